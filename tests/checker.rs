//! The checker must pass a correct history and catch each invariant's violation, named by the
//! invariant that broke. Every history here is made by hand: a correct one, then one mutation of
//! it per invariant.

use std::collections::BTreeMap;
use tenure::history::{
    check, Committed, Decision, FinalRow, History, Resumed, StoreRecord, WorkerOp, WorkerRecord,
};
use tenure::ids::{FencingToken, PartitionId, SessionId};

const MS: u64 = 1_000_000;

fn committed(index: u64, p: u32, session: u64, token: u64, decision: Decision) -> Committed {
    Committed {
        node: 1,
        index,
        at_ns: applied_at_ms(index) * MS,
        partition: PartitionId(p),
        session: SessionId(session),
        token: FencingToken(token),
        decision,
    }
}

/// When the recorder saw each entry of the story applied.
fn applied_at_ms(index: u64) -> u64 {
    match index {
        3 => 20,
        9 => 1_000,
        11 => 1_950,
        12 => 2_150,
        other => other * 200,
    }
}

fn op(
    worker: &str,
    session: u64,
    p: u32,
    token: u64,
    op: WorkerOp,
    at_ms: u64,
    until_ms: Option<u64>,
) -> WorkerRecord {
    WorkerRecord {
        worker: worker.into(),
        session: SessionId(session),
        partition: PartitionId(p),
        token: FencingToken(token),
        op,
        start_ns: at_ms * MS,
        end_ns: at_ms * MS + MS,
        believed_until_ns: until_ms.map(|u| u * MS),
    }
}

fn store(seq: u64, p: u32, token: u64, accepted: bool) -> StoreRecord {
    StoreRecord { seq, partition: PartitionId(p), token: FencingToken(token), accepted }
}

/// Two partitions, workers a (session 1) and b (session 2). a owns p0 with token 3 and p1 with
/// token 3; a freezes; its grants are lost at index 9, p0 and p1 go to b with token 9; a wakes
/// and its late write to p0 is refused. a rejoins as session 3 and p1 moves to it gracefully
/// (revoke, release, grant with token 12).
fn correct() -> History {
    let mut h = History::new(2, 1000);
    h.coordinator = vec![
        committed(3, 0, 1, 3, Decision::Granted),
        committed(3, 1, 1, 3, Decision::Granted),
        committed(9, 0, 1, 3, Decision::Lost),
        committed(9, 1, 1, 3, Decision::Lost),
        committed(9, 0, 2, 9, Decision::Granted),
        committed(9, 1, 2, 9, Decision::Granted),
        committed(11, 1, 2, 9, Decision::Revoking),
        committed(12, 1, 2, 9, Decision::Released),
        committed(12, 1, 3, 12, Decision::Granted),
    ];
    // A second replica applied the same entries, one of them twice (a restart replaying it).
    let mut replica: Vec<Committed> = h
        .coordinator
        .iter()
        .cloned()
        .map(|mut c| {
            c.node = 2;
            c
        })
        .collect();
    replica.push(replica[0].clone());
    h.coordinator.extend(replica);
    h.workers = vec![
        op("a", 1, 0, 3, WorkerOp::Acquired, 30, Some(800)),
        op("a", 1, 0, 3, WorkerOp::Wrote, 40, Some(800)),
        op("a", 1, 1, 3, WorkerOp::Acquired, 30, Some(800)),
        op("b", 2, 0, 9, WorkerOp::Acquired, 1_100, Some(1_900)),
        op("b", 2, 0, 9, WorkerOp::Wrote, 1_110, Some(1_900)),
        op("b", 2, 1, 9, WorkerOp::Acquired, 1_100, Some(1_900)),
        op("a", 1, 0, 3, WorkerOp::Refused, 2_000, None), // the blind late write
        op("b", 2, 1, 9, WorkerOp::Released, 2_100, None),
        op("a", 3, 1, 12, WorkerOp::Acquired, 2_200, Some(3_000)),
    ];
    h.store = vec![store(0, 0, 3, true), store(1, 0, 3, true), store(2, 0, 9, true), store(3, 0, 3, false)];
    h.final_table = vec![
        FinalRow { partition: PartitionId(0), owner: Some(SessionId(2)), token: FencingToken(9) },
        FinalRow { partition: PartitionId(1), owner: Some(SessionId(3)), token: FencingToken(12) },
    ];
    h.live_sessions = BTreeMap::from([("a".into(), SessionId(3)), ("b".into(), SessionId(2))]);
    h.recovered_after_ms = Some(1_500);
    h.liveness_bound_ms = 3_000;
    h
}

/// Checks that exactly `invariant` fails.
fn caught(h: &History, invariant: &str) {
    let report = check(h);
    assert_eq!(report.failed(), vec![invariant], "\n{report}");
}

