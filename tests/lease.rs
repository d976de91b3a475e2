//! The leader's lease table, driven with made-up instants: renewals, expiry, revoke deadlines,
//! and the rule that a new leader never expires a lease early.

use std::time::Duration;
use tenure::ids::{FencingToken, PartitionId, SessionId};
use tenure::lease::{Due, LeaseTable};
use tenure::ownership::{Command, Event, OwnershipState, Response, SecretHash};
use tokio::time::Instant;

const TTL: Duration = Duration::from_millis(1000);
const MS: Duration = Duration::from_millis(1);

fn state_with_two_sessions() -> (OwnershipState, SessionId, SessionId) {
    let mut s = OwnershipState::default();
    s.apply(1, &Command::Configure { partition_count: 4, lease_ttl_ms: 1000, max_revoking: None });
    let mut index = 1;
    // Each join, then the leader's placement after it.
    let mut join = |s: &mut OwnershipState, n: &str| {
        index += 1;
        let session =
            match s.apply(index, &Command::Join { name: n.into(), weight: 1, secret: SecretHash::of(n) }).0 {
                Response::Joined { session, .. } => session,
                r => panic!("{r:?}"),
            };
        tenure::planner::settle(s, &mut index, &Default::default());
        session
    };
    let a = join(&mut s, "a");
    let b = join(&mut s, "b");
    (s, a, b)
}

#[test]
fn a_new_leader_starts_every_lease_at_its_own_start() {
    let (state, a, b) = state_with_two_sessions();
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    table.reset(t0, &state);
    assert!(table.due(t0 + TTL - MS).is_empty(), "nothing expires before one full TTL");
    let due = table.due(t0 + TTL);
    assert_eq!(due.sessions, vec![a, b]);
    // Revoking partitions (b's join revoked half of a's) get the same fresh deadline.
    assert_eq!(due.revoking.len(), 2);
}

#[test]
fn renewals_extend_from_their_arrival_and_never_shorten() {
    let (state, a, b) = state_with_two_sessions();
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    table.reset(t0, &state);
    assert!(table.renew(a, t0 + 500 * MS).is_some());
    assert!(table.renew(a, t0 + 100 * MS).is_some(), "a late-arriving older renewal is accepted");
    let due = table.due(t0 + TTL + MS);
    assert_eq!(due.sessions, vec![b], "a runs until 1500 ms");
    assert!(table.due(t0 + 1499 * MS).sessions.contains(&b), "b stays due until its expiry is applied");
    assert!(table.due(t0 + 1500 * MS).sessions.contains(&a));
}

#[test]
fn a_session_reported_due_is_never_renewed() {
    let (state, a, _) = state_with_two_sessions();
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    table.reset(t0, &state);
    let due = table.due(t0 + TTL);
    assert!(due.sessions.contains(&a));
    assert!(table.renew(a, t0 + TTL - MS).is_none(), "a renewal racing the expiry decision loses");
    assert!(!table.renewable(a, t0));
    table.observe(t0 + TTL, &[Event::SessionEnded { session: a }]);
    assert!(!table.due(t0 + TTL * 5).sessions.contains(&a), "an applied expiry is not reported again");
}

#[test]
fn revoking_partitions_keep_the_deadline_they_had_when_revoked() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    let a = SessionId(1);
    table.observe(t0, &[Event::SessionStarted { session: a, name: "a".into() }]);
    let p = PartitionId(3);
    table.observe(t0 + 200 * MS, &[Event::Revoking { partition: p, session: a, token: FencingToken(2) }]);
    assert!(table.renew(a, t0 + 900 * MS).is_some());
    let due = table.due(t0 + TTL);
    assert_eq!(
        due,
        Due { sessions: vec![], revoking: vec![(p, a, FencingToken(2))], settle: None },
        "the revoked lease was not extended"
    );
    // Released and granted: no longer tracked, and the move latency is reported.
    table.observe(t0 + TTL, &[Event::Released { partition: p, session: a, token: FencingToken(2) }]);
    let moves = table.observe(
        t0 + TTL + 5 * MS,
        &[Event::Granted { partition: p, session: SessionId(2), token: FencingToken(9) }],
    );
    assert_eq!(moves, vec![TTL - 200 * MS + 5 * MS]);
    assert!(table.due(t0 + TTL * 3).revoking.is_empty());
}

/// The TTL change event a `SetLeaseTtl` at `changed_at` emits.
fn changed(ttl: Duration, ceiling: Duration, changed_at: u64) -> Event {
    Event::LeaseTtlChanged {
        lease_ttl_ms: ttl.as_millis() as u64,
        ceiling_ms: ceiling.as_millis() as u64,
        changed_at,
    }
}

