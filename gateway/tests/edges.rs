//! What the main protocol tests leave out: the HTTP cache's DELETE of CAS
//! and action cache entries, HEAD of an action cache entry, the empty blob
//! over HTTP, a body above the size limit, a body shorter than its
//! Content-Length; an unknown instance in every REAPI call that names
//! one; slow, idle and too many HTTP clients; ccache `subdirs` paths under
//! `/ac/` and `/cas/`; unknown names while the coordinators hang.

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use sha2::{Digest as _, Sha256};
use tonic::Code;

mod support;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_deletes_heads_the_empty_blob_and_sizes() {
    let s = setup(true).await;
    let at = s.gateway.http_address;
    let content = blob(60, 5_000);
    let h = hex(&Sha256::digest(&content));
    let cas = format!("/cas/{h}");
    assert_eq!(http(at, "PUT", &cas, None, content.clone()).await.0, 200);
    let (status, headers, _) = http_with(at, "HEAD", &cas, &[], vec![]).await;
    assert_eq!(
        (status, headers["content-length"].to_str().unwrap()),
        (200, "5000")
    );
    // DELETE of a CAS entry: gone, and a second DELETE finds nothing.
    assert_eq!(http(at, "DELETE", &cas, None, vec![]).await.0, 200);
    assert_eq!(http(at, "GET", &cas, None, vec![]).await.0, 404);
    assert_eq!(http(at, "HEAD", &cas, None, vec![]).await.0, 404);
    assert_eq!(http(at, "DELETE", &cas, None, vec![]).await.0, 404);
    assert!(
        !s.client
            .exists("cache", &Sha256::digest(&content))
            .await
            .unwrap()
    );

    // The action cache: HEAD gives the entry's size; DELETE removes it.
    let action = hex(&Sha256::digest(b"an entry to delete"));
    let ac = format!("/ac/{action}");
    assert_eq!(http(at, "HEAD", &ac, None, vec![]).await.0, 404);
    assert_eq!(http(at, "PUT", &ac, None, b"opaque".to_vec()).await.0, 200);
    let (status, headers, _) = http_with(at, "HEAD", &ac, &[], vec![]).await;
    assert_eq!(
        (status, headers["content-length"].to_str().unwrap()),
        (200, "6")
    );
    assert_eq!(http(at, "DELETE", &ac, None, vec![]).await.0, 200);
    assert_eq!(http(at, "GET", &ac, None, vec![]).await.0, 404);
    assert_eq!(http(at, "DELETE", &ac, None, vec![]).await.0, 404);

    // The empty blob is always there, and storing it is a no-op.
    let empty = format!("/cas/{}", hex(&Sha256::digest(b"")));
    assert_eq!(http(at, "GET", &empty, None, vec![]).await, (200, vec![]));
    let (status, headers, _) = http_with(at, "HEAD", &empty, &[], vec![]).await;
    assert_eq!(
        (status, headers["content-length"].to_str().unwrap()),
        (200, "0")
    );
    assert_eq!(http(at, "PUT", &empty, None, vec![]).await.0, 200);

    // Above the gateway's 8 MiB limit: 413 (the gateway answers from the
    // Content-Length, without reading the body), and nothing stored.
    let big = vec![7u8; (8 << 20) + 1];
    let big_path = format!("/cas/{}", hex(&Sha256::digest(&big)));
    let answer = raw_put(at, &big_path, &big, big.len()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert_eq!(http(at, "HEAD", &big_path, None, vec![]).await.0, 404);
    // A body shorter than its Content-Length (the connection ends
    // mid-body) is not stored.
    let short = blob(61, 1_000);
    let short_path = format!("/cas/{}", hex(&Sha256::digest(&short)));
    let answer = raw_put(at, &short_path, &short[..500], short.len()).await;
    assert!(
        !answer.starts_with("HTTP/1.1 200"),
        "a short body was accepted: {answer}"
    );
    assert_eq!(http(at, "HEAD", &short_path, None, vec![]).await.0, 404);
    s.stop().await;
}

/// Sends a PUT whose Content-Length says `declared` and whose body is
/// `body` (possibly shorter: then the connection's sending side ends),
/// asking the gateway to close after its answer, and returns what it
/// answered (empty if it only closed). The gateway may answer and close
/// before the body is all sent: write errors are the gateway's refusal,
/// not the test's failure. A whole body is not followed by a half-close:
/// hyper takes the end of a client's sending side for the client leaving
/// and drops a request still waiting (one waiting for upload room was
/// then answered nothing, a flaky test), and the clients the gateway
/// serves do not half-close.
async fn raw_put(at: std::net::SocketAddr, path: &str, body: &[u8], declared: usize) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let stream = tokio::net::TcpStream::connect(at).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let head = format!(
        "PUT {path} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\ncontent-length: {declared}\r\n\r\n"
    );
    let body = body.to_vec();
    let sending = tokio::spawn(async move {
        let short = body.len() < declared;
        if writer.write_all(head.as_bytes()).await.is_ok() && writer.write_all(&body).await.is_ok()
        {
            if short {
                let _ = writer.shutdown().await;
            } else {
                // Open until the answer is read (the task is aborted).
                std::future::pending::<()>().await;
            }
        }
    });
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        reader.read_to_end(&mut answer),
    )
    .await;
    sending.abort();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_reapi_call_refuses_an_unknown_instance() {
    let s = setup(true).await;
    let instance = "nosuch";
    let bytes = blob(62, 100);
    let find = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: instance.into(),
            blob_digests: vec![digest(&bytes)],
            digest_function: 0,
        })
        .await;
    let update = s
        .cas()
        .batch_update_blobs(re::BatchUpdateBlobsRequest {
            instance_name: instance.into(),
            requests: vec![re::batch_update_blobs_request::Request {
                digest: Some(digest(&bytes)),
                data: bytes.clone(),
                compressor: 0,
            }],
            digest_function: 0,
        })
        .await
        .map(|_| ());
    let read = s
        .cas()
        .batch_read_blobs(re::BatchReadBlobsRequest {
            instance_name: instance.into(),
            digests: vec![digest(&bytes)],
            ..Default::default()
        })
        .await
        .map(|_| ());
    let get_result = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: instance.into(),
            action_digest: Some(digest(b"action")),
            ..Default::default()
        })
        .await
        .map(|_| ());
    let update_result = s
        .ac()
        .update_action_result(re::UpdateActionResultRequest {
            instance_name: instance.into(),
            action_digest: Some(digest(b"action")),
            action_result: Some(re::ActionResult::default()),
            ..Default::default()
        })
        .await
        .map(|_| ());
    let read_stream = bytestream_read(&s, &format!("{instance}/{}", blob_name(&bytes)), 0, 0)
        .await
        .map(|_| ());
    for (call, result) in [
        ("FindMissingBlobs", find.map(|_| ())),
        ("BatchUpdateBlobs", update),
        ("BatchReadBlobs", read),
        ("GetActionResult", get_result),
        ("UpdateActionResult", update_result),
        ("ByteStream.Read", read_stream),
    ] {
        let e = result.expect_err(call);
        assert_eq!(e.code(), Code::InvalidArgument, "{call}: {e:?}");
        assert!(e.message().contains("unknown instance"), "{call}: {e:?}");
    }
    assert!(
        !s.client
            .exists("cache", &Sha256::digest(&bytes))
            .await
            .unwrap(),
        "nothing was stored anywhere else"
    );
    s.stop().await;
}

