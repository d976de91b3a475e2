//! The replicated state machine at scale, without Raft around it: what one replica holds and
//! does with 1,000,000 partitions and thousands of workers. Every replica applies the same
//! entries, so these are per-node costs: the table's memory, the snapshot's size, what applying
//! a join, the leader's placement decision and a release costs (apply is O(what changes); only
//! the leader runs placement, O(P), and the log carries its decision), and what the leader does
//! per heartbeat (looks up what the session owns in the owner index: independent of P).
//!
//! The table is built directly in its balanced end state (placement run once over the whole
//! membership) rather than by replaying thousands of joins, which at this size would take
//! longer than the measurements themselves.

use super::{ms, Sample, Table};
use anyhow::{bail, Context, Result};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tenure::ids::{FencingToken, SessionId};
use tenure::ownership::{
    Command, Config, OwnershipState, PartitionRecord, Response, SecretHash, SessionRecord,
};
use tenure::placement::{place, Member};

/// The system allocator, counting the bytes currently allocated, so the table's memory is
/// measured exactly rather than read from the process's resident size (which earlier sections
/// of the run have already grown and the allocator reuses).
pub struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator, under the caller's contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above; `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

fn live_bytes() -> u64 {
    LIVE_BYTES.load(Ordering::Relaxed) as u64
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1 << 20) as f64)
}

/// A balanced table of `partitions` over `workers` sessions, every grant at token 1.
fn balanced(partitions: u32, workers: usize) -> OwnershipState {
    let members: Vec<Member> = (1..=workers as u64)
        .map(|s| Member { session: SessionId(s), name: format!("w{s}"), weight: 1 })
        .collect();
    let target = place(&members, &vec![None; partitions as usize]);
    let rows: Vec<PartitionRecord> = target
        .into_iter()
        .map(|owner| PartitionRecord {
            owner,
            token: FencingToken(1),
            revoking: false,
            next: None,
            moved: false,
        })
        .collect();
    let sessions: BTreeMap<SessionId, SessionRecord> = members
        .iter()
        .map(|m| {
            let record = SessionRecord {
                name: m.name.clone(),
                weight: 1,
                secret: SecretHash::of(&format!("secret-{}", m.session.0)),
                leaving: false,
            };
            (m.session, record)
        })
        .collect();
    let config =
        Config { partition_count: partitions, lease_ttl_ms: 5000, max_revoking: None, ttl_change: None };
    OwnershipState::from_parts(Some(config), rows, sessions, workers as u64)
}

fn timed_apply(state: &mut OwnershipState, index: u64, command: Command) -> Result<(Response, f64)> {
    let t = Instant::now();
    let (response, _events) = state.apply(index, &command);
    let took = ms(t.elapsed());
    if let Response::Rejected(r) = response {
        bail!("rejected: {r:?}");
    }
    Ok((response, took))
}

