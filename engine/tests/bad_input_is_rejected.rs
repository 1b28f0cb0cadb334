//! Bad input gets a typed error and never damages stored data: oversized
//! values and batches, wrong key lengths, unknown key spaces, use after
//! close, a full disk, and configurations that do not match the data.

mod support;

use std::ops::Bound;

use support::{fault_storage, key, open, prefixed_key, value};
use tidepool_engine::{CellLayout, Config, Direction, Durability, Engine, Error, WriteBatch};

fn assert_intact(engine: &Engine, keys: std::ops::Range<u64>) {
    let ks = engine.key_space("default").unwrap();
    for k in keys {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().as_deref(),
            Some(&value(k, 1, 500)[..]),
            "key {k}"
        );
    }
}

fn stored(engine: &Engine, n: u64) {
    let ks = engine.key_space("default").unwrap();
    for k in 0..n {
        engine
            .put(ks, &key(k), &value(k, 1, 500), Durability::Buffered)
            .unwrap();
    }
}

#[test]
fn oversized_values_and_batches_are_refused_whole() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    stored(&engine, 20);
    let ks = engine.key_space("default").unwrap();
    let too_big = vec![7u8; config.max_value_bytes as usize + 1];
    assert!(matches!(
        engine.put(ks, &key(1), &too_big, Durability::Buffered),
        Err(Error::TooLarge { what: "value", .. })
    ));
    // A batch of allowed values that together exceed a segment.
    let mut batch = WriteBatch::new();
    let value_len = config.max_value_bytes as usize;
    for k in 0..(config.wal_segment_bytes as usize / value_len + 1) as u64 {
        batch.put(ks, &key(k), &vec![9u8; value_len]);
    }
    assert!(matches!(
        engine.write_batch(&batch, Durability::Buffered),
        Err(Error::TooLarge { .. })
    ));
    assert_intact(&engine, 0..20);
}

#[test]
fn wrong_keys_and_unknown_key_spaces_are_typed_errors() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    stored(&engine, 5);
    let ks = engine.key_space("default").unwrap();
    let short = [1u8; 31];
    let wrong = |r: Result<(), Error>| {
        assert!(
            matches!(
                r,
                Err(Error::WrongKeyLength {
                    expected: 32,
                    got: 31,
                    ..
                })
            ),
            "{r:?}"
        )
    };
    wrong(engine.put(ks, &short, b"v", Durability::Buffered).map(drop));
    wrong(engine.delete(ks, &short, Durability::Buffered).map(drop));
    wrong(engine.get(ks, &short).map(drop));
    wrong(engine.exists(ks, &short).map(drop));
    wrong(
        engine
            .scan(
                ks,
                Bound::Included(&short[..]),
                Bound::Unbounded,
                Direction::Forward,
            )
            .map(drop),
    );
    let mut batch = WriteBatch::new();
    batch.put(ks, &key(9), b"fine").put(ks, &short, b"bad");
    wrong(engine.write_batch(&batch, Durability::Buffered).map(drop));
    assert_eq!(
        engine.get(ks, &key(9)).unwrap(),
        None,
        "a rejected batch applies nothing"
    );
    assert!(matches!(
        engine.key_space("nope"),
        Err(Error::UnknownKeySpace(_))
    ));
    let prefixed = engine.key_space("prefixed").unwrap();
    assert!(matches!(
        engine.put(prefixed, &key(1), b"v", Durability::Buffered),
        Err(Error::WrongKeyLength { .. })
    ));
    engine
        .put(prefixed, &prefixed_key(1, 1), b"v", Durability::Buffered)
        .unwrap();
    assert_intact(&engine, 0..5);
}

#[test]
fn every_call_after_close_is_refused() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    stored(&engine, 5);
    engine.close().unwrap();
    let ks = engine.key_space("default").unwrap();
    assert!(matches!(
        engine.put(ks, &key(1), b"v", Durability::Buffered),
        Err(Error::Closed)
    ));
    assert!(matches!(engine.get(ks, &key(1)), Err(Error::Closed)));
    assert!(matches!(engine.exists(ks, &key(1)), Err(Error::Closed)));
    assert!(matches!(
        engine.delete(ks, &key(1), Durability::Synced),
        Err(Error::Closed)
    ));
    assert!(matches!(engine.flush(), Err(Error::Closed)));
    assert!(matches!(engine.close(), Err(Error::Closed)));
    drop(engine);
    assert_intact(&open(&storage, &config).unwrap(), 0..5);
}

