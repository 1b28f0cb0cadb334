//! Cluster operations behind the coordinator's API: registering nodes,
//! heartbeats, namespaces, epochs and drains. Each change to the map is one
//! fenced compare-and-swap (`Shared::update_map`).

use std::sync::Arc;

use prost::Message as _;
use tidepool_proto::v1::{
    ClusterMap, HeldMapRequest, Namespace, NodeInfo, NodeState, NodeStatus,
    PrepareNodeStopResponse, RegisterNodeRequest, Retention, retention::Policy,
};

use crate::CoordinatorError;
use crate::core::{Shared, unix_ms};
use crate::meta::Op;
use crate::schema::durable;

/// Longest node address stored in the map.
const MAX_ADDRESS: usize = 256;
/// Longest zone label.
const MAX_ZONE: usize = 64;
/// How far above the highest node id in the map a registering node's own
/// id may be (ids a restored map lost, handed out since its backup).
const UNKNOWN_NODE_ID_SLACK: u64 = 1_024;

fn check_retention(retention: Option<Retention>) -> Result<Retention, CoordinatorError> {
    let retention = retention.unwrap_or_else(durable);
    match &retention.policy {
        None => Ok(durable()),
        Some(Policy::Retain(r)) if r.epochs == 0 => Err(CoordinatorError::InvalidArgument(
            "retention.retain.epochs must be at least 1".into(),
        )),
        Some(_) => Ok(retention),
    }
}

impl Shared {
    /// Adds a node to the map (a new id when `node_id` is 0) or updates
    /// the address, zone and capacity of a known one. Returns its id and
    /// the map after.
    ///
    /// `identity` is the name in the caller's node certificate (`None` on
    /// an insecure coordinator): a new node is bound to it, an unbound one
    /// (registered before TLS) is bound now, and a node bound to another
    /// name is refused — a certificate speaks only for its own node.
    pub async fn register_node(
        &self,
        request: RegisterNodeRequest,
        identity: Option<&str>,
    ) -> Result<(u64, Arc<ClusterMap>), CoordinatorError> {
        let address = request.address.trim().to_string();
        if !(address.starts_with("http://") || address.starts_with("https://")) {
            return Err(CoordinatorError::InvalidArgument(format!(
                "address must be an http:// or https:// URL, not {address:?}"
            )));
        }
        if address.len() > MAX_ADDRESS || request.zone.len() > MAX_ZONE {
            return Err(CoordinatorError::InvalidArgument(format!(
                "address is at most {MAX_ADDRESS} bytes and zone at most {MAX_ZONE}"
            )));
        }
        let (looked_up, wanted) = self.kubernetes_view(&request.zone, identity).await;
        let rejoining = wanted.unwrap_or(false);
        let mut zone = looked_up.clone().unwrap_or_else(|| request.zone.clone());
        let mut assigned = 0;
        let map = self
            .update_map(|map| {
                if !request.cluster_id.is_empty() && request.cluster_id != map.cluster_id {
                    return Err(wrong_cluster(
                        request.node_id,
                        &request.cluster_id,
                        &map.cluster_id,
                    ));
                }
                let id = if request.node_id != 0 {
                    // An id the map lacks is taken back (a node whose id a
                    // restored map lost) only near the ids handed out: one
                    // picked at u64::MAX exhausted every id for good.
                    let last = map.nodes.iter().map(|n| n.node_id).max().unwrap_or(0);
                    if !map.nodes.iter().any(|n| n.node_id == request.node_id)
                        && request.node_id > last.saturating_add(UNKNOWN_NODE_ID_SLACK)
                    {
                        return Err(CoordinatorError::InvalidArgument(format!(
                            "node id {} was never handed out here (the highest is {last}); register with 0 for a new id",
                            request.node_id
                        )));
                    }
                    request.node_id
                } else if let Some(earlier) = identity.and_then(|name| {
                    map.nodes.iter().find(|n| {
                        n.identity == name
                            && n.state == NodeState::Up as i32
                            && n.address == address
                            && !map
                                .shards
                                .iter()
                                .any(|s| s.replicas.iter().any(|r| r.node_id == n.node_id))
                    })
                }) {
                    // The same certificate at the same address asking
                    // again for a new id, and its id holds nothing yet: an
                    // answer it never got (lost, or the first heartbeat
                    // failed after the map took the id). A second id left
                    // the first in the map, counted live until the down
                    // grace period ran out, placement choosing it meanwhile.
                    earlier.node_id
                } else if let Some(live) = identity.and_then(|name| {
                    map.nodes
                        .iter()
                        .find(|n| n.identity == name && n.state == NodeState::Up as i32)
                }) {
                    // A certificate whose node is up asking for another
                    // id: one certificate registered as many nodes as it
                    // liked (any address string will do), each placed as a
                    // node of its own — several replicas of a shard on one
                    // process, the map filled up. A node that lost its
                    // volume gets its new id once its old one is down (it
                    // retries).
                    return Err(CoordinatorError::Conflict(format!(
                        "certificate {:?} is node {}, which is up: a new id is given only once it is down",
                        live.identity, live.node_id
                    )));
                } else {
                    let last = map.nodes.iter().map(|n| n.node_id).max().unwrap_or(0);
                    last.checked_add(1).ok_or_else(|| {
                        CoordinatorError::Conflict("node ids are exhausted".into())
                    })?
                };
                assigned = id;
                let info = NodeInfo {
                    node_id: id,
                    address: address.clone(),
                    zone: zone.clone(),
                    capacity_bytes: request.capacity_bytes,
                    state: NodeState::Up as i32,
                    identity: identity.unwrap_or_default().to_string(),
                    scale_down: false,
                };
                match map.nodes.iter_mut().find(|n| n.node_id == id) {
                    Some(known) => {
                        if known.scale_down && wanted.is_none() {
                            // Whether the StatefulSet grew back over it is
                            // what registering decides for a scaled-away
                            // node: the node asks again.
                            return Err(CoordinatorError::Kubernetes(format!(
                                "node {id} was scaled away and the Kubernetes API does not say whether its pod is wanted again; retry"
                            )));
                        }
                        if looked_up.is_none() {
                            zone = known.zone.clone();
                        }
                        let bound = match identity {
                            None => known.identity.clone(),
                            Some(name) if known.identity.is_empty() || known.identity == name => {
                                name.to_string()
                            }
                            Some(name) => {
                                return Err(CoordinatorError::PermissionDenied(format!(
                                    "node {id} is bound to certificate {:?}, not {name:?}",
                                    known.identity
                                )));
                            }
                        };
                        // A pod scaled away and back: in the cluster again.
                        let undrain = rejoining && known.scale_down;
                        if undrain {
                            tracing::info!(
                                node_id = id,
                                "StatefulSet grew back over the node; undrained"
                            );
                        }
                        let updated = NodeInfo {
                            state: if undrain { info.state } else { known.state },
                            identity: bound,
                            scale_down: known.scale_down && !undrain,
                            zone: zone.clone(),
                            ..info
                        };
                        if *known == updated {
                            return Ok(None);
                        }
                        *known = updated;
                    }
                    None => {
                        map.nodes.push(info);
                        map.nodes.sort_by_key(|n| n.node_id);
                    }
                }
                Ok(Some(Vec::new()))
            })
            .await
            .inspect_err(|error| {
                if let CoordinatorError::WrongCluster(_) = error {
                    self.note_refused(request.node_id, &address, &request.cluster_id);
                }
            })?;
        tracing::info!(node_id = assigned, %address, %zone, "node registered");
        // Live from now: the first heartbeat follows within a third of the
        // lease.
        let first = NodeStatus {
            node_id: assigned,
            address,
            ..NodeStatus::default()
        };
        self.heartbeat(first, identity).await?;
        Ok((assigned, map))
    }

