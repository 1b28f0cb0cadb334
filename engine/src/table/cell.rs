//! One cell of the Large Table: the index of a contiguous key range.
//!
//! A cell holds up to three layers, newest first:
//! - `changes`: unflushed writes (the newest entry per key, tombstones
//!   included);
//! - `base`: the whole on-disk index merged into one sorted array, when
//!   loaded;
//! - `layers`: where the on-disk index lives in the index log — a base blob
//!   and the delta blobs flushed over it since it was written, oldest first.
//!
//! Its state follows from which layers are present:
//!
//! | state         | changes | base loaded | on disk |
//! |---------------|---------|-------------|---------|
//! | Empty         | none    | -           | no      |
//! | Loaded        | none    | yes         | yes     |
//! | DirtyLoaded   | some    | yes, or nothing on disk | maybe |
//! | Unloaded      | none    | no          | yes     |
//! | DirtyUnloaded | some    | no          | yes     |
//!
//! A write never loads anything: in an Unloaded cell it only buffers the
//! entry (DirtyUnloaded). See `docs/design/cell-states.md` and
//! `docs/design/index-flush.md`.

use std::collections::HashMap;
use std::collections::hash_map::Entry as Slot;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::index::blob::DiskRef;
use crate::index::bloom::{Bloom, KeyHash};
use crate::index::entry::{Entry, Key};
use crate::index::layers::{Layer, Layers, restored_layers, same_layers};

/// The five cell states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CellState {
    /// No entries anywhere.
    Empty,
    /// The on-disk index is in memory; no unflushed changes.
    Loaded,
    /// Everything is in memory, with unflushed changes.
    DirtyLoaded,
    /// Only on disk.
    Unloaded,
    /// On disk, plus unflushed changes buffered in memory.
    DirtyUnloaded,
}

/// Sorted entries of a loaded on-disk index.
pub(crate) type BaseEntries = Arc<Vec<(Key, Entry)>>;

/// Approximate memory of one unflushed change (key, change, tree overhead).
pub(crate) const CHANGE_BYTES: usize = 120;

/// An unflushed change: the new entry and the WAL record that carries it
/// (replay must restart at or before `record` to restore it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Change {
    pub entry: Entry,
    /// Position of the record; [`Change::NO_RECORD`] for a drop marker,
    /// which no record carries (it is durable once flushed).
    pub record: u64,
    /// It replaced a relocation move or drop marker not yet flushed: until
    /// it is, the durable index may still point where the move left (a
    /// segment relocation must not delete yet).
    pub covers_move: bool,
}

impl Change {
    /// `record` of a change no WAL record carries.
    pub const NO_RECORD: u64 = u64::MAX;
}
/// Memory of one loaded entry.
pub(crate) const BASE_ENTRY_BYTES: usize = std::mem::size_of::<(Key, Entry)>();

/// Hashes a [`Key`]: its 8-byte words folded with a multiply-xorshift
/// mix. Keys of uniform key spaces are hashes already; keys of prefixed
/// ones share prefixes, which the mix spreads.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            let mixed = (self.0 ^ u64::from_le_bytes(word)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            self.0 = mixed ^ (mixed >> 29);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A cell's unflushed changes by key. A hash map: a write finds its slot in
/// a cache miss or two, where a B-tree walk compared a dozen keys. The rare
/// readers that need key order (flushes, scans) sort what they take.
pub(crate) type ChangeMap = HashMap<Key, Change, BuildHasherDefault<KeyHasher>>;

/// One cell.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    pub changes: ChangeMap,
    /// The on-disk index merged into one sorted array (no tombstones),
    /// when loaded.
    pub base: Option<BaseEntries>,
    pub layers: Layers,
    /// Lowest record position among `changes` (`u64::MAX` when there are
    /// none): replay must start at or before it.
    pub dirty_since: u64,
    /// A flush of this cell is running.
    pub flushing: bool,
    /// The cell is in the flush queue.
    pub queued: bool,
    /// Set on access; cleared by the unloader's clock sweep.
    pub referenced: bool,
}

