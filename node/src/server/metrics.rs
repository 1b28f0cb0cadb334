//! What a node measures, as a [`prometheus_client`] registry served by the
//! shared endpoint of `tidepool-telemetry` (`/metrics`, `/healthz`,
//! `/readyz`). Every metric is listed in `docs/operations/metrics.md`.
//!
//! Two kinds of sources:
//! - instruments updated on the request path ([`NodeMetrics`]: requests,
//!   errors by stable code, latency, bytes; the RPC layer's counts of every
//!   gRPC method);
//! - a collector read at scrape time ([`ShardCollector`]): each hosted
//!   replica's Raft state, its owner's counters and commit latency, its
//!   engine's metrics snapshot, and the data directory's disk.
//!
//! Every series carries `node_id`.

use std::borrow::Cow;
use std::sync::{Arc, Weak};
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tidepool_engine::MetricsSnapshot;
use tidepool_telemetry::RequestMetrics;
use tidepool_telemetry::metrics::latency_buckets;

use super::Node;
use crate::shard::{ShardState, ShardStats};

/// The client operations measured.
pub const OPERATIONS: [&str; 7] = [
    "put",
    "get",
    "head",
    "batch_exists",
    "delete",
    "touch",
    "list",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    op: &'static str,
    code: &'static str,
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// The instruments of the request path.
#[derive(Debug)]
pub struct NodeMetrics {
    requests_family: Family<OpLabels, Counter>,
    latency_family: Family<OpLabels, Histogram, fn() -> Histogram>,
    errors: Family<ErrorLabels, Counter>,
    /// Per operation (index into [`OPERATIONS`]), resolved once.
    requests: Vec<Counter>,
    latency: Vec<Histogram>,
    /// Bytes of blob content accepted by puts.
    pub put_bytes: Counter,
    /// Bytes of blob content returned by gets.
    pub get_bytes: Counter,
    /// Raft messages dropped (full queues, unknown shards or peers).
    pub raft_messages_dropped: Counter,
    /// Snapshot bytes served to peers.
    pub snapshot_bytes_sent: Counter,
    /// Snapshot bytes received.
    pub snapshot_bytes_received: Counter,
    /// Snapshots received whole.
    pub snapshots_received: Counter,
    /// Every gRPC method served (the layer in front of the services).
    pub rpc: RequestMetrics,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        let requests_family = Family::<OpLabels, Counter>::default();
        let latency_family: Family<OpLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let requests = OPERATIONS
            .iter()
            .map(|op| requests_family.get_or_create_owned(&OpLabels { op }))
            .collect();
        let latency = OPERATIONS
            .iter()
            .map(|op| latency_family.get_or_create_owned(&OpLabels { op }))
            .collect();
        Self {
            requests_family,
            latency_family,
            errors: Family::default(),
            requests,
            latency,
            put_bytes: Counter::default(),
            get_bytes: Counter::default(),
            raft_messages_dropped: Counter::default(),
            snapshot_bytes_sent: Counter::default(),
            snapshot_bytes_received: Counter::default(),
            snapshots_received: Counter::default(),
            rpc: RequestMetrics::default(),
        }
    }
}

/// The label value of a stable error code (`NOT_FOUND`, ...).
pub fn code_label(code: tidepool_proto::v1::ErrorCode) -> &'static str {
    let name = code.as_str_name();
    name.strip_prefix("ERROR_CODE_").unwrap_or(name)
}

impl NodeMetrics {
    /// Counts a finished request of `operation` (an index into
    /// [`OPERATIONS`]); `error` is its stable error code if it failed.
    pub fn finished(&self, operation: usize, start: Instant, error: Option<&'static str>) {
        self.requests[operation].inc();
        self.latency[operation].observe(start.elapsed().as_secs_f64());
        if let Some(code) = error {
            self.errors
                .get_or_create(&ErrorLabels {
                    op: OPERATIONS[operation],
                    code,
                })
                .inc();
        }
    }

    /// Requests of `operation` counted so far.
    pub fn requests_of(&self, operation: usize) -> u64 {
        self.requests[operation].get()
    }

