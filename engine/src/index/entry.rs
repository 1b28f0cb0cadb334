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

/// Which of an entry's fields a blob stores, and how wide: chosen per blob
/// from its entries when it is written, so that a field every entry
/// shares, or whose values all fit fewer bytes, costs less. The empty
/// format (no flags) is the full entry; blobs written before formats
/// existed all have it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EntryFormat {
    /// `NO_VERSION | LOCATION_48 | LEN_16 | SHARED_EPOCH | SHARED_TAG`.
    pub flags: u8,
    /// Every entry's epoch under `SHARED_EPOCH`, else 0.
    pub epoch: Epoch,
    /// Every entry's tag under `SHARED_TAG`, else 0.
    pub tag: Tag,
}

impl EntryFormat {
    /// No version field: every entry's version is its location (no
    /// relocated copies, touches or drop markers).
    pub const NO_VERSION: u8 = 1;
    /// Locations in 6 bytes (all ones: a drop marker).
    pub const LOCATION_48: u8 = 2;
    /// Lengths in 2 bytes.
    pub const LEN_16: u8 = 4;
    /// No epoch field: the format's `epoch` is every entry's.
    pub const SHARED_EPOCH: u8 = 8;
    /// No tag field: the format's `tag` is every entry's.
    pub const SHARED_TAG: u8 = 16;
    /// Every flag this build knows.
    pub const KNOWN: u8 = 31;
    /// A drop marker's location in 6 bytes; no other location reaches it.
    const DROPPED_48: u64 = (1 << 48) - 1;

    /// The smallest format that holds every one of `entries`.
    pub fn of(entries: &[(Key, Entry)]) -> EntryFormat {
        let Some((_, first)) = entries.first() else {
            return EntryFormat::default();
        };
        let flags = entries.iter().fold(Self::KNOWN, |flags, (_, e)| {
            flags & Self::allowed(e, first.epoch, first.tag)
        });
        EntryFormat::from_parts(flags, first.epoch, first.tag)
    }

    /// The flags under which `entry` can be stored, with `epoch` and `tag`
    /// as the shared ones.
    fn allowed(entry: &Entry, epoch: Epoch, tag: Tag) -> u8 {
        let flag = |holds: bool, flag: u8| if holds { flag } else { 0 };
        flag(entry.version == entry.location, Self::NO_VERSION)
            | flag(
                entry.location == Entry::DROPPED || entry.location < Self::DROPPED_48,
                Self::LOCATION_48,
            )
            | flag(entry.len <= u32::from(u16::MAX), Self::LEN_16)
            | flag(entry.epoch == epoch, Self::SHARED_EPOCH)
            | flag(entry.tag == tag, Self::SHARED_TAG)
    }

    /// The format of `flags` with the shared values (ignored, and kept as
    /// 0, for fields the flags do not share).
    pub fn from_parts(flags: u8, epoch: Epoch, tag: Tag) -> EntryFormat {
        EntryFormat {
            flags,
            epoch: if flags & Self::SHARED_EPOCH != 0 {
                epoch
            } else {
                Epoch(0)
            },
            tag: if flags & Self::SHARED_TAG != 0 {
                tag
            } else {
                Tag(0)
            },
        }
    }

    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Whether `entry` can be stored in this format.
    fn holds(&self, entry: &Entry) -> bool {
        self.flags & !Self::allowed(entry, self.epoch, self.tag) == 0
    }

    fn location_bytes(&self) -> usize {
        if self.has(Self::LOCATION_48) { 6 } else { 8 }
    }

    fn len_bytes(&self) -> usize {
        if self.has(Self::LEN_16) { 2 } else { 4 }
    }

    /// Bytes after the key: the stored fields and the CRC.
    fn tail_bytes(&self) -> usize {
        let unless = |flag: u8, bytes: usize| if self.has(flag) { 0 } else { bytes };
        unless(Self::NO_VERSION, 8)
            + self.location_bytes()
            + self.len_bytes()
            + unless(Self::SHARED_EPOCH, 4)
            + unless(Self::SHARED_TAG, 4)
            + 4
    }
}

