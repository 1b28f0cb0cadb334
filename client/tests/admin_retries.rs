//! The SDK's calls on the coordinators: cluster changes repeated after an
//! attempt whose answer was lost take effect once and report what
//! happened; map refreshes are shared and end at the call's deadline.
//!
//! The client's first seed is a scripted coordinator on a real socket that
//! forwards `AdvanceEpoch` and `CreateNamespace` to the real leader, which
//! makes the change, and then answers `UNAVAILABLE` — as a coordinator
//! killed between its store's commit and its answer does. Everything else
//! it answers `UNAVAILABLE` at once. The SDK goes on to the next seed, the
//! real coordinator, and repeats the call.
//!
//! Before, an epoch advance without `--expect` was sent unconditionally and
//! repeated: the epoch moved by two (every retention one epoch shorter, a
//! drop an epoch early). With `--expect` the repeat was refused and the
//! call failed though the advance was made; a namespace created so was
//! reported as already existing.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tidepool_client::{Client, ClientConfig, ErrorCode, RetentionPolicy};
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::coordinator_service_server::{
    CoordinatorService, CoordinatorServiceServer,
};
use tidepool_proto::v1::*;
use tidepool_testkit::cluster::LocalCluster;
use tonic::{Request, Response, Status};

/// Forwards changes to `real`, then loses the answer.
struct Losing {
    real: String,
    forwarded: Arc<AtomicUsize>,
}

fn lost() -> Status {
    Status::unavailable("scripted: the answer was lost")
}

impl Losing {
    async fn real(&self) -> CoordinatorServiceClient<tonic::transport::Channel> {
        CoordinatorServiceClient::connect(self.real.clone())
            .await
            .unwrap()
    }
}

/// Methods answered `UNAVAILABLE` at once (written as `async_trait`
/// expands them: the attribute does not see into a macro's output).
macro_rules! unavailable {
    ($($name:ident($request:ty) -> $response:ty;)*) => {
        $(
            fn $name<'life0, 'async_trait>(
                &'life0 self,
                _: Request<$request>,
            ) -> std::pin::Pin<
                Box<
                    dyn std::future::Future<Output = Result<Response<$response>, Status>>
                        + Send
                        + 'async_trait,
                >,
            >
            where
                'life0: 'async_trait,
                Self: 'async_trait,
            {
                Box::pin(async { Err(lost()) })
            }
        )*
    };
}

#[tonic::async_trait]
impl CoordinatorService for Losing {
    type WatchClusterMapStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ClusterMap, Status>> + Send>>;

    async fn advance_epoch(
        &self,
        request: Request<AdvanceEpochRequest>,
    ) -> Result<Response<AdvanceEpochResponse>, Status> {
        self.real()
            .await
            .advance_epoch(request.into_inner())
            .await?;
        self.forwarded.fetch_add(1, Ordering::SeqCst);
        Err(lost())
    }

    async fn create_namespace(
        &self,
        request: Request<CreateNamespaceRequest>,
    ) -> Result<Response<Namespace>, Status> {
        self.real()
            .await
            .create_namespace(request.into_inner())
            .await?;
        self.forwarded.fetch_add(1, Ordering::SeqCst);
        Err(lost())
    }

    async fn watch_cluster_map(
        &self,
        _: Request<WatchClusterMapRequest>,
    ) -> Result<Response<Self::WatchClusterMapStream>, Status> {
        Err(lost())
    }

    unavailable! {
        get_cluster_map(GetClusterMapRequest) -> ClusterMap;
        register_node(RegisterNodeRequest) -> RegisterNodeResponse;
        heartbeat(HeartbeatRequest) -> HeartbeatResponse;
        prepare_node_stop(PrepareNodeStopRequest) -> PrepareNodeStopResponse;
        list_namespaces(ListNamespacesRequest) -> ListNamespacesResponse;
        set_retention(SetRetentionRequest) -> Namespace;
        get_epoch_status(GetEpochStatusRequest) -> EpochStatus;
        drain_node(DrainNodeRequest) -> DrainNodeResponse;
        split_shard(SplitShardRequest) -> SplitShardResponse;
        get_cluster_status(GetClusterStatusRequest) -> ClusterStatus;
        create_token(CreateTokenRequest) -> CreateTokenResponse;
        list_tokens(ListTokensRequest) -> ListTokensResponse;
        revoke_token(RevokeTokenRequest) -> RevokeTokenResponse;
        who_am_i(WhoAmIRequest) -> WhoAmIResponse;
        restore_map(RestoreMapRequest) -> RestoreMapResponse;
    }
}

