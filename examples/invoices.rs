//! The billing exercise: three workers share the customers by partition and write this month's
//! invoices. One of them freezes (a stop-the-world pause) in the middle of the run, between
//! deciding to bill a customer and writing the invoice, for three times the lease TTL. Its
//! partitions are granted to the others, which resume from the durable progress and finish the
//! month. Then it wakes up and carries on.
//!
//! Three layers of protection, each switchable, and the run is repeated for all eight settings:
//! - lease checks: before each invoice the job asks the worker library whether its lease is still
//!   valid (the library renews it with heartbeats on its own task and judges it by its local
//!   deadline) and stops when it is not. Off, the job trusts the lock it was granted at the start
//!   for the whole job, like a plain lock with a TTL shorter than the job.
//! - fencing: every write carries the partition's fencing token and the store refuses a token
//!   lower than the highest it has seen; a new owner raises the fence before it reads where to
//!   resume (fence-before-resume).
//! - unique key: `UNIQUE (customer_id, billing_period)`, so a second invoice for the same month
//!   is refused whoever writes it.
//!
//! It prints, per setting, how many invoices were written and how many of them are duplicates.
//! Lease checks alone leave the one invoice that was in flight during the pause; fencing or the
//! unique key alone already close the gap; all three give zero.
//!
//! The fenced writes go through `Fenced`, the value `PartitionHandle::acquire` returns once the
//! fence is raised: the invoice, the progress and the fence check are one PostgreSQL transaction.
//!
//! Run: `cargo run --example invoices` (against the server `scripts/setup` starts; `--postgres
//! CONNINFO` names another). The example works in a schema of its own, `tenure_invoices_<pid>`,
//! made afresh for every run and dropped at the end.

use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tenure::fence::{FenceError, PostgresFence};
use tenure::ids::{FencingToken, PartitionId};
use tenure::keyspace::KeySpace;
use tenure::local_cluster::LocalCluster;
use tenure::worker::{Events, Fenced, PartitionHandle, Worker, WorkerConfig, WorkerEvent};

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Billed {
    Inserted,
    /// The unique key already had this customer's invoice for the month.
    AlreadyBilled,
}

/// Where invoices go: a fenced store for the owners that fence, and a plain connection to the
/// same database for those that do not (and for the tally).
struct Ledger {
    fence: Arc<PostgresFence>,
    plain: tokio::sync::Mutex<tokio_postgres::Client>,
}

fn pg_error(e: tokio_postgres::Error) -> FenceError {
    match e.as_db_error() {
        Some(db) => FenceError::Backend(format!("{}: {}", db.code().code(), db.message())),
        None => FenceError::Backend(e.to_string()),
    }
}

impl Ledger {
    /// Where a new owner resumes: the last customer billed in the partition; under the fence
    /// when there is one, so no older owner can move it afterwards.
    async fn resume(&self, p: PartitionId, pen: &Pen) -> Result<Option<u32>, FenceError> {
        match pen {
            Pen::Fenced(fenced) => fenced.transaction(|tx| Box::pin(pg_progress(tx, p))).await,
            Pen::Unfenced => {
                let mut client = self.plain.lock().await;
                let tx = client.transaction().await.map_err(pg_error)?;
                pg_progress(&tx, p).await
            }
        }
    }

    /// Writes one invoice and the partition's progress in one transaction (with the fence check
    /// when there is one).
    async fn bill(
        &self,
        p: PartitionId,
        pen: &Pen,
        invoice: Invoice,
        layers: Layers,
    ) -> Result<Billed, FenceError> {
        match pen {
            Pen::Fenced(fenced) => {
                fenced.transaction(move |tx| Box::pin(pg_bill(tx, p, invoice, layers))).await
            }
            Pen::Unfenced => {
                let mut client = self.plain.lock().await;
                let tx = client.transaction().await.map_err(pg_error)?;
                let billed = pg_bill(&tx, p, invoice, layers).await?;
                tx.commit().await.map_err(pg_error)?;
                Ok(billed)
            }
        }
    }

    /// (invoices written, distinct customers invoiced for the month).
    async fn tally(&self) -> Result<(u64, u64)> {
        let row = self
            .plain
            .lock()
            .await
            .query_one("SELECT count(*), count(DISTINCT (customer_id, billing_period)) FROM invoices", &[])
            .await?;
        Ok((row.get::<_, i64>(0) as u64, row.get::<_, i64>(1) as u64))
    }
}

