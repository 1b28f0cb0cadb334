//! restic's REST backend protocol (version 2, with version-1 listings), on
//! axum: Tidepool as a restic repository (`restic -r rest:http://…/REPO/`).
//!
//! Paths, under an optional repository path (`REPO`, one or more segments;
//! the root is a repository too):
//! - `POST REPO/?create=true`: create the repository (200);
//! - `HEAD|GET|POST|DELETE REPO/config`;
//! - `GET REPO/TYPE/`: the objects of a type (`data`, `keys`, `locks`,
//!   `snapshots`, `index`), as version-2 JSON `[{"name","size"}]` with
//!   content type `application/vnd.x.restic.rest.v2` when the request
//!   accepts it, else version 1 (names only);
//! - `HEAD|GET|POST|DELETE REPO/TYPE/NAME`; `GET` honours `Range`.
//!
//! Storage: the gateway's restic namespace (durable, not content-addressed)
//! holds `REPO/config` and `REPO/TYPE/NAME`; locks live in the namespace
//! `NAMESPACE.locks`, so an append-only token (`NAMESPACE=append-only,
//! NAMESPACE.locks=write,delete`) can back up — create and remove its locks
//! — but never delete or overwrite anything else. Every object but
//! `config` is named by the SHA-256 of its bytes, checked on upload. With
//! `private_repos`, a repository's first path segment must be the Basic
//! user name. See `docs/design/restic.md`.

use std::sync::Arc;
use std::time::Duration;
use tidepool_telemetry::MethodNames;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Uri, header};
use tidepool_client::proto::v1::{ClusterMap, retention};
use tidepool_client::{Client, Error, ErrorCode, ListOptions};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::{Credential, Gateway};

/// The content type of version-2 listings.
const V2: &str = "application/vnd.x.restic.rest.v2";
/// The content type of version-1 listings.
const V1: &str = "application/vnd.x.restic.rest.v1";
/// The object types of a repository.
const TYPES: [&str; 5] = ["data", "keys", "locks", "snapshots", "index"];
/// Suffix of the namespace holding locks.
pub const LOCKS_SUFFIX: &str = ".locks";

/// How the restic endpoint behaves.
#[derive(Clone, Debug)]
pub struct ResticConfig {
    /// Where it is served.
    pub listen: std::net::SocketAddr,
    /// The namespace holding the repositories (locks: `NAMESPACE.locks`).
    pub namespace: String,
    /// Refuse every DELETE but of locks, and every overwrite, whatever
    /// the caller's token allows (`rest-server --append-only`).
    pub append_only: bool,
    /// A repository's first path segment must be the caller's Basic user
    /// name (`rest-server --private-repos`).
    pub private_repos: bool,
}

impl ResticConfig {
    /// Served on `listen`, repositories in namespace `restic`.
    pub fn new(listen: std::net::SocketAddr) -> Self {
        Self {
            listen,
            namespace: "restic".into(),
            append_only: false,
            private_repos: false,
        }
    }
}

/// What a request path names.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// The repository itself (`POST ?create=true`).
    Repo,
    Config,
    List(&'static str),
    Object(&'static str, String),
}

/// A parsed request path: the repository (no leading or trailing `/`) and
/// the target.
#[derive(Debug, PartialEq, Eq)]
struct Parsed {
    repo: String,
    target: Target,
}

fn bad(message: impl Into<String>) -> Error {
    Error::new(ErrorCode::InvalidArgument, message)
}

fn kind_of(segment: &str) -> Option<&'static str> {
    TYPES.iter().copied().find(|t| *t == segment)
}

fn check_repo(segments: &[&str]) -> tidepool_client::Result<String> {
    for segment in segments {
        let fine = !segment.is_empty()
            && *segment != "."
            && *segment != ".."
            && segment
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !fine {
            return Err(bad(format!(
                "repository path segment {segment:?}: use letters, digits, '.', '_' and '-'"
            )));
        }
    }
    Ok(segments.join("/"))
}

