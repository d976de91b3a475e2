//! The worker library: join a cluster, keep the session's leases renewed, and tell the
//! application which partitions it may act on.
//!
//! The invariant this module keeps is the worker's half of "one believer": a partition is
//! believed held only until `t_send + ttl - safety_margin`, where `t_send` is when the renewal
//! that confirmed it was *sent*, on this process's monotonic clock. The coordinator counts the
//! same lease from when it *received* that renewal, which is later, so the worker stops believing
//! before the coordinator can expire it, even if the coordinator is unreachable. A partition
//! announced by the ownership stream is not believed until a heartbeat sent after the
//! announcement confirms it.
//!
//! Heartbeats, the ownership stream and the deadline check run on their own tasks; application
//! code only reads events, so it can never delay a renewal.
//!
//! ```no_run
//! # async fn example() -> Result<(), tenure::worker::ClientError> {
//! use tenure::worker::{Worker, WorkerConfig, WorkerEvent};
//! let mut worker = Worker::join(WorkerConfig::new(vec!["127.0.0.1:7001".into()], "billing-1")).await?;
//! let mut events = worker.events();
//! while let Some(event) = events.recv().await {
//!     match event {
//!         WorkerEvent::Assigned(handle) => println!("own {} under {}", handle.partition(), handle.token()),
//!         WorkerEvent::Revoking { partition, .. } => { worker.release(&[partition]).await?; }
//!         WorkerEvent::Lost { partition, .. } => println!("stop {partition} now"),
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```

mod belief;
mod client;
mod router;

pub use belief::{Belief, Change, End, Held, LostReason};

pub use client::{Client, ClientError};
pub use router::{Route, Router};

use crate::fence::{FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::keyspace::{HashRange, KeySpace};
use crate::proto;
use crate::proto::ownership_event::Kind;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

/// The first pause after a failed heartbeat or stream; pauses double from here.
const RETRY_FIRST: Duration = Duration::from_millis(20);

/// Pauses between retries: from [`RETRY_FIRST`], doubling up to `most`, with jitter so that
/// many workers cut off together do not come back in step; endless (the caller starts a new
/// one after a success).
fn retry_pauses(most: Duration) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(RETRY_FIRST.min(most))
        .with_max_delay(most)
        .with_jitter()
        .without_max_times()
        .build()
        .map(move |d| d.min(most))
}

/// How a worker joins and how cautious it is. [`WorkerConfig::new`] sets weight 1 and leaves the
/// timings to their defaults, which follow the cluster's lease TTL.
///
/// ```
/// use std::time::Duration;
/// use tenure::worker::WorkerConfig;
/// let nodes = vec!["10.0.0.1:7001".to_string(), "10.0.0.2:7001".to_string()];
/// let mut config = WorkerConfig::new(nodes, "billing-1");
/// config.weight = 2; // about twice the partitions of a weight-1 worker
/// config.safety_margin = Some(Duration::from_millis(500));
/// assert_eq!(config.heartbeat_interval, None); // TTL / 4
/// ```
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub coordinators: Vec<String>,
    /// Stable across restarts, so the cluster recognises the worker.
    pub name: String,
    pub weight: u32,
    /// Subtracted from every local lease to cover clock-rate drift; default TTL / 5.
    pub safety_margin: Option<Duration>,
    /// Time between heartbeats; default TTL / 4.
    pub heartbeat_interval: Option<Duration>,
    /// Source address for connections to the coordinators, on hosts with several addresses.
    pub dial_from: Option<std::net::IpAddr>,
    /// How connections to the coordinators are opened; TCP unless a simulation says otherwise.
    pub dialer: crate::transport::Dialer,
}

impl WorkerConfig {
    pub fn new(coordinators: Vec<String>, name: impl Into<String>) -> Self {
        WorkerConfig {
            coordinators,
            name: name.into(),
            weight: 1,
            safety_margin: None,
            heartbeat_interval: None,
            dial_from: None,
            dialer: crate::transport::Dialer::tcp(),
        }
    }
}

/// What the application is told, in order. Every [`WorkerEvent::Assigned`] is followed, sooner
/// or later, by exactly one terminal event for the same partition and token: `Lost` or
/// `Released`.
///
/// ```
/// use tenure::ids::{FencingToken, PartitionId};
/// use tenure::worker::WorkerEvent;
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

/// The worker's end of a `Heartbeats` stream to the leader.
struct HeartbeatStream {
    /// The node that took the stream: avoided next time if it stops answering.
    addr: String,
    requests: mpsc::Sender<proto::HeartbeatRequest>,
    answers: tonic::Streaming<proto::HeartbeatResponse>,
    /// What this stream's answers renew, built from the changes each answer carries.
    renewing: BTreeMap<u32, u64>,
}

