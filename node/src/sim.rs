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
use std::sync::{Arc, Mutex};

use raft::eraftpb::Message;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_engine::storage::{FaultStorage, Storage};
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpace, KeySpaceConfig};

use crate::command::{Command, WriteOp};
use crate::replica::{Outcome, Replica, ReplicaConfig};

/// How the network misbehaves.
#[derive(Clone, Debug, Default)]
pub struct NetworkFaults {
    /// Probability a message is lost.
    pub drop: f64,
    /// Probability a message is delivered twice.
    pub duplicate: f64,
    /// Messages are delayed by 0 to this many ticks (reordering them).
    pub max_delay_ticks: u64,
}

struct InFlight {
    deliver_at: u64,
    to: u64,
    message: Message,
}

/// One simulated node.
struct SimNode {
    storage: FaultStorage,
    replica: Option<Replica>,
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
    /// The network's faults.
    pub faults: NetworkFaults,
    durability: Durability,
}

/// The engine configuration of a simulated replica.
pub fn engine_config() -> Config {
    let mut config = Config::for_tests("/replica");
    config.key_spaces = vec![KeySpaceConfig {
        name: "blobs".into(),
        key_bytes: 32,
        layout: CellLayout::Uniform { cells: 16 },
    }];
    config
}

fn open_engine(storage: &FaultStorage) -> crate::Result<Arc<Engine>> {
    let storage: Arc<dyn Storage> = Arc::new(storage.clone());
    Ok(Arc::new(Engine::open_with_storage(
        engine_config(),
        storage,
    )?))
}

impl SimCluster {
    /// A cluster of `size` founding voters (ids 1 to `size`).
    pub fn new(seed: u64, size: u64, durability: Durability) -> Self {
        let mut cluster = SimCluster {
            rng: SmallRng::seed_from_u64(seed),
            seed,
            now: 0,
            nodes: BTreeMap::new(),
            in_flight: Vec::new(),
            cut: BTreeSet::new(),
            faults: NetworkFaults::default(),
            durability,
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
        let storage = FaultStorage::default();
        let replica = self
            .open_replica(id, &storage, voters)
            .expect("open replica");
        self.nodes.insert(
            id,
            SimNode {
                storage,
                replica: Some(replica),
            },
        );
    }

    fn open_replica(
        &self,
        id: u64,
        storage: &FaultStorage,
        voters: &[u64],
    ) -> crate::Result<Replica> {
        let mut config = ReplicaConfig::new(0, id);
        config.durability = self.durability;
        Replica::open(config, open_engine(storage)?, KeySpace::default(), voters)
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
    }

    fn can_talk(&self, a: u64, b: u64) -> bool {
        !self.cut.contains(&(a.min(b), a.max(b)))
    }

    /// Kills a node's process: the page cache survives, so on restart it has
    /// every write it acknowledged.
    pub fn kill(&mut self, id: u64) {
        self.stop(id, |storage, _| storage.restart_process());
    }

    /// Cuts a node's power: on restart it has what it synced, plus torn
    /// unsynced sectors.
    pub fn power_off(&mut self, id: u64) {
        let seed = self.rng.random();
        self.stop(id, move |storage, _| storage.reboot(seed));
    }

    fn stop(&mut self, id: u64, after: impl FnOnce(&FaultStorage, u64) -> FaultStorage) {
        let node = self.nodes.get_mut(&id).expect("node");
        node.replica = None; // drops the engine and its threads
        node.storage = after(&node.storage, id);
        self.in_flight.retain(|m| m.to != id);
    }

    /// Restarts a stopped node from its storage.
    pub fn restart(&mut self, id: u64) -> crate::Result<()> {
        let storage = self.nodes[&id].storage.clone();
        let replica = self.open_replica(id, &storage, &[])?;
        self.nodes.get_mut(&id).expect("node").replica = Some(replica);
        Ok(())
    }

    /// Proposes a command on node `id`; the outcome appears in the returned
    /// slot.
    pub fn propose(&mut self, id: u64, command: &Command) -> Pending {
        let slot: Pending = Arc::new(Mutex::new(None));
        let done = slot.clone();
        let completion = Box::new(move |outcome| *done.lock().expect("slot") = Some(outcome));
        match self.replica(id) {
            Some(replica) => replica.propose(command, completion).expect("propose"),
            None => completion(Outcome::Failed("node is down".into())),
        }
        slot
    }

    /// Proposes a put of `value` under `key` on the current leader.
    pub fn put(&mut self, key: [u8; 32], value: Vec<u8>) -> Pending {
        let leader = self.leader().unwrap_or(1);
        self.put_on(leader, key, value)
    }

    /// Proposes a put on node `id`, leader or not.
    pub fn put_on(&mut self, id: u64, key: [u8; 32], value: Vec<u8>) -> Pending {
        let op = WriteOp {
            value: Some(value),
            namespace: 1,
            epoch: 1,
            key,
        };
        self.propose(id, &Command::Write(vec![op]))
    }

    /// One tick: every running replica ticks, then messages flow until the
    /// network is quiet for this tick.
    pub fn tick(&mut self) -> crate::Result<()> {
        self.now += 1;
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
        for (id, node) in &mut self.nodes {
            if let Some(replica) = node.replica.as_mut() {
                match replica.handle_ready() {
                    Ok(messages) => outgoing.extend(messages),
                    Err(_) => failed.push(*id),
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

    /// A replica whose engine failed (an injected crash) stops, like a
    /// process that died; the test decides how it comes back.
    fn crashed(&mut self, id: u64) {
        if let Some(node) = self.nodes.get_mut(&id) {
            node.replica = None;
        }
        self.in_flight.retain(|m| m.to != id);
    }

    /// The storage of node `id` (to inject faults).
    pub fn storage(&self, id: u64) -> FaultStorage {
        self.nodes[&id].storage.clone()
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
        for _ in 0..copies {
            let delay = self.rng.random_range(0..=self.faults.max_delay_ticks);
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
            if let Some(replica) = self.replica(flight.to)
                && replica.step(flight.message).is_err()
            {
                self.crashed(flight.to);
            }
        }
        Ok(count)
    }
}
