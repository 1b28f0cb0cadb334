//! Benchmarks of Tidepool, with the peer each is compared against measured
//! in the same run. Heavy peers (RocksDB) will sit behind a feature so
//! `make ci` never builds them; `make bench` does.
//!
//! What this crate is **not**: a place for timing assertions. Results are
//! recorded, with the command that produced them, in `benchmarks/RESULTS.md`.
//!
//! Binaries:
//! - `engine-put`: engine put throughput with 1 and 2 threads next to the
//!   `memcpy`-into-mmap limit of the same machine.
//! - `engine-reclaim`: a delete-heavy workload with relocation off and on.
//! - `node-shard`: a 3-replica shard of real nodes over loopback gRPC with
//!   concurrent clients, next to a single engine driven the same way.
//! - `split-bench`: a growing dev cluster splitting its shards, next to the
//!   same load with splits off (`make bench-split`).
//! - `engine-compare` (feature `peers`): the engine next to RocksDB and
//!   BlobDB in one process, every workload of issue 5, with the
//!   `memcpy`-into-mmap limit; `benchmarks/plot.py` draws its tables and
//!   charts (`make bench-engine`).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::sync::Arc;

use tidepool_engine::storage::{FileStorage, Storage, StorageFile};

/// Latencies of one run, exact (every sample kept).
#[derive(Debug, Default)]
pub struct Latencies {
    samples_ns: Vec<u64>,
    sorted: bool,
}

impl Latencies {
    /// Records one operation's latency.
    pub fn record(&mut self, latency: Duration) {
        self.samples_ns
            .push(u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
        self.sorted = false;
    }

    /// Adds another run's samples.
    pub fn merge(&mut self, other: Latencies) {
        self.samples_ns.extend(other.samples_ns);
        self.sorted = false;
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.samples_ns.len() as u64
    }

    /// The `q`-quantile (0.0–1.0), or zero without samples.
    pub fn quantile(&mut self, q: f64) -> Duration {
        if self.samples_ns.is_empty() {
            return Duration::ZERO;
        }
        if !self.sorted {
            self.samples_ns.sort_unstable();
            self.sorted = true;
        }
        let rank = ((self.samples_ns.len() - 1) as f64 * q).round() as usize;
        Duration::from_nanos(self.samples_ns[rank])
    }
}

/// A duration in the unit that reads best (µs below 10 ms, else ms).
pub fn human(d: Duration) -> String {
    if d < Duration::from_millis(10) {
        format!("{:.0} µs", d.as_secs_f64() * 1e6)
    } else {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    }
}

/// What [`memcpy_limit`] does with a file it has filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitFiles {
    /// Keep it until the end, as a log that is the store keeps its data:
    /// every copy lands in page-cache memory not used before, and the
    /// kernel writes the dirty pages back meanwhile — what a store's write
    /// path pays too. The limit the engine is held to.
    Kept,
    /// Keep it, and have a background thread sync it and drop its pages
    /// from the page cache (`POSIX_FADV_DONTNEED`) as soon as it is full —
    /// what the engine's syncer does to sealed segments once they are
    /// synced (`Config::wal_cached_bytes`, here with nothing kept): the
    /// next files reuse that memory, and every byte is still written to
    /// the disk.
    Released,
    /// Remove it at once: the next file reuses the freed (already touched)
    /// memory and its dirty pages are never written. An upper bound no
    /// store that keeps its data can reach; shown for reference.
    Recycled,
}

impl LimitFiles {
    /// The name of the limit in results.
    pub fn engine_name(self) -> &'static str {
        match self {
            LimitFiles::Kept => "memcpy-mmap",
            LimitFiles::Released => "memcpy-mmap-released",
            LimitFiles::Recycled => "memcpy-mmap-recycled",
        }
    }

    /// What becomes of the files, for result tables.
    pub fn describe(self) -> &'static str {
        match self {
            LimitFiles::Kept => "files kept in the page cache",
            LimitFiles::Released => "files kept, synced and released from the page cache",
            LimitFiles::Recycled => "files recycled (reference)",
        }
    }
}

