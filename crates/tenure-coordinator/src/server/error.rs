//! The coordinator's error type and its one mapping to gRPC status codes.

use crate::ids::{NodeId, SessionId};
use crate::ownership::Rejection;

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
            },
        }
    }
}

impl From<CoordinatorError> for tonic::Status {
    fn from(e: CoordinatorError) -> tonic::Status {
        use tonic::Code;
        let code = match &e {
            CoordinatorError::NotLeader { .. } | CoordinatorError::Unavailable(_) => Code::Unavailable,
            CoordinatorError::SessionExpired(_) => Code::NotFound,
            CoordinatorError::InvalidArgument(_) => Code::InvalidArgument,
            CoordinatorError::TooManyStreams { .. } => Code::ResourceExhausted,
            CoordinatorError::Unauthenticated(_) => Code::Unauthenticated,
            CoordinatorError::NotAllowed(_) => Code::PermissionDenied,
            CoordinatorError::Rejected(r) => match r {
                Rejection::UnknownSession(_) => Code::NotFound,
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
