//! A TCP proxy in front of one coordinator node that can cut chosen sources off: the network
//! partitions of the nemesis. Every participant of a run dials from its own loopback address
//! (nodes from `127.0.1.<id>`, workers from `127.0.2.<n>`), so the proxy knows who is calling
//! by the source address alone. Blocking a source cuts its open connections and refuses new
//! ones until healed: the caller sees resets, then timeouts of its retries, as across a broken
//! link.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

#[derive(Default)]
struct Links {
    blocked: HashSet<IpAddr>,
    open: Vec<(IpAddr, AbortHandle)>,
}

/// Forwards connections from `addr()` to a target, except from blocked sources.
pub struct FaultProxy {
    addr: SocketAddr,
    links: Arc<Mutex<Links>>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and forwards to `target`.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let links = Arc::new(Mutex::new(Links::default()));
        let accept = tokio::spawn(accept_loop(listener, target, links.clone()));
        Ok(FaultProxy { addr, links, accept })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts every open connection from `sources` and refuses their new ones.
    pub fn block(&self, sources: &[IpAddr]) {
        let mut links = self.links.lock().expect("proxy lock poisoned");
        links.blocked.extend(sources.iter().copied());
        links.open.retain(|(ip, task)| {
            if sources.contains(ip) {
                task.abort();
                false
            } else {
                !task.is_finished()
            }
        });
    }

    /// Lets every source through again.
    pub fn heal(&self) {
        self.links.lock().expect("proxy lock poisoned").blocked.clear();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for (_, task) in self.links.lock().expect("proxy lock poisoned").open.drain(..) {
            task.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, links: Arc<Mutex<Links>>) {
    loop {
        let Ok((inbound, peer)) = listener.accept().await else { continue };
        let mut guard = links.lock().expect("proxy lock poisoned");
        if guard.blocked.contains(&peer.ip()) {
            continue; // dropping the stream refuses the connection
        }
        let task = tokio::spawn(forward(inbound, target));
        guard.open.retain(|(_, t)| !t.is_finished());
        guard.open.push((peer.ip(), task.abort_handle()));
    }
}

async fn forward(mut inbound: TcpStream, target: SocketAddr) {
    let Ok(mut outbound) = TcpStream::connect(target).await else { return };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
}
