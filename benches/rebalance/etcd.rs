//! The baseline: the same job done the way a careful user would on etcd. A 3-member etcd
//! cluster (Debian's `etcd-server`, started here on loopback) holds one key per partition.
//! Each worker has its own client, keeps a lease alive, registers itself under `members/`, and
//! keeps members and owners current from one watch on the whole prefix (no polling). On every
//! change it sees it computes the same placement tenure uses (`tenure::placement::place`, so
//! both designs move the same partitions) and sends what it must do in transactions of up to
//! 64 guarded moves (a delete if it still holds the key, a create under its lease if the key
//! is free; each move a nested transaction, so one lost race fails alone), up to 8 in flight.
//! The key's revision is the fencing token.

use anyhow::{bail, Context, Result};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use futures::FutureExt;
use std::collections::{BTreeSet, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tenure::ids::SessionId;
use tenure::placement::{place, Member};
use tokio::task::{JoinHandle, JoinSet};

const PREFIX: &str = "tb/";
/// Moves per transaction: each is a compare and an operation, and etcd's default
/// `--max-txn-ops` allows 128 operations in one transaction, nested ones counted.
const BATCH: usize = 64;
/// Transactions a worker keeps in flight while it reconciles.
const IN_FLIGHT: usize = 8;

/// Three etcd members on loopback, stopped on drop.
pub struct EtcdCluster {
    children: Vec<Child>,
    pub endpoints: Vec<String>,
    /// Each member's command line, to start it again after a kill.
    commands: Vec<Vec<String>>,
    _dir: tempfile::TempDir,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn(args: &[String]) -> Result<Child> {
    Command::new("etcd")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting etcd (Debian package etcd-server)")
}

/// etcd's own timing: a heartbeat and an election timeout, in milliseconds (its defaults are 100
/// and 1000).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub heartbeat_ms: u64,
    pub election_ms: u64,
}

impl EtcdCluster {
    pub async fn start() -> Result<EtcdCluster> {
        EtcdCluster::start_with(Timing { heartbeat_ms: 100, election_ms: 1000 }).await
    }

    pub async fn start_with(timing: Timing) -> Result<EtcdCluster> {
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> =
            (0..3).map(|_| Ok((free_port()?, free_port()?))).collect::<Result<_>>()?;
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}")).collect();
        let mut commands = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let pairs = [
                ("--name", format!("e{i}")),
                ("--data-dir", dir.path().join(format!("e{i}")).display().to_string()),
                ("--listen-client-urls", format!("http://127.0.0.1:{client}")),
                ("--advertise-client-urls", format!("http://127.0.0.1:{client}")),
                ("--listen-peer-urls", format!("http://127.0.0.1:{peer}")),
                ("--initial-advertise-peer-urls", format!("http://127.0.0.1:{peer}")),
                ("--initial-cluster", initial.join(",")),
                ("--initial-cluster-state", "new".to_string()),
                ("--heartbeat-interval", timing.heartbeat_ms.to_string()),
                ("--election-timeout", timing.election_ms.to_string()),
            ];
            commands.push(pairs.into_iter().flat_map(|(k, v)| [k.to_string(), v]).collect::<Vec<_>>());
        }
        let children = commands.iter().map(|args| spawn(args)).collect::<Result<Vec<_>>>()?;
        let endpoints: Vec<String> = ports.iter().map(|(c, _)| format!("http://127.0.0.1:{c}")).collect();
        let cluster = EtcdCluster { children, endpoints, commands, _dir: dir };
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
        let i = self.leader_other_than(None).await.context("no etcd member says it leads")?;
        Ok(self.children[i].id())
    }

    /// The member (index) that says it leads, skipping `gone`; a member that does not answer
    /// within 100 ms (killed or frozen) is passed over.
    pub async fn leader_other_than(&self, gone: Option<usize>) -> Option<usize> {
        for (i, endpoint) in self.endpoints.iter().enumerate() {
            if Some(i) == gone {
                continue;
            }
            let ask = async {
                let mut c = Client::connect([endpoint.clone()], None).await.ok()?;
                let status = c.status().await.ok()?;
                let me = status.header().map(|h| h.member_id()).unwrap_or(0);
                Some(me != 0 && me == status.leader())
            };
            if let Ok(Some(true)) = tokio::time::timeout(Duration::from_millis(100), ask).await {
                return Some(i);
            }
        }
        None
    }

    /// SIGKILL for member `i`, and waits for it.
    pub fn kill(&mut self, i: usize) {
        let _ = self.children[i].kill();
        let _ = self.children[i].wait();
    }

    /// Starts member `i` again on its data directory, after `kill`.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.children[i] = spawn(&self.commands[i])?;
        Ok(())
    }

    /// SIGSTOP (`pause`) or SIGCONT for member `i`.
    pub fn signal_pause(&self, i: usize, pause: bool) {
        let signal = if pause { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) on a child this cluster started and has not reaped.
        unsafe { libc::kill(self.children[i].id() as libc::pid_t, signal) };
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

use super::Acquired;

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

/// What a worker knows of the cluster, kept current from one watch on the whole prefix: the
/// members and the owner of every partition, as of `revision`.
struct View {
    members: BTreeSet<String>,
    owners: Vec<Option<String>>,
    revision: i64,
}

impl View {
    /// Reads members and owners at one revision, so the watch can start right after it.
    async fn load(c: &mut Client, partitions: u32) -> Result<View> {
        let members_kv = c.get(format!("{PREFIX}members/"), Some(GetOptions::new().with_prefix())).await?;
        let revision = members_kv.header().map(|h| h.revision()).context("no revision")?;
        let members =
            members_kv.kvs().iter().filter_map(|kv| kv.value_str().ok().map(str::to_string)).collect();
        let owners = read_owners_at(c, partitions, Some(revision)).await?;
        Ok(View { members, owners, revision })
    }

    fn apply(&mut self, event: &etcd_client::Event) {
        let Some(kv) = event.kv() else { return };
        let Ok(key) = kv.key_str() else { return };
        let put = event.event_type() == EventType::Put;
        self.revision = self.revision.max(kv.mod_revision());
        if let Some(name) = key.strip_prefix(&format!("{PREFIX}members/")) {
            if put {
                self.members.insert(name.to_string());
            } else {
                self.members.remove(name);
            }
        } else if let Some(p) = key.strip_prefix(&format!("{PREFIX}owner/")) {
            if let Some(slot) = p.parse::<usize>().ok().and_then(|p| self.owners.get_mut(p)) {
                *slot = if put { kv.value_str().ok().map(str::to_string) } else { None };
            }
        }
    }

    /// The partitions `me` should give up (`false`) or take (`true`) now, leaving out those
    /// with a transaction in flight.
    fn moves(&self, me: &str, pending: &HashSet<u32>) -> Vec<(u32, bool)> {
        let members: Vec<Member> = self
            .members
            .iter()
            .map(|name| Member { session: session_of(name), name: name.clone(), weight: 1 })
            .collect();
        let current: Vec<Option<SessionId>> =
            self.owners.iter().map(|o| o.as_deref().map(session_of)).collect();
        let target = place(&members, &current);
        let mine = session_of(me);
        (0..self.owners.len())
            .filter(|p| !pending.contains(&(*p as u32)))
            .filter_map(|p| match (current[p], target[p]) {
                (Some(now), want) if now == mine && want != Some(mine) => Some((p as u32, false)),
                (None, Some(want)) if want == mine => Some((p as u32, true)),
                _ => None,
            })
            .collect()
    }
}

/// The partitions a transaction took, and its revision.
type Committed = (Vec<u32>, i64);

/// One transaction of up to [`BATCH`] moves, each a nested transaction with its own guard, so
/// one partition someone else took first fails alone: a take is a create under the worker's
/// lease if the key does not exist, a give-up a delete if the worker still holds the key.
/// Returns the partitions taken and the revision (their token).
async fn commit(mut c: Client, me: String, lease: i64, batch: Vec<(u32, bool)>) -> Result<Committed> {
    let ops: Vec<TxnOp> = batch
        .iter()
        .map(|&(p, take)| {
            let key = owner_key(p);
            let guarded = if take {
                Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key, me.clone(), Some(PutOptions::new().with_lease(lease)))])
            } else {
                Txn::new()
                    .when([Compare::value(key.clone(), CompareOp::Equal, me.clone())])
                    .and_then([TxnOp::delete(key, None)])
            };
            TxnOp::txn(guarded)
        })
        .collect();
    let reply = c.txn(Txn::new().and_then(ops)).await?;
    let revision = reply.header().map(|h| h.revision()).unwrap_or(0);
    let taken = batch
        .iter()
        .zip(reply.op_responses())
        .filter_map(|(&(p, take), r)| match r {
            TxnOpResponse::Txn(r) if take && r.succeeded() => Some(p),
            _ => None,
        })
        .collect();
    Ok((taken, revision))
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
        let mut view = View::load(&mut client, partitions).await?;
        let mut changes = client
            .watch(PREFIX, Some(WatchOptions::new().with_prefix().with_start_revision(view.revision + 1)))
            .await?;
        let (me, c) = (name.to_string(), client.clone());
        tasks.push(tokio::spawn(async move {
            // Partitions with a move in flight, or committed at a revision the view has not
            // reached yet: a reconcile must not send those again.
            let mut pending: HashSet<u32> = HashSet::new();
            let mut settling: Vec<(i64, Vec<u32>)> = Vec::new();
            let mut in_flight: JoinSet<(Vec<u32>, Result<Committed>)> = JoinSet::new();
            loop {
                settling.retain(|(revision, parts)| {
                    let seen = *revision <= view.revision;
                    if seen {
                        parts.iter().for_each(|p| {
                            pending.remove(p);
                        });
                    }
                    !seen
                });
                // Reconcile on every change seen and every transaction done: send what the view
                // asks for, as far as the in-flight limit allows; the rest is asked for again
                // on the next change.
                let moves = view.moves(&me, &pending);
                for batch in moves.chunks(BATCH).take(IN_FLIGHT.saturating_sub(in_flight.len())) {
                    pending.extend(batch.iter().map(|(p, _)| *p));
                    let parts = batch.iter().map(|(p, _)| *p).collect();
                    let commit = commit(c.clone(), me.clone(), lease, batch.to_vec());
                    in_flight.spawn(async move { (parts, commit.await) });
                }
                tokio::select! {
                    message = changes.message() => {
                        let mut next = message;
                        // Take every change already queued before reconciling again.
                        loop {
                            match next {
                                Ok(Some(reply)) if !reply.canceled() => {
                                    reply.events().iter().for_each(|e| view.apply(e));
                                    let at = reply.header().map_or(0, |h| h.revision());
                                    view.revision = view.revision.max(at);
                                }
                                _ => return,
                            }
                            match changes.message().now_or_never() {
                                Some(more) => next = more,
                                None => break,
                            }
                        }
                    }
                    Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                        let Ok((parts, outcome)) = done else { return };
                        match outcome {
                            Ok((taken, revision)) => {
                                let now = Instant::now();
                                let mut acquired = acquired.lock().unwrap();
                                for p in taken {
                                    acquired.insert(p, (me.clone(), now, revision));
                                }
                                settling.push((revision, parts));
                            }
                            Err(e) => {
                                eprintln!("etcd worker {me}: {e}");
                                settling.push((0, parts));
                            }
                        }
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

/// The owner of every partition, by worker name, read in pages: one response with 65,536 keys
/// is more than the client's HTTP/2 layer accepts.
async fn read_owners_at(c: &mut Client, partitions: u32, at: Option<i64>) -> Result<Vec<Option<String>>> {
    let mut table = vec![None; partitions as usize];
    let end = format!("{PREFIX}owner0"); // '0' follows '/': the end of the prefix
    let mut from = format!("{PREFIX}owner/");
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(4096);
        if let Some(revision) = at {
            options = options.with_revision(revision);
        }
        let page = c.get(from.clone(), Some(options)).await?;
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
    read_owners_at(&mut c, partitions, None).await
}
