//! The Tidepool gateway: the protocols build tools speak, served on top
//! of the client SDK — stateless apart from uploads in flight, so any
//! number of gateways can serve one cluster.
//!
//! - **REAPI v2** over gRPC (`Capabilities`, `ContentAddressableStorage`,
//!   `ActionCache`) and `google.bytestream.ByteStream` (reads with offset
//!   and limit, resumable writes, `compressed-blobs/zstd`): what `bazel
//!   --remote_cache=grpc://…` uses.
//! - **The HTTP cache protocol**: `GET`/`PUT`/`HEAD`/`DELETE` on
//!   `/cas/<sha256>` and `/ac/<sha256>` (what `bazel
//!   --remote_cache=http://…` uses) and on any other path as a mutable
//!   key (ccache's `remote_storage`).
//! - **restic's REST backend protocol** (v2), when configured
//!   ([`GatewayConfig::restic`]): restic repositories under path prefixes
//!   (`restic -r rest:http://…/REPO/`), objects verified against their
//!   names, append-only callers (see [`restic`]).
//!
//! An instance `NAME` is two namespaces: `NAME` (content-addressed: the
//! CAS) and `NAME.ac` (the action cache and HTTP path keys); the empty
//! instance name is `cache`. Callers' bearer tokens (HTTP: Bearer, or
//! Basic with the token as password) are passed on to the cluster, so a
//! caller may do exactly what its token's roles allow. Both listeners
//! serve TLS with the gateway's own certificate when
//! [`GatewayConfig::serve_tls`] is set. See `docs/design/gateway.md`.

mod bytestream;
mod cache;
mod codec;
mod http;
mod names;
mod reapi;
pub mod restic;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tidepool_client::{Client, ClientConfig, ErrorCode};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use names::{AC_SUFFIX, DEFAULT_INSTANCE, Instance};
pub use restic::ResticConfig;

/// Settings of a gateway.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Where REAPI and ByteStream are served (gRPC, plaintext).
    pub grpc_listen: SocketAddr,
    /// Where the HTTP cache protocol is served.
    pub http_listen: SocketAddr,
    /// How the gateway reaches the cluster: coordinators, TLS material,
    /// and its own token (used to follow the map; and for callers without
    /// credentials when `anonymous` is set).
    pub client: ClientConfig,
    /// Requests without credentials act with the gateway's own token.
    /// Off by default: every request must carry a token.
    pub anonymous: bool,
    /// Largest blob accepted, bytes (advertised as
    /// `max_cas_blob_size_bytes`).
    pub max_blob_bytes: u64,
    /// Largest total of a `BatchUpdateBlobs`/`BatchReadBlobs`, bytes.
    pub max_batch_bytes: u64,
    /// An unfinished ByteStream upload idle this long is forgotten.
    pub upload_idle: Duration,
    /// Serve both listeners over TLS with this certificate chain and key
    /// (PEM); clients authenticate with tokens, not certificates. `None`:
    /// plaintext.
    pub serve_tls: Option<ServeTls>,
    /// Serve restic's REST protocol too (on a listener of its own).
    pub restic: Option<ResticConfig>,
    /// Serve `/metrics`, `/healthz` and `/readyz` here (plain HTTP).
    pub metrics_listen: Option<SocketAddr>,
    /// What a client of the HTTP endpoints (the cache, restic) may hold.
    pub http_limits: HttpLimits,
    /// What the uploads being received (HTTP and restic PUTs, ByteStream
    /// writes, paused ones included) may buffer at once, bytes
    /// (`Client::with_upload_memory`): each reserves the rest of the chunk
    /// it fills (of the blob, when its size is declared); past the budget
    /// a write waits, then fails `OVERLOADED` (HTTP 503, gRPC
    /// `UNAVAILABLE`).
    pub upload_memory_bytes: u64,
    /// What the blob readers serving requests (GETs, ByteStream reads,
    /// batch reads, action cache checks) may hold at once, bytes
    /// (`Client::with_read_memory`): a read takes room before it asks for
    /// bytes (the digest's size, else a chunk, cut to what it read), and a
    /// client that reads slowly holds what it is being sent; past the
    /// budget a read waits, then fails `OVERLOADED` (HTTP 503, gRPC
    /// `UNAVAILABLE`).
    pub read_memory_bytes: u64,
}

