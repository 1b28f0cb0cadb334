//! The build-cache gateway under faults: a `tidepool gateway` process on a
//! cluster (its own token, mutual TLS to the nodes, like a deployment),
//! driven over its HTTP cache protocol the way ccache and Bazel's HTTP
//! cache use it (`PUT /<instance>/cas/<sha256>` of new blobs, `GET` and
//! `HEAD` of blobs stored before, each client on one kept-alive
//! connection), and over the REAPI the way Bazel's `--remote_cache=grpc://`
//! does (outputs uploaded with `BatchUpdateBlobs` or a ByteStream `Write`,
//! `FindMissingBlobs`, `UpdateActionResult`; hits with `GetActionResult`,
//! `BatchReadBlobs` and ByteStream `Read`).
//!
//! What is recorded and checked (`CacheReport`):
//! - a blob whose PUT was answered 200 is found afterwards, whole: every
//!   later GET returns exactly its bytes (its SHA-256 is checked), every
//!   HEAD its size;
//! - a GET never returns other bytes than the blob's, and a cut-short body
//!   is counted apart (the gateway streams large blobs; a failure after the
//!   first byte can only cut the response short);
//! - a blob whose PUT failed (error status, or the connection lost) is at
//!   the end either absent or whole — never partly stored;
//! - an action whose result was recorded is found, with every output
//!   whole, whenever fetched and at the end; `FindMissingBlobs` never
//!   reports an acknowledged upload missing;
//! - every failed request, by status and the gateway's error code, and the
//!   longest stretch without an acknowledged PUT.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};
use tidepool_testkit::{TestProcess, free_port};
use tokio::sync::watch;

use crate::cluster::{Cluster, binary};

/// A `tidepool gateway` process serving one cluster.
pub struct GatewayProcess {
    /// Its HTTP cache address.
    pub http: SocketAddr,
    /// Its REAPI / ByteStream address.
    pub grpc: SocketAddr,
    /// The bearer token requests carry (the cluster's admin token).
    pub token: String,
    /// The running process (`None` while killed).
    pub process: Option<TestProcess>,
    args: Vec<String>,
    logs: Vec<PathBuf>,
    dir: PathBuf,
}

impl GatewayProcess {
    /// Starts a gateway on `cluster` (creating the default instance) and
    /// returns once it answers a lookup through the cluster.
    pub async fn start(cluster: &Cluster) -> GatewayProcess {
        let http: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        let mut args: Vec<String> = vec!["gateway".into()];
        for c in &cluster.coordinators {
            args.push("--coordinator".into());
            args.push(c.url.clone());
        }
        args.extend([
            "--http-listen".into(),
            http.to_string(),
            "--grpc-listen".into(),
            grpc.to_string(),
            "--token-file".into(),
            cluster.credentials.token_file.display().to_string(),
            "--create-instance".into(),
            INSTANCE.into(),
            // Kept as long as any run lasts: scenarios that advance the
            // epoch expire other namespaces, not the checked cache.
            "--retain".into(),
            "1000".into(),
        ]);
        args.extend(cluster.credentials.flags("client"));
        let mut gateway = GatewayProcess {
            http,
            grpc,
            token: cluster.credentials.token.clone(),
            process: None,
            args,
            logs: Vec::new(),
            dir: cluster.dir.path().to_path_buf(),
        };
        gateway.restart().await;
        gateway
    }

