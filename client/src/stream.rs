//! Blobs of any size: split into chunks of at most the cluster's value
//! limit, each stored as its own blob, plus a manifest blob
//! (`BLOB_KIND_MANIFEST`, a `ChunkManifest`) under the caller's key.
//! Reads verify every chunk before its bytes reach the caller, and the
//! whole blob's digest at the end.
//!
//! Chunk keys: in a content-addressed namespace, the chunk's SHA-256 (so
//! chunks are shared and deduplicated; deleting a blob leaves them to
//! retention); elsewhere `SHA-256("tidepool.v1.chunk" || key || nonce ||
//! index)` with a random nonce per put, so concurrent puts of one key never
//! mix chunks, and a replaced or deleted blob's chunks are deleted once the
//! new blob is stored (a put's answer names the chunked blob it replaced)
//! or the manifest deleted.

use std::collections::VecDeque;
use std::sync::Arc;

use prost::Message as _;
use sha2::{Digest, Sha256};
use tidepool_proto::v1::{
    BlobInfo, BlobKind, ChunkManifest, ChunkRef, ErrorCode, GetRequest, ReadConsistency,
    ReplacedChunks,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::Instrument as _;

use crate::client::{Client, PutOutcome, blob_ref, digest_of, read_blob, sha256};
use crate::cluster::Cluster;
use crate::error::{Error, Result, Traced as _};

/// Reads until `buf` holds `limit` bytes or the input ends.
async fn read_up_to<R: AsyncRead + Unpin>(reader: &mut R, limit: usize) -> Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(limit.min(8 << 20));
    (&mut *reader)
        .take(limit as u64)
        .read_to_end(&mut buf)
        .await?;
    Ok(buf)
}

fn chunk_key(key: &[u8], nonce: u64, index: u64) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"tidepool.v1.chunk");
    h.update((key.len() as u32).to_le_bytes());
    h.update(key);
    h.update(nonce.to_le_bytes());
    h.update(index.to_le_bytes());
    h.finalize().into()
}

fn corrupt(what: String) -> Error {
    Error::new(ErrorCode::Corrupt, what)
}

