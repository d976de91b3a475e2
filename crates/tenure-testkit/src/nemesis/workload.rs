//! A worker slot of the nemesis: one real [`Worker`] at a time under one name, writing through
//! its partition handles to the run's fenced store and recording every operation.
//!
//! The same task runs in two places. In the harness's process ([`LocalSlot`]), the nemesis
//! freezes, crashes and restarts it through [`SlotCommand`]s, emulating a pause by stopping its
//! heartbeats and then writing blind. In a worker process of its own
//! ([`super::worker_process`]), the faults are real signals, and its writes are checked then
//! made one write interval later, so a SIGSTOP that lands in between produces a genuinely late
//! write. Either way the records and beliefs go to a [`Sink`].

use super::Clock;
use crate::fence::{FenceError, FenceStore};
use crate::history::{WorkerOp, WorkerRecord};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::worker::{Events, Fenced, PartitionHandle, Worker, WorkerConfig, WorkerEvent};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long a slot keeps trying to join while the coordinators are down.
const JOIN_PATIENCE: Duration = Duration::from_secs(60);

pub(crate) enum SlotCommand {
    /// Stop everything for this long (heartbeats included), then write once more with the
    /// tokens held before, without looking at the lease, and rejoin.
    Freeze(Duration),
    /// Die, forgetting everything, and rejoin after this long.
    Crash(Duration),
    /// Stop for good (as a crash: the table is read before).
    Stop,
    /// Do what applications do of their own accord.
    Act(Action),
}

/// What an application does with its worker of its own accord, as opposed to a fault. In each,
/// the partition tasks run on beside the call, writing while their handles say the lease is
/// valid, as an application's per-partition tasks do while another part of it decides to let
/// go: the library must end their belief before the coordinator can give the partitions away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum Action {
    /// Release one partition that was never revoked.
    Release,
    /// Leave gracefully, then join again under the same name.
    Leave,
    /// Drop the `Worker` (which leaves in the background), then join again under the same name.
    Drop,
}

/// What a slot's worker is: its session and the partitions its library believes it holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct View {
    pub(crate) session: Option<SessionId>,
    pub(crate) believed: BTreeMap<PartitionId, FencingToken>,
}

/// Where a slot's task reports what it did and what it believes.
pub(crate) trait Sink: Send + Sync + 'static {
    fn record(&self, record: WorkerRecord);
    fn view(&self, view: &View);
}

/// The sink of a slot in the harness's process: shared memory.
pub(crate) struct LocalSink {
    pub(crate) view: Arc<Mutex<View>>,
    pub(crate) records: Arc<Mutex<Vec<WorkerRecord>>>,
}

impl Sink for LocalSink {
    fn record(&self, record: WorkerRecord) {
        self.records.lock().expect("worker records poisoned").push(record);
    }
    fn view(&self, view: &View) {
        *self.view.lock().expect("slot view poisoned") = view.clone();
    }
}

/// A worker slot as the nemesis drives it, wherever it runs.
pub(crate) enum Slot {
    Local(LocalSlot),
    Process(Box<super::worker_process::ProcessSlot>),
}

impl Slot {
    pub(crate) fn name(&self) -> &str {
        match self {
            Slot::Local(s) => &s.name,
            Slot::Process(s) => &s.name,
        }
    }

    /// Carries out a command and waits until it is done.
    pub(crate) async fn send(&self, command: SlotCommand) -> Result<(), String> {
        match (self, command) {
            (Slot::Local(s), command) => s.send(command).await,
            (Slot::Process(s), SlotCommand::Freeze(pause)) => s.freeze(pause).await,
            (Slot::Process(s), SlotCommand::Crash(down)) => s.crash(down).await?,
            (Slot::Process(s), SlotCommand::Stop) => s.kill().await,
            (Slot::Process(s), SlotCommand::Act(action)) => s.act(action).await?,
        }
        Ok(())
    }

