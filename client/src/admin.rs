//! Cluster administration through the coordinators: status, namespaces,
//! epochs, drains. Changes are sent to the leader (following
//! `NOT_COORDINATOR_LEADER` hints).

use std::future::Future;
use std::time::Instant;

use tidepool_proto::v1::CreateTokenRequest;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::retention::{Durable, Policy, RetainEpochs};
use tidepool_proto::v1::{
    AdvanceEpochRequest, ClusterStatus, CreateNamespaceRequest, DrainNodeRequest, ErrorCode,
    GetClusterStatusRequest, ListNamespacesRequest, ListTokensRequest, Namespace,
    RestoreMapRequest, RestoreMapResponse, Retention, RevokeTokenRequest, SplitShardRequest,
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

impl Client {
    /// Runs `op` on a coordinator, moving to the leader when told to.
    async fn on_coordinator<T, F, Fut>(&self, mut op: F) -> Result<T>
    where
        F: FnMut(CoordinatorServiceClient<Channel>) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut target: Option<String> = None;
        let mut seed = 0;
        loop {
            let address = target
                .take()
                .unwrap_or_else(|| self.cluster.seeds[seed % self.cluster.seeds.len()].clone());
            // A client acting for a caller asks with the caller's token.
            let client = CoordinatorServiceClient::new(self.channel_as_caller(&address)?);
            let status = match op(client).await {
                Ok(value) => return Ok(value),
                Err(status) => status,
            };
            // Follow a leader hint at once; otherwise pause and try the
            // next seed.
            let last = match classify(&status) {
                Disposition::Fail(error) => return Err(error),
                Disposition::Redirect(error, ..)
                | Disposition::Refresh(error)
                | Disposition::Backoff(error) => error,
            };
            let hinted = error_hint(&status);
            if hinted.is_some() && hinted.as_deref() != Some(address.as_str()) {
                target = hinted;
            } else {
                seed += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorCode::Timeout,
                    format!("no coordinator completed the call: {last}"),
                ));
            }
        }
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
        let namespace = self
            .on_coordinator(|mut c| async move {
                c.create_namespace(CreateNamespaceRequest {
                    name: name.to_string(),
                    content_addressed,
                    retention: Some(retention.into()),
                })
                .await
                .map(|r| r.into_inner())
            })
            .await?;
        self.cluster.refresh().await?;
        Ok(namespace)
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
    pub async fn advance_epoch(&self, expected: Option<u64>) -> Result<u64> {
        self.on_coordinator(|mut c| async move {
            c.advance_epoch(AdvanceEpochRequest {
                expected_current: expected.unwrap_or(0),
            })
            .await
            .map(|r| r.into_inner().epoch)
        })
        .await
    }

    /// Creates a token (admin): its secret, shown once, and its record.
    pub async fn create_token(
        &self,
        name: &str,
        admin: bool,
        grants: Vec<TokenGrant>,
    ) -> Result<(String, TokenRecord)> {
        let grants = &grants;
        self.on_coordinator(|mut c| async move {
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
        .await
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

    /// Revokes a token (admin); whether it existed. Every node refuses it
    /// once its map watch delivers the change (normally well within a
    /// second).
    pub async fn revoke_token(&self, name: &str) -> Result<bool> {
        self.on_coordinator(|mut c| async move {
            c.revoke_token(RevokeTokenRequest {
                name: name.to_string(),
            })
            .await
            .map(|r| r.into_inner().existed)
        })
        .await
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
