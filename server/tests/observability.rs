//! Metrics, alerts and the dashboard, checked with Debian's `prometheus`
//! package against a `tidepool dev` cluster with traffic:
//!
//! - `promtool check metrics` accepts each of the five processes'
//!   `/metrics` (coordinator, three nodes, gateway), and OpenMetrics is
//!   served to scrapers that ask for it;
//! - `promtool check rules` and `promtool test rules` pass on the alert
//!   rules (the rule tests fire "shard without leader" from synthetic
//!   series, and every other alert);
//! - the dashboard and the rules name only metrics the processes export;
//! - a real Prometheus scrapes all five, sees the request counters, and
//!   evaluates every rule without error;
//! - `make observe`'s script says Prometheus is there only once it is, and
//!   refuses a dev cluster on random ports (it could not find them).

mod support;

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tidepool_client::{Client, ClientConfig, ErrorCode};

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../helm/tidepool")
}

/// A plain HTTP/1.1 GET: (status line and headers, body).
fn http_get(address: &str, path: &str, accept: Option<&str>) -> (String, String) {
    http_get_version(address, path, accept, "1.1")
}

/// A GET in HTTP/`version` (1.0: never a chunked body).
fn http_get_version(
    address: &str,
    path: &str,
    accept: Option<&str>,
    version: &str,
) -> (String, String) {
    let mut socket = std::net::TcpStream::connect(address).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(
        socket,
        "GET {path} HTTP/{version}\r\nHost: {address}\r\n{accept}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    socket.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

fn http_put(address: std::net::SocketAddr, path: &str, body: &[u8]) -> String {
    let mut socket = std::net::TcpStream::connect(address).unwrap();
    write!(
        socket,
        "PUT {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    socket.write_all(body).unwrap();
    let mut out = String::new();
    socket.read_to_string(&mut out).unwrap();
    out
}

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package: make deps)");
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    let output = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// Metric names a text exposition defines (histograms' series too).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        names.insert(name.to_string());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// The `tidepool_*` metric names an expression or file mentions.
fn mentioned(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("tidepool_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        names.insert(text[start..end].to_string());
        i = end;
    }
    names
}

/// Traffic of every kind the dashboard shows: SDK puts, gets and a miss;
/// HTTP cache puts, gets and a miss through the gateway.
fn traffic(url: &str, http_cache: std::net::SocketAddr) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let client = Client::with_config(ClientConfig::new(&[url]))
            .await
            .unwrap();
        for i in 0..20u32 {
            let key = format!("k{i}");
            client
                .put("default", key.as_bytes(), b"value")
                .await
                .unwrap();
            assert_eq!(
                client.get("default", key.as_bytes()).await.unwrap(),
                b"value"
            );
        }
        let missing = client.get("default", b"missing").await.unwrap_err();
        assert_eq!(missing.code(), ErrorCode::NotFound);
    });
    let body = b"cached bytes";
    let digest: String = tidepool_client::sha256(body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let stored = http_put(http_cache, &format!("/cas/{digest}"), body);
    assert!(stored.starts_with("HTTP/1.1 200"), "{stored}");
    let (head, got) = http_get(&http_cache.to_string(), &format!("/cas/{digest}"), None);
    assert!(
        head.starts_with("HTTP/1.1 200") && got.as_bytes() == body,
        "{head}"
    );
    let (head, _) = http_get(
        &http_cache.to_string(),
        &format!("/cas/{}", "0".repeat(64)),
        None,
    );
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
}