impl Client {
    /// Stores everything `reader` yields under `key`, in chunks when it is
    /// larger than one node entry.
    pub async fn put_stream<R: AsyncRead + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        reader: R,
    ) -> Result<PutOutcome> {
        self.put_stream_progress(namespace, key, reader, |_| {})
            .await
    }

    /// [`Client::put_stream`], calling `progress` with the bytes stored so
    /// far after each chunk.
    #[tracing::instrument(name = "tidepool.put_stream", level = "info", skip_all, fields(namespace = %namespace, error_code = tracing::field::Empty))]
    pub async fn put_stream_progress<R: AsyncRead + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        mut reader: R,
        mut progress: impl FnMut(u64),
    ) -> Result<PutOutcome> {
        let result: Result<PutOutcome> = async {
            let mut upload = self.upload(namespace, key).await?;
            let limit = self.chunk_size();
            loop {
                // A failed read or write deletes the chunks stored so far
                // before the error is returned (not left to a background
                // task a process about to exit would never run).
                let piece = match read_up_to(&mut reader, limit).await {
                    Ok(piece) => piece,
                    Err(error) => {
                        upload.abort().await;
                        return Err(error);
                    }
                };
                if piece.is_empty() {
                    break;
                }
                if let Err(error) = upload.write(&piece).await {
                    upload.abort().await;
                    return Err(error);
                }
                progress(upload.written());
            }
            upload.finish().await
        }
        .await;
        result.traced()
    }

    /// The chunks a blob is stored as, in order: a chunked blob's from its
    /// manifest, a plain blob as its single chunk (its own key).
    pub async fn chunks(&self, namespace: &str, key: &[u8]) -> Result<Vec<ChunkRef>> {
        if let Some(manifest) = self.manifest_if_chunked(namespace, key).await? {
            return Ok(manifest.chunks);
        }
        let meta = self.head(namespace, key).await?;
        Ok(vec![ChunkRef {
            key: key.to_vec(),
            size: meta.size,
            sha256: meta.sha256.to_vec(),
        }])
    }

    /// Stores under `key`, in a content-addressed namespace, the blob made
    /// of `chunks` — plain blobs already stored there, named by their
    /// digests, in order. Every chunk is read and verified, and their
    /// concatenation must hash to `key` (`DIGEST_MISMATCH`); a missing
    /// chunk is `NOT_FOUND`.
    pub async fn splice(
        &self,
        namespace: &str,
        key: &[u8],
        chunks: &[[u8; 32]],
    ) -> Result<PutOutcome> {
        let chunks: Vec<([u8; 32], Option<u64>)> = chunks.iter().map(|c| (*c, None)).collect();
        self.splice_chunks(namespace, key, &chunks).await
    }

    /// [`Client::splice`] of chunks named with their sizes, as digests
    /// name blobs (a build cache's): a chunk stored with another size is
    /// `NOT_FOUND`, found at its first answer — before its bytes are sent,
    /// and before any later chunk is read (a request naming one stored
    /// chunk thousands of times with a size of 0 made the cluster read it
    /// every time before the final digest check failed).
    pub async fn splice_sized(
        &self,
        namespace: &str,
        key: &[u8],
        chunks: &[([u8; 32], u64)],
    ) -> Result<PutOutcome> {
        let chunks: Vec<([u8; 32], Option<u64>)> =
            chunks.iter().map(|(c, size)| (*c, Some(*size))).collect();
        self.splice_chunks(namespace, key, &chunks).await
    }

    async fn splice_chunks(
        &self,
        namespace: &str,
        key: &[u8],
        chunks: &[([u8; 32], Option<u64>)],
    ) -> Result<PutOutcome> {
        if !self.content_addressed(namespace).await? {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "splicing is for content-addressed namespaces",
            ));
        }
        let mut whole = Sha256::new();
        let mut manifest = ChunkManifest::default();
        let mut epoch = 0;
        for (chunk, size) in chunks {
            let (info, bytes) = self.get_verified(namespace, chunk, true, *size).await?;
            epoch = info.epoch;
            if info.kind == BlobKind::Manifest as i32 || sha256(&bytes)[..] != chunk[..] {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("chunk {} is not a plain blob of its digest", hex(chunk)),
                ));
            }
            whole.update(&bytes);
            manifest.size += bytes.len() as u64;
            manifest.chunks.push(ChunkRef {
                key: chunk.to_vec(),
                size: bytes.len() as u64,
                sha256: chunk.to_vec(),
            });
        }
        let digest: [u8; 32] = whole.finalize().into();
        if digest[..] != key[..] {
            return Err(Error::new(
                ErrorCode::DigestMismatch,
                "the chunks do not concatenate to the blob of this digest",
            ));
        }
        if manifest.chunks.is_empty() {
            // The empty blob: stored (none of the chunks is it).
            return self.put_one(namespace, key, &[], BlobKind::Data).await;
        }
        if manifest.chunks.len() == 1 {
            // One chunk is the blob itself (stored under its digest).
            return Ok(PutOutcome {
                size: manifest.size,
                sha256: digest,
                epoch,
                already_present: true,
            });
        }
        manifest.sha256 = digest.to_vec();
        let mut outcome = self
            .put_one(
                namespace,
                key,
                &manifest.encode_to_vec(),
                BlobKind::Manifest,
            )
            .await?;
        outcome.size = manifest.size;
        outcome.sha256 = digest;
        Ok(outcome)
    }

    /// Starts writing a blob under `key` piece by piece ([`Upload`]):
    /// for producers that do not hold the whole blob, or that resume.
    pub async fn upload(&self, namespace: &str, key: &[u8]) -> Result<Upload> {
        let cas = self.content_addressed(namespace).await?;
        Ok(Upload {
            client: self.clone(),
            namespace: namespace.to_string(),
            key: key.to_vec(),
            cas,
            // Under a budget smaller than a chunk, chunks fit it.
            chunk_size: self.upload_memory.as_ref().map_or(self.chunk_size(), |m| {
                self.chunk_size().min(m.bytes()).max(EARLY_CHUNK_MIN)
            }),
            pending: Vec::new(),
            manifest: ChunkManifest {
                nonce: if cas { 0 } else { rand::random() },
                ..ChunkManifest::default()
            },
            storing: std::collections::VecDeque::new(),
            chunk_epochs: Vec::new(),
            whole: Sha256::new(),
            expected: None,
            written: 0,
            failed: false,
            published: false,
            started: 0,
            memory: self.upload_memory.clone(),
            reserved: None,
        })
    }

    /// Opens a blob for reading in verified pieces ([`BlobReader`]),
    /// from `offset`, at most `limit` bytes (`None`: to the end).
    pub async fn open_range(
        &self,
        namespace: &str,
        key: &[u8],
        offset: u64,
        limit: Option<u64>,
    ) -> Result<BlobReader> {
        self.open_checked(namespace, key, offset, limit, None).await
    }

    /// [`Client::open_range`] of the blob only if it is `size` bytes:
    /// `NOT_FOUND` otherwise, as soon as the node's first answer names
    /// another size: the rest of a blob stored whole is neither received
    /// nor hashed (a caller naming blobs by hash and size, as build caches
    /// do, is not made to fetch and hash a blob of another size; a chunked
    /// blob's size is known from its manifest).
    pub async fn open_sized(
        &self,
        namespace: &str,
        key: &[u8],
        size: u64,
        offset: u64,
        limit: Option<u64>,
    ) -> Result<BlobReader> {
        let reader = self
            .open_checked(namespace, key, offset, limit, Some(size))
            .await?;
        if reader.size() != size {
            return Err(Error::new(
                ErrorCode::NotFound,
                format!("the blob is {} bytes, not {size}", reader.size()),
            ));
        }
        Ok(reader)
    }

    #[tracing::instrument(name = "tidepool.open_range", level = "info", skip_all, fields(namespace = %namespace, offset, error_code = tracing::field::Empty))]
    async fn open_checked(
        &self,
        namespace: &str,
        key: &[u8],
        offset: u64,
        limit: Option<u64>,
        size: Option<u64>,
    ) -> Result<BlobReader> {
        let result: Result<BlobReader> = async {
            let cas = self.content_addressed(namespace).await?;
            // Room for what the read may hold, taken before it is asked
            // for: the size named, else a whole chunk; cut to the size read.
            let mut room = match &self.read_memory {
                None => None,
                Some(memory) => {
                    let most = self.chunk_size() as u64;
                    let bytes = size.map_or(most, |size| size.min(most)) as usize;
                    Some(memory.hold(bytes, self.timeout, "read").await?)
                }
            };
            let (info, mut content) = self.get_verified(namespace, key, cas, size).await?;
            if let (Some(memory), Some(room)) = (&self.read_memory, room.as_mut()) {
                let kept = if info.kind == BlobKind::Manifest as i32 {
                    0
                } else {
                    content.len()
                };
                memory.shrink(room, kept);
            }
            let mut reader = BlobReader {
                client: self.clone(),
                namespace: namespace.to_string(),
                key: key.to_vec(),
                cas,
                size: 0,
                sha256: [0; 32],
                epoch: info.epoch,
                current_epoch: info.current_epoch,
                plain: None,
                manifest: ChunkManifest::default(),
                next_chunk: 0,
                whole: None,
                skip: 0,
                remaining: limit.unwrap_or(u64::MAX),
                fetching: VecDeque::new(),
                fetch_next: 0,
                wanted: 0,
                requested: 0,
                failed: None,
                held: None,
            };
            if info.kind != BlobKind::Manifest as i32 {
                // `get_verified` checked the bytes against this digest.
                let digest = digest_of(&info.sha256)?;
                if cas && digest[..] != key[..] {
                    return Err(corrupt(format!(
                        "the content read under {} does not hash to it",
                        hex(key)
                    )));
                }
                reader.size = content.len() as u64;
                reader.sha256 = digest;
                let start = offset.min(reader.size) as usize;
                content.drain(..start);
                reader.plain = Some(content);
                reader.held = room;
                return Ok(reader);
            }
            let manifest = ChunkManifest::decode(&content[..])
                .map_err(|e| corrupt(format!("the manifest of {} is unreadable: {e}", hex(key))))?;
            reader.size = manifest.size;
            reader.sha256 = digest_of(&manifest.sha256)
                .map_err(|_| corrupt(format!("the manifest of {} has no digest", hex(key))))?;
            // The first chunk holding `offset`; the whole blob's digest is
            // checked when the range is the whole blob (a limit of its size
            // or more, as HTTP's `Range: bytes=0-` reads ask, included).
            let mut start = 0u64;
            while reader.next_chunk < manifest.chunks.len()
                && start + manifest.chunks[reader.next_chunk].size <= offset
            {
                start += manifest.chunks[reader.next_chunk].size;
                reader.next_chunk += 1;
            }
            reader.skip = offset.saturating_sub(start);
            reader.fetch_next = reader.next_chunk;
            reader.wanted = reader.skip.saturating_add(reader.remaining);
            if offset == 0 && limit.is_none_or(|limit| limit >= manifest.size) {
                reader.whole = Some(Sha256::new());
            }
            reader.manifest = manifest;
            Ok(reader)
        }
        .await;
        result.traced()
    }

    async fn delete_chunk(&self, namespace: &str, key: &[u8]) -> Result<()> {
        self.delete_one(namespace, key).await.map(|_| ())
    }

    /// Deletes `chunks`, the chunks of a blob under `key` that was
    /// replaced or deleted, [`DELETE_DEPTH`] at a time (a small put over a
    /// blob of thousands of chunks waited for them one by one). The
    /// blob's fate is settled: a chunk not deleted (a token without the
    /// delete role, a shard unavailable) is logged and left behind, its
    /// space taken.
    pub(crate) async fn delete_old_chunks(
        &self,
        namespace: &str,
        key: &[u8],
        chunks: Vec<[u8; 32]>,
    ) {
        let mut deleting = tokio::task::JoinSet::new();
        let log = |result: std::result::Result<Result<()>, tokio::task::JoinError>| {
            let error = match result {
                Ok(Ok(())) => return,
                Ok(Err(error)) => error.to_string(),
                Err(error) => error.to_string(),
            };
            tracing::warn!(
                %error,
                key = %hex(key),
                "a chunk of a replaced or deleted blob was not deleted; its space stays taken"
            );
        };
        for chunk in chunks {
            if deleting.len() >= DELETE_DEPTH
                && let Some(done) = deleting.join_next().await
            {
                log(done);
            }
            let (client, namespace) = (self.clone(), namespace.to_string());
            deleting.spawn(
                async move { client.delete_chunk(&namespace, &chunk).await }.in_current_span(),
            );
        }
        while let Some(done) = deleting.join_next().await {
            log(done);
        }
    }

    /// Writes the blob to `writer` (reassembling a chunked one); returns
    /// its size. Every chunk is verified before it is written; the whole
    /// blob's digest is checked at the end (and against the key in a
    /// content-addressed namespace).
    pub async fn get_stream<W: AsyncWrite + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        writer: W,
    ) -> Result<u64> {
        self.get_stream_progress(namespace, key, writer, |_, _| {})
            .await
    }

    /// [`Client::get_stream`], calling `progress(done, total)` after each
    /// chunk.
    pub async fn get_stream_progress<W: AsyncWrite + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        mut writer: W,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<u64> {
        let mut reader = self.open_range(namespace, key, 0, None).await?;
        let mut done = 0;
        while let Some(piece) = reader.next_piece().await? {
            writer.write_all(&piece).await?;
            done += piece.len() as u64;
            progress(done, reader.size());
        }
        writer.flush().await?;
        Ok(done)
    }

    /// One stored blob, verified against its stored digest. A leader
    /// whose copy is damaged (`CORRUPT`) is skipped: the replicas are asked
    /// directly, and bytes are taken only if they hash to the blob's
    /// digest — its key in a content-addressed namespace, else the one the
    /// leader's header names (read linearizably: a replica behind holds an
    /// older version, whose bytes do not match). Before, outside
    /// content-addressed namespaces one damaged copy made the blob
    /// unreadable while two good ones existed.
    async fn get_verified(
        &self,
        namespace: &str,
        key: &[u8],
        cas: bool,
        size: Option<u64>,
    ) -> Result<(BlobInfo, Vec<u8>)> {
        let first = self
            .get_sized(namespace, key, ReadConsistency::Linearizable, size)
            .await;
        match first {
            Err(e) if e.code() == ErrorCode::Corrupt => {
                let (expected, kind) = if cas {
                    (key.to_vec(), None)
                } else {
                    // The header alone, unchecked: a small blob's checked
                    // head reads (and fails on) the whole damaged value.
                    match self.head_info_checked(namespace, key, false).await {
                        Ok(head) => (head.sha256, Some(head.kind)),
                        // The header itself is damaged: no digest to check
                        // another copy against.
                        Err(_) => return Err(e),
                    }
                };
                let map = self.cluster.map();
                let route = Cluster::route(&map, namespace, key)?;
                for replica in &route.shard.replicas {
                    let Some(address) = Cluster::address(&map, replica.node_id) else {
                        continue;
                    };
                    if let Ok((info, bytes)) = self.get_any_replica(&address, namespace, key).await
                        && (sha256(&bytes)[..] == expected[..]
                            && kind.is_none_or(|k| k == info.kind)
                            || cas && describes(&info, &bytes, key))
                    {
                        return Ok((info, bytes));
                    }
                }
                Err(e)
            }
            other => other,
        }
    }

    /// A read from one replica's applied state.
    async fn get_any_replica(
        &self,
        address: &str,
        namespace: &str,
        key: &[u8],
    ) -> Result<(BlobInfo, Vec<u8>)> {
        let channel = self.channel_as_caller(address)?;
        let request = GetRequest {
            blob: blob_ref(namespace, key),
            consistency: ReadConsistency::AnyReplica as i32,
            ..GetRequest::default()
        };
        read_blob(channel, request, self.chunk_size())
            .await
            .map_err(|s| Error::new(ErrorCode::Internal, s.message().to_string()))
    }

    /// What a listing shows of the blob under `key` now (its whole size
    /// and SHA-256); `None` if it is gone. A key listed as chunked may hold
    /// a plain blob by the time the listing reaches it (overwritten): it is
    /// listed as that, not left out — it was there all along.
    pub(crate) async fn listed_now(
        &self,
        namespace: &str,
        key: &[u8],
    ) -> Result<Option<crate::list::ListEntry>> {
        let listed = |info: &BlobInfo, sha256: &[u8], size: u64, chunked: bool| {
            Ok(Some(crate::list::ListEntry {
                key: key.to_vec(),
                size,
                sha256: sha256.try_into().map_err(|_| {
                    corrupt(format!(
                        "the blob under {} names a SHA-256 that is not 32 bytes",
                        hex(key)
                    ))
                })?,
                epoch: info.epoch,
                chunked,
            }))
        };
        // One read of the manifest, no head first: listing a repository of
        // a million chunked objects (restic's packs) took two linearizable
        // round trips each. A key overwritten since by a plain blob is read
        // whole here (at most one node entry): rare, and bounded.
        let (info, content) = match self
            .get_one(namespace, key, ReadConsistency::Linearizable)
            .await
        {
            Ok(found) => found,
            Err(e) if e.code() == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if info.kind != BlobKind::Manifest as i32 {
            return listed(&info, &info.sha256, info.size, false);
        }
        let manifest = ChunkManifest::decode(&content[..])
            .map_err(|e| corrupt(format!("the manifest of {} is unreadable: {e}", hex(key))))?;
        listed(&info, &manifest.sha256, manifest.size, true)
    }

    /// The manifest under `key` if the blob there is chunked; `None` if it
    /// is a plain blob or absent.
    pub(crate) async fn manifest_if_chunked(
        &self,
        namespace: &str,
        key: &[u8],
    ) -> Result<Option<ChunkManifest>> {
        match self.head_info(namespace, key).await {
            Ok(info) if info.kind == BlobKind::Manifest as i32 => {}
            Ok(_) => return Ok(None),
            Err(e) if e.code() == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        }
        // Replaced (by a plain blob) or deleted since the head: what is
        // there now is the answer, not a manifest to decode (decoded, plain
        // bytes made a delete, a put or a read fail CORRUPT).
        let (info, content) = match self
            .get_one(namespace, key, ReadConsistency::Linearizable)
            .await
        {
            Ok(found) => found,
            Err(e) if e.code() == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if info.kind != BlobKind::Manifest as i32 {
            return Ok(None);
        }
        ChunkManifest::decode(&content[..])
            .map(Some)
            .map_err(|e| corrupt(format!("the manifest of {} is unreadable: {e}", hex(key))))
    }
}

/// A blob being written piece by piece ([`Client::upload`]): every full
/// chunk is stored as soon as it is complete, while the next fills (at
/// most [`UPLOAD_DEPTH`] chunks being stored at once, so memory stays
/// under `UPLOAD_DEPTH + 1` chunks), and [`Upload::finish`] stores the blob — a plain blob when it
/// fits one node entry, else the manifest of its chunks. Nothing is
/// visible under the key before `finish`. A failed write poisons the
/// upload (start again).
pub struct Upload {
    client: Client,
    namespace: String,
    key: Vec<u8>,
    cas: bool,
    chunk_size: usize,
    pending: Vec<u8>,
    manifest: ChunkManifest,
    /// Chunks being stored, oldest first (each task hashes and stores
    /// one; their references join the manifest in this order).
    storing: std::collections::VecDeque<tokio::task::JoinHandle<Result<(ChunkRef, u64)>>>,
    /// The epoch each stored chunk was written in (the manifest's order).
    chunk_epochs: Vec<u64>,
    whole: Sha256,
    /// The SHA-256 the content must have ([`Upload::expect_sha256`]).
    expected: Option<[u8; 32]>,
    written: u64,
    failed: bool,
    /// The manifest's put was sent: its chunks are the blob's from then on
    /// (even when the answer is an error, the put may have applied).
    published: bool,
    /// Chunks whose store was started (stored, being stored or failed).
    started: u64,
    /// The client's upload budget, if it has one.
    memory: Option<Arc<MemoryBudget>>,
    /// The room `pending` holds under the budget (KiB units). Moves with
    /// the chunk to its store.
    reserved: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Room under a client's read budget, given back when dropped
/// ([`BlobReader::take_room`]).
#[derive(Debug)]
pub struct ReadRoom(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

/// A budget of memory shared by a client's clones, counted in KiB: what
/// its uploads buffer ([`Client::with_upload_memory`]), or what its
/// readers hold ([`Client::with_read_memory`]).
#[derive(Debug)]
pub(crate) struct MemoryBudget {
    permits: Arc<tokio::sync::Semaphore>,
    /// The whole budget, KiB.
    units: u32,
}

impl MemoryBudget {
    pub(crate) fn new(bytes: u64) -> MemoryBudget {
        let units = (bytes >> 10).clamp(1, u64::from(u32::MAX >> 4)) as u32;
        MemoryBudget {
            permits: Arc::new(tokio::sync::Semaphore::new(units as usize)),
            units,
        }
    }

    /// KiB units holding `bytes` (at least 1, at most the whole budget).
    fn units_for(&self, bytes: usize) -> u32 {
        (bytes.div_ceil(1024) as u64).clamp(1, u64::from(self.units)) as u32
    }

    /// The whole budget, bytes.
    fn bytes(&self) -> usize {
        (self.units as usize) << 10
    }

    /// Room for `bytes` (at most the whole budget), waited for at most
    /// `timeout`: `OVERLOADED` then, saying what it was for.
    async fn hold(
        &self,
        bytes: usize,
        timeout: std::time::Duration,
        what: &str,
    ) -> Result<tokio::sync::OwnedSemaphorePermit> {
        let acquire = self
            .permits
            .clone()
            .acquire_many_owned(self.units_for(bytes));
        match tokio::time::timeout(timeout, acquire).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => unreachable!("a memory budget is never closed"),
            Err(_) => Err(Error::new(
                ErrorCode::Overloaded,
                format!(
                    "this client's {what} memory ({} KiB) stayed taken for {timeout:?}; try again later",
                    self.units
                ),
            )),
        }
    }

    /// Room for `bytes` (at most the whole budget) if there is some now.
    fn try_hold(&self, bytes: usize) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.permits
            .clone()
            .try_acquire_many_owned(self.units_for(bytes))
            .ok()
    }

    /// Gives back the room of `permit` beyond what `bytes` take.
    fn shrink(&self, permit: &mut tokio::sync::OwnedSemaphorePermit, bytes: usize) {
        let keep = self.units_for(bytes) as usize;
        if permit.num_permits() > keep {
            drop(permit.split(permit.num_permits() - keep));
        }
    }
}

/// Under an upload budget with no room left, an upload that buffers at
/// least this much stores it at once as a chunk of its own (its room
/// comes back once stored) instead of waiting; with less it waits.
const EARLY_CHUNK_MIN: usize = 256 << 10;

impl std::fmt::Debug for Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload")
            .field("namespace", &self.namespace)
            .field("key", &hex(&self.key))
            .field("written", &self.written)
            .finish()
    }
}

