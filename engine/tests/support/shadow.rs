//! A shadow model for concurrency tests: each key is owned by one writer,
//! which numbers its versions and records when each starts and is
//! acknowledged; readers check every value they see against that.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_engine::{Durability, Engine};

use super::{key, value, version_of};

/// Per key, the last acknowledged and the last started version.
pub struct Shadow {
    acked: Vec<AtomicU64>,
    started: Vec<AtomicU64>,
    /// Every `delete_every`-th version of a key is a delete.
    delete_every: u64,
}

impl Shadow {
    /// A model of `keys` keys, nothing written yet.
    pub fn new(keys: u64, delete_every: u64) -> Self {
        Self {
            acked: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            started: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            delete_every,
        }
    }

    fn keys(&self) -> u64 {
        self.acked.len() as u64
    }

    fn is_delete(&self, version: u64) -> bool {
        version > 0 && version.is_multiple_of(self.delete_every)
    }

    /// Writer `id` of `writers`: `ops` puts and deletes of its own keys,
    /// a fraction `synced` of them `Synced`.
    pub fn write(&self, engine: &Engine, id: u64, writers: u64, ops: u64, synced: f64, seed: u64) {
        let ks = engine.key_space("default").unwrap();
        let mut rng = SmallRng::seed_from_u64(seed ^ (id + 1));
        let mine: Vec<u64> = (0..self.keys()).filter(|k| k % writers == id).collect();
        for _ in 0..ops {
            let k = mine[rng.random_range(0..mine.len())];
            let version = self.started[k as usize].load(Ordering::SeqCst) + 1;
            self.started[k as usize].store(version, Ordering::SeqCst);
            let durability = if rng.random_bool(synced) {
                Durability::Synced
            } else {
                Durability::Buffered
            };
            if self.is_delete(version) {
                engine.delete(ks, &key(k), durability).unwrap();
            } else {
                let v = value(k, version, rng.random_range(1..1_500));
                engine.put(ks, &key(k), &v, durability).unwrap();
            }
            self.acked[k as usize].store(version, Ordering::SeqCst);
        }
    }

    /// Reads random keys until `stop`, checking that no read is older than
    /// what was acknowledged before it started or newer than anything
    /// started, and that a key is absent only if a delete explains it.
    /// Returns the number of reads.
    pub fn read_until(&self, engine: &Engine, stop: &AtomicBool, seed: u64) -> u64 {
        let ks = engine.key_space("default").unwrap();
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut reads = 0;
        while !stop.load(Ordering::SeqCst) {
            let k = rng.random_range(0..self.keys());
            let acked = self.acked[k as usize].load(Ordering::SeqCst);
            let got = engine.get(ks, &key(k)).unwrap();
            let started = self.started[k as usize].load(Ordering::SeqCst);
            match got {
                Some(v) => {
                    let version = version_of(&v);
                    assert!(
                        !self.is_delete(version),
                        "seed {seed}: key {k} read a delete's version"
                    );
                    assert!(
                        version >= acked && version <= started,
                        "seed {seed}: key {k} read version {version}; acknowledged {acked}, started {started}"
                    );
                    assert_eq!(
                        v,
                        value(k, version, v.len()),
                        "seed {seed}: key {k} value damaged"
                    );
                }
                None => assert!(
                    acked == 0 || (acked..=started).any(|v| self.is_delete(v)),
                    "seed {seed}: key {k} absent; acknowledged {acked}, started {started}"
                ),
            }
            reads += 1;
        }
        reads
    }

    /// After the writers finished: every key holds its last acknowledged
    /// version (or is absent if that was a delete).
    pub fn check_final(&self, engine: &Engine, context: &str) {
        let ks = engine.key_space("default").unwrap();
        for k in 0..self.keys() {
            let last = self.acked[k as usize].load(Ordering::SeqCst);
            let got = engine.get(ks, &key(k)).unwrap().map(|v| version_of(&v));
            let expected = (last > 0 && !self.is_delete(last)).then_some(last);
            assert_eq!(got, expected, "{context}: key {k} lost its last update");
        }
    }
}
