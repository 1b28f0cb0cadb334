//! The processed-position tracker: the highest position below which every
//! claimed byte of a log has been written (and, for applied records, indexed).
//!
//! Writers finish out of order; each reports its finished range and the
//! tracker advances the watermark over every contiguous finished range.
//! Anything below the watermark is complete, so recovery may cut the log at
//! the first bad record without losing anything that was acknowledged.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// Spins of a waiter before it blocks (about 10–30 µs).
const SPIN_ROUNDS: u32 = 2_000;

/// Tracks the contiguous processed prefix of a log.
#[derive(Debug)]
pub(crate) struct Tracker {
    processed: AtomicU64,
    state: Mutex<Pending>,
    advanced: Condvar,
}

#[derive(Debug, Default)]
struct Pending {
    /// Finished ranges above the watermark: start -> end.
    ranges: BTreeMap<u64, u64>,
    waiters: usize,
}

impl Tracker {
    /// A tracker whose watermark starts at `start`.
    pub fn new(start: u64) -> Self {
        Self {
            processed: AtomicU64::new(start),
            state: Mutex::new(Pending::default()),
            advanced: Condvar::new(),
        }
    }

    /// The watermark: every byte below it is processed.
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Acquire)
    }

    /// Reports `[start, end)` as processed.
    pub fn done(&self, start: u64, end: u64) {
        debug_assert!(start < end);
        let mut state = self.state.lock();
        let watermark = self.processed.load(Ordering::Relaxed);
        if start != watermark {
            debug_assert!(
                start > watermark,
                "range {start}..{end} below watermark {watermark}"
            );
            state.ranges.insert(start, end);
            return;
        }
        let mut new_mark = end;
        while let Some(next_end) = state.ranges.remove(&new_mark) {
            new_mark = next_end;
        }
        self.processed.store(new_mark, Ordering::Release);
        if state.waiters > 0 {
            self.advanced.notify_all();
        }
    }

    /// Blocks until the watermark reaches `position`, or `give_up` says to
    /// stop (checked at least every 10 ms). Returns whether it was reached.
    pub fn wait_for(&self, position: u64, give_up: impl Fn() -> bool) -> bool {
        // The gap is usually another writer's copy, a microsecond or two:
        // spin briefly before paying for a sleep and a wake-up.
        for _ in 0..SPIN_ROUNDS {
            if self.processed() >= position {
                return true;
            }
            std::hint::spin_loop();
        }
        if self.processed() >= position {
            return true;
        }
        let mut state = self.state.lock();
        state.waiters += 1;
        let reached = loop {
            if self.processed.load(Ordering::Acquire) >= position {
                break true;
            }
            if give_up() {
                break false;
            }
            self.advanced
                .wait_for(&mut state, Duration::from_millis(10));
        };
        state.waiters -= 1;
        reached
    }
}

/// Nanoseconds since the first call in this process (a clock cheap to
/// keep in an atomic).
pub(crate) fn since_start() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = *START.get_or_init(std::time::Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advances_only_over_contiguous_ranges() {
        let t = Tracker::new(100);
        t.done(120, 130);
        assert_eq!(t.processed(), 100);
        t.done(100, 110);
        assert_eq!(t.processed(), 110);
        t.done(110, 120);
        assert_eq!(t.processed(), 130);
    }

    #[test]
    fn waiters_wake_when_the_gap_closes() {
        let t = Tracker::new(0);
        t.done(8, 16);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| t.wait_for(16, || false));
            std::thread::sleep(Duration::from_millis(20));
            t.done(0, 8);
            assert!(waiter.join().unwrap());
        });
        assert!(!t.wait_for(17, || true));
    }
}
