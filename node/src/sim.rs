//! A simulated cluster for tests: replicas of one shard on in-memory
//! fault-injecting storage, connected by a network the test controls —
//! messages can be dropped, delayed, duplicated, reordered and partitioned,
//! all drawn from a printed seed — and nodes can crash (process kill or
//! power loss) and restart. Time is counted in ticks, so runs are
//! deterministic apart from the engines' own background threads.
//!
//! What this is **not**: a production transport. It exists so the Raft
//! logic can be tested without sockets.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfChangeV2, Message, MessageType};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_engine::storage::{FaultStorage, Storage};
use tidepool_engine::{CellLayout, Config, Durability, KeySpaceConfig};

use crate::command::{Command, WriteOp};
use crate::entry_context::EntrySync;
use crate::replica::{
    BLOB_KEY_SPACE, LeaseClock, LeaseGate, Outcome, ReadCompletion, ReadOutcome, Replica,
    ReplicaConfig,
};

/// The time one simulated tick stands for, on a replica's
/// [`LeaseClock::Manual`] clock (the simulator advances it every tick).
pub const SIM_TICK: std::time::Duration = std::time::Duration::from_millis(100);
use crate::snapshot::{Outbox, Receiver, manifest_of};
use crate::store::ReplicaStore;

/// How the network misbehaves.
#[derive(Clone, Debug, Default)]
pub struct NetworkFaults {
    /// Probability a message is lost.
    pub drop: f64,
    /// Probability a message is delivered twice.
    pub duplicate: f64,
    /// Messages are delayed by 0 to this many ticks (reordering them).
    pub max_delay_ticks: u64,
    /// Probability that a snapshot file stream breaks before a chunk (the
    /// receiver resumes from where it stopped).
    pub snapshot_break: f64,
    /// A snapshot reaches its follower this many ticks after the leader
    /// sent it (its files take that long to transfer), while the leader
    /// goes on; at most the leader's snapshot idle bound.
    pub snapshot_transfer_ticks: u64,
}

/// What snapshot transfers did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// Snapshots received whole and stepped.
    pub received: u64,
    /// Streams that broke and were resumed.
    pub resumed: u64,
    /// Transfers that failed (reported to the leader).
    pub failed: u64,
}

struct InFlight {
    deliver_at: u64,
    to: u64,
    message: Message,
}

/// Where a simulated node keeps its replica.
#[derive(Clone, Debug)]
enum NodeDisk {
    /// In-memory storage that can fail, crash and lose power.
    Fault(FaultStorage),
    /// Real files in a directory (to measure real disk traffic).
    Files(PathBuf),
}

/// One simulated node.
struct SimNode {
    storage: NodeDisk,
    replica: Option<Replica>,
    /// The snapshots this node's process offers (lost when it stops).
    outbox: Arc<Outbox>,
    /// The replica's lease gate (kept across restarts, as a node keeps its
    /// shard handle's).
    gate: LeaseGate,
}

/// The outcome of a proposal, filled in when it completes.
pub type Pending = Arc<Mutex<Option<Outcome>>>;

/// A cluster of replicas of shard 0 on a simulated network.
pub struct SimCluster {
    rng: SmallRng,
    seed: u64,
    now: u64,
    nodes: BTreeMap<u64, SimNode>,
    in_flight: Vec<InFlight>,
    /// Pairs of nodes that cannot talk.
    cut: BTreeSet<(u64, u64)>,
    /// Directed cuts: (from, to).
    cut_from: BTreeSet<(u64, u64)>,
    /// Extra delay, in ticks, of every message from the first node to the
    /// second (a slow link or peer).
    slow: BTreeMap<(u64, u64), u64>,
    /// The network's faults.
    pub faults: NetworkFaults,
    /// Settings every replica opens with (its ids filled in).
    template: ReplicaConfig,
    /// Engine settings of every replica.
    engine: Config,
    /// Real-file directories under this root instead of fault storage.
    disk_root: Option<PathBuf>,
    /// Snapshot transfers so far.
    pub snapshots: SnapshotStats,
}

