//! Epochs: keys written in epochs 1..=5, some touched later; dropping
//! epochs below 3 removes exactly the keys last written or touched in epochs
//! 1 and 2 — except those the filter keeps — deletes those epochs' segment
//! files, and leaves everything else byte-identical. Two engines with
//! different physical layouts, fed the same calls, end up identical.

mod support;

use std::collections::BTreeMap;

use support::{fault_storage, key, open, value};
use tidepool_engine::{
    Config, Decision, Durability, Engine, EntryInfo, Epoch, RelocationFilter, Strategy, Tag,
    WriteBatch,
};

/// Keeps entries tagged "durable"; drops the rest.
struct KeepDurable;

const DURABLE: Tag = Tag(7);

impl RelocationFilter for KeepDurable {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        if entry.tag == DURABLE {
            Decision::Keep
        } else {
            Decision::Drop
        }
    }
}

/// Key -> (value, epoch of last write or touch, tag).
type Model = BTreeMap<u64, (Vec<u8>, u32, Tag)>;

/// Writes 40 keys per epoch in epochs 1..=5 (every 8th tagged durable),
/// overwriting some older keys and touching others along the way.
fn run(engine: &Engine, extra_relocation: bool) -> Model {
    let ks = engine.key_space("default").unwrap();
    let mut model = Model::new();
    for epoch in 1..=5u32 {
        if epoch > 1 {
            engine.advance_epoch(Epoch(epoch)).unwrap();
        }
        for i in 0..40u64 {
            let k = u64::from(epoch) * 100 + i;
            let tag = if i % 8 == 0 { DURABLE } else { Tag(0) };
            let v = value(k, u64::from(epoch), 300 + (k as usize % 700));
            let mut batch = WriteBatch::new();
            batch.put_tagged(ks, &key(k), &v, tag);
            engine.write_batch(&batch, Durability::Buffered).unwrap();
            model.insert(k, (v, epoch, tag));
        }
        if epoch == 4 {
            // Overwrite a few epoch-1 keys: they now belong to epoch 4.
            for k in 100..105u64 {
                let v = value(k, 40, 500);
                engine
                    .put(
                        engine.key_space("default").unwrap(),
                        &key(k),
                        &v,
                        Durability::Buffered,
                    )
                    .unwrap();
                model.insert(k, (v, 4, Tag(0)));
            }
        }
        if epoch == 5 {
            // Touch some epoch-1 and epoch-2 keys: they survive the drop.
            for k in [110u64, 111, 210, 211] {
                assert!(engine.touch(ks, &key(k), Durability::Buffered).unwrap());
                model.get_mut(&k).unwrap().1 = 5;
            }
            assert!(
                !engine.touch(ks, &key(999), Durability::Buffered).unwrap(),
                "missing key"
            );
        }
        if extra_relocation {
            engine.relocate(Strategy::Wal { segments: 2 }).unwrap();
        }
    }
    model
}

fn expected_after_drop(model: &Model, below: u32) -> Model {
    model
        .iter()
        .filter(|(_, (_, epoch, tag))| *epoch >= below || *tag == DURABLE)
        .map(|(k, v)| (*k, v.clone()))
        .collect()
}

fn assert_matches(engine: &Engine, expected: &Model, context: &str) {
    let ks = engine.key_space("default").unwrap();
    for k in (100..140)
        .chain(200..240)
        .chain(300..340)
        .chain(400..440)
        .chain(500..540)
    {
        let got = engine.get(ks, &key(k)).unwrap().map(|v| v.to_vec());
        assert_eq!(
            got.as_ref(),
            expected.get(&k).map(|(v, _, _)| v),
            "{context}: key {k}"
        );
    }
}

fn config(segment_bytes: u64) -> Config {
    let (_, mut config) = fault_storage();
    config.relocation_enabled = false;
    config.wal_segment_bytes = segment_bytes;
    config
}

