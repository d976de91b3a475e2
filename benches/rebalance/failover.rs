//! A coordinator leader fails under a worker at work: three `tenure serve` processes, one
//! worker (the library, over TLS) holding every partition, and the leader killed (SIGKILL) or
//! frozen (SIGSTOP) at a random point of the worker's renewal period. Measured: when the other
//! nodes name a new leader, and the lapse, the time during which the worker held no valid lease
//! on a partition it keeps (its local lease ran out before a renewal reached the new leader).
//! A lapse stops that partition's work; since every worker renews on the same leader, a lapse
//! here is a lapse everywhere at once.

use super::*;
use tenure::nemesis::{ProcessCluster, ServeSettings};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    Kill,
    Freeze,
}

/// The election timeout's lower bound on these nodes (openraft draws from it to twice it).
const ELECTION: Duration = Duration::from_millis(150);

/// What one failure cost.
struct Trial {
    elected: Duration,
    /// Time during which the worker believed fewer partitions than it keeps.
    lapse: Duration,
}

/// Samples, every millisecond for `window`, how long `held` said no; returns that total.
async fn lapse_within(held: impl Fn() -> bool, window: Duration) -> Duration {
    let (start, mut lapse, mut short_since) = (Instant::now(), Duration::ZERO, None::<Instant>);
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    while start.elapsed() < window {
        ticks.tick().await;
        let now = Instant::now();
        match (!held(), short_since) {
            (true, None) => short_since = Some(now),
            (false, Some(since)) => {
                lapse += now - since;
                short_since = None;
            }
            _ => {}
        }
    }
    lapse + short_since.map_or(Duration::ZERO, |since| since.elapsed())
}

