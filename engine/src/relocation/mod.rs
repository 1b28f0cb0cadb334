//! Relocation: giving the space of overwritten, deleted and dropped values
//! back without blocking writers.
//!
//! A pass copies the *live* entries out of old WAL segments to the tail
//! (`mover`), repoints the index with compare-and-set (a newer write always
//! wins), flushes the index and writes a snapshot, and only then deletes the
//! segment files whole (`reclaim`). Two ways to find the live entries:
//! - **WAL-based**: read the oldest segments record by record and keep the
//!   items the index still points at;
//! - **index-based**: walk the cells and take the entries below a cutoff.
//!
//! An application filter decides per entry: keep (copy it), drop (remove
//! it), or stop (end the pass). See `docs/design/relocation.md`.

mod census;
mod mover;
mod policy;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::engine::{Engine, Inner};
use crate::error::{Error, Result};
use crate::index::entry::key_array;
use crate::metrics::Metrics;
use crate::types::{Epoch, KeySpace, SegmentId, Tag, WalPosition};
use crate::wal::format::{Kind, Op};
use crate::wal::replay::{self, Stop};

pub use census::SegmentUsage;
pub(crate) use census::census;
pub(crate) use mover::Mover;
pub use mover::RelocationReport;
pub(crate) use policy::Relocator;

/// What a relocation filter says about one entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Keep the entry (copy it forward if its segment is reclaimed).
    Keep,
    /// Remove the entry: its key reads as absent afterwards.
    Drop,
    /// Keep this and every remaining entry; end the pass.
    Stop,
}

/// What a filter sees of an entry (never its value: deciding costs no I/O).
#[derive(Clone, Copy, Debug)]
pub struct EntryInfo<'a> {
    /// Key space.
    pub key_space: KeySpace,
    /// The key.
    pub key: &'a [u8],
    /// Epoch of the entry's last write or touch.
    pub epoch: Epoch,
    /// Application tag.
    pub tag: Tag,
    /// Bytes of the item holding the value (header, key and value).
    pub item_bytes: u32,
    /// Where the value is now.
    pub position: WalPosition,
}

/// The application's say in relocation and epoch drops. Must be
/// deterministic (the same answer for the same entry) where replicas must
/// agree, as in epoch drops.
pub trait RelocationFilter: Send + Sync {
    /// Keep, drop, or stop.
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision;
}

/// The default filter: keeps everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct KeepAll;

impl RelocationFilter for KeepAll {
    fn decide(&self, _entry: &EntryInfo<'_>) -> Decision {
        Decision::Keep
    }
}

/// What relocation keeps in the engine, and only this module reaches
/// into: the turn that relocation passes, epoch drops and checkpoints
/// take one at a time, the filter, the log retention, and the last census
/// (which background passes, the metrics and [`Engine::data_bytes`] read).
pub(crate) struct RelocationState {
    /// One relocation pass, epoch drop or checkpoint at a time.
    turn: Mutex<()>,
    /// Epoch drops and checkpoints waiting for the turn: a background
    /// pass gives it up at its next entry (see [`RelocationState::yielding`]).
    waiting: std::sync::atomic::AtomicUsize,
    /// The filter background relocation and its census use.
    filter: parking_lot::RwLock<Arc<dyn RelocationFilter>>,
    /// Segments holding positions at or after this are never deleted.
    retention: AtomicU64,
    /// The last census.
    census: Mutex<Vec<SegmentUsage>>,
    /// The processed watermark when `census` began (0: no census since the
    /// engine opened or its filter changed).
    census_at: AtomicU64,
    /// The bytes relocation had written when `census` began.
    census_relocated: AtomicU64,
    /// The processed watermark when background relocation last took a
    /// census (0: take one at the next pass).
    census_processed: AtomicU64,
    /// Segments holding a live value that could not be read (since the
    /// engine opened): kept, and no longer background candidates — else
    /// as many of them as a pass takes held every pass on themselves.
    unreadable: Mutex<std::collections::BTreeSet<u64>>,
}

