//! Byte layout of log records and of the items inside entry records.
//!
//! All integers are little-endian; records and items start on 8-byte
//! boundaries. See `docs/design/wal-format.md` for the whole picture.
//!
//! ```text
//! record header (16 bytes)
//!   0  u32  body_len       bytes of body after the header
//!   4  u8   kind           1 pad, 2 segment header, 3 entry, 4 index blob,
//!                          5 sync mark, 6 single entry (below)
//!   5  u8   flags          entries: APPLIED, RELOCATED
//!   6  u16  item_count     entries: number of items
//!   8  u32  crc            see `record_crc`
//!  12  u32  meta_len       entries: bytes of opaque metadata before the items
//! entry body
//!   meta (meta_len bytes, padded to 8), then item_count items
//! item (32-byte header, key, value, padded to 8)
//!   0  u8   op             1 put, 2 delete, 3 touch (value empty:
//!                          moves the entry of `version` to `epoch`)
//!   1  u8   key_space
//!   2  u8   key_len
//!   3  u8   reserved (0)
//!   4  u32  value_len
//!   8  u32  epoch
//!  12  u32  tag
//!  16  u64  version        0: the item's own position; else the position of
//!                          the write it is a copy of (relocation)
//!  24  u32  crc            CRC32 of the header (crc field zeroed), key, value
//!  28  u32  reserved (0)
//! single entry (24-byte header, meta, key, value, padded to 8): an entry of
//! one new put or delete (version 0) with at most 64 KiB of metadata
//!   0  u32  body_len       bytes after byte 16, padding included (so a
//!                          multiple of 8: its first byte is never an item op)
//!   4  u8   kind           6
//!   5  u8   flags
//!   6  u8   op             1 put, 2 delete
//!   7  u8   key_space
//!   8  u32  crc            CRC32 of the position, bytes 0..8 and 12..end of
//!                          the value
//!  12  u8   key_len
//!  13  u8   pad            zero bytes after the value (0..=7)
//!  14  u16  meta_len
//!  16  u32  epoch
//!  20  u32  tag
//! ```
//!
//! The record CRC covers the record's position, its header (without the crc
//! field) and, for entries, the metadata and every item header — which hold
//! the item CRCs, so the record CRC transitively covers every byte while the
//! values are hashed only once. Any other record's CRC covers its whole body.
//! A value can therefore be read and verified alone (one small read), and a
//! torn or misplaced record is always detected. A single entry is its own
//! item: its one CRC covers position, header, metadata, key and value, and
//! its item location is the record's position. It spends 24 bytes of
//! headers on a value instead of 48.

mod gather;
mod single;

use crate::types::{Epoch, MAX_KEY_BYTES, Tag, WalPosition};

pub(crate) use gather::{Gathered, gather_entry};
pub(crate) use single::SINGLE_HEADER_BYTES;
use single::SINGLE_KIND;

/// Bytes of a record header.
pub(crate) const RECORD_HEADER_BYTES: usize = 16;
/// Bytes of an item header.
pub(crate) const ITEM_HEADER_BYTES: usize = 32;

/// Record kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// The rest of the segment is unused.
    Pad = 1,
    /// First record of every segment.
    SegmentHeader = 2,
    /// Metadata and items (puts, deletes); a single entry (kind byte 6)
    /// decodes as one too.
    Entry = 3,
    /// A flushed cell index (index log only).
    IndexBlob = 4,
    /// "Everything below this position was synced": body is the position,
    /// u64. Written after syncs, it lets recovery tell damage to synced
    /// data from a torn tail.
    SyncMark = 5,
}

impl Kind {
    fn from_u8(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Pad,
            2 => Kind::SegmentHeader,
            3 => Kind::Entry,
            4 => Kind::IndexBlob,
            5 => Kind::SyncMark,
            _ => return None,
        })
    }
}

/// Entry flag: the engine applied the items to the index when it wrote them,
/// so recovery replays them.
pub(crate) const FLAG_APPLIED: u8 = 1;
/// Entry flag: the items are relocated copies; recovery skips them (the
/// originals stay until a snapshot no longer needs them).
pub(crate) const FLAG_RELOCATED: u8 = 2;

/// Operation of an item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Store the value under the key.
    Put = 1,
    /// Delete the key (a tombstone).
    Delete = 2,
    /// Move the entry whose version is the item's `version` into the
    /// item's `epoch` (no value; applied only if that entry is current).
    Touch = 3,
}

