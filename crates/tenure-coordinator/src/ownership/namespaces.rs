//! Many jobs on one cluster: every namespace is its own ownership table, with its own partition
//! count, lease TTL, members, weights and revoke budget, all kept by the one replicated log.
//!
//! A log entry is a [`Proposal`]: a command to one namespace's table, or the deletion of a
//! namespace. Applying it touches that namespace's table alone, so what holds for one table
//! ([`OwnershipState`]'s invariants) holds for each, independently: a partition of a namespace
//! has at most one owner, and its token (the granting entry's log index) only grows. The log
//! index is shared by every namespace, which keeps tokens unique across namespaces too, and a
//! namespace deleted and created again grants under tokens above any it granted before.
//!
//! # Lifecycle
//! - The `default` namespace always exists (unconfigured until its first `Configure`), so a
//!   cluster started with the single-job flags is simply that namespace.
//! - A `Configure` to a namespace that does not exist creates it; any other command to one is
//!   refused as [`Rejection::UnknownNamespace`].
//! - A namespace is deleted only while it has no session. An ended session was either released
//!   or expired by a leader that waited out its lease, so no worker can still believe it owns a
//!   partition of a deleted namespace, and one created again under the same name starts with no
//!   believer to contend with.

use super::command::{Command, Event, Rejection, Response};
use super::state::{Changes, OwnershipState};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// The namespace every cluster has, and the one the single-job flags configure.
pub const DEFAULT_NAMESPACE: &str = "default";
/// Longest namespace name, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 63;
/// Most namespaces one cluster holds (the default one included).
pub const MAX_NAMESPACES: usize = 256;
/// Most partitions all of a cluster's namespaces hold together: what bounds a replica's table.
pub const MAX_TOTAL_PARTITIONS: u64 = 1 << 24;

/// A namespace's name: 1 to [`MAX_NAMESPACE_BYTES`] bytes of lower-case ASCII letters, digits,
/// `-` and `_`, starting with a letter or digit. Checked wherever one is made or read, so a
/// name can always be a storage key prefix and a metric label.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Namespace(String);

impl Namespace {
    pub fn new(name: &str) -> Result<Self, Rejection> {
        let valid_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
        let starts_well = name.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        if name.len() > MAX_NAMESPACE_BYTES || !starts_well || !name.chars().all(valid_char) {
            // A name far too long is not echoed back: a hostile client could send megabytes.
            let shown = match name.len() > MAX_NAMESPACE_BYTES {
                true => format!("a name of {} bytes", name.len()),
                false => format!("{name:?}"),
            };
            return Err(Rejection::InvalidNamespace(format!(
                "{shown}: a namespace is 1 to {MAX_NAMESPACE_BYTES} bytes of a-z, 0-9, '-' and '_', \
                 starting with a letter or digit"
            )));
        }
        Ok(Namespace(name.to_string()))
    }

    /// The `default` namespace.
    pub fn default_namespace() -> Self {
        Namespace(DEFAULT_NAMESPACE.to_string())
    }

