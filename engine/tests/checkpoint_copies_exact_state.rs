//! A checkpoint copied into another directory opens as an engine holding
//! exactly the state at the checkpoint — even when the source keeps
//! writing, relocating and dropping the very segments the checkpoint lists
//! while the copy runs, and with writers racing the checkpoint itself.
//!
//! Prints its seed; replay with `CHECKPOINT_SEED=<seed>`.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{fault_storage, key, open, value};
use tidepool_engine::storage::{FaultStorage, Storage};
use tidepool_engine::{Checkpoint, Durability, Engine, Epoch, ItemInput, ItemOp, Strategy, Tag};

/// Writes the checkpoint's files under `dir` of `storage`, as a receiver
/// would.
fn copy_into(checkpoint: &Checkpoint, storage: &FaultStorage, dir: &Path) {
    for file in &checkpoint.files {
        let path = dir.join(&file.path);
        storage.create_dir_all(path.parent().unwrap()).unwrap();
        let out = storage.create(&path, file.file_len).unwrap();
        let mut offset = 0;
        while offset < file.len {
            let mut buf = vec![0; (file.len - offset).min(5000) as usize];
            file.read_at(&mut buf, offset).unwrap();
            out.write_at(&buf, offset).unwrap();
            offset += buf.len() as u64;
        }
        out.sync_all().unwrap();
        storage.sync_dir(path.parent().unwrap()).unwrap();
    }
}

fn read_all(engine: &Engine, keys: u64) -> BTreeMap<u64, Vec<u8>> {
    let ks = engine.key_space("default").unwrap();
    (0..keys)
        .filter_map(|k| engine.get(ks, &key(k)).unwrap().map(|v| (k, v.to_vec())))
        .collect()
}

#[test]
fn copy_of_a_checkpoint_holds_exactly_its_state() {
    let seed = tidepool_testkit::seed_from_env("CHECKPOINT_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let (storage, config) = fault_storage();
    let engine = Arc::new(open(&storage, &config).unwrap());
    let ks = engine.key_space("default").unwrap();
    const KEYS: u64 = 200;
    let mut model = BTreeMap::new();

    // Ordinary puts and deletes, replicated-style appends (applied or not),
    // an epoch roll, enough to span many segments and leave garbage.
    for version in 0..1_500u64 {
        let k = rng.random_range(0..KEYS);
        match rng.random_range(0..10) {
            0 => {
                engine.delete(ks, &key(k), Durability::Buffered).unwrap();
                model.remove(&k);
            }
            1 | 2 => {
                let v = value(k, version, rng.random_range(10..3_000));
                let input = ItemInput {
                    space: ks,
                    op: ItemOp::Put,
                    key: &key(k),
                    value: &v,
                    epoch: engine.epoch(),
                    tag: Tag(1),
                };
                let appended = engine.append(b"entry", &[input]).unwrap();
                if rng.random_bool(0.8) {
                    engine.apply(&appended).unwrap();
                    model.insert(k, v);
                }
            }
            _ => {
                let v = value(k, version, rng.random_range(10..3_000));
                engine.put(ks, &key(k), &v, Durability::Buffered).unwrap();
                model.insert(k, v);
            }
        }
        if version == 700 {
            engine.advance_epoch(Epoch(2)).unwrap();
        }
    }
    engine.relocate(Strategy::Wal { segments: 4 }).unwrap();
    engine.set_app_state(b"raft state at the checkpoint");

    // Writers on other keys race the checkpoint; each writes each key once.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(KEYS));
    let racer = {
        let (engine, stop, done) = (engine.clone(), stop.clone(), done.clone());
        std::thread::spawn(move || {
            let mut k = KEYS;
            while !stop.load(Ordering::Relaxed) && k < KEYS + 2_000 {
                engine
                    .put(ks, &key(k), &value(k, 0, 500), Durability::Buffered)
                    .unwrap();
                k += 1;
                done.store(k, Ordering::SeqCst);
            }
            k
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(5));
    let done_before = done.load(Ordering::SeqCst);
    let checkpoint = engine.checkpoint().unwrap();
    stop.store(true, Ordering::Relaxed);
    let raced = racer.join().unwrap();
    assert_eq!(checkpoint.app_state, b"raft state at the checkpoint");
    assert!(
        checkpoint.files.last().unwrap().path == Path::new("control"),
        "control file last"
    );

    // The source moves on: overwrites everything, relocates, and drops the
    // epoch-1 segments the checkpoint lists.
    for k in 0..KEYS {
        engine
            .put(ks, &key(k), &value(k, 9_999, 100), Durability::Buffered)
            .unwrap();
    }
    engine.set_app_state(b"later");
    engine.relocate(Strategy::Wal { segments: 64 }).unwrap();
    engine.advance_epoch(Epoch(3)).unwrap();
    engine
        .drop_epochs_below(Epoch(2), &tidepool_engine::KeepAll)
        .unwrap();
    engine.flush().unwrap();
    let gone = checkpoint
        .files
        .iter()
        .filter(|f| !storage.exists(&Path::new("/db").join(&f.path)))
        .count();
    assert!(
        gone > 0,
        "seed {seed}: the source deleted none of the checkpoint's files"
    );

    let copy_storage = FaultStorage::default();
    copy_into(&checkpoint, &copy_storage, Path::new("/copy"));
    let mut copy_config = config.clone();
    copy_config.dir = "/copy".into();
    let copy = open(&copy_storage, &copy_config).unwrap();
    assert_eq!(copy.app_state(), b"raft state at the checkpoint");
    let state = read_all(&copy, KEYS);
    let differing: Vec<_> = (0..KEYS).filter(|k| state.get(k) != model.get(k)).collect();
    assert!(
        differing.is_empty(),
        "seed {seed}: the copy differs from the checkpointed state on keys {differing:?}"
    );
    // A racing write is in the copy whole or not at all.
    let mut raced_in = 0;
    for k in KEYS..raced {
        match copy.get(ks, &key(k)).unwrap() {
            Some(v) => {
                assert_eq!(v.as_ref(), &value(k, 0, 500)[..], "seed {seed}: key {k}");
                raced_in += 1;
            }
            None => assert!(
                k >= done_before,
                "seed {seed}: write {k}, acknowledged before the checkpoint, is not in it"
            ),
        }
    }
    println!(
        "seed {seed}: {} racing writes, {raced_in} in the copy",
        raced - KEYS
    );

    // The copy is a working engine: it takes writes and survives a reopen.
    copy.put(ks, &key(1), b"after", Durability::Synced).unwrap();
    copy.close().unwrap();
    drop(copy);
    let copy = open(&copy_storage, &copy_config).unwrap();
    assert_eq!(
        copy.get(ks, &key(1)).unwrap().as_deref(),
        Some(&b"after"[..])
    );
    assert_eq!(read_all(&copy, KEYS).len(), {
        let mut m = model.clone();
        m.insert(1, b"after".to_vec());
        m.len()
    });
}
