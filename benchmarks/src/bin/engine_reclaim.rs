//! `engine-reclaim`: a delete-heavy workload (after the TideHunter paper's
//! section 6.2.3), run twice in one process — once with background
//! relocation off, once on — reporting disk usage and what relocation costs
//! the foreground.
//!
//! Each run: fill `--fill-mib` of values under random keys; then for
//! `--seconds`, one thread alternates deleting a random existing key and
//! putting a new one (live data stays level, garbage piles up); finally
//! report foreground ops/s, live bytes, and the bytes the engine's files
//! occupy on disk (allocated blocks).
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin engine-reclaim --
//! [--seconds 30] [--fill-mib 512] [--value-bytes 1024] [--dir target/bench-reclaim]`

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rand::Rng;
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpaceConfig};

#[derive(Debug, Parser)]
struct Args {
    /// Seconds of the delete-heavy phase.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// MiB of values written before it.
    #[arg(long, default_value_t = 512)]
    fill_mib: u64,
    /// Bytes per value.
    #[arg(long, default_value_t = 1024)]
    value_bytes: usize,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-reclaim")]
    dir: PathBuf,
    /// Rounds; each runs the three modes in turn, and medians are reported
    /// (this machine's run-to-run noise is larger than the effect).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

struct Outcome {
    ops_per_sec: f64,
    disk_bytes: u64,
    live_bytes: u64,
    segments_deleted: u64,
    bytes_relocated: u64,
}

/// Relocation off, on at the default rate limit, or on unthrottled.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Off,
    Throttled,
    Unthrottled,
}

fn config(dir: &Path, mode: Mode) -> Config {
    let mut config = Config::new(dir);
    config.wal_segment_bytes = 64 << 20;
    config.relocation_enabled = !matches!(mode, Mode::Off);
    if matches!(mode, Mode::Unthrottled) {
        config.relocation_bytes_per_sec = 0;
    }
    config.relocation_interval_ms = 5_000;
    config.relocation_segments_per_pass = 32;
    config.key_spaces = vec![KeySpaceConfig {
        name: "default".into(),
        key_bytes: 32,
        layout: CellLayout::Uniform { cells: 16_384 },
    }];
    config
}

/// Bytes of disk blocks allocated to the files under `dir`.
fn allocated_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            total += allocated_bytes(&path);
        } else if let Ok(meta) = entry.metadata() {
            total += meta.blocks() * 512;
        }
    }
    total
}

fn run(args: &Args, mode: Mode) -> anyhow::Result<Outcome> {
    let dir = args.dir.join(format!("{mode:?}"));
    let _ = std::fs::remove_dir_all(&dir);
    let engine = Engine::open(config(&dir, mode)).context("open engine")?;
    let ks = engine.key_space("default")?;
    let mut rng = rand::rng();
    let value = vec![0x3Cu8; args.value_bytes];
    let fill = (args.fill_mib << 20) / args.value_bytes as u64;
    let mut keys: Vec<[u8; 32]> = Vec::with_capacity(fill as usize);
    for _ in 0..fill {
        let key: [u8; 32] = rng.random();
        engine.put(ks, &key, &value, Durability::Buffered)?;
        keys.push(key);
    }
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let start = Instant::now();
    let mut ops = 0u64;
    while Instant::now() < deadline {
        for _ in 0..1_000 {
            let victim = rng.random_range(0..keys.len());
            engine.delete(ks, &keys[victim], Durability::Buffered)?;
            let key: [u8; 32] = rng.random();
            engine.put(ks, &key, &value, Durability::Buffered)?;
            keys[victim] = key;
            ops += 2;
        }
    }
    let ops_per_sec = ops as f64 / start.elapsed().as_secs_f64();
    let counters = engine.metrics().counters;
    let usage = engine.segment_usage()?;
    engine.close()?;
    drop(engine);
    let outcome = Outcome {
        ops_per_sec,
        disk_bytes: allocated_bytes(&dir),
        live_bytes: usage.iter().map(|s| s.live_bytes).sum(),
        segments_deleted: counters.segments_deleted,
        bytes_relocated: counters.bytes_relocated,
    };
    let _ = std::fs::remove_dir_all(&dir);
    Ok(outcome)
}

/// The median outcome by throughput, with the median disk usage.
fn median(outcomes: &mut [Outcome]) -> Outcome {
    let mut disks: Vec<u64> = outcomes.iter().map(|o| o.disk_bytes).collect();
    disks.sort_unstable();
    outcomes.sort_by(|a, b| a.ops_per_sec.total_cmp(&b.ops_per_sec));
    let middle = &outcomes[outcomes.len() / 2];
    Outcome {
        ops_per_sec: middle.ops_per_sec,
        disk_bytes: disks[disks.len() / 2],
        live_bytes: middle.live_bytes,
        segments_deleted: middle.segments_deleted,
        bytes_relocated: middle.bytes_relocated,
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!(
        "engine-reclaim: fill {} MiB of {}-byte values, then {} s of 50% deletes / 50% new puts (1 thread)",
        args.fill_mib, args.value_bytes, args.seconds
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let modes = [Mode::Off, Mode::Throttled, Mode::Unthrottled];
    let mut results: Vec<Vec<Outcome>> = modes.iter().map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        for (i, mode) in modes.iter().enumerate() {
            let outcome = run(&args, *mode)?;
            println!(
                "round {round}, {mode:?}: {:.0} ops/s, {:.0} MiB on disk",
                outcome.ops_per_sec,
                mib(outcome.disk_bytes)
            );
            results[i].push(outcome);
        }
    }
    let [off, on, fast] = [0, 1, 2].map(|i| median(&mut results[i]));
    println!("medians of {} rounds:", args.rounds);
    println!(
        "| relocation | foreground ops/s | disk used MiB | live MiB | segments deleted | MiB relocated |"
    );
    println!("|---|---|---|---|---|---|");
    let rows = [
        ("off", &off),
        ("on, 64 MiB/s (default)", &on),
        ("on, unthrottled", &fast),
    ];
    for (name, o) in rows {
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {} | {:.0} |",
            o.ops_per_sec,
            mib(o.disk_bytes),
            mib(o.live_bytes),
            o.segments_deleted,
            mib(o.bytes_relocated)
        );
    }
    for (name, o) in &rows[1..] {
        println!(
            "relocation {name}: disk {:.0}% of off; foreground throughput {:+.1}%",
            100.0 * o.disk_bytes as f64 / off.disk_bytes.max(1) as f64,
            100.0 * (o.ops_per_sec / off.ops_per_sec - 1.0)
        );
    }
    Ok(())
}
