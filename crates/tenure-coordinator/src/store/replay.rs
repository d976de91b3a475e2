//! Reading a stopped node's decisions back from its RocksDB log.
//!
//! A coordinator that runs as its own process cannot be watched from inside, but its log is on
//! disk: every entry up to the node's `last_applied` is committed, and the state machine is
//! pure, so applying those entries in order to an empty table yields exactly the events the
//! node applied, with their log indices. The fault harness uses this to record what real
//! `tenure serve` processes decided, after they stop. It needs the whole log, so such nodes run
//! with `keep_whole_log`; a purged log is reported, never silently skipped.

use super::db::{cf, decode, CF_LOG, CF_RAFT, CF_SM_META};
use crate::ownership::{Event, Namespaces};
use crate::raft::{Entry, LogId};
use openraft::EntryPayload;
use std::path::Path;

/// Why a node's log could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot open {dir}: {source}")]
    Open { dir: String, source: rocksdb::Error },
    #[error("cannot read the database: {0}")]
    Read(#[from] rocksdb::Error),
    #[error("cannot decode {what}: {source}")]
    Decode { what: String, source: crate::codec::FormatError },
    #[error("cannot load the node's own table: {0}")]
    Load(String),
    #[error("the log was purged up to index {0}; run the node with the whole log kept")]
    Purged(u64),
    #[error("log entry {0} is missing")]
    Missing(u64),
    #[error("the replayed table differs from the node's own at index {0}")]
    Diverged(u64),
}

/// The events of one applied entry.
#[derive(Clone, Debug)]
pub struct ReplayedEntry {
    pub index: u64,
    pub events: Vec<Event>,
}

fn decode_as<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, ReplayError> {
    decode(bytes).map_err(|source| ReplayError::Decode { what: what.to_string(), source })
}

/// Replays the committed log of the (stopped) node whose data is in `dir`; returns the events
/// of every entry up to its `last_applied`. Also checks that the replay ends at the very table
/// the node persisted, so the record and the node cannot disagree unnoticed.
pub fn replay_applied(dir: &Path) -> Result<Vec<ReplayedEntry>, ReplayError> {
    let db =
        super::open(dir).map_err(|source| ReplayError::Open { dir: dir.display().to_string(), source })?;
    if let Some(bytes) = db.get_cf(cf(&db, CF_RAFT), b"last_purged")? {
        // The log store writes the purged id itself, present only once something was purged.
        let purged: LogId = decode_as("last_purged", &bytes)?;
        return Err(ReplayError::Purged(purged.index));
    }
    let last_applied: Option<LogId> = match db.get_cf(cf(&db, CF_SM_META), b"last_applied")? {
        Some(bytes) => decode_as("last_applied", &bytes)?,
        None => None,
    };
    let Some(last_applied) = last_applied else { return Ok(Vec::new()) };

    let mut state = Namespaces::default();
    let mut replayed = Vec::new();
    // Nothing was purged, so the log starts at index 0 (the first membership entry).
    let mut expected = 0u64;
    let from = 0u64.to_be_bytes();
    let iter =
        db.iterator_cf(cf(&db, CF_LOG), rocksdb::IteratorMode::From(&from, rocksdb::Direction::Forward));
    for item in iter {
        let (_, value) = item?;
        let entry: Entry = decode_as("a log entry", &value)?;
        let index = entry.log_id.index;
        if index > last_applied.index {
            break; // not known to be committed
        }
        if index != expected {
            return Err(ReplayError::Missing(expected));
        }
        expected = index + 1;
        if let EntryPayload::Normal(command) = &entry.payload {
            let (_, events) = state.apply(index, command);
            if !events.is_empty() {
                replayed.push(ReplayedEntry { index, events });
            }
        }
    }
    if expected != last_applied.index + 1 {
        return Err(ReplayError::Missing(expected));
    }
    let persisted = super::state_machine::load(&db).map_err(|e| ReplayError::Load(e.to_string()))?;
    let same = persisted.namespaces.len() == state.len()
        && persisted.namespaces.iter().zip(state.iter()).all(|((na, a), (nb, b))| {
            na == nb
                && a.config() == b.config()
                && a.partitions() == b.partitions()
                && a.sessions() == b.sessions()
                && a.next_session() == b.next_session()
        });
    if !same {
        return Err(ReplayError::Diverged(last_applied.index));
    }
    Ok(replayed)
}
