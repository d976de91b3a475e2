//! A coordinator cluster of real nodes in one process, each on its own loopback port with its
//! own RocksDB directory. Used by `tenure demo`, the cluster tests, examples and benchmarks.

use crate::certs::DevCa;
use crate::fault_proxy::FaultProxy;
use crate::ids::NodeId;
use crate::proto;
use crate::raft::Member;
use crate::server::{self, NodeConfig, RunningNode};
use crate::tls::Principal;
use crate::worker::{Client, ClientError, ClientTls, WorkerConfig};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// Nodes `1..=n` on `127.0.0.1`, data under one directory.
pub struct LocalCluster {
    nodes: BTreeMap<NodeId, Option<RunningNode>>,
    configs: BTreeMap<NodeId, NodeConfig>,
    /// The addresses every node and worker dials: the nodes' own, or their proxies'.
    members: BTreeMap<NodeId, Member>,
    /// Where each node listens (peers, clients); differs from `members` behind proxies.
    listen: BTreeMap<NodeId, (SocketAddr, SocketAddr)>,
    proxies: BTreeMap<NodeId, FaultProxy>,
    /// The cluster's throw-away CA: every node's peer side runs mutual TLS with its
    /// certificates. Boxed: it is large and rarely touched.
    ca: Box<DevCa>,
    /// The operator identity [`LocalCluster::client`] and [`LocalCluster::status`] connect
    /// with: made once, since tests poll the status many times.
    operator: Option<ClientTls>,
}

/// The loopback address node `id` listens and dials from when it runs behind a proxy.
pub fn node_ip(id: NodeId) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 1, id as u8))
}

impl LocalCluster {
    /// Starts `n` nodes; `tune` adjusts each node's configuration (TTL, partitions, timeouts).
    pub async fn start(
        n: u64,
        dir: &Path,
        tune: impl Fn(&mut NodeConfig),
    ) -> Result<LocalCluster, server::NodeError> {
        Self::launch(n, dir, tune, false).await
    }

    /// Starts `n` nodes, each behind a [`FaultProxy`] that every peer and worker dials; node `id`
    /// listens on, and dials from, [`node_ip`]`(id)`, so the proxies can cut links one by one.
    pub async fn start_behind_proxies(
        n: u64,
        dir: &Path,
        tune: impl Fn(&mut NodeConfig),
    ) -> Result<LocalCluster, server::NodeError> {
        Self::launch(n, dir, tune, true).await
    }

    async fn launch(
        n: u64,
        dir: &Path,
        tune: impl Fn(&mut NodeConfig),
        proxied: bool,
    ) -> Result<LocalCluster, server::NodeError> {
        let config_err = |e: std::io::Error| server::NodeError::Config(e.to_string());
        let mut listeners = BTreeMap::new();
        let mut cluster = LocalCluster {
            nodes: BTreeMap::new(),
            configs: BTreeMap::new(),
            members: BTreeMap::new(),
            listen: BTreeMap::new(),
            proxies: BTreeMap::new(),
            ca: Box::new(
                DevCa::new("tenure local cluster CA")
                    .map_err(|e| server::NodeError::Config(e.to_string()))?,
            ),
            operator: None,
        };
        for id in 1..=n {
            let ip = if proxied { node_ip(id) } else { IpAddr::V4(Ipv4Addr::LOCALHOST) };
            let peers = TcpListener::bind((ip, 0)).await.map_err(config_err)?;
            let clients = TcpListener::bind((ip, 0)).await.map_err(config_err)?;
            let listen = (peers.local_addr().map_err(config_err)?, clients.local_addr().map_err(config_err)?);
            let (peer_addr, client_addr) = if proxied {
                let front = (Ipv4Addr::LOCALHOST, 0).into();
                let mut proxy = FaultProxy::start(front, listen.0).await.map_err(config_err)?;
                let client_addr = proxy.forward_also(front, listen.1).await.map_err(config_err)?;
                let peer_addr = proxy.addr();
                cluster.proxies.insert(id, proxy);
                (peer_addr, client_addr)
            } else {
                listen
            };
            let member = Member { peer_addr: peer_addr.to_string(), client_addr: client_addr.to_string() };
            cluster.members.insert(id, member);
            cluster.listen.insert(id, listen);
            listeners.insert(id, server::Listeners { peers, clients });
        }
        for (id, listeners) in listeners {
            let mut config = NodeConfig::new(id, cluster.members.clone(), node_dir(dir, id));
            if proxied {
                config.dial_from = Some(node_ip(id));
            }
            let hosts = ["127.0.0.1".to_string(), node_ip(id).to_string(), "localhost".to_string()];
            let tls =
                cluster.ca.node_tls(id, &hosts).map_err(|e| server::NodeError::Config(e.to_string()))?;
            config.tls = Some(tls);
            tune(&mut config);
            let running = server::start(config.clone(), listeners).await?;
            cluster.configs.insert(id, config);
            cluster.nodes.insert(id, Some(running));
        }
        // A cluster `tune` made insecure takes plaintext clients.
        if cluster.secure() {
            let operator = cluster.ca.client_tls(&Principal::Operator("local-cluster".into()));
            cluster.operator = Some(operator.map_err(|e| server::NodeError::Config(e.to_string()))?);
        }
        Ok(cluster)
    }

