//! `tenure ctl`: an operator's view of a running cluster and hand on it, shaped like etcdctl.
//!
//! Reads are linearizable unless `--consistency serializable` is asked for: the leader answers
//! once a quorum has confirmed that it still leads, so what ctl prints is never older than what
//! was committed when it asked. Every command prints a table for people, or (`-w json`) one JSON
//! document for scripts (`watch`: one per line). The JSON shapes are part of the interface:
//! `tests/processes.rs` reads each of them from a real cluster.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};
use tenure::ids::NodeId;
use tenure::proto::operator_client::OperatorClient;
use tenure::proto::{self, StatusRequest, StatusResponse};
use tenure::worker::Client;

#[derive(Args)]
pub struct CtlArgs {
    /// Coordinator addresses (host:port), comma separated. Any of them will do: ctl finds the
    /// leader.
    #[arg(
        long,
        visible_alias = "coordinators",
        env = "TENURE_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    endpoints: Vec<String>,
    /// Output: a table for people, or JSON for scripts.
    #[arg(short = 'w', long = "write-out", value_enum, default_value_t = Output::Table)]
    write_out: Output,
    /// Reads from the leader after a quorum confirmed it (linearizable), or from whichever node
    /// answers first, possibly behind (serializable).
    #[arg(long, value_enum, default_value_t = Consistency::Linearizable)]
    consistency: Consistency,
    /// The namespace (job) the command is about; the cluster's `default` one if not given.
    #[arg(short = 'n', long, env = "TENURE_NAMESPACE", default_value = "")]
    namespace: String,
    #[command(flatten)]
    tls: super::ClientTlsArgs,
    #[command(subcommand)]
    what: CtlCommand,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Consistency {
    Linearizable,
    Serializable,
}

#[derive(Subcommand)]
enum CtlCommand {
    /// Members, leader, sessions and the whole partition table.
    Status,
    /// The coordinator nodes themselves: list, add, promote, remove.
    #[command(subcommand)]
    Member(MemberCommand),
    /// Each endpoint's own view (status) or whether it serves (health).
    #[command(subcommand)]
    Endpoint(EndpointCommand),
    /// Worker sessions.
    #[command(subcommand)]
    Session(SessionCommand),
    /// The partition table.
    #[command(subcommand)]
    Partition(PartitionCommand),
    /// Which partition a key falls in, and who owns it.
    Key {
        /// The key, as bytes of this UTF-8 string.
        key: String,
    },
    /// Move everything off a worker gracefully, then end its session (as its own leave would).
    Drain { name: String },
    /// Maintenance mode: while on, the leader grants unowned partitions but takes none from a
    /// live owner (for a rolling deployment of workers).
    Maintenance {
        #[arg(value_enum)]
        mode: OnOff,
    },
    /// Set a worker's weight (1 to 1,000): its live sessions' now, and its later sessions'.
    Weight { name: String, weight: u32 },
    /// Set the lease TTL renewals are granted under from now on (100 to 86,400,000 ms). Workers
    /// follow it from their next renewal; a lease granted before keeps the TTL it was told.
    LeaseTtl {
        /// The new TTL, in milliseconds.
        ms: u64,
    },
    /// Set the revoke budget, the most partitions in motion at once (--unlimited for none).
    RevokeBudget {
        #[arg(required_unless_present = "unlimited", conflicts_with = "unlimited")]
        partitions: Option<u32>,
        #[arg(long)]
        unlimited: bool,
    },
    /// Move a partition to a worker and pin it there (--to NAME), or unpin it (--unpin): the
    /// leader moves it gracefully and keeps it with that worker's live session.
    Move {
        partition: u32,
        #[arg(long, required_unless_present = "unpin", conflicts_with = "unpin")]
        to: Option<String>,
        #[arg(long)]
        unpin: bool,
    },
    /// The cluster's namespaces, each a job of its own: list, create, delete. A namespace's
    /// lease TTL and revoke budget are changed with `--namespace NAME lease-ttl` and
    /// `revoke-budget`.
    #[command(subcommand)]
    Namespace(NamespaceCommand),
    /// Ownership changes as they commit (owner, token, revoking), one per line; reconnects to
    /// a new leader and reports what changed meanwhile.
    Watch {
        /// Stop after this many changes.
        #[arg(long)]
        max_events: Option<u64>,
    },
}

#[derive(Subcommand)]
enum NamespaceCommand {
    /// Every namespace with its partition count, lease TTL, revoke budget and counts.
    List,
    /// Create a namespace (creating one that exists with the same settings changes nothing).
    Create {
        name: String,
        /// Its partition count (1 to 1,048,576).
        #[arg(long)]
        partitions: u32,
        /// Its lease TTL in milliseconds (100 to 86,400,000).
        #[arg(long)]
        lease_ttl_ms: u64,
        /// Its revoke budget: the most partitions in motion at once (none if not given).
        #[arg(long)]
        max_revoking: Option<u32>,
    },
    /// Delete a namespace with no session left (drain its workers first).
    Delete { name: String },
}

#[derive(Subcommand)]
enum MemberCommand {
    /// Every member with its role, addresses and how far it has replicated.
    List,
    /// Add a node as a learner, given as ID=CLIENT_ADDR/PEER_ADDR (host:port each); start it
    /// first with `tenure serve --join`.
    Add { member: String },
    /// Make a learner a voter once it has caught up.
    Promote { id: NodeId },
    /// Remove a node (a voter or a learner).
    Remove { id: NodeId },
}

#[derive(Subcommand)]
enum EndpointCommand {
    /// Each endpoint's id, version, term, leader, log and applied index, as it sees them.
    Status {
        /// Every member of the cluster rather than the endpoints given.
        #[arg(long)]
        cluster: bool,
    },
    /// Whether each endpoint serves (grpc.health.v1): it knows a leader, has applied nearly
    /// all it holds and is not stopping. Exits non-zero if any does not.
    Health {
        /// Every member of the cluster rather than the endpoints given.
        #[arg(long)]
        cluster: bool,
    },
}

#[derive(Subcommand)]
enum SessionCommand {
    /// Every session: name, weight, partitions owned, whether leaving, lease time left.
    List,
}

#[derive(Subcommand)]
enum PartitionCommand {
    /// Partitions with owner, token and lease time left, in order.
    List {
        /// Only those held by (or moving to) this worker.
        #[arg(long)]
        owner: Option<String>,
        /// At most this many rows.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// One partition: owner, token, whether revoking, lease time left by the leader's clock.
    Get { partition: u32 },
}

/// How long one endpoint gets to answer `endpoint status` or `endpoint health`.
const ENDPOINT_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn run(args: CtlArgs) -> Result<()> {
    let tls = args.tls.load()?;
    let client = Client::new(args.endpoints.clone())?.with_tls(tls.clone());
    let json = args.write_out == Output::Json;
    let linearizable = args.consistency == Consistency::Linearizable;
    let namespace = args.namespace.clone();
    let read = |request: StatusRequest, max_rows: Option<usize>| {
        client.read_status(StatusRequest { linearizable, namespace: namespace.clone(), ..request }, max_rows)
    };
    let out = match args.what {
        CtlCommand::Status => {
            let status = read(StatusRequest::default(), None).await?;
            shown(json, || super::demo::render_status(&status), || status_json(&status))
        }
        CtlCommand::Member(command) => member(&client, command).await?.render(json),
        CtlCommand::Endpoint(EndpointCommand::Status { cluster }) => {
            let endpoints = endpoints(&client, &args.endpoints, cluster, linearizable).await?;
            endpoint_status(&endpoints, tls.as_ref()).await.render(json)
        }
        CtlCommand::Endpoint(EndpointCommand::Health { cluster }) => {
            let endpoints = endpoints(&client, &args.endpoints, cluster, linearizable).await?;
            let (report, unhealthy) = endpoint_health(&endpoints, tls.as_ref()).await;
            print!("{}", report.render(json));
            if unhealthy > 0 {
                bail!("{unhealthy} of {} endpoints are unhealthy", endpoints.len());
            }
            return Ok(());
        }
        CtlCommand::Session(SessionCommand::List) => {
            let status = read(StatusRequest { omit_partitions: true, ..Default::default() }, None).await?;
            sessions(&status).render(json)
        }
        CtlCommand::Partition(PartitionCommand::List { owner, limit }) => {
            // At most `limit` rows arrive: each page asks for what is still missing.
            let status = read(StatusRequest { owner, ..Default::default() }, limit).await?;
            partitions(&status).render(json)
        }
        CtlCommand::Partition(PartitionCommand::Get { partition }) => {
            let status =
                read(StatusRequest { from_partition: partition, limit: 1, ..Default::default() }, Some(1))
                    .await?;
            let row = status.partitions.first().filter(|r| r.partition == partition).with_context(|| {
                format!("partition {partition} is out of range (the cluster has {})", status.partition_count)
            })?;
            partition_table(&status, row).render(json)
        }
        CtlCommand::Key { key } => {
            // The partition count first: the key's partition depends on it.
            let counts = read(StatusRequest { omit_partitions: true, ..Default::default() }, None).await?;
            let space = tenure::keyspace::KeySpace::new(counts.partition_count)
                .map_err(|e| anyhow::anyhow!("the cluster has no partition table yet ({e})"))?;
            let p = space.partition_of_key(key.as_bytes());
            let status =
                read(StatusRequest { from_partition: p.0, limit: 1, ..Default::default() }, Some(1)).await?;
            let row =
                status.partitions.first().context("the cluster did not answer with the key's partition")?;
            let range = space.range(p).context("the key's partition is out of range")?;
            let hash = tenure::keyspace::hash_key(key.as_bytes());
            let mut table = partition_table(&status, row);
            if let Value::Object(fields) = &mut table.json {
                fields.insert("key".into(), json!(key));
                fields.insert("hash".into(), json!(hash));
                fields.insert("range".into(), json!({ "start": range.start, "end": range.end }));
            }
            let text = || {
                format!(
                    "key {key:?} hashes to {hash:#018x}, in partition {} [{:#018x}, {:#018x}]\n{}",
                    p.0,
                    range.start,
                    range.end,
                    table.render(false)
                )
            };
            shown(json, text, || table.json.clone())
        }
        CtlCommand::Drain { name } => {
            let request = proto::DrainRequest { name: name.clone(), namespace };
            let drained = operator(&client, request, |mut c, r| async move { c.drain(r).await }).await?;
            let text = || {
                format!(
                    "draining {name}: sessions {:?} are leaving; their partitions move as they are given back\n",
                    drained.sessions
                )
            };
            shown(json, text, || json!({ "worker": name, "sessions": drained.sessions }))
        }
        CtlCommand::Maintenance { mode } => {
            let on = mode == OnOff::On;
            let request = proto::SetMaintenanceRequest { on, namespace };
            let set =
                operator(&client, request, |mut c, r| async move { c.set_maintenance(r).await }).await?;
            let word = |on: bool| if on { "on" } else { "off" };
            let text = || format!("maintenance mode {} (was {})\n", word(on), word(set.was));
            shown(json, text, || json!({ "maintenance": on, "was": set.was }))
        }
        CtlCommand::Weight { name, weight } => {
            let request = proto::SetWeightRequest { name: name.clone(), weight, namespace };
            let set = operator(&client, request, |mut c, r| async move { c.set_weight(r).await }).await?;
            let text = || format!("{name} has weight {weight} (sessions {:?})\n", set.sessions);
            shown(json, text, || json!({ "worker": name, "weight": weight, "sessions": set.sessions }))
        }
        CtlCommand::LeaseTtl { ms } => {
            let request = proto::SetLeaseTtlRequest { lease_ttl_ms: ms, namespace };
            let set = operator(&client, request, |mut c, r| async move { c.set_lease_ttl(r).await }).await?;
            let text = || {
                format!(
                    "lease TTL {ms} ms (was {} ms); workers follow it from their next renewal\n",
                    set.was_ms
                )
            };
            shown(json, text, || json!({ "lease_ttl_ms": ms, "was_ms": set.was_ms }))
        }
        CtlCommand::RevokeBudget { partitions, .. } => {
            let request = proto::SetRevokeBudgetRequest { max_revoking: partitions, namespace };
            let set =
                operator(&client, request, |mut c, r| async move { c.set_revoke_budget(r).await }).await?;
            let word = |b: Option<u32>| b.map_or("unlimited".to_string(), |n| format!("{n} partitions"));
            let text = || format!("revoke budget {} (was {})\n", word(partitions), word(set.was));
            shown(json, text, || json!({ "max_revoking": partitions, "was": set.was }))
        }
        CtlCommand::Move { partition, to, .. } => {
            let request = proto::MoveRequest { partition, to: to.clone().unwrap_or_default(), namespace };
            let moved = operator(&client, request, |mut c, r| async move { c.r#move(r).await }).await?;
            let was = (!moved.was.is_empty()).then_some(moved.was);
            let text = || match &to {
                Some(name) => {
                    format!("partition {partition} pinned to {name}; it moves there as it is given back\n")
                }
                None => format!("partition {partition} unpinned\n"),
            };
            shown(json, text, || json!({ "partition": partition, "to": to, "was": was }))
        }
        CtlCommand::Namespace(command) => namespaces(&client, command).await?.render(json),
        CtlCommand::Watch { max_events } => return watch(&client, &namespace, json, max_events).await,
    };
    print!("{out}");
    Ok(())
}

/// What a command prints: its text, or its JSON document on one line.
fn shown(json: bool, text: impl FnOnce() -> String, document: impl FnOnce() -> Value) -> String {
    match json {
        true => format!("{}\n", document()),
        false => text(),
    }
}

/// One call of the operator service, made on the leader (followed like any call).
async fn operator<R, T, F, Fut>(client: &Client, request: R, call: F) -> Result<T>
where
    R: Clone,
    F: Fn(OperatorClient<tonic::transport::Channel>, R) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    Ok(client.call_on(|channel| call(OperatorClient::new(channel), request.clone())).await?)
}

/// The rows of one command, shown as a table or as its JSON document.
struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
    json: Value,
}

impl Table {
    fn render(&self, json: bool) -> String {
        shown(json, || self.text(), || self.json.clone())
    }

