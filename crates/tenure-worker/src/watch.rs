//! The ownership-stream task: follows the session's stream of grants, revokes and losses,
//! reopening it when it ends or when the heartbeats moved to another node.

use super::heartbeat::{retry_pauses, RETRY_FIRST};
use super::{ClientError, Worker};
use crate::proto;
use std::time::Duration;
use tokio_stream::StreamExt;

impl Worker {
    /// Follows the session's ownership stream, reopening it when it ends, and also when the
    /// heartbeats have moved to another node than the one it is on (which may be frozen or cut
    /// off without the connection saying so).
    pub(super) fn watch_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (client, shared) = (self.client.clone(), self.shared.clone());
        let request = proto::WatchRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            namespace: self.namespace.clone(),
        };
        async move {
            let ttl = shared.ttl();
            let (mut patience, mut most) = (ttl / 2, (ttl / 4).clamp(RETRY_FIRST, Duration::from_secs(1)));
            let mut pauses = retry_pauses(most);
            loop {
                // Paced to the TTL of the session's last renewal, which an operator may change.
                let ttl = shared.ttl();
                if patience != ttl / 2 {
                    (patience, most) = (ttl / 2, (ttl / 4).clamp(RETRY_FIRST, Duration::from_secs(1)));
                    pauses = retry_pauses(most);
                }
                let opened = client.call_without_waiting(patience / 3, |mut c| {
                    let request = request.clone();
                    async move { c.watch(request).await }
                });
                let stream = tokio::select! {
                    _ = shared.session_over.cancelled() => return,
                    s = tokio::time::timeout(patience, opened) => s.unwrap_or_else(|_| {
                        Err(ClientError::Unavailable(format!("no ownership stream within {patience:?}")))
                    }),
                };
                match stream {
                    Ok((addr, mut stream)) => {
                        pauses = retry_pauses(most);
                        shared.watching_at(Some(&addr));
                        loop {
                            let next = tokio::select! {
                                _ = shared.session_over.cancelled() => return,
                                n = stream.next() => n,
                                _ = shared.moved.notified() => {
                                    tracing::debug!("heartbeats moved to another node; reopening the ownership stream");
                                    break;
                                }
                            };
                            match next {
                                Some(Ok(event)) => shared.streamed(&event),
                                Some(Err(status)) => {
                                    tracing::debug!(%status, "ownership stream ended");
                                    break;
                                }
                                None => break,
                            }
                        }
                        shared.watching_at(None);
                    }
                    Err(e) if e.is_session_gone() => return, // the heartbeat loop reports it
                    Err(e) => tracing::warn!(error = %e, "cannot open the ownership stream"),
                }
                let pause = pauses.next().unwrap_or(most);
                tokio::select! {
                    _ = shared.session_over.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}
