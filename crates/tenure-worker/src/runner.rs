//! The partition runner: the loop every application would otherwise write around the event
//! stream, written once.
//!
//! [`Runner::run`] joins a session and starts one task per granted partition, handing it an
//! [`Assignment`]. It tells the task to stop when the partition is revoked, lost, the session
//! ends or the process shuts down; it releases a revoked partition once the task has ended; it
//! restarts a task whose handler failed, with backoff; and it joins a new session, with
//! backoff, when the old one is gone.
//!
//! The invariant it keeps, on top of the worker's "one believer": **a partition is given back
//! only after its task has ended.** On revoke the task is asked to stop and given until the
//! drain bound or the lease's local deadline, whichever comes first; then it is aborted, and the
//! release goes out once the aborted task is gone. On loss (the lease ran out, storage fenced
//! the token, the session ended) the task is aborted at once, since another worker may own the
//! partition already. Aborting takes effect at the task's next `.await`: code that blocks a
//! thread keeps running, and fencing is what stops such a straggler from doing harm.

use crate::fence::{FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::keyspace::{HashRange, KeySpace};
use crate::{ClientError, Fenced, PartitionHandle, SessionEnd, Worker, WorkerConfig, WorkerEvent};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, Id, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What a partition's task is given: the grant, and a signal to wind down.
///
/// The task should return once [`Assignment::stopped`] resolves, after finishing or
/// checkpointing what it was doing. The only way to write for the partition is through
/// [`Assignment::acquire`], which raises the partition's fence first.
#[derive(Clone, Debug)]
pub struct Assignment {
    handle: PartitionHandle,
    session: SessionId,
    stop: CancellationToken,
    lease_ttl: Duration,
    keyspace: KeySpace,
    give_back: GiveBack,
}

/// An assignment's way to ask its session to give the partition back: once per grant.
#[derive(Clone, Debug)]
struct GiveBack {
    asked: Arc<std::sync::atomic::AtomicBool>,
    to: mpsc::UnboundedSender<Grant>,
}

/// A partition's grant, named by its token.
type Grant = (PartitionId, FencingToken);

impl Assignment {
    pub fn partition(&self) -> PartitionId {
        self.handle.partition()
    }

    pub fn token(&self) -> FencingToken {
        self.handle.token()
    }

    /// The session this partition was granted to (a new session gets new grants, new tokens).
    pub fn session(&self) -> SessionId {
        self.session
    }

    /// The slice of the key space's hashes this partition covers.
    pub fn range(&self) -> HashRange {
        self.handle.range()
    }

    pub fn handle(&self) -> &PartitionHandle {
        &self.handle
    }

    /// The cluster's lease TTL: how long a lease lasts between renewals.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// The cluster's key space, which maps keys to partitions.
    pub fn keyspace(&self) -> KeySpace {
        self.keyspace
    }

    /// Resolves when the task should stop: the partition is being revoked (finish or
    /// checkpoint, then return), it was lost or the session ended (the task is about to be
    /// aborted), or the runner is shutting down.
    pub async fn stopped(&self) {
        self.stop.cancelled().await
    }

    pub fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Gives the partition back of this process's own accord (it is overloaded, say, or its
    /// host is being drained): the task is told to stop, as on a revoke, and once it has
    /// returned (or the drain bound passed) the runner releases the partition and the
    /// coordinator places it again. Placement may grant it back to this same worker, under a
    /// new token, when that is where balance puts it. Asking twice, or after the grant ended,
    /// does nothing.
    pub fn give_back(&self) {
        if !self.give_back.asked.swap(true, Ordering::SeqCst) {
            // The session is gone when this fails, and the grant with it.
            let _ = self.give_back.to.send((self.partition(), self.token()));
        }
    }

    /// Raises the partition's fence in `store` to this grant's token and returns the value
    /// that writes for it; see [`PartitionHandle::acquire`].
    pub async fn acquire<S: FenceStore>(&self, store: S) -> Result<Fenced<S>, FenceError> {
        self.handle.acquire(store).await
    }
}

/// What a run did, returned when it ends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// Sessions joined.
    pub sessions: u64,
    /// Partition tasks started, one per grant.
    pub granted: u64,
    /// Tasks of revoked partitions (or of a shutdown) that returned within the drain bound.
    pub drained: u64,
    /// Tasks of revoked partitions (or of a shutdown) aborted at the drain bound.
    pub cut_short: u64,
    /// Tasks aborted because their partition was lost.
    pub lost: u64,
    /// Handler runs that returned an error or panicked.
    pub failures: u64,
    /// Why each session but a shut-down one ended, in order.
    pub session_ends: Vec<SessionEnd>,
}

