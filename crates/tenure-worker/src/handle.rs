//! The application's hold on one partition: its token, its range, its cancellation, and writes
//! through a fenced store that report a stale token as the partition lost.

use super::shared::Shared;
use crate::fence::{FenceError, FenceStore};
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
/// The documented order for a new owner is [`PartitionHandle::acquire`] first (raise the fence,
/// then read the checkpoint), then work, writing through the handle.
///
/// ```no_run
/// # async fn example(handle: tenure_worker::PartitionHandle) -> Result<(), tenure_worker::fence::FenceError> {
/// let store = tenure_worker::fence::MemoryFence::default(); // stands in for the application's store
/// let checkpoint = handle.acquire(&store).await?;
/// let mut next = checkpoint.map_or(0, |c| u64::from_be_bytes(c.try_into().unwrap()));
/// while handle.is_valid() {
///     handle.write(&store, &next.to_be_bytes(), b"processed").await?;
///     next += 1;
///     handle.save_checkpoint(&store, &next.to_be_bytes()).await?;
/// }
/// # Ok(()) }
/// ```
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

    /// Fence-before-resume: raises the partition's fence to this token, then reads the
    /// checkpoint to resume from. After this returns, no older owner can change that state.
    pub async fn acquire(&self, store: &impl FenceStore) -> Result<Option<Vec<u8>>, FenceError> {
        self.observe(store.raise(self.partition, self.token).await)?;
        self.observe(store.checkpoint(self.partition, self.token).await)
    }

    /// Writes under this partition's token; a stale token reports the partition lost.
    pub async fn write(&self, store: &impl FenceStore, key: &[u8], value: &[u8]) -> Result<(), FenceError> {
        self.observe(store.write(self.partition, self.token, key, value).await)
    }

    /// Saves the checkpoint under this partition's token.
    pub async fn save_checkpoint(
        &self,
        store: &impl FenceStore,
        checkpoint: &[u8],
    ) -> Result<(), FenceError> {
        self.observe(store.save_checkpoint(self.partition, self.token, checkpoint).await)
    }
}
