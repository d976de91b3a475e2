//! A stopped node's decisions read back from its RocksDB log (`store::replay_applied`), as the
//! fault harness records `tenure serve` processes: every replica replays to the same decisions
//! and to the table it persisted; a node whose log was purged says so instead of answering
//! with half a history.

mod common;

use common::*;
use std::collections::BTreeMap;
use tenure::ids::PartitionId;
use tenure::local_cluster::LocalCluster;
use tenure::ownership::Event;
use tenure::store::{replay_applied, ReplayError};

/// Replays `dir`, waiting (bounded) until the stopped node's background tasks, such as a
/// snapshot still being built, have let go of its database.
async fn replay(dir: &std::path::Path) -> Result<Vec<tenure::store::ReplayedEntry>, ReplayError> {
    let until = std::time::Instant::now() + PATIENCE;
    loop {
        match replay_applied(dir) {
            Err(ReplayError::Open { .. }) if std::time::Instant::now() < until => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            other => return other,
        }
    }
}

/// Three workers join, one leaves; enough entries for several snapshots at `snapshot_after`.
async fn some_history(dir: &std::path::Path, keep_whole_log: bool, snapshot_after: u64) -> LocalCluster {
    init_tracing();
    let c = LocalCluster::start(3, dir, |n| {
        fast(n);
        n.keep_whole_log = keep_whole_log;
        n.snapshot_after_logs = snapshot_after;
    })
    .await
    .expect("cluster starts");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    let mut workers = Vec::new();
    for name in ["w1", "w2", "w3"] {
        workers.push(worker(&c, name).await);
        settled(&c, workers.len()).await;
    }
    workers.pop().expect("w3").leave().await.expect("w3 leaves");
    settled(&c, 2).await;
    for w in workers {
        w.leave().await.expect("leaves");
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_replays_its_log_to_the_same_decisions_and_its_own_table() {
    let dir = tempfile::tempdir().unwrap();
    let c = some_history(dir.path(), true, 10).await;
    let status = c.status().await.expect("status");
    let dirs: Vec<_> = c.ids().into_iter().map(|id| c.data_dir(id).expect("a node")).collect();
    c.shutdown().await;

    let mut histories = Vec::new();
    for d in &dirs {
        // An error here includes "the replay ended elsewhere than the node's own table".
        histories.push(replay(d).await.expect("the whole log replays"));
    }
    // The leader's last answer was read before shutdown; every replica applied at least that far.
    for h in &histories {
        assert!(h.last().map_or(0, |e| e.index) > 0);
    }
    // Same index, same decisions, on every replica.
    let by_index = |h: &Vec<tenure::store::ReplayedEntry>| -> BTreeMap<u64, Vec<Event>> {
        h.iter().map(|e| (e.index, e.events.clone())).collect()
    };
    let first = by_index(&histories[0]);
    for h in &histories[1..] {
        for (index, events) in by_index(h) {
            if let Some(other) = first.get(&index) {
                assert_eq!(&events, other, "replicas disagree at index {index}");
            }
        }
    }
    // The most advanced replica's last grant of each partition carries the token the table
    // reported (nothing was granted after the status was read: every worker had left).
    let longest = histories.iter().max_by_key(|h| h.last().map_or(0, |e| e.index)).expect("three");
    let mut last_grant: BTreeMap<PartitionId, u64> = BTreeMap::new();
    for e in longest {
        for ev in &e.events {
            if let Event::Granted { partition, token, .. } = ev {
                last_grant.insert(*partition, token.0);
            }
        }
    }
    for row in &status.partitions {
        let p = PartitionId(row.partition);
        assert_eq!(last_grant.get(&p), Some(&row.token), "the last grant of {p} in the replay");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_log_is_reported_not_half_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let c = some_history(dir.path(), false, 5).await;
    let leader = c.leader().expect("a leader");
    let leader_dir = c.data_dir(leader).expect("a node");
    c.shutdown().await;
    match replay(&leader_dir).await {
        Err(ReplayError::Purged(index)) => assert!(index > 0),
        other => panic!("expected a purged log, got {:?}", other.map(|h| h.len())),
    }
}

/// Deletes log entry `index` from a stopped node's database, as a damaged disk might lose it.
async fn delete_entry(dir: &std::path::Path, index: u64) {
    let until = std::time::Instant::now() + PATIENCE;
    let db = loop {
        match tenure::store::open(dir) {
            Ok(db) => break db,
            Err(e) if std::time::Instant::now() < until => {
                tracing::debug!(error = %e, "database still held");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("cannot open {}: {e}", dir.display()),
        }
    };
    let log = db.cf_handle("log").expect("the log column family");
    assert!(db.get_cf(&log, index.to_be_bytes()).unwrap().is_some(), "entry {index} was there");
    db.delete_cf(&log, index.to_be_bytes()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_with_a_hole_or_without_its_first_entry_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let c = some_history(dir.path(), true, 1000).await;
    let (first, middle) = (c.data_dir(1).expect("node 1"), c.data_dir(2).expect("node 2"));
    c.shutdown().await;
    delete_entry(&first, 0).await;
    delete_entry(&middle, 3).await;
    assert!(matches!(replay(&first).await, Err(ReplayError::Missing(0))), "a log without its first entry");
    assert!(matches!(replay(&middle).await, Err(ReplayError::Missing(3))), "a log with a hole at 3");
}

/// Every entry on disk starts with the format version it was written in. A node that finds in
/// its own log a version this build does not read refuses to start, naming the version, rather
/// than guessing at the bytes; reading the log back says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_entry_of_an_unknown_format_stops_the_node_and_is_named() {
    use tenure::codec::{FormatError, FORMAT};
    let dir = tempfile::tempdir().unwrap();
    let mut c = some_history(dir.path(), true, 1000).await;
    let id = c.ids()[2];
    c.stop(id).await;
    let data = c.data_dir(id).expect("a node");

    let db = eventually("the stopped node's database to be free", || {
        let data = data.clone();
        async move { tenure::store::open(&data).ok() }
    })
    .await;
    let log = db.cf_handle("log").expect("the log's column family");
    type Row = (Box<[u8]>, Box<[u8]>);
    let entries: Vec<Row> =
        db.iterator_cf(log, rocksdb::IteratorMode::Start).map(|item| item.expect("readable")).collect();
    assert!(entries.len() > 5, "{} entries", entries.len());
    assert!(entries.iter().all(|(_, value)| value[0] == FORMAT), "every entry carries this build's format");
    // The last entry (what a starting node reads first) and the first (what a replay reads
    // first: the last may lie beyond what the node had applied, where a replay stops).
    for (key, value) in [entries.first(), entries.last()].into_iter().flatten() {
        let mut newer = value.to_vec();
        newer[0] = FORMAT + 1;
        db.put_cf(log, key, newer).expect("rewritten");
    }
    drop(db);

    let refused = c.restart(id).await.expect_err("a log this build cannot read stops the node");
    let message = refused.to_string();
    assert!(message.contains(&format!("format version {}", FORMAT + 1)), "{message}");
    match replay(&data).await {
        Err(ReplayError::Decode { source: FormatError::UnknownVersion(v), .. }) => assert_eq!(v, FORMAT + 1),
        other => panic!("replay read a log it cannot decode: {:?}", other.map(|e| e.len())),
    }
    c.shutdown().await;
}
