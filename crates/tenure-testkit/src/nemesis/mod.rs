//! The nemesis: the real system under injected faults, with a recorded history that the
//! [checker](crate::history::check) judges afterwards.
//!
//! A run starts a coordinator cluster whose nodes sit behind [`FaultProxy`]s on loopback (real
//! gRPC, real RocksDB on disk), and worker slots that each run a real [`Worker`] and write
//! through their partition handles to a fenced store. A schedule drawn from a seed injects one
//! fault at a time, heals it, and moves on:
//!
//! - `freeze-worker`: a worker stops past its TTL, as under a long GC pause: a worker process
//!   gets SIGSTOP, then SIGCONT, and the writes it had checked before the stop go out late; an
//!   in-process slot stops its heartbeats, then writes once more with the tokens it had without
//!   looking at its lease (a write stuck in a buffer). Either then carries on or rejoins.
//! - `crash-worker`: a worker dies (its memory with it) and restarts later as a new session.
//! - `partition-worker`: a worker loses the coordinators but still reaches storage.
//! - `minority-leader`: the leader is cut off from the other nodes; workers still reach it.
//! - `isolate-leader`: the leader is cut off from everyone.
//! - `pause-leader`: the leader process is frozen with SIGSTOP and woken with SIGCONT (with
//!   in-process nodes, emulated by cutting all its links).
//! - `kill-leader`, `kill-follower`: a node dies abruptly (`kill -9` of its process) and restarts
//!   on the same data.
//! - `kill-all`: every node dies at once, then all restart.
//! - `slow-network`: every link to every node (workers' and peers') holds each chunk back by
//!   the same delay, a few milliseconds to half an election timeout each way.
//!
//! Three streams are recorded on one monotonic clock: every replica's applied decisions, every
//! worker operation, and the store's decisions in the order it applied them. After the last
//! fault heals, the run waits for the table to be fully owned again and reads it; then the
//! history is checked. Everything is bounded: the fault phase by `fault_time`, each fault by a
//! few TTLs, the recovery wait by twice the liveness bound.
//!
//! The nodes are either `tenure serve` processes ([`NemesisConfig::serve_binary`]), which take
//! real signals and whose decisions are read back from their RocksDB logs after the run, or
//! nodes in this process, followed live as they apply entries (quicker to start; a "kill" there
//! is an abrupt stop). The worker slots go with the nodes: with processes, each slot is a
//! `tenure nemesis-worker` process that dials from its own loopback address, reaches the run's
//! store over gRPC ([`RemoteStore`]) and is frozen with a real SIGSTOP and killed with SIGKILL;
//! otherwise each slot runs in this process and a freeze is emulated (heartbeats stop, then a
//! blind write).

mod coordinators;
mod processes;
mod remote_store;
mod runner_slot;
mod worker_process;
pub(crate) mod workload;

pub use crate::fault_proxy::FaultProxy;
pub use processes::{ProcessCluster, ProcessError, ServeSettings};
pub use remote_store::{serve_store, RemoteStore};
pub use worker_process::{run_worker_process, WorkerProcessArgs};

use crate::history::{self, Committed, Fault, FinalRow, History, Report, Resumed, StoreRecord, WorkerOp};
use crate::ids::{FencingToken, NodeId, PartitionId, SessionId};
use crate::local_cluster::{node_ip, LocalCluster};
use coordinators::{Coordinators, Operation};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use workload::{Action, LocalSlot, Slot, SlotCommand};

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    FreezeWorker,
    CrashWorker,
    PartitionWorker,
    MinorityLeader,
    IsolateLeader,
    PauseLeader,
    KillLeader,
    KillFollower,
    KillAll,
    SlowNetwork,
    /// A node is killed and restarted with another `--lease-ttl-ms` than the cluster's.
    RestartOtherFlags,
    /// One step of a rolling upgrade: a node that runs the oldest version of the placement
    /// rules in the cluster is killed and started again running the next. Nodes of two
    /// versions then lead in turn; the log carries their decisions, so replicas must still
    /// agree entry by entry.
    UpgradeNode,
    /// What applications do of their own accord (not faults, but paths the invariants must
    /// hold on): release a partition that was never revoked, leave, drop the `Worker`; the
    /// last two join again under the same name.
    ReleaseOwnAccord,
    LeaveWorker,
    DropWorker,
    /// An operator's planned restart of the leader: SIGTERM (the leader hands over to a
    /// follower, then exits), and the node starts again.
    StopLeaderGracefully,
    /// An operator drains a worker (`ctl drain`): its session leaves as if the worker had
    /// left, and the worker, told its session ended, joins again.
    DrainWorker,
    /// An operator turns maintenance mode on for a while (nothing is taken from a live
    /// owner, unowned partitions are still granted), then off.
    Maintenance,
    /// An operator gives a worker another weight for a while, then weight 1 again.
    SetWeight,
    /// An operator shortens the lease TTL to a third to a half for a while (half the time the
    /// leader is killed just after, so a new leader takes over while the change is unsettled),
    /// then sets it back.
    SetLeaseTtl,
}

