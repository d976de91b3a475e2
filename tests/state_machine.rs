//! Scenario tests of the pure ownership state machine. Each test is a short story: commands at
//! log indexes in, responses, events and the table out.

use tenure::ids::{FencingToken, PartitionId, SessionId};
use tenure::ownership::{
    Command, Config, Event, Grant, LostReason, OwnershipState, Rejection, Response, Revoke, SecretHash,
    TtlChange,
};
use tenure::planner::{self, Rules};

/// A state machine with a log index counter, so stories read as a sequence of commits.
struct Story {
    state: OwnershipState,
    index: u64,
}

impl Story {
    fn new(partitions: u32) -> Story {
        let mut story = Story { state: OwnershipState::default(), index: 0 };
        let (r, _) = story.commit(Command::Configure {
            partition_count: partitions,
            lease_ttl_ms: 1000,
            max_revoking: None,
        });
        assert_eq!(r, Response::Configured);
        story
    }

    /// Commits a command, then what the leader decides after it (placement, until the table
    /// is where placement wants it), as a leader with nothing else to do would. The response is
    /// the command's; the events are those of every entry, in order.
    fn commit(&mut self, command: Command) -> (Response, Vec<Event>) {
        let (response, mut events) = self.commit_alone(command);
        events.extend(planner::settle(&mut self.state, &mut self.index, &Rules::default()));
        (response, events)
    }

    /// Commits one entry and nothing after it.
    fn commit_alone(&mut self, command: Command) -> (Response, Vec<Event>) {
        self.index += 1;
        self.state.apply(self.index, &command)
    }

    fn join(&mut self, name: &str) -> (SessionId, SecretHash) {
        let secret = SecretHash::of(&format!("secret-of-{name}"));
        match self.commit(Command::Join { name: name.into(), weight: 1, secret }).0 {
            Response::Joined { session, .. } => (session, secret),
            other => panic!("join failed: {other:?}"),
        }
    }

    /// w1 and w2 joined and balanced: w2's half released by w1 and granted to w2.
    fn balanced_pair(partitions: u32) -> (Story, (SessionId, SecretHash), (SessionId, SecretHash)) {
        let mut s = Story::new(partitions);
        let (w1, secret1) = s.join("w1");
        let w2 = s.join("w2");
        let partitions = s.revoking(w1);
        s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions });
        (s, (w1, secret1), w2)
    }

    /// The table is what `before` held (the change list aside).
    fn unchanged_since(&self, before: &OwnershipState) -> bool {
        let mut after = self.state.clone();
        after.take_changes();
        let mut expected = before.clone();
        expected.take_changes();
        after == expected
    }

    fn owned(&self, s: SessionId) -> Vec<u32> {
        self.state.owned_by(s).into_iter().map(|(p, _)| p.0).collect()
    }

    fn revoking(&self, s: SessionId) -> Vec<PartitionId> {
        self.state.owned_by(s).into_iter().filter(|(_, r)| r.revoking).map(|(p, _)| p).collect()
    }

    fn token(&self, p: u32) -> FencingToken {
        self.state.partition(PartitionId(p)).unwrap().token
    }

    /// Checks the table's invariants after every step of a story.
    fn check(&self) {
        for (p, r) in self.state.partitions().iter().enumerate() {
            if let Some(owner) = r.owner {
                assert!(self.state.session(owner).is_some(), "p{p} is owned by dead session {owner}");
                assert!(r.token.0 > 0 && r.token.0 <= self.index);
            }
        }
        // The derived counts and the owner index answer exactly what a scan of the table does.
        let rows = self.state.partitions();
        assert_eq!(self.state.unowned_count(), rows.iter().filter(|r| r.owner.is_none()).count());
        assert_eq!(self.state.revoking_count(), rows.iter().filter(|r| r.revoking).count());
        for session in self.state.sessions().keys() {
            let scanned: Vec<u32> = (0..self.state.partitions().len() as u32)
                .filter(|p| self.state.partition(PartitionId(*p)).unwrap().owner == Some(*session))
                .collect();
            assert_eq!(self.owned(*session), scanned, "owner index of session {session}");
            // The name index answers what a scan of the sessions does.
            let name = &self.state.session(*session).unwrap().name;
            let named: Vec<SessionId> =
                self.state.sessions().iter().filter(|(_, r)| &r.name == name).map(|(s, _)| *s).collect();
            assert_eq!(self.state.sessions_named(name).collect::<Vec<_>>(), named, "name index of {name}");
        }
    }
}

#[test]
fn first_worker_gets_every_partition_under_the_join_index() {
    let mut s = Story::new(8);
    let (w1, _) = s.join("w1");
    assert_eq!(s.owned(w1), (0..8).collect::<Vec<_>>());
    for p in 0..8 {
        assert_eq!(s.token(p), FencingToken(s.index), "token is the index of the granting entry");
    }
    s.check();
}

