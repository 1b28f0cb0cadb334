//! REAPI v2 over gRPC: `Capabilities`, `ContentAddressableStorage` and
//! `ActionCache` (the cache half of the API; remote execution is not
//! offered), served with ByteStream on one port.

use std::pin::Pin;
use std::sync::Arc;

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use bazel_remote_apis::build::bazel::semver::SemVer;
use bazel_remote_apis::google::rpc::Status as RpcStatus;
use prost::Message as _;
use re::action_cache_server::{ActionCache, ActionCacheServer};
use re::capabilities_server::{Capabilities, CapabilitiesServer};
use re::content_addressable_storage_server::{
    ContentAddressableStorage, ContentAddressableStorageServer,
};
use re::{compressor, digest_function};
use tidepool_client::proto::v1::{Role, WhoAmIResponse};
use tidepool_client::{Client, Error, ErrorCode};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::http::feed;
use crate::names::{BlobDigest, Instance};
use crate::{Credential, Gateway, cache, codec};

/// gRPC status of an SDK error (codes chosen for what a build tool does
/// next: retry on UNAVAILABLE, rebuild on NOT_FOUND, stop on the rest).
pub(crate) fn status(error: Error) -> Status {
    let message = error.to_string();
    match error.code() {
        ErrorCode::NotFound => Status::not_found(message),
        ErrorCode::InvalidArgument
        | ErrorCode::DigestMismatch
        | ErrorCode::SizeMismatch
        | ErrorCode::ValueTooLarge
        | ErrorCode::NamespaceNotFound => Status::invalid_argument(message),
        ErrorCode::Unauthenticated => Status::unauthenticated(message),
        ErrorCode::PermissionDenied => Status::permission_denied(message),
        // An `append-only` caller's overwrite: refused for good.
        ErrorCode::AlreadyExists => Status::already_exists(message),
        // Read again, or try again (the write was not applied now).
        ErrorCode::Conflict | ErrorCode::SessionExpired => Status::aborted(message),
        ErrorCode::WrongCluster => Status::failed_precondition(message),
        ErrorCode::DiskFull => Status::resource_exhausted(message),
        ErrorCode::Corrupt => Status::data_loss(message),
        ErrorCode::Unsupported => Status::unimplemented(message),
        ErrorCode::Timeout
        | ErrorCode::NoQuorum
        | ErrorCode::Overloaded
        | ErrorCode::ShuttingDown
        | ErrorCode::NotLeader
        | ErrorCode::WrongShard
        | ErrorCode::StaleMap => Status::unavailable(message),
        _ => Status::internal(message),
    }
}

/// A `google.rpc.Status` for one item of a batch.
fn rpc_status(result: Result<(), Status>) -> Option<RpcStatus> {
    Some(match result {
        Ok(()) => RpcStatus::default(),
        Err(s) => RpcStatus {
            code: s.code() as i32,
            message: s.message().to_string(),
            details: Vec::new(),
        },
    })
}

fn digest_of(digest: Option<&re::Digest>) -> Result<BlobDigest, Status> {
    BlobDigest::from_proto(digest).map_err(Status::invalid_argument)
}

/// Only SHA-256 is served (`UNKNOWN` means the default, SHA-256).
fn check_digest_function(value: i32) -> Result<(), Status> {
    if value == digest_function::Value::Unknown as i32
        || value == digest_function::Value::Sha256 as i32
    {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "digest function {value} is not served; this server speaks SHA-256"
        )))
    }
}

/// The REAPI services, sharing the gateway.
#[derive(Clone)]
pub(crate) struct Reapi {
    pub(crate) gateway: Arc<Gateway>,
}

impl Reapi {
    /// The caller's client and the instance, or the refusal.
    pub(crate) async fn begin<T>(
        &self,
        request: &Request<T>,
        instance: &str,
    ) -> Result<(Client, Instance), Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        let credential = Credential::from_header(header).map_err(status)?;
        let client = self.gateway.caller(credential).await.map_err(status)?;
        let instance = self.gateway.instance(instance).await.map_err(status)?;
        Ok((client, instance))
    }

    fn max_batch(&self) -> u64 {
        self.gateway.config.max_batch_bytes
    }
}

