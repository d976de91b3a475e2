//! Storage-side fencing: the check that makes a stale owner harmless.
//!
//! A lease tells a worker when to stop, but a worker that was paused (a GC pause, SIGSTOP, a
//! migrated VM) does not know it was paused. So storage decides: every write carries the
//! partition's fencing token, and storage accepts it iff `token >= highest[p]`, then raises
//! `highest[p]` to `token`. It is `>=`, not `>`: the current owner writes many times under one
//! token. The check and the write are one atomic step in every backend.
//!
//! "Lower than the highest seen" alone leaves a hole: a paused old owner that wakes after the new
//! grant but before the new owner's first write still gets in. So a new owner first
//! [raises the fence](FenceStore::raise) to its token, which writes no data, and only then reads
//! the state it resumes from ([`FenceStore::checkpoint`]). From then on the old owner is
//! rejected, and the new owner's view of the data cannot change behind its back.
//!
//! Architecture invariant: this module depends only on the core identifier types. It uses no
//! Raft, no gRPC, no coordinator code, so a storage service that only checks tokens builds
//! without them.
//!
//! ```
//! # tokio_test_block_on(async {
//! use tenure_core::fence::{FenceStore, MemoryFence, FenceError};
//! use tenure_core::ids::{FencingToken, PartitionId};
//! let store = MemoryFence::default();
//! let p = PartitionId(7);
//! store.write(p, FencingToken(10), b"k", b"from the old owner").await.unwrap();
//! store.raise(p, FencingToken(12)).await.unwrap();           // the new owner fences first
//! let err = store.write(p, FencingToken(10), b"k", b"late").await.unwrap_err();
//! assert!(matches!(err, FenceError::Stale { highest: FencingToken(12), .. }));
//! # });
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
//! # }
//! ```

mod batch;
mod dynamic;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "rocksdb")]
mod rocks;
#[cfg(feature = "testing")]
pub mod testing;

pub use batch::{BatchOp, FenceBatch};
pub use dynamic::{BoxFuture, DynFenceStore};
pub use memory::MemoryFence;
#[cfg(feature = "postgres")]
pub use postgres::PostgresFence;
#[cfg(feature = "rocksdb")]
pub use rocks::RocksFence;
/// The transaction [`PostgresFence::transaction`] hands the application's statements.
#[cfg(feature = "postgres")]
pub use tokio_postgres::Transaction as PostgresTransaction;

use crate::ids::{FencingToken, PartitionId};
use std::collections::HashMap;
use std::future::Future;

/// Why a fenced operation failed. `Stale` is final for the writer's token: stop acting on the
/// partition. `Backend` says nothing about ownership; the operation may be retried.
///
/// ```
/// use tenure_core::fence::{FenceError, FenceTable};
/// use tenure_core::ids::{FencingToken, PartitionId};
/// let mut fences = FenceTable::default();
/// fences.admit(PartitionId(1), FencingToken(9)).unwrap();
/// let err = fences.admit(PartitionId(1), FencingToken(8)).unwrap_err();
/// assert!(matches!(err, FenceError::Stale { highest: FencingToken(9), .. }));
/// assert_eq!(err.to_string(), "stale token 8 for p1: highest seen is 9");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    /// A newer owner has been seen for this partition: the writer lost it and must stop.
    #[error("stale token {token} for {partition}: highest seen is {highest}")]
    Stale { partition: PartitionId, token: FencingToken, highest: FencingToken },
    /// The backend failed; nothing was written.
    #[error("fenced store failed: {0}")]
    Backend(String),
}

/// The rule, once: accept iff `token >= highest`.
///
/// ```
/// use tenure_core::fence::admits;
/// use tenure_core::ids::FencingToken;
/// assert!(admits(None, FencingToken(1))); // nothing seen yet
/// assert!(admits(Some(FencingToken(5)), FencingToken(5))); // the same owner, writing again
/// assert!(!admits(Some(FencingToken(5)), FencingToken(4))); // an owner that was replaced
/// ```
pub fn admits(highest: Option<FencingToken>, token: FencingToken) -> bool {
    highest.is_none_or(|h| token >= h)
}

/// The highest token seen per partition, with the check in one place. Backends that keep their
/// table in memory use it; SQL backends express the same rule in the statement.
///
/// ```
/// use tenure_core::fence::FenceTable;
/// use tenure_core::ids::{FencingToken, PartitionId};
/// let mut fences = FenceTable::default();
/// let p = PartitionId(3);
/// fences.admit(p, FencingToken(20)).unwrap();
/// assert!(fences.check(p, FencingToken(19)).is_err());
/// assert!(fences.check(p, FencingToken(21)).is_ok()); // checking alone raises nothing
/// assert_eq!(fences.highest(p), Some(FencingToken(20)));
/// ```
#[derive(Clone, Debug, Default)]
pub struct FenceTable {
    highest: HashMap<PartitionId, FencingToken>,
}

impl FenceTable {
    pub fn highest(&self, partition: PartitionId) -> Option<FencingToken> {
        self.highest.get(&partition).copied()
    }

