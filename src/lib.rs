//! tenure: a partition-ownership coordinator.
//!
//! The key space is split into partitions; each has one owner at a time, a lease judged by the
//! coordinator leader, and a fencing token that storage checks. See `ARCHITECTURE.md` for the
//! code map and the invariants.
//!
//! Features: the core types, the key space and the [`fence`] check (the `tenure-core` crate,
//! re-exported here) are always built and pull in nothing heavy; `fence-rocksdb` and `fence-postgres` add fenced stores; `worker` adds the
//! worker library; `coordinator` adds the replicated coordinator as a library (`server::start`);
//! `harness` adds the test kit (local cluster, fault proxy, nemesis, model simulation); `cli` (the
//! default) adds the `tenure` binary.
//! [`history`] records what a run did and checks it against the invariants.

pub use tenure_core::{fence, ids, keyspace};

pub mod history;

#[cfg(feature = "harness")]
pub mod fault_proxy;
#[cfg(feature = "coordinator")]
pub mod lease;
#[cfg(feature = "harness")]
pub mod local_cluster;
#[cfg(feature = "harness")]
pub mod nemesis;
#[cfg(feature = "coordinator")]
pub mod ownership;
#[cfg(feature = "coordinator")]
pub mod placement;
#[cfg(feature = "worker")]
pub mod proto;
#[cfg(feature = "coordinator")]
pub mod raft;
#[cfg(feature = "harness")]
pub mod recording;
#[cfg(feature = "coordinator")]
pub mod server;
#[cfg(feature = "harness")]
pub mod simulation;
#[cfg(feature = "simulation")]
pub mod stack_simulation;
#[cfg(feature = "coordinator")]
pub mod store;
#[cfg(feature = "worker")]
pub mod transport;
#[cfg(feature = "worker")]
pub mod worker;
