//! `Client`: the blob operations, each routed by key hash to its shard's
//! leader and retried within the call's deadline.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use sha2::{Digest, Sha256};
use tidepool_proto::v1::blob_service_client::BlobServiceClient;
use tidepool_proto::v1::{
    BatchExistsRequest, BlobInfo, BlobKind, BlobRef, ClusterMap, DeleteRequest, Durability,
    ErrorCode, GetRequest, HeadRequest, Presence, PutHeader, PutRequest, ReadConsistency,
    ReplacedChunks, TouchRequest, TouchResponse, WriteSession, get_response, put_request,
};
use tidepool_security::Channel;
use tonic::Status;
use tracing::Instrument as _;

use crate::cluster::{Cluster, MAX_MESSAGE};
use crate::error::{Disposition, Error, Result, Traced as _, classify};
use crate::session::SessionPool;

/// [`ClientConfig::hedge_after`] of a new configuration: several times a
/// healthy call's latency (1 MiB puts under load: p99 about 350 ms), well
/// under an election (1-2 s).
pub const DEFAULT_HEDGE_AFTER: Duration = Duration::from_millis(500);

/// Settings of a [`Client`].
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Coordinator addresses (`http://host:port`); any one will do.
    pub seeds: Vec<String>,
    /// Deadline of one SDK call, retries included.
    pub timeout: Duration,
    /// Hedge delay: an attempt of a call that has not answered after this
    /// long is no longer waited for alone. It keeps running, and the call
    /// also tries the next replica (a write with the same session number,
    /// so it still applies once); whichever succeeds first is the answer.
    /// While attempts run unanswered the call starts at most one more per
    /// delay, and never a second one at the same node. A frozen or cut-off
    /// leader so costs a call about this delay plus the others' election,
    /// whatever the state of its connection. `None`: an attempt may take
    /// the whole call deadline alone. Default 500 ms.
    pub hedge_after: Option<Duration>,
    /// Deadline of connecting to one server.
    pub connect_timeout: Duration,
    /// Keep the map current with a watch on a coordinator. Without it (a
    /// short-lived program), the map is refreshed only when a call finds
    /// it stale.
    pub watch: bool,
    /// Mutual TLS: this client's certificate and key, and the cluster's CA
    /// (PEM files, re-read when they change). Required by clusters that
    /// run with TLS; `None` speaks plaintext.
    pub tls: Option<tidepool_security::TlsFiles>,
    /// Bearer token sent with every call (what it may do is the token's
    /// roles).
    pub token: Option<String>,
}

impl ClientConfig {
    /// Defaults (30 s calls, 3 s connects) for `seeds`.
    pub fn new<S: AsRef<str>>(seeds: &[S]) -> Self {
        Self {
            seeds: seeds.iter().map(|s| s.as_ref().to_string()).collect(),
            timeout: Duration::from_secs(30),
            hedge_after: Some(DEFAULT_HEDGE_AFTER),
            connect_timeout: Duration::from_secs(3),
            watch: true,
            tls: None,
            token: None,
        }
    }

    /// With TLS material.
    pub fn with_tls(mut self, tls: tidepool_security::TlsFiles) -> Self {
        self.tls = Some(tls);
        self
    }

    /// With a bearer token.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// With the material `tidepool dev` makes in its data directory `dir`
    /// (`tls/client.pem`, `tls/client-key.pem`, `tls/ca.pem`,
    /// `admin.token`), each only if it exists — so the same program runs
    /// against a dev cluster started with `--insecure`. `TIDEPOOL_TOKEN`,
    /// when set, is the token instead.
    pub fn with_dev_credentials(mut self, dir: &std::path::Path) -> Self {
        let tls = dir.join("tls");
        if tls.join("ca.pem").exists() {
            self.tls = Some(tidepool_security::TlsFiles {
                cert: tls.join("client.pem"),
                key: tls.join("client-key.pem"),
                ca: tls.join("ca.pem"),
            });
        }
        self.token = std::env::var("TIDEPOOL_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| tidepool_security::token::read_file(&dir.join("admin.token")).ok())
            .or(self.token);
        self
    }
}

/// What a put stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutOutcome {
    /// Size of the blob, bytes.
    pub size: u64,
    /// SHA-256 of the blob.
    pub sha256: [u8; 32],
    /// Epoch of the write. For a put the SDK sent again (an attempt
    /// ended without a definite answer), the epoch of the copy that was
    /// answered: an earlier copy that applied in an earlier epoch is
    /// answered as a duplicate with the later copy's epoch, so the blob
    /// may have been stored one epoch earlier than this says. (Chunks of a
    /// blob the SDK uploads are moved to their manifest's epoch then.)
    pub epoch: u64,
    /// A content-addressed key that was already stored (nothing written).
    pub already_present: bool,
}

/// What `head` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobMeta {
    /// Size of the blob, bytes (of the whole blob when chunked).
    pub size: u64,
    /// SHA-256 of the blob.
    pub sha256: [u8; 32],
    /// Epoch of its last write or touch.
    pub epoch: u64,
    /// Whether the SDK stored it in chunks.
    pub chunked: bool,
}

/// A connection to a Tidepool cluster. Cheap to clone; clones share the
/// map and connections.
#[derive(Clone)]
pub struct Client {
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) timeout: Duration,
    pub(crate) hedge_after: Option<Duration>,
    /// Write sessions (exactly-once writes), shared by clones.
    pub(crate) sessions: Arc<SessionPool>,
    /// Counts the attempts this client (or clone) makes, if set.
    pub(crate) attempts: Option<Arc<AtomicU64>>,
    /// The token blob calls carry instead of the client's own
    /// ([`Client::acting_as`]).
    pub(crate) caller_token: Option<Arc<str>>,
    /// What puts and deletes wait for ([`Client::with_durability`]).
    pub(crate) durability: Durability,
    /// What the uploads of this client and its clones may buffer at once
    /// ([`Client::with_upload_memory`]; `None`: unbounded).
    pub(crate) upload_memory: Option<Arc<crate::stream::MemoryBudget>>,
    /// What the readers of this client and its clones may hold at once
    /// ([`Client::with_read_memory`]; `None`: unbounded).
    pub(crate) read_memory: Option<Arc<crate::stream::MemoryBudget>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("seeds", &self.cluster.seeds)
            .field("map_version", &self.cluster.map().version)
            .finish()
    }
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A failure that is not an answer from the node: no connection, a
/// broken one (a transport error carries no Tidepool error detail).
fn no_answer(status: &Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    ) && tidepool_proto::error_detail(status).is_none()
}

/// Whether the node refused for load (`OVERLOADED`): it may still lead.
fn overloaded(status: &Status) -> bool {
    tidepool_proto::error_detail(status).is_some_and(|d| d.code == ErrorCode::Overloaded as i32)
}

/// Whether a write's final error was decided before the shard's session
/// check, so that it speaks for its own attempt only: every refusal but the
/// ones the apply step makes (`SESSION_EXPIRED`, `ALREADY_EXISTS`), which
/// account for every earlier attempt of the write, `TIMEOUT`, which
/// already says the outcome is unknown, and the write's own `settled`
/// codes (a touch's `NOT_FOUND`: whatever an earlier attempt did, there is
/// nothing to touch now, and a touch leaves nothing a reader could see).
fn refused_before_applying(error: &Error, settled: &[ErrorCode]) -> bool {
    !matches!(
        error.code(),
        ErrorCode::SessionExpired | ErrorCode::AlreadyExists | ErrorCode::Timeout
    ) && !settled.contains(&error.code())
}

/// The error of a write refused by its last attempt after an earlier one
/// ended without an answer: that one may have applied (once), so the
/// refusal (`DISK_FULL`: "nothing was stored") does not say what happened.
fn outcome_unknown(refusal: &Error) -> Error {
    Error::new(
        ErrorCode::Timeout,
        format!(
            "the outcome is unknown: an earlier attempt got no definite answer and may have applied (at most once); the last attempt was refused: {refusal}"
        ),
    )
}

/// Longest `retry_after_ms` a node's refusal is heeded for.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(2);

/// Keys per `BatchExists` request.
const BATCH_EXISTS_KEYS: usize = 10_000;

/// Bytes of keys per `BatchExists` request: half a node's default request
/// limit (8 MiB), so 10,000 keys of up to 1 KiB each, which the key limit
/// allows, are sent in two requests rather than refused whole.
const BATCH_EXISTS_BYTES: usize = 4 << 20;

/// Splits `indexes` (of `keys`) into runs of at most `BATCH_EXISTS_KEYS`
/// keys and `BATCH_EXISTS_BYTES` bytes of keys (a run holds at least one).
fn exists_batches<'a>(keys: &[Vec<u8>], indexes: &'a [usize]) -> Vec<&'a [usize]> {
    let mut batches = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (n, &i) in indexes.iter().enumerate() {
        // Each key costs its bytes and a few of framing.
        let cost = keys[i].len() + 8;
        if n > start && (n - start == BATCH_EXISTS_KEYS || bytes + cost > BATCH_EXISTS_BYTES) {
            batches.push(&indexes[start..n]);
            (start, bytes) = (n, 0);
        }
        bytes += cost;
    }
    if start < indexes.len() {
        batches.push(&indexes[start..]);
    }
    batches
}

/// Longest pause before asking a shard's replicas again when none named
/// a leader to go to (an election is under way: it takes about a second).
const ELECTION_POLL: Duration = Duration::from_millis(160);

/// A call's attempts that are still running while it tries others.
struct Hedged<F> {
    running: Vec<(Option<u64>, String, std::pin::Pin<Box<F>>)>,
}

impl<F> Default for Hedged<F> {
    fn default() -> Self {
        Self {
            running: Vec::new(),
        }
    }
}

impl<F: Future> Hedged<F> {
    fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// Whether an attempt at `address` is running.
    fn at(&self, address: &str) -> bool {
        self.running.iter().any(|(_, a, _)| a == address)
    }

    fn push(&mut self, node: Option<u64>, address: String, attempt: std::pin::Pin<Box<F>>) {
        self.running.push((node, address, attempt));
    }

    /// The first running attempt to end (its node and outcome); never
    /// ready when none runs.
    fn next(&mut self) -> impl Future<Output = (Option<u64>, F::Output)> + '_ {
        std::future::poll_fn(move |cx| {
            for i in 0..self.running.len() {
                if let std::task::Poll::Ready(output) = self.running[i].2.as_mut().poll(cx) {
                    let (node, _, _) = self.running.swap_remove(i);
                    return std::task::Poll::Ready((node, output));
                }
            }
            std::task::Poll::Pending
        })
    }
}