    /// Starts the process again (after `kill`) on the same ports and waits
    /// until it serves.
    pub async fn restart(&mut self) {
        let log = self
            .dir
            .join(format!("gateway.{}.log", self.logs.len() + 1));
        self.logs.push(log.clone());
        self.process = Some(TestProcess::spawn(
            binary().to_str().expect("utf-8"),
            &self.args,
            log,
        ));
        let deadline = Instant::now() + Duration::from_secs(60);
        let probe = cas_path(&[0xab; 32]);
        loop {
            let mut connection = Connection::new(self.http, &self.token);
            if let Ok(answer) = connection.request("GET", &probe, Bytes::new()).await
                && answer.status == 404
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway did not serve within 60 s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// Everything it logged, every run.
    pub fn log(&self) -> String {
        self.logs
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect()
    }

    /// Its log lines at ERROR level or with a panic.
    pub fn error_lines(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter(|l| l.contains(" ERROR ") || l.contains("panicked"))
            .map(str::to_string)
            .collect()
    }
}

/// The instance the load uses (namespaces `e2e-cache`, `e2e-cache.ac`),
/// created by the gateway.
pub const INSTANCE: &str = "e2e-cache";

/// One HTTP answer: its status, body (empty for HEAD) and declared length.
struct Answer {
    status: u16,
    body: Bytes,
    content_length: Option<u64>,
}

/// A kept-alive HTTP/1.1 connection, opened again after any failure.
struct Connection {
    address: SocketAddr,
    authorization: String,
    sender: Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>,
}

/// How one request ended when it got no answer.
#[derive(Debug)]
enum Lost {
    /// No connection, or it broke before the answer's head.
    Transport(String),
    /// The answer's body ended early or broke.
    CutShort(String),
}

impl Connection {
    fn new(address: SocketAddr, token: &str) -> Connection {
        Connection {
            address,
            authorization: format!("Bearer {token}"),
            sender: None,
        }
    }

    async fn request(&mut self, method: &str, path: &str, body: Bytes) -> Result<Answer, Lost> {
        let result = self.try_request(method, path, body).await;
        if result.is_err() {
            self.sender = None;
        }
        result
    }

    async fn try_request(&mut self, method: &str, path: &str, body: Bytes) -> Result<Answer, Lost> {
        if self.sender.as_mut().is_none_or(|s| s.is_closed()) {
            let stream = tokio::net::TcpStream::connect(self.address)
                .await
                .map_err(|e| Lost::Transport(format!("connect: {e}")))?;
            let (sender, connection) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| Lost::Transport(format!("handshake: {e}")))?;
            tokio::spawn(connection);
            self.sender = Some(sender);
        }
        let sender = self.sender.as_mut().expect("connected");
        sender
            .ready()
            .await
            .map_err(|e| Lost::Transport(format!("not ready: {e}")))?;
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "gateway")
            .header("authorization", &self.authorization)
            .header("content-length", body.len())
            .body(Full::new(body))
            .expect("request");
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| Lost::Transport(format!("send: {e}")))?;
        let status = response.status().as_u16();
        let content_length = response
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = if method == "HEAD" {
            Bytes::new()
        } else {
            response
                .into_body()
                .collect()
                .await
                .map_err(|e| Lost::CutShort(e.to_string()))?
                .to_bytes()
        };
        if method != "HEAD"
            && let Some(length) = content_length
            && length != body.len() as u64
        {
            return Err(Lost::CutShort(format!("{} of {length} bytes", body.len())));
        }
        Ok(Answer {
            status,
            body,
            content_length,
        })
    }
}

/// The HTTP cache path of a blob in [`INSTANCE`] (the instance as a URL
/// prefix, as `--remote_cache=http://HOST/INSTANCE` gives it).
fn cas_path(digest: &[u8; 32]) -> String {
    format!("/{INSTANCE}/cas/{}", hex(digest))
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A blob of `len` bytes from `seed`, and its SHA-256.
fn blob(seed: u64, len: usize) -> (Bytes, [u8; 32]) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut bytes = vec![0u8; len];
    rng.fill(&mut bytes[..]);
    bytes[..8.min(len)].copy_from_slice(&seed.to_le_bytes()[..8.min(len)]);
    let digest: [u8; 32] = Sha256::digest(&bytes).into();
    (Bytes::from(bytes), digest)
}

/// Sizes as a build cache sees them: mostly small objects, some of a few
/// hundred KiB, a few over the SDK's 4 MiB chunk (stored as several
/// chunks, streamed back).
fn blob_size(rng: &mut SmallRng) -> usize {
    match rng.random_range(0..100) {
        0..70 => rng.random_range(100..8 << 10),
        70..97 => rng.random_range(32 << 10..512 << 10),
        _ => rng.random_range((4 << 20) + 1..6 << 20),
    }
}

/// A client's pause after a request that got no answer.
const UNANSWERED_PAUSE: Duration = Duration::from_millis(100);

/// Shape of the load.
#[derive(Clone, Debug)]
pub struct CacheLoadOptions {
    /// Seed of sizes and contents.
    pub seed: u64,
    /// Clients storing new blobs.
    pub writers: usize,
    /// Clients reading blobs stored before (GET, and HEAD one time in four).
    pub readers: usize,
    /// Requests a second per writer, at most.
    pub writes_per_second: u32,
    /// REAPI clients (as Bazel with `--remote_cache=grpc://`): each in
    /// turn stores a new action (its outputs, then its result) or fetches
    /// a stored one (its result, then its outputs), at most
    /// `writes_per_second` a second.
    pub builders: usize,
    /// A request unanswered after this has failed (the client's timeout).
    pub timeout: Duration,
}

