//! The billing exercise: three billing workers share the customers by partition and write this
//! month's invoices, each on the partition runner (a handler per owned partition). One of them
//! freezes in the middle of the run, between deciding to bill a customer and writing the
//! invoice, for three times the lease TTL. Its partitions go to the others, which resume from
//! the durable progress and finish the month. Then it wakes up and carries on.
//!
//! Each biller is a machine of its own: a runtime on a thread of its own, with its runner,
//! heartbeats and database connections. The freeze blocks that thread, so everything of the
//! biller stops at once, heartbeats included, as in a stop-the-world pause; the coordinators and
//! the other billers run on.
//!
//! Three layers of protection, each switchable, and the run is repeated for all eight settings:
//! - lease checks: a partition's billing runs inside its handler, which the runner stops when
//!   the partition is revoked or lost, and which looks at its lease before each invoice. Off,
//!   the handler hands the partition's billing to a job of its own that runs to the end
//!   whatever happens to the grant, like a plain lock with a TTL shorter than the job.
//! - fencing: every write carries the partition's fencing token and the store refuses a token
//!   lower than the highest it has seen; a new owner raises the fence before it reads where to
//!   resume (fence-before-resume), and the invoice, the progress and the check are one
//!   PostgreSQL transaction, through the `Fenced` value `acquire` returns.
//! - unique key: `UNIQUE (customer_id, billing_period)`, so a second invoice for the same month
//!   is refused whoever writes it.
//!
//! It prints, per setting, how many invoices were written and how many of them are duplicates.
//! Lease checks alone leave the invoice whose check came before the pause: on waking, the
//! biller's thread goes on from where it stopped and hands that invoice to the database client
//! before anything else of it runs, so no later check can catch it. Fencing or the unique key
//! alone close the gap; all three give zero.
//!
//! Run: `cargo run --example invoices` (against the server `scripts/setup` starts; `--postgres
//! CONNINFO` names another). The example works in a schema of its own, `tenure_invoices_<pid>`,
//! made afresh for every run and dropped at the end.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tenure::fence::{FenceError, PostgresFence};
use tenure::ids::PartitionId;
use tenure::keyspace::KeySpace;
use tenure::local_cluster::LocalCluster;
use tenure::worker::{Assignment, Fenced, Runner, WorkerConfig};
use tokio_util::sync::CancellationToken;

const PERIOD: &str = "2026-11";
const CUSTOMERS: u32 = 240;
const PARTITIONS: u32 = 12;
const TTL: Duration = Duration::from_millis(1000);
/// Time to compute one invoice: a worker's share takes longer than the TTL.
const WORK_PER_INVOICE: Duration = Duration::from_millis(15);
/// How long the frozen worker is stopped.
const PAUSE: Duration = Duration::from_millis(3000);
/// The frozen worker stops after this many invoices of its first partition.
const PAUSE_AFTER: usize = 8;

#[derive(Clone, Copy, Debug)]
struct Layers {
    lease_checks: bool,
    fencing: bool,
    unique_key: bool,
}

/// What the billers did, counted across all of them.
#[derive(Default)]
struct Counts {
    inserted: AtomicU64,
    refused_by_unique_key: AtomicU64,
    refused_by_fence: AtomicU64,
    stopped_by_lease_check: AtomicU64,
    /// Billing tasks the runner aborted because their partition was lost.
    aborted_by_runner: AtomicU64,
}

/// Counts and tells of a billing task the runner aborts: dropped while still armed.
struct AbortWatch<'a> {
    run: &'a Run,
    name: &'a str,
    partition: PartitionId,
    armed: bool,
}

impl Drop for AbortWatch<'_> {
    fn drop(&mut self) {
        if self.armed {
            count(&self.run.counts.aborted_by_runner);
            self.run.say(format!(
                "{}'s runner aborts its task for {}: the partition was lost, or the session with it",
                self.name, self.partition
            ));
        }
    }
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::SeqCst);
}

/// What one setting's run shares between the billers.
struct Run {
    start: Instant,
    layers: Layers,
    customers: BTreeMap<PartitionId, Vec<u32>>,
    /// Fires when the assignment has settled and the month's billing may begin.
    month_begins: CancellationToken,
    counts: Counts,
    database: String,
}