#[test]
fn metrics_alerts_and_dashboard_hold_with_promtool_and_prometheus() {
    support::require("promtool");
    support::require("prometheus");
    let dir = tempfile::tempdir().unwrap();
    let (child, banner) = support::start_dev_banner(dir.path(), &["--insecure"]);
    let url = support::banner_url(&banner);
    let targets = support::banner_metrics(&banner);
    assert_eq!(
        targets.len(),
        5,
        "coordinator, 3 nodes, gateway: {banner:?}"
    );
    traffic(&url, support::banner_http_cache(&banner));

    // Each process: valid Prometheus text, and OpenMetrics on request.
    let mut names = BTreeSet::new();
    for (process, address) in &targets {
        let (head, text) = http_get(address, "/metrics", None);
        assert!(
            head.contains("text/plain; version=0.0.4"),
            "{process}: {head}"
        );
        let (ok, lint) = promtool(&["check", "metrics"], Some(&text));
        assert!(ok, "{process}: promtool check metrics:\n{lint}\n{text}");
        names.extend(exported(&text));
        let (head, open) = http_get(address, "/metrics", Some("application/openmetrics-text"));
        assert!(head.contains("application/openmetrics-text"), "{head}");
        assert!(open.ends_with("# EOF\n"), "{process}");
        let (head, _) = http_get(address, "/healthz", None);
        assert!(head.starts_with("HTTP/1.1 200"), "{process}: {head}");
    }
    // A dev cluster with TLS (its default): every process also says when
    // its certificate and CA expire, about a year from now.
    let tls_dir = tempfile::tempdir().unwrap();
    let (tls_child, tls_banner) = support::start_dev_banner(tls_dir.path(), &[]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as f64;
    for (process, address) in support::banner_metrics(&tls_banner) {
        let (_, text) = http_get(&address, "/metrics", None);
        let (ok, lint) = promtool(&["check", "metrics"], Some(&text));
        assert!(
            ok,
            "{process} (TLS): promtool check metrics:\n{lint}\n{text}"
        );
        names.extend(exported(&text));
        let own = text
            .lines()
            .find(|l| {
                l.starts_with("tidepool_tls_certificate_expiry_timestamp_seconds")
                    && l.contains("certificate=\"own\"")
            })
            .unwrap_or_else(|| panic!("{process} (TLS) says nothing of its certificate:\n{text}"));
        let at: f64 = own.rsplit(' ').next().unwrap().parse().unwrap();
        let days = (at - now) / 86_400.0;
        assert!(
            (300.0..=366.0).contains(&days),
            "{process}: {own} ({days:.0} days)"
        );
    }
    drop(tls_child);
    for expected in [
        "tidepool_node_requests_total",
        "tidepool_node_request_errors_total",
        "tidepool_rpc_requests_total",
        "tidepool_raft_commit_duration_seconds_bucket",
        "tidepool_shard_apply_lag_entries",
        "tidepool_engine_relocation_debt_bytes",
        "tidepool_node_disk_free_bytes",
        "tidepool_node_index_memory_limit_bytes",
        "tidepool_node_cache_bytes",
        "tidepool_coordinator_shards_leaderless",
    ] {
        assert!(
            names.contains(expected),
            "{expected} not exported: {names:#?}"
        );
    }

    // Every metric is documented.
    let documented = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations/metrics.md"),
    )
    .unwrap();
    for name in &names {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| names.contains(*b)))
            .unwrap_or(name);
        assert!(
            documented.contains(&format!("`{base}`")),
            "{base} is not in docs/operations/metrics.md"
        );
    }

    // The rules: valid, their tests pass, their metrics exist.
    let rules = chart().join("alerts/tidepool-rules.yaml");
    let (ok, out) = promtool(&["check", "rules", rules.to_str().unwrap()], None);
    assert!(ok, "promtool check rules:\n{out}");
    let tests = chart().join("alerts/tidepool-rules.test.yaml");
    let (ok, out) = promtool(&["test", "rules", tests.to_str().unwrap()], None);
    assert!(ok, "promtool test rules:\n{out}");
    let rules_text = std::fs::read_to_string(&rules).unwrap();
    for name in mentioned(&rules_text) {
        assert!(
            names.contains(&name),
            "the alert rules use {name}, which nothing exports"
        );
    }
    // The dashboard: every expression names exported metrics only.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("dashboards/tidepool.json")).unwrap(),
    )
    .unwrap();
    let mut used = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for name in mentioned(expr) {
                assert!(
                    names.contains(&name),
                    "dashboard panel {:?} uses {name}, which nothing exports",
                    panel["title"]
                );
                used += 1;
            }
        }
    }
    assert!(used > 20, "the dashboard names metrics");
    // The copy under docs/ is the chart's.
    let docs =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations/grafana-dashboard.json");
    assert_eq!(
        std::fs::read(docs).unwrap(),
        std::fs::read(chart().join("dashboards/tidepool.json")).unwrap()
    );

    scrape_with_prometheus(dir.path(), &targets, &rules);
    drop(child);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A real Prometheus scraping every process and evaluating the rules.
