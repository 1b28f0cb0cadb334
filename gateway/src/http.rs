//! The HTTP cache protocol (Bazel's `--remote_cache=http://…`, ccache's
//! `remote_storage=http://…`), on axum.
//!
//! Paths:
//! - `[/INSTANCE]/cas/<sha256>` (64 hex digits): the CAS; a `PUT` must
//!   hash to the name.
//! - `[/INSTANCE]/ac/<sha256>` (64 hex digits): the action cache, shared
//!   with REAPI; an
//!   entry that reads as an `ActionResult` is only returned while every
//!   output it references is stored (other tools' entries, such as
//!   ccache's `bazel` layout, are returned as they are).
//! - any other path: a mutable key (ccache's `subdirs` and `flat`
//!   layouts, and its `bazel` layout under a prefix that names no
//!   instance), in the instance the first segment names if there is one,
//!   else in the default instance.
//!
//! `GET`, `HEAD`, `PUT` (200), `DELETE` (200, or 404 when absent).

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tidepool_telemetry::MethodNames;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use tidepool_client::{Client, Error, ErrorCode};
use tidepool_security::first_byte::FirstByteDeadline;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_stream::StreamExt as _;

use crate::names::{BlobDigest, Instance, parse_hash};
use crate::{Credential, Gateway, HttpLimits, cache};

/// Entries of `/ac/` up to this size are read whole and checked as action
/// results (larger ones, which no build tool's action result reaches, are
/// streamed as stored: ccache's `bazel` layout keeps its results there).
/// Each is charged its size and its decoded form's bound
/// (`wire::MAX_DECODED_RATIO` times its size) against [`AC_MEMORY_BYTES`],
/// which must hold that whole: at 64 MiB, an entry charged the whole
/// budget could take several times it.
const AC_CHECK_BYTES: u64 = 6 << 20;
const _: () = assert!(
    AC_CHECK_BYTES * (1 + crate::wire::MAX_DECODED_RATIO) + crate::wire::SLACK_BYTES
        <= AC_MEMORY_BYTES
);

/// Entries of `/ac/` up to this size are answered from the copy read for
/// their check; larger ones are read again and streamed.
const AC_INLINE_BYTES: u64 = 4 << 20;

/// Memory the `/ac/` entries read whole for their check may hold at once,
/// across requests (while being checked).
const AC_MEMORY_BYTES: u64 = 256 << 20;
static AC_MEMORY: Semaphore = Semaphore::const_new((AC_MEMORY_BYTES >> 10) as usize);

/// What a path names.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    Cas([u8; 32]),
    Ac([u8; 32]),
    Key(Vec<u8>),
}

/// Serves the HTTP cache on `listener` until `stop`, through TLS
/// handshakes when `tls` is given.
pub(crate) async fn serve(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    stop: watch::Receiver<bool>,
) {
    let counted = gateway
        .metrics
        .layer("http_cache", MethodNames::Http(crate::HTTP_METHODS))
        .traced();
    let limits = gateway.config.http_limits.clone();
    let app = Router::new()
        .fallback(handle)
        .with_state(gateway)
        .layer(counted);
    serve_app(app, listener, tls, limits, stop).await;
}

/// How long a stopping endpoint lets requests under way finish.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `stop` (TLS when `tls` is given),
/// within `limits`.
pub(crate) async fn serve_app(
    app: Router,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: HttpLimits,
    stop: watch::Receiver<bool>,
) {
    match tls {
        None => {
            use axum::serve::ListenerExt as _;
            // Small responses must not wait for Nagle's algorithm.
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            serve_connections(app, listener, limits, stop).await;
        }
        Some(config) => {
            let address = listener.local_addr();
            let listener = TlsListener {
                address,
                incoming: tidepool_security::tls::incoming_with(listener, move || config.clone()),
            };
            serve_connections(app, listener, limits, stop).await;
        }
    }
}

