//! The status page: a picture of the cluster over HTTP, for operators who would rather look at
//! the partition map than read it. Every node serves it from what it has applied (and the
//! leader from its lease table too): the members, leader and term, each node's health as this
//! node knows it, the key space as a ring of ranges coloured by owner, the sessions against
//! their fair share, what is moving, the recent decisions and the leader's renewal rate.
//!
//! Three routes: `/` is the page (one HTML file compiled into the binary, no build chain),
//! `/status.json` what it draws, `/events` a stream of server-sent events, one per applied
//! entry that changed ownership, so the page follows the table as it commits without reading
//! it again. Tables above [`EXACT_LIMIT`] partitions are sent as at most [`MAX_BUCKETS`]
//! aggregated ranges (each with its majority owner and that owner's share), and their events
//! only ask the page to read that summary again, at most twice a second.
//!
//! The invariant it keeps: it only reads. No route proposes anything, and each read holds the
//! state's read lock for one pass over what it shows, never across an await. For a large
//! table that is one pass over the table (15.5 ms at a million partitions) per applied change,
//! shared by every page open on the node; reads between changes reuse it.
//! Connections are bounded in number and in how long a handshake may take, and an event
//! stream whose reader falls behind is closed (the page reconnects and reads again). With TLS
//! on, it is served over TLS and only to an operator's certificate (see [`serve`]).

use super::coordinator::status_of;
use super::Node;
use crate::ownership::Event;
use crate::proto;
use crate::tls::Principal;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tenure_core::ids::PartitionId;
use tenure_core::keyspace::KeySpace;
use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The page itself.
const PAGE: &str = include_str!("status_page.html");

/// Tables up to this many partitions are sent row by row and patched live.
pub const EXACT_LIMIT: usize = 4096;
/// Larger ones are cut into at most this many ranges.
pub const MAX_BUCKETS: usize = 2048;
/// Decisions kept for the timeline.
const RECENT: usize = 200;
/// How often a large table's page is told to read the summary again, at most.
const REFRESH_EVERY: Duration = Duration::from_millis(500);
/// Connections served at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 256;
/// How long a TLS handshake, or a request's headers, may take.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(10);

/// One ownership decision, for the timeline.
#[derive(Clone, Debug, Serialize)]
struct Decision {
    /// When this node applied it, by its wall clock (ms since the Unix epoch).
    at_ms: u64,
    index: u64,
    kind: &'static str,
    partition: u32,
    session: u64,
    token: u64,
}

fn decisions_of(index: u64, events: &[Event]) -> Vec<Decision> {
    let at_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    events
        .iter()
        .filter_map(|e| {
            let (kind, partition, session, token) = match e {
                Event::Granted { partition, session, token } => ("granted", partition, session, token),
                Event::Revoking { partition, session, token } => ("revoking", partition, session, token),
                Event::Released { partition, session, token } => ("released", partition, session, token),
                Event::Lost { partition, session, token, .. } => ("lost", partition, session, token),
                _ => return None,
            };
            Some(Decision { at_ms, index, kind, partition: partition.0, session: session.0, token: token.0 })
        })
        .collect()
}

/// A partition's row as the page keeps it.
#[derive(Clone, Debug, Serialize)]
struct Row {
    partition: u32,
    owner: u64,
    token: u64,
    revoking: bool,
    next: u64,
    lease_remaining_ms: Option<u64>,
}

impl From<&proto::PartitionRow> for Row {
    fn from(r: &proto::PartitionRow) -> Row {
        Row {
            partition: r.partition,
            owner: r.owner,
            token: r.token,
            revoking: r.revoking,
            next: r.next,
            lease_remaining_ms: r.lease_remaining_ms,
        }
    }
}

/// An aggregated range of a large table, as the page draws it.
#[derive(Clone, Debug, Serialize)]
pub struct Range {
    pub first: u32,
    pub last: u32,
    /// The session owning most of it (0: most of it is unowned), and its share of the range.
    pub owner: u64,
    pub share: f64,
    /// Whether any partition in it is revoking, and where the first of those goes.
    pub revoking: bool,
    pub next: u64,
    pub token_min: u64,
    pub token_max: u64,
    /// Where its hashes start, and where the next range's start (hex).
    pub hash_start: String,
    pub hash_end: String,
    lease_remaining_ms: Option<u64>,
}

#[derive(Debug, Serialize)]
struct NodeView {
    id: u64,
    addr: String,
    role: &'static str,
    /// As this node knows it: the leader knows how far each follower has replicated.
    health: String,
}