fn is_name(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn parse(method: &Method, path: &str, query: Option<&str>) -> tidepool_client::Result<Parsed> {
    let trimmed = path.trim_start_matches('/');
    let segments: Vec<&str> = trimmed.split('/').collect();
    let n = segments.len();
    let last = segments[n - 1];
    // Creating a repository, whatever its last segment says: a repository
    // may end in a type's name (`/backup/data/`), which read otherwise
    // would be a listing of `data` in `/backup/`.
    let creating = query.is_some_and(|q| q.split('&').any(|p| p == "create=true"));
    if *method == Method::POST && creating {
        let end = if last.is_empty() { n - 1 } else { n };
        let repo = if end == 0 {
            String::new()
        } else {
            check_repo(&segments[..end])?
        };
        return Ok(Parsed {
            repo,
            target: Target::Repo,
        });
    }
    if last == "config" {
        let repo = check_repo(&segments[..n - 1])?;
        return Ok(Parsed {
            repo,
            target: Target::Config,
        });
    }
    if n >= 2
        && let Some(kind) = kind_of(segments[n - 2])
    {
        let repo = check_repo(&segments[..n - 2])?;
        if last.is_empty() {
            return Ok(Parsed {
                repo,
                target: Target::List(kind),
            });
        }
        if !is_name(last) {
            return Err(bad(format!(
                "{last:?} is not an object name (64 lowercase hex digits, the SHA-256 of its bytes)"
            )));
        }
        return Ok(Parsed {
            repo,
            target: Target::Object(kind, last.to_string()),
        });
    }
    // `GET REPO/TYPE` without the trailing slash lists too.
    if *method == Method::GET
        && let Some(kind) = kind_of(last)
    {
        let repo = check_repo(&segments[..n - 1])?;
        return Ok(Parsed {
            repo,
            target: Target::List(kind),
        });
    }
    Err(Error::new(
        ErrorCode::NotFound,
        format!("{path:?} names nothing in a restic repository"),
    ))
}

impl Parsed {
    fn prefix(&self) -> String {
        if self.repo.is_empty() {
            String::new()
        } else {
            format!("{}/", self.repo)
        }
    }

    /// The namespace and key of the config or of an object.
    fn location(&self, namespace: &str) -> (String, Vec<u8>) {
        let prefix = self.prefix();
        match &self.target {
            Target::Object(kind, name) => (
                namespace_of(namespace, kind),
                format!("{prefix}{kind}/{name}").into_bytes(),
            ),
            _ => (
                namespace.to_string(),
                format!("{prefix}config").into_bytes(),
            ),
        }
    }
}

fn namespace_of(namespace: &str, kind: &str) -> String {
    if kind == "locks" {
        format!("{namespace}{LOCKS_SUFFIX}")
    } else {
        namespace.to_string()
    }
}

/// The Basic user name of a request, if it sent one.
fn basic_user(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let (user, password) = decoded.split_once(':')?;
    (!password.is_empty() && !user.is_empty()).then(|| user.to_string())
}

/// Serves the restic endpoint on `listener` until `stop`.
pub(crate) async fn serve(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    stop: watch::Receiver<bool>,
) {
    let counted = gateway
        .metrics
        .layer("restic", MethodNames::Http(crate::HTTP_METHODS))
        .traced();
    let limits = gateway.config.http_limits.clone();
    let app = Router::new()
        .fallback(handle)
        .with_state(gateway)
        .layer(counted);
    crate::http::serve_app(app, listener, tls, limits, stop).await;
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
        // An append-only caller's overwrite: refused, as rest-server does.
        Err(error) if error.code() == ErrorCode::AlreadyExists => {
            crate::http::error_response(Error::new(ErrorCode::PermissionDenied, error.to_string()))
        }
        Err(error) => crate::http::error_response(error),
    }
}

