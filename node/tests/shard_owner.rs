//! Three shard owners (real threads, real files) wired by an in-process
//! network: concurrent clients' puts are group-committed — many puts per
//! Raft entry — and every acknowledged put is on every replica; a
//! linearizable read after an acknowledged put sees it; a follower refuses
//! linearizable reads and names the leader; a follower whose disk fills
//! fails, reopens, catches up and keeps what it acknowledged; a follower
//! whose files are deleted under it stays failed and silent instead of
//! coming back empty.

use std::collections::BTreeMap;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use raft::eraftpb::Message;
use tidepool_engine::storage::FaultStorage;
use tidepool_node::entry_context::EntrySync;
use tidepool_node::replica::{BLOB_KEY_SPACE, Outcome, ReadOutcome, ReplicaConfig};
use tidepool_node::shard::{DriverConfig, Outgoing, ShardHandle};
use tidepool_node::sim::{engine_config, put_op, replica_store};
use tidepool_node::snapshot::Outbox;
use tidepool_node::store::ReplicaStore;

#[derive(Default)]
struct LocalNet {
    nodes: RwLock<BTreeMap<u64, Arc<ShardHandle>>>,
    /// Messages sent, by sender.
    sent: parking_lot::Mutex<BTreeMap<u64, u64>>,
}

impl Outgoing for LocalNet {
    fn send(&self, _shard: u32, message: Message) {
        *self.sent.lock().entry(message.from).or_default() += 1;
        if let Some(to) = self.nodes.read().get(&message.to) {
            to.step(message);
        }
    }
}

fn key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    k
}

fn put(handle: &ShardHandle, i: u64) -> Outcome {
    put_value(handle, i, format!("value {i}").into_bytes())
}

