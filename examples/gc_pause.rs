//! The GC-pause story on the real system: a 3-node coordinator in this process, two workers on
//! the runner and a store, with a short real TTL. Worker A owns the partition and writes
//! batch-1, then freezes mid-task past its TTL: A runs on a thread and runtime of its own, and
//! the pause blocks that thread, so its heartbeats stop with it, as in a stop-the-world pause.
//! B is granted the partition with a higher token and writes batch-2. A wakes, goes on where it
//! stopped before its runner hears that the lease is gone, and writes batch-1-late with the
//! pen it had. Without fencing, A's late write wins; with fencing, the store rejects it.
//!
//! Run: `cargo run --example gc_pause`

use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::fence::{FenceStore, MemoryFence};
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::LocalCluster;
use tenure::worker::{Assignment, Fenced, PartitionHandle, Runner};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_millis(1000);
const KEY: &[u8] = b"account-42";

/// The naive store: takes every write.
#[derive(Default)]
struct Unfenced(Mutex<HashMap<Vec<u8>, Vec<u8>>>);

/// What a worker writes with: the naive store and its token, or the only value that can write
/// for the partition in the fenced store, made by raising the fence.
enum Pen {
    Unfenced(FencingToken),
    Fenced(Fenced<Arc<MemoryFence>>),
}

impl Pen {
    async fn new(story: &Story, handle: &PartitionHandle) -> Result<Pen> {
        Ok(match story.fencing {
            true => Pen::Fenced(handle.acquire(story.fenced.clone()).await?), // fence before resume
            false => Pen::Unfenced(handle.token()),
        })
    }
}

struct Story {
    start: Instant,
    fencing: bool,
    unfenced: Unfenced,
    fenced: Arc<MemoryFence>,
}

impl Story {
    async fn write(&self, who: &str, pen: &Pen, value: &str) -> Result<()> {
        let t = self.start.elapsed().as_secs_f64();
        let fenced = match pen {
            Pen::Unfenced(token) => {
                self.unfenced.0.lock().unwrap().insert(KEY.to_vec(), value.as_bytes().to_vec());
                println!("t={t:5.2}s ACCEPT {who} token={token} value={value}");
                return Ok(());
            }
            Pen::Fenced(fenced) => fenced,
        };
        let token = fenced.token();
        match fenced.write(KEY, value.as_bytes()).await {
            Ok(()) => println!("t={t:5.2}s ACCEPT {who} token={token} value={value}"),
            Err(tenure::fence::FenceError::Stale { highest, .. }) => {
                println!("t={t:5.2}s REJECT {who} token={token} value={value} (highest seen {highest})")
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    async fn value(&self) -> Result<String> {
        let raw = if self.fencing {
            self.fenced.read(PartitionId(0), KEY).await?
        } else {
            self.unfenced.0.lock().unwrap().get(KEY).cloned()
        };
        Ok(String::from_utf8_lossy(&raw.unwrap_or_default()).into_owned())
    }
}

/// A's runner, on a thread and runtime of its own (A's "machine"): its one task writes
/// batch-1, then stops the whole thread, heartbeats included, until B has written; then it
/// writes batch-1-late with the pen it had, without looking at the lease.
fn start_a(
    story: Arc<Story>,
    config: tenure::worker::WorkerConfig,
    paused: oneshot::Sender<Instant>,
    b_wrote: std::sync::mpsc::Receiver<()>,
    done: oneshot::Sender<()>,
    stop: CancellationToken,
) -> std::thread::JoinHandle<Result<()>> {
    let once = Arc::new(Mutex::new(Some((paused, b_wrote, done))));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async move {
            let handler = move |assignment: Assignment| {
                let (story, once) = (story.clone(), once.clone());
                async move {
                    let Some((paused, b_wrote, done)) = once.lock().unwrap().take() else {
                        assignment.stopped().await; // granted again later: nothing more to tell
                        return Ok(());
                    };
                    let pen = Pen::new(&story, assignment.handle()).await?;
                    story.write("A", &pen, "batch-1").await?;
                    println!(
                        "t={:5.2}s A pauses (stop-the-world), holding token={}",
                        story.start.elapsed().as_secs_f64(),
                        assignment.token()
                    );
                    let _ = paused.send(Instant::now());
                    // The pause: this thread stops, and A's heartbeats with it.
                    b_wrote.recv_timeout(Duration::from_secs(30)).context("B never wrote")?;
                    // Awake, A goes on where it stopped, before its runner hears that the lease is gone.
                    println!("t={:5.2}s A wakes up and carries on", story.start.elapsed().as_secs_f64());
                    story.write("A", &pen, "batch-1-late").await?;
                    let _ = done.send(());
                    assignment.stopped().await;
                    Ok::<(), anyhow::Error>(())
                }
            };
            Runner::new(config).run(handler, stop.cancelled_owned()).await?;
            Ok(())
        })
    })
}

