//! A fenced key-value store on RocksDB. The highest token per partition is persisted, so a
//! restarted store forgets nothing.
//!
//! Each operation reads the partition's fence and writes the new fence plus the data in one
//! synced write batch, under a lock that serialises operations on that partition, so the check
//! and the write are one step and a crash leaves both or neither.

use super::{admits, FenceError, FenceStore};
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
    db: Arc<rocksdb::DB>,
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
        Ok(RocksFence { db: Arc::new(db), stripes: (0..STRIPES).map(|_| Mutex::new(())).collect() })
    }

    fn highest_now(&self, p: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        let raw = self.db.get(fence_key(p)).map_err(backend)?;
        raw.map(|b| {
            let bytes: [u8; 8] =
                b.as_slice().try_into().map_err(|_| FenceError::Backend("corrupt fence row".into()))?;
            Ok(FencingToken(u64::from_be_bytes(bytes)))
        })
        .transpose()
    }

    /// Under the partition's lock: check `token`, then write the raised fence and `extra` rows in
    /// one synced batch.
    fn fenced_write(
        &self,
        p: PartitionId,
        token: FencingToken,
        extra: &[(Vec<u8>, &[u8])],
    ) -> Result<(), FenceError> {
        let _guard = self.stripes[p.0 as usize % STRIPES]
            .lock()
            .map_err(|_| FenceError::Backend("lock poisoned".into()))?;
        let highest = self.highest_now(p)?;
        if !admits(highest, token) {
            return Err(FenceError::Stale { partition: p, token, highest: highest.unwrap_or_default() });
        }
        let mut batch = rocksdb::WriteBatch::default();
        batch.put(fence_key(p), token.0.to_be_bytes());
        for (k, v) in extra {
            batch.put(k, v);
        }
        let mut options = rocksdb::WriteOptions::default();
        options.set_sync(true);
        self.db.write_opt(batch, &options).map_err(backend)
    }
}

impl FenceStore for RocksFence {
    async fn raise(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        self.fenced_write(partition, token, &[])
    }

    async fn write(
        &self,
        partition: PartitionId,
        token: FencingToken,
        key: &[u8],
        value: &[u8],
    ) -> Result<(), FenceError> {
        self.fenced_write(partition, token, &[(data_key(partition, key), value)])
    }

    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        self.db.get(data_key(partition, key)).map_err(backend)
    }

    async fn save_checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
        checkpoint: &[u8],
    ) -> Result<(), FenceError> {
        self.fenced_write(partition, token, &[(checkpoint_key(partition), checkpoint)])
    }

    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        let _guard = self.stripes[partition.0 as usize % STRIPES]
            .lock()
            .map_err(|_| FenceError::Backend("lock poisoned".into()))?;
        let highest = self.highest_now(partition)?;
        if !admits(highest, token) {
            return Err(FenceError::Stale { partition, token, highest: highest.unwrap_or_default() });
        }
        self.db.get(checkpoint_key(partition)).map_err(backend)
    }

    async fn highest(&self, partition: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        self.highest_now(partition)
    }
}