#[test]
fn a_join_revokes_only_what_the_newcomer_needs_and_the_release_grants_it() {
    let mut s = Story::new(8);
    let (w1, secret1) = s.join("w1");
    let (w2, _) = s.join("w2");
    let revoking = s.revoking(w1);
    assert_eq!(revoking.len(), 4, "half moves to the newcomer");
    assert!(s.owned(w2).is_empty(), "nothing is granted before the old owner lets go");
    let before: Vec<_> = revoking.iter().map(|p| s.token(p.0)).collect();

    // The release alone, with no decision after it: the revoke named the receiver, so the
    // entry that lets go also grants (a planned move is two commits).
    let (r, events) = s.commit_alone(Command::Release {
        tokens: vec![],
        session: w1,
        secret: secret1,
        partitions: revoking.clone(),
    });
    assert_eq!(r, Response::Released { partitions: revoking.clone() });
    let granted: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Granted { partition, session, token } => Some((*partition, *session, *token)),
            _ => None,
        })
        .collect();
    assert_eq!(granted.len(), 4);
    for ((p, session, token), old) in granted.iter().zip(before) {
        assert_eq!(*session, w2);
        assert!(*token > old, "{p}: new token {token} above old {old}");
    }
    assert_eq!(s.owned(w1).len(), 4);
    assert_eq!(s.owned(w2).len(), 4);
    s.check();
}

#[test]
fn an_expired_session_loses_its_partitions_and_they_are_granted_again() {
    let (mut s, (w1, _), (w2, secret2)) = Story::balanced_pair(6);
    let lost_partitions = s.owned(w2);
    let untouched: Vec<_> = s.owned(w1).iter().map(|&p| (p, s.token(p))).collect();

    let (r, events) = s.commit(Command::Expire { sessions: vec![w2] });
    assert_eq!(r, Response::Expired { partitions: 3 });
    assert!(events.contains(&Event::SessionEnded { session: w2 }));
    assert!(events.iter().any(|e| matches!(e, Event::Lost { reason: LostReason::SessionExpired, .. })));
    assert_eq!(s.owned(w1).len(), 6, "the survivor takes everything");
    for p in lost_partitions {
        assert_eq!(s.token(p), FencingToken(s.index));
    }
    for (p, token) in untouched {
        assert_eq!(s.token(p), token, "blast radius: the survivor's own partitions keep their tokens");
    }
    // The dead session can do nothing any more.
    let (r, _) =
        s.commit(Command::Release { tokens: vec![], session: w2, secret: secret2, partitions: vec![] });
    assert_eq!(r, Response::Rejected(Rejection::UnknownSession(w2)));
    s.check();
}

#[test]
fn a_revoke_that_is_never_released_expires_and_is_granted() {
    let mut s = Story::new(4);
    let (w1, _) = s.join("w1");
    let (w2, _) = s.join("w2");
    let revoking = s.revoking(w1);
    let (_, events) = s.commit(Command::ExpireRevoking {
        partitions: revoking.iter().map(|p| (*p, w1, s.token(p.0))).collect(),
    });
    assert!(events.iter().any(|e| matches!(e, Event::Lost { reason: LostReason::RevokeExpired, .. })));
    assert_eq!(s.owned(w2).len(), 2);
    assert_eq!(s.owned(w1).len(), 2);
    assert!(s.revoking(w1).is_empty());
    s.check();
}

#[test]
fn leaving_revokes_everything_and_the_session_ends_when_all_is_released() {
    let (mut s, (w1, _), (w2, secret2)) = Story::balanced_pair(4);
    let (r, _) = s.commit(Command::Leave { session: w2, secret: secret2 });
    assert_eq!(r, Response::Left);
    assert_eq!(s.revoking(w2).len(), 2);
    let (_, events) = s.commit(Command::Release {
        tokens: vec![],
        session: w2,
        secret: secret2,
        partitions: s.revoking(w2),
    });
    assert!(events.contains(&Event::SessionEnded { session: w2 }));
    assert_eq!(s.owned(w1).len(), 4);
    s.check();
}

#[test]
fn a_rejoin_under_the_same_name_supersedes_the_old_session_gracefully() {
    let mut s = Story::new(4);
    let (old, _) = s.join("w1");
    let (new, _) = s.join("w1");
    assert_ne!(old, new);
    assert!(s.state.session(old).unwrap().leaving);
    assert_eq!(s.revoking(old).len(), 4, "the old incarnation may still be alive: revoke, don't steal");
    s.commit(Command::Expire { sessions: vec![old] });
    assert_eq!(s.owned(new).len(), 4);
    s.check();
}

#[test]
fn rejected_commands_change_nothing() {
    let (mut s, (w1, secret1), (w2, secret2)) = Story::balanced_pair(4);
    let before = s.state.clone();
    let cases = vec![
        (
            Command::Release {
                tokens: vec![],
                session: w1,
                secret: SecretHash::of("wrong"),
                partitions: vec![],
            },
            Rejection::WrongSecret(w1),
        ),
        (
            Command::Release { tokens: vec![], session: SessionId(99), secret: secret1, partitions: vec![] },
            Rejection::UnknownSession(SessionId(99)),
        ),
        (
            Command::Release {
                tokens: vec![],
                session: w1,
                secret: secret1,
                partitions: vec![PartitionId(4)],
            },
            Rejection::PartitionOutOfRange { partition: 4, count: 4 },
        ),
        (Command::Leave { session: w2, secret: secret1 }, Rejection::WrongSecret(w2)),
        (
            Command::Join { name: String::new(), weight: 1, secret: SecretHash::of("x") },
            Rejection::InvalidName("must be 1 to 256 bytes without control characters".into()),
        ),
        (
            Command::Join { name: "w3".into(), weight: 0, secret: SecretHash::of("x") },
            Rejection::InvalidWeight(0),
        ),
        (
            Command::Configure { partition_count: 8, lease_ttl_ms: 1000, max_revoking: None },
            Rejection::ConfigMismatch {
                have: Config { partition_count: 4, lease_ttl_ms: 1000, max_revoking: None, ttl_change: None },
                want: Config { partition_count: 8, lease_ttl_ms: 1000, max_revoking: None, ttl_change: None },
            },
        ),
    ];
    // Releasing a mix of owned and foreign partitions is refused as a whole.
    let foreign = s.owned(w2)[0];
    let mine = s.owned(w1)[0];
    let cases = cases.into_iter().chain([(
        Command::Release {
            tokens: vec![],
            session: w1,
            secret: secret1,
            partitions: vec![PartitionId(mine), PartitionId(foreign)],
        },
        Rejection::NotOwner { partition: PartitionId(foreign), session: w1 },
    )]);
    for (command, want) in cases {
        let (r, events) = s.commit(command.clone());
        assert_eq!(r, Response::Rejected(want), "{command:?}");
        assert!(events.is_empty());
        assert!(s.unchanged_since(&before), "{command:?} changed the table");
    }
    let _ = secret2;
}

