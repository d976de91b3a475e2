//! Safety at the edges a workload of our own never reached: what users do that the fault suite
//! did not. Each test names the finding it guards and failed before its fix.
//!
//! - A node restarted with another `--lease-ttl-ms` judged leases by its own flag, not the
//!   TTL the cluster was created with and told its workers.
//! - Releasing of one's own accord, leaving and dropping a `Worker` gave partitions away before
//!   the worker stopped believing in them.
//! - A lease TTL shortened at run time must not let a leader (a new one above all) expire a lease
//!   before the longer TTL its worker was told when it last renewed.
//! - A leave that is not followed by a release (a client other than our library, or one that
//!   died between the two calls) revoked nothing: the leave entry emitted no event, so the
//!   leader never decided again.
//! - A leader change forgot the moves still unconfirmed (only the leader that saw a renewal knows
//!   of it), so the next leader could revoke past the budget.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tenure::ids::{PartitionId, SessionId};
use tenure::local_cluster::LocalCluster;
use tenure::ownership::Event;
use tenure::store::AppliedEvent;
use tenure::worker::{Events, PartitionHandle, Worker, WorkerEvent};
use tokio::sync::broadcast;

use tokio::time::Instant;

/// The handles of every `Granted` event so far that are still valid, by partition.
fn valid_handles(events: &mut Events) -> BTreeMap<PartitionId, PartitionHandle> {
    let mut handles = BTreeMap::new();
    while let Some(event) = events.try_recv() {
        if let WorkerEvent::Granted(h) = event {
            handles.insert(h.partition(), h);
        }
    }
    handles.retain(|_, h| h.is_valid());
    handles
}

/// Every node's applied entries from now on. A follower that lags applies older entries after
/// the subscription too; `after` (the furthest any node had applied when subscribing) tells
/// those apart from what happened since.
struct Feeds {
    nodes: Vec<broadcast::Receiver<Arc<AppliedEvent>>>,
    after: u64,
}

fn feeds(c: &LocalCluster) -> Feeds {
    let (nodes, applied): (Vec<_>, Vec<u64>) = c.running().map(|n| n.node.applied_events_after()).unzip();
    Feeds { nodes, after: applied.into_iter().max().unwrap_or(0) }
}

/// Waits for the first event that `pick` accepts among entries applied after the subscription,
/// on any node.
async fn first_applied(feeds: &mut Feeds, pick: impl Fn(&Event) -> bool) -> Event {
    let after = feeds.after;
    let wait = async {
        loop {
            // Whichever node applies next; `recv` is cancel-safe, so the others lose nothing.
            assert!(!feeds.nodes.is_empty(), "every watched node stopped");
            let next = feeds.nodes.iter_mut().map(|feed| Box::pin(feed.recv()));
            let (received, which, _) = futures::future::select_all(next).await;
            match received {
                Ok(applied) if applied.index > after => {
                    if let Some(e) = applied.events.iter().find(|e| pick(e)) {
                        return e.clone();
                    }
                }
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                // A node stopped on purpose (a killed leader): the others still apply.
                Err(broadcast::error::RecvError::Closed) => {
                    feeds.nodes.remove(which);
                }
            }
        }
    };
    tokio::time::timeout(PATIENCE, wait).await.expect("timed out waiting for an applied event")
}

/// Workers a and b on a settled table, with a's event stream and the handles a believes in.
async fn two_workers(c: &LocalCluster) -> (Worker, Worker, Events, BTreeMap<PartitionId, PartitionHandle>) {
    let mut a = worker(c, "a").await;
    let mut events = a.events().expect("events taken once");
    let b = worker(c, "b").await;
    settled(c, 2).await;
    workers_agree(c, &[&a, &b]).await;
    let handles = valid_handles(&mut events);
    (a, b, events, handles)
}

/// Every handle has stopped believing: cancelled, and not valid.
fn withdrawn(handles: &BTreeMap<PartitionId, PartitionHandle>, when: &str) {
    for (p, h) in handles {
        assert!(h.cancellation().is_cancelled() && !h.is_valid(), "{p} still believed {when}");
    }
}