/// Reads from `reader` until the server closes the connection (or
/// `patience` passes): what it sent, and how long after `since` it closed
/// (`None`: still open).
async fn until_closed_within(
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    since: std::time::Instant,
    patience: std::time::Duration,
) -> (String, Option<std::time::Duration>) {
    use tokio::io::AsyncReadExt as _;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(patience, reader.read_to_end(&mut answer)).await;
    let closed = read.is_ok().then(|| since.elapsed());
    (String::from_utf8_lossy(&answer).into_owned(), closed)
}

/// [`until_closed_within`] 10 s.
async fn until_closed(
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    since: std::time::Instant,
) -> (String, Option<std::time::Duration>) {
    until_closed_within(reader, since, std::time::Duration::from_secs(10)).await
}

/// What `HttpLimits` bound: a client trickling its headers in and an idle
/// keep-alive connection are closed after the header timeout; a body that
/// stalls fails the request with nothing stored; past the connection bound
/// a new connection is served only once another closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_idle_and_surplus_http_clients_are_bounded() {
    use std::time::{Duration, Instant};
    use tokio::io::AsyncWriteExt as _;
    let s = setup_with(true, |config| {
        config.http_limits = tidepool_gateway::HttpLimits {
            header_timeout: Duration::from_secs(1),
            body_idle: Duration::from_secs(1),
            max_connections: 4,
        };
    })
    .await;
    let at = s.gateway.http_address;
    let connect = || async move {
        tokio::net::TcpStream::connect(at)
            .await
            .unwrap()
            .into_split()
    };

    // Headers trickled in a byte every 100 ms, never finished: closed after
    // the timeout (the bytes do not restart it), with no answer.
    let (mut reader, mut writer) = connect().await;
    let start = Instant::now();
    let trickle = tokio::spawn(async move {
        for byte in b"GET /cas/0 HTTP/1.1\r\nhost: gateway\r\nx-slow: "
            .iter()
            .cycle()
        {
            if writer.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let (answer, closed) = until_closed(&mut reader, start).await;
    trickle.abort();
    let closed = closed.expect("a connection trickling its headers is closed");
    assert!(
        closed >= Duration::from_millis(900) && answer.is_empty(),
        "closed after {closed:?}, answering {answer:?}"
    );

    // HTTP/2 is not served here: its preface, whole or only begun, closes
    // the connection at once. (Served, an HTTP/2 connection stayed open
    // for as long as its client answered pings, whatever it asked; with
    // HTTP/2 served, the start of the preface and then nothing waited for
    // the header timeout.)
    for preface in [
        &b"PRI * HTTP/2.0"[..],
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    ] {
        let (mut reader, mut writer) = connect().await;
        let start = Instant::now();
        writer.write_all(preface).await.unwrap();
        let (_, closed) = until_closed(&mut reader, start).await;
        let closed = closed.expect("an HTTP/2 client is refused");
        assert!(
            closed < Duration::from_millis(900),
            "closed after {closed:?}: served until the header timeout"
        );
        drop(writer);
    }

    // An idle keep-alive connection: one request answered, then closed.
    let (mut reader, mut writer) = connect().await;
    let key = format!("/cas/{}", hex(&Sha256::digest(b"not stored")));
    let head = format!("GET {key} HTTP/1.1\r\nhost: gateway\r\n\r\n");
    writer.write_all(head.as_bytes()).await.unwrap();
    let (answer, closed) = until_closed(&mut reader, Instant::now()).await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert!(closed.is_some(), "an idle keep-alive connection is closed");

    // A body that stops halfway: the request fails, nothing is stored.
    let content = blob(62, 1_000);
    let path = format!("/cas/{}", hex(&Sha256::digest(&content)));
    let (mut reader, mut writer) = connect().await;
    let head = format!("PUT {path} HTTP/1.1\r\nhost: gateway\r\ncontent-length: 1000\r\n\r\n");
    writer.write_all(head.as_bytes()).await.unwrap();
    writer.write_all(&content[..500]).await.unwrap();
    let (answer, _) = until_closed(&mut reader, Instant::now()).await;
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "a stalled body: {answer:?}"
    );
    drop(writer);
    assert_eq!(http(at, "HEAD", &path, None, vec![]).await.0, 404);

    // Four connections held open with nothing sent fill the bound: a fifth
    // is answered only once the header timeout has closed them.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(connect().await);
    }
    let start = Instant::now();
    let (mut reader, mut writer) = connect().await;
    let head = format!("GET {key} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n");
    writer.write_all(head.as_bytes()).await.unwrap();
    let (answer, closed) = until_closed(&mut reader, start).await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer:?}");
    let waited = closed.expect("answered and closed");
    assert!(
        waited >= Duration::from_millis(700),
        "the fifth connection was served after {waited:?}, before a slot freed"
    );
    drop(held);
    s.stop().await;
}

