//! The client API of real nodes over gRPC: three nodes, two shards.
//! Every operation, every typed error a client can provoke, and the hints
//! that let a client route: `NOT_LEADER` names the leader, `WRONG_SHARD`
//! carries the map version.

mod grpc_support;

use grpc_support::{TestCluster, blob, code, get, get_on, put, put_on};
use prost::Message as _;
use sha2::{Digest, Sha256};
use tidepool_proto::error_detail;
use tidepool_proto::v1::{
    BatchExistsRequest, BlobKind, ChunkManifest, ChunkRef, DeleteRequest, ErrorCode, GetRequest,
    HeadRequest, Presence, PutHeader, PutRequest, PutResponse, ReadConsistency, ReplacedChunks,
    TouchRequest, WriteSession, get_response, put_request,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_operation_and_every_client_error() {
    let cluster = TestCluster::start(3, 2, |c| c.raft.max_value_bytes = 2 << 20).await;

    // Put, get, head; content over several stream chunks.
    let content: Vec<u8> = (0..1_500_000u32).map(|i| (i % 251) as u8).collect();
    let put_response = put(&cluster, "default", b"reports/q3.pdf", &content)
        .await
        .unwrap();
    let info = put_response.info.unwrap();
    assert_eq!(info.size, content.len() as u64);
    assert_eq!(info.sha256, Sha256::digest(&content).to_vec());
    assert!(!put_response.already_present);
    assert_eq!(
        get(&cluster, "default", b"reports/q3.pdf").await.unwrap(),
        content
    );

    // Find the leader of that key's shard through a NOT_LEADER hint.
    let mut leader = 0;
    for id in 1..=3 {
        match get_on(
            &cluster,
            id,
            "default",
            b"reports/q3.pdf",
            ReadConsistency::Linearizable,
        )
        .await
        {
            Ok(_) => leader = id,
            Err(status) => {
                assert_eq!(code(&status), ErrorCode::NotLeader, "{status:?}");
                let detail = error_detail(&status).unwrap();
                let hint = detail.leader_hint.expect("the follower names the leader");
                assert_eq!(hint.address, cluster.url(hint.node_id));
                assert!(detail.map_version >= 1);
                assert!(detail.shard_id.is_some());
            }
        }
    }
    assert_ne!(leader, 0);
    let follower = leader % 3 + 1;
    // Any replica may serve reads that accept staleness, once it applied.
    let mut served = false;
    for _ in 0..100 {
        if let Ok(bytes) = get_on(
            &cluster,
            follower,
            "default",
            b"reports/q3.pdf",
            ReadConsistency::AnyReplica,
        )
        .await
        {
            assert_eq!(bytes, content);
            served = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(served, "a follower never served an any-replica read");
    let status = put_on(&cluster, follower, "default", b"reports/q3.pdf", b"x")
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotLeader);

    let mut client = cluster.client(leader).await;
    // A range read, clamped at the end.
    let mut stream = client
        .get(GetRequest {
            blob: blob("default", b"reports/q3.pdf"),
            offset: 1_499_990,
            length: 100,
            ..GetRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut range = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        if let Some(get_response::Msg::Data(d)) = m.msg {
            range.extend_from_slice(&d);
        }
    }
    assert_eq!(range, content[1_499_990..]);
    let head = client
        .head(HeadRequest {
            blob: blob("default", b"reports/q3.pdf"),
            ..HeadRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(head.info.unwrap().size, content.len() as u64);

    // Missing blobs, namespaces, bad keys.
    let status = get(&cluster, "default", b"nothing here").await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotFound);
    let status = put_on(&cluster, leader, "nope", b"k", b"v")
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::NamespaceNotFound);
    let status = put_on(&cluster, leader, "default", b"", b"v")
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);
    let status = put_on(&cluster, leader, "default", &[7u8; 1025], b"v")
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);

    // Too large, and a stream that does not match its header.
    let status = put(&cluster, "default", b"big", &vec![0u8; (2 << 20) + 1])
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::ValueTooLarge);
    let lying = vec![
        PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("default", b"reports/q3.pdf"),
                size: 10,
                ..PutHeader::default()
            })),
        },
        PutRequest {
            msg: Some(put_request::Msg::Data(vec![1; 5].into())),
        },
    ];
    let status = client.put(tokio_stream::iter(lying)).await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::SizeMismatch);
    let wrong_digest = vec![
        PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("default", b"reports/q3.pdf"),
                size: 3,
                expected_sha256: vec![0; 32],
                kind: BlobKind::Data as i32,
                ..PutHeader::default()
            })),
        },
        PutRequest {
            msg: Some(put_request::Msg::Data(b"abc".to_vec().into())),
        },
    ];
    let status = client
        .put(tokio_stream::iter(wrong_digest))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::DigestMismatch);
    // Nothing of the refused puts was stored.
    assert_eq!(
        get(&cluster, "default", b"reports/q3.pdf").await.unwrap(),
        content
    );

    // Content-addressed: the key must be the digest; a second put of the
    // same content only refreshes it.
    let chunk = b"a deduplicated chunk".to_vec();
    let digest = Sha256::digest(&chunk).to_vec();
    let first = put(&cluster, "cas", &digest, &chunk).await.unwrap();
    assert!(!first.already_present);
    let again = put(&cluster, "cas", &digest, &chunk).await.unwrap();
    assert!(again.already_present);
    let status = put(&cluster, "cas", &digest, b"other content")
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::DigestMismatch);
    let status = put(&cluster, "cas", b"short", &chunk).await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);
    // No unlisted chunk kind there: stored so, a content-addressed blob
    // would stay out of listings for good (later puts find it present).
    let other = b"content stored as a chunk".to_vec();
    let as_chunk = vec![
        PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("cas", &Sha256::digest(&other)),
                size: other.len() as u64,
                kind: BlobKind::Chunk as i32,
                ..PutHeader::default()
            })),
        },
        PutRequest {
            msg: Some(put_request::Msg::Data(other.clone().into())),
        },
    ];
    let status = cluster
        .client(1)
        .await
        .put(tokio_stream::iter(as_chunk))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);

    // Batch existence across both shards, from the leader of one: keys of
    // the other shard are answered there or marked NOT_HERE, never guessed.
    let mut keys: Vec<Vec<u8>> = (0..20).map(|i| format!("k{i}").into_bytes()).collect();
    for key in keys.iter().take(10) {
        put(&cluster, "default", key, b"v").await.unwrap();
    }
    keys.push(b"reports/q3.pdf".to_vec());
    let mut answered = vec![Presence::NotHere; keys.len()];
    for id in 1..=3 {
        let response = cluster
            .client(id)
            .await
            .batch_exists(BatchExistsRequest {
                namespace: "default".into(),
                keys: keys.clone(),
                ..BatchExistsRequest::default()
            })
            .await;
        // A node leading neither shard answers for none: its NOT_LEADER
        // is the answer, naming a leader.
        let response = match response {
            Ok(response) => response.into_inner(),
            Err(status) => {
                assert_eq!(code(&status), ErrorCode::NotLeader, "{status:?}");
                let hint = tidepool_proto::error_detail(&status).and_then(|d| d.leader_hint);
                assert!(hint.is_some(), "no leader named: {status:?}");
                continue;
            }
        };
        for (i, p) in response.presence.iter().enumerate() {
            let p = Presence::try_from(*p).unwrap();
            if p != Presence::NotHere {
                answered[i] = p;
            }
        }
    }
    // An unknown consistency is the request's error, not NOT_HERE for
    // every key.
    let status = cluster
        .client(1)
        .await
        .batch_exists(BatchExistsRequest {
            namespace: "default".into(),
            keys: keys.clone(),
            consistency: 7,
            ..BatchExistsRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);
    for (i, p) in answered.iter().enumerate() {
        let expected = if i < 10 || i == 20 {
            Presence::Present
        } else {
            Presence::Absent
        };
        assert_eq!(*p, expected, "key {i}");
    }

    // Touch and delete.
    let touched = cluster
        .client(leader)
        .await
        .touch(TouchRequest {
            blob: blob("default", b"reports/q3.pdf"),
            ..TouchRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(touched.epoch, 1);
    assert!(
        !touched.recorded,
        "written in the current epoch: nothing to record"
    );
    let deleted = client
        .delete(DeleteRequest {
            blob: blob("default", b"reports/q3.pdf"),
            ..DeleteRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.existed);
    let again = client
        .delete(DeleteRequest {
            blob: blob("default", b"reports/q3.pdf"),
            ..DeleteRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.existed);
    let status = get(&cluster, "default", b"reports/q3.pdf")
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotFound);
    let status = client
        .touch(TouchRequest {
            blob: blob("default", b"reports/q3.pdf"),
            ..TouchRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotFound);

    cluster.shutdown().await;
}

/// A put on node `id` in write session `session` (sequence `seq`).
async fn session_put(
    cluster: &TestCluster,
    id: u64,
    key: &[u8],
    content: &[u8],
    session: WriteSession,
) -> Result<PutResponse, tonic::Status> {
    session_put_kind(cluster, id, key, content, session, BlobKind::Data).await
}

async fn session_put_kind(
    cluster: &TestCluster,
    id: u64,
    key: &[u8],
    content: &[u8],
    session: WriteSession,
    kind: BlobKind,
) -> Result<PutResponse, tonic::Status> {
    let header = PutHeader {
        blob: blob("default", key),
        size: content.len() as u64,
        session: Some(session),
        kind: kind as i32,
        ..PutHeader::default()
    };
    let messages = vec![
        PutRequest {
            msg: Some(put_request::Msg::Header(header)),
        },
        PutRequest {
            msg: Some(put_request::Msg::Data(content.to_vec().into())),
        },
    ];
    cluster
        .client(id)
        .await
        .put(tokio_stream::iter(messages))
        .await
        .map(|r| r.into_inner())
}

fn session(id: u8, sequence: u64, opens: bool) -> WriteSession {
    WriteSession {
        id: vec![id; 16],
        sequence,
        opens,
    }
}

/// A put that would open its write session but whose body came slowly
/// (past `limits.opening_put_ms`) may not open it: refused with
/// `SESSION_EXPIRED`, nothing stored, when the shard does not know the
/// session — the client decided `opens` when it sent the header, and an
/// earlier attempt applied and then forgotten by a crowded shard would
/// apply again. The same slow put in a session the shard knows applies, and
/// so does a prompt opening put.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_put_may_not_open_its_session() {
    let cluster = TestCluster::start(3, 1, |c| c.limits.opening_put_ms = 300).await;
    let key = b"slow";
    put(&cluster, "default", key, b"first").await.unwrap();
    let mut leader = 0;
    for id in 1..=3 {
        if get_on(&cluster, id, "default", key, ReadConsistency::Linearizable)
            .await
            .is_ok()
        {
            leader = id;
        }
    }
    assert_ne!(leader, 0);
    let slow_put = |session: WriteSession, content: &'static [u8]| {
        let cluster = &cluster;
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel(2);
            tx.send(PutRequest {
                msg: Some(put_request::Msg::Header(PutHeader {
                    blob: blob("default", key),
                    size: content.len() as u64,
                    session: Some(session),
                    ..PutHeader::default()
                })),
            })
            .await
            .unwrap();
            let body = tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(600)).await;
                tx.send(PutRequest {
                    msg: Some(put_request::Msg::Data(content.to_vec().into())),
                })
                .await
                .unwrap();
            });
            let answer = cluster
                .client(leader)
                .await
                .put(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await;
            body.await.unwrap();
            answer
        }
    };
    let refused = slow_put(session(21, 1, true), b"slow opener")
        .await
        .unwrap_err();
    assert_eq!(code(&refused), ErrorCode::SessionExpired);
    assert!(refused.message().contains("slow body"), "{refused:?}");
    assert_eq!(get(&cluster, "default", key).await.unwrap(), b"first");
    // Opened promptly, then a slow put of the same session: applied.
    session_put(&cluster, leader, key, b"prompt", session(21, 2, true))
        .await
        .unwrap();
    slow_put(session(21, 3, true), b"slow, known session")
        .await
        .unwrap();
    assert_eq!(
        get(&cluster, "default", key).await.unwrap(),
        b"slow, known session"
    );
}

