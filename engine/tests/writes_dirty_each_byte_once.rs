//! The kernel's count of bytes this process dirtied (`/proc/self/io`
//! `write_bytes`, which sees writes through memory mappings) stays close to
//! what the engine appended: a value reaches the disk once. Checked for
//! synced writes (a sync per put, as a Raft log syncs per batch: pages the
//! log made writable ahead of its data would be written back as zeros at
//! every sync, then again once filled) and for a burst of buffered writes
//! (where the log makes pages writable ahead and may use large folios,
//! each bounded per sync), and for large records a replication layer
//! appends, each synced (written through the file, `pwritev`: its folios
//! are the kernel's choice, not the mapping's).
//! Skipped where the directory is not on a block device.

mod support;

use support::{key, value};
use tidepool_engine::{Config, Durability, Engine};

/// Engine bytes appended (value log and index log).
fn engine_bytes(engine: &Engine) -> u64 {
    let counters = engine.metrics().counters;
    counters.wal_bytes_written + counters.index_bytes_written
}

/// A new engine in a temporary directory on a block device (`None`
/// elsewhere), with 64 MiB value log segments and the background syncer
/// every `sync_interval_ms`.
fn open(sync_interval_ms: u64) -> Option<(tempfile::TempDir, Engine)> {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    if !tidepool_testkit::on_block_device(root.path()) {
        println!(
            "{} is not on a block device: skipped",
            root.path().display()
        );
        return None;
    }
    let mut config = Config::new(root.path().join("db"));
    config.wal_segment_bytes = 64 << 20;
    config.index_segment_bytes = 4 << 20;
    config.relocation_enabled = false;
    config.sync_interval_ms = sync_interval_ms;
    let engine = Engine::open(config).unwrap();
    Some((root, engine))
}

/// Writes `total` bytes of `value_bytes` values with `durability`, then
/// closes the engine; returns (engine bytes, bytes the kernel counted).
fn write(total: u64, value_bytes: usize, durability: Durability) -> Option<(u64, u64)> {
    let (_root, engine) = open(100)?;
    let ks = engine.key_space("default").unwrap();
    let io_before = tidepool_testkit::process_write_bytes();
    let before = engine_bytes(&engine);
    for i in 0..total / value_bytes as u64 {
        engine
            .put(ks, &key(i), &value(i, 1, value_bytes), durability)
            .unwrap();
    }
    engine.flush().unwrap();
    let appended = engine_bytes(&engine) - before;
    drop(engine);
    let dirtied = tidepool_testkit::process_write_bytes() - io_before;
    println!(
        "{durability:?}: {total} bytes of values, engine appended {appended}, kernel counted {dirtied} ({:.3}x the values)",
        dirtied as f64 / total as f64
    );
    Some((appended, dirtied))
}

/// One test: the kernel's count is per process, so the two workloads must
/// not run at the same time.
#[test]
fn synced_and_buffered_writes_are_dirtied_about_once() {
    synced_writes_are_dirtied_once();
    a_burst_of_buffered_writes_is_dirtied_about_once();
    synced_writes_after_a_burst_are_dirtied_once();
    synced_large_appends_are_dirtied_once();
}

fn synced_writes_are_dirtied_once() {
    // 12 MiB of 16 KiB values, each put synced: 768 syncs.
    let total = 12 << 20;
    if let Some((appended, dirtied)) = write(total, 16 << 10, Durability::Synced) {
        assert!(appended >= total);
        // Control files, sync marks, and the log's tail page dirtied again
        // by each sync (up to 4 KiB each).
        let overhead = (2 << 20) + 768 * 4096;
        assert!(
            dirtied <= appended + overhead,
            "the kernel counted {dirtied} bytes for {appended} appended"
        );
    }
}

fn a_burst_of_buffered_writes_is_dirtied_about_once() {
    // 192 MiB of 4 KiB values, buffered: the syncer runs every 100 ms.
    let total = 192 << 20;
    if let Some((appended, dirtied)) = write(total, 4 << 10, Durability::Buffered) {
        assert!(appended >= total);
        // Page folios: at most 1.5 chunks made writable ahead per sync of
        // at least 16 MiB. Large folios (a log writing 16 MiB or more per
        // sync gets them): at most one folio (2 MiB) more per such sync.
        assert!(
            dirtied <= appended + appended / 7 + (2 << 20),
            "the kernel counted {dirtied} bytes for {appended} appended"
        );
    }
}

