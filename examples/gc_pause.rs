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
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tenure::fence::{FenceStore, MemoryFence};
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::LocalCluster;
use tenure::worker::{PartitionHandle, Worker, WorkerEvent};

const TTL: Duration = Duration::from_millis(1000);
const KEY: &[u8] = b"account-42";

/// The naive store: takes every write.
#[derive(Default)]
struct Unfenced(Mutex<HashMap<Vec<u8>, Vec<u8>>>);

struct Story {
    start: Instant,
    fencing: bool,
    unfenced: Unfenced,
    fenced: MemoryFence,
}

impl Story {
    async fn write(&self, who: &str, handle: &PartitionHandle, value: &str) -> Result<()> {
        let t = self.start.elapsed().as_secs_f64();
        let token = handle.token();
        if !self.fencing {
            self.unfenced.0.lock().unwrap().insert(KEY.to_vec(), value.as_bytes().to_vec());
            println!("t={t:5.2}s ACCEPT {who} token={token} value={value}");
            return Ok(());
        }
        match self.fenced.write(handle.partition(), token, KEY, value.as_bytes()).await {
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
    let story = Story {
        start: Instant::now(),
        fencing,
        unfenced: Unfenced::default(),
        fenced: MemoryFence::default(),
    };

    let mut a = Worker::join(cluster.worker_config("A")).await?;
    let a_handle = first_assignment(&mut a).await?;
    if fencing {
        a_handle.acquire(&story.fenced).await?;
    }
    story.write("A", &a_handle, "batch-1").await?;

    let paused = Instant::now();
    a.abandon(); // A freezes: no more heartbeats, but its code still holds the handle.
    println!(
        "t={:5.2}s A pauses (stop-the-world), holding token={}",
        story.start.elapsed().as_secs_f64(),
        a_handle.token()
    );

    let mut b = Worker::join(cluster.worker_config("B")).await?;
    let b_handle = first_assignment(&mut b).await?;
    println!(
        "t={:5.2}s B granted the partition with token={} ({:.2}s after A paused)",
        story.start.elapsed().as_secs_f64(),
        b_handle.token(),
        paused.elapsed().as_secs_f64()
    );
    if fencing {
        b_handle.acquire(&story.fenced).await?; // fence before resume
    }
    story.write("B", &b_handle, "batch-2").await?;

    println!("t={:5.2}s A wakes up and carries on", story.start.elapsed().as_secs_f64());
    story.write("A", &a_handle, "batch-1-late").await?;

    let value = story.value().await?;
    println!("final value: {value}");
    if fencing {
        let highest = story.fenced.highest(PartitionId(0)).await?;
        println!("highest token seen by the store: {}", highest.unwrap_or(FencingToken(0)));
    }
    println!();
    b.leave().await?;
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
