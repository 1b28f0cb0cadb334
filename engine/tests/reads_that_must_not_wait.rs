//! `get_stored_now` and `epoch_of_now` answer from memory or say they
//! would wait: a value whose segment's pages were dropped from the page
//! cache is not read (the caller asks `get_stored` on a thread that may
//! block), and once read it is answered at once, the same as `get_stored`.
//! On real files, `read_at_if_cached` refuses pages the kernel dropped.

mod support;

use support::{fault_storage, key, open, value};
use tidepool_engine::Durability;
use tidepool_engine::storage::{FileStorage, Storage};

#[test]
fn a_read_that_would_wait_for_the_disk_is_refused_then_answered_once_warm() {
    let (storage, mut config) = fault_storage();
    config.wal_segment_bytes = 64 << 10;
    config.wal_cached_bytes = 128 << 10;
    config.relocation_enabled = false;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let n = 1_500u64; // about 24 segments; the first ones get released
    for i in 0..n {
        engine
            .put(ks, &key(i), &value(i, 1, 1_000), Durability::Buffered)
            .unwrap();
    }
    engine.wait_synced(engine.processed_position()).unwrap();
    engine
        .put(ks, &key(n), &value(n, 1, 1_000), Durability::Synced)
        .unwrap();
    assert!(storage.evictions().0 > 0, "early segments were released");

    // The first value's pages are gone: no answer without waiting.
    assert_eq!(engine.get_stored_now(ks, &key(0)).unwrap(), None);
    // Its epoch is in the index, in memory: answered.
    let epoch = engine.epoch_of(ks, &key(0)).unwrap();
    assert!(epoch.is_some());
    assert_eq!(engine.epoch_of_now(ks, &key(0)).unwrap(), Some(epoch));
    // The waiting read fetches it; then it is answered at once, the same.
    let stored = engine.get_stored(ks, &key(0)).unwrap().expect("stored");
    assert_eq!(&stored.value[..], &value(0, 1, 1_000)[..]);
    assert_eq!(
        engine.get_stored_now(ks, &key(0)).unwrap(),
        Some(Some(stored))
    );
    // The newest value is in the page cache: answered, as get_stored does.
    let newest = engine.get_stored(ks, &key(n)).unwrap();
    assert!(newest.is_some());
    assert_eq!(engine.get_stored_now(ks, &key(n)).unwrap(), Some(newest));
    // A key never written is never found.
    assert!(matches!(
        engine.get_stored_now(ks, &key(n + 1)).unwrap(),
        None | Some(None)
    ));
    engine.close().unwrap();
}

#[test]
fn real_files_refuse_reads_of_pages_the_kernel_dropped() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("segment");
    let storage = FileStorage::new();
    let len = 1u64 << 20;
    let file = storage.create(&path, len).unwrap();
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    file.write_at(&bytes, 0).unwrap();
    file.sync_all().unwrap();
    let mut buf = vec![0; 64 << 10];
    let at = 256 << 10;
    assert!(file.read_at_if_cached(&mut buf, at).unwrap());
    assert_eq!(buf, bytes[at as usize..at as usize + buf.len()]);

    let kind = rustix::fs::statfs(dir.path()).unwrap().f_type;
    const TMPFS: i64 = 0x0102_1994;
    if kind as i64 == TMPFS {
        // tmpfs pages are the file: nothing is ever dropped.
        file.evict_cache().unwrap();
        println!("tmpfs: its pages cannot be dropped; only the warm read is checked");
    } else {
        // The advice is advisory: a page someone holds a passing reference
        // to at that instant (reclaim, compaction) stays, and one CI run
        // saw the first advice leave the range cached. Ask again until the
        // pages are gone; a read that still succeeds after 100 tries means
        // the refusal does not work.
        let mut tries = 0;
        let dropped = loop {
            tries += 1;
            file.evict_cache().unwrap();
            if !file.read_at_if_cached(&mut buf, at).unwrap() {
                break true;
            }
            if tries == 100 {
                break false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        println!("pages dropped after {tries} advice(s)");
        assert!(dropped, "pages just dropped are not read without waiting");
    }
    file.read_at(&mut buf, at).unwrap();
    assert!(file.read_at_if_cached(&mut buf, at).unwrap());
    assert_eq!(buf, bytes[at as usize..at as usize + buf.len()]);
}