#[test]
fn dropping_epochs_removes_exactly_the_expired_keys_and_their_files() {
    let (storage, _) = fault_storage();
    let config = config(64 << 10);
    let engine = open(&storage, &config).unwrap();
    let model = run(&engine, false);
    let old_segments = engine
        .segment_usage()
        .unwrap()
        .iter()
        .filter(|s| s.epoch.0 < 3)
        .count();
    assert!(old_segments > 0);

    let report = engine.drop_epochs_below(Epoch(3), &KeepDurable).unwrap();
    let expected = expected_after_drop(&model, 3);
    assert_matches(&engine, &expected, "after the drop");
    let dropped = model.len() - expected.len();
    assert_eq!(report.entries_dropped as usize, dropped, "{report:?}");
    assert_eq!(
        report.entries_relocated, 0,
        "a drop copies no value: {report:?}"
    );
    let left: Vec<_> = engine
        .segment_usage()
        .unwrap()
        .into_iter()
        .filter(|s| s.epoch.0 < 3)
        .collect();
    assert_eq!(
        report.segments_deleted as usize + left.len(),
        old_segments,
        "{report:?}"
    );
    assert!(
        left.iter().all(|s| s.live_bytes > 0),
        "every epoch-1/2 segment left holds a kept entry: {left:?}"
    );
    // What the kept entries share is left to relocation (here run by
    // hand: background relocation is off).
    engine
        .relocate(Strategy::Wal {
            segments: left.len(),
        })
        .unwrap();
    assert!(
        engine
            .segment_usage()
            .unwrap()
            .iter()
            .all(|s| s.epoch.0 >= 3),
        "no segment of epochs 1-2 is left"
    );
    assert_matches(&engine, &expected, "after relocation");

    // Nothing comes back, and the kept keys stay, across a crash.
    drop(engine);
    let engine = open(&storage.restart_process(), &config).unwrap();
    assert_matches(&engine, &expected, "after reopening");
    // A later drop asks the filter again: durable keys stay for good.
    engine.advance_epoch(Epoch(6)).unwrap();
    engine.drop_epochs_below(Epoch(6), &KeepDurable).unwrap();
    let expected = expected_after_drop(&expected, 6);
    assert_matches(&engine, &expected, "after the second drop");
    assert!(expected.values().all(|(_, _, tag)| *tag == DURABLE));
}

#[test]
fn replicas_with_different_layouts_agree_after_a_drop() {
    let (a_storage, _) = fault_storage();
    let (b_storage, _) = fault_storage();
    let a = open(&a_storage, &config(64 << 10)).unwrap();
    let b = open(&b_storage, &config(128 << 10)).unwrap();
    let model_a = run(&a, false);
    let model_b = run(&b, true); // extra relocation passes move b's data around
    assert_eq!(model_a, model_b);
    let report_a = a.drop_epochs_below(Epoch(3), &KeepDurable).unwrap();
    let report_b = b.drop_epochs_below(Epoch(3), &KeepDurable).unwrap();
    assert_eq!(report_a.entries_dropped, report_b.entries_dropped);
    let expected = expected_after_drop(&model_a, 3);
    assert_matches(&a, &expected, "replica a");
    assert_matches(&b, &expected, "replica b");
}

