//! The receiving end of the Raft transport: decode, hand to openraft, encode its `Result`.

use crate::proto::peer::raft_transport_server::RaftTransport;
use crate::proto::peer::RaftPayload;
use crate::raft::Raft;
use tonic::{Request, Response, Status};

pub struct RaftService {
    pub raft: Raft,
}

fn decode<T: serde::de::DeserializeOwned>(req: Request<RaftPayload>) -> Result<T, Status> {
    serde_json::from_slice(&req.into_inner().data)
        .map_err(|e| Status::invalid_argument(format!("malformed raft message: {e}")))
}

fn encode<T: serde::Serialize>(value: &T) -> Result<Response<RaftPayload>, Status> {
    let data = serde_json::to_vec(value).map_err(|e| Status::internal(e.to_string()))?;
    Ok(Response::new(RaftPayload { data }))
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
        encode(&self.raft.install_snapshot(rpc).await)
    }
}
