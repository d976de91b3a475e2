//! The `tenure` binary: `serve` runs a coordinator node, `demo` runs a whole cluster with
//! workers in one process, `ctl` inspects and operates a running cluster.

mod ctl;
mod demo;
mod run;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tenure::ids::NodeId;
use tenure::raft::Member;
use tenure::server::{self, JoinLimits, NodeConfig};

#[derive(Parser)]
#[command(
    name = "tenure",
    version,
    about = "Partition-ownership coordinator: per-partition leases and fencing tokens"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one coordinator node.
    Serve(Box<ServeArgs>),
    /// Start a 3-node cluster and a few workers in this process and narrate what happens.
    Demo(DemoArgs),
    /// Inspect and operate a running cluster (members, endpoints, sessions, partitions, drain, watch).
    Ctl(ctl::CtlArgs),
    /// Make a development CA and certificates for nodes, workers and operators (PEM files).
    Certs(CertsArgs),
    /// Run the real cluster and workers under seeded faults, record the history and check it.
    Nemesis(NemesisArgs),
    /// Run the seeded simulation of the lease protocol over many seeds and check every history.
    Simulate(SimulateArgs),
    /// Run the whole stack (openraft, gRPC, RocksDB, worker library) under the seeded
    /// deterministic simulation of network and clock, over many seeds, and check every history.
    SimulateStack(SimulateStackArgs),
    /// Run a worker that writes a counter per owned partition into a PostgreSQL-fenced store,
    /// printing ACCEPT / REJECT / LOST lines (used by the process fault tests).
    Work(WorkArgs),
    /// Run a command once per owned partition, its grant and fencing token in its environment
    /// (TENURE_PARTITION, TENURE_TOKEN, ...): SIGTERM on revoke, SIGKILL after the drain bound
    /// or on loss, released once it exited.
    Run(run::RunArgs),
    /// A worker process of a nemesis run (started by `tenure nemesis`; prints JSON lines).
    #[command(hide = true)]
    NemesisWorker(NemesisWorkerArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
struct NemesisWorkerArgs {
    #[arg(long, value_delimiter = ',', required = true)]
    coordinators: Vec<String>,
    #[arg(long)]
    name: String,
    /// The run's fenced store (host:port).
    #[arg(long)]
    store: String,
    #[arg(long)]
    dial_from: std::net::IpAddr,
    /// The run clock's origin on the system's monotonic clock, in nanoseconds.
    #[arg(long)]
    epoch_ns: u64,
    #[arg(long, default_value_t = 20)]
    write_every_ms: u64,
    /// Where the worker's certificate is (ca.pem, worker-<name>.pem, worker-<name>-key.pem).
    #[arg(long)]
    tls_dir: Option<std::path::PathBuf>,
    /// Run the partition runner, a handler per owned partition, instead of the event loop.
    #[arg(long)]
    runner: bool,
}

#[derive(Args)]
struct WorkArgs {
    /// Coordinator addresses (host:port), comma separated.
    #[arg(long, env = "TENURE_COORDINATORS", value_delimiter = ',', required = true)]
    coordinators: Vec<String>,
    /// The worker's stable name.
    #[arg(long)]
    name: String,
    /// libpq-style connection string of the fenced store.
    #[arg(long, env = "TENURE_FENCE_POSTGRES")]
    postgres: String,
    /// Time between writes, per partition.
    #[arg(long, default_value_t = 50)]
    write_every_ms: u64,
    #[command(flatten)]
    tls: ClientTlsArgs,
}

/// How a worker or an operator proves who it is to the coordinators.
#[derive(Args)]
struct ClientTlsArgs {
    /// The cluster's CA certificate (PEM): the only one trusted for the coordinators.
    #[arg(long, env = "TENURE_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), naming tenure://worker/<name> or
    /// tenure://operator/<name>.
    #[arg(long, env = "TENURE_TLS_CERT", requires = "tls_ca")]
    tls_cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, env = "TENURE_TLS_KEY", requires = "tls_ca")]
    tls_key: Option<PathBuf>,
    /// Connect in plain text, to a cluster started with --insecure.
    #[arg(long, conflicts_with = "tls_ca")]
    insecure: bool,
}

