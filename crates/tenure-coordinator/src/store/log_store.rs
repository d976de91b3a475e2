//! The Raft log and vote, in the `log` and `raft` column families.
//!
//! Log keys are the big-endian entry index, so RocksDB's order is the log's order.

use super::db::{cf, decode, encode, io_error, synced, Db, CF_LOG, CF_RAFT};
use crate::raft::{Entry, LogId, StorageError, TypeConfig};
use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, LogState, OptionalSend, RaftLogReader, Vote};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_PURGED: &[u8] = b"last_purged";

/// The log half of a node's store. Cheap to clone: clones share the database.
#[derive(Clone)]
pub struct LogStore {
    db: Db,
}

impl LogStore {
    pub fn new(db: Db) -> Self {
        LogStore { db }
    }

    fn get_meta<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, StorageError> {
        let raw = self
            .db
            .get_cf(cf(&self.db, CF_RAFT), key)
            .map_err(|e| io_error(ErrorSubject::Store, ErrorVerb::Read, e))?;
        raw.map(|bytes| decode(&bytes))
            .transpose()
            .map_err(|e| io_error(ErrorSubject::Store, ErrorVerb::Read, e))
    }

    fn put_meta<T: serde::Serialize>(
        &self,
        key: &[u8],
        value: &T,
        subject: ErrorSubject<u64>,
    ) -> Result<(), StorageError> {
        self.db
            .put_cf_opt(cf(&self.db, CF_RAFT), key, encode(value), &synced())
            .map_err(|e| io_error(subject, ErrorVerb::Write, e))
    }

    fn last_entry_log_id(&self) -> Result<Option<LogId>, StorageError> {
        let mut iter = self.db.iterator_cf(cf(&self.db, CF_LOG), rocksdb::IteratorMode::End);
        match iter.next() {
            None => Ok(None),
            Some(item) => {
                let (_, value) = item.map_err(|e| io_error(ErrorSubject::Logs, ErrorVerb::Read, e))?;
                let entry: Entry =
                    decode(&value).map_err(|e| io_error(ErrorSubject::Logs, ErrorVerb::Read, e))?;
                Ok(Some(entry.log_id))
            }
        }
    }
}

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&i) => i,
            Bound::Excluded(&i) => i.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let from = index_key(start);
        let iter = self.db.iterator_cf(
            cf(&self.db, CF_LOG),
            rocksdb::IteratorMode::From(&from, rocksdb::Direction::Forward),
        );
        let mut entries = Vec::new();
        for item in iter {
            let (key, value) = item.map_err(|e| io_error(ErrorSubject::Logs, ErrorVerb::Read, e))?;
            let index = u64::from_be_bytes(key.as_ref().try_into().map_err(|_| {
                io_error(ErrorSubject::Logs, ErrorVerb::Read, std::io::Error::other("log key is not 8 bytes"))
            })?);
            if !range.contains(&index) {
                break;
            }
            entries.push(decode(&value).map_err(|e| io_error(ErrorSubject::Logs, ErrorVerb::Read, e))?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> = self.get_meta(KEY_PURGED)?;
        let last_log_id = self.last_entry_log_id()?.or(last_purged_log_id);
        Ok(LogState { last_purged_log_id, last_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), StorageError> {
        self.put_meta(KEY_VOTE, vote, ErrorSubject::Vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, StorageError> {
        self.get_meta(KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.put_meta(KEY_COMMITTED, &committed, ErrorSubject::Store)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.get_meta::<Option<LogId>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = rocksdb::WriteBatch::default();
        let log = cf(&self.db, CF_LOG);
        for entry in entries {
            batch.put_cf(log, index_key(entry.log_id.index), encode(&entry));
        }
        let result = self.db.write_opt(batch, &synced());
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(io_error(ErrorSubject::Logs, ErrorVerb::Write, e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut batch = rocksdb::WriteBatch::default();
        batch.delete_range_cf(cf(&self.db, CF_LOG), index_key(log_id.index), index_key(u64::MAX));
        batch.delete_cf(cf(&self.db, CF_LOG), index_key(u64::MAX));
        self.db.write_opt(batch, &synced()).map_err(|e| io_error(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // Record the purge point first: a crash between the two steps leaves extra entries
        // below it, which readers never ask for, rather than a gap.
        self.put_meta(KEY_PURGED, &log_id, ErrorSubject::Logs)?;
        let mut batch = rocksdb::WriteBatch::default();
        batch.delete_range_cf(cf(&self.db, CF_LOG), index_key(0), index_key(log_id.index + 1));
        self.db.write_opt(batch, &synced()).map_err(|e| io_error(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }
}
