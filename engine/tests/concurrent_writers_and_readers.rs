//! Concurrency stress: writer threads overwrite and delete their own keys,
//! reader threads read everyone's keys, and a third party flushes and
//! releases memory, all at once on real files. A shadow model per key
//! (acknowledged and started versions) proves that no read returns a value
//! older than one already acknowledged or newer than one started, and that
//! no update is lost.
//!
//! Prints its seed; replay with `STRESS_SEED=<seed>`.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};

use support::shadow::Shadow;
use tidepool_engine::{Config, Engine};

const WRITERS: u64 = 3;
const OPS_PER_WRITER: u64 = 3_000;

#[test]
fn no_lost_update_and_no_stale_read_under_concurrency() {
    let seed = tidepool_testkit::seed_from_env("STRESS_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::for_tests(dir.path());
    config.index_memory_bytes = 64 << 10;
    let engine = Engine::open(config.clone()).unwrap();
    let shadow = Shadow::new(240, 5);
    let stop = AtomicBool::new(false);
    let reads = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|id| {
                let (engine, shadow) = (&engine, &shadow);
                s.spawn(move || shadow.write(engine, id, WRITERS, OPS_PER_WRITER, 0.05, seed))
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (engine, shadow, stop) = (&engine, &shadow, &stop);
                s.spawn(move || shadow.read_until(engine, stop, seed.wrapping_add(r)))
            })
            .collect();
        let janitor = s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                engine.flush().unwrap();
                engine.release_memory();
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        });
        // Stop the readers and the janitor before reporting a writer's
        // panic, or the scope would wait for them forever.
        let written: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        stop.store(true, Ordering::SeqCst);
        for result in written {
            result.unwrap();
        }
        janitor.join().unwrap();
        readers.into_iter().map(|r| r.join().unwrap()).sum::<u64>()
    });
    shadow.check_final(&engine, &format!("seed {seed}"));
    engine.close().unwrap();
    shadow.check_final(
        &Engine::open(config).unwrap(),
        &format!("seed {seed}, reopened"),
    );
    println!(
        "seed {seed}: {} writes, {reads} concurrent reads",
        WRITERS * OPS_PER_WRITER
    );
    assert!(reads > 1_000, "readers must overlap the writers");
}
