//! The run's fenced store served over gRPC to worker processes, and the client they use.
//!
//! Worker processes must still reach storage while they are cut off from the coordinators, and
//! the store's journal must stay the single order of decisions that the checker reads. So the
//! store lives in the harness's process and each call is exactly one decision of it: the
//! server adds no state and no retries. A call that fails in transit is reported to the worker
//! as a backend error, and the worker records no operation for it.

use crate::fence::{BatchOp, FenceBatch, FenceError, FenceStore};
use crate::ids::{FencingToken, PartitionId};
use crate::proto::harness::fence_call::Op;
use crate::proto::harness::fenced_store_client::FencedStoreClient;
use crate::proto::harness::fenced_store_server::{FencedStore, FencedStoreServer};
use crate::proto::harness::{BatchChange, FenceAnswer, FenceCall};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

/// Largest key or value a call may carry.
const MAX_CALL_BYTES: usize = 1 << 20;

struct StoreService<S> {
    store: Arc<S>,
}

#[tonic::async_trait]
impl<S: FenceStore + 'static> FencedStore for StoreService<S> {
    async fn apply(&self, request: Request<FenceCall>) -> Result<Response<FenceAnswer>, Status> {
        let call = request.into_inner();
        let (p, t) = (PartitionId(call.partition), FencingToken(call.token));
        let store = &self.store;
        let result = match Op::try_from(call.op).unwrap_or(Op::Unspecified) {
            Op::Raise => store.raise(p, t).await.map(|()| None),
            Op::Write => store.write(p, t, &call.key, &call.value).await.map(|()| None),
            Op::Read => store.read(p, &call.key).await,
            Op::SaveCheckpoint => store.save_checkpoint(p, t, &call.value).await.map(|()| None),
            Op::Checkpoint => store.checkpoint(p, t).await,
            Op::Apply => store.apply(p, t, &batch_of(&call)).await.map(|()| None),
            Op::Highest => {
                let highest = store.highest(p).await.map_err(|e| Status::internal(e.to_string()))?;
                return Ok(Response::new(FenceAnswer {
                    stale: false,
                    highest: highest.map(|t| t.0),
                    value: None,
                }));
            }
            Op::Unspecified => {
                return Err(Status::invalid_argument(format!("unknown operation {}", call.op)))
            }
        };
        match result {
            Ok(value) => Ok(Response::new(FenceAnswer { stale: false, highest: None, value })),
            Err(FenceError::Stale { highest, .. }) => {
                Ok(Response::new(FenceAnswer { stale: true, highest: Some(highest.0), value: None }))
            }
            Err(FenceError::Backend(message)) => Err(Status::internal(message)),
        }
    }
}

/// The batch a call carries, rebuilt in its order.
fn batch_of(call: &FenceCall) -> FenceBatch {
    let mut batch = FenceBatch::new();
    for change in &call.batch {
        match &change.value {
            Some(value) => batch.put(&change.key, value),
            None => batch.delete(&change.key),
        };
    }
    if let Some(checkpoint) = &call.batch_checkpoint {
        batch.checkpoint(checkpoint);
    }
    batch
}

/// Serves `store` on `listener` until `shutdown` fires.
pub async fn serve_store<S: FenceStore + 'static>(
    store: Arc<S>,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let service = FencedStoreServer::new(StoreService { store })
        .max_decoding_message_size(2 * MAX_CALL_BYTES + 1024)
        .max_encoding_message_size(2 * MAX_CALL_BYTES + 1024);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
}

/// A fenced store in another process, reached over gRPC.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure_coordinator::fence::FenceError> {
/// use tenure_coordinator::fence::FenceStore;
/// use tenure_coordinator::ids::{FencingToken, PartitionId};
/// let store = tenure_testkit::nemesis::RemoteStore::new("127.0.0.1:7100")?;
/// store.raise(PartitionId(3), FencingToken(42)).await?; // fence before resume
/// store.write(PartitionId(3), FencingToken(42), b"k", b"v").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RemoteStore {
    client: FencedStoreClient<Channel>,
}

impl RemoteStore {
    /// A client for the store at `host:port`; it connects on the first call.
    pub fn new(addr: &str) -> Result<RemoteStore, FenceError> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| FenceError::Backend(format!("bad store address {addr:?}: {e}")))?
            .connect_timeout(std::time::Duration::from_secs(1))
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(RemoteStore { client: FencedStoreClient::new(channel) })
    }

    async fn call(
        &self,
        op: Op,
        partition: PartitionId,
        token: FencingToken,
        key: &[u8],
        value: &[u8],
    ) -> Result<FenceAnswer, FenceError> {
        if key.len() > MAX_CALL_BYTES || value.len() > MAX_CALL_BYTES {
            return Err(FenceError::Backend(format!("a key or value over {MAX_CALL_BYTES} bytes")));
        }
        let call = FenceCall {
            op: op as i32,
            partition: partition.0,
            token: token.0,
            key: key.to_vec(),
            value: value.to_vec(),
            ..Default::default()
        };
        self.send(call, partition, token).await
    }

    /// Sends one call and reads a refusal as [`FenceError::Stale`].
    async fn send(
        &self,
        call: FenceCall,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<FenceAnswer, FenceError> {
        let answer = self
            .client
            .clone()
            .apply(call)
            .await
            .map_err(|s| FenceError::Backend(s.message().to_string()))?
            .into_inner();
        if answer.stale {
            let highest = FencingToken(answer.highest.unwrap_or(0));
            return Err(FenceError::Stale { partition, token, highest });
        }
        Ok(answer)
    }
}

impl FenceStore for RemoteStore {
    async fn raise(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        self.call(Op::Raise, partition, token, b"", b"").await.map(drop)
    }

    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        if batch.size_bytes() > MAX_CALL_BYTES {
            return Err(FenceError::Backend(format!("a batch over {MAX_CALL_BYTES} bytes")));
        }
        let changes = batch
            .ops()
            .iter()
            .map(|op| match op {
                BatchOp::Put { key, value } => BatchChange { key: key.clone(), value: Some(value.clone()) },
                BatchOp::Delete { key } => BatchChange { key: key.clone(), value: None },
            })
            .collect();
        let call = FenceCall {
            op: Op::Apply as i32,
            partition: partition.0,
            token: token.0,
            batch: changes,
            batch_checkpoint: batch.new_checkpoint().map(<[u8]>::to_vec),
            ..Default::default()
        };
        self.send(call, partition, token).await.map(drop)
    }

    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        Ok(self.call(Op::Read, partition, FencingToken(0), key, b"").await?.value)
    }

    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        Ok(self.call(Op::Checkpoint, partition, token, b"", b"").await?.value)
    }

    async fn highest(&self, partition: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        Ok(self.call(Op::Highest, partition, FencingToken(0), b"", b"").await?.highest.map(FencingToken))
    }
}
