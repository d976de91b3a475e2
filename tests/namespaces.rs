//! Namespaces through the public API: an operator creates, lists, changes and deletes them on a
//! running 3-node cluster; workers join one each (one name in two at once); each namespace has
//! its own partitions, sessions, TTL and tokens; a leader change and a crashed worker in one
//! leave the other alone; bad names and unknown namespaces get typed errors.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::time::Duration;
use tenure::local_cluster::{is_settled, LocalCluster};
use tenure::proto::operator_client::OperatorClient;
use tenure::proto::{self, StatusRequest, StatusResponse};
use tenure::tls::Principal;
use tenure::worker::{Worker, WorkerConfig};
use tonic::Code;

fn kind(status: &tonic::Status) -> &str {
    status.metadata().get(tenure::server::ERROR_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("")
}

async fn operator(c: &LocalCluster) -> OperatorClient<tonic::transport::Channel> {
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    OperatorClient::new(channel_as(c, leader, &Principal::Operator("ops".into())).await)
}

/// The status of `namespace` from the leader, linearizably.
async fn status_in(c: &LocalCluster, namespace: &str) -> Option<StatusResponse> {
    let request = StatusRequest { namespace: namespace.into(), linearizable: true, ..Default::default() };
    c.client().read_status(request, None).await.ok()
}

async fn settled_in(c: &LocalCluster, namespace: &str, sessions: usize) -> StatusResponse {
    eventually(&format!("{sessions} sessions own {namespace}'s table, balanced"), || async {
        status_in(c, namespace).await.filter(|s| is_settled(s, sessions))
    })
    .await
}

fn config_in(c: &LocalCluster, name: &str, namespace: &str) -> WorkerConfig {
    let mut config = c.worker_config(name);
    config.namespace = namespace.into();
    config
}

/// Waits until each worker believes exactly what `namespace`'s table gives its session.
async fn agree_in(c: &LocalCluster, namespace: &str, workers: &[&Worker]) -> StatusResponse {
    eventually(&format!("workers believe what {namespace}'s table says"), || async {
        let status = status_in(c, namespace).await?;
        for w in workers {
            let want: BTreeMap<_, _> = status
                .partitions
                .iter()
                .filter(|r| r.owner == w.session().0 && !r.revoking)
                .map(|r| (tenure::ids::PartitionId(r.partition), tenure::ids::FencingToken(r.token)))
                .collect();
            if w.owned() != want {
                return None;
            }
        }
        Some(status)
    })
    .await
}

fn create(name: &str, partitions: u32, ttl_ms: u64) -> proto::CreateNamespaceRequest {
    proto::CreateNamespaceRequest {
        name: name.into(),
        partition_count: partitions,
        lease_ttl_ms: ttl_ms,
        max_revoking: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn namespaces_are_separate_jobs_on_one_cluster_from_creation_to_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cluster(dir.path()).await;
    let mut ops = operator(&c).await;

    // Bad requests change nothing.
    let bad = ops.create_namespace(create("Not A Name", 8, 2000)).await.unwrap_err();
    assert_eq!((bad.code(), kind(&bad)), (Code::InvalidArgument, "invalid_namespace"));
    let bad = ops.create_namespace(create("", 8, 2000)).await.unwrap_err();
    assert_eq!((bad.code(), kind(&bad)), (Code::InvalidArgument, "invalid_namespace"), "a creation names it");
    let bad = ops.create_namespace(create("billing", 0, 2000)).await.unwrap_err();
    assert_eq!((bad.code(), kind(&bad)), (Code::InvalidArgument, "invalid_config"));
    let bad = ops.create_namespace(create("billing", 8, 1)).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    let unknown = Worker::join(config_in(&c, "early", "billing")).await.err().expect("no such namespace yet");
    assert!(unknown.to_string().contains("billing"), "{unknown}");
    let listed = ops.list_namespaces(proto::ListNamespacesRequest {}).await.unwrap().into_inner();
    let names: Vec<&str> = listed.namespaces.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["default"], "nothing was created by the refused calls");

    // Created, then created again with the same settings (a retry) or refused with others.
    let info = ops.create_namespace(create("billing", 8, 2000)).await.expect("created").into_inner();
    assert_eq!((info.name.as_str(), info.partition_count, info.lease_ttl_ms), ("billing", 8, 2000));
    assert_eq!((info.sessions, info.unowned), (0, 8));
    ops.create_namespace(create("billing", 8, 2000)).await.expect("the same creation again is a no-op");
    let clash = ops.create_namespace(create("billing", 16, 2000)).await.unwrap_err();
    assert_eq!((clash.code(), kind(&clash)), (Code::FailedPrecondition, "config_mismatch"));

    // A hostile or confused client: a name of 100 KB is refused without being echoed back, and
    // a session's secret does not open the session of the same number in another namespace.
    let leader = c.leader().expect("a leader");
    let mut raw = api_client_as(&c, leader, &Principal::Worker("raw".into())).await;
    let huge = proto::JoinRequest { name: "raw".into(), weight: 1, namespace: "a".repeat(100_000) };
    let refused = raw.join(huge).await.unwrap_err();
    assert_eq!((refused.code(), kind(&refused)), (Code::InvalidArgument, "invalid_namespace"));
    assert!(refused.message().len() < 500, "{} bytes of error", refused.message().len());
    let join_in =
        |namespace: &str| proto::JoinRequest { name: "raw".into(), weight: 1, namespace: namespace.into() };
    let in_default = raw.join(join_in("")).await.expect("joins default").into_inner();
    let in_billing = raw.join(join_in("billing")).await.expect("joins billing").into_inner();
    assert_eq!(in_default.session_id, in_billing.session_id, "session numbers belong to their namespace");
    assert_eq!(in_billing.partition_count, 8);
    let beat = |joined: &proto::JoinResponse, namespace: &str| proto::HeartbeatRequest {
        session_id: joined.session_id,
        secret: joined.secret.clone(),
        namespace: namespace.into(),
        ..Default::default()
    };
    raw.heartbeat(beat(&in_billing, "billing")).await.expect("billing's session renews in billing");
    let crossed = raw.heartbeat(beat(&in_default, "billing")).await.unwrap_err();
    assert_eq!((crossed.code(), kind(&crossed)), (Code::PermissionDenied, "wrong_secret"), "{crossed:?}");
    for (joined, namespace) in [(&in_default, ""), (&in_billing, "billing")] {
        let (session_id, secret) = (joined.session_id, joined.secret.clone());
        let leave = proto::LeaveRequest { session_id, secret: secret.clone(), namespace: namespace.into() };
        raw.leave(leave).await.expect("leaves");
        let all = proto::ReleaseRequest {
            session_id,
            secret,
            all: true,
            namespace: namespace.into(),
            ..Default::default()
        };
        let _ = raw.release(all).await; // the last release may end the session before it answers
    }

    // One worker name in both namespaces, as one process may be; a second worker in billing.
    let a = Worker::join(c.worker_config("shared-name")).await.expect("joins default");
    let b = Worker::join(config_in(&c, "shared-name", "billing")).await.expect("joins billing");
    assert_eq!(b.lease_ttl(), Duration::from_millis(2000), "billing's TTL, not default's");
    assert_eq!(a.lease_ttl(), TTL);
    assert_eq!(b.keyspace().partition_count(), 8);
    settled_in(&c, "default", 1).await;
    settled_in(&c, "billing", 1).await;
    let default_before = agree_in(&c, "default", &[&a]).await;
    let b2 = Worker::join(config_in(&c, "billing-2", "billing")).await.expect("joins billing");
    settled_in(&c, "billing", 2).await;
    let billing = agree_in(&c, "billing", &[&b, &b2]).await;
    assert_eq!(billing.namespace, "billing");
    assert_eq!(billing.partition_count, 8);
    assert_eq!(billing.lease_ttl_ms, 2000);
    let default_now = agree_in(&c, "default", &[&a]).await;
    assert_eq!(tokens(&default_now), tokens(&default_before), "a join in billing moved nothing in default");
    assert_eq!(a.owned().len(), 24);

    // In use: not deleted. The default namespace never is.
    let busy =
        ops.delete_namespace(proto::DeleteNamespaceRequest { name: "billing".into() }).await.unwrap_err();
    assert_eq!((busy.code(), kind(&busy)), (Code::FailedPrecondition, "namespace_in_use"));
    let default =
        ops.delete_namespace(proto::DeleteNamespaceRequest { name: "default".into() }).await.unwrap_err();
    assert_eq!((default.code(), kind(&default)), (Code::FailedPrecondition, "default_namespace"));

    // A TTL change in billing reaches billing's workers and nobody else.
    let set = proto::SetLeaseTtlRequest { lease_ttl_ms: 1500, namespace: "billing".into() };
    assert_eq!(ops.set_lease_ttl(set).await.expect("set").into_inner().was_ms, 2000);
    eventually("billing's workers follow its new TTL", || async {
        (b.lease_ttl() == Duration::from_millis(1500) && b2.lease_ttl() == Duration::from_millis(1500))
            .then_some(())
    })
    .await;
    assert_eq!(a.lease_ttl(), TTL);

    // A leader change: every namespace's leases are judged again by the new leader, and
    // nobody loses a partition.
    let old_leader = c.leader().expect("a leader");
    c.stop_gracefully(old_leader, PATIENCE).await.expect("leadership handed over");
    c.wait_for_leader(PATIENCE).await.expect("a new leader");
    let mut ops = operator(&c).await;
    let after_default = agree_in(&c, "default", &[&a]).await;
    let after_billing = agree_in(&c, "billing", &[&b, &b2]).await;
    assert_eq!(tokens(&after_default), tokens(&default_now), "default's grants survived the leader change");
    assert_eq!(tokens(&after_billing), tokens(&billing), "billing's grants survived the leader change");

    // A crashed worker in billing: its partitions expire to the other one; default is untouched.
    let b2_session = b2.session();
    b2.abandon();
    let alone = settled_in(&c, "billing", 1).await;
    assert!(alone.partitions.iter().all(|r| r.owner == b.session().0));
    assert!(alone.sessions.iter().all(|s| s.id != b2_session.0));
    for row in &alone.partitions {
        let (_, before) = tokens(&billing)[&row.partition];
        assert!(row.token >= before, "partition {}: token {} after {before}", row.partition, row.token);
    }
    assert_eq!(tokens(&agree_in(&c, "default", &[&a]).await), tokens(&default_now));

    // Emptied, then deleted; its name is free and a new namespace under it starts afresh, with
    // tokens above every token the old one gave.
    let highest_old = alone.partitions.iter().map(|r| r.token).max().unwrap();
    // A front-end following billing's routes sees its 8 rows, then the stream ends with it.
    let leader = c.leader().expect("a leader");
    let request = proto::RoutesRequest { namespace: "billing".into() };
    let mut routes = api_client(&c, leader).await.routes(request).await.expect("routes").into_inner();
    for _ in 0..8 {
        let row = routes.message().await.expect("a row").expect("the stream lives");
        assert_eq!((row.partition_count, row.session_id), (8, b.session().0));
    }
    b.leave().await.expect("b leaves");
    let gone =
        eventually("billing has no session left", || {
            let mut ops = ops.clone();
            async move {
                ops.delete_namespace(proto::DeleteNamespaceRequest { name: "billing".into() }).await.ok()
            }
        })
        .await;
    assert_eq!(gone.into_inner().partitions, 8);
    let ended = tokio::time::timeout(PATIENCE, async {
        loop {
            match routes.message().await {
                Ok(Some(row)) => assert_eq!(row.partition_count, 8, "only billing's rows: {row:?}"),
                Ok(None) => panic!("the route stream ended without saying why"),
                Err(status) => return status,
            }
        }
    })
    .await
    .expect("the route stream ends once billing is deleted");
    assert_eq!((ended.code(), kind(&ended)), (Code::NotFound, "unknown_namespace"));
    let listed = ops.list_namespaces(proto::ListNamespacesRequest {}).await.unwrap().into_inner();
    assert_eq!(listed.namespaces.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["default"]);
    let missing = c
        .client()
        .read_status(StatusRequest { namespace: "billing".into(), ..Default::default() }, None)
        .await
        .unwrap_err();
    assert!(missing.to_string().contains("billing"), "{missing}");
    ops.create_namespace(create("billing", 4, 1000)).await.expect("created again");
    let again = Worker::join(config_in(&c, "billing-3", "billing")).await.expect("joins the new billing");
    let fresh = settled_in(&c, "billing", 1).await;
    assert_eq!(fresh.partition_count, 4);
    assert!(
        fresh.partitions.iter().all(|r| r.token > highest_old),
        "tokens only grow: {:?}",
        fresh.partitions
    );
    agree_in(&c, "billing", &[&again]).await;
    assert_eq!(a.owned().len(), 24, "default kept every partition throughout");
    c.shutdown().await;
}