async fn serve_request(
    gateway: &Gateway,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> tidepool_client::Result<Response> {
    let restic = gateway
        .config
        .restic
        .as_ref()
        .expect("served only when configured");
    let credential =
        Credential::from_header(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))?;
    let secret = match &credential {
        Credential::Token(secret) => Some(secret.clone()),
        Credential::Anonymous => None,
    };
    let client = gateway.caller(credential).await?;
    let idle = gateway.config.http_limits.body_idle;
    let parsed = parse(&method, uri.path(), uri.query())?;
    if restic.private_repos {
        let user = basic_user(&headers).ok_or_else(|| {
            Error::new(
                ErrorCode::Unauthenticated,
                "private repositories: send Basic credentials (rest:http://USER:TOKEN@host/USER/…)",
            )
        })?;
        if parsed.repo.split('/').next() != Some(user.as_str()) {
            return Err(Error::new(
                ErrorCode::PermissionDenied,
                format!("user {user:?} may only use repositories under /{user}/"),
            ));
        }
        // The user name is only a claim: it must be the token's name, as
        // the coordinator authenticates it, or any token could open any
        // user's repositories. A cluster that checks no tokens has no
        // names to hold it to (as rest-server without authentication).
        let secret = secret.as_deref().unwrap_or_default();
        if let Some(name) = gateway.token_name(secret, &client).await?
            && name != user
        {
            return Err(Error::new(
                ErrorCode::PermissionDenied,
                format!(
                    "private repositories: the user name must be the token's name; this token is {name:?}, not {user:?}"
                ),
            ));
        }
    }
    let namespace = restic.namespace.as_str();
    let map = client.map();
    for name in [namespace.to_string(), format!("{namespace}{LOCKS_SUFFIX}")] {
        unfit_namespace(&map, &name).map_or(Ok(()), Err)?;
    }
    match (&parsed.target, method) {
        (Target::Repo, Method::POST) => {
            // Nothing to make: a repository is its keys. Checked only so a
            // caller learns early that the namespace is missing.
            client
                .list_page(namespace, ListOptions::default(), 1)
                .await?;
            Ok(StatusCode::OK.into_response())
        }
        (Target::List(kind), Method::GET) => {
            list(&client, namespace, &parsed, kind, &headers, idle).await
        }
        (Target::Config | Target::Object(..), Method::HEAD) => {
            let (namespace, key) = parsed.location(namespace);
            let meta = client.head(&namespace, &key).await?;
            Ok((
                StatusCode::OK,
                [(header::CONTENT_LENGTH, meta.size.to_string())],
            )
                .into_response())
        }
        (Target::Config | Target::Object(..), Method::GET) => {
            let (namespace, key) = parsed.location(namespace);
            get(&client, &namespace, &key, &headers, idle).await
        }
        (Target::Config, Method::POST) => {
            // The one object written under a fixed name: stored only into
            // an empty key, in every mode, as rest-server does — decided
            // where the write applies (an existence check first let two
            // racing `init`s both store theirs, and the second locked the
            // first out of its repository).
            let (namespace, key) = parsed.location(namespace);
            let mut content = Vec::new();
            let mut stream = body.into_data_stream();
            while let Some(piece) = crate::http::next_piece(&mut stream, idle).await? {
                if content.len() + piece.len() > client.chunk_size() {
                    return Err(Error::new(
                        ErrorCode::ValueTooLarge,
                        "a repository's config is small: this one is not accepted",
                    ));
                }
                content.extend_from_slice(&piece);
            }
            let declared = headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok());
            if declared.is_some_and(|length| length != content.len()) {
                return Err(bad(format!(
                    "Content-Length said {declared:?}, the body held {}",
                    content.len()
                )));
            }
            match client.put_if_absent(&namespace, &key, &content).await {
                // The same config again is a retry of a store whose answer
                // was lost (a timeout): done.
                Err(e) if e.code() == ErrorCode::AlreadyExists => {
                    if client.get(&namespace, &key).await? == content {
                        Ok(StatusCode::OK.into_response())
                    } else {
                        Err(Error::new(
                            ErrorCode::PermissionDenied,
                            "the repository has a config already; it is never overwritten \
                             (delete it first, as restic's migrations do)",
                        ))
                    }
                }
                Err(e) => Err(e),
                Ok(_) => Ok(StatusCode::OK.into_response()),
            }
        }
        (Target::Object(_, name), Method::POST) => {
            let (namespace, key) = parsed.location(namespace);
            let expected = crate::names::parse_hash(name).map_err(bad)?;
            // An object is named by the SHA-256 of its bytes: one stored
            // whole under its name (its hash checked on upload) holds these
            // bytes already. Answered once the body is seen to hash to the
            // name, without storing it again: a retry after a lost answer
            // succeeds in append-only mode (where an overwrite is refused,
            // and restic gives up on a refusal), and no upload of chunks
            // is left behind for a caller that may not delete them.
            match client.head(&namespace, &key).await {
                Ok(meta) if meta.sha256 == expected => {
                    return confirm(gateway, &headers, body, &expected).await;
                }
                // Something else (written around the gateway): replaced,
                // where overwrites are allowed.
                Ok(_) if restic.append_only => {
                    return Err(Error::new(
                        ErrorCode::PermissionDenied,
                        "append-only: an existing object is never overwritten",
                    ));
                }
                Ok(_) => {}
                Err(e) if e.code() == ErrorCode::NotFound => {}
                Err(e) => return Err(e),
            }
            put(
                gateway, &client, &namespace, &key, &expected, &headers, body,
            )
            .await?;
            Ok(StatusCode::OK.into_response())
        }
        (Target::Config | Target::Object(..), Method::DELETE) => {
            let lock = matches!(parsed.target, Target::Object("locks", _));
            if restic.append_only && !lock {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "append-only: only locks are deleted",
                ));
            }
            let (namespace, key) = parsed.location(namespace);
            // Gone either way: a missing object is no error (rest-server
            // makes deletes idempotent; a retry of a delete whose answer
            // was lost found nothing, and a 404 there failed restic's
            // prune).
            client.delete(&namespace, &key).await?;
            Ok(StatusCode::OK.into_response())
        }
        // With the methods the path takes (RFC 9110 requires `Allow`).
        (target, _) => {
            let allow = match target {
                Target::Repo => "POST",
                Target::List(_) => "GET",
                Target::Config | Target::Object(..) => "HEAD, GET, POST, DELETE",
            };
            Ok((StatusCode::METHOD_NOT_ALLOWED, [(header::ALLOW, allow)]).into_response())
        }
    }
}

