//! Bench workers (release at once when asked, write once when assigned) and the cluster they
//! run against.

use super::*;

/// When each (partition, token) was told to its new owner and first written by it.
#[derive(Default)]
pub(crate) struct Observed {
    pub(crate) told: HashMap<(PartitionId, FencingToken), (String, Instant)>,
    pub(crate) wrote: HashMap<(PartitionId, FencingToken), Instant>,
}

/// Workers that release at once when asked and write once to the fenced store when assigned.
pub(crate) struct Fleet {
    pub(crate) workers: BTreeMap<String, Arc<Worker>>,
    pub(crate) observed: Arc<Mutex<Observed>>,
    pub(crate) store: Arc<MemoryFence>,
}

/// A worker that releases revoked partitions at once (one call per batch of revokes) and, told
/// of a partition, raises its fence and writes once; `told` hears of every grant with when it
/// was told and when its first write was accepted.
pub(crate) async fn bench_worker(
    config: WorkerConfig,
    store: Arc<MemoryFence>,
    told: impl Fn(PartitionId, FencingToken, Instant, Option<Instant>) + Send + 'static,
) -> Result<Arc<Worker>> {
    let mut worker = Worker::join(config).await?;
    let mut events = worker.events().context("events taken once")?;
    let worker = Arc::new(worker);
    let me = Arc::downgrade(&worker);
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let mut revoked = Vec::new();
            let mut next = Some(event);
            while let Some(event) = next.take() {
                match event {
                    WorkerEvent::Granted(h) => {
                        let at = Instant::now();
                        let wrote = match h.acquire(&*store).await {
                            Ok(fenced) => fenced.write(b"k", b"v").await.ok().map(|()| Instant::now()),
                            Err(_) => None,
                        };
                        told(h.partition(), h.token(), at, wrote);
                    }
                    WorkerEvent::Revoking { partition, .. } => revoked.push(partition),
                    _ => {}
                }
                next = events.try_recv();
            }
            if let (false, Some(me)) = (revoked.is_empty(), me.upgrade()) {
                let _ = me.release(&revoked).await; // one call for the whole batch
            }
        }
    });
    Ok(worker)
}

impl Fleet {
    pub(crate) fn new() -> Fleet {
        Fleet { workers: BTreeMap::new(), observed: Default::default(), store: Default::default() }
    }

    /// Joins a worker with `config` (its name, its certificate).
    pub(crate) async fn join(&mut self, config: WorkerConfig) -> Result<()> {
        let (observed, who) = (self.observed.clone(), config.name.clone());
        let name = who.clone();
        let worker = bench_worker(config, self.store.clone(), move |p, token, told, wrote| {
            let mut observed = observed.lock().unwrap();
            observed.told.insert((p, token), (who.clone(), told));
            if let Some(wrote) = wrote {
                observed.wrote.insert((p, token), wrote);
            }
        })
        .await?;
        self.workers.insert(name, worker);
        Ok(())
    }

    pub(crate) fn owned(&self) -> usize {
        self.workers.values().map(|w| w.owned().len()).sum()
    }

    /// Waits until the leader's table is fully owned, nothing is being revoked, owned counts are
    /// balanced within one, every worker believes exactly its rows, and its handler has been told
    /// of each.
    pub(crate) async fn settle(&self, cluster: &LocalCluster, partitions: u32) -> Result<()> {
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
    pub(crate) async fn mismatch(&self, cluster: &LocalCluster) -> String {
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

    pub(crate) async fn settled(&self, cluster: &LocalCluster, partitions: u32) -> bool {
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
    pub(crate) fn moves_since(&self, since: Instant) -> Vec<(String, Instant, Option<Instant>)> {
        let observed = self.observed.lock().unwrap();
        observed
            .told
            .iter()
            .filter(|(_, (_, t))| *t >= since)
            .map(|(key, (who, t))| (who.clone(), *t, observed.wrote.get(key).copied()))
            .collect()
    }
}

pub(crate) async fn cluster(dir: &std::path::Path, partitions: u32, ttl: Duration) -> Result<LocalCluster> {
    cluster_with(dir, partitions, ttl, true).await
}

/// Like [`cluster`]; `tls: false` serves peers and clients in plain text, for benchmarks whose
/// thousands of sessions share a few connections (a worker certificate names one worker) and
/// whose etcd baseline runs without TLS too.
pub(crate) async fn cluster_with(
    dir: &std::path::Path,
    partitions: u32,
    ttl: Duration,
    tls: bool,
) -> Result<LocalCluster> {
    let cluster = LocalCluster::start(3, dir, |c| {
        if !tls {
            c.tls = None;
        }
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
