//! Linearizable reads by ReadIndex: the leader notes its commit index,
//! confirms with a heartbeat round that it still leads, and the read is
//! served once the replica has applied up to that index. One ReadIndex
//! request carries a whole batch of reads (the owner collects them), so a
//! burst of reads costs one heartbeat round.
//!
//! raft-rs drops a ReadIndex request silently while a new leader has not
//! yet committed an entry of its term; such requests, and those a leader
//! loses with its leadership, expire after `election_ticks` and answer
//! `NotLeader` (the caller retries).
//!
//! Leader lease (`ReplicaConfig::lease`). A confirmed ReadIndex request
//! asked at time `t` proves that a majority heard from this leader after
//! `t`. With check-quorum on, a voter that heard from a leader refuses
//! every vote (and does not campaign) until `election_ticks` of its own
//! ticks have passed, and ticks never come faster than one per tick plus
//! one catch-up tick: no other leader can exist before
//! `t + (election_ticks - 2) x tick`. The lease runs until `t + lease`, `lease` being that bound
//! less a margin for clock-rate drift; while it runs, a read is served at
//! the leader's commit index with no heartbeat round. The lease is given
//! up when the term changes and when this replica stops leading; a leader
//! that began a leadership transfer takes no lease for the rest of its term
//! (the transferee campaigns ignoring the voters' promises, whenever the
//! leader's `TimeoutNow` reaches it, even after the transfer was given up).
//! It is renewed by a ReadIndex round (carrying no read) once half of it
//! has run, and by every round the reads need anyway.
//!
//! A voter that restarts forgets whom it heard from; while leases are on,
//! a replica of a group with other voters therefore neither grants votes
//! nor campaigns during its first `election_ticks` ticks after opening
//! (longer than any lease its previous life helped confirm), except in a
//! leadership transfer. A replica whose saved term is still the founding
//! one, in synced mode, is spared: no leader ever had that term (the
//! first election makes the next), and a follower persists a new term,
//! synced, before it answers the leader of that term, so this replica
//! never answered a leader and no lease rests on it. A new group
//! therefore elects within a few ticks of opening.
//!
//! Reads without the owner (`ReplicaConfig::lease_gate`). A read served on
//! the lease needs nothing from the owner but three facts, so the leader
//! shows them in one atomic word, the [`LeaseGate`], and the node's request
//! threads serve a linearizable read on their own while it is open: no
//! hand-off to the owner's thread and back. The gate shows a time, the
//! first half of the lease (the second half goes through the owner, whose
//! lease reads renew it), and only while (a) this replica leads with a
//! lease of its current term, has committed an entry of that term and is
//! not transferring its leadership, and (b) it has applied every entry it
//! knows committed. It is shown at the start of every Ready, before any
//! message of it leaves, after the Ready's committed entries are applied
//! and at its end; cleared when the replica fails or closes.
//!
//! Why such a read sees every write acknowledged before it began: a write
//! is acknowledged by the leader that proposed it, once applied there. One
//! of this leader's term is applied to the engine the read reads (the
//! engine only moves forward). One of an earlier term is committed, so
//! below this leader's first entry of its term, which it has committed;
//! applied by (b). One of a later term cannot exist while the lease runs
//! (a leadership transfer closes the gate before its `TimeoutNow` leaves).
//! A write of another group that this group's entries gate (a split's child
//! exists only once the split is applied on some node, which learnt it
//! committed from this leader): this leader sent no commit index beyond
//! what the gate was last shown with, and (b) held then, so the split is
//! applied here and the range check after the read refuses the key. The
//! owner's path (ReadIndex at the commit index, served once applied) gives
//! the same guarantee; the gate only skips the queue.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use raft::ReadState;
use raft::StateRole;

use super::Replica;

/// How a read request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The replica's applied state now includes every write acknowledged
    /// before the read was asked: read the engine.
    Ready,
    /// This replica does not lead (or lost leadership before confirming);
    /// `leader` does (0: unknown).
    NotLeader {
        /// The leader, if known.
        leader: u64,
    },
    /// The replica failed.
    Failed(String),
}