impl ClientTlsArgs {
    fn load(&self) -> Result<Option<tenure::worker::ClientTls>> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => {
                Ok(Some(tenure::worker::ClientTls::from_files(ca, cert, key).map_err(anyhow::Error::msg)?))
            }
            _ if self.insecure => Ok(None),
            _ => bail!("give a client certificate (--tls-ca, --tls-cert, --tls-key; `tenure certs` makes a development set), or --insecure for a cluster started with --insecure"),
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    /// How log lines are written to stderr: text for people, or one JSON object per line for a
    /// log pipeline.
    #[arg(long, env = "TENURE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// This node's id (1, 2, ...); must appear in --peers.
    #[arg(long, env = "TENURE_NODE_ID")]
    id: NodeId,
    /// Every voter as id=CLIENT_ADDR/PEER_ADDR, comma separated, e.g.
    /// 1=127.0.0.1:7001/127.0.0.1:7101,2=127.0.0.1:7002/127.0.0.1:7102. Workers and operators
    /// dial the client address; only peers reach the peer address (Raft). A host name is as
    /// good as an IP (n1.example:7001): peers resolve it on every new connection.
    #[arg(long, env = "TENURE_PEERS", value_parser = parse_peer, value_delimiter = ',', required = true)]
    peers: Vec<(NodeId, Member)>,
    /// Address to serve clients on; defaults to this node's client address in --peers.
    #[arg(long, env = "TENURE_LISTEN")]
    listen: Option<SocketAddr>,
    /// Address to serve peers on; defaults to this node's peer address in --peers.
    #[arg(long, env = "TENURE_LISTEN_PEERS")]
    listen_peers: Option<SocketAddr>,
    /// Directory for this node's RocksDB data.
    #[arg(long, env = "TENURE_DATA_DIR")]
    data_dir: PathBuf,
    /// Partitions in the key space (fixed when the cluster is created).
    #[arg(long, env = "TENURE_PARTITIONS", default_value_t = 256)]
    partitions: u32,
    /// Lease TTL in milliseconds (fixed when the cluster is created).
    #[arg(long, env = "TENURE_LEASE_TTL_MS", default_value_t = 5000)]
    lease_ttl_ms: u64,
    /// Most partitions revoking at once, so joins, leaves and weight changes move the table in
    /// bounded waves (fixed when the cluster is created; default: no limit).
    #[arg(long, env = "TENURE_MAX_REVOKING")]
    max_revoking: Option<u32>,
    /// Raft election timeout (lower bound) in milliseconds.
    #[arg(long, env = "TENURE_ELECTION_TIMEOUT_MS", default_value_t = 500)]
    election_timeout_ms: u64,
    /// Serve Prometheus metrics on this address.
    #[arg(long, env = "TENURE_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Serve the status page (the partition map, sessions, nodes, recent decisions) over HTTP
    /// on this address; with TLS on, over HTTPS to operators' certificates only.
    #[arg(long, env = "TENURE_STATUS_LISTEN")]
    status_listen: Option<SocketAddr>,
    /// How often, in milliseconds, the per-worker gauges are set again; a worker's series is
    /// dropped from the metrics three periods after its session ends.
    #[arg(long, env = "TENURE_GAUGE_REFRESH_MS", default_value_t = 10_000)]
    gauge_refresh_ms: u64,
    /// On SIGTERM or SIGINT, how long, in milliseconds, the node may take to hand leadership
    /// over and stop; past it, it stops anyway.
    #[arg(long, env = "TENURE_SHUTDOWN_BOUND_MS", default_value_t = 10_000)]
    shutdown_bound_ms: u64,
    /// Join a cluster that already exists: never initialise one, and wait to be added with
    /// `tenure ctl member add`. A node whose disk was lost comes back this way, under a new id.
    #[arg(long, env = "TENURE_JOIN")]
    join: bool,
    /// Raft heartbeat interval in milliseconds (default: a fifth of the election timeout).
    #[arg(long, env = "TENURE_RAFT_HEARTBEAT_MS")]
    raft_heartbeat_ms: Option<u64>,
    /// Build a snapshot after this many applied log entries.
    #[arg(long, env = "TENURE_SNAPSHOT_AFTER_LOGS", default_value_t = 5000)]
    snapshot_after_logs: u64,
    /// Source address for connections to peers (on hosts with several addresses).
    #[arg(long, env = "TENURE_DIAL_FROM")]
    dial_from: Option<std::net::IpAddr>,
    /// Never purge the log, so every decision can be replayed from disk afterwards (audits and
    /// fault runs; the log grows without bound).
    #[arg(long)]
    keep_whole_log: bool,
    /// Most heartbeat streams, and most ownership and route streams together, served at once;
    /// more are refused.
    #[arg(long, env = "TENURE_MAX_STREAMS", default_value_t = 100_000)]
    max_streams: usize,
    /// Most streams one client (one certificate's principal) may hold open on this node; more
    /// are refused (RESOURCE_EXHAUSTED).
    #[arg(long, env = "TENURE_MAX_STREAMS_PER_CLIENT", default_value_t = 64)]
    max_streams_per_client: usize,
    /// Most workers with a session, cluster-wide, when this node leads; a new name beyond it is
    /// refused (RESOURCE_EXHAUSTED) until one leaves.
    #[arg(long, env = "TENURE_MAX_SESSIONS", default_value_t = JoinLimits::default().max_sessions)]
    max_sessions: usize,
    /// Joins admitted per second, sustained, when this node leads; more are refused
    /// (RESOURCE_EXHAUSTED) and the worker library retries them.
    #[arg(long, env = "TENURE_JOINS_PER_SECOND", default_value_t = JoinLimits::default().joins_per_second)]
    joins_per_second: u32,
    /// Joins admitted at once after a quiet spell (a fleet starting up).
    #[arg(long, env = "TENURE_JOIN_BURST", default_value_t = JoinLimits::default().join_burst)]
    join_burst: u32,
    /// Seed of the placement affinity ring. Two seeds stand for two versions of the placement
    /// rules, for rolling-upgrade tests; only the leader's applies, through the log.
    #[arg(long, hide = true, default_value_t = 0)]
    placement_ring_seed: u64,
    /// The cluster's CA certificate (PEM): peers must present a node certificate it issued.
    #[arg(long, env = "TENURE_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// This node's certificate (PEM), naming tenure://node/<id> and the hosts it serves.
    #[arg(long, env = "TENURE_TLS_CERT", requires = "tls_ca")]
    tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, env = "TENURE_TLS_KEY", requires = "tls_ca")]
    tls_key: Option<PathBuf>,
    /// Serve peers and clients in plain text, without --tls-*: anyone who reaches the peer port
    /// can then speak Raft, and anyone who reaches the client port can join under any name.
    /// For trying tenure out on one machine only.
    #[arg(long, conflicts_with = "tls_ca")]
    insecure: bool,
}

