//! Atomic write batches: every operation of a batch goes into one WAL record
//! (one allocation, one checksum chain), so after any crash either all of
//! them are present or none is.

use crate::engine::Engine;
use crate::error::Result;
use crate::types::{Durability, KeySpace, Tag, WalPosition};
use crate::wal::format::{ItemSpec, Op};

/// One operation of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BatchOp {
    space: KeySpace,
    op: Op,
    key: Vec<u8>,
    value: Vec<u8>,
    tag: Tag,
}

/// Puts and deletes applied all together or not at all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteBatch {
    ops: Vec<BatchOp>,
}

impl WriteBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a put.
    pub fn put(&mut self, space: KeySpace, key: &[u8], value: &[u8]) -> &mut Self {
        self.put_tagged(space, key, value, Tag(0))
    }

    /// Adds a put carrying an application tag (see [`Tag`]).
    pub fn put_tagged(&mut self, space: KeySpace, key: &[u8], value: &[u8], tag: Tag) -> &mut Self {
        self.ops.push(BatchOp {
            space,
            op: Op::Put,
            key: key.to_vec(),
            value: value.to_vec(),
            tag,
        });
        self
    }

    /// Adds a delete.
    pub fn delete(&mut self, space: KeySpace, key: &[u8]) -> &mut Self {
        self.ops.push(BatchOp {
            space,
            op: Op::Delete,
            key: key.to_vec(),
            value: Vec::new(),
            tag: Tag(0),
        });
        self
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

impl Engine {
    /// Writes every operation of `batch` atomically; later operations on the
    /// same key win. An empty batch writes nothing and returns the current
    /// processed position.
    pub fn write_batch(&self, batch: &WriteBatch, durability: Durability) -> Result<WalPosition> {
        if batch.is_empty() {
            return Ok(self.processed_position());
        }
        let epoch = self.epoch();
        let items: Vec<ItemSpec<'_>> = batch
            .ops
            .iter()
            .map(|op| {
                self.inner
                    .item(op.space, op.op, &op.key, &op.value, epoch, op.tag)
            })
            .collect::<Result<_>>()?;
        let position = self.inner.write(&items, durability)?;
        crate::metrics::Metrics::add(&self.inner.metrics.counters().batches, 1);
        Ok(position)
    }
}
