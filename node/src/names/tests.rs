//! The name index against a `BTreeMap` model: random inserts, removals,
//! dead leaves and reopens, then walks with prefixes, start points and
//! page sizes.

use std::collections::BTreeMap;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tidepool_engine::{CellLayout, Config, Durability, Engine, Epoch, KeySpaceConfig};

use super::*;

fn config(dir: &std::path::Path) -> Config {
    let mut config = Config::for_tests(dir);
    config.wal_segment_bytes = 256 << 10;
    config.max_value_bytes = 64 << 10;
    config.key_spaces = vec![
        KeySpaceConfig {
            name: "blobs".into(),
            key_bytes: 32,
            layout: CellLayout::Uniform { cells: 16 },
        },
        KeySpaceConfig {
            name: NAMES_KEY_SPACE.into(),
            key_bytes: NAME_KEY_BYTES as u32,
            layout: CellLayout::Uniform { cells: 16 },
        },
    ];
    config
}

fn meta(seed: u64) -> Meta {
    Meta {
        kind: 0,
        size: seed,
        sha256: [seed as u8; 32],
    }
}

/// Names from a tiny alphabet, so they share prefixes and burst often;
/// some long ones share 40 bytes.
fn random_name(rng: &mut StdRng) -> Vec<u8> {
    let mut name = Vec::new();
    if rng.random_bool(0.2) {
        name.extend_from_slice(b"backups/2026-11-27/host-number-one/dir/");
    }
    let len = rng.random_range(if name.is_empty() { 1 } else { 0 }..6);
    for _ in 0..len {
        name.push(*b"ab\0\xffc/".get(rng.random_range(0..6)).unwrap());
    }
    if name.is_empty() {
        name.push(b'a');
    }
    name
}

struct Model {
    /// namespace -> name -> meta size
    names: BTreeMap<u32, BTreeMap<Vec<u8>, u64>>,
}

fn all(engine: &Engine, space: KeySpace, namespace: u32) -> Vec<(Vec<u8>, u64)> {
    let mut seen = Vec::new();
    let walked = walk(engine, space, namespace, &[], None, |name, meta| {
        seen.push((name.to_vec(), meta.size));
        Ok(Step::Continue)
    })
    .unwrap();
    assert_eq!(walked, Walked::Done);
    seen
}

fn check(engine: &Engine, space: KeySpace, model: &Model, rng: &mut StdRng, seed: u64) {
    for namespace in [1u32, 2] {
        let expected: Vec<(Vec<u8>, u64)> = model
            .names
            .get(&namespace)
            .map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default();
        assert_eq!(all(engine, space, namespace), expected, "seed {seed}");
        // Pages of random sizes with random prefixes resume exactly.
        for _ in 0..3 {
            let prefix = if rng.random_bool(0.5) {
                Vec::new()
            } else {
                let mut p = random_name(rng);
                p.truncate(rng.random_range(0..=p.len()));
                p
            };
            let start = rng.random_bool(0.5).then(|| random_name(rng));
            let page = rng.random_range(1..5);
            let want: Vec<Vec<u8>> = expected
                .iter()
                .map(|(k, _)| k.clone())
                .filter(|k| k.starts_with(&prefix) && start.as_ref().is_none_or(|s| k > s))
                .collect();
            let mut got = Vec::new();
            let mut after = start.clone();
            loop {
                let mut n = 0;
                let walked = walk(
                    engine,
                    space,
                    namespace,
                    &prefix,
                    after.as_deref(),
                    |name, _| {
                        got.push(name.to_vec());
                        n += 1;
                        Ok(if n == page {
                            Step::Stop
                        } else {
                            Step::Continue
                        })
                    },
                )
                .unwrap();
                match walked {
                    Walked::Done => break,
                    Walked::StoppedAfter(name) => after = Some(name),
                }
            }
            assert_eq!(
                got, want,
                "seed {seed}: prefix {prefix:?}, after {start:?}, pages of {page}"
            );
        }
    }
}