/// What a probe of the in-memory layers found.
#[derive(Debug)]
pub(crate) enum Probe {
    /// The answer, from memory (`None`: no such key, or deleted).
    Found(Option<Entry>),
    /// No such key: the bloom filter of every on-disk layer says so.
    Filtered,
    /// Only the on-disk index can tell.
    Disk(Layers),
}

impl Cell {
    /// A cell restored from a snapshot: its on-disk blobs, oldest first,
    /// the first `base_blobs` of them the base's.
    pub fn restored(disk: &[DiskRef], base_blobs: usize) -> Self {
        Self {
            layers: restored_layers(disk, base_blobs),
            dirty_since: u64::MAX,
            ..Self::default()
        }
    }

    /// The cell's state.
    pub fn state(&self) -> CellState {
        let dirty = !self.changes.is_empty();
        match (!self.layers.is_empty(), self.base.is_some(), dirty) {
            (false, _, false) => CellState::Empty,
            (false, _, true) | (true, true, true) => CellState::DirtyLoaded,
            (true, true, false) => CellState::Loaded,
            (true, false, false) => CellState::Unloaded,
            (true, false, true) => CellState::DirtyUnloaded,
        }
    }

    /// Looks `key` up in memory. Tombstones read as `Found(Some)` with
    /// a zero `len`, so callers can tell "deleted" from "not here".
    pub fn probe(&mut self, key: &Key, key_len: usize) -> Probe {
        self.referenced = true;
        if let Some(change) = self.changes.get(key) {
            return Probe::Found(Some(change.entry));
        }
        if let Some(base) = &self.base {
            let found = base
                .binary_search_by(|(k, _)| k.cmp(key))
                .ok()
                .map(|i| base[i].1);
            return Probe::Found(found);
        }
        if self.layers.is_empty() {
            return Probe::Found(None);
        }
        let hash = KeyHash::of(&key[..key_len]);
        let filtered = self
            .layers
            .iter()
            .all(|l| l.bloom.as_ref().is_some_and(|b| !b.may_contain_hash(&hash)));
        if filtered {
            return Probe::Filtered;
        }
        Probe::Disk(self.layers.clone())
    }

    /// Records a change carried by the WAL record at `record`; the newer of
    /// it and an existing change wins (the same write at the same place —
    /// a touch — replaces it). Returns `None` if the cell did not change,
    /// else the bytes of memory added (computed without touching the base
    /// or the bloom filters: on the write path every extra cache miss
    /// counts).
    pub fn apply(&mut self, key: Key, entry: Entry, record: u64) -> Option<usize> {
        let mut change = Change {
            entry,
            record,
            covers_move: false,
        };
        let added = match self.changes.entry(key) {
            Slot::Occupied(existing) if !entry.replaces(&existing.get().entry) => return None,
            Slot::Occupied(mut existing) => {
                let old = existing.get();
                change.covers_move = record != Change::NO_RECORD
                    && (old.record == Change::NO_RECORD || old.covers_move);
                *existing.get_mut() = change;
                0
            }
            Slot::Vacant(slot) => {
                slot.insert(change);
                CHANGE_BYTES
            }
        };
        self.dirty_since = self.dirty_since.min(record);
        Some(added)
    }

