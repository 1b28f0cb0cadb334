//! A pool of background threads shared by engines.
//!
//! Each engine has background work: its logs' allocators (spare segments,
//! the populate window) and periodic syncs, index flushes, maintenance
//! (flush scheduling, index cleaning, snapshots) and relocation. Each used
//! to run on a thread of its own, eight per engine, so a node hosting a
//! thousand replicas ran eight thousand threads that slept nearly all the
//! time. Here that work is *tasks*: each runs, says when it wants to run
//! next, and gives its thread back. A node makes one pool and opens every
//! engine in it ([`crate::Engine::open_in`]); an engine opened alone gets a
//! small pool of its own.
//!
//! Rules that keep a pool of a few threads from deadlocking: a task never
//! waits for another task. Whoever needs a spare segment the allocator has
//! not made makes it itself; whoever needs a sync leads one (see
//! `wal::workers`). A task may wait for a foreground writer or for work
//! running on another thread, never for work that is only queued.
//!
//! Three lanes: `Normal`; `Low` for relocation, whose threads run at a
//! lower CPU priority (so relocation yields to foreground writes and to the
//! other tasks, as its own thread did); and `Sync` for the logs' syncers,
//! so that a sync a writer waits for never queues behind other work. A
//! pool without threads for a lane runs its tasks on the normal lane.
//!
//! Timers are coarse: a task's next run is rounded up to [`TICK`], so the
//! periodic tasks of many engines become due together and a pool thread
//! wakes once for all of them, not once per task.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// Timer granularity (see the module docs).
pub const TICK: Duration = Duration::from_millis(10);

/// The CPU priority (nice value) of the low lane's threads.
const LOW_LANE_NICE: i32 = 10;

/// Which threads run a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Most work.
    Normal = 0,
    /// Work that yields to the rest (threads at a lower CPU priority; the
    /// normal lane's if the pool has none).
    Low = 1,
    /// Logs' syncers, so that a sync a writer waits for never queues
    /// behind allocation, flushes or maintenance (the normal lane's threads
    /// if the pool has none).
    Sync = 2,
}

const LANES: usize = 3;

/// What a task wants after a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Run again after this long (sooner if woken).
    After(Duration),
    /// Run again as soon as the tasks queued before it ran (more work is
    /// waiting; giving the thread back between bites keeps one busy task
    /// from holding it).
    Again,
    /// Never run again.
    Stop,
}

type Body = Box<dyn FnMut() -> Next + Send>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Waiting for its timer or a wake.
    Waiting,
    /// In its lane's ready queue.
    Ready,
    /// On a pool thread.
    Running,
}

struct Slot {
    lane: Lane,
    status: Status,
    /// When a waiting task is due.
    due: Option<Instant>,
    /// Taken out while the task runs.
    body: Option<Body>,
    /// Woken while running: runs again right away.
    woken: bool,
    /// Its handle asked it to stop while it ran.
    stopping: bool,
}

struct State {
    tasks: HashMap<u64, Slot>,
    ready: [VecDeque<u64>; LANES],
    /// Due times of waiting tasks (an entry whose task was woken, stopped
    /// or rescheduled meanwhile is stale and skipped).
    timers: [BinaryHeap<Reverse<(Instant, u64)>>; LANES],
    shutdown: bool,
}

struct Shared {
    name: String,
    state: Mutex<State>,
    /// Wakes the threads of each lane.
    lanes: [Condvar; LANES],
    /// Wakes those waiting for a running task to stop.
    stopped: Condvar,
}

thread_local! {
    /// The task running on this thread (0: none).
    static CURRENT: Cell<u64> = const { Cell::new(0) };
    /// The pool this thread belongs to (its `Shared`'s address; 0: none).
    static CURRENT_POOL: Cell<usize> = const { Cell::new(0) };
}

/// A pool of background threads that runs the background work of the
/// engines opened in it. Cloning shares the pool; its threads stop when the
/// last clone (and every engine opened in it) is gone.
#[derive(Clone)]
pub struct WorkerPool {
    owner: Arc<Owner>,
}