#[derive(Debug, Serialize)]
struct SessionView {
    id: u64,
    name: String,
    weight: u32,
    leaving: bool,
    owned: u32,
    lease_remaining_ms: Option<u64>,
}

/// What `/status.json` answers.
#[derive(Debug, Serialize)]
struct View {
    node: u64,
    leader: u64,
    term: u64,
    applied: u64,
    last_log_index: u64,
    version: String,
    partition_count: u32,
    lease_ttl_ms: u64,
    maintenance: bool,
    stopping: bool,
    unowned: u32,
    revoking: u32,
    /// Moves granted but not yet confirmed by their new owner, by the leader's count (`None`
    /// when the answering node does not lead).
    unconfirmed_moves: Option<u32>,
    /// Renewals this node has confirmed as leader, ever (the page derives a rate).
    renewals_total: u64,
    nodes: Vec<NodeView>,
    sessions: Vec<SessionView>,
    /// Every partition's row, for tables up to [`EXACT_LIMIT`]; `None` above.
    partitions: Option<Vec<Row>>,
    /// Where each partition's hashes start (and, last, where the key space ends), with `partitions`.
    hashes: Option<Vec<String>>,
    /// The aggregated ranges of a larger table.
    buckets: Vec<Range>,
    recent: Vec<Decision>,
}

fn hex(h: u128) -> String {
    format!("{h:#x}")
}

/// A large table's ranges, as of the applied index they were cut at: every page open on the
/// node shares one pass over the table per change, not one per read.
type Summary = Mutex<Option<(u64, Vec<Range>)>>;

/// Reads the picture from the node: one status read, plus the raft metrics for health.
fn view(node: &Node, recent: &Mutex<VecDeque<Decision>>, summary: &Summary) -> View {
    let count = node
        .state
        .read()
        .expect("state lock poisoned")
        .default_table()
        .config()
        .map_or(0, |c| c.partition_count);
    let exact = count as usize <= EXACT_LIMIT;
    let request = proto::StatusRequest { omit_partitions: !exact, ..Default::default() };
    // The page shows the default namespace, which always exists.
    let default = crate::ownership::Namespace::default_namespace();
    let status = status_of(node, &default, &request).expect("the default namespace always exists");
    let metrics = node.raft.metrics().borrow().clone();
    let (voters, buckets) = {
        let applied = node.state.read().expect("state lock poisoned");
        let voters: Vec<u64> = applied.membership.membership().voter_ids().collect();
        let at = applied.last_applied.map_or(0, |l| l.index);
        let buckets = match exact {
            true => Vec::new(),
            false => {
                let mut cached = summary.lock().expect("summary poisoned");
                match cached.as_ref() {
                    Some((cut_at, ranges)) if *cut_at == at => ranges.clone(),
                    _ => cached.insert((at, aggregate(applied.default_table(), count))).1.clone(),
                }
            }
        };
        (voters, buckets)
    };
    let health = |id: u64| -> String {
        if id == status.node_id {
            return if status.leader_id == id { "leading".into() } else { "this node".into() };
        }
        let Some(replication) = metrics.replication.as_ref() else { return "unknown".into() };
        match replication.get(&id) {
            Some(Some(matched)) => match status.last_log_index.saturating_sub(matched.index) {
                0..=2 => "up to date".into(),
                behind => format!("{behind} entries behind"),
            },
            Some(None) => "unreachable".into(),
            None => "unknown".into(),
        }
    };
    let keyspace = KeySpace::new(count.max(1)).ok();
    let hashes = exact.then(|| {
        let mut starts: Vec<String> = (0..count)
            .map(|p| keyspace.and_then(|k| k.range(PartitionId(p))).map_or(0, |r| r.start as u128))
            .map(hex)
            .collect();
        starts.push(hex(1u128 << 64));
        starts
    });
    View {
        node: status.node_id,
        leader: status.leader_id,
        term: status.term,
        applied: status.last_applied,
        last_log_index: status.last_log_index,
        version: status.version.clone(),
        partition_count: status.partition_count,
        lease_ttl_ms: status.lease_ttl_ms,
        maintenance: status.maintenance,
        stopping: status.stopping,
        unowned: status.unowned,
        revoking: status.revoking,
        unconfirmed_moves: status.unconfirmed_moves,
        renewals_total: node.renewals_confirmed.load(std::sync::atomic::Ordering::Relaxed),
        nodes: status
            .nodes
            .iter()
            .map(|n| NodeView {
                id: n.id,
                addr: n.addr.clone(),
                role: if voters.contains(&n.id) { "voter" } else { "learner" },
                health: health(n.id),
            })
            .collect(),
        sessions: status
            .sessions
            .iter()
            .map(|s| SessionView {
                id: s.id,
                name: s.name.clone(),
                weight: s.weight,
                leaving: s.leaving,
                owned: s.owned,
                lease_remaining_ms: s.lease_remaining_ms,
            })
            .collect(),
        partitions: exact.then(|| status.partitions.iter().map(Row::from).collect()),
        hashes,
        buckets,
        recent: recent.lock().expect("recent decisions poisoned").iter().cloned().collect(),
    }
}