#[derive(serde::Serialize)]
struct Listed<'a> {
    name: &'a str,
    size: u64,
}

/// Streams the listing of one type: names and sizes of the objects. The
/// first entry is fetched before the answer, so a refusal (no permission,
/// no such namespace, shards unavailable) is the response's status; a
/// failure later cuts the body short — broken JSON, never a partial list
/// taken for whole.
async fn list(
    client: &Client,
    namespace: &str,
    parsed: &Parsed,
    kind: &str,
    headers: &HeaderMap,
    idle: Duration,
) -> tidepool_client::Result<Response> {
    let v2 = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().starts_with(V2)));
    let prefix = format!("{}{kind}/", parsed.prefix()).into_bytes();
    let mut lister = client.list(
        &namespace_of(namespace, kind),
        ListOptions {
            prefix: prefix.clone(),
            ..ListOptions::default()
        },
    );
    let mut next = Some(listed(&mut lister).await?);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        let mut piece = b"[".to_vec();
        let mut first = true;
        loop {
            let entry = match next.take() {
                Some(entry) => Ok(entry),
                None => listed(&mut lister).await,
            };
            let entry = match entry {
                Ok(Some(entry)) => entry,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "a restic listing failed");
                    let _ = crate::http::feed(&tx, Err(std::io::Error::other(e.to_string())), idle)
                        .await;
                    return;
                }
            };
            // Only this repository's own objects: not a nested repository's.
            let Ok(name) = std::str::from_utf8(&entry.key[prefix.len()..]) else {
                continue;
            };
            if !is_name(name) {
                continue;
            }
            if !first {
                piece.push(b',');
            }
            first = false;
            let item = if v2 {
                serde_json::to_vec(&Listed {
                    name,
                    size: entry.size,
                })
            } else {
                serde_json::to_vec(name)
            };
            piece.extend_from_slice(&item.expect("serialisable"));
            if piece.len() >= 64 << 10
                && !crate::http::feed(&tx, Ok(Bytes::from(std::mem::take(&mut piece))), idle).await
            {
                return;
            }
        }
        piece.push(b']');
        let _ = crate::http::feed(&tx, Ok(Bytes::from(piece)), idle).await;
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, if v2 { V2 } else { V1 })],
        body,
    )
        .into_response())
}

