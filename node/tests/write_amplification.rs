//! A value reaches each replica's disk once: N MiB of 64 KiB values written
//! through a 3-replica shard on real files cost each replica at most
//! 1.2 × N bytes of engine writes (WAL records, index blobs) plus a fixed
//! overhead, before relocation. Where the directory is on a block device,
//! the kernel's count of bytes this process dirtied (`/proc/self/io`
//! `write_bytes`, which sees writes through memory mappings) must agree:
//! at most 3 × (1.2 × N) plus overhead for the three replicas.
//!
//! Prints its seed; replay with `CLUSTER_SEED=<seed>`.

mod support;

use support::elect;
use tidepool_engine::Durability;
use tidepool_node::replica::{Outcome, ReplicaConfig};
use tidepool_node::sim::{Pending, SimCluster, SimOptions, engine_config};

const VALUE_BYTES: usize = 64 << 10;
const TOTAL_BYTES: u64 = 24 << 20;
/// Fixed overhead per replica: Raft state records, sync marks, control
/// files, segment headers, page-granular re-dirtying of the log's tail.
const OVERHEAD_BYTES: u64 = 2 << 20;

fn engine_bytes(cluster: &mut SimCluster, id: u64) -> u64 {
    let counters = cluster.replica(id).unwrap().engine().metrics().counters;
    counters.wal_bytes_written + counters.index_bytes_written
}

#[test]
fn each_replica_writes_each_value_once() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut engine = engine_config();
    engine.wal_segment_bytes = 8 << 20;
    engine.index_segment_bytes = 1 << 20;
    engine.max_value_bytes = 1 << 20;
    engine.relocation_enabled = false;
    let mut replica = ReplicaConfig::new(0, 0);
    replica.durability = Durability::Synced;
    let options = SimOptions {
        replica,
        engine,
        disk_root: Some(root.path().to_path_buf()),
    };
    let mut cluster = SimCluster::with_options(seed, 3, options);
    elect(&mut cluster);
    let ids = cluster.ids();
    let before: Vec<u64> = ids
        .iter()
        .map(|id| engine_bytes(&mut cluster, *id))
        .collect();
    let io_before = tidepool_testkit::process_write_bytes();

    let count = TOTAL_BYTES / VALUE_BYTES as u64;
    let mut pending: Vec<Pending> = Vec::new();
    for i in 0..count {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&i.to_be_bytes());
        let value: Vec<u8> = (0..VALUE_BYTES)
            .map(|b| (b as u64 ^ i.wrapping_mul(0x9e37_79b9)) as u8)
            .collect();
        pending.push(cluster.put(key, value));
        if i % 8 == 7 {
            cluster.tick().unwrap();
        }
    }
    let applied_everywhere = cluster
        .run_until(500, |c| {
            let leader_commit = c
                .leader()
                .and_then(|l| c.replica(l))
                .map(|r| r.status().commit);
            pending.iter().all(|p| p.lock().unwrap().is_some())
                && c.ids()
                    .into_iter()
                    .all(|id| c.replica(id).map(|r| r.status().applied) == leader_commit)
        })
        .unwrap();
    assert!(applied_everywhere, "seed {seed}: writes did not complete");
    for p in &pending {
        assert!(matches!(*p.lock().unwrap(), Some(Outcome::Applied { .. })));
    }
    let io_written = tidepool_testkit::process_write_bytes() - io_before;

    let limit = TOTAL_BYTES * 12 / 10 + OVERHEAD_BYTES;
    for (id, before) in ids.iter().zip(before) {
        let written = engine_bytes(&mut cluster, *id) - before;
        println!(
            "node {id}: {written} bytes written for {TOTAL_BYTES} bytes of values ({:.3}x)",
            written as f64 / TOTAL_BYTES as f64
        );
        assert!(
            written >= TOTAL_BYTES,
            "node {id}: {written} bytes written, less than the values themselves"
        );
        assert!(
            written <= limit,
            "seed {seed}: node {id} wrote {written} bytes for {TOTAL_BYTES} bytes of values"
        );
    }
    if tidepool_testkit::on_block_device(root.path()) {
        println!(
            "process dirtied {io_written} bytes for 3 x {TOTAL_BYTES} ({:.3}x per replica)",
            io_written as f64 / (3 * TOTAL_BYTES) as f64
        );
        assert!(
            io_written >= 3 * TOTAL_BYTES,
            "the kernel counted {io_written} bytes: it does not see these writes"
        );
        assert!(
            io_written <= 3 * limit,
            "seed {seed}: the three replicas dirtied {io_written} bytes for {TOTAL_BYTES} bytes of values"
        );
    } else {
        println!(
            "{} is not on a block device: kernel count skipped",
            root.path().display()
        );
    }
}