pub fn state_machine_scale(table: &mut Table, partitions: u32, workers: usize) -> Result<()> {
    let label = format!("P={partitions}, {workers} workers");
    let before = live_bytes();
    let mut state = balanced(partitions, workers);
    let after = live_bytes();
    table.figure(format!("{label}: heap held by one replica's table"), mib(after.saturating_sub(before)));
    let t = Instant::now();
    let snapshot = tenure::store::encode_table_snapshot(&state);
    let encode = t.elapsed();
    table.figure(format!("{label}: snapshot size (binary)"), mib(snapshot.len() as u64));
    table.figure(format!("{label}: snapshot encode"), format!("{:.0} ms", ms(encode)));
    drop(snapshot);

    // One membership change and the releases it causes, at full size.
    let mut index = 10;
    let (joined, join_ms) = timed_apply(
        &mut state,
        index,
        Command::Join { name: "newcomer".into(), weight: 1, secret: SecretHash::of("s") },
    )?;
    let Response::Joined { session: newcomer, .. } = joined else { bail!("unexpected answer to a join") };
    table.figure(format!("{label}: applying one join (it decides nothing)"), format!("{join_ms:.2} ms"));
    // The leader decides where the newcomer's share comes from (a pass over the table, on the
    // leader only, outside the state lock's write side); every replica applies the decision.
    let t = Instant::now();
    let decision = tenure::planner::plan(&state, &Default::default()).context("a join needs a decision")?;
    table.figure(
        format!("{label}: leader deciding the join's placement (not in apply)"),
        format!("{:.1} ms", ms(t.elapsed())),
    );
    index += 1;
    let (_, place_ms) = timed_apply(&mut state, index, decision)?;
    table.figure(format!("{label}: applying the join's placement decision"), format!("{place_ms:.2} ms"));
    let revoked: Vec<_> = state
        .sessions()
        .keys()
        .filter(|s| **s != newcomer)
        .filter_map(|s| {
            let mine: Vec<_> =
                state.owned_by(*s).into_iter().filter(|(_, r)| r.revoking).map(|(p, _)| p).collect();
            (!mine.is_empty()).then_some((*s, mine))
        })
        .collect();
    let moving: usize = revoked.iter().map(|(_, v)| v.len()).sum();
    let mut release_ms = Vec::new();
    // Every owner gives its share up (the first 20 releases timed), so the table settles.
    for (n, (session, mine)) in revoked.into_iter().enumerate() {
        index += 1;
        let secret = SecretHash::of(&format!("secret-{}", session.0));
        let (_, took) = timed_apply(
            &mut state,
            index,
            Command::Release { tokens: vec![], session, secret, partitions: mine },
        )?;
        if n < 20 {
            release_ms.push(std::time::Duration::from_secs_f64(took / 1000.0));
        }
    }
    let release_ms = Sample::new(release_ms);
    table
        .figure(format!("{label}: partitions a join moves (balance: P / (workers + 1))"), moving.to_string());
    table.figure(
        format!("{label}: applying one release p50 / max (each partition to its named receiver)"),
        format!("{:.2} / {:.2} ms", ms(release_ms.pct(0.5)), ms(release_ms.pct(1.0))),
    );

    // The leader decides again after every entry that changed ownership or membership; on a
    // table with nothing to move that pass is all it costs.
    tenure::planner::settle(&mut state, &mut index, &Default::default());
    if state.revoking_count() > 0 || state.unowned_count() > 0 {
        bail!("the table did not settle");
    }
    let t = Instant::now();
    let nothing = tenure::planner::plan(&state, &Default::default());
    let idle = t.elapsed();
    if nothing.is_some() {
        bail!("a settled table still needs a decision");
    }
    table.figure(
        format!("{label}: leader deciding on a settled table (nothing to move)"),
        format!("{:.1} ms", ms(idle)),
    );

    // The status page's map of the whole table, which a page open on a node reads every 2 s.
    let t = Instant::now();
    let ranges = tenure::server::status_page::aggregate(&state, partitions);
    let json = serde_json::to_string(&ranges)?;
    table.figure(
        format!("{label}: status page map ({} ranges, {} KiB of JSON)", ranges.len(), json.len() / 1024),
        format!("{:.1} ms", ms(t.elapsed())),
    );

    // A crash: the expiry takes the session's partitions, the leader grants them elsewhere.
    let victim = *state.sessions().keys().next().context("a session")?;
    index += 1;
    let (_, expire_ms) = timed_apply(&mut state, index, Command::Expire { sessions: vec![victim] })?;
    let t = Instant::now();
    let decision = tenure::planner::plan(&state, &Default::default()).context("a crash needs a decision")?;
    let decide_ms = ms(t.elapsed());
    index += 1;
    let (_, regrant_ms) = timed_apply(&mut state, index, decision)?;
    table.figure(
        format!("{label}: a crash: applying the expiry / leader deciding / applying the grants"),
        format!("{expire_ms:.2} / {decide_ms:.1} / {regrant_ms:.2} ms"),
    );

    // What the leader does per heartbeat: the session's rows from the owner index.
    let mut per_beat = Vec::new();
    for session in state.sessions().keys().take(2000).copied().collect::<Vec<_>>() {
        let t = Instant::now();
        let owned = state.owned_by(session);
        per_beat.push(t.elapsed());
        std::hint::black_box(owned);
    }
    let per_beat = Sample::new(per_beat);
    table.figure(
        format!("{label}: finding a session's {} rows per heartbeat p50", partitions as usize / workers),
        format!("{:.1} us", per_beat.pct(0.5).as_secs_f64() * 1e6),
    );
    Ok(())
}

/// From an empty table to every partition owned: the first worker joins a cluster of
/// `partitions`, and the leader grants the whole table in commands of at most
/// [`tenure::planner::MAX_MOVES_PER_COMMAND`] moves. Reports how many commands that took, the
/// slowest apply among them (the cost of the largest single move command) and the leader's
/// time deciding, which includes the pass that finds the table settled.
pub fn bootstrap(table: &mut Table, partitions: u32) -> Result<()> {
    let label = format!("P={partitions}");
    let mut state = OwnershipState::default();
    let mut index = 1;
    timed_apply(
        &mut state,
        index,
        Command::Configure { partition_count: partitions, lease_ttl_ms: 5000, max_revoking: None },
    )?;
    index += 1;
    timed_apply(
        &mut state,
        index,
        Command::Join { name: "first".into(), weight: 1, secret: SecretHash::of("s") },
    )?;
    let mut applies = Vec::new();
    let mut deciding = std::time::Duration::ZERO;
    // As the leader does: one decision, split into commands proposed in order.
    loop {
        let t = Instant::now();
        let decision = tenure::planner::plan_all(&state, &Default::default());
        deciding += t.elapsed();
        if decision.is_empty() {
            break;
        }
        for command in decision {
            index += 1;
            let (_, took) = timed_apply(&mut state, index, command)?;
            applies.push(std::time::Duration::from_secs_f64(took / 1000.0));
        }
    }
    let applies = Sample::new(applies);
    table.figure(
        format!("{label}: bootstrap, first join: grant commands / slowest apply / leader deciding in all"),
        format!("{} / {:.1} ms / {:.0} ms", applies.0.len(), ms(applies.max()), ms(deciding)),
    );
    Ok(())
}
