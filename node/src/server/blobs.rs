//! `BlobService`: the client API of a node.
//!
//! Writes go to the shard leader, are group-committed with other writes,
//! and are acknowledged once applied on the leader (so committed on a
//! majority at the cluster's durability). Reads are linearizable by
//! default: the leader confirms its leadership (ReadIndex) and reads its
//! applied state; `ANY_REPLICA` reads the local applied state of any
//! replica. Content-addressed puts of a blob already present write no
//! value bytes: they only touch it into the current epoch. A write that
//! carries a `WriteSession` applies at most once however often it is
//! retried (`crate::session`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidepool_engine::{Durability as EngineDurability, Engine, KeySpace};
use tidepool_proto::v1::blob_service_server::BlobService;
use tidepool_proto::v1::{
    BatchExistsRequest, BatchExistsResponse, BlobInfo, BlobKind, BlobRef, DeleteRequest,
    DeleteResponse, Durability, ErrorCode, GetRequest, GetResponse, HeadRequest, HeadResponse,
    ListEntry, ListRequest, ListResponse, Namespace, Presence, PutHeader, PutRequest, PutResponse,
    ReadConsistency, ReplacedChunks, Role, ShardInfo, TouchRequest, TouchResponse, WriteSession,
    get_response, put_request,
};
use tidepool_proto::{ErrorInfo, KEY_MAX_BYTES, StorageKey, storage_key};
use tidepool_security::Caller;
use tokio::sync::oneshot;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use super::Node;
use crate::command::{Command, WriteOp};
use crate::entry_context::EntrySync;
use crate::replica::{BLOB_KEY_SPACE, Outcome, ReadOutcome};
use crate::session::{OpResult, Refusal, SessionTag};
use crate::shard::ShardHandle;
use crate::{blob, names};

/// Largest piece of content per stream message.
const CHUNK_BYTES: usize = 1 << 20;

/// A `Get` answer: its messages, made before the first is sent, and the
/// read's hold on the node's in-flight budget, let go when the stream is
/// sent or dropped.
pub struct GetStream {
    messages: std::vec::IntoIter<GetResponse>,
    _budget: super::InFlight,
}

impl tokio_stream::Stream for GetStream {
    type Item = std::result::Result<GetResponse, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::task::Poll::Ready(self.messages.next().map(Ok))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.messages.size_hint()
    }
}
/// Most keys per `BatchExists`.
const MAX_BATCH_KEYS: usize = 100_000;
/// Entries in a list page when the request names no limit.
const DEFAULT_LIST_LIMIT: usize = 1_000;
/// Most entries in a list page.
const MAX_LIST_LIMIT: usize = 10_000;
/// A list page ends once its names reach this many bytes (a page stays
/// well under the 4 MiB message size clients accept by default).
const MAX_LIST_NAME_BYTES: usize = 1 << 20;
/// How long a request waits for its shard.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

type ApiResult<T> = std::result::Result<T, ErrorInfo>;

/// The `BlobService`.
pub(crate) struct BlobApi {
    node: Arc<Node>,
}

impl BlobApi {
    pub fn new(node: Arc<Node>) -> Self {
        Self { node }
    }
}

/// A request's blob, resolved: namespace, storage key, shard.
struct Target {
    namespace: Namespace,
    key: StorageKey,
    info: ShardInfo,
    shard: Arc<ShardHandle>,
}

/// Whether a group owning `range` (`None`: not recorded) owns `key`.
fn owns(range: Option<(u64, u64)>, key: &StorageKey) -> bool {
    range.is_none_or(|(start, end)| {
        let position = tidepool_proto::hash_position(key);
        start <= position && position <= end
    })
}

fn invalid(node: &Node, message: impl Into<String>) -> ErrorInfo {
    node.error(ErrorCode::InvalidArgument, message)
}

impl BlobApi {
    fn check_running(&self) -> ApiResult<()> {
        if self.node.is_stopping() {
            return Err(self
                .node
                .error(ErrorCode::ShuttingDown, "the node is shutting down"));
        }
        Ok(())
    }

    fn validate_key(&self, namespace: &Namespace, key: &[u8]) -> ApiResult<()> {
        if key.is_empty() || key.len() > KEY_MAX_BYTES {
            return Err(invalid(
                &self.node,
                format!("key must be 1 to {KEY_MAX_BYTES} bytes, not {}", key.len()),
            ));
        }
        if namespace.content_addressed && key.len() != 32 {
            return Err(invalid(
                &self.node,
                format!(
                    "namespace {:?} is content-addressed: keys are 32-byte SHA-256 digests, not {} bytes",
                    namespace.name,
                    key.len()
                ),
            ));
        }
        Ok(())
    }

    fn target(&self, blob: Option<&BlobRef>) -> ApiResult<Target> {
        self.check_running()?;
        let blob = blob.ok_or_else(|| invalid(&self.node, "blob is required"))?;
        let namespace = self.node.namespace(&blob.namespace)?;
        self.validate_key(&namespace, &blob.key)?;
        let key = storage_key(namespace.id, &blob.key);
        let (info, shard) = self.node.route(&key)?;
        let span = tracing::Span::current();
        span.record("shard_id", info.shard_id);
        span.record("namespace", blob.namespace.as_str());
        if let Some(status) = shard.state().status {
            span.record("term", status.term);
        }
        Ok(Target {
            namespace,
            key,
            info,
            shard,
        })
    }

    /// `NOT_LEADER` unless this replica leads the shard.
    fn require_leader(&self, target: &Target) -> ApiResult<()> {
        let status = target.shard.state().status;
        match status {
            Some(status) if status.is_leader => Ok(()),
            Some(status) => Err(self.node.not_leader(target.info.shard_id, status.leader)),
            None => Err(self
                .node
                .outcome_error(target.info.shard_id, Outcome::Failed("replica down".into()))),
        }
    }

    /// Waits until the replica may serve a read at `consistency`.
    async fn read_point(&self, target: &Target, consistency: i32) -> ApiResult<()> {
        match ReadConsistency::try_from(consistency) {
            Ok(ReadConsistency::AnyReplica) => Ok(()),
            Ok(ReadConsistency::Linearizable) if target.shard.read_now() => Ok(()),
            Ok(ReadConsistency::Linearizable) => {
                let (tx, rx) = oneshot::channel();
                target.shard.read(Box::new(move |outcome| {
                    let _ = tx.send(outcome);
                }));
                match self.wait(target, rx).await? {
                    ReadOutcome::Ready => Ok(()),
                    other => Err(self.node.read_error(target.info.shard_id, other)),
                }
            }
            Err(_) => Err(invalid(
                &self.node,
                format!("unknown consistency {consistency}"),
            )),
        }
    }

    /// The epoch a put, delete or touch takes now: the later of the
    /// shard's and this node's map's. The coordinator raises the map's
    /// epoch first and then asks each shard to advance, one after another
    /// (a leader it cannot reach, later): stamped with a lagging shard's
    /// own epoch, a blob written or touched in the cluster's epoch `e`
    /// counted as one of `e - 1`, and the next drop took it an epoch early
    /// (at once, in a namespace keeping one epoch). A drop walks entries
    /// by their own epoch, so one ahead of its segment's is kept.
    fn write_epoch(&self, target: &Target) -> u32 {
        let map = u32::try_from(self.node.map().epoch).unwrap_or(u32::MAX);
        target.shard.engine().epoch().0.max(map)
    }