impl FaultKind {
    pub const ALL: [FaultKind; 20] = [
        FaultKind::FreezeWorker,
        FaultKind::CrashWorker,
        FaultKind::PartitionWorker,
        FaultKind::MinorityLeader,
        FaultKind::IsolateLeader,
        FaultKind::PauseLeader,
        FaultKind::KillLeader,
        FaultKind::KillFollower,
        FaultKind::KillAll,
        FaultKind::SlowNetwork,
        FaultKind::RestartOtherFlags,
        FaultKind::UpgradeNode,
        FaultKind::ReleaseOwnAccord,
        FaultKind::LeaveWorker,
        FaultKind::DropWorker,
        FaultKind::StopLeaderGracefully,
        FaultKind::DrainWorker,
        FaultKind::Maintenance,
        FaultKind::SetWeight,
        FaultKind::SetLeaseTtl,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::FreezeWorker => "freeze-worker",
            FaultKind::CrashWorker => "crash-worker",
            FaultKind::PartitionWorker => "partition-worker",
            FaultKind::MinorityLeader => "minority-leader",
            FaultKind::IsolateLeader => "isolate-leader",
            FaultKind::PauseLeader => "pause-leader",
            FaultKind::KillLeader => "kill-leader",
            FaultKind::KillFollower => "kill-follower",
            FaultKind::KillAll => "kill-all",
            FaultKind::SlowNetwork => "slow-network",
            FaultKind::RestartOtherFlags => "restart-other-flags",
            FaultKind::UpgradeNode => "upgrade-node",
            FaultKind::ReleaseOwnAccord => "release-own-accord",
            FaultKind::LeaveWorker => "leave-worker",
            FaultKind::DropWorker => "drop-worker",
            FaultKind::StopLeaderGracefully => "stop-leader-gracefully",
            FaultKind::DrainWorker => "drain-worker",
            FaultKind::Maintenance => "maintenance",
            FaultKind::SetWeight => "set-weight",
            FaultKind::SetLeaseTtl => "set-lease-ttl",
        }
    }

    pub fn parse(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// What a run does.
#[derive(Clone, Debug)]
pub struct NemesisConfig {
    pub seed: u64,
    pub nodes: u64,
    pub workers: usize,
    pub partition_count: u32,
    pub lease_ttl: Duration,
    pub election_timeout: Duration,
    /// How long faults are injected; the run then heals, waits for recovery and stops.
    pub fault_time: Duration,
    /// The kinds to draw from; each appears once per round, in an order drawn from the seed.
    pub faults: Vec<FaultKind>,
    /// `false` runs the store with its check switched off, which the checker must flag.
    pub fencing: bool,
    /// Pause between a worker's rounds of writes.
    pub write_interval: Duration,
    /// Run the nodes and the workers as processes of this `tenure` binary; `None` runs them in
    /// this process.
    pub serve_binary: Option<std::path::PathBuf>,
    /// How many of the worker processes run the partition runner (the last ones) rather than
    /// the worker library's event loop; only with [`NemesisConfig::serve_binary`].
    pub runners: usize,
}

impl NemesisConfig {
    /// A run of `fault_time` with every fault kind, sized for a test: 3 nodes, 3 workers,
    /// 12 partitions, TTL 1 s.
    pub fn new(seed: u64, fault_time: Duration) -> NemesisConfig {
        NemesisConfig {
            seed,
            nodes: 3,
            workers: 3,
            partition_count: 12,
            lease_ttl: Duration::from_millis(1000),
            election_timeout: Duration::from_millis(300),
            fault_time,
            faults: FaultKind::ALL.to_vec(),
            fencing: true,
            write_interval: Duration::from_millis(20),
            serve_binary: None,
            runners: 1,
        }
    }

    /// After the faults heal, every partition must be owned again within this: an election
    /// (a few election timeouts, with retries), the new leader's fresh TTL for every lease, a
    /// frozen or crashed owner's TTL, and a second of slack for the grant and its confirmation.
    pub fn liveness_bound(&self) -> Duration {
        self.lease_ttl * 2 + self.election_timeout * 4 + Duration::from_secs(1)
    }
}

/// Why a run could not be carried out (as opposed to a violation, which is in the report).
#[derive(Debug, thiserror::Error)]
pub enum NemesisError {
    #[error("cluster: {0}")]
    Cluster(#[from] crate::server::NodeError),
    #[error("no leader within {0:?}")]
    NoLeader(Duration),
    #[error("worker: {0}")]
    Worker(String),
    #[error("node process: {0}")]
    Process(#[from] ProcessError),
    #[error("restarting node {0}: {1}")]
    Restart(NodeId, String),
    #[error("reading node {0}'s log back: {1}")]
    Replay(NodeId, crate::store::ReplayError),
    #[error("an operator's call: {0}")]
    Operator(String),
}

/// A finished run: the history, its verdicts and a few totals.
pub struct Outcome {
    pub history: History,
    pub report: Report,
    pub writes_accepted: usize,
    pub writes_refused: usize,
    pub faults: BTreeMap<&'static str, usize>,
    /// The worker slots that ran the partition runner.
    pub runner_slots: Vec<String>,
}

impl Outcome {
    /// Writes the store refused from an event-loop worker while it was frozen (SIGSTOP for a
    /// process): operations of the frozen worker that overlap its freeze. Fencing was exercised
    /// by a pause only if there are some. Runner slots are left out (see
    /// [`Outcome::froze_an_event_loop_worker`]).
    pub fn refused_from_frozen_workers(&self) -> usize {
        let h = &self.history;
        let freezes: Vec<(&str, u64, u64)> = h
            .faults
            .iter()
            .filter_map(|f| {
                let name = f.what.strip_prefix("freeze-worker ")?.split(' ').next()?;
                Some((name, f.start_ns, f.healed_ns))
            })
            .filter(|(name, ..)| !self.runner_slots.iter().any(|r| r == name))
            .collect();
        h.workers
            .iter()
            .filter(|r| r.op == WorkerOp::Refused)
            .filter(|r| {
                freezes
                    .iter()
                    .any(|(name, from, to)| *name == r.worker && r.start_ns <= *to && r.end_ns >= *from)
            })
            .count()
    }

    /// Whether a freeze hit a worker on the event loop. A frozen runner's tasks are aborted as
    /// it wakes, usually before a late write is sent, so only these must show refusals.
    pub fn froze_an_event_loop_worker(&self) -> bool {
        self.history.faults.iter().any(|f| {
            f.what
                .strip_prefix("freeze-worker ")
                .and_then(|rest| rest.split(' ').next())
                .is_some_and(|name| !self.runner_slots.iter().any(|r| r == name))
        })
    }

    /// What the run fell short of, if anything: a run that did too little proves nothing,
    /// whatever its verdicts say. At least 20 committed decisions, 500 worker operations, 100
    /// accepted writes, a fault, and, when a worker was frozen with fencing on, a write the
    /// store refused from it.
    pub fn shortfalls(&self, fencing: bool) -> Vec<String> {
        let h = &self.history;
        let decisions =
            h.coordinator.iter().map(|c| c.index).collect::<std::collections::BTreeSet<_>>().len();
        let mut short = Vec::new();
        if decisions < 20 {
            short.push(format!("only {decisions} log entries made decisions"));
        }
        if h.workers.len() < 500 {
            short.push(format!("only {} worker operations", h.workers.len()));
        }
        if self.writes_accepted < 100 {
            short.push(format!("only {} accepted writes", self.writes_accepted));
        }
        if h.faults.is_empty() {
            short.push("no fault ran".into());
        }
        if fencing && self.froze_an_event_loop_worker() && self.refused_from_frozen_workers() == 0 {
            short.push("a worker was frozen, but the store refused none of its writes".into());
        }
        short
    }
}

/// The run's clock: nanoseconds since it began, on the system's monotonic clock (which every
/// process on the machine shares, so worker processes stamp their records on it too), or, in a
/// simulation, on the simulated clock that every simulated host shares.
#[derive(Clone, Copy)]
pub(crate) enum Clock {
    Monotonic(Instant),
    Simulated,
}

/// The system's monotonic clock (`CLOCK_MONOTONIC`, which `Instant` reads on Linux) in ns.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the timespec we pass, which lives on this stack frame.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// An `Instant` and a reading of the system's monotonic clock taken as one: of a few tries, the
/// one whose two raw readings around the `Instant` are closest, with the raw value their
/// midpoint, so a preemption between the reads cannot shift a worker process's clock.
fn paired_now() -> (Instant, u64) {
    let mut best: Option<(u64, std::time::Instant, u64)> = None;
    for _ in 0..16 {
        let before = monotonic_ns();
        let instant = std::time::Instant::now();
        let after = monotonic_ns();
        let gap = after.saturating_sub(before);
        if best.is_none_or(|(g, _, _)| gap < g) {
            best = Some((gap, instant, before + gap / 2));
        }
        if gap < 1_000 {
            break;
        }
    }
    let (_, instant, raw) = best.expect("at least one try");
    (Instant::from_std(instant), raw)
}

impl Clock {
    /// A clock that starts now, and its origin as a reading of the system's monotonic clock.
    pub(crate) fn start() -> (Clock, u64) {
        let (now, raw) = paired_now();
        (Clock::Monotonic(now), raw)
    }

    /// The clock whose origin was `epoch_ns` of the system's monotonic clock (in another process
    /// on this machine).
    pub(crate) fn from_monotonic_ns(epoch_ns: u64) -> Result<Clock, String> {
        let (now, raw) = paired_now();
        let since = raw.checked_sub(epoch_ns).map(Duration::from_nanos).ok_or_else(|| {
            format!("clock origin {epoch_ns} ns is ahead of this machine's monotonic clock ({raw} ns)")
        })?;
        now.checked_sub(since)
            .map(Clock::Monotonic)
            .ok_or_else(|| format!("clock origin {epoch_ns} ns is out of range"))
    }

    pub(crate) fn now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic(origin) => origin.elapsed().as_nanos() as u64,
            Clock::Simulated => turmoil::sim_elapsed().unwrap_or_default().as_nanos() as u64,
        }
    }

    /// Where `t`, an instant of the calling host's clock, falls on the run's clock.
    pub(crate) fn at_ns(&self, t: Instant) -> u64 {
        match self {
            Clock::Monotonic(origin) => t.saturating_duration_since(*origin).as_nanos() as u64,
            Clock::Simulated => {
                let now = Instant::now();
                let now_ns = self.now_ns();
                if t >= now {
                    now_ns + (t - now).as_nanos() as u64
                } else {
                    now_ns.saturating_sub((now - t).as_nanos() as u64)
                }
            }
        }
    }
}

/// The fenced store of the run, journaling every decision in the order it made them.
pub(crate) struct JournaledStore {
    fencing: bool,
    inner: Mutex<(crate::fence::FenceTable, Vec<StoreRecord>)>,
}

impl JournaledStore {
    pub(crate) fn new(fencing: bool) -> JournaledStore {
        JournaledStore { fencing, inner: Mutex::new(Default::default()) }
    }

    /// The check (or, switched off, none) and the journal entry, in one step.
    fn decide(&self, partition: PartitionId, token: FencingToken) -> Result<(), crate::fence::FenceError> {
        let mut inner =
            self.inner.lock().map_err(|_| crate::fence::FenceError::Backend("poisoned".into()))?;
        let (table, journal) = &mut *inner;
        let result = if self.fencing { table.admit(partition, token) } else { Ok(()) };
        let seq = journal.len() as u64;
        journal.push(StoreRecord { seq, partition, token, accepted: result.is_ok() });
        result
    }

    pub(crate) fn journal(&self) -> Vec<StoreRecord> {
        self.inner.lock().map(|i| i.1.clone()).unwrap_or_default()
    }
}

impl crate::fence::FenceStore for JournaledStore {
    async fn raise(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<(), crate::fence::FenceError> {
        self.decide(partition, token)
    }
    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        _batch: &crate::fence::FenceBatch,
    ) -> Result<(), crate::fence::FenceError> {
        self.decide(partition, token)
    }
    async fn read(&self, _: PartitionId, _: &[u8]) -> Result<Option<Vec<u8>>, crate::fence::FenceError> {
        Ok(None)
    }
    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, crate::fence::FenceError> {
        let inner = self.inner.lock().map_err(|_| crate::fence::FenceError::Backend("poisoned".into()))?;
        if self.fencing {
            inner.0.check(partition, token)?;
        }
        Ok(None)
    }
    async fn highest(
        &self,
        partition: PartitionId,
    ) -> Result<Option<FencingToken>, crate::fence::FenceError> {
        Ok(self.inner.lock().ok().and_then(|i| i.0.highest(partition)))
    }
}

/// Follows every replica's applied decisions.
struct CoordinatorRecorder {
    clock: Clock,
    records: Arc<Mutex<Vec<Committed>>>,
    /// What the recorders know they missed (a follower that fell behind the applied events):
    /// the history says so, and the checker refuses to call it complete.
    gaps: Arc<Mutex<Vec<String>>>,
    /// Where each replica's record may skip entries on purpose (see [`Resumed`]).
    resumed: Arc<Mutex<Vec<Resumed>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl CoordinatorRecorder {
    /// Follows node `id` as it applies entries, when it runs in this process.
    fn follow(&mut self, cluster: &Coordinators, id: NodeId) {
        let Coordinators::InProcess(cluster) = cluster else { return };
        let Some(node) = cluster.node(id) else { return };
        let (mut applied, from) = node.node.applied_events_after();
        let after =
            crate::recording::highest_index(&self.records.lock().expect("recorder lock poisoned"), id);
        self.resumed.lock().expect("recorder lock poisoned").push(Resumed { node: id, index: from, after });
        let (clock, records, gaps, resumed) =
            (self.clock, self.records.clone(), self.gaps.clone(), self.resumed.clone());
        self.tasks.push(tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                let entry = match applied.recv().await {
                    Ok(entry) => entry,
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(node = id, missed = n, "history recorder lagged");
                        let gap = format!("the recorder of node {id} missed {n} applied entries");
                        gaps.lock().expect("recorder lock poisoned").push(gap);
                        continue;
                    }
                    Err(RecvError::Closed) => return,
                };
                if entry.snapshot {
                    let after =
                        crate::recording::highest_index(&records.lock().expect("recorder lock poisoned"), id);
                    resumed.lock().expect("recorder lock poisoned").push(Resumed {
                        node: id,
                        index: entry.index,
                        after,
                    });
                    continue;
                }
                let at_ns = clock.now_ns();
                let mut records = records.lock().expect("recorder lock poisoned");
                records.extend(crate::recording::committed(id, entry.index, at_ns, &entry.events));
            }
        }));
    }

    fn highest_index(&self) -> u64 {
        self.records.lock().map(|r| r.iter().map(|c| c.index).max().unwrap_or(0)).unwrap_or(0)
    }
}

