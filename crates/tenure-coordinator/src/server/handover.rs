//! A leader asked to stop hands leadership over before it goes, so that a planned restart costs
//! the cluster less than a crash and workers are sent to the next leader at once.
//!
//! openraft 0.9 has no leadership transfer, and a follower refuses to vote while it still trusts
//! its leader (openraft's leader lease: the longest election timeout since the leader's last
//! message). So the handover is: stop taking work, with every refusal naming the successor;
//! wait for the successor to hold the whole log, so it can win; stop sending heartbeats and
//! standing for election here; and ask the successor to campaign as soon as the followers'
//! leases on this node have run out (the peer service's `Campaign`). A crash costs the lease and
//! then a randomised election timeout on top; the handover saves the second, and workers are
//! redirected by the refusals rather than by their own timeouts.
//!
//! The invariant kept: once draining starts this node proposes nothing and confirms no renewal
//! (`Node::ensure_leader` refuses, and the renewal loop and duty loop ask it first), so no lease
//! this node granted is extended past the moment it went quiet, and the successor starts every
//! lease afresh from its election, as after any leader change.

use super::Node;
use crate::ids::NodeId;
use crate::proto::peer::CampaignRequest;
use crate::raft::Member;
use openraft::{RaftMetrics, ServerState};
use std::time::Duration;
use tokio::time::Instant;

/// Starts draining `node` and, if it leads, hands leadership over within `bound`. Returns the
/// node that took over, if one did in time.
pub(crate) async fn hand_over(node: &Node, bound: Duration) -> Option<NodeId> {
    let deadline = Instant::now() + bound;
    let me = node.config.id;
    let metrics = node.raft.metrics().borrow().clone();
    let leading = metrics.state == ServerState::Leader && metrics.current_leader == Some(me);
    // Chosen before draining starts, so that the first refusal already names it.
    let successor = if leading { most_caught_up(&metrics, me) } else { None };
    *node.successor.lock().expect("successor lock poisoned") = successor;
    node.draining.cancel();
    let successor = successor?;
    let term = metrics.current_term;
    tracing::info!(node = me, successor, term, "stopping: handing leadership over");

    // A candidate whose log is shorter than a voter's loses; the last entries are at most a
    // round trip away.
    let caught_up = until(node, deadline, |m| {
        let matched = m.replication.as_ref().and_then(|r| r.get(&successor).cloned().flatten());
        matched.map(|l| l.index) >= m.last_log_index
    })
    .await;
    if !caught_up {
        tracing::warn!(
            node = me,
            successor,
            "the successor did not catch up in time; stopping without a handover"
        );
        return None;
    }
    node.raft.runtime_config().heartbeat(false);
    node.raft.runtime_config().elect(false);
    let addr =
        metrics.membership_config.membership().get_node(&successor).map(|m: &Member| m.peer_addr.clone());
    let asked = match addr.map(|a| node.network.transport(&a)) {
        Some(Ok(mut client)) => {
            let mut request = tonic::Request::new(CampaignRequest { leader: me, term });
            request.set_timeout(deadline.saturating_duration_since(Instant::now()));
            client.campaign(request).await.map_err(|s| s.message().to_string())
        }
        Some(Err(e)) => Err(e),
        None => Err(format!("node {successor} has no address in the membership")),
    };
    if let Err(e) = asked {
        // The followers will elect someone once their leases run out, as after a crash.
        tracing::warn!(node = me, successor, error = %e, "the successor refused to campaign");
        return None;
    }
    let handed = until(node, deadline, |m| {
        m.current_term > term || m.current_leader.is_some_and(|leader| leader != me)
    })
    .await;
    let leader = node.raft.metrics().borrow().current_leader;
    if handed {
        tracing::info!(node = me, leader, "leadership handed over");
    } else {
        tracing::warn!(node = me, "no other node took over in time; stopping anyway");
    }
    handed.then_some(leader.unwrap_or(successor))
}

/// The voter, other than `me`, that holds the most of the log by the leader's replication
/// metrics.
fn most_caught_up(metrics: &RaftMetrics<NodeId, Member>, me: NodeId) -> Option<NodeId> {
    let matched = |id: &NodeId| {
        metrics.replication.as_ref().and_then(|r| r.get(id).cloned().flatten()).map(|l| l.index)
    };
    metrics
        .membership_config
        .membership()
        .voter_ids()
        .filter(|id| *id != me)
        .max_by_key(|id| (matched(id), *id))
}

/// Waits until `holds` is true of the node's Raft metrics, or `deadline`; whether it held.
async fn until(node: &Node, deadline: Instant, holds: impl Fn(&RaftMetrics<NodeId, Member>) -> bool) -> bool {
    let mut metrics = node.raft.metrics();
    loop {
        if holds(&metrics.borrow_and_update()) {
            return true;
        }
        match tokio::time::timeout_at(deadline, metrics.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => return false,
        }
    }
}
