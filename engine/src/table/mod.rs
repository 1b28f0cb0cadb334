//! The Large Table: per key space, the cells that index every key, behind
//! sharded locks.
//!
//! Uniform key spaces have a fixed array of cells grouped into rows, one
//! mutex per row. Prefixed key spaces keep one cell per prefix in a B-tree;
//! each cell has its own mutex. No I/O happens here: the engine reads and
//! writes index blobs and installs the results through these methods.

pub(crate) mod cell;

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::config::{CellLayout, KeySpaceConfig};
use crate::index::entry::{Key, key_array};
use crate::storage::prefetch_line;
use crate::striped::StripedCounter;
use cell::Cell;

/// Cells per row (per lock) in a uniform key space.
const CELLS_PER_ROW: u32 = 4;

/// Names a cell within its key space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum CellId {
    /// Cell number in a uniform key space.
    Uniform(u32),
    /// The prefix of a prefixed key space (zero-padded).
    Prefixed(Key),
}

/// The cells of one key space.
#[derive(Debug)]
enum Cells {
    Uniform {
        count: u32,
        /// The last row is padded with cells that are never used, so a
        /// row's cells sit right after its lock ([`SpaceTable::prefetch`]).
        rows: Vec<Mutex<[Cell; CELLS_PER_ROW as usize]>>,
    },
    Prefixed {
        prefix_bytes: usize,
        map: RwLock<BTreeMap<Key, Arc<Mutex<Cell>>>>,
    },
}

/// One key space's index.
#[derive(Debug)]
pub(crate) struct SpaceTable {
    pub config: KeySpaceConfig,
    cells: Cells,
}

/// The Large Table of all key spaces.
#[derive(Debug)]
pub(crate) struct LargeTable {
    pub spaces: Vec<SpaceTable>,
    /// Bytes held by cells in memory (striped: every put of a new key adds).
    memory: StripedCounter,
    /// The node's budget, which counts them too.
    budget: crate::memory::MemoryBudget,
}

impl Drop for LargeTable {
    fn drop(&mut self) {
        // What the cells held leaves the node's count with them.
        self.budget.account_index(-self.memory.sum());
    }
}

/// Lowest key rank (first 8 bytes, big-endian) of uniform cell `i` of `n`.
fn cell_low(i: u32, n: u32) -> u64 {
    ((u128::from(i) << 64).div_ceil(u128::from(n))) as u64
}

/// The uniform cell of `count` that holds `key`.
fn uniform_cell(key: &Key, count: u32) -> u32 {
    ((u128::from(rank_at(key, 0)) * u128::from(count)) >> 64) as u32
}

/// The row of uniform cell `i` and its place in the row.
fn row_and_slot(i: u32) -> (usize, usize) {
    ((i / CELLS_PER_ROW) as usize, (i % CELLS_PER_ROW) as usize)
}

/// The 8 bytes of `key` starting at `from`, big-endian, zero-padded.
pub(crate) fn rank_at(key: &Key, from: usize) -> u64 {
    let mut bytes = [0u8; 8];
    let available = key.len().saturating_sub(from).min(8);
    bytes[..available].copy_from_slice(&key[from..from + available]);
    u64::from_be_bytes(bytes)
}

impl SpaceTable {
    fn new(config: KeySpaceConfig) -> Self {
        let cells = match config.layout {
            CellLayout::Uniform { cells } => {
                let rows = cells.div_ceil(CELLS_PER_ROW);
                Cells::Uniform {
                    count: cells,
                    rows: (0..rows)
                        .map(|_| Mutex::new(std::array::from_fn(|_| Cell::restored(&[], 0))))
                        .collect(),
                }
            }
            CellLayout::Prefixed { prefix_bytes } => Cells::Prefixed {
                prefix_bytes: prefix_bytes as usize,
                map: RwLock::new(BTreeMap::new()),
            },
        };
        Self { config, cells }
    }

    /// Key length of this key space.
    pub fn key_len(&self) -> usize {
        self.config.key_bytes as usize
    }

    /// The cell that holds `key`.
    pub fn cell_of(&self, key: &Key) -> CellId {
        match &self.cells {
            Cells::Uniform { count, .. } => CellId::Uniform(uniform_cell(key, *count)),
            Cells::Prefixed { prefix_bytes, .. } => {
                CellId::Prefixed(key_array(&key[..*prefix_bytes]))
            }
        }
    }

    /// Starts loading the lock and the cell that hold `key` into the CPU
    /// cache without taking the lock. A write calls it before copying its
    /// value into the log, so the index update after the copy finds both
    /// cached instead of waiting on two cache misses while other writers
    /// wait on its claim. Uniform key spaces only (a prefixed cell is found
    /// through a map).
    pub fn prefetch(&self, key: &Key) {
        let Cells::Uniform { rows, count } = &self.cells else {
            return;
        };
        let (row, at) = row_and_slot(uniform_cell(key, *count));
        let row = &rows[row];
        // Address arithmetic only: nothing is read through the pointer.
        let cell = row.data_ptr().cast::<Cell>().wrapping_add(at).cast::<u8>();
        prefetch_line(std::ptr::from_ref(row).cast());
        prefetch_line(cell);
        prefetch_line(cell.wrapping_add(64));
    }

