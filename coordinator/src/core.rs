//! What every part of a running coordinator shares: the metadata store, the
//! cached cluster map (followed through a watch), leadership (an election
//! with a fencing generation) and fenced map updates.
//!
//! **Election.** A candidate grants a lease and creates the `leader` key
//! under it only if the key is absent. The revision of that write is its
//! *generation*. Every map write is a transaction that also compares the
//! leader key's modification revision with the writer's generation, so a
//! coordinator that lost its lease (and whose key expired, letting another
//! win) cannot write, however late its request arrives. A leader steps down
//! on its own when it cannot renew the lease for half its length.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tidepool_proto::v1::ClusterMap;
use tokio::sync::watch;

use crate::CoordinatorError;
use crate::config::CoordinatorConfig;
use crate::kubernetes::Orchestrator;
use crate::meta::{Compare, LeaseId, MetaStore, Op, WatchEvent};
use crate::reconcile::Progress;
use crate::schema::{Keys, LeaderRecord, decode_map, encode_map, new_map};

/// Why a leader resigns when its coordinator stops.
const STOPPING: &str = "the coordinator is stopping";

/// This coordinator's term as leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leadership {
    /// Modification revision of the leader key this coordinator wrote.
    pub generation: u64,
    lease: LeaseId,
}

/// A node holds a newer map of this cluster than the store: the store was
/// restored from an older snapshot (or rolled back). The coordinator
/// changes nothing until the map is restored (`RestoreMap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreBehind {
    /// The node holding the newest map (0: this coordinator saw it, and
    /// no node that reported holds it).
    pub node_id: u64,
    /// Its map's version.
    pub node_version: u64,
    /// The store's.
    pub store_version: u64,
}

impl StoreBehind {
    /// Why changes are refused, and what to do.
    pub fn explain(&self) -> String {
        let holder = match self.node_id {
            0 => "this coordinator has seen".to_string(),
            id => format!("node {id} holds"),
        };
        format!(
            "the coordinator's store holds map v{} but {holder} v{}: the store was restored from an older snapshot; nothing is changed until `tidectl cluster restore-map --from-node ADDRESS` puts the newest map back",
            self.store_version, self.node_version
        )
    }
}

/// State shared by the services, the election and the reconciler.
pub struct Shared {
    /// Settings.
    pub config: CoordinatorConfig,
    /// This replica's id.
    pub id: String,
    /// Where this replica serves.
    pub address: String,
    /// The metadata store.
    pub store: Arc<dyn MetaStore>,
    /// Key names.
    pub keys: Keys,
    map: watch::Sender<Arc<ClusterMap>>,
    leadership: watch::Sender<Option<Leadership>>,
    /// Heartbeat leases this replica granted, by node id.
    pub(crate) node_leases: Mutex<std::collections::HashMap<u64, LeaseId>>,
    /// What the reconciler last saw and did.
    pub progress: Mutex<Progress>,
    /// Held from computing an epoch drop's target through its proposal,
    /// and while a retention change commits: a retention lengthened (its
    /// call answered) is never followed by a drop computed with the
    /// shorter one.
    pub(crate) epoch_drops: tokio::sync::Mutex<()>,
    stop: watch::Sender<bool>,
    /// How it dials nodes (TLS material).
    pub security: tidepool_security::Security,
    /// Channels to nodes for calls outside the reconciler's rounds (status
    /// polls of `PrepareNodeStop`).
    pub(crate) node_clients: crate::nodes::NodeClients,
    /// The token table of the cached map, with the map version it is of.
    tokens: Mutex<(u64, Arc<tidepool_security::guard::TokenTable>)>,
    /// Kubernetes, when the coordinator runs under the chart.
    orchestrator: std::sync::OnceLock<Arc<dyn Orchestrator>>,
    /// Set while a node holds a newer map than the store.
    store_behind: Mutex<Option<StoreBehind>>,
    /// Nodes of other clusters this coordinator refused lately, by
    /// (cluster, node id).
    refused: Mutex<BTreeMap<(String, u64), Refusal>>,
}

/// A node refused as another cluster's.
struct Refusal {
    address: String,
    /// Its last call.
    at: Instant,
    /// When its record was last written to the store.
    stored: Option<Instant>,
}

/// How long a refused node is listed in the status after its last call (a
/// refused node calls again every ten seconds).
const REFUSED_LISTED: Duration = Duration::from_secs(60);