/// A 3-node cluster created with lease TTL `ttl`, with a leader.
async fn cluster_with_ttl(dir: &std::path::Path, ttl: Duration) -> LocalCluster {
    init_tracing();
    let c = LocalCluster::start(3, dir, |n| {
        fast(n);
        n.lease_ttl = ttl;
    })
    .await
    .expect("cluster starts");
    c.wait_for_leader(PATIENCE).await.expect("a leader");
    c
}

/// The latest instant any of `handles` may still be believed in, by the worker's own lease
/// arithmetic.
fn latest(handles: &BTreeMap<PartitionId, PartitionHandle>) -> Option<Instant> {
    handles.values().filter_map(PartitionHandle::valid_until).max()
}

fn gives_away(session: SessionId) -> impl Fn(&Event) -> bool {
    move |e| match e {
        Event::Released { session: s, .. } | Event::Lost { session: s, .. } => *s == session,
        _ => false,
    }
}

/// Before the fix, the restarted leader judged leases by its 1 s flag while the workers, told
/// 4 s, renewed every second: sessions expired over and over and the table never settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_restarted_with_another_ttl_judge_leases_by_the_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let created = Duration::from_millis(4000);
    let mut c = cluster_with_ttl(dir.path(), created).await;
    eventually("the cluster is configured", || async {
        c.status().await.ok().filter(|s| !s.partitions.is_empty())
    })
    .await;
    // Every node comes back with a shorter TTL and twice the partitions on its command line;
    // one of them leads.
    for id in c.ids() {
        c.stop(id).await;
    }
    for id in c.ids() {
        let restarted = c.restart_with(id, |n| {
            n.lease_ttl = Duration::from_millis(1000);
            n.partition_count = 48;
        });
        restarted.await.expect("restarts");
    }
    c.wait_for_leader(PATIENCE).await.expect("a leader among the restarted nodes");
    let table = c.status().await.expect("status");
    assert_eq!(table.partitions.len(), 24, "the cluster's partition count, not the flag's");

    let mut a = worker(&c, "a").await;
    assert_eq!(a.lease_ttl(), created, "workers are told the cluster's TTL");
    let mut events = a.events().expect("events taken once");
    let b = worker(&c, "b").await;
    settled(&c, 2).await;
    workers_agree(&c, &[&a, &b]).await;
    let mut feeds = feeds(&c);
    let handles = valid_handles(&mut events);
    assert!(!handles.is_empty());
    let session = a.session();
    // The latest instant `a` may still believe in a partition, by its own lease arithmetic:
    // read just before the crash, and again after it if the worker's state is still there to
    // ask (it is freed once its tasks have stopped), in case an answer extended it in between.
    // (A lease that lapsed under load since is believed no more: now bounds it.)
    let before = latest(&handles).unwrap_or_else(Instant::now);
    a.abandon(); // a crash: no more heartbeats
    let believed_until = latest(&handles).map_or(before, |after| after.max(before));
    let lost = first_applied(&mut feeds, gives_away(session)).await;
    let lost_at = Instant::now();
    assert!(
        lost_at >= believed_until,
        "{lost:?} was applied {:?} before the crashed worker stopped believing",
        believed_until - lost_at
    );
    settled(&c, 1).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_of_its_own_accord_ends_belief_before_the_partition_moves() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (a, _b, _events, handles) = two_workers(&c).await;
    let (&p, handle) = handles.iter().next().expect("a holds partitions");
    let mut feeds = feeds(&c);
    let session = a.session();
    let release = tokio::spawn(async move {
        a.release(&[p]).await.expect("released");
        a
    });
    let event = first_applied(&mut feeds, gives_away(session)).await;
    assert!(matches!(event, Event::Released { partition, .. } if partition == p), "{event:?}");
    assert!(
        handle.cancellation().is_cancelled() && !handle.is_valid(),
        "{p} was released by the cluster while its handle still believed in it"
    );
    let a = release.await.unwrap();
    assert!(!a.owned().contains_key(&p) || a.owned()[&p] > handle.token());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leaving_ends_belief_before_any_partition_moves() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (a, _b, mut events, handles) = two_workers(&c).await;
    assert!(!handles.is_empty());
    let mut feeds = feeds(&c);
    let session = a.session();
    let leave = tokio::spawn(async move { a.leave().await.expect("left") });
    // The first thing the leave does to the table (revoking every partition) comes after the
    // worker stopped believing, not only the releases that let others have them.
    first_applied(&mut feeds, move |e| {
        tenure::recording::decision(e).is_some_and(|(_, s, _, _)| s == session)
    })
    .await;
    withdrawn(&handles, "when the leave's first decision was applied");
    leave.await.unwrap();
    // Every partition reports its one terminal event, Released.
    let mut released = std::collections::BTreeSet::new();
    while let Some(event) = events.try_recv() {
        if let WorkerEvent::Released { partition, .. } = event {
            released.insert(partition);
        }
    }
    assert_eq!(released, handles.keys().copied().collect());
    settled(&c, 1).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_a_worker_ends_belief_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (a, _b, _events, handles) = two_workers(&c).await;
    assert!(!handles.is_empty());
    let mut feeds = feeds(&c);
    let session = a.session();
    drop(a);
    // Before anything was sent: the drop itself ended every handle.
    withdrawn(&handles, "after the drop");
    // The graceful leave the drop started hands everything over without waiting for a TTL:
    // the first decision that gives a partition away is a release, not an expiry.
    let given = first_applied(&mut feeds, gives_away(session)).await;
    assert!(matches!(given, Event::Released { .. }), "{given:?}");
    settled(&c, 1).await;
    c.shutdown().await;
}