    /// `WRONG_SHARD` unless the target's replica still owns `key`, checked
    /// after reading it: a split that gave the key to a new group applied
    /// after the read point (the read saw the key's last value here) or
    /// before it (the value may be stale: the client asks the new group).
    /// Ranges only narrow, so a key owned after the read was owned during.
    fn check_owned(&self, target: &Target, key: &StorageKey) -> ApiResult<()> {
        if owns(target.shard.range(), key) {
            return Ok(());
        }
        let mut info = self.node.error(
            ErrorCode::WrongShard,
            format!(
                "shard {} no longer owns hash position {:#018x} (it split)",
                target.info.shard_id,
                tidepool_proto::hash_position(key)
            ),
        );
        info.detail.shard_id = Some(target.info.shard_id);
        Err(info)
    }

    async fn wait<T>(&self, target: &Target, rx: oneshot::Receiver<T>) -> ApiResult<T> {
        match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) => Err(self.node.outcome_error(
                target.info.shard_id,
                Outcome::Failed("the replica stopped".into()),
            )),
            Err(_) => {
                let mut info = self.node.error(
                    ErrorCode::Timeout,
                    format!(
                        "shard {} did not answer within {REQUEST_TIMEOUT:?}; a write may still apply",
                        target.info.shard_id
                    ),
                );
                info.detail.shard_id = Some(target.info.shard_id);
                Err(info)
            }
        }
    }

    /// Proposes `command` (or queues `op` for group commit) and waits.
    async fn commit(&self, target: &Target, proposal: Proposal) -> ApiResult<OpResult> {
        let rx = submit(target, proposal);
        self.committed(target, rx).await
    }

    /// Waits for a submitted proposal; what its op did (a write op the
    /// sessions refused is an error).
    async fn committed(
        &self,
        target: &Target,
        rx: oneshot::Receiver<Outcome>,
    ) -> ApiResult<OpResult> {
        let outcome = self.wait(target, rx).await?;
        self.op_result(target, &outcome)
    }

    /// `commit` of a put: also the chunked blob it replaced
    /// (see [`Outcome::Applied`]).
    async fn commit_put(
        &self,
        target: &Target,
        proposal: Proposal,
    ) -> ApiResult<Option<ReplacedChunks>> {
        let outcome = self.wait(target, submit(target, proposal)).await?;
        self.op_result(target, &outcome)?;
        Ok(outcome.replaced_chunks())
    }

    /// What an ended proposal's op did (a write op the sessions refused
    /// is an error).
    fn op_result(&self, target: &Target, outcome: &Outcome) -> ApiResult<OpResult> {
        match outcome.op_result() {
            Some(OpResult::Refused(why)) => Err(self.refused(target, why)),
            Some(result) => Ok(result),
            None => Err(self
                .node
                .outcome_error(target.info.shard_id, outcome.clone())),
        }
    }

    /// The error for a sessioned op the shard did not apply.
    fn refused(&self, target: &Target, why: Refusal) -> ErrorInfo {
        let shard = target.info.shard_id;
        let mut info = match why {
            Refusal::Expired => self.node.error(
                ErrorCode::SessionExpired,
                format!(
                    "shard {shard} does not know this write session (it expired); the write was not applied now, and whether an earlier attempt applied is unknown"
                ),
            ),
            Refusal::Stale => self.node.error(
                ErrorCode::SessionExpired,
                format!(
                    "shard {shard} already applied a later write of this session; this attempt was not applied"
                ),
            ),
            Refusal::Full => {
                let mut info = self.node.error(
                    ErrorCode::Overloaded,
                    format!(
                        "shard {shard} holds too many write sessions to start another; nothing was applied"
                    ),
                );
                info.detail.retry_after_ms = 1000;
                info
            }
            Refusal::Exists => self.node.error(
                ErrorCode::AlreadyExists,
                "the key already holds a blob and this put may only create new keys; nothing was written",
            ),
            Refusal::WrongShard => self.node.error(
                ErrorCode::WrongShard,
                format!(
                    "shard {shard} no longer owns this key (its range changed before the write applied); nothing was written: refresh the cluster map and retry"
                ),
            ),
        };
        info.detail.shard_id = Some(shard);
        info
    }

    /// A request's session, checked (its time is stamped as the write is
    /// proposed).
    fn session(&self, session: Option<&WriteSession>) -> ApiResult<Option<SessionTag>> {
        let Some(session) = session else {
            return Ok(None);
        };
        let id: [u8; 16] = session.id.as_slice().try_into().map_err(|_| {
            invalid(
                &self.node,
                format!("session.id must be 16 bytes, not {}", session.id.len()),
            )
        })?;
        if session.sequence == 0 {
            return Err(invalid(&self.node, "session.sequence starts at 1"));
        }
        Ok(Some(SessionTag {
            id: u128::from_le_bytes(id),
            seq: session.sequence,
            opens: session.opens,
            // Stamped by the leader's replica as it proposes the write
            // (`Replica::propose_traced`).
            time_ms: 0,
        }))
    }

    /// Counts a write that would open its session against the caller's
    /// token's session opens on the shard (`opens.rs`): `OVERLOADED`, with
    /// the wait, beyond them. Called just before the write is proposed, so
    /// a write that proposes nothing (a content-addressed blob present
    /// already, a refused one) opens nothing and is not counted.
    fn charge_open(
        &self,
        target: &Target,
        session: Option<&SessionTag>,
        caller: &Caller,
    ) -> ApiResult<()> {
        let (Some(tag), Some(grant)) = (session, caller.grant.as_ref()) else {
            return Ok(());
        };
        if !tag.opens {
            return Ok(());
        }
        let Err(wait_ms) = self.node.session_opens.take(
            &grant.name,
            target.info.shard_id,
            std::time::Instant::now(),
        ) else {
            return Ok(());
        };
        let mut info = self.node.error(
            ErrorCode::Overloaded,
            format!(
                "token {:?} opens write sessions on shard {} faster than {} a second (a shard remembers at most {} sessions, shared by every client); nothing was applied",
                grant.name,
                target.info.shard_id,
                self.node.session_opens.rate(),
                crate::session::MAX_SESSIONS
            ),
        );
        info.detail.retry_after_ms = wait_ms;
        info.detail.shard_id = Some(target.info.shard_id);
        Err(info)
    }

    /// Refuses writes when the shard's volume is nearly full (reads go on).
    fn check_space(&self, target: &Target) -> ApiResult<()> {
        let store = target.shard.store();
        let reserve = 2 * (self.node.config.engine.wal_segment_mib << 20)
            + self.node.config.raft.max_value_bytes;
        match store.storage().available_bytes(store.dir()) {
            Ok(free) if free < reserve => Err(self.node.error(
                ErrorCode::DiskFull,
                format!("only {free} bytes free on the data volume; writes are refused"),
            )),
            _ => Ok(()),
        }
    }

    fn engine_read<T: Send + 'static>(
        &self,
        target: &Target,
        f: impl FnOnce(&Engine, KeySpace) -> tidepool_engine::Result<T> + Send + 'static,
    ) -> impl std::future::Future<Output = ApiResult<T>> + Send + 'static {
        let engine = target.shard.engine();
        let node = self.node.clone();
        let shard_id = target.info.shard_id;
        async move {
            let result = tokio::task::spawn_blocking(move || {
                let space = engine.key_space(BLOB_KEY_SPACE)?;
                f(&engine, space)
            })
            .await
            .map_err(|e| node.error(ErrorCode::Internal, format!("read task: {e}")))?;
            result.map_err(|e| node.internal_error(shard_id, e.into()))
        }
    }

    /// [`Self::engine_read`] answered on this thread when `now` can — the
    /// engine's `*_now` reads, from memory with no waiting — else `f` on a
    /// blocking thread. Most reads of a warm node skip the hand-over to
    /// another thread and back.
    fn engine_read_now<T: Send + 'static>(
        &self,
        target: &Target,
        now: impl FnOnce(&Engine, KeySpace) -> tidepool_engine::Result<Option<T>>,
        f: impl FnOnce(&Engine, KeySpace) -> tidepool_engine::Result<T> + Send + 'static,
    ) -> impl std::future::Future<Output = ApiResult<T>> + Send + 'static {
        let engine = target.shard.engine();
        let ready = engine
            .key_space(BLOB_KEY_SPACE)
            .and_then(|space| now(&engine, space));
        let node = self.node.clone();
        let shard_id = target.info.shard_id;
        let blocking = self.engine_read(target, f);
        async move {
            match ready {
                Ok(Some(value)) => Ok(value),
                Ok(None) => blocking.await,
                Err(e) => Err(node.internal_error(shard_id, e.into())),
            }
        }
    }

    /// `PERMISSION_DENIED` unless the caller holds `role` in `namespace`;
    /// `INVALID_ARGUMENT` for a request naming no blob (`None`), whatever
    /// the caller's roles (it was `PERMISSION_DENIED` in namespace "").
    fn allow(&self, caller: &Caller, namespace: Option<&str>, role: Role) -> ApiResult<()> {
        let Some(namespace) = namespace else {
            return Err(invalid(
                &self.node,
                "the request names no blob (`blob` is required)",
            ));
        };
        if caller.peer_read && !caller.open {
            // A node's certificate reads without a token only while the
            // map binds its name to a node (a retired pod's certificate,
            // or one issued by mistake, read every namespace until it
            // expired).
            let map = self.node.map();
            let bound = caller
                .node_name()
                .is_some_and(|name| map.nodes.iter().any(|n| n.identity == name));
            if !bound {
                let mut info = ErrorInfo::new(
                    ErrorCode::PermissionDenied,
                    "this node certificate names no node of the cluster",
                );
                info.detail.map_version = map.version;
                return Err(info);
            }
        }
        caller.require(namespace, role).map_err(|mut info| {
            info.detail.map_version = self.node.map().version;
            info
        })
    }

    async fn put_inner(
        &self,
        caller: Caller,
        mut stream: Streaming<PutRequest>,
    ) -> ApiResult<PutResponse> {
        let began = std::time::Instant::now();
        // The header too within the idle timeout: a stream opened and
        // never written was held (with its task) for good.
        let idle = Duration::from_millis(self.node.config.limits.put_idle_timeout_ms);
        let first = tokio::time::timeout(idle, stream.next())
            .await
            .map_err(|_| {
                self.node.error(
                    ErrorCode::Timeout,
                    format!("the put stream sent no header within {idle:?}; nothing was stored"),
                )
            })?
            .ok_or_else(|| invalid(&self.node, "empty put stream"))?
            .map_err(|s| invalid(&self.node, s.message()))?;
        let Some(put_request::Msg::Header(header)) = first.msg else {
            return Err(invalid(
                &self.node,
                "the first put message must be the header",
            ));
        };
        // A `write` role may overwrite; an `append-only` one only creates.
        let namespace = header.blob.as_ref().map(|b| b.namespace.as_str());
        let mut if_absent = match self.allow(&caller, namespace, Role::Write) {
            Ok(()) => header.if_absent,
            Err(denied) => {
                self.allow(&caller, namespace, Role::AppendOnly)
                    .map_err(|_| denied)?;
                true
            }
        };
        let target = self.target(header.blob.as_ref())?;
        let max = self.node.config.raft.max_value_bytes;
        if header.size > max {
            return Err(self.node.error(
                ErrorCode::ValueTooLarge,
                format!(
                    "blob of {} bytes exceeds the {max}-byte maximum; split it (the SDK does)",
                    header.size
                ),
            ));
        }
        if !header.expected_sha256.is_empty() && header.expected_sha256.len() != 32 {
            return Err(invalid(&self.node, "expected_sha256 must be 32 bytes"));
        }
        let kind = BlobKind::try_from(header.kind)
            .map_err(|_| invalid(&self.node, format!("unknown blob kind {}", header.kind)))?;
        if kind == BlobKind::Chunk && target.namespace.content_addressed {
            // A chunk is not listed; a content-addressed blob is its own
            // chunk (the SDK stores chunks there as data), and once stored
            // unlisted, later puts of the same content find it present and
            // would never list it.
            return Err(invalid(
                &self.node,
                "BLOB_KIND_CHUNK is for chunks outside content-addressed namespaces; \
                 store a content-addressed chunk as data",
            ));
        }
        let sync = self.entry_sync(header.durability)?;
        self.require_leader(&target)?;
        let mut session = self.session(header.session.as_ref())?;
        // Held until the put is answered: its bytes are in memory till then.
        let _budget = self.node.reserve(header.size, &caller)?;
        // The engine value: header room, then the content as received.
        let value = self.receive(&mut stream, header.size).await?;
        let content = &value[blob::HEADER_BYTES..];
        let digest = blob::sha256(content);
        self.check_digest(&target, &header, &digest)?;
        let engine = target.shard.engine();
        let epoch = self.write_epoch(&target);
        if target.namespace.content_addressed {
            // "Already present" is an answer about the shard's state: taken
            // at a linearizable read point, not from whatever this replica
            // applied. A new leader may not have applied a delete or an
            // epoch drop committed under the last one, and a deposed leader
            // not know of it at all: answered from there, the put would be
            // acknowledged for a blob that is gone (a backup's chunk).
            self.read_point(&target, ReadConsistency::Linearizable as i32)
                .await?;
            // Off the request's thread unless the index answers from
            // memory: a lookup that waits on the disk held a runtime
            // worker (two on this host) and every request queued behind.
            let key = target.key;
            let present = self
                .engine_read_now(
                    &target,
                    move |engine, space| engine.epoch_of_now(space, &key),
                    move |engine, space| engine.epoch_of(space, &key),
                )
                .await?;
            // Read as reads are: a split may have given the key to a new
            // group while the bytes came in, and this engine still indexes
            // the key (shared segments shed nothing) after the new owner
            // deleted or expired it: "already present" here would
            // acknowledge a blob its owner does not hold. The client asks
            // the new group.
            self.check_owned(&target, &target.key)?;
            // A replica whose index lacks blobs stored before it existed
            // writes a present blob whose name it lacks again, which
            // indexes the name: re-putting content-addressed chunks is how
            // they are listed again (once: then the name is there).
            let unindexed = if present.is_some() {
                let engine = engine.clone();
                let name = header.blob.as_ref().expect("checked").key.clone();
                let namespace = target.namespace.id;
                tokio::task::spawn_blocking(move || {
                    let space = engine
                        .key_space(names::NAMES_KEY_SPACE)
                        .map_err(crate::NodeError::from)?;
                    if names::is_complete(&engine, space)? {
                        return Ok(false);
                    }
                    let index = names::NameBatch::new(&engine, space);
                    Ok(!index.contains(namespace, &name)?)
                })
                .await
                .map_err(|e| {
                    self.node
                        .error(ErrorCode::Internal, format!("read task: {e}"))
                })?
                .map_err(|e| self.node.internal_error(target.info.shard_id, e))?
            } else {
                false
            };
            // Writing it again is no overwrite: a content-addressed key
            // holds only its content (an append-only caller's put would
            // otherwise be refused as one, ALREADY_EXISTS).
            if unindexed {
                if_absent = false;
            }
            if let Some(stored_epoch) = present
                && !unindexed
                && self
                    .keep_present(&target, stored_epoch.0, epoch, sync)
                    .await?
            {
                return Ok(PutResponse {
                    info: Some(
                        blob::Header {
                            kind,
                            sha256: digest,
                            size: header.size,
                        }
                        .info(epoch),
                    ),
                    already_present: true,
                    replaced: None,
                });
            }
        }
        if target.namespace.content_addressed && kind == BlobKind::Manifest {
            let key = &header.blob.as_ref().expect("checked").key;
            super::manifests::verify(&self.node, &caller, &target.namespace, key, content).await?;
        }
        self.check_space(&target)?;
        // A copy that took long to reach its proposal may no longer open
        // the session: the client decided `opens` when it sent the header,
        // and its reasoning (no earlier copy applied unseen, or the shard
        // would still know the session) holds only for a copy proposed
        // soon after (`limits.opening_put_ms`, counted from the start of
        // this call: the header's wait, the body, a content-addressed
        // put's read point, touch and manifest check).
        let opening = Duration::from_millis(self.node.config.limits.opening_put_ms);
        let mut cleared = false;
        if let Some(tag) = session.as_mut()
            && tag.opens
            && began.elapsed() > opening
        {
            tag.opens = false;
            cleared = true;
        }
        self.charge_open(&target, session.as_ref(), &caller)?;
        let sessioned = session.is_some();
        let size = header.size;
        let op = WriteOp {
            value: Some(blob::seal(kind, &digest, value)),
            namespace: target.namespace.id,
            epoch,
            key: target.key,
            // Named for chunks too, though a chunk is never listed (its
            // blob is, through the manifest): a chunk put under a listed
            // blob's key replaces that blob, whose name then goes.
            name: header.blob.as_ref().expect("checked").key.clone(),
            session,
            if_absent,
        };
        let replaced = self
            .commit_put(&target, Proposal::Write(op, sync))
            .await
            .map_err(|mut info| {
                if cleared && info.detail.code == ErrorCode::SessionExpired as i32 {
                    info.detail.message = format!(
                        "this copy of the put reached its proposal more than {opening:?} after it began (a slow body), so it may not start its write session, which shard {} does not know: this copy was not applied (an earlier copy may have been)",
                        target.info.shard_id
                    );
                }
                info
            })?;
        // A duplicate of an earlier copy is answered in this epoch: the
        // blob is brought there (if it was not replaced since). One gone
        // since is not written again (a delete after the first copy must
        // not be undone): a drop that took it before this retry leaves the
        // answer naming an epoch the blob never reached (known limit,
        // `replication.md`).
        if sessioned {
            self.settle_epoch(&target, epoch, Some(digest), sync)
                .await?;
        }
        // Said to a caller that may delete them (the SDK does) and may so
        // learn what the key held; content-addressed chunks are shared.
        let replaced = replaced.filter(|_| {
            !target.namespace.content_addressed
                && self.allow(&caller, namespace, Role::Delete).is_ok()
        });
        self.node.metrics.put_bytes.inc_by(size);
        tracing::Span::current().record("bytes", size);
        Ok(PutResponse {
            info: Some(
                blob::Header {
                    kind,
                    sha256: digest,
                    size,
                }
                .info(epoch),
            ),
            already_present: false,
            replaced,
        })
    }

    /// How durable a write's entry must be: a `SYNCED` request on a node
    /// configured `buffered` marks its entry, which every replica then
    /// syncs before acknowledging it, so it commits on the disks of a
    /// majority (`entry_context`). A `BUFFERED` request on a synced cluster
    /// gets the stronger guarantee anyway.
    /// A durability this node does not know is `INVALID_ARGUMENT` (as an
    /// unknown kind or consistency is), not silently the configured one.
    fn entry_sync(&self, requested: i32) -> ApiResult<EntrySync> {
        if Durability::try_from(requested).is_err() {
            return Err(invalid(
                &self.node,
                format!("unknown durability {requested}"),
            ));
        }
        let configured = self
            .node
            .config
            .durability()
            .unwrap_or(EngineDurability::Synced);
        Ok(
            if requested == Durability::Synced as i32 && configured == EngineDurability::Buffered {
                EntrySync::Always
            } else {
                EntrySync::AsConfigured
            },
        )
    }

    /// The content of a put stream — exactly `size` bytes, in chunks of at
    /// most 1 MiB, none more than the idle timeout after the last — after
    /// [`blob::HEADER_BYTES`] of room for the header ([`blob::seal`]), so
    /// the content is copied once, into the value the engine stores.
    async fn receive(&self, stream: &mut Streaming<PutRequest>, size: u64) -> ApiResult<Vec<u8>> {
        let mut value = Vec::with_capacity(blob::HEADER_BYTES + size as usize);
        value.resize(blob::HEADER_BYTES, 0);
        let received = |value: &Vec<u8>| (value.len() - blob::HEADER_BYTES) as u64;
        let idle = Duration::from_millis(self.node.config.limits.put_idle_timeout_ms);
        // And the whole at an average of at least `MIN_PUT_BYTES_PER_SEC`
        // (after one idle timeout's grace): a byte sent every so often
        // under the idle timeout held the value's reservation for as long
        // as the sender liked.
        let deadline = tokio::time::Instant::now()
            + idle
            + Duration::from_secs_f64(size as f64 / MIN_PUT_BYTES_PER_SEC as f64);
        loop {
            let wait = (tokio::time::Instant::now() + idle).min(deadline);
            let Ok(next) = tokio::time::timeout_at(wait, stream.next()).await else {
                let why = if wait == deadline {
                    format!(
                        "the put stream sent less than {} KiB/s on average",
                        MIN_PUT_BYTES_PER_SEC >> 10
                    )
                } else {
                    format!("the put stream sent nothing for {idle:?}")
                };
                return Err(self.node.error(
                    ErrorCode::Timeout,
                    format!(
                        "{why} ({} of {size} bytes received); nothing was stored",
                        received(&value)
                    ),
                ));
            };
            let Some(message) = next else { break };
            let message = message.map_err(|s| invalid(&self.node, s.message()))?;
            match message.msg {
                Some(put_request::Msg::Data(data)) => {
                    if data.len() > CHUNK_BYTES {
                        return Err(invalid(
                            &self.node,
                            format!("a put chunk carries at most {CHUNK_BYTES} bytes"),
                        ));
                    }
                    if received(&value) + data.len() as u64 > size {
                        return Err(self.node.error(
                            ErrorCode::SizeMismatch,
                            format!("the stream carries more than the {size} bytes announced"),
                        ));
                    }
                    value.extend_from_slice(&data);
                }
                Some(put_request::Msg::Header(_)) => {
                    return Err(invalid(&self.node, "a second header in one put stream"));
                }
                None => {}
            }
        }
        if received(&value) != size {
            return Err(self.node.error(
                ErrorCode::SizeMismatch,
                format!(
                    "the stream carried {} bytes, {size} were announced",
                    received(&value)
                ),
            ));
        }
        Ok(value)
    }

    fn check_digest(
        &self,
        target: &Target,
        header: &PutHeader,
        digest: &[u8; 32],
    ) -> ApiResult<()> {
        let key = &header.blob.as_ref().expect("checked").key;
        // A manifest's key is the digest of the whole blob it describes,
        // which the SDK verifies on every read; its own bytes hash to
        // something else.
        let manifest = header.kind == BlobKind::Manifest as i32;
        if target.namespace.content_addressed && !manifest && key[..] != digest[..] {
            return Err(self.node.error(
                ErrorCode::DigestMismatch,
                "the content's SHA-256 is not the key; nothing was stored",
            ));
        }
        if !header.expected_sha256.is_empty() && header.expected_sha256[..] != digest[..] {
            return Err(self.node.error(
                ErrorCode::DigestMismatch,
                "the content's SHA-256 is not expected_sha256; nothing was stored",
            ));
        }
        Ok(())
    }

    async fn get_inner(&self, request: GetRequest, caller: &Caller) -> ApiResult<GetStream> {
        let target = self.target(request.blob.as_ref())?;
        self.read_point(&target, request.consistency).await?;
        let key = target.key;
        // The in-flight budget is taken for the value's stored length
        // before the engine reads it (held until the stream is sent or
        // abandoned): taken after, concurrent reads of large blobs each
        // allocated their value before most were refused.
        let slot: HoldSlot<ApiResult<super::InFlight>> = Arc::default();
        let admit =
            |slot: HoldSlot<ApiResult<super::InFlight>>, node: Arc<Node>, caller: Caller| {
                admission(slot, move |len| node.reserve(len, &caller))
            };
        let mut now_admit = admit(slot.clone(), self.node.clone(), caller.clone());
        let mut wait_admit = admit(slot.clone(), self.node.clone(), caller.clone());
        let stored = self
            .engine_read_now(
                &target,
                |engine, space| engine.get_stored_admitted_now(space, &key, &mut now_admit),
                move |engine, space| engine.get_stored_admitted(space, &key, &mut wait_admit),
            )
            .await?;
        let budget = slot.lock().take();
        if let Some(Err(refused)) = budget {
            return Err(refused);
        }
        self.check_owned(&target, &key)?;
        let stored = stored.ok_or_else(|| self.node.error(ErrorCode::NotFound, "no such blob"))?;
        let budget = budget
            .expect("a value read was admitted")
            .expect("admitted");
        let (header, _) = blob::decode(&stored.value)
            .map_err(|e| self.node.internal_error(target.info.shard_id, e))?;
        let mut info = header.info(stored.epoch.0);
        info.current_epoch = u64::from(self.write_epoch(&target));
        let size = header.size;
        let start = request.offset.min(size);
        let end = match request.length {
            0 => size,
            n => start.saturating_add(n).min(size),
        };
        self.node.metrics.get_bytes.inc_by(end - start);
        tracing::Span::current().record("bytes", end - start);
        // Every message up front: the content ones are slices of the stored
        // value (no copy, no task, no channel per read); gRPC sends them as
        // the connection's flow control allows.
        let content = stored.value.slice(blob::HEADER_BYTES..);
        let mut messages = vec![GetResponse {
            msg: Some(get_response::Msg::Info(info)),
        }];
        let mut at = start as usize;
        while at < end as usize {
            let next = (at + CHUNK_BYTES).min(end as usize);
            messages.push(GetResponse {
                msg: Some(get_response::Msg::Data(content.slice(at..next))),
            });
            at = next;
        }
        Ok(GetStream {
            messages: messages.into_iter(),
            _budget: budget,
        })
    }

    async fn head_inner(&self, request: HeadRequest) -> ApiResult<HeadResponse> {
        let target = self.target(request.blob.as_ref())?;
        self.read_point(&target, request.consistency).await?;
        let key = target.key;
        let checked = !request.unchecked;
        let stored = self
            .engine_read_now(
                &target,
                |engine, space| {
                    if checked {
                        engine.get_head_now(space, &key, blob::HEADER_BYTES)
                    } else {
                        Ok(None)
                    }
                },
                move |engine, space| {
                    if checked {
                        engine.get_head(space, &key, blob::HEADER_BYTES)
                    } else {
                        engine.get_head_unchecked(space, &key, blob::HEADER_BYTES)
                    }
                },
            )
            .await?;
        self.check_owned(&target, &key)?;
        let stored = stored.ok_or_else(|| self.node.error(ErrorCode::NotFound, "no such blob"))?;
        // The header alone: a large blob's content is not read.
        let header = blob::decode_head(&stored.prefix, stored.len)
            .map_err(|e| self.node.internal_error(target.info.shard_id, e))?;
        let mut info = header.info(stored.epoch.0);
        info.current_epoch = u64::from(self.write_epoch(&target));
        Ok(HeadResponse { info: Some(info) })
    }

    async fn batch_exists_inner(
        &self,
        request: BatchExistsRequest,
    ) -> ApiResult<BatchExistsResponse> {
        self.check_running()?;
        if request.keys.len() > MAX_BATCH_KEYS {
            return Err(invalid(
                &self.node,
                format!(
                    "at most {MAX_BATCH_KEYS} keys per request, not {}",
                    request.keys.len()
                ),
            ));
        }
        let namespace = self.node.namespace(&request.namespace)?;
        let mut presence = vec![Presence::NotHere; request.keys.len()];
        // Keys grouped by the hosted shard that owns them.
        let mut by_shard: std::collections::BTreeMap<u32, (Target, Vec<usize>)> =
            std::collections::BTreeMap::new();
        for (i, key) in request.keys.iter().enumerate() {
            self.validate_key(&namespace, key)?;
            let storage = storage_key(namespace.id, key);
            let Ok((info, shard)) = self.node.route(&storage) else {
                continue;
            };
            by_shard
                .entry(info.shard_id)
                .or_insert_with(|| {
                    (
                        Target {
                            namespace: namespace.clone(),
                            key: storage,
                            info,
                            shard,
                        },
                        Vec::new(),
                    )
                })
                .1
                .push(i);
        }
        // A consistency this node does not know is the request's error, not
        // every key's NOT_HERE (a client asking the leader again would ask
        // for ever).
        if ReadConsistency::try_from(request.consistency).is_err() {
            return Err(invalid(
                &self.node,
                format!("unknown consistency {}", request.consistency),
            ));
        }
        let linearizable = request.consistency == ReadConsistency::Linearizable as i32;
        let mut refused = None;
        for (target, indexes) in by_shard.into_values() {
            if let Err(error) = self.read_point(&target, request.consistency).await {
                refused.get_or_insert(error);
                continue; // NOT_HERE: ask the leader
            }
            let keys: Arc<Vec<StorageKey>> = Arc::new(
                indexes
                    .iter()
                    .map(|i| storage_key(namespace.id, &request.keys[*i]))
                    .collect(),
            );
            let all = keys.clone();
            let epochs = self
                .engine_read_now(
                    &target,
                    |engine, space| {
                        keys.iter()
                            .map(|k| engine.epoch_of_now(space, k))
                            .collect::<tidepool_engine::Result<Option<Vec<_>>>>()
                    },
                    move |engine, space| {
                        all.iter()
                            .map(|k| engine.epoch_of(space, k))
                            .collect::<tidepool_engine::Result<Vec<_>>>()
                    },
                )
                .await?;
            let current = self.write_epoch(&target);
            // Keys a split gave away meanwhile stay NOT_HERE (the client
            // asks again): ranges only narrow, so a key owned after the
            // read was owned during it.
            let range = target.shard.range();
            for (i, epoch) in indexes.iter().zip(&epochs) {
                if !owns(range, &storage_key(namespace.id, &request.keys[*i])) {
                    continue;
                }
                presence[*i] = if epoch.is_some() {
                    Presence::Present
                } else {
                    Presence::Absent
                };
            }
            if request.touch && linearizable {
                let stale: Vec<usize> = indexes
                    .iter()
                    .zip(epochs)
                    .filter(|(i, _)| presence[**i] != Presence::NotHere)
                    .filter(|(_, epoch)| epoch.is_some_and(|e| e.0 < current))
                    .map(|(i, _)| *i)
                    .collect();
                // A wave proposed before any of it is awaited: the shard
                // owner takes it in one round, so it shares one Ready and
                // one sync. Waves, not all at once: 100,000 stale keys
                // (a build's inputs after an epoch advance) proposed
                // together filled the shard's event queue, whose overflow
                // then refused other clients' writes.
                for wave in stale.chunks(TOUCH_WAVE) {
                    let pending: Vec<_> = wave
                        .iter()
                        .map(|i| {
                            // Server-made and harmless twice (a touch only
                            // moves a blob forward): no session.
                            let touch = Command::Touch {
                                namespace: namespace.id,
                                epoch: current,
                                key: storage_key(namespace.id, &request.keys[*i]),
                                session: None,
                            };
                            (
                                *i,
                                submit(&target, Proposal::Command(touch, EntrySync::AsConfigured)),
                            )
                        })
                        .collect();
                    for (i, rx) in pending {
                        // Deleted or expired since its read: missing after
                        // all.
                        if self.committed(&target, rx).await? == (OpResult::Done { existed: false })
                        {
                            presence[i] = Presence::Absent;
                        }
                    }
                }
            }
        }
        // Answering for none of the keys, the reason is the answer: a
        // follower's NOT_LEADER names the leader, an overloaded or cut-off
        // leader says so (and when to come back); all NOT_HERE told the
        // client only to try another replica, at once.
        if let Some(error) = refused
            && presence.iter().all(|p| *p == Presence::NotHere)
        {
            return Err(error);
        }
        Ok(BatchExistsResponse {
            presence: presence.into_iter().map(|p| p as i32).collect(),
            map_version: self.node.map().version,
        })
    }

    async fn delete_inner(
        &self,
        request: DeleteRequest,
        caller: &Caller,
    ) -> ApiResult<DeleteResponse> {
        let target = self.target(request.blob.as_ref())?;
        self.require_leader(&target)?;
        let session = self.session(request.session.as_ref())?;
        let sync = self.entry_sync(request.durability)?;
        self.charge_open(&target, session.as_ref(), caller)?;
        // Always proposed; whether the key existed is decided when the
        // delete applies, in log order (so it is exact, and a retried
        // delete of a session answers what its first copy found).
        let op = WriteOp {
            value: None,
            namespace: target.namespace.id,
            epoch: self.write_epoch(&target),
            key: target.key,
            name: request.blob.as_ref().expect("checked").key.clone(),
            session,
            if_absent: false,
        };
        let outcome = self
            .wait(&target, submit(&target, Proposal::Write(op, sync)))
            .await?;
        let existed = match self.op_result(&target, &outcome)? {
            OpResult::Done { existed } => existed,
            OpResult::Refused(why) => return Err(self.refused(&target, why)),
        };
        // The chunks of the chunked blob this delete removed, as it found
        // it where it applied (a put between the SDK's read of the
        // manifest and this delete stored another's); content-addressed
        // chunks are shared.
        let replaced = outcome
            .replaced_chunks()
            .filter(|_| !target.namespace.content_addressed);
        Ok(DeleteResponse { existed, replaced })
    }

    async fn list_inner(&self, request: ListRequest) -> ApiResult<ListResponse> {
        self.check_running()?;
        let namespace = self.node.namespace(&request.namespace)?;
        let limit = match request.limit {
            0 => DEFAULT_LIST_LIMIT,
            n if n as usize > MAX_LIST_LIMIT => {
                return Err(invalid(
                    &self.node,
                    format!("limit is at most {MAX_LIST_LIMIT}, not {n}"),
                ));
            }
            n => n as usize,
        };
        for (what, bytes) in [
            ("prefix", &request.prefix),
            ("start_after", &request.start_after),
        ] {
            if bytes.len() > KEY_MAX_BYTES {
                return Err(invalid(
                    &self.node,
                    format!(
                        "{what} is at most {KEY_MAX_BYTES} bytes, not {}",
                        bytes.len()
                    ),
                ));
            }
        }
        let Some((info, shard)) = self
            .node
            .hosted()
            .into_iter()
            .find(|(info, _)| info.shard_id == request.shard_id)
        else {
            let mut error = self.node.error(
                ErrorCode::WrongShard,
                format!(
                    "node {} hosts no replica of shard {}",
                    self.node.config.node_id, request.shard_id
                ),
            );
            error.detail.shard_id = Some(request.shard_id);
            return Err(error);
        };
        tracing::Span::current().record("shard_id", info.shard_id);
        let target = Target {
            namespace,
            key: [0; 32],
            info,
            shard,
        };
        // An unknown consistency is the request's error, answered by any
        // replica (a follower answered NOT_LEADER first, and the leader
        // then INVALID_ARGUMENT).
        if ReadConsistency::try_from(request.consistency).is_err() {
            return Err(invalid(
                &self.node,
                format!("unknown consistency {}", request.consistency),
            ));
        }
        if request.consistency != ReadConsistency::AnyReplica as i32 {
            self.require_leader(&target)?;
        }
        self.read_point(&target, request.consistency).await?;
        let engine = target.shard.engine();
        let namespace_id = target.namespace.id;
        let limits = names::PageLimits {
            entries: limit,
            name_bytes: MAX_LIST_NAME_BYTES,
            examined: limit.saturating_mul(4) + 1024,
            entered: limit.saturating_mul(4) + 1024,
            owned: target.shard.range(),
        };
        let (prefix, start_after) = (request.prefix, request.start_after);
        let (page, complete) = self
            .engine_read(&target, move |engine, blobs| {
                let space = engine.key_space(names::NAMES_KEY_SPACE)?;
                let after = (!start_after.is_empty()).then_some(&start_after[..]);
                let page =
                    names::list_page(engine, space, blobs, namespace_id, &prefix, after, limits);
                let complete = names::is_complete(engine, space);
                Ok((page, complete))
            })
            .await?;
        // The range as it is after the walk (ranges only narrow): a split
        // applied during it may have dropped blobs of the half given away
        // from the walk, and a page reporting the range from before looked
        // whole — the client would never have asked the new shard.
        let owned = target.shard.range();
        let shard_id = target.info.shard_id;
        let page = page.map_err(|e| self.node.internal_error(shard_id, e))?;
        let complete = complete.map_err(|e| self.node.internal_error(shard_id, e))?;
        drop(engine);
        Ok(ListResponse {
            entries: page
                .entries
                .into_iter()
                .map(|listed| ListEntry {
                    key: listed.name,
                    info: Some(BlobInfo {
                        size: listed.meta.size,
                        sha256: listed.meta.sha256.to_vec(),
                        epoch: u64::from(listed.epoch),
                        kind: i32::from(listed.meta.kind),
                        current_epoch: 0,
                    }),
                })
                .collect(),
            done: page.done,
            resume_after: page.resume_after,
            incomplete: !complete,
            range: owned.map(|(start, end)| tidepool_proto::v1::HashRange { start, end }),
            map_version: self.node.map().version,
        })
    }

    /// For a content-addressed put whose key was present at its read point
    /// with `stored_epoch`: the same key can only hold the same content, so
    /// its epoch is refreshed and nothing else written. Whether the blob is
    /// still there: a touch that applies after a delete or a dropped epoch
    /// finds nothing, and the put then stores its bytes after all. A put
    /// asked synced on a buffered cluster commits a marked entry anyway:
    /// once it commits, a majority has synced its log through it, the
    /// stored blob included.
    async fn keep_present(
        &self,
        target: &Target,
        stored_epoch: u32,
        epoch: u32,
        sync: EntrySync,
    ) -> ApiResult<bool> {
        if stored_epoch < epoch {
            // No session: a touch only moves a blob forward, harmless
            // twice, and the put's session stays for the write that may
            // follow (a session applies each of its writes once).
            let touch = Command::Touch {
                namespace: target.namespace.id,
                epoch,
                key: target.key,
                session: None,
            };
            let result = self.commit(target, Proposal::Command(touch, sync)).await?;
            return Ok(result != OpResult::Done { existed: false });
        }
        if sync == EntrySync::Always {
            self.commit(target, Proposal::Command(Command::Noop, sync))
                .await?;
        }
        Ok(true)
    }

    /// After a sessioned put or touch committed: moves the blob to
    /// `epoch`, the epoch the answer names, if it still holds `digest`
    /// (any blob for a touch) in an earlier one. The copy that committed
    /// may be a duplicate — an earlier copy applied, maybe before an epoch
    /// advance, and its answer was lost — and a duplicate applies nothing:
    /// acknowledged in `epoch`, the blob stayed in the earlier one and a
    /// drop took it an epoch before its acknowledged retention ended (a
    /// chunked upload's manifest before its chunks). The move is a touch
    /// without a session (harmless twice). Returns whether the key still
    /// holds the blob; a key now holding another blob (replaced since) is
    /// left as it is.
    async fn settle_epoch(
        &self,
        target: &Target,
        epoch: u32,
        digest: Option<[u8; 32]>,
        sync: EntrySync,
    ) -> ApiResult<bool> {
        let key = target.key;
        // The index alone first: every sessioned put comes here, and a
        // value read (a small one is read whole, checked, and cached) would
        // cost each put a read and fill the value cache with what was just
        // written.
        let stored_epoch = self
            .engine_read_now(
                target,
                move |engine, space| engine.epoch_of_now(space, &key),
                move |engine, space| engine.epoch_of(space, &key),
            )
            .await?;
        let Some(stored_epoch) = stored_epoch else {
            return Ok(false);
        };
        if stored_epoch.0 >= epoch {
            return Ok(true);
        }
        if let Some(digest) = digest {
            let stored = self
                .engine_read(target, move |engine, space| {
                    engine.get_head(space, &key, blob::HEADER_BYTES)
                })
                .await?;
            let Some(stored) = stored else {
                return Ok(false);
            };
            let header = blob::decode_head(&stored.prefix, stored.len)
                .map_err(|e| self.node.internal_error(target.info.shard_id, e))?;
            if header.sha256 != digest {
                return Ok(true);
            }
        }
        self.keep_present(target, stored_epoch.0, epoch, sync).await
    }

    async fn touch_inner(
        &self,
        request: TouchRequest,
        caller: &Caller,
    ) -> ApiResult<TouchResponse> {
        let target = self.target(request.blob.as_ref())?;
        self.require_leader(&target)?;
        let session = self.session(request.session.as_ref())?;
        // As for delete: no NOT_FOUND for a blob whose put this leader has
        // not applied yet.
        self.read_point(&target, ReadConsistency::Linearizable as i32)
            .await?;
        let key = target.key;
        let stored_epoch = self
            .engine_read_now(
                &target,
                |engine, space| engine.epoch_of_now(space, &key),
                move |engine, space| engine.epoch_of(space, &key),
            )
            .await?;
        self.check_owned(&target, &key)?;
        let stored_epoch =
            stored_epoch.ok_or_else(|| self.node.error(ErrorCode::NotFound, "no such blob"))?;
        let epoch = self.write_epoch(&target);
        let recorded = stored_epoch.0 < epoch;
        if recorded {
            self.charge_open(&target, session.as_ref(), caller)?;
            let touch = Command::Touch {
                namespace: target.namespace.id,
                epoch,
                key: target.key,
                session,
            };
            let touch = Proposal::Command(touch, EntrySync::AsConfigured);
            if self.commit(&target, touch).await? == (OpResult::Done { existed: false })
                || !self
                    .settle_epoch(&target, epoch, None, EntrySync::AsConfigured)
                    .await?
            {
                return Err(self.node.error(
                    ErrorCode::NotFound,
                    "no such blob: deleted or expired before the touch applied",
                ));
            }
        }
        Ok(TouchResponse {
            epoch: u64::from(epoch),
            recorded,
        })
    }

    /// Runs one request of operation `operation` (an index into
    /// `OPERATIONS`) in its span — `shard_id` and `term` are recorded once
    /// the blob is routed; the span continues the caller's trace when it
    /// sent one — and counts it.
    async fn serve<T>(
        &self,
        operation: usize,
        parent: Option<opentelemetry::Context>,
        request: impl std::future::Future<Output = ApiResult<T>>,
    ) -> Result<Response<T>, Status> {
        let start = Instant::now();
        let span = tidepool_security::trace_context::continued(parent, || {
            tracing::info_span!(
                parent: None,
                "request",
                node_id = self.node.config.node_id,
                op = super::OPERATIONS[operation],
                shard_id = tracing::field::Empty,
                term = tracing::field::Empty,
                namespace = tracing::field::Empty,
                bytes = tracing::field::Empty,
                error_code = tracing::field::Empty
            )
        });
        // Counted `CANCELLED` if dropped unanswered (the caller's deadline
        // passed, or it reset the stream).
        let unanswered = Unanswered {
            node: &self.node,
            operation,
            start,
        };
        let result = request.instrument(span.clone()).await;
        std::mem::forget(unanswered);
        let code = result
            .as_ref()
            .err()
            .map(|error| super::metrics::code_label(error.code()));
        if let Some(code) = code {
            span.record("error_code", code);
        }
        // An access log line at debug, inside the request's span (so in
        // its trace: JSON lines carry its ids).
        tracing::debug!(
            parent: &span,
            code = code.unwrap_or("OK"),
            micros = start.elapsed().as_micros() as u64,
            "request answered"
        );
        self.node.metrics.finished(operation, start, code);
        result.map(Response::new).map_err(Status::from)
    }
}