#[test]
fn the_index_matches_a_model_through_inserts_removals_and_reopens() {
    let seed: u64 = std::env::var("TIDEPOOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TIDEPOOL_SEED reruns it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut engine = Engine::open(config(dir.path())).unwrap();
    let mut model = Model {
        names: BTreeMap::new(),
    };
    for round in 0..40 {
        let space = engine.key_space(NAMES_KEY_SPACE).unwrap();
        // One "entry": a few changes in one batch.
        for _ in 0..20 {
            let mut batch = NameBatch::new(&engine, space);
            for _ in 0..rng.random_range(1..6) {
                let namespace = rng.random_range(1..3);
                let name = random_name(&mut rng);
                let names = model.names.entry(namespace).or_default();
                if rng.random_bool(0.65) {
                    let size = rng.random_range(0..1000);
                    batch.insert(namespace, &name, &meta(size)).unwrap();
                    names.insert(name, size);
                } else {
                    let removed = batch.remove(namespace, &name).unwrap();
                    assert_eq!(removed, names.remove(&name).is_some(), "seed {seed}");
                }
            }
            batch.commit(Durability::Buffered).unwrap();
        }
        check(&engine, space, &model, &mut rng, seed);
        if round % 10 == 9 {
            engine.close().unwrap();
            drop(engine);
            engine = Engine::open(config(dir.path())).unwrap();
        }
    }
    // Removing every name leaves no index entry behind.
    let space = engine.key_space(NAMES_KEY_SPACE).unwrap();
    for (namespace, names) in std::mem::take(&mut model.names) {
        for name in names.keys() {
            let mut batch = NameBatch::new(&engine, space);
            assert!(batch.remove(namespace, name).unwrap());
            batch.commit(Durability::Buffered).unwrap();
        }
    }
    let left = engine
        .scan(
            space,
            Bound::Unbounded,
            Bound::Unbounded,
            tidepool_engine::Direction::Forward,
        )
        .unwrap()
        .count();
    assert_eq!(left, 0, "seed {seed}: nodes left after removing every name");
}

#[test]
fn pages_skip_dead_leaves_and_a_sweep_removes_them() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let (names, blobs) = (
        engine.key_space(NAMES_KEY_SPACE).unwrap(),
        engine.key_space("blobs").unwrap(),
    );
    assert!(check_complete(&engine, names, blobs).unwrap());
    let mut batch = NameBatch::new(&engine, names);
    for i in 0..100u32 {
        let name = format!("key-{i:03}");
        batch
            .insert(7, name.as_bytes(), &meta(u64::from(i)))
            .unwrap();
        // Every third blob exists.
        if i % 3 == 0 {
            let key = tidepool_proto::storage_key(7, name.as_bytes());
            engine.put(blobs, &key, b"x", Durability::Buffered).unwrap();
        }
    }
    batch.commit(Durability::Buffered).unwrap();
    let limits = PageLimits {
        entries: 10,
        name_bytes: 1 << 20,
        examined: 1000,
        entered: 1000,
        owned: None,
    };
    let page = list_page(&engine, names, blobs, 7, b"", None, limits).unwrap();
    let listed: Vec<_> = page.entries.iter().map(|e| e.name.clone()).collect();
    let want: Vec<_> = (0..30)
        .step_by(3)
        .map(|i| format!("key-{i:03}").into_bytes())
        .collect();
    assert_eq!(listed, want);
    assert!(!page.done);
    assert_eq!(page.resume_after, b"key-027");
    assert_eq!(page.entries[1].meta.size, 3);
    assert_eq!(page.entries[1].epoch, engine.epoch().0);
    // A group lists only the names whose blobs are in its range (after a
    // split, the other group's names stay until shed).
    let everything = PageLimits {
        entries: 1000,
        ..limits
    };
    let lower_half = PageLimits {
        owned: Some((0, u64::MAX / 2)),
        ..everything
    };
    let names_of =
        |page: Page| -> Vec<Vec<u8>> { page.entries.into_iter().map(|e| e.name).collect() };
    let all_live = names_of(list_page(&engine, names, blobs, 7, b"", None, everything).unwrap());
    let owned = names_of(list_page(&engine, names, blobs, 7, b"", None, lower_half).unwrap());
    let in_lower_half = |name: &Vec<u8>| {
        tidepool_proto::hash_position(&tidepool_proto::storage_key(7, name)) <= u64::MAX / 2
    };
    let want: Vec<_> = all_live
        .iter()
        .filter(|n| in_lower_half(n))
        .cloned()
        .collect();
    assert_eq!(owned, want);
    assert!(
        !owned.is_empty() && owned.len() < all_live.len(),
        "{} of {}",
        owned.len(),
        all_live.len()
    );
    // A page bounded by examined leaves stops early but resumes right.
    let small = PageLimits {
        examined: 2,
        ..limits
    };
    let page = list_page(&engine, names, blobs, 7, b"key-0", Some(b"key-003"), small).unwrap();
    assert!(page.entries.is_empty());
    assert_eq!(page.resume_after, b"key-005");
    let dropped = Swept {
        below: 1,
        ..Swept::NEVER
    };
    assert_eq!(sweep_all(&engine, names, blobs, 7, dropped), 66);
    let left = all(&engine, names, 7);
    assert_eq!(left.len(), 34);
    let _ = Epoch(0);
}