/// The engine configuration of a simulated replica.
pub fn engine_config() -> Config {
    let mut config = Config::for_tests("/replica");
    // As `NodeConfig::engine_config` opens a node's replicas.
    config.retain_log_until_set = true;
    config.hold_replay_until_released = true;
    config.key_spaces = vec![
        KeySpaceConfig {
            name: BLOB_KEY_SPACE.into(),
            key_bytes: 32,
            layout: CellLayout::Uniform { cells: 16 },
        },
        crate::names::key_space_config(16),
    ];
    config
}

/// A replica's directory on a simulated node's storage.
pub fn replica_store(storage: &FaultStorage) -> ReplicaStore {
    let storage: Arc<dyn Storage> = Arc::new(storage.clone());
    ReplicaStore::new(storage, "/replica", engine_config())
}

/// A plain put of `value` under `key` (namespace 1, epoch 1, no session,
/// not indexed by name), as tests write.
pub fn put_op(key: [u8; 32], value: Vec<u8>) -> WriteOp {
    WriteOp {
        value: Some(value),
        namespace: 1,
        epoch: 1,
        key,
        name: Vec::new(),
        session: None,
        if_absent: false,
    }
}

/// How a simulated cluster is built.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// Settings every replica opens with (its ids filled in).
    pub replica: ReplicaConfig,
    /// Engine settings of every replica.
    pub engine: Config,
    /// Keep replicas in real files under this directory (one subdirectory
    /// per node) instead of fault storage; crashes are then process kills
    /// only.
    pub disk_root: Option<PathBuf>,
}

impl SimOptions {
    /// Fault storage, test engine settings, replica settings `replica`.
    pub fn new(replica: ReplicaConfig) -> Self {
        Self {
            replica,
            engine: engine_config(),
            disk_root: None,
        }
    }

    /// Buffered replicas whose engines never sync in the background: only
    /// what the Ready path waits for is on disk when the power goes.
    pub fn buffered_without_background_syncs() -> Self {
        let mut replica = ReplicaConfig::new(0, 0);
        replica.durability = Durability::Buffered;
        let mut options = Self::new(replica);
        options.engine.sync_interval_ms = 3_600_000;
        options.engine.snapshot_interval_ms = 3_600_000;
        options
    }
}

impl SimCluster {
    /// A cluster of `size` founding voters (ids 1 to `size`).
    pub fn new(seed: u64, size: u64, durability: Durability) -> Self {
        let mut template = ReplicaConfig::new(0, 0);
        template.durability = durability;
        Self::with_config(seed, size, template)
    }

    /// A cluster of `size` founding voters whose replicas open with
    /// `template` (shard and node ids replaced).
    pub fn with_config(seed: u64, size: u64, template: ReplicaConfig) -> Self {
        Self::with_options(seed, size, SimOptions::new(template))
    }

    /// A cluster of `size` founding voters built as `options` say.
    pub fn with_options(seed: u64, size: u64, options: SimOptions) -> Self {
        let mut cluster = SimCluster {
            rng: SmallRng::seed_from_u64(seed),
            seed,
            now: 0,
            nodes: BTreeMap::new(),
            in_flight: Vec::new(),
            cut: BTreeSet::new(),
            cut_from: BTreeSet::new(),
            slow: BTreeMap::new(),
            faults: NetworkFaults::default(),
            template: options.replica,
            engine: options.engine,
            disk_root: options.disk_root,
            snapshots: SnapshotStats::default(),
        };
        let voters: Vec<u64> = (1..=size).collect();
        for id in 1..=size {
            cluster.add_node(id, &voters);
        }
        cluster
    }

    /// The seed, for failure messages.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Starts a node: a founding voter if `voters` is given, else an empty
    /// replica waiting to be added.
    pub fn add_node(&mut self, id: u64, voters: &[u64]) {
        let storage = match &self.disk_root {
            Some(root) => NodeDisk::Files(root.join(format!("node-{id}"))),
            None => NodeDisk::Fault(FaultStorage::default()),
        };
        let outbox = Arc::new(Outbox::default());
        let gate = LeaseGate::new(self.template.lease_clock.clone());
        let replica = self
            .open_replica(id, &storage, &outbox, &gate, voters)
            .expect("open replica");
        self.nodes.insert(
            id,
            SimNode {
                storage,
                replica: Some(replica),
                outbox,
                gate,
            },
        );
    }

