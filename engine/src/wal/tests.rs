//! Tests of the log on the fault-injecting storage.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::format::{self, FLAG_APPLIED, ItemSpec, Kind, Op};
use super::replay::{self, Stop};
use super::segment::LogKind;
use super::*;
use crate::storage::FaultStorage;
use crate::types::Tag;

const SEGMENT: u64 = 4096;

fn options() -> LogOptions {
    LogOptions {
        dir: PathBuf::from("/db/wal"),
        kind: LogKind::Values,
        log_id: [7; 16],
        segment_size: SEGMENT,
        spare_segments: 2,
        sync_interval: Duration::from_millis(5),
        keep_cached_bytes: None,
        mapped_reads: false,
    }
}

fn start(
    storage: &FaultStorage,
    next: u64,
    existing: BTreeMap<SegmentId, Arc<SegmentFile>>,
) -> Log {
    start_with(options(), Arc::new(storage.clone()), next, existing)
}

fn start_with(
    opts: LogOptions,
    storage: Arc<dyn Storage>,
    next: u64,
    existing: BTreeMap<SegmentId, Arc<SegmentFile>>,
) -> Log {
    storage.create_dir_all(&opts.dir).unwrap();
    Log::start(
        opts,
        storage,
        Arc::default(),
        Epoch(1),
        SegmentId(next),
        existing,
        &crate::pool::WorkerPool::new("test-log", 2, 1).unwrap(),
    )
    .unwrap()
}

/// A put of `value` under `key` in the log's epoch.
fn put_item<'a>(log: &Log, key: &'a [u8], value: &'a [u8]) -> ItemSpec<'a> {
    ItemSpec {
        op: Op::Put,
        key_space: 0,
        key,
        value,
        epoch: log.epoch(),
        tag: Tag(0),
        version: 0,
    }
}

fn put(log: &Log, key: &[u8], value: &[u8]) -> WalPosition {
    let item = put_item(log, key, value);
    let len = format::entry_record_len(0, &[item]);
    log.append(len, |buf, pos| {
        format::write_entry(buf, pos, FLAG_APPLIED, &[], &[item])
    })
    .unwrap()
    .0
}

/// Bytes of the record [`put`] writes for a 4-byte key and `value`.
fn put_record_len(value: &[u8]) -> usize {
    format::entry_record_len(
        0,
        &[ItemSpec {
            op: Op::Put,
            key_space: 0,
            key: &[0; 4],
            value,
            epoch: Epoch(1),
            tag: Tag(0),
            version: 0,
        }],
    )
}

/// Checks that `bytes`, read at `at`, are a whole verified record whose
/// first item holds `value`.
fn assert_put_record(at: WalPosition, bytes: &[u8], value: &[u8]) {
    let view = format::RecordView::verify(at, bytes).unwrap();
    assert_eq!(view.items().next().unwrap().1.value, value);
}

/// Every entry value from `from` on, in log order.
fn replay_values(storage: &FaultStorage, from: WalPosition) -> (Vec<Vec<u8>>, replay::ReplayEnd) {
    let segments = replay::open_segments(storage, &options()).unwrap();
    let mut values = Vec::new();
    let end = replay::replay(&options(), &segments.valid, from, |_, view| {
        assert_eq!(view.header.kind, Kind::Entry);
        values.extend(view.items().map(|(_, item)| item.value.to_vec()));
        Ok(())
    })
    .unwrap();
    (values, end)
}

#[test]
fn appends_across_segments_read_back_and_replay_in_order() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    let mut positions = Vec::new();
    for i in 0..200u32 {
        let value = vec![i as u8; 50 + (i as usize % 7) * 13];
        positions.push((put(&log, &i.to_le_bytes(), &value), value));
    }
    assert!(
        log.active_segment().0 >= 3,
        "values must span several segments"
    );
    for (position, value) in &positions {
        let bytes = log.read(*position, put_record_len(value)).unwrap();
        assert_put_record(*position, &bytes, value);
    }
    log.sync_now().unwrap();
    drop(log);
    let (values, end) = replay_values(&storage.restart_process(), WalPosition(0));
    assert_eq!(
        values,
        positions.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>()
    );
    assert_eq!(end.stop, Stop::End);
}

