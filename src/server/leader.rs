//! The leader's duties: configure a new cluster, keep the lease table, propose expiries, and
//! acknowledge renewals in batches after a quorum round.

use super::{CoordinatorError, Node, PendingRenewal};
use crate::lease::LeaseTable;
use crate::ownership::{Command, Event};
use crate::store::AppliedEvent;
use openraft::ServerState;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Most renewals answered by one quorum round.
const MAX_RENEWAL_BATCH: usize = 16384;

/// Follows leadership, applied events and the clock; proposes configuration and expiries.
pub(crate) async fn run_duties(node: Arc<Node>, cancel: CancellationToken) {
    let mut metrics = node.raft.metrics();
    let mut events = node.sm.subscribe();
    let mut tick = tokio::time::interval(node.config.expiry_check_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading_term: Option<u64> = None;
    loop {
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
                        leading_term = Some(m.current_term);
                        become_leader(&node).await;
                    }
                    (false, Some(_)) => {
                        leading_term = None;
                        *node.leases.lock().expect("lease lock poisoned") = None;
                        tracing::info!(node = node.config.id, "no longer the leader");
                    }
                    (false, None) => {}
                }
            }
            received = events.recv() => match received {
                Ok(applied) => observe(&node, &applied),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    // Missed events: start every lease over from now, which can only delay expiry.
                    tracing::warn!(missed = n, "lease table fell behind the applied events; resetting");
                    let state = node.state.read().expect("state lock poisoned");
                    if let Some(table) = node.leases.lock().expect("lease lock poisoned").as_mut() {
                        table.reset(Instant::now(), &state.state);
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = tick.tick() => {
                let due = match node.leases.lock().expect("lease lock poisoned").as_mut() {
                    Some(table) => table.due(Instant::now()),
                    None => continue,
                };
                if !due.sessions.is_empty() {
                    tracing::info!(sessions = ?due.sessions, "session leases expired");
                    if let Err(e) = node.propose(Command::Expire { sessions: due.sessions }).await {
                        tracing::warn!(error = %e, "could not propose session expiry");
                    }
                }
                if !due.revoking.is_empty() {
                    tracing::info!(partitions = due.revoking.len(), "revoking leases expired");
                    if let Err(e) = node.propose(Command::ExpireRevoking { partitions: due.revoking }).await {
                        tracing::warn!(error = %e, "could not propose revoke expiry");
                    }
                }
            }
        }
    }
}

async fn become_leader(node: &Arc<Node>) {
    let now = Instant::now();
    let configured = {
        let applied = node.state.read().expect("state lock poisoned");
        let mut table = LeaseTable::new(node.config.lease_ttl);
        table.reset(now, &applied.state);
        *node.leases.lock().expect("lease lock poisoned") = Some(table);
        applied.state.config()
    };
    tracing::info!(node = node.config.id, "became the leader; every lease runs one TTL from now");
    if configured.is_none() {
        let node = node.clone();
        tokio::spawn(async move {
            let command = Command::Configure {
                partition_count: node.config.partition_count,
                lease_ttl_ms: node.config.lease_ttl.as_millis() as u64,
            };
            match node.propose(command).await {
                Ok(_) => tracing::info!(partitions = node.config.partition_count, "cluster configured"),
                Err(e) => tracing::error!(error = %e, "could not configure the cluster"),
            }
        });
    } else if let Some(have) = configured {
        let want_ttl = node.config.lease_ttl.as_millis() as u64;
        if have.partition_count != node.config.partition_count || have.lease_ttl_ms != want_ttl {
            tracing::warn!(
                ?have,
                "this node's partition count or lease TTL differs from the cluster's; the cluster's wins"
            );
        }
    }
}

fn observe(node: &Node, applied: &AppliedEvent) {
    for event in &applied.events {
        match event {
            Event::Granted { .. } => metrics::counter!("tenure_grants_total").increment(1),
            Event::Revoking { .. } => metrics::counter!("tenure_revokes_total").increment(1),
            Event::Released { .. } => metrics::counter!("tenure_releases_total").increment(1),
            Event::Lost { .. } => metrics::counter!("tenure_expiries_total").increment(1),
            Event::SessionStarted { .. } | Event::SessionEnded { .. } => {}
        }
    }
    let mut leases = node.leases.lock().expect("lease lock poisoned");
    if let Some(table) = leases.as_mut() {
        for latency in table.observe(Instant::now(), &applied.events) {
            metrics::histogram!("tenure_move_latency_seconds").record(latency.as_secs_f64());
        }
    }
    drop(leases);
    if applied
        .events
        .iter()
        .any(|e| matches!(e, Event::Granted { .. } | Event::Lost { .. } | Event::Released { .. }))
    {
        let state = node.state.read().expect("state lock poisoned");
        let mut owned: HashMap<&str, usize> = HashMap::new();
        for (session, record) in state.state.sessions() {
            *owned.entry(record.name.as_str()).or_default() += state.state.owned_count(*session);
        }
        for (name, count) in owned {
            metrics::gauge!("tenure_owned_partitions", "worker" => name.to_string()).set(count as f64);
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
        let applied = node.state.read().expect("state lock poisoned");
        let mut leases = node.leases.lock().expect("lease lock poisoned");
        let mut answers = Vec::with_capacity(batch.len());
        let mut wanted: HashMap<crate::ids::SessionId, Vec<(u32, u64)>> = HashMap::new();
        for r in batch {
            let answer = match applied.state.authenticate(r.session, &r.secret) {
                Err(rejection) => Err(CoordinatorError::Rejected(rejection)),
                Ok(_) => match leases.as_mut() {
                    None => Err(node
                        .ensure_leader()
                        .err()
                        .unwrap_or(CoordinatorError::Unavailable("leadership is changing; retry".into()))),
                    Some(table) => {
                        if table.renew(r.session, r.received) {
                            wanted.insert(r.session, Vec::new());
                            Ok(())
                        } else {
                            Err(CoordinatorError::SessionExpired(r.session))
                        }
                    }
                },
            };
            answers.push((r.session, r.reply, answer));
        }
        drop(leases);
        // What each renewed session owns, from the owner index: the cost follows what the
        // sessions own, not the size of the table.
        for (session, list) in wanted.iter_mut() {
            for (p, record) in applied.state.owned_by(*session) {
                if !record.revoking {
                    list.push((p.0, record.token.0));
                }
            }
        }
        drop(applied);
        for (session, reply, answer) in answers {
            let _ = reply.send(answer.map(|()| wanted.get(&session).cloned().unwrap_or_default()));
        }
    }
}
