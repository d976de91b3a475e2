//! The whole stack under a deterministic simulation: real openraft, tonic, RocksDB and worker
//! library, on turmoil's simulated network and clock, with faults drawn from a seed.
//!
//! [`crate::simulation`] checks the ownership logic inside a model of Raft, fast enough for
//! thousands of seeds a second. This module runs the code that ships instead: each coordinator
//! is a simulated host running [`server::start_on`] over simulated TCP, with its RocksDB on
//! disk; each worker is a host running the worker library and writing to the run's fenced store.
//! Only the network and the clock are simulated. Every host runs on one thread, time moves only
//! when the simulation steps it, and the network, the schedule of faults, openraft's election
//! timeouts (fixed per node) and the library's retry jitter all come from the seed, so a run is a
//! function of its seed: a failing seed is printed and replays the same history.
//!
//! Faults (one at a time, healed before the next):
//! - `freeze-worker`: a worker is held between checking its leases and writing, longer than a
//!   TTL, with its links to the coordinators held too; its writes then arrive late.
//! - `crash-worker`: a worker host crashes and restarts as a new session.
//! - `partition-worker`: a worker's links to the coordinators are held (TCP under a partition:
//!   nothing arrives until it heals); it still reaches storage.
//! - `minority-leader`, `isolate-leader`: the leader's links to the other nodes (and, isolated,
//!   to the workers) are held. Isolation is also what peers and workers see of a frozen leader;
//!   a simulated host cannot be frozen with its timers, so there is no separate pause fault.
//! - `kill-leader`, `kill-follower`, `kill-all`: node hosts crash (their runtime and every task
//!   are dropped; RocksDB keeps what was synced) and restart on the same data.
//! - `lossy-links`: every link between nodes drops what is sent on it for a while, which breaks
//!   connections mid-stream; they must be noticed and opened again.
//! - `slow-network`: every message takes up to half an election timeout.
//! - `set-lease-ttl`: an operator (a host of its own, through the operator API as `tenure ctl`
//!   calls it) cuts the cluster's lease TTL to a fraction of it, half the time kills the leader
//!   while the shorter TTL holds, then sets it back. Workers that renewed just before the cut
//!   were told the longer TTL; no leader may expire them by the shorter one.
//!
//! Afterwards the run waits for the table to be fully owned again and checks the history with
//! the same [checker](crate::history::check) as the nemesis.
//!
//! One seed, one process: tokio numbers its tasks with a counter shared by the whole process,
//! and a crashed host's tasks are dropped in an order that follows those numbers (dropping a
//! connection sends on the simulated network). A second run in the same process therefore
//! starts from other numbers and can part from the first at its first crash. `tenure
//! simulate-stack` runs every seed in a fresh process of its own, which is also what a replay
//! is. Tokio's own choices (which ready branch of a `select!` goes first) are seeded through
//! turmoil, which needs the `tokio_unstable` cfg the project's `.cargo/config.toml` sets.

mod net;

use crate::history::{self, Committed, Fault, FinalRow, History, Report, Resumed, WorkerRecord};
use crate::ids::{FencingToken, NodeId, PartitionId, SessionId};
use crate::nemesis::workload::{Action, LocalSink, SlotTask, Stall, View};
use crate::nemesis::{Clock, JournaledStore};
use crate::ownership::Namespace;
use crate::raft::Member;
use crate::server::{self, NodeConfig};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The port every simulated node serves on.
const PORT: u16 = 7000;
/// The port every simulated node serves its peers on.
const PEER_PORT: u16 = 7100;

/// One kind of fault of the simulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimFault {
    FreezeWorker,
    CrashWorker,
    PartitionWorker,
    MinorityLeader,
    IsolateLeader,
    KillLeader,
    KillFollower,
    KillAll,
    LossyLinks,
    SlowNetwork,
    /// A node (the leader) restarted with another lease TTL than the cluster was created with.
    RestartOtherFlags,
    /// One step of a rolling upgrade: the first node on the oldest version of the placement
    /// rules crashes and comes back running the next version.
    UpgradeNode,
    /// What applications do of their own accord: release a partition never revoked, leave
    /// gracefully, drop the `Worker`, each followed by a join under the same name.
    ReleaseOwnAccord,
    LeaveWorker,
    DropWorker,
    /// An operator's change of the lease TTL at run time, set back afterwards.
    SetLeaseTtl,
}

