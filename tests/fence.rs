//! The fencing rule on every backend, through one conformance check: in-memory, RocksDB (with a
//! restart), and a real PostgreSQL server.

use tenure::fence::{FenceError, FenceStore, MemoryFence, RocksFence};
use tenure::ids::{FencingToken as T, PartitionId as P};

/// The rule and the fence-before-resume order, as a story every backend must tell the same way.
async fn conformance(store: &impl FenceStore) {
    let (p, q) = (P(3), P(4));
    // The first owner writes many times under one token (>=, not >).
    store.write(p, T(10), b"k", b"batch-1").await.unwrap();
    store.write(p, T(10), b"k", b"batch-1b").await.unwrap();
    store.save_checkpoint(p, T(10), b"offset=2").await.unwrap();
    assert_eq!(store.highest(p).await.unwrap(), Some(T(10)));

    // A new owner fences before it reads what it resumes from.
    store.raise(p, T(17)).await.unwrap();
    assert_eq!(store.checkpoint(p, T(17)).await.unwrap().as_deref(), Some(&b"offset=2"[..]));

    // The paused old owner wakes: every write and checkpoint is rejected, and nothing changes.
    let stale = FenceError::Stale { partition: p, token: T(10), highest: T(17) };
    assert_eq!(store.write(p, T(10), b"k", b"batch-1-late").await.unwrap_err(), stale);
    assert_eq!(store.save_checkpoint(p, T(10), b"offset=9").await.unwrap_err(), stale);
    assert_eq!(store.checkpoint(p, T(10)).await.unwrap_err(), stale);
    assert_eq!(store.read(p, b"k").await.unwrap().as_deref(), Some(&b"batch-1b"[..]));
    assert_eq!(store.checkpoint(p, T(17)).await.unwrap().as_deref(), Some(&b"offset=2"[..]));

    // The new owner writes; the fence never goes down, even when asked to.
    store.write(p, T(17), b"k", b"batch-2").await.unwrap();
    assert!(store.raise(p, T(12)).await.is_err());
    assert_eq!(store.highest(p).await.unwrap(), Some(T(17)));
    assert_eq!(store.read(p, b"k").await.unwrap().as_deref(), Some(&b"batch-2"[..]));

    // Partitions are independent.
    assert_eq!(store.highest(q).await.unwrap(), None);
    store.write(q, T(1), b"k", b"other").await.unwrap();
    assert_eq!(store.read(p, b"k").await.unwrap().as_deref(), Some(&b"batch-2"[..]));
}

#[tokio::test]
async fn in_memory_store_follows_the_rule() {
    conformance(&MemoryFence::default()).await;
}

#[tokio::test]
async fn rocksdb_store_follows_the_rule_and_remembers_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = RocksFence::open(dir.path()).unwrap();
        conformance(&store).await;
    }
    let store = RocksFence::open(dir.path()).unwrap();
    assert_eq!(store.highest(P(3)).await.unwrap(), Some(T(17)), "the fence survived the restart");
    assert!(matches!(store.write(P(3), T(16), b"k", b"late").await, Err(FenceError::Stale { .. })));
}

#[tokio::test]
async fn concurrent_writers_never_let_a_lower_token_in_after_a_higher_one() {
    use std::sync::Arc;
    let store = Arc::new(MemoryFence::default());
    let mut tasks = Vec::new();
    for token in 1..=40u64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let ok = store.write(P(0), T(token), b"k", &token.to_be_bytes()).await.is_ok();
            (token, ok)
        }));
    }
    let mut accepted = Vec::new();
    for t in tasks {
        let (token, ok) = t.await.unwrap();
        if ok {
            accepted.push(token);
        }
    }
    let highest = store.highest(P(0)).await.unwrap().unwrap();
    assert_eq!(highest, T(*accepted.iter().max().unwrap()));
    let value = store.read(P(0), b"k").await.unwrap().unwrap();
    assert_eq!(
        u64::from_be_bytes(value.try_into().unwrap()),
        highest.0,
        "the last write in is the highest token"
    );
}

/// The harness's store served over gRPC tells the same story as the store it serves: every
/// answer, stale ones with their highest token included, crosses the wire intact.
#[tokio::test]
async fn a_store_served_over_grpc_follows_the_rule() {
    use std::sync::Arc;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = Arc::new(MemoryFence::default());
    let server = tokio::spawn(tenure::nemesis::serve_store(served.clone(), listener, stop.clone()));
    let remote = tenure::nemesis::RemoteStore::new(&addr).unwrap();
    conformance(&remote).await;
    assert_eq!(served.highest(P(3)).await.unwrap(), Some(T(17)), "the decisions were the served store's");
    let huge = vec![0u8; 2 << 20];
    assert!(matches!(remote.write(P(5), T(1), b"k", &huge).await, Err(FenceError::Backend(_))));
    stop.cancel();
    server.await.unwrap().unwrap();
    let gone = remote.write(P(3), T(17), b"k", b"after").await.unwrap_err();
    assert!(matches!(gone, FenceError::Backend(_)), "{gone:?}");
}
