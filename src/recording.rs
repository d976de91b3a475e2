//! How the harness records the coordinator's decisions in a [`History`](crate::history::History):
//! the one mapping from the state machine's events and table to the history's vocabulary.
//!
//! It sits beside `ownership` and `history` rather than in either, so that the state machine
//! knows nothing of histories and a history stays checkable with nothing but its own types.

use crate::history::{Decision, FinalRow};
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
        Event::SessionStarted { .. } | Event::SessionEnded { .. } => None,
    }
}

/// The table as a history records it: every partition's owner and token.
pub fn final_table(state: &OwnershipState) -> Vec<FinalRow> {
    let rows = state.partitions().iter().enumerate();
    rows.map(|(p, r)| FinalRow { partition: PartitionId(p as u32), owner: r.owner, token: r.token }).collect()
}
