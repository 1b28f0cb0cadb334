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
