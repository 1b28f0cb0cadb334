//! Ordered iteration: range scans (forward or reverse), prefix scans, and
//! "largest key smaller than".
//!
//! A scan walks the key space's cells in key order and takes, per cell, a
//! consistent snapshot of the cell's merged index (on-disk entries plus
//! unflushed changes, captured under the cell's lock). Values are read as
//! the iterator reaches them.

use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use bytes::Bytes;

use crate::engine::{Engine, Inner};
use crate::error::{Error, Result};
use crate::index::entry::{Entry, Key, key_array};
use crate::index::layers::{merge, overlay};
use crate::index::lookup::Below;
use crate::table::{CellId, SpaceTable};
use crate::types::KeySpace;

/// Scan direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Ascending keys.
    Forward,
    /// Descending keys.
    Reverse,
}

/// An iterator over `(key, value)` pairs of a key range.
#[derive(Debug)]
pub struct Scan<'a> {
    inner: &'a Inner,
    space: &'a SpaceTable,
    lower: Bound<Key>,
    upper: Bound<Key>,
    direction: Direction,
    /// The next cell to read, and the last one the range reaches (`None`:
    /// the key space's end). Cells are found one at a time: a scan that
    /// stops after one key costs one or two cells, not a list of them all.
    cursor: Option<CellId>,
    last: Option<CellId>,
    current: std::vec::IntoIter<(Key, Entry)>,
}

fn pad_bound(bound: Bound<&[u8]>) -> Bound<Key> {
    match bound {
        Bound::Included(k) => Bound::Included(key_array(k)),
        Bound::Excluded(k) => Bound::Excluded(key_array(k)),
        Bound::Unbounded => Bound::Unbounded,
    }
}

impl Inner {
    /// The live entries of one cell, sorted: a consistent snapshot of its
    /// on-disk index and unflushed changes.
    pub(crate) fn cell_entries(
        &self,
        space: &SpaceTable,
        id: &CellId,
    ) -> Result<Vec<(Key, Entry)>> {
        self.cell_range(space, id, Bound::Unbounded, Bound::Unbounded)
    }

    /// The live entries of one cell within `[lower, upper]`, sorted. Only
    /// the range is copied when the cell's index is in memory; a cell read
    /// from disk is kept in memory afterwards if the index budget allows
    /// (as a lookup does), so walking a cell a range at a time reads its
    /// on-disk index once.
    pub(crate) fn cell_range(
        &self,
        space: &SpaceTable,
        id: &CellId,
        lower: Bound<&Key>,
        upper: Bound<&Key>,
    ) -> Result<Vec<(Key, Entry)>> {
        let range = (lower, upper);
        for _ in 0..8 {
            let Some((changes, base, layers)) = space.with_cell(id, |cell| {
                let mut changes: Vec<(Key, Entry)> = cell
                    .changes_iter()
                    .filter(|(k, _)| range.contains(*k))
                    .map(|(k, e)| (*k, e))
                    .collect();
                changes.sort_unstable_by_key(|(k, _)| *k);
                (changes, cell.base.clone(), cell.layers.clone())
            }) else {
                return Ok(Vec::new());
            };
            let base = match base {
                Some(base) => base,
                None if layers.is_empty() => Arc::new(Vec::new()),
                None => {
                    let _reading = self.index_gc.read();
                    match self.index.load_layers(space.key_len(), &layers) {
                        Ok((entries, loaded)) => {
                            let entries = Arc::new(entries);
                            let bytes = entries.len() * crate::table::cell::BASE_ENTRY_BYTES;
                            if self.table.load_fits(bytes as u64) {
                                space.with_cell(id, |cell| {
                                    self.table.account(
                                        cell.install_base(&loaded, entries.clone()) as isize
                                    )
                                });
                            }
                            entries
                        }
                        Err(Error::NoRecord(_)) => continue,
                        Err(error) => return Err(error),
                    }
                }
            };
            let start = match lower {
                Bound::Included(k) => base.partition_point(|(key, _)| key < k),
                Bound::Excluded(k) => base.partition_point(|(key, _)| key <= k),
                Bound::Unbounded => 0,
            };
            let end = match upper {
                Bound::Included(k) => base.partition_point(|(key, _)| key <= k),
                Bound::Excluded(k) => base.partition_point(|(key, _)| key < k),
                Bound::Unbounded => base.len(),
            };
            return Ok(merge(&base[start..end.max(start)], &changes));
        }
        Err(blobs_kept_changing())
    }

