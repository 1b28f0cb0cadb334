//! Delta blobs: a flush over a cell's on-disk index writes only the
//! changes (deletes included) while the cell has few deltas, merges into a
//! new base past the limit, and lookups, scans and recovery see the
//! layers as one index — on cells in memory and on disk, after a clean
//! close and after a crash.

mod support;

use std::collections::BTreeMap;
use std::ops::Bound;

use support::{fault_storage, key, open, value};
use tidepool_engine::storage::FaultStorage;
use tidepool_engine::{Config, Direction, Durability, Engine, KeySpace};

const CELLS: u64 = 64;

fn config() -> (FaultStorage, Config) {
    let (storage, mut config) = fault_storage();
    config.flush_dirty_entries = 1 << 20; // flushes only when asked
    config.max_replay_bytes = 1 << 40;
    config.relocation_enabled = false;
    config.index_max_deltas = 4;
    config.wal_segment_bytes = 1 << 20;
    config.index_segment_bytes = 1 << 20;
    (storage, config)
}

fn check(engine: &Engine, ks: KeySpace, model: &BTreeMap<[u8; 32], Vec<u8>>, what: &str) {
    for i in 0..3_000u64 {
        let k = key(i);
        let got = engine.get(ks, &k).unwrap();
        assert_eq!(
            got.as_deref(),
            model.get(&k).map(|v| &v[..]),
            "{what}: key {i}"
        );
        assert_eq!(
            engine.exists(ks, &k).unwrap(),
            model.contains_key(&k),
            "{what}: exists {i}"
        );
    }
    let scanned: Vec<Vec<u8>> = engine
        .scan(ks, Bound::Unbounded, Bound::Unbounded, Direction::Forward)
        .unwrap()
        .map(|r| r.unwrap().0)
        .collect();
    let expected: Vec<Vec<u8>> = model.keys().map(|k| k.to_vec()).collect();
    assert_eq!(scanned, expected, "{what}: scan");
    for (probe, _) in model.iter().step_by(37) {
        let got = engine.last_before(ks, probe).unwrap().map(|(k, _)| k);
        let want = model.range(..*probe).next_back().map(|(k, _)| k.to_vec());
        assert_eq!(got, want, "{what}: last_before");
    }
}

/// Flushes, and returns how many cells it flushed and how many of those
/// flushes wrote deltas.
fn flush_counting(engine: &Engine) -> (u64, u64) {
    let before = engine.metrics().counters;
    engine.flush().unwrap();
    let after = engine.metrics().counters;
    (
        after.flushes - before.flushes,
        after.delta_flushes - before.delta_flushes,
    )
}

#[test]
fn small_flushes_over_a_base_write_deltas_and_every_reader_sees_one_index() {
    let (storage, config) = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut model = BTreeMap::new();
    for i in 0..CELLS * 30 {
        let v = value(i, 1, 40);
        engine.put(ks, &key(i), &v, Durability::Buffered).unwrap();
        model.insert(key(i), v);
    }
    engine.flush().unwrap();
    let base = engine.metrics().counters;
    assert_eq!(
        base.delta_flushes, 0,
        "the first flush of a cell writes its base"
    );

    // Four rounds of a few changes per cell: deletes of base keys,
    // overwrites and new keys. Each round is a delta over the base.
    for round in 0..4u64 {
        for i in (round..CELLS * 30).step_by(23) {
            engine.delete(ks, &key(i), Durability::Buffered).unwrap();
            model.remove(&key(i));
        }
        for i in (round * 7..CELLS * 30).step_by(29) {
            let v = value(i, 10 + round, 50);
            engine.put(ks, &key(i), &v, Durability::Buffered).unwrap();
            model.insert(key(i), v);
        }
        let new = 2_000 + round * 100;
        for i in new..new + 100 {
            let v = value(i, 1, 30);
            engine.put(ks, &key(i), &v, Durability::Buffered).unwrap();
            model.insert(key(i), v);
        }
        let before = engine.metrics().counters;
        engine.flush().unwrap();
        let after = engine.metrics().counters;
        let flushes = after.flushes - before.flushes;
        let deltas = after.delta_flushes - before.delta_flushes;
        let written = after.index_bytes_written - before.index_bytes_written;
        println!("round {round}: {flushes} flushes, {deltas} deltas, {written} index bytes");
        assert_eq!(
            deltas, flushes,
            "round {round}: few changes over a base are deltas"
        );
        // ~250 changed entries of 64 bytes plus headers and filters, not
        // the ~120 KiB of the whole index.
        assert!(written < 40_000, "round {round}: {written} bytes written");
        check(&engine, ks, &model, &format!("round {round}, loaded"));
        engine.release_memory();
        check(&engine, ks, &model, &format!("round {round}, on disk"));
    }
    // The fifth small flush finds four deltas: it merges.
    for i in (0..CELLS * 30).step_by(31) {
        engine.delete(ks, &key(i), Durability::Buffered).unwrap();
        model.remove(&key(i));
    }
    let before = engine.metrics().counters;
    engine.flush().unwrap();
    let after = engine.metrics().counters;
    assert!(after.flushes > before.flushes);
    assert_eq!(
        after.delta_flushes, before.delta_flushes,
        "past the limit, flushes merge"
    );
    check(&engine, ks, &model, "after the merge");

    // One more delta, then reopen: cleanly, and after a crash.
    for i in (5..CELLS * 30).step_by(41) {
        engine.delete(ks, &key(i), Durability::Buffered).unwrap();
        model.remove(&key(i));
    }
    engine.flush().unwrap();
    engine.close().unwrap();
    drop(engine);
    let engine = open(&storage, &config).unwrap();
    check(&engine, ks, &model, "reopened");
    for i in (6..CELLS * 30).step_by(43) {
        engine.delete(ks, &key(i), Durability::Buffered).unwrap();
        model.remove(&key(i));
    }
    engine.flush().unwrap();
    let placeholder = open(&FaultStorage::default(), &config).unwrap();
    drop(std::mem::replace(&mut { engine }, placeholder));
    let storage = storage.restart_process();
    let engine = open(&storage, &config).unwrap();
    check(&engine, ks, &model, "after a crash");
    engine.close().unwrap();
}

