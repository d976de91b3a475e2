//! A worker keeps its session while the coordinator leader is frozen with SIGSTOP for longer
//! than a lease: its heartbeats give up on the silent node within a quarter TTL, find the leader
//! the others elect, and renew there before the leases that leader started at its election run
//! out. Nothing is lost, no token changes, and the woken old leader changes nothing either.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::time::Duration;
use tenure::nemesis::{ProcessCluster, ServeSettings};
use tenure::worker::{Events, LostReason, PartitionHandle, Worker, WorkerEvent};
use tokio::time::Instant;

const PARTITIONS: u32 = 12;
const LEASE: Duration = Duration::from_millis(2000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_session_while_the_leader_is_frozen() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let settings = ServeSettings {
        binary: env!("CARGO_BIN_EXE_tenure").into(),
        partition_count: PARTITIONS,
        lease_ttl: LEASE,
        election_timeout: Duration::from_millis(300),
        snapshot_after_logs: 1000,
        insecure: false,
        status_pages: false,
    };
    let mut c = ProcessCluster::start(3, dir.path(), settings).await.expect("three serve processes");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    let mut w = Worker::join(c.worker_config("w1")).await.expect("joins");
    let mut events = w.events().expect("events taken once");
    let mut handles: BTreeMap<u32, PartitionHandle> = BTreeMap::new();
    let until = Instant::now() + PATIENCE;
    while handles.len() < PARTITIONS as usize {
        match tokio::time::timeout_at(until, events.recv()).await {
            Ok(Some(WorkerEvent::Granted(h))) => {
                handles.insert(h.partition().0, h);
            }
            other => panic!("before the freeze, expected only assignments, got {other:?}"),
        }
    }
    eventually("every partition confirmed", || async {
        handles.values().all(|h| h.is_valid()).then_some(())
    })
    .await;
    let before = w.owned();

    // The leader of this moment (it may have changed since the start), frozen at once.
    let frozen = c.wait_for_leader(PATIENCE).await.expect("a leader");
    c.signal_pause(frozen, true);
    let elected = eventually("the other two elect a leader", || async {
        c.leader().await.filter(|l| *l != frozen).map(|_| Instant::now())
    })
    .await;
    // A renewal sent after the election is confirmed for every partition: the new leader's
    // leases, which started no later than `elected`, now run from a later moment, so none can
    // have lapsed. If the election took longer than the worker's local lease, the worker stopped
    // believing in the meantime (lost by deadline) and believes again now, under the same token.
    let margin = LEASE / 5; // the library's default safety margin
    let renewed_after = |at: Instant, handles: &mut BTreeMap<u32, PartitionHandle>, events: &mut Events| {
        while let Some(e) = events.try_recv() {
            match e {
                WorkerEvent::Granted(h) => {
                    assert_eq!(Some(&h.token()), before.get(&h.partition()), "same token");
                    handles.insert(h.partition().0, h);
                }
                WorkerEvent::Lost { partition, token, reason: LostReason::DeadlineExpired } => {
                    assert_eq!(Some(&token), before.get(&partition));
                    handles.remove(&partition.0);
                }
                other => panic!("unexpected event across the freeze: {other:?}"),
            }
        }
        let all = handles.len() == PARTITIONS as usize
            && handles.values().all(|h| h.valid_until().is_some_and(|u| u > at + LEASE - margin));
        all.then_some(())
    };
    eventually("a renewal sent after the election is confirmed", || {
        let ready = renewed_after(elected, &mut handles, &mut events);
        async move { ready }
    })
    .await;
    let status = c.status().await.expect("the new leader answers");
    assert!(status.sessions.iter().any(|s| s.id == w.session().0), "the session survived");
    assert_eq!(w.owned(), before, "same partitions, same tokens");

    let term = status.term;
    c.signal_pause(frozen, false);
    let woken = Instant::now();
    eventually("a renewal sent after the old leader woke is confirmed", || {
        let ready = renewed_after(woken, &mut handles, &mut events);
        async move { ready }
    })
    .await;
    assert_eq!(w.owned(), before, "waking the old leader changed nothing");
    // The woken node learns of the newer leader and follows it; it does not campaign against it.
    eventually("every node, the woken one too, names one leader", || async {
        c.wait_for_leader(Duration::from_millis(100)).await.filter(|l| *l != frozen)
    })
    .await;
    let now = c.status().await.expect("the leader answers");
    assert_eq!(now.term, term, "waking the old leader started no election");
    c.shutdown().await;
}