    /// Refuses a node (at `address`) that says it belongs to another
    /// cluster than this coordinator's (`cluster_id` empty: it does not
    /// say), and lists it in the status.
    pub fn same_cluster(
        &self,
        node_id: u64,
        address: &str,
        cluster_id: &str,
    ) -> Result<(), CoordinatorError> {
        let map = self.map();
        if cluster_id.is_empty() || map.cluster_id.is_empty() || cluster_id == map.cluster_id {
            return Ok(());
        }
        self.note_refused(node_id, address, cluster_id);
        Err(wrong_cluster(node_id, cluster_id, &map.cluster_id))
    }

    /// Records a node's status under its liveness lease (granting a new
    /// lease when this replica has none for it or it expired).
    ///
    /// `identity`: the caller's node certificate name (`None` on an
    /// insecure coordinator); it must be the one the node is bound to.
    pub async fn heartbeat(
        &self,
        status: NodeStatus,
        identity: Option<&str>,
    ) -> Result<(), CoordinatorError> {
        let id = status.node_id;
        let map = self.map();
        let Some(node) = map.nodes.iter().find(|n| n.node_id == id) else {
            return Err(CoordinatorError::UnknownNode(id));
        };
        check_bound(node, identity)?;
        let known = self.node_leases.lock().get(&id).copied();
        let lease = match known {
            Some(lease) if self.store.keep_alive(lease).await? => lease,
            _ => {
                let lease = self.store.grant_lease(self.config.node_lease()).await?;
                self.node_leases.lock().insert(id, lease);
                lease
            }
        };
        let put = Op::Put {
            key: self.keys.node(id),
            value: status.encode_to_vec(),
            lease: Some(lease),
        };
        self.store.txn(Vec::new(), vec![put]).await?;
        Ok(())
    }

    /// Creates a namespace with the next free id.
    pub async fn create_namespace(
        &self,
        name: &str,
        content_addressed: bool,
        retention: Option<Retention>,
    ) -> Result<Namespace, CoordinatorError> {
        tidepool_proto::validate_namespace_name(name)
            .map_err(|e| CoordinatorError::InvalidArgument(format!("namespace name: {e}")))?;
        let retention = check_retention(retention)?;
        let mut created = None;
        self.update_map(|map| {
            if map.namespaces.iter().any(|ns| ns.name == name) {
                return Err(CoordinatorError::NamespaceExists(name.to_string()));
            }
            let id = next_namespace_id(map);
            if id == u32::MAX {
                return Err(CoordinatorError::Conflict(
                    "namespace ids are exhausted".into(),
                ));
            }
            map.next_namespace_id = id + 1;
            let namespace = Namespace {
                name: name.to_string(),
                id,
                content_addressed,
                retention: Some(retention),
                created_epoch: map.epoch,
            };
            created = Some(namespace.clone());
            map.namespaces.push(namespace);
            map.namespaces.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(Some(Vec::new()))
        })
        .await?;
        let namespace = created.expect("set by the successful change");
        tracing::info!(name, id = namespace.id, "namespace created");
        Ok(namespace)
    }

    /// Changes a namespace's retention.
    pub async fn set_retention(
        &self,
        name: &str,
        retention: Option<Retention>,
    ) -> Result<Namespace, CoordinatorError> {
        let retention = check_retention(retention)?;
        // No drop computed with the old retention is in flight, nor starts
        // before the change is in the map (`Shared::epoch_drops`); every
        // drop computed after it reads the new map, so the gate is not held
        // while the shards record it (up to 20 s each call: held, it kept
        // the reconciler's epoch step waiting shard after shard).
        let drops = self.epoch_drops.lock().await;
        let map = self
            .update_map(|map| {
                let ns = map
                    .namespaces
                    .iter_mut()
                    .find(|ns| ns.name == name)
                    .ok_or_else(|| CoordinatorError::NamespaceNotFound(name.to_string()))?;
                if ns.retention.as_ref() == Some(&retention) {
                    return Ok(None);
                }
                // Durable is a one-way door: whoever holds the admin
                // credential cannot make a backup store's blobs expire.
                if is_durable(ns.retention.as_ref()) && !is_durable(Some(&retention)) {
                    return Err(CoordinatorError::InvalidArgument(format!(
                        "namespace {name:?} is durable: its retention cannot be changed to one that expires blobs"
                    )));
                }
                ns.retention = Some(retention);
                Ok(Some(Vec::new()))
            })
            .await?;
        drop(drops);
        let namespace = map
            .namespaces
            .iter()
            .find(|ns| ns.name == name)
            .cloned()
            .expect("present after the change");
        // Answered only once every shard holds it (a call repeated with
        // the same retention finishes the job): a drop computed under the
        // former retention is refused from then on, wherever it is.
        self.record_retention(&map, &namespace).await?;
        Ok(namespace)
    }

