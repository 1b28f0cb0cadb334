//! One memory budget for every engine of a node: the in-memory index of all
//! of them counts against one limit, and their values share one cache, so
//! memory follows the data and the hot set rather than the number of
//! engines (`docs/design/scale-out.md`, "One memory budget per node").
//!
//! - **Index.** Each engine's table adds what its cells hold (loaded
//!   entries, unflushed changes, bloom filters) to the node's count as well
//!   as to its own. A lookup loads a cell whole only if the node's count
//!   stays within the limit; otherwise it searches the cell's blobs on
//!   disk, and the refusal is remembered. Each engine's maintenance round
//!   unloads its cells not used since its last round (a clock) while the
//!   node is over the limit or the loads refused since the last time room
//!   was made would not fit, so memory moves from idle cells to the ones
//!   being read; if that is not
//!   enough it queues its unflushed cells for flushing, which turns changes
//!   into blobs that need no memory.
//! - **Values.** One least-recently-used cache keyed by engine and
//!   location.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cache::ValueCache;
use crate::striped::StripedCounter;

/// Memory that engines share. Cloning gives another handle on the same
/// budget; an engine opened alone ([`crate::Engine::open`]) gets one of its
/// own from its configuration.
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    index_limit: u64,
    index_used: StripedCounter,
    /// Bytes of cell loads refused for want of room since room was last
    /// made: maintenance unloads idle cells until they would fit, so that
    /// memory moves to the cells being read. At most a sixteenth of the
    /// limit: the same cell refused again and again counts each time, and
    /// room is made a round at a time rather than by emptying the index.
    refused: AtomicU64,
    cache: Arc<ValueCache>,
}

impl MemoryBudget {
    /// At most `index_bytes` of in-memory index and `cache_bytes` of cached
    /// values (0 disables the cache), for all engines opened with it.
    pub fn new(index_bytes: u64, cache_bytes: u64) -> Self {
        Self {
            shared: Arc::new(Shared {
                index_limit: index_bytes,
                index_used: StripedCounter::default(),
                refused: AtomicU64::new(0),
                cache: Arc::new(ValueCache::new(cache_bytes)),
            }),
        }
    }

    /// The index limit, bytes.
    pub fn index_limit(&self) -> u64 {
        self.shared.index_limit
    }

    /// Bytes the in-memory indexes of all its engines hold.
    pub fn index_bytes(&self) -> u64 {
        self.shared.index_used.sum().max(0) as u64
    }

    /// The value cache's budget, bytes.
    pub fn cache_limit(&self) -> u64 {
        self.shared.cache.budget()
    }

    /// Bytes the value cache holds (values plus bookkeeping).
    pub fn cache_bytes(&self) -> u64 {
        self.shared.cache.bytes()
    }

    /// Whether the indexes would exceed the limit with `extra` bytes more.
    pub(crate) fn index_over(&self, extra: u64) -> bool {
        self.index_bytes().saturating_add(extra) > self.shared.index_limit
    }

    /// Records a load of `bytes` refused by the limit.
    pub(crate) fn refuse_load(&self, bytes: u64) {
        let most = self.shared.index_limit / 16;
        let _ = self
            .shared
            .refused
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                Some(r.saturating_add(bytes).min(most))
            });
    }

    /// Whether the indexes need to give memory back: they are over the
    /// limit, or the loads refused since room was last made would not fit.
    pub(crate) fn index_pressed(&self) -> bool {
        let refused = self.shared.refused.load(Ordering::Relaxed);
        if !self.index_over(refused) {
            // Room made (or never wanted): forget the refusal.
            if refused > 0 {
                let _ = self.shared.refused.compare_exchange(
                    refused,
                    0,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            return false;
        }
        true
    }

    pub(crate) fn account_index(&self, delta: i64) {
        self.shared.index_used.add(delta);
    }

    pub(crate) fn cache(&self) -> &Arc<ValueCache> {
        &self.shared.cache
    }
}

/// What the engines of a node share: the pool their background work runs
/// in, and their memory budget.
#[derive(Clone, Debug)]
pub struct Host {
    /// Runs every engine's background tasks.
    pub pool: crate::pool::WorkerPool,
    /// Bounds every engine's index and value cache together.
    pub memory: MemoryBudget,
}
