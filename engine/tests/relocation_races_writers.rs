//! Relocation concurrent with writes: writers overwrite and delete their
//! keys while relocation passes (both strategies, and the background
//! policy) copy, repoint and delete segments underneath them, and readers
//! read everything. A shadow model proves that no relocated older value
//! ever replaces a newer write, no deleted key comes back, and no live key
//! disappears.
//!
//! Prints its seed; replay with `RELOCATION_SEED=<seed>`.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{key, value, version_of};
use tidepool_engine::{Config, Durability, Engine, Strategy};

const WRITERS: u64 = 2;
const KEYS: u64 = 200;
const OPS_PER_WRITER: u64 = 10_000;

fn is_delete(version: u64) -> bool {
    version.is_multiple_of(4)
}

struct Shadow {
    acked: Vec<AtomicU64>,
    started: Vec<AtomicU64>,
}

fn write(engine: &Engine, shadow: &Shadow, id: u64, seed: u64) {
    let ks = engine.key_space("default").unwrap();
    let mut rng = SmallRng::seed_from_u64(seed ^ (id + 1));
    let mine: Vec<u64> = (0..KEYS).filter(|k| k % WRITERS == id).collect();
    for _ in 0..OPS_PER_WRITER {
        let k = mine[rng.random_range(0..mine.len())];
        let version = shadow.started[k as usize].load(Ordering::SeqCst) + 1;
        shadow.started[k as usize].store(version, Ordering::SeqCst);
        if is_delete(version) {
            engine.delete(ks, &key(k), Durability::Buffered).unwrap();
        } else {
            let v = value(k, version, rng.random_range(100..2_000));
            engine.put(ks, &key(k), &v, Durability::Buffered).unwrap();
        }
        shadow.acked[k as usize].store(version, Ordering::SeqCst);
    }
}

fn read(engine: &Engine, shadow: &Shadow, stop: &AtomicBool, seed: u64) -> u64 {
    let ks = engine.key_space("default").unwrap();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut reads = 0;
    while !stop.load(Ordering::SeqCst) {
        let k = rng.random_range(0..KEYS);
        let acked = shadow.acked[k as usize].load(Ordering::SeqCst);
        let got = engine.get(ks, &key(k)).unwrap();
        let started = shadow.started[k as usize].load(Ordering::SeqCst);
        match got {
            Some(v) => {
                let version = version_of(&v);
                assert!(
                    version >= acked && version <= started,
                    "seed {seed}: key {k} read version {version}, acknowledged {acked}, started {started}"
                );
                assert_eq!(
                    v,
                    value(k, version, v.len()),
                    "seed {seed}: key {k} damaged"
                );
            }
            None => assert!(
                acked == 0 || (acked..=started).any(is_delete),
                "seed {seed}: key {k} vanished (acknowledged {acked}, started {started})"
            ),
        }
        reads += 1;
    }
    reads
}

#[test]
fn relocation_never_replaces_a_newer_write_or_loses_a_live_key() {
    let seed = tidepool_testkit::seed_from_env("RELOCATION_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::for_tests(dir.path());
    config.relocation_interval_ms = 20;
    config.relocation_garbage_ratio = 0.3;
    let engine = Engine::open(config.clone()).unwrap();
    let shadow = Shadow {
        acked: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
        started: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
    };
    let stop = AtomicBool::new(false);
    let (reads, passes) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|id| {
                let (engine, shadow) = (&engine, &shadow);
                s.spawn(move || write(engine, shadow, id, seed))
            })
            .collect();
        let reader = s.spawn(|| read(&engine, &shadow, &stop, seed));
        let relocator = s.spawn(|| {
            let mut passes = 0;
            while !stop.load(Ordering::SeqCst) {
                let strategy = if passes % 2 == 0 {
                    Strategy::Wal { segments: 4 }
                } else {
                    Strategy::Index {
                        below: engine.processed_position(),
                    }
                };
                engine.relocate(strategy).unwrap();
                passes += 1;
            }
            passes
        });
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        (reader.join().unwrap(), relocator.join().unwrap())
    });
    let check = |engine: &Engine, context: &str| {
        let ks = engine.key_space("default").unwrap();
        for k in 0..KEYS {
            let last = shadow.acked[k as usize].load(Ordering::SeqCst);
            let got = engine.get(ks, &key(k)).unwrap().map(|v| version_of(&v));
            let expected = (last > 0 && !is_delete(last)).then_some(last);
            assert_eq!(got, expected, "seed {seed}, {context}: key {k}");
        }
    };
    check(&engine, "live");
    let counters = engine.metrics().counters;
    println!(
        "seed {seed}: {} writes, {reads} reads, {passes} explicit passes; {} entries relocated, {} segments deleted",
        WRITERS * OPS_PER_WRITER,
        counters.entries_relocated,
        counters.segments_deleted
    );
    assert!(
        counters.segments_deleted > 0,
        "relocation must really delete segments under the writers"
    );
    drop(engine);
    check(&Engine::open(config).unwrap(), "after a crash");
}