    /// Registers the instruments in `registry`.
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "tidepool_node_requests",
            "Blob requests served, by operation.",
            self.requests_family.clone(),
        );
        registry.register(
            "tidepool_node_request_errors",
            "Blob requests that failed, by operation and stable error code.",
            self.errors.clone(),
        );
        registry.register_with_unit(
            "tidepool_node_request_duration",
            "Time to serve a blob request, by operation.",
            Unit::Seconds,
            self.latency_family.clone(),
        );
        for (name, help, counter) in [
            (
                "tidepool_node_put_bytes",
                "Bytes of blob content accepted by puts.",
                &self.put_bytes,
            ),
            (
                "tidepool_node_get_bytes",
                "Bytes of blob content returned by gets.",
                &self.get_bytes,
            ),
            (
                "tidepool_node_raft_messages_dropped",
                "Raft messages dropped (full queues, unknown shards or peers).",
                &self.raft_messages_dropped,
            ),
            (
                "tidepool_node_snapshot_sent_bytes",
                "Snapshot bytes served to peers.",
                &self.snapshot_bytes_sent,
            ),
            (
                "tidepool_node_snapshot_received_bytes",
                "Snapshot bytes received from peers.",
                &self.snapshot_bytes_received,
            ),
            (
                "tidepool_node_snapshots_received",
                "Raft snapshots received whole.",
                &self.snapshots_received,
            ),
        ] {
            registry.register(name, help, counter.clone());
        }
        self.rpc.register(registry);
    }
}

/// The node's registry: its instruments and its collector, every series
/// labelled `node_id`.
pub(crate) fn registry(node: &Arc<Node>) -> Registry {
    let mut root = Registry::default();
    let registry = root.sub_registry_with_label((
        Cow::Borrowed("node_id"),
        Cow::Owned(node.config.node_id.to_string()),
    ));
    node.metrics.register(registry);
    registry.register_collector(Box::new(ShardCollector {
        node: Arc::downgrade(node),
    }));
    if let Some(tls) = &node.security.tls {
        registry.register_collector(Box::new(tidepool_telemetry::metrics::TlsExpiry::of(
            tls.clone(),
        )));
    }
    root
}

/// Reads every hosted replica at scrape time.
#[derive(Debug)]
pub(crate) struct ShardCollector {
    node: Weak<Node>,
}

