//! gRPC over turmoil's simulated network: a [`Dial`] for clients and an accept stream for the
//! server, so tonic runs unchanged between simulated hosts.

use crate::transport::{Dial, Dialer};
use hyper_util::rt::TokioIo;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::{Channel, Endpoint, Uri};

/// Connects to `host:port` names on the simulated network.
struct SimulatedDial;

impl Dial for SimulatedDial {
    fn channel(&self, endpoint: Endpoint) -> Channel {
        endpoint.connect_with_connector_lazy(tower::service_fn(|uri: Uri| async move {
            let host = uri.host().ok_or_else(|| io::Error::other(format!("no host in {uri}")))?.to_string();
            let port = uri.port_u16().ok_or_else(|| io::Error::other(format!("no port in {uri}")))?;
            let stream = turmoil::net::TcpStream::connect((host.as_str(), port)).await?;
            Ok::<_, io::Error>(TokioIo::new(stream))
        }))
    }
}

/// The dialer of every simulated node and worker.
pub(crate) fn dialer() -> Dialer {
    Dialer::custom(SimulatedDial)
}

/// One accepted connection, as tonic's server wants it.
pub(crate) struct Accepted(turmoil::net::TcpStream);

impl tonic::transport::server::Connected for Accepted {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Accepted {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// Every connection `listener` accepts, for as long as it accepts.
pub(crate) fn incoming(
    listener: turmoil::net::TcpListener,
) -> impl futures::Stream<Item = io::Result<Accepted>> + Send + 'static {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| Accepted(stream));
        Some((accepted, listener))
    })
}
