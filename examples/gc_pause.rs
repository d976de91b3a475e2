//! The GC-pause story on the real system: a 3-node coordinator in this process, two workers and
//! a store, with a short real TTL. Worker A owns the partition and writes batch-1, then freezes
//! (its heartbeats stop, as in a stop-the-world pause) past its TTL. B is granted the partition
//! with a higher token and writes batch-2. A wakes, does not look at the clock, and writes
//! batch-1-late with the token it had. Without fencing, A's late write wins; with fencing, the
//! store rejects it.
//!
//! Run: `cargo run --example gc_pause`

use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::fence::{FenceStore, MemoryFence};
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::LocalCluster;
use tenure::worker::{Fenced, PartitionHandle, Runner, Worker, WorkerEvent};
use tokio::sync::oneshot;

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

async fn first_assignment(worker: &mut Worker) -> Result<PartitionHandle> {
    let mut events = worker.events().context("events taken")?;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv()).await.context("no assignment")? {
            Some(WorkerEvent::Granted(h)) => return Ok(h),
            Some(_) => continue,
            None => bail!("worker stopped"),
        }
    }
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

    // A is the naive program: it holds on to what it was given and never looks again.
    let mut a = Worker::join(cluster.worker_config("A")).await?;
    let a_handle = first_assignment(&mut a).await?;
    let a_pen = Pen::new(&story, &a_handle).await?;
    story.write("A", &a_pen, "batch-1").await?;

    let paused = Instant::now();
    a.abandon(); // A freezes: no more heartbeats, but its code still holds its pen.
    println!(
        "t={:5.2}s A pauses (stop-the-world), holding token={}",
        story.start.elapsed().as_secs_f64(),
        a_handle.token()
    );

    // B is written the way the library means: a runner, one task per partition.
    let (wrote, b_wrote) = oneshot::channel::<()>();
    let wrote = Arc::new(Mutex::new(Some(wrote)));
    let (stop_b, b_stopped) = oneshot::channel::<()>();
    let b = {
        let (story, wrote) = (story.clone(), wrote.clone());
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
            async {
                let _ = b_stopped.await;
            },
        ))
    };
    tokio::time::timeout(Duration::from_secs(30), b_wrote).await.context("B never wrote")??;

    println!("t={:5.2}s A wakes up and carries on", story.start.elapsed().as_secs_f64());
    story.write("A", &a_pen, "batch-1-late").await?;

    let value = story.value().await?;
    println!("final value: {value}");
    if fencing {
        let highest = story.fenced.highest(PartitionId(0)).await?;
        println!("highest token seen by the store: {}", highest.unwrap_or(FencingToken(0)));
    }
    println!();
    let _ = stop_b.send(());
    b.await??;
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