    /// The CA the nodes' certificates come from (to issue more: a worker's, a stranger's).
    pub fn ca(&self) -> &DevCa {
        &self.ca
    }

    /// Whether the nodes run TLS (unless `tune` turned it off).
    pub fn secure(&self) -> bool {
        self.configs.values().any(|c| c.tls.is_some())
    }

    /// A certificate of this cluster's CA for `principal`; `None` on an insecure cluster.
    pub fn client_tls(&self, principal: &Principal) -> Option<ClientTls> {
        self.secure().then(|| self.ca.client_tls(principal).expect("the local CA issues certificates"))
    }

    /// What a worker named `name` joins this cluster with: every node's address and, on a
    /// TLS cluster, a certificate in its name.
    pub fn worker_config(&self, name: &str) -> WorkerConfig {
        let mut config = WorkerConfig::new(self.addrs(), name);
        config.tls = self.client_tls(&Principal::Worker(name.to_string()));
        config
    }

    /// An operator's client for every node of the cluster.
    pub fn client(&self) -> Client {
        self.client_to(self.addrs())
    }

    /// An operator's client for the given addresses (a node of this cluster, its proxy).
    pub fn client_to(&self, addrs: Vec<String>) -> Client {
        Client::new(addrs).expect("addresses of this cluster parse").with_tls(self.operator.clone())
    }

    /// The proxy in front of node `id`, when the cluster runs behind proxies.
    pub fn proxy(&self, id: NodeId) -> Option<&FaultProxy> {
        self.proxies.get(&id)
    }

    /// Every node's id.
    pub fn ids(&self) -> Vec<NodeId> {
        self.members.keys().copied().collect()
    }

    /// `host:port` of every node's client listener, for workers and operators.
    pub fn addrs(&self) -> Vec<String> {
        self.members.values().map(|m| m.client_addr.clone()).collect()
    }

    /// Node `id`'s client listener (or its proxy).
    pub fn addr(&self, id: NodeId) -> SocketAddr {
        self.members[&id].client_addr.parse().expect("a socket address")
    }

    /// Node `id`'s peer listener (or its proxy): where Raft traffic goes.
    pub fn peer_addr(&self, id: NodeId) -> SocketAddr {
        self.members[&id].peer_addr.parse().expect("a socket address")
    }

    /// Where node `id` keeps its RocksDB data.
    pub fn data_dir(&self, id: NodeId) -> Option<PathBuf> {
        self.configs.get(&id).map(|c| c.data_dir.clone())
    }

    pub fn node(&self, id: NodeId) -> Option<&RunningNode> {
        self.nodes.get(&id).and_then(|n| n.as_ref())
    }

    pub fn running(&self) -> impl Iterator<Item = &RunningNode> {
        self.nodes.values().flatten()
    }

    /// The node every running node agrees leads, once there is one.
    pub fn leader(&self) -> Option<NodeId> {
        let mut seen = None;
        for node in self.running() {
            let m = node.raft().metrics().borrow().clone();
            if m.state == openraft::ServerState::Leader && m.current_leader == Some(node.node.config.id) {
                seen = Some(node.node.config.id);
            }
        }
        seen
    }

