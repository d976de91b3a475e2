//! A fenced store on PostgreSQL. The rule lives in the statement: the fence row is raised with a
//! conditional upsert (`... WHERE fence_token <= $token`), and one row affected means the write
//! is in. The data write happens in the same transaction, so both commit or neither does.
//!
//! A writer frozen inside a transaction (a paused process) holds the fence row's lock and would
//! block the next owner; set `idle_in_transaction_session_timeout` on the writers' sessions so
//! the server ends such transactions.

use super::{BatchOp, FenceBatch, FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId};
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio_postgres::{Client, NoTls, Transaction};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tenure_fence (
    partition   integer PRIMARY KEY,
    fence_token bigint NOT NULL,
    checkpoint  bytea
);
CREATE TABLE IF NOT EXISTS tenure_data (
    partition integer NOT NULL,
    key       bytea   NOT NULL,
    value     bytea   NOT NULL,
    PRIMARY KEY (partition, key)
);";

const RAISE: &str = "
INSERT INTO tenure_fence (partition, fence_token) VALUES ($1, $2)
ON CONFLICT (partition) DO UPDATE SET fence_token = EXCLUDED.fence_token
WHERE tenure_fence.fence_token <= EXCLUDED.fence_token";

const UPSERT: &str = "
INSERT INTO tenure_data (partition, key, value) VALUES ($1, $2, $3)
ON CONFLICT (partition, key) DO UPDATE SET value = EXCLUDED.value";

/// A [`FenceStore`] on PostgreSQL; [`PostgresFence::transaction`] puts the application's own
/// tables under the same fence.
///
/// Calls take a connection from a small pool ([`PostgresFence::connect_pooled`]; eight by
/// default), so one partition's transaction never waits for another's.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure_core::fence::FenceError> {
/// use tenure_core::fence::{FenceStore, PostgresFence};
/// use tenure_core::ids::{FencingToken, PartitionId};
/// let store = PostgresFence::connect("host=127.0.0.1 user=postgres dbname=tenure").await?;
/// let (p, token) = (PartitionId(0), FencingToken(12));
/// store.raise(p, token).await?; // fence first, then read where to resume
/// let resume_from = store.checkpoint(p, token).await?;
/// store.write(p, token, b"order-7", b"paid").await?;
/// # Ok(()) }
/// ```
pub struct PostgresFence {
    pool: Pool,
}

/// Connections to one server, opened on demand up to a bound and kept for reuse; a connection
/// the server closed is dropped, not handed out again.
struct Pool {
    config: String,
    idle: std::sync::Mutex<Vec<Client>>,
    permits: Semaphore,
}

/// A connection taken from the pool; it goes back when dropped, unless it was closed.
struct Pooled<'a> {
    client: Option<Client>,
    pool: &'a Pool,
    _permit: SemaphorePermit<'a>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        self.client.as_ref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.client.as_mut().expect("present until dropped")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take().filter(|c| !c.is_closed()) {
            if let Ok(mut idle) = self.pool.idle.lock() {
                idle.push(client);
            }
        }
    }
}

async fn open(config: &str) -> Result<Client, FenceError> {
    let (client, connection) = tokio_postgres::connect(config, NoTls).await.map_err(db)?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "postgres connection ended");
        }
    });
    Ok(client)
}

impl Pool {
    async fn get(&self) -> Result<Pooled<'_>, FenceError> {
        let permit = self.permits.acquire().await.map_err(|_| FenceError::Backend("pool closed".into()))?;
        let reused = {
            let mut idle = self.idle.lock().map_err(|_| FenceError::Backend("pool lock poisoned".into()))?;
            idle.retain(|c| !c.is_closed());
            idle.pop()
        };
        let client = match reused {
            Some(client) => client,
            None => open(&self.config).await?,
        };
        Ok(Pooled { client: Some(client), pool: self, _permit: permit })
    }
}

/// The server's own words when it sent an error (the driver's `Display` says only "db error").
fn db(e: tokio_postgres::Error) -> FenceError {
    FenceError::Backend(match e.as_db_error() {
        Some(err) => format!("{} ({}: {})", e, err.code().code(), err.message()),
        None => e.to_string(),
    })
}

fn sql_partition(p: PartitionId) -> Result<i32, FenceError> {
    i32::try_from(p.0).map_err(|_| FenceError::Backend(format!("{p} does not fit an integer column")))
}

fn sql_token(t: FencingToken) -> Result<i64, FenceError> {
    i64::try_from(t.0).map_err(|_| FenceError::Backend(format!("token {t} does not fit a bigint column")))
}

