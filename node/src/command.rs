//! Commands: what a normal Raft entry's data means.
//!
//! ```text
//! version u8 (1), kind u8, body
//! kind 1 Write:   count u32, then per op: op u8 (1 put, 2 delete),
//!                 namespace u32, epoch u32, key [32], value_len u32, value
//! kind 2 Touch:   namespace u32, epoch u32, key [32]
//! kind 3 Advance: epoch u32
//! kind 4 Drop:    namespace u32, below u32
//! kind 5 Noop
//! ```
//! Little-endian. A Write's ops become the items of the entry's WAL record,
//! so values are written to disk once; see `docs/design/replication.md`.

use crate::error::{NodeError, Result};

/// Version of the command encoding.
const VERSION: u8 = 1;
/// Bytes of a storage key.
pub const KEY_BYTES: usize = 32;

/// One put or delete of a Write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteOp {
    /// Put (`Some` value) or delete (`None`).
    pub value: Option<Vec<u8>>,
    /// Namespace id (the engine tag).
    pub namespace: u32,
    /// Epoch stamped by the proposer.
    pub epoch: u32,
    /// Storage key.
    pub key: [u8; KEY_BYTES],
}

/// What a normal entry asks the replicas to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Puts and deletes, applied atomically.
    Write(Vec<WriteOp>),
    /// Move a key into an epoch (the proposer's current one).
    Touch {
        /// Namespace id.
        namespace: u32,
        /// The epoch to move it to.
        epoch: u32,
        /// Storage key.
        key: [u8; KEY_BYTES],
    },
    /// Start a new epoch.
    AdvanceEpoch(u32),
    /// Drop a namespace's entries of epochs below `below`.
    DropEpochs {
        /// Namespace id.
        namespace: u32,
        /// Exclusive bound.
        below: u32,
    },
    /// Nothing (a leader's first entry, or a read barrier).
    Noop,
}

/// Command kinds on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// [`Command::Write`].
    Write = 1,
    /// [`Command::Touch`].
    Touch = 2,
    /// [`Command::AdvanceEpoch`].
    AdvanceEpoch = 3,
    /// [`Command::DropEpochs`].
    DropEpochs = 4,
    /// [`Command::Noop`].
    Noop = 5,
}

impl Kind {
    fn from_u8(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Write,
            2 => Kind::Touch,
            3 => Kind::AdvanceEpoch,
            4 => Kind::DropEpochs,
            5 => Kind::Noop,
            _ => return None,
        })
    }
}

/// Bytes one op occupies in a Write.
pub fn op_len(op: &WriteOp) -> usize {
    1 + 4 + 4 + KEY_BYTES + 4 + op.value.as_ref().map_or(0, Vec::len)
}

impl Command {
    /// The command's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Command::Write(_) => Kind::Write,
            Command::Touch { .. } => Kind::Touch,
            Command::AdvanceEpoch(_) => Kind::AdvanceEpoch,
            Command::DropEpochs { .. } => Kind::DropEpochs,
            Command::Noop => Kind::Noop,
        }
    }

    /// Encodes the command.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION, self.kind() as u8];
        match self {
            Command::Write(ops) => {
                out.reserve(4 + ops.iter().map(op_len).sum::<usize>());
                out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
                for op in ops {
                    out.push(if op.value.is_some() { 1 } else { 2 });
                    out.extend_from_slice(&op.namespace.to_le_bytes());
                    out.extend_from_slice(&op.epoch.to_le_bytes());
                    out.extend_from_slice(&op.key);
                    let value = op.value.as_deref().unwrap_or(&[]);
                    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
                    out.extend_from_slice(value);
                }
            }
            Command::Touch {
                namespace,
                epoch,
                key,
            } => {
                out.extend_from_slice(&namespace.to_le_bytes());
                out.extend_from_slice(&epoch.to_le_bytes());
                out.extend_from_slice(key);
            }
            Command::AdvanceEpoch(epoch) => out.extend_from_slice(&epoch.to_le_bytes()),
            Command::DropEpochs { namespace, below } => {
                out.extend_from_slice(&namespace.to_le_bytes());
                out.extend_from_slice(&below.to_le_bytes());
            }
            Command::Noop => {}
        }
        out
    }

    /// Decodes a command; an empty buffer is a `Noop` (raft-rs's own empty
    /// entries).
    pub fn decode(bytes: &[u8]) -> Result<Command> {
        if bytes.is_empty() {
            return Ok(Command::Noop);
        }
        let mut r = Reader { bytes, at: 0 };
        let version = r.u8()?;
        if version != VERSION {
            return Err(NodeError::Malformed(format!("command version {version}")));
        }
        let kind = Kind::from_u8(r.u8()?)
            .ok_or_else(|| NodeError::Malformed("unknown command kind".into()))?;
        let command = match kind {
            Kind::Write => {
                let count = r.u32()? as usize;
                let mut ops = Vec::with_capacity(count.min(bytes.len() / 45));
                for _ in 0..count {
                    ops.push(r.op()?);
                }
                Command::Write(ops)
            }
            Kind::Touch => Command::Touch {
                namespace: r.u32()?,
                epoch: r.u32()?,
                key: r.key()?,
            },
            Kind::AdvanceEpoch => Command::AdvanceEpoch(r.u32()?),
            Kind::DropEpochs => Command::DropEpochs {
                namespace: r.u32()?,
                below: r.u32()?,
            },
            Kind::Noop => Command::Noop,
        };
        if r.at != bytes.len() {
            return Err(NodeError::Malformed(
                "trailing bytes after a command".into(),
            ));
        }
        Ok(command)
    }
}

