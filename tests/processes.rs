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

/// `tenure ctl ARGS` as the operator `ops` whose certificate is in `certs`: what it printed,
/// or what it said on failure.
fn ctl(coordinators: &str, certs: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(BIN)
        .args(["ctl", "--coordinators", coordinators])
        .arg("--tls-ca")
        .arg(certs.join("ca.pem"))
        .arg("--tls-cert")
        .arg(certs.join("operator-ops.pem"))
        .arg("--tls-key")
        .arg(certs.join("operator-ops-key.pem"))
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

/// `tenure ctl status` as the operator `ops`.
fn ctl_status(coordinators: &str, certs: &Path) -> Option<String> {
    ctl(coordinators, certs, &["status"]).ok()
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
    let metrics: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers = peers_flag(&ports);
    let certs = make_certs(dir.path(), 3, "proc-worker");
    let mut children = Processes(Vec::new());
    for (i, metrics_port) in metrics.iter().enumerate() {
        let id = i + 1;
        let child = serve(id, &peers, &certs, dir.path())
            .args(["--lease-ttl-ms", "2000", "--gauge-refresh-ms", "200"])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
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
    let worker = join_worker(&runtime, &coordinators, &certs);
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

/// `tenure ctl -w json ARGS`: the one JSON document it printed.
fn ctl_json(coordinators: &str, certs: &Path, args: &[&str]) -> Result<serde_json::Value, String> {
    let out = ctl(coordinators, certs, &[&["-w", "json"], args].concat())?;
    serde_json::from_str(&out).map_err(|e| format!("not one JSON document ({e}): {out}"))
}

/// The worker `proc-worker` of [`make_certs`], joined through the library.
fn join_worker(runtime: &tokio::runtime::Runtime, coordinators: &str, certs: &Path) -> Worker {
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
    runtime.block_on(Worker::join(config)).unwrap()
}

/// Every `tenure ctl` read, in its table and its JSON shape, against three `tenure serve`
/// processes: watch sees the grants as they commit, sessions and partitions carry the leader's
/// lease time, `key` maps a key as the key space does, linearizable reads are answered by the
/// leader whichever node is asked while serializable ones are answered by the node asked, and
/// `endpoint` commands ask each node about itself, so a dead node shows as one.
#[test]
fn ctl_reads_tables_and_json_from_a_running_cluster() {
    use serde_json::Value;
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers = peers_flag(&ports);
    let certs = make_certs(dir.path(), 3, "proc-worker");
    let mut children = Processes(Vec::new());
    for id in 1..=3 {
        let mut command = serve(id, &peers, &certs, dir.path());
        command.args(["--lease-ttl-ms", "3000"]);
        if id == 1 {
            command.args(["--log-format", "json"]).stderr(Stdio::piped());
        }
        children.0.push(command.spawn().unwrap());
    }
    // Node 1 logs one JSON object per line, for a log pipeline.
    let logs = std::io::BufReader::new(children.0[0].stderr.take().unwrap());
    let (logged, log_lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in logs.lines().map_while(Result::ok) {
            let _ = logged.send(line);
        }
    });
    let line = log_lines.recv_timeout(Duration::from_secs(60)).expect("node 1 logs as it starts");
    let record: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert!(record["level"].is_string() && record["fields"]["message"].is_string(), "{record}");
    let endpoint = |id: usize| format!("127.0.0.1:{}", ports[id - 1]);
    let coordinators = (1..=3).map(endpoint).collect::<Vec<_>>().join(",");
    let status = until("a leader and a configured table", || {
        ctl_json(&coordinators, &certs, &["status"])
            .ok()
            .filter(|s| s["partition_count"] == 16 && s["leader"]["id"].as_u64().is_some_and(|id| id != 0))
    });
    assert_eq!(status["linearizable"], true, "reads are linearizable by default: {status}");
    assert_eq!(status["answered_by"], status["leader"]["id"], "so the leader answers: {status}");
    assert_eq!(status["nodes"].as_array().unwrap().len(), 3, "{status}");
    let leader = status["leader"]["id"].as_u64().unwrap() as usize;

    // A watch started before the worker joins prints the 16 grants as they commit.
    let mut watch = Command::new(BIN)
        .args(["ctl", "--endpoints", &coordinators, "-w", "json"])
        .arg("--tls-ca")
        .arg(certs.join("ca.pem"))
        .arg("--tls-cert")
        .arg(certs.join("operator-ops.pem"))
        .arg("--tls-key")
        .arg(certs.join("operator-ops-key.pem"))
        .args(["watch", "--max-events", "16"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (said, heard) = std::sync::mpsc::channel();
    let stderr = std::io::BufReader::new(watch.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = said.send(line);
        }
    });
    let first = heard.recv_timeout(Duration::from_secs(60)).expect("the watch reports it is watching");
    assert_eq!(first, "watching 16 partitions");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let worker = join_worker(&runtime, &coordinators, &certs);
    let deadline = Instant::now() + Duration::from_secs(60);
    while watch.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the watch never saw 16 changes");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut printed = String::new();
    watch.stdout.take().unwrap().read_to_string(&mut printed).unwrap();
    let changes: Vec<Value> = printed.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut granted: Vec<u64> = changes.iter().map(|c| c["partition"].as_u64().unwrap()).collect();
    granted.sort();
    assert_eq!(granted, (0..16).collect::<Vec<u64>>(), "one grant per partition:\n{printed}");
    for c in &changes {
        assert_eq!(c["owner"]["name"], "proc-worker", "{c}");
        assert_eq!(c["revoking"], false, "{c}");
        assert!(c["token"].as_u64().unwrap() > 0, "{c}");
    }
    let token_of = |p: u64| changes.iter().find(|c| c["partition"] == p).unwrap()["token"].clone();

    // Sessions, with the leader's lease time.
    let sessions = ctl_json(&coordinators, &certs, &["session", "list"]).unwrap();
    let session = &sessions["sessions"][0];
    assert_eq!(sessions["sessions"].as_array().unwrap().len(), 1, "{sessions}");
    assert_eq!((session["name"].as_str(), session["owned"].as_u64()), (Some("proc-worker"), Some(16)));
    let left = session["lease_remaining_ms"].as_u64().expect("the leader knows the lease");
    assert!(left <= 3000, "never more than the TTL: {sessions}");
    let table = ctl(&coordinators, &certs, &["session", "list"]).unwrap();
    assert!(table.starts_with("SESSION  NAME"), "{table}");
    assert!(table.lines().nth(1).is_some_and(|l| l.contains("proc-worker") && l.contains(" 16 ")), "{table}");

    // Partitions: by owner, with a limit, one by one, and out of range.
    let page =
        ctl_json(&coordinators, &certs, &["partition", "list", "--owner", "proc-worker", "--limit", "5"])
            .unwrap();
    let rows = page["partitions"].as_array().unwrap();
    assert_eq!(
        rows.iter().map(|r| r["partition"].as_u64().unwrap()).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert_eq!(page["next_partition"], 5, "{page}");
    let none = ctl_json(&coordinators, &certs, &["partition", "list", "--owner", "nobody"]).unwrap();
    assert_eq!(none["partitions"], serde_json::json!([]), "{none}");
    let p3 = ctl_json(&coordinators, &certs, &["partition", "get", "3"]).unwrap();
    assert_eq!((p3["partition"].as_u64(), &p3["owner"]["name"]), (Some(3), &Value::from("proc-worker")));
    assert_eq!(p3["token"], token_of(3), "the token the watch saw granted: {p3}");
    assert!(p3["lease_remaining_ms"].as_u64().is_some_and(|ms| ms <= 3000), "{p3}");
    let refused = ctl(&coordinators, &certs, &["partition", "get", "16"]).unwrap_err();
    assert!(refused.contains("out of range"), "{refused}");

    // A key maps to the partition the key space gives it.
    let key = ctl_json(&coordinators, &certs, &["key", "user-42"]).unwrap();
    let space = tenure::keyspace::KeySpace::new(16).unwrap();
    let p = space.partition_of_key(b"user-42");
    assert_eq!(key["partition"], p.0, "{key}");
    assert_eq!(key["hash"], tenure::keyspace::hash_key(b"user-42"), "{key}");
    assert_eq!(key["range"]["start"], space.range(p).unwrap().start, "{key}");
    assert_eq!(key["owner"]["name"], "proc-worker", "{key}");
    assert_eq!(key["token"], token_of(u64::from(p.0)), "{key}");

    // Consistency: asked only a follower, a linearizable read is answered by the leader (the
    // follower names it), a serializable one by the follower itself, without lease times.
    let follower = if leader == 1 { 2 } else { 1 };
    let read = ctl_json(&endpoint(follower), &certs, &["session", "list"]).unwrap();
    assert_eq!(
        (read["answered_by"].as_u64(), &read["linearizable"]),
        (Some(leader as u64), &Value::Bool(true))
    );
    let local =
        ctl_json(&endpoint(follower), &certs, &["--consistency", "serializable", "session", "list"]).unwrap();
    assert_eq!(
        (local["answered_by"].as_u64(), &local["linearizable"]),
        (Some(follower as u64), &Value::Bool(false))
    );
    assert_eq!(
        local["sessions"][0]["lease_remaining_ms"],
        Value::Null,
        "only the leader judges leases: {local}"
    );

    // Members and endpoints.
    let members = until("every member's replication known and caught up", || {
        ctl_json(&coordinators, &certs, &["member", "list"])
            .ok()
            .filter(|m| m["members"].as_array().unwrap().iter().all(|x| x["lag"] == 0))
    });
    assert_eq!(members["members"].as_array().unwrap().len(), 3, "{members}");
    assert!(members["members"].as_array().unwrap().iter().all(|m| m["voter"] == true), "{members}");
    let endpoints = ctl_json(&endpoint(leader), &certs, &["endpoint", "status", "--cluster"]).unwrap();
    let endpoints = endpoints.as_array().unwrap();
    let mut ids: Vec<u64> = endpoints.iter().map(|e| e["id"].as_u64().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, vec![1, 2, 3], "--cluster asks every member: {endpoints:?}");
    assert_eq!(endpoints.iter().filter(|e| e["is_leader"] == true).count(), 1, "{endpoints:?}");
    for e in endpoints {
        assert_eq!(e["version"], env!("CARGO_PKG_VERSION"), "{e}");
        assert_eq!(e["term"], endpoints[0]["term"], "{e}");
        assert_eq!(e["error"], Value::Null, "{e}");
    }
    let health = ctl_json(&coordinators, &certs, &["endpoint", "health"]).unwrap();
    assert!(health.as_array().unwrap().iter().all(|e| e["health"] == true), "{health}");

    // What the README shows.
    for args in [
        &["session", "list"][..],
        &["partition", "list", "--limit", "3"],
        &["partition", "get", "3"],
        &["key", "user-42"],
        &["member", "list"],
        &["endpoint", "status", "--cluster"],
        &["endpoint", "health", "--cluster"],
    ] {
        println!("$ tenure ctl {}\n{}", args.join(" "), ctl(&coordinators, &certs, args).unwrap());
    }
    println!("$ tenure ctl -w json partition get 3\n{p3}");

    // Maintenance mode and weights.
    let on = ctl_json(&coordinators, &certs, &["maintenance", "on"]).unwrap();
    assert_eq!(on, serde_json::json!({ "maintenance": true, "was": false }));
    let shown = ctl(&coordinators, &certs, &["status"]).unwrap();
    assert!(shown.contains("maintenance mode on"), "{shown}");
    assert_eq!(ctl_json(&coordinators, &certs, &["status"]).unwrap()["maintenance"], true);
    let off = ctl_json(&coordinators, &certs, &["maintenance", "off"]).unwrap();
    assert_eq!(off, serde_json::json!({ "maintenance": false, "was": true }));
    let weighed = ctl_json(&coordinators, &certs, &["weight", "proc-worker", "2"]).unwrap();
    assert_eq!(
        weighed,
        serde_json::json!({ "worker": "proc-worker", "weight": 2, "sessions": [session["id"]] })
    );
    let sessions = ctl_json(&coordinators, &certs, &["session", "list"]).unwrap();
    assert_eq!(sessions["sessions"][0]["weight"], 2, "{sessions}");
    let refused = ctl(&coordinators, &certs, &["weight", "nobody", "2"]).unwrap_err();
    assert!(refused.contains("no worker named \"nobody\""), "{refused}");

    // A dead node shows as one: health exits non-zero naming it, status reports its error.
    let dead = if leader == 3 { 2 } else { 3 };
    children.0[dead - 1].kill().unwrap();
    children.0[dead - 1].wait().unwrap();
    let unhealthy = ctl(&coordinators, &certs, &["-w", "json", "endpoint", "health"]).unwrap_err();
    assert!(unhealthy.contains("1 of 3 endpoints are unhealthy"), "{unhealthy}");
    let status = ctl_json(&coordinators, &certs, &["endpoint", "status"]).unwrap();
    let row = status.as_array().unwrap().iter().find(|e| e["endpoint"] == endpoint(dead)).unwrap().clone();
    assert!(row["error"].is_string() && row["id"].is_null(), "{row}");

    // Drain: the worker's session is set leaving, as its own leave would set it. With no other
    // worker to move its partitions to, it keeps them (and renews them) meanwhile.
    let drained = ctl_json(&coordinators, &certs, &["drain", "proc-worker"]).unwrap();
    assert_eq!(drained, serde_json::json!({ "worker": "proc-worker", "sessions": [session["id"]] }));
    let sessions = ctl_json(&coordinators, &certs, &["session", "list"]).unwrap();
    assert_eq!(sessions["sessions"][0]["leaving"], true, "{sessions}");
    let refused = ctl(&coordinators, &certs, &["drain", "proc-worker"]).unwrap_err();
    assert!(refused.contains("no worker named \"proc-worker\" has a live session"), "{refused}");
    drop(worker);
}

/// `--peers` for three nodes serving clients on `client_ports`, each with a free peer port.
fn peers_flag(client_ports: &[u16]) -> String {
    let pair = |(i, port): (usize, &u16)| format!("{}=127.0.0.1:{port}/127.0.0.1:{}", i + 1, free_port());
    client_ports.iter().enumerate().map(pair).collect::<Vec<_>>().join(",")
}

/// The operator's development certificates, as the README's quickstart makes them: `nodes`
/// nodes, the worker `worker` and the operator `ops`.
fn make_certs(dir: &Path, nodes: usize, worker: &str) -> std::path::PathBuf {
    let certs = dir.join("certs");
    let made = Command::new(BIN)
        .args(["certs", "--dir"])
        .arg(&certs)
        .args(["--nodes", &nodes.to_string(), "--workers", worker, "--operators", "ops"])
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    certs
}

/// `tenure serve` for node `id` of the three in `peers`, with the development certificates in
/// `certs` and its data under `dir`.
fn serve(id: usize, peers: &str, certs: &Path, dir: &Path) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--id", &id.to_string(), "--peers", peers])
        .arg("--tls-ca")
        .arg(certs.join("ca.pem"))
        .arg("--tls-cert")
        .arg(certs.join(format!("node-{id}.pem")))
        .arg("--tls-key")
        .arg(certs.join(format!("node-{id}-key.pem")))
        .arg("--data-dir")
        .arg(dir.join(format!("n{id}")))
        .args(["--partitions", "16"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// What an operator's rolling restart does: SIGTERM each `tenure serve` in turn, wait for it to
/// exit, start it again, wait for it to rejoin. The leader hands over before it exits; the
/// worker, in this process, never loses a partition and no partition changes owner or token.
#[test]
fn a_rolling_restart_by_sigterm_moves_nothing_and_loses_no_lease() {
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers = peers_flag(&ports);
    let certs = make_certs(dir.path(), 3, "roller");
    let mut children = Processes(Vec::new());
    for id in 1..=3 {
        children.0.push(serve(id, &peers, &certs, dir.path()).spawn().unwrap());
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let tls = |principal: &str| {
        let file = |suffix: &str| certs.join(format!("{principal}{suffix}"));
        ClientTls::from_files(&certs.join("ca.pem"), &file(".pem"), &file("-key.pem")).unwrap()
    };
    // One node's own view (any node answers status from its applied state).
    let view_of = |runtime: &tokio::runtime::Runtime, id: usize| {
        let client = tenure::worker::Client::new(vec![addrs[id - 1].clone()]).unwrap();
        let client = client.with_tls(Some(tls("operator-ops")));
        runtime.block_on(client.status()).ok().filter(|s| s.node_id == id as u64)
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut config = WorkerConfig::new(addrs.clone(), "roller");
    config.tls = Some(tls("worker-roller"));
    let mut worker = until("the worker joins", || runtime.block_on(Worker::join(config.clone())).ok());
    let mut events = worker.events();
    let table = |s: &tenure::proto::StatusResponse| {
        s.partitions.iter().map(|r| (r.partition, r.owner, r.token)).collect::<Vec<_>>()
    };
    let before = until("the worker owns all 16 partitions", || {
        let status = (1..=3).find_map(|id| view_of(&runtime, id).filter(|s| s.leader_id == id as u64))?;
        let owned = status.partitions.iter().filter(|r| r.owner == worker.session().0).count();
        (owned == 16 && worker.owned().len() == 16).then(|| table(&status))
    });

    let mut handed_over = false;
    for id in 1..=3usize {
        let leader = (1..=3).find_map(|i| view_of(&runtime, i)).map(|s| s.leader_id).unwrap_or(0);
        handed_over |= leader == id as u64;
        let child = &mut children.0[id - 1];
        let signalled =
            Command::new("sh").arg("-c").arg(format!("kill -TERM {}", child.id())).status().unwrap();
        assert!(signalled.success());
        let exited = until(&format!("node {id} exits after SIGTERM"), || child.try_wait().unwrap());
        assert!(exited.success(), "node {id} stopped cleanly: {exited:?}");
        *child = serve(id, &peers, &certs, dir.path()).spawn().unwrap();
        until(&format!("node {id} is back and knows a leader"), || {
            view_of(&runtime, id).filter(|s| s.leader_id != 0)
        });
    }
    assert!(handed_over, "the leader was among the nodes restarted");

    let after = until("a leader's table, the worker still holding every partition", || {
        let status = (1..=3).find_map(|id| view_of(&runtime, id).filter(|s| s.leader_id == id as u64))?;
        (worker.owned().len() == 16).then(|| table(&status))
    });
    assert_eq!(after, before, "no partition changed owner or token");
    while let Ok(event) = events.try_recv() {
        assert!(!matches!(event, tenure::worker::WorkerEvent::Lost { .. }), "the worker lost {event:?}");
    }
    runtime.block_on(worker.leave()).expect("the worker leaves");
}

/// Replacing a node whose disk died, as an operator does: node 3 is killed and its data
/// deleted; node 4 starts with `--join`, is added as a learner, promoted once it has caught up,
/// and node 3 is removed. Node 4 then counts: with one of the two old nodes also killed, the
/// cluster still confirms the worker's renewals, which needs node 4's vote. Throughout, the
/// worker never loses a partition and no owner or token changes.
#[test]
fn a_dead_node_is_replaced_by_a_new_one_and_no_lease_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let peer_ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let entry = |i: usize| format!("{}=127.0.0.1:{}/127.0.0.1:{}", i + 1, ports[i], peer_ports[i]);
    let peers_of = |n: usize| (0..n).map(entry).collect::<Vec<_>>().join(",");
    let certs = make_certs(dir.path(), 4, "keeper");
    let mut children = Processes(Vec::new());
    for id in 1..=3 {
        let child = serve(id, &peers_of(3), &certs, dir.path()).args(["--lease-ttl-ms", "2000"]).spawn();
        children.0.push(child.unwrap());
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let everyone = addrs.join(",");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let view_of = |id: usize| {
        let tls = ClientTls::from_files(
            &certs.join("ca.pem"),
            &certs.join("operator-ops.pem"),
            &certs.join("operator-ops-key.pem"),
        )
        .unwrap();
        let client = tenure::worker::Client::new(vec![addrs[id - 1].clone()]).unwrap().with_tls(Some(tls));
        runtime.block_on(client.status()).ok().filter(|s| s.node_id == id as u64)
    };
    let leaders_table = || {
        let status = (1..=4).find_map(|id| view_of(id).filter(|s| s.leader_id == id as u64))?;
        Some(status.partitions.iter().map(|r| (r.partition, r.owner, r.token)).collect::<Vec<_>>())
    };
    let mut config = WorkerConfig::new(addrs[..3].to_vec(), "keeper");
    config.tls = Some(
        ClientTls::from_files(
            &certs.join("ca.pem"),
            &certs.join("worker-keeper.pem"),
            &certs.join("worker-keeper-key.pem"),
        )
        .unwrap(),
    );
    let mut worker = until("the worker joins", || runtime.block_on(Worker::join(config.clone())).ok());
    let mut events = worker.events();
    let before = until("the worker holds all 16 partitions", || {
        leaders_table().filter(|t| {
            t.iter().all(|(_, owner, _)| *owner == worker.session().0) && worker.owned().len() == 16
        })
    });

    // Node 3's disk dies.
    let node3 = &mut children.0[2];
    node3.kill().unwrap();
    node3.wait().unwrap();
    std::fs::remove_dir_all(dir.path().join("n3")).unwrap();

    // Its replacement joins under a new id, as a learner, then a voter; node 3 is removed.
    children.0.push(serve(4, &peers_of(4), &certs, dir.path()).arg("--join").spawn().unwrap());
    let added = ctl(&everyone, &certs, &["member", "add", &entry(3)]).expect("node 4 is added");
    let role = |members: &serde_json::Value, id: u64| {
        let member = members["members"].as_array().unwrap().iter().find(|m| m["id"] == id).cloned();
        member.map(|m| if m["voter"] == true { "voter" } else { "learner" })
    };
    let members = ctl_json(&everyone, &certs, &["member", "list"]).unwrap();
    assert_eq!(role(&members, 4), Some("learner"), "{added}");
    until("node 4 is promoted once it has caught up", || {
        ctl(&everyone, &certs, &["member", "promote", "4"]).ok()
    });
    let removed = ctl_json(&everyone, &certs, &["member", "remove", "3"]).expect("node 3 is removed");
    assert_eq!(role(&removed, 3), None, "{removed}");
    let listed = ctl(&everyone, &certs, &["member", "list"]).unwrap();
    println!("$ tenure ctl member add {}\n{added}$ tenure ctl member list\n{listed}", entry(3));
    let members = ctl_json(&everyone, &certs, &["member", "list"]).unwrap();
    for id in [1, 2, 4] {
        assert_eq!(role(&members, id), Some("voter"), "node {id} votes: {listed}");
    }
    let refused = ctl(&everyone, &certs, &["member", "remove", "3"]).unwrap_err();
    assert!(refused.contains("not a member"), "{refused}");

    // Node 4 counts: kill one of the two old nodes that does not lead; renewals need a quorum
    // round, which now needs node 4.
    let leader = until("a leader", || (1..=4).find_map(view_of).map(|s| s.leader_id).filter(|l| *l != 0));
    let victim = if leader == 1 { 2 } else { 1 };
    children.0[victim - 1].kill().unwrap();
    let killed_at = Instant::now();
    let after = until("the worker still renews two TTLs after the kill", || {
        (killed_at.elapsed() > Duration::from_secs(4) && worker.owned().len() == 16)
            .then(leaders_table)
            .flatten()
    });
    assert_eq!(after, before, "no partition changed owner or token");
    while let Ok(event) = events.try_recv() {
        assert!(!matches!(event, tenure::worker::WorkerEvent::Lost { .. }), "the worker lost {event:?}");
    }
}
