//! The SDK against a real cluster: an in-process coordinator and nodes on
//! loopback sockets (`tidepool_testkit::cluster`). Routing and every
//! operation; calls that keep working while shard leaders move; a client
//! whose map went stale while replicas moved; a blob larger than 64 MiB
//! streamed in chunks, read back in ranges with the next chunk fetched
//! ahead; corrupted bytes on a replica never returned as data.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tidepool_client::proto::v1::TransferLeaderRequest;
use tidepool_client::proto::v1::node_admin_client::NodeAdminClient;
use tidepool_client::{
    Client, ClientConfig, ErrorCode, ListEntry, ListOptions, RetentionPolicy, sha256,
};
use tidepool_testkit::cluster::LocalCluster;

fn value(i: u64) -> Vec<u8> {
    (0..(100 + i * 13 % 3000))
        .map(|j| (i * 7 + j) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_routes_to_its_shard() {
    let cluster = LocalCluster::start(3, 4, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("key-{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate() {
        let outcome = client.put("default", key, &value(i as u64)).await.unwrap();
        assert_eq!(outcome.sha256, sha256(&value(i as u64)));
    }
    // The keys landed on every shard.
    let map = client.map();
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(client.get("default", key).await.unwrap(), value(i as u64));
    }
    let meta = client.head("default", &keys[3]).await.unwrap();
    assert_eq!(
        (meta.size, meta.epoch, meta.chunked),
        (value(3).len() as u64, 1, false)
    );

    // batch_exists is exact across shards, in order.
    let mut asked = keys.clone();
    asked.extend((0..10).map(|i| format!("absent-{i}").into_bytes()));
    let present = client.batch_exists("default", &asked).await.unwrap();
    assert_eq!(present.iter().filter(|p| **p).count(), 40);
    assert!(present[..40].iter().all(|p| *p) && present[40..].iter().all(|p| !*p));
    assert!(client.exists("default", &keys[0]).await.unwrap());
    let missing = client.find_missing("default", &asked).await.unwrap();
    assert_eq!(missing.len(), 10);

    // Delete, touch, and their errors.
    assert!(client.delete("default", &keys[0]).await.unwrap());
    assert!(!client.delete("default", &keys[0]).await.unwrap());
    assert!(!client.exists("default", &keys[0]).await.unwrap());
    let e = client.get("default", &keys[0]).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert_eq!(client.touch("default", &keys[1]).await.unwrap(), 1);
    assert_eq!(
        client.touch("default", b"never").await.unwrap_err().code(),
        ErrorCode::NotFound
    );
    let e = client.put("nope", b"k", b"v").await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::NamespaceNotFound);
    // A per-call deadline, sharing the map and connections.
    let quick = client.with_timeout(Duration::from_millis(300));
    assert_eq!(quick.get("default", &keys[2]).await.unwrap(), value(2));

    // Content addressing: the node verifies, the SDK verifies.
    client
        .create_namespace("chunks", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let digest = client.put_content("chunks", b"some chunk").await.unwrap();
    assert_eq!(digest, sha256(b"some chunk"));
    assert_eq!(client.get("chunks", &digest).await.unwrap(), b"some chunk");
    let again = client.put("chunks", &digest, b"some chunk").await.unwrap();
    assert!(again.already_present);
    let e = client
        .put("chunks", &digest, b"other bytes")
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::DigestMismatch);
    let e = client.put("chunks", b"short", b"x").await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);

    // An upload told the digest to expect stores nothing under its key
    // unless the content hashes to it, as a plain blob or chunked.
    for size in [1000usize, (4 << 20) + 1000] {
        let content: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let key = format!("expected-{size}").into_bytes();
        let mut upload = client.upload("default", &key).await.unwrap();
        upload.expect_sha256(sha256(b"something else"));
        upload.write(&content).await.unwrap();
        let e = upload.finish().await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::DigestMismatch, "{size} bytes: {e}");
        assert!(!client.exists("default", &key).await.unwrap(), "{size}");
        let mut upload = client.upload("default", &key).await.unwrap();
        upload.expect_sha256(sha256(&content));
        upload.write(&content).await.unwrap();
        assert_eq!(upload.finish().await.unwrap().sha256, sha256(&content));
        assert!(
            client.get("default", &key).await.unwrap() == content,
            "{size}"
        );
    }
    assert!(map.shards.len() == 4);
    cluster.stop().await;
}

/// Moves the leadership of every shard to another voter.
async fn move_leaders(cluster: &LocalCluster) {
    let map = cluster.map();
    for shard in &map.shards {
        let Some(to) = shard
            .replicas
            .iter()
            .map(|r| r.node_id)
            .find(|n| *n != shard.leader_hint)
        else {
            continue;
        };
        let address = map
            .nodes
            .iter()
            .find(|n| n.node_id == shard.leader_hint)
            .map(|n| n.address.clone())
            .unwrap();
        if let Ok(mut admin) = NodeAdminClient::connect(address).await {
            let _ = admin
                .transfer_leader(TransferLeaderRequest {
                    shard_id: shard.shard_id,
                    to_node: to,
                })
                .await;
        }
    }
}

/// A node that no longer leads a shard answers a batch existence check
/// with "not here" for every key (an OK reply): the SDK must move on to
/// the new leader, not keep asking the node it learned as leader until
/// the deadline (what made the build-cache gateway stall for 30 s per
/// call after a leadership transfer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_exists_follows_a_leadership_transfer() {
    let cluster = LocalCluster::start(3, 4, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("k-{i}").into_bytes()).collect();
    for key in &keys {
        client.put("default", key, b"v").await.unwrap();
    }
    let quick = client.with_timeout(Duration::from_secs(5));
    assert!(
        quick
            .batch_exists("default", &keys)
            .await
            .unwrap()
            .iter()
            .all(|p| *p)
    );
    for round in 0..3 {
        move_leaders(&cluster).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let present = quick
            .batch_exists("default", &keys)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(present.iter().all(|p| *p), "round {round}");
        let missing = quick.find_missing("default", &keys).await.unwrap();
        assert!(missing.is_empty(), "round {round}");
    }
    cluster.stop().await;
}

