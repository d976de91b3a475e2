//! The conformance suite for fenced stores: what any backend must do for fencing tokens to
//! protect it, as cases anyone can run against a store of their own (feature `testing`).
//!
//! A store that passes keeps the storage half of the design's invariants:
//! - the rule: a token is admitted iff it is at least the highest seen for its partition, and
//!   admitting it raises the fence (`>=`, so the current owner writes many times);
//! - raise-before-read: once [`FenceStore::raise`] returns, no older owner changes the
//!   partition's state, so what the new owner reads next is what it resumes from;
//! - atomicity: the check and every change of a [`FenceBatch`] are one step, under concurrent
//!   writers too; a refused batch changes nothing;
//! - independence: one partition's fence says nothing about another's;
//! - durability: a store opened again after a restart remembers its fences, data and
//!   checkpoints (skipped for a backend that keeps nothing, such as the in-memory one).
//!
//! ```
//! # tokio_test_block_on(async {
//! use tenure_core::fence::testing::{self, Backend};
//! use tenure_core::fence::{FenceError, MemoryFence};
//! struct InMemory;
//! impl Backend for InMemory {
//!     type Store = MemoryFence;
//!     async fn fresh(&self, _case: &'static str) -> Result<MemoryFence, FenceError> {
//!         Ok(MemoryFence::default())
//!     }
//!     async fn reopen(&self, _case: &'static str, _: MemoryFence) -> Result<Option<MemoryFence>, FenceError> {
//!         Ok(None) // forgets everything: the durability case is skipped
//!     }
//! }
//! let passed = testing::run_all(&InMemory).await.unwrap();
//! assert!(passed.contains(&"a_batch_is_all_or_nothing_under_concurrent_writers"));
//! # });
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap().block_on(f)
//! # }
//! ```

use super::{FenceBatch, FenceError, FenceStore};
use crate::ids::{FencingToken as T, PartitionId as P};
use std::future::Future;
use std::sync::Arc;

/// How the suite gets stores of the backend under test.
pub trait Backend: Send + Sync {
    type Store: FenceStore + 'static;

    /// A store with nothing in it, unseen by any other case; `case` names the case that will
    /// use it (cases run one at a time), say for a directory or schema of its own.
    fn fresh(&self, case: &'static str) -> impl Future<Output = Result<Self::Store, FenceError>> + Send;

    /// The store `fresh(case)` made, after its process restarted: close `store`, open the same
    /// data again. `None` for a backend that keeps nothing across restarts.
    fn reopen(
        &self,
        case: &'static str,
        store: Self::Store,
    ) -> impl Future<Output = Result<Option<Self::Store>, FenceError>> + Send;
}

/// A case that did not hold, and what was seen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{case}: {what}")]
pub struct Failure {
    pub case: &'static str,
    pub what: String,
}

/// Writers and rounds in the concurrent cases: enough to interleave on two cores, few enough to
/// run in well under a second on a synced disk store.
const WRITERS: u64 = 6;
const ROUNDS: u64 = 100;

/// Runs every case, each on a fresh store; returns the names of the cases that ran (a skipped
/// durability case is not among them) or the first failure.
pub async fn run_all<B: Backend>(backend: &B) -> Result<Vec<&'static str>, Failure> {
    let mut passed = Vec::new();
    macro_rules! case {
        ($name:ident) => {{
            let name = stringify!($name);
            let store = backend
                .fresh(name)
                .await
                .map_err(|e| Failure { case: name, what: format!("fresh store: {e}") })?;
            if $name(backend, store).await.map_err(|what| Failure { case: name, what })? {
                passed.push(name);
            }
        }};
    }
    case!(the_same_and_higher_tokens_are_admitted);
    case!(a_lower_token_is_refused_and_writes_nothing);
    case!(raising_writes_no_data_and_shuts_older_owners_out);
    case!(a_checkpoint_is_read_only_under_an_admitted_token);
    case!(partitions_are_fenced_independently);
    case!(a_batch_is_applied_whole);
    case!(a_raise_orders_every_older_write_before_the_new_owners_read);
    case!(a_batch_is_all_or_nothing_under_concurrent_writers);
    case!(fences_data_and_checkpoints_survive_a_restart);
    Ok(passed)
}

