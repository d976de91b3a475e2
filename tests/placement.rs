//! Property tests of placement: balance within one, minimal movement, determinism.

use proptest::prelude::*;
use std::collections::BTreeMap;
use tenure::ids::SessionId;
use tenure::placement::{place, place_pinned, place_with_seed, quotas, Member};

fn members(n: usize) -> Vec<Member> {
    (1..=n as u64).map(|i| Member { session: SessionId(i), name: format!("w{i}"), weight: 1 }).collect()
}

fn counts(assignment: &[Option<SessionId>]) -> BTreeMap<SessionId, usize> {
    let mut c = BTreeMap::new();
    for s in assignment.iter().flatten() {
        *c.entry(*s).or_insert(0) += 1;
    }
    c
}

fn assert_balanced(members: &[Member], assignment: &[Option<SessionId>]) {
    let c = counts(assignment);
    let p = assignment.len() as f64;
    let w: f64 = members.iter().map(|m| m.weight as f64).sum();
    for m in members {
        let have = *c.get(&m.session).unwrap_or(&0) as f64;
        let fair = p * m.weight as f64 / w;
        assert!((have - fair).abs() < 1.0, "{} has {have}, fair share {fair}", m.name);
    }
    assert!(assignment.iter().all(|a| a.is_some()), "every partition is placed");
}

fn moved(before: &[Option<SessionId>], after: &[Option<SessionId>]) -> usize {
    before.iter().zip(after).filter(|(b, a)| b.is_some() && b != a).count()
}

#[test]
fn fifth_worker_takes_exactly_what_balance_requires() {
    let four = members(4);
    let start = place(&four, &vec![None; 1024]);
    assert_balanced(&four, &start);
    let five = members(5);
    let after = place(&five, &start);
    assert_balanced(&five, &after);
    // 1024 / 5 = 204.8: the newcomer gets 204 (the old members keep 205 each), all from others.
    assert_eq!(counts(&after)[&SessionId(5)], 204);
    assert_eq!(moved(&start, &after), 204);
}

#[test]
fn placement_of_nothing_and_to_nobody() {
    assert_eq!(place(&[], &[None, Some(SessionId(3))]), vec![None, None]);
    assert!(place(&members(3), &[]).is_empty());
}

proptest! {
    #[test]
    fn balanced_within_one_by_weight(
        weights in proptest::collection::vec(1u32..5, 1..12),
        partitions in 1usize..600,
        seed_owner in proptest::collection::vec(0u64..14, 600),
    ) {
        let ms: Vec<Member> = weights.iter().enumerate()
            .map(|(i, w)| Member { session: SessionId(i as u64 + 1), name: format!("n{i}"), weight: *w }).collect();
        let current: Vec<Option<SessionId>> = seed_owner.iter().take(partitions)
            .map(|&o| if o == 0 { None } else { Some(SessionId(o)) }).collect();
        let current = if current.len() < partitions { vec![None; partitions] } else { current };
        let target = place(&ms, &current);
        assert_balanced(&ms, &target);
        // Deterministic: same input, same output.
        prop_assert_eq!(place(&ms, &current), target);
    }

    #[test]
    fn a_join_moves_only_the_minimum(n in 1usize..9, partitions in 1usize..2000) {
        let before_members = members(n);
        let before = place(&before_members, &vec![None; partitions]);
        let after_members = members(n + 1);
        let after = place(&after_members, &before);
        assert_balanced(&after_members, &after);
        let newcomer = SessionId(n as u64 + 1);
        let gained = counts(&after).get(&newcomer).copied().unwrap_or(0);
        // Every moved partition went to the newcomer, and it got no more than its quota.
        prop_assert_eq!(moved(&before, &after), gained);
        let held: Vec<u32> = after_members.iter().map(|m| counts(&before).get(&m.session).copied().unwrap_or(0) as u32).collect();
        let q = quotas(&after_members, &held, partitions as u32);
        prop_assert_eq!(gained as u32, q[n]);
    }

    #[test]
    fn a_crash_moves_only_the_dead_members_partitions(n in 2usize..9, partitions in 1usize..2000, dead in 0usize..9) {
        let dead = dead % n;
        let all = members(n);
        let before = place(&all, &vec![None; partitions]);
        let mut survivors = all.clone();
        let gone = survivors.remove(dead).session;
        let after = place(&survivors, &before);
        assert_balanced(&survivors, &after);
        for (b, a) in before.iter().zip(&after) {
            if *b != Some(gone) {
                prop_assert_eq!(b, a, "a survivor's partition moved");
            }
        }
    }

    #[test]
    fn placement_is_stable_when_nothing_changes(n in 1usize..9, partitions in 1usize..2000) {
        let ms = members(n);
        let once = place(&ms, &vec![None; partitions]);
        prop_assert_eq!(place(&ms, &once), once);
    }
}

/// The switch the upgrade tests turn stands for a real difference: under another ring seed the
/// same crash sends some partitions elsewhere, and each version alone still keeps balance and
/// minimal movement. (If both seeds decided alike, a rolling upgrade across them would prove
/// nothing.)
#[test]
fn two_versions_of_the_rules_decide_differently_and_each_keeps_the_invariants() {
    let four = members(4);
    let start = place(&four, &vec![None; 256]);
    let three = &four[..3];
    let old = place_with_seed(three, &start, 0);
    let new = place_with_seed(three, &start, 1);
    for after in [&old, &new] {
        assert_balanced(three, after);
        assert_eq!(moved(&start, after), start.iter().filter(|s| **s == Some(SessionId(4))).count());
    }
    let differ = old.iter().zip(&new).filter(|(a, b)| a != b).count();
    assert!(differ > 0, "the two versions placed the crashed member's partitions identically");
}

#[test]
fn pinned_partitions_go_to_their_member_and_the_rest_balances_around_them() {
    let m = members(3);
    let count = |t: &[Option<SessionId>], s: u64| t.iter().filter(|h| **h == Some(SessionId(s))).count();
    // From nothing: the three pinned partitions go to w3, which then takes seven others.
    let pins: BTreeMap<u32, SessionId> = (0..3).map(|p| (p, SessionId(3))).collect();
    let first = place_pinned(&m, &[None; 30], 0, &pins);
    assert!((0..3).all(|p| first[p] == Some(SessionId(3))), "{first:?}");
    assert_eq!((count(&first, 1), count(&first, 2), count(&first, 3)), (10, 10, 10));
    // One of w1's pinned to w2: it moves, and one partition of w2's (not a pinned one) goes
    // back to w1 for balance; nothing else moves.
    let p = first.iter().position(|h| *h == Some(SessionId(1))).unwrap() as u32;
    let mut more = pins.clone();
    more.insert(p, SessionId(2));
    let second = place_pinned(&m, &first, 0, &more);
    assert_eq!(second[p as usize], Some(SessionId(2)));
    assert!((0..3).all(|q| second[q] == Some(SessionId(3))));
    assert_eq!((count(&second, 1), count(&second, 2), count(&second, 3)), (10, 10, 10));
    let moved = first.iter().zip(&second).filter(|(a, b)| a != b).count();
    assert_eq!(moved, 2, "the pinned partition and one to make up for it");
    // Without pins, the same input places as before: no pin, no change.
    assert_eq!(place_pinned(&m, &first, 0, &BTreeMap::new()), place_with_seed(&m, &first, 0));
}
