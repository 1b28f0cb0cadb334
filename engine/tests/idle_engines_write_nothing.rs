//! An engine with nothing new to record leaves its control file alone:
//! its maintenance rounds go on (every `snapshot_interval_ms`) but do not
//! rewrite the same bytes. A node hosting a thousand idle replicas used to
//! replace a thousand control files (two fsyncs each) every interval.
//! Its logs' syncers park too, and a buffered write wakes them.

mod support;

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use support::{key, value};
use tidepool_engine::{Config, Durability, Engine};

fn snapshots(engine: &Engine) -> u64 {
    engine.metrics().counters.snapshots
}

/// The control file's inode: a rewrite replaces the file (write, rename).
fn control_inode(dir: &std::path::Path) -> u64 {
    std::fs::metadata(dir.join("control")).unwrap().ino()
}

#[test]
fn an_idle_engine_keeps_its_control_file_and_a_changed_one_rewrites_it() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("db");
    let mut config = Config::new(&dir);
    config.snapshot_interval_ms = 10;
    config.sync_interval_ms = 10;
    let engine = Engine::open(config.clone()).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in 0..100 {
        engine
            .put(ks, &key(i), &value(i, 1, 500), Durability::Buffered)
            .unwrap();
    }
    engine.flush().unwrap();
    // Let the background syncer and a few rounds settle what they record.
    std::thread::sleep(Duration::from_millis(200));
    let (count, inode) = (snapshots(&engine), control_inode(&dir));

    // About thirty maintenance rounds with nothing new.
    let kept = engine.metrics().counters.snapshots_unchanged;
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        engine.metrics().counters.snapshots_unchanged > kept,
        "no maintenance round ran"
    );
    assert_eq!(
        snapshots(&engine),
        count,
        "an idle engine rewrote its control file"
    );
    assert_eq!(control_inode(&dir), inode, "the control file was replaced");

    // A change is recorded by the next round, without being asked.
    engine
        .put(ks, &key(1_000), &value(1_000, 1, 500), Durability::Synced)
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while snapshots(&engine) == count {
        assert!(
            std::time::Instant::now() < deadline,
            "no snapshot after a write"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_ne!(control_inode(&dir), inode);

    // What the kept file says is still the truth: a reopen (no close, as
    // after a crash) finds every value.
    engine.shutdown();
    drop(engine);
    let engine = Engine::open(config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in (0..100).chain([1_000]) {
        assert_eq!(engine.get(ks, &key(i)).unwrap().unwrap(), value(i, 1, 500));
    }
}

#[test]
fn buffered_writes_after_idle_spells_are_synced_within_the_interval() {
    // An idle log's syncer parks after ten runs with nothing to sync; the
    // next writer wakes it. Writes land at random moments around the
    // parking (a race the syncer and writers settle with fences): each must
    // become durable by itself, as soon as a running syncer would make it.
    let seed = tidepool_testkit::seed_from_env("IDLE_SYNC_SEED");
    let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(seed);
    let root = tempfile::tempdir().unwrap();
    let mut config = Config::new(root.path().join("db"));
    config.sync_interval_ms = 2;
    let engine = Engine::open(config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in 0..60 {
        // 0-120 ms idle: around the ten runs (of 2 ms or more each) after
        // which the syncer parks.
        let idle = rand::Rng::random_range(&mut rng, 0..120);
        std::thread::sleep(Duration::from_millis(idle));
        engine
            .put(ks, &key(i), &value(i, 1, 100), Durability::Buffered)
            .unwrap();
        let written = engine.metrics().wal_processed;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while engine.metrics().wal_synced < written {
            assert!(
                std::time::Instant::now() < deadline,
                "seed {seed}: write {i} after {idle} ms idle not durable 2 s later"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
