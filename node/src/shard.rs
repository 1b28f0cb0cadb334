//! A shard replica's owner: the one task that drives its [`Replica`]
//! through ticks, messages, proposals and the Ready checklist. Everyone else
//! talks to it through events on a bounded queue. Owners are tasks of a
//! worker pool shared by the node's replicas (`DriverConfig::pool`), not
//! threads of their own: a round runs when events arrive or a tick is due,
//! and gives the thread back (a node of a thousand replicas ran a thousand
//! owner threads that slept nearly all the time).
//!
//! An owner's round never waits for another owner: it makes its log
//! durable itself (leading the sync) and sends messages without blocking.
//!
//! Group commit: the owner takes every event already queued before it runs
//! the Ready checklist, so the puts that arrived while the previous Ready was
//! being made durable become one Raft entry (up to `max_batch_ops` ops and
//! `max_batch_bytes` of values), and the reads that arrived become one
//! ReadIndex request.
//!
//! A replica that fails (its engine poisoned by an I/O error, say) is
//! dropped and reopened from its directory after a backoff, as a restarted
//! process would be; meanwhile every request fails with a clear error.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::{Condvar, Mutex};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use raft::eraftpb::{ConfChangeV2, Message};
use tidepool_engine::Engine;
use tidepool_engine::pool::{Lane, Next, Task, Waker, WorkerPool};

use crate::command::{Command, WriteOp};
use crate::entry_context::EntrySync;
use crate::error::{NodeError, Result};
use crate::replica::{
    Completion, Outcome, ReadCompletion, ReadOutcome, Replica, ReplicaConfig, ReplicaStatus,
};
use crate::snapshot::Outbox;
use crate::store::ReplicaStore;

/// Where the owner sends Raft messages.
pub trait Outgoing: Send + Sync + 'static {
    /// Sends `message` (addressed by `message.to`) for `shard`; never
    /// blocks (a message that cannot be queued is dropped: Raft resends).
    fn send(&self, shard: u32, message: Message);

    /// The groups split off `shard` changed (a split applied, or a
    /// snapshot or restart brought a state that names them): whoever hosts
    /// replicas opens theirs (`docs/design/splits.md`). Never blocks.
    fn split_off(&self, shard: u32) {
        let _ = shard;
    }
}

/// How the owner runs.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Time per Raft tick.
    pub tick: Duration,
    /// Most ops group-committed into one entry.
    pub max_batch_ops: usize,
    /// Most value bytes group-committed into one entry.
    pub max_batch_bytes: usize,
    /// Events that may wait for the owner; more are refused (overload).
    pub queue: usize,
    /// First wait before reopening a failed replica (doubles, up to 30 s).
    pub reopen_backoff: Duration,
    /// The pool the owner runs in (the node's); `None`: a thread of its
    /// own (a pool of one).
    pub pool: Option<WorkerPool>,
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self {
            tick: Duration::from_millis(100),
            max_batch_ops: 256,
            max_batch_bytes: 4 << 20,
            queue: 65_536,
            reopen_backoff: Duration::from_millis(500),
            pool: None,
        }
    }
}

/// What the owner can be asked to do.
pub enum Event {
    /// A Raft message from a peer.
    Step(Box<Message>),
    /// A snapshot message whose files are in the spare slot: step it and
    /// install it now.
    SnapshotReceived(Box<Message>),
    /// A put or delete, group-committed with others (the batch's entry is
    /// synced everywhere if any of its writes asks), with the span of the
    /// request that asked for it (a disabled span when not traced).
    Write(Box<WriteOp>, EntrySync, Completion, tracing::Span),
    /// Any other command, proposed alone.
    Propose(Command, EntrySync, Completion),
    /// A linearizable read point, batched with others.
    Read(ReadCompletion),
    /// A membership change.
    ConfChange(ConfChangeV2, Completion),
    /// Hand leadership to this voter; answered with the refusal's reason
    /// if the leader does not see it reachable and caught up.
    TransferLeader(u64, TransferReply),
    /// The node of this follower's leader went silent
    /// (`Replica::leader_lost`).
    LeaderLost(u64),
    /// Stop the owner (closing the replica).
    Stop,
}

/// Answers a leadership transfer request.
pub type TransferReply = Box<dyn FnOnce(std::result::Result<(), String>) + Send>;

/// The owner's queue of events: a deque that grows with what waits and is
/// taken whole by the owner. A bounded channel allocates and writes every
/// slot up front (65,536 events: 8 MiB per replica, idle or not), and an
/// unbounded list channel cost 3-replica puts about 8% (`node-shard`,
/// three runs each).
struct EventQueue {
    state: Mutex<Queued>,
    /// Most events waiting; more are refused (overload).
    limit: usize,
    /// Wakes the owner's task (set once it is registered).
    owner: std::sync::OnceLock<Waker>,
    /// Set once the owner has closed the replica and let go of it.
    closed: (Mutex<bool>, Condvar),
}

