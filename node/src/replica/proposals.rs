//! Proposals waiting to be applied, and how each one ends.

use std::collections::BTreeMap;
use std::sync::Arc;

use tidepool_proto::v1::ReplacedChunks;

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
        /// The chunked blobs the entry's puts replaced, by op ordinal:
        /// only ops this replica proposed and applied now (not
        /// duplicates), so only the proposer's answer carries them.
        replaced: Arc<[(u32, ReplacedChunks)]>,
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
            Outcome::Applied {
                index,
                results,
                replaced,
            } => Outcome::Applied {
                index: *index,
                results: results.get(ordinal).copied().into_iter().collect(),
                replaced: replaced
                    .iter()
                    .filter(|(op, _)| *op as usize == ordinal)
                    .map(|(_, chunks)| (0, *chunks))
                    .collect(),
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

    /// The chunked blob an applied single op's put replaced (see
    /// [`Outcome::Applied`]), if any.
    pub fn replaced_chunks(&self) -> Option<ReplacedChunks> {
        match self {
            Outcome::Applied { replaced, .. } => replaced
                .iter()
                .find(|(op, _)| *op == 0)
                .map(|(_, chunks)| *chunks),
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

    /// Whether a proposal of this replica waits for entry `index` of
    /// `term` (its answer is wanted).
    pub fn waits_for(&self, index: u64, term: u64) -> bool {
        self.pending
            .get(&index)
            .is_some_and(|(proposed_term, _)| *proposed_term == term)
    }

    /// Entry `index` of `term` was applied, its write ops with `results`
    /// (and the chunked blobs they `replaced`): its proposal (if ours and of
    /// that term) succeeded; a proposal for the same index from another
    /// term was dropped.
    pub fn applied(
        &mut self,
        index: u64,
        term: u64,
        results: Vec<OpResult>,
        replaced: Vec<(u32, ReplacedChunks)>,
    ) {
        if let Some((proposed_term, done)) = self.pending.remove(&index) {
            done(if proposed_term == term {
                Outcome::Applied {
                    index,
                    results: results.into(),
                    replaced: replaced.into(),
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

    /// A snapshot through `index` replaced the log: a proposal at or below
    /// it will never be applied here (its entry, committed or not, is in
    /// the snapshot or gone), so it ends now, as one whose outcome is
    /// unknown (the client retries in the same session: a write that did
    /// apply answers as a duplicate). Those above it wait for the entries
    /// that come after the snapshot.
    pub fn superseded_through(&mut self, index: u64) {
        let above = self.pending.split_off(&(index + 1));
        for (_, (_, done)) in std::mem::replace(&mut self.pending, above) {
            done(Outcome::Failed(format!(
                "the replica installed a snapshot through entry {index}; whether this write applied is unknown"
            )));
        }
    }

    /// Fails every waiting proposal.
    pub fn fail_all(&mut self, reason: &str) {
        for (_, (_, done)) in std::mem::take(&mut self.pending) {
            done(Outcome::Failed(reason.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A deposed leader caught up by a snapshot: its proposals at or below
    /// the snapshot's index end at once, outcome unknown (before, they
    /// waited for entries that never come — the client until its deadline,
    /// the replica's quiescence forever); one above waits for its entry.
    #[test]
    fn a_snapshot_ends_the_proposals_it_covers() {
        let ended: Arc<Mutex<Vec<(u64, Outcome)>>> = Arc::default();
        let mut proposals = Proposals::default();
        for index in [5, 7, 9] {
            let ended = ended.clone();
            proposals.add(
                index,
                3,
                Box::new(move |outcome| ended.lock().unwrap().push((index, outcome))),
            );
        }
        proposals.superseded_through(7);
        let seen: Vec<u64> = ended.lock().unwrap().iter().map(|(i, _)| *i).collect();
        assert_eq!(seen, [5, 7]);
        assert!(
            ended
                .lock()
                .unwrap()
                .iter()
                .all(|(_, o)| matches!(o, Outcome::Failed(r) if r.contains("unknown")))
        );
        assert!(!proposals.is_empty());
        proposals.applied(9, 3, Vec::new(), Vec::new());
        assert!(proposals.is_empty());
        assert!(matches!(
            ended.lock().unwrap().last(),
            Some((9, Outcome::Applied { index: 9, .. }))
        ));
    }
}
