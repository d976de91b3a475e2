//! Opening the database, and what the log and the state machine share (the encoding is
//! [`crate::codec`]'s).

use crate::raft::StorageError;
use openraft::{AnyError, ErrorSubject, ErrorVerb, StorageIOError};
use rocksdb::{ColumnFamilyDescriptor, Options, DB};
use std::path::Path;
use std::sync::Arc;

pub type Db = Arc<DB>;

pub(crate) const CF_LOG: &str = "log";
pub(crate) const CF_RAFT: &str = "raft";
pub(crate) const CF_SM_META: &str = "sm_meta";
pub(crate) const CF_PARTITIONS: &str = "sm_partitions";
pub(crate) const CF_SESSIONS: &str = "sm_sessions";

/// Opens (or creates) a node's database under `dir`.
pub fn open(dir: &Path) -> Result<Db, rocksdb::Error> {
    let mut options = Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    let cfs = [CF_LOG, CF_RAFT, CF_SM_META, CF_PARTITIONS, CF_SESSIONS]
        .into_iter()
        .map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    Ok(Arc::new(DB::open_cf_descriptors(&options, dir, cfs)?))
}

pub(crate) fn cf<'a>(db: &'a DB, name: &str) -> &'a rocksdb::ColumnFamily {
    db.cf_handle(name).unwrap_or_else(|| panic!("column family {name} is created at open"))
}

/// Synced write options: a write is on disk before it returns.
pub(crate) fn synced() -> rocksdb::WriteOptions {
    let mut w = rocksdb::WriteOptions::default();
    w.set_sync(true);
    w
}

pub(crate) fn io_error(
    subject: ErrorSubject<u64>,
    verb: ErrorVerb,
    e: impl std::error::Error + 'static,
) -> StorageError {
    StorageIOError::new(subject, verb, AnyError::new(&e)).into()
}

pub(crate) use crate::codec::{decode, encode};
