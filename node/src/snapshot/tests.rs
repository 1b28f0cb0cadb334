//! Receiving snapshot files: resumption, and every kind of bad input.

use std::sync::Arc;

use raft::eraftpb::ConfState;
use tidepool_engine::Durability;
use tidepool_engine::storage::FaultStorage;
use tidepool_proto::v1::NodeAddress;

use super::*;
use crate::replica::BLOB_KEY_SPACE;
use crate::sim::replica_store;
use crate::store::ReplicaStore;

fn prepared() -> Arc<Prepared> {
    let prepared = unhashed();
    prepared.hash();
    prepared
}

fn unhashed() -> Arc<Prepared> {
    unhashed_with(300)
}

/// A checkpoint of an engine holding `values` values of 3,000 bytes.
fn unhashed_with(values: u32) -> Arc<Prepared> {
    let store = replica_store(&FaultStorage::default());
    let engine = store.open_live().unwrap();
    let space = engine.key_space(BLOB_KEY_SPACE).unwrap();
    for i in 0..values {
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(&i.to_be_bytes());
        engine
            .put(space, &key, &vec![i as u8; 3_000], Durability::Buffered)
            .unwrap();
    }
    let checkpoint = engine.checkpoint().unwrap();
    Arc::new(Prepared::new(
        7,
        42,
        3,
        ConfState::default(),
        NodeAddress::default(),
        checkpoint,
    ))
}

/// A replica's store as a replica receiving a snapshot has it: with its
/// directory (the open replica's engine made it).
fn receiving_store(disk: &FaultStorage) -> ReplicaStore {
    let store = replica_store(disk);
    tidepool_engine::storage::Storage::create_dir_all(disk, store.dir()).unwrap();
    store
}

fn manifest(prepared: &Prepared) -> SnapshotManifest {
    manifest_of(&prepared.raft_snapshot().unwrap().unwrap()).unwrap()
}

#[test]
fn a_broken_stream_resumes_where_it_stopped() {
    let prepared = prepared();
    let manifest = manifest(&prepared);
    assert!(manifest.files.len() > 3, "{manifest:?}");
    let store = receiving_store(&FaultStorage::default());
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    let mut streams = 0;
    while !receiver.is_complete() {
        streams += 1;
        let (file, offset) = receiver.resume_point();
        // Each stream carries two chunks, then breaks.
        for chunk in prepared.chunks(2, file, offset).take(2) {
            let chunk = chunk.unwrap();
            let before = receiver.received_bytes();
            receiver.accept(&chunk).unwrap();
            // What the coordinator tells progress by.
            assert_eq!(receiver.received_bytes(), before + chunk.data.len() as u64);
        }
    }
    assert!(streams > 2);
    let total: u64 = manifest.files.iter().map(|f| f.size).sum();
    assert_eq!(receiver.received_bytes(), total);
    assert_eq!(receiver.finish().unwrap(), manifest.snapshot_id);
    assert_eq!(store.spare_snapshot().unwrap(), Some(manifest.snapshot_id));
    assert!(prepared.pulls(2) > 0);
    // The received engine holds the data.
    let engine = store.open_spare().unwrap();
    let space = engine.key_space(BLOB_KEY_SPACE).unwrap();
    let mut key = [0u8; 32];
    key[..4].copy_from_slice(&299u32.to_be_bytes());
    assert_eq!(engine.get(space, &key).unwrap().unwrap().len(), 3_000);
}

/// A slot emptied under a transfer (defence in depth: a reopening replica
/// did that) is never marked complete.
#[test]
fn a_file_removed_from_the_slot_during_the_transfer_fails_it() {
    let prepared = prepared();
    let manifest = manifest(&prepared);
    let disk = FaultStorage::default();
    let store = receiving_store(&disk);
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    for chunk in prepared.chunks(1, 0, 0) {
        receiver.accept(&chunk.unwrap()).unwrap();
    }
    assert!(receiver.is_complete());
    let first = store.spare_dir().unwrap().join(&manifest.files[0].path);
    tidepool_engine::storage::Storage::remove(&disk, &first).unwrap();
    let finished = receiver.finish();
    assert!(
        matches!(&finished, Err(NodeError::Failed(m)) if m.contains("left the spare slot")),
        "{finished:?}"
    );
    assert_eq!(store.spare_snapshot().unwrap(), None);
}

