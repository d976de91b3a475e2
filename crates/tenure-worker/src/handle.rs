//! The application's hold on one partition: its token, its range, its cancellation; and, once
//! its fence is raised in a store, the [`Fenced`] value that writes under its token and reports
//! a stale token as the partition lost.

use super::shared::Shared;
use crate::fence::{FenceBatch, FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId};
use crate::keyspace::HashRange;
use std::sync::Weak;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// One owned partition, as the application holds it: its id, hash range and fencing token, and
/// a cancellation token that fires when the partition is revoked, lost or released. A handle
/// cannot outlive its token: once the partition moves on, [`PartitionHandle::is_valid`] is false
/// and the fenced store refuses its writes.
///
/// A handle does not write: [`PartitionHandle::acquire`] raises the partition's fence in a store
/// and reads the checkpoint, and returns the [`Fenced`] partition that writes. That is the
/// fence-before-resume order, by construction.
#[derive(Clone)]
pub struct PartitionHandle {
    pub(super) partition: PartitionId,
    pub(super) token: FencingToken,
    pub(super) range: HashRange,
    pub(super) cancel: CancellationToken,
    pub(super) shared: Weak<Shared>,
}

impl std::fmt::Debug for PartitionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionHandle")
            .field("partition", &self.partition)
            .field("token", &self.token)
            .field("range", &self.range)
            .finish()
    }
}

impl PartitionHandle {
    pub fn partition(&self) -> PartitionId {
        self.partition
    }
    pub fn token(&self) -> FencingToken {
        self.token
    }
    pub fn range(&self) -> HashRange {
        self.range
    }
    /// Fires when the partition is revoked, lost or released.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }
    /// Until when this worker may believe it holds the partition, by its monotonic clock.
    pub fn valid_until(&self) -> Option<Instant> {
        self.shared.upgrade().and_then(|s| s.valid_until(self.partition, self.token))
    }
    /// Whether the local lease is still running. A cheap early stop; the fenced store is what
    /// makes a late writer harmless.
    pub fn is_valid(&self) -> bool {
        !self.cancel.is_cancelled() && self.valid_until().is_some_and(|v| v > Instant::now())
    }

    /// Passes on the result of a fenced operation done under this handle's token with a store of
    /// the application's own (for PostgreSQL, `PostgresFence::transaction`); a stale rejection
    /// reports the partition lost, exactly as [`PartitionHandle::write`] does.
    pub fn observe<T>(&self, result: Result<T, FenceError>) -> Result<T, FenceError> {
        if let Err(FenceError::Stale { .. }) = &result {
            if let Some(shared) = self.shared.upgrade() {
                shared.fenced_out(self.partition, self.token);
            }
        }
        result
    }

    /// Fence-before-resume: raises the partition's fence in `store` to this handle's token, then
    /// reads the checkpoint to resume from, and returns the [`Fenced`] partition: the only value
    /// through which the worker library writes, applies batches or saves checkpoints for it. So a
    /// write before the raise cannot be expressed, and once this returns, no older owner can
    /// change the state it read.
    ///
    /// `store` is taken by value: pass `&store`, an `Arc` or a `Box`, whichever the task needs.
    pub async fn acquire<S: FenceStore>(&self, store: S) -> Result<Fenced<S>, FenceError> {
        self.observe(store.raise(self.partition, self.token).await)?;
        let resumed_from = self.observe(store.checkpoint(self.partition, self.token).await)?;
        Ok(Fenced { handle: self.clone(), store, resumed_from })
    }
}

/// A partition whose fence this worker raised in a store: the way to write for it. Every
/// operation carries the grant's token, and a stale rejection reports the partition lost (its
/// handle's cancellation fires, the application hears `Lost { reason: Fenced }`), so a worker
/// that was replaced learns it from its first refused write.
///
/// ```no_run
/// # async fn example(handle: tenure_worker::PartitionHandle) -> Result<(), tenure_worker::fence::FenceError> {
/// use tenure_worker::fence::{FenceBatch, MemoryFence};
/// let store = MemoryFence::default(); // stands in for the application's store
/// let fenced = handle.acquire(&store).await?;
/// let mut next = fenced.resumed_from().map_or(0, |c| u64::from_be_bytes(c.try_into().unwrap()));
/// while handle.is_valid() {
///     let mut batch = FenceBatch::new();
///     batch.put(&next.to_be_bytes(), b"processed").checkpoint(&(next + 1).to_be_bytes());
///     fenced.apply(&batch).await?; // the row and the offset, under one check
///     next += 1;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Fenced<S> {
    handle: PartitionHandle,
    store: S,
    resumed_from: Option<Vec<u8>>,
}

impl<S> std::fmt::Debug for Fenced<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fenced").field("handle", &self.handle).finish_non_exhaustive()
    }
}

impl<S: FenceStore> Fenced<S> {
    pub fn handle(&self) -> &PartitionHandle {
        &self.handle
    }
    pub fn partition(&self) -> PartitionId {
        self.handle.partition
    }
    pub fn token(&self) -> FencingToken {
        self.handle.token
    }
    /// The checkpoint read right after the fence was raised: where to resume from.
    pub fn resumed_from(&self) -> Option<&[u8]> {
        self.resumed_from.as_deref()
    }
    /// The store, for reads and for what the application does beside the fenced writes.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Writes `key = value` under the partition's token.
    pub async fn write(&self, key: &[u8], value: &[u8]) -> Result<(), FenceError> {
        self.handle.observe(self.store.write(self.partition(), self.token(), key, value).await)
    }

    /// Applies several changes (and a new checkpoint) under one check, all or nothing.
    pub async fn apply(&self, batch: &FenceBatch) -> Result<(), FenceError> {
        self.handle.observe(self.store.apply(self.partition(), self.token(), batch).await)
    }

    /// Saves the checkpoint under the partition's token.
    pub async fn save_checkpoint(&self, checkpoint: &[u8]) -> Result<(), FenceError> {
        self.handle.observe(self.store.save_checkpoint(self.partition(), self.token(), checkpoint).await)
    }

    /// Reads a key of the partition (reads need no token).
    pub async fn read(&self, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        self.store.read(self.partition(), key).await
    }
}

#[cfg(feature = "fence-postgres")]
impl<S> Fenced<S>
where
    S: FenceStore + std::ops::Deref<Target = crate::fence::PostgresFence>,
{
    /// Runs `work` in one PostgreSQL transaction that first checks this grant's fence: the
    /// application's own statements commit with the check or not at all (see
    /// [`PostgresFence::transaction`](crate::fence::PostgresFence::transaction)).
    pub async fn transaction<T, F>(&self, work: F) -> Result<T, FenceError>
    where
        F: for<'a> FnOnce(
            &'a crate::fence::PostgresTransaction<'a>,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, FenceError>> + Send + 'a>,
        >,
    {
        let done = self.store.transaction(self.partition(), self.token(), work).await;
        self.handle.observe(done)
    }
}
