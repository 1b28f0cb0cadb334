//! A randomized model test: a mix of puts, deletes, atomic batches, gets,
//! existence checks, scans, flushes, memory pressure, close/reopen or
//! crash/reopen cycles, relocation passes, touches, epoch advances and epoch
//! drops, checked against a `BTreeMap` after every step.
//!
//! Prints its seed; replay a failure with `MODEL_SEED=<seed>`. Runs 6,000
//! operations by default; `MODEL_OPS=<n>` runs more. A seed whose run has
//! not yet exercised merges, deltas, cell loads and disk lookups goes on in
//! steps of 1,000 (up to five times as many): the run must reach them all.

mod support;

use std::collections::BTreeMap;
use std::ops::Bound;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{fault_storage, key, open, prefixed_key, value};
use tidepool_engine::storage::FaultStorage;
use tidepool_engine::{
    Config, Decision, Direction, Durability, Engine, EntryInfo, Epoch, KeySpace, RelocationFilter,
    Strategy, Tag, WriteBatch,
};

/// Tag of entries epoch drops keep.
const DURABLE: Tag = Tag(1);

/// Keeps durable entries, drops the rest.
struct KeepDurable;

impl RelocationFilter for KeepDurable {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        if entry.tag == DURABLE {
            Decision::Keep
        } else {
            Decision::Drop
        }
    }
}

/// Model key: (key space index, key bytes).
type ModelKey = (usize, Vec<u8>);

struct Harness {
    rng: SmallRng,
    storage: FaultStorage,
    config: Config,
    engine: Engine,
    spaces: [KeySpace; 2],
    model: BTreeMap<ModelKey, Vec<u8>>,
    /// Epoch of each key's last write or touch, and whether it is durable
    /// (tagged to survive epoch drops).
    meta: BTreeMap<ModelKey, (u32, bool)>,
    epoch: u32,
    version: u64,
    seed: u64,
    /// Flushes, delta flushes, cell loads and blobs searched by disk
    /// lookups of engines closed so far.
    flushes: u64,
    deltas: u64,
    cell_loads: u64,
    blobs_searched: u64,
}

impl Harness {
    /// Flushes, delta flushes, cell loads and blobs searched on disk so
    /// far (across reopens).
    fn coverage(&self) -> (u64, u64, u64, u64) {
        let counters = self.engine.metrics().counters;
        (
            self.flushes + counters.flushes,
            self.deltas + counters.delta_flushes,
            self.cell_loads + counters.cell_loads,
            self.blobs_searched + counters.disk_lookup_blobs,
        )
    }

    /// Whether merges, deltas, loading and disk lookups have all run.
    fn covers_every_path(&self) -> bool {
        let (flushes, deltas, loads, blobs) = self.coverage();
        flushes > deltas && deltas > 0 && loads > 0 && blobs > 0
    }

    fn random_key(&mut self) -> ModelKey {
        let i = self.rng.random_range(0..400u64);
        if self.rng.random_bool(0.7) {
            (0, key(i).to_vec())
        } else {
            (1, prefixed_key(self.rng.random_range(0..5), i).to_vec())
        }
    }

    fn random_value(&mut self, id: u64) -> Vec<u8> {
        self.version += 1;
        let len = match self.rng.random_range(0..10) {
            0 => 0,
            1..=6 => self.rng.random_range(1..200),
            7 | 8 => self.rng.random_range(200..2_000),
            _ => self.rng.random_range(2_000..12_000),
        };
        value(id, self.version, len)
    }

    fn durability(&mut self) -> Durability {
        if self.rng.random_bool(0.1) {
            Durability::Synced
        } else {
            Durability::Buffered
        }
    }

    fn step(&mut self, op: u32) {
        let seed = self.seed;
        match op {
            0..=39 => {
                let k = self.random_key();
                let v = self.random_value(k.1[8] as u64);
                let d = self.durability();
                self.engine.put(self.spaces[k.0], &k.1, &v, d).unwrap();
                self.meta.insert(k.clone(), (self.epoch, false));
                self.model.insert(k, v);
            }
            40..=49 => {
                let k = self.random_key();
                let d = self.durability();
                self.engine.delete(self.spaces[k.0], &k.1, d).unwrap();
                self.meta.remove(&k);
                self.model.remove(&k);
            }
            50..=54 => self.batch(),
            55..=79 => {
                let k = self.random_key();
                let got = self.engine.get(self.spaces[k.0], &k.1).unwrap();
                assert_eq!(
                    got.as_deref(),
                    self.model.get(&k).map(Vec::as_slice),
                    "seed {seed}: get {k:?}"
                );
            }
            80..=87 => {
                let k = self.random_key();
                let got = self.engine.exists(self.spaces[k.0], &k.1).unwrap();
                assert_eq!(
                    got,
                    self.model.contains_key(&k),
                    "seed {seed}: exists {k:?}"
                );
            }
            88..=90 => self.scan(),
            91..=93 => self.engine.flush().unwrap(),
            94..=96 => self.engine.release_memory(),
            97 => self.reopen(true),
            98 => self.reopen(false),
            99 => self.verify_all(),
            100..=103 => self.touch(),
            104 => self.advance_epoch(),
            105 => self.drop_epochs(),
            _ => self.relocate(),
        }
    }

