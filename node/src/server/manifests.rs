//! Verifying a chunk manifest put into a content-addressed namespace.
//!
//! There a key is the SHA-256 of the blob's content. A data put is checked
//! against it directly; a manifest (the SDK's record of a blob split into
//! chunks) is not its own content, so a client could otherwise store a
//! manifest under the digest of content it does not describe, and every
//! later read of that content would fail. Before a manifest is written the
//! node that accepts it checks that it is well formed (its `sha256` is the
//! key, the chunk sizes add up, each chunk is content-addressed), then
//! reads every chunk from the shard that holds it — through the cluster,
//! as a peer reading with its own certificate — and hashes them in order:
//! the manifest is stored only if every chunk exists and the whole
//! digest is the key. One chunk is held at a time, counted against the
//! caller's in-flight budget while held, and at most [`CHECKS_AT_ONCE`]
//! checks run on a node (others wait their turn): a manifest listing one
//! chunk 55,000 times makes its node read about 220 GiB, and many of them
//! at once held a chunk each outside every budget.

use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use sha2::{Digest, Sha256};
use tidepool_proto::v1::blob_service_client::BlobServiceClient;
use tidepool_proto::v1::{
    BlobRef, ChunkManifest, ErrorCode, GetRequest, Namespace, ReadConsistency, get_response,
};
use tidepool_proto::{ErrorInfo, error_detail, hash_position, storage_key};
use tokio_stream::StreamExt;

use super::Node;

/// Attempts per chunk (a leader change in between is followed).
const ATTEMPTS: usize = 4;
/// Manifest checks a node runs at once.
pub(crate) const CHECKS_AT_ONCE: usize = 8;
/// Deadline of reading one chunk.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(30);

fn invalid(node: &Node, message: impl Into<String>) -> ErrorInfo {
    node.error(ErrorCode::InvalidArgument, message)
}

/// Checks a manifest for `key` in content-addressed `namespace` (see the
/// module docs): `DIGEST_MISMATCH` if the chunks are not the content the
/// key names, `NOT_FOUND` if one is missing, `INVALID_ARGUMENT` if it is
/// malformed.
pub(crate) async fn verify(
    node: &Arc<Node>,
    caller: &tidepool_security::Caller,
    namespace: &Namespace,
    key: &[u8],
    content: &[u8],
) -> Result<(), ErrorInfo> {
    let manifest = ChunkManifest::decode(content)
        .map_err(|e| invalid(node, format!("the manifest does not decode: {e}")))?;
    if manifest.sha256[..] != key[..] {
        return Err(node.error(
            ErrorCode::DigestMismatch,
            "the manifest's sha256 is not the key; nothing was stored",
        ));
    }
    let max = node.config.raft.max_value_bytes;
    let mut total = 0u64;
    for chunk in &manifest.chunks {
        if chunk.key.len() != 32 || chunk.key != chunk.sha256 {
            return Err(invalid(
                node,
                "in a content-addressed namespace a chunk's key is its SHA-256",
            ));
        }
        if chunk.size == 0 || chunk.size > max {
            return Err(invalid(
                node,
                format!("a chunk of {} bytes (1 to {max})", chunk.size),
            ));
        }
        total = total.saturating_add(chunk.size);
    }
    if total != manifest.size {
        return Err(invalid(
            node,
            format!(
                "the chunks add up to {total} bytes, the manifest says {}",
                manifest.size
            ),
        ));
    }
    let _turn = node
        .manifest_checks
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| node.error(ErrorCode::ShuttingDown, "the node is stopping"))?;
    let mut whole = Sha256::new();
    for chunk in &manifest.chunks {
        // The read is admitted where it is served (its Get reserves the
        // chunk's length there); once here, the chunk is held under the
        // caller's share until it is hashed: refused (OVERLOADED,
        // retryable) when that is taken. Reserved before the read, a chunk
        // led by this node was counted twice while its Get ran, and at the
        // smallest budget the configuration allows (two of the largest
        // values) such a check never fit. The share is at least the
        // manifest the put holds and the chunk together (at that smallest
        // budget a token's half is one value: the two never fitted, and
        // every chunked content-addressed put made with a token was
        // OVERLOADED).
        let bytes = read_chunk(node, namespace, &chunk.key, chunk.size).await?;
        let _held = node.reserve_beside(chunk.size, content.len() as u64, caller)?;
        if Sha256::digest(&bytes)[..] != chunk.sha256[..] {
            return Err(node.error(
                ErrorCode::DigestMismatch,
                "a chunk's content is not its digest; nothing was stored",
            ));
        }
        whole.update(&bytes);
    }
    if whole.finalize()[..] != key[..] {
        return Err(node.error(
            ErrorCode::DigestMismatch,
            "the chunks' content is not the key's; nothing was stored",
        ));
    }
    Ok(())
}

