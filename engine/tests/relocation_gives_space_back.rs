//! Space: deleting or overwriting most values and relocating shrinks the
//! value WAL to about what is still live, and every remaining value reads
//! back byte-identical — through both relocation strategies.

mod support;

use support::{fault_storage, key, open, value};
use tidepool_engine::{
    Config, Decision, Durability, Engine, EntryInfo, RelocationFilter, Strategy, WalPosition,
};

const KEYS: u64 = 1_500;
const VALUE_BYTES: usize = 2_000;

fn config() -> Config {
    let (_, mut config) = fault_storage();
    config.relocation_enabled = false; // explicit passes only
    config.snapshot_interval_ms = 3_600_000;
    config
}

/// Bytes of value WAL segment files.
fn wal_bytes(engine: &Engine) -> u64 {
    engine
        .segment_usage()
        .unwrap()
        .iter()
        .map(|s| s.size_bytes)
        .sum()
}

fn check(engine: &Engine, live: impl Fn(u64) -> Option<Vec<u8>>) {
    let ks = engine.key_space("default").unwrap();
    for k in 0..KEYS {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().map(|v| v.to_vec()),
            live(k),
            "key {k}"
        );
    }
}

#[test]
fn deleting_seventy_percent_gives_back_about_seventy_percent() {
    for strategy in ["wal", "index"] {
        let (storage, _) = fault_storage();
        let config = config();
        let engine = open(&storage, &config).unwrap();
        let ks = engine.key_space("default").unwrap();
        for k in 0..KEYS {
            engine
                .put(ks, &key(k), &value(k, 0, VALUE_BYTES), Durability::Buffered)
                .unwrap();
        }
        // Delete 70%, uniformly spread over the keys (and so the segments).
        let survives = |k: u64| k % 10 < 3;
        for k in (0..KEYS).filter(|k| !survives(*k)) {
            engine.delete(ks, &key(k), Durability::Buffered).unwrap();
        }
        let before = wal_bytes(&engine);
        let report = match strategy {
            "wal" => engine
                .relocate(Strategy::Wal {
                    segments: usize::MAX,
                })
                .unwrap(),
            _ => engine
                .relocate(Strategy::Index {
                    below: engine.processed_position(),
                })
                .unwrap(),
        };
        let after = wal_bytes(&engine);
        let live = |k: u64| survives(k).then(|| value(k, 0, VALUE_BYTES));
        check(&engine, live);
        println!("{strategy}: {before} -> {after} bytes of WAL segments; {report:?}");
        // 30% of the values stay; allow for record overhead, the active
        // segment and partly filled segments.
        let bound = before * 3 / 10 + 4 * config.wal_segment_bytes;
        assert!(
            after <= bound,
            "{strategy}: {after} bytes after relocation, bound {bound}"
        );
        assert!(report.segments_deleted > 0 && report.entries_relocated > 0);
        engine.close().unwrap();
        check(&open(&storage, &config).unwrap(), live);
    }
}

#[test]
fn overwriting_three_times_gives_back_the_old_versions() {
    let (storage, _) = fault_storage();
    let config = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for round in 0..4 {
        for k in 0..KEYS / 2 {
            engine
                .put(
                    ks,
                    &key(k),
                    &value(k, round, VALUE_BYTES),
                    Durability::Buffered,
                )
                .unwrap();
        }
    }
    let before = wal_bytes(&engine);
    engine
        .relocate(Strategy::Wal {
            segments: usize::MAX,
        })
        .unwrap();
    let after = wal_bytes(&engine);
    let live = |k: u64| (k < KEYS / 2).then(|| value(k, 3, VALUE_BYTES));
    check(&engine, live);
    println!("overwrites: {before} -> {after} bytes of WAL segments");
    let bound = before / 4 + 4 * config.wal_segment_bytes;
    assert!(
        after <= bound,
        "{after} bytes after relocation, bound {bound}"
    );
    drop(engine); // no close: recovery must not need the deleted segments
    check(&open(&storage.restart_process(), &config).unwrap(), live);
}

#[test]
fn retained_log_is_never_reclaimed() {
    let (storage, _) = fault_storage();
    let config = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..KEYS {
        engine
            .put(ks, &key(k), &value(k, 0, VALUE_BYTES), Durability::Buffered)
            .unwrap();
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
    }
    engine.set_log_retention(WalPosition(0));
    let report = engine
        .relocate(Strategy::Wal {
            segments: usize::MAX,
        })
        .unwrap();
    assert_eq!(report.segments_deleted, 0, "retention keeps every segment");
    engine.set_log_retention(WalPosition(u64::MAX));
    let report = engine
        .relocate(Strategy::Wal {
            segments: usize::MAX,
        })
        .unwrap();
    assert!(report.segments_deleted > 0);
}