impl HeartbeatStream {
    /// Opens a stream on the leader, following redirects but never waiting: the heartbeat loop
    /// paces its own retries against the lease deadline.
    async fn open(client: &Client, per_node: Duration) -> Result<HeartbeatStream, ClientError> {
        let (addr, (requests, answers)) = client
            .call_without_waiting(per_node, |mut c| async move {
                let (requests, outgoing) = mpsc::channel(1);
                let answers = c.heartbeats(tokio_stream::wrappers::ReceiverStream::new(outgoing)).await?;
                Ok(answers.map(|answers| (requests, answers)))
            })
            .await?;
        Ok(HeartbeatStream { addr, requests, answers, renewing: BTreeMap::new() })
    }

    /// Sends one heartbeat and waits for its whole answer (the changes since the stream's last
    /// one, over as many messages as they take); returns every grant it renewed. A refusal that
    /// names another leader points the client there.
    async fn beat(
        &mut self,
        client: &Client,
        request: proto::HeartbeatRequest,
    ) -> Result<Vec<proto::PartitionLease>, ClientError> {
        self.requests
            .send(request)
            .await
            .map_err(|_| ClientError::Unavailable("heartbeat stream closed".into()))?;
        loop {
            match self.answers.message().await {
                Ok(Some(answer)) => {
                    for partition in answer.dropped {
                        self.renewing.remove(&partition);
                    }
                    self.renewing.extend(answer.renewed.iter().map(|l| (l.partition, l.token)));
                    if !answer.more {
                        let renewing = self.renewing.iter();
                        return Ok(renewing
                            .map(|(&partition, &token)| proto::PartitionLease { partition, token })
                            .collect());
                    }
                }
                Ok(None) => return Err(ClientError::Unavailable("heartbeat stream ended".into())),
                Err(status) => {
                    client.judge(&status, &self.addr)?;
                    return Err(ClientError::Unavailable(status.message().to_string()));
                }
            }
        }
    }
}

/// What the session believes, and the cancellation of each handle given to the application.
struct Local {
    belief: Belief,
    /// The cancellation of each confirmed grant's handles, a child of the session's token.
    handles: BTreeMap<PartitionId, (FencingToken, CancellationToken)>,
}

pub(crate) struct Shared {
    /// One lock for belief and handles, held while the changes are reported, so the application
    /// sees every partition's events in the order they happened.
    local: Mutex<Local>,
    // Unbounded on purpose: the background tasks must never wait for the application. The number
    // of pending events is bounded by partitions times transitions.
    events: mpsc::UnboundedSender<WorkerEvent>,
    keyspace: KeySpace,
    ttl: Duration,
    kick: Notify,
    /// Raised when a lease was confirmed for the first time: the deadline task looks again.
    confirmed: Notify,
    /// Raised when the heartbeats are answered by another node than the one the ownership
    /// stream is on: reopen the stream.
    moved: Notify,
    /// The node the ownership stream is open on, if it is open.
    watching: Mutex<Option<String>>,
    session_over: CancellationToken,
}

impl Shared {
    fn new(
        belief: Belief,
        keyspace: KeySpace,
        events: mpsc::UnboundedSender<WorkerEvent>,
        session_over: CancellationToken,
    ) -> Shared {
        Shared {
            ttl: belief.ttl(),
            local: Mutex::new(Local { belief, handles: BTreeMap::new() }),
            events,
            keyspace,
            kick: Notify::new(),
            confirmed: Notify::new(),
            moved: Notify::new(),
            watching: Mutex::new(None),
            session_over,
        }
    }

    fn emit(&self, event: WorkerEvent) {
        let _ = self.events.send(event);
    }

    fn watching_at(&self, addr: Option<&str>) {
        *self.watching.lock().expect("worker lock poisoned") = addr.map(str::to_string);
    }

    /// The heartbeats were answered at `addr`: if the ownership stream is open elsewhere, it
    /// is told to move too.
    fn heartbeats_at(&self, addr: &str) {
        let watching = self.watching.lock().expect("worker lock poisoned");
        if watching.as_deref().is_some_and(|w| w != addr) {
            self.moved.notify_one();
        }
    }

