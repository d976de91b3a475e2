//! A connection to the coordinator cluster that finds the leader and follows redirects.
//!
//! Any node answers a worker; a follower refuses with the leader's address in metadata, which the
//! client follows at once. Unreachable nodes are skipped with bounded exponential backoff, so a
//! call either reaches the leader or fails after a bounded number of tries.

use crate::proto::coordinator_client::CoordinatorClient;
use crate::proto::{ERROR_METADATA, LEADER_METADATA};
use crate::transport::{ClientTls, Dialer};
use backon::{BackoffBuilder, ExponentialBuilder};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Why a coordinator call failed, as seen by a worker.
///
/// ```
/// use tenure_worker::{Client, ClientError};
/// assert!(matches!(Client::new(Vec::new()), Err(ClientError::BadAddress(_))));
/// assert!(ClientError::SessionExpired("s7".into()).is_session_gone()); // join again
/// assert!(!ClientError::Unavailable("no leader".into()).is_session_gone()); // retry later
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("unknown session: {0}")]
    UnknownSession(String),
    #[error("wrong session secret: {0}")]
    WrongSecret(String),
    #[error("session expired: {0}")]
    SessionExpired(String),
    #[error("not the owner: {0}")]
    NotOwner(String),
    #[error("partition out of range: {0}")]
    PartitionOutOfRange(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The coordinator does not know who is calling: no certificate, or one it cannot read.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The caller is known but may not do this: a worker joining under another's name or
    /// acting on another worker's session, an operator renewing a lease.
    #[error("not allowed: {0}")]
    NotAllowed(String),
    /// The cluster is at a limit that waiting a moment will not lift: its cap on workers with
    /// a session, or its size limit on a message.
    #[error("limit reached: {0}")]
    LimitReached(String),
    #[error("no coordinator could serve the call: {0}")]
    Unavailable(String),
    #[error("bad coordinator address {0:?}")]
    BadAddress(String),
    #[error("coordinator error: {0}")]
    Other(String),
}

impl ClientError {
    /// The session is gone for good: join again.
    pub fn is_session_gone(&self) -> bool {
        matches!(
            self,
            ClientError::UnknownSession(_) | ClientError::SessionExpired(_) | ClientError::WrongSecret(_)
        )
    }

    pub(crate) fn from_status(status: &tonic::Status) -> ClientError {
        let kind = status.metadata().get(ERROR_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("");
        let msg = status.message().to_string();
        match kind {
            "unknown_session" => ClientError::UnknownSession(msg),
            "wrong_secret" => ClientError::WrongSecret(msg),
            "session_expired" => ClientError::SessionExpired(msg),
            "not_owner" => ClientError::NotOwner(msg),
            "partition_out_of_range" => ClientError::PartitionOutOfRange(msg),
            "invalid_argument" | "invalid_name" | "invalid_weight" => ClientError::InvalidArgument(msg),
            "not_allowed" => ClientError::NotAllowed(msg),
            "too_many_sessions" | "message_too_large" | "too_many_client_streams" => {
                ClientError::LimitReached(msg)
            }
            "unauthenticated" => ClientError::Unauthenticated(msg),
            // A join refused by the leader's rate passes on a later try: the call retries it.
            "not_leader" | "unavailable" | "not_configured" | "too_many_streams" | "too_many_joins" => {
                ClientError::Unavailable(msg)
            }
            _ if status.code() == tonic::Code::Unavailable => ClientError::Unavailable(msg),
            // The listener's gate answers before any handler, without a kind.
            _ if status.code() == tonic::Code::PermissionDenied => ClientError::NotAllowed(msg),
            _ if status.code() == tonic::Code::Unauthenticated => ClientError::Unauthenticated(msg),
            _ => ClientError::Other(format!("{:?}: {msg}", status.code())),
        }
    }
}

/// Connection to a cluster. Cheap to clone; clones share the leader hint.
///
/// This is the wire-level client, for operators' tools and tests: it speaks the generated gRPC
/// types of [`crate::proto`] directly. An application needs none of them: [`crate::Worker`],
/// [`crate::Runner`], their events and handles, and [`crate::Router`] carry tenure's own types.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure_worker::ClientError> {
/// use tenure_worker::proto::StatusRequest;
/// use tenure_worker::Client;
/// let client = Client::new(vec!["10.0.0.1:7001".into(), "10.0.0.2:7001".into()])?;
/// let status = client.status().await?; // the whole table, in pages
/// let first = client.call(|mut c| async move { c.status(StatusRequest { limit: 10, ..Default::default() }).await }).await?;
/// assert!(first.partitions.len() <= 10);
/// println!("leader at {}, {} partitions", status.leader_addr, status.partition_count);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<Mutex<Inner>>,
    max_tries: usize,
}

