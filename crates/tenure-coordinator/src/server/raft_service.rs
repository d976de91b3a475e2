//! The receiving end of the Raft transport: decode, hand to openraft, encode its `Result`.

use crate::codec;
use crate::proto::peer::raft_transport_server::RaftTransport;
use crate::proto::peer::RaftPayload;
use crate::raft::Raft;
use tonic::{Request, Response, Status};

pub struct RaftService {
    pub raft: Raft,
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
        encode(&self.raft.install_snapshot(rpc).await)
    }
}
