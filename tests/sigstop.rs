//! A real worker process is frozen with SIGSTOP past its TTL; another worker takes its
//! partitions and writes; the first is resumed with SIGCONT, its late writes are rejected by the
//! PostgreSQL-fenced store, and its library reports the partitions lost. Tokens in the store only
//! grow.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use tenure::fence::{FenceStore, PostgresFence};
use tenure::ids::PartitionId;
use tenure::worker::WorkerEvent;

fn base() -> String {
    std::env::var("TENURE_TEST_POSTGRES").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres password=tenure dbname=tenure_test".into()
    })
}

/// Kills the worker process however the test ends.
struct Reaper(std::process::Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_process_is_fenced_out_when_it_wakes() {
    let (client, conn) =
        tokio_postgres::connect(&base(), tokio_postgres::NoTls).await.expect("PostgreSQL (scripts/setup)");
    tokio::spawn(conn);
    let schema = format!("tenure_sigstop_{}_{}", std::process::id(), rand::random::<u32>());
    client.batch_execute(&format!("CREATE SCHEMA {schema}")).await.unwrap();
    let pg = format!("{} options='-c search_path={schema}'", base());
    // A process frozen inside a transaction would hold the fence row's lock and block the new
    // owner; the server ends such a session, as a deployment should configure it to.
    let pg_a =
        format!("{} options='-c search_path={schema} -c idle_in_transaction_session_timeout=300'", base());

    let dir = tempfile::tempdir().unwrap();
    let c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.partition_count = 2;
    })
    .await
    .unwrap();
    c.wait_for_leader(PATIENCE).await.unwrap();

    let principal = tenure::tls::Principal::Worker("A".into());
    let [ca, cert, key] = c.ca().write_client_files(dir.path(), "worker-A", &principal).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["work", "--coordinators", &c.addrs().join(","), "--name", "A", "--postgres", &pg_a])
        .arg("--tls-ca")
        .arg(ca)
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let _reaper = Reaper(child);
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let out = BufReader::new(stdout);
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    let seen = |needle: &str| lines.lock().unwrap().iter().filter(|l| l.starts_with(needle)).count();
    eventually("A writes to both partitions", || async {
        (seen("ACCEPT p0") > 0 && seen("ACCEPT p1") > 0).then_some(())
    })
    .await;

    signal(pid, "-STOP");
    let store = PostgresFence::connect(&pg).await.unwrap();
    let mut b = worker(&c, "B").await;
    let mut events = b.events().expect("events taken once");
    let mut b_tokens = BTreeMap::new();
    while b_tokens.len() < 2 {
        let event = tokio::time::timeout(PATIENCE, events.recv()).await.unwrap().unwrap();
        if let WorkerEvent::Granted(h) = event {
            let fenced = h.acquire(&store).await.expect("B fences before resuming");
            fenced.write(b"counter", b"B").await.unwrap();
            b_tokens.insert(h.partition(), h.token());
        }
    }
    signal(pid, "-CONT");
    let deadline = std::time::Instant::now() + PATIENCE;
    // Each late write is refused: by the fence (REJECT) or, if A was frozen mid-transaction, by
    // the server having ended that transaction (ERROR). Either way it must not land.
    let refused = |p: &str| seen(&format!("REJECT {p}")) + seen(&format!("ERROR {p}")) > 0;
    // A stops believing in each: `LOST` when its deadline check runs first after the wake; or
    // `RELEASED` when it first reads the revoke that reached its socket while it was frozen
    // (B's join took one of its two) and gives the partition back, as `tenure work` does.
    let ended = |p: &str| seen(&format!("LOST {p}")) + seen(&format!("RELEASED {p}")) > 0;
    while !(refused("p0") && refused("p1") && ended("p0") && ended("p1")) {
        assert!(
            std::time::Instant::now() < deadline,
            "A's late writes were not all rejected and reported lost; A printed:\n{}",
            lines.lock().unwrap().join("\n")
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for p in [PartitionId(0), PartitionId(1)] {
        assert_eq!(store.highest(p).await.unwrap(), Some(b_tokens[&p]), "the fence is B's token");
        assert_eq!(
            store.read(p, b"counter").await.unwrap().as_deref(),
            Some(&b"B"[..]),
            "A's late write left no trace"
        );
    }
    // Tokens only grew in what A saw accepted, and A's accepted tokens are below B's.
    for line in lines.lock().unwrap().iter().filter(|l| l.starts_with("ACCEPT")) {
        let token: u64 = line.split("token=").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!(b_tokens.values().all(|t| token < t.0), "{line}");
    }
    drop(b);
    c.shutdown().await;
}