type Outcome = Result<bool, String>;

/// `Err` with what happened instead, for the case's report.
fn expect(holds: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if holds {
        Ok(())
    } else {
        Err(what())
    }
}

fn ok<V>(result: Result<V, FenceError>, doing: &str) -> Result<V, String> {
    result.map_err(|e| format!("{doing}: {e}"))
}

fn stale<V: std::fmt::Debug>(result: Result<V, FenceError>, highest: u64, doing: &str) -> Result<(), String> {
    match result {
        Err(FenceError::Stale { highest: h, .. }) if h == T(highest) => Ok(()),
        other => Err(format!("{doing}: want Stale with highest {highest}, got {other:?}")),
    }
}

async fn the_same_and_higher_tokens_are_admitted<B: Backend>(_: &B, s: B::Store) -> Outcome {
    let p = P(3);
    ok(s.write(p, T(10), b"k", b"one").await, "first write under 10")?;
    ok(s.write(p, T(10), b"k", b"two").await, "second write under the same token")?;
    ok(s.write(p, T(11), b"k", b"three").await, "write under a higher token")?;
    let value = ok(s.read(p, b"k").await, "read")?;
    expect(value.as_deref() == Some(&b"three"[..]), || format!("read {value:?}, want \"three\""))?;
    let highest = ok(s.highest(p).await, "highest")?;
    expect(highest == Some(T(11)), || format!("highest is {highest:?}, want 11"))?;
    Ok(true)
}

async fn a_lower_token_is_refused_and_writes_nothing<B: Backend>(_: &B, s: B::Store) -> Outcome {
    let p = P(4);
    ok(s.write(p, T(11), b"k", b"new").await, "write under 11")?;
    ok(s.save_checkpoint(p, T(11), b"offset=5").await, "checkpoint under 11")?;
    stale(s.write(p, T(10), b"k", b"late").await, 11, "write under 10")?;
    stale(s.write(p, T(10), b"other", b"late").await, 11, "write of a new key under 10")?;
    stale(s.save_checkpoint(p, T(10), b"offset=1").await, 11, "checkpoint under 10")?;
    let mut batch = FenceBatch::new();
    batch.put(b"k", b"late").delete(b"k").checkpoint(b"offset=0");
    stale(s.apply(p, T(10), &batch).await, 11, "batch under 10")?;
    let value = ok(s.read(p, b"k").await, "read")?;
    expect(value.as_deref() == Some(&b"new"[..]), || format!("read {value:?} after refused writes"))?;
    let other = ok(s.read(p, b"other").await, "read")?;
    expect(other.is_none(), || format!("a refused write created a key: {other:?}"))?;
    let checkpoint = ok(s.checkpoint(p, T(11)).await, "checkpoint")?;
    expect(checkpoint.as_deref() == Some(&b"offset=5"[..]), || format!("checkpoint {checkpoint:?}"))?;
    Ok(true)
}

async fn raising_writes_no_data_and_shuts_older_owners_out<B: Backend>(_: &B, s: B::Store) -> Outcome {
    let p = P(5);
    ok(s.write(p, T(5), b"k", b"old").await, "write under 5")?;
    ok(s.raise(p, T(7)).await, "raise to 7")?;
    let value = ok(s.read(p, b"k").await, "read")?;
    expect(value.as_deref() == Some(&b"old"[..]), || format!("a raise changed the data: {value:?}"))?;
    stale(s.write(p, T(5), b"k", b"late").await, 7, "the old owner's write after the raise")?;
    stale(s.raise(p, T(6)).await, 7, "a raise to a lower token")?;
    ok(s.raise(p, T(7)).await, "the same raise again")?;
    let highest = ok(s.highest(p).await, "highest")?;
    expect(highest == Some(T(7)), || format!("highest is {highest:?}, want 7"))?;
    let untouched = ok(s.highest(P(6)).await, "highest of an untouched partition")?;
    expect(untouched.is_none(), || format!("an untouched partition has a fence: {untouched:?}"))?;
    Ok(true)
}

