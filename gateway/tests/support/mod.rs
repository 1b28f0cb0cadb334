//! What the gateway's protocol tests share: an in-process cluster
//! (coordinator and three nodes on loopback sockets) with a gateway in
//! front of it, the generated REAPI and ByteStream clients, and a plain
//! HTTP client.

#![allow(dead_code)]

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use bazel_remote_apis::google::bytestream::byte_stream_client::ByteStreamClient;
use bazel_remote_apis::google::bytestream::{ReadRequest, WriteRequest};
use http_body_util::{BodyExt as _, Full};
use re::action_cache_client::ActionCacheClient;
use re::content_addressable_storage_client::ContentAddressableStorageClient;
use sha2::{Digest as _, Sha256};
use tidepool_client::{Client, ClientConfig};
use tidepool_gateway::{GatewayConfig, RunningGateway};
use tidepool_testkit::cluster::LocalCluster;
use tonic::transport::Channel;

/// The cluster's chunk size (LocalCluster's value limit).
pub const CHUNK: usize = 1 << 20;

pub struct Setup {
    pub cluster: LocalCluster,
    pub gateway: RunningGateway,
    pub channel: Channel,
    pub client: Client,
}

pub async fn setup(anonymous: bool) -> Setup {
    setup_with(anonymous, |_| {}).await
}

/// [`setup`] with `adjust` applied to the gateway's configuration.
pub async fn setup_with(anonymous: bool, adjust: impl FnOnce(&mut GatewayConfig)) -> Setup {
    let cluster = LocalCluster::start(3, 4, 3).await;
    let mut config = GatewayConfig::new(ClientConfig::new(std::slice::from_ref(&cluster.url)));
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.anonymous = anonymous;
    config.max_blob_bytes = 8 << 20;
    config.max_batch_bytes = 2 << 20;
    adjust(&mut config);
    let gateway = tidepool_gateway::start(config)
        .await
        .expect("the gateway starts");
    gateway.create_instance("cache", 3).await.expect("instance");
    gateway.create_instance("ci", 3).await.expect("instance");
    let channel = Channel::from_shared(format!("http://{}", gateway.grpc_address))
        .unwrap()
        .connect()
        .await
        .expect("connects");
    let client = Client::connect(std::slice::from_ref(&cluster.url))
        .await
        .expect("client");
    Setup {
        cluster,
        gateway,
        channel,
        client,
    }
}

impl Setup {
    pub fn cas(&self) -> ContentAddressableStorageClient<Channel> {
        ContentAddressableStorageClient::new(self.channel.clone())
            .max_decoding_message_size(16 << 20)
    }
    pub fn ac(&self) -> ActionCacheClient<Channel> {
        ActionCacheClient::new(self.channel.clone())
    }
    pub fn bytestream(&self) -> ByteStreamClient<Channel> {
        ByteStreamClient::new(self.channel.clone())
    }
    pub async fn stop(self) {
        self.gateway.stop().await;
        self.cluster.stop().await;
    }
}

pub fn hex(bytes: &[u8]) -> String {
    tidepool_client::hex(bytes)
}

pub fn digest(bytes: &[u8]) -> re::Digest {
    re::Digest {
        hash: hex(&Sha256::digest(bytes)),
        size_bytes: bytes.len() as i64,
    }
}

/// Deterministic bytes of any size (a seed per blob).
pub fn blob(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub async fn upload(s: &Setup, instance: &str, bytes: &[u8]) {
    let response = s
        .cas()
        .batch_update_blobs(re::BatchUpdateBlobsRequest {
            instance_name: instance.into(),
            requests: vec![re::batch_update_blobs_request::Request {
                digest: Some(digest(bytes)),
                data: bytes.to_vec(),
                compressor: 0,
            }],
            digest_function: 0,
        })
        .await
        .expect("batch update")
        .into_inner();
    assert_eq!(
        response.responses[0].status.as_ref().unwrap().code,
        0,
        "{response:?}"
    );
}

pub fn write_requests(
    name: &str,
    bytes: &[u8],
    offset: usize,
    piece: usize,
    finish: bool,
) -> Vec<WriteRequest> {
    let mut requests: Vec<WriteRequest> = bytes[offset..]
        .chunks(piece)
        .scan(offset, |at, data| {
            let request = WriteRequest {
                resource_name: name.into(),
                write_offset: *at as i64,
                finish_write: false,
                data: data.to_vec(),
            };
            *at += data.len();
            Some(request)
        })
        .collect();
    if requests.is_empty() {
        requests.push(WriteRequest {
            resource_name: name.into(),
            write_offset: offset as i64,
            finish_write: false,
            data: Vec::new(),
        });
    }
    requests.last_mut().unwrap().finish_write = finish;
    requests
}

pub async fn bytestream_write(s: &Setup, name: &str, bytes: &[u8]) -> Result<i64, tonic::Status> {
    let requests = write_requests(name, bytes, 0, 256 << 10, true);
    s.bytestream()
        .write(tokio_stream::iter(requests))
        .await
        .map(|r| r.into_inner().committed_size)
}

pub async fn bytestream_read(
    s: &Setup,
    name: &str,
    offset: i64,
    limit: i64,
) -> Result<Vec<u8>, tonic::Status> {
    let mut stream = s
        .bytestream()
        .read(ReadRequest {
            resource_name: name.into(),
            read_offset: offset,
            read_limit: limit,
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(message) = stream.message().await? {
        out.extend_from_slice(&message.data);
    }
    Ok(out)
}

pub fn blob_name(bytes: &[u8]) -> String {
    let d = digest(bytes);
    format!("blobs/{}/{}", d.hash, d.size_bytes)
}

/// One HTTP/1.1 request with hyper; returns status and body.
pub async fn http(
    address: std::net::SocketAddr,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Vec<u8>,
) -> (u16, Vec<u8>) {
    let headers: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
    let (status, _, body) = http_with(address, method, path, &headers, body).await;
    (status, body)
}

/// One HTTP/1.1 request with extra headers; returns status, response
/// headers and body.
pub async fn http_with(
    address: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, http::HeaderMap, Vec<u8>) {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    let mut request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "gateway");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = sender
        .send_request(request.body(Full::new(bytes::Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, headers, body)
}
