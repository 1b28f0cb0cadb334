//! The Tidepool coordinator: owns the cluster map (in etcd, or an embedded
//! store in dev mode), places shard replicas on nodes, keeps them placed as
//! nodes come and go, and drives epochs across the cluster.
//!
//! What this crate is **not**: it never stores or reads blobs and has no
//! dependency on the engine or the node; it talks to nodes over gRPC only.
//!
//! Parts: [`meta`] (the metadata store: etcd or embedded), [`schema`] (keys
//! and the map's encoding), [`placement`] and [`plan`] (pure decisions),
//! `core` (cached map, election with a fencing generation, fenced map
//! updates), `reconcile` (the leader's loop), `ops` and `service` (the
//! gRPC API), [`epochs`] (retention arithmetic and progress). Start one
//! with [`start`]. Design: `docs/design/placement.md`,
//! `docs/design/coordinator.md`, `docs/design/epochs-cluster.md`.

pub mod config;
mod core;
pub mod epochs;
pub mod kubernetes;
pub mod meta;
mod metrics;
mod nodes;
mod ops;
pub mod placement;
pub mod plan;
mod reconcile;
pub mod schema;
mod service;
pub mod splits;
mod tokens;
mod transfers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use config::CoordinatorConfig;
pub use core::Shared;
use meta::{EmbeddedStore, EtcdStore, MetaError, MetaStore};
pub use ops::{RESTORE_ID_SKIP, RESTORE_VERSION_SKIP, next_namespace_id};
pub use reconcile::Progress;
use tidepool_proto::v1::coordinator_service_server::CoordinatorServiceServer;

/// Errors of the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// A setting is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// The metadata store failed.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// Stored metadata could not be decoded.
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
    /// This coordinator does not lead (or just lost leadership).
    #[error("this coordinator is not the leader")]
    NotLeader,
    /// The store holds no cluster yet.
    #[error("the cluster is not created yet")]
    NoCluster,
    /// A node could not be reached.
    #[error("node: {0}")]
    Node(String),
    /// A node refused a call.
    #[error("{what}: {message}")]
    NodeCall {
        /// The call.
        what: String,
        /// The node's error code (`ErrorCode`).
        code: i32,
        /// The node's message.
        message: String,
    },
    /// The node is not in the map.
    #[error("no node {0} in the cluster map")]
    UnknownNode(u64),
    /// The shard has no known leader.
    #[error("shard {0} has no known leader")]
    NoLeader(u32),
    /// A retention is in the map but not yet recorded by every shard
    /// (`Shared::record_retention`); calling again finishes it.
    #[error("{0}")]
    Unrecorded(String),
    /// The request conflicts with the current state.
    #[error("conflict: {0}")]
    Conflict(String),
    /// A request field is invalid.
    #[error("{0}")]
    InvalidArgument(String),
    /// The namespace exists already.
    #[error("namespace {0:?} exists already")]
    NamespaceExists(String),
    /// No such namespace.
    #[error("no namespace {0:?}")]
    NamespaceNotFound(String),
    /// Binding or serving failed.
    #[error("i/o: {0}")]
    Io(String),
    /// The caller may not do this (a certificate speaking for another
    /// node).
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// No token has that name.
    #[error("no token {0:?}")]
    TokenNotFound(String),
    /// The Kubernetes API failed or refused.
    #[error("{0}")]
    Kubernetes(String),
    /// A node of another cluster (its data directory holds that cluster's
    /// map).
    #[error("{0}")]
    WrongCluster(String),
}

/// Concurrent calls on one client connection (watches included).
const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// HTTP/2 pings on an idle connection, and how long an answer may take
/// before the connection is closed.
const KEEPALIVE: Duration = Duration::from_secs(20);

/// A coordinator serving on its socket.
pub struct RunningCoordinator {
    /// Its state (map, leadership, progress).
    pub shared: Arc<Shared>,
    /// The bound gRPC address.
    pub address: SocketAddr,
    /// The bound metrics address, if any.
    pub metrics_address: Option<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    server: tokio::task::JoinHandle<Result<(), CoordinatorError>>,
}

impl std::fmt::Debug for RunningCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningCoordinator")
            .field("id", &self.shared.id)
            .field("address", &self.address)
            .finish()
    }
}

impl RunningCoordinator {
    /// Resigns leadership (so another replica takes over at once) and stops
    /// serving.
    pub async fn stop(mut self) -> Result<(), CoordinatorError> {
        self.shared.begin_stop();
        for task in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        match tokio::time::timeout(Duration::from_secs(5), &mut self.server).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(CoordinatorError::Io(format!("server task: {e}"))),
            Err(_) => {
                self.server.abort();
                Ok(())
            }
        }
    }

    /// Waits until the server ends.
    pub async fn wait(&mut self) -> Result<(), CoordinatorError> {
        match (&mut self.server).await {
            Ok(result) => result,
            Err(e) => Err(CoordinatorError::Io(format!("server task: {e}"))),
        }
    }
}

