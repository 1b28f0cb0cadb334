//! An append-only log of framed records in pre-allocated, memory-mapped
//! segment files. The same machinery serves the value WAL (the permanent
//! home of values) and the index log (flushed cell indexes).
//!
//! Writers claim space with one atomic compare-and-swap on the active
//! segment's cursor and copy in parallel; the [`tracker`] publishes the
//! contiguous processed prefix; whoever waits for durability leads a sync
//! (and a periodic task syncs what buffered writers wrote); the allocator
//! task keeps the next segments ready. See `docs/design/wal-format.md`.

pub(crate) mod format;
pub(crate) mod replay;
pub(crate) mod segment;
mod tracker;
mod workers;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use parking_lot::{Mutex, RwLock};

use crate::error::{Error, Result};
use crate::health::Health;
use crate::pool::{Task, WorkerPool};
use crate::storage::{ClaimError, LARGEST_FOLIO_BYTES, Mapping, RegionMut, Storage};
use crate::types::{Epoch, SegmentId, WalPosition};
use segment::{Active, HEADER_RECORD_BYTES, LogKind, SegmentFile, SegmentHeader, Spare};
use tracker::Tracker;
use workers::{SpareQueue, SyncState};

/// Settings of one log.
#[derive(Clone, Debug)]
pub(crate) struct LogOptions {
    pub dir: PathBuf,
    pub kind: LogKind,
    pub log_id: [u8; 16],
    pub segment_size: u64,
    pub spare_segments: usize,
    pub sync_interval: Duration,
    /// Synced bytes behind the synced watermark whose pages stay in the
    /// page cache; sealed segments further behind have theirs dropped
    /// (`None`: never).
    pub keep_cached_bytes: Option<u64>,
    /// Read through a read-only mapping of each segment (no system call,
    /// and [`Log::mapped`] hands out ranges without a copy) instead of
    /// `pread`.
    pub mapped_reads: bool,
}

impl LogOptions {
    /// Largest record that fits in a segment after its header.
    pub fn max_record_bytes(&self) -> u64 {
        self.segment_size - HEADER_RECORD_BYTES
    }

    fn header(&self, id: SegmentId, epoch: Epoch) -> SegmentHeader {
        SegmentHeader {
            kind: self.kind,
            log_id: self.log_id,
            id,
            segment_size: self.segment_size,
            epoch,
        }
    }
}

/// State shared by a log's writers, readers and background tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    opts: LogOptions,
    storage: Arc<dyn Storage>,
    health: Arc<Health>,
    /// The active segment; `None` once the log is shut down.
    current: ArcSwapOption<Active>,
    rotation: Mutex<()>,
    files: RwLock<BTreeMap<SegmentId, Arc<SegmentFile>>>,
    spares: SpareQueue,
    tracker: Tracker,
    synced: AtomicU64,
    sync: SyncState,
    epoch: AtomicU32,
    /// End of the last sync mark written.
    last_mark_end: AtomicU64,
    /// Segments below this id had their pages dropped (see
    /// [`LogOptions::keep_cached_bytes`]).
    released_below: Mutex<u64>,
    /// Bytes of segments whose pages were dropped.
    released_bytes: AtomicU64,
    /// Syncs that made new bytes durable.
    syncs: AtomicU64,
    /// Bytes processed that no writer wrote through the mapping: records
    /// appended through the file (see [`Log::append_gathered`]) and the
    /// unwritten rest of each segment behind its pad. The allocator
    /// populates ahead only for the others.
    unmapped_bytes: AtomicU64,
    /// When the last sync that made new bytes durable ended (by any
    /// thread), as `tracker::since_start` nanoseconds.
    last_sync: AtomicU64,
    shutdown: AtomicBool,
}

/// A range of a segment read in place through its mapping (it keeps the
/// segment, and so the mapping, alive).
#[derive(Debug)]
pub(crate) struct MappedRange {
    segment: Arc<SegmentFile>,
    offset: u64,
    len: usize,
}

impl std::ops::Deref for MappedRange {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.segment
            .mapped()
            .and_then(|m| m.bytes(self.offset, self.len))
            .expect("checked when the range was made")
    }
}

