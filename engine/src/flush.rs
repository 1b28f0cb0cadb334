//! Index flushing and the background tasks that drive it.
//!
//! A flush of one cell:
//! 1. under the cell's lock, take the changes below the WAL's processed
//!    watermark (everything below it is complete in the log) and the current
//!    index (the merged entries if loaded, and the on-disk layers); mark the
//!    cell flushing;
//! 2. without the lock, either append the changes alone as a *delta* blob
//!    over the on-disk layers (no read), or *merge*: read the layers not
//!    in memory, merge the changes in (newest entry per key; tombstones drop
//!    keys) and append the result as a new *base* blob that replaces every
//!    layer (`index::layers::flush_kind` decides);
//! 3. under the lock, install the new layers and remove each flushed change
//!    that was not superseded meanwhile ("unmerge").
//!
//! Readers see the old layers plus all changes until step 3, and the new
//! layers plus the remaining changes after it: never a partial view.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::engine::Inner;
use crate::error::{Error, Result};
use crate::index::blob::BlobKind;
use crate::index::entry::{Entry, Key};
use crate::index::layers::{FlushKind, Layer, Layers, MAX_CELL_BLOBS, flush_kind, merge};
use crate::metrics::Metrics;
use crossbeam_channel::{Receiver, Sender};

use crate::pool::{Next, Waker};
use crate::table::cell::{BaseEntries, Change};
use crate::table::{CellId, SpaceTable};

/// What a flush captured under the cell's lock.
struct Job {
    flushable: Vec<(Key, Change)>,
    base: Option<BaseEntries>,
    layers: Layers,
}

/// Flushes one cell. Returns whether anything was written.
pub(crate) fn flush_cell(inner: &Inner, space_index: u8, id: &CellId) -> Result<bool> {
    let space = &inner.table.spaces[usize::from(space_index)];
    let processed = inner.values.processed().0;
    let job = space.with_cell(id, |cell| {
        cell.queued = false;
        if cell.flushing {
            return None;
        }
        let flushable = cell.flushable(processed);
        if flushable.is_empty() {
            return None;
        }
        cell.flushing = true;
        Some(Job {
            flushable,
            base: cell.base.clone(),
            layers: cell.layers.clone(),
        })
    });
    let Some(job) = job.flatten() else {
        return Ok(false);
    };
    // Held until the new blob is installed: index garbage collection must
    // not delete the segment of a blob that no cell references *yet*.
    let _reading = inner.index_gc.read();
    // Entries that add no key: deletes, and relocation's moves (each
    // replaces an entry of the same key with its copy's).
    let deletes = job
        .flushable
        .iter()
        .filter(|(_, change)| change.entry.tombstone() || change.record == Change::NO_RECORD)
        .count();
    let kind = flush_kind(
        &job.layers,
        job.flushable.len(),
        deletes,
        inner.config.index_max_deltas,
        inner.config.index_merge_ratio,
    );
    let written = write_flush(inner, space, &job, kind).and_then(|written| {
        if written.0.len() > MAX_CELL_BLOBS {
            return Err(Error::TooLarge {
                what: "index blobs of one cell",
                got: written.0.len() as u64,
                max: MAX_CELL_BLOBS as u64,
            });
        }
        Ok(written)
    });
    let (layers, merged, written) = match written {
        Ok(result) => result,
        Err(error) => {
            space.with_cell(id, |cell| cell.flushing = false);
            return Err(inner.health.poison_unless_full(error));
        }
    };
    space.with_cell(id, |cell| {
        debug_assert!(
            crate::index::layers::same_layers(&cell.layers, &job.layers),
            "only a flush changes a cell's layers, one at a time"
        );
        let delta = cell.finish_flush(&job.flushable, layers, merged);
        inner.table.account(delta);
    });
    let counters = &inner.metrics.counters();
    Metrics::add(&counters.flushes, 1);
    Metrics::add(&counters.index_bytes_written, written as u64);
    if kind == FlushKind::Delta {
        Metrics::add(&counters.delta_flushes, 1);
    }
    Ok(true)
}

