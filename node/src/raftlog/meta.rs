//! How Raft entries and Raft state are laid out in engine records.
//!
//! ```text
//! entry record metadata:
//!   "RE", version u8 (1), entry type u8, index u64, term u64,
//!   context len u32 + context,
//!   data kind u8 (0: raw — data follows; 1: Write — data is rebuilt from
//!   the record's items; 2: Write with sessions — as 1, followed by count
//!   u32 and each op's session (u8 0, or u8 1 + tag, as in `command.rs`);
//!   3: as 2, then each op's flags u8 (bit 0: put only if absent) —
//!   written only when an op has a flag; 4: as 3, flags always, then each
//!   op's name, len u16 + bytes — written when an op has a name),
//!   [data len u32 + data]
//! state record metadata:
//!   "RS", version u8 (1), term u64, vote u64, commit u64,
//!   voters, learners, voters_outgoing, learners_next (count u32 + u64s),
//!   auto_leave u8, conf index u64 (the entry that made this configuration;
//!   the shard's `conf_version`)
//! ```
//! A Write's values travel as the record's items, never in the metadata.

use raft::eraftpb::{ConfState, Entry, EntryType, HardState};
use tidepool_engine::{Epoch, ItemData, ItemInput, ItemOp, KeySpace, Tag};

use crate::command::{Command, KEY_BYTES, Reader, WriteOp, encode_session};
use crate::error::{NodeError, Result};
use crate::session::SessionTag;

const ENTRY_MAGIC: &[u8; 2] = b"RE";
const STATE_MAGIC: &[u8; 2] = b"RS";
const VERSION: u8 = 1;
const DATA_RAW: u8 = 0;
/// A Write written before sessions (still read).
const DATA_WRITE: u8 = 1;
const DATA_WRITE_SESSIONS: u8 = 2;
const DATA_WRITE_FLAGS: u8 = 3;
const DATA_WRITE_NAMES: u8 = 4;
/// Op flag: a put only if the key holds no blob.
const FLAG_IF_ABSENT: u8 = 1;

/// A Raft entry split for the WAL: metadata, and the Write ops whose values
/// become the record's items.
#[derive(Debug)]
pub(crate) struct SplitEntry {
    pub meta: Vec<u8>,
    pub ops: Vec<WriteOp>,
}

/// What an application record's metadata says.
#[derive(Debug)]
pub(crate) enum LogRecord {
    /// A Raft entry (its data not yet rebuilt).
    Entry(EntryHead),
    /// Hard state and configuration.
    State(HardState, ConfState, u64),
}

/// The index and term of an entry record, and what is needed to rebuild it.
#[derive(Debug)]
pub(crate) struct EntryHead {
    pub entry_type: i32,
    pub index: u64,
    pub term: u64,
    pub context: Vec<u8>,
    /// `None` for a Write (rebuilt from items), else the raw data.
    pub raw_data: Option<Vec<u8>>,
    /// A Write's sessions, one per op (empty: written before sessions).
    pub sessions: Vec<Option<SessionTag>>,
    /// A Write's ops that put only if absent (empty: none does).
    pub if_absent: Vec<bool>,
    /// A Write's names, one per op (empty: none has one).
    pub names: Vec<Vec<u8>>,
}

