//! How fast one token may open write sessions on a shard this node leads.
//!
//! A shard remembers at most `session::MAX_SESSIONS` write sessions; when
//! it holds that many, a new session evicts those idle for
//! `session::EVICTABLE_IDLE_MS`, and is refused (`OVERLOADED`) if none is.
//! Sessions are not the tenants': one token opening a fresh session with
//! every put (a few hundred a second) kept the table full of sessions
//! never idle that long, and every other client's first write on the
//! shard was refused for as long as it went on. So the leader lets each
//! token open at most `limits.session_opens_per_second` sessions a second
//! on each shard (100), in bursts of up to `limits.session_opens_burst`
//! (2,000): one token then holds at most about `burst + rate ×
//! EVICTABLE_IDLE_MS` = 32,000 of the sessions a shard remembers, a third
//! of the table. An SDK client opens one session
//! per concurrent writer and shard, once. Callers without a token (a
//! cluster that checks none, a node's certificate) are not limited.
//!
//! The buckets live in the leader's memory only: a new leader starts them
//! full (a tenant may then open one more burst).

use std::collections::HashMap;
use std::time::Instant;

/// Buckets kept before full ones (a token quiet for a while) are dropped.
const MAX_BUCKETS: usize = 10_000;

/// Session opens left to each (token, shard).
pub(crate) struct SessionOpens {
    /// Opens a second (`limits.session_opens_per_second`).
    rate: f64,
    /// Opens at once (`limits.session_opens_burst`).
    burst: f64,
    buckets: parking_lot::Mutex<HashMap<(String, u32), Bucket>>,
}

struct Bucket {
    left: f64,
    at: Instant,
}

impl SessionOpens {
    /// `rate` opens a second per token and shard, `burst` at once.
    pub(crate) fn new(rate: u64, burst: u64) -> Self {
        Self {
            rate: rate.max(1) as f64,
            burst: burst.max(1) as f64,
            buckets: parking_lot::Mutex::default(),
        }
    }

    /// Opens a second per token and shard.
    pub(crate) fn rate(&self) -> u64 {
        self.rate as u64
    }

    fn refilled(&self, bucket: &Bucket, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        (bucket.left + elapsed * self.rate).min(self.burst)
    }

    /// Takes one session open for `token` on `shard` at `now`; `Err(ms)`:
    /// none is left, one will be in `ms` milliseconds.
    pub(crate) fn take(&self, token: &str, shard: u32, now: Instant) -> Result<(), u32> {
        let mut buckets = self.buckets.lock();
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(&(token.to_string(), shard)) {
            buckets.retain(|_, bucket| self.refilled(bucket, now) < self.burst);
        }
        let bucket = buckets.entry((token.to_string(), shard)).or_insert(Bucket {
            left: self.burst,
            at: now,
        });
        let left = self.refilled(bucket, now);
        bucket.at = now;
        if left < 1.0 {
            bucket.left = left;
            let wait = (1.0 - left) / self.rate;
            return Err((wait * 1000.0).ceil().clamp(1.0, f64::from(u32::MAX)) as u32);
        }
        bucket.left = left - 1.0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const OPENS_PER_SECOND: f64 = 100.0;
    const OPENS_BURST: f64 = 2_000.0;

    fn opens() -> SessionOpens {
        SessionOpens::new(OPENS_PER_SECOND as u64, OPENS_BURST as u64)
    }

    #[test]
    fn a_token_opens_its_burst_then_its_rate_per_shard() {
        let opens = opens();
        let start = Instant::now();
        for _ in 0..OPENS_BURST as usize {
            opens.take("greedy", 1, start).unwrap();
        }
        let wait = opens.take("greedy", 1, start).unwrap_err();
        assert_eq!(wait, 10, "one open every 10 ms");
        // Other tokens, and this token on other shards, are not held back.
        opens.take("other", 1, start).unwrap();
        opens.take("greedy", 2, start).unwrap();
        // A second later: the rate's worth, and no more.
        let later = start + Duration::from_secs(1);
        for _ in 0..OPENS_PER_SECOND as usize {
            opens.take("greedy", 1, later).unwrap();
        }
        assert!(opens.take("greedy", 1, later).is_err());
        // Quiet long enough, the burst is whole again (never more).
        let quiet = later + Duration::from_secs(3600);
        for _ in 0..OPENS_BURST as usize {
            opens.take("greedy", 1, quiet).unwrap();
        }
        assert!(opens.take("greedy", 1, quiet).is_err());
    }

    #[test]
    fn full_buckets_are_dropped_when_too_many_are_kept() {
        let opens = opens();
        let start = Instant::now();
        for shard in 0..MAX_BUCKETS as u32 {
            opens.take("many", shard, start).unwrap();
        }
        // One spends its burst: 5 s later it is refilled by 500 only.
        for _ in 0..OPENS_BURST as usize - 1 {
            opens.take("many", 0, start).unwrap();
        }
        assert!(opens.take("many", 0, start).is_err());
        // A new bucket past the bound drops those full again (the others,
        // which spent one open each) and keeps the busy one with what it
        // spent.
        let later = start + Duration::from_secs(5);
        opens.take("new", 0, later).unwrap();
        assert_eq!(opens.buckets.lock().len(), 2);
        for _ in 0..500 {
            opens.take("many", 0, later).unwrap();
        }
        assert!(opens.take("many", 0, later).is_err());
    }
}
