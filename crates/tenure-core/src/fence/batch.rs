//! Several changes to one partition's state under one token: what a fenced store applies whole,
//! after one check, or not at all.
//!
//! A partition owner rarely changes one key at a time: it writes the rows an input produced and
//! the offset it consumed together, so that a crash or a stale token leaves both or neither. A
//! [`FenceBatch`] is that unit; [`FenceStore::apply`](super::FenceStore::apply) checks the token
//! once and applies every change in the same atomic step.

/// One change in a [`FenceBatch`], in the order it was added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOp {
    Put { key: Vec<u8>, value: Vec<u8> },
    Delete { key: Vec<u8> },
}

/// Puts, deletes and an optional new checkpoint for one partition, applied in order as one step.
/// A later change to a key wins over an earlier one in the same batch.
///
/// ```
/// use tenure_core::fence::{BatchOp, FenceBatch};
/// let mut batch = FenceBatch::new();
/// batch.put(b"order-7", b"paid").delete(b"cart-7").checkpoint(b"offset=18");
/// assert_eq!(batch.ops().len(), 2);
/// assert_eq!(batch.new_checkpoint(), Some(&b"offset=18"[..]));
/// assert!(matches!(&batch.ops()[1], BatchOp::Delete { key } if key == b"cart-7"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FenceBatch {
    ops: Vec<BatchOp>,
    checkpoint: Option<Vec<u8>>,
}

impl FenceBatch {
    pub fn new() -> FenceBatch {
        FenceBatch::default()
    }

    /// Sets `key` to `value`.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> &mut FenceBatch {
        self.ops.push(BatchOp::Put { key: key.to_vec(), value: value.to_vec() });
        self
    }

    /// Removes `key`; removing a key that is not there is no error.
    pub fn delete(&mut self, key: &[u8]) -> &mut FenceBatch {
        self.ops.push(BatchOp::Delete { key: key.to_vec() });
        self
    }

    /// Replaces the partition's checkpoint in the same step as the data.
    pub fn checkpoint(&mut self, checkpoint: &[u8]) -> &mut FenceBatch {
        self.checkpoint = Some(checkpoint.to_vec());
        self
    }

    pub fn ops(&self) -> &[BatchOp] {
        &self.ops
    }

    pub fn new_checkpoint(&self) -> Option<&[u8]> {
        self.checkpoint.as_deref()
    }

    /// Nothing to write: applying it only checks (and raises) the fence.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.checkpoint.is_none()
    }

    /// The bytes the batch carries, keys and values together.
    pub fn size_bytes(&self) -> usize {
        let ops: usize = self
            .ops
            .iter()
            .map(|op| match op {
                BatchOp::Put { key, value } => key.len() + value.len(),
                BatchOp::Delete { key } => key.len(),
            })
            .sum();
        ops + self.checkpoint.as_ref().map_or(0, Vec::len)
    }

    /// A batch of one put.
    pub fn of_put(key: &[u8], value: &[u8]) -> FenceBatch {
        let mut batch = FenceBatch::new();
        batch.put(key, value);
        batch
    }

    /// A batch that only replaces the checkpoint.
    pub fn of_checkpoint(checkpoint: &[u8]) -> FenceBatch {
        let mut batch = FenceBatch::new();
        batch.checkpoint(checkpoint);
        batch
    }
}