struct Queued {
    events: VecDeque<Event>,
    /// The owner was woken for the events queued since it last took them
    /// (so only the first event after a take wakes it).
    woken: bool,
}

impl EventQueue {
    fn new(limit: usize) -> Self {
        Self {
            state: Mutex::new(Queued {
                events: VecDeque::new(),
                woken: false,
            }),
            limit,
            owner: std::sync::OnceLock::new(),
            closed: (Mutex::new(false), Condvar::new()),
        }
    }

    /// Queues `event`, unless `limit` events wait and it is not `forced`,
    /// and wakes the owner if no earlier event did since it last looked.
    fn push(&self, event: Event, forced: bool) -> std::result::Result<(), Event> {
        self.push_within(event, if forced { usize::MAX } else { self.limit })
    }

    /// Queues a peer's Raft message: up to twice the limit, so that a
    /// queue full of client work (refused past `limit`) still takes the
    /// appends, acknowledgements, heartbeats and votes that drain it.
    /// Raft's flow control bounds what peers send.
    fn push_peer(&self, event: Event) -> std::result::Result<(), Event> {
        self.push_within(event, self.limit.saturating_mul(2))
    }

    fn push_within(&self, event: Event, limit: usize) -> std::result::Result<(), Event> {
        let mut state = self.state.lock();
        if state.events.len() >= limit {
            return Err(event);
        }
        state.events.push_back(event);
        let wake = !std::mem::replace(&mut state.woken, true);
        drop(state);
        if wake && let Some(owner) = self.owner.get() {
            owner.wake();
        }
        Ok(())
    }

    /// Swaps everything queued into `into` (which must be empty).
    fn take(&self, into: &mut VecDeque<Event>) {
        debug_assert!(into.is_empty());
        let mut state = self.state.lock();
        state.woken = false;
        std::mem::swap(&mut state.events, into);
    }

    /// Waits until the owner let go of the replica.
    fn wait_closed(&self) {
        let (lock, condvar) = &self.closed;
        let mut closed = lock.lock();
        while !*closed {
            condvar.wait(&mut closed);
        }
    }
}

/// Tells [`EventQueue::wait_closed`] when dropped: the owner's state (its
/// replica) is gone however its task ended, even by a panic.
struct ClosedSignal(Arc<EventQueue>);

impl Drop for ClosedSignal {
    fn drop(&mut self) {
        let (lock, condvar) = &self.0.closed;
        *lock.lock() = true;
        condvar.notify_all();
    }
}

/// What the owner last published about its replica.
#[derive(Clone, Debug, Default)]
pub struct ShardState {
    /// Raft status (default while the replica is down).
    pub status: Option<ReplicaStatus>,
    /// Why the replica is down, if it is.
    pub failed: Option<String>,
    /// Down because its files are gone ([`NodeError::FilesMissing`]): it
    /// stays down until they return.
    pub files_missing: bool,
    /// The shard's epoch.
    pub epoch: u32,
    /// Disk bytes of its engine.
    pub disk_bytes: u64,
    /// Bytes of the values its engine holds (`Engine::data_bytes`).
    pub data_bytes: Option<u64>,
    /// Whether a snapshot is being received.
    pub receiving_snapshot: bool,
    /// Bytes of it written so far.
    pub snapshot_bytes_received: u64,
    /// Requests routed to the replica, and where a split would divide
    /// them (`crate::load`).
    pub load: crate::load::LoadReport,
}

/// What the owner counts for metrics (shared handles: clones count
/// together).
#[derive(Clone, Debug)]
pub struct ShardStats {
    /// Entries proposed by this replica that applied.
    pub proposals: Counter,
    /// Entries proposed by this replica that another leader's replaced.
    pub proposals_dropped: Counter,
    /// Leader changes seen (a new, known leader).
    pub leader_changes: Counter,
    /// Snapshots installed.
    pub snapshots_installed: Counter,
    /// Linearizable reads served on the lease without the owner
    /// ([`ShardHandle::read_now`]).
    pub lease_reads_direct: Counter,
    /// Time from proposing an entry to applying it, seconds.
    pub commit_latency: Histogram,
}

impl Default for ShardStats {
    fn default() -> Self {
        Self {
            proposals: Counter::default(),
            proposals_dropped: Counter::default(),
            leader_changes: Counter::default(),
            snapshots_installed: Counter::default(),
            lease_reads_direct: Counter::default(),
            commit_latency: Histogram::new(tidepool_telemetry::metrics::latency_buckets()),
        }
    }
}