    fn text(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.len()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.len());
            }
        }
        let mut out = String::new();
        let mut line = |cells: &mut dyn Iterator<Item = &str>| {
            let text: Vec<String> = cells.zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
            let _ = writeln!(out, "{}", text.join("  ").trim_end());
        };
        line(&mut self.header.iter().copied());
        for row in &self.rows {
            line(&mut row.iter().map(String::as_str));
        }
        out
    }
}

fn millis(ms: Option<u64>) -> String {
    ms.map(|ms| format!("{:.1}s", ms as f64 / 1000.0)).unwrap_or_else(|| "-".into())
}

fn status_json(s: &StatusResponse) -> Value {
    let names = session_names(s);
    json!({
        "answered_by": s.node_id,
        "leader": { "id": s.leader_id, "addr": s.leader_addr },
        "term": s.term,
        "last_applied": s.last_applied,
        "linearizable": s.linearizable,
        "partition_count": s.partition_count,
        "lease_ttl_ms": s.lease_ttl_ms,
        "lease_ttl_ceiling_ms": (s.lease_ttl_ceiling_ms > 0).then_some(s.lease_ttl_ceiling_ms),
        "max_revoking": s.max_revoking,
        "unowned": s.unowned,
        "revoking": s.revoking,
        "unconfirmed_moves": s.unconfirmed_moves,
        "maintenance": s.maintenance,
        "nodes": s.nodes.iter().map(|n| json!({ "id": n.id, "addr": n.addr, "peer_addr": n.peer_addr })).collect::<Vec<_>>(),
        "sessions": s.sessions.iter().map(session_json).collect::<Vec<_>>(),
        "partitions": s.partitions.iter().map(|r| row_json(r, &names)).collect::<Vec<_>>(),
    })
}

