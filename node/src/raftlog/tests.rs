//! The Raft log on an engine over the fault-injecting storage.

use std::sync::Arc;

use raft::eraftpb::{ConfState, Entry, EntryType, HardState};
use raft::{GetEntriesContext, Storage};
use tidepool_engine::storage::{FaultStorage, Storage as EngineStorage};
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpace, KeySpaceConfig};

use super::RaftLog;
use crate::command::{Command, WriteOp};

fn config() -> Config {
    let mut config = Config::for_tests("/replica");
    // As a node opens its replicas' engines.
    config.retain_log_until_set = true;
    config.key_spaces = vec![KeySpaceConfig {
        name: "blobs".into(),
        key_bytes: 32,
        layout: CellLayout::Uniform { cells: 16 },
    }];
    config
}

fn engine(storage: &FaultStorage) -> Arc<Engine> {
    let storage: Arc<dyn EngineStorage> = Arc::new(storage.clone());
    Arc::new(Engine::open_with_storage(config(), storage).unwrap())
}

fn write_entry(index: u64, term: u64, values: usize) -> Entry {
    let ops = (0..values)
        .map(|i| WriteOp {
            value: Some(vec![(index + i as u64) as u8; 200 + i * 50]),
            namespace: 1,
            epoch: 1,
            key: [(index as u8).wrapping_mul(31).wrapping_add(i as u8); 32],
            name: Vec::new(),
            session: None,
            if_absent: false,
        })
        .collect();
    Entry {
        entry_type: EntryType::EntryNormal as i32,
        index,
        term,
        data: Command::Write(ops).encode(),
        ..Entry::default()
    }
}

fn all(log: &RaftLog) -> Vec<Entry> {
    log.entries(
        log.first(),
        log.last() + 1,
        None,
        GetEntriesContext::empty(false),
    )
    .unwrap()
}

/// Compares logs by (index, term, data digest) so failures print briefly.
fn summary(entries: &[Entry]) -> Vec<(u64, u64, usize, u64)> {
    entries
        .iter()
        .map(|e| {
            (
                e.index,
                e.term,
                e.data.len(),
                e.data
                    .iter()
                    .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(*b))),
            )
        })
        .collect()
}

#[test]
fn entries_and_state_survive_a_restart() {
    let storage = FaultStorage::default();
    let mut log = RaftLog::open(engine(&storage), KeySpace::default(), &[1, 2, 3]).unwrap();
    assert_eq!(
        log.initial_state().unwrap().conf_state.voters,
        vec![1, 2, 3]
    );
    // A founded log starts after the founding configuration.
    assert_eq!((log.first(), log.last(), log.applied()), (2, 1, 1));
    assert_eq!(log.term(1).unwrap(), 1);
    let mut written = vec![Entry {
        entry_type: EntryType::EntryNormal as i32,
        index: 2,
        term: 1,
        ..Entry::default()
    }];
    written.extend((3..=20).map(|i| write_entry(i, 1, (i % 4) as usize)));
    written.push(Entry {
        entry_type: EntryType::EntryConfChangeV2 as i32,
        index: 21,
        term: 1,
        data: b"opaque conf change".to_vec(),
        ..Entry::default()
    });
    let end = log.append(&written).unwrap();
    let hs = HardState {
        term: 1,
        vote: 1,
        commit: 15,
    };
    let state_end = log.set_state(Some(&hs), None).unwrap();
    log.wait(end.max(state_end), Durability::Synced).unwrap();
    assert_eq!(summary(&all(&log)), summary(&written));
    assert_eq!(
        (log.first_index().unwrap(), log.last_index().unwrap()),
        (2, 21)
    );
    assert!(log.term(0).is_err(), "before the founding snapshot");
    assert!(log.term(22).is_err());
    let limited = log
        .entries(3, 21, 1_000, GetEntriesContext::empty(false))
        .unwrap();
    assert!(
        !limited.is_empty() && limited.len() < 19,
        "max_size limits the batch"
    );
    drop(log);

    // A crash of the process: the page cache survives.
    let log = RaftLog::open(engine(&storage.restart_process()), KeySpace::default(), &[]).unwrap();
    assert_eq!(summary(&all(&log)), summary(&written));
    assert_eq!(log.hard_state(), &hs);
    assert_eq!(log.conf_state().voters, vec![1, 2, 3]);
    // Power loss after the sync: everything was synced.
    let log = RaftLog::open(engine(&storage.reboot(3)), KeySpace::default(), &[]).unwrap();
    assert_eq!(summary(&all(&log)), summary(&written));
    assert_eq!(log.hard_state(), &hs);
}

