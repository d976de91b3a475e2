//! Three real coordinator nodes over real gRPC on loopback, RocksDB in temporary directories,
//! and real workers: balance, expiry, graceful leave, leader loss, full restart, snapshots.

mod common;

use common::*;
use std::time::{Duration, Instant};
use tenure::worker::WorkerEvent;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_join_and_get_a_balanced_assignment() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (w1, w2, w3) = (worker(&c, "w1").await, worker(&c, "w2").await, worker(&c, "w3").await);
    let status = settled(&c, 3).await;
    assert_eq!(status.partition_count, 24);
    for s in &status.sessions {
        assert_eq!(s.owned, 8, "24 partitions over 3 workers");
    }
    workers_agree(&c, &[&w1, &w2, &w3]).await;
    single_believers(&[&w1, &w2, &w3]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_loses_its_partitions_after_the_ttl_and_they_get_higher_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (w1, w2) = (worker(&c, "w1").await, worker(&c, "w2").await);
    let mut w3 = worker(&c, "w3").await;
    let mut w3_events = w3.events().expect("events taken once");
    settled(&c, 3).await;
    let before = tokens(&workers_agree(&c, &[&w1, &w2, &w3]).await);
    let dead = w3.session().0;

    let silent_since = Instant::now();
    w3.abandon();
    let after = tokens(&settled(&c, 2).await);
    // The last renewal was sent at most one heartbeat interval (TTL/4) before the silence began,
    // so the coordinator cannot have expired the lease sooner than this.
    assert!(silent_since.elapsed() >= TTL * 3 / 4, "lease expired early: {:?}", silent_since.elapsed());
    for (p, (owner, token)) in &before {
        let (new_owner, new_token) = after[p];
        if *owner == dead {
            assert!(new_token > *token, "p{p}: token {new_token} not above {token}");
            assert_ne!(new_owner, dead);
        } else {
            assert_eq!((new_owner, new_token), (*owner, *token), "p{p} of a live worker changed");
        }
    }
    workers_agree(&c, &[&w1, &w2]).await;
    // The dropped worker's stream ended; it never reported anything after its own deadline lapsed.
    while let Some(e) = w3_events.try_recv() {
        assert!(matches!(e, WorkerEvent::Granted { .. }), "unexpected event {e:?}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_leave_moves_only_its_partitions() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (w1, mut w2) = (worker(&c, "w1").await, worker(&c, "w2").await);
    let mut events = w2.events().expect("events taken once");
    // w2 believes its first grants before w3 joins, so some of them are revoked confirmed.
    settled(&c, 2).await;
    workers_agree(&c, &[&w1, &w2]).await;
    let w3 = worker(&c, "w3").await;
    settled(&c, 3).await;
    let before = tokens(&workers_agree(&c, &[&w1, &w2, &w3]).await);
    let leaving = w2.session().0;
    let held: std::collections::BTreeSet<u32> =
        before.iter().filter(|(_, (owner, _))| *owner == leaving).map(|(p, _)| *p).collect();
    // Before the leave: when w3 joined, some of w2's grants were revoked, and this test's
    // application never releases a revoked partition, so each ended locally as
    // `Lost(DeadlineExpired)` when its lease ran out. Those are no longer w2's.
    // The worker's deadline task reports them; it may run a moment after the table settled.
    let mut revoked = std::collections::BTreeSet::new();
    let four_lost = async {
        while revoked.len() < 4 {
            if let WorkerEvent::Lost { partition, reason, .. } = events.recv().await.expect("events") {
                assert_eq!(reason, tenure::worker::LostReason::DeadlineExpired, "p{partition:?}");
                revoked.insert(partition.0);
            }
        }
    };
    tokio::time::timeout(PATIENCE, four_lost).await.expect("w3 took 4 of w2's 12, each reported lost");
    assert!(revoked.is_disjoint(&held), "a partition w2 still holds was lost: {revoked:?}");
    w2.leave().await.unwrap();
    // The partitions were given back, not left to expire: once the leave returns, the session
    // is gone from the table (an expiry would keep it, leaving, for a TTL), and the worker saw
    // each partition end as `Released`, never `Lost`.
    let status = c.status().await.unwrap();
    assert!(status.sessions.iter().all(|s| s.id != leaving), "{:?}", status.sessions);
    let mut released = std::collections::BTreeSet::new();
    while let Some(event) = events.try_recv() {
        match event {
            WorkerEvent::Released { partition, .. } => {
                released.insert(partition.0);
            }
            WorkerEvent::Lost { .. } => panic!("a leaving worker lost a partition: {event:?}"),
            _ => {}
        }
    }
    assert_eq!(released, held);
    let after = tokens(&settled(&c, 2).await);
    for (p, (owner, token)) in &before {
        if *owner == leaving {
            assert!(after[p].1 > *token);
        } else {
            assert_eq!(after[p], (*owner, *token), "p{p} of a staying worker changed");
        }
    }
    workers_agree(&c, &[&w1, &w3]).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_moves_only_what_balance_requires() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let workers = [worker(&c, "w1").await, worker(&c, "w2").await, worker(&c, "w3").await];
    settled(&c, 3).await;
    let before = tokens(&workers_agree(&c, &[&workers[0], &workers[1], &workers[2]]).await);
    let w4 = worker(&c, "w4").await;
    let after = tokens(&settled(&c, 4).await);
    let moved: Vec<_> = before.iter().filter(|(p, (o, _))| after[p].0 != *o).collect();
    assert_eq!(moved.len(), 6, "24 partitions: 8 each for 3 workers, 6 each for 4");
    for (p, _) in moved {
        assert_eq!(after[p].0, w4.session().0, "p{p} moved somewhere other than the newcomer");
    }
    workers_agree(&c, &[&workers[0], &workers[1], &workers[2], &w4]).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_leader_expires_no_lease_and_tokens_keep_growing() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cluster(dir.path()).await;
    let (mut w1, w2) = (worker(&c, "w1").await, worker(&c, "w2").await);
    let mut w1_events = w1.events().expect("events taken once");
    settled(&c, 2).await;
    let before = tokens(&workers_agree(&c, &[&w1, &w2]).await);
    let old = c.leader().unwrap();
    c.stop(old).await;
    let new = eventually("a new leader", || async { c.leader().filter(|l| *l != old) }).await;
    assert_ne!(new, old);
    // Workers find the new leader and keep renewing: two full TTLs later nothing has expired.
    let deadline = Instant::now() + TTL * 2;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        single_believers(&[&w1, &w2]);
    }
    let status = c.status().await.unwrap();
    assert_eq!(status.sessions.len(), 2, "no session expired because of the failover");
    assert_eq!(tokens(&status), before, "no partition was granted again");
    // With a 1 s TTL the worker may stop believing while no leader answers (its local lease is
    // the cautious one), but the coordinator never took anything away.
    while let Some(event) = w1_events.try_recv() {
        if let tenure::worker::WorkerEvent::Lost { reason, .. } = event {
            assert_eq!(reason, tenure::worker::LostReason::DeadlineExpired, "{event:?}");
        }
    }
    workers_agree(&c, &[&w1, &w2]).await;
    // A newcomer's grants are above every token issued before the failover.
    let max_before = before.values().map(|(_, t)| *t).max().unwrap();
    let w3 = worker(&c, "w3").await;
    let after = tokens(&settled(&c, 3).await);
    for (p, (owner, token)) in &after {
        if *owner == w3.session().0 {
            assert!(*token > max_before, "p{p}: token {token} not above {max_before}");
        }
    }
    c.restart(old).await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_every_node_keeps_every_grant_and_never_reissues_a_token() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    // Leases long enough that the workers reach the new leader before the leases it starts at its
    // election run out, even on a loaded machine (with 1 s, CI once saw w1's session lapse).
    let mut c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.lease_ttl = TTL * 3;
    })
    .await
    .unwrap();
    let (w1, w2) = (worker(&c, "w1").await, worker(&c, "w2").await);
    settled(&c, 2).await;
    let before = tokens(&workers_agree(&c, &[&w1, &w2]).await);
    for id in 1..=3 {
        c.stop(id).await;
    }
    for id in 1..=3 {
        c.restart(id).await.unwrap();
    }
    c.wait_for_leader(PATIENCE).await.expect("a leader after the restart");
    let status = eventually("the restarted cluster answers", || async { c.status().await.ok() }).await;
    assert_eq!(tokens(&status), before, "every acknowledged grant survived");
    // The workers reconnect and keep their sessions (the new leader started every lease anew).
    workers_agree(&c, &[&w1, &w2]).await;
    w2.abandon();
    let after = tokens(&settled(&c, 1).await);
    let max_before = before.values().map(|(_, t)| *t).max().unwrap();
    for (p, (owner, token)) in &after {
        let (old_owner, old_token) = before[p];
        if *token == old_token {
            assert_eq!(*owner, old_owner, "p{p}: token {token} names a different owner");
        } else {
            // Regranted: a new token, above every token issued before the restart.
            assert!(*token > max_before, "p{p} regranted with {token}, not above {max_before}");
        }
    }
    assert!(after.values().all(|(owner, _)| *owner == w1.session().0), "w1 holds everything");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_node_catches_up_from_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.snapshot_after_logs = 10;
    })
    .await
    .unwrap();
    let leader = c.wait_for_leader(PATIENCE).await.unwrap();
    let lagging = (1..=3).find(|id| *id != leader).unwrap();
    let stopped_at = c.node(lagging).unwrap().raft().metrics().borrow().last_applied.map(|l| l.index);
    c.stop(lagging).await;
    // Enough joins and leaves to move the log well past a snapshot and a purge.
    for i in 0..15 {
        let w = worker(&c, &format!("churn-{i}")).await;
        w.leave().await.unwrap();
    }
    let w = worker(&c, "stays").await;
    let want = tokens(&settled(&c, 1).await);
    let leader = c.leader().unwrap();
    let purged = eventually("the leader purged past what the lagging node has", || async {
        let m = c.node(leader)?.raft().metrics().borrow().clone();
        m.purged.map(|p| p.index).filter(|p| Some(*p) > stopped_at)
    })
    .await;
    assert!(Some(purged) > stopped_at);
    c.restart(lagging).await.unwrap();
    let node = c.node(lagging).unwrap().node.clone();
    eventually("the lagging node has the leader's table", || async {
        let applied = node.state.read().unwrap();
        let have: std::collections::BTreeMap<u32, (u64, u64)> = applied
            .default_table()
            .partitions()
            .iter()
            .enumerate()
            .map(|(p, r)| (p as u32, (r.owner.map(|s| s.0).unwrap_or(0), r.token.0)))
            .collect();
        (have == want).then_some(())
    })
    .await;
    let metrics = node.raft.metrics().borrow().clone();
    assert!(metrics.snapshot.is_some_and(|s| s.index >= purged), "the node caught up through a snapshot");
    drop(w);
    c.shutdown().await;
}