#[test]
fn commands_before_configuration_are_refused() {
    let mut state = OwnershipState::default();
    let (r, _) = state.apply(1, &Command::Join { name: "w".into(), weight: 1, secret: SecretHash::of("s") });
    assert_eq!(r, Response::Rejected(Rejection::NotConfigured));
    let (r, _) =
        state.apply(2, &Command::Configure { partition_count: 0, lease_ttl_ms: 1, max_revoking: None });
    assert!(matches!(r, Response::Rejected(Rejection::InvalidConfig(_))));
}

#[test]
fn snapshot_and_restore_give_the_same_table_and_the_same_future() {
    let mut s = Story::new(16);
    let (w1, secret1) = s.join("w1");
    let _ = s.join("w2");
    s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions: s.revoking(w1) });
    let _ = s.join("w3");

    let bytes = serde_json::to_vec(&s.state).unwrap();
    let mut restored: OwnershipState = serde_json::from_slice(&bytes).unwrap();
    let mut original = s.state.clone();
    original.take_changes();
    assert_eq!(restored, original);

    // Replaying the same commands on both gives the same responses, events and tables.
    let next = Command::Expire { sessions: vec![w1] };
    let a = s.state.apply(s.index + 1, &next);
    let b = restored.apply(s.index + 1, &next);
    assert_eq!(a, b);
}

#[test]
fn tokens_only_grow_over_a_long_random_history() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut s = Story::new(32);
    let mut highest = vec![0u64; 32];
    let mut live: Vec<(SessionId, SecretHash)> = Vec::new();
    for step in 0..400 {
        match rng.random_range(0..4) {
            0 => live.push(s.join(&format!("w{}", step % 6))),
            1 if !live.is_empty() => {
                let (sid, secret) = live[rng.random_range(0..live.len())];
                let revoking = s.revoking(sid);
                s.commit(Command::Release { tokens: vec![], session: sid, secret, partitions: revoking });
            }
            2 if !live.is_empty() => {
                let (sid, _) = live.remove(rng.random_range(0..live.len()));
                s.commit(Command::Expire { sessions: vec![sid] });
            }
            _ => {}
        }
        for (p, r) in s.state.partitions().iter().enumerate() {
            assert!(r.token.0 >= highest[p], "p{p} token went down at step {step}");
            highest[p] = r.token.0;
        }
        s.check();
    }
}

#[test]
fn an_expiry_of_an_older_revoke_leaves_a_newer_revoke_of_the_same_partition_alone() {
    // A lease table that lags behind the log can compute an expiry for a revoke of grant 3 of
    // partition 0 to session 1, after that grant was released and partition 0 was granted to
    // session 1 again (token 7) and is being revoked once more. The expiry must name its grant,
    // and miss the newer one: session 1's newer revoke runs on its own, fresh deadline.
    use std::collections::BTreeMap;
    use tenure::ownership::{PartitionRecord, SessionRecord};
    let s1 = SessionId(1);
    let record = |name: &str| SessionRecord {
        name: name.into(),
        weight: 1,
        secret: SecretHash::of(name),
        leaving: false,
    };
    let sessions = BTreeMap::from([(s1, record("w1")), (SessionId(2), record("w2"))]);
    let partitions = vec![
        PartitionRecord { owner: Some(s1), token: FencingToken(7), revoking: true, next: None, moved: false },
        PartitionRecord {
            owner: Some(SessionId(2)),
            token: FencingToken(5),
            revoking: false,
            next: None,
            moved: false,
        },
    ];
    let config = Config { partition_count: 2, lease_ttl_ms: 1000, max_revoking: None, ttl_change: None };
    let mut state = OwnershipState::from_parts(Some(config), partitions, sessions, 2);
    let stale = Command::ExpireRevoking { partitions: vec![(PartitionId(0), s1, FencingToken(3))] };
    let (response, events) = state.apply(8, &stale);
    assert_eq!(response, Response::Expired { partitions: 0 });
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(state.partition(PartitionId(0)).unwrap().owner, Some(s1));
    // The expiry of the grant that is revoking now does take it away.
    let current = Command::ExpireRevoking { partitions: vec![(PartitionId(0), s1, FencingToken(7))] };
    let (response, events) = state.apply(9, &current);
    assert_eq!(response, Response::Expired { partitions: 1 });
    assert!(events.contains(&Event::Lost {
        partition: PartitionId(0),
        session: s1,
        token: FencingToken(7),
        reason: LostReason::RevokeExpired
    }));
}