/// gRPC servers (the gateway's REAPI and ByteStream, the coordinator's,
/// like every node's) disconnect a client that connects and sends nothing:
/// HTTP/2 waits for a client's preface with no timeout of its own
/// (`tidepool_security::first_byte`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_servers_disconnect_clients_that_send_nothing() {
    use std::time::{Duration, Instant};
    use tidepool_security::first_byte::FIRST_BYTE_TIMEOUT;
    let s = setup(true).await;
    let coordinator: std::net::SocketAddr =
        s.cluster.url.trim_start_matches("http://").parse().unwrap();
    let mut silent = Vec::new();
    for at in [s.gateway.grpc_address, coordinator] {
        // Nothing, or the start of the preface and then nothing (the
        // deadline ended at the first byte: held for ever).
        for opening in [&b""[..], b"PRI * HTTP/2.0\r\n"] {
            let (reader, mut writer) = tokio::net::TcpStream::connect(at)
                .await
                .unwrap()
                .into_split();
            tokio::io::AsyncWriteExt::write_all(&mut writer, opening)
                .await
                .unwrap();
            silent.push((at, reader, writer));
        }
    }
    let start = Instant::now();
    for (at, reader, _writer) in &mut silent {
        // The server's SETTINGS come at once; then it waits for ours.
        let patience = FIRST_BYTE_TIMEOUT + Duration::from_secs(10);
        let (_, closed) = until_closed_within(reader, start, patience).await;
        let closed = closed.unwrap_or_else(|| panic!("{at}: a silent client kept its connection"));
        assert!(
            closed >= FIRST_BYTE_TIMEOUT - Duration::from_millis(200),
            "{at}: closed after {closed:?}"
        );
    }
    // A client that speaks is served as before.
    let mut cas = s.cas();
    let found = cas
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: "cache".into(),
            blob_digests: vec![digest(b"absent")],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(found.into_inner().missing_blob_digests.len(), 1);
    s.stop().await;
}

/// ccache's `subdirs` layout stores a key at `/<first 2 digits>/<other
/// 31>`: the keys that start with `ac` (or a path `/cas/<not a hash>`)
/// are path keys like every other, not malformed action cache names.
/// Before, they were refused with 400: about one key in 256 never cached.
/// An append-only token's overwrite of a path key is a conflict (409),
/// not a server error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ccache_paths_under_ac_and_cas_are_path_keys() {
    let s = setup(true).await;
    let at = s.gateway.http_address;
    let key = "0123456789abcdef0123456789abcde";
    for path in [
        format!("/ac/{key}"),
        format!("/cas/{key}"),
        format!("/ci/ac/{key}"),
    ] {
        let content = path.as_bytes().repeat(100);
        assert_eq!(http(at, "HEAD", &path, None, vec![]).await.0, 404, "{path}");
        assert_eq!(
            http(at, "PUT", &path, None, content.clone()).await.0,
            200,
            "{path}"
        );
        assert_eq!(
            http(at, "GET", &path, None, vec![]).await,
            (200, content),
            "{path}"
        );
    }
    // A real action cache name is still one: a CAS name must hash.
    let h = hex(&Sha256::digest(b"not this"));
    assert_eq!(
        http(at, "PUT", &format!("/cas/{h}"), None, b"other".to_vec())
            .await
            .0,
        400
    );
    s.stop().await;
}