    /// The largest live entry of one cell below `bound` (`None`: the
    /// cell's largest). A cell not in memory answers from one window of
    /// each of its blobs (base and deltas) plus its changes, instead of
    /// loading it whole; if the answer could lie before a window (newer
    /// layers delete everything a window shows), the whole cell is read
    /// after all.
    pub(crate) fn last_in_cell(
        &self,
        space: &SpaceTable,
        id: &CellId,
        bound: Option<&Key>,
    ) -> Result<Option<(Key, Entry)>> {
        let below = |k: &Key| bound.is_none_or(|b| k < b);
        for _ in 0..8 {
            let Some((changes, base, layers)) = space.with_cell(id, |cell| {
                let changes = cell.change_entries_below(bound);
                (changes, cell.base.clone(), cell.layers.clone())
            }) else {
                return Ok(None);
            };
            if let Some(base) = base {
                let end = base.partition_point(|(k, _)| below(k));
                return Ok(merge(&base[..end], &changes).pop());
            }
            if layers.is_empty() {
                return Ok(merge(&[], &changes).pop());
            }
            let windows = {
                let _reading = self.index_gc.read();
                let read: Result<Vec<Below>> = layers
                    .iter()
                    .map(|layer| {
                        let count = layer.disk.count as usize;
                        let guess = bound.map_or(0, |b| space.rank_guess(id, b, count));
                        self.index
                            .entries_below(space.key_len(), &layer.disk, bound, guess)
                    })
                    .collect();
                match read {
                    Ok(read) => read,
                    Err(Error::NoRecord(_)) => continue,
                    Err(error) => return Err(error),
                }
            };
            // Oldest first: each delta's window over the older ones, then
            // the changes; tombstones kept until merged over the base's.
            let mut newer: Vec<(Key, Entry)> = Vec::new();
            for window in &windows[1..] {
                newer = overlay(&newer, &window.entries);
            }
            let newer = overlay(&newer, &changes);
            let last = merge(&windows[0].entries, &newer).pop();
            // Entries before a window are unseen. The answer stands if no
            // window is cut short of its blob's start, or if it lies at or
            // above the highest start of a cut window: then every layer's
            // entries from the answer up to the bound were seen.
            let mut seen_from: Option<Key> = None;
            let mut complete = true;
            for window in windows.iter().filter(|w| !w.from_start) {
                match window.entries.first() {
                    Some((first, _)) => seen_from = seen_from.max(Some(*first)),
                    None => complete = false,
                }
            }
            let stands = complete
                && seen_from.is_none_or(|from| last.as_ref().is_some_and(|(key, _)| *key >= from));
            if stands {
                return Ok(last);
            }
            return Ok(self
                .cell_entries(space, id)?
                .into_iter()
                .rev()
                .find(|(k, _)| below(k)));
        }
        Err(blobs_kept_changing())
    }
}

/// A scan's answer when a cell's on-disk index was replaced under every
/// attempt to read it.
fn blobs_kept_changing() -> Error {
    Error::Io {
        path: "index log".into(),
        source: std::io::Error::other("index blobs kept changing under a scan"),
    }
}

impl<'a> Scan<'a> {
    fn in_range(&self, key: &Key) -> bool {
        (self.lower, self.upper).contains(key)
    }

    fn next_cell(&mut self) -> Option<CellId> {
        let id = self.cursor.take()?;
        let forward = self.direction == Direction::Forward;
        self.cursor = self
            .space
            .next_cell(&id, forward)
            .filter(|next| match &self.last {
                Some(last) if forward => next <= last,
                Some(last) => next >= last,
                None => true,
            });
        Some(id)
    }

    fn next_entry(&mut self) -> Option<(Key, Entry)> {
        match self.direction {
            Direction::Forward => self.current.next(),
            Direction::Reverse => self.current.next_back(),
        }
    }
}