/// Byte layout of an on-disk entry for keys of `key_len` bytes in a blob
/// of `format`: key, version u64 (unless `NO_VERSION`), location (u64, or
/// u48 under `LOCATION_48`), len (u32, or u16 under `LEN_16`), epoch u32
/// (unless `SHARED_EPOCH`), tag u32 (unless `SHARED_TAG`), crc u32 (CRC32
/// of the entry's preceding bytes) — all little-endian. The full format is
/// 32 bytes after the key; the smallest 12.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EntryLayout {
    pub key_len: usize,
    pub format: EntryFormat,
}

fn put(out: &mut [u8], at: &mut usize, bytes: &[u8]) {
    out[*at..*at + bytes.len()].copy_from_slice(bytes);
    *at += bytes.len();
}

fn take(bytes: &[u8], at: &mut usize, width: usize) -> u64 {
    let mut wide = [0u8; 8];
    wide[..width].copy_from_slice(&bytes[*at..*at + width]);
    *at += width;
    u64::from_le_bytes(wide)
}

impl EntryLayout {
    /// The full layout (every field at full width) for keys of `key_len`.
    #[cfg(test)]
    pub fn full(key_len: usize) -> EntryLayout {
        EntryLayout {
            key_len,
            format: EntryFormat::default(),
        }
    }

    /// Bytes per entry.
    pub fn size(&self) -> usize {
        self.key_len + self.format.tail_bytes()
    }

    /// Writes `entry` for `key` into `out` (exactly `size()` bytes).
    ///
    /// # Panics
    /// If the layout's format cannot hold `entry` (a blob's format is
    /// chosen from its own entries, so this is a bug, never a bad input).
    pub fn encode(&self, key: &Key, entry: &Entry, out: &mut [u8]) {
        let f = &self.format;
        assert!(f.holds(entry), "entry {entry:?} does not fit {f:?}");
        let mut at = 0;
        put(out, &mut at, &key[..self.key_len]);
        if !f.has(EntryFormat::NO_VERSION) {
            put(out, &mut at, &entry.version.to_le_bytes());
        }
        let location = if f.has(EntryFormat::LOCATION_48) && entry.location == Entry::DROPPED {
            EntryFormat::DROPPED_48
        } else {
            entry.location
        };
        put(out, &mut at, &location.to_le_bytes()[..f.location_bytes()]);
        put(out, &mut at, &entry.len.to_le_bytes()[..f.len_bytes()]);
        if !f.has(EntryFormat::SHARED_EPOCH) {
            put(out, &mut at, &entry.epoch.0.to_le_bytes());
        }
        if !f.has(EntryFormat::SHARED_TAG) {
            put(out, &mut at, &entry.tag.0.to_le_bytes());
        }
        let crc = crc32fast::hash(&out[..at]);
        put(out, &mut at, &crc.to_le_bytes());
        debug_assert_eq!(at, self.size());
    }

