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

/// Approximate memory of one unflushed change (key, entry, tree overhead).
pub(crate) const CHANGE_BYTES: usize = 112;
/// Memory of one loaded entry.
pub(crate) const BASE_ENTRY_BYTES: usize = std::mem::size_of::<(Key, Entry)>();

/// One cell.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    pub changes: BTreeMap<Key, Entry>,
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
        if let Some(entry) = self.changes.get(key) {
            return Probe::Found(Some(*entry));
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
            return Probe::Found(None);
        }
        Probe::Disk {
            disk,
            bloom: self.bloom.clone(),
        }
    }

    /// Records a change; the newer of it and an existing change wins.
    /// Returns whether the cell changed.
    pub fn apply(&mut self, key: Key, entry: Entry) -> bool {
        match self.changes.get_mut(&key) {
            Some(existing) if !entry.supersedes(existing) => return false,
            Some(existing) => *existing = entry,
            None => {
                self.changes.insert(key, entry);
            }
        }
        self.dirty_since = self.dirty_since.min(entry.record());
        true
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
    /// below it is complete in the log).
    pub fn flushable(&self, processed: u64) -> Vec<(Key, Entry)> {
        self.changes
            .iter()
            .filter(|(_, e)| e.location < processed)
            .map(|(k, e)| (*k, *e))
            .collect()
    }

    /// Finishes a flush that wrote `flushed` over the previous index:
    /// points the cell at `disk`, drops each flushed change that was not
    /// superseded meanwhile ("unmerge"), and keeps the merged entries as the
    /// base if the cell was loaded. Returns the change in memory, bytes.
    pub fn finish_flush(
        &mut self,
        flushed: &[(Key, Entry)],
        disk: Option<DiskRef>,
        merged: BaseEntries,
        bloom: Option<Arc<Bloom>>,
    ) -> isize {
        let before = self.memory_bytes() as isize;
        for (key, entry) in flushed {
            if self.changes.get(key) == Some(entry) {
                self.changes.remove(key);
            }
        }
        self.dirty_since = self
            .changes
            .values()
            .map(Entry::record)
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

/// Merges `changes` into the sorted `base`: per key the superseding entry
/// wins; tombstones remove keys and are not kept.
pub(crate) fn merge(base: &[(Key, Entry)], changes: &[(Key, Entry)]) -> Vec<(Key, Entry)> {
    let mut merged = Vec::with_capacity(base.len() + changes.len());
    let (mut b, mut c) = (0, 0);
    while b < base.len() || c < changes.len() {
        let pick = match (base.get(b), changes.get(c)) {
            (Some(x), Some(y)) if x.0 == y.0 => {
                b += 1;
                c += 1;
                if y.1.supersedes(&x.1) { *y } else { *x }
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
            record_offset: 0,
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
        cell.apply(key_array(b"a"), entry(1, false));
        assert_eq!(cell.state(), CellState::DirtyLoaded);
        let mut cell = Cell::restored(Some(disk()));
        assert_eq!(cell.state(), CellState::Unloaded);
        cell.apply(key_array(b"a"), entry(1, false));
        assert_eq!(cell.state(), CellState::DirtyUnloaded);
        let mut cell = Cell::restored(Some(disk()));
        cell.install_base(disk(), Arc::new(vec![]), Arc::new(Bloom::new(1, 10)));
        assert_eq!(cell.state(), CellState::Loaded);
        cell.apply(key_array(b"a"), entry(1, false));
        assert_eq!(cell.state(), CellState::DirtyLoaded);
    }

    #[test]
    fn newer_change_wins_regardless_of_arrival_order() {
        let mut cell = Cell::restored(None);
        let key = key_array(b"k");
        assert!(cell.apply(key, entry(9, false)));
        assert!(!cell.apply(key, entry(5, true)));
        assert_eq!(cell.changes[&key].version, 9);
        assert_eq!(cell.dirty_since, 9);
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
        cell.apply(a, entry(1, false));
        cell.apply(b, entry(2, false));
        let flushed = cell.flushable(100);
        cell.apply(b, entry(3, false)); // arrives while the flush runs
        let merged = Arc::new(merge(&[], &flushed));
        cell.finish_flush(&flushed, Some(disk()), merged, None);
        assert_eq!(cell.changes.len(), 1);
        assert_eq!(cell.changes[&b].version, 3);
        assert_eq!(cell.dirty_since, 3);
        assert_eq!(cell.state(), CellState::DirtyUnloaded);
    }
}
