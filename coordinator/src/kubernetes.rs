//! What only Kubernetes knows, for a coordinator the Helm chart deploys
//! (`[kubernetes]` in its configuration; outside Kubernetes none of this
//! runs and the coordinator behaves as everywhere else).
//!
//! Two questions, each asked of the API server when it matters rather than
//! cached:
//!
//! - **Where a node pod runs**: the `topology.kubernetes.io/zone` label of
//!   the Kubernetes node hosting the pod named by the node's certificate
//!   becomes the node's zone at registration, so placement spreads a
//!   shard's replicas across zones the operator never had to configure.
//! - **Whether a stopping pod leaves for good**: a pod whose ordinal is at
//!   or above the node StatefulSet's `spec.replicas` was scaled away; its
//!   pre-stop hook asks (`PrepareNodeStop`) and the coordinator drains it
//!   before its container may exit. A restart, an upgrade or an uninstall
//!   (the StatefulSet deleted) is not a scale-down: the node stops at once
//!   and keeps its volume.
//!
//! Design and failure cases: `docs/design/kubernetes.md`.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use serde::Deserialize;

/// The label Kubernetes puts on nodes for their zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// `[kubernetes]`: where the coordinator finds its cluster's pods.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace of the node StatefulSet.
    pub namespace: String,
    /// Name of the node StatefulSet; node pods are `<statefulset>-<n>` and
    /// their certificates name them so.
    pub statefulset: String,
    /// Read zones from the Kubernetes nodes (needs `get` on `nodes`, a
    /// cluster-scoped permission). Default true. Off, each pod's host is
    /// its failure domain (read from the pod: namespaced).
    #[serde(default = "yes")]
    pub zones: bool,
}

fn yes() -> bool {
    true
}

/// The ordinal `n` of a pod named `<statefulset>-<n>`.
pub fn ordinal(statefulset: &str, pod: &str) -> Option<u32> {
    let digits = pod.strip_prefix(statefulset)?.strip_prefix('-')?;
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    digits.parse().ok()
}

/// The orchestrator's answers (the API server; a fake in unit tests).
#[tonic::async_trait]
pub trait Orchestrator: Send + Sync + 'static {
    /// The node StatefulSet's name.
    fn statefulset(&self) -> &str;

    /// Node pods the StatefulSet wants (`spec.replicas`); `None` when the
    /// StatefulSet is gone or being deleted.
    async fn desired_nodes(&self) -> Result<Option<u32>, String>;

    /// The zone of the Kubernetes node that runs `pod` (its host's domain,
    /// [`host_domain`], when the node has no zone label or zones are off);
    /// `None` when the pod or its node is missing.
    async fn zone_of_pod(&self, pod: &str) -> Result<Option<String>, String>;
}

/// The API server, through the pod's service account.
pub struct Kubernetes {
    config: KubernetesConfig,
    client: kube::Client,
}

impl std::fmt::Debug for Kubernetes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubernetes")
            .field("config", &self.config)
            .finish()
    }
}

impl Kubernetes {
    /// A client from the in-cluster environment (or `KUBECONFIG`).
    pub async fn connect(config: KubernetesConfig) -> Result<Self, String> {
        let client = kube::Client::try_default()
            .await
            .map_err(|e| format!("cannot reach the Kubernetes API: {e}"))?;
        Ok(Self { config, client })
    }
}

fn api_error(what: &str, e: kube::Error) -> String {
    format!("Kubernetes API, {what}: {e}")
}

#[tonic::async_trait]
impl Orchestrator for Kubernetes {
    fn statefulset(&self) -> &str {
        &self.config.statefulset
    }

    async fn desired_nodes(&self) -> Result<Option<u32>, String> {
        let sets: Api<StatefulSet> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let what = format!("statefulset {}", self.config.statefulset);
        let Some(set) = sets
            .get_opt(&self.config.statefulset)
            .await
            .map_err(|e| api_error(&what, e))?
        else {
            return Ok(None);
        };
        if set.metadata.deletion_timestamp.is_some() {
            return Ok(None);
        }
        let replicas = set.spec.and_then(|s| s.replicas).unwrap_or(1);
        Ok(Some(u32::try_from(replicas).unwrap_or(0)))
    }

    async fn zone_of_pod(&self, pod: &str) -> Result<Option<String>, String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let Some(host) = pods
            .get_opt(pod)
            .await
            .map_err(|e| api_error(&format!("pod {pod}"), e))?
            .and_then(|p| p.spec)
            .and_then(|s| s.node_name)
        else {
            return Ok(None);
        };
        if !self.config.zones {
            // No permission on nodes (cluster-wide): the pod's host is its
            // failure domain — read from the pod (namespaced). Before, a
            // cluster without zones put every node in one empty domain,
            // and two replicas of a shard could share a host.
            return Ok(Some(host_domain(&host)));
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        let zone = nodes
            .get_opt(&host)
            .await
            .map_err(|e| api_error(&format!("node {host}"), e))?
            .and_then(|n| n.metadata.labels)
            .and_then(|mut labels| labels.remove(ZONE_LABEL));
        Ok(Some(zone.unwrap_or_else(|| host_domain(&host))))
    }
}

/// How [`host_domain`]'s domains begin.
pub const HOST_DOMAIN_PREFIX: &str = "host:";

/// The failure domain of a pod on Kubernetes node `host` that carries no
/// zone label: the host itself. Without it every such pod's node reported
/// the same empty zone, and with the chart's soft anti-affinity two node
/// pods on one host could hold two of a shard's three replicas (one host
/// down, the shard without a majority). At most 64 bytes (the zone limit):
/// a longer host name is shortened to a digest of it.
pub fn host_domain(host: &str) -> String {
    const PREFIX: &str = HOST_DOMAIN_PREFIX;
    if PREFIX.len() + host.len() <= 64 {
        return format!("{PREFIX}{host}");
    }
    let digest = tidepool_security::token::hash(host);
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{PREFIX}{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_are_only_those_of_the_statefulset() {
        assert_eq!(ordinal("tp-node", "tp-node-0"), Some(0));
        assert_eq!(ordinal("tp-node", "tp-node-12"), Some(12));
        assert_eq!(ordinal("tp-node", "tp-node-"), None);
        assert_eq!(ordinal("tp-node", "tp-node-01"), None);
        assert_eq!(ordinal("tp-node", "tp-node-x"), None);
        assert_eq!(ordinal("tp-node", "tp-nodes-1"), None);
        assert_eq!(ordinal("tp-node", "other-1"), None);
        assert_eq!(ordinal("tp-node", "tp-node-1-2"), None);
        assert_eq!(ordinal("tp-node", "tp-node-99999999999"), None);
    }

    #[test]
    fn unlabelled_hosts_are_domains_of_their_own_within_the_zone_limit() {
        assert_eq!(host_domain("worker-1"), "host:worker-1");
        let long = "x".repeat(80);
        let domain = host_domain(&long);
        assert!(
            domain.len() <= 64 && domain.starts_with("host:"),
            "{domain}"
        );
        assert_eq!(domain, host_domain(&long), "the same host, the same domain");
        assert_ne!(domain, host_domain(&"y".repeat(80)));
    }

    #[test]
    fn configuration_defaults_to_reading_zones() {
        let c: KubernetesConfig =
            toml::from_str("namespace = \"ns\"\nstatefulset = \"tp-node\"").expect("parses");
        assert!(c.zones);
        assert!(toml::from_str::<KubernetesConfig>("namespace = \"ns\"").is_err());
    }
}
