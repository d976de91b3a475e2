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

/// Samples, every millisecond for `window`, how long the worker believed fewer than `all`
/// partitions; returns that total.
async fn lapse_within(worker: &Worker, all: usize, window: Duration) -> Duration {
    let (start, mut lapse, mut short_since) = (Instant::now(), Duration::ZERO, None::<Instant>);
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    while start.elapsed() < window {
        ticks.tick().await;
        let now = Instant::now();
        match (worker.owned().len() < all, short_since) {
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
        let lapse = lapse_within(&worker, all, ttl * 2);
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

    let ttl_s = ttl.as_secs_f64();
    for failure in [Failure::Kill, Failure::Freeze] {
        let of = || results.iter().filter(move |(f, _)| *f == failure).map(|(_, t)| t);
        let what = match failure {
            Failure::Kill => "killed",
            Failure::Freeze => "frozen",
        };
        let elected = Sample::new(of().map(|t| t.elected).collect());
        let lapses = Sample::new(of().map(|t| t.lapse).collect());
        let label = format!("leader {what} at TTL {ttl_s} s ({} trials)", lapses.0.len());
        table.latency(format!("{label}: new leader named p50"), elected.pct(0.5));
        table.latency(format!("{label}: new leader named max"), elected.max());
        table.figure(
            format!("{label}: trials with a lease lapse"),
            of().filter(|t| !t.lapse.is_zero()).count().to_string(),
        );
        table.latency(format!("{label}: longest lapse"), lapses.max());
    }
    Ok(())
}
