//! `backup-bench`: Tidepool as a backup chunk store, against a real dev
//! cluster (`tidepool dev --insecure`, a separate process: a coordinator and
//! three nodes, every shard replicated three times, and the gateway with its
//! restic endpoint).
//!
//! 1. Fill: `--chunks` content-addressed chunks of `--min-bytes` to
//!    `--max-bytes` (uniform), through the SDK, 64 concurrent puts.
//! 2. `find_missing` of 10,000 digests, half stored (drawn at random from
//!    the fill), half not, one call at a time: p50/p99.
//! 3. Listing the whole chunk namespace through `Client::list`: keys per
//!    second, and the resident memory of this process and of the cluster's
//!    process before and after (bounded memory: neither grows with the
//!    namespace).
//! 4. `restic backup` of a generated `--tree-mib` tree (files of 4 KiB to
//!    4 MiB, a tenth of them duplicated) into a local-directory repository
//!    and into Tidepool through the gateway, one after the other in this
//!    run, on the same disk: seconds and MiB/s each, and the ratio.
//!
//! The dev cluster's data, the local repository and the tree share one
//! disk. Pages of the tree read by the first backup may still be cached for
//! the second (the machine evicts page-cache data idle for about a minute):
//! the tree is read once before both, so both find it cached alike.
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin backup-bench --
//! [--chunks 2000000] [--min-bytes 4096] [--max-bytes 65536] [--tree-mib
//! 1024] [--tidepool target/release/tidepool] [--dir target/bench-backup]`

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use rand::{Rng, SeedableRng};
use tidepool_benchmarks::{Latencies, children_cpu_seconds, cpu_seconds, human};
use tidepool_client::{Client, ListOptions};

#[derive(Debug, Parser)]
struct Args {
    /// Chunks stored before `find_missing` is measured (0: skip the chunk
    /// phases).
    #[arg(long, default_value_t = 2_000_000)]
    chunks: u64,
    /// Smallest chunk, bytes.
    #[arg(long, default_value_t = 4096)]
    min_bytes: usize,
    /// Largest chunk, bytes.
    #[arg(long, default_value_t = 65_536)]
    max_bytes: usize,
    /// `find_missing` calls measured.
    #[arg(long, default_value_t = 100)]
    queries: usize,
    /// Size of the tree restic backs up, MiB (0: skip restic).
    #[arg(long, default_value_t = 1024)]
    tree_mib: u64,
    /// The server binary.
    #[arg(long, default_value = "target/release/tidepool")]
    tidepool: PathBuf,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-backup")]
    dir: PathBuf,
    /// Seed of the generated data.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

struct Dev {
    process: tidepool_benchmarks::DevProcess,
    coordinator: String,
    restic: String,
}

fn start_dev(args: &Args) -> anyhow::Result<Dev> {
    let process = tidepool_benchmarks::DevProcess::start(&args.tidepool, &args.dir, &[])?;
    let coordinator = process.coordinator()?;
    let restic = process.find(|w| {
        w.strip_prefix("rest:http://")
            .and_then(|w| w.strip_suffix("/REPO/"))
            .map(str::to_string)
    })?;
    Ok(Dev {
        process,
        coordinator,
        restic,
    })
}

/// Resident memory of process `pid`, bytes (from /proc).
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib << 10)
}

async fn fill(client: &Client, args: &Args) -> anyhow::Result<Vec<[u8; 32]>> {
    let next = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..64u64 {
        let (client, next, bytes) = (client.clone(), next.clone(), bytes.clone());
        let (chunks, min, max, seed) = (args.chunks, args.min_bytes, args.max_bytes, args.seed);
        tasks.spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (task << 32));
            let mut keys = Vec::new();
            let mut chunk = vec![0u8; max];
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= chunks {
                    return Ok::<_, tidepool_client::Error>(keys);
                }
                let len = rng.random_range(min..=max);
                rng.fill(&mut chunk[..len]);
                keys.push(client.put_content("chunks", &chunk[..len]).await?);
                bytes.fetch_add(len as u64, Ordering::Relaxed);
                if i > 0 && i % 200_000 == 0 {
                    eprintln!("  filled {i} chunks");
                }
            }
        });
    }
    let mut keys = Vec::new();
    while let Some(done) = tasks.join_next().await {
        keys.extend(done??);
    }
    let secs = started.elapsed().as_secs_f64();
    let total = bytes.load(Ordering::Relaxed);
    println!(
        "fill: {} chunks of {}–{} B ({:.1} GiB) in {secs:.0} s ({:.0} puts/s, {:.0} MiB/s)",
        args.chunks,
        args.min_bytes,
        args.max_bytes,
        total as f64 / (1u64 << 30) as f64,
        args.chunks as f64 / secs,
        total as f64 / (1 << 20) as f64 / secs
    );
    Ok(keys)
}

async fn find_missing(client: &Client, keys: &[[u8; 32]], args: &Args) -> anyhow::Result<()> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(args.seed ^ 0xf1);
    let mut latencies = Latencies::default();
    for q in 0..args.queries {
        let mut digests: Vec<Vec<u8>> = (0..5_000)
            .map(|_| keys[rng.random_range(0..keys.len())].to_vec())
            .collect();
        let absent: Vec<Vec<u8>> = (0..5_000)
            .map(|_| {
                let mut d = vec![0u8; 32];
                rng.fill(&mut d[..]);
                d
            })
            .collect();
        digests.extend(absent);
        let started = Instant::now();
        let missing = client.find_missing("chunks", &digests).await?;
        latencies.record(started.elapsed());
        if missing.len() < 5_000 {
            bail!("query {q}: {} missing of 5,000 absent", missing.len());
        }
    }
    println!(
        "find_missing of 10,000 digests (5,000 stored) over {} chunks, {} calls: p50 {}, p99 {}",
        keys.len(),
        latencies.count(),
        human(latencies.quantile(0.5)),
        human(latencies.quantile(0.99))
    );
    Ok(())
}

