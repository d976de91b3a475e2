//! What the application is told about its partitions, and the bounded stream that tells it.
//!
//! The stream is bounded so that an application that stops reading cannot grow the worker's
//! memory without end. The background tasks never wait for the application, so when the
//! stream is full the worker gives up its session instead, as a Kafka consumer that stops
//! polling is put out of its group: every handle is cancelled at once (belief ends), the
//! heartbeats stop, and the coordinator expires the session one TTL later. The reader then
//! gets what was queued, a `Lost` for every partition it was told of and not yet told the end
//! of, and `SessionEnded { reason: SessionEnd::EventsOverflowed }`, so the rule "every
//! `Granted` is followed by exactly one `Lost` or `Released`" holds on that path too.

use super::{ClientError, LostReason, PartitionHandle};
use crate::ids::{FencingToken, PartitionId};
use std::collections::BTreeMap;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What the application is told, in order. Every [`WorkerEvent::Granted`] is followed, sooner
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
    Granted(PartitionHandle),
    /// Finish or checkpoint, then call [`crate::Worker::release`]. The handle's cancellation
    /// fires now.
    Revoking { partition: PartitionId, token: FencingToken },
    /// Already gone: stop at once.
    Lost { partition: PartitionId, token: FencingToken, reason: LostReason },
    /// Released by this worker.
    Released { partition: PartitionId, token: FencingToken },
    /// The session is over; every partition was reported lost or released before this.
    SessionEnded { reason: SessionEnd },
}

/// Why a session ended.
///
/// ```
/// use tenure_worker::{ClientError, SessionEnd};
/// let gone = SessionEnd::Gone(ClientError::SessionExpired("s4".into()));
/// assert_eq!(gone.to_string(), "session expired: s4");
/// assert!(SessionEnd::Left.is_own_doing() && !gone.is_own_doing());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// This worker left ([`crate::Worker::leave`] or a shutdown).
    Left,
    /// The coordinator no longer knows the session: it expired (no renewal reached it for a
    /// TTL), or an operator drained the worker. Join again to go on.
    Gone(ClientError),
    /// The application did not read its events and the bounded stream filled up: the worker
    /// gave the session up (see the module docs).
    EventsOverflowed,
}

impl SessionEnd {
    /// Whether this worker ended the session itself.
    pub fn is_own_doing(&self) -> bool {
        matches!(self, SessionEnd::Left)
    }
}

impl std::fmt::Display for SessionEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionEnd::Left => write!(f, "left"),
            SessionEnd::Gone(e) => write!(f, "{e}"),
            SessionEnd::EventsOverflowed => {
                write!(f, "the event stream overflowed; the session was given up")
            }
        }
    }
}

/// The sending half, held by the worker's tasks: never waits, and gives the session up when
/// the stream is full.
pub(crate) struct EventSender {
    tx: mpsc::Sender<WorkerEvent>,
    overflowed: CancellationToken,
}

impl EventSender {
    /// Sends `event`; `false` once the stream has overflowed (now or before), when the caller
    /// must give the session up.
    pub(crate) fn send(&self, event: WorkerEvent) -> bool {
        if self.overflowed.is_cancelled() {
            return false;
        }
        match self.tx.try_send(event) {
            Ok(()) => true,
            // The application dropped its stream: nobody is told anything any more.
            Err(mpsc::error::TrySendError::Closed(_)) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(
                    capacity = self.tx.max_capacity(),
                    "the application is not reading its events; giving the session up"
                );
                self.overflowed.cancel();
                false
            }
        }
    }
}

/// The worker's events, in order, from [`crate::Worker::events`]. Bounded (see the module
/// docs); read it promptly, or use [`crate::Runner`], which does.
pub struct Events {
    rx: mpsc::Receiver<WorkerEvent>,
    overflowed: CancellationToken,
    /// Partitions the reader was told are its own and not yet told the end of, so an overflow
    /// can still end each of them.
    open: BTreeMap<PartitionId, FencingToken>,
    /// What an overflow still owes the reader, handed out before the stream ends.
    owed: Vec<WorkerEvent>,
    finished: bool,
}

/// A bounded event stream of `capacity` events.
pub(crate) fn channel(capacity: usize) -> (EventSender, Events) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let overflowed = CancellationToken::new();
    let events = Events {
        rx,
        overflowed: overflowed.clone(),
        open: BTreeMap::new(),
        owed: Vec::new(),
        finished: false,
    };
    (EventSender { tx, overflowed }, events)
}

impl Events {
    /// A stream that has already ended: a placeholder for a worker not joined yet.
    pub fn closed() -> Events {
        let (_, events) = channel(1);
        events
    }

    /// The next event; `None` once the session is over and everything was read.
    pub async fn recv(&mut self) -> Option<WorkerEvent> {
        loop {
            if let Some(event) = self.take_ready() {
                return Some(event);
            }
            if self.finished {
                return None;
            }
            tokio::select! {
                event = self.rx.recv() => match event {
                    Some(event) => return Some(self.note(event)),
                    None => self.finished = true,
                },
                _ = self.overflowed.cancelled() => {}
            }
        }
    }

    /// The next event if one is ready now.
    pub fn try_recv(&mut self) -> Option<WorkerEvent> {
        self.take_ready()
    }

    /// An event already queued, or what an overflow owes once the queue is empty.
    fn take_ready(&mut self) -> Option<WorkerEvent> {
        if let Some(event) = self.owed.pop() {
            return Some(event);
        }
        if self.finished {
            return None;
        }
        match self.rx.try_recv() {
            Ok(event) => Some(self.note(event)),
            Err(_) if self.overflowed.is_cancelled() => {
                self.finished = true;
                self.owed.push(WorkerEvent::SessionEnded { reason: SessionEnd::EventsOverflowed });
                let open = std::mem::take(&mut self.open);
                self.owed.extend(open.into_iter().rev().map(|(partition, token)| WorkerEvent::Lost {
                    partition,
                    token,
                    reason: LostReason::SessionEnded,
                }));
                self.owed.pop()
            }
            Err(mpsc::error::TryRecvError::Disconnected) => {
                self.finished = true;
                None
            }
            Err(mpsc::error::TryRecvError::Empty) => None,
        }
    }

    fn note(&mut self, event: WorkerEvent) -> WorkerEvent {
        match &event {
            WorkerEvent::Granted(h) => {
                self.open.insert(h.partition(), h.token());
            }
            WorkerEvent::Lost { partition, token, .. } | WorkerEvent::Released { partition, token } => {
                if self.open.get(partition) == Some(token) {
                    self.open.remove(partition);
                }
            }
            WorkerEvent::Revoking { .. } | WorkerEvent::SessionEnded { .. } => {}
        }
        event
    }
}
