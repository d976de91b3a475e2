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
use crate::ownership::{Config, Event, OwnershipState, PartitionRecord, Response, SessionRecord, Settings};
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
const KEY_CONFIG: &[u8] = b"config";
const KEY_NEXT_SESSION: &[u8] = b"next_session";
const KEY_SETTINGS: &[u8] = b"settings";
/// The stored snapshot: its metadata and its data, beside each other.
const KEY_SNAPSHOT_META: &[u8] = b"snapshot_meta";
const KEY_SNAPSHOT_DATA: &[u8] = b"snapshot_data";

/// How many applied batches a slow watcher may fall behind before it must resynchronise.
const EVENT_BUFFER: usize = 4096;

/// The applied state, shared with the server for reads. A std lock, not a Tokio one: nothing
/// awaits while holding it.
#[derive(Debug, Default)]
pub struct Applied {
    pub state: OwnershipState,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
}

pub type SharedState = Arc<RwLock<Applied>>;

/// The events of one applied log entry, or the mark of a snapshot installed in place of the
/// entries up to `index` (then `events` is empty: whoever follows the events one by one has
/// missed what the snapshot covers, and must read the state again).
#[derive(Clone, Debug)]
pub struct AppliedEvent {
    pub index: u64,
    pub events: Vec<Event>,
    pub snapshot: bool,
}

#[derive(Serialize, Deserialize)]
struct SnapshotPayload {
    last_applied: Option<LogId>,
    membership: StoredMembership,
    state: OwnershipState,
}

fn encode_snapshot(payload: &SnapshotPayload) -> Vec<u8> {
    crate::codec::encode(payload)
}

/// A snapshot's data for `state` alone (no membership, nothing applied), as a node would send
/// it: for measuring what a table costs to snapshot.
pub fn encode_table_snapshot(state: &OwnershipState) -> Vec<u8> {
    let payload =
        SnapshotPayload { last_applied: None, membership: StoredMembership::default(), state: state.clone() };
    encode_snapshot(&payload)
}

/// The table a snapshot's data carries, read as a node installing it would.
pub fn decode_table_snapshot(data: &[u8]) -> Result<OwnershipState, FormatError> {
    decode_snapshot(data).map(|payload| payload.state)
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

    /// Subscribes to the entries that name `session` (see [`SessionFanOut`]).
    pub fn subscribe_session(&self, session: SessionId) -> SessionEvents {
        self.sessions.subscribe(session)
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
        let changes = applied.state.take_changes();
        let mut batch = rocksdb::WriteBatch::default();
        if let Some((meta, data)) = snapshot {
            put_snapshot(&self.db, &mut batch, meta, data);
        }
        let (parts, sess, meta) =
            (cf(&self.db, CF_PARTITIONS), cf(&self.db, CF_SESSIONS), cf(&self.db, CF_SM_META));
        let state = &applied.state;
        if full {
            batch.delete_range_cf(parts, [0u8; 4], [0xffu8; 4]);
            batch.delete_cf(parts, [0xffu8; 4]);
            batch.delete_range_cf(sess, [0u8; 8], [0xffu8; 8]);
            batch.delete_cf(sess, [0xffu8; 8]);
            for (p, record) in state.partitions().iter().enumerate() {
                if *record != PartitionRecord::default() {
                    batch.put_cf(parts, (p as u32).to_be_bytes(), encode(record));
                }
            }
            for (s, record) in state.sessions() {
                batch.put_cf(sess, s.0.to_be_bytes(), encode(record));
            }
        } else {
            for p in &changes.partitions {
                match state.partitions().get(*p as usize) {
                    Some(record) if *record != PartitionRecord::default() => {
                        batch.put_cf(parts, p.to_be_bytes(), encode(record))
                    }
                    _ => batch.delete_cf(parts, p.to_be_bytes()),
                }
            }
            for s in &changes.sessions {
                match state.session(*s) {
                    Some(record) => batch.put_cf(sess, s.0.to_be_bytes(), encode(record)),
                    None => batch.delete_cf(sess, s.0.to_be_bytes()),
                }
            }
        }
        batch.put_cf(meta, KEY_CONFIG, encode(&state.config()));
        batch.put_cf(meta, KEY_NEXT_SESSION, encode(&state.next_session()));
        if full || changes.meta {
            batch.put_cf(meta, KEY_SETTINGS, encode(state.settings()));
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
                state: applied.state.clone(),
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
    let config: Option<Config> = match get(KEY_CONFIG)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => None,
    };
    let next_session: u64 = match get(KEY_NEXT_SESSION)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => 0,
    };
    let settings: Settings = match get(KEY_SETTINGS)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => Settings::default(),
    };
    let last_applied: Option<LogId> = match get(KEY_LAST_APPLIED)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => None,
    };
    let membership: StoredMembership = match get(KEY_MEMBERSHIP)? {
        Some(b) => decode(&b).map_err(read_err)?,
        None => StoredMembership::default(),
    };
    let count = config.map(|c| c.partition_count).unwrap_or(0) as usize;
    let mut partitions = vec![PartitionRecord::default(); count];
    for item in db.iterator_cf(cf(db, CF_PARTITIONS), rocksdb::IteratorMode::Start) {
        let (key, value) = item.map_err(read_err)?;
        let p = u32::from_be_bytes(
            key.as_ref().try_into().map_err(|_| read_err(std::io::Error::other("bad partition key")))?,
        );
        let slot = partitions.get_mut(p as usize).ok_or_else(|| {
            read_err(std::io::Error::other(format!("partition row {p} beyond the configured count")))
        })?;
        *slot = decode(&value).map_err(read_err)?;
    }
    let mut sessions = BTreeMap::new();
    for item in db.iterator_cf(cf(db, CF_SESSIONS), rocksdb::IteratorMode::Start) {
        let (key, value) = item.map_err(read_err)?;
        let s = u64::from_be_bytes(
            key.as_ref().try_into().map_err(|_| read_err(std::io::Error::other("bad session key")))?,
        );
        let record: SessionRecord = decode(&value).map_err(read_err)?;
        sessions.insert(SessionId(s), record);
    }
    Ok(Applied {
        state: OwnershipState::from_parts(config, partitions, sessions, next_session).with_settings(settings),
        last_applied,
        membership,
    })
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
                    EntryPayload::Normal(command) => {
                        let (response, events) = applied.state.apply(entry.log_id.index, &command);
                        if !events.is_empty() {
                            published.push(Arc::new(AppliedEvent {
                                index: entry.log_id.index,
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
            state: payload.state,
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
        let _ = self.events.send(Arc::new(AppliedEvent { index, events: Vec::new(), snapshot: true }));
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
