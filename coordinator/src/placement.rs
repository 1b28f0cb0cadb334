//! Placement: where each shard's replicas should live. Pure functions over
//! a snapshot of the nodes and the current placement; the reconciler turns
//! the difference into membership changes.
//!
//! Rules, in priority order:
//! 1. every shard has `min(R, eligible nodes)` replicas on distinct,
//!    eligible nodes (live, not draining);
//! 2. a shard's replicas sit in `min(R, zones with eligible nodes)`
//!    distinct zones;
//! 3. replica counts are balanced across nodes (ties broken by the lower
//!    disk-usage fraction, then the lower id);
//! 4. movement is minimal: a replica on an eligible node stays unless
//!    moving it fixes rule 2 or narrows a count gap of two or more.
//!
//! A (shard, node) pair may be barred ([`place_barring`]): the shard gets
//! no replica on that node, as if the node were not eligible for it alone
//! (a replica there whose files are gone, until it is closed).

use std::collections::{BTreeMap, BTreeSet};

/// What placement knows of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    /// Node id.
    pub id: u64,
    /// Failure domain (Kubernetes zone, rack…); "" if unknown.
    pub zone: String,
    /// Bytes of its data volume.
    pub capacity_bytes: u64,
    /// Bytes used on it.
    pub used_bytes: u64,
    /// Heard from within the liveness grace period.
    pub live: bool,
    /// Being drained: replicas move off it.
    pub draining: bool,
}

impl NodeView {
    fn eligible(&self) -> bool {
        self.live && !self.draining
    }

    /// Used fraction in millionths (0 when the capacity is unknown).
    fn fullness(&self) -> u64 {
        if self.capacity_bytes == 0 {
            return 0;
        }
        (u128::from(self.used_bytes) * 1_000_000 / u128::from(self.capacity_bytes)) as u64
    }
}

/// Replicas of each shard: shard id → node ids.
pub type Placement = BTreeMap<u32, BTreeSet<u64>>;

/// Moves allowed in one rebalancing pass per replica placed (bounds the
/// work; each move strictly narrows a gap, so it terminates anyway).
const MAX_BALANCE_MOVES: usize = 4;

struct Planner<'a> {
    nodes: BTreeMap<u64, &'a NodeView>,
    counts: BTreeMap<u64, usize>,
    placement: Placement,
    barred: &'a BTreeSet<(u32, u64)>,
}

impl<'a> Planner<'a> {
    fn zone(&self, node: u64) -> &str {
        &self.nodes[&node].zone
    }

    fn zones_of(&self, replicas: &BTreeSet<u64>) -> BTreeSet<&str> {
        replicas.iter().map(|n| self.zone(*n)).collect()
    }

    /// Preference order: fewer replicas, emptier disk, lower id.
    fn rank(&self, node: u64) -> (usize, u64, u64) {
        (self.counts[&node], self.nodes[&node].fullness(), node)
    }

    /// Whether `shard` may have a replica on `node` (an eligible one).
    fn allowed(&self, shard: u32, node: u64) -> bool {
        !self.barred.contains(&(shard, node))
    }

    /// The best node to add to `shard`'s `replicas`: in a new zone if there
    /// is one.
    fn best_addition(&self, shard: u32, replicas: &BTreeSet<u64>) -> Option<u64> {
        let used = self.zones_of(replicas);
        let candidates = self
            .nodes
            .keys()
            .copied()
            .filter(|n| !replicas.contains(n) && self.allowed(shard, *n));
        candidates.min_by_key(|n| (used.contains(self.zone(*n)), self.rank(*n)))
    }

    fn add(&mut self, shard: u32, node: u64) {
        self.placement.entry(shard).or_default().insert(node);
        *self.counts.get_mut(&node).expect("eligible") += 1;
    }

    fn remove(&mut self, shard: u32, node: u64) {
        self.placement.entry(shard).or_default().remove(&node);
        *self.counts.get_mut(&node).expect("eligible") -= 1;
    }

    /// Replaces a replica that shares its zone with another one of the
    /// same shard by one in an unused zone, where such a node exists.
    fn spread_zones(&mut self, shard: u32) -> bool {
        let replicas = self.placement[&shard].clone();
        let used = self.zones_of(&replicas);
        let mut per_zone: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for n in &replicas {
            per_zone.entry(self.zone(*n)).or_default().push(*n);
        }
        let Some(crowded) = per_zone
            .values()
            .filter(|v| v.len() > 1)
            .flat_map(|v| v.iter().copied())
            .max_by_key(|n| self.rank(*n))
        else {
            return false;
        };
        let target = self
            .nodes
            .keys()
            .copied()
            .filter(|n| !used.contains(self.zone(*n)) && self.allowed(shard, *n))
            .min_by_key(|n| self.rank(*n));
        match target {
            Some(target) => {
                self.remove(shard, crowded);
                self.add(shard, target);
                true
            }
            None => false,
        }
    }

    /// A shard `from` holds and `to` does not, that may move to `to`
    /// without its zone count dropping.
    fn movable(&self, from: u64, to: u64) -> Option<u32> {
        self.placement
            .iter()
            .filter(|(s, r)| r.contains(&from) && !r.contains(&to) && self.allowed(**s, to))
            .map(|(s, _)| *s)
            .find(|shard| {
                let replicas = &self.placement[shard];
                let mut after = replicas.clone();
                after.remove(&from);
                after.insert(to);
                self.zones_of(&after).len() >= self.zones_of(replicas).len()
            })
    }