impl SimFault {
    pub const ALL: [SimFault; 16] = [
        SimFault::FreezeWorker,
        SimFault::CrashWorker,
        SimFault::PartitionWorker,
        SimFault::MinorityLeader,
        SimFault::IsolateLeader,
        SimFault::KillLeader,
        SimFault::KillFollower,
        SimFault::KillAll,
        SimFault::LossyLinks,
        SimFault::SlowNetwork,
        SimFault::RestartOtherFlags,
        SimFault::UpgradeNode,
        SimFault::ReleaseOwnAccord,
        SimFault::LeaveWorker,
        SimFault::DropWorker,
        SimFault::SetLeaseTtl,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SimFault::FreezeWorker => "freeze-worker",
            SimFault::CrashWorker => "crash-worker",
            SimFault::PartitionWorker => "partition-worker",
            SimFault::MinorityLeader => "minority-leader",
            SimFault::IsolateLeader => "isolate-leader",
            SimFault::KillLeader => "kill-leader",
            SimFault::KillFollower => "kill-follower",
            SimFault::KillAll => "kill-all",
            SimFault::LossyLinks => "lossy-links",
            SimFault::SlowNetwork => "slow-network",
            SimFault::RestartOtherFlags => "restart-other-flags",
            SimFault::UpgradeNode => "upgrade-node",
            SimFault::ReleaseOwnAccord => "release-own-accord",
            SimFault::LeaveWorker => "leave-worker",
            SimFault::DropWorker => "drop-worker",
            SimFault::SetLeaseTtl => "set-lease-ttl",
        }
    }
}

/// What one simulated run does. Times are simulated time.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    pub nodes: usize,
    pub workers: usize,
    pub partition_count: u32,
    pub lease_ttl: Duration,
    /// The shortest election timeout; node `i` (from 1) waits this plus `i - 1` times a fifth
    /// of it, so elections are decided by the seed's network, not by a hidden random draw.
    pub election_timeout: Duration,
    /// How long faults are injected.
    pub fault_time: Duration,
    /// Time between a worker's lease check and its writes.
    pub write_interval: Duration,
    /// Whether the store checks tokens (off only to show that the checker catches it).
    pub fencing: bool,
    pub faults: Vec<SimFault>,
    /// The cluster's revoke budget: odd seeds have one of 1 or 2 partitions, so moves come in
    /// waves through every fault, leader changes among them.
    pub max_revoking: Option<u32>,
    /// The namespace the workload runs in. One seed in three runs it in a namespace of its own
    /// (`sim-job`, which the operator creates with the settings above once a leader is up),
    /// beside an idle default namespace: every fault then acts on a table that is not the one
    /// the leader configures itself. `None`: the default namespace.
    pub namespace: Option<String>,
}

impl SimConfig {
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            nodes: 3,
            workers: 3,
            partition_count: 8,
            lease_ttl: Duration::from_millis(1000),
            election_timeout: Duration::from_millis(300),
            fault_time: Duration::from_secs(15),
            write_interval: Duration::from_millis(50),
            fencing: true,
            faults: SimFault::ALL.to_vec(),
            max_revoking: (seed % 2 == 1).then_some(1 + (seed / 2 % 2) as u32),
            namespace: (seed % 3 == 1).then(|| "sim-job".to_string()),
        }
    }

    /// Owned again within this long after the last fault heals: as the nemesis's bound.
    pub fn liveness_bound(&self) -> Duration {
        self.lease_ttl * 2 + self.election_timeout * 4 + Duration::from_secs(1)
    }
}

/// Why a run could not be carried out (a violation is in the report, not here).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("simulation: {0}")]
    Turmoil(String),
    #[error("the table was never fully owned before the faults began")]
    NeverSettled,
    #[error("{0}")]
    Setup(String),
}

/// What a run recorded and what the checker said of it.
#[derive(Debug)]
pub struct SimOutcome {
    pub history: History,
    pub report: Report,
    /// The faults injected, in order, described.
    pub faults: Vec<String>,
    /// Simulated time the run took.
    pub simulated: Duration,
    pub writes_accepted: usize,
    pub writes_refused: usize,
}

impl SimOutcome {
    /// A fingerprint of everything recorded, to compare two runs of one seed.
    pub fn fingerprint(&self) -> u64 {
        let json = serde_json::to_vec(&self.history).expect("a history serializes");
        xxhash_rust::xxh64::xxh64(&json, 0)
    }

    /// What a sweep keeps of the run of `seed`.
    pub fn summary(&self, seed: u64) -> SimSummary {
        SimSummary {
            seed,
            passed: self.report.passed(),
            failed: self.report.failed().iter().map(|s| s.to_string()).collect(),
            report: self.report.to_string(),
            faults: self.faults.clone(),
            worker_operations: self.history.workers.len(),
            committed_decisions: self.history.coordinator.len(),
            writes_accepted: self.writes_accepted,
            writes_refused: self.writes_refused,
            recovered_after_ms: self.history.recovered_after_ms,
            simulated_ms: self.simulated.as_millis() as u64,
            fingerprint: format!("{:016x}", self.fingerprint()),
        }
    }
}

/// One run, as a line of a sweep's output: enough to judge it, and a fingerprint of its whole
/// history to compare with a replay.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SimSummary {
    pub seed: u64,
    pub passed: bool,
    pub failed: Vec<String>,
    pub report: String,
    pub faults: Vec<String>,
    pub worker_operations: usize,
    pub committed_decisions: usize,
    pub writes_accepted: usize,
    pub writes_refused: usize,
    pub recovered_after_ms: Option<u64>,
    pub simulated_ms: u64,
    pub fingerprint: String,
}