/// A losing coordinator in front of `real`: its URL and its count of
/// changes made.
async fn losing(real: &str) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let forwarded = Arc::new(AtomicUsize::new(0));
    let service = Losing {
        real: real.to_string(),
        forwarded: forwarded.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServiceServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (url, forwarded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_repeated_after_its_answer_was_lost_takes_effect_once() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let (url, forwarded) = losing(&cluster.url).await;
    let mut config = ClientConfig::new(&[url.as_str(), cluster.url.as_str()]);
    config.watch = false;
    let client = Client::with_config(config).await.unwrap();
    let direct = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let epoch = || cluster.map().epoch;

    // Unconditional: one advance, reported.
    let before = epoch();
    let advanced = client.advance_epoch(None).await.unwrap();
    assert_eq!(forwarded.load(Ordering::SeqCst), 1, "the lost attempt");
    assert_eq!(epoch(), before + 1, "advanced once, not twice");
    assert_eq!(advanced, before + 1);

    // Conditional: the repeat is refused, and the advance the lost attempt
    // made is this call's.
    let before = epoch();
    let advanced = client.advance_epoch(Some(before)).await.unwrap();
    assert_eq!(forwarded.load(Ordering::SeqCst), 2);
    assert_eq!((epoch(), advanced), (before + 1, before + 1));

    // A condition already false is refused as before (no attempt lost:
    // the losing coordinator forwards it and the real one refuses it).
    let error = client.advance_epoch(Some(before)).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::Conflict, "{error}");
    assert_eq!(epoch(), before + 1);

    // A namespace made by the lost attempt is the call's outcome, not
    // NAMESPACE_EXISTS.
    let made = client
        .create_namespace("made-once", false, RetentionPolicy::Epochs(3))
        .await
        .unwrap();
    assert_eq!(made.name, "made-once");
    // One that existed with other settings still is refused.
    direct
        .create_namespace("other", true, RetentionPolicy::Durable)
        .await
        .unwrap();
    let error = client
        .create_namespace("other", false, RetentionPolicy::Durable)
        .await
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::NamespaceExists, "{error}");
    cluster.stop().await;
}

/// A coordinator that answers `GetClusterMap` from the real one after a
/// pause, counting the calls, and nothing else.
struct Slow {
    real: String,
    fetched: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl CoordinatorService for Slow {
    type WatchClusterMapStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ClusterMap, Status>> + Send>>;

    async fn get_cluster_map(
        &self,
        request: Request<GetClusterMapRequest>,
    ) -> Result<Response<ClusterMap>, Status> {
        self.fetched.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        CoordinatorServiceClient::connect(self.real.clone())
            .await
            .unwrap()
            .get_cluster_map(request.into_inner())
            .await
    }

    async fn watch_cluster_map(
        &self,
        _: Request<WatchClusterMapRequest>,
    ) -> Result<Response<Self::WatchClusterMapStream>, Status> {
        Err(lost())
    }

    unavailable! {
        advance_epoch(AdvanceEpochRequest) -> AdvanceEpochResponse;
        create_namespace(CreateNamespaceRequest) -> Namespace;
        register_node(RegisterNodeRequest) -> RegisterNodeResponse;
        heartbeat(HeartbeatRequest) -> HeartbeatResponse;
        prepare_node_stop(PrepareNodeStopRequest) -> PrepareNodeStopResponse;
        list_namespaces(ListNamespacesRequest) -> ListNamespacesResponse;
        set_retention(SetRetentionRequest) -> Namespace;
        get_epoch_status(GetEpochStatusRequest) -> EpochStatus;
        drain_node(DrainNodeRequest) -> DrainNodeResponse;
        split_shard(SplitShardRequest) -> SplitShardResponse;
        get_cluster_status(GetClusterStatusRequest) -> ClusterStatus;
        create_token(CreateTokenRequest) -> CreateTokenResponse;
        list_tokens(ListTokensRequest) -> ListTokensResponse;
        revoke_token(RevokeTokenRequest) -> RevokeTokenResponse;
        who_am_i(WhoAmIRequest) -> WhoAmIResponse;
        restore_map(RestoreMapRequest) -> RestoreMapResponse;
    }
}

/// Map fetches: the calls that need the map at once share one fetch (a
/// split or an election sends every call in flight to refresh together),
/// and a call's refresh ends at the call's deadline, whatever the
/// coordinators do (before: each seed's connect timeout, one after
/// another — 3 s each — for a call of 500 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_refreshes_are_shared_and_end_at_the_calls_deadline() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow_url = format!("http://{}", listener.local_addr().unwrap());
    let fetched = Arc::new(AtomicUsize::new(0));
    let service = Slow {
        real: cluster.url.clone(),
        fetched: fetched.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServiceServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let mut config = ClientConfig::new(&[slow_url.as_str()]);
    config.watch = false;
    let client = Client::with_config(config).await.unwrap();
    let before = fetched.load(Ordering::SeqCst);
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let client = client.clone();
        calls.spawn(async move { client.refresh_map().await.map(|m| m.version) });
    }
    while let Some(done) = calls.join_next().await {
        assert!(done.unwrap().unwrap() > 0);
    }
    let fetches = fetched.load(Ordering::SeqCst) - before;
    println!("32 concurrent refreshes: {fetches} fetches");
    assert!(fetches <= 2, "{fetches} fetches for 32 calls at once");