pub(crate) async fn leader_failure(table: &mut Table, ttl: Duration, trials: usize) -> Result<()> {
    let partitions = 64;
    let dir = tempfile::tempdir()?;
    let settings = ServeSettings {
        binary: env!("CARGO_BIN_EXE_tenure").into(),
        partition_count: partitions,
        lease_ttl: ttl,
        election_timeout: ELECTION,
        snapshot_after_logs: 5000,
        insecure: false,
        status_pages: false,
    };
    let mut cluster = ProcessCluster::start(3, dir.path(), settings).await?;
    cluster.wait_for_leader(Duration::from_secs(20)).await.context("no leader")?;
    let mut worker = Worker::join(cluster.worker_config("steady")).await?;
    let mut events = worker.events().context("events taken")?;
    let drain = tokio::spawn(async move { while events.recv().await.is_some() {} });
    let all = partitions as usize;
    let until = Instant::now() + Duration::from_secs(30);
    while worker.owned().len() < all {
        if Instant::now() > until {
            bail!("the worker never held all {all} partitions");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut results: Vec<(Failure, Trial)> = Vec::new();
    for trial in 0..trials * 2 {
        let failure = if trial % 2 == 0 { Failure::Kill } else { Failure::Freeze };
        let leader = cluster.wait_for_leader(Duration::from_secs(20)).await.context("no leader")?;
        // Steady first: the worker holds everything and has renewed on this leader a few times.
        let steady = Instant::now() + Duration::from_secs(20);
        while worker.owned().len() < all {
            if Instant::now() > steady {
                bail!("trial {trial}: the worker did not get its partitions back");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(ttl).await;
        // At a random point of the worker's renewal period (a quarter TTL).
        tokio::time::sleep(ttl.mul_f64(rand::random_range(0.0..0.25))).await;
        let start = Instant::now();
        match failure {
            Failure::Kill => cluster.kill(leader).await,
            Failure::Freeze => cluster.signal_pause(leader, true),
        }
        // The lapse is watched for two TTLs: any local lease that ran out did so within one
        // TTL of the failure, and came back once a renewal reached the new leader.
        let lapse = lapse_within(|| worker.owned().len() == all, ttl * 2);
        let elected = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if cluster.leader_other_than(leader).await.is_some() {
                    return start.elapsed();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        let (lapse, elected) = tokio::join!(lapse, elected);
        let elected = elected.with_context(|| format!("trial {trial}: no new leader within 30 s"))?;
        results.push((failure, Trial { elected, lapse }));
        match failure {
            Failure::Kill => cluster.restart(leader)?,
            Failure::Freeze => cluster.signal_pause(leader, false),
        }
    }
    drain.abort();
    worker.abandon();
    cluster.shutdown().await;

    report(table, "", ttl, &results);
    Ok(())
}

/// One row pair per failure kind: when a new leader was named, and the lapses.
fn report(table: &mut Table, system: &str, ttl: Duration, results: &[(Failure, Trial)]) {
    let ttl_s = ttl.as_secs_f64();
    for failure in [Failure::Kill, Failure::Freeze] {
        let of = || results.iter().filter(move |(f, _)| *f == failure).map(|(_, t)| t);
        let what = match failure {
            Failure::Kill => "killed",
            Failure::Freeze => "frozen",
        };
        let elected = Sample::new(of().map(|t| t.elected).collect());
        let lapses = Sample::new(of().map(|t| t.lapse).collect());
        let label = format!("{system}leader {what} at TTL {ttl_s} s ({} trials)", lapses.0.len());
        table.latency(format!("{label}: new leader named p50"), elected.pct(0.5));
        table.latency(format!("{label}: new leader named max"), elected.max());
        table.figure(
            format!("{label}: trials with a lease lapse"),
            of().filter(|t| !t.lapse.is_zero()).count().to_string(),
        );
        table.latency(format!("{label}: longest lapse"), lapses.max());
    }
}

/// The same failures under a careful etcd user's worker: three etcd members with the same
/// heartbeat and election timeout as tenure's nodes above (etcd draws its timeout from one to
/// two times the flag, as openraft does), one lease of `ttl` kept alive every quarter TTL (as
/// tenure's worker renews), each keep-alive bounded by a quarter TTL and, on a failure or a
/// timeout, sent again at once through the next member (a frozen member keeps its TCP
/// connections open, so waiting on it would lose the lease). The worker believes its lease until
/// `sent + TTL - TTL / 5`, tenure's default margin, where `sent` is when the acknowledged
/// keep-alive left.
pub(crate) async fn etcd_leader_failure(table: &mut Table, ttl: Duration, trials: usize) -> Result<()> {
    use std::sync::{Arc, Mutex};
    let timing = etcd::Timing {
        heartbeat_ms: (ELECTION / 6).as_millis() as u64,
        election_ms: ELECTION.as_millis() as u64,
    };
    let mut cluster = etcd::EtcdCluster::start_with(timing).await?;
    let believed_until = Arc::new(Mutex::new(Instant::now()));
    let keeper = tokio::spawn(etcd_keep_alive(cluster.endpoints.clone(), ttl, believed_until.clone()));
    let held = || Instant::now() < *believed_until.lock().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while !held() {
        if Instant::now() > until || keeper.is_finished() {
            bail!("the etcd worker never held its lease");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut results: Vec<(Failure, Trial)> = Vec::new();
    for trial in 0..trials * 2 {
        let failure = if trial % 2 == 0 { Failure::Kill } else { Failure::Freeze };
        let deadline = Instant::now() + Duration::from_secs(20);
        let leader = loop {
            if let Some(l) = cluster.leader_other_than(None).await {
                break l;
            }
            if Instant::now() > deadline {
                bail!("trial {trial}: etcd has no leader");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        while !held() {
            if Instant::now() > deadline {
                bail!("trial {trial}: the etcd worker did not get its lease back");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(ttl).await;
        tokio::time::sleep(ttl.mul_f64(rand::random_range(0.0..0.25))).await;
        let start = Instant::now();
        match failure {
            Failure::Kill => cluster.kill(leader),
            Failure::Freeze => cluster.signal_pause(leader, true),
        }
        let lapse = lapse_within(held, ttl * 2);
        let elected = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if cluster.leader_other_than(Some(leader)).await.is_some() {
                    return start.elapsed();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        let (lapse, elected) = tokio::join!(lapse, elected);
        let elected = elected.with_context(|| format!("etcd trial {trial}: no new leader within 30 s"))?;
        results.push((failure, Trial { elected, lapse }));
        match failure {
            Failure::Kill => cluster.restart(leader)?,
            Failure::Freeze => cluster.signal_pause(leader, false),
        }
    }
    keeper.abort();
    report(table, "etcd: ", ttl, &results);
    Ok(())
}

/// The etcd worker's renewal loop: one lease, a keep-alive every quarter `ttl`, each bounded
/// by a quarter `ttl`; a failed or late one moves to the next member and is sent again there.
/// A lease etcd let expire is replaced by a new one.
async fn etcd_keep_alive(
    endpoints: Vec<String>,
    ttl: Duration,
    believed_until: std::sync::Arc<std::sync::Mutex<Instant>>,
) -> Result<()> {
    let patience = ttl / 4;
    let margin = ttl / 5;
    let mut member = 0;
    let mut first = etcd_client::Client::connect([endpoints[0].clone()], None).await?;
    let mut lease = first.lease_grant(ttl.as_secs() as i64, None).await?.id();
    let mut stream = None;
    let mut ticks = tokio::time::interval(ttl / 4);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let sent = Instant::now();
        let attempt = tokio::time::timeout(patience, async {
            if stream.is_none() {
                let mut c = etcd_client::Client::connect([endpoints[member].clone()], None).await?;
                if lease == 0 {
                    lease = c.lease_grant(ttl.as_secs() as i64, None).await?.id();
                }
                stream = Some(c.lease_keep_alive(lease).await?);
            }
            let (keeper, answers) = stream.as_mut().expect("opened above");
            keeper.keep_alive().await?;
            match answers.message().await? {
                Some(a) => Ok(a.ttl() > 0),
                None => bail!("keep-alive stream closed"),
            }
        })
        .await;
        match attempt {
            // The lease ran out in etcd: a worker takes a new one (and its partitions again),
            // and the time without one counts as a lapse.
            Ok(Ok(false)) => {
                eprintln!("etcd expired lease {lease}; the worker takes a new one");
                (lease, stream) = (0, None);
            }
            Ok(Ok(true)) => {
                {
                    let mut until = believed_until.lock().unwrap();
                    *until = (*until).max(sent + ttl - margin);
                }
                ticks.tick().await;
            }
            _ => {
                stream = None;
                member = (member + 1) % endpoints.len();
            }
        }
    }
}