impl Upload {
    /// Makes [`Upload::finish`] store nothing under the key unless the
    /// content's SHA-256 is `digest` (`DIGEST_MISMATCH`; chunks already
    /// stored are deleted, see the drop). The upload hashes
    /// the content anyway, so a caller that needs it checked (an object
    /// named by its digest) need not hash it again.
    pub fn expect_sha256(&mut self, digest: [u8; 32]) {
        self.expected = Some(digest);
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Makes room under the client's upload budget for `pending` to hold
    /// `more` bytes beyond what it holds: reserved as the bytes come (a
    /// client holds room only for bytes it sent). With no room left, a
    /// pending piece of at least [`EARLY_CHUNK_MIN`] is stored at once as
    /// a chunk of its own — storing needs no room, and gives its room back
    /// when done — so an upload never waits holding much while the others
    /// do the same; with less, it waits, at most the call timeout
    /// (`OVERLOADED`).
    async fn reserve(&mut self, more: usize) -> Result<()> {
        let Some(memory) = self.memory.clone() else {
            return Ok(());
        };
        loop {
            let have = self.reserved.as_ref().map_or(0, |p| p.num_permits() as u32);
            let want = memory.units_for(self.pending.len() + more);
            if want <= have {
                return Ok(());
            }
            let permit = match memory.permits.clone().try_acquire_many_owned(want - have) {
                Ok(permit) => permit,
                Err(_) if self.pending.len() >= EARLY_CHUNK_MIN => {
                    let chunk = std::mem::take(&mut self.pending);
                    self.store_chunk(chunk).await?;
                    continue;
                }
                Err(_) => {
                    memory
                        .hold(
                            ((want - have) as usize) << 10,
                            self.client.timeout,
                            "upload",
                        )
                        .await?
                }
            };
            match &mut self.reserved {
                Some(held) => held.merge(permit),
                None => self.reserved = Some(permit),
            }
            return Ok(());
        }
    }

    /// Stores what the upload buffers as a chunk of its own now, if it is
    /// at least 256 KiB (what a server does for an upload its
    /// client paused, so the upload holds no room meanwhile under the
    /// client's budget). A blob of at most one chunk is still stored
    /// whole: `finish` reads those bytes back.
    pub async fn store_buffered(&mut self) -> Result<()> {
        if self.failed {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "an earlier write of this upload failed or was cancelled; start the upload again",
            ));
        }
        if self.pending.len() < EARLY_CHUNK_MIN {
            return Ok(());
        }
        self.failed = true;
        let chunk = std::mem::take(&mut self.pending);
        self.store_chunk(chunk).await?;
        self.failed = false;
        Ok(())
    }

    /// Keys of the chunks whose store was started so far, outside a
    /// content-addressed namespace (where a chunk's key is its digest).
    #[doc(hidden)]
    pub fn started_chunk_keys(&self) -> Vec<[u8; 32]> {
        (0..self.started)
            .map(|index| chunk_key(&self.key, self.manifest.nonce, index))
            .collect()
    }

    /// Appends `bytes`, storing every chunk that is complete. A write
    /// that fails, or is cancelled (its future dropped before it ended),
    /// ends the upload: every later call fails.
    pub async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if self.failed {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "an earlier write of this upload failed or was cancelled; start the upload again",
            ));
        }
        // Failed until this write ends: cancelled while it waits for a
        // store, the bytes it took are counted in the blob's size and
        // digest but held by no chunk, and a `finish` after it stored a
        // blob every read of which is `CORRUPT`.
        self.failed = true;
        self.whole.update(bytes);
        self.written += bytes.len() as u64;
        // A chunk is stored once more bytes follow it, so that a blob of at
        // most one chunk stays a plain blob. `pending` never holds more than
        // a chunk: a large write is taken a chunk at a time (copied once,
        // not gathered whole and then split again and again).
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.pending.len() == self.chunk_size {
                let chunk =
                    std::mem::replace(&mut self.pending, Vec::with_capacity(self.chunk_size));
                self.store_chunk(chunk).await?;
            }
            let take = (self.chunk_size - self.pending.len()).min(rest.len());
            self.reserve(take).await?;
            self.pending.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
        }
        self.failed = false;
        Ok(())
    }

    /// Starts storing `chunk` (after waiting for the oldest chunk being
    /// stored if [`UPLOAD_DEPTH`] are).
    async fn store_chunk(&mut self, chunk: Vec<u8>) -> Result<()> {
        if self.storing.len() >= UPLOAD_DEPTH {
            self.stored_oldest().await?;
        }
        let index = (self.manifest.chunks.len() + self.storing.len()) as u64;
        self.started = index + 1;
        let named = (!self.cas).then(|| chunk_key(&self.key, self.manifest.nonce, index));
        // Outside content-addressed namespaces a chunk is no blob of its
        // own: it is not listed (the blob is, by its manifest).
        let kind = if self.cas {
            BlobKind::Data
        } else {
            BlobKind::Chunk
        };
        let (client, namespace) = (self.client.clone(), self.namespace.clone());
        // The chunk's room goes with it, given back once stored.
        let reserved = self.reserved.take();
        let store = async move {
            let _reserved = reserved;
            let digest = sha256(&chunk);
            let key = named.unwrap_or(digest);
            let (stored, retried) = client
                .put_hashed_retried(&namespace, &key, &chunk, kind, digest)
                .await?;
            let chunk = ChunkRef {
                key: key.to_vec(),
                size: chunk.len() as u64,
                sha256: digest.to_vec(),
            };
            // A retried put may have been answered for an earlier copy
            // that applied in an earlier epoch (the node answers a
            // duplicate with the epoch of the copy it refused): epoch 0
            // says "unknown", so the chunk is moved to its manifest's
            // epoch whatever that is. Taken at its word, the chunk was
            // dropped an epoch before its manifest.
            Ok((chunk, if retried { 0 } else { stored.epoch }))
        };
        self.storing
            .push_back(tokio::spawn(tracing::Instrument::in_current_span(store)));
        Ok(())
    }

    /// Waits for the oldest chunk being stored and adds it to the
    /// manifest.
    async fn stored_oldest(&mut self) -> Result<()> {
        // Awaited where it stands, taken out only once it ended: an upload
        // dropped during this wait (its caller gone) still finds the store
        // among those its cleanup waits for before deleting the chunks —
        // taken out first, it could apply after the delete of its key and
        // leave its chunk stored, unnamed, for good.
        let Some(task) = self.storing.front_mut() else {
            return Ok(());
        };
        let stored = task
            .await
            .map_err(|e| Error::new(ErrorCode::Internal, format!("a chunk's store failed: {e}")))
            .and_then(|r| r);
        self.storing.pop_front();
        match stored {
            Ok((chunk, epoch)) => {
                self.manifest.chunks.push(chunk);
                self.chunk_epochs.push(epoch);
                Ok(())
            }
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }

    /// Stores the blob. In a content-addressed namespace the content must
    /// hash to the key (`DIGEST_MISMATCH`; its chunks stay, to
    /// retention). Outside one, a chunked blob it replaces has its own
    /// chunks deleted afterwards.
    pub async fn finish(mut self) -> Result<PutOutcome> {
        let result = self.finish_inner().await;
        if let Err(error) = &result
            && self.published
            && refused_for_sure(error)
        {
            // The manifest's put was refused before it could apply (an
            // append-only token over a stored key, a full disk): its
            // chunks are nobody's.
            self.published = false;
        }
        if result.is_err()
            && let Some(cleanup) = self.take_cleanup()
        {
            cleanup.await;
        }
        result
    }

    /// Deletes the chunks stored so far and ends the upload (what dropping
    /// it does in the background, awaited: a process about to exit).
    pub async fn abort(mut self) {
        if let Some(cleanup) = self.take_cleanup() {
            cleanup.await;
        }
    }

    /// The deletion of the chunks this upload started, unless its manifest
    /// was sent or its chunks are shared (content-addressed); after it the
    /// drop does nothing.
    fn take_cleanup(&mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let storing = std::mem::take(&mut self.storing);
        let started = std::mem::take(&mut self.started);
        if self.published || self.cas || started == 0 {
            // Chunks of a published blob stay; a content-addressed chunk
            // being stored may finish (it is shared).
            if self.published {
                for task in &storing {
                    task.abort();
                }
            }
            return None;
        }
        let (client, namespace, key, nonce) = (
            self.client.clone(),
            self.namespace.clone(),
            self.key.clone(),
            self.manifest.nonce,
        );
        Some(async move {
            for task in storing {
                let _ = task.await;
            }
            for index in 0..started {
                let chunk = chunk_key(&key, nonce, index);
                if let Err(error) = client.delete_chunk(&namespace, &chunk).await {
                    tracing::warn!(
                        %error,
                        key = %hex(&key),
                        "a chunk of an unfinished upload was not deleted"
                    );
                }
            }
        })
    }

    /// Stores as a plain blob an upload of at most one chunk whose first
    /// bytes were stored early as chunks (its client paused it, or the
    /// upload budget was full): read back, joined, and put whole; outside
    /// content-addressed namespaces the early chunks are deleted after
    /// (in one they are content-addressed and may be shared: retention
    /// takes them). A blob of at most one chunk is always stored whole:
    /// a build cache's presence check touches only its key, and a small
    /// manifest there outlived its chunks — found present, read
    /// `NOT_FOUND`, and never healed by a re-upload (the node answers a
    /// content-addressed put of a present key "already present").
    async fn finish_whole(&mut self, digest: [u8; 32]) -> Result<PutOutcome> {
        while !self.storing.is_empty() {
            self.stored_oldest().await?;
        }
        let (client, namespace, key) = (
            self.client.clone(),
            self.namespace.clone(),
            self.key.clone(),
        );
        // The whole blob is held until it is stored: under the budget, as
        // what the upload buffers is (its own room given back first, so it
        // does not wait for itself; at most the whole budget).
        let _room = match self.memory.clone() {
            Some(memory) => {
                self.reserved = None;
                Some(
                    memory
                        .hold(self.written as usize, client.timeout, "upload")
                        .await?,
                )
            }
            None => None,
        };
        let mut content = Vec::with_capacity(self.written as usize);
        for chunk in &self.manifest.chunks {
            let (_, bytes) = client
                .get_verified(&namespace, &chunk.key, self.cas, Some(chunk.size))
                .await?;
            if sha256(&bytes)[..] != chunk.sha256[..] {
                return Err(Error::new(
                    ErrorCode::Corrupt,
                    "a chunk stored early by this upload read back different: upload the blob again",
                ));
            }
            content.extend_from_slice(&bytes);
        }
        content.extend_from_slice(&self.pending);
        if content.len() as u64 != self.written || sha256(&content) != digest {
            return Err(Error::new(
                ErrorCode::Corrupt,
                "the chunks stored early by this upload do not join into what was written: upload the blob again",
            ));
        }
        let outcome = client
            .put_hashed(&namespace, &key, &content, BlobKind::Data, digest)
            .await?;
        if let Some(cleanup) = self.take_cleanup() {
            cleanup.await;
        }
        Ok(outcome)
    }

    async fn finish_inner(&mut self) -> Result<PutOutcome> {
        if self.failed {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "an earlier write of this upload failed or was cancelled; start the upload again",
            ));
        }
        let (client, namespace, key) = (
            self.client.clone(),
            self.namespace.clone(),
            self.key.clone(),
        );
        let digest: [u8; 32] = self.whole.clone().finalize().into();
        if let Some(expected) = self.expected
            && expected != digest
        {
            return Err(Error::new(
                ErrorCode::DigestMismatch,
                format!(
                    "the content's SHA-256 is {}, not the expected {}; nothing was stored under the key",
                    hex(&digest),
                    hex(&expected)
                ),
            ));
        }
        if self.manifest.chunks.is_empty() && self.storing.is_empty() {
            // A plain blob: the node checks the digest (and, in a
            // content-addressed namespace, that it is the key).
            return client
                .put_hashed(&namespace, &key, &self.pending, BlobKind::Data, digest)
                .await;
        }
        if self.written <= client.chunk_size() as u64 {
            return self.finish_whole(digest).await;
        }
        let last = std::mem::take(&mut self.pending);
        if !last.is_empty() {
            self.store_chunk(last).await?;
        }
        while !self.storing.is_empty() {
            self.stored_oldest().await?;
        }
        if self.cas && key[..] != digest[..] {
            return Err(Error::new(
                ErrorCode::DigestMismatch,
                "the content's SHA-256 is not the key; the chunks were stored, the blob was not",
            ));
        }
        let replaced = if self.cas {
            None
        } else {
            client.manifest_if_chunked(&namespace, &key).await?
        };
        self.manifest.size = self.written;
        self.manifest.sha256 = digest.to_vec();
        self.published = true;
        let manifest = self.manifest.encode_to_vec();
        let (cas, nonce) = (self.cas, self.manifest.nonce);
        let chunks: Vec<(Vec<u8>, u64)> = self
            .manifest
            .chunks
            .iter()
            .map(|c| c.key.clone())
            .zip(self.chunk_epochs.iter().copied())
            .collect();
        let old_nonce = replaced.as_ref().map(|old| old.nonce);
        let mut old_chunks = replaced.map_or_else(Vec::new, |old| own_chunks(&key, &old));
        // Run apart from the caller, and awaited: a caller gone once the
        // manifest is sent (a gateway client disconnecting) no longer cuts
        // the old chunks' deletion short — nothing else names them.
        let stored = tokio::spawn(
            async move {
                let digest = sha256(&manifest);
                let (outcome, replaced, _) = client
                    .put_entry(&namespace, &key, &manifest, BlobKind::Manifest, digest, false)
                    .await?;
                // What the put replaced where it applied, with what was
                // there before the upload ended (an older node does not
                // say; a concurrent put may have come between): both are
                // gone from the key now.
                if replaced.map(|r| r.nonce) != old_nonce {
                    old_chunks.extend(replaced_chunks(&key, replaced, Some(nonce)));
                }
                // Chunks written in an epoch before the manifest's (the
                // upload spanned an advance) are moved to it: left there,
                // the first drop took them an epoch before the manifest,
                // which went on saying the blob exists while its reads
                // failed. A chunk gone already (the upload outlasted the
                // retention) makes the blob unreadable: it is deleted
                // (outside content-addressed namespaces; in one the node
                // checks chunks when a manifest is stored) and the upload
                // fails.
                for (chunk, epoch) in chunks.iter().filter(|(_, e)| *e < outcome.epoch) {
                    match client.touch_one(&namespace, chunk).await {
                        Ok(_) => {}
                        Err(e) if e.code() == ErrorCode::NotFound => {
                            // This upload's manifest only (its nonce): a
                            // put that replaced it since is another's blob.
                            if !cas
                                && let Ok(Some(stored)) =
                                    client.manifest_if_chunked(&namespace, &key).await
                                && stored.nonce == nonce
                            {
                                let _ = client.delete_one(&namespace, &key).await;
                            }
                            return Err(Error::new(
                                ErrorCode::Conflict,
                                format!(
                                    "a chunk written in epoch {epoch} expired before the upload ended: upload the blob again"
                                ),
                            ));
                        }
                        // The blob is stored and readable now: a chunk not
                        // moved (a shard unavailable) is logged, not the
                        // put's failure (its answer would have the chunks
                        // deleted under a stored manifest).
                        Err(error) => tracing::warn!(
                            %error,
                            key = %hex(&key),
                            "a chunk of an earlier epoch than its manifest was not moved to the manifest's"
                        ),
                    }
                }
                // The new blob is stored: the put succeeded whatever
                // happens to the old chunks.
                client.delete_old_chunks(&namespace, &key, old_chunks).await;
                Ok::<_, Error>(outcome)
            }
            .in_current_span(),
        );
        let mut outcome = stored.await.map_err(|e| {
            Error::new(
                ErrorCode::Internal,
                format!("storing the manifest failed: {e}"),
            )
        })??;
        outcome.size = self.written;
        outcome.sha256 = digest;
        Ok(outcome)
    }
}

