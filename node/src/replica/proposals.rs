//! Proposals waiting to be applied, and how each one ends.

use std::collections::BTreeMap;

/// How a proposal ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Committed and applied at this index.
    Applied {
        /// Raft index of the entry.
        index: u64,
    },
    /// This replica does not lead; `leader` does (0: unknown). Nothing was
    /// proposed.
    NotLeader {
        /// The leader, if known.
        leader: u64,
    },
    /// The entry was replaced by another leader's: it will never apply.
    Dropped,
    /// The command is larger than the replica accepts.
    TooLarge {
        /// The limit, bytes.
        max: usize,
    },
    /// The shard's queue is full; nothing was proposed.
    Overloaded,
    /// The replica failed (for example its engine is poisoned).
    Failed(String),
}

/// Called once with a proposal's outcome.
pub type Completion = Box<dyn FnOnce(Outcome) + Send>;

/// Proposals by index.
#[derive(Default)]
pub(crate) struct Proposals {
    pending: BTreeMap<u64, (u64, Completion)>,
}

impl Proposals {
    /// Waits for entry `index` of `term`.
    pub fn add(&mut self, index: u64, term: u64, done: Completion) {
        if let Some((_, replaced)) = self.pending.insert(index, (term, done)) {
            replaced(Outcome::Dropped);
        }
    }

    /// Entry `index` of `term` was applied: its proposal (if ours and of
    /// that term) succeeded; a proposal for the same index from another term
    /// was dropped.
    pub fn applied(&mut self, index: u64, term: u64) {
        if let Some((proposed_term, done)) = self.pending.remove(&index) {
            done(if proposed_term == term {
                Outcome::Applied { index }
            } else {
                Outcome::Dropped
            });
        }
    }

    /// Fails every waiting proposal.
    pub fn fail_all(&mut self, reason: &str) {
        for (_, (_, done)) in std::mem::take(&mut self.pending) {
            done(Outcome::Failed(reason.to_string()));
        }
    }
}
