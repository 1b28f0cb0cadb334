//! The `tidepool node` binary as operators run it: three processes from
//! TOML files serving puts and gets; one stopped with SIGTERM (clean exit)
//! and started again with its data; a single node from flags alone, with
//! its metrics endpoint; and configurations that are refused with a
//! message naming the problem.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tidepool_proto::v1::ReadConsistency;
use tidepool_testkit::free_port;
use tidepool_testkit::grpc::{get, get_at, put};

const BIN: &str = env!("CARGO_BIN_EXE_tidepool");

/// A `tidepool node` process, killed if still running when dropped.
struct NodeProcess {
    child: Child,
    log: PathBuf,
}

impl NodeProcess {
    fn spawn(args: &[&str], log: PathBuf) -> NodeProcess {
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(BIN)
            .args(["node", "--insecure"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap();
        NodeProcess { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the log must show no panic.
    fn terminate_checked(self) -> std::process::ExitStatus {
        let path = self.log.clone();
        let status = self.terminate();
        let log = std::fs::read_to_string(path).unwrap_or_default();
        assert!(!log.contains("panicked"), "{log}");
        status
    }

    /// SIGTERM, then the exit status.
    fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "node did not stop on SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `port` accepts connections.
fn wait_listening(port: u16, node: &mut NodeProcess) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = node.child.try_wait().unwrap() {
            panic!("node exited with {status}:\n{}", node.log());
        }
        assert!(
            Instant::now() < deadline,
            "node never listened:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn write_config(dir: &Path, id: u64, ports: &[u16]) -> PathBuf {
    let peers: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            format!(
                "{{ id = {}, address = \"http://127.0.0.1:{port}\" }}",
                i + 1
            )
        })
        .collect();
    let text = format!(
        r#"node_id = {id}
listen = "127.0.0.1:{port}"
data_dir = "{data}"

[raft]
tick_ms = 20

[engine]
wal_segment_mib = 16
index_segment_mib = 4
cells = 64

[memory]
budget_mib = 24

[cluster]
shards = 2
replicas = [1, 2, 3]
peers = [{peers}]
namespaces = [{{ name = "default", id = 1 }}]
"#,
        port = ports[id as usize - 1],
        data = dir.join(format!("data-{id}")).display(),
        peers = peers.join(", "),
    );
    let path = dir.join(format!("node-{id}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn urls(ports: &BTreeMap<u64, u16>) -> BTreeMap<u64, String> {
    ports
        .iter()
        .map(|(id, port)| (*id, format!("http://127.0.0.1:{port}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_from_config_files_serve_and_restart_with_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut nodes = BTreeMap::new();
    for id in 1..=3u64 {
        let config = write_config(dir.path(), id, &ports);
        let mut node = NodeProcess::spawn(
            &["--config", config.to_str().unwrap()],
            dir.path().join(format!("node-{id}.log")),
        );
        wait_listening(ports[id as usize - 1], &mut node);
        nodes.insert(id, node);
    }
    let all: BTreeMap<u64, u16> = (1..=3).map(|id| (id, ports[id as usize - 1])).collect();
    let mut written = Vec::new();
    for i in 0..20 {
        let key = format!("file/{i}");
        let content = vec![i as u8; 10_000 + i];
        put(&urls(&all), "default", key.as_bytes(), &content)
            .await
            .unwrap_or_else(|s| panic!("put {key}: {s:?}"));
        written.push((key, content));
    }

    // SIGTERM: a clean stop with status 0.
    let status = nodes.remove(&1).unwrap().terminate();
    assert!(status.success(), "{status}");
    let mut two = all.clone();
    two.remove(&1);
    put(
        &urls(&two),
        "default",
        b"while-away",
        b"written without node 1",
    )
    .await
    .unwrap();
    written.push(("while-away".into(), b"written without node 1".to_vec()));

    // Started again from the same file, it serves what it had and catches up.
    let config = dir.path().join("node-1.toml");
    let mut node = NodeProcess::spawn(
        &["--config", config.to_str().unwrap()],
        dir.path().join("node-1.again.log"),
    );
    wait_listening(ports[0], &mut node);
    nodes.insert(1, node);
    let url = format!("http://127.0.0.1:{}", ports[0]);
    let deadline = Instant::now() + Duration::from_secs(30);
    for (key, content) in &written {
        loop {
            match get_at(&url, "default", key.as_bytes(), ReadConsistency::AnyReplica).await {
                Ok(got) => {
                    assert_eq!(&got, content, "{key}");
                    break;
                }
                Err(status) => {
                    assert!(
                        Instant::now() < deadline,
                        "node 1 never served {key}: {status:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        assert_eq!(
            &get(&urls(&all), "default", key.as_bytes()).await.unwrap(),
            content
        );
    }
    for (_, node) in nodes {
        let status = node.terminate_checked();
        assert!(status.success(), "{status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_from_flags_with_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{port}");
    let listen = format!("127.0.0.1:{port}");
    let metrics_listen = format!("127.0.0.1:{metrics}");
    let data = dir.path().join("data");
    let peer = format!("1={url}");
    let mut node = NodeProcess::spawn(
        &[
            "--node-id",
            "1",
            "--listen",
            &listen,
            "--metrics-listen",
            &metrics_listen,
            "--data-dir",
            data.to_str().unwrap(),
            "--peer",
            &peer,
            "--shards",
            "2",
            "--namespace",
            "default=1",
            "--namespace",
            "chunks=2:cas",
        ],
        dir.path().join("node.log"),
    );
    wait_listening(port, &mut node);
    let one = BTreeMap::from([(1u64, url.clone())]);
    put(&one, "default", b"hello", b"world").await.unwrap();
    assert_eq!(get(&one, "default", b"hello").await.unwrap(), b"world");

    let text = http_get(metrics, "/metrics");
    // Puts before the election finished were refused (NOT_LEADER) and
    // count too.
    let puts: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tidepool_node_requests_total{node_id=\"1\",op=\"put\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no put counter in\n{text}"));
    assert!(puts >= 1, "{text}");
    assert!(text.contains("tidepool_shard_is_leader"), "{text}");
    assert!(
        text.contains("tidepool_engine_index_garbage_bytes{node_id=\"1\",shard_id="),
        "{text}"
    );
    assert!(http_get(metrics, "/healthz").starts_with("HTTP/1.1 200"));
    // Log lines carry the node, the shard and the term.
    let log = node.log();
    let changes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("leadership changed"))
        .collect();
    assert!(!changes.is_empty(), "{log}");
    for line in changes {
        assert!(
            line.contains("node_id=1") && line.contains("shard_id=") && line.contains("term="),
            "{line}"
        );
    }
    assert!(node.terminate_checked().success());
}

/// A plain HTTP/1.1 GET; the whole response.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    // One write: the responder answers after its first read and closes, so
    // a request split over several writes could meet a closed socket.
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn bad_configurations_are_refused_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let output = Command::new(BIN)
            .args(["node", "--insecure"])
            .args(args)
            .output()
            .unwrap();
        (
            output.status,
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (status, stderr) = run(&[]);
    assert!(!status.success());
    assert!(
        stderr.contains("give --config, --node-id or --coordinator"),
        "{stderr}"
    );
    // Dev mode's ports run up to 94 above --port: one past 65,441 wrapped
    // round (a release build) onto ports below 100.
    let output = Command::new(BIN)
        .args(["dev", "--port", "65500"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("65500 is not in 0..=65441"), "{stderr}");

    let (status, stderr) = run(&["--config", "/nonexistent/tidepool.toml"]);
    assert!(!status.success());
    assert!(stderr.contains("/nonexistent/tidepool.toml"), "{stderr}");

    let path = dir.path().join("typo.toml");
    std::fs::write(&path, "node_id = 1\nlisten_addr = \"127.0.0.1:1\"\n").unwrap();
    let (status, stderr) = run(&["--config", path.to_str().unwrap()]);
    assert!(!status.success());
    assert!(stderr.contains("listen_addr"), "{stderr}");

    let (status, stderr) = run(&["--node-id", "0"]);
    assert!(!status.success());
    assert!(stderr.contains("node_id"), "{stderr}");

    let (status, stderr) = run(&["--node-id", "1", "--peer", "one=http://x"]);
    assert!(!status.success());
    assert!(stderr.contains("--peer one=http://x"), "{stderr}");

    // A node missing from its own fixed cluster's peers.
    let (status, stderr) = run(&[
        "--node-id",
        "4",
        "--peer",
        "1=http://127.0.0.1:1",
        "--shards",
        "1",
    ]);
    assert!(!status.success());
    assert!(stderr.contains("peers"), "{stderr}");

    // A fixed cluster and a coordinator at once.
    let (status, stderr) = run(&[
        "--node-id",
        "1",
        "--peer",
        "1=http://127.0.0.1:1",
        "--coordinator",
        "http://127.0.0.1:2",
    ]);
    assert!(!status.success());
    assert!(stderr.contains("not both"), "{stderr}");

    // A data directory that belongs to another node.
    let data = dir.path().join("owned");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("NODE_ID"), "7\n").unwrap();
    let (status, stderr) = run(&[
        "--node-id",
        "3",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--coordinator",
        "http://127.0.0.1:2",
    ]);
    assert!(!status.success());
    assert!(stderr.contains("belongs to node 7"), "{stderr}");
    // So does a fixed cluster's node (no coordinator): its replicas' Raft
    // state is node 7's.
    let peer = "3=http://127.0.0.1:9";
    let (status, stderr) = run(&[
        "--node-id",
        "3",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--peer",
        peer,
    ]);
    assert!(!status.success());
    assert!(stderr.contains("belongs to node 7"), "{stderr}");
}

#[test]
fn the_coordinator_refuses_bad_settings() {
    let run = |args: &[&str]| {
        let output = Command::new(BIN)
            .args(["coordinator", "--insecure"])
            .args(args)
            .output()
            .unwrap();
        (
            output.status,
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (status, stderr) = run(&["--listen", "127.0.0.1:0"]);
    assert!(!status.success());
    assert!(stderr.contains("--etcd"), "{stderr}");
    let (status, stderr) = run(&["--shards", "0"]);
    assert!(!status.success());
    assert!(stderr.contains("cluster.shards"), "{stderr}");
    let (status, stderr) = run(&["--key-prefix", "tidepool"]);
    assert!(!status.success());
    assert!(stderr.contains("key_prefix"), "{stderr}");
    let (status, stderr) = run(&["--config", "/nonexistent/c.toml"]);
    assert!(!status.success());
    assert!(stderr.contains("/nonexistent/c.toml"), "{stderr}");
}

/// A node stopped while it starts — here while it retries its
/// registration with a coordinator that is not there — exits on SIGTERM,
/// also as the first process of its PID namespace, as in its container
/// (the image's entrypoint): such a process gets no signal it has no
/// handler for, and the handler was installed only once started (the pod
/// waited out its whole grace period; outside a container the signal's
/// default action killed it unannounced).
#[test]
fn a_node_stopped_while_it_starts_exits_as_the_first_process_of_its_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("node.log");
    let data = dir.path().join("data");
    let listen = format!("127.0.0.1:{}", free_port());
    let coordinator = format!("http://127.0.0.1:{}", free_port());
    let out = std::fs::File::create(&log).unwrap();
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", BIN, "node", "--insecure"])
        .args(["--data-dir", data.to_str().unwrap(), "--listen", &listen])
        .args(["--coordinator", &coordinator])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .expect("unshare (util-linux) runs");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // The node, once it retries its registration.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !read_log().contains("cannot register with a coordinator yet") {
        assert!(
            Instant::now() < deadline,
            "the node did not start:\n{}",
            read_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        unshare.id(),
        unshare.id()
    ))
    .unwrap();
    let node: u32 = children.split_whitespace().next().unwrap().parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{node}/status")).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("NSpid:") && l.trim_end().ends_with("\t1")),
        "the node is not its namespace's first process:\n{status}"
    );
    assert!(
        Command::new("kill")
            .args(["-TERM", &node.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if unshare.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() >= deadline {
            let _ = Command::new("kill")
                .args(["-KILL", &node.to_string()])
                .status();
            let _ = unshare.wait();
            panic!("the node ignored SIGTERM while starting:\n{}", read_log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        read_log().contains("stopped while starting"),
        "{}",
        read_log()
    );
}