fn session_names(s: &StatusResponse) -> BTreeMap<u64, String> {
    s.sessions.iter().map(|x| (x.id, x.name.clone())).collect()
}

fn session_json(x: &proto::Session) -> Value {
    json!({
        "id": x.id,
        "name": x.name,
        "weight": x.weight,
        "owned": x.owned,
        "leaving": x.leaving,
        "lease_remaining_ms": x.lease_remaining_ms,
    })
}

fn row_json(r: &proto::PartitionRow, names: &BTreeMap<u64, String>) -> Value {
    let session = |id: u64| (id != 0).then(|| json!({ "id": id, "name": names.get(&id) }));
    json!({
        "partition": r.partition,
        "owner": session(r.owner),
        "token": r.token,
        "revoking": r.revoking,
        "next": session(r.next),
        "lease_remaining_ms": r.lease_remaining_ms,
    })
}

fn sessions(s: &StatusResponse) -> Table {
    Table {
        header: vec!["SESSION", "NAME", "WEIGHT", "OWNED", "LEAVING", "LEASE LEFT"],
        rows: s
            .sessions
            .iter()
            .map(|x| {
                vec![
                    x.id.to_string(),
                    x.name.clone(),
                    x.weight.to_string(),
                    x.owned.to_string(),
                    x.leaving.to_string(),
                    millis(x.lease_remaining_ms),
                ]
            })
            .collect(),
        json: json!({
            "answered_by": s.node_id,
            "linearizable": s.linearizable,
            "sessions": s.sessions.iter().map(session_json).collect::<Vec<_>>(),
        }),
    }
}

