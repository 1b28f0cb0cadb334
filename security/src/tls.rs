//! Mutual TLS from PEM files that are re-read when they change.
//!
//! A process names three files — its certificate chain, its private key,
//! and the CA bundle it trusts — the shape a Kubernetes Secret or
//! cert-manager gives. [`Tls`] builds the rustls server and client
//! configurations from them and, at most once a second when a connection
//! is accepted or dialled, checks whether any file changed (modification
//! time, length, inode: a Secret update swaps a symlink); if so it loads
//! the new files and every later handshake uses them. Connections already
//! open keep the certificates they were made with. A reload that fails
//! (a half-written file) keeps the previous material and is retried at the
//! next check.
//!
//! Both sides verify each other against the CA bundle: a server requires a
//! client certificate, and the [`Identity`](crate::Identity) in it is what
//! the [`guard`](crate::guard) authorizes.

use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_stream::wrappers::ReceiverStream;

use crate::first_byte::{FIRST_BYTE_TIMEOUT, FirstByteDeadline};
use crate::{Error, Result};

/// How often at most the files are checked for changes.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// A handshake not done by then is dropped (a client that connects and
/// says nothing holds no more than a socket for this long).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a process's TLS material is.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// PEM certificate chain (leaf first).
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM bundle of the CA certificates trusted for peers.
    pub ca: PathBuf,
}

/// What a file looked like when loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: i64,
    modified_ns: i64,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: meta.mtime(),
        modified_ns: meta.mtime_nsec(),
        len: meta.len(),
        inode: meta.ino(),
    })
}

/// The parsed material.
struct Material {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    expiry: Expiry,
}

/// When a process's TLS material stops working: its own certificate and
/// its CA's, as Unix seconds (the certificate's `notAfter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expiry {
    /// The process's own certificate (the first of its chain).
    pub certificate: i64,
    /// The earliest of the CA certificates it trusts.
    pub ca: i64,
}

/// `notAfter` of a DER certificate, as Unix seconds.
pub fn not_after(der: &CertificateDer<'_>) -> Result<i64> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| Error::Invalid(format!("unreadable certificate: {e}")))?;
    Ok(cert.validity().not_after.timestamp())
}

struct Watch {
    stamps: [Option<Stamp>; 3],
    checked: Instant,
}

/// A process's TLS configuration, reloaded when its files change.
pub struct Tls {
    files: TlsFiles,
    material: ArcSwap<Material>,
    watch: Mutex<Watch>,
    reloads: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish()
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::File {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// The certificates in a PEM text.
pub fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Invalid(format!("bad PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(Error::Invalid("no certificate in the PEM text".into()));
    }
    Ok(certs)
}

/// A server configuration for clients that present no certificate (TLS
/// authenticates the server only; callers authenticate with tokens): the
/// PEM chain `cert` and its `key`, offering the ALPN protocols `alpn`.
/// What the build-cache gateway serves build tools with.
pub fn server_only_config(cert: &Path, key: &Path, alpn: &[&[u8]]) -> Result<Arc<ServerConfig>> {
    let chain = certificates(&read(cert)?)
        .map_err(|e| Error::Invalid(format!("{}: {e}", cert.display())))?;
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?)
        .map_err(|e| Error::Invalid(format!("{}: bad private key: {e}", key.display())))?;
    let mut server = ServerConfig::builder_with_provider(crate::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Invalid(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| Error::Invalid(format!("{}: {e}", cert.display())))?;
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(server))
}

fn load(files: &TlsFiles) -> Result<Material> {
    let with_path = |path: &Path, e: Error| Error::Invalid(format!("{}: {e}", path.display()));
    let chain = certificates(&read(&files.cert)?).map_err(|e| with_path(&files.cert, e))?;
    let key = PrivateKeyDer::from_pem_slice(&read(&files.key)?)
        .map_err(|e| Error::Invalid(format!("{}: bad private key: {e}", files.key.display())))?;
    let mut roots = RootCertStore::empty();
    for ca in certificates(&read(&files.ca)?).map_err(|e| with_path(&files.ca, e))? {
        roots
            .add(ca)
            .map_err(|e| Error::Invalid(format!("{}: {e}", files.ca.display())))?;
    }
    let roots = Arc::new(roots);
    let expiry = Expiry {
        certificate: not_after(&chain[0]).map_err(|e| with_path(&files.cert, e))?,
        ca: certificates(&read(&files.ca)?)?
            .iter()
            .map(not_after)
            .collect::<Result<Vec<i64>>>()
            .map_err(|e| with_path(&files.ca, e))?
            .into_iter()
            .min()
            .unwrap_or(i64::MAX),
    };
    let provider = crate::provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| Error::Invalid(format!("client verifier: {e}")))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Invalid(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| Error::Invalid(format!("{}: {e}", files.cert.display())))?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Invalid(e.to_string()))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| Error::Invalid(format!("{}: {e}", files.cert.display())))?;
    client.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Material {
        server: Arc::new(server),
        client: Arc::new(client),
        expiry,
    })
}