/// The leader once one is elected (within 5 s).
fn elected(net: &LocalNet) -> u64 {
    for _ in 0..500 {
        if let Some(id) = leader(&net.nodes.read()) {
            return id;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no leader was elected");
}

/// Writes `value` under `key(i)` through `handle`, waiting for the outcome.
fn put_value(handle: &ShardHandle, i: u64, value: Vec<u8>) -> Outcome {
    let (tx, rx) = mpsc::channel();
    handle.write(
        put_op(key(i), value),
        EntrySync::AsConfigured,
        Box::new(move |outcome| tx.send(outcome).unwrap()),
    );
    rx.recv_timeout(Duration::from_secs(20)).unwrap()
}

fn leader(nodes: &BTreeMap<u64, Arc<ShardHandle>>) -> Option<u64> {
    nodes
        .iter()
        .find_map(|(id, h)| h.state().status.filter(|s| s.is_leader).map(|_| *id))
}

#[test]
fn concurrent_puts_are_group_committed_and_replicated() {
    let root = tempfile::tempdir().unwrap();
    let net = Arc::new(LocalNet::default());
    let driver = DriverConfig {
        tick: Duration::from_millis(20),
        ..DriverConfig::default()
    };
    for id in 1..=3u64 {
        let config = ReplicaConfig::new(0, id);
        let store = ReplicaStore::on_files(root.path().join(format!("node-{id}")), engine_config());
        let handle = ShardHandle::start(
            config,
            driver.clone(),
            store,
            Arc::new(Outbox::default()),
            &[1, 2, 3],
            net.clone(),
        )
        .unwrap();
        net.nodes.write().insert(id, handle);
    }
    let nodes = net.nodes.read().clone();
    let mut leader_id = None;
    for _ in 0..500 {
        leader_id = leader(&nodes);
        if leader_id.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let leader_id = leader_id.expect("a leader is elected");
    let leader_handle = nodes[&leader_id].clone();
    let first_index = leader_handle.state().status.unwrap().last_index;

    const THREADS: u64 = 16;
    const PER_THREAD: u64 = 40;
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let handle = leader_handle.clone();
            std::thread::spawn(move || {
                for i in 0..PER_THREAD {
                    let outcome = put(&handle, t * 1_000 + i);
                    assert!(matches!(outcome, Outcome::Applied { .. }), "{outcome:?}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let writes = THREADS * PER_THREAD;
    let entries = leader_handle.state().status.unwrap().last_index - first_index;
    println!(
        "{writes} puts in {entries} entries ({:.1} puts per entry)",
        writes as f64 / entries as f64
    );
    assert!(
        entries < writes,
        "no group commit: {writes} puts took {entries} entries"
    );

    // A linearizable read on the leader sees the last acknowledged put.
    let (tx, rx) = mpsc::channel();
    leader_handle.read(Box::new(move |outcome| tx.send(outcome).unwrap()));
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        ReadOutcome::Ready
    );
    let engine = leader_handle.engine();
    let space = engine.key_space(BLOB_KEY_SPACE).unwrap();
    let last = (THREADS - 1) * 1_000 + PER_THREAD - 1;
    assert_eq!(
        engine.get(space, &key(last)).unwrap().as_deref(),
        Some(format!("value {last}").as_bytes())
    );
    // A follower refuses and names the leader.
    let follower = nodes.keys().find(|id| **id != leader_id).unwrap();
    let (tx, rx) = mpsc::channel();
    nodes[follower].read(Box::new(move |outcome| tx.send(outcome).unwrap()));
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        ReadOutcome::NotLeader { leader: leader_id }
    );

    // Every replica applies everything.
    let commit = leader_handle.state().status.unwrap().commit;
    for _ in 0..500 {
        if nodes
            .values()
            .all(|h| h.state().status.is_some_and(|s| s.applied >= commit))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for (id, handle) in &nodes {
        let engine = handle.engine();
        for t in 0..THREADS {
            for i in 0..PER_THREAD {
                let k = t * 1_000 + i;
                assert_eq!(
                    engine.get(space, &key(k)).unwrap().as_deref(),
                    Some(format!("value {k}").as_bytes()),
                    "node {id} key {k}"
                );
            }
        }
    }
    for handle in nodes.values() {
        handle.stop();
    }
}

/// Waits until every replica in `nodes` has applied the leader's commit
/// index; panics with `what` after 60 s.
fn wait_applied(nodes: &BTreeMap<u64, Arc<ShardHandle>>, leader_id: u64, what: &str) {
    for _ in 0..6_000 {
        let commit = nodes[&leader_id]
            .state()
            .status
            .map_or(u64::MAX, |s| s.commit);
        if nodes
            .values()
            .all(|h| h.state().status.is_some_and(|s| s.applied >= commit))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let states: Vec<_> = nodes.iter().map(|(id, h)| (id, h.state())).collect();
    panic!("{what}: replicas did not catch up: {states:#?}");
}

/// A follower's disk fills while the others keep acknowledging writes: its
/// replica fails and is reopened (again and again while the disk is full).
/// Space returns; it catches up; then its process restarts. Every
/// acknowledged write must be on it after the restart.
///
/// This once lost entries: the failed replica's engine (not poisoned by a
/// full disk) stayed alive beside the reopened one and its spare-segment
/// allocator and shutdown removed segment files the new engine was writing,
/// so the restart found a log that ended before what the follower had
/// acknowledged (raft-rs then panics: commit index beyond the last entry).
#[test]
fn a_follower_whose_disk_fills_keeps_what_it_acknowledged() {
    let net = Arc::new(LocalNet::default());
    let driver = DriverConfig {
        tick: Duration::from_millis(20),
        reopen_backoff: Duration::from_millis(300),
        ..DriverConfig::default()
    };
    let start = |id: u64, storage: &FaultStorage| {
        ShardHandle::start(
            ReplicaConfig::new(0, id),
            driver.clone(),
            replica_store(storage),
            Arc::new(Outbox::default()),
            &[1, 2, 3],
            net.clone(),
        )
        .unwrap()
    };
    let storages: BTreeMap<u64, FaultStorage> =
        (1..=3).map(|id| (id, FaultStorage::default())).collect();
    for (id, storage) in &storages {
        net.nodes.write().insert(*id, start(*id, storage));
    }
    let leader_id = elected(&net);
    let victim = leader_id % 3 + 1;
    let victim_storage = &storages[&victim];
    // Room for a few more 64 KiB segments, then the disk is full.
    victim_storage.set_capacity_bytes(Some(victim_storage.used_bytes() + (256 << 10)));

    let leader_handle = net.nodes.read()[&leader_id].clone();
    let value = |i: u64| format!("{i:>1000}").into_bytes();
    let put_value = |i: u64| put_value(&leader_handle, i, value(i));
    let victim_failed = || net.nodes.read()[&victim].state().failed.is_some();
    let mut acknowledged = Vec::new();
    // The replica fails, is reopened after its backoff and fails again at
    // its next append: it is sampled after every put, since at any one
    // moment it can be between a reopening and its next failure.
    let mut seen_failed = false;
    for i in 0..1_500u64 {
        if matches!(put_value(i), Outcome::Applied { .. }) {
            acknowledged.push(i);
        }
        seen_failed |= victim_failed();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen_failed && Instant::now() < deadline {
        seen_failed = victim_failed();
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        seen_failed,
        "the follower's disk filled up: {:#?}",
        net.nodes.read()[&victim].state()
    );
    assert!(acknowledged.len() > 1_000, "the majority went on writing");

    // Space returns; the follower catches up, writes go on meanwhile.
    victim_storage.set_capacity_bytes(None);
    for i in 1_500..1_700u64 {
        if matches!(put_value(i), Outcome::Applied { .. }) {
            acknowledged.push(i);
        }
    }
    wait_applied(&net.nodes.read(), leader_id, "after space returned");

    // The follower's process restarts from what it left on disk.
    let handle = net.nodes.write().remove(&victim).unwrap();
    handle.stop();
    drop(handle);
    let restarted = victim_storage.restart_process();
    net.nodes.write().insert(victim, start(victim, &restarted));
    for i in 1_700..1_800u64 {
        if matches!(put_value(i), Outcome::Applied { .. }) {
            acknowledged.push(i);
        }
    }
    wait_applied(&net.nodes.read(), leader_id, "after the restart");
    let engine = net.nodes.read()[&victim].engine();
    let space = engine.key_space(BLOB_KEY_SPACE).unwrap();
    for i in &acknowledged {
        assert_eq!(
            engine.get(space, &key(*i)).unwrap().as_deref(),
            Some(&value(*i)[..]),
            "key {i} on the restarted follower"
        );
    }
    for handle in net.nodes.read().values() {
        handle.stop();
    }
}

/// A failed replica is not reopened while a snapshot it received waits
/// for its install: the opening empties the spare slot the snapshot's
/// files are in, and the reopened replica then stepped a snapshot it had
/// no files for (stuck until the leader gave up on it). It reopens once
/// the snapshot is dealt with.
#[test]
fn a_failed_replica_is_not_reopened_under_a_received_snapshot() {
    let net = Arc::new(LocalNet::default());
    let driver = DriverConfig {
        tick: Duration::from_millis(20),
        reopen_backoff: Duration::from_millis(100),
        ..DriverConfig::default()
    };
    let storages: BTreeMap<u64, FaultStorage> =
        (1..=3).map(|id| (id, FaultStorage::default())).collect();
    for (id, storage) in &storages {
        let handle = ShardHandle::start(
            ReplicaConfig::new(0, *id),
            driver.clone(),
            replica_store(storage),
            Arc::new(Outbox::default()),
            &[1, 2, 3],
            net.clone(),
        )
        .unwrap();
        net.nodes.write().insert(*id, handle);
    }
    let leader_id = elected(&net);
    let victim = leader_id % 3 + 1;
    let victim_storage = &storages[&victim];
    victim_storage.set_capacity_bytes(Some(victim_storage.used_bytes() + (256 << 10)));
    let leader_handle = net.nodes.read()[&leader_id].clone();
    let victim_handle = net.nodes.read()[&victim].clone();
    let mut i = 0;
    while victim_handle.state().failed.is_none() {
        assert!(i < 5_000, "the follower's disk never filled");
        put_value(&leader_handle, i, format!("{i:>1000}").into_bytes());
        i += 1;
    }
    // A snapshot's files arrived (the transfer ended) and wait for the
    // owner to install them; space is back.
    let transfer = victim_handle
        .begin_snapshot()
        .expect("a transfer may start into a failed replica");
    drop(transfer);
    victim_storage.set_capacity_bytes(None);
    std::thread::sleep(Duration::from_millis(1_000));
    assert!(
        victim_handle.state().failed.is_some(),
        "reopened (emptying the spare slot) under a received snapshot"
    );
    // The snapshot dealt with: the replica reopens.
    victim_handle.abort_snapshot();
    let began = std::time::Instant::now();
    while victim_handle.state().failed.is_some() {
        assert!(began.elapsed() < Duration::from_secs(30), "never reopened");
        std::thread::sleep(Duration::from_millis(20));
    }
    for handle in net.nodes.read().values() {
        handle.stop();
    }
}

#[test]
fn a_full_queue_refuses_writes_as_overloaded() {
    // The queue is unbounded underneath (a bounded channel writes every
    // slot up front: 8 MiB per replica); `send` bounds it. With room for
    // no event, a write is refused at once, not queued.
    let root = tempfile::tempdir().unwrap();
    let driver = DriverConfig {
        queue: 0,
        ..DriverConfig::default()
    };
    let store = ReplicaStore::on_files(root.path().join("node-1"), engine_config());
    let handle = ShardHandle::start(
        ReplicaConfig::new(0, 1),
        driver,
        store,
        Arc::new(Outbox::default()),
        &[1],
        Arc::new(LocalNet::default()),
    )
    .unwrap();
    assert!(matches!(put(&handle, 1), Outcome::Overloaded));
    handle.stop();
}

/// A follower's replica directory is deleted while it runs (an operator's
/// `rm -rf`, or a volume unmounted under it). Its replica fails when it
/// next needs a new file; reopening it must not create an empty replica in
/// its place: with its node id still a voter of the group and its log and
/// vote forgotten, such a replica grants its vote to any candidate, and a
/// candidate missing committed entries could win with it (Raft's safety
/// rests on voters remembering what they acknowledged). It stays failed,
/// says why, sends nothing and leaves no engine files behind; the other two
/// go on acknowledging writes. Before the check, the replica was reopened
/// at once, empty, at term 0, in a re-created directory.
#[test]
fn a_follower_whose_files_are_deleted_stays_failed_and_never_comes_back_empty() {
    let root = tempfile::tempdir().unwrap();
    let net = Arc::new(LocalNet::default());
    let driver = DriverConfig {
        tick: Duration::from_millis(20),
        reopen_backoff: Duration::from_millis(50),
        ..DriverConfig::default()
    };
    let dir = |id: u64| root.path().join(format!("node-{id}"));
    for id in 1..=3u64 {
        let handle = ShardHandle::start(
            ReplicaConfig::new(0, id),
            driver.clone(),
            ReplicaStore::on_files(dir(id), engine_config()),
            Arc::new(Outbox::default()),
            &[1, 2, 3],
            net.clone(),
        )
        .unwrap();
        net.nodes.write().insert(id, handle);
    }
    let leader_id = elected(&net);
    let victim = leader_id % 3 + 1;
    let leader_handle = net.nodes.read()[&leader_id].clone();
    let victim_handle = net.nodes.read()[&victim].clone();
    let value = |i: u64| format!("{i:>1000}").into_bytes();
    let put_value = |i: u64| put_value(&leader_handle, i, value(i));
    for i in 0..100u64 {
        assert!(matches!(put_value(i), Outcome::Applied { .. }), "put {i}");
    }

    std::fs::remove_dir_all(dir(victim)).unwrap();
    // Writes go on until the follower needs a file it cannot make (a new
    // log segment: the test engine's are 64 KiB).
    let mut i = 100u64;
    while victim_handle.state().failed.is_none() {
        assert!(i < 20_000, "the follower never failed without its files");
        assert!(matches!(put_value(i), Outcome::Applied { .. }), "put {i}");
        i += 1;
    }
    // Many reopen attempts' worth of time (50 ms backoff, doubling to
    // its cap), with writes going on and the leader heartbeating.
    let sent_before = net.sent.lock().get(&victim).copied().unwrap_or(0);
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        assert!(
            matches!(put_value(i), Outcome::Applied { .. }),
            "put {i} on two of three"
        );
        i += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    let state = victim_handle.state();
    let failed = state.failed.clone().unwrap_or_default();
    assert!(
        failed.contains("replica files missing"),
        "the follower stays failed, saying why: {state:?}"
    );
    assert!(
        state.status.is_none(),
        "no replica runs in its place: {state:?}"
    );
    assert_eq!(
        net.sent.lock().get(&victim).copied().unwrap_or(0),
        sent_before,
        "the failed follower sends nothing: no votes, no answers"
    );
    let control = |slot: &str| dir(victim).join(slot).join("control");
    assert!(
        !control("a").exists() && !control("b").exists(),
        "no empty engine was created in its directory"
    );
    for handle in net.nodes.read().values() {
        handle.stop();
    }
}
