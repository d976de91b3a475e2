//! The fenced store as a trait object: one program that picks its backend at run time (memory
//! in tests, RocksDB or PostgreSQL in production) holds an `Arc<dyn DynFenceStore>`.
//!
//! [`FenceStore`] returns `impl Future`, which keeps backends simple to write but cannot be put
//! behind `dyn`. [`DynFenceStore`] is the same five operations with boxed futures; every
//! `FenceStore` is one, and `dyn DynFenceStore` is a `FenceStore` again, so code written against
//! `FenceStore` takes either. The rule itself is untouched: each call forwards to the backend's.

use super::{FenceBatch, FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId};
use std::future::Future;
use std::pin::Pin;

/// A boxed future that can move between threads.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`FenceStore`] with boxed futures, so it can be a trait object.
///
/// ```
/// # tokio_test_block_on(async {
/// use std::sync::Arc;
/// use tenure_core::fence::{DynFenceStore, FenceStore, MemoryFence};
/// use tenure_core::ids::{FencingToken, PartitionId};
/// let store: Arc<dyn DynFenceStore> = Arc::new(MemoryFence::default());
/// store.raise(PartitionId(1), FencingToken(8)).await.unwrap();
/// assert!(store.write(PartitionId(1), FencingToken(7), b"k", b"v").await.is_err());
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
pub trait DynFenceStore: Send + Sync {
    fn raise_boxed(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<(), FenceError>>;
    fn apply_boxed<'a>(
        &'a self,
        partition: PartitionId,
        token: FencingToken,
        batch: &'a FenceBatch,
    ) -> BoxFuture<'a, Result<(), FenceError>>;
    fn read_boxed<'a>(
        &'a self,
        partition: PartitionId,
        key: &'a [u8],
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, FenceError>>;
    fn checkpoint_boxed(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, FenceError>>;
    fn highest_boxed(
        &self,
        partition: PartitionId,
    ) -> BoxFuture<'_, Result<Option<FencingToken>, FenceError>>;
}

impl<S: FenceStore> DynFenceStore for S {
    fn raise_boxed(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<(), FenceError>> {
        Box::pin(self.raise(partition, token))
    }
    fn apply_boxed<'a>(
        &'a self,
        partition: PartitionId,
        token: FencingToken,
        batch: &'a FenceBatch,
    ) -> BoxFuture<'a, Result<(), FenceError>> {
        Box::pin(self.apply(partition, token, batch))
    }
    fn read_boxed<'a>(
        &'a self,
        partition: PartitionId,
        key: &'a [u8],
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, FenceError>> {
        Box::pin(self.read(partition, key))
    }
    fn checkpoint_boxed(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, FenceError>> {
        Box::pin(self.checkpoint(partition, token))
    }
    fn highest_boxed(
        &self,
        partition: PartitionId,
    ) -> BoxFuture<'_, Result<Option<FencingToken>, FenceError>> {
        Box::pin(self.highest(partition))
    }
}

impl FenceStore for dyn DynFenceStore + '_ {
    fn raise(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), FenceError>> + Send {
        self.raise_boxed(partition, token)
    }
    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        self.apply_boxed(partition, token, batch).await
    }
    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        self.read_boxed(partition, key).await
    }
    fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, FenceError>> + Send {
        self.checkpoint_boxed(partition, token)
    }
    fn highest(
        &self,
        partition: PartitionId,
    ) -> impl Future<Output = Result<Option<FencingToken>, FenceError>> + Send {
        self.highest_boxed(partition)
    }
}
