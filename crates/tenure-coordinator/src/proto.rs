//! The coordinator's protocols: the public API that `tenure-worker` generates (re-exported, so
//! the server implements the very types the client speaks) and the Raft transport between nodes.

pub use tenure_worker::proto::*;

/// The Raft transport between coordinator nodes (`proto/peer.proto`): not the public API.
pub mod peer {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tenure.peer.v1");
}
