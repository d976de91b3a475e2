//! Commands the log carries, the responses their proposers get, and the events they emit.

use super::SecretHash;
use crate::ids::{FencingToken, PartitionId, SessionId};
use serde::{Deserialize, Serialize};

/// A committed change to the ownership table. Every field is data chosen before proposing, so
/// applying it is deterministic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Fix the partition count, lease TTL and revoke budget; proposed once by the first leader.
    Configure { partition_count: u32, lease_ttl_ms: u64, max_revoking: Option<u32> },
    /// A worker joins under a stable name. The leader generated the secret and gave it to the
    /// worker; the log carries only its hash.
    Join { name: String, weight: u32, secret: SecretHash },
    /// The owner gives partitions back (after a revoke, or of its own accord). `tokens`, when
    /// not empty, names the grant given back for each partition (one per partition, in order):
    /// a partition granted to the session again since (a release that was delayed, or retried)
    /// is left alone rather than taken from the newer grant.
    Release {
        session: SessionId,
        /// The hash of the secret the request presented (as in every command for a session).
        secret: SecretHash,
        partitions: Vec<PartitionId>,
        #[serde(default)]
        tokens: Vec<FencingToken>,
    },
    /// The owner gives back every partition it holds (a leaving worker that has stopped work).
    ReleaseAll { session: SessionId, secret: SecretHash },
    /// The worker leaves: its partitions are revoked, and the session ends once they are released
    /// or expired.
    Leave { session: SessionId, secret: SecretHash },
    /// The leader saw these sessions' leases run out.
    Expire { sessions: Vec<SessionId> },
    /// The leader saw the leases of these revoking grants run out before their owner released:
    /// partition, owner and the grant's token. A grant that is no longer the partition's
    /// current, revoking one (released and granted again since) is left alone.
    ExpireRevoking { partitions: Vec<(PartitionId, SessionId, FencingToken)> },
    /// The leader's placement decision, made on the table as it had applied it: grant these
    /// unowned partitions, and ask these owners to give theirs up. Apply checks every move
    /// against the table it holds and applies all of them or none; a decision made on a table
    /// that has changed since is refused whole, and the leader decides again.
    Place { grants: Vec<Grant>, revokes: Vec<Revoke> },
    /// An operator turns maintenance mode on or off (see [`super::Settings::maintenance`]).
    SetMaintenance { on: bool },
    /// An operator sets a worker's weight: its live sessions' now, and its future sessions'.
    SetWeight { name: String, weight: u32 },
    /// An operator pins a partition to a worker name (`Some`), or unpins it (`None`): the
    /// leader moves it to a live session of that name, gracefully, and keeps it there.
    Pin { partition: PartitionId, name: Option<String> },
    /// An operator changes the lease TTL that renewals are granted under from now on.
    SetLeaseTtl { lease_ttl_ms: u64 },
    /// The leader saw every lease granted before the TTL change at log index `changed_at` run
    /// out: a new leader need no longer wait out the older TTL. A later change is left alone.
    SettleLeaseTtl { changed_at: u64 },
    /// An operator changes the revoke budget (`None`: no limit).
    SetRevokeBudget { max_revoking: Option<u32> },
}

/// Give an unowned partition to a member. The token is the index of the entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub partition: PartitionId,
    pub session: SessionId,
}

/// Ask `session`, which holds `partition` under `token`, to give it up; once it is released
/// (or its lease runs out) it goes to `next` in that same entry, if `next` can still take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revoke {
    pub partition: PartitionId,
    pub session: SessionId,
    pub token: FencingToken,
    pub next: SessionId,
}