#[derive(Args)]
struct CertsArgs {
    /// Directory for the PEM files; a CA already there (ca.pem, ca-key.pem) is reused.
    #[arg(long)]
    dir: PathBuf,
    /// Node certificates for ids 1..=N.
    #[arg(long, default_value_t = 3)]
    nodes: u64,
    /// Host names and IP addresses the nodes serve on, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1,localhost")]
    hosts: Vec<String>,
    /// Worker certificates, by worker name, comma separated.
    #[arg(long, value_delimiter = ',')]
    workers: Vec<String>,
    /// Operator certificates, by name, comma separated.
    #[arg(long, value_delimiter = ',')]
    operators: Vec<String>,
}

#[derive(Args)]
struct DemoArgs {
    /// Partitions in the demo cluster.
    #[arg(long, default_value_t = 12)]
    partitions: u32,
    /// Lease TTL in milliseconds.
    #[arg(long, default_value_t = 1500)]
    lease_ttl_ms: u64,
}

#[derive(Args)]
struct NemesisArgs {
    /// Seed of the fault schedule; the same seed draws the same faults in the same order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How many runs, with seeds seed, seed+1, ...
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// Seconds of faults per run.
    #[arg(long, default_value_t = 60)]
    fault_secs: u64,
    /// Coordinator nodes (3 or 5).
    #[arg(long, default_value_t = 3)]
    nodes: u64,
    /// Worker slots.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Partitions.
    #[arg(long, default_value_t = 12)]
    partitions: u32,
    /// Lease TTL in milliseconds.
    #[arg(long, default_value_t = 1000)]
    lease_ttl_ms: u64,
    /// Fault kinds to draw from, comma separated (default: all): freeze-worker, crash-worker,
    /// partition-worker, minority-leader, isolate-leader, pause-leader, kill-leader,
    /// kill-follower, kill-all, slow-network, restart-other-flags, upgrade-node, and what
    /// applications do of their own accord: release-own-accord, leave-worker, drop-worker.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Switch the store's fencing check off (the checker must then report violations).
    #[arg(long)]
    no_fencing: bool,
    /// Write each run's history as JSON into this directory.
    #[arg(long)]
    history_dir: Option<PathBuf>,
    /// Run the coordinator nodes and the workers in this process instead of as `tenure serve`
    /// and worker processes (no real SIGSTOP or kill -9 then; quicker to start).
    #[arg(long)]
    in_process: bool,
    /// How many of the worker processes run the partition runner instead of the event loop.
    #[arg(long, default_value_t = 1)]
    runners: usize,
}

