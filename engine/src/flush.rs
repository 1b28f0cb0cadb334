//! Index flushing and the background threads that drive it.
//!
//! A flush of one cell:
//! 1. under the cell's lock, take the changes below the WAL's processed
//!    watermark (everything below it is complete in the log) and the current
//!    index (loaded entries, or where it lives on disk); mark the cell
//!    flushing;
//! 2. without the lock, read the on-disk index if it is not loaded, merge
//!    the changes into it (newest entry per key; tombstones drop keys) and
//!    append the result to the index log as one blob;
//! 3. under the lock, swap the cell to the new blob and remove each flushed
//!    change that was not superseded meanwhile ("unmerge").
//!
//! Readers see the old index plus all changes until step 3, and the new
//! index plus the remaining changes after it: never a partial view.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::engine::Inner;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::table::CellId;
use crate::table::cell::merge;

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
        Some((flushable, cell.base.clone(), cell.disk))
    });
    let Some((flushable, base, disk)) = job.flatten() else {
        return Ok(false);
    };
    // Held until the new blob is installed: index garbage collection must
    // not delete the segment of a blob that no cell references *yet*.
    let _reading = inner.index_gc.read();
    let written = (|| {
        let base = match (base, disk) {
            (Some(base), _) => base,
            (None, Some(disk)) => Arc::new(inner.index.load(&space.layout, &disk)?.0),
            (None, None) => Arc::new(Vec::new()),
        };
        let changes: Vec<_> = flushable.iter().map(|(k, c)| (*k, c.entry)).collect();
        let merged = merge(&base, &changes);
        let written = inner.index.write(&space.layout, &merged)?;
        Ok((merged, written))
    })();
    let (merged, written) = match written {
        Ok(result) => result,
        Err(error) => {
            space.with_cell(id, |cell| cell.flushing = false);
            return Err(inner.health.poison_unless_full(error));
        }
    };
    let index_bytes = written
        .as_ref()
        .map_or(0, |(disk, _)| disk.record_len(&space.layout));
    let (disk, bloom) = written.map_or((None, None), |(disk, bloom)| (Some(disk), Some(bloom)));
    space.with_cell(id, |cell| {
        let delta = cell.finish_flush(&flushable, disk, Arc::new(merged), bloom);
        inner.table.account(delta);
    });
    Metrics::add(&inner.metrics.counters.flushes, 1);
    Metrics::add(
        &inner.metrics.counters.index_bytes_written,
        index_bytes as u64,
    );
    Ok(true)
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
        // wait for it so that everything is flushed when this returns.
        while !flush_cell(inner, space, &id)? && is_flushing(inner, space, &id) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

fn is_flushing(inner: &Inner, space: u8, id: &CellId) -> bool {
    inner.table.spaces[usize::from(space)]
        .with_cell(id, |cell| cell.flushing)
        .unwrap_or(false)
}

/// A flusher thread: flushes queued cells until shutdown.
pub(crate) fn run_flusher(inner: Arc<Inner>) {
    while !inner.shutdown.load(Ordering::Acquire) && !inner.health.is_poisoned() {
        match inner.flush_rx.recv_timeout(Duration::from_millis(50)) {
            // A full disk leaves the cell dirty; maintenance queues it again.
            Ok((space, id)) => match flush_cell(&inner, space, &id) {
                Ok(_) | Err(Error::DiskFull(_)) => {}
                Err(_) => return,
            },
            Err(_) => continue,
        }
    }
}

/// The maintenance thread: every snapshot interval (or when woken), flushes
/// cells that hold up replay or exceed the change threshold, unloads cells
/// under memory pressure, and writes a snapshot.
pub(crate) fn run_maintenance(inner: Arc<Inner>) {
    let interval = Duration::from_millis(inner.config.snapshot_interval_ms);
    loop {
        {
            let (lock, condvar) = &inner.wake;
            let mut woken = lock.lock();
            if !*woken && !inner.shutdown.load(Ordering::Acquire) {
                condvar.wait_for(&mut woken, interval);
            }
            *woken = false;
        }
        if inner.shutdown.load(Ordering::Acquire) || inner.health.is_poisoned() {
            return;
        }
        let result = schedule_flushes(&inner)
            .map(|()| unload_under_pressure(&inner))
            .and_then(|()| crate::snapshot::write_snapshot(&inner));
        match result {
            // Nothing was written; try again next round.
            Ok(()) | Err(Error::DiskFull(_)) => {}
            Err(error) => {
                inner.health.poison(format!("maintenance failed: {error}"));
                return;
            }
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
            let _ = inner.flush_tx.send((space as u8, *id));
        }
    });
    for (space, id) in old {
        flush_cell(inner, space, &id)?;
    }
    Ok(())
}

/// Unloads loaded cells not referenced since the last sweep (a clock
/// algorithm) until the in-memory index fits its budget.
fn unload_under_pressure(inner: &Inner) {
    let budget = inner.config.index_memory_bytes;
    if inner.table.memory_bytes() <= budget {
        return;
    }
    for _sweep in 0..2 {
        inner.table.for_each_cell(|_, _, cell| {
            if inner.table.memory_bytes() <= budget || cell.base.is_none() {
                return;
            }
            if std::mem::take(&mut cell.referenced) {
                return;
            }
            let freed = cell.unload();
            inner.table.account(-(freed as isize));
            Metrics::add(&inner.metrics.counters.cell_unloads, 1);
        });
        if inner.table.memory_bytes() <= budget {
            return;
        }
    }
}

/// Asks every background thread of the engine to stop.
pub(crate) fn stop(inner: &Inner) {
    inner.shutdown.store(true, Ordering::Release);
    let (lock, condvar) = &inner.wake;
    *lock.lock() = true;
    condvar.notify_all();
}