/// The accept loop: hyper's server with the [`HttpLimits`]
/// (`axum::serve` applies none of them: it gives hyper no timer, and
/// hyper's header timeout needs one — a client sending its headers a byte
/// at a time, or nothing, held its connection, task and buffer for ever).
async fn serve_connections<L: axum::serve::Listener>(
    app: Router,
    mut listener: L,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    // HTTP/1.1 only: the clients of these endpoints (Bazel's and ccache's
    // HTTP caches, restic) speak it, and hyper's HTTP/2 server has no idle
    // timeout — a client that sent the preface and answered pings held a
    // connection slot for ever, so a few thousand of them locked every
    // build tool out. An idle HTTP/1.1 connection is closed by the header
    // timeout, which also bounds the wait for each next request.
    let mut builder = Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let permit = tokio::select! {
            () = stopped(&mut stop) => break,
            permit = slots.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let io = tokio::select! {
            () = stopped(&mut stop) => break,
            (io, _) = listener.accept() => io,
        };
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let mut stop = stop.clone();
        let (header_timeout, body_idle) = (limits.header_timeout, limits.body_idle);
        tokio::spawn(async move {
            // hyper reads a connection's first bytes to tell HTTP/1 from
            // HTTP/2 before any of its timeouts applies: a connection that
            // sends nothing, or a prefix of HTTP/2's preface and then
            // nothing, is closed by this deadline instead.
            let io = WriteStall::new(FirstByteDeadline::new(io, header_timeout), body_idle);
            let connection = builder.serve_connection(TokioIo::new(io), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = stopped(&mut stop) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(DRAIN_TIMEOUT, connection).await;
                }
            }
            drop(permit);
        });
    }
    // Requests under way finish (or the drain times out on each).
    let _ = slots.acquire_many(limits.max_connections as u32).await;
}

/// A connection whose writes fail (`TimedOut`) once one has waited for
/// `stall` without the client taking a byte: hyper has no write timeout,
/// so a client that stopped reading a response (its receive window full)
/// held the connection, its slot and what the response had queued for as
/// long as it kept the socket open.
struct WriteStall<I> {
    io: I,
    stall: Duration,
    /// Armed while a write waits.
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<I> WriteStall<I> {
    fn new(io: I, stall: Duration) -> Self {
        WriteStall {
            io,
            stall,
            waiting: None,
        }
    }

    /// What a write that returned `poll` becomes: its result once ready
    /// (disarming the deadline), an error once it waited `stall`.
    fn judge<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if poll.is_ready() {
            self.waiting = None;
            return poll;
        }
        let stall = self.stall;
        let waiting = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        if waiting.as_mut().poll(cx).is_ready() {
            self.waiting = None;
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client took nothing of the response",
            )));
        }
        Poll::Pending
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for WriteStall<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for WriteStall<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, data);
        self.judge(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, data);
        self.judge(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.judge(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The next piece of a request's body (`None` at its end); an error once
/// the client has sent nothing for `idle`, since a stalled upload holds
/// its connection and what the upload buffered.
pub(crate) async fn next_piece(
    stream: &mut axum::body::BodyDataStream,
    idle: Duration,
) -> tidepool_client::Result<Option<Bytes>> {
    match tokio::time::timeout(idle, stream.next()).await {
        Err(_) => Err(Error::new(
            ErrorCode::Timeout,
            format!("the request body sent nothing for {idle:?}"),
        )),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(Error::new(
            ErrorCode::InvalidArgument,
            format!("reading the body: {e}"),
        )),
        Ok(Some(Ok(piece))) => Ok(Some(piece)),
    }
}

/// Connections whose TLS handshake completed, as axum's listener.
struct TlsListener {
    address: std::io::Result<std::net::SocketAddr>,
    incoming: tokio_stream::wrappers::ReceiverStream<
        std::io::Result<tidepool_security::tls::ServerStream>,
    >,
}

impl axum::serve::Listener for TlsListener {
    type Io = tidepool_security::tls::ServerStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.incoming.next().await {
                Some(Ok(stream)) => {
                    if let Ok(peer) = stream.get_ref().0.peer_addr() {
                        return (stream, peer);
                    }
                }
                Some(Err(e)) => tracing::debug!(error = %e, "a TLS connection failed"),
                // The accept loop ends only with the listener: wait for
                // the shutdown.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        match &self.address {
            Ok(address) => Ok(*address),
            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
        }
    }
}

pub(crate) fn error_response(error: Error) -> Response {
    let code = match error.code() {
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::InvalidArgument
        | ErrorCode::DigestMismatch
        | ErrorCode::SizeMismatch
        | ErrorCode::NamespaceNotFound => StatusCode::BAD_REQUEST,
        ErrorCode::ValueTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
        // An append-only caller's overwrite.
        ErrorCode::Conflict | ErrorCode::AlreadyExists => StatusCode::CONFLICT,
        ErrorCode::DiskFull => StatusCode::INSUFFICIENT_STORAGE,
        ErrorCode::Timeout
        | ErrorCode::NoQuorum
        | ErrorCode::Overloaded
        | ErrorCode::ShuttingDown
        | ErrorCode::NotLeader => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let mut response = (code, format!("{error}\n")).into_response();
    if code == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"tidepool\", Bearer"),
        );
    }
    response
}