    fn touch(&mut self) {
        let k = self.random_key();
        let d = self.durability();
        let exists = self.engine.touch(self.spaces[k.0], &k.1, d).unwrap();
        assert_eq!(
            exists,
            self.model.contains_key(&k),
            "seed {}: touch {k:?}",
            self.seed
        );
        if let Some(meta) = self.meta.get_mut(&k) {
            meta.0 = self.epoch;
        }
    }

    fn advance_epoch(&mut self) {
        self.epoch += 1;
        self.engine.advance_epoch(Epoch(self.epoch)).unwrap();
    }

    fn drop_epochs(&mut self) {
        let below = self
            .epoch
            .saturating_sub(self.rng.random_range(0..3))
            .max(1);
        let report = self
            .engine
            .drop_epochs_below(Epoch(below), &KeepDurable)
            .unwrap();
        let expired: Vec<ModelKey> = self
            .meta
            .iter()
            .filter(|(_, (epoch, durable))| *epoch < below && !durable)
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(
            report.entries_dropped as usize,
            expired.len(),
            "seed {}: drop below {below}",
            self.seed
        );
        for k in expired {
            self.meta.remove(&k);
            self.model.remove(&k);
        }
    }

    fn relocate(&mut self) {
        let strategy = if self.rng.random_bool(0.5) {
            Strategy::Wal {
                segments: self.rng.random_range(1..6),
            }
        } else {
            Strategy::Index {
                below: self.engine.processed_position(),
            }
        };
        self.engine.relocate(strategy).unwrap();
    }

    fn batch(&mut self) {
        let mut batch = WriteBatch::new();
        let mut staged = Vec::new();
        for _ in 0..self.rng.random_range(1..8) {
            let k = self.random_key();
            if self.rng.random_bool(0.8) {
                let v = self.random_value(k.1[8] as u64);
                let durable = self.rng.random_bool(0.3);
                batch.put_tagged(
                    self.spaces[k.0],
                    &k.1,
                    &v,
                    if durable { DURABLE } else { Tag(0) },
                );
                staged.push((k, Some((v, durable))));
            } else {
                batch.delete(self.spaces[k.0], &k.1);
                staged.push((k, None));
            }
        }
        let d = self.durability();
        self.engine.write_batch(&batch, d).unwrap();
        for (k, v) in staged {
            match v {
                Some((v, durable)) => {
                    self.meta.insert(k.clone(), (self.epoch, durable));
                    self.model.insert(k, v);
                }
                None => {
                    self.meta.remove(&k);
                    self.model.remove(&k);
                }
            }
        }
    }

    fn scan(&mut self) {
        let seed = self.seed;
        if self.rng.random_bool(0.5) {
            // A prefix scan of the prefixed key space, either direction.
            let prefix = self.rng.random_range(0..5u32).to_be_bytes();
            let reverse = self.rng.random_bool(0.5);
            let direction = if reverse {
                Direction::Reverse
            } else {
                Direction::Forward
            };
            let got: Vec<(Vec<u8>, Vec<u8>)> = self
                .engine
                .scan_prefix(self.spaces[1], &prefix, direction)
                .unwrap()
                .map(|r| r.map(|(k, v)| (k, v.to_vec())))
                .collect::<Result<_, _>>()
                .unwrap();
            let mut expected: Vec<(Vec<u8>, Vec<u8>)> = self
                .model
                .range((1, prefix.to_vec())..(1, vec![0xFF; 17]))
                .filter(|((_, k), _)| k.starts_with(&prefix))
                .map(|((_, k), v)| (k.clone(), v.clone()))
                .collect();
            if reverse {
                expected.reverse();
            }
            assert_eq!(
                got, expected,
                "seed {seed}: prefix scan {prefix:?} {direction:?}"
            );
        } else if self.rng.random_bool(0.5) {
            // A bounded range scan of the uniform key space.
            let mut bounds = [
                key(self.rng.random_range(0..400u64)).to_vec(),
                key(self.rng.random_range(0..400u64)).to_vec(),
            ];
            bounds.sort();
            let reverse = self.rng.random_bool(0.5);
            let direction = if reverse {
                Direction::Reverse
            } else {
                Direction::Forward
            };
            let got: Vec<(Vec<u8>, Vec<u8>)> = self
                .engine
                .scan(
                    self.spaces[0],
                    Bound::Included(&bounds[0]),
                    Bound::Excluded(&bounds[1]),
                    direction,
                )
                .unwrap()
                .map(|r| r.map(|(k, v)| (k, v.to_vec())))
                .collect::<Result<_, _>>()
                .unwrap();
            let mut expected: Vec<(Vec<u8>, Vec<u8>)> = self
                .model
                .range((0, bounds[0].clone())..(0, bounds[1].clone()))
                .map(|((_, k), v)| (k.clone(), v.clone()))
                .collect();
            if reverse {
                expected.reverse();
            }
            assert_eq!(got, expected, "seed {seed}: range scan {direction:?}");
        } else {
            // "Largest key smaller than" in the uniform key space.
            let probe = key(self.rng.random_range(0..400u64)).to_vec();
            let got = self.engine.last_before(self.spaces[0], &probe).unwrap();
            let expected = self
                .model
                .range((
                    Bound::Included((0, vec![])),
                    Bound::Excluded((0, probe.clone())),
                ))
                .next_back()
                .map(|((_, k), v)| (k.clone(), v.clone()));
            assert_eq!(
                got.map(|(k, v)| (k, v.to_vec())),
                expected,
                "seed {seed}: last_before"
            );
        }
    }