    /// Memory of the bloom filters in memory, bytes.
    fn bloom_bytes(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l.bloom.as_ref())
            .map(|b| b.memory_bytes())
            .sum()
    }

    /// Memory held by the cell's in-memory layers, bytes.
    pub fn memory_bytes(&self) -> usize {
        self.changes.len() * CHANGE_BYTES
            + self.base.as_ref().map_or(0, |b| b.len() * BASE_ENTRY_BYTES)
            + self.bloom_bytes()
    }

    /// Installs the merged on-disk index read from `seen` (with every
    /// layer's bloom filter) if `seen` is still the cell's on-disk index.
    /// Returns the bytes of memory added.
    pub fn install_base(&mut self, seen: &[Layer], entries: BaseEntries) -> usize {
        if !same_layers(&self.layers, seen) || self.base.is_some() {
            return 0;
        }
        let added = entries.len() * BASE_ENTRY_BYTES;
        self.base = Some(entries);
        let mut blooms = 0;
        for layer in seen {
            if let Some(bloom) = &layer.bloom {
                blooms += self.install_bloom(layer.disk, bloom.clone());
            }
        }
        added + blooms
    }

    /// Installs the bloom filter of the on-disk blob `disk`, if it is one
    /// of the cell's layers. Returns the bytes of memory added.
    pub fn install_bloom(&mut self, disk: DiskRef, bloom: Bloom) -> usize {
        let Some(i) = self.layers.iter().position(|l| l.disk == disk) else {
            return 0;
        };
        if self.layers[i].bloom.is_some() {
            return 0;
        }
        let added = bloom.memory_bytes();
        Arc::make_mut(&mut self.layers)[i].bloom = Some(bloom);
        added
    }

    /// Drops the loaded base (the cell stays correct: the disk index and the
    /// changes remain). Returns the bytes freed.
    pub fn unload(&mut self) -> usize {
        self.base.take().map_or(0, |b| b.len() * BASE_ENTRY_BYTES)
    }

    /// The changes a flush may write, in key order: those below
    /// `processed` (everything below it is complete in the log), and drop
    /// markers.
    pub fn flushable(&self, processed: u64) -> Vec<(Key, Change)> {
        // Its value and its record both processed (a touch keeps its
        // entry's old location: its record is what must come first, or
        // the index could reach the disk before the WAL record that made
        // it).
        let ready = |c: &Change| {
            (c.entry.location < processed || c.entry.location == Entry::DROPPED)
                && (c.record == Change::NO_RECORD || c.record < processed)
        };
        let mut flushable: Vec<(Key, Change)> = self
            .changes
            .iter()
            .filter(|(_, c)| ready(c))
            .map(|(k, c)| (*k, *c))
            .collect();
        flushable.sort_unstable_by_key(|(k, _)| *k);
        flushable
    }

    /// Whether a relocation move or drop marker is still only in memory
    /// (itself, or under a change that replaced it since).
    pub fn holds_unflushed_move(&self) -> bool {
        self.changes
            .values()
            .any(|c| c.record == Change::NO_RECORD || c.covers_move)
    }

    /// The changes' entries below `bound` (all of them for `None`), in key
    /// order.
    pub fn change_entries_below(&self, bound: Option<&Key>) -> Vec<(Key, Entry)> {
        let mut entries: Vec<(Key, Entry)> = self
            .changes
            .iter()
            .filter(|(k, _)| bound.is_none_or(|b| *k < b))
            .map(|(k, c)| (*k, c.entry))
            .collect();
        entries.sort_unstable_by_key(|(k, _)| *k);
        entries
    }

    /// The changes' entries, in no order.
    pub fn changes_iter(&self) -> impl Iterator<Item = (&Key, Entry)> + '_ {
        self.changes.iter().map(|(k, c)| (k, c.entry))
    }

    /// Finishes a move of some of the cell's blobs (index log cleaning):
    /// `moved[i]` holds what `self.layers[i]` holds, maybe at a new
    /// position. Bloom filters installed meanwhile are kept. Returns the
    /// change in memory, bytes.
    pub fn finish_move(&mut self, mut moved: Vec<Layer>) -> isize {
        let before = self.memory_bytes() as isize;
        debug_assert_eq!(moved.len(), self.layers.len(), "only a move ran");
        for (new, old) in moved.iter_mut().zip(self.layers.iter()) {
            debug_assert_eq!(new.disk.count, old.disk.count, "the same blob");
            if new.bloom.is_none() {
                new.bloom = old.bloom.clone();
            }
        }
        self.layers = moved.into();
        self.flushing = false;
        self.memory_bytes() as isize - before
    }

    /// Finishes a flush that wrote `flushed` as the new on-disk index
    /// `layers`: drops each flushed change that was not superseded
    /// meanwhile ("unmerge"), and, if the cell is loaded, installs `merged`
    /// (the new on-disk index merged, when the flush computed it) or
    /// unloads. Returns the change in memory, bytes.
    pub fn finish_flush(
        &mut self,
        flushed: &[(Key, Change)],
        layers: Layers,
        merged: Option<BaseEntries>,
    ) -> isize {
        let before = self.memory_bytes() as isize;
        for (key, change) in flushed {
            if self.changes.get(key) == Some(change) {
                self.changes.remove(key);
            }
        }
        // A hash map keeps its capacity: give back what the flush emptied,
        // so memory follows the changes held (as accounted).
        if self.changes.capacity() > 2 * self.changes.len() + 16 {
            self.changes.shrink_to_fit();
        }
        self.dirty_since = self
            .changes
            .values()
            .map(|c| c.record)
            .min()
            .unwrap_or(u64::MAX);
        // A loaded cell (or one loaded from the old index while the flush
        // ran) keeps the merged entries; an emptied cell has nothing on disk.
        self.base = match merged {
            Some(merged) if self.base.is_some() && !layers.is_empty() => Some(merged),
            _ => None,
        };
        self.layers = layers;
        self.flushing = false;
        self.memory_bytes() as isize - before
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::entry::key_array;
    use crate::index::layers::test_support::{disk_at, entry, layers};

    fn disk() -> DiskRef {
        disk_at(0, 1)
    }

    #[test]
    fn states_follow_the_layers() {
        let mut cell = Cell::restored(&[], 0);
        assert_eq!(cell.state(), CellState::Empty);
        cell.apply(key_array(b"a"), entry(1, false), 1);
        assert_eq!(cell.state(), CellState::DirtyLoaded);
        let mut cell = Cell::restored(&[disk()], 1);
        assert_eq!(cell.state(), CellState::Unloaded);
        cell.apply(key_array(b"a"), entry(1, false), 1);
        assert_eq!(cell.state(), CellState::DirtyUnloaded);
        let mut cell = Cell::restored(&[disk()], 1);
        let seen = vec![Layer {
            disk: disk(),
            bloom: Some(Bloom::new(1, 10)),
            kind: crate::index::blob::BlobKind::Base,
        }];
        cell.install_base(&seen, Arc::new(vec![]));
        assert_eq!(cell.state(), CellState::Loaded);
        assert!(
            cell.layers[0].bloom.is_some(),
            "the bloom came with the base"
        );
        cell.apply(key_array(b"a"), entry(1, false), 1);
        assert_eq!(cell.state(), CellState::DirtyLoaded);
    }

    /// A change is flushable once both its value and its record are
    /// processed: a touch keeps its entry's old (processed) location, and
    /// its new epoch must not reach a durable index blob before the
    /// touch's own record is in the WAL.
    #[test]
    fn a_touch_is_flushable_only_once_its_record_is_processed() {
        let mut cell = Cell::restored(&[], 0);
        // Value at 5, touched by a record at 50.
        cell.apply(key_array(b"t"), entry(5, false), 50);
        assert!(cell.flushable(10).is_empty(), "record at 50 not processed");
        assert_eq!(cell.flushable(51).len(), 1);
        let mut cell = Cell::restored(&[], 0);
        // A drop marker: no record carries it.
        let mut dropped = entry(7, true);
        dropped.location = Entry::DROPPED;
        cell.apply(key_array(b"d"), dropped, Change::NO_RECORD);
        assert_eq!(cell.flushable(0).len(), 1);
    }

    /// A write or touch replacing an unflushed move still counts as a move
    /// until flushed: relocation deleted the moved-from segment while the
    /// durable index still pointed into it (the move never reached disk).
    #[test]
    fn a_change_over_an_unflushed_move_counts_as_one() {
        let mut cell = Cell::restored(&[], 0);
        assert!(!cell.holds_unflushed_move());
        cell.apply(key_array(b"k"), entry(5, false), 20);
        assert!(!cell.holds_unflushed_move(), "a write alone");
        let mut moved = entry(5, false);
        moved.location = 900;
        cell.apply(key_array(b"k"), moved, Change::NO_RECORD);
        assert!(cell.holds_unflushed_move());
        // Touched: same version and location, a newer epoch, a record.
        let mut touched = moved;
        touched.epoch = crate::types::Epoch(2);
        cell.apply(key_array(b"k"), touched, 950);
        assert!(cell.holds_unflushed_move(), "the touch covers the move");
        // Overwritten: still covers it.
        cell.apply(key_array(b"k"), entry(1_000, false), 1_000);
        assert!(cell.holds_unflushed_move(), "the write covers the move");
    }

    #[test]
    fn a_base_read_from_replaced_layers_is_not_installed() {
        let mut cell = Cell::restored(&[disk(), disk_at(100, 1)], 1);
        let stale = layers(&[disk()]);
        assert_eq!(cell.install_base(&stale, Arc::new(vec![])), 0);
        assert_eq!(cell.state(), CellState::Unloaded);
        assert_eq!(cell.install_bloom(disk_at(7, 1), Bloom::new(1, 10)), 0);
        assert!(cell.install_bloom(disk_at(100, 1), Bloom::new(1, 10)) > 0);
        assert!(cell.layers[1].bloom.is_some());
    }

    #[test]
    fn absent_keys_are_filtered_only_when_every_layer_says_so() {
        let key = key_array(&[9u8; 32]);
        let other = key_array(&[1u8; 32]);
        let mut bloom = Bloom::new(1, 10);
        bloom.insert(&other);
        let mut cell = Cell::restored(&[disk(), disk_at(100, 1)], 1);
        assert!(
            matches!(cell.probe(&key, 32), Probe::Disk(_)),
            "no filter known yet"
        );
        cell.install_bloom(disk(), bloom.clone());
        assert!(
            matches!(cell.probe(&key, 32), Probe::Disk(_)),
            "one filter unknown"
        );
        cell.install_bloom(disk_at(100, 1), bloom);
        assert!(matches!(cell.probe(&key, 32), Probe::Filtered));
        assert!(matches!(cell.probe(&other, 32), Probe::Disk(_)));
    }

    #[test]
    fn newer_change_wins_regardless_of_arrival_order() {
        let mut cell = Cell::restored(&[], 0);
        let key = key_array(b"k");
        assert_eq!(cell.apply(key, entry(9, false), 9), Some(CHANGE_BYTES));
        assert_eq!(cell.apply(key, entry(5, true), 5), None);
        assert_eq!(cell.changes[&key].entry.version, 9);
        assert_eq!(cell.dirty_since, 9);
        // A replaced change adds no memory; what apply reports adds up to
        // what the cell holds.
        assert_eq!(cell.apply(key, entry(10, false), 10), Some(0));
        assert_eq!(cell.memory_bytes(), CHANGE_BYTES);
    }

    #[test]
    fn flushes_and_ordered_reads_get_the_changes_sorted() {
        let mut cell = Cell::restored(&[], 0);
        let keys: Vec<Key> = (0..200u64)
            .map(|i| key_array(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes()))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            cell.apply(*key, entry(i as u64 + 1, false), i as u64 + 1);
        }
        let mut sorted = keys.clone();
        sorted.sort();
        let flushable: Vec<Key> = cell.flushable(u64::MAX).iter().map(|(k, _)| *k).collect();
        assert_eq!(flushable, sorted);
        let bound = sorted[120];
        let below: Vec<Key> = cell
            .change_entries_below(Some(&bound))
            .iter()
            .map(|(k, _)| *k)
            .collect();
        assert_eq!(below, sorted[..120].to_vec());
        // A flush that empties the cell gives the map's memory back.
        let flushed = cell.flushable(u64::MAX);
        cell.finish_flush(&flushed, layers(&[disk()]), None);
        assert!(cell.changes.is_empty());
        assert!(
            cell.changes.capacity() <= 16,
            "capacity {}",
            cell.changes.capacity()
        );
    }

    #[test]
    fn unmerge_keeps_changes_that_arrived_during_the_flush() {
        let mut cell = Cell::restored(&[], 0);
        let (a, b) = (key_array(b"a"), key_array(b"b"));
        cell.apply(a, entry(1, false), 1);
        cell.apply(b, entry(2, false), 2);
        let flushed = cell.flushable(100);
        cell.apply(b, entry(3, false), 3); // arrives while the flush runs
        let entries: Vec<(Key, Entry)> = flushed.iter().map(|(k, c)| (*k, c.entry)).collect();
        let merged = Arc::new(crate::index::layers::merge(&[], &entries));
        cell.finish_flush(&flushed, layers(&[disk()]), Some(merged));
        assert_eq!(cell.changes.len(), 1);
        assert_eq!(cell.changes[&b].entry.version, 3);
        assert_eq!(cell.dirty_since, 3);
        assert_eq!(cell.state(), CellState::DirtyUnloaded);
    }
}
