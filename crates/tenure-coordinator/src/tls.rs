//! Who is on the other end of a connection: TLS material for a node, and the principal a
//! certificate names.
//!
//! The cluster has one certificate authority. Every certificate it issues names exactly one
//! principal in a URI subject-alternative name, `tenure://node/<id>`, `tenure://worker/<name>`
//! or `tenure://operator/<name>`, next to the DNS names and IP addresses it is valid for. The
//! peer listener requires a certificate from the cluster's CA during the handshake (a
//! connection without one never reaches gRPC), and then admits only a `node` principal: a
//! worker's certificate, although issued by the same CA, cannot speak Raft.
//!
//! The client listener requires a certificate from the same CA, and admits a `worker` or an
//! `operator`. The principal rides along with each request ([`Caller`]), so the service can
//! check that a worker joins only under its own name and acts only on its own sessions.
//!
//! The invariants kept here: a Raft message is decoded only after the connection it came on
//! proved, with a key the CA certified, that it belongs to a node of the cluster; a worker API
//! call is decoded only after its connection proved a worker's or an operator's name.

use crate::ids::NodeId;
use std::path::Path;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The URI scheme and authority every principal name starts with.
pub const PRINCIPAL_PREFIX: &str = "tenure://";

/// The party a certificate was issued to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// A coordinator node, by id.
    Node(NodeId),
    /// A worker, by the name it joins under.
    Worker(String),
    /// An operator (or a tool acting for one), by name.
    Operator(String),
}

impl Principal {
    /// The URI subject-alternative name that carries it.
    pub fn uri(&self) -> String {
        match self {
            Principal::Node(id) => format!("{PRINCIPAL_PREFIX}node/{id}"),
            Principal::Worker(name) => format!("{PRINCIPAL_PREFIX}worker/{name}"),
            Principal::Operator(name) => format!("{PRINCIPAL_PREFIX}operator/{name}"),
        }
    }

    /// Reads a principal back from its URI; `None` for any other URI.
    pub fn from_uri(uri: &str) -> Option<Principal> {
        let rest = uri.strip_prefix(PRINCIPAL_PREFIX)?;
        let (kind, name) = rest.split_once('/')?;
        match kind {
            "node" => name.parse().ok().filter(|id| *id != 0).map(Principal::Node),
            "worker" if !name.is_empty() => Some(Principal::Worker(name.to_string())),
            "operator" if !name.is_empty() => Some(Principal::Operator(name.to_string())),
            _ => None,
        }
    }
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

/// Why TLS material could not be used, or a certificate names no principal.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{0} holds no PEM certificate")]
    NoCertificate(String),
    #[error("{0} holds no PEM private key")]
    NoKey(String),
    #[error("the certificate does not parse: {0}")]
    Malformed(String),
    #[error("the certificate names no tenure principal (a {PRINCIPAL_PREFIX}... URI name)")]
    NoPrincipal,
    #[error("the certificate names {0} principals; it must name exactly one")]
    ManyPrincipals(usize),
}

/// A node's TLS material, PEM encoded: the cluster's CA certificate, and the node's own
/// certificate and private key. The same identity serves the peer listener and dials peers.
#[derive(Clone)]
pub struct NodeTls {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for NodeTls {
    // Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls").finish_non_exhaustive()
    }
}

impl NodeTls {
    /// Reads the three PEM files, checking each holds what it should.
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<NodeTls, TlsError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|error| TlsError::Read { path: p.display().to_string(), error })
        };
        let tls = NodeTls { ca_pem: read(ca)?, cert_pem: read(cert)?, key_pem: read(key)? };
        let has =
            |pem: &[u8], label: &str| String::from_utf8_lossy(pem).contains(&format!("-----BEGIN {label}"));
        if !has(&tls.ca_pem, "CERTIFICATE") {
            return Err(TlsError::NoCertificate(ca.display().to_string()));
        }
        if !has(&tls.cert_pem, "CERTIFICATE") {
            return Err(TlsError::NoCertificate(cert.display().to_string()));
        }
        if !has(&tls.key_pem, "PRIVATE KEY") && !has(&tls.key_pem, "EC PRIVATE KEY") {
            return Err(TlsError::NoKey(key.display().to_string()));
        }
        Ok(tls)
    }

    /// A listener's side (both of them): this node's identity, and a certificate from the
    /// cluster's CA required of every connection.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(false)
    }

    /// The dialing side: trusts only the cluster's CA, and presents this node's identity.
    pub fn peer_client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
    }
}