/// A request not answered yet: counted `CANCELLED` when dropped so.
struct Unanswered<'a> {
    node: &'a Node,
    operation: usize,
    start: Instant,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        self.node
            .metrics
            .finished(self.operation, self.start, Some("CANCELLED"));
    }
}

/// The caller's trace context, when this process keeps contexts.
fn remote_parent<T>(request: &Request<T>) -> Option<opentelemetry::Context> {
    if !tidepool_security::trace_context::tracking() {
        return None;
    }
    tidepool_security::trace_context::extract(request.metadata())
}

enum Proposal {
    Write(WriteOp, EntrySync),
    Command(Command, EntrySync),
}

/// Queues a proposal (or a write for group commit) without waiting.
/// Slowest average rate a put's content may arrive at, after one idle
/// timeout of grace (a 64 MiB value: 34 minutes).
const MIN_PUT_BYTES_PER_SEC: u64 = 32 << 10;

/// Most touches one `BatchExists` has waiting in a shard's event queue at
/// once (of the queue's 65,536 events).
const TOUCH_WAVE: usize = 1024;

fn submit(target: &Target, proposal: Proposal) -> oneshot::Receiver<Outcome> {
    let (tx, rx) = oneshot::channel();
    let done = Box::new(move |outcome| {
        let _ = tx.send(outcome);
    });
    match proposal {
        Proposal::Write(op, sync) => target.shard.write(op, sync, done),
        Proposal::Command(command, sync) => target.shard.propose(command, sync, done),
    }
    rx
}

