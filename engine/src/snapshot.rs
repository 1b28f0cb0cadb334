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
//! 4. make the index log durable up to the end of every blob the snapshot
//!    references — waiting, if need be, for appends claimed before them
//!    that are still being copied: a flush on another thread may have
//!    installed a blob behind such a claim, past the processed prefix a
//!    plain sync covers (a snapshot that did not wait referenced bytes
//!    that were not durable, and a checkpoint, copying the index log up to
//!    its synced watermark, shipped zeros where the blob was);
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
    write_snapshot_seeing_moves(inner, |data, _| then(data))
}

/// [`write_snapshot_then`]; `then` also learns whether a cell held a move
/// (or a change covering one) not yet flushed when the snapshot took its
/// layers: then the snapshot's index may still point into a segment a
/// relocation emptied, and that segment must stay. Asked after the
/// snapshot instead, a move flushed meanwhile (the background flusher, or
/// a touch's record processed during the snapshot's syncs) read as
/// flushed in the snapshot too, and a segment its index still named was
/// deleted.
pub(crate) fn write_snapshot_seeing_moves<T>(
    inner: &Inner,
    then: impl FnOnce(&ControlData, bool) -> Result<T>,
) -> Result<T> {
    let mut last = inner.last_snapshot.lock();
    inner.health.check()?;
    let p0 = inner.values.processed().0;
    let app_state = crate::replication::current_app_state(inner);
    // Not past the open's while the application holds it (it has not
    // applied its records again yet: `Config::hold_replay_until_released`).
    let mut replay_from = p0.min(inner.replay_hold.load(std::sync::atomic::Ordering::Acquire));
    let mut index_end = 0u64;
    let mut held_moves = false;
    let mut spaces = Vec::new();
    for space in &inner.table.spaces {
        let mut cells = Vec::new();
        let key_len = space.key_len();
        for id in space.cell_ids() {
            space.with_cell(&id, |cell| {
                held_moves |= cell.holds_unflushed_move();
                for layer in cell.layers.iter() {
                    let end = layer.disk.position.0 + layer.disk.record_len(key_len) as u64;
                    index_end = index_end.max(end);
                }
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
    inner.index.log.wait_synced(WalPosition(index_end))?;
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
    let result = then(&data, held_moves);
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use crate::wal::format::{self, Kind};
    use crate::{Config, Durability, Engine, KeySpace};

    /// Regression (e2e soak: a learner's index log read "unwritten" right
    /// after it installed a snapshot). Index appends are claimed in order
    /// and copied concurrently; a flush on one thread can install a blob
    /// that lies after another thread's claim still being copied. A
    /// snapshot then synced only the processed prefix, below that blob:
    /// its control region referenced bytes that were not durable, and a
    /// checkpoint (which copies the index log up to its synced watermark)
    /// shipped zeros where the blob was. Every blob a snapshot references
    /// now starts below the synced watermark when the control is written.
    #[test]
    fn a_snapshot_makes_every_blob_it_references_durable_behind_an_append_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::for_tests(dir.path());
        config.snapshot_interval_ms = 60_000;
        config.relocation_enabled = false;
        let engine = Engine::open(config).unwrap();
        for i in 0..100u8 {
            engine
                .put(
                    KeySpace::default(),
                    &[i; 32],
                    b"value",
                    Durability::Buffered,
                )
                .unwrap();
        }
        let inner = &*engine.inner;
        let (claimed_tx, claimed_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            // An index append claimed and still being copied (a flusher
            // descheduled in the middle of its copy).
            s.spawn(move || {
                let body = [0u8; 64];
                inner
                    .index
                    .log
                    .append(format::record_len(body.len()), |buf, position| {
                        claimed_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                        format::write_plain(buf, position, Kind::IndexBlob, &body);
                    })
                    .unwrap();
            });
            claimed_rx.recv().unwrap();
            // Flushed on this thread: the blobs land after the claim.
            crate::flush::flush_all(inner).unwrap();
            let snapshot = s.spawn(|| {
                super::write_snapshot_then(inner, |control| {
                    let synced = inner.index.log.synced().0;
                    let mut layers = control
                        .spaces
                        .iter()
                        .flat_map(|s| &s.cells)
                        .flat_map(|c| &c.layers)
                        .peekable();
                    assert!(layers.peek().is_some(), "nothing was flushed");
                    Ok(layers.all(|d| d.position.0 < synced))
                })
            });
            std::thread::sleep(Duration::from_millis(200));
            release_tx.send(()).unwrap();
            assert!(
                snapshot.join().unwrap().unwrap(),
                "the control region references index blobs past the synced watermark"
            );
        });
    }
}