/// How often a node that keeps being refused has its record written to
/// the store again (it lives `REFUSED_LISTED`).
const REFUSED_STORED_EVERY: Duration = Duration::from_secs(20);

/// Most refused nodes listed at once.
const REFUSED_MOST: usize = 1_024;

/// The store-behind mark after a comparison: the newest map known
/// (`node_version`, held by `node_id`; 0: this coordinator saw it) against
/// the store's version when it was read. A mark is replaced only by a newer
/// version and cleared only by a store holding its version.
fn next_mark(
    known: Option<StoreBehind>,
    node_id: u64,
    node_version: u64,
    store_version: Option<u64>,
) -> Option<StoreBehind> {
    let Some(store_version) = store_version else {
        return known;
    };
    let found = StoreBehind {
        node_id,
        node_version,
        store_version,
    };
    match known {
        Some(known) if known.node_version > store_version && known.node_version >= node_version => {
            Some(StoreBehind {
                store_version,
                ..known
            })
        }
        _ => (node_version > store_version).then_some(found),
    }
}

impl tidepool_security::Authority for Shared {
    fn token(&self, hash: &[u8; 32]) -> Option<Arc<tidepool_security::guard::Grant>> {
        let map = self.map();
        let mut cached = self.tokens.lock();
        if cached.0 != map.version {
            *cached = (
                map.version,
                Arc::new(tidepool_security::guard::TokenTable::of(&map.tokens)),
            );
        }
        cached.1.get(hash)
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("id", &self.id).finish()
    }
}

impl Shared {
    /// Shared state for a coordinator serving at `address`.
    pub fn new(
        config: CoordinatorConfig,
        id: String,
        address: String,
        store: Arc<dyn MetaStore>,
        security: tidepool_security::Security,
    ) -> Arc<Self> {
        Arc::new(Self {
            keys: Keys::new(&config.key_prefix),
            config,
            id,
            address,
            store,
            map: watch::Sender::new(Arc::new(ClusterMap::default())),
            leadership: watch::Sender::new(None),
            node_leases: Mutex::new(Default::default()),
            progress: Mutex::new(Progress::default()),
            epoch_drops: tokio::sync::Mutex::new(()),
            stop: watch::Sender::new(false),
            node_clients: crate::nodes::NodeClients::new(security.clone()),
            security,
            tokens: Mutex::default(),
            orchestrator: std::sync::OnceLock::new(),
            store_behind: Mutex::new(None),
            refused: Mutex::new(BTreeMap::new()),
        })
    }

    /// Whether a node was seen holding a newer map than the store.
    pub fn store_behind(&self) -> Option<StoreBehind> {
        *self.store_behind.lock()
    }

    /// Records that node `node_id` of cluster `cluster_id`, at `address`,
    /// was refused as a node of another cluster: here, and in the store
    /// (at most every `REFUSED_STORED_EVERY` per node), where every
    /// coordinator's status finds it — a node calls the leader, and an
    /// operator's `tidectl cluster status` may reach a standby.
    pub(crate) fn note_refused(&self, node_id: u64, address: &str, cluster_id: &str) {
        let now = Instant::now();
        let record = {
            let mut refused = self.refused.lock();
            refused.retain(|_, r| now.duration_since(r.at) < REFUSED_LISTED);
            let key = (cluster_id.to_string(), node_id);
            if refused.len() >= REFUSED_MOST && !refused.contains_key(&key) {
                // Callers inventing clusters cannot grow it without bound.
                return;
            }
            let entry = refused.entry(key).or_insert(Refusal {
                address: String::new(),
                at: now,
                stored: None,
            });
            entry.at = now;
            // A heartbeat may not say where the node is; keep what its
            // registration said.
            if !address.is_empty() {
                entry.address = address.to_string();
            }
            let due = entry
                .stored
                .is_none_or(|s| now.duration_since(s) >= REFUSED_STORED_EVERY);
            if !due || !storable_cluster_id(cluster_id) {
                return;
            }
            entry.stored = Some(now);
            crate::schema::RefusedRecord {
                node_id,
                address: entry.address.clone(),
                cluster_id: cluster_id.to_string(),
                at_ms: unix_ms(),
            }
        };
        let store = self.store.clone();
        let key = self.keys.refused_node(cluster_id, node_id);
        let value = serde_json::to_vec(&record).expect("a record serializes");
        tokio::spawn(async move {
            let written = async {
                let lease = store.grant_lease(REFUSED_LISTED).await?;
                store
                    .txn(
                        Vec::new(),
                        vec![Op::Put {
                            key,
                            value,
                            lease: Some(lease),
                        }],
                    )
                    .await
            };
            if let Err(error) = written.await {
                tracing::debug!(%error, "cannot store a refused node's record");
            }
        });
    }