impl Drop for CoordinatorRecorder {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Runs the nemesis with its data under `dir`; returns the history and the checker's report.
pub async fn run(config: &NemesisConfig, dir: &Path) -> Result<Outcome, NemesisError> {
    let (clock, epoch_ns) = Clock::start();
    let mut rng = StdRng::seed_from_u64(config.seed);
    let snapshot_after_logs = 200; // so restarts also go through snapshots
    let mut cluster = match &config.serve_binary {
        None => Coordinators::InProcess(
            LocalCluster::start_behind_proxies(config.nodes, dir, |c| {
                c.partition_count = config.partition_count;
                c.lease_ttl = config.lease_ttl;
                c.election_timeout = config.election_timeout;
                c.raft_heartbeat_interval = config.election_timeout / 6;
                c.snapshot_after_logs = snapshot_after_logs;
            })
            .await?,
        ),
        Some(binary) => {
            let settings = ServeSettings {
                binary: binary.clone(),
                partition_count: config.partition_count,
                lease_ttl: config.lease_ttl,
                election_timeout: config.election_timeout,
                snapshot_after_logs,
                insecure: false,
                status_pages: false,
            };
            Coordinators::Processes(ProcessCluster::start(config.nodes, dir, settings).await?)
        }
    };
    let mut recorder = CoordinatorRecorder {
        clock,
        records: Default::default(),
        gaps: Default::default(),
        resumed: Default::default(),
        tasks: Vec::new(),
    };
    for id in cluster.ids() {
        recorder.follow(&cluster, id);
    }
    let settle = Duration::from_secs(10);
    cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;

    let store = Arc::new(JournaledStore::new(config.fencing));
    let worker_records = Arc::new(Mutex::new(Vec::new()));
    let store_service = CancellationToken::new();
    let store_addr = match &config.serve_binary {
        Some(_) => {
            let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
                .await
                .map_err(|e| NemesisError::Worker(format!("store listener: {e}")))?;
            let addr = listener.local_addr().map_err(|e| NemesisError::Worker(e.to_string()))?;
            let (store, stop) = (store.clone(), store_service.clone());
            tokio::spawn(async move {
                if let Err(e) = serve_store(store, listener, stop).await {
                    tracing::error!(error = %e, "the run's store stopped serving");
                }
            });
            Some(addr.to_string())
        }
        None => None,
    };
    let _stop_store = store_service.drop_guard();
    let mut slots = Vec::new();
    let runner_slots: Vec<String> = match config.serve_binary {
        Some(_) => (config.workers.saturating_sub(config.runners)..config.workers)
            .map(|n| format!("w{}", n + 1))
            .collect(),
        None => Vec::new(),
    };
    for n in 0..config.workers {
        let name = format!("w{}", n + 1);
        let slot = match (&config.serve_binary, &store_addr) {
            (Some(binary), Some(store_addr)) => {
                let tls_dir = match cluster.ca() {
                    Some(ca) => {
                        let principal = crate::tls::Principal::Worker(name.clone());
                        ca.write_client_files(dir, &format!("worker-{name}"), &principal)
                            .map_err(|e| NemesisError::Worker(e.to_string()))?;
                        Some(dir.to_path_buf())
                    }
                    None => None,
                };
                let runner = runner_slots.contains(&name);
                let args = WorkerProcessArgs {
                    coordinators: cluster.addrs(),
                    name,
                    store: store_addr.clone(),
                    dial_from: worker_ip(n),
                    epoch_ns,
                    write_interval: config.write_interval,
                    tls_dir,
                    runner,
                };
                Slot::Process(Box::new(
                    worker_process::ProcessSlot::start(binary, dir, &args, worker_records.clone())
                        .map_err(NemesisError::Worker)?,
                ))
            }
            _ => Slot::Local(
                LocalSlot::start(
                    {
                        let mut worker = crate::worker::WorkerConfig::new(cluster.addrs(), name.clone());
                        worker.dial_from = Some(worker_ip(n));
                        worker.tls = cluster
                            .ca()
                            .map(|ca| ca.client_tls(&crate::tls::Principal::Worker(name)))
                            .transpose()
                            .map_err(|e| NemesisError::Worker(e.to_string()))?;
                        worker
                    },
                    store.clone(),
                    worker_records.clone(),
                    clock,
                    config.write_interval,
                )
                .await
                .map_err(NemesisError::Worker)?,
            ),
        };
        slots.push(slot);
    }

    // Faults start from a settled table.
    let settled = Instant::now();
    while fully_owned(&cluster, &slots).await.is_none() && settled.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    let mut faults = Vec::new();
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut order: Vec<FaultKind> = Vec::new();
    let until = Instant::now() + config.fault_time;
    while Instant::now() < until && !config.faults.is_empty() {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1200))).await;
        if order.is_empty() {
            order = config.faults.clone();
            order.shuffle(&mut rng);
        }
        let kind = order.remove(0);
        let start_ns = clock.now_ns();
        let what = inject(kind, config, &mut rng, &mut cluster, &mut recorder, &slots).await?;
        faults.push(Fault { what, start_ns, healed_ns: clock.now_ns() });
        *counts.entry(kind.name()).or_default() += 1;
    }
    let healed = Instant::now();

    // Recovery: every partition owned by a live session, nothing being revoked, and every
    // worker believing exactly its rows.
    let bound = config.liveness_bound();
    let mut recovered_after = None;
    let mut final_table = Vec::new();
    let mut final_index = 0;
    while healed.elapsed() < bound * 2 {
        if let Some((rows, index)) = fully_owned(&cluster, &slots).await {
            recovered_after = Some(healed.elapsed());
            final_table = rows;
            final_index = index;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if recovered_after.is_none() {
        if let Some(status) = cluster.status().await {
            final_table = rows_of(&status);
            final_index = status.last_applied;
        }
    }
    // Let the recorders catch up with the entry the final table was read at.
    let catch_up = Instant::now();
    let following = matches!(cluster, Coordinators::InProcess(_));
    while following && recorder.highest_index() < final_index && catch_up.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let live_sessions: BTreeMap<String, SessionId> =
        slots.iter().filter_map(|s| s.session().map(|id| (s.name().to_string(), id))).collect();
    for slot in &slots {
        slot.send(SlotCommand::Stop).await.map_err(NemesisError::Worker)?;
    }
    for slot in slots {
        slot.join().await;
    }
    let committed = recorder.records.clone();
    let gaps = std::mem::take(&mut *recorder.gaps.lock().expect("recorder lock poisoned"));
    let resumed = std::mem::take(&mut *recorder.resumed.lock().expect("recorder lock poisoned"));
    drop(recorder); // stops following
    if let Some(processes) = cluster.shutdown().await {
        // The processes are gone; what they decided is in their logs.
        let mut records = committed.lock().expect("recorder lock poisoned");
        for id in processes.ids() {
            let replayed = crate::store::replay_applied(&processes.data_dir(id))
                .map_err(|e| NemesisError::Replay(id, e))?;
            for entry in replayed {
                records.extend(crate::recording::committed(id, entry.index, 0, &entry.events));
            }
        }
    }

    let mut history = History::new(config.partition_count, config.lease_ttl.as_millis() as u64);
    history.coordinator = committed
        .lock()
        .expect("recorder lock poisoned")
        .iter()
        .filter(|c| c.index <= final_index)
        .cloned()
        .collect();
    history.workers = std::mem::take(&mut *worker_records.lock().expect("worker records poisoned"));
    history.store = store.journal();
    history.faults = faults;
    history.gaps = gaps;
    history.resumed = resumed;
    history.final_table = final_table;
    history.live_sessions = live_sessions;
    history.recovered_after_ms = recovered_after.map(|d| d.as_millis() as u64);
    history.liveness_bound_ms = bound.as_millis() as u64;
    let report = history::check(&history);
    let (writes_accepted, writes_refused) = history.store_decisions();
    Ok(Outcome { history, report, writes_accepted, writes_refused, faults: counts, runner_slots })
}

/// The loopback address worker slot `n` dials from.
fn worker_ip(n: usize) -> IpAddr {
    IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 2, (n + 1) as u8))
}

