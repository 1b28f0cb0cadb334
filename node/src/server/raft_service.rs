//! `RaftTransport`: Raft messages in from peers, snapshot files out to
//! them, and pulling a snapshot's files before its message is stepped.

use std::sync::Arc;
use std::time::Duration;

use prost011::Message as _;
use raft::eraftpb::{Message, MessageType};
use tidepool_proto::v1::raft_transport_client::RaftTransportClient;
use tidepool_proto::v1::raft_transport_server::RaftTransport;
use tidepool_proto::v1::{
    ErrorCode, FetchSnapshotRequest, RaftBatch, RaftSendSummary, SnapshotChunk,
};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use tidepool_security::Caller;

use super::Node;
use crate::error::{NodeError, Result};
use crate::shard::ShardHandle;
use crate::snapshot::{Receiver, SNAPSHOT_IDLE, manifest_of};

/// Times a snapshot transfer resumes after a broken stream.
const SNAPSHOT_ATTEMPTS: usize = 8;
/// Silent attempts in a row after which a transfer ends: one is resumed on
/// a new connection (the old one may be dead while the source is well); a
/// second means the source itself does not answer.
const SILENT_ATTEMPTS: usize = 2;

/// The `RaftTransport` service.
pub(crate) struct RaftApi {
    node: Arc<Node>,
}

impl RaftApi {
    pub fn new(node: Arc<Node>) -> Self {
        Self { node }
    }
}

#[tonic::async_trait]
impl RaftTransport for RaftApi {
    async fn send(
        &self,
        request: Request<Streaming<RaftBatch>>,
    ) -> std::result::Result<Response<RaftSendSummary>, Status> {
        let mut sender = Sender::new(Caller::of(&request));
        let mut stream = request.into_inner();
        let mut summary = RaftSendSummary::default();
        let me = self.node.config.node_id;
        let stopped = self.node.stopped();
        tokio::pin!(stopped);
        loop {
            let batch = tokio::select! {
                batch = stream.next() => batch,
                () = &mut stopped => break,
            };
            let Some(batch) = batch else { break };
            let batch = batch?;
            summary.batches += 1;
            if batch.to_node != me {
                summary.dropped += batch.messages.len() as u64;
                continue;
            }
            if sender.speaks_for(&self.node, batch.from_node) {
                // Empty batches too: the peer's keepalive (`liveness.rs`).
                self.node.liveness.heard(batch.from_node);
            }
            for envelope in batch.messages {
                let delivered = Message::decode(&envelope.message[..])
                    .ok()
                    .filter(|message| sender.speaks_for(&self.node, message.from))
                    .zip(self.node.shard(envelope.shard_id))
                    .filter(|(message, shard)| member_of(&self.node, shard, message.from))
                    .is_some_and(|(message, shard)| deliver(&self.node, &shard, message));
                if delivered {
                    summary.delivered += 1;
                } else {
                    summary.dropped += 1;
                    self.node.metrics.raft_messages_dropped.inc();
                }
            }
        }
        Ok(Response::new(summary))
    }

    type FetchSnapshotStream = ReceiverStream<std::result::Result<SnapshotChunk, Status>>;

