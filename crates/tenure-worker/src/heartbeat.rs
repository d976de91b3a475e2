//! The heartbeat task: one long-lived stream to the leader per session, one heartbeat
//! outstanding at a time, each answer taken into the session's belief from the instant its
//! heartbeat was sent.

use super::{send_release_request, Client, ClientError, Worker};
use crate::ids::PartitionId;
use crate::proto;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The first pause after a failed heartbeat or stream; pauses double from here.
pub(super) const RETRY_FIRST: Duration = Duration::from_millis(20);

/// Pauses between retries: from [`RETRY_FIRST`], doubling up to `most`, with jitter so that
/// many workers cut off together do not come back in step; endless (the caller starts a new
/// one after a success).
pub(super) fn retry_pauses(most: Duration) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(RETRY_FIRST.min(most))
        .with_max_delay(most)
        .with_jitter()
        .without_max_times()
        .build()
        .map(move |d| d.min(most))
}

/// The worker's end of a `Heartbeats` stream to the leader.
struct HeartbeatStream {
    /// The node that took the stream: avoided next time if it stops answering.
    addr: String,
    requests: mpsc::Sender<proto::HeartbeatRequest>,
    answers: tonic::Streaming<proto::HeartbeatResponse>,
    /// What this stream's answers renew, built from the changes each answer carries.
    renewing: BTreeMap<u32, u64>,
}

impl HeartbeatStream {
    /// Opens a stream on the leader, following redirects but never waiting: the heartbeat loop
    /// paces its own retries against the lease deadline.
    async fn open(client: &Client, per_node: Duration) -> Result<HeartbeatStream, ClientError> {
        let (addr, (requests, answers)) = client
            .call_without_waiting(per_node, |mut c| async move {
                let (requests, outgoing) = mpsc::channel(1);
                let answers = c.heartbeats(tokio_stream::wrappers::ReceiverStream::new(outgoing)).await?;
                Ok(answers.map(|answers| (requests, answers)))
            })
            .await?;
        Ok(HeartbeatStream { addr, requests, answers, renewing: BTreeMap::new() })
    }

    /// Sends one heartbeat and waits for its whole answer (the changes since the stream's last
    /// one, over as many messages as they take); returns every grant it renewed. A refusal that
    /// names another leader points the client there.
    async fn beat(
        &mut self,
        client: &Client,
        request: proto::HeartbeatRequest,
    ) -> Result<(Vec<proto::PartitionLease>, Option<Duration>), ClientError> {
        self.requests
            .send(request)
            .await
            .map_err(|_| ClientError::Unavailable("heartbeat stream closed".into()))?;
        loop {
            match self.answers.message().await {
                Ok(Some(answer)) => {
                    for partition in answer.dropped {
                        self.renewing.remove(&partition);
                    }
                    self.renewing.extend(answer.renewed.iter().map(|l| (l.partition, l.token)));
                    if !answer.more {
                        let renewing = self.renewing.iter();
                        let leases = renewing
                            .map(|(&partition, &token)| proto::PartitionLease { partition, token })
                            .collect();
                        let ttl =
                            (answer.lease_ttl_ms > 0).then(|| Duration::from_millis(answer.lease_ttl_ms));
                        return Ok((leases, ttl));
                    }
                }
                Ok(None) => return Err(ClientError::Unavailable("heartbeat stream ended".into())),
                Err(status) => {
                    client.judge(&status, &self.addr)?;
                    return Err(ClientError::Unavailable(status.message().to_string()));
                }
            }
        }
    }
}