/// Called once with a read's outcome.
pub type ReadCompletion = Box<dyn FnOnce(ReadOutcome) + Send>;

/// Where a replica reads the time its leader lease runs on.
#[derive(Clone, Debug, Default)]
pub enum LeaseClock {
    /// The monotonic clock.
    #[default]
    Monotonic,
    /// Nanoseconds a test advances (the simulator: its ticks).
    Manual(Arc<AtomicU64>),
}

impl LeaseClock {
    /// Time since an arbitrary fixed origin.
    pub fn now(&self) -> Duration {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        match self {
            LeaseClock::Monotonic => ORIGIN.get_or_init(Instant::now).elapsed(),
            LeaseClock::Manual(nanos) => Duration::from_nanos(nanos.load(Ordering::Acquire)),
        }
    }
}

/// Until when the node's request threads may serve a linearizable read
/// without asking the replica's owner (see the module docs): a time of the
/// lease clock, shown by the leader. Clones share the gate.
#[derive(Clone, Debug, Default)]
pub struct LeaseGate {
    shown: Arc<Shown>,
    clock: LeaseClock,
}

#[derive(Debug, Default)]
struct Shown {
    /// Lease-clock nanoseconds; 0: closed.
    until: AtomicU64,
    /// The engine's applied index when last opened.
    applied: AtomicU64,
}

impl LeaseGate {
    /// A closed gate on `clock` (the replica's lease clock).
    pub fn new(clock: LeaseClock) -> Self {
        Self {
            shown: Arc::default(),
            clock,
        }
    }

    /// Whether a read arriving now may be served without the owner.
    pub fn is_open(&self) -> bool {
        let until = self.shown.until.load(Ordering::Acquire);
        until != 0 && self.clock.now() < Duration::from_nanos(until)
    }

    /// The applied index the replica had when it last opened the gate (no
    /// commit index beyond it leaves the replica while the gate is open:
    /// what the simulator checks).
    pub fn opened_at_applied(&self) -> u64 {
        self.shown.applied.load(Ordering::Acquire)
    }

    /// Opens the gate until `until` (at applied index `applied`), or closes
    /// it.
    pub(crate) fn show(&self, open: Option<(Duration, u64)>) {
        match open {
            Some((until, applied)) => {
                self.shown.applied.store(applied, Ordering::Release);
                let nanos = u64::try_from(until.as_nanos()).unwrap_or(u64::MAX).max(1);
                self.shown.until.store(nanos, Ordering::Release);
            }
            None => self.shown.until.store(0, Ordering::Release),
        }
    }
}

/// The longest safe lease for these Raft timings (see the module docs),
/// `None` when they leave none: `(election_ticks - 2) x tick`, less a
/// tenth for clock-rate drift.
pub fn safe_lease(tick: Duration, election_ticks: usize) -> Option<Duration> {
    let ticks = u32::try_from(election_ticks.checked_sub(2)?).ok()?;
    (ticks > 0).then(|| tick * ticks * 9 / 10)
}

/// Reads waiting for confirmation or for the apply index to catch up.
#[derive(Default)]
pub(crate) struct Reads {
    next_context: u64,
    /// Asked, not yet confirmed: by context, with the tick and the lease
    /// clock's time they were asked.
    asked: BTreeMap<u64, (u64, Duration, Vec<ReadCompletion>)>,
    /// Confirmed at a read index, waiting for it to be applied.
    confirmed: Vec<(u64, Vec<ReadCompletion>)>,
    /// Ticks so far.
    now: u64,
    /// The leader lease: the term it belongs to and when it ends.
    lease: Option<(u64, Duration)>,
    /// The context of a ReadIndex round asked only to renew the lease.
    renewing: Option<u64>,
    /// A term in which this replica, leading, began a leadership transfer:
    /// no lease in it.
    transferred_in: Option<u64>,
    /// Reads served by the lease (no heartbeat round).
    pub(crate) lease_reads: u64,
    /// Opened with no term beyond the founding one, in synced mode: this
    /// replica never answered a leader (see the module docs), so it need
    /// not sit out the ticks after opening.
    pub(crate) never_answered: bool,
}