/// Rounds up to the next multiple of 8.
pub(crate) fn align8(n: usize) -> usize {
    (n + 7) & !7
}

/// An item to be written.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ItemSpec<'a> {
    pub op: Op,
    pub key_space: u8,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub epoch: Epoch,
    pub tag: Tag,
    /// 0 for a new write; the original position for a relocated copy.
    pub version: u64,
}

impl ItemSpec<'_> {
    /// Bytes the item occupies, unpadded.
    pub fn len(&self) -> usize {
        ITEM_HEADER_BYTES + self.key.len() + self.value.len()
    }
}

/// Bytes a record with a body of `body_len` occupies, padding included.
pub(crate) fn record_len(body_len: usize) -> usize {
    align8(RECORD_HEADER_BYTES + body_len)
}

/// Body length of a multi-item entry with this metadata and these items.
fn entry_body_len(meta_len: usize, items: &[ItemSpec<'_>]) -> usize {
    align8(meta_len) + items.iter().map(|i| align8(i.len())).sum::<usize>()
}

/// Bytes an entry record with this metadata and these items occupies,
/// padding included.
pub(crate) fn entry_record_len(meta_len: usize, items: &[ItemSpec<'_>]) -> usize {
    match single::as_single(meta_len, items) {
        Some(item) => single::record_len(meta_len, item),
        None => record_len(entry_body_len(meta_len, items)),
    }
}

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn get_u64(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

/// A decoded record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub body_len: u32,
    pub kind: Kind,
    pub flags: u8,
    pub item_count: u16,
    pub crc: u32,
    pub meta_len: u32,
    /// A single entry (kind byte 6): one item, its own header layout.
    pub single: bool,
}

/// What a header's bytes say.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeaderRead {
    /// All zero: never written (end of data).
    Unwritten,
    /// Not a valid header (unknown kind).
    Invalid,
    /// A header; its CRC is checked with the body.
    Header(RecordHeader),
}

impl RecordHeader {
    pub fn decode(bytes: &[u8]) -> HeaderRead {
        // Callers read whole headers; fewer bytes are no header (found by
        // the decoder fuzzing).
        let Some(bytes) = bytes.get(..RECORD_HEADER_BYTES) else {
            return HeaderRead::Invalid;
        };
        if bytes.iter().all(|&b| b == 0) {
            return HeaderRead::Unwritten;
        }
        if bytes[4] == SINGLE_KIND {
            let body_len = get_u32(bytes, 0);
            if !body_len.is_multiple_of(8)
                || (body_len as usize) < SINGLE_HEADER_BYTES - RECORD_HEADER_BYTES
            {
                return HeaderRead::Invalid;
            }
            return HeaderRead::Header(RecordHeader {
                body_len,
                kind: Kind::Entry,
                flags: bytes[5],
                item_count: 1,
                crc: get_u32(bytes, 8),
                meta_len: u32::from(u16::from_le_bytes([bytes[14], bytes[15]])),
                single: true,
            });
        }
        let Some(kind) = Kind::from_u8(bytes[4]) else {
            return HeaderRead::Invalid;
        };
        HeaderRead::Header(RecordHeader {
            body_len: get_u32(bytes, 0),
            kind,
            flags: bytes[5],
            item_count: u16::from_le_bytes([bytes[6], bytes[7]]),
            crc: get_u32(bytes, 8),
            meta_len: get_u32(bytes, 12),
            single: false,
        })
    }

    fn encode_without_crc(&self, out: &mut [u8]) {
        put_u32(out, 0, self.body_len);
        out[4] = self.kind as u8;
        out[5] = self.flags;
        out[6..8].copy_from_slice(&self.item_count.to_le_bytes());
        put_u32(out, 8, 0);
        put_u32(out, 12, self.meta_len);
    }

    /// Total bytes of the record, padding included.
    pub fn record_len(&self) -> usize {
        record_len(self.body_len as usize)
    }
}

/// Starts the record CRC: position and header (crc field excluded).
fn crc_start(position: WalPosition, header: &[u8]) -> crc32fast::Hasher {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&position.0.to_le_bytes());
    hasher.update(&header[0..8]);
    hasher.update(&header[12..16]);
    hasher
}

