//! The two background tasks of a log (run by the engine's
//! [`WorkerPool`]): the allocator keeps spare segments created and mapped
//! ahead of the writers, and the syncer makes processed bytes durable in
//! batches when writers wait for it, and periodically what buffered writers
//! wrote. No task ever waits for one of them while it is merely queued: a
//! rotation that finds no spare ready makes it itself, and a task that
//! needs a sync leads it ([`Shared::sync_up_to`]), so the pool may be small
//! and shared by every engine of a node.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::pool::{Lane, Next, Task, WorkerPool, guarded};
use crate::storage::Storage;
use crate::types::SegmentId;
use crate::wal::segment::{Spare, segment_path};
use crate::wal::{LogOptions, Shared};

/// Spare segments, made ahead by the allocator (or by a rotation that
/// found none ready).
#[derive(Debug)]
pub(crate) struct SpareQueue {
    state: Mutex<SpareState>,
    /// Signals rotators: a spare being made is ready (or failed).
    available: Condvar,
    /// The allocator's windows, which a spare made by a rotation reserves
    /// and populates too: (reserve, populate).
    window: AtomicU64,
    populate: AtomicU64,
}

#[derive(Debug)]
struct SpareState {
    ready: VecDeque<Spare>,
    next_id: u64,
    /// A spare (the one `next_id` names) is being made.
    making: bool,
}

impl SpareQueue {
    pub fn new(next_id: SegmentId) -> Self {
        Self {
            state: Mutex::new(SpareState {
                ready: VecDeque::new(),
                next_id: next_id.0,
                making: false,
            }),
            available: Condvar::new(),
            window: AtomicU64::new(POPULATE_MIN_BYTES),
            populate: AtomicU64::new(POPULATE_MIN_BYTES),
        }
    }

    /// Takes the spare with id `id`: a ready one, the one the allocator is
    /// making (waiting for it), or one made here and now. Fails with the
    /// error of making it (for example disk full).
    pub fn take(&self, id: SegmentId, shared: &Shared) -> Result<Spare> {
        let mut state = self.state.lock();
        loop {
            if let Some(front) = state.ready.front() {
                debug_assert_eq!(front.id, id, "spares are taken in order");
                return Ok(state.ready.pop_front().expect("front exists"));
            }
            shared.health.check()?;
            if shared.shutdown.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            if state.making {
                // Running on another thread: it ends.
                self.available
                    .wait_for(&mut state, Duration::from_millis(50));
                continue;
            }
            debug_assert_eq!(state.next_id, id.0, "spares are made in order");
            state.making = true;
            let window = self.window.load(Ordering::Relaxed);
            let populate = self.populate.load(Ordering::Relaxed);
            let made = parking_lot::MutexGuard::unlocked(&mut state, || {
                create_spare(&*shared.storage, &shared.opts, id, true, window, populate)
            });
            state.making = false;
            self.available.notify_all();
            if made.is_ok() {
                state.next_id += 1;
            }
            return made;
        }
    }

    /// Disk space reserved by the spares made and not taken yet.
    pub fn reserved(&self) -> u64 {
        (self.state.lock().ready.iter())
            .map(|s| s.file.reserved())
            .sum()
    }

