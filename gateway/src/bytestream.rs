//! `google.bytestream.ByteStream` for CAS blobs of any size: reads with
//! offset and limit, resumable writes (`QueryWriteStatus`), early
//! completion when the blob is already stored, and
//! `compressed-blobs/zstd` both ways (offsets then count compressed
//! bytes).
//!
//! A write streams through an SDK [`Upload`]: every full chunk is stored
//! as it completes, and the blob appears under its digest only once all
//! its bytes arrived and hash to it. An unfinished upload (the stream
//! broke) stays in this gateway's memory for `upload_idle`, so the client
//! can resume at the committed offset; another gateway, or this one
//! restarted, answers `committed_size` 0 and the client starts over —
//! which the protocol allows, and which costs nothing stored twice
//! (chunks are content-addressed).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bazel_remote_apis::google::bytestream::byte_stream_server::{ByteStream, ByteStreamServer};
use bazel_remote_apis::google::bytestream::{
    QueryWriteStatusRequest, QueryWriteStatusResponse, ReadRequest, ReadResponse, WriteRequest,
    WriteResponse,
};
use tidepool_client::Upload;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::codec::{self, Decompressor};
use crate::http::feed;
use crate::names::{Compression, Resource, parse_resource};
use crate::reapi::{Reapi, status};
use crate::{Gateway, cache};

/// Paused uploads kept at most (each holds up to one chunk not yet
/// stored, 4 MiB by default: 256 MiB in all, plus chunks whose stores were
/// still running when it paused, freed as they finish); uploads being
/// written, by `reapi::GRPC_STREAMS_PER_CONNECTION` per connection (the
/// gRPC listener does not cap connections: a known limit).
const MAX_PAUSED: usize = 64;

/// Largest `data` of one `ReadResponse` (gRPC clients commonly accept 4
/// MiB messages).
const READ_PIECE: usize = 1 << 20;

/// One upload in progress.
struct Session {
    /// `None` while a request's bytes are being appended: a write whose
    /// handler is dropped mid-append (the client reset the stream) leaves
    /// none, rather than one holding part of those bytes.
    upload: Option<Upload>,
    decompressor: Option<Decompressor>,
    /// Bytes received, as sent (compressed for zstd uploads); meaningful
    /// only while `upload` is held.
    received: u64,
    last_used: Instant,
}

/// The key of an upload session: the resource name, and who writes it. A
/// session is the caller's own: another caller who learns the upload id
/// (it is in the resource name) can neither resume nor restart nor end it.
fn session_key(metadata: &tonic::metadata::MetadataMap, name: &str) -> String {
    let caller = metadata
        .get("authorization")
        .map_or(&b""[..], |v| v.as_bytes());
    format!(
        "{}/{name}",
        tidepool_client::hex(&tidepool_client::sha256(caller))
    )
}

/// Uploads in progress, by caller and resource name.
#[derive(Default)]
pub(crate) struct Uploads {
    sessions: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<Session>>>>,
}

impl Uploads {
    fn get(&self, name: &str) -> Option<Arc<tokio::sync::Mutex<Session>>> {
        self.sessions.lock().get(name).cloned()
    }

    fn get_or_create(&self, name: &str) -> Arc<tokio::sync::Mutex<Session>> {
        let mut sessions = self.sessions.lock();
        if !sessions.contains_key(name) {
            // Paused uploads hold up to a chunk each: beyond a bound, the
            // one idle longest is forgotten (its client starts again).
            let mut paused: Vec<(Instant, String)> = sessions
                .iter()
                .filter_map(|(n, s)| s.try_lock().ok().map(|s| (s.last_used, n.clone())))
                .collect();
            if paused.len() >= MAX_PAUSED {
                paused.sort();
                for (_, n) in &paused[..=paused.len() - MAX_PAUSED] {
                    sessions.remove(n);
                }
            }
        }
        sessions
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(tokio::sync::Mutex::new(Session {
                    upload: None,
                    decompressor: None,
                    received: 0,
                    last_used: Instant::now(),
                }))
            })
            .clone()
    }

    fn remove(&self, name: &str) {
        self.sessions.lock().remove(name);
    }
}

/// Forgets uploads idle for longer than the configured time.
pub(crate) async fn expire_uploads(gateway: Arc<Gateway>, mut stop: watch::Receiver<bool>) {
    let idle = gateway.config.upload_idle;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(idle.min(Duration::from_secs(30))) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        gateway
            .uploads
            .sessions
            .lock()
            .retain(|_, session| match session.try_lock() {
                Ok(s) => s.last_used.elapsed() < idle,
                // In use.
                Err(_) => true,
            });
    }
}

/// The ByteStream service.
pub(crate) fn server(reapi: Reapi, limit: usize) -> ByteStreamServer<Reapi> {
    ByteStreamServer::new(reapi)
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit)
}

