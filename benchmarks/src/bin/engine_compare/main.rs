//! `engine-compare`: Tidepool's engine, RocksDB (leveled LSM) and BlobDB
//! (RocksDB with blob files) side by side in one process, on the same
//! keys and values, driven through one trait — with the `memcpy`-into-mmap
//! limit measured in the same run (into files kept, as a log keeps its
//! data — the limit; and, for reference, into files removed once full, whose
//! memory the next file reuses). Built only with the `peers` feature
//! (the `rocksdb` crate compiles RocksDB from C++): `make bench-engine`.
//!
//! For each value size and engine: fill the data size (`--data-mib`, or
//! `--entries`), then, for each thread count, fixed-duration phases of
//! 32-byte uniformly random keys — 100% puts of new keys, 50/50 get/put,
//! 100% gets (uniform over every key), 100% gets skewed toward recent keys
//! (Zipf, θ 0.99, over insertion order), 100% exists (half present, half
//! absent), 100% "largest key smaller than" a random key — and at the last
//! thread count 100% deletes (of every key, until the phase ends or none
//! is left; disk used afterwards is the "without relocation" figure) and
//! a reclaim pass (Tidepool: relocation of everything below the WAL's end;
//! RocksDB: a full compaction, with blob garbage collection of every blob
//! file for BlobDB; disk used afterwards is the "with relocation" figure).
//!
//! Before each phase the suite waits for the dirty pages left by the work
//! before it to reach the disk (`sync`; `--no-settle` skips it), so a
//! phase does not measure the write-back of the one before it.
//!
//! Every phase reports ops/s, p50/p99/p99.9 latency, disk bytes written
//! per user byte (`/proc/self/io` write_bytes; user bytes = key + value of
//! each put), disk bytes read per operation, disk usage and CPU cores used;
//! one JSON line per phase goes to `--json`, a Markdown table to stdout.
//! `benchmarks/plot.py` turns the JSON lines into tables and PNG charts.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_benchmarks::{Latencies, LimitFiles, human, memcpy_limit};
use tidepool_testkit::{process_read_bytes, process_write_bytes};

mod engines;

use engines::{KvEngine, open};

#[derive(Debug, Parser)]
struct Args {
    /// Seconds each phase runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Data filled before the phases, MiB of keys and values (overrides
    /// `--entries`).
    #[arg(long)]
    data_mib: Option<u64>,
    /// Entries filled before the phases (without `--data-mib`).
    #[arg(long, default_value_t = 200_000)]
    entries: u64,
    /// Value sizes, bytes.
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    value_bytes: Vec<usize>,
    /// Thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Memory each engine may use for caches, indexes and memtables, MiB.
    #[arg(long, default_value_t = 256)]
    memory_mib: u64,
    /// Engines to run.
    #[arg(long, value_delimiter = ',', default_value = "tidepool,rocksdb,blobdb")]
    engines: Vec<String>,
    /// Phases to run (put, mixed, get, get-zipf, exists, last-before,
    /// delete, reclaim).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "put,mixed,get,get-zipf,exists,last-before,delete,reclaim"
    )]
    phases: Vec<String>,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-compare")]
    dir: PathBuf,
    /// Append one JSON line per phase here (the median run's, once every
    /// run of a value size is done).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Append each run's JSON lines here as soon as that run is done (with
    /// "run" and "of"), so a long sweep that is stopped keeps the runs it
    /// finished.
    #[arg(long)]
    runs_json: Option<PathBuf>,
    /// A label for this run's data size in the JSON ("in-memory",
    /// "beyond-memory").
    #[arg(long, default_value = "in-memory")]
    label: String,
    /// Skip the memcpy-limit runs (when profiling an engine).
    #[arg(long)]
    skip_limits: bool,
    /// Runs of the whole sequence (limits, then each engine from a fresh
    /// fill), one after another; the JSON and the last table give, per
    /// engine, threads and phase, the run with the median ops/s, and the
    /// JSON lists every run's ops/s and write amplification.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Start each phase at once, without first waiting for the kernel to
    /// write back the dirty pages the phases before it left (when
    /// profiling one phase).
    #[arg(long)]
    no_settle: bool,
}