/// More keys than a node takes in one request (100,000), all in one
/// shard: the SDK splits them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_exists_of_more_keys_than_one_request_takes() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    for i in [7u32, 99_999, 100_000] {
        client.put("default", &i.to_le_bytes(), b"v").await.unwrap();
    }
    let keys: Vec<Vec<u8>> = (0..100_001u32).map(|i| i.to_le_bytes().to_vec()).collect();
    let present = client.batch_exists("default", &keys).await.unwrap();
    let found: Vec<usize> = (0..present.len()).filter(|i| present[*i]).collect();
    assert_eq!(found, vec![7, 99_999, 100_000]);

    // 10,000 keys of 1 KiB (the longest a key may be): 10 MiB, over the
    // node's 8 MiB request limit in one request. Before, the node's gRPC
    // layer refused it (OUT_OF_RANGE, no detail) and the SDK sent it again
    // to every replica until its deadline, then answered TIMEOUT.
    let long = |i: u32| {
        let mut key = vec![b'k'; 1024];
        key[..4].copy_from_slice(&i.to_le_bytes());
        key
    };
    client.put("default", &long(4_321), b"v").await.unwrap();
    let keys: Vec<Vec<u8>> = (0..10_000u32).map(long).collect();
    let started = std::time::Instant::now();
    let present = client.batch_exists("default", &keys).await.unwrap();
    let found: Vec<usize> = (0..present.len()).filter(|i| present[*i]).collect();
    assert_eq!(found, vec![4_321]);
    println!("10,000 keys of 1 KiB checked in {:?}", started.elapsed());
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_keep_working_while_leaders_move() {
    let cluster = LocalCluster::start(3, 4, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let client = client.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut done = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("k-{done}");
                client
                    .put("default", key.as_bytes(), &value(done))
                    .await
                    .unwrap();
                assert_eq!(
                    client.get("default", key.as_bytes()).await.unwrap(),
                    value(done)
                );
                done += 1;
            }
            done
        })
    };
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        move_leaders(&cluster).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let done = load.await.expect("no call failed");
    assert!(done > 10, "the load ran ({done} rounds)");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_map_is_refreshed_after_replicas_move() {
    let mut cluster = LocalCluster::start(3, 4, 3).await;
    let mut config = ClientConfig::new(&[cluster.url.as_str()]);
    config.watch = false;
    let client = Client::with_config(config).await.unwrap();
    for i in 0..30 {
        client
            .put("default", format!("k-{i}").as_bytes(), &value(i))
            .await
            .unwrap();
    }
    let before = client.map().version;
    // Two nodes join and two old ones are drained: every shard leaves
    // nodes the client's map still routes to.
    cluster.add_node().await;
    cluster.add_node().await;
    let admin = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let old: Vec<u64> = client
        .map()
        .nodes
        .iter()
        .map(|n| n.node_id)
        .take(2)
        .collect();
    for id in &old {
        admin.drain_node(*id).await.unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        cluster.wait_settled(5).await;
        let map = cluster.map();
        let on_old = map
            .shards
            .iter()
            .any(|s| s.replicas.iter().any(|r| old.contains(&r.node_id)));
        if !on_old {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the drain did not finish: {map:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(client.map().version, before, "the client has not looked");
    for i in 0..30 {
        let got = client
            .get("default", format!("k-{i}").as_bytes())
            .await
            .unwrap();
        assert_eq!(got, value(i));
        client
            .put("default", format!("n-{i}").as_bytes(), &value(i))
            .await
            .unwrap();
    }
    assert!(client.map().version > before, "the stale map was refreshed");
    cluster.stop().await;
}

/// A node that no longer leads answers with the leader's address and its
/// own map version: the SDK follows the hint and, that version being newer
/// than its map, fetches the map (without the watch) so that later calls
/// go to the leader directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_from_a_newer_map_refreshes_the_client() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let mut config = ClientConfig::new(&[cluster.url.as_str()]);
    config.watch = false;
    let client = Client::with_config(config).await.unwrap();
    client.put("default", b"k", b"v").await.unwrap();
    let before = client.map().version;
    let old_leader = cluster.map().shards[0].leader_hint;
    move_leaders(&cluster).await;
    // Every node has a map in which another node leads.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let moved = cluster.map().shards[0].leader_hint;
        let newest = cluster.map().version;
        let known = cluster
            .nodes
            .iter()
            .flatten()
            .all(|n| n.node.map().version >= newest);
        if moved != 0 && moved != old_leader && known {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the leader moved");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(client.map().version, before, "the client has not looked");
    assert_eq!(client.get("default", b"k").await.unwrap(), b"v");
    assert!(
        client.map().version > before,
        "the not-leader answer's newer map version made the client fetch the map"
    );
    cluster.stop().await;
}

/// Chunks are stored in the background while the next fills: one that
/// fails (here: two of three replicas gone, so no quorum) fails a later
/// write, and poisons the upload: every write and `finish` after it refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_fails_for_good_after_a_chunk_failed() {
    let mut cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()])
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    let chunk = client.chunk_size();
    let mut upload = client.upload("default", b"doomed").await.unwrap();
    cluster.stop_node(1).await;
    cluster.stop_node(2).await;
    // Chunks go to the background; by the third write the first has failed.
    let mut first_error = None;
    for i in 0..4u8 {
        if let Err(e) = upload.write(&vec![i; chunk + 1]).await {
            first_error = Some(e);
            break;
        }
    }
    let error = first_error.expect("a write reports the failed chunk");
    assert!(
        matches!(error.code(), ErrorCode::Timeout | ErrorCode::NoQuorum),
        "{error}"
    );
    let again = upload.write(b"more").await.expect_err("poisoned");
    assert_eq!(again.code(), ErrorCode::InvalidArgument, "{again}");
    let finished = upload.finish().await.expect_err("poisoned");
    assert_eq!(finished.code(), ErrorCode::InvalidArgument, "{finished}");
    cluster.stop().await;
}

