//! A directory is held by one open engine at a time — in this process or
//! another — until it is closed, shut down or dropped: two engines on one
//! directory would delete and overwrite each other's segment files.
//! `shutdown` stops an engine (no final flush or snapshot; it touches its
//! files no more), and the next open recovers what it had acknowledged as
//! durable.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use support::{fault_storage, key, open};
use tidepool_engine::storage::{FaultStorage, read_whole_file};
use tidepool_engine::{Config, Durability, Engine, Error};

fn files(storage: &FaultStorage) -> BTreeMap<PathBuf, Vec<u8>> {
    storage
        .paths()
        .into_iter()
        .map(|path| {
            let bytes = read_whole_file(storage, &path).unwrap().unwrap();
            (path, bytes)
        })
        .collect()
}

#[test]
fn a_second_open_of_a_held_directory_is_refused_on_real_files() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::for_tests(dir.path());
    let first = Engine::open(config.clone()).unwrap();
    let Err(refused) = Engine::open(config.clone()) else {
        panic!("a second open of a held directory succeeded");
    };
    assert!(matches!(refused, Error::Locked(_)), "{refused}");
    assert!(refused.to_string().contains("in use"), "{refused}");
    first.close().unwrap();
    // Closed: the directory is free again, also for a dropped engine.
    let second = Engine::open(config.clone()).unwrap();
    drop(second);
    Engine::open(config).unwrap().close().unwrap();
}

#[test]
fn another_process_cannot_open_a_held_directory() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::for_tests(dir.path());
    let engine = Engine::open(config).unwrap();
    // flock(1) from util-linux tries the same lock file from another process.
    let lock = dir.path().join(tidepool_engine::storage::LOCK_FILE);
    let held = std::process::Command::new("flock")
        .args(["--nonblock", "--conflict-exit-code", "7"])
        .arg(&lock)
        .arg("true")
        .status()
        .expect("flock(1) runs");
    assert_eq!(
        held.code(),
        Some(7),
        "the lock is visible to other processes"
    );
    engine.close().unwrap();
    let free = std::process::Command::new("flock")
        .args(["--nonblock", "--conflict-exit-code", "7"])
        .arg(&lock)
        .arg("true")
        .status()
        .unwrap();
    assert_eq!(free.code(), Some(0), "close lets go of the lock");
}

#[test]
fn shutdown_frees_the_directory_and_touches_it_no_more() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in 0..200 {
        engine
            .put(ks, &key(i), &i.to_le_bytes(), Durability::Synced)
            .unwrap();
    }
    assert!(matches!(open(&storage, &config), Err(Error::Locked(_))));
    engine.shutdown();
    // Once shutdown returns, the engine never touches its files again
    // (background work in flight when it was called has finished).
    let after = files(&storage);
    std::thread::sleep(std::time::Duration::from_millis(
        3 * config.snapshot_interval_ms.max(config.sync_interval_ms),
    ));
    assert!(files(&storage) == after, "files changed after shutdown");
    // A handle kept elsewhere is refused from now on.
    assert!(matches!(engine.get(ks, &key(1)), Err(Error::Closed)));
    assert!(matches!(
        engine.put(ks, &key(999), b"late", Durability::Buffered),
        Err(Error::Closed)
    ));
    // The reopened engine recovers every synced write, while the old handle
    // is still alive.
    let reopened = open(&storage, &config).unwrap();
    for i in 0..200 {
        assert_eq!(
            reopened.get(ks, &key(i)).unwrap().as_deref(),
            Some(&i.to_le_bytes()[..]),
            "key {i}"
        );
    }
    assert_eq!(reopened.get(ks, &key(999)).unwrap(), None);
    drop(engine);
    reopened
        .put(ks, &key(1_000), b"after", Durability::Synced)
        .unwrap();
    reopened.close().unwrap();
    let last = open(&storage, &config).unwrap();
    assert_eq!(
        last.get(ks, &key(1_000)).unwrap().as_deref(),
        Some(&b"after"[..])
    );
}
