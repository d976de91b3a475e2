//! Raft glue: the openraft type configuration and the network that carries Raft RPCs over gRPC.
//!
//! openraft decides what is committed; this module only names the types it works with and moves
//! its messages between nodes. Nothing here touches ownership.

pub mod network;

use crate::ownership::{Command, Response};
use std::io::Cursor;

openraft::declare_raft_types!(
    /// The openraft type configuration of a tenure coordinator.
    pub TypeConfig:
        D = Command,
        R = Response,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<crate::ids::NodeId>;
pub type StoredMembership = openraft::StoredMembership<crate::ids::NodeId, openraft::BasicNode>;
pub type StorageError = openraft::StorageError<crate::ids::NodeId>;
pub type Entry = openraft::Entry<TypeConfig>;
