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
    let out = ctl_command(coordinators, certs).args(args).output().map_err(|e| e.to_string())?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

/// `tenure ctl` as the operator `ops`, its command still to be given.
fn ctl_command(coordinators: &str, certs: &Path) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(["ctl", "--coordinators", coordinators])
        .arg("--tls-ca")
        .arg(certs.join("ca.pem"))
        .arg("--tls-cert")
        .arg(certs.join("operator-ops.pem"))
        .arg("--tls-key")
        .arg(certs.join("operator-ops-key.pem"));
    command
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
    let metrics: Vec<u16> = (0..3).map(|_| free_port()).collect();
    // Every address by host name: --peers, the worker's and ctl's endpoints.
    let nodes = Nodes::start_on("localhost", 3, "proc-worker", |id, command| {
        command
            .args(["--lease-ttl-ms", "2000", "--gauge-refresh-ms", "200"])
            .args(["--metrics-listen", &format!("127.0.0.1:{}", metrics[id - 1])]);
    });
    let (certs, coordinators) = (&nodes.certs, nodes.endpoints());
    let status = until("a leader and a configured table", || {
        ctl_status(&coordinators, certs)
            .filter(|s| s.contains("16 partitions") && !s.contains("leader: node 0"))
    });
    assert!(status.contains("nodes: 1=localhost:"), "{status}");
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
    let worker = join_worker(&runtime, &coordinators, certs);
    let status = until("the worker owns every partition", || {
        ctl_status(&coordinators, certs).filter(|s| s.contains("owns 16"))
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
    // Raft's figures: one node calls itself the leader, every node names it, the leader tracks
    // both followers' replication and has answered the worker's renewals in batches.
    let refused = ctl(&coordinators, certs, &["drain", "nobody"]).unwrap_err();
    assert!(refused.contains("nobody"), "{refused}");
    let scrapes = until("Raft and renewal figures in the metrics", || {
        let bodies: Vec<String> =
            metrics.iter().map(|m| http_get(&format!("127.0.0.1:{m}"), "/metrics")).collect::<Option<_>>()?;
        let leaders: Vec<usize> = (1..=3)
            .filter(|id| {
                sample(&bodies[id - 1], &format!("tenure_raft_is_leader{{node=\"{id}\"}}")) == Some(1.0)
            })
            .collect();
        let [leader] = leaders[..] else { return None };
        let named = (1..=3).all(|id| {
            sample(&bodies[id - 1], &format!("tenure_raft_leader{{node=\"{id}\"}}")) == Some(leader as f64)
        });
        let body = &bodies[leader - 1];
        let renewals = sample(body, &format!("tenure_renewal_batch_size_count{{node=\"{leader}\"}}"))
            .is_some_and(|n| n > 0.0)
            && body.contains(&format!("tenure_renewal_seconds_count{{node=\"{leader}\"}}"));
        let followers = body.lines().filter(|l| l.starts_with("tenure_raft_replication_lag{")).count();
        let refusals = bodies.iter().any(|b| b.contains("tenure_refusals_total{reason=\"unknown_worker\"}"));
        (named && renewals && followers == 2 && refusals).then_some((leader, bodies))
    });
    let (leader, bodies) = scrapes;
    for (i, body) in bodies.iter().enumerate() {
        let id = i + 1;
        let term = sample(body, &format!("tenure_raft_term{{node=\"{id}\"}}")).expect("a term");
        assert!(term >= 1.0, "node {id}:\n{body}");
        let applied = sample(body, &format!("tenure_raft_applied_index{{node=\"{id}\"}}")).expect("applied");
        assert!(applied >= 3.0, "node {id} applied the configuration and the grants:\n{body}");
        assert!(body.contains(&format!("tenure_raft_apply_lag{{node=\"{id}\"}}")), "{body}");
        assert!(body.contains(&format!("tenure_moves_in_flight{{node=\"{id}\"}} 0")), "{body}");
    }
    assert!(bodies[leader - 1].contains("tenure_raft_quorum_ack_age_seconds"), "{}", bodies[leader - 1]);
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

#[test]
fn five_serve_processes_lose_two_nodes_and_no_worker_loses_a_lease() {
    use serde_json::Value;
    let mut nodes = Nodes::start_on("127.0.0.1", 5, "proc-worker", |_, command| {
        command.args(["--lease-ttl-ms", "3000"]);
    });
    let (certs, coordinators) = (nodes.certs.clone(), nodes.endpoints());
    let status = until("a leader of five and a configured table", || {
        ctl_json(&coordinators, &certs, &["status"])
            .ok()
            .filter(|s| s["partition_count"] == 16 && s["leader"]["id"].as_u64().is_some_and(|id| id != 0))
    });
    assert_eq!(status["nodes"].as_array().unwrap().len(), 5, "{status}");
    let members = ctl_json(&coordinators, &certs, &["member", "list"]).unwrap();
    assert_eq!(members["members"].as_array().map(Vec::len), Some(5), "{members}");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let worker = join_worker(&runtime, &coordinators, &certs);
    let tokens_of = |table: &Value| -> Vec<(u64, u64, u64)> {
        let rows = table["partitions"].as_array().cloned().unwrap_or_default();
        rows.iter()
            .map(|r| {
                let owner = r["owner"]["id"].as_u64().unwrap_or(0);
                (r["partition"].as_u64().unwrap(), owner, r["token"].as_u64().unwrap())
            })
            .collect()
    };
    let before = until("the worker owns every partition", || {
        ctl_json(&coordinators, &certs, &["partition", "list"])
            .ok()
            .filter(|t| tokens_of(t).len() == 16 && tokens_of(t).iter().all(|(_, owner, _)| *owner != 0))
    });

    // The leader and one follower die: three of five remain, a quorum; a new leader is elected
    // among them and the worker's session lives on with every partition under the same token.
    let leader = status["leader"]["id"].as_u64().unwrap() as usize;
    let follower = if leader == 1 { 2 } else { 1 };
    for id in [leader, follower] {
        nodes.children.0[id - 1].kill().unwrap();
        nodes.children.0[id - 1].wait().unwrap();
    }
    let after = until("a new leader among the three left", || {
        ctl_json(&coordinators, &certs, &["status"]).ok().filter(|s| {
            let id = s["leader"]["id"].as_u64().unwrap_or(0) as usize;
            id != 0 && id != leader && id != follower
        })
    });
    assert!(after["term"].as_u64() > status["term"].as_u64(), "{after}");
    // Two lease TTLs under the new leader: an expiry needs time to pass to show, so this waits
    // it out; a worker that renewed in time keeps everything.
    std::thread::sleep(Duration::from_secs(6));
    let table = ctl_json(&coordinators, &certs, &["partition", "list"]).unwrap();
    assert_eq!(tokens_of(&table), tokens_of(&before), "no owner or token changed");
    assert_eq!(worker.owned().len(), 16, "the worker still believes in every partition");
    runtime.block_on(worker.leave()).expect("the worker leaves");
}

/// The value of the sample named exactly `series` (name and labels) in a Prometheus scrape.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
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
    let mut nodes = Nodes::start("proc-worker", |id, command| {
        command.args(["--lease-ttl-ms", "3000"]);
        if id == 1 {
            command.args(["--log-format", "json"]).stderr(Stdio::piped());
        }
    });
    // Node 1 logs one JSON object per line, for a log pipeline.
    let log_lines = lines_of(nodes.children.0[0].stderr.take().unwrap());
    let line = log_lines.recv_timeout(Duration::from_secs(60)).expect("node 1 logs as it starts");
    let record: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert!(record["level"].is_string() && record["fields"]["message"].is_string(), "{record}");
    let (certs, coordinators) = (nodes.certs.clone(), nodes.endpoints());
    let endpoints: Vec<String> = (1..=3).map(|id| nodes.endpoint(id)).collect();
    let endpoint = |id: usize| endpoints[id - 1].clone();
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
    let watch = Watch::start(&coordinators, &certs, 16);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let worker = join_worker(&runtime, &coordinators, &certs);
    let changes = watch.changes();
    let printed = changes.iter().map(Value::to_string).collect::<Vec<_>>().join("\n");
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

    // Move: a pin to a worker name, and back; bad ones refused before the log.
    let pinned = ctl_json(&coordinators, &certs, &["move", "3", "--to", "proc-worker"]).unwrap();
    assert_eq!(pinned, serde_json::json!({ "partition": 3, "to": "proc-worker", "was": null }));
    let unpinned = ctl_json(&coordinators, &certs, &["move", "3", "--unpin"]).unwrap();
    assert_eq!(unpinned, serde_json::json!({ "partition": 3, "to": null, "was": "proc-worker" }));
    let refused = ctl(&coordinators, &certs, &["move", "16", "--to", "proc-worker"]).unwrap_err();
    assert!(refused.contains("partition_out_of_range") || refused.contains("out of range"), "{refused}");
    let refused = ctl(&coordinators, &certs, &["move", "3", "--to", "nobody"]).unwrap_err();
    assert!(refused.contains("no worker named \"nobody\""), "{refused}");
    let refused = ctl(&coordinators, &certs, &["move", "3"]).unwrap_err();
    assert!(refused.contains("--to"), "{refused}");

    // The lease TTL and the revoke budget, changed at run time and back.
    let status = ctl_json(&coordinators, &certs, &["status"]).unwrap();
    let ttl = status["lease_ttl_ms"].as_u64().expect("a TTL");
    let set = ctl_json(&coordinators, &certs, &["lease-ttl", &(ttl * 2).to_string()]).unwrap();
    assert_eq!(set, serde_json::json!({ "lease_ttl_ms": ttl * 2, "was_ms": ttl }));
    let status = ctl_json(&coordinators, &certs, &["status"]).unwrap();
    assert_eq!(
        (status["lease_ttl_ms"].as_u64(), status["lease_ttl_ceiling_ms"].as_u64()),
        (Some(ttl * 2), Some(ttl * 2))
    );
    let back = ctl_json(&coordinators, &certs, &["lease-ttl", &ttl.to_string()]).unwrap();
    assert_eq!(back["was_ms"], ttl * 2);
    let refused = ctl(&coordinators, &certs, &["lease-ttl", "5"]).unwrap_err();
    assert!(refused.contains("invalid_config") || refused.contains("outside"), "{refused}");
    let budget = ctl_json(&coordinators, &certs, &["revoke-budget", "4"]).unwrap();
    assert_eq!(budget, serde_json::json!({ "max_revoking": 4, "was": null }));
    // Read from the leader (linearizable, the default), with what is spent of the budget.
    let text = ctl(&coordinators, &certs, &["status"]).unwrap();
    let spent = "at most 4 partitions in motion (now 0 revoking and 0 moved but unconfirmed)";
    assert!(text.contains(spent), "{text}");
    let status = ctl_json(&coordinators, &certs, &["status"]).unwrap();
    assert_eq!((status["max_revoking"].as_u64(), status["unconfirmed_moves"].as_u64()), (Some(4), Some(0)));
    let budget = ctl_json(&coordinators, &certs, &["revoke-budget", "--unlimited"]).unwrap();
    assert_eq!(budget, serde_json::json!({ "max_revoking": null, "was": 4 }));
    let refused = ctl(&coordinators, &certs, &["revoke-budget", "0"]).unwrap_err();
    assert!(refused.contains("invalid_config") || refused.contains("at least 1"), "{refused}");

    // Drain: the worker's session is set leaving, as its own leave would set it. With no other
    // worker to move its partitions to, it keeps them (and renews them) meanwhile.
    let drained = ctl_json(&coordinators, &certs, &["drain", "proc-worker"]).unwrap();
    assert_eq!(drained, serde_json::json!({ "worker": "proc-worker", "sessions": [session["id"]] }));
    let sessions = ctl_json(&coordinators, &certs, &["session", "list"]).unwrap();
    assert_eq!(sessions["sessions"][0]["leaving"], true, "{sessions}");
    let refused = ctl(&coordinators, &certs, &["drain", "proc-worker"]).unwrap_err();
    assert!(refused.contains("no worker named \"proc-worker\" has a live session"), "{refused}");

    // A watch that was away while the leader died and the table changed: held stopped, it
    // finds its stream gone when it resumes, follows the new leader and reports what changed
    // meanwhile (the worker left: every partition is unowned), as the outcome of each.
    let watch = Watch::start(&coordinators, &certs, 16);
    watch.signal("STOP");
    let dead = leader;
    nodes.children.0[dead - 1].kill().unwrap();
    nodes.children.0[dead - 1].wait().unwrap();
    if let Err(e) = runtime.block_on(worker.leave()) {
        let said: Vec<String> = log_lines.try_iter().filter(|l| !l.contains("openraft")).collect();
        panic!("the worker leaves under the new leader: {e}; node 1 said:\n{}", said.join("\n"));
    }
    until("every partition is unowned", || {
        ctl_json(&coordinators, &certs, &["status"]).ok().filter(|s| s["unowned"] == 16)
    });
    watch.signal("CONT");
    let changes = watch.changes();
    let mut freed: Vec<u64> = changes.iter().map(|c| c["partition"].as_u64().unwrap()).collect();
    freed.sort();
    assert_eq!(freed, (0..16).collect::<Vec<u64>>(), "{changes:?}");
    assert!(changes.iter().all(|c| c["owner"].is_null()), "{changes:?}");

    // A dead node shows as one: health exits non-zero naming it, status reports its error.
    let unhealthy = ctl(&coordinators, &certs, &["-w", "json", "endpoint", "health"]).unwrap_err();
    assert!(unhealthy.contains("1 of 3 endpoints are unhealthy"), "{unhealthy}");
    let status = ctl_json(&coordinators, &certs, &["endpoint", "status"]).unwrap();
    let row = status.as_array().unwrap().iter().find(|e| e["endpoint"] == endpoint(dead)).unwrap().clone();
    assert!(row["error"].is_string() && row["id"].is_null(), "{row}");
}

/// Sends `child` the signal `name` (TERM, STOP, CONT).
fn signal(child: &Child, name: &str) {
    let sent = Command::new("sh").arg("-c").arg(format!("kill -{name} {}", child.id())).status().unwrap();
    assert!(sent.success(), "SIG{name} to process {}", child.id());
}

/// Each line `reader` gives, as it comes, on a channel (a thread reads, so a child's pipe never
/// fills up).
fn lines_of(reader: impl Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(reader).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// `tenure ctl -w json watch --max-events N` as the operator `ops`, started and watching;
/// killed if dropped before it is read.
struct Watch(Option<Child>);

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Watch {
    /// Returns once the watch has read every partition's route (its baseline).
    fn start(coordinators: &str, certs: &Path, max_events: u64) -> Watch {
        let mut child = ctl_command(coordinators, certs)
            .args(["-w", "json", "watch", "--max-events", &max_events.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let said = lines_of(child.stderr.take().unwrap());
        let first = said.recv_timeout(Duration::from_secs(60)).expect("the watch reports it is watching");
        assert_eq!(first, "watching 16 partitions");
        Watch(Some(child))
    }

    fn signal(&self, name: &str) {
        signal(self.0.as_ref().expect("running"), name);
    }

    /// The changes it printed, once it has printed its `max_events` and exited.
    fn changes(mut self) -> Vec<serde_json::Value> {
        let mut child = self.0.take().expect("running");
        let exited = until("the watch has printed its changes and exited", || child.try_wait().unwrap());
        assert!(exited.success(), "{exited:?}");
        let mut printed = String::new();
        child.stdout.take().unwrap().read_to_string(&mut printed).unwrap();
        printed.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }
}

/// `tenure serve` processes (three unless asked for more) on free loopback ports with the development certificates
/// (the worker of [`make_certs`] and the operator `ops`), killed when dropped.
struct Nodes {
    /// What every address names the nodes' host by: an IP literal or a host name.
    host: &'static str,
    dir: tempfile::TempDir,
    ports: Vec<u16>,
    peers: String,
    certs: std::path::PathBuf,
    children: Processes,
}

impl Nodes {
    /// Starts three; `tweak` adds to node `id`'s command before it runs.
    fn start(worker: &str, tweak: impl FnMut(usize, &mut Command)) -> Nodes {
        Nodes::start_on("127.0.0.1", 3, worker, tweak)
    }

    /// As [`Nodes::start`], `count` of them, with `host` in every address (`--peers`, the
    /// endpoints).
    fn start_on(
        host: &'static str,
        count: usize,
        worker: &str,
        mut tweak: impl FnMut(usize, &mut Command),
    ) -> Nodes {
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<u16> = (0..count).map(|_| free_port()).collect();
        let peers = peers_flag(host, &ports);
        let certs = make_certs(dir.path(), count, worker);
        let mut nodes = Nodes { host, dir, ports, peers, certs, children: Processes(Vec::new()) };
        for id in 1..=count {
            let mut command = nodes.serve(id);
            tweak(id, &mut command);
            nodes.children.0.push(command.spawn().unwrap());
        }
        nodes
    }

    /// `tenure serve` for node `id`, as it started (for a restart).
    fn serve(&self, id: usize) -> Command {
        serve(id, &self.peers, &self.certs, self.dir.path())
    }

    /// Node `id`'s client address.
    fn endpoint(&self, id: usize) -> String {
        format!("{}:{}", self.host, self.ports[id - 1])
    }

    /// Every node's client address, comma separated.
    fn endpoints(&self) -> String {
        (1..=self.ports.len()).map(|id| self.endpoint(id)).collect::<Vec<_>>().join(",")
    }
}

/// `--peers` for three nodes serving clients on `client_ports`, each with a free peer port.
fn peers_flag(host: &str, client_ports: &[u16]) -> String {
    let pair = |(i, port): (usize, &u16)| format!("{}={host}:{port}/{host}:{}", i + 1, free_port());
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
        .stdout(Stdio::null());
    // TENURE_TEST_NODE_LOGS=1 lets the nodes' logs through, to see what a failing run did.
    if std::env::var_os("TENURE_TEST_NODE_LOGS").is_some() {
        command.stderr(Stdio::inherit());
    } else {
        command.stderr(Stdio::null());
    }
    command
}

/// What an operator's rolling restart does: SIGTERM each `tenure serve` in turn, wait for it to
/// exit, start it again, wait for it to rejoin. The leader hands over before it exits; the
/// worker, in this process, never loses a partition and no partition changes owner or token.
#[test]
fn a_rolling_restart_by_sigterm_moves_nothing_and_loses_no_lease() {
    let mut nodes = Nodes::start("roller", |_, _| {});
    let certs = nodes.certs.clone();
    let addrs: Vec<String> = (1..=3).map(|id| nodes.endpoint(id)).collect();
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
    let mut events = worker.events().expect("events taken once");
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
        let child = &mut nodes.children.0[id - 1];
        signal(child, "TERM");
        let exited = until(&format!("node {id} exits after SIGTERM"), || child.try_wait().unwrap());
        assert!(exited.success(), "node {id} stopped cleanly: {exited:?}");
        nodes.children.0[id - 1] = nodes.serve(id).spawn().unwrap();
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
    while let Some(event) = events.try_recv() {
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
    // A snapshot every two entries, keeping two: the log the new node would need is gone by the
    // time it joins, so it must catch up from a snapshot.
    let snapshots = ["--snapshot-after-logs", "2"];
    for id in 1..=3 {
        let mut command = serve(id, &peers_of(3), &certs, dir.path());
        let child = command.args(["--lease-ttl-ms", "2000"]).args(snapshots).spawn();
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
    let mut events = worker.events().expect("events taken once");
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
    let metrics4 = free_port();
    let mut node4 = serve(4, &peers_of(4), &certs, dir.path());
    node4.arg("--join").args(snapshots).args(["--metrics-listen", &format!("127.0.0.1:{metrics4}")]);
    children.0.push(node4.spawn().unwrap());
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
    // It caught up by installing the leader's snapshot.
    let installed = sample(
        &http_get(&format!("127.0.0.1:{metrics4}"), "/metrics").expect("node 4's metrics"),
        "tenure_snapshot_bytes_count{how=\"installed\"}",
    );
    assert!(installed.is_some_and(|n| n >= 1.0), "node 4 installed a snapshot: {installed:?}");
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
    while let Some(event) = events.try_recv() {
        assert!(!matches!(event, tenure::worker::WorkerEvent::Lost { .. }), "the worker lost {event:?}");
    }
}
