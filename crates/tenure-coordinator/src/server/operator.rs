//! The operator's service: the coordinator cluster's own membership, so that a node whose disk
//! died or whose address changed can be replaced without stopping the cluster.
//!
//! A node is added as a learner (it receives the log, or a snapshot, and votes in nothing),
//! promoted to a voter only once it holds nearly all of the log, and removed by a membership
//! change that openraft commits through joint consensus. Node ids are never reused: a
//! replacement gets a new id, so a node restarted empty can never answer for votes it forgot.
//!
//! Every call needs an operator's certificate (or an insecure cluster); changes need the
//! leader, and a refused change changes nothing.

use super::coordinator::{namespace_of, table_of};
use super::{CoordinatorError, Node};
use crate::ids::{NodeId, PartitionId, SessionId};
use crate::ownership::{Command, Namespace, Proposal, Rejection, Response as SmResponse, SecretHash};
use crate::proto;
use crate::proto::operator_server::Operator;
use crate::raft::Member;
use crate::tls::{Caller, Principal};
use openraft::error::{ClientWriteError, RaftError};
use openraft::ChangeMembers;
use std::collections::BTreeSet;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// How far behind the leader's log a learner may be and still be promoted: a voter that lags
/// further would slow every commit that needs it while it catches up.
pub const MAX_PROMOTION_LAG: u64 = 64;

pub struct OperatorService {
    pub(crate) node: Arc<Node>,
}

impl OperatorService {
    /// The namespace a request names (empty: the default one), which must exist: a change to
    /// one that does not is refused here rather than as a log entry.
    fn existing(&self, name: &str) -> Result<Namespace, CoordinatorError> {
        let namespace = namespace_of(name)?;
        table_of(&self.node.state.read().expect("state lock poisoned"), &namespace)?;
        Ok(namespace)
    }
}

/// What `ListNamespaces` and `CreateNamespace` say of one namespace.
fn namespace_info(namespace: &Namespace, table: &crate::ownership::OwnershipState) -> proto::NamespaceInfo {
    let config = table.config();
    proto::NamespaceInfo {
        name: namespace.to_string(),
        partition_count: config.map_or(0, |c| c.partition_count),
        lease_ttl_ms: config.map_or(0, |c| c.lease_ttl_ms),
        max_revoking: config.and_then(|c| c.max_revoking),
        sessions: table.sessions().values().filter(|r| !r.leaving).count() as u32,
        unowned: table.unowned_count() as u32,
        revoking: table.revoking_count() as u32,
        maintenance: table.maintenance(),
    }
}

/// A response of another kind than the command proposed can give: a bug, reported as one.
fn unexpected(response: SmResponse) -> Status {
    Status::internal(format!("unexpected response from the state machine: {response:?}"))
}

/// Only operators may call (workers have their own service); an insecure cluster checks nobody.
fn operators_only<T>(req: &Request<T>) -> Result<(), CoordinatorError> {
    match Caller::of(req).0 {
        None | Some(Principal::Operator(_)) => Ok(()),
        Some(other) => Err(CoordinatorError::NotAllowed(format!(
            "{other} may not call the operator service: only operators may"
        ))),
    }
}

/// `host:port` with a non-empty host and a numeric port: what a peer can dial (an IP literal
/// or a host name).
fn check_addr(what: &str, addr: &str) -> Result<(), CoordinatorError> {
    if crate::raft::dialable(addr) {
        Ok(())
    } else {
        Err(CoordinatorError::InvalidArgument(format!("{what} {addr:?} is not host:port")))
    }
}

/// A membership change refused or failed: the leader's address if this node is not it.
fn change_failed(e: RaftError<NodeId, ClientWriteError<NodeId, Member>>) -> CoordinatorError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => CoordinatorError::NotLeader {
            leader_id: f.leader_id,
            leader_addr: f.leader_node.map(|n| n.client_addr),
        },
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
            CoordinatorError::MembershipRefused(e.to_string())
        }
        other => CoordinatorError::Unavailable(other.to_string()),
    }
}

