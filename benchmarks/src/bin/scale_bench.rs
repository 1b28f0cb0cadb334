//! `scale-bench`: what idle replicas cost. For each shard count, a
//! `tidepool dev --insecure --shards N` process (a coordinator and three
//! nodes in one process, every shard replicated three times: 3·N replicas,
//! no data) is started and measured:
//!
//! - how long it takes to print its ready banner (every shard has a
//!   leader);
//! - once settled (`--settle-seconds`), the CPU it spends idle over
//!   `--cpu-seconds` (user + system, in cores);
//! - its resident memory, threads, open files, and the disk its data
//!   directory has allocated (blocks: holes of sparse files do not count).
//!
//! `--baseline` runs another `tidepool` binary (for example one built from
//! an older commit) the same way, in the same run, row by row next to it.
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin scale-bench --
//! [--shards 4,64,334] [--tidepool target/release/tidepool] [--baseline
//! PATH] [--dir target/bench-scale] [--json PATH]`

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;

#[derive(Parser)]
#[command(about = "What idle replicas cost: tidepool dev at several shard counts")]
struct Args {
    /// Shard counts (each shard has three replicas), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,64,334")]
    shards: Vec<u32>,
    /// The tidepool binary measured.
    #[arg(long, default_value = "target/release/tidepool")]
    tidepool: PathBuf,
    /// Another tidepool binary measured the same way, next to it.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Seconds to wait after the ready banner before measuring.
    #[arg(long, default_value_t = 10)]
    settle_seconds: u64,
    /// Seconds over which idle CPU is measured.
    #[arg(long, default_value_t = 10)]
    cpu_seconds: u64,
    /// Longest wait for the ready banner, seconds.
    #[arg(long, default_value_t = 900)]
    ready_timeout_seconds: u64,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-scale")]
    dir: PathBuf,
    /// Also write the rows as JSON lines here.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Row {
    binary: String,
    shards: u32,
    ready: Duration,
    idle_cores: f64,
    rss: u64,
    threads: u64,
    files: u64,
    disk: u64,
}

fn allocated_bytes(dir: &Path) -> u64 {
    let Ok(read) = std::fs::read_dir(dir) else {
        return 0;
    };
    read.flatten()
        .map(|entry| match entry.metadata() {
            Ok(m) if m.is_dir() => allocated_bytes(&entry.path()),
            Ok(m) => std::os::unix::fs::MetadataExt::blocks(&m) * 512,
            Err(_) => 0,
        })
        .sum()
}

/// User + system CPU of `pid`, in clock ticks (100 per second on Linux).
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name (which may hold spaces).
    let rest = &stat[stat.rfind(')').context("malformed stat")? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

fn status_bytes(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .context("field missing")?
        .parse()?;
    Ok(kib << 10)
}

fn count(path: String) -> anyhow::Result<u64> {
    Ok(std::fs::read_dir(path)?.count() as u64)
}

fn measure(args: &Args, label: &str, binary: &Path, shards: u32) -> anyhow::Result<Row> {
    let dir = args.dir.join(format!("{label}-{shards}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let started = Instant::now();
    let mut child = Command::new(binary)
        .args(["dev", "--insecure", "--port", "0", "--shards"])
        .arg(shards.to_string())
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("dev.log"))?)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = started + Duration::from_secs(args.ready_timeout_seconds);
    let result = (|| {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.contains("ready") => break,
                Ok(_) => {}
                Err(_) => bail!("no ready banner within {} s", args.ready_timeout_seconds),
            }
        }
        let ready = started.elapsed();
        std::thread::sleep(Duration::from_secs(args.settle_seconds));
        let pid = child.id();
        let before = cpu_ticks(pid)?;
        let clock = Instant::now();
        std::thread::sleep(Duration::from_secs(args.cpu_seconds));
        let ticks = cpu_ticks(pid)? - before;
        let idle_cores = ticks as f64 / 100.0 / clock.elapsed().as_secs_f64();
        Ok(Row {
            binary: label.to_string(),
            shards,
            ready,
            idle_cores,
            rss: status_bytes(pid, "VmRSS:")?,
            threads: count(format!("/proc/{pid}/task"))?,
            files: count(format!("/proc/{pid}/fd"))?,
            disk: allocated_bytes(&dir.join("data")),
        })
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut binaries = vec![("tidepool".to_string(), args.tidepool.clone())];
    if let Some(baseline) = &args.baseline {
        binaries.push(("baseline".to_string(), baseline.clone()));
    }
    eprintln!(
        "scale-bench: tidepool dev --shards {:?}; settle {} s, idle CPU over {} s",
        args.shards, args.settle_seconds, args.cpu_seconds
    );
    let mut rows = Vec::new();
    for &shards in &args.shards {
        for (label, binary) in &binaries {
            let row = measure(&args, label, binary, shards)?;
            eprintln!(
                "{label} --shards {shards}: ready {:.1} s, idle {:.2} cores, {} MiB resident",
                row.ready.as_secs_f64(),
                row.idle_cores,
                row.rss >> 20
            );
            rows.push(row);
        }
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "| binary | shards | replicas | ready | idle CPU (cores) | resident MiB | per replica | threads | per replica | open files | disk MiB | per replica |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let replicas = f64::from(r.shards * 3);
        println!(
            "| {} | {} | {} | {:.1} s | {:.2} | {:.0} | {:.2} | {} | {:.1} | {} | {:.0} | {:.2} |",
            r.binary,
            r.shards,
            r.shards * 3,
            r.ready.as_secs_f64(),
            r.idle_cores,
            mib(r.rss),
            mib(r.rss) / replicas,
            r.threads,
            r.threads as f64 / replicas,
            r.files,
            mib(r.disk),
            mib(r.disk) / replicas,
        );
    }
    if let Some(path) = &args.json {
        let mut out = String::new();
        for r in &rows {
            out.push_str(
                &serde_json::json!({
                    "binary": r.binary,
                    "shards": r.shards,
                    "replicas": r.shards * 3,
                    "ready_seconds": r.ready.as_secs_f64(),
                    "idle_cores": r.idle_cores,
                    "resident_bytes": r.rss,
                    "threads": r.threads,
                    "open_files": r.files,
                    "disk_bytes": r.disk,
                })
                .to_string(),
            );
            out.push('\n');
        }
        std::fs::write(path, out)?;
    }
    Ok(())
}
