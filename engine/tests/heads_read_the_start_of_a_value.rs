//! `get_head` returns a value's first bytes and its length — reading only
//! those of a large value — the same warm or cold, for values written
//! alone (single entries) and in batches (listed items), and nothing for a
//! key without a value.

mod support;

use support::{fault_storage, key, open, value};
use tidepool_engine::{Durability, WriteBatch};

const SIZES: [usize; 6] = [1, 40, 16_000, 20_000, 70_000, 1 << 20];

fn check(engine: &tidepool_engine::Engine, base: u64) {
    let ks = engine.key_space("default").unwrap();
    for (i, &size) in SIZES.iter().enumerate() {
        let i = base + i as u64;
        let expected = value(i, 1, size);
        let size = expected.len();
        // Before anything reads the whole value (which the value cache
        // would then hold): the large ones are read in part.
        let heads: Vec<_> = [0, 34, 100, 1 << 21]
            .into_iter()
            .map(|n| (n, engine.get_head(ks, &key(i), n).unwrap().expect("stored")))
            .collect();
        let stored = engine.get_stored(ks, &key(i)).unwrap().unwrap();
        for (n, head) in heads {
            assert_eq!(head.len, size as u64, "size {size}, n {n}");
            assert_eq!(
                &head.prefix[..],
                &expected[..n.min(size)],
                "size {size}, n {n}"
            );
            assert_eq!((head.epoch, head.tag), (stored.epoch, stored.tag));
            // From memory, where it can be answered: the same.
            if let Some(now) = engine.get_head_now(ks, &key(i), n).unwrap() {
                assert_eq!(now, Some(head), "size {size}, n {n}");
            }
        }
    }
    assert_eq!(engine.get_head(ks, &key(base + 99), 34).unwrap(), None);
}

#[test]
fn heads_match_the_values_warm_and_cold() {
    let (storage, mut config) = fault_storage();
    config.wal_segment_bytes = 4 << 20;
    config.max_value_bytes = 2 << 20;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    // Alone: single entries.
    for (i, &size) in SIZES.iter().enumerate() {
        let i = i as u64;
        engine
            .put(ks, &key(i), &value(i, 1, size), Durability::Buffered)
            .unwrap();
    }
    // Together: one entry of listed items.
    let mut batch = WriteBatch::new();
    for (i, &size) in SIZES.iter().enumerate() {
        let i = 1_000 + i as u64;
        batch.put(ks, &key(i), &value(i, 1, size));
    }
    engine.write_batch(&batch, Durability::Synced).unwrap();
    check(&engine, 0);
    check(&engine, 1_000);
    engine.close().unwrap();
    // Reopened: no value cache, the index from disk.
    let engine = open(&storage, &config).unwrap();
    check(&engine, 0);
    check(&engine, 1_000);
    engine.close().unwrap();
}