    async fn fetch_snapshot(
        &self,
        request: Request<FetchSnapshotRequest>,
    ) -> std::result::Result<Response<Self::FetchSnapshotStream>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        if !Sender::new(caller).speaks_for(&self.node, request.to_node) {
            return Err(self
                .node
                .error(
                    ErrorCode::PermissionDenied,
                    format!(
                        "the caller's certificate does not speak for node {}",
                        request.to_node
                    ),
                )
                .into());
        }
        // Only a member's node pulls a group's snapshot (any node's
        // certificate could read any shard's, and keep its files pinned by
        // pulling again and again).
        let member = match self.node.shard(request.shard_id) {
            Some(shard) => member_of(&self.node, &shard, request.to_node),
            None => self.node.map().shards.iter().any(|s| {
                s.shard_id == request.shard_id
                    && s.replicas.iter().any(|r| r.node_id == request.to_node)
            }),
        };
        if !member {
            return Err(self
                .node
                .error(
                    ErrorCode::PermissionDenied,
                    format!(
                        "node {} is not a member of shard {}: it pulls no snapshot of it",
                        request.to_node, request.shard_id
                    ),
                )
                .into());
        }
        let Some(prepared) = self.node.outbox.get(request.shard_id, request.snapshot_id) else {
            return Err(self
                .node
                .error(
                    ErrorCode::SnapshotGone,
                    format!(
                        "snapshot {} of shard {} is no longer offered",
                        request.snapshot_id, request.shard_id
                    ),
                )
                .into());
        };
        let (tx, rx) = mpsc::channel(4);
        let metrics = self.node.clone();
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let chunks = prepared
                .chunks(request.to_node, request.file_index, request.offset)
                .inspect(|chunk| {
                    if let Ok(chunk) = chunk {
                        metrics
                            .metrics
                            .snapshot_bytes_sent
                            .inc_by(chunk.data.len() as u64);
                    }
                });
            send_chunks(&runtime, chunks, &tx, SNAPSHOT_IDLE);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Sends `chunks` into a snapshot stream from a blocking thread, until
/// they end, the receiver goes away, or it takes none for `idle`: a peer
/// that keeps its stream open without reading (its disk hung; buggy or
/// hostile) held this thread, and the checkpoint with the WAL segments it
/// pins, for as long as the connection lived. It resumes from where it
/// got to with a new request.
fn send_chunks(
    runtime: &tokio::runtime::Handle,
    chunks: impl Iterator<Item = Result<SnapshotChunk>>,
    tx: &mpsc::Sender<std::result::Result<SnapshotChunk, Status>>,
    idle: std::time::Duration,
) {
    for chunk in chunks {
        let item = chunk.map_err(|e| Status::internal(e.to_string()));
        // The timer is made inside the runtime (a blocking thread has none).
        match runtime.block_on(async { tokio::time::timeout(idle, tx.send(item)).await }) {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return, // the receiver went away
            Err(_) => {
                tracing::warn!(
                    idle_s = idle.as_secs(),
                    "snapshot stream ended: the receiver took nothing for the idle bound"
                );
                return;
            }
        }
    }
}

/// The authenticated peer of a Raft stream: which node ids its certificate
/// may speak for (those the map binds to its name), cached per map version.
struct Sender {
    caller: Caller,
    map_version: u64,
    verified: std::collections::HashMap<u64, bool>,
}

impl Sender {
    fn new(caller: Caller) -> Self {
        Self {
            caller,
            map_version: 0,
            verified: std::collections::HashMap::new(),
        }
    }

