//! Raft RPCs over gRPC. Payloads are openraft's own request and response types, serialized with
//! serde; the receiving node's answer is a `Result` so that openraft's remote errors arrive as
//! remote errors and transport failures as unreachable.

use crate::ids::NodeId;
use crate::proto::peer::raft_transport_client::RaftTransportClient;
use crate::proto::peer::RaftPayload;
use crate::raft::{Member, TypeConfig};
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tenure_worker::transport::Dialer;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// Largest Raft message a node sends or accepts.
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// How often a peer connection is pinged, and how long an answer may take before the
/// connection is given up.
const PEER_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
const PEER_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(1);

/// Creates clients for peers. openraft asks for a new client per replication stream and, in
/// 0.9, for every leadership check (`ensure_linearizable`), so the channels are kept here and
/// shared: a leadership check then costs one round trip on an open HTTP/2 connection instead of
/// a new connection. A tonic channel reconnects by itself after a peer restarts.
#[derive(Clone, Default)]
pub struct Network {
    /// Source address of connections to peers, when the node is told to dial from one.
    pub dial_from: Option<std::net::IpAddr>,
    dialer: Dialer,
    /// Set when peers are dialled over TLS (see [`crate::tls::NodeTls::peer_client`]).
    tls: Option<ClientTlsConfig>,
    /// Ordered, not hashed: dropping the cache closes the connections in its order, and the
    /// whole-stack simulation replays a seed only if that order is the same in every process.
    channels: Arc<Mutex<BTreeMap<String, Channel>>>,
    /// How long the leader waits before trying an unreachable peer again; `None` keeps
    /// openraft's 500 ms. A leader should find a peer that woke (a deposed leader back from a
    /// freeze) within a heartbeat or two, before that peer's own election timer runs out.
    retry_every: Option<Duration>,
}

impl Network {
    pub fn new(dial_from: Option<std::net::IpAddr>, dialer: Dialer, tls: Option<ClientTlsConfig>) -> Network {
        Network { dial_from, dialer, tls, channels: Arc::default(), retry_every: None }
    }

    /// Tries an unreachable peer again every `every` instead of every 500 ms.
    pub fn retrying_every(self, every: Duration) -> Network {
        Network { retry_every: Some(every), ..self }
    }

    /// A client of the peer service at `addr`, on the shared connection to it.
    pub(crate) fn transport(&self, addr: &str) -> Result<RaftTransportClient<Channel>, String> {
        self.channel(addr).map(RaftTransportClient::new)
    }

    fn channel(&self, addr: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().expect("channel cache poisoned");
        if let Some(channel) = channels.get(addr) {
            return Ok(channel.clone());
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| format!("bad address {addr:?}: {e}"))?;
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone()).map_err(|e| format!("TLS for {addr:?}: {e}"))?;
        }
        let endpoint = endpoint
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            // A connection that stops carrying anything (its peer's host died without a reset,
            // or a partition lost data in flight) is noticed by an unanswered ping and replaced
            // on the next call. Without this the cached channel would keep every later call on
            // the dead connection, and a leader could stay cut off after the network healed.
            .http2_keep_alive_interval(PEER_KEEPALIVE_INTERVAL)
            .keep_alive_timeout(PEER_KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .local_address(self.dial_from);
        let channel = self.dialer.channel(endpoint);
        channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }
}

pub struct PeerClient {
    target: NodeId,
    client: Result<RaftTransportClient<Channel>, String>,
    retry_every: Option<Duration>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Member) -> PeerClient {
        let client = self
            .channel(&node.peer_addr)
            .map(|channel| {
                RaftTransportClient::new(channel)
                    .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES)
            })
            .map_err(|e| format!("node {target}: {e}"));
        PeerClient { target, client, retry_every: self.retry_every }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TransportError(String);

impl PeerClient {
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: &'static str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, Member, E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let client = self
            .client
            .as_mut()
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&TransportError(e.clone()))))?;
        let data = crate::codec::encode(req);
        let mut request = tonic::Request::new(RaftPayload { data });
        request.set_timeout(option.hard_ttl());
        let reply = match rpc {
            "append" => client.append_entries(request).await,
            "vote" => client.vote(request).await,
            _ => client.install_snapshot(request).await,
        };
        let reply = reply.map_err(|status| {
            let err = TransportError(format!("{rpc} to node {}: {}", self.target, status.message()));
            match status.code() {
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                    RPCError::Unreachable(Unreachable::new(&err))
                }
                _ => RPCError::Network(NetworkError::new(&err)),
            }
        })?;
        let result: Result<Resp, E> = crate::codec::decode(&reply.into_inner().data)
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    fn backoff(&self) -> openraft::network::Backoff {
        let every = self.retry_every.unwrap_or(Duration::from_millis(500));
        openraft::network::Backoff::new(std::iter::repeat(every))
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, Member, RaftError<NodeId>>> {
        self.call("append", &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, Member, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call("snapshot", &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, Member, RaftError<NodeId>>> {
        self.call("vote", &rpc, &option).await
    }
}
