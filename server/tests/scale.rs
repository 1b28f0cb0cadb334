//! Many idle replicas in one process: `tidepool dev --shards 334` (three
//! nodes, 1,002 replicas) becomes ready and serves, and what it holds —
//! resident memory, threads, open files, allocated disk — stays within
//! generous bounds (the targets are for `make bench-scale`, which measures
//! a release build; this is a debug build sharing the machine with
//! nothing else of this binary).
//!
//! Before replicas were cheap this process took 330 s to become ready
//! and held 20 GB resident and 45 GB of disk (whole WAL and index segments
//! populated and reserved per replica).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use tidepool_client::{Client, ClientConfig};

const SHARDS: u32 = 334;
const REPLICAS: u64 = SHARDS as u64 * 3;

/// Bytes allocated on disk under `dir` (blocks, so holes do not count).
fn allocated_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let Ok(metadata) = entry.metadata() else {
            continue;
        };
        if metadata.is_dir() {
            total += allocated_bytes(&entry.path());
        } else {
            total += std::os::unix::fs::MetadataExt::blocks(&metadata) * 512;
        }
    }
    total
}

fn entries(path: &str) -> u64 {
    std::fs::read_dir(path).unwrap().count() as u64
}

#[test]
fn a_thousand_idle_replicas_open_and_serve() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let shards = SHARDS.to_string();
    let (child, banner) = support::start_dev_banner_within(
        dir.path(),
        &["--insecure", "--shards", &shards],
        Duration::from_secs(240),
    );
    let ready = started.elapsed();
    let url = support::banner_url(&banner);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // It serves: keys spread over the shards.
    runtime.block_on(async {
        let client = Client::with_config(ClientConfig::new(&[url]))
            .await
            .unwrap();
        for i in 0..64u32 {
            let key = format!("key-{i}");
            let value = format!("value-{i}");
            client
                .put("default", key.as_bytes(), value.as_bytes())
                .await
                .unwrap();
            assert_eq!(
                client.get("default", key.as_bytes()).await.unwrap(),
                value.as_bytes()
            );
        }
    });
    drop(runtime);
    let pid = child.id();
    let rss = support::status_kib(pid, "VmRSS:").expect("VmRSS") << 10;
    let threads = entries(&format!("/proc/{pid}/task"));
    let files = entries(&format!("/proc/{pid}/fd"));
    let disk = allocated_bytes(dir.path());
    drop(child);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{REPLICAS} replicas: ready in {ready:.1?}; resident {:.0} MiB ({:.2} MiB per replica), \
         {threads} threads, {files} open files, {:.0} MiB allocated on disk ({:.2} MiB per replica)",
        mib(rss),
        mib(rss) / REPLICAS as f64,
        mib(disk),
        mib(disk) / REPLICAS as f64,
    );
    // Generous: several times what a debug build measured here (1.0 GiB,
    // 5,059 files, 0.5 GiB). Threads do not grow with the replicas: each
    // node runs its engines' background work, their syncs and its Raft
    // owners on pools of twice the cores each (42 threads in all here on 2
    // cores; 8,019 when each replica had 8 of its own).
    assert!(
        rss < (3 * REPLICAS) << 20,
        "{:.0} MiB resident for {REPLICAS} idle replicas",
        mib(rss)
    );
    assert!(
        disk < (2 * REPLICAS) << 20,
        "{:.0} MiB allocated on disk for {REPLICAS} idle replicas",
        mib(disk)
    );
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    assert!(
        threads < 100 + 20 * cores,
        "{threads} threads for {REPLICAS} replicas on {cores} cores"
    );
    assert!(
        files < 10 * REPLICAS + 1_000,
        "{files} open files for {REPLICAS} replicas"
    );
}