struct Owner {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Whether the pool has threads of each lane.
    has_lane: [bool; LANES],
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.owner.shared.state.lock();
        f.debug_struct("WorkerPool")
            .field("name", &self.owner.shared.name)
            .field("threads", &self.owner.threads.lock().len())
            .field("tasks", &state.tasks.len())
            .finish()
    }
}

impl WorkerPool {
    /// Starts a pool named `name` (its threads are `name-N` and
    /// `name-low-N`) with `threads` threads (at least one) for most work
    /// and `low_threads` at a lower CPU priority for relocation (none: the
    /// low lane's tasks run on the normal lane).
    pub fn new(name: &str, threads: usize, low_threads: usize) -> Result<WorkerPool> {
        WorkerPool::with_sync_lane(name, threads, low_threads, 0)
    }

    /// [`WorkerPool::new`] with `sync_threads` threads (`name-sync-N`) for
    /// the logs' syncers.
    pub fn with_sync_lane(
        name: &str,
        threads: usize,
        low_threads: usize,
        sync_threads: usize,
    ) -> Result<WorkerPool> {
        let shared = Arc::new(Shared {
            name: name.to_string(),
            state: Mutex::new(State {
                tasks: HashMap::new(),
                ready: Default::default(),
                timers: Default::default(),
                shutdown: false,
            }),
            lanes: Default::default(),
            stopped: Condvar::new(),
        });
        let owner = Arc::new(Owner {
            shared: shared.clone(),
            threads: Mutex::new(Vec::new()),
            has_lane: [true, low_threads > 0, sync_threads > 0],
        });
        let lanes = [
            (Lane::Normal, threads.max(1)),
            (Lane::Low, low_threads),
            (Lane::Sync, sync_threads),
        ];
        for (lane, count) in lanes {
            for i in 0..count {
                let thread_name = match lane {
                    Lane::Normal => format!("{name}-{i}"),
                    Lane::Low => format!("{name}-low-{i}"),
                    Lane::Sync => format!("{name}-sync-{i}"),
                };
                let shared = shared.clone();
                let thread = std::thread::Builder::new()
                    .name(thread_name)
                    .spawn(move || run_worker(&shared, lane))
                    .map_err(|e| Error::io("<spawning a worker thread>", e))?;
                owner.threads.lock().push(thread);
            }
        }
        Ok(WorkerPool { owner })
    }

    /// The pool of an engine opened on its own: enough threads that its
    /// flushes, maintenance and log work do not queue behind each other.
    pub(crate) fn private(flushers: usize) -> Result<WorkerPool> {
        WorkerPool::new("tidepool-engine", flushers + 2, 1)
    }

    /// The pool's threads (both lanes).
    pub fn threads(&self) -> usize {
        self.owner.threads.lock().len()
    }

    /// Tasks registered and not stopped.
    pub fn tasks(&self) -> usize {
        self.owner.shared.state.lock().tasks.len()
    }

    /// Registers a task that first runs after `first` (zero: right away).
    /// It must never wait for another task that is not running (see the
    /// module docs).
    pub fn spawn(
        &self,
        lane: Lane,
        first: Duration,
        body: impl FnMut() -> Next + Send + 'static,
    ) -> Task {
        let lane = if self.owner.has_lane[lane as usize] {
            lane
        } else {
            Lane::Normal
        };
        let shared = &self.owner.shared;
        // Unique across pools: `CURRENT` tells which task runs on a thread.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut state = shared.state.lock();
        let mut slot = Slot {
            lane,
            status: Status::Waiting,
            due: None,
            body: Some(Box::new(body)),
            woken: false,
            stopping: false,
        };
        if first.is_zero() {
            slot.status = Status::Ready;
            state.ready[lane as usize].push_back(id);
            shared.lanes[lane as usize].notify_one();
        } else {
            let due = round_up(Instant::now() + first);
            slot.due = Some(due);
            state.timers[lane as usize].push(Reverse((due, id)));
            shared.lanes[lane as usize].notify_one();
        }
        state.tasks.insert(id, slot);
        Task {
            waker: Waker {
                shared: shared.clone(),
                id,
            },
            _pool: self.clone(),
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        for lane in &self.shared.lanes {
            lane.notify_all();
        }
        let me = std::thread::current().id();
        for thread in self.threads.lock().drain(..) {
            // The last handle may go on one of the pool's own threads (a
            // task's captures dropped there): that one ends by itself.
            if thread.thread().id() != me {
                let _ = thread.join();
            }
        }
    }
}

/// Rounds `at` up to the next [`TICK`] boundary of a process-wide clock.
fn round_up(at: Instant) -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let since = at.saturating_duration_since(epoch).as_nanos();
    let tick = TICK.as_nanos();
    let ticks = since.div_ceil(tick);
    epoch + Duration::from_nanos(u64::try_from(ticks * tick).unwrap_or(u64::MAX))
}

