//! A coordinator node: RocksDB store, openraft, the leader's duties and the gRPC services, wired
//! together and run on two listeners the caller bound (peers, clients), until a shutdown token
//! fires. The Raft transport is served only on the peer listener: peers and clients are
//! different principals, and a client must never be able to send a `Vote` or an entry.
//!
//! What runs where:
//! - [`coordinator`]: the worker-facing API. Joins, releases and leaves become log entries;
//!   heartbeats do not: they are batched and acknowledged after one quorum round confirms this
//!   node is still the leader (openraft's `ensure_linearizable`), then extend the in-memory lease.
//! - [`leader`]: the duties only the leader has: configuring a new cluster, deciding placement
//!   ([`crate::planner`]) and proposing it, following applied events into the
//!   [`crate::lease::LeaseTable`] (judged by the cluster's replicated TTL, never this node's
//!   flag), and proposing expiries when deadlines pass.
//! - [`raft_service`]: the receiving end of the Raft transport.

mod admission;
pub mod coordinator;
mod error;
mod failover;
mod handover;
pub mod health;
mod leader;
mod leadership;
pub mod operator;
mod raft_service;
pub mod status_page;
mod telemetry;

pub use admission::JoinLimits;

/// The largest message a client may send (a heartbeat, a release, a join); a larger one is
/// refused as `RESOURCE_EXHAUSTED` (`message_too_large`) before it is decoded.
pub const MAX_CLIENT_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
pub use error::{CoordinatorError, ERROR_METADATA, LEADER_METADATA};

use crate::ids::NodeId;
use crate::ownership::{Command, Proposal, Response};
use crate::proto::coordinator_server::CoordinatorServer;
use crate::proto::operator_server::OperatorServer;
use crate::proto::peer::raft_transport_server::RaftTransportServer;
use crate::raft::network::{Network, MAX_RAFT_MESSAGE_BYTES};
use crate::raft::Member;
use crate::raft::Raft;
use crate::store::{LogStore, SharedState, StateMachineStore};
use crate::tls::Caller;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{ServerState, SnapshotPolicy};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Everything a node needs to start. Every node of a cluster must agree on `peers`,
/// `partition_count` and `lease_ttl`.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: NodeId,
    /// Every voter of the cluster, this node included, with the addresses it serves peers and
    /// clients on.
    pub peers: BTreeMap<NodeId, Member>,
    pub data_dir: PathBuf,
    pub partition_count: u32,
    pub lease_ttl: Duration,
    /// The revoke budget proposed when this node creates the cluster (see
    /// [`crate::ownership::Config::max_revoking`]); `None` for no limit.
    pub max_revoking: Option<u32>,
    /// This node's placement rules when it leads (see [`crate::planner::Rules`]).
    pub placement: crate::planner::Rules,
    /// How often the leader looks for expired leases.
    pub expiry_check_interval: Duration,
    pub raft_heartbeat_interval: Duration,
    /// Lower bound of the election timeout; the upper bound is twice this.
    pub election_timeout: Duration,
    /// Wait exactly `election_timeout` instead of a random time up to twice it. Only the
    /// deterministic simulation wants this (with a different timeout on every node): openraft
    /// draws the random wait from a generator no seed reaches.
    pub fixed_election_timeout: bool,
    /// Build a snapshot (and purge the log) after this many applied entries.
    pub snapshot_after_logs: u64,
    /// Source address for connections to peers, on hosts with several addresses. `None` lets
    /// the system choose.
    pub dial_from: Option<std::net::IpAddr>,
    /// Never purge the log, even after a snapshot, so that every decision can be replayed from
    /// disk afterwards (the fault harness's record of `tenure serve` processes). The log then
    /// grows without bound: for test and audit runs only.
    pub keep_whole_log: bool,
    /// Most streams of each kind this node serves at once, over all connections: heartbeat
    /// streams, and ownership and route streams together. One more is refused with
    /// `TooManyStreams` rather than growing without bound; subscribers cannot crowd out renewals.
    pub max_streams: usize,
    /// This node joins a cluster that exists: it never initialises one, even as the smallest id
    /// in `peers`, and waits for an operator to add it (`ctl member add`). A node restarted
    /// with an empty disk must be started this way, under a new id.
    pub join_existing: bool,
    /// Most streams (of all kinds together) one client may hold open on this node, counted by
    /// the principal its certificate names; one more is refused with `TooManyClientStreams`, so
    /// one worker's leak cannot use up the node's `max_streams`. Unauthenticated clients of an
    /// insecure cluster have no identity and are not counted.
    pub max_streams_per_client: usize,
    /// This node's limits on joins when it leads (see [`JoinLimits`]).
    pub join_limits: JoinLimits,
    /// How often the per-worker gauges (`tenure_owned_partitions{worker}`) are set again. An
    /// exporter that drops series idle for a few periods then drops a worker's series once its
    /// session has ended, so a stream of distinct names cannot grow the metrics without bound.
    pub gauge_refresh: Duration,
    /// How this node connects to its peers; TCP unless a simulation says otherwise.
    pub dialer: tenure_worker::transport::Dialer,
    /// The cluster CA and this node's certificate: the peer listener then requires a node's
    /// certificate from that CA, and peers are dialled over TLS. `None` runs the peer side in
    /// plain text, which anyone who reaches the peer port can then speak.
    pub tls: Option<crate::tls::NodeTls>,
}