    /// The rank range `[low, high]` of keys in `cell`, and the byte offset
    /// the rank is read from, for the optimistic lookup's estimate.
    pub fn rank_range(&self, cell: &CellId) -> (usize, u64, u64) {
        match (&self.cells, cell) {
            (Cells::Uniform { count, .. }, CellId::Uniform(i)) => {
                let high = if i + 1 == *count {
                    u64::MAX
                } else {
                    cell_low(i + 1, *count) - 1
                };
                (0, cell_low(*i, *count), high)
            }
            (Cells::Prefixed { prefix_bytes, .. }, _) => (*prefix_bytes, 0, u64::MAX),
            _ => unreachable!("cell id of another layout"),
        }
    }

    /// The estimated rank of `key` among the `count` sorted entries of
    /// `cell`'s on-disk index (where the optimistic lookup starts).
    pub fn rank_guess(&self, cell: &CellId, key: &Key, count: usize) -> usize {
        let (rank_from, low, high) = self.rank_range(cell);
        crate::index::lookup::estimate(rank_at(key, rank_from), low, high, count)
    }

    /// Runs `f` on an existing cell under its lock; `None` if a prefixed
    /// cell does not exist.
    pub fn with_cell<R>(&self, id: &CellId, f: impl FnOnce(&mut Cell) -> R) -> Option<R> {
        match (&self.cells, id) {
            (Cells::Uniform { rows, .. }, CellId::Uniform(i)) => {
                let (row, at) = row_and_slot(*i);
                Some(f(&mut rows[row].lock()[at]))
            }
            (Cells::Prefixed { map, .. }, CellId::Prefixed(prefix)) => {
                let cell = map.read().get(prefix).cloned()?;
                let mut guard = cell.lock();
                Some(f(&mut guard))
            }
            _ => unreachable!("cell id of another layout"),
        }
    }

    /// [`SpaceTable::with_cell`] if no lock it takes is held: `None` where
    /// it would wait for one (a cell being loaded or flushed), else what
    /// `with_cell` returns.
    pub fn try_with_cell<R>(
        &self,
        id: &CellId,
        f: impl FnOnce(&mut Cell) -> R,
    ) -> Option<Option<R>> {
        match (&self.cells, id) {
            (Cells::Uniform { rows, .. }, CellId::Uniform(i)) => {
                let (row, at) = row_and_slot(*i);
                let mut row = rows[row].try_lock()?;
                Some(Some(f(&mut row[at])))
            }
            (Cells::Prefixed { map, .. }, CellId::Prefixed(prefix)) => {
                let Some(cell) = map.try_read()?.get(prefix).cloned() else {
                    return Some(None);
                };
                let mut guard = cell.try_lock()?;
                Some(Some(f(&mut guard)))
            }
            _ => unreachable!("cell id of another layout"),
        }
    }

    /// Runs `f` on a cell under its lock, creating a prefixed cell first if
    /// needed.
    pub fn with_cell_or_create<R>(&self, id: &CellId, f: impl FnOnce(&mut Cell) -> R) -> R {
        if let (Cells::Prefixed { map, .. }, CellId::Prefixed(prefix)) = (&self.cells, id)
            && !map.read().contains_key(prefix)
        {
            map.write()
                .entry(*prefix)
                .or_insert_with(|| Arc::new(Mutex::new(Cell::restored(&[], 0))));
        }
        self.with_cell(id, f).expect("the cell exists")
    }

    /// Every cell id, in key order.
    pub fn cell_ids(&self) -> Vec<CellId> {
        match &self.cells {
            Cells::Uniform { count, .. } => (0..*count).map(CellId::Uniform).collect(),
            Cells::Prefixed { map, .. } => {
                map.read().keys().map(|k| CellId::Prefixed(*k)).collect()
            }
        }
    }

    /// The cells whose keys may fall in `[from, to]`, walked in key order
    /// (`forward`) or reverse, one at a time: the first to visit, and the
    /// last (`None`: the walk ends with the key space).
    pub fn cell_walk(
        &self,
        from: Bound<&Key>,
        to: Bound<&Key>,
        forward: bool,
    ) -> (Option<CellId>, Option<CellId>) {
        let cell = |bound: Bound<&Key>| match bound {
            Bound::Included(k) | Bound::Excluded(k) => Some(self.cell_of(k)),
            Bound::Unbounded => None,
        };
        let (low, high) = (cell(from), cell(to));
        let (start, end) = if forward { (low, high) } else { (high, low) };
        let start = start.or_else(|| self.end_cell(forward));
        (start, end)
    }

