//! Background relocation: every `relocation_interval_ms`, take a census —
//! when a segment's worth was written since the last one, when anything was
//! written and the last one is four intervals old (deletes write little),
//! or when the last pass relocated a full batch — and relocate (index-based:
//! only live values are read) the oldest sealed segments whose garbage
//! ratio reaches the threshold — a lower threshold when the disk is
//! filling; any ratio when the relocation filter drops some of their
//! entries (a split group shedding the other half's keys) and no other
//! engine shares the file (while one does, relocating frees nothing) — at a limited
//! rate so foreground writes keep their throughput. Setting a filter asks
//! for a census at the next pass.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::engine::Inner;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::pool::Next;

/// Background relocation's state between runs. Its task runs on the
/// pool's low-priority lane: the copy rate limit bounds its I/O, the
/// priority bounds what its census, lookups and flushes take from
/// foreground threads.
#[derive(Debug)]
pub(crate) struct Relocator {
    last_census: std::time::Instant,
    /// The last pass relocated a full batch: more may be waiting.
    more: bool,
}

impl Relocator {
    pub fn new() -> Relocator {
        Relocator {
            last_census: std::time::Instant::now(),
            more: false,
        }
    }

    /// One run, every `relocation_interval_ms`.
    pub fn run(&mut self, inner: &Inner) -> Next {
        let interval = Duration::from_millis(inner.config.relocation_interval_ms);
        if inner.shutdown.load(Ordering::Acquire) || inner.health.is_poisoned() {
            return Next::Stop;
        }
        match pass(inner, &mut self.last_census, interval, self.more) {
            Ok(full) => self.more = full,
            Err(error) => {
                self.more = false;
                if !super::is_transient(&error) && inner.health.is_poisoned() {
                    return Next::Stop;
                }
            }
        }
        Next::After(interval)
    }
}

/// One policy-driven pass. The census walks the whole index, so it runs
/// only when a segment's worth of writes arrived since the last one (new
/// garbage comes only with new writes), or when the disk is filling.
/// Passes a census may wait, when little was written since the last one,
/// before it runs anyway: deletes write little but may leave whole segments
/// dead (a backup tool's prune), and their space must come back without
/// waiting for more writes.
const STALE_CENSUS_PASSES: u32 = 4;

/// One pass; returns whether it relocated a full batch (so the next pass
/// looks again whatever was written meanwhile).
pub(super) fn pass(
    inner: &Inner,
    last_census: &mut std::time::Instant,
    interval: Duration,
    more: bool,
) -> Result<bool> {
    let state = &inner.relocation;
    let config = &inner.config;
    let free = inner
        .storage
        .available_bytes(&config.dir)
        .unwrap_or(u64::MAX);
    let pressure = free < config.relocation_pressure_free_bytes;
    let processed = inner.values.processed().0;
    let last = state.census_processed.load(Ordering::Acquire);
    let grown = processed.saturating_sub(last);
    let stale = grown > 0 && last_census.elapsed() >= interval * STALE_CENSUS_PASSES;
    if !pressure && grown < config.wal_segment_bytes && !stale && !more {
        return Ok(false);
    }
    state.census_processed.store(processed, Ordering::Release);
    *last_census = std::time::Instant::now();
    // The census walks the whole index (seconds on a big one) without the
    // relocation turn, as `Engine::segment_usage` does: under it, an epoch
    // drop or a checkpoint on the application's critical thread (a node's
    // Raft thread) waited for the walk to end. What it counts is a hint for
    // choosing segments; what the pass moves is looked up under the turn.
    let usage = super::census(inner)?;
    let _turn = state.take_turn();
    if state.yielding() {
        return Ok(false);
    }
    let threshold = if pressure {
        config.relocation_pressure_garbage_ratio
    } else {
        config.relocation_garbage_ratio
    };
    let unreadable = state.unreadable.lock().clone();
    // Only segments a pass may reclaim (sealed, below the log retention):
    // one the retention still holds, chosen alone under pressure, held
    // every pass on itself.
    let reclaimable: std::collections::BTreeSet<_> =
        inner.sealed_segments().into_iter().map(|s| s.id).collect();
    let wanted: Vec<_> = usage
        .iter()
        .filter(|u| u.sealed && (u.garbage_ratio() >= threshold || u.to_shed()))
        .filter(|u| !unreadable.contains(&u.segment.0) && reclaimable.contains(&u.segment))
        .collect();
    // Under pressure, segments holding nothing live go first, alone: they
    // free space without copying a byte. Oldest first, a pass met a
    // segment with live values first, failed to copy them on the full
    // disk, and reclaimed none of the dead segments after it — every pass
    // again. Then the least live first: the most space for the copying.
    let mut chosen: Vec<_> = if pressure {
        let dead: Vec<_> = wanted
            .iter()
            .filter(|u| u.live_bytes == 0)
            .copied()
            .collect();
        if dead.is_empty() {
            let mut least_live = wanted;
            least_live.sort_by_key(|u| u.live_bytes);
            least_live
        } else {
            dead
        }
    } else {
        wanted
    };
    chosen.truncate(config.relocation_segments_per_pass as usize);
    let chosen: Vec<_> = chosen.iter().map(|u| u.segment).collect();
    let candidates: Vec<_> = reclaimable
        .into_iter()
        .filter(|id| chosen.contains(id))
        .collect();
    if candidates.is_empty() {
        return Ok(false);
    }
    let full = candidates.len() == config.relocation_segments_per_pass as usize;
    let filter = state.filter();
    inner.relocate_out_of(&candidates, &*filter, Some(config.relocation_bytes_per_sec))?;
    Metrics::add(&inner.metrics.counters().relocation_passes, 1);
    Ok(full)
}