#[test]
fn an_engine_with_blobs_before_the_index_is_marked_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let (names, blobs) = (
        engine.key_space(NAMES_KEY_SPACE).unwrap(),
        engine.key_space("blobs").unwrap(),
    );
    assert!(is_complete(&engine, names).unwrap());
    engine
        .put(blobs, &[1; 32], b"old", Durability::Buffered)
        .unwrap();
    assert!(!check_complete(&engine, names, blobs).unwrap());
    assert!(!is_complete(&engine, names).unwrap());
    // Decided once: later checks keep the answer.
    assert!(!check_complete(&engine, names, blobs).unwrap());
}

fn far() -> Instant {
    Instant::now() + std::time::Duration::from_secs(3600)
}

/// Sweeps `namespace` to `want` in one go; returns how many it removed.
fn sweep_all(
    engine: &Engine,
    names: KeySpace,
    blobs: KeySpace,
    namespace: u32,
    want: Swept,
) -> u64 {
    let (mut after, mut removed) = (None::<Vec<u8>>, 0);
    loop {
        let step = sweep_step(
            engine,
            names,
            blobs,
            namespace,
            want,
            after.as_deref(),
            (100, far()),
        )
        .unwrap();
        removed += step.removed;
        match step.walked {
            Walked::Done => return removed,
            Walked::StoppedAfter(name) => after = Some(name),
        }
    }
}