impl Reads {
    pub fn fail_all(&mut self, outcome: &ReadOutcome) {
        let asked = std::mem::take(&mut self.asked)
            .into_values()
            .map(|(_, _, b)| b);
        let confirmed = std::mem::take(&mut self.confirmed)
            .into_iter()
            .map(|(_, b)| b);
        for done in asked.chain(confirmed).flatten() {
            done(outcome.clone());
        }
    }
}

impl Replica {
    /// Asks for one linearizable read point for a batch of reads; each
    /// completion is called once the replica may serve its read (or with
    /// the reason it may not).
    pub fn read_index(&mut self, batch: Vec<ReadCompletion>) {
        if batch.is_empty() {
            return;
        }
        self.wake();
        // An engine poisoned since the last tick fails the replica now:
        // a lease read would be sent to it, and fail there.
        if self.failed.is_none()
            && let Err(error) = self.engine().health()
        {
            self.fail(error.to_string());
        }
        if let Some(reason) = &self.failed {
            let outcome = ReadOutcome::Failed(reason.clone());
            batch.into_iter().for_each(|done| done(outcome.clone()));
            return;
        }
        if self.raw.raft.state != StateRole::Leader {
            let outcome = ReadOutcome::NotLeader {
                leader: self.raw.raft.leader_id,
            };
            batch.into_iter().for_each(|done| done(outcome.clone()));
            return;
        }
        if let Some(index) = self.lease_read_index() {
            self.reads.lease_reads += batch.len() as u64;
            self.reads.confirmed.push((index, batch));
            self.serve_reads();
            self.renew_lease_if_due();
            return;
        }
        self.ask_read_index(batch);
    }

    /// Steps a ReadIndex request for `batch` (empty: a lease renewal).
    fn ask_read_index(&mut self, batch: Vec<ReadCompletion>) -> u64 {
        let at = self.config.lease_clock.now();
        let reads = &mut self.reads;
        reads.next_context += 1;
        let context = reads.next_context;
        reads.asked.insert(context, (reads.now, at, batch));
        self.raw.read_index(context.to_le_bytes().to_vec());
        context
    }

    /// The index a read may be served at without a heartbeat round: the
    /// commit index, while this leader's lease runs and it is not handing
    /// its leadership over.
    fn lease_read_index(&mut self) -> Option<u64> {
        self.config.lease?;
        self.note_transfer();
        let raft = &self.raw.raft;
        let (term, until) = self.reads.lease?;
        let valid = raft.state == StateRole::Leader
            && raft.term == term
            && raft.commit_to_current_term()
            && self.config.lease_clock.now() < until;
        if !valid {
            self.reads.lease = None;
            return None;
        }
        Some(raft.raft_log.committed)
    }

    /// Shows the lease gate (see the module docs).
    pub(crate) fn show_lease(&mut self) {
        if self.config.lease_gate.is_none() {
            return;
        }
        let until = self.unasked_reads_until();
        if let Some(gate) = &self.config.lease_gate {
            gate.show(until);
        }
    }

    /// Until when reads may skip the owner: the first half of a lease that
    /// serves reads now, while every known-committed entry is applied.
    fn unasked_reads_until(&mut self) -> Option<(Duration, u64)> {
        let length = self.config.lease?;
        if self.failed.is_some() {
            return None;
        }
        self.note_transfer();
        let raft = &self.raw.raft;
        let (term, until) = self.reads.lease?;
        // Applied to the engine (raft-rs's own count moves at `advance`).
        let applied = self.raw.store().applied();
        let serves = raft.state == StateRole::Leader
            && raft.term == term
            && self.reads.transferred_in != Some(raft.term)
            && raft.commit_to_current_term()
            && applied >= raft.raft_log.committed;
        serves.then(|| (until.saturating_sub(length / 2), applied))
    }