fn run_worker(shared: &Shared, lane: Lane) {
    if lane == Lane::Low {
        // On Linux a thread id names the thread alone; failure (a platform
        // without per-thread priorities) only leaves it at normal priority.
        let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), LOW_LANE_NICE);
    }
    CURRENT_POOL.with(|c| c.set(std::ptr::from_ref(shared) as usize));
    let l = lane as usize;
    let mut state = shared.state.lock();
    loop {
        let now = Instant::now();
        while let Some(&Reverse((due, id))) = state.timers[l].peek() {
            if due > now {
                break;
            }
            state.timers[l].pop();
            if let Some(slot) = state.tasks.get_mut(&id)
                && slot.status == Status::Waiting
                && slot.due == Some(due)
            {
                slot.status = Status::Ready;
                slot.due = None;
                state.ready[l].push_back(id);
            }
        }
        if let Some(id) = state.ready[l].pop_front() {
            if !state.ready[l].is_empty() {
                shared.lanes[l].notify_one();
            }
            // A task stopped while it waited in the queue left its id
            // behind (ids are never reused).
            let Some(slot) = state.tasks.get_mut(&id) else {
                continue;
            };
            slot.status = Status::Running;
            slot.woken = false;
            let mut body = slot.body.take().expect("a ready task has its body");
            let next = parking_lot::MutexGuard::unlocked(&mut state, || {
                CURRENT.with(|c| c.set(id));
                let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut body))
                    .unwrap_or(Next::Stop);
                CURRENT.with(|c| c.set(0));
                next
            });
            let slot = state
                .tasks
                .get_mut(&id)
                .expect("a running task stays registered");
            let after = match next {
                Next::After(after) if !slot.stopping => Some(after),
                Next::Again if !slot.stopping => None,
                _ => {
                    state.tasks.remove(&id);
                    shared.stopped.notify_all();
                    // Its captures may own engines: dropped without the lock.
                    parking_lot::MutexGuard::unlocked(&mut state, || drop(body));
                    continue;
                }
            };
            slot.body = Some(body);
            if let (false, Some(after)) = (slot.woken, after) {
                let due = round_up(Instant::now() + after);
                slot.status = Status::Waiting;
                slot.due = Some(due);
                state.timers[l].push(Reverse((due, id)));
            } else {
                slot.status = Status::Ready;
                state.ready[l].push_back(id);
            }
            continue;
        }
        if state.shutdown {
            return;
        }
        match state.timers[l].peek() {
            Some(&Reverse((due, _))) => {
                shared.lanes[l].wait_until(&mut state, due);
            }
            None => shared.lanes[l].wait(&mut state),
        }
    }
}

/// `body`, poisoning `health` if it panics (the task then stops): a
/// background task that died would leave its engine silently without it.
pub(crate) fn guarded(
    health: Arc<crate::health::Health>,
    what: &'static str,
    mut body: impl FnMut() -> Next + Send + 'static,
) -> impl FnMut() -> Next + Send + 'static {
    move || match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut body)) {
        Ok(next) => next,
        Err(_) => {
            health.poison(format!("the background task {what} panicked"));
            Next::Stop
        }
    }
}

/// Wakes a task (a cheap handle that does not keep it registered).
#[derive(Clone)]
pub struct Waker {
    shared: Arc<Shared>,
    id: u64,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Waker({}#{})", self.shared.name, self.id)
    }
}

