//! How busy a replica is, for splits by load (`docs/design/splits.md`):
//! the requests the node routed to it per second, and where in its hash
//! range a cut would divide its recent requests most evenly.
//!
//! Recording is an atomic increment plus, when its lock is free, one slot
//! of a ring of recent hash positions; the owner turns the count into a
//! moving average about once a second ([`Load::observe`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Recent hash positions kept for choosing a cut.
const RECENT: usize = 512;

/// Fewer recent positions than this give no cut (too few to judge).
const MIN_SAMPLES: usize = 64;

/// A cut leaving more than this share of the recent requests on one side
/// is no cut: the load sits on a few hash positions (a hot key), and
/// splitting would move it, not spread it.
const MAX_SIDE_SHARE: f64 = 0.75;

/// The moving average's time constant.
const WINDOW: Duration = Duration::from_secs(5);

/// The average is updated at most this often.
const OBSERVE_EVERY: Duration = Duration::from_secs(1);

/// What [`Load::observe`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Requests per second, averaged over about five seconds.
    pub requests_per_second: f64,
    /// The first hash position of the upper half of the most even cut of
    /// the recent requests within the range (`None`: too few, or no cut
    /// leaves both sides at most three quarters).
    pub split_at: Option<u64>,
}

#[derive(Debug)]
struct Recent {
    positions: Vec<u64>,
    next: usize,
}

#[derive(Debug, Default)]
struct Average {
    at: Option<Instant>,
    counted: u64,
    range: Option<(u64, u64)>,
    report: LoadReport,
}

/// Counts a replica's requests (shared by the node's request handlers and
/// the replica's owner).
#[derive(Debug)]
pub struct Load {
    requests: AtomicU64,
    recent: Mutex<Recent>,
    average: Mutex<Average>,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            recent: Mutex::new(Recent {
                positions: Vec::with_capacity(RECENT),
                next: 0,
            }),
            average: Mutex::new(Average::default()),
        }
    }
}

impl Load {
    /// Counts a request for the key at hash `position`.
    pub fn record(&self, position: u64) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        // A position lost to a busy lock only thins the sample.
        if let Some(mut recent) = self.recent.try_lock() {
            if recent.positions.len() < RECENT {
                recent.positions.push(position);
            } else {
                let slot = recent.next;
                recent.positions[slot] = position;
            }
            recent.next = (recent.next + 1) % RECENT;
        }
    }

    /// The load at `now` of a replica owning `range` (`None`: the whole
    /// ring). Updates the average if a second passed since the last
    /// update; a changed range starts it again from zero (the requests
    /// before a split were partly the other side's).
    pub fn observe(&self, now: Instant, range: Option<(u64, u64)>) -> LoadReport {
        let mut average = self.average.lock();
        let counted = self.requests.load(Ordering::Relaxed);
        let Some(at) = average.at.filter(|_| average.range == range) else {
            *average = Average {
                at: Some(now),
                counted,
                range,
                report: LoadReport::default(),
            };
            self.recent.lock().positions.clear();
            return average.report;
        };
        let elapsed = now.saturating_duration_since(at);
        if elapsed < OBSERVE_EVERY {
            return average.report;
        }
        let rate = (counted - average.counted) as f64 / elapsed.as_secs_f64();
        let weight = 1.0 - (-elapsed.as_secs_f64() / WINDOW.as_secs_f64()).exp();
        let before = average.report.requests_per_second;
        let (start, end) = range.unwrap_or((0, u64::MAX));
        let mut positions: Vec<u64> = self
            .recent
            .lock()
            .positions
            .iter()
            .copied()
            .filter(|p| start <= *p && *p <= end)
            .collect();
        average.report = LoadReport {
            requests_per_second: before + (rate - before) * weight,
            split_at: balanced_cut(&mut positions, start, end),
        };
        average.at = Some(now);
        average.counted = counted;
        average.report
    }
}