/// A replica stops and its directory is deleted while a transfer into it
/// is stuck (`ShardHandle::stop` waits only so long): the transfer's later
/// files fail, and nothing makes the deleted directory again.
#[test]
fn a_transfer_outliving_its_deleted_replica_makes_nothing_again() {
    let prepared = prepared();
    let manifest = manifest(&prepared);
    let root = tempfile::tempdir().unwrap();
    let replica = root.path().join("shards").join("7");
    let storage: Arc<dyn tidepool_engine::storage::Storage> =
        Arc::new(tidepool_engine::storage::FileStorage::new());
    std::fs::create_dir_all(&replica).unwrap();
    let store = ReplicaStore::new(storage, &replica, crate::sim::engine_config());
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    let mut chunks = prepared.chunks(1, 0, 0);
    // The first file, and into the second.
    while receiver.resume_point().0 == 0 {
        receiver.accept(&chunks.next().unwrap().unwrap()).unwrap();
    }
    // The replica is closed and deleted (`Node::close_replica`).
    std::fs::remove_dir_all(&replica).unwrap();
    let mut failed = None;
    for chunk in chunks {
        if let Err(error) = receiver.accept(&chunk.unwrap()) {
            failed = Some(error);
            break;
        }
    }
    let failed = failed.expect("a later file fails");
    assert!(failed.to_string().contains("No such file"), "{failed}");
    assert!(
        !replica.exists(),
        "the deleted replica's directory was made again"
    );
    // Nor can a transfer begin into a deleted replica.
    assert!(Receiver::start(manifest, &store).is_err());
    assert!(!replica.exists());
}

#[test]
fn damaged_or_misplaced_chunks_are_refused_and_nothing_is_marked_complete() {
    let prepared = prepared();
    let manifest = manifest(&prepared);
    let disk = FaultStorage::default();
    let store = receiving_store(&disk);

    // A chunk whose bytes changed in flight.
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    let mut chunk = prepared.chunk(1, 0, 0).unwrap();
    let mut data = chunk.data.to_vec();
    data[10] ^= 1;
    chunk.data = data;
    assert!(receiver.accept(&chunk).is_err(), "CRC mismatch accepted");

    // A chunk that does not continue where the receiver is.
    let ahead = prepared.chunk(1, 1, 0).unwrap();
    assert!(
        receiver.accept(&ahead).is_err(),
        "out-of-order chunk accepted"
    );

    // A file whose digest does not match: CRCs fine, content not the
    // manifest's.
    let mut wrong = manifest.clone();
    wrong.files[0].sha256 = vec![0; 32];
    let mut receiver = Receiver::start(wrong, &store).unwrap();
    let mut failed = false;
    for chunk in prepared.chunks(1, 0, 0) {
        if receiver.accept(&chunk.unwrap()).is_err() {
            failed = true;
            break;
        }
    }
    assert!(failed, "a file with the wrong SHA-256 was accepted");
    assert!(receiver.finish().is_err());
    assert_eq!(store.spare_snapshot().unwrap(), None);

    // Paths that leave the replica directory, and impossible sizes.
    for path in ["../escape", "/etc/passwd", "wal/../../x", ""] {
        let mut bad = manifest.clone();
        bad.files[0].path = path.into();
        assert!(
            Receiver::start(bad, &store).is_err(),
            "path {path:?} accepted"
        );
    }
    let mut bad = manifest.clone();
    bad.files[0].file_size = bad.files[0].size - 1;
    assert!(Receiver::start(bad, &store).is_err());
    // A manifest asking for more than the disk holds, files longer than
    // any engine makes, or sizes that wrap: refused before anything is
    // created.
    disk.set_capacity_bytes(Some(1 << 40));
    for (size, file_size) in [
        (1 << 40, 1 << 40),
        (1, receive::MAX_SNAPSHOT_FILE_BYTES + 1),
        (u64::MAX / 2 + 1, u64::MAX / 2 + 1),
    ] {
        let mut bad = manifest.clone();
        for file in &mut bad.files[..2] {
            file.size = size;
            file.file_size = file_size;
        }
        let error = Receiver::start(bad, &store).unwrap_err().to_string();
        assert!(
            error.contains("fit") || error.contains("at most") || error.contains("overflow"),
            "{error}"
        );
    }
    // The same cap, met exactly, is accepted.
    let mut big = manifest.clone();
    big.files[0].file_size = receive::MAX_SNAPSHOT_FILE_BYTES;
    assert!(receive::check_bounds(&big, &store).is_ok());
    let mut bad = manifest.clone();
    let one = bad.files[0].clone();
    bad.files = vec![one; receive::MAX_SNAPSHOT_FILES + 1];
    assert!(Receiver::start(bad, &store).is_err());
}