fn partition_cells(r: &proto::PartitionRow, names: &BTreeMap<u64, String>) -> Vec<String> {
    let who = |id: u64| match id {
        0 => "-".to_string(),
        id => format!("{} (s{id})", names.get(&id).map(String::as_str).unwrap_or("?")),
    };
    vec![
        r.partition.to_string(),
        who(r.owner),
        r.token.to_string(),
        if r.revoking { format!("to {}", who(r.next)) } else { "no".into() },
        millis(r.lease_remaining_ms),
    ]
}

const PARTITION_HEADER: [&str; 5] = ["PARTITION", "OWNER", "TOKEN", "REVOKING", "LEASE LEFT"];

fn partitions(s: &StatusResponse) -> Table {
    let names = session_names(s);
    let rows = &s.partitions;
    Table {
        header: PARTITION_HEADER.to_vec(),
        rows: rows.iter().map(|r| partition_cells(r, &names)).collect(),
        json: json!({
            "answered_by": s.node_id,
            "linearizable": s.linearizable,
            "partition_count": s.partition_count,
            "partitions": rows.iter().map(|r| row_json(r, &names)).collect::<Vec<_>>(),
            "next_partition": s.next_partition,
        }),
    }
}

fn partition_table(s: &StatusResponse, r: &proto::PartitionRow) -> Table {
    let names = session_names(s);
    let mut json = row_json(r, &names);
    if let Value::Object(fields) = &mut json {
        fields.insert("answered_by".into(), json!(s.node_id));
        fields.insert("linearizable".into(), json!(s.linearizable));
    }
    Table { header: PARTITION_HEADER.to_vec(), rows: vec![partition_cells(r, &names)], json }
}

