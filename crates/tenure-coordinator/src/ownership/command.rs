//! Commands the log carries, the responses their proposers get, and the events they emit.

use crate::ids::{FencingToken, PartitionId, SessionId};
use serde::{Deserialize, Serialize};

/// A committed change to the ownership table. Every field is data chosen before proposing, so
/// applying it is deterministic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Fix the partition count and lease TTL; proposed once by the first leader.
    Configure { partition_count: u32, lease_ttl_ms: u64 },
    /// A worker joins under a stable name. The leader generated `secret`.
    Join { name: String, weight: u32, secret: String },
    /// The owner gives partitions back (after a revoke, or of its own accord). `tokens`, when
    /// not empty, names the grant given back for each partition (one per partition, in order):
    /// a partition granted to the session again since (a release that was delayed, or retried)
    /// is left alone rather than taken from the newer grant.
    Release {
        session: SessionId,
        secret: String,
        partitions: Vec<PartitionId>,
        #[serde(default)]
        tokens: Vec<FencingToken>,
    },
    /// The owner gives back every partition it holds (a leaving worker that has stopped work).
    ReleaseAll { session: SessionId, secret: String },
    /// The worker leaves: its partitions are revoked, and the session ends once they are released
    /// or expired.
    Leave { session: SessionId, secret: String },
    /// The leader saw these sessions' leases run out.
    Expire { sessions: Vec<SessionId> },
    /// The leader saw the leases of these revoking grants run out before their owner released:
    /// partition, owner and the grant's token. A grant that is no longer the partition's
    /// current, revoking one (released and granted again since) is left alone.
    ExpireRevoking { partitions: Vec<(PartitionId, SessionId, FencingToken)> },
}

/// What the proposer of a command is told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// For entries that carry no command (blank and membership entries).
    Noop,
    Configured,
    Joined {
        session: SessionId,
        secret: String,
        superseded: Option<SessionId>,
    },
    Released {
        partitions: Vec<PartitionId>,
    },
    Left,
    Expired {
        partitions: u32,
    },
    Rejected(Rejection),
}

/// A deterministic refusal: the command was valid Raft data but not allowed by the table. The
/// state is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Rejection {
    #[error("the cluster has no partition table yet")]
    NotConfigured,
    #[error("the cluster is configured with {have_partitions} partitions and a {have_ttl_ms} ms lease TTL; refusing {want_partitions} partitions and {want_ttl_ms} ms")]
    ConfigMismatch { have_partitions: u32, have_ttl_ms: u64, want_partitions: u32, want_ttl_ms: u64 },
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("unknown session {0}")]
    UnknownSession(SessionId),
    #[error("wrong secret for session {0}")]
    WrongSecret(SessionId),
    #[error("partition {partition} is out of range (the cluster has {count} partitions)")]
    PartitionOutOfRange { partition: u32, count: u32 },
    #[error("session {session} does not own partition {partition}")]
    NotOwner { partition: PartitionId, session: SessionId },
    #[error("invalid worker name: {0}")]
    InvalidName(String),
    #[error("invalid weight {0}: must be between 1 and {max}", max = crate::placement::MAX_WEIGHT)]
    InvalidWeight(u32),
    #[error("a release names {partitions} partitions but {tokens} tokens")]
    TokensMismatch { partitions: usize, tokens: usize },
}

/// Why an owner lost a partition without releasing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossReason {
    /// The session's lease ran out.
    SessionExpired,
    /// The partition was revoking and its lease ran out before the owner released it.
    RevokeExpired,
}

/// What changed, in order, for watchers, metrics and the leader's lease table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    SessionStarted { session: SessionId, name: String },
    SessionEnded { session: SessionId },
    Granted { partition: PartitionId, session: SessionId, token: FencingToken },
    Revoking { partition: PartitionId, session: SessionId, token: FencingToken },
    Released { partition: PartitionId, session: SessionId, token: FencingToken },
    Lost { partition: PartitionId, session: SessionId, token: FencingToken, reason: LossReason },
}
