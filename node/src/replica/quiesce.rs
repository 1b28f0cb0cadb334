//! Quiescence: a group with nothing to do stops ticking and heartbeating
//! (`docs/design/quiescence.md`).
//!
//! A leader that has seen `quiesce_ticks` ticks in a row with nothing in
//! flight (no proposal, read, transfer, snapshot or sweep; every peer's
//! log matching its own, all of it committed and applied) sends one last
//! heartbeat carrying [`QUIESCE_CONTEXT`] and stops ticking. A follower
//! that steps that heartbeat with its log complete stops ticking too. Any
//! other message, proposal, read or membership change wakes the replica;
//! heartbeat answers do not (they are what the quiesce heartbeat brings
//! back).
//!
//! A quiesced follower no longer counts ticks toward an election, so the
//! node watches its peers instead: a node silent for an election timeout
//! (no Raft batch, and the transport sends an empty one every tick) has
//! the followers of the groups it leads told by [`Replica::leader_lost`],
//! which wakes them and counts the election timeout as passed: the
//! follower grants votes and campaigns within `election_spread_ticks`, as
//! it would had it been ticking. (Every follower of it, quiesced or not:
//! one woken by a candidate's message restarts its count from where
//! quiescence froze it, and would refuse the candidate for a whole
//! timeout.) That keeps the leader lease safe (`read.rs`): the lease ends
//! `(election_ticks - 2) x tick x 0.9` after a round the follower heard,
//! and the follower heard the leader's node after that round, so it waits
//! at least `election_ticks x tick` from it.

use raft::eraftpb::{Message, MessageType};
use raft::{ProgressState, StateRole};

use super::Replica;

/// The context of a leader's last heartbeat before it quiesces. Read
/// contexts are 8 bytes (`read.rs`), so it cannot be mistaken for one; a
/// follower answers with the same context, which raft-rs ignores as an
/// unknown read.
pub const QUIESCE_CONTEXT: &[u8] = b"tidepool/quiesce";

/// A replica's quiescence.
#[derive(Debug, Default)]
pub(crate) struct Quiescence {
    /// Not ticking: woken by messages, proposals and reads.
    pub quiesced: bool,
    /// Ticks in a row this leader found nothing in flight.
    idle_ticks: u32,
    /// Something happened since the last tick.
    active: bool,
    /// Times this replica quiesced.
    pub count: u64,
}

impl Replica {
    /// Whether the replica is quiesced (ticks do nothing; anything that
    /// needs it wakes it).
    pub fn is_quiesced(&self) -> bool {
        self.quiescence.quiesced
    }

    /// Times this replica quiesced.
    pub fn quiesce_count(&self) -> u64 {
        self.quiescence.count
    }

    /// Whether its owner needs to tick it: not while it is quiesced.
    pub fn wants_ticks(&self) -> bool {
        !self.quiescence.quiesced
    }

    /// Something needs the group awake.
    pub(crate) fn wake(&mut self) {
        self.quiescence.active = true;
        self.quiescence.quiesced = false;
    }

    /// Before stepping `message`: wakes the replica unless the message is a
    /// heartbeat answer or the leader's quiesce heartbeat (which
    /// [`Replica::after_quiesce_heartbeat`] looks at).
    pub(crate) fn before_step(&mut self, message: &Message) {
        match message.msg_type() {
            MessageType::MsgHeartbeatResponse => {}
            MessageType::MsgHeartbeat if message.context == QUIESCE_CONTEXT => {}
            _ => self.wake(),
        }
    }

    /// After stepping the quiesce heartbeat of `from` in `term`: a
    /// follower of it whose log is complete quiesces; otherwise the
    /// replica stays awake.
    pub(crate) fn after_quiesce_heartbeat(&mut self, from: u64, term: u64) {
        let raft = &self.raw.raft;
        let follows =
            raft.state == StateRole::Follower && raft.leader_id == from && raft.term == term;
        let complete = raft.raft_log.committed == raft.raft_log.last_index();
        if self.config.quiesce_ticks > 0 && follows && complete && self.nothing_local_in_flight() {
            self.quiescence.quiesced = true;
            self.quiescence.idle_ticks = 0;
            self.quiescence.count += 1;
        } else {
            self.wake();
        }
    }