#[tonic::async_trait]
impl Capabilities for Reapi {
    async fn get_capabilities(
        &self,
        request: Request<re::GetCapabilitiesRequest>,
    ) -> Result<Response<re::ServerCapabilities>, Status> {
        let instance = request.get_ref().instance_name.clone();
        self.begin(&request, &instance).await?;
        let version = |minor| SemVer {
            major: 2,
            minor,
            patch: 0,
            prerelease: String::new(),
        };
        let zstd = vec![compressor::Value::Zstd as i32];
        Ok(Response::new(re::ServerCapabilities {
            cache_capabilities: Some(re::CacheCapabilities {
                digest_functions: vec![digest_function::Value::Sha256 as i32],
                action_cache_update_capabilities: Some(re::ActionCacheUpdateCapabilities {
                    update_enabled: true,
                }),
                max_batch_total_size_bytes: self.max_batch() as i64,
                symlink_absolute_path_strategy: re::symlink_absolute_path_strategy::Value::Allowed
                    as i32,
                supported_compressors: zstd.clone(),
                supported_batch_update_compressors: zstd,
                max_cas_blob_size_bytes: self.gateway.config.max_blob_bytes as i64,
                split_blob_support: true,
                splice_blob_support: true,
                ..Default::default()
            }),
            low_api_version: Some(version(0)),
            high_api_version: Some(version(3)),
            ..Default::default()
        }))
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ContentAddressableStorage for Reapi {
    async fn find_missing_blobs(
        &self,
        request: Request<re::FindMissingBlobsRequest>,
    ) -> Result<Response<re::FindMissingBlobsResponse>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let digests = request
            .blob_digests
            .iter()
            .map(|d| digest_of(Some(d)))
            .collect::<Result<Vec<_>, _>>()?;
        let missing = cache::find_missing(&client, &instance, &digests)
            .await
            .map_err(status)?;
        Ok(Response::new(re::FindMissingBlobsResponse {
            missing_blob_digests: missing.into_iter().map(BlobDigest::to_proto).collect(),
        }))
    }

    async fn batch_update_blobs(
        &self,
        request: Request<re::BatchUpdateBlobsRequest>,
    ) -> Result<Response<re::BatchUpdateBlobsResponse>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let total: u64 = request.requests.iter().map(|r| r.data.len() as u64).sum();
        if total > self.max_batch() {
            return Err(Status::invalid_argument(format!(
                "the batch holds {total} bytes; at most {} (max_batch_total_size_bytes)",
                self.max_batch()
            )));
        }
        // The limit is on the blobs, not on what carries them: compressed
        // items declare their size, and a few kilobytes of zstd can stand
        // for gigabytes (each item decompresses to at most its size).
        let declared = request.requests.iter().try_fold(0u64, |sum, r| {
            let size = r.digest.as_ref().map_or(0, |d| d.size_bytes.max(0) as u64);
            sum.checked_add(size)
        });
        match declared {
            Some(declared) if declared <= self.max_batch() => {}
            _ => {
                return Err(Status::invalid_argument(format!(
                    "the batch's digests declare more than {} bytes (max_batch_total_size_bytes); upload larger blobs with ByteStream",
                    self.max_batch()
                )));
            }
        }
        let responses = each_bounded(request.requests, |item| {
            let (client, instance) = (client.clone(), instance.clone());
            async move {
                let result = async {
                    let digest = digest_of(item.digest.as_ref())?;
                    let data = match item.compressor {
                        c if c == compressor::Value::Identity as i32 => item.data,
                        c if c == compressor::Value::Zstd as i32 => {
                            codec::decompress(&item.data, digest.size)
                                .map_err(Status::invalid_argument)?
                        }
                        other => {
                            return Err(Status::invalid_argument(format!(
                                "compressor {other} is not supported"
                            )));
                        }
                    };
                    cache::write_cas(&client, &instance, digest, &data)
                        .await
                        .map_err(status)
                }
                .await;
                re::batch_update_blobs_response::Response {
                    digest: item.digest,
                    status: rpc_status(result),
                }
            }
        })
        .await?;
        Ok(Response::new(re::BatchUpdateBlobsResponse { responses }))
    }