/// An upload whose chunks were written before an epoch advance and whose
/// manifest after it moves the chunks to the manifest's epoch: left in
/// theirs, the first drop took them an epoch before the manifest, which
/// went on saying the blob exists while every read of it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_written_before_an_epoch_advance_move_to_the_manifests_epoch() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    client
        .create_namespace("expiring", false, RetentionPolicy::Epochs(2))
        .await
        .unwrap();
    let chunk = client.chunk_size();
    let content = vec![5u8; 2 * chunk + 1];
    let mut upload = client.upload("expiring", b"spanning").await.unwrap();
    upload.write(&content).await.unwrap();
    let chunks = upload.started_chunk_keys();
    assert_eq!(chunks.len(), 2);
    let before = client.map().epoch;
    // The chunks are stored (in the background) in the epoch before.
    for key in &chunks {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let stored = loop {
            match client.head("expiring", key).await {
                Ok(meta) => break meta,
                Err(e) if e.code() == ErrorCode::NotFound => {
                    assert!(std::time::Instant::now() < deadline, "a chunk never stored");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(stored.epoch, before);
    }
    let advanced = client.advance_epoch(None).await.unwrap();
    assert!(advanced > before);
    // Every shard's leader knows of the advance before the manifest is
    // stored: 16 puts in a row (of keys spread over both shards) say so.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (mut in_a_row, mut i) = (0, 0);
    while in_a_row < 16 {
        assert!(
            std::time::Instant::now() < deadline,
            "the advance never reached the nodes"
        );
        let probe = format!("probe-{i}").into_bytes();
        i += 1;
        if client.put("expiring", &probe, b"p").await.unwrap().epoch >= advanced {
            in_a_row += 1;
        } else {
            in_a_row = 0;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let stored = upload.finish().await.unwrap();
    assert_eq!(stored.epoch, advanced);
    for key in &chunks {
        let meta = client.head("expiring", key).await.unwrap();
        assert_eq!(
            meta.epoch, advanced,
            "a chunk stayed in epoch {}",
            meta.epoch
        );
    }
    assert_eq!(client.get("expiring", b"spanning").await.unwrap(), content);
    cluster.stop().await;
}

/// A delete of a chunked blob dropped once its manifest is gone (a gateway
/// client disconnecting mid-request) still deletes the blob's chunks:
/// nothing else names them, so they were never reclaimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_dropped_after_the_manifest_went_still_deletes_the_chunks() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let content = vec![9u8; 6 * client.chunk_size() + 1];
    let mut cut_short = 0;
    for round in 0..3 {
        let key = format!("deleted-{round}").into_bytes();
        client.put("default", &key, &content).await.unwrap();
        let chunks: Vec<Vec<u8>> = client
            .chunks("default", &key)
            .await
            .unwrap()
            .into_iter()
            .map(|c| c.key)
            .collect();
        assert_eq!(chunks.len(), 7);
        let watcher = client.clone();
        let manifest_gone = async { while watcher.exists("default", &key).await.unwrap() {} };
        tokio::select! {
            biased;
            _ = manifest_gone => cut_short += 1,
            done = client.delete("default", &key) => assert!(done.unwrap()),
        }
        let mut left = chunks.len();
        for _ in 0..100 {
            let present = client.batch_exists("default", &chunks).await.unwrap();
            left = present.iter().filter(|p| **p).count();
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(left, 0, "round {round}: chunks of the deleted blob stay");
    }
    assert!(
        cut_short > 0,
        "no delete was cut short: the test checked nothing"
    );
    cluster.stop().await;
}

/// A put over a chunked blob dropped once the new manifest is stored (a
/// gateway client disconnecting) still deletes the old blob's chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_dropped_after_its_manifest_went_still_deletes_the_old_chunks() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let size = 6 * client.chunk_size() + 1;
    let mut cut_short = 0;
    for round in 0..3u8 {
        let key = format!("replaced-{round}").into_bytes();
        client.put("default", &key, &vec![1; size]).await.unwrap();
        let old: Vec<Vec<u8>> = client
            .chunks("default", &key)
            .await
            .unwrap()
            .into_iter()
            .map(|c| c.key)
            .collect();
        let watcher = client.clone();
        let replaced = async {
            loop {
                if let Ok(chunks) = watcher.chunks("default", &key).await
                    && chunks.first().map(|c| &c.key) != old.first()
                {
                    break;
                }
            }
        };
        let new = vec![2; size];
        tokio::select! {
            biased;
            _ = replaced => cut_short += 1,
            done = client.put("default", &key, &new) => { done.unwrap(); }
        }
        let mut left = old.len();
        for _ in 0..100 {
            let present = client.batch_exists("default", &old).await.unwrap();
            left = present.iter().filter(|p| **p).count();
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(left, 0, "round {round}: chunks of the replaced blob stay");
        assert_eq!(client.get("default", &key).await.unwrap(), vec![2; size]);
    }
    assert!(
        cut_short > 0,
        "no put was cut short: the test checked nothing"
    );
    cluster.stop().await;
}

/// A blob of one chunk or less put over a chunked one — by `put` or by an
/// upload — deletes the old blob's chunks (the node answers with the
/// manifest the put replaced): before, only a chunked put did (it reads
/// the old manifest first), and a small overwrite left them stored,
/// unlisted and unnamed, for ever. A refused put deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_put_over_a_chunked_blob_deletes_its_chunks() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let size = 3 * client.chunk_size() + 1;
    let chunks_of = |key: &'static [u8]| {
        let client = client.clone();
        async move {
            client
                .chunks("default", key)
                .await
                .unwrap()
                .into_iter()
                .map(|c| c.key)
                .collect::<Vec<_>>()
        }
    };
    for (round, by_upload) in [(0u8, false), (1, true)] {
        let key: &'static [u8] = if by_upload {
            b"small-upload"
        } else {
            b"small-put"
        };
        client
            .put("default", key, &vec![round; size])
            .await
            .unwrap();
        let old = chunks_of(key).await;
        assert_eq!(old.len(), 4, "the blob is chunked");
        assert_eq!(
            client.batch_exists("default", &old).await.unwrap(),
            vec![true; 4]
        );
        if by_upload {
            let mut upload = client.upload("default", key).await.unwrap();
            upload.write(b"now small").await.unwrap();
            upload.finish().await.unwrap();
        } else {
            client.put("default", key, b"now small").await.unwrap();
        }
        assert_eq!(client.get("default", key).await.unwrap(), b"now small");
        let present = client.batch_exists("default", &old).await.unwrap();
        assert_eq!(
            present,
            vec![false; 4],
            "by upload: {by_upload}: the replaced blob's chunks stay"
        );
    }
    // A put refused (only if absent) deletes nothing.
    client
        .put("default", b"kept", &vec![9; size])
        .await
        .unwrap();
    let kept = chunks_of(b"kept").await;
    let refused = client.put_if_absent("default", b"kept", b"x").await;
    assert_eq!(refused.unwrap_err().code(), ErrorCode::AlreadyExists);
    assert_eq!(
        client.batch_exists("default", &kept).await.unwrap(),
        vec![true; 4]
    );
    assert_eq!(client.get("default", b"kept").await.unwrap(), vec![9; size]);
    cluster.stop().await;
}

/// An upload that ends without storing its blob — dropped (a client gone
/// mid-body), or refused at the end because the content is not the one
/// expected — deletes the chunks it stored: nothing else names them, so
/// they were never reclaimed (every interrupted restic upload of a pack
/// larger than a chunk leaked its chunks). A finished upload's stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_upload_deletes_its_chunks() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let chunk = client.chunk_size();
    let content = vec![7u8; 3 * chunk + 100];
    let stored = |keys: Vec<[u8; 32]>| {
        let client = client.clone();
        async move {
            let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
            let present = client.batch_exists("default", &keys).await.unwrap();
            present.iter().filter(|p| **p).count()
        }
    };
    let gone_soon = |keys: Vec<[u8; 32]>| async move {
        for _ in 0..100 {
            if stored(keys.clone()).await == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    };
    // Dropped after three chunks were started.
    let mut upload = client.upload("default", b"dropped").await.unwrap();
    upload.write(&content).await.unwrap();
    let keys = upload.started_chunk_keys();
    assert_eq!(keys.len(), 3);
    drop(upload);
    assert!(gone_soon(keys).await, "the dropped upload's chunks stay");
    // Dropped while a write waited for the oldest chunk's store (the
    // caller gone mid-write): that store is still waited for before the
    // chunks are deleted. (Taken out of the upload's list before it was
    // awaited, it escaped the cleanup, and left its chunk stored for good
    // whenever it applied after the delete of its key — not forced here.)
    let mut upload = client.upload("default", b"cut-mid-write").await.unwrap();
    upload.write(&content[..2 * chunk + 1]).await.unwrap();
    let keys = upload.started_chunk_keys();
    assert_eq!(keys.len(), 2);
    let cut = tokio::time::timeout(
        Duration::from_micros(1),
        upload.write(&content[2 * chunk + 1..]),
    )
    .await;
    assert!(cut.is_err(), "the write did not wait for a store");
    // Cancelled, the write took bytes no chunk holds: the upload is over
    // (a `finish` stored a blob whose size and digest counted them).
    let after = upload.write(b"more").await.unwrap_err();
    assert_eq!(after.code(), ErrorCode::InvalidArgument, "{after}");
    drop(upload);
    assert!(gone_soon(keys).await, "the cut upload's chunks stay");
    // Refused at the end: the content is not the one expected.
    let mut upload = client.upload("default", b"mismatched").await.unwrap();
    upload.expect_sha256([0; 32]);
    upload.write(&content).await.unwrap();
    let keys = upload.started_chunk_keys();
    let error = upload.finish().await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::DigestMismatch, "{error}");
    assert!(
        gone_soon(keys.clone()).await,
        "the refused upload's chunks stay"
    );
    // Finished: the blob and its chunks stay.
    let mut upload = client.upload("default", b"kept").await.unwrap();
    upload.write(&content).await.unwrap();
    let keys = upload.started_chunk_keys();
    upload.finish().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stored(keys.clone()).await, keys.len());
    assert_eq!(client.get("default", b"kept").await.unwrap(), content);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_larger_than_64_mib_stream_in_chunks() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let seed = tidepool_testkit::seed_from_env("STREAM_SEED");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut big = vec![0u8; (65 << 20) + 12_345];
    rng.fill(&mut big[..]);
    let outcome = client
        .put_stream("default", b"big", &big[..])
        .await
        .unwrap();
    assert_eq!(outcome.size, big.len() as u64);
    assert_eq!(outcome.sha256, sha256(&big));
    let meta = client.head("default", b"big").await.unwrap();
    assert!(meta.chunked);
    assert_eq!((meta.size, meta.sha256), (big.len() as u64, sha256(&big)));
    let mut out = Vec::new();
    let size = client
        .get_stream("default", b"big", &mut out)
        .await
        .unwrap();
    assert_eq!(size, big.len() as u64);
    assert!(out == big, "the blob comes back whole (seed {seed})");
    // Replaced by a small one, then deleted.
    client.put("default", b"big", b"small now").await.unwrap();
    assert_eq!(client.get("default", b"big").await.unwrap(), b"small now");
    assert!(client.delete("default", b"big").await.unwrap());
    cluster.stop().await;
}

