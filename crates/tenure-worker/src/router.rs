//! Key -> partition -> owner lookups for callers that route requests (front-ends), kept fresh
//! from the coordinator's route stream. A route is a hint for where to send a request; the
//! owner's fenced store still decides whether its writes are current.

use super::{Client, ClientError};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::keyspace::KeySpace;
use crate::proto;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

/// Who owns a partition right now, as far as the stream has told.
///
/// ```no_run
/// # fn example(router: &tenure_worker::Router) {
/// use tenure_worker::ids::PartitionId;
/// if let Some(route) = router.route_partition(PartitionId(12)) {
///     let state = if route.revoking { "moving away" } else { "settled" };
///     println!("{} holds {} under token {} ({state})", route.worker, route.partition, route.token);
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub partition: PartitionId,
    pub session: SessionId,
    pub worker: String,
    pub token: FencingToken,
    /// Moving away: requests may be refused by the owner soon.
    pub revoking: bool,
}

#[derive(Default)]
struct Table {
    keyspace: Option<KeySpace>,
    routes: Vec<Option<Route>>,
}

/// A live routing table. Dropping it stops the stream.
///
/// ```no_run
/// # async fn example() -> Result<(), tenure_worker::ClientError> {
/// use tenure_worker::Router;
/// let router = Router::connect(vec!["127.0.0.1:7001".into()])?;
/// match router.route(b"customer-42") {
///     Some(route) if !route.revoking => println!("send to {}", route.worker),
///     _ => println!("no settled owner yet; retry shortly"),
/// }
/// # Ok(()) }
/// ```
pub struct Router {
    table: Arc<RwLock<Table>>,
    stop: CancellationToken,
}

impl Drop for Router {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Router {
    /// Starts following the cluster's routes; reconnects (and resynchronises) on its own.
    pub fn connect(coordinators: Vec<String>) -> Result<Router, ClientError> {
        Ok(Router::follow(Client::new(coordinators)?))
    }

    /// Starts following the cluster's routes through `client` (which carries its TLS identity
    /// and dialer); reconnects (and resynchronises) on its own.
    pub fn follow(client: Client) -> Router {
        Router::follow_namespace(client, "")
    }

    /// [`Router::follow`] for the routes of one namespace (empty: `default`).
    pub fn follow_namespace(client: Client, namespace: &str) -> Router {
        let table = Arc::new(RwLock::new(Table::default()));
        let stop = CancellationToken::new();
        let (t, s) = (table.clone(), stop.clone());
        let request = proto::RoutesRequest { namespace: namespace.to_string() };
        tokio::spawn(async move {
            loop {
                let request = request.clone();
                let opened = client.call(|mut c| {
                    let request = request.clone();
                    async move { c.routes(request).await }
                });
                let stream = tokio::select! {
                    _ = s.cancelled() => return,
                    opened = opened => opened,
                };
                if let Ok(mut stream) = stream {
                    loop {
                        let next = tokio::select! {
                            _ = s.cancelled() => return,
                            next = stream.next() => next,
                        };
                        match next {
                            Some(Ok(update)) => apply(&t, update),
                            _ => break,
                        }
                    }
                }
                tokio::select! {
                    _ = s.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        });
        Router { table, stop }
    }

    /// The owner of `key`'s partition, if the table knows one.
    pub fn route(&self, key: &[u8]) -> Option<Route> {
        let table = self.table.read().expect("router lock poisoned");
        let p = table.keyspace?.partition_of_key(key);
        table.routes.get(p.0 as usize).cloned().flatten()
    }

    /// The owner of a partition, if the table knows one.
    pub fn route_partition(&self, p: PartitionId) -> Option<Route> {
        self.table.read().expect("router lock poisoned").routes.get(p.0 as usize).cloned().flatten()
    }
}

fn apply(table: &RwLock<Table>, update: proto::RouteUpdate) {
    let mut table = table.write().expect("router lock poisoned");
    let Ok(keyspace) = KeySpace::new(update.partition_count) else { return };
    if table.keyspace != Some(keyspace) {
        table.keyspace = Some(keyspace);
        table.routes = vec![None; update.partition_count as usize];
    }
    let Some(slot) = table.routes.get_mut(update.partition as usize) else { return };
    *slot = (update.session_id != 0).then_some(Route {
        partition: PartitionId(update.partition),
        session: SessionId(update.session_id),
        worker: update.worker,
        token: FencingToken(update.token),
        revoking: update.revoking,
    });
}
