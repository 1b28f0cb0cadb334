//! Votes held by a replica that founded its group, until it has caught up
//! with a leader (`docs/design/replication.md`, "Replicas founded empty").
//!
//! A founding replica cannot tell a new group from one whose earlier life
//! it has forgotten: a node whose disk was replaced, started again under
//! its fixed id, founds its shards again, empty, at the founding term, as
//! voters. Such a replica grants its vote to any candidate (an empty log
//! is behind every log), and what its lost copy helped commit — held now
//! by a single other replica, maybe down for a moment — would be lost by a
//! leader elected without it. So a replica that founds a group of several
//! voters **holds its votes** until it has caught up:
//!
//! - it grants (pre-)votes only to candidates whose log is still at the
//!   founding point (a new group's first election, where nothing can have
//!   been committed) or that hold their votes too (below), and ignores
//!   the `TimeoutNow` of a leadership transfer;
//! - once its own log is past the founding point, it may be a leader's
//!   prefix without the end that was committed: its vote requests then
//!   carry [`HELD_CONTEXT`], and only replicas holding their votes grant
//!   those. (Replicas that all hold — a new group restarted whole before
//!   any of them caught up — still elect among themselves.)
//! - it has caught up once its log holds the leader's commit index with an
//!   entry of the leader's term, learnt from an append (which carries the
//!   leader's whole commit index; a heartbeat carries it only up to the
//!   follower's match) or from the heartbeat a leader quiesces with (sent
//!   when every follower's log matches its own): a leader that committed
//!   an entry of its own term holds every entry committed before it, and
//!   one committed in its term before the disk was lost is below its
//!   commit index. A leader has caught up once it commits an entry of its
//!   term. The hold ends after the Ready that made the log durable through
//!   it.
//!
//! The hold is recorded (`VOTES_HELD` in the replica's directory, outside
//! the engine slots, so an installed snapshot keeps it) before the group
//! is founded, and removed, durably, when it ends. Split groups' replicas,
//! made from their parent's, and replicas made to join a group (learners,
//! voters only once caught up) never hold votes.
//!
//! A follower that lost entries it acknowledged (its disk replaced, or a
//! power loss under `buffered` durability) breaks what raft-rs takes for
//! granted: the leader's heartbeats carry a commit index up to what the
//! follower once matched, beyond its log now, which raft-rs's follower
//! treats as a fatal error — the replica failed, was reopened, and failed
//! again at the next heartbeat, for as long as the leader lived. Such a
//! heartbeat is stepped without its commit index
//! ([`Replica::when_entries_were_lost`]); commits are learnt again from
//! appends, which check the log. (The leader takes the follower's first
//! rejection, of the index it matched, for a stale one; the rejection of
//! its next append sets it probing from the follower's end, as raft-rs
//! does for any follower behind.)
//!
//! What it costs: in a new group, a follower holds until the commit of the
//! first leader's first entry reaches it, a few milliseconds. A group
//! whose leader is lost while a founding replica holds, behind the third,
//! waits for the leader (as it would with a learner in that seat). It
//! protects against one replica of a group having lost its files; if a
//! second never caught up either, the two can still elect each other, as
//! two failures of three can.

use raft::StateRole;
use raft::eraftpb::{Message, MessageType};

use super::Replica;
use crate::error::Result;
use crate::raftlog::{FOUNDING_INDEX, FOUNDING_TERM};

/// The context of a vote request from a replica that holds its votes and
/// whose log is past the founding point. Read contexts are 8 bytes and the
/// transfer's is raft-rs's `CAMPAIGN_TRANSFER`: it cannot be mistaken.
pub const HELD_CONTEXT: &[u8] = b"tidepool/votes-held";

/// A replica's hold on its votes.
#[derive(Debug, Default)]
pub(crate) struct VoteHold {
    /// Votes held (see the module docs).
    pub held: bool,
    /// Caught up with a leader: the hold ends after this Ready.
    caught_up: bool,
}

/// Whether a vote request comes from a log at the founding point.
fn at_founding(message: &Message) -> bool {
    message.index == FOUNDING_INDEX && message.log_term == FOUNDING_TERM
}

fn is_vote_request(message: &Message) -> bool {
    matches!(
        message.msg_type(),
        MessageType::MsgRequestVote | MessageType::MsgRequestPreVote
    )
}

/// Whether a replica `node_id` founding a group of `voters` holds its
/// votes: a voter with others to catch up with.
pub(crate) fn holds_when_founding(node_id: u64, voters: &[u64]) -> bool {
    voters.len() > 1 && voters.contains(&node_id)
}

