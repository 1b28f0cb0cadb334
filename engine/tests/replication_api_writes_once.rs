//! The replication API: a record appended with `append` is durable but not
//! visible until `apply` points the index at it; applying writes no value
//! bytes again; `read_record` returns it whole; recovery does not apply it
//! by itself, so a replication layer re-applies committed records at or
//! after `recovered_replay_from`; the application state survives snapshots.

mod support;

use support::{fault_storage, key, open, value};
use tidepool_engine::{Durability, Epoch, ItemInput, ItemOp, Strategy, Tag, WalPosition};

#[test]
fn append_then_apply_without_rewriting_values() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let big = value(1, 1, 10_000);
    let items = [
        ItemInput {
            space: ks,
            op: ItemOp::Put,
            key: &key(1),
            value: &big,
            epoch: Epoch(3),
            tag: Tag(7),
        },
        ItemInput {
            space: ks,
            op: ItemOp::Put,
            key: &key(2),
            value: b"two",
            epoch: Epoch(3),
            tag: Tag(7),
        },
    ];
    let appended = engine.append(b"raft index 5, term 2", &items).unwrap();
    engine.wait_synced(appended.end).unwrap();
    assert_eq!(
        engine.get(ks, &key(1)).unwrap(),
        None,
        "appended but not applied: invisible"
    );

    let written_before = engine.metrics().counters.wal_bytes_written;
    engine.apply(&appended).unwrap();
    assert_eq!(engine.get(ks, &key(1)).unwrap().as_deref(), Some(&big[..]));
    assert_eq!(
        engine.get(ks, &key(2)).unwrap().as_deref(),
        Some(&b"two"[..])
    );
    assert_eq!(
        engine.metrics().counters.wal_bytes_written,
        written_before,
        "apply writes no value bytes"
    );
    engine.apply(&appended).unwrap(); // idempotent
    let stored = engine.get_stored(ks, &key(1)).unwrap().unwrap();
    assert_eq!(
        (stored.value.as_ref(), stored.epoch, stored.tag),
        (&big[..], Epoch(3), Tag(7)),
        "a stored value carries the epoch and tag its item was appended with"
    );
    assert_eq!(engine.epoch_of(ks, &key(1)).unwrap(), Some(Epoch(3)));
    assert_eq!(engine.epoch_of(ks, &key(99)).unwrap(), None);

    let record = engine.read_record(appended.position).unwrap();
    assert_eq!(record.meta, b"raft index 5, term 2");
    assert_eq!(record.items.len(), 2);
    assert_eq!(record.items[0].value, big);
    assert_eq!(
        (record.items[1].epoch, record.items[1].tag),
        (Epoch(3), Tag(7))
    );
    assert_eq!(record.appended, appended);

    // A delete through the same path, appended after the put: once applied,
    // the newer version wins even if applied twice in any order.
    let delete = engine
        .append(
            b"raft index 6",
            &[ItemInput {
                space: ks,
                op: ItemOp::Delete,
                key: &key(2),
                value: &[],
                epoch: Epoch(3),
                tag: Tag(7),
            }],
        )
        .unwrap();
    engine.apply(&delete).unwrap();
    engine.apply(&appended).unwrap();
    assert_eq!(engine.get(ks, &key(2)).unwrap(), None);
}

#[test]
fn recovery_leaves_appended_records_to_the_replication_layer() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    engine.set_app_state(b"hard state: term 4, commit 9");
    engine.flush().unwrap(); // snapshot with the app state
    let put = |k: u64| {
        let v = value(k, 1, 100);
        engine
            .append(
                b"entry",
                &[ItemInput {
                    space: ks,
                    op: ItemOp::Put,
                    key: &key(k),
                    value: &v,
                    epoch: Epoch(1),
                    tag: Tag(0),
                }],
            )
            .unwrap()
    };
    let committed = put(1);
    engine.apply(&committed).unwrap();
    let uncommitted = put(2);
    engine.wait_synced(uncommitted.end).unwrap();
    drop(engine); // crash before any snapshot covers the apply

    let engine = open(&storage.restart_process(), &config).unwrap();
    assert_eq!(engine.app_state(), b"hard state: term 4, commit 9");
    let replay_from = engine.recovered_replay_from();
    assert!(
        replay_from <= committed.position,
        "the apply happened after the snapshot"
    );
    assert_eq!(
        engine.get(ks, &key(2)).unwrap(),
        None,
        "recovery never applies appended records"
    );
    // The replication layer re-applies what it knows is committed.
    let record = engine.read_record(committed.position).unwrap();
    engine.apply(&record.appended).unwrap();
    assert_eq!(
        engine.get(ks, &key(1)).unwrap().as_deref(),
        Some(&value(1, 1, 100)[..])
    );
    assert!(
        engine.read_record(uncommitted.position).is_ok(),
        "the uncommitted record stays readable"
    );
}