#[test]
fn a_late_release_of_an_older_grant_leaves_the_newer_grant_alone() {
    // Found by the model simulation's "no belief outlives its grant": a release of grant 20,
    // held up on the network, arrived after partition 0 had been lost, granted elsewhere and
    // granted back to the same session (grant 24), and released the grant the worker believed.
    use std::collections::BTreeMap;
    use tenure::ownership::{PartitionRecord, SessionRecord};
    let s1 = SessionId(1);
    let record = SessionRecord { name: "w1".into(), weight: 1, secret: SecretHash::of("s"), leaving: false };
    let partitions = vec![PartitionRecord {
        owner: Some(s1),
        token: FencingToken(24),
        revoking: false,
        next: None,
        moved: false,
    }];
    let config = Config { partition_count: 1, lease_ttl_ms: 1000, max_revoking: None, ttl_change: None };
    let mut state = OwnershipState::from_parts(Some(config), partitions, BTreeMap::from([(s1, record)]), 1);
    let late = Command::Release {
        session: s1,
        secret: SecretHash::of("s"),
        partitions: vec![PartitionId(0)],
        tokens: vec![FencingToken(20)],
    };
    let (response, events) = state.apply(25, &late);
    assert_eq!(response, Response::Released { partitions: vec![] });
    assert!(events.is_empty(), "{events:?}");
    let current = Command::Release {
        session: s1,
        secret: SecretHash::of("s"),
        partitions: vec![PartitionId(0)],
        tokens: vec![FencingToken(24)],
    };
    assert_eq!(state.apply(26, &current).0, Response::Released { partitions: vec![PartitionId(0)] });
    let uneven = Command::Release {
        session: s1,
        secret: SecretHash::of("s"),
        partitions: vec![],
        tokens: vec![FencingToken(1)],
    };
    assert_eq!(
        state.apply(27, &uneven).0,
        Response::Rejected(Rejection::TokensMismatch { partitions: 0, tokens: 1 })
    );
}

/// Plans a decision on the story's table without committing it.
fn decide(s: &Story) -> Command {
    planner::plan(&s.state, &Rules::default()).expect("the table needs a decision")
}

fn join_alone(s: &mut Story, name: &str) -> SessionId {
    let (r, _) = s.commit_alone(Command::Join {
        name: name.into(),
        weight: 1,
        secret: SecretHash::of(&format!("secret-of-{name}")),
    });
    let Response::Joined { session, .. } = r else { panic!("join failed: {r:?}") };
    session
}

#[test]
fn a_join_decides_nothing_on_its_own_the_leader_does() {
    let mut s = Story::new(8);
    let (w1, _) = s.join("w1");
    let (r, events) =
        s.commit_alone(Command::Join { name: "w2".into(), weight: 1, secret: SecretHash::of("s2") });
    let Response::Joined { session: w2, .. } = r else { panic!("{r:?}") };
    assert_eq!(
        events,
        vec![Event::SessionStarted { session: w2, name: "w2".into() }],
        "apply placed nothing"
    );
    assert_eq!(s.owned(w1).len(), 8);
    let Command::Place { grants, revokes } = decide(&s) else { panic!("not a placement") };
    assert!(grants.is_empty());
    assert_eq!(revokes.len(), 4);
    assert!(revokes.iter().all(|r| r.session == w1 && r.next == w2 && r.token == s.token(r.partition.0)));
    s.check();
}

#[test]
fn a_placement_made_on_a_table_that_changed_is_refused_whole() {
    let mut s = Story::new(8);
    let (w1, secret1) = s.join("w1");
    join_alone(&mut s, "w2");
    let plan = decide(&s);
    let Command::Place { revokes, .. } = &plan else { panic!() };
    // Before the decision commits, w1 gives one of the partitions up of its own accord.
    let gone = revokes[0].partition;
    s.commit_alone(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions: vec![gone] });
    let before = s.state.clone();
    let (r, events) = s.commit_alone(plan);
    assert_eq!(r, Response::Rejected(Rejection::StalePlacement(gone)));
    assert!(events.is_empty());
    assert!(s.unchanged_since(&before), "none of the other revokes was applied");
    assert!(s.revoking(w1).is_empty());
    // Decided again on the table as it is, the placement goes through.
    s.commit(Command::Expire { sessions: vec![] });
    assert_eq!(s.revoking(w1).len(), 3, "one partition was already free and went straight to w2");
    s.check();
}

#[test]
fn a_placement_that_breaks_a_rule_of_the_table_is_refused_whole() {
    let (mut s, (w1, _), (w2, secret2)) = Story::balanced_pair(4);
    s.commit_alone(Command::Leave { session: w2, secret: secret2 });
    let before = s.state.clone();
    let mine = PartitionId(s.owned(w1)[0]);
    let token = s.token(mine.0);
    let revoke = |next: SessionId, token: FencingToken| Command::Place {
        grants: vec![],
        revokes: vec![Revoke { partition: mine, session: w1, token, next }],
    };
    let cases = vec![
        (
            Command::Place {
                grants: vec![Grant { partition: PartitionId(9), session: w1 }],
                revokes: vec![],
            },
            Rejection::PartitionOutOfRange { partition: 9, count: 4 },
        ),
        (revoke(SessionId(77), token), Rejection::NotEligible(SessionId(77))),
        // w2 is leaving: it takes nothing.
        (revoke(w2, token), Rejection::NotEligible(w2)),
        // Not the grant w1 holds now.
        (revoke(w1, FencingToken(token.0 - 1)), Rejection::StalePlacement(mine)),
        // Granting a partition that has an owner.
        (
            Command::Place { grants: vec![Grant { partition: mine, session: w1 }], revokes: vec![] },
            Rejection::StalePlacement(mine),
        ),
    ];
    for (command, want) in cases {
        let (r, events) = s.commit_alone(command.clone());
        assert_eq!(r, Response::Rejected(want), "{command:?}");
        assert!(events.is_empty());
        assert!(s.unchanged_since(&before), "{command:?} changed the table");
    }
    s.check();
}