impl Tls {
    /// Loads the files (an error if any is missing or unusable).
    pub fn load(files: TlsFiles) -> Result<Arc<Tls>> {
        let stamps = Self::stamps(&files);
        let material = load(&files)?;
        Ok(Arc::new(Tls {
            files,
            material: ArcSwap::from_pointee(material),
            watch: Mutex::new(Watch {
                stamps,
                checked: Instant::now(),
            }),
            reloads: 0.into(),
        }))
    }

    fn stamps(files: &TlsFiles) -> [Option<Stamp>; 3] {
        [stamp(&files.cert), stamp(&files.key), stamp(&files.ca)]
    }

    /// The files it loads.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// How many times changed files were loaded since start.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reloads the files if they changed since the last check (checks at
    /// most once a second).
    pub fn refresh(&self) {
        let mut watch = self.watch.lock();
        if watch.checked.elapsed() < CHECK_EVERY {
            return;
        }
        watch.checked = Instant::now();
        let now = Self::stamps(&self.files);
        if now == watch.stamps {
            return;
        }
        match load(&self.files) {
            Ok(material) => {
                self.material.store(Arc::new(material));
                watch.stamps = now;
                self.reloads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(cert = %self.files.cert.display(), "TLS files changed: reloaded");
            }
            // Kept until the files are whole again; checked again in a
            // second.
            Err(e) => tracing::warn!("TLS files changed but do not load (keeping the old): {e}"),
        }
    }

    /// The server configuration for the next handshake.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.refresh();
        self.material.load().server.clone()
    }

    /// The client configuration for the next connection.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.refresh();
        self.material.load().client.clone()
    }

    /// When the certificate and CA in use now expire (after a reload if
    /// the files changed).
    pub fn expiry(&self) -> Expiry {
        self.refresh();
        self.material.load().expiry
    }
}

/// A TLS connection accepted by [`incoming`].
pub type ServerStream = tokio_rustls::server::TlsStream<TcpStream>;

/// Accepts connections on `listener` and completes their TLS handshakes
/// concurrently (a slow or silent client never delays others); yields the
/// connections whose handshake succeeded. The accept loop ends when the
/// stream is dropped.
pub fn incoming(listener: TcpListener, tls: Arc<Tls>) -> ReceiverStream<io::Result<ServerStream>> {
    incoming_with(listener, move || tls.server_config())
}

/// [`incoming`] with the server configuration `config` returns for each
/// handshake (a server whose clients present no certificate, such as the
/// build-cache gateway's, brings its own). At most [`HANDSHAKES_AT_ONCE`]
/// handshakes run at once, [`HANDSHAKES_PER_PEER`] of them from one IP
/// address; a connection past either bound is closed at once (its client
/// tries again). Unbounded, a flood of connections that never finish their
/// handshake held a task and a socket each for `HANDSHAKE_TIMEOUT`; the
/// accept loop never waits, so such connections cannot lock others out
/// either. A handshake holds its place until its connection is taken by
/// the server.
pub fn incoming_with(
    listener: TcpListener,
    config: impl Fn() -> Arc<ServerConfig> + Send + 'static,
) -> ReceiverStream<io::Result<ServerStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_AT_ONCE));
    let peers = PeerLimit::new(HANDSHAKES_PER_PEER);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            let (socket, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: do not spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(place) = handshakes.clone().try_acquire_owned() else {
                tracing::debug!(%peer, "too many TLS handshakes at once: connection closed");
                continue;
            };
            let Some(from_peer) = peers.take(peer.ip()) else {
                tracing::debug!(%peer, "too many TLS handshakes from this address: connection closed");
                continue;
            };
            let _ = socket.set_nodelay(true);
            let acceptor = TlsAcceptor::from(config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(socket)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake refused: {e}"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
                drop((place, from_peer));
            });
        }
    });
    ReceiverStream::new(rx)
}