    /// Runs one step of the belief rules and reports what it changed: events for the
    /// application, cancelled handles, a kick for the heartbeat task.
    fn step<T>(self: &Arc<Self>, f: impl FnOnce(&mut Belief, Instant) -> (T, Vec<Change>)) -> T {
        let mut local = self.local.lock().expect("worker lock poisoned");
        let (out, changes) = f(&mut local.belief, Instant::now());
        for change in changes {
            match change {
                Change::Announced { .. } => self.kick.notify_one(),
                Change::Unreleased { .. } => {} // returned by `renewed`
                Change::Assigned { partition, token, .. } => {
                    let cancel = self.session_over.child_token();
                    if let Some((_, old)) = local.handles.insert(partition, (token, cancel.clone())) {
                        old.cancel();
                    }
                    self.confirmed.notify_one();
                    let range = self.keyspace.range(partition).unwrap_or(HashRange { start: 0, end: 0 });
                    self.emit(WorkerEvent::Assigned(PartitionHandle {
                        partition,
                        token,
                        range,
                        cancel,
                        shared: Arc::downgrade(self),
                    }));
                }
                Change::Revoking { partition, token } => {
                    if let Some((_, cancel)) = local.handles.get(&partition).filter(|(t, _)| *t == token) {
                        cancel.cancel();
                    }
                    self.emit(WorkerEvent::Revoking { partition, token });
                }
                Change::Ended { partition, token, end } => {
                    if local.handles.get(&partition).is_some_and(|(t, _)| *t == token) {
                        let (_, cancel) = local.handles.remove(&partition).expect("present");
                        cancel.cancel();
                    }
                    self.emit(match end {
                        End::Released => WorkerEvent::Released { partition, token },
                        End::Lost(reason) => WorkerEvent::Lost { partition, token, reason },
                    });
                }
            }
        }
        out
    }

    /// Takes in a heartbeat's answer; returns the grants this worker withdrew that the
    /// coordinator still renews (their release has to be sent again).
    fn renewed(self: &Arc<Self>, sent: Instant, renewed: &[proto::PartitionLease]) -> Vec<(u32, u64)> {
        let leases = renewed.iter().map(|l| (PartitionId(l.partition), FencingToken(l.token)));
        self.step(|b, now| {
            let changes = b.renewed(sent, now, leases);
            let unreleased = changes
                .iter()
                .filter_map(|c| match c {
                    Change::Unreleased { partition, token } => Some((partition.0, token.0)),
                    _ => None,
                })
                .collect();
            (unreleased, changes)
        })
    }

    /// Stops believing in `partitions` (every held one when `None`) before the coordinator is
    /// told they are given up: their handles are cancelled and the application is told
    /// `Released` now. Returns what was withdrawn.
    fn withdraw(self: &Arc<Self>, partitions: Option<&[PartitionId]>) -> BTreeMap<PartitionId, FencingToken> {
        self.step(|b, now| b.withdraw(partitions, now))
    }

    /// The release of `partitions` was answered or failed: see [`Belief::release_settled`].
    fn release_settled(&self, partitions: &[PartitionId]) {
        let mut local = self.local.lock().expect("worker lock poisoned");
        local.belief.release_settled(partitions, Instant::now());
    }

    /// Drops the grant `token` of `partition` after a release.
    #[cfg(test)]
    fn released(self: &Arc<Self>, partition: PartitionId, token: FencingToken) {
        self.step(|b, now| ((), b.released(partition, token, now)));
    }

    fn streamed(self: &Arc<Self>, event: &proto::OwnershipEvent) {
        let (partition, token) = (PartitionId(event.partition), FencingToken(event.token));
        self.step(|b, now| {
            let changes = match Kind::try_from(event.kind).unwrap_or(Kind::Unspecified) {
                Kind::Assigned => b.announced(partition, token, now),
                Kind::Revoking => b.revoking(partition, token),
                Kind::Lost => b.lost(partition, token, now),
                Kind::Released => b.released(partition, token, now),
                Kind::Unspecified => Vec::new(),
            };
            ((), changes)
        });
    }

    /// The fenced store rejected `token`: the partition is lost, whatever the lease says.
    fn fenced_out(self: &Arc<Self>, partition: PartitionId, token: FencingToken) {
        self.step(|b, now| ((), b.fenced(partition, token, now)));
    }

    fn valid_until(&self, partition: PartitionId, token: FencingToken) -> Option<Instant> {
        self.local.lock().expect("worker lock poisoned").belief.valid_until(partition, token)
    }

    /// Drops every partition whose local lease has run out; returns the next deadline.
    fn check_deadlines(self: &Arc<Self>, now: Instant) -> Option<Instant> {
        self.step(|b, _| {
            let changes = b.expire(now);
            (b.next_deadline(), changes)
        })
    }

    fn end_session(self: &Arc<Self>, reason: String) {
        self.step(|b, now| ((), b.end_session(now)));
        self.emit(WorkerEvent::SessionEnded { reason });
        self.session_over.cancel();
    }
}

