//! Crashes during relocation and during an epoch drop, at every storage
//! operation they perform: after a power loss (torn unsynced sectors) or a
//! process crash, the store equals the model — relocation never changes
//! what is visible; an interrupted drop leaves each expired key either
//! present with its value or gone, and a drop that returned is complete.
//! No live key is lost, no deleted key comes back.
//!
//! Prints its seed; replay with `RECLAIM_CRASH_SEED=<seed>`.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{key, open, value};
use tidepool_engine::storage::FaultStorage;
use tidepool_engine::{
    Config, Decision, Durability, Engine, EntryInfo, Epoch, RelocationFilter, Strategy, Tag,
    WriteBatch,
};

const KEYS: u64 = 120;

struct KeepDurable;

impl RelocationFilter for KeepDurable {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        if entry.tag == Tag(1) {
            Decision::Keep
        } else {
            Decision::Drop
        }
    }
}

/// Key -> (value, epoch, durable).
type Model = BTreeMap<u64, (Vec<u8>, u32, bool)>;

fn config() -> Config {
    let mut config = Config::for_tests("/db");
    config.relocation_enabled = false;
    config.snapshot_interval_ms = 3_600_000;
    config
}

/// Three epochs of puts, overwrites and deletes; all synced at the end.
fn populate(engine: &Engine, seed: u64) -> Model {
    let ks = engine.key_space("default").unwrap();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model = Model::new();
    for epoch in 1..=3u32 {
        if epoch > 1 {
            engine.advance_epoch(Epoch(epoch)).unwrap();
        }
        for version in 0..150u64 {
            let k = rng.random_range(0..KEYS);
            if rng.random_bool(0.2) {
                engine.delete(ks, &key(k), Durability::Buffered).unwrap();
                model.remove(&k);
            } else {
                let durable = rng.random_bool(0.25);
                let v = value(
                    k,
                    u64::from(epoch) * 1000 + version,
                    rng.random_range(50..1_500),
                );
                let mut batch = WriteBatch::new();
                batch.put_tagged(ks, &key(k), &v, if durable { Tag(1) } else { Tag(0) });
                engine.write_batch(&batch, Durability::Buffered).unwrap();
                model.insert(k, (v, epoch, durable));
            }
        }
    }
    engine.wait_synced(engine.processed_position()).unwrap();
    model
}

#[derive(Clone, Copy, Debug)]
enum Operation {
    RelocateWal,
    RelocateIndex,
    DropBelow3,
}

fn run(engine: &Engine, operation: Operation) -> bool {
    match operation {
        Operation::RelocateWal => engine
            .relocate(Strategy::Wal {
                segments: usize::MAX,
            })
            .is_ok(),
        Operation::RelocateIndex => engine
            .relocate(Strategy::Index {
                below: engine.processed_position(),
            })
            .is_ok(),
        Operation::DropBelow3 => engine.drop_epochs_below(Epoch(3), &KeepDurable).is_ok(),
    }
}

fn verify(engine: &Engine, model: &Model, operation: Operation, completed: bool, context: &str) {
    let ks = engine.key_space("default").unwrap();
    let expired: BTreeSet<u64> = match operation {
        Operation::DropBelow3 => model
            .iter()
            .filter(|(_, (_, e, d))| *e < 3 && !d)
            .map(|(k, _)| *k)
            .collect(),
        _ => BTreeSet::new(),
    };
    for k in 0..KEYS {
        let got = engine
            .get(ks, &key(k))
            .unwrap_or_else(|e| panic!("{context}: key {k}: {e}"))
            .map(|v| v.to_vec());
        let expected = model.get(&k).map(|(v, _, _)| v.clone());
        if expired.contains(&k) {
            assert!(
                got.is_none() || got == expected,
                "{context}: expired key {k} has a value never written"
            );
            assert!(
                !completed || got.is_none(),
                "{context}: the drop returned, but expired key {k} is back"
            );
        } else {
            assert_eq!(got, expected, "{context}: key {k}");
        }
    }
}

#[test]
fn crashes_at_every_step_of_relocation_and_drops_lose_nothing() {
    let seed = tidepool_testkit::seed_from_env("RECLAIM_CRASH_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let config = config();
    let mut points = 0;
    for operation in [
        Operation::RelocateWal,
        Operation::RelocateIndex,
        Operation::DropBelow3,
    ] {
        // How many storage operations the operation takes without a crash.
        let probe = FaultStorage::default();
        let engine = open(&probe, &config).unwrap();
        let model = populate(&engine, seed);
        let before = probe.ops();
        assert!(run(&engine, operation));
        let total = probe.ops() - before;
        verify(
            &engine,
            &model,
            operation,
            true,
            &format!("seed {seed}, {operation:?} without a crash"),
        );
        drop(engine);
        for crash_at in 1..=total + 1 {
            let storage = FaultStorage::default();
            let engine = open(&storage, &config).unwrap();
            populate(&engine, seed);
            storage.crash_at_op(storage.ops() + crash_at);
            let completed = run(&engine, operation);
            drop(engine);
            points += 1;
            let context = format!("seed {seed}, {operation:?}, crash at op {crash_at}/{total}");
            let after_kill = open(&storage.restart_process(), &config)
                .unwrap_or_else(|e| panic!("{context}: reopen after kill: {e}"));
            verify(
                &after_kill,
                &model,
                operation,
                completed,
                &format!("{context} (process crash)"),
            );
            drop(after_kill);
            let reboot_seed: u64 = rng.random();
            let rebooted = open(&storage.reboot(reboot_seed), &config)
                .unwrap_or_else(|e| panic!("{context}: reopen after power loss: {e}"));
            verify(
                &rebooted,
                &model,
                operation,
                completed,
                &format!("{context}, reboot seed {reboot_seed} (power loss)"),
            );
        }
    }
    println!("seed {seed}: {points} crash points");
}
