//! Writing control-region snapshots, and collecting index-log garbage after
//! them.
//!
//! A snapshot, in order:
//! 1. read the WAL's processed watermark P0 and the application state;
//! 2. for each cell, record its on-disk index (its blobs) and its replay position
//!    `min(oldest unflushed change, P0)`; `replay_from` is the least of them
//!    (P0 if none is lower);
//! 3. make the value WAL durable up to the current processed watermark
//!    (every entry a flushed index points at lies below it);
//! 4. make the index log durable (every blob the snapshot references);
//! 5. replace the control file crash-safely (unless it already holds
//!    exactly this data: nothing changed since the last snapshot);
//! 6. delete index segments that neither this snapshot nor any cell
//!    references.
//!
//! Why nothing is lost: a write below P0 had updated its cell before the
//! watermark passed it, so it is either in a flushed blob (durable by step
//! 4) or an unflushed change at or after its cell's replay position; a write
//! at or after P0 is replayed because `replay_from <= P0`.

use std::collections::BTreeSet;

use crate::control::{CONTROL_FILE, CellControl, ControlData, SpaceControl};
use crate::engine::Inner;
use crate::error::{Error, Result};
use crate::index::layers::layer_refs;
use crate::metrics::Metrics;
use crate::storage::write_file_atomically;
use crate::types::{SegmentId, WalPosition};

/// Writes a snapshot (one at a time) and collects index garbage.
pub(crate) fn write_snapshot(inner: &Inner) -> Result<()> {
    write_snapshot_then(inner, |_| Ok(()))
}

/// Writes a snapshot, collects index garbage, and runs `then` on the new
/// control data before another snapshot can start.
pub(crate) fn write_snapshot_then<T>(
    inner: &Inner,
    then: impl FnOnce(&ControlData) -> Result<T>,
) -> Result<T> {
    let mut last = inner.last_snapshot.lock();
    inner.health.check()?;
    let p0 = inner.values.processed().0;
    let app_state = crate::replication::current_app_state(inner);
    let mut replay_from = p0;
    let mut spaces = Vec::new();
    for space in &inner.table.spaces {
        let mut cells = Vec::new();
        for id in space.cell_ids() {
            space.with_cell(&id, |cell| {
                if !cell.layers.is_empty() || !cell.changes.is_empty() {
                    let cell_replay = cell.dirty_since.min(p0);
                    replay_from = replay_from.min(cell_replay);
                    cells.push(CellControl {
                        id,
                        layers: layer_refs(&cell.layers),
                        replay_from: cell_replay,
                    });
                }
            });
        }
        spaces.push(SpaceControl {
            config: space.config.clone(),
            cells,
        });
    }
    inner.values.wait_synced(inner.values.processed())?;
    inner.index.log.sync_now()?;
    let data = ControlData {
        log_id: inner.log_id,
        wal_segment_bytes: inner.config.wal_segment_bytes,
        index_segment_bytes: inner.config.index_segment_bytes,
        epoch: inner.values.epoch(),
        replay_from: WalPosition(replay_from),
        synced: inner.values.synced(),
        app_state,
        spaces,
    };
    // The control file holds the last snapshot written (or read at open):
    // an engine with nothing new since keeps it instead of rewriting the
    // same bytes (two fsyncs, and a node's idle replicas did that every
    // interval).
    if last.as_ref() != Some(&data) {
        let path = inner.config.dir.join(CONTROL_FILE);
        write_file_atomically(&*inner.storage, &path, &data.encode())
            .map_err(|e| inner.health.poison_unless_full(Error::io(&path, e)))?;
        Metrics::add(&inner.metrics.counters().snapshots, 1);
    } else {
        Metrics::add(&inner.metrics.counters().snapshots_unchanged, 1);
    }
    collect_index_garbage(inner, &data)?;
    let result = then(&data);
    *last = Some(data);
    result
}

/// Deletes sealed index segments that hold no blob referenced by the
/// durable snapshot or by any cell.
fn collect_index_garbage(inner: &Inner, durable: &ControlData) -> Result<()> {
    let _exclusive = inner.index_gc.write();
    let size = inner.config.index_segment_bytes;
    let mut live: BTreeSet<SegmentId> = durable.index_segments();
    inner.table.for_each_cell(|_, _, cell| {
        for layer in cell.layers.iter() {
            live.insert(SegmentId(layer.disk.position.0 / size));
        }
    });
    let active = inner.index.log.active_segment();
    let mut deleted = 0;
    for segment in inner.index.log.segments() {
        if segment.id < active && !live.contains(&segment.id) {
            inner.index.log.delete_segment(segment.id)?;
            deleted += 1;
        }
    }
    if deleted > 0 {
        inner.index.log.sync_dir()?;
        Metrics::add(&inner.metrics.counters().index_segments_deleted, deleted);
    }
    Ok(())
}