#[test]
fn a_delete_in_a_delta_hides_the_base_entry_on_disk() {
    let (storage, mut config) = config();
    config.index_memory_bytes = 1; // never load a cell: every lookup reads blobs
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in 0..CELLS * 20 {
        engine
            .put(ks, &key(i), &value(i, 1, 40), Durability::Buffered)
            .unwrap();
    }
    engine.flush().unwrap();
    engine.delete(ks, &key(5), Durability::Buffered).unwrap();
    engine.flush().unwrap();
    let counters = engine.metrics().counters;
    assert_eq!(counters.delta_flushes, 1, "the delete went out as a delta");
    assert!(
        !engine.exists(ks, &key(5)).unwrap(),
        "the delta's tombstone wins"
    );
    assert!(engine.get(ks, &key(5)).unwrap().is_none());
    assert!(
        engine.exists(ks, &key(6)).unwrap(),
        "other keys come from the base"
    );
    let counters = engine.metrics().counters;
    assert_eq!(counters.cell_loads, 0);
    assert!(counters.disk_lookups >= 2);
    engine.close().unwrap();
}

#[test]
fn deltas_grow_to_the_merge_ratio_times_the_base_before_a_merge() {
    // 25 base entries per cell, then rounds of 10 new entries per cell
    // (the test keys spread evenly over the cells): with ratio 1 the third
    // round's deltas (30) pass the base and merge; with ratio 3 the deltas
    // grow to 70 and the eighth round (80 ≥ 75) merges (nearly every cell:
    // the keys spread evenly only to a key or two per cell).
    for (ratio, merging_round) in [(1u32, 3u64), (3, 8)] {
        let (storage, mut config) = config();
        config.index_max_deltas = 16;
        config.index_merge_ratio = ratio;
        let engine = open(&storage, &config).unwrap();
        let ks = engine.key_space("default").unwrap();
        let mut model = BTreeMap::new();
        let mut put = |engine: &Engine, range: std::ops::Range<u64>| {
            for i in range {
                let v = value(i, 1, 40);
                engine.put(ks, &key(i), &v, Durability::Buffered).unwrap();
                model.insert(key(i), v);
            }
        };
        put(&engine, 0..CELLS * 25);
        engine.flush().unwrap();
        for round in 1..=merging_round {
            let start = CELLS * (25 + 10 * (round - 1));
            put(&engine, start..start + CELLS * 10);
            let (flushes, deltas) = flush_counting(&engine);
            assert_eq!(flushes, CELLS, "ratio {ratio}, round {round}");
            if round < merging_round {
                assert_eq!(deltas, CELLS, "ratio {ratio}, round {round}: all deltas");
            } else {
                // A cell's share of the keys is even only to a few keys.
                assert!(
                    deltas <= CELLS / 8,
                    "ratio {ratio}, round {round}: {deltas} deltas, the rest merges"
                );
            }
        }
        check(&engine, ks, &model, &format!("ratio {ratio}, loaded"));
        engine.release_memory();
        check(&engine, ks, &model, &format!("ratio {ratio}, on disk"));
        engine.close().unwrap();
        drop(engine);
        let engine = open(&storage, &config).unwrap();
        check(&engine, ks, &model, &format!("ratio {ratio}, reopened"));
        engine.close().unwrap();
    }
}

