//! How nodes and workers open their gRPC channels.
//!
//! Everything that dials (a node's Raft transport, the worker library's client) asks a
//! [`Dialer`] for its channel instead of building a TCP one itself. In production that is
//! plain TCP. The whole-stack simulation (in `tenure-testkit`) plugs in a dialer whose connections run over
//! turmoil's simulated network, so the very same openraft, tonic and worker code can be run
//! under a seeded schedule of losses, delays, partitions and crashes.

use std::sync::Arc;
use tonic::transport::{Channel, Endpoint};

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