/// How often the server pings an HTTP/2 connection, and how long it waits for the answer.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

impl NodeConfig {
    /// A configuration with the defaults for everything but identity and placement.
    pub fn new(id: NodeId, peers: BTreeMap<NodeId, Member>, data_dir: PathBuf) -> Self {
        NodeConfig {
            id,
            peers,
            data_dir,
            partition_count: 256,
            lease_ttl: Duration::from_secs(5),
            max_revoking: None,
            placement: crate::planner::Rules::default(),
            expiry_check_interval: Duration::from_millis(50),
            raft_heartbeat_interval: Duration::from_millis(100),
            election_timeout: Duration::from_millis(500),
            fixed_election_timeout: false,
            snapshot_after_logs: 5000,
            dial_from: None,
            keep_whole_log: false,
            max_streams: 100_000,
            join_existing: false,
            max_streams_per_client: 64,
            join_limits: JoinLimits::default(),
            gauge_refresh: Duration::from_secs(10),
            dialer: tenure_worker::transport::Dialer::tcp(),
            tls: None,
        }
    }

    /// Checks the values that the cluster cannot work with.
    pub fn validate(&self) -> Result<(), NodeError> {
        let bad = |m: String| Err(NodeError::Config(m));
        if !self.peers.contains_key(&self.id) {
            return bad(format!(
                "node id {} is not among the peers {:?}",
                self.id,
                self.peers.keys().collect::<Vec<_>>()
            ));
        }
        for (id, member) in &self.peers {
            if member.peer_addr.is_empty() || member.client_addr.is_empty() {
                return bad(format!("node {id} needs both a peer and a client address"));
            }
            if member.peer_addr == member.client_addr {
                return bad(format!(
                    "node {id} serves peers and clients on one address ({}); give each its own",
                    member.peer_addr
                ));
            }
        }
        if self.peers.contains_key(&0) {
            return bad("node id 0 is reserved; number nodes from 1".into());
        }
        crate::keyspace::KeySpace::new(self.partition_count).map_err(|e| NodeError::Config(e.to_string()))?;
        let ttl_ms = u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX);
        crate::ownership::check_lease_ttl(ttl_ms).map_err(|e| NodeError::Config(e.to_string()))?;
        if self.raft_heartbeat_interval.is_zero() || self.election_timeout <= self.raft_heartbeat_interval * 2
        {
            return bad("the election timeout must exceed twice the raft heartbeat interval".into());
        }
        if self.max_revoking == Some(0) {
            return bad("the revoke budget must be at least 1 partition".into());
        }
        if self.expiry_check_interval.is_zero() {
            return bad("the expiry check interval must be positive".into());
        }
        if self.max_streams == 0 || self.max_streams > tokio::sync::Semaphore::MAX_PERMITS {
            return bad(format!(
                "the stream limit must be between 1 and {}, not {}",
                tokio::sync::Semaphore::MAX_PERMITS,
                self.max_streams
            ));
        }
        if self.gauge_refresh.is_zero() {
            return bad("the gauge refresh period must be positive".to_string());
        }
        if self.max_streams_per_client == 0 {
            return bad("the per-client stream limit must be positive".to_string());
        }
        let limits = &self.join_limits;
        if limits.max_sessions == 0 || limits.joins_per_second == 0 || limits.join_burst == 0 {
            return bad(format!(
                "the session cap, the join rate and the join burst must all be positive, not {}, {} and {}",
                limits.max_sessions, limits.joins_per_second, limits.join_burst
            ));
        }
        Ok(())
    }
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot open the store: {0}")]
    Storage(String),
    #[error("raft failed to start: {0}")]
    Raft(String),
}

