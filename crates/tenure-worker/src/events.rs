//! What the application is told about its partitions.

use super::{LostReason, PartitionHandle};
use crate::ids::{FencingToken, PartitionId};

/// What the application is told, in order. Every [`WorkerEvent::Assigned`] is followed, sooner
/// or later, by exactly one terminal event for the same partition and token: `Lost` or
/// `Released`.
///
/// ```
/// use tenure_worker::ids::{FencingToken, PartitionId};
/// use tenure_worker::WorkerEvent;
/// fn ended(event: &WorkerEvent) -> Option<PartitionId> {
///     match event {
///         WorkerEvent::Lost { partition, .. } | WorkerEvent::Released { partition, .. } => {
///             Some(*partition)
///         }
///         _ => None,
///     }
/// }
/// let released = WorkerEvent::Released { partition: PartitionId(3), token: FencingToken(8) };
/// assert_eq!(ended(&released), Some(PartitionId(3)));
/// ```
#[derive(Clone, Debug)]
pub enum WorkerEvent {
    /// The partition is yours: act on it through the handle, under its token.
    Assigned(PartitionHandle),
    /// Finish or checkpoint, then call [`Worker::release`]. The handle's cancellation fires now.
    Revoking { partition: PartitionId, token: FencingToken },
    /// Already gone: stop at once.
    Lost { partition: PartitionId, token: FencingToken, reason: LostReason },
    /// Released by this worker.
    Released { partition: PartitionId, token: FencingToken },
    /// The session is over; every partition was reported lost or released before this.
    SessionEnded { reason: String },
}
