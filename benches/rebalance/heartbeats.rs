//! Heartbeat sections: throughput and leader CPU per renewal.

use super::*;

/// One heartbeat through the client (following the leader); whether it was acknowledged.
pub(crate) async fn heartbeat(client: &Client, beat: &proto::HeartbeatRequest) -> bool {
    client
        .call(|mut c| {
            let beat = beat.clone();
            async move { c.heartbeat(beat).await }
        })
        .await
        .is_ok()
}

pub(crate) type BeatStream =
    (tokio::sync::mpsc::Sender<proto::HeartbeatRequest>, tonic::Streaming<proto::HeartbeatResponse>);

/// One `Heartbeats` stream per session, as the worker library keeps, dealt round-robin into
/// `in_flight` groups.
pub(crate) async fn open_streams(
    client: &Client,
    beats: &[proto::HeartbeatRequest],
    in_flight: usize,
) -> Result<Vec<Vec<(proto::HeartbeatRequest, BeatStream)>>> {
    let mut groups: Vec<Vec<_>> = (0..in_flight).map(|_| Vec::new()).collect();
    for (i, beat) in beats.iter().enumerate() {
        let stream = client
            .call(|mut c| async move {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                let answers = c.heartbeats(tokio_stream::wrappers::ReceiverStream::new(rx)).await?;
                Ok(answers.map(|a| (tx, a)))
            })
            .await?;
        groups[i % in_flight].push((beat.clone(), stream));
    }
    groups.retain(|g| !g.is_empty());
    Ok(groups)
}

/// Each group heartbeats its sessions in turn, one outstanding heartbeat per group, for
/// `window`; returns how many were acknowledged.
pub(crate) async fn drive_streams(
    groups: Vec<Vec<(proto::HeartbeatRequest, BeatStream)>>,
    window: Duration,
) -> Result<u64> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for mut group in groups {
        tasks.push(tokio::spawn(async move {
            let mut acked = 0u64;
            'run: loop {
                for (beat, (tx, answers)) in group.iter_mut() {
                    if start.elapsed() >= window {
                        break 'run;
                    }
                    if tx.send(beat.clone()).await.is_err() || !matches!(answers.message().await, Ok(Some(_)))
                    {
                        break 'run;
                    }
                    acked += 1;
                }
            }
            acked
        }));
    }
    let mut acked = 0;
    for t in tasks {
        acked += t.await?;
    }
    Ok(acked)
}

/// This process's CPU time so far (user + system), from /proc.
pub(crate) fn cpu_time() -> Option<Duration> {
    process_cpu_time("self")
}

/// CPU time (user and system) a process has used so far, from `/proc/<pid>/stat`.
pub(crate) fn process_cpu_time(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10)) // USER_HZ is 100 on Linux
}

/// Joins one session under `name` (through the client, following the leader); what it needs to
/// heartbeat.
pub(crate) async fn join_session(client: Client, name: String) -> Result<proto::HeartbeatRequest> {
    let r = client
        .call(|mut c| {
            let name = name.clone();
            async move { c.join(proto::JoinRequest { name, weight: 1, ..Default::default() }).await }
        })
        .await?;
    Ok(proto::HeartbeatRequest { session_id: r.session_id, secret: r.secret, ..Default::default() })
}

