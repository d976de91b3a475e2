//! The same rebalance workloads on the baselines (etcd, PostgreSQL), beside tenure's: one
//! driver for both, so they see exactly the same steps.

use super::*;

/// When each partition was taken, by whom, under which token.
pub(crate) type Acquired = Arc<Mutex<HashMap<u32, (String, Instant, i64)>>>;

/// A design a user could build instead of tenure.
pub(crate) trait Baseline {
    type Worker: BaselineWorker;
    /// How the table names it.
    const NAME: &'static str;
    async fn join(
        &self,
        name: &str,
        ttl: Duration,
        partitions: u32,
        acquired: Acquired,
    ) -> Result<Self::Worker>;
    /// The owner of every partition, by worker name.
    async fn owners(&self, partitions: u32) -> Result<Vec<Option<String>>>;

    /// Waits until every partition is owned by one of `names` and balanced within one.
    async fn settle(&self, partitions: u32, names: &[&str], patience: Duration) -> Result<()> {
        let until = Instant::now() + patience;
        loop {
            let table = self.owners(partitions).await?;
            let mut counts: HashMap<&str, usize> = names.iter().map(|n| (*n, 0)).collect();
            let mut complete = true;
            for owner in &table {
                match owner.as_deref().and_then(|o| counts.get_mut(o)) {
                    Some(c) => *c += 1,
                    None => complete = false,
                }
            }
            let (min, max) =
                (counts.values().min().copied().unwrap_or(0), counts.values().max().copied().unwrap_or(0));
            if complete && max - min <= 1 {
                return Ok(());
            }
            if Instant::now() > until {
                bail!("{} baseline did not settle: complete={complete}, counts {counts:?}", Self::NAME);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub(crate) trait BaselineWorker {
    /// Stops as a crash would: no renewals, no cleanup.
    fn crash(self);
    async fn leave(self) -> Result<()>;
    /// The lease the worker holds, as the store granted it.
    fn granted_ttl(&self) -> Duration;
    /// How often the worker renews.
    fn renewal_period(&self) -> Duration;
}

impl Baseline for etcd::EtcdCluster {
    type Worker = etcd::EtcdWorker;
    const NAME: &'static str = "etcd";
    async fn join(
        &self,
        name: &str,
        ttl: Duration,
        partitions: u32,
        acquired: Acquired,
    ) -> Result<etcd::EtcdWorker> {
        etcd::EtcdWorker::join(&self.endpoints, name, ttl.as_secs().max(1) as i64, partitions, acquired).await
    }
    async fn owners(&self, partitions: u32) -> Result<Vec<Option<String>>> {
        etcd::owners(&self.endpoints, partitions).await
    }
}

impl BaselineWorker for etcd::EtcdWorker {
    fn crash(self) {
        etcd::EtcdWorker::crash(self)
    }
    async fn leave(self) -> Result<()> {
        etcd::EtcdWorker::leave(self).await
    }
    fn granted_ttl(&self) -> Duration {
        Duration::from_secs(self.granted_ttl as u64)
    }
    fn renewal_period(&self) -> Duration {
        self.granted_ttl() / 3
    }
}

impl Baseline for postgres::Postgres {
    type Worker = postgres::PgWorker;
    const NAME: &'static str = "PostgreSQL";
    async fn join(
        &self,
        name: &str,
        ttl: Duration,
        partitions: u32,
        acquired: Acquired,
    ) -> Result<postgres::PgWorker> {
        postgres::PgWorker::join(self, name, ttl, partitions, acquired).await
    }
    async fn owners(&self, partitions: u32) -> Result<Vec<Option<String>>> {
        postgres::current_owners(self, partitions).await
    }
}

impl BaselineWorker for postgres::PgWorker {
    fn crash(self) {
        postgres::PgWorker::crash(self)
    }
    async fn leave(self) -> Result<()> {
        postgres::PgWorker::leave(self).await
    }
    fn granted_ttl(&self) -> Duration {
        self.ttl
    }
    fn renewal_period(&self) -> Duration {
        self.ttl / 4
    }
}

/// How long after `start` each partition taken since then was taken (by `who`, if given).
pub(crate) fn taken_since(acquired: &Acquired, start: Instant, who: Option<&str>) -> Sample {
    Sample::new(
        acquired
            .lock()
            .unwrap()
            .values()
            .filter(|(by, t, _)| *t >= start && who.is_none_or(|w| w == by))
            .map(|(_, t, _)| t.saturating_duration_since(start))
            .collect(),
    )
}

/// A baseline on the same workload: join 4 -> 5 and leave 5 -> 4 at `partitions`.
pub(crate) async fn baseline_join_and_leave<B: Baseline>(
    table: &mut Table,
    baseline: &B,
    partitions: u32,
) -> Result<(Sample, Sample)> {
    let acquired: Acquired = Default::default();
    let name = B::NAME;
    let (ttl, patience) = (Duration::from_secs(5), Duration::from_secs(600));
    let mut workers = Vec::new();
    for n in 1..=4 {
        workers.push(baseline.join(&format!("w{n}"), ttl, partitions, acquired.clone()).await?);
    }
    baseline.settle(partitions, &["w1", "w2", "w3", "w4"], patience).await?;
    let start = Instant::now();
    workers.push(baseline.join("w5", ttl, partitions, acquired.clone()).await?);
    baseline.settle(partitions, &["w1", "w2", "w3", "w4", "w5"], patience).await?;
    let join = taken_since(&acquired, start, Some("w5"));
    table.figure(format!("{name} P={partitions} join 4->5: partitions moved"), join.0.len().to_string());
    table.latency(
        format!("{name} P={partitions} join 4->5: move, join -> new owner holds the key p99"),
        join.pct(0.99),
    );
    table.latency(format!("{name} P={partitions} join 4->5: every moved partition owned"), join.max());

    let start = Instant::now();
    workers.pop().context("w5")?.leave().await?;
    baseline.settle(partitions, &["w1", "w2", "w3", "w4"], patience).await?;
    let leave = taken_since(&acquired, start, None);
    table.figure(format!("{name} P={partitions} leave 5->4: partitions moved"), leave.0.len().to_string());
    table.latency(format!("{name} P={partitions} leave 5->4: every moved partition owned"), leave.max());
    for w in workers {
        w.leave().await?;
    }
    Ok((join, leave))
}

/// A baseline when a worker dies: its lease must run out first.
pub(crate) async fn baseline_crash<B: Baseline>(
    table: &mut Table,
    baseline: &B,
    ttl: Duration,
) -> Result<Sample> {
    let partitions = 256;
    let acquired: Acquired = Default::default();
    let name = B::NAME;
    let mut workers = Vec::new();
    for n in 1..=4 {
        workers.push(baseline.join(&format!("w{n}"), ttl, partitions, acquired.clone()).await?);
    }
    baseline.settle(partitions, &["w1", "w2", "w3", "w4"], Duration::from_secs(120)).await?;
    let victim = workers.pop().context("w4")?;
    let granted = victim.granted_ttl();
    // At a random point of its renewal period, as for tenure.
    tokio::time::sleep(victim.renewal_period().mul_f64(rand::random_range(0.0..1.0))).await;
    let start = Instant::now();
    victim.crash();
    baseline.settle(partitions, &["w1", "w2", "w3"], Duration::from_secs(120)).await?;
    let crash = taken_since(&acquired, start, None);
    let label =
        format!("{name} crash at lease TTL {} s (granted {} s)", ttl.as_secs_f64(), granted.as_secs_f64());
    table.latency(format!("{label}: owned again p99"), crash.pct(0.99));
    table.latency(format!("{label}: owned again, last partition"), crash.max());
    for w in workers {
        w.leave().await?;
    }
    Ok(crash)
}
