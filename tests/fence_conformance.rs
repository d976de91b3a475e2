//! The fence kit's conformance suite (`fence::testing`) against every store tenure ships: in
//! memory, RocksDB on disk (reopened from its directory) and a real PostgreSQL server (reopened
//! by connecting again). The same cases a user runs against a backend of their own.

use tenure::fence::testing::{self, Backend};
use tenure::fence::{FenceError, MemoryFence, PostgresFence, RocksFence};

/// Every case the suite has; a backend that keeps its data across restarts runs them all.
const ALL_CASES: usize = 9;

struct InMemory;

impl Backend for InMemory {
    type Store = MemoryFence;
    async fn fresh(&self, _: &'static str) -> Result<MemoryFence, FenceError> {
        Ok(MemoryFence::default())
    }
    async fn reopen(&self, _: &'static str, _: MemoryFence) -> Result<Option<MemoryFence>, FenceError> {
        Ok(None)
    }
}

/// One RocksDB directory per case, under a temporary directory that lives as long as the test.
struct OnDisk {
    root: tempfile::TempDir,
}

impl Backend for OnDisk {
    type Store = RocksFence;
    async fn fresh(&self, case: &'static str) -> Result<RocksFence, FenceError> {
        RocksFence::open(&self.root.path().join(case))
    }
    async fn reopen(&self, case: &'static str, store: RocksFence) -> Result<Option<RocksFence>, FenceError> {
        drop(store); // closes the database, as the process's exit would
        RocksFence::open(&self.root.path().join(case)).map(Some)
    }
}

fn postgres_base() -> String {
    std::env::var("TENURE_TEST_POSTGRES").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".into()
    })
}

/// A schema per case on the server `scripts/setup` starts, named for this run and the case.
struct OnPostgres {
    run: String,
}

impl OnPostgres {
    fn config(&self, case: &str) -> String {
        format!("{} options='-c search_path={}_{case}'", postgres_base(), self.run)
    }
}

impl Backend for OnPostgres {
    type Store = PostgresFence;
    async fn fresh(&self, case: &'static str) -> Result<PostgresFence, FenceError> {
        let backend =
            |e: tokio_postgres::Error| FenceError::Backend(format!("PostgreSQL (run scripts/setup): {e}"));
        let (client, conn) =
            tokio_postgres::connect(&postgres_base(), tokio_postgres::NoTls).await.map_err(backend)?;
        tokio::spawn(conn);
        client.batch_execute(&format!("CREATE SCHEMA {}_{case}", self.run)).await.map_err(backend)?;
        PostgresFence::connect(&self.config(case)).await
    }
    async fn reopen(
        &self,
        case: &'static str,
        store: PostgresFence,
    ) -> Result<Option<PostgresFence>, FenceError> {
        drop(store); // closes every pooled connection
        PostgresFence::connect(&self.config(case)).await.map(Some)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_passes_the_suite() {
    let passed = testing::run_all(&InMemory).await.unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(passed.len(), ALL_CASES - 1, "all but durability: {passed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rocksdb_store_passes_the_suite() {
    let backend = OnDisk { root: tempfile::tempdir().unwrap() };
    let passed = testing::run_all(&backend).await.unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(passed.len(), ALL_CASES, "{passed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_passes_the_suite() {
    let backend = OnPostgres { run: format!("tenure_kit_{}_{}", std::process::id(), rand::random::<u32>()) };
    let passed = testing::run_all(&backend).await.unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(passed.len(), ALL_CASES, "{passed:?}");
}