impl OperatorService {
    /// The membership as this node knows it, with how far each member has replicated when
    /// this node leads.
    fn members(&self) -> proto::MembersResponse {
        let m = self.node.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let matched = |id: &NodeId| {
            if *id == self.node.config.id {
                return m.last_log_index;
            }
            m.replication.as_ref().and_then(|r| r.get(id).cloned().flatten()).map(|l| l.index)
        };
        let members = membership
            .nodes()
            .map(|(id, node)| proto::MemberStatus {
                id: *id,
                addr: node.client_addr.clone(),
                peer_addr: node.peer_addr.clone(),
                voter: voters.contains(id),
                leader: m.current_leader == Some(*id),
                matched_index: if m.replication.is_some() { matched(id) } else { None },
            })
            .collect();
        proto::MembersResponse {
            members,
            leader_id: m.current_leader.unwrap_or(0),
            term: m.current_term,
            last_log_index: m.last_log_index.unwrap_or(0),
            answered_by: self.node.config.id,
        }
    }
}

#[tonic::async_trait]
impl Operator for OperatorService {
    async fn list_members(
        &self,
        req: Request<proto::ListMembersRequest>,
    ) -> Result<Response<proto::MembersResponse>, Status> {
        operators_only(&req)?;
        Ok(Response::new(self.members()))
    }

    async fn add_member(
        &self,
        req: Request<proto::AddMemberRequest>,
    ) -> Result<Response<proto::MembersResponse>, Status> {
        operators_only(&req)?;
        let req = req.into_inner();
        if req.id == 0 {
            return Err(CoordinatorError::InvalidArgument("node ids start at 1".into()).into());
        }
        check_addr("client address", &req.addr)?;
        check_addr("peer address", &req.peer_addr)?;
        self.node.ensure_leader()?;
        let member = Member { peer_addr: req.peer_addr, client_addr: req.addr };
        let known =
            self.node.raft.metrics().borrow().membership_config.membership().get_node(&req.id).cloned();
        match known {
            // Asked again (an operator's retry): nothing to do.
            Some(have) if have == member => return Ok(Response::new(self.members())),
            Some(have) => {
                return Err(CoordinatorError::InvalidArgument(format!(
                    "node {} is already a member at {have}; ids are never reused, give the new node another",
                    req.id
                ))
                .into())
            }
            None => {}
        }
        tracing::info!(node = req.id, %member, "adding a learner");
        self.node.raft.add_learner(req.id, member, false).await.map_err(change_failed)?;
        Ok(Response::new(self.members()))
    }