/// What a node last published about itself, read by the driver between steps.
#[derive(Clone, Debug, Default)]
struct Published {
    leader: bool,
    term: u64,
    last_applied: u64,
    rows: Vec<FinalRow>,
    revoking: bool,
    /// Live sessions that are not leaving.
    sessions: Vec<SessionId>,
}

/// Everything the hosts and the driver share. The simulation runs on one thread, so plain
/// mutexes are never contended.
#[derive(Clone, Default)]
struct Shared {
    published: Arc<Mutex<BTreeMap<NodeId, Published>>>,
    committed: Arc<Mutex<Vec<Committed>>>,
    /// Where each replica's record may skip entries on purpose (a snapshot, a restart).
    resumed: Arc<Mutex<Vec<Resumed>>>,
    /// What the recorders know they missed.
    gaps: Arc<Mutex<Vec<String>>>,
    /// The lease TTL a node is started with when it is not the cluster's (other flags).
    flags: Arc<Mutex<BTreeMap<NodeId, Duration>>>,
    /// The version of the placement rules (ring seed) of nodes upgraded since the start.
    rules: Arc<Mutex<BTreeMap<NodeId, u64>>>,
    /// How the driver asks each worker's current incarnation to act of its own accord.
    actions: Arc<Mutex<BTreeMap<usize, tokio::sync::mpsc::Sender<Action>>>>,
    /// How the driver asks the operator host for a lease TTL (in ms).
    operator: Arc<Mutex<Option<tokio::sync::mpsc::Sender<u64>>>>,
    /// What came of each of the operator's requests, in order: the TTL it replaced, or why not.
    operated: Arc<Mutex<Vec<Result<u64, String>>>>,
    worker_records: Arc<Mutex<Vec<WorkerRecord>>>,
}

fn node_name(id: NodeId) -> String {
    format!("n{id}")
}

fn worker_name(n: usize) -> String {
    format!("w{}", n + 1)
}

/// Runs one seed with every node's data under `dir`.
pub fn run(config: &SimConfig, dir: &Path) -> Result<SimOutcome, SimError> {
    // The worker library's retry jitter draws from this thread's generator.
    fastrand::seed(config.seed);
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut sim = turmoil::Builder::new()
        .rng_seed(config.seed)
        .simulation_duration(Duration::from_secs(3600))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(3))
        .build();
    let shared = Shared::default();
    let ids: Vec<NodeId> = (1..=config.nodes as NodeId).collect();
    let peers: BTreeMap<NodeId, Member> = ids
        .iter()
        .map(|id| {
            let (peer_addr, client_addr) =
                (format!("{}:{PEER_PORT}", node_name(*id)), format!("{}:{PORT}", node_name(*id)));
            (*id, Member { peer_addr, client_addr })
        })
        .collect();
    let ca = crate::certs::DevCa::new("tenure simulation CA").map_err(|e| SimError::Setup(e.to_string()))?;
    for id in &ids {
        // Peers speak mutual TLS here as in production; the handshake's randomness changes
        // bytes on the wire, never their sizes or order, so a seed still replays.
        let tls = ca.node_tls(*id, &[node_name(*id)]).map_err(|e| SimError::Setup(e.to_string()))?;
        add_node(&mut sim, config, *id, &peers, tls, dir.join(node_name(*id)), &shared);
    }
    let store = Arc::new(JournaledStore::new(config.fencing));
    let pauses: Vec<Arc<Mutex<Option<Duration>>>> = (0..config.workers).map(|_| Arc::default()).collect();
    let views: Vec<Arc<Mutex<View>>> = (0..config.workers).map(|_| Arc::default()).collect();
    for n in 0..config.workers {
        // Workers, too, prove their name with a certificate of the cluster's CA.
        let tls = ca
            .client_tls(&crate::tls::Principal::Worker(worker_name(n)))
            .map_err(|e| SimError::Setup(e.to_string()))?;
        add_worker(&mut sim, config, n, &peers, &store, &pauses[n], &views[n], &shared, tls);
    }
    let operator_tls = ca
        .client_tls(&crate::tls::Principal::Operator(OPERATOR.into()))
        .map_err(|e| SimError::Setup(e.to_string()))?;
    add_operator(&mut sim, config, &peers, &shared, operator_tls);
    let mut driver = Driver { sim, config, shared, views, pauses, ids };

    // Faults start from a settled table.
    let settle_by = driver.now() + Duration::from_secs(20);
    if !driver.step_until(settle_by, |d| d.fully_owned().is_some())? {
        return Err(SimError::NeverSettled);
    }

    let mut faults = Vec::new();
    let mut described = Vec::new();
    let mut order: Vec<SimFault> = Vec::new();
    let faults_until = driver.now() + config.fault_time;
    while driver.now() < faults_until && !config.faults.is_empty() {
        let quiet = Duration::from_millis(rng.random_range(300..1200));
        driver.advance(quiet)?;
        if order.is_empty() {
            order = config.faults.clone();
            order.shuffle(&mut rng);
        }
        let kind = order.remove(0);
        let start_ns = driver.now_ns();
        let what = driver.inject(kind, &mut rng)?;
        faults.push(Fault { what: what.clone(), start_ns, healed_ns: driver.now_ns() });
        described.push(what);
    }

    let healed = driver.now();
    let bound = config.liveness_bound();
    let mut recovered_after = None;
    let mut final_table = Vec::new();
    let mut final_index = 0;
    let recovered = driver.step_until(healed + bound * 2, |d| d.fully_owned().is_some())?;
    if recovered {
        recovered_after = Some(driver.now() - healed);
        (final_table, final_index) = driver.fully_owned().expect("just seen");
    } else if let Some(leader) = driver.leader() {
        final_table = leader.rows;
        final_index = leader.last_applied;
    }
    // Let every replica apply up to the index the table was read at, so the record is whole.
    let catch_up = driver.now() + Duration::from_secs(5);
    driver.step_until(catch_up, |d| {
        let published = d.shared.published.lock().expect("published");
        published.values().all(|p| p.last_applied >= final_index)
    })?;
    let live_sessions: BTreeMap<String, SessionId> =
        (0..config.workers).filter_map(|n| driver.view(n).session.map(|s| (worker_name(n), s))).collect();
    let simulated = driver.now();
    let Driver { sim, shared, .. } = driver;
    drop(sim); // every host's runtime, and with it every node and worker, stops here

    let mut history = History::new(config.partition_count, config.lease_ttl.as_millis() as u64);
    let mut committed = std::mem::take(&mut *shared.committed.lock().expect("committed"));
    committed.retain(|c| c.index <= final_index);
    history.coordinator = committed;
    history.resumed = std::mem::take(&mut *shared.resumed.lock().expect("resumed"));
    history.gaps = std::mem::take(&mut *shared.gaps.lock().expect("gaps"));
    history.workers = std::mem::take(&mut *shared.worker_records.lock().expect("worker records"));
    history.store = store.journal();
    history.faults = faults;
    history.final_table = final_table;
    history.live_sessions = live_sessions;
    history.recovered_after_ms = recovered_after.map(|d| d.as_millis() as u64);
    history.liveness_bound_ms = bound.as_millis() as u64;
    let report = history::check(&history);
    let (writes_accepted, writes_refused) = history.store_decisions();
    Ok(SimOutcome { history, report, faults: described, simulated, writes_accepted, writes_refused })
}