#[derive(Args)]
struct SimulateArgs {
    /// First seed (also read from TENURE_SIM_SEED, to replay one).
    #[arg(long, env = "TENURE_SIM_SEED", default_value_t = 0)]
    seed: u64,
    /// How many seeds, from the first.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// Simulated seconds of faults per seed.
    #[arg(long, default_value_t = 20)]
    fault_secs: u64,
    /// Chance that a message is held up for 200-800 ms.
    #[arg(long, default_value_t = 0.01)]
    slow: f64,
    /// Switch the store's fencing check off (the checker must then report violations).
    #[arg(long)]
    no_fencing: bool,
}

#[derive(Args)]
struct SimulateStackArgs {
    /// First seed (also read from TENURE_SIM_SEED, to replay one).
    #[arg(long, env = "TENURE_SIM_SEED", default_value_t = 0)]
    seed: u64,
    /// How many seeds, from the first.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// Simulated seconds of faults per seed.
    #[arg(long, default_value_t = 8)]
    fault_secs: u64,
    /// Seeds run at once, one per thread.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Print every seed's faults and figures, not only failures.
    #[arg(long)]
    verbose: bool,
    /// One JSON summary line per seed instead of text.
    #[arg(long)]
    json: bool,
    /// Switch the store's fencing check off (the checker must then report violations).
    #[arg(long)]
    no_fencing: bool,
    /// Only these fault kinds (comma separated); all of them by default.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
}

/// `ID=CLIENT_ADDR/PEER_ADDR`, as `--peers` and `ctl member add` write a member.
fn split_member(s: &str) -> Result<(NodeId, &str, &str), String> {
    let expected = || format!("expected id=CLIENT_ADDR/PEER_ADDR, got {s:?}");
    let (id, addrs) = s.split_once('=').ok_or_else(expected)?;
    let (client, peer) = addrs.split_once('/').ok_or_else(expected)?;
    let id: NodeId = id.trim().parse().map_err(|_| format!("bad node id in {s:?}"))?;
    Ok((id, client.trim(), peer.trim()))
}

fn parse_peer(s: &str) -> Result<(NodeId, Member), String> {
    let (id, client, peer) = split_member(s)?;
    for addr in [client, peer] {
        if !tenure::raft::dialable(addr) {
            return Err(format!(
                "bad address {addr:?} in {s:?} (expected host:port, the host an IP or a name)"
            ));
        }
    }
    Ok((id, Member { peer_addr: peer.to_string(), client_addr: client.to_string() }))
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Serve(_) => "info",
        // Hundreds of simulated clusters retry through every fault: only errors are news.
        Command::SimulateStack(_) => "error,openraft=off",
        _ => "warn,openraft=off",
    };
    let json = matches!(&cli.command, Command::Serve(args) if args.log_format == LogFormat::Json);
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr);
    match json {
        true => logs.json().init(),
        false => logs.init(),
    }
    match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Demo(args) => {
            demo::run(args.partitions, Duration::from_millis(args.lease_ttl_ms), &mut std::io::stdout()).await
        }
        Command::Ctl(args) => ctl::run(args).await,
        Command::Certs(args) => certs(args),
        Command::Nemesis(args) => nemesis(args).await,
        Command::Simulate(args) => simulate(args),
        Command::SimulateStack(args) => simulate_stack(args),
        Command::Work(args) => work(args).await,
        Command::Run(args) => run::run(args).await,
        Command::NemesisWorker(args) => {
            let args = tenure::nemesis::WorkerProcessArgs {
                coordinators: args.coordinators,
                name: args.name,
                store: args.store,
                dial_from: args.dial_from,
                epoch_ns: args.epoch_ns,
                write_interval: Duration::from_millis(args.write_every_ms),
                tls_dir: args.tls_dir,
                runner: args.runner,
            };
            tenure::nemesis::run_worker_process(args).await.map_err(|e| anyhow::anyhow!(e))
        }
    }
}

