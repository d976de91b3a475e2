//! Durable storage of one coordinator node in RocksDB: the Raft log, the vote, and the
//! ownership state machine, all in one database with a column family each.
//!
//! Invariants kept here:
//! - Persist, then acknowledge. Log appends are one synced write batch before openraft is told
//!   they are flushed; an apply batch writes every changed row and `last_applied` in one synced
//!   write batch before the responses are returned. A crash therefore leaves either the whole
//!   batch or none of it, and never a state ahead of or behind its `last_applied`.
//! - Tokens survive everything: partition rows carry their token, and snapshots carry the rows,
//!   so restart, snapshot install and log purge never lower a token.
//!
//! The store is checked by openraft's storage conformance suite (`tests/store_conformance.rs`).

// openraft's storage traits fix the error type (`StorageError`, a large enum); the helpers here
// return it unboxed so `?` works straight into the trait methods.
#![allow(clippy::result_large_err)]

mod db;
mod log_store;
mod replay;
mod session_fan_out;
mod state_machine;

pub use db::{open, Db};
pub use log_store::LogStore;
pub use replay::{replay_applied, ReplayError, ReplayedEntry};
pub use session_fan_out::{Delivery, SessionEvents, SessionFanOut};
pub use state_machine::{
    check_snapshot, decode_table_snapshot, encode_table_snapshot, Applied, AppliedEvent, SharedState,
    StateMachineStore,
};