#[test]
fn a_ttl_change_applies_to_renewals_from_now_on_and_moves_no_deadline_earlier() {
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    let a = SessionId(1);
    table.observe(t0, &[Event::SessionStarted { session: a, name: "a".into() }]);
    assert_eq!(table.renew(a, t0), Some(TTL));
    table.observe(t0, &[changed(TTL * 4, TTL * 4, 9)]);
    assert_eq!(table.ttl(), TTL * 4);
    // Each renewal says which TTL it was granted under: the worker is told the new one.
    assert_eq!(table.renew(a, t0 + MS), Some(TTL * 4));
    assert!(table.due(t0 + TTL * 4).sessions.is_empty(), "renewed under the new TTL");
    assert_eq!(table.due(t0 + TTL * 4 + MS).sessions, vec![a]);
    // A shorter TTL does not take back what was promised.
    let mut table = LeaseTable::new(TTL * 4);
    table.observe(t0, &[Event::SessionStarted { session: a, name: "a".into() }]);
    assert_eq!(table.renew(a, t0), Some(TTL * 4));
    table.observe(t0, &[changed(TTL, TTL * 4, 9)]);
    assert_eq!(table.renew(a, t0 + MS), Some(TTL));
    assert!(table.due(t0 + TTL * 4 - MS).sessions.is_empty(), "no deadline moves earlier");
}

/// A cluster whose TTL went from 1 s to 250 ms at the returned index, not yet settled.
fn shortened() -> (OwnershipState, SessionId, u64) {
    let (mut state, a, _) = state_with_two_sessions();
    let at = 100;
    assert_eq!(
        state.apply(at, &Command::SetLeaseTtl { lease_ttl_ms: 250 }).0,
        Response::LeaseTtlSet { was_ms: 1000 }
    );
    (state, a, at)
}

#[test]
fn a_new_leader_waits_out_the_longer_ttl_until_the_change_is_settled() {
    let t0 = Instant::now();
    let (state, a, at) = shortened();
    // A worker renewed just before the change was told 1 s. A new leader judges renewals by
    // 250 ms but expires nothing before 1 s from its start.
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    assert_eq!(table.ttl(), TTL / 4);
    assert_eq!(table.renew(a, t0 + MS), Some(TTL / 4));
    let due = table.due(t0 + TTL - MS);
    assert!(due.sessions.is_empty() && due.revoking.is_empty() && due.settle.is_none(), "{due:?}");
    // Once the ceiling has passed since its start, the change is due for settling.
    let due = table.due(t0 + TTL);
    assert_eq!(due.settle, Some(at));
    assert_eq!(due.sessions.len(), 2);
    // Settled: the next leader judges by 250 ms alone.
    let mut settled = state.clone();
    let (response, events) = settled.apply(at + 1, &Command::SettleLeaseTtl { changed_at: at });
    assert_eq!(response, Response::LeaseTtlSettled { settled: true });
    table.observe(t0 + TTL, &events);
    assert_eq!(table.due(t0 + TTL).settle, None);
    let mut next = LeaseTable::for_new_term(t0, &settled, TTL);
    assert!(next.due(t0 + TTL / 4 - MS).sessions.is_empty());
    assert_eq!(next.due(t0 + TTL / 4).sessions.len(), 2);
    assert_eq!(next.due(t0 + TTL / 4).settle, None);
}

#[test]
fn the_leader_that_applies_a_change_settles_it_one_ceiling_later() {
    let t0 = Instant::now();
    let (state, _, at) = shortened();
    let mut table = LeaseTable::new(TTL);
    table.reset(t0, &state_with_two_sessions().0);
    // The change is seen applied 50 ms in: a renewal answered just before it was told 1 s.
    table.observe(t0 + 50 * MS, &[changed(TTL / 4, TTL, at)]);
    assert_eq!(table.next_deadline(), Some(t0 + TTL), "the sessions' deadlines come first");
    assert_eq!(table.due(t0 + 50 * MS + TTL - MS).settle, None);
    assert_eq!(table.due(t0 + 50 * MS + TTL).settle, Some(at));
    assert_eq!(table.next_deadline(), Some(t0 + 50 * MS + TTL), "then the settling");
    // A second change before the first settled: only the latest is settled, a ceiling after it.
    table.observe(t0 + 500 * MS, &[changed(TTL / 2, TTL, at + 5)]);
    assert_eq!(table.due(t0 + 500 * MS + TTL - MS).settle, None);
    assert_eq!(table.due(t0 + 500 * MS + TTL).settle, Some(at + 5));
    // Settling the older change is refused by the state machine and changes nothing here.
    let mut state = state;
    state.apply(at + 5, &Command::SetLeaseTtl { lease_ttl_ms: 500 });
    let (response, events) = state.apply(at + 6, &Command::SettleLeaseTtl { changed_at: at });
    assert_eq!((response, events), (Response::LeaseTtlSettled { settled: false }, vec![]));
    assert_eq!(state.config().unwrap().ttl_ceiling_ms(), 1000);
}