/// Bounds on what clients of an HTTP endpoint may hold, against slow,
/// idle and hostile clients (each endpoint counts its own connections).
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// Longest wait for a request's headers, counted from when the
    /// connection is ready for its next request: a client trickling its
    /// headers in, and an idle keep-alive connection, are closed after it.
    pub header_timeout: Duration,
    /// Longest wait for the next piece of a request's body, or the next
    /// message of a gRPC client stream (ByteStream `Write`,
    /// `RegisterChunkMapping`): the request then fails (`TIMEOUT`,
    /// `DEADLINE_EXCEEDED`) and nothing of it is stored.
    pub body_idle: Duration,
    /// Connections served at once by each listener (the HTTP cache, the
    /// restic server, and the gRPC one too); more wait in the listen
    /// backlog until one closes.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    /// 30 s for headers (hyper's own default, which `axum::serve` leaves
    /// unarmed), 60 s between pieces of a body, 4,096 connections.
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(30),
            body_idle: Duration::from_secs(60),
            max_connections: 4096,
        }
    }
}

/// The gateway's own certificate (`grpcs://`, `https://`).
#[derive(Clone, Debug)]
pub struct ServeTls {
    /// PEM certificate chain.
    pub cert: std::path::PathBuf,
    /// PEM private key.
    pub key: std::path::PathBuf,
}

impl GatewayConfig {
    /// Defaults: gRPC on 127.0.0.1:7480, HTTP on 127.0.0.1:7481, blobs up
    /// to 64 GiB, batches up to 4 MiB, 256 MiB of uploads buffered and
    /// 256 MiB held by readers.
    pub fn new(client: ClientConfig) -> GatewayConfig {
        GatewayConfig {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 7480)),
            http_listen: SocketAddr::from(([127, 0, 0, 1], 7481)),
            client,
            anonymous: false,
            max_blob_bytes: 64 << 30,
            max_batch_bytes: 4 << 20,
            upload_idle: Duration::from_secs(600),
            serve_tls: None,
            restic: None,
            metrics_listen: None,
            http_limits: HttpLimits::default(),
            upload_memory_bytes: 256 << 20,
            read_memory_bytes: 256 << 20,
        }
    }
}

/// When the first certificate of the PEM file `path` expires (Unix
/// seconds).
fn serving_expiry(path: &std::path::Path) -> Result<i64, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let chain = tidepool_security::tls::certificates(&pem).map_err(|e| e.to_string())?;
    tidepool_security::tls::not_after(&chain[0]).map_err(|e| e.to_string())
}

/// Longest a request naming an unknown instance waits for a newer map.
const UNKNOWN_NAME_REFRESH: Duration = Duration::from_secs(1);

/// What the protocol handlers share.
pub(crate) struct Gateway {
    /// The gateway's own client (map, anonymous callers).
    client: Client,
    config: GatewayConfig,
    uploads: bytestream::Uploads,
    /// When the map was last fetched (or tried) for an unknown instance.
    last_refresh: std::sync::Mutex<std::time::Instant>,
    /// Requests by protocol, method and code.
    metrics: tidepool_telemetry::RequestMetrics,
    /// Token names by the SHA-256 of the secret, as the coordinator
    /// authenticated them (a name never changes for a secret).
    token_names: std::sync::Mutex<std::collections::HashMap<[u8; 32], String>>,
}

/// The gRPC methods the gateway serves (every other path counts as
/// `other`).
pub(crate) const GRPC_METHODS: [&str; 12] = [
    "/build.bazel.remote.execution.v2.Capabilities/GetCapabilities",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/FindMissingBlobs",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchUpdateBlobs",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchReadBlobs",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/GetTree",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/SplitBlob",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/SpliceBlob",
    "/build.bazel.remote.execution.v2.ActionCache/GetActionResult",
    "/build.bazel.remote.execution.v2.ActionCache/UpdateActionResult",
    "/google.bytestream.ByteStream/Read",
    "/google.bytestream.ByteStream/Write",
    "/google.bytestream.ByteStream/QueryWriteStatus",
];

