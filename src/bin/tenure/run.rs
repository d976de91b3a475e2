//! `tenure run -- CMD ARGS`: one child process per owned partition, for programs in any
//! language.
//!
//! The worker library's runner does the owning; this module only maps its tasks onto child
//! processes. Each child learns its grant from its environment (`TENURE_PARTITION`,
//! `TENURE_TOKEN`, `TENURE_HASH_START`/`TENURE_HASH_END` inclusive, `TENURE_LEASE_TTL_MS`,
//! `TENURE_PARTITION_COUNT`, `TENURE_WORKER`) and writes with the token to a store that fences.
//!
//! The invariant, the runner's own: a partition is released only once its child has exited.
//! On revoke (or on SIGTERM/SIGINT to `tenure run`) the child gets SIGTERM and the drain bound
//! to exit, then SIGKILL; on loss it gets SIGKILL at once. Each child leads a process group of
//! its own and the signals go to the group, so what it started dies with it. A child that exits non-zero runs
//! again after a backoff; one that exits 0 is done, and its partition stays owned, idle.
//!
//! Each step is one line on stdout: `START`, `TERM`, `EXIT`, `KILL`, for scripts and tests.

use super::ClientTlsArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::time::Duration;
use tenure::worker::{Assignment, Runner, WorkerConfig};
use tokio::process::{Child, Command};

#[derive(Args)]
pub struct RunArgs {
    /// Coordinator addresses (host:port), comma separated.
    #[arg(long, env = "TENURE_COORDINATORS", value_delimiter = ',', required = true)]
    coordinators: Vec<String>,
    /// The worker's stable name.
    #[arg(long, env = "TENURE_WORKER")]
    name: String,
    /// The namespace (job) to join; the cluster's `default` one if not given.
    #[arg(long, env = "TENURE_NAMESPACE", default_value = "")]
    namespace: String,
    /// The worker's share of partitions relative to others.
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// How long a child has to exit after SIGTERM before it gets SIGKILL (never past the
    /// lease's local deadline).
    #[arg(long, default_value_t = 10_000)]
    drain_ms: u64,
    /// How long leaving may take on shutdown, once every child has exited.
    #[arg(long, default_value_t = 5_000)]
    shutdown_ms: u64,
    /// The first wait before a child that failed runs again; it doubles up to 30 s.
    #[arg(long, default_value_t = 1_000)]
    restart_ms: u64,
    #[command(flatten)]
    tls: ClientTlsArgs,
    /// The command to run per partition, and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

pub async fn run(args: RunArgs) -> Result<()> {
    let Some((program, program_args)) = args.command.split_first() else {
        bail!("give the command to run after --");
    };
    // A command that cannot start would fail on every partition, forever: refuse it before
    // taking any partition, and run exactly the file that was checked.
    let program = executable(program)?;
    let mut config = WorkerConfig::new(args.coordinators, args.name.clone());
    config.weight = args.weight;
    config.namespace = args.namespace.clone();
    config.tls = args.tls.load()?;
    let restart = Duration::from_millis(args.restart_ms.max(1));
    let runner = Runner::new(config)
        .drain_bound(Duration::from_millis(args.drain_ms))
        .shutdown_bound(Duration::from_millis(args.shutdown_ms))
        .restart_backoff(restart, Duration::from_secs(30).max(restart));
    let child = ChildSpec { program, args: program_args.to_vec(), worker: args.name };
    let report = runner
        .run(
            move |assignment| {
                let child = child.clone();
                async move { child.supervise(assignment).await }
            },
            stop_signal(),
        )
        .await
        .context("running the partitions")?;
    println!(
        "STOPPED sessions={} granted={} drained={} killed_at_bound={} lost={} failed={}",
        report.sessions, report.granted, report.drained, report.cut_short, report.lost, report.failures
    );
    Ok(())
}

/// Where `program` would be run from: itself if it names a path, else the first match on
/// `PATH`; an error if that is not an executable file.
fn executable(program: &str) -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |path: &std::path::Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let path = std::path::PathBuf::from(program);
        if !runnable(&path) {
            bail!("cannot run {program}: it is not an executable file");
        }
        return Ok(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| runnable(candidate))
        .with_context(|| format!("cannot run {program}: no executable of that name on PATH"))
}