/// A renewal waiting for the next leadership confirmation round.
pub(crate) struct PendingRenewal {
    pub namespace: crate::ownership::Namespace,
    pub session: crate::ids::SessionId,
    pub secret: crate::ownership::SecretHash,
    pub received: tokio::time::Instant,
    pub reply: tokio::sync::oneshot::Sender<Result<leader::RenewedLeases, CoordinatorError>>,
}

/// One open stream's place in the node's budget and in its client's.
pub(crate) struct StreamPermit {
    _node: tokio::sync::OwnedSemaphorePermit,
    _client: Option<ClientStream>,
}

/// One stream counted against a client principal; uncounted when dropped.
struct ClientStream {
    key: String,
    open: Arc<Mutex<std::collections::HashMap<String, usize>>>,
}

impl Drop for ClientStream {
    fn drop(&mut self) {
        let mut open = self.open.lock().expect("stream count lock poisoned");
        if let Some(count) = open.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// The parts of a running node that its services share.
pub struct Node {
    pub config: NodeConfig,
    pub raft: Raft,
    pub state: SharedState,
    pub(crate) sm: StateMachineStore,
    /// `Some` only while this node is the leader and has reset the table for its term.
    pub(crate) leases: Mutex<Option<leadership::Leadership>>,
    pub(crate) renewals: mpsc::Sender<PendingRenewal>,
    /// Renewals this node confirmed while leading, ever (the status page shows their rate).
    pub(crate) renewals_confirmed: std::sync::atomic::AtomicU64,
    /// Raised when renewals confirmed moved partitions, which frees revoke budget: the leader
    /// decides again.
    pub(crate) moves_confirmed: tokio::sync::Notify,
    /// Fires when the node stops; every task that holds the node watches it, so the store (and
    /// its file lock) is released on shutdown.
    pub(crate) stopping: CancellationToken,
    /// Role and leader, as openraft last reported them (kept, so a request needs no new handle).
    server_metrics: tokio::sync::watch::Receiver<openraft::metrics::RaftServerMetrics<NodeId, Member>>,
    /// One permit per open ownership or route stream (see [`NodeConfig::max_streams`]).
    pub(crate) streams: Arc<tokio::sync::Semaphore>,
    /// One permit per open heartbeat stream.
    pub(crate) heartbeat_streams: Arc<tokio::sync::Semaphore>,
    /// Open streams per client principal (see [`NodeConfig::max_streams_per_client`]); a name
    /// leaves the map when its last stream closes.
    pub(crate) client_streams: Arc<Mutex<std::collections::HashMap<String, usize>>>,
    /// The session cap and join rate this node enforces while it leads.
    pub(crate) admission: admission::Admission,
    /// Fires when a graceful stop begins: the node takes no new work from then on (every call
    /// that needs the leader is pointed at `successor`), while Raft keeps running until the
    /// handover is done.
    pub(crate) draining: CancellationToken,
    /// The follower a draining leader hands over to, once chosen.
    pub(crate) successor: Mutex<Option<NodeId>>,
    /// Connections to peers, shared with Raft (for the handover's campaign request).
    pub(crate) network: Network,
}

impl Node {
    /// Every entry this node applies from now on, with its events, as it applies them (for
    /// in-process observers: benchmarks and the fault harness).
    pub fn applied_events(
        &self,
    ) -> tokio::sync::broadcast::Receiver<std::sync::Arc<crate::store::AppliedEvent>> {
        self.sm.subscribe()
    }

    /// Like [`Node::applied_events`], with the index this node had applied when it subscribed:
    /// every entry after it reaches the receiver (for a recorder that must not miss one).
    pub fn applied_events_after(
        &self,
    ) -> (tokio::sync::broadcast::Receiver<std::sync::Arc<crate::store::AppliedEvent>>, u64) {
        self.sm.subscribe_after()
    }

    /// A permit for one more ownership or route stream (`heartbeats: false`) or heartbeat
    /// stream for `caller`, held for as long as the stream is served: within the caller's own
    /// limit first, then the node's.
    pub(crate) fn stream_permit(
        &self,
        heartbeats: bool,
        caller: &Caller,
    ) -> Result<StreamPermit, CoordinatorError> {
        let client = match &caller.0 {
            Some(principal) => {
                let key = principal.to_string();
                let limit = self.config.max_streams_per_client;
                let mut open = self.client_streams.lock().expect("stream count lock poisoned");
                let count = open.entry(key.clone()).or_default();
                if *count >= limit {
                    return Err(CoordinatorError::TooManyClientStreams { limit });
                }
                *count += 1;
                Some(ClientStream { key, open: self.client_streams.clone() })
            }
            None => None,
        };
        let budget = if heartbeats { &self.heartbeat_streams } else { &self.streams };
        // On refusal `client` is dropped here, which gives the caller's place back.
        let node = budget
            .clone()
            .try_acquire_owned()
            .map_err(|_| CoordinatorError::TooManyStreams { limit: self.config.max_streams })?;
        Ok(StreamPermit { _node: node, _client: client })
    }

    /// Fails with `NotLeader` (and the leader's address) unless this node leads.
    pub fn ensure_leader(&self) -> Result<(), CoordinatorError> {
        if self.draining.is_cancelled() {
            // Stopping: the work goes to the successor (or, until one is chosen, anywhere else).
            let leader_id = *self.successor.lock().expect("successor lock poisoned");
            let leader_addr = leader_id.and_then(|id| self.address_of(id));
            return Err(CoordinatorError::NotLeader { leader_id, leader_addr });
        }
        // Every request asks this: read the small server metrics in place, copying nothing.
        let leader_id = {
            let metrics = self.server_metrics.borrow();
            if metrics.state == ServerState::Leader && metrics.current_leader == Some(self.config.id) {
                return Ok(());
            }
            metrics.current_leader
        };
        let leader_addr = leader_id.and_then(|id| self.address_of(id));
        Err(CoordinatorError::NotLeader { leader_id, leader_addr })
    }

    /// The refusal a stopping node ends its streams with: `UNAVAILABLE`, naming the node that
    /// took over leadership from it, if it handed over, so that workers go there at once.
    pub(crate) fn stopped(&self) -> CoordinatorError {
        let successor = *self.successor.lock().expect("successor lock poisoned");
        match successor.and_then(|id| self.address_of(id).map(|addr| (id, addr))) {
            Some((id, addr)) => CoordinatorError::NotLeader { leader_id: Some(id), leader_addr: Some(addr) },
            None => CoordinatorError::Unavailable("node is shutting down".into()),
        }
    }

    /// The term this node last saw, as openraft reports it.
    pub(crate) fn current_term(&self) -> u64 {
        self.server_metrics.borrow().vote.leader_id().get_term()
    }

    fn address_of(&self, id: NodeId) -> Option<String> {
        let applied = self.state.read().expect("state lock poisoned");
        applied
            .membership
            .membership()
            .get_node(&id)
            .map(|n| n.client_addr.clone())
            .or_else(|| self.config.peers.get(&id).map(|m| m.client_addr.clone()))
    }

    /// Returns once this node, as the leader, has heard from a quorum that it still leads and has
    /// applied everything committed before the call: a read of the state after this is
    /// linearizable. Refused (naming the leader) on a follower; `Unavailable` if no quorum
    /// answers within [`LINEARIZABLE_READ_BOUND`].
    pub async fn read_linearizably(&self) -> Result<(), CoordinatorError> {
        use openraft::error::CheckIsLeaderError;
        match tokio::time::timeout(LINEARIZABLE_READ_BOUND, self.raft.ensure_linearizable()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(CoordinatorError::NotLeader {
                    leader_id: f.leader_id,
                    leader_addr: f.leader_node.map(|n| n.client_addr),
                })
            }
            Ok(Err(e)) => Err(CoordinatorError::Unavailable(e.to_string())),
            Err(_) => Err(CoordinatorError::Unavailable(format!(
                "no quorum confirmed this node's leadership within {LINEARIZABLE_READ_BOUND:?}"
            ))),
        }
    }

    /// Proposes a command to the default namespace and waits until it is committed and applied.
    pub async fn propose(&self, command: Command) -> Result<Response, CoordinatorError> {
        self.propose_entry(Proposal::default_namespace(command)).await
    }

    /// Proposes an entry and waits until it is committed and applied.
    pub async fn propose_entry(&self, proposal: Proposal) -> Result<Response, CoordinatorError> {
        match self.raft.client_write(proposal).await {
            Ok(reply) => match reply.data {
                Response::Rejected(r) => Err(CoordinatorError::Rejected(r)),
                other => Ok(other),
            },
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(CoordinatorError::NotLeader {
                    leader_id: f.leader_id,
                    leader_addr: f.leader_node.map(|n| n.client_addr),
                })
            }
            Err(e) => Err(CoordinatorError::Unavailable(e.to_string())),
        }
    }
}

