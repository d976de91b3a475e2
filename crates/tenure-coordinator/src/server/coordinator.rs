//! The worker-facing gRPC service. Requests are validated here, before anything reaches the
//! log; the state machine checks them again when it applies them.

use super::{CoordinatorError, Node, PendingRenewal};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::ownership::{
    check_join, Command, Event, Namespace, Proposal, Rejection, Response as SmResponse, SecretHash,
};
use crate::proto::{self, coordinator_server::Coordinator, ownership_event::Kind};
use crate::store::Delivery;
use crate::tls::Caller;
use rand::RngCore;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// Longest secret accepted; real ones are 32 hex characters.
const MAX_SECRET_BYTES: usize = 128;

pub struct CoordinatorService {
    pub node: Arc<Node>,
}

fn check_secret(secret: &str) -> Result<(), CoordinatorError> {
    if secret.len() > MAX_SECRET_BYTES {
        return Err(CoordinatorError::InvalidArgument(format!(
            "secret longer than {MAX_SECRET_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Checks that `caller` may act for `session`: its secret (the proof the session is the
/// caller's, given only to the joiner), then, on a TLS cluster, that the certificate names the
/// worker the session belongs to. Read under the state's lock the caller already holds.
fn authorize_session(
    state: &crate::ownership::OwnershipState,
    caller: &Caller,
    session: SessionId,
    secret: &SecretHash,
) -> Result<(), CoordinatorError> {
    let record = state.authenticate_hash(session, secret)?;
    caller.may_act_as(&record.name).map_err(CoordinatorError::NotAllowed)
}

/// The namespace a request names: empty means the default one.
pub(crate) fn namespace_of(name: &str) -> Result<Namespace, CoordinatorError> {
    Namespace::or_default(name).map_err(CoordinatorError::Rejected)
}

/// The applied table of `namespace`, or `UnknownNamespace`.
pub(crate) fn table_of<'a>(
    applied: &'a crate::store::Applied,
    namespace: &Namespace,
) -> Result<&'a crate::ownership::OwnershipState, CoordinatorError> {
    applied
        .table(namespace)
        .ok_or_else(|| CoordinatorError::Rejected(Rejection::UnknownNamespace(namespace.to_string())))
}

fn new_secret() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl CoordinatorService {
    fn event_for(
        &self,
        namespace: &Namespace,
        kind: Kind,
        partition: PartitionId,
        token: u64,
        index: u64,
    ) -> proto::OwnershipEvent {
        let applied = self.node.state.read().expect("state lock poisoned");
        // A namespace deleted since has no range to give; its session has ended, and the stream
        // ends with it.
        let table = applied.table(namespace);
        let range = table.and_then(|t| t.keyspace()).and_then(|k| k.range(partition));
        proto::OwnershipEvent {
            kind: kind as i32,
            partition: partition.0,
            token,
            hash_start: range.map(|r| r.start).unwrap_or(0),
            hash_end: range.map(|r| r.end).unwrap_or(0),
            lease_ttl_ms: table.and_then(|t| t.config()).map(|c| c.lease_ttl_ms).unwrap_or(0),
            log_index: index,
        }
    }
}

type RoutesStream = Pin<Box<dyn Stream<Item = Result<proto::RouteUpdate, Status>> + Send>>;

/// The current route of one partition, read from the applied table. Updates always carry the
/// row as it is now, so a watcher that applies them in order converges on the table.
fn route_of(state: &crate::ownership::OwnershipState, p: PartitionId) -> proto::RouteUpdate {
    let record = state.partition(p).copied().unwrap_or_default();
    let worker = record.owner.and_then(|s| state.session(s)).map(|r| r.name.clone()).unwrap_or_default();
    proto::RouteUpdate {
        partition: p.0,
        session_id: record.owner.map(|s| s.0).unwrap_or(0),
        worker,
        token: record.token.0,
        revoking: record.revoking,
        partition_count: state.config().map(|c| c.partition_count).unwrap_or(0),
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<proto::OwnershipEvent, Status>> + Send>>;
type HeartbeatsStream = Pin<Box<dyn Stream<Item = Result<proto::HeartbeatResponse, Status>> + Send>>;

/// Most partition leases (or dropped partitions) one heartbeat message carries: about 11 bytes
/// each, so a message stays near 700 KiB, far below tonic's 4 MiB default, whatever a session
/// owns.
pub const LEASES_PER_MESSAGE: usize = 65_536;

/// Most partition rows one `Status` answer carries.
pub const STATUS_ROWS_PER_PAGE: u32 = 65_536;

/// What one renewal confirmed: the session's grants that are not revoking, by partition.
pub(crate) struct Renewed {
    leases: Vec<(u32, u64)>,
    ttl_ms: u64,
}

impl Renewed {
    /// The unary answer: one page of the renewed grants, from `from` on.
    fn page(self, from: u32) -> proto::HeartbeatResponse {
        let start = self.leases.partition_point(|(p, _)| *p < from);
        let rest = &self.leases[start..];
        let shown = rest.len().min(LEASES_PER_MESSAGE);
        proto::HeartbeatResponse {
            renewed: rest[..shown]
                .iter()
                .map(|&(partition, token)| proto::PartitionLease { partition, token })
                .collect(),
            lease_ttl_ms: self.ttl_ms,
            next_partition: rest.get(shown).map(|(p, _)| *p),
            ..Default::default()
        }
    }
}

/// What a heartbeat stream's answers have told its worker so far, so each answer carries only
/// what changed: a session that owns half a million partitions is renewed with empty messages.
#[derive(Default)]
pub(crate) struct StreamView {
    /// The grants the stream's answers renewed, by partition (sorted).
    told: Vec<(u32, u64)>,
}

impl StreamView {
    /// The answer to one renewal, as one or more messages (all but the last with `more`).
    pub(crate) fn answer(&mut self, renewed: Renewed) -> Vec<proto::HeartbeatResponse> {
        let (mut changed, mut dropped) = (Vec::new(), Vec::new());
        let (old, new) = (&self.told, &renewed.leases);
        let (mut i, mut j) = (0, 0);
        while i < old.len() || j < new.len() {
            match (old.get(i), new.get(j)) {
                (Some(o), Some(n)) if o.0 == n.0 => {
                    if o.1 != n.1 {
                        changed.push(*n);
                    }
                    i += 1;
                    j += 1;
                }
                (Some(o), Some(n)) if o.0 < n.0 => {
                    dropped.push(o.0);
                    i += 1;
                }
                (Some(o), None) => {
                    dropped.push(o.0);
                    i += 1;
                }
                (_, Some(n)) => {
                    changed.push(*n);
                    j += 1;
                }
                (None, None) => unreachable!("the loop runs while either has items"),
            }
        }
        self.told = renewed.leases;
        let mut messages = Vec::new();
        let (mut changed, mut dropped) = (changed.as_slice(), dropped.as_slice());
        loop {
            let c = changed.len().min(LEASES_PER_MESSAGE);
            let d = dropped.len().min(LEASES_PER_MESSAGE - c);
            messages.push(proto::HeartbeatResponse {
                renewed: changed[..c]
                    .iter()
                    .map(|&(partition, token)| proto::PartitionLease { partition, token })
                    .collect(),
                dropped: dropped[..d].to_vec(),
                lease_ttl_ms: renewed.ttl_ms,
                more: false,
                next_partition: None,
            });
            changed = &changed[c..];
            dropped = &dropped[d..];
            if changed.is_empty() && dropped.is_empty() {
                return messages;
            }
            messages.last_mut().expect("just pushed").more = true;
        }
    }
}

/// One renewal of a session's leases, received at `received`: answered only after a quorum
/// round that started after it arrived (batched with the others), by the leader's lease table.
async fn renew(
    node: &Node,
    caller: &Caller,
    req: proto::HeartbeatRequest,
    received: Instant,
) -> Result<Renewed, Status> {
    check_secret(&req.secret)?;
    let namespace = namespace_of(&req.namespace)?;
    node.ensure_leader()?;
    let session = SessionId(req.session_id);
    // Hashed once, before any lock: the batch checks it again under the state's read lock.
    let secret = SecretHash::of(&req.secret);
    {
        let applied = node.state.read().expect("state lock poisoned");
        authorize_session(table_of(&applied, &namespace)?, caller, session, &secret)?;
    }
    // A lease that already ran out is refused here, without spending a quorum round on it.
    if let Some(leases) =
        node.leases.lock().expect("lease lock poisoned").as_ref().and_then(|l| l.table(&namespace))
    {
        if !leases.renewable(session, received) {
            return Err(CoordinatorError::SessionExpired(session).into());
        }
    }
    let (reply, answer) = oneshot::channel();
    let pending = PendingRenewal { namespace, session, secret, received, reply };
    node.renewals
        .send(pending)
        .await
        .map_err(|_| CoordinatorError::Unavailable("node is shutting down".into()))?;
    let renewed =
        answer.await.map_err(|_| CoordinatorError::Unavailable("node is shutting down".into()))??;
    Ok(Renewed { leases: renewed.leases, ttl_ms: renewed.ttl.as_millis() as u64 })
}

/// Sends one item of a stream, unless the node stops first; `false` when the stream is over
/// (the caller hung up or the node is stopping), so no task waits on a reader that stopped
/// reading past the node's end.
async fn send_or_stop<T>(
    tx: &mpsc::Sender<Result<T, Status>>,
    item: Result<T, Status>,
    stopping: &tokio_util::sync::CancellationToken,
) -> bool {
    tokio::select! {
        _ = stopping.cancelled() => false,
        sent = tx.send(item) => sent.is_ok(),
    }
}

/// Reads the next heartbeat of a stream and renews it; `None` when the worker closed the stream.
/// A message that cannot be read is answered with an error, which ends the stream; so is a
/// stream left silent for `idle`, so that a frozen worker does not hold a stream forever.
async fn next_renewal(
    node: &Node,
    caller: &Caller,
    inbound: &mut tonic::Streaming<proto::HeartbeatRequest>,
    idle: std::time::Duration,
) -> Option<Result<Renewed, Status>> {
    match tokio::time::timeout(idle, inbound.message()).await {
        Ok(Ok(Some(request))) => Some(renew(node, caller, request, Instant::now()).await),
        Ok(Ok(None)) => None,
        Ok(Err(status)) if super::error::is_oversized(&status) => {
            Some(Err(CoordinatorError::MessageTooLarge(status.message().to_string()).into()))
        }
        Ok(Err(status)) => {
            Some(Err(Status::invalid_argument(format!("unreadable heartbeat: {}", status.message()))))
        }
        Err(_) => Some(Err(Status::deadline_exceeded(format!("no heartbeat for {idle:?}")))),
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn join(&self, req: Request<proto::JoinRequest>) -> Result<Response<proto::JoinResponse>, Status> {
        let caller = Caller::of(&req);
        let req = req.into_inner();
        let namespace = namespace_of(&req.namespace)?;
        self.node.ensure_leader()?;
        let weight = if req.weight == 0 { 1 } else { req.weight };
        check_join(&req.name, weight).map_err(CoordinatorError::Rejected)?;
        // A worker joins only under the name its certificate gives it: a join under another's
        // name would end that worker's session and take its partitions.
        caller.may_act_as(&req.name).map_err(CoordinatorError::NotAllowed)?;
        let (has_session, live_names) = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let table = table_of(&applied, &namespace)?;
            let has = table.sessions().values().any(|r| !r.leaving && r.name == req.name);
            // The session cap is the cluster's: every namespace's sessions count toward it.
            let live =
                applied.namespaces.iter().map(|(_, t)| t.sessions().values().filter(|r| !r.leaving).count());
            (has, live.sum())
        };
        // Held until the join is applied or fails: joins in flight count against the cap.
        // Keyed by namespace and name (a name holds one session per namespace); the rate and
        // the cap are the cluster's.
        let key = format!("{namespace}/{}", req.name);
        let _admitted =
            self.node.admission.admit(&key, has_session, live_names, std::time::Instant::now())?;
        // The secret goes to the worker in this answer and nowhere else; the log, every
        // replica's table and every snapshot keep only its hash.
        let secret = new_secret();
        let command = Command::Join { name: req.name, weight, secret: SecretHash::of(&secret) };
        match self.node.propose_entry(Proposal::to(&namespace, command)).await? {
            SmResponse::Joined { session, .. } => {
                let applied = self.node.state.read().expect("state lock poisoned");
                let config = applied.table(&namespace).and_then(|t| t.config());
                Ok(Response::new(proto::JoinResponse {
                    session_id: session.0,
                    secret,
                    lease_ttl_ms: config.map(|c| c.lease_ttl_ms).unwrap_or(0),
                    partition_count: config.map(|c| c.partition_count).unwrap_or(0),
                }))
            }
            other => Err(Status::internal(format!("unexpected response to join: {other:?}"))),
        }
    }

    async fn heartbeat(
        &self,
        req: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        let received = Instant::now();
        let caller = Caller::of(&req);
        let req = req.into_inner();
        let from = req.from_partition;
        Ok(Response::new(renew(&self.node, &caller, req, received).await?.page(from)))
    }

    type HeartbeatsStream = HeartbeatsStream;

    async fn heartbeats(
        &self,
        req: Request<tonic::Streaming<proto::HeartbeatRequest>>,
    ) -> Result<Response<HeartbeatsStream>, Status> {
        self.node.ensure_leader()?;
        let permit = self.node.stream_permit(true, &Caller::of(&req))?;
        // Two of the longest TTL any namespace has (which wins over this node's own setting):
        // a stream silent that long belongs to a session that has expired anyway. The stream
        // names its namespace only in its messages, so the longest is the one that is safe.
        let idle = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let ttl = applied
                .namespaces
                .iter()
                .filter_map(|(_, t)| t.config())
                .map(|c| std::time::Duration::from_millis(c.ttl_ceiling_ms().max(c.lease_ttl_ms)))
                .max();
            ttl.unwrap_or(self.node.config.lease_ttl) * 2
        };
        let caller = Caller::of(&req);
        let mut inbound = req.into_inner();
        // One answer in flight per stream: a worker sends its next heartbeat after the answer.
        let (tx, rx) = mpsc::channel(1);
        let node = self.node.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut view = StreamView::default();
            // Every wait also watches for the node stopping and the worker hanging up, so the
            // task (and the node it holds) never outlives either.
            loop {
                let answer = tokio::select! {
                    _ = tx.closed() => return,
                    _ = node.stopping.cancelled() => {
                        let _ = tx.try_send(Err(node.stopped().into()));
                        return;
                    }
                    answer = next_renewal(&node, &caller, &mut inbound, idle) => match answer {
                        Some(answer) => answer,
                        None => return, // the worker closed its side
                    },
                };
                match answer {
                    Ok(renewed) => {
                        for message in view.answer(renewed) {
                            if !send_or_stop(&tx, Ok(message), &node.stopping).await {
                                return;
                            }
                        }
                    }
                    Err(refused) => {
                        send_or_stop(&tx, Err(refused), &node.stopping).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn release(
        &self,
        req: Request<proto::ReleaseRequest>,
    ) -> Result<Response<proto::ReleaseResponse>, Status> {
        let caller = Caller::of(&req);
        let req = req.into_inner();
        check_secret(&req.secret)?;
        // Refused here, as apply would refuse it, rather than as a log entry.
        if !req.tokens.is_empty() && req.tokens.len() != req.partitions.len() {
            let why = format!("{} tokens for {} partitions", req.tokens.len(), req.partitions.len());
            return Err(CoordinatorError::InvalidArgument(why).into());
        }
        let namespace = namespace_of(&req.namespace)?;
        self.node.ensure_leader()?;
        let count = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let table = table_of(&applied, &namespace)?;
            let secret = SecretHash::of(&req.secret);
            authorize_session(table, &caller, SessionId(req.session_id), &secret)?;
            table.config().map(|c| c.partition_count).unwrap_or(0)
        };
        if let Some(&bad) = req.partitions.iter().find(|&&p| p >= count) {
            return Err(
                CoordinatorError::Rejected(Rejection::PartitionOutOfRange { partition: bad, count }).into()
            );
        }
        let command = if req.all {
            if !req.partitions.is_empty() {
                return Err(CoordinatorError::InvalidArgument("`all` with a partition list".into()).into());
            }
            Command::ReleaseAll { session: SessionId(req.session_id), secret: SecretHash::of(&req.secret) }
        } else {
            Command::Release {
                session: SessionId(req.session_id),
                secret: SecretHash::of(&req.secret),
                partitions: req.partitions.into_iter().map(PartitionId).collect(),
                tokens: req.tokens.into_iter().map(FencingToken).collect(),
            }
        };
        match self.node.propose_entry(Proposal::to(&namespace, command)).await? {
            SmResponse::Released { partitions } => Ok(Response::new(proto::ReleaseResponse {
                released: partitions.into_iter().map(|p| p.0).collect(),
            })),
            other => Err(Status::internal(format!("unexpected response to release: {other:?}"))),
        }
    }

    async fn leave(
        &self,
        req: Request<proto::LeaveRequest>,
    ) -> Result<Response<proto::LeaveResponse>, Status> {
        let caller = Caller::of(&req);
        let req = req.into_inner();
        check_secret(&req.secret)?;
        let namespace = namespace_of(&req.namespace)?;
        self.node.ensure_leader()?;
        {
            let applied = self.node.state.read().expect("state lock poisoned");
            let secret = SecretHash::of(&req.secret);
            authorize_session(table_of(&applied, &namespace)?, &caller, SessionId(req.session_id), &secret)?;
        }
        let leave =
            Command::Leave { session: SessionId(req.session_id), secret: SecretHash::of(&req.secret) };
        self.node.propose_entry(Proposal::to(&namespace, leave)).await?;
        Ok(Response::new(proto::LeaveResponse {}))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, req: Request<proto::WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let caller = Caller::of(&req);
        let req = req.into_inner();
        check_secret(&req.secret)?;
        let namespace = namespace_of(&req.namespace)?;
        self.node.ensure_leader()?;
        let session = SessionId(req.session_id);
        // Subscribe before reading the snapshot, so nothing falls between the two. Only the
        // entries that name this session reach the stream (see `store::SessionFanOut`).
        let mut events = self.node.sm.subscribe_session(&namespace, session);
        let (initial, from_index) = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let table = table_of(&applied, &namespace)?;
            authorize_session(table, &caller, session, &SecretHash::of(&req.secret))?;
            let index = applied.last_applied.map(|l| l.index).unwrap_or(0);
            (table.owned_by(session), index)
        };
        let permit = self.node.stream_permit(false, &caller)?;
        let (tx, rx) = mpsc::channel(1024);
        let service = CoordinatorService { node: self.node.clone() };
        tokio::spawn(async move {
            let _permit = permit;
            for (partition, record) in initial {
                let kind = if record.revoking { Kind::Revoking } else { Kind::Granted };
                if !send_or_stop(
                    &tx,
                    Ok(service.event_for(&namespace, kind, partition, record.token.0, from_index)),
                    &service.node.stopping,
                )
                .await
                {
                    return;
                }
            }
            loop {
                let received = tokio::select! {
                    _ = tx.closed() => return, // the worker hung up
                    _ = service.node.stopping.cancelled() => {
                        let _ = tx.try_send(Err(service.node.stopped().into()));
                        return;
                    }
                    received = events.recv() => received,
                };
                let applied = match received {
                    Some(Delivery::Entry(applied)) => applied,
                    // A snapshot replaced entries this stream did not see one by one, or the
                    // stream fell so far behind that its queue overflowed.
                    Some(Delivery::Resync) | None => {
                        send_or_stop(
                            &tx,
                            Err(Status::aborted("watch fell behind; reconnect to resynchronise")),
                            &service.node.stopping,
                        )
                        .await;
                        return;
                    }
                };
                if applied.index <= from_index {
                    continue;
                }
                for event in &applied.events {
                    let out =
                        match *event {
                            Event::Granted { partition, session: s, token } if s == session => service
                                .event_for(&namespace, Kind::Granted, partition, token.0, applied.index),
                            Event::Revoking { partition, session: s, token } if s == session => service
                                .event_for(&namespace, Kind::Revoking, partition, token.0, applied.index),
                            Event::Lost { partition, session: s, token, .. } if s == session => {
                                service.event_for(&namespace, Kind::Lost, partition, token.0, applied.index)
                            }
                            Event::Released { partition, session: s, token } if s == session => service
                                .event_for(&namespace, Kind::Released, partition, token.0, applied.index),
                            Event::SessionEnded { session: s } if s == session => {
                                send_or_stop(
                                    &tx,
                                    Err(Status::not_found(format!("session {session} ended"))),
                                    &service.node.stopping,
                                )
                                .await;
                                return;
                            }
                            _ => continue,
                        };
                    if !send_or_stop(&tx, Ok(out), &service.node.stopping).await {
                        return; // the worker hung up
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    type RoutesStream = RoutesStream;

    async fn routes(&self, req: Request<proto::RoutesRequest>) -> Result<Response<RoutesStream>, Status> {
        let namespace = namespace_of(&req.get_ref().namespace)?;
        self.node.ensure_leader()?;
        let permit = self.node.stream_permit(false, &Caller::of(&req))?;
        let mut events = self.node.sm.subscribe();
        let (initial, from_index) = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let table = table_of(&applied, &namespace)?;
            let rows: Vec<proto::RouteUpdate> =
                (0..table.partitions().len() as u32).map(|p| route_of(table, PartitionId(p))).collect();
            (rows, applied.last_applied.map(|l| l.index).unwrap_or(0))
        };
        let (tx, rx) = mpsc::channel(1024);
        let node = self.node.clone();
        tokio::spawn(async move {
            let _permit = permit;
            for row in initial {
                if !send_or_stop(&tx, Ok(row), &node.stopping).await {
                    return;
                }
            }
            loop {
                let received = tokio::select! {
                    _ = tx.closed() => return, // the caller hung up
                    _ = node.stopping.cancelled() => {
                        let _ = tx.try_send(Err(node.stopped().into()));
                        return;
                    }
                    received = events.recv() => received,
                };
                let applied = match received {
                    Ok(applied) if !applied.snapshot || applied.index <= from_index => applied,
                    // Lagged, closed, or a snapshot replaced entries not seen one by one.
                    _ => {
                        send_or_stop(
                            &tx,
                            Err(Status::aborted("routes fell behind; reconnect")),
                            &node.stopping,
                        )
                        .await;
                        return;
                    }
                };
                if applied.index <= from_index || applied.namespace != namespace {
                    continue;
                }
                // A namespace deleted (and perhaps made again) is not the table this stream
                // began with: its follower must start over, if there is anything to follow.
                let deleted = applied.events.iter().any(|e| matches!(e, Event::NamespaceDeleted));
                let rows: Option<Vec<proto::RouteUpdate>> = {
                    let state = node.state.read().expect("state lock poisoned");
                    state.table(&namespace).filter(|_| !deleted).map(|table| {
                        applied
                            .events
                            .iter()
                            .filter_map(|e| e.ownership())
                            .map(|(p, _)| route_of(table, p))
                            .collect()
                    })
                };
                let Some(rows) = rows else {
                    let gone = CoordinatorError::Rejected(Rejection::UnknownNamespace(namespace.to_string()));
                    send_or_stop(&tx, Err(gone.into()), &node.stopping).await;
                    return;
                };
                for row in rows {
                    if !send_or_stop(&tx, Ok(row), &node.stopping).await {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn status(
        &self,
        req: Request<proto::StatusRequest>,
    ) -> Result<Response<proto::StatusResponse>, Status> {
        let req = req.into_inner();
        let namespace = namespace_of(&req.namespace)?;
        if req.linearizable {
            self.node.ensure_leader()?;
            self.node.read_linearizably().await?;
        }
        Ok(Response::new(status_of(&self.node, &namespace, &req)?))
    }
}

/// What `Status` answers, read from this node's applied state (and, on the leader, its lease
/// table): the state first, then the leases, never both locks at once.
pub(crate) fn status_of(
    node: &Node,
    namespace: &Namespace,
    req: &proto::StatusRequest,
) -> Result<proto::StatusResponse, CoordinatorError> {
    let limit = match req.limit {
        0 => STATUS_ROWS_PER_PAGE,
        n => n.min(STATUS_ROWS_PER_PAGE),
    } as usize;
    let metrics = node.raft.metrics().borrow().clone();
    let leader_id = metrics.current_leader.unwrap_or(0);
    // Read before the state: the lease table follows the applied entries, so every move it
    // counts is granted already in the state read below, and a hand-over applied between the two
    // reads is not counted both as revoking and as unconfirmed.
    // A leader that has no table for the namespace yet has seen nothing move in it this term.
    let unconfirmed_moves = node
        .leases
        .lock()
        .expect("lease lock poisoned")
        .as_ref()
        .map(|l| l.table(namespace).map_or(0, |t| t.unconfirmed_moves() as u32));
    let mut answer = {
        let applied = node.state.read().expect("state lock poisoned");
        let state = table_of(&applied, namespace)?;
        let nodes: Vec<proto::Node> = applied
            .membership
            .membership()
            .nodes()
            .map(|(id, n)| proto::Node {
                id: *id,
                addr: n.client_addr.clone(),
                peer_addr: n.peer_addr.clone(),
            })
            .collect();
        let leader_addr =
            nodes.iter().find(|n| n.id == leader_id).map(|n| n.addr.clone()).unwrap_or_default();
        // The sessions of the owner asked for (a leaving one still holds rows), as ids: the
        // filter below compares ids, not names, whatever the table's size.
        let of_owner: Option<std::collections::BTreeSet<SessionId>> = req
            .owner
            .as_ref()
            .map(|name| state.sessions().iter().filter(|(_, r)| r.name == *name).map(|(s, _)| *s).collect());
        let rows = state.partitions();
        let mut partitions = Vec::new();
        let mut next_partition = None;
        if !req.omit_partitions {
            let from = (req.from_partition as usize).min(rows.len());
            let wanted = |r: &crate::ownership::PartitionRecord| match &of_owner {
                None => true,
                Some(ids) => [r.owner, r.next].into_iter().flatten().any(|s| ids.contains(&s)),
            };
            for (p, r) in rows.iter().enumerate().skip(from) {
                if partitions.len() == limit {
                    next_partition = Some(p as u32);
                    break;
                }
                if !wanted(r) {
                    continue;
                }
                partitions.push(proto::PartitionRow {
                    partition: p as u32,
                    owner: r.owner.map(|s| s.0).unwrap_or(0),
                    token: r.token.0,
                    revoking: r.revoking,
                    lease_remaining_ms: None,
                    next: r.next.map_or(0, |s| s.0),
                });
            }
        }
        let sessions = state
            .sessions()
            .iter()
            .map(|(s, r)| proto::Session {
                id: s.0,
                name: r.name.clone(),
                weight: r.weight,
                leaving: r.leaving,
                owned: state.owned_count(*s) as u32,
                lease_remaining_ms: None,
            })
            .collect();
        let config = state.config();
        proto::StatusResponse {
            node_id: node.config.id,
            leader_id,
            leader_addr,
            nodes,
            sessions,
            partitions,
            partition_count: config.map(|c| c.partition_count).unwrap_or(0),
            lease_ttl_ms: config.map(|c| c.lease_ttl_ms).unwrap_or(0),
            last_applied: applied.last_applied.map(|l| l.index).unwrap_or(0),
            next_partition,
            term: metrics.current_term,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            version: env!("CARGO_PKG_VERSION").to_string(),
            stopping: node.draining.is_cancelled(),
            unowned: state.unowned_count() as u32,
            revoking: state.revoking_count() as u32,
            linearizable: req.linearizable,
            maintenance: state.maintenance(),
            max_revoking: config.and_then(|c| c.max_revoking),
            lease_ttl_ceiling_ms: config.filter(|c| c.ttl_change.is_some()).map_or(0, |c| c.ttl_ceiling_ms()),
            unconfirmed_moves,
            namespace: namespace.to_string(),
        }
    };
    // The leader's clock: only the node that judges leases can say how long they have left.
    if let Some(table) =
        node.leases.lock().expect("lease lock poisoned").as_ref().and_then(|l| l.table(namespace))
    {
        let now = Instant::now();
        let millis = |d: std::time::Duration| d.as_millis() as u64;
        for s in &mut answer.sessions {
            s.lease_remaining_ms = table.session_remaining(SessionId(s.id), now).map(millis);
        }
        for row in answer.partitions.iter_mut().filter(|r| r.owner != 0) {
            row.lease_remaining_ms = if row.revoking {
                table.revoke_remaining(PartitionId(row.partition), now)
            } else {
                table.session_remaining(SessionId(row.owner), now)
            }
            .map(millis);
        }
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    //! Heartbeat answers stay small whatever a session owns.

    use super::*;

    fn renewed(leases: impl IntoIterator<Item = (u32, u64)>) -> Renewed {
        Renewed { leases: leases.into_iter().collect(), ttl_ms: 1000 }
    }

    /// Replays a stream's messages as the worker library does.
    fn replay(view: &mut std::collections::BTreeMap<u32, u64>, messages: &[proto::HeartbeatResponse]) {
        for (i, m) in messages.iter().enumerate() {
            assert_eq!(m.more, i + 1 < messages.len(), "only the last message ends the answer");
            for p in &m.dropped {
                view.remove(p);
            }
            view.extend(m.renewed.iter().map(|l| (l.partition, l.token)));
        }
    }

    #[test]
    fn a_stream_answer_carries_only_what_changed_and_fits_in_messages() {
        let mut server = StreamView::default();
        let mut worker = std::collections::BTreeMap::new();
        // Half of a million-partition table: the first answer is split, the next is empty.
        let all: Vec<(u32, u64)> = (0..500_000u32).map(|p| (p * 2, 7)).collect();
        let first = server.answer(renewed(all.clone()));
        assert_eq!(first.len(), 500_000usize.div_ceil(LEASES_PER_MESSAGE));
        assert!(first.iter().all(|m| m.renewed.len() + m.dropped.len() <= LEASES_PER_MESSAGE));
        replay(&mut worker, &first);
        assert_eq!(worker, all.iter().copied().collect());
        let steady = server.answer(renewed(all.clone()));
        assert_eq!(steady.len(), 1);
        assert!(steady[0].renewed.is_empty() && steady[0].dropped.is_empty());
        // A revoke (dropped), a new grant (added) and a grant again under a newer token.
        let mut next = all.clone();
        next.retain(|(p, _)| *p != 4);
        next.push((3, 9));
        next.sort();
        next[0].1 = 11;
        let change = server.answer(renewed(next.clone()));
        assert_eq!(change.len(), 1);
        assert_eq!(change[0].dropped, vec![4]);
        assert_eq!(change[0].renewed.len(), 2);
        replay(&mut worker, &change);
        assert_eq!(worker, next.iter().copied().collect());
        // Everything taken away at once.
        let gone = server.answer(renewed([]));
        replay(&mut worker, &gone);
        assert!(worker.is_empty());
    }

    #[test]
    fn a_unary_answer_is_one_page_and_says_where_the_next_starts() {
        let leases: Vec<(u32, u64)> = (0..100_000u32).map(|p| (p, 3)).collect();
        let first = renewed(leases.clone()).page(0);
        assert_eq!(first.renewed.len(), LEASES_PER_MESSAGE);
        let next = first.next_partition.expect("a second page");
        let second = renewed(leases).page(next);
        assert_eq!(second.renewed.len(), 100_000 - LEASES_PER_MESSAGE);
        assert_eq!(second.next_partition, None);
    }
}
