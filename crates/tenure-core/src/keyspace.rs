//! The key space: one stable hash of a key's bytes, and the partitions that cover its range.
//!
//! The hash is xxHash64 with seed 0 over the key's raw bytes, available in every mainstream
//! language, so any client computes the same partition for a key. `P` partitions cover the u64
//! hash space exactly in contiguous ranges: partition `p` holds the hashes `h` with
//! `floor(h * P / 2^64) == p`. Invariant kept here: every hash maps to exactly one partition, and
//! the ranges are contiguous, ordered, non-overlapping and together cover `0..=u64::MAX`.
//!
//! Test vectors (xxHash64, seed 0):
//!
//! | key       | hash                 | partition of 256 |
//! |-----------|----------------------|------------------|
//! | `""`      | `0xef46db3751d8e999` | 239              |
//! | `"a"`     | `0xd24ec4f1a98c6e5b` | 210              |
//! | `"abc"`   | `0x44bc2cf5ad770999` | 68               |
//!
//! ```
//! use tenure_core::keyspace::{hash_key, KeySpace};
//! let space = KeySpace::new(256).unwrap();
//! assert_eq!(hash_key(b""), 0xef46db3751d8e999);
//! assert_eq!(space.partition_of_key(b"").0, 239);
//! ```

use crate::ids::PartitionId;
use serde::{Deserialize, Serialize};

/// Largest partition count a cluster accepts.
pub const MAX_PARTITIONS: u32 = 1 << 22;

/// The documented, stable hash of a key: xxHash64 with seed 0.
pub fn hash_key(key: &[u8]) -> u64 {
    xxhash_rust::xxh64::xxh64(key, 0)
}

/// A key space split into `count` partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySpace {
    count: u32,
}

/// An inclusive range of hashes, `start..=end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashRange {
    pub start: u64,
    pub end: u64,
}

/// Why a partition count was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("partition count must be between 1 and {MAX_PARTITIONS}, got {0}")]
pub struct BadPartitionCount(pub u64);

impl KeySpace {
    pub fn new(count: u32) -> Result<Self, BadPartitionCount> {
        if count == 0 || count > MAX_PARTITIONS {
            return Err(BadPartitionCount(count as u64));
        }
        Ok(KeySpace { count })
    }

    pub fn partition_count(&self) -> u32 {
        self.count
    }

    pub fn partition_of_hash(&self, hash: u64) -> PartitionId {
        PartitionId(((hash as u128 * self.count as u128) >> 64) as u32)
    }

    pub fn partition_of_key(&self, key: &[u8]) -> PartitionId {
        self.partition_of_hash(hash_key(key))
    }

    /// First hash of partition `p`: the smallest `h` with `h * P >= p * 2^64`.
    fn start_of(&self, p: u64) -> u128 {
        ((p as u128) << 64).div_ceil(self.count as u128)
    }

    /// The hashes partition `p` covers, or `None` when `p` is out of range.
    pub fn range(&self, p: PartitionId) -> Option<HashRange> {
        if p.0 >= self.count {
            return None;
        }
        let start = self.start_of(p.0 as u64);
        let end = self.start_of(p.0 as u64 + 1) - 1;
        Some(HashRange { start: start as u64, end: end as u64 })
    }

    pub fn contains(&self, p: PartitionId) -> bool {
        p.0 < self.count
    }
}