#[test]
fn a_flush_that_deletes_the_base_merges_whatever_the_ratio() {
    let (storage, mut config) = config();
    config.index_max_deltas = 16;
    config.index_merge_ratio = 3;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut model = BTreeMap::new();
    let n = CELLS * 25;
    for i in 0..n {
        let v = value(i, 1, 40);
        engine.put(ks, &key(i), &v, Durability::Buffered).unwrap();
        model.insert(key(i), v);
    }
    engine.flush().unwrap();
    // A fifth of the keys deleted: a delta of tombstones over each base
    // (5 deletes weigh 15, under 3 x 25).
    for i in (0..n).step_by(5) {
        engine.delete(ks, &key(i), Durability::Buffered).unwrap();
        model.remove(&key(i));
    }
    assert_eq!(flush_counting(&engine), (CELLS, CELLS));
    // Every key deleted in one flush (again for the fifth already gone):
    // 25 tombstones per cell weigh 75, with the earlier delta's 5 past
    // 3 x 25, so every cell merges and its dead index leaves no blob.
    for i in 0..n {
        engine.delete(ks, &key(i), Durability::Buffered).unwrap();
        model.remove(&key(i));
    }
    assert_eq!(flush_counting(&engine), (CELLS, 0), "every cell merged");
    assert!(model.is_empty());
    check(&engine, ks, &model, "all deleted");
    engine.release_memory();
    check(&engine, ks, &model, "all deleted, on disk");
    engine.close().unwrap();
}

/// A blob takes the smallest entry format its entries fit: fresh puts of
/// one epoch and tag, with 32-byte keys, cost 44 bytes an entry on disk (key,
/// 6-byte location, 2-byte length, CRC) instead of the full 64, and the
/// engine reads them back from disk, after a close and after a crash.
#[test]
fn fresh_puts_are_indexed_in_the_smallest_entry_format() {
    let (storage, config) = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut model = BTreeMap::new();
    let entries = CELLS * 30;
    for i in 0..entries {
        let v = value(i, 1, 200);
        engine.put(ks, &key(i), &v, Durability::Buffered).unwrap();
        model.insert(key(i), v);
    }
    let before = engine.metrics().counters.index_bytes_written;
    engine.flush().unwrap();
    let written = engine.metrics().counters.index_bytes_written - before;
    println!("{entries} fresh entries: {written} index bytes");
    assert!(
        written >= entries * 44,
        "{written} bytes for {entries} entries"
    );
    // Headers and bloom filters add ~100 bytes per cell's blob; full
    // entries would take 64 bytes each.
    assert!(
        written < entries * 50,
        "{written} bytes for {entries} entries"
    );
    engine.release_memory();
    check(&engine, ks, &model, "compact blobs, on disk");
    // A power loss right after the flush: the blobs and the control file
    // naming their formats are durable.
    storage.crash();
    drop(engine);
    let storage = storage.reboot(7);
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    check(&engine, ks, &model, "compact blobs, after a crash");
    engine.close().unwrap();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    check(&engine, ks, &model, "compact blobs, reopened");
    engine.close().unwrap();
}

/// Key `i` of cell 0 (the first 8 bytes 0): every key of this test in one
/// cell.
fn crowded_key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[8..16].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k
}

fn check_crowded(engine: &Engine, ks: KeySpace, model: &BTreeMap<[u8; 32], Vec<u8>>, what: &str) {
    for i in 0..CROWDED + 2_000 {
        let k = crowded_key(i);
        let got = engine.get(ks, &k).unwrap();
        assert_eq!(
            got.as_deref(),
            model.get(&k).map(|v| &v[..]),
            "{what}: key {i}"
        );
    }
    let scanned: Vec<Vec<u8>> = engine
        .scan(ks, Bound::Unbounded, Bound::Unbounded, Direction::Forward)
        .unwrap()
        .map(|r| r.unwrap().0)
        .collect();
    let expected: Vec<Vec<u8>> = model.keys().map(|k| k.to_vec()).collect();
    assert_eq!(scanned, expected, "{what}: scan");
    for i in (0..CROWDED + 2_000).step_by(13) {
        let probe = crowded_key(i);
        let got = engine.last_before(ks, &probe).unwrap().map(|(k, _)| k);
        let want = model.range(..probe).next_back().map(|(k, _)| k.to_vec());
        assert_eq!(got, want, "{what}: last_before key {i}");
    }
}