impl RelocationState {
    /// The state of an engine opening; `retain_log` keeps every segment
    /// until the application sets the log retention
    /// ([`Config::retain_log_until_set`](crate::Config::retain_log_until_set)).
    pub fn new(retain_log: bool) -> RelocationState {
        RelocationState {
            turn: Mutex::new(()),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            filter: parking_lot::RwLock::new(Arc::new(KeepAll)),
            retention: AtomicU64::new(if retain_log { 0 } else { u64::MAX }),
            census: Mutex::new(Vec::new()),
            census_at: AtomicU64::new(0),
            census_relocated: AtomicU64::new(0),
            census_processed: AtomicU64::new(0),
            unreadable: Mutex::new(std::collections::BTreeSet::new()),
        }
    }

    /// Waits for the running relocation pass, epoch drop or checkpoint to
    /// end; none starts while the guard is held.
    pub fn take_turn(&self) -> MutexGuard<'_, ()> {
        self.turn.lock()
    }

    /// [`RelocationState::take_turn`] for an epoch drop or a checkpoint,
    /// which run on an application's critical thread (a node's Raft
    /// thread): a background pass under way stops at its next entry
    /// instead of running to its end (seconds of rate-limited copying, a
    /// Raft leader's heartbeats stalled behind it and its leadership lost).
    pub fn take_turn_first(&self) -> MutexGuard<'_, ()> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let guard = self.turn.lock();
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    /// Whether an epoch drop or checkpoint waits for the turn: a background
    /// pass stops (what it copied stays valid; the segments it was
    /// emptying are not reclaimed this time, and the next pass goes on).
    pub fn yielding(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// The filter in force.
    pub fn filter(&self) -> Arc<dyn RelocationFilter> {
        self.filter.read().clone()
    }

    /// Asks the next background pass for a census, however little was
    /// written since the last one (new garbage that came without writes).
    pub fn request_census(&self) {
        self.census_processed.store(0, Ordering::Release);
    }

    /// The last census (empty before the first).
    pub fn last_census(&self) -> Vec<SegmentUsage> {
        self.census.lock().clone()
    }

    /// Segments holding positions at or after this are never deleted.
    fn retention(&self) -> u64 {
        self.retention.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for RelocationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelocationState")
            .field("retention", &self.retention)
            .field("census_at", &self.census_at)
            .field("census_processed", &self.census_processed)
            .finish_non_exhaustive()
    }
}

/// How to pick what to relocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Read the oldest sealed segments (at most this many) record by record
    /// and keep what the index still points at.
    Wal {
        /// Segments to process.
        segments: usize,
    },
    /// Walk the index and relocate every entry below this position; then
    /// reclaim the segments entirely below it.
    Index {
        /// The cutoff.
        below: WalPosition,
    },
}

