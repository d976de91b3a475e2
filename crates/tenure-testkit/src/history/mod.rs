//! Recorded histories of a run, and the checker that judges them.
//!
//! Correctness under faults is judged after the fact, from the outside, the way Jepsen and the
//! etcd robustness suite do it: a run records three streams and [`check`] reads them against the
//! invariants of the design notes.
//!
//! - The coordinator's committed decisions ([`Committed`]): every grant, revoke, release and loss,
//!   with the log index that made it, as each replica applied it.
//! - Each worker's operations ([`WorkerRecord`]): when it acquired a partition, each write it
//!   tried and what the store said, and until when it believed it held the partition when it
//!   acted, on the recorder's monotonic clock.
//! - The fenced store's decisions ([`StoreRecord`]) in the order it applied them.
//!
//! Times are nanoseconds on one monotonic clock shared by every recorder of a run (one process,
//! or one host's `CLOCK_MONOTONIC`); wall clocks are never used.
//!
//! The module is pure data and pure functions (it depends on the core identifiers and serde
//! only), so a history can be saved as JSON, read back and checked anywhere.
//!
//! ```
//! use tenure_testkit::history::{check, Committed, Decision, History, StoreRecord};
//! use tenure_coordinator::ids::{FencingToken, PartitionId, SessionId};
//! let mut history = History::new(1, 1000);
//! let grant = |index, session| Committed {
//!     node: 1, index, at_ns: index * 1000, partition: PartitionId(0), session: SessionId(session),
//!     token: FencingToken(index), decision: Decision::Granted,
//! };
//! history.coordinator = vec![grant(3, 1), grant(7, 2)]; // two owners, no end to the first: wrong
//! history.store = vec![StoreRecord { seq: 0, partition: PartitionId(0), token: FencingToken(7), accepted: true }];
//! let report = check(&history);
//! assert!(!report.passed());
//! assert_eq!(report.failed(), vec!["one owner at a time"]);
//! ```

mod check;

pub use check::{check, Report, Verdict};

use crate::ids::{FencingToken, PartitionId, SessionId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a committed log entry did to a partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    Granted,
    Revoking,
    Released,
    /// Taken away: the lease expired or the session ended.
    Lost,
}

/// One decision of the coordinator, as replica `node` applied the entry at `index`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    pub node: u64,
    pub index: u64,
    /// When the recorder saw it applied.
    pub at_ns: u64,
    pub partition: PartitionId,
    pub session: SessionId,
    pub token: FencingToken,
    pub decision: Decision,
}

/// What a worker did with a partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerOp {
    /// The library told the worker the partition is its own.
    Acquired,
    /// A write through the fenced store that was accepted.
    Wrote,
    /// A write the fenced store refused.
    Refused,
    /// The coordinator asked for the partition back; the worker stopped believing it held it.
    Revoked,
    /// The library reported the partition lost.
    Lost,
    /// The worker released it.
    Released,
}

/// One worker operation, from its start to its end on the shared clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub worker: String,
    pub session: SessionId,
    pub partition: PartitionId,
    pub token: FencingToken,
    pub op: WorkerOp,
    pub start_ns: u64,
    pub end_ns: u64,
    /// When the worker acted believing it held the partition: until when, by its own local
    /// lease. `None` for a blind write (a late writer that did not look). A `Revoked`, `Lost`
    /// or `Released` record ends the belief at its start, whatever was believed before.
    pub believed_until_ns: Option<u64>,
}

/// One decision of the fenced store, numbered in the order it applied them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreRecord {
    pub seq: u64,
    pub partition: PartitionId,
    pub token: FencingToken,
    pub accepted: bool,
}

/// A stretch of a replica's log that its record may lack on purpose: the entries after `after`
/// (the highest index its record held then) up to `index`, because the replica installed a
/// snapshot that covers the log up to `index`, or its recorder began following it when it had
/// applied up to `index` already.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resumed {
    pub node: u64,
    pub index: u64,
    #[serde(default)]
    pub after: u64,
}

impl Resumed {
    /// Whether this stretch excuses `node` for not recording `index`.
    pub fn covers(&self, node: u64, index: u64) -> bool {
        self.node == node && self.after < index && index <= self.index
    }
}

/// A fault the run injected, and when it was healed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub what: String,
    pub start_ns: u64,
    pub healed_ns: u64,
}

/// One partition's row of the final table, read after the run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalRow {
    pub partition: PartitionId,
    /// `None` when unowned.
    pub owner: Option<SessionId>,
    pub token: FencingToken,
}

/// Everything a run recorded.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    pub partition_count: u32,
    pub lease_ttl_ms: u64,
    pub coordinator: Vec<Committed>,
    pub workers: Vec<WorkerRecord>,
    pub store: Vec<StoreRecord>,
    pub faults: Vec<Fault>,
    /// The table once the run was over and quiet; empty when it was not read.
    pub final_table: Vec<FinalRow>,
    /// What the recorders know they missed; a history with gaps is not complete evidence.
    #[serde(default)]
    pub gaps: Vec<String>,
    /// Where each replica's record may skip entries it did not apply one by one.
    #[serde(default)]
    pub resumed: Vec<Resumed>,
    /// The sessions alive at the end, by worker name (equal weights).
    pub live_sessions: BTreeMap<String, SessionId>,
    /// From the last heal until every partition was owned by a live session and confirmed by
    /// its worker; `None` if that never happened.
    pub recovered_after_ms: Option<u64>,
    /// The promise the run is held to: owned again within this long after the faults heal.
    pub liveness_bound_ms: u64,
}

impl History {
    pub fn new(partition_count: u32, lease_ttl_ms: u64) -> History {
        History { partition_count, lease_ttl_ms, ..History::default() }
    }

    /// How many writes the store accepted, and how many it refused.
    pub fn store_decisions(&self) -> (usize, usize) {
        let accepted = self.store.iter().filter(|r| r.accepted).count();
        (accepted, self.store.len() - accepted)
    }
}