impl Default for CacheLoadOptions {
    fn default() -> Self {
        Self {
            seed: 1,
            writers: 3,
            readers: 3,
            writes_per_second: 20,
            builders: 2,
            timeout: Duration::from_secs(10),
        }
    }
}

/// A blob the load stored or tried to.
#[derive(Clone, Debug)]
struct Stored {
    seed: u64,
    len: usize,
    digest: [u8; 32],
}

/// What the load saw.
#[derive(Debug, Default)]
pub struct CacheReport {
    /// PUTs answered 200.
    pub puts_acknowledged: u64,
    /// PUTs that failed, by reason (`503 TIMEOUT`, `transport`, ...).
    pub puts_failed: BTreeMap<String, u64>,
    /// GETs and HEADs of acknowledged blobs answered with the blob.
    pub reads_ok: u64,
    /// Reads that failed, by reason; `404` here is an acknowledged blob
    /// not found.
    pub reads_failed: BTreeMap<String, u64>,
    /// GETs answered 200 with other bytes than the blob's.
    pub wrong_bytes: u64,
    /// Acknowledged blobs not found whole at the end.
    pub lost: Vec<String>,
    /// Blobs whose PUT failed found partly stored at the end.
    pub partial: Vec<String>,
    /// Blobs whose PUT failed found whole at the end (the write took
    /// effect; the client could not know).
    pub failed_but_stored: u64,
    /// Bytes acknowledged.
    pub bytes_acknowledged: u64,
    /// REAPI actions stored (outputs uploaded, result recorded).
    pub actions_stored: u64,
    /// REAPI cache hits served whole (result and every output).
    pub actions_fetched: u64,
    /// Uploads that `FindMissingBlobs` reported missing right after they
    /// were acknowledged.
    pub missing_after_upload: u64,
    /// When each acknowledged PUT completed.
    completions: Vec<Instant>,
}

impl CacheReport {
    /// The longest stretch between `from` and `to` without an
    /// acknowledged PUT.
    pub fn longest_put_gap(&self, from: Instant, to: Instant) -> Duration {
        let mut times: Vec<Instant> = self
            .completions
            .iter()
            .copied()
            .filter(|t| *t >= from && *t <= to)
            .collect();
        times.sort();
        let mut last = from;
        let mut longest = Duration::ZERO;
        for t in times.into_iter().chain(std::iter::once(to)) {
            longest = longest.max(t.duration_since(last));
            last = t;
        }
        longest
    }

    /// Panics unless every acknowledged blob was found whole whenever it
    /// was read and at the end, no read returned other bytes, and no
    /// failed upload left part of a blob.
    pub fn assert_intact(&self) {
        assert_eq!(self.wrong_bytes, 0, "reads returned other bytes");
        assert!(
            self.lost.is_empty(),
            "acknowledged blobs lost: {:?}",
            self.lost
        );
        assert!(
            self.partial.is_empty(),
            "failed uploads left part of a blob: {:?}",
            self.partial
        );
        assert!(
            !self
                .reads_failed
                .keys()
                .any(|k| k.starts_with("404") || k.contains("NotFound")),
            "an acknowledged blob or action result was not found: {:?}",
            self.reads_failed
        );
        assert_eq!(
            self.missing_after_upload, 0,
            "FindMissingBlobs reported acknowledged uploads missing"
        );
    }

    /// Failed requests of every kind.
    pub fn failures(&self) -> u64 {
        self.puts_failed.values().sum::<u64>() + self.reads_failed.values().sum::<u64>()
    }
}

#[derive(Default)]
struct Shared {
    acknowledged: Vec<Stored>,
    failed: Vec<Stored>,
    actions: Vec<reapi::Action>,
    report: CacheReport,
}

/// The load, running.
pub struct CacheLoad {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    shared: Arc<Mutex<Shared>>,
    gateway: SocketAddr,
    reapi: reapi::Reapi,
    token: String,
    timeout: Duration,
}

