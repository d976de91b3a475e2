//! `tenure run` with a job that is a shell script: no client library, one process per owned
//! partition, and a fence that the script checks in SQL.
//!
//! A 3-node coordinator runs in this process with 4 partitions; two `tenure run` processes,
//! alpha and beta, run `examples/jobs/fenced_step.sh` per partition. The script appends a row
//! per step to PostgreSQL in the statement that checks the partition's fence.
//!
//! The story: alpha owns everything. Then alpha and its children freeze together (SIGSTOP, as
//! a paused VM would), beta joins, alpha's leases run out and beta's children write under new
//! tokens. One of alpha's children wakes first and tries its next step under its old token:
//! the fence refuses it, and the table shows no row of the old token after the first of the new.
//!
//! Run: `cargo build --bin tenure --example tenure_run && target/debug/examples/tenure_run`
//! (`--tenure PATH` names the binary elsewhere, `--postgres CONNINFO` the database).

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tenure::local_cluster::LocalCluster;
use tenure::tls::Principal;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

const PARTITIONS: u32 = 4;
const PATIENCE: Duration = Duration::from_secs(60);

struct Args {
    tenure: PathBuf,
    postgres: String,
}

fn args() -> Result<Args> {
    let mut tenure = None;
    let mut postgres = std::env::var("TENURE_TEST_POSTGRES").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".into()
    });
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        match flag.as_str() {
            "--tenure" => tenure = Some(PathBuf::from(given.next().context("--tenure PATH")?)),
            "--postgres" => postgres = given.next().context("--postgres CONNINFO")?,
            other => bail!("unknown argument {other:?}; the flags are --tenure PATH and --postgres CONNINFO"),
        }
    }
    // Cargo puts examples in target/<profile>/examples and the binary in target/<profile>.
    let tenure = match tenure {
        Some(path) => path,
        None => {
            let exe = std::env::current_exe()?;
            let profile = exe.parent().and_then(Path::parent).context("locating target/<profile>")?;
            profile.join("tenure")
        }
    };
    if !tenure.exists() {
        bail!(
            "{} is missing: build it with `cargo build --bin tenure`, or pass --tenure PATH",
            tenure.display()
        );
    }
    Ok(Args { tenure, postgres })
}

/// One line a `tenure run` process (or one of its children) printed.
struct Line {
    who: &'static str,
    text: String,
}

/// What a line says about a partition: (verb, partition, token, pid).
fn parse(text: &str) -> Option<(&str, u32, u64, Option<i32>)> {
    let mut words = text.split_whitespace();
    let verb = words.next()?;
    let (mut partition, mut token, mut pid) = (None, None, None);
    for word in words {
        match word.split_once('=') {
            Some(("partition", v)) => partition = v.parse().ok(),
            Some(("token", v)) => token = v.parse().ok(),
            Some(("pid", v)) => pid = v.parse().ok(),
            _ => {}
        }
    }
    Some((verb, partition?, token?, pid))
}

struct Story {
    start: Instant,
    lines: mpsc::UnboundedReceiver<Line>,
    sender: mpsc::UnboundedSender<Line>,
    /// The latest child of each partition, per runner: (token, pid).
    children: BTreeMap<(&'static str, u32), (u64, i32)>,
}

impl Story {
    /// Waits for a line of `who` that `wanted` accepts, printing every line on the way.
    async fn until(
        &mut self,
        what: &str,
        mut wanted: impl FnMut(&'static str, &str) -> bool,
    ) -> Result<String> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv())
                .await
                .with_context(|| format!("timed out waiting for {what}"))?
                .with_context(|| format!("every runner exited before {what}"))?;
            println!("t={:5.2}s [{}] {}", self.start.elapsed().as_secs_f64(), line.who, line.text);
            if let Some(("START", partition, token, Some(pid))) = parse(&line.text) {
                self.children.insert((line.who, partition), (token, pid));
            }
            if wanted(line.who, &line.text) {
                return Ok(line.text);
            }
        }
    }

    /// Waits until `who` has had an accepted step on every partition in `partitions`.
    async fn accepted(&mut self, who: &'static str, partitions: &[u32]) -> Result<BTreeMap<u32, u64>> {
        let mut seen = BTreeMap::new();
        while seen.len() < partitions.len() {
            let line = self
                .until(&format!("{who} to write on {partitions:?}"), |w, text| {
                    w == who && text.starts_with("ACCEPT")
                })
                .await?;
            if let Some((_, partition, token, _)) = parse(&line) {
                if partitions.contains(&partition) {
                    seen.insert(partition, token);
                }
            }
        }
        Ok(seen)
    }

    fn spawn(
        &self,
        who: &'static str,
        args: &Args,
        dir: &Path,
        cluster: &LocalCluster,
        schema: &str,
    ) -> Result<Child> {
        let [ca, cert, key] =
            cluster.ca().write_client_files(dir, &format!("worker-{who}"), &Principal::Worker(who.into()))?;
        // The job travels inside this binary, so it runs the script it was built with from
        // wherever the binary is.
        let job = dir.join("fenced_step.sh");
        std::fs::write(&job, include_str!("jobs/fenced_step.sh")).context("writing the job script")?;
        let mut child = Command::new(&args.tenure)
            .args(["run", "--coordinators", &cluster.addrs().join(","), "--name", who])
            .arg("--tls-ca")
            .arg(ca)
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .args(["--drain-ms", "2000", "--restart-ms", "200", "--", "sh"])
            .arg(job)
            .env("JOB_DATABASE", &args.postgres)
            .env("PGOPTIONS", format!("-c search_path={schema}"))
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", args.tenure.display()))?;
        let stdout = child.stdout.take().context("the runner's stdout")?;
        let sender = self.sender.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(text)) = lines.next_line().await {
                if sender.send(Line { who, text }).is_err() {
                    return;
                }
            }
        });
        Ok(child)
    }
}

