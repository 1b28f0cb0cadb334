//! `tidepool dev` (what `make run` starts): a coordinator and three nodes
//! in one process; a blob stored, the process stopped with Ctrl-C
//! (SIGINT), started again on the same directory, and the same bytes read
//! back.

mod support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use support::start_dev as start;
use tidepool_client::Client;

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
    let client = Client::connect(&[url.as_str()]).await.unwrap();
    assert_eq!(client.map().nodes.len(), 3);
    client.put("default", b"kept", &content).await.unwrap();
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();

    let (child, url) = start(dir.path());
    let client = Client::connect(&[url.as_str()]).await.unwrap();
    assert_eq!(client.map().nodes.len(), 3, "the same three nodes");
    assert_eq!(client.get("default", b"kept").await.unwrap(), content);
    drop(client);
    tokio::task::spawn_blocking(move || interrupt(child))
        .await
        .unwrap();
}