impl Drop for Upload {
    /// An upload that ends without its manifest sent (dropped, failed, its
    /// digest not the one expected) deletes the chunks it stored, in the
    /// background: outside a content-addressed namespace nothing else
    /// names them (their keys come from the upload's nonce), so they would
    /// never be reclaimed — every interrupted restic upload of a pack
    /// larger than a chunk leaked them. Chunks being stored are waited for
    /// first (a put cut short may still apply). Best effort: a token
    /// without the delete role, an unavailable shard or a process killed
    /// first leaves them (logged). In a content-addressed namespace chunks
    /// are shared, and left to retention.
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            for task in &self.storing {
                task.abort();
            }
            return;
        };
        if let Some(cleanup) = self.take_cleanup() {
            runtime.spawn(cleanup);
        }
    }
}

/// Whether a write's error says it was not applied (see `docs/design/
/// client.md`: the SDK reports an outcome it cannot know as `TIMEOUT`,
/// `SESSION_EXPIRED` or, from the shard, `NO_QUORUM`/`INTERNAL`).
fn refused_for_sure(error: &Error) -> bool {
    !matches!(
        error.code(),
        ErrorCode::Timeout
            | ErrorCode::SessionExpired
            | ErrorCode::NoQuorum
            | ErrorCode::Internal
            | ErrorCode::Unspecified
    )
}