impl Run {
    fn say(&self, line: String) {
        println!("  t={:5.2}s {line}", self.start.elapsed().as_secs_f64());
    }
}

/// One biller's connections to the ledger: the fenced store (a pool), and a plain connection
/// for the writers that do not fence.
struct Ledger {
    fence: Arc<PostgresFence>,
    plain: tokio_postgres::Client,
}

/// How an owner writes: through the value that raising the fence returned, or, with fencing
/// off, with nothing but its belief.
enum Pen {
    Fenced(Fenced<Arc<PostgresFence>>),
    Unfenced,
}

/// One biller: its name, whether it is the one that freezes, and its ledger.
struct Biller {
    name: String,
    freezes: AtomicBool,
    ledger: Ledger,
    run: Arc<Run>,
    /// A biller bills one partition at a time.
    turn: tokio::sync::Semaphore,
    /// The billing jobs handed off when lease checks are off; awaited before the biller ends.
    jobs: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Biller {
    /// The handler the runner starts for each owned partition.
    async fn partition(self: Arc<Self>, assignment: Assignment) -> Result<(), FenceError> {
        // Nothing is billed until the assignment settles; a partition moved before that is
        // simply given back.
        tokio::select! {
            _ = self.run.month_begins.cancelled() => {}
            _ = assignment.stopped() => return Ok(()),
        }
        if self.run.layers.lease_checks {
            let mut watch = AbortWatch {
                run: &self.run,
                name: &self.name,
                partition: assignment.partition(),
                armed: true,
            };
            let billed = self.bill(&assignment).await;
            watch.armed = false;
            return billed;
        }
        // A job that, once started, trusts its grant to the end: the runner's stop does not
        // reach it.
        let (biller, job_assignment) = (self.clone(), assignment.clone());
        let job = tokio::spawn(async move {
            if let Err(e) = biller.bill(&job_assignment).await {
                biller.run.say(format!("{} gave up on {}: {e}", biller.name, job_assignment.partition()));
            }
        });
        self.jobs.lock().expect("jobs poisoned").push(job);
        assignment.stopped().await;
        Ok(())
    }

    /// Bills the partition's customers from where the last owner stopped.
    async fn bill(&self, assignment: &Assignment) -> Result<(), FenceError> {
        let (run, p, token) = (&self.run, assignment.partition(), assignment.token());
        let _turn = self.turn.acquire().await.map_err(|e| FenceError::Backend(e.to_string()))?;
        // Fence before resume: raising the fence is what makes the value that writes.
        let pen = match run.layers.fencing {
            true => assignment.acquire(self.ledger.fence.clone()).await.map(Pen::Fenced),
            false => Ok(Pen::Unfenced),
        };
        let resumed = match pen {
            Ok(pen) => self.resume(p, &pen).await.map(|last| (pen, last)),
            Err(e) => Err(e),
        };
        let (pen, last) = match resumed {
            Ok(resumed) => resumed,
            Err(FenceError::Stale { highest, .. }) => {
                count(&run.counts.refused_by_fence);
                run.say(format!("{} REJECT resume of {p} token={token} (highest seen {highest})", self.name));
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let todo: Vec<u32> =
            run.customers[&p].iter().copied().filter(|c| last.is_none_or(|l| *c > l)).collect();
        if todo.is_empty() {
            return Ok(());
        }
        run.say(format!("{} bills {p} token={token}: {} customers to go", self.name, todo.len()));
        for (done, customer) in todo.into_iter().enumerate() {
            if run.layers.lease_checks && (assignment.is_stopped() || !assignment.handle().is_valid()) {
                count(&run.counts.stopped_by_lease_check);
                run.say(format!("{} stops {p}: its lease is no longer valid", self.name));
                return Ok(());
            }
            tokio::time::sleep(WORK_PER_INVOICE).await; // computing the invoice
            if done == PAUSE_AFTER && self.freezes.swap(false, Ordering::SeqCst) {
                run.say(format!(
                    "{} freezes for {:.1}s just before writing customer {customer}'s invoice",
                    self.name,
                    PAUSE.as_secs_f64()
                ));
                // The whole biller stops: this thread is its only one.
                std::thread::sleep(PAUSE);
                run.say(format!("{} wakes up and carries on", self.name));
            }
            match self.write(p, &pen, customer, token.0).await {
                Ok(true) => count(&run.counts.inserted),
                Ok(false) => count(&run.counts.refused_by_unique_key),
                Err(FenceError::Stale { highest, .. }) => {
                    count(&run.counts.refused_by_fence);
                    run.say(format!(
                        "{} REJECT invoice of customer {customer} in {p} token={token} (highest seen {highest})",
                        self.name
                    ));
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Where a new owner resumes: the last customer billed in the partition; under the fence
    /// when there is one, so no older owner can move it afterwards.
    async fn resume(&self, p: PartitionId, pen: &Pen) -> Result<Option<u32>, FenceError> {
        let query = "SELECT last_customer FROM billing_progress WHERE partition = $1";
        let row = match pen {
            Pen::Fenced(fenced) => {
                fenced
                    .transaction(move |tx| {
                        Box::pin(async move { tx.query_opt(query, &[&(p.0 as i32)]).await.map_err(pg_error) })
                    })
                    .await?
            }
            Pen::Unfenced => self.ledger.plain.query_opt(query, &[&(p.0 as i32)]).await.map_err(pg_error)?,
        };
        Ok(row.map(|r| r.get::<_, i32>(0) as u32))
    }

    /// Writes one invoice and the partition's progress in one transaction (with the fence
    /// check when there is one); `false` when the unique key already had the invoice.
    async fn write(&self, p: PartitionId, pen: &Pen, customer: u32, token: u64) -> Result<bool, FenceError> {
        let on_conflict = if self.run.layers.unique_key {
            "ON CONFLICT (customer_id, billing_period) DO NOTHING"
        } else {
            ""
        };
        let amount = 1_000 + i64::from(customer % 97) * 13;
        let invoice = format!(
            "INSERT INTO invoices (customer_id, billing_period, amount_cents, worker, token)
             VALUES ({customer}, '{PERIOD}', {amount}, '{}', {token}) {on_conflict}",
            self.name
        );
        let progress = format!(
            "INSERT INTO billing_progress (partition, last_customer) VALUES ({}, {customer})
             ON CONFLICT (partition) DO UPDATE SET last_customer = EXCLUDED.last_customer",
            p.0
        );
        match pen {
            Pen::Fenced(fenced) => {
                fenced
                    .transaction(move |tx| {
                        Box::pin(async move {
                            let rows = tx.execute(&invoice, &[]).await.map_err(pg_error)?;
                            tx.execute(&progress, &[]).await.map_err(pg_error)?;
                            Ok(rows == 1)
                        })
                    })
                    .await
            }
            // One message, sent as it is called: invoice and progress commit together.
            Pen::Unfenced => {
                let replies = self
                    .ledger
                    .plain
                    .simple_query(&format!("BEGIN; {invoice}; {progress}; COMMIT"))
                    .await
                    .map_err(pg_error)?;
                // BEGIN completes first (no rows); the invoice's count comes next.
                let counts: Vec<u64> = replies
                    .iter()
                    .filter_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::CommandComplete(rows) => Some(*rows),
                        _ => None,
                    })
                    .collect();
                Ok(counts.get(1) == Some(&1))
            }
        }
    }
}

fn pg_error(e: tokio_postgres::Error) -> FenceError {
    match e.as_db_error() {
        Some(db) => FenceError::Backend(format!("{}: {}", db.code().code(), db.message())),
        None => FenceError::Backend(e.to_string()),
    }
}

/// The example's own schema, one per process so concurrent runs cannot disturb each other.
fn schema() -> String {
    format!("tenure_invoices_{}", std::process::id())
}

async fn pg_connect(config: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to PostgreSQL with {config:?}"))?;
    tokio::spawn(connection);
    Ok(client)
}

/// Creates the example's schema afresh and returns a connection string that works inside it.
async fn pg_prepare(config: &str, layers: Layers) -> Result<String> {
    let schema = schema();
    let unique = if layers.unique_key { ", UNIQUE (customer_id, billing_period)" } else { "" };
    pg_connect(config)
        .await?
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE;
             CREATE SCHEMA {schema};
             CREATE TABLE {schema}.invoices (
                 id             bigserial PRIMARY KEY,
                 customer_id    integer NOT NULL,
                 billing_period text    NOT NULL,
                 amount_cents   bigint  NOT NULL,
                 worker         text    NOT NULL,
                 token          bigint  NOT NULL{unique}
             );
             CREATE TABLE {schema}.billing_progress (
                 partition     integer PRIMARY KEY,
                 last_customer integer NOT NULL
             );"
        ))
        .await?;
    let database = format!("{config} options='-c search_path={schema}'");
    // The fence's own table, made once here rather than by three billers at the same moment.
    PostgresFence::connect(&database).await?;
    Ok(database)
}

/// (invoices written, distinct customers invoiced for the month).
async fn tally(client: &tokio_postgres::Client) -> Result<(u64, u64)> {
    let row = client
        .query_one("SELECT count(*), count(DISTINCT (customer_id, billing_period)) FROM invoices", &[])
        .await?;
    Ok((row.get::<_, i64>(0) as u64, row.get::<_, i64>(1) as u64))
}

/// Starts a biller on a thread and runtime of its own; it runs until `shutdown` fires, then
/// waits for the billing jobs it handed off and for its plain connection to carry out what it was given.
fn start_biller(
    name: String,
    config: WorkerConfig,
    run: Arc<Run>,
    freezes: bool,
    shutdown: CancellationToken,
) -> std::thread::JoinHandle<Result<()>> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async move {
            let ledger = Ledger {
                fence: Arc::new(PostgresFence::connect(&run.database).await?),
                plain: pg_connect(&run.database).await?,
            };
            let biller = Arc::new(Biller {
                name,
                freezes: AtomicBool::new(freezes),
                ledger,
                run,
                turn: tokio::sync::Semaphore::new(1),
                jobs: Default::default(),
            });
            let handler = {
                let biller = biller.clone();
                move |assignment| biller.clone().partition(assignment)
            };
            Runner::new(config)
                .rejoin_backoff(Duration::from_millis(50), Duration::from_millis(500))
                .run(handler, shutdown.cancelled_owned())
                .await?;
            let jobs = std::mem::take(&mut *biller.jobs.lock().expect("jobs poisoned"));
            for job in jobs {
                let _ = job.await;
            }
            // A write handed to the plain connection just before its task was aborted is still
            // on its way; answers on one connection come in order, so once this one is back,
            // every earlier statement has reached the database. Without it the runtime could
            // end first and take that write with it, which is a race, not a protection.
            biller.ledger.plain.simple_query("SELECT 1").await?;
            Ok(())
        })
    })
}