    fn open_replica(
        &self,
        id: u64,
        storage: &NodeDisk,
        outbox: &Arc<Outbox>,
        gate: &LeaseGate,
        voters: &[u64],
    ) -> crate::Result<Replica> {
        let store = match storage {
            NodeDisk::Fault(storage) => {
                let storage: Arc<dyn Storage> = Arc::new(storage.clone());
                ReplicaStore::new(storage, "/replica", self.engine.clone())
            }
            NodeDisk::Files(dir) => ReplicaStore::on_files(dir, self.engine.clone()),
        };
        let mut config = self.template.clone();
        config.node_id = id;
        config.address = format!("sim://{id}");
        config.hash_snapshots_inline = true;
        config.lease_gate = Some(gate.clone());
        Replica::open(config, store, outbox.clone(), voters)
    }

    /// Node ids.
    pub fn ids(&self) -> Vec<u64> {
        self.nodes.keys().copied().collect()
    }

    /// A running node's replica.
    pub fn replica(&mut self, id: u64) -> Option<&mut Replica> {
        self.nodes.get_mut(&id).and_then(|n| n.replica.as_mut())
    }

    /// The node that believes it leads, if exactly one running node does in
    /// the highest term.
    pub fn leader(&self) -> Option<u64> {
        let mut best: Option<(u64, u64)> = None;
        for (id, node) in &self.nodes {
            if let Some(status) = node.replica.as_ref().map(Replica::status)
                && status.is_leader
                && best.is_none_or(|(_, term)| status.term > term)
            {
                best = Some((*id, status.term));
            }
        }
        best.map(|(id, _)| id)
    }

    /// Cuts the network between `a` and `b` (both ways).
    pub fn cut(&mut self, a: u64, b: u64) {
        self.cut.insert((a.min(b), a.max(b)));
    }

    /// Cuts messages from `from` to `to` only (the other way still flows).
    pub fn cut_one_way(&mut self, from: u64, to: u64) {
        self.cut_from.insert((from, to));
    }

    /// Delays every message from `from` to `to` by `ticks` more (in order:
    /// the same delay for each).
    pub fn slow_one_way(&mut self, from: u64, to: u64, ticks: u64) {
        self.slow.insert((from, to), ticks);
    }

    /// Isolates `side` from every other node.
    pub fn partition(&mut self, side: &[u64]) {
        for a in side {
            for b in self.ids() {
                if !side.contains(&b) {
                    self.cut(*a, b);
                }
            }
        }
    }

    /// Restores every link.
    pub fn heal(&mut self) {
        self.cut.clear();
        self.cut_from.clear();
        self.slow.clear();
    }

    /// Whether a message from `a` reaches `b`.
    fn can_talk(&self, a: u64, b: u64) -> bool {
        !self.cut.contains(&(a.min(b), a.max(b))) && !self.cut_from.contains(&(a, b))
    }

    /// Kills a node's process: the page cache survives, so on restart it has
    /// every write it acknowledged.
    pub fn kill(&mut self, id: u64) {
        self.stop(id, |storage| match storage {
            NodeDisk::Fault(storage) => NodeDisk::Fault(storage.restart_process()),
            files => files.clone(),
        });
    }

    /// Kills a node's process with its disk as `image` shows it (one taken
    /// earlier with `FaultStorage::restart_process`: a kill -9 at that
    /// moment, whatever the node did since).
    pub fn kill_as_of(&mut self, id: u64, image: FaultStorage) {
        self.stop(id, move |_| NodeDisk::Fault(image));
    }

    /// Cuts a node's power: on restart it has what it synced, plus torn
    /// unsynced sectors.
    pub fn power_off(&mut self, id: u64) {
        let seed = self.rng.random();
        self.stop(id, move |storage| match storage {
            NodeDisk::Fault(storage) => NodeDisk::Fault(storage.reboot(seed)),
            NodeDisk::Files(_) => panic!("power loss needs fault storage"),
        });
    }

