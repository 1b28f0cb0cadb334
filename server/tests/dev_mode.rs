//! `tidepool dev` (what `make run` starts): a coordinator and three nodes
//! in one process; a blob stored, the process stopped with Ctrl-C
//! (SIGINT), started again on the same directory, and the same bytes read
//! back. Dev mode runs with TLS and tokens of its own: a client with its
//! material and token gets in, one without is refused.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use tidepool_client::proto::v1::NodeStatusRequest;
use tidepool_client::proto::v1::node_admin_client::NodeAdminClient;
use tidepool_client::{Client, ClientConfig, Durability, ErrorCode, TlsFiles};

fn start(dir: &std::path::Path) -> (support::DevChild, String) {
    support::start_dev(dir, &[])
}

/// The client material and admin token dev mode made in `dir`.
fn credentials(dir: &std::path::Path, url: &str) -> ClientConfig {
    let tls = dir.join("tls");
    let token = tidepool_client::read_token_file(&dir.join("admin.token")).unwrap();
    ClientConfig::new(&[url])
        .with_tls(TlsFiles {
            cert: tls.join("client.pem"),
            key: tls.join("client-key.pem"),
            ca: tls.join("ca.pem"),
        })
        .with_token(token)
}

async fn connect(dir: &std::path::Path, url: &str) -> Client {
    Client::with_config(credentials(dir, url)).await.unwrap()
}

fn interrupt(mut child: support::DevChild) {
    let pid = child.id().to_string();
    Command::new("kill").args(["-INT", &pid]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(
                status.success(),
                "dev mode exits cleanly on Ctrl-C: {status}"
            );
            return;
        }
        assert!(Instant::now() < deadline, "dev mode did not stop on Ctrl-C");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_keeps_data_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let content: Vec<u8> = (0..100_000u32).map(|i| (i % 97) as u8).collect();

    let (child, banner) = support::start_dev_banner(dir.path(), &[]);
    let url = support::banner_url(&banner);
    assert!(url.starts_with("https://"), "{url}");
    // The banner's tidectl commands name the port and the directory (the
    // defaults are 7400 and ./tidepool-dev).
    let dir_path = std::fs::canonicalize(dir.path()).unwrap();
    let tidectl = format!(
        "tidectl --coordinator {url} --dev-dir {} cluster status",
        dir_path.display()
    );
    assert!(
        banner.iter().any(|line| line.trim().ends_with(&tidectl)),
        "{tidectl} in {banner:#?}"
    );
    let client = connect(dir.path(), &url).await;
    assert_eq!(client.map().nodes.len(), 3);
    assert_eq!(
        reported_durabilities(&client).await,
        vec![Durability::Synced; 3],
        "dev mode's nodes sync by default"
    );
    client.put("default", b"kept", &content).await.unwrap();
    // The same material without the token: refused, with its stable code.
    let mut tokenless = credentials(dir.path(), &url);
    tokenless.token = None;
    tokenless.timeout = Duration::from_secs(5);
    let refused = Client::with_config(tokenless).await.unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Unauthenticated, "{refused}");
    // Plaintext: no connection at all.
    let mut plaintext = ClientConfig::new(&[url.replace("https://", "http://")]);
    plaintext.timeout = Duration::from_secs(3);
    plaintext.connect_timeout = Duration::from_secs(1);
    assert!(Client::with_config(plaintext).await.is_err());
    // A second dev cluster on the same directory: refused, the first's
    // data untouched.
    let second = Command::new(support::BIN)
        .args(["dev", "--port", "0"])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!second.status.success(), "{second:?}");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("in use"), "{stderr}");
    assert_eq!(client.get("default", b"kept").await.unwrap(), content);
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();

    let (child, url) = start(dir.path());
    let client = connect(dir.path(), &url).await;
    assert_eq!(client.map().nodes.len(), 3, "the same three nodes");
    assert_eq!(client.get("default", b"kept").await.unwrap(), content);
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();

    // Its CA and admin token deleted (a reset): made anew, and what they
    // admit gets in — before, the old certificates stayed (signed by a CA
    // nobody trusted any more: every handshake failed) and the store kept
    // the old token (every call UNAUTHENTICATED, dev mode's own too).
    let old = credentials(dir.path(), &url);
    for file in ["tls/ca.pem", "tls/ca-key.pem", "admin.token"] {
        std::fs::remove_file(dir.path().join(file)).unwrap();
    }
    // And --shards, which is for a new cluster: said, not silently dropped.
    let (child, url) = support::start_dev(dir.path(), &["--shards", "8"]);
    let client = connect(dir.path(), &url).await;
    assert_eq!(client.get("default", b"kept").await.unwrap(), content);
    client.put("default", b"after", b"reset").await.unwrap();
    assert_eq!(client.map().shards.len(), 4, "the cluster keeps its shards");
    let log = std::fs::read_to_string(dir.path().join("dev.log")).unwrap();
    for said in [
        "node-1.pem issued anew: it is not signed by the CA",
        "replaces the cluster's bootstrap admin token",
        "--shards 8 is for a new cluster",
    ] {
        assert!(log.contains(said), "{said:?} in {log}");
    }
    let mut stale = old;
    stale.seeds = vec![url.clone()];
    stale.timeout = Duration::from_secs(5);
    let refused = Client::with_config(stale).await.unwrap_err();
    assert_eq!(
        refused.code(),
        ErrorCode::Unauthenticated,
        "the old token no longer admits: {refused}"
    );
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();
}