    // A seed that accepts connections and never answers, first in line.
    let frozen = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let frozen_url = format!("http://{}", frozen.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = frozen.accept().await {
            held.push(socket);
        }
    });
    let mut config = ClientConfig::new(&[frozen_url.as_str(), cluster.url.as_str()]);
    config.watch = false;
    let client = Client::with_config(config).await.unwrap();
    // The seed that answered is asked first from then on: the frozen one
    // no longer costs each fetch its connect timeout (3 s).
    let started = std::time::Instant::now();
    client.refresh_map().await.unwrap();
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_millis(1_500),
        "a refresh took {took:?}"
    );
    let started = std::time::Instant::now();
    let error = client
        .with_timeout(std::time::Duration::from_millis(500))
        .get("no-such-namespace", b"k")
        .await
        .unwrap_err();
    let took = started.elapsed();
    println!("a 500 ms call needing the map: {took:?} ({error})");
    assert!(
        took < std::time::Duration::from_millis(1_500),
        "took {took:?}: {error}"
    );
    cluster.stop().await;
}

/// A coordinator cut off from its store: it serves the map it cached.
struct Stale {
    map: ClusterMap,
}

#[tonic::async_trait]
impl CoordinatorService for Stale {
    type WatchClusterMapStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ClusterMap, Status>> + Send>>;

    async fn get_cluster_map(
        &self,
        _: Request<GetClusterMapRequest>,
    ) -> Result<Response<ClusterMap>, Status> {
        Ok(Response::new(self.map.clone()))
    }

    async fn watch_cluster_map(
        &self,
        _: Request<WatchClusterMapRequest>,
    ) -> Result<Response<Self::WatchClusterMapStream>, Status> {
        Err(lost())
    }

    unavailable! {
        advance_epoch(AdvanceEpochRequest) -> AdvanceEpochResponse;
        create_namespace(CreateNamespaceRequest) -> Namespace;
        register_node(RegisterNodeRequest) -> RegisterNodeResponse;
        heartbeat(HeartbeatRequest) -> HeartbeatResponse;
        prepare_node_stop(PrepareNodeStopRequest) -> PrepareNodeStopResponse;
        list_namespaces(ListNamespacesRequest) -> ListNamespacesResponse;
        set_retention(SetRetentionRequest) -> Namespace;
        get_epoch_status(GetEpochStatusRequest) -> EpochStatus;
        drain_node(DrainNodeRequest) -> DrainNodeResponse;
        split_shard(SplitShardRequest) -> SplitShardResponse;
        get_cluster_status(GetClusterStatusRequest) -> ClusterStatus;
        create_token(CreateTokenRequest) -> CreateTokenResponse;
        list_tokens(ListTokensRequest) -> ListTokensResponse;
        revoke_token(RevokeTokenRequest) -> RevokeTokenResponse;
        who_am_i(WhoAmIRequest) -> WhoAmIResponse;
        restore_map(RestoreMapRequest) -> RestoreMapResponse;
    }
}