async fn a_checkpoint_is_read_only_under_an_admitted_token<B: Backend>(_: &B, s: B::Store) -> Outcome {
    let p = P(7);
    let none = ok(s.checkpoint(p, T(1)).await, "checkpoint of a new partition")?;
    expect(none.is_none(), || format!("a new partition has a checkpoint: {none:?}"))?;
    ok(s.save_checkpoint(p, T(3), b"offset=9").await, "checkpoint under 3")?;
    ok(s.raise(p, T(4)).await, "raise to 4")?;
    stale(s.checkpoint(p, T(3)).await, 4, "the old owner reading the checkpoint")?;
    let carried = ok(s.checkpoint(p, T(4)).await, "the new owner reading the checkpoint")?;
    expect(carried.as_deref() == Some(&b"offset=9"[..]), || format!("the new owner read {carried:?}"))?;
    Ok(true)
}

async fn partitions_are_fenced_independently<B: Backend>(_: &B, s: B::Store) -> Outcome {
    ok(s.raise(P(1), T(100)).await, "raise p1 to 100")?;
    ok(s.write(P(2), T(1), b"k", b"p2").await, "write to p2 under 1")?;
    ok(s.write(P(1), T(100), b"k", b"p1").await, "write to p1 under 100")?;
    let (one, two) = (ok(s.read(P(1), b"k").await, "read p1")?, ok(s.read(P(2), b"k").await, "read p2")?);
    expect(one.as_deref() == Some(&b"p1"[..]) && two.as_deref() == Some(&b"p2"[..]), || {
        format!("the same key in two partitions reads {one:?} and {two:?}")
    })?;
    Ok(true)
}

async fn a_batch_is_applied_whole<B: Backend>(_: &B, s: B::Store) -> Outcome {
    let p = P(8);
    ok(s.write(p, T(2), b"gone", b"soon").await, "write under 2")?;
    let mut batch = FenceBatch::new();
    batch.put(b"a", b"1").put(b"b", b"2").put(b"a", b"3").delete(b"gone").checkpoint(b"offset=3");
    ok(s.apply(p, T(2), &batch).await, "batch under 2")?;
    let a = ok(s.read(p, b"a").await, "read a")?;
    let b = ok(s.read(p, b"b").await, "read b")?;
    let gone = ok(s.read(p, b"gone").await, "read gone")?;
    let checkpoint = ok(s.checkpoint(p, T(2)).await, "checkpoint")?;
    expect(
        a.as_deref() == Some(&b"3"[..])
            && b.as_deref() == Some(&b"2"[..])
            && gone.is_none()
            && checkpoint.as_deref() == Some(&b"offset=3"[..]),
        || format!("after the batch: a={a:?} b={b:?} gone={gone:?} checkpoint={checkpoint:?}"),
    )?;
    ok(s.apply(p, T(3), &FenceBatch::new()).await, "an empty batch under 3")?;
    stale(s.write(p, T(2), b"a", b"late").await, 3, "a write after an empty batch raised the fence")?;
    Ok(true)
}

/// An old owner writes as fast as it can while the new owner raises its fence: once the raise
/// has returned, what the new owner reads never changes again.
async fn a_raise_orders_every_older_write_before_the_new_owners_read<B: Backend>(
    _: &B,
    s: B::Store,
) -> Outcome {
    let p = P(9);
    let s = Arc::new(s);
    let old = {
        let s = s.clone();
        tokio::spawn(async move {
            let mut accepted = 0u64;
            for n in 0..ROUNDS * 4 {
                match s.write(p, T(1), b"counter", n.to_string().as_bytes()).await {
                    Ok(()) => accepted += 1,
                    Err(FenceError::Stale { .. }) => return Ok(accepted),
                    Err(e) => return Err(format!("the old owner's write failed: {e}")),
                }
                tokio::task::yield_now().await;
            }
            Ok(accepted)
        })
    };
    tokio::task::yield_now().await;
    ok(s.raise(p, T(2)).await, "the new owner's raise")?;
    let resumed = ok(s.read(p, b"counter").await, "the new owner's read")?;
    let accepted = old.await.map_err(|e| format!("the old owner's task: {e}"))??;
    let later = ok(s.read(p, b"counter").await, "a read after the old owner stopped")?;
    expect(resumed == later, || {
        format!("the old owner changed the state after the raise: read {resumed:?}, then {later:?} ({accepted} accepted)")
    })?;
    stale(s.write(p, T(1), b"counter", b"late").await, 2, "the old owner after the raise")?;
    Ok(true)
}