/// A client of its own speaks the protocol: it joins, heartbeats, and leaves without releasing.
/// The leader must revoke what it holds; the revoking leases then run out (nobody releases)
/// and the partitions go to the other worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leave_without_a_release_still_revokes_everything() {
    use tenure::proto;
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (mut client, joined) = raw_join(&c, "raw").await;
    let session = SessionId(joined.session_id);
    // Heartbeats keep the session alive for the whole test, so nothing but the leave can take
    // its partitions away before the check.
    let beat = proto::HeartbeatRequest {
        session_id: joined.session_id,
        secret: joined.secret.clone(),
        ..Default::default()
    };
    let mut beating = client.clone();
    let heartbeats = tokio::spawn(async move {
        for _ in 0..600 {
            if beating.heartbeat(beat.clone()).await.is_err() {
                return; // the session ended
            }
            tokio::time::sleep(TTL / 5).await;
        }
    });
    eventually("the raw client owns every partition", || async {
        let status = c.status().await.ok()?;
        status.partitions.iter().all(|p| p.owner == joined.session_id).then_some(())
    })
    .await;
    let b = worker(&c, "b").await;
    settled(&c, 2).await;

    let mut feeds = feeds(&c);
    client
        .leave(proto::LeaveRequest {
            session_id: joined.session_id,
            secret: joined.secret,
            ..Default::default()
        })
        .await
        .unwrap();
    first_applied(&mut feeds, move |e| matches!(e, Event::Revoking { session: s, .. } if *s == session))
        .await;
    let status = settled(&c, 1).await;
    assert!(status.partitions.iter().all(|p| p.owner == b.session().0));
    heartbeats.abort();
    c.shutdown().await;
}

/// An operator's client on the current leader.
async fn operator(
    c: &LocalCluster,
) -> tenure::proto::operator_client::OperatorClient<tonic::transport::Channel> {
    let leader = c.leader().expect("a leader");
    let principal = tenure::tls::Principal::Operator("ops".into());
    tenure::proto::operator_client::OperatorClient::new(channel_as(c, leader, &principal).await)
}

