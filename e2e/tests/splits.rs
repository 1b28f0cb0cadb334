//! Shard splits under a checked workload, on clusters of real processes
//! with real etcd (`docs/design/splits.md`): the split completes, clients
//! follow the new map, the coordinator spreads the new shards' replicas and
//! leaders, and the history checker finds nothing, also when
//! the parent's leader or the coordinator is killed (-9) mid-split. Replay
//! a seed with `E2E_SEED=<seed>`.

use std::time::{Duration, Instant};

use tidepool_client::proto::v1::{ClusterMap, ShardInfo};
use tidepool_client::proto::{hash_position, storage_key};
use tidepool_e2e::cluster::{Cluster, Options};
use tidepool_e2e::scenario::{Report, Run, start};
use tidepool_e2e::workload::Workload;

/// One scenario at a time: each runs a cluster of processes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Workload keys (few, so clients contend on them).
const KEYS: u32 = 24;

fn workload() -> Workload {
    Workload {
        seed: tidepool_testkit::seed_from_env("E2E_SEED"),
        keys: KEYS,
        ..Workload::default()
    }
}

/// The shard holding the most workload keys.
async fn busiest_shard(cluster: &Cluster) -> u32 {
    let shards = cluster.shards_of_keys(KEYS).await;
    let mut counts = std::collections::BTreeMap::new();
    for shard in shards {
        *counts.entry(shard).or_insert(0) += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(shard, _)| shard)
        .expect("keys")
}

/// Waits (running the workload) until the map has published the split of
/// `parent` into `child` at `at`, and the cluster has settled.
async fn wait_published(cluster: &Cluster, run: &Run, parent: u32, child: u32, at: u64) {
    tidepool_e2e::scenario::wait_split_published(cluster, run, parent, child, at).await;
    cluster.wait_settled(Duration::from_secs(90)).await;
}

/// The checks every split scenario ends with: a clean history, workload
/// keys served by the new shards, a listing that names exactly the keys
/// holding values, and no unexpected log line.
async fn finish_checks(cluster: &Cluster, report: &Report, new: &[u32]) {
    report.assert_clean();
    // The SDK retries through the split (WRONG_SHARD, a leader lost): no
    // operation may fail after its retries.
    assert!(
        report.errors.is_empty(),
        "operations failed through the split: {:?}",
        report.errors
    );
    assert!(report.acknowledged > 50, "the workload ran: {report:?}");
    let shards = cluster.shards_of_keys(KEYS).await;
    assert!(
        shards.iter().any(|s| new.contains(s)),
        "some workload keys belong to the new shards {new:?}: {shards:?}"
    );
    tidepool_e2e::scenario::check_listing(cluster, KEYS)
        .await
        .expect("the listing agrees with the blobs");
    let unexpected = cluster.unexpected_log_lines(&[]);
    assert!(
        unexpected.is_empty(),
        "unexpected log lines:\n{}",
        unexpected.join("\n")
    );
}

/// Writes acknowledged after `from` by the keys now in `child`.
fn child_writes_after(report: &Report, shards: &[u32], child: u32, from: u64) -> usize {
    use tidepool_e2e::history::{Op, Status};
    report
        .history
        .iter()
        .filter(|e| matches!(e.op, Op::Put(_)) && e.status == Status::Ok)
        .filter(|e| e.invoked > from && shards[e.key as usize] == child)
        .count()
}

/// How far apart the up nodes of `map` are in replicas held and in
/// shards led: (most - fewest) of each.
fn spread_of(map: &ClusterMap) -> (usize, usize) {
    use std::collections::BTreeMap;
    use tidepool_client::proto::v1::NodeState;
    let up = map.nodes.iter().filter(|n| n.state == NodeState::Up as i32);
    let mut held: BTreeMap<u64, usize> = up.map(|n| (n.node_id, 0)).collect();
    let mut led = held.clone();
    for shard in &map.shards {
        for replica in &shard.replicas {
            held.entry(replica.node_id).and_modify(|c| *c += 1);
        }
        led.entry(shard.leader_hint).and_modify(|c| *c += 1);
    }
    let gap = |counts: &BTreeMap<u64, usize>| {
        counts.values().max().unwrap_or(&0) - counts.values().min().unwrap_or(&0)
    };
    (gap(&held), gap(&led))
}

