//! Cluster administration through the coordinators: status, namespaces,
//! epochs, drains. Changes are sent to the leader (following
//! `NOT_COORDINATOR_LEADER` hints).

use std::future::Future;
use std::time::Instant;

use tidepool_proto::v1::CreateTokenRequest;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::retention::{Durable, Policy, RetainEpochs};
use tidepool_proto::v1::{
    AdvanceEpochRequest, AdvanceEpochResponse, ClusterStatus, CreateNamespaceRequest,
    DrainNodeRequest, ErrorCode, GetClusterMapRequest, GetClusterStatusRequest,
    ListNamespacesRequest, ListTokensRequest, Namespace, RestoreMapRequest, RestoreMapResponse,
    Retention, RevokeTokenRequest, RevokeTokenResponse, SetRetentionRequest, SplitShardRequest,
    TokenGrant, TokenRecord, WhoAmIRequest, WhoAmIResponse,
};
use tidepool_security::Channel;
use tonic::Status;

use crate::client::Client;
use crate::error::{Disposition, Error, Result, classify};

/// A namespace's retention, as the SDK takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetentionPolicy {
    /// Never dropped by epochs.
    Durable,
    /// Dropped once this many epochs have passed since the last write or
    /// touch.
    Epochs(u32),
}

impl From<RetentionPolicy> for Retention {
    fn from(policy: RetentionPolicy) -> Self {
        Retention {
            policy: Some(match policy {
                RetentionPolicy::Durable => Policy::Durable(Durable {}),
                RetentionPolicy::Epochs(epochs) => Policy::Retain(RetainEpochs { epochs }),
            }),
        }
    }
}

/// What a call on the coordinators ended with, and whether an attempt
/// before the last may have taken effect though it failed (its answer
/// lost: a timeout, a coordinator gone after its store committed).
struct Tried<T> {
    result: Result<T>,
    uncertain: bool,
}