fn rows_of(status: &crate::proto::StatusResponse) -> Vec<FinalRow> {
    status
        .partitions
        .iter()
        .map(|r| FinalRow {
            partition: PartitionId(r.partition),
            owner: (r.owner != 0).then_some(SessionId(r.owner)),
            token: FencingToken(r.token),
        })
        .collect()
}

/// The table and the index it was read at, if it is fully owned by the slots' live sessions,
/// with nothing being revoked, and each slot believes exactly its rows.
async fn fully_owned(cluster: &Coordinators, slots: &[Slot]) -> Option<(Vec<FinalRow>, u64)> {
    let status = cluster.status().await?;
    if status.leader_id == 0 || status.partitions.iter().any(|r| r.revoking || r.owner == 0) {
        return None;
    }
    for slot in slots {
        // A slot may not have heard yet that its session expired (say, across a partition):
        // it counts as recovered only once its session is one the table knows.
        let session = slot.session().filter(|s| status.sessions.iter().any(|r| r.id == s.0 && !r.leaving))?;
        let rows: BTreeMap<PartitionId, FencingToken> = status
            .partitions
            .iter()
            .filter(|r| r.owner == session.0)
            .map(|r| (PartitionId(r.partition), FencingToken(r.token)))
            .collect();
        if slot.believed() != rows {
            return None;
        }
    }
    let live: Vec<u64> = slots.iter().filter_map(|s| s.session().map(|id| id.0)).collect();
    if status.partitions.iter().any(|r| !live.contains(&r.owner)) {
        return None;
    }
    // The leader decides placement after the entries that call for it (a join is placed by the
    // entry after it): a table that is owned but not yet balanced is still moving. A leader
    // that never balances it shows as a run that never recovered.
    let counts: Vec<usize> =
        live.iter().map(|s| status.partitions.iter().filter(|r| r.owner == *s).count()).collect();
    if counts.iter().max().zip(counts.iter().min()).is_some_and(|(max, min)| max - min > 1) {
        return None;
    }
    Some((rows_of(&status), status.last_applied))
}