    /// The key bytes of an encoded entry (unverified).
    pub fn key_of<'a>(&self, bytes: &'a [u8]) -> &'a [u8] {
        &bytes[..self.key_len]
    }

    /// Decodes and verifies one encoded entry.
    pub fn decode(&self, bytes: &[u8]) -> Option<(Key, Entry)> {
        let f = &self.format;
        let body = self.size() - 4;
        let stored = u32::from_le_bytes(bytes[body..body + 4].try_into().expect("4 bytes"));
        if crc32fast::hash(&bytes[..body]) != stored {
            return None;
        }
        let mut at = self.key_len;
        let version = (!f.has(EntryFormat::NO_VERSION)).then(|| take(bytes, &mut at, 8));
        let mut location = take(bytes, &mut at, f.location_bytes());
        if f.has(EntryFormat::LOCATION_48) && location == EntryFormat::DROPPED_48 {
            location = Entry::DROPPED;
        }
        let len = take(bytes, &mut at, f.len_bytes()) as u32;
        let epoch = if f.has(EntryFormat::SHARED_EPOCH) {
            f.epoch
        } else {
            Epoch(take(bytes, &mut at, 4) as u32)
        };
        let tag = if f.has(EntryFormat::SHARED_TAG) {
            f.tag
        } else {
            Tag(take(bytes, &mut at, 4) as u32)
        };
        let entry = Entry {
            version: version.unwrap_or(location),
            location,
            len,
            epoch,
            tag,
        };
        Some((key_array(&bytes[..self.key_len]), entry))
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
    fn encode_decode_and_detect_damage_in_every_format() {
        let key = key_array(&[5u8; 20]);
        let entry = Entry {
            version: 10,
            location: 10,
            len: 300,
            epoch: Epoch(4),
            tag: Tag(2),
        };
        let mut sizes = std::collections::BTreeSet::new();
        for flags in 0..=EntryFormat::KNOWN {
            let layout = EntryLayout {
                key_len: 20,
                format: EntryFormat::from_parts(flags, entry.epoch, entry.tag),
            };
            let mut buf = vec![0u8; layout.size()];
            layout.encode(&key, &entry, &mut buf);
            assert_eq!(layout.decode(&buf), Some((key, entry)), "flags {flags:#x}");
            for i in 0..buf.len() {
                let mut bad = buf.clone();
                bad[i] ^= 0x10;
                assert_eq!(
                    layout.decode(&bad),
                    None,
                    "flags {flags:#x}: flip at byte {i}"
                );
            }
            sizes.insert(layout.size());
        }
        assert_eq!(
            sizes.first(),
            Some(&32),
            "20-byte key, 6-byte location, 2-byte len, CRC"
        );
        assert_eq!(
            sizes.last(),
            Some(&52),
            "the full entry: 32 bytes after the key"
        );
    }

    #[test]
    fn the_format_of_entries_is_the_smallest_that_holds_them_all() {
        let key = key_array(&[1u8; 32]);
        let fresh = |position: u64| Entry::written(position, 1080, false, Epoch(3), Tag(0));
        let format = |entries: &[Entry]| {
            EntryFormat::of(&entries.iter().map(|e| (key, *e)).collect::<Vec<_>>())
        };
        let smallest = format(&[fresh(100), fresh(200)]);
        assert_eq!(smallest.flags, EntryFormat::KNOWN);
        assert_eq!((smallest.epoch, smallest.tag), (Epoch(3), Tag(0)));
        assert_eq!(
            EntryLayout {
                key_len: 32,
                format: smallest
            }
            .size(),
            44
        );
        let moved = Entry {
            location: 900,
            ..fresh(100)
        };
        let dropped = Entry::dropped(&fresh(300));
        let big = Entry::written(400, 70_000, false, Epoch(3), Tag(0));
        let far = fresh(1 << 50);
        let other_epoch = Entry::written(500, 1080, false, Epoch(4), Tag(0));
        let other_tag = Entry::written(600, 1080, false, Epoch(3), Tag(7));
        for (entry, lost) in [
            (moved, EntryFormat::NO_VERSION),
            (dropped, EntryFormat::NO_VERSION),
            (big, EntryFormat::LEN_16),
            (far, EntryFormat::LOCATION_48),
            (other_epoch, EntryFormat::SHARED_EPOCH),
            (other_tag, EntryFormat::SHARED_TAG),
        ] {
            let f = format(&[fresh(100), entry]);
            assert_eq!(f.flags, EntryFormat::KNOWN & !lost, "{entry:?}");
            let layout = EntryLayout {
                key_len: 32,
                format: f,
            };
            let mut buf = vec![0u8; layout.size()];
            for e in [fresh(100), entry] {
                layout.encode(&key, &e, &mut buf);
                assert_eq!(layout.decode(&buf), Some((key, e)));
            }
        }
        // A drop marker's location fits 6 bytes (all ones stand for it).
        let f = format(&[dropped]);
        assert_ne!(f.flags & EntryFormat::LOCATION_48, 0);
        let at_limit = fresh(EntryFormat::DROPPED_48);
        assert_eq!(format(&[at_limit]).flags & EntryFormat::LOCATION_48, 0);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn an_entry_outside_the_format_is_refused() {
        let layout = EntryLayout {
            key_len: 32,
            format: EntryFormat::from_parts(EntryFormat::LEN_16, Epoch(0), Tag(0)),
        };
        let mut buf = vec![0u8; layout.size()];
        let entry = Entry::written(7, 70_000, false, Epoch(0), Tag(0));
        layout.encode(&key_array(&[0u8; 32]), &entry, &mut buf);
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