/// How an owner writes: through the value that raising the fence returned, or, with fencing
/// off, with nothing but its belief.
enum Pen {
    Fenced(Fenced<Arc<PostgresFence>>),
    Unfenced,
}

#[derive(Clone, Debug)]
struct Invoice {
    customer: u32,
    amount_cents: i64,
    worker: String,
    token: FencingToken,
}

async fn pg_progress(
    tx: &tokio_postgres::Transaction<'_>,
    p: PartitionId,
) -> Result<Option<u32>, FenceError> {
    let row = tx
        .query_opt("SELECT last_customer FROM billing_progress WHERE partition = $1", &[&(p.0 as i32)])
        .await
        .map_err(pg_error)?;
    Ok(row.map(|r| r.get::<_, i32>(0) as u32))
}

async fn pg_bill(
    tx: &tokio_postgres::Transaction<'_>,
    p: PartitionId,
    invoice: Invoice,
    layers: Layers,
) -> Result<Billed, FenceError> {
    let insert = if layers.unique_key {
        "INSERT INTO invoices (customer_id, billing_period, amount_cents, worker, token)
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (customer_id, billing_period) DO NOTHING"
    } else {
        "INSERT INTO invoices (customer_id, billing_period, amount_cents, worker, token)
         VALUES ($1, $2, $3, $4, $5)"
    };
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
        &(invoice.customer as i32),
        &PERIOD,
        &invoice.amount_cents,
        &invoice.worker,
        &(invoice.token.0 as i64),
    ];
    let rows = tx.execute(insert, &params).await.map_err(pg_error)?;
    tx.execute(
        "INSERT INTO billing_progress (partition, last_customer) VALUES ($1, $2)
         ON CONFLICT (partition) DO UPDATE SET last_customer = EXCLUDED.last_customer",
        &[&(p.0 as i32), &(invoice.customer as i32)],
    )
    .await
    .map_err(pg_error)?;
    Ok(if rows == 1 { Billed::Inserted } else { Billed::AlreadyBilled })
}

/// The example's own schema, one per process so concurrent runs cannot disturb each other.
fn schema() -> String {
    format!("tenure_invoices_{}", std::process::id())
}

async fn pg_drop_schema(config: &str) -> Result<()> {
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", schema())).await?;
    Ok(())
}

/// Creates the example's schema afresh and returns a connection string that works inside it.
async fn pg_prepare(config: &str, layers: Layers) -> Result<String> {
    let schema = schema();
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to PostgreSQL with {config:?}"))?;
    tokio::spawn(connection);
    let unique = if layers.unique_key { ", UNIQUE (customer_id, billing_period)" } else { "" };
    client
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
    Ok(format!("{config} options='-c search_path={schema}'"))
}

async fn pg_ledger(config: &str) -> Result<Ledger> {
    let fence = PostgresFence::connect(config).await?;
    let (plain, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(Ledger { fence: Arc::new(fence), plain: tokio::sync::Mutex::new(plain) })
}

/// What one worker did, counted.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    inserted: u64,
    refused_by_unique_key: u64,
    refused_by_fence: u64,
    stopped_by_lease_check: u64,
}

struct Run {
    start: Instant,
    layers: Layers,
    customers: BTreeMap<PartitionId, Vec<u32>>,
}

impl Run {
    fn say(&self, line: String) {
        println!("  t={:5.2}s {line}", self.start.elapsed().as_secs_f64());
    }
}

/// A billing worker: takes the partitions it is assigned in order and bills their customers.
struct Biller {
    name: String,
    /// `None` once the worker froze: its heartbeats stopped with it.
    worker: Option<Worker>,
    events: Events,
    /// How to join again if the coordinator ends the session (say, the machine stalled for
    /// longer than the TTL), as any long-running application must.
    config: WorkerConfig,
    /// Partitions assigned and not yet lost or released.
    held: Arc<AtomicU64>,
    ledger: Ledger,
    freezes: bool,
    counts: Counts,
}

impl Biller {
    /// Follows the worker's events from the moment it joined; bills only once `start` fires, so
    /// the month begins on a settled assignment.
    async fn run(
        mut self,
        run: Arc<Run>,
        start: CancellationToken,
        stop: CancellationToken,
    ) -> Result<Counts> {
        let mut queue: VecDeque<PartitionHandle> = VecDeque::new();
        loop {
            while let Some(event) = self.events.try_recv() {
                self.on_event(event, &mut queue).await;
            }
            if start.is_cancelled() {
                if let Some(handle) = queue.pop_front() {
                    self.bill_partition(&run, handle).await?;
                    continue;
                }
            }
            tokio::select! {
                event = self.events.recv() => match event {
                    Some(event) => self.on_event(event, &mut queue).await,
                    None => break, // a frozen worker hears nothing more
                },
                _ = start.cancelled(), if !start.is_cancelled() => {}
                _ = stop.cancelled() => break,
            }
        }
        if let Some(worker) = self.worker.take() {
            worker.leave().await?;
        }
        Ok(self.counts)
    }