#[test]
fn a_first_heartbeat_that_overtakes_the_sessions_start_is_renewed() {
    // The caller found the session in the applied state; the table has not seen it start yet.
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    let a = SessionId(7);
    assert!(table.renewable(a, t0));
    assert!(table.renew(a, t0).is_some());
    // Observing its start afterwards does not move the deadline the renewal set.
    table.observe(t0 + 300 * MS, &[Event::SessionStarted { session: a, name: "a".into() }]);
    assert!(table.due(t0 + TTL - MS).is_empty());
    assert_eq!(table.due(t0 + TTL).sessions, vec![a]);
}

#[test]
fn a_new_term_judges_by_the_clusters_ttl_whatever_the_nodes_flag_says() {
    let t0 = Instant::now();
    // A configured cluster (1 s TTL, from `state_with_two_sessions`): a node started with 4 s,
    // or with 250 ms, still judges by 1 s.
    let (state, a, _) = state_with_two_sessions();
    for flag in [Duration::from_secs(4), Duration::from_millis(250)] {
        let mut table = LeaseTable::for_new_term(t0, &state, flag);
        assert_eq!(table.ttl(), TTL);
        assert!(table.due(t0 + TTL - MS).is_empty());
        assert_eq!(table.due(t0 + TTL).sessions.len(), 2);
        assert!(!table.follow(state.config()), "already on the cluster's TTL");
    }
    // Before the configuration is applied, the table starts from the value the node proposes,
    // and takes the cluster's the moment the configuration is seen, once.
    let unconfigured = OwnershipState::default();
    let mut table = LeaseTable::for_new_term(t0, &unconfigured, Duration::from_secs(4));
    assert_eq!(table.ttl(), Duration::from_secs(4));
    assert!(!table.follow(unconfigured.config()));
    assert!(table.follow(state.config()));
    assert_eq!(table.ttl(), TTL);
    assert!(!table.follow(state.config()));
    // A session it meets from now on (a first heartbeat) runs on the cluster's TTL.
    assert!(table.renew(a, t0).is_some());
    assert!(table.due(t0 + TTL - MS).is_empty());
    assert_eq!(table.due(t0 + TTL).sessions, vec![a]);
}

#[test]
fn a_change_a_new_leader_applies_after_taking_over_holds_every_lease_to_its_ceiling() {
    // The previous leader applied a longer TTL and told workers of it; this node took over
    // before applying that entry, so it started on the old TTL. Once it applies the change,
    // every lease runs at least the new ceiling from its start.
    let t0 = Instant::now();
    let (state, a, _) = state_with_two_sessions();
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    table.observe(t0 + 30 * MS, &[changed(TTL * 3, TTL * 3, 50)]);
    let due = table.due(t0 + TTL * 3 - MS);
    assert!(due.sessions.is_empty() && due.revoking.is_empty(), "{due:?}");
    assert_eq!(table.due(t0 + TTL * 3).sessions.len(), 2);
    // On a leader that applied the change itself, long after its start, nothing moves.
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    assert_eq!(table.renew(a, t0 + TTL / 2), Some(TTL));
    table.observe(t0 + TTL / 2, &[changed(TTL / 2, TTL, 50)]);
    assert!(table.due(t0 + TTL - MS).sessions.is_empty());
    let due = table.due(t0 + TTL).sessions;
    assert!(due.len() == 1 && !due.contains(&a), "only the session not renewed: {due:?}");
    assert!(!table.due(t0 + TTL / 2 + TTL - MS).sessions.contains(&a));
    assert!(table.due(t0 + TTL / 2 + TTL).sessions.contains(&a));
}

