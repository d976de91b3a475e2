//! A fenced key-value store on RocksDB. The highest token per partition is persisted, so a
//! restarted store forgets nothing.
//!
//! Each operation reads the partition's fence and writes the new fence plus the data in one
//! synced write batch, under a lock that serialises operations on that partition, so the check
//! and the write are one step and a crash leaves both or neither. The work runs on Tokio's
//! blocking pool, never on a runtime thread.

use super::{admits, BatchOp, FenceBatch, FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Locks striped over partitions: enough to keep unrelated partitions apart, bounded in number.
const STRIPES: usize = 64;

/// A [`FenceStore`] on RocksDB. Every accepted operation is a synced write batch, and the highest
/// token per partition is stored with the data, so a reopened store still refuses old owners.
///
/// ```
/// # tokio_test_block_on(async {
/// use tenure_core::fence::{FenceStore, RocksFence};
/// use tenure_core::ids::{FencingToken, PartitionId};
/// let dir = tempfile::tempdir().unwrap();
/// let store = RocksFence::open(dir.path()).unwrap();
/// store.raise(PartitionId(1), FencingToken(30)).await.unwrap();
/// drop(store); // a restart
/// let store = RocksFence::open(dir.path()).unwrap();
/// assert!(store.write(PartitionId(1), FencingToken(29), b"k", b"v").await.is_err());
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
pub struct RocksFence {
    inner: Arc<Inner>,
}

struct Inner {
    db: rocksdb::DB,
    stripes: Vec<Mutex<()>>,
}

fn fence_key(p: PartitionId) -> Vec<u8> {
    let mut k = vec![b'f'];
    k.extend_from_slice(&p.0.to_be_bytes());
    k
}
fn data_key(p: PartitionId, key: &[u8]) -> Vec<u8> {
    let mut k = vec![b'd'];
    k.extend_from_slice(&p.0.to_be_bytes());
    k.extend_from_slice(key);
    k
}
fn checkpoint_key(p: PartitionId) -> Vec<u8> {
    let mut k = vec![b'c'];
    k.extend_from_slice(&p.0.to_be_bytes());
    k
}

fn backend(e: rocksdb::Error) -> FenceError {
    FenceError::Backend(e.to_string())
}

impl RocksFence {
    /// Opens (or creates) a fenced store in `dir`.
    pub fn open(dir: &Path) -> Result<RocksFence, FenceError> {
        let mut options = rocksdb::Options::default();
        options.create_if_missing(true);
        let db = rocksdb::DB::open(&options, dir).map_err(backend)?;
        let stripes = (0..STRIPES).map(|_| Mutex::new(())).collect();
        Ok(RocksFence { inner: Arc::new(Inner { db, stripes }) })
    }

    /// Runs `work` where blocking is allowed: RocksDB reads and synced writes wait on the disk,
    /// so inside a Tokio runtime they go to its blocking pool and never hold a runtime thread.
    /// A caller that stops waiting does not stop the work: like a write whose answer was lost,
    /// it may still be applied.
    async fn off_runtime<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Inner) -> Result<T, FenceError> + Send + 'static,
    ) -> Result<T, FenceError> {
        let inner = self.inner.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => runtime
                .spawn_blocking(move || work(&inner))
                .await
                .map_err(|e| FenceError::Backend(format!("the store's task failed: {e}")))?,
            Err(_) => work(&inner),
        }
    }
}

impl Inner {
    fn highest_now(&self, p: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        let raw = self.db.get(fence_key(p)).map_err(backend)?;
        raw.map(|b| {
            let bytes: [u8; 8] =
                b.as_slice().try_into().map_err(|_| FenceError::Backend("corrupt fence row".into()))?;
            Ok(FencingToken(u64::from_be_bytes(bytes)))
        })
        .transpose()
    }

    fn lock(&self, p: PartitionId) -> Result<std::sync::MutexGuard<'_, ()>, FenceError> {
        self.stripes[p.0 as usize % STRIPES].lock().map_err(|_| FenceError::Backend("lock poisoned".into()))
    }

    fn admitted(&self, p: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        let highest = self.highest_now(p)?;
        if !admits(highest, token) {
            return Err(FenceError::Stale { partition: p, token, highest: highest.unwrap_or_default() });
        }
        Ok(())
    }

    /// Under the partition's lock: check `token`, then write the raised fence and the batch in
    /// one synced write batch.
    fn fenced_write(
        &self,
        p: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        let _guard = self.lock(p)?;
        self.admitted(p, token)?;
        let mut rows = rocksdb::WriteBatch::default();
        rows.put(fence_key(p), token.0.to_be_bytes());
        for op in batch.ops() {
            match op {
                BatchOp::Put { key, value } => rows.put(data_key(p, key), value),
                BatchOp::Delete { key } => rows.delete(data_key(p, key)),
            }
        }
        if let Some(checkpoint) = batch.new_checkpoint() {
            rows.put(checkpoint_key(p), checkpoint);
        }
        let mut options = rocksdb::WriteOptions::default();
        options.set_sync(true);
        self.db.write_opt(rows, &options).map_err(backend)
    }
}

impl FenceStore for RocksFence {
    async fn raise(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        self.off_runtime(move |db| db.fenced_write(partition, token, &FenceBatch::new())).await
    }

    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        let batch = batch.clone();
        self.off_runtime(move |db| db.fenced_write(partition, token, &batch)).await
    }

    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        let key = data_key(partition, key);
        self.off_runtime(move |db| db.db.get(key).map_err(backend)).await
    }

    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        self.off_runtime(move |db| {
            let _guard = db.lock(partition)?;
            db.admitted(partition, token)?;
            db.db.get(checkpoint_key(partition)).map_err(backend)
        })
        .await
    }

    async fn highest(&self, partition: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        self.off_runtime(move |db| db.highest_now(partition)).await
    }
}
