//! The receiving end of the Raft transport: decode, hand to openraft, encode its `Result`.
//!
//! Nothing a peer sends can stop this node: a message that does not decode is refused, and a
//! snapshot is assembled from its chunks here and checked before openraft sees it (openraft
//! would report a snapshot that fails to decode during the install as a storage failure, which
//! stops the node).

use crate::codec;
use crate::ids::NodeId;
use crate::proto::peer::raft_transport_server::RaftTransport;
use crate::proto::peer::{CampaignRequest, CampaignResponse, RaftPayload};
use crate::raft::{Raft, TypeConfig};
use crate::store::check_snapshot;
use crate::tls::Principal;
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{InstallSnapshotRequest, InstallSnapshotResponse};
use openraft::storage::Snapshot;
use openraft::ServerState;
use std::io::Cursor;
use tonic::{Request, Response, Status};

pub struct RaftService {
    raft: Raft,
    /// How long a follower trusts a silent leader (openraft's leader lease): a vote asked
    /// sooner is refused, so a campaign waits this long after the leader falls silent.
    leader_lease: std::time::Duration,
    /// The snapshot being received: its id and the bytes so far. One at a time, as openraft
    /// sends them; a chunk of another snapshot, or out of order, starts over or is refused.
    receiving: tokio::sync::Mutex<Option<(String, Vec<u8>)>>,
}

impl RaftService {
    pub fn new(raft: Raft, leader_lease: std::time::Duration) -> Self {
        RaftService { raft, leader_lease, receiving: tokio::sync::Mutex::new(None) }
    }

    async fn receive_snapshot(
        &self,
        req: InstallSnapshotRequest<TypeConfig>,
    ) -> Result<Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>, Status>
    {
        let current = self.raft.metrics().borrow().vote;
        if req.vote < current {
            // A deposed leader: the answer carries the newer vote, as openraft's own would.
            return Ok(Ok(InstallSnapshotResponse { vote: current }));
        }
        let mut receiving = self.receiving.lock().await;
        let id = req.meta.snapshot_id.clone();
        let mut data = match receiving.take() {
            _ if req.offset == 0 => Vec::new(),
            Some((have, data)) if have == id && data.len() as u64 == req.offset => data,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "snapshot {id}: a chunk at offset {} without the chunks before it",
                    req.offset
                )))
            }
        };
        data.extend_from_slice(&req.data);
        if !req.done {
            *receiving = Some((id, data));
            return Ok(Ok(InstallSnapshotResponse { vote: current }));
        }
        drop(receiving);
        if let Err(e) = check_snapshot(&data) {
            tracing::warn!(snapshot = %id, error = %e, "refusing a snapshot this build cannot read");
            return Err(Status::invalid_argument(format!("snapshot {id}: {e}")));
        }
        let snapshot = Snapshot { meta: req.meta, snapshot: Box::new(Cursor::new(data)) };
        Ok(match self.raft.install_full_snapshot(req.vote, snapshot).await {
            Ok(response) => Ok(response.into()),
            Err(fatal) => Err(RaftError::Fatal(fatal)),
        })
    }
}

/// A peer's message in this build's format; another version or garbage is refused here, and
/// the node keeps running.
fn decode<T: serde::de::DeserializeOwned>(req: Request<RaftPayload>) -> Result<T, Status> {
    codec::decode(&req.into_inner().data)
        .map_err(|e| Status::invalid_argument(format!("malformed raft message: {e}")))
}

fn encode<T: serde::Serialize>(value: &T) -> Result<Response<RaftPayload>, Status> {
    Ok(Response::new(RaftPayload { data: codec::encode(value) }))
}

#[tonic::async_trait]
impl RaftTransport for RaftService {
    async fn append_entries(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(req)?;
        encode(&self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(req)?;
        encode(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(req)?;
        encode(&self.receive_snapshot(rpc).await?)
    }

    /// A stopping leader hands over: once the other followers' leases on it have run out (it
    /// stopped sending heartbeats before asking), this node stands for election at once rather
    /// than after its randomised election timeout. Asked by anyone but the leader this node
    /// follows, in the term it follows it in, it refuses: a campaign is never a way to depose a
    /// live leader.
    async fn campaign(&self, req: Request<CampaignRequest>) -> Result<Response<CampaignResponse>, Status> {
        if let Some(Ok(Principal::Node(caller))) = crate::tls::caller(&req) {
            if caller != req.get_ref().leader {
                return Err(Status::permission_denied(format!(
                    "node {caller} may not ask for a campaign on behalf of node {}",
                    req.get_ref().leader
                )));
            }
        }
        let CampaignRequest { leader, term } = req.into_inner();
        let follows = move |raft: &Raft| {
            let m = raft.metrics().borrow().clone();
            m.current_leader == Some(leader) && m.current_term == term && m.state == ServerState::Follower
        };
        if !follows(&self.raft) {
            return Err(Status::failed_precondition(format!(
                "this node does not follow node {leader} in term {term}"
            )));
        }
        let (raft, wait) = (self.raft.clone(), self.leader_lease);
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            // Only if nothing happened meanwhile (another election, the leader back at work).
            if follows(&raft) {
                tracing::info!(leader, term, "the leader handed over: standing for election");
                if let Err(e) = raft.trigger().elect().await {
                    tracing::warn!(error = %e, "could not stand for election");
                }
            }
        });
        Ok(Response::new(CampaignResponse {}))
    }
}
