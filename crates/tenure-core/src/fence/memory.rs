//! An in-memory fenced store, for tests and examples.

use super::{BatchOp, FenceBatch, FenceError, FenceStore, FenceTable};
use crate::ids::{FencingToken, PartitionId};
use std::collections::HashMap;
use std::sync::Mutex;

/// An in-memory [`FenceStore`], for tests and examples; it forgets everything when dropped.
///
/// Everything is behind one std mutex: nothing awaits while it is held, and one lock makes the
/// check and the write a single step.
///
/// ```
/// # tokio_test_block_on(async {
/// use tenure_core::fence::{FenceStore, MemoryFence};
/// use tenure_core::ids::{FencingToken, PartitionId};
/// let store = MemoryFence::default();
/// let p = PartitionId(2);
/// store.write(p, FencingToken(5), b"balance", b"100").await.unwrap();
/// assert_eq!(store.read(p, b"balance").await.unwrap(), Some(b"100".to_vec()));
/// assert_eq!(store.highest(p).await.unwrap(), Some(FencingToken(5)));
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Debug, Default)]
pub struct MemoryFence {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    fences: FenceTable,
    data: HashMap<(PartitionId, Vec<u8>), Vec<u8>>,
    checkpoints: HashMap<PartitionId, Vec<u8>>,
}

impl MemoryFence {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> Result<T, FenceError>) -> Result<T, FenceError> {
        let mut inner = self.inner.lock().map_err(|_| FenceError::Backend("lock poisoned".into()))?;
        f(&mut inner)
    }
}

impl FenceStore for MemoryFence {
    async fn raise(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        self.with(|i| i.fences.admit(partition, token))
    }

    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        self.with(|i| {
            i.fences.admit(partition, token)?;
            for op in batch.ops() {
                match op {
                    BatchOp::Put { key, value } => {
                        i.data.insert((partition, key.clone()), value.clone());
                    }
                    BatchOp::Delete { key } => {
                        i.data.remove(&(partition, key.clone()));
                    }
                }
            }
            if let Some(checkpoint) = batch.new_checkpoint() {
                i.checkpoints.insert(partition, checkpoint.to_vec());
            }
            Ok(())
        })
    }

    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        self.with(|i| Ok(i.data.get(&(partition, key.to_vec())).cloned()))
    }

    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        self.with(|i| {
            i.fences.check(partition, token)?;
            Ok(i.checkpoints.get(&partition).cloned())
        })
    }

    async fn highest(&self, partition: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        self.with(|i| Ok(i.fences.highest(partition)))
    }
}