impl Worker {
    /// Renews the session every heartbeat interval (a quarter of the cluster's TTL unless
    /// configured; it follows a TTL change), or at once when the stream names a new grant, over one
    /// long-lived stream to the leader, one heartbeat outstanding at a time. Each answer extends
    /// the leases from the instant its heartbeat was sent; meanwhile the deadline task lets
    /// leases run out.
    ///
    /// One attempt (finding the leader, a twelfth of a TTL per node tried, opening the stream if
    /// there is none, one heartbeat and its answer) is bounded by a quarter TTL. A failed attempt
    /// drops the stream and is retried soon, backing off (with jitter) from 20 ms up to `every`;
    /// a node that let a heartbeat go unanswered is moved away from. So a frozen or dead leader
    /// costs one bounded attempt: the worker's last confirmed send was at most a heartbeat
    /// interval before the failure, its lease lasts `TTL - margin` from that send, and the
    /// attempt that finds the leader silent gives up half a TTL after it, which leaves the
    /// election and the first renewal on the new leader the rest.
    pub(super) fn heartbeat_loop(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (client, shared) = (self.client.clone(), self.shared.clone());
        let request = proto::HeartbeatRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            namespace: self.namespace.clone(),
            ..Default::default()
        };
        let request_release = proto::ReleaseRequest {
            session_id: self.session.0,
            secret: self.secret.clone(),
            namespace: self.namespace.clone(),
            ..Default::default()
        };
        async move {
            let mut stream: Option<HeartbeatStream> = None;
            let mut every = shared.heartbeat_every();
            let mut retries = retry_pauses(every);
            let mut failing = false;
            loop {
                let patience = shared.ttl() / 4;
                let sent = Instant::now();
                let attempt = async {
                    if stream.is_none() {
                        stream = Some(HeartbeatStream::open(&client, patience / 3).await?);
                    }
                    stream.as_mut().expect("opened above").beat(&client, request.clone()).await
                };
                let result = tokio::select! {
                    _ = shared.session_over.cancelled() => return,
                    r = tokio::time::timeout(patience, attempt) => r,
                };
                let timed_out = result.is_err();
                let outcome = result.unwrap_or_else(|_| {
                    if let Some(s) = &stream {
                        client.avoid(&s.addr);
                    }
                    Err(ClientError::Unavailable(format!("no heartbeat answer within {patience:?}")))
                });
                let pause = match outcome {
                    Ok((renewed, ttl)) => {
                        let unreleased = shared.renewed(sent, &renewed, ttl);
                        let leaving = shared.leaving.load(std::sync::atomic::Ordering::SeqCst);
                        if !unreleased.is_empty() && !leaving {
                            // A release that did not get through: sent again beside the
                            // heartbeats, which must not wait for it.
                            let (partitions, tokens): (Vec<u32>, Vec<u64>) = unreleased.into_iter().unzip();
                            let settled: Vec<PartitionId> =
                                partitions.iter().map(|p| PartitionId(*p)).collect();
                            let release =
                                proto::ReleaseRequest { partitions, tokens, ..request_release.clone() };
                            let (client, shared) = (client.clone(), shared.clone());
                            tokio::spawn(async move {
                                let _ = send_release_request(client, release).await;
                                shared.release_settled(&settled);
                            });
                        }
                        failing = false;
                        every = shared.heartbeat_every();
                        retries = retry_pauses(every);
                        if let Some(s) = &stream {
                            shared.heartbeats_at(&s.addr);
                        }
                        every
                    }
                    Err(e) if e.is_session_gone() => {
                        shared.end_session(crate::SessionEnd::Gone(e));
                        return;
                    }
                    Err(e) => {
                        if failing {
                            tracing::debug!(error = %e, "heartbeat failed again");
                        } else {
                            tracing::warn!(error = %e, "heartbeat failed; retrying");
                        }
                        stream = None;
                        failing = true;
                        // After a timeout, a quarter TTL has gone by already: try again at once.
                        let pause = retries.next().unwrap_or(every);
                        if timed_out {
                            RETRY_FIRST.min(pause)
                        } else {
                            pause
                        }
                    }
                };
                tokio::select! {
                    _ = shared.session_over.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                    _ = shared.kick.notified() => {}
                }
            }
        }
    }
}