    fn stop(&mut self, id: u64, after: impl FnOnce(&NodeDisk) -> NodeDisk) {
        let node = self.nodes.get_mut(&id).expect("node");
        node.replica = None; // drops the engine and its threads
        node.outbox = Arc::new(Outbox::default());
        node.storage = after(&node.storage);
        self.in_flight.retain(|m| m.to != id);
    }

    /// Restarts a stopped node from its storage.
    pub fn restart(&mut self, id: u64) -> crate::Result<()> {
        let storage = self.nodes[&id].storage.clone();
        let outbox = self.nodes[&id].outbox.clone();
        let gate = self.nodes[&id].gate.clone();
        let replica = self.open_replica(id, &storage, &outbox, &gate, &[])?;
        self.nodes.get_mut(&id).expect("node").replica = Some(replica);
        Ok(())
    }

    /// Node `id` loses its disk and starts again under its id, founding its
    /// replica anew with `voters`: what a node of a fixed cluster does when
    /// its data directory is replaced.
    pub fn lose_disk(&mut self, id: u64, voters: &[u64]) -> crate::Result<()> {
        self.stop(id, |storage| match storage {
            NodeDisk::Fault(_) => NodeDisk::Fault(FaultStorage::default()),
            NodeDisk::Files(_) => panic!("losing a disk needs fault storage"),
        });
        let node = &self.nodes[&id];
        let (storage, outbox, gate) =
            (node.storage.clone(), node.outbox.clone(), node.gate.clone());
        let replica = self.open_replica(id, &storage, &outbox, &gate, voters)?;
        self.nodes.get_mut(&id).expect("node").replica = Some(replica);
        Ok(())
    }

    /// Proposes a command on node `id`; the outcome appears in the returned
    /// slot.
    pub fn propose(&mut self, id: u64, command: &Command) -> Pending {
        self.propose_with(id, command, EntrySync::AsConfigured)
    }

    /// [`SimCluster::propose`], its entry synced as `sync` says.
    pub fn propose_with(&mut self, id: u64, command: &Command, sync: EntrySync) -> Pending {
        let slot: Pending = Arc::new(Mutex::new(None));
        let done = slot.clone();
        let completion = Box::new(move |outcome| *done.lock().expect("slot") = Some(outcome));
        match self.replica(id) {
            Some(replica) => replica
                .propose_traced(command, sync, Vec::new(), completion)
                .expect("propose"),
            None => completion(Outcome::Failed("node is down".into())),
        }
        slot
    }

    /// Asks node `id` for a linearizable read point; the outcome appears in
    /// the returned slot.
    pub fn read(&mut self, id: u64) -> Arc<Mutex<Option<ReadOutcome>>> {
        let slot = Arc::new(Mutex::new(None));
        let done = slot.clone();
        let completion: ReadCompletion =
            Box::new(move |outcome| *done.lock().expect("slot") = Some(outcome));
        match self.replica(id) {
            Some(replica) => replica.read_index(vec![completion]),
            None => completion(ReadOutcome::Failed("node is down".into())),
        }
        slot
    }

    /// Proposes a membership change of `node` on the current leader.
    pub fn change_membership(&mut self, change: ConfChangeType, node: u64) -> Pending {
        let slot: Pending = Arc::new(Mutex::new(None));
        let done = slot.clone();
        let completion = Box::new(move |outcome| *done.lock().expect("slot") = Some(outcome));
        let mut single = ConfChangeSingle::default();
        single.set_change_type(change);
        single.node_id = node;
        let mut request = ConfChangeV2::default();
        request.set_changes(vec![single]);
        let leader = self.leader().unwrap_or(1);
        match self.replica(leader) {
            Some(replica) => {
                // A refused change is reported through the slot.
                let _ = replica.propose_conf_change(request, completion);
            }
            None => completion(Outcome::Failed("no leader".into())),
        }
        slot
    }

    /// Stops node `id` for good and forgets it (after its removal from the
    /// group).
    pub fn remove_node(&mut self, id: u64) {
        self.nodes.remove(&id);
        self.in_flight.retain(|m| m.to != id);
    }

    /// Proposes a put of `value` under `key` on the current leader.
    pub fn put(&mut self, key: [u8; 32], value: Vec<u8>) -> Pending {
        let leader = self.leader().unwrap_or(1);
        self.put_on(leader, key, value)
    }

