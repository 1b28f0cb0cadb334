//! Which plane each gRPC method belongs to. Every method of every Tidepool
//! service is listed here; a path not listed belongs to no plane and is
//! refused on secured servers (a test checks the table against the
//! `.proto` files).

/// A group of methods authorized alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Plane {
    /// Blob operations on nodes: a bearer token, with the role the method
    /// needs in the request's namespace (checked by the handler).
    Client,
    /// The coordinator's reads (map, status, namespaces, epochs): any valid
    /// token, or a node or coordinator certificate.
    ClusterRead,
    /// Raft traffic and snapshot pulls between nodes: a node certificate
    /// (the handler further checks that it speaks for the message's
    /// sender).
    Peer,
    /// The nodes' admin calls (replicas, membership, leadership, admin
    /// entries): a coordinator certificate.
    NodeAdmin,
    /// A node registering with and heartbeating to the coordinator: a node
    /// certificate (bound to the node id at first registration).
    Registration,
    /// The coordinator's changes (namespaces, retention, epochs, drains,
    /// tokens): an admin token.
    ClusterAdmin,
}

/// Every method, by its gRPC path.
pub const METHODS: &[(&str, Plane)] = &[
    ("/tidepool.v1.BlobService/Put", Plane::Client),
    ("/tidepool.v1.BlobService/Get", Plane::Client),
    ("/tidepool.v1.BlobService/Head", Plane::Client),
    ("/tidepool.v1.BlobService/BatchExists", Plane::Client),
    ("/tidepool.v1.BlobService/Delete", Plane::Client),
    ("/tidepool.v1.BlobService/Touch", Plane::Client),
    ("/tidepool.v1.BlobService/List", Plane::Client),
    ("/tidepool.v1.RaftTransport/Send", Plane::Peer),
    ("/tidepool.v1.RaftTransport/FetchSnapshot", Plane::Peer),
    ("/tidepool.v1.NodeAdmin/OpenReplica", Plane::NodeAdmin),
    ("/tidepool.v1.NodeAdmin/ChangeMembership", Plane::NodeAdmin),
    ("/tidepool.v1.NodeAdmin/TransferLeader", Plane::NodeAdmin),
    ("/tidepool.v1.NodeAdmin/CloseReplica", Plane::NodeAdmin),
    ("/tidepool.v1.NodeAdmin/ProposeAdmin", Plane::NodeAdmin),
    ("/tidepool.v1.NodeAdmin/Status", Plane::NodeAdmin),
    ("/tidepool.v1.NodeAdmin/HeldMap", Plane::NodeAdmin),
    (
        "/tidepool.v1.CoordinatorService/GetClusterMap",
        Plane::ClusterRead,
    ),
    (
        "/tidepool.v1.CoordinatorService/WatchClusterMap",
        Plane::ClusterRead,
    ),
    (
        "/tidepool.v1.CoordinatorService/ListNamespaces",
        Plane::ClusterRead,
    ),
    (
        "/tidepool.v1.CoordinatorService/GetEpochStatus",
        Plane::ClusterRead,
    ),
    (
        "/tidepool.v1.CoordinatorService/GetClusterStatus",
        Plane::ClusterRead,
    ),
    ("/tidepool.v1.CoordinatorService/WhoAmI", Plane::ClusterRead),
    (
        "/tidepool.v1.CoordinatorService/RegisterNode",
        Plane::Registration,
    ),
    (
        "/tidepool.v1.CoordinatorService/Heartbeat",
        Plane::Registration,
    ),
    (
        "/tidepool.v1.CoordinatorService/PrepareNodeStop",
        Plane::Registration,
    ),
    (
        "/tidepool.v1.CoordinatorService/CreateNamespace",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/SetRetention",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/AdvanceEpoch",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/DrainNode",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/SplitShard",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/CreateToken",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/ListTokens",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/RevokeToken",
        Plane::ClusterAdmin,
    ),
    (
        "/tidepool.v1.CoordinatorService/RestoreMap",
        Plane::ClusterAdmin,
    ),
];

/// The plane of the method at `path`.
pub fn plane_of(path: &str) -> Option<Plane> {
    METHODS
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, plane)| *plane)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `rpc` of every service in the `.proto` files is in the table,
    /// and the table names nothing else.
    #[test]
    fn every_method_of_every_service_has_a_plane() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/tidepool/v1");
        let mut declared = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let mut service = None;
            for line in text.lines().map(str::trim) {
                if let Some(rest) = line.strip_prefix("service ") {
                    service = rest.split_whitespace().next().map(str::to_string);
                } else if let (Some(rest), Some(service)) = (line.strip_prefix("rpc "), &service) {
                    let method = rest.split('(').next().unwrap().trim();
                    declared.push(format!("/tidepool.v1.{service}/{method}"));
                }
            }
        }
        assert!(declared.len() >= 20, "{declared:?}");
        for path in &declared {
            assert!(plane_of(path).is_some(), "{path} has no plane");
        }
        for (path, _) in METHODS {
            assert!(
                declared.contains(&path.to_string()),
                "{path} is not a method"
            );
        }
        assert_eq!(plane_of("/grpc.reflection.v1.ServerReflection/Info"), None);
    }
}