/// Old chunks a put or a delete deletes at once.
pub(crate) const DELETE_DEPTH: usize = 16;

/// Chunks an [`Upload`] stores at once: one in flight while the next
/// fills keeps a single stream's disk and network busy through each
/// chunk's commit round.
pub const UPLOAD_DEPTH: usize = 2;

/// A chunk being fetched: its stored blob, verified against its stored
/// digest.
type ChunkFetch = tokio::task::JoinHandle<
    Result<(
        (BlobInfo, Vec<u8>),
        Option<tokio::sync::OwnedSemaphorePermit>,
    )>,
>;

/// Chunks a [`BlobReader`] fetches beyond the one it hands out next: the
/// next chunk's round trip overlaps the caller's use of this one (as
/// [`UPLOAD_DEPTH`] overlaps a writer's), for at most one more chunk of
/// memory per reader.
pub const READ_AHEAD: usize = 1;

/// A blob opened for reading ([`Client::open_range`]): its size and
/// digest, and its bytes in pieces (a chunk at a time), each verified
/// before it is handed out; a whole read is checked against the blob's
/// digest at the end. Chunks are fetched [`READ_AHEAD`] ahead, never past
/// the range.
pub struct BlobReader {
    client: Client,
    namespace: String,
    key: Vec<u8>,
    cas: bool,
    size: u64,
    sha256: [u8; 32],
    epoch: u64,
    current_epoch: u64,
    plain: Option<Vec<u8>>,
    manifest: ChunkManifest,
    next_chunk: usize,
    whole: Option<Sha256>,
    skip: u64,
    remaining: u64,
    /// Fetches of chunks `next_chunk..fetch_next`, in order.
    fetching: VecDeque<ChunkFetch>,
    fetch_next: usize,
    /// Bytes from the first chunk's start to the range's end, and from it
    /// to the end of chunk `fetch_next - 1`: no chunk wholly past the
    /// range is fetched ahead.
    wanted: u64,
    requested: u64,
    /// The error a piece ended with: every later call answers it again (a
    /// reader past a failed chunk handed out the following chunk's bytes
    /// as if they came next, or panicked).
    failed: Option<(ErrorCode, String)>,
    /// Room under the client's read budget for the bytes this reader
    /// holds or handed out last (given back at the next call).
    held: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for BlobReader {
    /// A reader dropped before its end stops the fetches it started.
    fn drop(&mut self) {
        for task in &self.fetching {
            task.abort();
        }
    }
}

impl std::fmt::Debug for BlobReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobReader")
            .field("namespace", &self.namespace)
            .field("key", &hex(&self.key))
            .field("size", &self.size)
            .finish()
    }
}