/// Injects one fault, waits, heals it; returns a description.
async fn inject(
    kind: FaultKind,
    config: &NemesisConfig,
    rng: &mut StdRng,
    cluster: &mut Coordinators,
    recorder: &mut CoordinatorRecorder,
    slots: &[Slot],
) -> Result<String, NemesisError> {
    let ttl = config.lease_ttl;
    let jitter = |rng: &mut StdRng, from: Duration, to: Duration| {
        from + (to.saturating_sub(from)).mul_f64(rng.random_range(0.0..1.0))
    };
    let settle = Duration::from_secs(10);
    match kind {
        FaultKind::FreezeWorker | FaultKind::CrashWorker => {
            let slot = &slots[rng.random_range(0..slots.len())];
            let (pause, command) = if kind == FaultKind::FreezeWorker {
                let pause = jitter(rng, ttl * 2, ttl * 3);
                (pause, SlotCommand::Freeze(pause))
            } else {
                let down = jitter(rng, ttl / 2, ttl * 2);
                (down, SlotCommand::Crash(down))
            };
            slot.send(command).await.map_err(NemesisError::Worker)?;
            Ok(format!("{} {} for {} ms", kind.name(), slot.name(), pause.as_millis()))
        }
        FaultKind::ReleaseOwnAccord | FaultKind::LeaveWorker | FaultKind::DropWorker => {
            let slot = &slots[rng.random_range(0..slots.len())];
            let action = match kind {
                FaultKind::ReleaseOwnAccord => Action::Release,
                FaultKind::LeaveWorker => Action::Leave,
                _ => Action::Drop,
            };
            slot.send(SlotCommand::Act(action)).await.map_err(NemesisError::Worker)?;
            Ok(format!("{} {}", kind.name(), slot.name()))
        }
        FaultKind::RestartOtherFlags => {
            // The leader, so that the cluster must hand leadership on, and the odd node may
            // lead later with a TTL flag that disagrees with the cluster's.
            let leader = cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;
            let flag = if rng.random_range(0..2) == 0 { ttl / 4 } else { ttl * 3 };
            cluster.kill(leader).await;
            let down = jitter(rng, Duration::from_millis(200), ttl);
            tokio::time::sleep(down).await;
            cluster.restart_with_ttl(leader, flag).await.map_err(|e| NemesisError::Restart(leader, e))?;
            recorder.follow(cluster, leader);
            Ok(format!("{} node {leader} with --lease-ttl-ms {}", kind.name(), flag.as_millis()))
        }
        FaultKind::UpgradeNode => {
            // Rolling: the first node still on the oldest version goes next, leader or not.
            let ids = cluster.ids();
            let oldest = ids.iter().map(|id| cluster.rules(*id)).min().unwrap_or(0);
            let id = *ids.iter().find(|id| cluster.rules(**id) == oldest).expect("a node");
            cluster.kill(id).await;
            let down = jitter(rng, Duration::from_millis(100), ttl / 2);
            tokio::time::sleep(down).await;
            cluster.restart_with_rules(id, oldest + 1).await.map_err(|e| NemesisError::Restart(id, e))?;
            recorder.follow(cluster, id);
            let versions: Vec<u64> = ids.iter().map(|id| cluster.rules(*id)).collect();
            Ok(format!("{} node {id} to placement rules {} (cluster: {versions:?})", kind.name(), oldest + 1))
        }
        FaultKind::PartitionWorker => {
            let n = rng.random_range(0..slots.len());
            let cut = jitter(rng, ttl * 3 / 2, ttl * 3);
            for id in cluster.ids() {
                cluster.proxy(id).expect("proxied").block(&[worker_ip(n)]);
            }
            tokio::time::sleep(cut).await;
            heal_all(cluster);
            Ok(format!("{} {} for {} ms", kind.name(), slots[n].name(), cut.as_millis()))
        }
        FaultKind::PauseLeader if matches!(cluster, Coordinators::Processes(_)) => {
            let leader = cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;
            let frozen = jitter(rng, config.election_timeout * 4, ttl * 2);
            cluster.freeze(leader, true);
            tokio::time::sleep(frozen).await;
            cluster.freeze(leader, false);
            Ok(format!("{} node {leader} stopped for {} ms", kind.name(), frozen.as_millis()))
        }
        FaultKind::MinorityLeader | FaultKind::IsolateLeader | FaultKind::PauseLeader => {
            let leader = cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;
            let others: Vec<IpAddr> =
                cluster.ids().into_iter().filter(|id| *id != leader).map(node_ip).collect();
            let mut cut_from_leader = others.clone();
            if kind != FaultKind::MinorityLeader {
                cut_from_leader.extend((0..slots.len()).map(worker_ip));
            }
            cluster.proxy(leader).expect("proxied").block(&cut_from_leader);
            for id in cluster.ids().into_iter().filter(|id| *id != leader) {
                cluster.proxy(id).expect("proxied").block(&[node_ip(leader)]);
            }
            let cut = jitter(rng, config.election_timeout * 4, ttl * 2);
            tokio::time::sleep(cut).await;
            heal_all(cluster);
            Ok(format!("{} node {leader} for {} ms", kind.name(), cut.as_millis()))
        }
        FaultKind::SlowNetwork => {
            // From a few milliseconds, which the cluster should ride out, to half an election
            // timeout each way, which times out every Raft append and every renewal.
            let delay = jitter(rng, Duration::from_millis(5), config.election_timeout / 2);
            let held = jitter(rng, ttl, ttl * 2);
            for id in cluster.ids() {
                cluster.proxy(id).expect("proxied").delay(delay);
            }
            tokio::time::sleep(held).await;
            heal_all(cluster);
            Ok(format!("{} {} ms each way for {} ms", kind.name(), delay.as_millis(), held.as_millis()))
        }
        FaultKind::StopLeaderGracefully => {
            let leader = cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;
            let stopped = cluster.stop_gracefully(leader).await;
            let down = jitter(rng, Duration::from_millis(200), ttl);
            tokio::time::sleep(down).await;
            cluster.restart(leader).await.map_err(|e| NemesisError::Restart(leader, e))?;
            recorder.follow(cluster, leader);
            Ok(format!("{} node {leader} ({stopped}), back after {} ms", kind.name(), down.as_millis()))
        }
        FaultKind::DrainWorker => {
            let slot = &slots[rng.random_range(0..slots.len())];
            let outcome = match cluster.drain(slot.name()).await {
                Ok(sessions) => format!("sessions {sessions:?} leaving"),
                // Between a session's end and the worker's next join there is none to drain.
                Err(e) => format!("refused: {e}"),
            };
            Ok(format!("{} {} ({outcome})", kind.name(), slot.name()))
        }
        FaultKind::Maintenance => {
            cluster.operate(Operation::Maintenance(true), settle).await.map_err(NemesisError::Operator)?;
            let held = jitter(rng, ttl / 2, ttl * 3 / 2);
            tokio::time::sleep(held).await;
            // Off again whatever happens meanwhile: the run's recovery wants a balanced table.
            cluster.operate(Operation::Maintenance(false), settle).await.map_err(NemesisError::Operator)?;
            Ok(format!("{} for {} ms", kind.name(), held.as_millis()))
        }
        FaultKind::SetWeight => {
            let slot = &slots[rng.random_range(0..slots.len())];
            let weight = rng.random_range(2..=4);
            let held = jitter(rng, ttl / 2, ttl * 3 / 2);
            // A worker between sessions (after a drain, a leave) has no weight to set: refused.
            let outcome = match cluster.operate(Operation::Weight(slot.name().into(), weight), ttl * 2).await
            {
                Ok(()) => {
                    tokio::time::sleep(held).await;
                    // The weight outlives sessions, so it must go back to 1 for the run's
                    // balanced recovery; the worker may be rejoining: keep trying.
                    cluster
                        .operate(Operation::Weight(slot.name().into(), 1), settle)
                        .await
                        .map_err(NemesisError::Operator)?;
                    format!("weight {weight} for {} ms", held.as_millis())
                }
                Err(e) => format!("refused: {e}"),
            };
            Ok(format!("{} {} ({outcome})", kind.name(), slot.name()))
        }
        FaultKind::SetLeaseTtl => {
            let ms = |d: Duration| d.as_millis() as u64;
            let short = jitter(rng, ttl / 3, ttl / 2).max(Duration::from_millis(100));
            cluster.operate(Operation::LeaseTtl(ms(short)), settle).await.map_err(NemesisError::Operator)?;
            let held = jitter(rng, ttl / 2, ttl * 3 / 2);
            let kill = rng.random_bool(0.5);
            let mut what = format!("{} {} ms for {} ms", kind.name(), ms(short), ms(held));
            if kill {
                // Workers that renewed just before the change were told the longer TTL: the
                // new leader must wait that out, not the shorter one.
                let leader = cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;
                cluster.kill(leader).await;
                tokio::time::sleep(held).await;
                cluster.restart(leader).await.map_err(|e| NemesisError::Restart(leader, e))?;
                recorder.follow(cluster, leader);
                what += &format!(", leader {leader} killed meanwhile");
            } else {
                tokio::time::sleep(held).await;
            }
            // Back again whatever happens meanwhile: the run's recovery bound assumes the TTL.
            cluster.operate(Operation::LeaseTtl(ms(ttl)), settle).await.map_err(NemesisError::Operator)?;
            Ok(what)
        }
        FaultKind::KillLeader | FaultKind::KillFollower | FaultKind::KillAll => {
            let leader = cluster.wait_for_leader(settle).await.ok_or(NemesisError::NoLeader(settle))?;
            let victims: Vec<NodeId> = match kind {
                FaultKind::KillLeader => vec![leader],
                FaultKind::KillFollower => {
                    let followers: Vec<NodeId> =
                        cluster.ids().into_iter().filter(|id| *id != leader).collect();
                    vec![followers[rng.random_range(0..followers.len())]]
                }
                _ => cluster.ids(),
            };
            for id in &victims {
                cluster.kill(*id).await;
            }
            let down = jitter(rng, Duration::from_millis(200), ttl * 3 / 2);
            tokio::time::sleep(down).await;
            for id in &victims {
                cluster.restart(*id).await.map_err(|e| NemesisError::Restart(*id, e))?;
                recorder.follow(cluster, *id);
            }
            Ok(format!("{} {:?} down for {} ms", kind.name(), victims, down.as_millis()))
        }
    }
}

fn heal_all(cluster: &Coordinators) {
    for id in cluster.ids() {
        if let Some(proxy) = cluster.proxy(id) {
            proxy.heal();
        }
    }
}