/// Step 2 of a flush: writes the delta or the merged base. Returns the new
/// layers, the new merged index if the flush computed it (the cell was
/// loaded, or it merged), and the bytes written.
fn write_flush(
    inner: &Inner,
    space: &SpaceTable,
    job: &Job,
    kind: FlushKind,
) -> Result<(Layers, Option<BaseEntries>, usize)> {
    let changes: Vec<(Key, Entry)> = job.flushable.iter().map(|(k, c)| (*k, c.entry)).collect();
    let key_len = space.key_len();
    // One blob, or parts when it outgrows a record of the index log.
    let write = |entries: &[(Key, Entry)], kind: BlobKind| -> Result<(Vec<Layer>, usize)> {
        let written = inner.index.write_parts(key_len, entries, kind)?;
        let bytes = written
            .iter()
            .map(|(disk, _)| disk.record_len(key_len))
            .sum();
        let layers = written
            .into_iter()
            .map(|(disk, bloom)| Layer {
                disk,
                bloom: Some(bloom),
                kind,
            })
            .collect();
        Ok((layers, bytes))
    };
    match kind {
        FlushKind::Delta => {
            let (delta, bytes) = write(&changes, BlobKind::Delta)?;
            debug_assert!(!delta.is_empty(), "a delta of at least one change");
            let mut layers = job.layers.to_vec();
            layers.extend(delta);
            let merged = job
                .base
                .as_ref()
                .map(|base| Arc::new(merge(base, &changes)));
            Ok((layers.into(), merged, bytes))
        }
        FlushKind::Merge => {
            let current = match &job.base {
                Some(base) => base.clone(),
                None => Arc::new(inner.index.load_layers(key_len, &job.layers)?.0),
            };
            let merged = merge(&current, &changes);
            let (layers, bytes) = write(&merged, BlobKind::Base)?;
            Ok((layers.into(), Some(Arc::new(merged)), bytes))
        }
    }
}