/// The HTTP verbs counted by name (others count as `other`).
pub(crate) const HTTP_METHODS: &[&str] = &["GET", "HEAD", "PUT", "POST", "DELETE"];

/// The gateway's metrics endpoint.
struct GatewayExposition {
    registry: prometheus_client::registry::Registry,
}

impl tidepool_telemetry::Exposition for GatewayExposition {
    fn registry(&self) -> &prometheus_client::registry::Registry {
        &self.registry
    }
}

/// A request's credential.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Credential {
    /// A bearer token.
    Token(String),
    /// None given.
    Anonymous,
}

impl Credential {
    /// From an `authorization` header: `Bearer <token>`, or `Basic` with
    /// the token as the password (or as the user name when the password
    /// is empty: `https://TOKEN@host/`).
    pub(crate) fn from_header(value: Option<&[u8]>) -> tidepool_client::Result<Credential> {
        use base64::Engine as _;
        let Some(value) = value else {
            return Ok(Credential::Anonymous);
        };
        let bad = |what: &str| {
            tidepool_client::Error::new(
                ErrorCode::Unauthenticated,
                format!("authorization header: {what}; use `Bearer <token>` or `Basic`"),
            )
        };
        let value = std::str::from_utf8(value)
            .map_err(|_| bad("not text"))?
            .trim();
        let (scheme, rest) = value.split_once(' ').ok_or_else(|| bad("no scheme"))?;
        let rest = rest.trim();
        if scheme.eq_ignore_ascii_case("bearer") && !rest.is_empty() {
            return Ok(Credential::Token(rest.to_string()));
        }
        if scheme.eq_ignore_ascii_case("basic") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(rest)
                .map_err(|_| bad("Basic credentials are not base64"))?;
            let decoded =
                String::from_utf8(decoded).map_err(|_| bad("Basic credentials are not text"))?;
            let (user, password) = decoded.split_once(':').unwrap_or((&decoded, ""));
            let token = if password.is_empty() { user } else { password };
            if !token.is_empty() {
                return Ok(Credential::Token(token.to_string()));
            }
        }
        Err(bad("unsupported or empty"))
    }
}