/// How long a linearizable read waits for a quorum to confirm the leader.
pub const LINEARIZABLE_READ_BOUND: Duration = Duration::from_secs(2);

/// How long a stopping node waits for its tasks before aborting them.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(300);

/// A started node; [`RunningNode::shutdown`] stops it and releases its database.
pub struct RunningNode {
    pub node: Arc<Node>,
    /// Where it serves workers, front-ends and operators.
    pub addr: std::net::SocketAddr,
    /// Where it serves its peers.
    pub peer_addr: std::net::SocketAddr,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// The two listeners a node serves on: peers and clients are different principals and never
/// share a port (see [`crate::raft::Member`]).
pub struct Listeners {
    pub peers: TcpListener,
    pub clients: TcpListener,
}

/// Connections accepted for one of a node's two listeners, and where they arrive.
pub struct Incoming<I> {
    pub addr: std::net::SocketAddr,
    pub connections: I,
}

impl RunningNode {
    pub fn raft(&self) -> &Raft {
        &self.node.raft
    }

    /// Stops serving, shuts Raft down and ends every task, so the store can be reopened.
    /// Open streams (workers' ownership streams) would keep a graceful gRPC shutdown waiting
    /// forever, so each task gets a short grace period and is then aborted.
    /// Stops the way an operator's SIGTERM should: the node takes no new work; if it leads, it
    /// hands leadership to its most caught-up follower (see [`handover`]) and waits, within
    /// `bound`, for that follower to lead; then it stops as [`RunningNode::shutdown`] does. The
    /// answer names the node that took over, if one did.
    pub async fn shutdown_gracefully(self, bound: Duration) -> Option<NodeId> {
        let successor = handover::hand_over(&self.node, bound).await;
        self.shutdown().await;
        successor
    }

    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.node.raft.shutdown().await;
        for mut task in self.tasks {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await.is_err() {
                task.abort();
                let _ = task.await;
            }
        }
    }
}