/// Cuts a large table into at most [`MAX_BUCKETS`] ranges of neighbouring partitions, each
/// with its majority owner: what the page draws for a table above [`EXACT_LIMIT`].
pub fn aggregate(state: &crate::ownership::OwnershipState, count: u32) -> Vec<Range> {
    let Ok(keyspace) = KeySpace::new(count.max(1)) else { return Vec::new() };
    let rows = state.partitions();
    let size = rows.len().div_ceil(MAX_BUCKETS).max(1);
    let mut owners: HashMap<u64, usize> = HashMap::new();
    rows.chunks(size)
        .enumerate()
        .map(|(i, chunk)| {
            owners.clear();
            for r in chunk {
                *owners.entry(r.owner.map_or(0, |s| s.0)).or_default() += 1;
            }
            let (&owner, &most) =
                owners.iter().max_by_key(|(id, n)| (**n, std::cmp::Reverse(**id))).expect("a chunk has rows");
            let first = (i * size) as u32;
            let last = first + chunk.len() as u32 - 1;
            let moving = chunk.iter().find(|r| r.revoking);
            Range {
                first,
                last,
                owner,
                share: most as f64 / chunk.len() as f64,
                revoking: moving.is_some(),
                next: moving.and_then(|r| r.next).map_or(0, |s| s.0),
                token_min: chunk.iter().map(|r| r.token.0).min().unwrap_or(0),
                token_max: chunk.iter().map(|r| r.token.0).max().unwrap_or(0),
                hash_start: hex(keyspace.range(PartitionId(first)).map_or(0, |r| r.start as u128)),
                hash_end: hex(keyspace.range(PartitionId(last)).map_or(0, |r| r.end as u128 + 1)),
                lease_remaining_ms: None,
            }
        })
        .collect()
}

#[derive(Clone)]
struct Page {
    node: Arc<Node>,
    recent: Arc<Mutex<VecDeque<Decision>>>,
    summary: Arc<Summary>,
    /// The page's own stop (the node's is `node.stopping`).
    stop: CancellationToken,
}

/// The page's routes over `node`; the timeline starts with what `recent` has kept.
fn router(page: Page) -> Router {
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/status.json", get(status_json))
        .route("/events", get(events))
        .with_state(page)
}

async fn status_json(State(page): State<Page>) -> Response {
    let node = page.node.clone();
    // Reading a large table costs a pass over it: off the runtime's threads.
    match tokio::task::spawn_blocking(move || view(&node, &page.recent, &page.summary)).await {
        Ok(view) => Json(view).into_response(),
        Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "status read failed").into_response(),
    }
}