fn reason(answer: &Answer) -> String {
    let word = String::from_utf8_lossy(&answer.body[..answer.body.len().min(64)])
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .find(|w| !w.is_empty())
        .unwrap_or("")
        .to_string();
    format!("{} {word}", answer.status)
}

async fn timed(
    connection: &mut Connection,
    timeout: Duration,
    method: &str,
    path: &str,
    body: Bytes,
) -> Result<Answer, String> {
    match tokio::time::timeout(timeout, connection.request(method, path, body)).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(Lost::Transport(e))) => Err(format!("transport ({e})")),
        Ok(Err(Lost::CutShort(e))) => Err(format!("cut short ({e})")),
        Err(_) => {
            connection.sender = None;
            Err("client timeout".into())
        }
    }
}

/// Transport errors vary in their text; count them by kind only.
fn kind(reason: &str) -> String {
    reason.split(" (").next().unwrap_or(reason).to_string()
}

impl CacheLoad {
    /// Starts the writers and readers against `gateway`.
    pub fn start(gateway: &GatewayProcess, options: CacheLoadOptions) -> CacheLoad {
        println!("cache load: seed {}", options.seed);
        let (stop, stopped) = watch::channel(false);
        let shared = Arc::new(Mutex::new(Shared::default()));
        let mut tasks = Vec::new();
        for w in 0..options.writers {
            let shared = shared.clone();
            let stopped = stopped.clone();
            let options = options.clone();
            let mut connection = Connection::new(gateway.http, &gateway.token);
            tasks.push(tokio::spawn(async move {
                let mut rng = SmallRng::seed_from_u64(options.seed ^ (w as u64) << 32);
                let pause = Duration::from_secs(1) / options.writes_per_second.max(1);
                let mut n = 0u64;
                while !*stopped.borrow() {
                    n += 1;
                    let seed = options.seed.wrapping_mul(1_000_003) ^ ((w as u64) << 40) ^ n;
                    let len = blob_size(&mut rng);
                    let (bytes, digest) = blob(seed, len);
                    let stored = Stored { seed, len, digest };
                    let path = cas_path(&digest);
                    let started = Instant::now();
                    let outcome =
                        timed(&mut connection, options.timeout, "PUT", &path, bytes).await;
                    let unanswered = outcome.is_err();
                    {
                        let mut s = shared.lock();
                        match outcome {
                            Ok(answer) if answer.status == 200 => {
                                s.report.puts_acknowledged += 1;
                                s.report.bytes_acknowledged += len as u64;
                                s.report.completions.push(Instant::now());
                                s.acknowledged.push(stored);
                            }
                            Ok(answer) => {
                                *s.report.puts_failed.entry(reason(&answer)).or_default() += 1;
                                s.failed.push(stored);
                            }
                            Err(e) => {
                                *s.report.puts_failed.entry(kind(&e)).or_default() += 1;
                                s.failed.push(stored);
                            }
                        }
                    }
                    if unanswered {
                        // As a build tool would: no retry loop on a dead
                        // address, the next request a moment later.
                        tokio::time::sleep(UNANSWERED_PAUSE).await;
                    } else if let Some(rest) = pause.checked_sub(started.elapsed()) {
                        tokio::time::sleep(rest).await;
                    }
                }
            }));
        }
        for r in 0..options.readers {
            let shared = shared.clone();
            let stopped = stopped.clone();
            let options = options.clone();
            let mut connection = Connection::new(gateway.http, &gateway.token);
            tasks.push(tokio::spawn(async move {
                let mut rng = SmallRng::seed_from_u64(options.seed ^ 0x5eed ^ (r as u64) << 32);
                while !*stopped.borrow() {
                    let pick = {
                        let s = shared.lock();
                        (!s.acknowledged.is_empty()).then(|| {
                            s.acknowledged[rng.random_range(0..s.acknowledged.len())].clone()
                        })
                    };
                    let Some(stored) = pick else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    let head = rng.random_range(0..4) == 0;
                    let method = if head { "HEAD" } else { "GET" };
                    let path = cas_path(&stored.digest);
                    let outcome = timed(
                        &mut connection,
                        options.timeout,
                        method,
                        &path,
                        Bytes::new(),
                    )
                    .await;
                    if outcome.is_err() {
                        tokio::time::sleep(UNANSWERED_PAUSE).await;
                    }
                    let mut s = shared.lock();
                    match outcome {
                        Ok(answer) if answer.status == 200 => {
                            if head {
                                if answer.content_length == Some(stored.len as u64) {
                                    s.report.reads_ok += 1;
                                } else {
                                    *s.report
                                        .reads_failed
                                        .entry("HEAD wrong size".into())
                                        .or_default() += 1;
                                }
                            } else if Sha256::digest(&answer.body)[..] == stored.digest {
                                s.report.reads_ok += 1;
                            } else {
                                s.report.wrong_bytes += 1;
                            }
                        }
                        Ok(answer) => {
                            *s.report.reads_failed.entry(reason(&answer)).or_default() += 1;
                        }
                        Err(e) => {
                            *s.report.reads_failed.entry(kind(&e)).or_default() += 1;
                        }
                    }
                }
            }));
        }
        let client = reapi::Reapi::new(gateway.grpc, &gateway.token);
        for b in 0..options.builders {
            let shared = shared.clone();
            let stopped = stopped.clone();
            let options = options.clone();
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                build(b, client, shared, stopped, options).await;
            }));
        }
        CacheLoad {
            stop,
            tasks,
            shared,
            reapi: client,
            gateway: gateway.http,
            token: gateway.token.clone(),
            timeout: options.timeout,
        }
    }

    /// Requests failed so far.
    pub fn failures(&self) -> u64 {
        self.shared.lock().report.failures()
    }

    /// Stops the clients; [`StoppedCache::verify`] then reads back what
    /// they stored.
    pub async fn stop(self) -> StoppedCache {
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.await.expect("client task");
        }
        StoppedCache {
            shared: std::mem::take(&mut *self.shared.lock()),
            gateway: self.gateway,
            reapi: self.reapi,
            token: self.token,
            timeout: self.timeout,
        }
    }
}

