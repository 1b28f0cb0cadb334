//! Commands: what a normal Raft entry's data means.
//!
//! ```text
//! version u8 (3), kind u8, body
//! kind 1 Write:   count u32, then per op: op u8 (1 put, 2 delete, 3 put
//!                 only if the key holds no blob),
//!                 namespace u32, epoch u32, key [32], name_len u16, name,
//!                 session, value_len u32, value
//! kind 2 Touch:   namespace u32, epoch u32, key [32], session
//! kind 3 Advance: epoch u32
//! kind 4 Drop:    namespace u32, below u32
//! kind 5 Noop
//! kind 6 Split:   child u32, at u64 (see `docs/design/splits.md`)
//! session:        u8 0 (none) | u8 1, id [16], sequence u64, opens u8,
//!                 time_ms u64 (see `session.rs`)
//! ```
//! Little-endian. Version 1 (still read) had no session fields, version 2
//! (still read) no names. An op's name is the blob's key as the client
//! wrote it (empty: not listed — SDK chunks, or older proposers), which the
//! replica's name index (`names.rs`) records at apply. A Write's
//! ops become the items of the entry's WAL record, so values are written to
//! disk once; see `docs/design/replication.md`.

use crate::error::{NodeError, Result};
use crate::session::{SessionTag, TAG_BYTES};

/// Version of the command encoding written.
const VERSION: u8 = 3;
/// The version before names.
const VERSION_WITHOUT_NAMES: u8 = 2;
/// The version before write sessions.
const VERSION_WITHOUT_SESSIONS: u8 = 1;
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
    /// The blob's key as the client named it, for the name index (empty:
    /// not indexed).
    pub name: Vec<u8>,
    /// The client's write session, for exactly-once application.
    pub session: Option<SessionTag>,
    /// A put applied only if the key holds no blob (decided at apply, in
    /// log order; refused with `Refusal::Exists` otherwise).
    pub if_absent: bool,
}

impl WriteOp {
    /// The op's code on the wire.
    fn code(&self) -> u8 {
        match (&self.value, self.if_absent) {
            (Some(_), false) => 1,
            (None, _) => 2,
            (Some(_), true) => 3,
        }
    }
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
        /// The client's write session, for exactly-once application.
        session: Option<SessionTag>,
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
    /// Cut the group's hash range at `at`: the group keeps the positions
    /// below it, a new group `child` (same voters, same state at this
    /// entry) takes the rest (`docs/design/splits.md`).
    Split {
        /// The new shard's id.
        child: u32,
        /// First hash position of the child's range.
        at: u64,
    },
    /// Record a namespace's retention in the replicated state: later
    /// drops it does not allow are refused at apply
    /// (`docs/design/epochs-cluster.md`, "Retention in the shards").
    Retain {
        /// Namespace id.
        namespace: u32,
        /// Epochs retained; 0: durable (no drop).
        epochs: u32,
        /// The cluster map version it was read from: an older one than
        /// the group holds is ignored.
        map_version: u64,
    },
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
    /// [`Command::Split`].
    Split = 6,
    /// [`Command::Retain`].
    Retain = 7,
}

impl Kind {
    fn from_u8(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Write,
            2 => Kind::Touch,
            3 => Kind::AdvanceEpoch,
            4 => Kind::DropEpochs,
            5 => Kind::Noop,
            6 => Kind::Split,
            7 => Kind::Retain,
            _ => return None,
        })
    }
}

/// Bytes one op occupies in a Write.
pub fn op_len(op: &WriteOp) -> usize {
    1 + 4
        + 4
        + KEY_BYTES
        + 2
        + op.name.len()
        + session_len(op.session.as_ref())
        + 4
        + op.value.as_ref().map_or(0, Vec::len)
}

/// Bytes of an encoded optional session.
pub(crate) fn session_len(session: Option<&SessionTag>) -> usize {
    1 + session.map_or(0, |_| TAG_BYTES)
}

/// Appends an optional session.
pub(crate) fn encode_session(session: Option<&SessionTag>, out: &mut Vec<u8>) {
    encode_session_at(session, None, out);
}