#[test]
fn a_partition_named_twice_in_one_placement_is_refused() {
    let mut s = Story::new(4);
    let w1 = join_alone(&mut s, "w1");
    let twice = Command::Place {
        grants: vec![
            Grant { partition: PartitionId(0), session: w1 },
            Grant { partition: PartitionId(0), session: w1 },
        ],
        revokes: vec![],
    };
    assert_eq!(s.commit_alone(twice).0, Response::Rejected(Rejection::DuplicateMove(PartitionId(0))));
    assert!(s.owned(w1).is_empty());
}

#[test]
fn the_revoke_budget_moves_the_table_in_waves() {
    let mut s = Story { state: OwnershipState::default(), index: 0 };
    s.commit(Command::Configure { partition_count: 8, lease_ttl_ms: 1000, max_revoking: Some(2) });
    let (w1, secret1) = s.join("w1");
    let (w2, _) = s.join("w2");
    let mut waves = 0;
    while !s.revoking(w1).is_empty() {
        assert!(s.revoking(w1).len() <= 2, "at most the budget is revoking");
        waves += 1;
        let partitions = s.revoking(w1);
        s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions });
        s.check();
    }
    assert_eq!(waves, 2, "four partitions move, two at a time");
    assert_eq!((s.owned(w1).len(), s.owned(w2).len()), (4, 4));
    // A budget of zero would never move anything: refused.
    let mut fresh = OwnershipState::default();
    let zero = Command::Configure { partition_count: 8, lease_ttl_ms: 1000, max_revoking: Some(0) };
    assert!(matches!(fresh.apply(1, &zero).0, Response::Rejected(Rejection::InvalidConfig(_))));
}

#[test]
fn a_receiver_that_left_before_the_release_does_not_get_the_partition() {
    let mut s = Story::new(4);
    let (w1, secret1) = s.join("w1");
    let (w2, secret2) = s.join("w2");
    let revoking = s.revoking(w1);
    assert!(revoking.iter().all(|p| s.state.partition(*p).unwrap().next == Some(w2)));
    s.commit_alone(Command::Leave { session: w2, secret: secret2 });
    let (_, events) = s.commit_alone(Command::Release {
        tokens: vec![],
        session: w1,
        secret: secret1,
        partitions: revoking,
    });
    assert!(!events.iter().any(|e| matches!(e, Event::Granted { .. })), "{events:?}");
    // The leader places them again: back to w1, the only member.
    s.commit(Command::Expire { sessions: vec![] });
    assert_eq!(s.owned(w1).len(), 4);
    s.check();
}

#[test]
fn every_change_placement_reads_is_announced_by_an_event() {
    // The leader decides again only after an entry that emitted events: a configuration, a
    // leave or a superseded session that said nothing would never be acted on.
    let mut s = Story { state: OwnershipState::default(), index: 0 };
    let config = Config { partition_count: 4, lease_ttl_ms: 1000, max_revoking: None, ttl_change: None };
    let (_, events) =
        s.commit_alone(Command::Configure { partition_count: 4, lease_ttl_ms: 1000, max_revoking: None });
    assert_eq!(events, vec![Event::Configured { config }]);

    let (mut s, _, (w2, secret2)) = Story::balanced_pair(4);
    let (r, events) = s.commit_alone(Command::Leave { session: w2, secret: secret2 });
    assert_eq!((r, events), (Response::Left, vec![Event::SessionLeaving { session: w2 }]));
    let Command::Place { revokes, .. } = decide(&s) else { panic!("not a placement") };
    assert_eq!(revokes.len(), 2, "the leaver's partitions are revoked by the leader's next decision");

    let (mut s, (w1, _), _) = Story::balanced_pair(4);
    let (_, events) =
        s.commit_alone(Command::Join { name: "w1".into(), weight: 1, secret: SecretHash::of("again") });
    assert_eq!(events[0], Event::SessionLeaving { session: w1 }, "{events:?}");
}