/// A bounds-checked little-endian reader.
pub(crate) struct Reader<'a> {
    pub bytes: &'a [u8],
    pub at: usize,
}

impl<'a> Reader<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| {
                NodeError::Malformed(format!(
                    "{n} bytes wanted at {}, {} left",
                    self.at,
                    self.bytes.len() - self.at
                ))
            })?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn key(&mut self) -> Result<[u8; KEY_BYTES]> {
        Ok(self.take(KEY_BYTES)?.try_into().expect("32 bytes"))
    }
    fn op(&mut self) -> Result<WriteOp> {
        let op = self.u8()?;
        let namespace = self.u32()?;
        let epoch = self.u32()?;
        let key = self.key()?;
        let len = self.u32()? as usize;
        let value = self.take(len)?;
        let value = match op {
            1 => Some(value.to_vec()),
            2 if value.is_empty() => None,
            _ => return Err(NodeError::Malformed(format!("bad write op {op}"))),
        };
        Ok(WriteOp {
            value,
            namespace,
            epoch,
            key,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Command> {
        vec![
            Command::Write(vec![
                WriteOp {
                    value: Some(b"v1".to_vec()),
                    namespace: 3,
                    epoch: 7,
                    key: [1; 32],
                },
                WriteOp {
                    value: None,
                    namespace: 3,
                    epoch: 7,
                    key: [2; 32],
                },
                WriteOp {
                    value: Some(Vec::new()),
                    namespace: 4,
                    epoch: 8,
                    key: [3; 32],
                },
            ]),
            Command::Touch {
                namespace: 9,
                epoch: 3,
                key: [4; 32],
            },
            Command::AdvanceEpoch(12),
            Command::DropEpochs {
                namespace: 2,
                below: 5,
            },
            Command::Noop,
        ]
    }

    #[test]
    fn commands_round_trip() {
        for command in samples() {
            assert_eq!(Command::decode(&command.encode()).unwrap(), command);
        }
        assert_eq!(Command::decode(&[]).unwrap(), Command::Noop);
    }

    #[test]
    fn truncated_or_damaged_commands_are_errors_not_panics() {
        for command in samples() {
            let bytes = command.encode();
            for cut in 0..bytes.len() {
                if cut == 0 {
                    continue;
                }
                assert!(
                    Command::decode(&bytes[..cut]).is_err(),
                    "{command:?} cut at {cut}"
                );
            }
            let mut extra = bytes.clone();
            extra.push(0);
            assert!(Command::decode(&extra).is_err());
        }
        assert!(Command::decode(&[1, 99]).is_err());
        assert!(Command::decode(&[2, 1]).is_err());
        // A count far larger than the bytes fails cleanly.
        assert!(Command::decode(&[1, 1, 255, 255, 255, 255]).is_err());
    }
}