#[test]
fn a_full_disk_fails_writes_cleanly_and_recovers_when_space_returns() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    stored(&engine, 50);
    engine.flush().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100)); // spares created
    storage.set_capacity_bytes(Some(storage.used_bytes()));
    let ks = engine.key_space("default").unwrap();
    let mut failure = None;
    for k in 1_000..3_000 {
        match engine.put(ks, &key(k), &value(k, 1, 2_000), Durability::Buffered) {
            Ok(_) => {}
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    assert!(matches!(failure, Some(Error::DiskFull(_))), "{failure:?}");
    assert_intact(&engine, 0..50);
    storage.set_capacity_bytes(None);
    std::thread::sleep(std::time::Duration::from_millis(300));
    engine
        .put(ks, &key(5_000), &value(5_000, 1, 500), Durability::Synced)
        .unwrap();
    engine.close().unwrap();
    let engine = open(&storage, &config).unwrap();
    assert_intact(&engine, 0..50);
    assert!(engine.get(ks, &key(5_000)).unwrap().is_some());
}

#[test]
fn configurations_that_do_not_match_the_data_are_refused() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    stored(&engine, 5);
    engine.close().unwrap();
    drop(engine);

    let mut bad = config.clone();
    bad.max_value_bytes = 0;
    assert!(matches!(open(&storage, &bad), Err(Error::Config(_))));
    let mut other_segments = config.clone();
    other_segments.wal_segment_bytes *= 2;
    assert!(matches!(
        open(&storage, &other_segments),
        Err(Error::Incompatible(_))
    ));
    let mut removed = config.clone();
    removed.key_spaces.remove(0);
    assert!(matches!(
        open(&storage, &removed),
        Err(Error::Incompatible(_))
    ));
    let mut changed = config.clone();
    changed.key_spaces[0].layout = CellLayout::Uniform { cells: 32 };
    assert!(matches!(
        open(&storage, &changed),
        Err(Error::Incompatible(_))
    ));
    // Appending a key space is allowed.
    let mut added = config.clone();
    added.key_spaces.push(tidepool_engine::KeySpaceConfig {
        name: "extra".into(),
        key_bytes: 8,
        layout: CellLayout::Uniform { cells: 4 },
    });
    let engine = open(&storage, &added).unwrap();
    assert_intact(&engine, 0..5);
    let extra = engine.key_space("extra").unwrap();
    engine
        .put(extra, b"8bytes!!", b"x", Durability::Buffered)
        .unwrap();
    drop(engine);
    let _ = Config::default();
}

/// An epoch advanced while the disk is full, with no spare segment left
/// to roll to, fails and leaves the epoch as it was: asked again once
/// space returns, it rolls to a segment of the new epoch. Before, the
/// epoch was stored first, and asking again was refused as "not after the
/// current" — the new epoch's writes stayed in a segment of the old one.
#[test]
fn an_epoch_that_cannot_roll_on_a_full_disk_is_not_advanced() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    stored(&engine, 5);
    std::thread::sleep(std::time::Duration::from_millis(100)); // spares created
    storage.set_capacity_bytes(Some(storage.used_bytes()));
    // The spare made before takes the first roll; none is left after.
    let mut epoch = 2;
    let failure = loop {
        match engine.advance_epoch(tidepool_engine::Epoch(epoch)) {
            Ok(()) => epoch += 1,
            Err(e) => break e,
        }
        assert!(epoch < 10, "the full disk never refused a roll");
    };
    assert!(matches!(failure, Error::DiskFull(_)), "{failure:?}");
    assert_eq!(engine.epoch(), tidepool_engine::Epoch(epoch - 1));
    storage.set_capacity_bytes(None);
    engine.advance_epoch(tidepool_engine::Epoch(epoch)).unwrap();
    assert_eq!(engine.epoch(), tidepool_engine::Epoch(epoch));
    assert_intact(&engine, 0..5);
    engine.close().unwrap();
}
