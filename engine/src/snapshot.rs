//! Writing control-region snapshots, and collecting index-log garbage after
//! them.
//!
//! A snapshot, in order:
//! 1. read the WAL's processed watermark P0;
//! 2. under the application's hold of its state, read that state and, for
//!    each cell, record its on-disk index (its blobs) and its replay
//!    position `min(oldest unflushed change, P0)`; `replay_from` is the
//!    least of them (P0 if none is lower);
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
//! at or after P0 is replayed because `replay_from <= P0`. A replicated
//! record the application applied under its hold of the state before step
//! 2 is in the saved state and (as above) in the index or replayed; one it
//! applied after is in neither the state nor the saved on-disk index, and
//! the application applies it again as new.

use std::collections::BTreeSet;

use crate::control::{CONTROL_FILE, CellControl, ControlData, SpaceControl};
use crate::engine::Inner;
use crate::error::{Error, Result};
use crate::index::layers::{base_blobs, layer_refs};
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
    // The cells are read under the application's hold of its state: an
    // entry it applies (index effects and its own records of them, such as
    // a replica's write sessions) is wholly in both or in neither. Read
    // before the cells instead, the state missed an entry applied in
    // between whose effects a flush then put in the saved index: applied
    // again after a crash as if new, a put-if-absent found its own blob.
    let mut captured = None;
    let app_state = crate::replication::app_state_with(inner, &mut || {
        captured = Some(capture_cells(inner, p0));
    });
    let Captured {
        spaces,
        replay_from,
        index_end,
        held_moves,
    } = captured.expect("the application state source runs the capture");
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

/// The index state a snapshot saves, read from the cells.
struct Captured {
    spaces: Vec<SpaceControl>,
    /// The least replay position of a cell, P0, or the open's hold.
    replay_from: u64,
    /// The end of the last index blob a cell references.
    index_end: u64,
    /// Whether a cell held an unflushed move.
    held_moves: bool,
}

/// Reads every cell's on-disk index and replay position (step 2).
fn capture_cells(inner: &Inner, p0: u64) -> Captured {
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
                        base_blobs: u16::try_from(base_blobs(&cell.layers))
                            .expect("a flush installs at most MAX_CELL_BLOBS"),
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
    Captured {
        spaces,
        replay_from,
        index_end,
        held_moves,
    }
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
    use std::sync::{Arc, Weak, mpsc};
    use std::time::Duration;

    use parking_lot::Mutex;

    use crate::storage::{FaultStorage, Storage};
    use crate::wal::format::{self, Kind};
    use crate::{
        AppStateSource, Appended, Config, Durability, Engine, Epoch, ItemInput, ItemOp, KeySpace,
        Tag,
    };

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

    /// A snapshot reads the index under the application's hold of its
    /// state. It used to read the state first: an entry the application
    /// applied right after (the applier waiting for that hold) and a
    /// flush of its cell both came before the cells were read, so the
    /// saved index held the entry's effects while the saved state did not
    /// have it applied. A replica's sessions, re-deciding it after a crash,
    /// then found a put-if-absent's own blob there.
    #[test]
    fn a_snapshot_reads_the_index_under_the_application_state_hold() {
        let storage = FaultStorage::default();
        let mut config = Config::for_tests("/db");
        config.snapshot_interval_ms = 60_000;
        config.relocation_enabled = false;
        let open = |storage: &FaultStorage| {
            let storage: Arc<dyn Storage> = Arc::new(storage.clone());
            Engine::open_with_storage(config.clone(), storage).map(Arc::new)
        };
        let engine = open(&storage).unwrap();
        let space = KeySpace::default();
        let put = |key: &'static [u8; 32]| ItemInput {
            space,
            op: ItemOp::Put,
            key,
            value: b"value",
            epoch: Epoch(0),
            tag: Tag(0),
        };
        let first = engine.append(b"1", &[put(&[1; 32])]).unwrap();
        let second = engine.append(b"2", &[put(&[2; 32])]).unwrap();
        engine.wait_synced(second.end).unwrap();
        engine.apply(&first).unwrap();
        engine.flush().unwrap();

        let source = Arc::new(Applier {
            applied: Mutex::new(1),
            waiting: Mutex::new(Some((Arc::downgrade(&engine), second))),
        });
        engine.set_app_state_source(source.clone());
        engine.write_control_snapshot().unwrap();
        assert_eq!(*source.applied.lock(), 2, "the second entry was applied");
        // A kill -9 now; the engine's close would snapshot again.
        let image = storage.restart_process();
        drop(engine);

        let engine = open(&image).unwrap();
        assert_eq!(engine.app_state(), vec![1], "the saved state");
        assert_eq!(
            engine.get(space, &[1; 32]).unwrap().as_deref(),
            Some(&b"value"[..])
        );
        assert_eq!(
            engine.get(space, &[2; 32]).unwrap(),
            None,
            "the saved index holds an entry the saved state has not applied"
        );
    }

    /// An application whose state is the last entry it applied; `waiting`
    /// is an entry an applier applies (and a flusher flushes) the moment
    /// the state's hold is released.
    struct Applier {
        applied: Mutex<u8>,
        waiting: Mutex<Option<(Weak<Engine>, Appended)>>,
    }

    impl AppStateSource for Applier {
        fn app_state_with(&self, capture: &mut dyn FnMut()) -> Vec<u8> {
            let state = {
                let applied = self.applied.lock();
                capture();
                vec![*applied]
            };
            if let Some((engine, entry)) = self.waiting.lock().take() {
                let engine = engine.upgrade().expect("the engine is open");
                let mut applied = self.applied.lock();
                engine.apply(&entry).unwrap();
                *applied = 2;
                crate::flush::flush_all(&engine.inner).unwrap();
            }
            state
        }
    }
}