/// Writes a development CA and certificates as PEM files; an existing CA in the directory is
/// reused, so more certificates can be added later.
fn certs(args: CertsArgs) -> Result<()> {
    use tenure::certs::DevCa;
    use tenure::tls::Principal;
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let (ca_path, key_path) = (args.dir.join("ca.pem"), args.dir.join("ca-key.pem"));
    let ca = if ca_path.exists() && key_path.exists() {
        let read = |p: &std::path::Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        DevCa::from_pem(&read(&ca_path)?, &read(&key_path)?)?
    } else {
        let ca = DevCa::new("tenure development CA")?;
        write_private(&key_path, &ca.key_pem())?;
        std::fs::write(&ca_path, ca.ca_pem()).with_context(|| format!("writing {}", ca_path.display()))?;
        ca
    };
    let mut principals: Vec<(String, Principal)> =
        (1..=args.nodes).map(|id| (format!("node-{id}"), Principal::Node(id))).collect();
    principals.extend(args.workers.iter().map(|w| (format!("worker-{w}"), Principal::Worker(w.clone()))));
    principals
        .extend(args.operators.iter().map(|o| (format!("operator-{o}"), Principal::Operator(o.clone()))));
    for (file, principal) in principals {
        let issued = ca.issue(&principal, &args.hosts, Default::default())?;
        let cert = args.dir.join(format!("{file}.pem"));
        std::fs::write(&cert, &issued.cert_pem).with_context(|| format!("writing {}", cert.display()))?;
        write_private(&args.dir.join(format!("{file}-key.pem")), &issued.key_pem)?;
        println!("{} {principal}", cert.display());
    }
    Ok(())
}

/// Writes a private key readable by its owner only.
fn write_private(path: &std::path::Path, pem: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(pem.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// The address to listen on for `host:port` from --peers: the literal itself, or the host
/// name's first IPv4 address (its first address if it has none), resolved once at start. Peers
/// dial the name, resolved on every new connection; --listen and --listen-peers choose the
/// address outright.
fn resolve(addr: &str) -> Result<SocketAddr> {
    if let Ok(literal) = addr.parse() {
        return Ok(literal);
    }
    let found: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .with_context(|| format!("resolving {addr:?}"))?
        .collect();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or(found.first())
        .copied()
        .with_context(|| format!("{addr:?} resolves to no address"))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let mut peers = BTreeMap::new();
    for (id, addr) in args.peers {
        if peers.insert(id, addr).is_some() {
            bail!("node id {id} appears twice in --peers");
        }
    }
    let advertised =
        peers.get(&args.id).with_context(|| format!("node id {} is not in --peers", args.id))?.clone();
    let listen_clients = match args.listen {
        Some(a) => a,
        None => resolve(&advertised.client_addr).context("this node's client address in --peers")?,
    };
    let listen_peers = match args.listen_peers {
        Some(a) => a,
        None => resolve(&advertised.peer_addr).context("this node's peer address in --peers")?,
    };
    let mut config = NodeConfig::new(args.id, peers, args.data_dir);
    config.partition_count = args.partitions;
    config.lease_ttl = Duration::from_millis(args.lease_ttl_ms);
    config.max_revoking = args.max_revoking;
    config.placement.ring_seed = args.placement_ring_seed;
    config.election_timeout = Duration::from_millis(args.election_timeout_ms);
    config.raft_heartbeat_interval =
        args.raft_heartbeat_ms.map_or(config.election_timeout / 5, Duration::from_millis);
    config.snapshot_after_logs = args.snapshot_after_logs;
    config.dial_from = args.dial_from;
    config.keep_whole_log = args.keep_whole_log;
    config.max_streams = args.max_streams;
    config.max_streams_per_client = args.max_streams_per_client;
    config.join_limits = JoinLimits {
        max_sessions: args.max_sessions,
        joins_per_second: args.joins_per_second,
        join_burst: args.join_burst,
    };
    config.tls = match (&args.tls_ca, &args.tls_cert, &args.tls_key) {
        (Some(ca), Some(cert), Some(key)) => Some(tenure::tls::NodeTls::from_files(ca, cert, key)?),
        _ if args.insecure => {
            tracing::warn!("--insecure: peers and clients are served in plain text and unauthenticated; anyone who reaches the peer port can speak Raft");
            None
        }
        _ => bail!("give the node its TLS material (--tls-ca, --tls-cert, --tls-key; `tenure certs` makes a development set), or --insecure to run without"),
    };
    config.gauge_refresh = Duration::from_millis(args.gauge_refresh_ms);
    config.join_existing = args.join;
    config.validate()?;
    if let Some(addr) = args.metrics_listen {
        // Gauges the node stops setting (a worker whose session ended) leave the scrape;
        // counters and histograms are kept.
        let idle = config.gauge_refresh * 3;
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .idle_timeout(metrics_util::MetricKindMask::GAUGE, Some(idle))
            .with_http_listener(addr)
            .install()
            .context("starting the metrics endpoint")?;
    }
    let bind = |addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))
    };
    let listeners =
        server::Listeners { peers: bind(listen_peers).await?, clients: bind(listen_clients).await? };
    let status_page = match args.status_listen {
        Some(addr) => Some(bind(addr).await.context("binding the status page's address")?),
        None => None,
    };
    let node = server::start(config, listeners).await?;
    tracing::info!(clients = %node.addr, peers = %node.peer_addr, "serving");
    if let Some(listener) = status_page {
        let addr = listener.local_addr()?;
        let page = server::status_page::serve(node.node.clone(), listener, Default::default());
        tokio::spawn(async move {
            if let Err(e) = page.await {
                tracing::error!(error = %e, "the status page stopped");
            }
        });
        tracing::info!(%addr, "status page");
    }
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    let signal = tokio::select! {
        r = tokio::signal::ctrl_c() => { r.context("listening for SIGINT")?; "SIGINT" }
        _ = terminate.recv() => "SIGTERM",
    };
    // A planned stop: no new work, leadership handed over if this node leads, streams ended
    // with a status that sends workers elsewhere, all within a bound. A second signal stops at
    // once, as a crash would (every write is already synced).
    let bound = Duration::from_millis(args.shutdown_bound_ms);
    tracing::info!(signal, ?bound, "stopping gracefully");
    tokio::select! {
        successor = node.shutdown_gracefully(bound) => match successor {
            Some(id) => tracing::info!(successor = id, "stopped; node {id} leads"),
            None => tracing::info!("stopped"),
        },
        _ = tokio::signal::ctrl_c() => tracing::warn!("second signal: stopping at once"),
        _ = terminate.recv() => tracing::warn!("second signal: stopping at once"),
    }
    Ok(())
}

