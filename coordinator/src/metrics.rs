//! The coordinator's Prometheus endpoint (`GET /metrics`, text format
//! 0.0.4; `GET /healthz`): leadership, map version, epoch, nodes by state,
//! and the reconciler's progress.

use std::fmt::Write as _;
use std::sync::Arc;

use tidepool_proto::v1::NodeState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::core::Shared;

/// The metrics text.
pub(crate) fn render(shared: &Shared) -> String {
    let map = shared.map();
    let progress = shared.progress.lock().clone();
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, kind: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    };
    gauge(
        "tidepool_coordinator_is_leader",
        "1 while this coordinator leads.",
        "gauge",
        u64::from(shared.leadership().is_some()),
    );
    gauge(
        "tidepool_coordinator_map_version",
        "Version of the cluster map this coordinator holds.",
        "gauge",
        map.version,
    );
    gauge(
        "tidepool_coordinator_epoch",
        "Current cluster epoch.",
        "gauge",
        map.epoch,
    );
    gauge(
        "tidepool_coordinator_moves_in_progress",
        "Shards changing membership (leader only).",
        "gauge",
        progress.moves.len() as u64,
    );
    gauge(
        "tidepool_coordinator_moves_completed_total",
        "Replica moves this coordinator completed.",
        "counter",
        progress.moves_done,
    );
    gauge(
        "tidepool_coordinator_shards_under_replicated",
        "Shards with fewer live voters than the replication factor (leader only).",
        "gauge",
        u64::from(progress.under_replicated),
    );
    gauge(
        "tidepool_coordinator_reconcile_rounds_total",
        "Reconcile rounds run while leading.",
        "counter",
        progress.rounds,
    );
    gauge(
        "tidepool_coordinator_reconcile_errors_total",
        "Reconcile rounds or steps that failed.",
        "counter",
        progress.errors,
    );
    let _ = writeln!(
        out,
        "# HELP tidepool_coordinator_nodes Nodes in the map by state.\n# TYPE tidepool_coordinator_nodes gauge"
    );
    for state in [
        NodeState::Up,
        NodeState::Down,
        NodeState::Draining,
        NodeState::Drained,
    ] {
        let count = map.nodes.iter().filter(|n| n.state == state as i32).count();
        let name = state
            .as_str_name()
            .trim_start_matches("NODE_STATE_")
            .to_lowercase();
        let _ = writeln!(
            out,
            "tidepool_coordinator_nodes{{state=\"{name}\"}} {count}"
        );
    }
    out
}

/// Serves `/metrics`, `/healthz` (alive) and `/readyz` (the map is
/// loaded), one request per connection.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut socket, _)) = accepted else {
            // Out of file descriptors and the like: do not spin.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let shared = shared.clone();
        // A client that connects and sends nothing holds a socket 10 s.
        tokio::spawn(tokio::time::timeout(
            std::time::Duration::from_secs(10),
            async move {
                let mut request = vec![0u8; 4096];
                let Ok(n) = socket.read(&mut request).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&request[..n]);
                let (status, body) = match head.split_whitespace().nth(1).unwrap_or("/") {
                    "/metrics" => ("200 OK", render(&shared)),
                    "/healthz" => ("200 OK", "ok\n".to_string()),
                    // Serving: the map is loaded (the store answered).
                    "/readyz" if shared.map().version > 0 => ("200 OK", "ready\n".to_string()),
                    "/readyz" => (
                        "503 Service Unavailable",
                        "no cluster map loaded\n".to_string(),
                    ),
                    _ => ("404 Not Found", "not found\n".to_string()),
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