/// The listing's next entry. A shard holding blobs stored before keys were
/// indexed (by an older version) cannot list them: a list without them
/// would be taken for whole (`prune` deletes packs only unlisted index
/// files name), so it fails.
async fn listed(
    lister: &mut tidepool_client::Lister,
) -> tidepool_client::Result<Option<tidepool_client::ListEntry>> {
    let next = lister.next().await?;
    if lister.incomplete() {
        return Err(Error::new(
            ErrorCode::Unsupported,
            "a shard holds objects stored by an older version, before keys were indexed: they cannot be listed",
        ));
    }
    Ok(next)
}

/// The byte range a `Range` header asks of a blob of `size` bytes:
/// `(offset, length)`, `None` for the whole blob, or an error when no byte
/// of the range exists (416). As RFC 9110 has it, a header this server
/// does not take is ignored and the blob sent whole: another unit than
/// `bytes`, a malformed or backwards range, several ranges.
fn range(headers: &HeaderMap, size: u64) -> tidepool_client::Result<Option<(u64, u64)>> {
    let Some(value) = headers.get(header::RANGE) else {
        return Ok(None);
    };
    // An empty object is sent whole whatever the range (as rest-server's
    // Go `ServeContent` does; restic asks `bytes=0-` of every object).
    if size == 0 {
        return Ok(None);
    }
    let unsatisfiable = || {
        Error::new(
            ErrorCode::InvalidArgument,
            format!("range {value:?} of a {size}-byte object"),
        )
    };
    let Some(spec) = value.to_str().ok().and_then(|t| t.strip_prefix("bytes=")) else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let Some((start, end)) = spec.split_once('-') else {
        return Ok(None);
    };
    let (start, end) = (start.trim(), end.trim());
    let number = |s: &str| s.parse::<u64>().ok();
    let (offset, last) = match (start.is_empty(), end.is_empty()) {
        // The last N bytes; none is a range of no byte.
        (true, false) => match number(end) {
            Some(0) => return Err(unsatisfiable()),
            Some(n) => (size - n.min(size), size - 1),
            None => return Ok(None),
        },
        (false, true) => match number(start) {
            Some(first) => (first, size - 1),
            None => return Ok(None),
        },
        (false, false) => match (number(start), number(end)) {
            (Some(first), Some(last)) if first <= last => (first, last.min(size - 1)),
            _ => return Ok(None),
        },
        (true, true) => return Ok(None),
    };
    if offset >= size {
        return Err(unsatisfiable());
    }
    Ok(Some((offset, last - offset + 1)))
}

async fn get(
    client: &Client,
    namespace: &str,
    key: &[u8],
    headers: &HeaderMap,
    idle: Duration,
) -> tidepool_client::Result<Response> {
    let size = client.head(namespace, key).await?.size;
    let range = match range(headers, size) {
        Ok(range) => range,
        Err(e) => {
            return Ok((
                StatusCode::RANGE_NOT_SATISFIABLE,
                [(header::CONTENT_RANGE, format!("bytes */{size}"))],
                format!("{e}\n"),
            )
                .into_response());
        }
    };
    let (offset, length) = range.unwrap_or((0, size));
    // A range of the whole object is read as a whole one, so the object's
    // digest and size are checked at its end (restic asks `bytes=0-`).
    let limit = (offset > 0 || length < size).then_some(length);
    let reader = client.open_range(namespace, key, offset, limit).await?;
    if reader.size() != size {
        // Replaced since its size was read (only `config` ever is): the
        // headers would not describe the bytes.
        return Err(Error::new(
            ErrorCode::Conflict,
            "the object changed while it was being read; try again",
        ));
    }
    let body = crate::http::streamed(reader, idle);
    let mut response = (
        if range.is_some() {
            StatusCode::PARTIAL_CONTENT
        } else {
            StatusCode::OK
        },
        [(header::CONTENT_LENGTH, length.to_string())],
        body,
    )
        .into_response();
    if range.is_some() {
        response.headers_mut().insert(
            header::CONTENT_RANGE,
            format!("bytes {offset}-{}/{size}", offset + length - 1)
                .parse()
                .expect("ascii"),
        );
    }
    Ok(response)
}