/// Background relocation reclaims, with no write after the drop, the old
/// segments the drop left because they hold kept entries beside dropped
/// ones (7 of 8 entries dropped: far above the garbage threshold). The
/// drop asks for a census: its garbage comes with no write, and passes
/// otherwise wait for new writes.
#[test]
fn background_relocation_reclaims_the_segments_a_drop_leaves() {
    let (storage, _) = fault_storage();
    let mut config = config(64 << 10);
    config.relocation_enabled = true;
    config.relocation_interval_ms = 20;
    // Each epoch's segment is padded when the next one starts (about 65%
    // of it garbage before the drop, 95% after it): relocate only what the
    // drop empties.
    config.relocation_garbage_ratio = 0.9;
    config.relocation_pressure_free_bytes = 0;
    let engine = open(&storage, &config).unwrap();
    let model = run(&engine, false);
    // Let background passes take their census of everything written, so
    // that no write is pending a census when the drop comes.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let report = engine.drop_epochs_below(Epoch(3), &KeepDurable).unwrap();
    let left = |engine: &Engine| {
        (engine.segment_usage().unwrap().iter())
            .filter(|s| s.epoch.0 < 3)
            .count()
    };
    assert!(
        left(&engine) > 0,
        "the drop left shared segments: {report:?}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while left(&engine) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} epoch-1/2 segments still there after 20 s",
            left(&engine)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_matches(&engine, &expected_after_drop(&model, 3), "after relocation");
}

/// Drops everything.
struct DropAll;

impl RelocationFilter for DropAll {
    fn decide(&self, _: &EntryInfo<'_>) -> Decision {
        Decision::Drop
    }
}

/// A drop whose expired entries all live in segments of later epochs
/// (relocation copied them forward, keeping their epoch) deletes no
/// segment itself: it still asks for a census, so background relocation
/// reclaims the garbage it made with no write after it. Before, it asked
/// only when it kept segments of the dropped epochs, and an idle engine
/// kept that garbage until something was written.
#[test]
fn a_drop_of_entries_copied_forward_gets_them_reclaimed_without_a_write() {
    let (storage, _) = fault_storage();
    let mut config = config(64 << 10);
    config.relocation_enabled = true;
    config.relocation_interval_ms = 20;
    config.relocation_garbage_ratio = 0.9;
    config.relocation_pressure_free_bytes = 0;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let put = |k: u64, len: usize| {
        engine
            .put(ks, &key(k), &value(k, 1, len), Durability::Buffered)
            .unwrap();
    };
    // Epochs 1 and 2: about two segments of values.
    for epoch in 1..=2u32 {
        if epoch > 1 {
            engine.advance_epoch(Epoch(epoch)).unwrap();
        }
        for i in 0..80u64 {
            put(u64::from(epoch) * 1_000 + i, 700);
        }
    }
    // Epoch 3: everything so far copied forward into epoch-3 segments
    // (their old segments deleted), then enough new writes that those are
    // sealed.
    engine.advance_epoch(Epoch(3)).unwrap();
    let at = engine
        .put(ks, &key(3_000), &value(3_000, 1, 100), Durability::Buffered)
        .unwrap();
    let report = engine.relocate(Strategy::Index { below: at }).unwrap();
    assert!(report.entries_relocated >= 160, "{report:?}");
    for i in 1..200u64 {
        put(3_000 + i, 700);
    }
    let forward = |engine: &Engine| {
        engine
            .segment_usage()
            .unwrap()
            .iter()
            .filter(|s| s.epoch.0 == 3 && s.sealed)
            .map(|s| s.segment)
            .collect::<Vec<_>>()
    };
    let before = forward(&engine);
    assert!(!before.is_empty());
    assert!(
        engine
            .segment_usage()
            .unwrap()
            .iter()
            .all(|s| s.epoch.0 >= 3),
        "relocation emptied the epoch-1/2 segments"
    );
    // Let background passes take their census of everything written.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let report = engine.drop_epochs_below(Epoch(3), &DropAll).unwrap();
    assert_eq!(report.entries_dropped, 160, "{report:?}");
    assert_eq!(report.segments_deleted, 0, "{report:?}");
    // The segments that held the copies are garbage now: gone without a
    // write. (`segment_usage` counts, but sets no census due.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let now = forward(&engine);
        if before.iter().any(|s| !now.contains(s)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "segments {now:?} all still there 20 s after the drop"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for i in 0..200u64 {
        assert!(engine.get(ks, &key(3_000 + i)).unwrap().is_some());
    }
    assert!(engine.get(ks, &key(1_000)).unwrap().is_none());
}

#[test]
fn the_current_epoch_cannot_be_dropped() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    assert!(engine.drop_epochs_below(Epoch(2), &KeepDurable).is_err());
    assert!(engine.advance_epoch(Epoch(1)).is_err(), "epochs only grow");
}

/// Drops every entry it is asked about, but first touches the one key it
/// is given: the touch lands between the drop's decision and its removal
/// of the entry, as a touch on another thread can.
struct TouchThenDrop<'a> {
    engine: &'a Engine,
    key: Vec<u8>,
    touched: std::sync::atomic::AtomicBool,
}

impl RelocationFilter for TouchThenDrop<'_> {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        if entry.key == &self.key[..]
            && !self.touched.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            let ks = self.engine.key_space("default").unwrap();
            assert!(
                self.engine
                    .touch(ks, &self.key, Durability::Buffered)
                    .unwrap()
            );
        }
        Decision::Drop
    }
}

/// A key touched while an epoch drop is deciding on it keeps its value: the
/// drop finds the entry changed and leaves it, and the segment it lives in
/// (an expired epoch's) is not deleted under it. Before, the segment was
/// deleted and every read of the key failed as corrupt.
#[test]
fn a_touch_racing_an_epoch_drop_keeps_the_segment_it_lives_in() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    for epoch in 1..=3u32 {
        if epoch > 1 {
            engine.advance_epoch(Epoch(epoch)).unwrap();
        }
        for i in 0..40u64 {
            let k = u64::from(epoch) * 100 + i;
            engine
                .put(ks, &key(k), &value(k, 1, 900), Durability::Buffered)
                .unwrap();
        }
    }
    let touched = 105u64;
    let filter = TouchThenDrop {
        engine: &engine,
        key: key(touched).to_vec(),
        touched: Default::default(),
    };
    let report = engine.drop_epochs_below(Epoch(3), &filter).unwrap();
    println!("{report:?}");
    assert!(report.entries_dropped > 0);
    assert_eq!(
        engine.get(ks, &key(touched)).unwrap().as_deref(),
        Some(&value(touched, 1, 900)[..]),
        "the touched key reads back"
    );
    // Dropped: the other keys of epochs 1 and 2; kept: epoch 3's.
    assert_eq!(engine.get(ks, &key(106)).unwrap(), None);
    assert!(engine.get(ks, &key(300)).unwrap().is_some());
}
