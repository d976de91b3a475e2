//! openraft's storage conformance suite against the RocksDB store, plus durability checks of our
//! own: what an apply batch wrote survives reopening the database.

use openraft::storage::RaftStateMachine;
use openraft::testing::{StoreBuilder, Suite};
use openraft::{Entry, EntryPayload, LogId, StorageError};
use tempfile::TempDir;
use tenure::ids::{FencingToken, PartitionId};
use tenure::ownership::{Command, Response};
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

fn entry(index: u64, command: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(command),
    }
}

#[tokio::test]
async fn applied_rows_and_tokens_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = {
        let db = tenure::store::open(dir.path()).unwrap();
        let mut sm = StateMachineStore::open(db).unwrap();
        let responses = sm
            .apply(vec![
                entry(1, Command::Configure { partition_count: 8, lease_ttl_ms: 1000 }),
                entry(2, Command::Join { name: "w1".into(), weight: 1, secret: "s1".into() }),
                entry(3, Command::Join { name: "w2".into(), weight: 1, secret: "s2".into() }),
            ])
            .await
            .unwrap();
        assert!(matches!(responses[1], Response::Joined { .. }));
        let shared = sm.shared();
        let applied = shared.read().unwrap();
        applied.state.partitions().iter().map(|r| (r.owner, r.token, r.revoking)).collect::<Vec<_>>()
    };
    assert!(tokens.iter().all(|(_, t, _)| *t == FencingToken(2)));

    let db = tenure::store::open(dir.path()).unwrap();
    let mut sm = StateMachineStore::open(db.clone()).unwrap();
    let (last, _) = sm.applied_state().await.unwrap();
    assert_eq!(last.map(|l| l.index), Some(3));
    {
        let shared = sm.shared();
        let applied = shared.read().unwrap();
        let reloaded: Vec<_> =
            applied.state.partitions().iter().map(|r| (r.owner, r.token, r.revoking)).collect();
        assert_eq!(reloaded, tokens);
        assert_eq!(applied.state.sessions().len(), 2);
        assert_eq!(applied.state.next_session(), 2);
    }
    // A snapshot built now and installed into a fresh store reproduces the table.
    let mut builder = sm.get_snapshot_builder().await;
    let snapshot = openraft::RaftSnapshotBuilder::build_snapshot(&mut builder).await.unwrap();
    let other = tempfile::tempdir().unwrap();
    let mut fresh = StateMachineStore::open(tenure::store::open(other.path()).unwrap()).unwrap();
    fresh.install_snapshot(&snapshot.meta, snapshot.snapshot).await.unwrap();
    let shared = fresh.shared();
    let applied = shared.read().unwrap();
    assert_eq!(applied.state.partition(PartitionId(0)).unwrap().token, FencingToken(2));
    assert_eq!(applied.last_applied.map(|l| l.index), Some(3));
    drop(applied);
    drop(db);
}