    /// The namespace a request names, the default one when it names none (an empty string: what
    /// a client built before namespaces sends).
    pub fn or_default(name: &str) -> Result<Self, Rejection> {
        if name.is_empty() {
            Ok(Self::default_namespace())
        } else {
            Self::new(name)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_default(&self) -> bool {
        self.0 == DEFAULT_NAMESPACE
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Namespace {
    type Error = Rejection;
    fn try_from(name: String) -> Result<Self, Rejection> {
        Namespace::new(&name)
    }
}

impl From<Namespace> for String {
    fn from(ns: Namespace) -> String {
        ns.0
    }
}

/// One log entry's data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Proposal {
    /// A command to one namespace's table (a `Configure` creates the namespace).
    To { namespace: Namespace, command: Command },
    /// Delete a namespace that has no session left.
    DeleteNamespace { namespace: Namespace },
}

impl Proposal {
    /// A command to the default namespace.
    pub fn default_namespace(command: Command) -> Self {
        Proposal::To { namespace: Namespace::default_namespace(), command }
    }

    pub fn to(namespace: &Namespace, command: Command) -> Self {
        Proposal::To { namespace: namespace.clone(), command }
    }

    /// The namespace the entry acts on.
    pub fn namespace(&self) -> &Namespace {
        match self {
            Proposal::To { namespace, .. } | Proposal::DeleteNamespace { namespace } => namespace,
        }
    }
}

/// What changed since the store last drained it: each touched namespace's rows, and the
/// namespaces deleted (whose rows all go).
#[derive(Debug, Default)]
pub struct NamespaceChanges {
    pub tables: Vec<(Namespace, Changes)>,
    pub deleted: BTreeSet<Namespace>,
}

/// Every namespace's table.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(from = "BTreeMap<Namespace, OwnershipState>", into = "BTreeMap<Namespace, OwnershipState>")]
pub struct Namespaces {
    tables: BTreeMap<Namespace, OwnershipState>,
    /// Namespaces whose table may have changed since the store last drained the changes.
    touched: BTreeSet<Namespace>,
    deleted: BTreeSet<Namespace>,
}

/// Two clusters are equal when their tables are (what the store has yet to persist is not state).
impl PartialEq for Namespaces {
    fn eq(&self, other: &Self) -> bool {
        self.tables == other.tables
    }
}
impl Eq for Namespaces {}

impl Default for Namespaces {
    fn default() -> Self {
        Namespaces::from(BTreeMap::new())
    }
}

impl From<BTreeMap<Namespace, OwnershipState>> for Namespaces {
    /// The default namespace is added when missing: it always exists.
    fn from(mut tables: BTreeMap<Namespace, OwnershipState>) -> Self {
        tables.entry(Namespace::default_namespace()).or_default();
        Namespaces { tables, touched: BTreeSet::new(), deleted: BTreeSet::new() }
    }
}

impl From<Namespaces> for BTreeMap<Namespace, OwnershipState> {
    fn from(namespaces: Namespaces) -> Self {
        namespaces.tables
    }
}

impl Namespaces {
    /// A cluster whose default namespace is `table` and that has no other.
    pub fn with_default(table: OwnershipState) -> Self {
        Namespaces::from(BTreeMap::from([(Namespace::default_namespace(), table)]))
    }

    pub fn get(&self, namespace: &Namespace) -> Option<&OwnershipState> {
        self.tables.get(namespace)
    }

    /// The default namespace's table (it always exists).
    pub fn default_table(&self) -> &OwnershipState {
        self.tables.get(&Namespace::default_namespace()).expect("the default namespace always exists")
    }

    /// Every namespace with its table, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&Namespace, &OwnershipState)> {
        self.tables.iter()
    }

    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// Partitions all namespaces hold together.
    pub fn total_partitions(&self) -> u64 {
        self.tables.values().map(|t| t.partitions().len() as u64).sum()
    }

    /// Applies one committed entry at log index `index`. Deterministic, like
    /// [`OwnershipState::apply`]; a rejection changes nothing.
    pub fn apply(&mut self, index: u64, proposal: &Proposal) -> (Response, Vec<Event>) {
        match self.apply_inner(index, proposal) {
            Ok(applied) => applied,
            Err(rejection) => (Response::Rejected(rejection), Vec::new()),
        }
    }

    fn apply_inner(&mut self, index: u64, proposal: &Proposal) -> Result<(Response, Vec<Event>), Rejection> {
        match proposal {
            Proposal::To { namespace, command } => {
                let created = !self.tables.contains_key(namespace);
                if created {
                    let Command::Configure { partition_count, .. } = command else {
                        return Err(Rejection::UnknownNamespace(namespace.to_string()));
                    };
                    self.check_room_for(*partition_count)?;
                }
                let table = self.tables.entry(namespace.clone()).or_default();
                let (response, events) = table.apply(index, command);
                if created && matches!(response, Response::Rejected(_)) {
                    // A refused creation leaves no empty namespace behind.
                    self.tables.remove(namespace);
                } else {
                    // A namespace deleted and created again before the store drained the
                    // changes stays in `deleted` too: the store removes the old rows first, then
                    // writes the new table's.
                    self.touched.insert(namespace.clone());
                }
                Ok((response, events))
            }
            Proposal::DeleteNamespace { namespace } => {
                let table = self.check_delete(namespace)?;
                let partitions = table.partitions().len() as u32;
                self.tables.remove(namespace);
                self.touched.remove(namespace);
                self.deleted.insert(namespace.clone());
                Ok((Response::NamespaceDeleted { partitions }, vec![Event::NamespaceDeleted]))
            }
        }
    }

    /// What creating a namespace of `partition_count` partitions must satisfy, apply and the
    /// server alike: room for one more namespace and for its partitions.
    pub fn check_room_for(&self, partition_count: u32) -> Result<(), Rejection> {
        if self.tables.len() >= MAX_NAMESPACES {
            return Err(Rejection::TooManyNamespaces { max: MAX_NAMESPACES });
        }
        let total = self.total_partitions() + u64::from(partition_count);
        if total > MAX_TOTAL_PARTITIONS {
            return Err(Rejection::InvalidConfig(format!(
                "the cluster's namespaces would hold {total} partitions together, more than {MAX_TOTAL_PARTITIONS}"
            )));
        }
        Ok(())
    }

    /// What deleting `namespace` must satisfy, apply and the server alike: it exists, it is not
    /// the default one, and no session is left in it.
    pub fn check_delete(&self, namespace: &Namespace) -> Result<&OwnershipState, Rejection> {
        if namespace.is_default() {
            return Err(Rejection::DefaultNamespace);
        }
        let table =
            self.tables.get(namespace).ok_or_else(|| Rejection::UnknownNamespace(namespace.to_string()))?;
        if !table.sessions().is_empty() {
            return Err(Rejection::NamespaceInUse {
                namespace: namespace.to_string(),
                sessions: table.sessions().len(),
            });
        }
        Ok(table)
    }

    /// Takes what changed since the last call.
    pub fn take_changes(&mut self) -> NamespaceChanges {
        let touched = std::mem::take(&mut self.touched);
        let tables = touched
            .into_iter()
            .filter_map(|ns| {
                let changes = self.tables.get_mut(&ns)?.take_changes();
                Some((ns, changes))
            })
            .collect();
        NamespaceChanges { tables, deleted: std::mem::take(&mut self.deleted) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ownership::SecretHash;

    fn ns(name: &str) -> Namespace {
        Namespace::new(name).expect("a valid name")
    }

    fn configure(partition_count: u32) -> Command {
        Command::Configure { partition_count, lease_ttl_ms: 1000, max_revoking: None }
    }

    fn join(name: &str) -> Command {
        Command::Join { name: name.into(), weight: 1, secret: SecretHash::of("s") }
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "-x", "Upper", "a b", "a\0b", &"x".repeat(MAX_NAMESPACE_BYTES + 1)] {
            assert!(matches!(Namespace::new(bad), Err(Rejection::InvalidNamespace(_))), "{bad:?}");
        }
        assert_eq!(Namespace::or_default("").unwrap(), Namespace::default_namespace());
        assert!(Namespace::new("billing-v2_eu").is_ok());
        assert!(serde_json::from_str::<Namespace>("\"Bad\"").is_err(), "a stored name is checked too");
    }

    #[test]
    fn a_configure_creates_a_namespace_and_nothing_else_does() {
        let mut all = Namespaces::default();
        let (r, _) = all.apply(1, &Proposal::to(&ns("billing"), join("w")));
        assert_eq!(r, Response::Rejected(Rejection::UnknownNamespace("billing".into())));
        assert!(all.get(&ns("billing")).is_none(), "a refused command creates nothing");
        let (r, events) = all.apply(2, &Proposal::to(&ns("billing"), configure(8)));
        assert_eq!(r, Response::Configured);
        assert_eq!(events.len(), 1);
        let (r, _) = all.apply(3, &Proposal::to(&ns("search"), configure(0)));
        assert!(matches!(r, Response::Rejected(Rejection::InvalidConfig(_))));
        assert!(all.get(&ns("search")).is_none(), "a refused creation leaves no empty namespace");
        assert_eq!(all.len(), 2, "default and billing");
        assert_eq!(all.get(&ns("billing")).unwrap().partitions().len(), 8);
        assert!(all.default_table().config().is_none(), "the default namespace is untouched");
    }

    #[test]
    fn namespaces_keep_their_own_sessions_and_tables() {
        let mut all = Namespaces::default();
        all.apply(1, &Proposal::default_namespace(configure(4)));
        all.apply(2, &Proposal::to(&ns("billing"), configure(16)));
        let (a, _) = all.apply(3, &Proposal::default_namespace(join("w")));
        let (b, _) = all.apply(4, &Proposal::to(&ns("billing"), join("w")));
        assert!(matches!(a, Response::Joined { superseded: None, .. }));
        assert!(
            matches!(b, Response::Joined { superseded: None, .. }),
            "the same name in another namespace supersedes nothing"
        );
        assert_eq!(all.default_table().sessions().len(), 1);
        assert_eq!(all.get(&ns("billing")).unwrap().sessions().len(), 1);
        assert_eq!(all.total_partitions(), 20);
    }

    #[test]
    fn only_an_empty_namespace_other_than_the_default_is_deleted() {
        let mut all = Namespaces::default();
        all.apply(1, &Proposal::to(&ns("billing"), configure(8)));
        all.apply(2, &Proposal::to(&ns("billing"), join("w")));
        let delete = Proposal::DeleteNamespace { namespace: ns("billing") };
        let (r, _) = all.apply(3, &delete);
        assert_eq!(
            r,
            Response::Rejected(Rejection::NamespaceInUse { namespace: "billing".into(), sessions: 1 })
        );
        let (r, _) = all.apply(4, &Proposal::DeleteNamespace { namespace: Namespace::default_namespace() });
        assert_eq!(r, Response::Rejected(Rejection::DefaultNamespace));
        let (r, _) = all.apply(5, &Proposal::DeleteNamespace { namespace: ns("nope") });
        assert_eq!(r, Response::Rejected(Rejection::UnknownNamespace("nope".into())));
        let mut empty = Namespaces::default();
        empty.apply(1, &Proposal::to(&ns("billing"), configure(8)));
        empty.take_changes();
        let (r, events) = empty.apply(2, &delete);
        assert_eq!(r, Response::NamespaceDeleted { partitions: 8 });
        assert_eq!(events, vec![Event::NamespaceDeleted]);
        assert!(empty.get(&ns("billing")).is_none());
        let changes = empty.take_changes();
        assert!(changes.deleted.contains(&ns("billing")) && changes.tables.is_empty());
        // Deleted and created again before the store drains: the old rows must still go.
        empty.apply(3, &Proposal::to(&ns("billing"), configure(8)));
        empty.apply(4, &delete);
        empty.apply(5, &Proposal::to(&ns("billing"), configure(4)));
        let changes = empty.take_changes();
        assert!(changes.deleted.contains(&ns("billing")), "the older table's rows are deleted");
        assert_eq!(changes.tables.len(), 1, "and the new table's written after");
    }

    #[test]
    fn the_cluster_bounds_how_many_namespaces_it_holds() {
        let mut many = Namespaces::default();
        for i in 1..MAX_NAMESPACES {
            many.apply(i as u64, &Proposal::to(&ns(&format!("n{i}")), configure(1)));
        }
        let (r, _) = many.apply(1000, &Proposal::to(&ns("one-more"), configure(1)));
        assert_eq!(r, Response::Rejected(Rejection::TooManyNamespaces { max: MAX_NAMESPACES }));
    }

    #[test]
    fn a_snapshot_of_every_namespace_reads_back_equal() {
        let mut all = Namespaces::default();
        all.apply(1, &Proposal::default_namespace(configure(4)));
        all.apply(2, &Proposal::to(&ns("billing"), configure(16)));
        all.apply(3, &Proposal::to(&ns("billing"), join("w")));
        // As the store does before it builds a snapshot: what is yet to be persisted is no part
        // of a table's equality or of its snapshot.
        all.take_changes();
        let back: Namespaces = crate::codec::decode(&crate::codec::encode(&all)).expect("reads back");
        assert_eq!(back, all);
    }
}