async fn handle(
    State(gateway): State<Arc<Gateway>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match serve_request(&gateway, method, uri, headers, body).await {
        Ok(response) => response,
        Err(error) => error_response(error),
    }
}

async fn serve_request(
    gateway: &Gateway,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> tidepool_client::Result<Response> {
    let credential =
        Credential::from_header(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))?;
    let client = gateway.caller(credential).await?;
    let (instance, target) = resolve(gateway, uri.path()).await?;
    let (namespace, key) = match &target {
        Target::Cas(hash) => (&instance.cas, hash.to_vec()),
        Target::Ac(hash) => (&instance.ac, hash.to_vec()),
        Target::Key(key) => (&instance.ac, key.clone()),
    };
    let idle = gateway.config.http_limits.body_idle;
    match method {
        Method::GET => get(&client, &instance, &target, namespace, &key, Some(idle)).await,
        // An action-cache entry is there only with its outputs, as for GET.
        Method::HEAD if matches!(target, Target::Ac(_)) => {
            let response = get(&client, &instance, &target, namespace, &key, None).await?;
            let (parts, _) = response.into_parts();
            Ok(Response::from_parts(parts, Body::empty()))
        }
        Method::HEAD => {
            if let Target::Cas(hash) = &target
                && (BlobDigest {
                    hash: *hash,
                    size: 0,
                })
                .is_empty_blob()
            {
                return Ok(sized(StatusCode::OK, 0));
            }
            let meta = client.head(namespace, &key).await?;
            Ok(sized(StatusCode::OK, meta.size))
        }
        Method::PUT => {
            put(gateway, &client, namespace, &key, &target, &headers, body).await?;
            Ok(StatusCode::OK.into_response())
        }
        Method::DELETE => {
            if client.delete(namespace, &key).await? {
                Ok(StatusCode::OK.into_response())
            } else {
                Err(Error::new(ErrorCode::NotFound, "no such entry"))
            }
        }
        _ => Ok((
            StatusCode::METHOD_NOT_ALLOWED,
            [(header::ALLOW, "GET, HEAD, PUT, DELETE")],
        )
            .into_response()),
    }
}

fn sized(code: StatusCode, size: u64) -> Response {
    (code, [(header::CONTENT_LENGTH, size.to_string())]).into_response()
}

/// The instance and target a path names.
async fn resolve(gateway: &Gateway, path: &str) -> tidepool_client::Result<(Instance, Target)> {
    let trimmed = path.trim_start_matches('/');
    let segments: Vec<&str> = trimmed.split('/').collect();
    if segments.len() >= 2 {
        let kind = segments[segments.len() - 2];
        let prefix = segments[..segments.len() - 2].join("/");
        // `cas`/`ac` after a prefix that is no instance (ccache's `bazel`
        // layout under a URL path of its own) is a plain path key.
        // Only a definite "no such instance" makes one: a timeout (the
        // coordinators unreachable) stored an instance's CAS and AC writes
        // as path keys of the default instance, unverified, where its
        // readers would never look.
        let instance = if (kind == "cas" || kind == "ac") && Instance::parse(&prefix).is_ok() {
            match gateway.instance(&prefix).await {
                Ok(instance) => Some(instance),
                Err(e) if prefix.is_empty() || e.code() != ErrorCode::InvalidArgument => {
                    return Err(e);
                }
                Err(_) => None,
            }
        } else {
            None
        };
        // A last segment that is no SHA-256 makes a plain path key too:
        // ccache's `subdirs` layout puts the keys that start with `ac` at
        // `/ac/<the other 31 digits>` (before: 400, about 1 key in 256).
        if let Some(instance) = instance
            && let Ok(hash) = parse_hash(segments[segments.len() - 1])
        {
            let target = if kind == "cas" {
                Target::Cas(hash)
            } else {
                Target::Ac(hash)
            };
            return Ok((instance, target));
        }
        // `/INSTANCE/any/path` when INSTANCE is one. Unlike `cas`/`ac`
        // entries above, a name the gateway cannot resolve now makes the
        // whole path a key of the default instance: every ccache `subdirs`
        // path starts with a name that is no instance, and must be served
        // while the coordinators hang.
        if Instance::parse(segments[0]).is_ok()
            && let Ok(instance) = gateway.instance(segments[0]).await
        {
            let rest = &trimmed[segments[0].len()..];
            return Ok((instance, Target::Key(rest.as_bytes().to_vec())));
        }
    }
    if trimmed.is_empty() {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            "a path names an entry: /cas/<sha256>, /ac/<sha256> or any other path",
        ));
    }
    let instance = gateway.instance("").await?;
    Ok((instance, Target::Key(format!("/{trimmed}").into_bytes())))
}