/// Sequential `memcpy` of `chunk`-byte pieces into fresh, fallocated,
/// mapped 256 MiB files (through the engine's own storage seam) by
/// `threads` threads, each filling files of its own, for `duration`: the
/// limit of any write path that copies values into a mapped log on this
/// machine. Returns the pieces copied and the time taken. Filled files are
/// kept or removed at once (`files`); all are removed at the end.
///
/// On this virtual machine the difference matters: touching page-cache
/// memory for the first time costs several times the copy (the host backs
/// guest memory lazily and takes back what sits idle).
pub fn memcpy_limit(
    dir: &Path,
    chunk: usize,
    threads: usize,
    duration: Duration,
    files: LimitFiles,
) -> anyhow::Result<(u64, Duration)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let copies = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let copies = &copies;
                s.spawn(move || -> anyhow::Result<()> {
                    let storage = FileStorage::new();
                    let source = vec![0x5Au8; chunk];
                    let mut mine = 0u64;
                    // Syncs and releases full files behind the copy (Released).
                    let (full_tx, full_rx) = std::sync::mpsc::channel::<Arc<dyn StorageFile>>();
                    let releaser = std::thread::spawn(move || -> std::io::Result<()> {
                        for file in full_rx {
                            file.sync_all()?;
                            file.evict_cache()?;
                        }
                        Ok(())
                    });
                    for file_number in 0.. {
                        if start.elapsed() >= duration {
                            break;
                        }
                        let path = dir.join(format!("memcpy-{t}-{file_number}"));
                        let file = storage.create(&path, 256 << 20)?;
                        let mapping = file.map(false)?;
                        while let Ok(mut region) = mapping.claim(chunk as u64) {
                            region.copy_from_slice(&source);
                            mine += 1;
                            if mine.is_multiple_of(4096) && start.elapsed() >= duration {
                                break;
                            }
                        }
                        drop(mapping);
                        match files {
                            LimitFiles::Kept => {}
                            LimitFiles::Released => full_tx.send(file)?,
                            LimitFiles::Recycled => storage.remove(&path)?,
                        }
                    }
                    copies.fetch_add(mine, Ordering::Relaxed);
                    drop(full_tx);
                    releaser.join().expect("releaser")?;
                    Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("memcpy worker")?;
        }
        Ok(())
    })?;
    let elapsed = start.elapsed();
    let _ = std::fs::remove_dir_all(dir);
    Ok((copies.into_inner(), elapsed))
}

/// A `tidepool dev --insecure` process on free ports, killed when dropped.
pub struct DevProcess {
    /// The process.
    pub child: std::process::Child,
    /// Its ready banner, line by line.
    pub banner: Vec<String>,
}

impl DevProcess {
    /// Starts `tidepool dev --insecure --port 0` with its data in
    /// `dir/data` (emptied first), its log in `dir/dev.log`, and `extra`
    /// arguments; returns once it printed its ready banner.
    pub fn start(tidepool: &Path, dir: &Path, extra: &[&str]) -> anyhow::Result<DevProcess> {
        use anyhow::Context;
        use std::io::BufRead;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        let mut child = std::process::Command::new(tidepool)
            .args(["dev", "--insecure", "--port", "0", "--data-dir"])
            .arg(dir.join("data"))
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(dir.join("dev.log"))?)
            .spawn()
            .with_context(|| format!("cannot run {}", tidepool.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut banner = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line?;
            let last = line.starts_with("Ctrl-C");
            banner.push(line);
            if last {
                break;
            }
        }
        Ok(DevProcess { child, banner })
    }

    /// The first banner word that `pick` maps to something.
    pub fn find<T>(&self, pick: impl Fn(&str) -> Option<T>) -> anyhow::Result<T> {
        self.banner
            .iter()
            .flat_map(|l| l.split_whitespace())
            .find_map(pick)
            .ok_or_else(|| anyhow::anyhow!("unexpected banner:\n{}", self.banner.join("\n")))
    }

    /// The coordinator's URL from the banner.
    pub fn coordinator(&self) -> anyhow::Result<String> {
        self.find(|w| {
            w.starts_with("http://")
                .then(|| w.trim_end_matches(',').to_string())
        })
    }
}

impl Drop for DevProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Fields of `/proc/<pid>/stat` after the command name (which may hold
/// spaces), as numbers of clock ticks (100 a second on Linux): the user and
/// system CPU of the process (fields 14, 15 of the line) or of its
/// waited-for children (16, 17).
fn stat_seconds(pid: &str, fields: [usize; 2]) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let all: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields
        .iter()
        .filter_map(|i| all.get(*i).and_then(|f| f.parse::<f64>().ok()))
        .sum();
    ticks / 100.0
}

/// CPU seconds (user + system) process `pid` has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    stat_seconds(&pid.to_string(), [11, 12])
}

/// CPU seconds (user + system) this process's children used, counting
/// those it has waited for.
pub fn children_cpu_seconds() -> f64 {
    stat_seconds("self", [13, 14])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_exact_ranks() {
        let mut l = Latencies::default();
        for ms in (1..=100).rev() {
            l.record(Duration::from_millis(ms));
        }
        assert_eq!(l.count(), 100);
        assert_eq!(l.quantile(0.0), Duration::from_millis(1));
        assert_eq!(l.quantile(0.5), Duration::from_millis(51));
        assert_eq!(l.quantile(0.99), Duration::from_millis(99));
        assert_eq!(l.quantile(1.0), Duration::from_millis(100));
        assert_eq!(Latencies::default().quantile(0.5), Duration::ZERO);
    }
}
