//! A process that fails soon after opening its engine, again and again (a
//! crash loop), must not grow the engine's files with every start: each
//! open began a new index segment after the last file, with its reserved
//! blocks, so a loop filled the disk, and then no open could succeed.

mod support;

use tidepool_engine::Durability;
use tidepool_engine::storage::Storage as _;

use support::*;

#[test]
fn repeated_opens_without_a_snapshot_do_not_add_index_segments() {
    let (storage, mut config) = fault_storage();
    // No background snapshot: every start dies before its first one.
    config.snapshot_interval_ms = 3_600_000;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..200 {
        engine
            .put(ks, &key(k), &value(k, 0, 300), Durability::Buffered)
            .unwrap();
    }
    engine.close().unwrap();
    let index_dir = config.dir.join("index");
    let mut storage = storage.restart_process();
    let mut counts = Vec::new();
    let mut wal_counts = Vec::new();
    for start in 0..8u64 {
        let engine = open(&storage, &config).unwrap();
        // Each start writes a little and dies (kill -9) before a snapshot.
        engine
            .put(
                ks,
                &key(1_000 + start),
                &value(start, 1, 300),
                Durability::Buffered,
            )
            .unwrap();
        engine.wait_synced(engine.processed_position()).unwrap();
        let next = storage.restart_process();
        drop(engine);
        storage = next;
        counts.push(storage.list(&index_dir).unwrap().len());
        wal_counts.push(storage.list(&config.dir.join("wal")).unwrap().len());
    }
    println!("index segment files after each start: {counts:?}; WAL segment files: {wal_counts:?}");
    assert!(
        counts.iter().all(|c| *c <= counts[0]),
        "index segment files grew with every start: {counts:?}"
    );
    // Nothing written in those starts was lost.
    let engine = open(&storage, &config).unwrap();
    for start in 0..8u64 {
        assert_eq!(
            engine.get(ks, &key(1_000 + start)).unwrap().as_deref(),
            Some(&value(start, 1, 300)[..])
        );
    }
    for k in 0..200 {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().as_deref(),
            Some(&value(k, 0, 300)[..])
        );
    }
}