impl Gateway {
    /// The client acting for a caller, whose token the coordinator knows:
    /// checked (once per token, remembered) before the request's body is
    /// read, so a made-up token holds no upload buffer (before, anyone
    /// could, with any string). Only a definite refusal refuses: with no
    /// coordinator answering, the nodes' own check on every call decides.
    pub(crate) async fn caller(&self, credential: Credential) -> tidepool_client::Result<Client> {
        match credential {
            Credential::Token(token) => {
                let client = self.client.acting_as(&token)?;
                match self.token_name(&token, &client).await {
                    Err(e)
                        if matches!(
                            e.code(),
                            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied
                        ) =>
                    {
                        Err(e)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "a token could not be checked now; the nodes will");
                        Ok(client)
                    }
                    Ok(_) => Ok(client),
                }
            }
            Credential::Anonymous if self.config.anonymous => Ok(self.client.clone()),
            Credential::Anonymous => Err(tidepool_client::Error::new(
                ErrorCode::Unauthenticated,
                "a token is required (gRPC: `authorization: Bearer <token>`; HTTP: Bearer, or Basic with the token as password)",
            )),
        }
    }

    /// The name of the token `secret`, as the coordinator authenticates it
    /// (`client` acts with it); `None` when the cluster checks no tokens.
    pub(crate) async fn token_name(
        &self,
        secret: &str,
        client: &Client,
    ) -> tidepool_client::Result<Option<String>> {
        /// Names remembered at most; past it the memory starts again.
        const REMEMBERED: usize = 4_096;
        let hash = tidepool_security::token::hash(secret);
        // "" for a cluster that checks no tokens.
        if let Some(name) = self.token_names.lock().expect("names").get(&hash) {
            return Ok(Some(name.clone()).filter(|n| !n.is_empty()));
        }
        let me = client.who_am_i().await?;
        if me.open {
            let mut names = self.token_names.lock().expect("names");
            if names.len() >= REMEMBERED {
                names.clear();
            }
            names.insert(hash, String::new());
            return Ok(None);
        }
        if me.token_name.is_empty() {
            return Err(tidepool_client::Error::new(
                ErrorCode::Unauthenticated,
                "the coordinator authenticated no token",
            ));
        }
        let mut names = self.token_names.lock().expect("names");
        if names.len() >= REMEMBERED {
            names.clear();
        }
        names.insert(hash, me.token_name.clone());
        Ok(Some(me.token_name))
    }

    /// The instance `name` names, if its namespaces exist.
    pub(crate) async fn instance(&self, name: &str) -> tidepool_client::Result<Instance> {
        let instance = Instance::parse(name)
            .map_err(|e| tidepool_client::Error::new(ErrorCode::InvalidArgument, e))?;
        for refresh in [false, true] {
            let map = if refresh {
                // An unknown name may be a namespace created a moment ago;
                // the map is fetched again at most once a second, whether
                // the fetch succeeds or not, and only the request that
                // fetches it waits, for at most `UNKNOWN_NAME_REFRESH`:
                // unknown names are common (ccache's `subdirs` paths, URL
                // prefixes), and with the coordinators unreachable every
                // such request queued behind the one before for a connect
                // timeout per seed.
                {
                    let mut last = self.last_refresh.lock().expect("not poisoned");
                    if last.elapsed() < Duration::from_secs(1) {
                        break;
                    }
                    *last = std::time::Instant::now();
                }
                tokio::time::timeout(UNKNOWN_NAME_REFRESH, self.client.refresh_map())
                    .await
                    .map_err(|_| {
                        tidepool_client::Error::new(
                            ErrorCode::Timeout,
                            format!(
                                "instance {:?} is not in the cluster map and the coordinators did not send a newer one within {UNKNOWN_NAME_REFRESH:?}",
                                instance.name
                            ),
                        )
                    })??
            } else {
                self.client.map()
            };
            let cas = map.namespaces.iter().find(|n| n.name == instance.cas);
            let ac = map.namespaces.iter().any(|n| n.name == instance.ac);
            if let Some(cas) = cas
                && ac
            {
                if !cas.content_addressed {
                    return Err(tidepool_client::Error::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "namespace {:?} is not content-addressed, so it cannot be instance {:?}'s CAS",
                            instance.cas, instance.name
                        ),
                    ));
                }
                return Ok(instance);
            }
        }
        Err(tidepool_client::Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "unknown instance {:?}: it needs namespaces {:?} (content-addressed) and {:?} (`tidectl cache create {}`)",
                instance.name, instance.cas, instance.ac, instance.cas
            ),
        ))
    }
}

/// A running gateway.
pub struct RunningGateway {
    /// Where gRPC (REAPI, ByteStream) is served.
    pub grpc_address: SocketAddr,
    /// Where the HTTP cache is served.
    pub http_address: SocketAddr,
    /// Where restic's REST protocol is served, if it is.
    pub restic_address: Option<SocketAddr>,
    /// Where `/metrics` is served, if it is.
    pub metrics_address: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    gateway: Arc<Gateway>,
}

impl RunningGateway {
    /// Creates instance `name` — namespaces `name` (content-addressed) and
    /// `name.ac`, each dropping entries `retain` epochs after their last
    /// write or touch — where they do not exist yet (with the gateway's
    /// own token, which must be an admin's).
    pub async fn create_instance(&self, name: &str, retain: u32) -> Result<Instance, StartError> {
        let instance = Instance::parse(name)?;
        let retention = tidepool_client::RetentionPolicy::Epochs(retain.max(1));
        for (namespace, content_addressed) in [(&instance.cas, true), (&instance.ac, false)] {
            match self
                .gateway
                .client
                .create_namespace(namespace, content_addressed, retention)
                .await
            {
                Ok(_) => tracing::info!(namespace, "created namespace for the build cache"),
                Err(e) if e.code() == ErrorCode::NamespaceExists => {}
                Err(e) => return Err(format!("cannot create namespace {namespace:?}: {e}").into()),
            }
        }
        self.gateway
            .instance(name)
            .await
            .map_err(|e| e.to_string())?;
        Ok(instance)
    }