impl Inner {
    /// The filter view of an entry.
    pub(crate) fn info<'k>(
        &self,
        space: u8,
        key: &'k [u8],
        entry: &crate::index::entry::Entry,
    ) -> EntryInfo<'k> {
        EntryInfo {
            key_space: KeySpace(space),
            key,
            epoch: entry.epoch,
            tag: entry.tag,
            item_bytes: entry.len,
            position: WalPosition(entry.location),
        }
    }

    /// Sealed segments (not active, not retained for the application, and
    /// every write into them finished), oldest first.
    ///
    /// Finished matters: the log rolls to its next segment without waiting
    /// for writes that claimed room in the last one, and a put points the
    /// index at its value only once its bytes are copied. A drop or a
    /// relocation pass that walked the index meanwhile did not see that
    /// put, found its segment emptied, and deleted it under the value just
    /// acknowledged (the engine's own API; a node applies puts and drops
    /// on one thread). Below the processed watermark every write is
    /// complete and indexed.
    pub(crate) fn sealed_segments(&self) -> Vec<Arc<crate::wal::segment::SegmentFile>> {
        let active = self.values.active_segment();
        let size = self.config.wal_segment_bytes;
        let finished = self.relocation.retention().min(self.values.processed().0);
        self.values
            .segments()
            .into_iter()
            .filter(|s| s.id < active && (s.id.0 + 1) * size <= finished)
            .collect()
    }

    /// WAL-based relocation of `segments`.
    pub(crate) fn relocate_segments(
        &self,
        segments: &[Arc<crate::wal::segment::SegmentFile>],
        filter: &dyn RelocationFilter,
        rate: Option<u64>,
    ) -> Result<RelocationReport> {
        let mut mover = Mover::new(self, rate);
        let mut emptied = Vec::new();
        for segment in segments {
            let (clean, stopped) = self.relocate_segment(segment, filter, &mut mover)?;
            if stopped {
                mover.report.stopped = true;
                break;
            }
            if clean {
                emptied.push(segment.id);
            }
        }
        mover.finish()?;
        // A segment whose entry a drop found touched since holds it still.
        emptied.retain(|id| !mover.kept_segments.contains(&id.0));
        let mut report = std::mem::take(&mut mover.report);
        self.reclaim(&emptied, &mut report)?;
        Ok(report)
    }

    /// Relocates the live items of one segment. Returns whether the whole
    /// segment was read (no damage) and whether the filter stopped.
    fn relocate_segment(
        &self,
        segment: &Arc<crate::wal::segment::SegmentFile>,
        filter: &dyn RelocationFilter,
        mover: &mut Mover<'_>,
    ) -> Result<(bool, bool)> {
        let opts = self.values.options();
        let only = BTreeMap::from([(segment.id, segment.clone())]);
        let base = WalPosition(segment.id.0 * opts.segment_size);
        let mut stopped = false;
        let end = replay::replay(opts, &only, base, |position, view| {
            if stopped || view.header.kind != Kind::Entry {
                return Ok(());
            }
            for (offset, item) in view.items() {
                if item.op != Op::Put || stopped {
                    continue;
                }
                let location = position.0 + offset as u64;
                let space = usize::from(item.key_space);
                let Some(table) = self.table.spaces.get(space) else {
                    continue;
                };
                let key = key_array(item.key);
                let Some(current) = self.lookup(table, &key)? else {
                    continue;
                };
                if current.location != location {
                    continue; // superseded: garbage
                }
                match filter.decide(&self.info(item.key_space, item.key, &current)) {
                    Decision::Keep => {
                        mover.relocate(item.key_space, key, current, item.value.to_vec())?
                    }
                    Decision::Drop => mover.drop_entry(item.key_space, &key, current)?,
                    Decision::Stop => stopped = true,
                }
            }
            Ok(())
        })?;
        Ok((end.stop == Stop::End, stopped))
    }

    /// Index-based relocation of the entries living in `segments` (what the
    /// background policy uses: the walk touches only the index, and only the
    /// live values are read), then reclaims the segments.
    pub(crate) fn relocate_out_of(
        &self,
        segments: &[SegmentId],
        filter: &dyn RelocationFilter,
        rate: Option<u64>,
    ) -> Result<RelocationReport> {
        let size = self.config.wal_segment_bytes;
        let targets: std::collections::BTreeSet<u64> = segments.iter().map(|s| s.0).collect();
        let (mut report, kept) =
            self.move_entries(filter, rate, |e| targets.contains(&(e.location / size)))?;
        if report.stopped && rate.is_some() {
            // A background pass that gave way to an epoch drop or a
            // checkpoint: reclaiming would flush every cell and write a
            // snapshot (seconds, while the other waits on its critical
            // thread) to delete nothing. Its copies and repointed entries
            // are ordinary index changes, flushed in the background.
            return Ok(report);
        }
        let emptied = if report.stopped {
            Vec::new()
        } else {
            segments
                .iter()
                .copied()
                .filter(|id| !kept.contains(&id.0))
                .collect()
        };
        self.reclaim(&emptied, &mut report)?;
        Ok(report)
    }

    /// Index-based relocation of every entry below `below`, then reclaims
    /// the sealed segments entirely below it.
    pub(crate) fn relocate_below(
        &self,
        below: WalPosition,
        filter: &dyn RelocationFilter,
    ) -> Result<RelocationReport> {
        // Never past what the WAL held when the pass began: its own copies
        // (and writes racing it) land after that, and a segment they fill
        // is not emptied (asked for everything, `WalPosition(u64::MAX)`,
        // the pass deleted the segments holding its copies).
        let below = WalPosition(below.0.min(self.values.processed().0));
        let (mut report, kept) = self.move_entries(filter, None, |e| e.location < below.0)?;
        let size = self.config.wal_segment_bytes;
        let emptied: Vec<SegmentId> = if report.stopped {
            Vec::new()
        } else {
            self.sealed_segments()
                .iter()
                .filter(|s| (s.id.0 + 1) * size <= below.0 && !kept.contains(&s.id.0))
                .map(|s| s.id)
                .collect()
        };
        self.reclaim(&emptied, &mut report)?;
        Ok(report)
    }

    /// Walks every cell and hands each live entry `select` picks to the
    /// filter: copies it forward or drops it, until the filter says stop.
    /// Also returns the segments a drop found still holding a changed
    /// entry (`Mover::kept_segments`): not to be reclaimed.
    fn move_entries(
        &self,
        filter: &dyn RelocationFilter,
        rate: Option<u64>,
        select: impl Fn(&crate::index::entry::Entry) -> bool,
    ) -> Result<(RelocationReport, std::collections::BTreeSet<u64>)> {
        let mut mover = Mover::new(self, rate);
        let mut stopped = false;
        // A background pass (rate-limited) gives way to a drop or a
        // checkpoint waiting for its turn.
        let background = rate.is_some();
        'spaces: for (space_index, space) in self.table.spaces.iter().enumerate() {
            for id in space.cell_ids() {
                for (key, entry) in self.cell_entries(space, &id)? {
                    if background && self.relocation.yielding() {
                        stopped = true;
                        break 'spaces;
                    }
                    if select(&entry)
                        && !self.keep_or_drop(
                            space_index as u8,
                            space,
                            &key,
                            entry,
                            filter,
                            &mut mover,
                        )?
                    {
                        stopped = true;
                        break 'spaces;
                    }
                }
            }
        }
        mover.finish()?;
        let mut report = std::mem::take(&mut mover.report);
        report.stopped = stopped;
        Ok((report, std::mem::take(&mut mover.kept_segments)))
    }

    /// Applies the filter to one live entry: copies it forward or drops it.
    /// Returns `false` if the filter said stop.
    fn keep_or_drop(
        &self,
        space_index: u8,
        space: &crate::table::SpaceTable,
        key: &crate::index::entry::Key,
        entry: crate::index::entry::Entry,
        filter: &dyn RelocationFilter,
        mover: &mut Mover<'_>,
    ) -> Result<bool> {
        match filter.decide(&self.info(space_index, &key[..space.key_len()], &entry)) {
            Decision::Keep => match self.read_value(space, key, &entry) {
                Ok(value) => mover.relocate(space_index, *key, entry, value.to_vec())?,
                // A value that fails its checksum, or that the disk will not
                // read, stays where it is and keeps its segment: the pass
                // goes on. Failing the pass instead stopped reclamation for
                // good — the oldest segments come back as candidates every
                // pass, each pass failed on the same record before it
                // reclaimed anything, and the disk filled.
                Err(Error::Corrupt { .. } | Error::Io { .. }) => {
                    let segment = entry.location / self.config.wal_segment_bytes;
                    mover.kept_segments.insert(segment);
                    mover.report.entries_unreadable += 1;
                    if self.relocation.unreadable.lock().insert(segment) {
                        Metrics::add(&self.metrics.counters().unreadable_values, 1);
                    }
                }
                Err(error) => return Err(error),
            },
            Decision::Drop => mover.drop_entry(space_index, key, entry)?,
            Decision::Stop => return Ok(false),
        }
        Ok(true)
    }

    /// Deletes `segments`, whose live entries have all been moved or
    /// dropped, once nothing can reference them:
    /// 1. flush every cell (the moves and drops reach the on-disk index);
    /// 2. write a snapshot (the index, the copies and the control region are
    ///    durable, and `replay_from` moves past the segments);
    /// 3. delete each segment that ends at or below the durable
    ///    `replay_from`, the synced watermark and the application's
    ///    retention, and is not active — provided no move or drop was
    ///    unflushed when the snapshot took the cells' layers, nor is now;
    /// 4. sync the directory.
    ///
    /// A reader that found an entry in a deleted segment before step 3 still
    /// reads it (the file stays open); one that looks after finds the new
    /// location in the index and retries.
    pub(crate) fn reclaim(
        &self,
        segments: &[SegmentId],
        report: &mut RelocationReport,
    ) -> Result<()> {
        crate::flush::flush_all(self)?;
        crate::index_cleaning::clean(self)?;
        let (replay_from, held_moves) =
            crate::snapshot::write_snapshot_seeing_moves(self, |control, held_moves| {
                Ok((control.replay_from.0, held_moves))
            })?;
        if segments.is_empty() || held_moves || self.has_unflushed_moves() {
            return Ok(());
        }
        let limit = replay_from
            .min(self.values.synced().0)
            .min(self.relocation.retention());
        let active = self.values.active_segment();
        let size = self.config.wal_segment_bytes;
        let mut deleted = 0;
        for id in segments {
            if *id < active && (id.0 + 1) * size <= limit {
                self.values.delete_segment(*id)?;
                deleted += 1;
            }
        }
        if deleted > 0 {
            self.values.sync_dir()?;
            report.segments_deleted += deleted;
            report.bytes_reclaimed += deleted * size;
            Metrics::add(&self.metrics.counters().segments_deleted, deleted);
            Metrics::add(&self.metrics.counters().bytes_reclaimed, deleted * size);
        }
        Ok(())
    }

    /// Whether any move or drop is still only in memory (or a change that
    /// replaced one since: a touch or write of a moved key not yet
    /// processed when the flush came left the move unflushed under it).
    fn has_unflushed_moves(&self) -> bool {
        let mut found = false;
        self.table.for_each_cell(|_, _, cell| {
            found |= cell.holds_unflushed_move();
        });
        found
    }
}