/// A pass that moves every entry leaves one index entry per key: the flush
/// after it merges each cell (a move adds no key, so it counts like a
/// delete in the merge rule) instead of writing a delta beside the old base
/// that it shadows entry for entry (twice the bytes). The moved entries
/// are a little larger: a relocated copy's version is no longer its
/// location, so the blob stores it (8 bytes more per entry).
#[test]
fn relocating_everything_leaves_one_index_entry_per_key() {
    let (storage, _) = fault_storage();
    let mut config = config();
    config.index_merge_ratio = 2; // the default: deltas up to twice the base
    config.index_max_deltas = 8;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..KEYS {
        engine
            .put(ks, &key(k), &value(k, 0, 200), Durability::Buffered)
            .unwrap();
    }
    engine.flush().unwrap();
    let before = engine.metrics().index_live_bytes;
    let report = engine
        .relocate(Strategy::Index {
            below: engine.processed_position(),
        })
        .unwrap();
    assert_eq!(report.entries_relocated, KEYS);
    let after = engine.metrics().index_live_bytes;
    println!("index blobs referenced: {before} B before relocation, {after} B after");
    assert!(
        after <= before + before / 4,
        "{after} B of index after relocating everything, {before} B before"
    );
    check(&engine, |k| Some(value(k, 0, 200)));
    engine.close().unwrap();
    check(&open(&storage, &config).unwrap(), |k| {
        Some(value(k, 0, 200))
    });
}

/// Deletes write little (tombstones) but can leave whole segments dead:
/// background relocation gives their space back without waiting for a
/// segment's worth of new writes (a backup tool's prune is the last thing
/// it does).
#[test]
fn background_relocation_reclaims_after_deletes_alone() {
    let (storage, mut config) = fault_storage();
    config.relocation_enabled = true;
    config.relocation_interval_ms = 20;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..KEYS {
        engine
            .put(ks, &key(k), &value(k, 0, VALUE_BYTES), Durability::Buffered)
            .unwrap();
    }
    // A census sees the writes; nothing is garbage yet.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = wal_bytes(&engine);
    for k in 0..KEYS - 10 {
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let after = wal_bytes(&engine);
        if after * 2 < before {
            println!("value WAL: {before} B before the deletes, {after} B after");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "value WAL still {after} B of {before} B after the deletes"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    check(&engine, |k| {
        (k >= KEYS - 10).then(|| value(k, 0, VALUE_BYTES))
    });
}

/// Drops the keys in the top quarter of the hash space (their first 8 bytes,
/// big-endian): what a shard split off the top quarter of a group's range
/// leaves the group to shed.
struct TopQuarter;

impl RelocationFilter for TopQuarter {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        let position = u64::from_be_bytes(entry.key[..8].try_into().unwrap());
        if position >= u64::MAX / 4 * 3 {
            Decision::Drop
        } else {
            Decision::Keep
        }
    }
}

#[test]
fn a_filter_set_later_is_shed_in_the_background_without_new_writes() {
    let (storage, mut config) = fault_storage();
    config.relocation_enabled = true;
    config.relocation_interval_ms = 20;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..KEYS {
        engine
            .put(ks, &key(k), &value(k, 0, VALUE_BYTES), Durability::Buffered)
            .unwrap();
    }
    // A census sees the writes; nothing is garbage, nothing moves.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = wal_bytes(&engine);
    let all = KEYS * VALUE_BYTES as u64;
    let size = engine.data_bytes().expect("a census ran");
    assert!(
        (all..all + all / 10).contains(&size),
        "{size} B of values counted, {all} B written"
    );
    // A quarter to shed: below the garbage threshold (a half), so only the
    // filter's own rule makes relocation pass over those segments.
    engine.set_relocation_filter(std::sync::Arc::new(TopQuarter));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let usage = engine.segment_usage().unwrap();
        let left: u64 = usage
            .iter()
            .filter(|u| u.sealed)
            .map(|u| u.shed_bytes)
            .sum();
        let after = wal_bytes(&engine);
        if left == 0 && after < before * 17 / 20 {
            println!("value WAL: {before} B before the filter, {after} B after shedding");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{left} B still to shed; value WAL {after} B of {before} B"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let kept = |k: u64| u64::from_be_bytes(key(k)[..8].try_into().unwrap()) < u64::MAX / 4 * 3;
    // The size counts what the filter keeps; relocation's copies are not
    // new data.
    let kept_bytes = (0..KEYS).filter(|k| kept(*k)).count() as u64 * VALUE_BYTES as u64;
    let size = engine.data_bytes().expect("a census ran since the filter");
    assert!(
        (kept_bytes..kept_bytes + kept_bytes / 10).contains(&size),
        "{size} B of values counted, {kept_bytes} B kept"
    );
    let mut unshed = 0;
    for k in 0..KEYS {
        let got = engine.get(ks, &key(k)).unwrap().map(|v| v.to_vec());
        if kept(k) {
            assert_eq!(got, Some(value(k, 0, VALUE_BYTES)), "key {k} kept");
        } else if got.is_some() {
            unshed += 1;
        }
    }
    // Only values in the active segment (never relocated) may remain.
    let dropped = (0..KEYS).filter(|k| !kept(*k)).count() as u64;
    println!("{unshed} of {dropped} keys to shed are still in the active segment");
    assert!(unshed * VALUE_BYTES as u64 <= config.wal_segment_bytes && unshed < dropped / 2);
}

/// Index relocation asked for everything (a cutoff past the WAL's end)
/// relocates what the WAL held when it began and keeps its own copies:
/// before, the segments its copies filled counted as emptied (sealed,
/// entirely below the cutoff) and were deleted, and every key read from a
/// deleted segment.
#[test]
fn relocating_below_a_cutoff_past_the_end_keeps_its_copies() {
    let (storage, _) = fault_storage();
    let config = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..200 {
        engine
            .put(ks, &key(k), &value(k, 0, VALUE_BYTES), Durability::Buffered)
            .unwrap();
    }
    engine
        .relocate(Strategy::Index {
            below: WalPosition(u64::MAX),
        })
        .unwrap();
    for k in 0..200 {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().map(|v| v.to_vec()),
            Some(value(k, 0, VALUE_BYTES)),
            "key {k}"
        );
    }
    engine.close().unwrap();
    drop(engine);
    let engine = open(&storage, &config).unwrap();
    for k in 0..200 {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().map(|v| v.to_vec()),
            Some(value(k, 0, VALUE_BYTES)),
            "key {k} after a reopen"
        );
    }
}