/// `sessions` sessions named `s0`, `s1`, ..., joined 32 at a time, as a fleet starting up
/// would (Raft batches them); what each needs to heartbeat.
pub(crate) async fn join_sessions(client: &Client, sessions: usize) -> Result<Vec<proto::HeartbeatRequest>> {
    futures::stream::iter(0..sessions)
        .map(|n| join_session(client.clone(), format!("s{n}")))
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// Leader CPU per renewal, the figure that decides how many workers one coordinator can keep:
/// tenure's session heartbeats against three `tenure serve` processes and etcd's lease
/// keep-alives against its three members, the same number of sessions and requests in flight,
/// each leader's CPU read from `/proc` around the load.
pub(crate) async fn renewal_cpu(
    table: &mut Table,
    sessions: usize,
    window: Duration,
    etcd: Option<&etcd::EtcdCluster>,
) -> Result<f64> {
    use tenure::nemesis::{ProcessCluster, ServeSettings};
    let in_flight = 256;
    let dir = tempfile::tempdir()?;
    let settings = ServeSettings {
        binary: env!("CARGO_BIN_EXE_tenure").into(),
        partition_count: 1024,
        lease_ttl: Duration::from_secs(600),
        election_timeout: Duration::from_millis(300),
        snapshot_after_logs: 5000,
        // As etcd's members here: no TLS on either side.
        insecure: true,
        status_pages: false,
    };
    let mut cluster = ProcessCluster::start(3, dir.path(), settings).await?;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await.context("no leader")?;
    let pid = cluster.pid(leader).context("leader not running")?.to_string();
    let client = Client::new(cluster.addrs())?; // plain text, as the cluster
    let beats = join_sessions(&client, sessions).await?;
    let groups = open_streams(&client, &beats, in_flight).await?;
    let before = process_cpu_time(&pid);
    let start = Instant::now();
    let acked = drive_streams(groups, window).await?;
    let elapsed = start.elapsed();
    let cpu = before.zip(process_cpu_time(&pid)).map(|(a, b)| b.saturating_sub(a));
    cluster.shutdown().await;
    let Some(cpu) = cpu else { bail!("cannot read the leader's CPU time") };
    let tenure_us = cpu.as_secs_f64() * 1e6 / acked.max(1) as f64;
    table.figure(
        format!("{sessions} sessions on serve processes: heartbeats acknowledged per second"),
        format!("{:.0}", acked as f64 / elapsed.as_secs_f64()),
    );
    table.figure(
        format!("{sessions} sessions: leader CPU per heartbeat (tenure)"),
        format!("{tenure_us:.1} us"),
    );

    let Some(etcd) = etcd else { return Ok(tenure_us) };
    let pid = etcd.leader_pid().await?.to_string();
    let before = process_cpu_time(&pid);
    let start = Instant::now();
    let acked = etcd::keepalive_load(&etcd.endpoints, sessions, in_flight, window).await?;
    let elapsed = start.elapsed();
    let cpu = before.zip(process_cpu_time(&pid)).map(|(a, b)| b.saturating_sub(a));
    let Some(cpu) = cpu else { bail!("cannot read etcd's CPU time") };
    let etcd_us = cpu.as_secs_f64() * 1e6 / acked.max(1) as f64;
    table.figure(
        format!("etcd, {sessions} leases: keep-alives acknowledged per second"),
        format!("{:.0}", acked as f64 / elapsed.as_secs_f64()),
    );
    table.figure(format!("etcd, {sessions} leases: leader CPU per keep-alive"), format!("{etcd_us:.1} us"));
    table.figure("ratio etcd / tenure: leader CPU per renewal", format!("{:.1}x", etcd_us / tenure_us));
    Ok(tenure_us)
}

/// The PostgreSQL design's renewals: `sessions` workers, each holding its share of `partitions`,
/// renewing with one statement each over a pool of 32 connections, 256 renewals in flight; the
/// server's CPU (every PostgreSQL process) per renewal.
pub(crate) async fn postgres_renewal_cpu(
    table: &mut Table,
    partitions: u32,
    sessions: usize,
    window: Duration,
    tenure_us: f64,
) -> Result<()> {
    let pg = match postgres::Postgres::start(partitions).await {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("PostgreSQL baseline skipped: {e:#}");
            return Ok(());
        }
    };
    let (renewed, cpu) = postgres::renewal_load(&pg, sessions, 32, 256, window).await?;
    pg.stop().await?;
    let label = format!("PostgreSQL, P={partitions}, {sessions} workers");
    table.figure(
        format!("{label}: renewals per second"),
        format!("{:.0}", renewed as f64 / window.as_secs_f64()),
    );
    let pg_us = cpu.as_secs_f64() * 1e6 / renewed.max(1) as f64;
    table.figure(format!("{label}: server CPU per renewal"), format!("{pg_us:.1} us"));
    table.figure(
        format!("ratio PostgreSQL / tenure: CPU per renewal, P={partitions}"),
        format!("{:.1}x", pg_us / tenure_us),
    );
    Ok(())
}

/// Many sessions heartbeating from this process: renewals per second the leader acknowledges.
pub(crate) async fn heartbeat_throughput(
    table: &mut Table,
    partitions: u32,
    sessions: usize,
    window: Duration,
) -> Result<()> {
    let dir = tempfile::tempdir()?;
    // A long TTL: the sessions do not heartbeat while the others join.
    // Plain text: thousands of sessions share one connection here, and etcd's runs without TLS.
    let cluster = cluster_with(dir.path(), partitions, Duration::from_secs(600), false).await?;
    let client = cluster.client();
    let join_start = Instant::now();
    let joined = join_sessions(&client, sessions).await?;
    let join_time = join_start.elapsed();
    // One at a time first: the latency of a renewal (a quorum round and the table lookup).
    let mut single = Vec::new();
    for beat in joined.iter().cycle().take(200) {
        let t = Instant::now();
        if !heartbeat(&client, beat).await {
            bail!("a heartbeat of session {} was refused", beat.session_id);
        }
        single.push(t.elapsed());
    }
    let single = Sample::new(single);
    table.latency(format!("P={partitions}: heartbeat round trip, one at a time, p50"), single.pct(0.5));
    table.latency(format!("P={partitions}: heartbeat round trip, one at a time, p99"), single.pct(0.99));
    let concurrency = 256;
    let groups = open_streams(&client, &joined, concurrency).await?;
    let cpu_before = cpu_time();
    let start = Instant::now();
    let acked = drive_streams(groups, window).await?;
    let elapsed = start.elapsed();
    let cpu = cpu_before.zip(cpu_time()).map(|(a, b)| b.saturating_sub(a));
    table.figure(
        format!("{sessions} sessions joined (P={partitions})"),
        format!("{:.1} s", join_time.as_secs_f64()),
    );
    table.figure(
        format!("P={partitions}, {sessions} sessions: heartbeats acknowledged per second (one stream per session, {concurrency} in flight)"),
        format!("{:.0}", acked as f64 / elapsed.as_secs_f64()),
    );
    if let Some(cpu) = cpu {
        table.figure(
            format!(
                "P={partitions}, {sessions} sessions: CPU per acknowledged heartbeat (cluster and clients)"
            ),
            format!("{:.0} us", cpu.as_secs_f64() * 1e6 / acked.max(1) as f64),
        );
    }
    cluster.shutdown().await;
    Ok(())
}
