//! The build-cache gateway with the real build tools, against `tidepool
//! dev` (TLS and tokens, as `make run` starts it): Bazel 4.2.3 (Debian's
//! `bazel-bootstrap`) through REAPI over gRPC and through the HTTP cache,
//! and ccache 4.7 through its HTTP remote storage. Both need `make deps`.
//!
//! Bazel runs with `--batch` (a JVM per command, a few seconds each); the
//! workspace (`tests/data/bazel-workspace`) has three genrules (one makes
//! a 6 MB output, streamed through ByteStream) and a C `cc_binary`.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tidepool_client::proto::v1::{Role, TokenGrant};
use tidepool_client::{Client, ClientConfig, RetentionPolicy, TlsFiles};

/// One dev cluster at a time (2 cores).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Dev {
    /// Killed when dropped (first: before its directory goes).
    _process: support::DevChild,
    dir: tempfile::TempDir,
    grpc: String,
    http: String,
    token: String,
    coordinator: String,
}

/// `tidepool dev`, and the gateway addresses its banner prints.
fn start_dev() -> Dev {
    let dir = tempfile::tempdir().unwrap();
    let (process, banner) = support::start_dev_banner(dir.path(), &[]);
    let find = |prefix: &str| -> String {
        banner
            .iter()
            .flat_map(|l| l.split_whitespace())
            .find_map(|w| w.strip_prefix(prefix).map(str::to_string))
            .unwrap_or_else(|| panic!("no {prefix} in the banner:\n{}", banner.join("\n")))
    };
    let grpc = find("--remote_cache=grpc://");
    let http = find("--remote_cache=http://");
    let coordinator = banner[0]
        .split_whitespace()
        .find(|w| w.starts_with("https://"))
        .unwrap()
        .trim_end_matches(',')
        .to_string();
    let token = tidepool_client::read_token_file(&dir.path().join("admin.token")).unwrap();
    Dev {
        _process: process,
        dir,
        grpc,
        http,
        token,
        coordinator,
    }
}

