//! tenure's worker library: join a coordinator cluster, keep the session's leases renewed, and
//! tell the application which partitions it may act on and with which fencing token.
//!
//! This is the crate an application embeds. It depends on `tenure-core` (identifiers, key space,
//! fenced stores, re-exported here) and the public gRPC API, and on no Raft, RocksDB or
//! coordinator code; Cargo keeps it that way.
//!
//! The invariant this crate keeps is the worker's half of "one believer": a partition is
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
//! # async fn example() -> Result<(), tenure_worker::ClientError> {
//! use tenure_worker::{Worker, WorkerConfig, WorkerEvent};
//! let mut worker = Worker::join(WorkerConfig::new(vec!["127.0.0.1:7001".into()], "billing-1")).await?;
//! let mut events = worker.events().expect("taken once");
//! while let Some(event) = events.recv().await {
//!     match event {
//!         WorkerEvent::Granted(handle) => println!("own {} under {}", handle.partition(), handle.token()),
//!         WorkerEvent::Revoking { partition, .. } => { worker.release(&[partition]).await?; }
//!         WorkerEvent::Lost { partition, .. } => println!("stop {partition} now"),
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```

pub use tenure_core::{fence, ids, keyspace};

pub mod proto;
pub mod transport;

mod belief;
mod client;
mod config;
mod events;
mod handle;
mod heartbeat;
mod router;
mod runner;
mod shared;
mod watch;

pub use belief::{Belief, Change, End, Held, LostReason};
pub use client::{Client, ClientError};
pub use config::WorkerConfig;
pub use events::{Events, SessionEnd, WorkerEvent};
pub use handle::{Fenced, PartitionHandle};
pub use router::{Route, Router};
pub use runner::{Assignment, RunReport, Runner, RunnerState, RunnerStatus};
pub use transport::ClientTls;

use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::keyspace::KeySpace;
use shared::Shared;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A joined worker. [`Worker::leave`] hands its partitions over gracefully; dropping it does the
/// same on a best-effort basis (when a Tokio runtime is still running); [`Worker::abandon`]
/// stops it as a crash would.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure_worker::ClientError> {
/// use tenure_worker::{Worker, WorkerConfig};
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
    /// As the join named it (empty: `default`); every request of the session names it too.
    namespace: String,
    session: SessionId,
    secret: String,
    shared: Arc<Shared>,
    events: Option<Events>,
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
        let namespace = self.namespace.clone();
        runtime.spawn(async move {
            if let Err(e) = leave_session(&client, &namespace, session, secret).await {
                tracing::debug!(error = %e, "leave on drop failed; the session will expire");
            }
        });
    }
}

/// Leave, then release everything the session owns: the one graceful exit, shared by
/// [`Worker::leave`] and the drop path. Returns the released partitions.
async fn leave_session(
    client: &Client,
    namespace: &str,
    session: SessionId,
    secret: String,
) -> Result<Vec<u32>, ClientError> {
    let namespace = namespace.to_string();
    let leave =
        proto::LeaveRequest { session_id: session.0, secret: secret.clone(), namespace: namespace.clone() };
    client
        .call(|mut c| {
            let leave = leave.clone();
            async move { c.leave(leave).await }
        })
        .await?;
    let release =
        proto::ReleaseRequest { session_id: session.0, secret, all: true, namespace, ..Default::default() };
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

/// Room for every partition of the cluster to be granted, revoked and released a few times
/// over before a reader that fell behind loses its session.
fn default_event_capacity(partition_count: u32) -> usize {
    (partition_count as usize).saturating_mul(4).max(65_536)
}

impl Worker {
    /// Joins the cluster and starts heartbeating and watching.
    pub async fn join(config: WorkerConfig) -> Result<Worker, ClientError> {
        if config.heartbeat_interval.is_some_and(|i| i.is_zero()) {
            return Err(ClientError::InvalidArgument("the heartbeat interval must be positive".into()));
        }
        let client = Client::new(config.coordinators.clone())?
            .dialing_from(config.dial_from)
            .dialing_with(config.dialer.clone())
            .with_tls(config.tls.clone());
        let request = proto::JoinRequest {
            name: config.name.clone(),
            weight: config.weight,
            namespace: config.namespace.clone(),
        };
        let joined = client
            .call(|mut c| {
                let request = request.clone();
                async move { c.join(request).await }
            })
            .await?;
        let ttl = Duration::from_millis(joined.lease_ttl_ms);
        let pacing = shared::Pacing { margin: config.safety_margin, every: config.heartbeat_interval };
        let margin = match pacing.under(ttl) {
            Ok((margin, _)) => margin,
            Err(why) => {
                // Leases would lapse between heartbeats: give the new session back, then refuse.
                let _ =
                    leave_session(&client, &config.namespace, SessionId(joined.session_id), joined.secret)
                        .await;
                return Err(ClientError::InvalidArgument(why));
            }
        };
        let keyspace =
            KeySpace::new(joined.partition_count).map_err(|e| ClientError::Other(e.to_string()))?;
        let capacity =
            config.event_capacity.unwrap_or_else(|| default_event_capacity(joined.partition_count));
        let (tx, rx) = events::channel(capacity);
        let cancel = CancellationToken::new();
        let shared =
            Arc::new(Shared::new(Belief::new(ttl, margin), pacing, keyspace, tx, cancel.child_token()));
        let worker = Worker {
            client,
            namespace: config.namespace.clone(),
            session: SessionId(joined.session_id),
            secret: joined.secret,
            shared,
            events: Some(rx),
            cancel,
            left: std::sync::atomic::AtomicBool::new(false),
        };
        tokio::spawn(worker.heartbeat_loop());
        tokio::spawn(worker.watch_loop());
        tokio::spawn(worker.deadline_loop());
        Ok(worker)
    }

    pub fn session(&self) -> SessionId {
        self.session
    }

    /// The cluster's lease TTL, as the answer to the session's last renewal gave it (an
    /// operator may change it at run time).
    pub fn lease_ttl(&self) -> Duration {
        self.shared.ttl()
    }

    pub fn keyspace(&self) -> KeySpace {
        self.shared.keyspace
    }

    /// The event stream, bounded by [`WorkerConfig::event_capacity`]: `Some` the first time,
    /// `None` after (there is one reader, so no event is seen twice or missed by both).
    pub fn events(&mut self) -> Option<Events> {
        self.events.take()
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
            namespace: self.namespace.clone(),
        };
        let sent = send_release_request(self.client.clone(), request).await;
        self.shared.release_settled(&withdrawn.keys().copied().collect::<Vec<_>>());
        sent
    }

    /// Leaves as [`Worker::leave`] does, within `bound`: what a process stopping on SIGTERM
    /// calls once its work is finished or checkpointed. Belief ends at once, before anything
    /// is sent, so a shutdown that cannot reach the cluster in time is still safe: it returns
    /// `Unavailable`, tries the leave once more in the background while the runtime lives, and
    /// otherwise the session expires one TTL later.
    pub async fn shutdown(self, bound: Duration) -> Result<(), ClientError> {
        match tokio::time::timeout(bound, self.leave()).await {
            Ok(left) => left,
            // Dropped below: the drop path sends the leave once more, without waiting for it.
            Err(_) => Err(ClientError::Unavailable(format!("could not leave within {bound:?}"))),
        }
    }

    /// Leaves gracefully: this worker stops believing in every partition (each is reported
    /// `Released`; the application should have finished or checkpointed its work), then the
    /// session's partitions are revoked and all released at once, the session ends and the
    /// background tasks stop.
    pub async fn leave(&self) -> Result<(), ClientError> {
        self.shared.leaving.store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.withdraw(None);
        if let Err(e) = leave_session(&self.client, &self.namespace, self.session, self.secret.clone()).await
        {
            // Not left: the heartbeats may release what was withdrawn, as they would have.
            self.shared.leaving.store(false, std::sync::atomic::Ordering::SeqCst);
            return Err(e);
        }
        self.left.store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.end_session(SessionEnd::Left);
        self.cancel.cancel();
        Ok(())
    }

    /// The deadline task: drops every lease whose local deadline has passed.
    fn deadline_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            // A scan costs what the worker holds, so it runs when the earliest deadline comes
            // (renewals only move deadlines later) or a lease is confirmed for the first time,
            // not on a fixed tick: a worker holding half a million partitions would spend a
            // core on it.
            loop {
                let next = shared.check_deadlines(Instant::now());
                let wake = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                tokio::select! {
                    _ = shared.session_over.cancelled() => return,
                    _ = tokio::time::sleep_until(wake) => {}
                    _ = shared.confirmed.notified() => {}
                }
            }
        }
    }
}