/// Why `namespace` cannot hold restic's objects, if it cannot: blobs that
/// expire (a pack is never written again, and reads touch nothing, so a
/// backup's packs would be dropped under it) or keys that must be digests
/// (restic's names are paths). `None` also for a namespace the map does
/// not hold (its requests answer `NAMESPACE_NOT_FOUND`).
pub(crate) fn unfit_namespace(map: &ClusterMap, namespace: &str) -> Option<Error> {
    let found = map.namespaces.iter().find(|n| n.name == namespace)?;
    let durable = matches!(
        found.retention.as_ref().and_then(|r| r.policy.as_ref()),
        None | Some(retention::Policy::Durable(_))
    );
    let why = if found.content_addressed {
        "is content-addressed (its keys must be digests; restic's are paths)"
    } else if !durable {
        "drops blobs some epochs after their last write (restic writes a pack once and never again: a backup would lose its data)"
    } else {
        return None;
    };
    Some(Error::new(
        ErrorCode::Internal,
        format!(
            "namespace {namespace:?} {why}: the gateway's restic namespaces must be durable and not content-addressed (see docs/design/restic.md)"
        ),
    ))
}

/// The body's length as its `Content-Length` declares it, refused above
/// the gateway's largest blob.
fn declared_length(gateway: &Gateway, headers: &HeaderMap) -> tidepool_client::Result<Option<u64>> {
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
    Ok(declared)
}

/// The pieces of an upload's body: at most the gateway's largest blob, and
/// as many bytes as `Content-Length` declared, if it did (checked at the
/// end).
struct Pieces {
    stream: axum::body::BodyDataStream,
    idle: Duration,
    max: u64,
    declared: Option<u64>,
    taken: u64,
}

impl Pieces {
    fn new(gateway: &Gateway, headers: &HeaderMap, body: Body) -> tidepool_client::Result<Self> {
        Ok(Self {
            stream: body.into_data_stream(),
            idle: gateway.config.http_limits.body_idle,
            max: gateway.config.max_blob_bytes,
            declared: declared_length(gateway, headers)?,
            taken: 0,
        })
    }

    /// The next piece; `None` at the end of a body of the declared length.
    async fn next(&mut self) -> tidepool_client::Result<Option<Bytes>> {
        let Some(piece) = crate::http::next_piece(&mut self.stream, self.idle).await? else {
            if let Some(length) = self.declared
                && length != self.taken
            {
                return Err(bad(format!(
                    "Content-Length said {length}, the body held {}",
                    self.taken
                )));
            }
            return Ok(None);
        };
        if self.taken + piece.len() as u64 > self.max {
            return Err(Error::new(
                ErrorCode::ValueTooLarge,
                format!("more than {} bytes; not accepted", self.max),
            ));
        }
        self.taken += piece.len() as u64;
        Ok(Some(piece))
    }
}

/// Stores a body under `key` if it hashes to `expected` (its name).
async fn put(
    gateway: &Gateway,
    client: &Client,
    namespace: &str,
    key: &[u8],
    expected: &[u8; 32],
    headers: &HeaderMap,
    body: Body,
) -> tidepool_client::Result<()> {
    let mut pieces = Pieces::new(gateway, headers, body)?;
    let mut upload = client.upload(namespace, key).await?;
    // The upload hashes what it stores; it stores nothing under the key
    // unless the bytes hash to the name (DIGEST_MISMATCH).
    upload.expect_sha256(*expected);
    while let Some(piece) = pieces.next().await? {
        upload.write(&piece).await?;
    }
    upload.finish().await?;
    Ok(())
}

