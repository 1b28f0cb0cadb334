//! What the tests with scripted nodes share.

use std::time::{Duration, Instant};

use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::{HeartbeatRequest, NodeStatus, RegisterNodeRequest};

/// Registers a scripted node serving at `address` with the coordinator at
/// `url`, then keeps its lease with a heartbeat every 300 ms. Registers
/// again while the coordinator is not leading, as a node does (a 1 s
/// lease on a loaded machine can lapse and be taken back). Returns the
/// node id.
pub async fn register_and_beat(url: &str, address: &str) -> u64 {
    let mut coordinator = CoordinatorServiceClient::connect(url.to_string())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let node_id = loop {
        let answer = coordinator
            .register_node(RegisterNodeRequest {
                address: address.to_string(),
                capacity_bytes: 1 << 30,
                ..RegisterNodeRequest::default()
            })
            .await;
        match answer {
            Ok(answer) => break answer.into_inner().node_id,
            Err(status)
                if status.code() == tonic::Code::Unavailable && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("registering: {status:?}"),
        }
    };
    tokio::spawn(async move {
        loop {
            let status = NodeStatus {
                node_id,
                ..NodeStatus::default()
            };
            let _ = coordinator
                .heartbeat(HeartbeatRequest {
                    status: Some(status),
                    cluster_id: String::new(),
                })
                .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    node_id
}
