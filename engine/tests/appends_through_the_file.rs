//! Records appended for a replication layer (`Engine::append`) at least
//! `append_pwrite_min_bytes` long are written through the file (one
//! `pwritev`), not copied into the log's mapping. Such a record reads back
//! as one written through the mapping does — at once, after a `kill -9`,
//! after a power loss once synced — among concurrent appenders of both
//! kinds and across segment rotations; a crash inside its write fails the
//! append and leaves the records before it whole; a power loss before its
//! sync tears it at worst, never into a record that reads back wrong.

mod support;

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use support::{key, value};
use tidepool_engine::storage::FaultStorage;
use tidepool_engine::{Appended, Config, Engine, Epoch, ItemInput, ItemOp, Tag};

/// A fault storage and an engine configuration whose appends of 4 KiB or
/// more go through the file, with 1 MiB value log segments.
fn setup() -> (FaultStorage, Config) {
    let (storage, mut config) = support::fault_storage();
    config.append_pwrite_min_bytes = 4096;
    config.wal_segment_bytes = 1 << 20;
    config.max_value_bytes = 256 << 10;
    // As a replication layer runs it: records appended and not applied
    // again after a restart are not relocation's garbage.
    config.retain_log_until_set = true;
    (storage, config)
}

fn open(storage: &FaultStorage, config: &Config) -> Engine {
    support::open(storage, config).unwrap()
}

/// A put of `value` under `key` in the default key space, epoch 2, tag 5.
fn put<'a>(engine: &Engine, key: &'a [u8], value: &'a [u8]) -> ItemInput<'a> {
    ItemInput {
        space: engine.key_space("default").unwrap(),
        op: ItemOp::Put,
        key,
        value,
        epoch: Epoch(2),
        tag: Tag(5),
    }
}

/// Appends one record of one put of `value` under `key(k)` with `meta`.
fn append(engine: &Engine, meta: &[u8], k: u64, value: &[u8]) -> tidepool_engine::Result<Appended> {
    engine.append(meta, &[put(engine, &key(k), value)])
}

fn pwritten(engine: &Engine) -> u64 {
    engine.metrics().counters.wal_bytes_pwritten
}

#[test]
fn large_records_go_through_the_file_and_read_back() {
    let (storage, config) = setup();
    let engine = open(&storage, &config);
    let ks = engine.key_space("default").unwrap();
    let big = value(1, 1, 20_000);
    let small = value(2, 1, 100);
    let (key1, key2) = (key(1), key(2));
    let ks_items = [put(&engine, &key1, &big), put(&engine, &key2, &small)];
    // Two items: a multi-item entry; then a single entry of a large value;
    // then a small record, through the mapping.
    let two = engine.append(b"two items", &ks_items).unwrap();
    let record_bytes = two.end.0 - two.position.0;
    assert_eq!(pwritten(&engine), record_bytes, "through the file");
    let single = append(&engine, b"one large", 3, &value(3, 1, 50_000)).unwrap();
    assert_eq!(
        pwritten(&engine),
        record_bytes + single.end.0 - single.position.0
    );
    let before = pwritten(&engine);
    let mapped = append(&engine, b"one small", 4, &small).unwrap();
    assert_eq!(
        pwritten(&engine),
        before,
        "a small record through the mapping"
    );

    for (appended, meta) in [
        (&two, &b"two items"[..]),
        (&single, b"one large"),
        (&mapped, b"one small"),
    ] {
        let record = engine.read_record(appended.position).unwrap();
        assert_eq!(record.meta, meta);
        assert_eq!(&record.appended, appended);
        engine.apply(appended).unwrap();
    }
    assert_eq!(engine.get(ks, &key(1)).unwrap().as_deref(), Some(&big[..]));
    assert_eq!(
        engine.get(ks, &key(2)).unwrap().as_deref(),
        Some(&small[..])
    );
    assert_eq!(
        engine.get(ks, &key(3)).unwrap().as_deref(),
        Some(&value(3, 1, 50_000)[..])
    );
    engine.wait_synced(mapped.end).unwrap();
    drop(engine);

    // A kill -9, and a power loss after the sync: all three read back.
    for storage in [storage.restart_process(), storage.reboot(7)] {
        let engine = open(&storage, &config);
        for appended in [&two, &single, &mapped] {
            let record = engine.read_record(appended.position).unwrap();
            assert_eq!(&record.appended, appended);
        }
        let record = engine.read_record(single.position).unwrap();
        assert_eq!(record.items[0].value, value(3, 1, 50_000));
    }
}

