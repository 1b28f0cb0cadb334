//! The node's table of replicas while replicas open, and a restart that
//! finds a replica's files gone.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use tidepool_proto::v1::{ReplicaInfo, ReplicaRole, ShardInfo};

use super::Node;
use crate::config::NodeConfig;

/// A one-node cluster of one shard in `dir`.
fn one_node(dir: &std::path::Path) -> Arc<Node> {
    Node::open(one_node_config(dir)).unwrap()
}

fn one_node_config(dir: &std::path::Path) -> NodeConfig {
    NodeConfig::from_toml(&format!(
        "node_id = 1\n\
         insecure = true\n\
         data_dir = {:?}\n\
         [engine]\nwal_segment_mib = 16\n\
         [cluster]\nshards = 1\nreplicas = [1]\n\
         peers = [{{ id = 1, address = \"http://127.0.0.1:1\" }}]\n",
        dir.display().to_string()
    ))
    .unwrap()
}

/// Runs `f` on a thread of its own; `None` if it has not returned within
/// `wait` (the thread is left to finish).
fn within<T: Send + 'static>(wait: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(wait).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_find_their_replicas_while_another_opens() {
    let dir = tempfile::tempdir().unwrap();
    let node = one_node(dir.path());
    assert!(
        node.shard(1).is_some(),
        "the shard of the static map is open"
    );

    // A replica whose opening cannot finish yet: a split is moving a
    // directory into place (it holds the lock on making replica
    // directories, as while it syncs the shards directory).
    let making = crate::store::making_dirs();
    let opening = {
        let node = node.clone();
        std::thread::spawn(move || {
            let info = ShardInfo {
                shard_id: 2,
                hash_start: 0,
                hash_end: u64::MAX,
                replicas: vec![ReplicaInfo {
                    node_id: 1,
                    role: ReplicaRole::Voter as i32,
                }],
                ..ShardInfo::default()
            };
            node.open_replica(info, &[1])
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !opening.is_finished(),
        "the opening waits for the directory lock"
    );

    // Meanwhile the request path still finds the open replicas, and the
    // one still opening is not there yet.
    let looking = node.clone();
    let found = within(Duration::from_secs(5), move || {
        (
            looking.shard(1).is_some(),
            looking.shard(2).is_some(),
            looking.hosted().len(),
        )
    });
    drop(making);
    assert_eq!(
        found,
        Some((true, false, 1)),
        "lookups answered while a replica opened"
    );

    // The opening completes, once; a second one finds it open.
    assert!(!opening.join().unwrap().unwrap(), "newly opened");
    assert!(node.shard(2).is_some());
    let info = node
        .hosted()
        .into_iter()
        .find(|(i, _)| i.shard_id == 2)
        .unwrap()
        .0;
    assert!(node.open_replica(info, &[1]).unwrap(), "already open");
    node.shutdown();
}

/// A node restarts and finds the directory of a replica it hosted (its
/// `SHARD` file) without the replica's engine: the files were deleted, or
/// the volume holding them is not mounted. It must not open an empty
/// replica there — one that votes with its log and votes forgotten — and
/// says which directory and why; nothing is created in it. (A node that
/// does not start is down to the coordinator, which rebuilds its replicas
/// on the other nodes after the grace period.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_refuses_a_replica_whose_files_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let node = one_node(dir.path());
    node.shutdown();
    drop(node);
    let replica = dir.path().join("shards").join("1");
    assert!(replica.join(crate::store::SHARD_FILE).exists());
    let engine = replica.join("a");
    assert!(engine.join("control").exists(), "the replica had an engine");
    std::fs::remove_dir_all(&engine).unwrap();

    let error = match Node::open(one_node_config(dir.path())) {
        Ok(_) => panic!("the node opened a replica without its files"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("replica files missing") && error.contains(&engine.display().to_string()),
        "names the missing files: {error}"
    );
    assert!(
        !engine.join("control").exists(),
        "no empty engine was created in their place"
    );
}

/// A second node on the data directory of a running one — a second pod on
/// one volume, a dev cluster started twice — is refused before it touches
/// anything: opening removes the directories of unfinished splits, which
/// the first node may be building at that moment. Once the first has shut
/// down, the directory is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_on_one_data_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let node = one_node(dir.path());
    let building = dir
        .path()
        .join("shards")
        .join(format!("{}9", crate::replica::SPLIT_TEMP_PREFIX));
    std::fs::create_dir_all(&building).unwrap();

    let error = match Node::open(one_node_config(dir.path())) {
        Ok(_) => panic!("a second node opened a data directory in use"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("in use by another node"), "{error}");
    assert!(building.exists(), "the first node's split was left alone");

    node.shutdown();
    let again = Node::open(one_node_config(dir.path())).unwrap();
    assert!(!building.exists(), "the directory is the node's again");
    again.shutdown();
}

/// A pre-stop hook whose coordinator accepts the connection and never
/// answers (hung, or its host gone without a reset) stops waiting once
/// `undecided` has passed and the call's own deadline fired: before, the
/// call waited for ever and held the pod for its whole grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_stop_hook_does_not_wait_on_a_hung_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("NODE_ID"), b"1").unwrap();
    // Accepts, reads whatever comes, answers nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut sink = Vec::new();
                let _ = tokio::io::AsyncReadExt::read_to_end(&mut socket, &mut sink).await;
            });
        }
    });
    let began = std::time::Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        super::prepare_stop(
            dir.path(),
            vec![address],
            tidepool_security::Security::default(),
            Duration::from_secs(1),
            Duration::from_secs(300),
        ),
    )
    .await
    .expect("the hook ended")
    .unwrap();
    assert!(
        outcome.contains("without an answer"),
        "{outcome} after {:?}",
        began.elapsed()
    );
}
