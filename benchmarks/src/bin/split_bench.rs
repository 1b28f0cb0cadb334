//! `split-bench`: a growing cluster splitting its shards (issue 37: a
//! cluster that starts with 4 shards and receives 20 GiB splits until no
//! shard holds more than the configured limit, with write throughput
//! during splits at least 0.7x of before).
//!
//! A `tidepool dev --insecure --shards 4 --split-mib LIMIT` process (a
//! coordinator and three nodes in one process, every shard replicated three
//! times) receives `--total-mib` of `--value-kib` values from `--writers`
//! concurrent SDK clients. Every second the bench records the bytes
//! acknowledged and the cluster's shape (shards, splits under way). After
//! the writes it waits until no split is under way and the leaders' sizes
//! are known, then prints:
//!
//! - write throughput before the first split was decided, and from then to
//!   the end of the writes (the splits, the new groups' elections and the
//!   relocation shedding the other halves), and their ratio;
//! - the shards at the end, the largest one's values (as its leader
//!   reports them) against the limit;
//! - the disk the data directory allocated;
//! - the same for a control run first: the same load on the same cluster
//!   shape with splits off, its throughput cut at the same second (the
//!   data growing, the page cache filling, change throughput too).
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin split-bench --
//! [--total-mib 4096] [--limit-mib 256] [--writers 16] [--value-kib 64]
//! [--tidepool target/release/tidepool] [--dir target/bench-split]`

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use tidepool_benchmarks::DevProcess;
use tidepool_client::Client;

#[derive(Parser)]
#[command(about = "A growing cluster splitting its shards: throughput before and during splits")]
struct Args {
    /// Bytes to write in all, MiB.
    #[arg(long, default_value_t = 4096)]
    total_mib: u64,
    /// The split size (`tidepool dev --split-mib`), MiB.
    #[arg(long, default_value_t = 256)]
    limit_mib: u64,
    /// Concurrent writers.
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Bytes per value, KiB.
    #[arg(long, default_value_t = 64)]
    value_kib: usize,
    /// Shards the cluster starts with.
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// Longest wait for the splits to finish after the writes, seconds.
    #[arg(long, default_value_t = 600)]
    settle_timeout_seconds: u64,
    /// The tidepool binary.
    #[arg(long, default_value = "target/release/tidepool")]
    tidepool: PathBuf,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-split")]
    dir: PathBuf,
}

/// One second of the run.
#[derive(Clone, Copy, Debug)]
struct Second {
    /// Bytes acknowledged in it.
    bytes: u64,
    /// Shards in the map at its end.
    shards: usize,
    /// Splits decided and not yet published at its end.
    splitting: usize,
}

fn allocated_bytes(dir: &Path) -> u64 {
    let Ok(read) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut total = 0;
    let mut stack: Vec<PathBuf> = read.flatten().map(|e| e.path()).collect();
    while let Some(path) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            if let Ok(read) = std::fs::read_dir(&path) {
                stack.extend(read.flatten().map(|e| e.path()));
            }
        } else if seen.insert(std::os::unix::fs::MetadataExt::ino(&meta)) {
            total += std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
        }
    }
    total
}

/// Shards in the map, splits under way, and the largest size a leader
/// reports (`None` while some leader's size is unknown).
async fn shape(client: &Client) -> Option<(usize, usize, Option<u64>)> {
    let status = client.cluster_status().await.ok()?;
    let map = status.map.as_ref()?;
    let splitting = map.shards.iter().filter(|s| s.split.is_some()).count();
    let sizes: Option<Vec<u64>> = map
        .shards
        .iter()
        .map(|shard| {
            status
                .nodes
                .iter()
                .filter(|n| n.node_id == shard.leader_hint)
                .flat_map(|n| &n.replicas)
                .find(|r| r.shard_id == shard.shard_id && r.is_leader)
                .and_then(|r| r.data_bytes)
        })
        .collect();
    Some((
        map.shards.len(),
        splitting,
        sizes.and_then(|s| s.into_iter().max()),
    ))
}

fn mib_per_s(seconds: &[Second]) -> f64 {
    let bytes: u64 = seconds.iter().map(|s| s.bytes).sum();
    bytes as f64 / (1 << 20) as f64 / seconds.len().max(1) as f64
}

/// What one run measured.
struct Run {
    timeline: Vec<Second>,
    wrote: Duration,
    failures: u64,
    shards_end: usize,
    largest: u64,
    allocated: u64,
}