/// Blob content bytes the cluster's nodes have returned so far.
fn bytes_served(cluster: &LocalCluster) -> u64 {
    cluster
        .nodes
        .iter()
        .flatten()
        .map(|n| n.node.metrics.get_bytes.get())
        .sum()
}

/// A chunked blob read in pieces: every range comes back exact; a reader
/// fetches the chunk after the one it handed out before it is asked for it
/// (so the next round trip overlaps the caller's work), and never a chunk
/// wholly past its range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_reads_fetch_ahead_within_their_range() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let chunk = client.chunk_size() as u64;
    let seed = tidepool_testkit::seed_from_env("STREAM_SEED");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut blob = vec![0u8; (5 * chunk + 1_000) as usize];
    rng.fill(&mut blob[..]);
    client
        .put_stream("default", b"six-chunks", &blob[..])
        .await
        .unwrap();

    // Ranges: inside one chunk, across a boundary, to the end, random.
    let mut ranges = vec![
        (chunk + 10, 100),
        (2 * chunk - 5, 10),
        (5 * chunk, 1_000),
        (0, 6 * chunk),
    ];
    for _ in 0..6 {
        let offset = rng.random_range(0..blob.len() as u64);
        ranges.push((offset, rng.random_range(1..3 * chunk)));
    }
    for (offset, len) in ranges {
        let served = bytes_served(&cluster);
        let mut reader = client
            .open_range("default", b"six-chunks", offset, Some(len))
            .await
            .unwrap();
        let mut out = Vec::new();
        while let Some(piece) = reader.next_piece().await.unwrap() {
            out.extend_from_slice(&piece);
        }
        let end = (offset + len).min(blob.len() as u64) as usize;
        assert!(
            out[..] == blob[offset as usize..end],
            "range {offset}+{len} (seed {seed})"
        );
        // The manifest, and the chunks the range touches.
        let touched = (end as u64).div_ceil(chunk) - offset / chunk;
        let fetched = bytes_served(&cluster) - served;
        assert!(
            fetched < (touched + 1) * chunk,
            "range {offset}+{len} touches {touched} chunks; {fetched} bytes fetched (seed {seed})"
        );
    }

    // After the first piece, the second chunk is on its way unasked.
    let served = bytes_served(&cluster);
    let mut reader = client
        .open_range("default", b"six-chunks", 0, None)
        .await
        .unwrap();
    let first = reader.next_piece().await.unwrap().unwrap();
    assert_eq!(first.len() as u64, chunk);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while bytes_served(&cluster) - served < 2 * chunk {
        assert!(
            std::time::Instant::now() < deadline,
            "the next chunk was not fetched ahead"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // And no further than one ahead while the caller holds back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(bytes_served(&cluster) - served < 3 * chunk);
    drop(reader);
    cluster.stop().await;
}

/// Flips one byte of the first copy of `pattern` under `dir`; returns
/// whether it found one.
fn corrupt_first(dir: &std::path::Path, pattern: &[u8]) -> bool {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap().flatten() {
                stack.push(entry.path());
            }
            continue;
        }
        let Ok(mut bytes) = std::fs::read(&path) else {
            continue;
        };
        if let Some(at) = bytes.windows(pattern.len()).position(|w| w == pattern) {
            bytes[at + pattern.len() / 2] ^= 0xff;
            std::fs::write(&path, &bytes).unwrap();
            return true;
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_replica_bytes_are_never_returned() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    client
        .create_namespace("cas", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let content: Vec<u8> = (0..200_000u32)
        .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
        .collect();
    let digest = client.put_content("cas", &content).await.unwrap();
    client.put("default", b"plain", &content).await.unwrap();
    // A small blob: a head reads it whole, checked.
    let small: Vec<u8> = (0..2_000u32).map(|i| (i * 7 + 3) as u8).collect();
    client.put("default", b"small", &small).await.unwrap();
    // Corrupt the leader's copy (the one linearizable reads use).
    let leader = cluster.map().shards[0].leader_hint;
    let index = cluster
        .nodes
        .iter()
        .position(|n| n.as_ref().unwrap().node.config.node_id == leader)
        .unwrap();
    // Both blobs' copies (the first flip breaks the pattern in the first).
    for _ in 0..2 {
        assert!(corrupt_first(
            &cluster.node_dir(index),
            &content[1000..1064]
        ));
    }
    assert!(corrupt_first(&cluster.node_dir(index), &small[100..164]));
    // The right bytes, from a healthy replica where the leader's copy is
    // damaged — in a content-addressed namespace checked against the key,
    // elsewhere against the digest the leader's header names (before, one
    // damaged copy there answered CORRUPT while two good ones existed).
    let nodes: std::collections::BTreeMap<u64, String> = client
        .map()
        .nodes
        .iter()
        .map(|n| (n.node_id, n.address.clone()))
        .collect();
    // Both copies on the leader are damaged: read from it, each fails.
    for (ns, key) in [
        ("cas", digest.to_vec()),
        ("default", b"plain".to_vec()),
        ("default", b"small".to_vec()),
    ] {
        let direct = tidepool_testkit::grpc::get_at(
            &nodes[&leader],
            ns,
            &key,
            tidepool_client::proto::v1::ReadConsistency::Linearizable,
        )
        .await;
        assert!(direct.is_err(), "{ns}: the leader's copy is intact");
    }
    let got = client.get("cas", &digest).await.unwrap();
    assert!(got == content, "corrupt content returned");
    let got = client.get("default", b"plain").await.unwrap();
    assert!(got == content, "corrupt content returned");
    let got = client.get("default", b"small").await.unwrap();
    assert!(got == small, "corrupt content returned");
    cluster.stop().await;
}

/// A content-addressed blob stored in chunks whose manifest is damaged on
/// the leader is read from a healthy replica's manifest: one intact by its
/// own header and describing the key's digest (a manifest's bytes never
/// hash to the blob's digest, its key, so checked against the key alone
/// no replica's copy was taken and the read failed `CORRUPT` while two
/// good copies existed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_content_addressed_manifest_is_read_from_another_replica() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    client
        .create_namespace("cas", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let limit = client.map().max_value_bytes as usize;
    let content: Vec<u8> = (0..limit * 2 + 100)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect();
    let digest = client.put_content("cas", &content).await.unwrap();
    let leader = cluster.map().shards[0].leader_hint;
    let nodes: std::collections::BTreeMap<u64, String> = client
        .map()
        .nodes
        .iter()
        .map(|n| (n.node_id, n.address.clone()))
        .collect();
    // Its bytes, from a follower (a read on the leader would cache them
    // there, out of reach of the damage).
    let follower = nodes.keys().copied().find(|n| *n != leader).unwrap();
    let manifest = tidepool_testkit::grpc::get_at(
        &nodes[&follower],
        "cas",
        &digest,
        tidepool_client::proto::v1::ReadConsistency::AnyReplica,
    )
    .await
    .unwrap();
    assert!(manifest.len() < content.len() / 100, "a manifest");
    let index = cluster
        .nodes
        .iter()
        .position(|n| n.as_ref().unwrap().node.config.node_id == leader)
        .unwrap();
    // Every copy in the leader's files (the log may hold it twice).
    let mut copies = 0;
    while corrupt_first(&cluster.node_dir(index), &manifest) {
        copies += 1;
    }
    assert!(copies > 0);
    let direct = tidepool_testkit::grpc::get_at(
        &nodes[&leader],
        "cas",
        &digest,
        tidepool_client::proto::v1::ReadConsistency::Linearizable,
    )
    .await;
    assert!(
        direct.as_ref().map_or(true, |d| *d != manifest),
        "the leader's manifest is intact"
    );
    let got = client.get("cas", &digest).await.unwrap();
    assert!(got == content, "wrong content returned");
    cluster.stop().await;
}

/// A manifest is data a node hands back: one forged to list another blob
/// as its chunk (written over the raw API by anyone who may put) must not
/// make `delete` remove that blob. Only chunks whose key derives from the
/// blob's key and the manifest's nonce are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_manifest_cannot_make_delete_remove_other_blobs() {
    use prost::Message as _;
    use tidepool_client::proto::v1::{
        BlobKind, BlobRef, ChunkManifest, ChunkRef, PutHeader, PutRequest, put_request,
    };
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    client
        .put("default", b"victim", b"must survive")
        .await
        .unwrap();
    // A genuine chunked blob, to check its own chunks still go.
    let limit = client.map().max_value_bytes as usize;
    let genuine: Vec<u8> = (0..limit * 2 + 10).map(|i| (i % 251) as u8).collect();
    client.put("default", b"genuine", &genuine).await.unwrap();

    let forged = ChunkManifest {
        size: 12,
        sha256: sha256(b"must survive").to_vec(),
        chunks: vec![ChunkRef {
            key: b"victim".to_vec(),
            size: 12,
            sha256: sha256(b"must survive").to_vec(),
        }],
        nonce: 7,
    }
    .encode_to_vec();
    let nodes: std::collections::BTreeMap<u64, String> = client
        .map()
        .nodes
        .iter()
        .map(|n| (n.node_id, n.address.clone()))
        .collect();
    tidepool_testkit::grpc::routed(&nodes, |url| {
        let forged = forged.clone();
        async move {
            let header = PutHeader {
                blob: Some(BlobRef {
                    namespace: "default".into(),
                    key: b"evil".to_vec(),
                }),
                size: forged.len() as u64,
                kind: BlobKind::Manifest as i32,
                ..PutHeader::default()
            };
            let messages = vec![
                PutRequest {
                    msg: Some(put_request::Msg::Header(header)),
                },
                PutRequest {
                    msg: Some(put_request::Msg::Data(forged.into())),
                },
            ];
            tidepool_testkit::grpc::client(&url)
                .await
                .put(tokio_stream::iter(messages))
                .await
                .map(|r| r.into_inner())
        }
    })
    .await
    .unwrap();

    assert!(client.delete("default", b"evil").await.unwrap());
    assert_eq!(
        client.get("default", b"victim").await.unwrap(),
        b"must survive",
        "the forged manifest's 'chunk' was another blob"
    );
    // The genuine blob's chunks are its own: deleted with it.
    let manifest_chunks = {
        let bytes = tidepool_testkit::grpc::get(&nodes, "default", b"genuine")
            .await
            .unwrap();
        ChunkManifest::decode(&bytes[..]).unwrap().chunks
    };
    assert_eq!(manifest_chunks.len(), 3);
    assert!(client.delete("default", b"genuine").await.unwrap());
    for chunk in manifest_chunks {
        assert!(!client.exists("default", &chunk.key).await.unwrap());
    }
    cluster.stop().await;
}

/// Every key of `options` through `Client::list`, in order.
async fn list_all(client: &Client, namespace: &str, options: ListOptions) -> Vec<ListEntry> {
    let mut lister = client.list(namespace, options);
    let mut all = Vec::new();
    while let Some(entry) = lister.next().await.unwrap() {
        all.push(entry);
    }
    assert!(!lister.incomplete());
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_merges_every_shard_in_key_order() {
    let cluster = LocalCluster::start(3, 4, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let seed = tidepool_testkit::seed_from_env("LIST_SEED");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut model = std::collections::BTreeMap::new();
    for i in 0..300u64 {
        let dir = ["a/", "a/b/", "b/", "snapshots/"][rng.random_range(0..4)];
        let key = format!("{dir}{:03x}", rng.random_range(0..0x400)).into_bytes();
        let content = value(i);
        client.put("default", &key, &content).await.unwrap();
        model.insert(key, content);
    }
    // Some deleted again.
    let doomed: Vec<Vec<u8>> = model.keys().step_by(7).cloned().collect();
    for key in &doomed {
        assert!(client.delete("default", key).await.unwrap());
        model.remove(key);
    }
    // A chunked blob is one entry (its chunks are not listed), with the
    // whole blob's size and digest.
    let big: Vec<u8> = (0..(9 << 20) + 77).map(|i| (i % 251) as u8).collect();
    client
        .put_stream("default", b"b/big", &big[..])
        .await
        .unwrap();
    model.insert(b"b/big".to_vec(), big.clone());

    // The keys sit on all four shards, and come back merged in order.
    let shards: std::collections::BTreeSet<u32> = model
        .keys()
        .map(|k| {
            let map = client.map();
            let id = map
                .namespaces
                .iter()
                .find(|n| n.name == "default")
                .unwrap()
                .id;
            let position =
                tidepool_client::proto::hash_position(&tidepool_client::proto::storage_key(id, k));
            map.shards
                .iter()
                .find(|s| s.hash_start <= position && position <= s.hash_end)
                .unwrap()
                .shard_id
        })
        .collect();
    assert_eq!(shards.len(), 4, "seed {seed}");
    for page_size in [1, 7, 0] {
        let all = list_all(
            &client,
            "default",
            ListOptions {
                page_size,
                ..ListOptions::default()
            },
        )
        .await;
        let keys: Vec<&Vec<u8>> = all.iter().map(|e| &e.key).collect();
        assert_eq!(
            keys,
            model.keys().collect::<Vec<_>>(),
            "seed {seed}, pages of {page_size}"
        );
        for entry in &all {
            let content = &model[&entry.key];
            assert_eq!(entry.size, content.len() as u64);
            assert_eq!(entry.sha256, sha256(content));
            assert_eq!(entry.chunked, entry.key == b"b/big");
        }
    }
    // Prefixes, and pages that resume from their token.
    for prefix in [&b"a/"[..], b"a/b/", b"snap", b"zzz"] {
        let want: Vec<&Vec<u8>> = model.keys().filter(|k| k.starts_with(prefix)).collect();
        let mut got = Vec::new();
        let mut start_after = None;
        loop {
            let page = client
                .list_page(
                    "default",
                    ListOptions {
                        prefix: prefix.to_vec(),
                        start_after: start_after.clone(),
                        page_size: 3,
                    },
                    10,
                )
                .await
                .unwrap();
            assert!(page.entries.len() <= 10);
            got.extend(page.entries.into_iter().map(|e| e.key));
            match page.next {
                Some(next) => start_after = Some(next),
                None => break,
            }
        }
        assert_eq!(
            got.iter().collect::<Vec<_>>(),
            want,
            "seed {seed}, prefix {prefix:?}"
        );
    }
    // A chunked blob overwritten by a plain one after its page was read
    // is listed as the plain one, not left out: the key held a blob for
    // the whole listing.
    let mut lister = client.list(
        "default",
        ListOptions {
            prefix: b"b/".to_vec(),
            ..ListOptions::default()
        },
    );
    let first = lister.next().await.unwrap().expect("b/ holds keys");
    assert!(first.key.as_slice() < &b"b/big"[..], "{:?}", first.key);
    client.put("default", b"b/big", b"small now").await.unwrap();
    let mut rest = Vec::new();
    while let Some(entry) = lister.next().await.unwrap() {
        rest.push(entry);
    }
    let big_now = rest
        .iter()
        .find(|e| e.key == b"b/big")
        .expect("b/big is listed");
    assert_eq!(
        (big_now.size, big_now.sha256, big_now.chunked),
        (9, sha256(b"small now"), false)
    );

    // Content-addressed keys are listed as their digests; an empty
    // namespace lists nothing; an unknown one is an error.
    client
        .create_namespace("cas", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let digest = client.put_content("cas", b"chunk").await.unwrap();
    let cas = list_all(&client, "cas", ListOptions::default()).await;
    assert_eq!(cas.len(), 1);
    assert_eq!(cas[0].key, digest.to_vec());
    client
        .create_namespace("empty", false, RetentionPolicy::Durable)
        .await
        .unwrap();
    assert!(
        list_all(&client, "empty", ListOptions::default())
            .await
            .is_empty()
    );
    let error = client
        .list("missing", ListOptions::default())
        .next()
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::NamespaceNotFound);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_continues_over_both_sides_of_a_split() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let keys: Vec<Vec<u8>> = (0..200).map(|i| format!("k{i:04}").into_bytes()).collect();
    for key in &keys {
        client.put("default", key, b"x").await.unwrap();
    }
    let mut lister = client.list(
        "default",
        tidepool_client::ListOptions {
            page_size: 5,
            ..Default::default()
        },
    );
    let mut listed = Vec::new();
    for _ in 0..50 {
        listed.push(lister.next().await.unwrap().expect("an entry").key);
    }
    // Shard 1 splits under the listing: its later pages cover only its
    // lower half, the rest is the new shard's.
    let (child, _) = client.split_shard(1, 0).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !client
        .refresh_map()
        .await
        .unwrap()
        .shards
        .iter()
        .any(|s| s.shard_id == child)
    {
        assert!(std::time::Instant::now() < deadline, "split not published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while let Some(entry) = lister.next().await.unwrap() {
        listed.push(entry.key);
    }
    let text = |keys: &[Vec<u8>]| -> Vec<String> {
        keys.iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect()
    };
    assert_eq!(text(&listed), text(&keys), "every key once, in order");
}

/// A chunked blob replaced (or deleted) while a reader holds its old
/// manifest: the replacing put deletes the old chunks once its manifest is
/// stored, so the reader's next chunk is gone. The reader says the blob
/// changed (CONFLICT), not that the key is missing (it holds the new
/// blob); `get`, which has returned nothing yet, reads the new blob.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_blob_replaced_while_it_is_read_is_a_conflict_not_a_missing_key() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let chunk = client.chunk_size();
    let old: Vec<u8> = (0..6 * chunk).map(|i| (i % 251) as u8).collect();
    let new: Vec<u8> = (0..6 * chunk).map(|i| (i % 241) as u8).collect();
    client
        .put_stream("default", b"moving", &old[..])
        .await
        .unwrap();
    for replace in [true, false] {
        let mut reader = client
            .open_range("default", b"moving", 0, None)
            .await
            .unwrap();
        let first = reader.next_piece().await.unwrap().unwrap();
        assert!(first[..] == old[..chunk]);
        if replace {
            client
                .put_stream("default", b"moving", &new[..])
                .await
                .unwrap();
        } else {
            client.delete("default", b"moving").await.unwrap();
        }
        let error = loop {
            match reader.next_piece().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("read to the end of a blob whose chunks were deleted"),
                Err(error) => break error,
            }
        };
        assert_eq!(
            error.code(),
            ErrorCode::Conflict,
            "replaced: {replace}: {error}"
        );
        if replace {
            assert!(client.get("default", b"moving").await.unwrap() == new);
        }
        client
            .put_stream("default", b"moving", &old[..])
            .await
            .unwrap();
    }
    cluster.stop().await;
}

/// `splice` stores the blob its chunks make: of two chunks a manifest, of
/// one the chunk itself (already the blob), of none the empty blob — which
/// before was reported stored and was not (a later get: NOT_FOUND).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn splicing_stores_the_blob_its_chunks_make_even_of_none() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    client
        .create_namespace("cas", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let (a, b) = (b"first chunk ".to_vec(), b"second chunk".to_vec());
    let ka = client.put_content("cas", &a).await.unwrap();
    let kb = client.put_content("cas", &b).await.unwrap();
    let whole = [a.clone(), b.clone()].concat();
    let spliced = client
        .splice("cas", &sha256(&whole), &[ka, kb])
        .await
        .unwrap();
    assert_eq!(spliced.size, whole.len() as u64);
    assert_eq!(client.get("cas", &sha256(&whole)).await.unwrap(), whole);
    let one = client.splice("cas", &ka, &[ka]).await.unwrap();
    assert!(one.already_present && one.epoch > 0, "{one:?}");
    let empty = sha256(b"");
    assert_eq!(
        client.get("cas", &empty).await.unwrap_err().code(),
        ErrorCode::NotFound
    );
    client.splice("cas", &empty, &[]).await.unwrap();
    assert_eq!(client.get("cas", &empty).await.unwrap(), b"");
    let error = client.splice("cas", &empty, &[ka]).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::DigestMismatch, "{error}");
    cluster.stop().await;
}

/// A range that covers the whole blob is checked as a whole read is: the
/// chunks must add up to the blob the manifest describes. Before, only a
/// read without a limit was, and HTTP readers ask `Range: bytes=0-` with
/// the size (the gateway's restic server): a manifest whose chunks hold
/// more than its size was served cut to that size, unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_the_whole_blob_is_checked_as_a_whole_read() {
    use prost::Message as _;
    use tidepool_client::proto::v1::{
        BlobKind, BlobRef, ChunkManifest, ChunkRef, PutHeader, PutRequest, put_request,
    };
    let cluster = LocalCluster::start(3, 2, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    client
        .put("default", b"chunk", b"twelve bytes")
        .await
        .unwrap();
    // Six bytes, says the manifest; its one chunk holds twelve.
    let short = ChunkManifest {
        size: 6,
        sha256: sha256(b"twelve").to_vec(),
        chunks: vec![ChunkRef {
            key: b"chunk".to_vec(),
            size: 12,
            sha256: sha256(b"twelve bytes").to_vec(),
        }],
        nonce: 7,
    }
    .encode_to_vec();
    let nodes: std::collections::BTreeMap<u64, String> = client
        .map()
        .nodes
        .iter()
        .map(|n| (n.node_id, n.address.clone()))
        .collect();
    tidepool_testkit::grpc::routed(&nodes, |url| {
        let short = short.clone();
        async move {
            let header = PutHeader {
                blob: Some(BlobRef {
                    namespace: "default".into(),
                    key: b"short".to_vec(),
                }),
                size: short.len() as u64,
                kind: BlobKind::Manifest as i32,
                ..PutHeader::default()
            };
            let messages = vec![
                PutRequest {
                    msg: Some(put_request::Msg::Header(header)),
                },
                PutRequest {
                    msg: Some(put_request::Msg::Data(short.into())),
                },
            ];
            tidepool_testkit::grpc::client(&url)
                .await
                .put(tokio_stream::iter(messages))
                .await
                .map(|r| r.into_inner())
        }
    })
    .await
    .unwrap();
    let read = async |limit: Option<u64>| {
        let mut reader = client.open_range("default", b"short", 0, limit).await?;
        let mut out = Vec::new();
        while let Some(piece) = reader.next_piece().await? {
            out.extend_from_slice(&piece);
        }
        tidepool_client::Result::Ok(out)
    };
    for whole in [None, Some(6), Some(100)] {
        let error = read(whole)
            .await
            .expect_err("the chunks hold more than the blob");
        assert_eq!(error.code(), ErrorCode::Corrupt, "{whole:?}: {error}");
    }
    // A part of the blob is no claim about the whole.
    assert_eq!(read(Some(3)).await.unwrap(), b"twe");
    cluster.stop().await;
}

/// A reader whose chunk failed stays failed: every later call answers the
/// same error. Before, it had moved past the failed chunk, so a caller
/// that tried again got the next chunk's bytes as if they came next (a
/// range with a hole, and no error), or the reader panicked ("the next
/// chunk's fetch was started") once the failure had dropped its fetches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_stays_failed_after_a_chunk_failed() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let chunk = client.chunk_size();
    let blob: Vec<u8> = (0..3 * chunk + 10).map(|i| (i % 241) as u8).collect();
    client.put("default", b"holed", &blob).await.unwrap();
    let chunks = client.chunks("default", b"holed").await.unwrap();
    assert_eq!(chunks.len(), 4);
    let mut reader = client
        .open_range("default", b"holed", 0, Some(blob.len() as u64 - 5))
        .await
        .unwrap();
    let first = reader.next_piece().await.unwrap().unwrap();
    assert!(first[..] == blob[..chunk]);
    // Chunk 1 goes (as if an operator or a bug deleted it) before the
    // reader reaches it; its fetch may be under way already, so wait for
    // it to end first by deleting chunk 2's too and reading on.
    for c in &chunks[1..3] {
        assert!(client.delete("default", &c.key).await.unwrap());
    }
    let mut failed = None;
    for _ in 0..3 {
        match reader.next_piece().await {
            Ok(Some(piece)) => {
                // Fetched ahead before the delete: the right bytes.
                assert!(failed.is_none(), "a piece after the failure");
                assert!(piece[..] == blob[chunk..2 * chunk]);
            }
            Ok(None) => panic!("ended without the missing chunks"),
            Err(e) => {
                let again = failed.get_or_insert_with(|| e.code());
                assert_eq!(e.code(), *again, "{e}");
            }
        }
    }
    assert_eq!(failed, Some(ErrorCode::NotFound));
    // A read cancelled while it waits for a chunk ends the reader too: it
    // had taken that chunk, and the next call handed out the one after.
    client.put("default", b"whole", &blob).await.unwrap();
    let mut reader = client
        .open_range("default", b"whole", 0, None)
        .await
        .unwrap();
    let cut = tokio::time::timeout(Duration::from_micros(1), reader.next_piece()).await;
    assert!(cut.is_err(), "the read did not wait for its chunk");
    match reader.next_piece().await {
        Err(after) => assert_eq!(after.code(), ErrorCode::Internal, "{after}"),
        Ok(piece) => panic!(
            "{:?} bytes handed out after a cancelled read",
            piece.map(|p| p.len())
        ),
    }
    cluster.stop().await;
}