#[test]
fn an_entry_that_emits_no_event_leaves_the_leaders_next_decision_as_it_was() {
    // Over a random history of every kind of command (refused ones too), with decisions
    // applied only now and then so the table is often mid-move: whenever an entry emitted no
    // event, the plan after it is the plan before it. That is what lets the leader skip
    // deciding after such an entry.
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut s = Story::new(16);
    let mut sessions: Vec<(SessionId, SecretHash)> = Vec::new();
    let mut silent = 0;
    for step in 0..2000 {
        let pick = |rng: &mut rand::rngs::StdRng, sessions: &[(SessionId, SecretHash)]| {
            (!sessions.is_empty()).then(|| sessions[rng.random_range(0..sessions.len())])
        };
        let command = match rng.random_range(0..12) {
            0 => {
                let name = format!("w{}", rng.random_range(0..5));
                let secret = SecretHash::of(&format!("s{step}"));
                Command::Join { name, weight: rng.random_range(1..3), secret }
            }
            1 => match pick(&mut rng, &sessions) {
                Some((session, secret)) => Command::Leave { session, secret },
                None => continue,
            },
            2 | 3 => match pick(&mut rng, &sessions) {
                Some((session, secret)) => {
                    let mut partitions: Vec<PartitionId> =
                        s.state.owned_by(session).into_iter().map(|(p, _)| p).collect();
                    partitions.truncate(rng.random_range(0..3));
                    Command::Release { session, secret, partitions, tokens: vec![] }
                }
                None => continue,
            },
            4 => match pick(&mut rng, &sessions) {
                Some((session, _)) => Command::Expire { sessions: vec![session] },
                None => continue,
            },
            5 => {
                let revoking: Vec<_> = s
                    .state
                    .partitions()
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.revoking && rng.random_bool(0.5))
                    .map(|(p, r)| (PartitionId(p as u32), r.owner.unwrap(), r.token))
                    .collect();
                Command::ExpireRevoking { partitions: revoking }
            }
            6 => match pick(&mut rng, &sessions) {
                Some((session, _)) => Command::Leave { session, secret: SecretHash::of("wrong") },
                None => Command::Expire { sessions: vec![SessionId(999)] },
            },
            7 => Command::Configure { partition_count: 16, lease_ttl_ms: 1000, max_revoking: None },
            8 => Command::SetRevokeBudget { max_revoking: [None, Some(1), Some(3)][rng.random_range(0..3)] },
            9 => match rng.random_range(0..3) {
                0 => Command::SetLeaseTtl { lease_ttl_ms: [500, 1000, 2000][rng.random_range(0..3)] },
                1 => Command::SettleLeaseTtl {
                    changed_at: s.state.config().and_then(|c| c.ttl_change).map_or(1, |c| c.changed_at),
                },
                _ => Command::SetLeaseTtl { lease_ttl_ms: 5 },
            },
            _ => match planner::plan(&s.state, &Rules::default()) {
                Some(place) => place,
                None => continue,
            },
        };
        let before = planner::plan(&s.state, &Rules::default());
        let (response, events) = s.commit_alone(command.clone());
        if let (Response::Joined { session, .. }, Command::Join { secret, .. }) = (&response, &command) {
            sessions.push((*session, *secret));
        }
        sessions.retain(|(id, _)| s.state.session(*id).is_some());
        if events.is_empty() {
            silent += 1;
            assert_eq!(
                planner::plan(&s.state, &Rules::default()),
                before,
                "step {step}: {command:?} emitted no event but changed the next decision"
            );
        }
        s.check();
    }
    assert!(silent > 100, "the history had too few silent entries to say anything ({silent})");
}

#[test]
fn a_decision_larger_than_one_command_is_split_into_commands_that_apply_in_order() {
    let max = planner::MAX_MOVES_PER_COMMAND;
    let partitions = 3 * max as u32 + 5;
    let mut s = Story::new(partitions);
    join_alone(&mut s, "w1");
    let commands = planner::plan_all(&s.state, &Rules::default());
    assert_eq!(commands.len(), 4);
    let mut named = std::collections::BTreeSet::new();
    for command in &commands {
        let Command::Place { grants, revokes } = command else { panic!("not a placement") };
        assert!(grants.len() + revokes.len() <= max);
        assert!(grants.iter().all(|g| named.insert(g.partition)), "a partition in two commands");
    }
    for command in commands {
        let (r, _) = s.commit_alone(command);
        assert!(matches!(r, Response::Placed { .. }), "{r:?}");
    }
    assert_eq!(s.state.unowned_count(), 0);
    assert!(planner::plan_all(&s.state, &Rules::default()).is_empty(), "settled after the last command");
    s.check();
}

#[test]
fn maintenance_mode_grants_unowned_partitions_but_takes_none_from_a_live_owner() {
    let mut s = Story::new(12);
    let (w1, _) = s.join("w1");
    let (_, events) = s.commit(Command::SetMaintenance { on: true });
    assert_eq!(events, vec![Event::MaintenanceChanged { on: true }]);
    assert!(s.state.maintenance());
    // A newcomer gets nothing from w1 while maintenance is on.
    let (w2, secret2) = s.join("w2");
    assert!(s.revoking(w1).is_empty() && s.owned(w2).is_empty(), "nothing moved to w2");
    // Turning it on again changes nothing and says so.
    let (r, events) = s.commit(Command::SetMaintenance { on: true });
    assert_eq!((r, events), (Response::MaintenanceSet { was: true }, vec![]));
    // A leaving worker still gives its partitions up, and unowned ones are still granted: w2
    // leaves and comes back as w3, which takes w1's partitions only once maintenance ends.
    s.commit(Command::Leave { session: w2, secret: secret2 });
    let (w3, _) = s.join("w3");
    assert!(s.revoking(w1).is_empty() && s.owned(w3).is_empty());
    s.commit(Command::Expire { sessions: vec![w1] });
    assert_eq!(s.owned(w3).len(), 12, "w1's lost partitions are unowned, and granted to w3");
    let (w4, _) = s.join("w4");
    assert!(s.owned(w4).is_empty());
    let (r, events) = s.commit(Command::SetMaintenance { on: false });
    assert_eq!(r, Response::MaintenanceSet { was: true });
    assert_eq!(events[0], Event::MaintenanceChanged { on: false });
    assert_eq!(s.revoking(w3).len(), 6, "once it is off, the leader balances again");
    s.check();
    // The setting survives a snapshot.
    s.commit(Command::SetMaintenance { on: true });
    let restored: OwnershipState = serde_json::from_slice(&serde_json::to_vec(&s.state).unwrap()).unwrap();
    assert!(restored.maintenance());
}

