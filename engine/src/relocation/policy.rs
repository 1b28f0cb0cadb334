//! Background relocation: every `relocation_interval_ms`, take a census and
//! relocate (index-based: only live values are read) the oldest sealed
//! segments whose garbage ratio reaches the threshold — a lower threshold when the disk is filling — at a limited
//! rate so foreground writes keep their throughput.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::engine::Inner;
use crate::error::Result;
use crate::metrics::Metrics;

/// Nice value of the relocation thread: when cores are contended, the
/// foreground (nice 0) gets about nine tenths of them.
const RELOCATION_NICE: i32 = 10;

/// The relocation thread's loop. It runs at a lower CPU priority: the copy
/// rate limit bounds its I/O, the priority bounds what its census, lookups
/// and flushes take from foreground threads.
pub(crate) fn run_relocation(inner: Arc<Inner>) {
    // On Linux a thread id names the thread alone; failure (a platform
    // without per-thread priorities) only leaves it at normal priority.
    let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), RELOCATION_NICE);
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

/// One policy-driven pass. The census walks the whole index, so it runs
/// only when a segment's worth of writes arrived since the last one (new
/// garbage comes only with new writes), or when the disk is filling.
fn pass(inner: &Inner) -> Result<()> {
    let _one_at_a_time = inner.relocation_lock.lock();
    let config = &inner.config;
    let free = inner
        .storage
        .available_bytes(&config.dir)
        .unwrap_or(u64::MAX);
    let pressure = free < config.relocation_pressure_free_bytes;
    let processed = inner.values.processed().0;
    let last = inner.census_processed.load(Ordering::Acquire);
    if !pressure && processed.saturating_sub(last) < config.wal_segment_bytes {
        return Ok(());
    }
    inner.census_processed.store(processed, Ordering::Release);
    let usage = super::census(inner)?;
    let threshold = if pressure {
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
        .map(|s| s.id)
        .collect();
    if candidates.is_empty() {
        return Ok(());
    }
    let filter = inner.filter.get();
    inner.relocate_out_of(&candidates, &*filter, Some(config.relocation_bytes_per_sec))?;
    Metrics::add(&inner.metrics.counters().relocation_passes, 1);
    Ok(())
}