/// A log open for appending and reading.
#[derive(Debug)]
pub(crate) struct Log {
    shared: Arc<Shared>,
    /// The allocator and the periodic syncer.
    tasks: Mutex<Vec<Task>>,
}

/// What a writer claimed: a region of the mapping to copy into, or the
/// offset of a range it writes through the file.
enum Claim<'m> {
    Mapped(RegionMut<'m>),
    Direct(u64),
}

/// Marks a claimed range processed when dropped; if the writer did not
/// finish (it panicked), the log is poisoned, since the range holds garbage.
struct Claimed<'a> {
    shared: &'a Shared,
    start: u64,
    end: u64,
    finished: bool,
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.health.poison(format!(
                "a writer failed inside its claimed range at @{}",
                self.start
            ));
        }
        self.shared.tracker.done(self.start, self.end);
        self.shared.wake_parked_syncer();
    }
}

impl Log {
    /// Starts writing in a new segment `next`, after the existing segments
    /// in `existing` (which stay readable). Files of segments at or after
    /// `next` are deleted first. Everything below `next`'s first byte must
    /// already be durable. Its background tasks run in `pool`.
    pub fn start(
        opts: LogOptions,
        storage: Arc<dyn Storage>,
        health: Arc<Health>,
        epoch: Epoch,
        next: SegmentId,
        existing: BTreeMap<SegmentId, Arc<SegmentFile>>,
        pool: &WorkerPool,
    ) -> Result<Log> {
        replay::remove_segments_from(&*storage, &opts, next)?;
        let base = next.0 * opts.segment_size;
        let first = workers::create_spare(
            &*storage,
            &opts,
            next,
            true,
            workers::POPULATE_MIN_BYTES,
            workers::POPULATE_MIN_BYTES,
        )?;
        let mut files = existing;
        let active = activate(&opts, first, epoch);
        files.insert(next, active.segment.clone());
        let shared = Arc::new(Shared {
            current: ArcSwapOption::from_pointee(active),
            opts: opts.clone(),
            storage: storage.clone(),
            health,
            rotation: Mutex::new(()),
            files: RwLock::new(files),
            spares: SpareQueue::new(SegmentId(next.0 + 1)),
            tracker: Tracker::new(base),
            synced: AtomicU64::new(base),
            sync: SyncState::default(),
            epoch: AtomicU32::new(epoch.0),
            last_mark_end: AtomicU64::new(0),
            released_below: Mutex::new(0),
            released_bytes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            unmapped_bytes: AtomicU64::new(0),
            last_sync: AtomicU64::new(tracker::since_start()),
            shutdown: AtomicBool::new(false),
        });
        shared.tracker.done(base, base + HEADER_RECORD_BYTES);
        let tasks = workers::spawn_tasks(&shared, pool);
        Ok(Log {
            shared,
            tasks: Mutex::new(tasks),
        })
    }

    /// Appends a record of `len` bytes (a multiple of 8, at most
    /// [`LogOptions::max_record_bytes`]): `write` fills it, knowing its
    /// position. The range counts as processed once `write` returns, so
    /// `write` must also do whatever must precede that (index updates).
    pub fn append<R>(
        &self,
        len: usize,
        write: impl FnOnce(&mut [u8], WalPosition) -> R,
    ) -> Result<(WalPosition, R)> {
        self.shared.append(len, write)
    }

