//! Retention through the gateway: a build cache's blobs expire by epochs,
//! and every hit — `FindMissingBlobs`, `GetActionResult`, a ByteStream
//! `Read`, an HTTP `GET` — keeps what it touched alive for another epoch,
//! while what nobody asked for is dropped.

use std::time::{Duration, Instant};

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use tidepool_client::{Client, ClientConfig};

mod support;
use support::*;

/// Waits until every replica has applied cluster epoch `epoch`.
async fn wait_applied(client: &Client, epoch: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = client.cluster_status().await.expect("status");
        let replicas: Vec<u64> = status
            .nodes
            .iter()
            .flat_map(|n| n.replicas.iter().map(|r| r.epoch))
            .collect();
        if !replicas.is_empty() && replicas.iter().all(|e| *e >= epoch) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "epoch {epoch} not applied everywhere: {replicas:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Advances the cluster epoch and waits until every replica is in it.
async fn advance(client: &Client) -> u64 {
    let epoch = client.advance_epoch(None).await.expect("advance");
    wait_applied(client, epoch).await;
    epoch
}

/// An instance kept two epochs: blobs written in epoch `e` are dropped at
/// the advance to `e + 2` unless a hit in `e + 1` touched them. One blob
/// per kind of hit (a chunked one among them, whose chunks must be touched
/// too), one that nobody asks for, and a cached action whose output only
/// `GetActionResult` reaches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_hit_keeps_what_it_touched_alive_for_another_epoch() {
    let s = setup(true).await;
    let instance = s
        .gateway
        .create_instance("keep", 2)
        .await
        .expect("instance");
    let found = blob(1, 1_000);
    let output = blob(2, 2_000);
    let fetched = blob(3, 3_000);
    let read = blob(4, 4_000);
    let chunked = blob(5, 2 * CHUNK + 100);
    let idle = blob(6, 1_500);
    for bytes in [&found, &output, &fetched, &read, &idle] {
        upload(&s, "keep", bytes).await;
    }
    let name = format!("keep/uploads/one/{}", blob_name(&chunked));
    bytestream_write(&s, &name, &chunked).await.expect("write");
    let action = digest(b"an action kept two epochs");
    s.ac()
        .update_action_result(re::UpdateActionResultRequest {
            instance_name: "keep".into(),
            action_digest: Some(action.clone()),
            action_result: Some(re::ActionResult {
                output_files: vec![re::OutputFile {
                    path: "out".into(),
                    digest: Some(digest(&output)),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("update action result");

    advance(&s.client).await;
    // The hits, one epoch later.
    let missing = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: "keep".into(),
            blob_digests: vec![digest(&found)],
            digest_function: 0,
        })
        .await
        .expect("find missing")
        .into_inner();
    assert!(missing.missing_blob_digests.is_empty(), "{missing:?}");
    s.ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: "keep".into(),
            action_digest: Some(action.clone()),
            ..Default::default()
        })
        .await
        .expect("the cached action is a hit");
    let path = format!("/keep/cas/{}", hex(&tidepool_client::sha256(&fetched)));
    let (status, body) = http(s.gateway.http_address, "GET", &path, None, Vec::new()).await;
    assert_eq!((status, body.len()), (200, fetched.len()));
    for bytes in [&read, &chunked] {
        let got = bytestream_read(&s, &format!("keep/{}", blob_name(bytes)), 0, 0)
            .await
            .expect("read");
        assert!(got == *bytes, "read back whole");
    }

    advance(&s.client).await;
    // The drop below the first epoch reaches every shard: the blob nobody
    // asked for goes.
    let idle_key = tidepool_client::sha256(&idle);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s
        .client
        .exists(&instance.cas, &idle_key)
        .await
        .expect("exists")
    {
        assert!(Instant::now() < deadline, "the idle blob was not dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (what, bytes) in [
        ("found by FindMissingBlobs", &found),
        ("output of a GetActionResult hit", &output),
        ("fetched by HTTP GET", &fetched),
        ("read by ByteStream", &read),
        ("chunked, read by ByteStream", &chunked),
    ] {
        let key = tidepool_client::sha256(bytes);
        assert!(
            s.client.exists(&instance.cas, &key).await.expect("exists"),
            "the blob {what} was dropped"
        );
    }
    let got = s
        .client
        .get(&instance.cas, &tidepool_client::sha256(&chunked))
        .await
        .expect("every chunk of the chunked blob is still there");
    assert!(got == chunked);
    s.ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: "keep".into(),
            action_digest: Some(action),
            ..Default::default()
        })
        .await
        .expect("the touched action result and its output are still served");
    s.stop().await;
}

/// A read says which epoch the replica that answered is in, so a reader
/// keeping blobs alive touches one read right after an advance even while
/// its map still names the epoch before (here: a client without the
/// map's watch, which has not looked since). Before, the gateway compared
/// the blob's epoch with its map's only, and such a hit was not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_after_an_advance_is_due_a_touch_while_the_map_lags() {
    let s = setup(true).await;
    let instance = s.gateway.create_instance("lag", 2).await.expect("instance");
    let bytes = blob(7, 5_000);
    let key = tidepool_client::sha256(&bytes);
    let mut config = ClientConfig::new(std::slice::from_ref(&s.cluster.url));
    config.watch = false;
    let reader_client = Client::with_config(config).await.expect("client");
    reader_client
        .put(&instance.cas, &key, &bytes)
        .await
        .expect("put");
    let written = reader_client.map().epoch;
    let epoch = advance(&s.client).await;
    let reader = reader_client
        .open_range(&instance.cas, &key, 0, None)
        .await
        .expect("read");
    assert_eq!(reader_client.map().epoch, written, "the map has not looked");
    assert_eq!(reader.epoch(), written);
    assert_eq!(reader.current_epoch(), epoch);
    assert!(
        reader.touch_due(),
        "a blob of the epoch before is due a touch"
    );
    s.stop().await;
}

