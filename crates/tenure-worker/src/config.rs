//! How a worker joins and how cautious it is.

use std::time::Duration;

/// How a worker joins and how cautious it is. [`WorkerConfig::new`] sets weight 1 and leaves the
/// timings to their defaults, which follow the cluster's lease TTL.
///
/// ```
/// use std::time::Duration;
/// use tenure_worker::WorkerConfig;
/// let nodes = vec!["10.0.0.1:7001".to_string(), "10.0.0.2:7001".to_string()];
/// let mut config = WorkerConfig::new(nodes, "billing-1");
/// config.weight = 2; // about twice the partitions of a weight-1 worker
/// config.safety_margin = Some(Duration::from_millis(500));
/// assert_eq!(config.heartbeat_interval, None); // TTL / 4
/// ```
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub coordinators: Vec<String>,
    /// Stable across restarts, so the cluster recognises the worker.
    pub name: String,
    /// The namespace (job) to join; empty for the cluster's `default` one. It must exist (an
    /// operator creates it: `tenure ctl namespace create`). Partition numbers, tokens and
    /// session ids belong to their namespace; a process may run one worker per namespace.
    pub namespace: String,
    pub weight: u32,
    /// Subtracted from every local lease to cover clock-rate drift; default TTL / 5.
    pub safety_margin: Option<Duration>,
    /// Time between heartbeats; default TTL / 4.
    pub heartbeat_interval: Option<Duration>,
    /// Source address for connections to the coordinators, on hosts with several addresses.
    pub dial_from: Option<std::net::IpAddr>,
    /// How connections to the coordinators are opened; TCP unless a simulation says otherwise.
    pub dialer: crate::transport::Dialer,
    /// The certificate to connect with, which must name `tenure://worker/<name>` for this
    /// worker's name; `None` only for a cluster started with `--insecure`.
    pub tls: Option<crate::transport::ClientTls>,
    /// How many events [`crate::Worker::events`] queues for a reader that is behind before the
    /// worker gives its session up; default four per partition of the cluster, at least 65,536.
    pub event_capacity: Option<usize>,
}

impl WorkerConfig {
    pub fn new(coordinators: Vec<String>, name: impl Into<String>) -> Self {
        WorkerConfig {
            coordinators,
            name: name.into(),
            namespace: String::new(),
            weight: 1,
            safety_margin: None,
            heartbeat_interval: None,
            dial_from: None,
            dialer: crate::transport::Dialer::tcp(),
            tls: None,
            event_capacity: None,
        }
    }
}