/// Sweeping in small steps leaves exactly the names inside the range whose
/// blobs exist, of that namespace only, records what it swept to once the
/// walk ends, and a walk begun again finds nothing more to remove.
#[test]
fn sweeping_keeps_exactly_the_live_names_inside_the_range() {
    let seed: u64 = std::env::var("TIDEPOOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TIDEPOOL_SEED reruns it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let (names, blobs) = (
        engine.key_space(NAMES_KEY_SPACE).unwrap(),
        engine.key_space("blobs").unwrap(),
    );
    let mut model = Model {
        names: BTreeMap::new(),
    };
    // One name in eight has no blob (as if dropped with its epoch).
    let mut dead = std::collections::BTreeSet::new();
    let mut batch = NameBatch::new(&engine, names);
    for i in 0..600u64 {
        let namespace = 1 + (i % 2) as u32;
        let name = random_name(&mut rng);
        batch.insert(namespace, &name, &meta(i)).unwrap();
        model
            .names
            .entry(namespace)
            .or_default()
            .insert(name.clone(), i);
        let key = tidepool_proto::storage_key(namespace, &name);
        if rng.random_bool(0.125) {
            engine.delete(blobs, &key, Durability::Buffered).unwrap();
            dead.insert((namespace, name));
        } else {
            engine.put(blobs, &key, b"x", Durability::Buffered).unwrap();
            dead.remove(&(namespace, name));
        }
    }
    batch.commit(Durability::Buffered).unwrap();
    let want = Swept {
        range: (u64::MAX / 3, u64::MAX / 3 * 2),
        below: 3,
    };
    let kept = |name: &[u8]| {
        let position = tidepool_proto::hash_position(&tidepool_proto::storage_key(1, name));
        want.range.0 <= position && position <= want.range.1 && !dead.contains(&(1, name.to_vec()))
    };
    assert_eq!(swept(&engine, names, 1).unwrap(), Swept::NEVER);
    let (mut after, mut removed, mut steps) = (None::<Vec<u8>>, 0, 0);
    loop {
        // The first step's time is up at once: it examines one leaf.
        let until = if steps == 0 { Instant::now() } else { far() };
        let step =
            sweep_step(&engine, names, blobs, 1, want, after.as_deref(), (7, until)).unwrap();
        if steps == 0 {
            assert!(step.removed <= 1, "seed {seed}");
            assert!(
                matches!(&step.walked, Walked::StoppedAfter(name) if Some(name) == model.names[&1].keys().next()),
                "seed {seed}"
            );
        }
        removed += step.removed;
        steps += 1;
        match step.walked {
            Walked::Done => break,
            Walked::StoppedAfter(name) => {
                // Not recorded before the walk ends.
                assert_eq!(swept(&engine, names, 1).unwrap(), Swept::NEVER);
                after = Some(name);
            }
        }
    }
    let before = model.names[&1].clone();
    model
        .names
        .get_mut(&1)
        .unwrap()
        .retain(|name, _| kept(name));
    assert!(steps > 10, "{steps} steps, seed {seed}");
    assert_eq!(
        removed as usize,
        before.len() - model.names[&1].len(),
        "seed {seed}"
    );
    assert!(!model.names[&1].is_empty() && removed > 0, "seed {seed}");
    assert!(
        before
            .keys()
            .any(|n| dead.contains(&(1, n.clone())) && !kept(n)),
        "seed {seed}: no dead name inside the range"
    );
    assert_eq!(swept(&engine, names, 1).unwrap(), want);
    assert_eq!(swept(&engine, names, 2).unwrap(), Swept::NEVER);
    check(&engine, names, &model, &mut rng, seed);
    // What covers what: the same range and a drop at or below the record's.
    assert!(want.covers(&Swept { below: 2, ..want }));
    assert!(!want.covers(&Swept { below: 4, ..want }));
    assert!(!want.covers(&Swept::NEVER));
    // Again: nothing left to remove; and the record survives a reopen.
    assert_eq!(sweep_all(&engine, names, blobs, 1, want), 0);
    engine.close().unwrap();
    drop(engine);
    let engine = Engine::open(config(dir.path())).unwrap();
    assert_eq!(swept(&engine, names, 1).unwrap(), want);
    check(&engine, names, &model, &mut rng, seed);
}

/// A sweep that removes every name leaves no node behind: the key space
/// holds only the sweep's record (removals delete emptied nodes upward).
#[test]
fn sweeping_every_name_out_leaves_no_node_behind() {
    let seed: u64 = std::env::var("TIDEPOOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TIDEPOOL_SEED reruns it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let (names, blobs) = (
        engine.key_space(NAMES_KEY_SPACE).unwrap(),
        engine.key_space("blobs").unwrap(),
    );
    let mut batch = NameBatch::new(&engine, names);
    for i in 0..400u64 {
        let name = random_name(&mut rng);
        batch.insert(3, &name, &meta(i)).unwrap();
        let key = tidepool_proto::storage_key(3, &name);
        engine.put(blobs, &key, b"x", Durability::Buffered).unwrap();
    }
    batch.commit(Durability::Buffered).unwrap();
    let nowhere = Swept {
        range: (0, 0),
        below: 0,
    };
    assert!(
        sweep_all(&engine, names, blobs, 3, nowhere) > 100,
        "seed {seed}"
    );
    assert!(all(&engine, names, 3).is_empty(), "seed {seed}");
    let mut keys = engine
        .scan(
            names,
            Bound::Unbounded,
            Bound::Unbounded,
            tidepool_engine::Direction::Forward,
        )
        .unwrap();
    let mut left = 0;
    while let Some(key) = keys.next_key() {
        key.unwrap();
        left += 1;
    }
    assert_eq!(left, 1, "seed {seed}: only the sweep's record is left");
    assert_eq!(swept(&engine, names, 3).unwrap(), nowhere);
}

