//! Per-thread stripes for state that every foreground operation touches:
//! a counter and a reader-writer lock whose readers never write a cache
//! line another thread's readers write. Threads take stripes in turn
//! ([`stripe_index`]); a reader or adder touches its own stripe, and the
//! rare whole-value reader or writer visits them all.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Stripes per striped value: threads beyond this share stripes (correct,
/// just slower when they run at once).
pub(crate) const STRIPES: usize = 8;

/// The stripe of the calling thread.
pub(crate) fn stripe_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    MINE.with(|i| *i)
}

/// A value on cache lines of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

/// A sum that many threads add to: each adds to its own stripe.
#[derive(Debug)]
pub(crate) struct StripedCounter {
    stripes: Box<[Padded<AtomicI64>]>,
}

impl Default for StripedCounter {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Padded::default()).collect(),
        }
    }
}

impl StripedCounter {
    /// Adds `delta` (negative to subtract).
    pub fn add(&self, delta: i64) {
        if delta != 0 {
            self.stripes[stripe_index()]
                .0
                .fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// The sum of all stripes.
    pub fn sum(&self) -> i64 {
        self.stripes
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .sum()
    }
}

/// A reader-writer lock for many frequent readers and a rare writer:
/// a reader locks its thread's stripe; the writer locks every stripe, in
/// order.
#[derive(Debug)]
pub(crate) struct StripedRwLock {
    stripes: Box<[Padded<RwLock<()>>]>,
}

/// The writer's hold on every stripe.
pub(crate) struct WriteGuard<'a> {
    _held: Vec<RwLockWriteGuard<'a, ()>>,
}

impl Default for StripedRwLock {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Padded::default()).collect(),
        }
    }
}

impl StripedRwLock {
    /// Shared access: excludes the writer only.
    pub fn read(&self) -> RwLockReadGuard<'_, ()> {
        self.stripes[stripe_index()].0.read()
    }

    /// Exclusive access: waits for every reader of every stripe.
    pub fn write(&self) -> WriteGuard<'_> {
        WriteGuard {
            _held: self.stripes.iter().map(|s| s.0.write()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_sum_counts_every_threads_additions() {
        let counter = StripedCounter::default();
        std::thread::scope(|s| {
            for t in 0..STRIPES as i64 + 5 {
                let counter = &counter;
                s.spawn(move || {
                    for _ in 0..1000 {
                        counter.add(t);
                    }
                    counter.add(-1);
                });
            }
        });
        let n = STRIPES as i64 + 5;
        assert_eq!(counter.sum(), 1000 * n * (n - 1) / 2 - n);
    }

    #[test]
    fn the_writer_excludes_readers_of_every_stripe() {
        let lock = StripedRwLock::default();
        let writing = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..STRIPES + 2 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let _read = lock.read();
                        assert!(!writing.load(Ordering::SeqCst), "a reader met the writer");
                    }
                });
            }
            s.spawn(|| {
                for _ in 0..50 {
                    let _write = lock.write();
                    writing.store(true, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_micros(50));
                    writing.store(false, Ordering::SeqCst);
                }
            });
        });
    }
}
