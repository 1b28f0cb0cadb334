//! Index log cleaning: copies the live blobs out of sealed index segments
//! that are mostly garbage, so that index garbage collection (after the
//! next snapshot) can delete those segments.
//!
//! Garbage collection deletes a sealed index segment only once no blob in
//! it is referenced. Cells merge and rewrite their blobs at different
//! times, so after deletes or a relocation pass most segments hold some
//! dead blobs and a few live ones, and the index log can grow to several
//! times the live index. When more than half of the sealed index log is
//! garbage, a cleaning pass picks the sealed segments with the fewest live
//! bytes (at most [`SEGMENTS_PER_PASS`], each at most half live), copies
//! each live blob in them to the end of the index log (the same bytes
//! under a new record header) and points its cell at the copy.
//!
//! A move is a flush that changes only blob positions: under the cell's
//! lock it marks the cell flushing (no flush or other move runs on it) and
//! takes its layers; without the lock it copies the blobs; under the lock
//! it installs the moved layers. Readers use the old blobs until then and
//! the copies after it: the same entries either way. The old blobs stay on
//! disk, and stay referenced by the durable snapshot, until a newer
//! snapshot references the copies; a crash before that leaves the copies
//! unreferenced, and garbage collection deletes them with their segment.
//! See docs/design/index-flush.md.

use std::collections::{BTreeMap, BTreeSet};

use crate::engine::Inner;
use crate::error::Result;
use crate::index::layers::Layer;
use crate::metrics::Metrics;
use crate::table::CellId;
use crate::table::cell::Cell;
use crate::types::SegmentId;

/// Sealed index segments a cleaning pass empties at most.
pub(crate) const SEGMENTS_PER_PASS: usize = 8;

/// Cleaning starts only once the garbage in sealed index segments is at
/// least this many segments (and more than half of them).
pub(crate) const MIN_GARBAGE_SEGMENTS: u64 = 4;

/// Live and total bytes of the index log, from the blobs cells reference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct IndexLogUsage {
    /// Bytes of blob records some cell references (active segment included).
    pub live_bytes: u64,
    /// Bytes of sealed segment files.
    pub sealed_bytes: u64,
    /// Bytes of referenced blob records in sealed segments.
    pub sealed_live_bytes: u64,
}

/// A tally of the index log's usage from the blobs cells reference:
/// live bytes per sealed segment, and the totals.
pub(crate) struct Census {
    segment_bytes: u64,
    per_segment: BTreeMap<SegmentId, u64>,
    pub usage: IndexLogUsage,
}

impl Census {
    /// An empty tally over the index log's sealed segments.
    pub fn new(inner: &Inner) -> Self {
        let segment_bytes = inner.config.index_segment_bytes;
        let active = inner.index.log.active_segment();
        let per_segment: BTreeMap<SegmentId, u64> = inner
            .index
            .log
            .segments()
            .iter()
            .filter(|s| s.id < active)
            .map(|s| (s.id, 0))
            .collect();
        let usage = IndexLogUsage {
            sealed_bytes: per_segment.len() as u64 * segment_bytes,
            ..IndexLogUsage::default()
        };
        Self {
            segment_bytes,
            per_segment,
            usage,
        }
    }

    /// Counts the blobs `cell` (of a key space with keys of `key_len` bytes)
    /// references.
    pub fn add(&mut self, key_len: usize, cell: &Cell) {
        for layer in cell.layers.iter() {
            let bytes = layer.disk.record_len(key_len) as u64;
            self.usage.live_bytes += bytes;
            let segment = SegmentId(layer.disk.position.0 / self.segment_bytes);
            if let Some(live) = self.per_segment.get_mut(&segment) {
                *live += bytes;
                self.usage.sealed_live_bytes += bytes;
            }
        }
    }
}

/// The census of every cell.
fn census(inner: &Inner) -> Census {
    let mut census = Census::new(inner);
    inner.table.for_each_cell(|space, _, cell| {
        census.add(inner.table.spaces[space].key_len(), cell);
    });
    census
}

/// The sealed segments a cleaning pass should empty: none while at most
/// half of the sealed index log (or less than [`MIN_GARBAGE_SEGMENTS`]) is
/// garbage; else the segments with the fewest live bytes, each at most
/// half live, at most [`SEGMENTS_PER_PASS`]. Segments no cell references
/// are left to garbage collection.
pub(crate) fn victims(
    per_segment: &BTreeMap<SegmentId, u64>,
    usage: &IndexLogUsage,
    segment_bytes: u64,
) -> BTreeSet<SegmentId> {
    let garbage = usage.sealed_bytes.saturating_sub(usage.sealed_live_bytes);
    if garbage < MIN_GARBAGE_SEGMENTS * segment_bytes || garbage * 2 <= usage.sealed_bytes {
        return BTreeSet::new();
    }
    let mut candidates: Vec<(u64, SegmentId)> = per_segment
        .iter()
        .filter(|&(_, &live)| live > 0 && live * 2 <= segment_bytes)
        .map(|(&id, &live)| (live, id))
        .collect();
    candidates.sort_unstable();
    candidates
        .into_iter()
        .take(SEGMENTS_PER_PASS)
        .map(|(_, id)| id)
        .collect()
}

