//! Tidepool as a backup chunk store with the real restic 0.14 (Debian's
//! `restic`, `make deps`) through the gateway's REST endpoint, against
//! `tidepool dev` (TLS and tokens, as `make run` starts it): init, a backup
//! of a generated 60 MB tree with duplicated content, a second backup that
//! uploads far less, snapshots, a byte-identical restore, `check
//! --read-data`, `forget --prune` and `check` again; an append-only token
//! that backs up but whose `prune` is refused with nothing deleted; private
//! repositories. The kill -9 scenario and the disk space given back are in
//! `coordinated_cluster.rs`, which runs separate node processes.

mod support;

use rand::{Rng, SeedableRng};
use support::{data_added, generate_tree, ok, require, restic, same_tree, text};
use tidepool_client::proto::v1::{Role, TokenGrant};
use tidepool_client::{Client, ClientConfig, ListOptions, TlsFiles};

struct Dev {
    /// Killed when dropped (first: before its directory goes).
    _process: support::DevChild,
    dir: tempfile::TempDir,
    /// `host:port` of the restic endpoint.
    restic: String,
    token: String,
    coordinator: String,
}

fn start_dev() -> Dev {
    let dir = tempfile::tempdir().unwrap();
    let (process, banner) = support::start_dev_banner(dir.path(), &[]);
    let restic = banner
        .iter()
        .flat_map(|l| l.split_whitespace())
        .find_map(|w| w.strip_suffix("/REPO/"))
        .and_then(|rest| rest.rsplit_once('@').map(|(_, host)| host))
        .unwrap_or_else(|| panic!("no restic URL in the banner:\n{}", banner.join("\n")))
        .to_string();
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
        restic,
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

    /// A repository URL with Basic credentials `user:token`.
    fn repo(&self, user: &str, token: &str, path: &str) -> String {
        format!("rest:http://{user}:{token}@{}/{path}/", self.restic)
    }
}

/// Names of the keys of a repository's objects of one type.
async fn objects(client: &Client, namespace: &str, prefix: &str) -> Vec<Vec<u8>> {
    let mut lister = client.list(
        namespace,
        ListOptions {
            prefix: prefix.as_bytes().to_vec(),
            ..ListOptions::default()
        },
    );
    let mut keys = Vec::new();
    while let Some(entry) = lister.next().await.unwrap() {
        keys.push(entry.key);
    }
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restic_backs_up_restores_checks_and_prunes() {
    require("restic");
    let dev = start_dev();
    let work = tempfile::tempdir().unwrap();
    let (source, cache) = (work.path().join("source"), work.path().join("cache"));
    let seed = tidepool_testkit::seed_from_env("BACKUP_SEED");
    let size = generate_tree(&source, 110, seed);
    assert!(size >= 50 << 20, "the tree holds {size} bytes");
    let repo = dev.repo("restic", &dev.token, "team/main");

    ok(restic(&repo, &cache, &["init"]));
    // Opening a repository that does not exist fails cleanly.
    let missing = restic(
        &dev.repo("restic", &dev.token, "nothing/here"),
        &cache,
        &["snapshots"],
    );
    assert!(!missing.status.success());
    let first = data_added(&ok(restic(
        &repo,
        &cache,
        &["backup", "--json", source.to_str().unwrap()],
    )));
    // Duplicated content is stored once.
    assert!(
        first < size * 9 / 10,
        "the first backup added {first} bytes of a {size}-byte tree with duplicates"
    );

    // A few files change: the second backup uploads far less.
    // Files are under 1 MiB, so each changed file is one or two chunks: at
    // most its own bytes go up again, plus the trees that name it.
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 1);
    let mut changed = 0;
    for i in [3, 17, 40] {
        let path = source.join(format!("d{}/e{}/f{i}", i % 7, i % 3));
        let mut bytes = std::fs::read(&path).unwrap();
        rng.fill(&mut bytes[..1000]);
        std::fs::write(&path, &bytes).unwrap();
        changed += bytes.len() as u64;
    }
    std::fs::write(source.join("new-file"), b"written between the backups").unwrap();
    let second = data_added(&ok(restic(
        &repo,
        &cache,
        &["backup", "--json", source.to_str().unwrap()],
    )));
    assert!(
        second <= changed + (256 << 10) && second * 10 < first,
        "the second backup added {second} bytes for {changed} bytes of changed files, \
         the first {first}"
    );
    let snapshots: serde_json::Value =
        serde_json::from_str(&ok(restic(&repo, &cache, &["snapshots", "--json"]))).unwrap();
    assert_eq!(snapshots.as_array().unwrap().len(), 2);

    let target = work.path().join("restored");
    ok(restic(
        &repo,
        &cache,
        &["restore", "latest", "--target", target.to_str().unwrap()],
    ));
    same_tree(&source, &target.join(source.strip_prefix("/").unwrap()));
    ok(restic(&repo, &cache, &["check", "--read-data"]));

    // Objects are what their names say: the gateway refuses a forged one.
    let client = dev.client().await;
    let packs_before = objects(&client, "restic", "team/main/data/").await;
    assert!(!packs_before.is_empty());
    let forged = reqwest_like_post(
        &dev.restic,
        &dev.token,
        &format!("/team/main/data/{}", "ab".repeat(32)),
        b"not what the name says",
    );
    assert!(forged.starts_with("HTTP/1.1 400"), "{forged}");

    // forget + prune removes the first snapshot and the packs only it used.
    ok(restic(
        &repo,
        &cache,
        &["forget", "--keep-last", "1", "--prune"],
    ));
    ok(restic(&repo, &cache, &["check"]));
    let snapshots: serde_json::Value =
        serde_json::from_str(&ok(restic(&repo, &cache, &["snapshots", "--json"]))).unwrap();
    assert_eq!(snapshots.as_array().unwrap().len(), 1);

    // An append-only token (with its own locks): backs up, cannot prune,
    // and deletes nothing.
    let grant = |namespace: &str, roles: &[Role]| TokenGrant {
        namespace: namespace.into(),
        roles: roles.iter().map(|r| *r as i32).collect(),
    };
    let (append, _) = client
        .create_token(
            "nightly",
            false,
            vec![
                grant("restic", &[Role::Read, Role::AppendOnly]),
                grant("restic.locks", &[Role::Read, Role::Write, Role::Delete]),
            ],
        )
        .await
        .unwrap();
    let append_repo = dev.repo("nightly", &append, "team/main");
    std::fs::write(source.join("another"), b"a third backup").unwrap();
    ok(restic(
        &append_repo,
        &cache,
        &["backup", source.to_str().unwrap()],
    ));
    let data_before = objects(&client, "restic", "team/main/data/").await;
    let snaps_before = objects(&client, "restic", "team/main/snapshots/").await;
    let refused = restic(
        &append_repo,
        &cache,
        &["forget", "--keep-last", "1", "--prune"],
    );
    assert!(
        !refused.status.success(),
        "prune with an append-only token:\n{}",
        text(&refused)
    );
    assert_eq!(
        objects(&client, "restic", "team/main/data/").await,
        data_before
    );
    assert_eq!(
        objects(&client, "restic", "team/main/snapshots/").await,
        snaps_before
    );
    // It left no lock behind, and the repository is whole.
    assert!(
        objects(&client, "restic.locks", "team/main/locks/")
            .await
            .is_empty()
    );
    ok(restic(&repo, &cache, &["check"]));

    private_repositories(&dev, &client, &cache).await;
}