/// While the coordinators hang (a host that accepts connections and never
/// answers), requests whose path starts with a name that is no instance
/// (every ccache `subdirs` path) are served from the map the gateway has:
/// at most one of them a second waits, at most a second, for a newer map.
/// Before, each waited its turn for the one before it to give up on the
/// coordinator (3 s per seed), so the eighth took over 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_names_do_not_queue_behind_a_hung_coordinator() {
    let cluster = tidepool_testkit::cluster::LocalCluster::start(3, 4, 3).await;
    let proxy = tidepool_testkit::proxy::Proxy::start(cluster.coordinator.address).await;
    let seeds = [format!("http://{}", proxy.address)];
    let mut config =
        tidepool_gateway::GatewayConfig::new(tidepool_client::ClientConfig::new(&seeds));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = true;
    let gateway = tidepool_gateway::start(config).await.expect("starts");
    gateway.create_instance("cache", 3).await.expect("instance");
    let at = gateway.http_address;
    // First segments that could be instance names (a letter first).
    let paths: Vec<String> = ["a0", "b1", "c2", "d3", "e4", "f5", "fa", "fb"]
        .iter()
        .map(|prefix| format!("/{prefix}/{}", "5".repeat(31)))
        .collect();
    for path in &paths {
        assert_eq!(
            http(at, "PUT", path, None, path.as_bytes().to_vec())
                .await
                .0,
            200
        );
    }
    proxy.freeze();
    // Past the once-a-second limit of the fetches the puts made.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let began = std::time::Instant::now();
    let asked: Vec<_> = paths
        .iter()
        .map(|path| {
            let path = path.clone();
            tokio::spawn(async move {
                let answer = http(at, "GET", &path, None, vec![]).await;
                (answer, began.elapsed())
            })
        })
        .collect();
    for (asked, path) in asked.into_iter().zip(&paths) {
        let (answer, took) = asked.await.unwrap();
        assert_eq!(answer, (200, path.as_bytes().to_vec()), "{path}");
        assert!(
            took < std::time::Duration::from_secs(3),
            "{path} answered after {took:?}"
        );
    }
    // An instance's CAS entry under a name the gateway cannot resolve now
    // is refused, not stored as a path key of `cache` (unverified, and
    // where the instance's readers never look).
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let body = b"a CAS entry".to_vec();
    let cas_path = format!(
        "/zz/cas/{}",
        tidepool_client::hex(&tidepool_client::sha256(&body))
    );
    let (code, text) = http(at, "PUT", &cas_path, None, body).await;
    assert_eq!(code, 503, "{}", String::from_utf8_lossy(&text));
    proxy.unblock();
    gateway.stop().await;
    cluster.stop().await;
}

/// The REAPI limits and digests a review found wrong:
/// - an output tree larger than a batch (a tree artifact of some 30,000
///   files) is checked, not refused: the action is a cache hit (before:
///   `INVALID_ARGUMENT` on every build, the action never cached);
/// - an action result larger than a batch is refused when stored, so
///   every stored one can be returned;
/// - a digest is (hash, size): a write or status query of a stored hash
///   with another size is not complete;
/// - a spliced blob of at most one chunk is stored whole, so it lives on
///   without the chunks it was spliced from;
/// - a zstd frame whose window is over 8 MiB is refused (each paused
///   upload held the library's default of up to 128 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reapi_limits_and_digests() {
    // Batches of 2 MiB, chunks of 1 MiB.
    let s = setup(true).await;
    let file = blob(70, 1_000);
    upload(&s, "", &file).await;
    let root = re::Directory {
        files: (0..30_000)
            .map(|i| re::FileNode {
                name: format!("generated/file-{i:06}.txt"),
                digest: Some(digest(&file)),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let tree = prost::Message::encode_to_vec(&re::Tree {
        root: Some(root),
        children: vec![],
    });
    assert!(tree.len() > 2 << 20, "{} bytes", tree.len());
    let name = format!("uploads/t-1/{}", blob_name(&tree));
    bytestream_write(&s, &name, &tree)
        .await
        .expect("tree stored");
    let result = re::ActionResult {
        output_directories: vec![re::OutputDirectory {
            path: "generated".into(),
            tree_digest: Some(digest(&tree)),
            ..Default::default()
        }],
        ..Default::default()
    };
    let action = digest(b"an action with a large tree");
    s.ac()
        .update_action_result(re::UpdateActionResultRequest {
            action_digest: Some(action.clone()),
            action_result: Some(result.clone()),
            ..Default::default()
        })
        .await
        .expect("update");
    let got = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            action_digest: Some(action.clone()),
            ..Default::default()
        })
        .await
        .expect("a cache hit")
        .into_inner();
    assert_eq!(got, result);

    // An action result over a batch is refused.
    let huge = re::ActionResult {
        stdout_raw: vec![b'x'; (2 << 20) + 1],
        ..Default::default()
    };
    let answer = s
        .ac()
        .update_action_result(re::UpdateActionResultRequest {
            action_digest: Some(digest(b"a huge result")),
            action_result: Some(huge),
            ..Default::default()
        })
        .await;
    assert_eq!(
        answer.as_ref().map(|_| "stored").map_err(|e| e.code()),
        Err(Code::InvalidArgument)
    );

    // The tree's hash with another size: not stored, so not complete.
    let wrong = format!(
        "uploads/{}/blobs/{}/{}",
        "0d7c2a8c-4a53-4f4c-9a86-7b1f4c2d9e10",
        hex(&Sha256::digest(&tree)),
        tree.len() + 1
    );
    let status = s
        .bytestream()
        .query_write_status(
            bazel_remote_apis::google::bytestream::QueryWriteStatusRequest {
                resource_name: wrong.clone(),
            },
        )
        .await
        .expect("status")
        .into_inner();
    assert!(!status.complete, "{status:?}");
    let first = write_requests(&wrong, &tree[..1000], 0, 1000, false);
    let answer = s.bytestream().write(tokio_stream::iter(first)).await;
    assert!(
        !matches!(&answer, Ok(r) if r.get_ref().committed_size == tree.len() as i64 + 1),
        "a write of the wrong size completed at once: {answer:?}"
    );

    // Two small chunks spliced: the blob stays whole without them.
    let parts = [blob(71, 300), blob(72, 500)];
    for p in &parts {
        upload(&s, "", p).await;
    }
    let whole = parts.concat();
    s.cas()
        .splice_blob(re::SpliceBlobRequest {
            blob_digest: Some(digest(&whole)),
            chunk_digests: parts.iter().map(|p| digest(p)).collect(),
            ..Default::default()
        })
        .await
        .expect("splice");
    for p in &parts {
        assert!(s.client.delete("cache", &Sha256::digest(p)).await.unwrap());
    }
    let missing = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            blob_digests: vec![digest(&whole)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(missing.missing_blob_digests.is_empty(), "{missing:?}");
    assert_eq!(
        bytestream_read(&s, &blob_name(&whole), 0, 0).await.unwrap(),
        whole
    );

    // zstd with a 32 MiB window.
    let content = blob(73, 100_000);
    let mut encoder = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
    encoder
        .set_parameter(zstd::stream::raw::CParameter::WindowLog(25))
        .unwrap();
    std::io::Write::write_all(&mut encoder, &content).unwrap();
    let compressed = encoder.finish().unwrap();
    let name = format!(
        "uploads/{}/compressed-blobs/zstd/{}/{}",
        "5f0b1c7e-2b1d-4c55-8f0e-1e2d3c4b5a69",
        hex(&Sha256::digest(&content)),
        content.len()
    );
    let e = bytestream_write(&s, &name, &compressed).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    s.stop().await;
}

/// A ByteStream write is refused for a caller the cluster does not admit
/// before any of its messages is read: a client that opens the stream and
/// sends nothing (or a first message of a batch and a chunk) holds no
/// buffer, and hears UNAUTHENTICATED at once, not after the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bytestream_writes_check_the_caller_before_reading() {
    use bazel_remote_apis::google::bytestream::WriteRequest;
    use std::time::Duration;
    let s = setup(false).await;
    let mut bytestream = s.bytestream();
    let silent = tokio_stream::pending::<WriteRequest>();
    let refused = tokio::time::timeout(Duration::from_secs(10), bytestream.write(silent))
        .await
        .expect("answered before any message was sent")
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    s.stop().await;
}