impl Client {
    /// Runs `op` on a coordinator, moving to the leader when told to.
    /// Only for calls that are safe to repeat; others use
    /// [`Client::on_coordinator_tried`] and settle an uncertain earlier
    /// attempt themselves.
    async fn on_coordinator<T, F, Fut>(&self, op: F) -> Result<T>
    where
        F: FnMut(CoordinatorServiceClient<Channel>) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        self.on_coordinator_tried(op).await.result
    }

    /// [`Client::on_coordinator`], telling whether a failed attempt before
    /// the last may have taken effect.
    async fn on_coordinator_tried<T, F, Fut>(&self, mut op: F) -> Tried<T>
    where
        F: FnMut(CoordinatorServiceClient<Channel>) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut target: Option<String> = None;
        let mut seed = 0;
        let mut uncertain = false;
        loop {
            let address = target
                .take()
                .unwrap_or_else(|| self.cluster.seeds[seed % self.cluster.seeds.len()].clone());
            // A client acting for a caller asks with the caller's token.
            let channel = match self.channel_as_caller(&address) {
                Ok(channel) => channel,
                Err(error) => {
                    return Tried {
                        result: Err(error),
                        uncertain,
                    };
                }
            };
            let client = CoordinatorServiceClient::new(channel);
            let status = match op(client).await {
                Ok(value) => {
                    return Tried {
                        result: Ok(value),
                        uncertain,
                    };
                }
                Err(status) => status,
            };
            // Follow a leader hint at once; otherwise pause and try the
            // next seed.
            let last = match classify(&status) {
                Disposition::Fail(error) => {
                    return Tried {
                        result: Err(error),
                        uncertain,
                    };
                }
                Disposition::Redirect(error, ..)
                | Disposition::Refresh(error)
                | Disposition::Backoff(error) => error,
            };
            // A follower refuses a change without making it; any other
            // failure may have come after the change was stored.
            if last.code() != ErrorCode::NotCoordinatorLeader {
                uncertain = true;
            }
            let hinted = error_hint(&status);
            if hinted.is_some() && hinted.as_deref() != Some(address.as_str()) {
                target = hinted;
            } else {
                seed += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            if Instant::now() >= deadline {
                return Tried {
                    result: Err(Error::new(
                        ErrorCode::Timeout,
                        format!("no coordinator completed the call: {last}"),
                    )),
                    uncertain,
                };
            }
        }
    }

    /// The cluster epoch as a coordinator's map has it now.
    async fn epoch_now(&self) -> Result<u64> {
        self.on_coordinator(|mut c| async move {
            c.get_cluster_map(GetClusterMapRequest {})
                .await
                .map(|r| r.into_inner().epoch)
        })
        .await
    }

    /// Everything an operator wants on one screen.
    pub async fn cluster_status(&self) -> Result<ClusterStatus> {
        self.on_coordinator(|mut c| async move {
            c.get_cluster_status(GetClusterStatusRequest {})
                .await
                .map(|r| r.into_inner())
        })
        .await
    }

    /// Creates a namespace.
    pub async fn create_namespace(
        &self,
        name: &str,
        content_addressed: bool,
        retention: RetentionPolicy,
    ) -> Result<Namespace> {
        let tried = self
            .on_coordinator_tried(|mut c| async move {
                c.create_namespace(CreateNamespaceRequest {
                    name: name.to_string(),
                    content_addressed,
                    retention: Some(retention.into()),
                })
                .await
                .map(|r| r.into_inner())
            })
            .await;
        let namespace = match tried.result {
            Err(error) if tried.uncertain && error.code() == ErrorCode::NamespaceExists => {
                // An attempt whose answer was lost may have made it: the
                // namespace asked for, as asked, is this call's outcome.
                let wanted = Some(Retention::from(retention));
                self.list_namespaces()
                    .await?
                    .into_iter()
                    .find(|ns| {
                        ns.name == name
                            && ns.content_addressed == content_addressed
                            && ns.retention == wanted
                    })
                    .ok_or(error)?
            }
            other => other?,
        };
        // The namespace exists whether or not this client's map shows it
        // yet (a call naming it refreshes the map on a miss).
        if let Err(error) = self.cluster.refresh().await {
            tracing::debug!(%error, "map refresh after creating a namespace");
        }
        Ok(namespace)
    }

    /// Changes a namespace's retention; returns the namespace as changed.
    /// A durable namespace never becomes an expiring one
    /// (`INVALID_ARGUMENT`). Answered once every shard has recorded the
    /// new retention (no drop computed under the former one applies
    /// afterwards); the coordinator's `NO_QUORUM` while some shard has not
    /// is tried again until the client's timeout (the call is idempotent).
    pub async fn set_retention(&self, name: &str, retention: RetentionPolicy) -> Result<Namespace> {
        self.on_coordinator(|mut c| async move {
            c.set_retention(SetRetentionRequest {
                name: name.to_string(),
                retention: Some(retention.into()),
            })
            .await
            .map(|r| r.into_inner())
        })
        .await
    }

    /// Every namespace, by name.
    pub async fn list_namespaces(&self) -> Result<Vec<Namespace>> {
        self.on_coordinator(|mut c| async move {
            c.list_namespaces(ListNamespacesRequest {})
                .await
                .map(|r| r.into_inner().namespaces)
        })
        .await
    }

    /// Starts the next cluster epoch (only if the current one is
    /// `expected`, when given). Returns the new epoch.
    ///
    /// Exactly once: the request always names the epoch it advances from
    /// (without `expected`, the one a coordinator reports first), so an
    /// attempt repeated after one whose answer was lost cannot advance a
    /// second time — each advance shortens every retention by an epoch.
    /// The repeat is refused (`CONFLICT`); the epoch is then one past
    /// the one named, and that advance is reported as this call's (it is
    /// this call's, or a concurrent one's from the same epoch: one advance
    /// either way); if it is further on, `CONFLICT` says so (whether this
    /// call's attempt was among the advances is unknown). Without
    /// `expected`, a refusal because the epoch moved before a certain
    /// attempt reads the epoch again and tries again.
    ///
    /// The coordinator answers once every live node holds the map of the
    /// new epoch, so a write begun after this returns is stamped with it;
    /// live nodes still behind after its wait (two node leases) are logged
    /// here as a warning ([`advance_epoch_answer`](Self::advance_epoch_answer)
    /// returns them).
    pub async fn advance_epoch(&self, expected: Option<u64>) -> Result<u64> {
        Ok(self.advance_epoch_answer(expected).await?.epoch)
    }

    /// [`advance_epoch`](Self::advance_epoch), with the live nodes that had
    /// not taken the new epoch's map when the coordinator stopped waiting
    /// (`behind_nodes`: writes they take until they do carry the epoch
    /// before). Empty after a repeat whose refusal was read as this call's
    /// success (the refusal waited for the nodes too, and names any still
    /// behind only in its message, logged).
    pub async fn advance_epoch_answer(
        &self,
        expected: Option<u64>,
    ) -> Result<AdvanceEpochResponse> {
        let answer = self.advance_epoch_tried(expected).await?;
        if !answer.behind_nodes.is_empty() {
            tracing::warn!(
                epoch = answer.epoch,
                nodes = ?answer.behind_nodes,
                "epoch advanced; live nodes had not taken its map yet: writes they take carry the epoch before until they do"
            );
        }
        Ok(answer)
    }

    async fn advance_epoch_tried(&self, expected: Option<u64>) -> Result<AdvanceEpochResponse> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let from = match expected {
                Some(epoch) => epoch,
                None => self.epoch_now().await?,
            };
            if from == 0 {
                // The coordinator reads 0 as "no condition".
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    "epochs start at 1: there is no epoch 0 to advance from",
                ));
            }
            let tried = self
                .on_coordinator_tried(|mut c| async move {
                    c.advance_epoch(AdvanceEpochRequest {
                        expected_current: from,
                    })
                    .await
                    .map(|r| r.into_inner())
                })
                .await;
            let error = match tried.result {
                Err(error) if error.code() == ErrorCode::Conflict => error,
                other => return other,
            };
            let now = self.epoch_now().await?;
            if tried.uncertain {
                if now == from + 1 {
                    if error.to_string().contains("have not taken") {
                        tracing::warn!(%error, "epoch advanced");
                    }
                    return Ok(AdvanceEpochResponse {
                        epoch: now,
                        behind_nodes: Vec::new(),
                    });
                }
                // Moved further: whether one of the moves was this call's
                // is unknown, and trying again could make it two.
                return Err(Error::new(
                    ErrorCode::Conflict,
                    format!(
                        "the epoch is {now}: an attempt to advance it from {from} lost its answer, \
                         and it may have been one of the advances since"
                    ),
                ));
            }
            if expected.is_some() || Instant::now() >= deadline {
                return Err(error);
            }
        }
    }

    /// Creates a token (admin): its secret, shown once, and its record.
    /// An attempt repeated after one whose answer was lost is refused if
    /// the lost one made the token (its secret went with the answer): the
    /// `CONFLICT` says to revoke it and create it again.
    pub async fn create_token(
        &self,
        name: &str,
        admin: bool,
        grants: Vec<TokenGrant>,
    ) -> Result<(String, TokenRecord)> {
        let grants = &grants;
        let tried = self
            .on_coordinator_tried(|mut c| async move {
                c.create_token(CreateTokenRequest {
                    name: name.to_string(),
                    admin,
                    grants: grants.clone(),
                })
                .await
                .map(|r| {
                    let r = r.into_inner();
                    (r.secret, r.record.unwrap_or_default())
                })
            })
            .await;
        match tried.result {
            Err(error) if tried.uncertain && error.code() == ErrorCode::Conflict => {
                Err(Error::new(
                    ErrorCode::Conflict,
                    format!(
                        "{error}; an earlier attempt whose answer was lost may have created it, \
                         and its secret was lost with the answer: revoke token {name:?} and create it again"
                    ),
                ))
            }
            other => other,
        }
    }

    /// Every token (admin), without secrets or hashes.
    pub async fn list_tokens(&self) -> Result<Vec<TokenRecord>> {
        self.on_coordinator(|mut c| async move {
            c.list_tokens(ListTokensRequest {})
                .await
                .map(|r| r.into_inner().tokens)
        })
        .await
    }

    /// The caller's own token as the coordinator authenticated it (name
    /// and roles; `open` when the cluster checks no tokens).
    pub async fn who_am_i(&self) -> Result<WhoAmIResponse> {
        self.on_coordinator(|mut c| async move {
            c.who_am_i(WhoAmIRequest {}).await.map(|r| r.into_inner())
        })
        .await
    }

    /// Revokes a token (admin); whether it existed. The coordinator
    /// answers once every live node holds the map without it, so no live
    /// node takes it after this returns; live nodes still behind after its
    /// wait (two node leases) are logged here as a warning
    /// ([`revoke_token_answer`](Self::revoke_token_answer) returns them).
    pub async fn revoke_token(&self, name: &str) -> Result<bool> {
        Ok(self.revoke_token_answer(name).await?.existed)
    }

    /// [`revoke_token`](Self::revoke_token), with the live nodes that had
    /// not taken the map without the token when the coordinator stopped
    /// waiting (`behind_nodes`: they may take it until they do).
    pub async fn revoke_token_answer(&self, name: &str) -> Result<RevokeTokenResponse> {
        let answer = self
            .on_coordinator(|mut c| async move {
                c.revoke_token(RevokeTokenRequest {
                    name: name.to_string(),
                })
                .await
                .map(|r| r.into_inner())
            })
            .await?;
        if !answer.behind_nodes.is_empty() {
            tracing::warn!(
                token = name,
                nodes = ?answer.behind_nodes,
                "token revoked; live nodes had not taken the map without it yet"
            );
        }
        Ok(answer)
    }

    /// Splits a shard's hash range at `at` (0: the middle). Returns the new
    /// shard's id and the cut; the split completes in the background.
    pub async fn split_shard(&self, shard_id: u32, at: u64) -> Result<(u32, u64)> {
        self.on_coordinator(|mut c| async move {
            c.split_shard(SplitShardRequest { shard_id, at })
                .await
                .map(|r| {
                    let r = r.into_inner();
                    (r.child_shard_id, r.at)
                })
        })
        .await
    }

    /// Moves every replica off a node. Returns how many it holds.
    pub async fn drain_node(&self, node_id: u64) -> Result<u32> {
        self.on_coordinator(|mut c| async move {
            c.drain_node(DrainNodeRequest { node_id })
                .await
                .map(|r| r.into_inner().replicas_to_move)
        })
        .await
    }

    /// Puts the newest map the nodes hold back into the coordinator's
    /// store (emptied, or restored from an older snapshot): the map of the
    /// node at `node_address` or of another node it lists holding a newer
    /// one. Refused while a node of the map does not answer, unless
    /// `allow_unanswered`.
    pub async fn restore_map(
        &self,
        node_address: &str,
        allow_unanswered: bool,
    ) -> Result<RestoreMapResponse> {
        self.on_coordinator(|mut c| async move {
            c.restore_map(RestoreMapRequest {
                node_address: node_address.to_string(),
                allow_unanswered,
            })
            .await
            .map(|r| r.into_inner())
        })
        .await
    }
}

fn error_hint(status: &Status) -> Option<String> {
    tidepool_proto::error_detail(status)
        .and_then(|d| d.leader_hint)
        .map(|h| h.address)
        .filter(|a| !a.is_empty())
}