    /// Removes the files of spares never used (at shutdown, once the
    /// allocator stopped).
    pub fn discard(&self, shared: &Shared) {
        let spares: Vec<Spare> = self.state.lock().ready.drain(..).collect();
        for spare in &spares {
            let _ = shared.storage.remove(&spare.path);
        }
        if !spares.is_empty() {
            let _ = shared.storage.sync_dir(&shared.opts.dir);
        }
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

/// Whether the log should have a spare made now: the active segment is a
/// quarter claimed, or what is left of it is less than two windows. An idle
/// log never gets one (a spare is a segment's length of disk space
/// reserved).
fn spare_wanted(shared: &Shared, window: u64) -> bool {
    let guard = shared.current.load();
    let Some(active) = guard.as_ref() else {
        return false;
    };
    let (claimed, len) = (active.mapping.claimed(), active.mapping.len());
    claimed.saturating_mul(4) >= len || len - claimed <= window.saturating_mul(2)
}

/// How often the allocator looks at a log that wrote since its last look.
const ALLOCATOR_BUSY_LOOK: Duration = Duration::from_millis(100);

/// How often it looks at an idle one (a burst on an idle log meets no
/// wait: its writers reserve and fault in ahead of themselves, and a
/// rotation makes its own spare, until the allocator's next look).
const ALLOCATOR_IDLE_LOOK: Duration = Duration::from_millis(500);

/// The allocator: a task looking at the log every
/// [`ALLOCATOR_BUSY_LOOK`] (or [`ALLOCATOR_IDLE_LOOK`] while idle). It keeps
/// the active segment reserved and populated a window ahead of the writers,
/// makes spares, and picks their folios. After a failure (for example a
/// full disk) it tries again at its next look; a writer that needs what it
/// failed to make meets the failure itself.
struct Allocator {
    shared: Arc<Shared>,
    /// When, at what processed watermark and with how many bytes processed
    /// but not written through the mapping the write rate was last
    /// measured.
    rate_since: (std::time::Instant, u64, u64),
    /// How far ahead of the writers the active segment is reserved, and
    /// how far populated: the same window for bytes written through the
    /// mapping; bytes appended through the file need no populated pages
    /// (they would only be zero-filled to be overwritten).
    window: u64,
    populate: u64,
    /// The log's progress (processed bytes, syncs) when the previous spare
    /// was made: what it did since picks the next one's folios.
    since: (u64, u64),
    /// The log's progress at each idle look, oldest first: enough to judge
    /// it over its last `FOLIO_JUDGE_SYNCS` syncs.
    looks: VecDeque<(u64, u64)>,
}

impl Allocator {
    fn new(shared: Arc<Shared>) -> Allocator {
        let since = Self::progress(&shared);
        Allocator {
            rate_since: (
                std::time::Instant::now(),
                since.0,
                shared.unmapped_bytes.load(Ordering::Relaxed),
            ),
            window: POPULATE_MIN_BYTES,
            populate: POPULATE_MIN_BYTES,
            since,
            looks: VecDeque::new(),
            shared,
        }
    }

    fn progress(shared: &Shared) -> (u64, u64) {
        (
            shared.tracker.processed(),
            shared.syncs.load(Ordering::Relaxed),
        )
    }

    fn run(&mut self) -> Next {
        let shared = Arc::clone(&self.shared);
        let shared = &*shared;
        if shared.shutdown.load(Ordering::Acquire) || shared.health.is_poisoned() {
            return Next::Stop;
        }
        let queue = &shared.spares;
        // The log's write rate, from the bytes processed since the last look
        // (and, for populating, of those the ones written through the
        // mapping).
        let now = (
            std::time::Instant::now(),
            shared.tracker.processed(),
            shared.unmapped_bytes.load(Ordering::Relaxed),
        );
        let wrote = now.1 > self.rate_since.1;
        let elapsed = now.0 - self.rate_since.0;
        if elapsed >= Duration::from_millis(50) {
            let segment = shared.opts.segment_size;
            let processed = now.1 - self.rate_since.1;
            let mapped = processed.saturating_sub(now.2 - self.rate_since.2);
            self.window = populate_window(processed, elapsed, segment);
            self.populate = populate_window(mapped, elapsed, segment);
            queue.window.store(self.window, Ordering::Relaxed);
            queue.populate.store(self.populate, Ordering::Relaxed);
            self.rate_since = now;
        }
        let window = self.window;
        let id = {
            let mut state = queue.state.lock();
            if !state.making
                && state.ready.len() < shared.opts.spare_segments
                && spare_wanted(shared, window)
            {
                state.making = true;
                Some(SegmentId(state.next_id))
            } else {
                None
            }
        };
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
            let claimed = mapping.claimed();
            mapping.populate_ahead(claimed, claimed.saturating_add(self.populate));
        }
        let Some(id) = id else {
            self.judge_folios();
            return Next::After(if wrote {
                ALLOCATOR_BUSY_LOOK
            } else {
                ALLOCATOR_IDLE_LOOK
            });
        };
        let progress = Self::progress(shared);
        let small = page_folios(progress.0 - self.since.0, progress.1 - self.since.1);
        self.since = progress;
        let result = create_spare(
            &*shared.storage,
            &shared.opts,
            id,
            small,
            window,
            self.populate,
        );
        let mut state = queue.state.lock();
        state.making = false;
        if let Ok(spare) = result {
            state.ready.push_back(spare);
            state.next_id += 1;
        }
        queue.available.notify_all();
        // Another spare may be wanted: look again soon.
        Next::After(crate::pool::TICK)
    }

    /// At an idle look: judges the log over its last `FOLIO_JUDGE_SYNCS`
    /// syncs, and if it is slow gives the active segment's unwritten rest
    /// page folios where it has large ones (a segment mapped while the log
    /// was fast, see `Shared::use_page_folios_ahead`).
    fn judge_folios(&mut self) {
        let now = Self::progress(&self.shared);
        // One look per sync count (the latest), so an idle log keeps one,
        // and a busy one a few.
        match self.looks.back_mut() {
            Some(last) if last.1 == now.1 => *last = now,
            _ => self.looks.push_back(now),
        }
        while self.looks.len() > 1 && now.1 - self.looks[1].1 >= FOLIO_JUDGE_SYNCS {
            self.looks.pop_front();
        }
        let oldest = self.looks[0];
        if now.1 - oldest.1 >= FOLIO_JUDGE_SYNCS && page_folios(now.0 - oldest.0, now.1 - oldest.1)
        {
            self.shared.use_page_folios_ahead();
        }
    }
}

/// Registers a log's allocator and periodic syncer with `pool`.
pub(crate) fn spawn_tasks(shared: &Arc<Shared>, pool: &WorkerPool) -> Vec<Task> {
    let mut allocator = Allocator::new(shared.clone());
    let mut syncer = Syncer {
        shared: shared.clone(),
        idle_runs: 0,
    };
    let interval = shared.opts.sync_interval;
    let health = &shared.health;
    let tasks = vec![
        pool.spawn(
            Lane::Normal,
            ALLOCATOR_BUSY_LOOK,
            guarded(health.clone(), "log allocator", move || allocator.run()),
        ),
        pool.spawn(
            Lane::Sync,
            interval,
            guarded(health.clone(), "log syncer", move || syncer.run()),
        ),
    ];
    let _ = shared.sync.syncer.set(tasks[1].waker());
    tasks
}

/// Creates, persists and maps one spare segment file:
/// 0. remove a leftover file of that name from a failed attempt;
/// 1. create the file at full size, sparse, with the space of its first
///    `populate` bytes (at least [`RESERVE_MIN_BYTES`]) reserved;
/// 2. sync it (its length becomes durable);
/// 3. sync the directory (its name becomes durable);
/// 4. map it (page folios or large ones, see [`page_folios`]), and
///    populate its first `populate` bytes.
///
/// Its first `reserve` bytes (at least, rounded up to
/// [`RESERVE_MIN_BYTES`]) are reserved.
pub(crate) fn create_spare(
    storage: &dyn Storage,
    opts: &LogOptions,
    id: SegmentId,
    page_folios: bool,
    reserve: u64,
    populate: u64,
) -> Result<Spare> {
    let path = segment_path(&opts.dir, opts.kind, id);
    if storage.exists(&path) {
        // Left over from an attempt that failed after creating the file.
        storage.remove(&path).map_err(|e| Error::io(&path, e))?;
    }
    let step = RESERVE_MIN_BYTES;
    let reserve = reserve.max(step).div_ceil(step).saturating_mul(step);
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

/// Who is syncing a log, what its waiters asked for, and the syncer task.
#[derive(Debug, Default)]
pub(crate) struct SyncState {
    /// A thread is syncing the log.
    syncing: Mutex<bool>,
    /// Wakes those waiting for a sync: the one under way ended.
    done: Condvar,
    /// The furthest position a waiter asked the syncer for, and whether the
    /// syncer was woken for it.
    requested: Mutex<(u64, bool)>,
    /// Wakes the syncer task (set once it is registered).
    syncer: std::sync::OnceLock<crate::pool::Waker>,
    /// The syncer parked, the log having had nothing to sync for
    /// [`SYNCER_IDLE_RUNS`] runs: the next writer wakes it.
    parked: AtomicBool,
}

/// Runs in a row with nothing to sync after which the syncer parks until
/// a writer wakes it (one second at the default interval): an idle log's
/// syncer ran ten times a second, 20,000 task runs a second on a node of
/// 1,000 idle replicas.
const SYNCER_IDLE_RUNS: u32 = 10;

/// How long a parked syncer sleeps if no writer wakes it.
const SYNCER_PARKED: Duration = Duration::from_secs(60);

impl Shared {
    /// After a writer's range counted as processed: wakes the syncer if it
    /// parked (see `Syncer::park`).
    pub(crate) fn wake_parked_syncer(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sync.parked.load(Ordering::Relaxed)
            && self.sync.parked.swap(false, Ordering::Relaxed)
            && let Some(syncer) = self.sync.syncer.get()
        {
            syncer.wake();
        }
    }

    /// Returns once every byte below `position` (processed already) is
    /// durable. A thread outside the syncer's pool (a writer of an engine
    /// opened alone; a shard's Raft owner, whose pool is another) asks the
    /// syncer task and waits: the syncer goes straight from one sync to the
    /// next while writers wait, as a thread of its own did (writers that
    /// took turns leading the syncs measured 14% fewer synced puts, and
    /// Raft owners syncing their logs themselves 10–25% fewer puts on a
    /// 4-shard cluster). A task of the syncer's own pool (maintenance, a
    /// flusher) syncs itself, since the syncer may be queued behind it.
    pub(crate) fn wait_synced(&self, position: u64) -> Result<()> {
        let state = &self.sync;
        let syncer = state.syncer.get().filter(|s| !s.in_current_pool());
        let Some(syncer) = syncer else {
            return self.sync_up_to(position);
        };
        {
            let mut requested = state.requested.lock();
            requested.0 = requested.0.max(position);
            if !std::mem::replace(&mut requested.1, true) {
                syncer.wake();
            }
        }
        let mut syncing = state.syncing.lock();
        loop {
            if self.synced_or_stopped(position)? {
                return Ok(());
            }
            state.done.wait_for(&mut syncing, Duration::from_millis(10));
        }
    }

    /// Whether every byte below `position` is durable; an error if the log
    /// is poisoned or shut down (so it never will be).
    fn synced_or_stopped(&self, position: u64) -> Result<bool> {
        if self.synced.load(Ordering::Acquire) >= position {
            return Ok(true);
        }
        self.health.check()?;
        if self.shutdown.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(false)
    }

    /// Returns once every byte below `position` (processed already) is
    /// durable: if no thread is syncing the log, this one syncs everything
    /// processed (leading the writers that queue behind it: one sync for
    /// all of them); otherwise it waits for that sync and looks again.
    pub(crate) fn sync_up_to(&self, position: u64) -> Result<()> {
        let state = &self.sync;
        let mut syncing = state.syncing.lock();
        loop {
            if self.synced_or_stopped(position)? {
                return Ok(());
            }
            if *syncing {
                state.done.wait_for(&mut syncing, Duration::from_millis(10));
                continue;
            }
            *syncing = true;
            let before = self.synced.load(Ordering::Acquire);
            // The sync mark is appended before the waiters learn they are
            // durable: one that then drops the engine (which refuses
            // appends once closed) would otherwise leave the log without a
            // mark over its data, whose damage could then pass for a torn
            // tail.
            let result = parking_lot::MutexGuard::unlocked(&mut syncing, || {
                self.sync_to_processed()?;
                let synced = self.synced.load(Ordering::Acquire);
                if synced > before {
                    self.append_sync_mark(synced);
                }
                Ok(synced)
            });
            *syncing = false;
            state.done.notify_all();
            if result? > before {
                parking_lot::MutexGuard::unlocked(&mut syncing, || self.release_cold_pages());
            }
        }
    }
}

/// The syncer task: syncs while waiters ask (straight from one sync to the
/// next), and makes what buffered writers wrote durable once
/// `sync_interval` passed without a sync by any thread. (Not right after a
/// sync: that would sync the sync mark it appended on its own, a second
/// write-back of the log's tail page per synced write; nor beside a Raft
/// owner that syncs its log itself all the time, which the sync would
/// only hold up.)
struct Syncer {
    shared: Arc<Shared>,
    /// Runs in a row that found nothing to sync.
    idle_runs: u32,
}

impl Syncer {
    /// Parks unless a writer processed bytes meanwhile. With
    /// [`Shared::wake_parked_syncer`]: the syncer stores `parked` then
    /// reads the watermark, a writer advances the watermark then reads
    /// `parked`, each with a full fence between, so at least one sees the
    /// other's store: a write is never left unsynced behind a parked
    /// syncer.
    fn park(&mut self) -> bool {
        let shared = &*self.shared;
        shared.sync.parked.store(true, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
        if shared.tracker.processed() <= shared.synced.load(Ordering::Acquire) {
            return true;
        }
        shared.sync.parked.store(false, Ordering::Relaxed);
        self.idle_runs = 0;
        false
    }

    fn run(&mut self) -> Next {
        let shared = Arc::clone(&self.shared);
        let shared = &*shared;
        if shared.shutdown.load(Ordering::Acquire) || shared.health.is_poisoned() {
            return Next::Stop;
        }
        shared.sync.parked.store(false, Ordering::Relaxed);
        let asked = {
            let mut requested = shared.sync.requested.lock();
            let asked = requested.0 > shared.synced.load(Ordering::Acquire);
            // Seen satisfied: the next request wakes the syncer again.
            requested.1 = asked;
            asked
        };
        if !asked && shared.tracker.processed() <= shared.synced.load(Ordering::Acquire) {
            self.idle_runs += 1;
            if self.idle_runs >= SYNCER_IDLE_RUNS && self.park() {
                return Next::After(SYNCER_PARKED);
            }
        } else {
            self.idle_runs = 0;
        }
        let interval = shared.opts.sync_interval;
        let since = Duration::from_nanos(
            super::tracker::since_start().saturating_sub(shared.last_sync.load(Ordering::Relaxed)),
        );
        if !asked && since < interval {
            return Next::After(interval - since);
        }
        let result = shared.sync_up_to(shared.tracker.processed());
        match result {
            Ok(()) if asked => Next::Again,
            Ok(()) => Next::After(interval),
            // A failed sync poisoned the log.
            Err(_) => Next::Stop,
        }
    }
}