/// The gRPC listener holds at most `max_connections` connections, like
/// the HTTP one: with four held, a fifth client's call is answered only
/// once one of them closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn surplus_grpc_connections_wait_for_a_slot() {
    use std::time::Duration;
    use tonic::transport::Channel;
    let s = setup_with(true, |config| {
        config.http_limits.max_connections = 4;
    })
    .await;
    let url = format!("http://{}", s.gateway.grpc_address);
    let ask = |channel: Channel| async move {
        re::content_addressable_storage_client::ContentAddressableStorageClient::new(channel)
            .find_missing_blobs(re::FindMissingBlobsRequest {
                instance_name: "cache".into(),
                blob_digests: vec![digest(b"absent")],
                ..Default::default()
            })
            .await
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        // With the setup's own channel: four connections.
        let channel = Channel::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        ask(channel.clone()).await.unwrap();
        held.push(channel);
    }
    ask(s.channel.clone()).await.unwrap();
    let fifth = Channel::from_shared(url.clone()).unwrap().connect_lazy();
    let waiting = tokio::spawn(ask(fifth));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiting.is_finished(), "a fifth connection was served");
    drop(held.pop());
    let answered = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("served once a slot freed")
        .unwrap();
    assert_eq!(answered.unwrap().into_inner().missing_blob_digests.len(), 1);
    s.stop().await;
}

/// A `BatchReadBlobs` within the batch limit is answered, however many
/// small blobs it names: the answer frames each (digest, status) on top of
/// the data the limit counts. Before, 15,000 four-byte blobs under a 64 KiB
/// limit (a request of about 1 MB) got an answer over the message limit:
/// `OUT_OF_RANGE`, every time. A digest named many times is read once
/// (before, 15,000 times: 60,000 bytes of gets for a 4-byte blob).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_read_of_many_small_blobs_is_answered() {
    let s = setup_with(true, |config| config.max_batch_bytes = 64 << 10).await;
    let bytes = b"four".to_vec();
    upload(&s, "cache", &bytes).await;
    let got = |s: &Setup| -> u64 {
        s.cluster
            .nodes
            .iter()
            .flatten()
            .map(|n| n.node.metrics.get_bytes.get())
            .sum()
    };
    let before = got(&s);
    let read = s
        .cas()
        .batch_read_blobs(re::BatchReadBlobsRequest {
            instance_name: "cache".into(),
            digests: vec![digest(&bytes); 15_000],
            ..Default::default()
        })
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(read.responses.len(), 15_000);
    assert!(
        read.responses
            .iter()
            .all(|r| r.data == bytes && r.status.as_ref().is_none_or(|s| s.code == 0))
    );
    let read_bytes = got(&s) - before;
    assert!(
        (4..=16).contains(&read_bytes),
        "{read_bytes} bytes read from the nodes for one 4-byte blob"
    );
    // Repeats among others: every occurrence answered, in order.
    let other = b"other".to_vec();
    upload(&s, "cache", &other).await;
    let missing = b"never stored".to_vec();
    let asked = [&bytes, &other, &bytes, &missing, &other];
    let read = s
        .cas()
        .batch_read_blobs(re::BatchReadBlobsRequest {
            instance_name: "cache".into(),
            digests: asked.iter().map(|b| digest(b)).collect(),
            ..Default::default()
        })
        .await
        .expect("answered")
        .into_inner();
    let got: Vec<(Option<re::Digest>, Vec<u8>, i32)> = read
        .responses
        .into_iter()
        .map(|r| (r.digest, r.data, r.status.map_or(0, |s| s.code)))
        .collect();
    let want: Vec<(Option<re::Digest>, Vec<u8>, i32)> = asked
        .iter()
        .map(|b| {
            let found = **b != missing;
            (
                Some(digest(b)),
                if found { b.to_vec() } else { Vec::new() },
                if found { 0 } else { Code::NotFound as i32 },
            )
        })
        .collect();
    assert_eq!(got, want);
    s.stop().await;
}

