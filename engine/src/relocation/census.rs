//! The census: live bytes per WAL segment, from a walk of the whole index.
//! No value is read; unloaded cells' index blobs are. Entries the
//! relocation filter drops (a split group's keys of the other half) are
//! not live: bytes to shed, and garbage once the segment is no longer
//! shared with the other side of the split.

use std::collections::BTreeMap;

use super::Decision;
use crate::engine::Inner;
use crate::error::Result;
use crate::types::{Epoch, SegmentId};
use crate::wal::format::align8;

/// How much of a WAL segment is still referenced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentUsage {
    /// The segment.
    pub segment: SegmentId,
    /// The epoch it belongs to.
    pub epoch: Epoch,
    /// Its size on disk, bytes.
    pub size_bytes: u64,
    /// Bytes of items the index points into it.
    pub live_bytes: u64,
    /// Whether it is sealed (no longer written).
    pub sealed: bool,
    /// Bytes of items the index points into it that the relocation filter
    /// drops (not counted live): a segment holding any is relocated
    /// whatever its garbage ratio, so they go eventually — unless shared.
    pub shed_bytes: u64,
    /// Whether another engine holds a hard link to the file (a split's
    /// other side): deleting it here frees no space, so what the filter
    /// drops in it counts as neither garbage nor a reason to relocate it,
    /// until the other engine lets it go.
    pub shared: bool,
}

impl SegmentUsage {
    /// Fraction of the segment that relocating it would give back, 0 to 1
    /// (none of what the filter drops while the file is shared).
    pub fn garbage_ratio(&self) -> f64 {
        let kept = self.live_bytes + if self.shared { self.shed_bytes } else { 0 };
        1.0 - (kept.min(self.size_bytes) as f64 / self.size_bytes.max(1) as f64)
    }

    /// Whether the relocation filter drops entries of it that relocating
    /// it would free (it is not shared).
    pub fn to_shed(&self) -> bool {
        self.shed_bytes > 0 && !self.shared
    }
}

/// Live bytes of every segment, oldest first; remembered for the metrics.
pub(crate) fn census(inner: &Inner) -> Result<Vec<SegmentUsage>> {
    let size = inner.config.wal_segment_bytes;
    let began_at = inner.values.processed().0;
    let relocated = relocated_bytes(inner);
    let state = &inner.relocation;
    let filter = state.filter();
    let mut live: BTreeMap<SegmentId, u64> = BTreeMap::new();
    let mut shed: BTreeMap<SegmentId, u64> = BTreeMap::new();
    for (index, space) in inner.table.spaces.iter().enumerate() {
        for id in space.cell_ids() {
            for (key, entry) in inner.cell_entries(space, &id)? {
                let segment = SegmentId(entry.location / size);
                let bytes = align8(entry.len as usize) as u64;
                let info = inner.info(index as u8, &key[..space.key_len()], &entry);
                let counted = match filter.decide(&info) {
                    Decision::Drop => &mut shed,
                    Decision::Keep | Decision::Stop => &mut live,
                };
                *counted.entry(segment).or_default() += bytes;
            }
        }
    }
    let active = inner.values.active_segment();
    let usage: Vec<SegmentUsage> = inner
        .values
        .segments()
        .iter()
        .map(|s| SegmentUsage {
            segment: s.id,
            epoch: s.epoch,
            size_bytes: size,
            live_bytes: live.get(&s.id).copied().unwrap_or(0),
            sealed: s.id < active,
            shed_bytes: shed.get(&s.id).copied().unwrap_or(0),
            shared: inner
                .storage
                .link_count(&s.path)
                .is_ok_and(|links| links > 1),
        })
        .collect();
    *state.census.lock() = usage.clone();
    // A census taken under a filter replaced meanwhile counts what the new
    // one may drop: it does not tell the engine's size.
    if std::sync::Arc::ptr_eq(&filter, &state.filter()) {
        state
            .census_relocated
            .store(relocated, std::sync::atomic::Ordering::Release);
        state
            .census_at
            .store(began_at, std::sync::atomic::Ordering::Release);
    }
    Ok(usage)
}

/// Bytes of records relocation has written since the engine opened.
pub(crate) fn relocated_bytes(inner: &Inner) -> u64 {
    inner
        .metrics
        .counters()
        .bytes_relocated
        .load(std::sync::atomic::Ordering::Relaxed)
}