async fn get(
    client: &Client,
    instance: &Instance,
    target: &Target,
    namespace: &str,
    key: &[u8],
    body: Option<Duration>,
) -> tidepool_client::Result<Response> {
    if let Target::Cas(hash) = target
        && (BlobDigest {
            hash: *hash,
            size: 0,
        })
        .is_empty_blob()
    {
        return Ok(sized(StatusCode::OK, 0));
    }
    let mut reader = client.open_range(namespace, key, 0, None).await?;
    let size = reader.size();
    let checked = matches!(target, Target::Ac(_)) && size <= AC_CHECK_BYTES;
    if !checked {
        cache::keep_alive(client, namespace, &reader).await;
    }
    if checked {
        let stored = reader.sha256();
        // The entry within the budget (never clamped to it:
        // `AC_CHECK_BYTES`), and its decoded form only if it decodes
        // (`wire::decodes_in_bounds`): counted 41 times over for every
        // entry, a ccache result of 5 MiB (not an `ActionResult`) held
        // most of the budget, and every action-cache lookup queued behind.
        let mut memory =
            cache::hold_memory(&AC_MEMORY, AC_MEMORY_BYTES, size, client.timeout()).await?;
        let mut bytes = Vec::with_capacity(size as usize);
        while let Some(piece) = reader.next_piece().await? {
            bytes.extend_from_slice(&piece);
        }
        if crate::wire::decodes_in_bounds(&bytes) {
            // Given back before asking for more: two requests each holding
            // part and waiting for the rest never both get it.
            drop(memory);
            let held = size
                .saturating_mul(1 + crate::wire::MAX_DECODED_RATIO)
                .saturating_add(crate::wire::SLACK_BYTES);
            memory =
                cache::hold_memory(&AC_MEMORY, AC_MEMORY_BYTES, held, client.timeout()).await?;
            if let Some(result) = cache::as_action_result(&bytes) {
                cache::require_outputs(client, instance, &result).await?;
            }
        }
        // Kept alive only as a hit: an entry whose outputs are gone, moved
        // to the current epoch at every lookup, never expired — and a
        // caller who may not overwrite (append-only) could never replace
        // it, so the action missed at every build for good.
        cache::keep_alive(client, namespace, &reader).await;
        if size <= AC_INLINE_BYTES || body.is_none() {
            return Ok((
                StatusCode::OK,
                [(header::CONTENT_LENGTH, size.to_string())],
                bytes,
            )
                .into_response());
        }
        // A large entry is sent from a second read, streamed: a slow client
        // must not hold the checked copy (nor its budget). It must be the
        // entry checked.
        drop((bytes, memory));
        reader = client.open_range(namespace, key, 0, None).await?;
        if reader.sha256() != stored {
            return Err(Error::new(
                ErrorCode::Conflict,
                "the action cache entry changed while it was checked; try again",
            ));
        }
    }
    // `body`: the idle bound of a GET's body; none for a HEAD.
    let Some(idle) = body else {
        return Ok(sized(StatusCode::OK, size));
    };
    Ok((
        StatusCode::OK,
        [(header::CONTENT_LENGTH, size.to_string())],
        streamed(reader, idle),
    )
        .into_response())
}

