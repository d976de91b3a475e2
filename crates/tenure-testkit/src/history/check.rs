//! The checker: one function per invariant, each returning the first violations it finds.

use super::{Committed, Decision, History, WorkerOp};
use crate::ids::{FencingToken, PartitionId, SessionId};
use std::collections::{BTreeMap, BTreeSet};

/// How many violations each verdict keeps: the first ones are what a reader needs.
const KEEP: usize = 5;

/// The outcome of one invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub invariant: &'static str,
    /// The first violating events, described; empty means it held.
    pub violations: Vec<String>,
    /// How many violations there were in all.
    pub violation_count: usize,
    /// Why the invariant could not be judged, if it could not (say, no final table was read).
    pub skipped: Option<&'static str>,
}

impl Verdict {
    /// A verdict with no violations yet, for a run that judges an invariant of its own.
    pub fn new(invariant: &'static str) -> Verdict {
        Verdict { invariant, violations: Vec::new(), violation_count: 0, skipped: None }
    }

    pub fn violation(&mut self, what: String) {
        self.violation_count += 1;
        if self.violations.len() < KEEP {
            self.violations.push(what);
        }
    }

    fn skip(mut self, why: &'static str) -> Verdict {
        self.skipped = Some(why);
        self
    }

    pub fn passed(&self) -> bool {
        self.violation_count == 0
    }
}