    /// Starts the next cluster epoch; with `expected` non-zero, only if the
    /// current epoch is `expected`. Returns the new epoch.
    pub async fn advance_epoch(&self, expected: u64) -> Result<u64, CoordinatorError> {
        let map = self
            .update_map(|map| {
                if expected != 0 && map.epoch != expected {
                    return Err(CoordinatorError::Conflict(format!(
                        "the epoch is {}, not {expected}",
                        map.epoch
                    )));
                }
                if map.epoch >= u64::from(u32::MAX) {
                    return Err(CoordinatorError::InvalidArgument(
                        "the epoch counter is exhausted".into(),
                    ));
                }
                map.epoch += 1;
                Ok(Some(vec![Op::Put {
                    key: self.keys.epoch_started(),
                    value: unix_ms().to_string().into_bytes(),
                    lease: None,
                }]))
            })
            .await?;
        tracing::info!(epoch = map.epoch, "epoch advanced");
        Ok(map.epoch)
    }

    /// [`advance_epoch`](Self::advance_epoch), answered once every live
    /// node holds the new map: a node stamps a write with the later of its
    /// map's epoch and its shard's, and the shards follow the map, so a
    /// write a lagging node took after the answer was stamped with the
    /// epoch before and expired one epoch early. Returns the new epoch and
    /// the live nodes still behind when the wait ended (`map_taken`). A
    /// refusal (`CONFLICT`: the epoch moved) waits alike, so a caller whose
    /// answer was lost, repeating the call and reading the refusal as its
    /// success, learns as much; nodes still behind are named in its
    /// message.
    pub async fn advance_epoch_confirmed(
        &self,
        expected: u64,
    ) -> Result<(u64, Vec<u64>), CoordinatorError> {
        match self.advance_epoch(expected).await {
            Ok(epoch) => {
                let behind = self.map_taken(self.map().version).await;
                if !behind.is_empty() {
                    tracing::warn!(
                        epoch,
                        nodes = ?behind,
                        "epoch advanced; live nodes have not taken its map yet: writes they take carry the epoch before until they do"
                    );
                }
                Ok((epoch, behind))
            }
            Err(CoordinatorError::Conflict(message)) => {
                // The refusal published the map it read (`change_map`).
                let behind = self.map_taken(self.map().version).await;
                Err(CoordinatorError::Conflict(if behind.is_empty() {
                    message
                } else {
                    format!("{message} (live nodes {behind:?} have not taken its map yet)")
                }))
            }
            Err(error) => Err(error),
        }
    }

    /// Waits until every node holding a liveness lease holds map `version`
    /// or a newer one, as its last heartbeat or a status call now says, and
    /// returns the nodes not confirmed after two node leases, or when the
    /// coordinator stops (empty: every live node holds it): those last seen
    /// behind, or — the store never read — every node of the map. A node
    /// whose lease ended is no longer waited for: cut off from every
    /// coordinator, it serves with the map it has until a heartbeat
    /// succeeds again (a known gap, `docs/design/epochs-cluster.md`). A
    /// live node still behind after the wait is heartbeating, yet neither
    /// its watch nor its own fetch brought it the map. Never fails: the
    /// change it follows is made, and a failure would be taken for the
    /// change's (a retried revocation answered "no such token").
    pub(crate) async fn map_taken(&self, version: u64) -> Vec<u64> {
        let deadline = tokio::time::Instant::now() + self.config.node_lease() * 2;
        let mut stopping = self.stopping();
        let mut behind: Option<std::collections::BTreeSet<u64>> = None;
        loop {
            let map = self.map();
            match crate::reconcile::alive(self).await {
                Ok(alive) => {
                    let mut now: std::collections::BTreeSet<u64> = alive
                        .into_iter()
                        .filter(|(id, status)| {
                            status.map_version < version
                                && map.nodes.iter().any(|n| n.node_id == *id)
                        })
                        .map(|(id, _)| id)
                        .collect();
                    if !now.is_empty() {
                        let polled = self.poll_statuses(&map, &now, MAP_POLL_TIMEOUT).await;
                        now.retain(|id| polled.get(id).is_none_or(|s| s.map_version < version));
                    }
                    if now.is_empty() {
                        return Vec::new();
                    }
                    behind = Some(now);
                }
                Err(error) => {
                    tracing::warn!(%error, "the store failed while waiting for nodes to take a map");
                }
            }
            if tokio::time::Instant::now() >= deadline || *stopping.borrow() {
                return match behind {
                    Some(behind) => behind.into_iter().collect(),
                    None => map.nodes.iter().map(|n| n.node_id).collect(),
                };
            }
            tokio::select! {
                () = tokio::time::sleep(MAP_POLL_PAUSE) => {}
                _ = stopping.changed() => {}
            }
        }
    }

    /// Under Kubernetes, what it says of the pod registering as node
    /// certificate `identity`: its zone (`reported` when not under
    /// Kubernetes or the node has no zone label; `None` when the API
    /// failed: a known node keeps the zone the map has), and whether the
    /// node StatefulSet wants the pod (it grew back over a scaled-away
    /// node; `None` when the API failed). Failures are logged.
    async fn kubernetes_view(
        &self,
        reported: &str,
        identity: Option<&str>,
    ) -> (Option<String>, Option<bool>) {
        let (Some(k8s), Some(pod)) = (self.orchestrator(), identity) else {
            return (Some(reported.to_string()), Some(false));
        };
        let zone = match k8s.zone_of_pod(pod).await {
            // A zone the node was given (`--zone`) over the host
            // fallback: the operator said where it is.
            Ok(Some(zone))
                if zone.starts_with(crate::kubernetes::HOST_DOMAIN_PREFIX)
                    && !reported.is_empty() =>
            {
                Some(reported.to_string())
            }
            Ok(Some(zone)) if zone.len() <= MAX_ZONE => Some(zone),
            Ok(_) => Some(reported.to_string()),
            Err(error) => {
                tracing::warn!(%error, pod, "zone unknown; a known node keeps its zone");
                None
            }
        };
        let wanted = match crate::kubernetes::ordinal(k8s.statefulset(), pod) {
            None => Some(false),
            Some(ordinal) => match k8s.desired_nodes().await {
                Ok(desired) => Some(desired.is_some_and(|d| ordinal < d)),
                Err(error) => {
                    tracing::warn!(%error, pod, "StatefulSet unknown");
                    None
                }
            },
        };
        (zone, wanted)
    }

