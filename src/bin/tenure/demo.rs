//! `tenure demo`: a 3-node cluster and four workers in one process, on loopback, with a
//! temporary data directory. Workers join, one more joins, one leaves, one dies; every ownership
//! change is printed with its token as the workers see it.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::local_cluster::{is_settled, LocalCluster};
use tenure::proto::StatusResponse;
use tenure::worker::{Worker, WorkerEvent};

type Log = Arc<Mutex<Vec<String>>>;

/// Runs the demo, writing its narration to `out`.
pub async fn run(partitions: u32, ttl: Duration, out: &mut (dyn Write + Send)) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary data directory")?;
    let start = Instant::now();
    let cluster = LocalCluster::start(3, dir.path(), |c| {
        c.partition_count = partitions;
        c.lease_ttl = ttl;
        c.election_timeout = Duration::from_millis(300);
        c.raft_heartbeat_interval = Duration::from_millis(60);
    })
    .await?;
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await.context("no leader elected")?;
    writeln!(out, "3 coordinator nodes on {}; node {leader} leads", cluster.addrs().join(", "))?;
    writeln!(
        out,
        "{partitions} partitions, lease TTL {} ms, data in a temporary directory\n",
        ttl.as_millis()
    )?;

    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let mut workers = BTreeMap::new();
    for name in ["w1", "w2", "w3"] {
        workers.insert(name, spawn_worker(&cluster, name, start, log.clone()).await?);
    }
    settle(&cluster, &workers, out, &log, "w1, w2 and w3 join").await?;

    workers.insert("w4", spawn_worker(&cluster, "w4", start, log.clone()).await?);
    settle(&cluster, &workers, out, &log, "w4 joins: only what balance requires moves to it").await?;

    let w2 = workers.remove("w2").expect("w2 is running");
    w2.leave().await.context("w2 leaving")?;
    settle(
        &cluster,
        &workers,
        out,
        &log,
        "w2 leaves gracefully: its partitions are released and granted again",
    )
    .await?;

    let w3 = workers.remove("w3").expect("w3 is running");
    let died = Instant::now();
    match Arc::try_unwrap(w3) {
        Ok(w3) => w3.abandon(),
        Err(_) => bail!("w3 is still referenced"),
    }
    settle(
        &cluster,
        &workers,
        out,
        &log,
        "w3 dies (stops heartbeating): after the TTL its partitions are granted elsewhere",
    )
    .await?;
    writeln!(
        out,
        "   (w3's partitions were owned again {:.2}s after it died)\n",
        died.elapsed().as_secs_f64()
    )?;

    let status = cluster.status().await?;
    write!(out, "{}", render_status(&status))?;
    for (_, w) in workers {
        w.leave().await.ok();
    }
    cluster.shutdown().await;
    Ok(())
}

async fn spawn_worker(
    cluster: &LocalCluster,
    name: &'static str,
    start: Instant,
    log: Log,
) -> Result<Arc<Worker>> {
    let mut worker = Worker::join(cluster.worker_config(name)).await?;
    let mut events = worker.events().context("a new worker's events")?;
    let worker = Arc::new(worker);
    let handle = Arc::downgrade(&worker);
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let t = start.elapsed().as_secs_f64();
            let line = match &event {
                WorkerEvent::Granted(h) => {
                    let (partition, token, range) = (h.partition(), h.token(), h.range());
                    format!("t={t:6.2}s  {name} granted  {partition:>4} token={token:<4} hashes {:#018x}..={:#018x}", range.start, range.end)
                }
                WorkerEvent::Revoking { partition, token } => {
                    format!("t={t:6.2}s  {name} revoking {partition:>4} token={token}")
                }
                WorkerEvent::Released { partition, token } => {
                    format!("t={t:6.2}s  {name} released {partition:>4} token={token}")
                }
                WorkerEvent::Lost { partition, token, reason } => {
                    format!("t={t:6.2}s  {name} lost     {partition:>4} token={token} ({reason:?})")
                }
                WorkerEvent::SessionEnded { reason } => format!("t={t:6.2}s  {name} session ended: {reason}"),
            };
            log.lock().expect("log lock").push(line);
            // A revoked partition is handed back at once (a real worker would checkpoint first).
            if let WorkerEvent::Revoking { partition, .. } = event {
                if let Some(w) = handle.upgrade() {
                    let _ = w.release(&[partition]).await;
                }
            }
        }
    });
    Ok(worker)
}

