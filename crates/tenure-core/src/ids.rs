//! Identifier and token newtypes shared by every module.
//!
//! One word per concept, the same in code, proto and docs: a `PartitionId` names a range of the
//! key space, a `SessionId` names one incarnation of a worker, a `FencingToken` is the number that
//! storage compares. Keeping them distinct types means a token can never be passed where a
//! partition is expected.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of a partition, `0..partition_count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PartitionId(pub u32);

/// One incarnation of a worker, from join to leave or expiry. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId(pub u64);

/// A grant's fencing token: the Raft log index of the entry that committed the grant, so it is
/// strictly greater than every token issued before it, for every partition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FencingToken(pub u64);

/// Identifier of a coordinator node (Raft member).
pub type NodeId = u64;

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