/// One replica, read once per scrape.
struct Sample {
    shard_id: u32,
    state: ShardState,
    stats: ShardStats,
    engine: MetricsSnapshot,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabels {
    shard_id: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CellLabels {
    shard_id: u32,
    state: &'static str,
}

/// The names of the engine's cell states, in `MetricsSnapshot::cell_states`
/// order.
const CELL_STATES: [&str; 5] = [
    "empty",
    "loaded",
    "dirty_loaded",
    "unloaded",
    "dirty_unloaded",
];

type Read = fn(&Sample) -> Option<u64>;

/// Per-replica gauges: name, help, value (`None`: no series, e.g. a
/// replica that is down has no Raft state).
const SHARD_GAUGES: &[(&str, &str, Read)] = &[
    (
        "tidepool_shard_up",
        "1 while the replica is open, 0 while it is down and being reopened.",
        |s| Some(u64::from(s.state.status.is_some())),
    ),
    (
        "tidepool_shard_is_leader",
        "1 while this replica leads its shard.",
        |s| s.state.status.as_ref().map(|r| u64::from(r.is_leader)),
    ),
    (
        "tidepool_shard_has_leader",
        "1 while the replica knows a leader of its shard.",
        |s| s.state.status.as_ref().map(|r| u64::from(r.leader != 0)),
    ),
    (
        "tidepool_shard_quiesced",
        "1 while the replica's group is quiesced (idle: no ticks, no heartbeats).",
        |s| s.state.status.as_ref().map(|r| u64::from(r.quiesced)),
    ),
    ("tidepool_shard_term", "Current Raft term.", |s| {
        s.state.status.as_ref().map(|r| r.term)
    }),
    (
        "tidepool_shard_commit_index",
        "Highest Raft index known committed.",
        |s| s.state.status.as_ref().map(|r| r.commit),
    ),
    (
        "tidepool_shard_applied_index",
        "Highest Raft index applied to the engine.",
        |s| s.state.status.as_ref().map(|r| r.applied),
    ),
    (
        "tidepool_shard_first_index",
        "First Raft index still in the log.",
        |s| s.state.status.as_ref().map(|r| r.first_index),
    ),
    (
        "tidepool_shard_last_index",
        "Last Raft index in the log.",
        |s| s.state.status.as_ref().map(|r| r.last_index),
    ),
    (
        "tidepool_shard_apply_lag_entries",
        "Committed entries not yet applied.",
        |s| {
            s.state
                .status
                .as_ref()
                .map(|r| r.commit.saturating_sub(r.applied))
        },
    ),
    (
        "tidepool_shard_append_lag_entries",
        "On a leader: entries the slowest voter has yet to append (0 on followers).",
        |s| s.state.status.as_ref().map(|r| r.append_lag),
    ),
    (
        "tidepool_shard_voters",
        "Voters in the replica's configuration.",
        |s| s.state.status.as_ref().map(|r| r.voters.len() as u64),
    ),
    ("tidepool_shard_epoch", "The shard's current epoch.", |s| {
        Some(u64::from(s.state.epoch))
    }),
    (
        "tidepool_shard_disk_bytes",
        "Bytes the replica's engine holds on disk.",
        |s| Some(s.state.disk_bytes),
    ),
    (
        "tidepool_shard_receiving_snapshot",
        "1 while a snapshot is being received.",
        |s| Some(u64::from(s.state.receiving_snapshot)),
    ),
    (
        "tidepool_engine_segments",
        "Value WAL segments (as of the last census).",
        |s| Some(s.engine.segments.len() as u64),
    ),
    (
        "tidepool_engine_relocation_debt_bytes",
        "Garbage bytes in sealed WAL segments as of the last census: space relocation has yet to give back.",
        |s| Some(s.engine.relocation_lag_bytes),
    ),
    (
        "tidepool_engine_index_memory_bytes",
        "Bytes the replica's in-memory index holds (of the node's budget).",
        |s| Some(s.engine.index_memory_bytes),
    ),
    (
        "tidepool_engine_cache_bytes",
        "Bytes the replica's values take in the node's value cache.",
        |s| Some(s.engine.cache_bytes),
    ),
    (
        "tidepool_engine_index_live_bytes",
        "Bytes of index blobs the cells reference.",
        |s| Some(s.engine.index_live_bytes),
    ),
    (
        "tidepool_engine_index_garbage_bytes",
        "Bytes of sealed index log segments no cell references.",
        |s| Some(s.engine.index_garbage_bytes),
    ),
    (
        "tidepool_engine_wal_unsynced_bytes",
        "Value WAL bytes processed but not yet synced.",
        |s| Some(s.engine.wal_processed.saturating_sub(s.engine.wal_synced)),
    ),
];

/// Per-replica counters (name without `_total`).
const SHARD_COUNTERS: &[(&str, &str, Read)] = &[
    (
        "tidepool_raft_proposals",
        "Raft entries this replica proposed as leader.",
        |s| Some(s.stats.proposals.get()),
    ),
    (
        "tidepool_raft_proposals_dropped",
        "Raft entries this replica proposed that a new leader's entries replaced (never applied).",
        |s| Some(s.stats.proposals_dropped.get()),
    ),
    (
        "tidepool_raft_leader_changes",
        "Changes of the leader this replica saw (elections won by anyone).",
        |s| Some(s.stats.leader_changes.get()),
    ),
    (
        "tidepool_raft_snapshots_installed",
        "Raft snapshots this replica installed.",
        |s| Some(s.stats.snapshots_installed.get()),
    ),
    (
        "tidepool_raft_lease_reads_direct",
        "Linearizable reads this replica served on its leader lease on the request's thread, without its Raft owner.",
        |s| Some(s.stats.lease_reads_direct.get()),
    ),
    (
        "tidepool_engine_wal_written_bytes",
        "Bytes appended to the value WAL.",
        |s| Some(s.engine.counters.wal_bytes_written),
    ),
    (
        "tidepool_engine_index_written_bytes",
        "Bytes appended to the index log.",
        |s| Some(s.engine.counters.index_bytes_written),
    ),
    (
        "tidepool_engine_cache_hits",
        "Gets served from the value cache.",
        |s| Some(s.engine.counters.cache_hits),
    ),
    (
        "tidepool_engine_cache_misses",
        "Gets that read the value from disk.",
        |s| Some(s.engine.counters.cache_misses),
    ),
    ("tidepool_engine_flushes", "Cell index flushes.", |s| {
        Some(s.engine.counters.flushes)
    }),
    (
        "tidepool_engine_reclaimed_bytes",
        "Bytes of value WAL segments deleted.",
        |s| Some(s.engine.counters.bytes_reclaimed),
    ),
    (
        "tidepool_engine_relocated_bytes",
        "Bytes rewritten by relocation and epoch drops.",
        |s| Some(s.engine.counters.bytes_relocated),
    ),
    (
        "tidepool_engine_segments_deleted",
        "Value WAL segments deleted.",
        |s| Some(s.engine.counters.segments_deleted),
    ),
    (
        "tidepool_engine_index_blobs_moved",
        "Index blobs copied out of mostly-garbage index segments.",
        |s| Some(s.engine.counters.index_blobs_moved),
    ),
    (
        "tidepool_engine_relocation_passes",
        "Relocation passes run.",
        |s| Some(s.engine.counters.relocation_passes),
    ),
    (
        "tidepool_engine_unreadable_values",
        "Segments in which relocation met a live value it could not read (corrupt, or an I/O error), once each: kept, and no longer relocated.",
        |s| Some(s.engine.counters.unreadable_values),
    ),
];

fn encode_gauges(
    encoder: &mut DescriptorEncoder<'_>,
    samples: &[Sample],
    table: &[(&str, &str, Read)],
    metric_type: MetricType,
) -> Result<(), std::fmt::Error> {
    for (name, help, read) in table {
        // Units are in the names (a unit here would be appended again).
        let mut family = encoder.encode_descriptor(name, help, None, metric_type)?;
        for sample in samples {
            let Some(value) = read(sample) else {
                continue;
            };
            let labels = ShardLabels {
                shard_id: sample.shard_id,
            };
            let encoder = family.encode_family(&labels)?;
            match metric_type {
                MetricType::Counter => ConstCounter::new(value).encode(encoder)?,
                _ => ConstGauge::new(value as i64).encode(encoder)?,
            }
        }
    }
    Ok(())
}

impl ShardCollector {
    fn samples(node: &Node) -> Vec<Sample> {
        node.hosted()
            .into_iter()
            .map(|(info, shard)| Sample {
                shard_id: info.shard_id,
                state: shard.state(),
                stats: shard.stats().clone(),
                engine: shard.engine().metrics(),
            })
            .collect()
    }

    fn encode_node(
        node: &Node,
        encoder: &mut DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        let (used, total) = super::admin::disk_usage(&node.config.data_dir);
        let memory = &node.engines.memory;
        for (name, help, value) in [
            (
                "tidepool_node_index_memory_limit_bytes",
                "The node's budget for all replicas' in-memory indexes ([memory]).",
                memory.index_limit(),
            ),
            (
                "tidepool_node_index_memory_bytes",
                "Bytes all replicas' in-memory indexes hold.",
                memory.index_bytes(),
            ),
            (
                "tidepool_node_cache_limit_bytes",
                "The node's budget for the value cache all replicas share ([memory]).",
                memory.cache_limit(),
            ),
            (
                "tidepool_node_cache_bytes",
                "Bytes the node's value cache holds.",
                memory.cache_bytes(),
            ),
            (
                "tidepool_node_disk_total_bytes",
                "Size of the file system holding the data directory.",
                total,
            ),
            (
                "tidepool_node_disk_used_bytes",
                "Bytes used on that file system.",
                used,
            ),
            (
                "tidepool_node_disk_free_bytes",
                "Bytes available on that file system.",
                total.saturating_sub(used),
            ),
        ] {
            let metric = ConstGauge::new(value as i64);
            let family = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
            metric.encode(family)?;
        }
        Ok(())
    }
}

impl Collector for ShardCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(node) = self.node.upgrade() else {
            return Ok(());
        };
        let samples = Self::samples(&node);
        encode_gauges(&mut encoder, &samples, SHARD_GAUGES, MetricType::Gauge)?;
        encode_gauges(&mut encoder, &samples, SHARD_COUNTERS, MetricType::Counter)?;
        let mut cells = encoder.encode_descriptor(
            "tidepool_engine_cells",
            "Index cells by state.",
            None,
            MetricType::Gauge,
        )?;
        for sample in &samples {
            for (state, count) in CELL_STATES.iter().zip(sample.engine.cell_states) {
                let labels = CellLabels {
                    shard_id: sample.shard_id,
                    state,
                };
                ConstGauge::new(count as i64).encode(cells.encode_family(&labels)?)?;
            }
        }
        let mut commit = encoder.encode_descriptor(
            "tidepool_raft_commit_duration",
            "On a leader: time from proposing a Raft entry to applying it.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for sample in &samples {
            let labels = ShardLabels {
                shard_id: sample.shard_id,
            };
            sample
                .stats
                .commit_latency
                .encode(commit.encode_family(&labels)?)?;
        }
        Self::encode_node(&node, &mut encoder)
    }
}

impl tidepool_telemetry::Exposition for NodeExposition {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn alive(&self) -> Result<(), String> {
        match self.node.upgrade() {
            Some(node) if !node.is_stopping() => Ok(()),
            _ => Err("stopping".into()),
        }
    }

    fn ready(&self) -> Result<(), String> {
        match self.node.upgrade() {
            Some(node) => node.readiness(),
            None => Err("stopped".into()),
        }
    }
}

/// The node's metrics endpoint.
pub(crate) struct NodeExposition {
    node: Weak<Node>,
    registry: Registry,
}

impl NodeExposition {
    /// The endpoint of `node`.
    pub(crate) fn new(node: &Arc<Node>) -> Self {
        Self {
            node: Arc::downgrade(node),
            registry: registry(node),
        }
    }
}