/// SIGINT or SIGTERM: stop every child, then leave.
async fn stop_signal() {
    let terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    match terminate {
        Ok(mut terminate) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[derive(Clone)]
struct ChildSpec {
    program: std::path::PathBuf,
    args: Vec<String>,
    worker: String,
}

impl ChildSpec {
    /// One run of the child for `a`: started with the grant in its environment, told to stop
    /// with SIGTERM when the runner says so, killed when the runner aborts this task.
    async fn supervise(&self, a: Assignment) -> Result<(), String> {
        let (partition, token, range) = (a.partition(), a.token(), a.range());
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env("TENURE_PARTITION", partition.0.to_string())
            .env("TENURE_TOKEN", token.0.to_string())
            .env("TENURE_HASH_START", range.start.to_string())
            .env("TENURE_HASH_END", range.end.to_string())
            .env("TENURE_LEASE_TTL_MS", a.lease_ttl().as_millis().to_string())
            .env("TENURE_PARTITION_COUNT", a.keyspace().partition_count().to_string())
            .env("TENURE_WORKER", &self.worker)
            // Its own process group, so that what it starts (a shell's psql) is signalled with it.
            .process_group(0)
            .kill_on_drop(true);
        let mut child = Running::spawn(&mut command, &a)
            .map_err(|e| format!("cannot start {}: {e}", self.program.display()))?;
        tokio::select! {
            status = child.wait() => return child.exited(status),
            _ = a.stopped() => {}
        }
        // Revoked, or shutting down: ask it to finish. On a loss the runner aborts this task
        // right after, and dropping `child` kills it.
        child.terminate();
        let status = child.wait().await;
        // Whatever it exits with now, it stopped because it was asked to: not a failure.
        child.exited(status).or(Ok(()))
    }
}

/// A child of one partition. Dropped while it still runs (the runner aborted the task: a loss,
/// or the drain bound passed), it is killed.
struct Running {
    child: Child,
    pid: u32,
    partition: u32,
    token: u64,
    done: bool,
}

impl Running {
    fn spawn(command: &mut Command, a: &Assignment) -> std::io::Result<Running> {
        let child = command.spawn()?;
        let pid = child.id().unwrap_or(0);
        let (partition, token) = (a.partition().0, a.token().0);
        println!("START partition={partition} token={token} pid={pid}");
        Ok(Running { child, pid, partition, token, done: false })
    }

    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        let status = self.child.wait().await;
        self.done = true;
        status
    }

    fn terminate(&self) {
        println!("TERM partition={} token={} pid={}", self.partition, self.token, self.pid);
        self.signal_group(libc::SIGTERM);
    }

    /// Signals the child's process group (the child leads it).
    fn signal_group(&self, signal: libc::c_int) {
        if let Ok(pid) = libc::pid_t::try_from(self.pid) {
            if pid > 0 {
                // SAFETY: kill(2) takes no pointers; the group is our child's own, and the
                // child is not reaped while `done` is false, so its id is not reused.
                unsafe { libc::kill(-pid, signal) };
            }
        }
    }

    fn exited(&self, status: std::io::Result<std::process::ExitStatus>) -> Result<(), String> {
        let (partition, token) = (self.partition, self.token);
        match status {
            Ok(status) if status.success() => {
                println!("EXIT partition={partition} token={token} status=0");
                Ok(())
            }
            Ok(status) => {
                let code = status.code().map_or_else(|| format!("{status}"), |c| c.to_string());
                println!("EXIT partition={partition} token={token} status={code}");
                Err(format!("the child of partition {partition} exited with {status}"))
            }
            Err(e) => Err(format!("waiting for the child of partition {partition}: {e}")),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            println!("KILL partition={} token={} pid={}", self.partition, self.token, self.pid);
            self.signal_group(libc::SIGKILL);
            let _ = self.child.start_kill();
        }
    }
}