/// How a wait beside running attempts ended.
enum Waited<T> {
    /// One of them succeeded: the call's answer.
    Answer(T),
    /// One of them failed (the call moves on at once).
    Failed(Error),
    /// The time passed.
    Slept,
}

fn backoff(attempt: usize) -> Duration {
    Duration::from_millis(20 << attempt.min(5))
}

pub(crate) fn digest_of(bytes: &[u8]) -> Result<[u8; 32]> {
    bytes.try_into().map_err(|_| {
        Error::new(
            ErrorCode::Internal,
            "a node sent a digest that is not 32 bytes",
        )
    })
}

/// One `Get` call, whole: the info message and the bytes. A node is not
/// trusted with the memory it makes this client allocate: a blob announced
/// larger than `limit` (the cluster's largest value), or bytes beyond what
/// was announced, end the call with `CORRUPT`.
pub(crate) async fn read_blob(
    channel: Channel,
    request: GetRequest,
    limit: usize,
) -> std::result::Result<(BlobInfo, Vec<u8>), Status> {
    read_blob_sized(channel, request, limit, None).await
}

/// [`read_blob`], ended with `NOT_FOUND` as soon as the info message names
/// a blob stored whole whose size is not `size` (a manifest's own size is
/// not its blob's: read on).
pub(crate) async fn read_blob_sized(
    channel: Channel,
    request: GetRequest,
    limit: usize,
    size: Option<u64>,
) -> std::result::Result<(BlobInfo, Vec<u8>), Status> {
    let mut stream = BlobServiceClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .get(request)
        .await?
        .into_inner();
    let mut info = BlobInfo::default();
    let mut content = Vec::new();
    while let Some(message) = stream.message().await? {
        match message.msg {
            Some(get_response::Msg::Info(i)) => {
                if i.size > limit as u64 {
                    return Err(untrusted(format!(
                        "a node announced a blob of {} bytes; the cluster stores at most {limit}",
                        i.size
                    )));
                }
                if let Some(size) = size
                    && i.kind != BlobKind::Manifest as i32
                    && i.size != size
                {
                    return Err(tidepool_proto::status_with_detail(
                        tidepool_proto::v1::ErrorDetail {
                            code: ErrorCode::NotFound as i32,
                            message: format!("the blob is {} bytes, not {size}", i.size),
                            ..Default::default()
                        },
                    ));
                }
                content.reserve(i.size as usize);
                info = i;
            }
            Some(get_response::Msg::Data(data)) => {
                if (content.len() + data.len()) as u64 > info.size {
                    return Err(untrusted(format!(
                        "a node sent more than the {} bytes it announced",
                        info.size
                    )));
                }
                content.extend_from_slice(&data)
            }
            None => {}
        }
    }
    Ok((info, content))
}

/// A reply no honest node sends: `CORRUPT`, so it is not retried (and a
/// content-addressed read asks the other replicas).
fn untrusted(message: String) -> Status {
    tidepool_proto::status_with_detail(tidepool_proto::v1::ErrorDetail {
        code: ErrorCode::Corrupt as i32,
        message,
        ..Default::default()
    })
}

pub(crate) fn blob_ref(namespace: &str, key: &[u8]) -> Option<BlobRef> {
    Some(BlobRef {
        namespace: namespace.to_string(),
        key: key.to_vec(),
    })
}

impl Client {
    /// Connects through `seeds` (coordinator addresses): fetches the map
    /// and keeps it current in the background. Must run inside a tokio
    /// runtime.
    pub async fn connect<S: AsRef<str>>(seeds: &[S]) -> Result<Client> {
        Self::with_config(ClientConfig::new(seeds)).await
    }