impl Scan<'_> {
    /// The next entry in range, loading cells as needed.
    fn advance(&mut self) -> Option<Result<(Key, Entry)>> {
        loop {
            if let Some((key, entry)) = self.next_entry() {
                if self.in_range(&key) {
                    return Some(Ok((key, entry)));
                }
                continue;
            }
            let id = self.next_cell()?;
            match self
                .inner
                .cell_range(self.space, &id, self.lower.as_ref(), self.upper.as_ref())
            {
                Ok(entries) => self.current = entries.into_iter(),
                Err(error) => return Some(Err(error)),
            }
        }
    }

    /// The next key, without reading its value.
    pub fn next_key(&mut self) -> Option<Result<Vec<u8>>> {
        Some(
            self.advance()?
                .map(|(key, _)| key[..self.space.key_len()].to_vec()),
        )
    }
}

impl Iterator for Scan<'_> {
    type Item = Result<(Vec<u8>, Bytes)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (key, entry) = match self.advance()? {
                Ok(found) => found,
                Err(error) => return Some(Err(error)),
            };
            let value = match self.inner.read_value(self.space, &key, &entry) {
                // Relocated since the cell was read: look it up afresh.
                Err(Error::NoRecord(_)) => match self.inner.get_value(self.space, &key) {
                    Ok(Some(value)) => Ok(value),
                    Ok(None) => continue,
                    Err(error) => Err(error),
                },
                other => other,
            };
            return Some(value.map(|v| (key[..self.space.key_len()].to_vec(), v)));
        }
    }
}

impl Engine {
    /// Iterates the keys in `[lower, upper]` (as the bounds say) of a key
    /// space, in `direction`. Keys must have the key space's length.
    pub fn scan(
        &self,
        space: KeySpace,
        lower: Bound<&[u8]>,
        upper: Bound<&[u8]>,
        direction: Direction,
    ) -> Result<Scan<'_>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let table = crate::engine::space_index(inner, space)?;
        for key in [lower, upper] {
            if let Bound::Included(k) | Bound::Excluded(k) = key {
                inner.key(space, k)?;
            }
        }
        let (lower, upper) = (pad_bound(lower), pad_bound(upper));
        let (cursor, last) = table.cell_walk(
            lower.as_ref(),
            upper.as_ref(),
            direction == Direction::Forward,
        );
        Ok(Scan {
            inner,
            space: table,
            lower,
            upper,
            direction,
            cursor,
            last,
            current: Vec::new().into_iter(),
        })
    }

    /// Iterates every key that starts with `prefix`, in `direction`.
    pub fn scan_prefix(
        &self,
        space: KeySpace,
        prefix: &[u8],
        direction: Direction,
    ) -> Result<Scan<'_>> {
        let key_len = crate::engine::space_index(&self.inner, space)?.key_len();
        if prefix.len() > key_len {
            return Err(Error::WrongKeyLength {
                key_space: format!("#{}", space.index()),
                expected: key_len,
                got: prefix.len(),
            });
        }
        let mut low = prefix.to_vec();
        low.resize(key_len, 0x00);
        let mut high = prefix.to_vec();
        high.resize(key_len, 0xFF);
        self.scan(
            space,
            Bound::Included(&low),
            Bound::Included(&high),
            direction,
        )
    }

    /// The largest key smaller than `key`, with its value. Walks cells
    /// down from `key`'s; each cell not in memory costs one window of its
    /// on-disk index, not the whole cell.
    pub fn last_before(&self, space: KeySpace, key: &[u8]) -> Result<Option<(Vec<u8>, Bytes)>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (table, bound) = inner.key(space, key)?;
        let mut cursor = Some(table.cell_of(&bound));
        let mut first = true;
        while let Some(id) = cursor {
            let cell_bound = first.then_some(&bound);
            if let Some((found, entry)) = inner.last_in_cell(table, &id, cell_bound)? {
                return match inner.read_value(table, &found, &entry) {
                    Ok(value) => Ok(Some((found[..table.key_len()].to_vec(), value))),
                    // Relocated or deleted since: the ordered scan sorts it out.
                    Err(Error::NoRecord(_)) => self
                        .scan(
                            space,
                            Bound::Unbounded,
                            Bound::Excluded(key),
                            Direction::Reverse,
                        )?
                        .next()
                        .transpose(),
                    Err(error) => Err(error),
                };
            }
            first = false;
            cursor = table.next_cell(&id, false);
        }
        Ok(None)
    }
}
