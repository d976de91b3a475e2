//! Worker slots as processes of their own: `tenure nemesis-worker`, started, frozen with
//! SIGSTOP, killed with SIGKILL and restarted by the harness.
//!
//! The child runs the slot task against the harness's store over gRPC
//! ([`RemoteStore`]) and prints one JSON line per record and per change of what it believes;
//! the parent reads them back. Both stamp times on the run's clock: the parent hands the child
//! the clock's origin as a reading of the system-wide monotonic clock, which the two processes
//! share on one machine. A record is printed when its operation has finished, so a process
//! killed mid-operation leaves that operation out of the worker record (the store's journal
//! still has its decision, which is what the fencing checks read).

use super::remote_store::RemoteStore;
use super::workload::{Sink, SlotTask, View};
use super::Clock;
use crate::history::WorkerRecord;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// What a worker process needs to know.
#[derive(Clone, Debug)]
pub struct WorkerProcessArgs {
    pub coordinators: Vec<String>,
    pub name: String,
    /// The harness's fenced store (`host:port`).
    pub store: String,
    /// The loopback address this worker dials the coordinators from (its "host").
    pub dial_from: IpAddr,
    /// The run clock's origin, as nanoseconds of the system's monotonic clock.
    pub epoch_ns: u64,
    pub write_interval: Duration,
    /// Where `ca.pem`, `worker-<name>.pem` and `worker-<name>-key.pem` are (the layout
    /// `tenure certs` writes); `None` for an insecure cluster.
    pub tls_dir: Option<PathBuf>,
    /// Run the partition runner with a handler per partition ([`super::runner_slot`]) instead
    /// of the worker library's event loop.
    pub runner: bool,
}

/// One line of a worker process's output.
#[derive(Debug, Serialize, Deserialize)]
enum Line {
    Record(WorkerRecord),
    View(View),
}

struct StdoutSink;

impl StdoutSink {
    fn print(line: &Line) {
        if let Ok(json) = serde_json::to_string(line) {
            let mut out = std::io::stdout().lock();
            if writeln!(out, "{json}").and_then(|()| out.flush()).is_err() {
                // The harness stopped reading: the run is over, and so is this worker.
                std::process::exit(0);
            }
        }
    }
}

impl Sink for StdoutSink {
    fn record(&self, record: WorkerRecord) {
        StdoutSink::print(&Line::Record(record));
    }
    fn view(&self, view: &View) {
        StdoutSink::print(&Line::View(view.clone()));
    }
}

/// The body of `tenure nemesis-worker`: joins, then works until it is killed.
pub async fn run_worker_process(args: WorkerProcessArgs) -> Result<(), String> {
    let clock = Clock::from_monotonic_ns(args.epoch_ns)?;
    let store = Arc::new(RemoteStore::new(&args.store).map_err(|e| e.to_string())?);
    let tls = match &args.tls_dir {
        Some(dir) => Some(crate::worker::ClientTls::from_files(
            &dir.join("ca.pem"),
            &dir.join(format!("worker-{}.pem", args.name)),
            &dir.join(format!("worker-{}-key.pem", args.name)),
        )?),
        None => None,
    };
    let mut config = crate::worker::WorkerConfig::new(args.coordinators, args.name);
    config.dial_from = Some(args.dial_from);
    config.tls = tls;
    // The harness's requests to act, one JSON line each; bounded, read off the work loop.
    let (actions, requested) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            match serde_json::from_str(&line) {
                Ok(action) => {
                    if actions.send(action).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, %line, "unreadable action"),
            }
        }
    });
    if args.runner {
        return super::runner_slot::run(
            config,
            store,
            Arc::new(StdoutSink),
            clock,
            args.write_interval,
            requested,
        )
        .await;
    }
    let mut task = SlotTask::new(config, store, Arc::new(StdoutSink), clock, args.write_interval);
    task = task.acting_on(requested);
    task.rejoin().await?;
    task.run_checking_before_work().await
}

/// The harness's side of a worker process.
pub(crate) struct ProcessSlot {
    pub(crate) name: String,
    command: Vec<String>,
    binary: PathBuf,
    log: PathBuf,
    running: tokio::sync::Mutex<Option<(Child, JoinHandle<()>)>>,
    view: Arc<Mutex<View>>,
    records: Arc<Mutex<Vec<WorkerRecord>>>,
}

