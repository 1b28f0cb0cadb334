//! `engine-put`: put throughput of the engine with 1 and 2 writer threads,
//! next to the machine's limit for the same bytes — a plain sequential
//! `memcpy` into memory-mapped, pre-allocated files that are kept, as a
//! log keeps its data, each synced and released from the page cache behind
//! the copy as the engine's syncer does (and, for reference, into files kept
//! in the page cache, and into files removed once full) — measured in the
//! same run.
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin engine-put --
//! [--seconds 10] [--value-bytes 1024] [--dir target/bench-engine]`

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rand::Rng;
use tidepool_benchmarks::{LimitFiles, memcpy_limit};
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpaceConfig};

#[derive(Debug, Parser)]
struct Args {
    /// Seconds each measurement runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Bytes per value.
    #[arg(long, default_value_t = 1024)]
    value_bytes: usize,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-engine")]
    dir: PathBuf,
}

fn engine_config(dir: &PathBuf) -> Config {
    let mut config = Config::new(dir);
    config.wal_segment_bytes = 256 << 20;
    config.key_spaces = vec![KeySpaceConfig {
        name: "default".into(),
        key_bytes: 32,
        layout: CellLayout::Uniform { cells: 16_384 },
    }];
    config
}

/// Puts random 32-byte keys from `threads` threads for `duration`.
fn engine_puts(
    dir: &PathBuf,
    threads: usize,
    value_bytes: usize,
    duration: Duration,
) -> anyhow::Result<(u64, Duration, String)> {
    let _ = std::fs::remove_dir_all(dir);
    let engine = Engine::open(engine_config(dir)).context("open engine")?;
    let ks = engine.key_space("default")?;
    let stop = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut rng = rand::rng();
                let value = vec![0xA5u8; value_bytes];
                let mut done = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key: [u8; 32] = rng.random();
                    engine
                        .put(ks, &key, &value, Durability::Buffered)
                        .expect("put");
                    done += 1;
                }
                ops.fetch_add(done, Ordering::Relaxed);
            });
        }
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
    });
    let elapsed = start.elapsed();
    let latency = engine.metrics().write_latency;
    engine.close()?;
    let _ = std::fs::remove_dir_all(dir);
    let detail = format!(
        "p50 {} ns, p99 {} ns (power-of-two buckets)",
        latency.p50_ns, latency.p99_ns
    );
    Ok((ops.into_inner(), elapsed, detail))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let duration = Duration::from_secs(args.seconds);
    let mib = |ops: u64, elapsed: Duration| {
        ops as f64 * args.value_bytes as f64 / elapsed.as_secs_f64() / (1 << 20) as f64
    };
    println!(
        "engine-put: {}-byte values, 32-byte random keys, Durability::Buffered, {} s per run",
        args.value_bytes, args.seconds
    );
    println!("| run | ops/s | MiB/s | vs memcpy limit | latency |");
    println!("|---|---|---|---|---|");
    // The ratio column compares with the copy into files kept, synced and
    // released behind the copy: the write path of a log that keeps its
    // data, as the engine does (`Config::wal_cached_bytes`).
    let mut limit = 0.0;
    for files in [LimitFiles::Released, LimitFiles::Kept, LimitFiles::Recycled] {
        let (copies, elapsed) = memcpy_limit(&args.dir, args.value_bytes, 1, duration, files)?;
        let rate = copies as f64 / elapsed.as_secs_f64();
        if files == LimitFiles::Released {
            limit = rate;
        }
        println!(
            "| memcpy into mmap, {} (1 thread) | {rate:.0} | {:.0} | {:.2} | - |",
            files.describe(),
            mib(copies, elapsed),
            rate / limit
        );
    }
    for threads in [1, 2] {
        let (ops, elapsed, detail) = engine_puts(&args.dir, threads, args.value_bytes, duration)?;
        let rate = ops as f64 / elapsed.as_secs_f64();
        println!(
            "| engine put, {threads} thread{} | {rate:.0} | {:.0} | {:.2} | {detail} |",
            if threads == 1 { "" } else { "s" },
            mib(ops, elapsed),
            rate / limit
        );
    }
    Ok(())
}
