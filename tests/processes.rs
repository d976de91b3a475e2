//! The operator's path: three `tenure serve` processes on loopback, `tenure ctl status`, and the
//! Prometheus endpoint, all through the real binary.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tenure::worker::{ClientTls, Worker, WorkerConfig};

const BIN: &str = env!("CARGO_BIN_EXE_tenure");

/// Kills the processes when the test ends, however it ends.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).ok()?;
    Some(body)
}

/// `tenure ctl status` as the operator `ops` whose certificate is in `certs`.
fn ctl_status(coordinators: &str, certs: &Path) -> Option<String> {
    let out = Command::new(BIN)
        .args(["ctl", "--coordinators", coordinators])
        .arg("--tls-ca")
        .arg(certs.join("ca.pem"))
        .arg("--tls-cert")
        .arg(certs.join("operator-ops.pem"))
        .arg("--tls-key")
        .arg(certs.join("operator-ops-key.pem"))
        .arg("status")
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn three_serve_processes_form_a_cluster_that_ctl_and_prometheus_can_read() {
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peer_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let metrics: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers = ports
        .iter()
        .zip(&peer_ports)
        .enumerate()
        .map(|(i, (p, q))| format!("{}=127.0.0.1:{p}/127.0.0.1:{q}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    // The operator's development certificates, as the README's quickstart makes them.
    let certs = dir.path().join("certs");
    let made = Command::new(BIN)
        .args(["certs", "--dir"])
        .arg(&certs)
        .args(["--nodes", "3", "--workers", "proc-worker", "--operators", "ops"])
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let mut children = Processes(Vec::new());
    for (i, metrics_port) in metrics.iter().enumerate() {
        let id = i + 1;
        let child = Command::new(BIN)
            .args(["serve", "--id", &id.to_string(), "--peers", &peers])
            .arg("--tls-ca")
            .arg(certs.join("ca.pem"))
            .arg("--tls-cert")
            .arg(certs.join(format!("node-{id}.pem")))
            .arg("--tls-key")
            .arg(certs.join(format!("node-{id}-key.pem")))
            .arg("--data-dir")
            .arg(dir.path().join(format!("n{i}")))
            .args(["--partitions", "16", "--lease-ttl-ms", "2000"])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}"), "--gauge-refresh-ms", "200"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        children.0.push(child);
    }
    let coordinators = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    let status = until("a leader and a configured table", || {
        ctl_status(&coordinators, &certs)
            .filter(|s| s.contains("16 partitions") && !s.contains("leader: node 0"))
    });
    assert!(status.contains("nodes: 1=127.0.0.1:"), "{status}");
    // Without a certificate, ctl gets nothing: it must say how to give one, or be told
    // --insecure, which this cluster refuses at the handshake.
    let bare = Command::new(BIN).args(["ctl", "--coordinators", &coordinators, "status"]).output().unwrap();
    assert!(!bare.status.success());
    assert!(String::from_utf8_lossy(&bare.stderr).contains("--tls-ca"), "{bare:?}");
    let plain = Command::new(BIN)
        .args(["ctl", "--coordinators", &coordinators, "--insecure", "status"])
        .output()
        .unwrap();
    assert!(!plain.status.success(), "a plain-text client is refused: {plain:?}");

    // A worker joins through the library; ctl then shows it owning all 16 partitions.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let addrs: Vec<String> = coordinators.split(',').map(str::to_string).collect();
    let mut config = WorkerConfig::new(addrs, "proc-worker");
    config.tls = Some(
        ClientTls::from_files(
            &certs.join("ca.pem"),
            &certs.join("worker-proc-worker.pem"),
            &certs.join("worker-proc-worker-key.pem"),
        )
        .unwrap(),
    );
    let worker = runtime.block_on(Worker::join(config)).unwrap();
    let status = until("the worker owns every partition", || {
        ctl_status(&coordinators, &certs).filter(|s| s.contains("owns 16"))
    });
    assert!(status.contains("proc-worker"), "{status}");

    // The leader's metrics endpoint reports the grants.
    let scraped = until("grants in the metrics", || {
        metrics
            .iter()
            .filter_map(|m| http_get(&format!("127.0.0.1:{m}"), "/metrics"))
            .find(|b| b.contains("tenure_grants_total"))
    });
    assert!(scraped.contains("tenure_owned_partitions"), "{scraped}");
    // Every replica counts the decisions it applies under its own `node` label, never another
    // node's: the 16 grants appear once per node, each series labelled with that node.
    for (i, m) in metrics.iter().enumerate() {
        let id = i + 1;
        let own = format!("tenure_grants_total{{node=\"{id}\"}} 16");
        let body = until(&format!("node {id} counts the 16 grants it applied"), || {
            http_get(&format!("127.0.0.1:{m}"), "/metrics").filter(|b| b.contains(&own))
        });
        let series = body.lines().filter(|l| l.starts_with("tenure_grants_total{")).count();
        assert_eq!(series, 1, "node {id} exports one grants series, its own:\n{body}");
    }
    // A worker's gauge lives as long as its session, on every node: once it leaves, the series
    // is dropped rather than kept at its last value for ever.
    let series = "tenure_owned_partitions{worker=\"proc-worker\"}";
    for m in &metrics {
        until("every node exports the worker's gauge", || {
            http_get(&format!("127.0.0.1:{m}"), "/metrics").filter(|b| b.contains(series))
        });
    }
    runtime.block_on(worker.leave()).expect("the worker leaves");
    for m in &metrics {
        until("the worker's gauge is dropped once its session has ended", || {
            http_get(&format!("127.0.0.1:{m}"), "/metrics").filter(|b| !b.contains(series))
        });
    }
    let body = http_get(&format!("127.0.0.1:{}", metrics[0]), "/metrics").expect("a scrape");
    assert!(body.contains("tenure_grants_total"), "counters are kept: {body}");
}
