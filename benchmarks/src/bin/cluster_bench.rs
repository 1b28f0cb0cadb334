//! `cluster-bench` (`make bench-cluster`): Tidepool as a user runs it next
//! to SeaweedFS, on the same machine and disk, in one run (issue 38).
//!
//! - **Tidepool**: etcd (Debian's `etcd-server`), a coordinator and three
//!   nodes as separate processes on their default settings, every shard
//!   replicated three times; driven by `tidectl bench` (its own SDK
//!   client). Run twice: nodes configured `synced` (a majority fsyncs a
//!   write before its ack) and `buffered`.
//! - **SeaweedFS**: a master and three volume servers, replication `002`
//!   (three copies); driven by `weed benchmark` (its own client), writes
//!   with `-fsync` (each volume server fsyncs before answering) and
//!   without.
//!
//! For each value size and client count both tools do the same number of
//! operations: puts of new keys (Tidepool: `--distribution sequential`,
//! each key once), then `--get-passes` times as many reads of keys drawn
//! uniformly from those just written (Tidepool: linearizable gets from the
//! shard leaders, `--distribution uniform`; SeaweedFS: plain reads from
//! any replica, `weed benchmark -readOnly`, which draws its reads from the
//! written list the same way). Reads come from memory on both (the data
//! was written seconds before; the machine evicts page cache idle for
//! about a minute). Gets outnumber puts because they are many times
//! faster: one pass over the 1 KiB keys lasts about a second, too short to
//! compare.
//!
//! Also measured in the same run: the disk's sequential write limit (`dd
//! … conv=fdatasync`), so that large puts read as a fraction of `limit / 3`
//! (three copies on one disk), and each system's write amplification (the
//! bytes its storage processes wrote, `/proc/<pid>/io`, over the value
//! bytes times three).
//!
//! Output: a JSON line per phase (stdout and `--jsonl`), then a Markdown
//! table with the ratios.
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin cluster-bench --
//! [--weed PATH] [--sizes 1024,65536,1048576] [--clients 16,64] [--scale 1]
//! [--dir target/bench-cluster]`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use serde_json::{Value, json};
use tidepool_testkit::{EtcdServer, TestProcess};

#[derive(Parser)]
#[command(about = "Tidepool and SeaweedFS side by side: puts and gets at matched durability")]
struct Args {
    /// Value sizes, bytes.
    #[arg(long, value_delimiter = ',', default_value = "1024,65536,1048576")]
    sizes: Vec<usize>,
    /// Concurrent clients.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    clients: Vec<usize>,
    /// Multiplies the operations per phase (20,000 at 1 KiB, 8,000 at
    /// 64 KiB, 800 at 1 MiB; others scaled by bytes).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Gets per phase as a multiple of its puts (each drawn uniformly
    /// from the keys the puts wrote).
    #[arg(long, default_value_t = 5)]
    get_passes: u64,
    /// Tidepool's durabilities to run (`synced`, `buffered`).
    #[arg(long, value_delimiter = ',', default_value = "synced,buffered")]
    durabilities: Vec<String>,
    /// Extra `[raft]` settings of the Tidepool nodes, `key=value` (e.g.
    /// `lease_reads=false`, to measure a change against its absence).
    #[arg(long = "raft-setting")]
    raft_settings: Vec<String>,
    /// Shards of the Tidepool cluster.
    #[arg(long, default_value_t = 6)]
    shards: u32,
    /// The tidepool binary.
    #[arg(long, default_value = "target/release/tidepool")]
    tidepool: PathBuf,
    /// The tidectl binary.
    #[arg(long, default_value = "target/release/tidectl")]
    tidectl: PathBuf,
    /// SeaweedFS's `weed` binary (none: Tidepool alone).
    #[arg(long)]
    weed: Option<PathBuf>,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-cluster")]
    dir: PathBuf,
    /// JSON lines of every phase also go here.
    #[arg(long, default_value = "target/bench-cluster.jsonl")]
    jsonl: PathBuf,
}

/// Operations per phase for values of `size` bytes.
fn operations(size: usize, scale: f64) -> u64 {
    let base = match size {
        s if s <= 4 << 10 => 20_000.0,
        s if s <= 256 << 10 => 8_000.0 * (65_536.0 / s as f64).sqrt(),
        s => 800.0 * (1_048_576.0 / s as f64),
    };
    ((base * scale).round() as u64).max(16)
}

/// What one phase measured.
#[derive(Clone, Debug, Default)]
struct Phase {
    ops_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    failed: u64,
    /// Bytes the storage processes wrote over `3 × value bytes` (puts).
    amplification: Option<f64>,
}