/// Sends `signal` to a process (`pid` > 0) or a process group (`pid` < 0).
fn signal(pid: i32, signal: libc::c_int) -> Result<()> {
    // SAFETY: kill(2) takes no pointers; the processes are this story's children.
    if unsafe { libc::kill(pid, signal) } != 0 {
        bail!("kill({pid}, {signal}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn pid_of(child: &Child) -> Result<i32> {
    Ok(i32::try_from(child.id().context("the runner exited early")?)?)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = args()?;
    let dir = tempfile::tempdir()?;
    let schema = format!("tenure_run_example_{}", std::process::id());
    let (db, connection) = tokio_postgres::connect(&args.postgres, tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL (`bash scripts/setup` starts one)")?;
    tokio::spawn(connection);
    db.batch_execute(&format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; SET search_path = {schema};
         CREATE TABLE tenure_fence (partition integer PRIMARY KEY, fence_token bigint NOT NULL, checkpoint bytea);
         CREATE TABLE job_log (id bigserial PRIMARY KEY, partition integer NOT NULL, token bigint NOT NULL, step integer NOT NULL);"
    ))
    .await?;
    let outcome = story(&args, dir.path(), &db, &schema).await;
    db.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await?;
    outcome
}

async fn story(args: &Args, dir: &Path, db: &tokio_postgres::Client, schema: &str) -> Result<()> {
    let cluster = LocalCluster::start(3, &dir.join("cluster"), |c| {
        c.partition_count = PARTITIONS;
        c.lease_ttl = Duration::from_millis(1500);
        c.election_timeout = Duration::from_millis(300);
        c.raft_heartbeat_interval = Duration::from_millis(100);
        c.expiry_check_interval = Duration::from_millis(20);
    })
    .await?;
    cluster.wait_for_leader(PATIENCE).await.context("no leader")?;
    let (sender, lines) = mpsc::unbounded_channel();
    let mut story = Story { start: Instant::now(), lines, sender, children: BTreeMap::new() };
    let all: Vec<u32> = (0..PARTITIONS).collect();

    println!("== alpha runs the job on every partition");
    let mut alpha = story.spawn("alpha", args, dir, &cluster, schema)?;
    story.accepted("alpha", &all).await?;

    println!("== alpha and its children freeze; beta joins and takes over once alpha's leases run out");
    let alpha_pid = pid_of(&alpha)?;
    signal(alpha_pid, libc::SIGSTOP)?;
    let frozen: Vec<(u32, u64, i32)> = all
        .iter()
        .filter_map(|p| story.children.get(&("alpha", *p)).map(|(t, pid)| (*p, *t, *pid)))
        .collect();
    for (_, _, pid) in &frozen {
        signal(-pid, libc::SIGSTOP)?;
    }
    let mut beta = story.spawn("beta", args, dir, &cluster, schema)?;
    let beta_tokens = story.accepted("beta", &all).await?;

    let (partition, old_token, child) = frozen[0];
    println!("== alpha's child of partition {partition} wakes first and tries its next step under token {old_token}");
    signal(-child, libc::SIGCONT)?;
    let refused = format!("REFUSED partition={partition} token={old_token}");
    story
        .until("the woken child to be refused", |who, text| who == "alpha" && text.starts_with(&refused))
        .await?;

    println!("== alpha wakes: it finds its session gone, kills what is left and joins again");
    for (_, _, pid) in &frozen[1..] {
        signal(-pid, libc::SIGCONT)?;
    }
    signal(alpha_pid, libc::SIGCONT)?;
    story
        .until("alpha to own partitions again", |who, text| {
            who == "alpha"
                && parse(text).is_some_and(|(verb, p, t, _)| {
                    verb == "ACCEPT" && beta_tokens.get(&p).is_some_and(|b| t > *b)
                })
        })
        .await?;

    println!("== both stop on SIGTERM: every child is told, then each runner leaves");
    signal(alpha_pid, libc::SIGTERM)?;
    signal(pid_of(&beta)?, libc::SIGTERM)?;
    for (who, child) in [("alpha", &mut alpha), ("beta", &mut beta)] {
        let status =
            tokio::time::timeout(PATIENCE, child.wait()).await.context("a runner did not stop")??;
        if !status.success() {
            bail!("{who} exited with {status}");
        }
    }
    while let Ok(line) = story.lines.try_recv() {
        println!("t={:5.2}s [{}] {}", story.start.elapsed().as_secs_f64(), line.who, line.text);
    }

    // The table's own account: on the woken child's partition, no row of alpha's old token
    // comes after the first row of beta's.
    let new_token = beta_tokens[&partition];
    let row = db
        .query_one(
            &format!(
                "SELECT (SELECT max(id) FROM {schema}.job_log WHERE partition = $1 AND token = $2),
                        (SELECT min(id) FROM {schema}.job_log WHERE partition = $1 AND token = $3)"
            ),
            &[&(partition as i32), &(old_token as i64), &(new_token as i64)],
        )
        .await?;
    let (last_old, first_new): (Option<i64>, Option<i64>) = (row.get(0), row.get(1));
    match (last_old, first_new) {
        (Some(last_old), Some(first_new)) if last_old < first_new => println!(
            "fence held: partition {partition}'s last row under token {old_token} is #{last_old}, before the first under {new_token} (#{first_new})"
        ),
        other => bail!("the fence did not hold on partition {partition}: {other:?}"),
    }
    cluster.shutdown().await;
    Ok(())
}