/// Answers the upload of an object stored already: 200 if the body hashes
/// to its name (the stored bytes, then), else what an upload of it would
/// have answered. Nothing is stored.
async fn confirm(
    gateway: &Gateway,
    headers: &HeaderMap,
    body: Body,
    expected: &[u8; 32],
) -> tidepool_client::Result<Response> {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    let mut pieces = Pieces::new(gateway, headers, body)?;
    while let Some(piece) = pieces.next().await? {
        hasher.update(&piece);
    }
    if hasher.finalize()[..] != expected[..] {
        return Err(Error::new(
            ErrorCode::DigestMismatch,
            "the body does not hash to the object's name",
        ));
    }
    Ok(StatusCode::OK.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn parsed(method: Method, path: &str, query: Option<&str>) -> Parsed {
        parse(&method, path, query).unwrap()
    }

    #[test]
    fn paths_name_repositories_and_objects() {
        let p = parsed(Method::POST, "/", Some("create=true"));
        assert_eq!((p.repo.as_str(), p.target), ("", Target::Repo));
        let p = parsed(Method::POST, "/team/repo/", Some("create=true"));
        assert_eq!((p.repo.as_str(), p.target), ("team/repo", Target::Repo));
        let p = parsed(Method::HEAD, "/config", None);
        assert_eq!((p.repo.as_str(), &p.target), ("", &Target::Config));
        assert_eq!(p.location("restic"), ("restic".into(), b"config".to_vec()));
        let p = parsed(Method::GET, "/r/data/", None);
        assert_eq!((p.repo.as_str(), p.target), ("r", Target::List("data")));
        let p = parsed(Method::GET, "/r/locks", None);
        assert_eq!(p.target, Target::List("locks"));
        let p = parsed(Method::POST, &format!("/a/b/locks/{NAME}"), None);
        assert_eq!(
            p.location("restic"),
            (
                "restic.locks".into(),
                format!("a/b/locks/{NAME}").into_bytes()
            )
        );
        // A repository may be called like a type, and be created so.
        let p = parsed(Method::GET, &format!("/data/data/{NAME}"), None);
        assert_eq!(p.repo, "data");
        for (path, repo) in [("/data/", "data"), ("/backup/keys/", "backup/keys")] {
            let p = parsed(Method::POST, path, Some("create=true"));
            assert_eq!((p.repo.as_str(), p.target), (repo, Target::Repo), "{path}");
        }
        for bad in ["/r/data/xyz", "/../config", "/r/other/", "/r/data/ABC"] {
            assert!(parse(&Method::GET, bad, None).is_err(), "{bad}");
        }
        assert!(parse(&Method::POST, "/r/", None).is_err());
    }

    #[test]
    fn ranges() {
        let headers = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::RANGE, v.parse().unwrap());
            h
        };
        assert_eq!(range(&HeaderMap::new(), 10).unwrap(), None);
        assert_eq!(range(&headers("bytes=0-9"), 10).unwrap(), Some((0, 10)));
        assert_eq!(range(&headers("bytes=2-4"), 10).unwrap(), Some((2, 3)));
        assert_eq!(range(&headers("bytes=5-"), 10).unwrap(), Some((5, 5)));
        assert_eq!(range(&headers("bytes=-3"), 10).unwrap(), Some((7, 3)));
        assert_eq!(range(&headers("bytes=8-100"), 10).unwrap(), Some((8, 2)));
        // No byte of these exists: 416.
        for unsatisfiable in ["bytes=10-", "bytes=12-20", "bytes=-0"] {
            assert!(
                range(&headers(unsatisfiable), 10).is_err(),
                "{unsatisfiable}"
            );
        }
        // Ignored: the object is sent whole (RFC 9110 section 14.2).
        for ignored in [
            "bytes=4-2",
            "items=0-1",
            "bytes=0-1,3-4",
            "bytes=-",
            "bytes=x-3",
            "bytes",
        ] {
            assert_eq!(range(&headers(ignored), 10).unwrap(), None, "{ignored}");
        }
        assert_eq!(range(&headers("bytes=0-"), 0).unwrap(), None);
    }
}