impl BlobReader {
    /// Size of the whole blob, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// SHA-256 of the whole blob.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }

    /// Epoch of the blob's last write or touch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The epoch the replica that answered is in (0 if it did not say:
    /// an older node).
    pub fn current_epoch(&self) -> u64 {
        self.current_epoch
    }

    /// Whether the blob was last written or touched before the current
    /// epoch — the later of the answering replica's and the client's map's
    /// (which lags the cluster's for a moment after an advance) — so a
    /// reader keeping it alive must touch it.
    pub fn touch_due(&self) -> bool {
        self.epoch < self.current_epoch.max(self.client.map().epoch)
    }

    /// What a chunk found missing means: if the key no longer holds the
    /// manifest being read, the blob was replaced or deleted meanwhile
    /// (which deletes the old chunks once the new manifest is stored):
    /// `CONFLICT`, read it again. Otherwise the chunk's own error.
    async fn chunk_gone(&mut self, error: Error) -> Error {
        for task in self.fetching.drain(..) {
            task.abort();
        }
        match self
            .client
            .manifest_if_chunked(&self.namespace, &self.key)
            .await
        {
            Ok(Some(current)) if current == self.manifest => error,
            Err(other) => other,
            Ok(_) => Error::new(
                ErrorCode::Conflict,
                format!(
                    "{} was replaced or deleted while it was read (its old chunks are gone): read it again",
                    hex(&self.key)
                ),
            ),
        }
    }

