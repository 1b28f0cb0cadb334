//! The value cache: least-recently-used values under a byte budget, keyed by
//! WAL location. Bytes at a location never change, so entries never go
//! stale; a relocated or deleted value simply stops being asked for and
//! ages out.

use std::collections::HashMap;

use bytes::Bytes;
use parking_lot::Mutex;

const SHARDS: usize = 16;
const NIL: usize = usize::MAX;
/// Per-entry bookkeeping counted against the budget.
const ENTRY_OVERHEAD_BYTES: usize = 64;

#[derive(Debug)]
struct Node {
    location: u64,
    value: Bytes,
    prev: usize,
    next: usize,
}

/// One shard: a hash map into a doubly linked list stored in a slab.
#[derive(Debug)]
struct Shard {
    map: HashMap<u64, usize>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
    bytes: usize,
    budget: usize,
}

impl Shard {
    fn new(budget: usize) -> Self {
        Self {
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            bytes: 0,
            budget,
        }
    }

    fn unlink(&mut self, i: usize) {
        let (prev, next) = (self.nodes[i].prev, self.nodes[i].next);
        if prev == NIL {
            self.head = next
        } else {
            self.nodes[prev].next = next
        }
        if next == NIL {
            self.tail = prev
        } else {
            self.nodes[next].prev = prev
        }
    }

    fn push_front(&mut self, i: usize) {
        self.nodes[i].prev = NIL;
        self.nodes[i].next = self.head;
        if self.head != NIL {
            self.nodes[self.head].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn get(&mut self, location: u64) -> Option<Bytes> {
        let i = *self.map.get(&location)?;
        self.unlink(i);
        self.push_front(i);
        Some(self.nodes[i].value.clone())
    }

    fn insert(&mut self, location: u64, value: Bytes) {
        let cost = value.len() + ENTRY_OVERHEAD_BYTES;
        if cost > self.budget || self.map.contains_key(&location) {
            return;
        }
        while self.bytes + cost > self.budget && self.tail != NIL {
            self.evict_tail();
        }
        let node = Node {
            location,
            value,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.push_front(i);
        self.map.insert(location, i);
        self.bytes += cost;
    }

    fn evict_tail(&mut self) {
        let i = self.tail;
        self.unlink(i);
        let node = &mut self.nodes[i];
        self.map.remove(&node.location);
        self.bytes -= node.value.len() + ENTRY_OVERHEAD_BYTES;
        node.value = Bytes::new();
        self.free.push(i);
    }
}

/// A sharded LRU cache of values.
#[derive(Debug)]
pub(crate) struct ValueCache {
    shards: Vec<Mutex<Shard>>,
    enabled: bool,
}

impl ValueCache {
    /// A cache of at most `budget_bytes` (values plus bookkeeping).
    pub fn new(budget_bytes: u64) -> Self {
        let per_shard = (budget_bytes as usize) / SHARDS;
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Shard::new(per_shard)))
                .collect(),
            enabled: budget_bytes > 0,
        }
    }

    fn shard(&self, location: u64) -> &Mutex<Shard> {
        // Locations are 8-aligned and sequential: mix before picking a shard.
        let mixed = (location >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        &self.shards[(mixed >> 60) as usize % SHARDS]
    }

    /// The cached value at `location`, marking it recently used.
    pub fn get(&self, location: u64) -> Option<Bytes> {
        if !self.enabled {
            return None;
        }
        self.shard(location).lock().get(location)
    }

    /// Caches a value, evicting the least recently used as needed.
    pub fn insert(&self, location: u64, value: Bytes) {
        if self.enabled {
            self.shard(location).lock().insert(location, value);
        }
    }

    /// Bytes held (values plus bookkeeping).
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().bytes as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let mut shard = Shard::new(3 * (100 + ENTRY_OVERHEAD_BYTES));
        for location in 0..3 {
            shard.insert(location, Bytes::from(vec![location as u8; 100]));
        }
        assert!(shard.get(0).is_some()); // 0 is now most recent
        shard.insert(3, Bytes::from(vec![3; 100]));
        assert!(shard.get(1).is_none(), "1 was least recently used");
        assert!(shard.get(0).is_some() && shard.get(2).is_some() && shard.get(3).is_some());
        assert!(shard.bytes <= shard.budget);
    }

    #[test]
    fn oversized_values_are_not_cached_and_budget_holds() {
        let cache = ValueCache::new(16 * 1024);
        cache.insert(8, Bytes::from(vec![0; 4096]));
        assert!(cache.get(8).is_none(), "larger than a shard's budget");
        for location in 0..10_000u64 {
            cache.insert(location * 8, Bytes::from(vec![1; 10]));
        }
        assert!(cache.bytes() <= 16 * 1024);
        assert!(cache.get(9_999 * 8).is_some());
    }
}