/// Splits an entry: a normal entry carrying a Write keeps only its
/// metadata, the ops go to the items.
pub(crate) fn split_entry(entry: &Entry) -> Result<SplitEntry> {
    let mut meta = Vec::with_capacity(32 + entry.context.len());
    meta.extend_from_slice(ENTRY_MAGIC);
    meta.push(VERSION);
    meta.push(entry.entry_type as u8);
    meta.extend_from_slice(&entry.index.to_le_bytes());
    meta.extend_from_slice(&entry.term.to_le_bytes());
    meta.extend_from_slice(&(entry.context.len() as u32).to_le_bytes());
    meta.extend_from_slice(&entry.context);
    let write = (entry.entry_type == EntryType::EntryNormal as i32 && !entry.data.is_empty())
        .then(|| Command::decode(&entry.data))
        .transpose()?;
    match write {
        Some(Command::Write(ops)) => {
            let names = ops.iter().any(|op| !op.name.is_empty());
            let flags = names || ops.iter().any(|op| op.if_absent);
            meta.push(if names {
                DATA_WRITE_NAMES
            } else if flags {
                DATA_WRITE_FLAGS
            } else {
                DATA_WRITE_SESSIONS
            });
            meta.extend_from_slice(&(ops.len() as u32).to_le_bytes());
            for op in &ops {
                encode_session(op.session.as_ref(), &mut meta);
            }
            if flags {
                meta.extend(
                    ops.iter()
                        .map(|op| if op.if_absent { FLAG_IF_ABSENT } else { 0 }),
                );
            }
            if names {
                for op in &ops {
                    meta.extend_from_slice(&(op.name.len() as u16).to_le_bytes());
                    meta.extend_from_slice(&op.name);
                }
            }
            Ok(SplitEntry { meta, ops })
        }
        _ => {
            meta.push(DATA_RAW);
            meta.extend_from_slice(&(entry.data.len() as u32).to_le_bytes());
            meta.extend_from_slice(&entry.data);
            Ok(SplitEntry {
                meta,
                ops: Vec::new(),
            })
        }
    }
}

/// The engine items of Write ops, in the blob key space.
pub(crate) fn items<'a>(space: KeySpace, ops: &'a [WriteOp]) -> Vec<ItemInput<'a>> {
    ops.iter()
        .map(|op| ItemInput {
            space,
            op: if op.value.is_some() {
                ItemOp::Put
            } else {
                ItemOp::Delete
            },
            key: &op.key,
            value: op.value.as_deref().unwrap_or(&[]),
            epoch: Epoch(op.epoch),
            tag: Tag(op.namespace),
        })
        .collect()
}

/// Reads an application record's metadata.
pub(crate) fn parse(meta: &[u8]) -> Result<LogRecord> {
    let mut r = Reader { bytes: meta, at: 0 };
    let magic = r.take(2)?;
    let version = r.u8()?;
    if version != VERSION {
        return Err(NodeError::Malformed(format!(
            "raft record version {version}"
        )));
    }
    let record = if magic == ENTRY_MAGIC {
        LogRecord::Entry(parse_entry(&mut r)?)
    } else if magic == STATE_MAGIC {
        let (hs, cs, conf_index) = parse_state(&mut r)?;
        LogRecord::State(hs, cs, conf_index)
    } else {
        return Err(NodeError::Malformed("not a raft record".into()));
    };
    if r.at != meta.len() {
        return Err(NodeError::Malformed(
            "trailing bytes in a raft record".into(),
        ));
    }
    Ok(record)
}

fn parse_entry(r: &mut Reader<'_>) -> Result<EntryHead> {
    let entry_type = i32::from(r.u8()?);
    let index = r.u64()?;
    let term = r.u64()?;
    let context_len = r.u32()? as usize;
    let context = r.take(context_len)?.to_vec();
    let mut sessions = Vec::new();
    let mut if_absent = Vec::new();
    let mut names = Vec::new();
    let raw_data = match r.u8()? {
        DATA_WRITE => None,
        kind @ (DATA_WRITE_SESSIONS | DATA_WRITE_FLAGS | DATA_WRITE_NAMES) => {
            let count = r.u32()? as usize;
            sessions.reserve(count.min(r.bytes.len()));
            for _ in 0..count {
                sessions.push(r.session()?);
            }
            if kind != DATA_WRITE_SESSIONS {
                for flags in r.take(count)? {
                    if flags & !FLAG_IF_ABSENT != 0 {
                        return Err(NodeError::Malformed(format!("unknown op flags {flags:#x}")));
                    }
                    if_absent.push(flags & FLAG_IF_ABSENT != 0);
                }
            }
            if kind == DATA_WRITE_NAMES {
                names.reserve(count);
                for _ in 0..count {
                    let len = r.u16()? as usize;
                    names.push(r.take(len)?.to_vec());
                }
            }
            None
        }
        DATA_RAW => {
            let len = r.u32()? as usize;
            Some(r.take(len)?.to_vec())
        }
        other => return Err(NodeError::Malformed(format!("entry data kind {other}"))),
    };
    Ok(EntryHead {
        entry_type,
        index,
        term,
        context,
        raw_data,
        sessions,
        if_absent,
        names,
    })
}

