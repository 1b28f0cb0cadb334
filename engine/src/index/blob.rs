//! An index blob: one layer of a cell's on-disk index, appended to the
//! index log as one record: a small header, the blob's bloom filter, then
//! the sorted fixed-size entries. A *base* blob is a whole index (live
//! entries only); a *delta* blob holds the changes of one flush over it,
//! tombstones included. A lookup reads a window of entries straight from
//! the log without a directory (see `lookup.rs`).
//!
//! ```text
//! 0   [u8; 4]  magic "TPIX"
//! 4   u32      entry count
//! 8   u16      key length
//! 10  u16      entry size
//! 12  u32      bloom bytes
//! 16  u32      CRC32 of the bloom bytes (a lookup may read the bloom
//!              alone, without the record's checksum)
//! 20  u32      kind: 0 base, 1 delta (version 1 of the format had only
//!              bases, with 0 here)
//! 24  bloom    (padded to 8)
//! ..  entries  sorted by key
//! ```

use crate::index::bloom::Bloom;
use crate::index::entry::{Entry, EntryLayout, Key};
use crate::types::WalPosition;
use crate::wal::format::{Malformed, RECORD_HEADER_BYTES, align8, record_len};

const MAGIC: &[u8; 4] = b"TPIX";
const BLOB_HEADER_BYTES: usize = 24;

/// What a blob holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlobKind {
    /// A whole index: live entries only.
    Base = 0,
    /// The changes of one flush over the layers below it: tombstones and
    /// drop markers included.
    Delta = 1,
}

/// Where a cell's index lives in the index log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DiskRef {
    /// Position of the blob's record.
    pub position: WalPosition,
    /// Number of entries.
    pub count: u32,
    /// Bytes of the encoded bloom filter.
    pub bloom_len: u32,
}

impl DiskRef {
    /// Log position of the blob header (the bloom filter follows it).
    pub fn header_position(&self) -> WalPosition {
        self.position.plus(RECORD_HEADER_BYTES as u64)
    }

    /// Bytes of the blob header and bloom filter.
    pub fn header_and_bloom_len(&self) -> usize {
        BLOB_HEADER_BYTES + self.bloom_len as usize
    }

    /// Log position of entry `i`.
    pub fn entry_position(&self, layout: &EntryLayout, i: usize) -> WalPosition {
        let first = RECORD_HEADER_BYTES + BLOB_HEADER_BYTES + align8(self.bloom_len as usize);
        self.position.plus((first + i * layout.size()) as u64)
    }

    /// Bytes of the whole record.
    pub fn record_len(&self, layout: &EntryLayout) -> usize {
        record_len(body_len(
            self.bloom_len as usize,
            self.count as usize,
            layout,
        ))
    }
}

fn body_len(bloom_len: usize, count: usize, layout: &EntryLayout) -> usize {
    BLOB_HEADER_BYTES + align8(bloom_len) + count * layout.size()
}

/// Encodes sorted, distinct `entries` (live ones only for a base) as a
/// blob body, with a bloom filter of `bits_per_key`. Returns the body, the
/// filter and the bloom length to record in the [`DiskRef`].
pub(crate) fn encode(
    layout: &EntryLayout,
    entries: &[(Key, Entry)],
    bits_per_key: u32,
    kind: BlobKind,
) -> (Vec<u8>, Bloom, u32) {
    debug_assert!(
        kind == BlobKind::Delta || entries.iter().all(|(_, e)| !e.tombstone()),
        "a base blob holds live entries only"
    );
    let mut bloom = Bloom::new(entries.len(), bits_per_key);
    for (key, _) in entries {
        bloom.insert(&key[..layout.key_len]);
    }
    let bloom_len = bloom.encoded_len();
    let mut body = Vec::with_capacity(body_len(bloom_len, entries.len(), layout));
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    body.extend_from_slice(&(layout.key_len as u16).to_le_bytes());
    body.extend_from_slice(&(layout.size() as u16).to_le_bytes());
    body.extend_from_slice(&(bloom_len as u32).to_le_bytes());
    let mut encoded_bloom = Vec::with_capacity(bloom_len);
    bloom.encode(&mut encoded_bloom);
    body.extend_from_slice(&crc32fast::hash(&encoded_bloom).to_le_bytes());
    body.extend_from_slice(&(kind as u32).to_le_bytes());
    body.extend_from_slice(&encoded_bloom);
    body.resize(BLOB_HEADER_BYTES + align8(bloom_len), 0);
    let start = body.len();
    body.resize(start + entries.len() * layout.size(), 0);
    for (i, (key, entry)) in entries.iter().enumerate() {
        let at = start + i * layout.size();
        layout.encode(key, entry, &mut body[at..at + layout.size()]);
    }
    (body, bloom, bloom_len as u32)
}

