//! The coordinator cluster under test, in one of two forms: nodes in this process
//! ([`LocalCluster`]) or `tenure serve` processes ([`ProcessCluster`]). The nemesis drives both
//! through this one type, so every fault kind means the same in both; where a form cannot do a
//! fault for real (an in-process node cannot be SIGSTOPped), the nearest emulation is named.

use super::processes::{ProcessCluster, ProcessError};
use super::FaultProxy;
use crate::ids::NodeId;
use crate::local_cluster::LocalCluster;
use crate::proto;
use std::time::Duration;

pub(crate) enum Coordinators {
    InProcess(LocalCluster),
    Processes(ProcessCluster),
}

impl Coordinators {
    pub(crate) fn ids(&self) -> Vec<NodeId> {
        match self {
            Coordinators::InProcess(c) => c.ids(),
            Coordinators::Processes(c) => c.ids(),
        }
    }

    pub(crate) fn addrs(&self) -> Vec<String> {
        match self {
            Coordinators::InProcess(c) => c.addrs(),
            Coordinators::Processes(c) => c.addrs(),
        }
    }

    /// The CA whose certificates the nodes require of workers; `None` on an insecure cluster.
    pub(crate) fn ca(&self) -> Option<&crate::certs::DevCa> {
        match self {
            Coordinators::InProcess(c) => c.secure().then(|| c.ca()),
            Coordinators::Processes(c) => c.ca(),
        }
    }

    pub(crate) fn proxy(&self, id: NodeId) -> Option<&FaultProxy> {
        match self {
            Coordinators::InProcess(c) => c.proxy(id),
            Coordinators::Processes(c) => c.proxy(id),
        }
    }

    pub(crate) async fn wait_for_leader(&self, timeout: Duration) -> Option<NodeId> {
        match self {
            Coordinators::InProcess(c) => c.wait_for_leader(timeout).await,
            Coordinators::Processes(c) => c.wait_for_leader(timeout).await,
        }
    }

    pub(crate) async fn status(&self) -> Option<proto::StatusResponse> {
        match self {
            Coordinators::InProcess(c) => c.status().await.ok(),
            Coordinators::Processes(c) => c.status().await,
        }
    }

    /// A node dies abruptly: `kill -9` for a process; for an in-process node, a stop (which
    /// loses nothing that was synced, and every write is).
    pub(crate) async fn kill(&mut self, id: NodeId) {
        match self {
            Coordinators::InProcess(c) => c.stop(id).await,
            Coordinators::Processes(c) => c.kill(id).await,
        }
    }

    /// A planned stop, as an operator's SIGTERM: a leader hands over first. Says how it went.
    pub(crate) async fn stop_gracefully(&mut self, id: NodeId) -> String {
        const BOUND: Duration = Duration::from_secs(15);
        match self {
            Coordinators::InProcess(c) => match c.stop_gracefully(id, BOUND).await {
                Some(successor) => format!("handed over to node {successor}"),
                None => "stopped without a handover".into(),
            },
            Coordinators::Processes(c) => match c.terminate(id, BOUND).await {
                true => "exited cleanly after SIGTERM".into(),
                false => {
                    tracing::warn!(node = id, "the node did not exit cleanly after SIGTERM");
                    "did not exit cleanly after SIGTERM; killed".into()
                }
            },
        }
    }

    /// An operator's drain of the worker `name`: the sessions set leaving.
    pub(crate) async fn drain(&self, name: &str) -> Result<Vec<u64>, String> {
        use proto::operator_client::OperatorClient;
        let client = match self {
            Coordinators::InProcess(c) => c.client(),
            Coordinators::Processes(c) => c.client(),
        };
        let request = proto::DrainRequest { name: name.into(), ..Default::default() };
        let drained = client
            .call_on(|channel| {
                let request = request.clone();
                async move { OperatorClient::new(channel).drain(request).await }
            })
            .await
            .map_err(|e| e.to_string())?;
        Ok(drained.sessions)
    }