/// What the proposer of a command is told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// For entries that carry no command (blank and membership entries).
    Noop,
    Configured,
    /// The secret is not here: the proposer generated it and keeps it until it answers.
    Joined {
        session: SessionId,
        superseded: Option<SessionId>,
    },
    Released {
        partitions: Vec<PartitionId>,
    },
    Left,
    Expired {
        partitions: u32,
    },
    Placed {
        granted: u32,
        revoking: u32,
    },
    MaintenanceSet {
        /// Whether maintenance mode was on before.
        was: bool,
    },
    WeightSet {
        /// The live sessions of that name, which now have the weight.
        sessions: Vec<SessionId>,
    },
    Pinned {
        /// The name the partition was pinned to before, if any.
        was: Option<String>,
    },
    LeaseTtlSet {
        /// The TTL before, in milliseconds.
        was_ms: u64,
    },
    LeaseTtlSettled {
        /// False when that change was settled already, or a later one is pending.
        settled: bool,
    },
    RevokeBudgetSet {
        was: Option<u32>,
    },
    /// The namespace is gone, with its table of `partitions` partitions.
    NamespaceDeleted {
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
    #[error("the cluster is configured as {have:?}; refusing {want:?}")]
    ConfigMismatch { have: super::Config, want: super::Config },
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
    #[error("invalid weight {0}: must be between 1 and {max}", max = super::MAX_WEIGHT)]
    InvalidWeight(u32),
    #[error("a release names {partitions} partitions but {tokens} tokens")]
    TokensMismatch { partitions: usize, tokens: usize },
    #[error("the placement decision for partition {0} was made on a table that has changed since")]
    StalePlacement(PartitionId),
    #[error("session {0} cannot be given partitions: it is unknown or leaving")]
    NotEligible(SessionId),
    #[error("partition {0} is named twice in one placement decision")]
    DuplicateMove(PartitionId),
    #[error("no worker named {0:?} has a live session")]
    UnknownWorker(String),
    #[error("invalid namespace {0}")]
    InvalidNamespace(String),
    #[error("no namespace named {0:?}")]
    UnknownNamespace(String),
    #[error(
        "namespace {namespace:?} still has {sessions} sessions: its workers must leave (or expire) first"
    )]
    NamespaceInUse { namespace: String, sessions: usize },
    #[error("the default namespace cannot be deleted")]
    DefaultNamespace,
    #[error("the cluster already holds the most namespaces it may ({max})")]
    TooManyNamespaces { max: usize },
}

/// Why an owner lost a partition without releasing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LostReason {
    /// The session's lease ran out.
    SessionExpired,
    /// The partition was revoking and its lease ran out before the owner released it.
    RevokeExpired,
}

/// What changed, in order, for watchers, metrics and the leader's lease table and planner.
///
/// Every change to what placement reads (the configuration, the members, an owner) emits an
/// event: the leader decides again only when an applied entry emitted one, so a change that
/// emitted none would never be acted on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// The cluster took its configuration (the first `Configure`).
    Configured {
        config: super::Config,
    },
    SessionStarted {
        session: SessionId,
        name: String,
    },
    /// The session asked to leave: it gets nothing more, and the leader revokes what it holds.
    SessionLeaving {
        session: SessionId,
    },
    SessionEnded {
        session: SessionId,
    },
    Granted {
        partition: PartitionId,
        session: SessionId,
        token: FencingToken,
    },
    Revoking {
        partition: PartitionId,
        session: SessionId,
        token: FencingToken,
    },
    Released {
        partition: PartitionId,
        session: SessionId,
        token: FencingToken,
    },
    Lost {
        partition: PartitionId,
        session: SessionId,
        token: FencingToken,
        reason: LostReason,
    },
    /// Maintenance mode turned on or off.
    MaintenanceChanged {
        on: bool,
    },
    /// An operator changed a live session's weight.
    WeightChanged {
        session: SessionId,
        weight: u32,
    },
    /// An operator pinned a partition to a worker name, or unpinned it (`None`).
    Pinned {
        partition: PartitionId,
        name: Option<String>,
    },
    /// The lease TTL changed at log index `changed_at`; a worker may still believe a lease
    /// granted under a TTL as long as `ceiling_ms` until the change is settled.
    LeaseTtlChanged {
        lease_ttl_ms: u64,
        ceiling_ms: u64,
        changed_at: u64,
    },
    /// The TTL change at `changed_at` is settled: every lease is under the current TTL.
    LeaseTtlSettled {
        changed_at: u64,
    },
    /// The revoke budget changed.
    RevokeBudgetChanged {
        max_revoking: Option<u32>,
    },
    /// The namespace was deleted (it had no session left): its table is gone.
    NamespaceDeleted,
}

impl Event {
    /// The partition and session of an ownership change (a grant, revoke, release or loss);
    /// `None` for every other event.
    pub fn ownership(&self) -> Option<(PartitionId, SessionId)> {
        match *self {
            Event::Granted { partition, session, .. }
            | Event::Revoking { partition, session, .. }
            | Event::Released { partition, session, .. }
            | Event::Lost { partition, session, .. } => Some((partition, session)),
            _ => None,
        }
    }
}
