//! Corruption: flipped bytes and truncated files in the value WAL, the index
//! log and the control file must give a typed error (`Error::Corrupt`) or a
//! correct answer — never wrong data, never a missing key that exists, never
//! a panic.
//!
//! Each case damages a private copy of a populated store. Prints its seed;
//! replay with `CORRUPTION_SEED=<seed>`.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{key, open, value};
use tidepool_engine::storage::{FaultStorage, Storage};
use tidepool_engine::{Config, Durability, Error};

type Model = BTreeMap<u64, Vec<u8>>;

/// Every write in order: key and new value (`None`: deleted).
type History = Vec<(u64, Option<Vec<u8>>)>;

/// The model after the first `n` writes.
fn model_after(history: &History, n: usize) -> Model {
    let mut model = Model::new();
    for (k, v) in &history[..n] {
        match v {
            Some(v) => model.insert(*k, v.clone()),
            None => model.remove(k),
        };
    }
    model
}

/// A store with 300 keys (some overwritten, some deleted), all synced.
/// `closed`: closed cleanly (nothing to replay); otherwise dropped, so the
/// next open replays the WAL's tail.
fn populated(config: &Config, closed: bool) -> (FaultStorage, History) {
    let storage = FaultStorage::default();
    let engine = open(&storage, config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut history = History::new();
    for round in 0..2 {
        for k in 0..300 {
            if round == 1 && k % 3 != 0 {
                continue;
            }
            let v = value(k, round, 100 + (k as usize * 37) % 900);
            engine.put(ks, &key(k), &v, Durability::Buffered).unwrap();
            history.push((k, Some(v)));
        }
    }
    for k in (0..300).step_by(7) {
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
        history.push((k, None));
    }
    engine.wait_synced(engine.processed_position()).unwrap();
    if closed {
        engine.close().unwrap();
    } else {
        drop(engine);
    }
    (storage.restart_process(), history)
}

/// Outcome of reading a damaged store.
#[derive(Debug, Default)]
struct Tally {
    open_refused: u32,
    reads_refused: u32,
    clean: u32,
}

/// Opens a damaged copy and reads every key. The readable keys must match
/// the full history — or, where damage may have cut the log's unsynced-
/// looking tail (`allow_cut`), the history up to some point. Panics on any
/// other answer.
fn check(
    storage: &FaultStorage,
    config: &Config,
    history: &History,
    allow_cut: bool,
    context: &str,
    tally: &mut Tally,
) {
    let engine = match open(storage, config) {
        Ok(engine) => engine,
        Err(Error::Corrupt { .. }) => {
            tally.open_refused += 1;
            return;
        }
        Err(other) => panic!("{context}: open failed with a non-corruption error: {other}"),
    };
    let ks = engine.key_space("default").unwrap();
    let mut readable = BTreeMap::new();
    for k in 0..300 {
        match (engine.get(ks, &key(k)), engine.exists(ks, &key(k))) {
            (Ok(got), Ok(present)) => {
                assert_eq!(
                    got.is_some(),
                    present,
                    "{context}: get and exists disagree on {k}"
                );
                readable.insert(k, got.map(|v| v.to_vec()));
            }
            (Err(Error::Corrupt { .. }), _) | (_, Err(Error::Corrupt { .. })) => {}
            (Err(other), _) | (_, Err(other)) => {
                panic!("{context}: key {k}: non-corruption error {other}")
            }
        }
    }
    let matches = |model: &Model| readable.iter().all(|(k, v)| model.get(k) == v.as_ref());
    let lengths = if allow_cut {
        0..=history.len()
    } else {
        history.len()..=history.len()
    };
    let consistent = lengths.rev().any(|n| matches(&model_after(history, n)));
    assert!(
        consistent,
        "{context}: the readable keys match no {} of the history",
        if allow_cut { "prefix" } else { "end" }
    );
    if readable.len() < 300 {
        tally.reads_refused += 1
    } else {
        tally.clean += 1
    }
}

/// Bytes of `path` up to its last non-zero byte (the written part).
fn written_len(storage: &FaultStorage, path: &Path) -> u64 {
    let file = storage.open(path).unwrap();
    let mut bytes = vec![0; file.len() as usize];
    file.read_at(&mut bytes, 0).unwrap();
    bytes
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |i| i as u64 + 1)
}