/// The cut of `[start, end]` (the first position of its upper half) that
/// divides `positions` most evenly, if there are enough of them and it
/// leaves neither side more than three quarters of them. Sorts
/// `positions`.
pub fn balanced_cut(positions: &mut [u64], start: u64, end: u64) -> Option<u64> {
    let total = positions.len();
    if total < MIN_SAMPLES {
        return None;
    }
    positions.sort_unstable();
    // Cutting at positions[i] puts i samples below the cut; candidates
    // are the first index of each run of equal positions.
    let mut best: Option<(usize, u64)> = None;
    for i in 1..total {
        let at = positions[i];
        if at == positions[i - 1] || at <= start || at > end {
            continue;
        }
        let larger = i.max(total - i);
        if best.is_none_or(|(b, _)| larger < b) {
            best = Some((larger, at));
        }
    }
    let (larger, at) = best?;
    (larger as f64 <= MAX_SIDE_SHARE * total as f64).then_some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_requests_are_cut_near_their_median() {
        let mut positions: Vec<u64> = (0..100).map(|i| i * 1000).collect();
        assert_eq!(balanced_cut(&mut positions, 0, u64::MAX), Some(50_000));
        // Too few to judge.
        let mut few: Vec<u64> = (0..10).collect();
        assert_eq!(balanced_cut(&mut few, 0, u64::MAX), None);
    }

    #[test]
    fn a_hot_key_has_no_cut_but_a_hot_key_among_others_may() {
        let mut hot = vec![7_000u64; 200];
        assert_eq!(balanced_cut(&mut hot, 0, u64::MAX), None);
        // 70% on one position, the rest above it: the cut just above the
        // hot key leaves 70% below (allowed).
        let mut mostly: Vec<u64> = std::iter::repeat_n(7_000u64, 70)
            .chain((0..30).map(|i| 10_000 + i))
            .collect();
        assert_eq!(balanced_cut(&mut mostly, 0, u64::MAX), Some(10_000));
        // 80% on one position: whichever side takes it has too much.
        let mut too_hot: Vec<u64> = std::iter::repeat_n(7_000u64, 80)
            .chain((0..10).map(|i| 100 + i))
            .chain((0..10).map(|i| 10_000 + i))
            .collect();
        assert_eq!(balanced_cut(&mut too_hot, 0, u64::MAX), None);
    }

    #[test]
    fn the_cut_stays_inside_the_range_and_never_at_its_start() {
        // Every sample at the range's first position: no cut.
        let mut at_start = vec![500u64; 100];
        assert_eq!(balanced_cut(&mut at_start, 500, 900), None);
        let mut spread: Vec<u64> = (0..100).map(|i| 500 + i * 4).collect();
        let at = balanced_cut(&mut spread, 500, 900).unwrap();
        assert!(500 < at && at <= 900);
        assert_eq!(at, 700);
    }

    #[test]
    fn the_rate_is_a_moving_average_started_again_when_the_range_changes() {
        let load = Load::default();
        let t0 = Instant::now();
        let range = Some((0, u64::MAX));
        assert_eq!(load.observe(t0, range), LoadReport::default());
        for i in 0..2_000u64 {
            load.record(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        // Under a second: not updated yet.
        assert_eq!(
            load.observe(t0 + Duration::from_millis(500), range),
            LoadReport::default()
        );
        let report = load.observe(t0 + Duration::from_secs(1), range);
        // 2,000/s weighted by 1 - e^(-1/5).
        let expected = 2_000.0 * (1.0 - (-0.2f64).exp());
        assert!(
            (report.requests_per_second - expected).abs() < 1.0,
            "{report:?}"
        );
        assert!(report.split_at.is_some(), "spread positions give a cut");
        // Sustained: the average approaches the rate.
        let mut report = report;
        for second in 2..40u64 {
            for i in 0..2_000u64 {
                load.record(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            }
            report = load.observe(t0 + Duration::from_secs(second), range);
        }
        assert!(report.requests_per_second > 1_900.0, "{report:?}");
        // A split narrows the range: the average starts again.
        let narrowed = Some((0, u64::MAX / 2));
        let report = load.observe(t0 + Duration::from_secs(41), narrowed);
        assert_eq!(report, LoadReport::default());
    }
}
