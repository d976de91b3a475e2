//! The partition runner on a real cluster, judged from a journal of its tasks: when each one
//! started and ended, per partition, and what the fenced store said to its writes.
//!
//! What must hold, whatever the path (a graceful move, a task that ignores its stop signal, a
//! handler that fails, a session lost to a partition of the network): for each partition, a
//! task ends before the next one starts, tokens grow from task to task, and no write of a
//! task that was stopped in time is refused by the store. A task may also give its partition
//! back of its own accord; the same must hold.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tenure::fence::{FenceError, MemoryFence};
use tenure::ids::{FencingToken, PartitionId};
use tenure::local_cluster::LocalCluster;
use tenure::worker::{Assignment, RunReport, Runner, RunnerState};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
struct Span {
    runner: &'static str,
    partition: u32,
    token: u64,
    start: Instant,
    end: Option<Instant>,
}

/// Every task any runner of the test started, and what the store refused.
#[derive(Clone, Default)]
struct Journal {
    spans: Arc<Mutex<Vec<Span>>>,
    refused: Arc<AtomicU64>,
    store: Arc<MemoryFence>,
}

/// Marks its span ended when dropped: on return, on error and on abort alike.
struct Open {
    spans: Arc<Mutex<Vec<Span>>>,
    index: usize,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.spans.lock().unwrap()[self.index].end = Some(Instant::now());
    }
}

impl Journal {
    fn begin(&self, runner: &'static str, a: &Assignment) -> Open {
        let mut spans = self.spans.lock().unwrap();
        let span =
            Span { runner, partition: a.partition().0, token: a.token().0, start: Instant::now(), end: None };
        spans.push(span);
        Open { spans: self.spans.clone(), index: spans.len() - 1 }
    }

    fn noted<T>(&self, result: Result<T, FenceError>) -> Result<T, FenceError> {
        if result.is_err() {
            self.refused.fetch_add(1, Ordering::SeqCst);
        }
        result
    }

    /// Partitions a task of `runner` is running for now.
    fn running(&self, runner: &str) -> usize {
        let spans = self.spans.lock().unwrap();
        spans.iter().filter(|s| s.runner == runner && s.end.is_none()).count()
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// One task at a time per partition, under growing tokens (a restart keeps its token).
    fn assert_one_task_at_a_time(&self) {
        let mut by_partition: BTreeMap<u32, Vec<Span>> = BTreeMap::new();
        for span in self.spans() {
            by_partition.entry(span.partition).or_default().push(span);
        }
        for (partition, mut spans) in by_partition {
            spans.sort_by_key(|s| s.start);
            for pair in spans.windows(2) {
                let (before, after) = (&pair[0], &pair[1]);
                let ended = before
                    .end
                    .unwrap_or_else(|| panic!("p{partition}: {before:?} still runs beside {after:?}"));
                assert!(ended <= after.start, "p{partition}: {before:?} overlaps {after:?}");
                assert!(
                    before.token <= after.token,
                    "p{partition}: token went back from {before:?} to {after:?}"
                );
            }
        }
    }

    fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }
}

/// A handler that writes until told to stop, then takes a moment to checkpoint and returns.
fn polite(
    runner: &'static str,
    journal: Journal,
) -> impl Fn(Assignment) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), FenceError>> + Send>>
       + Send
       + Sync
       + 'static {
    move |a: Assignment| {
        let journal = journal.clone();
        Box::pin(async move {
            let _open = journal.begin(runner, &a);
            let fenced = journal.noted(a.acquire(journal.store.clone()).await)?;
            let mut n = 0u64;
            while !a.is_stopped() {
                journal.noted(fenced.write(b"n", &n.to_le_bytes()).await)?;
                n += 1;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                    _ = a.stopped() => {}
                }
            }
            // Checkpointing takes a while; the partition must still be this task's when it lands.
            tokio::time::sleep(Duration::from_millis(50)).await;
            journal.noted(fenced.save_checkpoint(&n.to_le_bytes()).await)
        })
    }
}

/// A runner on its own task, stopped by the returned sender.
fn spawn<H, Fut>(runner: Runner, handler: H) -> (oneshot::Sender<()>, JoinHandle<RunReport>)
where
    H: Fn(Assignment) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), FenceError>> + Send + 'static,
{
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.await;
        };
        runner.run(handler, shutdown).await.expect("the runner ends cleanly")
    });
    (stop, run)
}

async fn stop(handle: (oneshot::Sender<()>, JoinHandle<RunReport>)) -> RunReport {
    let _ = handle.0.send(());
    tokio::time::timeout(PATIENCE, handle.1).await.expect("the runner stops in time").expect("no panic")
}

