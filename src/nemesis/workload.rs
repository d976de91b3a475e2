//! A worker slot of the nemesis: one real [`Worker`] at a time under one name, writing through
//! its partition handles to the run's fenced store and recording every operation. The nemesis
//! freezes, crashes and restarts it through [`SlotCommand`]s.

use super::{Clock, JournaledStore};
use crate::fence::FenceError;
use crate::history::{WorkerOp, WorkerRecord};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::worker::{PartitionHandle, Worker, WorkerConfig, WorkerEvent};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

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
}

#[derive(Default)]
struct View {
    session: Option<SessionId>,
    believed: BTreeMap<PartitionId, FencingToken>,
}

/// The nemesis's side of a slot.
pub(crate) struct Slot {
    pub(crate) name: String,
    commands: mpsc::Sender<(SlotCommand, oneshot::Sender<()>)>,
    view: Arc<Mutex<View>>,
    task: JoinHandle<()>,
}

impl Slot {
    pub(crate) async fn start(
        name: String,
        ip: IpAddr,
        coordinators: Vec<String>,
        store: Arc<JournaledStore>,
        records: Arc<Mutex<Vec<WorkerRecord>>>,
        clock: Clock,
        interval: Duration,
    ) -> Result<Slot, String> {
        let view = Arc::new(Mutex::new(View::default()));
        let mut config = WorkerConfig::new(coordinators, name.clone());
        config.dial_from = Some(ip);
        let mut task = SlotTask {
            name: name.clone(),
            config,
            store,
            records,
            clock,
            interval,
            worker: None,
            events: mpsc::unbounded_channel().1,
            handles: BTreeMap::new(),
            view: view.clone(),
            writes: 0,
        };
        task.rejoin().await?;
        let (commands, rx) = mpsc::channel(1);
        let task = tokio::spawn(task.run(rx));
        Ok(Slot { name, commands, view, task })
    }

    /// Carries out a command and waits until the slot has done it.
    pub(crate) async fn send(&self, command: SlotCommand) {
        let (done, wait) = oneshot::channel();
        if self.commands.send((command, done)).await.is_ok() {
            let _ = wait.await;
        }
    }

    pub(crate) fn session(&self) -> Option<SessionId> {
        self.view.lock().expect("slot view poisoned").session
    }

    /// What the worker library believes it holds right now.
    pub(crate) fn believed(&self) -> BTreeMap<PartitionId, FencingToken> {
        self.view.lock().expect("slot view poisoned").believed.clone()
    }

    pub(crate) async fn join(self) {
        let _ = self.task.await;
    }
}

struct SlotTask {
    name: String,
    config: WorkerConfig,
    store: Arc<JournaledStore>,
    records: Arc<Mutex<Vec<WorkerRecord>>>,
    clock: Clock,
    interval: Duration,
    worker: Option<Worker>,
    events: mpsc::UnboundedReceiver<WorkerEvent>,
    handles: BTreeMap<PartitionId, PartitionHandle>,
    view: Arc<Mutex<View>>,
    writes: u64,
}

impl SlotTask {
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

    fn record(&self, h: &PartitionHandle, op: WorkerOp, start_ns: u64, believed_until: Option<Instant>) {
        let session = self.view.lock().expect("slot view poisoned").session.unwrap_or(SessionId(0));
        self.records.lock().expect("worker records poisoned").push(WorkerRecord {
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
    fn belief(h: &PartitionHandle) -> Option<Instant> {
        h.valid_until().filter(|until| *until > Instant::now() && h.is_valid())
    }

    async fn follow_events(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            match event {
                WorkerEvent::Assigned(h) => {
                    let (start, belief) = (self.clock.now_ns(), Self::belief(&h));
                    // Fence before resume: raise the fence, then read the checkpoint.
                    match h.acquire(&*self.store).await {
                        Ok(_) => {
                            self.record(&h, WorkerOp::Acquired, start, belief);
                            self.handles.insert(h.partition(), h);
                        }
                        Err(FenceError::Stale { .. }) => self.record(&h, WorkerOp::Refused, start, belief),
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
        let handles: Vec<PartitionHandle> = self.handles.values().cloned().collect();
        for h in handles {
            let Some(belief) = Self::belief(&h) else { continue };
            self.write(&h, Some(belief)).await;
        }
    }

    async fn write(&mut self, h: &PartitionHandle, belief: Option<Instant>) {
        self.writes += 1;
        let value = format!("{}:{}:{}", self.name, h.token(), self.writes);
        let start = self.clock.now_ns();
        match h.write(&*self.store, b"k", value.as_bytes()).await {
            Ok(()) => self.record(h, WorkerOp::Wrote, start, belief),
            Err(FenceError::Stale { .. }) => {
                self.record(h, WorkerOp::Refused, start, belief);
                self.handles.remove(&h.partition());
            }
            Err(e) => tracing::warn!(error = %e, "store failed"),
        }
    }

    fn publish(&self) {
        let believed = self.worker.as_ref().map(Worker::owned).unwrap_or_default();
        self.view.lock().expect("slot view poisoned").believed = believed;
    }

    /// The process is gone: no heartbeats, no leave.
    fn vanish(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.abandon();
        }
        let mut view = self.view.lock().expect("slot view poisoned");
        view.believed.clear();
    }

    async fn freeze(&mut self, pause: Duration) {
        self.vanish();
        tokio::time::sleep(pause).await;
        // Awake, with the tokens it had: one write each, without a look at the lease.
        let held: Vec<PartitionHandle> = std::mem::take(&mut self.handles).into_values().collect();
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
        self.view.lock().expect("slot view poisoned").session = None;
        tokio::time::sleep(down).await;
        if let Err(e) = self.rejoin().await {
            tracing::warn!(worker = %self.name, error = %e, "could not rejoin");
        }
    }

    async fn rejoin(&mut self) -> Result<(), String> {
        let started = Instant::now();
        loop {
            match Worker::join(self.config.clone()).await {
                Ok(mut worker) => {
                    self.events = worker.events();
                    self.view.lock().expect("slot view poisoned").session = Some(worker.session());
                    self.worker = Some(worker);
                    return Ok(());
                }
                Err(e) if started.elapsed() > JOIN_PATIENCE => return Err(format!("{}: {e}", self.name)),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}
