//! The two background threads of a log: the allocator keeps spare segments
//! created and mapped so a writer never waits for a file, and the syncer
//! makes processed bytes durable, in batches, advancing the synced
//! watermark.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::types::SegmentId;
use crate::wal::segment::{Spare, segment_path};
use crate::wal::{LogOptions, Shared};

/// Spare segments, filled by the allocator thread.
#[derive(Debug)]
pub(crate) struct SpareQueue {
    state: Mutex<SpareState>,
    /// Signals the allocator: a spare was taken, or shutdown.
    wanted: Condvar,
    /// Signals rotators: a spare is ready, or the allocator failed.
    available: Condvar,
}

#[derive(Debug)]
struct SpareState {
    ready: VecDeque<Spare>,
    next_id: u64,
    failure: Option<Failure>,
    /// Rotators waiting for a spare.
    waiting: usize,
}

#[derive(Clone, Debug)]
struct Failure {
    disk_full: bool,
    message: String,
}

impl SpareQueue {
    pub fn new(next_id: SegmentId) -> Self {
        Self {
            state: Mutex::new(SpareState {
                ready: VecDeque::new(),
                next_id: next_id.0,
                failure: None,
                waiting: 0,
            }),
            wanted: Condvar::new(),
            available: Condvar::new(),
        }
    }

    /// Takes the spare with id `id`, waiting for the allocator if needed.
    /// Fails with the allocator's error (for example disk full) rather than
    /// waiting forever.
    pub fn take(&self, id: SegmentId, shared: &Shared) -> Result<Spare> {
        let mut state = self.state.lock();
        loop {
            if let Some(front) = state.ready.front() {
                debug_assert_eq!(front.id, id, "spares are taken in order");
                let spare = state.ready.pop_front().expect("front exists");
                self.wanted.notify_one();
                return Ok(spare);
            }
            if let Some(failure) = state.failure.clone() {
                return Err(if failure.disk_full {
                    Error::DiskFull(failure.message)
                } else {
                    Error::Io {
                        path: shared.opts.dir.clone(),
                        source: std::io::Error::other(failure.message),
                    }
                });
            }
            shared.health.check()?;
            if shared.shutdown.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            state.waiting += 1;
            self.wanted.notify_one();
            self.available
                .wait_for(&mut state, Duration::from_millis(50));
            state.waiting -= 1;
        }
    }

    /// Disk space reserved by the spares made and not taken yet.
    pub fn reserved(&self) -> u64 {
        (self.state.lock().ready.iter())
            .map(|s| s.file.reserved())
            .sum()
    }

    /// Removes the files of spares never used (at shutdown).
    pub fn discard(&self, shared: &Shared) {
        let spares: Vec<Spare> = self.state.lock().ready.drain(..).collect();
        for spare in &spares {
            let _ = shared.storage.remove(&spare.path);
        }
        if !spares.is_empty() {
            let _ = shared.storage.sync_dir(&shared.opts.dir);
        }
    }

    pub fn wake(&self) {
        self.wanted.notify_all();
        self.available.notify_all();
    }
}

/// Bytes a log wrote per sync, on average, at or above which the next spare
/// gets large page-cache folios.
pub(crate) const LARGE_FOLIO_MIN_BYTES_PER_SYNC: u64 = 16 << 20;

/// Whether the next spare gets page-sized folios, from what the log did
/// since the previous spare was made: `written` bytes in `syncs` syncs.
///
/// A write through the mapping marks its whole folio dirty, so each sync
/// writes back the whole folio holding the log's tail, and writes it again
/// at the next sync if the tail is still in it: with 2 MiB folios, synced
/// 16 KiB puts wrote their bytes 1.5–5.6 times over (`/proc/self/io`), and
/// the disk took 118 MB for 12.7 MB of them. Page folios bound that to a
/// page per sync, but cost a log written fast without syncs a third of its
/// puts (the kernel's per-folio work at every step, 512 times as often;
/// measured in `docs/design/wal-format.md`). So a log that writes at least
/// 16 MiB per sync (a bulk load of buffered writes: the extra is at most
/// one folio per sync, under 12.5%; 0.4–1.6% measured) gets large folios,
/// and everything else — a log synced per write or per Raft batch, a slow
/// one synced by the background syncer, a new one — gets page folios.
pub(crate) fn page_folios(written: u64, syncs: u64) -> bool {
    written < LARGE_FOLIO_MIN_BYTES_PER_SYNC.saturating_mul(syncs.max(1))
}

/// The last this many syncs decide whether a log writes too little per
/// sync for large folios (see [`run_allocator`]): more than one, so that
/// one short pause does not decide; few, because until the verdict a log
/// that slowed down after a burst writes its tail folio back whole at
/// every sync.
pub(crate) const FOLIO_JUDGE_SYNCS: u64 = 4;

