//! Placement: a pure function from (members, weights, current assignment) to the target
//! assignment.
//!
//! Only the leader runs it ([`crate::planner`]), and the log carries what it decided, so a
//! change to these rules between versions cannot make replicas diverge. It is still
//! deterministic (no randomness, no clock, no iteration over hash maps, a ring hashed with
//! xxHash64 rather than the standard library's hasher), so that a leader change does not undo
//! the previous leader's choices and a restarted worker finds its partitions again.
//!
//! Invariants kept here (checked by the property tests in `tests/placement.rs`):
//! - Balance: every member's target count is `floor(P * w / W)` or one more, so counts by weight
//!   differ by at most one partition.
//! - Minimal movement: a partition keeps its current holder unless that holder is gone or holds
//!   more than its quota; only the excess is taken away, so a join moves only what balance
//!   requires onto the newcomer and a crash moves only the dead member's partitions.
//! - Affinity: a partition that must move goes to its consistent-hash preferred member (ring keyed
//!   by the stable worker name) when that member has room, so it tends to return to the same
//!   worker after a restart.

use crate::ids::SessionId;
use hashring::HashRing;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use xxhash_rust::xxh64::Xxh64Builder;

/// Ring entries per unit of weight.
pub const VNODES_PER_WEIGHT: u32 = 16;
/// Weights above this are clamped, which bounds the size of the ring. Joins with a higher
/// weight are refused.
pub use crate::ownership::MAX_WEIGHT;

/// One eligible member: a live session that is not leaving.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub session: SessionId,
    pub name: String,
    pub weight: u32,
}

#[derive(Clone, Debug)]
struct VNode<'a> {
    member: usize,
    name: &'a str,
    replica: u32,
}

impl Hash for VNode<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.name.as_bytes());
        state.write(&self.replica.to_le_bytes());
    }
}

struct PartitionKey(u32);

impl Hash for PartitionKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.0.to_le_bytes());
    }
}

/// Target count per member: `floor(P * w / W)`, plus one for the members with the largest
/// remainders (ties: members that hold more now, then by name), so the sum is exactly `P`.
pub fn quotas(members: &[Member], held: &[u32], partitions: u32) -> Vec<u32> {
    let total_weight: u128 = members.iter().map(|m| weight_of(m) as u128).sum();
    if total_weight == 0 {
        return vec![0; members.len()];
    }
    let mut quota = Vec::with_capacity(members.len());
    let mut frac = Vec::with_capacity(members.len());
    for m in members {
        let share = partitions as u128 * weight_of(m) as u128;
        quota.push((share / total_weight) as u32);
        frac.push(share % total_weight);
    }
    let assigned: u32 = quota.iter().sum();
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by(|&a, &b| {
        frac[b]
            .cmp(&frac[a])
            .then(held[b].cmp(&held[a]))
            .then(members[a].name.cmp(&members[b].name))
            .then(members[a].session.cmp(&members[b].session))
    });
    for &i in order.iter().take((partitions - assigned) as usize) {
        quota[i] += 1;
    }
    quota
}

fn weight_of(m: &Member) -> u32 {
    m.weight.clamp(1, MAX_WEIGHT)
}

/// Computes the target holder of every partition. `current[p]` is the present holder of
/// partition `p`; holders that are not in `members` count as gone. With no members, every
/// partition's target is `None`.
pub fn place(members: &[Member], current: &[Option<SessionId>]) -> Vec<Option<SessionId>> {
    place_with_seed(members, current, 0)
}

/// [`place`] with the affinity ring hashed under another seed. Balance and minimal movement are
/// the same; which member a moving partition prefers differs. Two seeds stand for two versions
/// of the placement rules (the rolling-upgrade test runs nodes with different seeds).
pub fn place_with_seed(
    members: &[Member],
    current: &[Option<SessionId>],
    ring_seed: u64,
) -> Vec<Option<SessionId>> {
    place_pinned(members, current, ring_seed, &BTreeMap::new())
}

