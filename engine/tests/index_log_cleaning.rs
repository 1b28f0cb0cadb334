//! Index log cleaning: once deletes and merges leave the sealed index
//! segments mostly garbage, each holding a few live blobs, cleaning copies
//! those blobs forward and garbage collection deletes the segments. Every
//! key reads the same before and after, after a reopen, and after a crash
//! at any point of a cleaning pass.

mod support;

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{fault_storage, key, open, value, version_of};
use tidepool_engine::storage::FaultStorage;
use tidepool_engine::{Config, Durability, Engine, KeySpace};

const KEYS: u64 = 12_000;
const SEGMENT: u64 = 64 << 10;

fn config() -> (FaultStorage, Config) {
    let (storage, mut config) = fault_storage();
    // Flushes and cleaning only when the test asks (`Engine::flush`).
    config.flush_dirty_entries = 1 << 20;
    config.max_replay_bytes = 1 << 40;
    config.snapshot_interval_ms = 1 << 30;
    config.relocation_enabled = false;
    config.index_segment_bytes = SEGMENT;
    config.wal_segment_bytes = 1 << 20;
    (storage, config)
}

type Model = BTreeMap<u64, u64>;

/// Writes every key and flushes (the cells' bases fill the sealed
/// segments), then deletes every key of three quarters of the cells (keys
/// whose first byte is below 192), overwrites a few of the others, and
/// waits until all that is durable in the WAL. The flush that follows
/// merges the emptied cells away, leaving the old segments a quarter live,
/// each with bases of the other cells: more than half the sealed index is
/// then garbage that collection alone cannot delete.
fn workload(engine: &Engine, ks: KeySpace, seed: u64) -> Model {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model = Model::new();
    for i in 0..KEYS {
        let len = rng.random_range(16..120);
        engine
            .put(ks, &key(i), &value(i, 1, len), Durability::Buffered)
            .unwrap();
        model.insert(i, 1);
    }
    engine.flush().unwrap();
    for i in 0..KEYS {
        if key(i)[0] < 192 {
            engine.delete(ks, &key(i), Durability::Buffered).unwrap();
            model.remove(&i);
        } else if rng.random_bool(0.05) {
            let len = rng.random_range(16..120);
            engine
                .put(ks, &key(i), &value(i, 2, len), Durability::Buffered)
                .unwrap();
            model.insert(i, 2);
        }
    }
    engine.wait_synced(engine.processed_position()).unwrap();
    model
}

fn check(engine: &Engine, ks: KeySpace, model: &Model, what: &str) {
    for i in 0..KEYS {
        let got = engine.get(ks, &key(i)).unwrap();
        assert_eq!(
            got.as_deref().map(version_of),
            model.get(&i).copied(),
            "{what}: key {i}"
        );
        assert_eq!(
            engine.exists(ks, &key(i)).unwrap(),
            model.contains_key(&i),
            "{what}: exists {i}"
        );
    }
}

/// Flushes (each flush runs a cleaning pass) until a pass moves nothing.
fn clean_fully(engine: &Engine) {
    for _ in 0..50 {
        let before = engine.metrics().counters.index_blobs_moved;
        engine.flush().unwrap();
        if engine.metrics().counters.index_blobs_moved == before {
            return;
        }
    }
    panic!("cleaning kept moving blobs");
}

#[test]
fn cleaning_bounds_index_garbage_and_loses_nothing() {
    let seed = tidepool_testkit::seed_from_env("CLEANING_SEED");
    let (storage, config) = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let model = workload(&engine, ks, seed);
    check(&engine, ks, &model, "before cleaning");
    clean_fully(&engine);
    let m = engine.metrics();
    assert!(
        m.counters.index_blobs_moved > 0,
        "the workload must leave sparse index segments to clean"
    );
    assert!(m.counters.index_segments_deleted > 0);
    // Cleaning stops only when at most half of the sealed index log is
    // garbage (garbage <= the live blobs in it) or the garbage is small.
    assert!(
        m.index_garbage_bytes <= m.index_live_bytes.max(4 * SEGMENT),
        "garbage {} B, live {} B",
        m.index_garbage_bytes,
        m.index_live_bytes
    );
    check(&engine, ks, &model, "after cleaning");
    engine.release_memory();
    check(&engine, ks, &model, "after cleaning, cells unloaded");
    engine.close().unwrap();
    drop(engine);
    let engine = open(&storage, &config).unwrap();
    check(&engine, ks, &model, "reopened");
}

#[test]
fn a_crash_anywhere_in_a_cleaning_pass_loses_nothing() {
    let seed = tidepool_testkit::seed_from_env("CLEANING_SEED");
    // How many storage operations one cleaning pass takes.
    let span = {
        let (storage, config) = config();
        let engine = open(&storage, &config).unwrap();
        let ks = engine.key_space("default").unwrap();
        workload(&engine, ks, seed);
        let before = storage.ops();
        let moved = engine.metrics().counters.index_blobs_moved;
        engine.flush().unwrap();
        assert!(
            engine.metrics().counters.index_blobs_moved > moved,
            "the pass under test must move blobs"
        );
        storage.ops() - before
    };
    let points: Vec<u64> = (1..=span).step_by((span as usize / 24).max(1)).collect();
    for crash_after in points {
        let (storage, config) = config();
        let engine = open(&storage, &config).unwrap();
        let ks = engine.key_space("default").unwrap();
        let model = workload(&engine, ks, seed);
        // Everything the model holds is durable in the WAL; the flush that
        // crashes merges, moves blobs and snapshots.
        storage.crash_at_op(storage.ops() + crash_after);
        let _ = engine.flush();
        drop(engine);
        let rebooted = storage.reboot(seed ^ crash_after);
        let engine = open(&rebooted, &config).unwrap();
        check(
            &engine,
            ks,
            &model,
            &format!("crash after {crash_after} ops"),
        );
        clean_fully(&engine);
        check(
            &engine,
            ks,
            &model,
            &format!("crash after {crash_after} ops, cleaned again"),
        );
    }
}