/// Least bytes a log keeps populated ahead of its claim cursor (see
/// [`populate_window`]).
pub(crate) const POPULATE_MIN_BYTES: u64 = 256 << 10;

/// Segments are sparse files whose disk space is reserved (`fallocate`) in
/// steps of at least this many bytes, a window ahead of the writers (the
/// populate window), so an idle log holds this much of each segment on
/// disk, not the segment's length; writers that outrun the allocator
/// reserve the next step themselves.
pub(crate) const RESERVE_MIN_BYTES: u64 = 256 << 10;

/// A log keeps populated ahead of its writers what it wrote in this long at
/// its recent rate.
const POPULATE_AHEAD: Duration = Duration::from_millis(500);

/// How far ahead of its claim cursor a log that wrote `bytes` in `elapsed`
/// keeps its segment populated, at most `segment` bytes.
///
/// Populating (the kernel's zero-filling of fresh page-cache pages, about
/// 1 GB/s here) on the allocator's thread spares the writers those faults;
/// but pages populated are memory held, so a whole segment populated up
/// front cost every idle log its segment's length (a node of 192 empty
/// replicas held 12 GiB). A fast log gets its whole segment, as before; an
/// idle one [`POPULATE_MIN_BYTES`].
pub(crate) fn populate_window(bytes: u64, elapsed: Duration, segment: u64) -> u64 {
    let secs = elapsed.as_secs_f64().max(0.001);
    let ahead = (bytes as f64 / secs * POPULATE_AHEAD.as_secs_f64()) as u64;
    ahead.max(POPULATE_MIN_BYTES).min(segment)
}

/// Whether the log should have a spare made now: a rotator waits for one,
/// or the active segment is a quarter claimed, or what is left of it is
/// less than two windows. An idle log never gets one (a spare is a
/// segment's length of disk space reserved).
fn spare_wanted(shared: &Shared, waiting: usize, window: u64) -> bool {
    if waiting > 0 {
        return true;
    }
    let guard = shared.current.load();
    let Some(active) = guard.as_ref() else {
        return false;
    };
    let (claimed, len) = (active.mapping.claimed(), active.mapping.len());
    claimed.saturating_mul(4) >= len || len - claimed <= window.saturating_mul(2)
}

/// The allocator thread's loop. After a failure (for example a full disk) it
/// reports the failure to writers, backs off, and tries again.
pub(crate) fn run_allocator(shared: Arc<Shared>) {
    let queue = &shared.spares;
    let segment = shared.opts.segment_size;
    // The log's write rate, from the bytes processed since the last look.
    let mut rate_since = (std::time::Instant::now(), shared.tracker.processed());
    let mut window = POPULATE_MIN_BYTES;
    let mut measure = |window: &mut u64| {
        let now = (std::time::Instant::now(), shared.tracker.processed());
        let elapsed = now.0 - rate_since.0;
        if elapsed >= Duration::from_millis(50) {
            *window = populate_window(now.1 - rate_since.1, elapsed, segment);
            rate_since = now;
        }
    };
    // Bytes processed and syncs made so far: what the log did since the
    // previous spare picks the next one's folios.
    let progress = || {
        (
            shared.tracker.processed(),
            shared.syncs.load(Ordering::Relaxed),
        )
    };
    let mut since = progress();
    // The log's progress at each idle look, oldest first: enough to judge
    // it over its last `FOLIO_JUDGE_SYNCS` syncs.
    let mut looks: VecDeque<(u64, u64)> = VecDeque::new();
    loop {
        let id = {
            let mut state = queue.state.lock();
            loop {
                if shared.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if state.failure.is_some() {
                    queue
                        .wanted
                        .wait_for(&mut state, Duration::from_millis(100));
                    state.failure = None;
                    continue;
                }
                if state.ready.len() < shared.opts.spare_segments
                    && spare_wanted(&shared, state.waiting, window)
                {
                    break Some(SegmentId(state.next_id));
                }
                if queue
                    .wanted
                    .wait_for(&mut state, Duration::from_millis(100))
                    .timed_out()
                {
                    break None;
                }
            }
        };
        measure(&mut window);
        // Keep the active segment reserved and populated a window ahead of
        // its writers. A failure to reserve (disk full) is the writers' to
        // meet when they get there.
        if let Some(active) = shared.current.load_full() {
            let mapping = &active.mapping;
            let ahead = mapping.claimed().saturating_add(window);
            // Once less than half a window is left (an idle log keeps its
            // first step).
            if mapping.limit() < ahead - window / 2 {
                let _ = shared.reserve(&active, ahead);
            }
            mapping.populate_to(ahead);
        }
        let Some(id) = id else {
            // Idle: judge the log over its last `FOLIO_JUDGE_SYNCS` syncs,
            // and if it is slow give the active segment's unwritten rest
            // page folios where it has large ones (a segment mapped while
            // the log was fast, see `Shared::use_page_folios_ahead`).
            let now = progress();
            // One look per sync count (the latest), so an idle log keeps
            // one, and a busy one a few.
            match looks.back_mut() {
                Some(last) if last.1 == now.1 => *last = now,
                _ => looks.push_back(now),
            }
            while looks.len() > 1 && now.1 - looks[1].1 >= FOLIO_JUDGE_SYNCS {
                looks.pop_front();
            }
            let oldest = looks[0];
            if now.1 - oldest.1 >= FOLIO_JUDGE_SYNCS
                && page_folios(now.0 - oldest.0, now.1 - oldest.1)
            {
                shared.use_page_folios_ahead();
            }
            continue;
        };
        let now = progress();
        let small = page_folios(now.0 - since.0, now.1 - since.1);
        since = now;
        let result = create_spare(&*shared.storage, &shared.opts, id, small, window);
        let mut state = queue.state.lock();
        match result {
            Ok(spare) => {
                state.ready.push_back(spare);
                state.next_id += 1;
            }
            Err(error) => {
                state.failure = Some(Failure {
                    disk_full: matches!(error, Error::DiskFull(_)),
                    message: error.to_string(),
                });
            }
        }
        queue.available.notify_all();
    }
}