/// `tidepool gateway --restic-private-repos` on the dev cluster: a
/// repository's first path segment is its user, and the Basic user name
/// must be the name of the token sent as the password, as the coordinator
/// authenticates it. A user name is a claim; without the check any token
/// with the restic roles opened every user's repositories.
async fn private_repositories(dev: &Dev, client: &Client, cache: &std::path::Path) {
    let grant = |namespace: &str| TokenGrant {
        namespace: namespace.into(),
        roles: [Role::Read, Role::Write, Role::Delete]
            .iter()
            .map(|r| *r as i32)
            .collect(),
    };
    let mut tokens = Vec::new();
    for name in ["alice", "mallory"] {
        let grants = vec![grant("restic"), grant("restic.locks")];
        tokens.push(client.create_token(name, false, grants).await.unwrap().0);
    }
    let (alice, mallory) = (&tokens[0], &tokens[1]);
    let tls = dev.dir.path().join("tls");
    let path = |p: std::path::PathBuf| p.to_str().unwrap().to_string();
    let restic_at = format!("127.0.0.1:{}", tidepool_testkit::free_port());
    let args = [
        "gateway".to_string(),
        "--coordinator".into(),
        dev.coordinator.clone(),
        "--tls-cert".into(),
        path(tls.join("client.pem")),
        "--tls-key".into(),
        path(tls.join("client-key.pem")),
        "--tls-ca".into(),
        path(tls.join("ca.pem")),
        "--token-file".into(),
        path(dev.dir.path().join("admin.token")),
        "--grpc-listen".into(),
        format!("127.0.0.1:{}", tidepool_testkit::free_port()),
        "--http-listen".into(),
        format!("127.0.0.1:{}", tidepool_testkit::free_port()),
        "--restic-listen".into(),
        restic_at.clone(),
        "--restic-private-repos".into(),
    ];
    let log = dev.dir.path().join("private-gateway.log");
    let mut gateway = tidepool_testkit::TestProcess::spawn(support::BIN, &args, log);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::net::TcpStream::connect(&restic_at).is_err() {
        assert!(gateway.running(), "the gateway exited:\n{}", gateway.log());
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway does not listen:\n{}",
            gateway.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let repo =
        |user: &str, token: &str| format!("rest:http://{user}:{token}@{restic_at}/alice/main/");
    ok(restic(&repo("alice", alice), cache, &["init"]));
    for (user, token, why) in [
        ("alice", mallory, "another token claiming alice's name"),
        ("mallory", mallory, "a user outside its own repositories"),
    ] {
        let refused = restic(&repo(user, token), cache, &["cat", "config"]);
        assert!(
            !refused.status.success() && text(&refused).contains("403"),
            "{why}:\n{}",
            text(&refused)
        );
    }
    ok(restic(&repo("alice", alice), cache, &["cat", "config"]));
    gateway.kill();
}

/// A raw HTTP/1.1 POST with Basic credentials; the whole response as text.
fn reqwest_like_post(host: &str, token: &str, path: &str, body: &[u8]) -> String {
    use base64::Engine as _;
    use std::io::{Read, Write};
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("restic:{token}"));
    let mut socket = std::net::TcpStream::connect(host).unwrap();
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Basic {auth}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    socket.write_all(body).unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    response
}
