//! What users of a coordinator care about, measured on a 3-node cluster in this process (real
//! gRPC on loopback, RocksDB on disk, every write synced): the cost of one Raft commit, planned
//! move latency, join and leave rebalances, crash failover, leader loss and heartbeat
//! throughput. Every latency is also printed as a multiple of the commit, measured in the same
//! run, so the ratios hold on a noisy machine.
//!
//! `cargo bench` runs everything; `cargo bench -- --quick` (or `TENURE_BENCH_QUICK=1`) runs the
//! small sizes only, in a couple of minutes. The table is printed and written to
//! `<target dir>/tenure-bench/results.md`.

mod etcd;
mod scale;

#[global_allocator]
static ALLOCATOR: scale::Counting = scale::Counting;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::fence::MemoryFence;
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::LocalCluster;
use tenure::ownership::Command;
use tenure::proto;
use tenure::worker::{Client, Worker, WorkerConfig, WorkerEvent};

/// Latencies, sorted.
struct Sample(Vec<Duration>);

impl Sample {
    fn new(mut v: Vec<Duration>) -> Sample {
        v.sort();
        Sample(v)
    }
    fn pct(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() as f64 - 1.0) * p).round() as usize;
        self.0[i]
    }
    fn max(&self) -> Duration {
        self.0.last().copied().unwrap_or_default()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The printed table: every row a figure and, for latencies, its multiple of the commit.
struct Table {
    floor: Duration,
    rows: Vec<(String, String, String)>,
}

impl Table {
    fn latency(&mut self, what: impl Into<String>, d: Duration) {
        let multiple = format!("{:.1}x", d.as_secs_f64() / self.floor.as_secs_f64());
        self.push((what.into(), format!("{:.1} ms", ms(d)), multiple));
    }
    fn figure(&mut self, what: impl Into<String>, value: impl Into<String>) {
        self.push((what.into(), value.into(), String::new()));
    }
    /// Rows are also printed as they come, so a run that fails later keeps what it measured.
    fn push(&mut self, row: (String, String, String)) {
        eprintln!("  {}: {} {}", row.0, row.1, row.2);
        self.rows.push(row);
    }
    fn render(&self) -> String {
        let w = self.rows.iter().map(|r| r.0.len()).max().unwrap_or(10);
        let mut out = String::new();
        let _ = writeln!(out, "| {:<w$} | {:>14} | {:>9} |", "measure", "value", "commits");
        let _ = writeln!(out, "|{}|{}|{}|", "-".repeat(w + 2), "-".repeat(16), "-".repeat(11));
        for (what, value, multiple) in &self.rows {
            let _ = writeln!(out, "| {what:<w$} | {value:>14} | {multiple:>9} |");
        }
        out
    }
}

/// When each (partition, token) was told to its new owner and first written by it.
#[derive(Default)]
struct Observed {
    told: HashMap<(PartitionId, FencingToken), (String, Instant)>,
    wrote: HashMap<(PartitionId, FencingToken), Instant>,
}

/// Workers that release at once when asked and write once to the fenced store when assigned.
struct Fleet {
    addrs: Vec<String>,
    workers: BTreeMap<String, Arc<Worker>>,
    observed: Arc<Mutex<Observed>>,
    store: Arc<MemoryFence>,
}

/// A worker that releases revoked partitions at once (one call per batch of revokes) and, told
/// of a partition, raises its fence and writes once; `told` hears of every grant with when it
/// was told and when its first write was accepted.
async fn bench_worker(
    addrs: Vec<String>,
    name: String,
    store: Arc<MemoryFence>,
    told: impl Fn(PartitionId, FencingToken, Instant, Option<Instant>) + Send + 'static,
) -> Result<Arc<Worker>> {
    let mut worker = Worker::join(WorkerConfig::new(addrs, name)).await?;
    let mut events = worker.events();
    let worker = Arc::new(worker);
    let me = Arc::downgrade(&worker);
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let mut revoked = Vec::new();
            let mut next = Some(event);
            while let Some(event) = next.take() {
                match event {
                    WorkerEvent::Assigned(h) => {
                        let at = Instant::now();
                        let wrote = match h.acquire(&*store).await {
                            Ok(_) => h.write(&*store, b"k", b"v").await.ok().map(|()| Instant::now()),
                            Err(_) => None,
                        };
                        told(h.partition(), h.token(), at, wrote);
                    }
                    WorkerEvent::Revoking { partition, .. } => revoked.push(partition),
                    _ => {}
                }
                next = events.try_recv().ok();
            }
            if let (false, Some(me)) = (revoked.is_empty(), me.upgrade()) {
                let _ = me.release(&revoked).await; // one call for the whole batch
            }
        }
    });
    Ok(worker)
}

