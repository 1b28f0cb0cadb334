//! Leadership transfers that never cost availability.
//!
//! A transfer is accepted only towards a voter this leader itself sees as
//! reachable and caught up: it answered one of the leader's appends or
//! heartbeats within the last [`HEARD_WITHIN_HEARTBEATS`] heartbeat
//! intervals, and its matched index is at most [`MAX_LAG_ENTRIES`] behind
//! the leader's last index. Whoever asks (the coordinator's balancer) may
//! see a node as alive that its peers cannot reach; the leader's own view
//! is the one that counts.
//!
//! While raft-rs transfers leadership it drops proposals. Instead of
//! refusing them (a client would read "not the leader" from the leader),
//! the replica holds them — at most [`MAX_HELD_BYTES`] — until the transfer
//! resolves: within an election timeout raft-rs either hands leadership
//! over (the held proposals are answered `NotLeader` naming the new leader;
//! nothing was proposed) or aborts it (they are proposed, in order).

use std::collections::BTreeMap;

use raft::StateRole;
use raft::eraftpb::{Message, MessageType};

use super::{Completion, Outcome, Replica};
use crate::error::Result;

/// A transfer target must have answered within this many heartbeat
/// intervals.
pub const HEARD_WITHIN_HEARTBEATS: u64 = 2;
/// ... and be at most this many entries behind the leader's log.
pub const MAX_LAG_ENTRIES: u64 = 64;
/// Most bytes of proposals held while a transfer is pending; beyond,
/// proposals are refused as overload.
pub const MAX_HELD_BYTES: usize = 64 << 20;

/// Proposals waiting for a transfer to resolve, and when each peer last
/// answered this leader.
#[derive(Default)]
pub(crate) struct TransferState {
    /// Each with its entry context (its sync marker, its trace context),
    /// proposed with it when released.
    held: Vec<(Vec<u8>, Vec<u8>, Completion)>,
    held_bytes: usize,
    /// Tick when the first held proposal arrived.
    held_since: u64,
    /// Peer → tick of its last append or heartbeat response.
    heard: BTreeMap<u64, u64>,
    /// Ticks since the replica opened.
    now: u64,
    /// The tick at which a replica just opened campaigns if it has heard
    /// of no leader (`ReplicaConfig::early_campaign`).
    pub campaign_at: Option<u64>,
}

impl Replica {
    /// Asks raft-rs to hand leadership to `to`; refused (with the reason)
    /// unless this replica leads and `to` is a voter it sees as reachable
    /// and caught up.
    pub fn transfer_leader(&mut self, to: u64) -> std::result::Result<(), String> {
        self.wake();
        let raft = &self.raw.raft;
        if raft.state != StateRole::Leader {
            return Err(format!(
                "node {} does not lead this shard",
                self.config.node_id
            ));
        }
        if to == self.config.node_id {
            return Ok(());
        }
        if !self.raw.store().conf_state().voters.contains(&to) {
            return Err(format!("node {to} is not a voter"));
        }
        let heard = self.transfer.heard.get(&to).copied();
        let within = HEARD_WITHIN_HEARTBEATS * self.config.heartbeat_ticks as u64;
        if heard.is_none_or(|at| self.transfer.now.saturating_sub(at) > within) {
            return Err(format!(
                "node {to} has not answered this leader within {within} ticks"
            ));
        }
        let last = raft.raft_log.last_index();
        let matched = raft.prs().get(to).map_or(0, |p| p.matched);
        if matched + MAX_LAG_ENTRIES < last {
            return Err(format!(
                "node {to} lags: it holds up to entry {matched} of {last}"
            ));
        }
        self.raw.transfer_leader(to);
        Ok(())
    }

    /// Whether a leadership transfer is pending.
    pub fn transferring(&self) -> bool {
        self.raw.raft.lead_transferee.is_some()
    }

    /// Notes a message from a peer before it is stepped.
    pub(crate) fn note_heard(&mut self, message: &Message) {
        if matches!(
            message.msg_type(),
            MessageType::MsgAppendResponse | MessageType::MsgHeartbeatResponse
        ) && message.term == self.raw.raft.term
        {
            self.transfer.heard.insert(message.from, self.transfer.now);
        }
    }

    /// One tick passed.
    pub(crate) fn transfer_tick(&mut self) {
        self.transfer.now += 1;
    }

    /// A replica just opened that has heard of no leader by its chosen tick
    /// campaigns (pre-vote first) rather than waiting out an election
    /// timeout.
    pub(crate) fn maybe_campaign_early(&mut self) -> Result<()> {
        if self
            .transfer
            .campaign_at
            .is_some_and(|at| self.transfer.now >= at)
        {
            self.transfer.campaign_at = None;
            let raft = &self.raw.raft;
            if raft.leader_id == 0 && raft.state != StateRole::Leader {
                self.raw.campaign()?;
            }
        }
        Ok(())
    }

    /// Holds an encoded proposal while a transfer is pending; gives it back
    /// otherwise.
    pub(crate) fn hold_if_transferring(
        &mut self,
        data: Vec<u8>,
        context: Vec<u8>,
        done: Completion,
    ) -> Option<(Vec<u8>, Vec<u8>, Completion)> {
        if !self.transferring() {
            return Some((data, context, done));
        }
        if self.transfer.held_bytes + data.len() > MAX_HELD_BYTES {
            done(Outcome::Overloaded);
            return None;
        }
        if self.transfer.held.is_empty() {
            self.transfer.held_since = self.transfer.now;
        }
        self.transfer.held_bytes += data.len();
        self.transfer.held.push((data, context, done));
        None
    }

    /// Once no transfer is pending: proposes what was held (still leading)
    /// or answers it `NotLeader` (leadership moved; nothing was proposed)
    /// — naming the new leader, so this waits until it is known, for at
    /// most an election timeout.
    pub(crate) fn release_held(&mut self) -> Result<()> {
        if self.transfer.held.is_empty() || self.transferring() {
            return Ok(());
        }
        let raft = &self.raw.raft;
        let waited = self.transfer.now - self.transfer.held_since;
        if raft.state != StateRole::Leader
            && raft.leader_id == 0
            && waited < self.config.election_ticks as u64
        {
            return Ok(());
        }
        let held = std::mem::take(&mut self.transfer.held);
        self.transfer.held_bytes = 0;
        for (data, context, done) in held {
            if self.raw.raft.state == StateRole::Leader {
                // With its context: proposed without it, a write asked to
                // be synced (on a buffered group) was acknowledged unsynced.
                self.propose_encoded(data, context, done)?;
            } else {
                done(Outcome::NotLeader {
                    leader: self.raw.raft.leader_id,
                });
            }
        }
        Ok(())
    }

    /// Fails every held proposal (the replica closes or fails).
    /// Nothing held, no transfer under way, no early campaign to come.
    pub(crate) fn transfer_idle(&self) -> bool {
        self.transfer.held.is_empty() && !self.transferring() && self.transfer.campaign_at.is_none()
    }

    pub(crate) fn fail_held(&mut self, reason: &str) {
        self.transfer.held_bytes = 0;
        for (_, _, done) in std::mem::take(&mut self.transfer.held) {
            done(Outcome::Failed(reason.to_string()));
        }
    }
}