#[test]
fn a_new_leader_overwrites_the_tail() {
    let storage = FaultStorage::default();
    let mut log = RaftLog::open(engine(&storage), KeySpace::default(), &[1]).unwrap();
    let old: Vec<Entry> = (2..=11).map(|i| write_entry(i, 1, 1)).collect();
    log.append(&old).unwrap();
    let new: Vec<Entry> = (7..=9).map(|i| write_entry(i, 2, 2)).collect();
    let end = log.append(&new).unwrap();
    log.wait(end, Durability::Synced).unwrap();
    let expected: Vec<Entry> = old[..5]
        .iter()
        .cloned()
        .chain(new.iter().cloned())
        .collect();
    assert_eq!(summary(&all(&log)), summary(&expected));
    assert_eq!(log.last(), 9);
    drop(log);
    let log = RaftLog::open(engine(&storage.restart_process()), KeySpace::default(), &[]).unwrap();
    assert_eq!(
        summary(&all(&log)),
        summary(&expected),
        "the overwritten tail stays overwritten after a restart"
    );
}

#[test]
fn applied_index_and_conf_state_are_kept_in_the_engine_snapshot() {
    let storage = FaultStorage::default();
    let mut log = RaftLog::open(engine(&storage), KeySpace::default(), &[1]).unwrap();
    let end = log
        .append(&(2..=6).map(|i| write_entry(i, 1, 1)).collect::<Vec<_>>())
        .unwrap();
    let cs = ConfState {
        voters: vec![1, 2],
        learners: vec![3],
        ..ConfState::default()
    };
    log.set_state(None, Some((&cs, 9))).unwrap();
    log.wait(end, Durability::Synced).unwrap();
    log.set_applied(5);
    log.record_drop(7, 3);
    log.record_drop(7, 2); // an older bound never lowers it
    log.engine().flush().unwrap();
    log.engine().close().unwrap();
    drop(log);
    let log = RaftLog::open(engine(&storage), KeySpace::default(), &[]).unwrap();
    assert_eq!(log.applied(), 5);
    assert_eq!(log.drops().iter().collect::<Vec<_>>(), vec![(&7, &3)]);
    assert_eq!(log.conf_state(), &cs);
    assert_eq!(log.conf_index(), 9);
    assert_eq!(log.last(), 6);
}

/// Retentions recorded by retain entries persist with the application
/// state, an older map's never replaces a newer one's, and a group split
/// off starts with them. A state holding none is still written in the
/// version before retentions (a node of that version reads it: retain
/// entries are proposed only once every node reports the capability).
#[test]
fn retentions_persist_and_pass_to_a_split_off_group() {
    use super::Retained;
    let storage = FaultStorage::default();
    let mut log = RaftLog::open(engine(&storage), KeySpace::default(), &[1]).unwrap();
    log.set_applied(1);
    log.engine().flush().unwrap();
    let version = |log: &RaftLog| log.engine().app_state()[4];
    assert_eq!(version(&log), 5, "no retention held: the older version");
    let held = Retained {
        epochs: 3,
        map_version: 10,
    };
    assert!(log.record_retain(7, held));
    let older = Retained {
        epochs: 1,
        map_version: 9,
    };
    assert!(!log.record_retain(7, older), "an older map's retention");
    assert!(log.record_retain(
        8,
        Retained {
            epochs: 0,
            map_version: 4
        }
    ));
    log.engine().flush().unwrap();
    assert_eq!(version(&log), 6);
    let expected = vec![
        (7, held),
        (
            8,
            Retained {
                epochs: 0,
                map_version: 4,
            },
        ),
    ];
    let listed = |log: &RaftLog| {
        log.retained()
            .iter()
            .map(|(n, r)| (*n, *r))
            .collect::<Vec<_>>()
    };
    // A copy of the engine, as a split makes one for the group split off.
    let copy = FaultStorage::default();
    log.engine()
        .checkpoint()
        .unwrap()
        .materialize(&copy, std::path::Path::new("/replica"))
        .unwrap();
    log.engine().close().unwrap();
    drop(log);
    let log = RaftLog::open(engine(&storage), KeySpace::default(), &[]).unwrap();
    assert_eq!(listed(&log), expected, "after a restart");
    let child = RaftLog::split_child(engine(&copy), KeySpace::default(), &[1], (5, 9)).unwrap();
    assert_eq!(listed(&child), expected, "in the group split off");
    // Allowed drops: the epochs below `epoch + 1 - epochs`.
    assert!(held.allows_drop(2, 4) && !held.allows_drop(3, 4) && held.allows_drop(3, 5));
    assert!(
        !Retained {
            epochs: 0,
            map_version: 4
        }
        .allows_drop(1, u32::MAX)
    );
}

/// Regression (found by the cluster scenarios): relocation reclaimed
/// segments that still held entries of the log, and a restarted replica
/// found a gap. The log pins its segments with the engine's log retention.
#[test]
fn relocation_never_takes_segments_the_log_needs() {
    let storage = FaultStorage::default();
    let mut log = RaftLog::open(engine(&storage), KeySpace::default(), &[1]).unwrap();
    // The same keys over and over: every older value becomes garbage once
    // the newer entry is applied.
    let entries: Vec<Entry> = (2..=201).map(|i| write_entry(i, 1, 2)).collect();
    let end = log.append(&entries).unwrap();
    log.wait(end, Durability::Synced).unwrap();
    for i in 2..=201 {
        let appended = log.appended(i).unwrap();
        log.engine().apply(&appended).unwrap();
        log.set_applied(i);
    }
    let report = log
        .engine()
        .relocate(tidepool_engine::Strategy::Wal {
            segments: usize::MAX,
        })
        .unwrap();
    assert_eq!(report.segments_deleted, 0, "{report:?}");
    assert_eq!(summary(&all(&log)), summary(&entries));
    drop(log);
    let log = RaftLog::open(engine(&storage.restart_process()), KeySpace::default(), &[]).unwrap();
    assert_eq!(summary(&all(&log)), summary(&entries));
}

