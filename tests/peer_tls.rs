//! The peer listener speaks only to nodes of the cluster: mutual TLS with a certificate from
//! the cluster's CA naming a node. Each hostile caller below sends a forged `Vote` with a far
//! higher term, which would depose the leader if a node took it in; each is refused, and the
//! leader keeps its term and its place.

mod common;

use common::*;
use tenure::certs::{DevCa, Validity};
use tenure::proto::peer::RaftPayload;
use tenure::tls::Principal;
use tonic::Code;

fn forged_vote(term: u64, candidate: u64) -> RaftPayload {
    let vote =
        openraft::raft::VoteRequest::<u64> { vote: openraft::Vote::new(term, candidate), last_log_id: None };
    RaftPayload { data: tenure::codec::encode(&vote) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_node_certificate_from_the_cluster_ca_may_speak_raft() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster(dir.path()).await;
    let leader = c.wait_for_leader(PATIENCE).await.expect("a leader");
    let term = || c.node(leader).expect("the leader runs").raft().metrics().borrow().current_term;
    let before = term();
    let hosts = ["127.0.0.1".to_string()];
    let ca = c.ca();
    let stranger = DevCa::new("another CA").unwrap();
    let expired = Validity { expired: true, ..Default::default() };
    let node = |id| Principal::Node(id);

    // Refused during the handshake: no gRPC status reaches the caller, only a broken connection.
    let refused_at_handshake = [
        ("no client certificate", raft_client_as(&c, leader, &ca.ca_pem(), None)),
        (
            "a node certificate from another CA",
            raft_client_as(
                &c,
                leader,
                &ca.ca_pem(),
                Some(&stranger.issue(&node(2), &hosts, Default::default()).unwrap()),
            ),
        ),
        (
            "an expired node certificate from the cluster's CA",
            raft_client_as(&c, leader, &ca.ca_pem(), Some(&ca.issue(&node(2), &hosts, expired).unwrap())),
        ),
    ];
    for (what, mut client) in refused_at_handshake {
        let err = client.vote(forged_vote(before + 1000, 2)).await.unwrap_err();
        assert!(
            matches!(err.code(), Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled),
            "{what}: {:?} {}",
            err.code(),
            err.message()
        );
    }
    // Plain text is not TLS at all.
    let mut plain = tenure::proto::peer::raft_transport_client::RaftTransportClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{}", c.peer_addr(leader)))
            .unwrap()
            .connect_lazy(),
    );
    assert!(plain.vote(forged_vote(before + 1000, 2)).await.is_err(), "a plain-text caller");

    // Certified by the cluster's CA, but not as a node: refused by name, before decoding.
    for principal in [Principal::Worker("w1".into()), Principal::Operator("ops".into())] {
        let issued = ca.issue(&principal, &hosts, Default::default()).unwrap();
        let mut client = raft_client_as(&c, leader, &ca.ca_pem(), Some(&issued));
        let err = client.vote(forged_vote(before + 1000, 2)).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{principal}: {}", err.message());
        assert!(err.message().contains("only nodes"), "{}", err.message());
    }

    assert_eq!(term(), before, "no forged vote reached Raft");
    assert_eq!(c.leader(), Some(leader));

    // A node's certificate gets through the gate: garbage from it is refused by the decoder.
    let err = raft_client(&c, leader).vote(RaftPayload { data: b"\x00garbage".to_vec() }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    c.shutdown().await;
}

#[test]
fn a_certificate_names_exactly_one_principal() {
    let ca = DevCa::new("test CA").unwrap();
    let issued =
        ca.issue(&Principal::Worker("billing-7".into()), &["127.0.0.1".into()], Default::default()).unwrap();
    assert_eq!(tenure::tls::principal_of(&issued.cert_der).unwrap(), Principal::Worker("billing-7".into()));
    assert!(tenure::tls::principal_of(b"not a certificate").is_err());
}