/// Writes a non-entry record (pad, segment header, index blob) into `buf`,
/// which must be exactly `record_len(body.len())` bytes (or, for a pad, the
/// whole rest of the segment: the body is then left as it is).
pub(crate) fn write_plain(buf: &mut [u8], position: WalPosition, kind: Kind, body: &[u8]) {
    let header = RecordHeader {
        body_len: body.len() as u32,
        kind,
        flags: 0,
        item_count: 0,
        crc: 0,
        meta_len: 0,
        single: false,
    };
    let (head, rest) = buf.split_at_mut(RECORD_HEADER_BYTES);
    rest[..body.len()].copy_from_slice(body);
    rest[body.len()..align8(body.len())].fill(0);
    header.encode_without_crc(head);
    let mut hasher = crc_start(position, head);
    hasher.update(body);
    put_u32(head, 8, hasher.finalize());
}

/// Writes a pad record claiming the rest of a segment. `buf` is at least
/// `RECORD_HEADER_BYTES` long; the bytes after the header are not touched.
pub(crate) fn write_pad(buf: &mut [u8], position: WalPosition) {
    write_plain(&mut buf[..RECORD_HEADER_BYTES], position, Kind::Pad, &[]);
}

/// Where an item landed: its position and unpadded length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ItemLocation {
    pub position: WalPosition,
    pub len: u32,
}

/// Writes an entry record into `buf` (exactly `entry_record_len` bytes) at
/// `position`; returns where each item landed.
pub(crate) fn write_entry(
    buf: &mut [u8],
    position: WalPosition,
    flags: u8,
    meta: &[u8],
    items: &[ItemSpec<'_>],
) -> Vec<ItemLocation> {
    debug_assert_eq!(buf.len(), entry_record_len(meta.len(), items));
    if let Some(item) = single::as_single(meta.len(), items) {
        return vec![single::write(buf, position, flags, meta, item)];
    }
    let (head, body) = buf.split_at_mut(RECORD_HEADER_BYTES);
    head.copy_from_slice(&entry_header(flags, meta.len(), items));
    let mut record_crc = crc_start(position, head);
    let meta_padded = align8(meta.len());
    body[..meta.len()].copy_from_slice(meta);
    body[meta.len()..meta_padded].fill(0);
    record_crc.update(meta);
    let mut locations = Vec::with_capacity(items.len());
    let mut at = meta_padded;
    for item in items {
        let item_len = item.len();
        let slot = &mut body[at..at + align8(item_len)];
        write_item(slot, item);
        record_crc.update(&slot[..ITEM_HEADER_BYTES]);
        let item_position = position.plus((RECORD_HEADER_BYTES + at) as u64);
        locations.push(ItemLocation {
            position: item_position,
            len: item_len as u32,
        });
        at += align8(item_len);
    }
    put_u32(head, 8, record_crc.finalize());
    locations
}

/// The header of `item`, its crc field zero.
fn item_header(item: &ItemSpec<'_>) -> [u8; ITEM_HEADER_BYTES] {
    let mut head = [0u8; ITEM_HEADER_BYTES];
    head[0] = item.op as u8;
    head[1] = item.key_space;
    head[2] = item.key.len() as u8;
    put_u32(&mut head, 4, item.value.len() as u32);
    put_u32(&mut head, 8, item.epoch.0);
    put_u32(&mut head, 12, item.tag.0);
    put_u64(&mut head, 16, item.version);
    head
}

/// The header of a multi-item entry (crc field zero) with this metadata
/// and these items.
fn entry_header(flags: u8, meta_len: usize, items: &[ItemSpec<'_>]) -> [u8; RECORD_HEADER_BYTES] {
    let header = RecordHeader {
        body_len: entry_body_len(meta_len, items) as u32,
        kind: Kind::Entry,
        flags,
        item_count: items.len() as u16,
        crc: 0,
        meta_len: meta_len as u32,
        single: false,
    };
    let mut head = [0u8; RECORD_HEADER_BYTES];
    header.encode_without_crc(&mut head);
    head
}

/// Writes one item (header, key, value, zero padding) into `slot`.
fn write_item(slot: &mut [u8], item: &ItemSpec<'_>) {
    let key_end = ITEM_HEADER_BYTES + item.key.len();
    let value_end = key_end + item.value.len();
    slot[..ITEM_HEADER_BYTES].copy_from_slice(&item_header(item));
    slot[ITEM_HEADER_BYTES..key_end].copy_from_slice(item.key);
    slot[key_end..value_end].copy_from_slice(item.value);
    slot[value_end..].fill(0);
    let crc = crc32fast::hash(&slot[..value_end]);
    put_u32(slot, 24, crc);
}

/// A decoded, checksum-verified item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Item<'a> {
    pub op: Op,
    pub key_space: u8,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub epoch: Epoch,
    pub tag: Tag,
    pub version: u64,
    /// Bytes from the item's location to the end of its value: what a read
    /// of the item alone fetches.
    pub len: usize,
}

/// Why bytes are not a valid item or record.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Malformed(pub String);

/// Decodes and verifies the item at `position` from `bytes` (which may
/// extend past it): an item of a multi-item entry, or a single entry (an
/// item's first byte is its op, 1 to 3; a single entry's is a multiple of
/// 8).
pub(crate) fn decode_item(position: WalPosition, bytes: &[u8]) -> Result<Item<'_>, Malformed> {
    match bytes.first() {
        Some(1..=3) => decode_listed_item(bytes),
        _ => single::decode(position, bytes),
    }
}

