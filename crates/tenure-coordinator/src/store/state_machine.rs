//! The ownership state machine on RocksDB (openraft storage-v2 `RaftStateMachine`).
//!
//! The table lives in memory for reads and in the `sm_*` column families for durability. Each
//! apply batch writes the rows it changed plus `last_applied` and the membership in one synced
//! write batch, then publishes the batch's events; the responses go back to openraft only after
//! that write returns.
//!
//! Rows, metadata and snapshots are in [`crate::codec`]'s format (a version byte, then
//! postcard). A node that meets a version it does not know stops (a storage error) instead of
//! guessing. Installing a
//! snapshot replaces the table, `last_applied` and the stored snapshot in one synced batch.

use super::db::{cf, decode, encode, io_error, synced, Db, CF_PARTITIONS, CF_SESSIONS, CF_SM_META};
use super::session_fan_out::{SessionEvents, SessionFanOut};
use crate::codec::FormatError;
use crate::ids::SessionId;
use crate::ownership::{
    Config, Event, Namespace, Namespaces, OwnershipState, PartitionRecord, Response, SessionRecord, Settings,
};
use crate::raft::{Entry, LogId, StorageError, StoredMembership, TypeConfig};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{EntryPayload, ErrorSubject, ErrorVerb, OptionalSend, RaftSnapshotBuilder, SnapshotMeta};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use tokio::sync::broadcast;

const KEY_LAST_APPLIED: &[u8] = b"last_applied";
const KEY_MEMBERSHIP: &[u8] = b"membership";
/// Per namespace, each followed by the namespace's name: its configuration with its session
/// counter, and its operator settings (kept apart: they are written only when they change).
const KEY_TABLE: &[u8] = b"table\0";
const KEY_SETTINGS: &[u8] = b"settings\0";
/// The stored snapshot: its metadata and its data, beside each other.
const KEY_SNAPSHOT_META: &[u8] = b"snapshot_meta";
const KEY_SNAPSHOT_DATA: &[u8] = b"snapshot_data";

/// How many applied batches a slow watcher may fall behind before it must resynchronise.
const EVENT_BUFFER: usize = 4096;

/// The applied state, shared with the server for reads. A std lock, not a Tokio one: nothing
/// awaits while holding it.
#[derive(Debug, Default)]
pub struct Applied {
    pub namespaces: Namespaces,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
}

impl Applied {
    /// The default namespace's table.
    pub fn default_table(&self) -> &OwnershipState {
        self.namespaces.default_table()
    }

    /// A namespace's table, if it exists.
    pub fn table(&self, namespace: &Namespace) -> Option<&OwnershipState> {
        self.namespaces.get(namespace)
    }
}

/// A namespace's configuration and session counter, as stored.
#[derive(Serialize, Deserialize)]
struct TableMeta {
    config: Option<Config>,
    next_session: u64,
}

/// `prefix` (a metadata key's kind, or nothing for a row) then the namespace, then `suffix`:
/// namespace names never hold a zero byte, so one namespace's keys are one contiguous range.
fn key(prefix: &[u8], namespace: &Namespace, suffix: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(prefix.len() + namespace.as_str().len() + 1 + suffix.len());
    key.extend_from_slice(prefix);
    key.extend_from_slice(namespace.as_str().as_bytes());
    key.push(0);
    key.extend_from_slice(suffix);
    key
}

/// The keys of every row of `namespace`: `[start, end)`.
fn rows_of(namespace: &Namespace) -> (Vec<u8>, Vec<u8>) {
    let start = key(b"", namespace, b"");
    let mut end = start.clone();
    *end.last_mut().expect("a key is never empty") = 1;
    (start, end)
}

/// A row key read back: its namespace and the rest.
fn split_row_key(key: &[u8]) -> Option<(Namespace, &[u8])> {
    let zero = key.iter().position(|b| *b == 0)?;
    let namespace = Namespace::new(std::str::from_utf8(&key[..zero]).ok()?).ok()?;
    Some((namespace, &key[zero + 1..]))
}

