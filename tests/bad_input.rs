//! Bad input gets a clear, typed error and changes nothing: unknown sessions, wrong secrets,
//! out-of-range partitions, oversized fields, garbage Raft messages and bad configurations.

mod common;

use common::*;
use tenure::proto;
use tenure::proto::peer::raft_transport_client::RaftTransportClient;
use tenure::proto::peer::RaftPayload;
use tenure::server::{NodeConfig, ERROR_METADATA};
use tonic::Code;

fn kind(status: &tonic::Status) -> &str {
    status.metadata().get(ERROR_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_sessions_secrets_and_partitions_are_refused_without_a_state_change() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let w = worker(&c, "w1").await;
    let before = settled(&c, 1).await;
    let leader = c.leader().unwrap();
    let mut client = api_client(&c, leader).await;

    let err = client
        .heartbeat(proto::HeartbeatRequest { session_id: 999, secret: "x".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::NotFound, "unknown_session"));

    let session_id = w.session().0;
    let err = client
        .heartbeat(proto::HeartbeatRequest { session_id, secret: "not-it".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "wrong_secret"));

    // On the heartbeat stream, a refusal is the stream's end, with the same status.
    let requests = tokio_stream::iter([proto::HeartbeatRequest {
        session_id,
        secret: "not-it".into(),
        ..Default::default()
    }]);
    let mut answers = client.heartbeats(requests).await.unwrap().into_inner();
    let err = answers.message().await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "wrong_secret"));
    let requests = tokio_stream::iter([proto::HeartbeatRequest {
        session_id: 999,
        secret: "x".into(),
        ..Default::default()
    }]);
    let mut answers = client.heartbeats(requests).await.unwrap().into_inner();
    let err = answers.message().await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::NotFound, "unknown_session"));

    let err = client
        .leave(proto::LeaveRequest { session_id, secret: "not-it".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "wrong_secret");

    let err = client
        .release(proto::ReleaseRequest {
            session_id,
            secret: "not-it".into(),
            partitions: vec![0],
            all: false,
            tokens: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "wrong_secret");
    // A token list that does not match the partitions is refused before it becomes an entry.
    let err = client
        .release(proto::ReleaseRequest {
            session_id,
            secret: "not-it".into(),
            partitions: vec![0, 1],
            all: false,
            tokens: vec![5],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::InvalidArgument, "invalid_argument"));

    let err = client
        .watch(proto::WatchRequest { session_id, secret: "not-it".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "wrong_secret");

    let err = client
        .heartbeat(proto::HeartbeatRequest { session_id, secret: "x".repeat(10_000), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::InvalidArgument, "invalid_argument"));

    // Joins the table would refuse are refused before they become log entries.
    let log_before = c.node(leader).expect("the leader runs").raft().metrics().borrow().last_log_index;
    let err = client
        .join(proto::JoinRequest { name: String::new(), weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::InvalidArgument, "invalid_name"));
    let err = client
        .join(proto::JoinRequest { name: "n".repeat(1000), weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "invalid_name");
    let err = client
        .join(proto::JoinRequest { name: "two\nlines".into(), weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "invalid_name");
    let err = client
        .join(proto::JoinRequest { name: "heavy".into(), weight: 1_000_000, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "invalid_weight");
    let err = client
        .join(proto::JoinRequest { name: "heaviest".into(), weight: u32::MAX, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "invalid_weight");
    let log_after = c.node(leader).expect("the leader runs").raft().metrics().borrow().last_log_index;
    assert_eq!(log_after, log_before, "a refused join appended nothing");

    // The worker's own secret works; out-of-range and foreign partitions are refused.
    // (Release goes through the library so the secret stays private to it.)
    let err = w.release(&[tenure::ids::PartitionId(24)]).await.unwrap_err();
    assert!(matches!(err, tenure::worker::ClientError::PartitionOutOfRange(_)), "{err:?}");

    // Garbage on the Raft port is refused, not applied.
    let mut raft = raft_client(&c, leader);
    let err = raft.append_entries(RaftPayload { data: b"\x00garbage".to_vec() }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // So is a message in a format version this build does not read (a peer on another
    // version): refused and named, and the node keeps serving (the checks below reach it).
    let other = vec![tenure::codec::FORMAT + 1, 0, 0];
    let err = raft.vote(RaftPayload { data: other }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("format version"), "{}", err.message());
    let err = raft.install_snapshot(RaftPayload { data: Vec::new() }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // A follower points at the leader.
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let mut on_follower = api_client(&c, follower).await;
    let err = on_follower
        .join(proto::JoinRequest { name: "w9".into(), weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::Unavailable, "not_leader"));
    let hinted = err.metadata().get(tenure::server::LEADER_METADATA).unwrap().to_str().unwrap();
    assert_eq!(hinted, c.addr(leader).to_string());

    let after = c.status().await.unwrap();
    assert_eq!(tokens(&after), tokens(&before), "nothing changed");
    assert_eq!(after.sessions.len(), 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_beyond_the_limit_are_refused_and_a_closed_one_frees_its_place() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.max_streams = 2;
    })
    .await
    .unwrap();
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let mut client = api_client(&c, leader).await;
    // Ownership and route streams share one budget, heartbeat streams have their own, so
    // subscribers cannot crowd out renewals.
    let routes = [
        client.routes(proto::RoutesRequest { ..Default::default() }).await.expect("first route stream"),
        client.routes(proto::RoutesRequest { ..Default::default() }).await.expect("second route stream"),
    ];
    let err = client.routes(proto::RoutesRequest { ..Default::default() }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "too_many_streams"));
    // Heartbeat streams held open with nothing sent yet.
    let mut held = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = tokio::sync::mpsc::channel::<proto::HeartbeatRequest>(1);
        let stream = client.heartbeats(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
        held.push((tx, stream.expect("a heartbeat stream within its own budget")));
    }
    let beats = || {
        tokio_stream::iter([proto::HeartbeatRequest {
            session_id: 999,
            secret: "x".into(),
            ..Default::default()
        }])
    };
    let err = client.heartbeats(beats()).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "too_many_streams"));
    drop(held.pop());
    let mut answers = eventually("the closed stream's place is free again", || {
        let mut client = client.clone();
        async move { client.heartbeats(beats()).await.ok() }
    })
    .await
    .into_inner();
    let err = answers.message().await.unwrap_err();
    assert_eq!(kind(&err), "unknown_session", "the new stream is served");
    drop(routes);
    eventually("a route stream's place is free again", || {
        let mut client = client.clone();
        async move { client.routes(proto::RoutesRequest { ..Default::default() }).await.ok() }
    })
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_heartbeat_stream_is_ended_after_two_ttls() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    let mut client = api_client(&c, leader).await;
    let (_keep_open, rx) = tokio::sync::mpsc::channel::<proto::HeartbeatRequest>(1);
    let opened = std::time::Instant::now();
    let mut answers =
        client.heartbeats(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    let err = tokio::time::timeout(PATIENCE, answers.message()).await.expect("ended").unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(opened.elapsed() >= TTL * 2, "ended after {:?}, before two TTLs", opened.elapsed());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_timings_that_cannot_keep_a_lease_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let mut config = c.worker_config("w1");
    config.heartbeat_interval = Some(std::time::Duration::ZERO);
    let err = tenure::worker::Worker::join(config.clone()).await.err().expect("refused");
    assert!(matches!(err, tenure::worker::ClientError::InvalidArgument(_)), "{err:?}");
    config.heartbeat_interval = Some(TTL); // a heartbeat per TTL cannot keep a TTL lease
    let err = tenure::worker::Worker::join(config).await.err().expect("refused");
    assert!(matches!(err, tenure::worker::ClientError::InvalidArgument(_)), "{err:?}");
    // The session the second attempt was given is handed back, not left to expire.
    let status = eventually("no session left behind", || async {
        c.status().await.ok().filter(|s| s.sessions.is_empty())
    })
    .await;
    assert!(status.partitions.iter().all(|r| r.owner == 0));
    c.shutdown().await;
}

/// Peers and clients are served on different listeners: a client that reaches a node's client
/// address (with a worker's certificate) cannot speak Raft there. A forged `Vote` with a far higher term (which would depose
/// the leader if a node took it in) and a forged `AppendEntries` are refused as unknown
/// methods, and the leader keeps its term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_messages_on_the_client_listener_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let metrics = || c.node(leader).expect("the leader runs").raft().metrics().borrow().clone();
    let before = metrics();
    for id in c.ids() {
        // A worker's certificate gets it through the client listener's handshake; the listener
        // still has no Raft to offer it.
        let tls = c.client_tls(&tenure::tls::Principal::Worker("w1".into())).unwrap();
        let endpoint = tonic::transport::Endpoint::from_shared(format!("https://{}", c.addr(id)))
            .unwrap()
            .tls_config(tls.config())
            .unwrap();
        let mut raft = RaftTransportClient::new(endpoint.connect().await.unwrap());
        let vote = openraft::raft::VoteRequest::<u64> {
            vote: openraft::Vote::new(before.current_term + 1000, id),
            last_log_id: before.last_log_index.map(|i| {
                openraft::LogId::new(
                    openraft::CommittedLeaderId::new(before.current_term + 1000, id),
                    i + 1000,
                )
            }),
        };
        let err = raft.vote(RaftPayload { data: tenure::codec::encode(&vote) }).await.unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
        let append = openraft::raft::AppendEntriesRequest::<tenure::raft::TypeConfig> {
            vote: openraft::Vote::new_committed(before.current_term + 1000, id),
            prev_log_id: None,
            entries: Vec::new(),
            leader_commit: None,
        };
        let err =
            raft.append_entries(RaftPayload { data: tenure::codec::encode(&append) }).await.unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    }
    let after = metrics();
    assert_eq!(after.current_term, before.current_term, "the forged vote reached no node");
    assert_eq!(c.leader(), Some(leader));
    c.shutdown().await;
}

#[test]
fn bad_node_configurations_are_refused() {
    let member = |i: u64| tenure::raft::Member {
        peer_addr: format!("127.0.0.1:{}", 7100 + i),
        client_addr: format!("127.0.0.1:{}", 7000 + i),
    };
    let peers = move |ids: &[u64]| ids.iter().map(|i| (*i, member(*i))).collect();
    let dir = std::path::PathBuf::from("unused");
    let cases: Vec<(NodeConfig, &str)> = vec![
        (NodeConfig::new(4, peers(&[1, 2, 3]), dir.clone()), "not among the peers"),
        (NodeConfig::new(0, peers(&[0, 1, 2]), dir.clone()), "reserved"),
        (
            {
                let mut c = NodeConfig::new(1, peers(&[1, 2]), dir.clone());
                let m = c.peers.get_mut(&2).unwrap();
                m.peer_addr = m.client_addr.clone();
                c
            },
            "node 2 serves peers and clients on one address",
        ),
        (
            {
                let mut c = NodeConfig::new(1, peers(&[1]), dir.clone());
                c.peers.get_mut(&1).unwrap().peer_addr.clear();
                c
            },
            "needs both a peer and a client address",
        ),
        (
            {
                let mut c = NodeConfig::new(1, peers(&[1]), dir.clone());
                c.partition_count = 0;
                c
            },
            "partition count",
        ),
        (
            {
                let mut c = NodeConfig::new(1, peers(&[1]), dir.clone());
                c.lease_ttl = std::time::Duration::from_millis(5);
                c
            },
            "lease TTL",
        ),
        (
            {
                let mut c = NodeConfig::new(1, peers(&[1]), dir.clone());
                c.election_timeout = c.raft_heartbeat_interval;
                c
            },
            "election timeout",
        ),
        (
            {
                let mut c = NodeConfig::new(1, peers(&[1]), dir.clone());
                c.max_streams = 0;
                c
            },
            "stream limit",
        ),
    ];
    for (config, needle) in cases {
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }
}

#[test]
fn the_binary_rejects_garbage_flags_with_a_clear_message() {
    let bin = env!("CARGO_BIN_EXE_tenure");
    let run = |args: &[&str]| std::process::Command::new(bin).args(args).output().unwrap();
    let out = run(&["serve", "--id", "1", "--peers", "1=nowhere/127.0.0.1:2", "--data-dir", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad address"));
    let out = run(&["serve", "--id", "1", "--peers", "1=127.0.0.1:1", "--data-dir", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected id=CLIENT_ADDR/PEER_ADDR"));
    let out = run(&["serve", "--id", "x", "--peers", "1=127.0.0.1:1/127.0.0.1:2", "--data-dir", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--id"));
    let out = run(&["serve", "--id", "2", "--peers", "1=127.0.0.1:1/127.0.0.1:2", "--data-dir", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not in --peers"));
    // `serve` for node 1 of a one-node cluster, with `extra` flags.
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--id", "1", "--peers", "1=127.0.0.1:1/127.0.0.1:2", "--data-dir", "x"];
        args.extend_from_slice(extra);
        run(&args)
    };
    // No TLS material and no --insecure: refused, naming both ways out.
    let out = serve(&[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls-ca") && err.contains("--insecure"), "{err}");
    // Half the TLS material is not enough.
    let out = serve(&["--tls-ca", "ca.pem"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-cert"));
    // Files that do not hold what they should are named.
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not PEM").unwrap();
    let junk = junk.to_str().unwrap();
    let out = serve(&["--tls-ca", junk, "--tls-cert", junk, "--tls-key", junk]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no PEM certificate"));
    // `tenure run` refuses a command it could never start before it joins (no coordinator
    // listens at this address: a join would only fail later, and differently).
    let run_cmd =
        |command: &str| run(&["run", "--coordinators", "127.0.0.1:1", "--name", "w", "--", command]);
    let out = run_cmd("no-such-command-anywhere");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no executable of that name on PATH"), "{err}");
    let out = run_cmd(junk);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not an executable file"), "{err}");
}

/// A snapshot that does not decode, sent by a peer with the leader's own vote, is refused when
/// its last chunk arrives: openraft never sees it (it would report the failed install as a
/// storage failure and stop the node), and the node keeps replicating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_snapshot_is_refused_and_the_node_keeps_running() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let follower = c.ids().into_iter().find(|id| *id != leader).expect("a follower");
    let vote = c.node(leader).expect("the leader runs").raft().metrics().borrow().vote;
    let mut raft = raft_client(&c, follower);
    let chunk = |offset: u64, data: Vec<u8>, done: bool| {
        let request = openraft::raft::InstallSnapshotRequest::<tenure::raft::TypeConfig> {
            vote,
            meta: openraft::SnapshotMeta {
                last_log_id: None,
                last_membership: Default::default(),
                snapshot_id: "forged".into(),
            },
            offset,
            data,
            done,
        };
        RaftPayload { data: tenure::codec::encode(&request) }
    };
    // Garbage in one chunk, and in two; a chunk whose predecessors never came.
    let err =
        raft.install_snapshot(chunk(0, vec![tenure::codec::FORMAT, 0xff, 0xff], true)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    raft.install_snapshot(chunk(0, vec![tenure::codec::FORMAT], false)).await.expect("a first chunk is kept");
    let err = raft.install_snapshot(chunk(1, vec![0xff; 64], true)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = raft.install_snapshot(chunk(4096, vec![1], true)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // The follower still runs and still applies what the leader commits.
    let running =
        c.node(follower).expect("the follower runs").raft().metrics().borrow().running_state.clone();
    assert!(running.is_ok(), "{running:?}");
    let w = worker(&c, "after").await;
    let applied = eventually("the follower to apply the join", || {
        let c = &c;
        async move {
            let m = c.node(follower)?.raft().metrics().borrow().clone();
            let leader_applied = c.node(leader)?.raft().metrics().borrow().last_applied;
            (m.last_applied >= leader_applied && m.running_state.is_ok()).then_some(m.last_applied)
        }
    })
    .await;
    assert!(applied.is_some());
    w.leave().await.expect("leaves");
    c.shutdown().await;
}

/// The leader's session cap: a new name beyond it is refused as `too_many_sessions` before
/// anything is proposed, a name that has a session may rejoin, and a leave makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_beyond_the_session_cap_are_refused_until_one_leaves() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.join_limits.max_sessions = 3;
    })
    .await
    .unwrap();
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let w1 = worker(&c, "w1").await;
    let w2 = worker(&c, "w2").await;
    let w3 = worker(&c, "w3").await;
    let before = settled(&c, 3).await;

    let log = || c.node(leader).expect("the leader runs").raft().metrics().borrow().last_log_index;
    let log_before = log();
    let principal = tenure::tls::Principal::Worker("w4".into());
    let mut w4 = api_client_as(&c, leader, &principal).await;
    let join_w4 = proto::JoinRequest { name: "w4".into(), weight: 1, ..Default::default() };
    let err = w4.join(join_w4.clone()).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "too_many_sessions"));
    assert!(err.message().contains('3'), "the message names the limit: {}", err.message());
    // The worker library names it too, and does not retry a limit waiting will not lift.
    let err = tenure::worker::Worker::join(c.worker_config("w4")).await.err().expect("w4 is refused");
    assert!(matches!(err, tenure::worker::ClientError::LimitReached(_)), "{err:?}");
    assert_eq!(log(), log_before, "a refused join appended nothing");
    assert_eq!(tokens(&c.status().await.unwrap()), tokens(&before), "nothing changed");

    // A worker that crashes and restarts under its own name replaces its session: not a new
    // name. (Dropped outside the runtime, the old handle stops renewing but cannot leave.)
    let old_session = w1.session();
    std::thread::spawn(move || drop(w1)).join().unwrap();
    let w1 = worker(&c, "w1").await;
    assert_ne!(w1.session(), old_session);
    let err = w4.join(join_w4.clone()).await.unwrap_err();
    assert_eq!(kind(&err), "too_many_sessions", "the cap is still full");

    // w2 leaves; its place is free once the leave is applied.
    w2.leave().await.expect("w2 leaves");
    let answer = eventually("w4 joins once w2 has left", || {
        let (mut w4, join) = (w4.clone(), join_w4.clone());
        async move { w4.join(join).await.ok() }
    })
    .await
    .into_inner();
    let status = c.status().await.unwrap();
    let names: Vec<&str> = status.sessions.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"w1") && names.contains(&"w3"), "the others kept their sessions: {names:?}");
    drop(w3);
    let status = c.status().await.unwrap();
    assert!(status.sessions.iter().any(|s| s.id == answer.session_id), "w4 has a session");
    c.shutdown().await;
}

/// A burst of 10,000 joins from one stolen worker certificate: the leader admits no more than
/// its burst plus its rate over the time the burst took, refuses the rest as `too_many_joins`
/// (none becomes a log entry), and a worker already in the cluster keeps its session and its
/// leases throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_joins_is_held_to_the_leaders_rate() {
    use futures::StreamExt;
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let (burst, per_second) = (50u32, 20u32);
    let c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.join_limits.join_burst = burst;
        cfg.join_limits.joins_per_second = per_second;
    })
    .await
    .unwrap();
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let steady = worker(&c, "steady").await;
    settled(&c, 1).await;
    let session = steady.session();

    let principal = tenure::tls::Principal::Worker("storm".into());
    let client = api_client_as(&c, leader, &principal).await;
    let started = std::time::Instant::now();
    let answers: Vec<_> = futures::stream::iter(0..10_000)
        .map(|_| {
            let mut client = client.clone();
            async move {
                client
                    .join(proto::JoinRequest { name: "storm".into(), weight: 1, ..Default::default() })
                    .await
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let took = started.elapsed();
    let admitted = answers.iter().filter(|a| a.is_ok()).count();
    for refused in answers.iter().filter_map(|a| a.as_ref().err()) {
        assert_eq!((refused.code(), kind(refused)), (Code::ResourceExhausted, "too_many_joins"));
    }
    // The bucket's bound, with the whole burst's duration as the interval (an upper bound on
    // the time the leader saw it for).
    let bound = f64::from(burst) + f64::from(per_second) * took.as_secs_f64() + 1.0;
    assert!(admitted >= burst as usize, "the burst itself is admitted: {admitted}");
    assert!((admitted as f64) <= bound, "{admitted} joins admitted in {took:?}, bound {bound}");

    // The steady worker kept its session and holds what the table gives it.
    let status = workers_agree(&c, &[&steady]).await;
    assert!(status.sessions.iter().any(|s| s.id == session.0), "steady's session lives on");
    assert!(c.leader().is_some(), "the cluster still has a leader");
    steady.leave().await.expect("steady leaves");
    c.shutdown().await;
}

/// A name of a megabyte is a bad name; a message over the client listener's size limit is
/// refused before it is decoded, as RESOURCE_EXHAUSTED, on a call and on a heartbeat stream.
/// Neither appends anything, and the node keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_name_is_invalid_and_an_oversized_message_is_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let w = worker(&c, "w1").await;
    let before = settled(&c, 1).await;
    let leader = c.leader().unwrap();
    let log = || c.node(leader).expect("the leader runs").raft().metrics().borrow().last_log_index;
    let log_before = log();
    let mut client = api_client(&c, leader).await;

    let megabyte = "n".repeat(1 << 20);
    let err = client
        .join(proto::JoinRequest { name: megabyte, weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::InvalidArgument, "invalid_name"));

    let huge = "n".repeat(tenure::server::MAX_CLIENT_MESSAGE_BYTES + 1);
    let err = client
        .join(proto::JoinRequest { name: huge.clone(), weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "message_too_large"), "{err:?}");
    let beat = proto::HeartbeatRequest { session_id: w.session().0, secret: huge, ..Default::default() };
    let outcome = client.heartbeats(tokio_stream::iter([beat])).await;
    let err = match outcome {
        Ok(answers) => answers.into_inner().message().await.unwrap_err(),
        Err(err) => err,
    };
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "message_too_large"), "{err:?}");
    // The peer listener has a larger limit (a snapshot chunk), enforced the same way.
    let too_big = vec![0u8; tenure::raft::network::MAX_RAFT_MESSAGE_BYTES + 1];
    let err = raft_client(&c, leader).append_entries(RaftPayload { data: too_big }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "message_too_large"), "{err:?}");

    assert_eq!(log(), log_before, "nothing was appended");
    let after = workers_agree(&c, &[&w]).await;
    assert_eq!(tokens(&after), tokens(&before), "nothing changed");
    c.shutdown().await;
}

/// One client (one certificate's principal) holds at most its share of a node's streams, over
/// however many connections: a leak in one worker cannot use up the node's budget, and
/// another worker still gets its streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_take_every_stream_of_a_node() {
    use tenure::tls::Principal;
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.max_streams_per_client = 2;
    })
    .await
    .unwrap();
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let w1 = Principal::Worker("w1".into());
    let mut greedy = api_client_as(&c, leader, &w1).await;
    let held = [
        greedy.routes(proto::RoutesRequest { ..Default::default() }).await.expect("first stream"),
        greedy.routes(proto::RoutesRequest { ..Default::default() }).await.expect("second stream"),
    ];
    let err = greedy.routes(proto::RoutesRequest { ..Default::default() }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::ResourceExhausted, "too_many_client_streams"));
    assert!(err.message().contains('2'), "the message names the limit: {}", err.message());
    // Heartbeat streams count against the same share.
    let beat = proto::HeartbeatRequest { session_id: 999, secret: "x".into(), ..Default::default() };
    let err = greedy.heartbeats(tokio_stream::iter([beat])).await.unwrap_err();
    assert_eq!(kind(&err), "too_many_client_streams");
    // Another connection under the same certificate is the same client.
    let mut again = api_client_as(&c, leader, &w1).await;
    let err = again.routes(proto::RoutesRequest { ..Default::default() }).await.unwrap_err();
    assert_eq!(kind(&err), "too_many_client_streams");
    // Another worker is not crowded out.
    let mut other = api_client_as(&c, leader, &Principal::Worker("w2".into())).await;
    other.routes(proto::RoutesRequest { ..Default::default() }).await.expect("w2 gets a stream");
    drop(held);
    eventually("w1's places are free again once its streams close", || {
        let mut greedy = greedy.clone();
        async move { greedy.routes(proto::RoutesRequest { ..Default::default() }).await.ok() }
    })
    .await;
    c.shutdown().await;
}