    /// Whether the peer may send as node `from` (always, on an insecure
    /// node). A message from anyone else is dropped (and counted).
    fn speaks_for(&mut self, node: &Node, from: u64) -> bool {
        if self.caller.open {
            return true;
        }
        let Some(name) = self.caller.node_name() else {
            return false;
        };
        let map = node.map();
        if map.version != self.map_version {
            self.map_version = map.version;
            self.verified.clear();
        }
        *self.verified.entry(from).or_insert_with(|| {
            let bound = map
                .nodes
                .iter()
                .any(|n| n.node_id == from && n.identity == name);
            if !bound {
                tracing::warn!(
                    from,
                    peer = name,
                    "refusing Raft traffic: the peer's certificate does not speak for that node"
                );
            }
            bound
        })
    }
}

/// Whether node `from` may speak in shard `shard`'s group here: a member
/// as this replica knows the group, or a replica of the shard in the map
/// (a member this replica has not applied yet, or the group a joining,
/// still empty replica is about to hear from). A certificate speaks for
/// its own node only (checked before); without this, any node's spoke in
/// every group: a higher term in a forged heartbeat deposed a leader, and
/// forged appends wrote into shards the node was never a member of.
fn member_of(node: &Node, shard: &ShardHandle, from: u64) -> bool {
    shard.has_member(from)
        || node
            .map()
            .shards
            .iter()
            .any(|s| s.shard_id == shard.shard_id && s.replicas.iter().any(|r| r.node_id == from))
}

/// Hands a message to its shard. A snapshot the replica needs is fetched
/// first (one transfer per shard at a time; others are dropped: the leader
/// retries).
fn deliver(node: &Arc<Node>, shard: &Arc<ShardHandle>, message: Message) -> bool {
    if message.msg_type() != MessageType::MsgSnapshot {
        return shard.step(message);
    }
    let commit = shard.state().status.map_or(0, |s| s.commit);
    if message.get_snapshot().get_metadata().index <= commit {
        return shard.step(message);
    }
    let Some(mut transfer) = shard.begin_snapshot() else {
        return false;
    };
    let (node, shard) = (node.clone(), shard.clone());
    tokio::spawn(async move {
        // A replica stopping (closed, moved away, deleted) ends the
        // transfer at its next await, before its directory goes.
        let fetched = tokio::select! {
            fetched = fetch_snapshot(&node, &shard, &message) => fetched,
            () = transfer.stopped() => Err(NodeError::Failed("the replica stopped".into())),
        };
        match fetched {
            Ok(()) => {
                drop(transfer);
                if shard.snapshot_received(message).is_err() {
                    shard.abort_snapshot();
                }
            }
            Err(error) if shard.is_stopping() => {
                drop(transfer);
                tracing::info!(shard_id = shard.shard_id, %error, "snapshot transfer ended: the replica stopped");
                shard.abort_snapshot();
            }
            Err(error) => {
                tracing::warn!(shard_id = shard.shard_id, %error, "snapshot transfer failed");
                // Its partial files (up to a whole shard) are of no use to
                // the next transfer, which starts afresh: gone now, while
                // the transfer's claim still keeps a reopen (and a stop,
                // which waits for the claim) off the slot — not at the next
                // transfer, install or reopen.
                if let Err(error) = shard.store().clear_spare() {
                    tracing::warn!(shard_id = shard.shard_id, %error, "cannot empty the spare slot");
                }
                drop(transfer);
                shard.abort_snapshot();
            }
        }
    });
    true
}

/// Pulls a snapshot's files into the shard's spare slot, resuming after
/// broken or silent streams, and giving up on a source silent twice in a
/// row (the leader then sends a new snapshot).
/// The files must be those of the snapshot the message installs: an honest
/// sender builds both from one checkpoint; a buggy or hostile one could
/// make a replica claim entries it has no data for (a manifest without
/// the engine's control file opened as an empty engine at the message's
/// index; `ReplicaStore::open_spare` refuses such a slot too).
fn check_manifest(
    manifest: &tidepool_proto::v1::SnapshotManifest,
    metadata: &raft::eraftpb::SnapshotMetadata,
    shard_id: u32,
) -> Result<()> {
    if manifest.shard_id != shard_id
        || manifest.raft_index != metadata.index
        || manifest.raft_term != metadata.term
        || !manifest
            .files
            .iter()
            .any(|f| f.path == tidepool_engine::CONTROL_FILE)
    {
        return Err(NodeError::Malformed(format!(
            "snapshot manifest (shard {}, entry {} of term {}, {} files) does not match its message (shard {shard_id}, entry {} of term {})",
            manifest.shard_id,
            manifest.raft_index,
            manifest.raft_term,
            manifest.files.len(),
            metadata.index,
            metadata.term
        )));
    }
    Ok(())
}

async fn fetch_snapshot(node: &Node, shard: &ShardHandle, message: &Message) -> Result<()> {
    let manifest = manifest_of(message.get_snapshot())?;
    check_manifest(
        &manifest,
        message.get_snapshot().get_metadata(),
        shard.shard_id,
    )?;
    let source = manifest
        .source
        .clone()
        .ok_or_else(|| NodeError::Malformed("snapshot manifest names no source".into()))?;
    let id = manifest.snapshot_id;
    tracing::info!(
        shard_id = shard.shard_id,
        snapshot = id,
        index = manifest.raft_index,
        files = manifest.files.len(),
        from = source.node_id,
        "receiving snapshot"
    );
    let store = shard.store().clone();
    let mut receiver = tokio::task::block_in_place(|| Receiver::start(manifest, &store))?;
    // The leader gives a transfer up after as long without a chunk pulled
    // (`Replica::watch_snapshots`); the receiver waits no longer for one.
    let idle = Duration::from_millis(
        node.config.raft.tick_ms * u64::from(crate::replica::SNAPSHOT_IDLE_TICKS),
    );
    let pulling = Pulling { node, shard, idle };
    let mut last_error = None;
    let mut silent = 0;
    // Attempts in a row that brought nothing: a stream that breaks after
    // bringing chunks (a proxy cutting long streams) costs none, or a
    // large snapshot over such a link never finished, and the next one
    // started again from nothing.
    let mut fruitless = 0;
    while fruitless < SNAPSHOT_ATTEMPTS {
        if receiver.is_complete() {
            break;
        }
        let before = receiver.received_bytes();
        let (file_index, offset) = receiver.resume_point();
        let request = FetchSnapshotRequest {
            shard_id: shard.shard_id,
            snapshot_id: id,
            file_index,
            offset,
            to_node: node.config.node_id,
        };
        match pulling.pull(&source.address, request, &mut receiver).await {
            Ok(()) => {}
            Err(PullError::Gone(status)) => {
                return Err(NodeError::Network(format!("snapshot {id}: {status}")));
            }
            Err(PullError::Broken(error)) => {
                silent = 0;
                last_error = Some(error);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(PullError::Silent { received }) => {
                silent = if received { 1 } else { silent + 1 };
                let error = format!("the source sent nothing for {idle:?}");
                if silent >= SILENT_ATTEMPTS {
                    return Err(NodeError::Network(format!(
                        "snapshot {id}: {error}, {silent} attempts in a row"
                    )));
                }
                tracing::info!(
                    shard_id = shard.shard_id,
                    snapshot = id,
                    "{error}: resuming on a new connection"
                );
                last_error = Some(error);
            }
            Err(PullError::Bad(error)) => return Err(error),
        }
        if receiver.received_bytes() > before {
            fruitless = 0;
        } else {
            fruitless += 1;
        }
    }
    if !receiver.is_complete() {
        return Err(NodeError::Network(format!(
            "snapshot {id} incomplete after {SNAPSHOT_ATTEMPTS} attempts in a row that brought nothing: {}",
            last_error.unwrap_or_default()
        )));
    }
    tokio::task::block_in_place(|| receiver.finish())?;
    node.metrics.snapshots_received.inc();
    Ok(())
}

enum PullError {
    /// The sender no longer offers it.
    Gone(Status),
    /// The stream broke: resume.
    Broken(String),
    /// Nothing came for the idle bound (a frozen source, or a connection
    /// that went dead without a reset); `received`: chunks came before the
    /// silence in this attempt.
    Silent { received: bool },
    /// The data is wrong: give up.
    Bad(NodeError),
}

/// One attempt at a transfer's files, from one connection.
struct Pulling<'a> {
    node: &'a Node,
    shard: &'a ShardHandle,
    /// Longest wait for the connection, the stream or its next chunk.
    idle: Duration,
}

impl Pulling<'_> {
    async fn pull(
        &self,
        address: &str,
        request: FetchSnapshotRequest,
        receiver: &mut Receiver,
    ) -> std::result::Result<(), PullError> {
        let silent = PullError::Silent { received: false };
        let mut stream = tokio::time::timeout(self.idle, self.open(address, request))
            .await
            .map_err(|_| silent)??;
        let mut received = false;
        loop {
            let chunk = match tokio::time::timeout(self.idle, stream.next()).await {
                Err(_) => return Err(PullError::Silent { received }),
                Ok(None) => return Ok(()),
                Ok(Some(chunk)) => chunk.map_err(|s| PullError::Broken(s.to_string()))?,
            };
            received = true;
            // Chunks already buffered come without a pause in which the
            // caller's `select!` could end the transfer.
            if self.shard.is_stopping() {
                return Err(PullError::Bad(NodeError::Failed(
                    "the replica stopped".into(),
                )));
            }
            let len = chunk.data.len() as u64;
            tokio::task::block_in_place(|| receiver.accept(&chunk)).map_err(PullError::Bad)?;
            self.node.metrics.snapshot_bytes_received.inc_by(len);
            self.shard.note_snapshot_progress(receiver.received_bytes());
        }
    }