/// A put that overwrites a chunked blob (an SDK manifest) answers with
/// the chunks it replaced (the manifest's nonce and chunk count, read
/// where the put applied), so the SDK can delete them (nothing else names
/// them); a duplicate copy of that put answers without them — the blob
/// there by then may be another writer's, whose chunks are in use — and
/// so does a put over a plain blob, or over a manifest without a nonce.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_put_over_a_chunked_blob_answers_with_the_chunks_it_replaced() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let key = b"was-chunked";
    put(&cluster, "default", key, b"plain").await.unwrap();
    let mut leader = 0;
    for id in 1..=3 {
        if get_on(&cluster, id, "default", key, ReadConsistency::Linearizable)
            .await
            .is_ok()
        {
            leader = id;
        }
    }
    assert_ne!(leader, 0);
    let manifest = |nonce: u64, chunks: usize| {
        ChunkManifest {
            size: 10,
            sha256: vec![1; 32],
            chunks: vec![ChunkRef::default(); chunks],
            nonce,
        }
        .encode_to_vec()
    };
    let put_manifest = |nonce: u64, chunks: usize, session: WriteSession| {
        let cluster = &cluster;
        let bytes = manifest(nonce, chunks);
        async move {
            session_put_kind(cluster, leader, key, &bytes, session, BlobKind::Manifest)
                .await
                .unwrap()
        }
    };
    let stored = put_manifest(77, 3, session(9, 1, true)).await;
    assert_eq!(
        stored.replaced, None,
        "a put over a plain blob replaced none"
    );
    let over = session_put(&cluster, leader, key, b"small", session(9, 2, false))
        .await
        .unwrap();
    assert_eq!(
        over.replaced,
        Some(ReplacedChunks {
            nonce: 77,
            count: 3
        })
    );
    // Another writer stores a manifest there; the duplicate of write 2
    // changes nothing and names nothing (these chunks are in use).
    put_manifest(78, 5, session(10, 1, true)).await;
    let duplicate = session_put(&cluster, leader, key, b"small", session(9, 2, false))
        .await
        .unwrap();
    assert_eq!(duplicate.replaced, None);
    // Write 3 replaces it: named.
    let third = session_put(&cluster, leader, key, b"small", session(9, 3, false))
        .await
        .unwrap();
    assert_eq!(
        third.replaced,
        Some(ReplacedChunks {
            nonce: 78,
            count: 5
        })
    );
    // A manifest without a nonce (older SDKs, content-addressed uploads):
    // its chunks' keys cannot be derived; nothing named.
    put_manifest(0, 2, session(10, 2, false)).await;
    let fourth = session_put(&cluster, leader, key, b"small", session(9, 4, false))
        .await
        .unwrap();
    assert_eq!(fourth.replaced, None);
}