#[test]
fn mapped_reads_match_pread_on_both_storages() {
    let dir = tempfile::tempdir().unwrap();
    let storages: [Arc<dyn Storage>; 2] = [
        Arc::new(FaultStorage::default()),
        Arc::new(crate::storage::FileStorage),
    ];
    for (n, storage) in storages.into_iter().enumerate() {
        let mut opts = options();
        opts.mapped_reads = true;
        opts.dir = dir.path().join(n.to_string());
        let log = start_with(opts.clone(), storage.clone(), 0, BTreeMap::new());
        let plain = {
            let mut opts = opts.clone();
            opts.mapped_reads = false;
            opts
        };
        let mut positions = Vec::new();
        for i in 0..100u32 {
            let value = vec![i as u8; 40 + (i as usize % 5) * 31];
            let at = put(&log, &i.to_le_bytes(), &value);
            // Read back at once: the active segment is read in place too.
            let mapped = log.mapped(at, 24).unwrap().expect("the log maps");
            assert_eq!(&mapped[..], &log.read(at, 24).unwrap()[..]);
            positions.push(at);
        }
        assert!(log.active_segment().0 >= 2, "several segments");
        for &at in &positions {
            let via_map = log.mapped(at, 32).unwrap().expect("mapped")[..].to_vec();
            let mut via_pread = vec![0; 32];
            let (segment, offset) = log.shared.segment_of(at, 32).unwrap();
            segment.file.read_at(&mut via_pread, offset).unwrap();
            assert_eq!(via_map, via_pread, "at {at:?}");
        }
        // A range past a segment's end is no record, mapped or not.
        let last = WalPosition(SEGMENT - 8);
        assert!(matches!(log.mapped(last, 16), Err(Error::NoRecord(_))));
        assert!(matches!(log.read(last, 16), Err(Error::NoRecord(_))));
        drop(log);
        let log = start_with(plain, storage, 10, BTreeMap::new());
        assert!(log.mapped(WalPosition(10 * SEGMENT), 8).unwrap().is_none());
    }
}

#[test]
fn a_sync_unmaps_the_whole_pages_it_makes_durable() {
    // Writing back a page still mapped writable costs a TLB shootdown per
    // page; the syncer unmaps what it syncs first (the page cache keeps it).
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options();
    opts.dir = dir.path().join("wal");
    opts.segment_size = 4 << 20;
    opts.sync_interval = Duration::from_secs(3600);
    let log = start_with(
        opts.clone(),
        Arc::new(crate::storage::FileStorage),
        0,
        BTreeMap::new(),
    );
    let path = segment::segment_path(&opts.dir, opts.kind, SegmentId(0));
    let rss = || crate::storage::mapped_bytes(&path, &["Rss:"]);
    // The whole segment populated now, so the allocator's populating ahead
    // of the writers cannot change what is mapped between the two looks.
    let active = log.shared.current.load_full().unwrap();
    log.shared.reserve(&active, u64::MAX).unwrap();
    active.mapping.populate_to(u64::MAX);
    let value = vec![3u8; 4000];
    let positions: Vec<WalPosition> = (0..300u32)
        .map(|i| put(&log, &i.to_le_bytes(), &value))
        .collect();
    let before = rss();
    log.sync_now().unwrap();
    let after = rss();
    let written = log.shared.tracker.processed();
    assert!(written > 1 << 20, "{written} bytes written");
    // Every whole page below the synced end left the mapping: at most the
    // last, partly written page is still mapped among them.
    assert!(
        after + written / 4096 * 4096 <= before + 4096,
        "{before} bytes mapped before the sync, {after} after, {written} written"
    );
    // Every record still reads back whole and verified: from the page cache,
    // and from the disk once the log is closed and the cache dropped.
    let len = put_record_len(&value);
    let check = |read: &dyn Fn(WalPosition) -> Vec<u8>| {
        for &at in &positions {
            assert_put_record(at, &read(at), &value);
        }
    };
    check(&|at| log.read(at, len).unwrap());
    drop(log);
    let file = crate::storage::FileStorage.open(&path).unwrap();
    file.evict_cache().unwrap();
    check(&|at| {
        let mut bytes = vec![0; len];
        file.read_at(&mut bytes, at.0).unwrap();
        bytes
    });
}

