//! The largest table end to end through real gRPC: 1,000,000 partitions and two workers. Every
//! message a worker or an operator reads stays within gRPC's default 4 MiB whatever a session
//! owns: heartbeat answers carry what changed (split over several messages when a change is
//! long), the status table comes in pages. Before, a worker that owned a few hundred thousand
//! partitions could never decode its heartbeat answer, although the leader had renewed it.
//!
//! A debug build moves a million rows slowly, so leases are long here and the waits generous;
//! how fast it goes is the benchmark's business (`cargo bench -- --only scale`).

mod common;

use common::*;
use std::collections::BTreeMap;
use std::time::Duration;
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::is_settled;
use tenure::local_cluster::LocalCluster;
use tenure::worker::{Worker, WorkerEvent};

const PARTITIONS: u32 = 1_000_000;
const WAIT: Duration = Duration::from_secs(240);

/// What the table gives `worker`'s session, not revoking, by partition.
fn rows_of(status: &tenure::proto::StatusResponse, worker: &Worker) -> BTreeMap<PartitionId, FencingToken> {
    status
        .partitions
        .iter()
        .filter(|r| r.owner == worker.session().0 && !r.revoking)
        .map(|r| (PartitionId(r.partition), FencingToken(r.token)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_million_partitions_with_two_workers_through_grpc() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let c = LocalCluster::start(3, dir.path(), |n| {
        fast(n);
        n.partition_count = PARTITIONS;
        n.lease_ttl = Duration::from_secs(60);
        n.election_timeout = Duration::from_millis(2000);
    })
    .await
    .expect("cluster starts");
    c.wait_for_leader(PATIENCE).await.expect("a leader");

    let mut a = worker(&c, "a").await;
    let mut events = a.events().expect("events taken once");
    let until = tokio::time::Instant::now() + WAIT;
    let mut sample = Vec::new();
    let mut assigned = 0;
    while assigned < PARTITIONS {
        let wait = until.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(wait, events.recv()).await.expect("assigned in time").expect("open") {
            WorkerEvent::Granted(h) => {
                assigned += 1;
                if h.partition().0 % 1000 == 0 {
                    sample.push(h);
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(a.owned().len(), PARTITIONS as usize, "a believes the whole table");
    let b = worker(&c, "b").await;
    // a is asked to give half of the table to b; it releases in a few large batches.
    let mut revoked = Vec::new();
    while revoked.len() < PARTITIONS as usize / 2 {
        let wait = until.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(wait, events.recv()).await.expect("revokes in time").expect("open") {
            WorkerEvent::Revoking { partition, .. } => revoked.push(partition),
            other => panic!("unexpected {other:?}"),
        }
    }
    for batch in revoked.chunks(125_000) {
        a.release(batch).await.expect("released");
    }
    // Every row, read over several pages; each worker believes exactly its half.
    // Polled every half second: each look reads a million rows and both workers' beliefs.
    let until = tokio::time::Instant::now() + WAIT;
    let status = loop {
        if let Ok(status) = c.status().await {
            if is_settled(&status, 2)
                && a.owned() == rows_of(&status, &a)
                && b.owned() == rows_of(&status, &b)
            {
                break status;
            }
        }
        assert!(tokio::time::Instant::now() < until, "a and b never each believed their half");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(status.partitions.len(), PARTITIONS as usize);
    assert_eq!(a.owned().len(), PARTITIONS as usize / 2);
    let held_by_b = b.owned();
    assert!(revoked.iter().all(|p| held_by_b.contains_key(p)));
    // Steady answers carry nothing, yet keep renewing: the lease of a partition that stayed
    // with a moves forward with later heartbeats.
    let handle = sample.into_iter().find(|h| h.is_valid()).expect("a handle that a still holds");
    let before = handle.valid_until().expect("believed");
    eventually_within(WAIT, "a later heartbeat renews a's lease", || async {
        handle.valid_until().filter(|v| *v > before)
    })
    .await;
    c.shutdown().await;
}
