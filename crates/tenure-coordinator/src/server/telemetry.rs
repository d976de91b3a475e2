//! Raft's own figures as Prometheus series: term, leader, log and applied index, apply lag,
//! snapshot and purge points, time since the last quorum acknowledgement, and, on the leader,
//! each follower's replication lag. Read from openraft's metrics channel as it changes, so
//! nothing here touches the log or the state machine.
//!
//! Every series carries the `node` label: in a process that hosts several nodes (tests) they
//! stay apart. openraft 0.9 does not publish the commit index; `tenure_raft_apply_lag` counts
//! entries this node holds but has not applied, which includes the uncommitted tail.

use super::Node;
use crate::ids::NodeId;
use crate::raft::Member;
use openraft::{RaftMetrics, ServerState};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Publishes every change of the node's Raft metrics until `cancel` or Raft stops, and again
/// every `gauge_refresh`: the exporter drops a gauge nobody set for a few refresh periods, and
/// a quiet follower's term must not vanish from the scrape.
pub(crate) async fn follow_raft(node: Arc<Node>, cancel: CancellationToken) {
    let mut metrics = node.raft.metrics();
    let mut tick = tokio::time::interval(node.config.gauge_refresh);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut followers: Vec<NodeId> = Vec::new();
    loop {
        let current = metrics.borrow_and_update().clone();
        publish(&current, &mut followers);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
            changed = metrics.changed() => if changed.is_err() { return },
        }
    }
}

fn publish(m: &RaftMetrics<NodeId, Member>, followers: &mut Vec<NodeId>) {
    let node = m.id.to_string();
    let gauge = |name: &'static str, value: f64| metrics::gauge!(name, "node" => node.clone()).set(value);
    let leading = m.state == ServerState::Leader && m.current_leader == Some(m.id);
    let last_log = m.last_log_index.unwrap_or(0);
    let applied = m.last_applied.map_or(0, |l| l.index);
    gauge("tenure_raft_term", m.current_term as f64);
    // 0 while no leader is known (node ids start at 1).
    gauge("tenure_raft_leader", m.current_leader.unwrap_or(0) as f64);
    gauge("tenure_raft_is_leader", if leading { 1.0 } else { 0.0 });
    gauge("tenure_raft_last_log_index", last_log as f64);
    gauge("tenure_raft_applied_index", applied as f64);
    gauge("tenure_raft_apply_lag", last_log.saturating_sub(applied) as f64);
    gauge("tenure_raft_snapshot_index", m.snapshot.map_or(0, |l| l.index) as f64);
    gauge("tenure_raft_purged_index", m.purged.map_or(0, |l| l.index) as f64);
    if let Some(ms) = m.millis_since_quorum_ack {
        gauge("tenure_raft_quorum_ack_age_seconds", ms as f64 / 1e3);
    }
    // A follower's lag: entries the leader holds that the follower has not acknowledged. Set
    // to 0 for followers of an earlier leadership of this node, so no stale lag lingers.
    let now: Vec<(NodeId, u64)> = m
        .replication
        .iter()
        .flatten()
        .filter(|(id, _)| **id != m.id)
        .map(|(id, matched)| (*id, last_log.saturating_sub(matched.map_or(0, |l| l.index))))
        .collect();
    for gone in followers.iter().filter(|f| !now.iter().any(|(id, _)| id == *f)) {
        metrics::gauge!("tenure_raft_replication_lag", "node" => node.clone(), "follower" => gone.to_string())
            .set(0.0);
    }
    for (follower, lag) in &now {
        metrics::gauge!("tenure_raft_replication_lag", "node" => node.clone(), "follower" => follower.to_string())
            .set(*lag as f64);
    }
    *followers = now.into_iter().map(|(id, _)| id).collect();
}