/// Waits (running the workload) until the coordinator has spread the
/// shards a split made: every up node holds and leads within one of every
/// other, with no move under way.
async fn wait_spread(cluster: &Cluster, run: &Run) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = cluster.status().await
            && let Some(map) = &status.map
            && status.moves.is_empty()
            && tidepool_e2e::cluster::settled(&status)
            && spread_of(map) <= (1, 1)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the shards were not spread over the nodes; map {:?}\n{}",
            cluster.status().await.and_then(|s| s.map),
            cluster.log_tails()
        );
        run.run_for(Duration::from_millis(300)).await;
    }
}

/// Four nodes, so that the new shards' replicas move as well as their
/// leaders: a split leaves the new group on its parent's three nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_under_load() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        nodes: 4,
        ..Options::default()
    })
    .await;
    let mut run = start(&cluster, workload()).await;
    run.run_for(Duration::from_secs(3)).await;
    let parent = busiest_shard(&cluster).await;
    let client = cluster.client().await;
    run.fault_begins();
    let (child, at) = client.split_shard(parent, 0).await.expect("split");
    wait_published(&cluster, &run, parent, child, at).await;
    let published = run.now();
    run.fault_ends();
    run.run_for(Duration::from_secs(3)).await;
    // A second split of the new shard: splits compose.
    let (grandchild, at2) = client.split_shard(child, 0).await.expect("split again");
    wait_published(&cluster, &run, child, grandchild, at2).await;
    // The coordinator spreads the six shards' 18 replicas and leaders over
    // the four nodes (placement moves replicas, the balancer leaders).
    wait_spread(&cluster, &run).await;
    run.run_for(Duration::from_secs(2)).await;
    let report = run.finish("split under load (twice)").await;
    let shards = cluster.shards_of_keys(KEYS).await;
    let served = child_writes_after(&report, &shards, child, published)
        + child_writes_after(&report, &shards, grandchild, published);
    assert!(served > 0, "the new shards took writes");
    finish_checks(&cluster, &report, &[child, grandchild]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_with_the_leader_killed() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Options::default()).await;
    let mut run = start(&cluster, workload()).await;
    run.run_for(Duration::from_secs(3)).await;
    let parent = busiest_shard(&cluster).await;
    let leader = cluster
        .status()
        .await
        .and_then(|s| s.map)
        .and_then(|m| m.shards.into_iter().find(|s| s.shard_id == parent))
        .map(|s| s.leader_hint)
        .expect("the parent has a leader");
    let client = cluster.client().await;
    run.fault_begins();
    let (child, at) = client.split_shard(parent, 0).await.expect("split");
    // Killed as soon as the split is decided: before, during or right
    // after its entry applies, depending on the coordinator's round.
    run.run_for(Duration::from_millis(400)).await;
    cluster.kill_node(leader as usize - 1);
    run.run_for(Duration::from_secs(4)).await;
    cluster.start_node(leader as usize - 1);
    wait_published(&cluster, &run, parent, child, at).await;
    run.fault_ends();
    run.run_for(Duration::from_secs(3)).await;
    let report = run.finish("split with the parent's leader killed").await;
    finish_checks(&cluster, &report, &[child]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_with_the_coordinator_killed() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Options {
        coordinators: 2,
        ..Options::default()
    })
    .await;
    let mut run = start(&cluster, workload()).await;
    run.run_for(Duration::from_secs(3)).await;
    let parent = busiest_shard(&cluster).await;
    let client = cluster.client().await;
    run.fault_begins();
    let (child, at) = client.split_shard(parent, 0).await.expect("split");
    // The intent is in etcd; the leader dies before (or while) carrying it
    // out, and the other coordinator takes over from the map and reports.
    let (index, _) = cluster.leader_status().await.expect("a leader");
    cluster.kill_coordinator(index);
    wait_published(&cluster, &run, parent, child, at).await;
    run.fault_ends();
    run.run_for(Duration::from_secs(3)).await;
    let report = run.finish("split with the coordinator killed").await;
    finish_checks(&cluster, &report, &[child]).await;
}