/// The engine makes a batch's writes visible one at a time, and a listing
/// walks without a lock: at every point of a batch's writes in the order
/// they are committed, every name present before it and kept by it is
/// found by a walk. Before, the items went in key order: a link could turn
/// interior before the leaf moved below it was there, and a walk skipped a
/// name that existed all along (a restic prune through the gateway takes a
/// listing as whole).
#[test]
fn a_walk_between_a_batchs_writes_sees_every_name_kept() {
    let seed: u64 = std::env::var("TIDEPOOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TIDEPOOL_SEED reruns it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let space = engine.key_space(NAMES_KEY_SPACE).unwrap();
    let mut present: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
    for _ in 0..300 {
        let mut batch = NameBatch::new(&engine, space);
        let mut removed = Vec::new();
        let mut added = Vec::new();
        let mut after = present.clone();
        for _ in 0..rng.random_range(1..4) {
            let name = random_name(&mut rng);
            if rng.random_bool(0.75) {
                let size = rng.random_range(0..1000);
                batch.insert(1, &name, &meta(size)).unwrap();
                after.insert(name.clone(), size);
                added.push((name, size));
            } else if batch.remove(1, &name).unwrap() {
                after.remove(&name);
                removed.push(name);
            }
        }
        // Names present before the batch and not touched by it.
        let kept: Vec<Vec<u8>> = present
            .keys()
            .filter(|n| !removed.contains(n) && !added.iter().any(|(a, _)| a == *n))
            .cloned()
            .collect();
        let items: Vec<(NameKey, Option<Vec<u8>>)> = batch
            .ordered()
            .into_iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        drop(batch);
        for (at, (key, value)) in items.iter().enumerate() {
            let mut one = WriteBatch::new();
            match value {
                Some(value) => one.put_tagged(space, key, value, NAMES_TAG),
                None => one.delete(space, key),
            };
            engine.write_batch(&one, Durability::Buffered).unwrap();
            let seen: Vec<Vec<u8>> = all(&engine, space, 1).into_iter().map(|(n, _)| n).collect();
            for name in &kept {
                assert!(
                    seen.contains(name),
                    "seed {seed}: {name:?} not found after write {at} of {}",
                    items.len()
                );
            }
        }
        present = after;
        let seen: BTreeMap<Vec<u8>, u64> = all(&engine, space, 1).into_iter().collect();
        assert_eq!(seen, present, "seed {seed}");
    }
}

/// Names sharing hundreds of bytes hang under chains of nodes (a pair
/// whose other name was deleted leaves its chain): a page stops once it
/// entered as many nodes as it may, at the next leaf, and
/// pages still resume to list every name. Before, one page entered every
/// node of every chain (here 12,000 engine scans for a page of 40 names).
#[test]
fn a_page_through_long_chains_of_nodes_is_bounded_by_the_nodes_it_enters() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let (names, blobs) = (
        engine.key_space(NAMES_KEY_SPACE).unwrap(),
        engine.key_space("blobs").unwrap(),
    );
    let chained = |i: u32, last: u8| {
        let mut name = format!("{i:02}").into_bytes();
        name.extend(std::iter::repeat_n(b'z', 300));
        name.push(last);
        name
    };
    for i in 0..40u32 {
        let mut batch = NameBatch::new(&engine, names);
        for last in [b'a', b'b'] {
            batch.insert(7, &chained(i, last), &meta(1)).unwrap();
        }
        batch.commit(Durability::Buffered).unwrap();
        let mut batch = NameBatch::new(&engine, names);
        assert!(batch.remove(7, &chained(i, b'b')).unwrap());
        batch.commit(Durability::Buffered).unwrap();
        let key = tidepool_proto::storage_key(7, &chained(i, b'a'));
        engine.put(blobs, &key, b"x", Durability::Buffered).unwrap();
    }
    let limits = PageLimits {
        entries: 1000,
        name_bytes: 1 << 20,
        examined: 1000,
        entered: 1000,
        owned: None,
    };
    let mut listed = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    let mut pages = 0;
    loop {
        let page = list_page(&engine, names, blobs, 7, b"", after.as_deref(), limits).unwrap();
        pages += 1;
        // About 300 nodes a name: at most 1,000 entered, then the chain
        // to the next leaf.
        assert!(
            page.entries.len() <= 5,
            "{} names in a page",
            page.entries.len()
        );
        listed.extend(page.entries.into_iter().map(|e| e.name));
        if page.done {
            break;
        }
        after = Some(page.resume_after);
    }
    let want: Vec<_> = (0..40).map(|i| chained(i, b'a')).collect();
    assert_eq!(listed, want);
    assert!(pages >= 8, "{pages} pages");
}

