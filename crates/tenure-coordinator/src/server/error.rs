//! The coordinator's error type and its one mapping to gRPC status codes.

use crate::ids::{NodeId, SessionId};
use crate::ownership::Rejection;
use tonic::codegen::http;

pub use crate::proto::{ERROR_METADATA, LEADER_METADATA};

/// Why a coordinator call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordinatorError {
    /// Retry on the leader (its address, when known).
    #[error("this node is not the leader (leader: {})", leader_addr.as_deref().unwrap_or("unknown"))]
    NotLeader { leader_id: Option<NodeId>, leader_addr: Option<String> },
    /// The ownership table refused the request; nothing changed.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// The session's lease ran out on the leader; join again.
    #[error("session {0} has expired")]
    SessionExpired(SessionId),
    /// A malformed request, refused before it reached the log.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The node already serves as many streams as it is configured for; retry later, or on
    /// another connection once some close.
    #[error("this node already serves its limit of {limit} streams")]
    TooManyStreams { limit: usize },
    /// The caller proved no identity (an insecure client on a TLS cluster cannot get this far:
    /// its handshake fails first).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The caller is known but may not make this call (a worker joining under another's name,
    /// acting on another worker's session, an operator renewing a lease).
    #[error("not allowed: {0}")]
    NotAllowed(String),
    /// The cluster already has `limit` workers with a session; a new name may join when one
    /// leaves.
    #[error("the cluster already has its limit of {limit} workers with a session")]
    TooManySessions { limit: usize },
    /// Joins arrive faster than the leader admits them; retry after a short wait.
    #[error("joins arrive faster than the {per_second} per second this leader admits; retry shortly")]
    TooManyJoins { per_second: u32 },
    /// This client already holds as many streams on this node as one client may.
    #[error("this client already holds its limit of {limit} streams on this node")]
    TooManyClientStreams { limit: usize },
    /// No member of the coordinator cluster has this id.
    #[error("node {0} is not a member of the cluster")]
    UnknownMember(NodeId),
    /// A learner too far behind the leader's log to be made a voter yet.
    #[error("node {id} is {behind} entries behind the leader; promote it once it has caught up")]
    NotCaughtUp { id: NodeId, behind: u64 },
    /// A membership change openraft refused (another in progress, a quorum it would break).
    #[error("membership change refused: {0}")]
    MembershipRefused(String),
    /// A message over the listener's size limit, refused before it was decoded.
    #[error("message too large: {0}")]
    MessageTooLarge(String),
    /// The cluster could not answer now (no quorum, shutting down); retry later.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl CoordinatorError {
    fn kind(&self) -> &'static str {
        match self {
            CoordinatorError::NotLeader { .. } => "not_leader",
            CoordinatorError::SessionExpired(_) => "session_expired",
            CoordinatorError::InvalidArgument(_) => "invalid_argument",
            CoordinatorError::Unavailable(_) => "unavailable",
            CoordinatorError::TooManyStreams { .. } => "too_many_streams",
            CoordinatorError::Unauthenticated(_) => "unauthenticated",
            CoordinatorError::TooManySessions { .. } => "too_many_sessions",
            CoordinatorError::TooManyJoins { .. } => "too_many_joins",
            CoordinatorError::MessageTooLarge(_) => "message_too_large",
            CoordinatorError::UnknownMember(_) => "unknown_member",
            CoordinatorError::TooManyClientStreams { .. } => "too_many_client_streams",
            CoordinatorError::NotCaughtUp { .. } => "not_caught_up",
            CoordinatorError::MembershipRefused(_) => "membership_refused",
            CoordinatorError::NotAllowed(_) => "not_allowed",
            CoordinatorError::Rejected(r) => match r {
                Rejection::NotConfigured => "not_configured",
                Rejection::ConfigMismatch { .. } => "config_mismatch",
                Rejection::InvalidConfig(_) => "invalid_config",
                Rejection::UnknownSession(_) => "unknown_session",
                Rejection::WrongSecret(_) => "wrong_secret",
                Rejection::PartitionOutOfRange { .. } => "partition_out_of_range",
                Rejection::NotOwner { .. } => "not_owner",
                Rejection::InvalidName(_) => "invalid_name",
                Rejection::InvalidWeight(_) => "invalid_weight",
                Rejection::TokensMismatch { .. } => "invalid_argument",
                // Only the leader's own placement commands meet these.
                Rejection::StalePlacement(_) => "stale_placement",
                Rejection::NotEligible(_) => "not_eligible",
                Rejection::DuplicateMove(_) => "invalid_argument",
                Rejection::UnknownWorker(_) => "unknown_worker",
                Rejection::InvalidNamespace(_) => "invalid_namespace",
                Rejection::UnknownNamespace(_) => "unknown_namespace",
                Rejection::NamespaceInUse { .. } => "namespace_in_use",
                Rejection::DefaultNamespace => "default_namespace",
                Rejection::TooManyNamespaces { .. } => "too_many_namespaces",
            },
        }
    }
}

