//! The census: live bytes per WAL segment, from a walk of the whole index.
//! No value is read; unloaded cells' index blobs are.

use std::collections::BTreeMap;

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
}

impl SegmentUsage {
    /// Fraction of the segment that is garbage, 0 to 1.
    pub fn garbage_ratio(&self) -> f64 {
        1.0 - (self.live_bytes.min(self.size_bytes) as f64 / self.size_bytes.max(1) as f64)
    }
}

/// Live bytes of every segment, oldest first; remembered for the metrics.
pub(crate) fn census(inner: &Inner) -> Result<Vec<SegmentUsage>> {
    let size = inner.config.wal_segment_bytes;
    let mut live: BTreeMap<SegmentId, u64> = BTreeMap::new();
    for space in &inner.table.spaces {
        for id in space.cell_ids() {
            for (_, entry) in inner.cell_entries(space, &id)? {
                *live.entry(SegmentId(entry.location / size)).or_default() +=
                    align8(entry.len as usize) as u64;
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
        })
        .collect();
    *inner.last_census.lock() = usage.clone();
    Ok(usage)
}
