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
//!         WorkerEvent::Assigned { partition, token, .. } => println!("own {partition} under {token}"),
//!         WorkerEvent::Revoking { partition, .. } => { worker.release(&[partition]).await?; }
//!         WorkerEvent::Lost { partition, .. } => println!("stop {partition} now"),
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```

mod client;

pub use client::{Client, ClientError};

use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::keyspace::{HashRange, KeySpace};
use crate::proto;
use crate::proto::ownership_event::Kind;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

/// How a worker joins and how cautious it is.
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
}

impl WorkerConfig {
    pub fn new(coordinators: Vec<String>, name: impl Into<String>) -> Self {
        WorkerConfig {
            coordinators,
            name: name.into(),
            weight: 1,
            safety_margin: None,
            heartbeat_interval: None,
        }
    }
}

/// Why a partition was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LostReason {
    /// The local lease ran out before a renewal confirmed it.
    DeadlineExpired,
    /// The coordinator took it away (its lease expired there).
    Expired,
    /// The session itself ended.
    SessionEnded,
}

/// What the application is told, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// The partition is yours under `token` until at least `valid_until` (renewed silently).
    Assigned { partition: PartitionId, token: FencingToken, range: HashRange, valid_until: Instant },
    /// Finish or checkpoint, then call [`Worker::release`].
    Revoking { partition: PartitionId, token: FencingToken },
    /// Already gone: stop at once.
    Lost { partition: PartitionId, token: FencingToken, reason: LostReason },
    /// Released by this worker.
    Released { partition: PartitionId, token: FencingToken },
    /// The session is over; every partition was reported lost or released before this.
    SessionEnded { reason: String },
}

/// A partition this worker has been told about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub token: FencingToken,
    pub revoking: bool,
    /// `None` until a renewal confirms it.
    pub valid_until: Option<Instant>,
}

struct Shared {
    held: Mutex<BTreeMap<PartitionId, Held>>,
    // Unbounded on purpose: the background tasks must never wait for the application. The number
    // of pending events is bounded by partitions times transitions.
    events: mpsc::UnboundedSender<WorkerEvent>,
    keyspace: KeySpace,
    ttl: Duration,
    margin: Duration,
    kick: Notify,
    session_over: CancellationToken,
}

impl Shared {
    fn emit(&self, event: WorkerEvent) {
        let _ = self.events.send(event);
    }

    fn renewed(&self, sent: Instant, renewed: &[proto::PartitionLease]) {
        let valid_until = sent + self.ttl.saturating_sub(self.margin);
        let mut held = self.held.lock().expect("worker lock poisoned");
        for lease in renewed {
            let (partition, token) = (PartitionId(lease.partition), FencingToken(lease.token));
            let entry = held.get(&partition).copied();
            match entry {
                Some(h) if h.token == token => {
                    if h.revoking {
                        continue;
                    }
                    let until = h.valid_until.map_or(valid_until, |v| v.max(valid_until));
                    held.insert(partition, Held { valid_until: Some(until), ..h });
                    if h.valid_until.is_none() {
                        self.assigned(partition, token, until);
                    }
                }
                Some(h) if h.token > token => {}
                _ => {
                    if let Some(old) = entry.filter(|h| h.valid_until.is_some()) {
                        self.emit(WorkerEvent::Lost {
                            partition,
                            token: old.token,
                            reason: LostReason::Expired,
                        });
                    }
                    held.insert(partition, Held { token, revoking: false, valid_until: Some(valid_until) });
                    self.assigned(partition, token, valid_until);
                }
            }
        }
    }

    fn assigned(&self, partition: PartitionId, token: FencingToken, valid_until: Instant) {
        let range = self.keyspace.range(partition).unwrap_or(HashRange { start: 0, end: 0 });
        self.emit(WorkerEvent::Assigned { partition, token, range, valid_until });
    }

    fn streamed(&self, event: &proto::OwnershipEvent) {
        let (partition, token) = (PartitionId(event.partition), FencingToken(event.token));
        let mut held = self.held.lock().expect("worker lock poisoned");
        let current = held.get(&partition).copied();
        match Kind::try_from(event.kind).unwrap_or(Kind::Unspecified) {
            Kind::Assigned => {
                if current.is_none_or(|h| h.token < token) {
                    held.insert(partition, Held { token, revoking: false, valid_until: None });
                    self.kick.notify_one();
                }
            }
            Kind::Revoking => {
                if let Some(h) = current.filter(|h| h.token == token && !h.revoking) {
                    held.insert(partition, Held { revoking: true, ..h });
                    self.emit(WorkerEvent::Revoking { partition, token });
                }
            }
            Kind::Lost => {
                if let Some(h) = current.filter(|h| h.token <= token) {
                    held.remove(&partition);
                    if h.valid_until.is_some() {
                        self.emit(WorkerEvent::Lost {
                            partition,
                            token: h.token,
                            reason: LostReason::Expired,
                        });
                    }
                }
            }
            Kind::Released => {
                if current.is_some_and(|h| h.token == token) {
                    held.remove(&partition);
                    self.emit(WorkerEvent::Released { partition, token });
                }
            }
            Kind::Unspecified => {}
        }
    }

    /// Drops every partition whose local lease has run out; returns the next deadline.
    fn check_deadlines(&self, now: Instant) -> Option<Instant> {
        let mut held = self.held.lock().expect("worker lock poisoned");
        let expired: Vec<(PartitionId, Held)> = held
            .iter()
            .filter(|(_, h)| h.valid_until.is_some_and(|v| v <= now))
            .map(|(p, h)| (*p, *h))
            .collect();
        for (partition, h) in expired {
            held.remove(&partition);
            self.emit(WorkerEvent::Lost { partition, token: h.token, reason: LostReason::DeadlineExpired });
        }
        held.values().filter_map(|h| h.valid_until).min()
    }

    fn end_session(&self, reason: String) {
        let mut held = self.held.lock().expect("worker lock poisoned");
        for (partition, h) in std::mem::take(&mut *held) {
            if h.valid_until.is_some() {
                self.emit(WorkerEvent::Lost { partition, token: h.token, reason: LostReason::SessionEnded });
            }
        }
        self.emit(WorkerEvent::SessionEnded { reason });
        self.session_over.cancel();
    }
}

/// A joined worker. Dropping it stops its heartbeats (the coordinator then expires it); call
/// [`Worker::leave`] to hand partitions over gracefully.
pub struct Worker {
    client: Client,
    session: SessionId,
    secret: String,
    shared: Arc<Shared>,
    events: Option<mpsc::UnboundedReceiver<WorkerEvent>>,
    cancel: CancellationToken,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Worker {
    /// Joins the cluster and starts heartbeating and watching.
    pub async fn join(config: WorkerConfig) -> Result<Worker, ClientError> {
        let client = Client::new(config.coordinators.clone())?;
        let request = proto::JoinRequest { name: config.name.clone(), weight: config.weight };
        let joined = client
            .call(|mut c| {
                let request = request.clone();
                async move { c.join(request).await }
            })
            .await?;
        let ttl = Duration::from_millis(joined.lease_ttl_ms);
        let keyspace =
            KeySpace::new(joined.partition_count).map_err(|e| ClientError::Other(e.to_string()))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let shared = Arc::new(Shared {
            held: Mutex::new(BTreeMap::new()),
            events: tx,
            keyspace,
            ttl,
            margin: config.safety_margin.unwrap_or(ttl / 5),
            kick: Notify::new(),
            session_over: cancel.child_token(),
        });
        let worker = Worker {
            client,
            session: SessionId(joined.session_id),
            secret: joined.secret,
            shared,
            events: Some(rx),
            cancel,
        };
        let every = config.heartbeat_interval.unwrap_or(ttl / 4);
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
        let now = Instant::now();
        let held = self.shared.held.lock().expect("worker lock poisoned");
        held.iter()
            .filter(|(_, h)| h.valid_until.is_some_and(|v| v > now))
            .map(|(p, h)| (*p, h.token))
            .collect()
    }

    /// Gives partitions back to the cluster.
    pub async fn release(&self, partitions: &[PartitionId]) -> Result<(), ClientError> {
        self.send_release(partitions.iter().map(|p| p.0).collect(), false).await
    }

    /// Gives back every partition this session owns, whatever this process has heard of.
    pub async fn release_all(&self) -> Result<(), ClientError> {
        self.send_release(Vec::new(), true).await
    }

    async fn send_release(&self, partitions: Vec<u32>, all: bool) -> Result<(), ClientError> {
        let request = proto::ReleaseRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            partitions,
            all,
        };
        let reply = self
            .client
            .call(|mut c| {
                let request = request.clone();
                async move { c.release(request).await }
            })
            .await?;
        let mut held = self.shared.held.lock().expect("worker lock poisoned");
        for p in reply.released {
            if let Some(h) = held.remove(&PartitionId(p)) {
                self.shared.emit(WorkerEvent::Released { partition: PartitionId(p), token: h.token });
            }
        }
        Ok(())
    }

    /// Leaves gracefully: the session's partitions are revoked and all released at once (the
    /// application should have finished or checkpointed its work), then the session ends and the
    /// background tasks stop.
    pub async fn leave(&self) -> Result<(), ClientError> {
        let request = proto::LeaveRequest { session_id: self.session.0, secret: self.secret.clone() };
        self.client
            .call(|mut c| {
                let request = request.clone();
                async move { c.leave(request).await }
            })
            .await?;
        match self.release_all().await {
            Ok(()) => {}
            // Releasing the last partition can end the session before the reply is read.
            Err(e) if e.is_session_gone() => {}
            Err(e) => return Err(e),
        }
        self.shared.end_session("left".into());
        self.cancel.cancel();
        Ok(())
    }

    fn heartbeat_loop(&self, every: Duration) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (client, shared, cancel) = (self.client.clone(), self.shared.clone(), self.cancel.clone());
        let request = proto::HeartbeatRequest { session_id: self.session.0, secret: self.secret.clone() };
        async move {
            loop {
                let sent = Instant::now();
                let result = client.call(|mut c| {
                    let request = request.clone();
                    async move { c.heartbeat(request).await }
                });
                let result = tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = shared.session_over.cancelled() => return,
                    r = result => r,
                };
                match result {
                    Ok(reply) => shared.renewed(sent, &reply.renewed),
                    Err(e) if e.is_session_gone() => {
                        shared.end_session(e.to_string());
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = shared.session_over.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                    _ = shared.kick.notified() => {}
                }
            }
        }
    }

    fn watch_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (client, shared, cancel) = (self.client.clone(), self.shared.clone(), self.cancel.clone());
        let request = proto::WatchRequest { session_id: self.session.0, secret: self.secret.clone() };
        async move {
            let mut pause = Duration::from_millis(20);
            loop {
                let opened = client.call(|mut c| {
                    let request = request.clone();
                    async move { c.watch(request).await }
                });
                let stream = tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = shared.session_over.cancelled() => return,
                    s = opened => s,
                };
                match stream {
                    Ok(mut stream) => {
                        pause = Duration::from_millis(20);
                        loop {
                            let next = tokio::select! {
                                _ = cancel.cancelled() => return,
                                _ = shared.session_over.cancelled() => return,
                                n = stream.next() => n,
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
                    }
                    Err(e) if e.is_session_gone() => return, // the heartbeat loop reports it
                    Err(e) => tracing::warn!(error = %e, "cannot open the ownership stream"),
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }

    fn deadline_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (shared, cancel) = (self.shared.clone(), self.cancel.clone());
        async move {
            loop {
                let next = shared.check_deadlines(Instant::now());
                let wake = next
                    .unwrap_or_else(|| Instant::now() + Duration::from_millis(50))
                    .min(Instant::now() + Duration::from_millis(50));
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep_until(wake.into()) => {}
                }
            }
        }
    }
}