/// `ctl namespace`: one row per namespace (the one created or deleted, or every one).
async fn namespaces(client: &Client, command: NamespaceCommand) -> Result<Table> {
    let headers =
        ["NAMESPACE", "PARTITIONS", "LEASE TTL", "REVOKE BUDGET", "SESSIONS", "UNOWNED", "REVOKING"];
    let info_row = |n: &proto::NamespaceInfo| {
        vec![
            n.name.clone(),
            n.partition_count.to_string(),
            format!("{} ms", n.lease_ttl_ms),
            n.max_revoking.map_or("-".to_string(), |b| b.to_string()),
            n.sessions.to_string(),
            n.unowned.to_string(),
            n.revoking.to_string(),
        ]
    };
    let info_json = |n: &proto::NamespaceInfo| {
        json!({
            "name": n.name,
            "partition_count": n.partition_count,
            "lease_ttl_ms": n.lease_ttl_ms,
            "max_revoking": n.max_revoking,
            "sessions": n.sessions,
            "unowned": n.unowned,
            "revoking": n.revoking,
            "maintenance": n.maintenance,
        })
    };
    let table = |list: &[proto::NamespaceInfo]| Table {
        header: headers.to_vec(),
        rows: list.iter().map(info_row).collect(),
        json: json!({ "namespaces": list.iter().map(info_json).collect::<Vec<_>>() }),
    };
    match command {
        NamespaceCommand::List => {
            let listed = operator(client, proto::ListNamespacesRequest {}, |mut c, r| async move {
                c.list_namespaces(r).await
            })
            .await?;
            Ok(table(&listed.namespaces))
        }
        NamespaceCommand::Create { name, partitions, lease_ttl_ms, max_revoking } => {
            let request = proto::CreateNamespaceRequest {
                name,
                partition_count: partitions,
                lease_ttl_ms,
                max_revoking,
            };
            let created =
                operator(client, request, |mut c, r| async move { c.create_namespace(r).await }).await?;
            Ok(table(&[created]))
        }
        NamespaceCommand::Delete { name } => {
            let request = proto::DeleteNamespaceRequest { name: name.clone() };
            let deleted =
                operator(client, request, |mut c, r| async move { c.delete_namespace(r).await }).await?;
            Ok(Table {
                header: vec!["DELETED", "PARTITIONS"],
                rows: vec![vec![name.clone(), deleted.partitions.to_string()]],
                json: json!({ "deleted": name, "partitions": deleted.partitions }),
            })
        }
    }
}