    /// Appends a record of `len` bytes (a multiple of 8, at most
    /// [`LogOptions::max_record_bytes`]) through the file instead of the
    /// mapping: `gather` lays it out, knowing its position, and it is
    /// written with one `pwritev` (no page faults, and no zero-filling of
    /// the pages it covers whole). The range counts as processed once
    /// written, so the caller must not make readers expect it before this
    /// returns (the Raft log applies its entries after). A failed write
    /// poisons the log.
    pub fn append_gathered<'a>(
        &self,
        len: usize,
        gather: impl FnOnce(WalPosition) -> format::Gathered<'a>,
    ) -> Result<(WalPosition, format::Gathered<'a>)> {
        self.shared.append_gathered(len, gather)
    }

    /// Reads `buf.len()` bytes at `position`.
    pub fn read_into(&self, position: WalPosition, buf: &mut [u8]) -> Result<()> {
        self.shared.read_into(position, buf)
    }

    /// The `len` bytes at `position` in place, if this log reads through
    /// mappings (`Ok(None)` otherwise, or if the segment cannot be mapped).
    /// The range must hold completed records.
    pub fn mapped(&self, position: WalPosition, len: usize) -> Result<Option<MappedRange>> {
        if !self.shared.opts.mapped_reads {
            return Ok(None);
        }
        let (segment, offset) = self.shared.segment_of(position, len)?;
        if segment
            .mapped()
            .and_then(|m| m.bytes(offset, len))
            .is_none()
        {
            return Ok(None);
        }
        Ok(Some(MappedRange {
            segment,
            offset,
            len,
        }))
    }

    /// Reads `len` bytes at `position`.
    pub fn read(&self, position: WalPosition, len: usize) -> Result<Vec<u8>> {
        let mut buf = crate::buffers::take(len);
        self.read_into(position, &mut buf)?;
        Ok(buf)
    }

    /// [`Log::read`] if the bytes are in the page cache; `Ok(None)` where
    /// reading them would wait for the disk (or fault on a mapping).
    pub fn read_if_cached(&self, position: WalPosition, len: usize) -> Result<Option<Vec<u8>>> {
        if self.shared.opts.mapped_reads {
            return Ok(None);
        }
        let (segment, offset) = self.shared.segment_of(position, len)?;
        let mut buf = crate::buffers::take(len);
        let cached = segment
            .file
            .read_at_if_cached(&mut buf, offset)
            .map_err(|e| Error::io(&segment.path, e))?;
        Ok(cached.then_some(buf))
    }

    /// Largest record that fits in a segment.
    pub fn max_record_bytes(&self) -> u64 {
        self.shared.opts.max_record_bytes()
    }

    /// The log's settings.
    pub fn options(&self) -> &LogOptions {
        &self.shared.opts
    }

    /// The processed watermark.
    pub fn processed(&self) -> WalPosition {
        WalPosition(self.shared.tracker.processed())
    }

    /// The synced watermark: every byte below it is durable.
    pub fn synced(&self) -> WalPosition {
        WalPosition(self.shared.synced.load(Ordering::Acquire))
    }

    /// Waits until every byte below `position` is processed. Fails if the
    /// log is poisoned, even once the watermark is reached: a writer that
    /// failed inside its claimed range poisons the log before marking the
    /// range processed (`Claimed`), so the watermark can pass over a hole
    /// of garbage, and recovery cuts the log there — a write above it
    /// acknowledged now would be lost at the next open. (The watermark is
    /// read with Acquire after the poison's Release: seen past the hole, the
    /// poison is seen too.)
    pub fn wait_processed(&self, position: WalPosition) -> Result<()> {
        let health = &self.shared.health;
        if self
            .shared
            .tracker
            .wait_for(position.0, || health.is_poisoned())
        {
            health.check()
        } else {
            health.check().and(Err(Error::Closed))
        }
    }

    /// Waits until every byte below `position` is durable (see
    /// `Shared::wait_synced`: the syncer does it, or this thread if it is a
    /// pool task).
    pub fn wait_synced(&self, position: WalPosition) -> Result<()> {
        let shared = &*self.shared;
        if shared.synced.load(Ordering::Acquire) >= position.0 {
            return Ok(());
        }
        self.wait_processed(position)?;
        shared.wait_synced(position.0)
    }

    /// Syncs everything processed so far, on the calling thread (or waits
    /// for the sync under way that covers it). One sync of the log at a
    /// time: a write-back error is reported once per open file, so a
    /// second `fdatasync` running beside a failing one could return 0 and
    /// advance the synced watermark over the pages that failed.
    pub fn sync_now(&self) -> Result<WalPosition> {
        let shared = &*self.shared;
        shared.sync_up_to(shared.tracker.processed())?;
        Ok(self.synced())
    }

    /// The current epoch (of the active segment, or newer if a roll is
    /// under way).
    pub fn epoch(&self) -> Epoch {
        Epoch(self.shared.epoch.load(Ordering::Acquire))
    }

    /// Starts a new segment belonging to `epoch`.
    pub fn advance_epoch(&self, epoch: Epoch) -> Result<()> {
        let shared = &*self.shared;
        shared.health.check()?;
        // Under the rotation lock: a rotation under way read the old epoch
        // for its new segment's header, and one that installed it after
        // this read the active id made the roll here a no-op — the new
        // epoch's writes then went into a segment of the old one (a
        // restart before the next snapshot took its epoch back).
        let _rotating = shared.rotation.lock();
        let before = shared.epoch.swap(epoch.0, Ordering::AcqRel);
        let rolled = shared
            .active_id()
            .and_then(|active| shared.rotate_locked(active, Some(epoch)));
        if rolled.is_err() {
            // Not rolled (a full disk): the epoch is not advanced either,
            // so asking again rolls.
            shared.epoch.store(before, Ordering::Release);
        }
        rolled
    }

    /// Bytes of sealed segments whose pages were dropped from the page
    /// cache once synced (see [`LogOptions::keep_cached_bytes`]).
    pub fn released_bytes(&self) -> u64 {
        self.shared.released_bytes.load(Ordering::Relaxed)
    }

    /// Every segment file, oldest first.
    pub fn segments(&self) -> Vec<Arc<SegmentFile>> {
        self.shared.files.read().values().cloned().collect()
    }

    /// The active segment's id (`SegmentId(u64::MAX)` once shut down).
    pub fn active_segment(&self) -> SegmentId {
        self.shared.active_id().unwrap_or(SegmentId(u64::MAX))
    }

    /// Bytes of segment files on disk (active and spare segments included;
    /// reserved space: a segment's unreserved tail is a hole).
    pub fn disk_bytes(&self) -> u64 {
        let files: u64 = (self.shared.files.read().values())
            .map(|s| s.file.reserved())
            .sum();
        files + self.shared.spares.reserved()
    }

    /// Deletes a sealed segment file: after this no record in it can be read.
    pub fn delete_segment(&self, id: SegmentId) -> Result<()> {
        let shared = &*self.shared;
        if id >= shared.active_id()? {
            return Err(Error::Config(format!("cannot delete {id}: it is active")));
        }
        let removed = shared.files.write().remove(&id);
        if let Some(segment) = removed {
            shared
                .storage
                .remove(&segment.path)
                .map_err(|e| shared.health.poison_with(Error::io(&segment.path, e)))?;
        }
        Ok(())
    }

    /// Makes deletions durable.
    pub fn sync_dir(&self) -> Result<()> {
        let dir = &self.shared.opts.dir;
        self.shared
            .storage
            .sync_dir(dir)
            .map_err(|e| self.shared.health.poison_with(Error::io(dir, e)))
    }

    /// Stops the background tasks (waiting for a run under way) and removes
    /// unused spare files. Does not sync: callers that need durability sync
    /// first.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for task in self.tasks.lock().drain(..) {
            task.stop();
        }
        self.shared.spares.discard(&self.shared);
        // Unmap the active segment; a writer still holding it finishes first.
        let _rotating = self.shared.rotation.lock();
        self.shared.current.store(None);
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn append<R>(
        &self,
        len: usize,
        write: impl FnOnce(&mut [u8], WalPosition) -> R,
    ) -> Result<(WalPosition, R)> {
        self.claim(len, false, |active, claim| {
            let Claim::Mapped(region) = claim else {
                unreachable!("a mapped claim was asked for")
            };
            let offset = region.offset();
            let (position, result) = self.fill(active, region, write);
            self.fault_in_ahead(&active.mapping, offset, position.0, len as u64);
            Ok((position, result))
        })
    }

    fn append_gathered<'a>(
        &self,
        len: usize,
        gather: impl FnOnce(WalPosition) -> format::Gathered<'a>,
    ) -> Result<(WalPosition, format::Gathered<'a>)> {
        self.claim(len, true, |active, claim| {
            let Claim::Direct(offset) = claim else {
                unreachable!("a direct claim was asked for")
            };
            let start = active.base + offset;
            // Processed when dropped; the log is poisoned unless finished.
            let mut claimed = Claimed {
                shared: self,
                start,
                end: start + len as u64,
                finished: false,
            };
            let gathered = gather(WalPosition(start));
            debug_assert_eq!(gathered.len(), len);
            if let Err(error) = active
                .segment
                .file
                .write_vectored_at(&gathered.slices(), offset)
            {
                let error = Error::io(&active.segment.path, error);
                self.health
                    .poison(format!("appending at @{start}: {error}"));
                return Err(error);
            }
            claimed.finished = true;
            self.unmapped_bytes.fetch_add(len as u64, Ordering::Relaxed);
            Ok((WalPosition(start), gathered))
        })
    }

    /// Claims `len` bytes of the active segment (rotating to the next one,
    /// or reserving disk space ahead, as needed) and hands them to `with`:
    /// a region of the mapping, or with `direct` the range's offset alone.
    fn claim<R>(
        &self,
        len: usize,
        direct: bool,
        with: impl FnOnce(&Active, Claim<'_>) -> Result<R>,
    ) -> Result<R> {
        debug_assert_eq!(len % 8, 0);
        if len as u64 > self.opts.max_record_bytes() {
            return Err(Error::TooLarge {
                what: "record",
                got: len as u64,
                max: self.opts.max_record_bytes(),
            });
        }
        loop {
            self.health.check()?;
            let guard = self.current.load();
            let Some(active) = guard.as_ref() else {
                return Err(Error::Closed);
            };
            let claim = if direct {
                active.mapping.claim_range(len as u64).map(Claim::Direct)
            } else {
                active.mapping.claim(len as u64).map(Claim::Mapped)
            };
            match claim {
                Ok(claim) => return with(active, claim),
                Err(ClaimError::Full { .. }) => {
                    let full = active.segment.id;
                    drop(guard);
                    self.rotate(full, None)?;
                }
                Err(ClaimError::Unreserved) => {
                    // The writers passed what the allocator reserved ahead.
                    let active = Arc::clone(active);
                    drop(guard);
                    let end = active.mapping.claimed() + len as u64;
                    self.reserve(&active, end.saturating_add(workers::RESERVE_MIN_BYTES))?;
                }
            }
        }
    }

    /// Reserves the active segment's disk space up to `end` (rounded up to
    /// [`workers::RESERVE_MIN_BYTES`]) and lets writers claim up to it.
    /// Fails (disk full) without changing anything.
    fn reserve(&self, active: &Active, end: u64) -> Result<()> {
        let file = &active.segment.file;
        let step = workers::RESERVE_MIN_BYTES;
        file.reserve_to(end.div_ceil(step).saturating_mul(step))
            .map_err(|e| Error::io(&active.segment.path, e))?;
        active
            .mapping
            .raise_limit(claim_limit(file.reserved(), active.mapping.len()));
        Ok(())
    }

    /// Writes a region claimed in `active` and reports it processed (the log
    /// is poisoned if `write` panics, see [`Claimed`]).
    fn fill<R>(
        &self,
        active: &Active,
        mut region: RegionMut<'_>,
        write: impl FnOnce(&mut [u8], WalPosition) -> R,
    ) -> (WalPosition, R) {
        let start = active.base + region.offset();
        let mut claimed = Claimed {
            shared: self,
            start,
            end: start + region.len() as u64,
            finished: false,
        };
        let result = write(&mut region, WalPosition(start));
        claimed.finished = true;
        (WalPosition(start), result)
    }

    /// After a sync that made new data durable, records the synced
    /// watermark in the log itself (a sync mark), so that recovery can tell
    /// damage to synced data from a torn tail even if the last snapshot is
    /// old. A sync that covered only the previous mark writes none (an idle
    /// log stays idle). Failures are ignored: marks are an aid, not data.
    fn append_sync_mark(&self, synced: u64) {
        if synced <= self.last_mark_end.load(Ordering::Acquire) {
            return;
        }
        let body = synced.to_le_bytes();
        let len = format::record_len(body.len());
        let written = self.append(len, |buf, position| {
            format::write_plain(buf, position, format::Kind::SyncMark, &body);
            position.0 + len as u64
        });
        if let Ok((_, end)) = written {
            self.last_mark_end.fetch_max(end, Ordering::AcqRel);
        }
    }

    fn active_id(&self) -> Result<SegmentId> {
        self.current
            .load()
            .as_ref()
            .map(|a| a.segment.id)
            .ok_or(Error::Closed)
    }

    /// The segment holding `[position, position + len)`, and the range's
    /// offset in it; `NoRecord` if there is none (deleted, or the range
    /// crosses a segment's end).
    fn segment_of(&self, position: WalPosition, len: usize) -> Result<(Arc<SegmentFile>, u64)> {
        let size = self.opts.segment_size;
        let id = SegmentId(position.0 / size);
        let offset = position.0 % size;
        if offset + len as u64 > size {
            return Err(Error::NoRecord(position));
        }
        let segment = self
            .files
            .read()
            .get(&id)
            .cloned()
            .ok_or(Error::NoRecord(position))?;
        Ok((segment, offset))
    }

    fn read_into(&self, position: WalPosition, buf: &mut [u8]) -> Result<()> {
        let (segment, offset) = self.segment_of(position, buf.len())?;
        if self.opts.mapped_reads
            && let Some(bytes) = segment.mapped().and_then(|m| m.bytes(offset, buf.len()))
        {
            buf.copy_from_slice(bytes);
            return Ok(());
        }
        segment
            .file
            .read_at(buf, offset)
            .map_err(|e| Error::io(&segment.path, e))
    }

    /// Seals the active segment `full` (if it still is active) and makes the
    /// next spare active, with a header for `epoch` (default: current).
    fn rotate(&self, full: SegmentId, epoch: Option<Epoch>) -> Result<()> {
        let _rotating = self.rotation.lock();
        self.rotate_locked(full, epoch)
    }

    /// [`Shared::rotate`] with the rotation lock held.
    fn rotate_locked(&self, full: SegmentId, epoch: Option<Epoch>) -> Result<()> {
        let Some(active) = self.current.load_full() else {
            return Err(Error::Closed);
        };
        if active.segment.id != full {
            return Ok(());
        }
        // Take the spare first: if that fails (disk full), nothing changed.
        let spare = self.spares.take(SegmentId(full.0 + 1), self)?;
        if let Some(mut rest) = active.mapping.claim_rest() {
            let start = active.base + rest.offset();
            let end = start + rest.len() as u64;
            if rest.len() >= format::RECORD_HEADER_BYTES {
                format::write_pad(&mut rest, WalPosition(start));
            }
            // Nothing is written past the pad's header: no page to populate.
            self.unmapped_bytes.fetch_add(
                (rest.len() as u64).saturating_sub(format::RECORD_HEADER_BYTES as u64),
                Ordering::Relaxed,
            );
            self.tracker.done(start, end);
        }
        let epoch = epoch.unwrap_or(Epoch(self.epoch.load(Ordering::Acquire)));
        self.install(spare, epoch);
        Ok(())
    }

    /// Makes `spare` the active segment, with a header for `epoch`.
    fn install(&self, spare: Spare, epoch: Epoch) {
        let active = activate(&self.opts, spare, epoch);
        let (id, base) = (active.segment.id, active.base);
        self.files.write().insert(id, active.segment.clone());
        self.current.store(Some(Arc::new(active)));
        self.tracker.done(base, base + HEADER_RECORD_BYTES);
    }

    /// Drops the page-cache pages of sealed segments that are synced and
    /// lie more than `keep_cached_bytes` behind the synced watermark, each
    /// once. The advice cannot lose data (the pages are clean; the kernel
    /// writes back any dirty one first), so a failure is ignored.
    fn release_cold_pages(&self) {
        let Some(keep) = self.opts.keep_cached_bytes else {
            return;
        };
        let size = self.opts.segment_size;
        let limit = self.synced.load(Ordering::Acquire).saturating_sub(keep);
        let mut next = self.released_below.lock();
        let cold: Vec<Arc<SegmentFile>> = self
            .files
            .read()
            .range(SegmentId(*next)..)
            .take_while(|(id, _)| (id.0 + 1) * size <= limit)
            .map(|(_, s)| s.clone())
            .collect();
        for segment in cold {
            let _ = segment.file.evict_cache();
            *next = segment.id.0 + 1;
            self.released_bytes.fetch_add(size, Ordering::Relaxed);
        }
    }

    /// Makes every processed byte durable.
    fn sync_to_processed(&self) -> Result<()> {
        let target = self.tracker.processed();
        // After reading the watermark: one past a failed writer's hole
        // comes with the poison visible (`Log::wait_processed`). The synced
        // watermark never passes a hole, so no write above one is told it
        // is durable.
        self.health.check()?;
        let from = self.synced.load(Ordering::Acquire);
        if target <= from {
            return Ok(());
        }
        // Nothing writes below `target` again: unmapping those pages first
        // spares the write-back a TLB shootdown per page (see
        // `Mapping::release_below`). Sealed segments are unmapped whole.
        if let Some(active) = self.current.load().as_ref() {
            active
                .mapping
                .release_below(target.saturating_sub(active.base));
        }
        let size = self.opts.segment_size;
        let segments: Vec<Arc<SegmentFile>> = {
            let files = self.files.read();
            files
                .range(SegmentId(from / size)..=SegmentId((target - 1) / size))
                .map(|(_, s)| s.clone())
                .collect()
        };
        for segment in segments {
            let seg_start = segment.id.0 * size;
            let lo = from.max(seg_start) - seg_start;
            let hi = target.min(seg_start + size) - seg_start;
            segment
                .file
                .sync_range(lo, hi - lo)
                .map_err(|e| self.health.poison_with(Error::io(&segment.path, e)))?;
        }
        // Another sync of these pages may have failed meanwhile (and taken
        // the error this one would have seen): never past a poison.
        self.health.check()?;
        self.synced.fetch_max(target, Ordering::AcqRel);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.last_sync
            .store(tracker::since_start(), Ordering::Relaxed);
        Ok(())
    }

    /// Gives the active segment's unwritten rest page-sized folios if it
    /// has large ones, for a log that now writes too little per sync for
    /// them. A spare is mapped with the folios the log's rate called for
    /// when it was made, so after a burst the active segment and the spares
    /// keep large folios, and every sync would write the (up to 2 MiB)
    /// folio holding the log's tail back whole until they are full.
    ///
    /// The bytes from the first [`LARGEST_FOLIO_BYTES`] boundary a margin
    /// past the claim cursor are switched (writes claimed meanwhile and
    /// the chunk made writable ahead of them keep their pages; no byte
    /// changes either way), and a filler record moves the log's tail to
    /// that boundary, so the large folios before it are written back once,
    /// not at every sync until the log's slow writes have filled them
    /// (up to 512 syncs of 4 KiB writes per 2 MiB folio). The filler is a
    /// sync mark whose body (the synced watermark) is followed by zeros:
    /// replay skips it, and the sync-mark scan, which reads marks of 8
    /// bytes, ignores it. It costs the log under `LARGEST_FOLIO_BYTES` plus
    /// the margin, once per slow-down.
    fn use_page_folios_ahead(&self) {
        let guard = self.current.load();
        let Some(active) = guard.as_ref() else {
            return;
        };
        if active.page_folios.swap(true, Ordering::AcqRel) {
            return;
        }
        let mapping = &active.mapping;
        let claimed = mapping.claimed();
        let boundary =
            (claimed + 4 * FAULT_AHEAD_BYTES).div_ceil(LARGEST_FOLIO_BYTES) * LARGEST_FOLIO_BYTES;
        if boundary >= mapping.len() {
            // The segment is nearly full; the next one is judged afresh.
            return;
        }
        // The filler ends at the boundary: reserved first (a sparse
        // segment's claims stop at its reserved part).
        if self.reserve(active, boundary + FAULT_AHEAD_BYTES).is_err() {
            return;
        }
        mapping.use_page_folios_from(boundary);
        let gap = boundary - claimed;
        if gap < format::record_len(8) as u64 {
            return;
        }
        // Claimed in this segment only: if another writer took its end
        // meanwhile, or its tail moved on, the filler lands a little past
        // the boundary (still one record, written once).
        let Ok(region) = mapping.claim(gap) else {
            return;
        };
        let mut body = vec![0u8; gap as usize - format::RECORD_HEADER_BYTES];
        body[..8].copy_from_slice(&self.synced.load(Ordering::Acquire).to_le_bytes());
        let (start, ()) = self.fill(active, region, |buf, position| {
            format::write_plain(buf, position, format::Kind::SyncMark, &body);
        });
        self.last_mark_end
            .fetch_max(start.0 + gap, Ordering::AcqRel);
    }

    /// After a write of `[offset, offset + len)` into `mapping` (at log
    /// position `start`): if the range holds the first byte of a chunk (of
    /// [`FAULT_AHEAD_BYTES`]) and at least [`FAULT_AHEAD_MIN_UNSYNCED`] bytes
    /// wait for a sync, takes the write faults of the next chunk now.
    ///
    /// Each page of a fresh segment faults on its first write (the kernel's
    /// page-mkwrite: block reservation, dirty marking), under the lock of the
    /// page's folio — with large folios, up to 2 MiB shared by every writer.
    /// Taken inline, concurrent writers queue on that lock and sleep while
    /// holding their claims, and the other writers wait on the processed
    /// watermark behind them. Exactly one write holds each chunk's first byte,
    /// so each chunk is faulted in once, by one thread, in one call, while the
    /// writers are still a chunk behind it.
    fn fault_in_ahead(&self, mapping: &Mapping, offset: u64, start: u64, len: u64) {
        let Some(chunk) = chunk_to_fault_in(offset, len) else {
            return;
        };
        // The syncer may already have passed this range.
        let unsynced = (start + len).saturating_sub(self.synced.load(Ordering::Relaxed));
        if unsynced >= FAULT_AHEAD_MIN_UNSYNCED {
            mapping.fault_in_writable(chunk, FAULT_AHEAD_BYTES);
        }
    }
}

