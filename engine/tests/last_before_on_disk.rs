//! "Largest key smaller than" on cells that stay on disk: each answer comes
//! from one window of the cell's base blob merged with its deltas and
//! unflushed changes — including deletes that hide whole runs of the
//! window, which send the search to the whole cell — and must equal a
//! `BTreeMap`'s answer, before the deletes are flushed and after (most
//! cells then have them in a delta blob, some merged a new base), and
//! again after two more rounds of deletes and puts go out as further
//! deltas, each searched through its own window.

mod support;

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{fault_storage, open, value};
use tidepool_engine::Durability;

#[test]
fn last_before_on_disk_cells_with_unflushed_deletes_matches_a_model() {
    let seed = tidepool_testkit::seed_from_env("LAST_BEFORE_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let (storage, mut config) = fault_storage();
    config.index_memory_bytes = 1; // no cell is ever loaded whole
    config.lookup_window_entries = 8; // small windows: runs of deletes cover them
    config.flush_dirty_entries = 1 << 20; // the deletes stay unflushed changes
    config.max_replay_bytes = 1 << 40;
    config.relocation_enabled = false;
    config.index_max_deltas = 8;
    config.index_merge_ratio = 4; // deltas pile up over the base
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut model = BTreeMap::new();
    for i in 0..3_000u64 {
        let key: [u8; 32] = rng.random();
        engine
            .put(ks, &key, &value(i, 1, 20), Durability::Buffered)
            .unwrap();
        model.insert(key, value(i, 1, 20));
    }
    engine.close().unwrap();
    drop(engine);
    // Reopened: every cell's index is on disk, none in memory.
    let engine = open(&storage, &config).unwrap();
    let sorted: Vec<[u8; 32]> = model.keys().copied().collect();
    let mut delete_runs_and_put = |round: u64, model: &mut BTreeMap<[u8; 32], Vec<u8>>| {
        let live: Vec<[u8; 32]> = model.keys().copied().collect();
        for _ in 0..60 {
            let start = rng.random_range(0..live.len());
            let run = rng.random_range(1..40);
            for key in live.iter().skip(start).take(run) {
                engine.delete(ks, key, Durability::Buffered).unwrap();
                model.remove(key);
            }
        }
        for i in 0..200u64 {
            let key: [u8; 32] = rng.random();
            let v = value(10_000 * round + i, 1, 20);
            engine.put(ks, &key, &v, Durability::Buffered).unwrap();
            model.insert(key, v);
        }
    };
    delete_runs_and_put(1, &mut model);
    let mut probe_rng = SmallRng::seed_from_u64(seed.wrapping_add(1));
    let mut probes: Vec<[u8; 32]> = (0..2_000).map(|_| probe_rng.random()).collect();
    probes.extend(sorted.iter().step_by(3).copied());
    probes.push([0u8; 32]);
    probes.push([0xFF; 32]);
    let check = |when: &str, model: &BTreeMap<[u8; 32], Vec<u8>>| {
        for probe in &probes {
            let expected = model
                .range(..*probe)
                .next_back()
                .map(|(k, v)| (k.to_vec(), v.clone()));
            let got = engine
                .last_before(ks, probe)
                .unwrap()
                .map(|(k, v)| (k, v.to_vec()));
            assert_eq!(
                got, expected,
                "seed {seed}, {when}: last_before({probe:02x?})"
            );
        }
    };
    check("deletes unflushed", &model);
    engine.flush().unwrap();
    assert!(
        engine.metrics().counters.delta_flushes > 0,
        "seed {seed}: some deletes went out as deltas"
    );
    check("deletes in deltas", &model);
    for round in 2..4 {
        delete_runs_and_put(round, &mut model);
        engine.flush().unwrap();
        check(&format!("round {round} in deltas"), &model);
    }
    let metrics = engine.metrics().counters;
    println!(
        "seed {seed}: {} probes over {} keys, {} cell loads",
        probes.len(),
        model.len(),
        metrics.cell_loads
    );
    engine.close().unwrap();
}