/// A burst of buffered writes gets large folios for the segments mapped
/// while it lasts; synced writes after it would write the 2 MiB folio
/// holding the log's tail back at every sync, until those segments are
/// full. The log notices that it slowed down and gives the rest of its
/// active segment page folios.
fn synced_writes_after_a_burst_are_dirtied_once() {
    // A sync every 2 s: the burst writes far more than 16 MiB per sync.
    let Some((_root, engine)) = open(2000) else {
        return;
    };
    let ks = engine.key_space("default").unwrap();
    // 232 MiB of 64 KiB values: the active segment is the fourth (the
    // first three were mapped when the log was new, with page folios), and
    // its tail 40 MiB in, where readahead's folios have grown to 2 MiB.
    let burst = 3712;
    for i in 0..burst {
        engine
            .put(ks, &key(i), &value(i, 1, 64 << 10), Durability::Buffered)
            .unwrap();
    }
    // The log is judged over its last 4 syncs, by a task that looks every
    // 100 ms while the log writes: 40 synced puts spread over 400 ms give
    // it several looks with syncs between them.
    for i in burst..burst + 40 {
        engine
            .put(ks, &key(i), &value(i, 1, 4 << 10), Durability::Synced)
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));

    let io_before = tidepool_testkit::process_write_bytes();
    let before = engine_bytes(&engine);
    let puts = 256;
    for i in burst + 40..burst + 40 + puts {
        engine
            .put(ks, &key(i), &value(i, 1, 4 << 10), Durability::Synced)
            .unwrap();
    }
    let appended = engine_bytes(&engine) - before;
    let dirtied = tidepool_testkit::process_write_bytes() - io_before;
    println!(
        "{puts} synced 4 KiB puts after a burst: engine appended {appended}, kernel counted {dirtied}"
    );
    // Each put's pages and its sync mark's (the tail page again: up to
    // 12 KiB a put), plus control files; with a large tail folio it was
    // 2 MiB a put.
    let overhead = (2 << 20) + puts * (12 << 10);
    assert!(
        dirtied <= appended + overhead,
        "the kernel counted {dirtied} bytes for {appended} appended"
    );
}

/// A Raft log's large entries: 1 MiB records appended (through the file,
/// `append_pwrite_min_bytes`) and synced one at a time. The folio holding
/// a record's end is the only one the next record dirties again.
fn synced_large_appends_are_dirtied_once() {
    let Some((_root, engine)) = open(100) else {
        return;
    };
    let ks = engine.key_space("default").unwrap();
    let io_before = tidepool_testkit::process_write_bytes();
    let before = engine_bytes(&engine);
    let records = 48u64;
    for i in 0..records {
        let value = value(i, 1, 1 << 20);
        let appended = engine
            .append(
                b"raft entry",
                &[tidepool_engine::ItemInput {
                    space: ks,
                    op: tidepool_engine::ItemOp::Put,
                    key: &key(i),
                    value: &value,
                    epoch: tidepool_engine::Epoch(1),
                    tag: tidepool_engine::Tag(0),
                }],
            )
            .unwrap();
        engine.wait_synced(appended.end).unwrap();
    }
    let appended = engine_bytes(&engine) - before;
    assert!(
        engine.metrics().counters.wal_bytes_pwritten >= records << 20,
        "the records went through the file"
    );
    drop(engine);
    let dirtied = tidepool_testkit::process_write_bytes() - io_before;
    println!(
        "{records} synced 1 MiB appends: engine appended {appended}, kernel counted {dirtied} ({:.3}x)",
        dirtied as f64 / appended as f64
    );
    // Each sync's tail page and sync mark again, plus control files.
    let overhead = (2 << 20) + records * (12 << 10);
    assert!(
        dirtied <= appended + overhead,
        "the kernel counted {dirtied} bytes for {appended} appended"
    );
}