impl ShardStats {
    /// `done`, also counting the proposal's outcome and commit latency.
    fn counted(&self, done: Completion) -> Completion {
        let stats = self.clone();
        let start = Instant::now();
        Box::new(move |outcome: Outcome| {
            match &outcome {
                Outcome::Applied { .. } => {
                    stats.proposals.inc();
                    stats.commit_latency.observe(start.elapsed().as_secs_f64());
                }
                Outcome::Dropped => {
                    stats.proposals_dropped.inc();
                }
                _ => {}
            }
            done(outcome)
        })
    }
}

/// The handle everyone else holds.
pub struct ShardHandle {
    /// The shard.
    pub shard_id: u32,
    store: ReplicaStore,
    queue: Arc<EventQueue>,
    engine: ArcSwap<Engine>,
    state: Mutex<ShardState>,
    fetching: AtomicBool,
    /// Bytes of the snapshot being received written so far.
    snapshot_received: AtomicU64,
    /// Snapshot transfers writing into the replica's spare slot.
    transfers: Mutex<Transfers>,
    transfer_ended: Condvar,
    /// Turns true when the replica stops: a transfer then ends.
    stopping: tokio::sync::watch::Sender<bool>,
    /// The owner's task in the pool.
    task: Mutex<Option<Task>>,
    stats: ShardStats,
    /// The hash range the group owns as its replicated state says (`None`:
    /// not recorded), shown by the replica itself (`ReplicaConfig::
    /// range_cell`).
    range: crate::replica::RangeCell,
    /// Requests the node routed here (`crate::load`).
    load: crate::load::Load,
    /// While the replica follows a known leader: that leader (else 0).
    following: AtomicU64,
    /// Open while a linearizable read may be served without the owner.
    lease_gate: crate::replica::LeaseGate,
}

impl std::fmt::Debug for ShardHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardHandle")
            .field("shard", &self.shard_id)
            .finish()
    }
}

/// Everything needed to (re)open the replica.
struct Opener {
    config: ReplicaConfig,
    store: ReplicaStore,
    outbox: Arc<Outbox>,
}

impl Opener {
    /// Opens the replica again after a failure: its files must still be
    /// there ([`ReplicaStore::expect_existing`]).
    fn reopen(&self) -> Result<Replica> {
        self.store.expect_existing()?;
        self.open(&[])
    }

    fn open(&self, voters: &[u64]) -> Result<Replica> {
        Replica::open(
            self.config.clone(),
            self.store.clone(),
            self.outbox.clone(),
            voters,
        )
    }
}

impl ShardHandle {
    /// Opens the replica in `store` and starts its owner task (in
    /// `driver.pool`).
    pub fn start(
        config: ReplicaConfig,
        driver: DriverConfig,
        store: ReplicaStore,
        outbox: Arc<Outbox>,
        initial_voters: &[u64],
        outgoing: Arc<dyn Outgoing>,
    ) -> Result<Arc<ShardHandle>> {
        let range = crate::replica::RangeCell::default();
        let lease_gate = crate::replica::LeaseGate::new(config.lease_clock.clone());
        let opener = Opener {
            config: ReplicaConfig {
                range_cell: Some(range.clone()),
                session_clock: Some(Arc::new(crate::session::SessionClock::default())),
                lease_gate: Some(lease_gate.clone()),
                ..config
            },
            store,
            outbox,
        };
        let replica = opener.open(initial_voters)?;
        let opener_node_id = opener.config.node_id;
        let queue = Arc::new(EventQueue::new(driver.queue));
        let handle = Arc::new(ShardHandle {
            shard_id: opener.config.shard_id,
            store: opener.store.clone(),
            queue: queue.clone(),
            engine: ArcSwap::new(replica.engine().clone()),
            state: Mutex::new(ShardState::default()),
            fetching: AtomicBool::new(false),
            snapshot_received: AtomicU64::new(0),
            transfers: Mutex::new(Transfers::default()),
            transfer_ended: Condvar::new(),
            stopping: tokio::sync::watch::Sender::new(false),
            task: Mutex::new(None),
            stats: ShardStats::default(),
            range,
            load: crate::load::Load::default(),
            following: AtomicU64::new(0),
            lease_gate,
        });
        let mut owner = Owner {
            handle: handle.clone(),
            opener,
            driver,
            outgoing,
            replica: Some(replica),
            down_since: None,
            reopened_at: None,
            backoff: Duration::ZERO,
            writes: Vec::new(),
            write_spans: Vec::new(),
            write_bytes: 0,
            write_sync: EntrySync::AsConfigured,
            reads: Vec::new(),
            batch: VecDeque::new(),
            next_tick: Instant::now(),
            // A root: its lines belong to no request that opened it.
            span: tracing::info_span!(
                parent: None,
                "shard",
                node_id = opener_node_id,
                shard_id = handle.shard_id
            ),
        };
        owner.span.in_scope(|| owner.publish());
        owner.next_tick = Instant::now() + owner.driver.tick;
        let pool = match &owner.driver.pool {
            Some(pool) => pool.clone(),
            None => WorkerPool::new(&format!("shard-{}", handle.shard_id), 1, 0)
                .map_err(NodeError::Engine)?,
        };
        let signal = ClosedSignal(queue.clone());
        let task = pool.spawn(Lane::Normal, owner.driver.tick, move || {
            let _signal = &signal;
            owner.round(&signal.0)
        });
        let _ = queue.owner.set(task.waker());
        // Events queued before the owner could be woken: look now.
        task.waker().wake();
        *handle.task.lock() = Some(task);
        Ok(handle)
    }

