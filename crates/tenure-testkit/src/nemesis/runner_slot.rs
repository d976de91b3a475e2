//! A worker slot that runs the partition [`Runner`], as an application built on it does: one
//! handler per owned partition, which raises the partition's fence, then works and writes
//! until it is told to stop, and trusts the runner to stop it in time.
//!
//! The handler does not look at the lease before it writes. What it believed is what the
//! runner promised: that its task runs only while the grant is this worker's. So each write is
//! recorded as believed until the grant's last local deadline the handler saw, even when the
//! library has already forgotten the grant, and the history checker judges the runner's
//! promise, not the handler's caution: a runner that gave a partition back before its task
//! ended shows as a belief that outlived its grant. The task's end (returned after a stop, or
//! aborted) closes the belief with a `Released` or `Lost` record.
//!
//! After a stop the handler writes a few times more, as one finishing its batch would, so a
//! release sent before the task ended would be seen. As in the plain worker slot, a write is
//! checked, then made one write interval later, so a
//! SIGSTOP in between makes it genuinely late. Leave shuts the runner down (it stops every
//! task, then leaves) and Drop drops the running future; either way a new runner joins under
//! the same name. A release of one's own accord is a running task giving its partition back
//! ([`Assignment::give_back`]).

use super::workload::{Action, Sink, View};
use super::Clock;
use crate::fence::{FenceError, FenceStore};
use crate::history::{WorkerOp, WorkerRecord};
use crate::ids::PartitionId;
use crate::worker::{Assignment, Runner, RunnerStatus, WorkerConfig};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Writes a handler still makes after it was told to stop (finishing its batch, saving a
/// checkpoint), a few write intervals: the runner must not give the partition back until they
/// are done.
const DRAIN_WRITES: u32 = 3;

/// What every handler of the slot shares.
struct Work<S> {
    name: String,
    store: Arc<S>,
    sink: Arc<dyn Sink>,
    clock: Clock,
    interval: Duration,
    /// The assignments whose handlers have raised their fence and not yet ended.
    live: Mutex<BTreeMap<PartitionId, Assignment>>,
}

/// Runs runners under `config`'s name until one meets an error it cannot retry; `actions` are
/// the harness's requests to act of the application's own accord.
pub(crate) async fn run<S: FenceStore + 'static>(
    config: WorkerConfig,
    store: Arc<S>,
    sink: Arc<dyn Sink>,
    clock: Clock,
    interval: Duration,
    mut actions: mpsc::Receiver<Action>,
) -> Result<(), String> {
    let work = Arc::new(Work {
        name: config.name.clone(),
        store,
        sink: sink.clone(),
        clock,
        interval,
        live: Mutex::new(BTreeMap::new()),
    });
    let mut listening = true;
    loop {
        let runner = Runner::new(config.clone())
            .restart_backoff(Duration::from_millis(50), Duration::from_secs(1))
            .rejoin_backoff(Duration::from_millis(50), Duration::from_secs(1));
        let publisher = tokio::spawn(publish(runner.status(), sink.clone()));
        let shutdown = CancellationToken::new();
        let handler = {
            let work = work.clone();
            move |assignment: Assignment| work.clone().partition(assignment)
        };
        let mut running = Box::pin(runner.run(handler, shutdown.clone().cancelled_owned()));
        let ended = loop {
            tokio::select! {
                ended = &mut running => break Some(ended),
                action = actions.recv(), if listening => match action {
                    Some(Action::Leave) => shutdown.cancel(),
                    Some(Action::Drop) => break None,
                    Some(Action::Release) => work.give_one_back(),
                    None => listening = false,
                },
            }
        };
        drop(running); // a dropped runner: its tasks are aborted, its worker leaves in the background
        publisher.abort();
        sink.view(&View::default());
        match ended {
            Some(Ok(report)) => {
                tracing::info!(worker = %work.name, ?report, "the runner left; starting another")
            }
            Some(Err(e)) => return Err(format!("{}: {e}", work.name)),
            None => tracing::info!(worker = %work.name, "the runner was dropped; starting another"),
        }
    }
}

