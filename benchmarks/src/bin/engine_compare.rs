//! `engine-compare`: Tidepool's engine, RocksDB (leveled LSM) and BlobDB
//! (RocksDB with blob files) side by side in one process, on the same
//! keys and values, driven through one trait — with the `memcpy`-into-mmap
//! limit measured in the same run. Built only with the `peers` feature
//! (the `rocksdb` crate compiles RocksDB from C++): `make bench-engine`.
//!
//! For each engine, value size and thread count: fill `--entries` keys,
//! then fixed-duration phases — 100% puts of new keys, 50/50 get/put, 100%
//! gets of present keys, 100% exists (half present, half absent). Each
//! phase reports ops/s, p50/p99/p99.9 latency, bytes written to disk per
//! user byte (`/proc/self/io`), disk usage and CPU cores used; one JSON
//! line per phase goes to `--json`, a Markdown table to stdout.
//!
//! Status (issue 5, first increment): the fits-in-memory size and four of
//! the workloads; Zipf gets, reverse lookups, delete phases, the
//! larger-than-memory size and the charts are not built yet.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_benchmarks::{Latencies, human};
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpace, KeySpaceConfig};
use tidepool_testkit::process_write_bytes;

#[derive(Debug, Parser)]
struct Args {
    /// Seconds each phase runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Entries filled before the phases.
    #[arg(long, default_value_t = 200_000)]
    entries: u64,
    /// Value sizes, bytes.
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    value_bytes: Vec<usize>,
    /// Thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Memory each engine may use for caches and indexes, MiB.
    #[arg(long, default_value_t = 256)]
    memory_mib: u64,
    /// Engines to run.
    #[arg(long, value_delimiter = ',', default_value = "tidepool,rocksdb,blobdb")]
    engines: Vec<String>,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-compare")]
    dir: PathBuf,
    /// Append one JSON line per phase here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// What the benchmark needs of an engine.
trait KvEngine: Send + Sync {
    fn put(&self, key: &[u8; 32], value: &[u8]);
    fn get(&self, key: &[u8; 32]) -> Option<usize>;
    fn exists(&self, key: &[u8; 32]) -> bool;
    fn finish(&self);
}

struct Tidepool {
    engine: Engine,
    space: KeySpace,
}

impl KvEngine for Tidepool {
    fn put(&self, key: &[u8; 32], value: &[u8]) {
        self.engine
            .put(self.space, key, value, Durability::Buffered)
            .expect("tidepool put");
    }
    fn get(&self, key: &[u8; 32]) -> Option<usize> {
        self.engine
            .get(self.space, key)
            .expect("tidepool get")
            .map(|v| v.len())
    }
    fn exists(&self, key: &[u8; 32]) -> bool {
        self.engine
            .exists(self.space, key)
            .expect("tidepool exists")
    }
    fn finish(&self) {
        self.engine.flush().expect("tidepool flush");
    }
}

struct Rocks {
    db: rocksdb::DB,
    write: rocksdb::WriteOptions,
}

impl KvEngine for Rocks {
    fn put(&self, key: &[u8; 32], value: &[u8]) {
        self.db
            .put_opt(key, value, &self.write)
            .expect("rocksdb put");
    }
    fn get(&self, key: &[u8; 32]) -> Option<usize> {
        self.db
            .get_pinned(key)
            .expect("rocksdb get")
            .map(|v| v.len())
    }
    fn exists(&self, key: &[u8; 32]) -> bool {
        // What a blob store's "exists" must be: exact (a bloom filter's
        // "maybe" is checked by a read).
        self.db.get_pinned(key).expect("rocksdb get").is_some()
    }
    fn finish(&self) {
        self.db.flush().expect("rocksdb flush");
    }
}

fn open(
    name: &str,
    dir: &Path,
    memory: u64,
    value_bytes: usize,
) -> anyhow::Result<(Box<dyn KvEngine>, String)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    match name {
        "tidepool" => {
            let mut config = Config::new(dir);
            config.wal_segment_bytes = 256 << 20;
            config.index_memory_bytes = memory * 3 / 4;
            config.value_cache_bytes = memory / 4;
            config.max_value_bytes = (value_bytes as u64).max(1 << 20);
            config.key_spaces = vec![KeySpaceConfig {
                name: "default".into(),
                key_bytes: 32,
                layout: CellLayout::Uniform { cells: 16_384 },
            }];
            let settings = format!(
                "WAL segments 256 MiB, index memory {} MiB, value cache {} MiB, 16384 cells, writes buffered (no fsync per write)",
                config.index_memory_bytes >> 20,
                config.value_cache_bytes >> 20
            );
            let engine = Engine::open(config).context("open tidepool")?;
            let space = engine.key_space("default")?;
            Ok((Box::new(Tidepool { engine, space }), settings))
        }
        "rocksdb" | "blobdb" => {
            let mut options = rocksdb::Options::default();
            options.create_if_missing(true);
            options.increase_parallelism(2);
            let mut table = rocksdb::BlockBasedOptions::default();
            let cache = rocksdb::Cache::new_lru_cache((memory / 2) as usize);
            table.set_block_cache(&cache);
            table.set_bloom_filter(10.0, false);
            table.set_cache_index_and_filter_blocks(true);
            options.set_block_based_table_factory(&table);
            options.set_write_buffer_size((memory / 4) as usize);
            options.set_max_write_buffer_number(2);
            let blob = name == "blobdb";
            if blob {
                options.set_enable_blob_files(true);
                options.set_min_blob_size(512);
                options.set_enable_blob_gc(true);
            }
            let mut write = rocksdb::WriteOptions::default();
            write.set_sync(false);
            write.disable_wal(false);
            let settings = format!(
                "leveled, WAL on, no sync per write, bloom 10 bits/key, block cache {} MiB, 2 memtables of {} MiB{}",
                (memory / 2) >> 20,
                (memory / 4) >> 20,
                if blob {
                    ", blob files for values >= 512 B, blob GC on"
                } else {
                    ""
                }
            );
            let db = rocksdb::DB::open(&options, dir).context("open rocksdb")?;
            Ok((Box::new(Rocks { db, write }), settings))
        }
        other => anyhow::bail!("unknown engine {other:?} (tidepool, rocksdb, blobdb)"),
    }
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

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Puts,
    Mixed,
    Gets,
    Exists,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Puts => "100% put (new keys)",
            Phase::Mixed => "50/50 get/put",
            Phase::Gets => "100% get (uniform)",
            Phase::Exists => "100% exists (half absent)",
        }
    }
}

