//! Hostile clients, roles, revocation and certificate rotation against a
//! real cluster of processes running as production does: mutual TLS on
//! every connection (etcd included), bearer tokens, per-method planes.
//!
//! Every attack of issue 32's report is made with the credential an
//! attacker could hold — a client certificate of the cluster's CA with a
//! token (even an admin one), or a node's own certificate speaking for
//! another node — and must be refused with its stable code; afterwards
//! every acknowledged blob is read back and the cluster still serves.

use std::time::{Duration, Instant};

use prost011::Message as _;
use tidepool_client::proto::v1::blob_service_client::BlobServiceClient;
use tidepool_client::proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_client::proto::v1::node_admin_client::NodeAdminClient;
use tidepool_client::proto::v1::raft_transport_client::RaftTransportClient;
use tidepool_client::proto::v1::{
    self as pb, AdvanceEpochRequest, BatchExistsRequest, BlobRef, CloseReplicaRequest,
    DropEpochsOp, ErrorCode, FetchSnapshotRequest, GetClusterMapRequest, HeadRequest,
    HeartbeatRequest, NodeStatus, OpenReplicaRequest, ProposeAdminRequest, RaftBatch, RaftEnvelope,
    RegisterNodeRequest, Role, SetRetentionRequest, ShardInfo, TokenGrant,
};
use tidepool_client::{Client, RetentionPolicy};
use tidepool_e2e::cluster::{Cluster, Options};
use tidepool_security::certs::{self, Request};
use tidepool_security::{Channel, Identity, Security, Tls, TlsFiles};
use tonic::Status;

/// One cluster at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn code(status: &Status) -> ErrorCode {
    tidepool_client::proto::error_detail(status)
        .map(|d| d.code())
        .unwrap_or(ErrorCode::Unspecified)
}

fn node_url(cluster: &Cluster, i: usize) -> String {
    format!("https://127.0.0.1:{}", cluster.nodes[i].port)
}

/// A channel to `url` presenting certificate `base` and `token`.
async fn channel(cluster: &Cluster, files: TlsFiles, token: Option<&str>, url: &str) -> Channel {
    let security = Security {
        tls: Some(Tls::load(files).expect("TLS material")),
        token: token.map(str::to_string),
    };
    let endpoint = security
        .endpoint(url)
        .expect("url")
        .connect_timeout(Duration::from_secs(3));
    let _ = cluster;
    security.connect(&endpoint).await.expect("connects")
}

async fn as_cert(cluster: &Cluster, base: &str, token: Option<&str>, url: &str) -> Channel {
    channel(cluster, cluster.credentials.files(base), token, url).await
}

/// A client with `token` and the client certificate.
async fn client_with(cluster: &Cluster, token: &str) -> Client {
    let seeds = vec![cluster.coordinators[0].url.clone()];
    let mut config = cluster.credentials.client_config(&seeds);
    config.token = Some(token.to_string());
    config.timeout = Duration::from_secs(10);
    Client::with_config(config).await.expect("client connects")
}

fn expect_code<T: std::fmt::Debug>(what: &str, result: Result<T, Status>, wanted: ErrorCode) {
    match result {
        Ok(value) => panic!("{what}: accepted ({value:?}), wanted {wanted:?}"),
        Err(status) => assert_eq!(code(&status), wanted, "{what}: {status:?}"),
    }
}