const CROWDED: u64 = 6_000;

/// One cell whose index outgrows an index segment (64 KiB: about 1,100
/// entries; here 6,000 keys, a hostile writer's choice of names or a
/// shard's share of a large namespace at production sizes). Its base was
/// one record, refused as larger than a segment at every flush: the engine
/// was poisoned, and again after every reopen (the flush came back with
/// the replay), so a shard whose replicas all hold the same keys stayed
/// down. Now the base — and a delta of that many changes — is written in
/// parts, and lookups, scans, merges, a reopen and a crash see one index.
#[test]
fn a_cell_larger_than_an_index_segment_is_written_in_parts() {
    let (storage, mut config) = config();
    config.index_segment_bytes = 64 << 10;
    // No flush under memory pressure: each flush below is the test's.
    config.index_memory_bytes = 64 << 20;
    let on_disk = Config {
        index_memory_bytes: 1,
        ..config.clone()
    };
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut model = BTreeMap::new();
    for i in 0..CROWDED {
        let v = value(i, 1, 24);
        engine
            .put(ks, &crowded_key(i), &v, Durability::Buffered)
            .unwrap();
        model.insert(crowded_key(i), v);
    }
    let before = engine.metrics().counters;
    engine.flush().unwrap();
    let after = engine.metrics().counters;
    let written = after.index_bytes_written - before.index_bytes_written;
    assert!(
        written > 2 * config.index_segment_bytes,
        "one cell's base of {written} bytes, past a segment"
    );
    engine.health().unwrap();
    check_crowded(&engine, ks, &model, "the base in parts, loaded");

    // A delta of more changes than a record holds: deletes of every other
    // key, overwrites, new keys.
    for i in (0..CROWDED).step_by(2) {
        engine
            .delete(ks, &crowded_key(i), Durability::Buffered)
            .unwrap();
        model.remove(&crowded_key(i));
    }
    for i in CROWDED..CROWDED + 1_500 {
        let v = value(i, 2, 24);
        engine
            .put(ks, &crowded_key(i), &v, Durability::Buffered)
            .unwrap();
        model.insert(crowded_key(i), v);
    }
    let before = engine.metrics().counters;
    let (flushes, deltas) = flush_counting(&engine);
    assert_eq!((flushes, deltas), (1, 1), "a delta over the base's parts");
    let written = engine.metrics().counters.index_bytes_written - before.index_bytes_written;
    assert!(
        written > config.index_segment_bytes,
        "one delta of {written} bytes, past a segment"
    );
    check_crowded(&engine, ks, &model, "a delta in parts, loaded");

    // Reopened cleanly (the control file names the base's parts), with no
    // memory for cells: every lookup, scan and last_before reads the
    // blobs — the base's parts and the delta's — on disk.
    engine.close().unwrap();
    drop(engine);
    let engine = open(&storage, &on_disk).unwrap();
    check_crowded(&engine, ks, &model, "reopened, on disk");
    let counters = engine.metrics().counters;
    assert_eq!(counters.cell_loads, 0, "no cell was loaded");
    assert!(counters.disk_lookups > CROWDED, "lookups read the blobs");
    engine.close().unwrap();
    drop(engine);
    let engine = open(&storage, &config).unwrap();
    check_crowded(&engine, ks, &model, "reopened");

    // Merges until the deltas are folded in, then a crash.
    for round in 0..6u64 {
        for i in (1..CROWDED + 1_500).step_by(7 + round as usize) {
            let v = value(i, 10 + round, 24);
            engine
                .put(ks, &crowded_key(i), &v, Durability::Buffered)
                .unwrap();
            model.insert(crowded_key(i), v);
        }
        engine.flush().unwrap();
        check_crowded(&engine, ks, &model, &format!("round {round}"));
    }
    let counters = engine.metrics().counters;
    assert!(counters.flushes > counters.delta_flushes, "it merged");
    let placeholder = open(&FaultStorage::default(), &config).unwrap();
    drop(std::mem::replace(&mut { engine }, placeholder));
    let storage = storage.restart_process();
    let engine = open(&storage, &on_disk).unwrap();
    check_crowded(&engine, ks, &model, "after a crash, on disk");
    engine.close().unwrap();
}