    /// Nodes of another cluster than the map's refused in the last minute
    /// by any coordinator of the store (this one's own refusals too when
    /// the store cannot be read), by cluster and node id.
    pub async fn refused_nodes(&self) -> Vec<tidepool_proto::v1::RefusedNode> {
        let ours = self.map().cluster_id.clone();
        let now = Instant::now();
        // (cluster, node) -> (address, seconds since)
        let mut listed: BTreeMap<(String, u64), (String, u64)> = self
            .refused
            .lock()
            .iter()
            .filter(|(_, r)| now.duration_since(r.at) < REFUSED_LISTED)
            .map(|(key, r)| {
                (
                    key.clone(),
                    (r.address.clone(), now.duration_since(r.at).as_secs()),
                )
            })
            .collect();
        match self.store.list(&self.keys.refused()).await {
            Ok(records) => {
                let now_ms = unix_ms();
                for kv in records {
                    let Ok(record) =
                        serde_json::from_slice::<crate::schema::RefusedRecord>(&kv.value)
                    else {
                        continue;
                    };
                    let ago_ms = now_ms.saturating_sub(record.at_ms);
                    if ago_ms >= REFUSED_LISTED.as_millis() as u64 {
                        continue;
                    }
                    let key = (record.cluster_id, record.node_id);
                    if listed.len() >= REFUSED_MOST && !listed.contains_key(&key) {
                        break;
                    }
                    let seen = (record.address, ago_ms / 1_000);
                    match listed.get_mut(&key) {
                        Some(known) if known.1 <= seen.1 && !known.0.is_empty() => {}
                        Some(known) => *known = seen,
                        None => {
                            listed.insert(key, seen);
                        }
                    }
                }
            }
            Err(error) => {
                tracing::debug!(%error, "cannot read the refused nodes' records");
            }
        }
        listed
            .into_iter()
            .filter(|((cluster, _), _)| *cluster != ours)
            .map(|((cluster_id, node_id), (address, seconds_ago))| {
                tidepool_proto::v1::RefusedNode {
                    node_id,
                    address,
                    cluster_id,
                    seconds_ago,
                }
            })
            .collect()
    }