impl ProcessSlot {
    /// Starts the worker process; its stderr goes to `<dir>/<name>.log`.
    pub(crate) fn start(
        binary: &Path,
        dir: &Path,
        args: &WorkerProcessArgs,
        records: Arc<Mutex<Vec<WorkerRecord>>>,
    ) -> Result<ProcessSlot, String> {
        let command = vec![
            "nemesis-worker".to_string(),
            "--coordinators".into(),
            args.coordinators.join(","),
            "--name".into(),
            args.name.clone(),
            "--store".into(),
            args.store.clone(),
            "--dial-from".into(),
            args.dial_from.to_string(),
            "--epoch-ns".into(),
            args.epoch_ns.to_string(),
            "--write-every-ms".into(),
            args.write_interval.as_millis().to_string(),
        ];
        let mut command = command;
        if let Some(dir) = &args.tls_dir {
            command.extend(["--tls-dir".to_string(), dir.display().to_string()]);
        }
        if args.runner {
            command.push("--runner".to_string());
        }
        let slot = ProcessSlot {
            name: args.name.clone(),
            command,
            binary: binary.to_path_buf(),
            log: dir.join(format!("{}.log", args.name)),
            running: tokio::sync::Mutex::new(None),
            view: Arc::new(Mutex::new(View::default())),
            records,
        };
        let running = slot.spawn()?;
        *slot.running.try_lock().expect("not shared yet") = Some(running);
        Ok(slot)
    }

    fn spawn(&self) -> Result<(Child, JoinHandle<()>), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("opening {}: {e}", self.log.display()))?;
        let mut command = Command::new(&self.binary);
        command
            .args(&self.command)
            .env("RUST_LOG", "info")
            // Actions of the application's own accord arrive as lines of JSON.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        super::processes::die_with_parent(&mut command);
        let mut child = command.spawn().map_err(|e| format!("starting {}: {e}", self.binary.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (view, records, name) = (self.view.clone(), self.records.clone(), self.name.clone());
        let reader = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            loop {
                match lines.next_line().await {
                    Ok(Some(line)) => match serde_json::from_str::<Line>(&line) {
                        Ok(Line::Record(r)) => records.lock().expect("worker records poisoned").push(r),
                        Ok(Line::View(v)) => *view.lock().expect("slot view poisoned") = v,
                        Err(e) => tracing::warn!(worker = %name, error = %e, %line, "unreadable worker line"),
                    },
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(worker = %name, error = %e, "cannot read the worker's output");
                        break;
                    }
                }
            }
            // Killed, or gone by itself (see its log): either way it believes nothing now.
            *view.lock().expect("slot view poisoned") = View::default();
        });
        Ok((child, reader))
    }

    /// Asks the process to do `action` (a line on its standard input); it does it between
    /// two rounds of work.
    pub(crate) async fn act(&self, action: super::workload::Action) -> Result<(), String> {
        use tokio::io::AsyncWriteExt;
        let mut running = self.running.lock().await;
        let Some(stdin) = running.as_mut().and_then(|(child, _)| child.stdin.as_mut()) else {
            return Ok(()); // not running (killed): nothing to act on
        };
        let mut line = serde_json::to_string(&action).map_err(|e| e.to_string())?;
        line.push('\n');
        if let Err(e) = stdin.write_all(line.as_bytes()).await {
            tracing::warn!(worker = %self.name, error = %e, "could not ask the worker process to act");
        }
        Ok(())
    }

    /// SIGSTOP for `pause`, then SIGCONT.
    pub(crate) async fn freeze(&self, pause: Duration) {
        self.signal(libc::SIGSTOP).await;
        tokio::time::sleep(pause).await;
        self.signal(libc::SIGCONT).await;
    }

    async fn signal(&self, signal: libc::c_int) {
        let running = self.running.lock().await;
        let Some((child, _)) = running.as_ref() else { return };
        if !super::processes::send_signal(child, signal) {
            tracing::warn!(worker = %self.name, signal, "could not signal the worker process");
        }
    }

    /// SIGKILL; every line it printed is read before this returns, and it believes nothing
    /// any more.
    pub(crate) async fn kill(&self) {
        if let Some((mut child, reader)) = self.running.lock().await.take() {
            let _ = child.kill().await;
            let _ = reader.await;
        }
        *self.view.lock().expect("slot view poisoned") = View::default();
    }

    /// SIGKILL, then a new process (a new session) after `down`.
    pub(crate) async fn crash(&self, down: Duration) -> Result<(), String> {
        self.kill().await;
        tokio::time::sleep(down).await;
        let running = self.spawn()?;
        *self.running.lock().await = Some(running);
        Ok(())
    }

    pub(crate) fn view(&self) -> View {
        self.view.lock().expect("slot view poisoned").clone()
    }
}