    /// The status of every node holding a liveness lease, asked of each
    /// at once (heartbeats are up to their interval apart: a follower's
    /// older one would show it behind a leader's newer commit index); a
    /// node that does not answer within `STATUS_POLL_TIMEOUT` is left out.
    pub(crate) async fn fresh_reports(
        &self,
        map: &ClusterMap,
    ) -> Result<std::collections::BTreeMap<u64, NodeStatus>, CoordinatorError> {
        let alive = crate::reconcile::alive(self).await?.into_keys().collect();
        Ok(self.poll_statuses(map, &alive, STATUS_POLL_TIMEOUT).await)
    }

    /// The status of each of `ids` the map lists, asked of all at once; a
    /// node that does not answer within `timeout` is left out.
    async fn poll_statuses(
        &self,
        map: &ClusterMap,
        ids: &std::collections::BTreeSet<u64>,
        timeout: std::time::Duration,
    ) -> std::collections::BTreeMap<u64, NodeStatus> {
        let mut polls = tokio::task::JoinSet::new();
        for &id in ids {
            let Some(node) = map.nodes.iter().find(|n| n.node_id == id) else {
                continue;
            };
            let Ok(mut client) = self.node_clients.admin(&node.address) else {
                continue;
            };
            polls.spawn(async move {
                let call = client.status(tidepool_proto::v1::NodeStatusRequest {});
                let answer = crate::nodes::NodeClients::call("status", timeout, call).await;
                (id, answer)
            });
        }
        let mut reports = std::collections::BTreeMap::new();
        while let Some(joined) = polls.join_next().await {
            match joined {
                Ok((id, Ok(status))) if status.node_id == id => {
                    reports.insert(id, status);
                }
                Ok((id, Ok(_))) => {
                    tracing::debug!(node_id = id, "another node answers at its address")
                }
                Ok((id, Err(error))) => {
                    tracing::debug!(node_id = id, %error, "no status from a node")
                }
                Err(_) => {}
            }
        }
        reports
    }

    /// A node about to stop asks whether it leaves for good. Under
    /// Kubernetes, a pod at or above its StatefulSet's `spec.replicas` was
    /// scaled away: it is drained (and flagged `scale_down`, so growing the
    /// StatefulSet back undoes it), and must keep serving until it hosts
    /// nothing. Anything else — a restart, an upgrade, the StatefulSet
    /// deleted, no Kubernetes at all — stops at once and keeps its data.
    pub async fn prepare_node_stop(
        &self,
        node_id: u64,
        identity: Option<&str>,
    ) -> Result<PrepareNodeStopResponse, CoordinatorError> {
        let map = self.map();
        let node = map
            .nodes
            .iter()
            .find(|n| n.node_id == node_id)
            .ok_or(CoordinatorError::UnknownNode(node_id))?;
        check_bound(node, identity)?;
        let hosted = |map: &ClusterMap| {
            let listed = map
                .shards
                .iter()
                .filter(|s| s.replicas.iter().any(|r| r.node_id == node_id))
                .count() as u32;
            // Draining is over when the reconciler says so (`Drained`): it
            // also counts replicas the map does not list yet (a split's new
            // group, published a moment after it elects), which the node
            // must not stop under.
            let draining = map
                .nodes
                .iter()
                .any(|n| n.node_id == node_id && n.state == NodeState::Draining as i32);
            if draining { listed.max(1) } else { listed }
        };
        let answer = |leaving, map: &ClusterMap, reason: &str| PrepareNodeStopResponse {
            leaving,
            replicas: hosted(map),
            reason: reason.to_string(),
            quorum_at_risk: 0,
        };
        let Some(k8s) = self.orchestrator() else {
            return Ok(answer(false, &map, "not under Kubernetes: a restart"));
        };
        let Some(ordinal) = crate::kubernetes::ordinal(k8s.statefulset(), &node.identity) else {
            return Ok(answer(
                false,
                &map,
                "not a pod of the node StatefulSet: a restart",
            ));
        };
        let leaving = match k8s
            .desired_nodes()
            .await
            .map_err(CoordinatorError::Kubernetes)?
        {
            None => {
                return Ok(answer(
                    false,
                    &map,
                    "the StatefulSet is being deleted: the node stops and keeps its volume",
                ));
            }
            Some(desired) => ordinal >= desired,
        };
        let mut changed = false;
        let map = self
            .update_map(|map| {
                changed = false;
                let node = map
                    .nodes
                    .iter_mut()
                    .find(|n| n.node_id == node_id)
                    .ok_or(CoordinatorError::UnknownNode(node_id))?;
                let draining = node.state == NodeState::Draining as i32
                    || node.state == NodeState::Drained as i32;
                if leaving && !draining {
                    node.state = NodeState::Draining as i32;
                    node.scale_down = true;
                } else if !leaving && draining && node.scale_down {
                    node.state = NodeState::Up as i32;
                    node.scale_down = false;
                } else {
                    return Ok(None);
                }
                changed = true;
                Ok(Some(Vec::new()))
            })
            .await?;
        let response = if leaving {
            answer(true, &map, "scaled down: draining before the pod goes")
        } else {
            // A restart (a rolling update's): it waits while it would stop
            // shards another member being down leaves at their majority
            // (an uninstall stops everything anyway; not under Kubernetes
            // the operator decides).
            PrepareNodeStopResponse {
                quorum_at_risk: quorum_at_risk(&map, &self.fresh_reports(&map).await?, node_id),
                ..answer(
                    false,
                    &map,
                    "a restart: the StatefulSet still wants the pod",
                )
            }
        };
        if changed && leaving {
            tracing::info!(
                node_id,
                replicas = response.replicas,
                "node pod scaled away; draining it"
            );
        } else if changed {
            tracing::info!(node_id, "StatefulSet grew back over the node; undrained");
        }
        Ok(response)
    }