/// Started again on its directory, dev mode says it is ready only once
/// every shard has a leader in this run, asked of the nodes themselves
/// right after the banner. (The map's leader hints are saved with it and
/// outlive their leaders: the banner came before any election.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_is_ready_again_only_once_every_shard_has_a_leader() {
    let dir = tempfile::tempdir().unwrap();
    let (child, banner) = support::start_dev_banner(dir.path(), &["--insecure"]);
    let url = support::banner_url(&banner);
    let tidectl = format!("tidectl --coordinator {url} --insecure get default hello");
    assert!(
        banner.iter().any(|line| line.trim().ends_with(&tidectl)),
        "{tidectl} in {banner:#?}"
    );
    let client = Client::with_config(ClientConfig::new(&[url.as_str()]))
        .await
        .unwrap();
    client.put("default", b"kept", b"value").await.unwrap();
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();

    let (child, banner) = support::start_dev_banner(dir.path(), &["--insecure"]);
    let url = support::banner_url(&banner);
    // The nodes' addresses as the banner gives them (the map may still
    // name a node's address of the last run: it registers meanwhile).
    let nodes: Vec<String> = banner[0]
        .split(", nodes ")
        .nth(1)
        .and_then(|rest| rest.split(", data in").next())
        .unwrap()
        .split(", ")
        .map(|address| format!("http://{address}"))
        .collect();
    assert_eq!(nodes.len(), 3, "{banner:?}");
    let client = Client::with_config(ClientConfig::new(&[url.as_str()]))
        .await
        .unwrap();
    let shards: std::collections::BTreeSet<u32> =
        client.map().shards.iter().map(|s| s.shard_id).collect();
    // Asked of the three nodes at once, a few times within half a second
    // (a leader the coordinator moves between two nodes' answers leads on
    // neither for a moment); an election takes longer than that.
    let mut leading = std::collections::BTreeSet::new();
    for _ in 0..5 {
        let asked: Vec<_> = nodes
            .iter()
            .map(|node| {
                let node = node.clone();
                tokio::spawn(async move {
                    let mut admin = NodeAdminClient::connect(node).await.ok()?;
                    let status = admin.status(NodeStatusRequest {}).await.ok()?.into_inner();
                    Some(
                        status
                            .replicas
                            .iter()
                            .filter(|r| r.is_leader)
                            .map(|r| r.shard_id)
                            .collect::<Vec<u32>>(),
                    )
                })
            })
            .collect();
        leading.clear();
        for answer in asked {
            leading.extend(answer.await.unwrap().into_iter().flatten());
        }
        if leading == shards {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(leading, shards, "shards with a leader at the banner");
    assert_eq!(client.get("default", b"kept").await.unwrap(), b"value");
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();
}

/// The durability every node of a dev cluster reports, once all three have
/// reported (30 s at most).
async fn reported_durabilities(client: &Client) -> Vec<Durability> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = client.cluster_status().await.unwrap();
        if status.nodes.len() == 3 {
            return status.nodes.iter().map(|n| n.durability()).collect();
        }
        assert!(
            Instant::now() < deadline,
            "nodes did not report: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_runs_buffered_when_asked_and_says_so() {
    // A value clap does not know: refused before anything starts.
    let dir = tempfile::tempdir().unwrap();
    let refused = Command::new(support::BIN)
        .args(["dev", "--port", "0", "--insecure", "--durability", "maybe"])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("synced") && stderr.contains("buffered"),
        "{stderr}"
    );

    let (child, banner) =
        support::start_dev_banner(dir.path(), &["--insecure", "--durability", "buffered"]);
    assert!(
        banner.iter().any(|l| l.starts_with("BUFFERED")),
        "the banner warns: {banner:?}"
    );
    let url = support::banner_url(&banner);
    let client = Client::connect(&[url.as_str()]).await.unwrap();
    assert_eq!(
        reported_durabilities(&client).await,
        vec![Durability::Buffered; 3],
        "every node runs buffered and reports it"
    );
    // Both kinds of write are acknowledged and read back; a request for
    // synced writes is still honoured on buffered nodes (its entry is
    // marked for every replica to sync first).
    let content = vec![7u8; 50_000];
    client.put("default", b"buffered", &content).await.unwrap();
    let synced = client.with_durability(Durability::Synced);
    synced.put("default", b"synced", &content).await.unwrap();
    assert_eq!(client.get("default", b"buffered").await.unwrap(), content);
    assert_eq!(client.get("default", b"synced").await.unwrap(), content);
    drop((client, synced));
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();
}

/// `tidepool gateway`'s HTTP limits refuse zero (a bound of no
/// connections, a timeout of nothing) before anything starts.
#[test]
fn gateway_http_limits_refuse_zero() {
    for flag in [
        "--http-header-timeout-s",
        "--http-body-idle-s",
        "--http-max-connections",
    ] {
        let refused = Command::new(support::BIN)
            .args([
                "gateway",
                "--insecure",
                "--coordinator",
                "http://127.0.0.1:1",
            ])
            .args([flag, "0"])
            .output()
            .unwrap();
        assert_eq!(refused.status.code(), Some(2), "{flag}: {refused:?}");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }
}

/// A start-up that fails after the coordinator and the nodes started (here
/// the gateway's port is taken) stops them and says why, instead of
/// returning past them.
#[test]
fn a_failed_start_stops_what_started_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    // The gateway's gRPC port is --port + 80.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = taken.local_addr().unwrap().port() - 80;
    let started = Instant::now();
    let output = Command::new(support::BIN)
        .args([
            "dev",
            "--insecure",
            "--port",
            &base.to_string(),
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success(), "{output:?}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The gateway's port, or (other tests take ports too) another of the
    // cluster's: either way a start that fails after something started.
    assert!(
        stderr.contains("Address already in use"),
        "says which address is taken: {stderr}"
    );
    assert!(
        stderr.contains("stopping"),
        "stops what had started: {stderr}"
    );
    drop(taken);
}
