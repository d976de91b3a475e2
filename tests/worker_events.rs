//! The worker library's event paths on a real cluster: assigned, revoking then released, lost by
//! deadline (coordinator unreachable), and lost by a fencing rejection.

mod common;

use common::*;
use std::collections::BTreeMap;
use tenure::fence::{FenceError, FenceStore, MemoryFence};
use tenure::ids::{FencingToken, PartitionId};
use tenure::worker::{Events, LostReason, PartitionHandle, WorkerEvent};

async fn next(events: &mut Events) -> WorkerEvent {
    tokio::time::timeout(PATIENCE, events.recv()).await.expect("an event in time").expect("stream open")
}

/// Collects `Granted` handles until `n` partitions are held.
async fn assigned(events: &mut Events, n: usize) -> BTreeMap<PartitionId, PartitionHandle> {
    let mut handles = BTreeMap::new();
    while handles.len() < n {
        match next(events).await {
            WorkerEvent::Granted(h) => {
                handles.insert(h.partition(), h);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    handles
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_fires_the_cancellation_and_release_is_the_one_terminal_event() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let mut w1 = worker(&c, "w1").await;
    let mut events = w1.events().expect("events taken once");
    let handles = assigned(&mut events, 24).await;
    assert!(handles.values().all(|h| h.is_valid()));

    let _w2 = worker(&c, "w2").await;
    let mut revoked = Vec::new();
    while revoked.len() < 12 {
        match next(&mut events).await {
            WorkerEvent::Revoking { partition, token } => {
                let h = &handles[&partition];
                assert_eq!(h.token(), token);
                assert!(h.cancellation().is_cancelled(), "the handle's cancellation fires on revoke");
                revoked.push(partition);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    w1.release(&revoked).await.unwrap();
    let mut terminal = BTreeMap::new();
    while terminal.len() < 12 {
        match next(&mut events).await {
            WorkerEvent::Released { partition, token } => {
                assert_eq!(handles[&partition].token(), token);
                assert!(terminal.insert(partition, token).is_none(), "{partition} ended twice");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    settled(&c, 2).await;
    assert!(events.try_recv().is_none(), "no further events for the released partitions");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_coordinator_means_lost_by_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cluster(dir.path()).await;
    let mut w = worker(&c, "w1").await;
    let mut events = w.events().expect("events taken once");
    let handles = assigned(&mut events, 24).await;
    for id in 1..=3 {
        c.stop(id).await;
    }
    let mut lost = 0;
    while lost < 24 {
        match next(&mut events).await {
            WorkerEvent::Lost { partition, token, reason } => {
                assert_eq!(reason, LostReason::DeadlineExpired);
                assert_eq!(handles[&partition].token(), token);
                assert!(!handles[&partition].is_valid());
                lost += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(w.owned().is_empty());
    w.abandon();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_rejection_reports_the_partition_lost() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let mut w = worker(&c, "w1").await;
    let mut events = w.events().expect("events taken once");
    let handles = assigned(&mut events, 24).await;
    let store = MemoryFence::default();
    let h = &handles[&PartitionId(5)];
    let fenced = h.acquire(&store).await.unwrap();
    assert_eq!(fenced.resumed_from(), None, "no checkpoint yet");
    fenced.write(b"k", b"v1").await.unwrap();
    fenced.save_checkpoint(b"offset=1").await.unwrap();

    // Someone with a newer grant fences the partition (as a new owner would).
    store.raise(PartitionId(5), FencingToken(h.token().0 + 1000)).await.unwrap();
    let err = fenced.write(b"k", b"v2").await.unwrap_err();
    assert!(matches!(err, FenceError::Stale { .. }));
    match next(&mut events).await {
        WorkerEvent::Lost { partition, reason, .. } => {
            assert_eq!((partition, reason), (PartitionId(5), LostReason::Fenced));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(!h.is_valid());
    assert!(h.cancellation().is_cancelled());
    assert!(!w.owned().contains_key(&PartitionId(5)));
    assert_eq!(store.read(PartitionId(5), b"k").await.unwrap().as_deref(), Some(&b"v1"[..]));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_follows_the_table_for_any_key() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let router = tenure::worker::Router::follow(c.client());
    let (w1, w2) = (worker(&c, "w1").await, worker(&c, "w2").await);
    let status = settled(&c, 2).await;
    let space = tenure::keyspace::KeySpace::new(status.partition_count).unwrap();
    let keys: Vec<String> = (0..50).map(|i| format!("customer-{i}")).collect();
    eventually("the router agrees with the table for every key", || async {
        keys.iter()
            .all(|k| {
                let p = space.partition_of_key(k.as_bytes());
                let row = &status.partitions[p.0 as usize];
                router.route(k.as_bytes()).is_some_and(|r| {
                    r.partition == p && r.session.0 == row.owner && r.token.0 == row.token && !r.revoking
                })
            })
            .then_some(())
    })
    .await;
    let names: std::collections::BTreeSet<String> =
        keys.iter().filter_map(|k| router.route(k.as_bytes())).map(|r| r.worker).collect();
    assert_eq!(names, ["w1", "w2"].into_iter().map(String::from).collect());
    drop((w1, w2));
    c.shutdown().await;
}
