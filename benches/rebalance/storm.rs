//! A join storm: thousands of sessions join a large table at once, as a fleet starting up does.
//!
//! Each session is a client of the public API that behaves as the worker library does: it
//! heartbeats every quarter TTL, follows its ownership stream and gives back what is revoked at
//! once, and opens its stream again when it breaks. Sessions share clients, 500 to a client (a
//! connection to each node), as sessions sharing a few processes would; a `Worker` each would
//! need three connections per session, more descriptors than one process may open at 10,000. Measured: until every session has joined; until the
//! table is owned, balanced within one and nothing is revoking; until every session's heartbeat
//! answer lists exactly what the table gives it (every lease confirmed).

use super::*;
use futures::FutureExt;
use std::sync::atomic::{AtomicBool, Ordering};

/// Sessions that share one client (one connection to each node), as in one process.
const SESSIONS_PER_CLIENT: usize = 500;

/// What each session's latest heartbeat answer renewed: partition -> token.
type Renewed = Arc<Mutex<HashMap<u64, BTreeMap<u32, u64>>>>;

pub(crate) async fn join_storm(table: &mut Table, partitions: u32, sessions: usize) -> Result<()> {
    let label = format!("P={partitions}, {sessions} sessions joining at once");
    let dir = tempfile::tempdir()?;
    let ttl = Duration::from_secs(5);
    // Plain text: 500 sessions share each client here (a worker certificate names one worker).
    let cluster = cluster_with(dir.path(), partitions, ttl, false).await?;
    let clients: Vec<Client> =
        (0..sessions.div_ceil(SESSIONS_PER_CLIENT)).map(|_| cluster.client()).collect();
    let renewed: Renewed = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
    let start = Instant::now();

    let joined: Vec<proto::HeartbeatRequest> = futures::stream::iter(0..sessions)
        .map(|n| {
            let client = clients[n / SESSIONS_PER_CLIENT].clone();
            let (renewed, stop, tasks) = (renewed.clone(), stop.clone(), tasks.clone());
            async move {
                let beat = join_session(client.clone(), format!("storm-{n}")).await?;
                // From its join on, the session renews and gives back what is revoked.
                let watch = tokio::spawn(watch_and_release(client.clone(), beat.clone(), stop.clone()));
                let beats = tokio::spawn(heartbeat_every(client, beat.clone(), ttl / 4, renewed, stop));
                tasks.lock().expect("tasks").extend([watch.abort_handle(), beats.abort_handle()]);
                Ok::<_, anyhow::Error>(beat)
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let all_joined = start.elapsed();
    if joined.len() != sessions {
        bail!("{} of {sessions} sessions joined", joined.len());
    }

    let leader = cluster.leader().context("no leader")?;
    let node = cluster.node(leader).context("the leader stopped")?.node.clone();
    let deadline = start + Duration::from_secs(300);
    let mut settled_at = None;
    let mut confirmed_at = None;
    let mut entries = 0;
    while Instant::now() < deadline && confirmed_at.is_none() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let want: HashMap<u64, BTreeMap<u32, u64>> = {
            let applied = node.state.read().expect("state lock");
            let state = applied.default_table();
            let owned: Vec<usize> = state.sessions().keys().map(|s| state.owned_count(*s)).collect();
            let balanced = owned.iter().max().zip(owned.iter().min()).is_some_and(|(a, b)| a - b <= 1);
            let done = state.sessions().len() == sessions
                && balanced
                && state.partitions().iter().all(|r| r.owner.is_some() && !r.revoking);
            if !done {
                continue;
            }
            entries = applied.last_applied.map_or(0, |l| l.index);
            state
                .sessions()
                .keys()
                .map(|s| (s.0, state.owned_by(*s).into_iter().map(|(p, r)| (p.0, r.token.0)).collect()))
                .collect()
        };
        settled_at.get_or_insert_with(|| start.elapsed());
        let have = renewed.lock().expect("renewed");
        if want.iter().all(|(s, rows)| have.get(s) == Some(rows)) {
            confirmed_at = Some(start.elapsed());
        }
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks.lock().expect("tasks").drain(..) {
        task.abort();
    }
    let secs = |d: Option<Duration>| {
        d.map_or("not within 300 s".to_string(), |d| format!("{:.1} s", d.as_secs_f64()))
    };
    table.figure(format!("{label}: every join answered"), format!("{:.1} s", all_joined.as_secs_f64()));
    table.figure(format!("{label}: owned, balanced, nothing revoking"), secs(settled_at));
    table.figure(format!("{label}: every lease confirmed by a heartbeat"), secs(confirmed_at));
    table.figure(format!("{label}: log entries until settled"), entries.to_string());
    cluster.shutdown().await;
    Ok(())
}

/// Follows a session's ownership stream and releases each batch of revokes at once (one call
/// for what has arrived together), as the worker library does; a stream that breaks is opened
/// again (its snapshot repeats what the session holds, revoking ones included).
async fn watch_and_release(client: Client, beat: proto::HeartbeatRequest, stop: Arc<AtomicBool>) {
    let request = proto::WatchRequest {
        session_id: beat.session_id,
        secret: beat.secret.clone(),
        ..Default::default()
    };
    while !stop.load(Ordering::Relaxed) {
        let opened = client
            .call(|mut c| {
                let request = request.clone();
                async move { c.watch(request).await }
            })
            .await;
        let Ok(mut stream) = opened else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while !stop.load(Ordering::Relaxed) {
            let Ok(Some(first)) = stream.message().await else { break };
            let mut batch = vec![first];
            // What the stream already holds goes in the same release.
            while let Some(Ok(Some(more))) = stream.message().now_or_never() {
                batch.push(more);
            }
            let revoked: Vec<(u32, u64)> = batch
                .iter()
                .filter(|e| e.kind == proto::ownership_event::Kind::Revoking as i32)
                .map(|e| (e.partition, e.token))
                .collect();
            if revoked.is_empty() {
                continue;
            }
            let release = proto::ReleaseRequest {
                session_id: beat.session_id,
                secret: beat.secret.clone(),
                partitions: revoked.iter().map(|r| r.0).collect(),
                tokens: revoked.iter().map(|r| r.1).collect(),
                all: false,
                ..Default::default()
            };
            let _ = client
                .call(|mut c| {
                    let release = release.clone();
                    async move { c.release(release).await }
                })
                .await;
        }
    }
}

/// Heartbeats a session every `every` and records what each answer renewed.
async fn heartbeat_every(
    client: Client,
    beat: proto::HeartbeatRequest,
    every: Duration,
    renewed: Renewed,
    stop: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval(every);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let answer = client
            .call(|mut c| {
                let beat = beat.clone();
                async move { c.heartbeat(beat).await }
            })
            .await;
        if let Ok(answer) = answer {
            let rows = answer.renewed.iter().map(|l| (l.partition, l.token)).collect();
            renewed.lock().expect("renewed").insert(beat.session_id, rows);
        }
    }
}
