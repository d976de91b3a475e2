//! The leader's placement decisions: compare the applied table with [`crate::placement`]'s
//! target and say which moves to propose.
//!
//! Only the leader calls [`plan`]; the [`Command::Place`] it returns goes through the log, and
//! every replica checks and applies exactly those moves. That is the rule this module exists
//! for: replicas never decide placement, so placement may change between versions (or differ
//! between nodes, see [`Rules::ring_seed`]) without two replicas ever disagreeing about an
//! owner or a token.
//!
//! What a plan keeps:
//! - A partition in motion (revoking) is not moved again until it lands: the revoke already
//!   names its receiver.
//! - At most the cluster's revoke budget ([`crate::ownership::Config::max_revoking`], replicated
//!   state) of partitions are revoking at once, counting those already revoking; unowned
//!   partitions are always granted, since nobody works on them.
//! - One command carries at most [`MAX_MOVES_PER_COMMAND`] moves; a larger plan is proposed in
//!   several commands, each decided on the table the previous one left.

use crate::ids::SessionId;
use crate::ownership::{Command, Grant, OwnershipState, Revoke};
use crate::placement::{self, Member};

/// Most grants and revokes in one [`Command::Place`], which bounds an entry's size (about 20
/// bytes a move) and the time one apply holds the table.
pub const MAX_MOVES_PER_COMMAND: usize = 65_536;

/// The leader's own placement settings: what may differ between nodes and versions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    /// Seed of the affinity ring ([`placement::place_with_seed`]). Nodes may differ: only the
    /// leader's rules decide, and the log carries the outcome. 0 unless a test wants two
    /// versions of the rules side by side.
    pub ring_seed: u64,
}

/// The next placement decision to propose, or `None` when the table is where placement wants
/// it (or nothing can move: no configuration, no eligible member, the revoke budget spent).
/// Costs one pass over the table and a placement run.
pub fn plan(state: &OwnershipState, rules: &Rules) -> Option<Command> {
    let config = state.config()?;
    let members: Vec<Member> = state
        .sessions()
        .iter()
        .filter(|(_, r)| !r.leaving)
        .map(|(s, r)| Member { session: *s, name: r.name.clone(), weight: r.weight })
        .collect();
    if members.is_empty() {
        return None;
    }
    // A revoking partition already has its receiver: placement counts it there, so a second
    // decision made while the first is in motion builds on it instead of moving other
    // partitions in its place.
    let current: Vec<Option<SessionId>> =
        state.partitions().iter().map(|r| if r.revoking { r.next.or(r.owner) } else { r.owner }).collect();
    let target = placement::place_with_seed(&members, &current, rules.ring_seed);
    let revoking = state.partitions().iter().filter(|r| r.revoking).count();
    let mut may_revoke =
        config.max_revoking.map_or(usize::MAX, |max| (max as usize).saturating_sub(revoking));
    let mut grants = Vec::new();
    let mut revokes = Vec::new();
    for (p, (record, want)) in state.partitions().iter().zip(target).enumerate() {
        if grants.len() + revokes.len() >= MAX_MOVES_PER_COMMAND {
            break;
        }
        let partition = crate::ids::PartitionId(p as u32);
        match (record.owner, want) {
            (None, Some(session)) => grants.push(Grant { partition, session }),
            (Some(owner), Some(next)) if next != owner && !record.revoking && may_revoke > 0 => {
                may_revoke -= 1;
                revokes.push(Revoke { partition, session: owner, token: record.token, next });
            }
            _ => {}
        }
    }
    (!grants.is_empty() || !revokes.is_empty()).then_some(Command::Place { grants, revokes })
}

/// Applies plans until there is nothing left to decide, as a leader would with nothing else
/// happening; each plan is committed at the next index. Returns the events of every entry in
/// order. For tests, benchmarks and tools that drive a bare state machine.
pub fn settle(state: &mut OwnershipState, index: &mut u64, rules: &Rules) -> Vec<crate::ownership::Event> {
    let mut events = Vec::new();
    while let Some(command) = plan(state, rules) {
        *index += 1;
        let (response, mut applied) = state.apply(*index, &command);
        assert!(
            !matches!(response, crate::ownership::Response::Rejected(_)),
            "a plan made on the table it is applied to was refused: {response:?}"
        );
        events.append(&mut applied);
    }
    events
}