    /// An error if a restic namespace — `NAMESPACE` or `NAMESPACE.locks`
    /// — exists but cannot hold restic's objects: expiring (a backup's
    /// packs would be dropped under it) or content-addressed. Its requests
    /// are refused too (500), whenever the namespace is made so.
    pub fn check_restic_namespaces(&self) -> Result<(), StartError> {
        let Some(restic) = &self.gateway.config.restic else {
            return Ok(());
        };
        let map = self.gateway.client.map();
        let locks = format!("{}{}", restic.namespace, restic::LOCKS_SUFFIX);
        for namespace in [&restic.namespace, &locks] {
            if let Some(e) = restic::unfit_namespace(&map, namespace) {
                return Err(e.to_string().into());
            }
        }
        Ok(())
    }

    /// Creates the restic namespaces — `NAMESPACE` and `NAMESPACE.locks`,
    /// durable — where they do not exist yet (with the gateway's own token,
    /// which must be an admin's). Nothing to do without restic.
    pub async fn create_restic_namespaces(&self) -> Result<(), StartError> {
        let Some(restic) = &self.gateway.config.restic else {
            return Ok(());
        };
        let locks = format!("{}{}", restic.namespace, restic::LOCKS_SUFFIX);
        for namespace in [&restic.namespace, &locks] {
            match self
                .gateway
                .client
                .create_namespace(namespace, false, tidepool_client::RetentionPolicy::Durable)
                .await
            {
                Ok(_) => tracing::info!(namespace, "created namespace for restic"),
                Err(e) if e.code() == ErrorCode::NamespaceExists => {}
                Err(e) => return Err(format!("cannot create namespace {namespace:?}: {e}").into()),
            }
        }
        Ok(())
    }

    /// Stops serving (requests in flight are cut).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Connects to the cluster and serves both protocols.
pub async fn start(config: GatewayConfig) -> Result<RunningGateway, StartError> {
    let client = Client::with_config(config.client.clone())
        .await
        .map_err(|e| format!("cannot reach the cluster: {e}"))?
        .with_upload_memory(config.upload_memory_bytes)
        .with_read_memory(config.read_memory_bytes);
    let grpc = TcpListener::bind(config.grpc_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.grpc_listen))?;
    let http = TcpListener::bind(config.http_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.http_listen))?;
    let tls = match &config.serve_tls {
        None => None,
        Some(files) => {
            let config = |alpn: &[&[u8]]| {
                tidepool_security::tls::server_only_config(&files.cert, &files.key, alpn)
                    .map_err(|e| format!("the gateway's TLS material: {e}"))
            };
            // HTTP/1.1 only on the HTTP endpoints (`http::serve_connections`).
            Some((config(&[b"h2"])?, config(&[b"http/1.1"])?))
        }
    };
    let restic = match &config.restic {
        None => None,
        Some(restic) => Some(
            TcpListener::bind(restic.listen)
                .await
                .map_err(|e| format!("cannot listen on {}: {e}", restic.listen))?,
        ),
    };
    let restic_address = match &restic {
        None => None,
        Some(listener) => Some(listener.local_addr().map_err(|e| e.to_string())?),
    };
    let metrics = match config.metrics_listen {
        None => None,
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .map_err(|e| format!("cannot listen on {address}: {e}"))?,
        ),
    };
    let metrics_address = match &metrics {
        None => None,
        Some(listener) => Some(listener.local_addr().map_err(|e| e.to_string())?),
    };
    let grpc_address = grpc.local_addr().map_err(|e| e.to_string())?;
    let http_address = http.local_addr().map_err(|e| e.to_string())?;
    let gateway = Arc::new(Gateway {
        client,
        uploads: bytestream::Uploads::default(),
        last_refresh: std::sync::Mutex::new(
            std::time::Instant::now()
                .checked_sub(Duration::from_secs(2))
                .unwrap_or_else(std::time::Instant::now),
        ),
        config,
        metrics: tidepool_telemetry::RequestMetrics::default(),
        token_names: Default::default(),
    });
    let (stop, stopped) = watch::channel(false);
    let mut tasks = vec![
        tokio::spawn(reapi::serve(
            gateway.clone(),
            grpc,
            tls.as_ref().map(|t| t.0.clone()),
            stopped.clone(),
        )),
        tokio::spawn(http::serve(
            gateway.clone(),
            http,
            tls.as_ref().map(|t| t.1.clone()),
            stopped.clone(),
        )),
        tokio::spawn(bytestream::expire_uploads(gateway.clone(), stopped.clone())),
    ];
    if let Some(listener) = metrics {
        let mut registry = prometheus_client::registry::Registry::default();
        gateway.metrics.register(&mut registry);
        // The certificate it reaches the cluster with (the client's TLS
        // files, loaded again here to be read at each scrape), and the one
        // it serves build tools with (read at start, as it is served until
        // a restart).
        let mut expiry = tidepool_telemetry::metrics::TlsExpiry::default();
        if let Some(files) = &gateway.config.client.tls {
            match tidepool_security::Tls::load(files.clone()) {
                Ok(tls) => expiry.cluster = Some(tls),
                Err(error) => tracing::warn!(%error, "no certificate expiry metric"),
            }
        }
        if let Some(files) = &gateway.config.serve_tls {
            match serving_expiry(&files.cert) {
                Ok(at) => expiry.serving = Some(at),
                Err(error) => tracing::warn!(%error, "no serving certificate expiry metric"),
            }
        }
        registry.register_collector(Box::new(expiry));
        let exposition = Arc::new(GatewayExposition { registry });
        let mut stop = stopped.clone();
        tasks.push(tokio::spawn(tidepool_telemetry::metrics::serve(
            listener,
            exposition,
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        )));
    }
    if let Some(listener) = restic {
        tasks.push(tokio::spawn(restic::serve(
            gateway.clone(),
            listener,
            tls.map(|t| t.1),
            stopped,
        )));
    }
    tracing::info!(%grpc_address, %http_address, "gateway serving");
    Ok(RunningGateway {
        grpc_address,
        http_address,
        restic_address,
        metrics_address,
        stop,
        tasks,
        gateway,
    })
}