    async fn on_event(&mut self, event: WorkerEvent, queue: &mut VecDeque<PartitionHandle>) {
        match event {
            WorkerEvent::Granted(handle) => {
                self.held.fetch_add(1, Ordering::SeqCst);
                queue.push_back(handle)
            }
            WorkerEvent::Revoking { partition, .. } => {
                queue.retain(|h| h.partition() != partition);
                if let Some(worker) = &self.worker {
                    // Not started yet, nothing to checkpoint. If the release fails the lease
                    // runs out instead, which only delays the move.
                    if let Err(e) = worker.release(&[partition]).await {
                        eprintln!("{} could not release {partition}: {e}", self.name);
                    }
                }
            }
            WorkerEvent::Lost { partition, .. } | WorkerEvent::Released { partition, .. } => {
                self.held.fetch_sub(1, Ordering::SeqCst);
                queue.retain(|h| h.partition() != partition)
            }
            WorkerEvent::SessionEnded { reason } => {
                // A frozen worker has already dropped its session and hears nothing more; a
                // live one whose session the coordinator ended joins again under its name.
                if self.worker.take().is_some() {
                    eprintln!("{}'s session ended ({reason}); joining again", self.name);
                    self.rejoin().await;
                }
            }
        }
    }

    /// Joins again after the coordinator ended the session; the partitions come back through
    /// the new session's events. Bounded: a worker that cannot join for a minute gives up.
    async fn rejoin(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            match Worker::join(self.config.clone()).await {
                Ok(mut worker) => {
                    self.events = worker.events().expect("events taken once");
                    self.worker = Some(worker);
                    return;
                }
                Err(e) => {
                    eprintln!("{} could not join again: {e}", self.name);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    async fn bill_partition(&mut self, run: &Run, handle: PartitionHandle) -> Result<()> {
        let (p, token, layers) = (handle.partition(), handle.token(), run.layers);
        if layers.lease_checks && !handle.is_valid() {
            self.counts.stopped_by_lease_check += 1;
            run.say(format!("{} skips {p}: its lease is no longer valid", self.name));
            return Ok(());
        }
        // Fence before resume: raising the fence is what makes the value that writes.
        let pen = match layers.fencing {
            true => handle.acquire(self.ledger.fence.clone()).await.map(Pen::Fenced),
            false => Ok(Pen::Unfenced),
        };
        let resume = match pen {
            Ok(pen) => self.ledger.resume(p, &pen).await.map(|resume| (pen, resume)),
            Err(e) => Err(e),
        };
        let (pen, resume) = match resume {
            Ok(resumed) => resumed,
            Err(FenceError::Stale { highest, .. }) => {
                self.counts.refused_by_fence += 1;
                run.say(format!("{} REJECT resume of {p} token={token} (highest seen {highest})", self.name));
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        let todo: Vec<u32> =
            run.customers[&p].iter().copied().filter(|c| resume.is_none_or(|last| *c > last)).collect();
        if todo.is_empty() {
            return Ok(());
        }
        run.say(format!("{} bills {p} token={token}: {} customers to go", self.name, todo.len()));
        for (done, customer) in todo.into_iter().enumerate() {
            if layers.lease_checks && !handle.is_valid() {
                self.counts.stopped_by_lease_check += 1;
                run.say(format!("{} stops {p}: its lease is no longer valid", self.name));
                return Ok(());
            }
            tokio::time::sleep(WORK_PER_INVOICE).await; // computing the invoice
            if self.freezes && done == PAUSE_AFTER {
                self.freeze(run, customer).await;
            }
            let invoice = Invoice {
                customer,
                amount_cents: 1_000 + i64::from(customer % 97) * 13,
                worker: self.name.clone(),
                token,
            };
            match self.ledger.bill(p, &pen, invoice, layers).await {
                Ok(Billed::Inserted) => self.counts.inserted += 1,
                Ok(Billed::AlreadyBilled) => self.counts.refused_by_unique_key += 1,
                Err(FenceError::Stale { highest, .. }) => {
                    self.counts.refused_by_fence += 1;
                    run.say(format!(
                        "{} REJECT invoice of customer {customer} in {p} token={token} (highest seen {highest})",
                        self.name
                    ));
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// A stop-the-world pause between deciding to bill `customer` and writing the invoice: the
    /// heartbeats stop too, so the coordinator expires the session after the TTL.
    async fn freeze(&mut self, run: &Run, customer: u32) {
        self.freezes = false;
        if let Some(worker) = self.worker.take() {
            worker.abandon();
        }
        run.say(format!(
            "{} freezes for {:.1}s just before writing customer {customer}'s invoice",
            self.name,
            PAUSE.as_secs_f64()
        ));
        tokio::time::sleep(PAUSE).await;
        run.say(format!("{} wakes up and carries on", self.name));
    }
}

/// Waits until every worker owns its share, so the month starts on a settled assignment.
async fn settled(held: &[Arc<AtomicU64>]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let counts: Vec<u64> = held.iter().map(|n| n.load(Ordering::SeqCst)).collect();
        if counts.iter().all(|n| *n == u64::from(PARTITIONS) / held.len() as u64) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("assignment did not settle: {counts:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Outcome {
    layers: Layers,
    invoices: u64,
    customers_billed: u64,
    counts: Counts,
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

    let database = pg_prepare(postgres, layers).await?;

    let run = Arc::new(Run { start: Instant::now(), layers, customers });
    let (start, stop) = (CancellationToken::new(), CancellationToken::new());
    let mut tasks = Vec::new();
    let mut owned = Vec::new();
    for i in 0..3 {
        let name = format!("w{}", i + 1);
        let config = cluster.worker_config(&name);
        let mut worker = Worker::join(config.clone()).await?;
        let biller = Biller {
            name,
            events: worker.events().expect("events taken once"),
            config,
            held: Arc::new(AtomicU64::new(0)),
            worker: Some(worker),
            ledger: pg_ledger(&database).await?,
            freezes: i == 1,
            counts: Counts::default(),
        };
        owned.push(biller.held.clone());
        tasks.push(tokio::spawn(biller.run(run.clone(), start.clone(), stop.clone())));
    }
    settled(&owned).await?;
    run.say("the month's billing starts".into());
    start.cancel();
    let frozen = tasks.remove(1);
    let mut counts = frozen.await??;

    // The month is done when every customer has an invoice; then the others stop.
    let tally = pg_ledger(&database).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, billed) = tally.tally().await?;
        if billed == u64::from(CUSTOMERS) {
            break;
        }
        if Instant::now() > deadline {
            bail!("only {billed} of {CUSTOMERS} customers were billed");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    for task in tasks {
        let c = task.await??;
        counts.inserted += c.inserted;
        counts.refused_by_fence += c.refused_by_fence;
        counts.refused_by_unique_key += c.refused_by_unique_key;
        counts.stopped_by_lease_check += c.stopped_by_lease_check;
    }
    let (invoices, customers_billed) = tally.tally().await?;
    println!(
        "  {invoices} invoices for {customers_billed} customers: {} duplicates\n",
        invoices - customers_billed
    );
    cluster.shutdown().await;
    Ok(Outcome { layers, invoices, customers_billed, counts })
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
        "{CUSTOMERS} customers in {PARTITIONS} partitions, 3 workers, lease TTL {} ms, one worker frozen for {} ms; store: PostgreSQL\n",
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
    pg_drop_schema(&postgres).await?;
    if let Some(e) = failed {
        return Err(e);
    }

    println!("lease checks  fencing  unique key | invoices  duplicates | refused: by fence  by unique key | stopped by lease check");
    for o in &outcomes {
        println!(
            "{:<12}  {:<7}  {:<10} | {:>8}  {:>10} | {:>17}  {:>13} | {:>22}",
            on_off(o.layers.lease_checks),
            on_off(o.layers.fencing),
            on_off(o.layers.unique_key),
            o.invoices,
            o.invoices - o.customers_billed,
            o.counts.refused_by_fence,
            o.counts.refused_by_unique_key,
            o.counts.stopped_by_lease_check,
        );
    }
    let duplicates = |o: &Outcome| o.invoices - o.customers_billed;
    let none = &outcomes[0];
    let all = &outcomes[7];
    if duplicates(none) == 0 {
        bail!("the unprotected run produced no duplicates: the pause did not overlap the takeover");
    }
    if duplicates(all) != 0 {
        bail!("with all three layers there were {} duplicates", duplicates(all));
    }
    println!(
        "\nplain lock with a TTL shorter than the job: {} duplicates; all three layers: 0",
        duplicates(none)
    );
    Ok(())
}
