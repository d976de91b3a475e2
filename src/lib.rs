//! tenure: a partition-ownership coordinator. This package is the `tenure` binary (serve, ctl,
//! demo and the harness's commands) and one import of the whole system for the tests,
//! benchmarks and examples. What users embed are the crates it re-exports:
//!
//! - `tenure-core` ([`ids`], [`keyspace`], [`fence`]): what a storage service that checks
//!   fencing tokens links; no Raft, no gRPC.
//! - `tenure-worker` ([`worker`], [`transport`]): the library an application embeds to own
//!   partitions; no Raft, no RocksDB.
//! - `tenure-coordinator` ([`ownership`], [`placement`], [`lease`], [`store`], [`codec`], [`raft`],
//!   [`server`]): a coordinator node as a library.
//! - `tenure-testkit` ([`history`], [`recording`], [`local_cluster`], [`fault_proxy`],
//!   [`nemesis`], [`simulation`], [`stack_simulation`]): runs clusters under faults and checks
//!   what they did; no user depends on it.
//!
//! See `ARCHITECTURE.md` for the code map and the invariants.

pub use tenure_coordinator::{codec, lease, ownership, placement, planner, raft, server, store, tls};
pub use tenure_core::{fence, ids, keyspace};
pub use tenure_testkit::{
    certs, fault_proxy, history, local_cluster, nemesis, proto, recording, simulation, stack_simulation,
};
pub use tenure_worker as worker;
pub use tenure_worker::transport;

/// The README's code is compiled as a doc test, so the library section cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeCode;