#[test]
fn parallel_writers_never_overlap_and_processed_covers_all() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let log = &log;
            s.spawn(move || {
                for i in 0..300u16 {
                    put(log, &[t, i as u8, (i >> 8) as u8], &[t; 40]);
                }
            });
        }
    });
    let processed = log.processed();
    log.wait_synced(processed).unwrap();
    drop(log);
    let (values, end) = replay_values(&storage.reboot(1), WalPosition(0));
    assert_eq!(values.len(), 1200);
    assert_eq!(end.end, processed, "replay ends where processing ended");
}

#[test]
fn synced_data_survives_power_loss_and_the_tail_is_cut_cleanly() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    for i in 0..30u8 {
        put(&log, &[i], &[i; 100]);
    }
    let durable = log.processed();
    log.wait_synced(durable).unwrap();
    for i in 30..60u8 {
        put(&log, &[i], &[i; 100]);
    }
    storage.crash();
    drop(log);
    for seed in 0..20 {
        let (values, end) = replay_values(&storage.reboot(seed), WalPosition(0));
        assert!(values.len() >= 30, "seed {seed}: lost synced records");
        for (i, v) in values.iter().enumerate() {
            assert_eq!(v, &vec![i as u8; 100], "seed {seed}: record {i} wrong");
        }
        assert!(end.end >= durable);
    }
}

#[test]
fn epoch_advance_rolls_the_segment() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    put(&log, b"a", b"1");
    let before = log.active_segment();
    log.advance_epoch(Epoch(2)).unwrap();
    let after = log.active_segment();
    assert!(after > before);
    let p = put(&log, b"b", b"2");
    assert_eq!(p.0 / SEGMENT, after.0);
    let epochs: Vec<_> = log.segments().iter().map(|s| s.epoch.0).collect();
    assert_eq!(epochs, vec![1, 2]);
}

#[test]
fn restart_after_the_existing_segments() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    let first = put(&log, b"a", b"first");
    log.sync_now().unwrap();
    drop(log);
    let segments = replay::open_segments(&storage, &options()).unwrap();
    // Unused spares are removed at shutdown.
    assert!(segments.unreadable.is_empty(), "{:?}", segments.unreadable);
    let (_, end) = replay_values(&storage, WalPosition(0));
    let next = replay::seal_tail(
        &storage,
        &options(),
        &segments.valid,
        WalPosition(0),
        end.end,
    )
    .unwrap();
    assert_eq!(next, SegmentId(1));
    let log = start(&storage, next.0, segments.valid);
    let second = put(&log, b"b", b"second");
    assert_eq!(second.0 / SEGMENT, 1);
    assert!(log.read(first, 8).is_ok());
    log.sync_now().unwrap();
    drop(log);
    let (values, _) = replay_values(&storage, WalPosition(0));
    assert_eq!(values, vec![b"first".to_vec(), b"second".to_vec()]);
}

#[test]
fn full_disk_fails_the_write_without_damage() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    put(&log, b"a", b"kept");
    // Wait for the spares, then allow nothing more.
    std::thread::sleep(Duration::from_millis(50));
    storage.set_capacity_bytes(Some(storage.used_bytes()));
    let big = vec![1u8; 1500];
    let mut failed = None;
    for i in 0..20u8 {
        let item = ItemSpec {
            op: Op::Put,
            key_space: 0,
            key: &[i],
            value: &big,
            epoch: Epoch(1),
            tag: Tag(0),
            version: 0,
        };
        let len = format::entry_record_len(0, &[item]);
        if let Err(e) = log.append(len, |buf, pos| {
            format::write_entry(buf, pos, FLAG_APPLIED, &[], &[item])
        }) {
            failed = Some(e);
            break;
        }
    }
    assert!(
        matches!(failed, Some(crate::Error::DiskFull(_))),
        "{failed:?}"
    );
    storage.set_capacity_bytes(None);
    // Space came back: writes work again, and everything reads back.
    std::thread::sleep(Duration::from_millis(250));
    put(&log, b"z", b"after");
    log.sync_now().unwrap();
    drop(log);
    let (values, end) = replay_values(&storage, WalPosition(0));
    assert_eq!(values.first().unwrap(), b"kept");
    assert_eq!(values.last().unwrap(), b"after");
    assert_eq!(end.stop, Stop::End);
}