/// The key of entry `i` (uniformly distributed, reproducible).
fn key(i: u64) -> [u8; 32] {
    let mut rng = SmallRng::seed_from_u64(i ^ 0x5eed_5eed);
    rng.random()
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&path) {
            for entry in entries.flatten() {
                match entry.metadata() {
                    Ok(m) if m.is_dir() => stack.push(entry.path()),
                    Ok(m) => total += std::os::unix::fs::MetadataExt::blocks(&m) * 512,
                    Err(_) => {}
                }
            }
        }
    }
    total
}

/// CPU seconds this process has used (`/proc/self/stat` utime + stime,
/// in 100 Hz clock ticks).
/// The kernel's dirty and under-write-back page-cache bytes
/// (`/proc/meminfo`), all processes.
fn dirty_bytes() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .filter(|l| l.starts_with("Dirty:") || l.starts_with("Writeback:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// Waits until the dirty pages left by the work before a phase are on disk
/// (`sync`), so that each phase measures itself and not the write-back of
/// the one before it (a fill leaves up to the kernel's dirty limit, several
/// GiB, behind it). Returns the dirty bytes found and the time it took.
/// Engines' own background work (flushes, compactions) goes on meanwhile.
fn settle() -> (u64, Duration) {
    let dirty = dirty_bytes();
    let start = Instant::now();
    match std::process::Command::new("sync").status() {
        Ok(status) if status.success() => {}
        other => eprintln!("settle: sync failed: {other:?}"),
    }
    (dirty, start.elapsed())
}

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Zipf-distributed ranks in `0..n` (θ < 1), by the method of Gray et al.,
/// "Quickly generating billion-record synthetic databases" (SIGMOD 1994),
/// as YCSB uses it: rank 0 is the most popular.
struct Zipf {
    n: f64,
    theta: f64,
    alpha: f64,
    zeta_n: f64,
    eta: f64,
}

impl Zipf {
    fn new(n: u64, theta: f64) -> Self {
        let zeta = |n: u64| (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zeta_n = zeta(n);
        let zeta_2 = zeta(2.min(n));
        let nf = n as f64;
        Self {
            n: nf,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zeta_n,
            eta: (1.0 - (2.0 / nf).powf(1.0 - theta)) / (1.0 - zeta_2 / zeta_n),
        }
    }

    fn sample(&self, rng: &mut SmallRng) -> u64 {
        let u: f64 = rng.random();
        let uz = u * self.zeta_n;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1;
        }
        let rank = (self.n * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        rank.min(self.n as u64 - 1)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Puts,
    Mixed,
    Gets,
    GetsZipf,
    Exists,
    LastBefore,
    Deletes,
    Reclaim,
}

impl Phase {
    const ALL: [Phase; 8] = [
        Phase::Puts,
        Phase::Mixed,
        Phase::Gets,
        Phase::GetsZipf,
        Phase::Exists,
        Phase::LastBefore,
        Phase::Deletes,
        Phase::Reclaim,
    ];

    fn id(self) -> &'static str {
        match self {
            Phase::Puts => "put",
            Phase::Mixed => "mixed",
            Phase::Gets => "get",
            Phase::GetsZipf => "get-zipf",
            Phase::Exists => "exists",
            Phase::LastBefore => "last-before",
            Phase::Deletes => "delete",
            Phase::Reclaim => "reclaim",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Phase::Puts => "100% put (new keys)",
            Phase::Mixed => "50/50 get/put",
            Phase::Gets => "100% get (uniform)",
            Phase::GetsZipf => "100% get (Zipf 0.99, recent keys hot)",
            Phase::Exists => "100% exists (half absent)",
            Phase::LastBefore => "100% largest key smaller than",
            Phase::Deletes => "100% delete (no relocation)",
            Phase::Reclaim => "reclaim (relocation / full compaction)",
        }
    }

    /// Runs once, at the last thread count: it changes the data.
    fn destructive(self) -> bool {
        matches!(self, Phase::Deletes | Phase::Reclaim)
    }
}

struct Measured {
    ops: u64,
    elapsed: Duration,
    latencies: Latencies,
    user_bytes: u64,
    disk_written: u64,
    disk_read: u64,
    cpu: f64,
    /// Bytes the engine counted itself writing in the phase (value log,
    /// index), where it counts them.
    engine_written: Option<(u64, u64)>,
}

/// Shared positions in the key sequence: keys `deleted..filled` are
/// present (entry `i` holds `key(i)`).
struct Keys {
    filled: AtomicU64,
    deleted: AtomicU64,
}

impl Keys {
    /// Entries present: filled and not deleted (a delete phase's threads
    /// may each take one position past the end before they stop).
    fn live(&self) -> u64 {
        let filled = self.filled.load(Ordering::Relaxed);
        filled - self.deleted.load(Ordering::Relaxed).min(filled)
    }
}

fn run_phase(
    engine: &dyn KvEngine,
    phase: Phase,
    threads: usize,
    value: &[u8],
    keys: &Keys,
    duration: Duration,
) -> Measured {
    let written_before = process_write_bytes();
    let engine_before = engine.written();
    let read_before = process_read_bytes();
    let cpu_before = cpu_seconds();
    let start = Instant::now();
    if phase == Phase::Reclaim {
        engine.reclaim();
        let mut latencies = Latencies::default();
        latencies.record(start.elapsed());
        return Measured {
            ops: 1,
            elapsed: start.elapsed(),
            latencies,
            user_bytes: 0,
            disk_written: process_write_bytes() - written_before,
            disk_read: process_read_bytes() - read_before,
            cpu: cpu_seconds() - cpu_before,
            engine_written: written_since(engine, engine_before),
        };
    }
    let stop = AtomicBool::new(false);
    let user_bytes = AtomicU64::new(0);
    let present = keys.filled.load(Ordering::Relaxed);
    let zipf = (phase == Phase::GetsZipf).then(|| Zipf::new(present, 0.99));
    let results: Vec<(u64, Latencies)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, user_bytes, zipf) = (&stop, &user_bytes, zipf.as_ref());
                s.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(t as u64 * 7919 + 1);
                    let mut latencies = Latencies::default();
                    let mut ops = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let put = match phase {
                            Phase::Puts => true,
                            Phase::Mixed => rng.random_bool(0.5),
                            _ => false,
                        };
                        // Keys below this may still be in flight in
                        // another thread's put.
                        let settled = |n: u64| n.saturating_sub(threads as u64 * 4).max(1);
                        let began = Instant::now();
                        if put {
                            let i = keys.filled.fetch_add(1, Ordering::Relaxed);
                            engine.put(&key(i), value);
                            user_bytes.fetch_add(value.len() as u64 + 32, Ordering::Relaxed);
                        } else {
                            match phase {
                                Phase::Exists => {
                                    let n = keys.filled.load(Ordering::Relaxed);
                                    let i = rng.random_range(0..n * 2);
                                    let present = engine.exists(&key(i));
                                    assert_eq!(present, i < n, "exists of entry {i} of {n}");
                                }
                                Phase::GetsZipf => {
                                    let rank = zipf.expect("zipf").sample(&mut rng);
                                    let i = present - 1 - rank;
                                    assert!(engine.get(&key(i)).is_some(), "entry {i}");
                                }
                                Phase::LastBefore => {
                                    let probe: [u8; 32] = rng.random();
                                    if let Some((found, _)) = engine.last_before(&probe) {
                                        assert!(found < probe, "a smaller key");
                                    }
                                }
                                Phase::Deletes => {
                                    let i = keys.deleted.fetch_add(1, Ordering::Relaxed);
                                    if i >= keys.filled.load(Ordering::Relaxed) {
                                        break;
                                    }
                                    engine.delete(&key(i));
                                }
                                _ => {
                                    let n = settled(keys.filled.load(Ordering::Relaxed));
                                    let i = rng.random_range(0..n);
                                    assert!(engine.get(&key(i)).is_some(), "entry {i}");
                                }
                            }
                        }
                        latencies.record(began.elapsed());
                        ops += 1;
                    }
                    (ops, latencies)
                })
            })
            .collect();
        while start.elapsed() < duration && !handles.iter().all(|h| h.is_finished()) {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| h.join().expect("worker"))
            .collect()
    });
    let elapsed = start.elapsed();
    // CPU over the timed window only (the flush below is not in `elapsed`);
    // its disk writes still count for the phase's amplification.
    let cpu = cpu_seconds() - cpu_before;
    engine.finish();
    let mut latencies = Latencies::default();
    let mut ops = 0;
    for (n, l) in results {
        ops += n;
        latencies.merge(l);
    }
    Measured {
        ops,
        elapsed,
        latencies,
        user_bytes: user_bytes.into_inner(),
        disk_written: process_write_bytes() - written_before,
        disk_read: process_read_bytes() - read_before,
        cpu,
        engine_written: written_since(engine, engine_before),
    }
}

