//! The coordinator's Kubernetes decisions, against a scripted orchestrator
//! (the API server itself is exercised by `make k8s-test` on a real
//! cluster): zones come from the pod's Kubernetes node; a stopping pod at
//! or above the StatefulSet's replicas is drained and flagged, and undrained
//! when the StatefulSet grows back; restarts, uninstalls and operator
//! drains are left alone; a certificate speaks only for its own node.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tidepool_coordinator::kubernetes::Orchestrator;
use tidepool_coordinator::meta::EmbeddedStore;
use tidepool_coordinator::{CoordinatorConfig, CoordinatorError, Shared};
use tidepool_proto::v1::{NodeState, RegisterNodeRequest};
use tokio::sync::watch;

/// What the scripted API server answers.
struct Script {
    desired: Mutex<Result<Option<u32>, String>>,
    /// The zone lookups fail (the API unreachable).
    zones_fail: std::sync::atomic::AtomicBool,
}

#[tonic::async_trait]
impl Orchestrator for Script {
    fn statefulset(&self) -> &str {
        "tp-node"
    }

    async fn desired_nodes(&self) -> Result<Option<u32>, String> {
        self.desired.lock().clone()
    }

    async fn zone_of_pod(&self, pod: &str) -> Result<Option<String>, String> {
        if self.zones_fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("connection refused".into());
        }
        // Pods 0 and 2 in zone a, 1 in b; the rest on Kubernetes nodes
        // without the label: their host is their domain.
        Ok(match pod {
            "tp-node-0" | "tp-node-2" => Some("zone-a".into()),
            "tp-node-1" => Some("zone-b".into()),
            other => Some(tidepool_coordinator::kubernetes::host_domain(&format!(
                "k8s-{other}"
            ))),
        })
    }
}

