//! The harness: a real `etcd`, real `tidepool coordinator` and `tidepool
//! node` processes, each in its own directory on its own port, and a TCP
//! proxy on every node-to-peer path (`proxy.rs`; nodes are told to reach
//! each peer through it with `--peer-address`). It can kill -9 and restart
//! a process, freeze and thaw it (SIGSTOP/SIGCONT), cut and heal paths,
//! put a node's data on a small filesystem (tmpfs with a size limit) and
//! grow it again, and scan every log for panics and errors.
//!
//! Every cluster runs as production does: mutual TLS on every connection
//! (etcd included) with certificates from its own CA, and clients with an
//! admin bearer token (`Credentials`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::time::{Duration, Instant};

use tidepool_client::proto::v1::{ClusterStatus, NodeState, ReplicaRole};
use tidepool_client::{Client, ClientConfig};
use tidepool_testkit::{EtcdServer, TestProcess, free_port};

use crate::proxy::Proxy;

/// The `tidepool` binary, built once per test process.
pub fn binary() -> PathBuf {
    static BUILD: Once = Once::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace");
    BUILD.call_once(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "-p", "tidepool", "--bin", "tidepool"])
            .current_dir(root)
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the tidepool binary failed");
    });
    let target =
        std::env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), PathBuf::from);
    target.join("debug").join("tidepool")
}

/// A cluster's TLS material (in `<dir>/tls`) and its admin token.
pub struct Credentials {
    /// Where the PEM files are.
    pub dir: PathBuf,
    /// The bootstrap admin token.
    pub token: String,
    /// The file holding it.
    pub token_file: PathBuf,
}

impl Credentials {
    /// A CA; certificates `coordinator-<i>` (identity `c<i>`), `node-<id>`,
    /// `etcd`, `client`, all for 127.0.0.1; an admin token.
    pub fn make(dir: &Path, coordinators: usize, nodes: usize) -> Credentials {
        use tidepool_security::Identity;
        use tidepool_security::certs::{self, CERT_VALIDITY, Request};
        let dir = dir.join("tls");
        let ca = certs::new_ca("e2e", certs::CA_VALIDITY).expect("CA");
        certs::write(&dir, "ca", &ca).expect("write CA");
        let mut wanted = vec![
            ("etcd".to_string(), Identity::Node("etcd".into())),
            ("client".to_string(), Identity::Client("e2e".into())),
        ];
        for i in 0..coordinators {
            wanted.push((
                format!("coordinator-{i}"),
                Identity::Coordinator(format!("c{i}")),
            ));
        }
        for id in 1..=nodes {
            wanted.push((format!("node-{id}"), Identity::Node(format!("node-{id}"))));
        }
        for (base, identity) in wanted {
            let issued = certs::issue(
                &ca,
                &Request {
                    identity,
                    hosts: vec!["127.0.0.1".into(), "localhost".into()],
                    valid_for: CERT_VALIDITY,
                    expired: false,
                },
            )
            .expect("certificate");
            certs::write(&dir, &base, &issued).expect("write certificate");
        }
        let token = tidepool_security::token::generate();
        let token_file = dir.join("admin.token");
        std::fs::write(&token_file, format!("{token}\n")).expect("token file");
        Credentials {
            dir,
            token,
            token_file,
        }
    }

    /// The files of certificate `base`.
    pub fn files(&self, base: &str) -> tidepool_security::TlsFiles {
        tidepool_security::certs::files(&self.dir, base)
    }

    /// `--tls-cert`, `--tls-key`, `--tls-ca` for certificate `base`.
    pub fn flags(&self, base: &str) -> Vec<String> {
        let files = self.files(base);
        vec![
            "--tls-cert".into(),
            files.cert.display().to_string(),
            "--tls-key".into(),
            files.key.display().to_string(),
            "--tls-ca".into(),
            files.ca.display().to_string(),
        ]
    }

    /// A client configuration with the client certificate and admin token.
    pub fn client_config(&self, seeds: &[String]) -> ClientConfig {
        ClientConfig::new(seeds)
            .with_tls(self.files("client"))
            .with_token(self.token.clone())
    }
}