#[test]
fn an_operators_weight_applies_now_and_to_the_workers_next_sessions() {
    let mut s = Story::new(16);
    let (w1, secret1) = s.join("w1");
    let (w2, _) = s.join("w2");
    s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions: s.revoking(w1) });
    assert_eq!((s.owned(w1).len(), s.owned(w2).len()), (8, 8));

    let (r, events) = s.commit(Command::SetWeight { name: "w2".into(), weight: 3 });
    assert_eq!(r, Response::WeightSet { sessions: vec![w2] });
    assert_eq!(events[0], Event::WeightChanged { session: w2, weight: 3 });
    assert_eq!(s.revoking(w1).len(), 4, "w2 is to hold three quarters");
    s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions: s.revoking(w1) });
    assert_eq!((s.owned(w1).len(), s.owned(w2).len()), (4, 12));
    s.check();

    // The weight is the name's: w2 restarts asking for weight 1 and still gets 3.
    let again = Command::Join { name: "w2".into(), weight: 1, secret: SecretHash::of("again") };
    let Response::Joined { session: w2b, .. } = s.commit(again).0 else { panic!("join") };
    assert_eq!(s.state.session(w2b).unwrap().weight, 3);

    // Refused, changing nothing: no live session of that name, a weight out of range.
    let before = s.state.clone();
    for (name, weight, want) in [
        ("nobody", 2, Rejection::UnknownWorker("nobody".into())),
        ("w1", 0, Rejection::InvalidWeight(0)),
        ("w1", 1001, Rejection::InvalidWeight(1001)),
    ] {
        let (r, events) = s.commit_alone(Command::SetWeight { name: name.into(), weight });
        assert_eq!((r, events), (Response::Rejected(want), vec![]));
    }
    assert!(s.unchanged_since(&before));
    // The same weight again emits nothing, so the leader has nothing to decide.
    let (r, events) = s.commit_alone(Command::SetWeight { name: "w1".into(), weight: 1 });
    assert_eq!((r, events), (Response::WeightSet { sessions: vec![w1] }, vec![]));
}

#[test]
fn an_operators_pin_moves_one_partition_gracefully_and_the_table_balances_around_it() {
    let (mut s, (w1, secret1), (w2, secret2)) = Story::balanced_pair(16);
    let p = s.owned(w1)[0];
    let owner = |s: &Story, p: u32| s.state.partitions()[p as usize].owner;

    // Pinned to w2: revoked from w1 for w2, gracefully; nothing else of w1's moves.
    let (r, _) = s.commit(Command::Pin { partition: PartitionId(p), name: Some("w2".into()) });
    assert_eq!(r, Response::Pinned { was: None });
    assert_eq!(s.revoking(w1), vec![PartitionId(p)]);
    assert_eq!(s.state.partitions()[p as usize].next, Some(w2));
    s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions: s.revoking(w1) });
    assert_eq!(owner(&s, p), Some(w2));
    // w2 now holds one too many: another of its partitions, never the pinned one, goes back.
    let back = s.revoking(w2);
    assert_eq!(back.len(), 1, "{back:?}");
    assert_ne!(back[0], PartitionId(p));
    s.commit(Command::Release { tokens: vec![], session: w2, secret: secret2, partitions: back });
    assert_eq!((s.owned(w1).len(), s.owned(w2).len()), (8, 8));
    assert_eq!(owner(&s, p), Some(w2));
    assert!(planner::plan(&s.state, &Rules::default()).is_none(), "settled with the pin met");
    s.check();

    // The pin is the name's: w2's next session gets the partition.
    let again = Command::Join { name: "w2".into(), weight: 1, secret: SecretHash::of("again") };
    let Response::Joined { session: w2b, .. } = s.commit(again).0 else { panic!("join") };
    s.commit(Command::Release { tokens: vec![], session: w2, secret: secret2, partitions: s.revoking(w2) });
    assert_eq!(owner(&s, p), Some(w2b));

    // Refused, changing nothing: a partition beyond the table, a name with no live session.
    let before = s.state.clone();
    for (partition, name, want) in [
        (16, Some("w2"), Rejection::PartitionOutOfRange { partition: 16, count: 16 }),
        (p, Some("nobody"), Rejection::UnknownWorker("nobody".into())),
    ] {
        let command = Command::Pin { partition: PartitionId(partition), name: name.map(str::to_string) };
        assert_eq!(s.commit_alone(command), (Response::Rejected(want), vec![]));
    }
    assert!(s.unchanged_since(&before));
    // Unpinned: nothing moves (the table is balanced as it is).
    let (r, events) = s.commit(Command::Pin { partition: PartitionId(p), name: None });
    let unpinned = Event::Pinned { partition: PartitionId(p), name: None };
    assert_eq!((r, events), (Response::Pinned { was: Some("w2".into()) }, vec![unpinned]));
    assert_eq!(owner(&s, p), Some(w2b));
}

