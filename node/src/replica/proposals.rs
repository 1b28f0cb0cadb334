//! Proposals waiting to be applied, and how each one ends.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::session::OpResult;

/// How a proposal ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Committed and applied at this index.
    Applied {
        /// Raft index of the entry.
        index: u64,
        /// What each write op of the entry did (empty for other entries).
        results: Arc<[OpResult]>,
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

impl Outcome {
    /// The outcome as seen by op `ordinal` of the entry: only its result.
    pub fn for_op(&self, ordinal: usize) -> Outcome {
        match self {
            Outcome::Applied { index, results } => Outcome::Applied {
                index: *index,
                results: results.get(ordinal).copied().into_iter().collect(),
            },
            other => other.clone(),
        }
    }

    /// An applied single op's result (applied, nothing to report, for an
    /// entry without write ops).
    pub fn op_result(&self) -> Option<OpResult> {
        match self {
            Outcome::Applied { results, .. } => {
                Some(results.first().copied().unwrap_or(OpResult::DONE))
            }
            _ => None,
        }
    }
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

    /// Entry `index` of `term` was applied, its write ops with `results`:
    /// its proposal (if ours and of that term) succeeded; a proposal for the
    /// same index from another term was dropped.
    pub fn applied(&mut self, index: u64, term: u64, results: Vec<OpResult>) {
        if let Some((proposed_term, done)) = self.pending.remove(&index) {
            done(if proposed_term == term {
                Outcome::Applied {
                    index,
                    results: results.into(),
                }
            } else {
                Outcome::Dropped
            });
        }
    }

    /// Whether no proposal waits.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Fails every waiting proposal.
    pub fn fail_all(&mut self, reason: &str) {
        for (_, (_, done)) in std::mem::take(&mut self.pending) {
            done(Outcome::Failed(reason.to_string()));
        }
    }
}