/// One owned partition, as the application holds it: its id, hash range and fencing token, and
/// a cancellation token that fires when the partition is revoked, lost or released. A handle
/// cannot outlive its token: once the partition moves on, [`PartitionHandle::is_valid`] is false
/// and the fenced store refuses its writes.
///
/// The documented order for a new owner is [`PartitionHandle::acquire`] first (raise the fence,
/// then read the checkpoint), then work, writing through the handle.
///
/// ```no_run
/// # async fn example(handle: tenure::worker::PartitionHandle) -> Result<(), tenure::fence::FenceError> {
/// let store = tenure::fence::MemoryFence::default(); // stands in for the application's store
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
    partition: PartitionId,
    token: FencingToken,
    range: HashRange,
    cancel: CancellationToken,
    shared: Weak<Shared>,
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

/// A joined worker. [`Worker::leave`] hands its partitions over gracefully; dropping it does the
/// same on a best-effort basis (when a Tokio runtime is still running); [`Worker::abandon`]
/// stops it as a crash would.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure::worker::ClientError> {
/// use tenure::worker::{Worker, WorkerConfig};
/// let worker = Worker::join(WorkerConfig::new(vec!["127.0.0.1:7001".into()], "indexer-3")).await?;
/// println!("session {} with a {:?} lease", worker.session(), worker.lease_ttl());
/// for (partition, token) in worker.owned() {
///     println!("holding {partition} under token {token}");
/// }
/// worker.leave().await?; // hands every partition over before the process exits
/// # Ok(()) }
/// ```
pub struct Worker {
    client: Client,
    session: SessionId,
    secret: String,
    shared: Arc<Shared>,
    events: Option<mpsc::UnboundedReceiver<WorkerEvent>>,
    cancel: CancellationToken,
    /// Set once the session was left or abandoned, so dropping does not leave again.
    left: std::sync::atomic::AtomicBool,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Belief ends here, before anything is sent: every handle is cancelled and retired.
        if !self.left.load(std::sync::atomic::Ordering::SeqCst) {
            self.shared.withdraw(None);
        }
        self.cancel.cancel();
        if self.left.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (client, session, secret) = (self.client.clone(), self.session, self.secret.clone());
        runtime.spawn(async move {
            if let Err(e) = leave_session(&client, session, secret).await {
                tracing::debug!(error = %e, "leave on drop failed; the session will expire");
            }
        });
    }
}