#[test]
fn a_full_disk_inside_a_sparse_segment_fails_the_write_without_damage() {
    // Segments are sparse: their space is reserved a step at a time ahead
    // of the writers. When a step cannot be reserved the write fails with
    // DiskFull before it claims a byte (no byte lands in a hole: the fault
    // storage fails any sync of such bytes), and writing goes on once
    // space comes back.
    let storage = FaultStorage::default();
    let mut opts = options();
    opts.segment_size = 4 << 20;
    let log = start_with(opts.clone(), Arc::new(storage.clone()), 0, BTreeMap::new());
    put(&log, b"a", b"kept");
    std::thread::sleep(Duration::from_millis(250));
    assert!(
        storage.used_bytes() < opts.segment_size,
        "{} bytes reserved by an idle log of {}-byte segments",
        storage.used_bytes(),
        opts.segment_size
    );
    storage.set_capacity_bytes(Some(storage.used_bytes()));
    let value = vec![9u8; 1000];
    let mut written = Vec::new();
    let failure = loop {
        let key = (written.len() as u32).to_le_bytes();
        let item = ItemSpec {
            op: Op::Put,
            key_space: 0,
            key: &key,
            value: &value,
            epoch: Epoch(1),
            tag: Tag(0),
            version: 0,
        };
        let len = format::entry_record_len(0, &[item]);
        match log.append(len, |buf, pos| {
            format::write_entry(buf, pos, FLAG_APPLIED, &[], &[item])
        }) {
            Ok((position, _)) => written.push(position),
            Err(error) => break error,
        }
        assert!(written.len() < 4_096, "the disk never filled");
    };
    assert!(matches!(failure, crate::Error::DiskFull(_)), "{failure:?}");
    assert!(!written.is_empty());
    log.sync_now().unwrap();
    storage.set_capacity_bytes(None);
    put(&log, b"z", b"after");
    log.sync_now().unwrap();
    drop(log);
    let segments = replay::open_segments(&storage, &opts).unwrap();
    let mut values = Vec::new();
    let end = replay::replay(&opts, &segments.valid, WalPosition(0), |_, view| {
        values.extend(view.items().map(|(_, item)| item.value.to_vec()));
        Ok(())
    })
    .unwrap();
    assert_eq!(values.len(), written.len() + 2);
    assert_eq!(values.first().unwrap(), b"kept");
    assert_eq!(values.last().unwrap(), b"after");
    assert_eq!(end.stop, Stop::End);
}

/// Regression (found by the crash suite): recovery that crashes while
/// sealing the tail must never make records past the cut reachable. With
/// the pad written before the later segments were deleted, a crash in
/// between let the next replay jump over the torn record into them.
#[test]
fn a_crash_while_sealing_the_tail_never_exposes_records_past_the_cut() {
    for crash_at in 1..=12 {
        let storage = FaultStorage::default();
        let log = start(&storage, 0, BTreeMap::new());
        let mut positions = Vec::new();
        for i in 0..120u8 {
            positions.push(put(&log, &[i], &[i; 100]));
        }
        log.sync_now().unwrap();
        drop(log);
        assert!(
            positions.last().unwrap().0 / SEGMENT >= 2,
            "records must span segments"
        );
        // Pretend record 10 was torn: the log must end there.
        let cut = positions[10];
        let segments = replay::open_segments(&storage, &options()).unwrap();
        storage.crash_at_op(storage.ops() + crash_at);
        let _ = replay::seal_tail(&storage, &options(), &segments.valid, WalPosition(0), cut);
        // Worst case: every write that reached the page cache persists.
        let after = storage.restart_process();
        // Record 10 is not really torn, so an unfinished seal may still
        // replay past it — but only ever a gap-free prefix of the log.
        let (values, _) = replay_values(&after, WalPosition(0));
        let replayed: Vec<u8> = values.iter().map(|v| v[0]).collect();
        let prefix: Vec<u8> = (0..replayed.len() as u8).collect();
        assert_eq!(
            replayed, prefix,
            "crash at op {crash_at}: replay must see a prefix, no gap"
        );
    }
}