async fn list(client: &Client, dev: &Dev, expected: u64) -> anyhow::Result<()> {
    let (own, cluster) = (rss(std::process::id()), rss(dev.process.child.id()));
    let started = Instant::now();
    let mut lister = client.list("chunks", ListOptions::default());
    let (mut count, mut last): (u64, Option<Vec<u8>>) = (0, None);
    let (mut own_peak, mut cluster_peak) = (own, cluster);
    while let Some(entry) = lister.next().await? {
        if last.as_ref().is_some_and(|l| *l >= entry.key) {
            bail!("the listing is out of order at {count}");
        }
        last = Some(entry.key);
        count += 1;
        if count % 100_000 == 0 {
            own_peak = own_peak.max(rss(std::process::id()));
            cluster_peak = cluster_peak.max(rss(dev.process.child.id()));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    if count != expected {
        bail!("listed {count} keys, {expected} stored");
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "list: {count} keys in {secs:.1} s ({:.0} keys/s); resident memory of this client {:.0} -> peak {:.0} MiB, of the cluster process {:.0} -> peak {:.0} MiB",
        count as f64 / secs,
        mib(own),
        mib(own_peak),
        mib(cluster),
        mib(cluster_peak)
    );
    Ok(())
}

/// A tree of about `mib` MiB: files of 4 KiB to 4 MiB of random bytes, a
/// tenth of them copies of earlier ones.
fn generate_tree(root: &Path, mib: u64, seed: u64) -> anyhow::Result<u64> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut total = 0u64;
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let mut i = 0;
    while total < mib << 20 {
        let dir = root.join(format!("d{}", i % 32));
        std::fs::create_dir_all(&dir)?;
        let bytes = if i % 10 == 9 && !kept.is_empty() {
            kept[rng.random_range(0..kept.len())].clone()
        } else {
            let mut bytes = vec![0u8; rng.random_range(4 << 10..4 << 20)];
            rng.fill(&mut bytes[..]);
            if kept.len() < 16 {
                kept.push(bytes.clone());
            }
            bytes
        };
        std::fs::write(dir.join(format!("f{i}")), &bytes)?;
        total += bytes.len() as u64;
        i += 1;
    }
    Ok(total)
}

/// Reads every file once, so both backups find the tree in the page cache.
fn read_tree(root: &Path) -> anyhow::Result<()> {
    let mut stack = vec![root.to_path_buf()];
    let mut buffer = vec![0u8; 1 << 20];
    while let Some(path) = stack.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        } else {
            let mut file = std::fs::File::open(&path)?;
            while file.read(&mut buffer)? > 0 {}
        }
    }
    Ok(())
}

fn restic(repo: &str, cache: &Path, args: &[&str]) -> anyhow::Result<f64> {
    let started = Instant::now();
    let output = Command::new("restic")
        .arg("-r")
        .arg(repo)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .env("RESTIC_PASSWORD", "benchmark")
        .output()
        .context("restic runs (make deps installs it)")?;
    if !output.status.success() {
        bail!(
            "restic {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(started.elapsed().as_secs_f64())
}

fn restic_backups(dev: &Dev, args: &Args) -> anyhow::Result<()> {
    let tree = args.dir.join("tree");
    let size = generate_tree(&tree, args.tree_mib, args.seed)?;
    read_tree(&tree)?;
    let tree_arg = tree.to_str().context("a UTF-8 path")?;
    let mib = size as f64 / (1 << 20) as f64;
    let local = args.dir.join("local-repo");
    let local_repo = local.to_str().context("a UTF-8 path")?;
    let tidepool_repo = format!("rest:http://{}/bench/", dev.restic);
    let mut rows = Vec::new();
    for (name, repo) in [
        ("local directory", local_repo),
        ("Tidepool (3 replicas)", &tidepool_repo),
    ] {
        let cache = args.dir.join(format!("cache-{}", rows.len()));
        restic(repo, &cache, &["init"])?;
        let dev_pid = dev.process.child.id();
        let (dev_before, restic_before) = (cpu_seconds(dev_pid), children_cpu_seconds());
        let secs = restic(repo, &cache, &["backup", tree_arg])?;
        let dev_cpu = cpu_seconds(dev_pid) - dev_before;
        let restic_cpu = children_cpu_seconds() - restic_before;
        println!(
            "restic backup of {mib:.0} MiB into {name}: {secs:.1} s ({:.0} MiB/s); CPU seconds: restic {restic_cpu:.1}, tidepool dev (nodes, coordinator, gateway) {dev_cpu:.1}, of {:.1} for two cores",
            mib / secs,
            2.0 * secs
        );
        rows.push(secs);
    }
    println!(
        "restic backup, Tidepool / local directory (throughput ratio): {:.2}",
        rows[0] / rows[1]
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dev = start_dev(&args)?;
    let client = Client::connect(std::slice::from_ref(&dev.coordinator)).await?;
    client
        .create_namespace("chunks", true, tidepool_client::RetentionPolicy::Durable)
        .await?;
    println!(
        "backup-bench: dev cluster (3 nodes, 3 replicas), {} chunks of {}–{} B, tree {} MiB",
        args.chunks, args.min_bytes, args.max_bytes, args.tree_mib
    );
    if args.chunks > 0 {
        let keys = fill(&client, &args).await?;
        find_missing(&client, &keys, &args).await?;
        drop(keys);
        list(&client, &dev, args.chunks).await?;
    }
    if args.tree_mib > 0 {
        restic_backups(&dev, &args)?;
    }
    drop(dev);
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}