impl Fleet {
    fn new(cluster: &LocalCluster) -> Fleet {
        Fleet {
            addrs: cluster.addrs(),
            workers: BTreeMap::new(),
            observed: Default::default(),
            store: Default::default(),
        }
    }

    async fn join(&mut self, name: &str) -> Result<()> {
        let (observed, who) = (self.observed.clone(), name.to_string());
        let worker = bench_worker(
            self.addrs.clone(),
            who.clone(),
            self.store.clone(),
            move |p, token, told, wrote| {
                let mut observed = observed.lock().unwrap();
                observed.told.insert((p, token), (who.clone(), told));
                if let Some(wrote) = wrote {
                    observed.wrote.insert((p, token), wrote);
                }
            },
        )
        .await?;
        self.workers.insert(name.to_string(), worker);
        Ok(())
    }

    fn owned(&self) -> usize {
        self.workers.values().map(|w| w.owned().len()).sum()
    }

    /// Waits until the leader's table is fully owned, nothing is being revoked, owned counts are
    /// balanced within one, every worker believes exactly its rows, and its handler has been told
    /// of each.
    async fn settle(&self, cluster: &LocalCluster, partitions: u32) -> Result<()> {
        let until = Instant::now() + Duration::from_secs(300);
        loop {
            if self.settled(cluster, partitions).await {
                return Ok(());
            }
            if Instant::now() > until {
                bail!("the table did not settle: {}", self.mismatch(cluster).await);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// What keeps the table from settling, for the error message.
    async fn mismatch(&self, cluster: &LocalCluster) -> String {
        let Ok(status) = cluster.status().await else { return "no status".into() };
        let mut out = format!("{} partitions believed; ", self.owned());
        for r in status.partitions.iter().filter(|r| r.owner == 0 || r.revoking).take(3) {
            let _ =
                write!(out, "p{} owner {} token {} revoking {}; ", r.partition, r.owner, r.token, r.revoking);
        }
        for (name, w) in &self.workers {
            let owned = w.owned();
            for r in status.partitions.iter().filter(|r| r.owner == w.session().0) {
                if owned.get(&PartitionId(r.partition)) != Some(&FencingToken(r.token)) {
                    let _ = write!(out, "{name} does not believe p{} token {}; ", r.partition, r.token);
                }
            }
        }
        out
    }

    async fn settled(&self, cluster: &LocalCluster, partitions: u32) -> bool {
        let Ok(status) = cluster.status().await else { return false };
        if status.leader_id != status.node_id
            || status.partitions.len() != partitions as usize
            || status.partitions.iter().any(|r| r.owner == 0 || r.revoking)
        {
            return false;
        }
        let mut counts = Vec::new();
        for w in self.workers.values() {
            let rows: BTreeMap<PartitionId, FencingToken> = status
                .partitions
                .iter()
                .filter(|r| r.owner == w.session().0)
                .map(|r| (PartitionId(r.partition), FencingToken(r.token)))
                .collect();
            if w.owned() != rows {
                return false;
            }
            // The application, not only the library, has heard of every grant: its handler
            // may still be working through a long queue of them.
            let observed = self.observed.lock().unwrap();
            if rows.iter().any(|(p, t)| !observed.told.contains_key(&(*p, *t))) {
                return false;
            }
            drop(observed);
            counts.push(rows.len());
        }
        let (min, max) = (counts.iter().min(), counts.iter().max());
        counts.iter().sum::<usize>() == partitions as usize && min.zip(max).is_some_and(|(a, b)| b - a <= 1)
    }

    /// Who was told of each grant made after `since`, when, and when it first wrote.
    fn moves_since(&self, since: Instant) -> Vec<(String, Instant, Option<Instant>)> {
        let observed = self.observed.lock().unwrap();
        observed
            .told
            .iter()
            .filter(|(_, (_, t))| *t >= since)
            .map(|(key, (who, t))| (who.clone(), *t, observed.wrote.get(key).copied()))
            .collect()
    }
}

async fn cluster(dir: &std::path::Path, partitions: u32, ttl: Duration) -> Result<LocalCluster> {
    let cluster = LocalCluster::start(3, dir, |c| {
        c.partition_count = partitions;
        c.lease_ttl = ttl;
        c.election_timeout = Duration::from_millis(300);
        c.raft_heartbeat_interval = Duration::from_millis(50);
        c.expiry_check_interval = Duration::from_millis(20);
    })
    .await?;
    cluster.wait_for_leader(Duration::from_secs(10)).await.context("no leader")?;
    Ok(cluster)
}

/// One Raft commit and apply, through the leader: an `Expire` of nobody changes nothing.
async fn commit_floor(cluster: &LocalCluster, n: usize) -> Result<Sample> {
    let leader = cluster.leader().context("no leader")?;
    let raft = cluster.node(leader).context("leader stopped")?.raft().clone();
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        raft.client_write(Command::Expire { sessions: Vec::new() }).await?;
        v.push(t.elapsed());
    }
    Ok(Sample::new(v))
}

/// 4 -> 5 and 5 -> 4 workers at `partitions`.
/// Returns, per moved partition, how long the join and the leave took until it was owned.
async fn join_and_leave(table: &mut Table, partitions: u32) -> Result<(Sample, Sample)> {
    let dir = tempfile::tempdir()?;
    let cluster = cluster(dir.path(), partitions, Duration::from_secs(5)).await?;
    let mut fleet = Fleet::new(&cluster);
    for n in 1..=4 {
        fleet.join(&format!("w{n}")).await?;
    }
    fleet.settle(&cluster, partitions).await?;

    // Join: the decision is the Join entry (it marks the moves); then each old owner releases.
    let start = Instant::now();
    fleet.join("w5").await?;
    let decided = Instant::now();
    fleet.settle(&cluster, partitions).await?;
    let moves: Vec<_> = fleet.moves_since(start).into_iter().filter(|(who, _, _)| who == "w5").collect();
    let told = Sample::new(moves.iter().map(|(_, t, _)| t.saturating_duration_since(decided)).collect());
    let wrote = Sample::new(
        moves.iter().filter_map(|(_, _, w)| w.map(|w| w.saturating_duration_since(decided))).collect(),
    );
    let minimum = partitions / 5;
    table.figure(
        format!("P={partitions} join 4->5: partitions moved (minimum for balance)"),
        format!("{} ({minimum})", moves.len()),
    );
    table.latency(
        format!("P={partitions} join 4->5: move, decision -> new owner confirmed p50"),
        told.pct(0.5),
    );
    table.latency(
        format!("P={partitions} join 4->5: move, decision -> new owner confirmed p99"),
        told.pct(0.99),
    );
    table.latency(
        format!("P={partitions} join 4->5: move, decision -> first accepted write p99"),
        wrote.pct(0.99),
    );
    table.latency(format!("P={partitions} join 4->5: every moved partition owned and confirmed"), told.max());
    let join_all = told;

    // Leave: w5 hands everything back.
    let leaving = fleet.workers["w5"].owned().len();
    let start = Instant::now();
    fleet.workers["w5"].leave().await?;
    fleet.workers.remove("w5");
    fleet.settle(&cluster, partitions).await?;
    let moves = fleet.moves_since(start);
    let told = Sample::new(moves.iter().map(|(_, t, _)| t.saturating_duration_since(start)).collect());
    table.figure(
        format!("P={partitions} leave 5->4: partitions moved (minimum)"),
        format!("{} ({leaving})", moves.len()),
    );
    table.latency(
        format!("P={partitions} leave 5->4: move, leave call -> new owner confirmed p99"),
        told.pct(0.99),
    );
    table
        .latency(format!("P={partitions} leave 5->4: every moved partition owned and confirmed"), told.max());
    let leave_all = told;
    for w in fleet.workers.values() {
        let _ = w.leave().await;
    }
    cluster.shutdown().await;
    Ok((join_all, leave_all))
}

/// Planned moves one at a time, the way an operator sees them: worker `b` joins a 16-partition
/// table that `a` owns (8 partitions move to it), then leaves (they move back). The decision is
/// the instant the leader applied the entry that revoked the partition (observed on the leader
/// itself); the new owner is "told" when its library reports the partition assigned, which is
/// after a heartbeat confirmed the lease, and then it raises the fence and writes once.
async fn planned_moves(table: &mut Table, rounds: usize) -> Result<Sample> {
    let partitions = 16;
    let dir = tempfile::tempdir()?;
    let cluster = cluster(dir.path(), partitions, Duration::from_secs(5)).await?;
    let leader = cluster.leader().context("no leader")?;
    let mut applied = cluster.node(leader).context("leader stopped")?.node.applied_events();
    // When the leader applied each partition's latest revoke.
    let decided: Arc<Mutex<HashMap<PartitionId, Instant>>> = Default::default();
    let watcher = {
        let decided = decided.clone();
        tokio::spawn(async move {
            while let Ok(entry) = applied.recv().await {
                let now = Instant::now();
                let mut decided = decided.lock().unwrap();
                for event in &entry.events {
                    if let tenure::ownership::Event::Revoking { partition, .. } = event {
                        decided.insert(*partition, now);
                    }
                }
            }
        })
    };
    let store = Arc::new(MemoryFence::default());
    let (told_tx, mut told_rx) = tokio::sync::mpsc::unbounded_channel();
    let start_worker = |name: String| {
        let told_tx = told_tx.clone();
        bench_worker(cluster.addrs(), name, store.clone(), move |p, _, told, wrote| {
            let _ = told_tx.send((p, told, wrote));
        })
    };
    let a = start_worker("a".into()).await?;
    let mut initial = 0;
    while initial < partitions {
        tokio::time::timeout(Duration::from_secs(30), told_rx.recv()).await?.context("a stopped")?;
        initial += 1;
    }
    let (mut told, mut wrote) = (Vec::new(), Vec::new());
    let mut collect = async |count: usize| -> Result<()> {
        for _ in 0..count {
            let (p, t, w) = tokio::time::timeout(Duration::from_secs(30), told_rx.recv())
                .await?
                .context("worker stopped")?;
            let at = *decided.lock().unwrap().get(&p).context("a move without a revoke")?;
            told.push(t.saturating_duration_since(at));
            wrote.extend(w.map(|w| w.saturating_duration_since(at)));
        }
        Ok(())
    };
    for round in 0..rounds {
        let b = start_worker(format!("b{round}")).await?;
        collect(partitions as usize / 2).await?; // to b
        b.leave().await?;
        collect(partitions as usize / 2).await?; // back to a
    }
    let (told, wrote) = (Sample::new(told), Sample::new(wrote));
    table.figure(
        "planned moves (P=16: 8 move to a joiner, 8 back when it leaves)",
        format!("{}", told.0.len()),
    );
    table.latency("planned move, decision -> new owner told (lease confirmed) p50", told.pct(0.5));
    table.latency("planned move, decision -> new owner told (lease confirmed) p99", told.pct(0.99));
    table.latency("planned move, decision -> new owner told (lease confirmed) max", told.max());
    table.latency("planned move, decision -> first accepted fenced write p50", wrote.pct(0.5));
    table.latency("planned move, decision -> first accepted fenced write p99", wrote.pct(0.99));
    watcher.abort();
    let _ = a.leave().await;
    cluster.shutdown().await;
    Ok(told)
}

/// A worker stops heartbeating: time until its partitions are owned again (returned: the last).
async fn crash_failover(table: &mut Table, ttl: Duration) -> Result<Sample> {
    let partitions = 256;
    let dir = tempfile::tempdir()?;
    let cluster = cluster(dir.path(), partitions, ttl).await?;
    let mut fleet = Fleet::new(&cluster);
    for n in 1..=4 {
        fleet.join(&format!("w{n}")).await?;
    }
    fleet.settle(&cluster, partitions).await?;
    let victim = fleet.workers.remove("w4").context("w4")?;
    let lost = victim.owned().len();
    // Crash at a random point of the worker's heartbeat period (a quarter TTL), not right after
    // the renewal that let the table settle, which would always leave the full TTL to run.
    tokio::time::sleep((ttl / 4).mul_f64(rand::random_range(0.0..1.0))).await;
    let start = Instant::now();
    Arc::into_inner(victim).context("the fleet holds the only handle")?.abandon();
    fleet.settle(&cluster, partitions).await?;
    let moves = fleet.moves_since(start);
    let told = Sample::new(moves.iter().map(|(_, t, _)| t.saturating_duration_since(start)).collect());
    let wrote = Sample::new(
        moves.iter().filter_map(|(_, _, w)| w.map(|w| w.saturating_duration_since(start))).collect(),
    );
    let label = format!("crash at TTL {} ms ({lost} partitions)", ttl.as_millis());
    table.latency(format!("{label}: owned again p50"), told.pct(0.5));
    table.latency(format!("{label}: owned again p99"), told.pct(0.99));
    table.latency(format!("{label}: first accepted write, last partition"), wrote.max());
    for w in fleet.workers.values() {
        let _ = w.leave().await;
    }
    cluster.shutdown().await;
    Ok(told)
}

/// The leader stops: time until a new leader, a renewal and a grant are served again.
async fn leader_loss(table: &mut Table, trials: usize) -> Result<()> {
    let partitions = 256;
    let dir = tempfile::tempdir()?;
    let mut cluster = cluster(dir.path(), partitions, Duration::from_secs(5)).await?;
    let client = Client::new(cluster.addrs())?;
    let joined = client
        .call(|mut c| async move { c.join(proto::JoinRequest { name: "probe".into(), weight: 1 }).await })
        .await?;
    let beat = proto::HeartbeatRequest {
        session_id: joined.session_id,
        secret: joined.secret.clone(),
        ..Default::default()
    };
    let (mut elected, mut renewed, mut granted) = (Vec::new(), Vec::new(), Vec::new());
    for trial in 0..trials {
        // Each trial starts from a cluster that has been quiet under one leader for a while, as
        // a leader failure would find it.
        let leader = cluster.wait_for_leader(Duration::from_secs(10)).await.context("no leader")?;
        while !heartbeat(&client, &beat).await {}
        tokio::time::sleep(Duration::from_millis(500)).await;
        let start = Instant::now();
        cluster.stop(leader).await;
        elected.push(loop {
            if cluster.leader().is_some() {
                break start.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        });
        renewed.push(loop {
            if heartbeat(&client, &beat).await {
                break start.elapsed();
            }
        });
        let fresh = Worker::join(WorkerConfig::new(cluster.addrs(), format!("after-{trial}"))).await?;
        granted.push(start.elapsed());
        fresh.abandon();
        cluster.restart(leader).await?;
    }
    let (elected, renewed, granted) = (Sample::new(elected), Sample::new(renewed), Sample::new(granted));
    table.figure("leader stop: trials", trials.to_string());
    table.latency("leader stop: new leader elected p50", elected.pct(0.5));
    table.latency("leader stop: new leader elected max", elected.max());
    table.latency("leader stop: first renewal acknowledged p50", renewed.pct(0.5));
    table.latency("leader stop: first renewal acknowledged max", renewed.max());
    table.latency("leader stop: first join committed p50", granted.pct(0.5));
    table.latency("leader stop: first join committed max", granted.max());
    cluster.shutdown().await;
    Ok(())
}

/// One heartbeat through the client (following the leader); whether it was acknowledged.
async fn heartbeat(client: &Client, beat: &proto::HeartbeatRequest) -> bool {
    client
        .call(|mut c| {
            let beat = beat.clone();
            async move { c.heartbeat(beat).await }
        })
        .await
        .is_ok()
}

type BeatStream =
    (tokio::sync::mpsc::Sender<proto::HeartbeatRequest>, tonic::Streaming<proto::HeartbeatResponse>);

/// One `Heartbeats` stream per session, as the worker library keeps, dealt round-robin into
/// `in_flight` groups.
async fn open_streams(
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
async fn drive_streams(
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
fn cpu_time() -> Option<Duration> {
    process_cpu_time("self")
}

/// CPU time (user and system) a process has used so far, from `/proc/<pid>/stat`.
fn process_cpu_time(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10)) // USER_HZ is 100 on Linux
}

/// `sessions` sessions named `s0`, `s1`, ..., joined 32 at a time, as a fleet starting up
/// would (Raft batches them); what each needs to heartbeat.
async fn join_sessions(client: &Client, sessions: usize) -> Result<Vec<proto::HeartbeatRequest>> {
    futures::stream::iter(0..sessions)
        .map(|n| {
            let client = client.clone();
            async move {
                let name = format!("s{n}");
                let r = client
                    .call(|mut c| {
                        let name = name.clone();
                        async move { c.join(proto::JoinRequest { name, weight: 1 }).await }
                    })
                    .await?;
                Ok::<_, anyhow::Error>(proto::HeartbeatRequest {
                    session_id: r.session_id,
                    secret: r.secret,
                    ..Default::default()
                })
            }
        })
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
async fn renewal_cpu(
    table: &mut Table,
    sessions: usize,
    window: Duration,
    etcd: Option<&etcd::EtcdCluster>,
) -> Result<()> {
    use tenure::nemesis::{ProcessCluster, ServeSettings};
    let in_flight = 256;
    let dir = tempfile::tempdir()?;
    let settings = ServeSettings {
        binary: env!("CARGO_BIN_EXE_tenure").into(),
        partition_count: 1024,
        lease_ttl: Duration::from_secs(600),
        election_timeout: Duration::from_millis(300),
        snapshot_after_logs: 5000,
    };
    let mut cluster = ProcessCluster::start(3, dir.path(), settings).await?;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await.context("no leader")?;
    let pid = cluster.pid(leader).context("leader not running")?.to_string();
    let client = Client::new(cluster.addrs())?;
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

    let Some(etcd) = etcd else { return Ok(()) };
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
    Ok(())
}

/// Many sessions heartbeating from this process: renewals per second the leader acknowledges.
async fn heartbeat_throughput(
    table: &mut Table,
    partitions: u32,
    sessions: usize,
    window: Duration,
) -> Result<()> {
    let dir = tempfile::tempdir()?;
    // A long TTL: the sessions do not heartbeat while the others join.
    let cluster = cluster(dir.path(), partitions, Duration::from_secs(600)).await?;
    let client = Client::new(cluster.addrs())?;
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

/// How long after `start` each partition taken since then was taken (by `who`, if given).
fn taken_since(acquired: &etcd::Acquired, start: Instant, who: Option<&str>) -> Sample {
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
async fn etcd_join_and_leave(
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
async fn etcd_crash(table: &mut Table, etcd: &etcd::EtcdCluster, ttl_s: i64) -> Result<Sample> {
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

fn ratio(table: &mut Table, what: &str, tenure: Duration, etcd: Duration) {
    table.figure(
        format!("ratio etcd / tenure: {what}"),
        format!("{:.1}x", etcd.as_secs_f64() / tenure.as_secs_f64().max(1e-9)),
    );
}

async fn run(quick: bool, only: Option<&str>) -> Result<(String, String)> {
    let want = |section: &str| only.is_none_or(|o| o == section);
    let dir = tempfile::tempdir()?;
    let base = cluster(dir.path(), 1024, Duration::from_secs(5)).await?;
    let floor = commit_floor(&base, if quick { 200 } else { 1000 }).await?;
    base.shutdown().await;
    let mut table = Table { floor: floor.pct(0.5), rows: Vec::new() };
    table.latency("one Raft commit (no-op write) p50", floor.pct(0.5));
    table.latency("one Raft commit (no-op write) p99", floor.pct(0.99));
    eprintln!("commit floor measured");

    let etcd_wanted = want("join-leave") || want("crash") || want("renewal-cpu");
    let etcd = if !etcd_wanted {
        None
    } else {
        match etcd::EtcdCluster::start().await {
            Ok(etcd) => Some(etcd),
            Err(e) => {
                eprintln!("etcd baseline skipped: {e:#}");
                table.figure("etcd baseline", "skipped (etcd not available)");
                None
            }
        }
    };
    let mut curves: Vec<(String, Sample)> = Vec::new();
    if want("planned") {
        let moves = planned_moves(&mut table, if quick { 25 } else { 100 }).await?;
        curves.push(("tenure, planned move, P=16".into(), moves));
        eprintln!("planned moves measured");
    }
    let sizes: &[u32] = if !want("join-leave") {
        &[]
    } else if quick {
        &[1024]
    } else {
        &[1024, 65536]
    };
    for &p in sizes {
        let (join, leave) = join_and_leave(&mut table, p).await?;
        eprintln!("P={p} join/leave measured");
        if let Some(etcd) = &etcd {
            let (ejoin, eleave) = etcd_join_and_leave(&mut table, etcd, p).await?;
            ratio(
                &mut table,
                &format!("P={p} join 4->5, every moved partition owned"),
                join.max(),
                ejoin.max(),
            );
            ratio(
                &mut table,
                &format!("P={p} leave 5->4, every moved partition owned"),
                leave.max(),
                eleave.max(),
            );
            eprintln!("etcd P={p} join/leave measured");
            if p == 1024 {
                curves.push((format!("etcd, join 4->5, P={p}"), ejoin));
            }
        }
        if p == 1024 {
            curves.push((format!("tenure, join 4->5, P={p}"), join));
        }
    }
    let ttls: &[u64] = if !want("crash") {
        &[]
    } else if quick {
        &[1]
    } else {
        &[1, 5]
    };
    for &ttl in ttls {
        let crash = crash_failover(&mut table, Duration::from_secs(ttl)).await?;
        if let Some(etcd) = &etcd {
            let ecrash = etcd_crash(&mut table, etcd, ttl as i64).await?;
            ratio(
                &mut table,
                &format!("crash at TTL {ttl} s, last partition owned again"),
                crash.max(),
                ecrash.max(),
            );
            if ttl == 1 {
                curves.push((format!("etcd, crash, lease TTL {ttl} s"), ecrash));
            }
        }
        if ttl == 1 {
            curves.push((format!("tenure, crash, TTL {ttl} s"), crash));
        }
        eprintln!("crash failover at TTL {ttl} s measured");
    }
    if want("leader") {
        leader_loss(&mut table, if quick { 5 } else { 20 }).await?;
        eprintln!("leader loss measured");
    }
    let loads: &[(u32, usize)] = if !want("heartbeats") {
        &[]
    } else if quick {
        &[(1024, 500)]
    } else {
        &[(1024, 1000), (65536, 1000), (1024, 5000), (1024, 10_000)]
    };
    for &(p, sessions) in loads {
        heartbeat_throughput(&mut table, p, sessions, Duration::from_secs(5)).await?;
        eprintln!("heartbeats at P={p} with {sessions} sessions measured");
    }
    if want("renewal-cpu") {
        renewal_cpu(&mut table, 1000, Duration::from_secs(if quick { 5 } else { 10 }), etcd.as_ref()).await?;
        eprintln!("leader CPU per renewal measured");
    }
    if want("scale") {
        let sizes: &[(u32, usize)] =
            if quick { &[(1_000_000, 1000)] } else { &[(1_000_000, 1000), (1_000_000, 10_000)] };
        for &(p, workers) in sizes {
            scale::state_machine_scale(&mut table, p, workers)?;
            eprintln!("state machine at P={p} with {workers} workers measured");
        }
    }
    Ok((table.render(), cdf_svg(&curves)))
}

/// Cumulative distributions of per-partition latencies, on a log scale from 1 ms to 10 s, as SVG.
fn cdf_svg(curves: &[(String, Sample)]) -> String {
    let (w, h, left, bottom, top, right) = (760.0, 420.0, 60.0, 50.0, 20.0, 20.0);
    let (plot_w, plot_h) = (w - left - right, h - top - bottom);
    let x_of = |d: Duration| {
        let ms = ms(d).clamp(1.0, 10_000.0);
        left + plot_w * ms.log10() / 4.0
    };
    let y_of = |f: f64| top + plot_h * (1.0 - f);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, label) in ["1 ms", "10 ms", "100 ms", "1 s", "10 s"].iter().enumerate() {
        let x = left + plot_w * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            "<line x1=\"{x}\" y1=\"{top}\" x2=\"{x}\" y2=\"{}\" stroke=\"#ddd\"/>",
            top + plot_h
        );
        let _ = writeln!(
            svg,
            "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{label}</text>",
            top + plot_h + 18.0
        );
    }
    for f in [0.0, 0.5, 1.0] {
        let y = y_of(f);
        let _ = writeln!(
            svg,
            "<line x1=\"{left}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/>",
            left + plot_w
        );
        let _ =
            writeln!(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{f:.1}</text>", left - 6.0, y + 4.0);
    }
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">time until the partition is owned again (log scale)</text>",
        left + plot_w / 2.0,
        h - 8.0
    );
    for (i, (label, sample)) in curves.iter().enumerate() {
        let color = colors[i % colors.len()];
        let n = sample.0.len().max(1) as f64;
        let mut points = String::new();
        for (k, d) in sample.0.iter().enumerate() {
            let _ = write!(
                points,
                "{:.1},{:.1} {:.1},{:.1} ",
                x_of(*d),
                y_of(k as f64 / n),
                x_of(*d),
                y_of((k + 1) as f64 / n)
            );
        }
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{points}\"/>"
        );
        let y = top + 16.0 + 18.0 * i as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{color}\" stroke-width=\"2\"/>",
            left + 10.0,
            left + 30.0
        );
        let _ = writeln!(svg, "<text x=\"{}\" y=\"{}\">{label}</text>", left + 36.0, y + 4.0);
    }
    svg.push_str("</svg>\n");
    svg
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("benchmarks run with `cargo bench` (quick: `cargo bench -- --quick`)");
        return Ok(());
    }
    let quick = args.iter().any(|a| a == "--quick") || std::env::var_os("TENURE_BENCH_QUICK").is_some();
    // `--only <section>`: planned, join-leave, crash, leader, heartbeats, renewal-cpu, scale.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (table, svg) = runtime.block_on(run(quick, only.as_deref()))?;
    println!("\n{table}");
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let out = std::path::Path::new(&target).join("tenure-bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("results.md"), &table)?;
    std::fs::write(out.join("latency.svg"), &svg)?;
    println!("written to {} and latency.svg", out.join("results.md").display());
    Ok(())
}