/// A live value that fails its checksum is left where it is, its segment
/// kept, and the pass goes on: every other segment is reclaimed and every
/// other value reads back. Before, the pass failed on it before reclaiming
/// anything — and the background policy, taking the oldest segments
/// first, met the same record every pass: reclamation stopped for good.
#[test]
fn a_damaged_live_value_keeps_its_segment_and_the_rest_is_reclaimed() {
    let (storage, _) = fault_storage();
    let config = config();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut positions = Vec::new();
    for k in 0..KEYS {
        positions.push(
            engine
                .put(ks, &key(k), &value(k, 0, VALUE_BYTES), Durability::Buffered)
                .unwrap(),
        );
    }
    let survives = |k: u64| k % 10 < 3;
    for k in (0..KEYS).filter(|k| !survives(*k)) {
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
    }
    engine.close().unwrap();
    // Key 10 survives and lives in the first segment: its value's bytes
    // are damaged on disk (the engine reopened reads them from there).
    let damaged = 10;
    let at = positions[damaged as usize].0;
    let segment = at / config.wal_segment_bytes;
    let path = std::path::PathBuf::from(format!("/db/wal/{segment:016x}.wal"));
    storage
        .corrupt(&path, at % config.wal_segment_bytes + 100, 0x01)
        .unwrap();
    let engine = open(&storage, &config).unwrap();
    let before = wal_bytes(&engine);
    let report = engine
        .relocate(Strategy::Index {
            below: engine.processed_position(),
        })
        .unwrap();
    let after = wal_bytes(&engine);
    println!("{before} -> {after} bytes of WAL segments; {report:?}");
    assert_eq!(report.entries_unreadable, 1, "{report:?}");
    assert!(report.segments_deleted > 0, "{report:?}");
    let bound = before * 3 / 10 + 5 * config.wal_segment_bytes;
    assert!(
        after <= bound,
        "{after} bytes after relocation, bound {bound}"
    );
    assert!(
        engine
            .segment_usage()
            .unwrap()
            .iter()
            .any(|s| s.segment.0 == segment),
        "the damaged value's segment is kept"
    );
    assert!(matches!(
        engine.get(ks, &key(damaged)),
        Err(tidepool_engine::Error::Corrupt { .. })
    ));
    // Met again, the segment counts once.
    let again = engine
        .relocate(Strategy::Index {
            below: engine.processed_position(),
        })
        .unwrap();
    assert_eq!(again.entries_unreadable, 1, "{again:?}");
    assert_eq!(engine.metrics().counters.unreadable_values, 1);
    for k in (0..KEYS).filter(|k| survives(*k) && *k != damaged) {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().map(|v| v.to_vec()),
            Some(value(k, 0, VALUE_BYTES)),
            "key {k}"
        );
    }
}