impl Engine {
    /// Sets the filter background relocation (and its census) uses
    /// (default: keep all). The next background pass takes a census, so
    /// entries the new filter drops are found without waiting for writes.
    pub fn set_relocation_filter(&self, filter: Arc<dyn RelocationFilter>) {
        let state = &self.inner.relocation;
        *state.filter.write() = filter;
        state.census_processed.store(0, Ordering::Release);
        state.census_at.store(0, Ordering::Release);
    }

    /// Runs one relocation pass now, with the configured filter and no rate
    /// limit, and reclaims the segments it empties.
    pub fn relocate(&self, strategy: Strategy) -> Result<RelocationReport> {
        let inner = &*self.inner;
        inner.health.check()?;
        let _turn = inner.relocation.take_turn();
        let filter = inner.relocation.filter();
        let report = match strategy {
            Strategy::Wal { segments } => {
                let oldest: Vec<_> = inner.sealed_segments().into_iter().take(segments).collect();
                inner.relocate_segments(&oldest, &*filter, None)?
            }
            Strategy::Index { below } => inner.relocate_below(below, &*filter)?,
        };
        Metrics::add(&inner.metrics.counters().relocation_passes, 1);
        Ok(report)
    }

    /// Live and total bytes of every WAL segment, from a walk of the whole
    /// index (no value is read).
    pub fn segment_usage(&self) -> Result<Vec<SegmentUsage>> {
        self.inner.health.check()?;
        census(&self.inner)
    }