#[tonic::async_trait]
impl BlobService for BlobApi {
    async fn put(
        &self,
        request: Request<Streaming<PutRequest>>,
    ) -> Result<Response<PutResponse>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        self.serve(0, parent, self.put_inner(caller, request.into_inner()))
            .await
    }

    type GetStream = GetStream;

    async fn get(&self, request: Request<GetRequest>) -> Result<Response<Self::GetStream>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        let request = request.into_inner();
        self.serve(1, parent, async {
            self.allow(
                &caller,
                request.blob.as_ref().map(|b| b.namespace.as_str()),
                Role::Read,
            )?;
            self.get_inner(request, &caller).await
        })
        .await
    }

    async fn head(&self, request: Request<HeadRequest>) -> Result<Response<HeadResponse>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        let request = request.into_inner();
        self.serve(2, parent, async {
            self.allow(
                &caller,
                request.blob.as_ref().map(|b| b.namespace.as_str()),
                Role::Read,
            )?;
            self.head_inner(request).await
        })
        .await
    }

    async fn batch_exists(
        &self,
        request: Request<BatchExistsRequest>,
    ) -> Result<Response<BatchExistsResponse>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        let request = request.into_inner();
        self.serve(3, parent, async {
            self.allow(&caller, Some(&request.namespace), Role::Read)?;
            self.batch_exists_inner(request).await
        })
        .await
    }

    async fn delete(
        &self,
        request: Request<DeleteRequest>,
    ) -> Result<Response<DeleteResponse>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        let request = request.into_inner();
        self.serve(4, parent, async {
            self.allow(
                &caller,
                request.blob.as_ref().map(|b| b.namespace.as_str()),
                Role::Delete,
            )?;
            self.delete_inner(request, &caller).await
        })
        .await
    }

    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        let request = request.into_inner();
        self.serve(6, parent, async {
            self.allow(&caller, Some(&request.namespace), Role::Read)?;
            self.list_inner(request).await
        })
        .await
    }

    async fn touch(
        &self,
        request: Request<TouchRequest>,
    ) -> Result<Response<TouchResponse>, Status> {
        let caller = Caller::of(&request);
        let parent = remote_parent(&request);
        let request = request.into_inner();
        self.serve(5, parent, async {
            self.allow(
                &caller,
                request.blob.as_ref().map(|b| b.namespace.as_str()),
                Role::Write,
            )?;
            self.touch_inner(request, &caller).await
        })
        .await
    }
}