/// A deliberately naive application loop: it sleeps, writes, and only then looks at whether it
/// still owns the partition, as a program that was paused mid-loop would. The fence is what keeps
/// its late writes out.
async fn work(args: WorkArgs) -> Result<()> {
    use std::sync::Arc;
    use tenure::fence::{FenceError, PostgresFence};
    use tenure::worker::{Worker, WorkerConfig, WorkerEvent};
    let store = Arc::new(PostgresFence::connect(&args.postgres).await?);
    let mut config = WorkerConfig::new(args.coordinators, args.name);
    config.tls = args.tls.load()?;
    let mut worker = Worker::join(config).await?;
    let mut events = worker.events().context("a new worker's events")?;
    println!("JOINED session={}", worker.session());
    let every = Duration::from_millis(args.write_every_ms);
    while let Some(event) = events.recv().await {
        match event {
            WorkerEvent::Granted(h) => {
                println!("GRANTED {} token={}", h.partition(), h.token());
                let store = store.clone();
                tokio::spawn(async move {
                    let fenced = match h.acquire(store).await {
                        Ok(fenced) => fenced,
                        Err(e) => {
                            println!("REJECT {} token={} ({e})", h.partition(), h.token());
                            return;
                        }
                    };
                    for n in 1u64.. {
                        tokio::time::sleep(every).await;
                        match fenced.write(b"counter", format!("{}:{n}", h.token()).as_bytes()).await {
                            Ok(()) => println!("ACCEPT {} token={} n={n}", h.partition(), h.token()),
                            Err(FenceError::Stale { highest, .. }) => {
                                println!("REJECT {} token={} highest={highest}", h.partition(), h.token());
                                return;
                            }
                            Err(e) => println!("ERROR {} {e}", h.partition()),
                        }
                        if h.cancellation().is_cancelled() {
                            return;
                        }
                    }
                });
            }
            WorkerEvent::Revoking { partition, .. } => {
                let _ = worker.release(&[partition]).await;
            }
            WorkerEvent::Lost { partition, token, reason } => {
                println!("LOST {partition} token={token} {reason:?}")
            }
            WorkerEvent::Released { partition, token } => println!("RELEASED {partition} token={token}"),
            // Keep running: writers that were mid-loop still get to try (and be refused).
            WorkerEvent::SessionEnded { reason } => println!("ENDED {reason}"),
        }
    }
    Ok(())
}

