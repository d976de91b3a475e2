//! tenure's core: what a storage service that checks fencing tokens needs, and nothing heavy.
//!
//! - [`ids`]: `PartitionId`, `SessionId`, `FencingToken`, one newtype per concept.
//! - [`keyspace`]: the documented, stable key hash (xxHash64, seed 0) and partition ranges, so
//!   clients in any language compute the same partition for a key.
//! - [`fence`]: the storage-side rule (accept a token iff it is at least the highest seen for the
//!   partition) and its stores: in memory, RocksDB (feature `rocksdb`), PostgreSQL (feature
//!   `postgres`).
//!
//! This crate depends on no Raft, no gRPC and no part of the coordinator; the `tenure` crate
//! re-exports it as `tenure::{ids, keyspace, fence}`.

pub mod fence;
pub mod ids;
pub mod keyspace;