/// Bytes written to storage by these processes so far.
fn written(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/io")).ok())
        .filter_map(|io| {
            io.lines()
                .find_map(|l| l.strip_prefix("write_bytes:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// A loopback port `p` with `p + 10000` free as well (SeaweedFS serves
/// gRPC there).
fn port_pair() -> u16 {
    loop {
        let port = tidepool_testkit::free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// The disk's sequential write rate, MiB/s: 1 GiB in 4 MiB blocks, then
/// fdatasync (`dd … conv=fdatasync`).
fn disk_limit(dir: &Path) -> anyhow::Result<f64> {
    let file = dir.join("dd.bin");
    let began = Instant::now();
    let output = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", file.display()))
        .args(["bs=4M", "count=256", "conv=fdatasync"])
        .output()
        .context("dd")?;
    let seconds = began.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&file);
    if !output.status.success() {
        bail!("dd failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(1024.0 / seconds)
}

/// A Tidepool cluster of separate processes.
struct Tidepool {
    _etcd: EtcdServer,
    coordinator: String,
    _processes: Vec<TestProcess>,
    node_pids: Vec<u32>,
}

impl Tidepool {
    fn start(args: &Args, durability: &str) -> anyhow::Result<Tidepool> {
        let dir = args.dir.join(format!("tidepool-{durability}"));
        std::fs::create_dir_all(&dir)?;
        let etcd = EtcdServer::start();
        let bin = args.tidepool.display().to_string();
        let port = tidepool_testkit::free_port();
        let coordinator = format!("http://127.0.0.1:{port}");
        let mut processes = vec![TestProcess::spawn(
            &bin,
            &[
                "coordinator".to_string(),
                "--insecure".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--etcd".into(),
                etcd.url.clone(),
                "--shards".into(),
                args.shards.to_string(),
                "--replication-factor".into(),
                "3".into(),
            ],
            dir.join("coordinator.log"),
        )];
        let config = dir.join("node.toml");
        let mut raft = format!("[raft]\ndurability = \"{durability}\"\n");
        for setting in &args.raft_settings {
            raft.push_str(&setting.replacen('=', " = ", 1));
            raft.push('\n');
        }
        std::fs::write(&config, raft)?;
        let mut node_pids = Vec::new();
        for id in 1..=3 {
            let data = dir.join(format!("node-{id}"));
            std::fs::create_dir_all(&data)?;
            let node = TestProcess::spawn(
                &bin,
                &[
                    "node".to_string(),
                    "--insecure".into(),
                    "--config".into(),
                    config.display().to_string(),
                    "--node-id".into(),
                    id.to_string(),
                    "--listen".into(),
                    format!("127.0.0.1:{}", tidepool_testkit::free_port()),
                    "--data-dir".into(),
                    data.display().to_string(),
                    "--coordinator".into(),
                    coordinator.clone(),
                ],
                dir.join(format!("node-{id}.log")),
            );
            node_pids.push(node.pid());
            processes.push(node);
        }
        let tidepool = Tidepool {
            _etcd: etcd,
            coordinator,
            _processes: processes,
            node_pids,
        };
        // Ready once the namespace exists and a burst of puts reaches
        // every shard's leader.
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut ready = false;
        while Instant::now() < deadline {
            let created = tidepool.tidectl(args, &["namespace", "create", "bench"])?;
            let exists = String::from_utf8_lossy(&created.stderr).contains("ALREADY_EXISTS");
            if created.status.success() || exists {
                let warm = tidepool.tidectl(
                    args,
                    &[
                        "bench",
                        "bench",
                        "--count",
                        "300",
                        "--seconds",
                        "0",
                        "--prefix",
                        "warm",
                    ],
                )?;
                if warm.status.success() {
                    ready = true;
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        if !ready {
            bail!(
                "the Tidepool cluster did not become ready; logs in {}",
                dir.display()
            );
        }
        Ok(tidepool)
    }

    fn tidectl(&self, args: &Args, more: &[&str]) -> anyhow::Result<std::process::Output> {
        Command::new(&args.tidectl)
            .args([
                "--insecure",
                "--coordinator",
                &self.coordinator,
                "--timeout",
                "30",
            ])
            .args(more)
            .output()
            .with_context(|| format!("cannot run {}", args.tidectl.display()))
    }

    /// One `tidectl bench` phase: `op` (`put` or `get`) over keys
    /// `<prefix>-0 ..` each taken once.
    fn phase(
        &self,
        args: &Args,
        op: &str,
        prefix: &str,
        size: usize,
        clients: usize,
        (count, keys): (u64, u64),
    ) -> anyhow::Result<Phase> {
        let before = written(&self.node_pids);
        // Puts write each key once; gets draw from the keys written.
        let distribution = if op == "put" { "sequential" } else { "uniform" };
        let (size, clients, count, keys) = (
            size.to_string(),
            clients.to_string(),
            count.to_string(),
            keys.to_string(),
        );
        let output = self.tidectl(
            args,
            &[
                "--json",
                "bench",
                "bench",
                "--mix",
                &format!("{op}=1"),
                "--size",
                &size,
                "--concurrency",
                &clients,
                "--count",
                &count,
                "--keys",
                &keys,
                "--seconds",
                "0",
                "--distribution",
                distribution,
                "--no-prefill",
                "--prefix",
                prefix,
                "--seed",
                "1",
            ],
        )?;
        let after = written(&self.node_pids);
        // The report is the first JSON value; a run with failed operations
        // prints its error as a second one (and exits 1): the failures are
        // counted in the report, not a reason to stop the whole benchmark.
        let report: Value = serde_json::Deserializer::from_slice(&output.stdout)
            .into_iter::<Value>()
            .next()
            .transpose()
            .ok()
            .flatten()
            .with_context(|| {
                format!(
                    "tidectl bench printed no report:\n{}",
                    String::from_utf8_lossy(&output.stderr)
                )
            })?;
        let row = &report["ops"][op];
        let errors: u64 = row["errors"]
            .as_object()
            .map(|e| e.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        let values = row["count"].as_u64().unwrap_or(0) * size.parse::<u64>()?;
        Ok(Phase {
            ops_per_s: row["ops_per_s"].as_f64().unwrap_or(0.0),
            p50_ms: row["p50_us"].as_f64().unwrap_or(0.0) / 1e3,
            p99_ms: row["p99_us"].as_f64().unwrap_or(0.0) / 1e3,
            failed: errors,
            amplification: (op == "put" && values > 0)
                .then(|| (after - before) as f64 / (3 * values) as f64),
        })
    }
}

/// A SeaweedFS cluster: a master and three volume servers.
struct SeaweedFs {
    weed: PathBuf,
    master: String,
    dir: PathBuf,
    _processes: Vec<TestProcess>,
    volume_pids: Vec<u32>,
}

impl SeaweedFs {
    fn start(weed: &Path, dir: &Path) -> anyhow::Result<SeaweedFs> {
        let dir = dir.join("seaweedfs");
        std::fs::create_dir_all(dir.join("master"))?;
        let bin = weed.display().to_string();
        let port = port_pair();
        let master = format!("127.0.0.1:{port}");
        let mut processes = vec![TestProcess::spawn(
            &bin,
            &[
                "master".to_string(),
                "-ip=127.0.0.1".into(),
                format!("-port={port}"),
                format!("-mdir={}", dir.join("master").display()),
                "-volumeSizeLimitMB=1024".into(),
                "-peers=none".into(),
            ],
            dir.join("master.log"),
        )];
        let mut volume_pids = Vec::new();
        for i in 1..=3 {
            let data = dir.join(format!("volume-{i}"));
            std::fs::create_dir_all(&data)?;
            let volume = TestProcess::spawn(
                &bin,
                &[
                    "volume".to_string(),
                    "-ip=127.0.0.1".into(),
                    format!("-port={}", port_pair()),
                    format!("-dir={}", data.display()),
                    format!("-master={master}"),
                    "-max=100".into(),
                ],
                dir.join(format!("volume-{i}.log")),
            );
            volume_pids.push(volume.pid());
            processes.push(volume);
        }
        let cluster = SeaweedFs {
            weed: weed.to_path_buf(),
            master,
            dir,
            _processes: processes,
            volume_pids,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            let list = cluster.dir.join("warm.list");
            if let Ok((phase, _)) = cluster.benchmark(&["-writeOnly"], &list, 1024, 4, 64, "warm")
                && phase.failed == 0
                && phase.ops_per_s > 0.0
            {
                return Ok(cluster);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        bail!(
            "SeaweedFS did not become ready; logs in {}",
            cluster.dir.display()
        )
    }

    /// One `weed benchmark` run; returns its phase and full output.
    fn benchmark(
        &self,
        mode: &[&str],
        list: &Path,
        size: usize,
        clients: usize,
        count: u64,
        collection: &str,
    ) -> anyhow::Result<(Phase, String)> {
        let before = written(&self.volume_pids);
        let output = Command::new(&self.weed)
            .arg("benchmark")
            .arg(format!("-master={}", self.master))
            .arg(format!("-c={clients}"))
            .arg(format!("-n={count}"))
            .arg(format!("-size={size}"))
            .arg("-replication=002")
            .arg(format!("-collection={collection}"))
            .arg(format!("-list={}", list.display()))
            .args(mode)
            .output()
            .context("weed benchmark")?;
        let after = written(&self.volume_pids);
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        let mut phase = parse_weed(&text).with_context(|| {
            format!(
                "weed benchmark printed no summary:\n{text}\n{}",
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
        if mode.contains(&"-writeOnly") {
            // weed pads each value with 0–63 random bytes.
            let values = count * (size as u64 + 32);
            phase.amplification = Some((after - before) as f64 / (3 * values) as f64);
        }
        Ok((phase, text))
    }
}

impl SeaweedFs {
    /// Deletes a collection's volumes (the master's `/col/delete`), so
    /// that the phases after it have the disk space.
    fn delete_collection(&self, collection: &str) -> anyhow::Result<()> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(&self.master)?;
        write!(
            stream,
            "GET /col/delete?collection={collection} HTTP/1.0\r\nHost: {}\r\n\r\n",
            self.master
        )?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        if !answer.starts_with("HTTP/1.1 2") && !answer.starts_with("HTTP/1.0 2") {
            bail!("deleting collection {collection}: {answer}");
        }
        Ok(())
    }
}

/// The summary `weed benchmark` prints after a run.
fn parse_weed(text: &str) -> Option<Phase> {
    let field = |name: &str| -> Option<f64> {
        text.lines()
            .rev()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    let percentile = |p: &str| -> Option<f64> {
        text.lines().rev().find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next()? == p).then_some(())?;
            words.next()?.parse().ok()
        })
    };
    Some(Phase {
        ops_per_s: field("Requests per second:")?,
        failed: field("Failed requests:")? as u64,
        p50_ms: percentile("50%").unwrap_or(0.0),
        p99_ms: percentile("99%").unwrap_or(0.0),
        amplification: None,
    })
}

fn label(size: usize) -> String {
    if size >= 1 << 20 && size.is_multiple_of(1 << 20) {
        format!("{} MiB", size >> 20)
    } else if size >= 1 << 10 && size.is_multiple_of(1 << 10) {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    let mut lines = Vec::new();
    let mut emit = |line: Value| {
        println!("{line}");
        lines.push(line.to_string());
    };
    let limit = disk_limit(&args.dir)?;
    eprintln!("disk: {limit:.0} MiB/s sequential (dd, 1 GiB, fdatasync)");
    emit(json!({"system": "disk", "sequential_write_mib_per_s": limit}));
    // (system, durability or op, size, clients) -> phase
    let mut results: BTreeMap<(String, String, usize, usize), Phase> = BTreeMap::new();
    let mut record = |system: &str,
                      what: &str,
                      size: usize,
                      clients: usize,
                      phase: Phase,
                      emit: &mut dyn FnMut(Value)| {
        eprintln!(
            "{system} {what} {} x{clients}: {:.0}/s p50 {:.1} ms p99 {:.1} ms failed {}{}",
            label(size),
            phase.ops_per_s,
            phase.p50_ms,
            phase.p99_ms,
            phase.failed,
            phase
                .amplification
                .map(|a| format!(" amplification {a:.2}"))
                .unwrap_or_default()
        );
        emit(json!({
            "system": system, "phase": what, "value_bytes": size, "clients": clients,
            "ops_per_s": phase.ops_per_s, "mib_per_s": phase.ops_per_s * size as f64 / 1048576.0,
            "p50_ms": phase.p50_ms, "p99_ms": phase.p99_ms, "failed": phase.failed,
            "write_amplification": phase.amplification,
        }));
        results.insert((system.into(), what.into(), size, clients), phase);
    };
    for durability in args.durabilities.iter().map(String::as_str) {
        let cluster = Tidepool::start(&args, durability)?;
        for &size in &args.sizes {
            for &clients in &args.clients {
                let count = operations(size, args.scale);
                let prefix = format!("{durability}-{size}-{clients}");
                let put = cluster.phase(&args, "put", &prefix, size, clients, (count, count))?;
                record(
                    "tidepool",
                    &format!("put {durability}"),
                    size,
                    clients,
                    put,
                    &mut emit,
                );
                if durability == "synced" {
                    let gets = count * args.get_passes;
                    let get = cluster.phase(&args, "get", &prefix, size, clients, (gets, count))?;
                    record("tidepool", "get", size, clients, get, &mut emit);
                }
            }
        }
        // Its data goes before the next system writes (the disk is shared).
        drop(cluster);
        std::fs::remove_dir_all(args.dir.join(format!("tidepool-{durability}")))?;
    }
    if let Some(weed) = &args.weed {
        let cluster = SeaweedFs::start(weed, &args.dir)?;
        for &size in &args.sizes {
            for &clients in &args.clients {
                let count = operations(size, args.scale);
                for (what, fsync) in [("put synced", true), ("put buffered", false)] {
                    let list = cluster.dir.join(format!("{size}-{clients}-{fsync}.list"));
                    let collection = format!("b{size}c{clients}{}", if fsync { "s" } else { "b" });
                    let mut mode = vec!["-writeOnly"];
                    if fsync {
                        mode.push("-fsync");
                    }
                    let (put, _) =
                        cluster.benchmark(&mode, &list, size, clients, count, &collection)?;
                    record("seaweedfs", what, size, clients, put, &mut emit);
                    if fsync {
                        let (get, _) = cluster.benchmark(
                            &["-readOnly"],
                            &list,
                            size,
                            clients,
                            count * args.get_passes,
                            &collection,
                        )?;
                        record("seaweedfs", "get", size, clients, get, &mut emit);
                    }
                    cluster.delete_collection(&collection)?;
                }
            }
        }
    }
    std::fs::write(&args.jsonl, lines.join("\n") + "\n")?;
    println!();
    println!(
        "| size | clients | operation | Tidepool /s | SeaweedFS /s | Tidepool ÷ SeaweedFS | Tidepool p50 / p99 ms | SeaweedFS p50 / p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &size in &args.sizes {
        for &clients in &args.clients {
            for what in ["put synced", "put buffered", "get"] {
                let key = |system: &str| (system.to_string(), what.to_string(), size, clients);
                let Some(ours) = results.get(&key("tidepool")) else {
                    continue;
                };
                let theirs = results.get(&key("seaweedfs"));
                println!(
                    "| {} | {clients} | {what}{} | {:.0} | {} | {} | {:.1} / {:.1} | {} |",
                    label(size),
                    if what == "put synced" {
                        " (SeaweedFS -fsync)"
                    } else {
                        ""
                    },
                    ours.ops_per_s,
                    theirs
                        .map(|t| format!("{:.0}", t.ops_per_s))
                        .unwrap_or("–".into()),
                    theirs
                        .map(|t| format!("**{:.2}×**", ours.ops_per_s / t.ops_per_s))
                        .unwrap_or("–".into()),
                    ours.p50_ms,
                    ours.p99_ms,
                    theirs
                        .map(|t| format!("{:.1} / {:.1}", t.p50_ms, t.p99_ms))
                        .unwrap_or("–".into()),
                );
            }
        }
    }
    println!();
    println!(
        "Disk: {limit:.0} MiB/s sequential; limit ÷ 3 copies = {:.0} MiB/s.",
        limit / 3.0
    );
    for &size in &args.sizes {
        for &clients in &args.clients {
            for what in ["put synced", "put buffered"] {
                for system in ["tidepool", "seaweedfs"] {
                    if let Some(p) =
                        results.get(&(system.to_string(), what.to_string(), size, clients))
                    {
                        let mib = p.ops_per_s * size as f64 / 1048576.0;
                        println!(
                            "- {system} {what} {} ×{clients}: {mib:.1} MiB/s = {:.2} of limit ÷ 3; write amplification per replica {}",
                            label(size),
                            mib / (limit / 3.0),
                            p.amplification
                                .map(|a| format!("{a:.2}"))
                                .unwrap_or("–".into())
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weed_summary_parses() {
        let text = "\n------------ Writing Benchmark ----------\nCompleted 10 of 100 requests, 10.0% 5.0/s 0.0MB/s\n\nConcurrency Level:      16\nTime taken for tests:   2.000 seconds\nCompleted requests:      100\nFailed requests:        2\nTotal transferred:      106400 bytes\nRequests per second:    50.00 [#/sec]\n\nPercentage of the requests served within a certain time (ms)\n   50%      3.1 ms\n   99%     12.5 ms\n  100%     20.0 ms\n";
        let phase = parse_weed(text).unwrap();
        assert_eq!(phase.ops_per_s, 50.0);
        assert_eq!(phase.failed, 2);
        assert_eq!(phase.p50_ms, 3.1);
        assert_eq!(phase.p99_ms, 12.5);
        assert!(parse_weed("no summary").is_none());
        assert_eq!(operations(1024, 1.0), 20_000);
        assert_eq!(operations(1 << 20, 0.5), 400);
    }
}
