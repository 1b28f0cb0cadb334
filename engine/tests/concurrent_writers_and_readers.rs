//! Concurrency stress: writer threads overwrite and delete their own keys,
//! reader threads read everyone's keys, and a third party flushes and
//! releases memory, all at once on real files. A shadow model per key
//! (acknowledged and started versions) proves that no read returns a value
//! older than one already acknowledged or newer than one started, and that
//! no update is lost.
//!
//! Prints its seed; replay with `STRESS_SEED=<seed>`.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{key, value, version_of};
use tidepool_engine::{Config, Durability, Engine};

const WRITERS: u64 = 3;
const KEYS: u64 = 240;
const OPS_PER_WRITER: u64 = 3_000;

/// Versions of a key are numbered from 1; every fifth is a delete.
fn is_delete(version: u64) -> bool {
    version.is_multiple_of(5)
}

struct Shadow {
    acked: Vec<AtomicU64>,
    started: Vec<AtomicU64>,
}

fn writer(engine: &Engine, shadow: &Shadow, id: u64, seed: u64) {
    let ks = engine.key_space("default").unwrap();
    let mut rng = SmallRng::seed_from_u64(seed ^ id);
    let mine: Vec<u64> = (0..KEYS).filter(|k| k % WRITERS == id).collect();
    for _ in 0..OPS_PER_WRITER {
        let k = mine[rng.random_range(0..mine.len())];
        let version = shadow.started[k as usize].load(Ordering::SeqCst) + 1;
        shadow.started[k as usize].store(version, Ordering::SeqCst);
        let durability = if rng.random_bool(0.05) {
            Durability::Synced
        } else {
            Durability::Buffered
        };
        if is_delete(version) {
            engine.delete(ks, &key(k), durability).unwrap();
        } else {
            engine
                .put(
                    ks,
                    &key(k),
                    &value(k, version, rng.random_range(1..1_500)),
                    durability,
                )
                .unwrap();
        }
        shadow.acked[k as usize].store(version, Ordering::SeqCst);
    }
}

fn reader(engine: &Engine, shadow: &Shadow, stop: &AtomicBool, seed: u64) -> u64 {
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
                    !is_delete(version),
                    "seed {seed}: key {k} read a delete's version"
                );
                assert!(
                    version >= acked || (is_delete(acked) && version > acked) || version == acked,
                    "seed {seed}: key {k} read version {version}, older than acknowledged {acked}"
                );
                assert!(
                    version <= started,
                    "seed {seed}: key {k} read version {version}, never started (started {started})"
                );
                assert_eq!(
                    v,
                    value(k, version, v.len()),
                    "seed {seed}: key {k} value damaged"
                );
            }
            None => {
                // Absent is right only if a delete at or after the
                // acknowledged version had started (or nothing was written).
                let deleted = (acked..=started).any(is_delete) || acked == 0;
                assert!(
                    deleted,
                    "seed {seed}: key {k} absent; acknowledged {acked}, started {started}"
                );
            }
        }
        reads += 1;
    }
    reads
}

#[test]
fn no_lost_update_and_no_stale_read_under_concurrency() {
    let seed = tidepool_testkit::seed_from_env("STRESS_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::for_tests(dir.path());
    config.index_memory_bytes = 64 << 10;
    let engine = Engine::open(config.clone()).unwrap();
    let shadow = Shadow {
        acked: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
        started: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
    };
    let stop = AtomicBool::new(false);
    let reads = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|id| {
                s.spawn({
                    let (engine, shadow) = (&engine, &shadow);
                    move || writer(engine, shadow, id, seed)
                })
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|r| {
                s.spawn({
                    let (engine, shadow, stop) = (&engine, &shadow, &stop);
                    move || reader(engine, shadow, stop, seed.wrapping_add(r))
                })
            })
            .collect();
        let janitor = s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                engine.flush().unwrap();
                engine.release_memory();
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        });
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        janitor.join().unwrap();
        readers.into_iter().map(|r| r.join().unwrap()).sum::<u64>()
    });
    let check = |engine: &Engine| {
        let ks = engine.key_space("default").unwrap();
        for k in 0..KEYS {
            let last = shadow.acked[k as usize].load(Ordering::SeqCst);
            let got = engine.get(ks, &key(k)).unwrap();
            if last == 0 || is_delete(last) {
                assert!(got.is_none(), "seed {seed}: key {k} should be absent");
            } else {
                assert_eq!(
                    got.map(|v| version_of(&v)),
                    Some(last),
                    "seed {seed}: key {k} lost its last update"
                );
            }
        }
    };
    check(&engine);
    engine.close().unwrap();
    check(&Engine::open(config).unwrap());
    println!(
        "seed {seed}: {} writes, {reads} concurrent reads",
        WRITERS * OPS_PER_WRITER
    );
    assert!(reads > 1_000, "readers must overlap the writers");
}