    async fn batch_read_blobs(
        &self,
        request: Request<re::BatchReadBlobsRequest>,
    ) -> Result<Response<re::BatchReadBlobsResponse>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let digests = request
            .digests
            .iter()
            .map(|d| digest_of(Some(d)))
            .collect::<Result<Vec<_>, _>>()?;
        let total = digests
            .iter()
            .try_fold(0u64, |sum, d| sum.checked_add(d.size))
            .filter(|total| *total <= self.max_batch());
        if total.is_none() {
            return Err(Status::invalid_argument(format!(
                "the blobs asked for add up to more than {} bytes (max_batch_total_size_bytes)",
                self.max_batch()
            )));
        }
        let zstd = request
            .acceptable_compressors
            .contains(&(compressor::Value::Zstd as i32));
        let limit = self.max_batch();
        // Each distinct digest read once, every occurrence answered: a
        // request naming one small blob (or a missing one) tens of
        // thousands of times, within the batch limit, read it as often.
        let mut distinct = Vec::new();
        let mut slots = std::collections::HashMap::new();
        let order: Vec<usize> = digests
            .iter()
            .map(|digest| {
                *slots.entry(*digest).or_insert_with(|| {
                    distinct.push(*digest);
                    distinct.len() - 1
                })
            })
            .collect();
        let answers = each_bounded(distinct, |digest| {
            let (client, instance) = (client.clone(), instance.clone());
            async move {
                let read = cache::read_cas(&client, &instance, digest, limit)
                    .await
                    .map_err(status);
                match read {
                    Ok(data) if zstd && !data.is_empty() => match codec::compress(&data) {
                        Ok(compressed) => re::batch_read_blobs_response::Response {
                            digest: Some(digest.to_proto()),
                            data: compressed,
                            compressor: compressor::Value::Zstd as i32,
                            status: rpc_status(Ok(())),
                        },
                        Err(e) => re::batch_read_blobs_response::Response {
                            digest: Some(digest.to_proto()),
                            status: rpc_status(Err(Status::internal(e.to_string()))),
                            ..Default::default()
                        },
                    },
                    Ok(data) => re::batch_read_blobs_response::Response {
                        digest: Some(digest.to_proto()),
                        data,
                        compressor: compressor::Value::Identity as i32,
                        status: rpc_status(Ok(())),
                    },
                    Err(e) => re::batch_read_blobs_response::Response {
                        digest: Some(digest.to_proto()),
                        status: rpc_status(Err(e)),
                        ..Default::default()
                    },
                }
            }
        })
        .await?;
        // Each answer moved to its last occurrence, cloned only for the
        // earlier ones (a batch without repeats copies nothing).
        let mut left = vec![0usize; answers.len()];
        for &i in &order {
            left[i] += 1;
        }
        let mut answers: Vec<Option<_>> = answers.into_iter().map(Some).collect();
        let responses = order
            .into_iter()
            .map(|i| {
                left[i] -= 1;
                if left[i] == 0 {
                    answers[i]
                        .take()
                        .expect("moved at its last occurrence only")
                } else {
                    answers[i].clone().expect("not moved yet")
                }
            })
            .collect();
        Ok(Response::new(re::BatchReadBlobsResponse { responses }))
    }

    type GetTreeStream = BoxStream<re::GetTreeResponse>;

    async fn get_tree(
        &self,
        request: Request<re::GetTreeRequest>,
    ) -> Result<Response<Self::GetTreeStream>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let root = digest_of(request.root_digest.as_ref())?;
        let page_size = match request.page_size {
            n if n < 0 => return Err(Status::invalid_argument("page_size is negative")),
            0 => 1000,
            n => (n as usize).min(10_000),
        };
        // A token is the position of the next directory and its hash: a
        // directory missing when the walk passed it and stored since moves
        // every later position, and a resumed walk would repeat or skip
        // directories; with the hash it says so instead. (A bare position,
        // from an older gateway, is taken as it is.)
        let bad_token = || Status::invalid_argument("page_token is not one this server gave");
        let (start, expected): (usize, Option<[u8; 32]>) = if request.page_token.is_empty() {
            (0, None)
        } else {
            let (at, hash) = match request.page_token.split_once(':') {
                Some((at, hash)) => (at, Some(hash)),
                None => (request.page_token.as_str(), None),
            };
            let hash = match hash {
                None => None,
                Some(hash) => Some(crate::names::parse_hash(hash).map_err(|_| bad_token())?),
            };
            (at.parse().map_err(|_| bad_token())?, hash)
        };
        // The rest of the tree, one traversal, each page sent as soon as
        // it is full — by count, or by bytes below the send limit (before,
        // the whole rest was read and held, and pages of large directories
        // went over the limit: OUT_OF_RANGE every time). The walk waits
        // for the client to take each page.
        let limit = self.max_batch();
        // A client that takes no page for this long loses the rest.
        let idle = self.gateway.config.http_limits.body_idle;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            let mut walk = cache::TreeWalk::new(root, limit);
            let mut page: Vec<re::Directory> = Vec::new();
            let mut page_bytes = 0u64;
            loop {
                // A client that went away ends the walk (a walk that gave
                // out no page, skipping to its token or past missing
                // directories, went on to the end without anyone).
                if tx.is_closed() {
                    return;
                }
                let at = walk.index();
                let next = match walk.next(&client, &instance, || tx.is_closed()).await {
                    Ok(next) => next,
                    Err(e) => {
                        let _ = feed(&tx, Err(status(e)), idle).await;
                        return;
                    }
                };
                if at < start {
                    if next.is_none() {
                        break;
                    }
                    continue;
                }
                let Some((digest, directory)) = next else {
                    break;
                };
                if at == start
                    && let Some(expected) = expected
                    && digest.hash != expected
                {
                    let changed = Status::invalid_argument(
                        "the tree changed since this page token was given (a directory missing then is stored now): call GetTree again without a token",
                    );
                    let _ = feed(&tx, Err(changed), idle).await;
                    return;
                }
                let bytes = directory.encoded_len() as u64 + 8;
                if !page.is_empty() && (page.len() == page_size || page_bytes + bytes > limit) {
                    let full = re::GetTreeResponse {
                        directories: std::mem::take(&mut page),
                        next_page_token: format!("{at}:{}", crate::names::hex(&digest.hash)),
                    };
                    page_bytes = 0;
                    if !feed(&tx, Ok(full), idle).await {
                        return; // the client went away, or stopped reading
                    }
                }
                page_bytes += bytes;
                page.push(directory);
            }
            let last = re::GetTreeResponse {
                directories: page,
                next_page_token: String::new(),
            };
            let _ = feed(&tx, Ok(last), idle).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn split_blob(
        &self,
        request: Request<re::SplitBlobRequest>,
    ) -> Result<Response<re::SplitBlobResponse>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let digest = digest_of(request.blob_digest.as_ref())?;
        let chunk_digests = split(&client, &instance, digest).await?;
        Ok(Response::new(re::SplitBlobResponse {
            chunk_digests,
            chunking_function: re::chunking_function::Value::Unknown as i32,
        }))
    }

    type GetChunkMappingStream = BoxStream<re::GetChunkMappingResponse>;

    async fn get_chunk_mapping(
        &self,
        request: Request<re::GetChunkMappingRequest>,
    ) -> Result<Response<Self::GetChunkMappingStream>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let digest = digest_of(request.blob_digest.as_ref())?;
        let chunk_digests = split(&client, &instance, digest).await?;
        let mut first = true;
        let pages: Vec<_> = chunk_digests
            .chunks(10_000)
            .map(|page| {
                let chunking_function = if std::mem::take(&mut first) {
                    re::chunking_function::Value::Unknown as i32
                } else {
                    0
                };
                Ok(re::GetChunkMappingResponse {
                    chunk_digests: page.to_vec(),
                    chunking_function,
                })
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(pages))))
    }

    async fn splice_blob(
        &self,
        request: Request<re::SpliceBlobRequest>,
    ) -> Result<Response<re::SpliceBlobResponse>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let digest = digest_of(request.blob_digest.as_ref())?;
        let chunks = request
            .chunk_digests
            .iter()
            .map(|d| digest_of(Some(d)))
            .collect::<Result<Vec<_>, _>>()?;
        splice(
            &client,
            &instance,
            digest,
            &chunks,
            self.gateway.config.max_blob_bytes,
        )
        .await?;
        Ok(Response::new(re::SpliceBlobResponse {
            blob_digest: Some(digest.to_proto()),
        }))
    }

    async fn register_chunk_mapping(
        &self,
        request: Request<Streaming<re::RegisterChunkMappingRequest>>,
    ) -> Result<Response<re::RegisterChunkMappingResponse>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes().to_vec());
        // The caller first: the stream may name a million digests.
        let credential = Credential::from_header(header.as_deref()).map_err(status)?;
        let client = self.gateway.caller(credential).await.map_err(status)?;
        let mut stream = request.into_inner();
        let mut first: Option<re::RegisterChunkMappingRequest> = None;
        let mut chunks = Vec::new();
        let idle = self.gateway.config.http_limits.body_idle;
        while let Some(message) = crate::next_message(&mut stream, idle).await? {
            for d in &message.chunk_digests {
                chunks.push(digest_of(Some(d))?);
                if chunks.len() > 1_000_000 {
                    return Err(Status::invalid_argument("more than 1,000,000 chunks"));
                }
            }
            first.get_or_insert(message);
        }
        let first = first.ok_or_else(|| Status::invalid_argument("no request was sent"))?;
        check_digest_function(first.digest_function)?;
        let instance = self
            .gateway
            .instance(&first.instance_name)
            .await
            .map_err(status)?;
        let digest = digest_of(first.blob_digest.as_ref())?;
        splice(
            &client,
            &instance,
            digest,
            &chunks,
            self.gateway.config.max_blob_bytes,
        )
        .await?;
        Ok(Response::new(re::RegisterChunkMappingResponse {
            blob_digest: Some(digest.to_proto()),
        }))
    }
}