    /// Puts the newest map the nodes hold back into the store, when the
    /// store lost it (it holds no map: etcd lost its data under this
    /// coordinator; or a new cluster was founded on an emptied store, still
    /// without nodes) or holds an older version of it (restored from an
    /// older snapshot). Asks the node at `address` and every node its map
    /// lists; a node that does not answer refuses the restore unless
    /// `allow_unanswered` (it may hold a newer map than those that did).
    pub async fn restore_map(
        &self,
        address: &str,
        allow_unanswered: bool,
    ) -> Result<Restored, CoordinatorError> {
        let address = address.trim();
        if !(address.starts_with("http://") || address.starts_with("https://"))
            || address.len() > MAX_ADDRESS
        {
            return Err(CoordinatorError::InvalidArgument(format!(
                "node_address must be a node's http:// or https:// URL, not {address:?}"
            )));
        }
        if self.leadership().is_none() {
            return Err(CoordinatorError::NotLeader);
        }
        let nodes = Arc::new(crate::nodes::NodeClients::new(self.security.clone()));
        let held = held_map(&nodes, address).await?;
        if held.cluster_id.is_empty() || held.version == 0 || held.cluster_id == "static" {
            return Err(CoordinatorError::InvalidArgument(format!(
                "the node at {address} holds no coordinated cluster's map (it never joined one, or runs a fixed cluster)"
            )));
        }
        // Every other node of that map, asked at once.
        let mut calls = tokio::task::JoinSet::new();
        for node in held.nodes.iter().filter(|n| n.address != address) {
            let (nodes, other) = (nodes.clone(), node.address.clone());
            let required = must_answer(&held, node);
            calls.spawn(async move {
                let answer = held_map(&nodes, &other).await;
                if let Err(error) = &answer {
                    tracing::warn!(node = %other, %error, required, "restoring the map: no answer");
                }
                (other, answer.ok(), required)
            });
        }
        // A node gone for good with nothing on it (drained and scaled
        // away, or down and rebuilt elsewhere) is not waited for.
        let answers = calls
            .join_all()
            .await
            .into_iter()
            .filter(|(_, answer, required)| answer.is_some() || *required)
            .map(|(address, answer, _)| (address, answer))
            .collect();
        let found = newest_held(address.to_string(), held, answers);
        if !found.unanswered.is_empty() && !allow_unanswered {
            return Err(CoordinatorError::Conflict(format!(
                "nodes {} of cluster {}'s map did not answer, and one of them may hold a newer map than v{} (from {}): start them, or restore without them (--allow-unanswered); nothing changed",
                found.unanswered.join(", "),
                found.map.cluster_id,
                found.map.version,
                found.from
            )));
        }
        // A newer map seen (reported by a node, or cached here) than any
        // answer: its holder did not answer, or is not in the map asked.
        let seen = self
            .store_behind()
            .filter(|b| b.node_version > found.map.version);
        if let Some(seen) = seen
            && !allow_unanswered
        {
            return Err(CoordinatorError::Conflict(format!(
                "{} map v{}, newer than the newest the nodes answered with (v{} from {}): restore when it answers, or without it (--allow-unanswered); nothing changed",
                match seen.node_id {
                    0 => "this coordinator has seen".to_string(),
                    id => format!("node {id} was seen holding"),
                },
                seen.node_version,
                found.map.version,
                found.from
            )));
        }
        // A map newer than the one restored (held by a node that did not
        // answer, or seen) may have handed out namespace and shard ids this
        // one lacks: the next ids skip past them, or a new namespace would
        // take a lost one's id (part of every storage key: it would read its
        // blobs), a new shard a lost split's.
        let skipped_ids = if found.unanswered.is_empty() && seen.is_none() {
            0
        } else {
            let missed = seen.map_or(0, |s| s.node_version.saturating_sub(found.map.version));
            RESTORE_ID_SKIP.saturating_add(u32::try_from(missed).unwrap_or(u32::MAX))
        };
        // The version stored is above every version seen, so every node
        // takes the restored map as the newest. Without every node's answer
        // it is also above any version a node that did not answer can hold:
        // the maps it held and this one's successors are different lines,
        // and versions compare only within one. Were the returning node's
        // map the higher, it would keep it, the store would be reported
        // behind, and the next restore would store it — dropping every
        // change made since this one (namespaces created meanwhile, whose
        // ids the next creations would hand out again).
        let floor = seen.map_or(0, |s| s.node_version);
        let floor = if skipped_ids > 0 {
            floor
                .max(found.map.version)
                .saturating_add(RESTORE_VERSION_SKIP)
        } else {
            floor
        };
        // The restored epoch starts its interval now. A store that lost its
        // data lost the epoch's start too (without one the epoch would
        // advance at once), and one restored from a backup holds the start
        // of the backup's epoch, perhaps long past: either way the restored
        // epoch would be cut short and blobs expire before their
        // retention. Late by up to an interval, never early.
        let epoch_clock = vec![Op::Put {
            key: self.keys.epoch_started(),
            value: unix_ms().to_string().into_bytes(),
            lease: None,
        }];
        let mut previous = (String::new(), 0);
        let held = &found.map;
        let map = self
            .change_map(
                |map| {
                    previous = (map.cluster_id.clone(), map.version);
                    if map.cluster_id == held.cluster_id {
                        if held.version <= map.version {
                            return Err(CoordinatorError::Conflict(format!(
                                "the store's map of cluster {} (v{}) is not older than the nodes' newest (v{}): nothing to restore",
                                map.cluster_id, map.version, held.version
                            )));
                        }
                    } else if !map.nodes.is_empty() {
                        return Err(CoordinatorError::Conflict(format!(
                            "this coordinator's cluster {} has nodes: restoring cluster {}'s map would leave them out",
                            map.cluster_id, held.cluster_id
                        )));
                    }
                    // The stored version becomes one above the store's,
                    // the map's and any seen.
                    *map = held.clone();
                    map.version = map.version.max(floor);
                    if skipped_ids > 0 {
                        map.next_namespace_id = next_namespace_id(map).saturating_add(skipped_ids);
                        map.next_shard_id =
                            crate::splits::next_shard_id(map).saturating_add(skipped_ids);
                    }
                    Ok(Some(epoch_clock.clone()))
                },
                true,
            )
            .await?;
        *self.store_behind_mark() = None;
        tracing::warn!(
            asked = %address,
            from = %found.from,
            held_version = found.map.version,
            unanswered = ?found.unanswered,
            skipped_ids,
            cluster = %map.cluster_id,
            version = map.version,
            previous_cluster = %previous.0,
            previous_version = previous.1,
            "restored the cluster map from the nodes"
        );
        Ok(Restored {
            map,
            previous_cluster_id: previous.0,
            previous_version: previous.1,
            from_node_address: found.from,
            unanswered_nodes: found.unanswered,
            skipped_ids,
        })
    }