    /// The worker's session and what its library believes it holds, as last reported.
    pub(crate) fn view(&self) -> View {
        match self {
            Slot::Local(s) => s.view(),
            Slot::Process(s) => s.view(),
        }
    }

    pub(crate) fn session(&self) -> Option<SessionId> {
        self.view().session
    }

    /// What the worker library believes it holds right now.
    pub(crate) fn believed(&self) -> BTreeMap<PartitionId, FencingToken> {
        self.view().believed
    }

    /// Waits for the slot to finish after [`SlotCommand::Stop`].
    pub(crate) async fn join(self) {
        match self {
            Slot::Local(s) => s.join().await,
            Slot::Process(s) => s.kill().await,
        }
    }
}

/// The nemesis's side of a slot in its own process.
pub(crate) struct LocalSlot {
    pub(crate) name: String,
    commands: mpsc::Sender<(SlotCommand, oneshot::Sender<()>)>,
    view: Arc<Mutex<View>>,
    task: JoinHandle<()>,
}

impl LocalSlot {
    /// A slot joining with `config` (its name, where it dials from, its certificate).
    pub(crate) async fn start<S: FenceStore + 'static>(
        config: WorkerConfig,
        store: Arc<S>,
        records: Arc<Mutex<Vec<WorkerRecord>>>,
        clock: Clock,
        interval: Duration,
    ) -> Result<LocalSlot, String> {
        let view = Arc::new(Mutex::new(View::default()));
        let sink = Arc::new(LocalSink { view: view.clone(), records });
        let name = config.name.clone();
        let mut task = SlotTask::new(config, store, sink, clock, interval);
        task.rejoin().await?;
        let (commands, rx) = mpsc::channel(1);
        let task = tokio::spawn(task.run(rx));
        Ok(LocalSlot { name, commands, view, task })
    }

    /// Carries out a command and waits until the slot has done it.
    pub(crate) async fn send(&self, command: SlotCommand) {
        let (done, wait) = oneshot::channel();
        if self.commands.send((command, done)).await.is_ok() {
            let _ = wait.await;
        }
    }

    pub(crate) fn view(&self) -> View {
        self.view.lock().expect("slot view poisoned").clone()
    }

    pub(crate) async fn join(self) {
        let _ = self.task.await;
    }
}

/// Something that may hold a slot up between its check and its writes (the simulation's
/// stand-in for a process pause); the future ends when the slot may go on.
pub(crate) type Stall = Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

pub(crate) struct SlotTask<S> {
    name: String,
    stall: Option<Stall>,
    config: WorkerConfig,
    store: Arc<S>,
    sink: Arc<dyn Sink>,
    clock: Clock,
    interval: Duration,
    worker: Option<Worker>,
    events: Events,
    /// The partitions this slot acquired, each with its fence raised in the run's store.
    handles: BTreeMap<PartitionId, Fenced<Arc<S>>>,
    view: View,
    writes: u64,
    /// Actions sent to a worker process (on its standard input).
    actions: Option<mpsc::Receiver<Action>>,
}