    /// The stored keys the blob is made of: its own and its chunks'
    /// (what to touch to keep it whole).
    pub fn stored_keys(&self) -> Vec<Vec<u8>> {
        std::iter::once(self.key.clone())
            .chain(self.manifest.chunks.iter().map(|c| c.key.clone()))
            .collect()
    }

    /// The whole range at once if the blob is plain (one stored blob,
    /// already read and verified); `None` for a chunked one.
    pub(crate) fn take_plain(&mut self) -> Option<Vec<u8>> {
        let mut content = self.plain.take()?;
        content.truncate(self.remaining.min(content.len() as u64) as usize);
        self.remaining -= content.len() as u64;
        Some(content)
    }

    /// The next verified piece; `None` at the end of the range. After an
    /// error the reader is done: every later call fails the same way (a
    /// retry opens the blob again).
    pub async fn next_piece(&mut self) -> Result<Option<Vec<u8>>> {
        if let Some((code, message)) = &self.failed {
            return Err(Error::new(
                *code,
                format!("{message} (an earlier read of this reader failed: open the blob again)"),
            ));
        }
        // Failed until this call ends: one cancelled while it waits for a
        // chunk has taken that chunk, and the next call would hand out the
        // one after it as the next bytes.
        self.failed = Some((
            ErrorCode::Internal,
            "a read of this reader was cancelled before it ended".into(),
        ));
        let piece = self.next_piece_once().await;
        match &piece {
            Ok(_) => self.failed = None,
            Err(error) => {
                self.failed = Some((error.code(), error.to_string()));
                for task in self.fetching.drain(..) {
                    task.abort();
                }
            }
        }
        piece
    }

    /// The room under the client's read budget
    /// ([`Client::with_read_memory`]) of the piece handed out last, kept
    /// by the caller (until dropped) instead of coming back at the next
    /// call: for a caller that holds the pieces after the reader's end (a
    /// server answering with a small blob whole). `None` without a budget.
    pub fn take_room(&mut self) -> Option<ReadRoom> {
        self.held.take().map(ReadRoom)
    }