    pub(crate) fn store_behind_mark(&self) -> parking_lot::MutexGuard<'_, Option<StoreBehind>> {
        self.store_behind.lock()
    }

    /// Compares the map versions nodes hold, `(node, version)`, with the
    /// store's: a node ahead of it marks the store behind. The mark stays
    /// until the store holds that version or a newer one (a restore), even
    /// if the node that reported it stops reporting: the store is behind a
    /// map that exists, whoever holds it. With `all` (every live node's
    /// report, each reconcile round) the store is read every time (the
    /// cache may hold a newer map than a store rolled back under it);
    /// otherwise (a heartbeat, the nodes asked before leading) only when a
    /// node is ahead of the cache (which may trail a write that just
    /// succeeded).
    pub async fn note_node_maps(
        &self,
        held: impl IntoIterator<Item = (u64, u64)>,
        all: bool,
    ) -> Result<Option<StoreBehind>, CoordinatorError> {
        let newest = held
            .into_iter()
            .max_by_key(|(node, version)| (*version, *node));
        // The newest map known: a node's, or the newest this coordinator saw
        // (its cache never goes back to an older version).
        let cached = self.map().version;
        let (node_id, node_version) = match newest {
            Some((node, version)) if version >= cached => (node, version),
            _ => (0, cached),
        };
        let store_version = if all || node_version > cached {
            Some(self.read_map().await?.map_or(0, |(map, _)| map.version))
        } else {
            None
        };
        let mut mark = self.store_behind.lock();
        let next = next_mark(*mark, node_id, node_version, store_version);
        if let Some(found) = next
            && mark.is_none_or(|known| known.node_version != found.node_version)
        {
            tracing::error!("{}", found.explain());
        }
        *mark = next;
        Ok(next)
    }

    /// Answers what only Kubernetes knows from now on (zones, scale-downs).
    /// Set once, before serving.
    pub fn set_orchestrator(&self, orchestrator: Arc<dyn Orchestrator>) {
        let _ = self.orchestrator.set(orchestrator);
    }

    /// Kubernetes, if the coordinator runs under it.
    pub(crate) fn orchestrator(&self) -> Option<&Arc<dyn Orchestrator>> {
        self.orchestrator.get()
    }

    /// Fires when the coordinator begins to stop.
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Begins to stop: resigns, ends the loops and open streams.
    pub(crate) fn begin_stop(&self) {
        self.stop.send_replace(true);
    }

    /// The newest map this replica has seen (version 0 before the first).
    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.borrow().clone()
    }

    /// Follows map versions as they are published.
    pub fn subscribe_map(&self) -> watch::Receiver<Arc<ClusterMap>> {
        self.map.subscribe()
    }

    /// Installs `map` if it is newer than the cached one.
    fn publish(&self, map: ClusterMap) {
        self.map.send_if_modified(|current| {
            if map.version > current.version {
                *current = Arc::new(map);
                true
            } else {
                false
            }
        });
    }

    /// The current leadership, if this replica leads.
    pub fn leadership(&self) -> Option<Leadership> {
        *self.leadership.borrow()
    }

    /// Follows leadership changes.
    pub fn subscribe_leadership(&self) -> watch::Receiver<Option<Leadership>> {
        self.leadership.subscribe()
    }

    /// The current leader as stored, if any.
    pub async fn leader_record(&self) -> Option<LeaderRecord> {
        let kv = self.store.get(&self.keys.leader()).await.ok()??;
        serde_json::from_slice(&kv.value).ok()
    }

    /// Reads the map from the store (not the cache): the map and its key's
    /// revision, `None` before the cluster exists.
    async fn read_map(&self) -> Result<Option<(ClusterMap, u64)>, CoordinatorError> {
        match self.store.get(&self.keys.map()).await? {
            Some(kv) => Ok(Some((decode_map(&kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    /// Applies `change` to the current map as the leader: `change` returns
    /// `None` to leave the map alone, or extra operations for the same
    /// transaction. The write is fenced by this leader's generation and
    /// retried if another write raced it. Returns the map after.
    pub async fn update_map<F>(&self, change: F) -> Result<Arc<ClusterMap>, CoordinatorError>
    where
        F: FnMut(&mut ClusterMap) -> Result<Option<Vec<Op>>, CoordinatorError>,
    {
        self.change_map(change, false).await
    }

    /// [`Shared::update_map`]; `restoring` lets it write while the store is
    /// behind the nodes, or holds no map (`RestoreMap`). The new version is
    /// one above the
    /// larger of the stored one and the one `change` leaves (and, restoring,
    /// the cached one).
    pub(crate) async fn change_map<F>(
        &self,
        mut change: F,
        restoring: bool,
    ) -> Result<Arc<ClusterMap>, CoordinatorError>
    where
        F: FnMut(&mut ClusterMap) -> Result<Option<Vec<Op>>, CoordinatorError>,
    {
        loop {
            let Some(leadership) = self.leadership() else {
                return Err(CoordinatorError::NotLeader);
            };
            // Before the read: the cache holds only versions the store held
            // before it, so the read cannot be older unless the store went
            // back (a version cached after the read may be newer).
            let seen = self.map().version;
            // A restore may find no map at all (etcd lost its data under a
            // running coordinator): it creates the key.
            let (current, map_compare) = match self.read_map().await? {
                Some((map, revision)) => (map, Compare::ModRevision(self.keys.map(), revision)),
                None if restoring => (ClusterMap::default(), Compare::Absent(self.keys.map())),
                None if seen == 0 => {
                    return Err(CoordinatorError::Corrupt(
                        "the cluster map is missing".into(),
                    ));
                }
                // It served a map the store no longer holds: the store lost
                // its data under it, and is behind every map there is.
                None => return Err(self.store_went_back(seen, 0)),
            };
            let mut next = current.clone();
            // A refusal is judged on the map read here: the cache takes it
            // too (a caller waiting for the nodes to hold the map the
            // refusal names must not wait on an older one).
            let changed = change(&mut next);
            if changed.is_err() {
                self.publish(current.clone());
            }
            let Some(mut ops) = changed? else {
                self.publish(current.clone());
                return Ok(Arc::new(current));
            };
            // Only writes are refused while the store is behind (a node
            // registering again unchanged is not a write).
            if !restoring && let Some(behind) = self.store_behind() {
                return Err(CoordinatorError::Conflict(behind.explain()));
            }
            if !restoring && current.version < seen {
                // The store went back under this coordinator: it saw newer.
                return Err(self.store_went_back(seen, current.version));
            }
            // A restored map goes above what the cache served too (nodes
            // took it), though the store was behind it.
            let served = if restoring { seen } else { 0 };
            next.version = next_version(next.version.max(current.version).max(served))?;
            ops.push(Op::Put {
                key: self.keys.map(),
                value: bounded_map(&next)?,
                lease: None,
            });
            let compares = vec![
                Compare::ModRevision(self.keys.leader(), leadership.generation),
                map_compare,
            ];
            if self.store.txn(compares, ops).await?.succeeded {
                self.publish(next.clone());
                return Ok(Arc::new(next));
            }
            if !self.still_leader(leadership).await? {
                self.step_down(leadership, "the leader key changed");
                return Err(CoordinatorError::NotLeader);
            }
        }
    }

    /// Marks the store behind the map version `seen` this coordinator
    /// served (the store holds `store_version`), and says why a write is
    /// refused.
    fn store_went_back(&self, seen: u64, store_version: u64) -> CoordinatorError {
        let behind = StoreBehind {
            node_id: 0,
            node_version: seen,
            store_version,
        };
        let mut mark = self.store_behind.lock();
        match *mark {
            Some(known) if known.node_version >= seen => {
                CoordinatorError::Conflict(known.explain())
            }
            _ => {
                tracing::error!("{}", behind.explain());
                *mark = Some(behind);
                CoordinatorError::Conflict(behind.explain())
            }
        }
    }

    /// Applies `change` to the stored map under a compare-and-swap of its
    /// revision alone, without leadership: for idempotent adoptions at
    /// start-up (a leader's concurrent write makes one of the two retry).
    /// Returns whether `change` changed anything.
    pub(crate) async fn change_map_unled<F>(&self, mut change: F) -> Result<bool, CoordinatorError>
    where
        F: FnMut(&mut ClusterMap) -> bool,
    {
        loop {
            let Some((current, revision)) = self.read_map().await? else {
                return Err(CoordinatorError::Corrupt(
                    "the cluster map is missing".into(),
                ));
            };
            let mut next = current.clone();
            if !change(&mut next) {
                return Ok(false);
            }
            next.version = next_version(current.version)?;
            let ops = vec![Op::Put {
                key: self.keys.map(),
                value: bounded_map(&next)?,
                lease: None,
            }];
            let compares = vec![Compare::ModRevision(self.keys.map(), revision)];
            if self.store.txn(compares, ops).await?.succeeded {
                self.publish(next);
                return Ok(true);
            }
        }
    }

    async fn still_leader(&self, leadership: Leadership) -> Result<bool, CoordinatorError> {
        let kv = self.store.get(&self.keys.leader()).await?;
        Ok(kv.is_some_and(|kv| kv.mod_revision == leadership.generation))
    }

    fn step_down(&self, leadership: Leadership, why: &str) {
        let changed = self.leadership.send_if_modified(|current| {
            if *current == Some(leadership) {
                *current = None;
                true
            } else {
                false
            }
        });
        if changed && why == STOPPING {
            tracing::info!(coordinator = %self.id, generation = leadership.generation, "resigning as leader: {why}");
        } else if changed {
            tracing::warn!(
                coordinator = %self.id,
                generation = leadership.generation,
                "stepping down as leader: {why}"
            );
        }
    }

    /// Creates the cluster map if the store holds none (any replica may;
    /// the first wins).
    pub async fn ensure_cluster(&self) -> Result<(), CoordinatorError> {
        if self.read_map().await?.is_some() {
            return Ok(());
        }
        let c = &self.config.cluster;
        let map = new_map(c.shards, c.replication_factor, c.max_value_bytes);
        let ops = vec![
            Op::Put {
                key: self.keys.map(),
                value: encode_map(&map),
                lease: None,
            },
            Op::Put {
                key: self.keys.epoch_started(),
                value: unix_ms().to_string().into_bytes(),
                lease: None,
            },
        ];
        let created = self
            .store
            .txn(vec![Compare::Absent(self.keys.map())], ops)
            .await?;
        if created.succeeded {
            tracing::info!(
                cluster_id = %map.cluster_id,
                shards = c.shards,
                replication_factor = c.replication_factor,
                "created the cluster"
            );
        }
        Ok(())
    }

    /// Reads the stored map into the cache (before serving, so no caller
    /// ever sees an empty map from a coordinator whose cluster exists).
    pub async fn load_map(&self) -> Result<(), CoordinatorError> {
        if let Some((map, _)) = self.read_map().await? {
            self.publish(map);
        }
        Ok(())
    }

    /// Keeps the cached map current until `stop` fires.
    pub async fn follow_map(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut delay = Duration::from_millis(200);
        loop {
            let mut healthy = false;
            let followed = async {
                // Watch first, then read: nothing between the two is missed.
                let key = self.keys.map();
                let mut events = self.store.watch(&key, 0).await?;
                if let Some((map, _)) = self.read_map().await? {
                    self.publish(map);
                }
                healthy = true;
                while let Some(event) = events.recv().await {
                    // A watch is by prefix: another cluster's keys under a
                    // longer prefix (`/tidepool/map-b/…` beside
                    // `/tidepool/map`) are not this cluster's map.
                    if let WatchEvent::Put(kv) = event
                        && kv.key == key
                    {
                        self.publish(decode_map(&kv.value)?);
                    }
                }
                Ok::<(), CoordinatorError>(())
            };
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                result = followed => {
                    if let Err(error) = result {
                        tracing::warn!(%error, "cluster map watch broke; watching again in {delay:?}");
                    }
                }
            }
            // Back off while the store is unreachable; start over once a
            // watch got going.
            delay = if healthy {
                Duration::from_millis(200)
            } else {
                (delay * 2).min(Duration::from_secs(5))
            };
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Campaigns for leadership and holds it while the lease renews, until
    /// `stop` fires (then resigns, so another replica takes over at once).
    pub async fn campaign(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let ttl = self.config.leader_lease();
        let record = serde_json::to_vec(&LeaderRecord {
            id: self.id.clone(),
            address: self.address.clone(),
        })
        .expect("serializable");
        loop {
            let won = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                won = self.try_win(ttl, &record) => won,
            };
            match won {
                Ok(Some((leadership, asked))) => {
                    // A quarter of the lease at most, its store reads
                    // included: the lease renews only once this leads.
                    // Each node's answer within half of that, so the
                    // answers that came are compared even if a node hangs.
                    let patience = (ttl / 8).min(Duration::from_secs(1));
                    let _ = tokio::time::timeout(ttl / 4, self.ask_nodes_for_their_maps(patience))
                        .await;
                    // The lease runs from when the store was asked for it:
                    // with half of it gone (a slow store), another may win
                    // before the first renewal; this one does not lead on it.
                    if asked.elapsed() >= ttl / 2 {
                        tracing::warn!(
                            coordinator = %self.id,
                            "half the leader lease went by before leading: giving it back"
                        );
                        let _ = tokio::time::timeout(ttl / 4, self.store.revoke(leadership.lease))
                            .await;
                    } else {
                        tracing::info!(
                            coordinator = %self.id,
                            generation = leadership.generation,
                            "became the coordinator leader"
                        );
                        self.leadership.send_replace(Some(leadership));
                        let resigned = self.hold(leadership, ttl, asked, &mut stop).await;
                        if resigned {
                            let _ = self.store.revoke(leadership.lease).await;
                            return;
                        }
                    }
                }
                Ok(None) => {}
                Err(error) => tracing::warn!(%error, "election attempt failed"),
            }
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(ttl / 4) => {}
            }
        }
    }

    /// Before leading: the map versions the nodes of the store's map hold
    /// (`NodeAdmin.HeldMap`, waiting `patience` at most), so a store
    /// restored from an older backup under a coordinator that starts or
    /// takes over is caught before its first change — heartbeats tell
    /// within a third of a node lease, and an admin call can come sooner.
    /// A node that does not answer in time tells at its next heartbeat.
    async fn ask_nodes_for_their_maps(&self, patience: Duration) {
        let map = match self.read_map().await {
            Ok(Some((map, _))) => map,
            // The store lost its data under this coordinator: the nodes of
            // the map it served.
            Ok(None) => (*self.map()).clone(),
            Err(error) => {
                tracing::warn!(%error, "cannot read the map to ask the nodes for theirs");
                return;
            }
        };
        let nodes = Arc::new(crate::nodes::NodeClients::new(self.security.clone()));
        let mut calls = tokio::task::JoinSet::new();
        for node in map.nodes.iter() {
            let (nodes, node_id, address) = (nodes.clone(), node.node_id, node.address.clone());
            let cluster = map.cluster_id.clone();
            calls.spawn(async move {
                let held =
                    tokio::time::timeout(patience, crate::ops::held_map(&nodes, &address)).await;
                match held {
                    Ok(Ok(held)) if held.cluster_id == cluster => Some((node_id, held.version)),
                    _ => None,
                }
            });
        }
        let held = calls.join_all().await.into_iter().flatten();
        if let Err(error) = self.note_node_maps(held, false).await {
            tracing::warn!(%error, "cannot compare the nodes' maps with the store's");
        }
    }

    /// The leader key, if nobody holds it: the leadership, and when its
    /// lease was asked for (it runs from when the store granted it).
    async fn try_win(
        &self,
        ttl: Duration,
        record: &[u8],
    ) -> Result<Option<(Leadership, Instant)>, CoordinatorError> {
        if self.store.get(&self.keys.leader()).await?.is_some() {
            return Ok(None);
        }
        let asked = Instant::now();
        let lease = self.store.grant_lease(ttl).await?;
        let put = Op::Put {
            key: self.keys.leader(),
            value: record.to_vec(),
            lease: Some(lease),
        };
        let outcome = self
            .store
            .txn(vec![Compare::Absent(self.keys.leader())], vec![put])
            .await?;
        if outcome.succeeded {
            Ok(Some((
                Leadership {
                    generation: outcome.revision,
                    lease,
                },
                asked,
            )))
        } else {
            let _ = self.store.revoke(lease).await;
            Ok(None)
        }
    }

    /// Renews the lease (granted when asked for at `granted`) until it is
    /// lost (returns false) or `stop` fires (returns true).
    async fn hold(
        &self,
        leadership: Leadership,
        ttl: Duration,
        granted: Instant,
        stop: &mut watch::Receiver<bool>,
    ) -> bool {
        let mut renewed = granted;
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => {
                    self.step_down(leadership, STOPPING);
                    return true;
                }
                _ = tokio::time::sleep(ttl / 6) => {}
            }
            if self.leadership() != Some(leadership) {
                return false;
            }
            // Each call bounded (the store client's own timeout, 10 s, is
            // longer than a lease: a leader whose store stopped answering
            // acted on for seconds after another could have won), and the
            // renewal dated from when it was asked (the lease runs from
            // when the store took it).
            let bound = ttl / 6;
            let asked = Instant::now();
            match tokio::time::timeout(bound, self.store.keep_alive(leadership.lease)).await {
                Ok(Ok(true)) => {
                    renewed = asked;
                    let still = tokio::time::timeout(bound, self.still_leader(leadership)).await;
                    if let Ok(Ok(false)) = still {
                        self.step_down(leadership, "the leader key changed");
                        let _ =
                            tokio::time::timeout(bound, self.store.revoke(leadership.lease)).await;
                        return false;
                    }
                }
                Ok(Ok(false)) => {
                    self.step_down(leadership, "the lease expired");
                    return false;
                }
                Ok(Err(error)) => {
                    tracing::warn!(%error, "cannot renew the leader lease");
                }
                Err(_) => {
                    tracing::warn!(
                        bound_ms = bound.as_millis() as u64,
                        "the store did not answer a leader lease renewal in time"
                    );
                }
            }
            if renewed.elapsed() > ttl / 2 {
                self.step_down(leadership, "the lease could not be renewed");
                let _ = tokio::time::timeout(ttl / 6, self.store.revoke(leadership.lease)).await;
                return false;
            }
        }
    }
}

/// Largest encoded cluster map stored: etcd refuses requests over 1.5 MiB
/// by default, and a map it refused made every change fail as if the
/// store were down (`NO_QUORUM`), its cause hidden.
pub const MAX_MAP_BYTES: usize = 1 << 20;

/// `map` encoded, or `INVALID_ARGUMENT` naming its size if over
/// [`MAX_MAP_BYTES`] (the change that made it so is refused; the map
/// stays as it was).
fn bounded_map(map: &ClusterMap) -> Result<Vec<u8>, CoordinatorError> {
    let bytes = encode_map(map);
    if bytes.len() > MAX_MAP_BYTES {
        return Err(CoordinatorError::InvalidArgument(format!(
            "the change would make the cluster map {} bytes, over its {MAX_MAP_BYTES}-byte limit \
             ({} nodes, {} shards, {} namespaces, {} tokens)",
            bytes.len(),
            map.nodes.len(),
            map.shards.len(),
            map.namespaces.len(),
            map.tokens.len()
        )));
    }
    Ok(bytes)
}

/// The version after `version`: `CONFLICT` at the end of the range (a
/// map stored at `u64::MAX` wrapped to 0, below every node's).
fn next_version(version: u64) -> Result<u64, CoordinatorError> {
    version
        .checked_add(1)
        .ok_or_else(|| CoordinatorError::Conflict("map versions are exhausted".into()))
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether a cluster id a node sent can name a store key: ids this
/// coordinator makes are 16 hex digits (`static` for a fixed cluster).
fn storable_cluster_id(cluster_id: &str) -> bool {
    !cluster_id.is_empty()
        && cluster_id.len() <= 64
        && cluster_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A change that would make the map too large for the store is refused
    /// with its size (`INVALID_ARGUMENT`), not sent for etcd to refuse as if
    /// down; version arithmetic stops at the end of the range.
    #[test]
    fn a_map_over_its_limit_and_the_last_version_are_refused() {
        let mut map = ClusterMap::default();
        assert!(bounded_map(&map).is_ok());
        map.tokens = (0..15_000)
            .map(|i| tidepool_proto::v1::TokenRecord {
                name: format!("token-{i:06}-with-a-long-descriptive-name"),
                sha256: vec![7; 32],
                ..Default::default()
            })
            .collect();
        match bounded_map(&map) {
            Err(CoordinatorError::InvalidArgument(why)) => {
                assert!(why.contains("15000 tokens"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(next_version(7).unwrap(), 8);
        assert!(matches!(
            next_version(u64::MAX),
            Err(CoordinatorError::Conflict(_))
        ));
    }

    fn behind(node_id: u64, node_version: u64, store_version: u64) -> Option<StoreBehind> {
        Some(StoreBehind {
            node_id,
            node_version,
            store_version,
        })
    }

    #[test]
    fn a_node_ahead_of_the_store_marks_it_behind() {
        assert_eq!(next_mark(None, 2, 9, Some(5)), behind(2, 9, 5));
        assert_eq!(next_mark(None, 2, 5, Some(5)), None);
        // Not read: nothing learned.
        assert_eq!(next_mark(None, 2, 9, None), None);
        assert_eq!(next_mark(behind(2, 9, 5), 0, 5, None), behind(2, 9, 5));
    }

    #[test]
    fn the_mark_stays_though_its_node_stops_reporting() {
        // A round with no report of node 2 (or only older maps): the store
        // is still behind the version node 2 held.
        assert_eq!(next_mark(behind(2, 9, 5), 0, 5, Some(5)), behind(2, 9, 5));
        assert_eq!(next_mark(behind(2, 9, 5), 1, 7, Some(5)), behind(2, 9, 5));
    }

    #[test]
    fn only_a_newer_version_replaces_the_mark() {
        assert_eq!(next_mark(behind(2, 9, 5), 3, 12, Some(5)), behind(3, 12, 5));
        assert_eq!(next_mark(behind(2, 9, 5), 3, 9, Some(6)), behind(2, 9, 6));
    }

    #[test]
    fn a_store_holding_the_version_clears_the_mark() {
        assert_eq!(next_mark(behind(2, 9, 5), 0, 10, Some(10)), None);
        assert_eq!(next_mark(behind(2, 9, 5), 2, 9, Some(9)), None);
        // Caught up with the mark, behind a newer one.
        assert_eq!(
            next_mark(behind(2, 9, 5), 1, 11, Some(10)),
            behind(1, 11, 10)
        );
    }
}