impl<S: FenceStore + 'static> SlotTask<S> {
    /// A slot joining with `config` (its name, where it dials from, its certificate).
    pub(crate) fn new(
        config: WorkerConfig,
        store: Arc<S>,
        sink: Arc<dyn Sink>,
        clock: Clock,
        interval: Duration,
    ) -> SlotTask<S> {
        SlotTask {
            name: config.name.clone(),
            stall: None,
            config,
            store,
            sink,
            clock,
            interval,
            worker: None,
            events: Events::closed(),
            handles: BTreeMap::new(),
            view: View::default(),
            writes: 0,
            actions: None,
        }
    }

    /// Takes [`Action`]s from `actions` between rounds.
    pub(crate) fn acting_on(mut self, actions: mpsc::Receiver<Action>) -> Self {
        self.actions = Some(actions);
        self
    }

    /// Carries out the actions that arrived since the last round.
    async fn take_actions(&mut self) {
        while let Some(action) = self.actions.as_mut().and_then(|a| a.try_recv().ok()) {
            self.act(action).await;
        }
    }

    /// See [`Action`]. The slot's own belief ends when it decides (each handle it gives up is
    /// recorded `Released` then); what the library's handles say afterwards is what is tested.
    pub(crate) async fn act(&mut self, action: Action) {
        self.follow_events().await;
        let Some(worker) = self.worker.take() else { return };
        let given_up: Vec<Fenced<Arc<S>>> = match action {
            Action::Release => {
                self.handles.values().find(|h| Self::belief(h).is_some()).cloned().into_iter().collect()
            }
            Action::Leave | Action::Drop => self.handles.values().cloned().collect(),
        };
        for h in &given_up {
            self.handles.remove(&h.partition());
            self.record(h, WorkerOp::Released, self.clock.now_ns(), None);
        }
        // Long enough for the coordinator to apply what was asked, bounded.
        let linger = (self.interval * 10).max(Duration::from_millis(200));
        match action {
            Action::Release => {
                let partitions: Vec<PartitionId> = given_up.iter().map(Fenced::partition).collect();
                if !partitions.is_empty() {
                    let release = worker.release(&partitions);
                    tokio::pin!(release);
                    if let Err(e) = self.write_while_believed(&given_up, &mut release).await {
                        tracing::debug!(worker = %self.name, error = %e, "release failed");
                    }
                }
                self.worker = Some(worker);
            }
            Action::Leave => {
                {
                    let leave = async {
                        let left = worker.leave().await;
                        tokio::time::sleep(linger).await;
                        left
                    };
                    tokio::pin!(leave);
                    if let Err(e) = self.write_while_believed(&given_up, &mut leave).await {
                        tracing::debug!(worker = %self.name, error = %e, "leave failed; the session will expire");
                    }
                }
                drop(worker);
                self.start_over().await;
            }
            Action::Drop => {
                drop(worker);
                let linger = tokio::time::sleep(linger);
                tokio::pin!(linger);
                self.write_while_believed(&given_up, &mut linger).await;
                self.start_over().await;
            }
        }
        self.publish();
    }

    /// Writes under each of `handles` that the library still says is valid, every millisecond,
    /// until `done` finishes; returns its output.
    async fn write_while_believed<F: std::future::Future + Unpin>(
        &mut self,
        handles: &[Fenced<Arc<S>>],
        done: &mut F,
    ) -> F::Output {
        loop {
            // `done` first: the call must have started (the library withdraws belief before
            // it sends anything) before the tasks write again.
            tokio::select! {
                biased;
                out = &mut *done => return out,
                _ = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
            for h in handles {
                if let Some(belief) = Self::belief(h) {
                    self.write(h, Some(belief)).await;
                }
            }
        }
    }

    /// After leaving or dropping the worker: forget its handles and join again, under the
    /// same name.
    async fn start_over(&mut self) {
        self.handles.clear();
        self.view.session = None;
        self.view.believed.clear();
        self.sink.view(&self.view);
        if let Err(e) = self.rejoin().await {
            tracing::warn!(worker = %self.name, error = %e, "could not rejoin");
        }
    }

    /// Connects with `dialer` and lets `stall` hold the slot up between checks and writes.
    pub(crate) fn simulated(mut self, dialer: crate::transport::Dialer, stall: Stall) -> Self {
        self.config.dialer = dialer;
        self.stall = Some(stall);
        self
    }

    /// The loop of a worker process: take in events, check which leases are believed, spend a
    /// write interval "working", then write under each of those tokens. A SIGSTOP during the
    /// work makes the writes late, as a GC pause between check and write would.
    ///
    /// Each write is recorded as one operation from its check to its end, with the lease
    /// believed at the check, so the belief counts from when the worker held it. Returns only
    /// if the worker lost its session and could not join again.
    pub(crate) async fn run_checking_before_work(mut self) -> Result<(), String> {
        loop {
            self.take_actions().await;
            self.follow_events().await;
            if self.worker.is_none() {
                return Err(format!("{} could not join again", self.name));
            }
            let checked_at = self.clock.now_ns();
            let checked: Vec<(Fenced<Arc<S>>, Instant)> =
                self.handles.values().filter_map(|h| Self::belief(h).map(|b| (h.clone(), b))).collect();
            self.publish();
            tokio::time::sleep(self.interval).await;
            if let Some(stall) = &self.stall {
                stall().await;
            }
            for (h, belief) in checked {
                if self.handles.get(&h.partition()).is_some_and(|held| held.token() == h.token()) {
                    self.write_from(checked_at, &h, Some(belief)).await;
                }
            }
        }
    }

    async fn run(mut self, mut commands: mpsc::Receiver<(SlotCommand, oneshot::Sender<()>)>) {
        loop {
            tokio::select! {
                command = commands.recv() => {
                    let Some((command, done)) = command else { return };
                    match command {
                        SlotCommand::Stop => {
                            self.vanish();
                            let _ = done.send(());
                            return;
                        }
                        SlotCommand::Freeze(pause) => self.freeze(pause).await,
                        SlotCommand::Crash(down) => self.crash(down).await,
                        SlotCommand::Act(action) => self.act(action).await,
                    }
                    let _ = done.send(());
                }
                _ = tokio::time::sleep(self.interval) => {}
            }
            self.follow_events().await;
            self.write_round().await;
            self.publish();
        }
    }

    fn record(&self, h: &Fenced<Arc<S>>, op: WorkerOp, start_ns: u64, believed_until: Option<Instant>) {
        self.record_handle(h.handle(), op, start_ns, believed_until)
    }

    fn record_handle(
        &self,
        h: &PartitionHandle,
        op: WorkerOp,
        start_ns: u64,
        believed_until: Option<Instant>,
    ) {
        let session = self.view.session.unwrap_or(SessionId(0));
        self.sink.record(WorkerRecord {
            worker: self.name.clone(),
            session,
            partition: h.partition(),
            token: h.token(),
            op,
            start_ns,
            end_ns: self.clock.now_ns(),
            believed_until_ns: believed_until.map(|t| self.clock.at_ns(t)),
        });
    }

    /// The lease the worker believes in right now, if it is still running.
    fn belief(h: &Fenced<Arc<S>>) -> Option<Instant> {
        let h = h.handle();
        h.valid_until().filter(|until| *until > Instant::now() && h.is_valid())
    }

    async fn follow_events(&mut self) {
        while let Some(event) = self.events.try_recv() {
            match event {
                WorkerEvent::Granted(h) => {
                    let start = self.clock.now_ns();
                    let belief = h.valid_until().filter(|until| *until > Instant::now() && h.is_valid());
                    // Fence before resume: raise the fence, then read the checkpoint.
                    match h.acquire(self.store.clone()).await {
                        Ok(fenced) => {
                            self.record(&fenced, WorkerOp::Acquired, start, belief);
                            self.handles.insert(h.partition(), fenced);
                        }
                        Err(FenceError::Stale { .. }) => {
                            self.record_handle(&h, WorkerOp::Refused, start, belief)
                        }
                        Err(e) => tracing::warn!(error = %e, "store failed"),
                    }
                }
                WorkerEvent::Revoking { partition, token } => {
                    if let Some(h) = self.handles.remove(&partition).filter(|h| h.token() == token) {
                        self.record(&h, WorkerOp::Revoked, self.clock.now_ns(), None);
                    }
                    if let Some(worker) = &self.worker {
                        if let Err(e) = worker.release(&[partition]).await {
                            tracing::debug!(worker = %self.name, error = %e, "release failed; the lease will run out");
                        }
                    }
                }
                WorkerEvent::Lost { partition, token, .. } | WorkerEvent::Released { partition, token } => {
                    if self.handles.get(&partition).is_some_and(|h| h.token() == token) {
                        let h = self.handles.remove(&partition).expect("present");
                        let op = if matches!(event, WorkerEvent::Lost { .. }) {
                            WorkerOp::Lost
                        } else {
                            WorkerOp::Released
                        };
                        self.record(&h, op, self.clock.now_ns(), None);
                    }
                }
                WorkerEvent::SessionEnded { .. } => {
                    // The coordinator expired the session (say, across a partition): start a
                    // new one, as a real worker would.
                    self.vanish();
                    self.handles.clear();
                    if let Err(e) = self.rejoin().await {
                        tracing::warn!(worker = %self.name, error = %e, "could not rejoin");
                    }
                    return;
                }
            }
        }
    }

    async fn write_round(&mut self) {
        let handles: Vec<Fenced<Arc<S>>> = self.handles.values().cloned().collect();
        for h in handles {
            let Some(belief) = Self::belief(&h) else { continue };
            self.write(&h, Some(belief)).await;
        }
    }

    async fn write(&mut self, h: &Fenced<Arc<S>>, belief: Option<Instant>) {
        let start = self.clock.now_ns();
        self.write_from(start, h, belief).await;
    }

    /// One write, recorded as an operation that began at `start` (on the run's clock).
    async fn write_from(&mut self, start: u64, h: &Fenced<Arc<S>>, belief: Option<Instant>) {
        self.writes += 1;
        let value = format!("{}:{}:{}", self.name, h.token(), self.writes);
        match h.write(b"k", value.as_bytes()).await {
            Ok(()) => self.record(h, WorkerOp::Wrote, start, belief),
            Err(FenceError::Stale { .. }) => {
                self.record(h, WorkerOp::Refused, start, belief);
                self.handles.remove(&h.partition());
            }
            Err(e) => tracing::warn!(error = %e, "store failed"),
        }
    }

    /// Reports the view when it changed.
    fn publish(&mut self) {
        let believed = self.worker.as_ref().map(Worker::owned).unwrap_or_default();
        if believed != self.view.believed {
            self.view.believed = believed;
            self.sink.view(&self.view);
        }
    }

    /// The process is gone: no heartbeats, no leave.
    fn vanish(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.abandon();
        }
        self.view.believed.clear();
        self.sink.view(&self.view);
    }

    async fn freeze(&mut self, pause: Duration) {
        self.vanish();
        tokio::time::sleep(pause).await;
        // Awake, with the tokens it had: one write each, without a look at the lease.
        let held: Vec<Fenced<Arc<S>>> = std::mem::take(&mut self.handles).into_values().collect();
        for h in &held {
            self.write(h, None).await;
        }
        self.handles.clear();
        if let Err(e) = self.rejoin().await {
            tracing::warn!(worker = %self.name, error = %e, "could not rejoin");
        }
    }

    async fn crash(&mut self, down: Duration) {
        self.vanish();
        self.handles.clear();
        self.view.session = None;
        self.sink.view(&self.view);
        tokio::time::sleep(down).await;
        if let Err(e) = self.rejoin().await {
            tracing::warn!(worker = %self.name, error = %e, "could not rejoin");
        }
    }

    pub(crate) async fn rejoin(&mut self) -> Result<(), String> {
        let started = Instant::now();
        loop {
            match Worker::join(self.config.clone()).await {
                Ok(mut worker) => {
                    self.events = worker.events().unwrap_or_else(Events::closed);
                    self.view.session = Some(worker.session());
                    self.sink.view(&self.view);
                    self.worker = Some(worker);
                    return Ok(());
                }
                Err(e) if started.elapsed() > JOIN_PATIENCE => return Err(format!("{}: {e}", self.name)),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}
