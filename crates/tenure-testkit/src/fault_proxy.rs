//! A TCP proxy in front of one coordinator node (both its listeners, peers' and clients') that
//! can cut chosen sources off: the network partitions of the nemesis. Every participant of a run dials from its own loopback address
//! (nodes from `127.0.1.<id>`, workers from `127.0.2.<n>`), so the proxy knows who is calling
//! by the source address alone. Blocking a source cuts its open connections and refuses new
//! ones until healed: the caller sees resets, then timeouts of its retries, as across a broken
//! link. A delay holds every chunk back by that long in both directions, order kept, as on a
//! slow or congested link (TCP turns loss into such delay).

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinHandle};

#[derive(Default)]
struct Links {
    blocked: HashSet<IpAddr>,
    open: Vec<(IpAddr, AbortHandle)>,
}

/// Forwards connections from each of its addresses to that address's target, except from
/// blocked sources; one rule set covers them all.
pub struct FaultProxy {
    addrs: Vec<SocketAddr>,
    links: Arc<Mutex<Links>>,
    /// Added to every chunk in flight, in microseconds.
    delay_us: Arc<AtomicU64>,
    accepts: Vec<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and forwards to `target`.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> std::io::Result<FaultProxy> {
        let links = Arc::new(Mutex::new(Links::default()));
        let delay_us = Arc::new(AtomicU64::new(0));
        let mut proxy = FaultProxy { addrs: Vec::new(), links, delay_us, accepts: Vec::new() };
        proxy.forward_also(listen, target).await?;
        Ok(proxy)
    }

    /// Also listens on `listen` and forwards to `target`, under the same blocks and delay (a
    /// node's second listener); returns the new address.
    pub async fn forward_also(
        &mut self,
        listen: SocketAddr,
        target: SocketAddr,
    ) -> std::io::Result<SocketAddr> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let accept = accept_loop(listener, target, self.links.clone(), self.delay_us.clone());
        self.accepts.push(tokio::spawn(accept));
        self.addrs.push(addr);
        Ok(addr)
    }

    /// The first address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addrs[0]
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

    /// Holds every chunk sent from now on, either way, back by `delay` (zero: none).
    pub fn delay(&self, delay: Duration) {
        self.delay_us.store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// Lets every source through again, without delay.
    pub fn heal(&self) {
        self.links.lock().expect("proxy lock poisoned").blocked.clear();
        self.delay(Duration::ZERO);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        for accept in &self.accepts {
            accept.abort();
        }
        for (_, task) in self.links.lock().expect("proxy lock poisoned").open.drain(..) {
            task.abort();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    links: Arc<Mutex<Links>>,
    delay_us: Arc<AtomicU64>,
) {
    loop {
        let Ok((inbound, peer)) = listener.accept().await else { continue };
        let mut guard = links.lock().expect("proxy lock poisoned");
        if guard.blocked.contains(&peer.ip()) {
            continue; // dropping the stream refuses the connection
        }
        let task = tokio::spawn(forward(inbound, target, delay_us.clone()));
        guard.open.retain(|(_, t)| !t.is_finished());
        guard.open.push((peer.ip(), task.abort_handle()));
    }
}

async fn forward(inbound: TcpStream, target: SocketAddr, delay_us: Arc<AtomicU64>) {
    let Ok(outbound) = TcpStream::connect(target).await else { return };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (from_caller, to_caller) = inbound.into_split();
    let (from_node, to_node) = outbound.into_split();
    tokio::join!(pipe(from_caller, to_node, delay_us.clone()), pipe(from_node, to_caller, delay_us));
}

/// Copies one direction until it ends, each chunk due the proxy's delay after it was read.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay_us: Arc<AtomicU64>) {
    let (chunks, mut due) = mpsc::channel::<(Instant, Vec<u8>)>(256);
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            let at = Instant::now() + Duration::from_micros(delay_us.load(Ordering::Relaxed));
            if chunks.send((at, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