/// The chunks a CAS blob is stored as (a plain blob is its own single
/// chunk).
async fn split(
    client: &Client,
    instance: &Instance,
    digest: BlobDigest,
) -> Result<Vec<re::Digest>, Status> {
    if digest.is_empty_blob() {
        return Ok(Vec::new());
    }
    let chunks = client
        .chunks(&instance.cas, &digest.hash)
        .await
        .map_err(status)?;
    let total: u64 = chunks.iter().map(|c| c.size).sum();
    if total != digest.size {
        return Err(Status::not_found(format!(
            "the blob of this hash is {total} bytes, not {}",
            digest.size
        )));
    }
    chunks
        .into_iter()
        .map(|c| {
            let hash: [u8; 32] = c.sha256[..]
                .try_into()
                .map_err(|_| Status::data_loss("a chunk without a SHA-256"))?;
            Ok(BlobDigest { hash, size: c.size }.to_proto())
        })
        .collect()
}

/// `PERMISSION_DENIED` unless the caller may store blobs in `namespace`
/// (asked of the coordinator: [`may_store`]). A coordinator that cannot
/// answer now lets the call go on: the nodes check the role at the one
/// write, as before (a splice must not fail for a coordinator restart).
async fn require_store(client: &Client, namespace: &str) -> Result<(), Status> {
    let me = match client.who_am_i().await {
        Ok(me) => me,
        Err(e)
            if matches!(
                e.code(),
                ErrorCode::Unauthenticated | ErrorCode::PermissionDenied
            ) =>
        {
            return Err(status(e));
        }
        Err(e) => {
            tracing::debug!(error = %e, "a splice's caller could not be checked now; the nodes will");
            return Ok(());
        }
    };
    if may_store(&me, namespace) {
        return Ok(());
    }
    Err(status(Error::new(
        ErrorCode::PermissionDenied,
        format!(
            "token {:?} may not store blobs in namespace {namespace:?}",
            me.token_name
        ),
    )))
}

