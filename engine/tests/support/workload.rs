//! A deterministic single-writer workload and the prefix check used by the
//! crash tests: after a crash, the store must equal the model after some
//! prefix of the workload.

use std::collections::BTreeMap;

use rand::Rng;
use rand::rngs::SmallRng;
use tidepool_engine::{Durability, Engine, WriteBatch};

use super::{key, value};

/// Keys the workload touches.
pub const KEYS: u64 = 24;

/// One workload step.
#[derive(Clone, Debug)]
pub enum Op {
    Put(u64, Vec<u8>),
    Delete(u64),
    Batch(Vec<(u64, Option<Vec<u8>>)>),
}

/// Key number to value.
pub type Model = BTreeMap<u64, Vec<u8>>;

/// `len` random steps, each with a durability.
pub fn workload(rng: &mut SmallRng, len: usize) -> Vec<(Op, Durability)> {
    (0..len as u64)
        .map(|version| {
            let op = match rng.random_range(0..10) {
                0..=5 => {
                    let k = rng.random_range(0..KEYS);
                    Op::Put(k, value(k, version, rng.random_range(10..3_000)))
                }
                6 | 7 => Op::Delete(rng.random_range(0..KEYS)),
                _ => Op::Batch(
                    (0..rng.random_range(2..6))
                        .map(|_| {
                            let k = rng.random_range(0..KEYS);
                            let v = rng
                                .random_bool(0.8)
                                .then(|| value(k, version, rng.random_range(10..2_000)));
                            (k, v)
                        })
                        .collect(),
                ),
            };
            let durability = if rng.random_bool(0.3) {
                Durability::Synced
            } else {
                Durability::Buffered
            };
            (op, durability)
        })
        .collect()
}

/// Applies a step to the model.
pub fn apply_model(model: &mut Model, op: &Op) {
    match op {
        Op::Put(k, v) => {
            model.insert(*k, v.clone());
        }
        Op::Delete(k) => {
            model.remove(k);
        }
        Op::Batch(ops) => {
            for (k, v) in ops {
                match v {
                    Some(v) => model.insert(*k, v.clone()),
                    None => model.remove(k),
                };
            }
        }
    }
}

/// Runs a step against the engine's "default" key space.
pub fn run(engine: &Engine, op: &Op, durability: Durability) -> tidepool_engine::Result<()> {
    let ks = engine.key_space("default")?;
    match op {
        Op::Put(k, v) => engine.put(ks, &key(*k), v, durability).map(drop),
        Op::Delete(k) => engine.delete(ks, &key(*k), durability).map(drop),
        Op::Batch(ops) => {
            let mut batch = WriteBatch::new();
            for (k, v) in ops {
                match v {
                    Some(v) => batch.put(ks, &key(*k), v),
                    None => batch.delete(ks, &key(*k)),
                };
            }
            engine.write_batch(&batch, durability).map(drop)
        }
    }
}

/// Reads the whole key universe; any error (corruption) fails the test.
pub fn read_state(engine: &Engine, context: &str) -> Model {
    let ks = engine.key_space("default").unwrap();
    (0..KEYS)
        .filter_map(|k| {
            let got = engine
                .get(ks, &key(k))
                .unwrap_or_else(|e| panic!("{context}: get {k}: {e}"));
            got.map(|v| (k, v.to_vec()))
        })
        .collect()
}

/// Checks that `state` is the model after some prefix of `ops` whose
/// length is in `[min, max]`.
pub fn assert_prefix(
    ops: &[(Op, Durability)],
    state: &Model,
    min: usize,
    max: usize,
    context: &str,
) {
    let mut model = Model::new();
    for (i, (op, _)) in ops.iter().enumerate().take(max) {
        if i >= min && model == *state {
            return;
        }
        apply_model(&mut model, op);
    }
    if max >= min && model == *state {
        return;
    }
    let describe = |m: &Model, k: u64| {
        m.get(&k)
            .map(|v| String::from_utf8_lossy(&v[..v.len().min(12)]).into_owned())
    };
    let mut details = Vec::new();
    for n in min..=max {
        let mut expected = Model::new();
        for (op, _) in &ops[..n] {
            apply_model(&mut expected, op);
        }
        let diff: Vec<String> = (0..KEYS)
            .filter(|k| expected.get(k) != state.get(k))
            .map(|k| {
                format!(
                    "key {k}: expected {:?}, got {:?}",
                    describe(&expected, k),
                    describe(state, k)
                )
            })
            .collect();
        details.push(format!("prefix {n}: {diff:?}"));
    }
    let ops_text: Vec<String> = ops[min.saturating_sub(3)..max.min(ops.len())]
        .iter()
        .enumerate()
        .map(|(i, (op, d))| {
            let text = match op {
                Op::Put(k, _) => format!("put {k}"),
                Op::Delete(k) => format!("delete {k}"),
                Op::Batch(b) => format!(
                    "batch {:?}",
                    b.iter().map(|(k, v)| (k, v.is_some())).collect::<Vec<_>>()
                ),
            };
            format!("#{} {text} {d:?}", i + min.saturating_sub(3))
        })
        .collect();
    let details = format!("{details:#?}\nops: {ops_text:#?}");
    panic!(
        "{context}: {details}; recovered state is no prefix of the workload of length in [{min}, {max}]: keys {:?}",
        state.keys().collect::<Vec<_>>()
    );
}