    /// Bytes of the values the index holds: the live bytes of the last
    /// census plus every byte the application wrote since (not
    /// relocation's copies; an upper bound: newer writes may replace older
    /// ones). `None` until a census ran since the engine opened or its
    /// relocation filter changed (values the filter drops are not counted).
    pub fn data_bytes(&self) -> Option<u64> {
        let inner = &*self.inner;
        let state = &inner.relocation;
        let at = state.census_at.load(Ordering::Acquire);
        if at == 0 {
            return None;
        }
        let relocated = census::relocated_bytes(inner)
            .saturating_sub(state.census_relocated.load(Ordering::Acquire));
        let written = inner.values.processed().0.saturating_sub(at);
        let live: u64 = state.census.lock().iter().map(|u| u.live_bytes).sum();
        Some(live + written.saturating_sub(relocated))
    }

    /// Keeps every WAL segment holding a position at or after `from` (a
    /// replication layer keeps its uncompacted log this way); `u64::MAX`
    /// keeps nothing extra. Until the first call an engine keeps nothing
    /// extra, or everything with [`Config::retain_log_until_set`](crate::Config::retain_log_until_set).
    pub fn set_log_retention(&self, from: WalPosition) {
        self.inner
            .relocation
            .retention
            .store(from.0, Ordering::Release);
    }
}

