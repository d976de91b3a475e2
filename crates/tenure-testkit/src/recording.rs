//! How the harness records the coordinator's decisions in a [`History`](crate::history::History):
//! the one mapping from the state machine's events and table to the history's vocabulary.
//!
//! It sits beside `ownership` and `history` rather than in either, so that the state machine
//! knows nothing of histories and a history stays checkable with nothing but its own types.

use crate::history::{Committed, Decision, FinalRow};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::ownership::{Event, OwnershipState};

/// What an applied event did to a partition, as a recorded history names it; `None` for
/// session events.
pub fn decision(event: &Event) -> Option<(PartitionId, SessionId, FencingToken, Decision)> {
    match *event {
        Event::Granted { partition, session, token } => Some((partition, session, token, Decision::Granted)),
        Event::Revoking { partition, session, token } => {
            Some((partition, session, token, Decision::Revoking))
        }
        Event::Released { partition, session, token } => {
            Some((partition, session, token, Decision::Released))
        }
        Event::Lost { partition, session, token, .. } => Some((partition, session, token, Decision::Lost)),
        Event::Configured { .. }
        | Event::SessionStarted { .. }
        | Event::SessionLeaving { .. }
        | Event::SessionEnded { .. }
        | Event::MaintenanceChanged { .. }
        | Event::WeightChanged { .. }
        | Event::Pinned { .. }
        | Event::LeaseTtlChanged { .. }
        | Event::LeaseTtlSettled { .. }
        | Event::RevokeBudgetChanged { .. }
        | Event::NamespaceDeleted => None,
    }
}

/// The decisions of the entry at `index`, as replica `node` applied it at `at_ns` (0 for
/// decisions read back from a log, which carry no time).
pub fn committed(
    node: u64,
    index: u64,
    at_ns: u64,
    events: &[Event],
) -> impl Iterator<Item = Committed> + '_ {
    events.iter().filter_map(move |event| {
        let (partition, session, token, decision) = decision(event)?;
        Some(Committed { node, index, at_ns, partition, session, token, decision })
    })
}

/// The highest log index recorded for `node`: where a `Resumed` stretch starts. A scan, but only
/// on a snapshot install or a recorder's fresh start.
pub fn highest_index(records: &[Committed], node: u64) -> u64 {
    records.iter().filter(|c| c.node == node).map(|c| c.index).max().unwrap_or(0)
}

/// The table as a history records it: every partition's owner and token.
pub fn final_table(state: &OwnershipState) -> Vec<FinalRow> {
    let rows = state.partitions().iter().enumerate();
    rows.map(|(p, r)| FinalRow { partition: PartitionId(p as u32), owner: r.owner, token: r.token }).collect()
}