struct Inner {
    addrs: Vec<String>,
    dial_from: Option<std::net::IpAddr>,
    dialer: Dialer,
    tls: Option<ClientTls>,
    current: usize,
    /// Ordered, not hashed: dropping the client closes the connections in this order, which
    /// must not depend on the process (the whole-stack simulation replays seeds).
    channels: std::collections::BTreeMap<String, Channel>,
}

/// How long one try of [`Client::call`] may take before the client moves to another node.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

impl Client {
    /// A client for the given `host:port` addresses; nothing connects until the first call.
    pub fn new(addrs: Vec<String>) -> Result<Client, ClientError> {
        if addrs.is_empty() {
            return Err(ClientError::BadAddress(String::new()));
        }
        for a in &addrs {
            Endpoint::from_shared(format!("http://{a}")).map_err(|_| ClientError::BadAddress(a.clone()))?;
        }
        Ok(Client {
            inner: Arc::new(Mutex::new(Inner {
                addrs,
                dial_from: None,
                dialer: Dialer::tcp(),
                tls: None,
                current: 0,
                channels: Default::default(),
            })),
            max_tries: 12,
        })
    }

    /// Connects from `source` (on hosts with several addresses); `None` lets the system choose.
    pub fn dialing_from(self, source: Option<std::net::IpAddr>) -> Client {
        self.inner.lock().expect("client lock poisoned").dial_from = source;
        self
    }

    /// Opens its channels with `dialer` instead of plain TCP.
    pub fn dialing_with(self, dialer: Dialer) -> Client {
        self.inner.lock().expect("client lock poisoned").dialer = dialer;
        self
    }

    /// Connects over TLS with this identity (`None`: plain TCP, for an insecure cluster).
    pub fn with_tls(self, tls: Option<ClientTls>) -> Client {
        let mut inner = self.inner.lock().expect("client lock poisoned");
        inner.tls = tls;
        inner.channels.clear();
        drop(inner);
        self
    }