    /// Connects with explicit settings.
    pub async fn with_config(config: ClientConfig) -> Result<Client> {
        if config.seeds.is_empty() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "give at least one coordinator address",
            ));
        }
        let tls = match config.tls {
            Some(files) => Some(tidepool_security::Tls::load(files).map_err(|e| {
                Error::new(ErrorCode::InvalidArgument, format!("TLS material: {e}"))
            })?),
            None => None,
        };
        let security = tidepool_security::Security {
            tls,
            token: config.token,
        };
        let cluster = Cluster::new(config.seeds, config.connect_timeout, security);
        cluster.refresh().await?;
        if config.watch {
            cluster.spawn_watch();
        }
        Ok(Client {
            cluster,
            timeout: config.timeout,
            hedge_after: config.hedge_after,
            sessions: Arc::default(),
            attempts: None,
            caller_token: None,
            durability: Durability::Default,
            upload_memory: None,
            read_memory: None,
        })
    }

    /// The deadline of each call (retries included).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The same client (shared map, connections and sessions) with another
    /// deadline for each call:
    /// `client.with_timeout(Duration::from_secs(2)).get(..)`.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        Client {
            timeout,
            ..self.clone()
        }
    }

    /// The same client with puts and deletes acknowledged once `durability`
    /// holds: `Synced` waits until a majority of replicas has synced the
    /// write also on a cluster configured `buffered` (its entry is marked
    /// for every replica to sync); `Buffered` on a synced cluster gets
    /// the cluster's stronger guarantee anyway; `Default` (a new client's)
    /// is the cluster's setting.
    pub fn with_durability(&self, durability: Durability) -> Client {
        Client {
            durability,
            ..self.clone()
        }
    }

    /// The same client, its [`Upload`](crate::Upload)s — and those of the
    /// clones made from it, which share the budget — buffering at most
    /// `bytes` at once: each reserves room for the bytes it buffers as
    /// they come, and gives it back when the chunk holding them is stored
    /// or the upload ends. With no room left, an upload buffering at least
    /// 256 KiB stores that at once as a chunk of its own (a blob smaller
    /// than a chunk may then be stored chunked); one buffering less waits,
    /// at most the call timeout, then fails `OVERLOADED` (the upload is
    /// over: start it again). Chunks are at most `bytes` long. What a
    /// server taking uploads from many clients (a gateway) bounds its
    /// memory with; a chunk being sent is copied once more into its
    /// messages, so the process may hold up to about twice the budget.
    pub fn with_upload_memory(&self, bytes: u64) -> Client {
        Client {
            upload_memory: Some(Arc::new(crate::stream::MemoryBudget::new(bytes))),
            ..self.clone()
        }
    }

    /// The same client, its [`BlobReader`](crate::BlobReader)s — and those
    /// of the clones made from it, which share the budget — holding at
    /// most `bytes` at once: a reader takes room before it asks a node for
    /// bytes (the size it was opened with, else a whole chunk, cut to what
    /// it read), a chunk takes room for its size before it is fetched (one
    /// ahead only with room to spare), and the room of a piece handed out
    /// comes back at the next call or
    /// when the reader is dropped. Room not given within the call timeout
    /// fails the read `OVERLOADED`. What a server streaming blobs to many
    /// clients (a gateway: a client that reads slowly holds what it is
    /// sent) bounds its memory with. A caller that keeps the pieces it is
    /// handed holds them outside the budget.
    pub fn with_read_memory(&self, bytes: u64) -> Client {
        Client {
            read_memory: Some(Arc::new(crate::stream::MemoryBudget::new(bytes))),
            ..self.clone()
        }
    }

    /// The same client, adding one to `counter` for every attempt a call
    /// makes (a call that succeeds at once adds 1; each retry adds 1): how
    /// much retrying an application's calls need.
    pub fn counting_attempts(&self, counter: Arc<AtomicU64>) -> Client {
        Client {
            attempts: Some(counter),
            ..self.clone()
        }
    }

    /// The same client with another hedge delay (see
    /// [`ClientConfig::hedge_after`]).
    pub fn with_hedge_after(&self, hedge_after: Option<Duration>) -> Client {
        Client {
            hedge_after,
            ..self.clone()
        }
    }

    /// The same client (shared map, connections and sessions) sending
    /// `token` with its blob calls instead of its own: what a gateway
    /// uses to act with each caller's own rights. The map is still
    /// fetched with the client's own credentials. `INVALID_ARGUMENT` if
    /// the token cannot be sent in a header.
    pub fn acting_as(&self, token: &str) -> Result<Client> {
        if token.is_empty() || token.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "a token is printable ASCII without spaces",
            ));
        }
        Ok(Client {
            caller_token: Some(Arc::from(token)),
            ..self.clone()
        })
    }

    /// A channel to `address` carrying the caller's token when acting for
    /// one.
    pub(crate) fn channel_as_caller(&self, address: &str) -> Result<Channel> {
        let channel = self.cluster.channel(address)?;
        match &self.caller_token {
            None => Ok(channel),
            Some(token) => channel.with_token(token).ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    "the token is not a header value",
                )
            }),
        }
    }

    /// The cluster map the client routes by.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.cluster.map()
    }

    /// Fetches the newest map now.
    pub async fn refresh_map(&self) -> Result<Arc<ClusterMap>> {
        self.cluster.refresh().await
    }

    /// Runs `op` on the leader of the shard owning `(namespace, key)`,
    /// following `NOT_LEADER` hints, refreshing a stale map and backing off
    /// on transient failures until it succeeds, fails for good, or the
    /// deadline passes. `op` gets a channel, the map version routed by and
    /// the shard.
    pub(crate) async fn on_shard<T, F, Fut>(&self, namespace: &str, key: &[u8], op: F) -> Result<T>
    where
        F: FnMut(Channel, u64, u32) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        self.on_route(
            |map| Cluster::route(map, namespace, key),
            op,
            &mut false,
            Instant::now() + self.timeout,
        )
        .await
    }

    /// Runs `op` on shard `shard_id`'s leader, as [`Client::on_shard`]
    /// does for a key's shard (`namespace` must exist).
    pub(crate) async fn on_shard_id<T, F, Fut>(
        &self,
        namespace: &str,
        shard_id: u32,
        op: F,
    ) -> Result<T>
    where
        F: FnMut(Channel, u64, u32) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        self.on_route(
            |map| {
                Cluster::namespace(map, namespace)?;
                map.shards
                    .iter()
                    .find(|s| s.shard_id == shard_id)
                    .cloned()
                    .map(|shard| crate::cluster::Route { shard })
                    .ok_or_else(|| {
                        Error::new(
                            ErrorCode::WrongShard,
                            format!("shard {shard_id} is not in the cluster map"),
                        )
                    })
            },
            op,
            &mut false,
            Instant::now() + self.timeout,
        )
        .await
    }

    /// Runs `op` on the leader of the shard `locate` finds. `uncertain` is
    /// set once an attempt ended without a definite answer (none came in
    /// time, the connection failed, or the node could not say whether its
    /// proposal committed): a write may have applied through it. Gives up
    /// at `deadline` (`TIMEOUT`).
    async fn on_route<T, F, Fut>(
        &self,
        locate: impl Fn(&ClusterMap) -> Result<crate::cluster::Route>,
        mut op: F,
        uncertain: &mut bool,
        deadline: Instant,
    ) -> Result<T>
    where
        F: FnMut(Channel, u64, u32) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        let mut redirect: Option<String> = None;
        let mut attempt = 0usize;
        let mut refreshed = false;
        // Attempts still running that the call no longer waits for alone
        // (hedged): the first of them to succeed is the call's answer.
        let mut pending = Hedged::<Fut>::default();
        loop {
            let map = self.cluster.map();
            let route = match locate(&map) {
                Err(e) if e.code() == ErrorCode::NamespaceNotFound && !refreshed => {
                    refreshed = true;
                    self.cluster.refresh_before(deadline).await?;
                    continue;
                }
                route => route?,
            };
            let shard_id = route.shard.shard_id;
            // The hinted leader, else the next replica in turn that has no
            // attempt of this call running already — one that answered of
            // late before one that did not (a frozen node's new connection
            // hangs until the connect timeout), whatever the turn.
            let candidates = self.cluster.candidates(&route.shard);
            let address = redirect.take().or_else(|| {
                let n = candidates.len();
                let free: Vec<(u64, String)> = (0..n)
                    .map(|i| candidates[(attempt + i) % n])
                    .filter_map(|id| Some((id, Cluster::address(&map, id)?)))
                    .filter(|(_, a)| !pending.at(a))
                    .collect();
                free.iter()
                    .find(|(id, _)| !self.cluster.is_unreachable(*id))
                    .or(free.first())
                    .map(|(_, a)| a.clone())
            });
            let target = address.as_deref().and_then(|a| Cluster::node_at(&map, a));
            let last = match address {
                None if !pending.is_empty() => {
                    // Every replica has an attempt running: wait for them.
                    match self.settle(shard_id, &mut pending, deadline).await {
                        Waited::Answer(value) => return Ok(value),
                        Waited::Failed(error) => error,
                        Waited::Slept => {
                            unreachable!("settle waits until an answer or the deadline")
                        }
                    }
                }
                None => {
                    tokio::time::sleep(
                        backoff(attempt).min(deadline.saturating_duration_since(Instant::now())),
                    )
                    .await;
                    Error::new(
                        ErrorCode::NoQuorum,
                        format!(
                            "shard {} has no replica in the map yet",
                            route.shard.shard_id
                        ),
                    )
                }
                Some(address) => {
                    if let Some(counter) = &self.attempts {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    let channel = self.channel_as_caller(&address)?;
                    let started = Instant::now();
                    let hedge_at = self
                        .hedge_after
                        .map(|h| started + h)
                        .filter(|at| *at < deadline);
                    let mut current = Box::pin(op(channel, map.version, route.shard.shard_id));
                    // The current attempt answers, an earlier one does, or
                    // the hedge delay passes.
                    let answer = loop {
                        tokio::select! {
                            biased;
                            answer = &mut current => break Some(answer),
                            (id, answer) = pending.next() => match answer {
                                Ok(value) => {
                                    if let Some(id) = id {
                                        self.cluster.answered(shard_id, id);
                                    }
                                    return Ok(value);
                                }
                                Err(status) => self.attempt_failed(shard_id, id, &status),
                            },
                            () = tokio::time::sleep_until(hedge_at.unwrap_or(deadline).into()) => break None,
                        }
                    };
                    let status = match answer {
                        Some(Ok(value)) => {
                            if let Some(id) = target {
                                self.cluster.answered(shard_id, id);
                            }
                            return Ok(value);
                        }
                        Some(Err(status)) => status,
                        None if hedge_at.is_some() => {
                            // No answer yet (the node may be frozen, or
                            // slow): the attempt keeps running, and the
                            // call tries the next replica beside it.
                            pending.push(target, address.clone(), current);
                            *uncertain = true;
                            attempt += 1;
                            continue;
                        }
                        None => {
                            return Err(Error::new(
                                ErrorCode::Timeout,
                                format!("no answer from {address} within the deadline"),
                            ));
                        }
                    };
                    let mut disposition = classify(&status);
                    if no_answer(&status)
                        || (matches!(disposition, Disposition::Backoff(_)) && !overloaded(&status))
                    {
                        *uncertain = true;
                    }
                    // The node knows a newer map: routes may have moved
                    // (its hint gets this call there; the map gets the
                    // next ones there without a detour).
                    let node_version =
                        tidepool_proto::error_detail(&status).map_or(0, |d| d.map_version);
                    self.cluster.note_version(node_version);
                    if node_version > map.version
                        && !matches!(disposition, Disposition::Fail(_) | Disposition::Refresh(_))
                    {
                        let _ = self.cluster.catch_up(node_version, deadline).await;
                    }
                    // A node whose map is older than ours has not heard of
                    // a namespace created since: it will.
                    if let Disposition::Fail(error) = &disposition
                        && error.code() == ErrorCode::NamespaceNotFound
                        && tidepool_proto::error_detail(&status)
                            .is_some_and(|d| d.map_version < map.version)
                    {
                        disposition = Disposition::Backoff(Error::new(
                            ErrorCode::NamespaceNotFound,
                            error.to_string(),
                        ));
                    }
                    if !matches!(disposition, Disposition::Fail(_)) {
                        self.attempt_failed(shard_id, target, &status);
                    }
                    // Whether the replicas are electing a leader (or are
                    // about to): then the running attempts are not at a
                    // live leader, and the replicas are asked again at the
                    // election's pace, not the hedge delay's.
                    let mut electing = false;
                    let (error, pause) = match disposition {
                        Disposition::Fail(error) => return Err(error),
                        Disposition::Redirect(error, hinted, id, no_leader) => {
                            electing = no_leader;
                            redirect =
                                hinted.or_else(|| id.and_then(|id| Cluster::address(&map, id)));
                            // Not back to the node that sent us away, nor
                            // to one this call already waits on, nor to
                            // one that failed to answer of late while the
                            // follower no longer hears it either: a
                            // follower names the leader it last heard from
                            // (frozen, cut off) until the others elect a
                            // new one. A leader the follower hears is
                            // alive, whatever this client saw of it before
                            // (a node thawed, a connection re-made).
                            if redirect.as_deref().is_some_and(|a| {
                                a == address
                                    || pending.at(a)
                                    || (no_leader
                                        && Cluster::node_at(&map, a)
                                            .is_some_and(|id| self.cluster.is_unreachable(id)))
                            }) {
                                redirect = None;
                            }
                            // An election is the usual reason: asked again
                            // often enough to find its winner soon.
                            let pause = redirect
                                .is_none()
                                .then(|| backoff(attempt).min(ELECTION_POLL));
                            (error, pause)
                        }
                        Disposition::Refresh(error) => {
                            let _ = self.cluster.refresh_before(deadline).await;
                            (error, Some(backoff(attempt.min(2))))
                        }
                        Disposition::Backoff(error) => {
                            // A node that is overloaded says when to come
                            // back (at most a few seconds is heeded), and
                            // is asked again then: it still leads.
                            let asked = tidepool_proto::error_detail(&status)
                                .map(|d| u64::from(d.retry_after_ms))
                                .map_or(Duration::ZERO, Duration::from_millis)
                                .min(MAX_RETRY_AFTER);
                            if overloaded(&status) {
                                redirect = Some(address.clone());
                            }
                            (error, Some(backoff(attempt).max(asked)))
                        }
                    };
                    if let Some(pause) = pause {
                        // Beside running attempts at a live leader, the
                        // next one starts a hedge delay after this one did
                        // (or as soon as one of them fails).
                        let until = match self.hedge_after {
                            Some(h) if !pending.is_empty() && !electing => started + h.max(pause),
                            _ => Instant::now() + pause,
                        };
                        if let Waited::Answer(value) = self
                            .pause(shard_id, &mut pending, until.min(deadline))
                            .await
                        {
                            return Ok(value);
                        }
                    }
                    error
                }
            };
            attempt += 1;
            if attempt.is_multiple_of(4) {
                let _ = self.cluster.refresh_before(deadline).await;
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorCode::Timeout,
                    format!("gave up after {attempt} attempts; last error: {last}"),
                ));
            }
        }
    }

    /// What an attempt's failure teaches about its node (`id`): one that
    /// did not answer at all is tried last for a while; one that answered
    /// without serving as the shard's leader (not leading, stopping,
    /// overloaded) is not taken for its leader.
    fn attempt_failed(&self, shard_id: u32, id: Option<u64>, status: &Status) {
        let Some(id) = id else { return };
        if no_answer(status) {
            self.cluster.unreachable(id);
        } else if !overloaded(status) {
            self.cluster.not_leader(shard_id, id);
        }
        // An overloaded leader still leads: asked again after the pause it
        // named. (Forgotten, the next attempt went to a follower, whose
        // NOT_LEADER sent it straight back, without a pause.)
    }

    /// Waits until `until`, or less if a running attempt answers first:
    /// its value, or its failure (which ends the wait, so that the call
    /// moves on at once).
    async fn pause<T, Fut>(
        &self,
        shard_id: u32,
        pending: &mut Hedged<Fut>,
        until: Instant,
    ) -> Waited<T>
    where
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        tokio::select! {
            biased;
            (id, answer) = pending.next() => match answer {
                Ok(value) => {
                    if let Some(id) = id {
                        self.cluster.answered(shard_id, id);
                    }
                    Waited::Answer(value)
                }
                Err(status) => {
                    self.attempt_failed(shard_id, id, &status);
                    Waited::Failed(Error::new(
                        ErrorCode::Timeout,
                        format!("an earlier attempt failed: {}", status.message()),
                    ))
                }
            },
            () = tokio::time::sleep_until(until.into()) => Waited::Slept,
        }
    }

    /// Waits on the running attempts alone (every replica has one), until
    /// one answers or `deadline`.
    async fn settle<T, Fut>(
        &self,
        shard_id: u32,
        pending: &mut Hedged<Fut>,
        deadline: Instant,
    ) -> Waited<T>
    where
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        match self.pause(shard_id, pending, deadline).await {
            Waited::Slept => Waited::Failed(Error::new(
                ErrorCode::Timeout,
                "no replica answered within the deadline",
            )),
            other => other,
        }
    }

    /// Runs a write through [`Client::on_shard`] in a write session, so
    /// that however often it is retried it applies once: every attempt
    /// carries the same session number. `op` gets a channel, the map
    /// version and the session to send. `settled`: refusals of this write
    /// that are a true answer whatever an earlier unanswered attempt did
    /// (otherwise such a refusal is reported as an unknown outcome).
    pub(crate) async fn write_once<T, F, Fut>(
        &self,
        namespace: &str,
        key: &[u8],
        settled: &[ErrorCode],
        op: F,
    ) -> Result<T>
    where
        F: FnMut(Channel, u64, WriteSession) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        self.write_once_recorded(namespace, key, settled, op, |_| true)
            .await
    }

    /// [`Client::write_once`] for a write whose answer may say the shard
    /// recorded nothing (`recorded` false: a content-addressed put of a
    /// blob already there is answered without a Raft entry): the shard then
    /// does not know the session, and it is not marked opened there — the
    /// session's next write on that shard opens it instead of meeting
    /// `SESSION_EXPIRED` (one more round, and a final refusal for a write
    /// past the re-open window).
    pub(crate) async fn write_once_recorded<T, F, Fut>(
        &self,
        namespace: &str,
        key: &[u8],
        settled: &[ErrorCode],
        mut op: F,
        recorded: impl Fn(&T) -> bool,
    ) -> Result<T>
    where
        F: FnMut(Channel, u64, WriteSession) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        let mut write = self.sessions.begin();
        let mut reopened = false;
        // One deadline for the call, across a session reopened: routed
        // anew with a fresh one, a write refused near its deadline ran
        // for almost twice the client's timeout.
        let deadline = Instant::now() + self.timeout;
        // An attempt of this write ended without a definite answer: it
        // may have applied.
        let mut uncertain = false;
        loop {
            let mut shard = 0u32;
            let result = self
                .on_route(
                    |map| Cluster::route(map, namespace, key),
                    |channel, map_version, shard_id| {
                        shard = shard_id;
                        op(channel, map_version, write.tag(shard_id))
                    },
                    &mut uncertain,
                    deadline,
                )
                .await;
            match result {
                Ok(value) => {
                    if recorded(&value) {
                        write.opened(shard);
                    }
                    return Ok(value);
                }
                // The shard forgot the session: no attempt of this write
                // applied (see `session.rs`); open it anew, once.
                // (Not past the deadline: sent again then, the attempt
                // would be cut short by it — a definite "not applied" made
                // an unknown outcome.)
                Err(error)
                    if error.code() == ErrorCode::SessionExpired
                        && !reopened
                        && Instant::now() < deadline
                        && write.reopen(shard) =>
                {
                    reopened = true;
                }
                Err(error) if uncertain && refused_before_applying(&error, settled) => {
                    return Err(outcome_unknown(&error));
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Stores one blob of at most the cluster's `max_value_bytes`.
    pub(crate) async fn put_one(
        &self,
        namespace: &str,
        key: &[u8],
        content: &[u8],
        kind: BlobKind,
    ) -> Result<PutOutcome> {
        self.put_hashed(namespace, key, content, kind, sha256(content))
            .await
    }

    /// [`Client::put_one`] of content whose SHA-256 the caller computed
    /// (`digest`; the node checks it against the bytes it receives, so a
    /// wrong one stores nothing: `DIGEST_MISMATCH`).
    pub(crate) async fn put_hashed(
        &self,
        namespace: &str,
        key: &[u8],
        content: &[u8],
        kind: BlobKind,
        digest: [u8; 32],
    ) -> Result<PutOutcome> {
        self.put_hashed_retried(namespace, key, content, kind, digest)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// [`Client::put_hashed`], also saying whether more than one attempt
    /// was sent: then the answer may be a later copy's, found a duplicate
    /// of an earlier one that applied, and `epoch` is the later copy's —
    /// the blob may have been stored in an earlier epoch.
    pub(crate) async fn put_hashed_retried(
        &self,
        namespace: &str,
        key: &[u8],
        content: &[u8],
        kind: BlobKind,
        digest: [u8; 32],
    ) -> Result<(PutOutcome, bool)> {
        let (outcome, replaced, retried) = self
            .put_entry(namespace, key, content, kind, digest, false)
            .await?;
        let chunks = crate::stream::replaced_chunks(key, replaced, None);
        if !chunks.is_empty() {
            // Run apart from the caller, and awaited: a caller gone once
            // the put is answered no longer cuts the deletion short —
            // nothing else names these chunks.
            let (client, namespace, key) = (self.clone(), namespace.to_string(), key.to_vec());
            let deleting = tokio::spawn(
                async move { client.delete_old_chunks(&namespace, &key, chunks).await }
                    .in_current_span(),
            );
            let _ = deleting.await;
        }
        Ok((outcome, retried))
    }

    /// Stores `content` under `key` only if the key holds no blob, decided
    /// where the write applies (in log order with the key's other writes,
    /// so of two racing calls one stores and the other is refused);
    /// otherwise `ALREADY_EXISTS` and nothing is written — except in a
    /// content-addressed namespace, where a key already holding its blob is
    /// the usual success (`already_present`: the same bytes). For blobs of
    /// at most one node entry (`INVALID_ARGUMENT` for larger ones).
    pub async fn put_if_absent(
        &self,
        namespace: &str,
        key: &[u8],
        content: &[u8],
    ) -> Result<PutOutcome> {
        if content.len() > self.chunk_size() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "put_if_absent takes blobs of at most {} bytes",
                    self.chunk_size()
                ),
            ));
        }
        self.put_entry(
            namespace,
            key,
            content,
            BlobKind::Data,
            sha256(content),
            true,
        )
        .await
        .map(|(outcome, _, _)| outcome)
    }

    /// One put of one node entry (`if_absent`: only into an empty key).
    /// Also returns the chunked blob the put replaced, as the node
    /// answered it (`None` if none, or not known: a duplicate attempt, an
    /// older node, a token without the delete role).
    pub(crate) async fn put_entry(
        &self,
        namespace: &str,
        key: &[u8],
        content: &[u8],
        kind: BlobKind,
        digest: [u8; 32],
        if_absent: bool,
    ) -> Result<(PutOutcome, Option<ReplacedChunks>, bool)> {
        // Copied once; every attempt sends the same buffers.
        let pieces: Vec<Bytes> = content
            .chunks(1 << 20)
            .map(Bytes::copy_from_slice)
            .collect();
        let mut attempts = 0u32;
        let response = self
            .write_once_recorded(
                namespace,
                key,
                &[],
                |channel, map_version, session| {
                    attempts += 1;
                    let mut messages = vec![PutRequest {
                        msg: Some(put_request::Msg::Header(PutHeader {
                            blob: blob_ref(namespace, key),
                            size: content.len() as u64,
                            expected_sha256: digest.to_vec(),
                            kind: kind as i32,
                            map_version,
                            session: Some(session),
                            durability: self.durability as i32,
                            if_absent,
                        })),
                    }];
                    messages.extend(pieces.iter().map(|piece| PutRequest {
                        msg: Some(put_request::Msg::Data(piece.clone())),
                    }));
                    async move {
                        BlobServiceClient::new(channel)
                            .put(tokio_stream::iter(messages))
                            .await
                            .map(|r| r.into_inner())
                    }
                },
                |response| !response.already_present,
            )
            .await?;
        let info = response.info.unwrap_or_default();
        let outcome = PutOutcome {
            size: info.size,
            sha256: digest,
            epoch: info.epoch,
            already_present: response.already_present,
        };
        Ok((outcome, response.replaced, attempts > 1))
    }

    /// Reads one stored blob whole: its info and bytes, verified against
    /// the digest stored with it.
    pub(crate) async fn get_one(
        &self,
        namespace: &str,
        key: &[u8],
        consistency: ReadConsistency,
    ) -> Result<(BlobInfo, Vec<u8>)> {
        self.get_sized(namespace, key, consistency, None).await
    }

    /// [`Client::get_one`] of a blob that must be `size` bytes if stored
    /// whole (`read_blob_sized`).
    pub(crate) async fn get_sized(
        &self,
        namespace: &str,
        key: &[u8],
        consistency: ReadConsistency,
        size: Option<u64>,
    ) -> Result<(BlobInfo, Vec<u8>)> {
        let (info, content) = self
            .on_shard(namespace, key, |channel, map_version, _| {
                read_blob_sized(
                    channel,
                    GetRequest {
                        blob: blob_ref(namespace, key),
                        consistency: consistency as i32,
                        map_version,
                        ..GetRequest::default()
                    },
                    self.chunk_size(),
                    size,
                )
            })
            .await?;
        if sha256(&content)[..] != info.sha256[..] || content.len() as u64 != info.size {
            return Err(Error::new(
                ErrorCode::Corrupt,
                format!(
                    "blob {:?} in {namespace:?}: the bytes received do not match the digest stored with them",
                    String::from_utf8_lossy(key)
                ),
            ));
        }
        Ok((info, content))
    }

    /// Stores `content` under `key` (in chunks if it is larger than one
    /// node entry). Overwrites what the key held.
    pub async fn put(&self, namespace: &str, key: &[u8], content: &[u8]) -> Result<PutOutcome> {
        self.put_known(namespace, key, content, None).await
    }

    /// [`Client::put`] of content whose SHA-256 may be known already
    /// (`digest`, computed by this SDK from `content`): a blob that fits
    /// one entry is then not hashed a second time.
    #[tracing::instrument(name = "tidepool.put", level = "info", skip_all, fields(namespace = %namespace, bytes = content.len(), error_code = tracing::field::Empty))]
    async fn put_known(
        &self,
        namespace: &str,
        key: &[u8],
        content: &[u8],
        digest: Option<[u8; 32]>,
    ) -> Result<PutOutcome> {
        let result: Result<PutOutcome> = async {
            let limit = self.chunk_size();
            if content.len() <= limit {
                let digest = digest.unwrap_or_else(|| sha256(content));
                return self
                    .put_hashed(namespace, key, content, BlobKind::Data, digest)
                    .await;
            }
            self.put_stream(namespace, key, content).await
        }
        .await;
        result.traced()
    }

    /// Stores `content` under its SHA-256 and returns the digest (the key).
    /// In a content-addressed namespace the node verifies it. The content
    /// is hashed once, for the key and the put's end-to-end check together.
    pub async fn put_content(&self, namespace: &str, content: &[u8]) -> Result<[u8; 32]> {
        let digest = sha256(content);
        self.put_known(namespace, &digest, content, Some(digest))
            .await?;
        Ok(digest)
    }

    /// Reads a blob whole (reassembling a chunked one). The content is
    /// verified: against the digest stored with it, and in a
    /// content-addressed namespace against the key; a replica that returns
    /// bad bytes is not believed (`CORRUPT`, or the bytes of a healthy
    /// replica for content-addressed blobs).
    #[tracing::instrument(name = "tidepool.get", level = "info", skip_all, fields(namespace = %namespace, error_code = tracing::field::Empty))]
    pub async fn get(&self, namespace: &str, key: &[u8]) -> Result<Vec<u8>> {
        let result: Result<Vec<u8>> = async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let mut reader = self.open_range(namespace, key, 0, None).await?;
                if let Some(content) = reader.take_plain() {
                    return Ok(content);
                }
                // The size comes from a node: reserve no more than a few
                // chunks.
                let mut out = Vec::with_capacity(reader.size().min(64 << 20) as usize);
                let read = async {
                    while let Some(piece) = reader.next_piece().await? {
                        out.extend_from_slice(&piece);
                    }
                    Ok::<(), Error>(())
                };
                match read.await {
                    Ok(()) => return Ok(out),
                    // Replaced while read: nothing was returned yet, so
                    // read the new one (a blob replaced on every read
                    // fails after a few tries).
                    Err(error) if error.code() == ErrorCode::Conflict && attempt < 3 => {}
                    Err(error) => return Err(error),
                }
            }
        }
        .await;
        result.traced()
    }

    /// Size, digest and epoch of a blob.
    #[tracing::instrument(name = "tidepool.head", level = "info", skip_all, fields(namespace = %namespace, error_code = tracing::field::Empty))]
    pub async fn head(&self, namespace: &str, key: &[u8]) -> Result<BlobMeta> {
        let result: Result<BlobMeta> = async {
            // A chunked blob replaced by a plain one, or deleted, between
            // its head and its manifest's read is looked at again (it
            // answered INTERNAL, "not chunked").
            let mut tries = 0;
            loop {
                tries += 1;
                let info = self.head_info(namespace, key).await?;
                if info.kind == BlobKind::Manifest as i32 {
                    let Some(manifest) = self.manifest_if_chunked(namespace, key).await? else {
                        if tries < 3 {
                            continue;
                        }
                        return Err(Error::new(
                            ErrorCode::Conflict,
                            "the blob changed while it was looked at: look again",
                        ));
                    };
                    return Ok(BlobMeta {
                        size: manifest.size,
                        sha256: digest_of(&manifest.sha256)?,
                        epoch: info.epoch,
                        chunked: true,
                    });
                }
                return Ok(BlobMeta {
                    size: info.size,
                    sha256: digest_of(&info.sha256)?,
                    epoch: info.epoch,
                    chunked: false,
                });
            }
        }
        .await;
        result.traced()
    }

    /// The stored blob's own info (a manifest's, for a chunked blob).
    pub(crate) async fn head_info(&self, namespace: &str, key: &[u8]) -> Result<BlobInfo> {
        self.head_info_checked(namespace, key, true).await
    }

    /// [`Client::head_info`]; `checked` false reads the header alone even
    /// where the value fails its checksum (`HeadRequest.unchecked`): a
    /// digest to compare other copies with, never trusted alone.
    pub(crate) async fn head_info_checked(
        &self,
        namespace: &str,
        key: &[u8],
        checked: bool,
    ) -> Result<BlobInfo> {
        self.on_shard(namespace, key, |channel, map_version, _| async move {
            BlobServiceClient::new(channel)
                .head(HeadRequest {
                    blob: blob_ref(namespace, key),
                    map_version,
                    unchecked: !checked,
                    ..HeadRequest::default()
                })
                .await
                .map(|r| r.into_inner().info.unwrap_or_default())
        })
        .await
    }

    /// Whether a blob exists.
    pub async fn exists(&self, namespace: &str, key: &[u8]) -> Result<bool> {
        Ok(self.batch_exists(namespace, &[key.to_vec()]).await?[0])
    }

    /// For each key, whether it exists: one call per shard, answered by the
    /// shard's leader (so the answer is exact, not a replica's guess).
    #[tracing::instrument(name = "tidepool.batch_exists", level = "info", skip_all, fields(namespace = %namespace, keys = keys.len(), error_code = tracing::field::Empty))]
    pub async fn batch_exists(&self, namespace: &str, keys: &[Vec<u8>]) -> Result<Vec<bool>> {
        let result: Result<Vec<bool>> =
            async { self.batch_exists_touch(namespace, keys, false).await }.await;
        result.traced()
    }

    /// Like [`Client::batch_exists`], and moves every present blob it names
    /// into the current epoch (what build caches expect of "find
    /// missing"). The keys are the blobs' own: a chunked blob (stored above
    /// `max_value_bytes`) is named by its manifest, and only the manifest
    /// moves — its chunks keep their epoch, and an epoch drop takes them.
    /// [`Client::touch`] moves a chunked blob whole; the gateway's
    /// `FindMissingBlobs` does so for blobs whose size says they are
    /// chunked.
    #[tracing::instrument(name = "tidepool.find_missing", level = "info", skip_all, fields(namespace = %namespace, keys = keys.len(), error_code = tracing::field::Empty))]
    pub async fn find_missing(&self, namespace: &str, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>> {
        let result: Result<Vec<Vec<u8>>> = async {
            let present = self.batch_exists_touch(namespace, keys, true).await?;
            Ok(keys
                .iter()
                .zip(present)
                .filter(|(_, p)| !p)
                .map(|(k, _)| k.clone())
                .collect())
        }
        .await;
        result.traced()
    }

    async fn batch_exists_touch(
        &self,
        namespace: &str,
        keys: &[Vec<u8>],
        touch: bool,
    ) -> Result<Vec<bool>> {
        let mut answers: Vec<Option<bool>> = vec![None; keys.len()];
        let deadline = Instant::now() + self.timeout;
        let mut rounds = 0;
        while answers.iter().any(Option::is_none) {
            // Group the unanswered keys by shard under the current map.
            let mut map = self.cluster.map();
            let mut refreshed = false;
            let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for (i, key) in keys.iter().enumerate() {
                if answers[i].is_none() {
                    // A namespace newer than the map: one refresh, and
                    // every key routed by the fresh map (each key of a
                    // large batch refreshed on its own).
                    let route = match Cluster::route(&map, namespace, key) {
                        Err(e) if e.code() == ErrorCode::NamespaceNotFound && !refreshed => {
                            refreshed = true;
                            map = self.cluster.refresh_before(deadline).await?;
                            Cluster::route(&map, namespace, key)?
                        }
                        route => route?,
                    };
                    groups.entry(route.shard.shard_id).or_default().push(i);
                }
            }
            // At most BATCH_EXISTS_KEYS keys per request (nodes take up to
            // 100,000; smaller requests keep messages and waits short), and
            // at most BATCH_EXISTS_BYTES of them (long keys); the shards are
            // asked at once.
            let mut calls = tokio::task::JoinSet::new();
            for indexes in groups.values().flat_map(|g| exists_batches(keys, g)) {
                let group: Vec<Vec<u8>> = indexes.iter().map(|i| keys[*i].clone()).collect();
                let (client, namespace, indexes) =
                    (self.clone(), namespace.to_string(), indexes.to_vec());
                calls.spawn(async move {
                    let presence = client.batch_exists_group(&namespace, group, touch).await;
                    (indexes, presence)
                });
            }
            while let Some(done) = calls.join_next().await {
                let (indexes, presence) = done.map_err(|e| {
                    Error::new(ErrorCode::Internal, format!("a batch check failed: {e}"))
                })?;
                for (i, p) in indexes.iter().zip(presence?) {
                    if p == Presence::Present as i32 {
                        answers[*i] = Some(true);
                    } else if p == Presence::Absent as i32 {
                        answers[*i] = Some(false);
                    }
                }
            }
            if answers.iter().any(Option::is_none) {
                // Some keys belong elsewhere now: the map moved on.
                if Instant::now() >= deadline {
                    return Err(Error::new(
                        ErrorCode::Timeout,
                        "keys kept moving between shards until the deadline",
                    ));
                }
                tokio::time::sleep(backoff(rounds)).await;
                rounds += 1;
                self.cluster.refresh_before(deadline).await?;
            }
        }
        Ok(answers.into_iter().map(|a| a.unwrap_or(false)).collect())
    }

    /// One `BatchExists` call for keys of one shard (under the current
    /// map): each key's presence, `NOT_HERE` for keys the node did not
    /// answer for.
    async fn batch_exists_group(
        &self,
        namespace: &str,
        group: Vec<Vec<u8>>,
        touch: bool,
    ) -> Result<Vec<i32>> {
        self.on_shard(namespace, &group[0], |channel, map_version, _| {
            let request = BatchExistsRequest {
                namespace: namespace.to_string(),
                keys: group.clone(),
                touch,
                map_version,
                ..BatchExistsRequest::default()
            };
            async move {
                let presence = BlobServiceClient::new(channel)
                    .batch_exists(request)
                    .await?
                    .into_inner()
                    .presence;
                // A node that answers for none of the shard's keys does not
                // lead it (it answers OK, with NOT_HERE): treated as
                // NOT_LEADER, so another replica is tried (after a pause)
                // and this one is not remembered as the leader.
                if !presence.is_empty() && presence.iter().all(|p| *p == Presence::NotHere as i32) {
                    return Err(tidepool_proto::status_with_detail(
                        tidepool_proto::v1::ErrorDetail {
                            code: ErrorCode::NotLeader as i32,
                            message: "the node cannot answer for this shard".into(),
                            ..Default::default()
                        },
                    ));
                }
                Ok(presence)
            }
        })
        .await
    }

    /// Deletes a blob (and the chunks of a chunked one, outside
    /// content-addressed namespaces, where chunks may be shared). Returns
    /// whether it existed.
    #[tracing::instrument(name = "tidepool.delete", level = "info", skip_all, fields(namespace = %namespace, error_code = tracing::field::Empty))]
    pub async fn delete(&self, namespace: &str, key: &[u8]) -> Result<bool> {
        let result: Result<bool> = async {
            // Read first for a node that does not say what its delete
            // removed (an older version): the chunks of the blob stored
            // now. The node's answer names what the delete did remove,
            // where it applied: a blob put between this read and the
            // delete was otherwise deleted without its chunks.
            let read = match self.manifest_if_chunked(namespace, key).await? {
                Some(manifest) if !self.content_addressed(namespace).await? => {
                    crate::stream::own_chunks(key, &manifest)
                }
                _ => Vec::new(),
            };
            // Run apart from the caller, and awaited: a caller gone once
            // the manifest's delete is sent (a gateway client
            // disconnecting) no longer leaves the chunks behind — nothing
            // else names them.
            let (client, namespace, key) = (self.clone(), namespace.to_string(), key.to_vec());
            let deleting = tokio::spawn(
                async move {
                    let (existed, removed) = client.delete_one_replaced(&namespace, &key).await?;
                    let mut chunks = read;
                    for chunk in crate::stream::replaced_chunks(&key, removed, None) {
                        if !chunks.contains(&chunk) {
                            chunks.push(chunk);
                        }
                    }
                    // The blob is gone with its manifest: a chunk that
                    // cannot be deleted now is the caller's problem no
                    // more (an error here would report a done delete as
                    // failed, and a retry would find no manifest left to
                    // name the chunks). Logged, and left.
                    if !chunks.is_empty() {
                        client.delete_old_chunks(&namespace, &key, chunks).await;
                    }
                    Ok::<_, Error>(existed)
                }
                .in_current_span(),
            );
            deleting
                .await
                .map_err(|e| Error::new(ErrorCode::Internal, format!("the delete failed: {e}")))?
        }
        .await;
        result.traced()
    }

    pub(crate) async fn delete_one(&self, namespace: &str, key: &[u8]) -> Result<bool> {
        self.delete_one_replaced(namespace, key)
            .await
            .map(|(existed, _)| existed)
    }

    /// [`Client::delete_one`], also returning the chunked blob the delete
    /// removed, as the node answered it (`None` if none, or not known: a
    /// duplicate attempt, an older node).
    pub(crate) async fn delete_one_replaced(
        &self,
        namespace: &str,
        key: &[u8],
    ) -> Result<(bool, Option<ReplacedChunks>)> {
        self.write_once(
            namespace,
            key,
            &[],
            |channel, map_version, session| async move {
                BlobServiceClient::new(channel)
                    .delete(DeleteRequest {
                        blob: blob_ref(namespace, key),
                        map_version,
                        session: Some(session),
                        durability: self.durability as i32,
                    })
                    .await
                    .map(|r| {
                        let response = r.into_inner();
                        (response.existed, response.replaced)
                    })
            },
        )
        .await
    }

    /// Moves a blob (and its chunks) into the current epoch. Returns the
    /// epoch; `NOT_FOUND` if it does not exist.
    #[tracing::instrument(name = "tidepool.touch", level = "info", skip_all, fields(namespace = %namespace, error_code = tracing::field::Empty))]
    pub async fn touch(&self, namespace: &str, key: &[u8]) -> Result<u64> {
        let result: Result<u64> = async {
            let epoch = self.touch_one(namespace, key).await?;
            if let Some(manifest) = self.manifest_if_chunked(namespace, key).await? {
                for chunk in manifest.chunks {
                    self.touch_one(namespace, &chunk.key).await?;
                }
            }
            Ok(epoch)
        }
        .await;
        result.traced()
    }

    pub(crate) async fn touch_one(&self, namespace: &str, key: &[u8]) -> Result<u64> {
        // A touch that finds nothing is a true answer after any earlier
        // attempt: nothing is there to touch now.
        // A blob already in the current epoch is answered without a log
        // entry (`recorded` false): the shard then did not learn the
        // session, which stays unopened there.
        self.write_once_recorded(
            namespace,
            key,
            &[ErrorCode::NotFound],
            |channel, map_version, session| async move {
                BlobServiceClient::new(channel)
                    .touch(TouchRequest {
                        blob: blob_ref(namespace, key),
                        map_version,
                        session: Some(session),
                    })
                    .await
                    .map(|r| r.into_inner())
            },
            |answer: &TouchResponse| answer.recorded,
        )
        .await
        .map(|answer| answer.epoch)
    }

    pub(crate) async fn content_addressed(&self, namespace: &str) -> Result<bool> {
        let map = self.cluster.map();
        let ns = match Cluster::namespace(&map, namespace) {
            Ok(ns) => ns,
            Err(_) => {
                let deadline = Instant::now() + self.timeout;
                Cluster::namespace(&*self.cluster.refresh_before(deadline).await?, namespace)?
            }
        };
        Ok(ns.content_addressed)
    }

    /// Largest chunk: the cluster's value limit. Blobs larger than this
    /// are stored chunked (a manifest and its chunks).
    pub fn chunk_size(&self) -> usize {
        let limit = self.cluster.map().max_value_bytes;
        if limit == 0 { 4 << 20 } else { limit as usize }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10,000 keys of 1 KiB (the key limit) are over a node's 8 MiB
    /// request limit in one request: the batches stay under half of it.
    #[test]
    fn existence_batches_are_bounded_by_keys_and_bytes() {
        let long: Vec<Vec<u8>> = (0..10_000u32).map(|i| vec![i as u8; 1024]).collect();
        let all: Vec<usize> = (0..long.len()).collect();
        let batches = exists_batches(&long, &all);
        assert!(batches.len() >= 3, "{} batches", batches.len());
        for batch in &batches {
            let bytes: usize = batch.iter().map(|i| long[*i].len() + 8).sum();
            assert!(bytes <= BATCH_EXISTS_BYTES, "{bytes}");
        }
        assert_eq!(batches.concat(), all, "every key once, in order");
        let short: Vec<Vec<u8>> = (0..25_000u32).map(|i| i.to_be_bytes().to_vec()).collect();
        let all: Vec<usize> = (0..short.len()).collect();
        let sizes: Vec<usize> = exists_batches(&short, &all)
            .iter()
            .map(|b| b.len())
            .collect();
        assert_eq!(sizes, [10_000, 10_000, 5_000]);
        assert!(exists_batches(&short, &[]).is_empty());
    }

    use tidepool_proto::v1::blob_service_server::{BlobService, BlobServiceServer};
    use tidepool_proto::v1::{
        BatchExistsResponse, DeleteRequest as Del, DeleteResponse, GetResponse, HeadResponse,
        PutResponse,
    };
    use tonic::{Request, Response, Streaming};

    /// A node that lies about sizes: it announces `announced` bytes and
    /// sends `sent`.
    struct Liar {
        announced: u64,
        sent: usize,
        kind: BlobKind,
    }

    type GetStream =
        tokio_stream::Iter<std::vec::IntoIter<std::result::Result<GetResponse, Status>>>;

    #[tonic::async_trait]
    impl BlobService for Liar {
        async fn put(
            &self,
            _: Request<Streaming<PutRequest>>,
        ) -> std::result::Result<Response<PutResponse>, Status> {
            Err(Status::unimplemented("put"))
        }
        type GetStream = GetStream;
        async fn get(
            &self,
            _: Request<GetRequest>,
        ) -> std::result::Result<Response<GetStream>, Status> {
            let info = GetResponse {
                msg: Some(get_response::Msg::Info(BlobInfo {
                    size: self.announced,
                    kind: self.kind as i32,
                    ..BlobInfo::default()
                })),
            };
            let data = GetResponse {
                msg: Some(get_response::Msg::Data(vec![7; self.sent].into())),
            };
            Ok(Response::new(tokio_stream::iter(vec![Ok(info), Ok(data)])))
        }
        async fn head(
            &self,
            _: Request<HeadRequest>,
        ) -> std::result::Result<Response<HeadResponse>, Status> {
            Err(Status::unimplemented("head"))
        }
        async fn batch_exists(
            &self,
            _: Request<BatchExistsRequest>,
        ) -> std::result::Result<Response<BatchExistsResponse>, Status> {
            Err(Status::unimplemented("batch_exists"))
        }
        async fn delete(
            &self,
            _: Request<Del>,
        ) -> std::result::Result<Response<DeleteResponse>, Status> {
            Err(Status::unimplemented("delete"))
        }
        async fn touch(
            &self,
            _: Request<TouchRequest>,
        ) -> std::result::Result<Response<TouchResponse>, Status> {
            Err(Status::unimplemented("touch"))
        }
        async fn list(
            &self,
            _: Request<tidepool_proto::v1::ListRequest>,
        ) -> std::result::Result<Response<tidepool_proto::v1::ListResponse>, Status> {
            Err(Status::unimplemented("list"))
        }
    }

    /// Reads from a `Liar` on a real socket.
    async fn read_from(
        liar: Liar,
        limit: usize,
    ) -> std::result::Result<(BlobInfo, Vec<u8>), Status> {
        read_sized_from(liar, limit, None).await
    }

    async fn read_sized_from(
        liar: Liar,
        limit: usize,
        size: Option<u64>,
    ) -> std::result::Result<(BlobInfo, Vec<u8>), Status> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(BlobServiceServer::new(liar))
                .serve_with_incoming(incoming),
        );
        let security = tidepool_security::Security::insecure();
        let endpoint = security.endpoint(&format!("http://{address}")).unwrap();
        let channel = security.connect(&endpoint).await.unwrap();
        read_blob_sized(channel, GetRequest::default(), limit, size).await
    }

    fn code_of(status: &Status) -> ErrorCode {
        tidepool_proto::error_detail(status)
            .map(|d| d.code())
            .unwrap_or(ErrorCode::Unspecified)
    }

    #[tokio::test]
    async fn a_node_cannot_make_the_sdk_allocate_what_it_announces() {
        // 2^62 bytes announced: refused before any allocation (reserving it
        // would abort the process).
        let status = read_from(
            Liar {
                announced: 1 << 62,
                sent: 10,
                kind: BlobKind::Data,
            },
            4 << 20,
        )
        .await
        .unwrap_err();
        assert_eq!(code_of(&status), ErrorCode::Corrupt, "{status:?}");
        // More bytes than announced: refused.
        let status = read_from(
            Liar {
                announced: 10,
                sent: 11,
                kind: BlobKind::Data,
            },
            4 << 20,
        )
        .await
        .unwrap_err();
        assert_eq!(code_of(&status), ErrorCode::Corrupt, "{status:?}");
        // And an honest reply reads.
        let (info, bytes) = read_from(
            Liar {
                announced: 10,
                sent: 10,
                kind: BlobKind::Data,
            },
            4 << 20,
        )
        .await
        .unwrap();
        assert_eq!((info.size, bytes.len()), (10, 10));
    }

    /// A read naming the size it wants ends at the info message when a
    /// blob stored whole has another size: the bytes after it are never
    /// read (here ones a read would refuse, more than announced: the
    /// answer is `NOT_FOUND`, not `CORRUPT`). A manifest's own size is not
    /// its blob's: read on.
    #[tokio::test]
    async fn a_sized_read_ends_at_an_info_of_another_size() {
        let liar = |kind| Liar {
            announced: 10,
            sent: 11,
            kind,
        };
        let status = read_sized_from(liar(BlobKind::Data), 4 << 20, Some(9))
            .await
            .unwrap_err();
        assert_eq!(code_of(&status), ErrorCode::NotFound, "{status:?}");
        let status = read_sized_from(liar(BlobKind::Manifest), 4 << 20, Some(9))
            .await
            .unwrap_err();
        assert_eq!(code_of(&status), ErrorCode::Corrupt, "{status:?}");
        let honest = Liar {
            announced: 10,
            sent: 10,
            kind: BlobKind::Data,
        };
        let (info, bytes) = read_sized_from(honest, 4 << 20, Some(10)).await.unwrap();
        assert_eq!((info.size, bytes.len()), (10, 10));
    }

    /// How a scripted replica answers `Head`, by time since the test began.
    #[derive(Clone, Copy)]
    enum Rule {
        /// Leads: answers (its id as the size) after `delay`.
        Lead { delay: Duration },
        /// Leads, but answers `OVERLOADED` (come back after `retry_after`)
        /// until `until`.
        Overloaded {
            until: Duration,
            retry_after: Duration,
        },
        /// Names `before` as the leader until `switch`, then `after`; a
        /// replica naming itself leads from then on. `silent`: says it has
        /// not heard from `before` for a while (`leader_silent_ms`).
        Follow {
            before: u64,
            after: u64,
            switch: Duration,
            silent: bool,
        },
    }

    #[derive(Clone)]
    struct Scripted {
        id: u64,
        rule: Rule,
        began: Instant,
        calls: Arc<AtomicU64>,
        addresses: Arc<parking_lot::Mutex<BTreeMap<u64, String>>>,
    }

    #[tonic::async_trait]
    impl BlobService for Scripted {
        async fn put(
            &self,
            _: Request<Streaming<PutRequest>>,
        ) -> std::result::Result<Response<PutResponse>, Status> {
            Err(Status::unimplemented("put"))
        }
        type GetStream = GetStream;
        async fn get(
            &self,
            _: Request<GetRequest>,
        ) -> std::result::Result<Response<GetStream>, Status> {
            Err(Status::unimplemented("get"))
        }
        async fn head(
            &self,
            _: Request<HeadRequest>,
        ) -> std::result::Result<Response<HeadResponse>, Status> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let (leader, silent) = match self.rule {
                Rule::Lead { delay } => {
                    tokio::time::sleep(delay).await;
                    (self.id, false)
                }
                Rule::Overloaded { until, retry_after } => {
                    if self.began.elapsed() < until {
                        return Err(tidepool_proto::status_with_detail(
                            tidepool_proto::v1::ErrorDetail {
                                code: ErrorCode::Overloaded as i32,
                                message: "too many requests in flight".into(),
                                retry_after_ms: retry_after.as_millis() as u32,
                                ..tidepool_proto::v1::ErrorDetail::default()
                            },
                        ));
                    }
                    (self.id, false)
                }
                Rule::Follow {
                    before,
                    after,
                    switch,
                    silent,
                } => {
                    if self.began.elapsed() < switch {
                        (before, silent)
                    } else {
                        (after, false)
                    }
                }
            };
            if leader == self.id {
                return Ok(Response::new(HeadResponse {
                    info: Some(BlobInfo {
                        size: self.id,
                        ..BlobInfo::default()
                    }),
                }));
            }
            let address = self.addresses.lock()[&leader].clone();
            Err(tidepool_proto::status_with_detail(
                tidepool_proto::v1::ErrorDetail {
                    code: ErrorCode::NotLeader as i32,
                    message: format!("node {leader} leads"),
                    map_version: 1,
                    leader_hint: Some(tidepool_proto::v1::NodeAddress {
                        node_id: leader,
                        address,
                    }),
                    leader_silent_ms: silent.then_some(600),
                    ..tidepool_proto::v1::ErrorDetail::default()
                },
            ))
        }
        async fn batch_exists(
            &self,
            _: Request<BatchExistsRequest>,
        ) -> std::result::Result<Response<BatchExistsResponse>, Status> {
            Err(Status::unimplemented("batch_exists"))
        }
        async fn delete(
            &self,
            _: Request<Del>,
        ) -> std::result::Result<Response<DeleteResponse>, Status> {
            Err(Status::unimplemented("delete"))
        }
        async fn touch(
            &self,
            _: Request<TouchRequest>,
        ) -> std::result::Result<Response<TouchResponse>, Status> {
            Err(Status::unimplemented("touch"))
        }
        async fn list(
            &self,
            _: Request<tidepool_proto::v1::ListRequest>,
        ) -> std::result::Result<Response<tidepool_proto::v1::ListResponse>, Status> {
            Err(Status::unimplemented("list"))
        }
    }

    /// Three replicas of one shard on real sockets, node 1 the map's
    /// leader hint: `None` is a frozen process (its socket accepts
    /// connections and never answers), else the rule. Returns a client
    /// with hedge delay `hedge` and each replica's count of calls.
    async fn three_replicas(
        rules: [Option<Rule>; 3],
        hedge: Option<Duration>,
    ) -> (Client, Vec<Arc<AtomicU64>>) {
        let began = Instant::now();
        let addresses = Arc::new(parking_lot::Mutex::new(BTreeMap::new()));
        let mut calls = Vec::new();
        let mut nodes = Vec::new();
        for (i, rule) in rules.into_iter().enumerate() {
            let id = i as u64 + 1;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = format!("http://{}", listener.local_addr().unwrap());
            addresses.lock().insert(id, address.clone());
            nodes.push(tidepool_proto::v1::NodeInfo {
                node_id: id,
                address,
                ..Default::default()
            });
            let count = Arc::new(AtomicU64::new(0));
            calls.push(count.clone());
            match rule {
                None => {
                    // Frozen: connections are accepted (by the kernel)
                    // and held, never read.
                    tokio::spawn(async move {
                        let mut held = Vec::new();
                        while let Ok((socket, _)) = listener.accept().await {
                            count.fetch_add(1, Ordering::SeqCst);
                            held.push(socket);
                        }
                    });
                }
                Some(rule) => {
                    let service = Scripted {
                        id,
                        rule,
                        began,
                        calls: count,
                        addresses: addresses.clone(),
                    };
                    tokio::spawn(
                        tonic::transport::Server::builder()
                            .add_service(BlobServiceServer::new(service))
                            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
                                listener,
                            )),
                    );
                }
            }
        }
        let cluster = Cluster::new(
            Vec::new(),
            Duration::from_secs(3),
            tidepool_security::Security::insecure(),
        );
        cluster.install(ClusterMap {
            version: 1,
            nodes,
            namespaces: vec![tidepool_proto::v1::Namespace {
                name: "ns".into(),
                id: 1,
                ..Default::default()
            }],
            shards: vec![tidepool_proto::v1::ShardInfo {
                shard_id: 1,
                hash_start: 0,
                hash_end: u64::MAX,
                leader_hint: 1,
                replicas: (1..=3)
                    .map(|node_id| tidepool_proto::v1::ReplicaInfo {
                        node_id,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        });
        let client = Client {
            cluster,
            timeout: Duration::from_secs(10),
            hedge_after: hedge,
            sessions: Arc::default(),
            attempts: None,
            caller_token: None,
            durability: Durability::Default,
            upload_memory: None,
            read_memory: None,
        };
        (client, calls)
    }

    /// The id of the node that answered a `Head`, with how long it took.
    async fn head_answered_by(client: &Client) -> (Result<u64>, Duration) {
        let began = Instant::now();
        let answer = client
            .on_shard("ns", b"k", |channel, _, _| async move {
                let mut blobs = BlobServiceClient::new(channel);
                let response = blobs.head(HeadRequest::default()).await?;
                Ok(response.into_inner().info.map_or(0, |i| i.size))
            })
            .await;
        (answer, began.elapsed())
    }

    /// An overloaded leader says when to come back: it is asked again then,
    /// and the followers are not asked meanwhile. Before, the SDK came
    /// back after 20 ms, forgot the leader, asked a follower, and the
    /// follower's hint sent it straight back to the overloaded node.
    #[tokio::test]
    async fn an_overloaded_leader_is_asked_again_when_it_says() {
        let overloaded = Rule::Overloaded {
            until: Duration::from_millis(250),
            retry_after: Duration::from_millis(300),
        };
        let follow = Rule::Follow {
            before: 1,
            after: 1,
            switch: Duration::ZERO,
            silent: false,
        };
        let (client, calls) =
            three_replicas([Some(overloaded), Some(follow), Some(follow)], None).await;
        let (answer, took) = head_answered_by(&client).await;
        assert_eq!(answer.unwrap(), 1);
        let calls: Vec<u64> = calls.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        assert_eq!(calls, [2, 0, 0], "took {took:?}");
        assert!(took >= Duration::from_millis(300), "took {took:?}");
    }

    #[tokio::test]
    async fn a_frozen_leader_is_hedged_around_before_its_connection_fails() {
        // Node 1 is frozen; nodes 2 and 3 name it until, 300 ms in, they
        // elect node 3. The connection to node 1 would be given up by its
        // pings after 1.5 s; with hedged attempts the call gets to node 3
        // soon after the election.
        let election = Rule::Follow {
            before: 1,
            after: 3,
            switch: Duration::from_millis(300),
            silent: false,
        };
        let (client, calls) = three_replicas(
            [None, Some(election), Some(election)],
            Some(Duration::from_millis(100)),
        )
        .await;
        let (answer, took) = head_answered_by(&client).await;
        assert_eq!(answer.unwrap(), 3, "the new leader answered");
        assert!(took < Duration::from_millis(1200), "took {took:?}");
        assert_eq!(
            calls[0].load(Ordering::SeqCst),
            1,
            "one connection to the frozen node"
        );
        // Without hedging the same call waits for the pings.
        let (client, _) = three_replicas([None, Some(election), Some(election)], None).await;
        let (answer, took) = head_answered_by(&client).await;
        assert_eq!(answer.unwrap(), 3);
        assert!(took >= Duration::from_millis(1000), "took {took:?}");
    }

    #[tokio::test]
    async fn a_slow_leader_gets_one_attempt_and_followers_a_probe_per_delay() {
        // Node 1 leads and takes 800 ms; the followers name it. A hedge
        // delay of 200 ms asks a follower about every 200 ms, never node 1
        // twice, and node 1's answer is the call's.
        let follow = Rule::Follow {
            before: 1,
            after: 1,
            switch: Duration::ZERO,
            silent: false,
        };
        let (client, calls) = three_replicas(
            [
                Some(Rule::Lead {
                    delay: Duration::from_millis(800),
                }),
                Some(follow),
                Some(follow),
            ],
            Some(Duration::from_millis(200)),
        )
        .await;
        let (answer, took) = head_answered_by(&client).await;
        assert_eq!(answer.unwrap(), 1);
        assert!(took >= Duration::from_millis(800), "took {took:?}");
        assert_eq!(calls[0].load(Ordering::SeqCst), 1, "node 1 asked once");
        let probes = calls[1].load(Ordering::SeqCst) + calls[2].load(Ordering::SeqCst);
        assert!(
            (1..=4).contains(&probes),
            "{probes} follower probes in 800 ms at one per 200 ms"
        );
    }

    #[tokio::test]
    async fn followers_that_no_longer_hear_the_leader_are_asked_at_the_elections_pace() {
        // Node 1 is frozen; nodes 2 and 3 name it until, 1.1 s in, they
        // elect node 3. When they say they have not heard from node 1 for
        // a while, the call asks them again every election poll (160 ms at
        // most) once its first hedge (500 ms) ran, and reaches node 3 soon
        // after the election; when they do not say so (a slow leader, for
        // all the call knows), it asks once per hedge delay and meets the
        // new leader at the 1.5 s hedge at best.
        let mut took_by_silence = Vec::new();
        for silent in [true, false] {
            let election = Rule::Follow {
                before: 1,
                after: 3,
                switch: Duration::from_millis(1100),
                silent,
            };
            let (client, _) = three_replicas(
                [None, Some(election), Some(election)],
                Some(Duration::from_millis(500)),
            )
            .await;
            let (answer, took) = head_answered_by(&client).await;
            assert_eq!(answer.unwrap(), 3, "the new leader answered");
            took_by_silence.push(took);
        }
        let (silent, heard) = (took_by_silence[0], took_by_silence[1]);
        eprintln!("new leader reached after {silent:?} with silence reported, {heard:?} without");
        assert!(
            silent < Duration::from_millis(1400),
            "after the election at 1.1 s, with silence reported: {silent:?}"
        );
        assert!(
            heard >= Duration::from_millis(1400),
            "paced by the hedge delay without it: {heard:?}"
        );
    }

    #[tokio::test]
    async fn a_node_that_stopped_answering_is_not_dialled_again_while_others_answer() {
        // Node 1 is frozen and the others elect node 3 only 2.5 s in. The
        // pings give up on node 1's connection at about 1.5 s; from then
        // the call keeps asking the followers (they no longer hear node 1)
        // and never opens a new connection to node 1, which would hang
        // until the connect timeout whenever its turn came.
        let election = Rule::Follow {
            before: 1,
            after: 3,
            switch: Duration::from_millis(2500),
            silent: true,
        };
        let (client, calls) = three_replicas(
            [None, Some(election), Some(election)],
            Some(Duration::from_millis(500)),
        )
        .await;
        let (answer, took) = head_answered_by(&client).await;
        assert_eq!(answer.unwrap(), 3, "the new leader answered");
        assert_eq!(
            calls[0].load(Ordering::SeqCst),
            1,
            "one connection to the frozen node"
        );
        let probes = calls[1].load(Ordering::SeqCst) + calls[2].load(Ordering::SeqCst);
        eprintln!("answered after {took:?}, {probes} follower attempts");
        assert!(
            took < Duration::from_millis(2800),
            "answered {took:?} after the start, the election at 2.5 s"
        );
    }

    #[tokio::test]
    async fn a_leader_its_followers_hear_is_followed_though_it_failed_this_client_before() {
        // Node 3 leads; the client marked it unreachable (it was frozen a
        // moment ago, say, and has been thawed). Its followers hear it and
        // name it: the call follows them at once instead of avoiding node 3
        // until the mark expires (5 s).
        let follow = Rule::Follow {
            before: 3,
            after: 3,
            switch: Duration::ZERO,
            silent: false,
        };
        let (client, calls) = three_replicas(
            [
                Some(follow),
                Some(follow),
                Some(Rule::Lead {
                    delay: Duration::ZERO,
                }),
            ],
            Some(Duration::from_millis(500)),
        )
        .await;
        client.cluster.unreachable(3);
        let (answer, took) = head_answered_by(&client).await;
        assert_eq!(answer.unwrap(), 3);
        assert!(took < Duration::from_secs(1), "took {took:?}");
        assert_eq!(calls[2].load(Ordering::SeqCst), 1, "node 3 asked once");
    }

    fn refusal(code: ErrorCode) -> Status {
        tidepool_proto::status_with_detail(tidepool_proto::v1::ErrorDetail {
            code: code as i32,
            message: format!("scripted {}", code.as_str_name()),
            map_version: 1,
            ..Default::default()
        })
    }

    /// A write answered without the shard recording anything (a
    /// content-addressed put of a blob already there) leaves the session
    /// unopened on that shard: the session's next write there opens it,
    /// and the one after does not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_that_recorded_nothing_leaves_the_session_unopened() {
        let follow = Rule::Follow {
            before: 1,
            after: 1,
            switch: Duration::ZERO,
            silent: false,
        };
        let (client, _) = three_replicas([Some(follow); 3], None).await;
        let opens = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let write = |opens: Arc<parking_lot::Mutex<Vec<bool>>>| {
            move |_: Channel, _: u64, session: WriteSession| {
                opens.lock().push(session.opens);
                async { Ok::<(), Status>(()) }
            }
        };
        client
            .write_once_recorded("ns", b"k", &[], write(opens.clone()), |_| false)
            .await
            .unwrap();
        for _ in 0..2 {
            client
                .write_once("ns", b"k", &[], write(opens.clone()))
                .await
                .unwrap();
        }
        assert_eq!(*opens.lock(), [true, true, false]);
    }

    /// A write whose attempts get `answers` in turn (`None`: no answer
    /// until the test ends): what the SDK reports.
    async fn write_answered(answers: Vec<Option<Status>>, hedge: Option<Duration>) -> Error {
        write_settled_by(answers, hedge, &[]).await
    }

    /// [`write_answered`] of a write whose `settled` refusals answer for
    /// every attempt.
    async fn write_settled_by(
        answers: Vec<Option<Status>>,
        hedge: Option<Duration>,
        settled: &[ErrorCode],
    ) -> Error {
        let follow = Rule::Follow {
            before: 1,
            after: 1,
            switch: Duration::ZERO,
            silent: false,
        };
        let (client, _) = three_replicas([Some(follow); 3], hedge).await;
        let answers = Arc::new(parking_lot::Mutex::new(answers.into_iter()));
        let sessions = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let result: Result<()> = client
            .write_once("ns", b"k", settled, |_, _, session| {
                sessions.lock().push((session.id.clone(), session.sequence));
                let answer = answers.lock().next().expect("an answer for every attempt");
                async move {
                    match answer {
                        Some(status) => Err(status),
                        None => std::future::pending().await,
                    }
                }
            })
            .await;
        let sessions = sessions.lock();
        assert!(sessions.len() >= 2, "{} attempts", sessions.len());
        assert!(
            sessions.iter().all(|s| *s == sessions[0]),
            "every attempt is the same write of the same session"
        );
        result.expect_err("every attempt failed")
    }

    /// A retried write refused for a reason found before the shard's
    /// session check (a full disk, a revoked role, a deleted namespace)
    /// after an earlier attempt got no definite answer may have applied
    /// through that attempt: the SDK says the outcome is unknown
    /// (`TIMEOUT`), not the refusal's "nothing was stored". Before, the
    /// caller got `DISK_FULL` for a blob that was stored.
    #[tokio::test]
    async fn a_refusal_after_an_unanswered_attempt_reports_an_unknown_outcome() {
        use ErrorCode::*;
        for (first, last) in [
            (Status::unavailable("connection reset"), DiskFull),
            (refusal(NoQuorum), PermissionDenied),
            (refusal(Timeout), NamespaceNotFound),
            (refusal(ShuttingDown), DiskFull),
        ] {
            let error = write_answered(vec![Some(first.clone()), Some(refusal(last))], None).await;
            assert_eq!(error.code(), Timeout, "{first:?} then {last:?}: {error}");
            assert!(error.to_string().contains(last.as_str_name()), "{error}");
        }
        // An attempt still running when another is refused (hedged).
        let error = write_answered(
            vec![None, Some(refusal(DiskFull))],
            Some(Duration::from_millis(50)),
        )
        .await;
        assert_eq!(error.code(), Timeout, "{error}");
    }

    /// Refusals that are definite stay what they are: after answers that
    /// said nothing was proposed (`OVERLOADED`, `NOT_LEADER`, a stale
    /// map), and the apply step's own (`ALREADY_EXISTS`, which accounts for
    /// every attempt of the write: a duplicate answers the first one's
    /// outcome).
    #[tokio::test]
    async fn a_refusal_after_definite_answers_is_reported_as_it_is() {
        use ErrorCode::*;
        for (first, last) in [
            (refusal(Overloaded), DiskFull),
            (refusal(NotLeader), PermissionDenied),
            (refusal(StaleMap), DiskFull),
            (refusal(NoQuorum), AlreadyExists),
        ] {
            let error = write_answered(vec![Some(first.clone()), Some(refusal(last))], None).await;
            assert_eq!(error.code(), last, "{first:?} then {last:?}: {error}");
        }
    }

    /// A write's own settled refusals stay what they are after an
    /// unanswered attempt (a touch's `NOT_FOUND`: the e2e split test saw a
    /// touch reported as `TIMEOUT` when its retry found the key deleted);
    /// other refusals of the same write still report an unknown outcome.
    #[tokio::test]
    async fn a_settled_refusal_after_an_unanswered_attempt_is_reported_as_it_is() {
        use ErrorCode::*;
        let first = Status::unavailable("connection reset");
        let error = write_settled_by(
            vec![Some(first.clone()), Some(refusal(NotFound))],
            None,
            &[NotFound],
        )
        .await;
        assert_eq!(error.code(), NotFound, "{error}");
        let error = write_settled_by(
            vec![Some(first), Some(refusal(DiskFull))],
            None,
            &[NotFound],
        )
        .await;
        assert_eq!(error.code(), Timeout, "{error}");
    }
}