/// On a full disk, background relocation gives back the segments holding
/// nothing live first, without copying a byte. Before, it took the oldest
/// segments first: a pass met one with live values, failed to copy them
/// (DISK_FULL), and reclaimed none of the dead segments after it — every
/// pass again, so the disk stayed full.
#[test]
fn a_full_disk_gives_back_dead_segments_before_copying_anything() {
    let (storage, _) = fault_storage();
    let mut config = Config::for_tests("/db");
    config.relocation_enabled = true;
    config.relocation_interval_ms = 20;
    config.relocation_pressure_free_bytes = u64::MAX;
    config.snapshot_interval_ms = 3_600_000;
    let size = config.wal_segment_bytes;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let len = 6_000;
    let mut segment_of = Vec::new();
    for k in 0..60u64 {
        let at = engine
            .put(ks, &key(k), &value(k, 0, len), Durability::Buffered)
            .unwrap();
        segment_of.push(at.0 / size);
    }
    let first = segment_of[0];
    // The two oldest segments keep most of their values (copying them
    // needs more than the room left); the next three hold nothing live.
    let mostly_live = [first, first + 1];
    let dead = [first + 2, first + 3, first + 4];
    let mut deleted = 0;
    for k in 0..60u64 {
        let s = segment_of[k as usize];
        if dead.contains(&s) || (mostly_live.contains(&s) && k.is_multiple_of(5)) {
            engine.delete(ks, &key(k), Durability::Buffered).unwrap();
            deleted += 1;
        }
    }
    assert!(deleted > 20);
    engine.flush().unwrap();
    // Room for small files (the control file, index blobs), not for a
    // new value segment.
    storage.set_capacity_bytes(Some(storage.used_bytes() + size / 4));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let left: Vec<u64> = engine
            .segment_usage()
            .unwrap()
            .iter()
            .map(|s| s.segment.0)
            .filter(|s| dead.contains(s))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "dead segments {left:?} never given back on the full disk"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    storage.set_capacity_bytes(None);
    for k in 0..60u64 {
        let s = segment_of[k as usize];
        let live = !(dead.contains(&s) || (mostly_live.contains(&s) && k.is_multiple_of(5)));
        assert_eq!(engine.get(ks, &key(k)).unwrap().is_some(), live, "key {k}");
    }
}

/// Under pressure, a dead segment the log retention still holds is not
/// chosen: chosen alone (nothing live to copy), it held every pass on
/// itself — the pass reclaimed nothing, not even the segments below the
/// retention whose garbage it could have copied away.
#[test]
fn a_dead_segment_the_retention_holds_does_not_hold_relocation_under_pressure() {
    let (storage, _) = fault_storage();
    let mut config = Config::for_tests("/db");
    config.relocation_enabled = true;
    config.relocation_interval_ms = 20;
    config.relocation_pressure_free_bytes = u64::MAX;
    config.snapshot_interval_ms = 3_600_000;
    let size = config.wal_segment_bytes;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let len = 6_000;
    let mut segment_of = Vec::new();
    for k in 0..60u64 {
        let at = engine
            .put(ks, &key(k), &value(k, 0, len), Durability::Buffered)
            .unwrap();
        segment_of.push(at.0 / size);
    }
    let first = segment_of[0];
    let garbage = [first, first + 1];
    let held = first + 3;
    let gone = |k: u64| {
        let s = segment_of[k as usize];
        s == held || (garbage.contains(&s) && k.is_multiple_of(3))
    };
    for k in (0..60u64).filter(|k| gone(*k)) {
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
    }
    engine.set_log_retention(WalPosition(held * size));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let left: Vec<u64> = engine
            .segment_usage()
            .unwrap()
            .iter()
            .map(|s| s.segment.0)
            .filter(|s| garbage.contains(s))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "segments {left:?} below the retention never relocated"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        engine
            .segment_usage()
            .unwrap()
            .iter()
            .any(|s| s.segment.0 == held),
        "the held segment stays"
    );
    for k in 0..60u64 {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().is_some(),
            !gone(k),
            "key {k}"
        );
    }
}
