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

use super::{CoordinatorError, Node};
use crate::ids::{NodeId, PartitionId, SessionId};
use crate::ownership::{Command, Rejection, Response as SmResponse, SecretHash};
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
        let name = req.into_inner().name;
        self.node.ensure_leader()?;
        // The very command the worker's own leave proposes, under the secret hash the table
        // keeps: an operator's drain takes the same path through apply as a leave.
        let live: Vec<(SessionId, SecretHash)> = {
            let applied = self.node.state.read().expect("state lock poisoned");
            let state = applied.default_table();
            state.live_sessions_named(&name).filter_map(|s| Some((s, state.session(s)?.secret))).collect()
        };
        if live.is_empty() {
            return Err(CoordinatorError::Rejected(Rejection::UnknownWorker(name)).into());
        }
        for (session, secret) in &live {
            tracing::info!(worker = %name, %session, "draining at an operator's request");
            self.node.propose(Command::Leave { session: *session, secret: *secret }).await?;
        }
        Ok(Response::new(proto::DrainResponse { sessions: live.iter().map(|(id, _)| id.0).collect() }))
    }

    async fn set_maintenance(
        &self,
        req: Request<proto::SetMaintenanceRequest>,
    ) -> Result<Response<proto::SetMaintenanceResponse>, Status> {
        operators_only(&req)?;
        let on = req.into_inner().on;
        self.node.ensure_leader()?;
        tracing::info!(on, "maintenance mode set at an operator's request");
        match self.node.propose(Command::SetMaintenance { on }).await? {
            SmResponse::MaintenanceSet { was } => Ok(Response::new(proto::SetMaintenanceResponse { was })),
            other => Err(unexpected(other)),
        }
    }

    async fn set_lease_ttl(
        &self,
        req: Request<proto::SetLeaseTtlRequest>,
    ) -> Result<Response<proto::SetLeaseTtlResponse>, Status> {
        operators_only(&req)?;
        let lease_ttl_ms = req.into_inner().lease_ttl_ms;
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        crate::ownership::check_lease_ttl(lease_ttl_ms).map_err(CoordinatorError::from)?;
        tracing::info!(lease_ttl_ms, "lease TTL set at an operator's request");
        match self.node.propose(Command::SetLeaseTtl { lease_ttl_ms }).await? {
            SmResponse::LeaseTtlSet { was_ms } => Ok(Response::new(proto::SetLeaseTtlResponse { was_ms })),
            other => Err(unexpected(other)),
        }
    }

    async fn set_revoke_budget(
        &self,
        req: Request<proto::SetRevokeBudgetRequest>,
    ) -> Result<Response<proto::SetRevokeBudgetResponse>, Status> {
        operators_only(&req)?;
        let max_revoking = req.into_inner().max_revoking;
        self.node.ensure_leader()?;
        crate::ownership::check_revoke_budget(max_revoking).map_err(CoordinatorError::from)?;
        tracing::info!(?max_revoking, "revoke budget set at an operator's request");
        match self.node.propose(Command::SetRevokeBudget { max_revoking }).await? {
            SmResponse::RevokeBudgetSet { was } => Ok(Response::new(proto::SetRevokeBudgetResponse { was })),
            other => Err(unexpected(other)),
        }
    }

    async fn set_weight(
        &self,
        req: Request<proto::SetWeightRequest>,
    ) -> Result<Response<proto::SetWeightResponse>, Status> {
        operators_only(&req)?;
        let proto::SetWeightRequest { name, weight } = req.into_inner();
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        self.node
            .state
            .read()
            .expect("state lock poisoned")
            .default_table()
            .check_set_weight(&name, weight)
            .map_err(CoordinatorError::from)?;
        tracing::info!(worker = %name, weight, "weight set at an operator's request");
        match self.node.propose(Command::SetWeight { name, weight }).await? {
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
        let proto::MoveRequest { partition, to } = req.into_inner();
        let (partition, name) = (PartitionId(partition), (!to.is_empty()).then_some(to));
        self.node.ensure_leader()?;
        // Refused before the log by the very check apply makes.
        self.node
            .state
            .read()
            .expect("state lock poisoned")
            .default_table()
            .check_pin(partition, name.as_deref())
            .map_err(CoordinatorError::from)?;
        tracing::info!(partition = partition.0, to = ?name, "partition pinned at an operator's request");
        match self.node.propose(Command::Pin { partition, name }).await? {
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
}