impl Replica {
    /// Whether votes are held; set when the replica opens.
    pub(crate) fn open_vote_hold(&mut self) {
        self.votes = VoteHold {
            held: self.store.votes_held(),
            caught_up: false,
        };
    }

    /// Before stepping `message`: a heartbeat whose commit index is beyond
    /// the log, sent to a follower that lost entries it acknowledged, is
    /// stepped without it (see the module docs).
    pub(crate) fn when_entries_were_lost(&self, message: &mut Message) {
        let raft = &self.raw.raft;
        if message.msg_type() == MessageType::MsgHeartbeat
            && message.commit > raft.raft_log.last_index()
        {
            tracing::warn!(
                shard_id = self.config.shard_id,
                leader = message.from,
                commit = message.commit,
                last_index = raft.raft_log.last_index(),
                "the leader's heartbeat commits past this replica's log: it lost entries it acknowledged; commits are learnt again from appends"
            );
            message.commit = raft.raft_log.committed;
        }
    }

    /// Whether the replica holds its votes.
    pub fn holds_votes(&self) -> bool {
        self.votes.held
    }

    /// Whether `message`, to this replica, is one it does not step: a vote
    /// request it may not grant, or a transfer's `TimeoutNow` while it
    /// holds its votes.
    pub(crate) fn held_back(&self, message: &Message) -> bool {
        if is_vote_request(message) {
            if message.context == HELD_CONTEXT {
                return !self.votes.held;
            }
            return self.votes.held && !at_founding(message);
        }
        self.votes.held && message.msg_type() == MessageType::MsgTimeoutNow
    }

    /// Marks this replica's vote requests in `messages` when it holds its
    /// votes and its log is past the founding point.
    pub(crate) fn mark_held_requests(&self, messages: &mut [Message]) {
        if !self.votes.held {
            return;
        }
        for message in messages {
            if is_vote_request(message) && !at_founding(message) && message.context.is_empty() {
                message.context = HELD_CONTEXT.to_vec();
            }
        }
    }

    /// After stepping a message of type `kind` from `from` in `term`,
    /// carrying `commit` (`quiesce`: the leader's quiesce heartbeat): notes
    /// whether this follower caught up with its leader.
    pub(crate) fn note_caught_up(
        &mut self,
        kind: MessageType,
        from: u64,
        term: u64,
        commit: u64,
        quiesce: bool,
    ) {
        if !self.votes.held || self.votes.caught_up {
            return;
        }
        let raft = &self.raw.raft;
        let whole_commit =
            kind == MessageType::MsgAppend || (kind == MessageType::MsgHeartbeat && quiesce);
        if whole_commit
            && raft.state == StateRole::Follower
            && raft.leader_id == from
            && raft.term == term
            && commit <= raft.raft_log.last_index()
            && raft.raft_log.term(commit).ok() == Some(term)
        {
            self.votes.caught_up = true;
        }
    }

