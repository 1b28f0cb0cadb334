//! Engine metrics: lock-free counters and latency histograms, read as one
//! plain [`MetricsSnapshot`] that a node exports however it likes.
//!
//! Every foreground operation adds to a few counters. Held in one place,
//! those would be cache lines that every core writes on every operation
//! (two writer threads measurably slowed each other down that way), so each
//! thread adds to its own *stripe* — a copy of every counter and histogram
//! on cache lines of its own, picked once per thread — and a snapshot sums
//! the stripes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::striped::{STRIPES, stripe_index};

/// Buckets of a latency histogram: bucket `i` counts latencies in
/// `[2^i, 2^(i+1))` nanoseconds.
const BUCKETS: usize = 40;

/// A latency histogram with power-of-two buckets.
#[derive(Debug)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Records the time since `start`.
    pub fn record_since(&self, start: Instant) {
        let ns = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        let bucket = (63 - ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The distribution of several histograms' samples together.
    fn snapshot_of<'a>(histograms: impl Iterator<Item = &'a Histogram>) -> LatencySnapshot {
        let mut counts = vec![0u64; BUCKETS];
        let mut sum_ns = 0u64;
        for h in histograms {
            for (count, bucket) in counts.iter_mut().zip(&h.buckets) {
                *count += bucket.load(Ordering::Relaxed);
            }
            sum_ns += h.sum_ns.load(Ordering::Relaxed);
        }
        let count: u64 = counts.iter().sum();
        let quantile = |q: f64| -> u64 {
            if count == 0 {
                return 0;
            }
            let rank = (q * count as f64).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, c) in counts.iter().enumerate() {
                seen += c;
                if seen >= rank {
                    // Upper bound of the bucket.
                    return (1u64 << (i + 1)).saturating_sub(1);
                }
            }
            u64::MAX
        };
        LatencySnapshot {
            count,
            sum_ns,
            p50_ns: quantile(0.50),
            p99_ns: quantile(0.99),
            p999_ns: quantile(0.999),
            buckets: counts,
        }
    }
}

/// A latency distribution (bucket upper bounds, so quantiles are rounded
/// up to the next power of two of nanoseconds).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// Operations recorded.
    pub count: u64,
    /// Sum of their latencies, nanoseconds.
    pub sum_ns: u64,
    /// Median, nanoseconds (upper bucket bound).
    pub p50_ns: u64,
    /// 99th percentile, nanoseconds (upper bucket bound).
    pub p99_ns: u64,
    /// 99.9th percentile, nanoseconds (upper bucket bound).
    pub p999_ns: u64,
    /// Counts per bucket: bucket `i` holds `[2^i, 2^(i+1))` ns.
    pub buckets: Vec<u64>,
}

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// The engine's counters.
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub $name: AtomicU64,)*
        }

        /// Counter values at one moment.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct CounterSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Counters {
            fn add_to(&self, sum: &mut CounterSnapshot) {
                $(sum.$name += self.$name.load(Ordering::Relaxed);)*
            }
        }
    };
}

counters! {
    /// Puts (single and in batches).
    puts,
    /// Deletes (single and in batches).
    deletes,
    /// Gets.
    gets,
    /// Existence checks.
    exists_checks,
    /// Atomic batches written.
    batches,
    /// Bytes of records appended to the value WAL.
    wal_bytes_written,
    /// Of those, bytes of records written through the file (`pwritev`)
    /// rather than copied into a mapping (`Config::append_pwrite_min_bytes`).
    wal_bytes_pwritten,
    /// Bytes of index blobs appended to the index log.
    index_bytes_written,
    /// Cell flushes completed (deltas and merges).
    flushes,
    /// Cell flushes that wrote a delta blob (the rest merged into a new
    /// base).
    delta_flushes,
    /// Control-region snapshots written.
    snapshots,
    /// Snapshots that found the control file already holding what they
    /// would write, and kept it.
    snapshots_unchanged,
    /// Gets served from the value cache.
    cache_hits,
    /// Gets that read the value from disk.
    cache_misses,
    /// Lookups answered "absent" by a bloom filter.
    bloom_negatives,
    /// Lookups that searched a cell's on-disk index (its blobs' filters
    /// let the key through).
    disk_lookups,
    /// Blobs searched by those lookups (base and deltas; blobs per lookup
    /// = this / disk_lookups).
    disk_lookup_blobs,
    /// Windows read by optimistic lookups (reads per lookup = this / disk_lookups).
    disk_lookup_reads,
    /// Whole cell indexes loaded into memory.
    cell_loads,
    /// Cells unloaded under memory pressure.
    cell_unloads,
    /// Index log segments deleted as garbage.
    index_segments_deleted,
    /// Index blobs copied out of mostly-garbage index segments by index
    /// log cleaning (their bytes count in `index_bytes_written`).
    index_blobs_moved,
    /// Entries copied forward by relocation and epoch drops.
    entries_relocated,
    /// Bytes of records written by relocation.
    bytes_relocated,
    /// Entries removed by a relocation filter or an epoch drop.
    entries_dropped,
    /// Value WAL segments deleted.
    segments_deleted,
    /// Bytes of value WAL segments deleted.
    bytes_reclaimed,
    /// Relocation passes run.
    relocation_passes,
    /// Segments in which relocation met a live value it could not read
    /// (corrupt, or an I/O error), once each since the engine opened: kept,
    /// and no longer background candidates.
    unreadable_values,
    /// Entries touched into the current epoch.
    touches,
}

