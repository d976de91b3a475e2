//! The second baseline: partition ownership on PostgreSQL, the way a careful user would build it
//! from one lease table. One row per partition; a worker takes free or expired partitions with
//! one conditional update (`UPDATE leases SET holder = $me, token = token + 1, expires_at =
//! now() + ttl WHERE part = ANY($mine) AND expires_at < now()`), so the row's token is the
//! fencing token, checked in the same database; it gives partitions up with a guarded update
//! (both lock rows in partition order and skip rows another transaction holds, taken up again
//! on the next pass, so workers never deadlock);
//! it renews its membership and every lease it holds with one statement per heartbeat. Changes
//! are announced with `NOTIFY`, on which every worker reconciles at once; since an expiry
//! announces nothing, each also reconciles on every heartbeat tick. Placement is tenure's own
//! (`tenure::placement::place`), so all three designs move the same partitions.
//!
//! Every commit is synced (PostgreSQL's default `synchronous_commit`), as tenure's and etcd's.

use anyhow::{Context, Result};
use futures::StreamExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tenure::ids::SessionId;
use tenure::placement::{place, Member};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Client, NoTls};

use super::Acquired;

/// The server the tests use (`scripts/setup` starts it), or `TENURE_TEST_POSTGRES`.
fn conninfo() -> String {
    std::env::var("TENURE_TEST_POSTGRES").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".into()
    })
}

/// A schema of its own for one run: the member and lease tables, dropped at the end.
pub struct Postgres {
    schema: String,
}