fn add_node(
    sim: &mut turmoil::Sim<'_>,
    config: &SimConfig,
    id: NodeId,
    peers: &BTreeMap<NodeId, Member>,
    tls: crate::tls::NodeTls,
    data_dir: PathBuf,
    shared: &Shared,
) {
    let namespace = workload_namespace(config);
    let mut node_config = NodeConfig::new(id, peers.clone(), data_dir);
    node_config.tls = Some(tls);
    node_config.partition_count = config.partition_count;
    node_config.lease_ttl = config.lease_ttl;
    node_config.max_revoking = config.max_revoking;
    node_config.election_timeout = config.election_timeout + config.election_timeout / 5 * (id as u32 - 1);
    node_config.fixed_election_timeout = true;
    node_config.raft_heartbeat_interval = config.election_timeout / 6;
    node_config.snapshot_after_logs = 100; // so restarts also go through snapshots
    node_config.dialer = net::dialer();
    let shared = shared.clone();
    sim.host(node_name(id), move || {
        let (mut node_config, shared, namespace) = (node_config.clone(), shared.clone(), namespace.clone());
        if let Some(ttl) = shared.flags.lock().expect("flags").get(&id) {
            node_config.lease_ttl = *ttl;
        }
        if let Some(seed) = shared.rules.lock().expect("rules").get(&id) {
            node_config.placement.ring_seed = *seed;
        }
        async move {
            let any = std::net::Ipv4Addr::UNSPECIFIED;
            let listen = |port| async move {
                let listener = turmoil::net::TcpListener::bind((any, port)).await?;
                let addr = listener.local_addr()?;
                Ok::<_, std::io::Error>(server::Incoming { addr, connections: net::incoming(listener) })
            };
            let node = server::start_on(node_config, listen(PEER_PORT).await?, listen(PORT).await?).await?;
            let (mut applied, from) = node.node.applied_events_after();
            let after = crate::recording::highest_index(&shared.committed.lock().expect("committed"), id);
            shared.resumed.lock().expect("resumed").push(Resumed { node: id, index: from, after });
            let clock = Clock::Simulated;
            let mut publish = tokio::time::interval(Duration::from_millis(10));
            loop {
                tokio::select! {
                    biased;
                    entry = applied.recv() => {
                        let entry = match entry {
                            Ok(entry) => entry,
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                                let gap = format!("the recorder of node {id} missed {n} applied entries");
                                shared.gaps.lock().expect("gaps").push(gap);
                                continue;
                            }
                            Err(_) => continue,
                        };
                        // Only the workload's namespace is recorded: another's partitions are
                        // other partitions under the same numbers.
                        if entry.namespace != namespace && !entry.snapshot {
                            continue;
                        }
                        if entry.snapshot {
                            let after = crate::recording::highest_index(&shared.committed.lock().expect("committed"), id);
                            shared.resumed.lock().expect("resumed").push(Resumed { node: id, index: entry.index, after });
                            continue;
                        }
                        let at_ns = clock.now_ns();
                        let mut committed = shared.committed.lock().expect("committed");
                        committed.extend(crate::recording::committed(id, entry.index, at_ns, &entry.events));
                    }
                    _ = publish.tick() => {
                        let published = publish_state(&node, &namespace);
                        shared.published.lock().expect("published").insert(id, published);
                    }
                }
            }
        }
    });
}

