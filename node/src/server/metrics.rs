//! The node's metrics and its Prometheus endpoint (`GET /metrics`, text
//! format 0.0.4; `GET /healthz` alive, `GET /readyz` serving).
//!
//! Request counters and latency histograms per operation, Raft state per
//! hosted shard (role, term, commit, applied, log bounds), and each shard
//! engine's counters. Served by a deliberately tiny HTTP/1.1 responder: one
//! request per connection, no keep-alive.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::Node;

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Upper bounds of the latency buckets, seconds.
const BUCKETS: [f64; 16] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records the time since `start`.
    pub fn observe_since(&self, start: Instant) {
        let seconds = start.elapsed().as_secs_f64();
        let bucket = BUCKETS
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.counts[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

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

/// Everything the node counts.
#[derive(Debug, Default)]
pub struct NodeMetrics {
    /// Requests per operation (index into [`OPERATIONS`]).
    pub requests: [Counter; 7],
    /// Failed requests per operation.
    pub errors: [Counter; 7],
    /// Latency per operation.
    pub latency: [Histogram; 7],
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
}

impl NodeMetrics {
    /// Counts a finished request of `operation` (index into [`OPERATIONS`]).
    pub fn finished(&self, operation: usize, start: Instant, ok: bool) {
        self.requests[operation].inc();
        if !ok {
            self.errors[operation].inc();
        }
        self.latency[operation].observe_since(start);
    }
}

/// The Prometheus text of everything.
pub fn render(node: &Node) -> String {
    let m = &node.metrics;
    let id = node.config.node_id;
    let mut out = String::new();
    let _ = writeln!(out, "# TYPE tidepool_node_requests_total counter");
    for (i, op) in OPERATIONS.iter().enumerate() {
        let _ = writeln!(
            out,
            "tidepool_node_requests_total{{node_id=\"{id}\",op=\"{op}\"}} {}",
            m.requests[i].get()
        );
    }
    let _ = writeln!(out, "# TYPE tidepool_node_request_errors_total counter");
    for (i, op) in OPERATIONS.iter().enumerate() {
        let _ = writeln!(
            out,
            "tidepool_node_request_errors_total{{node_id=\"{id}\",op=\"{op}\"}} {}",
            m.errors[i].get()
        );
    }
    let _ = writeln!(out, "# TYPE tidepool_node_request_seconds histogram");
    for (i, op) in OPERATIONS.iter().enumerate() {
        m.latency[i].render(
            &mut out,
            "tidepool_node_request_seconds",
            &format!("node_id=\"{id}\",op=\"{op}\""),
        );
    }
    for (name, counter) in [
        ("tidepool_node_put_bytes_total", &m.put_bytes),
        ("tidepool_node_get_bytes_total", &m.get_bytes),
        (
            "tidepool_node_raft_messages_dropped_total",
            &m.raft_messages_dropped,
        ),
        (
            "tidepool_node_snapshot_bytes_sent_total",
            &m.snapshot_bytes_sent,
        ),
        (
            "tidepool_node_snapshot_bytes_received_total",
            &m.snapshot_bytes_received,
        ),
        (
            "tidepool_node_snapshots_received_total",
            &m.snapshots_received,
        ),
    ] {
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name}{{node_id=\"{id}\"}} {}", counter.get());
    }
    let _ = writeln!(out, "# TYPE tidepool_shard_is_leader gauge");
    for (info, shard) in node.hosted() {
        let state = shard.state();
        let labels = format!("node_id=\"{id}\",shard_id=\"{}\"", info.shard_id);
        let Some(status) = state.status else {
            let _ = writeln!(out, "tidepool_shard_up{{{labels}}} 0");
            continue;
        };
        let _ = writeln!(out, "tidepool_shard_up{{{labels}}} 1");
        for (name, value) in [
            ("tidepool_shard_is_leader", u64::from(status.is_leader)),
            ("tidepool_shard_term", status.term),
            ("tidepool_shard_commit_index", status.commit),
            ("tidepool_shard_applied_index", status.applied),
            ("tidepool_shard_first_index", status.first_index),
            ("tidepool_shard_last_index", status.last_index),
            ("tidepool_shard_epoch", u64::from(state.epoch)),
            ("tidepool_shard_disk_bytes", state.disk_bytes),
            (
                "tidepool_shard_receiving_snapshot",
                u64::from(state.receiving_snapshot),
            ),
        ] {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
        let metrics = shard.engine().metrics();
        let counters = metrics.counters;
        for (name, value) in [
            // Gauges: index log bytes the cells reference, and sealed
            // index log bytes they do not (what garbage collection and
            // index log cleaning give back).
            ("tidepool_engine_index_live_bytes", metrics.index_live_bytes),
            (
                "tidepool_engine_index_garbage_bytes",
                metrics.index_garbage_bytes,
            ),
            (
                "tidepool_engine_index_blobs_moved_total",
                counters.index_blobs_moved,
            ),
            (
                "tidepool_engine_wal_bytes_written_total",
                counters.wal_bytes_written,
            ),
            (
                "tidepool_engine_index_bytes_written_total",
                counters.index_bytes_written,
            ),
            ("tidepool_engine_cache_hits_total", counters.cache_hits),
            ("tidepool_engine_cache_misses_total", counters.cache_misses),
            (
                "tidepool_engine_bytes_reclaimed_total",
                counters.bytes_reclaimed,
            ),
            (
                "tidepool_engine_bytes_relocated_total",
                counters.bytes_relocated,
            ),
        ] {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
    out
}

/// How long one metrics connection may take, reading and writing: a
/// client that connects and sends nothing holds a socket no longer.
pub(crate) const METRICS_CONNECTION_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(10);

/// Serves `/metrics`, `/healthz` (alive) and `/readyz` (serving) until the
/// runtime stops.
pub async fn serve(node: Arc<Node>, listener: TcpListener) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            // Out of file descriptors and the like: do not spin.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let node = node.clone();
        tokio::spawn(tokio::time::timeout(
            METRICS_CONNECTION_TIMEOUT,
            async move {
                let mut request = vec![0u8; 4096];
                let Ok(n) = socket.read(&mut request).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&request[..n]);
                let path = head.split_whitespace().nth(1).unwrap_or("/");
                let (status, body) = match path {
                    "/metrics" => ("200 OK", tokio::task::block_in_place(|| render(&node))),
                    "/healthz" if node.is_stopping() => {
                        ("503 Service Unavailable", "stopping\n".into())
                    }
                    "/healthz" => ("200 OK", "ok\n".into()),
                    "/readyz" => match tokio::task::block_in_place(|| node.readiness()) {
                        Ok(()) => ("200 OK", "ready\n".into()),
                        Err(why) => ("503 Service Unavailable", format!("{why}\n")),
                    },
                    _ => ("404 Not Found", "not found\n".into()),
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            },
        ));
    }
}