    async fn promote_member(
        &self,
        req: Request<proto::PromoteMemberRequest>,
    ) -> Result<Response<proto::MembersResponse>, Status> {
        operators_only(&req)?;
        let id = req.into_inner().id;
        self.node.ensure_leader()?;
        let m = self.node.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        if membership.get_node(&id).is_none() {
            return Err(CoordinatorError::UnknownMember(id).into());
        }
        if membership.voter_ids().any(|v| v == id) {
            return Ok(Response::new(self.members()));
        }
        let matched = m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index);
        let last = m.last_log_index.unwrap_or(0);
        let behind = matched.map_or(last, |i| last.saturating_sub(i));
        if matched.is_none() || behind > MAX_PROMOTION_LAG {
            return Err(CoordinatorError::NotCaughtUp { id, behind }.into());
        }
        tracing::info!(node = id, "promoting a learner to voter");
        let change = ChangeMembers::AddVoterIds(BTreeSet::from([id]));
        self.node.raft.change_membership(change, false).await.map_err(change_failed)?;
        Ok(Response::new(self.members()))
    }

    async fn drain(
        &self,
        req: Request<proto::DrainRequest>,
    ) -> Result<Response<proto::DrainResponse>, Status> {
        operators_only(&req)?;
        let proto::DrainRequest { name, namespace } = req.into_inner();
        let namespace = namespace_of(&namespace)?;
        self.node.ensure_leader()?;
        // The very command the worker's own leave proposes, under the secret hash the table
        // keeps: an operator's drain takes the same path through apply as a leave.
        let live: Vec<(SessionId, SecretHash)> = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let state = table_of(&applied, &namespace)?;
            state.live_sessions_named(&name).filter_map(|s| Some((s, state.session(s)?.secret))).collect()
        };
        if live.is_empty() {
            return Err(CoordinatorError::Rejected(Rejection::UnknownWorker(name)).into());
        }
        for (session, secret) in &live {
            tracing::info!(%namespace, worker = %name, %session, "draining at an operator's request");
            let leave = Command::Leave { session: *session, secret: *secret };
            self.node.propose_entry(Proposal::to(&namespace, leave)).await?;
        }
        Ok(Response::new(proto::DrainResponse { sessions: live.iter().map(|(id, _)| id.0).collect() }))
    }

    async fn set_maintenance(
        &self,
        req: Request<proto::SetMaintenanceRequest>,
    ) -> Result<Response<proto::SetMaintenanceResponse>, Status> {
        operators_only(&req)?;
        let proto::SetMaintenanceRequest { on, namespace } = req.into_inner();
        let namespace = self.existing(&namespace)?;
        self.node.ensure_leader()?;
        tracing::info!(%namespace, on, "maintenance mode set at an operator's request");
        match self.node.propose_entry(Proposal::to(&namespace, Command::SetMaintenance { on })).await? {
            SmResponse::MaintenanceSet { was } => Ok(Response::new(proto::SetMaintenanceResponse { was })),
            other => Err(unexpected(other)),
        }
    }

    async fn set_lease_ttl(
        &self,
        req: Request<proto::SetLeaseTtlRequest>,
    ) -> Result<Response<proto::SetLeaseTtlResponse>, Status> {
        operators_only(&req)?;
        let proto::SetLeaseTtlRequest { lease_ttl_ms, namespace } = req.into_inner();
        let namespace = self.existing(&namespace)?;
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        crate::ownership::check_lease_ttl(lease_ttl_ms).map_err(CoordinatorError::from)?;
        tracing::info!(%namespace, lease_ttl_ms, "lease TTL set at an operator's request");
        match self.node.propose_entry(Proposal::to(&namespace, Command::SetLeaseTtl { lease_ttl_ms })).await?
        {
            SmResponse::LeaseTtlSet { was_ms } => Ok(Response::new(proto::SetLeaseTtlResponse { was_ms })),
            other => Err(unexpected(other)),
        }
    }

    async fn set_revoke_budget(
        &self,
        req: Request<proto::SetRevokeBudgetRequest>,
    ) -> Result<Response<proto::SetRevokeBudgetResponse>, Status> {
        operators_only(&req)?;
        let proto::SetRevokeBudgetRequest { max_revoking, namespace } = req.into_inner();
        let namespace = self.existing(&namespace)?;
        self.node.ensure_leader()?;
        crate::ownership::check_revoke_budget(max_revoking).map_err(CoordinatorError::from)?;
        tracing::info!(%namespace, ?max_revoking, "revoke budget set at an operator's request");
        let budget = Command::SetRevokeBudget { max_revoking };
        match self.node.propose_entry(Proposal::to(&namespace, budget)).await? {
            SmResponse::RevokeBudgetSet { was } => Ok(Response::new(proto::SetRevokeBudgetResponse { was })),
            other => Err(unexpected(other)),
        }
    }

    async fn set_weight(
        &self,
        req: Request<proto::SetWeightRequest>,
    ) -> Result<Response<proto::SetWeightResponse>, Status> {
        operators_only(&req)?;
        let proto::SetWeightRequest { name, weight, namespace } = req.into_inner();
        let namespace = namespace_of(&namespace)?;
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        table_of(&self.node.state.read().expect("state lock poisoned"), &namespace)?
            .check_set_weight(&name, weight)
            .map_err(CoordinatorError::from)?;
        tracing::info!(%namespace, worker = %name, weight, "weight set at an operator's request");
        match self.node.propose_entry(Proposal::to(&namespace, Command::SetWeight { name, weight })).await? {
            SmResponse::WeightSet { sessions } => Ok(Response::new(proto::SetWeightResponse {
                sessions: sessions.iter().map(|s| s.0).collect(),
            })),
            other => Err(unexpected(other)),
        }
    }

    async fn r#move(
        &self,
        req: Request<proto::MoveRequest>,
    ) -> Result<Response<proto::MoveResponse>, Status> {
        operators_only(&req)?;
        let proto::MoveRequest { partition, to, namespace } = req.into_inner();
        let (partition, name) = (PartitionId(partition), (!to.is_empty()).then_some(to));
        let namespace = namespace_of(&namespace)?;
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        table_of(&self.node.state.read().expect("state lock poisoned"), &namespace)?
            .check_pin(partition, name.as_deref())
            .map_err(CoordinatorError::from)?;
        tracing::info!(%namespace, partition = partition.0, to = ?name, "partition pinned at an operator's request");
        match self.node.propose_entry(Proposal::to(&namespace, Command::Pin { partition, name })).await? {
            SmResponse::Pinned { was } => {
                Ok(Response::new(proto::MoveResponse { was: was.unwrap_or_default() }))
            }
            other => Err(unexpected(other)),
        }
    }

    async fn remove_member(
        &self,
        req: Request<proto::RemoveMemberRequest>,
    ) -> Result<Response<proto::MembersResponse>, Status> {
        operators_only(&req)?;
        let id = req.into_inner().id;
        self.node.ensure_leader()?;
        let membership = self.node.raft.metrics().borrow().membership_config.membership().clone();
        if membership.get_node(&id).is_none() {
            return Err(CoordinatorError::UnknownMember(id).into());
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let change = if voters.contains(&id) {
            if voters.len() == 1 {
                let why = format!("node {id} is the only voter; add another before removing it");
                return Err(CoordinatorError::MembershipRefused(why).into());
            }
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        tracing::info!(node = id, "removing a member");
        self.node.raft.change_membership(change, false).await.map_err(change_failed)?;
        Ok(Response::new(self.members()))
    }

    async fn create_namespace(
        &self,
        req: Request<proto::CreateNamespaceRequest>,
    ) -> Result<Response<proto::NamespaceInfo>, Status> {
        operators_only(&req)?;
        let proto::CreateNamespaceRequest { name, partition_count, lease_ttl_ms, max_revoking } =
            req.into_inner();
        // An empty name is not the default namespace here: a creation names what it creates.
        let namespace = Namespace::new(&name).map_err(CoordinatorError::from)?;
        self.node.ensure_leader()?;
        // Refused before the log by the very checks apply makes.
        crate::keyspace::KeySpace::new(partition_count)
            .map_err(|e| CoordinatorError::from(Rejection::InvalidConfig(e.to_string())))?;
        crate::ownership::check_lease_ttl(lease_ttl_ms).map_err(CoordinatorError::from)?;
        crate::ownership::check_revoke_budget(max_revoking).map_err(CoordinatorError::from)?;
        {
            let applied = self.node.state.read().expect("state lock poisoned");
            if applied.table(&namespace).is_none() {
                applied.namespaces.check_room_for(partition_count).map_err(CoordinatorError::from)?;
            }
        }
        tracing::info!(%namespace, partition_count, lease_ttl_ms, ?max_revoking, "creating a namespace at an operator's request");
        let configure = Command::Configure { partition_count, lease_ttl_ms, max_revoking };
        match self.node.propose_entry(Proposal::to(&namespace, configure)).await? {
            SmResponse::Configured => {
                let applied = self.node.state.read().expect("state lock poisoned");
                let table = table_of(&applied, &namespace)?;
                Ok(Response::new(namespace_info(&namespace, table)))
            }
            other => Err(unexpected(other)),
        }
    }

    async fn list_namespaces(
        &self,
        req: Request<proto::ListNamespacesRequest>,
    ) -> Result<Response<proto::ListNamespacesResponse>, Status> {
        operators_only(&req)?;
        let applied = self.node.state.read().expect("state lock poisoned");
        let namespaces = applied.namespaces.iter().map(|(ns, table)| namespace_info(ns, table)).collect();
        Ok(Response::new(proto::ListNamespacesResponse { namespaces, answered_by: self.node.config.id }))
    }

    async fn delete_namespace(
        &self,
        req: Request<proto::DeleteNamespaceRequest>,
    ) -> Result<Response<proto::DeleteNamespaceResponse>, Status> {
        operators_only(&req)?;
        let namespace = Namespace::new(&req.into_inner().name).map_err(CoordinatorError::from)?;
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        self.node
            .state
            .read()
            .expect("state lock poisoned")
            .namespaces
            .check_delete(&namespace)
            .map_err(CoordinatorError::from)?;
        tracing::info!(%namespace, "deleting a namespace at an operator's request");
        match self.node.propose_entry(Proposal::DeleteNamespace { namespace }).await? {
            SmResponse::NamespaceDeleted { partitions } => {
                Ok(Response::new(proto::DeleteNamespaceResponse { partitions }))
            }
            other => Err(unexpected(other)),
        }
    }
}