impl Waker {
    /// Whether the calling thread is one of the task's pool's (so waiting
    /// for the task could wait for a thread that is not free).
    pub fn in_current_pool(&self) -> bool {
        CURRENT_POOL.with(|c| c.get()) == Arc::as_ptr(&self.shared) as usize
    }

    /// Runs the task as soon as a thread is free (once more after its
    /// current run if it is running). Does nothing if it stopped.
    pub fn wake(&self) {
        let mut state = self.shared.state.lock();
        let Some(slot) = state.tasks.get_mut(&self.id) else {
            return;
        };
        match slot.status {
            Status::Waiting => {
                slot.status = Status::Ready;
                slot.due = None;
                let lane = slot.lane as usize;
                state.ready[lane].push_back(self.id);
                self.shared.lanes[lane].notify_one();
            }
            Status::Running => slot.woken = true,
            Status::Ready => {}
        }
    }
}

/// A registered task: stops it when dropped (see [`Task::stop`]). Keeps
/// the pool alive.
pub struct Task {
    waker: Waker,
    _pool: WorkerPool,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Task({}#{})", self.waker.shared.name, self.waker.id)
    }
}

impl Task {
    /// A handle that wakes the task.
    pub fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// Unregisters the task; if it is running on another thread, waits for
    /// that run to end. Afterwards it never runs again. (From inside its own
    /// run it only marks it stopped.)
    pub fn stop(&self) {
        let shared = &self.waker.shared;
        let id = self.waker.id;
        let mut state = shared.state.lock();
        let inside = CURRENT.with(|c| c.get()) == id;
        loop {
            let Some(slot) = state.tasks.get_mut(&id) else {
                return;
            };
            if slot.status != Status::Running {
                let body = state.tasks.remove(&id).and_then(|s| s.body);
                drop(state);
                drop(body);
                return;
            }
            slot.stopping = true;
            if inside {
                return;
            }
            shared.stopped.wait(&mut state);
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn counter_task(pool: &WorkerPool, every: Duration) -> (Task, Arc<AtomicU32>) {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let task = pool.spawn(Lane::Normal, every, move || {
            counted.fetch_add(1, Ordering::SeqCst);
            Next::After(every)
        });
        (task, runs)
    }

    fn wait_until(what: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !what() {
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_task_runs_on_its_timer_and_when_woken() {
        let pool = WorkerPool::new("test-pool", 1, 1).unwrap();
        let (task, runs) = counter_task(&pool, Duration::from_secs(3600));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(runs.load(Ordering::SeqCst), 0, "not due for an hour");
        task.waker().wake();
        wait_until(|| runs.load(Ordering::SeqCst) == 1);
        task.waker().wake();
        wait_until(|| runs.load(Ordering::SeqCst) == 2);
        let (_fast, fast_runs) = counter_task(&pool, Duration::from_millis(10));
        wait_until(|| fast_runs.load(Ordering::SeqCst) >= 5);
    }

    #[test]
    fn many_tasks_share_a_few_threads() {
        let pool = WorkerPool::new("test-pool", 2, 1).unwrap();
        let tasks: Vec<_> = (0..500)
            .map(|_| counter_task(&pool, Duration::from_millis(20)))
            .collect();
        wait_until(|| {
            tasks
                .iter()
                .all(|(_, runs)| runs.load(Ordering::SeqCst) >= 3)
        });
        assert_eq!(pool.threads(), 3);
        assert_eq!(pool.tasks(), 500);
        drop(tasks);
        assert_eq!(pool.tasks(), 0, "dropping a task unregisters it");
    }

    #[test]
    fn stop_waits_for_a_running_task_and_it_never_runs_again() {
        let pool = WorkerPool::new("test-pool", 2, 1).unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let runs = Arc::new(AtomicU32::new(0));
        let finished = Arc::new(AtomicU32::new(0));
        let (r, f) = (runs.clone(), finished.clone());
        let task = pool.spawn(Lane::Normal, Duration::ZERO, move || {
            r.fetch_add(1, Ordering::SeqCst);
            let _ = entered_tx.send(());
            std::thread::sleep(Duration::from_millis(100));
            f.fetch_add(1, Ordering::SeqCst);
            Next::After(Duration::ZERO)
        });
        entered_rx.recv().unwrap();
        task.stop();
        assert_eq!(
            finished.load(Ordering::SeqCst),
            1,
            "stop waited for the run"
        );
        let after = runs.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(runs.load(Ordering::SeqCst), after);
        assert_eq!(pool.tasks(), 0);
    }

    /// A task stopped while it waits in the ready queue (woken, every
    /// thread busy) leaves its id there; the thread that pops it skips it.
    /// (It used to panic, and the pool's lane lost that thread: with all
    /// sync-lane threads gone this way, a node stopping 256 replicas hung
    /// waiting for syncs that no thread would run.)
    #[test]
    fn a_task_stopped_while_queued_is_skipped_and_the_thread_goes_on() {
        let pool = WorkerPool::new("test-pool", 1, 0).unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let release_rx = Mutex::new(release_rx);
        // Holds the only thread until released.
        let _busy = pool.spawn(Lane::Normal, Duration::ZERO, move || {
            let _ = entered_tx.send(());
            let _ = release_rx.lock().recv();
            Next::Stop
        });
        entered_rx.recv().unwrap();
        let ran = Arc::new(AtomicU32::new(0));
        let r = ran.clone();
        let queued = pool.spawn(Lane::Normal, Duration::from_secs(3600), move || {
            r.fetch_add(1, Ordering::SeqCst);
            Next::Stop
        });
        queued.waker().wake();
        queued.stop();
        release_tx.send(()).unwrap();
        // The thread survived the stale entry: a new task still runs.
        let (_task, runs) = counter_task(&pool, Duration::from_millis(10));
        wait_until(|| runs.load(Ordering::SeqCst) >= 2);
        assert_eq!(ran.load(Ordering::SeqCst), 0, "a stopped task never runs");
    }

    #[test]
    fn a_panicking_task_stops_and_the_pool_goes_on() {
        let pool = WorkerPool::new("test-pool", 1, 1).unwrap();
        let _bad = pool.spawn(Lane::Normal, Duration::ZERO, || panic!("a task failed"));
        wait_until(|| pool.tasks() == 0);
        let (_task, runs) = counter_task(&pool, Duration::from_millis(10));
        wait_until(|| runs.load(Ordering::SeqCst) >= 2);
    }

    #[test]
    fn a_task_may_stop_itself_from_inside_its_run() {
        let pool = WorkerPool::new("test-pool", 1, 1).unwrap();
        let slot: Arc<Mutex<Option<Task>>> = Arc::new(Mutex::new(None));
        let inside = slot.clone();
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let task = pool.spawn(Lane::Normal, Duration::from_millis(20), move || {
            r.fetch_add(1, Ordering::SeqCst);
            // Dropping its own handle inside its run must not deadlock.
            drop(inside.lock().take());
            Next::After(Duration::from_millis(1))
        });
        *slot.lock() = Some(task);
        wait_until(|| runs.load(Ordering::SeqCst) == 1 && pool.tasks() == 0);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn sync_lane_tasks_run_on_their_lane_or_the_normal_one() {
        let name_of = |pool: &WorkerPool| {
            let (tx, rx) = std::sync::mpsc::channel();
            let _task = pool.spawn(Lane::Sync, Duration::ZERO, move || {
                let _ = tx.send(std::thread::current().name().map(str::to_string));
                Next::Stop
            });
            rx.recv_timeout(Duration::from_secs(10)).unwrap()
        };
        let with = WorkerPool::with_sync_lane("test-pool", 1, 0, 1).unwrap();
        assert_eq!(name_of(&with).as_deref(), Some("test-pool-sync-0"));
        let without = WorkerPool::new("test-pool", 1, 0).unwrap();
        assert_eq!(name_of(&without).as_deref(), Some("test-pool-0"));
    }

    #[test]
    fn low_lane_tasks_run_on_low_lane_threads() {
        let pool = WorkerPool::new("test-pool", 1, 1).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let _task = pool.spawn(Lane::Low, Duration::ZERO, move || {
            let _ = tx.send(std::thread::current().name().map(str::to_string));
            Next::Stop
        });
        let name = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(name.as_deref(), Some("test-pool-low-0"));
    }
}