async fn leader(orchestrator: Option<Arc<Script>>) -> (Arc<Shared>, watch::Sender<bool>) {
    let shared = Shared::new(
        CoordinatorConfig {
            key_prefix: "/k8s/".into(),
            ..CoordinatorConfig::default()
        },
        "c".into(),
        "http://c".into(),
        Arc::new(EmbeddedStore::in_memory()),
        Default::default(),
    );
    if let Some(o) = orchestrator {
        shared.set_orchestrator(o);
    }
    shared.ensure_cluster().await.unwrap();
    shared.load_map().await.unwrap();
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(shared.clone().campaign(stop_rx));
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared.leadership().is_none() {
        assert!(Instant::now() < deadline, "no leadership");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (shared, stop)
}

async fn register(shared: &Shared, node_id: u64, pod: &str, zone: &str) -> u64 {
    let request = RegisterNodeRequest {
        node_id,
        address: format!("https://{pod}:7401"),
        zone: zone.into(),
        capacity_bytes: 1 << 30,
        cluster_id: String::new(),
    };
    shared.register_node(request, Some(pod)).await.unwrap().0
}

fn state(shared: &Shared, node_id: u64) -> (NodeState, bool) {
    let map = shared.map();
    let node = map.nodes.iter().find(|n| n.node_id == node_id).unwrap();
    (NodeState::try_from(node.state).unwrap(), node.scale_down)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_downs_drain_and_scale_ups_undrain() {
    let script = Arc::new(Script {
        desired: Mutex::new(Ok(Some(5))),
        zones_fail: Default::default(),
    });
    let (shared, _stop) = leader(Some(script.clone())).await;
    let mut ids = Vec::new();
    // Pod 4 was given no zone.
    let reported = |i| if i == 4 { "" } else { "reported" };
    for i in 0..5 {
        ids.push(register(&shared, 0, &format!("tp-node-{i}"), reported(i)).await);
    }
    // A registration asked again (its answer lost) gets the same id: the
    // same certificate and address, an id that holds nothing yet.
    assert_eq!(register(&shared, 0, "tp-node-4", "").await, ids[4]);
    assert_eq!(shared.map().nodes.len(), 5);
    let zones: Vec<String> = shared.map().nodes.iter().map(|n| n.zone.clone()).collect();
    assert_eq!(
        zones,
        [
            "zone-a",
            "zone-b",
            "zone-a",
            "reported",
            "host:k8s-tp-node-4"
        ],
        "Kubernetes zones win; where the node has no label, the zone the node was given, else its host"
    );

    // A restart: the StatefulSet still wants every pod.
    let answer = shared
        .prepare_node_stop(ids[4], Some("tp-node-4"))
        .await
        .unwrap();
    assert!(!answer.leaving, "{answer:?}");
    assert_eq!(state(&shared, ids[4]), (NodeState::Up, false));

    // Scaled to 3: pods 3 and 4 leave, 2 does not.
    *script.desired.lock() = Ok(Some(3));
    for i in [3, 4] {
        let pod = format!("tp-node-{i}");
        let answer = shared.prepare_node_stop(ids[i], Some(&pod)).await.unwrap();
        assert!(answer.leaving, "{answer:?}");
        assert_eq!(state(&shared, ids[i]), (NodeState::Draining, true));
        // It hosts no shard the map lists, but only the reconciler says it
        // is drained (it also counts a split's new group not yet listed):
        // the pod waits until then.
        assert_eq!(answer.replicas, 1, "{answer:?}");
        // Asking again changes nothing.
        let again = shared.prepare_node_stop(ids[i], Some(&pod)).await.unwrap();
        assert!(again.leaving);
    }
    let answer = shared
        .prepare_node_stop(ids[2], Some("tp-node-2"))
        .await
        .unwrap();
    assert!(!answer.leaving);

    // A certificate speaks only for its own node.
    let refused = shared.prepare_node_stop(ids[3], Some("tp-node-2")).await;
    assert!(
        matches!(refused, Err(CoordinatorError::PermissionDenied(_))),
        "{refused:?}"
    );

    // Grown back to 4 while pod 3 waits in its hook: it stays.
    *script.desired.lock() = Ok(Some(4));
    let answer = shared
        .prepare_node_stop(ids[3], Some("tp-node-3"))
        .await
        .unwrap();
    assert!(!answer.leaving, "{answer:?}");
    assert_eq!(state(&shared, ids[3]), (NodeState::Up, false));
    // Grown to 5: pod 4 comes back on its volume and registers: undrained
    // — once the API says so (while it fails, the registration fails and
    // the node asks again; before, it stayed drained until its next stop).
    *script.desired.lock() = Err("connection refused".into());
    let request = RegisterNodeRequest {
        node_id: ids[4],
        address: "https://tp-node-4:7401".into(),
        ..RegisterNodeRequest::default()
    };
    let failed = shared.register_node(request, Some("tp-node-4")).await;
    assert!(
        matches!(failed, Err(CoordinatorError::Kubernetes(_))),
        "{failed:?}"
    );
    assert_eq!(state(&shared, ids[4]), (NodeState::Draining, true));
    *script.desired.lock() = Ok(Some(5));
    register(&shared, ids[4], "tp-node-4", "").await;
    assert_eq!(state(&shared, ids[4]), (NodeState::Up, false));

    // A zone lookup that fails keeps the zone the map has (the node
    // reports none: it was made empty, and placement took the node for a
    // zone of its own).
    script
        .zones_fail
        .store(true, std::sync::atomic::Ordering::Relaxed);
    register(&shared, ids[0], "tp-node-0", "").await;
    let zone = |id: u64| {
        let map = shared.map();
        map.nodes
            .iter()
            .find(|n| n.node_id == id)
            .unwrap()
            .zone
            .clone()
    };
    assert_eq!(zone(ids[0]), "zone-a");
    script
        .zones_fail
        .store(false, std::sync::atomic::Ordering::Relaxed);

    // An operator's drain is never undone by Kubernetes.
    shared.drain_node(ids[1]).await.unwrap();
    let answer = shared
        .prepare_node_stop(ids[1], Some("tp-node-1"))
        .await
        .unwrap();
    assert!(!answer.leaving);
    register(&shared, ids[1], "tp-node-1", "").await;
    assert_eq!(state(&shared, ids[1]), (NodeState::Draining, false));

    // Uninstall (StatefulSet gone): nobody drains.
    *script.desired.lock() = Ok(None);
    let answer = shared
        .prepare_node_stop(ids[4], Some("tp-node-4"))
        .await
        .unwrap();
    assert!(!answer.leaving, "{answer:?}");
    assert_eq!(state(&shared, ids[4]), (NodeState::Up, false));

    // The API failing: an error the hook retries, no change.
    *script.desired.lock() = Err("connection refused".into());
    let failed = shared.prepare_node_stop(ids[4], Some("tp-node-4")).await;
    assert!(
        matches!(failed, Err(CoordinatorError::Kubernetes(_))),
        "{failed:?}"
    );
    assert_eq!(state(&shared, ids[4]), (NodeState::Up, false));
}

/// One node certificate gets one id while that node is up: asked again
/// under another address string it is refused (it got a new id every
/// time — as many "nodes" as it liked, placement putting several replicas
/// of a shard on one process); asked again the same way (an answer lost),
/// it gets the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_whose_node_is_up_gets_no_second_id() {
    let (shared, _stop) = leader(None).await;
    let id = register(&shared, 0, "tp-node-7", "rack-1").await;
    assert_eq!(register(&shared, 0, "tp-node-7", "rack-1").await, id);
    for address in ["https://tp-node-7:7401/", "https://tp-node-7:7401/?1"] {
        let request = RegisterNodeRequest {
            address: address.into(),
            ..RegisterNodeRequest::default()
        };
        let refused = shared.register_node(request, Some("tp-node-7")).await;
        assert!(
            matches!(refused, Err(CoordinatorError::Conflict(_))),
            "{address}: {refused:?}"
        );
    }
    assert_eq!(shared.map().nodes.len(), 1);
    // Another certificate is another node.
    assert_ne!(register(&shared, 0, "tp-node-8", "rack-1").await, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_kubernetes_a_stop_is_a_restart() {
    let (shared, _stop) = leader(None).await;
    let id = register(&shared, 0, "tp-node-7", "rack-1").await;
    assert_eq!(shared.map().nodes[0].zone, "rack-1");
    let answer = shared
        .prepare_node_stop(id, Some("tp-node-7"))
        .await
        .unwrap();
    assert!(!answer.leaving);
    assert_eq!(state(&shared, id), (NodeState::Up, false));
    let unknown = shared.prepare_node_stop(99, None).await;
    assert!(
        matches!(unknown, Err(CoordinatorError::UnknownNode(99))),
        "{unknown:?}"
    );
}