pub type SharedState = Arc<RwLock<Applied>>;

/// The events of one applied log entry, or the mark of a snapshot installed in place of the
/// entries up to `index` (then `events` is empty: whoever follows the events one by one has
/// missed what the snapshot covers, and must read the state again).
#[derive(Clone, Debug)]
pub struct AppliedEvent {
    pub index: u64,
    /// The namespace the entry acted on (the default one for a snapshot's mark, which stands
    /// for every namespace).
    pub namespace: Namespace,
    pub events: Vec<Event>,
    pub snapshot: bool,
}

#[derive(Serialize, Deserialize)]
struct SnapshotPayload {
    last_applied: Option<LogId>,
    membership: StoredMembership,
    namespaces: Namespaces,
}

fn encode_snapshot(payload: &SnapshotPayload) -> Vec<u8> {
    crate::codec::encode(payload)
}

/// A snapshot's data for a cluster whose default namespace is `state` and that holds no other
/// (no membership, nothing applied), as a node would send it: for measuring what a table costs
/// to snapshot.
pub fn encode_table_snapshot(state: &OwnershipState) -> Vec<u8> {
    let payload = SnapshotPayload {
        last_applied: None,
        membership: StoredMembership::default(),
        namespaces: Namespaces::with_default(state.clone()),
    };
    encode_snapshot(&payload)
}

/// The default namespace's table a snapshot's data carries, read as a node installing it would.
pub fn decode_table_snapshot(data: &[u8]) -> Result<OwnershipState, FormatError> {
    decode_snapshot(data).map(|payload| payload.namespaces.default_table().clone())
}

/// Whether `data` is a snapshot this build can install: checked on receipt, before openraft is
/// handed it, because a snapshot that fails to decode inside the install is a storage error and
/// stops the node.
pub fn check_snapshot(data: &[u8]) -> Result<(), FormatError> {
    decode_snapshot(data).map(|_| ())
}

fn decode_snapshot(data: &[u8]) -> Result<SnapshotPayload, FormatError> {
    crate::codec::decode(data)
}

/// A snapshot's stored form, written into `batch` beside whatever else it carries.
fn put_snapshot(
    db: &Db,
    batch: &mut rocksdb::WriteBatch,
    meta: &SnapshotMeta<u64, crate::raft::Member>,
    data: &[u8],
) {
    let cf_meta = cf(db, CF_SM_META);
    batch.put_cf(cf_meta, KEY_SNAPSHOT_META, encode(meta));
    batch.put_cf(cf_meta, KEY_SNAPSHOT_DATA, data);
}

/// The state-machine half of a node's store.
#[derive(Clone)]
pub struct StateMachineStore {
    db: Db,
    shared: SharedState,
    events: broadcast::Sender<Arc<AppliedEvent>>,
    /// The same entries, each to the ownership streams of the sessions it names.
    sessions: SessionFanOut,
    snapshot_seq: Arc<AtomicU64>,
}

fn read_err(e: impl std::error::Error + 'static) -> StorageError {
    io_error(ErrorSubject::StateMachine, ErrorVerb::Read, e)
}
fn write_err(e: impl std::error::Error + 'static) -> StorageError {
    io_error(ErrorSubject::StateMachine, ErrorVerb::Write, e)
}

impl StateMachineStore {
    /// Loads the persisted state machine (empty on a new database).
    pub fn open(db: Db) -> Result<Self, StorageError> {
        let applied = load(&db)?;
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        Ok(StateMachineStore {
            db,
            shared: Arc::new(RwLock::new(applied)),
            events,
            sessions: SessionFanOut::default(),
            snapshot_seq: Arc::new(AtomicU64::new(0)),
        })
    }