    /// The replica's directory.
    pub fn store(&self) -> &ReplicaStore {
        &self.store
    }

    /// Queues an event; `Err` gives it back if the queue is full (the
    /// driver's `queue` events wait, give or take the senders racing this
    /// check) or the owner stopped.
    pub fn send(&self, event: Event) -> std::result::Result<(), Event> {
        self.queue.push(event, false)
    }

    /// Queues a snapshot whose files were received, for its install,
    /// however full the queue is: one transfer at a time holds the claim
    /// ([`ShardHandle::begin_snapshot`]), and refusing it threw the whole
    /// transfer away (the leader then prepared and sent another).
    pub fn snapshot_received(&self, message: Message) -> std::result::Result<(), Event> {
        self.queue
            .push(Event::SnapshotReceived(Box::new(message)), true)
    }

    /// Queues a put or delete; its completion gets `Failed` if refused.
    /// When spans are exported, the caller's current span follows the
    /// write into its Raft entry if its trace is sampled.
    pub fn write(&self, op: WriteOp, sync: EntrySync, done: Completion) {
        let span = if tidepool_security::trace_context::exporting() {
            Some(tracing::Span::current())
                .filter(tidepool_security::trace_context::sampled)
                .unwrap_or_else(tracing::Span::none)
        } else {
            tracing::Span::none()
        };
        if let Err(Event::Write(_, _, done, _)) =
            self.send(Event::Write(Box::new(op), sync, done, span))
        {
            done(Outcome::Overloaded);
        }
    }

    /// What the owner counts.
    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// Queues a command.
    pub fn propose(&self, command: Command, sync: EntrySync, done: Completion) {
        if let Err(Event::Propose(_, _, done)) = self.send(Event::Propose(command, sync, done)) {
            done(Outcome::Overloaded);
        }
    }

    /// Queues a linearizable read.
    pub fn read(&self, done: ReadCompletion) {
        if let Err(Event::Read(done)) = self.send(Event::Read(done)) {
            done(ReadOutcome::Failed("the shard is overloaded".into()));
        }
    }

    /// Whether a linearizable read arriving now may read the engine at
    /// once: the leader's lease gate is open (`replica/read.rs`, "Reads
    /// without the owner"). Otherwise ask [`ShardHandle::read`]: also
    /// when the engine is poisoned since the owner's last round, so that
    /// the owner fails the replica now and the read is answered as by a
    /// replica that is down.
    pub fn read_now(&self) -> bool {
        let open = self.lease_gate.is_open() && self.engine.load().health().is_ok();
        if open {
            self.stats.lease_reads_direct.inc();
        }
        open
    }

    /// Queues a membership change.
    pub fn change_membership(&self, change: ConfChangeV2, done: Completion) {
        if let Err(Event::ConfChange(_, done)) = self.send(Event::ConfChange(change, done)) {
            done(Outcome::Overloaded);
        }
    }

    /// Delivers a Raft message (dropped if the queue is full even of peer
    /// messages: client events cannot crowd them out).
    pub fn step(&self, message: Message) -> bool {
        self.queue.push_peer(Event::Step(Box::new(message))).is_ok()
    }

    /// Whether `node` is a member of the group as this replica last
    /// published it (a voter, outgoing voters included, or a learner).
    pub fn has_member(&self, node: u64) -> bool {
        self.state
            .lock()
            .status
            .as_ref()
            .is_some_and(|s| s.voters.contains(&node) || s.learners.contains(&node))
    }