    fn channel(&self) -> Result<(String, Channel), ClientError> {
        let mut inner = self.inner.lock().expect("client lock poisoned");
        let addr = inner.addrs[inner.current % inner.addrs.len()].clone();
        if let Some(c) = inner.channels.get(&addr) {
            return Ok((addr, c.clone()));
        }
        let scheme = if inner.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|_| ClientError::BadAddress(addr.clone()))?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .local_address(inner.dial_from);
        if let Some(tls) = &inner.tls {
            endpoint = endpoint
                .tls_config(tls.config())
                .map_err(|e| ClientError::BadAddress(format!("{addr} (TLS: {e})")))?;
        }
        let channel = inner.dialer.channel(endpoint);
        inner.channels.insert(addr.clone(), channel.clone());
        Ok((addr, channel))
    }

    fn follow(&self, leader: Option<String>, failed: &str) {
        let mut inner = self.inner.lock().expect("client lock poisoned");
        match leader {
            Some(addr) => {
                let pos = match inner.addrs.iter().position(|a| *a == addr) {
                    Some(pos) => pos,
                    None => {
                        inner.addrs.push(addr);
                        inner.addrs.len() - 1
                    }
                };
                inner.current = pos;
            }
            None => {
                if inner.addrs[inner.current % inner.addrs.len()] == failed {
                    inner.current = (inner.current + 1) % inner.addrs.len();
                }
                inner.channels.remove(failed);
            }
        }
    }

    /// The status of the cluster as one node sees it, with the whole partition table: the
    /// table arrives in pages of at most 65,536 rows (one message each, so any table size fits
    /// gRPC's message limits), read one after another; a table that changes meanwhile may show
    /// rows from different moments.
    pub async fn status(&self) -> Result<crate::proto::StatusResponse, ClientError> {
        self.read_status(crate::proto::StatusRequest::default(), None).await
    }

    /// [`Client::status`] with the request's options (a linearizable read, rows of one owner,
    /// no rows), reading pages from `request.from_partition` on until the table ends or
    /// `max_rows` rows have arrived; `next_partition` of the answer says where a further read
    /// would start.
    pub async fn read_status(
        &self,
        request: crate::proto::StatusRequest,
        max_rows: Option<usize>,
    ) -> Result<crate::proto::StatusResponse, ClientError> {
        let page = |from_partition: u32, limit: u32| {
            let request = crate::proto::StatusRequest { from_partition, limit, ..request.clone() };
            self.call(move |mut c| {
                let request = request.clone();
                async move { c.status(request).await }
            })
        };
        let page_limit = |have: usize| match max_rows {
            // Never 0, which would mean a whole page.
            Some(max) => max.saturating_sub(have).clamp(1, 65_536) as u32,
            None => request.limit,
        };
        let mut status = page(request.from_partition, page_limit(0)).await?;
        // Bounded: every page starts past the previous one, and a table has at most 2^22 rows.
        while let Some(from) = status.next_partition {
            if max_rows.is_some_and(|max| status.partitions.len() >= max) {
                break;
            }
            let more = page(from, page_limit(status.partitions.len())).await?;
            if more.next_partition.is_some_and(|n| n <= from) {
                return Err(ClientError::Other(format!("status pages do not advance past {from}")));
            }
            status.partitions.extend(more.partitions);
            status.next_partition = more.next_partition;
        }
        Ok(status)
    }

    /// Runs `f` against the leader, following redirects and retrying unreachable nodes.
    pub async fn call<T, F, Fut>(&self, mut f: F) -> Result<T, ClientError>
    where
        F: FnMut(CoordinatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_on(|channel| f(CoordinatorClient::new(channel))).await
    }

    /// Like [`Client::call`], for any service the nodes serve on their client listener (the
    /// operator's, for one): `f` gets a channel to the node tried.
    pub async fn call_on<T, F, Fut>(&self, mut f: F) -> Result<T, ClientError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut delays = ExponentialBuilder::new()
            .with_min_delay(Duration::from_millis(20))
            .with_max_delay(Duration::from_millis(500))
            .with_jitter()
            .with_max_times(self.max_tries)
            .build();
        loop {
            let (addr, channel) = self.channel()?;
            let status = match self.attempt(ATTEMPT_TIMEOUT, channel, &mut f).await {
                Ok(reply) => return Ok(reply),
                Err(status) => status,
            };
            let redirected = self.judge(&status, &addr)?;
            match delays.next() {
                Some(_) if redirected => continue,
                Some(delay) => tokio::time::sleep(delay).await,
                None => return Err(ClientError::Unavailable(status.message().to_string())),
            }
        }
    }

    /// Like [`Client::call`], but never sleeps: it follows redirects and moves past nodes that
    /// cannot serve, visiting each known node about once, and returns the address that answered.
    /// Each node gets `per_node` to answer before the client moves on to the next. For callers
    /// that pace their own retries against a deadline, such as heartbeats.
    pub(crate) async fn call_without_waiting<T, F, Fut>(
        &self,
        per_node: Duration,
        mut f: F,
    ) -> Result<(String, T), ClientError>
    where
        F: FnMut(CoordinatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let hops = 2 * self.inner.lock().expect("client lock poisoned").addrs.len() + 1;
        let mut last = String::from("no coordinator address");
        for _ in 0..hops {
            let (addr, channel) = self.channel()?;
            match self.attempt(per_node, channel, &mut |channel| f(CoordinatorClient::new(channel))).await {
                Ok(reply) => return Ok((addr, reply)),
                Err(status) => {
                    self.judge(&status, &addr)?;
                    last = format!("{addr}: {}", status.message());
                }
            }
        }
        Err(ClientError::Unavailable(last))
    }

    /// One try of `f` on `channel`, bounded by `limit`: a node that does not answer in time
    /// fails as DeadlineExceeded, which [`Client::judge`] moves away from.
    async fn attempt<T, F, Fut>(
        &self,
        limit: Duration,
        channel: Channel,
        f: &mut F,
    ) -> Result<T, tonic::Status>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(limit, f(channel)).await {
            Ok(answer) => answer.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer within {limit:?}"))),
        }
    }

    /// Sorts a failed call: an error to hand back (`Err`), or a node to move away from, toward the
    /// leader it named if it named one (`Ok(true)` when that is a different node).
    pub(crate) fn judge(&self, status: &tonic::Status, addr: &str) -> Result<bool, ClientError> {
        use tonic::Code;
        let retry = matches!(
            status.code(),
            Code::Unavailable | Code::Cancelled | Code::Unknown | Code::DeadlineExceeded
        );
        if !retry {
            return Err(ClientError::from_status(status));
        }
        let leader = status.metadata().get(LEADER_METADATA).and_then(|v| v.to_str().ok()).map(str::to_string);
        let redirected = leader.as_deref().is_some_and(|l| l != addr);
        self.follow(leader, addr);
        Ok(redirected)
    }

    /// Moves away from `addr`, which stopped answering; its connection is dropped, so the next
    /// one to it is new.
    pub(crate) fn avoid(&self, addr: &str) {
        self.follow(None, addr);
    }
}