    /// Checks `token` and, if admitted, raises the partition's fence to it.
    pub fn admit(&mut self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        let highest = self.highest(partition);
        if !admits(highest, token) {
            return Err(FenceError::Stale { partition, token, highest: highest.unwrap_or_default() });
        }
        self.highest.insert(partition, token);
        Ok(())
    }

    /// Checks `token` without raising anything.
    pub fn check(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        let highest = self.highest(partition);
        if admits(highest, token) {
            Ok(())
        } else {
            Err(FenceError::Stale { partition, token, highest: highest.unwrap_or_default() })
        }
    }
}

/// A store that checks fencing tokens. Every method that takes a token checks it and raises the
/// partition's fence in the same atomic step as its write.
///
/// A backend implements five methods: [`raise`](FenceStore::raise), [`apply`](FenceStore::apply)
/// (a [`FenceBatch`] after one check, all or nothing), [`read`](FenceStore::read),
/// [`checkpoint`](FenceStore::checkpoint) and [`highest`](FenceStore::highest); single writes
/// and checkpoints are batches of one. [`testing`] (feature `testing`) is the conformance suite
/// a backend of one's own should pass. For a trait object, use [`DynFenceStore`].
///
/// Code written against the trait works with every backend, such as this fence-before-resume:
///
/// ```
/// # tokio_test_block_on(async {
/// use tenure_core::fence::{FenceError, FenceStore, MemoryFence};
/// use tenure_core::ids::{FencingToken, PartitionId};
/// async fn resume(s: &impl FenceStore, p: PartitionId, t: FencingToken) -> Result<Vec<u8>, FenceError> {
///     s.raise(p, t).await?;
///     Ok(s.checkpoint(p, t).await?.unwrap_or_default())
/// }
/// let store = MemoryFence::default();
/// store.save_checkpoint(PartitionId(0), FencingToken(4), b"offset=17").await.unwrap();
/// assert_eq!(resume(&store, PartitionId(0), FencingToken(9)).await.unwrap(), b"offset=17");
/// assert!(store.write(PartitionId(0), FencingToken(4), b"k", b"v").await.is_err());
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
pub trait FenceStore: Send + Sync {
    /// Raises the partition's fence to `token` without writing data (fence-before-resume).
    fn raise(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), FenceError>> + Send;

    /// Checks `token` once and applies every change of `batch` with the raised fence, in one
    /// atomic step: a stale token or a failure writes none of it.
    fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> impl Future<Output = Result<(), FenceError>> + Send;

    /// Reads a key (no token needed: reads cannot corrupt).
    fn read(
        &self,
        partition: PartitionId,
        key: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>, FenceError>> + Send;

    /// The partition's checkpoint, after checking that `token` is still admitted, so a new owner
    /// that raised its fence reads state no stale owner can change any more.
    fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, FenceError>> + Send;

    /// The highest token the store has seen for the partition.
    fn highest(
        &self,
        partition: PartitionId,
    ) -> impl Future<Output = Result<Option<FencingToken>, FenceError>> + Send;

    /// Writes `key = value` in the partition's key space under `token`: a batch of one.
    fn write(
        &self,
        partition: PartitionId,
        token: FencingToken,
        key: &[u8],
        value: &[u8],
    ) -> impl Future<Output = Result<(), FenceError>> + Send {
        let batch = FenceBatch::of_put(key, value);
        async move { self.apply(partition, token, &batch).await }
    }

    /// Stores the partition's checkpoint (say, the last committed offset) under `token`.
    fn save_checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
        checkpoint: &[u8],
    ) -> impl Future<Output = Result<(), FenceError>> + Send {
        let batch = FenceBatch::of_checkpoint(checkpoint);
        async move { self.apply(partition, token, &batch).await }
    }
}

/// A reference, `Box` or `Arc` of a store is the same store, so owners can hand out whichever
/// suits them (`Arc<dyn DynFenceStore>` included).
macro_rules! forward_fence_store {
    ($($ty:ty),*) => {$(
        impl<S: FenceStore + ?Sized> FenceStore for $ty {
            fn raise(&self, partition: PartitionId, token: FencingToken) -> impl Future<Output = Result<(), FenceError>> + Send {
                (**self).raise(partition, token)
            }
            fn apply(&self, partition: PartitionId, token: FencingToken, batch: &FenceBatch) -> impl Future<Output = Result<(), FenceError>> + Send {
                (**self).apply(partition, token, batch)
            }
            fn read(&self, partition: PartitionId, key: &[u8]) -> impl Future<Output = Result<Option<Vec<u8>>, FenceError>> + Send {
                (**self).read(partition, key)
            }
            fn checkpoint(&self, partition: PartitionId, token: FencingToken) -> impl Future<Output = Result<Option<Vec<u8>>, FenceError>> + Send {
                (**self).checkpoint(partition, token)
            }
            fn highest(&self, partition: PartitionId) -> impl Future<Output = Result<Option<FencingToken>, FenceError>> + Send {
                (**self).highest(partition)
            }
        }
    )*};
}

forward_fence_store!(&S, Box<S>, std::sync::Arc<S>);
