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
//! 20  u8       kind: 0 base, 1 delta (version 1 of the format had only
//!              bases, with 0 here)
//! 21  u8       entry format flags (`EntryFormat`; 0: full entries)
//! 22  u16      0
//! -- only when the format flags are not 0 (older blobs have none):
//! 24  u32      the entries' shared epoch (`SHARED_EPOCH`), else 0
//! 28  u32      the entries' shared tag (`SHARED_TAG`), else 0
//! --
//! ..  bloom    (padded to 8)
//! ..  entries  sorted by key, `EntryLayout` of the key length and format
//! ```

use crate::index::bloom::Bloom;
use crate::index::entry::{Entry, EntryFormat, EntryLayout, Key};
use crate::types::{Epoch, Tag, WalPosition};
use crate::wal::format::{Malformed, RECORD_HEADER_BYTES, align8, record_len};

const MAGIC: &[u8; 4] = b"TPIX";
/// Header bytes of a blob of full entries (format flags 0).
const BLOB_HEADER_BYTES: usize = 24;
/// Header bytes of a blob of any other format: the shared epoch and tag
/// follow.
const FORMAT_HEADER_BYTES: usize = 32;

fn header_bytes(format: &EntryFormat) -> usize {
    if format.flags == 0 {
        BLOB_HEADER_BYTES
    } else {
        FORMAT_HEADER_BYTES
    }
}

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
    /// How the blob stores its entries.
    pub format: EntryFormat,
}

impl DiskRef {
    /// The layout of the blob's entries, for keys of `key_len` bytes.
    pub fn layout(&self, key_len: usize) -> EntryLayout {
        EntryLayout {
            key_len,
            format: self.format,
        }
    }

    /// Log position of the blob header (the bloom filter follows it).
    pub fn header_position(&self) -> WalPosition {
        self.position.plus(RECORD_HEADER_BYTES as u64)
    }

    /// Bytes of the blob header and bloom filter.
    pub fn header_and_bloom_len(&self) -> usize {
        header_bytes(&self.format) + self.bloom_len as usize
    }

    /// Log position of entry `i` (keys of `key_len` bytes).
    pub fn entry_position(&self, key_len: usize, i: usize) -> WalPosition {
        let first =
            RECORD_HEADER_BYTES + header_bytes(&self.format) + align8(self.bloom_len as usize);
        self.position
            .plus((first + i * self.layout(key_len).size()) as u64)
    }

    /// Bytes of the whole record (keys of `key_len` bytes).
    pub fn record_len(&self, key_len: usize) -> usize {
        record_len(body_len(
            self.bloom_len as usize,
            self.count as usize,
            &self.layout(key_len),
        ))
    }
}

fn body_len(bloom_len: usize, count: usize, layout: &EntryLayout) -> usize {
    header_bytes(&layout.format) + align8(bloom_len) + count * layout.size()
}