fn invalid(message: String) -> Status {
    Status::invalid_argument(message)
}

impl Reapi {
    async fn resource<T>(
        &self,
        request: &Request<T>,
        name: &str,
        write: bool,
    ) -> Result<(tidepool_client::Client, Resource), Status> {
        let resource = parse_resource(name, write).map_err(invalid)?;
        let (client, instance) = self.begin(request, &resource.instance.name).await?;
        Ok((
            client,
            Resource {
                instance,
                ..resource
            },
        ))
    }

    /// Whether the blob is stored (touching it), so a write can end at
    /// once.
    async fn stored(
        &self,
        client: &tidepool_client::Client,
        resource: &Resource,
    ) -> Result<bool, Status> {
        if resource.digest.is_empty_blob() {
            return Ok(true);
        }
        let present = cache::find_missing(client, &resource.instance, &[resource.digest])
            .await
            .map_err(status)?
            .is_empty();
        // The digest is (hash, size): a blob of this hash and another size
        // is not the one asked for (a write declaring a wrong size would
        // otherwise complete at once, storing nothing).
        Ok(present
            && match client
                .head(&resource.instance.cas, &resource.digest.hash)
                .await
            {
                Ok(info) => info.size == resource.digest.size,
                Err(e) if e.code() == tidepool_client::ErrorCode::NotFound => false,
                Err(e) => return Err(status(e)),
            })
    }
}

type ReadStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ReadResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ByteStream for Reapi {
    type ReadStream = ReadStream;

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadStream>, Status> {
        let name = request.get_ref().resource_name.clone();
        let (client, resource) = self.resource(&request, &name, false).await?;
        let request = request.into_inner();
        // bytestream.proto: a negative offset is OUT_OF_RANGE.
        let Ok(offset) = u64::try_from(request.read_offset) else {
            return Err(Status::out_of_range(format!(
                "read_offset {} is negative",
                request.read_offset
            )));
        };
        let Ok(limit) = u64::try_from(request.read_limit) else {
            return Err(invalid("read_limit may not be negative".into()));
        };
        let limit = (limit > 0).then_some(limit);
        let digest = resource.digest;
        let identity = resource.compression == Compression::Identity;
        // REAPI: a compressed read's offset counts uncompressed bytes (a
        // client resuming a download counts what it decompressed), and it
        // takes no limit.
        if !identity && limit.is_some() {
            return Err(invalid(
                "read_limit must be 0 for compressed-blobs (REAPI)".into(),
            ));
        }
        if offset > digest.size {
            return Err(Status::out_of_range(format!(
                "read_offset {offset} is past the end of the {}-byte blob",
                digest.size
            )));
        }
        let mut reader = if digest.is_empty_blob() {
            None
        } else {
            // The size is checked before the bytes come (a blob of this
            // hash and another size is not the one asked for).
            let reader = client
                .open_sized(
                    &resource.instance.cas,
                    &digest.hash,
                    digest.size,
                    offset,
                    limit,
                )
                .await
                .map_err(status)?;
            cache::keep_alive(&client, &resource.instance.cas, &reader).await;
            Some(reader)
        };
        // A blob stored whole (most of a build's): answered from the one
        // read already made, without a task.
        if identity && digest.size <= client.chunk_size() as u64 {
            // (One piece, unless it was spliced from smaller chunks.) Its
            // room under the read budget is kept until the answer is sent
            // (or dropped): given back at the reader's end, the blob sat
            // in the answer uncounted for as long as a slow client took.
            let mut piece = Vec::new();
            let mut rooms = Vec::new();
            if let Some(reader) = reader.as_mut() {
                while let Some(more) = reader.next_piece().await.map_err(status)? {
                    piece.extend_from_slice(&more);
                    rooms.extend(reader.take_room());
                }
            }
            let messages: Vec<Result<ReadResponse, Status>> = piece
                .chunks(READ_PIECE)
                .map(|data| {
                    Ok(ReadResponse {
                        data: data.to_vec(),
                    })
                })
                .collect();
            let answer = tokio_stream::StreamExt::map(tokio_stream::iter(messages), move |m| {
                let _held = &rooms;
                m
            });
            return Ok(Response::new(Box::pin(answer)));
        }
        // A client that takes nothing for this long loses the rest.
        let idle = self.gateway.config.http_limits.body_idle;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            // Compressed reads: a frame of each piece from `offset` on (a
            // resumed read is a zstd stream of its own).
            let mut sent_any = false;
            loop {
                let piece = match reader.as_mut() {
                    None => None,
                    Some(reader) => match reader.next_piece().await {
                        Ok(piece) => piece,
                        Err(e) => {
                            let _ = feed(&tx, Err(status(e)), idle).await;
                            return;
                        }
                    },
                };
                let Some(piece) = piece else { break };
                let piece = if identity {
                    piece
                } else {
                    match codec::compress(&piece) {
                        Ok(frame) => frame,
                        Err(e) => {
                            let _ = feed(&tx, Err(Status::internal(e.to_string())), idle).await;
                            return;
                        }
                    }
                };
                for data in piece.chunks(READ_PIECE) {
                    sent_any = true;
                    let data = data.to_vec();
                    if !feed(&tx, Ok(ReadResponse { data }), idle).await {
                        return;
                    }
                }
            }
            if !sent_any && !identity {
                // The empty blob, compressed: one empty frame.
                if let Ok(frame) = codec::compress(&[]) {
                    let _ = feed(&tx, Ok(ReadResponse { data: frame }), idle).await;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn write(
        &self,
        request: Request<Streaming<WriteRequest>>,
    ) -> Result<Response<WriteResponse>, Status> {
        let header = request.metadata().clone();
        // The caller first: a message (up to a batch and a chunk) is read
        // and held only for a caller the cluster knows.
        let credential =
            crate::Credential::from_header(header.get("authorization").map(|v| v.as_bytes()))
                .map_err(status)?;
        self.gateway.caller(credential).await.map_err(status)?;
        let idle = self.gateway.config.http_limits.body_idle;
        let mut stream = request.into_inner();
        let first = crate::next_message(&mut stream, idle)
            .await?
            .ok_or_else(|| invalid("the write sent no request".into()))?;
        let name = first.resource_name.clone();
        let key = session_key(&header, &name);
        let mut probe = Request::new(());
        *probe.metadata_mut() = header;
        let (client, resource) = self.resource(&probe, &name, true).await?;
        let digest = resource.digest;
        let max = self.gateway.config.max_blob_bytes;
        if digest.size > max {
            return Err(invalid(format!(
                "the blob is {} bytes; at most {max} are accepted (max_cas_blob_size_bytes)",
                digest.size
            )));
        }
        let compressed = resource.compression == Compression::Zstd;
        // Early completion saves sending a large blob again; a small one
        // costs no more to put again (a content-addressed put of stored
        // bytes changes nothing) than to look up first.
        let large = digest.size > client.chunk_size() as u64;
        if first.write_offset == 0 && large && self.stored(&client, &resource).await? {
            // Already stored: done at once (-1 for a compressed upload,
            // whose compressed size the server cannot know).
            self.gateway.uploads.remove(&key);
            return Ok(Response::new(WriteResponse {
                committed_size: if compressed { -1 } else { digest.size as i64 },
            }));
        }
        // The whole blob in the first message (small blobs): stored
        // directly, without an upload session.
        if first.write_offset == 0
            && first.finish_write
            && !compressed
            && first.data.len() as u64 == digest.size
        {
            cache::write_cas(&client, &resource.instance, digest, &first.data)
                .await
                .map_err(status)?;
            return Ok(Response::new(WriteResponse {
                committed_size: digest.size as i64,
            }));
        }
        let session = self.gateway.uploads.get_or_create(&key);
        let Ok(mut session) = session.try_lock() else {
            return Err(Status::aborted(format!(
                "another write of {name} is in progress"
            )));
        };
        session.last_used = Instant::now();
        if first.write_offset > 0 && session.upload.is_none() {
            // A resumption this gateway holds nothing of (another gateway's
            // upload, one evicted, or one cut off mid-append): retryable,
            // so the client asks QueryWriteStatus (0) and starts again.
            // INVALID_ARGUMENT ended the upload for good.
            drop(session);
            self.gateway.uploads.remove(&key);
            return Err(Status::unavailable(format!(
                "this gateway holds no upload of {name} to resume at {}: ask QueryWriteStatus and start again at 0",
                first.write_offset
            )));
        }
        if first.write_offset == 0 {
            // A fresh start.
            session.upload = Some(
                client
                    .upload(&resource.instance.cas, &digest.hash)
                    .await
                    .map_err(status)?,
            );
            session.decompressor = if compressed {
                Some(Decompressor::new(digest.size).map_err(|e| Status::internal(e.to_string()))?)
            } else {
                None
            };
            session.received = 0;
        }
        let mut message = Some(first);
        let finished = loop {
            let Some(request) = message.take() else {
                break false;
            };
            if !request.resource_name.is_empty() && request.resource_name != name {
                return Err(invalid(format!(
                    "a write of {name} cannot continue with {}",
                    request.resource_name
                )));
            }
            if u64::try_from(request.write_offset) != Ok(session.received) {
                return Err(invalid(format!(
                    "write_offset {} but {} bytes are committed (QueryWriteStatus says where to resume)",
                    request.write_offset, session.received
                )));
            }
            let result = append(&mut session, &request.data, digest.size).await;
            if let Err(e) = result {
                self.gateway.uploads.remove(&key);
                return Err(e);
            }
            session.last_used = Instant::now();
            if request.finish_write {
                break true;
            }
            message = match crate::next_message(&mut stream, idle).await {
                Ok(message) => message,
                Err(error) => {
                    pause(&mut session).await;
                    return Err(error);
                }
            };
        };
        if !finished {
            pause(&mut session).await;
            return Err(invalid(format!(
                "the write of {name} ended without finish_write; {} bytes are committed",
                session.received
            )));
        }
        let upload = session.upload.take();
        let complete = session
            .decompressor
            .as_ref()
            .is_none_or(Decompressor::complete);
        let received = session.received;
        drop(session);
        self.gateway.uploads.remove(&key);
        let upload = upload.ok_or_else(|| Status::internal("the upload vanished"))?;
        if upload.written() != digest.size || !complete {
            return Err(invalid(format!(
                "{} bytes were written, the digest says {}",
                upload.written(),
                digest.size
            )));
        }
        upload.finish().await.map_err(status)?;
        Ok(Response::new(WriteResponse {
            committed_size: received as i64,
        }))
    }

    async fn query_write_status(
        &self,
        request: Request<QueryWriteStatusRequest>,
    ) -> Result<Response<QueryWriteStatusResponse>, Status> {
        let name = request.get_ref().resource_name.clone();
        let (client, resource) = self.resource(&request, &name, true).await?;
        let key = session_key(request.metadata(), &name);
        if let Some(session) = self.gateway.uploads.get(&key) {
            let received = match session.try_lock() {
                Ok(s) if s.upload.is_some() => s.received,
                // Cut off mid-append: nothing of it is kept.
                Ok(_) => 0,
                Err(_) => return Err(Status::aborted("the upload is being written right now")),
            };
            return Ok(Response::new(QueryWriteStatusResponse {
                committed_size: received as i64,
                complete: false,
            }));
        }
        let complete = self.stored(&client, &resource).await?;
        Ok(Response::new(QueryWriteStatusResponse {
            committed_size: if complete {
                resource.digest.size as i64
            } else {
                0
            },
            complete,
        }))
    }
}

/// Appends a request's bytes (decompressing them first for a zstd
/// upload); never past the blob's declared size.
///
/// The upload and decompressor are out of the session while it runs, and
/// go back with `received` only once the bytes are all written: a handler
/// dropped at an await in between (a client's reset) left the session
/// counting bytes its upload had only partly taken — a resumption from
/// there passed the size check and its manifest was refused.
/// An upload whose client stopped before `finish_write` stays, paused, for
/// a resumption: what it buffers is stored now as a chunk (from 256 KiB),
/// so a paused upload holds no room under the gateway's upload memory for
/// as long as it waits (`upload_idle`, 10 minutes). Failing, it is
/// forgotten (the client starts again).
async fn pause(session: &mut Session) {
    if let Some(upload) = session.upload.as_mut()
        && let Err(error) = upload.store_buffered().await
    {
        tracing::info!(%error, "a paused upload could not store what it buffered: forgotten");
        session.upload = None;
    }
}

async fn append(session: &mut Session, data: &[u8], size: u64) -> Result<(), Status> {
    let mut upload = session
        .upload
        .take()
        .ok_or_else(|| Status::internal("no upload"))?;
    let mut decompressor = session.decompressor.take();
    append_to(&mut upload, decompressor.as_mut(), data, size).await?;
    session.upload = Some(upload);
    session.decompressor = decompressor;
    session.received += data.len() as u64;
    Ok(())
}

async fn append_to(
    upload: &mut Upload,
    decompressor: Option<&mut Decompressor>,
    data: &[u8],
    size: u64,
) -> Result<(), Status> {
    let Some(decompressor) = decompressor else {
        return write_within(upload, data, size).await;
    };
    // A message of a few megabytes of zstd may stand for gigabytes: stored
    // a piece at a time, never held whole.
    let (mut at, mut plain) = (0, Vec::new());
    loop {
        plain.clear();
        let done = decompressor
            .feed_some(data, &mut at, &mut plain, DECOMPRESSED_PIECE)
            .map_err(invalid)?;
        write_within(upload, &plain, size).await?;
        if done {
            return Ok(());
        }
    }
}

/// Most decompressed bytes of an upload held at once.
const DECOMPRESSED_PIECE: usize = 4 << 20;

/// Writes `bytes` to `upload`, never past the blob's declared `size`.
async fn write_within(upload: &mut Upload, bytes: &[u8], size: u64) -> Result<(), Status> {
    if upload.written() + bytes.len() as u64 > size {
        return Err(invalid(format!(
            "more bytes than the {size} the digest declares"
        )));
    }
    upload.write(bytes).await.map_err(status)
}