/// TLS handshakes a server runs at once ([`incoming_with`]).
pub const HANDSHAKES_AT_ONCE: usize = 1024;

/// TLS handshakes a server runs at once for one client IP address.
pub const HANDSHAKES_PER_PEER: usize = 32;

/// Places counted per client IP address, at most `per_peer` held at once
/// by one address (TLS handshakes here, metrics connections elsewhere): one
/// client cannot take every place of a bounded listener.
#[derive(Clone, Debug)]
pub struct PeerLimit {
    counts: Arc<Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    per_peer: usize,
}

impl PeerLimit {
    /// At most `per_peer` places for each address.
    pub fn new(per_peer: usize) -> Self {
        Self {
            counts: Arc::default(),
            per_peer,
        }
    }

    /// A place for `ip`, held until dropped; `None` while it holds
    /// `per_peer`.
    pub fn take(&self, ip: std::net::IpAddr) -> Option<PeerPlace> {
        let mut counts = self.counts.lock();
        let count = counts.entry(ip).or_default();
        if *count >= self.per_peer {
            return None;
        }
        *count += 1;
        Some(PeerPlace {
            counts: self.counts.clone(),
            ip,
        })
    }
}

/// A place of a [`PeerLimit`], given back when dropped.
#[derive(Debug)]
pub struct PeerPlace {
    counts: Arc<Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    ip: std::net::IpAddr,
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut counts = self.counts.lock();
        if let Some(count) = counts.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

/// Connections a node's or coordinator's gRPC server holds at once
/// ([`serve`]): past it, a new connection waits (in the kernel's backlog,
/// then unanswered) until another closes. Every client process holds one
/// or a few connections to each server.
pub const MAX_GRPC_CONNECTIONS: usize = 8192;

/// `incoming`'s connections, each holding one of `max` slots until it is
/// dropped, and given [`FIRST_BYTE_TIMEOUT`] to send its opening bytes
/// ([`crate::first_byte`]). With every slot taken, the next connection
/// waits for one (and no further one is accepted meanwhile): a client
/// that opens connections without end holds at most `max` sockets.
fn slotted<S>(
    incoming: impl tokio_stream::Stream<Item = io::Result<S>> + Send + 'static,
    max: usize,
) -> impl tokio_stream::Stream<Item = io::Result<FirstByteDeadline<S>>> + Send + 'static
where
    S: Send + 'static,
{
    use tokio_stream::StreamExt as _;
    let slots = Arc::new(tokio::sync::Semaphore::new(max.max(1)));
    incoming.then(move |accepted| {
        let slots = slots.clone();
        async move {
            let stream = accepted?;
            let slot = slots
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            Ok(FirstByteDeadline::new(stream, FIRST_BYTE_TIMEOUT).holding(slot))
        }
    })
}

/// A gRPC server's TLS connections ([`incoming_with`]): at most `max` at
/// once (`slotted`), each of whose clients must send its opening bytes within
/// [`FIRST_BYTE_TIMEOUT`] of its handshake ([`crate::first_byte`]).
pub fn grpc_incoming_tls(
    listener: TcpListener,
    config: impl Fn() -> Arc<ServerConfig> + Send + 'static,
    max: usize,
) -> impl tokio_stream::Stream<Item = io::Result<FirstByteDeadline<ServerStream>>> + Send + 'static
{
    slotted(incoming_with(listener, config), max)
}

/// A gRPC server's plaintext connections: `TCP_NODELAY` (small Raft and
/// client messages must not wait for Nagle's algorithm, 40 ms with delayed
/// ACKs), TCP keep-alive, at most `max` at once (`slotted`), and a client
/// that must send its opening bytes within [`FIRST_BYTE_TIMEOUT`]
/// ([`crate::first_byte`]).
pub fn grpc_incoming_plain(
    listener: TcpListener,
    max: usize,
) -> impl tokio_stream::Stream<Item = io::Result<FirstByteDeadline<TcpStream>>> + Send + 'static {
    let incoming = tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)));
    slotted(incoming, max)
}

/// Dials TLS connections for a tonic endpoint, with the files current at
/// each connection; the server is verified against the URI's host.
#[derive(Clone, Debug)]
pub struct Connector {
    tls: Arc<Tls>,
}

impl Connector {
    /// A connector with `tls`.
    pub fn new(tls: Arc<Tls>) -> Self {
        Self { tls }
    }
}