/// Contiguous writes of lengths from `len` (multiples of 8, as records
/// are) from the end of a segment's header to its end: the chunks they
/// fault in, and how many times each.
fn chunks_faulted_in(segment: u64, mut len: impl FnMut() -> u64) -> BTreeMap<u64, u32> {
    let mut offset = HEADER_RECORD_BYTES;
    let mut faulted = BTreeMap::new();
    while offset < segment {
        let len = (8 * len()).min(segment - offset);
        if let Some(chunk) = chunk_to_fault_in(offset, len) {
            assert_eq!(chunk % FAULT_AHEAD_BYTES, 0);
            assert!(
                chunk >= offset + len,
                "chunk {chunk} faulted in by a write reaching {}",
                offset + len
            );
            *faulted.entry(chunk).or_insert(0) += 1;
        }
        offset += len;
    }
    faulted
}

#[test]
fn each_chunk_is_faulted_in_once_ahead_of_the_writes() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(seed);
    let segment = 64 * FAULT_AHEAD_BYTES;
    // Writes shorter than a chunk: every chunk from the third on (the first
    // two fault inline) is faulted in by exactly one write, a whole chunk
    // before any write reaches it.
    let small = chunks_faulted_in(segment, || {
        rand::Rng::random_range(&mut rng, 1..=FAULT_AHEAD_BYTES / 8)
    });
    let expected: Vec<u64> = (2..=64).map(|i| i * FAULT_AHEAD_BYTES).collect();
    assert_eq!(small.keys().copied().collect::<Vec<_>>(), expected);
    assert!(small.values().all(|&n| n == 1), "{small:?}");
    // Writes of up to five chunks: still each chunk at most once, ahead of
    // the data (checked inside); chunks a long write spans it faults in
    // itself.
    let mixed = chunks_faulted_in(segment, || {
        rand::Rng::random_range(&mut rng, 1..=5 * FAULT_AHEAD_BYTES / 8)
    });
    assert!(mixed.values().all(|&n| n == 1), "{mixed:?}");
    assert!(!mixed.is_empty());
}

#[test]
fn spares_get_large_folios_only_after_16_mib_per_sync() {
    use workers::page_folios;
    let mib = 1 << 20;
    // A new log, or one that wrote nothing: page folios.
    assert!(page_folios(0, 0));
    // Synced per write or per batch: page folios.
    assert!(page_folios(256 * mib, 10_000));
    // The background syncer every 100 ms under 100 MB/s: page folios.
    assert!(page_folios(256 * mib, 27));
    // A bulk load at 300 MB/s synced every 100 ms: 30 MB per sync.
    assert!(!page_folios(256 * mib, 9));
    // Exactly 16 MiB per sync, and no sync at all over a large write.
    assert!(!page_folios(64 * mib, 4));
    assert!(page_folios(64 * mib - 1, 4));
    assert!(!page_folios(16 * mib, 0));
    assert!(page_folios(16 * mib - 1, 0));
}

