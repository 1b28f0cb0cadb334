//! One cell of the Large Table: the index of a contiguous key range.
//!
//! A cell holds up to three layers, newest first:
//! - `changes`: unflushed writes (the newest entry per key, tombstones
//!   included);
//! - `base`: the whole on-disk index, when loaded;
//! - `disk`: where the on-disk index lives in the index log.
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
//! entry (DirtyUnloaded). See `docs/design/cell-states.md`.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::index::blob::DiskRef;
use crate::index::bloom::Bloom;
use crate::index::entry::{Entry, Key};

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
}

impl Change {
    /// `record` of a change no WAL record carries.
    pub const NO_RECORD: u64 = u64::MAX;
}
/// Memory of one loaded entry.
pub(crate) const BASE_ENTRY_BYTES: usize = std::mem::size_of::<(Key, Entry)>();

/// One cell.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    pub changes: BTreeMap<Key, Change>,
    pub base: Option<BaseEntries>,
    pub disk: Option<DiskRef>,
    pub bloom: Option<Arc<Bloom>>,
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
    /// No such key: the on-disk index's bloom filter says so.
    Filtered,
    /// Only the on-disk index can tell.
    Disk {
        disk: DiskRef,
        bloom: Option<Arc<Bloom>>,
    },
}

impl Cell {
    /// A cell restored from a snapshot.
    pub fn restored(disk: Option<DiskRef>) -> Self {
        Self {
            disk,
            dirty_since: u64::MAX,
            ..Self::default()
        }
    }