/// One batch whose index writes outnumber what one engine record holds
/// (65,535 items): 70 names of 1,000-byte shared runs, each put beside an
/// existing one, burst a level per shared byte — about 70,000 writes. The
/// batch is written as several records, in order, and every name is
/// listed, after a reopen too; removing them all (as many writes again)
/// leaves nothing. Before, the commit failed `TooLarge`: applied from a
/// committed Raft entry, on every replica, at every restart.
#[test]
fn a_batch_past_one_records_items_is_written_whole() {
    // Split by items (16 MiB segments), and by bytes (the tests' 256 KiB).
    for wal_segment_bytes in [16 << 20, 256 << 10] {
        a_batch_past_one_record_is_written_whole(wal_segment_bytes);
    }
}

fn a_batch_past_one_record_is_written_whole(wal_segment_bytes: u64) {
    let dir = tempfile::tempdir().unwrap();
    let config = || {
        let mut config = config(dir.path());
        config.wal_segment_bytes = wal_segment_bytes;
        // The node's sizes, not the tests' tiny ones (a cell of 70,000
        // index nodes flushed every 16 writes took minutes).
        config.index_segment_bytes = 8 << 20;
        config.flush_dirty_entries = 4_096;
        config.snapshot_interval_ms = 5_000;
        config.key_spaces[1].layout = CellLayout::Uniform { cells: 1_024 };
        config
    };
    let mut engine = Engine::open(config()).unwrap();
    let space = engine.key_space(NAMES_KEY_SPACE).unwrap();
    let run = vec![b'x'; 1_000];
    let name = |i: usize, last: u8| {
        let mut name = format!("{i:03}").into_bytes();
        name.extend_from_slice(&run);
        name.push(last);
        name
    };
    let mut expected = BTreeMap::new();
    let mut batch = NameBatch::new(&engine, space);
    for i in 0..70 {
        batch.insert(1, &name(i, b'a'), &meta(1)).unwrap();
        expected.insert(name(i, b'a'), 1);
    }
    batch.commit(Durability::Buffered).unwrap();
    let mut batch = NameBatch::new(&engine, space);
    for i in 0..70 {
        batch.insert(1, &name(i, b'b'), &meta(2)).unwrap();
        expected.insert(name(i, b'b'), 2);
    }
    assert!(
        batch.overlay.len() > Engine::MAX_RECORD_ITEMS,
        "{} writes",
        batch.overlay.len()
    );
    batch.commit(Durability::Buffered).unwrap();
    let expected: Vec<(Vec<u8>, u64)> = expected.into_iter().collect();
    assert_eq!(all(&engine, space, 1), expected);
    engine.close().unwrap();
    drop(engine);
    engine = Engine::open(config()).unwrap();
    assert_eq!(all(&engine, space, 1), expected);
    let mut batch = NameBatch::new(&engine, space);
    for (name, _) in &expected {
        assert!(batch.remove(1, name).unwrap());
    }
    batch.commit(Durability::Buffered).unwrap();
    let left = engine
        .scan(
            space,
            Bound::Unbounded,
            Bound::Unbounded,
            tidepool_engine::Direction::Forward,
        )
        .unwrap()
        .count();
    assert_eq!(left, 0, "nodes left after removing every name");
}

