//! Cold reads: with the WAL's pages dropped from the page cache
//! (`posix_fadvise(DONTNEED)`), a random get reads about one value's worth of
//! bytes from the disk — not a readahead window (this machine's block device
//! reads ahead 8 MiB) — and an existence check reads no value at all.
//! Measured with `read_bytes` of `/proc/self/io`, on a real block device.

mod support;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use support::{key, on_block_device, process_read_bytes, value};
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpaceConfig};

/// `/proc/self/io` counts the whole process: the tests of this file take
/// turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

const VALUE_BYTES: usize = 8 << 10;
const VALUES: u64 = 16_384; // 128 MiB of values
const GETS: usize = 2_000;

fn config(dir: &std::path::Path) -> Config {
    let mut config = Config::new(dir);
    config.wal_segment_bytes = 32 << 20;
    config.index_segment_bytes = 8 << 20;
    config.max_value_bytes = 1 << 20;
    config.value_cache_bytes = 0; // every get goes to the WAL
    config.key_spaces = vec![KeySpaceConfig {
        name: "default".into(),
        key_bytes: 32,
        layout: CellLayout::Uniform { cells: 256 },
    }];
    config
}

#[test]
fn a_cold_get_reads_about_one_value_and_exists_reads_none() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let seed = tidepool_testkit::seed_from_env("COLD_READ_SEED");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    assert!(
        on_block_device(dir.path()),
        "{} is not on a block device: /proc/self/io cannot see its reads",
        dir.path().display()
    );
    let engine = Engine::open(config(dir.path())).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..VALUES {
        engine
            .put(ks, &key(k), &value(k, 1, VALUE_BYTES), Durability::Buffered)
            .unwrap();
    }
    engine.close().unwrap();
    drop(engine);

    let engine = Engine::open(config(dir.path())).unwrap();
    // Existence checks load the index (not evicted) and never touch values.
    engine.drop_page_cache().unwrap();
    let before = process_read_bytes();
    for k in 0..VALUES {
        assert!(engine.exists(ks, &key(k)).unwrap());
    }
    let exists_bytes = process_read_bytes() - before;

    let mut order: Vec<u64> = (0..VALUES).collect();
    order.shuffle(&mut SmallRng::seed_from_u64(seed));
    engine.drop_page_cache().unwrap();
    let before = process_read_bytes();
    for &k in &order[..GETS] {
        let got = engine.get(ks, &key(k)).unwrap().expect("stored");
        assert_eq!(got.len(), VALUE_BYTES);
    }
    let per_get = (process_read_bytes() - before) as f64 / GETS as f64;
    println!(
        "seed {seed}: {VALUES} values of {VALUE_BYTES} bytes; {:.0} bytes read from disk per cold get; \
         {exists_bytes} bytes for {VALUES} existence checks",
        per_get
    );
    assert!(
        per_get >= VALUE_BYTES as f64 * 0.9,
        "the gets must really go to the disk ({per_get:.0} bytes each)"
    );
    assert!(
        per_get <= VALUE_BYTES as f64 * 2.0,
        "a cold get read {per_get:.0} bytes; about one value ({VALUE_BYTES}) expected"
    );
    assert!(
        exists_bytes < 4 << 20,
        "existence checks read {exists_bytes} bytes: values must not be read"
    );
    engine.close().unwrap();
}