    /// The first cell of the key space (`forward`) or its last.
    fn end_cell(&self, forward: bool) -> Option<CellId> {
        match &self.cells {
            Cells::Uniform { count, .. } => {
                Some(CellId::Uniform(if forward { 0 } else { count - 1 }))
            }
            Cells::Prefixed { map, .. } => {
                let map = map.read();
                let key = if forward {
                    map.keys().next()
                } else {
                    map.keys().next_back()
                };
                key.map(|k| CellId::Prefixed(*k))
            }
        }
    }

    /// The cell after `id` in key order (`forward`), or before it; `id`
    /// need not exist (a prefix no key has yet).
    pub fn next_cell(&self, id: &CellId, forward: bool) -> Option<CellId> {
        match (&self.cells, id) {
            (Cells::Uniform { count, .. }, CellId::Uniform(i)) => {
                let next = if forward {
                    i.checked_add(1).filter(|n| n < count)
                } else {
                    i.checked_sub(1)
                };
                next.map(CellId::Uniform)
            }
            (Cells::Prefixed { map, .. }, CellId::Prefixed(prefix)) => {
                let map = map.read();
                let next = if forward {
                    map.range((Bound::Excluded(*prefix), Bound::Unbounded))
                        .next()
                } else {
                    map.range((Bound::Unbounded, Bound::Excluded(*prefix)))
                        .next_back()
                };
                next.map(|(k, _)| CellId::Prefixed(*k))
            }
            _ => unreachable!("cell id of another layout"),
        }
    }
}

impl LargeTable {
    /// An empty table for these key spaces, counting against `budget`.
    pub fn new(spaces: &[KeySpaceConfig], budget: crate::memory::MemoryBudget) -> Self {
        Self {
            spaces: spaces.iter().cloned().map(SpaceTable::new).collect(),
            memory: StripedCounter::default(),
            budget,
        }
    }

    /// Records a change in memory use, bytes.
    pub fn account(&self, delta: isize) {
        self.memory.add(delta as i64);
        self.budget.account_index(delta as i64);
    }

    /// Bytes held in memory by all cells.
    pub fn memory_bytes(&self) -> u64 {
        self.memory.sum().max(0) as u64
    }

    /// Whether `extra` more bytes would take the node's indexes over their
    /// budget.
    pub fn over_budget(&self, extra: u64) -> bool {
        self.budget.index_over(extra)
    }

    /// Whether a cell load of `bytes` fits the budget; if not, the refusal
    /// is remembered so that idle cells make room.
    pub fn load_fits(&self, bytes: u64) -> bool {
        let fits = !self.budget.index_over(bytes);
        if !fits {
            self.budget.refuse_load(bytes);
        }
        fits
    }

    /// Whether the node's indexes need memory back (over the limit, or a
    /// refused load would not fit).
    pub fn pressed(&self) -> bool {
        self.budget.index_pressed()
    }

    /// Runs `f` on every cell of every key space, one lock at a time.
    pub fn for_each_cell(&self, mut f: impl FnMut(usize, &CellId, &mut Cell)) {
        for (space_index, space) in self.spaces.iter().enumerate() {
            for id in space.cell_ids() {
                space.with_cell(&id, |cell| f(space_index, &id, cell));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(cells: u32) -> SpaceTable {
        SpaceTable::new(KeySpaceConfig {
            name: "u".into(),
            key_bytes: 32,
            layout: CellLayout::Uniform { cells },
        })
    }

    #[test]
    fn uniform_cells_partition_the_rank_space_exactly() {
        for n in [1u32, 3, 7, 64, 1000] {
            let space = uniform(n);
            let mut expected_low = 0u64;
            for i in 0..n {
                let (_, low, high) = space.rank_range(&CellId::Uniform(i));
                assert_eq!(low, expected_low, "n={n} cell {i}");
                for rank in [low, high, low + (high - low) / 2] {
                    let mut key = [0u8; 32];
                    key[..8].copy_from_slice(&rank.to_be_bytes());
                    assert_eq!(space.cell_of(&key), CellId::Uniform(i), "n={n} rank {rank}");
                }
                expected_low = high.wrapping_add(1);
            }
            assert_eq!(expected_low, 0, "the last cell ends at u64::MAX");
        }
    }

    #[test]
    fn prefixed_cells_are_created_on_write_and_ordered() {
        let space = SpaceTable::new(KeySpaceConfig {
            name: "p".into(),
            key_bytes: 8,
            layout: CellLayout::Prefixed { prefix_bytes: 2 },
        });
        for prefix in [b"zz", b"aa", b"mm"] {
            let mut key = [0u8; 32];
            key[..2].copy_from_slice(prefix);
            let id = space.cell_of(&key);
            assert!(space.with_cell(&id, |_| ()).is_none());
            space.with_cell_or_create(&id, |_| ());
        }
        let ids = space.cell_ids();
        let prefixes: Vec<_> = ids
            .iter()
            .map(|id| match id {
                CellId::Prefixed(k) => [k[0], k[1]],
                CellId::Uniform(_) => unreachable!(),
            })
            .collect();
        assert_eq!(prefixes, vec![*b"aa", *b"mm", *b"zz"]);
    }
}