impl From<CoordinatorError> for tonic::Status {
    fn from(e: CoordinatorError) -> tonic::Status {
        use tonic::Code;
        let code = match &e {
            CoordinatorError::NotLeader { .. } | CoordinatorError::Unavailable(_) => Code::Unavailable,
            CoordinatorError::SessionExpired(_) | CoordinatorError::UnknownMember(_) => Code::NotFound,
            CoordinatorError::NotCaughtUp { .. } | CoordinatorError::MembershipRefused(_) => {
                Code::FailedPrecondition
            }
            CoordinatorError::InvalidArgument(_) => Code::InvalidArgument,
            CoordinatorError::TooManyStreams { .. }
            | CoordinatorError::TooManySessions { .. }
            | CoordinatorError::TooManyJoins { .. }
            | CoordinatorError::MessageTooLarge(_)
            | CoordinatorError::TooManyClientStreams { .. } => Code::ResourceExhausted,
            CoordinatorError::Unauthenticated(_) => Code::Unauthenticated,
            CoordinatorError::NotAllowed(_) => Code::PermissionDenied,
            CoordinatorError::Rejected(r) => match r {
                Rejection::UnknownSession(_)
                | Rejection::UnknownWorker(_)
                | Rejection::UnknownNamespace(_) => Code::NotFound,
                Rejection::TooManyNamespaces { .. } => Code::ResourceExhausted,
                Rejection::NamespaceInUse { .. } | Rejection::DefaultNamespace => Code::FailedPrecondition,
                Rejection::InvalidNamespace(_) => Code::InvalidArgument,
                Rejection::WrongSecret(_) => Code::PermissionDenied,
                Rejection::PartitionOutOfRange { .. } => Code::OutOfRange,
                Rejection::NotOwner { .. }
                | Rejection::ConfigMismatch { .. }
                | Rejection::StalePlacement(_)
                | Rejection::NotEligible(_) => Code::FailedPrecondition,
                Rejection::NotConfigured => Code::Unavailable,
                Rejection::InvalidName(_)
                | Rejection::InvalidWeight(_)
                | Rejection::InvalidConfig(_)
                | Rejection::TokensMismatch { .. }
                | Rejection::DuplicateMove(_) => Code::InvalidArgument,
            },
        };
        // Every refusal a client is told of, by its kind: the same words it reads in the
        // status's metadata.
        metrics::counter!("tenure_refusals_total", "reason" => e.kind()).increment(1);
        let mut status = tonic::Status::new(code, e.to_string());
        if let Ok(v) = e.kind().parse() {
            status.metadata_mut().insert(ERROR_METADATA, v);
        }
        if let CoordinatorError::NotLeader { leader_addr: Some(addr), .. } = &e {
            if let Ok(v) = addr.parse() {
                status.metadata_mut().insert(LEADER_METADATA, v);
            }
        }
        status
    }
}

/// tonic's decoder refuses a message over the listener's size limit with `OUT_OF_RANGE`, the
/// code this API gives a partition outside the table. This rewrites that refusal (a
/// trailers-only answer, sent before any handler runs) as `RESOURCE_EXHAUSTED` with the kind
/// `message_too_large`, so a caller can tell its own oversized message from a bad partition.
pub(crate) fn oversized_as_exhausted<B: Default>(response: http::Response<B>) -> http::Response<B> {
    match tonic::Status::from_header_map(response.headers()) {
        Some(status) if is_oversized(&status) => {
            tonic::Status::from(CoordinatorError::MessageTooLarge(status.message().to_string())).into_http()
        }
        _ => response,
    }
}

/// Whether `status` is tonic's refusal of a message over the decoding limit.
pub(crate) fn is_oversized(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().contains("decoded message length too large")
}