/// A cached action whose output is gone is a miss, and the miss does not
/// keep the entry alive: touched at every lookup before its outputs were
/// checked, it never expired, and a caller who may not overwrite
/// (`append-only`) could never replace it — the action missed at every
/// build for good. Both lookups: `GetActionResult` and HTTP `GET /ac/…`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_miss_does_not_keep_its_action_entry_alive() {
    let s = setup(true).await;
    let instance = s
        .gateway
        .create_instance("stale", 2)
        .await
        .expect("instance");
    let output = blob(7, 1_200);
    upload(&s, "stale", &output).await;
    let written = s.client.map().epoch;
    let mut actions = Vec::new();
    for name in [&b"looked up over gRPC"[..], b"looked up over HTTP"] {
        let action = digest(name);
        s.ac()
            .update_action_result(re::UpdateActionResultRequest {
                instance_name: "stale".into(),
                action_digest: Some(action.clone()),
                action_result: Some(re::ActionResult {
                    output_files: vec![re::OutputFile {
                        path: "out".into(),
                        digest: Some(digest(&output)),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect("update action result");
        actions.push(action);
    }
    // The output goes (as if it expired before its entry).
    assert!(
        s.client
            .delete(&instance.cas, &tidepool_client::sha256(&output))
            .await
            .unwrap()
    );
    advance(&s.client).await;
    let status = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: "stale".into(),
            action_digest: Some(actions[0].clone()),
            ..Default::default()
        })
        .await
        .expect_err("a miss: its output is gone");
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let path = format!("/stale/ac/{}", actions[1].hash);
    let (status, _) = http(s.gateway.http_address, "GET", &path, None, Vec::new()).await;
    assert_eq!(status, 404);
    for name in [&b"looked up over gRPC"[..], b"looked up over HTTP"] {
        let key = tidepool_client::sha256(name);
        let meta = s.client.head(&instance.ac, &key).await.expect("stored");
        assert_eq!(
            meta.epoch, written,
            "a miss moved the entry to epoch {}",
            meta.epoch
        );
    }
    s.stop().await;
}

/// A blob of at most one chunk is stored whole however its upload went:
/// here a ByteStream write paused after 300 KiB (the gateway stores what
/// it buffered as a chunk) and resumed. Stored as a manifest, a hit
/// touched only that (`FindMissingBlobs` checks chunks of larger blobs
/// only), its chunk expired under it — found present, read `NOT_FOUND` —
/// and a re-upload changed nothing (the node answers a present key
/// "already present").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_blob_whose_upload_paused_is_stored_whole_and_kept_alive_by_hits() {
    let s = setup(true).await;
    let instance = s
        .gateway
        .create_instance("small", 2)
        .await
        .expect("instance");
    let content = blob(9, 600 << 10);
    assert!(content.len() <= CHUNK);
    let name = format!("small/uploads/p1/{}", blob_name(&content));
    let paused = 300 << 10;
    let first = write_requests(&name, &content[..paused], 0, 64 << 10, false);
    s.bytestream()
        .write(tokio_stream::iter(first))
        .await
        .expect_err("a write that ends without finish_write is paused");
    let rest = write_requests(&name, &content, paused, 64 << 10, true);
    s.bytestream()
        .write(tokio_stream::iter(rest))
        .await
        .expect("the resumed write");
    let key = tidepool_client::sha256(&content);
    let meta = s.client.head(&instance.cas, &key).await.expect("head");
    assert!(!meta.chunked, "{meta:?}");

    // A hit in the next epoch keeps it (and all it needs) past the drop.
    advance(&s.client).await;
    let missing = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: "small".into(),
            blob_digests: vec![digest(&content)],
            digest_function: 0,
        })
        .await
        .expect("find missing")
        .into_inner();
    assert!(missing.missing_blob_digests.is_empty(), "{missing:?}");
    advance(&s.client).await;
    // The drop reaches every shard: the chunk the pause stored (in the
    // first epoch, touched by nothing) goes.
    let early = tidepool_client::sha256(&content[..paused]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s
        .client
        .exists(&instance.cas, &early)
        .await
        .expect("exists")
    {
        assert!(Instant::now() < deadline, "the early chunk was not dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = bytestream_read(&s, &format!("small/{}", blob_name(&content)), 0, 0).await;
    assert!(
        got.as_ref().is_ok_and(|got| *got == content),
        "found present a drop ago, then read: {:?}",
        got.map(|g| g.len())
    );
    s.stop().await;
}
