//! Helpers shared by the cluster tests: a small fast cluster, workers, and awaited conditions.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::is_settled;
use tenure::local_cluster::LocalCluster;
use tenure::proto::StatusResponse;
use tenure::server::NodeConfig;
use tenure::worker::Worker;

pub const TTL: Duration = Duration::from_millis(1000);
/// Generous bound for anything the tests await; never a speed assertion.
pub const PATIENCE: Duration = Duration::from_secs(30);

pub fn fast(c: &mut NodeConfig) {
    c.partition_count = 24;
    c.lease_ttl = TTL;
    c.election_timeout = Duration::from_millis(300);
    // openraft gives each append this long to answer; much shorter is fragile on a loaded 2-core box.
    c.raft_heartbeat_interval = Duration::from_millis(100);
    c.expiry_check_interval = Duration::from_millis(20);
}

/// Logs to the test's captured output; `RUST_LOG` picks the level (default: warnings).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}

pub async fn cluster(dir: &std::path::Path) -> LocalCluster {
    init_tracing();
    let c = LocalCluster::start(3, dir, fast).await.expect("cluster starts");
    c.wait_for_leader(PATIENCE).await.expect("a leader is elected");
    c
}

pub async fn worker(c: &LocalCluster, name: &str) -> Worker {
    Worker::join(c.worker_config(name)).await.expect("worker joins")
}

/// Polls `check` until it returns `Some`, or panics after [`PATIENCE`].
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_within(PATIENCE, what, check).await
}

/// Polls `check` until it returns `Some`, or panics after `patience`.
pub async fn eventually_within<T, F, Fut>(patience: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let until = Instant::now() + patience;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `sessions` live sessions hold every partition, balanced, none revoking.
pub async fn settled(c: &LocalCluster, sessions: usize) -> StatusResponse {
    eventually(&format!("{sessions} sessions own a balanced table"), || async {
        c.status().await.ok().filter(|s| is_settled(s, sessions))
    })
    .await
}

/// Waits until each worker believes exactly what the table gives its session.
pub async fn workers_agree(c: &LocalCluster, workers: &[&Worker]) -> StatusResponse {
    eventually("workers believe exactly what the table says", || async {
        let status = c.status().await.ok()?;
        for w in workers {
            let want: BTreeMap<PartitionId, FencingToken> = status
                .partitions
                .iter()
                .filter(|r| r.owner == w.session().0 && !r.revoking)
                .map(|r| (PartitionId(r.partition), FencingToken(r.token)))
                .collect();
            if w.owned() != want {
                return None;
            }
        }
        Some(status)
    })
    .await
}

/// No partition is believed by two workers at this instant.
pub fn single_believers(workers: &[&Worker]) {
    let mut seen = BTreeMap::new();
    for w in workers {
        for (p, t) in w.owned() {
            if let Some(other) = seen.insert(p, (w.session(), t)) {
                panic!("{p} believed by {} (token {}) and {} (token {t})", other.0, other.1, w.session());
            }
        }
    }
}

pub fn tokens(status: &StatusResponse) -> BTreeMap<u32, (u64, u64)> {
    status.partitions.iter().map(|r| (r.partition, (r.owner, r.token))).collect()
}

/// A client of the worker API on node `id`'s client listener, holding a certificate of the
/// cluster's CA that names `principal` (plain text on a cluster made insecure).
pub async fn api_client_as(
    c: &LocalCluster,
    id: tenure::ids::NodeId,
    principal: &tenure::tls::Principal,
) -> tenure::proto::coordinator_client::CoordinatorClient<tonic::transport::Channel> {
    tenure::proto::coordinator_client::CoordinatorClient::new(channel_as(c, id, principal).await)
}

/// A connection to node `id`'s client listener holding a certificate that names `principal`
/// (plain text on a cluster made insecure), for any service served there.
pub async fn channel_as(
    c: &LocalCluster,
    id: tenure::ids::NodeId,
    principal: &tenure::tls::Principal,
) -> tonic::transport::Channel {
    let endpoint = match c.client_tls(principal) {
        Some(tls) => tonic::transport::Endpoint::from_shared(format!("https://{}", c.addr(id)))
            .unwrap()
            .tls_config(tls.config())
            .unwrap(),
        None => tonic::transport::Endpoint::from_shared(format!("http://{}", c.addr(id))).unwrap(),
    };
    endpoint.connect().await.expect("connects to the node")
}

/// An operator's client of the worker API on node `id`.
pub async fn api_client(
    c: &LocalCluster,
    id: tenure::ids::NodeId,
) -> tenure::proto::coordinator_client::CoordinatorClient<tonic::transport::Channel> {
    api_client_as(c, id, &tenure::tls::Principal::Operator("test".into())).await
}

/// A client of its own speaking the public API to the leader, and the session it joined under
/// `name`: for tests of what callers other than the worker library can do.
pub async fn raw_join(
    c: &LocalCluster,
    name: &str,
) -> (
    tenure::proto::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    tenure::proto::JoinResponse,
) {
    let leader = c.leader().expect("a leader");
    let mut client = api_client_as(c, leader, &tenure::tls::Principal::Worker(name.into())).await;
    let request = tenure::proto::JoinRequest { name: name.into(), weight: 1, ..Default::default() };
    let joined = client.join(request).await.expect("joins").into_inner();
    (client, joined)
}

/// A Raft transport client for node `id`'s peer listener, over TLS trusting `ca_pem` and
/// presenting `identity` (certificate and key PEM), if any. It connects on first use, so a
/// refused handshake shows as that call's error.
pub fn raft_client_as(
    c: &LocalCluster,
    id: tenure::ids::NodeId,
    ca_pem: &str,
    identity: Option<&tenure::certs::Issued>,
) -> tenure::proto::peer::raft_transport_client::RaftTransportClient<tonic::transport::Channel> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
    if let Some(issued) = identity {
        tls = tls.identity(Identity::from_pem(&issued.cert_pem, &issued.key_pem));
    }
    let endpoint =
        Endpoint::from_shared(format!("https://{}", c.peer_addr(id))).unwrap().tls_config(tls).unwrap();
    tenure::proto::peer::raft_transport_client::RaftTransportClient::new(endpoint.connect_lazy())
}

/// A Raft transport client for node `id`'s peer listener holding a node certificate from the
/// cluster's CA: what a peer (or an attacker who stole a node's key) can send.
pub fn raft_client(
    c: &LocalCluster,
    id: tenure::ids::NodeId,
) -> tenure::proto::peer::raft_transport_client::RaftTransportClient<tonic::transport::Channel> {
    let hosts = ["127.0.0.1".to_string()];
    let issued = c.ca().issue(&tenure::tls::Principal::Node(id), &hosts, Default::default()).unwrap();
    raft_client_as(c, id, &c.ca().ca_pem(), Some(&issued))
}