fn scrape_with_prometheus(dir: &Path, targets: &[(String, String)], rules: &Path) {
    let port = free_port();
    let list: Vec<String> = targets.iter().map(|(_, a)| format!("'{a}'")).collect();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - '{}'\nscrape_configs:\n  - job_name: tidepool\n    static_configs:\n      - targets: [{}]\n",
        rules.display(),
        list.join(", ")
    );
    let config_file = dir.join("prometheus.yml");
    std::fs::write(&config_file, config).unwrap();
    let mut prometheus = Command::new("prometheus")
        .arg(format!("--config.file={}", config_file.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("prometheus").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn()
        .unwrap();
    let address = format!("127.0.0.1:{port}");
    let api = |path: &str| -> Option<serde_json::Value> {
        std::net::TcpStream::connect(&address).ok()?;
        let (head, body) = http_get_version(&address, path, None, "1.0");
        head.contains(" 200 ")
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = String::new();
    let done = loop {
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(500));
        let (Some(targets_state), Some(requests), Some(rules_state)) = (
            api("/api/v1/targets"),
            api("/api/v1/query?query=sum%20by%20(node_id)%20(tidepool_node_requests_total)"),
            api("/api/v1/rules"),
        ) else {
            continue;
        };
        let active = targets_state["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = active.iter().filter(|t| t["health"] == "up").count();
        let nodes = requests["data"]["result"].as_array().map_or(0, Vec::len);
        let rules: Vec<serde_json::Value> = rules_state["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = rules
            .iter()
            .filter(|r| {
                r["health"] == "ok"
                    && r["lastEvaluation"]
                        .as_str()
                        .is_some_and(|t| !t.starts_with("0001"))
            })
            .count();
        last = format!(
            "{up} of {} targets up, {nodes} nodes' counters, {evaluated} of {} rules evaluated",
            active.len(),
            rules.len()
        );
        if up == targets.len() && nodes == 3 && !rules.is_empty() && evaluated == rules.len() {
            break true;
        }
    };
    let _ = prometheus.kill();
    let _ = prometheus.wait();
    let log = std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default();
    assert!(done, "Prometheus: {last}\n{log}");
}

/// `deploy/observe.sh` (what `make observe` runs) with a stand-in for the
/// `tidepool` binary that exits at once: Prometheus announced when it
/// serves; its failure (its port taken) said with its log, exit 1 — before,
/// announced all the same; `--port 0` refused (the metrics ports would be
/// random: before, it scraped ports 90 to 94).
#[test]
fn make_observe_says_what_it_started() {
    support::require("prometheus");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/observe.sh");
    let run = |port: u16, args: &[&str]| {
        let output = Command::new(&script)
            .arg("/bin/true")
            .args(args)
            .env("OBSERVE_PROMETHEUS_PORT", port.to_string())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.code(), text)
    };
    let port = free_port();
    let (code, text) = run(port, &[]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(&format!("Prometheus at http://127.0.0.1:{port}")),
        "{text}"
    );
    // Its scratch directory removed on exit (a failed `kill` of a
    // Prometheus gone already stopped the exit trap before the removal).
    let work = text
        .split("log in ")
        .nth(1)
        .and_then(|rest| rest.split("/prometheus.log").next())
        .unwrap();
    assert!(!Path::new(work).exists(), "{work} left behind");

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (code, text) = run(port, &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("Prometheus did not start"), "{text}");
    let work = text
        .split("its log (")
        .nth(1)
        .and_then(|rest| rest.split("/prometheus.log").next())
        .unwrap();
    assert!(!Path::new(work).exists(), "{work} left behind");
    assert!(!text.contains("Prometheus at"), "{text}");
    drop(taken);

    let (code, text) = run(free_port(), &["--port", "0"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("needs the dev cluster on fixed ports"),
        "{text}"
    );
}
