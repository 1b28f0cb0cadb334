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

use std::collections::BTreeMap;

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

/// Reads waiting for confirmation or for the apply index to catch up.
#[derive(Default)]
pub(crate) struct Reads {
    next_context: u64,
    /// Asked, not yet confirmed: by context, with the tick they were asked.
    asked: BTreeMap<u64, (u64, Vec<ReadCompletion>)>,
    /// Confirmed at a read index, waiting for it to be applied.
    confirmed: Vec<(u64, Vec<ReadCompletion>)>,
    /// Ticks so far.
    now: u64,
}

impl Reads {
    pub fn fail_all(&mut self, outcome: &ReadOutcome) {
        let asked = std::mem::take(&mut self.asked)
            .into_values()
            .map(|(_, b)| b);
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
        let reads = &mut self.reads;
        reads.next_context += 1;
        let context = reads.next_context;
        reads.asked.insert(context, (reads.now, batch));
        self.raw.read_index(context.to_le_bytes().to_vec());
    }

    /// Moves confirmed read points out of a Ready.
    pub(crate) fn confirm_reads(&mut self, states: Vec<ReadState>) {
        for state in states {
            let Ok(bytes) = <[u8; 8]>::try_from(&state.request_ctx[..]) else {
                continue;
            };
            if let Some((_, batch)) = self.reads.asked.remove(&u64::from_le_bytes(bytes)) {
                self.reads.confirmed.push((state.index, batch));
            }
        }
        self.serve_reads();
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

    /// Per tick: expires unconfirmed reads that waited an election timeout,
    /// and all of them when this replica no longer leads.
    pub(crate) fn expire_reads(&mut self) {
        self.reads.now += 1;
        let leader = self.raw.raft.leader_id;
        let outcome = ReadOutcome::NotLeader { leader };
        let leads = self.raw.raft.state == StateRole::Leader;
        let oldest = self
            .reads
            .now
            .saturating_sub(self.config.election_ticks as u64);
        let expired: Vec<u64> = self
            .reads
            .asked
            .iter()
            .filter(|(_, (asked_at, _))| !leads || *asked_at < oldest)
            .map(|(context, _)| *context)
            .collect();
        for context in expired {
            if let Some((_, batch)) = self.reads.asked.remove(&context) {
                batch.into_iter().for_each(|done| done(outcome.clone()));
            }
        }
    }
}