/// A storage node process.
pub struct NodeProcess {
    /// Its id (fixed by the harness).
    pub id: u64,
    /// Its gRPC port.
    pub port: u16,
    /// Its data directory.
    pub dir: PathBuf,
    /// The running process (`None` while killed).
    pub process: Option<TestProcess>,
    args: Vec<String>,
    logs: Vec<PathBuf>,
    tmpfs: bool,
}

/// A coordinator process.
pub struct CoordinatorProcess {
    /// Its URL.
    pub url: String,
    /// The running process (`None` while killed).
    pub process: Option<TestProcess>,
    args: Vec<String>,
    logs: Vec<PathBuf>,
}

/// Shape of a test cluster.
#[derive(Clone, Debug)]
pub struct Options {
    /// Storage nodes.
    pub nodes: usize,
    /// Coordinator replicas.
    pub coordinators: usize,
    /// Shards.
    pub shards: u32,
    /// Put this node's (index) data on a tmpfs of this many MiB.
    pub small_disk: Option<(usize, u64)>,
    /// Coordinator down-grace, milliseconds.
    pub down_grace_ms: u64,
    /// The coordinator's `--split-mib` (0: no automatic splits).
    pub split_mib: u64,
    /// The coordinator's `--split-rps` (0: no splits by load) and
    /// `--split-load-secs`.
    pub split_rps: u64,
    /// How long a shard stays over `split_rps` before it splits, seconds.
    pub split_load_secs: u64,
    /// The nodes' `engine.relocation_interval_ms` (`None`: their default).
    pub relocation_interval_ms: Option<u64>,
    /// The nodes' `raft.compact_log_entries` (`None`: their default).
    pub compact_log_entries: Option<u64>,
    /// The nodes' `raft.election_spread_ticks` (`None`: their default).
    pub election_spread_ticks: Option<usize>,
    /// The nodes' `limits.in_flight_mib` (`None`: their default).
    pub in_flight_mib: Option<u64>,
    /// The nodes' `limits.session_opens_per_second` and
    /// `limits.session_opens_burst` (`None`: their defaults).
    pub session_opens: Option<(u64, u64)>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            nodes: 3,
            coordinators: 1,
            shards: 4,
            small_disk: None,
            down_grace_ms: 60_000,
            split_mib: 0,
            split_rps: 0,
            split_load_secs: 60,
            relocation_interval_ms: None,
            compact_log_entries: None,
            election_spread_ticks: None,
            in_flight_mib: None,
            session_opens: None,
        }
    }
}

/// The processes of one cluster.
pub struct Cluster {
    /// Its directory (logs, data).
    pub dir: tempfile::TempDir,
    /// etcd.
    pub etcd: EtcdServer,
    /// Coordinators.
    pub coordinators: Vec<CoordinatorProcess>,
    /// Nodes, index `i` has id `i + 1`.
    pub nodes: Vec<NodeProcess>,
    proxies: BTreeMap<(u64, u64), Proxy>,
    restarts: usize,
    /// TLS material and the admin token.
    pub credentials: Credentials,
}

const NODE_CONFIG: &str = "[engine]\nwal_segment_mib = 16\n[memory]\nbudget_mib = 64\n";

