//! The gateway's protocols against a real in-process cluster (coordinator
//! and three nodes on loopback sockets), through the generated REAPI and
//! ByteStream clients and a real HTTP client: every call, and the bad
//! input each must refuse with its code.

use std::time::Duration;

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use bazel_remote_apis::google::bytestream::QueryWriteStatusRequest;
use http_body_util::{BodyExt as _, Full};
use prost::Message as _;
use re::capabilities_client::CapabilitiesClient;
use sha2::{Digest as _, Sha256};
use tidepool_client::{ClientConfig, RetentionPolicy};
use tidepool_gateway::{GatewayConfig, RunningGateway};
use tidepool_testkit::cluster::LocalCluster;
use tonic::Code;
use tonic::transport::Channel;

mod support;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capabilities_find_missing_and_batches() {
    let s = setup(true).await;
    let caps = CapabilitiesClient::new(s.channel.clone())
        .get_capabilities(re::GetCapabilitiesRequest {
            instance_name: String::new(),
        })
        .await
        .expect("capabilities")
        .into_inner();
    let cache = caps.cache_capabilities.unwrap();
    assert_eq!(
        cache.digest_functions,
        vec![re::digest_function::Value::Sha256 as i32]
    );
    assert!(
        cache
            .action_cache_update_capabilities
            .unwrap()
            .update_enabled
    );
    assert_eq!(cache.max_batch_total_size_bytes, 2 << 20);
    assert_eq!(cache.max_cas_blob_size_bytes, 8 << 20);
    assert!(
        cache
            .supported_compressors
            .contains(&(re::compressor::Value::Zstd as i32))
    );
    assert!(cache.split_blob_support && cache.splice_blob_support);
    let unknown = CapabilitiesClient::new(s.channel.clone())
        .get_capabilities(re::GetCapabilitiesRequest {
            instance_name: "nosuch".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::InvalidArgument, "{unknown:?}");

    // Exact FindMissingBlobs: what was stored is found, the rest is not;
    // the empty blob is always there; duplicates are answered once.
    let present: Vec<Vec<u8>> = (0..20).map(|i| blob(i, 100 + i as usize)).collect();
    let absent: Vec<Vec<u8>> = (100..120).map(|i| blob(i, 100)).collect();
    for b in &present {
        upload(&s, "", b).await;
    }
    let mut asked: Vec<re::Digest> = present.iter().chain(&absent).map(|b| digest(b)).collect();
    asked.push(digest(b""));
    asked.push(digest(&absent[0]));
    let missing = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: String::new(),
            blob_digests: asked,
            digest_function: 0,
        })
        .await
        .expect("find missing")
        .into_inner()
        .missing_blob_digests;
    let expected: Vec<re::Digest> = absent.iter().map(|b| digest(b)).collect();
    assert_eq!(missing, expected);
    // Instances are separate.
    let other = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: "ci".into(),
            blob_digests: vec![digest(&present[0])],
            digest_function: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .missing_blob_digests;
    assert_eq!(other.len(), 1);
    // Bad digests and digest functions.
    for bad in [
        re::Digest {
            hash: "abc".into(),
            size_bytes: 1,
        },
        re::Digest {
            hash: digest(b"x").hash.to_uppercase(),
            size_bytes: 1,
        },
        re::Digest {
            hash: digest(b"x").hash,
            size_bytes: -1,
        },
    ] {
        let e = s
            .cas()
            .find_missing_blobs(re::FindMissingBlobsRequest {
                instance_name: String::new(),
                blob_digests: vec![bad.clone()],
                digest_function: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e:?}");
    }
    let e = s
        .cas()
        .find_missing_blobs(re::FindMissingBlobsRequest {
            instance_name: String::new(),
            blob_digests: vec![],
            digest_function: re::digest_function::Value::Sha1 as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // BatchUpdateBlobs: per-item verdicts; a wrong hash or size is refused
    // and nothing is stored under the digest.
    let good = blob(1000, 5000);
    let liar = blob(1001, 5000);
    let mut wrong_size = digest(&good);
    wrong_size.size_bytes += 1;
    let zstd_data = zstd::bulk::compress(&blob(1002, 50_000), 3).unwrap();
    let response = s
        .cas()
        .batch_update_blobs(re::BatchUpdateBlobsRequest {
            instance_name: String::new(),
            requests: vec![
                re::batch_update_blobs_request::Request {
                    digest: Some(digest(&good)),
                    data: good.clone(),
                    compressor: 0,
                },
                re::batch_update_blobs_request::Request {
                    digest: Some(digest(&good)),
                    data: liar.clone(),
                    compressor: 0,
                },
                re::batch_update_blobs_request::Request {
                    digest: Some(wrong_size),
                    data: good.clone(),
                    compressor: 0,
                },
                re::batch_update_blobs_request::Request {
                    digest: Some(digest(&blob(1002, 50_000))),
                    data: zstd_data,
                    compressor: re::compressor::Value::Zstd as i32,
                },
            ],
            digest_function: 0,
        })
        .await
        .expect("batch update")
        .into_inner();
    let codes: Vec<i32> = response
        .responses
        .iter()
        .map(|r| r.status.as_ref().unwrap().code)
        .collect();
    assert_eq!(
        codes,
        vec![
            0,
            Code::InvalidArgument as i32,
            Code::InvalidArgument as i32,
            0
        ]
    );
    assert_eq!(
        s.client.get("cache", &Sha256::digest(&good)).await.unwrap(),
        good
    );
    assert!(
        !s.client
            .exists("cache", &Sha256::digest(&liar))
            .await
            .unwrap()
    );
    // Too big a batch.
    let big = blob(1003, (2 << 20) + 1);
    let e = s
        .cas()
        .batch_update_blobs(re::BatchUpdateBlobsRequest {
            instance_name: String::new(),
            requests: vec![re::batch_update_blobs_request::Request {
                digest: Some(digest(&big)),
                data: big,
                compressor: 0,
            }],
            digest_function: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // A few bytes of zstd declaring an exabyte: the batch limit is on the
    // sizes declared, refused before anything is decompressed.
    let bomb = zstd::bulk::compress(&vec![0u8; 1 << 20], 3).unwrap();
    let e = s
        .cas()
        .batch_update_blobs(re::BatchUpdateBlobsRequest {
            instance_name: String::new(),
            requests: vec![re::batch_update_blobs_request::Request {
                digest: Some(re::Digest {
                    hash: digest(b"any").hash,
                    size_bytes: 1 << 60,
                }),
                data: bomb,
                compressor: re::compressor::Value::Zstd as i32,
            }],
            digest_function: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("declare"), "{e:?}");

    // BatchReadBlobs: found, missing, compressed on request.
    let response = s
        .cas()
        .batch_read_blobs(re::BatchReadBlobsRequest {
            instance_name: String::new(),
            digests: vec![
                digest(&good),
                digest(&liar),
                digest(b""),
                // A stored blob asked for with a smaller size: not read.
                re::Digest {
                    hash: digest(&good).hash,
                    size_bytes: 1,
                },
            ],
            acceptable_compressors: vec![re::compressor::Value::Zstd as i32],
            digest_function: 0,
        })
        .await
        .expect("batch read")
        .into_inner();
    assert_eq!(
        response.responses[3].status.as_ref().unwrap().code,
        Code::NotFound as i32
    );
    // Sizes that add up past 2^64 are refused, not wrapped.
    let e = s
        .cas()
        .batch_read_blobs(re::BatchReadBlobsRequest {
            instance_name: String::new(),
            digests: vec![
                re::Digest {
                    hash: digest(&good).hash,
                    size_bytes: i64::MAX,
                },
                re::Digest {
                    hash: digest(&good).hash,
                    size_bytes: i64::MAX,
                },
                re::Digest {
                    hash: digest(&good).hash,
                    size_bytes: 3,
                },
            ],
            acceptable_compressors: Vec::new(),
            digest_function: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let first = &response.responses[0];
    assert_eq!(first.compressor, re::compressor::Value::Zstd as i32);
    assert_eq!(zstd::stream::decode_all(&first.data[..]).unwrap(), good);
    assert_eq!(
        response.responses[1].status.as_ref().unwrap().code,
        Code::NotFound as i32
    );
    assert_eq!(response.responses[2].status.as_ref().unwrap().code, 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bytestream_reads_writes_and_resumes() {
    let s = setup(true).await;
    // A blob of several chunks, written in pieces, read whole and in
    // ranges (across chunk boundaries).
    let big = blob(7, 3 * CHUNK + 12_345);
    let name = format!("uploads/u-1/{}", blob_name(&big));
    assert_eq!(
        bytestream_write(&s, &name, &big).await.unwrap(),
        big.len() as i64
    );
    assert_eq!(
        bytestream_read(&s, &blob_name(&big), 0, 0).await.unwrap(),
        big
    );
    let ranged = bytestream_read(&s, &blob_name(&big), CHUNK as i64 - 10, 100_000)
        .await
        .unwrap();
    assert_eq!(ranged, big[CHUNK - 10..CHUNK - 10 + 100_000]);
    let tail = bytestream_read(&s, &blob_name(&big), big.len() as i64 - 5, 0)
        .await
        .unwrap();
    assert_eq!(tail, big[big.len() - 5..]);
    assert!(
        bytestream_read(&s, &blob_name(&big), big.len() as i64, 0)
            .await
            .unwrap()
            .is_empty()
    );
    let e = bytestream_read(&s, &blob_name(&big), big.len() as i64 + 1, 0)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    let e = bytestream_read(&s, &blob_name(&blob(8, 10)), 0, 0)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // bytestream.proto: a negative offset is OUT_OF_RANGE.
    let e = bytestream_read(&s, &blob_name(&big), -1, 0)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);
    // The empty blob is always there.
    assert!(
        bytestream_read(&s, &blob_name(b""), 0, 0)
            .await
            .unwrap()
            .is_empty()
    );

    // The whole blob is known to SplitBlob as its chunks.
    let split = s
        .cas()
        .split_blob(re::SplitBlobRequest {
            instance_name: String::new(),
            blob_digest: Some(digest(&big)),
            ..Default::default()
        })
        .await
        .expect("split")
        .into_inner();
    let sizes: Vec<i64> = split.chunk_digests.iter().map(|d| d.size_bytes).collect();
    assert_eq!(
        sizes,
        vec![CHUNK as i64, CHUNK as i64, CHUNK as i64, 12_345]
    );
    assert_eq!(split.chunk_digests[0], digest(&big[..CHUNK]));

    // Wrong content for the digest: refused, nothing stored.
    let liar = blob(9, 2 * CHUNK + 1);
    let name = format!("uploads/u-2/{}", blob_name(&liar));
    let mut other = liar.clone();
    other[CHUNK + 5] ^= 1;
    let e = bytestream_write(&s, &name, &other).await.unwrap_err();
    assert!(matches!(e.code(), Code::InvalidArgument), "{e:?}");
    let e = bytestream_read(&s, &blob_name(&liar), 0, 0)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // A small one too (verified by the node).
    let name = format!("uploads/u-2b/{}", blob_name(&liar[..100]));
    let e = bytestream_write(&s, &name, &other[..100]).await;
    assert!(e.is_ok(), "same bytes: {e:?}");
    let name = format!("uploads/u-2c/{}", blob_name(b"small liar"));
    let e = bytestream_write(&s, &name, b"small lie!")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Wrong size: more bytes than declared.
    let small = blob(10, 1000);
    let name = format!("uploads/u-3/blobs/{}/999", digest(&small).hash);
    let e = bytestream_write(&s, &name, &small).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Larger than max_cas_blob_size_bytes.
    let name = format!("uploads/u-4/blobs/{}/{}", digest(&small).hash, 9 << 20);
    let e = bytestream_write(&s, &name, &small).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Unknown instance.
    let name = format!("nosuch/uploads/u-5/{}", blob_name(&small));
    let e = bytestream_write(&s, &name, &small).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // A resumed write: half is sent, the stream ends without
    // finish_write; QueryWriteStatus says how much is committed, and the
    // write resumes there.
    let resumable = blob(11, 2 * CHUNK + 777);
    let name = format!("uploads/u-6/{}", blob_name(&resumable));
    let half = CHUNK + 1000;
    let first = write_requests(&name, &resumable[..half], 0, 64 << 10, false);
    let e = s
        .bytestream()
        .write(tokio_stream::iter(first))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let status = s
        .bytestream()
        .query_write_status(QueryWriteStatusRequest {
            resource_name: name.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (status.committed_size, status.complete),
        (half as i64, false)
    );
    // Another caller (another token) knowing the resource name sees
    // nothing of this upload, and its writes neither restart nor end it.
    fn as_other<T>(message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert("authorization", "Bearer someone-else".parse().unwrap());
        request
    }
    let theirs = s
        .bytestream()
        .query_write_status(as_other(QueryWriteStatusRequest {
            resource_name: name.clone(),
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(theirs.committed_size, 0);
    for (offset, finish) in [(0, false), (half, true)] {
        let attempt = write_requests(&name, &resumable[..offset + 100], offset, 100, finish);
        let e = s
            .bytestream()
            .write(as_other(tokio_stream::iter(attempt)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let status = s
        .bytestream()
        .query_write_status(QueryWriteStatusRequest {
            resource_name: name.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.committed_size, half as i64, "the upload is intact");
    // A resumption this gateway holds nothing of (another gateway's upload,
    // an evicted one): retryable, and QueryWriteStatus then says 0 — the
    // client starts again (INVALID_ARGUMENT ended Bazel's upload for good).
    let elsewhere = format!("uploads/u-8/{}", blob_name(&resumable));
    let e = s
        .bytestream()
        .write(tokio_stream::iter(write_requests(
            &elsewhere,
            &resumable[..half + 100],
            half,
            100,
            true,
        )))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let status = s
        .bytestream()
        .query_write_status(QueryWriteStatusRequest {
            resource_name: elsewhere.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((status.committed_size, status.complete), (0, false));
    // At the wrong offset: refused, the upload survives.
    let wrong = write_requests(&name, &resumable, half + 1, 64 << 10, true);
    let e = s
        .bytestream()
        .write(tokio_stream::iter(wrong))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let rest = write_requests(&name, &resumable, half, 64 << 10, true);
    let committed = s
        .bytestream()
        .write(tokio_stream::iter(rest))
        .await
        .expect("the resumed write completes")
        .into_inner()
        .committed_size;
    assert_eq!(committed, resumable.len() as i64);
    assert_eq!(
        bytestream_read(&s, &blob_name(&resumable), 0, 0)
            .await
            .unwrap(),
        resumable
    );
    let status = s
        .bytestream()
        .query_write_status(QueryWriteStatusRequest {
            resource_name: name.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(status.complete);

    // Early completion: the blob is there, the first message ends it.
    let first_only = write_requests(
        &format!("uploads/u-7/{}", blob_name(&big)),
        &big[..1000],
        0,
        1000,
        false,
    );
    let committed = s
        .bytestream()
        .write(tokio_stream::iter(first_only))
        .await
        .expect("early completion")
        .into_inner()
        .committed_size;
    assert_eq!(committed, big.len() as i64);

    // Two concurrent writes of one new blob (different uploads): both
    // succeed, the blob is stored once and reads back.
    let shared = blob(12, CHUNK + 5);
    let (name_a, name_b) = (
        format!("uploads/a/{}", blob_name(&shared)),
        format!("uploads/b/{}", blob_name(&shared)),
    );
    let (a, b) = tokio::join!(
        bytestream_write(&s, &name_a, &shared),
        bytestream_write(&s, &name_b, &shared),
    );
    assert_eq!(a.unwrap(), shared.len() as i64);
    assert_eq!(b.unwrap(), shared.len() as i64);
    assert_eq!(
        bytestream_read(&s, &blob_name(&shared), 0, 0)
            .await
            .unwrap(),
        shared
    );

    // zstd both ways: a compressed upload is stored decompressed and
    // verified; a compressed read decompresses to the blob; its offset
    // counts uncompressed bytes (REAPI: a client resuming a download asks
    // from what it decompressed) and it takes no limit.
    let text: Vec<u8> = (0..(CHUNK * 2)).map(|i| b"tidepool "[i % 9]).collect();
    let d = digest(&text);
    let compressed = zstd::bulk::compress(&text, 3).unwrap();
    let name = format!(
        "uploads/z/compressed-blobs/zstd/{}/{}",
        d.hash, d.size_bytes
    );
    let committed = s
        .bytestream()
        .write(tokio_stream::iter(write_requests(
            &name,
            &compressed,
            0,
            1000,
            true,
        )))
        .await
        .expect("compressed write")
        .into_inner()
        .committed_size;
    assert_eq!(committed, compressed.len() as i64);
    assert_eq!(
        s.client.get("cache", &Sha256::digest(&text)).await.unwrap(),
        text
    );
    let read_name = format!("compressed-blobs/zstd/{}/{}", d.hash, d.size_bytes);
    let frames = bytestream_read(&s, &read_name, 0, 0).await.unwrap();
    assert_eq!(zstd::stream::decode_all(&frames[..]).unwrap(), text);
    for offset in [1000, CHUNK + 7, text.len() - 1, text.len()] {
        let later = bytestream_read(&s, &read_name, offset as i64, 0)
            .await
            .unwrap();
        assert_eq!(
            zstd::stream::decode_all(&later[..]).unwrap(),
            text[offset..],
            "resumed at {offset}"
        );
    }
    let past = bytestream_read(&s, &read_name, text.len() as i64 + 1, 0)
        .await
        .unwrap_err();
    assert_eq!(past.code(), tonic::Code::OutOfRange, "{past:?}");
    let limited = bytestream_read(&s, &read_name, 0, 10).await.unwrap_err();
    assert_eq!(limited.code(), tonic::Code::InvalidArgument, "{limited:?}");
    // Paused uploads are bounded: beyond 64, the one idle longest is
    // forgotten (its client would start again).
    let mut names = Vec::new();
    for i in 0..65u64 {
        let bytes = blob(500 + i, 1000);
        let name = format!("uploads/p-{i}/{}", blob_name(&bytes));
        let first = write_requests(&name, &bytes[..10], 0, 10, false);
        assert!(
            s.bytestream()
                .write(tokio_stream::iter(first))
                .await
                .is_err()
        );
        names.push(name);
    }
    let committed = |name: String| {
        let mut bytestream = s.bytestream();
        async move {
            bytestream
                .query_write_status(QueryWriteStatusRequest {
                    resource_name: name,
                })
                .await
                .unwrap()
                .into_inner()
                .committed_size
        }
    };
    assert_eq!(
        committed(names[0].clone()).await,
        0,
        "the oldest paused upload was forgotten"
    );
    assert_eq!(committed(names[64].clone()).await, 10);
    assert_eq!(committed(names[1].clone()).await, 10);
    // A compression bomb declared small is refused.
    let bomb = zstd::bulk::compress(&vec![0u8; 4 << 20], 3).unwrap();
    let name = format!(
        "uploads/z2/compressed-blobs/zstd/{}/{}",
        digest(&[0u8; 100]).hash,
        100
    );
    let e = s
        .bytestream()
        .write(tokio_stream::iter(write_requests(
            &name,
            &bomb,
            0,
            1 << 20,
            true,
        )))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // One message of zstd standing for more than the gateway holds at once
    // is stored in pieces.
    let zeros = vec![0u8; 6 << 20];
    let packed = zstd::bulk::compress(&zeros, 3).unwrap();
    let name = format!(
        "uploads/z3/compressed-blobs/zstd/{}/{}",
        digest(&zeros).hash,
        zeros.len()
    );
    s.bytestream()
        .write(tokio_stream::iter(write_requests(
            &name,
            &packed,
            0,
            packed.len(),
            true,
        )))
        .await
        .expect("a compressed upload in one message");
    assert_eq!(
        s.client
            .get("cache", &Sha256::digest(&zeros))
            .await
            .unwrap(),
        zeros
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn action_results_trees_and_splicing() {
    let s = setup(true).await;
    let out = blob(20, 3000);
    let stdout = b"compiled\n".to_vec();
    let in_dir = blob(21, 4000);
    // A tree with one file.
    let root = re::Directory {
        files: vec![re::FileNode {
            name: "lib.a".into(),
            digest: Some(digest(&in_dir)),
            is_executable: false,
            ..Default::default()
        }],
        ..Default::default()
    };
    let tree = re::Tree {
        root: Some(root.clone()),
        children: vec![],
    }
    .encode_to_vec();
    for b in [&out, &stdout, &in_dir, &tree] {
        upload(&s, "", b).await;
    }
    let result = re::ActionResult {
        output_files: vec![re::OutputFile {
            path: "out/a.o".into(),
            digest: Some(digest(&out)),
            ..Default::default()
        }],
        output_directories: vec![re::OutputDirectory {
            path: "out/lib".into(),
            tree_digest: Some(digest(&tree)),
            ..Default::default()
        }],
        stdout_digest: Some(digest(&stdout)),
        exit_code: 0,
        ..Default::default()
    };
    let action = digest(b"the action");
    s.ac()
        .update_action_result(re::UpdateActionResultRequest {
            instance_name: String::new(),
            action_digest: Some(action.clone()),
            action_result: Some(result.clone()),
            ..Default::default()
        })
        .await
        .expect("update");
    let got = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: String::new(),
            action_digest: Some(action.clone()),
            inline_stdout: true,
            inline_output_files: vec!["out/a.o".into()],
            ..Default::default()
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.stdout_raw, stdout);
    assert_eq!(got.output_files[0].contents, out);
    assert_eq!(got.output_directories, result.output_directories);
    // Unknown action.
    let e = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: String::new(),
            action_digest: Some(digest(b"another action")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // A bad digest inside a result is refused.
    let mut bad = result.clone();
    bad.output_files[0].digest = Some(re::Digest {
        hash: "x".into(),
        size_bytes: 1,
    });
    let e = s
        .ac()
        .update_action_result(re::UpdateActionResultRequest {
            instance_name: String::new(),
            action_digest: Some(digest(b"bad")),
            action_result: Some(bad),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // A file inside an output directory disappears: the result is no
    // longer returned.
    assert!(
        s.client
            .delete("cache", &Sha256::digest(&in_dir))
            .await
            .unwrap()
    );
    let e = s
        .ac()
        .get_action_result(re::GetActionResultRequest {
            instance_name: String::new(),
            action_digest: Some(action.clone()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    upload(&s, "", &in_dir).await;
    assert!(
        s.ac()
            .get_action_result(re::GetActionResultRequest {
                instance_name: String::new(),
                action_digest: Some(action.clone()),
                ..Default::default()
            })
            .await
            .is_ok()
    );

    // GetTree, paged: root -> a, b; a -> c.
    let c = re::Directory::default();
    let c_bytes = re::Directory {
        files: vec![re::FileNode {
            name: "c.txt".into(),
            digest: Some(digest(b"c")),
            ..Default::default()
        }],
        ..Default::default()
    };
    let _ = c;
    let c_d = digest(&c_bytes.encode_to_vec());
    let a = re::Directory {
        directories: vec![re::DirectoryNode {
            name: "c".into(),
            digest: Some(c_d.clone()),
        }],
        ..Default::default()
    };
    let b = re::Directory {
        files: vec![re::FileNode {
            name: "b.txt".into(),
            digest: Some(digest(b"b")),
            ..Default::default()
        }],
        ..Default::default()
    };
    let top = re::Directory {
        directories: vec![
            re::DirectoryNode {
                name: "a".into(),
                digest: Some(digest(&a.encode_to_vec())),
            },
            re::DirectoryNode {
                name: "b".into(),
                digest: Some(digest(&b.encode_to_vec())),
            },
        ],
        ..Default::default()
    };
    for d in [&c_bytes, &a, &b, &top] {
        upload(&s, "", &d.encode_to_vec()).await;
    }
    let mut token = String::new();
    let mut seen = Vec::new();
    let mut calls = 0;
    loop {
        let mut stream = s
            .cas()
            .get_tree(re::GetTreeRequest {
                instance_name: String::new(),
                root_digest: Some(digest(&top.encode_to_vec())),
                page_size: 1,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .expect("get tree")
            .into_inner();
        calls += 1;
        // Read one page only, then continue from its token.
        let page = stream.message().await.unwrap().expect("a page");
        assert!(page.directories.len() <= 1);
        seen.extend(page.directories);
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
        assert!(calls < 10);
    }
    assert_eq!(
        seen,
        vec![top.clone(), a.clone(), b.clone(), c_bytes.clone()]
    );
    let e = s
        .cas()
        .get_tree(re::GetTreeRequest {
            instance_name: String::new(),
            root_digest: Some(digest(b"no such directory")),
            ..Default::default()
        })
        .await;
    let e = match e {
        Err(e) => e,
        Ok(r) => r.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(e.code(), Code::NotFound);
    // Directories of about 1.6 MiB each: pages end by bytes, under the send
    // limit (a batch plus 1 MiB), whatever the page size (before, the one
    // page of all four went over it: OUT_OF_RANGE on every call).
    let large: Vec<re::Directory> = (0..3)
        .map(|d| re::Directory {
            files: (0..9_000)
                .map(|f| re::FileNode {
                    name: format!("{d}-{f:0>100}"),
                    digest: Some(digest(b"f")),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    let top = re::Directory {
        directories: large
            .iter()
            .enumerate()
            .map(|(i, d)| re::DirectoryNode {
                name: format!("d{i}"),
                digest: Some(digest(&d.encode_to_vec())),
            })
            .collect(),
        ..Default::default()
    };
    for d in large.iter().chain([&top]) {
        let bytes = d.encode_to_vec();
        assert!(bytes.len() < 2 << 20);
        bytestream_write(&s, &format!("uploads/t/{}", blob_name(&bytes)), &bytes)
            .await
            .unwrap();
    }
    let mut stream = s
        .cas()
        .get_tree(re::GetTreeRequest {
            instance_name: String::new(),
            root_digest: Some(digest(&top.encode_to_vec())),
            ..Default::default()
        })
        .await
        .expect("get tree")
        .into_inner();
    let mut pages = Vec::new();
    while let Some(page) = stream.message().await.expect("a page within the limit") {
        pages.push(page);
    }
    let got: Vec<re::Directory> = pages.iter().flat_map(|p| p.directories.clone()).collect();
    assert_eq!(got, [vec![top.clone()], large.clone()].concat());
    assert!(pages.len() >= 2, "{} pages", pages.len());
    assert!(pages.last().unwrap().next_page_token.is_empty());

    // SpliceBlob: three stored chunks make a new blob, readable whole.
    let parts: Vec<Vec<u8>> = (30..33).map(|i| blob(i, 200_000)).collect();
    for p in &parts {
        upload(&s, "", p).await;
    }
    let whole = parts.concat();
    s.cas()
        .splice_blob(re::SpliceBlobRequest {
            instance_name: String::new(),
            blob_digest: Some(digest(&whole)),
            chunk_digests: parts.iter().map(|p| digest(p)).collect(),
            ..Default::default()
        })
        .await
        .expect("splice");
    assert_eq!(
        bytestream_read(&s, &blob_name(&whole), 0, 0).await.unwrap(),
        whole
    );
    // Chunks in the wrong order do not make the blob.
    let e = s
        .cas()
        .splice_blob(re::SpliceBlobRequest {
            instance_name: String::new(),
            blob_digest: Some(digest(&[&parts[1][..], &parts[0][..]].concat())),
            chunk_digests: vec![digest(&parts[0]), digest(&parts[1])],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // A missing chunk.
    let e = s
        .cas()
        .splice_blob(re::SpliceBlobRequest {
            instance_name: String::new(),
            blob_digest: Some(digest(&[&parts[0][..], b"zz"].concat())),
            chunk_digests: vec![digest(&parts[0]), digest(b"zz")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // A stored chunk named twice with its size, then a thousand times as
    // 0 bytes: the sizes add up, and each chunk is read with its size, so
    // the first one named with a wrong size ends the splice (NOT_FOUND:
    // that digest is not stored). Named by hash only, every one was read
    // whole before the final digest check failed.
    let served = || -> u64 {
        s.cluster
            .nodes
            .iter()
            .flatten()
            .map(|n| n.node.metrics.get_bytes.get())
            .sum()
    };
    // (A chunk over half a node entry, so the two make a blob larger than
    // one: spliced from its chunks, not read into one value.)
    let big = blob(34, 600_000);
    upload(&s, "", &big).await;
    let before = served();
    let mut named = vec![digest(&big), digest(&big)];
    named.extend((0..1000).map(|_| re::Digest {
        size_bytes: 0,
        ..digest(&big)
    }));
    let e = s
        .cas()
        .splice_blob(re::SpliceBlobRequest {
            instance_name: String::new(),
            blob_digest: Some(digest(&[&big[..], &big[..]].concat())),
            chunk_digests: named,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let read = served() - before;
    assert!(read <= 4 * 600_000, "{read} bytes read for the splice");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_cache() {
    let s = setup(false).await;
    let at = s.gateway.http_address;
    let auth = Some("Bearer any-token-the-open-cluster-accepts");
    let content = blob(40, 2 * CHUNK + 3);
    let h = hex(&Sha256::digest(&content));
    // Without a credential: 401.
    assert_eq!(
        http(at, "GET", &format!("/cas/{h}"), None, vec![]).await.0,
        401
    );
    assert_eq!(
        http(at, "GET", &format!("/cas/{h}"), auth, vec![]).await.0,
        404
    );
    assert_eq!(
        http(at, "PUT", &format!("/cas/{h}"), auth, content.clone())
            .await
            .0,
        200
    );
    let (code, body) = http(at, "GET", &format!("/cas/{h}"), auth, vec![]).await;
    assert_eq!((code, body.len()), (200, content.len()));
    assert!(body == content);
    assert_eq!(
        http(at, "HEAD", &format!("/cas/{h}"), auth, vec![]).await.0,
        200
    );
    // Content that does not hash to the name.
    let other = hex(&Sha256::digest(b"other"));
    assert_eq!(
        http(
            at,
            "PUT",
            &format!("/cas/{other}"),
            auth,
            b"not other".to_vec()
        )
        .await
        .0,
        400
    );
    assert_eq!(
        http(at, "HEAD", &format!("/cas/{other}"), auth, vec![])
            .await
            .0,
        404
    );
    // `/cas/X` where X is no SHA-256 is a path key (ccache's `subdirs`
    // layout makes such paths), absent here.
    assert_eq!(http(at, "GET", "/cas/nothex", auth, vec![]).await.0, 404);
    // Basic authentication with the token as the password.
    use base64::Engine as _;
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("ci:token")
    );
    assert_eq!(
        http(at, "GET", &format!("/cas/{h}"), Some(&basic), vec![])
            .await
            .0,
        200
    );

    // The action cache: an ActionResult whose output is gone is not
    // returned; other bytes are returned as they are.
    let output = blob(41, 100);
    let result = re::ActionResult {
        output_files: vec![re::OutputFile {
            path: "o".into(),
            digest: Some(digest(&output)),
            ..Default::default()
        }],
        ..Default::default()
    };
    let action = hex(&Sha256::digest(b"http action"));
    assert_eq!(
        http(
            at,
            "PUT",
            &format!("/ac/{action}"),
            auth,
            result.encode_to_vec()
        )
        .await
        .0,
        200
    );
    assert_eq!(
        http(at, "GET", &format!("/ac/{action}"), auth, vec![])
            .await
            .0,
        404
    );
    // HEAD says what GET would.
    assert_eq!(
        http(at, "HEAD", &format!("/ac/{action}"), auth, vec![])
            .await
            .0,
        404
    );
    let oh = hex(&Sha256::digest(&output));
    assert_eq!(
        http(at, "PUT", &format!("/cas/{oh}"), auth, output.clone())
            .await
            .0,
        200
    );
    let (code, body) = http(at, "GET", &format!("/ac/{action}"), auth, vec![]).await;
    assert_eq!((code, body), (200, result.encode_to_vec()));
    assert_eq!(
        http(at, "HEAD", &format!("/ac/{action}"), auth, vec![])
            .await
            .0,
        200
    );
    // The empty blob's name with a body that is not empty.
    let empty = hex(&Sha256::digest(b""));
    assert_eq!(
        http(at, "PUT", &format!("/cas/{empty}"), auth, b"x".to_vec())
            .await
            .0,
        400
    );
    assert_eq!(
        http(at, "PUT", &format!("/cas/{empty}"), auth, Vec::new())
            .await
            .0,
        200
    );
    let opaque = hex(&Sha256::digest(b"ccache entry"));
    assert_eq!(
        http(
            at,
            "PUT",
            &format!("/ac/{opaque}"),
            auth,
            b"cCrS opaque".to_vec()
        )
        .await
        .0,
        200
    );
    assert_eq!(
        http(at, "GET", &format!("/ac/{opaque}"), auth, vec![])
            .await
            .1,
        b"cCrS opaque"
    );

    // Path keys (ccache layouts), mutable; an instance as first segment.
    assert_eq!(
        http(at, "PUT", "/ccache/ab/cdef", auth, b"v1".to_vec())
            .await
            .0,
        200
    );
    assert_eq!(
        http(at, "PUT", "/ccache/ab/cdef", auth, b"v2".to_vec())
            .await
            .0,
        200
    );
    assert_eq!(
        http(at, "GET", "/ccache/ab/cdef", auth, vec![]).await,
        (200, b"v2".to_vec())
    );
    assert_eq!(
        http(at, "PUT", "/ci/x/y", auth, b"in ci".to_vec()).await.0,
        200
    );
    assert_eq!(s.client.get("ci.ac", b"/x/y").await.unwrap(), b"in ci");
    assert_eq!(
        s.client.get("cache.ac", b"/ccache/ab/cdef").await.unwrap(),
        b"v2"
    );
    assert_eq!(
        http(at, "PUT", &format!("/ci/cas/{h}"), auth, content.clone())
            .await
            .0,
        200
    );
    assert!(
        s.client
            .exists("ci", &Sha256::digest(&content))
            .await
            .unwrap()
    );
    assert_eq!(
        http(at, "DELETE", "/ccache/ab/cdef", auth, vec![]).await.0,
        200
    );
    assert_eq!(
        http(at, "DELETE", "/ccache/ab/cdef", auth, vec![]).await.0,
        404
    );
    assert_eq!(
        http(at, "GET", "/ccache/ab/cdef", auth, vec![]).await.0,
        404
    );
    assert_eq!(
        http(at, "POST", "/ccache/ab/cdef", auth, vec![]).await.0,
        405
    );
    s.stop().await;
}

/// With its own certificate the gateway serves both protocols over TLS
/// (clients present no certificate; they authenticate with tokens), and
/// refuses plaintext.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_serves_tls() {
    use tidepool_security::certs;
    let cluster = LocalCluster::start(3, 2, 3).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = certs::new_ca("gateway test", Duration::from_secs(3600)).unwrap();
    let issued = certs::issue(
        &ca,
        &certs::Request {
            identity: tidepool_security::Identity::Server("gateway".into()),
            hosts: vec!["localhost".into(), "127.0.0.1".into()],
            valid_for: Duration::from_secs(3600),
            expired: false,
        },
    )
    .unwrap();
    let (cert, key) = certs::write(dir.path(), "gateway", &issued).unwrap();
    let mut config = GatewayConfig::new(ClientConfig::new(std::slice::from_ref(&cluster.url)));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = true;
    config.serve_tls = Some(tidepool_gateway::ServeTls { cert, key });
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let gateway = tidepool_gateway::start(config).await.expect("starts");
    gateway.create_instance("cache", 3).await.unwrap();

    // The served certificate's expiry is exported (an hour from now).
    let (status, text) = http(
        gateway.metrics_address.unwrap(),
        "GET",
        "/metrics",
        None,
        Vec::new(),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8(text).unwrap();
    let line = text
        .lines()
        .find(|l| {
            l.starts_with("tidepool_tls_certificate_expiry_timestamp_seconds")
                && l.contains("certificate=\"serving\"")
        })
        .unwrap_or_else(|| panic!("no serving certificate expiry in:\n{text}"));
    let at: i64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (now + 3_000..=now + 3_700).contains(&at),
        "{line} (now {now})"
    );

    // gRPC over TLS, verified against the CA.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&ca.cert_pem))
        .domain_name("localhost");
    let channel =
        Channel::from_shared(format!("https://localhost:{}", gateway.grpc_address.port()))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .expect("a TLS connection");
    let caps = CapabilitiesClient::new(channel.clone())
        .get_capabilities(re::GetCapabilitiesRequest {
            instance_name: String::new(),
        })
        .await
        .expect("capabilities over TLS");
    assert!(caps.into_inner().cache_capabilities.is_some());
    // Plaintext to the TLS port: no answer.
    let plain = Channel::from_shared(format!("http://{}", gateway.grpc_address))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await;
    if let Ok(plain) = plain {
        assert!(
            CapabilitiesClient::new(plain)
                .get_capabilities(re::GetCapabilitiesRequest {
                    instance_name: String::new()
                })
                .await
                .is_err()
        );
    }

    // HTTPS: a PUT and a GET through rustls.
    let mut roots = rustls::RootCertStore::empty();
    for c in tidepool_security::tls::certificates(ca.cert_pem.as_bytes()).unwrap() {
        roots.add(c).unwrap();
    }
    let client_config = rustls::ClientConfig::builder_with_provider(tidepool_security::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client_config));
    let body = b"over https".to_vec();
    let h = hex(&Sha256::digest(&body));
    for (method, payload) in [("PUT", body.clone()), ("GET", Vec::new())] {
        let tcp = tokio::net::TcpStream::connect(gateway.http_address)
            .await
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let stream = connector.connect(name, tcp).await.expect("TLS handshake");
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        let request = http::Request::builder()
            .method(method)
            .uri(format!("/cas/{h}"))
            .header("host", "localhost")
            .body(Full::new(bytes::Bytes::from(payload)))
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200, "{method}");
        let got = response.into_body().collect().await.unwrap().to_bytes();
        if method == "GET" {
            assert_eq!(&got[..], &body[..]);
        }
    }
    gateway.stop().await;
    cluster.stop().await;
}

/// A gateway serving restic for `s`'s cluster with `append_only` and
/// `private_repos`; its restic address.
async fn restic_gateway(
    s: &Setup,
    append_only: bool,
    private_repos: bool,
) -> (RunningGateway, std::net::SocketAddr) {
    let mut config = GatewayConfig::new(ClientConfig::new(std::slice::from_ref(&s.cluster.url)));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = true;
    let mut restic = tidepool_gateway::ResticConfig::new("127.0.0.1:0".parse().unwrap());
    restic.append_only = append_only;
    restic.private_repos = private_repos;
    config.restic = Some(restic);
    let gateway = tidepool_gateway::start(config).await.expect("starts");
    gateway
        .create_restic_namespaces()
        .await
        .expect("namespaces");
    let address = gateway.restic_address.expect("restic served");
    (gateway, address)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restic_rest_protocol() {
    let s = setup(true).await;
    let (gateway, at) = restic_gateway(&s, false, false).await;
    let object = |content: &[u8]| (hex(&Sha256::digest(content)), content.to_vec());
    let v2 = [("accept", "application/vnd.x.restic.rest.v2")];
    assert_eq!(
        http(at, "POST", "/team/r/?create=true", None, vec![])
            .await
            .0,
        200
    );
    assert_eq!(
        http(at, "HEAD", "/team/r/config", None, vec![]).await.0,
        404
    );
    assert_eq!(
        http(at, "POST", "/team/r/config", None, b"cfg".to_vec())
            .await
            .0,
        200
    );
    // The same config again is a retry whose answer was lost: 200; another
    // is refused (never overwritten, in any mode: rest-server's rule; a
    // second `init` racing the first locked it out of its repository).
    assert_eq!(
        http(at, "POST", "/team/r/config", None, b"cfg".to_vec())
            .await
            .0,
        200
    );
    assert_eq!(
        http(at, "POST", "/team/r/config", None, b"other".to_vec())
            .await
            .0,
        403
    );
    let (status, body) = http(at, "GET", "/team/r/config", None, vec![]).await;
    assert_eq!((status, body), (200, b"cfg".to_vec()));
    let (first, second) = tokio::join!(
        http(
            at,
            "POST",
            "/team/open-race/config",
            None,
            b"first".to_vec()
        ),
        http(
            at,
            "POST",
            "/team/open-race/config",
            None,
            b"second".to_vec()
        )
    );
    let mut statuses = [first.0, second.0];
    statuses.sort();
    assert_eq!(statuses, [200, 403], "two inits, one config");
    // Objects: verified against their names, listed v2 and v1, ranged.
    let (name, content) = object(b"a pack of bytes");
    let path = format!("/team/r/data/{name}");
    assert_eq!(http(at, "POST", &path, None, content.clone()).await.0, 200);
    let (wrong, _) = object(b"other bytes");
    let (status, _) = http(
        at,
        "POST",
        &format!("/team/r/data/{wrong}"),
        None,
        content.clone(),
    )
    .await;
    assert_eq!(status, 400, "an object must hash to its name");
    // Stored already: the same bytes again are 200, other bytes under its
    // name 400 (as for a new object), and nothing changes.
    assert_eq!(http(at, "POST", &path, None, content.clone()).await.0, 200);
    assert_eq!(
        http(at, "POST", &path, None, b"other bytes".to_vec())
            .await
            .0,
        400
    );
    assert_eq!(
        http(at, "GET", &path, None, vec![]).await,
        (200, content.clone())
    );
    // Bytes written around the gateway under an object's name that are
    // not its content are replaced by an upload of the right ones.
    let (fixed, fixed_content) = object(b"repaired");
    let fixed_path = format!("/team/r/snapshots/{fixed}");
    s.client
        .put(
            "restic",
            format!("team/r/snapshots/{fixed}").as_bytes(),
            b"damaged",
        )
        .await
        .unwrap();
    assert_eq!(
        http(at, "POST", &fixed_path, None, fixed_content.clone())
            .await
            .0,
        200
    );
    assert_eq!(
        http(at, "GET", &fixed_path, None, vec![]).await,
        (200, fixed_content)
    );
    assert_eq!(
        http(at, "HEAD", &format!("/team/r/data/{wrong}"), None, vec![])
            .await
            .0,
        404
    );
    let (status, headers, body) = http_with(at, "GET", "/team/r/data/", &v2, vec![]).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/vnd.x.restic.rest.v2");
    let listed: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        listed,
        serde_json::json!([{"name": name, "size": content.len()}])
    );
    let (_, headers, body) = http_with(at, "GET", "/team/r/data/", &[], vec![]).await;
    assert_eq!(headers["content-type"], "application/vnd.x.restic.rest.v1");
    let listed: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(listed, serde_json::json!([name]));
    // A nested repository's objects are not the outer one's.
    let (inner, inner_content) = object(b"nested");
    let inner_path = format!("/team/r/data/data/{inner}");
    assert_eq!(
        http(at, "POST", &inner_path, None, inner_content).await.0,
        200
    );
    let (_, _, body) = http_with(at, "GET", "/team/r/data/", &v2, vec![]).await;
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let (status, headers, body) =
        http_with(at, "GET", &path, &[("range", "bytes=2-5")], vec![]).await;
    assert_eq!((status, body.as_slice()), (206, &content[2..6]));
    assert_eq!(
        headers["content-range"],
        format!("bytes 2-5/{}", content.len())
    );
    let (status, _, _) = http_with(at, "GET", &path, &[("range", "bytes=99-")], vec![]).await;
    assert_eq!(status, 416);
    // A range this server does not take is ignored (RFC 9110): the
    // object whole. Before: 416.
    for ignored in ["bytes=5-2", "items=0-1", "bytes=0-1,3-4"] {
        let (status, _, body) = http_with(at, "GET", &path, &[("range", ignored)], vec![]).await;
        assert_eq!((status, &body), (200, &content), "{ignored}");
    }
    // Locks live in their own namespace; deletes answer 200, and again
    // once the lock is gone (a retried delete whose first answer was lost
    // found nothing: a 404 there failed restic's prune and unlock).
    let (lock, lock_content) = object(b"a lock");
    let lock_path = format!("/team/r/locks/{lock}");
    assert_eq!(
        http(at, "POST", &lock_path, None, lock_content).await.0,
        200
    );
    assert!(
        s.client
            .exists("restic.locks", format!("team/r/locks/{lock}").as_bytes())
            .await
            .unwrap()
    );
    assert_eq!(http(at, "DELETE", &lock_path, None, vec![]).await.0, 200);
    assert_eq!(http(at, "DELETE", &lock_path, None, vec![]).await.0, 200);
    assert_eq!(http(at, "HEAD", &lock_path, None, vec![]).await.0, 404);
    // A method a path does not take: 405, naming those it does.
    let (status, headers, _) = http_with(at, "PUT", "/team/r/config", &[], vec![]).await;
    assert_eq!(status, 405);
    assert_eq!(headers["allow"], "HEAD, GET, POST, DELETE");
    let (status, headers, _) = http_with(at, "DELETE", "/team/r/data/", &[], vec![]).await;
    assert_eq!(status, 405);
    assert_eq!(headers["allow"], "GET");
    // Bad paths.
    assert_eq!(
        http(at, "GET", "/team/r/data/NOTHEX", None, vec![]).await.0,
        400
    );
    assert_eq!(
        http(at, "GET", "/team/../config", None, vec![]).await.0,
        400
    );
    assert_eq!(
        http(at, "GET", "/team/r/unknown/", None, vec![]).await.0,
        404
    );
    gateway.stop().await;

    // Append-only: objects are added, never overwritten or deleted, but
    // locks still come and go.
    let (gateway, at) = restic_gateway(&s, true, false).await;
    let (other, other_content) = object(b"appended later");
    let other_path = format!("/team/r/data/{other}");
    assert_eq!(
        http(at, "POST", &other_path, None, other_content.clone())
            .await
            .0,
        200
    );
    // The same object again (a retry whose answer was lost) is no
    // overwrite: 200, which restic needs to go on (it gives up on a 403).
    assert_eq!(
        http(at, "POST", &other_path, None, other_content).await.0,
        200
    );
    assert_eq!(
        http(at, "POST", &other_path, None, b"not it".to_vec())
            .await
            .0,
        400
    );
    // Other bytes stored under an object's name stay: no overwrite here.
    let (kept, kept_content) = object(b"kept as it is");
    s.client
        .put(
            "restic",
            format!("team/r/index/{kept}").as_bytes(),
            b"written around the gateway",
        )
        .await
        .unwrap();
    assert_eq!(
        http(
            at,
            "POST",
            &format!("/team/r/index/{kept}"),
            None,
            kept_content
        )
        .await
        .0,
        403
    );
    assert_eq!(http(at, "DELETE", &path, None, vec![]).await.0, 403);
    assert_eq!(
        http(at, "POST", "/team/r/config", None, b"new".to_vec())
            .await
            .0,
        403
    );
    // Two racing `init`s of one new repository: one config is stored, the
    // other refused (an existence check before the put let both through).
    for round in 0..5 {
        let path = format!("/team/race{round}/config");
        let (first, second) = tokio::join!(
            http(at, "POST", &path, None, b"first".to_vec()),
            http(at, "POST", &path, None, b"second".to_vec())
        );
        let mut statuses = [first.0, second.0];
        statuses.sort();
        assert_eq!(statuses, [200, 403], "round {round}");
        let stored = http(at, "GET", &path, None, vec![]).await;
        let winner: &[u8] = if first.0 == 200 { b"first" } else { b"second" };
        assert_eq!(stored, (200, winner.to_vec()), "round {round}");
    }
    let (lock, lock_content) = object(b"another lock");
    let lock_path = format!("/team/r/locks/{lock}");
    assert_eq!(
        http(at, "POST", &lock_path, None, lock_content).await.0,
        200
    );
    assert_eq!(http(at, "DELETE", &lock_path, None, vec![]).await.0, 200);
    assert_eq!(http(at, "HEAD", &path, None, vec![]).await.0, 200);
    gateway.stop().await;

    // Private repositories: the first segment must be the Basic user.
    let (gateway, at) = restic_gateway(&s, false, true).await;
    let basic = |user: &str| {
        use base64::Engine as _;
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:token"))
        )
    };
    let (status, _) = http(at, "HEAD", "/team/r/config", Some(&basic("team")), vec![]).await;
    // (The token is not a real one: the gateway allows anonymous callers
    // here, so the request is refused by the cluster, not the path rule.)
    assert_ne!(status, 403, "team may use /team/...");
    let (status, _) = http(
        at,
        "HEAD",
        "/team/r/config",
        Some(&basic("mallory")),
        vec![],
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = http(at, "HEAD", "/team/r/config", None, vec![]).await;
    assert_eq!(status, 401);
    gateway.stop().await;
    s.stop().await;
}

/// A restic namespace made to expire blobs (restic writes a pack once and
/// never touches it: a backup would lose its data) or content-addressed
/// is refused: the gateway does not start, and a gateway already serving
/// answers 500 once the map says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restic_namespace_that_expires_is_refused() {
    let s = setup(true).await;
    let (gateway, at) = restic_gateway(&s, false, false).await;
    gateway.check_restic_namespaces().expect("made durable");
    let (name, content) = (hex(&Sha256::digest(b"pack")), b"pack".to_vec());
    let path = format!("/backups/r/data/{name}");
    s.client
        .create_namespace("backups", false, RetentionPolicy::Epochs(2))
        .await
        .unwrap();
    s.client
        .create_namespace("backups.locks", false, RetentionPolicy::Durable)
        .await
        .unwrap();
    let mut config = GatewayConfig::new(ClientConfig::new(std::slice::from_ref(&s.cluster.url)));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = true;
    let mut restic = tidepool_gateway::ResticConfig::new("127.0.0.1:0".parse().unwrap());
    restic.namespace = "backups".into();
    config.restic = Some(restic);
    let expiring = tidepool_gateway::start(config).await.expect("starts");
    let error = expiring.check_restic_namespaces().unwrap_err().to_string();
    assert!(error.contains("\"backups\" drops blobs"), "{error}");
    let expiring_at = expiring.restic_address.unwrap();
    let (status, body) = http(expiring_at, "POST", &path, None, content.clone()).await;
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
    assert!(
        !s.client
            .exists("backups", &path.as_bytes()[1..])
            .await
            .unwrap()
    );
    expiring.stop().await;
    // The fit gateway still serves, and one whose namespace is
    // content-addressed is refused too.
    assert_eq!(
        http(at, "POST", &format!("/r/data/{name}"), None, content)
            .await
            .0,
        200
    );
    s.client
        .create_namespace("digests", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let mut config = GatewayConfig::new(ClientConfig::new(std::slice::from_ref(&s.cluster.url)));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = true;
    let mut restic = tidepool_gateway::ResticConfig::new("127.0.0.1:0".parse().unwrap());
    restic.namespace = "digests".into();
    config.restic = Some(restic);
    let addressed = tidepool_gateway::start(config).await.expect("starts");
    let error = addressed.check_restic_namespaces().unwrap_err().to_string();
    assert!(error.contains("content-addressed"), "{error}");
    addressed.stop().await;
    gateway.stop().await;
    s.stop().await;
}

/// A listing the cluster refuses at once is answered with the refusal's
/// status (here: the restic namespaces were never made), not 200 and a
/// body cut short — which restic took for a broken connection, and
/// retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restic_listing_refused_at_once_gets_its_status() {
    let s = setup(true).await;
    let mut config = GatewayConfig::new(ClientConfig::new(std::slice::from_ref(&s.cluster.url)));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = true;
    config.restic = Some(tidepool_gateway::ResticConfig::new(
        "127.0.0.1:0".parse().unwrap(),
    ));
    let gateway = tidepool_gateway::start(config).await.expect("starts");
    let at = gateway.restic_address.expect("restic served");
    let (status, body) = http(at, "GET", "/team/r/locks/", None, vec![]).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    gateway.stop().await;
    s.stop().await;
}

/// A write stream that stays open and sends nothing is ended after the
/// body idle bound (`DEADLINE_EXCEEDED`), not held for as long as its
/// client likes with what it sent so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_write_stream_is_ended() {
    let s = setup_with(true, |c| {
        c.http_limits.body_idle = Duration::from_millis(500);
    })
    .await;
    let bytes = blob(12, 1000);
    let name = format!("uploads/u-silent/{}", blob_name(&bytes));
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(write_requests(&name, &bytes[..10], 0, 10, false).remove(0))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let e = s
        .bytestream()
        .write(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(tx);
    s.stop().await;
}