/// Flushes every cell with flushable changes, on the calling thread.
pub(crate) fn flush_all(inner: &Inner) -> Result<()> {
    let mut dirty = Vec::new();
    inner.table.for_each_cell(|space, id, cell| {
        if !cell.changes.is_empty() {
            dirty.push((space as u8, *id));
        }
    });
    for (space, id) in dirty {
        // A flush already running on another thread finishes on its own;
        // wait for it, then look again: it took its changes before this
        // call, so what came after them is still to flush. (Before, a
        // flush that ended between the two checks ended the wait with
        // such changes unflushed — an epoch drop's markers among them,
        // which the drop's snapshot then left out.)
        loop {
            if flush_cell(inner, space, &id)? {
                break;
            }
            if is_flushing(inner, space, &id) {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            if !has_flushable(inner, space, &id) {
                break;
            }
        }
    }
    Ok(())
}

fn has_flushable(inner: &Inner, space: u8, id: &CellId) -> bool {
    let processed = inner.values.processed().0;
    inner.table.spaces[usize::from(space)]
        .with_cell(id, |cell| !cell.flushable(processed).is_empty())
        .unwrap_or(false)
}

fn is_flushing(inner: &Inner, space: u8, id: &CellId) -> bool {
    inner.table.spaces[usize::from(space)]
        .with_cell(id, |cell| cell.flushing)
        .unwrap_or(false)
}

/// How often an idle flusher task looks at its queue anyway (a queued cell
/// wakes it).
pub(crate) const FLUSHER_LOOK: Duration = Duration::from_secs(1);

/// Cells a flusher task flushes per run before giving its thread back.
const FLUSHES_PER_RUN: usize = 16;

/// The cells waiting for a flusher, and the flushers to wake. Each cell
/// is queued at most once at a time (its `queued` flag, set by whoever
/// queues it), so the unbounded channel holds at most one item per cell.
#[derive(Debug)]
pub(crate) struct FlushQueue {
    sender: Sender<(u8, CellId)>,
    receiver: Receiver<(u8, CellId)>,
    /// Set once the flusher tasks are registered.
    flushers: OnceLock<Vec<Waker>>,
    /// Picks the flusher the next queued cell wakes.
    next: AtomicUsize,
}

impl FlushQueue {
    pub fn new() -> FlushQueue {
        let (sender, receiver) = crossbeam_channel::unbounded();
        FlushQueue {
            sender,
            receiver,
            flushers: OnceLock::new(),
            next: AtomicUsize::new(0),
        }
    }

    /// Gives the queue the flusher tasks it wakes (once, at open).
    pub fn set_flushers(&self, flushers: Vec<Waker>) {
        let _ = self.flushers.set(flushers);
    }

    /// Queues a cell whose `queued` flag the caller set, and wakes one
    /// flusher (in turn) for it.
    pub fn push_and_wake(&self, space: u8, id: CellId) {
        self.push(space, id);
        if let Some(flushers) = self.flushers.get().filter(|f| !f.is_empty()) {
            let next = self.next.fetch_add(1, Ordering::Relaxed);
            flushers[next % flushers.len()].wake();
        }
    }

    /// Queues a cell whose `queued` flag the caller set; a flusher finds
    /// it at its next look (within [`FLUSHER_LOOK`]) or wake.
    fn push(&self, space: u8, id: CellId) {
        // The receiver lives as long as the sender: sending cannot fail.
        let _ = self.sender.send((space, id));
    }

    fn pop(&self) -> Option<(u8, CellId)> {
        self.receiver.try_recv().ok()
    }

    fn wake_all(&self) {
        for flusher in self.flushers.get().into_iter().flatten() {
            flusher.wake();
        }
    }
}

/// A flusher task's run: flushes queued cells.
pub(crate) fn run_flusher(inner: &Inner) -> Next {
    for _ in 0..FLUSHES_PER_RUN {
        if inner.shutdown.load(Ordering::Acquire) || inner.health.is_poisoned() {
            return Next::Stop;
        }
        let Some((space, id)) = inner.flush_queue.pop() else {
            return Next::After(FLUSHER_LOOK);
        };
        match flush_cell(inner, space, &id) {
            // A full disk leaves the cell dirty; maintenance queues it again.
            Ok(_) | Err(Error::DiskFull(_)) => {}
            // The engine is poisoned.
            Err(_) => return Next::Stop,
        }
    }
    Next::Again
}

/// The maintenance task's run (every snapshot interval): flushes cells that
/// hold up replay or exceed the change threshold, unloads cells under
/// memory pressure, cleans the index log, and writes a snapshot.
pub(crate) fn run_maintenance(inner: &Inner) -> Next {
    if inner.shutdown.load(Ordering::Acquire) || inner.health.is_poisoned() {
        return Next::Stop;
    }
    let result = schedule_flushes(inner)
        .map(|()| unload_under_pressure(inner))
        .and_then(|()| crate::index_cleaning::clean(inner))
        .and_then(|_| crate::snapshot::write_snapshot(inner));
    match result {
        // Nothing was written; try again next round.
        Ok(()) | Err(Error::DiskFull(_)) => {
            Next::After(Duration::from_millis(inner.config.snapshot_interval_ms))
        }
        Err(error) => {
            inner.health.poison(format!("maintenance failed: {error}"));
            Next::Stop
        }
    }
}

/// Flushes (on this thread) cells whose oldest change is more than
/// `max_replay_bytes` behind, and queues cells over the change threshold.
fn schedule_flushes(inner: &Inner) -> Result<()> {
    let processed = inner.values.processed().0;
    let oldest_allowed = processed.saturating_sub(inner.config.max_replay_bytes);
    let threshold = inner.config.flush_dirty_entries as usize;
    let mut old = Vec::new();
    inner.table.for_each_cell(|space, id, cell| {
        if cell.dirty_since < oldest_allowed {
            old.push((space as u8, *id));
        } else if cell.changes.len() >= threshold && !cell.queued && !cell.flushing {
            cell.queued = true;
            inner.flush_queue.push(space as u8, *id);
        }
    });
    for (space, id) in old {
        flush_cell(inner, space, &id)?;
    }
    Ok(())
}

/// While the node's indexes are over their budget, or a cell load was
/// refused for want of room: unloads this engine's loaded cells not used
/// since its last round (one sweep of a clock per round, so that the cells
/// an engine keeps using stay loaded while other engines' idle ones go),
/// and if the indexes are still over the budget, queues its cells with
/// unflushed changes for flushing (a flushed change needs no memory).
fn unload_under_pressure(inner: &Inner) {
    if !inner.table.pressed() {
        return;
    }
    inner.table.for_each_cell(|_, _, cell| {
        if !inner.table.pressed() || cell.base.is_none() {
            return;
        }
        if std::mem::take(&mut cell.referenced) {
            return;
        }
        let freed = cell.unload();
        inner.table.account(-(freed as isize));
        Metrics::add(&inner.metrics.counters().cell_unloads, 1);
    });
    if !inner.table.over_budget(0) {
        return;
    }
    inner.table.for_each_cell(|space, id, cell| {
        if !cell.changes.is_empty() && !cell.queued && !cell.flushing {
            cell.queued = true;
            inner.flush_queue.push(space as u8, *id);
        }
    });
    inner.flush_queue.wake_all();
}

/// Asks every background task of the engine to stop (the engine then
/// unregisters them, waiting for runs under way).
pub(crate) fn stop(inner: &Inner) {
    inner.shutdown.store(true, Ordering::Release);
}