    async fn next_piece_once(&mut self) -> Result<Option<Vec<u8>>> {
        // The piece handed out last is the caller's now.
        if self.plain.is_none() {
            self.held = None;
        }
        if let Some(mut content) = self.plain.take() {
            content.truncate(self.remaining.min(content.len() as u64) as usize);
            self.remaining -= content.len() as u64;
            return Ok((!content.is_empty()).then_some(content));
        }
        if self.remaining == 0 || self.next_chunk >= self.manifest.chunks.len() {
            // Read whole: the chunks (all of them: those past the range
            // too) must make exactly the blob the manifest describes.
            if let Some(whole) = self.whole.take() {
                let digest: [u8; 32] = whole.finalize().into();
                let total: u64 = self.manifest.chunks.iter().map(|c| c.size).sum();
                if digest != self.sha256
                    || (self.cas && digest[..] != self.key[..])
                    || total != self.size
                {
                    return Err(corrupt(format!(
                        "the chunks of {} do not add up to the blob its manifest describes",
                        hex(&self.key)
                    )));
                }
            }
            return Ok(None);
        }
        self.fetch_ahead().await?;
        let chunk = self.manifest.chunks[self.next_chunk].clone();
        self.next_chunk += 1;
        let task = self
            .fetching
            .pop_front()
            .expect("the next chunk's fetch was started");
        let fetched = task
            .await
            .map_err(|e| Error::new(ErrorCode::Internal, format!("a chunk's fetch failed: {e}")))?;
        let ((_, mut bytes), room) = match fetched {
            Err(error) if error.code() == ErrorCode::NotFound => {
                return Err(self.chunk_gone(error).await);
            }
            other => other?,
        };
        self.held = room;
        if sha256(&bytes)[..] != chunk.sha256[..] || bytes.len() as u64 != chunk.size {
            return Err(corrupt(format!(
                "chunk {} of {} does not match its manifest",
                hex(&chunk.key),
                hex(&self.key)
            )));
        }
        if let Some(whole) = &mut self.whole {
            whole.update(&bytes);
        }
        let start = self.skip.min(bytes.len() as u64) as usize;
        self.skip = 0;
        let end = (start as u64)
            .saturating_add(self.remaining)
            .min(bytes.len() as u64) as usize;
        self.remaining -= (end - start) as u64;
        bytes.truncate(end);
        bytes.drain(..start);
        Ok(Some(bytes))
    }

    /// Starts fetching the next chunk if it is not under way, and up to
    /// [`READ_AHEAD`] more while they hold bytes of the range. Under a read
    /// budget, the next chunk waits for its room here (the reader holds
    /// nothing else then: the piece handed out last was given back), in
    /// order; one ahead is fetched only with room to spare at once — taken
    /// by tasks racing each other, the room went to a chunk ahead while the
    /// one needed first waited for it for ever.
    async fn fetch_ahead(&mut self) -> Result<()> {
        while self.fetch_next < self.manifest.chunks.len()
            && (self.fetching.is_empty()
                || (self.fetching.len() <= READ_AHEAD && self.requested < self.wanted))
        {
            let chunk = &self.manifest.chunks[self.fetch_next];
            let room = match &self.client.read_memory {
                None => None,
                Some(memory) => {
                    let bytes = chunk.size.min(self.client.chunk_size() as u64) as usize;
                    if self.fetching.is_empty() {
                        Some(memory.hold(bytes, self.client.timeout, "read").await?)
                    } else {
                        match memory.try_hold(bytes) {
                            Some(room) => Some(room),
                            None => break,
                        }
                    }
                }
            };
            let chunk = &self.manifest.chunks[self.fetch_next];
            self.requested = self.requested.saturating_add(chunk.size);
            let (client, namespace, key, cas) = (
                self.client.clone(),
                self.namespace.clone(),
                chunk.key.clone(),
                self.cas,
            );
            let fetch = async move {
                let read = client.get_verified(&namespace, &key, cas, None).await?;
                Ok((read, room))
            };
            self.fetching
                .push_back(tokio::spawn(tracing::Instrument::in_current_span(fetch)));
            self.fetch_next += 1;
        }
        Ok(())
    }
}

/// Whether a replica's copy of a content-addressed key is a manifest
/// intact by its own header (its bytes hash to the digest the header names)
/// describing the blob of digest `key`. A chunked blob's manifest is stored
/// under the blob's digest, which its own bytes never hash to: checked
/// against the key alone, a leader's damaged manifest was never replaced by
/// a healthy replica's. Its chunks are then checked against the manifest,
/// and the whole content against the key, as they are read.
fn describes(info: &BlobInfo, bytes: &[u8], key: &[u8]) -> bool {
    info.kind == BlobKind::Manifest as i32
        && sha256(bytes)[..] == info.sha256[..]
        && ChunkManifest::decode(bytes).is_ok_and(|m| m.sha256[..] == key[..])
}

/// The keys of `manifest`'s chunks that belong to the blob under `key`:
/// those derived from its key and the manifest's nonce. A manifest is data
/// a node returned; deleting whatever keys it lists would let a forged one
/// delete any blob of the namespace, so any other key is left alone (and
/// so are the chunks of manifests written before the nonce was recorded).
pub(crate) fn own_chunks(key: &[u8], manifest: &ChunkManifest) -> Vec<[u8; 32]> {
    manifest
        .chunks
        .iter()
        .enumerate()
        .map(|(index, _)| chunk_key(key, manifest.nonce, index as u64))
        .zip(&manifest.chunks)
        .filter(|(derived, chunk)| derived[..] == chunk.key[..])
        .map(|(derived, _)| derived)
        .collect()
}

/// The chunks to delete after a put under `key` answered that it
/// replaced a chunked blob (`replaced`; `None`: nothing replaced, or not
/// said): the keys derived from the key and its nonce, unless it is this
/// very upload's (`nonce`), whose chunks are the stored blob's.
pub(crate) fn replaced_chunks(
    key: &[u8],
    replaced: Option<ReplacedChunks>,
    nonce: Option<u64>,
) -> Vec<[u8; 32]> {
    match replaced {
        Some(old) if old.count > MAX_REPLACED_CHUNKS => {
            tracing::warn!(
                count = old.count,
                key = %hex(key),
                "a node named more chunks replaced than a manifest can list: none deleted"
            );
            Vec::new()
        }
        Some(old) if old.nonce != 0 && Some(old.nonce) != nonce => (0..old.count)
            .map(|index| chunk_key(key, old.nonce, index))
            .collect(),
        _ => Vec::new(),
    }
}

/// More chunks than an SDK manifest can list (each of its chunk references
/// takes more than 64 bytes; a node value is at most 64 MiB): a larger
/// count is no SDK blob's, and nothing is deleted for it.
const MAX_REPLACED_CHUNKS: u64 = 1 << 20;

/// Lower-case hex of `bytes` (keys in messages).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(key: &[u8]) -> ChunkRef {
        ChunkRef {
            key: key.to_vec(),
            size: 1,
            sha256: vec![0; 32],
        }
    }

    #[test]
    fn only_chunks_derived_from_the_blob_are_its_own() {
        let nonce = 42;
        let own: Vec<[u8; 32]> = (0..3).map(|i| chunk_key(b"blob", nonce, i)).collect();
        let genuine = ChunkManifest {
            chunks: own.iter().map(|k| chunk(k)).collect(),
            nonce,
            ..ChunkManifest::default()
        };
        assert_eq!(own_chunks(b"blob", &genuine), own);
        // Forged: another blob's key, a chunk of another blob, a chunk out
        // of place; only the genuine first chunk survives the filter.
        let forged = ChunkManifest {
            chunks: vec![
                chunk(&own[0]),
                chunk(b"someone else's blob"),
                chunk(&chunk_key(b"other", nonce, 2)),
                chunk(&own[1]),
            ],
            nonce,
            ..ChunkManifest::default()
        };
        assert_eq!(own_chunks(b"blob", &forged), vec![own[0]]);
        // Another key's manifest, or one without its nonce: nothing.
        assert!(own_chunks(b"other", &genuine).is_empty());
        let old = ChunkManifest {
            nonce: 0,
            ..genuine
        };
        assert!(own_chunks(b"blob", &old).is_empty());
    }
}
