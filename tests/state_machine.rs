//! Scenario tests of the pure ownership state machine. Each test is a short story: commands at
//! log indexes in, responses, events and the table out.

use tenure::ids::{FencingToken, PartitionId, SessionId};
use tenure::ownership::{Command, Event, LossReason, OwnershipState, Rejection, Response};

/// A state machine with a log index counter, so stories read as a sequence of commits.
struct Story {
    state: OwnershipState,
    index: u64,
}

impl Story {
    fn new(partitions: u32) -> Story {
        let mut story = Story { state: OwnershipState::default(), index: 0 };
        let (r, _) = story.commit(Command::Configure { partition_count: partitions, lease_ttl_ms: 1000 });
        assert_eq!(r, Response::Configured);
        story
    }

    fn commit(&mut self, command: Command) -> (Response, Vec<Event>) {
        self.index += 1;
        self.state.apply(self.index, &command)
    }

    fn join(&mut self, name: &str) -> (SessionId, String) {
        let secret = format!("secret-of-{name}");
        match self.commit(Command::Join { name: name.into(), weight: 1, secret: secret.clone() }).0 {
            Response::Joined { session, .. } => (session, secret),
            other => panic!("join failed: {other:?}"),
        }
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
        // The owner index answers exactly what a scan of the table does.
        for session in self.state.sessions().keys() {
            let scanned: Vec<u32> = (0..self.state.partitions().len() as u32)
                .filter(|p| self.state.partition(PartitionId(*p)).unwrap().owner == Some(*session))
                .collect();
            assert_eq!(self.owned(*session), scanned, "owner index of session {session}");
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

    let (r, events) = s.commit(Command::Release {
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
    let mut s = Story::new(6);
    let (w1, _) = s.join("w1");
    let (w2, secret2) = s.join("w2");
    s.commit(Command::Release {
        tokens: vec![],
        session: w1,
        secret: "secret-of-w1".into(),
        partitions: s.revoking(w1),
    });
    let lost_partitions = s.owned(w2);
    let untouched: Vec<_> = s.owned(w1).iter().map(|&p| (p, s.token(p))).collect();

    let (r, events) = s.commit(Command::Expire { sessions: vec![w2] });
    assert_eq!(r, Response::Expired { partitions: 3 });
    assert!(events.contains(&Event::SessionEnded { session: w2 }));
    assert!(events.iter().any(|e| matches!(e, Event::Lost { reason: LossReason::SessionExpired, .. })));
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
    assert!(events.iter().any(|e| matches!(e, Event::Lost { reason: LossReason::RevokeExpired, .. })));
    assert_eq!(s.owned(w2).len(), 2);
    assert_eq!(s.owned(w1).len(), 2);
    assert!(s.revoking(w1).is_empty());
    s.check();
}

#[test]
fn leaving_revokes_everything_and_the_session_ends_when_all_is_released() {
    let mut s = Story::new(4);
    let (w1, secret1) = s.join("w1");
    let (w2, secret2) = s.join("w2");
    s.commit(Command::Release {
        tokens: vec![],
        session: w1,
        secret: secret1.clone(),
        partitions: s.revoking(w1),
    });
    let (r, _) = s.commit(Command::Leave { session: w2, secret: secret2.clone() });
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
    let mut s = Story::new(4);
    let (w1, secret1) = s.join("w1");
    let (w2, secret2) = s.join("w2");
    s.commit(Command::Release {
        tokens: vec![],
        session: w1,
        secret: secret1.clone(),
        partitions: s.revoking(w1),
    });
    let before = s.state.clone();
    let cases = vec![
        (
            Command::Release { tokens: vec![], session: w1, secret: "wrong".into(), partitions: vec![] },
            Rejection::WrongSecret(w1),
        ),
        (
            Command::Release {
                tokens: vec![],
                session: SessionId(99),
                secret: secret1.clone(),
                partitions: vec![],
            },
            Rejection::UnknownSession(SessionId(99)),
        ),
        (
            Command::Release {
                tokens: vec![],
                session: w1,
                secret: secret1.clone(),
                partitions: vec![PartitionId(4)],
            },
            Rejection::PartitionOutOfRange { partition: 4, count: 4 },
        ),
        (Command::Leave { session: w2, secret: secret1.clone() }, Rejection::WrongSecret(w2)),
        (
            Command::Join { name: String::new(), weight: 1, secret: "x".into() },
            Rejection::InvalidName("must be 1 to 256 bytes without control characters".into()),
        ),
        (Command::Join { name: "w3".into(), weight: 0, secret: "x".into() }, Rejection::InvalidWeight(0)),
        (
            Command::Configure { partition_count: 8, lease_ttl_ms: 1000 },
            Rejection::ConfigMismatch {
                have_partitions: 4,
                have_ttl_ms: 1000,
                want_partitions: 8,
                want_ttl_ms: 1000,
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
            secret: secret1.clone(),
            partitions: vec![PartitionId(mine), PartitionId(foreign)],
        },
        Rejection::NotOwner { partition: PartitionId(foreign), session: w1 },
    )]);
    for (command, want) in cases {
        let (r, events) = s.commit(command.clone());
        assert_eq!(r, Response::Rejected(want), "{command:?}");
        assert!(events.is_empty());
        let mut after = s.state.clone();
        after.take_changes();
        let mut expected = before.clone();
        expected.take_changes();
        assert_eq!(after, expected, "{command:?} changed the table");
    }
    let _ = secret2;
}

#[test]
fn commands_before_configuration_are_refused() {
    let mut state = OwnershipState::default();
    let (r, _) = state.apply(1, &Command::Join { name: "w".into(), weight: 1, secret: "s".into() });
    assert_eq!(r, Response::Rejected(Rejection::NotConfigured));
    let (r, _) = state.apply(2, &Command::Configure { partition_count: 0, lease_ttl_ms: 1 });
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
    let mut live: Vec<(SessionId, String)> = Vec::new();
    for step in 0..400 {
        match rng.random_range(0..4) {
            0 => live.push(s.join(&format!("w{}", step % 6))),
            1 if !live.is_empty() => {
                let (sid, secret) = live[rng.random_range(0..live.len())].clone();
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
    use tenure::ownership::{Config, PartitionRecord, SessionRecord};
    let s1 = SessionId(1);
    let record =
        |name: &str| SessionRecord { name: name.into(), weight: 1, secret: name.into(), leaving: false };
    let sessions = BTreeMap::from([(s1, record("w1")), (SessionId(2), record("w2"))]);
    let partitions = vec![
        PartitionRecord { owner: Some(s1), token: FencingToken(7), revoking: true },
        PartitionRecord { owner: Some(SessionId(2)), token: FencingToken(5), revoking: false },
    ];
    let config = Config { partition_count: 2, lease_ttl_ms: 1000 };
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
        reason: LossReason::RevokeExpired
    }));
}

#[test]
fn a_late_release_of_an_older_grant_leaves_the_newer_grant_alone() {
    // Found by the model simulation's "no belief outlives its grant": a release of grant 20,
    // held up on the network, arrived after partition 0 had been lost, granted elsewhere and
    // granted back to the same session (grant 24), and released the grant the worker believed.
    use std::collections::BTreeMap;
    use tenure::ownership::{Config, PartitionRecord, SessionRecord};
    let s1 = SessionId(1);
    let record = SessionRecord { name: "w1".into(), weight: 1, secret: "s".into(), leaving: false };
    let partitions = vec![PartitionRecord { owner: Some(s1), token: FencingToken(24), revoking: false }];
    let config = Config { partition_count: 1, lease_ttl_ms: 1000 };
    let mut state = OwnershipState::from_parts(Some(config), partitions, BTreeMap::from([(s1, record)]), 1);
    let late = Command::Release {
        session: s1,
        secret: "s".into(),
        partitions: vec![PartitionId(0)],
        tokens: vec![FencingToken(20)],
    };
    let (response, events) = state.apply(25, &late);
    assert_eq!(response, Response::Released { partitions: vec![] });
    assert!(events.is_empty(), "{events:?}");
    let current = Command::Release {
        session: s1,
        secret: "s".into(),
        partitions: vec![PartitionId(0)],
        tokens: vec![FencingToken(24)],
    };
    assert_eq!(state.apply(26, &current).0, Response::Released { partitions: vec![PartitionId(0)] });
    let uneven = Command::Release {
        session: s1,
        secret: "s".into(),
        partitions: vec![],
        tokens: vec![FencingToken(1)],
    };
    assert_eq!(
        state.apply(27, &uneven).0,
        Response::Rejected(Rejection::TokensMismatch { partitions: 0, tokens: 1 })
    );
}