/// One cleaning pass (see the module docs). Returns the blobs moved.
pub(crate) fn clean(inner: &Inner) -> Result<u64> {
    let size = inner.config.index_segment_bytes;
    let census = census(inner);
    let victims = victims(&census.per_segment, &census.usage, size);
    if victims.is_empty() {
        return Ok(0);
    }
    let in_victim = |layer: &Layer| victims.contains(&SegmentId(layer.disk.position.0 / size));
    let mut cells: Vec<(u8, CellId)> = Vec::new();
    inner.table.for_each_cell(|space, id, cell| {
        if cell.layers.iter().any(in_victim) {
            cells.push((space as u8, *id));
        }
    });
    let mut moved = 0;
    for (space, id) in cells {
        moved += move_blobs(inner, space, &id, &in_victim)?;
    }
    Ok(moved)
}

/// Copies the blobs of cell `id` that `selected` picks to the end of the
/// index log and points the cell at the copies. Returns the blobs moved
/// (none if the cell is flushing: a later pass retries).
fn move_blobs(
    inner: &Inner,
    space_index: u8,
    id: &CellId,
    selected: &dyn Fn(&Layer) -> bool,
) -> Result<u64> {
    let space = &inner.table.spaces[usize::from(space_index)];
    let layers = space.with_cell(id, |cell| {
        if cell.flushing || !cell.layers.iter().any(selected) {
            return None;
        }
        cell.flushing = true;
        Some(cell.layers.clone())
    });
    let Some(layers) = layers.flatten() else {
        return Ok(0);
    };
    // As for a flush: garbage collection must not delete the copies'
    // segment before the cell references them.
    let _reading = inner.index_gc.read();
    let mut written = 0u64;
    let mut count = 0u64;
    let copied: Result<Vec<Layer>> = layers
        .iter()
        .map(|layer| {
            if !selected(layer) {
                return Ok(layer.clone());
            }
            let disk = inner.index.copy(space.key_len(), &layer.disk)?;
            written += disk.record_len(space.key_len()) as u64;
            count += 1;
            Ok(Layer {
                disk,
                bloom: layer.bloom.clone(),
                kind: layer.kind,
            })
        })
        .collect();
    let copied = match copied {
        Ok(copied) => copied,
        Err(error) => {
            space.with_cell(id, |cell| cell.flushing = false);
            return Err(inner.health.poison_unless_full(error));
        }
    };
    space.with_cell(id, |cell| {
        let delta = cell.finish_move(copied);
        inner.table.account(delta);
    });
    let counters = inner.metrics.counters();
    Metrics::add(&counters.index_bytes_written, written);
    Metrics::add(&counters.index_blobs_moved, count);
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u64 = 1000;

    fn usage_of(per_segment: &BTreeMap<SegmentId, u64>) -> IndexLogUsage {
        IndexLogUsage {
            live_bytes: per_segment.values().sum(),
            sealed_bytes: per_segment.len() as u64 * SEG,
            sealed_live_bytes: per_segment.values().sum(),
        }
    }

    fn segments(live: &[u64]) -> BTreeMap<SegmentId, u64> {
        live.iter()
            .enumerate()
            .map(|(i, &l)| (SegmentId(i as u64), l))
            .collect()
    }

    #[test]
    fn nothing_is_cleaned_while_at_most_half_is_garbage() {
        let per = segments(&[500, 500, 500, 500, 500, 500, 500, 500, 500, 500]);
        assert!(victims(&per, &usage_of(&per), SEG).is_empty());
        // Exactly half garbage.
        let per = segments(&[100, 900, 1000, 1000, 1000, 0, 0, 0]);
        assert!(victims(&per, &usage_of(&per), SEG).is_empty());
    }

    #[test]
    fn only_sparse_referenced_segments_are_victims() {
        // 5,000 of 8,000 bytes garbage. Unreferenced segments are left to
        // garbage collection, segments more than half live stay.
        let per = segments(&[100, 900, 1000, 1000, 0, 0, 0, 0]);
        assert_eq!(
            victims(&per, &usage_of(&per), SEG),
            [SegmentId(0)].into_iter().collect()
        );
    }

    #[test]
    fn too_little_garbage_is_left_alone() {
        let per = segments(&[10, 10, 10]);
        assert!(victims(&per, &usage_of(&per), SEG).is_empty());
    }

    #[test]
    fn the_sparsest_segments_go_first_and_a_pass_is_bounded() {
        let mut live = vec![400; 20];
        live[3] = 5;
        live[7] = 50;
        live[11] = 600; // more than half live: never a victim
        let per = segments(&live);
        let chosen = victims(&per, &usage_of(&per), SEG);
        assert_eq!(chosen.len(), SEGMENTS_PER_PASS);
        assert!(chosen.contains(&SegmentId(3)) && chosen.contains(&SegmentId(7)));
        assert!(!chosen.contains(&SegmentId(11)));
    }
}