/// Writes in a session over the wire: a retried copy answers the first
/// copy's outcome and changes nothing; stale and unknown sessions are
/// refused with `SESSION_EXPIRED`; malformed sessions are
/// `INVALID_ARGUMENT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_write_applies_once_however_often_it_is_sent() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let key = b"once";
    put(&cluster, "default", key, b"first").await.unwrap();
    let mut leader = 0;
    for id in 1..=3 {
        if get_on(&cluster, id, "default", key, ReadConsistency::Linearizable)
            .await
            .is_ok()
        {
            leader = id;
        }
    }
    assert_ne!(leader, 0);
    let delete = |s: WriteSession| DeleteRequest {
        blob: blob("default", key),
        session: Some(s),
        ..DeleteRequest::default()
    };
    let client = cluster.client(leader).await;

    // Write 1 of session 7: a delete that finds the key.
    let first = client.clone().delete(delete(session(7, 1, true))).await;
    assert!(first.unwrap().into_inner().existed);
    // Another client writes the key again.
    put(&cluster, "default", key, b"second").await.unwrap();
    // The retry of write 1: the first copy's answer, and nothing deleted.
    let retry = client.clone().delete(delete(session(7, 1, true))).await;
    assert!(retry.unwrap().into_inner().existed);
    assert_eq!(get(&cluster, "default", key).await.unwrap(), b"second");

    // Write 2 (a put), twice: the second copy writes nothing.
    session_put(&cluster, leader, key, b"third", session(7, 2, false))
        .await
        .unwrap();
    put(&cluster, "default", key, b"fourth").await.unwrap();
    session_put(&cluster, leader, key, b"third", session(7, 2, false))
        .await
        .unwrap();
    assert_eq!(get(&cluster, "default", key).await.unwrap(), b"fourth");

    // A copy of write 1 after write 2 applied: refused, nothing deleted.
    let stale = client.clone().delete(delete(session(7, 1, false))).await;
    assert_eq!(code(&stale.unwrap_err()), ErrorCode::SessionExpired);
    // A session this shard does not know, not opening: refused.
    let unknown = client.clone().delete(delete(session(8, 5, false))).await;
    let status = unknown.unwrap_err();
    assert_eq!(code(&status), ErrorCode::SessionExpired);
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(get(&cluster, "default", key).await.unwrap(), b"fourth");

    // Malformed sessions.
    for bad in [
        WriteSession {
            id: vec![1; 3],
            sequence: 1,
            opens: true,
        },
        session(9, 0, true),
    ] {
        let status = client.clone().delete(delete(bad)).await.unwrap_err();
        assert_eq!(code(&status), ErrorCode::InvalidArgument, "{status:?}");
    }
    cluster.shutdown().await;
}

