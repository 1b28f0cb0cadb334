//! A minimal gRPC client for tests of real nodes: one call on a chosen
//! node, or routed to a shard leader by following `NOT_LEADER` hints (what
//! the SDK does with the cluster map, without the map).
//!
//! Nodes are given as `id → URL` of those running.

use std::collections::BTreeMap;
use std::time::Duration;

use tidepool_proto::v1::blob_service_client::BlobServiceClient;
use tidepool_proto::v1::{
    BlobKind, BlobRef, ErrorCode, GetRequest, PutHeader, PutRequest, PutResponse, ReadConsistency,
    get_response, put_request,
};
use tidepool_proto::{ErrorInfo, error_detail};
use tonic::Status;
use tonic::transport::Channel;

/// How long a routed call keeps following hints and retrying.
pub const ROUTE_DEADLINE: Duration = Duration::from_secs(20);

/// A client of the node at `url`; panics if it cannot connect.
pub async fn client(url: &str) -> BlobServiceClient<Channel> {
    try_client(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

/// A client of the node at `url`, or `UNAVAILABLE` (with no Tidepool error
/// detail) if it cannot connect.
pub async fn try_client(url: &str) -> Result<BlobServiceClient<Channel>, Status> {
    let endpoint = Channel::from_shared(url.to_string())
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .connect_timeout(Duration::from_secs(2));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("cannot connect to {url}: {e}")))?;
    Ok(BlobServiceClient::new(channel).max_decoding_message_size(64 << 20))
}

/// The stable error code of a failed call.
pub fn code(status: &Status) -> ErrorCode {
    error_detail(status)
        .map(|d| ErrorInfo { detail: d }.code())
        .unwrap_or(ErrorCode::Unspecified)
}

/// A blob reference.
pub fn blob(namespace: &str, key: &[u8]) -> Option<BlobRef> {
    Some(BlobRef {
        namespace: namespace.into(),
        key: key.to_vec(),
    })
}

/// One put of `content` on the node at `url`, in 1 MiB messages.
pub async fn put_at(
    url: &str,
    namespace: &str,
    key: &[u8],
    content: &[u8],
) -> Result<PutResponse, Status> {
    let mut messages = vec![PutRequest {
        msg: Some(put_request::Msg::Header(PutHeader {
            blob: blob(namespace, key),
            size: content.len() as u64,
            kind: BlobKind::Data as i32,
            ..PutHeader::default()
        })),
    }];
    for chunk in content.chunks(1 << 20) {
        messages.push(PutRequest {
            msg: Some(put_request::Msg::Data(chunk.to_vec().into())),
        });
    }
    try_client(url)
        .await?
        .put(tokio_stream::iter(messages))
        .await
        .map(|r| r.into_inner())
}

/// One whole-blob get on the node at `url`.
pub async fn get_at(
    url: &str,
    namespace: &str,
    key: &[u8],
    consistency: ReadConsistency,
) -> Result<Vec<u8>, Status> {
    let mut stream = try_client(url)
        .await?
        .get(GetRequest {
            blob: blob(namespace, key),
            consistency: consistency as i32,
            ..GetRequest::default()
        })
        .await?
        .into_inner();
    let mut content = Vec::new();
    while let Some(message) = stream.message().await? {
        if let Some(get_response::Msg::Data(data)) = message.msg {
            content.extend_from_slice(&data);
        }
    }
    Ok(content)
}

/// Whether a failed call should be tried on another node.
fn retry_elsewhere(status: &Status) -> bool {
    matches!(
        code(status),
        ErrorCode::NotLeader | ErrorCode::NoQuorum | ErrorCode::WrongShard | ErrorCode::Unspecified
    )
}

/// Calls `call` on a node, then on the node each failure hints at (or the
/// next one), until it succeeds, fails for another reason, or
/// `ROUTE_DEADLINE` passes.
pub async fn routed<T, F, Fut>(nodes: &BTreeMap<u64, String>, mut call: F) -> Result<T, Status>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let mut target = *nodes.keys().next().expect("no node is running");
    let deadline = tokio::time::Instant::now() + ROUTE_DEADLINE;
    // Nodes that did not know the namespace: one whose map is older than
    // the namespace (restarted with the map it held, not caught up yet)
    // says so, as the SDK knows (`Client::on_shard`); the answer stands
    // only once every node gave it.
    let mut unknown = std::collections::BTreeSet::new();
    loop {
        match call(nodes[&target].clone()).await {
            Err(status)
                if code(&status) == ErrorCode::NamespaceNotFound
                    && unknown.len() + 1 < nodes.len()
                    && tokio::time::Instant::now() < deadline =>
            {
                unknown.insert(target);
                target = nodes
                    .keys()
                    .copied()
                    .find(|id| !unknown.contains(id))
                    .expect("a node not asked yet");
            }
            Err(status) if retry_elsewhere(&status) && tokio::time::Instant::now() < deadline => {
                let hint = error_detail(&status)
                    .and_then(|d| d.leader_hint)
                    .map(|h| h.node_id);
                target = match hint {
                    Some(id) if id != target && nodes.contains_key(&id) => id,
                    _ => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        nodes
                            .keys()
                            .copied()
                            .find(|id| *id > target)
                            .unwrap_or_else(|| *nodes.keys().next().expect("nodes"))
                    }
                };
            }
            other => return other,
        }
    }
}

/// A put routed to the shard leader.
pub async fn put(
    nodes: &BTreeMap<u64, String>,
    namespace: &str,
    key: &[u8],
    content: &[u8],
) -> Result<PutResponse, Status> {
    routed(nodes, |url| async move {
        put_at(&url, namespace, key, content).await
    })
    .await
}

/// A linearizable get routed to the shard leader.
pub async fn get(
    nodes: &BTreeMap<u64, String>,
    namespace: &str,
    key: &[u8],
) -> Result<Vec<u8>, Status> {
    routed(nodes, |url| async move {
        get_at(&url, namespace, key, ReadConsistency::Linearizable).await
    })
    .await
}
