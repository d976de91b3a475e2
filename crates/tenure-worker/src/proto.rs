//! The public API's generated protobuf and gRPC types (`proto/tenure.proto`, package
//! `tenure.v1`): the client this library speaks and the service the coordinator implements. They
//! stay at the edge: the worker library and the coordinator's server convert them to their own
//! types, and nothing else uses them.

#![allow(clippy::all, missing_docs)]
tonic::include_proto!("tenure.v1");

/// The encoded descriptors of `proto/tenure.proto`, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tenure_descriptor");

/// Metadata key carrying the leader's address on a "not the leader" error.
pub const LEADER_METADATA: &str = "tenure-leader";
/// Metadata key carrying the error's kind (`unknown_session`, `wrong_secret`, ...), so clients
/// can rebuild a typed error.
pub const ERROR_METADATA: &str = "tenure-error";