/// The worst case for a TTL change: a worker renewed under 4 s goes silent, the TTL is cut to
/// 500 ms, and the leader is killed before anything else happens. The new leader must still
/// wait out the 4 s that worker was told; judging by 500 ms it would expire the worker (and give
/// its partitions away) about three seconds while it still believes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shortened_ttl_expires_no_lease_before_the_ttl_its_worker_was_told() {
    let dir = tempfile::tempdir().unwrap();
    let told = Duration::from_millis(4000);
    let mut c = cluster_with_ttl(dir.path(), told).await;
    let (a, b, _events, handles) = two_workers(&c).await;
    assert_eq!(a.lease_ttl(), told);
    assert!(!handles.is_empty());
    let session = a.session();
    let mut feeds = feeds(&c);
    let before = latest(&handles).unwrap_or_else(Instant::now);
    a.abandon(); // no more heartbeats: its last renewal was under 4 s
    let believed_until = latest(&handles).map_or(before, |after| after.max(before));

    let mut ops = operator(&c).await;
    let set = ops
        .set_lease_ttl(tenure::proto::SetLeaseTtlRequest { lease_ttl_ms: 500, ..Default::default() })
        .await;
    assert_eq!(set.expect("an operator sets the TTL").into_inner().was_ms, 4000);
    let leader = c.leader().expect("a leader");
    c.stop(leader).await;
    c.wait_for_leader(PATIENCE).await.expect("a new leader");
    let status = c.status().await.expect("status");
    assert_eq!(status.lease_ttl_ms, 500);
    assert_eq!(status.lease_ttl_ceiling_ms, 4000, "the change is not settled yet");

    let lost = first_applied(&mut feeds, gives_away(session)).await;
    let lost_at = Instant::now();
    assert!(
        lost_at >= believed_until,
        "{lost:?} was applied {:?} before the silent worker stopped believing",
        believed_until - lost_at
    );
    // The live worker follows the new TTL from its next renewal, and the change settles once
    // the new leader has waited out the old TTL.
    eventually("b follows the new TTL", || async {
        (b.lease_ttl() == Duration::from_millis(500)).then_some(())
    })
    .await;
    eventually("the change settles", || async {
        c.status().await.ok().filter(|s| s.lease_ttl_ceiling_ms == 0 && s.lease_ttl_ms == 500)
    })
    .await;
    let status = settled(&c, 1).await;
    assert!(status.partitions.iter().all(|p| p.owner == b.session().0));
    c.shutdown().await;
}