    fn shift(&mut self, shard: u32, from: u64, to: u64) {
        self.remove(shard, from);
        self.add(shard, to);
    }

    /// One move from the fullest node to a node with at least two fewer
    /// replicas, keeping the shard's zone spread; or, where no shard of the
    /// fullest node can go there without its zone count dropping, two:
    /// a third node gives one of its shards to the emptier node and takes
    /// one of the fuller node's (with two zones, a node whose every shard
    /// has it as its one replica in its zone could not give any of them to
    /// the other zone, and the counts stayed two apart). Returns whether it
    /// moved.
    fn balance_once(&mut self) -> bool {
        let mut by_load: Vec<u64> = self.nodes.keys().copied().collect();
        by_load.sort_by_key(|n| std::cmp::Reverse(self.rank(*n)));
        let mut pairs = Vec::new();
        for &from in &by_load {
            let mut targets: Vec<u64> = self
                .nodes
                .keys()
                .copied()
                .filter(|t| self.counts[t] + 2 <= self.counts[&from])
                .collect();
            targets.sort_by_key(|t| self.rank(*t));
            for to in targets {
                if let Some(shard) = self.movable(from, to) {
                    self.shift(shard, from, to);
                    return true;
                }
                pairs.push((from, to));
            }
        }
        let middles: Vec<u64> = self.nodes.keys().copied().collect();
        for (from, to) in pairs {
            for &middle in &middles {
                if middle == from || middle == to {
                    continue;
                }
                let Some(first) = self.movable(middle, to) else {
                    continue;
                };
                self.shift(first, middle, to);
                if let Some(second) = self.movable(from, middle) {
                    self.shift(second, from, middle);
                    return true;
                }
                self.shift(first, to, middle);
            }
        }
        false
    }
}

/// The desired placement of `shards` with `replication` replicas each,
/// given the nodes and the current placement.
pub fn place(
    nodes: &[NodeView],
    current: &Placement,
    shards: &[u32],
    replication: usize,
) -> Placement {
    place_barring(nodes, current, shards, replication, &BTreeSet::new())
}

/// [`place`], with no replica of a shard on a node where `barred` holds
/// the pair (shard, node): such a shard gets its replicas on the other
/// eligible nodes, fewer if there are not enough.
pub fn place_barring(
    nodes: &[NodeView],
    current: &Placement,
    shards: &[u32],
    replication: usize,
    barred: &BTreeSet<(u32, u64)>,
) -> Placement {
    let eligible: BTreeMap<u64, &NodeView> = nodes
        .iter()
        .filter(|n| n.eligible())
        .map(|n| (n.id, n))
        .collect();
    let mut planner = Planner {
        counts: eligible.keys().map(|id| (*id, 0)).collect(),
        nodes: eligible,
        placement: Placement::new(),
        barred,
    };
    // Keep what may stay.
    for &shard in shards {
        planner.placement.insert(shard, BTreeSet::new());
        let kept: Vec<u64> = current
            .get(&shard)
            .into_iter()
            .flatten()
            .copied()
            .filter(|n| planner.nodes.contains_key(n) && planner.allowed(shard, *n))
            .take(replication)
            .collect();
        for node in kept {
            planner.add(shard, node);
        }
    }
    // Fill the gaps, the emptiest shards first (a shard barred from the
    // nodes it lacks stays short).
    let want = replication.min(planner.nodes.len());
    let mut stuck = BTreeSet::new();
    loop {
        let short = shards
            .iter()
            .copied()
            .filter(|s| planner.placement[s].len() < want && !stuck.contains(s))
            .min_by_key(|s| (planner.placement[s].len(), *s));
        let Some(shard) = short else { break };
        match planner.best_addition(shard, &planner.placement[&shard]) {
            Some(node) => planner.add(shard, node),
            None => {
                stuck.insert(shard);
            }
        }
    }
    for &shard in shards {
        while planner.spread_zones(shard) {}
    }
    let budget = MAX_BALANCE_MOVES * (shards.len() * want).max(1);
    for _ in 0..budget {
        if !planner.balance_once() {
            break;
        }
    }
    let mut placement = planner.placement;
    // A draining node that is live keeps the copies no eligible node can
    // take: a drain moves replicas, it never leaves a shard with fewer
    // than `replication` of them. Before, a shard wanted only as many
    // replicas as there were eligible nodes, and a drain with a node down
    // deleted good copies down to one (the drain now waits for a node).
    let draining: BTreeSet<u64> = nodes
        .iter()
        .filter(|n| n.live && n.draining)
        .map(|n| n.id)
        .collect();
    for &shard in shards {
        let desired = placement.entry(shard).or_default();
        for node in current.get(&shard).into_iter().flatten() {
            if desired.len() >= replication {
                break;
            }
            if draining.contains(node) && !barred.contains(&(shard, *node)) {
                desired.insert(*node);
            }
        }
    }
    placement
}

/// Replicas that `desired` adds or removes relative to `current`.
pub fn moves(current: &Placement, desired: &Placement) -> usize {
    let empty = BTreeSet::new();
    desired
        .iter()
        .map(|(shard, replicas)| {
            let before = current.get(shard).unwrap_or(&empty);
            replicas.difference(before).count()
        })
        .sum()
}