/// One SSE event per applied entry that changed ownership (`applied`: the changed rows and the
/// decisions), or `refresh` when the page should read the summary again: after a snapshot, a
/// change of sessions, a stream that fell behind, or any change of a large table.
async fn events(State(page): State<Page>) -> impl IntoResponse {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    let (node, stop) = (page.node.clone(), page.stop.clone());
    tokio::spawn(async move {
        let mut applied = node.sm.subscribe();
        let mut refresh_pending = false;
        let mut tick = tokio::time::interval(REFRESH_EVERY);
        // Idle time must not bank ticks that would later let every entry through.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let event = tokio::select! {
                _ = tx.closed() => return,
                _ = node.stopping.cancelled() => return,
                _ = stop.cancelled() => return,
                _ = tick.tick(), if refresh_pending => {
                    refresh_pending = false;
                    Some(SseEvent::default().event("refresh").data("{}"))
                }
                received = applied.recv() => match received {
                    Err(RecvError::Closed) => return,
                    Err(RecvError::Lagged(_)) => Some(SseEvent::default().event("refresh").data("{}")),
                    Ok(entry) if !entry.snapshot && !entry.namespace.is_default() => None,
                    Ok(entry) => {
                        let large = node.state.read().expect("state lock poisoned").default_table().config()
                            .is_some_and(|c| c.partition_count as usize > EXACT_LIMIT);
                        let sessions_changed = entry.events.iter().any(|e| {
                            matches!(e, Event::SessionStarted { .. } | Event::SessionLeaving { .. } | Event::SessionEnded { .. })
                        });
                        if entry.snapshot || large {
                            refresh_pending |= entry.snapshot || !entry.events.is_empty();
                            None
                        } else {
                            let data = changes(&node, entry.index, &entry.events);
                            let applied = data.map(|d| SseEvent::default().event("applied").data(d));
                            if sessions_changed && tx.try_send(Ok(SseEvent::default().event("refresh").data("{}"))).is_err() {
                                return;
                            }
                            applied
                        }
                    }
                },
            };
            // A reader that fell 64 events behind is cut off: its page reconnects and reads
            // the picture again, rather than this node queueing for it without bound.
            if let Some(event) = event {
                if tx.try_send(Ok(event)).is_err() {
                    return;
                }
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

/// The rows an entry changed and its decisions, as the `applied` event's data; `None` if it
/// changed no partition.
fn changes(node: &Node, index: u64, events: &[Event]) -> Option<String> {
    #[derive(Serialize)]
    struct Applied {
        index: u64,
        changes: Vec<Row>,
        recent: Vec<Decision>,
    }
    let recent = decisions_of(index, events);
    if recent.is_empty() {
        return None;
    }
    let touched: BTreeMap<u32, ()> = recent.iter().map(|d| (d.partition, ())).collect();
    let changes = {
        let applied = node.state.read().expect("state lock poisoned");
        touched
            .keys()
            .filter_map(|p| {
                applied.default_table().partition(PartitionId(*p)).map(|r| Row {
                    partition: *p,
                    owner: r.owner.map_or(0, |s| s.0),
                    token: r.token.0,
                    revoking: r.revoking,
                    next: r.next.map_or(0, |s| s.0),
                    lease_remaining_ms: None,
                })
            })
            .collect()
    };
    serde_json::to_string(&Applied { index, changes, recent }).ok()
}

/// Keeps the last [`RECENT`] decisions this node applied, for pages opened later.
async fn remember(node: Arc<Node>, recent: Arc<Mutex<VecDeque<Decision>>>, stop: CancellationToken) {
    let mut applied = node.sm.subscribe();
    loop {
        let entry = tokio::select! {
            _ = stop.cancelled() => return,
            _ = node.stopping.cancelled() => return,
            received = applied.recv() => match received {
                Ok(entry) if entry.namespace.is_default() => entry,
                Ok(_) => continue,
                Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return,
            },
        };
        let mut kept = recent.lock().expect("recent decisions poisoned");
        kept.extend(decisions_of(entry.index, &entry.events));
        while kept.len() > RECENT {
            kept.pop_front();
        }
    }
}

/// Why the status page could not be served.
#[derive(Debug, thiserror::Error)]
pub enum StatusPageError {
    #[error("status page: {0}")]
    Io(#[from] std::io::Error),
    #[error("status page TLS: {0}")]
    Tls(String),
}

/// Serves the status page of `node` on `listener` until `stop` fires or the node stops.
///
/// Without TLS it is plain HTTP, readable by anyone who reaches the address (bind it to a
/// private one). With the node's TLS material it is HTTPS with the node's certificate, and a
/// connection must present a certificate from the cluster's CA naming an operator
/// (`tenure://operator/<name>`); a worker's or a node's is refused at the handshake's end.
pub async fn serve(
    node: Arc<Node>,
    listener: TcpListener,
    stop: CancellationToken,
) -> Result<(), StatusPageError> {
    let recent = Arc::new(Mutex::new(VecDeque::new()));
    tokio::spawn(remember(node.clone(), recent.clone(), stop.clone()));
    let app = router(Page { node: node.clone(), recent, summary: Arc::default(), stop: stop.clone() });
    let acceptor = match &node.config.tls {
        Some(tls) => Some(tls_acceptor(tls)?),
        None => None,
    };
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = node.stopping.cancelled() => return Ok(()),
            permit = connections.clone().acquire_owned() => permit.expect("never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = node.stopping.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "status page: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Either stop ends the connection: the page's own, or the node's.
        let (app, acceptor, stop) = (app.clone(), acceptor.clone(), [stop.clone(), node.stopping.clone()]);
        tokio::spawn(async move {
            let _permit = permit;
            let served = match acceptor {
                None => serve_connection(stream, app, stop).await,
                Some(acceptor) => {
                    match tokio::time::timeout(HANDSHAKE_BOUND, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => match operator_of(&tls) {
                            Some(_) => serve_connection(tls, app, stop).await,
                            None => {
                                tracing::info!(%peer, "status page: refused a connection without an operator's certificate");
                                return;
                            }
                        },
                        Ok(Err(e)) => {
                            tracing::info!(%peer, error = %e, "status page: TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::info!(%peer, "status page: TLS handshake took too long");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "status page: connection ended");
            }
        });
    }
}

/// The operator a TLS connection's certificate names, if it names one.
fn operator_of(tls: &tokio_rustls::server::TlsStream<tokio::net::TcpStream>) -> Option<String> {
    let (_, session) = tls.get_ref();
    let cert = session.peer_certificates()?.first()?;
    match crate::tls::principal_of(cert.as_ref()) {
        Ok(Principal::Operator(name)) => Some(name),
        _ => None,
    }
}

/// HTTP/1.1 over one connection, until the client or the server is done.
async fn serve_connection<IO>(io: IO, app: Router, stop: [CancellationToken; 2]) -> Result<(), hyper::Error>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let mut app = app.clone();
        async move { tower::Service::call(&mut app, request.map(axum::body::Body::new)).await }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HANDSHAKE_BOUND)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    tokio::pin!(connection);
    let [page_stop, node_stop] = stop;
    tokio::select! {
        served = connection.as_mut() => served,
        _ = page_stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
        _ = node_stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    }
}

/// A TLS acceptor with the node's identity that requires a client certificate from the
/// cluster's CA (which principal it names is checked after the handshake).
fn tls_acceptor(tls: &crate::tls::NodeTls) -> Result<tokio_rustls::TlsAcceptor, StatusPageError> {
    use tokio_rustls::rustls;
    let bad = |what: &str, e: &dyn std::fmt::Display| StatusPageError::Tls(format!("{what}: {e}"));
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&tls.ca_pem) {
        roots.add(cert.map_err(|e| bad("reading the CA", &e))?).map_err(|e| bad("adding the CA", &e))?;
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&tls.cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| bad("reading the certificate", &e))?;
    let key = PrivateKeyDer::from_pem_slice(&tls.key_pem).map_err(|e| bad("reading the key", &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| bad("client verifier", &e))?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("protocol versions", &e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| bad("the node's certificate", &e))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    //! A large table reaches the browser as a bounded number of ranges that still cover it.

    use super::*;
    use crate::ownership::{Command, Grant, OwnershipState, SecretHash};
    use tenure_core::ids::SessionId;

    #[test]
    fn a_million_partitions_are_drawn_as_at_most_max_buckets_ranges_covering_the_table() {
        let count = 1_000_000u32;
        let mut state = OwnershipState::default();
        state
            .apply(1, &Command::Configure { partition_count: count, lease_ttl_ms: 1000, max_revoking: None });
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            state.apply(
                2 + i as u64,
                &Command::Join { name: name.into(), weight: 1, secret: SecretHash::of("s") },
            );
        }
        let sessions: Vec<SessionId> = state.sessions().keys().copied().collect();
        assert_eq!(sessions.len(), 3);
        // The first half of the key space to the first session, the rest shared by the others
        // partition by partition: buckets there are mixed.
        let grants = (0..count)
            .map(|p| Grant {
                partition: PartitionId(p),
                session: if p < count / 2 { sessions[0] } else { sessions[1 + (p % 2) as usize] },
            })
            .collect();
        state.apply(10, &Command::Place { grants, revokes: Vec::new() });
        assert_eq!(state.owned_count(sessions[0]), count as usize / 2);

        let buckets = aggregate(&state, count);
        assert!(buckets.len() <= MAX_BUCKETS, "{} buckets", buckets.len());
        assert_eq!(buckets[0].first, 0);
        assert_eq!(buckets.last().unwrap().last, count - 1);
        for pair in buckets.windows(2) {
            assert_eq!(pair[0].last + 1, pair[1].first, "ranges are contiguous");
            assert_eq!(pair[0].hash_end, pair[1].hash_start, "hashes too");
        }
        assert_eq!(buckets.last().unwrap().hash_end, "0x10000000000000000");
        let whole = |b: &Range| b.owner == sessions[0].0 && b.share == 1.0;
        let mixed = |b: &Range| (b.owner == sessions[1].0 || b.owner == sessions[2].0) && b.share < 0.6;
        assert!(buckets.iter().filter(|b| b.last < count / 2).all(whole));
        assert!(buckets.iter().filter(|b| b.first >= count / 2).all(mixed));
    }
}