/// Names in namespace `default` whose hash position lies in `shard`
/// (`count` of them, `prefix-0`, `prefix-1`, ...: the first that do).
fn names_in(map: &ClusterMap, shard: &ShardInfo, prefix: &str, count: usize) -> Vec<Vec<u8>> {
    let ns = map
        .namespaces
        .iter()
        .find(|n| n.name == "default")
        .expect("default")
        .id;
    (0..)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .filter(|name| {
            let p = hash_position(&storage_key(ns, name));
            shard.hash_start <= p && p <= shard.hash_end
        })
        .take(count)
        .collect()
}

/// Gets of `names` from `tasks` concurrent loops until `stop` is set;
/// returns the number of gets done.
fn hammer(
    client: &tidepool_client::Client,
    names: Vec<Vec<u8>>,
    tasks: usize,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinSet<u64> {
    use std::sync::atomic::Ordering;
    let names = std::sync::Arc::new(names);
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let (client, names, stop) = (client.clone(), names.clone(), stop.clone());
        set.spawn(async move {
            let mut done = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let name = &names[(done as usize * 7 + t) % names.len()];
                // A get may fail over a split (retried inside the SDK) or
                // time out under load; only the count matters here.
                let _ = client.get("default", name).await;
                done += 1;
            }
            done
        });
    }
    set
}