/// Bytes handed to a streamed response at a time: a client that reads at
/// all takes one well within the idle bound (a whole 4 MiB chunk at once
/// cut off clients slower than about 70 KB/s).
const STREAMED_PIECE: usize = 64 << 10;

/// A response body streamed from `reader`. A failure after the first byte
/// cuts it short (the client sees fewer bytes than `Content-Length`); a
/// client that takes less than [`STREAMED_PIECE`] for `idle` loses the
/// rest, and the reader and what it fetched ahead are let go.
pub(crate) fn streamed(mut reader: tidepool_client::BlobReader, idle: Duration) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        loop {
            let mut piece = match reader.next_piece().await {
                Ok(Some(piece)) => Bytes::from(piece),
                Ok(None) => return,
                Err(e) => {
                    let _ = feed(&tx, Err(std::io::Error::other(e.to_string())), idle).await;
                    return;
                }
            };
            // Copied out, not shared: parts queued for a client that stopped
            // reading would each keep the whole piece (up to a chunk) alive
            // after the producer let it go.
            while !piece.is_empty() {
                let part = piece.split_to(piece.len().min(STREAMED_PIECE));
                if !feed(&tx, Ok(Bytes::copy_from_slice(&part)), idle).await {
                    return;
                }
            }
        }
    });
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Hands `item` to a streamed response; false once its consumer is gone
/// or has taken nothing for `idle` (a client that stops reading must not
/// hold what the response's producer holds for ever).
pub(crate) async fn feed<T>(tx: &mpsc::Sender<T>, item: T, idle: Duration) -> bool {
    matches!(tokio::time::timeout(idle, tx.send(item)).await, Ok(Ok(())))
}

async fn put(
    gateway: &Gateway,
    client: &Client,
    namespace: &str,
    key: &[u8],
    target: &Target,
    headers: &HeaderMap,
    body: Body,
) -> tidepool_client::Result<()> {
    let max = gateway.config.max_blob_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(length) = declared
        && length > max
    {
        return Err(Error::new(
            ErrorCode::ValueTooLarge,
            format!("{length} bytes; at most {max} are accepted"),
        ));
    }
    let mut stream = body.into_data_stream();
    let idle = gateway.config.http_limits.body_idle;
    if let Target::Cas(hash) = target
        && (BlobDigest {
            hash: *hash,
            size: 0,
        })
        .is_empty_blob()
    {
        // Always there; but a body is checked against its name all the
        // same.
        while let Some(frame) = next_piece(&mut stream, idle).await? {
            if !frame.is_empty() {
                return Err(Error::new(
                    ErrorCode::DigestMismatch,
                    "the name is the empty blob's digest; the body is not empty",
                ));
            }
        }
        return Ok(());
    }
    let mut upload = client.upload(namespace, key).await?;
    while let Some(frame) = next_piece(&mut stream, idle).await? {
        if upload.written() + frame.len() as u64 > max {
            return Err(Error::new(
                ErrorCode::ValueTooLarge,
                format!("more than {max} bytes; not accepted"),
            ));
        }
        upload.write(&frame).await?;
    }
    if let Some(length) = declared
        && length != upload.written()
    {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "Content-Length said {length}, the body held {}",
                upload.written()
            ),
        ));
    }
    upload.finish().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamed response's producer gives up once its consumer has taken
    /// nothing for the idle bound (and at once when it is gone), so a
    /// client that stops reading holds no reader.
    #[tokio::test]
    async fn feeding_stops_when_the_consumer_stalls_or_goes() {
        let idle = Duration::from_millis(50);
        let (tx, mut rx) = mpsc::channel::<u32>(1);
        assert!(feed(&tx, 1, idle).await);
        let began = std::time::Instant::now();
        assert!(
            !feed(&tx, 2, idle).await,
            "nobody reads: the channel stays full"
        );
        assert!(began.elapsed() >= idle);
        assert_eq!(rx.recv().await, Some(1));
        assert!(feed(&tx, 3, idle).await);
        drop(rx);
        assert!(!feed(&tx, 4, idle).await);
    }
}