#[test]
fn the_lease_ttl_changes_at_run_time_and_stays_unsettled_until_the_leader_says() {
    let (mut s, _, _) = Story::balanced_pair(4);
    let before = s.state.clone();
    // Out of range: refused, nothing changes.
    for ms in [0, 99, 24 * 60 * 60 * 1000 + 1] {
        let (r, events) = s.commit_alone(Command::SetLeaseTtl { lease_ttl_ms: ms });
        assert!(matches!(r, Response::Rejected(Rejection::InvalidConfig(_))), "{ms}: {r:?}");
        assert!(events.is_empty() && s.unchanged_since(&before));
    }
    // Shorter: renewals use 250 ms from now on, and a worker may still believe 1 s.
    let (r, events) = s.commit_alone(Command::SetLeaseTtl { lease_ttl_ms: 250 });
    let first = s.index;
    assert_eq!(r, Response::LeaseTtlSet { was_ms: 1000 });
    assert_eq!(
        events,
        vec![Event::LeaseTtlChanged { lease_ttl_ms: 250, ceiling_ms: 1000, changed_at: first }]
    );
    let config = s.state.config().unwrap();
    assert_eq!(config.lease_ttl_ms, 250);
    assert_eq!(config.ttl_change, Some(TtlChange { ceiling_ms: 1000, changed_at: first }));
    // Longer again before it settled: the ceiling is the longest of the three.
    s.commit_alone(Command::SetLeaseTtl { lease_ttl_ms: 600 });
    let second = s.index;
    assert_eq!(s.state.config().unwrap().ttl_ceiling_ms(), 1000);
    // The same TTL again: no change, no event, the change stays as it was.
    let (r, events) = s.commit_alone(Command::SetLeaseTtl { lease_ttl_ms: 600 });
    assert_eq!((r, events), (Response::LeaseTtlSet { was_ms: 600 }, vec![]));
    // Settling the first change does nothing: the second is pending.
    let (r, events) = s.commit_alone(Command::SettleLeaseTtl { changed_at: first });
    assert_eq!((r, events), (Response::LeaseTtlSettled { settled: false }, vec![]));
    let (r, events) = s.commit_alone(Command::SettleLeaseTtl { changed_at: second });
    assert_eq!(r, Response::LeaseTtlSettled { settled: true });
    assert_eq!(events, vec![Event::LeaseTtlSettled { changed_at: second }]);
    let config = s.state.config().unwrap();
    assert_eq!((config.lease_ttl_ms, config.ttl_change, config.ttl_ceiling_ms()), (600, None, 600));
    // A snapshot carries the configuration as it is now; restarting with the old flags is a
    // mismatch the cluster's values win, not a reconfiguration.
    let restored: OwnershipState = serde_json::from_slice(&serde_json::to_vec(&s.state).unwrap()).unwrap();
    assert_eq!(restored.config(), s.state.config());
    let (r, _) =
        s.commit_alone(Command::Configure { partition_count: 4, lease_ttl_ms: 1000, max_revoking: None });
    assert!(matches!(r, Response::Rejected(Rejection::ConfigMismatch { .. })), "{r:?}");
    s.check();
}

#[test]
fn the_revoke_budget_changes_at_run_time_and_the_next_decisions_keep_to_it() {
    let mut s = Story::new(8);
    let (w1, secret1) = s.join("w1");
    let (r, events) = s.commit_alone(Command::SetRevokeBudget { max_revoking: Some(1) });
    assert_eq!(r, Response::RevokeBudgetSet { was: None });
    assert_eq!(events, vec![Event::RevokeBudgetChanged { max_revoking: Some(1) }]);
    let (r, _) = s.commit_alone(Command::SetRevokeBudget { max_revoking: Some(0) });
    assert!(matches!(r, Response::Rejected(Rejection::InvalidConfig(_))), "{r:?}");
    let (w2, _) = s.join("w2");
    let mut waves = 0;
    while !s.revoking(w1).is_empty() {
        assert_eq!(s.revoking(w1).len(), 1, "one partition in motion at a time");
        waves += 1;
        if waves == 2 {
            // Lifted mid-move: the rest move at once.
            s.commit_alone(Command::SetRevokeBudget { max_revoking: None });
            s.commit(Command::Expire { sessions: vec![] });
            assert_eq!(s.revoking(w1).len(), 3, "the one in motion and the two still to go");
        }
        let partitions = s.revoking(w1);
        s.commit(Command::Release { tokens: vec![], session: w1, secret: secret1, partitions });
        s.check();
    }
    assert_eq!(waves, 2);
    assert_eq!((s.owned(w1).len(), s.owned(w2).len()), (4, 4));
}

#[test]
fn moves_granted_but_unconfirmed_count_toward_the_revoke_budget() {
    let mut s = Story { state: OwnershipState::default(), index: 0 };
    s.commit(Command::Configure { partition_count: 8, lease_ttl_ms: 1000, max_revoking: Some(2) });
    let (w1, _) = s.join("w1");
    join_alone(&mut s, "w2");
    let revokes = |c: &[Command]| -> usize {
        c.iter().map(|c| if let Command::Place { revokes, .. } = c { revokes.len() } else { 0 }).sum()
    };
    let rules = Rules::default();
    assert_eq!(revokes(&planner::plan_all_in_motion(&s.state, &rules, 0)), 2);
    assert_eq!(revokes(&planner::plan_all_in_motion(&s.state, &rules, 1)), 1, "one move still unconfirmed");
    assert_eq!(revokes(&planner::plan_all_in_motion(&s.state, &rules, 2)), 0, "the budget is spent");
    assert_eq!(s.owned(w1).len(), 8);
}
