//! Planned stops and membership. A leader stopped the way SIGTERM stops it hands leadership to
//! a follower, and no worker loses a lease or a partition over it; a follower stopped that way
//! just leaves; the peer call a handover uses cannot depose a live leader; the membership calls
//! are an operator's, and bad ones change nothing; health follows what a node knows, and
//! reflection lists the API; maintenance mode holds live owners still, and an operator's weight
//! moves partitions and outlives the session it was set on; a worker's bounded shutdown leaves
//! when it can and stops believing when it cannot. (Replacing a node is in `processes.rs`.)

mod common;

use common::*;
use std::time::{Duration, Instant};
use tenure::proto::peer::CampaignRequest;
use tenure::worker::{Events, WorkerEvent};
use tonic::Code;

/// Enough that a renewal refused during the handover is retried well inside the lease.
const LONG_TTL: Duration = Duration::from_secs(3);
const BOUND: Duration = Duration::from_secs(20);

fn no_loss(events: &mut Events, who: &str) {
    while let Some(event) = events.try_recv() {
        assert!(!matches!(event, WorkerEvent::Lost { .. }), "{who} lost a partition: {event:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_gracefully_hands_over_and_no_worker_loses_a_lease() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut c = tenure::local_cluster::LocalCluster::start(3, dir.path(), |cfg| {
        fast(cfg);
        cfg.lease_ttl = LONG_TTL;
    })
    .await
    .unwrap();
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let mut w1 = worker(&c, "w1").await;
    let mut w2 = worker(&c, "w2").await;
    let mut events = [w1.events().expect("events taken once"), w2.events().expect("events taken once")];
    settled(&c, 2).await;
    let before = workers_agree(&c, &[&w1, &w2]).await;
    // What the join of w2 took from w1 (revoked, and not released by this test, which holds
    // the event streams) is over; from here on nothing may be lost.
    for rx in &mut events {
        while rx.try_recv().is_some() {}
    }

    // A follower stopped gracefully has nothing to hand over.
    let follower = c.ids().into_iter().find(|id| *id != leader).unwrap();
    assert_eq!(c.stop_gracefully(follower, BOUND).await, None);
    c.restart(follower).await.expect("the follower restarts");

    let started = Instant::now();
    let successor = c.stop_gracefully(leader, BOUND).await.expect("leadership is handed over");
    println!("handover from node {leader} to node {successor} took {:?}", started.elapsed());
    assert_ne!(successor, leader);
    assert_eq!(c.wait_for_leader(PATIENCE).await, Some(successor), "the successor leads");

    // A leader change moves nothing: every partition keeps its owner and token, and both
    // workers renew with the new leader without ever dropping a partition.
    let renewed_after = Instant::now();
    eventually("both workers renew with the new leader", || async {
        let believed = [&w1, &w2].iter().all(|w| !w.owned().is_empty());
        (believed && renewed_after.elapsed() > LONG_TTL).then_some(())
    })
    .await;
    let after = workers_agree(&c, &[&w1, &w2]).await;
    assert_eq!(tokens(&after), tokens(&before), "no partition moved");
    no_loss(&mut events[0], "w1");
    no_loss(&mut events[1], "w2");

    // The old leader comes back as a follower of the new one.
    c.restart(leader).await.expect("the old leader restarts");
    eventually("the old leader follows the new one", || async {
        let m = c.node(leader)?.raft().metrics().borrow().clone();
        (m.current_leader == Some(successor)).then_some(())
    })
    .await;
    w1.leave().await.expect("w1 leaves");
    w2.leave().await.expect("w2 leaves");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_request_cannot_depose_a_live_leader() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    let term = c.node(leader).unwrap().raft().metrics().borrow().current_term;
    let follower = c.ids().into_iter().find(|id| *id != leader).unwrap();
    let other = c.ids().into_iter().find(|id| *id != leader && *id != follower).unwrap();

    // From a node that does not lead: refused, whatever it claims to be.
    let mut from_other = raft_client(&c, follower);
    let hosts = ["127.0.0.1".to_string()];
    let as_other = c.ca().issue(&tenure::tls::Principal::Node(other), &hosts, Default::default()).unwrap();
    let mut from_other_cert = raft_client_as(&c, follower, &c.ca().ca_pem(), Some(&as_other));
    let err = from_other_cert.campaign(CampaignRequest { leader: other, term }).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let err = from_other_cert.campaign(CampaignRequest { leader, term }).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "a node may not speak for the leader: {err:?}");
    // Claiming the leader in another term: refused too.
    let err = from_other.campaign(CampaignRequest { leader: follower, term: term + 1 }).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    // Refused before anything was scheduled: the same leader, in the same term.
    let m = c.node(leader).unwrap().raft().metrics().borrow().clone();
    assert_eq!((m.current_leader, m.current_term), (Some(leader), term));
    c.shutdown().await;
}