/// What the engine counted itself writing since `before`.
fn written_since(engine: &dyn KvEngine, before: Option<(u64, u64)>) -> Option<(u64, u64)> {
    let ((log, index), (log0, index0)) = (engine.written()?, before?);
    Some((log - log0, index - index0))
}

/// Fills `entries` entries with two threads, as fast as the engine takes
/// them.
fn fill(engine: &dyn KvEngine, entries: u64, value: &[u8]) -> Duration {
    let next = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= entries {
                        break;
                    }
                    engine.put(&key(i), value);
                }
            });
        }
    });
    engine.finish();
    start.elapsed()
}

/// One result row, for the table and the JSON line.
struct Row {
    engine: String,
    settings: String,
    value_bytes: usize,
    threads: usize,
    entries: u64,
    /// Entries present after the phase (filled and not deleted).
    live: u64,
    phase: Phase,
    rate: f64,
    latency: (Duration, Duration, Duration),
    amplification: Option<f64>,
    /// The engine's own value-log and index bytes per user byte (the parts
    /// of `amplification` it counts).
    parts: Option<(f64, f64)>,
    read_per_op: f64,
    disk: u64,
    cores: f64,
    /// Dirty page-cache bytes found before the phase and the time taken to
    /// write them back (see `settle`).
    settled: (u64, Duration),
    detail: String,
}