/// Why a gateway did not start.
#[derive(Debug)]
pub struct StartError(String);

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartError {}

impl From<String> for StartError {
    fn from(message: String) -> Self {
        StartError(message)
    }
}

/// The next message of a client stream, failing (`DEADLINE_EXCEEDED`)
/// when none comes within `idle`: a stream left open and silent holds what
/// it sent so far (an upload's unstored bytes) for as long as it stays.
pub(crate) async fn next_message<T>(
    stream: &mut tonic::Streaming<T>,
    idle: Duration,
) -> Result<Option<T>, tonic::Status> {
    match tokio::time::timeout(idle, stream.message()).await {
        Ok(message) => message,
        Err(_) => Err(tonic::Status::deadline_exceeded(format!(
            "the stream sent nothing for {idle:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_from_headers() {
        use base64::Engine as _;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let token = |s: &str| Credential::Token(s.to_string());
        assert_eq!(
            Credential::from_header(None).unwrap(),
            Credential::Anonymous
        );
        assert_eq!(
            Credential::from_header(Some(b"Bearer abc")).unwrap(),
            token("abc")
        );
        assert_eq!(
            Credential::from_header(Some(b"bearer  abc ")).unwrap(),
            token("abc")
        );
        let basic = format!("Basic {}", b64("ci:secret"));
        assert_eq!(
            Credential::from_header(Some(basic.as_bytes())).unwrap(),
            token("secret")
        );
        let user_only = format!("Basic {}", b64("secret:"));
        assert_eq!(
            Credential::from_header(Some(user_only.as_bytes())).unwrap(),
            token("secret")
        );
        for bad in ["Bearer", "Bearer ", "Digest x", "Basic !!!", "abc"] {
            let e = Credential::from_header(Some(bad.as_bytes())).unwrap_err();
            assert_eq!(e.code(), ErrorCode::Unauthenticated, "{bad}");
        }
        let empty = format!("Basic {}", b64(":"));
        assert!(Credential::from_header(Some(empty.as_bytes())).is_err());
    }
}