struct Measured {
    ops: u64,
    elapsed: Duration,
    latencies: Latencies,
    user_bytes: u64,
    disk_written: u64,
    cpu: f64,
}

fn run_phase(
    engine: &dyn KvEngine,
    phase: Phase,
    threads: usize,
    value: &[u8],
    filled: &AtomicU64,
    duration: Duration,
) -> Measured {
    let stop = AtomicBool::new(false);
    let written_before = process_write_bytes();
    let cpu_before = cpu_seconds();
    let user_bytes = AtomicU64::new(0);
    let start = Instant::now();
    let results: Vec<(u64, Latencies)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, user_bytes) = (&stop, &user_bytes);
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
                        let began = Instant::now();
                        if put {
                            let i = filled.fetch_add(1, Ordering::Relaxed);
                            engine.put(&key(i), value);
                            user_bytes.fetch_add(value.len() as u64 + 32, Ordering::Relaxed);
                        } else if phase == Phase::Exists {
                            let n = filled.load(Ordering::Relaxed);
                            let i = rng.random_range(0..n * 2);
                            let present = engine.exists(&key(i));
                            assert_eq!(present, i < n, "exists of entry {i} of {n}");
                        } else {
                            let n = filled.load(Ordering::Relaxed);
                            let i =
                                rng.random_range(0..n.saturating_sub(threads as u64 * 4).max(1));
                            assert!(engine.get(&key(i)).is_some(), "entry {i} is present");
                        }
                        latencies.record(began.elapsed());
                        ops += 1;
                    }
                    (ops, latencies)
                })
            })
            .collect();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| h.join().expect("worker"))
            .collect()
    });
    let elapsed = start.elapsed();
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
        cpu: cpu_seconds() - cpu_before,
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let duration = Duration::from_secs(args.seconds);
    let memory = args.memory_mib << 20;
    let mut json = match &args.json {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => None,
    };
    println!(
        "engine-compare: {} entries filled, 32-byte uniform keys, {} s per phase, {} MiB memory per engine",
        args.entries, args.seconds, args.memory_mib
    );
    println!(
        "| engine | value | threads | phase | ops/s | p50 | p99 | p99.9 | disk bytes written / user byte | disk used | CPU cores |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &value_bytes in &args.value_bytes {
        // Random bytes: no engine gains from compression.
        let mut value = vec![0u8; value_bytes];
        SmallRng::seed_from_u64(value_bytes as u64).fill(&mut value[..]);
        for &threads in &args.threads {
            for name in &args.engines {
                let dir = args.dir.join(name);
                let (engine, settings) = open(name, &dir, memory, value_bytes)?;
                eprintln!("{name}: {settings}");
                let filled = AtomicU64::new(0);
                let fill_start = Instant::now();
                // Fill with two threads, as fast as the engine takes it.
                std::thread::scope(|s| {
                    for _ in 0..2 {
                        s.spawn(|| {
                            loop {
                                let i = filled.fetch_add(1, Ordering::Relaxed);
                                if i >= args.entries {
                                    break;
                                }
                                engine.put(&key(i), &value);
                            }
                        });
                    }
                });
                filled.store(args.entries, Ordering::Relaxed);
                engine.finish();
                eprintln!(
                    "{name}: filled {} entries in {}",
                    args.entries,
                    human(fill_start.elapsed())
                );
                for phase in [Phase::Puts, Phase::Mixed, Phase::Gets, Phase::Exists] {
                    let mut m =
                        run_phase(engine.as_ref(), phase, threads, &value, &filled, duration);
                    let rate = m.ops as f64 / m.elapsed.as_secs_f64();
                    let amplification = if m.user_bytes > 0 {
                        m.disk_written as f64 / m.user_bytes as f64
                    } else {
                        0.0
                    };
                    let disk = dir_bytes(&dir);
                    let cores = m.cpu / m.elapsed.as_secs_f64();
                    let (p50, p99, p999) = (
                        m.latencies.quantile(0.5),
                        m.latencies.quantile(0.99),
                        m.latencies.quantile(0.999),
                    );
                    println!(
                        "| {name} | {value_bytes} B | {threads} | {} | {rate:.0} | {} | {} | {} | {} | {} MiB | {cores:.2} |",
                        phase.name(),
                        human(p50),
                        human(p99),
                        human(p999),
                        if m.user_bytes > 0 {
                            format!("{amplification:.2}")
                        } else {
                            "-".into()
                        },
                        disk >> 20
                    );
                    if let Some(file) = json.as_mut() {
                        writeln!(
                            file,
                            "{{\"engine\":\"{name}\",\"settings\":\"{settings}\",\"value_bytes\":{value_bytes},\"threads\":{threads},\"entries\":{},\"phase\":\"{}\",\"ops_per_s\":{rate:.1},\"p50_ns\":{},\"p99_ns\":{},\"p999_ns\":{},\"write_amplification\":{amplification:.3},\"disk_bytes\":{disk},\"cpu_cores\":{cores:.3}}}",
                            args.entries,
                            phase.name(),
                            p50.as_nanos(),
                            p99.as_nanos(),
                            p999.as_nanos()
                        )?;
                    }
                }
                drop(engine);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    Ok(())
}