#[test]
fn scan_appended_visits_only_appended_records_in_order() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let mut positions = Vec::new();
    for i in 0..30u64 {
        let v = value(i, 1, 3_000);
        let item = ItemInput {
            space: ks,
            op: ItemOp::Put,
            key: &key(i),
            value: &v,
            epoch: Epoch(1),
            tag: Tag(0),
        };
        let appended = engine
            .append(format!("entry {i}").as_bytes(), &[item])
            .unwrap();
        positions.push(appended.position);
        // Interleaved engine-applied writes are not visited.
        engine
            .put(
                ks,
                &key(1_000 + i),
                b"local",
                tidepool_engine::Durability::Buffered,
            )
            .unwrap();
    }
    engine.wait_synced(engine.processed_position()).unwrap();
    drop(engine);
    let engine = open(&storage.restart_process(), &config).unwrap();
    let mut seen = Vec::new();
    engine
        .scan_appended(positions[0], |position, meta, appended| {
            assert_eq!(appended.position, position);
            assert_eq!(appended.items.len(), 1);
            seen.push((position, String::from_utf8(meta.to_vec()).unwrap()));
            Ok(())
        })
        .unwrap();
    let expected: Vec<_> = positions
        .iter()
        .enumerate()
        .map(|(i, p)| (*p, format!("entry {i}")))
        .collect();
    assert_eq!(seen, expected);
}

/// A record from before the open applied again — as a replication layer
/// re-applies committed records from the snapshot's replay position, which
/// may lie before what a cell's index already holds — while the index
/// holds the key's relocated copy: the older entry sits in the cell's
/// unflushed changes (read first by lookups) while relocation's walk,
/// merging by version, counts the copy and reclaims the older segment.
/// The key must still read: reclaiming flushes first, and the flush keeps
/// the copy (the newer by location).
#[test]
fn an_item_applied_again_after_a_restart_does_not_hide_its_relocated_copy() {
    let (storage, mut config) = fault_storage();
    config.relocation_enabled = false; // explicit passes only
    config.snapshot_interval_ms = 3_600_000;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let kept = value(1, 1, 2_000);
    let appended = engine
        .append(
            b"raft entry",
            &[ItemInput {
                space: ks,
                op: ItemOp::Put,
                key: &key(1),
                value: &kept,
                epoch: Epoch(1),
                tag: Tag(0),
            }],
        )
        .unwrap();
    engine.wait_synced(appended.end).unwrap();
    engine.apply(&appended).unwrap();
    // More of the first segment (live for now), then enough to roll it.
    for k in 2..=12 {
        engine
            .put(ks, &key(k), &value(k, 0, 2_000), Durability::Buffered)
            .unwrap();
    }
    let segment = config.wal_segment_bytes;
    let first_end = WalPosition((appended.position.0 / segment + 1) * segment);
    let mut k = 100;
    while engine.processed_position() <= first_end {
        engine
            .put(ks, &key(k), &value(k, 0, 2_000), Durability::Buffered)
            .unwrap();
        k += 1;
    }
    // Key 1 alone is copied out; its segment stays (keys 2..=12 live).
    engine
        .relocate(Strategy::Index {
            below: appended.end,
        })
        .unwrap();
    engine.close().unwrap();
    drop(engine);

    let engine = open(&storage, &config).unwrap();
    // The replication layer applies the old record's item again.
    engine.apply_item(&appended.items[0]).unwrap();
    assert_eq!(engine.get(ks, &key(1)).unwrap().as_deref(), Some(&kept[..]));
    // The rest of the first segment goes; relocation reclaims it.
    for k in 2..=12 {
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
    }
    engine
        .relocate(Strategy::Index { below: first_end })
        .unwrap();
    assert_eq!(
        engine.get(ks, &key(1)).unwrap().as_deref(),
        Some(&kept[..]),
        "key 1 reads from its copy after its first segment was reclaimed"
    );
    engine.close().unwrap();
}