/// Reads one chunk (at most `size` bytes) from its shard's leader,
/// following leader hints.
async fn read_chunk(
    node: &Arc<Node>,
    namespace: &Namespace,
    key: &[u8],
    size: u64,
) -> Result<Vec<u8>, ErrorInfo> {
    let position = hash_position(&storage_key(namespace.id, key));
    let map = node.map();
    let shard = map
        .shards
        .iter()
        .find(|s| s.hash_start <= position && position <= s.hash_end)
        .ok_or_else(|| node.error(ErrorCode::WrongShard, "no shard holds a chunk"))?;
    let mut target = Some(shard.leader_hint).filter(|l| *l != 0);
    let mut last = node.error(ErrorCode::NoQuorum, "no replica answered for a chunk");
    for attempt in 0..ATTEMPTS {
        let candidates: Vec<u64> = match target.take() {
            Some(leader) => vec![leader],
            None => shard.replicas.iter().map(|r| r.node_id).collect(),
        };
        for id in candidates {
            let Some(address) = node.address_of(id) else {
                continue;
            };
            match tokio::time::timeout(
                CHUNK_TIMEOUT,
                get(node, &address.address, namespace, key, size),
            )
            .await
            {
                Ok(Ok(Ok(bytes))) => return Ok(bytes),
                Ok(Ok(Err(why))) => {
                    return Err(node.error(
                        ErrorCode::DigestMismatch,
                        format!("{why}: the chunks are not the manifest's; nothing was stored"),
                    ));
                }
                Ok(Err(status)) => {
                    let detail = error_detail(&status);
                    let peer_code = detail.as_ref().map(|d| d.code());
                    match peer_code {
                        Some(ErrorCode::NotFound) => {
                            return Err(node.error(
                                ErrorCode::NotFound,
                                "a chunk the manifest lists is not stored; nothing was stored",
                            ));
                        }
                        Some(ErrorCode::NotLeader) => {
                            target = detail
                                .and_then(|d| d.leader_hint)
                                .map(|h| h.node_id)
                                .filter(|l| *l != 0);
                        }
                        _ => {}
                    }
                    // A busy replica is the client's to retry later (as
                    // OVERLOADED says); anything else, no replica served.
                    let code = match peer_code {
                        Some(ErrorCode::Overloaded) => ErrorCode::Overloaded,
                        _ => ErrorCode::NoQuorum,
                    };
                    last = node.error(code, format!("reading a chunk: {}", status.message()));
                    if code == ErrorCode::Overloaded {
                        last.detail.retry_after_ms = 100;
                    }
                    if target.is_some() {
                        break;
                    }
                }
                Err(_) => {
                    last = node.error(ErrorCode::Timeout, "reading a chunk timed out");
                }
            }
        }
        if target.is_none() {
            tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
        }
    }
    Err(last)
}

/// A chunk read whole from the replica at `address`; `Ok(Err(why))` when
/// it is not the `size` bytes the manifest says (a final answer: the
/// manifest is wrong, whichever replica is asked).
async fn get(
    node: &Arc<Node>,
    address: &str,
    namespace: &Namespace,
    key: &[u8],
    size: u64,
) -> Result<Result<Vec<u8>, String>, tonic::Status> {
    let channel = node.peer_channel(address)?;
    // Get answers carry at most 1 MiB of data per message.
    let mut client = BlobServiceClient::new(channel).max_decoding_message_size(2 << 20);
    let mut stream = client
        .get(GetRequest {
            blob: Some(BlobRef {
                namespace: namespace.name.clone(),
                key: key.to_vec(),
            }),
            consistency: ReadConsistency::Linearizable as i32,
            ..GetRequest::default()
        })
        .await?
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(message) = stream.next().await {
        match message?.msg {
            // The manifest is wrong, not the replica: a final answer (as
            // NO_QUORUM, retryable, it was read again from every replica
            // and the client retried a put that can never be stored).
            Some(get_response::Msg::Info(info)) if info.size != size => {
                return Ok(Err(format!(
                    "a chunk the manifest lists as {size} bytes holds {}",
                    info.size
                )));
            }
            Some(get_response::Msg::Data(data)) => {
                // More than the replica announced: its fault, not the
                // manifest's (another replica is asked).
                if bytes.len() as u64 + data.len() as u64 > size {
                    return Err(tonic::Status::data_loss("more chunk bytes than announced"));
                }
                bytes.extend_from_slice(&data);
            }
            _ => {}
        }
    }
    Ok(Ok(bytes))
}