/// Creates, persists and maps one spare segment file:
/// 0. remove a leftover file of that name from a failed attempt;
/// 1. create the file at full size, sparse, with the space of its first
///    `populate` bytes (at least [`RESERVE_MIN_BYTES`]) reserved;
/// 2. sync it (its length becomes durable);
/// 3. sync the directory (its name becomes durable);
/// 4. map it (page folios or large ones, see [`page_folios`]), and
///    populate its first `populate` bytes.
pub(crate) fn create_spare(
    storage: &dyn Storage,
    opts: &LogOptions,
    id: SegmentId,
    page_folios: bool,
    populate: u64,
) -> Result<Spare> {
    let path = segment_path(&opts.dir, opts.kind, id);
    if storage.exists(&path) {
        // Left over from an attempt that failed after creating the file.
        storage.remove(&path).map_err(|e| Error::io(&path, e))?;
    }
    let step = RESERVE_MIN_BYTES;
    let reserve = populate.max(step).div_ceil(step).saturating_mul(step);
    let file = storage
        .create_sparse(&path, opts.segment_size, reserve)
        .map_err(|e| Error::io(&path, e))?;
    file.sync_all().map_err(|e| Error::io(&path, e))?;
    storage
        .sync_dir(&opts.dir)
        .map_err(|e| Error::io(&opts.dir, e))?;
    let mut mapping = file.map(page_folios).map_err(|e| Error::io(&path, e))?;
    mapping.set_limit(super::claim_limit(file.reserved(), mapping.len()));
    mapping.populate_to(populate);
    Ok(Spare {
        id,
        path,
        file,
        mapping,
        page_folios,
    })
}

/// Pending sync requests and the synced watermark's waiters.
#[derive(Debug, Default)]
pub(crate) struct SyncState {
    requested: Mutex<u64>,
    /// Wakes the syncer.
    request: Condvar,
    /// Wakes writers waiting for the synced watermark.
    synced: Condvar,
}

impl SyncState {
    /// Asks the syncer to sync up to `position` and wakes it.
    pub fn request(&self, position: u64) {
        let mut requested = self.requested.lock();
        if *requested < position {
            *requested = position;
        }
        self.request.notify_one();
    }

    /// Waits until `done()` says so, checking at least every 10 ms.
    pub fn wait(&self, done: impl Fn() -> bool) {
        let mut guard = self.requested.lock();
        while !done() {
            self.synced.wait_for(&mut guard, Duration::from_millis(10));
        }
    }

    pub fn wake(&self) {
        self.request.notify_all();
        self.synced.notify_all();
    }
}

/// The syncer thread's loop.
pub(crate) fn run_syncer(shared: Arc<Shared>) {
    let state = &shared.sync;
    loop {
        {
            let mut requested = state.requested.lock();
            let synced = shared.synced.load(Ordering::Acquire);
            if !shared.shutdown.load(Ordering::Acquire) && *requested <= synced {
                state
                    .request
                    .wait_for(&mut requested, shared.opts.sync_interval);
            }
        }
        if shared.shutdown.load(Ordering::Acquire) || shared.health.is_poisoned() {
            state.wake();
            return;
        }
        let before = shared.synced.load(Ordering::Acquire);
        if let Err(error) = shared.sync_to_processed() {
            shared
                .health
                .poison(format!("background sync failed: {error}"));
            state.wake();
            return;
        }
        state.synced.notify_all();
        let synced = shared.synced.load(Ordering::Acquire);
        if synced > before {
            shared.append_sync_mark(synced);
            shared.release_cold_pages();
        }
    }
}