/// Writers take a segment's write faults a chunk of this many bytes at a
/// time, one chunk ahead of the data (see [`Shared::fault_in_ahead`]).
pub(crate) const FAULT_AHEAD_BYTES: u64 = 64 << 10;

/// Writes fault in ahead only while at least this many bytes wait for a
/// sync: a sync writes back the pages faulted in ahead (zeros) along with
/// the data, and they are written again once filled, so this bounds that
/// extra to about `1.5 * FAULT_AHEAD_BYTES` per sync of at least this many
/// bytes (under 0.6%). Logs synced often (durable writes, Raft) never
/// fault in ahead; they write too little between syncs to need it.
pub(crate) const FAULT_AHEAD_MIN_UNSYNCED: u64 = 16 << 20;

/// The start of the chunk a write of `[offset, offset + len)` faults in,
/// if the write holds the first byte of a chunk: the chunk after the last
/// such chunk (a write longer than a chunk faults in the chunks it spans
/// itself).
fn chunk_to_fault_in(offset: u64, len: u64) -> Option<u64> {
    let last = (offset + len).checked_sub(1)? / FAULT_AHEAD_BYTES * FAULT_AHEAD_BYTES;
    (last >= offset).then_some(last + FAULT_AHEAD_BYTES)
}

/// How far writers may claim into a segment of `len` bytes whose first
/// `reserved` are reserved: a record header's length short of the reserved
/// end, so the pad a rotation writes where the claims stopped (a record
/// header) is always in reserved space.
pub(crate) fn claim_limit(reserved: u64, len: u64) -> u64 {
    if reserved >= len {
        len
    } else {
        reserved.saturating_sub(format::RECORD_HEADER_BYTES as u64)
    }
}

/// Writes the segment header into a spare and wraps it as the active
/// segment. The header's range still has to be reported to the tracker.
fn activate(opts: &LogOptions, spare: Spare, epoch: Epoch) -> Active {
    let base = spare.id.0 * opts.segment_size;
    {
        let mut region = spare
            .mapping
            .claim(HEADER_RECORD_BYTES)
            .expect("a fresh segment has room for its header");
        opts.header(spare.id, epoch).write_record(&mut region, base);
    }
    let segment = Arc::new(SegmentFile::new(spare.id, spare.path, spare.file, epoch));
    Active {
        segment,
        mapping: spare.mapping,
        base,
        page_folios: AtomicBool::new(spare.page_folios),
    }
}

#[cfg(test)]
mod tests;