const TABLE_HEADER: &str = "| engine | value | threads | phase | ops/s | p50 | p99 | p99.9 | disk bytes written / user byte | disk bytes read / op | disk used | CPU cores |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

impl Row {
    fn print(&self) {
        let (p50, p99, p999) = self.latency;
        let amplification = match (self.amplification, self.parts) {
            (Some(a), Some((log, index))) => format!("{a:.2} (log {log:.3}, index {index:.3})"),
            (Some(a), None) => format!("{a:.2}"),
            (None, _) => "-".into(),
        };
        println!(
            "| {} | {} B | {} | {} | {:.0} | {} | {} | {} | {} | {:.0} | {} MiB | {:.2} |",
            self.engine,
            self.value_bytes,
            self.threads,
            self.phase.name(),
            self.rate,
            human(p50),
            human(p99),
            human(p999),
            amplification,
            self.read_per_op,
            self.disk >> 20,
            self.cores
        );
        if !self.detail.is_empty() {
            eprintln!("  {} {}: {}", self.engine, self.phase.id(), self.detail);
        }
        let (dirty, took) = self.settled;
        if !took.is_zero() {
            eprintln!(
                "  {} {}: settled {} MiB of dirty pages first, in {}",
                self.engine,
                self.phase.id(),
                dirty >> 20,
                human(took)
            );
        }
    }