/// Limits against hostile clients: a put that stops sending, never sends
/// its header, or trickles below the minimum average rate is dropped (not
/// held forever); a request larger than the
/// largest legal one is refused before it is decoded; the node serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_put_and_an_oversized_request_are_refused() {
    let cluster = TestCluster::start(3, 1, |c| {
        c.limits.put_idle_timeout_ms = 300;
        c.limits.max_request_bytes = 1 << 20 | 4096;
    })
    .await;
    put(&cluster, "default", b"before", b"v").await.unwrap();
    let mut leader = 0;
    for id in 1..=3 {
        if get_on(
            &cluster,
            id,
            "default",
            b"before",
            ReadConsistency::Linearizable,
        )
        .await
        .is_ok()
        {
            leader = id;
        }
    }
    // A header announcing 100 bytes, then silence (the sender stays open).
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(PutRequest {
        msg: Some(put_request::Msg::Header(PutHeader {
            blob: blob("default", b"stalled"),
            size: 100,
            ..PutHeader::default()
        })),
    })
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let status = cluster
        .client(leader)
        .await
        .put(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::Timeout, "{status:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    drop(tx);
    // A stream that never sends its header (was held for good).
    let (tx, rx) = tokio::sync::mpsc::channel::<PutRequest>(1);
    let started = std::time::Instant::now();
    let status = cluster
        .client(leader)
        .await
        .put(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::Timeout, "{status:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    drop(tx);
    // A byte every 200 ms, under the idle timeout, of 100 announced: the
    // average rate runs out after about the idle timeout (was held for as
    // long as the sender kept trickling).
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let trickle = tokio::spawn(async move {
        let header = PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("default", b"trickled"),
                size: 100,
                ..PutHeader::default()
            })),
        };
        if tx.send(header).await.is_err() {
            return;
        }
        for _ in 0..100 {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let byte = PutRequest {
                msg: Some(put_request::Msg::Data(vec![7u8].into())),
            };
            if tx.send(byte).await.is_err() {
                return;
            }
        }
    });
    let started = std::time::Instant::now();
    let status = cluster
        .client(leader)
        .await
        .put(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::Timeout, "{status:?}");
    assert!(status.message().contains("on average"), "{status:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    trickle.abort();
    // 2 MiB of keys: over the limit, refused whole.
    let keys: Vec<Vec<u8>> = (0..70_000)
        .map(|i| format!("{i:>30}").into_bytes())
        .collect();
    let status = cluster
        .client(leader)
        .await
        .batch_exists(BatchExistsRequest {
            namespace: "default".into(),
            keys,
            ..BatchExistsRequest::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            status.code(),
            tonic::Code::ResourceExhausted | tonic::Code::OutOfRange
        ),
        "{status:?}"
    );
    // The node serves on; nothing of the stalled put was stored.
    put(&cluster, "default", b"after", b"w").await.unwrap();
    assert_eq!(get(&cluster, "default", b"after").await.unwrap(), b"w");
    for key in [&b"stalled"[..], b"trickled"] {
        let status = get(&cluster, "default", key).await.unwrap_err();
        assert_eq!(code(&status), ErrorCode::NotFound);
    }
    cluster.shutdown().await;
}

/// The in-flight budget: a node holding its whole budget (here a stalled
/// put that announced most of it) refuses more with `OVERLOADED` and a
/// retry-after instead of growing its memory, and serves again once the
/// held bytes are released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_refuses_requests_beyond_its_in_flight_budget() {
    let cluster = TestCluster::start(3, 1, |c| {
        c.limits.in_flight_mib = 2;
        // The budget must hold two of the largest values (checked at
        // start): a manifest being checked holds one of its chunks too.
        c.raft.max_value_bytes = 1 << 20;
        c.limits.put_idle_timeout_ms = 1_000;
    })
    .await;
    put(&cluster, "default", b"k", b"v").await.unwrap();
    let large = vec![5u8; 900 << 10];
    put(&cluster, "default", b"large", &large).await.unwrap();
    let mut leader = 0;
    for id in 1..=3 {
        if get_on(&cluster, id, "default", b"k", ReadConsistency::Linearizable)
            .await
            .is_ok()
        {
            leader = id;
        }
    }
    // Two puts announcing 1,000 KiB each, then silence: most of the budget.
    let mut senders = Vec::new();
    let mut stalled = Vec::new();
    for name in [&b"held-1"[..], b"held-2"] {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("default", name),
                size: 1000 * 1024,
                ..PutHeader::default()
            })),
        })
        .await
        .unwrap();
        let mut client = cluster.client(leader).await;
        stalled.push(tokio::spawn(async move {
            client
                .put(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        }));
        senders.push(tx);
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let refused = put_on(&cluster, leader, "default", b"more", &[1; 200 * 1024])
        .await
        .unwrap_err();
    assert_eq!(code(&refused), ErrorCode::Overloaded, "{refused:?}");
    assert!(
        tidepool_proto::error_detail(&refused)
            .unwrap()
            .retry_after_ms
            > 0
    );
    // A read of a large value is refused too (before its bytes are read:
    // `an_admitted_read_asks_before_reading` in the engine's tests).
    let refused = get_on(
        &cluster,
        leader,
        "default",
        b"large",
        ReadConsistency::Linearizable,
    )
    .await
    .unwrap_err();
    assert_eq!(code(&refused), ErrorCode::Overloaded, "{refused:?}");
    // The stalled puts time out; their bytes are released.
    for put in stalled {
        let status = put.await.unwrap().unwrap_err();
        assert_eq!(code(&status), ErrorCode::Timeout);
    }
    drop(senders);
    put_on(&cluster, leader, "default", b"more", &[1; 200 * 1024])
        .await
        .unwrap();
    let got = get_on(
        &cluster,
        leader,
        "default",
        b"large",
        ReadConsistency::Linearizable,
    )
    .await
    .unwrap();
    assert_eq!(got, large);
    cluster.shutdown().await;
}