/// Uploads share their client's memory budget, reserving room for the
/// bytes they buffer as the bytes come and giving it back when a chunk is
/// stored or the upload ends (finished, failed or dropped). With no room
/// left, an upload that buffers at least 256 KiB stores it at once as a
/// chunk of its own instead of waiting; one that buffers less waits, then
/// fails `OVERLOADED` at the call timeout, and is over. Before, nothing
/// bounded what concurrent uploads buffered (a gateway took up to three
/// chunks per upload from any number of clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_wait_for_their_clients_upload_memory() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let chunk = client.chunk_size();
    assert_eq!(chunk, 1 << 20, "the test cluster's chunk");
    // 512 KiB, shared by the clones made from it; `impatient` waits 2 s.
    let client = client
        .with_upload_memory(512 << 10)
        .with_timeout(Duration::from_secs(30));
    let impatient = client.with_timeout(Duration::from_secs(2));
    let kib = |n: usize| vec![(n % 251) as u8; n << 10];

    // 200 KiB held; 400 KiB more do not fit until the first upload ends.
    let mut first = client.upload("default", b"first").await.unwrap();
    first.write(&kib(200)).await.unwrap();
    let second = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut upload = client.upload("default", b"second").await?;
            upload.write(&kib(400)).await?;
            upload.finish().await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!second.is_finished(), "the second upload did not wait");
    first.finish().await.unwrap();
    second.await.unwrap().unwrap();
    assert_eq!(client.get("default", b"second").await.unwrap(), kib(400));

    // 300 KiB held by one upload, 150 KiB by another: 100 KiB more for the
    // first do not fit, and it stores its 300 KiB at once as a chunk
    // instead of waiting. The blob (400 KiB, under a chunk) is still
    // stored whole at the end, and that chunk deleted.
    let mut early = client.upload("default", b"early").await.unwrap();
    early.write(&kib(300)).await.unwrap();
    let mut small = client.upload("default", b"small").await.unwrap();
    small.write(&kib(150)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), early.write(&kib(100)))
        .await
        .expect("the write waited instead of storing what it buffered")
        .unwrap();
    let stored_early = early.started_chunk_keys();
    assert_eq!(stored_early.len(), 1);
    assert!(client.exists("default", &stored_early[0]).await.unwrap());
    // Joined whole, the blob takes room under the budget: it waits while
    // the other upload holds what it needs.
    let finishing = tokio::spawn(async move { early.finish().await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!finishing.is_finished(), "the join took no room");
    drop(small);
    finishing.await.unwrap().unwrap();
    let mut small = client.upload("default", b"small").await.unwrap();
    small.write(&kib(150)).await.unwrap();
    let mut whole = kib(300);
    whole.extend_from_slice(&kib(100));
    assert!(client.get("default", b"early").await.unwrap() == whole);
    assert!(!client.head("default", b"early").await.unwrap().chunked);
    assert!(!client.exists("default", &stored_early[0]).await.unwrap());

    // Buffering under 256 KiB, an upload waits for room; at the timeout
    // it is refused, for good.
    let mut holding = client.upload("default", b"holding").await.unwrap();
    holding.write(&kib(300)).await.unwrap();
    let mut refused = impatient.upload("default", b"refused").await.unwrap();
    let started = std::time::Instant::now();
    let error = refused.write(&kib(100)).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::Overloaded, "{error}");
    assert!(started.elapsed() >= Duration::from_secs(2), "{error}");
    let after = refused.write(b"x").await.unwrap_err();
    assert_eq!(after.code(), ErrorCode::InvalidArgument, "{after}");
    // Clones share the budget (a gateway acts as each caller).
    let clone = impatient.acting_as("some-token").unwrap();
    let mut blocked = clone.upload("default", b"blocked").await.unwrap();
    let error = blocked.write(&kib(100)).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::Overloaded, "{error}");
    // Dropped uploads give their room back.
    drop((holding, small));
    let mut next = impatient.upload("default", b"next").await.unwrap();
    next.write(&kib(500)).await.unwrap();
    drop(next);

    // A blob of several chunks goes through a budget of half a chunk:
    // its chunks fit the budget, each one's room given back once stored.
    let content: Vec<u8> = (0..2 * chunk + 77).map(|i| (i % 251) as u8).collect();
    let mut large = client.upload("default", b"large").await.unwrap();
    for part in content.chunks(chunk / 10) {
        large.write(part).await.unwrap();
    }
    large.finish().await.unwrap();
    assert!(client.get("default", b"large").await.unwrap() == content);
    cluster.stop().await;
}

