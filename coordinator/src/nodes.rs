//! gRPC clients for the nodes' `NodeAdmin` service, one lazily connected
//! channel per address, every call bounded by a timeout.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use parking_lot::Mutex;
use tidepool_proto::v1::node_admin_client::NodeAdminClient;
use tidepool_security::{Channel, Security};

use crate::CoordinatorError;

/// Channels to nodes by address.
#[derive(Debug, Default)]
pub struct NodeClients {
    channels: Mutex<HashMap<String, Channel>>,
    security: Security,
}

impl NodeClients {
    /// Clients that dial with `security`.
    pub fn new(security: Security) -> Self {
        Self {
            channels: Mutex::default(),
            security,
        }
    }

    /// A client for the node at `address`.
    pub fn admin(&self, address: &str) -> Result<NodeAdminClient<Channel>, CoordinatorError> {
        let mut channels = self.channels.lock();
        if let Some(channel) = channels.get(address) {
            return Ok(NodeAdminClient::new(channel.clone()));
        }
        let endpoint = self
            .security
            .endpoint(address)
            .map_err(|e| CoordinatorError::Node(format!("bad node address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let channel = self.security.connect_lazy(&endpoint);
        channels.insert(address.to_string(), channel.clone());
        Ok(NodeAdminClient::new(channel))
    }

    /// Runs one call with a deadline; the error names the node and call.
    pub async fn call<T, F>(what: &str, timeout: Duration, call: F) -> Result<T, CoordinatorError>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(CoordinatorError::NodeCall {
                what: what.to_string(),
                code: tidepool_proto::error_detail(&status)
                    .map(|d| d.code)
                    .unwrap_or_default(),
                message: status.message().to_string(),
            }),
            Err(_) => Err(CoordinatorError::Node(format!(
                "{what}: no answer within {timeout:?}"
            ))),
        }
    }
}