async fn nemesis(args: NemesisArgs) -> Result<()> {
    use tenure::nemesis::{FaultKind, NemesisConfig};
    let mut faults = Vec::new();
    for name in &args.faults {
        faults.push(FaultKind::parse(name).with_context(|| format!("unknown fault kind {name:?}"))?);
    }
    let (mut operations, mut injected, mut violations, mut short_runs) = (0, 0, 0, 0);
    for seed in args.seed..args.seed + args.runs {
        let mut config = NemesisConfig::new(seed, Duration::from_secs(args.fault_secs));
        config.nodes = args.nodes;
        config.workers = args.workers;
        config.runners = args.runners;
        config.partition_count = args.partitions;
        config.lease_ttl = Duration::from_millis(args.lease_ttl_ms);
        config.fencing = !args.no_fencing;
        if !faults.is_empty() {
            config.faults = faults.clone();
        }
        if !args.in_process {
            config.serve_binary = Some(std::env::current_exe().context("locating this binary")?);
        }
        let dir = tempfile::tempdir()?;
        let outcome = tenure::nemesis::run(&config, dir.path()).await?;
        let h = &outcome.history;
        println!(
            "seed {seed}: {} faults {:?}; {} store decisions ({} accepted, {} refused), {} worker operations, \
             {} committed decisions; recovered {} ms after the last heal (bound {} ms)",
            h.faults.len(),
            outcome.faults,
            h.store.len(),
            outcome.writes_accepted,
            outcome.writes_refused,
            h.workers.len(),
            h.coordinator.len(),
            h.recovered_after_ms.map_or("never".into(), |ms| ms.to_string()),
            h.liveness_bound_ms,
        );
        print!("{}", outcome.report);
        println!("  {} refused writes from frozen workers", outcome.refused_from_frozen_workers());
        let shortfalls = outcome.shortfalls(config.fencing);
        for short in &shortfalls {
            println!("  SHORT {short}");
        }
        if let Some(out) = &args.history_dir {
            std::fs::create_dir_all(out)?;
            let path = out.join(format!("history-{seed}.json"));
            std::fs::write(&path, serde_json::to_vec(h)?)?;
            println!("  history written to {}", path.display());
        }
        operations += h.store.len() + h.workers.len();
        injected += h.faults.len();
        violations += outcome.report.violation_count();
        short_runs += usize::from(!shortfalls.is_empty());
    }
    println!(
        "{} runs: {operations} operations, {injected} faults, {violations} violations, {short_runs} runs that did too little",
        args.runs
    );
    if violations > 0 {
        bail!("{violations} violations");
    }
    if short_runs > 0 {
        bail!("{short_runs} runs did too little to count as evidence");
    }
    Ok(())
}