#[test]
fn a_correct_history_passes_every_invariant() {
    let report = check(&correct());
    assert!(report.passed(), "\n{report}");
    assert_eq!(report.verdicts.len(), 11);
    assert!(report.verdicts.iter().all(|v| v.skipped.is_none()), "\n{report}");
}

#[test]
fn a_reused_or_lower_token_is_caught() {
    let mut h = correct();
    // p1's graceful move re-grants with token 9 again instead of 12, everywhere it appears.
    for c in h.coordinator.iter_mut().filter(|c| c.token == FencingToken(12)) {
        c.token = FencingToken(9);
    }
    for w in h.workers.iter_mut().filter(|w| w.token == FencingToken(12)) {
        w.token = FencingToken(9);
    }
    h.final_table[1].token = FencingToken(9);
    caught(&h, "tokens strictly increase per partition");
}

#[test]
fn a_grant_while_someone_holds_the_partition_is_caught() {
    let mut h = correct();
    h.coordinator
        .retain(|c| !(c.index == 9 && c.decision == Decision::Lost && c.partition == PartitionId(0)));
    caught(&h, "one owner at a time");
}

#[test]
fn two_believers_at_once_are_caught() {
    let mut h = correct();
    // a kept believing it held p0 after b had been told (a local deadline counted wrongly).
    h.workers.push(op("a", 1, 0, 3, WorkerOp::Wrote, 1_000, Some(1_200)));
    caught(&h, "one believer at any instant");
}

#[test]
fn a_store_without_the_check_is_caught() {
    let mut h = correct();
    h.store[3].accepted = true; // the late write with token 3 got in after token 9
    caught(&h, "the store never accepts a lower token after a higher one");
}

#[test]
fn a_grant_a_worker_was_told_of_but_the_log_lacks_is_caught() {
    let mut h = correct();
    h.workers.push(op("b", 2, 0, 14, WorkerOp::Acquired, 4_000, Some(4_100)));
    caught(&h, "no acknowledged grant is lost");

    let mut h = correct();
    h.final_table[0].token = FencingToken(7); // a restart that forgot the last grant
    caught(&h, "no acknowledged grant is lost");
}

#[test]
fn slow_or_missing_recovery_is_caught() {
    let mut h = correct();
    h.recovered_after_ms = Some(4_000);
    caught(&h, "every partition owned again within the bound after the faults heal");

    let mut h = correct();
    h.recovered_after_ms = None;
    caught(&h, "every partition owned again within the bound after the faults heal");
}

#[test]
fn an_unbalanced_final_table_is_caught() {
    let mut h = correct();
    h.live_sessions.insert("c".into(), SessionId(5)); // a live worker that owns nothing...
    h.live_sessions.insert("d".into(), SessionId(6));
    h.final_table[1].owner = Some(SessionId(2)); // ...while b owns both
    h.final_table[1].token = FencingToken(9);
    h.coordinator.retain(|c| c.index < 11);
    h.workers.retain(|w| w.session != SessionId(3) && w.op != WorkerOp::Released);
    caught(&h, "balance within one once stable");
}

#[test]
fn replicas_that_disagree_are_caught() {
    let mut h = correct();
    let last =
        h.coordinator.iter_mut().rfind(|c| c.node == 2 && c.index == 12 && c.decision == Decision::Granted);
    last.expect("node 2 applied index 12").session = SessionId(2);
    caught(&h, "replicas apply the same decisions at the same index");
}

#[test]
fn histories_survive_a_json_round_trip() {
    let h = correct();
    let text = serde_json::to_string(&h).expect("serialise");
    let back: History = serde_json::from_str(&text).expect("parse");
    assert_eq!(back, h);
}

#[test]
fn a_belief_ends_when_the_worker_sees_the_revoke() {
    let mut h = correct();
    h.workers.retain(|w| w.op != WorkerOp::Released);
    // b last sampled its lease on p1 before the revoke: valid until 2 300 ms by its clock.
    h.workers.push(op("b", 2, 1, 9, WorkerOp::Wrote, 2_000, Some(2_300)));
    caught(&h, "one believer at any instant");
    // Seeing the revoke at 2 050 ms ends that belief before a acquires p1 at 2 200 ms.
    h.workers.push(op("b", 2, 1, 9, WorkerOp::Revoked, 2_050, None));
    assert!(check(&h).passed(), "\n{}", check(&h));
}