/// A longer TTL and a revoke budget changed at run time: workers follow the TTL (they renew
/// less often and hold their leases longer), the next moves keep to the budget, and bad values
/// are refused with a typed error that changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ttl_and_the_revoke_budget_change_at_run_time_and_bad_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let (a, _b, _events, handles) = two_workers(&c).await;
    let mut ops = operator(&c).await;
    for ms in [0, 50, 86_400_001] {
        let refused = ops
            .set_lease_ttl(tenure::proto::SetLeaseTtlRequest { lease_ttl_ms: ms, ..Default::default() })
            .await;
        let status = refused.expect_err("out of range");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{ms}: {status:?}");
    }
    let refused = ops
        .set_revoke_budget(tenure::proto::SetRevokeBudgetRequest {
            max_revoking: Some(0),
            ..Default::default()
        })
        .await;
    assert_eq!(refused.expect_err("a budget of 0").code(), tonic::Code::InvalidArgument);
    let status = c.status().await.expect("status");
    assert_eq!((status.lease_ttl_ms, status.max_revoking, status.lease_ttl_ceiling_ms), (1000, None, 0));

    let set = ops
        .set_lease_ttl(tenure::proto::SetLeaseTtlRequest { lease_ttl_ms: 3000, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(set.into_inner().was_ms, 1000);
    eventually("a follows the longer TTL", || async {
        (a.lease_ttl() == Duration::from_secs(3)).then_some(())
    })
    .await;
    // A lease now runs well past the old TTL from its last renewal.
    let now = Instant::now();
    let longest = eventually("a renews under the longer TTL", || async {
        handles.values().filter_map(PartitionHandle::valid_until).max().filter(|v| *v > now + TTL)
    })
    .await;
    assert!(longest <= Instant::now() + Duration::from_secs(3), "a lease beyond the TTL");

    let set = ops
        .set_revoke_budget(tenure::proto::SetRevokeBudgetRequest {
            max_revoking: Some(1),
            ..Default::default()
        })
        .await;
    assert_eq!(set.unwrap().into_inner().was, None);
    let c2 = worker(&c, "c").await;
    // With a budget of one, the newcomer's partitions come one at a time.
    let status = eventually("the table settles for three, one move at a time", || async {
        let s = c.status().await.ok()?;
        // The leader also says how many moves are granted but unconfirmed: in motion too.
        let unconfirmed = s.unconfirmed_moves.unwrap_or(0);
        assert!(
            s.revoking + unconfirmed <= 1,
            "{} revoking and {unconfirmed} unconfirmed with a budget of one",
            s.revoking
        );
        tenure::local_cluster::is_settled(&s, 3).then_some(s)
    })
    .await;
    assert_eq!(status.max_revoking, Some(1));
    assert!(status.unconfirmed_moves.is_some(), "the leader answered, with its count");
    assert!(status.partitions.iter().any(|p| p.owner == c2.session().0));
    c.shutdown().await;
}

/// A move its new owner has not confirmed stays in motion through a leader change. With a budget
/// of one, a newcomer that joins by hand and never renews gets one partition, and then nothing
/// moves: that move is unconfirmed. The leader is stopped; its successor never saw the move
/// (confirmations live in the leader's memory) but finds it marked in the partition's row, and
/// counts it too, where a leader that forgot it would revoke the next partition and have two in
/// motion. The newcomer's first renewal frees the budget and the moves go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_move_left_unconfirmed_holds_the_budget_through_a_leader_change() {
    let dir = tempfile::tempdir().unwrap();
    // A long TTL: b never renews on its own, and must keep its session through the test.
    let mut c = cluster_with_ttl(dir.path(), Duration::from_secs(10)).await;
    let mut ops = operator(&c).await;
    let set = ops
        .set_revoke_budget(tenure::proto::SetRevokeBudgetRequest {
            max_revoking: Some(1),
            ..Default::default()
        })
        .await;
    set.expect("an operator sets the budget");
    // a gives back what it is asked for, as an application does.
    let mut a = worker(&c, "a").await;
    let mut events = a.events().expect("events taken once");
    let a = Arc::new(a);
    let releases = {
        let a = a.clone();
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if let WorkerEvent::Revoking { partition, .. } = event {
                    let _ = a.release(&[partition]).await;
                }
            }
        })
    };
    settled(&c, 1).await;

    let as_b = tenure::tls::Principal::Worker("b".into());
    let leader = c.leader().expect("a leader");
    let mut b =
        tenure::proto::coordinator_client::CoordinatorClient::new(channel_as(&c, leader, &as_b).await);
    let joined = b
        .join(tenure::proto::JoinRequest { name: "b".into(), weight: 1, ..Default::default() })
        .await
        .expect("b joins");
    let joined = joined.into_inner();
    let owned_by_b = |s: &tenure::proto::StatusResponse| {
        s.partitions.iter().filter(|p| p.owner == joined.session_id && !p.revoking).count()
    };
    let before = eventually("one partition moved to b, granted and unconfirmed", || async {
        c.status()
            .await
            .ok()
            .filter(|s| owned_by_b(s) == 1 && s.revoking == 0 && s.unconfirmed_moves == Some(1))
    })
    .await;
    assert_eq!(before.leader_id, leader);

    c.stop(leader).await;
    c.wait_for_leader(PATIENCE).await.expect("a new leader");
    let after = eventually("the new leader answers with its count", || async {
        c.status()
            .await
            .ok()
            .filter(|s| s.node_id == s.leader_id && s.leader_id != leader && s.unconfirmed_moves.is_some())
    })
    .await;
    assert_eq!(after.unconfirmed_moves, Some(1), "the new leader counts the move it never saw confirmed");
    assert_eq!((after.revoking, owned_by_b(&after)), (0, 1), "and moves nothing more");

    // b renews, with the new leader: the move is confirmed and the next one is made.
    let mut b = tenure::proto::coordinator_client::CoordinatorClient::new(
        channel_as(&c, after.leader_id, &as_b).await,
    );
    let beat = tenure::proto::HeartbeatRequest {
        session_id: joined.session_id,
        secret: joined.secret.clone(),
        ..Default::default()
    };
    b.heartbeat(beat).await.expect("b renews");
    eventually("b's renewal frees the budget for the next move", || async {
        c.status().await.ok().filter(|s| s.revoking == 1 || owned_by_b(s) > 1)
    })
    .await;
    releases.abort();
    c.shutdown().await;
}
