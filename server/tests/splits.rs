//! Splits in one `tidepool node` process (a static one-node cluster, one
//! shard; `docs/design/splits.md`).
//!
//! Crash points of a split's apply (step 3): a node holding
//! data is told to split, and aborts — as a kill -9 there would stop it —
//! after the child's files are copied, after its state is rewritten as a
//! new group's, after its directory is renamed into place, or after the
//! parent recorded the split in memory. Restarted, the node has both groups
//! with the ranges the split names, no half-made directory, and every value
//! written before; both groups take writes and keep them through another
//! restart. The same run without a crash is the control.
//!
//! Shedding (step 7): after a split both groups' engines name the old
//! values (hard links: one copy on the volume), and relocation leaves the
//! shared files alone; once one side goes (its replica moved away), the
//! other sheds the values outside its range.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use tidepool_proto::v1::node_admin_client::NodeAdminClient;
use tidepool_proto::v1::propose_admin_request::Op;
use tidepool_proto::v1::{CloseReplicaRequest, NodeStatusRequest, ProposeAdminRequest, SplitOp};
use tidepool_testkit::grpc::{get, put};
use tidepool_testkit::{TestProcess, free_port};

const CHILD: u32 = 2;
const AT: u64 = 1 << 63;
const KEYS: usize = 200;

fn value(i: usize, round: u32) -> Vec<u8> {
    format!("value {i} of round {round} ")
        .repeat(40)
        .into_bytes()
}

struct Node {
    process: TestProcess,
    url: String,
    config: std::path::PathBuf,
    dir: std::path::PathBuf,
    starts: u32,
}

/// Starts the node of `config`, aborting at `crash_point` if given.
fn spawn(dir: &Path, config: &Path, crash_point: Option<&str>, start: u32) -> TestProcess {
    let env: Vec<(&str, &str)> = crash_point
        .map(|p| (tidepool_node::replica::CRASH_POINT_VAR, p))
        .into_iter()
        .collect();
    TestProcess::spawn_with_env(
        support::BIN,
        &["node", "--insecure", "--config", config.to_str().unwrap()],
        &env,
        dir.join(format!("node-{start}.log")),
    )
}

impl Node {
    fn start(dir: &Path, crash_point: Option<&str>) -> Node {
        Self::start_with(dir, crash_point, "")
    }

    /// [`Node::start`] with `extra` as the settings before `[cluster]`
    /// (default: 16 MiB WAL segments).
    fn start_with(dir: &Path, crash_point: Option<&str>, extra: &str) -> Node {
        let port = free_port();
        let url = format!("http://127.0.0.1:{port}");
        let config = dir.join("node.toml");
        std::fs::write(
            &config,
            format!(
                r#"node_id = 1
listen = "127.0.0.1:{port}"
metrics_listen = "127.0.0.1:{metrics}"
data_dir = "{data}"

{extra}
[cluster]
shards = 1
replicas = [1]
peers = [{{ id = 1, address = "{url}" }}]
"#,
                metrics = free_port(),
                data = dir.join("data").display(),
                extra = if extra.is_empty() {
                    "[engine]\nwal_segment_mib = 16\n"
                } else {
                    extra
                },
            ),
        )
        .unwrap();
        Node {
            process: spawn(dir, &config, crash_point, 0),
            url,
            config,
            dir: dir.to_path_buf(),
            starts: 1,
        }
    }

    fn restart(&mut self, crash_point: Option<&str>) {
        self.process = spawn(&self.dir, &self.config, crash_point, self.starts);
        self.starts += 1;
    }

    fn nodes(&self) -> BTreeMap<u64, String> {
        BTreeMap::from([(1, self.url.clone())])
    }

