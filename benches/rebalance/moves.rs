//! Rebalance sections on tenure: the commit floor, join and leave, planned moves, crash
//! failover, leader loss.

use super::*;

/// One Raft commit and apply, through the leader: an `Expire` of nobody changes nothing.
pub(crate) async fn commit_floor(cluster: &LocalCluster, n: usize) -> Result<Sample> {
    let leader = cluster.leader().context("no leader")?;
    let raft = cluster.node(leader).context("leader stopped")?.raft().clone();
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        raft.client_write(tenure::ownership::Proposal::default_namespace(Command::Expire {
            sessions: Vec::new(),
        }))
        .await?;
        v.push(t.elapsed());
    }
    Ok(Sample::new(v))
}

/// 4 -> 5 and 5 -> 4 workers at `partitions`.
/// Returns, per moved partition, how long the join and the leave took until it was owned.
pub(crate) async fn join_and_leave(table: &mut Table, partitions: u32) -> Result<(Sample, Sample)> {
    let dir = tempfile::tempdir()?;
    let cluster = cluster(dir.path(), partitions, Duration::from_secs(5)).await?;
    let mut fleet = Fleet::new();
    for n in 1..=4 {
        fleet.join(cluster.worker_config(&format!("w{n}"))).await?;
    }
    fleet.settle(&cluster, partitions).await?;

    // Join: the decision is the Join entry (it marks the moves); then each old owner releases.
    let start = Instant::now();
    fleet.join(cluster.worker_config("w5")).await?;
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
pub(crate) async fn planned_moves(table: &mut Table, rounds: usize) -> Result<Sample> {
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
        bench_worker(cluster.worker_config(&name), store.clone(), move |p, _, told, wrote| {
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
pub(crate) async fn crash_failover(table: &mut Table, ttl: Duration) -> Result<Sample> {
    let partitions = 256;
    let dir = tempfile::tempdir()?;
    let cluster = cluster(dir.path(), partitions, ttl).await?;
    let mut fleet = Fleet::new();
    for n in 1..=4 {
        fleet.join(cluster.worker_config(&format!("w{n}"))).await?;
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
pub(crate) async fn leader_loss(table: &mut Table, trials: usize) -> Result<()> {
    let partitions = 256;
    let dir = tempfile::tempdir()?;
    // An election timeout of 150-300 ms, heartbeats every 25 ms; plain text, so the probe
    // session joins through the cluster's own client.
    let mut cluster = LocalCluster::start(3, dir.path(), |c| {
        c.tls = None;
        c.partition_count = partitions;
        c.lease_ttl = Duration::from_secs(5);
        c.election_timeout = Duration::from_millis(150);
        c.raft_heartbeat_interval = Duration::from_millis(25);
        c.expiry_check_interval = Duration::from_millis(20);
    })
    .await?;
    let client = cluster.client();
    let joined = client
        .call(|mut c| async move {
            c.join(proto::JoinRequest { name: "probe".into(), weight: 1, ..Default::default() }).await
        })
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
        // The stop runs beside the measurement: a node in this process takes a while to end
        // its tasks after Raft has stopped, which a killed process would not.
        let node = cluster.take(leader).context("leader not running")?;
        let start = Instant::now();
        let stopping = tokio::spawn(node.shutdown());
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
        let fresh = Worker::join(cluster.worker_config(&format!("after-{trial}"))).await?;
        granted.push(start.elapsed());
        fresh.abandon();
        stopping.await?;
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