/// Whether the caller `me` describes may store blobs in `namespace`: it
/// holds the write or append-only role there (or everywhere), is an admin,
/// or the cluster checks no tokens.
fn may_store(me: &WhoAmIResponse, namespace: &str) -> bool {
    let grant = tidepool_security::guard::Grant {
        name: me.token_name.clone(),
        admin: me.admin,
        namespaces: me
            .grants
            .iter()
            .map(|g| (g.namespace.clone(), g.roles().collect()))
            .collect(),
    };
    me.open || grant.holds(namespace, Role::Write) || grant.holds(namespace, Role::AppendOnly)
}

/// Stores `digest` as the concatenation of `chunks` (already in the CAS,
/// each at most one node entry). Verified by the SDK.
async fn splice(
    client: &Client,
    instance: &Instance,
    digest: BlobDigest,
    chunks: &[BlobDigest],
    max_blob: u64,
) -> Result<(), Status> {
    let total = chunks
        .iter()
        .try_fold(0u64, |sum, c| sum.checked_add(c.size));
    if total != Some(digest.size) {
        return Err(Status::invalid_argument(format!(
            "the chunks add up to {} bytes, the blob is {}",
            total.map_or_else(|| "more than 2^64".to_string(), |t| t.to_string()),
            digest.size
        )));
    }
    if digest.size > max_blob {
        return Err(status(Error::new(
            ErrorCode::ValueTooLarge,
            format!(
                "{} bytes; blobs of at most {max_blob} are accepted",
                digest.size
            ),
        )));
    }
    // Every chunk is read before the one write that needs the caller's
    // write role: without this, a read-only token's request of a few
    // megabytes naming one chunk again and again made the cluster read
    // the whole claimed size.
    require_store(client, &instance.cas).await?;
    let limit = client.chunk_size() as u64;
    if let Some(big) = chunks.iter().find(|c| c.size > limit) {
        return Err(Status::invalid_argument(format!(
            "a chunk of {} bytes; chunks are at most {limit} bytes here",
            big.size
        )));
    }
    if digest.is_empty_blob() {
        return Ok(());
    }
    // A blob of at most one chunk is stored whole, as every such blob is:
    // presence checks look for the chunks of larger blobs only.
    if digest.size <= limit {
        let mut bytes = Vec::with_capacity(digest.size as usize);
        for chunk in chunks {
            bytes.extend(
                cache::read_cas(client, instance, *chunk, limit)
                    .await
                    .map_err(status)?,
            );
        }
        return cache::write_cas(client, instance, digest, &bytes)
            .await
            .map_err(status);
    }
    // Read with their sizes: a chunk named with another size than it is
    // stored with ends the splice at its first answer (NOT_FOUND: that
    // digest is not stored) — named by hash only, one stored chunk named
    // a million times as 0 bytes made the cluster read it every time.
    let keys: Vec<([u8; 32], u64)> = chunks
        .iter()
        .filter(|c| !c.is_empty_blob())
        .map(|c| (c.hash, c.size))
        .collect();
    client
        .splice_sized(&instance.cas, &digest.hash, &keys)
        .await
        .map_err(status)?;
    Ok(())
}

