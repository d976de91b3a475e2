//! The leader's duties: configure a new cluster, decide placement and propose it, keep the
//! lease table, propose expiries, and acknowledge renewals in batches after a quorum round.

use super::leadership::Leadership;
use super::{CoordinatorError, Node, PendingRenewal};
use crate::ids::SessionId;
use crate::lease::Due;
use crate::ownership::{Command, Event, Namespace, Proposal};
use crate::store::AppliedEvent;
use futures::stream::{FuturesUnordered, StreamExt};
use openraft::ServerState;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Most renewals answered by one quorum round.
const MAX_RENEWAL_BATCH: usize = 16384;

/// A placement decision being proposed, which says its namespace when it is done.
type Placing = Pin<Box<dyn Future<Output = Namespace> + Send>>;

/// Follows leadership, applied events and the clock; proposes configuration and expiries.
///
/// Nothing here waits for a commit: the expiry proposal in flight is one more branch of the
/// loop's `select!`, one at a time, so that a slow commit (or one that never comes, on a leader
/// cut off in a minority) cannot keep this loop from following applied events or noticing that
/// leadership moved. (A future polled here, not a spawned task: the whole-stack simulation
/// replays a seed exactly only if no task's scheduling depends on the process.)
///
/// Placement is decided per namespace, each with at most one decision in flight: a namespace
/// whose decisions are large or slow to commit (a join storm) does not hold back another's.
pub(crate) async fn run_duties(node: Arc<Node>, cancel: CancellationToken) {
    let mut metrics = node.raft.metrics();
    let mut events = node.sm.subscribe();
    let mut tick = tokio::time::interval(node.config.expiry_check_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading_term: Option<u64> = None;
    // The expiry proposal in flight, if any: due leases are reported again until their expiry
    // is applied, so one at a time is enough and a failed one is retried on a later tick.
    // Dropping it (on a leadership change) abandons the wait, not the entry.
    let mut proposing: Option<Pin<Box<dyn Future<Output = ()> + Send>>> = None;
    // The placement decisions in flight (one per namespace at most), and the namespaces whose
    // table changed since their last decision was made. One at a time per namespace: the next
    // is made on the table the previous one left.
    let mut placing: FuturesUnordered<Placing> = FuturesUnordered::new();
    let mut in_flight: BTreeSet<Namespace> = BTreeSet::new();
    let mut replan: BTreeSet<Namespace> = BTreeSet::new();
    loop {
        if node.draining.is_cancelled() {
            // A stopping node decides nothing more (see the handover module); whatever is in
            // flight is left to the log.
            proposing = None;
            placing.clear();
            in_flight.clear();
            replan.clear();
        }
        if leading_term.is_some() {
            let ready: Vec<Namespace> =
                replan.iter().filter(|ns| !in_flight.contains(*ns)).cloned().collect();
            for namespace in ready {
                replan.remove(&namespace);
                if let Some(decision) = next_placement(&node, &namespace) {
                    in_flight.insert(namespace);
                    placing.push(Box::pin(decision));
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = metrics.changed() => {
                if changed.is_err() {
                    return; // raft shut down
                }
                let m = metrics.borrow().clone();
                let leading = m.state == ServerState::Leader && m.current_leader == Some(node.config.id);
                match (leading, leading_term) {
                    (true, Some(term)) if term == m.current_term => {}
                    (true, _) => {
                        proposing = None;
                        placing.clear();
                        in_flight.clear();
                        leading_term = Some(m.current_term);
                        // Nothing is expired before this node has applied as far as its log
                        // reached now (see `LeaseTable::hold_until_applied`).
                        replan = become_leader(&node, m.current_term, m.last_log_index.unwrap_or(0));
                    }
                    (false, Some(_)) => {
                        proposing = None;
                        placing.clear();
                        in_flight.clear();
                        replan.clear();
                        leading_term = None;
                        *node.leases.lock().expect("lease lock poisoned") = None;
                        tracing::info!(node = node.config.id, "no longer the leader");
                    }
                    (false, None) => {}
                }
            }
            received = events.recv() => match received {
                Ok(applied) => {
                    observe(&node, &applied);
                    if leading_term.is_some() {
                        replan.insert(applied.namespace.clone());
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    // Missed events: start every lease over from now, which can only delay expiry.
                    tracing::warn!(missed = n, "lease table fell behind the applied events; resetting");
                    let state = node.state.read().expect("state lock poisoned");
                    if let Some(leadership) = node.leases.lock().expect("lease lock poisoned").as_mut() {
                        leadership.reset(Instant::now(), &state);
                    }
                    if leading_term.is_some() {
                        replan.extend(state.namespaces.iter().map(|(ns, _)| ns.clone()));
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = async { proposing.as_mut().expect("guarded").await }, if proposing.is_some() => {
                proposing = None;
            }
            _ = node.moves_confirmed.notified() => {
                // Confirmations free revoke budget; only a namespace with a budget gains by it.
                if leading_term.is_some() {
                    let state = node.state.read().expect("state lock poisoned");
                    let budgeted = state
                        .namespaces
                        .iter()
                        .filter(|(_, t)| t.config().is_some_and(|c| c.max_revoking.is_some()));
                    replan.extend(budgeted.map(|(ns, _)| ns.clone()));
                }
            }
            Some(namespace) = placing.next(), if !placing.is_empty() => {
                // Whatever came of it (applied, refused as stale, not committed), decide again
                // on the table as it is now.
                in_flight.remove(&namespace);
                replan.insert(namespace);
            }
            _ = tick.tick() => {
                if proposing.is_some() || node.draining.is_cancelled() {
                    continue;
                }
                let index = node.state.read().expect("state lock poisoned").last_applied.map_or(0, |l| l.index);
                let now = Instant::now();
                let due: Vec<(Namespace, Due)> = match node.leases.lock().expect("lease lock poisoned").as_mut() {
                    Some(leadership) if Some(leadership.term) == leading_term => {
                        leadership.applied(index);
                        leadership
                            .tables_mut()
                            .map(|(ns, table)| (ns.clone(), table.due(now)))
                            .filter(|(_, due)| !due.is_empty())
                            .collect()
                    }
                    _ => continue,
                };
                if !due.is_empty() {
                    proposing = Some(Box::pin(propose_expiries(node.clone(), due)));
                }
            }
        }
    }
}

/// The next placement decision for `namespace` and the future that proposes it, if its table
/// needs one. Decided on the applied table under the read lock; proposed without it, one
/// command after another, stopping at the first that is not applied (the table changed: decide
/// again). The future ends with the namespace's name.
fn next_placement(
    node: &Arc<Node>,
    namespace: &Namespace,
) -> Option<impl Future<Output = Namespace> + Send + 'static> {
    let commands = {
        let applied = node.state.read().expect("state lock poisoned");
        let table = applied.table(namespace)?;
        // Moves granted but not yet confirmed by their new owner are still in motion.
        let unconfirmed = node
            .leases
            .lock()
            .expect("lease lock poisoned")
            .as_mut()
            .map_or(0, |l| l.table_mut(Instant::now(), namespace, table).unconfirmed_moves());
        crate::planner::plan_all_in_motion(table, &node.config.placement, unconfirmed)
    };
    if commands.is_empty() {
        return None;
    }
    let node = node.clone();
    let namespace = namespace.clone();
    Some(async move {
        for command in commands {
            if let Command::Place { grants, revokes } = &command {
                tracing::debug!(%namespace, grants = grants.len(), revokes = revokes.len(), "proposing placement");
            }
            match node.propose_entry(Proposal::to(&namespace, command)).await {
                Ok(_) => {}
                Err(CoordinatorError::Rejected(r)) => {
                    tracing::debug!(%namespace, reason = %r, "placement refused; deciding again");
                    break;
                }
                Err(e) => {
                    tracing::warn!(%namespace, error = %e, "could not propose placement");
                    break;
                }
            }
        }
        namespace
    })
}

/// What a confirmed renewal gives its session: the grants it renewed (partition, token, not
/// revoking), and the TTL the leader extended its lease by, which is what the worker must be
/// told (see [`LeaseTable::renew`]).
pub(crate) struct RenewedLeases {
    pub leases: Vec<(u32, u64)>,
    pub ttl: std::time::Duration,
}

async fn propose_expiries(node: Arc<Node>, due: Vec<(Namespace, Due)>) {
    for (namespace, due) in due {
        let propose = |command| node.propose_entry(Proposal::to(&namespace, command));
        if !due.sessions.is_empty() {
            tracing::info!(%namespace, sessions = ?due.sessions, "session leases expired");
            if let Err(e) = propose(Command::Expire { sessions: due.sessions }).await {
                tracing::warn!(%namespace, error = %e, "could not propose session expiry");
            }
        }
        if !due.revoking.is_empty() {
            tracing::info!(%namespace, partitions = due.revoking.len(), "revoking leases expired");
            if let Err(e) = propose(Command::ExpireRevoking { partitions: due.revoking }).await {
                tracing::warn!(%namespace, error = %e, "could not propose revoke expiry");
            }
        }
        if let Some(changed_at) = due.settle {
            tracing::info!(%namespace, changed_at, "every lease granted before the lease TTL change has run out");
            if let Err(e) = propose(Command::SettleLeaseTtl { changed_at }).await {
                tracing::warn!(%namespace, error = %e, "could not settle the lease TTL change");
            }
        }
    }
}

/// Starts a term of leadership: a fresh lease table per namespace, each judged by its
/// namespace's TTL. Returns the namespaces to decide placement for.
fn become_leader(node: &Arc<Node>, term: u64, last_log_index: u64) -> BTreeSet<Namespace> {
    let (configured, namespaces) = {
        let applied = node.state.read().expect("state lock poisoned");
        let leadership =
            Leadership::new(term, Instant::now(), &applied, node.config.lease_ttl, last_log_index);
        *node.leases.lock().expect("lease lock poisoned") = Some(leadership);
        let namespaces = applied.namespaces.iter().map(|(ns, _)| ns.clone()).collect();
        (applied.default_table().config(), namespaces)
    };
    tracing::info!(node = node.config.id, term, "became the leader; every lease runs one TTL from now");
    match configured {
        None => {
            let node = node.clone();
            tokio::spawn(async move {
                let command = Command::Configure {
                    partition_count: node.config.partition_count,
                    lease_ttl_ms: node.config.lease_ttl.as_millis() as u64,
                    max_revoking: node.config.max_revoking,
                };
                match node.propose(command).await {
                    Ok(_) => tracing::info!(partitions = node.config.partition_count, "cluster configured"),
                    Err(e) => tracing::error!(error = %e, "could not configure the cluster"),
                }
            });
        }
        Some(have) => {
            if let Some(differs) = config_differs(&node.config, have) {
                tracing::warn!("{differs}");
            }
        }
    }
    namespaces
}

/// Says how a node's own settings differ from the cluster's configuration, which wins.
pub(crate) fn config_differs(config: &super::NodeConfig, have: crate::ownership::Config) -> Option<String> {
    let want = crate::ownership::Config {
        partition_count: config.partition_count,
        lease_ttl_ms: config.lease_ttl.as_millis() as u64,
        max_revoking: config.max_revoking,
        ttl_change: have.ttl_change,
    };
    let budget =
        |b: Option<u32>| b.map_or("no revoke budget".to_string(), |n| format!("a revoke budget of {n}"));
    (have != want).then(|| {
        format!(
            "this node was started with {} partitions, a {} ms lease TTL and {}, but the cluster has \
             {} partitions, a {} ms lease TTL and {}; the cluster's values are used",
            want.partition_count,
            want.lease_ttl_ms,
            budget(want.max_revoking),
            have.partition_count,
            have.lease_ttl_ms,
            budget(have.max_revoking)
        )
    })
}

fn observe(node: &Node, applied: &AppliedEvent) {
    // Every replica counts the decisions it applies, labelled with its id: the same decision is
    // counted once per node, so read one node's series (or the maximum over nodes), not the sum.
    // One registry lookup per kind and batch, not per event: a join can grant a million.
    let mut counts = [0u64; 4];
    for event in &applied.events {
        match event {
            Event::Granted { .. } => counts[0] += 1,
            Event::Revoking { .. } => counts[1] += 1,
            Event::Released { .. } => counts[2] += 1,
            Event::Lost { .. } => counts[3] += 1,
            Event::Configured { .. }
            | Event::SessionStarted { .. }
            | Event::SessionLeaving { .. }
            | Event::SessionEnded { .. }
            | Event::MaintenanceChanged { .. }
            | Event::WeightChanged { .. }
            | Event::Pinned { .. }
            | Event::LeaseTtlChanged { .. }
            | Event::LeaseTtlSettled { .. }
            | Event::RevokeBudgetChanged { .. }
            | Event::NamespaceDeleted => {}
        }
    }
    let names =
        ["tenure_grants_total", "tenure_revokes_total", "tenure_releases_total", "tenure_expiries_total"];
    let id = node.config.id.to_string();
    for (name, n) in names.into_iter().zip(counts).filter(|(_, n)| *n > 0) {
        metrics::counter!(name, "node" => id.clone()).increment(n);
    }
    // The state is read before the lease lock is taken, as everywhere else.
    let state = node.state.read().expect("state lock poisoned");
    let mut leases = node.leases.lock().expect("lease lock poisoned");
    if let Some(leadership) = leases.as_mut() {
        let deleted = applied.events.iter().any(|e| matches!(e, Event::NamespaceDeleted));
        // Deleted (and perhaps created again since, which that entry's events will say): its
        // leases go with it.
        match state.table(&applied.namespace).filter(|_| !deleted) {
            None => leadership.forget(&applied.namespace),
            Some(table) => {
                let now = Instant::now();
                let leases = leadership.table_mut(now, &applied.namespace, table);
                for latency in leases.observe(now, &applied.events) {
                    metrics::histogram!("tenure_move_latency_seconds").record(latency.as_secs_f64());
                }
            }
        }
    }
    drop(leases);
    drop(state);
    // The per-worker gauges are the default namespace's only, as the status page is.
    if !applied.namespace.is_default() {
        return;
    }
    let touched: BTreeSet<SessionId> =
        applied.events.iter().filter_map(|e| e.ownership()).map(|(_, s)| s).collect();
    if !touched.is_empty() {
        publish_owned_by(node, &touched);
    }
}

/// Sets `tenure_owned_partitions{worker}` for the names of `sessions` only (the ones an applied
/// entry changed), and the moves in flight: an entry costs the workers it touched, not every
/// worker (with 10,000 sessions, setting every gauge after every entry was most of a join
/// storm's CPU).
fn publish_owned_by(node: &Node, sessions: &BTreeSet<SessionId>) {
    let state = node.state.read().expect("state lock poisoned");
    let state = state.default_table();
    let names: BTreeSet<&str> =
        sessions.iter().filter_map(|s| state.session(*s)).map(|r| r.name.as_str()).collect();
    for name in names {
        let count: usize = state.sessions_named(name).map(|s| state.owned_count(s)).sum();
        metrics::gauge!("tenure_owned_partitions", "worker" => name.to_string()).set(count as f64);
    }
    metrics::gauge!("tenure_moves_in_flight", "node" => node.config.id.to_string())
        .set(state.revoking_count() as f64);
}

/// Sets `tenure_owned_partitions{worker}` for every worker name with a session, from the
/// applied table. Only names with a session are set: the exporter drops a series nobody has
/// set for a few refresh periods, so a name whose session ended leaves no series behind.
fn publish_owned(node: &Node) {
    let state = node.state.read().expect("state lock poisoned");
    let mut owned: HashMap<&str, usize> = HashMap::new();
    for (session, record) in state.default_table().sessions() {
        *owned.entry(record.name.as_str()).or_default() += state.default_table().owned_count(*session);
    }
    for (name, count) in owned {
        metrics::gauge!("tenure_owned_partitions", "worker" => name.to_string()).set(count as f64);
    }
    // Moves in flight: partitions revoked and not yet released or expired.
    metrics::gauge!("tenure_moves_in_flight", "node" => node.config.id.to_string())
        .set(state.default_table().revoking_count() as f64);
}

/// Re-publishes the per-worker gauges every `gauge_refresh`, on every node, so that the series
/// of a live worker never goes idle while one whose session ended does (see [`publish_owned`]).
pub(crate) async fn refresh_gauges(node: Arc<Node>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(node.config.gauge_refresh);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => publish_owned(&node),
        }
    }
}

/// Answers renewals in batches: one `ensure_linearizable` round confirms leadership after every
/// renewal in the batch arrived; only then are their leases extended from their arrival times.
pub(crate) async fn run_renewals(
    node: Arc<Node>,
    mut rx: mpsc::Receiver<PendingRenewal>,
    cancel: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => return,
            next = rx.recv() => match next { Some(r) => r, None => return },
        };
        let mut batch = vec![first];
        while batch.len() < MAX_RENEWAL_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let node_label = node.config.id.to_string();
        metrics::histogram!("tenure_renewal_batch_size", "node" => node_label.clone())
            .record(batch.len() as f64);
        // A node that no longer leads, or is stopping, answers without a quorum round.
        if let Err(not_leader) = node.ensure_leader() {
            for r in batch {
                let _ = r.reply.send(Err(not_leader.clone()));
            }
            continue;
        }
        let confirmed = node.raft.ensure_linearizable().await;
        if let Err(e) = confirmed {
            let err = match node.ensure_leader() {
                Err(not_leader) => not_leader,
                Ok(()) => CoordinatorError::Unavailable(format!("leadership not confirmed: {e}")),
            };
            for r in batch {
                let _ = r.reply.send(Err(err.clone()));
            }
            continue;
        }
        let term = node.current_term();
        let now = Instant::now();
        let applied = node.state.read().expect("state lock poisoned");
        let mut leases = node.leases.lock().expect("lease lock poisoned");
        let mut answers = Vec::with_capacity(batch.len());
        let mut wanted: HashMap<(Namespace, SessionId), Vec<(u32, u64)>> = HashMap::new();
        let mut freed_budget = false;
        for r in batch {
            let table = match applied.table(&r.namespace) {
                Some(table) => table,
                None => {
                    let unknown = crate::ownership::Rejection::UnknownNamespace(r.namespace.to_string());
                    answers.push((
                        r.namespace,
                        r.session,
                        r.received,
                        r.reply,
                        Err(CoordinatorError::Rejected(unknown)),
                    ));
                    continue;
                }
            };
            let answer = match table.authenticate_hash(r.session, &r.secret) {
                Err(rejection) => Err(CoordinatorError::Rejected(rejection)),
                Ok(_) => match leases.as_mut() {
                    // No table, or one of an earlier term than the one just confirmed.
                    Some(leadership) if leadership.term != term => {
                        Err(CoordinatorError::Unavailable("leadership is changing; retry".into()))
                    }
                    None => Err(node
                        .ensure_leader()
                        .err()
                        .unwrap_or(CoordinatorError::Unavailable("leadership is changing; retry".into()))),
                    Some(leadership) => {
                        // A renewal may start a session the table has not seen yet (its first
                        // heartbeat overtook the applied join), or be the first of a namespace
                        // created since the term began: the table is made and judged by the
                        // namespace's TTL, even if the duty loop has not seen it applied yet.
                        let leases = leadership.table_mut(now, &r.namespace, table);
                        let unconfirmed_before = leases.unconfirmed_moves();
                        match leases.renew(r.session, r.received) {
                            Some(ttl) => {
                                // Only a budget makes a confirmation free anything for the
                                // next decision.
                                freed_budget |= leases.unconfirmed_moves() < unconfirmed_before
                                    && table.config().is_some_and(|c| c.max_revoking.is_some());
                                node.renewals_confirmed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                wanted.insert((r.namespace.clone(), r.session), Vec::new());
                                Ok(ttl)
                            }
                            None => Err(CoordinatorError::SessionExpired(r.session)),
                        }
                    }
                },
            };
            answers.push((r.namespace, r.session, r.received, r.reply, answer));
        }
        if freed_budget {
            node.moves_confirmed.notify_one();
        }
        drop(leases);
        // What each renewed session owns, from the owner index: the cost follows what the
        // sessions own, not the size of the table.
        for ((namespace, session), list) in wanted.iter_mut() {
            let Some(table) = applied.table(namespace) else { continue };
            for (p, record) in table.owned_by(*session) {
                if !record.revoking {
                    list.push((p.0, record.token.0));
                }
            }
        }
        drop(applied);
        // From a renewal's arrival to its answer: the wait for the batch, the quorum round and
        // the owner lookup, as the worker sees it (less the network).
        let latency = metrics::histogram!("tenure_renewal_seconds", "node" => node_label);
        for (namespace, session, received, reply, answer) in answers {
            latency.record(received.elapsed().as_secs_f64());
            let leases = |ttl| RenewedLeases {
                leases: wanted.get(&(namespace, session)).cloned().unwrap_or_default(),
                ttl,
            };
            let _ = reply.send(answer.map(leases));
        }
    }
}
