//! The same rebalance workload on the etcd design, beside tenure's.

use super::*;

/// How long after `start` each partition taken since then was taken (by `who`, if given).
pub(crate) fn taken_since(acquired: &etcd::Acquired, start: Instant, who: Option<&str>) -> Sample {
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

/// The etcd design on the same workload: join 4 -> 5 and leave 5 -> 4 at `partitions`.
pub(crate) async fn etcd_join_and_leave(
    table: &mut Table,
    etcd: &etcd::EtcdCluster,
    partitions: u32,
) -> Result<(Sample, Sample)> {
    let acquired: etcd::Acquired = Default::default();
    let eps = &etcd.endpoints;
    let patience = Duration::from_secs(600);
    let mut workers = Vec::new();
    for n in 1..=4 {
        workers.push(etcd::EtcdWorker::join(eps, &format!("w{n}"), 5, partitions, acquired.clone()).await?);
    }
    etcd::settle(eps, partitions, &["w1", "w2", "w3", "w4"], patience).await?;
    let start = Instant::now();
    workers.push(etcd::EtcdWorker::join(eps, "w5", 5, partitions, acquired.clone()).await?);
    etcd::settle(eps, partitions, &["w1", "w2", "w3", "w4", "w5"], patience).await?;
    let join = taken_since(&acquired, start, Some("w5"));
    table.figure(format!("etcd P={partitions} join 4->5: partitions moved"), join.0.len().to_string());
    table.latency(
        format!("etcd P={partitions} join 4->5: move, join -> new owner holds the key p99"),
        join.pct(0.99),
    );
    table.latency(format!("etcd P={partitions} join 4->5: every moved partition owned"), join.max());

    let start = Instant::now();
    workers.pop().context("w5")?.leave().await?;
    etcd::settle(eps, partitions, &["w1", "w2", "w3", "w4"], patience).await?;
    let leave = taken_since(&acquired, start, None);
    table.figure(format!("etcd P={partitions} leave 5->4: partitions moved"), leave.0.len().to_string());
    table.latency(format!("etcd P={partitions} leave 5->4: every moved partition owned"), leave.max());
    for w in workers {
        w.leave().await?;
    }
    Ok((join, leave))
}

/// The etcd design when a worker dies: its lease must run out first.
pub(crate) async fn etcd_crash(table: &mut Table, etcd: &etcd::EtcdCluster, ttl_s: i64) -> Result<Sample> {
    let partitions = 256;
    let acquired: etcd::Acquired = Default::default();
    let eps = &etcd.endpoints;
    let mut workers = Vec::new();
    for n in 1..=4 {
        workers
            .push(etcd::EtcdWorker::join(eps, &format!("w{n}"), ttl_s, partitions, acquired.clone()).await?);
    }
    etcd::settle(eps, partitions, &["w1", "w2", "w3", "w4"], Duration::from_secs(120)).await?;
    let victim = workers.pop().context("w4")?;
    let granted = victim.granted_ttl;
    // At a random point of its keep-alive period (a third of the granted TTL), as for tenure.
    tokio::time::sleep(Duration::from_secs(granted as u64).mul_f64(rand::random_range(0.0..1.0) / 3.0)).await;
    let start = Instant::now();
    victim.crash();
    etcd::settle(eps, partitions, &["w1", "w2", "w3"], Duration::from_secs(120)).await?;
    let crash = taken_since(&acquired, start, None);
    let label = format!("etcd crash at lease TTL {ttl_s} s (granted {granted} s)");
    table.latency(format!("{label}: owned again p99"), crash.pct(0.99));
    table.latency(format!("{label}: owned again, last partition"), crash.max());
    for w in workers {
        w.leave().await?;
    }
    // The dead worker's lease is gone by now; nothing of it is left to clean.
    Ok(crash)
}