    /// Waits until every hosted replica leads; returns (shard, range).
    async fn wait_ranges(&mut self, replicas: usize) -> Vec<(u32, Option<(u64, u64)>)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut admin) = NodeAdminClient::connect(self.url.clone()).await
                && let Ok(status) = admin.status(NodeStatusRequest {}).await
            {
                let status = status.into_inner();
                if status.replicas.len() == replicas && status.replicas.iter().all(|r| r.is_leader)
                {
                    let mut ranges: Vec<_> = status
                        .replicas
                        .iter()
                        .map(|r| (r.shard_id, r.range.as_ref().map(|r| (r.start, r.end))))
                        .collect();
                    ranges.sort_unstable();
                    return ranges;
                }
            }
            assert!(
                self.process.running(),
                "node exited:\n{}",
                self.process.log()
            );
            assert!(
                Instant::now() < deadline,
                "{replicas} leading replicas not seen within 60 s:\n{}",
                self.process.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Disk bytes of each hosted replica's engine, by shard.
    async fn disk_bytes(&self) -> BTreeMap<u32, u64> {
        let mut admin = NodeAdminClient::connect(self.url.clone()).await.unwrap();
        let status = admin
            .status(NodeStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        status
            .replicas
            .iter()
            .map(|r| (r.shard_id, r.disk_used_bytes))
            .collect()
    }

    async fn write(&self, keys: std::ops::Range<usize>, round: u32) {
        for i in keys {
            put(
                &self.nodes(),
                "default",
                format!("k{i}").as_bytes(),
                &value(i, round),
            )
            .await
            .unwrap_or_else(|e| panic!("put k{i}: {e}"));
        }
    }

    async fn check(&self, keys: std::ops::Range<usize>, round: u32, what: &str) {
        for i in keys {
            let got = get(&self.nodes(), "default", format!("k{i}").as_bytes())
                .await
                .unwrap_or_else(|e| panic!("{what}: get k{i}: {e}"));
            assert!(got == value(i, round), "{what}: k{i} read back wrong");
        }
    }
}

async fn split_and_check(crash_point: Option<&str>) {
    let what = crash_point.unwrap_or("no crash");
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), crash_point);
    assert_eq!(node.wait_ranges(1).await, [(1, Some((0, u64::MAX)))]);
    node.write(0..KEYS, 1).await;
    let mut admin = NodeAdminClient::connect(node.url.clone()).await.unwrap();
    let split = admin
        .propose_admin(ProposeAdminRequest {
            shard_id: 1,
            op: Some(Op::Split(SplitOp {
                child_shard_id: CHILD,
                at: AT,
            })),
        })
        .await;
    if crash_point.is_some() {
        assert!(split.is_err(), "{what}: the node aborted mid-split");
        let deadline = Instant::now() + Duration::from_secs(20);
        while node.process.running() {
            assert!(Instant::now() < deadline, "{what}: the node did not abort");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            node.process.log().contains("aborting"),
            "{what}: the crash point was reached:\n{}",
            node.process.log()
        );
        node.restart(None);
    } else {
        split.unwrap_or_else(|e| panic!("split: {e}"));
    }
    let want = [(1, Some((0, AT - 1))), (CHILD, Some((AT, u64::MAX)))];
    assert_eq!(node.wait_ranges(2).await, want, "{what}");
    let shards = dir.path().join("data/shards");
    let mut names: Vec<String> = std::fs::read_dir(&shards)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["1", "2"], "{what}: no half-made directory is left");
    node.check(0..KEYS, 1, what).await;
    // Both groups take writes (keys fall on both sides of the cut) and
    // keep them through a restart.
    node.write(KEYS / 2..KEYS + 100, 2).await;
    node.process.kill();
    node.restart(None);
    assert_eq!(node.wait_ranges(2).await, want, "{what}, restarted");
    node.check(0..KEYS / 2, 1, what).await;
    node.check(KEYS / 2..KEYS + 100, 2, what).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_survives_a_crash_at_every_point_of_its_apply() {
    for point in [
        None,
        Some("copied"),
        Some("rewritten"),
        Some("renamed"),
        Some("recorded"),
    ] {
        split_and_check(point).await;
        eprintln!("split crash point {point:?}: ok");
    }
}

/// Bytes allocated under `dir`, each file counted once (hard links share
/// their blocks).
fn allocated_once(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::BTreeSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else if seen.insert(meta.ino()) {
                total += meta.blocks() * 512;
            }
        }
    }
    total
}