/// Where an item's key and value lie, read from its header alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ItemSpan {
    pub op: Op,
    /// Offset of the key from the item's location.
    pub key_at: usize,
    pub key_len: usize,
    /// Offset of the value from the item's location.
    pub value_at: usize,
    pub value_len: usize,
}

impl ItemSpan {
    /// Bytes from the item's location to the end of its value.
    pub fn len(&self) -> usize {
        self.value_at + self.value_len
    }
}

/// The span of the item (or single entry) at the start of `bytes`, from
/// its header alone: `bytes` need not hold the value, and nothing is
/// verified but that the lengths are possible (a caller reading part of an
/// item cannot check its CRC).
pub(crate) fn item_span(bytes: &[u8]) -> Result<ItemSpan, Malformed> {
    let (op, key_at, key_len, value_at, value_len) = match bytes.first() {
        Some(1..=3) if bytes.len() >= ITEM_HEADER_BYTES => {
            let key_len = usize::from(bytes[2]);
            let value_at = ITEM_HEADER_BYTES + key_len;
            (
                bytes[0],
                ITEM_HEADER_BYTES,
                key_len,
                value_at,
                get_u32(bytes, 4) as usize,
            )
        }
        Some(_) if bytes.len() >= SINGLE_HEADER_BYTES && bytes[4] == SINGLE_KIND => {
            let body_len = get_u32(bytes, 0) as usize;
            let key_len = usize::from(bytes[12]);
            let pad = usize::from(bytes[13]);
            let meta_len = usize::from(u16::from_le_bytes([bytes[14], bytes[15]]));
            let key_at = SINGLE_HEADER_BYTES + meta_len;
            let value_at = key_at + key_len;
            let value_len = (RECORD_HEADER_BYTES + body_len)
                .checked_sub(pad + value_at)
                .ok_or_else(|| Malformed(format!("single entry of body {body_len}")))?;
            (bytes[6], key_at, key_len, value_at, value_len)
        }
        _ => return Err(Malformed("no item header".into())),
    };
    let op = match op {
        1 => Op::Put,
        2 => Op::Delete,
        3 => Op::Touch,
        other => return Err(Malformed(format!("unknown item op {other}"))),
    };
    if key_len == 0 || key_len > MAX_KEY_BYTES {
        return Err(Malformed(format!("item key length {key_len}")));
    }
    Ok(ItemSpan {
        op,
        key_at,
        key_len,
        value_at,
        value_len,
    })
}

/// Decodes and verifies one item of a multi-item entry from `bytes` (which
/// may extend past it).
fn decode_listed_item(bytes: &[u8]) -> Result<Item<'_>, Malformed> {
    if bytes.len() < ITEM_HEADER_BYTES {
        return Err(Malformed(format!(
            "item header needs 32 bytes, {} left",
            bytes.len()
        )));
    }
    let op = match bytes[0] {
        1 => Op::Put,
        2 => Op::Delete,
        3 => Op::Touch,
        other => return Err(Malformed(format!("unknown item op {other}"))),
    };
    let key_len = usize::from(bytes[2]);
    let value_len = get_u32(bytes, 4) as usize;
    if key_len == 0 || key_len > MAX_KEY_BYTES {
        return Err(Malformed(format!("item key length {key_len}")));
    }
    let end = ITEM_HEADER_BYTES + key_len + value_len;
    if bytes.len() < end {
        return Err(Malformed(format!(
            "item of {end} bytes, {} left",
            bytes.len()
        )));
    }
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&bytes[..24]);
    hasher.update(&[0u8; 4]);
    hasher.update(&bytes[28..end]);
    let stored = get_u32(bytes, 24);
    if hasher.finalize() != stored {
        return Err(Malformed("item checksum mismatch".into()));
    }
    let key_start = ITEM_HEADER_BYTES;
    let item = Item {
        op,
        key_space: bytes[1],
        key: &bytes[key_start..key_start + key_len],
        value: &bytes[key_start + key_len..end],
        epoch: Epoch(get_u32(bytes, 8)),
        tag: Tag(get_u32(bytes, 12)),
        version: get_u64(bytes, 16),
        len: end,
    };
    Ok(item)
}