    /// Proposes a put on node `id`, leader or not.
    pub fn put_on(&mut self, id: u64, key: [u8; 32], value: Vec<u8>) -> Pending {
        self.propose(id, &Command::Write(vec![put_op(key, value)]))
    }

    /// One tick: every running replica ticks, then messages flow until the
    /// network is quiet for this tick.
    pub fn tick(&mut self) -> crate::Result<()> {
        self.now += 1;
        if let LeaseClock::Manual(nanos) = &self.template.lease_clock {
            nanos.fetch_add(
                SIM_TICK.as_nanos() as u64,
                std::sync::atomic::Ordering::AcqRel,
            );
        }
        let mut failed = Vec::new();
        for (id, node) in &mut self.nodes {
            if let Some(replica) = node.replica.as_mut()
                && replica.tick().is_err()
            {
                failed.push(*id);
            }
        }
        for id in failed {
            self.crashed(id);
        }
        self.settle()
    }

    /// Runs every replica's Ready and delivers what is due until nothing
    /// moves, without a tick: what a node does right after a client's call.
    pub fn settle(&mut self) -> crate::Result<()> {
        for _ in 0..100 {
            let sent = self.drain_ready()?;
            let delivered = self.deliver_due()?;
            if sent == 0 && delivered == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Runs `ticks` ticks.
    pub fn run(&mut self, ticks: u64) -> crate::Result<()> {
        for _ in 0..ticks {
            self.tick()?;
        }
        Ok(())
    }

    /// Ticks until `done` holds, at most `max_ticks`. Returns whether it did.
    pub fn run_until(
        &mut self,
        max_ticks: u64,
        mut done: impl FnMut(&mut SimCluster) -> bool,
    ) -> crate::Result<bool> {
        for _ in 0..max_ticks {
            if done(self) {
                return Ok(true);
            }
            self.tick()?;
        }
        Ok(done(self))
    }

    fn drain_ready(&mut self) -> crate::Result<usize> {
        let mut outgoing = Vec::new();
        let mut failed = Vec::new();
        let seed = self.seed;
        for (id, node) in &mut self.nodes {
            if let Some(replica) = node.replica.as_mut() {
                // Early messages (a leader's appends) leave even when the
                // replica then dies before its own sync, as on a real node.
                let mut early = Vec::new();
                let gate = &node.gate;
                // Checked as they leave (a panic in there would be caught
                // as raft-rs's and fail the replica instead).
                let mut violations = Vec::new();
                let ready = replica.handle_ready_sending(&mut |m| {
                    violations.extend(check_gate(gate, &m));
                    early.extend(m);
                });
                if let Ok(messages) = &ready {
                    violations.extend(check_gate(gate, messages));
                }
                assert!(violations.is_empty(), "seed {seed}: {violations:?}");
                match ready {
                    Ok(messages) => {
                        outgoing.extend(early.into_iter().chain(messages));
                    }
                    Err(_) => {
                        outgoing.extend(early);
                        failed.push(*id);
                    }
                }
            }
        }
        for id in failed {
            self.crashed(id);
        }
        let sent = outgoing.len();
        for message in outgoing {
            self.send(message);
        }
        Ok(sent)
    }

    /// Whether node `id`'s lease gate is open: a linearizable read arriving
    /// now would be served without asking its replica.
    pub fn gate_open(&self, id: u64) -> bool {
        self.nodes[&id].gate.is_open()
    }

    /// A replica whose engine failed (an injected crash) stops, like a
    /// process that died; the test decides how it comes back.
    fn crashed(&mut self, id: u64) {
        if let Some(node) = self.nodes.get_mut(&id) {
            node.replica = None;
            node.outbox = Arc::new(Outbox::default());
        }
        self.in_flight.retain(|m| m.to != id);
    }

    /// The fault storage of node `id` (to inject faults).
    pub fn storage(&self, id: u64) -> FaultStorage {
        match &self.nodes[&id].storage {
            NodeDisk::Fault(storage) => storage.clone(),
            NodeDisk::Files(_) => panic!("node {id} keeps real files"),
        }
    }

    /// Whether node `id` is running.
    pub fn is_up(&self, id: u64) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.replica.is_some())
    }