    /// The JSON line of this row, which stands for `runs` (this row among
    /// them) of the same engine, threads and phase.
    fn json(&self, label: &str, data_mib: u64, runs: &[&Row]) -> serde_json::Value {
        let round = |x: f64, digits: i32| {
            let scale = 10f64.powi(digits);
            (x * scale).round() / scale
        };
        let (p50, p99, p999) = self.latency;
        serde_json::json!({
            "label": label,
            "data_mib": data_mib,
            "engine": self.engine,
            "settings": self.settings,
            "value_bytes": self.value_bytes,
            "threads": self.threads,
            "entries": self.entries,
            "live_entries": self.live,
            "phase": self.phase.id(),
            "phase_name": self.phase.name(),
            "ops_per_s": round(self.rate, 1),
            "p50_ns": p50.as_nanos() as u64,
            "p99_ns": p99.as_nanos() as u64,
            "p999_ns": p999.as_nanos() as u64,
            "write_amplification": self.amplification.map(|a| round(a, 3)),
            "log_bytes_per_user_byte": self.parts.map(|p| round(p.0, 4)),
            "index_bytes_per_user_byte": self.parts.map(|p| round(p.1, 4)),
            "disk_read_bytes_per_op": round(self.read_per_op, 1),
            "disk_bytes": self.disk,
            "cpu_cores": round(self.cores, 3),
            "settle_dirty_mib": self.settled.0 >> 20,
            "settle_seconds": round(self.settled.1.as_secs_f64(), 2),
            "runs": runs.len(),
            "ops_per_s_runs": runs.iter().map(|r| round(r.rate, 1)).collect::<Vec<_>>(),
            "write_amplification_runs": runs
                .iter()
                .filter_map(|r| r.amplification.map(|a| round(a, 3)))
                .collect::<Vec<_>>(),
            "detail": self.detail,
        })
    }
}

/// For each (engine, threads, phase), in the order first measured: the
/// run with the median rate (the lower middle one for an even count) and
/// all the runs.
fn medians(runs: &[Vec<Row>]) -> Vec<(&Row, Vec<&Row>)> {
    let mut groups: Vec<Vec<&Row>> = Vec::new();
    for row in runs.iter().flatten() {
        let same = |g: &&mut Vec<&Row>| {
            let first = g[0];
            (&first.engine, first.threads, first.phase) == (&row.engine, row.threads, row.phase)
        };
        match groups.iter_mut().find(same) {
            Some(group) => group.push(row),
            None => groups.push(vec![row]),
        }
    }
    groups
        .into_iter()
        .map(|group| {
            let mut by_rate = group.clone();
            by_rate.sort_by(|a, b| a.rate.total_cmp(&b.rate));
            (by_rate[(by_rate.len() - 1) / 2], group)
        })
        .collect()
}

