//! Raft glue: the openraft type configuration and the network that carries Raft RPCs over gRPC.
//!
//! openraft decides what is committed; this module only names the types it works with and moves
//! its messages between nodes. Nothing here touches ownership.

pub mod network;

use crate::ownership::{Proposal, Response};
use std::io::Cursor;

openraft::declare_raft_types!(
    /// The openraft type configuration of a tenure coordinator.
    pub TypeConfig:
        D = Proposal,
        R = Response,
        Node = Member,
);

/// A voter's two addresses, as the membership (and so every replica) records them. Peers and
/// clients are different principals, so each node serves them on different listeners: Raft
/// traffic reaches `peer_addr` only, and a worker or operator that can reach `client_addr` cannot
/// speak Raft there.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Member {
    /// Where the node serves its peers (the Raft transport).
    pub peer_addr: String,
    /// Where it serves workers, front-ends and operators; what a `NotLeader` answer names.
    pub client_addr: String,
}

/// Whether `addr` is `host:port` a peer can dial: a non-empty host (an IP literal or a host
/// name) and a numeric port. Host names are resolved on every new connection.
pub fn dialable(addr: &str) -> bool {
    addr.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && !host.contains(char::is_whitespace) && port.parse::<u16>().is_ok()
    })
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (peers {})", self.client_addr, self.peer_addr)
    }
}

pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<crate::ids::NodeId>;
pub type StoredMembership = openraft::StoredMembership<crate::ids::NodeId, Member>;
pub type StorageError = openraft::StorageError<crate::ids::NodeId>;
pub type Entry = openraft::Entry<TypeConfig>;