/// The namespace a run's workload is in.
fn workload_namespace(config: &SimConfig) -> Namespace {
    match &config.namespace {
        Some(name) => Namespace::new(name).expect("a valid namespace name"),
        None => Namespace::default_namespace(),
    }
}

fn publish_state(node: &server::RunningNode, namespace: &Namespace) -> Published {
    let metrics = node.raft().metrics().borrow().clone();
    let applied = node.node.state.read().expect("state lock poisoned");
    // Before the workload's namespace exists: an empty table with no session, never settled.
    let empty = tenure_coordinator::ownership::OwnershipState::default();
    let table = applied.table(namespace).unwrap_or(&empty);
    let rows = crate::recording::final_table(table);
    Published {
        leader: metrics.current_leader == Some(node.node.config.id)
            && metrics.state == openraft::ServerState::Leader,
        term: metrics.current_term,
        last_applied: applied.last_applied.map(|l| l.index).unwrap_or(0),
        rows,
        // Still moving: something is revoking, or the leader has a placement still to decide.
        revoking: table.partitions().iter().any(|r| r.revoking)
            || tenure_coordinator::planner::plan(table, &node.node.config.placement).is_some(),
        sessions: table.sessions().iter().filter(|(_, s)| !s.leaving).map(|(id, _)| *id).collect(),
    }
}

#[allow(clippy::too_many_arguments)]
fn add_worker(
    sim: &mut turmoil::Sim<'_>,
    config: &SimConfig,
    n: usize,
    peers: &BTreeMap<NodeId, Member>,
    store: &Arc<JournaledStore>,
    pause: &Arc<Mutex<Option<Duration>>>,
    view: &Arc<Mutex<View>>,
    shared: &Shared,
    tls: crate::worker::ClientTls,
) {
    let name = worker_name(n);
    let coordinators: Vec<String> = peers.values().map(|m| m.client_addr.clone()).collect();
    let nodes: Vec<String> = peers.keys().map(|id| node_name(*id)).collect();
    let (store, pause, view, records, actions) =
        (store.clone(), pause.clone(), view.clone(), shared.worker_records.clone(), shared.actions.clone());
    let interval = config.write_interval;
    let namespace = config.namespace.clone().unwrap_or_default();
    sim.host(name.clone(), move || {
        let namespace = namespace.clone();
        let tls = tls.clone();
        let (name, coordinators, store, view, records, actions) = (
            name.clone(),
            coordinators.clone(),
            store.clone(),
            view.clone(),
            records.clone(),
            actions.clone(),
        );
        let stall = stall(name.clone(), nodes.clone(), pause.clone());
        async move {
            // A new start forgets everything the last incarnation believed.
            *view.lock().expect("view") = View::default();
            let sink = Arc::new(LocalSink { view, records });
            let ip = std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            actions.lock().expect("actions").insert(n, tx);
            let mut config = crate::worker::WorkerConfig::new(coordinators, name);
            config.namespace = namespace.clone();
            config.dial_from = Some(ip);
            config.tls = Some(tls);
            let mut task = SlotTask::new(config, store, sink, Clock::Simulated, interval)
                .simulated(net::dialer(), stall)
                .acting_on(rx);
            task.rejoin().await?;
            task.run_checking_before_work().await?;
            Ok(())
        }
    });
}

/// The name of the operator's host, and of its certificate.
const OPERATOR: &str = "op";

/// The operator: a host that makes the driver's lease TTL changes through the operator API,
/// trying again across leader changes for a bounded time, and reports what came of each.
fn add_operator(
    sim: &mut turmoil::Sim<'_>,
    config: &SimConfig,
    peers: &BTreeMap<NodeId, Member>,
    shared: &Shared,
    tls: crate::worker::ClientTls,
) {
    let coordinators: Vec<String> = peers.values().map(|m| m.client_addr.clone()).collect();
    let (requests, operated) = (shared.operator.clone(), shared.operated.clone());
    let create = config.namespace.clone().map(|name| crate::proto::CreateNamespaceRequest {
        name,
        partition_count: config.partition_count,
        lease_ttl_ms: config.lease_ttl.as_millis() as u64,
        max_revoking: config.max_revoking,
    });
    let namespace = config.namespace.clone().unwrap_or_default();
    sim.host(OPERATOR, move || {
        let (coordinators, requests, operated, tls, create, namespace) = (
            coordinators.clone(),
            requests.clone(),
            operated.clone(),
            tls.clone(),
            create.clone(),
            namespace.clone(),
        );
        async move {
            let ip = std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);
            let client = crate::worker::Client::new(coordinators)?
                .dialing_from(Some(ip))
                .dialing_with(net::dialer())
                .with_tls(Some(tls));
            if let Some(create) = create {
                create_namespace(&client, create).await?;
            }
            let (tx, mut rx) = tokio::sync::mpsc::channel(1);
            *requests.lock().expect("operator") = Some(tx);
            while let Some(lease_ttl_ms) = rx.recv().await {
                let outcome = set_lease_ttl(&client, &namespace, lease_ttl_ms).await;
                operated.lock().expect("operated").push(outcome);
            }
            Ok(())
        }
    });
}

