//! The fencing rule on a real PostgreSQL server (started by `scripts/setup`). The connection
//! string comes from `TENURE_TEST_POSTGRES`, defaulting to the server `scripts/setup` prepares.

use tenure::fence::{FenceError, FenceStore, PostgresFence};
use tenure::ids::{FencingToken as T, PartitionId as P};

fn base() -> String {
    std::env::var("TENURE_TEST_POSTGRES").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".into()
    })
}

/// A fresh schema per run, so runs never see each other's rows.
async fn fresh_store() -> PostgresFence {
    let (client, conn) = tokio_postgres::connect(&base(), tokio_postgres::NoTls)
        .await
        .expect("a PostgreSQL server (run scripts/setup, or set TENURE_TEST_POSTGRES)");
    tokio::spawn(conn);
    let schema = format!("tenure_test_{}_{}", std::process::id(), rand::random::<u32>());
    client.batch_execute(&format!("CREATE SCHEMA {schema}")).await.unwrap();
    PostgresFence::connect(&format!("{} options='-c search_path={schema}'", base())).await.unwrap()
}

#[tokio::test]
async fn postgres_store_follows_the_rule() {
    let store = fresh_store().await;
    let p = P(3);
    store.write(p, T(10), b"k", b"batch-1").await.unwrap();
    store.write(p, T(10), b"k", b"batch-1b").await.unwrap();
    store.save_checkpoint(p, T(10), b"offset=2").await.unwrap();
    store.raise(p, T(17)).await.unwrap();
    assert_eq!(store.checkpoint(p, T(17)).await.unwrap().as_deref(), Some(&b"offset=2"[..]));
    let stale = FenceError::Stale { partition: p, token: T(10), highest: T(17) };
    assert_eq!(store.write(p, T(10), b"k", b"batch-1-late").await.unwrap_err(), stale);
    assert_eq!(store.save_checkpoint(p, T(10), b"offset=9").await.unwrap_err(), stale);
    assert_eq!(
        store.read(p, b"k").await.unwrap().as_deref(),
        Some(&b"batch-1b"[..]),
        "the rejected write left no trace"
    );
    store.write(p, T(17), b"k", b"batch-2").await.unwrap();
    assert!(store.raise(p, T(12)).await.is_err());
    assert_eq!(store.highest(p).await.unwrap(), Some(T(17)));
    assert_eq!(store.read(p, b"k").await.unwrap().as_deref(), Some(&b"batch-2"[..]));
    assert_eq!(store.highest(P(4)).await.unwrap(), None);
}

#[tokio::test]
async fn tokens_beyond_the_sql_range_are_refused_cleanly() {
    let store = fresh_store().await;
    let err = store.write(P(1), T(u64::MAX), b"k", b"v").await.unwrap_err();
    assert!(matches!(err, FenceError::Backend(_)), "{err:?}");
    assert_eq!(store.highest(P(1)).await.unwrap(), None);
}