    /// Marks a node draining: placement stops using it and the reconciler
    /// moves its replicas away. Returns how many replicas it holds.
    pub async fn drain_node(&self, node_id: u64) -> Result<u32, CoordinatorError> {
        let map = self
            .update_map(|map| {
                let node = map
                    .nodes
                    .iter_mut()
                    .find(|n| n.node_id == node_id)
                    .ok_or(CoordinatorError::UnknownNode(node_id))?;
                if node.state == NodeState::Draining as i32
                    || node.state == NodeState::Drained as i32
                {
                    return Ok(None);
                }
                node.state = NodeState::Draining as i32;
                Ok(Some(Vec::new()))
            })
            .await?;
        let hosted = map
            .shards
            .iter()
            .filter(|s| s.replicas.iter().any(|r| r.node_id == node_id))
            .count();
        tracing::info!(node_id, replicas = hosted, "draining node");
        Ok(hosted as u32)
    }
}

/// What `Shared::restore_map` stored.
#[derive(Debug)]
pub struct Restored {
    /// The map now in the store.
    pub map: Arc<ClusterMap>,
    /// The cluster the store held before.
    pub previous_cluster_id: String,
    /// And its map's version.
    pub previous_version: u64,
    /// The node whose map was stored.
    pub from_node_address: String,
    /// Nodes of the map that did not answer.
    pub unanswered_nodes: Vec<String>,
    /// How far the next namespace and shard ids were moved past the
    /// restored map's (0: every node answered, none seen holding newer).
    pub skipped_ids: u32,
}

/// Ids a restore that went on without a node skips, beyond the map
/// versions it knows it missed: the unanswered node may hold a map newer
/// than any seen, and each map change hands out at most one namespace id
/// and one shard id. A thousand map changes between the last the answering
/// nodes received and the loss of the store is far more than the seconds a
/// map takes to reach every node allow; ids are 32 bits.
pub const RESTORE_ID_SKIP: u32 = 1_024;

/// How far a restore that went on without a node moves the map's version
/// past the newest it saw: a node that did not answer can be ahead of it by
/// the map changes only that node received, and four billion map changes
/// are beyond any cluster's life. A node back with such a map
/// then takes the restored one (same cluster, higher version), so the
/// store is not reported behind it and a later restore cannot store it
/// over the changes made since.
pub const RESTORE_VERSION_SKIP: u64 = 1 << 32;

/// The id the next new namespace gets: above every id the map holds and
/// every id it handed out (`u32::MAX`, never handed out, when exhausted:
/// that tag is the name index's).
pub fn next_namespace_id(map: &ClusterMap) -> u32 {
    let above_all = map
        .namespaces
        .iter()
        .map(|ns| ns.id)
        .max()
        .unwrap_or(0)
        .saturating_add(1);
    map.next_namespace_id.max(above_all)
}

/// The map the node at `address` holds.
pub(crate) async fn held_map(
    nodes: &crate::nodes::NodeClients,
    address: &str,
) -> Result<ClusterMap, CoordinatorError> {
    let mut admin = nodes.admin(address)?;
    crate::nodes::NodeClients::call(
        "held map",
        std::time::Duration::from_secs(10),
        admin.held_map(HeldMapRequest {}),
    )
    .await
}

/// Whether a restore waits for `node`'s answer: it may hold a newer map
/// than the others while it hosts a replica or is up or draining. A node
/// drained, or down with every replica rebuilt elsewhere, holds nothing
/// and is likely gone for good (a pod scaled away); its map is taken if it
/// answers.
fn must_answer(map: &ClusterMap, node: &NodeInfo) -> bool {
    let hosts = map
        .shards
        .iter()
        .any(|s| s.replicas.iter().any(|r| r.node_id == node.node_id));
    hosts
        || matches!(
            NodeState::try_from(node.state),
            Ok(NodeState::Up | NodeState::Draining)
        )
}

/// The newest map the nodes hold.
#[derive(Debug, PartialEq)]
struct NewestHeld {
    map: ClusterMap,
    /// Where it came from.
    from: String,
    /// Addresses that gave no answer, sorted.
    unanswered: Vec<String>,
}

/// Of the map the node at `asked` holds and the answers of the other nodes
/// it lists (`None`: no answer), the newest version of the same cluster.
/// Maps of other clusters (a node since given a new data directory) are
/// not its: they are left out, not counted as unanswered. Ties go to the
/// node asked.
fn newest_held(
    asked: String,
    held: ClusterMap,
    answers: Vec<(String, Option<ClusterMap>)>,
) -> NewestHeld {
    let mut newest = NewestHeld {
        map: held,
        from: asked,
        unanswered: Vec::new(),
    };
    for (address, answer) in answers {
        match answer {
            None => newest.unanswered.push(address),
            Some(map)
                if map.cluster_id == newest.map.cluster_id && map.version > newest.map.version =>
            {
                newest.map = map;
                newest.from = address;
            }
            Some(_) => {}
        }
    }
    newest.unanswered.sort();
    newest
}