/// The same, with the stale entry written to disk: the record applied
/// again after a restart lands in a cell whose on-disk index is large
/// next to its changes, so the flush that precedes reclaiming writes a
/// delta. Lookups read a cell's on-disk layers newest first, so a delta
/// holding the older entry hid the relocated copy once the cell was read
/// from disk again (after a restart, or when its index did not fit in
/// memory): the key read as a record that is gone. A record applied again
/// must not replace a newer entry anywhere — in the changes, the loaded
/// index, or on disk.
#[test]
fn an_item_applied_again_never_reaches_disk_over_its_relocated_copy() {
    let (storage, mut config) = fault_storage();
    config.relocation_enabled = false; // explicit passes only
    config.snapshot_interval_ms = 3_600_000;
    // One cell: its on-disk index outweighs the changes, so flushes write
    // deltas.
    config.key_spaces[0].layout = tidepool_engine::CellLayout::Uniform { cells: 1 };
    config.index_merge_ratio = 4;
    config.index_max_deltas = 8;
    config.flush_dirty_entries = 10_000;
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let kept = value(1, 1, 2_000);
    let appended = engine
        .append(
            b"raft entry",
            &[ItemInput {
                space: ks,
                op: ItemOp::Put,
                key: &key(1),
                value: &kept,
                epoch: Epoch(1),
                tag: Tag(0),
            }],
        )
        .unwrap();
    engine.wait_synced(appended.end).unwrap();
    engine.apply(&appended).unwrap();
    for k in 2..=12 {
        engine
            .put(ks, &key(k), &value(k, 0, 2_000), Durability::Buffered)
            .unwrap();
    }
    let segment = config.wal_segment_bytes;
    let first_end = WalPosition((appended.position.0 / segment + 1) * segment);
    let mut k = 100;
    while engine.processed_position() <= first_end {
        engine
            .put(ks, &key(k), &value(k, 0, 2_000), Durability::Buffered)
            .unwrap();
        k += 1;
    }
    engine
        .relocate(Strategy::Index {
            below: appended.end,
        })
        .unwrap();
    engine.flush().unwrap();
    engine.close().unwrap();
    drop(engine);

    let engine = open(&storage, &config).unwrap();
    engine.apply_item(&appended.items[0]).unwrap();
    assert_eq!(engine.get(ks, &key(1)).unwrap().as_deref(), Some(&kept[..]));
    for k in 2..=12 {
        engine.delete(ks, &key(k), Durability::Buffered).unwrap();
    }
    engine
        .relocate(Strategy::Index { below: first_end })
        .unwrap();
    engine.flush().unwrap();
    assert!(
        engine.metrics().counters.delta_flushes > 0,
        "the flush wrote a delta"
    );
    engine.close().unwrap();
    drop(engine);

    // The cell is read from disk again, and does not fit in memory: the
    // lookup searches its blobs.
    config.index_memory_bytes = 256;
    let engine = open(&storage, &config).unwrap();
    assert_eq!(
        engine.get(ks, &key(1)).unwrap().as_deref(),
        Some(&kept[..]),
        "key 1 reads from its copy, its first segment reclaimed"
    );
    engine.close().unwrap();
}

/// A record appended before a restart and applied only after it, whose
/// key's prefix (in a prefixed key space) had no cell yet: applying makes
/// the cell. The comparison with the key's whole entry found no cell and
/// dropped the item — the write was never indexed.
#[test]
fn an_item_applied_after_a_restart_makes_its_prefix_cell() {
    let (storage, config) = fault_storage();
    let engine = open(&storage, &config).unwrap();
    let ks = engine.key_space("prefixed").unwrap();
    let key = support::prefixed_key(77, 1);
    let appended = engine
        .append(
            b"raft entry",
            &[ItemInput {
                space: ks,
                op: ItemOp::Put,
                key: &key,
                value: b"kept",
                epoch: Epoch(1),
                tag: Tag(0),
            }],
        )
        .unwrap();
    engine.wait_synced(appended.end).unwrap();
    engine.close().unwrap();
    drop(engine);

    let engine = open(&storage, &config).unwrap();
    assert_eq!(engine.get(ks, &key).unwrap(), None, "not applied yet");
    engine.apply(&appended).unwrap();
    assert_eq!(engine.get(ks, &key).unwrap().as_deref(), Some(&b"kept"[..]));
    engine.close().unwrap();
}

/// With `hold_replay_until_released`, a snapshot written after a restart
/// but before the application applied its records again (the engine's
/// background one, seconds after opening) keeps the replay position the
/// engine opened with: before, it found no unflushed change, recorded the
/// WAL's end, and a second crash left the record's index change out for
/// good (the application re-applies from `recovered_replay_from`).
#[test]
fn a_snapshot_before_the_records_are_applied_again_keeps_the_replay_position() {
    let (storage, mut config) = fault_storage();
    config.hold_replay_until_released = true;
    config.snapshot_interval_ms = 3_600_000;
    let engine = open(&storage, &config).unwrap();
    engine.release_replay_hold(); // a new engine: nothing to apply again
    let ks = engine.key_space("default").unwrap();
    engine.flush().unwrap();
    let v = value(1, 1, 300);
    let appended = engine
        .append(
            b"entry",
            &[ItemInput {
                space: ks,
                op: ItemOp::Put,
                key: &key(1),
                value: &v,
                epoch: Epoch(1),
                tag: Tag(0),
            }],
        )
        .unwrap();
    engine.wait_synced(appended.end).unwrap();
    engine.apply(&appended).unwrap();
    // Killed before the change was flushed.
    let next = storage.restart_process();
    drop(engine);
    let storage = next;
    let engine = open(&storage, &config).unwrap();
    assert!(engine.recovered_replay_from() <= appended.position);
    // A snapshot before the application applies anything again, then
    // killed again.
    engine.flush().unwrap();
    let next = storage.restart_process();
    drop(engine);
    let storage = next;
    let engine = open(&storage, &config).unwrap();
    assert!(
        engine.recovered_replay_from() <= appended.position,
        "the record is still to be applied again: replay from {:?}, record at {:?}",
        engine.recovered_replay_from(),
        appended.position
    );
    engine.apply(&appended).unwrap();
    engine.release_replay_hold();
    assert_eq!(engine.get(ks, &key(1)).unwrap().as_deref(), Some(&v[..]));
}