#[test]
fn a_log_that_slows_down_skips_to_a_folio_boundary_with_a_filler_replay_passes_over() {
    let storage = FaultStorage::default();
    let mut opts = options();
    opts.segment_size = 8 << 20;
    let log = start_with(opts.clone(), Arc::new(storage.clone()), 0, BTreeMap::new());
    let before = put(&log, b"key1", b"before");
    // A new log's segments have page folios: nothing to do.
    log.shared.use_page_folios_ahead();
    let still = put(&log, b"key2", b"still");
    assert!(still.0 < 64 << 10, "no filler before {still}");
    // As if the active segment had been mapped while the log was fast.
    log.shared
        .current
        .load()
        .as_ref()
        .unwrap()
        .page_folios
        .store(false, Ordering::SeqCst);
    log.shared.use_page_folios_ahead();
    log.shared.use_page_folios_ahead();
    let after = put(&log, b"key3", b"after");
    // (A sync mark of the background syncer may come first.)
    assert!(
        (LARGEST_FOLIO_BYTES..LARGEST_FOLIO_BYTES + 64).contains(&after.0),
        "the next write starts a folio, not at {after}"
    );
    log.sync_now().unwrap();
    assert_put_record(
        after,
        &log.read(after, put_record_len(b"after")).unwrap(),
        b"after",
    );
    log.shutdown();

    let segments = replay::open_segments(&storage, &opts).unwrap();
    let mut values = Vec::new();
    let end = replay::replay(&opts, &segments.valid, WalPosition(0), |_, view| {
        assert_eq!(view.header.kind, Kind::Entry);
        values.extend(view.items().map(|(_, item)| item.value.to_vec()));
        Ok(())
    })
    .unwrap();
    assert_eq!(values, [&b"before"[..], b"still", b"after"]);
    assert_eq!(end.stop, Stop::End);
    assert!(end.end.0 > after.0);
    // The sync-mark scan reads 8-byte marks and passes over the filler
    // (which marks the watermark of its time, never a later one).
    let synced = replay::scan_sync_marks(&opts, &segments.valid, before).unwrap();
    assert!(synced <= end.end.0, "{synced}");
}

#[test]
fn the_populate_window_follows_the_write_rate() {
    let segment = 64 << 20;
    let second = Duration::from_secs(1);
    // Idle, or slow: the least window.
    assert_eq!(
        workers::populate_window(0, second, segment),
        workers::POPULATE_MIN_BYTES
    );
    assert_eq!(
        workers::populate_window(100 << 10, second, segment),
        workers::POPULATE_MIN_BYTES
    );
    // Half a second of the rate ahead.
    assert_eq!(workers::populate_window(8 << 20, second, segment), 4 << 20);
    // Never past a segment.
    assert_eq!(workers::populate_window(1 << 30, second, segment), segment);
}

#[test]
fn an_idle_log_holds_a_window_of_memory_and_no_spare() {
    // A log that nobody writes neither populates its segment nor reserves
    // a spare; once written it gets both, ahead of its writers.
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options();
    opts.dir = dir.path().join("wal");
    opts.segment_size = 16 << 20;
    let log = start_with(
        opts.clone(),
        Arc::new(crate::storage::FileStorage),
        0,
        BTreeMap::new(),
    );
    let segments = || std::fs::read_dir(&opts.dir).unwrap().count();
    let path = segment::segment_path(&opts.dir, opts.kind, SegmentId(0));
    let rss = || crate::storage::mapped_bytes(&path, &["Rss:"]);
    // Several of the allocator's looks (every 100 ms).
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(segments(), 1, "an idle log made a spare");
    assert!(
        rss() <= workers::POPULATE_MIN_BYTES + 4096,
        "{} bytes of an idle segment in memory",
        rss()
    );
    // And little of it on disk: the segment is sparse.
    let allocated =
        std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&path).unwrap()) * 512;
    assert!(
        allocated <= workers::RESERVE_MIN_BYTES,
        "{allocated} bytes of an idle segment allocated"
    );
    assert!(log.disk_bytes() <= workers::RESERVE_MIN_BYTES);
    // A quarter of the segment written: a spare follows.
    let value = vec![5u8; 64 << 10];
    let mut i = 0u32;
    while log.shared.tracker.processed() < (4 << 20) + 4096 {
        put(&log, &i.to_le_bytes(), &value);
        i += 1;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while segments() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no spare for a log a quarter full"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Writes go on across rotations (spares are made when needed).
    while log.shared.tracker.processed() < (40 << 20) {
        put(&log, &i.to_le_bytes(), &value);
        i += 1;
    }
    assert!(log.active_segment().0 >= 2);
    log.sync_now().unwrap();
}