    /// The cell's state.
    pub fn state(&self) -> CellState {
        let dirty = !self.changes.is_empty();
        match (self.disk.is_some(), self.base.is_some(), dirty) {
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
        let Some(disk) = self.disk else {
            return Probe::Found(None);
        };
        if let Some(bloom) = &self.bloom
            && !bloom.may_contain(&key[..key_len])
        {
            return Probe::Filtered;
        }
        Probe::Disk {
            disk,
            bloom: self.bloom.clone(),
        }
    }

    /// Records a change carried by the WAL record at `record`; the newer of
    /// it and an existing change wins (the same write at the same place —
    /// a touch — replaces it). Returns `None` if the cell did not change,
    /// else the bytes of memory added (computed without touching the base
    /// or the bloom filter: on the write path every extra cache miss counts).
    pub fn apply(&mut self, key: Key, entry: Entry, record: u64) -> Option<usize> {
        let change = Change { entry, record };
        let added = match self.changes.get_mut(&key) {
            Some(existing) if !entry.replaces(&existing.entry) => return None,
            Some(existing) => {
                *existing = change;
                0
            }
            None => {
                self.changes.insert(key, change);
                CHANGE_BYTES
            }
        };
        self.dirty_since = self.dirty_since.min(record);
        Some(added)
    }

    /// Memory held by the cell's in-memory layers, bytes.
    pub fn memory_bytes(&self) -> usize {
        self.changes.len() * CHANGE_BYTES
            + self.base.as_ref().map_or(0, |b| b.len() * BASE_ENTRY_BYTES)
            + self.bloom.as_ref().map_or(0, |b| b.memory_bytes())
    }

    /// Installs a loaded on-disk index if it is still the current one.
    /// Returns the bytes of memory added.
    pub fn install_base(
        &mut self,
        disk: DiskRef,
        entries: BaseEntries,
        bloom: Arc<Bloom>,
    ) -> usize {
        if self.disk != Some(disk) || self.base.is_some() {
            return 0;
        }
        let added = entries.len() * BASE_ENTRY_BYTES;
        self.base = Some(entries);
        added + self.install_bloom(disk, bloom)
    }

    /// Installs the bloom filter of the current on-disk index. Returns the
    /// bytes of memory added.
    pub fn install_bloom(&mut self, disk: DiskRef, bloom: Arc<Bloom>) -> usize {
        if self.disk != Some(disk) || self.bloom.is_some() {
            return 0;
        }
        let added = bloom.memory_bytes();
        self.bloom = Some(bloom);
        added
    }

    /// Drops the loaded base (the cell stays correct: the disk index and the
    /// changes remain). Returns the bytes freed.
    pub fn unload(&mut self) -> usize {
        self.base.take().map_or(0, |b| b.len() * BASE_ENTRY_BYTES)
    }

    /// The changes a flush may write: those below `processed` (everything
    /// below it is complete in the log), and drop markers.
    pub fn flushable(&self, processed: u64) -> Vec<(Key, Change)> {
        let ready = |c: &Change| c.entry.location < processed || c.entry.location == Entry::DROPPED;
        self.changes
            .iter()
            .filter(|(_, c)| ready(c))
            .map(|(k, c)| (*k, *c))
            .collect()
    }

    /// The changes' entries, in key order.
    pub fn change_entries(&self) -> Vec<(Key, Entry)> {
        self.changes.iter().map(|(k, c)| (*k, c.entry)).collect()
    }

    /// Finishes a flush that wrote `flushed` over the previous index:
    /// points the cell at `disk`, drops each flushed change that was not
    /// superseded meanwhile ("unmerge"), and keeps the merged entries as the
    /// base if the cell was loaded. Returns the change in memory, bytes.
    pub fn finish_flush(
        &mut self,
        flushed: &[(Key, Change)],
        disk: Option<DiskRef>,
        merged: BaseEntries,
        bloom: Option<Arc<Bloom>>,
    ) -> isize {
        let before = self.memory_bytes() as isize;
        for (key, change) in flushed {
            if self.changes.get(key) == Some(change) {
                self.changes.remove(key);
            }
        }
        self.dirty_since = self
            .changes
            .values()
            .map(|c| c.record)
            .min()
            .unwrap_or(u64::MAX);
        // A loaded cell (or one loaded from the old index while the flush
        // ran) keeps the merged entries; an emptied cell has nothing on disk.
        self.base = match disk {
            Some(_) if self.base.is_some() => Some(merged),
            _ => None,
        };
        self.disk = disk;
        self.bloom = bloom;
        self.flushing = false;
        self.memory_bytes() as isize - before
    }
}

/// Merges `changes` into the sorted `base`: per key the change wins unless
/// the base entry supersedes it; tombstones and drop markers remove keys and
/// are not kept.
pub(crate) fn merge(base: &[(Key, Entry)], changes: &[(Key, Entry)]) -> Vec<(Key, Entry)> {
    let mut merged = Vec::with_capacity(base.len() + changes.len());
    let (mut b, mut c) = (0, 0);
    while b < base.len() || c < changes.len() {
        let pick = match (base.get(b), changes.get(c)) {
            (Some(x), Some(y)) if x.0 == y.0 => {
                b += 1;
                c += 1;
                if x.1.supersedes(&y.1) { *x } else { *y }
            }
            (Some(x), Some(y)) if x.0 < y.0 => {
                b += 1;
                *x
            }
            (Some(x), None) => {
                b += 1;
                *x
            }
            (_, Some(y)) => {
                c += 1;
                *y
            }
            (None, None) => unreachable!("loop condition"),
        };
        if !pick.1.tombstone() {
            merged.push(pick);
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::entry::key_array;
    use crate::types::{Epoch, Tag};

    fn entry(version: u64, tombstone: bool) -> Entry {
        Entry {
            version,
            location: version,
            len: if tombstone { 0 } else { 40 },
            epoch: Epoch(1),
            tag: Tag(0),
        }
    }

    fn disk() -> DiskRef {
        DiskRef {
            position: crate::types::WalPosition(0),
            count: 1,
            bloom_len: 12,
        }
    }

    #[test]
    fn states_follow_the_layers() {
        let mut cell = Cell::restored(None);
        assert_eq!(cell.state(), CellState::Empty);
        cell.apply(key_array(b"a"), entry(1, false), 1);
        assert_eq!(cell.state(), CellState::DirtyLoaded);
        let mut cell = Cell::restored(Some(disk()));
        assert_eq!(cell.state(), CellState::Unloaded);
        cell.apply(key_array(b"a"), entry(1, false), 1);
        assert_eq!(cell.state(), CellState::DirtyUnloaded);
        let mut cell = Cell::restored(Some(disk()));
        cell.install_base(disk(), Arc::new(vec![]), Arc::new(Bloom::new(1, 10)));
        assert_eq!(cell.state(), CellState::Loaded);
        cell.apply(key_array(b"a"), entry(1, false), 1);
        assert_eq!(cell.state(), CellState::DirtyLoaded);
    }

    #[test]
    fn newer_change_wins_regardless_of_arrival_order() {
        let mut cell = Cell::restored(None);
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
    fn merge_keeps_the_superseding_entry_and_drops_tombstones() {
        let k = |s: &[u8]| key_array(s);
        let base = vec![
            (k(b"a"), entry(1, false)),
            (k(b"b"), entry(2, false)),
            (k(b"d"), entry(3, false)),
        ];
        let changes = vec![
            (k(b"b"), entry(10, true)),
            (k(b"c"), entry(11, false)),
            (k(b"d"), entry(2, false)),
        ];
        let merged = merge(&base, &changes);
        let keys: Vec<_> = merged.iter().map(|(key, e)| (key[0], e.version)).collect();
        assert_eq!(keys, vec![(b'a', 1), (b'c', 11), (b'd', 3)]);
    }

    #[test]
    fn unmerge_keeps_changes_that_arrived_during_the_flush() {
        let mut cell = Cell::restored(None);
        let (a, b) = (key_array(b"a"), key_array(b"b"));
        cell.apply(a, entry(1, false), 1);
        cell.apply(b, entry(2, false), 2);
        let flushed = cell.flushable(100);
        cell.apply(b, entry(3, false), 3); // arrives while the flush runs
        let entries: Vec<(Key, Entry)> = flushed.iter().map(|(k, c)| (*k, c.entry)).collect();
        let merged = Arc::new(merge(&[], &entries));
        cell.finish_flush(&flushed, Some(disk()), merged, None);
        assert_eq!(cell.changes.len(), 1);
        assert_eq!(cell.changes[&b].entry.version, 3);
        assert_eq!(cell.dirty_since, 3);
        assert_eq!(cell.state(), CellState::DirtyUnloaded);
    }
}