/// What a runner is doing at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunnerState {
    /// The session it serves; `None` between sessions.
    pub session: Option<SessionId>,
    /// The partitions whose tasks are running (or stopping), with their grants' tokens.
    pub running: BTreeMap<PartitionId, FencingToken>,
}

/// A view of a runner's [`RunnerState`] that follows it, from [`Runner::status`].
#[derive(Clone, Debug)]
pub struct RunnerStatus(watch::Receiver<RunnerState>);

impl RunnerStatus {
    /// The state as of now.
    pub fn now(&self) -> RunnerState {
        self.0.borrow().clone()
    }

    /// Waits for the next change; `false` once the runner is gone.
    pub async fn changed(&mut self) -> bool {
        self.0.changed().await.is_ok()
    }
}

/// Runs a handler for every partition this process owns, across sessions, until shut down.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure_worker::ClientError> {
/// use std::time::Duration;
/// use tenure_worker::{fence::MemoryFence, Runner, WorkerConfig};
/// let store = std::sync::Arc::new(MemoryFence::default());
/// let config = WorkerConfig::new(vec!["127.0.0.1:7001".into()], "indexer-3");
/// let report = Runner::new(config)
///     .drain_bound(Duration::from_secs(5))
///     .run(
///         move |assignment| {
///             let store = store.clone();
///             async move {
///                 let fenced = assignment.acquire(store).await?;
///                 while !assignment.is_stopped() {
///                     fenced.write(b"progress", b"one more step").await?;
///                     tokio::time::sleep(Duration::from_millis(100)).await;
///                 }
///                 Ok::<(), tenure_worker::fence::FenceError>(())
///             }
///         },
///         async { let _ = tokio::signal::ctrl_c().await; },
///     )
///     .await?;
/// println!("{} grants, {} drained", report.granted, report.drained);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Runner {
    config: WorkerConfig,
    status: Arc<watch::Sender<RunnerState>>,
    drain: Duration,
    shutdown: Duration,
    restart: (Duration, Duration),
    rejoin: (Duration, Duration),
}

impl Runner {
    /// A runner joining with `config`: a drain bound of 10 s (never past the lease), 5 s to
    /// leave on shutdown, handler restarts after 1 s doubling to 30 s, rejoins after 250 ms
    /// doubling to 30 s.
    pub fn new(config: WorkerConfig) -> Runner {
        Runner {
            config,
            status: Arc::new(watch::Sender::new(RunnerState::default())),
            drain: Duration::from_secs(10),
            shutdown: Duration::from_secs(5),
            restart: (Duration::from_secs(1), Duration::from_secs(30)),
            rejoin: (Duration::from_millis(250), Duration::from_secs(30)),
        }
    }

    /// Follows what this runner is doing (its session, the partitions whose tasks run), for a
    /// health check or a status page; take it before [`Runner::run`]. Clones of a runner share
    /// one status, so give each run its own `Runner::new`. Publishing costs a pass over the
    /// session's partitions per event, which is nothing at the hundreds a worker holds.
    pub fn status(&self) -> RunnerStatus {
        RunnerStatus(self.status.subscribe())
    }

    /// How long a revoked partition's task (or every task, on shutdown) may take to return
    /// before it is aborted. A revoked partition is not renewed, so its lease's local deadline
    /// cuts the drain shorter when it comes first.
    pub fn drain_bound(mut self, bound: Duration) -> Runner {
        self.drain = bound;
        self
    }

