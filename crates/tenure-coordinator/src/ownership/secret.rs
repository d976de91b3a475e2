//! Session secrets as the replicated state keeps them: hashed.
//!
//! Every replica's RocksDB, every snapshot and every log entry would otherwise hold each
//! session's secret in clear, so anyone who reads a node's disk or a snapshot in transit could
//! renew or release any worker's partitions. The leader generates a secret, gives it to the
//! worker once (in the join answer) and proposes only its hash; a request that presents a secret
//! is judged by hashing what it presents. Commands that act for a session carry the hash of the
//! secret presented, so apply can still refuse one that names the wrong session.
//!
//! SHA-256, not a slow password hash: a secret is 128 random bits drawn by the leader, not a
//! word a person chose, so there is no dictionary to try and a fast hash costs a heartbeat well
//! under a microsecond.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The SHA-256 of a session secret.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretHash([u8; 32]);

impl SecretHash {
    /// The hash of `secret`, as presented by a client.
    pub fn of(secret: &str) -> SecretHash {
        SecretHash(Sha256::digest(secret.as_bytes()).into())
    }

    /// Compares in constant time, so the time a refusal takes says nothing about how much of the
    /// hash matched.
    pub fn matches(&self, other: &SecretHash) -> bool {
        self.0.iter().zip(&other.0).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// Only a prefix: enough to tell two apart in a log line, not enough to matter.
impl std::fmt::Debug for SecretHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretHash({:02x}{:02x}{:02x}{:02x}..)", self.0[0], self.0[1], self.0[2], self.0[3])
    }
}