/// Appends one record of a put of `value` under `key` through the file.
fn put_through_the_file(log: &Log, key: &[u8], value: &[u8]) -> WalPosition {
    let item = put_item(log, key, value);
    let len = format::entry_record_len(0, &[item]);
    log.append_gathered(len, |pos| format::gather_entry(pos, 0, &[], &[item]))
        .unwrap()
        .0
}

/// How far ahead of its writers a log keeps its active segment populated
/// (pages the kernel zero-fills, only to be overwritten) after writing
/// 1 MiB records at about 50 MiB/s for a second, through the file or
/// through the mapping.
fn populated_ahead(through_the_file: bool) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options();
    opts.dir = dir.path().join("wal");
    opts.segment_size = 16 << 20;
    let log = start_with(
        opts,
        Arc::new(crate::storage::FileStorage),
        0,
        BTreeMap::new(),
    );
    let value = vec![7u8; 1 << 20];
    let mut most = 0;
    for i in 0..60u32 {
        let at = if through_the_file {
            put_through_the_file(&log, &i.to_le_bytes(), &value)
        } else {
            put(&log, &i.to_le_bytes(), &value)
        };
        let read = log.read(at, put_record_len(&value)).unwrap();
        assert_put_record(at, &read, &value);
        std::thread::sleep(Duration::from_millis(20));
        let guard = log.shared.current.load();
        let active = guard.as_ref().unwrap();
        most = most.max(
            active
                .mapping
                .populated()
                .saturating_sub(active.mapping.claimed()),
        );
    }
    log.sync_now().unwrap();
    most
}

/// A log written through the file (large Raft entries) keeps the least
/// window populated ahead of its writers, rotation pads included; written
/// through the mapping at the same rate it keeps half a second of it.
#[test]
fn records_written_through_the_file_are_not_populated_ahead() {
    let file = populated_ahead(true);
    let mapping = populated_ahead(false);
    println!("populated ahead: through the file {file} bytes, through the mapping {mapping}");
    assert!(
        file <= workers::POPULATE_MIN_BYTES + 4096,
        "{file} bytes populated ahead of writes through the file"
    );
    assert!(
        mapping >= 4 * workers::POPULATE_MIN_BYTES,
        "the control: {mapping} bytes populated ahead of writes through the mapping"
    );
}

/// A writer that fails inside its claimed range leaves garbage there and
/// poisons the log, and its range still counts as processed (so waiters
/// are not stuck). A write claimed after it and finished meanwhile is past
/// that hole, where recovery cuts the log: it must not be told it is
/// processed (`Buffered`) or durable (`Synced`). Before, the watermark
/// passing over the hole acknowledged it.
#[test]
fn a_write_past_a_failed_writers_hole_is_not_acknowledged() {
    let storage = FaultStorage::default();
    let log = start(&storage, 0, BTreeMap::new());
    put(&log, b"k000", b"before");
    log.wait_synced(log.processed()).unwrap();
    let (claimed_tx, claimed_rx) = std::sync::mpsc::channel();
    let (fail_tx, fail_rx) = std::sync::mpsc::channel::<()>();
    let after = std::thread::scope(|scope| {
        let log = &log;
        let failing = scope.spawn(move || {
            let item = put_item(log, b"k001", b"torn");
            let len = format::entry_record_len(0, &[item]);
            log.append(len, |_buf, _pos| {
                claimed_tx.send(()).unwrap();
                fail_rx.recv().unwrap();
                panic!("a writer fails inside its claimed range");
            })
        });
        claimed_rx.recv().unwrap();
        // Claimed after the failing writer, written before it fails.
        let at = put(log, b"k002", b"after");
        let end = WalPosition(at.0 + put_record_len(b"after") as u64);
        fail_tx.send(()).unwrap();
        assert!(failing.join().is_err(), "the writer panicked");
        end
    });
    assert!(log.processed() >= after, "the hole counts as processed");
    assert!(matches!(log.wait_processed(after), Err(Error::Poisoned(_))));
    assert!(matches!(log.wait_synced(after), Err(Error::Poisoned(_))));
    assert!(log.synced() < after, "never synced past the hole");
}