/// A load whose clients stopped, with what they stored.
pub struct StoppedCache {
    shared: Shared,
    gateway: SocketAddr,
    reapi: reapi::Reapi,
    token: String,
    timeout: Duration,
}

/// Connections the read-back sweep uses at once.
const SWEEPERS: usize = 4;

impl StoppedCache {
    /// Reads back every blob the load stored or tried to store, and every
    /// action it stored, through the gateway, and reports.
    pub async fn verify(self) -> CacheReport {
        let mut shared = self.shared;
        let (gateway, token, timeout) = (self.gateway, self.token, self.timeout);
        // Every blob on one of a few connections at once: a soak stores
        // thousands, one at a time they took minutes.
        let blobs: Vec<(bool, Stored)> = (shared.acknowledged.iter().map(|s| (true, s.clone())))
            .chain(shared.failed.iter().map(|s| (false, s.clone())))
            .collect();
        let per = blobs.len().div_ceil(SWEEPERS).max(1);
        let sweeps: Vec<_> = blobs
            .chunks(per)
            .map(|part| {
                let (part, token) = (part.to_vec(), token.clone());
                tokio::spawn(async move {
                    let mut connection = Connection::new(gateway, &token);
                    let mut answers = Vec::with_capacity(part.len());
                    for (acknowledged, stored) in part {
                        let answer = sweep_get(&mut connection, timeout, &stored.digest).await;
                        answers.push((acknowledged, stored, answer));
                    }
                    answers
                })
            })
            .collect();
        for sweep in sweeps {
            for (acknowledged, stored, answer) in sweep.await.expect("sweep task") {
                let name = hex(&stored.digest);
                let whole = answer.as_ref().is_some_and(|a| {
                    a.status == 200 && Sha256::digest(&a.body)[..] == stored.digest
                });
                if acknowledged {
                    if !whole {
                        shared.report.lost.push(name);
                    }
                } else if whole {
                    assert_eq!(blob(stored.seed, stored.len).1, stored.digest);
                    shared.report.failed_but_stored += 1;
                } else if answer.map(|a| a.status) != Some(404) {
                    shared.report.partial.push(name);
                }
            }
        }
        for action in &shared.actions {
            let mut whole = false;
            for _ in 0..5 {
                match tokio::time::timeout(timeout, self.reapi.fetch(action)).await {
                    Ok(Ok(intact)) => {
                        whole = intact;
                        break;
                    }
                    Ok(Err(e)) if e.contains("NotFound") => break,
                    _ => tokio::time::sleep(Duration::from_millis(500)).await,
                }
            }
            if !whole {
                shared
                    .report
                    .lost
                    .push(format!("action {}", hex(&action.digest)));
            }
        }
        shared.report
    }
}