/// A crash between the records of one batch keeps a prefix of its writes
/// (in `ordered` order); the entry is then applied again over what was
/// kept. Randomized over the cut: every name is listed as if the batch had
/// been written whole, and removing every name at the end leaves no index
/// entry (none left unreachable). Before removals went first, bottom-up, a
/// link removed (or a leaf written over a node a removal emptied) could be
/// kept while entries below it were not: applying the entry again found
/// nothing to remove under the new leaf, and the dead entries stayed.
#[test]
fn a_batch_cut_by_a_crash_and_applied_again_is_whole() {
    let seed: u64 = std::env::var("TIDEPOOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TIDEPOOL_SEED reruns it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(config(dir.path())).unwrap();
    let space = engine.key_space(NAMES_KEY_SPACE).unwrap();
    let mut present: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
    for round in 0..2_000 {
        // Ops on few, short names: removals and puts of related names in
        // one batch (a name removed and put again, its prefixes too).
        let mut ops: Vec<(Vec<u8>, Option<u64>)> = Vec::new();
        for _ in 0..rng.random_range(1..8) {
            let mut name = random_name(&mut rng);
            name.truncate(rng.random_range(1..=3).min(name.len()));
            let size = rng.random_bool(0.6).then(|| rng.random_range(0..1000));
            ops.push((name, size));
        }
        let apply = |ops: &[(Vec<u8>, Option<u64>)]| {
            let mut batch = NameBatch::new(&engine, space);
            for (name, size) in ops {
                match size {
                    Some(size) => batch.insert(1, name, &meta(*size)).unwrap(),
                    None => {
                        batch.remove(1, name).unwrap();
                    }
                }
            }
            batch
        };
        let mut after = present.clone();
        for (name, size) in &ops {
            match size {
                Some(size) => after.insert(name.clone(), *size),
                None => after.remove(name),
            };
        }
        let batch = apply(&ops);
        let items: Vec<(NameKey, Option<Vec<u8>>)> = batch
            .ordered()
            .into_iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        drop(batch);
        let cut = rng.random_range(0..=items.len());
        for (key, value) in &items[..cut] {
            let mut one = WriteBatch::new();
            match value {
                Some(value) => one.put_tagged(space, key, value, NAMES_TAG),
                None => one.delete(space, key),
            };
            engine.write_batch(&one, Durability::Buffered).unwrap();
        }
        apply(&ops).commit(Durability::Buffered).unwrap();
        let seen: BTreeMap<Vec<u8>, u64> = all(&engine, space, 1).into_iter().collect();
        assert_eq!(
            seen,
            after,
            "seed {seed}, round {round}: cut after {cut} of {} writes",
            items.len()
        );
        present = after;
    }
    let mut batch = NameBatch::new(&engine, space);
    for name in present.keys() {
        assert!(batch.remove(1, name).unwrap(), "seed {seed}");
    }
    batch.commit(Durability::Buffered).unwrap();
    let left = engine
        .scan(
            space,
            Bound::Unbounded,
            Bound::Unbounded,
            tidepool_engine::Direction::Forward,
        )
        .unwrap()
        .count();
    assert_eq!(left, 0, "seed {seed}: index entries left unreachable");
}