/// Waits until three sessions own four partitions each, none moving; a biller that ended
/// before then says why.
async fn settled(
    cluster: &LocalCluster,
    billers: &mut Vec<std::thread::JoinHandle<Result<()>>>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(ended) = billers.iter().position(|b| b.is_finished()) {
            let result = billers.remove(ended).join().map_err(|_| anyhow::anyhow!("a biller panicked"))?;
            return result
                .context("a biller stopped before the month began")
                .and(Err(anyhow::anyhow!("a biller stopped")));
        }
        if let Ok(status) = cluster.status().await {
            let mut owned: BTreeMap<u64, u32> = BTreeMap::new();
            for row in status.partitions.iter().filter(|r| r.owner != 0 && !r.revoking) {
                *owned.entry(row.owner).or_default() += 1;
            }
            if owned.len() == 3 && owned.values().all(|n| *n == PARTITIONS / 3) {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("the assignment did not settle");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Outcome {
    layers: Layers,
    invoices: u64,
    customers_billed: u64,
    run: Arc<Run>,
}

async fn run(layers: Layers, postgres: &str) -> Result<Outcome> {
    println!(
        "== lease checks {}, fencing {}, unique key {}",
        on_off(layers.lease_checks),
        on_off(layers.fencing),
        on_off(layers.unique_key)
    );
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(3, dir.path(), |c| {
        c.partition_count = PARTITIONS;
        c.lease_ttl = TTL;
        c.election_timeout = Duration::from_millis(300);
        c.raft_heartbeat_interval = Duration::from_millis(50);
    })
    .await?;
    cluster.wait_for_leader(Duration::from_secs(10)).await.context("no leader")?;

    let keyspace = KeySpace::new(PARTITIONS)?;
    let mut customers: BTreeMap<PartitionId, Vec<u32>> =
        (0..PARTITIONS).map(|p| (PartitionId(p), Vec::new())).collect();
    for c in 0..CUSTOMERS {
        let p = keyspace.partition_of_key(format!("customer-{c}").as_bytes());
        customers.get_mut(&p).expect("partition in range").push(c);
    }
    let run = Arc::new(Run {
        start: Instant::now(),
        layers,
        customers,
        month_begins: CancellationToken::new(),
        counts: Counts::default(),
        database: pg_prepare(postgres, layers).await?,
    });
    let shutdown = CancellationToken::new();
    let mut billers: Vec<_> = (1..=3)
        .map(|i| {
            let name = format!("w{i}");
            let config = cluster.worker_config(&name);
            start_biller(name, config, run.clone(), i == 2, shutdown.clone())
        })
        .collect();
    settled(&cluster, &mut billers).await?;
    run.say("the month's billing starts".into());
    run.month_begins.cancel();

    // The month is done when every customer has an invoice; then the billers stop.
    let ledger = pg_connect(&run.database).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, billed) = tally(&ledger).await?;
        if billed == u64::from(CUSTOMERS) {
            break;
        }
        if Instant::now() > deadline {
            bail!("only {billed} of {CUSTOMERS} customers were billed");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    for biller in billers {
        tokio::task::spawn_blocking(move || biller.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a biller panicked"))??;
    }
    let (invoices, customers_billed) = tally(&ledger).await?;
    println!(
        "  {invoices} invoices for {customers_billed} customers: {} duplicates\n",
        invoices - customers_billed
    );
    cluster.shutdown().await;
    Ok(Outcome { layers, invoices, customers_billed, run })
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let postgres = match args.as_slice() {
        [] => "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".to_string(),
        [flag, config] if flag == "--postgres" => config.clone(),
        _ => bail!("usage: invoices [--postgres <libpq connection string>]"),
    };
    println!(
        "{CUSTOMERS} customers in {PARTITIONS} partitions, 3 billers on the runner, lease TTL {} ms, one frozen for {} ms; store: PostgreSQL\n",
        TTL.as_millis(),
        PAUSE.as_millis(),
    );
    let mut outcomes = Vec::new();
    let mut failed = None;
    for bits in 0..8u8 {
        let layers =
            Layers { lease_checks: bits & 1 != 0, fencing: bits & 2 != 0, unique_key: bits & 4 != 0 };
        // Every run is bounded: a run that cannot finish (say, its worker never froze) fails.
        let bounded = tokio::time::timeout(Duration::from_secs(120), run(layers, &postgres));
        match bounded.await.unwrap_or_else(|_| Err(anyhow::anyhow!("the run did not finish within 120 s"))) {
            Ok(outcome) => outcomes.push(outcome),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    pg_connect(&postgres)
        .await?
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", schema()))
        .await?;
    if let Some(e) = failed {
        return Err(e);
    }

    println!(
        "lease checks  fencing  unique key | invoices  duplicates | refused: by fence  by unique key | stopped: by lease check  by runner"
    );
    for o in &outcomes {
        let c = &o.run.counts;
        println!(
            "{:<12}  {:<7}  {:<10} | {:>8}  {:>10} | {:>17}  {:>13} | {:>22}  {:>9}",
            on_off(o.layers.lease_checks),
            on_off(o.layers.fencing),
            on_off(o.layers.unique_key),
            o.invoices,
            o.invoices - o.customers_billed,
            c.refused_by_fence.load(Ordering::SeqCst),
            c.refused_by_unique_key.load(Ordering::SeqCst),
            c.stopped_by_lease_check.load(Ordering::SeqCst),
            c.aborted_by_runner.load(Ordering::SeqCst),
        );
    }
    let duplicates = |o: &Outcome| o.invoices - o.customers_billed;
    if duplicates(&outcomes[0]) == 0 {
        bail!("the unprotected run produced no duplicates: the pause did not overlap the takeover");
    }
    if duplicates(&outcomes[7]) != 0 {
        bail!("with all three layers there were {} duplicates", duplicates(&outcomes[7]));
    }
    println!(
        "\nplain lock with a TTL shorter than the job: {} duplicates; all three layers: 0",
        duplicates(&outcomes[0])
    );
    Ok(())
}