/// Beyond the index memory budget cells stay on disk: a cold lookup reads a
/// window of the cell's sorted entries sized to the rank estimate's error
/// (a few KiB), not the whole cell, and an absent key is turned away by the
/// cell's bloom filter without any read.
#[test]
fn beyond_the_index_budget_a_cold_lookup_reads_a_small_window() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const CELLS: u32 = 64;
    const ENTRIES: u64 = 262_144; // 4,096 per cell: 256 KiB of on-disk index each
    const SMALL_VALUE: usize = 256;
    // Few enough lookups that they rarely share an index page.
    const LOOKUPS: usize = 200;
    let seed = tidepool_testkit::seed_from_env("COLD_READ_SEED");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    assert!(on_block_device(dir.path()));
    let small_index = |dir: &std::path::Path| {
        let mut config = config(dir);
        config.index_memory_bytes = 1; // no cell ever fits: every lookup goes to disk
        // Sealed index segments are unmapped, so their pages can be dropped.
        config.index_segment_bytes = 1 << 20;
        config.key_spaces[0].layout = CellLayout::Uniform { cells: CELLS };
        config
    };
    let engine = Engine::open(small_index(dir.path())).unwrap();
    let ks = engine.key_space("default").unwrap();
    for k in 0..ENTRIES {
        engine
            .put(ks, &key(k), &value(k, 1, SMALL_VALUE), Durability::Buffered)
            .unwrap();
    }
    engine.close().unwrap();
    drop(engine);

    let engine = Engine::open(small_index(dir.path())).unwrap();
    let absent = |k: u64| key(ENTRIES + k);
    // The first lookup in each cell reads its bloom filter once.
    for k in 0..1_000 {
        assert!(!engine.exists(ks, &absent(k)).unwrap());
    }
    engine.drop_page_cache().unwrap();
    let metrics = || engine.metrics().counters;
    let (before, negatives) = (process_read_bytes(), metrics().bloom_negatives);
    for k in 1_000..11_000 {
        assert!(!engine.exists(ks, &absent(k)).unwrap());
    }
    let absent_bytes = process_read_bytes() - before;
    let filtered = metrics().bloom_negatives - negatives;

    let mut order: Vec<u64> = (0..ENTRIES).collect();
    order.shuffle(&mut SmallRng::seed_from_u64(seed));
    engine.drop_page_cache().unwrap();
    let (before, lookups) = (process_read_bytes(), metrics().disk_lookups);
    for &k in &order[..LOOKUPS] {
        assert!(engine.exists(ks, &key(k)).unwrap());
    }
    let per_exists = (process_read_bytes() - before) as f64 / LOOKUPS as f64;
    let disk_lookups = metrics().disk_lookups - lookups;
    engine.drop_page_cache().unwrap();
    let before = process_read_bytes();
    for &k in &order[LOOKUPS..2 * LOOKUPS] {
        let got = engine.get(ks, &key(k)).unwrap().expect("stored");
        assert_eq!(got.len(), SMALL_VALUE);
    }
    let per_get = (process_read_bytes() - before) as f64 / LOOKUPS as f64;
    let cell_bytes = (ENTRIES / u64::from(CELLS)) as f64 * 64.0;
    println!(
        "seed {seed}: {ENTRIES} entries in {CELLS} cells ({cell_bytes:.0} bytes of index each), index \
         memory budget 1 byte: absent keys: {filtered} of 10000 filtered by bloom, {absent_bytes} bytes \
         read; present keys: {per_exists:.0} bytes read per cold exists ({disk_lookups} disk lookups), \
         {per_get:.0} per cold get of a {SMALL_VALUE}-byte value"
    );
    assert!(
        filtered >= 9_800,
        "only {filtered} of 10000 absent keys were turned away by the bloom filters"
    );
    // Only the bloom filters' false positives (about 1%) read a window.
    assert!(
        absent_bytes <= (10_000 - filtered) * (24 << 10),
        "absent keys read {absent_bytes} bytes: the bloom filters must answer them"
    );
    assert_eq!(
        disk_lookups, LOOKUPS as u64,
        "present keys must be looked up on disk"
    );
    // The window is 3·sqrt(4096) + 16 = 208 entries (13 KiB: four pages);
    // reading the whole cell, or an 800-entry window, costs 50 KiB or more.
    assert!(
        per_exists <= 24.0 * 1024.0,
        "a cold exists read {per_exists:.0} bytes of index; a small window of a {cell_bytes:.0}-byte cell expected"
    );
    assert!(
        per_get <= 24.0 * 1024.0 + 8192.0,
        "a cold get read {per_get:.0} bytes; a small index window plus one value expected"
    );
    engine.close().unwrap();
}