/// Appends an optional session, its time `time_ms` if given.
fn encode_session_at(session: Option<&SessionTag>, time_ms: Option<u64>, out: &mut Vec<u8>) {
    match session {
        None => out.push(0),
        Some(tag) => {
            out.push(1);
            SessionTag {
                time_ms: time_ms.unwrap_or(tag.time_ms),
                ..*tag
            }
            .encode(out);
        }
    }
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
            Command::Split { .. } => Kind::Split,
            Command::Retain { .. } => Kind::Retain,
        }
    }

    /// Encodes the command.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_stamped(None)
    }

    /// Whether any op carries a write session.
    pub fn has_sessions(&self) -> bool {
        match self {
            Command::Write(ops) => ops.iter().any(|op| op.session.is_some()),
            Command::Touch { session, .. } => session.is_some(),
            _ => false,
        }
    }

    /// Encodes the command, every session tag's time `time_ms` if given
    /// (the proposing leader's stamp, `session::SessionClock`).
    pub fn encode_stamped(&self, time_ms: Option<u64>) -> Vec<u8> {
        let mut out = vec![VERSION, self.kind() as u8];
        match self {
            Command::Write(ops) => {
                out.reserve(4 + ops.iter().map(op_len).sum::<usize>());
                out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
                for op in ops {
                    out.push(op.code());
                    out.extend_from_slice(&op.namespace.to_le_bytes());
                    out.extend_from_slice(&op.epoch.to_le_bytes());
                    out.extend_from_slice(&op.key);
                    out.extend_from_slice(&(op.name.len() as u16).to_le_bytes());
                    out.extend_from_slice(&op.name);
                    encode_session_at(op.session.as_ref(), time_ms, &mut out);
                    let value = op.value.as_deref().unwrap_or(&[]);
                    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
                    out.extend_from_slice(value);
                }
            }
            Command::Touch {
                namespace,
                epoch,
                key,
                session,
            } => {
                out.extend_from_slice(&namespace.to_le_bytes());
                out.extend_from_slice(&epoch.to_le_bytes());
                out.extend_from_slice(key);
                encode_session_at(session.as_ref(), time_ms, &mut out);
            }
            Command::AdvanceEpoch(epoch) => out.extend_from_slice(&epoch.to_le_bytes()),
            Command::DropEpochs { namespace, below } => {
                out.extend_from_slice(&namespace.to_le_bytes());
                out.extend_from_slice(&below.to_le_bytes());
            }
            Command::Noop => {}
            Command::Split { child, at } => {
                out.extend_from_slice(&child.to_le_bytes());
                out.extend_from_slice(&at.to_le_bytes());
            }
            Command::Retain {
                namespace,
                epochs,
                map_version,
            } => {
                out.extend_from_slice(&namespace.to_le_bytes());
                out.extend_from_slice(&epochs.to_le_bytes());
                out.extend_from_slice(&map_version.to_le_bytes());
            }
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
        if !(VERSION_WITHOUT_SESSIONS..=VERSION).contains(&version) {
            return Err(NodeError::Malformed(format!("command version {version}")));
        }
        let sessions = version >= VERSION_WITHOUT_NAMES;
        let names = version >= VERSION;
        let kind = Kind::from_u8(r.u8()?)
            .ok_or_else(|| NodeError::Malformed("unknown command kind".into()))?;
        let command = match kind {
            Kind::Write => {
                let count = r.u32()? as usize;
                let mut ops = Vec::with_capacity(count.min(bytes.len() / 45));
                for _ in 0..count {
                    ops.push(r.op(sessions, names)?);
                }
                Command::Write(ops)
            }
            Kind::Touch => Command::Touch {
                namespace: r.u32()?,
                epoch: r.u32()?,
                key: r.key()?,
                session: if sessions { r.session()? } else { None },
            },
            Kind::AdvanceEpoch => Command::AdvanceEpoch(r.u32()?),
            Kind::DropEpochs => Command::DropEpochs {
                namespace: r.u32()?,
                below: r.u32()?,
            },
            Kind::Noop => Command::Noop,
            Kind::Split => Command::Split {
                child: r.u32()?,
                at: r.u64()?,
            },
            Kind::Retain => Command::Retain {
                namespace: r.u32()?,
                epochs: r.u32()?,
                map_version: r.u64()?,
            },
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
    /// An optional session (see [`encode_session`]).
    pub fn session(&mut self) -> Result<Option<SessionTag>> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(SessionTag::decode(self)?)),
            other => Err(NodeError::Malformed(format!("session marker {other}"))),
        }
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn op(&mut self, sessions: bool, names: bool) -> Result<WriteOp> {
        let op = self.u8()?;
        let namespace = self.u32()?;
        let epoch = self.u32()?;
        let key = self.key()?;
        let name = if names {
            let len = self.u16()? as usize;
            self.take(len)?.to_vec()
        } else {
            Vec::new()
        };
        let session = if sessions { self.session()? } else { None };
        let len = self.u32()? as usize;
        let value = self.take(len)?;
        let value = match op {
            1 | 3 => Some(value.to_vec()),
            2 if value.is_empty() => None,
            _ => return Err(NodeError::Malformed(format!("bad write op {op}"))),
        };
        Ok(WriteOp {
            value,
            namespace,
            epoch,
            key,
            name,
            session,
            if_absent: op == 3,
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
                    name: b"photos/2026/cat.jpg".to_vec(),
                    session: Some(SessionTag {
                        id: u128::MAX - 3,
                        seq: 9,
                        opens: true,
                        time_ms: 1_764_000_000_000,
                    }),
                    if_absent: false,
                },
                WriteOp {
                    value: None,
                    namespace: 3,
                    epoch: 7,
                    key: [2; 32],
                    name: Vec::new(),
                    session: None,
                    if_absent: false,
                },
                WriteOp {
                    value: Some(Vec::new()),
                    namespace: 4,
                    epoch: 8,
                    key: [3; 32],
                    name: vec![0xff; 1024],
                    session: None,
                    if_absent: false,
                },
            ]),
            Command::Touch {
                namespace: 9,
                epoch: 3,
                key: [4; 32],
                session: Some(SessionTag {
                    id: 1,
                    seq: 2,
                    opens: false,
                    time_ms: 3,
                }),
            },
            Command::Touch {
                namespace: 9,
                epoch: 3,
                key: [4; 32],
                session: None,
            },
            Command::AdvanceEpoch(12),
            Command::DropEpochs {
                namespace: 2,
                below: 5,
            },
            Command::Noop,
            Command::Split {
                child: 7,
                at: 1 << 63,
            },
            Command::Retain {
                namespace: 4,
                epochs: 3,
                map_version: 1 << 40,
            },
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
    fn version_1_commands_without_sessions_still_decode() {
        // A Write of one delete and a Touch, as version 1 wrote them.
        let mut write = vec![1, 1, 1, 0, 0, 0, 2];
        write.extend_from_slice(&3u32.to_le_bytes());
        write.extend_from_slice(&7u32.to_le_bytes());
        write.extend_from_slice(&[2; 32]);
        write.extend_from_slice(&0u32.to_le_bytes());
        let op = WriteOp {
            value: None,
            namespace: 3,
            epoch: 7,
            key: [2; 32],
            name: Vec::new(),
            session: None,
            if_absent: false,
        };
        assert_eq!(Command::decode(&write).unwrap(), Command::Write(vec![op]));
        let mut touch = vec![1, 2];
        touch.extend_from_slice(&9u32.to_le_bytes());
        touch.extend_from_slice(&3u32.to_le_bytes());
        touch.extend_from_slice(&[4; 32]);
        let expected = Command::Touch {
            namespace: 9,
            epoch: 3,
            key: [4; 32],
            session: None,
        };
        assert_eq!(Command::decode(&touch).unwrap(), expected);
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
        assert!(Command::decode(&[3, 1]).is_err());
        // A count far larger than the bytes fails cleanly.
        assert!(Command::decode(&[1, 1, 255, 255, 255, 255]).is_err());
    }
}