async fn run(fencing: bool) -> Result<String> {
    println!("== fencing {}", if fencing { "on" } else { "off" });
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(3, dir.path(), |c| {
        c.partition_count = 1;
        c.lease_ttl = TTL;
        c.election_timeout = Duration::from_millis(300);
        c.raft_heartbeat_interval = Duration::from_millis(50);
    })
    .await?;
    cluster.wait_for_leader(Duration::from_secs(10)).await.context("no leader")?;
    let story = Arc::new(Story {
        start: Instant::now(),
        fencing,
        unfenced: Unfenced::default(),
        fenced: Arc::new(MemoryFence::default()),
    });

    // A owns the partition first, writes, and is paused in the middle of its task.
    let (paused, a_paused) = oneshot::channel();
    let (wrote, b_wrote) = std::sync::mpsc::channel::<()>();
    let (done, a_done) = oneshot::channel();
    let stop_a = CancellationToken::new();
    let a = start_a(story.clone(), cluster.worker_config("A"), paused, b_wrote, done, stop_a.clone());
    let paused = tokio::time::timeout(Duration::from_secs(30), a_paused).await.context("A never wrote")??;

    // B joins while A is paused; once A's lease has run out, B's task is granted the partition.
    let wrote = Arc::new(Mutex::new(Some(wrote)));
    let stop_b = CancellationToken::new();
    let b = {
        let story = story.clone();
        let runner = Runner::new(cluster.worker_config("B"));
        tokio::spawn(runner.run(
            move |assignment| {
                let (story, wrote) = (story.clone(), wrote.clone());
                async move {
                    println!(
                        "t={:5.2}s B granted the partition with token={} ({:.2}s after A paused)",
                        story.start.elapsed().as_secs_f64(),
                        assignment.token(),
                        paused.elapsed().as_secs_f64()
                    );
                    let pen = Pen::new(&story, assignment.handle()).await?;
                    story.write("B", &pen, "batch-2").await?;
                    if let Some(wrote) = wrote.lock().unwrap().take() {
                        let _ = wrote.send(());
                    }
                    assignment.stopped().await;
                    Ok::<(), anyhow::Error>(())
                }
            },
            stop_b.clone().cancelled_owned(),
        ))
    };
    tokio::time::timeout(Duration::from_secs(30), a_done).await.context("A never woke")??;

    let value = story.value().await?;
    println!("final value: {value}");
    if fencing {
        let highest = story.fenced.highest(PartitionId(0)).await?;
        println!("highest token seen by the store: {}", highest.unwrap_or(FencingToken(0)));
    }
    println!();
    stop_a.cancel();
    stop_b.cancel();
    b.await??;
    tokio::task::spawn_blocking(move || a.join()).await?.map_err(|_| anyhow::anyhow!("A panicked"))??;
    cluster.shutdown().await;
    Ok(value)
}

#[tokio::main]
async fn main() -> Result<()> {
    let without = run(false).await?;
    let with = run(true).await?;
    println!(
        "without fencing the stale write won ({without}); with fencing the new owner's write stands ({with})"
    );
    if without != "batch-1-late" || with != "batch-2" {
        bail!("unexpected outcome: {without} / {with}");
    }
    Ok(())
}