    /// At the end of a Ready: ends the hold of a replica that caught up
    /// (a leader once it committed an entry of its term), once its log is
    /// durable through what it caught up to.
    pub(crate) fn end_vote_hold(&mut self) -> Result<()> {
        if !self.votes.held {
            return Ok(());
        }
        let raft = &self.raw.raft;
        if raft.state == StateRole::Leader
            && raft.raft_log.term(raft.raft_log.committed).ok() == Some(raft.term)
        {
            self.votes.caught_up = true;
        }
        if !self.votes.caught_up {
            return Ok(());
        }
        let engine = self.engine().clone();
        engine.wait_synced(engine.processed_position())?;
        self.store.release_votes()?;
        self.votes = VoteHold::default();
        tracing::debug!(
            shard_id = self.config.shard_id,
            term = self.raw.raft.term,
            commit = self.raw.raft.raft_log.committed,
            "caught up with a leader: votes no longer held"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use raft::eraftpb::{Entry, Message, MessageType};
    use tidepool_engine::storage::FaultStorage;

    use crate::replica::{Replica, ReplicaConfig};
    use crate::sim::replica_store;
    use crate::snapshot::Outbox;

    fn open(storage: &FaultStorage) -> Replica {
        let config = ReplicaConfig::new(0, 2);
        Replica::open(
            config,
            replica_store(storage),
            Arc::new(Outbox::default()),
            &[1, 2, 3],
        )
        .expect("open")
    }

    fn message(kind: MessageType, from: u64, term: u64, index: u64, log_term: u64) -> Message {
        let mut m = Message::default();
        m.set_msg_type(kind);
        m.from = from;
        m.to = 2;
        m.term = term;
        m.index = index;
        m.log_term = log_term;
        m
    }

    fn append(term: u64, index: u64, log_term: u64, entries: &[u64], commit: u64) -> Message {
        let mut m = message(MessageType::MsgAppend, 1, term, index, log_term);
        m.commit = commit;
        m.set_entries(
            entries
                .iter()
                .enumerate()
                .map(|(i, t)| Entry {
                    index: index + 1 + i as u64,
                    term: *t,
                    ..Entry::default()
                })
                .collect::<Vec<_>>(),
        );
        m
    }

    fn answers_vote(replica: &mut Replica, request: Message) -> bool {
        replica.step(request).unwrap();
        replica.handle_ready().unwrap().iter().any(|m| {
            matches!(
                m.msg_type(),
                MessageType::MsgRequestVoteResponse | MessageType::MsgRequestPreVoteResponse
            )
        })
    }

    fn held(mut m: Message) -> Message {
        m.context = super::HELD_CONTEXT.to_vec();
        m
    }

    /// A founding replica holds its votes from before its group exists,
    /// across a restart, and until it holds the leader's commit index with
    /// an entry of the leader's term (not before: the first append's commit
    /// index is an older term's); meanwhile it answers only candidates at
    /// the founding point or holding their votes too. Then it answers
    /// others, and no longer those that hold.
    #[test]
    fn a_founding_replica_holds_its_votes_until_it_caught_up() {
        let storage = FaultStorage::default();
        let mut replica = open(&storage);
        assert!(replica.holds_votes(), "founding: holds its votes");
        assert!(replica.store().votes_held(), "recorded");
        // A candidate whose log is past the founding point gets no answer,
        // one at the founding point does, and so does one that holds.
        let request = message(MessageType::MsgRequestPreVote, 3, 3, 9, 2);
        assert!(!answers_vote(&mut replica, request));
        let request = message(MessageType::MsgRequestVote, 3, 3, 9, 2);
        assert!(!answers_vote(&mut replica, request));
        let request = message(MessageType::MsgRequestPreVote, 3, 3, 1, 1);
        assert!(answers_vote(&mut replica, request));
        let request = held(message(MessageType::MsgRequestPreVote, 3, 3, 9, 2));
        assert!(answers_vote(&mut replica, request));

        // Entries of term 5 from the leader, whose commit index (1) is the
        // founding one: still held.
        replica.step(append(5, 1, 1, &[5, 5], 1)).unwrap();
        replica.handle_ready().unwrap();
        assert_eq!(replica.status().last_index, 3);
        assert!(replica.holds_votes());

        // A restart keeps the hold.
        drop(replica);
        let storage = storage.restart_process();
        let mut replica = open(&storage);
        assert!(replica.holds_votes(), "the hold survives a restart");
        let request = message(MessageType::MsgRequestVote, 3, 6, 3, 5);
        assert!(!answers_vote(&mut replica, request));

        // The leader's commit index reaches an entry of its term: caught up.
        replica.step(append(5, 3, 5, &[], 3)).unwrap();
        replica.handle_ready().unwrap();
        assert!(!replica.holds_votes(), "caught up: votes no longer held");
        assert!(!replica.store().votes_held(), "the record is gone");
        // Past an election timeout without the leader (raft-rs ignores
        // votes while it hears from one).
        for _ in 0..30 {
            replica.tick().unwrap();
            replica.handle_ready().unwrap();
        }
        let request = held(message(MessageType::MsgRequestPreVote, 3, 99, 9, 5));
        assert!(
            !answers_vote(&mut replica, request),
            "a replica that holds no votes does not answer one that holds"
        );
        let request = message(MessageType::MsgRequestPreVote, 3, 99, 9, 5);
        assert!(answers_vote(&mut replica, request));
        drop(replica);
        let replica = open(&storage.restart_process());
        assert!(
            !replica.holds_votes(),
            "a restart after catching up holds nothing"
        );
    }

    /// A replica founded as the only voter has nobody to catch up with.
    #[test]
    fn a_single_voter_holds_nothing() {
        let storage = FaultStorage::default();
        let replica = Replica::open(
            ReplicaConfig::new(0, 2),
            replica_store(&storage),
            Arc::new(Outbox::default()),
            &[2],
        )
        .unwrap();
        assert!(!replica.holds_votes());
    }
}