/// Every verdict of one history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub verdicts: Vec<Verdict>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.verdicts.iter().all(Verdict::passed)
    }

    /// The invariants that were violated.
    pub fn failed(&self) -> Vec<&'static str> {
        self.verdicts.iter().filter(|v| !v.passed()).map(|v| v.invariant).collect()
    }

    pub fn violation_count(&self) -> usize {
        self.verdicts.iter().map(|v| v.violation_count).sum()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for v in &self.verdicts {
            match (&v.skipped, v.passed()) {
                (Some(why), _) => writeln!(f, "  skip  {}: {why}", v.invariant)?,
                (None, true) => writeln!(f, "  pass  {}", v.invariant)?,
                (None, false) => {
                    writeln!(f, "  FAIL  {} ({} violations), first:", v.invariant, v.violation_count)?;
                    for what in &v.violations {
                        writeln!(f, "          {what}")?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Judges a history against every invariant.
pub fn check(history: &History) -> Report {
    let log = agreed_log(history);
    Report {
        verdicts: vec![
            complete(history),
            replicas_agree(&log.disagreements),
            token_monotonicity(&log.entries),
            one_owner(&log.entries),
            one_believer(history),
            belief_ends_before_the_grant(history),
            fencing(history),
            refusals_are_stale(history),
            durability(history, &log.entries),
            liveness(history),
            balance(history),
        ],
    }
}

/// The coordinator's decisions once per log index, in log order, and the indexes at which
/// replicas disagreed.
struct AgreedLog {
    entries: Vec<Committed>,
    disagreements: Vec<String>,
}

fn agreed_log(history: &History) -> AgreedLog {
    // index -> node -> that node's decisions at the index, in the order it applied them.
    let mut by_index: BTreeMap<u64, BTreeMap<u64, Vec<&Committed>>> = BTreeMap::new();
    for c in &history.coordinator {
        by_index.entry(c.index).or_default().entry(c.node).or_default().push(c);
    }
    let mut entries = Vec::new();
    let mut disagreements = skipped_entries(history, &by_index);
    for (index, nodes) in by_index {
        // A replica that applied an entry twice (a restart replaying its log) reports it twice;
        // what counts is the set of decisions.
        let mut views = nodes.iter().map(|(node, cs)| {
            let decisions: BTreeSet<(u32, u64, u64, String)> = cs
                .iter()
                .map(|c| (c.partition.0, c.session.0, c.token.0, format!("{:?}", c.decision)))
                .collect();
            (*node, decisions, cs)
        });
        let (first_node, first, first_records) = views.next().expect("an index has a record");
        for (node, decisions, _) in views {
            if decisions != first {
                disagreements.push(format!(
                    "index {index}: node {first_node} applied {first:?}, node {node} applied {decisions:?}"
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for c in first_records.iter() {
            if seen.insert((c.partition, c.session, c.token, format!("{:?}", c.decision))) {
                entries.push((*c).clone());
            }
        }
    }
    AgreedLog { entries, disagreements }
}

/// Indexes a replica skipped: another replica recorded decisions there, and this one recorded
/// entries before and after it, with no snapshot or fresh start of its record covering it in
/// between. (Comparing replicas only where both recorded would let a replica that skipped an
/// entry pass.)
fn skipped_entries(
    history: &History,
    by_index: &BTreeMap<u64, BTreeMap<u64, Vec<&Committed>>>,
) -> Vec<String> {
    let mut span: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for c in &history.coordinator {
        let s = span.entry(c.node).or_insert((c.index, c.index));
        *s = (s.0.min(c.index), s.1.max(c.index));
    }
    let mut skipped = Vec::new();
    for (index, nodes) in by_index {
        for (node, (first, last)) in &span {
            let inside = first < index && index < last;
            let covered = history.resumed.iter().any(|r| r.covers(*node, *index));
            if inside && !nodes.contains_key(node) && !covered {
                let by: Vec<&u64> = nodes.keys().collect();
                skipped.push(format!(
                    "index {index}: node {node} applied entries {first}..={last} but not this one, which nodes {by:?} applied"
                ));
            }
        }
    }
    skipped
}

/// The history covers what it claims to: no recorder missed entries, and a final table, when
/// read, has exactly one row for each of the run's partitions (a table missing rows would pass
/// liveness, balance and durability for them without a look).
fn complete(history: &History) -> Verdict {
    let mut v = Verdict::new("the history is complete");
    for gap in &history.gaps {
        v.violation(gap.clone());
    }
    if !history.final_table.is_empty() {
        let rows: BTreeSet<u32> = history.final_table.iter().map(|r| r.partition.0).collect();
        let want = history.partition_count as usize;
        if rows.len() != history.final_table.len()
            || rows.len() != want
            || rows.iter().any(|p| *p as usize >= want)
        {
            v.violation(format!(
                "the final table has {} rows for {} distinct partitions; the run has {want}",
                history.final_table.len(),
                rows.len()
            ));
        }
    }
    v
}

fn replicas_agree(disagreements: &[String]) -> Verdict {
    let mut v = Verdict::new("replicas apply the same decisions at the same index");
    for d in disagreements {
        v.violation(d.clone());
    }
    v
}

/// Tokens of grants strictly increase per partition, in log order, and are never reused.
fn token_monotonicity(log: &[Committed]) -> Verdict {
    let mut v = Verdict::new("tokens strictly increase per partition");
    let mut last: BTreeMap<PartitionId, &Committed> = BTreeMap::new();
    for c in log.iter().filter(|c| c.decision == Decision::Granted) {
        if let Some(prev) = last.get(&c.partition) {
            if c.token <= prev.token {
                v.violation(format!(
                    "{} granted to session {} with token {} at index {}, after token {} at index {}",
                    c.partition, c.session.0, c.token, c.index, prev.token, prev.index
                ));
            }
        }
        last.insert(c.partition, c);
    }
    v
}

/// In log order (the coordinator's clock), a partition is granted only when nobody holds it,
/// and only its holder's grant is revoked, released or lost.
fn one_owner(log: &[Committed]) -> Verdict {
    let mut v = Verdict::new("one owner at a time");
    let mut holder: BTreeMap<PartitionId, (SessionId, FencingToken, u64)> = BTreeMap::new();
    for c in log {
        let current = holder.get(&c.partition).copied();
        match c.decision {
            Decision::Granted => {
                if let Some((session, token, index)) = current {
                    v.violation(format!(
                        "{} granted to session {} (token {}) at index {} while session {} held it \
                         with token {} since index {}",
                        c.partition, c.session.0, c.token, c.index, session.0, token, index
                    ));
                }
                holder.insert(c.partition, (c.session, c.token, c.index));
            }
            Decision::Revoking | Decision::Released | Decision::Lost => {
                if current.map(|(s, t, _)| (s, t)) != Some((c.session, c.token)) {
                    v.violation(format!(
                        "{:?} of {} for session {} token {} at index {}, but the holder was {:?}",
                        c.decision,
                        c.partition,
                        c.session.0,
                        c.token,
                        c.index,
                        current.map(|(s, t, _)| (s.0, t.0))
                    ));
                }
                if c.decision != Decision::Revoking {
                    holder.remove(&c.partition);
                }
            }
        }
    }
    v
}

/// At any instant on the shared clock, at most one worker believes it holds a partition: the
/// belief intervals of different grants never overlap.
///
/// A grant can be believed several times over (a lease that ran out locally and came back), so
/// each grant's records are read in time order: an `Acquired` or a first belief opens an
/// interval, each later belief may stretch it, and a revoke, loss or release closes it at once.
fn one_believer(history: &History) -> Verdict {
    let mut v = Verdict::new("one believer at any instant");
    struct Interval<'a> {
        from: u64,
        until: u64,
        session: SessionId,
        token: FencingToken,
        worker: &'a str,
    }
    let mut by_grant: BTreeMap<(PartitionId, SessionId, FencingToken), Vec<&super::WorkerRecord>> =
        BTreeMap::new();
    for r in &history.workers {
        by_grant.entry((r.partition, r.session, r.token)).or_default().push(r);
    }
    let mut by_partition: BTreeMap<PartitionId, Vec<Interval>> = BTreeMap::new();
    for ((p, session, token), mut records) in by_grant {
        records.sort_by_key(|r| {
            (r.start_ns, matches!(r.op, WorkerOp::Revoked | WorkerOp::Lost | WorkerOp::Released))
        });
        let mut open: Option<Interval> = None;
        let intervals = by_partition.entry(p).or_default();
        for r in records {
            match (r.op, r.believed_until_ns) {
                (WorkerOp::Revoked | WorkerOp::Lost | WorkerOp::Released, _) => {
                    if let Some(mut i) = open.take() {
                        i.until = i.until.min(r.start_ns);
                        intervals.push(i);
                    }
                }
                (_, Some(until)) if until > r.start_ns => match open.as_mut() {
                    Some(i) => i.until = i.until.max(until),
                    None => {
                        open = Some(Interval { from: r.start_ns, until, session, token, worker: &r.worker })
                    }
                },
                _ => {}
            }
        }
        intervals.extend(open);
    }
    for (p, mut ws) in by_partition {
        ws.retain(|i| i.until > i.from);
        ws.sort_by_key(|w| (w.from, w.until));
        // Compare each interval with the one reaching furthest among those that began before it.
        let mut reach: Option<&Interval> = None;
        for b in &ws {
            let a = match reach {
                Some(a) if a.until >= b.until => a,
                _ => {
                    let previous = reach;
                    reach = Some(b);
                    match previous {
                        Some(a) => a,
                        None => continue,
                    }
                }
            };
            if b.from < a.until && (a.session, a.token) != (b.session, b.token) {
                v.violation(format!(
                    "{p}: {} (session {}, token {}) believed it until {} ns, but {} (session {}, token {}) \
                     believed it from {} ns",
                    a.worker, a.session.0, a.token, a.until, b.worker, b.session.0, b.token, b.from
                ));
            }
        }
    }
    v
}

/// A worker never acts believing in a grant after the coordinator ended it: belief ends before
/// the message that gives a partition away (a release, a leave) is sent, and before the lease
/// the leader judges runs out. The evidence is positive: an operation that began, believing,
/// after a replica was seen applying the grant's release or loss. Decisions read back from a
/// log after the run carry no time and are not used here.
fn belief_ends_before_the_grant(history: &History) -> Verdict {
    let mut v = Verdict::new("no belief outlives its grant");
    let mut ended: BTreeMap<(PartitionId, SessionId, FencingToken), &Committed> = BTreeMap::new();
    for c in &history.coordinator {
        if c.at_ns > 0 && matches!(c.decision, Decision::Released | Decision::Lost) {
            let seen = ended.entry((c.partition, c.session, c.token)).or_insert(c);
            if c.at_ns < seen.at_ns {
                *seen = c;
            }
        }
    }
    for r in &history.workers {
        let believing = r.believed_until_ns.is_some_and(|until| until > r.start_ns);
        if !believing || !matches!(r.op, WorkerOp::Acquired | WorkerOp::Wrote | WorkerOp::Refused) {
            continue;
        }
        if let Some(end) = ended.get(&(r.partition, r.session, r.token)) {
            if r.start_ns > end.at_ns {
                v.violation(format!(
                    "{} ({:?} at {} ns) believed {} under token {} (session {}), which node {} saw {:?} \
                     at index {} at {} ns",
                    r.worker,
                    r.op,
                    r.start_ns,
                    r.partition,
                    r.token,
                    r.session.0,
                    end.node,
                    end.decision,
                    end.index,
                    end.at_ns
                ));
            }
        }
    }
    v
}

/// Once the store accepted token t for a partition, it never accepts a lower token for it.
fn fencing(history: &History) -> Verdict {
    let mut v = Verdict::new("the store never accepts a lower token after a higher one");
    let mut store = history.store.clone();
    store.sort_by_key(|r| r.seq);
    let mut highest: BTreeMap<PartitionId, (FencingToken, u64)> = BTreeMap::new();
    for r in store.iter().filter(|r| r.accepted) {
        match highest.get(&r.partition) {
            Some((h, seq)) if r.token < *h => v.violation(format!(
                "{}: accepted token {} at #{} after accepting token {} at #{}",
                r.partition, r.token, r.seq, h, seq
            )),
            Some((h, _)) if r.token == *h => {}
            _ => {
                highest.insert(r.partition, (r.token, r.seq));
            }
        }
    }
    v
}

/// The store refuses a write only when it had accepted a higher token for the partition: a
/// store that turned away valid writes would look safe while doing nothing.
fn refusals_are_stale(history: &History) -> Verdict {
    let mut v = Verdict::new("the store refuses only stale tokens");
    let mut store = history.store.clone();
    store.sort_by_key(|r| r.seq);
    let mut highest: BTreeMap<PartitionId, FencingToken> = BTreeMap::new();
    for r in &store {
        let seen = highest.get(&r.partition).copied();
        if r.accepted {
            highest.insert(r.partition, seen.map_or(r.token, |h| h.max(r.token)));
        } else if seen.is_none_or(|h| r.token >= h) {
            v.violation(format!(
                "{}: refused token {} at #{} when the highest it had accepted was {:?}",
                r.partition,
                r.token,
                r.seq,
                seen.map(|h| h.0)
            ));
        }
    }
    v
}

/// Every grant a worker was told about is in the committed log, and the final table is what the
/// log says it should be: restarts lost no acknowledged grant.
fn durability(history: &History, log: &[Committed]) -> Verdict {
    let mut v = Verdict::new("no acknowledged grant is lost");
    let granted: BTreeSet<(PartitionId, SessionId, FencingToken)> = log
        .iter()
        .filter(|c| c.decision == Decision::Granted)
        .map(|c| (c.partition, c.session, c.token))
        .collect();
    // Every token the store accepted for a partition was granted for it by a committed entry.
    let tokens: BTreeSet<(PartitionId, FencingToken)> = granted.iter().map(|(p, _, t)| (*p, *t)).collect();
    for r in history.store.iter().filter(|r| r.accepted && r.token.0 > 0) {
        if !tokens.contains(&(r.partition, r.token)) {
            v.violation(format!(
                "the store accepted token {} for {} at #{}, which no committed entry granted",
                r.token, r.partition, r.seq
            ));
        }
    }
    for r in history.workers.iter().filter(|r| r.op == WorkerOp::Acquired) {
        if !granted.contains(&(r.partition, r.session, r.token)) {
            v.violation(format!(
                "{} acquired {} with token {} (session {}), which no committed entry granted",
                r.worker, r.partition, r.token, r.session.0
            ));
        }
    }
    if history.final_table.is_empty() {
        return v;
    }
    let mut expected: BTreeMap<PartitionId, Option<(SessionId, FencingToken)>> = BTreeMap::new();
    for c in log {
        match c.decision {
            Decision::Granted => {
                expected.insert(c.partition, Some((c.session, c.token)));
            }
            Decision::Released | Decision::Lost => {
                expected.insert(c.partition, None);
            }
            Decision::Revoking => {}
        }
    }
    for row in &history.final_table {
        let want = expected.get(&row.partition).copied().flatten();
        let have = row.owner.map(|s| (s, row.token));
        if want != have {
            v.violation(format!(
                "{}: the final table says {:?}, the committed log says {:?}",
                row.partition,
                have.map(|(s, t)| (s.0, t.0)),
                want.map(|(s, t)| (s.0, t.0))
            ));
        }
    }
    v
}

/// After the faults heal, every partition is owned again within the stated bound.
fn liveness(history: &History) -> Verdict {
    let v = Verdict::new("every partition owned again within the bound after the faults heal");
    if history.final_table.is_empty() {
        return v.skip("no final table was read");
    }
    let mut v = v;
    match history.recovered_after_ms {
        None => v.violation("the table never became fully owned after the last fault healed".into()),
        Some(ms) if ms > history.liveness_bound_ms => v.violation(format!(
            "fully owned {ms} ms after the last fault healed; the bound is {} ms",
            history.liveness_bound_ms
        )),
        Some(_) => {}
    }
    for row in &history.final_table {
        let live = row.owner.is_some_and(|s| history.live_sessions.values().any(|l| *l == s));
        if !live {
            v.violation(format!("{} is not owned by a live session at the end", row.partition));
        }
    }
    v
}

/// Once stable, live workers' counts differ by at most one.
fn balance(history: &History) -> Verdict {
    let v = Verdict::new("balance within one once stable");
    if history.final_table.is_empty() || history.live_sessions.is_empty() {
        return v.skip("no final table was read");
    }
    let mut v = v;
    let mut counts: BTreeMap<SessionId, usize> = history.live_sessions.values().map(|s| (*s, 0)).collect();
    for row in &history.final_table {
        if let Some(c) = row.owner.and_then(|s| counts.get_mut(&s)) {
            *c += 1;
        }
    }
    let (min, max) = (counts.values().min().copied(), counts.values().max().copied());
    if let (Some(min), Some(max)) = (min, max) {
        if max - min > 1 {
            v.violation(format!("owned counts per live session {counts:?} differ by {}", max - min));
        }
    }
    v
}
