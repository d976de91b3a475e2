//! openraft's storage conformance suite against the RocksDB store, plus durability checks of our
//! own: what an apply batch wrote survives reopening the database.

use openraft::storage::RaftStateMachine;
use openraft::testing::{StoreBuilder, Suite};
use openraft::{Entry, EntryPayload, LogId, StorageError};
use tempfile::TempDir;
use tenure::ids::{FencingToken, PartitionId};
use tenure::ownership::{Command, OwnershipState, Response, SecretHash};
use tenure::raft::TypeConfig;
use tenure::store::{LogStore, StateMachineStore};

struct RocksBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for RocksBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError<u64>> {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = tenure::store::open(dir.path()).expect("open rocksdb");
        let sm = StateMachineStore::open(db.clone())?;
        Ok((dir, LogStore::new(db), sm))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(RocksBuilder).expect("the store conforms to openraft's storage contract");
}

/// The log a leader writes for: configure `partitions`, w1 joins, w2 joins, each join followed
/// by the placement decisions the leader proposes after it.
fn two_joins(partitions: u32) -> Vec<Entry<TypeConfig>> {
    let mut state = OwnershipState::default();
    let mut log = Vec::new();
    let mut commit = |state: &mut OwnershipState, command: Command| {
        let index = log.len() as u64 + 1;
        state.apply(index, &command);
        log.push(entry(index, command));
    };
    commit(
        &mut state,
        Command::Configure { partition_count: partitions, lease_ttl_ms: 1000, max_revoking: None },
    );
    for name in ["w1", "w2"] {
        let secret = SecretHash::of(&format!("secret-of-{name}"));
        commit(&mut state, Command::Join { name: name.into(), weight: 1, secret });
        while let Some(place) = tenure::planner::plan(&state, &Default::default()) {
            commit(&mut state, place);
        }
    }
    log
}

fn entry(index: u64, command: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(tenure::ownership::Proposal::default_namespace(command)),
    }
}

#[tokio::test]
async fn applied_rows_and_tokens_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = {
        let db = tenure::store::open(dir.path()).unwrap();
        let mut sm = StateMachineStore::open(db).unwrap();
        let responses = sm.apply(two_joins(8)).await.unwrap();
        assert!(matches!(responses[1], Response::Joined { .. }));
        assert_eq!(responses[2], Response::Placed { granted: 8, revoking: 0 });
        assert_eq!(responses[4], Response::Placed { granted: 0, revoking: 4 });
        let shared = sm.shared();
        let applied = shared.read().unwrap();
        applied
            .default_table()
            .partitions()
            .iter()
            .map(|r| (r.owner, r.token, r.revoking))
            .collect::<Vec<_>>()
    };
    assert!(tokens.iter().all(|(_, t, _)| *t == FencingToken(3)), "granted by the entry after w1's join");

    let db = tenure::store::open(dir.path()).unwrap();
    let mut sm = StateMachineStore::open(db.clone()).unwrap();
    let (last, _) = sm.applied_state().await.unwrap();
    assert_eq!(last.map(|l| l.index), Some(5));
    {
        let shared = sm.shared();
        let applied = shared.read().unwrap();
        let reloaded: Vec<_> =
            applied.default_table().partitions().iter().map(|r| (r.owner, r.token, r.revoking)).collect();
        assert_eq!(reloaded, tokens);
        assert_eq!(applied.default_table().sessions().len(), 2);
        assert_eq!(applied.default_table().next_session(), 2);
    }
    // A snapshot built now and installed into a fresh store reproduces the table.
    let mut builder = sm.get_snapshot_builder().await;
    let snapshot = openraft::RaftSnapshotBuilder::build_snapshot(&mut builder).await.unwrap();
    let other = tempfile::tempdir().unwrap();
    let mut fresh = StateMachineStore::open(tenure::store::open(other.path()).unwrap()).unwrap();
    fresh.install_snapshot(&snapshot.meta, snapshot.snapshot).await.unwrap();
    let shared = fresh.shared();
    let applied = shared.read().unwrap();
    assert_eq!(applied.default_table().partition(PartitionId(0)).unwrap().token, FencingToken(3));
    assert_eq!(applied.last_applied.map(|l| l.index), Some(5));
    drop(applied);
    drop(db);
}

/// A store with a configured table of `partitions` and two sessions, applied up to index 5.
async fn applied_store(dir: &std::path::Path, partitions: u32) -> StateMachineStore {
    let mut sm = StateMachineStore::open(tenure::store::open(dir).unwrap()).unwrap();
    sm.apply(two_joins(partitions)).await.unwrap();
    sm
}

#[tokio::test]
async fn snapshots_are_binary_with_a_format_version_and_an_unknown_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = applied_store(dir.path(), 4096).await;
    let mut builder = sm.get_snapshot_builder().await;
    let snapshot = openraft::RaftSnapshotBuilder::build_snapshot(&mut builder).await.unwrap();
    let data = snapshot.snapshot.into_inner();
    assert_eq!(data[0], tenure::codec::FORMAT);
    // The table alone as JSON rows, for scale: the binary snapshot is several times smaller.
    let json_rows = serde_json::to_vec(sm.shared().read().unwrap().default_table().partitions()).unwrap();
    assert!(
        data.len() * 3 < json_rows.len(),
        "{} bytes of snapshot, {} of JSON rows",
        data.len(),
        json_rows.len()
    );

    // What this build wrote is what it reads back, after reopening.
    drop((sm, builder));
    let mut reopened = StateMachineStore::open(tenure::store::open(dir.path()).unwrap()).unwrap();
    let current = reopened.get_current_snapshot().await.unwrap().expect("stored");
    assert_eq!(current.snapshot.into_inner(), data);

    // A snapshot of a format this build does not know stops the install with a storage
    // error (openraft then stops the node) and changes nothing.
    let other = tempfile::tempdir().unwrap();
    let mut fresh = applied_store(other.path(), 8).await;
    let mut unknown = data.clone();
    unknown[0] = tenure::codec::FORMAT + 1;
    let refused = fresh.install_snapshot(&snapshot.meta, Box::new(std::io::Cursor::new(unknown))).await;
    let message = refused.expect_err("an unknown format is refused").to_string();
    assert!(message.contains("format version"), "{message}");
    let garbage =
        fresh.install_snapshot(&snapshot.meta, Box::new(std::io::Cursor::new(vec![1, 0xff, 0xff]))).await;
    assert!(garbage.is_err());
    assert_eq!(
        fresh.shared().read().unwrap().default_table().partitions().len(),
        8,
        "the table is untouched"
    );
    assert_eq!(fresh.applied_state().await.unwrap().0.map(|l| l.index), Some(5));
}
