//! Seeds for randomized tests: printed, and replayable from the environment.

use std::time::{SystemTime, UNIX_EPOCH};

/// The seed for a randomized test: the value of the environment variable
/// `var` when set (to replay a failure), otherwise one drawn from the clock.
/// Always printed, so a failing run can be re-run with the same seed.
pub fn seed_from_env(var: &str) -> u64 {
    let seed = match std::env::var(var) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{var}={text:?} is not a u64 seed")),
        Err(_) => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            now.as_nanos() as u64 ^ u64::from(std::process::id())
        }
    };
    eprintln!("seed: {var}={seed}");
    seed
}