async fn running(journal: &Journal, runner: &str, n: usize) {
    eventually(&format!("{runner} runs {n} partitions"), || async {
        (journal.running(runner) == n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_partition_is_released_only_after_its_task_returned() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let journal = Journal::default();
    let runner_a = Runner::new(c.worker_config("a")).drain_bound(PATIENCE);
    let status_a = runner_a.status();
    assert_eq!(status_a.now(), RunnerState::default(), "nothing runs before run()");
    let a = spawn(runner_a, polite("a", journal.clone()));
    running(&journal, "a", 24).await;

    // b joins: half of a's partitions move, each only after a's task checkpointed and returned.
    let b = spawn(Runner::new(c.worker_config("b")).drain_bound(PATIENCE), polite("b", journal.clone()));
    settled(&c, 2).await;
    running(&journal, "b", 12).await;
    running(&journal, "a", 12).await;
    // a's status names its session and exactly the partitions whose tasks run, with the
    // tokens the table gives them.
    let table = c.status().await.unwrap();
    eventually("a's status shows its 12 tasks", || async {
        (status_a.now().running.len() == 12).then_some(())
    })
    .await;
    let state = status_a.now();
    let session = state.session.expect("a serves a session");
    let owned: BTreeMap<PartitionId, FencingToken> = table
        .partitions
        .iter()
        .filter(|r| r.owner == session.0)
        .map(|r| (PartitionId(r.partition), FencingToken(r.token)))
        .collect();
    assert_eq!(state.running, owned, "a's status against the table");
    journal.assert_one_task_at_a_time();
    assert_eq!(
        journal.refused(),
        0,
        "a stopped task's checkpoint was refused: the partition moved too early"
    );

    // a shuts down: its tasks checkpoint, then it leaves and b takes everything.
    let report = stop(a).await;
    assert_eq!(status_a.now(), RunnerState::default(), "a stopped runner runs nothing");
    assert_eq!((report.sessions, report.granted, report.drained), (1, 24, 24), "{report:?}");
    assert_eq!((report.cut_short, report.lost, report.failures), (0, 0, 0), "{report:?}");
    settled(&c, 1).await;
    running(&journal, "b", 24).await;
    journal.assert_one_task_at_a_time();
    assert_eq!(journal.refused(), 0);

    let report = stop(b).await;
    assert_eq!((report.granted, report.drained, report.cut_short), (24, 24, 0), "{report:?}");
    journal.assert_one_task_at_a_time();
    assert_eq!(journal.refused(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_ignores_its_stop_is_aborted_at_the_drain_bound_before_the_release() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let journal = Journal::default();
    let stubborn = {
        let journal = journal.clone();
        move |a: Assignment| {
            let journal = journal.clone();
            async move {
                let _open = journal.begin("a", &a);
                let fenced = journal.noted(a.acquire(journal.store.clone()).await)?;
                loop {
                    journal.noted(fenced.write(b"n", b"on and on").await)?;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    };
    let bound = Duration::from_millis(300);
    let a = spawn(Runner::new(c.worker_config("a")).drain_bound(bound), stubborn);
    running(&journal, "a", 24).await;

    let b = spawn(Runner::new(c.worker_config("b")), polite("b", journal.clone()));
    settled(&c, 2).await;
    running(&journal, "b", 12).await;
    running(&journal, "a", 12).await;
    // Every moved task was aborted before its partition was released: b never refused, a never
    // wrote under a stale token.
    journal.assert_one_task_at_a_time();
    assert_eq!(journal.refused(), 0);

    let report = stop(a).await;
    assert_eq!((report.granted, report.drained, report.cut_short, report.lost), (24, 0, 24, 0), "{report:?}");
    running(&journal, "b", 24).await;
    journal.assert_one_task_at_a_time();
    assert_eq!(journal.refused(), 0);
    stop(b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_or_panicking_handler_runs_again_under_the_same_grant() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let journal = Journal::default();
    let attempts: Arc<Mutex<BTreeMap<PartitionId, u32>>> = Default::default();
    let flaky = {
        let (journal, attempts) = (journal.clone(), attempts.clone());
        move |a: Assignment| {
            let (journal, attempts) = (journal.clone(), attempts.clone());
            async move {
                let _open = journal.begin("a", &a);
                let attempt = {
                    let mut attempts = attempts.lock().unwrap();
                    let n = attempts.entry(a.partition()).or_default();
                    *n += 1;
                    *n
                };
                match attempt {
                    1 => return Err(FenceError::Backend("the first attempt fails".into())),
                    2 => panic!("the second attempt panics"),
                    _ => {}
                }
                a.stopped().await;
                Ok(())
            }
        }
    };
    let runner = Runner::new(c.worker_config("a"))
        .restart_backoff(Duration::from_millis(10), Duration::from_millis(40));
    let a = spawn(runner, flaky);
    running(&journal, "a", 24).await;
    assert!(attempts.lock().unwrap().values().all(|n| *n == 3), "{attempts:?}");
    let tokens: Vec<_> = journal.spans().iter().map(|s| (s.partition, s.token)).collect();
    let report = stop(a).await;
    assert_eq!((report.granted, report.failures, report.drained), (24, 48, 24), "{report:?}");
    // Each partition's three runs were under its one grant.
    let mut per_partition: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for (p, t) in tokens {
        per_partition.entry(p).or_default().push(t);
    }
    assert!(
        per_partition.values().all(|t| t.len() == 3 && t.iter().all(|x| *x == t[0])),
        "{per_partition:?}"
    );
    journal.assert_one_task_at_a_time();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_lost_to_a_network_partition_aborts_its_tasks_and_is_joined_again() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let c = LocalCluster::start_behind_proxies(3, dir.path(), fast).await.expect("cluster starts");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    let journal = Journal::default();
    let me = IpAddr::V4(Ipv4Addr::new(127, 0, 2, 1));
    let mut config = c.worker_config("a");
    config.dial_from = Some(me);
    let runner = Runner::new(config).rejoin_backoff(Duration::from_millis(50), Duration::from_millis(200));
    let a = spawn(runner, polite("a", journal.clone()));
    running(&journal, "a", 24).await;
    let first = c.status().await.expect("status").sessions[0].id;

    // Cut the worker off: its leases run out locally (tasks aborted at once), then the
    // coordinator ends the session.
    for id in c.ids() {
        c.proxy(id).expect("proxied").block(&[me]);
    }
    running(&journal, "a", 0).await;
    eventually("the cut-off session ends", || async {
        c.status().await.ok().filter(|s| s.sessions.is_empty()).map(|_| ())
    })
    .await;
    for id in c.ids() {
        c.proxy(id).expect("proxied").heal();
    }

    // The runner hears its session is gone and joins again; every partition runs once more.
    let status = settled(&c, 1).await;
    assert_ne!(status.sessions[0].id, first, "a new session");
    running(&journal, "a", 24).await;
    journal.assert_one_task_at_a_time();
    let spans = journal.spans();
    for p in 0..24u32 {
        let tokens: Vec<u64> = spans.iter().filter(|s| s.partition == p).map(|s| s.token).collect();
        assert!(tokens.len() == 2 && tokens[0] < tokens[1], "p{p}: {tokens:?}");
    }

    let report = stop(a).await;
    assert_eq!((report.sessions, report.granted, report.lost), (2, 48, 24), "{report:?}");
    assert_eq!(report.session_ends.len(), 1, "{report:?}");
    assert!(!report.session_ends[0].is_own_doing());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_its_task_gives_back_is_released_only_after_the_task_returned() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let journal = Journal::default();
    let (given, finished) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let handler = {
        let (polite, given, finished) =
            (Arc::new(polite("a", journal.clone())), given.clone(), finished.clone());
        move |a: Assignment| {
            let (polite, given, finished) = (polite.clone(), given.clone(), finished.clone());
            async move {
                // The first task of p3 gives its partition back at once; it still checkpoints
                // before it returns, and that checkpoint must land.
                if a.partition() != PartitionId(3) || given.fetch_add(1, Ordering::SeqCst) > 0 {
                    return polite(a).await;
                }
                a.give_back();
                a.give_back(); // asking twice changes nothing
                polite(a).await?;
                finished.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        }
    };
    let a = spawn(Runner::new(c.worker_config("a")).drain_bound(PATIENCE), handler);
    // The only worker is granted p3 again, under a new grant.
    eventually("p3 runs a second time", || async {
        let spans = journal.spans();
        let p3: Vec<&Span> = spans.iter().filter(|s| s.partition == 3).collect();
        (p3.len() == 2 && p3[1].start > p3[0].end?).then_some(())
    })
    .await;
    running(&journal, "a", 24).await;
    journal.assert_one_task_at_a_time();
    assert_eq!(journal.refused(), 0, "the given-back task's checkpoint was refused: released too early");
    assert_eq!(finished.load(Ordering::SeqCst), 1, "the given-back task did not finish its checkpoint");
    let p3: Vec<u64> = journal.spans().iter().filter(|s| s.partition == 3).map(|s| s.token).collect();
    assert!(p3[0] < p3[1], "p3 came back under a new token: {p3:?}");

    let report = stop(a).await;
    assert_eq!((report.granted, report.drained, report.cut_short), (25, 25, 0), "{report:?}");
    journal.assert_one_task_at_a_time();
    assert_eq!(journal.refused(), 0);
}