    /// The engine holding the shard's applied state (replaced when a
    /// snapshot is installed).
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.load_full()
    }

    /// The hash range the group owns, as its replicated state last said
    /// (`None`: not recorded).
    pub fn range(&self) -> Option<(u64, u64)> {
        *self.range.read()
    }

    /// Counts the requests routed to this replica.
    pub fn load(&self) -> &crate::load::Load {
        &self.load
    }

    /// The leader this replica follows, if it knows one (the node tells
    /// it when that leader's node goes silent: a quiesced follower counts
    /// no ticks toward an election).
    pub fn following(&self) -> Option<u64> {
        match self.following.load(Ordering::Acquire) {
            0 => None,
            leader => Some(leader),
        }
    }

    /// Tells a follower that its leader's node went silent.
    pub fn leader_lost(&self, leader: u64) {
        let _ = self.send(Event::LeaderLost(leader));
    }

    /// What the owner last published.
    pub fn state(&self) -> ShardState {
        let mut state = self.state.lock().clone();
        state.receiving_snapshot = self.fetching.load(Ordering::Acquire);
        state.snapshot_bytes_received = if state.receiving_snapshot {
            self.snapshot_received.load(Ordering::Relaxed)
        } else {
            0
        };
        state
    }

    /// Claims the right to receive a snapshot (one at a time): `None` if a
    /// transfer is already running or the replica has stopped. The
    /// transfer writes into the replica's directory until the returned
    /// guard is dropped, and must end when [`SnapshotTransfer::stopped`]
    /// resolves: [`ShardHandle::stop`] waits for that, so a replica's
    /// directory is deleted only once nothing writes into it.
    pub fn begin_snapshot(self: &Arc<Self>) -> Option<SnapshotTransfer> {
        if self.state.lock().files_missing {
            // Down for good: it would only be thrown away.
            return None;
        }
        let mut transfers = self.transfers.lock();
        if transfers.stopped || transfers.reopening || self.fetching.swap(true, Ordering::AcqRel) {
            return None;
        }
        transfers.running = true;
        self.snapshot_received.store(0, Ordering::Relaxed);
        Some(SnapshotTransfer {
            shard: self.clone(),
            stopping: self.stopping.subscribe(),
        })
    }

    /// Marks the failed replica as reopening unless a snapshot transfer
    /// writes into its spare slot (which the opening empties: the transfer
    /// would go on writing the rest of its files and mark the slot
    /// complete without the ones deleted under it), or a received snapshot
    /// waits for its install (the opening would delete its files, and the
    /// reopened replica then stepped a snapshot it had no files for). While
    /// marked, no transfer starts; [`ShardHandle::end_reopen`] clears the
    /// mark.
    fn begin_reopen(&self) -> bool {
        let mut transfers = self.transfers.lock();
        if transfers.running || self.fetching.load(Ordering::Acquire) {
            return false;
        }
        transfers.reopening = true;
        true
    }

    fn end_reopen(&self) {
        self.transfers.lock().reopening = false;
    }

    /// Records how much of the snapshot being received is written.
    pub fn note_snapshot_progress(&self, bytes: u64) {
        self.snapshot_received.store(bytes, Ordering::Relaxed);
    }

    /// Ends a transfer that failed (a successful one ends when the owner
    /// has installed it).
    pub fn abort_snapshot(&self) {
        self.fetching.store(false, Ordering::Release);
    }

    /// Whether the replica is stopping: a snapshot transfer into it ends.
    pub fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Stops the owner and waits for it; the replica's engine is closed,
    /// and no snapshot transfer writes into its directory (one under way
    /// is told to end and waited for, up to 10 s; one that outlives the
    /// wait cannot make the directory again once it is deleted: the
    /// receiver makes nothing above the spare slot).
    pub fn stop(&self) {
        self.transfers.lock().stopped = true;
        self.stopping.send_replace(true);
        {
            let deadline = Instant::now() + TRANSFER_END_WAIT;
            let mut transfers = self.transfers.lock();
            while transfers.running {
                if (self.transfer_ended)
                    .wait_until(&mut transfers, deadline)
                    .timed_out()
                {
                    tracing::warn!(
                        shard_id = self.shard_id,
                        "a snapshot transfer did not end when the replica stopped"
                    );
                    break;
                }
            }
        }
        // A full queue still gets the stop.
        let _ = self.queue.push(Event::Stop, true);
        let Some(task) = self.task.lock().take() else {
            return;
        };
        self.queue.wait_closed();
        drop(task);
    }
}

/// Longest a stopping replica waits for a snapshot transfer to notice: one
/// chunk's write into the spare slot.
const TRANSFER_END_WAIT: Duration = Duration::from_secs(10);

/// Whether a snapshot transfer writes into the replica's directory, and
/// whether the replica stopped or is being reopened (no transfer starts
/// then).
#[derive(Debug, Default)]
struct Transfers {
    running: bool,
    stopped: bool,
    /// A failed replica is being reopened: its opening empties the spare
    /// slot, where a transfer writes.
    reopening: bool,
}

/// A snapshot transfer into a replica's spare slot
/// ([`ShardHandle::begin_snapshot`]); dropping it says the transfer wrote
/// its last byte.
#[derive(Debug)]
pub struct SnapshotTransfer {
    shard: Arc<ShardHandle>,
    stopping: tokio::sync::watch::Receiver<bool>,
}

impl SnapshotTransfer {
    /// Resolves once the replica is stopping: the transfer must end.
    pub async fn stopped(&mut self) {
        let _ = self.stopping.wait_for(|stopping| *stopping).await;
    }
}