/// The hash position of `key` in the static cluster's namespace `default`.
fn position(key: &str) -> u64 {
    tidepool_proto::hash_position(&tidepool_proto::storage_key(1, key.as_bytes()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sides_of_a_split_share_their_files_and_shed_once_apart() {
    const BIG: usize = 320;
    let big = |i: usize| {
        format!("big value {i} ")
            .repeat(256 << 10 >> 4)
            .into_bytes()
    };
    let dir = tempfile::tempdir().unwrap();
    // Small segments (and so small entries), so the active and spare
    // segments weigh little next to the 72 MB of values.
    let settings = "[engine]\nwal_segment_mib = 4\nrelocation_interval_ms = 200\n\n[raft]\ncompact_log_entries = 64\nmax_value_bytes = 1048576\nmax_batch_bytes = 1048576\n";
    let mut node = Node::start_with(dir.path(), None, settings);
    node.wait_ranges(1).await;
    for i in 0..BIG {
        put(
            &node.nodes(),
            "default",
            format!("b{i}").as_bytes(),
            &big(i),
        )
        .await
        .unwrap_or_else(|e| panic!("put b{i}: {e}"));
    }
    let before = node.disk_bytes().await[&1];
    let shards = dir.path().join("data/shards");
    let volume_before = allocated_once(&shards);
    let mut admin = NodeAdminClient::connect(node.url.clone()).await.unwrap();
    admin
        .propose_admin(ProposeAdminRequest {
            shard_id: 1,
            op: Some(Op::Split(SplitOp {
                child_shard_id: CHILD,
                at: AT,
            })),
        })
        .await
        .unwrap();
    node.wait_ranges(2).await;
    // Both engines name every old value (the child's sealed segments are
    // hard links): the volume holds one copy, and relocation leaves the
    // shared files alone (copying a half out of one frees nothing while
    // the other side holds it), writes and log compactions going on.
    for round in 0..8 {
        node.write(round * 20..round * 20 + 20, 3).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Allowed: the copied tail segment, the child's own active and spare
    // segments (4 MiB each) and the writes; shedding both halves would add
    // the whole 72 MB again.
    let written = 160 * value(0, 3).len() as u64;
    let volume_split = allocated_once(&shards);
    assert!(
        volume_split < volume_before + (16 << 20) + 3 * written,
        "the split copied no more than the tail, and nothing was shed while shared: {volume_split} B of {volume_before} B"
    );
    // The child goes away (as when its replica moves to another node):
    // the parent's old segments are its own again, and it sheds.
    admin
        .close_replica(CloseReplicaRequest {
            shard_id: CHILD,
            map_version: 0,
            node_id: 0,
            conf_version: 0,
        })
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut round = 8;
    let parent = loop {
        let parent = node.disk_bytes().await[&1];
        if parent < before * 3 / 4 {
            break parent;
        }
        assert!(
            Instant::now() < deadline,
            "not shed within 90 s: {parent} B of {before} B before the split:\n{}",
            node.process.log()
        );
        // Writes to the parent's half (the child's has no host now) keep
        // its log compacting past the old segments.
        for i in round * 20..round * 20 + 20 {
            let key = format!("p{i}");
            if position(&key) < AT {
                put(&node.nodes(), "default", key.as_bytes(), &value(i, 4))
                    .await
                    .unwrap_or_else(|e| panic!("put {key}: {e}"));
            }
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "parent engine: {before} B before the split, {parent} B once alone; volume {volume_before} B before, {volume_split} B with both sides"
    );
    for i in 0..BIG {
        if position(&format!("b{i}")) >= AT {
            continue; // the child's, gone with it
        }
        let got = get(&node.nodes(), "default", format!("b{i}").as_bytes())
            .await
            .unwrap_or_else(|e| panic!("get b{i}: {e}"));
        assert!(got == big(i), "b{i} read back wrong after shedding");
    }
}

/// The names namespace `default`'s index holds in shard `shard`'s engine,
/// read from its files (the node stopped).
fn indexed_names(node: &Node, shard: u32) -> Vec<String> {
    let config = tidepool_node::config::NodeConfig::from_toml(
        &std::fs::read_to_string(&node.config).unwrap(),
    )
    .unwrap();
    let dir = node.dir.join("data/shards").join(shard.to_string());
    let store =
        tidepool_node::store::ReplicaStore::on_files(&dir, config.engine_config(dir.clone()));
    let engine = store.open_live().unwrap();
    let space = engine
        .key_space(tidepool_node::names::NAMES_KEY_SPACE)
        .unwrap();
    let mut names = Vec::new();
    tidepool_node::names::walk(&engine, space, 1, &[], None, |name, _| {
        names.push(String::from_utf8(name.to_vec()).unwrap());
        Ok(tidepool_node::names::Step::Continue)
    })
    .unwrap();
    engine.close().unwrap();
    names.sort();
    names
}

/// After a split each side's name index sheds the other half's names (a
/// listing skips them, but left there they would make every page examine
/// twice the leaves per split, and the index never shrink), and keeps its
/// own, through a kill -9 and later writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_side_of_a_split_sheds_the_other_halfs_names() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), None);
    node.wait_ranges(1).await;
    node.write(0..KEYS, 1).await;
    let all: Vec<String> = {
        let mut all: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
        all.sort();
        all
    };
    let below: Vec<String> = all.iter().filter(|k| position(k) < AT).cloned().collect();
    let above: Vec<String> = all.iter().filter(|k| position(k) >= AT).cloned().collect();
    assert!(!below.is_empty() && !above.is_empty());
    let mut admin = NodeAdminClient::connect(node.url.clone()).await.unwrap();
    admin
        .propose_admin(ProposeAdminRequest {
            shard_id: 1,
            op: Some(Op::Split(SplitOp {
                child_shard_id: CHILD,
                at: AT,
            })),
        })
        .await
        .unwrap();
    node.wait_ranges(2).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while node
        .process
        .log()
        .matches(tidepool_node::replica::SWEPT_LOG)
        .count()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "both sides did not finish shedding within 30 s:\n{}",
            node.process.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Killed (kill -9) right after shedding (its removals and records are
    // buffered writes, recovered from the log), restarted, more writes on
    // both sides, a graceful stop: each index holds exactly its side's
    // names, and nothing is shed twice or put back.
    node.process.kill();
    node.restart(None);
    node.wait_ranges(2).await;
    node.write(KEYS..KEYS + 20, 2).await;
    node.check(0..KEYS, 1, "after the restart").await;
    node.process.terminate();
    let mut all: Vec<String> = (0..KEYS + 20).map(|i| format!("k{i}")).collect();
    all.sort();
    let below: Vec<String> = all.iter().filter(|k| position(k) < AT).cloned().collect();
    let above: Vec<String> = all.iter().filter(|k| position(k) >= AT).cloned().collect();
    assert_eq!(indexed_names(&node, 1), below, "the parent's index");
    assert_eq!(indexed_names(&node, CHILD), above, "the child's index");
}