    /// How long leaving may take once the tasks have stopped on shutdown; past it the session
    /// expires on its own one TTL later.
    pub fn shutdown_bound(mut self, bound: Duration) -> Runner {
        self.shutdown = bound;
        self
    }

    /// The wait before a failed handler runs again, doubling from `first` up to `max`.
    pub fn restart_backoff(mut self, first: Duration, max: Duration) -> Runner {
        self.restart = (first, max.max(first));
        self
    }

    /// The wait before joining again after a session ended or a join failed, doubling from
    /// `first` up to `max`; it starts again from `first` after a session that lasted a TTL.
    pub fn rejoin_backoff(mut self, first: Duration, max: Duration) -> Runner {
        self.rejoin = (first, max.max(first));
        self
    }

    /// Joins and runs `handler` once per granted partition until `shutdown` resolves; then
    /// stops every task (within the drain bound) and leaves (within the shutdown bound).
    ///
    /// A handler that returns `Ok` is done: the partition stays owned, idle, until it is
    /// revoked. One that returns `Err` or panics runs again after the restart backoff, unless
    /// it was told to stop. Errors that waiting will not cure end the run: a bad coordinator
    /// address, a refused name or certificate, a configuration the cluster rejects, a cluster
    /// at its session limit. Everything else (no leader, a session that expired) is retried.
    ///
    /// Dropping this future instead of resolving `shutdown` is a crash of the runner, not a
    /// shutdown: the tasks are aborted, not awaited, and the worker then leaves in the
    /// background, so a task busy on another thread may finish its current poll after the
    /// leave went out. Fencing is what covers that straggler.
    pub async fn run<H, Fut, E>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<RunReport, ClientError>
    where
        H: Fn(Assignment) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let handler = Arc::new(handler);
        let failures = Arc::new(AtomicU64::new(0));
        let mut report = RunReport::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut wait = self.rejoin.0;
        loop {
            let joined = tokio::select! {
                joined = Worker::join(self.config.clone()) => joined,
                _ = shutdown.as_mut() => break,
            };
            let worker = match joined {
                Ok(worker) => worker,
                Err(e) if is_fatal(&e) => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?wait, "could not join; trying again");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.as_mut() => break,
                    }
                    wait = (wait * 2).min(self.rejoin.1);
                    continue;
                }
            };
            report.sessions += 1;
            let began = Instant::now();
            let ttl = worker.lease_ttl();
            let mut session = Session::new(&self, worker, handler.clone(), failures.clone());
            session.publish();
            let ended = session.serve(shutdown.as_mut()).await;
            session.count_into(&mut report);
            self.status.send_replace(RunnerState::default());
            match ended {
                None => break,
                Some(reason) => {
                    tracing::warn!(reason = %reason, "the session ended; joining again");
                    report.session_ends.push(reason);
                }
            }
            if began.elapsed() >= ttl {
                wait = self.rejoin.0;
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.as_mut() => break,
            }
            wait = (wait * 2).min(self.rejoin.1);
        }
        report.failures = failures.load(Ordering::Relaxed);
        Ok(report)
    }
}

/// Join errors that a retry will not cure.
fn is_fatal(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::BadAddress(_)
            | ClientError::InvalidArgument(_)
            | ClientError::NotAllowed(_)
            | ClientError::Unauthenticated(_)
            | ClientError::LimitReached(_)
    )
}

/// Who asked for a partition to be given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// The coordinator, with a revoke.
    Revoked,
    /// The partition's task, with [`Assignment::give_back`].
    GivenBack,
}

/// Where a partition's task is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// The handler returned `Ok`: the partition is owned and nothing runs for it.
    Idle,
    /// Told to stop; aborted at `until`. `release` is false on shutdown (the leave gives
    /// everything back at once).
    Draining {
        until: Instant,
        cut: bool,
        release: bool,
    },
    /// Aborted: the partition is not this worker's any more.
    Aborted,
}

struct Slot {
    token: FencingToken,
    stop: CancellationToken,
    task: Id,
    abort: AbortHandle,
    phase: Phase,
}