impl PostgresFence {
    /// Connects with a libpq-style string (`host=127.0.0.1 user=postgres dbname=tenure`) and
    /// creates the tables when missing; calls share a pool of eight connections.
    pub async fn connect(config: &str) -> Result<PostgresFence, FenceError> {
        PostgresFence::connect_pooled(config, 8).await
    }

    /// As [`PostgresFence::connect`], with at most `connections` connections open at once.
    pub async fn connect_pooled(config: &str, connections: usize) -> Result<PostgresFence, FenceError> {
        if connections == 0 {
            return Err(FenceError::Backend("a pool needs at least one connection".into()));
        }
        let first = open(config).await?;
        first.batch_execute(SCHEMA).await.map_err(db)?;
        let pool = Pool {
            config: config.to_string(),
            idle: std::sync::Mutex::new(vec![first]),
            permits: Semaphore::new(connections),
        };
        Ok(PostgresFence { pool })
    }

    /// Raises the fence inside `tx`; a stale token rolls nothing forward.
    async fn raise_in(tx: &Transaction<'_>, p: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        let rows = tx.execute(RAISE, &[&sql_partition(p)?, &sql_token(token)?]).await.map_err(db)?;
        if rows == 1 {
            return Ok(());
        }
        let highest: i64 = tx
            .query_one("SELECT fence_token FROM tenure_fence WHERE partition = $1", &[&sql_partition(p)?])
            .await
            .map_err(db)?
            .get(0);
        Err(FenceError::Stale { partition: p, token, highest: FencingToken(highest as u64) })
    }

    /// Runs `work` in one transaction that first raises the partition's fence to `token`: the
    /// way to keep an application's own tables under the fence. If the token is stale, `work`
    /// never runs; if `work` fails, nothing commits, the fence included.
    ///
    /// ```no_run
    /// # async fn example(fence: &tenure_core::fence::PostgresFence) -> Result<(), tenure_core::fence::FenceError> {
    /// use tenure_core::ids::{FencingToken, PartitionId};
    /// let inserted = fence
    ///     .transaction(PartitionId(3), FencingToken(41), |tx| {
    ///         Box::pin(async move {
    ///             tx.execute("INSERT INTO invoices (customer_id) VALUES (7)", &[])
    ///                 .await
    ///                 .map_err(|e| tenure_core::fence::FenceError::Backend(e.to_string()))
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn transaction<T, F>(
        &self,
        p: PartitionId,
        token: FencingToken,
        work: F,
    ) -> Result<T, FenceError>
    where
        F: for<'a> FnOnce(
            &'a Transaction<'a>,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, FenceError>> + Send + 'a>,
        >,
    {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await.map_err(db)?;
        Self::raise_in(&tx, p, token).await?;
        let value = work(&tx).await?;
        tx.commit().await.map_err(db)?;
        Ok(value)
    }
}

impl FenceStore for PostgresFence {
    async fn raise(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        self.transaction(partition, token, |_| Box::pin(async { Ok(()) })).await
    }

    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        let p = sql_partition(partition)?;
        let batch = batch.clone();
        self.transaction(partition, token, move |tx| {
            Box::pin(async move {
                for op in batch.ops() {
                    match op {
                        BatchOp::Put { key, value } => tx.execute(UPSERT, &[&p, key, value]).await,
                        BatchOp::Delete { key } => {
                            tx.execute(
                                "DELETE FROM tenure_data WHERE partition = $1 AND key = $2",
                                &[&p, key],
                            )
                            .await
                        }
                    }
                    .map_err(db)?;
                }
                if let Some(checkpoint) = batch.new_checkpoint() {
                    tx.execute(
                        "UPDATE tenure_fence SET checkpoint = $2 WHERE partition = $1",
                        &[&p, &checkpoint],
                    )
                    .await
                    .map_err(db)?;
                }
                Ok(())
            })
        })
        .await
    }

    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT value FROM tenure_data WHERE partition = $1 AND key = $2",
                &[&sql_partition(partition)?, &key],
            )
            .await
            .map_err(db)?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT fence_token, checkpoint FROM tenure_fence WHERE partition = $1",
                &[&sql_partition(partition)?],
            )
            .await
            .map_err(db)?;
        match row {
            None => Ok(None),
            Some(r) => {
                let highest = FencingToken(r.get::<_, i64>(0) as u64);
                if token < highest {
                    return Err(FenceError::Stale { partition, token, highest });
                }
                Ok(r.get(1))
            }
        }
    }

    async fn highest(&self, partition: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT fence_token FROM tenure_fence WHERE partition = $1",
                &[&sql_partition(partition)?],
            )
            .await
            .map_err(db)?;
        Ok(row.map(|r| FencingToken(r.get::<_, i64>(0) as u64)))
    }
}