/// Decodes the bloom filter from the blob header and bloom bytes (read
/// alone by lookups), verifying its checksum.
pub(crate) fn decode_bloom(bytes: &[u8], expected: &DiskRef) -> Result<Bloom, Malformed> {
    if bytes.len() != expected.header_and_bloom_len() || &bytes[..4] != MAGIC {
        return Err(Malformed("not an index blob header".into()));
    }
    let stored_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
    let stored_crc = u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let encoded = &bytes[BLOB_HEADER_BYTES..];
    if stored_len != expected.bloom_len || crc32fast::hash(encoded) != stored_crc {
        return Err(Malformed("bloom filter checksum mismatch".into()));
    }
    Bloom::decode(encoded).ok_or_else(|| Malformed("bad bloom filter".into()))
}

/// Decodes a whole blob body (from a verified record) of the `kind` its
/// place among the cell's layers says it is, checking every entry's
/// checksum and the sort order.
pub(crate) fn decode(
    layout: &EntryLayout,
    body: &[u8],
    expected: &DiskRef,
    kind: BlobKind,
) -> Result<(Vec<(Key, Entry)>, Bloom), Malformed> {
    if body.len() < BLOB_HEADER_BYTES || &body[..4] != MAGIC {
        return Err(Malformed("not an index blob".into()));
    }
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    let count = u32_at(4);
    let key_len = usize::from(u16::from_le_bytes([body[8], body[9]]));
    let bloom_len = u32_at(12);
    if u32_at(20) != kind as u32 {
        return Err(Malformed(format!(
            "index blob kind {} where a {kind:?} blob belongs",
            u32_at(20)
        )));
    }
    if count != expected.count || bloom_len != expected.bloom_len || key_len != layout.key_len {
        return Err(Malformed(
            "index blob header does not match its reference".into(),
        ));
    }
    if body.len() != body_len(bloom_len as usize, count as usize, layout) {
        return Err(Malformed("index blob has the wrong length".into()));
    }
    let bloom = decode_bloom(&body[..BLOB_HEADER_BYTES + bloom_len as usize], expected)?;
    let start = BLOB_HEADER_BYTES + align8(bloom_len as usize);
    let mut entries: Vec<(Key, Entry)> = Vec::with_capacity(count as usize);
    for chunk in body[start..].chunks_exact(layout.size()) {
        let decoded = layout
            .decode(chunk)
            .ok_or_else(|| Malformed("index entry checksum mismatch".into()))?;
        if entries.last().is_some_and(|(last, _)| *last >= decoded.0) {
            return Err(Malformed("index entries out of order".into()));
        }
        if kind == BlobKind::Base && decoded.1.tombstone() {
            return Err(Malformed("a tombstone in a base index blob".into()));
        }
        entries.push(decoded);
    }
    Ok((entries, bloom))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::entry::key_array;
    use crate::types::{Epoch, Tag};

    #[test]
    fn blob_round_trips() {
        let layout = EntryLayout { key_len: 32 };
        let entries: Vec<(Key, Entry)> = (0..100u64)
            .map(|i| {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&(i * 1000).to_be_bytes());
                let entry = Entry {
                    version: i,
                    location: i,
                    len: 40,
                    epoch: Epoch(1),
                    tag: Tag(0),
                };
                (key_array(&key), entry)
            })
            .collect();
        let (body, bloom, bloom_len) = encode(&layout, &entries, 10, BlobKind::Base);
        let disk = DiskRef {
            position: WalPosition(0),
            count: 100,
            bloom_len,
        };
        let (decoded, decoded_bloom) = decode(&layout, &body, &disk, BlobKind::Base).unwrap();
        assert!(
            decode(&layout, &body, &disk, BlobKind::Delta).is_err(),
            "a base is not read as a delta"
        );
        assert_eq!(decoded, entries);
        assert_eq!(decoded_bloom, bloom);
        assert_eq!(record_len(body.len()), disk.record_len(&layout));
        let header = &body[..disk.header_and_bloom_len()];
        assert_eq!(decode_bloom(header, &disk).unwrap(), bloom);
        let mut damaged = header.to_vec();
        damaged[40] ^= 4;
        assert!(
            decode_bloom(&damaged, &disk).is_err(),
            "a damaged bloom filter is detected"
        );
        let first = disk.entry_position(&layout, 0).0 as usize - RECORD_HEADER_BYTES;
        assert_eq!(
            layout.decode(&body[first..first + layout.size()]),
            Some(entries[0])
        );
    }

    #[test]
    fn deltas_carry_tombstones_and_bases_refuse_them() {
        let layout = EntryLayout { key_len: 32 };
        let mut key = [0u8; 32];
        key[0] = 7;
        let tombstone = Entry {
            version: 9,
            location: Entry::DROPPED,
            len: 0,
            epoch: Epoch(2),
            tag: Tag(5),
        };
        let entries = vec![(key_array(&key), tombstone)];
        let (body, _, bloom_len) = encode(&layout, &entries, 10, BlobKind::Delta);
        let disk = DiskRef {
            position: WalPosition(0),
            count: 1,
            bloom_len,
        };
        let (decoded, _) = decode(&layout, &body, &disk, BlobKind::Delta).unwrap();
        assert_eq!(decoded, entries);
        let mut as_base = body.clone();
        as_base[20] = 0;
        assert!(decode(&layout, &as_base, &disk, BlobKind::Base).is_err());
    }
}
