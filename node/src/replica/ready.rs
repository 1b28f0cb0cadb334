//! The Ready checklist, in raft-rs's order:
//! 1. messages a leader may send before persisting (its appends to
//!    followers): sent at once, so followers write while the leader syncs;
//!    raft-rs counts the leader's own copy only after `advance`;
//! 2. a snapshot to install: its files are already in the spare slot (the
//!    transport fetched them before stepping the message); open them, give
//!    them this replica's Raft state, flip the slot;
//! 3. committed entries to apply (already persisted);
//! 4. new entries to append to the log;
//! 5. a changed hard state to persist;
//!    — then wait until 4 and 5 are durable —
//! 6. messages that required 4 and 5 to be durable;
//! 7. `advance`: a new commit index is persisted, its messages sent and its
//!    committed entries applied; `advance_apply`.

use raft::StateRole;
use raft::eraftpb::{Message, Snapshot};
use tidepool_engine::Durability;

use super::{BLOB_KEY_SPACE, Replica};
use crate::entry_context::{must_sync, traceparent};
use crate::error::{NodeError, Result};
use crate::raftlog::RaftLog;
use crate::snapshot::manifest_of;
use crate::tracing_context::{Place, Step, entry_span};

impl Replica {
    /// Runs the Ready checklist if raft-rs has anything ready. Returns the
    /// messages to send.
    pub fn handle_ready(&mut self) -> Result<Vec<Message>> {
        let mut early = Vec::new();
        let rest = self.handle_ready_sending(&mut |messages| early.extend(messages))?;
        early.extend(rest);
        Ok(early)
    }

    /// `handle_ready`, handing the messages a leader may send before its
    /// own append is durable (appends to followers) to `send_early` before
    /// waiting for that sync, so the followers' writes overlap the
    /// leader's. The rest are returned.
    pub fn handle_ready_sending(
        &mut self,
        send_early: &mut dyn FnMut(Vec<Message>),
    ) -> Result<Vec<Message>> {
        // Any error fails the replica, not only the engine's: a Ready left
        // half handled (raft-rs has moved past its committed entries) lost
        // the rest of the batch's entries for good, each replica different
        // ones (batches differ), and the Ready's messages.
        match self.guarded(|replica| replica.handle_ready_unguarded(send_early)) {
            Err(error) if !matches!(error, NodeError::Failed(_)) => {
                Err(self.fail(format!("handling a Ready failed: {error}")))
            }
            result => result,
        }
    }