fn kind(status: &tonic::Status) -> &str {
    status.metadata().get(tenure::server::ERROR_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_calls_are_an_operators_and_bad_ones_change_nothing() {
    use tenure::proto::operator_client::OperatorClient;
    use tenure::proto::{AddMemberRequest, ListMembersRequest, PromoteMemberRequest, RemoveMemberRequest};
    use tenure::tls::Principal;
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    let mut ops = OperatorClient::new(channel_as(&c, leader, &Principal::Operator("ops".into())).await);
    let before = eventually("the leader reports how far every member has replicated", || {
        let mut ops = ops.clone();
        async move {
            let members =
                ops.list_members(ListMembersRequest {}).await.expect("an operator lists").into_inner();
            members.members.iter().all(|m| m.matched_index.is_some()).then_some(members)
        }
    })
    .await;
    assert_eq!(before.members.iter().filter(|m| m.voter).count(), 3, "{before:?}");
    assert_eq!(before.leader_id, leader);

    // A worker may not even look.
    let mut worker = OperatorClient::new(channel_as(&c, leader, &Principal::Worker("w1".into())).await);
    let err = worker.list_members(ListMembersRequest {}).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"));
    let add =
        |id: u64, addr: &str| AddMemberRequest { id, addr: addr.into(), peer_addr: "127.0.0.1:1".into() };
    let err = worker.add_member(add(4, "127.0.0.1:2")).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"));

    // Bad requests are refused with what is wrong.
    let err = ops.add_member(add(0, "127.0.0.1:2")).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::InvalidArgument, "invalid_argument"));
    for addr in ["no-port", ":7001", "host:99999", "two words:1"] {
        let err = ops.add_member(add(4, addr)).await.unwrap_err();
        assert_eq!((err.code(), kind(&err)), (Code::InvalidArgument, "invalid_argument"), "{addr}");
    }
    let err = ops.add_member(add(2, "127.0.0.1:2")).await.unwrap_err();
    assert!(err.message().contains("never reused"), "an id in use at another address: {err:?}");
    let err = ops.promote_member(PromoteMemberRequest { id: 9 }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::NotFound, "unknown_member"));
    let err = ops.remove_member(RemoveMemberRequest { id: 9 }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::NotFound, "unknown_member"));
    // Promoting a voter, or adding a member again as it is, changes nothing.
    ops.promote_member(PromoteMemberRequest { id: leader }).await.expect("already a voter");
    let same = before.members.iter().find(|m| m.id == leader).unwrap();
    let again = AddMemberRequest { id: leader, addr: same.addr.clone(), peer_addr: same.peer_addr.clone() };
    ops.add_member(again).await.expect("the same member again");
    // A follower points at the leader.
    let follower = c.ids().into_iter().find(|id| *id != leader).unwrap();
    let mut on_follower =
        OperatorClient::new(channel_as(&c, follower, &Principal::Operator("ops".into())).await);
    let err = on_follower.remove_member(RemoveMemberRequest { id: follower }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::Unavailable, "not_leader"));

    let after = ops.list_members(ListMembersRequest {}).await.unwrap().into_inner();
    let ids =
        |m: &tenure::proto::MembersResponse| m.members.iter().map(|m| (m.id, m.voter)).collect::<Vec<_>>();
    assert_eq!(ids(&after), ids(&before), "the membership did not change");
    assert_eq!(after.last_log_index, before.last_log_index, "nothing was appended");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_what_a_node_knows_and_reflection_lists_the_api() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let dir = tempfile::tempdir().unwrap();
    let mut c = cluster(dir.path()).await;
    let ops = tenure::tls::Principal::Operator("ops".into());
    let status_of = |channel: tonic::transport::Channel, service: &'static str| async move {
        let request = HealthCheckRequest { service: service.into() };
        let answer = HealthClient::new(channel).check(request).await.ok()?;
        ServingStatus::try_from(answer.into_inner().status).ok()
    };
    for id in c.ids() {
        let channel = channel_as(&c, id, &ops).await;
        for service in ["", "tenure.v1.Coordinator"] {
            eventually(&format!("node {id} serves {service:?}"), || {
                let channel = channel.clone();
                async move { (status_of(channel, service).await == Some(ServingStatus::Serving)).then_some(()) }
            })
            .await;
        }
    }

    // Reflection names every service, so grpcurl can list and call them.
    let channel = channel_as(&c, c.leader().unwrap(), &ops).await;
    let list = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([list]))
        .await
        .expect("reflection answers")
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let names: Vec<String> = match answer.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("not a list of services: {other:?}"),
    };
    for service in ["tenure.v1.Coordinator", "tenure.v1.Operator", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == service), "{service} is not listed: {names:?}");
    }

    // A node cut off from every other one loses its leader and says so.
    let leader = c.leader().unwrap();
    let survivor = c.ids().into_iter().find(|id| *id != leader).unwrap();
    let channel = channel_as(&c, survivor, &ops).await;
    for id in c.ids().into_iter().filter(|id| *id != survivor) {
        c.stop(id).await;
    }
    eventually("the lone node reports NOT_SERVING", || {
        let channel = channel.clone();
        async move { (status_of(channel, "").await == Some(ServingStatus::NotServing)).then_some(()) }
    })
    .await;
    for id in c.ids().into_iter().filter(|id| *id != survivor) {
        c.restart(id).await.expect("restarts");
    }
    eventually("it serves again once there is a leader", || {
        let channel = channel.clone();
        async move { (status_of(channel, "").await == Some(ServingStatus::Serving)).then_some(()) }
    })
    .await;
    c.shutdown().await;
}