impl tower::Service<http::Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = io::Result<Self::Response>> + Send + 'static>,
    >;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let config = self.tls.client_config();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "URI without a host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            let socket = TcpStream::connect((host.as_str(), port)).await?;
            socket.set_nodelay(true)?;
            let name = ServerName::try_from(host)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = TlsConnector::from(config).connect(name, socket).await?;
            Ok(TokioIo::new(stream))
        })
    }
}

/// The leaf certificate a server presents now (a new TLS handshake with
/// `tls`'s client material): what operators and tests use to see that a
/// rotated certificate is served.
pub async fn server_certificate(
    tls: &Tls,
    host: &str,
    port: u16,
) -> io::Result<CertificateDer<'static>> {
    let socket = TcpStream::connect((host, port)).await?;
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let stream = TlsConnector::from(tls.client_config())
        .connect(name, socket)
        .await?;
    let (_, session) = stream.get_ref();
    session
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|leaf| leaf.clone().into_owned())
        .ok_or_else(|| io::Error::other("the server presented no certificate"))
}

/// Serves `router` on `listener` until `stopped` resolves: through TLS
/// handshakes ([`incoming`]) when `tls` is given, else plaintext TCP. Small
/// Raft and client messages must not wait for Nagle's algorithm (40 ms
/// with delayed ACKs): every accepted socket has `TCP_NODELAY`. A client
/// that sends nothing is disconnected after [`FIRST_BYTE_TIMEOUT`]; at most
/// [`MAX_GRPC_CONNECTIONS`] connections are held at once.
pub async fn serve<L, ResBody>(
    router: tonic::transport::server::Router<L>,
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
    stopped: impl std::future::Future<Output = ()>,
) -> std::result::Result<(), tonic::transport::Error>
where
    L: tower::Layer<tonic::service::Routes>,
    L::Service: tower::Service<http::Request<tonic::body::Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    <L::Service as tower::Service<http::Request<tonic::body::Body>>>::Future: Send,
    <L::Service as tower::Service<http::Request<tonic::body::Body>>>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    match tls {
        Some(tls) => {
            let incoming =
                grpc_incoming_tls(listener, move || tls.server_config(), MAX_GRPC_CONNECTIONS);
            router.serve_with_incoming_shutdown(incoming, stopped).await
        }
        None => {
            router
                .serve_with_incoming_shutdown(
                    grpc_incoming_plain(listener, MAX_GRPC_CONNECTIONS),
                    stopped,
                )
                .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS handshake from `from` to the server at `port`.
    async fn handshake(tls: &Tls, from: &str, port: u16) -> io::Result<()> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(format!("{from}:0").parse().unwrap())?;
        let stream = socket
            .connect(format!("127.0.0.1:{port}").parse().unwrap())
            .await?;
        let name = ServerName::try_from("127.0.0.1".to_string()).unwrap();
        let connecting = TlsConnector::from(tls.client_config()).connect(name, stream);
        tokio::time::timeout(Duration::from_secs(5), connecting)
            .await
            .map_err(|_| io::Error::other("no handshake within 5 s"))??;
        Ok(())
    }

    /// Connections that never finish their TLS handshake are bounded per
    /// client address: past the bound, that address's new connections are
    /// closed at once, and another address's are served as before — the
    /// accept loop never waits on them, so they lock nobody out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unfinished_handshakes_are_bounded_per_client() {
        let dir = tempfile::tempdir().unwrap();
        crate::certs::ensure_dev(dir.path(), 1).unwrap();
        let tls = Tls::load(crate::certs::files(dir.path(), "node-1")).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = tls.clone();
        let mut incoming = incoming_with(listener, move || served.server_config());
        // The server takes the connections that finish.
        tokio::spawn(async move {
            use tokio_stream::StreamExt as _;
            let mut held = Vec::new();
            while let Some(stream) = incoming.next().await {
                held.push(stream);
            }
        });

        let mut silent = Vec::new();
        for _ in 0..HANDSHAKES_PER_PEER {
            silent.push(TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let began = Instant::now();
        assert!(
            handshake(&tls, "127.0.0.1", port).await.is_err(),
            "a handshake past the address's bound"
        );
        assert!(began.elapsed() < Duration::from_secs(2), "closed at once");
        handshake(&tls, "127.0.0.2", port)
            .await
            .expect("another address is served");
        drop(silent);
        tokio::time::sleep(Duration::from_millis(200)).await;
        handshake(&tls, "127.0.0.1", port)
            .await
            .expect("served once the silent connections closed");
    }
}