/// Readers share their client's read memory: a reader takes room before
/// it asks for bytes — the size it was opened with, else a whole chunk —
/// cut to what it read; a chunk fetched takes room for its size; a piece's
/// room comes back at the reader's next call or when it is dropped. Past
/// the budget a read waits, then fails `OVERLOADED` at the call timeout.
/// Before, nothing bounded what readers held (a gateway held every blob it
/// streamed, up to two chunks per read, for as long as its client took to
/// read it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_wait_for_their_clients_read_memory() {
    let cluster = LocalCluster::start(3, 1, 3).await;
    let writer = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let chunk = writer.chunk_size();
    assert_eq!(chunk, 1 << 20, "the test cluster's chunk");
    let kib = |n: usize| vec![(n % 251) as u8; n << 10];
    writer.put("default", b"900", &kib(900)).await.unwrap();
    writer.put("default", b"300", &kib(300)).await.unwrap();
    let large: Vec<u8> = (0..2 * chunk + 77).map(|i| (i % 249) as u8).collect();
    writer.put("default", b"large", &large).await.unwrap();
    // 1.5 MiB, shared by the clones made from it; `impatient` waits 2 s.
    let client = writer
        .with_read_memory(1536 << 10)
        .with_timeout(Duration::from_secs(30));
    let impatient = client.with_timeout(Duration::from_secs(2));

    // Opened: 900 KiB held (a chunk taken, cut to the blob).
    let mut first = client.open_range("default", b"900", 0, None).await.unwrap();
    // A read of unknown size takes a chunk first: 600 KiB are left.
    let started = std::time::Instant::now();
    let error = impatient
        .open_range("default", b"300", 0, None)
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::Overloaded, "{error}");
    assert!(started.elapsed() >= Duration::from_secs(2), "{error}");
    // One of a known size takes that size.
    let sized = impatient
        .open_sized("default", b"300", 300 << 10, 0, None)
        .await
        .unwrap();
    drop(sized);
    // Another waits until the first reader's piece is taken and the
    // reader called again.
    let waiting = {
        let clone = client.acting_as("some-token").unwrap();
        tokio::spawn(async move {
            clone
                .open_range("default", b"300", 0, None)
                .await
                .map(|_| ())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the read did not wait");
    assert_eq!(first.next_piece().await.unwrap(), Some(kib(900)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the piece handed out was not counted"
    );
    assert_eq!(first.next_piece().await.unwrap(), None);
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the read still waits")
        .unwrap()
        .unwrap();
    drop(first);
    // A blob of chunks goes through a budget of one and a half chunks,
    // each chunk fetched once the one before was handed on (the room went
    // to the chunk fetched ahead while the one needed first waited for it,
    // for ever, when fetch tasks took it themselves).
    assert!(client.get("default", b"large").await.unwrap() == large);
    // All of it came back: two readers of 700 KiB fit.
    writer.put("default", b"700", &kib(700)).await.unwrap();
    let both = (
        impatient
            .open_sized("default", b"700", 700 << 10, 0, None)
            .await
            .unwrap(),
        impatient
            .open_sized("default", b"700", 700 << 10, 0, None)
            .await
            .unwrap(),
    );
    drop(both);
    // A caller that keeps the room of the last piece past the reader's end
    // holds it until it lets it go.
    let mut kept = client.open_range("default", b"900", 0, None).await.unwrap();
    assert_eq!(kept.next_piece().await.unwrap(), Some(kib(900)));
    let room = kept.take_room();
    assert!(room.is_some());
    assert_eq!(kept.next_piece().await.unwrap(), None);
    drop(kept);
    let error = impatient
        .open_sized("default", b"700", 700 << 10, 0, None)
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::Overloaded, "{error}");
    drop(room);
    impatient
        .open_sized("default", b"700", 700 << 10, 0, None)
        .await
        .unwrap();
    cluster.stop().await;
}
