//! `CoordinatorService`: the gRPC API. Reads are answered by any replica
//! from its cached map and the nodes' heartbeat records; changes go through
//! the leader (others answer `NOT_COORDINATOR_LEADER` with a hint).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;

use tidepool_proto::v1::coordinator_service_server::CoordinatorService;
use tidepool_proto::v1::{
    AdvanceEpochRequest, AdvanceEpochResponse, ClusterMap, ClusterStatus, CreateNamespaceRequest,
    CreateTokenRequest, CreateTokenResponse, DrainNodeRequest, DrainNodeResponse, EpochStatus,
    GetClusterMapRequest, GetClusterStatusRequest, GetEpochStatusRequest, HeartbeatRequest,
    HeartbeatResponse, ListNamespacesRequest, ListNamespacesResponse, ListTokensRequest,
    ListTokensResponse, Namespace, NodeAddress, PrepareNodeStopRequest, PrepareNodeStopResponse,
    RegisterNodeRequest, RegisterNodeResponse, RestoreMapRequest, RestoreMapResponse,
    RevokeTokenRequest, RevokeTokenResponse, SetRetentionRequest, SplitShardRequest,
    SplitShardResponse, TokenGrant, WatchClusterMapRequest, WhoAmIRequest, WhoAmIResponse,
};
use tidepool_proto::{ErrorInfo, v1::ErrorCode};
use tidepool_security::{Caller, Identity};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::CoordinatorError;
use crate::core::Shared;
use crate::epochs::epoch_status;
use crate::plan::shard_views;
use crate::reconcile::{alive, current_placement, desired_placement, moves_of, node_views};
use crate::tokens::for_clients;

/// The service.
pub(crate) struct CoordinatorApi {
    shared: Arc<Shared>,
}

impl CoordinatorApi {
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The error as a status; a `NOT_COORDINATOR_LEADER` names the leader.
    async fn fail(&self, error: CoordinatorError) -> Status {
        let mut info = ErrorInfo::from(&error);
        info.detail.map_version = self.shared.map().version;
        if matches!(error, CoordinatorError::NotLeader)
            && let Some(leader) = self.shared.leader_record().await
        {
            info.detail.leader_hint = Some(NodeAddress {
                node_id: 0,
                address: leader.address,
            });
        }
        Status::from(info)
    }

    async fn respond<T>(&self, result: Result<T, CoordinatorError>) -> Result<Response<T>, Status> {
        match result {
            Ok(value) => Ok(Response::new(value)),
            Err(error) => Err(self.fail(error).await),
        }
    }

    fn map_or_unavailable(&self) -> Result<Arc<ClusterMap>, CoordinatorError> {
        let map = self.shared.map();
        if map.version == 0 {
            return Err(CoordinatorError::NoCluster);
        }
        Ok(map)
    }

    /// Epochs and moves as the nodes' last heartbeats show them.
    async fn assess(&self) -> Result<ClusterStatus, CoordinatorError> {
        let map = self.map_or_unavailable()?;
        let reports = alive(&self.shared).await?;
        let views = shard_views(&map, &reports);
        let is_leader = self.shared.leadership().is_some();
        let moves = if is_leader {
            self.shared.progress.lock().moves.clone()
        } else {
            let live: BTreeSet<u64> = reports.keys().copied().collect();
            let nodes = node_views(&map, &reports, |id| live.contains(&id));
            // A follower keeps no learner watch: its estimate bars nothing.
            let none = BTreeSet::new();
            let desired =
                desired_placement(&map, &current_placement(&views), &nodes, &views, &none);
            moves_of(&views, &desired, &live, self.shared.config.catch_up_slack)
                .into_iter()
                .map(|(m, _)| m)
                .collect()
        };
        let behind = self.shared.store_behind();
        Ok(ClusterStatus {
            epochs: Some(epoch_status(map.epoch, &map.namespaces, &views)),
            map: Some((*map).clone()),
            nodes: reports.into_values().collect(),
            moves,
            coordinator_id: self.shared.id.clone(),
            is_leader,
            newer_map_on_node: behind.map_or(0, |b| b.node_id),
            newer_map_version: behind.map_or(0, |b| b.node_version),
            refused_nodes: self.shared.refused_nodes().await,
        })
    }
}

type MapStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<ClusterMap, Status>> + Send>>;

#[tonic::async_trait]
impl CoordinatorService for CoordinatorApi {
    async fn get_cluster_map(
        &self,
        request: Request<GetClusterMapRequest>,
    ) -> Result<Response<ClusterMap>, Status> {
        let member = is_member(&request);
        let result = self.map_or_unavailable().map(|m| {
            if member {
                (*m).clone()
            } else {
                for_clients(&m)
            }
        });
        self.respond(result).await
    }

    type WatchClusterMapStream = MapStream;

