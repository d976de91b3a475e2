//! Coordinator nodes as real `tenure serve` processes, each behind a [`FaultProxy`].
//!
//! This is the harness's way to inject the faults that only an operating system can: `kill -9`
//! (the process dies between any two instructions, with whatever RocksDB had not synced) and
//! SIGSTOP/SIGCONT (the process, leader included, freezes with its timers and sockets and wakes
//! up believing no time passed). Node `id` listens on, and dials its peers from,
//! [`node_ip`]`(id)`, and every peer and worker reaches it through its proxy, so links can be
//! cut one by one as with the in-process cluster.
//!
//! No process outlives the harness: children are killed when the cluster is dropped, however
//! the run ends. Each node's standard error goes to `node-<id>.log` beside its data.

use super::FaultProxy;
use crate::ids::NodeId;
use crate::local_cluster::node_ip;
use crate::proto;
use crate::worker::Client;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How the `tenure serve` processes are configured.
#[derive(Clone, Debug)]
pub struct ServeSettings {
    /// The `tenure` binary to run.
    pub binary: PathBuf,
    pub partition_count: u32,
    pub lease_ttl: Duration,
    pub election_timeout: Duration,
    pub snapshot_after_logs: u64,
    /// Run the nodes with `--insecure` (plain text, nobody authenticated) instead of with the
    /// run's certificates; for benchmarks against baselines that run without TLS.
    pub insecure: bool,
    /// Serve each node's status page (`--status-listen`) on its own address; see
    /// [`ProcessCluster::status_page`].
    pub status_pages: bool,
}

/// Why a process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{what}: {source}")]
    Certificate { what: String, source: crate::certs::CertError },
}