    fn handle_ready_unguarded(
        &mut self,
        send_early: &mut dyn FnMut(Vec<Message>),
    ) -> Result<Vec<Message>> {
        // Before any message of this Ready leaves (`read.rs`).
        self.show_lease();
        if !self.raw.has_ready() {
            return Ok(Vec::new());
        }
        let mut ready = self.raw.ready();
        let mut early = ready.take_messages();
        self.mark_held_requests(&mut early);
        let mut outgoing = Vec::new();
        if !early.is_empty() {
            send_early(early);
        }
        let read_states = ready.take_read_states();
        if !ready.snapshot().is_empty() {
            self.install_snapshot(ready.snapshot())?;
        }
        self.apply_entries(ready.take_committed_entries())?;
        self.show_lease();
        // An entry marked for it is synced whatever the configuration, by
        // the leader before raft-rs counts its own copy and by a follower
        // before it answers (`entry_context`).
        let durability = if ready.entries().iter().any(|e| must_sync(&e.context)) {
            Durability::Synced
        } else {
            self.config.durability
        };
        // A follower traces the append of traced entries until durable.
        let append_spans: Vec<tracing::Span> = if self.raw.raft.state == StateRole::Leader {
            Vec::new()
        } else {
            ready
                .entries()
                .iter()
                .filter(|e| !traceparent(&e.context).is_empty())
                .map(|e| {
                    let place = Place {
                        node_id: self.config.node_id,
                        shard_id: self.shard_id(),
                        term: e.term,
                    };
                    entry_span(Step::Append, traceparent(&e.context), place, e.index)
                })
                .collect()
        };
        let entries_end = self.log().append(ready.entries())?;
        let state_end = self.log().set_state(ready.hs(), None)?;
        self.log().wait(entries_end.max(state_end), durability)?;
        drop(append_spans);
        outgoing.extend(ready.take_persisted_messages());
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            // A commit index need not be durable before anything goes out
            // (a lower one after a crash is learnt again from the leader),
            // so this record is not waited for: the next sync covers it.
            let mut hard_state = self.raw.store().hard_state().clone();
            hard_state.commit = commit;
            self.log().set_state(Some(&hard_state), None)?;
        }
        outgoing.extend(light.take_messages());
        self.apply_entries(light.take_committed_entries())?;
        self.raw.advance_apply();
        self.confirm_reads(read_states);
        self.maybe_compact()?;
        self.end_vote_hold()?;
        self.mark_held_requests(&mut outgoing);
        self.show_lease();
        Ok(outgoing)
    }

    /// Installs a snapshot whose files were received into the spare slot.
    fn install_snapshot(&mut self, snapshot: &Snapshot) -> Result<()> {
        let manifest = manifest_of(snapshot)?;
        if self.store.spare_snapshot()? != Some(manifest.snapshot_id) {
            // raft-rs holds the snapshot as unstable now and would offer it
            // at every Ready: the replica fails and reopens from disk (the
            // leader sends the snapshot again).
            return Err(NodeError::Failed(format!(
                "snapshot {} was stepped before its files were received",
                manifest.snapshot_id
            )));
        }
        let started = std::time::Instant::now();
        let engine = self.store.open_spare()?;
        // A snapshot from a leader of an older version holds blobs and no
        // indexing state: decided here as at an open, or the replica would
        // answer complete listings without those blobs' names.
        let names = engine.key_space(crate::names::NAMES_KEY_SPACE)?;
        crate::names::check_complete(&engine, names, engine.key_space(BLOB_KEY_SPACE)?)?;
        // A leader's checkpoint: everything it applied is in its index
        // (the checkpoint flushes first), nothing to apply again.
        engine.release_replay_hold();
        let hard_state = self.raw.store().hard_state().clone();
        let mut log = RaftLog::installed(engine, self.space, snapshot.get_metadata(), &hard_state)?;
        // The point of no return: from here on a restart opens the new slot.
        self.store.flip()?;
        if let Some(sender) = self.log().take_snapshot_sender() {
            log.set_snapshot_sender(sender);
        }
        let old = std::mem::replace(self.log(), log);
        self.proposals
            .superseded_through(snapshot.get_metadata().index);
        self.show_range();
        self.show_session_clock();
        // The old engine's data is superseded; a failing close loses nothing.
        let _ = old.engine().close();
        drop(old);
        tracing::info!(
            snapshot = manifest.snapshot_id,
            index = snapshot.get_metadata().index,
            install_ms = started.elapsed().as_millis() as u64,
            "snapshot installed"
        );
        self.store.clear_spare()
    }

    /// Compacts the log in steps of a quarter of its limits: to the
    /// applied index, except that a leader keeps what followers still need,
    /// up to half the entry limit (a follower further behind gets a
    /// snapshot), and, whatever the limit, the entries after a snapshot a
    /// follower is being sent, then those it still needs while it catches
    /// up from there (up to the byte limit).
    fn maybe_compact(&mut self) -> Result<()> {
        let applied = self.raw.raft.raft_log.applied;
        let (max_entries, max_bytes) = (
            self.config.compact_log_entries,
            self.config.compact_log_bytes,
        );
        let mut to = applied;
        if self.raw.raft.state == StateRole::Leader {
            let kept = applied.saturating_sub(max_entries / 2);
            let (mut sending, mut catching_up) = (u64::MAX, u64::MAX);
            for (id, progress) in self.raw.raft.prs().iter() {
                if *id == self.config.node_id {
                    continue;
                }
                to = to.min(progress.matched);
                // A follower taking a snapshot goes on from the entry after
                // it: compacted, that entry would earn it another snapshot,
                // as late as this one (never caught up while a transfer
                // outlasts the entries kept). Kept from the snapshot's
                // index while the transfer moves, then from the follower's
                // matched index while it advances, until it is within the
                // entries kept for any follower: appends carry a message
                // budget of entries each, so a follower that installed a
                // snapshot older than that takes several round trips to
                // get there. A stalled transfer or catch-up is given up
                // (`watch_snapshots`) and the limit applies.
                if progress.state == raft::ProgressState::Snapshot {
                    sending = sending.min(progress.pending_snapshot);
                    self.catch_up.entry(*id).or_insert((progress.matched, 0));
                } else if self.catch_up.contains_key(id) {
                    if progress.matched >= kept {
                        self.catch_up.remove(id);
                    } else {
                        catching_up = catching_up.min(progress.matched);
                    }
                }
            }
            to = to.max(kept).min(sending);
            // A catch-up holds at most the byte limit of log: a follower
            // slower than the writes would otherwise keep it growing.
            if catching_up < to {
                let spanned = self.raw.store().wal_bytes_through(applied);
                if spanned < max_bytes {
                    to = catching_up;
                } else {
                    tracing::warn!(
                        shard_id = self.config.shard_id,
                        spanned,
                        followers = ?self.catch_up.keys().collect::<Vec<_>>(),
                        "the log reached its byte limit holding entries for followers catching up after a snapshot; they will need another"
                    );
                    self.catch_up.clear();
                }
            }
        }
        let log = self.raw.store();
        if to < log.first() {
            return Ok(());
        }
        let entries = to + 1 - log.first();
        // After an epoch drop, whatever the limits: expired blobs in the
        // segments the log still spans are reclaimed only once it no
        // longer does, and an idle shard (two entries an epoch) reached a
        // quarter of the limits after some thousand epochs — up to the
        // byte limit of expired data per shard kept meanwhile.
        // Forced once as the drop applies (a leader's compaction stops at
        // its slowest follower, and no Ready may come when that one catches
        // up), then once a compaction can reach the drop — not at every
        // Ready until then: with a follower down, that flushed the engine
        // every Ready.
        let (forced, reached) = match self.drop_to_compact {
            Some((drop, tried)) => (!tried || to >= drop, to >= drop),
            None => (false, false),
        };
        if entries >= (max_entries / 4).max(1)
            || log.wal_bytes_through(to) >= max_bytes / 4
            || forced
        {
            self.log().compact(to)?;
            self.drop_to_compact = match self.drop_to_compact {
                Some((drop, _)) if !reached => Some((drop, true)),
                _ => None,
            };
        }
        Ok(())
    }
}