fn files(storage: &FaultStorage, dir: &str) -> Vec<PathBuf> {
    storage
        .paths()
        .into_iter()
        .filter(|p| p.starts_with(dir))
        .collect()
}

fn flip_campaign(
    config: &Config,
    closed: bool,
    dir: &str,
    flips: u32,
    rng: &mut SmallRng,
    seed: u64,
) -> Tally {
    let (pristine, history) = populated(config, closed);
    let targets = files(&pristine, dir);
    assert!(!targets.is_empty(), "no files under {dir}");
    let mut tally = Tally::default();
    for _ in 0..flips {
        let copy = pristine.restart_process();
        let path = &targets[rng.random_range(0..targets.len())];
        let used = written_len(&copy, path).max(1);
        let offset = rng.random_range(0..used);
        let bit = 1u8 << rng.random_range(0..8);
        copy.corrupt(path, offset, bit).unwrap();
        let context = format!(
            "seed {seed}: flip bit {bit:#04x} at {}:{offset}",
            path.display()
        );
        // Damage in the replayed tail may be taken for a torn write and cut
        // there (unless a durable sync mark proves it was synced).
        check(&copy, config, &history, !closed, &context, &mut tally);
    }
    tally
}

#[test]
fn flipped_bytes_give_typed_errors_or_correct_data() {
    let seed = tidepool_testkit::seed_from_env("CORRUPTION_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let loaded = Config::for_tests("/db");
    // No index memory: lookups read bloom filters and windows from disk.
    let mut on_disk = Config::for_tests("/db");
    on_disk.index_memory_bytes = 0;
    let cases = [
        ("WAL, closed store", &loaded, true, "/db/wal"),
        ("WAL, replayed tail", &loaded, false, "/db/wal"),
        ("index log, cells loaded", &loaded, true, "/db/index"),
        ("index log, window lookups", &on_disk, true, "/db/index"),
        ("control file", &loaded, true, "/db/control"),
    ];
    for (name, config, closed, dir) in cases {
        let tally = flip_campaign(config, closed, dir, 150, &mut rng, seed);
        println!("{name}: {tally:?}");
        assert!(
            tally.open_refused + tally.reads_refused > 0,
            "{name}: 150 random flips in written bytes and none detected"
        );
    }
}

#[test]
fn truncated_files_give_typed_errors_or_correct_data() {
    let seed = tidepool_testkit::seed_from_env("CORRUPTION_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let config = Config::for_tests("/db");
    for closed in [true, false] {
        let (pristine, history) = populated(&config, closed);
        let mut tally = Tally::default();
        for path in pristine.paths() {
            let len = pristine.open(&path).unwrap().len();
            for cut in [
                0,
                len / 2,
                len.saturating_sub(1),
                rng.random_range(0..len.max(1)),
            ] {
                let copy = pristine.restart_process();
                copy.truncate(&path, cut).unwrap();
                let context = format!(
                    "seed {seed}: {} cut to {cut} bytes (closed: {closed})",
                    path.display()
                );
                check(&copy, &config, &history, !closed, &context, &mut tally);
            }
        }
        println!("truncations (closed: {closed}): {tally:?}");
        assert!(
            tally.open_refused > 0,
            "truncating acknowledged data must be refused"
        );
    }
}

/// Damage to a record that a later, durable sync mark covers is damage to
/// synced data: strict recovery refuses to open even though the last
/// snapshot predates the data; `TruncateCorrupt` opens, cut at the damage,
/// with nothing wrong in what is read.
#[test]
fn damage_under_a_durable_sync_mark_is_refused() {
    let mut config = Config::for_tests("/db");
    config.snapshot_interval_ms = 3_600_000; // the control file stays old
    let storage = FaultStorage::default();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut history = History::new();
    let mut positions = Vec::new();
    for k in 0..60 {
        let v = value(k, 0, 300);
        positions.push(engine.put(ks, &key(k), &v, Durability::Synced).unwrap());
        history.push((k, Some(v)));
    }
    drop(engine);
    let damaged = storage.restart_process();
    let segment = positions[10].0 / config.wal_segment_bytes;
    let path = PathBuf::from(format!("/db/wal/{segment:016x}.wal"));
    damaged
        .corrupt(&path, positions[10].0 % config.wal_segment_bytes + 40, 0x01)
        .unwrap();
    assert!(
        matches!(
            open(&damaged.restart_process(), &config),
            Err(Error::Corrupt { .. })
        ),
        "strict recovery must refuse damage below a durable sync mark"
    );
    config.recovery = tidepool_engine::RecoveryMode::TruncateCorrupt;
    let mut tally = Tally::default();
    check(
        &damaged,
        &config,
        &history,
        true,
        "truncate mode",
        &mut tally,
    );
    assert_eq!(tally.open_refused, 0, "truncate mode opens");
    let engine = open(&damaged, &config).unwrap();
    assert!(
        engine.get(ks, &key(5)).unwrap().is_some(),
        "writes before the damage survive"
    );
    assert!(
        engine.get(ks, &key(50)).unwrap().is_none(),
        "writes after the damage are cut"
    );
}

/// A segment past the replay point whose header is damaged, or cannot be
/// read, holds durable records: strict recovery refuses to open and keeps
/// the file. Before, any such segment was taken for an unused spare and
/// deleted with its synced records (a transient EIO was enough).
#[test]
fn a_segment_with_a_damaged_or_unreadable_header_is_not_taken_for_a_spare() {
    let mut config = Config::for_tests("/db");
    config.snapshot_interval_ms = 3_600_000; // the control file stays old
    let storage = FaultStorage::default();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut last = 0;
    for k in 0..400 {
        let position = engine
            .put(ks, &key(k), &value(k, 0, 300), Durability::Synced)
            .unwrap();
        last = position.0 / config.wal_segment_bytes;
    }
    drop(engine);
    assert!(last >= 2, "the records span segments: last {last}");
    let path = PathBuf::from(format!("/db/wal/{last:016x}.wal"));

    // A flipped bit in its header.
    let damaged = storage.restart_process();
    damaged.corrupt(&path, 20, 0x01).unwrap();
    let damaged = damaged.restart_process();
    match open(&damaged, &config) {
        Err(Error::Corrupt { detail, .. }) => println!("damaged header: {detail}"),
        Err(other) => panic!("a damaged header: {other}"),
        Ok(_) => panic!("a damaged header over synced records was taken for a spare"),
    }
    assert!(damaged.paths().contains(&path), "the segment is kept");

    // Reads of it fail (EIO): the open fails, the segment stays, and once
    // it reads again every record is there.
    let failing = storage.restart_process();
    failing.fail_reads(&path, true).unwrap();
    match open(&failing, &config) {
        Err(Error::Io { .. }) => {}
        Err(other) => panic!("an unreadable header: {other}"),
        Ok(_) => panic!("an unreadable segment was taken for a spare"),
    }
    assert!(failing.paths().contains(&path), "the segment is kept");
    failing.fail_reads(&path, false).unwrap();
    let engine = open(&failing.restart_process(), &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..400 {
        assert_eq!(
            engine.get(ks, &key(k)).unwrap().as_deref(),
            Some(&value(k, 0, 300)[..]),
            "key {k}"
        );
    }
}