/// The leader-reported requests per second of each shard.
fn shard_rates(status: &tidepool_client::proto::v1::ClusterStatus) -> Vec<(u32, f64)> {
    let mut rates: Vec<(u32, f64)> = status
        .nodes
        .iter()
        .flat_map(|n| n.replicas.iter())
        .filter(|r| r.is_leader)
        .map(|r| (r.shard_id, r.requests_per_second))
        .collect();
    rates.sort_by_key(|(id, _)| *id);
    rates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_shard_splits_by_load_and_a_hot_key_does_not() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    const LIMIT: u64 = 200;
    const SUSTAIN_SECS: u64 = 3;
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        shards: 2,
        split_rps: LIMIT,
        split_load_secs: SUSTAIN_SECS,
        ..Options::default()
    })
    .await;
    // One checked client paced to at most 50 operations a second: its own
    // load stays well under the limit whatever the host (unpaced it was
    // 150-220 requests per second per shard in a debug build, and two
    // clients once reached 302, over the 300 this test used then). The
    // hammers below are not paced: 800-1,900 requests a second on the hot
    // shard (one hot key: about as many), 360-440 on a host three to four
    // times slower, where the limit of 500 this test used before was not
    // reached in 90 s.
    let mut run = start(
        &cluster,
        Workload {
            clients: 1,
            pace: Some(Duration::from_millis(20)),
            ..workload()
        },
    )
    .await;
    run.run_for(Duration::from_secs(8)).await;
    let status = cluster.status().await.expect("status");
    let before = shard_rates(&status);
    eprintln!("requests per second with the checked workload alone: {before:?}");
    let map = status.map.expect("map");
    assert_eq!(map.shards.len(), 2, "no split under the workload alone");
    // Many keys of shard 1, spread over its range.
    let hot_shard = map.shards[0].clone();
    let names = names_in(&map, &hot_shard, "hot", 256);
    let client = cluster.client().await;
    for name in &names {
        client.put("default", name, b"hot").await.expect("put");
    }
    run.fault_begins();
    let stop = Arc::new(AtomicBool::new(false));
    let mut gets = hammer(&client, names, 12, &stop);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(90);
    let child = loop {
        let status = cluster.status().await;
        let child = status.as_ref().and_then(|s| s.map.as_ref()).and_then(|m| {
            m.shards
                .iter()
                .find(|s| {
                    s.shard_id > 2
                        && hot_shard.hash_start < s.hash_start
                        && s.hash_end <= hot_shard.hash_end
                })
                .map(|s| s.shard_id)
        });
        if let Some(child) = child {
            break child;
        }
        assert!(
            Instant::now() < deadline,
            "the hot shard did not split; rates {:?}\n{}",
            status.as_ref().map(shard_rates),
            cluster.log_tails()
        );
        run.run_for(Duration::from_millis(300)).await;
    };
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut done = 0;
    while let Some(n) = gets.join_next().await {
        done += n.expect("hammer task");
    }
    eprintln!(
        "shard {} split into {child} by load after {took:?} ({done} gets)",
        hot_shard.shard_id
    );
    assert!(
        took >= Duration::from_secs(SUSTAIN_SECS),
        "a split by load waits for the load to last"
    );
    // Where the leader's cut was: both halves took a fair part of the
    // spread keys (the cut balances the recent requests, within a quarter).
    let status = cluster.status().await.expect("status");
    let map = status.map.expect("map");
    let parent = map
        .shards
        .iter()
        .find(|s| s.shard_id == hot_shard.shard_id)
        .expect("parent");
    let spread = names_in(&map, &hot_shard, "hot", 256);
    let below = spread
        .iter()
        .filter(|n| {
            let ns = map
                .namespaces
                .iter()
                .find(|n| n.name == "default")
                .unwrap()
                .id;
            hash_position(&storage_key(ns, n)) <= parent.hash_end
        })
        .count();
    assert!(
        (64..=192).contains(&below),
        "the cut divides the hot keys: {below} of 256 below it"
    );
    cluster.wait_settled(Duration::from_secs(90)).await;
    // One hot key in shard 2: over the limit, but no cut spreads it.
    let cold = map
        .shards
        .iter()
        .find(|s| s.shard_id == 2)
        .expect("shard 2")
        .clone();
    let key = names_in(&map, &cold, "hotkey", 1);
    client.put("default", &key[0], b"hot").await.expect("put");
    let stop = Arc::new(AtomicBool::new(false));
    let mut gets = hammer(&client, key, 12, &stop);
    let watched = Instant::now();
    let mut peak = 0.0f64;
    while watched.elapsed() < Duration::from_secs(SUSTAIN_SECS * 4) {
        run.run_for(Duration::from_millis(500)).await;
        if let Some(status) = cluster.status().await {
            let rate = shard_rates(&status)
                .into_iter()
                .find(|(id, _)| *id == 2)
                .map_or(0.0, |(_, r)| r);
            peak = peak.max(rate);
        }
    }
    stop.store(true, Ordering::Relaxed);
    while let Some(n) = gets.join_next().await {
        n.expect("hammer task");
    }
    let map = cluster.status().await.and_then(|s| s.map).expect("map");
    let shard2 = map
        .shards
        .iter()
        .find(|s| s.shard_id == 2)
        .expect("shard 2");
    eprintln!("one hot key in shard 2: peak {peak:.0} requests per second");
    assert!(
        peak > LIMIT as f64,
        "the hot key took shard 2 over the limit ({peak:.0} <= {LIMIT})"
    );
    assert!(
        shard2.split.is_none()
            && (shard2.hash_start, shard2.hash_end) == (cold.hash_start, cold.hash_end),
        "a shard hot on one key does not split: {shard2:?}"
    );
    assert!(
        !cluster.log_lines_with("no split would spread").is_empty(),
        "the coordinator says why it does not split shard 2"
    );
    run.fault_ends();
    run.run_for(Duration::from_secs(2)).await;
    let report = run.finish("splits by load").await;
    finish_checks(&cluster, &report, &[child]).await;
}