async fn member(client: &Client, command: MemberCommand) -> Result<Table> {
    use tenure::proto::{AddMemberRequest, PromoteMemberRequest, RemoveMemberRequest};
    let members = match command {
        MemberCommand::List => {
            let request = proto::ListMembersRequest {};
            operator(client, request, |mut c, r| async move { c.list_members(r).await }).await?
        }
        MemberCommand::Add { member } => {
            let (id, addr, peer_addr) = super::split_member(&member).map_err(anyhow::Error::msg)?;
            let request = AddMemberRequest { id, addr: addr.into(), peer_addr: peer_addr.into() };
            operator(client, request, |mut c, r| async move { c.add_member(r).await }).await?
        }
        MemberCommand::Promote { id } => {
            let request = PromoteMemberRequest { id };
            operator(client, request, |mut c, r| async move { c.promote_member(r).await }).await?
        }
        MemberCommand::Remove { id } => {
            let request = RemoveMemberRequest { id };
            operator(client, request, |mut c, r| async move { c.remove_member(r).await }).await?
        }
    };
    let lag = |m: &proto::MemberStatus| m.matched_index.map(|i| members.last_log_index.saturating_sub(i));
    Ok(Table {
        header: vec!["ID", "ROLE", "LEADER", "ADDR", "PEER ADDR", "MATCHED", "LAG"],
        rows: members
            .members
            .iter()
            .map(|m| {
                vec![
                    m.id.to_string(),
                    if m.voter { "voter" } else { "learner" }.into(),
                    m.leader.to_string(),
                    m.addr.clone(),
                    m.peer_addr.clone(),
                    m.matched_index.map(|i| i.to_string()).unwrap_or_else(|| "-".into()),
                    lag(m).map(|l| l.to_string()).unwrap_or_else(|| "-".into()),
                ]
            })
            .collect(),
        json: json!({
            "answered_by": members.answered_by,
            "leader_id": members.leader_id,
            "term": members.term,
            "last_log_index": members.last_log_index,
            "members": members.members.iter().map(|m| json!({
                "id": m.id,
                "addr": m.addr,
                "peer_addr": m.peer_addr,
                "voter": m.voter,
                "leader": m.leader,
                "matched_index": m.matched_index,
                "lag": lag(m),
            })).collect::<Vec<_>>(),
        }),
    })
}

