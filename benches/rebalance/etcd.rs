//! The baseline: the same job done the way a user would on etcd. A 3-member etcd cluster
//! (Debian's `etcd-server`, started here on loopback) holds one key per partition; each worker
//! keeps a lease alive, registers itself under `members/`, and on every change it sees computes
//! the same placement tenure uses (`tenure::placement::place`, so both designs move the same
//! partitions), gives up what it must with a compare-and-delete, and takes free partitions
//! with a transactional create under its lease. The key's revision is the fencing token.

use anyhow::{bail, Context, Result};
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use futures::{FutureExt, StreamExt};
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::ids::SessionId;
use tenure::placement::{place, Member};
use tokio::task::JoinHandle;

const PREFIX: &str = "tb/";
/// Transactions a worker keeps in flight while it reconciles.
const IN_FLIGHT: usize = 32;

/// Three etcd members on loopback, stopped on drop.
pub struct EtcdCluster {
    children: Vec<Child>,
    pub endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdCluster {
    pub async fn start() -> Result<EtcdCluster> {
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> =
            (0..3).map(|_| Ok((free_port()?, free_port()?))).collect::<Result<_>>()?;
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}")).collect();
        let mut children = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let child = Command::new("etcd")
                .args(["--name", &format!("e{i}")])
                .args(["--data-dir", &dir.path().join(format!("e{i}")).display().to_string()])
                .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
                .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-state", "new"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting etcd (Debian package etcd-server)")?;
            children.push(child);
        }
        let endpoints: Vec<String> = ports.iter().map(|(c, _)| format!("http://127.0.0.1:{c}")).collect();
        let cluster = EtcdCluster { children, endpoints, _dir: dir };
        // Ready when every member answers on its own.
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let mut ready = 0;
            for endpoint in &cluster.endpoints {
                if let Ok(mut c) = Client::connect([endpoint.clone()], None).await {
                    if c.put(format!("{PREFIX}ready"), "1", None).await.is_ok() {
                        ready += 1;
                    }
                }
            }
            if ready == cluster.endpoints.len() {
                return Ok(cluster);
            }
            if Instant::now() > until {
                bail!("etcd did not come up");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl EtcdCluster {
    /// The process id of the member that leads now.
    pub async fn leader_pid(&self) -> Result<u32> {
        for (i, endpoint) in self.endpoints.iter().enumerate() {
            let mut c = Client::connect([endpoint.clone()], None).await?;
            let status = c.status().await?;
            let me = status.header().map(|h| h.member_id()).unwrap_or(0);
            if me != 0 && me == status.leader() {
                return Ok(self.children[i].id());
            }
        }
        bail!("no etcd member says it leads")
    }
}

/// `leases` leases, each kept alive on its own stream, `in_flight` keep-alives outstanding at a
/// time, for `window`: how many keep-alives etcd acknowledged.
pub async fn keepalive_load(
    endpoints: &[String],
    leases: usize,
    in_flight: usize,
    window: Duration,
) -> Result<u64> {
    let mut client = Client::connect(endpoints.to_vec(), None).await?;
    let mut streams = Vec::with_capacity(leases);
    for _ in 0..leases {
        let id = client.lease_grant(600, None).await?.id();
        streams.push(client.lease_keep_alive(id).await?);
    }
    let mut groups: Vec<Vec<_>> = (0..in_flight).map(|_| Vec::new()).collect();
    for (i, s) in streams.into_iter().enumerate() {
        groups[i % in_flight].push(s);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for mut group in groups.into_iter().filter(|g| !g.is_empty()) {
        tasks.push(tokio::spawn(async move {
            let mut acked = 0u64;
            'run: while start.elapsed() < window {
                for (keeper, stream) in group.iter_mut() {
                    if keeper.keep_alive().await.is_err() || !matches!(stream.message().await, Ok(Some(_))) {
                        break 'run;
                    }
                    acked += 1;
                    if start.elapsed() >= window {
                        break 'run;
                    }
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

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn owner_key(p: u32) -> String {
    format!("{PREFIX}owner/{p:08}")
}

/// When each partition was taken, by whom.
pub type Acquired = Arc<Mutex<HashMap<u32, (String, Instant, i64)>>>;

/// One worker of the baseline.
pub struct EtcdWorker {
    pub lease: i64,
    pub granted_ttl: i64,
    tasks: Vec<JoinHandle<()>>,
    client: Client,
}

/// `w3` -> session 3, so placement sees the same members as in tenure.
fn session_of(name: &str) -> SessionId {
    SessionId(name.trim_start_matches('w').parse().unwrap_or(0))
}

impl EtcdWorker {
    pub async fn join(
        endpoints: &[String],
        name: &str,
        ttl_s: i64,
        partitions: u32,
        acquired: Acquired,
    ) -> Result<EtcdWorker> {
        let mut client = Client::connect(endpoints.to_vec(), None).await?;
        let grant = client.lease_grant(ttl_s, None).await?;
        let (lease, granted_ttl) = (grant.id(), grant.ttl());
        let mut tasks = Vec::new();
        let (mut keeper, mut replies) = client.lease_keep_alive(lease).await?;
        let every = Duration::from_millis((granted_ttl as u64 * 1000 / 3).max(100));
        tasks.push(tokio::spawn(async move {
            loop {
                if keeper.keep_alive().await.is_err() || replies.message().await.is_err() {
                    return;
                }
                tokio::time::sleep(every).await;
            }
        }));
        client
            .put(format!("{PREFIX}members/{name}"), name, Some(PutOptions::new().with_lease(lease)))
            .await?;
        // Membership changes arrive on a watch; the partition keys are polled every 50 ms (a watch
        // on them floods the client with small messages at 65,536 partitions).
        let mut changes =
            client.watch(format!("{PREFIX}members/"), Some(WatchOptions::new().with_prefix())).await?;
        let (me, mut c) = (name.to_string(), client.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                if let Err(e) = reconcile(&mut c, &me, lease, partitions, &acquired).await {
                    eprintln!("etcd worker {me}: {e}");
                }
                // Wait for a change, then take every change that queued up.
                match tokio::time::timeout(Duration::from_millis(50), changes.message()).await {
                    Ok(Ok(Some(_))) | Err(_) => {}
                    Ok(_) => return,
                }
                while let Some(next) = changes.message().now_or_never() {
                    if !matches!(next, Ok(Some(_))) {
                        break;
                    }
                }
            }
        }));
        Ok(EtcdWorker { lease, granted_ttl, tasks, client })
    }

    /// Stops as a crash would: no keep-alives, no cleanup; the lease runs out.
    pub fn crash(self) {
        for t in &self.tasks {
            t.abort();
        }
    }

    /// Leaves: revoking the lease deletes its keys at once.
    pub async fn leave(mut self) -> Result<()> {
        for t in &self.tasks {
            t.abort();
        }
        self.client.lease_revoke(self.lease).await?;
        Ok(())
    }
}

/// One pass: read members and owners, compute the placement, give up and take partitions.
async fn reconcile(c: &mut Client, me: &str, lease: i64, partitions: u32, acquired: &Acquired) -> Result<()> {
    let members_kv = c.get(format!("{PREFIX}members/"), Some(GetOptions::new().with_prefix())).await?;
    let mut members: Vec<Member> = members_kv
        .kvs()
        .iter()
        .filter_map(|kv| kv.value_str().ok())
        .map(|name| Member { session: session_of(name), name: name.to_string(), weight: 1 })
        .collect();
    members.sort_by_key(|m| m.session);
    let current: Vec<Option<SessionId>> =
        read_owners(c, partitions).await?.iter().map(|o| o.as_deref().map(session_of)).collect();
    let target = place(&members, &current);
    let mine = session_of(me);
    let mut ops = Vec::new();
    for p in 0..partitions as usize {
        let (now, want) = (current[p], target[p]);
        if now == Some(mine) && want != Some(mine) {
            ops.push((p as u32, false));
        } else if now.is_none() && want == Some(mine) {
            ops.push((p as u32, true));
        }
    }
    let results: Vec<Result<()>> = futures::stream::iter(ops)
        .map(|(p, take)| {
            let mut c = c.clone();
            let (me, acquired) = (me.to_string(), acquired.clone());
            async move {
                let key = owner_key(p);
                if take {
                    let txn = Txn::new()
                        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(key, me.clone(), Some(PutOptions::new().with_lease(lease)))]);
                    let reply = c.txn(txn).await?;
                    if reply.succeeded() {
                        let revision = reply.header().map(|h| h.revision()).unwrap_or(0);
                        acquired.lock().unwrap().insert(p, (me, Instant::now(), revision));
                    }
                } else {
                    let txn = Txn::new()
                        .when([Compare::value(key.clone(), CompareOp::Equal, me)])
                        .and_then([TxnOp::delete(key, None)]);
                    c.txn(txn).await?;
                }
                Ok(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The owner of every partition, by worker name, read in pages: one response with 65,536 keys
/// is more than the client's HTTP/2 layer accepts.
async fn read_owners(c: &mut Client, partitions: u32) -> Result<Vec<Option<String>>> {
    let mut table = vec![None; partitions as usize];
    let end = format!("{PREFIX}owner0"); // '0' follows '/': the end of the prefix
    let mut from = format!("{PREFIX}owner/");
    loop {
        let page =
            c.get(from.clone(), Some(GetOptions::new().with_range(end.clone()).with_limit(4096))).await?;
        for kv in page.kvs() {
            let p: usize = kv.key_str()?.rsplit('/').next().unwrap_or("").parse()?;
            if let Some(slot) = table.get_mut(p) {
                *slot = Some(kv.value_str()?.to_string());
            }
        }
        match page.kvs().last() {
            Some(last) if page.more() => from = format!("{}\0", last.key_str()?),
            _ => return Ok(table),
        }
    }
}

/// The owner of every partition, by worker name.
pub async fn owners(endpoints: &[String], partitions: u32) -> Result<Vec<Option<String>>> {
    let mut c = Client::connect(endpoints.to_vec(), None).await?;
    read_owners(&mut c, partitions).await
}

/// Waits until every partition is owned by one of `names` and balanced within one.
pub async fn settle(endpoints: &[String], partitions: u32, names: &[&str], patience: Duration) -> Result<()> {
    let until = Instant::now() + patience;
    loop {
        let table = owners(endpoints, partitions).await?;
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
            bail!("etcd baseline did not settle: complete={complete}, counts {counts:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