/// Leave, then release everything the session owns: the one graceful exit, shared by
/// [`Worker::leave`] and the drop path. Returns the released partitions.
async fn leave_session(client: &Client, session: SessionId, secret: String) -> Result<Vec<u32>, ClientError> {
    let leave = proto::LeaveRequest { session_id: session.0, secret: secret.clone() };
    client
        .call(|mut c| {
            let leave = leave.clone();
            async move { c.leave(leave).await }
        })
        .await?;
    let release = proto::ReleaseRequest { session_id: session.0, secret, all: true, ..Default::default() };
    let released = client
        .call(|mut c| {
            let release = release.clone();
            async move { c.release(release).await }
        })
        .await;
    match released {
        Ok(reply) => Ok(reply.released),
        // Releasing the last partition can end the session before the reply is read.
        Err(e) if e.is_session_gone() => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Sends one release request (following the leader, with the client's bounded retries).
async fn send_release_request(client: Client, request: proto::ReleaseRequest) -> Result<(), ClientError> {
    client
        .call(|mut c| {
            let request = request.clone();
            async move { c.release(request).await }
        })
        .await?;
    Ok(())
}

impl Worker {
    /// Joins the cluster and starts heartbeating and watching.
    pub async fn join(config: WorkerConfig) -> Result<Worker, ClientError> {
        if config.heartbeat_interval.is_some_and(|i| i.is_zero()) {
            return Err(ClientError::InvalidArgument("the heartbeat interval must be positive".into()));
        }
        let client = Client::new(config.coordinators.clone())?
            .dialing_from(config.dial_from)
            .dialing_with(config.dialer.clone());
        let request = proto::JoinRequest { name: config.name.clone(), weight: config.weight };
        let joined = client
            .call(|mut c| {
                let request = request.clone();
                async move { c.join(request).await }
            })
            .await?;
        let ttl = Duration::from_millis(joined.lease_ttl_ms);
        let margin = config.safety_margin.unwrap_or(ttl / 5);
        let every = config.heartbeat_interval.unwrap_or(ttl / 4);
        if margin >= ttl || every >= ttl - margin {
            // Leases would lapse between heartbeats: give the new session back, then refuse.
            let _ = leave_session(&client, SessionId(joined.session_id), joined.secret).await;
            return Err(ClientError::InvalidArgument(format!(
                "heartbeat interval {every:?} and safety margin {margin:?} do not fit the cluster's lease TTL {ttl:?}"
            )));
        }
        let keyspace =
            KeySpace::new(joined.partition_count).map_err(|e| ClientError::Other(e.to_string()))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let shared = Arc::new(Shared::new(Belief::new(ttl, margin), keyspace, tx, cancel.child_token()));
        let worker = Worker {
            client,
            session: SessionId(joined.session_id),
            secret: joined.secret,
            shared,
            events: Some(rx),
            cancel,
            left: std::sync::atomic::AtomicBool::new(false),
        };
        tokio::spawn(worker.heartbeat_loop(every));
        tokio::spawn(worker.watch_loop());
        tokio::spawn(worker.deadline_loop());
        Ok(worker)
    }

    pub fn session(&self) -> SessionId {
        self.session
    }

    pub fn lease_ttl(&self) -> Duration {
        self.shared.ttl
    }

    pub fn keyspace(&self) -> KeySpace {
        self.shared.keyspace
    }

    /// The event stream; can be taken once.
    pub fn events(&mut self) -> mpsc::UnboundedReceiver<WorkerEvent> {
        self.events.take().expect("Worker::events can be taken once")
    }

    /// Partitions this worker believes it holds right now (confirmed and not past their deadline).
    pub fn owned(&self) -> BTreeMap<PartitionId, FencingToken> {
        self.shared.local.lock().expect("worker lock poisoned").belief.owned(Instant::now())
    }

    /// Stops every background task without telling the coordinator, as a crash would: the
    /// coordinator expires the session after the TTL.
    pub fn abandon(self) {
        self.left.store(true, std::sync::atomic::Ordering::SeqCst);
        self.cancel.cancel();
    }

    /// Gives partitions back to the cluster.
    pub async fn release(&self, partitions: &[PartitionId]) -> Result<(), ClientError> {
        self.send_release(partitions.iter().map(|p| p.0).collect(), false).await
    }

    /// Gives back every partition this session owns, whatever this process has heard of.
    pub async fn release_all(&self) -> Result<(), ClientError> {
        self.send_release(Vec::new(), true).await
    }

    /// Belief ends first: the partitions' handles are cancelled and `Released` is reported
    /// before the request leaves, since the entry that releases them may grant them to another
    /// worker at once. If the coordinator cannot be told (an error is returned), they are not
    /// believed any more all the same; call again, or they are given away when the session ends.
    async fn send_release(&self, partitions: Vec<u32>, all: bool) -> Result<(), ClientError> {
        let chosen: Vec<PartitionId> = partitions.iter().map(|p| PartitionId(*p)).collect();
        let withdrawn = self.shared.withdraw(if all { None } else { Some(&chosen) });
        // Each partition this worker held is released under its grant's token, so a release
        // that arrives late cannot take a newer grant of the same partition; one it did not
        // hold (never confirmed, or already given up) goes without, as before.
        let tokens = if !all && chosen.iter().all(|p| withdrawn.contains_key(p)) {
            chosen.iter().map(|p| withdrawn[p].0).collect()
        } else {
            Vec::new()
        };
        let request = proto::ReleaseRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            partitions,
            all,
            tokens,
        };
        let sent = send_release_request(self.client.clone(), request).await;
        self.shared.release_settled(&withdrawn.keys().copied().collect::<Vec<_>>());
        sent
    }

    /// Leaves gracefully: this worker stops believing in every partition (each is reported
    /// `Released`; the application should have finished or checkpointed its work), then the
    /// session's partitions are revoked and all released at once, the session ends and the
    /// background tasks stop.
    pub async fn leave(&self) -> Result<(), ClientError> {
        self.shared.withdraw(None);
        leave_session(&self.client, self.session, self.secret.clone()).await?;
        self.left.store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.end_session("left".into());
        self.cancel.cancel();
        Ok(())
    }

    /// Renews the session every `every` (or at once when the stream names a new grant), over one
    /// long-lived stream to the leader, one heartbeat outstanding at a time. Each answer extends
    /// the leases from the instant its heartbeat was sent; meanwhile the deadline task lets
    /// leases run out.
    ///
    /// One attempt (finding the leader, a sixth of a TTL per node tried, opening the stream if
    /// there is none, one heartbeat and its answer) is bounded by half a TTL. A failed attempt
    /// drops the stream and is retried soon, backing off (with jitter) from 20 ms up to `every`; a node that let
    /// a heartbeat go unanswered is moved away from. So a frozen or dead leader costs one bounded
    /// attempt, and the worker reaches a new leader well within the TTL that leader starts every
    /// lease with.
    fn heartbeat_loop(&self, every: Duration) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (client, shared, cancel) = (self.client.clone(), self.shared.clone(), self.cancel.clone());
        let request = proto::HeartbeatRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            ..Default::default()
        };
        let patience = shared.ttl / 2;
        let request_release = proto::ReleaseRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            ..Default::default()
        };
        async move {
            let mut stream: Option<HeartbeatStream> = None;
            let mut retries = retry_pauses(every);
            let mut failing = false;
            loop {
                let sent = Instant::now();
                let attempt = async {
                    if stream.is_none() {
                        stream = Some(HeartbeatStream::open(&client, patience / 3).await?);
                    }
                    stream.as_mut().expect("opened above").beat(&client, request.clone()).await
                };
                let result = tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = shared.session_over.cancelled() => return,
                    r = tokio::time::timeout(patience, attempt) => r,
                };
                let timed_out = result.is_err();
                let outcome = result.unwrap_or_else(|_| {
                    if let Some(s) = &stream {
                        client.avoid(&s.addr);
                    }
                    Err(ClientError::Unavailable(format!("no heartbeat answer within {patience:?}")))
                });
                let pause = match outcome {
                    Ok(renewed) => {
                        let unreleased = shared.renewed(sent, &renewed);
                        if !unreleased.is_empty() {
                            // A release that did not get through: sent again beside the
                            // heartbeats, which must not wait for it.
                            let (partitions, tokens): (Vec<u32>, Vec<u64>) = unreleased.into_iter().unzip();
                            let settled: Vec<PartitionId> =
                                partitions.iter().map(|p| PartitionId(*p)).collect();
                            let release =
                                proto::ReleaseRequest { partitions, tokens, ..request_release.clone() };
                            let (client, shared) = (client.clone(), shared.clone());
                            tokio::spawn(async move {
                                let _ = send_release_request(client, release).await;
                                shared.release_settled(&settled);
                            });
                        }
                        failing = false;
                        retries = retry_pauses(every);
                        if let Some(s) = &stream {
                            shared.heartbeats_at(&s.addr);
                        }
                        every
                    }
                    Err(e) if e.is_session_gone() => {
                        shared.end_session(e.to_string());
                        return;
                    }
                    Err(e) => {
                        if failing {
                            tracing::debug!(error = %e, "heartbeat failed again");
                        } else {
                            tracing::warn!(error = %e, "heartbeat failed; retrying");
                        }
                        stream = None;
                        failing = true;
                        // After a timeout, half a TTL has gone by already: try again at once.
                        let pause = retries.next().unwrap_or(every);
                        if timed_out {
                            RETRY_FIRST.min(pause)
                        } else {
                            pause
                        }
                    }
                };
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = shared.session_over.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                    _ = shared.kick.notified() => {}
                }
            }
        }
    }

    /// Follows the session's ownership stream, reopening it when it ends, and also when the
    /// heartbeats have moved to another node than the one it is on (which may be frozen or cut
    /// off without the connection saying so).
    fn watch_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (client, shared, cancel) = (self.client.clone(), self.shared.clone(), self.cancel.clone());
        let request = proto::WatchRequest { session_id: self.session.0, secret: self.secret.clone() };
        async move {
            let (patience, most) =
                (shared.ttl / 2, (shared.ttl / 4).clamp(RETRY_FIRST, Duration::from_secs(1)));
            let mut pauses = retry_pauses(most);
            loop {
                let opened = client.call_without_waiting(patience / 3, |mut c| {
                    let request = request.clone();
                    async move { c.watch(request).await }
                });
                let stream = tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = shared.session_over.cancelled() => return,
                    s = tokio::time::timeout(patience, opened) => s.unwrap_or_else(|_| {
                        Err(ClientError::Unavailable(format!("no ownership stream within {patience:?}")))
                    }),
                };
                match stream {
                    Ok((addr, mut stream)) => {
                        pauses = retry_pauses(most);
                        shared.watching_at(Some(&addr));
                        loop {
                            let next = tokio::select! {
                                _ = cancel.cancelled() => return,
                                _ = shared.session_over.cancelled() => return,
                                n = stream.next() => n,
                                _ = shared.moved.notified() => {
                                    tracing::debug!("heartbeats moved to another node; reopening the ownership stream");
                                    break;
                                }
                            };
                            match next {
                                Some(Ok(event)) => shared.streamed(&event),
                                Some(Err(status)) => {
                                    tracing::debug!(%status, "ownership stream ended");
                                    break;
                                }
                                None => break,
                            }
                        }
                        shared.watching_at(None);
                    }
                    Err(e) if e.is_session_gone() => return, // the heartbeat loop reports it
                    Err(e) => tracing::warn!(error = %e, "cannot open the ownership stream"),
                }
                let pause = pauses.next().unwrap_or(most);
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }

    fn deadline_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (shared, cancel) = (self.shared.clone(), self.cancel.clone());
        async move {
            // A scan costs what the worker holds, so it runs when the earliest deadline comes
            // (renewals only move deadlines later) or a lease is confirmed for the first time,
            // not on a fixed tick: a worker holding half a million partitions would spend a
            // core on it.
            loop {
                let next = shared.check_deadlines(Instant::now());
                let wake = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep_until(wake) => {}
                    _ = shared.confirmed.notified() => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The belief rules on their own, with made-up answers: these are the races a network can
    //! produce but a cluster test cannot stage on demand. Found by the simulation: an answer to
    //! a heartbeat sent before a release used to bring the released partition back.

    use super::*;

    fn shared() -> (Arc<Shared>, mpsc::UnboundedReceiver<WorkerEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let belief = Belief::new(Duration::from_secs(1), Duration::from_millis(200));
        let shared = Arc::new(Shared::new(belief, KeySpace::new(4).unwrap(), tx, CancellationToken::new()));
        (shared, rx)
    }

    fn lease(p: u32, token: u64) -> Vec<proto::PartitionLease> {
        vec![proto::PartitionLease { partition: p, token }]
    }

    fn assigned(rx: &mut mpsc::UnboundedReceiver<WorkerEvent>) -> usize {
        std::iter::from_fn(|| rx.try_recv().ok()).filter(|e| matches!(e, WorkerEvent::Assigned(_))).count()
    }

    #[test]
    fn a_late_answer_does_not_bring_back_a_released_partition() {
        let (s, mut rx) = shared();
        let sent = Instant::now();
        s.renewed(sent, &lease(1, 5));
        assert_eq!(assigned(&mut rx), 1);
        s.released(PartitionId(1), FencingToken(5));
        // The answer to a heartbeat sent before the release arrives after it.
        s.renewed(sent, &lease(1, 5));
        assert_eq!(assigned(&mut rx), 0);
        assert_eq!(s.valid_until(PartitionId(1), FencingToken(5)), None);
        // Even a later heartbeat cannot: the coordinator may have moved it on already.
        s.renewed(Instant::now(), &lease(1, 5));
        assert_eq!(assigned(&mut rx), 0);
        // A newer grant of the same partition is believed as usual.
        s.renewed(Instant::now(), &lease(1, 9));
        assert_eq!(assigned(&mut rx), 1);
    }

    #[test]
    fn a_late_release_answer_does_not_drop_a_newer_grant() {
        // Found by the benchmark at 65,536 partitions: the answer to a release of grant 3 came
        // back after the same partition had been granted to this worker again (grant 18).
        let (s, mut rx) = shared();
        s.renewed(Instant::now(), &lease(1, 3));
        s.withdraw(Some(&[PartitionId(1)]));
        s.renewed(Instant::now(), &lease(1, 18));
        assert_eq!(assigned(&mut rx), 2);
        s.released(PartitionId(1), FencingToken(3)); // the stream's late word on the release
        assert!(s.valid_until(PartitionId(1), FencingToken(18)).is_some());
    }

    fn announce(s: &Arc<Shared>, p: u32, token: u64) {
        let kind = Kind::Assigned as i32;
        s.streamed(&proto::OwnershipEvent { kind, partition: p, token, ..Default::default() });
    }

    #[test]
    fn an_announced_partition_is_believed_only_after_a_heartbeat_sent_after_the_announcement() {
        let (s, mut rx) = shared();
        let before = Instant::now();
        announce(&s, 1, 5);
        // The answer to a heartbeat that left before (or at) the announcement confirms nothing;
        // one that left after it does (a send instant just ahead stands for a later heartbeat).
        s.renewed(before, &lease(1, 5));
        assert_eq!(assigned(&mut rx), 0);
        assert_eq!(s.valid_until(PartitionId(1), FencingToken(5)), None);
        s.renewed(Instant::now() + Duration::from_millis(1), &lease(1, 5));
        assert_eq!(assigned(&mut rx), 1);
    }

    #[test]
    fn a_stream_read_before_a_release_does_not_bring_the_released_grant_back() {
        let (s, mut rx) = shared();
        s.renewed(Instant::now(), &lease(2, 7));
        assert_eq!(assigned(&mut rx), 1);
        s.withdraw(Some(&[PartitionId(2)]));
        // The ownership stream's snapshot, read before the release, announces grant 7 again,
        // and a later heartbeat's answer (sent before the release was applied) lists it.
        announce(&s, 2, 7);
        s.renewed(Instant::now() + Duration::from_millis(1), &lease(2, 7));
        assert_eq!(assigned(&mut rx), 0);
        assert_eq!(s.valid_until(PartitionId(2), FencingToken(7)), None);
    }

    #[test]
    fn withdrawing_cancels_the_handle_and_reports_released_at_once() {
        let (s, mut rx) = shared();
        s.renewed(Instant::now(), &lease(0, 4));
        let handle = match rx.try_recv() {
            Ok(WorkerEvent::Assigned(h)) => h,
            other => panic!("{other:?}"),
        };
        assert!(handle.is_valid());
        let withdrawn = s.withdraw(None);
        assert_eq!(withdrawn, BTreeMap::from([(PartitionId(0), FencingToken(4))]));
        assert!(!handle.is_valid() && handle.cancellation().is_cancelled());
        assert!(matches!(rx.try_recv(), Ok(WorkerEvent::Released { token: FencingToken(4), .. })));
    }

    #[test]
    fn a_lease_runs_from_the_send_of_the_heartbeat_that_confirmed_it_less_the_margin() {
        // The library's own rule, on its own code: a zero margin, or a lease counted from the
        // answer's arrival, would each give another instant here.
        let (s, _rx) = shared();
        // Sent 100 ms before the answer is taken in: a lease counted from the answer would end
        // 100 ms later than the rule says.
        let Some(sent) = Instant::now().checked_sub(Duration::from_millis(100)) else { return };
        s.renewed(sent, &lease(1, 5));
        let (ttl, margin) = {
            let l = s.local.lock().unwrap();
            (l.belief.ttl(), l.belief.margin())
        };
        let want = sent + ttl - margin;
        assert_eq!(s.valid_until(PartitionId(1), FencingToken(5)), Some(want));
        assert!(margin > Duration::ZERO);
        // A later heartbeat moves it to its own send, never back.
        let later = sent + Duration::from_millis(1);
        s.renewed(later, &lease(1, 5));
        assert_eq!(s.valid_until(PartitionId(1), FencingToken(5)), Some(later + ttl - margin));
        s.renewed(sent, &lease(1, 5));
        assert_eq!(s.valid_until(PartitionId(1), FencingToken(5)), Some(later + ttl - margin));
    }

    #[test]
    fn every_handle_is_cancelled_when_the_session_is_over() {
        let (s, mut rx) = shared();
        s.renewed(Instant::now(), &lease(3, 9));
        let Ok(WorkerEvent::Assigned(handle)) = rx.try_recv() else { panic!("assigned") };
        s.session_over.cancel();
        assert!(handle.cancellation().is_cancelled());
    }

    #[test]
    fn a_withdrawn_grant_still_renewed_later_is_released_again() {
        // The release was lost or failed: the coordinator keeps renewing the grant this worker
        // stopped believing in, which would stay with the session, unused, until it ended.
        let (s, mut rx) = shared();
        let before = Instant::now();
        s.renewed(before, &lease(1, 5));
        s.withdraw(Some(&[PartitionId(1)]));
        // An answer to a heartbeat that left before the withdrawal says nothing of the release.
        assert_eq!(s.renewed(before, &lease(1, 5)), vec![]);
        let later = Instant::now() + Duration::from_millis(1);
        assert_eq!(s.renewed(later, &lease(1, 5)), vec![(1, 5)]);
        // Still not believed, and only a withdrawn grant is asked for again.
        assert_eq!(assigned(&mut rx), 1);
        assert_eq!(s.valid_until(PartitionId(1), FencingToken(5)), None);
        s.renewed(later, &lease(2, 6));
        s.fenced_out(PartitionId(2), FencingToken(6));
        assert_eq!(s.renewed(later + Duration::from_millis(1), &lease(2, 6)), vec![]);
    }

    #[test]
    fn a_lease_that_ran_out_locally_comes_back_only_through_a_later_heartbeat() {
        let (s, mut rx) = shared();
        let sent = Instant::now();
        s.renewed(sent, &lease(2, 7));
        assert_eq!(assigned(&mut rx), 1);
        let dropped = Instant::now() + Duration::from_secs(2);
        s.check_deadlines(dropped);
        assert_eq!(s.valid_until(PartitionId(2), FencingToken(7)), None);
        s.renewed(sent, &lease(2, 7)); // an old answer
        assert_eq!(assigned(&mut rx), 0);
        // A heartbeat sent after the lease was dropped: the coordinator still counts it ours.
        s.renewed(dropped + Duration::from_millis(1), &lease(2, 7));
        assert_eq!(assigned(&mut rx), 1);
    }

    #[test]
    fn an_answer_older_than_the_lease_it_would_give_confirms_nothing() {
        let (s, mut rx) = shared();
        let Some(sent) = Instant::now().checked_sub(Duration::from_secs(2)) else { return };
        s.renewed(sent, &lease(3, 4));
        assert_eq!(assigned(&mut rx), 0);
        assert_eq!(s.valid_until(PartitionId(3), FencingToken(4)), None);
    }
}