/// The endpoints an `endpoint` command asks: those given, or (`--cluster`) every member's
/// client address, as the cluster lists them.
async fn endpoints(
    client: &Client,
    given: &[String],
    cluster: bool,
    linearizable: bool,
) -> Result<Vec<String>> {
    if !cluster {
        return Ok(given.to_vec());
    }
    let request = StatusRequest { omit_partitions: true, linearizable, ..Default::default() };
    let status = client.read_status(request, None).await?;
    Ok(status.nodes.iter().map(|n| n.addr.clone()).collect())
}

/// A channel to exactly this endpoint: `endpoint` commands ask each node about itself, never
/// following it to the leader.
fn channel_to(addr: &str, tls: Option<&tenure::worker::ClientTls>) -> Result<tonic::transport::Channel> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))
        .with_context(|| format!("bad endpoint {addr:?}"))?
        .connect_timeout(ENDPOINT_TIMEOUT)
        .timeout(ENDPOINT_TIMEOUT);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.config())?;
    }
    Ok(endpoint.connect_lazy())
}

async fn endpoint_status(endpoints: &[String], tls: Option<&tenure::worker::ClientTls>) -> Table {
    let mut rows = Vec::new();
    let mut docs = Vec::new();
    for addr in endpoints {
        let answer = async {
            let mut c = tenure::proto::coordinator_client::CoordinatorClient::new(channel_to(addr, tls)?);
            let request = StatusRequest { omit_partitions: true, ..Default::default() };
            Ok::<_, anyhow::Error>(c.status(request).await?.into_inner())
        }
        .await;
        match answer {
            Ok(s) => {
                rows.push(vec![
                    addr.clone(),
                    s.node_id.to_string(),
                    s.version.clone(),
                    s.term.to_string(),
                    (s.leader_id == s.node_id).to_string(),
                    s.leader_id.to_string(),
                    s.last_log_index.to_string(),
                    s.last_applied.to_string(),
                    s.stopping.to_string(),
                    String::new(),
                ]);
                docs.push(json!({
                    "endpoint": addr,
                    "id": s.node_id,
                    "version": s.version,
                    "term": s.term,
                    "is_leader": s.leader_id == s.node_id,
                    "leader_id": s.leader_id,
                    "last_log_index": s.last_log_index,
                    "last_applied": s.last_applied,
                    "stopping": s.stopping,
                    "sessions": s.sessions.len(),
                    "partition_count": s.partition_count,
                    "error": null,
                }));
            }
            Err(e) => {
                let e = format!("{e:#}");
                let mut row = vec![addr.clone()];
                row.extend(std::iter::repeat_n("-".to_string(), 8));
                row.push(e.clone());
                rows.push(row);
                docs.push(json!({ "endpoint": addr, "error": e }));
            }
        }
    }
    Table {
        header: vec![
            "ENDPOINT",
            "ID",
            "VERSION",
            "TERM",
            "IS LEADER",
            "LEADER",
            "LOG INDEX",
            "APPLIED",
            "STOPPING",
            "ERROR",
        ],
        rows,
        json: Value::Array(docs),
    }
}