/// Errors a background pass may shrug off.
pub(crate) fn is_transient(error: &Error) -> bool {
    matches!(error, Error::DiskFull(_))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::KeepAll;
    use crate::{Config, Durability, Engine, Epoch, KeySpace};

    /// An engine whose sealed segments hold about 1 MiB of live values
    /// (and as much garbage), with no background relocation.
    fn engine_with_garbage(dir: &std::path::Path) -> Engine {
        let mut config = Config::for_tests(dir);
        config.relocation_enabled = false;
        let engine = Engine::open(config).unwrap();
        for round in 0..2u8 {
            for i in 0..1_000u32 {
                let mut key = [0u8; 32];
                key[..4].copy_from_slice(&i.to_le_bytes());
                engine
                    .put(
                        KeySpace::default(),
                        &key,
                        &[round; 1_000],
                        Durability::Buffered,
                    )
                    .unwrap();
            }
        }
        engine.advance_epoch(Epoch(2)).unwrap();
        engine
    }

    /// Drops every entry; at its first decision it lets the held write
    /// finish (`release`) and waits until it has (`done`).
    struct DropAll {
        release: parking_lot::Mutex<Option<std::sync::mpsc::Sender<()>>>,
        done: parking_lot::Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl super::RelocationFilter for DropAll {
        fn decide(&self, _entry: &super::EntryInfo<'_>) -> super::Decision {
            if let Some(release) = self.release.lock().take() {
                release.send(()).unwrap();
                self.done.lock().recv().unwrap();
            }
            super::Decision::Drop
        }
    }

    /// A segment the log rolled past while a write into it was still being
    /// made is not sealed to drops and relocation until that write is
    /// done. A put's index entry appears only once its bytes are copied:
    /// a drop that chose its segments then, and walked the index before
    /// the put's entry appeared, found the segment emptied and deleted it
    /// under the value acknowledged meanwhile. Here the write finishes
    /// during the drop's walk; the drop must leave its segment alone.
    #[test]
    fn a_segment_with_a_write_in_progress_is_not_dropped() {
        use crate::wal::format::{Kind, record_len, write_plain};
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::for_tests(dir.path());
        config.relocation_enabled = false;
        let engine = Engine::open(config).unwrap();
        let inner = &*engine.inner;
        let size = inner.config.wal_segment_bytes;
        let (claimed_tx, claimed_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let present =
            |engine: &Engine, id: u64| engine.inner.values.segments().iter().any(|s| s.id.0 == id);
        // An entry of epoch 1 for the drop to decide on.
        engine
            .put(
                KeySpace::default(),
                &[1; 32],
                &[7; 100],
                Durability::Buffered,
            )
            .unwrap();
        let held = std::thread::scope(|s| {
            s.spawn(move || {
                inner
                    .values
                    .append(record_len(8), |buf, position| {
                        claimed_tx.send(position).unwrap();
                        release_rx.recv().unwrap();
                        write_plain(buf, position, Kind::SyncMark, &0u64.to_le_bytes());
                    })
                    .unwrap();
                done_tx.send(()).unwrap();
            });
            let held = claimed_rx.recv().unwrap().0 / size;
            // The log rolls on past the held write's segment.
            engine.advance_epoch(Epoch(2)).unwrap();
            assert!(inner.values.active_segment().0 > held);
            let sealed: Vec<u64> = inner.sealed_segments().iter().map(|s| s.id.0).collect();
            assert!(!sealed.contains(&held), "sealed with a write in it");
            let filter = DropAll {
                release: parking_lot::Mutex::new(Some(release_tx)),
                done: parking_lot::Mutex::new(done_rx),
            };
            engine.drop_epochs_below(Epoch(2), &filter).unwrap();
            assert!(
                filter.release.lock().is_none(),
                "the write was let finish during the walk"
            );
            assert!(
                present(&engine, held),
                "the segment was deleted though a write into it ended after the walk began"
            );
            held
        });
        // Done now: the next drop takes it.
        assert!(inner.sealed_segments().iter().any(|s| s.id.0 == held));
        let filter = DropAll {
            release: parking_lot::Mutex::new(None),
            done: parking_lot::Mutex::new(std::sync::mpsc::channel().1),
        };
        engine.drop_epochs_below(Epoch(2), &filter).unwrap();
        assert!(!present(&engine, held), "dropped then");
    }

    /// A checkpoint or an epoch drop (a node takes both on a shard's Raft
    /// thread) does not wait for a rate-limited background pass to copy
    /// everything it chose: the pass stops at its next entry. Before, the
    /// Raft thread waited the whole pass (seconds at the default rate),
    /// its heartbeats stalled and its leadership lost.
    #[test]
    fn a_background_pass_gives_way_to_a_checkpoint_and_a_drop() {
        for drop in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let engine = engine_with_garbage(dir.path());
            let inner = &*engine.inner;
            let segments: Vec<_> = inner.sealed_segments().iter().map(|s| s.id).collect();
            assert!(segments.len() > 10, "{} segments", segments.len());
            std::thread::scope(|s| {
                // About 1 MiB to copy at 100 KiB/s: some ten seconds.
                let pass = s.spawn(|| {
                    let _turn = inner.relocation.take_turn();
                    inner
                        .relocate_out_of(&segments, &KeepAll, Some(100 << 10))
                        .unwrap()
                });
                while engine.metrics().counters.entries_relocated == 0 {
                    assert!(!pass.is_finished(), "the pass ended before it was seen");
                    std::thread::sleep(Duration::from_millis(5));
                }
                if drop {
                    engine.drop_epochs_below(Epoch(1), &KeepAll).unwrap();
                } else {
                    engine.checkpoint().unwrap();
                }
                let report = pass.join().unwrap();
                assert!(report.stopped, "drop {drop}: {report:?}");
                assert!(
                    report.entries_relocated < 500,
                    "drop {drop}: the pass copied {} entries first",
                    report.entries_relocated
                );
            });
        }
    }

    /// Keeps everything; its first call (the census's first entry) waits
    /// until released.
    struct Parking {
        parked: std::sync::mpsc::SyncSender<()>,
        released: std::sync::atomic::AtomicBool,
        first: std::sync::atomic::AtomicBool,
    }

    impl super::RelocationFilter for Parking {
        fn decide(&self, _entry: &super::EntryInfo<'_>) -> super::Decision {
            use std::sync::atomic::Ordering;
            if self.first.swap(false, Ordering::AcqRel) {
                let _ = self.parked.try_send(());
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                while !self.released.load(Ordering::Acquire) && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            super::Decision::Keep
        }
    }

    /// A background pass's census (a walk of the whole index: seconds on a
    /// big one) does not hold the relocation turn: a checkpoint and an
    /// epoch drop, taken on a node's Raft thread, go ahead while it walks.
    /// Before, they waited for the whole walk.
    #[test]
    fn a_census_under_way_does_not_hold_back_a_checkpoint_or_a_drop() {
        use std::sync::atomic::{AtomicBool, Ordering};
        for drop in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let engine = engine_with_garbage(dir.path());
            let (parked_tx, parked) = std::sync::mpsc::sync_channel(1);
            let filter = std::sync::Arc::new(Parking {
                parked: parked_tx,
                released: AtomicBool::new(false),
                first: AtomicBool::new(true),
            });
            engine.set_relocation_filter(filter.clone());
            let inner = &*engine.inner;
            std::thread::scope(|s| {
                let pass = s.spawn(|| {
                    let mut last = std::time::Instant::now();
                    super::policy::pass(inner, &mut last, Duration::from_millis(20), true)
                });
                parked
                    .recv_timeout(Duration::from_secs(10))
                    .expect("the census asked the filter");
                let (done_tx, done) = std::sync::mpsc::channel();
                let engine = &engine;
                s.spawn(move || {
                    let result = if drop {
                        engine.drop_epochs_below(Epoch(1), &KeepAll).map(|_| ())
                    } else {
                        engine.checkpoint().map(|_| ())
                    };
                    done_tx.send(result).unwrap();
                });
                let finished = done.recv_timeout(Duration::from_secs(10));
                filter.released.store(true, Ordering::Release);
                let finished = finished.unwrap_or_else(|_| {
                    panic!("drop {drop}: still waiting 10 s into a parked census")
                });
                finished.unwrap();
                pass.join().unwrap().unwrap();
            });
        }
    }
}