/// Stored messages that would decode huge, and digests of the wrong size:
/// - a chunked blob named with sizes it does not have is missing (reads
///   of those digests say `NOT_FOUND`), named with its own it is present;
/// - an action-cache entry of nearly empty entries (stored over HTTP,
///   unchecked) is a miss, not decoded: 1 MiB of empty output files is
///   half a million structs decoded;
/// - `GetTree` refuses a directory of nearly empty entries;
/// - an output tree is read from its wire form: a result whose tree holds
///   a present file is a hit, one whose tree names a missing file a miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wrong_sizes_and_nearly_empty_messages() {
    use prost::Message as _;
    let s = setup(true).await;
    let large = blob(90, 3 * CHUNK + 17);
    bytestream_write(&s, &format!("uploads/u1/{}", blob_name(&large)), &large)
        .await
        .unwrap();
    let right = digest(&large);
    let wrong = |size: i64| re::Digest {
        hash: right.hash.clone(),
        size_bytes: size,
    };
    let missing = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: String::new(),
            blob_digests: vec![wrong(5), right.clone(), wrong(right.size_bytes + 1)],
            digest_function: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .missing_blob_digests;
    assert_eq!(missing, vec![wrong(5), wrong(right.size_bytes + 1)]);
    let read = bytestream_read(&s, &format!("blobs/{}/5", right.hash), 0, 0).await;
    assert_eq!(read.unwrap_err().code(), Code::NotFound);

    // Half a million empty output files.
    let mut empties = Vec::new();
    while empties.len() < 1 << 20 {
        empties.extend([0x12, 0x00]);
    }
    assert_eq!(
        re::ActionResult::decode(&empties[..])
            .unwrap()
            .output_files
            .len(),
        1 << 19
    );
    let action = hex(&Sha256::digest(b"nearly empty"));
    let (code, _) = http(
        s.gateway.http_address,
        "PUT",
        &format!("/ac/{action}"),
        None,
        empties.clone(),
    )
    .await;
    assert_eq!(code, 200);
    let miss = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            action_digest: Some(re::Digest {
                hash: action.clone(),
                size_bytes: 1,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(miss.code(), Code::NotFound, "{miss:?}");
    // Over HTTP it is another tool's entry: returned as stored.
    let (code, body) = http(
        s.gateway.http_address,
        "GET",
        &format!("/ac/{action}"),
        None,
        vec![],
    )
    .await;
    assert_eq!((code, body.len()), (200, empties.len()));

    // A directory of half a million empty file nodes.
    let mut directory = Vec::new();
    while directory.len() < 1 << 20 {
        directory.extend([0x0a, 0x00]);
    }
    upload(&s, "", &directory).await;
    let refused = async {
        let mut stream = s
            .cas()
            .get_tree(re::GetTreeRequest {
                root_digest: Some(digest(&directory)),
                ..Default::default()
            })
            .await?
            .into_inner();
        while stream.message().await?.is_some() {}
        Ok::<(), tonic::Status>(())
    }
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");

    // Trees read from the wire: a present file, then a missing one.
    let present = blob(91, 500);
    upload(&s, "", &present).await;
    for (name, file, hit) in [
        ("a", digest(&present), true),
        ("b", digest(b"never stored"), false),
    ] {
        let tree = re::Tree {
            root: Some(re::Directory {
                files: vec![re::FileNode {
                    name: name.into(),
                    digest: Some(file),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            children: Vec::new(),
        }
        .encode_to_vec();
        upload(&s, "", &tree).await;
        let action = digest(name.as_bytes());
        s.ac()
            .update_action_result(re::UpdateActionResultRequest {
                action_digest: Some(action.clone()),
                action_result: Some(re::ActionResult {
                    output_directories: vec![re::OutputDirectory {
                        path: "out".into(),
                        tree_digest: Some(digest(&tree)),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap();
        let got = s
            .ac()
            .get_action_result(re::GetActionResultRequest {
                action_digest: Some(action),
                ..Default::default()
            })
            .await;
        assert_eq!(got.is_ok(), hit, "{name}: {got:?}");
    }
    s.stop().await;
}

/// A stop ends within the drain even when a gRPC stream never does: a
/// ByteStream read whose client stopped reading held the gateway's stop
/// (and dev mode's Ctrl-C) for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_does_not_wait_for_a_stalled_grpc_stream() {
    use bazel_remote_apis::google::bytestream::ReadRequest;
    let s = setup(true).await;
    let content = blob(77, 6 << 20);
    bytestream_write(&s, &format!("uploads/u1/{}", blob_name(&content)), &content)
        .await
        .unwrap();
    let mut stream = s
        .bytestream()
        .read(ReadRequest {
            resource_name: blob_name(&content),
            read_offset: 0,
            read_limit: 0,
        })
        .await
        .unwrap()
        .into_inner();
    // One message read, then none: flow control stops the gateway's
    // sending, and the stream never ends.
    assert!(!stream.message().await.unwrap().unwrap().data.is_empty());
    let started = std::time::Instant::now();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(30), s.gateway.stop()).await;
    assert!(
        stopped.is_ok(),
        "the stop waited for the stalled stream for 30 s"
    );
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(9),
        "the stream was given the drain ({:?})",
        started.elapsed()
    );
    drop(stream);
    s.cluster.stop().await;
}

/// A `GetTree` page token names the next directory too: a directory
/// missing when the first page was walked and stored before the next page
/// moves every later position, and the resumed walk repeated one (here:
/// `b` twice) — it now says the tree changed. An unchanged tree pages as
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_get_tree_token_says_when_the_tree_changed_under_it() {
    use prost::Message as _;
    let s = setup(true).await;
    let leaf = |name: &str| re::Directory {
        files: vec![re::FileNode {
            name: name.into(),
            digest: Some(digest(name.as_bytes())),
            ..Default::default()
        }],
        ..Default::default()
    };
    let (a, b, c) = (leaf("a.txt"), leaf("b.txt"), leaf("c.txt"));
    let node = |name: &str, d: &re::Directory| re::DirectoryNode {
        name: name.into(),
        digest: Some(digest(&d.encode_to_vec())),
    };
    let top = re::Directory {
        directories: vec![node("a", &a), node("b", &b), node("c", &c)],
        ..Default::default()
    };
    // `a` not stored yet.
    for d in [&b, &c, &top] {
        upload(&s, "cache", &d.encode_to_vec()).await;
    }
    let page = |token: String| {
        let s = &s;
        let top = &top;
        async move {
            let mut stream = s
                .cas()
                .get_tree(re::GetTreeRequest {
                    instance_name: "cache".into(),
                    root_digest: Some(digest(&top.encode_to_vec())),
                    page_size: 2,
                    page_token: token,
                    ..Default::default()
                })
                .await?
                .into_inner();
            stream.message().await.map(|p| p.expect("a page"))
        }
    };
    let first = page(String::new()).await.unwrap();
    assert_eq!(first.directories, vec![top.clone(), b.clone()]);
    // Unchanged: the next page is `c`.
    let next = page(first.next_page_token.clone()).await.unwrap();
    assert_eq!(next.directories, vec![c.clone()]);
    assert!(next.next_page_token.is_empty());
    // `a` stored since: the token's position now points at `b`.
    upload(&s, "cache", &a.encode_to_vec()).await;
    let changed = page(first.next_page_token.clone()).await.unwrap_err();
    assert_eq!(changed.code(), Code::InvalidArgument, "{changed:?}");
    assert!(changed.message().contains("tree changed"), "{changed:?}");
    // From the start, the whole tree.
    let whole = page(String::new()).await.unwrap();
    assert_eq!(whole.directories, vec![top.clone(), a.clone()]);
    s.stop().await;
}

/// A client that stops reading a response (its receive window full) loses
/// the connection once a write has waited for the body idle bound: hyper
/// has no write timeout, and such connections held their slots (and what
/// their responses had queued) for as long as their clients kept the
/// sockets open — here four of them locked out every other client.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_stops_reading_loses_its_connection() {
    use std::time::{Duration, Instant};
    use tokio::io::AsyncWriteExt as _;
    let s = setup_with(true, |config| {
        config.http_limits = tidepool_gateway::HttpLimits {
            header_timeout: Duration::from_secs(1),
            body_idle: Duration::from_secs(1),
            max_connections: 4,
        };
    })
    .await;
    let at = s.gateway.http_address;
    let content = blob(63, 8 << 20);
    let path = format!("/cas/{}", hex(&Sha256::digest(&content)));
    assert_eq!(http(at, "PUT", &path, None, content.clone()).await.0, 200);
    // Four GETs of 8 MiB whose clients read nothing (small receive
    // buffers: the server's writes wait once its send buffer is full).
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let stream = socket.connect(at).await.unwrap();
        let (reader, mut writer) = stream.into_split();
        let head = format!("GET {path} HTTP/1.1\r\nhost: gateway\r\n\r\n");
        writer.write_all(head.as_bytes()).await.unwrap();
        stalled.push((reader, writer));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    // A fifth client is served: the stalled ones were let go.
    let (mut reader, mut writer) = tokio::net::TcpStream::connect(at)
        .await
        .unwrap()
        .into_split();
    let start = Instant::now();
    let missing = format!("/cas/{}", hex(&Sha256::digest(b"not stored here")));
    let head = format!("GET {missing} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n");
    writer.write_all(head.as_bytes()).await.unwrap();
    let (answer, closed) = until_closed(&mut reader, start).await;
    assert!(
        closed.is_some() && answer.starts_with("HTTP/1.1 404"),
        "not served while four clients held their responses: {answer:?}"
    );
    drop(stalled);
    s.stop().await;
}

/// Uploads buffer at most the gateway's upload memory at once: a PUT
/// whose client sends 900 KiB of its body and then waits holds that much
/// of the 1 MiB; another PUT that does not fit (buffering under 256 KiB,
/// it cannot store early) waits, then is refused (503) at the gateway's
/// call timeout and stores nothing; once the first connection goes, its
/// room is given back and a PUT is stored. Before, nothing bounded it:
/// every upload held up to three chunks, from any number of connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uploads_past_the_memory_budget_are_refused() {
    use std::time::{Duration, Instant};
    use tokio::io::AsyncWriteExt as _;
    let s = setup_with(true, |config| {
        config.upload_memory_bytes = 1 << 20;
        config.client.timeout = Duration::from_secs(2);
    })
    .await;
    let at = s.gateway.http_address;
    // 1000 KiB declared, 900 KiB sent, then nothing (within the body
    // idle bound): the gateway holds 900 KiB of the 1 MiB.
    let held = blob(71, 1000 << 10);
    let held_path = format!("/cas/{}", hex(&Sha256::digest(&held)));
    let stream = tokio::net::TcpStream::connect(at).await.unwrap();
    let (reader, mut writer) = stream.into_split();
    let head = format!(
        "PUT {held_path} HTTP/1.1\r\nhost: gateway\r\ncontent-length: {}\r\n\r\n",
        held.len()
    );
    writer.write_all(head.as_bytes()).await.unwrap();
    writer.write_all(&held[..900 << 10]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // 300 KiB more does not fit: refused after the 2 s call timeout.
    let other = blob(72, 300 << 10);
    let other_path = format!("/cas/{}", hex(&Sha256::digest(&other)));
    let started = Instant::now();
    let answer = raw_put(at, &other_path, &other, other.len()).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "refused after {:?}",
        started.elapsed()
    );
    assert_eq!(http(at, "HEAD", &other_path, None, vec![]).await.0, 404);
    // The held upload's client goes: its reservation comes back.
    drop(writer);
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = http(at, "PUT", &other_path, None, other.clone()).await;
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{status} {}",
            String::from_utf8_lossy(&body)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(http(at, "HEAD", &other_path, None, vec![]).await.0, 200);
    assert_eq!(http(at, "HEAD", &held_path, None, vec![]).await.0, 404);
    s.stop().await;
}

/// A ByteStream upload its client paused (the stream ended without
/// `finish_write`) stores what it buffered at once and waits for its
/// resumption holding no upload memory: other uploads are served
/// meanwhile, and the resumed write completes the blob. Paused uploads
/// held their buffered bytes for the ten minutes they wait (64 of them,
/// a chunk each: the whole default budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_bytestream_upload_holds_no_upload_memory() {
    use std::time::Duration;
    let s = setup_with(true, |config| {
        config.upload_memory_bytes = 1 << 20;
        config.client.timeout = Duration::from_secs(2);
    })
    .await;
    let content = blob(81, 2 * CHUNK + 333);
    let name = format!("uploads/paused-1/{}", blob_name(&content));
    let paused = 900 << 10;
    let first = write_requests(&name, &content[..paused], 0, 64 << 10, false);
    let e = s
        .bytestream()
        .write(tokio_stream::iter(first))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // 600 KiB more fits only if the paused upload holds nothing.
    let other = blob(82, 600 << 10);
    let other_path = format!("/cas/{}", hex(&Sha256::digest(&other)));
    assert_eq!(
        http(
            s.gateway.http_address,
            "PUT",
            &other_path,
            None,
            other.clone()
        )
        .await
        .0,
        200
    );
    let rest = write_requests(&name, &content, paused, 64 << 10, true);
    let committed = s
        .bytestream()
        .write(tokio_stream::iter(rest))
        .await
        .unwrap()
        .into_inner()
        .committed_size;
    assert_eq!(committed, content.len() as i64);
    assert_eq!(
        bytestream_read(&s, &blob_name(&content), 0, 0)
            .await
            .unwrap(),
        content
    );
    s.stop().await;
}

/// Reads hold at most the gateway's read memory: a client that stops
/// reading a large blob keeps what it is being sent (its chunks), and
/// another read then waits and is refused (503) at the call timeout; once
/// the slow client goes, its room comes back and reads are served. Before,
/// every read held up to two chunks for as long as its client took.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_past_the_memory_budget_are_refused() {
    use std::time::{Duration, Instant};
    use tokio::io::AsyncWriteExt as _;
    let s = setup_with(true, |config| {
        config.read_memory_bytes = 1536 << 10;
        config.max_blob_bytes = 32 << 20;
        config.client.timeout = Duration::from_secs(2);
    })
    .await;
    let at = s.gateway.http_address;
    let large = blob(91, 16 * CHUNK);
    let large_path = format!("/cas/{}", hex(&Sha256::digest(&large)));
    assert_eq!(
        http(at, "PUT", &large_path, None, large.clone()).await.0,
        200
    );
    let small = blob(92, 1000);
    let small_path = format!("/cas/{}", hex(&Sha256::digest(&small)));
    assert_eq!(
        http(at, "PUT", &small_path, None, small.clone()).await.0,
        200
    );
    // A GET whose client reads nothing (a small receive buffer): what the
    // socket does not take stays with the gateway.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(at).await.unwrap();
    slow.write_all(format!("GET {large_path} HTTP/1.1\r\nhost: gateway\r\n\r\n").as_bytes())
        .await
        .unwrap();
    // Once the gateway is stalled on it (a probe is refused), reads wait
    // the call timeout and are refused.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let started = Instant::now();
        let (status, _) = http(at, "GET", &small_path, None, vec![]).await;
        if status == 503 {
            assert!(
                started.elapsed() >= Duration::from_millis(1900),
                "refused after {:?}",
                started.elapsed()
            );
            break;
        }
        assert_eq!(status, 200);
        assert!(Instant::now() < deadline, "reads were never refused");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = http(at, "GET", &small_path, None, vec![]).await;
        if status == 200 {
            assert!(body == small);
            break;
        }
        assert!(Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.stop().await;
}

/// Under an upload budget smaller than a chunk, the SDK stores an upload's
/// bytes a budget at a time as chunks of their own; a blob of at most one
/// chunk is still stored whole at the end (read back and joined), as the
/// presence check of `FindMissingBlobs` takes it to be.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_blob_is_stored_whole_under_a_small_upload_budget() {
    let s = setup_with(true, |config| {
        config.upload_memory_bytes = 256 << 10;
    })
    .await;
    let content = blob(91, 600 << 10);
    let key = Sha256::digest(&content);
    let path = format!("/ci/cas/{}", hex(&key));
    let (status, body) = http(s.gateway.http_address, "PUT", &path, None, content.clone()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let meta = s.client.head("ci", &key).await.expect("head");
    assert!(!meta.chunked, "{meta:?}");
    let (status, body) = http(s.gateway.http_address, "GET", &path, None, vec![]).await;
    assert!(status == 200 && body == content, "{status}");
    s.stop().await;
}