/// Rebuilds an entry from its metadata and its record's items.
pub(crate) fn rebuild_entry(head: EntryHead, items: Vec<ItemData>) -> Result<Entry> {
    let data = match head.raw_data {
        Some(data) => data,
        None => {
            if !head.sessions.is_empty() && head.sessions.len() != items.len() {
                return Err(NodeError::Malformed(format!(
                    "entry {} names {} sessions for {} items",
                    head.index,
                    head.sessions.len(),
                    items.len()
                )));
            }
            let ops = items
                .into_iter()
                .enumerate()
                .map(|(i, item)| {
                    let key: [u8; KEY_BYTES] = item.key.try_into().map_err(|_| {
                        NodeError::Malformed("entry item key is not 32 bytes".into())
                    })?;
                    Ok(WriteOp {
                        value: (item.op == ItemOp::Put).then_some(item.value),
                        namespace: item.tag.0,
                        epoch: item.epoch.0,
                        key,
                        name: head.names.get(i).cloned().unwrap_or_default(),
                        session: head.sessions.get(i).copied().flatten(),
                        if_absent: head.if_absent.get(i).copied().unwrap_or(false),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Command::Write(ops).encode()
        }
    };
    Ok(Entry {
        entry_type: head.entry_type,
        term: head.term,
        index: head.index,
        data,
        context: head.context,
        ..Entry::default()
    })
}

/// Encodes a state record's metadata.
pub(crate) fn encode_state(hs: &HardState, cs: &ConfState, conf_index: u64) -> Vec<u8> {
    let mut meta = Vec::with_capacity(64);
    meta.extend_from_slice(STATE_MAGIC);
    meta.push(VERSION);
    for v in [hs.term, hs.vote, hs.commit] {
        meta.extend_from_slice(&v.to_le_bytes());
    }
    for list in [
        &cs.voters,
        &cs.learners,
        &cs.voters_outgoing,
        &cs.learners_next,
    ] {
        meta.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for id in list {
            meta.extend_from_slice(&id.to_le_bytes());
        }
    }
    meta.push(u8::from(cs.auto_leave));
    meta.extend_from_slice(&conf_index.to_le_bytes());
    meta
}

fn parse_state(r: &mut Reader<'_>) -> Result<(HardState, ConfState, u64)> {
    let hs = HardState {
        term: r.u64()?,
        vote: r.u64()?,
        commit: r.u64()?,
    };
    let mut lists: [Vec<u64>; 4] = Default::default();
    for list in &mut lists {
        let count = r.u32()? as usize;
        if count > r.bytes.len() / 8 {
            return Err(NodeError::Malformed(
                "conf state count exceeds the record".into(),
            ));
        }
        for _ in 0..count {
            list.push(r.u64()?);
        }
    }
    let [voters, learners, voters_outgoing, learners_next] = lists;
    let cs = ConfState {
        voters,
        learners,
        voters_outgoing,
        learners_next,
        auto_leave: r.u8()? != 0,
    };
    Ok((hs, cs, r.u64()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(data: Vec<u8>, entry_type: EntryType) -> Entry {
        Entry {
            entry_type: entry_type as i32,
            term: 3,
            index: 17,
            data,
            context: b"ctx".to_vec(),
            ..Entry::default()
        }
    }

    fn item_data(ops: &[WriteOp]) -> Vec<ItemData> {
        items(KeySpace::default(), ops)
            .iter()
            .map(|i| ItemData {
                space: i.space,
                op: i.op,
                key: i.key.to_vec(),
                value: i.value.to_vec(),
                epoch: i.epoch,
                tag: i.tag,
            })
            .collect()
    }

    #[test]
    fn a_write_entry_is_rebuilt_byte_for_byte_from_metadata_and_items() {
        let write = Command::Write(vec![
            WriteOp {
                value: Some(vec![9; 100]),
                namespace: 2,
                epoch: 4,
                key: [7; 32],
                name: b"a name".to_vec(),
                session: Some(SessionTag {
                    id: 11,
                    seq: 12,
                    opens: true,
                    time_ms: 13,
                }),
                if_absent: true,
            },
            WriteOp {
                value: None,
                namespace: 2,
                epoch: 4,
                key: [8; 32],
                name: Vec::new(),
                session: None,
                if_absent: false,
            },
        ]);
        let original = entry(write.encode(), EntryType::EntryNormal);
        let split = split_entry(&original).unwrap();
        assert_eq!(split.ops.len(), 2);
        assert!(split.meta.len() < 100, "values stay out of the metadata");
        let LogRecord::Entry(head) = parse(&split.meta).unwrap() else {
            panic!("entry")
        };
        assert_eq!(
            rebuild_entry(head, item_data(&split.ops)).unwrap(),
            original
        );
    }

    #[test]
    fn a_write_record_from_before_sessions_is_rebuilt_without_them() {
        let op = WriteOp {
            value: Some(vec![1; 10]),
            namespace: 2,
            epoch: 4,
            key: [7; 32],
            name: Vec::new(),
            session: None,
            if_absent: false,
        };
        let original = entry(
            Command::Write(vec![op.clone()]).encode(),
            EntryType::EntryNormal,
        );
        let mut meta = split_entry(&original).unwrap().meta;
        // Version-1 metadata: data kind 1 and nothing after it.
        let kind_at = meta.len() - 4 - 1 - 1;
        assert_eq!(meta[kind_at], DATA_WRITE_SESSIONS);
        meta.truncate(kind_at);
        meta.push(DATA_WRITE);
        let LogRecord::Entry(head) = parse(&meta).unwrap() else {
            panic!("entry")
        };
        assert_eq!(rebuild_entry(head, item_data(&[op])).unwrap(), original);
    }

    #[test]
    fn other_entries_keep_their_data_raw() {
        for original in [
            entry(Vec::new(), EntryType::EntryNormal),
            entry(Command::AdvanceEpoch(5).encode(), EntryType::EntryNormal),
            entry(b"conf change bytes".to_vec(), EntryType::EntryConfChangeV2),
        ] {
            let split = split_entry(&original).unwrap();
            assert!(split.ops.is_empty());
            let LogRecord::Entry(head) = parse(&split.meta).unwrap() else {
                panic!("entry")
            };
            assert_eq!(rebuild_entry(head, Vec::new()).unwrap(), original);
        }
    }

    #[test]
    fn state_round_trips_and_damage_is_an_error() {
        let hs = HardState {
            term: 5,
            vote: 2,
            commit: 40,
        };
        let cs = ConfState {
            voters: vec![1, 2, 3],
            learners: vec![4],
            voters_outgoing: vec![],
            learners_next: vec![],
            auto_leave: true,
        };
        let meta = encode_state(&hs, &cs, 17);
        let LogRecord::State(h, c, i) = parse(&meta).unwrap() else {
            panic!("state")
        };
        assert_eq!((h, c, i), (hs, cs, 17));
        for cut in 0..meta.len() {
            assert!(parse(&meta[..cut]).is_err(), "cut at {cut}");
        }
    }
}
