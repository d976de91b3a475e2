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
    assert!(table.renew(a, t0 + 500 * MS));
    assert!(table.renew(a, t0 + 100 * MS), "a late-arriving older renewal is accepted");
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
    assert!(!table.renew(a, t0 + TTL - MS), "a renewal racing the expiry decision loses");
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
    assert!(table.renew(a, t0 + 900 * MS));
    let due = table.due(t0 + TTL);
    assert_eq!(
        due,
        Due { sessions: vec![], revoking: vec![(p, a, FencingToken(2))] },
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

#[test]
fn the_cluster_ttl_applies_to_renewals_from_now_on_and_moves_no_deadline_earlier() {
    // The leader's table starts with a guess (no configuration applied yet) and follows the
    // replicated TTL once it is known.
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    let a = SessionId(1);
    table.observe(t0, &[Event::SessionStarted { session: a, name: "a".into() }]);
    assert!(table.renew(a, t0));
    table.set_ttl(TTL * 4);
    assert_eq!(table.ttl(), TTL * 4);
    assert!(table.renew(a, t0 + MS));
    assert!(table.due(t0 + TTL * 4).is_empty(), "renewed under the cluster's TTL");
    assert_eq!(table.due(t0 + TTL * 4 + MS).sessions, vec![a]);
    // A shorter TTL does not take back what was promised.
    let mut table = LeaseTable::new(TTL * 4);
    table.observe(t0, &[Event::SessionStarted { session: a, name: "a".into() }]);
    assert!(table.renew(a, t0));
    table.set_ttl(TTL);
    assert!(table.renew(a, t0 + MS));
    assert!(table.due(t0 + TTL * 4 - MS).is_empty(), "no deadline moves earlier");
}

#[test]
fn a_first_heartbeat_that_overtakes_the_sessions_start_is_renewed() {
    // The caller found the session in the applied state; the table has not seen it start yet.
    let t0 = Instant::now();
    let mut table = LeaseTable::new(TTL);
    let a = SessionId(7);
    assert!(table.renewable(a, t0));
    assert!(table.renew(a, t0));
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
        assert!(!table.adopt(state.config()), "already on the cluster's TTL");
    }
    // Before the configuration is applied, the table starts from the value the node proposes,
    // and takes the cluster's the moment the configuration is seen, once.
    let unconfigured = OwnershipState::default();
    let mut table = LeaseTable::for_new_term(t0, &unconfigured, Duration::from_secs(4));
    assert_eq!(table.ttl(), Duration::from_secs(4));
    assert!(!table.adopt(unconfigured.config()));
    assert!(table.adopt(state.config()));
    assert_eq!(table.ttl(), TTL);
    assert!(!table.adopt(state.config()));
    // A session it meets from now on (a first heartbeat) runs on the cluster's TTL.
    assert!(table.renew(a, t0));
    assert!(table.due(t0 + TTL - MS).is_empty());
    assert_eq!(table.due(t0 + TTL).sessions, vec![a]);
}