/// One session's tasks.
struct Session<H> {
    /// Dropped first (fields drop in order): a dropped run aborts its tasks before the worker
    /// goes and leaves. Aborting does not wait; see [`Runner::run`].
    tasks: JoinSet<()>,
    worker: Arc<Worker>,
    status: Arc<watch::Sender<RunnerState>>,
    handler: Arc<H>,
    failures: Arc<AtomicU64>,
    drain: Duration,
    shutdown_bound: Duration,
    restart: (Duration, Duration),
    slots: BTreeMap<PartitionId, Slot>,
    owners: HashMap<Id, PartitionId>,
    deadlines: BTreeSet<(Instant, PartitionId)>,
    /// Partitions the tasks asked to give back ([`Assignment::give_back`]).
    given_back: (mpsc::UnboundedSender<Grant>, mpsc::UnboundedReceiver<Grant>),
    shutting_down: bool,
    counts: RunReport,
}

impl<H, Fut, E> Session<H>
where
    H: Fn(Assignment) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Display + Send + 'static,
{
    fn new(runner: &Runner, worker: Worker, handler: Arc<H>, failures: Arc<AtomicU64>) -> Session<H> {
        Session {
            worker: Arc::new(worker),
            status: runner.status.clone(),
            handler,
            failures,
            drain: runner.drain,
            shutdown_bound: runner.shutdown,
            restart: runner.restart,
            slots: BTreeMap::new(),
            tasks: JoinSet::new(),
            owners: HashMap::new(),
            deadlines: BTreeSet::new(),
            given_back: mpsc::unbounded_channel(),
            shutting_down: false,
            counts: RunReport::default(),
        }
    }

    fn count_into(&self, report: &mut RunReport) {
        report.granted += self.counts.granted;
        report.drained += self.counts.drained;
        report.cut_short += self.counts.cut_short;
        report.lost += self.counts.lost;
    }

    /// Runs the session until it ends (`Some(why)`) or `shutdown` resolves and the session was
    /// left (`None`).
    async fn serve(&mut self, mut shutdown: Pin<&mut impl Future<Output = ()>>) -> Option<SessionEnd> {
        // A fresh worker's stream is always there; a closed one ends the session below.
        let mut events =
            Arc::get_mut(&mut self.worker).and_then(Worker::events).unwrap_or_else(crate::Events::closed);
        loop {
            self.publish();
            if self.shutting_down && self.tasks.is_empty() {
                self.leave().await;
                return None;
            }
            let next_deadline = self.deadlines.first().map(|(at, _)| *at);
            tokio::select! {
                event = events.recv() => match event {
                    Some(WorkerEvent::SessionEnded { reason }) => return self.end(reason).await,
                    Some(event) => self.on_event(event),
                    None => {
                        let gone = ClientError::Unavailable("the worker's event stream closed".into());
                        return self.end(SessionEnd::Gone(gone)).await;
                    }
                },
                Some(ended) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.on_task_end(match ended {
                        Ok((id, ())) => id,
                        Err(e) => e.id(),
                    });
                }
                _ = tokio::time::sleep_until(next_deadline.unwrap_or_else(Instant::now)), if next_deadline.is_some() => {
                    self.on_deadlines(Instant::now());
                }
                Some((partition, token)) = self.given_back.1.recv() => {
                    self.stop_and_release(partition, token, Asked::GivenBack);
                }
                _ = shutdown.as_mut(), if !self.shutting_down => self.begin_shutdown(),
            }
        }
    }

    /// Tells [`RunnerStatus`] readers what runs now, if that changed.
    fn publish(&self) {
        let running: BTreeMap<PartitionId, FencingToken> = self
            .slots
            .iter()
            .filter(|(_, slot)| matches!(slot.phase, Phase::Running | Phase::Draining { .. }))
            .map(|(partition, slot)| (*partition, slot.token))
            .collect();
        let session = Some(self.worker.session());
        self.status.send_if_modified(|state| {
            let changed = state.session != session || state.running != running;
            if changed {
                *state = RunnerState { session, running };
            }
            changed
        });
    }

    fn on_event(&mut self, event: WorkerEvent) {
        match event {
            WorkerEvent::Granted(handle) => {
                if self.shutting_down {
                    return; // the leave gives it back with the rest
                }
                if let Some(old) = self.slots.remove(&handle.partition()) {
                    old.abort.abort();
                }
                self.start(handle);
            }
            WorkerEvent::Revoking { partition, token } => {
                self.stop_and_release(partition, token, Asked::Revoked)
            }
            WorkerEvent::Lost { partition, token, .. } | WorkerEvent::Released { partition, token } => {
                let lost = matches!(event, WorkerEvent::Lost { .. });
                if let Some(slot) = self.slots.get_mut(&partition).filter(|s| s.token == token) {
                    match slot.phase {
                        Phase::Idle => {
                            self.slots.remove(&partition);
                        }
                        Phase::Running | Phase::Draining { .. } => {
                            slot.stop.cancel();
                            slot.abort.abort();
                            slot.phase = Phase::Aborted;
                            if lost {
                                self.counts.lost += 1;
                            }
                        }
                        Phase::Aborted => {}
                    }
                }
            }
            WorkerEvent::SessionEnded { .. } => {} // handled by the caller
        }
    }

    /// Tells the task of grant `token` of `partition` to stop, and releases the partition once
    /// the task has ended (or at once when none runs).
    fn stop_and_release(&mut self, partition: PartitionId, token: FencingToken, asked: Asked) {
        // A revoked lease is not renewed, so its local deadline cuts the drain short when it
        // comes first; a given-back one still is, and only the drain bound (or a loss) ends it.
        let bound = Instant::now() + self.drain;
        let until = match asked {
            Asked::Revoked => self.worker_deadline(partition, token).min(bound),
            Asked::GivenBack => bound,
        };
        match self.slots.get_mut(&partition) {
            // Another grant's task (a newer one): not this grant's to stop or give back.
            Some(slot) if slot.token != token => {}
            Some(slot) if slot.phase == Phase::Running => {
                slot.stop.cancel();
                slot.phase = Phase::Draining { until, cut: false, release: true };
                self.deadlines.insert((until, partition));
            }
            Some(slot) if matches!(slot.phase, Phase::Draining { .. }) => {
                // Already stopping (for a shutdown, or asked twice): release it when it is done.
                if let Phase::Draining { release, .. } = &mut slot.phase {
                    *release = true;
                }
            }
            Some(slot) if slot.phase == Phase::Aborted => {}
            Some(_) => {
                // Idle: nothing runs to wait for.
                self.slots.remove(&partition);
                self.release(partition);
            }
            // No task: the grant was never started (granted while shutting down), or its task
            // already ended and gave it back (a revoke that crossed a give-back). Release only
            // while this worker still holds that very grant, never a newer one.
            None => {
                if asked == Asked::Revoked && self.worker.shared.valid_until(partition, token).is_some() {
                    self.release(partition);
                }
            }
        }
    }

    /// The local deadline of a revoked grant, which no renewal moves any more.
    fn worker_deadline(&self, partition: PartitionId, token: FencingToken) -> Instant {
        let held = self.worker.shared.valid_until(partition, token);
        held.unwrap_or_else(Instant::now)
    }

    fn start(&mut self, handle: PartitionHandle) {
        let partition = handle.partition();
        let stop = handle.cancellation().child_token();
        let assignment = Assignment {
            handle: handle.clone(),
            session: self.worker.session(),
            stop: stop.clone(),
            lease_ttl: self.worker.lease_ttl(),
            keyspace: self.worker.keyspace(),
            give_back: GiveBack { asked: Default::default(), to: self.given_back.0.clone() },
        };
        let work = supervise(self.handler.clone(), assignment, self.restart, self.failures.clone());
        let abort = self.tasks.spawn(work);
        let task = abort.id();
        self.owners.insert(task, partition);
        self.slots
            .insert(partition, Slot { token: handle.token(), stop, task, abort, phase: Phase::Running });
        self.counts.granted += 1;
    }

    fn on_task_end(&mut self, task: Id) {
        let Some(partition) = self.owners.remove(&task) else { return };
        let Some(slot) = self.slots.get_mut(&partition).filter(|s| s.task == task) else { return };
        match slot.phase {
            Phase::Running => slot.phase = Phase::Idle,
            Phase::Idle => {}
            Phase::Draining { until, cut, release } => {
                self.deadlines.remove(&(until, partition));
                if cut {
                    self.counts.cut_short += 1;
                } else {
                    self.counts.drained += 1;
                }
                self.slots.remove(&partition);
                if release {
                    self.release(partition);
                }
            }
            Phase::Aborted => {
                self.slots.remove(&partition);
            }
        }
    }

    /// Aborts every draining task whose bound has come.
    fn on_deadlines(&mut self, now: Instant) {
        while let Some(&(at, partition)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(slot) = self.slots.get_mut(&partition) {
                if let Phase::Draining { until, cut, .. } = &mut slot.phase {
                    if *until == at && !*cut {
                        tracing::warn!(%partition, "the partition's task did not stop within its drain bound; aborting it");
                        *cut = true;
                        slot.abort.abort();
                    }
                }
            }
        }
    }

    /// Gives a revoked partition back, now that its task has ended.
    fn release(&self, partition: PartitionId) {
        let worker = self.worker.clone();
        tokio::spawn(async move {
            if let Err(e) = worker.release(&[partition]).await {
                tracing::debug!(%partition, error = %e, "release failed; the lease will run out instead");
            }
        });
    }

    fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        let until = Instant::now() + self.drain;
        for (partition, slot) in &mut self.slots {
            slot.stop.cancel();
            if slot.phase == Phase::Running {
                slot.phase = Phase::Draining { until, cut: false, release: false };
                self.deadlines.insert((until, *partition));
            }
        }
    }

    async fn leave(&self) {
        match tokio::time::timeout(self.shutdown_bound, self.worker.leave()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not leave; the session will expire"),
            Err(_) => {
                tracing::warn!(bound = ?self.shutdown_bound, "could not leave in time; the session will expire")
            }
        }
    }

    /// The session is over: every task is aborted, and awaited so none outlives it.
    async fn end(&mut self, reason: SessionEnd) -> Option<SessionEnd> {
        for slot in self.slots.values() {
            slot.stop.cancel();
            if matches!(slot.phase, Phase::Running | Phase::Draining { .. }) {
                self.counts.lost += 1;
            }
        }
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        self.slots.clear();
        self.owners.clear();
        self.deadlines.clear();
        if self.shutting_down {
            return None;
        }
        Some(reason)
    }
}