/// Opens the metadata store the configuration names.
pub async fn open_store(
    config: &CoordinatorConfig,
) -> Result<Arc<dyn MetaStore>, CoordinatorError> {
    Ok(if !config.etcd.is_empty() {
        Arc::new(EtcdStore::connect(&config.etcd, config.etcd_tls.as_ref()).await?)
    } else if let Some(path) = &config.embedded_path {
        Arc::new(EmbeddedStore::open(path)?)
    } else {
        Arc::new(EmbeddedStore::in_memory())
    })
}

/// Starts a coordinator on the store the configuration names (etcd, or
/// the embedded store's file; a coordinator whose map would vanish with
/// the process is refused).
pub async fn start(config: CoordinatorConfig) -> Result<RunningCoordinator, CoordinatorError> {
    config.validate()?;
    if config.etcd.is_empty() && config.embedded_path.is_none() {
        return Err(CoordinatorError::Config(
            "give etcd endpoints (--etcd) or an embedded store file (--embedded-path)".into(),
        ));
    }
    let store = open_store(&config).await?;
    start_with_store(config, store).await
}

/// Starts a coordinator on `store` (dev mode shares an embedded store).
/// Binds before returning.
pub async fn start_with_store(
    config: CoordinatorConfig,
    store: Arc<dyn MetaStore>,
) -> Result<RunningCoordinator, CoordinatorError> {
    config.validate()?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| CoordinatorError::Io(format!("cannot bind {}: {e}", config.listen)))?;
    let address = listener
        .local_addr()
        .map_err(|e| CoordinatorError::Io(e.to_string()))?;
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| CoordinatorError::Io(format!("cannot bind {addr}: {e}")))?,
        ),
        None => None,
    };
    let metrics_address = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    let tls = match &config.tls {
        Some(files) => Some(
            tidepool_security::Tls::load(files.clone())
                .map_err(|e| CoordinatorError::Config(format!("tls: {e}")))?,
        ),
        None => None,
    };
    let advertise = config.advertise.clone().unwrap_or_else(|| {
        let scheme = if tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{address}")
    });
    let id = config
        .id
        .clone()
        .unwrap_or_else(|| format!("coordinator@{advertise}"));
    let security = tidepool_security::Security {
        tls: tls.clone(),
        token: None,
    };
    let kubernetes = config.kubernetes.clone();
    let shared = Shared::new(config, id, advertise, store, security);
    if let Some(settings) = kubernetes {
        let k8s = kubernetes::Kubernetes::connect(settings)
            .await
            .map_err(CoordinatorError::Config)?;
        shared.set_orchestrator(Arc::new(k8s));
    }
    shared.ensure_cluster().await?;
    shared.adopt_bootstrap_token().await?;
    shared.load_map().await?;
    let stop_rx = shared.stopping();
    let mut tasks = vec![
        tokio::spawn(shared.clone().follow_map(stop_rx.clone())),
        tokio::spawn(shared.clone().campaign(stop_rx.clone())),
        tokio::spawn(reconcile::run(shared.clone(), stop_rx.clone())),
    ];
    let rpc = tidepool_telemetry::RequestMetrics::default();
    if let Some(listener) = metrics_listener {
        let exposition = Arc::new(metrics::CoordinatorExposition::new(&shared, &rpc));
        let mut stop = stop_rx.clone();
        tasks.push(tokio::spawn(tidepool_telemetry::metrics::serve(
            listener,
            exposition,
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        )));
    }
    // Every method is counted, refused ones too (outside the guard).
    let counted = rpc.layer(
        "grpc",
        tidepool_telemetry::MethodNames::grpc(
            tidepool_security::planes::METHODS
                .iter()
                .map(|(path, _)| *path),
        ),
    );
    let api = CoordinatorServiceServer::new(service::CoordinatorApi::new(shared.clone()));
    let guard = match &tls {
        Some(_) => tidepool_security::GuardLayer::secured(shared.clone()),
        None => {
            tracing::warn!(
                coordinator = %shared.id,
                "INSECURE: no TLS; every caller may call every method, including admin ones"
            );
            tidepool_security::GuardLayer::open()
        }
    };
    let mut server_stop = stop_rx;
    let server = tokio::spawn(async move {
        // Bounded like a node's server: a caller opening streams without
        // end (each watch holds a task and map copies) or leaving dead
        // connections must not exhaust the coordinator.
        let router = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
            .max_frame_size(Some(tidepool_security::MAX_FRAME_BYTES))
            .http2_keepalive_interval(Some(KEEPALIVE))
            .http2_keepalive_timeout(Some(KEEPALIVE))
            .layer(counted)
            .layer(guard)
            .add_service(api);
        let stopped = async move {
            let _ = server_stop.wait_for(|s| *s).await;
        };
        tidepool_security::tls::serve(router, listener, tls, stopped)
            .await
            .map_err(|e| CoordinatorError::Io(format!("gRPC server: {e}")))
    });
    tracing::info!(coordinator = %shared.id, %address, "coordinator serving");
    Ok(RunningCoordinator {
        shared,
        address,
        metrics_address,
        tasks,
        server,
    })
}
