//! One term of this node's leadership: a lease table per namespace, all judged on this node's
//! clock from the moment the term began.
//!
//! Invariants kept here:
//! - Renewals and expiries act on a term's tables only while the node still leads in that term
//!   (the callers compare [`Leadership::term`]): a table left over from an earlier term knows
//!   nothing of the renewals another leader acknowledged in between.
//! - A namespace's table starts the way a new term's table does ([`LeaseTable::for_new_term`]:
//!   every lease a TTL, or an unsettled change's ceiling, from when the table is made), whether
//!   it is made when the term begins or later, when the namespace first shows up in the applied
//!   state. Making it late can only push deadlines later.
//! - Every table of a term, however late it is made, expires nothing before the node has applied
//!   the log as far as it reached when the term began ([`LeaseTable::hold_until_applied`]).
//! - A namespace deleted from the state loses its table; one created again under the same name
//!   gets a new one, with nothing of the old.

use crate::lease::LeaseTable;
use crate::ownership::{Namespace, OwnershipState};
use crate::store::Applied;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

pub(crate) struct Leadership {
    pub term: u64,
    /// The last log index when the term began: no table expires anything before it is applied.
    held_until: u64,
    /// The TTL a table starts from before its namespace's configuration is applied (this
    /// node's own setting, which it proposes for the default namespace).
    proposed_ttl: Duration,
    /// The last index this node applied, as the duty loop last said.
    applied: u64,
    tables: BTreeMap<Namespace, LeaseTable>,
}

impl Leadership {
    /// A new term at `now`, with a table for every namespace `state` holds.
    pub fn new(term: u64, now: Instant, state: &Applied, proposed_ttl: Duration, held_until: u64) -> Self {
        let mut leadership = Leadership {
            term,
            held_until,
            proposed_ttl,
            applied: state.last_applied.map_or(0, |l| l.index),
            tables: BTreeMap::new(),
        };
        leadership.reset(now, state);
        leadership
    }

    fn start_table(&self, now: Instant, table: &OwnershipState) -> LeaseTable {
        let mut leases = LeaseTable::for_new_term(now, table, self.proposed_ttl);
        leases.hold_until_applied(self.held_until);
        leases.applied(self.applied);
        leases
    }

    /// The lease table of `namespace`, whose applied table is `table`: made now if the
    /// namespace is new to this term, and following the TTL its configuration holds.
    pub fn table_mut(
        &mut self,
        now: Instant,
        namespace: &Namespace,
        table: &OwnershipState,
    ) -> &mut LeaseTable {
        if !self.tables.contains_key(namespace) {
            let leases = self.start_table(now, table);
            self.tables.insert(namespace.clone(), leases);
        }
        let leases = self.tables.get_mut(namespace).expect("inserted above");
        if leases.follow(table.config()) {
            tracing::info!(
                namespace = %namespace,
                ttl_ms = leases.ttl().as_millis() as u64,
                "renewals follow the namespace's lease TTL"
            );
        }
        leases
    }

    /// The lease table of `namespace`, if this term has made one.
    pub fn table(&self, namespace: &Namespace) -> Option<&LeaseTable> {
        self.tables.get(namespace)
    }

    /// Every table this term has made.
    pub fn tables_mut(&mut self) -> impl Iterator<Item = (&Namespace, &mut LeaseTable)> {
        self.tables.iter_mut()
    }

    /// Forgets a deleted namespace's leases.
    pub fn forget(&mut self, namespace: &Namespace) {
        self.tables.remove(namespace);
    }

    /// Starts every table over from `now` (after missing applied events): one table per
    /// namespace in `state`, none for a namespace it no longer holds. Can only delay expiries.
    pub fn reset(&mut self, now: Instant, state: &Applied) {
        self.tables.clear();
        for (namespace, table) in state.namespaces.iter() {
            let leases = self.start_table(now, table);
            self.tables.insert(namespace.clone(), leases);
        }
    }

    /// The node has applied the log up to `index`.
    pub fn applied(&mut self, index: u64) {
        self.applied = self.applied.max(index);
        for table in self.tables.values_mut() {
            table.applied(index);
        }
    }
}

#[cfg(test)]
mod tests {
    //! A term's tables, made when the term begins or later, never expire anything early.

    use super::*;
    use crate::ids::SessionId;
    use crate::ownership::{Command, Proposal, Response, SecretHash};

    fn ns(name: &str) -> Namespace {
        Namespace::new(name).expect("a valid name")
    }

    fn configure(state: &mut Applied, index: u64, namespace: &Namespace, lease_ttl_ms: u64) {
        let command = Command::Configure { partition_count: 4, lease_ttl_ms, max_revoking: None };
        let (response, _) = state.namespaces.apply(index, &Proposal::to(namespace, command));
        assert_eq!(response, Response::Configured);
    }

    fn join(state: &mut Applied, index: u64, namespace: &Namespace) -> SessionId {
        let command = Command::Join { name: "w".into(), weight: 1, secret: SecretHash::of("secret") };
        match state.namespaces.apply(index, &Proposal::to(namespace, command)).0 {
            Response::Joined { session, .. } => session,
            other => panic!("join refused: {other:?}"),
        }
    }

    #[test]
    fn a_table_made_late_runs_its_ttl_from_then_and_waits_for_the_terms_log() {
        let (default, billing) = (Namespace::default_namespace(), ns("billing"));
        let mut state = Applied::default();
        configure(&mut state, 1, &default, 1000);
        let start = Instant::now();
        // The term began with its log at index 10.
        let mut leadership = Leadership::new(7, start, &state, Duration::from_millis(1000), 10);
        // A namespace and a session the term's table never saw, applied five seconds later.
        configure(&mut state, 2, &billing, 2000);
        let session = join(&mut state, 3, &billing);
        let made = start + Duration::from_secs(5);
        let table = leadership.table_mut(made, &billing, state.table(&billing).expect("created"));
        assert_eq!(table.ttl(), Duration::from_millis(2000), "the namespace's TTL, not the node's");
        assert!(table.due(made + Duration::from_secs(60)).is_empty(), "held until index 10 is applied");
        leadership.applied(10);
        let table = leadership.table_mut(made, &billing, state.table(&billing).expect("created"));
        assert!(
            table.due(made + Duration::from_millis(1999)).is_empty(),
            "a whole TTL from when it was made"
        );
        assert_eq!(table.due(made + Duration::from_millis(2001)).sessions, vec![session]);
    }

    #[test]
    fn a_deleted_namespace_loses_its_table_and_a_reset_makes_none_for_it() {
        let (default, scratch) = (Namespace::default_namespace(), ns("scratch"));
        let mut state = Applied::default();
        configure(&mut state, 1, &default, 1000);
        configure(&mut state, 2, &scratch, 1000);
        let now = Instant::now();
        let mut leadership = Leadership::new(3, now, &state, Duration::from_millis(1000), 0);
        assert!(leadership.table(&scratch).is_some(), "a table for every namespace at the start");
        let (response, _) =
            state.namespaces.apply(4, &Proposal::DeleteNamespace { namespace: scratch.clone() });
        assert_eq!(response, Response::NamespaceDeleted { partitions: 4 });
        leadership.forget(&scratch);
        assert!(leadership.table(&scratch).is_none());
        leadership.reset(now, &state);
        assert!(leadership.table(&scratch).is_none(), "a reset makes tables for what the state holds");
        assert!(leadership.table(&default).is_some());
    }
}