    async fn watch_cluster_map(
        &self,
        request: Request<WatchClusterMapRequest>,
    ) -> Result<Response<MapStream>, Status> {
        let member = is_member(&request);
        // Checked at the start by the guard, and at every map after: a
        // watch opened with a token ends when the token is revoked (it
        // went on receiving every map).
        let token = Caller::of(&request).token_sha256;
        let mut after = request.into_inner().after_version;
        let mut maps = self.shared.subscribe_map();
        let mut stopping = self.shared.stopping();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let map = maps.borrow_and_update().clone();
                if let Some(hash) = &token
                    && !map.tokens.iter().any(|t| t.sha256[..] == hash[..])
                {
                    let revoked = ErrorInfo::new(
                        ErrorCode::Unauthenticated,
                        "unknown or revoked token: the watch ends",
                    );
                    let _ = tx.send(Err(Status::from(revoked))).await;
                    return;
                }
                if map.version > after {
                    after = map.version;
                    let map = if member {
                        (*map).clone()
                    } else {
                        for_clients(&map)
                    };
                    if tx.send(Ok(map)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    changed = maps.changed() => if changed.is_err() { return },
                    _ = tx.closed() => return,
                    _ = stopping.wait_for(|s| *s) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn register_node(
        &self,
        request: Request<RegisterNodeRequest>,
    ) -> Result<Response<RegisterNodeResponse>, Status> {
        let caller = Caller::of(&request);
        let result = self
            .shared
            .register_node(request.into_inner(), caller.node_name())
            .await
            .map(|(node_id, map)| RegisterNodeResponse {
                node_id,
                lease_ttl_ms: self.shared.config.node_lease_ms as u32,
                map: Some((*map).clone()),
            });
        self.respond(result).await
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        let result = match request.status {
            Some(status) => {
                match self
                    .shared
                    .same_cluster(status.node_id, &status.address, &request.cluster_id)
                {
                    Ok(()) => {
                        // The map version a node holds is believed only
                        // from the node itself: a known id whose binding
                        // the caller's certificate holds. Before, any node
                        // certificate could claim any id held map
                        // u64::MAX, and the store counted behind it froze
                        // every map change (token revocations included).
                        let held = [(status.node_id, status.map_version)];
                        let beat = self.shared.heartbeat(status, caller.node_name()).await;
                        if beat.is_ok()
                            && let Err(error) = self.shared.note_node_maps(held, false).await
                        {
                            tracing::warn!(%error, "cannot compare a node's map with the store's");
                        }
                        beat
                    }
                    Err(error) => Err(error),
                }
            }
            None => Err(CoordinatorError::InvalidArgument(
                "status is required".into(),
            )),
        }
        .map(|()| HeartbeatResponse {
            map_version: self.shared.map().version,
            lease_ttl_ms: self.shared.config.node_lease_ms as u32,
        });
        self.respond(result).await
    }

    async fn prepare_node_stop(
        &self,
        request: Request<PrepareNodeStopRequest>,
    ) -> Result<Response<PrepareNodeStopResponse>, Status> {
        let caller = Caller::of(&request);
        let result = self
            .shared
            .prepare_node_stop(request.into_inner().node_id, caller.node_name())
            .await;
        self.respond(result).await
    }

    async fn create_namespace(
        &self,
        request: Request<CreateNamespaceRequest>,
    ) -> Result<Response<Namespace>, Status> {
        let r = request.into_inner();
        let result = self
            .shared
            .create_namespace(&r.name, r.content_addressed, r.retention)
            .await;
        self.respond(result).await
    }

    async fn list_namespaces(
        &self,
        _: Request<ListNamespacesRequest>,
    ) -> Result<Response<ListNamespacesResponse>, Status> {
        let result = self.map_or_unavailable().map(|map| {
            let mut namespaces = map.namespaces.clone();
            namespaces.sort_by(|a, b| a.name.cmp(&b.name));
            ListNamespacesResponse { namespaces }
        });
        self.respond(result).await
    }

    async fn set_retention(
        &self,
        request: Request<SetRetentionRequest>,
    ) -> Result<Response<Namespace>, Status> {
        let r = request.into_inner();
        let result = self.shared.set_retention(&r.name, r.retention).await;
        self.respond(result).await
    }

    async fn advance_epoch(
        &self,
        request: Request<AdvanceEpochRequest>,
    ) -> Result<Response<AdvanceEpochResponse>, Status> {
        let expected = request.into_inner().expected_current;
        let result =
            self.shared
                .advance_epoch_confirmed(expected)
                .await
                .map(|(epoch, behind_nodes)| AdvanceEpochResponse {
                    epoch,
                    behind_nodes,
                });
        self.respond(result).await
    }

    async fn get_epoch_status(
        &self,
        _: Request<GetEpochStatusRequest>,
    ) -> Result<Response<EpochStatus>, Status> {
        let result = self
            .assess()
            .await
            .map(|status| status.epochs.unwrap_or_default());
        self.respond(result).await
    }

    async fn drain_node(
        &self,
        request: Request<DrainNodeRequest>,
    ) -> Result<Response<DrainNodeResponse>, Status> {
        let result = self
            .shared
            .drain_node(request.into_inner().node_id)
            .await
            .map(|replicas_to_move| DrainNodeResponse { replicas_to_move });
        self.respond(result).await
    }

    async fn split_shard(
        &self,
        request: Request<SplitShardRequest>,
    ) -> Result<Response<SplitShardResponse>, Status> {
        let request = request.into_inner();
        let result = self
            .shared
            .split_shard(request.shard_id, request.at)
            .await
            .map(|(child_shard_id, at)| SplitShardResponse { child_shard_id, at });
        self.respond(result).await
    }

    async fn get_cluster_status(
        &self,
        request: Request<GetClusterStatusRequest>,
    ) -> Result<Response<ClusterStatus>, Status> {
        let member = is_member(&request);
        let result = self.assess().await.map(|mut status| {
            if !member {
                status.map = status.map.as_ref().map(for_clients);
            }
            status
        });
        self.respond(result).await
    }

    async fn create_token(
        &self,
        request: Request<CreateTokenRequest>,
    ) -> Result<Response<CreateTokenResponse>, Status> {
        let r = request.into_inner();
        let result = self
            .shared
            .create_token(&r.name, r.admin, r.grants)
            .await
            .map(|(secret, mut record)| {
                record.sha256.clear();
                CreateTokenResponse {
                    secret,
                    record: Some(record),
                }
            });
        self.respond(result).await
    }

    async fn list_tokens(
        &self,
        _: Request<ListTokensRequest>,
    ) -> Result<Response<ListTokensResponse>, Status> {
        let tokens = self.shared.list_tokens();
        Ok(Response::new(ListTokensResponse { tokens }))
    }

    async fn who_am_i(
        &self,
        request: Request<WhoAmIRequest>,
    ) -> Result<Response<WhoAmIResponse>, Status> {
        let caller = Caller::of(&request);
        let mut answer = WhoAmIResponse {
            open: caller.open,
            ..WhoAmIResponse::default()
        };
        if let Some(grant) = &caller.grant {
            answer.token_name = grant.name.clone();
            answer.admin = grant.admin;
            answer.grants = grant
                .namespaces
                .iter()
                .map(|(namespace, roles)| TokenGrant {
                    namespace: namespace.clone(),
                    roles: roles.iter().map(|r| *r as i32).collect(),
                })
                .collect();
        }
        Ok(Response::new(answer))
    }

    async fn revoke_token(
        &self,
        request: Request<RevokeTokenRequest>,
    ) -> Result<Response<RevokeTokenResponse>, Status> {
        let result = self
            .shared
            .revoke_token(&request.into_inner().name)
            .await
            .map(|(existed, behind_nodes)| RevokeTokenResponse {
                existed,
                behind_nodes,
            });
        self.respond(result).await
    }

    async fn restore_map(
        &self,
        request: Request<RestoreMapRequest>,
    ) -> Result<Response<RestoreMapResponse>, Status> {
        let request = request.into_inner();
        let result = self
            .shared
            .restore_map(&request.node_address, request.allow_unanswered)
            .await
            .map(|restored| RestoreMapResponse {
                map: Some((*restored.map).clone()),
                previous_cluster_id: restored.previous_cluster_id,
                previous_version: restored.previous_version,
                from_node_address: restored.from_node_address,
                unanswered_nodes: restored.unanswered_nodes,
                skipped_ids: restored.skipped_ids,
            });
        self.respond(result).await
    }
}

/// Whether the caller is a node or coordinator (or the coordinator is
/// insecure): it gets the map with its token hashes.
fn is_member<T>(request: &Request<T>) -> bool {
    let caller = Caller::of(request);
    caller.open
        || matches!(
            caller.identity,
            Some(Identity::Node(_) | Identity::Coordinator(_))
        )
}

impl From<&CoordinatorError> for ErrorInfo {
    fn from(error: &CoordinatorError) -> Self {
        use CoordinatorError as E;
        let code = match error {
            E::NotLeader => ErrorCode::NotCoordinatorLeader,
            E::UnknownNode(_) => ErrorCode::NodeNotFound,
            E::NamespaceExists(_) => ErrorCode::NamespaceExists,
            E::NamespaceNotFound(_) => ErrorCode::NamespaceNotFound,
            E::Conflict(_) => ErrorCode::Conflict,
            E::PermissionDenied(_) => ErrorCode::PermissionDenied,
            E::WrongCluster(_) => ErrorCode::WrongCluster,
            E::TokenNotFound(_) => ErrorCode::NotFound,
            E::InvalidArgument(_) | E::Config(_) => ErrorCode::InvalidArgument,
            E::Meta(_) | E::NoLeader(_) | E::NoCluster | E::Unrecorded(_) => ErrorCode::NoQuorum,
            E::Corrupt(_) | E::Node(_) | E::NodeCall { .. } | E::Io(_) | E::Kubernetes(_) => {
                ErrorCode::Internal
            }
        };
        ErrorInfo::new(code, error.to_string())
    }
}