    fn reopen(&mut self, clean: bool) {
        let counters = self.engine.metrics().counters;
        self.flushes += counters.flushes;
        self.deltas += counters.delta_flushes;
        self.cell_loads += counters.cell_loads;
        self.blobs_searched += counters.disk_lookup_blobs;
        let engine = if clean {
            self.engine.close().unwrap();
            open(&self.storage, &self.config).unwrap()
        } else {
            // As after kill -9: every write is in the page cache.
            let placeholder = open(&FaultStorage::default(), &self.config).unwrap();
            drop(std::mem::replace(&mut self.engine, placeholder));
            self.storage = self.storage.restart_process();
            open(&self.storage, &self.config).unwrap()
        };
        self.engine = engine;
        self.verify_all();
    }

    fn verify_all(&mut self) {
        let seed = self.seed;
        for (k, v) in &self.model {
            let got = self.engine.get(self.spaces[k.0], &k.1).unwrap();
            assert_eq!(
                got.as_deref(),
                Some(v.as_slice()),
                "seed {seed}: verify {k:?}"
            );
        }
        for i in 400..420 {
            assert!(
                self.engine.get(self.spaces[0], &key(i)).unwrap().is_none(),
                "seed {seed}: phantom key"
            );
        }
    }
}

#[test]
fn engine_matches_a_btreemap_model() {
    let seed = tidepool_testkit::seed_from_env("MODEL_SEED");
    let ops: u32 = std::env::var("MODEL_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_000);
    let (storage, mut config) = fault_storage();
    // Small memory budgets so cells load, unload and use disk lookups.
    config.index_memory_bytes = 48 << 10;
    config.value_cache_bytes = 32 << 10;
    let engine = open(&storage, &config).unwrap();
    let spaces = [
        engine.key_space("default").unwrap(),
        engine.key_space("prefixed").unwrap(),
    ];
    let mut harness = Harness {
        rng: SmallRng::seed_from_u64(seed),
        storage,
        config,
        engine,
        spaces,
        model: BTreeMap::new(),
        meta: BTreeMap::new(),
        epoch: 1,
        version: 0,
        seed,
        flushes: 0,
        deltas: 0,
        cell_loads: 0,
        blobs_searched: 0,
    };
    for _ in 0..ops {
        let op = harness.rng.random_range(0..110);
        harness.step(op);
    }
    // Some seeds need more operations before every path has run (a run
    // whose lookups all found their cells loaded searched no blob on
    // disk): go on, in steps, up to five times as many.
    let mut extra = 0;
    while !harness.covers_every_path() && extra < 4 * ops {
        for _ in 0..1_000 {
            let op = harness.rng.random_range(0..110);
            harness.step(op);
        }
        extra += 1_000;
    }
    harness.verify_all();
    let (flushes, deltas, loads, blobs) = harness.coverage();
    println!(
        "seed {seed}: {} operations, {} keys, {flushes} flushes ({deltas} wrote deltas), {loads} cell loads, {blobs} blobs searched by disk lookups",
        ops + extra,
        harness.model.len()
    );
    assert!(
        flushes > deltas && deltas > 0 && loads > 0 && blobs > 0,
        "seed {seed}: the run must exercise merges, deltas, loading and disk lookups"
    );
    harness.engine.close().unwrap();
}