/// `ctl drain`: an operator ends a worker's session the way its own leave would. Its partitions
/// are revoked and, given back by the worker, go to the other worker; the session then ends and
/// the worker is told; nothing is lost and the other worker's partitions keep their tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_drain_moves_a_workers_partitions_gracefully_and_ends_its_session() {
    use tenure::proto::operator_client::OperatorClient;
    use tenure::proto::DrainRequest;
    use tenure::tls::Principal;
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    let mut w1 = worker(&c, "w1").await;
    let w2 = worker(&c, "w2").await;
    let mut events = w1.events().expect("events taken once");
    settled(&c, 2).await;
    let before = workers_agree(&c, &[&w1, &w2]).await;
    while events.try_recv().is_some() {} // what the join of w2 took from w1 is over
    let held_by_w1: Vec<u32> =
        before.partitions.iter().filter(|r| r.owner == w1.session().0).map(|r| r.partition).collect();

    let mut worker_cert = OperatorClient::new(channel_as(&c, leader, &Principal::Worker("w2".into())).await);
    let err = worker_cert.drain(DrainRequest { name: "w1".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(
        (err.code(), kind(&err)),
        (Code::PermissionDenied, "not_allowed"),
        "a worker may not drain another"
    );
    let mut ops = OperatorClient::new(channel_as(&c, leader, &Principal::Operator("ops".into())).await);
    let err = ops.drain(DrainRequest { name: "nobody".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::NotFound, "unknown_worker"));

    let drained = ops
        .drain(DrainRequest { name: "w1".into(), ..Default::default() })
        .await
        .expect("w1 is drained")
        .into_inner();
    assert_eq!(drained.sessions, vec![w1.session().0]);
    // w1 does what an application does: gives back each partition it is asked for.
    let (mut released, mut ended) = (Vec::new(), false);
    while !ended {
        let event =
            tokio::time::timeout(PATIENCE, events.recv()).await.expect("an event").expect("the stream lives");
        match event {
            WorkerEvent::Revoking { partition, .. } => w1.release(&[partition]).await.expect("released"),
            WorkerEvent::Released { partition, .. } => released.push(partition.0),
            WorkerEvent::SessionEnded { .. } => ended = true,
            WorkerEvent::Lost { .. } => panic!("w1 lost a partition while being drained: {event:?}"),
            WorkerEvent::Granted(_) => {}
        }
    }
    released.sort();
    assert_eq!(released, held_by_w1, "every partition w1 held was given back, none expired");
    let after = settled(&c, 1).await;
    assert!(after.partitions.iter().all(|r| r.owner == w2.session().0), "w2 owns the table");
    for row in before.partitions.iter().filter(|r| r.owner == w2.session().0) {
        assert_eq!(
            tokens(&after)[&row.partition],
            (row.owner, row.token),
            "w2 kept partition {}",
            row.partition
        );
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_mode_holds_live_owners_still_and_an_operators_weight_moves_partitions() {
    use std::collections::BTreeMap;
    use tenure::proto::operator_client::OperatorClient;
    use tenure::proto::{SetMaintenanceRequest, SetWeightRequest};
    use tenure::tls::Principal;
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    let mut w1 = worker(&c, "w1").await;
    let w3 = worker(&c, "w3").await;
    settled(&c, 2).await;
    let before = workers_agree(&c, &[&w1, &w3]).await;
    let held = |s: &tenure::proto::StatusResponse, session: u64| -> BTreeMap<u32, u64> {
        s.partitions.iter().filter(|r| r.owner == session).map(|r| (r.partition, r.token)).collect()
    };
    let w1_before = held(&before, w1.session().0);

    let mut as_worker = OperatorClient::new(channel_as(&c, leader, &Principal::Worker("w1".into())).await);
    let err = as_worker
        .set_maintenance(SetMaintenanceRequest { on: true, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"));
    let err = as_worker
        .set_weight(SetWeightRequest { name: "w1".into(), weight: 5, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"));
    let mut ops = OperatorClient::new(channel_as(&c, leader, &Principal::Operator("ops".into())).await);
    let set = ops
        .set_maintenance(SetMaintenanceRequest { on: true, ..Default::default() })
        .await
        .expect("maintenance on");
    assert!(!set.into_inner().was);
    assert!(c.status().await.unwrap().maintenance, "status shows maintenance mode");

    // While it is on, two workers join and w3 leaves: w3's partitions go to the newcomers, and
    // w1, which balance would have asked for a third of its partitions, keeps every one of them
    // under the same token.
    let mut w1_events = w1.events().expect("events taken once");
    while w1_events.try_recv().is_some() {} // what w3's join took from w1 is over
    let w2 = worker(&c, "w2").await;
    let w4 = worker(&c, "w4").await;
    w3.leave().await.expect("w3 leaves");
    let during = eventually("w3's partitions owned by the newcomers", || async {
        let s = c.status().await.ok()?;
        let live = s.sessions.iter().filter(|x| !x.leaving).count();
        (live == 3 && s.sessions.len() == 3 && s.unowned == 0 && s.revoking == 0).then_some(s)
    })
    .await;
    assert_eq!(held(&during, w1.session().0), w1_before, "w1 kept every partition and token");
    assert_eq!(held(&during, w2.session().0).len() + held(&during, w4.session().0).len(), 12, "{during:?}");
    while let Some(event) = w1_events.try_recv() {
        assert!(!matches!(event, WorkerEvent::Revoking { .. } | WorkerEvent::Lost { .. }), "{event:?}");
    }

    // Off: the leader balances again.
    let set = ops
        .set_maintenance(SetMaintenanceRequest { on: false, ..Default::default() })
        .await
        .expect("maintenance off");
    assert!(set.into_inner().was);
    let after = settled(&c, 3).await;
    assert!(!after.maintenance);
    assert_eq!(held(&after, w1.session().0).len(), 8, "w1 gave up its excess once maintenance ended");

    // Weights: refused before the log when bad, changing nothing.
    let applied = c.status().await.unwrap().last_applied;
    for (name, weight, code, what) in [
        ("nobody", 2, Code::NotFound, "unknown_worker"),
        ("w2", 0, Code::InvalidArgument, "invalid_weight"),
        ("w2", 4_294_967_295, Code::InvalidArgument, "invalid_weight"),
        ("w\n2", 2, Code::InvalidArgument, "invalid_name"),
    ] {
        let err = ops
            .set_weight(SetWeightRequest { name: name.into(), weight, ..Default::default() })
            .await
            .unwrap_err();
        assert_eq!((err.code(), kind(&err)), (code, what), "{name:?} {weight}");
    }
    assert_eq!(c.status().await.unwrap().last_applied, applied, "no refused request became an entry");
    // Weight 3 of 5: w2 is to hold floor(24 * 3 / 5) = 14, the others 5 each.
    let set = ops
        .set_weight(SetWeightRequest { name: "w2".into(), weight: 3, ..Default::default() })
        .await
        .expect("weight set");
    assert_eq!(set.into_inner().sessions, vec![w2.session().0]);
    eventually("w2 holds three fifths of the table", || async {
        let s = c.status().await.ok()?;
        let owned = |session: u64| s.sessions.iter().find(|x| x.id == session).map(|x| x.owned);
        let shares = (owned(w1.session().0)?, owned(w2.session().0)?, owned(w4.session().0)?);
        (s.unowned == 0 && s.revoking == 0 && shares == (5, 14, 5)).then_some(())
    })
    .await;
    // The weight is w2's, not its session's: a restart asking for weight 1 still gets 3.
    w2.leave().await.expect("w2 leaves");
    let w2b = worker(&c, "w2").await;
    let status = c.status().await.unwrap();
    let record = status.sessions.iter().find(|x| x.id == w2b.session().0).expect("w2's new session");
    assert_eq!(record.weight, 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_bounded_shutdown_leaves_when_it_can_and_stops_believing_when_it_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let mut w1 = worker(&c, "w1").await;
    let mut w2 = worker(&c, "w2").await;
    let (mut events1, mut events2) =
        (w1.events().expect("events taken once"), w2.events().expect("events taken once"));
    let before = settled(&c, 2).await;
    let held_by_w1: Vec<u32> =
        before.partitions.iter().filter(|r| r.owner == w1.session().0).map(|r| r.partition).collect();
    while events1.try_recv().is_some() {} // what the join of w2 took from w1 is over

    // Reachable: the leave goes through, every partition is given back, none expires.
    w1.shutdown(BOUND).await.expect("w1 leaves within the bound");
    let mut released = Vec::new();
    while let Some(event) = events1.try_recv() {
        match event {
            WorkerEvent::Released { partition, .. } => released.push(partition.0),
            WorkerEvent::Lost { .. } => panic!("w1 lost a partition on shutdown: {event:?}"),
            _ => {}
        }
    }
    released.sort();
    assert_eq!(released, held_by_w1, "w1 gave back every partition it held");
    let after = settled(&c, 1).await;
    assert!(after.partitions.iter().all(|r| r.owner == w2.session().0), "w2 owns the table");

    // Unreachable: the cluster is gone; the shutdown gives up after its bound, and the
    // worker believes nothing any more.
    let mut handles = Vec::new();
    while let Some(event) = events2.try_recv() {
        if let WorkerEvent::Granted(h) = event {
            handles.push(h);
        }
    }
    assert!(handles.iter().any(|h| h.is_valid()), "w2 holds valid leases before the cluster goes");
    c.shutdown().await;
    let outcome = tokio::time::timeout(BOUND, w2.shutdown(Duration::from_millis(300)))
        .await
        .expect("shutdown returns within its bound");
    let err = outcome.expect_err("no coordinator can take the leave");
    assert!(matches!(err, tenure::worker::ClientError::Unavailable(_)), "{err:?}");
    assert!(handles.iter().all(|h| !h.is_valid()), "no handle is valid after the shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_move_pins_a_partition_to_a_worker_and_it_moves_there_gracefully() {
    use tenure::proto::operator_client::OperatorClient;
    use tenure::proto::MoveRequest;
    use tenure::tls::Principal;
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    let mut w1 = worker(&c, "w1").await;
    let w2 = worker(&c, "w2").await;
    let mut events = w1.events().expect("events taken once");
    let before = settled(&c, 2).await;
    while events.try_recv().is_some() {} // what the join of w2 took from w1 is over
    let p = before.partitions.iter().find(|r| r.owner == w1.session().0).expect("w1 owns some").partition;

    let mut as_worker = OperatorClient::new(channel_as(&c, leader, &Principal::Worker("w2".into())).await);
    let err = as_worker
        .r#move(MoveRequest { partition: p, to: "w2".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"));
    let mut ops = OperatorClient::new(channel_as(&c, leader, &Principal::Operator("ops".into())).await);
    let err =
        ops.r#move(MoveRequest { partition: 99, to: "w2".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::OutOfRange, "partition_out_of_range"));
    let err = ops
        .r#move(MoveRequest { partition: p, to: "nobody".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::NotFound, "unknown_worker"));

    let moved = ops
        .r#move(MoveRequest { partition: p, to: "w2".into(), ..Default::default() })
        .await
        .expect("pinned")
        .into_inner();
    assert_eq!(moved.was, "");
    // w1 does what an application does: gives back what it is asked for. It is asked for the
    // pinned partition, which it releases (never loses), and the table settles balanced.
    let deadline = Instant::now() + PATIENCE;
    let after = loop {
        let s = c.status().await.ok();
        let done = s.as_ref().is_some_and(|s| {
            let owner_of_p = s.partitions.iter().find(|r| r.partition == p).map(|r| r.owner);
            let count = |session: u64| s.partitions.iter().filter(|r| r.owner == session).count();
            let balanced = count(w1.session().0) == count(w2.session().0);
            owner_of_p == Some(w2.session().0) && s.revoking == 0 && s.unowned == 0 && balanced
        });
        if done {
            break s.unwrap();
        }
        assert!(Instant::now() < deadline, "the pinned partition never settled with w2: {s:?}");
        // The next event, or a look at the table again shortly.
        if let Ok(Some(event)) = tokio::time::timeout(Duration::from_millis(50), events.recv()).await {
            match event {
                WorkerEvent::Revoking { partition, .. } => {
                    assert_eq!(partition.0, p, "only the pinned partition is asked of w1");
                    w1.release(&[partition]).await.expect("released");
                }
                WorkerEvent::Lost { .. } => panic!("w1 lost a partition: {event:?}"),
                _ => {}
            }
        }
    };
    let row = after.partitions.iter().find(|r| r.partition == p).unwrap();
    let old = before.partitions.iter().find(|r| r.partition == p).unwrap();
    assert!(row.token > old.token, "a move is a new grant under a higher token");
    c.shutdown().await;
}
