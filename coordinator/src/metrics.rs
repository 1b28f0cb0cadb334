//! The coordinator's metrics, read at scrape time from what it holds
//! (the map, leadership, the reconciler's last round) and served by the
//! shared endpoint of `tidepool-telemetry`: leadership, map version, epoch,
//! nodes by state, shards (all, leaderless, under-replicated), moves, epoch
//! drop progress per namespace, and every gRPC method served. Listed in
//! `docs/operations/metrics.md`.

use std::sync::{Arc, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tidepool_proto::v1::NodeState;
use tidepool_telemetry::RequestMetrics;

use crate::core::Shared;
use crate::reconcile::Progress;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NamespaceLabels {
    namespace: String,
}

/// Reads the coordinator's state at scrape time.
#[derive(Debug)]
struct CoordinatorCollector {
    shared: Weak<Shared>,
}

fn single(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    metric_type: MetricType,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let family = encoder.encode_descriptor(name, help, None, metric_type)?;
    match metric_type {
        MetricType::Counter => ConstCounter::new(value).encode(family),
        _ => ConstGauge::new(value as i64).encode(family),
    }
}

impl CoordinatorCollector {
    /// The reconcile rounds' figures. The gauges are the leader's view as
    /// of its last round: a coordinator that does not lead exports none
    /// (a deposed leader's last counts stayed exported as they were, and
    /// alerts taking the highest across coordinators fired until it
    /// restarted); the counters are this coordinator's own.
    fn encode_progress(
        progress: &Progress,
        leading: bool,
        encoder: &mut DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use MetricType::{Counter, Gauge};
        for (name, help, kind, value) in [
            (
                "tidepool_coordinator_shards",
                "Shards in the map (leader only, as of its last round).",
                Gauge,
                u64::from(progress.shards),
            ),
            (
                "tidepool_coordinator_shards_leaderless",
                "Shards no replica reports leading (leader only).",
                Gauge,
                u64::from(progress.leaderless),
            ),
            (
                "tidepool_coordinator_shards_under_replicated",
                "Shards with fewer live voters than the replication factor (leader only).",
                Gauge,
                u64::from(progress.under_replicated),
            ),
            (
                "tidepool_coordinator_moves_in_progress",
                "Shards changing membership (leader only).",
                Gauge,
                progress.moves.len() as u64,
            ),
            (
                "tidepool_coordinator_moves_completed",
                "Replica moves this coordinator completed.",
                Counter,
                progress.moves_done,
            ),
            (
                "tidepool_coordinator_moves_abandoned",
                "Learners removed for making no progress catching up (their moves planned again elsewhere).",
                Counter,
                progress.moves_abandoned,
            ),
            (
                "tidepool_coordinator_reconcile_rounds",
                "Reconcile rounds run while leading.",
                Counter,
                progress.rounds,
            ),
            (
                "tidepool_coordinator_reconcile_errors",
                "Reconcile rounds or steps that failed.",
                Counter,
                progress.errors,
            ),
        ] {
            if kind == Counter || leading {
                single(encoder, name, help, kind, value)?;
            }
        }
        if !leading {
            return Ok(());
        }
        for (name, help, read) in [
            (
                "tidepool_coordinator_epoch_drop_target",
                "Per namespace with retention: the epoch below which data is to be dropped (0: nothing yet).",
                (|ns| ns.drop_below) as fn(&tidepool_proto::v1::NamespaceDropStatus) -> u64,
            ),
            (
                "tidepool_coordinator_epoch_drop_shards_pending",
                "Per namespace with retention: shards that have not yet applied the drop target.",
                |ns| u64::from(ns.shards_total.saturating_sub(ns.shards_done)),
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for ns in &progress.epochs.namespaces {
                let labels = NamespaceLabels {
                    namespace: ns.namespace.clone(),
                };
                ConstGauge::new(read(ns) as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

impl Collector for CoordinatorCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(shared) = self.shared.upgrade() else {
            return Ok(());
        };
        let map = shared.map();
        let progress = shared.progress.lock().clone();
        use MetricType::Gauge;
        let leading = u64::from(shared.leadership().is_some());
        single(
            &mut encoder,
            "tidepool_coordinator_is_leader",
            "1 while this coordinator leads.",
            Gauge,
            leading,
        )?;
        single(
            &mut encoder,
            "tidepool_coordinator_map_version",
            "Version of the cluster map this coordinator holds.",
            Gauge,
            map.version,
        )?;
        single(
            &mut encoder,
            "tidepool_coordinator_epoch",
            "Current cluster epoch.",
            Gauge,
            map.epoch,
        )?;
        let mut nodes = encoder.encode_descriptor(
            "tidepool_coordinator_nodes",
            "Nodes in the map by state.",
            None,
            Gauge,
        )?;
        for state in [
            NodeState::Up,
            NodeState::Down,
            NodeState::Draining,
            NodeState::Drained,
        ] {
            let count = map.nodes.iter().filter(|n| n.state == state as i32).count();
            let name = state.as_str_name().trim_start_matches("NODE_STATE_");
            let labels = StateLabels {
                state: match name {
                    "UP" => "up",
                    "DOWN" => "down",
                    "DRAINING" => "draining",
                    _ => "drained",
                },
            };
            ConstGauge::new(count as i64).encode(nodes.encode_family(&labels)?)?;
        }
        Self::encode_progress(&progress, leading == 1, &mut encoder)
    }
}

/// The coordinator's metrics endpoint.
pub(crate) struct CoordinatorExposition {
    shared: Weak<Shared>,
    registry: Registry,
}

impl CoordinatorExposition {
    /// The endpoint of `shared`, counting requests in `rpc`.
    pub(crate) fn new(shared: &Arc<Shared>, rpc: &RequestMetrics) -> Self {
        let mut registry = Registry::default();
        rpc.register(&mut registry);
        registry.register_collector(Box::new(CoordinatorCollector {
            shared: Arc::downgrade(shared),
        }));
        if let Some(tls) = &shared.security.tls {
            registry.register_collector(Box::new(tidepool_telemetry::metrics::TlsExpiry::of(
                tls.clone(),
            )));
        }
        Self {
            shared: Arc::downgrade(shared),
            registry,
        }
    }
}

impl tidepool_telemetry::Exposition for CoordinatorExposition {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Serving: the map is loaded (the store answered).
    fn ready(&self) -> Result<(), String> {
        match self.shared.upgrade() {
            Some(shared) if shared.map().version > 0 => Ok(()),
            _ => Err("no cluster map loaded".into()),
        }
    }
}