/// The most entries (keys of `key_len` bytes) one blob may hold in a
/// record of at most `max_record` bytes, whatever format they take: counted
/// as full entries (the largest) under the longer header.
pub(crate) fn max_entries(key_len: usize, bits_per_key: u32, max_record: u64) -> usize {
    let size = EntryLayout {
        key_len,
        format: EntryFormat::default(),
    }
    .size();
    let fits = |n: usize| {
        let bloom = Bloom::encoded_len_for(n, bits_per_key);
        record_len(FORMAT_HEADER_BYTES + align8(bloom) + n * size) as u64 <= max_record
    };
    // The largest `n` that fits: `fits` is monotone.
    let (mut low, mut high) = (0usize, (max_record as usize / size) + 1);
    while low < high {
        let mid = low + (high - low).div_ceil(2);
        if fits(mid) {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}

/// A blob body ready to append, with what its [`DiskRef`] records.
pub(crate) struct Encoded {
    pub body: Vec<u8>,
    pub bloom: Bloom,
    pub bloom_len: u32,
    pub format: EntryFormat,
}

/// Encodes sorted, distinct `entries` (live ones only for a base), keys
/// of `key_len` bytes, as a blob body in the smallest format that holds
/// them, with a bloom filter of `bits_per_key`.
pub(crate) fn encode(
    key_len: usize,
    entries: &[(Key, Entry)],
    bits_per_key: u32,
    kind: BlobKind,
) -> Encoded {
    encode_as(
        &EntryLayout {
            key_len,
            format: EntryFormat::of(entries),
        },
        entries,
        bits_per_key,
        kind,
    )
}

/// [`encode`] in the given layout (which must hold every entry).
pub(crate) fn encode_as(
    layout: &EntryLayout,
    entries: &[(Key, Entry)],
    bits_per_key: u32,
    kind: BlobKind,
) -> Encoded {
    debug_assert!(
        kind == BlobKind::Delta || entries.iter().all(|(_, e)| !e.tombstone()),
        "a base blob holds live entries only"
    );
    let mut bloom = Bloom::new(entries.len(), bits_per_key);
    for (key, _) in entries {
        bloom.insert(&key[..layout.key_len]);
    }
    let bloom_len = bloom.encoded_len();
    let format = layout.format;
    let mut body = Vec::with_capacity(body_len(bloom_len, entries.len(), layout));
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    body.extend_from_slice(&(layout.key_len as u16).to_le_bytes());
    body.extend_from_slice(&(layout.size() as u16).to_le_bytes());
    body.extend_from_slice(&(bloom_len as u32).to_le_bytes());
    let mut encoded_bloom = Vec::with_capacity(bloom_len);
    bloom.encode(&mut encoded_bloom);
    body.extend_from_slice(&crc32fast::hash(&encoded_bloom).to_le_bytes());
    body.extend_from_slice(&[kind as u8, format.flags, 0, 0]);
    if format.flags != 0 {
        body.extend_from_slice(&format.epoch.0.to_le_bytes());
        body.extend_from_slice(&format.tag.0.to_le_bytes());
    }
    body.extend_from_slice(&encoded_bloom);
    body.resize(header_bytes(&format) + align8(bloom_len), 0);
    let start = body.len();
    let size = layout.size();
    body.resize(start + entries.len() * size, 0);
    for (i, (key, entry)) in entries.iter().enumerate() {
        let at = start + i * size;
        layout.encode(key, entry, &mut body[at..at + size]);
    }
    Encoded {
        body,
        bloom,
        bloom_len: bloom_len as u32,
        format,
    }
}

/// The entry format a blob header states; `None` if the header is too
/// short or names flags this build does not know.
fn header_format(bytes: &[u8]) -> Option<EntryFormat> {
    let flags = *bytes.get(21)?;
    if flags & !EntryFormat::KNOWN != 0 || bytes.get(22..24)? != [0, 0] {
        return None;
    }
    if flags == 0 {
        return Some(EntryFormat::default());
    }
    let u32_at = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    Some(EntryFormat::from_parts(
        flags,
        Epoch(u32_at(24)?),
        Tag(u32_at(28)?),
    ))
}

/// Decodes the bloom filter from the blob header and bloom bytes (read
/// alone by lookups), verifying its checksum and that the header states
/// the format `expected` records.
pub(crate) fn decode_bloom(bytes: &[u8], expected: &DiskRef) -> Result<Bloom, Malformed> {
    if bytes.len() != expected.header_and_bloom_len() || &bytes[..4] != MAGIC {
        return Err(Malformed("not an index blob header".into()));
    }
    if header_format(bytes) != Some(expected.format) {
        return Err(Malformed(
            "index blob header does not state its reference's entry format".into(),
        ));
    }
    let stored_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
    let stored_crc = u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let encoded = &bytes[header_bytes(&expected.format)..];
    if stored_len != expected.bloom_len || crc32fast::hash(encoded) != stored_crc {
        return Err(Malformed("bloom filter checksum mismatch".into()));
    }
    Bloom::decode(encoded).ok_or_else(|| Malformed("bad bloom filter".into()))
}

/// Decodes a whole blob body (from a verified record, keys of `key_len`
/// bytes) of the `kind` its place among the cell's layers says it is,
/// checking every entry's checksum and the sort order.
pub(crate) fn decode(
    key_len: usize,
    body: &[u8],
    expected: &DiskRef,
    kind: BlobKind,
) -> Result<(Vec<(Key, Entry)>, Bloom), Malformed> {
    if body.len() < BLOB_HEADER_BYTES || &body[..4] != MAGIC {
        return Err(Malformed("not an index blob".into()));
    }
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    let count = u32_at(4);
    let stored_key_len = usize::from(u16::from_le_bytes([body[8], body[9]]));
    let bloom_len = u32_at(12);
    if body[20] != kind as u8 {
        return Err(Malformed(format!(
            "index blob kind {} where a {kind:?} blob belongs",
            body[20]
        )));
    }
    let Some(format) = header_format(body) else {
        return Err(Malformed("index blob of an unknown entry format".into()));
    };
    if count != expected.count
        || bloom_len != expected.bloom_len
        || stored_key_len != key_len
        || format != expected.format
    {
        return Err(Malformed(
            "index blob header does not match its reference".into(),
        ));
    }
    let layout = expected.layout(key_len);
    if body.len() != body_len(bloom_len as usize, count as usize, &layout) {
        return Err(Malformed("index blob has the wrong length".into()));
    }
    let header_len = header_bytes(&format);
    let bloom = decode_bloom(&body[..header_len + bloom_len as usize], expected)?;
    let start = header_len + align8(bloom_len as usize);
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

    /// `n` entries that take the full format (no field shared or short).
    fn full_entries(n: usize) -> Vec<(Key, Entry)> {
        (0..n as u64)
            .map(|i| {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&i.to_be_bytes());
                let entry = Entry {
                    version: i + 7,
                    location: (1 << 50) + i,
                    len: 100_000 + i as u32,
                    epoch: Epoch(i as u32),
                    tag: Tag(i as u32),
                };
                (key_array(&key), entry)
            })
            .collect()
    }

    #[test]
    fn max_entries_is_the_most_a_record_holds() {
        for max_record in [4_000u64, 65_472, 1 << 20] {
            let n = max_entries(32, 10, max_record);
            let len = |n: usize| {
                let entries = full_entries(n);
                assert_eq!(EntryFormat::of(&entries), EntryFormat::default());
                record_len(encode(32, &entries, 10, BlobKind::Base).body.len()) as u64
            };
            assert!(len(n) <= max_record, "{n} entries fit in {max_record}");
            assert!(len(n + 1) > max_record, "{} do not", n + 1);
        }
    }

    fn sample_entries(epoch_of: impl Fn(u64) -> u32) -> Vec<(Key, Entry)> {
        (0..100u64)
            .map(|i| {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&(i * 1000).to_be_bytes());
                let entry = Entry {
                    version: i,
                    location: i,
                    len: 40,
                    epoch: Epoch(epoch_of(i)),
                    tag: Tag(0),
                };
                (key_array(&key), entry)
            })
            .collect()
    }

    fn disk_of(encoded: &Encoded, count: u32) -> DiskRef {
        DiskRef {
            position: WalPosition(0),
            count,
            bloom_len: encoded.bloom_len,
            format: encoded.format,
        }
    }

    /// Encodes, decodes whole and by parts: the header and bloom filter
    /// alone, the first entry alone.
    fn round_trip(encoded: &Encoded, entries: &[(Key, Entry)]) {
        let disk = disk_of(encoded, entries.len() as u32);
        let body = &encoded.body;
        let (decoded, decoded_bloom) = decode(32, body, &disk, BlobKind::Base).unwrap();
        assert!(
            decode(32, body, &disk, BlobKind::Delta).is_err(),
            "a base is not read as a delta"
        );
        assert_eq!(decoded, entries);
        assert_eq!(decoded_bloom, encoded.bloom);
        assert_eq!(record_len(body.len()), disk.record_len(32));
        let header = &body[..disk.header_and_bloom_len()];
        assert_eq!(decode_bloom(header, &disk).unwrap(), encoded.bloom);
        let mut damaged = header.to_vec();
        damaged[40] ^= 4;
        assert!(
            decode_bloom(&damaged, &disk).is_err(),
            "a damaged bloom filter is detected"
        );
        let first = disk.entry_position(32, 0).0 as usize - RECORD_HEADER_BYTES;
        let layout = disk.layout(32);
        assert_eq!(
            layout.decode(&body[first..first + layout.size()]),
            Some(entries[0])
        );
    }

    #[test]
    fn full_entries_round_trip_with_the_first_format() {
        let entries = sample_entries(|_| 1);
        let encoded = encode_as(&EntryLayout::full(32), &entries, 10, BlobKind::Base);
        assert_eq!(encoded.format, EntryFormat::default());
        assert_eq!(
            &encoded.body[20..24],
            &[0, 0, 0, 0],
            "kind word as before formats"
        );
        assert_eq!(
            encoded.body.len(),
            24 + align8(encoded.bloom_len as usize) + 100 * 64
        );
        round_trip(&encoded, &entries);
    }

    #[test]
    fn blobs_take_the_smallest_format_of_their_entries() {
        let shared = sample_entries(|_| 1);
        let encoded = encode(32, &shared, 10, BlobKind::Base);
        assert_eq!(encoded.format.flags, EntryFormat::KNOWN);
        assert_eq!(encoded.format.epoch, Epoch(1));
        assert_eq!(
            encoded.body.len(),
            32 + align8(encoded.bloom_len as usize) + 100 * 44
        );
        round_trip(&encoded, &shared);
        let mixed = sample_entries(|i| (i % 3) as u32);
        let encoded = encode(32, &mixed, 10, BlobKind::Base);
        assert_eq!(
            encoded.format.flags,
            EntryFormat::KNOWN & !EntryFormat::SHARED_EPOCH
        );
        assert_eq!(encoded.format.epoch, Epoch(0));
        round_trip(&encoded, &mixed);
    }

    #[test]
    fn a_reference_of_another_format_or_a_damaged_header_is_refused() {
        let entries = sample_entries(|_| 1);
        let encoded = encode(32, &entries, 10, BlobKind::Base);
        let disk = disk_of(&encoded, 100);
        let header = &encoded.body[..disk.header_and_bloom_len()];
        let other_epoch = DiskRef {
            format: EntryFormat {
                epoch: Epoch(2),
                ..disk.format
            },
            ..disk
        };
        assert!(decode(32, &encoded.body, &other_epoch, BlobKind::Base).is_err());
        assert!(decode_bloom(header, &other_epoch).is_err());
        for at in [21, 22, 24, 28] {
            let mut bad = encoded.body.clone();
            bad[at] ^= 0x40;
            assert!(
                decode(32, &bad, &disk, BlobKind::Base).is_err(),
                "flip at {at}"
            );
            assert!(
                decode_bloom(&bad[..header.len()], &disk).is_err(),
                "flip at {at}, header alone"
            );
        }
    }

    #[test]
    fn deltas_carry_tombstones_and_bases_refuse_them() {
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
        let encoded = encode(32, &entries, 10, BlobKind::Delta);
        let disk = disk_of(&encoded, 1);
        let (decoded, _) = decode(32, &encoded.body, &disk, BlobKind::Delta).unwrap();
        assert_eq!(decoded, entries);
        let mut as_base = encoded.body.clone();
        as_base[20] = 0;
        assert!(decode(32, &as_base, &disk, BlobKind::Base).is_err());
    }
}