/// One operator call, tried again every 100 ms (a node down, an election) for up to `bound`.
async fn operate<R, T, F, Fut>(
    client: &crate::worker::Client,
    bound: Duration,
    request: R,
    call: F,
) -> Result<T, String>
where
    R: Clone,
    F: Fn(crate::proto::operator_client::OperatorClient<tonic::transport::Channel>, R) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    use crate::proto::operator_client::OperatorClient;
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let made = client.call_on(|channel| call(OperatorClient::new(channel), request.clone())).await;
        match made {
            Ok(reply) => return Ok(reply),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.to_string()),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The workload's namespace, created before any fault, for up to twenty seconds (a restarted
/// operator host finds it made, which changes nothing).
async fn create_namespace(
    client: &crate::worker::Client,
    request: crate::proto::CreateNamespaceRequest,
) -> Result<(), Box<dyn std::error::Error>> {
    operate(client, Duration::from_secs(20), request, |mut c, r| async move { c.create_namespace(r).await })
        .await
        .map(drop)
        .map_err(|e| format!("could not create the workload's namespace: {e}").into())
}

/// One `SetLeaseTtl`, for up to ten seconds.
async fn set_lease_ttl(
    client: &crate::worker::Client,
    namespace: &str,
    lease_ttl_ms: u64,
) -> Result<u64, String> {
    let request = crate::proto::SetLeaseTtlRequest { lease_ttl_ms, namespace: namespace.to_string() };
    let set =
        operate(client, Duration::from_secs(10), request, |mut c, r| async move { c.set_lease_ttl(r).await });
    set.await.map(|reply| reply.was_ms)
}

/// The freeze of a worker: when one is asked for, hold the worker between its check and its
/// writes, with its links to the coordinators held for as long.
fn stall(me: String, nodes: Vec<String>, pause: Arc<Mutex<Option<Duration>>>) -> Stall {
    Arc::new(move || {
        let requested = pause.lock().expect("pause").take();
        let (me, nodes) = (me.clone(), nodes.clone());
        Box::pin(async move {
            let Some(pause) = requested else { return };
            for n in &nodes {
                turmoil::hold(me.as_str(), n.as_str());
            }
            tokio::time::sleep(pause).await;
            for n in &nodes {
                turmoil::release(me.as_str(), n.as_str());
            }
        })
    })
}

struct Driver<'a> {
    sim: turmoil::Sim<'a>,
    config: &'a SimConfig,
    shared: Shared,
    views: Vec<Arc<Mutex<View>>>,
    pauses: Vec<Arc<Mutex<Option<Duration>>>>,
    ids: Vec<NodeId>,
}