/// Four threads append records of 64 B to 60 KiB at once (both paths,
/// rotating through many 1 MiB segments), each applied; every value reads
/// back, and after a restart every record is found in log order with its
/// metadata. Seeded; the seed is printed.
#[test]
fn appenders_of_both_kinds_at_once() {
    let (storage, config) = setup();
    let engine = Arc::new(open(&storage, &config));
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ t);
                let mut done = Vec::new();
                for i in 0..150u64 {
                    let k = t * 1_000 + i;
                    let len = if rng.random_bool(0.5) {
                        rng.random_range(64..4_000)
                    } else {
                        rng.random_range(4_096..60_000)
                    };
                    let meta = format!("t{t} i{i} len{len}");
                    let appended = append(&engine, meta.as_bytes(), k, &value(k, 1, len)).unwrap();
                    engine.apply(&appended).unwrap();
                    done.push((appended.position, meta, k, len));
                }
                done
            })
        })
        .collect();
    let mut records: Vec<_> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    records.sort();
    let ks = engine.key_space("default").unwrap();
    for (_, _, k, len) in &records {
        assert_eq!(
            engine.get(ks, &key(*k)).unwrap().as_deref(),
            Some(&value(*k, 1, *len)[..]),
            "seed {seed} key {k}"
        );
    }
    assert!(pwritten(&engine) > 0, "seed {seed}");
    engine.wait_synced(engine.processed_position()).unwrap();
    drop(engine);

    let engine = open(&storage.restart_process(), &config);
    let mut seen = Vec::new();
    engine
        .scan_appended(records[0].0, |position, meta, _| {
            seen.push((position, String::from_utf8(meta.to_vec()).unwrap()));
            Ok(())
        })
        .unwrap();
    let expected: Vec<_> = records.iter().map(|(p, m, _, _)| (*p, m.clone())).collect();
    assert_eq!(seen, expected, "seed {seed}");
    for (position, _, k, len) in &records {
        let record = engine.read_record(*position).unwrap();
        assert_eq!(record.items[0].value, value(*k, 1, *len), "seed {seed}");
    }
}

/// A crash at the write of a large record: the append fails, the engine is
/// poisoned, and what was synced before reads back after a power loss.
#[test]
fn a_crash_inside_a_large_append_fails_it_and_keeps_what_came_before() {
    let (storage, config) = setup();
    let engine = open(&storage, &config);
    let first = append(&engine, b"first", 1, &value(1, 1, 30_000)).unwrap();
    engine.wait_synced(first.end).unwrap();
    // The next counted operation (the record's write, or a background
    // one before it) fails, and every one after it.
    storage.crash_at_op(storage.ops() + 1);
    assert!(append(&engine, b"second", 2, &value(2, 1, 30_000)).is_err());
    assert!(
        append(&engine, b"third", 3, &value(3, 1, 30_000)).is_err(),
        "the engine is poisoned"
    );
    drop(engine);
    let engine = open(&storage.reboot(11), &config);
    let record = engine.read_record(first.position).unwrap();
    assert_eq!(record.items[0].value, value(1, 1, 30_000));
    let mut metas = Vec::new();
    engine
        .scan_appended(first.position, |_, meta, _| {
            metas.push(meta.to_vec());
            Ok(())
        })
        .unwrap();
    assert_eq!(metas, vec![b"first".to_vec()]);
}

/// A power loss before large records were synced: each of their sectors
/// survives or not (torn writes, seeded). After the reboot every record the
/// log still holds reads back exactly, and they are a prefix of what was
/// appended.
#[test]
fn unsynced_large_records_torn_by_a_power_loss_never_read_back_wrong() {
    for seed in 0..20u64 {
        let (storage, mut config) = setup();
        config.sync_interval_ms = 60_000;
        let engine = open(&storage, &config);
        let synced = append(&engine, b"synced", 0, &value(0, 1, 10_000)).unwrap();
        engine.wait_synced(synced.end).unwrap();
        let mut appended = vec![synced];
        for k in 1..6u64 {
            appended.push(append(&engine, b"later", k, &value(k, 1, 9_000 + k as usize)).unwrap());
        }
        drop(engine);
        let engine = open(&storage.reboot(seed), &config);
        let mut found = Vec::new();
        engine
            .scan_appended(appended[0].position, |position, _, _| {
                found.push(position);
                Ok(())
            })
            .unwrap();
        let prefix: Vec<_> = appended
            .iter()
            .take(found.len())
            .map(|a| a.position)
            .collect();
        println!(
            "seed {seed}: {} of {} records after the reboot",
            found.len(),
            appended.len()
        );
        assert_eq!(found, prefix, "seed {seed}");
        assert!(!found.is_empty(), "seed {seed}: the synced record is kept");
        for (k, position) in found.iter().enumerate() {
            let record = engine.read_record(*position).unwrap();
            let len = if k == 0 { 10_000 } else { 9_000 + k };
            assert_eq!(
                record.items[0].value,
                value(k as u64, 1, len),
                "seed {seed}"
            );
        }
    }
}