#[test]
fn idle_snapshots_leave_the_outbox_and_release_their_checkpoint() {
    let outbox = Outbox::default();
    let prepared = unhashed();
    outbox.insert(prepared.clone());
    // Not hashed yet: kept however idle.
    assert_eq!(outbox.expire_idle(std::time::Duration::ZERO), 0);
    prepared.hash();
    assert_eq!(outbox.expire_idle(std::time::Duration::from_secs(60)), 0);
    assert!(outbox.get(7, prepared.id).is_some());
    assert_eq!(outbox.expire_idle(std::time::Duration::ZERO), 1);
    assert!(outbox.get(7, prepared.id).is_none());
    // The outbox held the only other reference: the checkpoint goes with
    // this one.
    assert_eq!(Arc::strong_count(&prepared), 1);
}

#[test]
fn a_received_snapshot_reserves_the_bytes_it_copied_not_whole_segments() {
    // The manifest sends each WAL segment up to its synced end; the rest
    // of the segment is zeros. The receiver keeps that rest a hole (as the
    // sender's sparse segment is), so a replica made by a snapshot costs
    // the disk its data, not its segments' full length.
    let prepared = unhashed_with(20);
    prepared.hash();
    let manifest = manifest(&prepared);
    let copied: u64 = manifest.files.iter().map(|f| f.size).sum();
    let whole: u64 = manifest.files.iter().map(|f| f.file_size).sum();
    assert!(
        whole > copied * 2,
        "the test needs segments mostly unwritten: {copied} of {whole} bytes"
    );
    let disk = FaultStorage::default();
    let store = receiving_store(&disk);
    let before = disk.used_bytes();
    let pages = manifest.files.len() as u64 * 4096;
    // A disk with room for the copied bytes but not the whole files: the
    // snapshot is accepted (it was refused when the check summed lengths).
    disk.set_capacity_bytes(Some(before + copied + pages));
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    for chunk in prepared.chunks(3, 0, 0) {
        receiver.accept(&chunk.unwrap()).unwrap();
    }
    assert_eq!(receiver.finish().unwrap(), manifest.snapshot_id);
    disk.set_capacity_bytes(None);
    let used = disk.used_bytes() - before;
    eprintln!("received {copied} bytes of {whole}: {used} bytes reserved");
    assert!(
        used <= copied + pages,
        "{used} bytes reserved for {copied} copied ({whole} in whole files)"
    );
    // And it opens and reads like any engine.
    let engine = store.open_spare().unwrap();
    let space = engine.key_space(BLOB_KEY_SPACE).unwrap();
    let mut key = [0u8; 32];
    key[..4].copy_from_slice(&7u32.to_be_bytes());
    assert_eq!(engine.get(space, &key).unwrap().unwrap(), vec![7u8; 3_000]);
    // Writes go on past what was copied: the engine reserves as it goes
    // (the fault storage fails a sync of any byte past the reserved end).
    for i in 300..600u32 {
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(&i.to_be_bytes());
        engine
            .put(space, &key, &vec![i as u8; 3_000], Durability::Synced)
            .unwrap();
    }
}

/// A follower pulling an older snapshot after a newer one was prepared
/// (for a learner added meanwhile) is seen making progress: its pulls of
/// every offered snapshot count, not only the newest's. Before, the leader
/// saw none, gave the transfer up as idle and sent yet another snapshot.
#[test]
fn pulls_of_an_older_offered_snapshot_count() {
    let outbox = Outbox::default();
    let older = prepared();
    let newer = prepared();
    assert_ne!(older.id, newer.id);
    outbox.insert(older.clone());
    outbox.insert(newer.clone());
    assert_eq!(outbox.pulls(7, 2), 0);
    older.chunk(2, 0, 0).unwrap();
    older.chunk(2, 0, 0).unwrap();
    newer.chunk(3, 0, 0).unwrap();
    assert_eq!(outbox.pulls(7, 2), 2);
    assert_eq!(outbox.pulls(7, 3), 1);
    assert_eq!(outbox.pulls(8, 2), 0, "another shard's");
}