    pub fn shared(&self) -> SharedState {
        self.shared.clone()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<AppliedEvent>> {
        self.events.subscribe()
    }

    /// Subscribes to the entries that name `session` of `namespace` (see [`SessionFanOut`]).
    pub fn subscribe_session(&self, namespace: &Namespace, session: SessionId) -> SessionEvents {
        self.sessions.subscribe(namespace, session)
    }

    /// Subscribes, then reads how far the state machine had applied: every entry after that
    /// index reaches the receiver; the ones up to it may have been published before.
    pub fn subscribe_after(&self) -> (broadcast::Receiver<Arc<AppliedEvent>>, u64) {
        let events = self.events.subscribe();
        let applied = self.shared.read().expect("state lock poisoned").last_applied.map_or(0, |l| l.index);
        (events, applied)
    }

    /// Writes what changed (everything when `full`) in one synced batch, together with
    /// `snapshot` when one is being installed.
    fn persist(
        &self,
        applied: &mut Applied,
        full: bool,
        snapshot: Option<(&SnapshotMeta<u64, crate::raft::Member>, &[u8])>,
    ) -> Result<(), StorageError> {
        let changes = applied.namespaces.take_changes();
        let mut batch = rocksdb::WriteBatch::default();
        if let Some((meta, data)) = snapshot {
            put_snapshot(&self.db, &mut batch, meta, data);
        }
        let (parts, sess, meta) =
            (cf(&self.db, CF_PARTITIONS), cf(&self.db, CF_SESSIONS), cf(&self.db, CF_SM_META));
        if full {
            // Namespace names are ASCII, so every row key sorts below 0xff.
            for family in [parts, sess] {
                batch.delete_range_cf(family, b"".as_slice(), [0xffu8].as_slice());
            }
            for kind in [KEY_TABLE, KEY_SETTINGS] {
                let mut end = kind.to_vec();
                *end.last_mut().expect("a key kind is never empty") = 1;
                batch.delete_range_cf(meta, kind, end.as_slice());
            }
            for (namespace, state) in applied.namespaces.iter() {
                for (p, record) in state.partitions().iter().enumerate() {
                    if *record != PartitionRecord::default() {
                        batch.put_cf(parts, key(b"", namespace, &(p as u32).to_be_bytes()), encode(record));
                    }
                }
                for (s, record) in state.sessions() {
                    batch.put_cf(sess, key(b"", namespace, &s.0.to_be_bytes()), encode(record));
                }
                put_table_meta(&mut batch, meta, namespace, state, true);
            }
        } else {
            for namespace in &changes.deleted {
                let (start, end) = rows_of(namespace);
                batch.delete_range_cf(parts, start.as_slice(), end.as_slice());
                batch.delete_range_cf(sess, start.as_slice(), end.as_slice());
                batch.delete_cf(meta, key(KEY_TABLE, namespace, b""));
                batch.delete_cf(meta, key(KEY_SETTINGS, namespace, b""));
            }
            for (namespace, changed) in &changes.tables {
                let Some(state) = applied.namespaces.get(namespace) else { continue };
                for p in &changed.partitions {
                    let row = key(b"", namespace, &p.to_be_bytes());
                    match state.partitions().get(*p as usize) {
                        Some(record) if *record != PartitionRecord::default() => {
                            batch.put_cf(parts, row, encode(record))
                        }
                        _ => batch.delete_cf(parts, row),
                    }
                }
                for s in &changed.sessions {
                    let row = key(b"", namespace, &s.0.to_be_bytes());
                    match state.session(*s) {
                        Some(record) => batch.put_cf(sess, row, encode(record)),
                        None => batch.delete_cf(sess, row),
                    }
                }
                put_table_meta(&mut batch, meta, namespace, state, changed.meta);
            }
        }
        batch.put_cf(meta, KEY_LAST_APPLIED, encode(&applied.last_applied));
        batch.put_cf(meta, KEY_MEMBERSHIP, encode(&applied.membership));
        self.db.write_opt(batch, &synced()).map_err(write_err)
    }

    fn build(&self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let (payload, meta) = {
            let applied = self.shared.read().expect("state lock poisoned");
            let payload = SnapshotPayload {
                last_applied: applied.last_applied,
                membership: applied.membership.clone(),
                namespaces: applied.namespaces.clone(),
            };
            let seq = self.snapshot_seq.fetch_add(1, Ordering::Relaxed);
            let index = applied.last_applied.map(|l| l.index).unwrap_or(0);
            let meta = SnapshotMeta {
                last_log_id: applied.last_applied,
                last_membership: applied.membership.clone(),
                snapshot_id: format!("{index}-{seq}"),
            };
            (payload, meta)
        };
        let data = encode_snapshot(&payload);
        metrics::histogram!("tenure_snapshot_bytes", "how" => "built").record(data.len() as f64);
        drop(payload);
        let mut batch = rocksdb::WriteBatch::default();
        put_snapshot(&self.db, &mut batch, &meta, &data);
        self.db
            .write_opt(batch, &synced())
            .map_err(|e| io_error(ErrorSubject::Snapshot(None), ErrorVerb::Write, e))?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

pub(super) fn load(db: &Db) -> Result<Applied, StorageError> {
    let meta = cf(db, CF_SM_META);
    let get = |key: &[u8]| db.get_cf(meta, key).map_err(read_err);
    let last_applied: Option<LogId> = match get(KEY_LAST_APPLIED)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => None,
    };
    let membership: StoredMembership = match get(KEY_MEMBERSHIP)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => StoredMembership::default(),
    };
    let bad = |what: &str| read_err(std::io::Error::other(what.to_string()));
    // Each namespace's configuration first, so its rows have a table to go into.
    struct Loading {
        meta: TableMeta,
        settings: Settings,
        partitions: Vec<PartitionRecord>,
        sessions: BTreeMap<SessionId, SessionRecord>,
    }
    let mut tables: BTreeMap<Namespace, Loading> = BTreeMap::new();
    for item in db.prefix_iterator_cf(meta, KEY_TABLE) {
        let (k, value) = item.map_err(read_err)?;
        if !k.starts_with(KEY_TABLE) {
            break;
        }
        let (namespace, rest) =
            split_row_key(&k[KEY_TABLE.len()..]).ok_or_else(|| bad("bad namespace key"))?;
        if !rest.is_empty() {
            return Err(bad("bad namespace key"));
        }
        let table: TableMeta = decode(&value).map_err(read_err)?;
        let settings: Settings = match get(&key(KEY_SETTINGS, &namespace, b""))? {
            Some(b) => decode(&b).map_err(read_err)?,
            None => Settings::default(),
        };
        let count = table.config.map_or(0, |c| c.partition_count) as usize;
        tables.insert(
            namespace,
            Loading {
                meta: table,
                settings,
                partitions: vec![PartitionRecord::default(); count],
                sessions: BTreeMap::new(),
            },
        );
    }
    for item in db.iterator_cf(cf(db, CF_PARTITIONS), rocksdb::IteratorMode::Start) {
        let (k, value) = item.map_err(read_err)?;
        let (namespace, rest) = split_row_key(&k).ok_or_else(|| bad("bad partition key"))?;
        let p = u32::from_be_bytes(rest.try_into().map_err(|_| bad("bad partition key"))?);
        let table = tables
            .get_mut(&namespace)
            .ok_or_else(|| bad(&format!("partition row {p} of namespace {namespace}, which has no table")))?;
        let slot = table.partitions.get_mut(p as usize).ok_or_else(|| {
            bad(&format!("partition row {p} of namespace {namespace} beyond its configured count"))
        })?;
        *slot = decode(&value).map_err(read_err)?;
    }
    for item in db.iterator_cf(cf(db, CF_SESSIONS), rocksdb::IteratorMode::Start) {
        let (k, value) = item.map_err(read_err)?;
        let (namespace, rest) = split_row_key(&k).ok_or_else(|| bad("bad session key"))?;
        let s = u64::from_be_bytes(rest.try_into().map_err(|_| bad("bad session key"))?);
        let table = tables
            .get_mut(&namespace)
            .ok_or_else(|| bad(&format!("session row {s} of namespace {namespace}, which has no table")))?;
        let record: SessionRecord = decode(&value).map_err(read_err)?;
        table.sessions.insert(SessionId(s), record);
    }
    let tables: BTreeMap<Namespace, OwnershipState> = tables
        .into_iter()
        .map(|(namespace, t)| {
            let state =
                OwnershipState::from_parts(t.meta.config, t.partitions, t.sessions, t.meta.next_session)
                    .with_settings(t.settings);
            (namespace, state)
        })
        .collect();
    Ok(Applied { namespaces: Namespaces::from(tables), last_applied, membership })
}

/// A namespace's configuration and session counter (every time it is touched: both are small)
/// and, when they changed, its settings.
fn put_table_meta(
    batch: &mut rocksdb::WriteBatch,
    meta: &rocksdb::ColumnFamily,
    namespace: &Namespace,
    state: &OwnershipState,
    settings_changed: bool,
) {
    let table = TableMeta { config: state.config(), next_session: state.next_session() };
    batch.put_cf(meta, key(KEY_TABLE, namespace, b""), encode(&table));
    if settings_changed {
        batch.put_cf(meta, key(KEY_SETTINGS, namespace, b""), encode(state.settings()));
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        self.build()
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.shared.read().expect("state lock poisoned");
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut responses = Vec::new();
        let mut published = Vec::new();
        {
            let mut applied = self.shared.write().expect("state lock poisoned");
            for entry in entries {
                applied.last_applied = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Blank => responses.push(Response::Noop),
                    EntryPayload::Normal(proposal) => {
                        let (response, events) = applied.namespaces.apply(entry.log_id.index, &proposal);
                        if !events.is_empty() {
                            published.push(Arc::new(AppliedEvent {
                                index: entry.log_id.index,
                                namespace: proposal.namespace().clone(),
                                events,
                                snapshot: false,
                            }));
                        }
                        responses.push(response);
                    }
                    EntryPayload::Membership(m) => {
                        applied.membership = StoredMembership::new(Some(entry.log_id), m);
                        responses.push(Response::Noop);
                    }
                }
            }
            self.persist(&mut applied, false, None)?;
        }
        for event in published {
            self.sessions.publish(&event);
            // No receivers is normal (a follower with no watchers).
            let _ = self.events.send(event);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, crate::raft::Member>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        metrics::histogram!("tenure_snapshot_bytes", "how" => "installed").record(data.len() as f64);
        let payload = decode_snapshot(&data)
            .map_err(|e| io_error(ErrorSubject::Snapshot(Some(meta.signature())), ErrorVerb::Read, e))?;
        let mut applied = self.shared.write().expect("state lock poisoned");
        let mut installed = Applied {
            namespaces: payload.namespaces,
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
        };
        // The table, `last_applied` and the snapshot itself: one synced batch, so a crash
        // leaves either the old state or the new one, never a mix.
        self.persist(&mut installed, true, Some((meta, &data)))?;
        *applied = installed;
        drop(applied);
        let index = meta.last_log_id.map_or(0, |l| l.index);
        self.sessions.resync_all();
        let _ = self.events.send(Arc::new(AppliedEvent {
            index,
            namespace: Namespace::default_namespace(),
            events: Vec::new(),
            snapshot: true,
        }));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let meta_cf = cf(&self.db, CF_SM_META);
        let Some(meta) = self.db.get_cf(meta_cf, KEY_SNAPSHOT_META).map_err(read_err)? else {
            return Ok(None);
        };
        let meta: SnapshotMeta<u64, crate::raft::Member> = decode(&meta).map_err(read_err)?;
        let data = self
            .db
            .get_cf(meta_cf, KEY_SNAPSHOT_DATA)
            .map_err(read_err)?
            .ok_or_else(|| read_err(std::io::Error::other("snapshot metadata without its data")))?;
        Ok(Some(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) }))
    }
}