/// Runs the handler for one assignment until it returns `Ok` or is told to stop, restarting
/// it after a failure. The handler's future runs inside this task, its panics caught here, so
/// aborting this task drops the handler's future before the runner hears that the task ended:
/// nothing of the handler outlives the moment the runner releases the partition.
async fn supervise<H, Fut, E>(
    handler: Arc<H>,
    assignment: Assignment,
    backoff: (Duration, Duration),
    failures: Arc<AtomicU64>,
) where
    H: Fn(Assignment) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Display + Send + 'static,
{
    let partition = assignment.partition();
    let mut wait = backoff.0;
    loop {
        let failure = match CatchUnwind(Box::pin(handler(assignment.clone()))).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(()) => "the handler panicked".to_string(),
        };
        failures.fetch_add(1, Ordering::Relaxed);
        if assignment.is_stopped() {
            tracing::warn!(%partition, error = %failure, "partition handler failed while stopping");
            return;
        }
        tracing::warn!(%partition, error = %failure, retry_in = ?wait, "partition handler failed; running it again");
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = assignment.stopped() => return,
        }
        wait = (wait * 2).min(backoff.1);
    }
}

/// A future whose panic becomes `Err(())`. The future is dropped after a panic and never
/// polled again, so no state it left half-changed is observed.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, ()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(out)) => std::task::Poll::Ready(Ok(out)),
            Err(_) => std::task::Poll::Ready(Err(())),
        }
    }
}
