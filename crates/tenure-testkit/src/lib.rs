//! tenure's test kit: everything that runs a cluster under faults and judges what it did. It is
//! not part of what applications, storage services or embedded nodes depend on.
//!
//! - [`history`]: a run's recorded history and the checker that judges it against the
//!   invariants (one believer, token monotonicity, fencing, blast radius, liveness, ...).
//! - [`recording`]: how a coordinator's applied entries become recorded decisions.
//! - [`local_cluster`]: real coordinator nodes in one process on loopback, optionally behind
//!   [`fault_proxy`]s that cut, delay or drop their links.
//! - [`nemesis`]: real nodes and workers (in process or as processes) under seeded faults.
//! - [`simulation`]: the seeded model of the lease protocol: thousands of seeds a second.
//! - [`stack_simulation`]: the whole stack under turmoil's simulated
//!   network and clock.
//!
//! It depends on `tenure-coordinator` and `tenure-worker`; nothing depends on it but the `tenure`
//! binary and the tests, benchmarks and examples.

use tenure_coordinator::{fence, ids, lease, ownership, raft, server, store, tls};
use tenure_worker::{self as worker, transport};

pub mod certs;
pub mod fault_proxy;
pub mod history;
pub mod local_cluster;
pub mod nemesis;
pub mod proto;
pub mod recording;
pub mod simulation;
pub mod stack_simulation;