/// Reports every change of what the runner runs as the slot's view.
async fn publish(mut status: RunnerStatus, sink: Arc<dyn Sink>) {
    loop {
        let now = status.now();
        sink.view(&View { session: now.session, believed: now.running });
        if !status.changed().await {
            return;
        }
    }
}

impl<S: FenceStore + 'static> Work<S> {
    /// One partition's handler: raise the fence, then check, work and write until stopped.
    async fn partition(self: Arc<Self>, assignment: Assignment) -> Result<(), String> {
        let mut deadline = assignment.handle().valid_until();
        let started = self.clock.now_ns();
        let fenced = match assignment.acquire(self.store.clone()).await {
            Ok(fenced) => {
                self.record(&assignment, WorkerOp::Acquired, started, deadline);
                fenced
            }
            Err(e) => {
                // Only the fence's refusal is a refusal; a store that could not be reached
                // decided nothing (the handler runs again).
                if matches!(e, FenceError::Stale { .. }) {
                    self.record(&assignment, WorkerOp::Refused, started, deadline);
                }
                return Err(e.to_string());
            }
        };
        // From here until the task is gone, this handler believes; its end is recorded however
        // it comes (returned, or dropped by an abort).
        self.live
            .lock()
            .expect("live assignments poisoned")
            .insert(assignment.partition(), assignment.clone());
        let mut end = EndOfBelief { work: self.clone(), assignment: assignment.clone(), op: WorkerOp::Lost };
        let (mut writes, mut draining) = (0u64, DRAIN_WRITES);
        loop {
            if assignment.is_stopped() {
                if draining == 0 {
                    break;
                }
                draining -= 1;
            }
            let checked_at = self.clock.now_ns();
            deadline = assignment.handle().valid_until().or(deadline);
            tokio::time::sleep(self.interval).await;
            writes += 1;
            let value = format!("{}:{}:{writes}", self.name, assignment.token());
            match fenced.write(b"k", value.as_bytes()).await {
                Ok(()) => self.record(&assignment, WorkerOp::Wrote, checked_at, deadline),
                Err(e) => {
                    if matches!(e, FenceError::Stale { .. }) {
                        self.record(&assignment, WorkerOp::Refused, checked_at, deadline);
                    }
                    return Err(e.to_string());
                }
            }
        }
        end.op = WorkerOp::Released;
        Ok(())
    }

    /// A release of the application's own accord: one running task gives its partition back.
    fn give_one_back(&self) {
        let live = self.live.lock().expect("live assignments poisoned");
        match live.values().find(|a| !a.is_stopped()) {
            Some(assignment) => assignment.give_back(),
            None => tracing::info!(worker = %self.name, "no running task to give its partition back"),
        }
    }

    fn record(&self, assignment: &Assignment, op: WorkerOp, start_ns: u64, believed_until: Option<Instant>) {
        self.sink.record(WorkerRecord {
            worker: self.name.clone(),
            session: assignment.session(),
            partition: assignment.partition(),
            token: assignment.token(),
            op,
            start_ns,
            end_ns: self.clock.now_ns(),
            believed_until_ns: believed_until.map(|t| self.clock.at_ns(t)),
        });
    }
}

/// Records the end of a handler's belief when the handler is dropped: `Released` after it
/// returned on a stop, `Lost` when the runner aborted it.
struct EndOfBelief<S: FenceStore + 'static> {
    work: Arc<Work<S>>,
    assignment: Assignment,
    op: WorkerOp,
}

impl<S: FenceStore + 'static> Drop for EndOfBelief<S> {
    fn drop(&mut self) {
        let mut live = self.work.live.lock().expect("live assignments poisoned");
        if live.get(&self.assignment.partition()).is_some_and(|a| a.token() == self.assignment.token()) {
            live.remove(&self.assignment.partition());
        }
        drop(live);
        let now = self.work.clock.now_ns();
        self.work.record(&self.assignment, self.op, now, None);
    }
}