/// Waits until every partition is owned, none is revoking, the live `workers` hold a balanced
/// share, and each worker believes exactly what the table gives it; then prints what happened
/// meanwhile.
async fn settle(
    cluster: &LocalCluster,
    workers: &BTreeMap<&str, Arc<Worker>>,
    out: &mut (dyn Write + Send),
    log: &Log,
    title: &str,
) -> Result<()> {
    writeln!(out, "== {title}")?;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(status) = cluster.status().await {
            if is_settled(&status, workers.len()) && workers.values().all(|w| believes_table(w, &status)) {
                break;
            }
        }
        if Instant::now() > until {
            bail!("the cluster did not settle within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for line in log.lock().expect("log lock").drain(..) {
        writeln!(out, "{line}")?;
    }
    writeln!(out)?;
    Ok(())
}

/// Whether `worker` believes it holds exactly its non-revoking rows of the table.
fn believes_table(worker: &Worker, status: &StatusResponse) -> bool {
    let session = worker.session().0;
    let want: Vec<(u32, u64)> = status
        .partitions
        .iter()
        .filter(|r| r.owner == session && !r.revoking)
        .map(|r| (r.partition, r.token))
        .collect();
    let have: Vec<(u32, u64)> = worker.owned().iter().map(|(p, t)| (p.0, t.0)).collect();
    have == want
}

/// The revoke budget and, from the leader, what is spent of it.
fn in_motion(status: &StatusResponse) -> String {
    let spent = status
        .unconfirmed_moves
        .map(|u| format!("{} revoking and {u} moved but unconfirmed", status.revoking));
    match (status.max_revoking, spent) {
        (Some(n), Some(spent)) => format!(", at most {n} partitions in motion (now {spent})"),
        (Some(n), None) => format!(", at most {n} partitions in motion"),
        (None, Some(spent)) if status.revoking > 0 || status.unconfirmed_moves > Some(0) => {
            format!(", in motion: {spent}")
        }
        (None, _) => String::new(),
    }
}

/// The status as a table for operators.
pub fn render_status(status: &StatusResponse) -> String {
    let mut s = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "node {} answering; leader: node {} ({})",
        status.node_id, status.leader_id, status.leader_addr
    );
    let _ = writeln!(
        s,
        "nodes: {}",
        status.nodes.iter().map(|n| format!("{}={}", n.id, n.addr)).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(
        s,
        "{} partitions, lease TTL {} ms{}{}, last applied index {}{}",
        status.partition_count,
        status.lease_ttl_ms,
        if status.lease_ttl_ceiling_ms > 0 {
            format!(" (leases granted before the last change may run {} ms)", status.lease_ttl_ceiling_ms)
        } else {
            String::new()
        },
        in_motion(status),
        status.last_applied,
        if status.maintenance { "; maintenance mode on (nothing is taken from a live owner)" } else { "" }
    );
    let _ = writeln!(s, "sessions:");
    for sess in &status.sessions {
        let _ = writeln!(
            s,
            "  s{:<5} {:<12} weight {:<3} owns {:<5}{}",
            sess.id,
            sess.name,
            sess.weight,
            sess.owned,
            if sess.leaving { " (leaving)" } else { "" }
        );
    }
    let names: BTreeMap<u64, &str> = status.sessions.iter().map(|x| (x.id, x.name.as_str())).collect();
    let _ = writeln!(s, "partitions:");
    for row in &status.partitions {
        let owner = if row.owner == 0 {
            "-".to_string()
        } else {
            format!("{} (s{})", names.get(&row.owner).unwrap_or(&"?"), row.owner)
        };
        let _ = writeln!(
            s,
            "  p{:<6} owner {:<16} token {:<6}{}",
            row.partition,
            owner,
            row.token,
            if row.revoking { " revoking" } else { "" }
        );
    }
    s
}
