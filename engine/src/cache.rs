//! The value cache: least-recently-used values under a byte budget, keyed by
//! engine and WAL location. Every engine of a node shares one cache
//! ([`crate::MemoryBudget`]), so its memory goes to the values read most,
//! whichever replica holds them. Bytes at a location never change, so
//! entries never go stale; a relocated or deleted value, or one of an
//! engine that was closed, simply stops being asked for and ages out (an
//! engine's tag is never reused).
//!
//! Admission: a value of [`LARGE_BYTES`] or more is cached only when it is
//! read a second time while its first read is still remembered (the last
//! [`SEEN_PER_SHARD`] large misses of each shard). A large value read once
//! — a scan, a stream of new blobs — would otherwise take fresh memory for
//! every read and push out what is read often; its pages are in the page
//! cache anyway, and its read buffer goes back to `crate::buffers`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;

const SHARDS: usize = 16;
/// Values this large are cached on their second read (see the module docs).
pub(crate) const LARGE_BYTES: usize = crate::buffers::MIN_BYTES;
/// Large values whose first read a shard remembers.
const SEEN_PER_SHARD: usize = 4096;
const NIL: usize = usize::MAX;
/// Per-entry bookkeeping counted against the budget.
const ENTRY_OVERHEAD_BYTES: usize = 64;

/// An engine's tag and a WAL location of that engine.
type CacheKey = (u64, u64);

#[derive(Debug)]
struct Node {
    key: CacheKey,
    value: Bytes,
    /// The bytes its engine holds in the cache (per-engine metrics).
    owner: Arc<AtomicI64>,
    prev: usize,
    next: usize,
}

/// One shard: a hash map into a doubly linked list stored in a slab.
#[derive(Debug)]
struct Shard {
    map: HashMap<CacheKey, usize>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
    bytes: usize,
    budget: usize,
    /// Large values read once and not cached, oldest first.
    seen: std::collections::VecDeque<CacheKey>,
    seen_set: std::collections::HashSet<CacheKey>,
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
            seen: std::collections::VecDeque::new(),
            seen_set: std::collections::HashSet::new(),
        }
    }

    /// Whether a large value read now may be cached: its second read while
    /// the first is remembered; a first read is remembered instead.
    fn admit_large(&mut self, key: CacheKey) -> bool {
        if self.seen_set.remove(&key) {
            return true;
        }
        if self.seen.len() >= SEEN_PER_SHARD
            && let Some(oldest) = self.seen.pop_front()
        {
            self.seen_set.remove(&oldest);
        }
        // A key whose entry was taken above is still queued: harmless (a
        // stale queue entry only ages out, removing nothing or a re-added
        // key early).
        self.seen.push_back(key);
        self.seen_set.insert(key);
        false
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

    fn get(&mut self, key: CacheKey) -> Option<Bytes> {
        let i = *self.map.get(&key)?;
        self.unlink(i);
        self.push_front(i);
        Some(self.nodes[i].value.clone())
    }

    fn insert(&mut self, key: CacheKey, value: Bytes, owner: &Arc<AtomicI64>) {
        let cost = value.len() + ENTRY_OVERHEAD_BYTES;
        if cost > self.budget || self.map.contains_key(&key) {
            return;
        }
        if value.len() >= LARGE_BYTES && !self.admit_large(key) {
            return;
        }
        while self.bytes + cost > self.budget && self.tail != NIL {
            self.evict_tail();
        }
        owner.fetch_add(cost as i64, Ordering::Relaxed);
        let node = Node {
            key,
            value,
            owner: owner.clone(),
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
        self.map.insert(key, i);
        self.bytes += cost;
    }

    fn evict_tail(&mut self) {
        let i = self.tail;
        self.unlink(i);
        let node = &mut self.nodes[i];
        self.map.remove(&node.key);
        let cost = node.value.len() + ENTRY_OVERHEAD_BYTES;
        self.bytes -= cost;
        node.owner.fetch_sub(cost as i64, Ordering::Relaxed);
        node.value = Bytes::new();
        self.free.push(i);
    }
}

/// A sharded LRU cache of values, shared by the engines of a node.
#[derive(Debug)]
pub(crate) struct ValueCache {
    shards: Vec<Mutex<Shard>>,
    budget: u64,
}

impl ValueCache {
    /// A cache of at most `budget_bytes` (values plus bookkeeping).
    pub fn new(budget_bytes: u64) -> Self {
        let per_shard = (budget_bytes as usize) / SHARDS;
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Shard::new(per_shard)))
                .collect(),
            budget: budget_bytes,
        }
    }

    fn shard(&self, (tag, location): CacheKey) -> &Mutex<Shard> {
        // Locations are 8-aligned and sequential: mix before picking a shard.
        let mixed = ((location >> 3) ^ tag.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        &self.shards[(mixed >> 60) as usize % SHARDS]
    }

    /// The budget, bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes held (values plus bookkeeping).
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().bytes as u64).sum()
    }
}

