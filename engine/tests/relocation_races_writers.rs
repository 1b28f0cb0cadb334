//! Relocation concurrent with writes: writers overwrite and delete their
//! keys while relocation passes (both strategies, and the background
//! policy) copy, repoint and delete segments underneath them, and a reader
//! reads everything. A shadow model proves that no relocated older value
//! ever replaces a newer write, no deleted key comes back, and no live key
//! disappears.
//!
//! Prints its seed; replay with `RELOCATION_SEED=<seed>`.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};

use support::shadow::Shadow;
use tidepool_engine::{Config, Engine, Strategy};

const WRITERS: u64 = 2;
const OPS_PER_WRITER: u64 = 10_000;

#[test]
fn relocation_never_replaces_a_newer_write_or_loses_a_live_key() {
    let seed = tidepool_testkit::seed_from_env("RELOCATION_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::for_tests(dir.path());
    config.relocation_interval_ms = 20;
    config.relocation_garbage_ratio = 0.3;
    let engine = Engine::open(config.clone()).unwrap();
    let shadow = Shadow::new(200, 4);
    let stop = AtomicBool::new(false);
    let (reads, passes) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|id| {
                let (engine, shadow) = (&engine, &shadow);
                s.spawn(move || shadow.write(engine, id, WRITERS, OPS_PER_WRITER, 0.0, seed))
            })
            .collect();
        let reader = s.spawn(|| shadow.read_until(&engine, &stop, seed));
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
    shadow.check_final(&engine, &format!("seed {seed}"));
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
    shadow.check_final(
        &Engine::open(config).unwrap(),
        &format!("seed {seed}, after a crash"),
    );
}