/// A manifest check in a content-addressed namespace holds one chunk at a
/// time, counted against the caller's in-flight budget: with the budget
/// nearly taken the manifest put is refused `OVERLOADED` (retryable), not
/// checked outside every budget; once the budget is free it is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_manifest_check_counts_the_chunk_it_holds() {
    let cluster = TestCluster::start(3, 1, |c| {
        c.limits.in_flight_mib = 2;
        c.raft.max_value_bytes = 1 << 20;
        c.limits.put_idle_timeout_ms = 1_000;
    })
    .await;
    let whole: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
    let halves = [&whole[..512 << 10], &whole[512 << 10..]];
    let sha = |bytes: &[u8]| Sha256::digest(bytes).to_vec();
    let mut leader = 0;
    for half in halves {
        put(&cluster, "cas", &sha(half), half).await.unwrap();
    }
    for id in 1..=3 {
        if get_on(
            &cluster,
            id,
            "cas",
            &sha(halves[0]),
            ReadConsistency::Linearizable,
        )
        .await
        .is_ok()
        {
            leader = id;
        }
    }
    let manifest = tidepool_proto::v1::ChunkManifest {
        size: whole.len() as u64,
        sha256: sha(&whole),
        chunks: halves
            .iter()
            .map(|h| tidepool_proto::v1::ChunkRef {
                key: sha(h),
                size: h.len() as u64,
                sha256: sha(h),
            })
            .collect(),
        nonce: 0,
    };
    let bytes = prost::Message::encode_to_vec(&manifest);
    let manifest_put = || {
        tokio_stream::iter(vec![
            PutRequest {
                msg: Some(put_request::Msg::Header(PutHeader {
                    blob: blob("cas", &sha(&whole)),
                    size: bytes.len() as u64,
                    kind: BlobKind::Manifest as i32,
                    ..PutHeader::default()
                })),
            },
            PutRequest {
                msg: Some(put_request::Msg::Data(bytes.clone().into())),
            },
        ])
    };
    // 1,536 KiB of the 2 MiB budget held by stalled puts: the manifest
    // (a few bytes) fits, its 512 KiB chunk does not.
    let mut senders = Vec::new();
    let mut stalled = Vec::new();
    for (name, size) in [(&b"held-1"[..], 1u64 << 20), (b"held-2", 512 << 10)] {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("default", name),
                size,
                ..PutHeader::default()
            })),
        })
        .await
        .unwrap();
        let mut client = cluster.client(leader).await;
        stalled.push(tokio::spawn(async move {
            client
                .put(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        }));
        senders.push(tx);
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let refused = cluster
        .client(leader)
        .await
        .put(manifest_put())
        .await
        .unwrap_err();
    assert_eq!(code(&refused), ErrorCode::Overloaded, "{refused:?}");
    for put in stalled {
        assert_eq!(code(&put.await.unwrap().unwrap_err()), ErrorCode::Timeout);
    }
    drop(senders);
    cluster
        .client(leader)
        .await
        .put(manifest_put())
        .await
        .expect("checked and stored once the budget is free");
    cluster.shutdown().await;
}

/// A client that connects to the metrics port and sends nothing is cut
/// off after the connection timeout (10 s), not held forever; the port
/// keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_metrics_connection_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let port = tidepool_testkit::free_port();
    let cluster = TestCluster::start(1, 1, |c| {
        c.metrics_listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    })
    .await;
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buffer = [0u8; 16];
    let read = tokio::time::timeout(std::time::Duration::from_secs(20), silent.read(&mut buffer))
        .await
        .expect("the node closes a silent connection");
    assert_eq!(read.unwrap_or(0), 0, "closed without an answer");
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let mut asking = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    asking
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    asking.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    cluster.shutdown().await;
}