#[tonic::async_trait]
impl ActionCache for Reapi {
    async fn get_action_result(
        &self,
        request: Request<re::GetActionResultRequest>,
    ) -> Result<Response<re::ActionResult>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let action = digest_of(request.action_digest.as_ref())?;
        let limit = self.max_batch();
        let mut result = cache::get_action_result(&client, &instance, action, limit)
            .await
            .map_err(status)?;
        // Inlining is best effort, within one batch's worth of bytes in
        // all (the response's encoding limit is a batch and 1 MiB).
        let mut budget = limit.saturating_sub(result.encoded_len() as u64);
        let mut inline = async |digest: Option<&re::Digest>| -> Option<Vec<u8>> {
            let digest = BlobDigest::from_proto(digest).ok()?;
            if digest.size > budget {
                return None;
            }
            budget -= digest.size;
            cache::read_cas(&client, &instance, digest, limit)
                .await
                .ok()
        };
        if request.inline_stdout
            && let Some(bytes) = inline(result.stdout_digest.as_ref()).await
        {
            result.stdout_raw = bytes;
        }
        if request.inline_stderr
            && let Some(bytes) = inline(result.stderr_digest.as_ref()).await
        {
            result.stderr_raw = bytes;
        }
        // A set: matched against each output file (a list scanned per file
        // was quadratic, seconds of a worker thread for a large request).
        let inline_paths: std::collections::HashSet<&str> = request
            .inline_output_files
            .iter()
            .map(String::as_str)
            .collect();
        for file in &mut result.output_files {
            if inline_paths.contains(file.path.as_str())
                && let Some(bytes) = inline(file.digest.as_ref()).await
            {
                file.contents = bytes;
            }
        }
        Ok(Response::new(result))
    }

    async fn update_action_result(
        &self,
        request: Request<re::UpdateActionResultRequest>,
    ) -> Result<Response<re::ActionResult>, Status> {
        let (client, instance) = self
            .begin(&request, &request.get_ref().instance_name)
            .await?;
        let request = request.into_inner();
        check_digest_function(request.digest_function)?;
        let action = digest_of(request.action_digest.as_ref())?;
        let result = request
            .action_result
            .ok_or_else(|| Status::invalid_argument("action_result is required"))?;
        // Every digest it holds must be well-formed.
        for file in &result.output_files {
            digest_of(file.digest.as_ref())?;
        }
        for directory in &result.output_directories {
            digest_of(directory.tree_digest.as_ref())?;
        }
        for digest in [&result.stdout_digest, &result.stderr_digest]
            .into_iter()
            .flatten()
        {
            digest_of(Some(digest))?;
        }
        // What is stored must be returned: `GetActionResult` sends entries
        // of at most a batch's bytes.
        if result.encoded_len() as u64 > self.max_batch() {
            return Err(Status::invalid_argument(format!(
                "the action result is {} bytes encoded; at most {} (max_batch_total_size_bytes) are stored",
                result.encoded_len(),
                self.max_batch()
            )));
        }
        cache::update_action_result(&client, &instance, action, &result)
            .await
            .map_err(status)?;
        Ok(Response::new(result))
    }
}