/// A Raft heartbeat claiming to come from node `from` at a huge term.
fn forged_raft_message(from: u64, to: u64) -> Vec<u8> {
    let mut message = raft::eraftpb::Message::default();
    message.set_msg_type(raft::eraftpb::MessageType::MsgHeartbeat);
    message.from = from;
    message.to = to;
    message.term = 1_000_000;
    message.encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_are_refused_and_nothing_is_lost() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options::default()).await;
    let admin = cluster.client().await;
    let admin_token = cluster.credentials.token.clone();
    admin
        .create_namespace("private", false, RetentionPolicy::Durable)
        .await
        .unwrap();
    let (app_token, _) = admin
        .create_token(
            "app",
            false,
            vec![TokenGrant {
                namespace: "default".into(),
                roles: vec![Role::Read as i32, Role::Write as i32],
            }],
        )
        .await
        .unwrap();
    // What must survive.
    let mut acknowledged = Vec::new();
    for i in 0..40u32 {
        let key = format!("kept-{i}").into_bytes();
        let value = format!("value {i}").repeat(50).into_bytes();
        admin.put("default", &key, &value).await.unwrap();
        admin.put("private", &key, &value).await.unwrap();
        acknowledged.push((key, value));
    }
    let map = admin.map();
    let coordinator = cluster.coordinators[0].url.clone();

    // 1. Node admin methods with a client certificate, even with the admin
    //    token: close every replica, found a rogue shard, drop a durable
    //    namespace's entries.
    for i in 0..cluster.nodes.len() {
        let url = node_url(&cluster, i);
        for token in [app_token.as_str(), admin_token.as_str()] {
            let mut node =
                NodeAdminClient::new(as_cert(&cluster, "client", Some(token), &url).await);
            for shard in &map.shards {
                expect_code(
                    "CloseReplica from a client",
                    node.close_replica(CloseReplicaRequest {
                        shard_id: shard.shard_id,
                        map_version: 0,
                        node_id: 0,
                        conf_version: 0,
                    })
                    .await,
                    ErrorCode::PermissionDenied,
                );
            }
            expect_code(
                "OpenReplica of shard 0 from a client",
                node.open_replica(OpenReplicaRequest {
                    shard: Some(ShardInfo {
                        shard_id: 0,
                        hash_start: 0,
                        hash_end: u64::MAX,
                        ..ShardInfo::default()
                    }),
                    bootstrap: true,
                })
                .await,
                ErrorCode::PermissionDenied,
            );
            expect_code(
                "ProposeAdmin DropEpochs from a client",
                node.propose_admin(ProposeAdminRequest {
                    shard_id: map.shards[0].shard_id,
                    op: Some(pb::propose_admin_request::Op::DropEpochs(DropEpochsOp {
                        namespace_id: 1,
                        below: 1_000,
                    })),
                })
                .await,
                ErrorCode::PermissionDenied,
            );
        }
        // A node's certificate is no coordinator's either.
        let mut as_peer = NodeAdminClient::new(as_cert(&cluster, "node-2", None, &url).await);
        expect_code(
            "CloseReplica from a node",
            as_peer
                .close_replica(CloseReplicaRequest {
                    shard_id: map.shards[0].shard_id,
                    map_version: 0,
                    node_id: 0,
                    conf_version: 0,
                })
                .await,
            ErrorCode::PermissionDenied,
        );
    }

    // 2. Raft traffic: from a client, refused outright; from node 2's
    //    certificate speaking as node 3, every message dropped.
    let url = node_url(&cluster, 0);
    let shard = map.shards[0].shard_id;
    let batch = |from: u64| RaftBatch {
        from_node: from,
        to_node: 1,
        messages: vec![RaftEnvelope {
            shard_id: shard,
            message: forged_raft_message(from, 1),
        }],
    };
    let mut raft_client =
        RaftTransportClient::new(as_cert(&cluster, "client", Some(&admin_token), &url).await);
    expect_code(
        "Raft Send from a client",
        raft_client.send(tokio_stream::iter(vec![batch(3)])).await,
        ErrorCode::PermissionDenied,
    );
    expect_code(
        "FetchSnapshot from a client",
        raft_client
            .fetch_snapshot(FetchSnapshotRequest {
                shard_id: shard,
                snapshot_id: 1,
                to_node: 2,
                ..FetchSnapshotRequest::default()
            })
            .await
            .map(|_| ()),
        ErrorCode::PermissionDenied,
    );
    let mut impostor = RaftTransportClient::new(as_cert(&cluster, "node-2", None, &url).await);
    let summary = impostor
        .send(tokio_stream::iter(vec![batch(3), batch(3)]))
        .await
        .expect("the stream is accepted; its messages are not")
        .into_inner();
    assert_eq!(summary.delivered, 0, "{summary:?}");
    assert_eq!(summary.dropped, 2, "{summary:?}");
    expect_code(
        "FetchSnapshot for another node",
        impostor
            .fetch_snapshot(FetchSnapshotRequest {
                shard_id: shard,
                snapshot_id: 1,
                to_node: 3,
                ..FetchSnapshotRequest::default()
            })
            .await
            .map(|_| ()),
        ErrorCode::PermissionDenied,
    );

    // 3. Registration: a client cannot re-register node 1 under its own
    //    address; node 2's certificate cannot either, nor heartbeat for it.
    let hijack = RegisterNodeRequest {
        node_id: 1,
        address: "https://203.0.113.9:7401".into(),
        ..RegisterNodeRequest::default()
    };
    let mut c = CoordinatorServiceClient::new(
        as_cert(&cluster, "client", Some(&admin_token), &coordinator).await,
    );
    expect_code(
        "RegisterNode from a client",
        c.register_node(hijack.clone()).await,
        ErrorCode::PermissionDenied,
    );
    let mut c2 =
        CoordinatorServiceClient::new(as_cert(&cluster, "node-2", None, &coordinator).await);
    expect_code(
        "RegisterNode of node 1 by node 2's certificate",
        c2.register_node(hijack).await,
        ErrorCode::PermissionDenied,
    );
    expect_code(
        "Heartbeat of node 1 by node 2's certificate",
        c2.heartbeat(HeartbeatRequest {
            status: Some(NodeStatus {
                node_id: 1,
                ..NodeStatus::default()
            }),
            cluster_id: String::new(),
        })
        .await,
        ErrorCode::PermissionDenied,
    );

    // 4. Cluster admin with a client token; the durable one-way door even
    //    for an admin.
    let mut app_c = CoordinatorServiceClient::new(
        as_cert(&cluster, "client", Some(&app_token), &coordinator).await,
    );
    expect_code(
        "SetRetention with a client token",
        app_c
            .set_retention(SetRetentionRequest {
                name: "private".into(),
                retention: Some(RetentionPolicy::Epochs(1).into()),
            })
            .await,
        ErrorCode::PermissionDenied,
    );
    expect_code(
        "AdvanceEpoch with a client token",
        app_c.advance_epoch(AdvanceEpochRequest::default()).await,
        ErrorCode::PermissionDenied,
    );
    expect_code(
        "SetRetention durable -> expiring, as admin",
        c.set_retention(SetRetentionRequest {
            name: "private".into(),
            retention: Some(RetentionPolicy::Epochs(1).into()),
        })
        .await,
        ErrorCode::InvalidArgument,
    );
    // The map a client gets carries no token hashes.
    let served = app_c
        .get_cluster_map(GetClusterMapRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(served.tokens.is_empty(), "token hashes leak to clients");

    // 5. Tokens: another namespace, none, garbage, unknown.
    let app = client_with(&cluster, &app_token).await;
    assert_eq!(
        app.put("private", b"x", b"y").await.unwrap_err().code(),
        ErrorCode::PermissionDenied
    );
    assert_eq!(
        app.get("private", b"kept-1").await.unwrap_err().code(),
        ErrorCode::PermissionDenied
    );
    app.put("default", b"app-wrote", b"fine").await.unwrap();
    let head = HeadRequest {
        blob: Some(BlobRef {
            namespace: "default".into(),
            key: b"kept-1".to_vec(),
        }),
        ..HeadRequest::default()
    };
    let mut anonymous = BlobServiceClient::new(as_cert(&cluster, "client", None, &url).await);
    expect_code(
        "Head without a token",
        anonymous.head(head.clone()).await,
        ErrorCode::Unauthenticated,
    );
    let forged = tidepool_security::token::generate();
    let mut unknown =
        BlobServiceClient::new(as_cert(&cluster, "client", Some(&forged), &url).await);
    expect_code(
        "Head with an unknown token",
        unknown.head(head.clone()).await,
        ErrorCode::Unauthenticated,
    );
    // A node certificate is no client credential.
    let mut node_as_client = BlobServiceClient::new(as_cert(&cluster, "node-2", None, &url).await);
    expect_code(
        "Head with a node certificate and no token",
        node_as_client.head(head.clone()).await,
        ErrorCode::Unauthenticated,
    );

    // 6. Oversized requests are refused before they are buffered.
    let mut app_blob =
        BlobServiceClient::new(as_cert(&cluster, "client", Some(&app_token), &url).await);
    let flood = BatchExistsRequest {
        namespace: "default".into(),
        keys: vec![Vec::new(); 10_000_000],
        ..BatchExistsRequest::default()
    };
    let refused = app_blob.batch_exists(flood).await.unwrap_err();
    assert!(
        matches!(
            refused.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted | tonic::Code::InvalidArgument
        ),
        "{refused:?}"
    );

    // 7. The wrong transport credentials never get a gRPC answer: plaintext,
    //    a certificate of another CA, an expired certificate.
    let plaintext = tonic::transport::Endpoint::from_shared(url.replace("https://", "http://"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2));
    let plain = async {
        let channel = plaintext.connect().await?;
        BlobServiceClient::new(channel)
            .head(head.clone())
            .await
            .map_err(|s| Box::new(s) as Box<dyn std::error::Error + Send + Sync>)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };
    assert!(plain.await.is_err(), "a plaintext request was answered");
    let foreign = cluster.dir.path().join("foreign");
    let other_ca = certs::new_ca("other", certs::CA_VALIDITY).unwrap();
    certs::write(&foreign, "ca", &other_ca).unwrap();
    let stranger = certs::issue(
        &other_ca,
        &Request {
            identity: Identity::Client("stranger".into()),
            hosts: Vec::new(),
            valid_for: certs::CERT_VALIDITY,
            expired: false,
        },
    )
    .unwrap();
    certs::write(&foreign, "stranger", &stranger).unwrap();
    let ca = certs::read(&cluster.credentials.dir, "ca").unwrap();
    let expired = certs::issue(
        &ca,
        &Request {
            identity: Identity::Client("late".into()),
            hosts: Vec::new(),
            valid_for: certs::CERT_VALIDITY,
            expired: true,
        },
    )
    .unwrap();
    certs::write(&foreign, "expired", &expired).unwrap();
    for (what, cert) in [("another CA", "stranger"), ("expired", "expired")] {
        let files = TlsFiles {
            cert: foreign.join(format!("{cert}.pem")),
            key: foreign.join(format!("{cert}-key.pem")),
            // Trusting the cluster's CA: only the client side is wrong.
            ca: cluster.credentials.dir.join("ca.pem"),
        };
        let security = Security {
            tls: Some(Tls::load(files).unwrap()),
            token: Some(admin_token.clone()),
        };
        let endpoint = security
            .endpoint(&url)
            .unwrap()
            .connect_timeout(Duration::from_secs(2));
        let answered = match security.connect(&endpoint).await {
            Ok(channel) => BlobServiceClient::new(channel)
                .head(head.clone())
                .await
                .is_ok(),
            Err(_) => false,
        };
        assert!(!answered, "a client certificate of {what} was accepted");
    }

    // 7b. A node certificate reads blobs without a token only while the
    //     map binds its name: one of the cluster's CA naming no node (a
    //     retired pod's, one issued by mistake) reads nothing.
    let ghost = certs::issue(
        &ca,
        &Request {
            identity: Identity::Node("ghost".into()),
            hosts: Vec::new(),
            valid_for: certs::CERT_VALIDITY,
            expired: false,
        },
    )
    .unwrap();
    certs::write(&foreign, "ghost", &ghost).unwrap();
    let ghost_files = TlsFiles {
        cert: foreign.join("ghost.pem"),
        key: foreign.join("ghost-key.pem"),
        ca: cluster.credentials.dir.join("ca.pem"),
    };
    let get = pb::GetRequest {
        blob: Some(BlobRef {
            namespace: "private".into(),
            key: b"kept-1".to_vec(),
        }),
        consistency: pb::ReadConsistency::AnyReplica as i32,
        ..pb::GetRequest::default()
    };
    let first_answer = |mut stream: tonic::Streaming<pb::GetResponse>| async move {
        stream.message().await.map(|m| m.is_some())
    };
    for i in 0..cluster.nodes.len() {
        let url = node_url(&cluster, i);
        let mut ghost =
            BlobServiceClient::new(channel(&cluster, ghost_files.clone(), None, &url).await);
        let answer = match ghost.get(get.clone()).await {
            Ok(stream) => first_answer(stream.into_inner()).await,
            Err(status) => Err(status),
        };
        expect_code(
            "Get with an unbound node certificate",
            answer,
            ErrorCode::PermissionDenied,
        );
    }
    // Bound node certificates still read from each other: the manifest
    // checks below need it.

    // 8. A forged manifest in a content-addressed namespace, under the
    //    digest of content it does not describe: refused by the node (it
    //    reads the chunks and hashes them), so the real content stays
    //    storable and readable.
    admin
        .create_namespace("cas", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let real: Vec<u8> = (0..9_000_000u32).map(|i| (i % 251) as u8).collect();
    let real_key = tidepool_client::sha256(&real);
    let decoy = b"some other chunk".to_vec();
    let decoy_key = admin.put_content("cas", &decoy).await.unwrap();
    let forge = |chunk_key: [u8; 32], chunk_sha: [u8; 32], size: u64| pb::ChunkManifest {
        size,
        sha256: real_key.to_vec(),
        chunks: vec![pb::ChunkRef {
            key: chunk_key.to_vec(),
            size,
            sha256: chunk_sha.to_vec(),
        }],
        nonce: 0,
    };
    let manifest_put = |manifest: pb::ChunkManifest| {
        let bytes = prost::Message::encode_to_vec(&manifest);
        let header = pb::PutRequest {
            msg: Some(pb::put_request::Msg::Header(pb::PutHeader {
                blob: Some(BlobRef {
                    namespace: "cas".into(),
                    key: real_key.to_vec(),
                }),
                size: bytes.len() as u64,
                kind: pb::BlobKind::Manifest as i32,
                ..pb::PutHeader::default()
            })),
        };
        let data = pb::PutRequest {
            msg: Some(pb::put_request::Msg::Data(bytes.into())),
        };
        tokio_stream::iter(vec![header, data])
    };
    let writer_token = {
        let (token, _) = admin
            .create_token(
                "cas-writer",
                false,
                vec![TokenGrant {
                    namespace: "cas".into(),
                    roles: vec![Role::Read as i32, Role::Write as i32],
                }],
            )
            .await
            .unwrap();
        token
    };
    // Sent to every node: the leader of the key's shard answers with the
    // verdict, the others with NOT_LEADER / WRONG_SHARD.
    let mut verdicts = Vec::new();
    for (what, manifest) in [
        // Chunks that exist but are not the content.
        (
            "other content",
            forge(decoy_key, decoy_key, decoy.len() as u64),
        ),
        // Chunks that do not exist.
        ("missing chunks", {
            let absent = tidepool_client::sha256(b"never stored");
            forge(absent, absent, 12)
        }),
    ] {
        let mut verdict = None;
        for i in 0..cluster.nodes.len() {
            let url = node_url(&cluster, i);
            let mut forger = BlobServiceClient::new(
                as_cert(&cluster, "client", Some(&writer_token), &url).await,
            );
            match forger.put(manifest_put(manifest.clone())).await {
                Ok(stored) => panic!("a forged manifest ({what}) was stored: {stored:?}"),
                Err(status)
                    if matches!(code(&status), ErrorCode::NotLeader | ErrorCode::WrongShard) => {}
                Err(status) => verdict = Some(code(&status)),
            }
        }
        verdicts.push((what, verdict));
    }
    assert_eq!(
        verdicts,
        vec![
            ("other content", Some(ErrorCode::DigestMismatch)),
            ("missing chunks", Some(ErrorCode::NotFound)),
        ]
    );
    // The real content, chunked by the SDK, passes the same check.
    assert_eq!(admin.put_content("cas", &real).await.unwrap(), real_key);
    assert_eq!(admin.get("cas", &real_key).await.unwrap(), real);

    // Afterwards: everything acknowledged is there, and the cluster serves.
    let admin = cluster.client().await;
    for (key, value) in &acknowledged {
        assert_eq!(&admin.get("default", key).await.unwrap(), value);
        assert_eq!(&admin.get("private", key).await.unwrap(), value);
    }
    admin
        .put("default", b"after", b"still serving")
        .await
        .unwrap();
    let status = cluster.status().await.expect("status");
    assert!(
        status
            .map
            .unwrap()
            .shards
            .iter()
            .all(|s| s.replicas.len() == 3),
        "every shard keeps its three replicas"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_hold_and_a_revoked_token_stops_on_every_node_within_five_seconds() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options::default()).await;
    let admin = cluster.client().await;
    admin
        .put("default", b"existing", b"original")
        .await
        .unwrap();
    let grant = |roles: &[Role]| {
        vec![TokenGrant {
            namespace: "default".into(),
            roles: roles.iter().map(|r| *r as i32).collect(),
        }]
    };
    let (ro, _) = admin
        .create_token("ro", false, grant(&[Role::Read]))
        .await
        .unwrap();
    let (ao, _) = admin
        .create_token("backup", false, grant(&[Role::AppendOnly, Role::Read]))
        .await
        .unwrap();

    let reader = client_with(&cluster, &ro).await;
    assert_eq!(
        reader.get("default", b"existing").await.unwrap(),
        b"original"
    );
    assert_eq!(
        reader
            .put("default", b"new", b"x")
            .await
            .unwrap_err()
            .code(),
        ErrorCode::PermissionDenied
    );
    assert_eq!(
        reader
            .delete("default", b"existing")
            .await
            .unwrap_err()
            .code(),
        ErrorCode::PermissionDenied
    );

    let backup = client_with(&cluster, &ao).await;
    for i in 0..20u32 {
        backup
            .put("default", format!("b-{i}").as_bytes(), b"first")
            .await
            .unwrap();
    }
    for key in [b"existing".to_vec(), b"b-3".to_vec()] {
        assert_eq!(
            backup
                .put("default", &key, b"overwrite")
                .await
                .unwrap_err()
                .code(),
            ErrorCode::AlreadyExists
        );
        assert_eq!(
            backup.delete("default", &key).await.unwrap_err().code(),
            ErrorCode::PermissionDenied
        );
    }
    assert_eq!(
        admin.get("default", b"existing").await.unwrap(),
        b"original"
    );
    assert_eq!(admin.get("default", b"b-3").await.unwrap(), b"first");

    // A token that may write and read but not delete replaces a chunked
    // blob: the put succeeds (the old chunks it may not delete are left
    // behind). Before, the put stored the new blob and then answered
    // PERMISSION_DENIED for the old chunks' deletion.
    let (rw, _) = admin
        .create_token("ci", false, grant(&[Role::Read, Role::Write]))
        .await
        .unwrap();
    let writer = client_with(&cluster, &rw).await;
    let chunk = writer.chunk_size();
    let first: Vec<u8> = (0..2 * chunk + 10).map(|i| (i % 251) as u8).collect();
    let second: Vec<u8> = (0..2 * chunk + 20).map(|i| (i % 241) as u8).collect();
    writer
        .put_stream("default", b"chunked", &first[..])
        .await
        .unwrap();
    writer
        .put_stream("default", b"chunked", &second[..])
        .await
        .unwrap();
    assert!(writer.get("default", b"chunked").await.unwrap() == second);

    // A put's answer names the chunked blob it replaced (what the key
    // held) only to a caller that may delete its chunks.
    let (rwd, _) = admin
        .create_token(
            "ci-delete",
            false,
            grant(&[Role::Read, Role::Write, Role::Delete]),
        )
        .await
        .unwrap();
    for (token, named) in [(&rw, false), (&rwd, true)] {
        admin
            .put_stream("default", b"named", &first[..])
            .await
            .unwrap();
        let small = |content: &'static [u8]| {
            tokio_stream::iter(vec![
                pb::PutRequest {
                    msg: Some(pb::put_request::Msg::Header(pb::PutHeader {
                        blob: Some(BlobRef {
                            namespace: "default".into(),
                            key: b"named".to_vec(),
                        }),
                        size: content.len() as u64,
                        ..pb::PutHeader::default()
                    })),
                },
                pb::PutRequest {
                    msg: Some(pb::put_request::Msg::Data(content.to_vec().into())),
                },
            ])
        };
        let mut answers = Vec::new();
        for i in 0..cluster.nodes.len() {
            let url = node_url(&cluster, i);
            let mut node =
                BlobServiceClient::new(as_cert(&cluster, "client", Some(token), &url).await);
            match node.put(small(b"small")).await {
                Ok(answer) => answers.push(answer.into_inner()),
                Err(status) => assert!(
                    matches!(code(&status), ErrorCode::NotLeader | ErrorCode::WrongShard),
                    "{status:?}"
                ),
            }
        }
        assert_eq!(answers.len(), 1, "one leader answers: {answers:?}");
        assert_eq!(answers[0].replaced.is_some(), named, "{answers:?}");
    }

    // Revocation reaches every node: ask each one directly.
    let head = HeadRequest {
        blob: Some(BlobRef {
            namespace: "default".into(),
            key: b"existing".to_vec(),
        }),
        ..HeadRequest::default()
    };
    let mut per_node = Vec::new();
    for i in 0..cluster.nodes.len() {
        let url = node_url(&cluster, i);
        per_node.push(BlobServiceClient::new(
            as_cert(&cluster, "client", Some(&ro), &url).await,
        ));
    }
    // Before: accepted by each (or refused only for routing, never for the
    // credential).
    for node in &mut per_node {
        if let Err(status) = node.head(head.clone()).await {
            assert!(
                !matches!(
                    code(&status),
                    ErrorCode::Unauthenticated | ErrorCode::PermissionDenied
                ),
                "{status:?}"
            );
        }
    }
    // A map watch opened with the token before it is revoked.
    let mut watch = CoordinatorServiceClient::new(
        as_cert(&cluster, "client", Some(&ro), &cluster.coordinators[0].url).await,
    )
    .watch_cluster_map(pb::WatchClusterMapRequest::default())
    .await
    .expect("a watch with a read token")
    .into_inner();
    assert!(watch.message().await.unwrap().is_some(), "the current map");
    let revoked_at = Instant::now();
    assert!(admin.revoke_token("ro").await.unwrap());
    // The watch ends with the revocation: it went on receiving every map
    // (tokens and namespaces created later included).
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the watch still runs 5 s after its token was revoked");
    match ended {
        Err(status) => assert_eq!(code(&status), ErrorCode::Unauthenticated, "{status:?}"),
        Ok(end) => panic!("the watch ended without an error: {end:?}"),
    }
    let mut refused = vec![None; per_node.len()];
    while refused.iter().any(Option::is_none) && revoked_at.elapsed() < Duration::from_secs(10) {
        for (i, node) in per_node.iter_mut().enumerate() {
            if refused[i].is_none()
                && let Err(status) = node.head(head.clone()).await
                && code(&status) == ErrorCode::Unauthenticated
            {
                refused[i] = Some(revoked_at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("revocation took effect per node after: {refused:?}");
    for (i, took) in refused.iter().enumerate() {
        let took = took.unwrap_or_else(|| panic!("node {} still accepts a revoked token", i + 1));
        assert!(took <= Duration::from_secs(5), "node {}: {took:?}", i + 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_load_without_a_failed_operation() {
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options::default()).await;
    let client = cluster.client().await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let client = client.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut done, mut failed) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("rot-{}", done % 200).into_bytes();
                let value = format!("v{done}").into_bytes();
                match client.put("default", &key, &value).await {
                    Ok(_) => match client.get("default", &key).await {
                        Ok(read) if read == value => {}
                        other => failed.push(format!("get {done}: {other:?}")),
                    },
                    Err(e) => failed.push(format!("put {done}: {e}")),
                }
                done += 1;
            }
            (done, failed)
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Re-issue every node's and the client's certificate from the same CA
    // (what cert-manager does before expiry), files replaced atomically.
    let ca = certs::read(&cluster.credentials.dir, "ca").unwrap();
    let mut issued = Vec::new();
    for (base, identity) in (1..=cluster.nodes.len())
        .map(|id| (format!("node-{id}"), Identity::Node(format!("node-{id}"))))
        .chain([("client".to_string(), Identity::Client("e2e".into()))])
    {
        let fresh = certs::issue(
            &ca,
            &Request {
                identity,
                hosts: vec!["127.0.0.1".into(), "localhost".into()],
                valid_for: certs::CERT_VALIDITY,
                expired: false,
            },
        )
        .unwrap();
        certs::write(&cluster.credentials.dir, &base, &fresh).unwrap();
        issued.push((base, fresh));
    }
    // Within a couple of seconds every node serves its new certificate to
    // new connections.
    let observer = Tls::load(cluster.credentials.files("client")).unwrap();
    for (i, node) in cluster.nodes.iter().enumerate() {
        let wanted = tidepool_security::tls::certificates(issued[i].1.cert_pem.as_bytes()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let served =
                tidepool_security::tls::server_certificate(&observer, "127.0.0.1", node.port)
                    .await
                    .unwrap();
            if served == wanted[0] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {} still serves its old certificate",
                i + 1
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // New connections with the new material work.
    let fresh_client = cluster.client().await;
    fresh_client
        .put("default", b"after-rotation", b"ok")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (done, failed) = load.await.unwrap();
    eprintln!(
        "operations during rotation: {done}, failed: {}",
        failed.len()
    );
    assert!(done > 20, "the load ran ({done} operations)");
    assert!(failed.is_empty(), "failed operations: {failed:?}");
}

/// One token cannot hold a node's whole in-flight budget: puts that send
/// their header and then nothing (a slow or hostile client) hold at most
/// half of it for their token; another tenant's put still goes through.
/// Before, one token's stalled puts took the whole budget and every other
/// client got OVERLOADED until they ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_cannot_hold_a_nodes_whole_in_flight_budget() {
    use tidepool_client::proto::v1::{PutHeader, PutRequest, put_request};
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        shards: 1,
        in_flight_mib: Some(8),
        ..Options::default()
    })
    .await;
    let admin = cluster.client().await;
    let grant = vec![TokenGrant {
        namespace: "default".into(),
        roles: vec![Role::Read as i32, Role::Write as i32],
    }];
    let (greedy, _) = admin
        .create_token("greedy", false, grant.clone())
        .await
        .unwrap();
    let (other, _) = admin.create_token("other", false, grant).await.unwrap();
    let map = admin.cluster_status().await.unwrap().map.unwrap();

    // A put of 1 MiB that sends its header, then nothing: held until its
    // stream ends. Finished within 300 ms: its answer.
    async fn stall(
        channel: &Channel,
        i: usize,
    ) -> Result<
        (
            tokio::sync::mpsc::Sender<PutRequest>,
            tokio::task::JoinHandle<Result<tonic::Response<pb::PutResponse>, Status>>,
        ),
        Status,
    > {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let header = PutHeader {
            blob: Some(BlobRef {
                namespace: "default".into(),
                key: format!("stalled-{i}").into_bytes(),
            }),
            size: 1 << 20,
            ..PutHeader::default()
        };
        tx.send(PutRequest {
            msg: Some(put_request::Msg::Header(header)),
        })
        .await
        .unwrap();
        let mut blobs = BlobServiceClient::new(channel.clone());
        let call = tokio::spawn(async move {
            blobs
                .put(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        if call.is_finished() {
            return Err(call.await.unwrap().unwrap_err());
        }
        Ok((tx, call))
    }

    // The shard's leader holds the puts (a follower answers NOT_LEADER).
    let mut stalled = Vec::new();
    let mut leader = None;
    for node in &map.nodes {
        let channel = as_cert(&cluster, "client", Some(&greedy), &node.address).await;
        match stall(&channel, 0).await {
            Ok(held) => {
                stalled.push(held);
                leader = Some(channel);
                break;
            }
            Err(status) => assert_eq!(code(&status), ErrorCode::NotLeader, "{status:?}"),
        }
    }
    let channel = leader.expect("a node leads the shard");
    // The node's budget is 8 MiB; the token's half is 4.
    let mut refused_at = None;
    for i in 1..8 {
        match stall(&channel, i).await {
            Ok(held) => stalled.push(held),
            Err(status) => {
                assert_eq!(code(&status), ErrorCode::Overloaded, "{status:?}");
                refused_at = Some(i);
                break;
            }
        }
    }
    assert_eq!(refused_at, Some(4), "refused once the token holds 4 MiB");

    // Another token's put goes through meanwhile.
    let neighbour = client_with(&cluster, &other)
        .await
        .with_timeout(Duration::from_secs(5));
    let value = vec![7u8; 1 << 20];
    neighbour
        .put("default", b"neighbour", &value)
        .await
        .unwrap();
    assert!(neighbour.get("default", b"neighbour").await.unwrap() == value);
    drop(stalled);

    // At this smallest budget (two of the largest values) a token's half
    // is one value: a content-addressed put of a chunked blob, whose
    // manifest check holds a chunk while the put holds the manifest, is
    // stored. Before, the chunk was counted under the token's half too:
    // OVERLOADED at every try, for every chunked put made with a token.
    admin
        .create_namespace("digests", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let (deduper, _) = admin
        .create_token(
            "deduper",
            false,
            vec![TokenGrant {
                namespace: "digests".into(),
                roles: vec![Role::Read as i32, Role::Write as i32],
            }],
        )
        .await
        .unwrap();
    let deduper = client_with(&cluster, &deduper).await;
    let blob: Vec<u8> = (0..deduper.chunk_size() + 1000)
        .map(|i| (i % 253) as u8)
        .collect();
    let key = tidepool_client::sha256(&blob);
    deduper
        .put("digests", &key, &blob)
        .await
        .expect("a chunked content-addressed put within a token's half");
    assert_eq!(deduper.chunks("digests", &key).await.unwrap().len(), 2);
    assert!(deduper.get("digests", &key).await.unwrap() == blob);
}

/// One token cannot fill a shard's table of write sessions: a client that
/// opens a fresh session with every put (here 8 at a time) is refused —
/// `OVERLOADED`, with the wait — once it has opened its burst (50 here,
/// then one a second; 2,000 and 100 by default), while another token's
/// first writes, and the same token's writes in sessions it holds, go on.
/// Before, a few hundred opens a second kept the table's 100,000 sessions
/// busy, and every other client's first write on the shard was refused for
/// as long as it went on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_cannot_fill_a_shards_write_sessions() {
    use tidepool_client::proto::v1::{PutHeader, PutRequest, WriteSession, put_request};
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(Options {
        shards: 1,
        session_opens: Some((1, 50)),
        ..Options::default()
    })
    .await;
    let admin = cluster.client().await;
    let grant = vec![TokenGrant {
        namespace: "default".into(),
        roles: vec![Role::Read as i32, Role::Write as i32],
    }];
    let (opener, _) = admin
        .create_token("opener", false, grant.clone())
        .await
        .unwrap();
    let (other, _) = admin.create_token("other", false, grant).await.unwrap();
    let map = admin.cluster_status().await.unwrap().map.unwrap();
    let put = |channel: Channel, key: String, id: [u8; 16], sequence: u64, opens: bool| async move {
        let header = PutHeader {
            blob: Some(BlobRef {
                namespace: "default".into(),
                key: key.into_bytes(),
            }),
            size: 1,
            session: Some(WriteSession {
                id: id.to_vec(),
                sequence,
                opens,
            }),
            ..PutHeader::default()
        };
        BlobServiceClient::new(channel)
            .put(tokio_stream::iter(vec![
                PutRequest {
                    msg: Some(put_request::Msg::Header(header)),
                },
                PutRequest {
                    msg: Some(put_request::Msg::Data(vec![1u8].into())),
                },
            ]))
            .await
    };
    // The shard's leader (a follower answers NOT_LEADER).
    let mut leader = None;
    for node in &map.nodes {
        let channel = as_cert(&cluster, "client", Some(&opener), &node.address).await;
        match put(channel.clone(), "held".into(), [1; 16], 1, true).await {
            Ok(_) => {
                leader = Some(channel);
                break;
            }
            Err(status) => assert_eq!(code(&status), ErrorCode::NotLeader, "{status:?}"),
        }
    }
    let channel = leader.expect("a node leads the shard");
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for task in 0..8u8 {
        let (channel, refused) = (channel.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            let mut opened = 0u64;
            for i in 0..100u64 {
                if refused.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let mut id = [0u8; 16];
                id[0] = task;
                id[8..].copy_from_slice(&(i + 1).to_le_bytes());
                match put(channel.clone(), format!("k-{task}-{i}"), id, 1, true).await {
                    Ok(_) => opened += 1,
                    Err(status) => {
                        assert_eq!(code(&status), ErrorCode::Overloaded, "{status:?}");
                        assert!(
                            status.message().contains("opens write sessions"),
                            "{status:?}"
                        );
                        let detail = tidepool_client::proto::error_detail(&status).unwrap();
                        assert!(detail.retry_after_ms >= 1, "{detail:?}");
                        refused.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            opened
        }));
    }
    let mut opened = 0;
    for task in tasks {
        opened += task.await.unwrap();
    }
    assert!(
        refused.load(std::sync::atomic::Ordering::Relaxed),
        "{opened} sessions opened, none refused"
    );
    // The first (`held`) and 49 more: the burst.
    assert!(opened >= 49, "refused after {opened} opens");
    // The same token, in the session it holds: no open, not refused.
    put(channel.clone(), "held".into(), [1; 16], 2, false)
        .await
        .expect("a write in a session held");
    // A request naming no blob is INVALID_ARGUMENT whatever the token's
    // roles (it was PERMISSION_DENIED in namespace "").
    let status = BlobServiceClient::new(channel.clone())
        .delete(pb::DeleteRequest::default())
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument, "{status:?}");
    // Another token's first writes (new sessions) go through.
    let neighbour = client_with(&cluster, &other).await;
    neighbour
        .put("default", b"neighbour", b"first write")
        .await
        .expect("another tenant opens its session");
}