/// Refuses a certificate speaking for a node bound to another one
/// (`identity` is `None` on an insecure coordinator).
fn check_bound(node: &NodeInfo, identity: Option<&str>) -> Result<(), CoordinatorError> {
    match identity {
        Some(name) if node.identity != name => Err(CoordinatorError::PermissionDenied(format!(
            "node {} is bound to certificate {:?}, not {name:?}",
            node.node_id, node.identity
        ))),
        _ => Ok(()),
    }
}

/// Longest `PrepareNodeStop` waits for a node's status.
const STATUS_POLL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// Longest [`Shared::map_taken`] waits for a node's status in one round
/// (a node not answering is judged by its heartbeats meanwhile).
const MAP_POLL_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);
/// Between [`Shared::map_taken`]'s rounds.
const MAP_POLL_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// Whether a retention keeps blobs forever (unset is durable).
fn is_durable(retention: Option<&Retention>) -> bool {
    !matches!(
        retention.and_then(|r| r.policy.as_ref()),
        Some(tidepool_proto::v1::retention::Policy::Retain(_))
    )
}

/// Why a node of cluster `theirs` is refused by a coordinator of `ours`.
fn wrong_cluster(node_id: u64, theirs: &str, ours: &str) -> CoordinatorError {
    tracing::error!(
        node_id,
        node_cluster = theirs,
        cluster = ours,
        "refused a node of another cluster: its data directory holds cluster {theirs}'s map; is this coordinator's store (etcd, --key-prefix) the one that cluster was created in? If the store lost that cluster, `tidectl cluster restore-map --from-node ADDRESS` puts its map back from the nodes"
    );
    CoordinatorError::WrongCluster(format!(
        "node {node_id}'s data belongs to cluster {theirs}, and this coordinator serves cluster {ours} (its store was emptied or replaced, or the coordinator's etcd key prefix or the node's coordinator addresses are wrong); nothing changed. If the store lost cluster {theirs}, `tidectl cluster restore-map --from-node ADDRESS` puts its map back from the nodes"
    ))
}