/// A request the caller gives up on before it is answered (here: a delete
/// that cannot commit, its leader's followers stopped, under a 300 ms
/// deadline) is counted as an error `CANCELLED`. Before, the deadline
/// dropped the handler and the request was counted nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_abandoned_before_its_answer_is_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ports: Vec<u16> = (0..3).map(|_| tidepool_testkit::free_port()).collect();
    let mut cluster = TestCluster::start(3, 1, |c| {
        c.metrics_listen = Some(
            format!("127.0.0.1:{}", ports[c.node_id as usize - 1])
                .parse()
                .unwrap(),
        );
        // A leader that lost its followers notices only after seconds.
        c.raft.tick_ms = 500;
    })
    .await;
    put(&cluster, "default", b"kept", b"v").await.unwrap();
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    for id in 1..=3 {
        if id != leader {
            cluster.stop(id).await;
        }
    }
    let mut request = tonic::Request::new(DeleteRequest {
        blob: blob("default", b"kept"),
        ..DeleteRequest::default()
    });
    request.set_timeout(std::time::Duration::from_millis(300));
    let status = cluster
        .client(leader)
        .await
        .delete(request)
        .await
        .expect_err("no quorum to commit it");
    assert!(
        matches!(
            status.code(),
            tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
        ),
        "{status:?}"
    );
    let port = ports[leader as usize - 1];
    let scrape = async || {
        let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        socket
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        socket.read_to_string(&mut text).await.unwrap();
        text
    };
    let counted = format!(
        "tidepool_node_request_errors_total{{node_id=\"{leader}\",op=\"delete\",code=\"CANCELLED\"}} 1"
    );
    let mut text = scrape().await;
    for _ in 0..50 {
        if text.contains(&counted) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        text = scrape().await;
    }
    assert!(text.contains(&counted), "{text}");
    cluster.shutdown().await;
}

/// A Raft batch larger than any a peer sends (16 MiB of messages plus
/// one message) is refused before it is buffered; the node serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_raft_batch_is_refused() {
    use tidepool_proto::v1::raft_transport_client::RaftTransportClient;
    use tidepool_proto::v1::{RaftBatch, RaftEnvelope};
    let cluster = TestCluster::start(1, 1, |_| {}).await;
    put(&cluster, "default", b"before", b"v").await.unwrap();
    let channel = tonic::transport::Channel::from_shared(cluster.url(1))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raft = RaftTransportClient::new(channel).max_encoding_message_size(usize::MAX);
    let batch = RaftBatch {
        from_node: 2,
        to_node: 1,
        messages: vec![RaftEnvelope {
            shard_id: 1,
            message: vec![0; 40 << 20],
        }],
    };
    let refused = raft
        .send(tokio_stream::iter(vec![batch]))
        .await
        .expect_err("a 40 MiB batch is refused");
    assert!(
        matches!(
            refused.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{refused:?}"
    );
    put(&cluster, "default", b"after", b"v").await.unwrap();
    cluster.shutdown().await;
}

/// The request counter (`tidepool_rpc_requests`) takes a gRPC call's code
/// from its trailers on a real server: successful streamed and unary calls
/// count as `OK` once each, not as `CANCELLED` (a body dropped before its
/// trailers) and not twice; a refusal in the response head as its code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_counted_by_the_status_they_end_with() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let count = |method: &'static str, code: &'static str| -> u64 {
        let labels = tidepool_telemetry::requests::RequestLabels {
            protocol: "grpc",
            method,
            code,
        };
        cluster
            .running
            .values()
            .map(|n| n.node.metrics.rpc.count(&labels))
            .sum()
    };
    let (gets, puts) = (count("Get", "OK"), count("Put", "OK"));
    let content = vec![7u8; 300_000];
    put(&cluster, "default", b"counted", &content)
        .await
        .unwrap();
    for _ in 0..3 {
        assert_eq!(get(&cluster, "default", b"counted").await.unwrap(), content);
    }
    // A linearizable get on every node: the followers refuse it in the head.
    let mut refused = 0;
    for id in 1..=3 {
        if get_on(
            &cluster,
            id,
            "default",
            b"counted",
            ReadConsistency::Linearizable,
        )
        .await
        .is_err()
        {
            refused += 1;
        }
    }
    assert_eq!(refused, 2);
    assert!(count("Put", "OK") > puts, "the put was not counted as OK");
    assert!(
        count("Get", "OK") >= gets + 4,
        "the gets were not counted as OK"
    );
    assert_eq!(count("Get", "CANCELLED") + count("Put", "CANCELLED"), 0);
    assert_eq!(count("Get", "UNKNOWN") + count("Put", "UNKNOWN"), 0);
    assert!(
        count("Get", "UNAVAILABLE") >= 2,
        "NOT_LEADER is UNAVAILABLE"
    );
}

/// A content-addressed blob the name index lacks — stored before the index
/// existed, so its replica says listings are incomplete — is indexed when
/// put again: a replica whose index is incomplete writes it again instead
/// of answering "already present" (which kept it unlisted for good; the
/// listing design names re-putting chunks as how they come back).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_content_addressed_put_on_an_incomplete_replica_indexes_the_blob() {
    use tidepool_engine::Durability;
    use tidepool_node::names::{NAMES_KEY_SPACE, NameBatch};
    use tidepool_proto::v1::ListRequest;
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let chunk = b"a chunk stored before the index".to_vec();
    let digest = Sha256::digest(&chunk).to_vec();
    put(&cluster, "cas", &digest, &chunk).await.unwrap();
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    // The leader's index as an older version left it: no name, and the
    // mark saying so (namespace `cas` is id 2).
    let engine = cluster.running[&leader]
        .node
        .shard(1)
        .unwrap()
        .engine()
        .clone();
    let names = engine.key_space(NAMES_KEY_SPACE).unwrap();
    let mut batch = NameBatch::new(&engine, names);
    assert!(batch.remove(2, &digest).unwrap());
    batch.mark_incomplete();
    batch.commit(Durability::Synced).unwrap();
    let list = || async {
        cluster
            .client(leader)
            .await
            .list(ListRequest {
                namespace: "cas".into(),
                shard_id: 1,
                ..ListRequest::default()
            })
            .await
            .unwrap()
            .into_inner()
    };
    let before = list().await;
    assert!(before.entries.is_empty() && before.incomplete, "{before:?}");
    // Put again only if absent, as an append-only caller's put is: written
    // again all the same (no overwrite: the key holds only its content).
    let if_absent = vec![
        PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob("cas", &digest),
                size: chunk.len() as u64,
                if_absent: true,
                ..PutHeader::default()
            })),
        },
        PutRequest {
            msg: Some(put_request::Msg::Data(chunk.clone().into())),
        },
    ];
    let again = cluster
        .client(leader)
        .await
        .put(tokio_stream::iter(if_absent))
        .await
        .expect("a put of present content is no overwrite")
        .into_inner();
    assert!(!again.already_present, "answered present, left unlisted");
    let after = list().await;
    let keys: Vec<_> = after.entries.iter().map(|e| e.key.clone()).collect();
    assert_eq!(keys, vec![digest.clone()]);
    // Indexed now: the next put is the usual no-op, though the replica
    // still says its listings are incomplete (other blobs may be missing).
    let third = put(&cluster, "cas", &digest, &chunk).await.unwrap();
    assert!(third.already_present);
    assert!(list().await.incomplete);
    assert_eq!(
        get(&cluster, "cas", &digest).await.unwrap(),
        chunk,
        "the blob written again"
    );
    cluster.shutdown().await;
}