/// The value of bulk key `i`: 64 KiB, cheap to check.
fn bulk(i: u32) -> Vec<u8> {
    format!("bulk value {i:08} ")
        .repeat(64 << 10 >> 5)
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_growing_cluster_splits_its_shards_by_size() {
    const LIMIT_MIB: u64 = 16;
    // 56 MiB of 64 KiB values over 2 shards: each splits at least once.
    const BULK: u32 = 896;
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        shards: 2,
        split_mib: LIMIT_MIB,
        relocation_interval_ms: Some(300),
        ..Options::default()
    })
    .await;
    let mut run = start(&cluster, workload()).await;
    run.run_for(Duration::from_secs(2)).await;
    run.fault_begins();
    let client = cluster.client().await;
    for i in 0..BULK {
        client
            .put("default", format!("bulk-{i}").as_bytes(), &bulk(i))
            .await
            .unwrap_or_else(|e| panic!("bulk put {i}: {e}"));
    }
    // Until no shard holds more than the limit of bulk values (counted
    // from the map's ranges: the truth, where the sizes nodes report are
    // estimates), no split is under way and the cluster has settled.
    let bulk_bytes = |map: &ClusterMap, shard: &ShardInfo| -> u64 {
        let ns = map
            .namespaces
            .iter()
            .find(|n| n.name == "default")
            .expect("default")
            .id;
        (0..BULK)
            .filter(|i| {
                let p = hash_position(&storage_key(ns, format!("bulk-{i}").as_bytes()));
                shard.hash_start <= p && p <= shard.hash_end
            })
            .count() as u64
            * (64 << 10)
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let map = loop {
        let status = cluster.status().await;
        if let Some(status) = &status
            && let Some(map) = &status.map
            && map
                .shards
                .iter()
                .all(|s| s.split.is_none() && bulk_bytes(map, s) <= LIMIT_MIB << 20)
            && tidepool_e2e::cluster::settled(status)
        {
            break map.clone();
        }
        assert!(
            Instant::now() < deadline,
            "shards still over {LIMIT_MIB} MiB after 120 s: {:?}\n{}",
            status.and_then(|s| s.map).map(|m| m.shards),
            cluster.log_tails()
        );
        run.run_for(Duration::from_millis(500)).await;
    };
    run.fault_ends();
    let sizes: Vec<(u32, u64)> = map
        .shards
        .iter()
        .map(|s| (s.shard_id, bulk_bytes(&map, s)))
        .collect();
    eprintln!("{} shards, bulk bytes each: {sizes:?}", sizes.len());
    assert!(sizes.len() >= 4, "each of the 2 shards split at least once");
    for i in 0..BULK {
        let got = client
            .get("default", format!("bulk-{i}").as_bytes())
            .await
            .unwrap_or_else(|e| panic!("bulk get {i}: {e}"));
        assert!(got == bulk(i), "bulk value {i} read back wrong");
    }
    run.run_for(Duration::from_secs(2)).await;
    let report = run.finish("a growing cluster splits by size").await;
    let new: Vec<u32> = sizes
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| *id > 2)
        .collect();
    finish_checks(&cluster, &report, &new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_of_a_shard_being_moved_while_epochs_drop() {
    use tidepool_client::{ErrorCode, RetentionPolicy};
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        nodes: 4,
        ..Options::default()
    })
    .await;
    let client = cluster.client().await;
    // A namespace whose blobs go one epoch after their last write.
    client
        .create_namespace("scratch", false, RetentionPolicy::Epochs(1))
        .await
        .expect("namespace");
    let scratch: Vec<Vec<u8>> = (0..60)
        .map(|i| format!("scratch-{i}").into_bytes())
        .collect();
    for key in &scratch {
        client
            .put("scratch", key, b"expires")
            .await
            .expect("scratch put");
    }
    let mut run = start(&cluster, workload()).await;
    run.run_for(Duration::from_secs(3)).await;
    run.fault_begins();
    // Node 4 drains: its replicas move, one shard at a time.
    client.drain_node(4).await.expect("drain");
    let deadline = Instant::now() + Duration::from_secs(30);
    let moving = loop {
        if let Some(status) = cluster.status().await
            && let Some(first) = status.moves.first()
        {
            break first.shard_id;
        }
        assert!(Instant::now() < deadline, "no move started");
        run.run_for(Duration::from_millis(100)).await;
    };
    // Split the shard being moved, and drop an epoch meanwhile.
    let (child, at) = client.split_shard(moving, 0).await.expect("split");
    client.advance_epoch(None).await.expect("advance");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = cluster.status().await
            && let Some(map) = &status.map
        {
            let published = map
                .shards
                .iter()
                .any(|s| s.shard_id == child && s.hash_start == at);
            let drained = map
                .shards
                .iter()
                .all(|s| s.replicas.iter().all(|r| r.node_id != 4));
            let dropped = status.epochs.as_ref().is_some_and(|e| {
                e.namespaces
                    .iter()
                    .filter(|n| n.namespace == "scratch")
                    .all(|n| n.drop_below >= 2 && n.shards_done == n.shards_total)
            });
            if published && drained && dropped && tidepool_e2e::cluster::settled(&status) {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "split {moving} -> {child}, drain and drop not all done: {:?}\n{}",
            cluster.status().await.map(|s| (s.map, s.moves, s.epochs)),
            cluster.log_tails()
        );
        run.run_for(Duration::from_millis(300)).await;
    }
    run.fault_ends();
    // The expired blobs are gone on both sides of the cut.
    for key in &scratch {
        let got = client.get("scratch", key).await;
        assert!(
            matches!(&got, Err(e) if e.code() == ErrorCode::NotFound),
            "{}: {got:?}",
            String::from_utf8_lossy(key)
        );
    }
    run.run_for(Duration::from_secs(2)).await;
    let report = run
        .finish("split of a shard being moved, epochs dropping")
        .await;
    finish_checks(&cluster, &report, &[child]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_behind_the_split_gets_the_new_shard_by_snapshot() {
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(Options {
        compact_log_entries: Some(64),
        ..Options::default()
    })
    .await;
    let mut run = start(&cluster, workload()).await;
    run.run_for(Duration::from_secs(3)).await;
    let parent = busiest_shard(&cluster).await;
    let leader = cluster
        .status()
        .await
        .and_then(|s| s.map)
        .and_then(|m| m.shards.into_iter().find(|s| s.shard_id == parent))
        .map(|s| s.leader_hint)
        .expect("the parent has a leader");
    // A follower of the parent is down through the split, and the parent's
    // log compacts past the split entry while it is: it comes back to a
    // snapshot of the parent taken after the split, so it never applies the
    // split itself.
    let victim = (leader as usize) % 3;
    run.fault_begins();
    cluster.kill_node(victim);
    let client = cluster.client().await;
    let (child, at) = client.split_shard(parent, 0).await.expect("split");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cluster.status().await.and_then(|s| s.map).is_some_and(|m| {
        m.shards
            .iter()
            .any(|s| s.shard_id == child && s.hash_start == at)
    }) {
        assert!(
            Instant::now() < deadline,
            "the split was not published with a node down"
        );
        run.run_for(Duration::from_millis(300)).await;
    }
    run.run_for(Duration::from_secs(6)).await;
    cluster.start_node(victim);
    // The node opens the new shard empty and gets it from its leader.
    let victim_id = victim as u64 + 1;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let caught_up = cluster.status().await.is_some_and(|status| {
            let leader_commit = status
                .nodes
                .iter()
                .flat_map(|n| &n.replicas)
                .find(|r| r.shard_id == child && r.is_leader)
                .map(|r| r.commit_index);
            let mine = status
                .nodes
                .iter()
                .filter(|n| n.node_id == victim_id)
                .flat_map(|n| &n.replicas)
                .find(|r| r.shard_id == child)
                .map(|r| r.applied_index);
            matches!((leader_commit, mine), (Some(c), Some(a)) if a > 1 && a + 64 >= c)
                && tidepool_e2e::cluster::settled(&status)
        });
        if caught_up {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {victim_id} did not catch up with shard {child}:\n{}",
            cluster.log_tails()
        );
        run.run_for(Duration::from_millis(300)).await;
    }
    run.fault_ends();
    let log = cluster.nodes[victim]
        .process
        .as_ref()
        .map(|p| p.log())
        .unwrap_or_default();
    assert!(
        log.contains("opened a split-off group's replica") && !log.contains("split applied"),
        "node {victim_id} opened the new shard without applying the split:\n{log}"
    );
    run.run_for(Duration::from_secs(2)).await;
    let report = run.finish("a node behind the split").await;
    finish_checks(&cluster, &report, &[child]).await;
}