/// Regression (e2e soak, seed 1795939058492546219: a follower killed with
/// committed entries appended and not applied lost 64 acknowledged blobs).
/// A replica's engine opens, and starts its background relocation, before
/// the Raft log has read its records back and set the log retention; the
/// index refers to no appended-but-unapplied record, so a relocation pass
/// in between counted their segments as garbage and deleted them, and
/// applying the entries afterwards pointed the index at missing segments.
/// A node's engines keep every segment until the log sets its retention.
#[test]
fn entries_appended_and_not_applied_survive_relocation_before_the_log_reopens() {
    for retain in [true, false] {
        let storage = FaultStorage::default();
        let mut config = config();
        config.relocation_interval_ms = 10;
        config.relocation_bytes_per_sec = 0;
        config.retain_log_until_set = retain;
        let open = |storage: &FaultStorage| {
            let storage: Arc<dyn EngineStorage> = Arc::new(storage.clone());
            Arc::new(Engine::open_with_storage(config.clone(), storage).unwrap())
        };
        let mut log = RaftLog::open(open(&storage), KeySpace::default(), &[1]).unwrap();
        // Several segments (64 KiB each) of entries a follower appended
        // and had not applied when it was killed.
        let entries: Vec<Entry> = (2..=101).map(|i| write_entry(i, 1, 4)).collect();
        let end = log.append(&entries).unwrap();
        log.wait(end, Durability::Synced).unwrap();
        drop(log);
        let engine = open(&storage.restart_process());
        // The log's scan of a large WAL takes a while: relocation passes run
        // meanwhile (every 10 ms; without the setting, one deletes).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        std::thread::sleep(std::time::Duration::from_millis(400));
        while !retain
            && engine.metrics().counters.segments_deleted == 0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let mut log = RaftLog::open(engine, KeySpace::default(), &[]).unwrap();
        let mut applied = Ok(());
        for i in 2..=101 {
            applied = applied.and_then(|()| {
                let appended = log.appended(i)?;
                log.engine().apply(&appended)?;
                log.set_applied(i);
                Ok::<(), crate::NodeError>(())
            });
        }
        let readable = (2..=101u64).all(|i| {
            let key = [(i as u8).wrapping_mul(31); 32];
            matches!(log.engine().get(KeySpace::default(), &key), Ok(Some(_)))
        });
        if retain {
            applied.unwrap();
            assert!(readable, "every applied entry's value reads back");
        } else {
            // What the setting prevents: the segments went while nothing
            // referred to them.
            assert!(
                applied.is_err() || !readable,
                "without retention until the log reopens, relocation takes the unapplied entries"
            );
        }
    }
}

/// Regression (e2e `split_with_the_leader_killed`, kill -9 during a
/// split): a Ready's committed entries are applied before its hard state
/// (with the new commit index) is written, and an engine snapshot taken
/// between the two (a split's checkpoint, a background flush) saves an
/// applied index above the saved commit. A process killed right there
/// reopened with `applied > commit`, which raft-rs refuses with a panic.
/// Applied entries were committed: the log raises its commit index to
/// the applied one.
#[test]
fn a_commit_index_saved_behind_the_applied_index_is_raised_to_it() {
    let storage = FaultStorage::default();
    let mut log = RaftLog::open(engine(&storage), KeySpace::default(), &[1]).unwrap();
    let end = log
        .append(&(2..=6).map(|i| write_entry(i, 1, 1)).collect::<Vec<_>>())
        .unwrap();
    let hs = HardState {
        term: 1,
        vote: 1,
        commit: 3,
    };
    log.set_state(Some(&hs), None).unwrap();
    log.wait(end, Durability::Synced).unwrap();
    // The next Ready commits through 5 and applies it; the engine
    // snapshots; the process dies before the hard state is written.
    log.set_applied(5);
    log.engine().flush().unwrap();
    log.engine().close().unwrap();
    drop(log);
    let log = RaftLog::open(engine(&storage), KeySpace::default(), &[]).unwrap();
    assert_eq!(log.applied(), 5);
    assert_eq!(log.hard_state().commit, 5);
    assert_eq!((log.hard_state().term, log.hard_state().vote), (1, 1));
    let config = raft::Config {
        id: 1,
        applied: log.applied(),
        ..raft::Config::default()
    };
    let logger = slog::Logger::root(slog::Discard, slog::o!());
    let node = raft::RawNode::new(&config, log, &logger).expect("raft-rs starts on it");
    assert_eq!(node.raft.raft_log.committed, 5);
}
