//! Pure: when the leader balancer may ask for a leadership transfer.
//!
//! The balancer sees nodes through their heartbeats and status reports; a
//! node cut off from its peers still answers both. Asking a leader to hand
//! leadership to such a node used to stall the shard's writes for the whole
//! partition, every round. Three rules keep a transfer from costing
//! availability (the node side is `node/src/replica/transfer.rs`: a leader
//! accepts only a target it hears and that is caught up, and holds writes
//! while a transfer is pending):
//!
//! - a transfer asked that has not completed within `timeout` (or that the
//!   leader refused) is not asked again, for that shard and target, until
//!   `backoff` has passed;
//! - a node that came back (absent from the live set the round before) is
//!   no target for `settle`, so a node resumed from a pause or restarted is
//!   not handed leadership the moment it answers;
//! - the first round of a coordinator term marks nobody as returned.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// A (shard, target node) pair.
type Pair = (u32, u64);

/// Transfers asked and the pairs and nodes to leave alone for now.
#[derive(Debug)]
pub(crate) struct Transfers {
    timeout: Duration,
    backoff: Duration,
    settle: Duration,
    asked: HashMap<Pair, Instant>,
    not_before: HashMap<Pair, Instant>,
    returned: HashMap<u64, Instant>,
    last_live: Option<BTreeSet<u64>>,
}

impl Transfers {
    /// Rules with these periods.
    pub fn new(timeout: Duration, backoff: Duration, settle: Duration) -> Self {
        Self {
            timeout,
            backoff,
            settle,
            asked: HashMap::new(),
            not_before: HashMap::new(),
            returned: HashMap::new(),
            last_live: None,
        }
    }

    /// Starts over (a new coordinator term).
    pub fn clear(&mut self) {
        *self = Self::new(self.timeout, self.backoff, self.settle);
    }

    /// A round's view: the live nodes and each shard's leader. Returns the
    /// transfers that did not complete in time (now backed off).
    pub fn observe(
        &mut self,
        now: Instant,
        live: &BTreeSet<u64>,
        leaders: impl IntoIterator<Item = (u32, Option<u64>)>,
    ) -> Vec<Pair> {
        if let Some(before) = &self.last_live {
            for node in live.difference(before) {
                self.returned.insert(*node, now);
            }
        }
        self.last_live = Some(live.clone());
        let settle = self.settle;
        self.returned
            .retain(|_, at| now.duration_since(*at) < settle);
        self.not_before.retain(|_, until| *until > now);
        let leaders: HashMap<u32, Option<u64>> = leaders.into_iter().collect();
        let mut expired = Vec::new();
        let timeout = self.timeout;
        self.asked.retain(|&(shard, to), at| {
            if leaders.get(&shard).copied().flatten() == Some(to) {
                return false; // done
            }
            if now.duration_since(*at) >= timeout {
                expired.push((shard, to));
                return false;
            }
            true
        });
        for pair in &expired {
            self.not_before.insert(*pair, now + self.backoff);
        }
        expired
    }

    /// Whether leadership of `shard` may be asked to move to `to` now.
    pub fn may_ask(&self, now: Instant, shard: u32, to: u64) -> bool {
        !self.asked.contains_key(&(shard, to))
            && self.not_before.get(&(shard, to)).is_none_or(|t| *t <= now)
            && !self.returned.contains_key(&to)
    }

    /// A transfer was asked (and accepted by the leader).
    pub fn asked(&mut self, now: Instant, shard: u32, to: u64) {
        self.asked.insert((shard, to), now);
    }

    /// The leader refused the transfer: leave the pair alone for a while.
    pub fn refused(&mut self, now: Instant, shard: u32, to: u64) {
        self.not_before.insert((shard, to), now + self.backoff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Transfers {
        Transfers::new(
            Duration::from_secs(3),
            Duration::from_secs(30),
            Duration::from_secs(10),
        )
    }

    fn live(ids: &[u64]) -> BTreeSet<u64> {
        ids.iter().copied().collect()
    }

    #[test]
    fn a_transfer_that_does_not_complete_is_backed_off() {
        let t0 = Instant::now();
        let mut t = rules();
        t.observe(t0, &live(&[1, 2, 3]), [(7, Some(2))]);
        assert!(t.may_ask(t0, 7, 1));
        t.asked(t0, 7, 1);
        assert!(!t.may_ask(t0, 7, 1), "pending");
        let later = t0 + Duration::from_secs(1);
        assert!(
            t.observe(later, &live(&[1, 2, 3]), [(7, Some(2))])
                .is_empty()
        );
        let late = t0 + Duration::from_secs(3);
        assert_eq!(
            t.observe(late, &live(&[1, 2, 3]), [(7, Some(2))]),
            vec![(7, 1)]
        );
        assert!(!t.may_ask(late, 7, 1), "backed off");
        assert!(
            t.may_ask(late, 8, 1) && t.may_ask(late, 7, 3),
            "only that pair"
        );
        let after = late + Duration::from_secs(30);
        t.observe(after, &live(&[1, 2, 3]), [(7, Some(2))]);
        assert!(t.may_ask(after, 7, 1));
    }

    #[test]
    fn a_completed_transfer_frees_the_pair() {
        let t0 = Instant::now();
        let mut t = rules();
        t.observe(t0, &live(&[1, 2]), [(7, Some(2))]);
        t.asked(t0, 7, 1);
        let done = t0 + Duration::from_millis(500);
        assert!(t.observe(done, &live(&[1, 2]), [(7, Some(1))]).is_empty());
        assert!(t.may_ask(done, 7, 1));
    }

    #[test]
    fn a_refusal_is_backed_off() {
        let t0 = Instant::now();
        let mut t = rules();
        t.refused(t0, 7, 1);
        assert!(!t.may_ask(t0 + Duration::from_secs(29), 7, 1));
        assert!(t.may_ask(t0 + Duration::from_secs(30), 7, 1));
    }

    #[test]
    fn a_returning_node_settles_before_it_is_a_target() {
        let t0 = Instant::now();
        let mut t = rules();
        // The first round marks nobody.
        t.observe(t0, &live(&[1, 2]), []);
        assert!(t.may_ask(t0, 7, 1) && t.may_ask(t0, 7, 2));
        let gone = t0 + Duration::from_secs(1);
        t.observe(gone, &live(&[2]), []);
        let back = t0 + Duration::from_secs(2);
        t.observe(back, &live(&[1, 2]), []);
        assert!(!t.may_ask(back, 7, 1), "settling");
        let settled = back + Duration::from_secs(10);
        t.observe(settled, &live(&[1, 2]), []);
        assert!(t.may_ask(settled, 7, 1));
    }
}