impl Cluster {
    /// Starts etcd, the coordinators and the nodes; returns once every
    /// shard has three voters and a leader.
    pub async fn start(options: Options) -> Cluster {
        let bin = binary();
        assert!(bin.exists(), "{} missing", bin.display());
        let mut dir = tempfile::Builder::new()
            .prefix("tidepool-e2e-")
            .tempdir()
            .expect("temp dir");
        // E2E_KEEP=1 keeps every process's directory and log for a look.
        if std::env::var_os("E2E_KEEP").is_some() {
            dir.disable_cleanup(true);
            eprintln!("E2E_KEEP: keeping {}", dir.path().display());
        }
        let credentials = Credentials::make(dir.path(), options.coordinators, options.nodes);
        let etcd_files = credentials.files("etcd");
        let etcd = EtcdServer::start_tls(&etcd_files.cert, &etcd_files.key, &etcd_files.ca);
        let config = dir.path().join("node.toml");
        let mut node_config = NODE_CONFIG.to_string();
        if let Some(ms) = options.relocation_interval_ms {
            node_config = node_config.replace(
                "[engine]\n",
                &format!("[engine]\nrelocation_interval_ms = {ms}\n"),
            );
        }
        let mut raft = String::new();
        if let Some(entries) = options.compact_log_entries {
            raft.push_str(&format!("compact_log_entries = {entries}\n"));
        }
        if let Some(ticks) = options.election_spread_ticks {
            raft.push_str(&format!("election_spread_ticks = {ticks}\n"));
        }
        if !raft.is_empty() {
            node_config.push_str(&format!("[raft]\n{raft}"));
        }
        let mut limits = String::new();
        if let Some(mib) = options.in_flight_mib {
            limits.push_str(&format!("in_flight_mib = {mib}\n"));
        }
        if let Some((per_second, burst)) = options.session_opens {
            limits.push_str(&format!(
                "session_opens_per_second = {per_second}\nsession_opens_burst = {burst}\n"
            ));
        }
        if !limits.is_empty() {
            node_config.push_str(&format!("[limits]\n{limits}"));
        }
        std::fs::write(&config, node_config).expect("node config");
        let mut cluster = Cluster {
            dir,
            etcd,
            coordinators: Vec::new(),
            nodes: Vec::new(),
            proxies: BTreeMap::new(),
            restarts: 0,
            credentials,
        };
        let coordinator_urls: Vec<String> = (0..options.coordinators)
            .map(|_| format!("https://127.0.0.1:{}", free_port()))
            .collect();
        for (i, url) in coordinator_urls.iter().enumerate() {
            let etcd_files = cluster.credentials.files(&format!("coordinator-{i}"));
            let mut args: Vec<String> = vec![
                "coordinator".into(),
                "--id".into(),
                format!("c{i}"),
                "--listen".into(),
                url.trim_start_matches("https://").into(),
                "--etcd-cert".into(),
                etcd_files.cert.display().to_string(),
                "--etcd-key".into(),
                etcd_files.key.display().to_string(),
                "--etcd-ca".into(),
                etcd_files.ca.display().to_string(),
                "--bootstrap-token-file".into(),
                cluster.credentials.token_file.display().to_string(),
                "--etcd".into(),
                cluster.etcd.url.clone(),
                "--key-prefix".into(),
                "/e2e/".into(),
                "--shards".into(),
                options.shards.to_string(),
                "--replication-factor".into(),
                "3".into(),
                "--node-lease-ms".into(),
                "1500".into(),
                "--leader-lease-ms".into(),
                "2000".into(),
                "--down-grace-ms".into(),
                options.down_grace_ms.to_string(),
                "--reconcile-interval-ms".into(),
                "200".into(),
                "--split-mib".into(),
                options.split_mib.to_string(),
                "--split-rps".into(),
                options.split_rps.to_string(),
                "--split-load-secs".into(),
                options.split_load_secs.to_string(),
            ];
            args.extend(cluster.credentials.flags(&format!("coordinator-{i}")));
            cluster.coordinators.push(CoordinatorProcess {
                url: url.clone(),
                process: None,
                args,
                logs: Vec::new(),
            });
            cluster.start_coordinator(i);
        }
        let ports: Vec<u16> = (0..options.nodes).map(|_| free_port()).collect();
        for from in 1..=options.nodes as u64 {
            for (j, &port) in ports.iter().enumerate() {
                let to = j as u64 + 1;
                if to != from {
                    let target = format!("127.0.0.1:{port}").parse().expect("address");
                    cluster
                        .proxies
                        .insert((from, to), Proxy::start(target).await);
                }
            }
        }
        for (i, &port) in ports.iter().enumerate() {
            let id = i as u64 + 1;
            let data = cluster.dir.path().join(format!("node-{id}"));
            std::fs::create_dir_all(&data).expect("data dir");
            let tmpfs = match options.small_disk {
                Some((index, mib)) if index == i => {
                    mount_tmpfs(&data, mib);
                    true
                }
                _ => false,
            };
            let mut args: Vec<String> = vec![
                "node".into(),
                "--config".into(),
                config.display().to_string(),
                "--node-id".into(),
                id.to_string(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--data-dir".into(),
                data.display().to_string(),
            ];
            for url in &coordinator_urls {
                args.push("--coordinator".into());
                args.push(url.clone());
            }
            args.extend(cluster.credentials.flags(&format!("node-{id}")));
            for ((from, to), proxy) in &cluster.proxies {
                if *from == id {
                    args.push("--peer-address".into());
                    args.push(format!("{to}=https://{}", proxy.address));
                }
            }
            cluster.nodes.push(NodeProcess {
                id,
                port,
                dir: data,
                process: None,
                args,
                logs: Vec::new(),
                tmpfs,
            });
            cluster.start_node(i);
        }
        cluster.wait_settled(Duration::from_secs(90)).await;
        cluster
    }

    fn log_path(&mut self, name: &str) -> PathBuf {
        self.restarts += 1;
        self.dir
            .path()
            .join(format!("{name}.{}.log", self.restarts))
    }

    /// Starts (or restarts) coordinator `i`.
    pub fn start_coordinator(&mut self, i: usize) {
        let log = self.log_path(&format!("coordinator-{i}"));
        let c = &mut self.coordinators[i];
        c.logs.push(log.clone());
        c.process = Some(TestProcess::spawn(
            binary().to_str().expect("utf-8"),
            &c.args,
            log,
        ));
    }

    /// Starts (or restarts) node index `i`.
    pub fn start_node(&mut self, i: usize) {
        let log = self.log_path(&format!("node-{}", i + 1));
        let n = &mut self.nodes[i];
        n.logs.push(log.clone());
        n.process = Some(TestProcess::spawn(
            binary().to_str().expect("utf-8"),
            &n.args,
            log,
        ));
    }

    /// How many shards each node (by index) leads, as the map says.
    pub async fn shards_led(&self) -> Vec<usize> {
        let map = self.status().await.expect("status").map.expect("map");
        let mut led = vec![0usize; self.nodes.len()];
        for s in &map.shards {
            if s.leader_hint > 0 {
                led[s.leader_hint as usize - 1] += 1;
            }
        }
        led
    }

    /// The node (index) leading the most shards.
    pub async fn busiest_leader(&self) -> usize {
        let led = self.shards_led().await;
        (0..led.len()).max_by_key(|i| led[*i]).expect("nodes")
    }

    /// kill -9 node index `i`.
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].process.take() {
            p.kill();
        }
    }

    /// SIGTERM node index `i` and wait for it.
    pub fn stop_node(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].process.take() {
            let status = p.terminate();
            assert!(status.success(), "node {} exited with {status}", i + 1);
        }
    }

    /// kill -9 coordinator `i`.
    pub fn kill_coordinator(&mut self, i: usize) {
        if let Some(mut p) = self.coordinators[i].process.take() {
            p.kill();
        }
    }

    fn signal(pid: u32, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// SIGSTOP node index `i` (a frozen peer).
    pub fn freeze_node(&self, i: usize) {
        if let Some(p) = &self.nodes[i].process {
            Self::signal(p.pid(), "-STOP");
        }
    }

    /// SIGCONT node index `i`.
    pub fn thaw_node(&self, i: usize) {
        if let Some(p) = &self.nodes[i].process {
            Self::signal(p.pid(), "-CONT");
        }
    }

    /// Cuts every path between nodes of different groups (node ids);
    /// nodes in no group are cut from everyone.
    pub fn partition(&self, groups: &[&[u64]]) {
        let group_of = |id: u64| groups.iter().position(|g| g.contains(&id));
        for ((from, to), proxy) in &self.proxies {
            let same = matches!((group_of(*from), group_of(*to)), (Some(a), Some(b)) if a == b);
            if same {
                proxy.unblock();
            } else {
                proxy.block();
            }
        }
    }

    /// Cuts node `id`'s peer traffic one way or both: what it sends to its
    /// peers (`outbound`), what they send it (`inbound`). Its traffic with
    /// the coordinator and clients still flows.
    pub fn cut_peer_traffic(&self, id: u64, outbound: bool, inbound: bool) {
        for ((from, to), proxy) in &self.proxies {
            if (outbound && *from == id) || (inbound && *to == id) {
                proxy.block();
            }
        }
    }

    /// Heals every path.
    pub fn heal(&self) {
        for proxy in self.proxies.values() {
            proxy.unblock();
        }
    }

    /// Node index `i`'s data directory.
    pub fn node_dir(&self, i: usize) -> &Path {
        &self.nodes[i].dir
    }

    /// Grows node index `i`'s small disk to `mib`.
    pub fn grow_disk(&self, i: usize, mib: u64) {
        let dir = &self.nodes[i].dir;
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={mib}m")])
            .arg(dir)
            .status()
            .expect("mount runs");
        assert!(status.success(), "remount of {}", dir.display());
    }

    /// The shard of each workload key `0..keys` (namespace `default`).
    pub async fn shards_of_keys(&self, keys: u32) -> Vec<u32> {
        use tidepool_client::proto::{hash_position, storage_key};
        let map = self.status().await.expect("status").map.expect("map");
        let namespace = map
            .namespaces
            .iter()
            .find(|n| n.name == "default")
            .expect("namespace default");
        (0..keys)
            .map(|key| {
                let name = crate::workload::key_name(key);
                let position = hash_position(&storage_key(namespace.id, &name));
                map.shards
                    .iter()
                    .find(|s| s.hash_start <= position && position <= s.hash_end)
                    .expect("a shard for every position")
                    .shard_id
            })
            .collect()
    }

    /// A client of the cluster (every coordinator as a seed).
    pub async fn client(&self) -> Client {
        self.try_client().await.expect("a client connects")
    }

    async fn try_client(&self) -> Option<Client> {
        let seeds: Vec<String> = self.coordinators.iter().map(|c| c.url.clone()).collect();
        self.client_of(&seeds, Duration::from_secs(20)).await
    }

    /// The leader's status (or any coordinator's).
    pub async fn status(&self) -> Option<ClusterStatus> {
        let client = tokio::time::timeout(Duration::from_secs(5), self.try_client())
            .await
            .ok()??;
        tokio::time::timeout(Duration::from_secs(5), client.cluster_status())
            .await
            .ok()?
            .ok()
    }

    /// The leading coordinator's index and status, asking each coordinator
    /// in turn (a follower answers with its own view, `is_leader` false).
    pub async fn leader_status(&self) -> Option<(usize, ClusterStatus)> {
        for (i, coordinator) in self.coordinators.iter().enumerate() {
            let ask = async {
                let seed = std::slice::from_ref(&coordinator.url);
                let client = self.client_of(seed, Duration::from_secs(2)).await?;
                client.cluster_status().await.ok()
            };
            if let Ok(Some(status)) = tokio::time::timeout(Duration::from_secs(3), ask).await
                && status.is_leader
            {
                return Some((i, status));
            }
        }
        None
    }

    /// Waits until every shard has three voters on up nodes and a leader,
    /// and no move is pending.
    pub async fn wait_settled(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.status().await
                && settled(&status)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not settle within {timeout:?}; last status: {:?}\n{}",
                self.status().await.map(|s| s.map),
                self.log_tails()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The last lines of every log.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        for path in self.all_logs() {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out += &format!("--- {}\n", path.display());
            for line in tail.into_iter().rev() {
                out += line;
                out.push('\n');
            }
        }
        out
    }

    fn all_logs(&self) -> Vec<PathBuf> {
        self.coordinators
            .iter()
            .flat_map(|c| c.logs.clone())
            .chain(self.nodes.iter().flat_map(|n| n.logs.clone()))
            .collect()
    }

    /// Lines of every log (coordinators', then nodes') containing `needle`.
    pub fn log_lines_with(&self, needle: &str) -> Vec<String> {
        self.all_logs()
            .iter()
            .flat_map(|path| {
                let text = std::fs::read_to_string(path).unwrap_or_default();
                text.lines()
                    .filter(|line| line.contains(needle))
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Lines of every log that report a panic or an error, except those
    /// containing one of `expected`.
    pub fn unexpected_log_lines(&self, expected: &[&str]) -> Vec<String> {
        let mut found = Vec::new();
        for path in self.all_logs() {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for line in text.lines() {
                let bad = line.contains("panicked") || line.contains(" ERROR ");
                if bad && !expected.iter().any(|e| line.contains(e)) {
                    found.push(format!("{}: {line}", path.display()));
                }
            }
        }
        found
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(p) = &n.process {
                // A frozen process ignores SIGKILL until continued.
                let _ = Command::new("kill")
                    .args(["-CONT", &p.pid().to_string()])
                    .status();
            }
            n.process = None;
            if n.tmpfs {
                let _ = Command::new("umount").arg("-l").arg(&n.dir).status();
            }
        }
    }
}

fn mount_tmpfs(dir: &Path, mib: u64) {
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
        .arg(dir)
        .status()
        .expect("mount runs");
    assert!(status.success(), "mounting a {mib} MiB tmpfs needs root");
}

/// Every shard has three voters on up nodes and a leader; nothing moves;
/// no replica is down for its files missing (one is rebuilt).
pub fn settled(status: &ClusterStatus) -> bool {
    let Some(map) = &status.map else { return false };
    let up: Vec<u64> = map
        .nodes
        .iter()
        .filter(|n| n.state == NodeState::Up as i32)
        .map(|n| n.node_id)
        .collect();
    !map.shards.is_empty()
        && status.moves.is_empty()
        && map.shards.iter().all(|s| {
            s.leader_hint != 0
                && s.replicas.len() == 3
                && s.replicas
                    .iter()
                    .all(|r| r.role == ReplicaRole::Voter as i32 && up.contains(&r.node_id))
        })
        && status
            .nodes
            .iter()
            .all(|n| n.replicas.iter().all(|r| !r.files_missing))
}

/// The cluster's membership in one line, for a soak's slow faults: each
/// node's state, then each shard's replicas (`*` the leader the map names,
/// `~` a learner) and the moves under way — what a stretch without writes
/// is read against.
pub fn membership(status: &ClusterStatus) -> String {
    let Some(map) = &status.map else {
        return "no map".into();
    };
    let nodes: Vec<String> = map
        .nodes
        .iter()
        .map(|n| {
            let state = NodeState::try_from(n.state).map_or("?", |s| s.as_str_name());
            format!("{} {}", n.node_id, state.trim_start_matches("NODE_STATE_"))
        })
        .collect();
    let shards: Vec<String> = map
        .shards
        .iter()
        .map(|s| {
            let replicas: Vec<String> = s
                .replicas
                .iter()
                .map(|r| {
                    let leader = if r.node_id == s.leader_hint { "*" } else { "" };
                    let learner = if r.role == ReplicaRole::Learner as i32 {
                        "~"
                    } else {
                        ""
                    };
                    format!("{learner}{}{leader}", r.node_id)
                })
                .collect();
            format!("{} [{}]", s.shard_id, replicas.join(" "))
        })
        .collect();
    format!(
        "nodes {}; shards {}; {} moves",
        nodes.join(", "),
        shards.join(", "),
        status.moves.len()
    )
}

impl Cluster {
    /// A client with these seeds and per-call timeout, not watching the
    /// map, with the client certificate and admin token.
    async fn client_of(&self, seeds: &[String], timeout: Duration) -> Option<Client> {
        let mut config = self.credentials.client_config(seeds);
        config.timeout = timeout;
        config.watch = false;
        Client::with_config(config).await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_client::proto::v1::{ClusterMap, NodeInfo, ReplicaInfo, ShardInfo};

    #[test]
    fn membership_names_states_leaders_and_learners() {
        let replica = |node_id, role: ReplicaRole| ReplicaInfo {
            node_id,
            role: role as i32,
        };
        let status = ClusterStatus {
            map: Some(ClusterMap {
                nodes: vec![
                    NodeInfo {
                        node_id: 1,
                        state: NodeState::Up as i32,
                        ..Default::default()
                    },
                    NodeInfo {
                        node_id: 2,
                        state: NodeState::Down as i32,
                        ..Default::default()
                    },
                ],
                shards: vec![ShardInfo {
                    shard_id: 7,
                    replicas: vec![
                        replica(1, ReplicaRole::Voter),
                        replica(2, ReplicaRole::Voter),
                        replica(3, ReplicaRole::Learner),
                    ],
                    leader_hint: 2,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            membership(&status),
            "nodes 1 UP, 2 DOWN; shards 7 [1 2* ~3]; 0 moves"
        );
        assert_eq!(membership(&ClusterStatus::default()), "no map");
    }
}