/// Shards of which `node_id` is a voter and whose other voters that can
/// help commit now are fewer than a majority, though enough others exist
/// to make one when they are back: stopping `node_id` now stops them, and
/// waiting can help (with one or two voters, a restart always stops the
/// shard, and waiting cannot). A StatefulSet's rolling update (pods in
/// parallel) restarts the next pod once the last restarted one is ready,
/// whatever the state of the pods not yet reached: one of those down, or
/// still catching up, and the restart takes the shards it shares with it
/// below a majority.
///
/// A voter counts when its node answered (`reports`, asked of the nodes
/// holding a liveness lease: a DRAINING node that died stays DRAINING in
/// the map, but neither answers nor keeps its lease) and is not DOWN in the
/// map, and its report shows the replica open, not receiving a snapshot
/// and not holding its votes (`replica/votes.rs`): such a replica
/// acknowledges nothing new until it has caught up. One behind by log
/// entries does (as it appends them), so how far behind is not asked: a
/// follower on a slower disk runs hundreds of entries behind under steady
/// writes, and a fixed slack held every restart of the others for the
/// whole hold.
pub(crate) fn quorum_at_risk(
    map: &ClusterMap,
    reports: &std::collections::BTreeMap<u64, NodeStatus>,
    node_id: u64,
) -> u32 {
    let report = |node: u64, shard: u32| {
        reports
            .get(&node)
            .and_then(|status| status.replicas.iter().find(|r| r.shard_id == shard))
    };
    let up = |id: u64| {
        reports.contains_key(&id)
            && map
                .nodes
                .iter()
                .any(|n| n.node_id == id && n.state != NodeState::Down as i32)
    };
    map.shards
        .iter()
        .filter(|s| {
            let voters: Vec<u64> = s
                .replicas
                .iter()
                .filter(|r| r.role == tidepool_proto::v1::ReplicaRole::Voter as i32)
                .map(|r| r.node_id)
                .collect();
            let majority = voters.len() / 2 + 1;
            if !voters.contains(&node_id) || voters.len() <= majority {
                return false;
            }
            let caught_up = |id: u64| {
                up(id)
                    && report(id, s.shard_id)
                        .is_some_and(|r| !r.receiving_snapshot && !r.votes_held)
            };
            voters
                .iter()
                .filter(|id| **id != node_id && caught_up(**id))
                .count()
                < majority
        })
        .count() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node may restart while each shard it votes in keeps a majority on
    /// the other live voters; with one of them down it may not (its shards
    /// of three would be left one).
    #[test]
    fn a_restart_that_would_stop_a_shard_is_counted() {
        use std::collections::BTreeMap;
        use tidepool_proto::v1::{NodeInfo, ReplicaInfo, ReplicaRole, ReplicaStatus, ShardInfo};
        let node = |id: u64, state: NodeState| NodeInfo {
            node_id: id,
            state: state as i32,
            ..NodeInfo::default()
        };
        let shard = |id: u32, voters: &[u64], learners: &[u64]| ShardInfo {
            shard_id: id,
            replicas: voters
                .iter()
                .map(|n| (n, ReplicaRole::Voter))
                .chain(learners.iter().map(|n| (n, ReplicaRole::Learner)))
                .map(|(n, role)| ReplicaInfo {
                    node_id: *n,
                    role: role as i32,
                })
                .collect(),
            ..ShardInfo::default()
        };
        let mut map = ClusterMap {
            nodes: (1..=4).map(|id| node(id, NodeState::Up)).collect(),
            shards: vec![
                shard(1, &[1, 2, 3], &[]),
                shard(2, &[2, 3, 4], &[1]),
                shard(3, &[1, 2, 3, 4, 5], &[]),
            ],
            ..ClusterMap::default()
        };
        // Every node of the map reports its replicas caught up at index
        // 100; node 3 leads every shard.
        let caught_up = |map: &ClusterMap| -> BTreeMap<u64, NodeStatus> {
            map.nodes
                .iter()
                .map(|n| {
                    let replicas = map
                        .shards
                        .iter()
                        .filter(|s| s.replicas.iter().any(|r| r.node_id == n.node_id))
                        .map(|s| ReplicaStatus {
                            shard_id: s.shard_id,
                            is_leader: n.node_id == 3,
                            commit_index: 100,
                            last_index: 100,
                            ..ReplicaStatus::default()
                        })
                        .collect();
                    (
                        n.node_id,
                        NodeStatus {
                            node_id: n.node_id,
                            replicas,
                            ..NodeStatus::default()
                        },
                    )
                })
                .collect()
        };
        let mut alive = caught_up(&map);
        assert_eq!(quorum_at_risk(&map, &alive, 1), 0);
        map.nodes[1].state = NodeState::Down as i32; // node 2
        // Shard 1: {3} of 3 left; shard 3: {3, 4} of 5 (node 5 unknown).
        assert_eq!(quorum_at_risk(&map, &alive, 1), 2);
        // Node 4 is no voter of shard 1; shard 2 keeps {3} of 3: at risk.
        assert_eq!(quorum_at_risk(&map, &alive, 4), 2);
        map.nodes[1].state = NodeState::Draining as i32;
        assert_eq!(
            quorum_at_risk(&map, &alive, 1),
            0,
            "a draining node still serves"
        );
        // ... while its lease lasts: a draining node that died stays
        // DRAINING in the map.
        let lease = alive.remove(&2).unwrap();
        assert_eq!(quorum_at_risk(&map, &alive, 1), 2);
        alive.insert(2, lease);
        // A voter receiving a snapshot or holding its votes cannot help
        // commit yet.
        for lagging in [
            |r: &mut ReplicaStatus| r.receiving_snapshot = true,
            |r: &mut ReplicaStatus| r.votes_held = true,
        ] {
            let mut behind = alive.clone();
            for replica in &mut behind.get_mut(&2).unwrap().replicas {
                lagging(replica);
            }
            assert_eq!(quorum_at_risk(&map, &behind, 1), 2);
        }
        // One behind by log entries acknowledges as it appends them.
        let mut behind = alive.clone();
        for replica in &mut behind.get_mut(&2).unwrap().replicas {
            replica.last_index = 1;
        }
        assert_eq!(quorum_at_risk(&map, &behind, 1), 0);
        // A voter whose node does not report the replica (not open yet).
        let mut unopened = alive.clone();
        unopened.get_mut(&2).unwrap().replicas.clear();
        assert_eq!(quorum_at_risk(&map, &unopened, 1), 2);
        // One or two voters: a restart stops the shard whatever waits.
        let lone = ClusterMap {
            nodes: vec![node(1, NodeState::Up), node(2, NodeState::Down)],
            shards: vec![shard(1, &[1], &[]), shard(2, &[1, 2], &[])],
            ..ClusterMap::default()
        };
        assert_eq!(quorum_at_risk(&lone, &caught_up(&lone), 1), 0);
        map.nodes[2].state = NodeState::Down as i32; // node 3
        // Shard 3 keeps {2, 4} of 5 besides node 1 (node 5 is unknown).
        assert_eq!(quorum_at_risk(&map, &alive, 1), 2);
    }

    fn map(cluster: &str, version: u64) -> ClusterMap {
        ClusterMap {
            cluster_id: cluster.into(),
            version,
            ..ClusterMap::default()
        }
    }

    #[test]
    fn the_newest_map_of_the_cluster_is_restored_whichever_node_was_named() {
        let found = newest_held(
            "http://a".into(),
            map("c1", 40),
            vec![
                ("http://b".into(), Some(map("c1", 45))),
                ("http://c".into(), Some(map("c1", 43))),
            ],
        );
        assert_eq!(found.map, map("c1", 45));
        assert_eq!(found.from, "http://b");
        assert!(found.unanswered.is_empty());
    }

    #[test]
    fn the_node_named_wins_a_tie_and_other_clusters_maps_are_left_out() {
        let found = newest_held(
            "http://a".into(),
            map("c1", 40),
            vec![
                ("http://b".into(), Some(map("c1", 40))),
                // A node given a new data directory since, in another
                // cluster: its newer version says nothing of this one.
                ("http://c".into(), Some(map("c2", 90))),
                // A fresh node: no map at all.
                ("http://d".into(), Some(ClusterMap::default())),
            ],
        );
        assert_eq!(found.map, map("c1", 40));
        assert_eq!(found.from, "http://a");
        assert!(found.unanswered.is_empty());
    }

    #[test]
    fn a_restore_waits_only_for_nodes_that_may_hold_something() {
        use tidepool_proto::v1::{ReplicaInfo, ShardInfo};
        let node = |node_id, state: NodeState| NodeInfo {
            node_id,
            state: state as i32,
            ..NodeInfo::default()
        };
        let map = ClusterMap {
            shards: vec![ShardInfo {
                replicas: vec![ReplicaInfo {
                    node_id: 3,
                    ..ReplicaInfo::default()
                }],
                ..ShardInfo::default()
            }],
            ..ClusterMap::default()
        };
        assert!(must_answer(&map, &node(1, NodeState::Up)));
        assert!(must_answer(&map, &node(2, NodeState::Draining)));
        // Down, but still holding a replica.
        assert!(must_answer(&map, &node(3, NodeState::Down)));
        // Scaled away after its drain; down with its replicas rebuilt.
        assert!(!must_answer(&map, &node(4, NodeState::Drained)));
        assert!(!must_answer(&map, &node(5, NodeState::Down)));
    }

    #[test]
    fn nodes_without_an_answer_are_named_in_order() {
        let found = newest_held(
            "http://a".into(),
            map("c1", 7),
            vec![
                ("http://z".into(), None),
                ("http://b".into(), Some(map("c1", 8))),
                ("http://m".into(), None),
            ],
        );
        assert_eq!(found.from, "http://b");
        assert_eq!(found.unanswered, vec!["http://m", "http://z"]);
    }
}