    /// Waits for a leader, up to `timeout`.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Option<NodeId> {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if let Some(id) = self.leader() {
                return Some(id);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Stops a node (as a crash would, minus the unflushed writes: every write is synced).
    pub async fn stop(&mut self, id: NodeId) {
        if let Some(node) = self.nodes.get_mut(&id).and_then(Option::take) {
            node.shutdown().await;
        }
    }

    /// Takes node `id` out of the cluster still running, for the caller to stop (on another
    /// task, say, so that what follows is timed from the moment the stop began rather than
    /// from its end); [`LocalCluster::restart`] starts it again afterwards.
    pub fn take(&mut self, id: NodeId) -> Option<server::RunningNode> {
        self.nodes.get_mut(&id).and_then(Option::take)
    }

    /// Stops a node as SIGTERM does: if it leads, it hands leadership over first (see
    /// [`server::RunningNode::shutdown_gracefully`]). Returns the node that took over, if any.
    pub async fn stop_gracefully(&mut self, id: NodeId, bound: Duration) -> Option<NodeId> {
        let node = self.nodes.get_mut(&id).and_then(Option::take)?;
        node.shutdown_gracefully(bound).await
    }

    /// Restarts a stopped node on the same address and data directory.
    pub async fn restart(&mut self, id: NodeId) -> Result<(), server::NodeError> {
        // In one process, the stopped node's last background work (a snapshot being built, a
        // stream being torn down) can hold its database a moment longer than `stop`; a process
        // that died would have released it. Bounded: ten seconds.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let (peers, clients) = self.listen[&id];
            let listeners =
                server::Listeners { peers: bind_again(peers).await?, clients: bind_again(clients).await? };
            match server::start(self.configs[&id].clone(), listeners).await {
                Ok(running) => {
                    self.nodes.insert(id, Some(running));
                    return Ok(());
                }
                Err(server::NodeError::Storage(e)) if e.contains("lock") && Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Restarts a stopped node with its configuration changed by `tune`, as an operator who
    /// restarts it with other flags would.
    /// The settings node `id` runs with (as last started).
    pub fn config(&self, id: NodeId) -> Option<&NodeConfig> {
        self.configs.get(&id)
    }

    pub async fn restart_with(
        &mut self,
        id: NodeId,
        tune: impl FnOnce(&mut NodeConfig),
    ) -> Result<(), server::NodeError> {
        if let Some(config) = self.configs.get_mut(&id) {
            tune(config);
        }
        self.restart(id).await
    }

    pub async fn shutdown(mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }

    /// The cluster status as the leader (or, without one, the first node) reports it.
    pub async fn status(&self) -> Result<proto::StatusResponse, ClientError> {
        let addr = match self.leader() {
            Some(id) => self.addr(id).to_string(),
            None => self.addrs()[0].clone(),
        };
        self.client_to(vec![addr]).status().await
    }
}

fn node_dir(dir: &Path, id: NodeId) -> PathBuf {
    dir.join(format!("node-{id}"))
}

async fn bind_again(addr: SocketAddr) -> Result<TcpListener, server::NodeError> {
    // The old listener's port can take a moment to be free again after shutdown.
    let mut last = None;
    for _ in 0..50 {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(server::NodeError::Config(format!("cannot bind {addr} again: {:?}", last)))
}

/// Every partition owned and not revoking, by exactly `sessions` live sessions, within one.
pub fn is_settled(status: &proto::StatusResponse, sessions: usize) -> bool {
    let live: Vec<_> = status.sessions.iter().filter(|s| !s.leaving).collect();
    if live.len() != sessions || status.partitions.is_empty() {
        return false;
    }
    if status.partitions.iter().any(|p| p.owner == 0 || p.revoking) {
        return false;
    }
    let counts: Vec<u32> = live.iter().map(|s| s.owned).collect();
    let (min, max) = (counts.iter().min().copied().unwrap_or(0), counts.iter().max().copied().unwrap_or(0));
    max - min <= 1 && status.sessions.len() == sessions
}
