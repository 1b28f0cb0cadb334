//! Background relocation: every `relocation_interval_ms`, take a census and
//! relocate the oldest sealed segments whose garbage ratio reaches the
//! threshold — a lower threshold when the disk is filling — at a limited
//! rate so foreground writes keep their throughput.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::engine::Inner;
use crate::error::Result;
use crate::metrics::Metrics;

/// The relocation thread's loop.
pub(crate) fn run_relocation(inner: Arc<Inner>) {
    let interval = Duration::from_millis(inner.config.relocation_interval_ms);
    loop {
        {
            let (lock, condvar) = &inner.wake;
            let mut woken = lock.lock();
            if !inner.shutdown.load(Ordering::Acquire) {
                condvar.wait_for(&mut woken, interval);
            }
        }
        if inner.shutdown.load(Ordering::Acquire) || inner.health.is_poisoned() {
            return;
        }
        if let Err(error) = pass(&inner)
            && !super::is_transient(&error)
            && inner.health.is_poisoned()
        {
            return;
        }
    }
}

/// One policy-driven pass.
fn pass(inner: &Inner) -> Result<()> {
    let _one_at_a_time = inner.relocation_lock.lock();
    let usage = super::census(inner)?;
    let config = &inner.config;
    let free = inner
        .storage
        .available_bytes(&config.dir)
        .unwrap_or(u64::MAX);
    let threshold = if free < config.relocation_pressure_free_bytes {
        config.relocation_pressure_garbage_ratio
    } else {
        config.relocation_garbage_ratio
    };
    let wanted: Vec<_> = usage
        .iter()
        .filter(|u| u.sealed && u.garbage_ratio() >= threshold)
        .map(|u| u.segment)
        .collect();
    let candidates: Vec<_> = inner
        .sealed_segments()
        .into_iter()
        .filter(|s| wanted.contains(&s.id))
        .take(config.relocation_segments_per_pass as usize)
        .collect();
    if candidates.is_empty() {
        return Ok(());
    }
    let filter = inner.filter.get();
    inner.relocate_segments(&candidates, &*filter, Some(config.relocation_bytes_per_sec))?;
    Metrics::add(&inner.metrics.counters.relocation_passes, 1);
    Ok(())
}