/// A chunk put under a listed blob's key (no SDK makes one: its chunk keys
/// are hashes; a hand-made put might) replaces the blob, whose name leaves
/// the listing: before, the listing went on showing the old blob's kind,
/// size and SHA-256 for a key holding a chunk. A blob put there again is
/// listed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chunk_put_over_a_listed_blob_unlists_it() {
    use tidepool_proto::v1::ListRequest;
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let key = b"report.pdf";
    put(&cluster, "default", key, b"the report").await.unwrap();
    put(&cluster, "default", b"other", b"stays").await.unwrap();
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    let list = || async {
        let page = cluster
            .client(leader)
            .await
            .list(ListRequest {
                namespace: "default".into(),
                shard_id: 1,
                ..ListRequest::default()
            })
            .await
            .unwrap()
            .into_inner();
        page.entries
            .into_iter()
            .map(|e| (e.key, e.info.map_or(0, |i| i.size)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        list().await,
        vec![(b"other".to_vec(), 5), (key.to_vec(), 10)]
    );
    session_put_kind(
        &cluster,
        leader,
        key,
        b"a chunk",
        session(30, 1, true),
        BlobKind::Chunk,
    )
    .await
    .unwrap();
    assert_eq!(list().await, vec![(b"other".to_vec(), 5)]);
    put(&cluster, "default", key, b"again").await.unwrap();
    assert_eq!(
        list().await,
        vec![(b"other".to_vec(), 5), (key.to_vec(), 5)]
    );
    cluster.shutdown().await;
}

/// A content-addressed manifest that lists a chunk with another size than
/// the stored chunk's is refused at once with `DIGEST_MISMATCH` (final):
/// before, the check took the wrong size for an unavailable replica, read
/// the chunk again from every replica with back-offs, and answered
/// `NO_QUORUM` — retryable, so clients retried a put that can never be
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_manifest_listing_a_chunk_with_a_wrong_size_is_refused_at_once() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let whole: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    let (first, second) = whole.split_at(1000);
    let sha = |bytes: &[u8]| Sha256::digest(bytes).to_vec();
    for part in [first, second] {
        put(&cluster, "cas", &sha(part), part).await.unwrap();
    }
    // Sizes swapped: they still add up to the whole.
    let manifest = ChunkManifest {
        size: whole.len() as u64,
        sha256: sha(&whole),
        chunks: vec![
            ChunkRef {
                key: sha(first),
                size: second.len() as u64,
                sha256: sha(first),
            },
            ChunkRef {
                key: sha(second),
                size: first.len() as u64,
                sha256: sha(second),
            },
        ],
        nonce: 0,
    }
    .encode_to_vec();
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    let refused = cluster
        .client(leader)
        .await
        .put(tokio_stream::iter(vec![
            PutRequest {
                msg: Some(put_request::Msg::Header(PutHeader {
                    blob: blob("cas", &sha(&whole)),
                    size: manifest.len() as u64,
                    kind: BlobKind::Manifest as i32,
                    ..PutHeader::default()
                })),
            },
            PutRequest {
                msg: Some(put_request::Msg::Data(manifest.clone().into())),
            },
        ]))
        .await
        .unwrap_err();
    assert_eq!(code(&refused), ErrorCode::DigestMismatch, "{refused:?}");
    assert!(
        refused.message().contains("lists as 2000 bytes holds 1000"),
        "{refused:?}"
    );
    let status = get(&cluster, "cas", &sha(&whole)).await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotFound);
    cluster.shutdown().await;
}