/// Each endpoint's health, and how many are not serving.
async fn endpoint_health(endpoints: &[String], tls: Option<&tenure::worker::ClientTls>) -> (Table, usize) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let (mut rows, mut docs, mut unhealthy) = (Vec::new(), Vec::new(), 0);
    for addr in endpoints {
        let started = Instant::now();
        let answer = async {
            let mut c = HealthClient::new(channel_to(addr, tls)?);
            let reply = c.check(HealthCheckRequest { service: String::new() }).await?.into_inner();
            Ok::<_, anyhow::Error>(reply.status())
        }
        .await;
        let took = started.elapsed();
        let (healthy, error) = match answer {
            Ok(ServingStatus::Serving) => (true, None),
            Ok(other) => (false, Some(other.as_str_name().to_string())),
            Err(e) => (false, Some(format!("{e:#}"))),
        };
        unhealthy += usize::from(!healthy);
        rows.push(vec![
            addr.clone(),
            healthy.to_string(),
            format!("{:.1}ms", took.as_secs_f64() * 1000.0),
            error.clone().unwrap_or_default(),
        ]);
        docs.push(json!({
            "endpoint": addr,
            "health": healthy,
            "took_ms": took.as_secs_f64() * 1000.0,
            "error": error,
        }));
    }
    (Table { header: vec!["ENDPOINT", "HEALTH", "TOOK", "ERROR"], rows, json: Value::Array(docs) }, unhealthy)
}

/// Prints ownership changes as they commit. The leader's route stream starts with every
/// partition's route; those are the baseline, not changes. When the stream ends (a new leader,
/// a node stopping) ctl opens another and prints what differs from the routes it knew, so
/// nothing committed in between is missed, though changes in between are reported once, as
/// their outcome.
async fn watch(client: &Client, namespace: &str, json: bool, max_events: Option<u64>) -> Result<()> {
    let request = proto::RoutesRequest { namespace: namespace.to_string() };
    let mut known: BTreeMap<u32, (u64, u64, bool)> = BTreeMap::new();
    let mut printed = 0u64;
    let mut reconnects = 0u32;
    loop {
        let mut stream = client
            .call(|mut c| {
                let request = request.clone();
                async move { c.routes(request).await }
            })
            .await
            .context("opening the route stream")?;
        let mut baseline: Option<u32> = None;
        let mut seen = 0u32;
        loop {
            let update = match stream.message().await {
                Ok(Some(update)) => update,
                Ok(None) | Err(_) => break,
            };
            let initial = baseline.get_or_insert(update.partition_count);
            let route = (update.session_id, update.token, update.revoking);
            let changed = known.insert(update.partition, route) != Some(route);
            if seen < *initial {
                seen += 1;
                if seen == *initial {
                    eprintln!("watching {} partitions", update.partition_count);
                }
                // The first stream sets the baseline; a later one reports what moved meanwhile.
                if reconnects == 0 || !changed {
                    continue;
                }
            } else if !changed {
                continue;
            }
            if json {
                println!(
                    "{}",
                    json!({
                        "partition": update.partition,
                        "owner": (update.session_id != 0).then(|| json!({ "id": update.session_id, "name": update.worker })),
                        "token": update.token,
                        "revoking": update.revoking,
                    })
                );
            } else {
                let owner = match update.session_id {
                    0 => "-".to_string(),
                    id => format!("{} (s{id})", update.worker),
                };
                println!(
                    "p{} owner {owner} token {}{}",
                    update.partition,
                    update.token,
                    if update.revoking { " revoking" } else { "" }
                );
            }
            printed += 1;
            if max_events.is_some_and(|max| printed >= max) {
                return Ok(());
            }
        }
        reconnects += 1;
        if reconnects > 1000 {
            bail!("the route stream ended {reconnects} times; giving up");
        }
    }
}