    /// Connects to the source and asks for the stream.
    async fn open(
        &self,
        address: &str,
        request: FetchSnapshotRequest,
    ) -> std::result::Result<Streaming<SnapshotChunk>, PullError> {
        let endpoint = self
            .node
            .security
            .endpoint(address)
            .map_err(|e| PullError::Bad(NodeError::Network(format!("bad address {address}: {e}"))))?
            .connect_timeout(Duration::from_secs(2));
        let channel = self
            .node
            .security
            .connect(&endpoint)
            .await
            .map_err(|e| PullError::Broken(e.to_string()))?;
        // Snapshot chunks carry at most `CHUNK_BYTES` of data.
        let mut client = RaftTransportClient::new(channel)
            .max_decoding_message_size(crate::snapshot::CHUNK_BYTES + (64 << 10));
        match client.fetch_snapshot(request).await {
            Ok(response) => Ok(response.into_inner()),
            Err(status) if status.code() == tonic::Code::NotFound => Err(PullError::Gone(status)),
            Err(status) => Err(PullError::Broken(status.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use tidepool_proto::v1::{SnapshotFile, SnapshotManifest};

    use super::*;

    /// A snapshot message whose manifest names another shard, entry or
    /// term, or no file, is refused before anything is fetched.
    /// A receiver that keeps its stream open and reads nothing: the
    /// sending thread ends after the idle bound (and lets the snapshot,
    /// with its checkpoint, go).
    #[test]
    fn a_snapshot_stream_nobody_reads_ends_after_the_idle_bound() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (tx, rx) = mpsc::channel(1);
        let pinned = std::sync::Arc::new(());
        let held = pinned.clone();
        let chunks = (0..100u64).map(move |i| {
            let _ = &held;
            Ok(SnapshotChunk {
                offset: i,
                ..SnapshotChunk::default()
            })
        });
        let began = std::time::Instant::now();
        send_chunks(
            runtime.handle(),
            chunks,
            &tx,
            std::time::Duration::from_millis(200),
        );
        assert!(began.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(std::sync::Arc::strong_count(&pinned), 1, "released");
        drop(rx);
    }

    #[test]
    fn a_manifest_must_match_its_snapshot_message() {
        let metadata = raft::eraftpb::SnapshotMetadata {
            index: 40,
            term: 3,
            ..Default::default()
        };
        let good = SnapshotManifest {
            shard_id: 7,
            snapshot_id: 1,
            raft_index: 40,
            raft_term: 3,
            files: vec![
                SnapshotFile {
                    path: "wal/00000000000000000001.wal".into(),
                    ..SnapshotFile::default()
                },
                SnapshotFile {
                    path: tidepool_engine::CONTROL_FILE.into(),
                    ..SnapshotFile::default()
                },
            ],
            source: None,
        };
        assert!(check_manifest(&good, &metadata, 7).is_ok());
        let bad = [
            SnapshotManifest {
                shard_id: 8,
                ..good.clone()
            },
            SnapshotManifest {
                raft_index: 41,
                ..good.clone()
            },
            SnapshotManifest {
                raft_term: 2,
                ..good.clone()
            },
            SnapshotManifest {
                files: Vec::new(),
                ..good.clone()
            },
            // Without the engine's control file (it would open empty).
            SnapshotManifest {
                files: good.files[..1].to_vec(),
                ..good.clone()
            },
        ];
        for manifest in &bad {
            assert!(
                check_manifest(manifest, &metadata, 7).is_err(),
                "{manifest:?}"
            );
        }
    }
}
