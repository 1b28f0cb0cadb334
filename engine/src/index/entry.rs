//! Index entries: what a key points at, in memory and on disk.

use std::cmp::Ordering;

use crate::types::{Epoch, MAX_KEY_BYTES, Tag};

/// A key, zero-padded to the maximum key length. Keys of one key space all
/// have the same length, so padding never changes their order.
pub(crate) type Key = [u8; MAX_KEY_BYTES];

/// Entries sorted by key, distinct keys.
pub(crate) type SortedEntries = Vec<(Key, Entry)>;

/// Pads `key` (at most `MAX_KEY_BYTES` long) into a [`Key`].
pub(crate) fn key_array(key: &[u8]) -> Key {
    let mut padded = [0u8; MAX_KEY_BYTES];
    padded[..key.len()].copy_from_slice(key);
    padded
}

/// What the index knows about one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// WAL position of the write this entry stems from; relocated copies
    /// keep it. The higher version wins.
    pub version: u64,
    /// WAL position of the item's bytes now (equal to `version` unless the
    /// item was relocated or touched).
    pub location: u64,
    /// Unpadded length of the item at `location` (header, key, value); 0
    /// for a tombstone (a delete: the key has no value).
    pub len: u32,
    /// Epoch of the last write or touch.
    pub epoch: Epoch,
    /// Application tag.
    pub tag: Tag,
}

impl Entry {
    /// Whether the entry is a delete.
    pub fn tombstone(&self) -> bool {
        self.len == 0
    }

    /// Whether `self` supersedes `other`: a later write wins, and between
    /// copies of one write the later copy wins.
    pub fn supersedes(&self, other: &Entry) -> bool {
        (self.version, self.location) > (other.version, other.location)
    }

    /// Whether `self` may replace `other`: it supersedes it, or it is the
    /// same write at the same place (a touch changing only the epoch).
    pub fn replaces(&self, other: &Entry) -> bool {
        (self.version, self.location) >= (other.version, other.location)
    }

    /// The entry of a freshly written item: its own position is its
    /// version and its location; a delete has no value (length 0).
    pub fn written(position: u64, item_len: u32, delete: bool, epoch: Epoch, tag: Tag) -> Entry {
        Entry {
            version: position,
            location: position,
            len: if delete { 0 } else { item_len },
            epoch,
            tag,
        }
    }

    /// The entry of a log item found at `location` (replay, replication):
    /// an item written with version 0 is a fresh write, its location its
    /// version; a relocated or replicated copy carries its version. Only a
    /// put has a value (`len`); a delete or touch is 0.
    pub fn of_item(location: u64, item: &crate::wal::format::Item<'_>) -> Entry {
        Entry {
            version: if item.version == 0 {
                location
            } else {
                item.version
            },
            location,
            len: if item.op == crate::wal::format::Op::Put {
                item.len as u32
            } else {
                0
            },
            epoch: item.epoch,
            tag: item.tag,
        }
    }

    /// Location of a drop marker: an entry removed by an epoch drop or a
    /// relocation filter, superseding every copy of its write.
    pub const DROPPED: u64 = u64::MAX;

    /// A marker that removes `entry` (and every copy of its write).
    pub fn dropped(entry: &Entry) -> Entry {
        Entry {
            location: Entry::DROPPED,
            len: 0,
            ..*entry
        }
    }
}

/// Byte layout of an on-disk entry for keys of `key_len` bytes:
/// key, version u64, location u64, len u32, epoch u32, tag u32, crc u32 —
/// all little-endian; the CRC covers the preceding bytes of the entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EntryLayout {
    pub key_len: usize,
}

/// Bytes after the key in an on-disk entry.
const ENTRY_TAIL_BYTES: usize = 32;

impl EntryLayout {
    /// Bytes per entry.
    pub fn size(&self) -> usize {
        self.key_len + ENTRY_TAIL_BYTES
    }

    /// Writes `entry` for `key` into `out` (exactly `size()` bytes).
    pub fn encode(&self, key: &Key, entry: &Entry, out: &mut [u8]) {
        let k = self.key_len;
        out[..k].copy_from_slice(&key[..k]);
        out[k..k + 8].copy_from_slice(&entry.version.to_le_bytes());
        out[k + 8..k + 16].copy_from_slice(&entry.location.to_le_bytes());
        out[k + 16..k + 20].copy_from_slice(&entry.len.to_le_bytes());
        out[k + 20..k + 24].copy_from_slice(&entry.epoch.0.to_le_bytes());
        out[k + 24..k + 28].copy_from_slice(&entry.tag.0.to_le_bytes());
        let crc = crc32fast::hash(&out[..k + 28]);
        out[k + 28..k + 32].copy_from_slice(&crc.to_le_bytes());
    }

    /// The key bytes of an encoded entry (unverified).
    pub fn key_of<'a>(&self, bytes: &'a [u8]) -> &'a [u8] {
        &bytes[..self.key_len]
    }

    /// Decodes and verifies one encoded entry.
    pub fn decode(&self, bytes: &[u8]) -> Option<(Key, Entry)> {
        let k = self.key_len;
        let field = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let wide = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        if crc32fast::hash(&bytes[..k + 28]) != field(k + 28) {
            return None;
        }
        let entry = Entry {
            version: wide(k),
            location: wide(k + 8),
            len: field(k + 16),
            epoch: Epoch(field(k + 20)),
            tag: Tag(field(k + 24)),
        };
        Some((key_array(&bytes[..k]), entry))
    }

    /// Compares `key` with an encoded entry's key.
    pub fn cmp_key(&self, key: &Key, bytes: &[u8]) -> Ordering {
        key[..self.key_len].cmp(self.key_of(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_and_detect_damage() {
        let layout = EntryLayout { key_len: 20 };
        let key = key_array(&[5u8; 20]);
        let entry = Entry {
            version: 10,
            location: 99,
            len: 300,
            epoch: Epoch(4),
            tag: Tag(2),
        };
        let mut buf = vec![0u8; layout.size()];
        layout.encode(&key, &entry, &mut buf);
        assert_eq!(layout.decode(&buf), Some((key, entry)));
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            assert_eq!(layout.decode(&bad), None, "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn version_then_location_decides() {
        let e = |version, location| Entry {
            version,
            location,
            len: 1,
            epoch: Epoch(0),
            tag: Tag(0),
        };
        assert!(e(5, 5).supersedes(&e(4, 90)));
        assert!(e(4, 90).supersedes(&e(4, 4)));
        assert!(!e(4, 4).supersedes(&e(4, 4)));
    }
}