/// A connection to the run's schema, its notifications forwarded to `changes`.
struct Connection {
    client: Client,
    changes: mpsc::UnboundedReceiver<()>,
    driver: JoinHandle<()>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Postgres {
    pub async fn start(partitions: u32) -> Result<Postgres> {
        let pg = Postgres { schema: format!("tb_{}", rand::random::<u32>()) };
        let c = pg.connect().await.context("connecting to PostgreSQL (scripts/setup starts it)")?;
        c.client
            .batch_execute(&format!(
                "CREATE SCHEMA {s};
                 CREATE TABLE {s}.members (name text PRIMARY KEY, expires_at timestamptz NOT NULL);
                 CREATE TABLE {s}.leases (part int PRIMARY KEY, holder text,
                     token bigint NOT NULL DEFAULT 0,
                     expires_at timestamptz NOT NULL DEFAULT '-infinity');
                 CREATE INDEX ON {s}.leases (holder);
                 INSERT INTO {s}.leases (part) SELECT generate_series(0, {last});",
                s = pg.schema,
                last = partitions as i64 - 1
            ))
            .await?;
        Ok(pg)
    }

    async fn connect(&self) -> Result<Connection> {
        let (client, mut connection) = tokio_postgres::connect(&conninfo(), NoTls).await?;
        let (tx, changes) = mpsc::unbounded_channel();
        let driver = tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(_)) => {
                        let _ = tx.send(());
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
        client.batch_execute(&format!("SET search_path TO {}, public", self.schema)).await?;
        Ok(Connection { client, changes, driver })
    }

    pub async fn stop(self) -> Result<()> {
        let c = self.connect().await?;
        c.client.batch_execute(&format!("DROP SCHEMA {} CASCADE", self.schema)).await?;
        Ok(())
    }
}

async fn owners(c: &Client, partitions: u32) -> Result<Vec<Option<String>>> {
    let mut table = vec![None; partitions as usize];
    for row in c.query("SELECT part, holder FROM leases WHERE expires_at > now()", &[]).await? {
        let (p, holder): (i32, Option<String>) = (row.get(0), row.get(1));
        if let Some(slot) = table.get_mut(p as usize) {
            *slot = holder;
        }
    }
    Ok(table)
}

/// `w3` -> session 3, so placement sees the same members as in tenure.
fn session_of(name: &str) -> SessionId {
    SessionId(name.trim_start_matches('w').parse().unwrap_or(0))
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One worker of the baseline.
pub struct PgWorker {
    name: String,
    pub ttl: Duration,
    task: JoinHandle<()>,
    connection: Connection,
}

impl PgWorker {
    pub async fn join(
        pg: &Postgres,
        name: &str,
        ttl: Duration,
        partitions: u32,
        acquired: Acquired,
    ) -> Result<PgWorker> {
        let connection = pg.connect().await?;
        connection
            .client
            .execute(
                "INSERT INTO members (name, expires_at) VALUES ($1, now() + $2::float8 * interval '1 ms')
                 ON CONFLICT (name) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                &[&name, &millis(ttl)],
            )
            .await?;
        connection.client.batch_execute("NOTIFY changes").await?;
        let mut own = pg.connect().await?;
        own.client.batch_execute("LISTEN changes").await?;
        let me = name.to_string();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(ttl / 4);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {
                        if let Err(e) = renew(&own.client, &me, ttl).await {
                            eprintln!("postgres worker {me}: renewal: {e}");
                        }
                    }
                    change = own.changes.recv() => if change.is_none() { return },
                }
                // Every change that queued up meanwhile is covered by one pass.
                while own.changes.try_recv().is_ok() {}
                if let Err(e) = reconcile(&mut own.client, &me, ttl, partitions, &acquired).await {
                    eprintln!("postgres worker {me}: {e}");
                }
            }
        });
        Ok(PgWorker { name: name.to_string(), ttl, task, connection })
    }

    /// Stops as a crash would: no renewals, no cleanup; the leases run out.
    pub fn crash(self) {
        self.task.abort();
    }

    /// Leaves: membership and every lease given up in one transaction, tried again (as
    /// PostgreSQL asks of its users) if the server broke a deadlock by aborting it.
    pub async fn leave(mut self) -> Result<()> {
        self.task.abort();
        let mut tries = 0;
        loop {
            match self.try_leave().await {
                Err(e)
                    if tries < 10
                        && e.code() == Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED) =>
                {
                    tries += 1;
                }
                outcome => return Ok(outcome?),
            }
        }
    }

    async fn try_leave(&mut self) -> Result<(), tokio_postgres::Error> {
        let tx = self.connection.client.transaction().await?;
        tx.execute("DELETE FROM members WHERE name = $1", &[&self.name]).await?;
        tx.execute(
            "UPDATE leases SET holder = NULL, expires_at = '-infinity' WHERE part IN
                 (SELECT part FROM leases WHERE holder = $1 ORDER BY part FOR UPDATE)",
            &[&self.name],
        )
        .await?;
        tx.batch_execute("NOTIFY changes").await?;
        tx.commit().await
    }
}

/// The renewal: one statement extends the worker's membership and every lease it still holds.
const RENEW: &str = "WITH m AS (UPDATE members SET expires_at = now() + $2::float8 * interval '1 ms' WHERE name = $1)
     UPDATE leases SET expires_at = now() + $2::float8 * interval '1 ms' WHERE holder = $1 AND expires_at > now()";

async fn renew(c: &Client, me: &str, ttl: Duration) -> Result<u64> {
    Ok(c.execute(RENEW, &[&me, &millis(ttl)]).await?)
}

