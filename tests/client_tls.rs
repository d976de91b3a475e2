//! The client listener speaks only to holders of a certificate from the cluster's CA, and a
//! worker acts only under the name its certificate gives it. Each hostile caller below is
//! refused, and the table (sessions, owners, tokens, the applied index) is the same after as
//! before: no refused request became a log entry.

mod common;

use common::*;
use tenure::certs::{DevCa, Validity};
use tenure::proto;
use tenure::tls::Principal;
use tenure::worker::{ClientError, ClientTls, Worker};
use tonic::Code;

/// The applied index, the sessions (id, name) and the rows (partition, owner, token).
type Fingerprint = (u64, Vec<(u64, String)>, Vec<(u32, u64, u64)>);

/// The part of the status that any change would touch.
fn fingerprint(s: &proto::StatusResponse) -> Fingerprint {
    (
        s.last_applied,
        s.sessions.iter().map(|x| (x.id, x.name.clone())).collect(),
        s.partitions.iter().map(|r| (r.partition, r.owner, r.token)).collect(),
    )
}

fn kind(status: &tonic::Status) -> &str {
    status.metadata().get(tenure::server::ERROR_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// A worker identity for `name` from `ca`, trusting the cluster's CA (`cluster_ca`).
fn identity(ca: &DevCa, cluster_ca: &str, name: &str, validity: Validity) -> ClientTls {
    let issued = ca.issue(&Principal::Worker(name.into()), &[], validity).unwrap();
    ClientTls {
        ca_pem: cluster_ca.as_bytes().to_vec(),
        cert_pem: issued.cert_pem.into_bytes(),
        key_pem: issued.key_pem.into_bytes(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_of_the_cluster_ca_is_refused_at_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let w1 = worker(&c, "w1").await;
    let before = fingerprint(&settled(&c, 1).await);
    let cluster_ca = c.ca().ca_pem();
    let stranger = DevCa::new("another CA").unwrap();
    let expired = Validity { expired: true, ..Default::default() };

    // The worker library with certificates the nodes do not accept: the handshake fails, so
    // the join never reaches the service.
    for (what, tls) in [
        ("a certificate from another CA", Some(identity(&stranger, &cluster_ca, "w2", Default::default()))),
        ("an expired certificate of the cluster's CA", Some(identity(c.ca(), &cluster_ca, "w2", expired))),
        ("no certificate at all (plain text)", None),
    ] {
        let mut config = c.worker_config("w2");
        config.tls = tls;
        let err = Worker::join(config).await.err().unwrap_or_else(|| panic!("{what}: joined"));
        assert!(matches!(err, ClientError::Unavailable(_) | ClientError::Other(_)), "{what}: {err:?}");
    }

    // TLS that trusts the cluster's CA but presents no certificate of its own.
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("https://{}", c.addr(c.leader().unwrap())))
            .unwrap()
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(&cluster_ca)),
            )
            .unwrap();
    let mut anonymous = proto::coordinator_client::CoordinatorClient::new(endpoint.connect_lazy());
    let err = anonymous
        .join(proto::JoinRequest { name: "w2".into(), weight: 1, ..Default::default() })
        .await
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled),
        "{err:?}"
    );

    assert_eq!(fingerprint(&c.status().await.unwrap()), before, "nothing changed");
    drop(w1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joins_and_acts_only_under_its_own_name() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.leader().unwrap();
    // w1's session, joined with w1's certificate; its id and secret are then stolen by w2.
    let (_w1_client, w1) = raw_join(&c, "w1").await;
    let before = fingerprint(&settled(&c, 1).await);

    // w2's certificate, asking to join as w1: refused, or it would end w1's session.
    let mut as_w1 = c.worker_config("w1");
    as_w1.tls = c.client_tls(&Principal::Worker("w2".into()));
    let err = Worker::join(as_w1).await.err().expect("refused");
    assert!(matches!(err, ClientError::NotAllowed(_)), "{err:?}");

    // An operator may read the table but not join.
    let mut as_operator = c.worker_config("ops");
    as_operator.tls = c.client_tls(&Principal::Operator("ops".into()));
    let err = Worker::join(as_operator).await.err().expect("refused");
    assert!(matches!(err, ClientError::NotAllowed(_)), "{err:?}");

    // With w1's session id and secret, but w2's certificate: every session call is refused.
    let mut thief = api_client_as(&c, leader, &Principal::Worker("w2".into())).await;
    let (session_id, secret) = (w1.session_id, w1.secret.clone());
    let beat = proto::HeartbeatRequest { session_id, secret: secret.clone(), ..Default::default() };
    let err = thief.heartbeat(beat.clone()).await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"), "{err:?}");
    let mut answers = thief.heartbeats(tokio_stream::iter([beat])).await.unwrap().into_inner();
    let err = answers.message().await.unwrap_err();
    assert_eq!((err.code(), kind(&err)), (Code::PermissionDenied, "not_allowed"), "{err:?}");
    let release =
        proto::ReleaseRequest { session_id, secret: secret.clone(), all: true, ..Default::default() };
    let err = thief.release(release).await.unwrap_err();
    assert_eq!(kind(&err), "not_allowed", "{err:?}");
    let err = thief
        .watch(proto::WatchRequest { session_id, secret: secret.clone(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "not_allowed", "{err:?}");
    let err = thief
        .leave(proto::LeaveRequest { session_id, secret: secret.clone(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "not_allowed", "{err:?}");

    // A node's certificate is for the peer listener only.
    let node = api_client_as(&c, leader, &Principal::Node(leader)).await;
    let err = node.clone().status(proto::StatusRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    assert_eq!(fingerprint(&c.status().await.unwrap()), before, "nothing changed");
    // The owner itself still may.
    let mut owner = api_client_as(&c, leader, &Principal::Worker("w1".into())).await;
    owner
        .leave(proto::LeaveRequest { session_id, secret, ..Default::default() })
        .await
        .expect("w1 leaves its own session");
    eventually("w1's session ends", || async { c.status().await.ok().filter(|s| s.sessions.is_empty()) })
        .await;
    c.shutdown().await;
}
