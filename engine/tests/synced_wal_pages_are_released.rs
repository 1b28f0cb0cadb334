//! Once a sealed value WAL segment is synced and lies more than
//! `wal_cached_bytes` behind the synced watermark, the engine drops its
//! pages from the page cache (so new writes reuse that memory) — never a
//! segment with unsynced bytes, never the index log — and every value stays
//! readable, also after a crash.

mod support;

use support::{fault_storage, key, open, value};
use tidepool_engine::Durability;
use tidepool_engine::storage::FaultStorage;

#[test]
fn synced_segments_behind_the_window_are_released_and_stay_readable() {
    let (storage, mut config) = fault_storage();
    config.wal_segment_bytes = 64 << 10;
    config.wal_cached_bytes = 128 << 10;
    config.relocation_enabled = false;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let n = 1_500u64; // ~1.5 MiB of WAL: about 24 segments
    for i in 0..n {
        engine
            .put(ks, &key(i), &value(i, 1, 1_000), Durability::Buffered)
            .unwrap();
    }
    engine.wait_synced(engine.processed_position()).unwrap();
    // The syncer releases after the sync that passes a segment's end plus
    // the window; one more synced write makes sure that sync happened.
    engine
        .put(ks, &key(n), &value(n, 1, 1_000), Durability::Synced)
        .unwrap();
    let metrics = engine.metrics();
    let (evictions, unsynced) = storage.evictions();
    println!(
        "{} WAL bytes synced, {} released, {evictions} evictions",
        metrics.wal_synced, metrics.wal_released_bytes
    );
    assert_eq!(unsynced, 0, "only synced segments are released");
    let segment = config.wal_segment_bytes;
    let released_at_least = (metrics.wal_synced - config.wal_cached_bytes) / segment - 1;
    assert!(
        metrics.wal_released_bytes >= released_at_least * segment,
        "segments behind the window were released"
    );
    assert!(
        metrics.wal_released_bytes + config.wal_cached_bytes <= metrics.wal_synced,
        "the window stays cached"
    );
    assert_eq!(
        evictions,
        metrics.wal_released_bytes / segment,
        "each segment once"
    );
    for i in 0..=n {
        assert_eq!(
            engine.get(ks, &key(i)).unwrap(),
            Some(value(i, 1, 1_000).into())
        );
    }
    // A crash: everything written is still there.
    let placeholder = open(&FaultStorage::default(), &config).unwrap();
    drop(std::mem::replace(&mut { engine }, placeholder));
    let storage = storage.restart_process();
    let engine = open(&storage, &config).unwrap();
    for i in 0..=n {
        assert_eq!(
            engine.get(ks, &key(i)).unwrap(),
            Some(value(i, 1, 1_000).into())
        );
    }
    engine.close().unwrap();
}

#[test]
fn wal_cached_bytes_max_never_releases() {
    let (storage, mut config) = fault_storage();
    config.wal_segment_bytes = 64 << 10;
    config.wal_cached_bytes = u64::MAX;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in 0..600u64 {
        engine
            .put(ks, &key(i), &value(i, 1, 1_000), Durability::Synced)
            .unwrap();
    }
    assert_eq!(engine.metrics().wal_released_bytes, 0);
    assert_eq!(storage.evictions(), (0, 0));
    engine.close().unwrap();
}
