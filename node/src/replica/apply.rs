//! Applying committed entries to the engine. A Write only points the index
//! at the values already in the WAL (`Engine::apply`); touches, epoch
//! advances and epoch drops act at the entry's index on every replica, with
//! everything they depend on carried in the entry, so replicas agree.

use prost011::Message as _;
use raft::eraftpb::{ConfChangeV2, Entry, EntryType};
use tidepool_engine::{Decision, Durability, EntryInfo, Epoch, RelocationFilter, Tag};

use super::Replica;
use crate::command::Command;
use crate::error::{NodeError, Result};

/// Drops one namespace's entries, keeps the rest.
struct Namespace(u32);

impl RelocationFilter for Namespace {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        if entry.tag == Tag(self.0) {
            Decision::Drop
        } else {
            Decision::Keep
        }
    }
}

impl Replica {
    /// Applies committed entries in order and completes their proposals.
    pub(crate) fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<()> {
        for entry in entries {
            let index = entry.index;
            if entry.entry_type == EntryType::EntryConfChangeV2 as i32 {
                let change = ConfChangeV2::decode(&entry.data[..])
                    .map_err(|e| NodeError::Malformed(format!("conf change at {index}: {e}")))?;
                let conf_state = self.raw.apply_conf_change(&change)?;
                self.log().set_state(None, Some((&conf_state, index)))?;
            } else if entry.entry_type == EntryType::EntryNormal as i32 {
                self.apply_command(&entry)?;
            }
            self.log().set_applied(index);
            self.proposals.applied(index, entry.term);
        }
        Ok(())
    }

    fn apply_command(&mut self, entry: &Entry) -> Result<()> {
        if entry.data.is_empty() {
            return Ok(());
        }
        let engine = self.engine().clone();
        let space = self.space;
        match Command::decode(&entry.data)? {
            Command::Write(_) => {
                let appended = self.log().appended(entry.index)?;
                engine.apply(&appended)?;
            }
            Command::Touch { key, epoch, .. } => {
                engine.touch_to(space, &key, Epoch(epoch), Durability::Buffered)?;
            }
            Command::AdvanceEpoch(epoch) => {
                if Epoch(epoch) > engine.epoch() {
                    engine.advance_epoch(Epoch(epoch))?;
                }
            }
            Command::DropEpochs { namespace, below } => {
                // A drop past the current epoch is refused by every replica
                // alike: nothing to do.
                if Epoch(below) <= engine.epoch() {
                    engine.drop_epochs_below(Epoch(below), &Namespace(namespace))?;
                    self.log().record_drop(namespace, below);
                }
            }
            Command::Noop => {}
        }
        Ok(())
    }

    /// After a restart, re-applies the applied entries whose index effects
    /// the engine may have lost: those recorded at or after the engine's
    /// `recovered_replay_from`. (Entries above the applied index come back
    /// from raft-rs as committed entries, as usual.) Applying is idempotent.
    pub(crate) fn reapply_after_restart(&mut self) -> Result<()> {
        let replay_from = self.engine().recovered_replay_from();
        let (first, applied) = (self.log().first(), self.log().applied());
        for index in first..=applied {
            if self.log().position(index).is_some_and(|p| p >= replay_from) {
                let entry = self.log().entry(index)?;
                if entry.entry_type == EntryType::EntryNormal as i32 {
                    self.apply_command(&entry)?;
                }
            }
        }
        Ok(())
    }
}