/// A slot still holding an earlier transfer's files (one cut off, or a
/// snapshot never installed) does not count against the next: the free
/// space is asked once the slot is emptied. Before, a volume with less
/// free than twice a snapshot refused every later transfer of it, and the
/// follower never caught up.
#[test]
fn leftovers_in_the_spare_slot_do_not_count_against_the_next_snapshot() {
    let prepared = prepared();
    let manifest = manifest(&prepared);
    let copied: u64 = manifest.files.iter().map(|f| f.size).sum();
    let disk = FaultStorage::default();
    let store = receiving_store(&disk);
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    for chunk in prepared.chunks(3, 0, 0) {
        receiver.accept(&chunk.unwrap()).unwrap();
    }
    assert_eq!(receiver.finish().unwrap(), manifest.snapshot_id);
    // Room for half the snapshot beside the leftovers: all of it once
    // they are gone.
    disk.set_capacity_bytes(Some(disk.used_bytes() + copied / 2));
    let mut receiver =
        Receiver::start(manifest.clone(), &store).expect("the leftovers' space counts as free");
    for chunk in prepared.chunks(3, 0, 0) {
        receiver.accept(&chunk.unwrap()).unwrap();
    }
    assert_eq!(receiver.finish().unwrap(), manifest.snapshot_id);
    // A snapshot that does not fit even then is still refused, before
    // any file is made.
    disk.set_capacity_bytes(Some(disk.used_bytes() - copied / 2));
    let error = Receiver::start(manifest, &store).unwrap_err().to_string();
    assert!(error.contains("does not fit"), "{error}");
}

/// A received slot without the engine's control file (a buggy or hostile
/// sender's manifest left it out) is not opened as an engine: opened, it
/// was an empty one, and the install claimed entries it had no data for.
#[test]
fn a_snapshot_without_its_control_file_is_not_opened() {
    let prepared = prepared();
    let mut manifest = manifest(&prepared);
    let control = manifest
        .files
        .iter()
        .position(|f| f.path == tidepool_engine::CONTROL_FILE)
        .expect("a checkpoint has a control file");
    manifest.files.truncate(control);
    let store = receiving_store(&FaultStorage::default());
    let mut receiver = Receiver::start(manifest.clone(), &store).unwrap();
    for chunk in prepared.chunks(3, 0, 0) {
        let chunk = chunk.unwrap();
        if receiver.is_complete() {
            break;
        }
        receiver.accept(&chunk).unwrap();
    }
    assert_eq!(receiver.finish().unwrap(), manifest.snapshot_id);
    let error = store.open_spare().map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("holds no engine"), "{error}");
}

/// A manifest may name only the engine's own files, each once: the slot is
/// emptied of those alone, so a peer's other names stayed for good (and a
/// name repeated, or left from an earlier transfer, failed every later
/// transfer as existing). Traversal out of the slot was refused before.
#[test]
fn a_manifest_naming_anything_but_engine_files_or_a_file_twice_is_refused() {
    let prepared = prepared();
    let good = manifest(&prepared);
    let store = receiving_store(&FaultStorage::default());
    assert!(Receiver::start(good.clone(), &store).is_ok());
    let wal = good
        .files
        .iter()
        .find(|f| f.path.starts_with("wal/"))
        .expect("a checkpoint has WAL segments")
        .clone();
    for path in [
        "junk",
        "wal/junk",
        "index/0000000000000001.wal",
        "control.tmp",
        "wal/x/0000000000000001.wal",
        "../control",
    ] {
        let mut bad = good.clone();
        bad.files[0].path = path.into();
        let error = Receiver::start(bad, &store).map(|_| ()).unwrap_err();
        assert!(
            error.to_string().contains("snapshot file"),
            "{path}: {error}"
        );
    }
    let mut twice = good.clone();
    twice.files.push(wal);
    let error = Receiver::start(twice, &store).map(|_| ()).unwrap_err();
    assert!(error.to_string().contains("named twice"), "{error}");
}
