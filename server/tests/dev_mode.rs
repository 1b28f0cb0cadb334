//! `tidepool dev` (what `make run` starts): a coordinator and three nodes
//! in one process; a blob stored, the process stopped with Ctrl-C
//! (SIGINT), started again on the same directory, and the same bytes read
//! back. Dev mode runs with TLS and tokens of its own: a client with its
//! material and token gets in, one without is refused.

mod support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tidepool_client::{Client, ClientConfig, ErrorCode, TlsFiles};

fn start(dir: &std::path::Path) -> (Child, String) {
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

fn interrupt(mut child: Child) {
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

    let (child, url) = start(dir.path());
    assert!(url.starts_with("https://"), "{url}");
    let client = connect(dir.path(), &url).await;
    assert_eq!(client.map().nodes.len(), 3);
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
}