/// One thread's copy of the counters and histograms, on cache lines of its
/// own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe {
    counters: Counters,
    put_latency: Histogram,
    get_latency: Histogram,
}

/// All metrics of an engine.
#[derive(Debug)]
pub(crate) struct Metrics {
    stripes: Box<[Stripe]>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
        }
    }
}

/// Everything the engine measures, at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Counters.
    pub counters: CounterSnapshot,
    /// Latency of puts, deletes and batches (until durable as requested).
    pub write_latency: LatencySnapshot,
    /// Latency of gets.
    pub read_latency: LatencySnapshot,
    /// Bytes the in-memory index holds.
    pub index_memory_bytes: u64,
    /// Bytes the value cache holds.
    pub cache_bytes: u64,
    /// The value WAL's processed watermark.
    pub wal_processed: u64,
    /// The value WAL's synced watermark.
    pub wal_synced: u64,
    /// Bytes of sealed value WAL segments whose pages were dropped from the
    /// page cache once synced (`Config::wal_cached_bytes`).
    pub wal_released_bytes: u64,
    /// Number of cells in each state, in the order Empty, Loaded,
    /// DirtyLoaded, Unloaded, DirtyUnloaded.
    pub cell_states: [u64; 5],
    /// Live and total bytes of each WAL segment, as of the last census.
    pub segments: Vec<crate::relocation::SegmentUsage>,
    /// Relocation lag: garbage bytes in sealed segments as of the last
    /// census — space relocation has yet to give back.
    pub relocation_lag_bytes: u64,
    /// Bytes of index blob records the cells reference.
    pub index_live_bytes: u64,
    /// Bytes of sealed index log segments no cell references: space index
    /// garbage collection and cleaning give back.
    pub index_garbage_bytes: u64,
}

impl Metrics {
    pub fn add(counter: &AtomicU64, n: u64) {
        if n > 0 {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The calling thread's counters.
    pub fn counters(&self) -> &Counters {
        &self.stripes[stripe_index()].counters
    }

    /// The calling thread's histogram of write latencies.
    pub fn put_latency(&self) -> &Histogram {
        &self.stripes[stripe_index()].put_latency
    }

    /// The calling thread's histogram of read latencies.
    pub fn get_latency(&self) -> &Histogram {
        &self.stripes[stripe_index()].get_latency
    }

    /// Counters and histograms, summed over the stripes (the engine fills
    /// in the gauges).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut counters = CounterSnapshot::default();
        for stripe in self.stripes.iter() {
            stripe.counters.add_to(&mut counters);
        }
        MetricsSnapshot {
            counters,
            write_latency: Histogram::snapshot_of(self.stripes.iter().map(|s| &s.put_latency)),
            read_latency: Histogram::snapshot_of(self.stripes.iter().map(|s| &s.get_latency)),
            ..MetricsSnapshot::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_buckets() {
        let h = Histogram::default();
        for bucket in [10usize, 10, 10, 20] {
            h.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        }
        let s = Histogram::snapshot_of([&h].into_iter());
        assert_eq!(s.count, 4);
        assert_eq!(s.p50_ns, (1 << 11) - 1);
        assert_eq!(s.p999_ns, (1 << 21) - 1);
    }

    #[test]
    fn a_snapshot_sums_every_threads_stripe() {
        let metrics = Metrics::default();
        std::thread::scope(|s| {
            for _ in 0..STRIPES + 3 {
                s.spawn(|| {
                    Metrics::add(&metrics.counters().gets, 2);
                    metrics.get_latency().record_since(Instant::now());
                });
            }
        });
        let snapshot = metrics.snapshot();
        assert_eq!(snapshot.counters.gets, 2 * (STRIPES as u64 + 3));
        assert_eq!(snapshot.read_latency.count, STRIPES as u64 + 3);
    }
}