/// One run: a fresh dev cluster splitting at `split_mib` (0: never).
async fn run_once(args: &Args, split_mib: u64) -> anyhow::Result<Run> {
    let limit = split_mib.to_string();
    let shards = args.shards.to_string();
    let dev = DevProcess::start(
        &args.tidepool,
        &args.dir,
        &["--shards", &shards, "--split-mib", &limit],
    )?;
    let client = Client::connect(std::slice::from_ref(&dev.coordinator()?)).await?;
    let value_bytes = args.value_kib << 10;
    let values = (args.total_mib << 20) / value_bytes as u64;
    let next = Arc::new(AtomicU64::new(0));
    let acked = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let writers: Vec<_> = (0..args.writers)
        .map(|w| {
            let (client, next, acked, failures) = (
                client.clone(),
                next.clone(),
                acked.clone(),
                failures.clone(),
            );
            tokio::spawn(async move {
                let mut value = vec![w as u8; value_bytes];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= values {
                        return;
                    }
                    value[..8].copy_from_slice(&i.to_le_bytes());
                    match client
                        .put("default", format!("v{i}").as_bytes(), &value)
                        .await
                    {
                        Ok(_) => {
                            acked.fetch_add(value_bytes as u64, Ordering::Relaxed);
                        }
                        Err(error) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                            eprintln!("put v{i}: {error}");
                        }
                    }
                }
            })
        })
        .collect();
    let mut timeline: Vec<Second> = Vec::new();
    let mut last = 0;
    while writers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = acked.load(Ordering::Relaxed);
        let (shards, splitting, _) = shape(&client).await.unwrap_or((0, 0, None));
        let second = Second {
            bytes: now - last,
            shards,
            splitting,
        };
        last = now;
        eprintln!(
            "split {split_mib} MiB, {:>4} s: {:>7.1} MiB/s, {} shards, {} splitting",
            timeline.len() + 1,
            second.bytes as f64 / (1 << 20) as f64,
            shards,
            splitting
        );
        timeline.push(second);
    }
    let wrote = started.elapsed();
    // Splits decided during the writes finish; sizes become known.
    let deadline = Instant::now() + Duration::from_secs(args.settle_timeout_seconds);
    let (shards_end, largest) = loop {
        if let Some((shards, 0, Some(largest))) = shape(&client).await {
            break (shards, largest);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "splits still under way {} s after the writes",
            args.settle_timeout_seconds
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let allocated = allocated_bytes(&args.dir.join("data"));
    drop(dev);
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(Run {
        timeline,
        wrote,
        failures: failures.load(Ordering::Relaxed),
        shards_end,
        largest,
        allocated,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The same load without splits first: the control, in the same run.
    let control = run_once(&args, 0).await?;
    let split = run_once(&args, args.limit_mib).await?;
    let timeline = &split.timeline;
    let first_split = timeline
        .iter()
        .position(|s| s.splitting > 0 || s.shards > args.shards as usize);
    // The first two seconds warm up (connections, leaders). "After" runs
    // from the first split decision to the end of the writes: the splits,
    // the new groups' elections and the shedding relocation they cause.
    // The control is cut at the same second.
    let windows = |timeline: &[Second]| -> (f64, f64, usize, usize) {
        let end = timeline.len();
        match first_split {
            Some(first) if first > 2 && first < end => (
                mib_per_s(&timeline[2..first]),
                mib_per_s(&timeline[first..]),
                first - 2,
                end - first,
            ),
            _ => (mib_per_s(timeline), 0.0, end, 0),
        }
    };
    let (before, after, before_s, after_s) = windows(timeline);
    let (control_before, control_after, _, _) = windows(&control.timeline);
    let splitting = timeline.iter().filter(|s| s.splitting > 0).count();
    println!(
        "split-bench: {} MiB of {} KiB values from {} writers into {} shards (tidepool dev, 3 replicas each, one process); split size {} MiB, control without splits in the same run",
        args.total_mib, args.value_kib, args.writers, args.shards, args.limit_mib
    );
    for (name, run) in [("control", &control), ("splitting", &split)] {
        println!(
            "{name}: written in {:.1} s ({:.1} MiB/s), {} failed puts; {} shards at the end, the largest holding {:.1} MiB of values; data directory {:.1} GiB allocated",
            run.wrote.as_secs_f64(),
            args.total_mib as f64 / run.wrote.as_secs_f64(),
            run.failures,
            run.shards_end,
            run.largest as f64 / (1 << 20) as f64,
            run.allocated as f64 / (1u64 << 30) as f64
        );
    }
    println!(
        "splitting: {before:.1} MiB/s over the {before_s} s before the first split decision, {after:.1} MiB/s over the {after_s} s from it to the end of the writes ({splitting} s with a split under way, {} -> {} shards meanwhile): ratio {:.2} (target at least 0.7)",
        args.shards,
        timeline.last().map_or(0, |s| s.shards),
        after / before.max(f64::MIN_POSITIVE)
    );
    println!(
        "control, same seconds: {control_before:.1} MiB/s, then {control_after:.1} MiB/s: ratio {:.2}",
        control_after / control_before.max(f64::MIN_POSITIVE)
    );
    Ok(())
}
