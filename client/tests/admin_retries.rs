//! Cluster changes repeated after an attempt whose answer was lost take
//! effect once and report what happened.
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