    /// Makes an operator's change, trying again (across a leader change, or while a worker is
    /// between sessions) until it is made or `bound` has passed.
    pub(crate) async fn operate(&self, operation: Operation, bound: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            match self.operate_once(&operation).await {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn operate_once(&self, operation: &Operation) -> Result<(), String> {
        use proto::operator_client::OperatorClient;
        let client = match self {
            Coordinators::InProcess(c) => c.client(),
            Coordinators::Processes(c) => c.client(),
        };
        match operation {
            Operation::Maintenance(on) => {
                let on = *on;
                client
                    .call_on(|channel| async move {
                        OperatorClient::new(channel)
                            .set_maintenance(proto::SetMaintenanceRequest { on, ..Default::default() })
                            .await
                    })
                    .await
                    .map(drop)
            }
            Operation::LeaseTtl(lease_ttl_ms) => {
                let request = proto::SetLeaseTtlRequest { lease_ttl_ms: *lease_ttl_ms, ..Default::default() };
                client
                    .call_on(|channel| {
                        let request = request.clone();
                        async move { OperatorClient::new(channel).set_lease_ttl(request).await }
                    })
                    .await
                    .map(drop)
            }
            Operation::Weight(name, weight) => {
                let request =
                    proto::SetWeightRequest { name: name.clone(), weight: *weight, ..Default::default() };
                client
                    .call_on(|channel| {
                        let request = request.clone();
                        async move { OperatorClient::new(channel).set_weight(request).await }
                    })
                    .await
                    .map(drop)
            }
        }
        .map_err(|e| e.to_string())
    }

    pub(crate) async fn restart(&mut self, id: NodeId) -> Result<(), String> {
        match self {
            Coordinators::InProcess(c) => c.restart(id).await.map_err(|e| e.to_string()),
            Coordinators::Processes(c) => c.restart(id).map_err(|e: ProcessError| e.to_string()),
        }
    }

    /// The version of the placement rules node `id` runs (its ring seed).
    pub(crate) fn rules(&self, id: NodeId) -> u64 {
        match self {
            Coordinators::InProcess(c) => c.config(id).map_or(0, |config| config.placement.ring_seed),
            Coordinators::Processes(c) => c.rules(id),
        }
    }

    /// Restarts a killed node running version `ring_seed` of the placement rules; it keeps
    /// that version for the rest of the run (or until upgraded again).
    pub(crate) async fn restart_with_rules(&mut self, id: NodeId, ring_seed: u64) -> Result<(), String> {
        match self {
            Coordinators::InProcess(c) => c
                .restart_with(id, |config| config.placement.ring_seed = ring_seed)
                .await
                .map_err(|e| e.to_string()),
            Coordinators::Processes(c) => {
                c.restart_with_rules(id, ring_seed).map_err(|e: ProcessError| e.to_string())
            }
        }
    }

    /// Restarts a killed node with `lease_ttl` on its command line instead of the cluster's;
    /// it keeps that flag for the rest of the run.
    pub(crate) async fn restart_with_ttl(&mut self, id: NodeId, lease_ttl: Duration) -> Result<(), String> {
        match self {
            Coordinators::InProcess(c) => {
                c.restart_with(id, |config| config.lease_ttl = lease_ttl).await.map_err(|e| e.to_string())
            }
            Coordinators::Processes(c) => {
                c.restart_with_ttl(id, lease_ttl).map_err(|e: ProcessError| e.to_string())
            }
        }
    }

    /// Freezes a node process (SIGSTOP) or wakes it (SIGCONT); `false` for an in-process node,
    /// which cannot be frozen alone (the nemesis then cuts its every link instead, which is
    /// what peers and workers see of a frozen process, minus the stale timers it wakes with).
    pub(crate) fn freeze(&self, id: NodeId, freeze: bool) -> bool {
        match self {
            Coordinators::Processes(c) => {
                c.signal_pause(id, freeze);
                true
            }
            Coordinators::InProcess(_) => false,
        }
    }

    pub(crate) async fn shutdown(self) -> Option<ProcessCluster> {
        match self {
            Coordinators::InProcess(c) => {
                c.shutdown().await;
                None
            }
            Coordinators::Processes(mut c) => {
                c.shutdown().await;
                Some(c)
            }
        }
    }
}

/// An operator's change to the cluster, as `tenure ctl` makes it.
pub(crate) enum Operation {
    Maintenance(bool),
    Weight(String, u32),
    LeaseTtl(u64),
}