fn cert_err(what: impl Into<String>) -> impl FnOnce(crate::certs::CertError) -> ProcessError {
    let what = what.into();
    move |source| ProcessError::Certificate { what, source }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ProcessError {
    let what = what.into();
    move |source| ProcessError::Io { what, source }
}

/// Makes the child die with SIGKILL when the thread that started it ends, however that happens
/// (`kill_on_drop` covers only a parent that unwinds normally; not one that is killed).
pub(crate) fn die_with_parent(command: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2),
    // which is async-signal-safe and touches no memory of ours.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Sends `signal` to a child that is still running; `false` if it could not.
pub(crate) fn send_signal(child: &Child, signal: libc::c_int) -> bool {
    let Some(pid) = child.id() else { return false };
    // SAFETY: kill(2) only sends a signal to our own child, which the caller holds and has not
    // reaped, so its pid cannot have been reused by another process.
    unsafe { libc::kill(pid as libc::pid_t, signal) == 0 }
}

/// Nodes `1..=n` as child processes.
pub struct ProcessCluster {
    settings: ServeSettings,
    dir: PathBuf,
    children: BTreeMap<NodeId, Option<Child>>,
    /// Where each node listens (its own loopback address, fixed ports): peers, clients.
    listen: BTreeMap<NodeId, (SocketAddr, SocketAddr)>,
    /// Where each node serves its status page, when the settings ask for one.
    status_pages: BTreeMap<NodeId, SocketAddr>,
    /// What peers and workers dial: the proxies (peers, clients).
    addrs: BTreeMap<NodeId, (SocketAddr, SocketAddr)>,
    proxies: BTreeMap<NodeId, FaultProxy>,
    /// Nodes restarted with another lease TTL flag than the cluster's.
    ttl_flags: BTreeMap<NodeId, Duration>,
    /// `--placement-ring-seed` of nodes upgraded to another version of the placement rules.
    ring_seeds: BTreeMap<NodeId, u64>,
    /// The run's CA (boxed: large, rarely touched) and the operator identity the harness
    /// asks the nodes for their status with.
    ca: Box<crate::certs::DevCa>,
    operator: Option<crate::worker::ClientTls>,
}

impl ProcessCluster {
    /// Starts `n` `tenure serve` processes with their data under `dir`.
    pub async fn start(n: u64, dir: &Path, settings: ServeSettings) -> Result<ProcessCluster, ProcessError> {
        // A throw-away CA for the run; each node gets its certificate as files, as an operator
        // would give them.
        let ca = crate::certs::DevCa::new("tenure nemesis CA").map_err(cert_err("making the run's CA"))?;
        let operator = match settings.insecure {
            true => None,
            false => Some(
                ca.client_tls(&crate::tls::Principal::Operator("nemesis".into()))
                    .map_err(cert_err("issuing the operator's certificate"))?,
            ),
        };
        let mut cluster = ProcessCluster {
            settings,
            dir: dir.to_path_buf(),
            children: BTreeMap::new(),
            listen: BTreeMap::new(),
            status_pages: BTreeMap::new(),
            addrs: BTreeMap::new(),
            proxies: BTreeMap::new(),
            ttl_flags: BTreeMap::new(),
            ring_seeds: BTreeMap::new(),
            ca: Box::new(ca),
            operator,
        };
        for id in 1..=n {
            // Ports free on the node's own address; the process binds them a moment later.
            let free_port = || -> Result<SocketAddr, ProcessError> {
                let probe = std::net::TcpListener::bind((node_ip(id), 0)).map_err(io("choosing a port"))?;
                probe.local_addr().map_err(io("choosing a port"))
            };
            let listen = (free_port()?, free_port()?);
            if cluster.settings.status_pages {
                cluster.status_pages.insert(id, free_port()?);
            }
            let front = (Ipv4Addr::LOCALHOST, 0).into();
            let mut proxy = FaultProxy::start(front, listen.0).await.map_err(io("starting a proxy"))?;
            let client_addr = proxy.forward_also(front, listen.1).await.map_err(io("starting a proxy"))?;
            cluster.addrs.insert(id, (proxy.addr(), client_addr));
            cluster.proxies.insert(id, proxy);
            cluster.listen.insert(id, listen);
        }
        let ca = &cluster.ca;
        std::fs::write(dir.join("ca.pem"), ca.ca_pem()).map_err(io("writing the CA"))?;
        for id in 1..=n {
            let hosts = ["127.0.0.1".to_string(), node_ip(id).to_string()];
            let issued = ca
                .issue(&crate::tls::Principal::Node(id), &hosts, Default::default())
                .map_err(cert_err("issuing a node certificate"))?;
            std::fs::write(dir.join(format!("node-{id}.pem")), issued.cert_pem)
                .map_err(io("writing a certificate"))?;
            std::fs::write(dir.join(format!("node-{id}-key.pem")), issued.key_pem)
                .map_err(io("writing a key"))?;
        }
        for id in 1..=n {
            cluster.spawn(id)?;
        }
        Ok(cluster)
    }

    fn spawn(&mut self, id: NodeId) -> Result<(), ProcessError> {
        let s = &self.settings;
        let peers: Vec<String> =
            self.addrs.iter().map(|(id, (peer, client))| format!("{id}={client}/{peer}")).collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("node-{id}.log")))
            .map_err(io("opening the node's log"))?;
        let mut command = Command::new(&s.binary);
        command
            .arg("serve")
            .args(["--id", &id.to_string(), "--peers", &peers.join(",")])
            .args(["--listen", &self.listen[&id].1.to_string()])
            .args(["--listen-peers", &self.listen[&id].0.to_string()])
            .arg("--data-dir")
            .arg(self.dir.join(format!("node-{id}")))
            .args(["--partitions", &s.partition_count.to_string()])
            .args([
                "--lease-ttl-ms",
                &self.ttl_flags.get(&id).unwrap_or(&s.lease_ttl).as_millis().to_string(),
            ])
            .args(["--election-timeout-ms", &s.election_timeout.as_millis().to_string()])
            .args(["--raft-heartbeat-ms", &(s.election_timeout / 6).as_millis().to_string()])
            .args(["--snapshot-after-logs", &s.snapshot_after_logs.to_string()])
            .args(["--dial-from", &node_ip(id).to_string()])
            .arg("--keep-whole-log")
            .args(["--placement-ring-seed", &self.rules(id).to_string()])
            .args(self.tls_args(id))
            .args(self.status_pages.get(&id).map(|a| format!("--status-listen={a}")))
            .env("RUST_LOG", "info,openraft=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        die_with_parent(&mut command);
        let child = command.spawn().map_err(io(format!("starting {}", s.binary.display())))?;
        self.children.insert(id, Some(child));
        Ok(())
    }

    /// The run's CA, to issue workers their certificates; `None` when the nodes run insecure.
    pub fn ca(&self) -> Option<&crate::certs::DevCa> {
        (!self.settings.insecure).then_some(&*self.ca)
    }

    /// What a worker named `name` joins this cluster with (through the proxies), with a
    /// certificate in its name unless the nodes run insecure.
    pub fn worker_config(&self, name: &str) -> crate::worker::WorkerConfig {
        let mut config = crate::worker::WorkerConfig::new(self.addrs(), name);
        config.tls = self.ca().map(|ca| {
            ca.client_tls(&crate::tls::Principal::Worker(name.to_string())).expect("the run's CA issues")
        });
        config
    }

    /// Node `id`'s TLS flags: its certificate files, or `--insecure`.
    fn tls_args(&self, id: NodeId) -> Vec<std::ffi::OsString> {
        if self.settings.insecure {
            return vec!["--insecure".into()];
        }
        vec![
            "--tls-ca".into(),
            self.dir.join("ca.pem").into(),
            "--tls-cert".into(),
            self.dir.join(format!("node-{id}.pem")).into(),
            "--tls-key".into(),
            self.dir.join(format!("node-{id}-key.pem")).into(),
        ]
    }

    pub fn ids(&self) -> Vec<NodeId> {
        self.addrs.keys().copied().collect()
    }

    /// Every node's client address (its proxy), for workers and operators.
    pub fn addrs(&self) -> Vec<String> {
        self.addrs.values().map(|(_, client)| client.to_string()).collect()
    }

    /// Where node `id` serves its status page, if it serves one (directly, not through its
    /// proxy).
    pub fn status_page(&self, id: NodeId) -> Option<SocketAddr> {
        self.status_pages.get(&id).copied()
    }

    pub fn proxy(&self, id: NodeId) -> Option<&FaultProxy> {
        self.proxies.get(&id)
    }

    /// The process id of node `id`, while it runs.
    pub fn pid(&self, id: NodeId) -> Option<u32> {
        self.children.get(&id).and_then(|c| c.as_ref()).and_then(Child::id)
    }

    /// Where node `id` keeps its RocksDB data.
    pub fn data_dir(&self, id: NodeId) -> PathBuf {
        self.dir.join(format!("node-{id}"))
    }

    /// Asks node `id` directly (not through its proxy) for its status.
    async fn status_of(&self, id: NodeId) -> Option<proto::StatusResponse> {
        let client = Client::new(vec![self.listen[&id].1.to_string()]).ok()?.with_tls(self.operator.clone());
        tokio::time::timeout(Duration::from_millis(500), client.status()).await.ok()?.ok()
    }

    /// The node that a majority of the cluster names as leader, when it also says so itself. A
    /// leader that was frozen and has just woken still names itself until it hears of the newer
    /// term, so one node's word is not enough.
    pub async fn leader(&self) -> Option<NodeId> {
        let mut named: BTreeMap<NodeId, usize> = BTreeMap::new();
        for id in self.ids() {
            if !self.children.get(&id).is_some_and(Option::is_some) {
                continue;
            }
            if let Some(status) = self.status_of(id).await.filter(|s| s.leader_id != 0) {
                *named.entry(status.leader_id).or_default() += 1;
            }
        }
        let majority = self.addrs.len() / 2 + 1;
        let (&leader, _) = named.iter().find(|(_, votes)| **votes >= majority)?;
        self.status_of(leader).await.is_some_and(|s| s.leader_id == leader).then_some(leader)
    }

    /// Like [`ProcessCluster::leader`], without asking node `gone` (killed or frozen, whose
    /// status would only time out): a node that a majority of the whole cluster names among the
    /// others, and that says so itself.
    pub async fn leader_other_than(&self, gone: NodeId) -> Option<NodeId> {
        let mut named: BTreeMap<NodeId, usize> = BTreeMap::new();
        for id in self.ids().into_iter().filter(|id| *id != gone) {
            if let Some(status) = self.status_of(id).await.filter(|s| s.leader_id != 0) {
                *named.entry(status.leader_id).or_default() += 1;
            }
        }
        let majority = self.addrs.len() / 2 + 1;
        let (&leader, _) = named.iter().find(|(id, votes)| **id != gone && **votes >= majority)?;
        self.status_of(leader).await.is_some_and(|s| s.leader_id == leader).then_some(leader)
    }

    pub async fn wait_for_leader(&self, timeout: Duration) -> Option<NodeId> {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if let Some(id) = self.leader().await {
                return Some(id);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// The table as the leader reports it.
    pub async fn status(&self) -> Option<proto::StatusResponse> {
        let leader = self.leader().await?;
        self.status_of(leader).await
    }

    /// `kill -9`: the process dies at once, mid-write if it was writing.
    pub async fn kill(&mut self, id: NodeId) {
        if let Some(mut child) = self.children.get_mut(&id).and_then(Option::take) {
            let _ = child.kill().await; // SIGKILL, then reaped
        }
    }

    /// SIGTERM, as an operator's planned restart sends it: the node hands over if it leads
    /// and exits. Whether it exited with success within `bound`; if not, it is killed.
    pub async fn terminate(&mut self, id: NodeId, bound: Duration) -> bool {
        let Some(mut child) = self.children.get_mut(&id).and_then(Option::take) else { return false };
        if !send_signal(&child, libc::SIGTERM) {
            let _ = child.kill().await;
            return false;
        }
        match tokio::time::timeout(bound, child.wait()).await {
            Ok(Ok(status)) => status.success(),
            _ => {
                let _ = child.kill().await;
                false
            }
        }
    }

    /// A client of the whole cluster with the operator's certificate.
    pub fn client(&self) -> Client {
        let addrs = self.listen.values().map(|(_, client)| client.to_string()).collect();
        Client::new(addrs).expect("addresses of this cluster parse").with_tls(self.operator.clone())
    }

    /// Starts a killed node again on the same port and data.
    pub fn restart(&mut self, id: NodeId) -> Result<(), ProcessError> {
        self.spawn(id)
    }

    /// Starts a killed node again with `lease_ttl` on its command line (the cluster's TTL,
    /// fixed at creation, must win).
    pub fn restart_with_ttl(&mut self, id: NodeId, lease_ttl: Duration) -> Result<(), ProcessError> {
        self.ttl_flags.insert(id, lease_ttl);
        self.spawn(id)
    }

    /// The version of the placement rules node `id` runs.
    pub fn rules(&self, id: NodeId) -> u64 {
        self.ring_seeds.get(&id).copied().unwrap_or(0)
    }

    /// Starts a killed node again running version `ring_seed` of the placement rules.
    pub fn restart_with_rules(&mut self, id: NodeId, ring_seed: u64) -> Result<(), ProcessError> {
        self.ring_seeds.insert(id, ring_seed);
        self.spawn(id)
    }

    /// SIGSTOP (`pause = true`) or SIGCONT: the process freezes, timers and all, or wakes up.
    pub fn signal_pause(&self, id: NodeId, pause: bool) {
        let Some(child) = self.children.get(&id).and_then(|c| c.as_ref()) else { return };
        let signal = if pause { libc::SIGSTOP } else { libc::SIGCONT };
        if !send_signal(child, signal) {
            tracing::warn!(node = id, pause, "could not signal the node process");
        }
    }

    /// Kills every process and waits for them.
    pub async fn shutdown(&mut self) {
        for id in self.ids() {
            self.kill(id).await;
        }
    }
}