impl Drop for SnapshotTransfer {
    fn drop(&mut self) {
        self.shard.transfers.lock().running = false;
        self.shard.transfer_ended.notify_all();
    }
}

/// Longest wait before reopening a failed replica.
const MAX_REOPEN_BACKOFF: Duration = Duration::from_secs(30);

/// How long a quiesced replica's owner sleeps if nothing wakes it (it
/// then finds nothing to do and sleeps again).
const QUIESCED_WAIT: Duration = Duration::from_secs(60);

/// A replica that ran this long after a reopen failed afresh: its backoff
/// starts again from the first wait.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// The wait before reopening a replica that just failed: the first wait
/// after a start or a healthy run, doubling (up to 30 s) while reopened
/// replicas keep failing soon after.
fn next_backoff(current: Duration, up_for: Option<Duration>, first: Duration) -> Duration {
    let failing_again = up_for.is_some_and(|up| up < HEALTHY_RUN);
    if current.is_zero() || !failing_again {
        first
    } else {
        (current * 2).min(MAX_REOPEN_BACKOFF)
    }
}

/// The owner task's state.
struct Owner {
    handle: Arc<ShardHandle>,
    opener: Opener,
    driver: DriverConfig,
    outgoing: Arc<dyn Outgoing>,
    replica: Option<Replica>,
    down_since: Option<Instant>,
    /// When the replica was last reopened after a failure.
    reopened_at: Option<Instant>,
    backoff: Duration,
    writes: Vec<(WriteOp, Completion)>,
    /// The spans of the queued writes that are traced.
    write_spans: Vec<tracing::Span>,
    write_bytes: usize,
    /// Whether an op of the batch asked for its entry synced everywhere.
    write_sync: EntrySync,
    reads: Vec<ReadCompletion>,
    /// Events taken from the queue and not handled yet.
    batch: VecDeque<Event>,
    /// When the next Raft tick is due.
    next_tick: Instant,
    /// Every event the owner logs carries the node and shard.
    span: tracing::Span,
}