/// One engine's view of its node's value cache.
#[derive(Debug)]
pub(crate) struct EngineCache {
    shared: Arc<ValueCache>,
    /// Tells this engine's entries from every other engine's, past or
    /// present.
    tag: u64,
    /// Bytes this engine's entries take.
    bytes: Arc<AtomicI64>,
}

impl EngineCache {
    /// A new engine's view of `shared`.
    pub fn new(shared: Arc<ValueCache>) -> Self {
        static NEXT_TAG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            shared,
            tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed),
            bytes: Arc::new(AtomicI64::new(0)),
        }
    }

    /// The cached value at `location`, marking it recently used.
    pub fn get(&self, location: u64) -> Option<Bytes> {
        if self.shared.budget == 0 {
            return None;
        }
        let key = (self.tag, location);
        self.shared.shard(key).lock().get(key)
    }

    /// Caches a value, evicting the node's least recently used as needed.
    pub fn insert(&self, location: u64, value: Bytes) {
        if self.shared.budget > 0 {
            let key = (self.tag, location);
            self.shared
                .shard(key)
                .lock()
                .insert(key, value, &self.bytes);
        }
    }

    /// Bytes this engine's values take in the cache (values plus
    /// bookkeeping).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let owner = Arc::new(AtomicI64::new(0));
        let mut shard = Shard::new(3 * (100 + ENTRY_OVERHEAD_BYTES));
        for location in 0..3 {
            shard.insert(
                (1, location),
                Bytes::from(vec![location as u8; 100]),
                &owner,
            );
        }
        assert!(shard.get((1, 0)).is_some()); // 0 is now most recent
        shard.insert((1, 3), Bytes::from(vec![3; 100]), &owner);
        assert!(shard.get((1, 1)).is_none(), "1 was least recently used");
        assert!(
            shard.get((1, 0)).is_some()
                && shard.get((1, 2)).is_some()
                && shard.get((1, 3)).is_some()
        );
        assert!(shard.bytes <= shard.budget);
        assert_eq!(owner.load(Ordering::Relaxed) as usize, shard.bytes);
    }

    #[test]
    fn oversized_values_are_not_cached_and_budget_holds() {
        let cache = EngineCache::new(Arc::new(ValueCache::new(16 * 1024)));
        cache.insert(8, Bytes::from(vec![0; 4096]));
        assert!(cache.get(8).is_none(), "larger than a shard's budget");
        for location in 0..10_000u64 {
            cache.insert(location * 8, Bytes::from(vec![1; 10]));
        }
        assert!(cache.shared.bytes() <= 16 * 1024);
        assert_eq!(cache.bytes(), cache.shared.bytes());
        assert!(cache.get(9_999 * 8).is_some());
    }

    #[test]
    fn a_large_value_is_cached_on_its_second_read() {
        let cache = EngineCache::new(Arc::new(ValueCache::new(64 << 20)));
        let large = || Bytes::from(vec![5; LARGE_BYTES]);
        cache.insert(8, large());
        assert!(cache.get(8).is_none(), "read once: not cached");
        cache.insert(8, large());
        assert_eq!(cache.get(8).unwrap(), large(), "read again: cached");
        // Small values at once.
        cache.insert(16, Bytes::from(vec![6; LARGE_BYTES - 1]));
        assert!(cache.get(16).is_some());
        // A first read forgotten (many large reads since) counts as new.
        cache.insert(24, large());
        for location in 100..100 + (SHARDS * SEEN_PER_SHARD * 2) as u64 {
            cache.insert(location * 8, Bytes::from(vec![7; LARGE_BYTES]));
        }
        cache.insert(24, large());
        assert!(cache.get(24).is_none(), "its first read was forgotten");
        let shard = cache.shared.shard((cache.tag, 24)).lock();
        assert!(shard.seen.len() <= SEEN_PER_SHARD);
        assert!(shard.seen_set.len() <= SEEN_PER_SHARD);
    }

    #[test]
    fn engines_share_one_budget_and_never_see_each_others_values() {
        let shared = Arc::new(ValueCache::new(64 * 1024));
        let (a, b) = (
            EngineCache::new(shared.clone()),
            EngineCache::new(shared.clone()),
        );
        a.insert(8, Bytes::from_static(b"a's value"));
        assert!(b.get(8).is_none(), "same location, another engine");
        b.insert(8, Bytes::from_static(b"b's value"));
        assert_eq!(a.get(8).unwrap(), &b"a's value"[..]);
        assert_eq!(b.get(8).unwrap(), &b"b's value"[..]);
        // b's reads push a's cold values out: the budget is the node's.
        for location in 1..5_000u64 {
            b.insert(location * 8, Bytes::from(vec![2; 100]));
        }
        assert!(shared.bytes() <= 64 * 1024);
        assert!(a.get(8).is_none(), "a's value was the least recently used");
        assert_eq!(a.bytes(), 0);
        assert_eq!(b.bytes(), shared.bytes());
        // A closed engine's entries age out; a new engine never sees them.
        drop(b);
        let c = EngineCache::new(shared.clone());
        assert!(c.get(4_999 * 8).is_none());
    }
}