    /// The node of this follower's leader has been silent for an election
    /// timeout: wake, and count the election timeout as passed (see the
    /// module docs). For a follower that was quiesced, or woken by a
    /// message other than its leader's, its own count of ticks since it
    /// heard the leader says nothing; for one that kept ticking, this only
    /// comes a little sooner than its own timeout.
    pub fn leader_lost(&mut self, leader: u64) {
        let raft = &self.raw.raft;
        if raft.state != StateRole::Follower || raft.leader_id != leader || self.quiet_after_open()
        {
            return;
        }
        self.wake();
        // Every follower of the lost leader is told in the same tick: with
        // timeouts drawn at random they would often campaign in one tick,
        // each vote for itself, and wait a whole timeout more (a split
        // vote). Each takes its own tick instead, in a turn that rotates
        // with the shard; the first to campaign wins the other's vote.
        let mut followers = self.voters_sorted();
        followers.retain(|id| *id != leader);
        let ticks = self.config.election_ticks;
        let raft = &mut self.raw.raft;
        // Elapsed counts the timeout as passed, so votes are granted; a
        // follower campaigns at the tick where elapsed reaches its timeout
        // (ticks + 1 .. ticks + spread - 1 are distinct ticks after this).
        raft.election_elapsed = raft.election_elapsed.max(ticks);
        let slots = self.config.election_spread_ticks.saturating_sub(1);
        if let Some(rank) = followers.iter().position(|id| *id == self.config.node_id)
            && slots > 0
        {
            let count = followers.len();
            let turn = (rank + self.config.shard_id as usize) % count;
            let step = (slots / count).max(1);
            raft.set_randomized_election_timeout(ticks + 1 + (turn * step) % slots);
        }
    }

    /// At the end of a tick, on a leader: counts idle ticks, and quiesces
    /// after `quiesce_ticks` of them (one last heartbeat, marked).
    pub(crate) fn maybe_quiesce(&mut self) {
        let active = std::mem::take(&mut self.quiescence.active);
        if self.config.quiesce_ticks == 0 || active || !self.leader_idle() {
            self.quiescence.idle_ticks = 0;
            return;
        }
        self.quiescence.idle_ticks += 1;
        if self.quiescence.idle_ticks < self.config.quiesce_ticks {
            return;
        }
        let before = self.raw.raft.msgs.len();
        self.raw.ping();
        for message in &mut self.raw.raft.msgs[before..] {
            if message.msg_type() == MessageType::MsgHeartbeat {
                message.context = QUIESCE_CONTEXT.to_vec();
            }
        }
        self.quiescence.quiesced = true;
        self.quiescence.idle_ticks = 0;
        self.quiescence.count += 1;
    }

    /// A leader with nothing in flight: every peer's log matches its own,
    /// all of it committed and applied, in its own term.
    fn leader_idle(&self) -> bool {
        let raft = &self.raw.raft;
        let last = raft.raft_log.last_index();
        raft.state == StateRole::Leader
            && raft.lead_transferee.is_none()
            && raft.raft_log.committed == last
            && raft.raft_log.applied == last
            && raft.pending_conf_index <= last
            && raft.commit_to_current_term()
            && self.snapshot_watch.is_empty()
            && raft
                .prs()
                .iter()
                .all(|(_, p)| p.matched == last && p.state == ProgressState::Replicate)
            && self.nothing_local_in_flight()
    }

    /// Nothing of this replica's own waits for ticks: proposals, reads,
    /// held proposals, an early campaign, the quiet ticks after opening,
    /// a sweep of the name index.
    fn nothing_local_in_flight(&self) -> bool {
        self.proposals.is_empty()
            && self.reads_idle()
            && self.transfer_idle()
            && !self.quiet_after_open()
            && self.sweep_idle()
    }
}