/// Writers with tokens 1..=WRITERS each write a batch of two keys holding the same value, over
/// and over at once. The check and the batch are one step, so the keys always agree; once a
/// writer is refused it is never admitted again; no write is admitted under a token lower than
/// one whose write had already been admitted before it began (a store whose check and write
/// are two steps lets a slow writer put the fence back, and then lower tokens through); and
/// the highest token's writes are last.
async fn a_batch_is_all_or_nothing_under_concurrent_writers<B: Backend>(_: &B, s: B::Store) -> Outcome {
    let p = P(10);
    let s = Arc::new(s);
    let admitted_before = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut writers = Vec::new();
    for token in 1..=WRITERS {
        let (s, admitted_before) = (s.clone(), admitted_before.clone());
        writers.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for round in 0..ROUNDS {
                let value = format!("{token}:{round}");
                let mut batch = FenceBatch::new();
                batch.put(b"a", value.as_bytes()).put(b"b", value.as_bytes());
                let floor = admitted_before.load(std::sync::atomic::Ordering::SeqCst);
                match s.apply(p, T(token), &batch).await {
                    Ok(()) if token < floor => {
                        return Err(format!(
                            "writer {token} was admitted after token {floor} had been: the fence went back"
                        ))
                    }
                    Ok(()) => {
                        admitted_before.fetch_max(token, std::sync::atomic::Ordering::SeqCst);
                        outcomes.push(true)
                    }
                    Err(FenceError::Stale { .. }) => outcomes.push(false),
                    Err(e) => return Err(format!("writer {token}: {e}")),
                }
                tokio::task::yield_now().await;
            }
            Ok((token, outcomes))
        }));
    }
    for writer in writers {
        let (token, outcomes) = writer.await.map_err(|e| format!("a writer's task: {e}"))??;
        let first_refusal = outcomes.iter().position(|accepted| !accepted).unwrap_or(outcomes.len());
        expect(outcomes[first_refusal..].iter().all(|accepted| !accepted), || {
            format!("writer {token} was admitted again after a refusal: {outcomes:?}")
        })?;
        if token == WRITERS {
            expect(outcomes.iter().all(|accepted| *accepted), || {
                format!("the highest token was refused: {outcomes:?}")
            })?;
        }
    }
    let a = ok(s.read(p, b"a").await, "read a")?;
    let b = ok(s.read(p, b"b").await, "read b")?;
    expect(a == b, || format!("a batch was applied in part: a={a:?} b={b:?}"))?;
    let last = format!("{WRITERS}:{}", ROUNDS - 1);
    expect(a.as_deref() == Some(last.as_bytes()), || format!("the last write is {a:?}, want {last}"))?;
    let highest = ok(s.highest(p).await, "highest")?;
    expect(highest == Some(T(WRITERS)), || format!("the fence ended at {highest:?}, want {WRITERS}"))?;
    Ok(true)
}

async fn fences_data_and_checkpoints_survive_a_restart<B: Backend>(backend: &B, s: B::Store) -> Outcome {
    let p = P(11);
    ok(s.write(p, T(8), b"k", b"kept").await, "write under 8")?;
    ok(s.save_checkpoint(p, T(8), b"offset=8").await, "checkpoint under 8")?;
    ok(s.raise(p, T(9)).await, "raise to 9")?;
    let Some(s) = ok(backend.reopen("fences_data_and_checkpoints_survive_a_restart", s).await, "reopen")?
    else {
        return Ok(false);
    };
    stale(s.write(p, T(8), b"k", b"late").await, 9, "the old owner after a restart")?;
    let value = ok(s.read(p, b"k").await, "read after a restart")?;
    expect(value.as_deref() == Some(&b"kept"[..]), || format!("read {value:?} after a restart"))?;
    let checkpoint = ok(s.checkpoint(p, T(9)).await, "checkpoint after a restart")?;
    expect(checkpoint.as_deref() == Some(&b"offset=8"[..]), || {
        format!("checkpoint {checkpoint:?} after a restart")
    })?;
    let highest = ok(s.highest(p).await, "highest after a restart")?;
    expect(highest == Some(T(9)), || format!("highest is {highest:?} after a restart, want 9"))?;
    Ok(true)
}
