//! tenure's coordinator node as a library: what `tenure serve` runs, for an operator who embeds a
//! node in a process of their own ([`server::start`]).
//!
//! - [`ownership`]: the pure, deterministic state machine (commands in, new state and events out).
//! - [`placement`]: who should own what (balance by weight, minimal movement, affinity).
//! - [`lease`]: the leader's deadlines on its monotonic clock.
//! - [`store`]: RocksDB log, vote and state machine for openraft.
//! - [`codec`]: the one versioned binary encoding of what a node stores and sends its peers.
//! - [`raft`]: openraft's type configuration and the peer transport over gRPC.
//! - [`server`]: the gRPC services, leader forwarding and the duty loop that proposes expiries.
//!
//! Architecture invariants Cargo enforces: this crate depends on `tenure-core` and on
//! `tenure-worker` only for the public API's generated types and the dialer; nothing here depends
//! on the test kit (`tenure-testkit`), and neither the worker library nor the core depends on
//! this crate.

pub use tenure_core::{fence, ids, keyspace};

pub mod codec;
pub mod lease;
pub mod ownership;
pub mod placement;
pub mod planner;
pub mod proto;
pub mod raft;
pub mod server;
pub mod store;
pub mod tls;