/// Items of one batch request worked on at once: each is a call to the
/// cluster, and a batch of tens of thousands of tiny blobs must not become
/// as many calls at once.
const BATCH_ITEMS_AT_ONCE: usize = 64;

/// `work` on every item, at most [`BATCH_ITEMS_AT_ONCE`] at a time; the
/// results in the items' order.
async fn each_bounded<I, R, F, Fut>(items: Vec<I>, work: F) -> Result<Vec<R>, Status>
where
    F: Fn(I) -> Fut,
    Fut: std::future::Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let mut results: Vec<Option<R>> = Vec::with_capacity(items.len());
    results.resize_with(items.len(), || None);
    let mut tasks = tokio::task::JoinSet::new();
    let mut done = |joined: Result<(usize, R), tokio::task::JoinError>| {
        let (i, result) = joined.map_err(|e| Status::internal(e.to_string()))?;
        results[i] = Some(result);
        Ok::<(), Status>(())
    };
    for (i, item) in items.into_iter().enumerate() {
        if tasks.len() >= BATCH_ITEMS_AT_ONCE
            && let Some(joined) = tasks.join_next().await
        {
            done(joined)?;
        }
        let work = work(item);
        tasks.spawn(async move { (i, work.await) });
    }
    while let Some(joined) = tasks.join_next().await {
        done(joined)?;
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every item's work ended"))
        .collect())
}

/// Most requests in flight on one gRPC connection.
pub(crate) const GRPC_STREAMS_PER_CONNECTION: u32 = 256;