impl Owner {
    /// One round of the owner's task, when events arrived or a tick is
    /// due: handles every event queued until the queue is seen empty (group
    /// commit), proposes the writes and reads gathered, ticks if due, runs
    /// the Ready checklist and publishes the state. Returns when the next
    /// tick is due (events wake it sooner).
    fn round(&mut self, queue: &EventQueue) -> Next {
        let span = self.span.clone();
        let _entered = span.enter();
        let mut batch = std::mem::take(&mut self.batch);
        let mut stop = false;
        'round: loop {
            queue.take(&mut batch);
            if batch.is_empty() {
                break;
            }
            while let Some(event) = batch.pop_front() {
                if matches!(event, Event::Stop) {
                    stop = true;
                    break 'round;
                }
                self.handle_event(event);
            }
        }
        batch.clear();
        self.batch = batch;
        self.flush_writes();
        self.flush_reads();
        if stop {
            self.close();
            return Next::Stop;
        }
        let now = Instant::now();
        if now >= self.next_tick {
            self.tick();
            self.next_tick = (self.next_tick + self.driver.tick).max(now);
        }
        self.ready();
        self.publish();
        if self.replica.as_ref().is_some_and(|r| !r.wants_ticks()) {
            // Quiesced: only an event wakes it; the tick then due runs at
            // once (at most one: `next_tick` moves past now).
            return Next::After(QUIESCED_WAIT);
        }
        Next::After(self.next_tick.saturating_duration_since(Instant::now()))
    }

    fn handle_event(&mut self, event: Event) {
        match event {
            Event::Write(op, sync, done, span) => {
                let bytes = op.value.as_ref().map_or(0, Vec::len);
                if self.write_bytes + bytes > self.driver.max_batch_bytes {
                    self.flush_writes();
                }
                self.write_bytes += bytes;
                if sync == EntrySync::Always {
                    self.write_sync = EntrySync::Always;
                }
                self.writes.push((*op, done));
                if !span.is_none() {
                    self.write_spans.push(span);
                }
                if self.writes.len() >= self.driver.max_batch_ops {
                    self.flush_writes();
                }
            }
            Event::Read(done) => self.reads.push(done),
            other => {
                // Keep the order of writes relative to other proposals.
                self.flush_writes();
                self.handle_other(other);
            }
        }
    }

    fn handle_other(&mut self, event: Event) {
        let failure = self.failure();
        let Some(replica) = self.replica.as_mut() else {
            match event {
                Event::Propose(_, _, done) | Event::ConfChange(_, done) => {
                    done(Outcome::Failed(failure))
                }
                Event::SnapshotReceived(_) => self.handle.abort_snapshot(),
                Event::TransferLeader(_, reply) => reply(Err(failure)),
                _ => {}
            }
            return;
        };
        let mut messages = Vec::new();
        let result = match event {
            Event::Step(message) => replica.step(*message),
            Event::SnapshotReceived(message) => {
                // Installed right away, so the spare slot is free again
                // before the next transfer may start.
                let result = replica
                    .step(*message)
                    .and_then(|()| replica.handle_ready())
                    .map(|out| messages = out);
                // Not installed (raft-rs ignores a snapshot of an older
                // term, as after a change of leader during the transfer):
                // its files would fill the spare slot until the next one.
                if result.is_ok()
                    && let Ok(Some(_)) = replica.store().spare_snapshot()
                    && let Err(error) = replica.store().clear_spare()
                {
                    tracing::warn!(%error, "cannot empty the spare slot");
                }
                self.handle.engine.store(replica.engine().clone());
                self.handle.abort_snapshot();
                if result.is_ok() {
                    self.handle.stats.snapshots_installed.inc();
                }
                result
            }
            Event::Propose(command, sync, done) => {
                let done = self.handle.stats.counted(done);
                replica.propose_traced(&command, sync, Vec::new(), done)
            }
            Event::ConfChange(change, done) => replica.propose_conf_change(change, done),
            Event::TransferLeader(to, reply) => {
                reply(replica.transfer_leader(to));
                Ok(())
            }
            Event::LeaderLost(leader) => {
                replica.leader_lost(leader);
                Ok(())
            }
            Event::Write(..) | Event::Read(_) | Event::Stop => Ok(()),
        };
        self.send_all(messages);
        self.check(result);
    }

    fn send_all(&self, messages: Vec<Message>) {
        for message in messages {
            self.outgoing.send(self.handle.shard_id, message);
        }
    }

    fn failure(&self) -> String {
        match &self.handle.state.lock().failed {
            Some(reason) => format!("shard {} is down: {reason}", self.handle.shard_id),
            None => format!("shard {} is down", self.handle.shard_id),
        }
    }

    /// Proposes the queued writes as one entry.
    fn flush_writes(&mut self) {
        if self.writes.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.writes);
        self.write_bytes = 0;
        let sync = std::mem::take(&mut self.write_sync);
        let (ops, completions): (Vec<WriteOp>, Vec<Completion>) = batch.into_iter().unzip();
        let place = crate::tracing_context::Place {
            node_id: self.opener.config.node_id,
            shard_id: self.handle.shard_id,
            term: self.replica.as_ref().map_or(0, |r| r.term()),
        };
        let (span, traceparent) = crate::tracing_context::propose_span(
            &std::mem::take(&mut self.write_spans),
            place,
            ops.len(),
        );
        // Each op's caller learns its own op's result; the entry's span
        // ends once it applied.
        let done: Completion = Box::new(move |outcome: Outcome| {
            for (ordinal, done) in completions.into_iter().enumerate() {
                done(outcome.for_op(ordinal));
            }
            drop(span);
        });
        let done = self.handle.stats.counted(done);
        match self.replica.as_mut() {
            Some(replica) => {
                let result = replica.propose_traced(&Command::Write(ops), sync, traceparent, done);
                self.check(result);
            }
            None => done(Outcome::Failed(self.failure())),
        }
    }

    fn flush_reads(&mut self) {
        if self.reads.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.reads);
        match self.replica.as_mut() {
            Some(replica) => replica.read_index(batch),
            None => {
                let outcome = ReadOutcome::Failed(self.failure());
                batch.into_iter().for_each(|done| done(outcome.clone()));
            }
        }
    }

    fn tick(&mut self) {
        match self.replica.as_mut() {
            Some(replica) => {
                let result = replica.tick();
                self.check(result);
            }
            None => self.maybe_reopen(),
        }
    }

    fn ready(&mut self) {
        let Some(replica) = self.replica.as_mut() else {
            return;
        };
        let (outgoing, shard_id) = (&self.outgoing, self.handle.shard_id);
        let mut send_early = |messages: Vec<Message>| {
            for message in messages {
                outgoing.send(shard_id, message);
            }
        };
        match replica.handle_ready_sending(&mut send_early) {
            Ok(messages) => self.send_all(messages),
            Err(error) => self.check(Err(error)),
        }
    }

    /// A failed call takes the replica down (its proposals and reads are
    /// failed by the replica itself).
    fn check(&mut self, result: Result<()>) {
        let Err(error) = result else {
            return;
        };
        let failed = matches!(error, NodeError::Failed(_) | NodeError::Engine(_))
            || self.replica.as_ref().is_some_and(Replica::is_failed);
        if !failed {
            return;
        }
        if let Some(replica) = self.replica.take() {
            let engine = replica.engine().clone();
            drop(replica); // fails what is still pending
            // Stopped before anything reopens the directory: a live engine
            // (a full disk does not poison it) would go on allocating and
            // discarding segment files under the new one's feet.
            engine.shutdown();
        }
        self.down_since = Some(Instant::now());
        let up_for = self.reopened_at.map(|at| at.elapsed());
        self.backoff = next_backoff(self.backoff, up_for, self.driver.reopen_backoff);
        tracing::error!(%error, backoff = ?self.backoff, "replica failed; reopening it from disk");
        self.handle.state.lock().failed = Some(error.to_string());
    }

    fn maybe_reopen(&mut self) {
        let Some(since) = self.down_since else {
            return;
        };
        if since.elapsed() < self.backoff {
            return;
        }
        // A transfer under way ends within a chunk or a few seconds (it
        // completes, or its stream fails): try again at a later tick.
        if !self.handle.begin_reopen() {
            return;
        }
        let opened = self.opener.reopen();
        self.handle.end_reopen();
        match opened {
            Ok(replica) => {
                tracing::info!("replica reopened");
                self.handle.engine.store(replica.engine().clone());
                self.replica = Some(replica);
                self.down_since = None;
                self.reopened_at = Some(Instant::now());
                let mut state = self.handle.state.lock();
                state.failed = None;
                state.files_missing = false;
            }
            Err(error) => {
                self.down_since = Some(Instant::now());
                self.backoff = (self.backoff * 2).min(MAX_REOPEN_BACKOFF);
                tracing::warn!(%error, backoff = ?self.backoff, "replica could not be reopened");
                let mut state = self.handle.state.lock();
                state.files_missing = matches!(error, NodeError::FilesMissing(_));
                state.failed = Some(error.to_string());
            }
        }
    }

    fn publish(&self) {
        let mut state = self.handle.state.lock();
        match &self.replica {
            Some(replica) => {
                let engine = replica.engine();
                let status = replica.status();
                let before = state.status.as_ref().map(|s| (s.term, s.leader));
                let leader_before = state.status.as_ref().map(|s| s.leader);
                if status.leader != 0 && leader_before != Some(status.leader) {
                    self.handle.stats.leader_changes.inc();
                }
                if before != Some((status.term, status.leader)) {
                    tracing::info!(
                        term = status.term,
                        leader = status.leader,
                        is_leader = status.is_leader,
                        "leadership changed"
                    );
                }
                let following = if status.is_leader { 0 } else { status.leader };
                self.handle.following.store(following, Ordering::Release);
                let children_before = state.status.as_ref().map(|s| s.children.len());
                let split_off =
                    !status.children.is_empty() && children_before != Some(status.children.len());
                state.status = Some(status);
                if split_off {
                    self.outgoing.split_off(self.handle.shard_id);
                }
                state.epoch = engine.epoch().0;
                state.disk_bytes = engine.disk_bytes();
                state.data_bytes = engine.data_bytes();
                state.load = self
                    .handle
                    .load
                    .observe(Instant::now(), self.handle.range());
                if !Arc::ptr_eq(engine, &self.handle.engine.load()) {
                    self.handle.engine.store(engine.clone());
                }
            }
            None => {
                state.status = None;
                self.handle.following.store(0, Ordering::Release);
            }
        }
    }

    fn close(&mut self) {
        self.flush_writes();
        self.flush_reads();
        if let Some(replica) = self.replica.take() {
            let engine = replica.engine().clone();
            drop(replica); // fails what is still pending
            let _ = engine.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reopen_backoff_doubles_while_failing_and_resets_after_a_healthy_run() {
        let first = Duration::from_millis(500);
        let soon = Some(Duration::from_secs(1));
        assert_eq!(next_backoff(Duration::ZERO, None, first), first);
        assert_eq!(next_backoff(first, soon, first), first * 2);
        assert_eq!(
            next_backoff(Duration::from_secs(20), soon, first),
            MAX_REOPEN_BACKOFF
        );
        assert_eq!(
            next_backoff(MAX_REOPEN_BACKOFF, Some(HEALTHY_RUN), first),
            first
        );
    }

    /// A queue full of client events still takes peers' Raft messages
    /// (before, a `BatchExists` touching 100,000 keys filled it and the
    /// appends and heartbeats that would commit them were dropped), up to
    /// its own bound; `Stop` always.
    #[test]
    fn a_queue_full_of_client_events_still_takes_peer_messages() {
        let queue = EventQueue::new(4);
        for n in 0..4 {
            assert!(queue.push(Event::LeaderLost(n), false).is_ok());
        }
        assert!(
            queue.push(Event::LeaderLost(9), false).is_err(),
            "clients refused at the limit"
        );
        for _ in 0..4 {
            assert!(queue.push_peer(Event::Step(Box::default())).is_ok());
        }
        assert!(
            queue.push_peer(Event::Step(Box::default())).is_err(),
            "peers bounded too"
        );
        assert!(queue.push(Event::Stop, true).is_ok());
    }
}