fn raft_config(config: &NodeConfig) -> Result<openraft::Config, NodeError> {
    let ms = |d: Duration| d.as_millis() as u64;
    openraft::Config {
        cluster_name: "tenure".into(),
        heartbeat_interval: ms(config.raft_heartbeat_interval),
        election_timeout_min: ms(config.election_timeout),
        election_timeout_max: if config.fixed_election_timeout {
            ms(config.election_timeout) + 1
        } else {
            ms(config.election_timeout) * 2
        },
        snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_after_logs),
        max_in_snapshot_log_to_keep: if config.keep_whole_log {
            u64::MAX
        } else {
            config.snapshot_after_logs.min(100)
        },
        ..Default::default()
    }
    .validate()
    .map_err(|e| NodeError::Config(e.to_string()))
}

/// Opens the store, starts Raft and serves on `listeners` until [`RunningNode::shutdown`].
/// The node with the smallest id initialises a new cluster.
pub async fn start(config: NodeConfig, listeners: Listeners) -> Result<RunningNode, NodeError> {
    let addr = |l: &TcpListener| l.local_addr().map_err(|e| NodeError::Config(e.to_string()));
    let (peer_addr, client_addr) = (addr(&listeners.peers)?, addr(&listeners.clients)?);
    // No Nagle: small answers and stream events must not wait for the peer's delayed ACK
    // (about 40 ms on Linux), which would be most of a planned move.
    let incoming = |l: TcpListener| tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
    let peers = Incoming { addr: peer_addr, connections: incoming(listeners.peers) };
    let clients = Incoming { addr: client_addr, connections: incoming(listeners.clients) };
    start_on(config, peers, clients).await
}