fn simulate_stack(args: SimulateStackArgs) -> Result<()> {
    use tenure::stack_simulation::{run, scratch_dir, SimConfig, SimFault, SimSummary};
    let mut faults = Vec::new();
    for name in &args.faults {
        match SimFault::ALL.iter().find(|f| f.name() == name) {
            Some(f) => faults.push(*f),
            None => bail!("unknown fault {name:?}; the kinds are {:?}", SimFault::ALL.map(SimFault::name)),
        }
    }
    // The arguments that run one seed alone: a child of a sweep, and the replay it prints.
    let one_seed = |seed: u64| {
        let mut one =
            ["simulate-stack", "--seed", &seed.to_string(), "--seeds", "1"].map(String::from).to_vec();
        one.extend(["--fault-secs".into(), args.fault_secs.to_string()]);
        if args.no_fencing {
            one.push("--no-fencing".into());
        }
        if !args.faults.is_empty() {
            one.extend(["--faults".into(), args.faults.join(",")]);
        }
        one
    };
    let replay = |seed: u64| format!("tenure {}", one_seed(seed).join(" "));

    if args.seeds == 1 {
        // One seed runs here, in this fresh process: that is what makes it replay exactly.
        let mut config = SimConfig::new(args.seed);
        config.fault_time = std::time::Duration::from_secs(args.fault_secs);
        config.fencing = !args.no_fencing;
        if !faults.is_empty() {
            config.faults = faults;
        }
        let dir = scratch_dir().context("scratch directory")?;
        // On a thread of its own: the simulation runs its own runtimes, which cannot start on
        // one of this program's runtime threads.
        let outcome = std::thread::scope(|s| s.spawn(|| run(&config, dir.path())).join())
            .map_err(|_| anyhow::anyhow!("seed {} panicked", args.seed))?
            .with_context(|| format!("seed {}", args.seed))?;
        let summary = outcome.summary(args.seed);
        if args.json {
            println!("{}", serde_json::to_string(&summary)?);
        } else {
            print_summary(&summary, true);
        }
        if !summary.passed {
            bail!("seed {} failed (replay: {})", args.seed, replay(args.seed));
        }
        return Ok(());
    }

    // Many seeds: each in a child process of its own, `threads` at a time.
    let started = std::time::Instant::now();
    let exe = std::env::current_exe().context("finding this program")?;
    let next = std::sync::atomic::AtomicU64::new(args.seed);
    let end = args.seed + args.seeds;
    let summaries = std::sync::Mutex::new(Vec::new());
    let failed = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..args.threads.max(1) {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if seed >= end {
                    return;
                }
                let output = std::process::Command::new(&exe)
                    .args(one_seed(seed))
                    .arg("--json")
                    .stderr(std::process::Stdio::null())
                    .output();
                let summary = output.ok().and_then(|o| {
                    let line = String::from_utf8_lossy(&o.stdout).lines().last()?.to_string();
                    serde_json::from_str::<SimSummary>(&line).ok()
                });
                match summary {
                    Some(summary) => {
                        if args.json {
                            println!("{}", serde_json::to_string(&summary).expect("a summary serializes"));
                        } else if !summary.passed || args.verbose {
                            print_summary(&summary, args.verbose);
                        }
                        if !summary.passed {
                            println!("  replay: {}", replay(seed));
                            failed.lock().expect("failed").push(seed);
                        }
                        summaries.lock().expect("summaries").push(summary);
                    }
                    None => {
                        println!("seed {seed} could not run (replay: {})", replay(seed));
                        failed.lock().expect("failed").push(seed);
                    }
                }
            });
        }
    });
    let summaries = summaries.into_inner().expect("summaries");
    let mut failed = failed.into_inner().expect("failed");
    failed.sort();
    let simulated_s: u64 = summaries.iter().map(|s| s.simulated_ms).sum::<u64>() / 1000;
    let fault_count: usize = summaries.iter().map(|s| s.faults.len()).sum();
    let operations: usize = summaries.iter().map(|s| s.worker_operations).sum();
    if !args.json {
        println!(
            "{} seeds in {:.1} s ({simulated_s} s simulated): {fault_count} faults, {operations} worker \
             operations, {} failing seeds {:?}",
            args.seeds,
            started.elapsed().as_secs_f64(),
            failed.len(),
            failed
        );
    }
    if !failed.is_empty() {
        bail!("{} seeds failed", failed.len());
    }
    Ok(())
}

fn print_summary(s: &tenure::stack_simulation::SimSummary, details: bool) {
    let verdict = if s.passed { "passed" } else { "FAILED" };
    println!(
        "seed {} {verdict}: {:.1} s simulated, faults {:?}; {} writes accepted, {} refused; recovered {:?} ms \
         after the last heal; history fingerprint {}",
        s.seed,
        s.simulated_ms as f64 / 1000.0,
        s.faults,
        s.writes_accepted,
        s.writes_refused,
        s.recovered_after_ms,
        s.fingerprint
    );
    if details || !s.passed {
        print!("{}", s.report);
    }
}

fn simulate(args: SimulateArgs) -> Result<()> {
    use tenure::simulation::{simulate, SimConfig};
    let started = std::time::Instant::now();
    let (mut faults, mut decisions, mut failed) = (0, 0, Vec::new());
    for seed in args.seed..args.seed + args.seeds {
        let mut config = SimConfig::new(seed);
        config.fault_ms = args.fault_secs * 1000;
        config.slow = args.slow;
        config.fencing = !args.no_fencing;
        let outcome = simulate(&config);
        faults += outcome.history.faults.len();
        decisions += outcome.history.store.len() + outcome.history.coordinator.len();
        if !outcome.report.passed() {
            println!(
                "seed {seed} FAILED (replay: tenure simulate --seed {seed} --seeds 1):\n{}",
                outcome.report
            );
            failed.push(seed);
        }
    }
    println!(
        "{} seeds in {:.1} s: {faults} faults, {decisions} recorded decisions, {} failing seeds {:?}",
        args.seeds,
        started.elapsed().as_secs_f64(),
        failed.len(),
        failed
    );
    if !failed.is_empty() {
        bail!("{} seeds violated invariants", failed.len());
    }
    Ok(())
}
