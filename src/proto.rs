//! Generated protobuf and gRPC types. They stay at the edge: the server and the worker client
//! convert them to the crate's own types, and nothing else uses them.

#![allow(clippy::all, missing_docs)]
tonic::include_proto!("tenure.v1");

/// The Raft transport between coordinator nodes (`proto/peer.proto`): not the public API.
#[cfg(feature = "coordinator")]
pub mod peer {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tenure.peer.v1");
}

/// The fault harness's fenced store (`proto/harness.proto`): test kit only.
#[cfg(feature = "harness")]
pub mod harness {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tenure.harness.v1");
}

/// Metadata key carrying the leader's address on a "not the leader" error.
pub const LEADER_METADATA: &str = "tenure-leader";
/// Metadata key carrying the error's kind (`unknown_session`, `wrong_secret`, ...), so clients
/// can rebuild a typed error.
pub const ERROR_METADATA: &str = "tenure-error";