/// One REAPI client: stores a new action or fetches a stored one, in turn.
async fn build(
    b: usize,
    client: reapi::Reapi,
    shared: Arc<Mutex<Shared>>,
    stopped: watch::Receiver<bool>,
    options: CacheLoadOptions,
) {
    let mut rng = SmallRng::seed_from_u64(options.seed ^ 0xb1d ^ (b as u64) << 32);
    let pause = Duration::from_secs(1) / options.writes_per_second.max(1);
    let mut n = 0u64;
    while !*stopped.borrow() {
        let started = Instant::now();
        let stored = {
            let s = shared.lock();
            (!s.actions.is_empty() && rng.random_bool(0.5))
                .then(|| s.actions[rng.random_range(0..s.actions.len())].clone())
        };
        let failed = match stored {
            Some(action) => {
                let outcome = tokio::time::timeout(options.timeout, client.fetch(&action)).await;
                let mut s = shared.lock();
                match outcome {
                    Ok(Ok(true)) => {
                        s.report.actions_fetched += 1;
                        false
                    }
                    Ok(Ok(false)) => {
                        s.report.wrong_bytes += 1;
                        false
                    }
                    Ok(Err(e)) => {
                        *s.report.reads_failed.entry(e).or_default() += 1;
                        true
                    }
                    Err(_) => {
                        *s.report
                            .reads_failed
                            .entry("REAPI client timeout".into())
                            .or_default() += 1;
                        true
                    }
                }
            }
            None => {
                n += 1;
                let seed = options.seed.wrapping_mul(7_000_003) ^ ((b as u64) << 44) ^ n;
                let outputs = (0..rng.random_range(1..=3u64))
                    .map(|i| {
                        let seed = seed.wrapping_mul(31) ^ (i << 56);
                        let len = blob_size(&mut rng);
                        reapi::Output {
                            seed,
                            len,
                            digest: blob(seed, len).1,
                        }
                    })
                    .collect();
                let action = reapi::Action {
                    digest: blob(seed ^ 0xac7, 64).1,
                    outputs,
                };
                let upload = format!("{seed:016x}");
                let outcome =
                    tokio::time::timeout(options.timeout, client.store(&action, &upload)).await;
                let mut s = shared.lock();
                match outcome {
                    Ok(Ok(())) => {
                        s.report.actions_stored += 1;
                        s.report.completions.push(Instant::now());
                        s.actions.push(action);
                        false
                    }
                    Ok(Err(e)) if e == "missing" => {
                        s.report.missing_after_upload += 1;
                        false
                    }
                    Ok(Err(e)) => {
                        *s.report.puts_failed.entry(e).or_default() += 1;
                        true
                    }
                    Err(_) => {
                        *s.report
                            .puts_failed
                            .entry("REAPI client timeout".into())
                            .or_default() += 1;
                        true
                    }
                }
            }
        };
        if failed {
            tokio::time::sleep(UNANSWERED_PAUSE).await;
        } else if let Some(rest) = pause.checked_sub(started.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
}

/// A GET at the end, when the cluster is settled: retried a few times on
/// transport failures and 503 (a leader may still be moving).
async fn sweep_get(
    connection: &mut Connection,
    timeout: Duration,
    digest: &[u8; 32],
) -> Option<Answer> {
    let path = cas_path(digest);
    for _ in 0..5 {
        match timed(connection, timeout, "GET", &path, Bytes::new()).await {
            Ok(answer) if answer.status != 503 => return Some(answer),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    None
}

/// Bazel's side of the REAPI, reduced to what a build does with a remote
/// cache: after running an action, upload its outputs (small ones in
/// `BatchUpdateBlobs`, larger ones with a ByteStream `Write`), ask
/// `FindMissingBlobs` (nothing may be missing once uploaded), then
/// `UpdateActionResult`; on a later build, `GetActionResult` and read the
/// outputs back (`BatchReadBlobs`, ByteStream `Read`).
mod reapi {
    use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
    use bazel_remote_apis::google::bytestream::byte_stream_client::ByteStreamClient;
    use bazel_remote_apis::google::bytestream::{ReadRequest, WriteRequest};
    use re::action_cache_client::ActionCacheClient;
    use re::content_addressable_storage_client::ContentAddressableStorageClient;
    use tonic::transport::Channel;

    use super::{INSTANCE, blob, hex};

    /// Largest message either side sends.
    const MESSAGE_BYTES: usize = 16 << 20;
    /// Outputs at least this large go through ByteStream.
    pub(super) const STREAMED: usize = 1 << 20;
    /// Bytes per ByteStream write message (Bazel's default chunk is 16 KiB;
    /// larger here to keep the debug build's CPU for the cluster).
    const WRITE_PIECE: usize = 256 << 10;

    /// One output of an action: the blob's seed, size and SHA-256.
    #[derive(Clone, Debug)]
    pub(super) struct Output {
        pub seed: u64,
        pub len: usize,
        pub digest: [u8; 32],
    }

    /// An action and its outputs.
    #[derive(Clone, Debug)]
    pub(super) struct Action {
        pub digest: [u8; 32],
        pub outputs: Vec<Output>,
    }

    pub(super) fn digest(hash: &[u8; 32], len: usize) -> re::Digest {
        re::Digest {
            hash: hex(hash),
            size_bytes: len as i64,
        }
    }

    /// A gRPC client of the gateway with the bearer token on every call.
    #[derive(Clone)]
    pub(super) struct Reapi {
        channel: Channel,
        authorization: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
    }

    fn step(name: &str, status: &tonic::Status) -> String {
        format!("{name} {:?}", status.code())
    }

    impl Reapi {
        pub fn new(address: std::net::SocketAddr, token: &str) -> Reapi {
            let channel = Channel::from_shared(format!("http://{address}"))
                .expect("uri")
                .connect_lazy();
            Reapi {
                channel,
                authorization: format!("Bearer {token}").parse().expect("header"),
            }
        }

        fn request<T>(&self, message: T) -> tonic::Request<T> {
            let mut request = tonic::Request::new(message);
            request
                .metadata_mut()
                .insert("authorization", self.authorization.clone());
            request
        }

        fn cas(&self) -> ContentAddressableStorageClient<Channel> {
            ContentAddressableStorageClient::new(self.channel.clone())
                .max_decoding_message_size(MESSAGE_BYTES)
                .max_encoding_message_size(MESSAGE_BYTES)
        }

        fn bytestream(&self) -> ByteStreamClient<Channel> {
            ByteStreamClient::new(self.channel.clone())
                .max_decoding_message_size(MESSAGE_BYTES)
                .max_encoding_message_size(MESSAGE_BYTES)
        }

        fn action_cache(&self) -> ActionCacheClient<Channel> {
            ActionCacheClient::new(self.channel.clone())
                .max_decoding_message_size(MESSAGE_BYTES)
                .max_encoding_message_size(MESSAGE_BYTES)
        }

        /// Uploads `action`'s outputs and records its result. `Err` names
        /// the step that failed and its code; "missing" is a violation
        /// (an uploaded blob reported missing).
        pub async fn store(&self, action: &Action, upload: &str) -> Result<(), String> {
            let mut batch = Vec::new();
            for output in &action.outputs {
                let (bytes, _) = blob(output.seed, output.len);
                if output.len >= STREAMED {
                    let name = format!(
                        "{INSTANCE}/uploads/{upload}/blobs/{}/{}",
                        hex(&output.digest),
                        output.len
                    );
                    let mut requests: Vec<WriteRequest> = bytes
                        .chunks(WRITE_PIECE)
                        .enumerate()
                        .map(|(i, piece)| WriteRequest {
                            resource_name: if i == 0 { name.clone() } else { String::new() },
                            write_offset: (i * WRITE_PIECE) as i64,
                            finish_write: false,
                            data: piece.to_vec(),
                        })
                        .collect();
                    requests.last_mut().expect("bytes").finish_write = true;
                    let committed = self
                        .bytestream()
                        .write(self.request(tokio_stream::iter(requests)))
                        .await
                        .map_err(|s| step("Write", &s))?
                        .into_inner()
                        .committed_size;
                    if committed != output.len as i64 {
                        return Err(format!("Write committed {committed} of {}", output.len));
                    }
                } else {
                    batch.push(re::batch_update_blobs_request::Request {
                        digest: Some(digest(&output.digest, output.len)),
                        data: bytes.to_vec(),
                        ..Default::default()
                    });
                }
            }
            if !batch.is_empty() {
                let answer = self
                    .cas()
                    .batch_update_blobs(self.request(re::BatchUpdateBlobsRequest {
                        instance_name: INSTANCE.into(),
                        requests: batch,
                        ..Default::default()
                    }))
                    .await
                    .map_err(|s| step("BatchUpdateBlobs", &s))?
                    .into_inner();
                if let Some(failed) = answer
                    .responses
                    .iter()
                    .find_map(|r| r.status.as_ref().filter(|s| s.code != 0))
                {
                    return Err(format!("BatchUpdateBlobs item {}", failed.code));
                }
            }
            let missing = self
                .cas()
                .find_missing_blobs(
                    self.request(re::FindMissingBlobsRequest {
                        instance_name: INSTANCE.into(),
                        blob_digests: action
                            .outputs
                            .iter()
                            .map(|o| digest(&o.digest, o.len))
                            .collect(),
                        ..Default::default()
                    }),
                )
                .await
                .map_err(|s| step("FindMissingBlobs", &s))?
                .into_inner()
                .missing_blob_digests;
            if !missing.is_empty() {
                return Err("missing".into());
            }
            self.action_cache()
                .update_action_result(
                    self.request(re::UpdateActionResultRequest {
                        instance_name: INSTANCE.into(),
                        action_digest: Some(digest(&action.digest, 64)),
                        action_result: Some(re::ActionResult {
                            output_files: action
                                .outputs
                                .iter()
                                .enumerate()
                                .map(|(i, o)| re::OutputFile {
                                    path: format!("out/{i}"),
                                    digest: Some(digest(&o.digest, o.len)),
                                    ..Default::default()
                                })
                                .collect(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                )
                .await
                .map_err(|s| step("UpdateActionResult", &s))?;
            Ok(())
        }

        /// A cache hit: the action's result, then every output read back.
        /// `Ok(false)`: some bytes read were not the output's (a
        /// violation); `Err` names the step that failed ("GetActionResult
        /// NotFound" is a violation for a stored action).
        pub async fn fetch(&self, action: &Action) -> Result<bool, String> {
            let result = self
                .action_cache()
                .get_action_result(self.request(re::GetActionResultRequest {
                    instance_name: INSTANCE.into(),
                    action_digest: Some(digest(&action.digest, 64)),
                    ..Default::default()
                }))
                .await
                .map_err(|s| step("GetActionResult", &s))?
                .into_inner();
            let mut intact = result.output_files.len() == action.outputs.len();
            let mut batch = Vec::new();
            for output in &action.outputs {
                if output.len >= STREAMED {
                    let mut stream = self
                        .bytestream()
                        .read(self.request(ReadRequest {
                            resource_name: format!(
                                "{INSTANCE}/blobs/{}/{}",
                                hex(&output.digest),
                                output.len
                            ),
                            read_offset: 0,
                            read_limit: 0,
                        }))
                        .await
                        .map_err(|s| step("Read", &s))?
                        .into_inner();
                    let mut bytes = Vec::with_capacity(output.len);
                    while let Some(message) =
                        stream.message().await.map_err(|s| step("Read", &s))?
                    {
                        bytes.extend_from_slice(&message.data);
                    }
                    intact &= <sha2::Sha256 as sha2::Digest>::digest(&bytes)[..] == output.digest;
                } else {
                    batch.push(digest(&output.digest, output.len));
                }
            }
            if !batch.is_empty() {
                let answer = self
                    .cas()
                    .batch_read_blobs(self.request(re::BatchReadBlobsRequest {
                        instance_name: INSTANCE.into(),
                        digests: batch.clone(),
                        ..Default::default()
                    }))
                    .await
                    .map_err(|s| step("BatchReadBlobs", &s))?
                    .into_inner();
                if let Some(failed) = answer
                    .responses
                    .iter()
                    .find_map(|r| r.status.as_ref().filter(|s| s.code != 0))
                {
                    return Err(format!("BatchReadBlobs item {}", failed.code));
                }
                intact &= answer.responses.len() == batch.len();
                for response in &answer.responses {
                    let hash = <sha2::Sha256 as sha2::Digest>::digest(&response.data);
                    intact &= response
                        .digest
                        .as_ref()
                        .is_some_and(|d| d.hash == hex(&hash) && batch.contains(d));
                }
            }
            Ok(intact)
        }
    }
}