/// [`place_with_seed`] with some partitions pinned to a member (an operator's pins, each
/// partition to the session it must go to, which must be in `members`): those go there and
/// count against that member's quota, and balance is kept by moving other partitions only.
pub fn place_pinned(
    members: &[Member],
    current: &[Option<SessionId>],
    ring_seed: u64,
    pinned: &BTreeMap<u32, SessionId>,
) -> Vec<Option<SessionId>> {
    let partitions = current.len() as u32;
    if members.is_empty() {
        return vec![None; current.len()];
    }
    // Members sorted by session for lookups; membership lists are small next to P.
    let mut by_session: Vec<(SessionId, usize)> =
        members.iter().enumerate().map(|(i, m)| (m.session, i)).collect();
    by_session.sort();
    let lookup =
        |s: SessionId| by_session.binary_search_by_key(&s, |&(sid, _)| sid).ok().map(|k| by_session[k].1);

    // Session ids are small and dense in practice (one per join): a direct table then answers
    // the million lookups of a large table far faster than a search each.
    let max_id = by_session.last().map_or(0, |(s, _)| s.0);
    let mut holder: Vec<Option<usize>> = if max_id as usize <= 4 * (members.len() + current.len()) {
        let mut slot = vec![u32::MAX; max_id as usize + 1];
        for &(s, i) in &by_session {
            slot[s.0 as usize] = i as u32;
        }
        let index = |s: SessionId| slot.get(s.0 as usize).filter(|i| **i != u32::MAX).map(|i| *i as usize);
        current.iter().map(|c| c.and_then(index)).collect()
    } else {
        current.iter().map(|c| c.and_then(lookup)).collect()
    };
    for (p, session) in pinned {
        if let (Some(slot), Some(i)) = (holder.get_mut(*p as usize), lookup(*session)) {
            *slot = Some(i);
        }
    }
    let is_pinned = |p: usize| !pinned.is_empty() && pinned.contains_key(&(p as u32));
    let mut held = vec![0u32; members.len()];
    for h in holder.iter().flatten() {
        held[*h] += 1;
    }
    let quota = quotas(members, &held, partitions);
    // Every partition held and nobody above quota: everyone is exactly at quota (the quotas sum
    // to P) and nothing moves, so the ring (its build is most of the cost with thousands of
    // members) is not needed.
    if holder.iter().all(Option::is_some) && held.iter().zip(&quota).all(|(h, q)| h <= q) {
        return holder.into_iter().map(|h| h.map(|i| members[i].session)).collect();
    }

    // One sort for the whole ring: `add` sorts after every node, which made building the ring
    // quadratic in the number of members (a join among 10,000 workers took seconds).
    let mut ring: HashRing<VNode<'_>, Xxh64Builder> = HashRing::with_hasher(Xxh64Builder::new(ring_seed));
    let vnodes = members.iter().enumerate().flat_map(|(i, m)| {
        (0..weight_of(m) * VNODES_PER_WEIGHT).map(move |replica| VNode {
            member: i,
            name: m.name.as_str(),
            replica,
        })
    });
    ring.batch_add(vnodes.collect());
    let preferred = |p: usize| ring.get(&PartitionKey(p as u32)).map(|v| v.member);

    // Take the excess away from members above quota: for each, the partitions the ring would
    // place elsewhere first, then the ones the ring places with it, each group from the highest
    // partition down. One scan from the top serves every member and stops as soon as every
    // excess is found; a join takes one or two partitions from each of thousands of members,
    // so the scan usually ends early.
    let mut need: Vec<u32> = held.iter().zip(&quota).map(|(h, q)| h.saturating_sub(*q)).collect();
    let mut remaining: u64 = need.iter().map(|n| u64::from(*n)).sum();
    for at_home in [false, true] {
        for p in (0..holder.len()).rev() {
            if remaining == 0 {
                break;
            }
            let Some(i) = holder[p] else { continue };
            if is_pinned(p) {
                continue;
            }
            // The second pass sees only partitions the ring places with their holder: the
            // first took every other one from a member that still needed to give.
            if need[i] > 0 && (at_home || preferred(p) != Some(i)) {
                holder[p] = None;
                need[i] -= 1;
                remaining -= 1;
            }
        }
    }
    for (h, q) in held.iter_mut().zip(&quota) {
        *h = (*h).min(*q);
    }

    // Hand out the free partitions: preferred member if it has room, else the next member with
    // room. The quotas sum to P, so every free partition finds a place.
    let mut cursor = 0usize;
    for (p, slot) in holder.iter_mut().enumerate() {
        if slot.is_some() {
            continue;
        }
        let target = match preferred(p) {
            Some(i) if held[i] < quota[i] => i,
            _ => {
                while held[cursor] >= quota[cursor] {
                    cursor += 1;
                }
                cursor
            }
        };
        *slot = Some(target);
        held[target] += 1;
    }
    holder.into_iter().map(|h| h.map(|i| members[i].session)).collect()
}