/// Serves REAPI and ByteStream on `listener` until `stop`.
pub(crate) async fn serve(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    mut stop: watch::Receiver<bool>,
) {
    let reapi = Reapi {
        gateway: gateway.clone(),
    };
    // A batch's bytes plus the messages' framing.
    let limit = gateway.config.max_batch_bytes as usize + (1 << 20);
    // The HTTP listener's bound, counted apart on this one.
    let max_connections = gateway.config.http_limits.max_connections;
    let counted = gateway
        .metrics
        .layer(
            "reapi",
            tidepool_telemetry::MethodNames::grpc(crate::GRPC_METHODS),
        )
        .traced();
    let router = tonic::transport::Server::builder()
        // Requests in flight on one connection (HTTP/2's own limit, which
        // tonic leaves unset: one connection could hold thousands of
        // uploads and tree reads at once). Bazel keeps its requests to a
        // few hundred per connection (`--remote_max_connections`).
        .max_concurrent_streams(Some(GRPC_STREAMS_PER_CONNECTION))
        .max_frame_size(Some(tidepool_security::MAX_FRAME_BYTES))
        // A connection whose peer is gone (host down, a middlebox lost the
        // flow) is found by its unanswered pings and closed.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .layer(counted)
        .add_service(CapabilitiesServer::new(reapi.clone()))
        .add_service(
            ContentAddressableStorageServer::new(reapi.clone())
                .max_decoding_message_size(limit)
                // A `BatchReadBlobs` answer frames each item (its digest,
                // status and message) on top of the data the batch limit
                // counts: a request of 15,000 small digests within the
                // limit got an answer over it, refused every time.
                .max_encoding_message_size(limit.saturating_mul(6)),
        )
        .add_service(
            ActionCacheServer::new(reapi.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        )
        .add_service(crate::bytestream::server(reapi, limit));
    let mut drain = stop.clone();
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let serving = async move {
        match tls {
            // A client that sends nothing is disconnected after a while
            // (`tidepool_security::first_byte`).
            Some(config) => {
                let incoming = tidepool_security::tls::grpc_incoming_tls(
                    listener,
                    move || config.clone(),
                    max_connections,
                );
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
            None => {
                let incoming =
                    tidepool_security::tls::grpc_incoming_plain(listener, max_connections);
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
        }
    };
    // Requests under way get the drain's time to finish, as on the HTTP
    // listener; then the server is dropped. Before, a stream that never
    // ended (a ByteStream read whose client stopped reading) held the
    // stop, and dev mode's Ctrl-C, for ever.
    let drained = async move {
        let _ = drain.wait_for(|s| *s).await;
        tokio::time::sleep(crate::http::DRAIN_TIMEOUT).await;
    };
    tokio::select! {
        result = serving => {
            if let Err(e) = result {
                tracing::error!(error = %e, "the gateway's gRPC server stopped");
            }
        }
        () = drained => {
            tracing::warn!(
                drain_s = crate::http::DRAIN_TIMEOUT.as_secs(),
                "gRPC requests still under way after the drain: no longer waited for (they end with the process)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tidepool_client::proto::v1::TokenGrant;

    #[test]
    fn only_callers_who_may_write_may_splice() {
        let me = |namespace: &str, roles: &[Role]| WhoAmIResponse {
            token_name: "t".into(),
            grants: vec![TokenGrant {
                namespace: namespace.into(),
                roles: roles.iter().map(|r| *r as i32).collect(),
            }],
            ..Default::default()
        };
        assert!(!may_store(&me("cache.cas", &[Role::Read]), "cache.cas"));
        assert!(!may_store(&me("other", &[Role::Write]), "cache.cas"));
        assert!(!may_store(
            &me("cache.cas", &[Role::Read, Role::Delete]),
            "cache.cas"
        ));
        assert!(may_store(&me("cache.cas", &[Role::Write]), "cache.cas"));
        assert!(may_store(
            &me("cache.cas", &[Role::AppendOnly]),
            "cache.cas"
        ));
        assert!(may_store(&me("*", &[Role::Read, Role::Write]), "cache.cas"));
        let admin = WhoAmIResponse {
            admin: true,
            ..Default::default()
        };
        assert!(may_store(&admin, "cache.cas"));
        let open = WhoAmIResponse {
            open: true,
            ..Default::default()
        };
        assert!(may_store(&open, "cache.cas"));
    }

    /// A batch's items are worked on at most `BATCH_ITEMS_AT_ONCE` at a
    /// time, and their results come back in the items' order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batch_items_run_bounded_and_answer_in_order() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let items: Vec<u64> = (0..500).collect();
        let results = each_bounded(items, |item| {
            let (running, most) = (running.clone(), most.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // Later items finish first.
                tokio::time::sleep(std::time::Duration::from_micros(500 - item)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                item * 2
            }
        })
        .await
        .unwrap();
        assert_eq!(results, (0..500).map(|i| i * 2).collect::<Vec<_>>());
        let most = most.load(Ordering::SeqCst);
        assert!(most <= BATCH_ITEMS_AT_ONCE, "{most} at once");
        assert!(most > 1, "items run concurrently");
    }
}