/// Requests a node cannot honour as sent get their typed error: an unknown
/// durability is `INVALID_ARGUMENT` (before: silently the configured one),
/// and a namespace name of a megabyte is `NAMESPACE_NOT_FOUND` with the
/// name cut short in the message (before: quoted whole into the error's
/// headers, which the client could not take — a transport error instead
/// of the typed one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_durabilities_and_huge_namespace_names_get_typed_errors() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    let put_with = |namespace: String, durability: i32| {
        tokio_stream::iter(vec![
            PutRequest {
                msg: Some(put_request::Msg::Header(PutHeader {
                    blob: blob(&namespace, b"k"),
                    size: 1,
                    durability,
                    ..PutHeader::default()
                })),
            },
            PutRequest {
                msg: Some(put_request::Msg::Data(vec![1u8].into())),
            },
        ])
    };
    let mut client = cluster.client(leader).await;
    let status = client.put(put_with("default".into(), 9)).await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument, "{status:?}");
    assert!(status.message().contains("durability 9"), "{status:?}");
    let status = client
        .delete(DeleteRequest {
            blob: blob("default", b"k"),
            durability: 9,
            ..DeleteRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument, "{status:?}");
    assert!(
        get(&cluster, "default", b"k").await.is_err(),
        "nothing was stored"
    );
    let huge = "n".repeat(1 << 20);
    let status = client.put(put_with(huge.clone(), 0)).await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::NamespaceNotFound, "{status:?}");
    assert!(status.message().len() < 400, "{}", status.message().len());
    let status = client
        .get(GetRequest {
            blob: blob(&huge, b"k"),
            ..GetRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::NamespaceNotFound, "{status:?}");
    // A listing with an unknown consistency: INVALID_ARGUMENT from every
    // replica (a follower answered NOT_LEADER first).
    for id in 1..=3 {
        let status = cluster
            .client(id)
            .await
            .list(tidepool_proto::v1::ListRequest {
                namespace: "default".into(),
                shard_id: 1,
                consistency: 9,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            code(&status),
            ErrorCode::InvalidArgument,
            "node {id}: {status:?}"
        );
    }
    cluster.shutdown().await;
}

/// A delete of a chunked blob answers with the chunks it removed, read
/// where it applied (so the SDK deletes the chunks of the blob the delete
/// really removed: one put after the SDK read the manifest was deleted
/// without its chunks, which nothing named any more); a duplicate of the
/// delete, and a delete of a plain blob or of nothing, name none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_of_a_chunked_blob_answers_with_the_chunks_it_removed() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let key = b"chunked-then-deleted";
    put(&cluster, "default", key, b"plain").await.unwrap();
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    let manifest = ChunkManifest {
        size: 10,
        sha256: vec![1; 32],
        chunks: vec![ChunkRef::default(); 4],
        nonce: 91,
    }
    .encode_to_vec();
    session_put_kind(
        &cluster,
        leader,
        key,
        &manifest,
        session(40, 1, true),
        BlobKind::Manifest,
    )
    .await
    .unwrap();
    let delete = |sequence: u64| {
        let cluster = &cluster;
        async move {
            cluster
                .client(leader)
                .await
                .delete(DeleteRequest {
                    blob: blob("default", key),
                    session: Some(session(41, sequence, sequence == 1)),
                    ..DeleteRequest::default()
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    let first = delete(1).await;
    assert!(first.existed);
    assert_eq!(
        first.replaced,
        Some(ReplacedChunks {
            nonce: 91,
            count: 4
        })
    );
    // The same delete again: a duplicate, which removed nothing now.
    let duplicate = delete(1).await;
    assert!(duplicate.existed, "the first copy's answer");
    assert_eq!(duplicate.replaced, None);
    // Nothing there, then a plain blob: none named.
    assert_eq!(delete(2).await.replaced, None);
    put(&cluster, "default", key, b"plain again").await.unwrap();
    let plain = delete(3).await;
    assert!(plain.existed);
    assert_eq!(plain.replaced, None);
    cluster.shutdown().await;
}

/// Poisons the engine of node `id`'s replica of shard 1 as a deleted
/// replica directory does: the next control snapshot cannot be written
/// (the replica's own maintenance may get there first).
async fn poison_replica(cluster: &TestCluster, id: u64) {
    let shard = cluster.running[&id].node.shard(1).unwrap();
    let engine = shard.engine().clone();
    std::fs::remove_dir_all(shard.store().dir()).unwrap();
    // Something new since the last snapshot, so that it is written now
    // (not by the maintenance task a moment earlier, which the owner's
    // next tick would have found: the read right after must meet an
    // engine poisoned since the owner's last round). Written into this
    // replica's engine alone: it is poisoned at once.
    let space = engine.key_space("blobs").unwrap();
    engine
        .put(
            space,
            &[0xee; 32],
            b"x",
            tidepool_engine::Durability::Buffered,
        )
        .unwrap();
    let _ = engine.write_control_snapshot();
    assert!(engine.health().is_err(), "the engine is poisoned");
}

/// A replica whose engine was poisoned in the background (its directory
/// deleted under it; the maintenance task's snapshot found out) answers the
/// reads that reach it before its owner notices as a replica that is down:
/// `NO_QUORUM`, which clients retry on the other replicas. They were
/// `INTERNAL`, which no client retries: a linearizable read passed the
/// leader's lease gate, an any-replica read went to the engine at once,
/// and the engine refused it (the e2e soak saw three).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_poisoned_in_the_background_answers_reads_as_down() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    put(&cluster, "default", b"k", b"value").await.unwrap();
    let leader = grpc_support::wait_leader(&cluster, 1).await;
    let follower = leader % 3 + 1;

    for (id, consistency) in [
        (follower, ReadConsistency::AnyReplica),
        (leader, ReadConsistency::Linearizable),
    ] {
        if id == leader {
            // The lease gate is open: reads skip the owner.
            get_on(&cluster, id, "default", b"k", consistency)
                .await
                .unwrap();
        }
        poison_replica(&cluster, id).await;
        let shard = cluster.running[&id].node.shard(1).unwrap();
        let direct = shard.stats().lease_reads_direct.get();
        let status = get_on(&cluster, id, "default", b"k", consistency)
            .await
            .expect_err("a poisoned replica serves nothing");
        assert_eq!(
            code(&status),
            ErrorCode::NoQuorum,
            "node {id} ({consistency:?}): {status:?}"
        );
        assert!(
            status.message().contains("poisoned"),
            "says why: {status:?}"
        );
        assert_eq!(status.code(), tonic::Code::Unavailable);
        if id == leader {
            // The lease gate sent the read to the owner, which failed the
            // replica before serving it.
            assert_eq!(shard.stats().lease_reads_direct.get(), direct);
            assert!(
                status.message().contains("cannot serve the read"),
                "{status:?}"
            );
        }
    }
    cluster.shutdown().await;
}