#[test]
fn a_worker_that_acts_on_a_grant_after_it_was_given_away_is_caught() {
    // b released p1 (applied at 2 150 ms) but its handle still believed, and wrote at 2 160 ms:
    // a released partition may be granted to the next owner by the same entry.
    let mut h = correct();
    h.workers.push(op("b", 2, 1, 9, WorkerOp::Wrote, 2_160, Some(2_190)));
    caught(&h, "no belief outlives its grant");
    // The same after an expiry: a kept believing p0 (token 3) past the loss at 1 000 ms.
    let mut h = correct();
    h.workers.push(op("a", 1, 0, 3, WorkerOp::Refused, 1_010, Some(1_050)));
    caught(&h, "no belief outlives its grant");
    // Decisions read back from a log carry no time: nothing can be judged from them.
    let mut h = correct();
    h.workers.push(op("b", 2, 1, 9, WorkerOp::Wrote, 2_160, Some(2_190)));
    for c in &mut h.coordinator {
        c.at_ns = 0;
    }
    assert!(check(&h).passed(), "\n{}", check(&h));
}

#[test]
fn an_incomplete_history_is_caught() {
    // A final table missing a row would pass liveness and balance for it without a look.
    let mut h = correct();
    h.final_table.pop();
    caught(&h, "the history is complete");
    // The same row twice is no better.
    let mut h = correct();
    h.final_table.push(h.final_table[1].clone());
    caught(&h, "the history is complete");
    // A recorder that fell behind says so, and the history is not evidence of anything then.
    let mut h = correct();
    h.gaps.push("the recorder of node 2 missed 3 applied entries".into());
    caught(&h, "the history is complete");
}

#[test]
fn a_write_accepted_under_a_token_never_granted_is_caught() {
    let mut h = correct();
    h.store.push(store(4, 1, 7, true)); // p1 never had a grant with token 7
    caught(&h, "no acknowledged grant is lost");
}

#[test]
fn a_revoke_release_or_loss_by_a_non_holder_is_caught() {
    // Each decision that ends or moves a grant must name the holder's grant: session 1 never
    // held p1 under token 9.
    for (index, decision) in [(11, Decision::Revoking), (12, Decision::Released), (9, Decision::Lost)] {
        let mut h = correct();
        for c in h
            .coordinator
            .iter_mut()
            .filter(|c| c.index == index && c.decision == decision && c.partition == PartitionId(1))
        {
            c.session = SessionId(1);
            c.token = FencingToken(9);
        }
        let report = check(&h);
        assert!(report.failed().contains(&"one owner at a time"), "{decision:?}:\n{report}");
    }
}

#[test]
fn an_unowned_partition_at_the_end_is_caught() {
    // The log and the final table agree that p0 ended up with nobody: durable, but not live.
    let mut h = correct();
    h.coordinator.push(committed(13, 0, 2, 9, Decision::Lost));
    h.final_table[0].owner = None;
    caught(&h, "every partition owned again within the bound after the faults heal");
}

#[test]
fn a_belief_ends_where_its_release_or_loss_is_recorded() {
    // b's lease on p1 still ran until 2 500 ms by its clock, but it released p1 at 2 100 ms,
    // before a (session 3) believed it from 2 200 ms: one believer at a time.
    let mut h = correct();
    h.workers.push(op("b", 2, 1, 9, WorkerOp::Wrote, 1_200, Some(2_500)));
    assert!(check(&h).passed(), "\n{}", check(&h));
    // The same when the library reported it lost rather than released.
    let mut lost = h.clone();
    for w in lost.workers.iter_mut().filter(|w| w.op == WorkerOp::Released) {
        w.op = WorkerOp::Lost;
    }
    assert!(check(&lost).passed(), "\n{}", check(&lost));
    // Without the record that ended it, the belief overlaps a's.
    h.workers.retain(|w| w.op != WorkerOp::Released);
    caught(&h, "one believer at any instant");
}

#[test]
fn a_replica_that_skipped_an_entry_is_caught() {
    // Node 2 recorded entries 3 and 11-12 but not 9, which node 1 applied.
    let mut h = correct();
    h.coordinator.retain(|c| !(c.node == 2 && c.index == 9));
    caught(&h, "replicas apply the same decisions at the same index");
    // A snapshot installed (or a record started afresh) after index 9 excuses nothing before it.
    h.resumed.push(Resumed { node: 2, index: 12, after: 11 });
    caught(&h, "replicas apply the same decisions at the same index");
    // One that covers index 9 does.
    h.resumed.push(Resumed { node: 2, index: 9, after: 3 });
    assert!(check(&h).passed(), "\n{}", check(&h));
}

#[test]
fn a_store_that_refuses_valid_writes_is_caught() {
    // a's second write under token 3 was the highest token yet, and was refused.
    let mut h = correct();
    h.store[1].accepted = false;
    caught(&h, "the store refuses only stale tokens");
}