#[test]
fn a_moved_partition_is_in_motion_until_a_renewal_of_its_new_owner_confirms_it() {
    let t0 = Instant::now();
    let (state, a, b) = state_with_two_sessions();
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    let p = PartitionId(0);
    let revoked = Event::Revoking { partition: p, session: a, token: FencingToken(2) };
    let released = Event::Released { partition: p, session: a, token: FencingToken(2) };
    let granted = Event::Granted { partition: p, session: b, token: FencingToken(9) };
    table.observe(t0, &[revoked]);
    table.observe(t0 + 10 * MS, &[released, granted.clone()]);
    assert_eq!(table.unconfirmed_moves(), 1, "granted, not yet renewed by b");
    // A renewal that arrived before the grant was seen confirms nothing; the old owner's
    // renewals never do.
    table.renew(b, t0 + 5 * MS);
    table.renew(a, t0 + 20 * MS);
    assert_eq!(table.unconfirmed_moves(), 1);
    table.renew(b, t0 + 20 * MS);
    assert_eq!(table.unconfirmed_moves(), 0, "b's renewal after the grant confirmed it");
    // A grant of an unowned partition was never in motion; a move lost before it was
    // confirmed, or its owner's end, takes it out of the count.
    let q = PartitionId(1);
    table.observe(t0 + 30 * MS, &[Event::Granted { partition: q, session: b, token: FencingToken(10) }]);
    assert_eq!(table.unconfirmed_moves(), 0);
    table.observe(t0 + 30 * MS, &[Event::Revoking { partition: p, session: b, token: FencingToken(9) }]);
    table.observe(
        t0 + 40 * MS,
        &[
            Event::Released { partition: p, session: b, token: FencingToken(9) },
            Event::Granted { partition: p, session: a, token: FencingToken(11) },
        ],
    );
    assert_eq!(table.unconfirmed_moves(), 1);
    table.observe(t0 + 50 * MS, &[Event::SessionEnded { session: a }]);
    assert_eq!(table.unconfirmed_moves(), 0);
}

#[test]
fn a_new_term_counts_the_moves_its_predecessor_may_not_have_seen_confirmed() {
    let t0 = Instant::now();
    let (mut state, a, b) = state_with_two_sessions();
    // b's join revoked two of a's partitions; a lets one go and it passes to b in that entry.
    let revoking: Vec<(PartitionId, FencingToken)> =
        state.owned_by(a).into_iter().filter(|(_, r)| r.revoking).map(|(p, r)| (p, r.token)).collect();
    assert_eq!(revoking.len(), 2);
    let (p, token) = revoking[0];
    let release = Command::Release {
        session: a,
        secret: SecretHash::of("a"),
        partitions: vec![p],
        tokens: vec![token],
    };
    let (response, _) = state.apply(100, &release);
    assert_eq!(response, Response::Released { partitions: vec![p] });
    let row = *state.partition(p).unwrap();
    assert_eq!((row.owner, row.moved), (Some(b), true), "the grant that ended the move is marked");

    // A leader taking over cannot know whether its predecessor saw b confirm it: in motion.
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    assert_eq!(table.unconfirmed_moves(), 1, "the moved grant; the other revoke counts as revoking");
    table.renew(a, t0 + MS);
    assert_eq!(table.unconfirmed_moves(), 1, "only the new owner's renewal confirms it");
    table.renew(b, t0 + MS);
    assert_eq!(table.unconfirmed_moves(), 0);

    // A partition given back of its owner's own accord and granted again ended no move.
    let (q, q_token) = state
        .owned_by(a)
        .into_iter()
        .find(|(_, r)| !r.revoking)
        .map(|(q, r)| (q, r.token))
        .expect("a keeps one");
    let release = Command::Release {
        session: a,
        secret: SecretHash::of("a"),
        partitions: vec![q],
        tokens: vec![q_token],
    };
    state.apply(101, &release);
    assert!(!state.partition(q).unwrap().moved);
    let mut index = 101;
    tenure::planner::settle(&mut state, &mut index, &Default::default());
    assert!(state.partition(q).unwrap().owner.is_some(), "granted again");
    let table = LeaseTable::for_new_term(t0, &state, TTL);
    assert_eq!(table.unconfirmed_moves(), 1, "still only the one move, until b renews in this term");
}

#[test]
fn a_new_leader_expires_nothing_until_it_has_applied_what_its_log_held() {
    // This node took over with entries up to 60 in its log, its state applied only to 40: the
    // previous leader's TTL change at 50, which workers were told of, is among the rest. Were
    // expiries judged before it is applied, the old 1 s TTL would take leases workers still
    // believe for 3 s.
    let t0 = Instant::now();
    let (state, _, _) = state_with_two_sessions();
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    table.hold_until_applied(60);
    table.applied(40);
    assert!(table.due(t0 + TTL * 10).is_empty(), "held while the log is not applied");
    // The change is applied (and stretches every lease), then the rest of the log.
    table.observe(t0 + TTL * 2, &[changed(TTL * 3, TTL * 3, 50)]);
    table.applied(59);
    assert!(table.due(t0 + TTL * 10).is_empty());
    table.applied(60);
    let due = table.due(t0 + TTL * 3 - MS);
    assert!(due.sessions.is_empty() && due.revoking.is_empty(), "{due:?}");
    assert_eq!(table.due(t0 + TTL * 3).sessions.len(), 2, "due by the TTL the change set");
    // A later index releases the hold too; a leader whose state was applied as far as its log
    // is not held at all.
    let mut table = LeaseTable::for_new_term(t0, &state, TTL);
    table.hold_until_applied(60);
    table.applied(75);
    assert_eq!(table.due(t0 + TTL).sessions.len(), 2);
}