/// [`start`], serving the connections that `peers` and `clients` accept (which the simulation
/// uses to serve over its simulated network).
pub async fn start_on<I, IO, IE>(
    config: NodeConfig,
    peers: Incoming<I>,
    clients: Incoming<I>,
) -> Result<RunningNode, NodeError>
where
    I: futures::Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    config.validate()?;
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|e| NodeError::Storage(format!("{}: {e}", config.data_dir.display())))?;
    let db = crate::store::open(&config.data_dir).map_err(|e| NodeError::Storage(e.to_string()))?;
    let log_store = LogStore::new(db.clone());
    let sm = StateMachineStore::open(db).map_err(|e| NodeError::Storage(e.to_string()))?;
    let state = sm.shared();
    // The partition count and lease TTL were fixed when the cluster was created; flags that
    // disagree are overridden, and said so at start rather than found out later.
    let created = state.read().expect("state lock poisoned").default_table().config();
    if let Some(differs) = created.and_then(|have| leader::config_differs(&config, have)) {
        tracing::warn!(node = config.id, "{differs}");
    }
    let network =
        Network::new(config.dial_from, config.dialer.clone(), config.tls.as_ref().map(|t| t.peer_client()))
            .retrying_every(config.raft_heartbeat_interval * 2);
    let raft_config = raft_config(&config)?;
    // How long a follower keeps trusting a silent leader (openraft's leader lease), with one
    // heartbeat interval of margin: a handover's campaign waits this long.
    let leader_lease =
        Duration::from_millis(raft_config.election_timeout_max) + config.raft_heartbeat_interval;
    let raft = Raft::new(config.id, Arc::new(raft_config), network.clone(), log_store, sm.clone())
        .await
        .map_err(|e| NodeError::Raft(e.to_string()))?;

    let first = config.peers.keys().next().copied();
    if first == Some(config.id)
        && !config.join_existing
        && !raft.is_initialized().await.map_err(|e| NodeError::Raft(e.to_string()))?
    {
        if let Err(e) = raft.initialize(config.peers.clone()).await {
            tracing::info!(error = %e, "cluster already initialised");
        }
    }

    let (renewals, renewal_rx) = mpsc::channel(65536);
    let cancel = CancellationToken::new();
    let (max_streams, join_limits) = (config.max_streams, config.join_limits);
    let node = Arc::new(Node {
        config,
        raft: raft.clone(),
        state,
        sm,
        leases: Mutex::new(None),
        renewals,
        renewals_confirmed: Default::default(),
        moves_confirmed: tokio::sync::Notify::new(),
        stopping: cancel.clone(),
        streams: Arc::new(tokio::sync::Semaphore::new(max_streams)),
        heartbeat_streams: Arc::new(tokio::sync::Semaphore::new(max_streams)),
        client_streams: Arc::default(),
        server_metrics: raft.server_metrics(),
        admission: admission::Admission::new(join_limits),
        draining: CancellationToken::new(),
        successor: Mutex::new(None),
        network,
    });
    let mut tasks = vec![
        tokio::spawn(leader::run_duties(node.clone(), cancel.clone())),
        tokio::spawn(leader::run_renewals(node.clone(), renewal_rx, cancel.clone())),
        tokio::spawn(leader::refresh_gauges(node.clone(), cancel.clone())),
        tokio::spawn(telemetry::follow_raft(node.clone(), cancel.clone())),
    ];

    let coordinator = CoordinatorServer::new(coordinator::CoordinatorService { node: node.clone() })
        .max_decoding_message_size(MAX_CLIENT_MESSAGE_BYTES);
    let coordinator = tonic::service::interceptor::InterceptedService::new(
        coordinator,
        crate::tls::admit_client(node.config.tls.is_some()),
    );
    // Health and reflection are gated by the listener's TLS handshake alone: any certificate
    // of the cluster's CA may probe the node or list the API.
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    tasks.push(tokio::spawn(health::report(node.clone(), health_reporter, cancel.clone())));
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| NodeError::Config(format!("gRPC reflection: {e}")))?;
    let operator = OperatorServer::new(operator::OperatorService { node: node.clone() })
        .max_decoding_message_size(MAX_CLIENT_MESSAGE_BYTES);
    let operator = tonic::service::interceptor::InterceptedService::new(
        operator,
        crate::tls::admit_client(node.config.tls.is_some()),
    );
    // The simulation gives each node its own fixed election timeout so that elections do not
    // split; a campaign timed by this node's lease alone would undo that.
    if !node.config.fixed_election_timeout {
        let timing = failover::Timing {
            lease: leader_lease,
            step: node.config.raft_heartbeat_interval,
            retry_after: leader_lease,
        };
        tasks.push(tokio::spawn(failover::stand_when_silent(
            raft.clone(),
            node.config.id,
            timing,
            node.draining.clone(),
            cancel.clone(),
        )));
    }
    let transport = RaftTransportServer::new(raft_service::RaftService::new(raft, leader_lease))
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
    let transport = tonic::service::interceptor::InterceptedService::new(
        transport,
        crate::tls::admit_peer(node.config.tls.is_some()),
    );
    // Both listeners require a certificate from the cluster's CA; the gates above then admit
    // nodes on one and workers and operators on the other.
    let oversized = tower::util::MapResponseLayer::new(error::oversized_as_exhausted);
    let mut peer_server = tonic::transport::Server::builder().layer(oversized.clone());
    let mut client_server = tonic::transport::Server::builder().layer(oversized);
    if let Some(tls) = &node.config.tls {
        peer_server =
            peer_server.tls_config(tls.server()).map_err(|e| NodeError::Config(format!("peer TLS: {e}")))?;
        client_server = client_server
            .tls_config(tls.server())
            .map_err(|e| NodeError::Config(format!("client TLS: {e}")))?;
    }
    // Peers reach the Raft transport only on their listener, clients the worker-facing API only
    // on theirs: a client connection cannot carry a `Vote` or an `AppendEntries`.
    let shutdown = cancel.clone();
    tasks.push(tokio::spawn(async move {
        let result = peer_server
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .add_service(transport)
            .serve_with_incoming_shutdown(peers.connections, shutdown.cancelled_owned())
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "peer gRPC server stopped");
        }
    }));
    let shutdown = cancel.clone();
    tasks.push(tokio::spawn(async move {
        let result = client_server
            // A client that stops answering pings (a frozen or vanished worker) loses its
            // connection, and with it the streams and permits it held.
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .add_service(coordinator)
            .add_service(operator)
            .add_service(health_service)
            .add_service(reflection)
            .serve_with_incoming_shutdown(clients.connections, shutdown.cancelled_owned())
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "client gRPC server stopped");
        }
    }));
    Ok(RunningNode { node, addr: clients.addr, peer_addr: peers.addr, cancel, tasks })
}
