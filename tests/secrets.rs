//! Session secrets are kept only as hashes: whoever reads a node's disk (its RocksDB log, state
//! and snapshots) learns no secret that would let them renew, release or leave for a worker.

mod common;

use common::*;
use tenure::proto;

/// Every file under `dir`, read whole.
fn files(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path) {
                out.push((path, bytes));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_keeps_a_session_secret_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (mut client, joined) = raw_join(&c, "w").await;
    assert!(joined.secret.len() >= 32, "a secret of 128 bits or more: {:?}", joined.secret);
    // The secret works, and every command that carries one for the session is in the log: a
    // heartbeat, a release of everything, a leave.
    client
        .heartbeat(proto::HeartbeatRequest {
            session_id: joined.session_id,
            secret: joined.secret.clone(),
            ..Default::default()
        })
        .await
        .expect("the secret authenticates");
    eventually("the worker owns the table", || async {
        let status = c.status().await.ok()?;
        status.partitions.iter().all(|p| p.owner == joined.session_id).then_some(())
    })
    .await;
    client
        .release(proto::ReleaseRequest {
            session_id: joined.session_id,
            secret: joined.secret.clone(),
            all: true,
            ..Default::default()
        })
        .await
        .expect("released");
    // Every node applied the release (the table is unowned again everywhere), so every node's
    // log and state have seen each command.
    for id in c.ids() {
        let node = c.node(id).expect("running");
        eventually("every node applied the release", || async {
            let applied = node.node.state.read().unwrap();
            applied.default_table().partitions().iter().all(|p| p.owner.is_none()).then_some(())
        })
        .await;
    }
    let needle = joined.secret.as_bytes();
    let mut scanned = 0;
    for id in c.ids() {
        for (path, bytes) in files(&c.data_dir(id).expect("a data directory")) {
            scanned += bytes.len();
            assert!(
                !bytes.windows(needle.len()).any(|w| w == needle),
                "the session's secret is in {} in clear",
                path.display()
            );
        }
    }
    assert!(scanned > 0, "the nodes' data directories were empty");
    c.shutdown().await;
}