/// Measures the memcpy limits and runs every engine's sequence once, for
/// one value size; prints each row as it is measured.
fn run_once(
    args: &Args,
    phases: &[Phase],
    value_bytes: usize,
    entries: u64,
    data_mib: u64,
) -> anyhow::Result<Vec<Row>> {
    let duration = Duration::from_secs(args.seconds);
    let memory = args.memory_mib << 20;
    let max_threads = args.threads.iter().copied().max().unwrap_or(1);
    let mut rows = Vec::new();
    // The limit of a copy into a mapped log, at each thread count.
    let limits = if args.skip_limits {
        &[][..]
    } else {
        &args.threads[..]
    };
    for (&threads, files) in limits.iter().flat_map(|t| {
        [
            (t, LimitFiles::Kept),
            (t, LimitFiles::Released),
            (t, LimitFiles::Recycled),
        ]
    }) {
        let (copies, elapsed) = memcpy_limit(
            &args.dir.join("memcpy"),
            value_bytes + 32,
            threads,
            duration,
            files,
        )?;
        let row = Row {
            engine: files.engine_name().into(),
            settings: format!(
                "sequential memcpy of key+value into fresh fallocated mapped 256 MiB files, {}",
                files.describe()
            ),
            value_bytes,
            threads,
            entries: 0,
            live: 0,
            phase: Phase::Puts,
            rate: copies as f64 / elapsed.as_secs_f64(),
            latency: (Duration::ZERO, Duration::ZERO, Duration::ZERO),
            amplification: None,
            parts: None,
            read_per_op: 0.0,
            disk: 0,
            cores: 0.0,
            settled: (0, Duration::ZERO),
            detail: String::new(),
        };
        row.print();
        rows.push(row);
    }
    // Random bytes: no engine gains from compression.
    let mut value = vec![0u8; value_bytes];
    SmallRng::seed_from_u64(value_bytes as u64).fill(&mut value[..]);
    for name in &args.engines {
        let dir = args.dir.join(name);
        let (engine, settings) = open(name, &dir, memory, value_bytes)?;
        eprintln!("{name}: {settings}");
        let took = fill(engine.as_ref(), entries, &value);
        eprintln!(
            "{name}: filled {entries} entries of {value_bytes} B ({data_mib} MiB) in {}",
            human(took)
        );
        let keys = Keys {
            filled: AtomicU64::new(entries),
            deleted: AtomicU64::new(0),
        };
        for &threads in &args.threads {
            for &phase in phases {
                if phase.destructive() && threads != max_threads {
                    continue;
                }
                let settled = if args.no_settle {
                    (0, Duration::ZERO)
                } else {
                    settle()
                };
                let mut m = run_phase(engine.as_ref(), phase, threads, &value, &keys, duration);
                let elapsed = m.elapsed.as_secs_f64();
                let per_user_byte = |n: u64| n as f64 / m.user_bytes as f64;
                let row = Row {
                    engine: name.clone(),
                    settings: settings.clone(),
                    value_bytes,
                    threads,
                    entries: keys.filled.load(Ordering::Relaxed),
                    live: keys.live(),
                    phase,
                    rate: m.ops as f64 / elapsed,
                    latency: (
                        m.latencies.quantile(0.5),
                        m.latencies.quantile(0.99),
                        m.latencies.quantile(0.999),
                    ),
                    amplification: (m.user_bytes > 0).then(|| per_user_byte(m.disk_written)),
                    parts: m
                        .engine_written
                        .filter(|_| m.user_bytes > 0)
                        .map(|(log, index)| (per_user_byte(log), per_user_byte(index))),
                    read_per_op: m.disk_read as f64 / m.ops.max(1) as f64,
                    disk: dir_bytes(&dir),
                    cores: m.cpu / elapsed,
                    settled,
                    detail: engine.detail(),
                };
                row.print();
                rows.push(row);
            }
        }
        drop(engine);
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(rows)
}

impl Args {
    fn phase_list(&self) -> anyhow::Result<Vec<Phase>> {
        self.phases
            .iter()
            .map(|id| {
                Phase::ALL
                    .into_iter()
                    .find(|p| p.id() == id)
                    .with_context(|| format!("unknown phase {id:?}"))
            })
            .collect()
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let phases = args.phase_list()?;
    anyhow::ensure!(args.repeat >= 1, "--repeat must be at least 1");
    let append = |path: &Option<PathBuf>| -> anyhow::Result<Option<std::fs::File>> {
        let Some(path) = path else {
            return Ok(None);
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Some(file))
    };
    let mut json = append(&args.json)?;
    let mut runs_json = append(&args.runs_json)?;
    let entries_for = |value_bytes: usize| match args.data_mib {
        Some(mib) => (mib << 20) / (value_bytes as u64 + 32),
        None => args.entries,
    };
    println!(
        "engine-compare ({}): 32-byte uniform keys, {} s per phase, {} MiB memory per engine, \
         {} run(s) of every sequence. This machine's memory manager evicts page-cache data idle \
         for about a minute even when RAM is free: reads of data not touched in the last minute \
         come from disk.",
        args.label, args.seconds, args.memory_mib, args.repeat
    );
    for &value_bytes in &args.value_bytes {
        let entries = entries_for(value_bytes);
        let data_mib = (entries * (value_bytes as u64 + 32)) >> 20;
        let mut runs = Vec::new();
        for run in 1..=args.repeat {
            if args.repeat > 1 {
                println!("\nRun {run} of {} ({value_bytes} B values):\n", args.repeat);
            }
            println!("{TABLE_HEADER}");
            let rows = run_once(&args, &phases, value_bytes, entries, data_mib)?;
            if let Some(file) = runs_json.as_mut() {
                for row in &rows {
                    let mut line = row.json(&args.label, data_mib, &[row]);
                    line["run"] = run.into();
                    line["of"] = args.repeat.into();
                    writeln!(file, "{line}")?;
                }
                file.flush()?;
            }
            runs.push(rows);
        }
        let medians = medians(&runs);
        if args.repeat > 1 {
            println!(
                "\nMedian of {} runs by ops/s ({value_bytes} B values; each row is the median run's):\n",
                args.repeat
            );
            println!("{TABLE_HEADER}");
            for (row, _) in &medians {
                row.print();
            }
        }
        if let Some(file) = json.as_mut() {
            for (row, all) in &medians {
                writeln!(file, "{}", row.json(&args.label, data_mib, all))?;
            }
        }
    }
    Ok(())
}
