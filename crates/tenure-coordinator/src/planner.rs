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
//!   state) of partitions are in motion at once: revoking, or moved and granted to their new
//!   owner but not yet confirmed by its heartbeat (the leader's lease table counts those,
//!   [`crate::lease::LeaseTable::unconfirmed_moves`]). Unowned partitions are always granted,
//!   since nobody works on them.
//! - One command carries at most [`MAX_MOVES_PER_COMMAND`] moves, which bounds what one apply
//!   costs; a larger decision is split into several commands over disjoint partitions, proposed
//!   in order. If one is refused (the table changed under it), the rest are dropped and the
//!   leader decides again.
//! - In maintenance mode ([`crate::ownership::Settings::maintenance`]) nothing is taken from a
//!   live owner: unowned partitions are granted, and leaving sessions' partitions revoked, as
//!   always; a member below its share waits until maintenance ends.
//! - A settled table is recognised without a pass over it (the table keeps counts of unowned and
//!   revoking partitions, and what each session owns), so deciding "nothing to do" costs the
//!   number of members, not of partitions.

use crate::ids::SessionId;
use crate::ownership::{Command, Grant, OwnershipState, Revoke};
use crate::placement::{self, Member};

/// Most grants and revokes in one [`Command::Place`], which bounds an entry's size (about 20
/// bytes a move) and the time one apply holds the table: a few milliseconds at this size (the
/// `scale` bench reports the slowest apply while granting a million partitions).
pub const MAX_MOVES_PER_COMMAND: usize = 8_192;

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
pub fn plan(state: &OwnershipState, rules: &Rules) -> Option<Command> {
    plan_all(state, rules).into_iter().next()
}

/// The whole decision, split into commands of at most [`MAX_MOVES_PER_COMMAND`] moves over
/// disjoint partitions, to be proposed in order; empty when there is nothing to do. Costs
/// one pass over the table and a placement run, unless the table is settled.
pub fn plan_all(state: &OwnershipState, rules: &Rules) -> Vec<Command> {
    plan_all_in_motion(state, rules, 0)
}

/// [`plan_all`] with `unconfirmed` moved partitions still in motion (granted after a revoke,
/// not yet confirmed by their new owner's heartbeat), which count toward the revoke budget.
pub fn plan_all_in_motion(state: &OwnershipState, rules: &Rules, unconfirmed: usize) -> Vec<Command> {
    let Some(config) = state.config() else { return Vec::new() };
    let members: Vec<Member> = state
        .sessions()
        .iter()
        .filter(|(_, r)| !r.leaving)
        .map(|(s, r)| Member { session: *s, name: r.name.clone(), weight: r.weight })
        .collect();
    if members.is_empty() || settled(state, &members, config.partition_count) {
        return Vec::new();
    }
    // A revoking partition already has its receiver: placement counts it there, so a second
    // decision made while the first is in motion builds on it instead of moving other
    // partitions in its place.
    let current: Vec<Option<SessionId>> =
        state.partitions().iter().map(|r| if r.revoking { r.next.or(r.owner) } else { r.owner }).collect();
    // An operator's pins place their partitions; the rest balances around them.
    let pins: std::collections::BTreeMap<u32, SessionId> =
        pinned(state, &members).map(|(p, s)| (p.0, s)).collect();
    let target = placement::place_pinned(&members, &current, rules.ring_seed, &pins);
    let in_motion = state.revoking_count().saturating_add(unconfirmed);
    let mut may_revoke =
        config.max_revoking.map_or(usize::MAX, |max| (max as usize).saturating_sub(in_motion));
    // Maintenance mode takes nothing from a live owner; a leaving (or superseded) one still
    // gives its partitions up, since it asked to.
    let maintenance = state.maintenance();
    let takeable = |owner: SessionId| !maintenance || state.session(owner).is_none_or(|s| s.leaving);
    let mut commands = Vec::new();
    let mut grants = Vec::new();
    let mut revokes = Vec::new();
    for (p, (record, want)) in state.partitions().iter().zip(target).enumerate() {
        let partition = crate::ids::PartitionId(p as u32);
        match (record.owner, want) {
            (None, Some(session)) => grants.push(Grant { partition, session }),
            (Some(owner), Some(next))
                if next != owner && !record.revoking && may_revoke > 0 && takeable(owner) =>
            {
                may_revoke -= 1;
                revokes.push(Revoke { partition, session: owner, token: record.token, next });
            }
            _ => continue,
        }
        if grants.len() + revokes.len() == MAX_MOVES_PER_COMMAND {
            commands.push(Command::Place {
                grants: std::mem::take(&mut grants),
                revokes: std::mem::take(&mut revokes),
            });
        }
    }
    if !grants.is_empty() || !revokes.is_empty() {
        commands.push(Command::Place { grants, revokes });
    }
    commands
}

/// Whether placement would leave the table as it is, told from counts alone: every partition
/// owned by a member, none revoking, and no member above its quota. This is the condition under
/// which [`placement::place_with_seed`] returns the current assignment unchanged.
fn settled(state: &OwnershipState, members: &[Member], partitions: u32) -> bool {
    if state.unowned_count() > 0 || state.revoking_count() > 0 {
        return false;
    }
    let partitions_rows = state.partitions();
    let unmet = pinned(state, members)
        .any(|(p, session)| partitions_rows.get(p.0 as usize).is_some_and(|r| r.owner != Some(session)));
    if unmet {
        return false;
    }
    let held: Vec<u32> = members.iter().map(|m| state.owned_count(m.session) as u32).collect();
    if held.iter().map(|h| u64::from(*h)).sum::<u64>() != u64::from(partitions) {
        return false; // a leaving session still owns some
    }
    let quota = placement::quotas(members, &held, partitions);
    held.iter().zip(&quota).all(|(h, q)| h <= q)
}

/// Each pinned partition with the member it is pinned to: the first live session of the pinned
/// name (in session order, so every replica's leader picks the same); pins to a name with no
/// live session are left to placement.
fn pinned<'a>(
    state: &'a OwnershipState,
    members: &'a [Member],
) -> impl Iterator<Item = (crate::ids::PartitionId, SessionId)> + 'a {
    state.settings().pins.iter().filter_map(move |(p, name)| {
        members.iter().filter(|m| &m.name == name).map(|m| m.session).min().map(|s| (*p, s))
    })
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