impl Dev {
    async fn client(&self) -> Client {
        let tls = self.dir.path().join("tls");
        let config = ClientConfig::new(std::slice::from_ref(&self.coordinator))
            .with_tls(TlsFiles {
                cert: tls.join("client.pem"),
                key: tls.join("client-key.pem"),
                ca: tls.join("ca.pem"),
            })
            .with_token(self.token.clone());
        Client::with_config(config).await.unwrap()
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn require(tool: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(found, "{tool} is not installed: run `make deps`");
}

/// A Bazel workspace of its own, with its own output root.
struct Workspace {
    _dir: tempfile::TempDir,
    path: PathBuf,
    root: PathBuf,
}

impl Workspace {
    fn new() -> Workspace {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workspace");
        copy_dir(&data("bazel-workspace"), &path);
        let root = dir.path().join("output-root");
        Workspace {
            _dir: dir,
            path,
            root,
        }
    }

    /// `bazel --batch <args>`: success and what it printed.
    fn bazel(&self, args: &[&str]) -> (bool, String) {
        let started = Instant::now();
        let output = Command::new("bazel")
            .arg("--batch")
            .arg(format!("--output_user_root={}", self.root.display()))
            .args(args)
            .current_dir(&self.path)
            .output()
            .expect("bazel runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        eprintln!(
            "bazel {} -> {} in {:.1} s",
            args.join(" "),
            output.status,
            started.elapsed().as_secs_f64()
        );
        (output.status.success(), text)
    }

    /// A build that must succeed; its process counts by kind.
    fn build(&self, flags: &[&str]) -> BTreeMap<String, u32> {
        let mut args = vec!["build", "--spawn_strategy=local", "--noshow_progress"];
        args.extend_from_slice(flags);
        args.push("//...");
        let (ok, text) = self.bazel(&args);
        assert!(ok, "the build failed:\n{text}");
        processes(&text)
    }

    fn clean(&self) {
        let (ok, text) = self.bazel(&["clean", "--expunge"]);
        assert!(ok, "bazel clean failed:\n{text}");
    }
}

/// Parses Bazel's `INFO: 8 processes: 4 remote cache hit, 4 internal.`
fn processes(text: &str) -> BTreeMap<String, u32> {
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains(" processes: ") || l.ends_with(" processes."))
        .unwrap_or_else(|| panic!("no process summary in:\n{text}"));
    let mut kinds = BTreeMap::new();
    if let Some((_, list)) = line.split_once("processes: ") {
        for item in list.trim_end_matches('.').split(", ") {
            let (count, kind) = item.split_once(' ').unwrap();
            kinds.insert(kind.to_string(), count.parse().unwrap());
        }
    }
    kinds
}

fn executed(kinds: &BTreeMap<String, u32>) -> u32 {
    kinds
        .iter()
        .filter(|(k, _)| *k != "internal" && *k != "remote cache hit")
        .map(|(_, n)| n)
        .sum()
}

fn hits(kinds: &BTreeMap<String, u32>) -> u32 {
    kinds.get("remote cache hit").copied().unwrap_or(0)
}

async fn create_instance(client: &Client, name: &str, cas: RetentionPolicy, ac: RetentionPolicy) {
    client.create_namespace(name, true, cas).await.unwrap();
    client
        .create_namespace(&format!("{name}.ac"), false, ac)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bazel_builds_from_the_cache() {
    require("bazel");
    let _serial = SERIAL.lock().await;
    let dev = start_dev();
    let client = dev.client().await;
    let header = format!("--remote_header=authorization=Bearer {}", dev.token);
    let grpc = format!("--remote_cache=grpc://{}", dev.grpc);
    let ws = Workspace::new();

    // Cold: every action runs and is uploaded.
    let cold = ws.build(&[&grpc, &header]);
    let actions = executed(&cold);
    assert!(actions >= 4, "{cold:?}");
    assert_eq!(hits(&cold), 0, "{cold:?}");
    let big = std::fs::read(ws.path.join("bazel-bin/big.bin")).unwrap();
    assert!(big.len() > 6_000_000);
    assert!(
        client
            .exists("cache", &tidepool_client::sha256(&big))
            .await
            .unwrap(),
        "the 6 MB output is in the CAS"
    );
    // Warm, from nothing local: every action is a remote cache hit.
    ws.clean();
    let warm = ws.build(&[&grpc, &header]);
    assert_eq!((hits(&warm), executed(&warm)), (actions, 0), "{warm:?}");
    assert_eq!(
        std::fs::read(ws.path.join("bazel-bin/big.bin")).unwrap(),
        big
    );
    // Without the token: refused (Bazel reports it and builds locally).
    ws.clean();
    let (ok, text) = ws.bazel(&[
        "build",
        "--spawn_strategy=local",
        "--remote_local_fallback",
        &grpc,
        "//...",
    ]);
    assert!(
        !ok || text.contains("UNAUTHENTICATED") || hits(&processes(&text)) == 0,
        "a build without a token must not be served from the cache:\n{text}"
    );
    // --remote_download_minimal: hits, outputs left in the cache.
    ws.clean();
    let minimal = ws.build(&[&grpc, &header, "--remote_download_minimal"]);
    assert_eq!(
        (hits(&minimal), executed(&minimal)),
        (actions, 0),
        "{minimal:?}"
    );

    // The HTTP cache, under its own instance (path prefix).
    create_instance(
        &client,
        "web",
        RetentionPolicy::Epochs(7),
        RetentionPolicy::Epochs(7),
    )
    .await;
    let http = format!("--remote_cache=http://{}/web", dev.http);
    ws.clean();
    let cold = ws.build(&[&http, &header]);
    assert_eq!((hits(&cold), executed(&cold)), (0, actions), "{cold:?}");
    ws.clean();
    let warm = ws.build(&[&http, &header]);
    assert_eq!((hits(&warm), executed(&warm)), (actions, 0), "{warm:?}");

    // Expiry: a CAS kept one epoch, an action cache kept for good. Once
    // the epoch advances and the CAS entries are dropped, the action
    // cache entries remain but are not served (their outputs are gone):
    // the build runs the actions again and succeeds.
    create_instance(
        &client,
        "expiry",
        RetentionPolicy::Epochs(1),
        RetentionPolicy::Durable,
    )
    .await;
    let expiry = ["--remote_instance_name=expiry", &grpc, &header];
    ws.clean();
    let cold = ws.build(&expiry);
    assert_eq!(executed(&cold), actions, "{cold:?}");
    let hello = tidepool_client::sha256(b"hello from a genrule\n");
    assert!(client.exists("expiry", &hello).await.unwrap());
    client.advance_epoch(None).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.exists("expiry", &hello).await.unwrap() {
        assert!(
            Instant::now() < deadline,
            "the expired CAS entries were not dropped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ws.clean();
    let rebuilt = ws.build(&expiry);
    assert_eq!(
        (hits(&rebuilt), executed(&rebuilt)),
        (0, actions),
        "{rebuilt:?}"
    );
    // Rebuilt outputs were uploaded again: the next build hits.
    ws.clean();
    let warm = ws.build(&expiry);
    assert_eq!((hits(&warm), executed(&warm)), (actions, 0), "{warm:?}");
}

/// `ccache -s -v`'s remote storage hits and misses.
fn remote_stats(ccache_dir: &Path) -> (u32, u32) {
    let output = Command::new("ccache")
        .args(["-s", "-v"])
        .env("CCACHE_DIR", ccache_dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    let mut section = false;
    let (mut hits, mut misses) = (None, None);
    for line in text.lines() {
        if line.starts_with("Remote storage:") {
            section = true;
            continue;
        }
        if section && !line.starts_with(' ') {
            section = false;
        }
        if section {
            let value = |l: &str| -> u32 {
                l.split(':')
                    .nth(1)
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            let trimmed = line.trim_start();
            if trimmed.starts_with("Hits:") {
                hits = Some(value(trimmed));
            } else if trimmed.starts_with("Misses:") {
                misses = Some(value(trimmed));
            }
        }
    }
    (
        hits.unwrap_or_else(|| panic!("no remote hits in:\n{text}")),
        misses.unwrap_or(0),
    )
}

/// Compiles the project's files with ccache and a fresh local cache;
/// returns the remote hits and misses.
fn ccache_build(project: &Path, cache: &Path, remote: &str) -> (u32, u32) {
    for source in ["alpha.c", "beta.c", "gamma.c"] {
        let status = Command::new("ccache")
            .args(["gcc", "-O2", "-c", source, "-o"])
            .arg(format!("{source}.o"))
            .current_dir(project)
            .env("CCACHE_DIR", cache)
            .env("CCACHE_REMOTE_STORAGE", remote)
            .status()
            .unwrap();
        assert!(status.success(), "ccache gcc {source}");
    }
    remote_stats(cache)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ccache_gets_remote_hits() {
    require("ccache");
    let _serial = SERIAL.lock().await;
    let dev = start_dev();
    let work = tempfile::tempdir().unwrap();
    let project = work.path().join("project");
    copy_dir(&data("ccache-project"), &project);
    for layout in ["subdirs", "bazel", "flat"] {
        let remote = format!(
            "http://{}/ccache-{layout}|layout={layout}|bearer-token={}",
            dev.http, dev.token
        );
        let first = ccache_build(&project, &work.path().join(format!("{layout}-1")), &remote);
        assert_eq!(
            first,
            (0, 3),
            "{layout}: the first build misses and uploads"
        );
        let second = ccache_build(&project, &work.path().join(format!("{layout}-2")), &remote);
        assert_eq!(
            second,
            (3, 0),
            "{layout}: an empty local cache gets remote hits"
        );
    }
    // A wrong token: no hits (ccache treats the refusal as a miss).
    let remote = format!(
        "http://{}/ccache-subdirs|layout=subdirs|bearer-token=wrong",
        dev.http
    );
    let refused = ccache_build(&project, &work.path().join("refused"), &remote);
    assert_eq!(refused.0, 0, "a wrong token gets nothing");
    // A made-up token is refused before its body is read: a PUT that
    // announces 4 MiB and sends none of it gets its 401 (before, the
    // gateway waited for and buffered the body first; anyone could hold
    // its memory so).
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(&dev.http).await.unwrap();
        let head = format!(
            "PUT /ccache-subdirs/aa/bb HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer made-up\r\ncontent-length: {}\r\n\r\n",
            4 << 20
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = vec![0; 64];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
            .await
            .expect("answered without the body")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..read]).into_owned();
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }

    // Roles hold through the gateway: a read-only token gets the hits but
    // cannot store. With it, a changed file misses and its upload is
    // refused; with a read-write token the same file still misses (nothing
    // was stored), and then hits.
    let client = dev.client().await;
    let read_only = |namespace: &str| TokenGrant {
        namespace: namespace.into(),
        roles: vec![Role::Read as i32],
    };
    let (reader, _) = client
        .create_token(
            "ci-reader",
            false,
            vec![read_only("cache"), read_only("cache.ac")],
        )
        .await
        .unwrap();
    let remote = |token: &str| {
        format!(
            "http://{}/ccache-subdirs|layout=subdirs|bearer-token={token}",
            dev.http
        )
    };
    let hits = ccache_build(&project, &work.path().join("reader-1"), &remote(&reader));
    assert_eq!(hits, (3, 0), "a read-only token reads");
    let source = project.join("alpha.c");
    let changed =
        std::fs::read_to_string(&source).unwrap() + "\nint alpha_extra(void) { return 7; }\n";
    std::fs::write(&source, changed).unwrap();
    let after = ccache_build(&project, &work.path().join("reader-2"), &remote(&reader));
    assert_eq!(after, (2, 1), "the changed file misses; the others hit");
    let writer = ccache_build(&project, &work.path().join("writer-1"), &remote(&dev.token));
    assert_eq!(writer, (2, 1), "the read-only token stored nothing");
    let again = ccache_build(&project, &work.path().join("writer-2"), &remote(&dev.token));
    assert_eq!(again, (3, 0));
}