impl Driver<'_> {
    fn now(&self) -> Duration {
        self.sim.elapsed()
    }

    fn now_ns(&self) -> u64 {
        self.now().as_nanos() as u64
    }

    fn step(&mut self) -> Result<(), SimError> {
        self.sim.step().map(|_| ()).map_err(|e| SimError::Turmoil(e.to_string()))
    }

    fn advance(&mut self, by: Duration) -> Result<(), SimError> {
        let until = self.now() + by;
        while self.now() < until {
            self.step()?;
        }
        Ok(())
    }

    /// Steps until `done` holds (true) or `until` passes (false).
    fn step_until(&mut self, until: Duration, done: impl Fn(&Self) -> bool) -> Result<bool, SimError> {
        loop {
            if done(self) {
                return Ok(true);
            }
            if self.now() >= until {
                return Ok(false);
            }
            self.step()?;
        }
    }

    fn view(&self, n: usize) -> View {
        self.views[n].lock().expect("view").clone()
    }

    /// The leader of the highest term, as the nodes last published.
    fn leader(&self) -> Option<Published> {
        let published = self.shared.published.lock().expect("published");
        published.values().filter(|p| p.leader).max_by_key(|p| p.term).cloned()
    }

    fn leader_id(&self) -> Option<NodeId> {
        let published = self.shared.published.lock().expect("published");
        published.iter().filter(|(_, p)| p.leader).max_by_key(|(_, p)| p.term).map(|(id, _)| *id)
    }

    /// The leader's table and index, if every partition is owned by a worker's live session,
    /// nothing is being revoked and every worker believes exactly its rows.
    fn fully_owned(&self) -> Option<(Vec<FinalRow>, u64)> {
        let leader = self.leader()?;
        if leader.revoking || leader.rows.iter().any(|r| r.owner.is_none()) {
            return None;
        }
        let mut live = Vec::new();
        for n in 0..self.config.workers {
            let view = self.view(n);
            let session = view.session.filter(|s| leader.sessions.contains(s))?;
            let rows: BTreeMap<PartitionId, FencingToken> = leader
                .rows
                .iter()
                .filter(|r| r.owner == Some(session))
                .map(|r| (r.partition, r.token))
                .collect();
            if view.believed != rows {
                return None;
            }
            live.push(session);
        }
        if leader.rows.iter().any(|r| !r.owner.is_some_and(|o| live.contains(&o))) {
            return None;
        }
        Some((leader.rows, leader.last_applied))
    }

    /// A leader, waiting for one if there is none right now.
    fn await_leader(&mut self) -> Result<NodeId, SimError> {
        let until = self.now() + Duration::from_secs(10);
        self.step_until(until, |d| d.leader_id().is_some())?;
        Ok(self.leader_id().unwrap_or(self.ids[0]))
    }

    /// Has the operator set the lease TTL to `to`; says what came of it.
    fn set_lease_ttl(&mut self, to: Duration) -> Result<String, SimError> {
        let before = self.shared.operated.lock().expect("operated").len();
        let sender = self.shared.operator.lock().expect("operator").clone();
        if sender.is_none_or(|s| s.try_send(to.as_millis() as u64).is_err()) {
            return Ok("not delivered".into());
        }
        let until = self.now() + Duration::from_secs(15);
        self.step_until(until, |d| d.shared.operated.lock().expect("operated").len() > before)?;
        Ok(match self.shared.operated.lock().expect("operated").get(before) {
            Some(Ok(was_ms)) => format!("made, was {was_ms} ms"),
            Some(Err(e)) => format!("refused: {e}"),
            None => "no answer".into(),
        })
    }

    fn crash_node(&mut self, id: NodeId) {
        self.sim.crash(node_name(id));
        self.shared.published.lock().expect("published").remove(&id);
    }

    /// Injects one fault, lets it last, heals it; returns a description.
    fn inject(&mut self, kind: SimFault, rng: &mut StdRng) -> Result<String, SimError> {
        let ttl = self.config.lease_ttl;
        let election = self.config.election_timeout;
        let jitter = |rng: &mut StdRng, from: Duration, to: Duration| {
            from + (to.saturating_sub(from)).mul_f64(rng.random_range(0.0..1.0))
        };
        let nodes: Vec<String> = self.ids.iter().map(|id| node_name(*id)).collect();
        let workers: Vec<String> = (0..self.config.workers).map(worker_name).collect();
        let name = kind.name();
        match kind {
            SimFault::FreezeWorker => {
                let n = rng.random_range(0..self.config.workers);
                let pause = jitter(rng, ttl * 2, ttl * 3);
                *self.pauses[n].lock().expect("pause") = Some(pause);
                // The worker takes the pause at its next write; give it that long and a little.
                self.advance(pause + self.config.write_interval * 2)?;
                Ok(format!("{name} {} for {} ms", workers[n], pause.as_millis()))
            }
            SimFault::CrashWorker => {
                let n = rng.random_range(0..self.config.workers);
                let down = jitter(rng, ttl / 2, ttl * 2);
                self.sim.crash(workers[n].as_str());
                *self.views[n].lock().expect("view") = View::default();
                self.advance(down)?;
                self.sim.bounce(workers[n].as_str());
                Ok(format!("{name} {} down for {} ms", workers[n], down.as_millis()))
            }
            SimFault::PartitionWorker => {
                let n = rng.random_range(0..self.config.workers);
                let cut = jitter(rng, ttl * 3 / 2, ttl * 3);
                for node in &nodes {
                    self.sim.hold(workers[n].as_str(), node.as_str());
                }
                self.advance(cut)?;
                for node in &nodes {
                    self.sim.release(workers[n].as_str(), node.as_str());
                }
                Ok(format!("{name} {} for {} ms", workers[n], cut.as_millis()))
            }
            SimFault::MinorityLeader | SimFault::IsolateLeader => {
                let leader = node_name(self.await_leader()?);
                let mut cut: Vec<&String> = nodes.iter().filter(|n| **n != leader).collect();
                if kind != SimFault::MinorityLeader {
                    cut.extend(workers.iter());
                }
                let lasts = jitter(rng, election * 4, ttl * 2);
                for other in &cut {
                    self.sim.hold(leader.as_str(), other.as_str());
                }
                self.advance(lasts)?;
                for other in &cut {
                    self.sim.release(leader.as_str(), other.as_str());
                }
                Ok(format!("{name} {leader} for {} ms", lasts.as_millis()))
            }
            SimFault::KillLeader | SimFault::KillFollower | SimFault::KillAll => {
                let leader = self.await_leader()?;
                let victims: Vec<NodeId> = match kind {
                    SimFault::KillLeader => vec![leader],
                    SimFault::KillFollower => {
                        let followers: Vec<NodeId> =
                            self.ids.iter().copied().filter(|id| *id != leader).collect();
                        vec![followers[rng.random_range(0..followers.len())]]
                    }
                    _ => self.ids.clone(),
                };
                for id in &victims {
                    self.crash_node(*id);
                }
                let down = jitter(rng, Duration::from_millis(200), ttl * 3 / 2);
                self.advance(down)?;
                for id in &victims {
                    self.sim.bounce(node_name(*id));
                }
                Ok(format!("{name} {victims:?} down for {} ms", down.as_millis()))
            }
            SimFault::LossyLinks => {
                let lasts = jitter(rng, election, ttl);
                let pairs: Vec<(&String, &String)> = nodes
                    .iter()
                    .enumerate()
                    .flat_map(|(i, a)| nodes[i + 1..].iter().map(move |b| (a, b)))
                    .collect();
                for (a, b) in &pairs {
                    self.sim.partition(a.as_str(), b.as_str());
                }
                self.advance(lasts)?;
                for (a, b) in &pairs {
                    self.sim.repair(a.as_str(), b.as_str());
                }
                Ok(format!("{name} between nodes for {} ms", lasts.as_millis()))
            }
            SimFault::RestartOtherFlags => {
                let leader = self.await_leader()?;
                let ms = self.config.lease_ttl.as_millis() as u64;
                let flag = Duration::from_millis(rng.random_range(ms / 4..=ms * 4));
                self.crash_node(leader);
                self.shared.flags.lock().expect("flags").insert(leader, flag);
                let down = jitter(rng, Duration::from_millis(200), ttl);
                self.advance(down)?;
                self.sim.bounce(node_name(leader));
                Ok(format!(
                    "{name} {leader} with a {} ms lease TTL after {} ms down",
                    flag.as_millis(),
                    down.as_millis()
                ))
            }
            SimFault::UpgradeNode => {
                let (id, version) = {
                    let rules = self.shared.rules.lock().expect("rules");
                    let version = |id: NodeId| rules.get(&id).copied().unwrap_or(0);
                    let ids = 1..=self.config.nodes as NodeId;
                    let oldest = ids.clone().map(version).min().unwrap_or(0);
                    (ids.clone().find(|id| version(*id) == oldest).expect("a node"), oldest + 1)
                };
                self.crash_node(id);
                self.shared.rules.lock().expect("rules").insert(id, version);
                let down = jitter(rng, Duration::from_millis(100), ttl / 2);
                self.advance(down)?;
                self.sim.bounce(node_name(id));
                Ok(format!("{name} {id} to placement rules {version} after {} ms down", down.as_millis()))
            }
            SimFault::ReleaseOwnAccord | SimFault::LeaveWorker | SimFault::DropWorker => {
                let n = rng.random_range(0..self.config.workers);
                let action = match kind {
                    SimFault::ReleaseOwnAccord => Action::Release,
                    SimFault::LeaveWorker => Action::Leave,
                    _ => Action::Drop,
                };
                let sender = self.shared.actions.lock().expect("actions").get(&n).cloned();
                let delivered = sender.is_some_and(|s| s.try_send(action).is_ok());
                // The slot acts between rounds and then lingers a while; give it a TTL.
                self.advance(ttl)?;
                // Said as it was, so a seed's fault count cannot rest on an action never taken.
                Ok(format!("{name} {}{}", workers[n], if delivered { "" } else { " (not delivered)" }))
            }
            SimFault::SetLeaseTtl => {
                let short = jitter(rng, ttl / 5, ttl / 2).max(Duration::from_millis(100));
                let cut = self.set_lease_ttl(short)?;
                let held = jitter(rng, ttl / 2, ttl * 3 / 2);
                let mut what = format!("{name} {} ms ({cut}) for {} ms", short.as_millis(), held.as_millis());
                if rng.random_bool(0.5) {
                    // Workers that renewed just before the cut were told the longer TTL: the
                    // next leader must wait that out, not the shorter one.
                    let leader = self.await_leader()?;
                    self.crash_node(leader);
                    self.advance(held)?;
                    self.sim.bounce(node_name(leader));
                    what += &format!(", leader {leader} killed meanwhile");
                } else {
                    self.advance(held)?;
                }
                // Back again whatever happened meanwhile: the run's recovery bound assumes it.
                let back = self.set_lease_ttl(ttl)?;
                Ok(format!("{what}, then {} ms ({back})", ttl.as_millis()))
            }
            SimFault::SlowNetwork => {
                let delay = jitter(rng, Duration::from_millis(5), election / 2);
                let lasts = jitter(rng, ttl, ttl * 2);
                self.sim.set_max_message_latency(delay);
                self.advance(lasts)?;
                self.sim.set_max_message_latency(Duration::from_millis(3));
                Ok(format!("{name} up to {} ms for {} ms", delay.as_millis(), lasts.as_millis()))
            }
        }
    }
}

/// A scratch directory for one run's RocksDB data: on tmpfs when the machine has one, since
/// every write is synced and the simulation waits for the disk.
pub fn scratch_dir() -> std::io::Result<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    match shm.is_dir() {
        true => {
            tempfile::Builder::new().prefix("tenure-sim-").tempdir_in(shm).or_else(|_| tempfile::tempdir())
        }
        false => tempfile::tempdir(),
    }
}