/// A first seed serving an old map (a coordinator cut off from etcd keeps
/// serving the one it cached) is passed over for the next seed's once a
/// node has answered with a newer version; later fetches ask the seed that
/// gave the map first. Before, every fetch took the first seed's answer:
/// a namespace created since stayed unknown to the client (and a split's
/// keys answered WRONG_SHARD until the deadline) for as long as that
/// coordinator stayed cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_with_an_old_map_is_passed_over_once_a_node_shows_a_newer_one() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let old = Client::connect(&[cluster.url.as_str()])
        .await
        .unwrap()
        .refresh_map()
        .await
        .unwrap();
    let direct = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    direct
        .create_namespace("newer", false, RetentionPolicy::Durable)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stale_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServiceServer::new(Stale {
                map: (*old).clone(),
            }))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let mut config = ClientConfig::new(&[stale_url.as_str(), cluster.url.as_str()]);
    config.watch = false;
    let client = Client::with_config(config).await.unwrap();
    assert_eq!(client.map().version, old.version, "the first seed's map");
    // A node's answer (here a NOT_FOUND) carries its newer map version.
    let error = client.get("default", b"no such key").await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::NotFound, "{error}");
    client
        .put("newer", b"k", b"written")
        .await
        .expect("the namespace is found in the next seed's map");
    assert!(client.map().version > old.version);
    assert_eq!(client.get("newer", b"k").await.unwrap(), b"written");
    cluster.stop().await;
}

/// A coordinator cut off from its store that keeps a map watch open: it
/// sends the map it cached, then nothing more; everything else it refuses,
/// so a node's heartbeats go to the next coordinator.
struct SilentWatch {
    map: ClusterMap,
}

#[tonic::async_trait]
impl CoordinatorService for SilentWatch {
    type WatchClusterMapStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ClusterMap, Status>> + Send>>;

    async fn get_cluster_map(
        &self,
        _: Request<GetClusterMapRequest>,
    ) -> Result<Response<ClusterMap>, Status> {
        Ok(Response::new(self.map.clone()))
    }

    async fn watch_cluster_map(
        &self,
        request: Request<WatchClusterMapRequest>,
    ) -> Result<Response<Self::WatchClusterMapStream>, Status> {
        let first =
            (self.map.version > request.get_ref().after_version).then(|| Ok(self.map.clone()));
        let stream =
            tokio_stream::StreamExt::chain(tokio_stream::iter(first), tokio_stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }

    unavailable! {
        advance_epoch(AdvanceEpochRequest) -> AdvanceEpochResponse;
        create_namespace(CreateNamespaceRequest) -> Namespace;
        register_node(RegisterNodeRequest) -> RegisterNodeResponse;
        heartbeat(HeartbeatRequest) -> HeartbeatResponse;
        prepare_node_stop(PrepareNodeStopRequest) -> PrepareNodeStopResponse;
        list_namespaces(ListNamespacesRequest) -> ListNamespacesResponse;
        set_retention(SetRetentionRequest) -> Namespace;
        get_epoch_status(GetEpochStatusRequest) -> EpochStatus;
        drain_node(DrainNodeRequest) -> DrainNodeResponse;
        split_shard(SplitShardRequest) -> SplitShardResponse;
        get_cluster_status(GetClusterStatusRequest) -> ClusterStatus;
        create_token(CreateTokenRequest) -> CreateTokenResponse;
        list_tokens(ListTokensRequest) -> ListTokensResponse;
        revoke_token(RevokeTokenRequest) -> RevokeTokenResponse;
        who_am_i(WhoAmIRequest) -> WhoAmIResponse;
        restore_map(RestoreMapRequest) -> RestoreMapResponse;
    }
}

/// A node whose map watch is held by a coordinator that no longer follows
/// its store (open, silent) catches up all the same: its heartbeats, which
/// another coordinator answers, carry the current map version, and a node
/// behind for two beats fetches the map there and watches elsewhere.
/// Before, the node kept its old map for as long as that coordinator stayed
/// cut off — revoked tokens accepted, new namespaces unknown, writes
/// stamped with an old epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_map_watch_went_silent_catches_up_through_its_heartbeats() {
    let mut cluster = LocalCluster::start(3, 1, 3).await;
    let client = Client::connect(&[cluster.url.as_str()]).await.unwrap();
    let old = client.refresh_map().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServiceServer::new(SilentWatch {
                map: (*old).clone(),
            }))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let real = cluster.url.clone();
    let i = cluster
        .add_node_with(|config| {
            if let Some(link) = config.coordinator.as_mut() {
                link.addresses = vec![silent_url.clone(), real.clone()];
            }
        })
        .await;
    // The map moves on: the node registered (through the real one), and a
    // namespace is created.
    client
        .create_namespace("later", false, RetentionPolicy::Durable)
        .await
        .unwrap();
    let current = client.refresh_map().await.unwrap().version;
    assert!(current > old.version);
    let node = cluster.nodes[i].as_ref().unwrap().node.clone();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while node.map().version < current {
        assert!(
            std::time::Instant::now() < deadline,
            "the node's map stayed at version {} (the coordinators' is {current})",
            node.map().version
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(node.map().namespaces.iter().any(|n| n.name == "later"));
    cluster.stop().await;
}
