//! The Ready checklist, in raft-rs's order:
//! 1. messages a leader may send before persisting;
//! 2. a snapshot to install (not supported yet: an error);
//! 3. committed entries to apply (already persisted);
//! 4. new entries to append to the log;
//! 5. a changed hard state to persist;
//!    — then wait until 4 and 5 are durable —
//! 6. messages that required 4 and 5 to be durable;
//! 7. `advance`: a new commit index is persisted, its messages sent and its
//!    committed entries applied; `advance_apply`.

use raft::eraftpb::Message;

use super::Replica;
use crate::error::{NodeError, Result};

impl Replica {
    /// Runs the Ready checklist if raft-rs has anything ready. Returns the
    /// messages to send.
    pub fn handle_ready(&mut self) -> Result<Vec<Message>> {
        self.guarded(Self::handle_ready_unguarded)
    }

    fn handle_ready_unguarded(&mut self) -> Result<Vec<Message>> {
        if !self.raw.has_ready() {
            return Ok(Vec::new());
        }
        let mut ready = self.raw.ready();
        let mut outgoing = ready.take_messages();
        if !ready.snapshot().is_empty() {
            return Err(NodeError::Malformed(
                "snapshot installation is not supported yet".into(),
            ));
        }
        self.apply_entries(ready.take_committed_entries())?;
        let durability = self.config.durability;
        let entries_end = self.log().append(ready.entries())?;
        let state_end = self.log().set_state(ready.hs(), None)?;
        self.log().wait(entries_end.max(state_end), durability)?;
        outgoing.extend(ready.take_persisted_messages());
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            let mut hard_state = self.raw.store().hard_state().clone();
            hard_state.commit = commit;
            let end = self.log().set_state(Some(&hard_state), None)?;
            self.log().wait(end, durability)?;
        }
        outgoing.extend(light.take_messages());
        self.apply_entries(light.take_committed_entries())?;
        self.raw.advance_apply();
        Ok(outgoing)
    }
}