    /// Asks for a renewal once half the lease has run (one at a time).
    fn renew_lease_if_due(&mut self) {
        let (Some(length), Some((_, until))) = (self.config.lease, self.reads.lease) else {
            return;
        };
        let renewing = self
            .reads
            .renewing
            .is_some_and(|context| self.reads.asked.contains_key(&context));
        if !renewing && until.saturating_sub(self.config.lease_clock.now()) < length / 2 {
            self.reads.renewing = Some(self.ask_read_index(Vec::new()));
        }
    }

    /// Moves confirmed read points out of a Ready.
    pub(crate) fn confirm_reads(&mut self, states: Vec<ReadState>) {
        for state in states {
            let Ok(bytes) = <[u8; 8]>::try_from(&state.request_ctx[..]) else {
                continue;
            };
            if let Some((_, at, batch)) = self.reads.asked.remove(&u64::from_le_bytes(bytes)) {
                self.extend_lease(at);
                if !batch.is_empty() {
                    self.reads.confirmed.push((state.index, batch));
                }
            }
        }
        self.serve_reads();
    }

    /// Whether this replica, just opened, must not help elect a leader
    /// yet (see the module docs).
    pub(crate) fn quiet_after_open(&self) -> bool {
        self.config.lease.is_some()
            && !self.reads.never_answered
            && self.reads.now < self.config.election_ticks as u64
            && !self.raw.raft.prs().conf().voters().is_singleton()
    }

    /// No read waits for confirmation or for the apply index.
    pub(crate) fn reads_idle(&self) -> bool {
        self.reads.asked.is_empty() && self.reads.confirmed.is_empty()
    }

    /// Reads this replica served on its lease, without a heartbeat round.
    pub fn lease_reads(&self) -> u64 {
        self.reads.lease_reads
    }

    /// Completes every confirmed read whose index is applied.
    pub(crate) fn serve_reads(&mut self) {
        let applied = self.raw.raft.raft_log.applied;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reads.confirmed)
            .into_iter()
            .partition(|(index, _)| *index <= applied);
        self.reads.confirmed = waiting;
        for done in ready.into_iter().flat_map(|(_, batch)| batch) {
            done(ReadOutcome::Ready);
        }
    }

    /// Gives the lease up for good in this term if a leadership transfer
    /// is under way (see the module docs).
    fn note_transfer(&mut self) {
        let raft = &self.raw.raft;
        if raft.state == StateRole::Leader && raft.lead_transferee.is_some() {
            self.reads.transferred_in = Some(raft.term);
        }
        if self.reads.transferred_in == Some(raft.term) {
            self.reads.lease = None;
        }
    }

    /// A ReadIndex round asked at `at` was confirmed by a majority.
    fn extend_lease(&mut self, at: Duration) {
        let Some(length) = self.config.lease else {
            return;
        };
        self.note_transfer();
        let raft = &self.raw.raft;
        if raft.state != StateRole::Leader || self.reads.transferred_in == Some(raft.term) {
            return;
        }
        let until = at + length;
        self.reads.lease = match self.reads.lease {
            Some((term, current)) if term == raft.term => Some((term, current.max(until))),
            _ => Some((raft.term, until)),
        };
    }

    /// Per tick: expires unconfirmed reads that waited an election timeout,
    /// and all of them when this replica no longer leads.
    pub(crate) fn expire_reads(&mut self) {
        self.reads.now += 1;
        let leader = self.raw.raft.leader_id;
        let outcome = ReadOutcome::NotLeader { leader };
        let leads = self.raw.raft.state == StateRole::Leader;
        self.note_transfer();
        if !leads {
            self.reads.lease = None;
        }
        let oldest = self
            .reads
            .now
            .saturating_sub(self.config.election_ticks as u64);
        let expired: Vec<u64> = self
            .reads
            .asked
            .iter()
            .filter(|(_, (asked_at, _, _))| !leads || *asked_at < oldest)
            .map(|(context, _)| *context)
            .collect();
        for context in expired {
            if let Some((_, _, batch)) = self.reads.asked.remove(&context) {
                batch.into_iter().for_each(|done| done(outcome.clone()));
            }
        }
    }
}