    fn send(&mut self, message: Message) {
        if !self.can_talk(message.from, message.to) || self.rng.random_bool(self.faults.drop) {
            return;
        }
        let copies = if self.rng.random_bool(self.faults.duplicate) {
            2
        } else {
            1
        };
        let transfer = if message.msg_type() == MessageType::MsgSnapshot {
            self.faults.snapshot_transfer_ticks
        } else {
            0
        };
        for _ in 0..copies {
            let delay = self.rng.random_range(0..=self.faults.max_delay_ticks)
                + transfer
                + self
                    .slow
                    .get(&(message.from, message.to))
                    .copied()
                    .unwrap_or(0);
            self.in_flight.push(InFlight {
                deliver_at: self.now + delay,
                to: message.to,
                message: message.clone(),
            });
        }
    }

    fn deliver_due(&mut self) -> crate::Result<usize> {
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.in_flight)
            .into_iter()
            .partition(|m| m.deliver_at <= now);
        self.in_flight = later;
        let count = due.len();
        for flight in due {
            let from = flight.message.from;
            if !self.can_talk(from, flight.to) {
                continue;
            }
            if flight.message.msg_type() == MessageType::MsgSnapshot
                && !self.transfer_snapshot(&flight.message)
            {
                continue;
            }
            if let Some(replica) = self.replica(flight.to)
                && replica.step(flight.message).is_err()
            {
                self.crashed(flight.to);
            }
        }
        Ok(count)
    }

    /// Pulls the files of a snapshot message into its receiver's spare slot,
    /// as the node's transport does before stepping the message; streams
    /// break at random and resume. Returns whether the message may be
    /// stepped; a failed transfer is reported to the sender.
    fn transfer_snapshot(&mut self, message: &Message) -> bool {
        let Some(replica) = self.replica(message.to) else {
            return false;
        };
        if !replica.needs_snapshot(message) {
            return true;
        }
        let store = replica.store().clone();
        let ok = self.receive_snapshot(message, &store).is_ok();
        if ok {
            self.snapshots.received += 1;
        } else {
            self.snapshots.failed += 1;
            if let Some(sender) = self.replica(message.from) {
                sender.report_snapshot_failure(message.to);
            }
        }
        ok
    }

    fn receive_snapshot(&mut self, message: &Message, store: &ReplicaStore) -> crate::Result<()> {
        let manifest = manifest_of(message.get_snapshot())?;
        let source = manifest.source.as_ref().map_or(0, |s| s.node_id);
        let prepared = self
            .nodes
            .get(&source)
            .and_then(|n| n.outbox.get(manifest.shard_id, manifest.snapshot_id))
            .ok_or_else(|| crate::NodeError::Malformed("snapshot gone".into()))?;
        let mut receiver = Receiver::start(manifest, store)?;
        for _attempt in 0..20 {
            let (file, offset) = receiver.resume_point();
            for chunk in prepared.chunks(message.to, file, offset) {
                if self.rng.random_bool(self.faults.snapshot_break) {
                    self.snapshots.resumed += 1;
                    break;
                }
                receiver.accept(&chunk?)?;
            }
            if receiver.is_complete() {
                break;
            }
        }
        receiver.finish()?;
        Ok(())
    }
}

/// Checks messages as they leave a node against its lease gate: while it
/// is open, no message may tell a peer of a commit index the gate's reads
/// might not see, nor start an election (`replica/read.rs`, "Reads without
/// the owner").
fn check_gate(gate: &LeaseGate, messages: &[Message]) -> Vec<String> {
    if !gate.is_open() {
        return Vec::new();
    }
    let applied = gate.opened_at_applied();
    let mut violations = Vec::new();
    for message in messages {
        if message.msg_type() == MessageType::MsgTimeoutNow {
            violations.push(format!(
                "node {} sent TimeoutNow with its lease gate open",
                message.from
            ));
        }
        if message.commit > applied {
            violations.push(format!(
                "node {} sent commit index {} with its lease gate open at applied {applied}",
                message.from, message.commit
            ));
        }
    }
    violations
}
