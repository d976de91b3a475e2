//! `grpc.health.v1` for load balancers, probes and `grpc_health_probe`: a node reports SERVING
//! only while it can usefully answer, so that traffic and restarts are steered by what the node
//! knows rather than by whether its port is open.
//!
//! SERVING means: Raft runs, the node knows a leader (its own view: a partitioned node that
//! lost its leader says NOT_SERVING once openraft notices), it has applied all but at most
//! [`MAX_APPLY_LAG`] of the entries it holds, and it is not stopping. The same status is given
//! for the whole server (`""`) and for `tenure.v1.Coordinator`.

use super::Node;
use crate::ids::NodeId;
use crate::raft::Member;
use openraft::RaftMetrics;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// Entries a node may hold but not yet have applied and still report SERVING.
pub const MAX_APPLY_LAG: u64 = 1000;

/// The service names reported: the whole server, and the worker API.
const SERVICES: [&str; 2] = ["", "tenure.v1.Coordinator"];

/// Whether a node with these Raft metrics, stopping or not, should report SERVING.
pub(crate) fn serving(m: &RaftMetrics<NodeId, Member>, stopping: bool) -> bool {
    let applied = m.last_applied.map(|l| l.index).unwrap_or(0);
    let lag = m.last_log_index.unwrap_or(0).saturating_sub(applied);
    !stopping && m.running_state.is_ok() && m.current_leader.is_some() && lag <= MAX_APPLY_LAG
}

/// Keeps `reporter` in step with the node until it stops; NOT_SERVING from the moment it
/// starts draining.
pub(crate) async fn report(node: Arc<Node>, reporter: HealthReporter, cancel: CancellationToken) {
    let mut metrics = node.raft.metrics();
    let mut last = None;
    loop {
        let status = match serving(&metrics.borrow_and_update(), node.draining.is_cancelled()) {
            true => ServingStatus::Serving,
            false => ServingStatus::NotServing,
        };
        if last != Some(status) {
            for service in SERVICES {
                reporter.set_service_status(service, status).await;
            }
            last = Some(status);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = node.draining.cancelled(), if !node.draining.is_cancelled() => {}
            changed = metrics.changed() => if changed.is_err() { return },
        }
    }
}