/// A verified record read back from a log.
#[derive(Debug)]
pub(crate) struct RecordView<'a> {
    pub header: RecordHeader,
    pub body: &'a [u8],
    /// The record's bytes from its header to the end of its body.
    record: &'a [u8],
}

impl<'a> RecordView<'a> {
    /// Verifies `bytes` (a whole record, header first) read at `position`.
    pub fn verify(position: WalPosition, bytes: &'a [u8]) -> Result<RecordView<'a>, Malformed> {
        let header = match RecordHeader::decode(bytes) {
            HeaderRead::Header(h) => h,
            HeaderRead::Unwritten => return Err(Malformed("unwritten".into())),
            HeaderRead::Invalid => return Err(Malformed("invalid record header".into())),
        };
        let body_end = RECORD_HEADER_BYTES + header.body_len as usize;
        if bytes.len() < body_end && header.kind != Kind::Pad {
            return Err(Malformed(format!(
                "record body of {} bytes is cut short",
                header.body_len
            )));
        }
        let body = if header.kind == Kind::Pad {
            &[][..]
        } else {
            &bytes[RECORD_HEADER_BYTES..body_end]
        };
        if header.single {
            single::decode(position, bytes)?;
            return Ok(RecordView {
                header,
                body,
                record: &bytes[..body_end],
            });
        }
        let mut hasher = crc_start(position, bytes);
        if header.kind == Kind::Entry {
            Self::hash_entry(&header, body, &mut hasher)?;
        } else if header.kind != Kind::Pad {
            hasher.update(body);
        }
        if hasher.finalize() != header.crc {
            return Err(Malformed("record checksum mismatch".into()));
        }
        Ok(RecordView {
            header,
            body,
            record: &bytes[..body_end.min(bytes.len())],
        })
    }

    fn hash_entry(
        header: &RecordHeader,
        body: &[u8],
        hasher: &mut crc32fast::Hasher,
    ) -> Result<(), Malformed> {
        let meta_len = header.meta_len as usize;
        if align8(meta_len) > body.len() {
            return Err(Malformed(format!(
                "entry metadata of {meta_len} bytes overruns the body"
            )));
        }
        hasher.update(&body[..meta_len]);
        let mut at = align8(meta_len);
        for _ in 0..header.item_count {
            // The previous item's padding may end past the body.
            let rest = body
                .get(at..)
                .ok_or_else(|| Malformed("entry items overrun the body".into()))?;
            let item = decode_listed_item(rest)?;
            hasher.update(&rest[..ITEM_HEADER_BYTES]);
            at += align8(item.len);
        }
        if at != body.len() {
            return Err(Malformed("entry body has trailing bytes".into()));
        }
        Ok(())
    }

    /// An entry's opaque metadata.
    pub fn meta(&self) -> &'a [u8] {
        let at = if self.header.single {
            SINGLE_HEADER_BYTES - RECORD_HEADER_BYTES
        } else {
            0
        };
        &self.body[at..at + self.header.meta_len as usize]
    }

    /// An entry's items with their offsets from the record start (0 for a
    /// single entry: it is its own item). The record was verified, so
    /// decoding cannot fail.
    pub fn items(&self) -> impl Iterator<Item = (usize, Item<'a>)> + 'a {
        let body = self.body;
        let single = self
            .header
            .single
            .then(|| (0, single::parse(self.record).expect("verified record")));
        let mut at = align8(self.header.meta_len as usize);
        let count = if self.header.kind == Kind::Entry && !self.header.single {
            self.header.item_count
        } else {
            0
        };
        let listed = (0..count).map(move |_| {
            let item = decode_listed_item(&body[at..]).expect("verified record");
            let offset = RECORD_HEADER_BYTES + at;
            at += align8(item.len);
            (offset, item)
        });
        single.into_iter().chain(listed)
    }
}

#[cfg(test)]
mod tests;
