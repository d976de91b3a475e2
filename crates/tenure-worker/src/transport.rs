//! How nodes and workers open their gRPC channels, and with which TLS identity.
//!
//! Everything that dials (a node's Raft transport, the worker library's client) asks a
//! [`Dialer`] for its channel instead of building a TCP one itself. In production that is
//! plain TCP. The whole-stack simulation (in `tenure-testkit`) plugs in a dialer whose connections run over
//! turmoil's simulated network, so the very same openraft, tonic and worker code can be run
//! under a seeded schedule of losses, delays, partitions and crashes.

use std::path::Path;
use std::sync::Arc;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A client's TLS material, PEM encoded: the cluster's CA certificate (the only one trusted
/// for the coordinators), and the client's own certificate and key, which name it
/// (`tenure://worker/<name>` or `tenure://operator/<name>`).
#[derive(Clone)]
pub struct ClientTls {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for ClientTls {
    // Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Reads the three PEM files; an error names the file that could not be read or holds
    /// no PEM block of the expected kind.
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<ClientTls, String> {
        let read = |p: &Path, label: &str| {
            let pem = std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
            if String::from_utf8_lossy(&pem).contains(label) {
                Ok(pem)
            } else {
                Err(format!("{} holds no PEM {label}", p.display()))
            }
        };
        Ok(ClientTls {
            ca_pem: read(ca, "CERTIFICATE")?,
            cert_pem: read(cert, "CERTIFICATE")?,
            key_pem: read(key, "PRIVATE KEY")?,
        })
    }

    /// tonic's form of it: trust only the cluster's CA, present this identity.
    pub fn config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
    }
}

/// Opens channels that connect on first use.
///
/// ```
/// use tenure_worker::transport::Dialer;
/// let endpoint = tonic::transport::Endpoint::from_static("http://127.0.0.1:7001");
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let _channel = Dialer::tcp().channel(endpoint); // nothing connects until the first call
/// # });
/// ```
#[derive(Clone, Default)]
pub struct Dialer(Option<Arc<dyn Dial>>);

/// A way to connect other than TCP, for [`Dialer::custom`].
pub trait Dial: Send + Sync + 'static {
    /// A channel to `endpoint` that connects when first used and reconnects when broken.
    fn channel(&self, endpoint: Endpoint) -> Channel;
}

impl Dialer {
    /// TCP, with the endpoint's own settings.
    pub fn tcp() -> Dialer {
        Dialer(None)
    }

    /// Connections made by `dial`.
    pub fn custom(dial: impl Dial) -> Dialer {
        Dialer(Some(Arc::new(dial)))
    }

    /// A channel to `endpoint` that connects when first used.
    pub fn channel(&self, endpoint: Endpoint) -> Channel {
        match &self.0 {
            None => endpoint.connect_lazy(),
            Some(dial) => dial.channel(endpoint),
        }
    }
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Dialer(custom)" } else { "Dialer(tcp)" })
    }
}