/// One pass: read live members and owners, compute the placement, give up and take.
async fn reconcile(
    c: &mut Client,
    me: &str,
    ttl: Duration,
    partitions: u32,
    acquired: &Acquired,
) -> Result<()> {
    let members: Vec<Member> = c
        .query("SELECT name FROM members WHERE expires_at > now() ORDER BY name", &[])
        .await?
        .iter()
        .map(|row| {
            let name: String = row.get(0);
            Member { session: session_of(&name), name, weight: 1 }
        })
        .collect();
    let mut members = members;
    members.sort_by_key(|m| m.session);
    let current: Vec<Option<SessionId>> =
        owners(c, partitions).await?.iter().map(|o| o.as_deref().map(session_of)).collect();
    let target = place(&members, &current);
    let mine = session_of(me);
    let (mut give, mut take): (Vec<i32>, Vec<i32>) = (Vec::new(), Vec::new());
    for p in 0..partitions as usize {
        match (current[p], target[p]) {
            (Some(now), want) if now == mine && want != Some(mine) => give.push(p as i32),
            (None, Some(want)) if want == mine => take.push(p as i32),
            _ => {}
        }
    }
    if !give.is_empty() {
        let tx = c.transaction().await?;
        tx.execute(
            "UPDATE leases SET holder = NULL, expires_at = '-infinity' WHERE part IN (SELECT part FROM leases
                 WHERE part = ANY($1) AND holder = $2 ORDER BY part FOR UPDATE SKIP LOCKED)",
            &[&give, &me],
        )
        .await?;
        tx.batch_execute("NOTIFY changes").await?;
        tx.commit().await?;
    }
    if !take.is_empty() {
        let tx = c.transaction().await?;
        let rows = tx
            .query(
                "UPDATE leases SET holder = $1, token = token + 1, expires_at = now() + $3::float8 * interval '1 ms'
                 WHERE part IN (SELECT part FROM leases WHERE part = ANY($2) AND expires_at < now()
                     ORDER BY part FOR UPDATE SKIP LOCKED)
                 RETURNING part, token",
                &[&me, &take, &millis(ttl)],
            )
            .await?;
        if !rows.is_empty() {
            tx.batch_execute("NOTIFY changes").await?;
        }
        tx.commit().await?;
        let now = Instant::now();
        let mut acquired = acquired.lock().unwrap();
        for row in rows {
            let (p, token): (i32, i64) = (row.get(0), row.get(1));
            acquired.insert(p as u32, (me.to_string(), now, token));
        }
    }
    Ok(())
}

/// The owner of every partition whose lease has not run out, by worker name.
pub async fn current_owners(pg: &Postgres, partitions: u32) -> Result<Vec<Option<String>>> {
    owners(&pg.connect().await?.client, partitions).await
}

/// CPU time used so far by every PostgreSQL server process (the postmaster and its backends).
pub fn server_cpu() -> Duration {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Duration::ZERO };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres")
        })
        .filter_map(|pid| super::process_cpu_time(&pid.to_string()))
        .sum()
}

/// `sessions` workers, each holding its share of `partitions`, renewing over `connections`
/// pooled connections with `in_flight` renewals outstanding in all, for `window`: renewals
/// done, and the server's CPU time meanwhile.
pub async fn renewal_load(
    pg: &Postgres,
    sessions: usize,
    connections: usize,
    in_flight: usize,
    window: Duration,
) -> Result<(u64, Duration)> {
    let setup = pg.connect().await?;
    setup
        .client
        .batch_execute(&format!(
            "INSERT INTO members (name, expires_at)
                 SELECT 's' || n, now() + interval '1 hour' FROM generate_series(0, {last}) n;
             UPDATE leases SET holder = 's' || (part % {sessions}), token = token + 1,
                 expires_at = now() + interval '1 hour';",
            last = sessions - 1
        ))
        .await?;
    let mut pool = Vec::new();
    for _ in 0..connections {
        pool.push(Arc::new(pg.connect().await?));
    }
    let ttl = Duration::from_secs(3600);
    let before = server_cpu();
    let start = Instant::now();
    let renewed: Vec<u64> = futures::stream::iter(0..in_flight)
        .map(|lane| {
            let c = pool[lane % connections].clone();
            async move {
                let mut done = 0u64;
                let mut session = lane;
                while start.elapsed() < window {
                    renew(&c.client, &format!("s{}", session % sessions), ttl).await?;
                    done += 1;
                    session += in_flight;
                }
                Ok::<u64, anyhow::Error>(done)
            }
        })
        .buffer_unordered(in_flight)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let cpu = server_cpu().saturating_sub(before);
    Ok((renewed.iter().sum(), cpu))
}