/// Where a read's admission leaves its hold on the in-flight budget.
type HoldSlot<H> = Arc<parking_lot::Mutex<Option<H>>>;

/// The admission a read asks of the budget before the engine reads a value
/// of the length it is given: reserves it into `slot` and says whether that
/// succeeded. A hold left by an earlier admission of the same read (the
/// read from memory found the value cold, and the blocking read asks
/// again) is given back first: held while the second reserved, it counted
/// the value twice, and a cold read of a value above a quarter of the
/// budget, under a token's half share, was always refused.
fn admission<H, E>(
    slot: HoldSlot<Result<H, E>>,
    reserve: impl Fn(u64) -> Result<H, E>,
) -> impl FnMut(u64) -> bool {
    move |len| {
        drop(slot.lock().take());
        let reserved = reserve(len);
        let admitted = reserved.is_ok();
        *slot.lock() = Some(reserved);
        admitted
    }
}

#[cfg(test)]
mod admission_tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A budget of `limit` bytes; a hold gives its bytes back when dropped.
    struct Hold(Arc<AtomicU64>, u64);

    impl Drop for Hold {
        fn drop(&mut self) {
            self.0.fetch_sub(self.1, Ordering::SeqCst);
        }
    }

    /// A read admitted twice (from memory, then blocking) holds the value
    /// once: a value above half the budget is admitted the second time.
    #[test]
    fn a_second_admission_gives_the_first_hold_back_first() {
        let used = Arc::new(AtomicU64::new(0));
        let limit = 100;
        let reserve = {
            let used = used.clone();
            move |len: u64| {
                if used.fetch_add(len, Ordering::SeqCst) + len > limit {
                    used.fetch_sub(len, Ordering::SeqCst);
                    return Err(());
                }
                Ok(Hold(used.clone(), len))
            }
        };
        let slot = super::HoldSlot::default();
        let mut now = super::admission(slot.clone(), reserve.clone());
        let mut wait = super::admission(slot.clone(), reserve);
        assert!(now(60));
        assert!(wait(60), "the first hold is given back before the second");
        assert_eq!(used.load(Ordering::SeqCst), 60);
        drop(slot.lock().take());
        assert_eq!(used.load(Ordering::SeqCst), 0);
    }
}