/// The one principal a DER certificate names.
pub fn principal_of(der: &[u8]) -> Result<Principal, TlsError> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::Malformed(e.to_string()))?;
    let names = cert.subject_alternative_name().map_err(|e| TlsError::Malformed(e.to_string()))?;
    let found: Vec<Principal> = names
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => Principal::from_uri(uri),
            _ => None,
        })
        .collect();
    match found.len() {
        0 => Err(TlsError::NoPrincipal),
        1 => Ok(found.into_iter().next().expect("one")),
        n => Err(TlsError::ManyPrincipals(n)),
    }
}

/// The principal of the certificate the caller presented on this request's connection, if it
/// came over TLS with one. Works for TCP connections and for any other transport (the
/// simulation's) that tonic's TLS wraps.
pub fn caller<T>(request: &tonic::Request<T>) -> Option<Result<Principal, TlsError>> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = request.extensions();
    let certs = ext
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
        .or_else(|| ext.get::<TlsConnectInfo<()>>().and_then(|i| i.peer_certs()))?;
    let leaf = certs.first()?;
    Some(principal_of(leaf.as_ref()))
}

/// The peer listener's gate, run on each request's headers before its message is decoded:
/// only a node of the cluster may call. Without TLS (an insecure cluster) everyone may.
pub fn admit_peer(
    tls: bool,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |request: tonic::Request<()>| {
        if !tls {
            return Ok(request);
        }
        match caller(&request) {
            Some(Ok(Principal::Node(_))) => Ok(request),
            Some(Ok(other)) => Err(tonic::Status::permission_denied(format!(
                "{other} may not call the peer service: only nodes may"
            ))),
            Some(Err(e)) => Err(tonic::Status::unauthenticated(e.to_string())),
            None => Err(tonic::Status::unauthenticated("no client certificate on a peer connection")),
        }
    }
}

/// Who made a request on the client listener, as the gate found it: `None` on an insecure
/// cluster, where nobody is authenticated and every check on names is skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller(pub Option<Principal>);

impl Caller {
    /// The caller of a request that passed [`admit_client`]; `Caller(None)` if none did (a
    /// service called directly, without the gate, in a unit test).
    pub fn of<T>(request: &tonic::Request<T>) -> Caller {
        request.extensions().get::<Caller>().cloned().unwrap_or(Caller(None))
    }

    /// May this caller act as the worker named `name` (join under it, renew, release or leave
    /// its sessions)? Only that worker may; operators and other workers may not.
    pub fn may_act_as(&self, name: &str) -> Result<(), String> {
        match &self.0 {
            None => Ok(()),
            Some(Principal::Worker(own)) if own == name => Ok(()),
            Some(other) => Err(format!("{other} may not act as worker {name:?}")),
        }
    }
}

/// The client listener's gate, run on each request's headers before its message is decoded:
/// a worker or an operator may call, a node (or a certificate naming nobody) may not. The
/// principal it found is attached to the request as a [`Caller`]. Without TLS everyone may.
pub fn admit_client(
    tls: bool,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |mut request: tonic::Request<()>| {
        if !tls {
            request.extensions_mut().insert(Caller(None));
            return Ok(request);
        }
        match caller(&request) {
            Some(Ok(p @ (Principal::Worker(_) | Principal::Operator(_)))) => {
                request.extensions_mut().insert(Caller(Some(p)));
                Ok(request)
            }
            Some(Ok(other)) => Err(tonic::Status::permission_denied(format!(
                "{other} may not call the worker API: only workers and operators may"
            ))),
            Some(Err(e)) => Err(tonic::Status::unauthenticated(e.to_string())),
            None => Err(tonic::Status::unauthenticated("no client certificate on a client connection")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn principals_round_trip_through_their_uri() {
        for p in [Principal::Node(3), Principal::Worker("w-1".into()), Principal::Operator("ops".into())] {
            assert_eq!(Principal::from_uri(&p.uri()), Some(p));
        }
        for bad in
            ["tenure://node/0", "tenure://node/x", "tenure://worker/", "tenure://admin/a", "https://node/1"]
        {
            assert_eq!(Principal::from_uri(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_the_named_worker_may_act_as_it() {
        assert!(Caller(None).may_act_as("w1").is_ok());
        assert!(Caller(Some(Principal::Worker("w1".into()))).may_act_as("w1").is_ok());
        assert!(Caller(Some(Principal::Worker("w2".into()))).may_act_as("w1").is_err());
        assert!(Caller(Some(Principal::Worker("w".into()))).may_act_as("w1").is_err());
        assert!(Caller(Some(Principal::Operator("w1".into()))).may_act_as("w1").is_err());
        assert!(Caller(Some(Principal::Node(1))).may_act_as("w1").is_err());
    }
}
