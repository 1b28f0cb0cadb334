//! `tidectl` as scripts run it, against an in-process cluster on real
//! sockets: every command, `--json`, and bad input (missing file, bad
//! digest, unknown namespace, missing key, unreachable cluster) giving a
//! clear message and the documented exit code.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use tidepool_testkit::cluster::LocalCluster;

const BIN: &str = env!("CARGO_BIN_EXE_tidectl");

/// Runs tidectl against `url` with `stdin` (20 s deadline unless `args`
/// set one).
fn run(url: &str, args: &[&str], stdin: &[u8]) -> Output {
    let mut command = Command::new(BIN);
    command.arg("--coordinator").arg(url);
    if !args.contains(&"--timeout") {
        command.args(["--timeout", "20"]);
    }
    let mut child = command
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts the exit code, showing stderr when it differs.
fn expect(output: &Output, code: i32) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout: {}\nstderr: {}",
        text(&output.stdout),
        text(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_and_its_errors() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let url = cluster.url.clone();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("report.txt");
    let content: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&file, &content).unwrap();
    let file = file.to_str().unwrap().to_string();

    tokio::task::spawn_blocking(move || {
        // put / get / head / rm in the default namespace.
        let out = run(&url, &["put", "default", "reports/q3", &file], b"");
        expect(&out, 0);
        assert!(text(&out.stdout).contains("stored 3000000 bytes"));
        let out = run(&url, &["get", "default", "reports/q3"], b"");
        expect(&out, 0);
        assert!(out.stdout == content, "stdout carries the blob");
        let copy = format!("{file}.copy");
        expect(
            &run(&url, &["get", "default", "reports/q3", "-o", &copy], b""),
            0,
        );
        assert!(std::fs::read(&copy).unwrap() == content);
        let out = run(&url, &["--json", "head", "default", "reports/q3"], b"");
        expect(&out, 0);
        let head: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(head["size"], 3_000_000);
        assert_eq!(
            head["chunked"], true,
            "3 MB is above the test cluster's 1 MiB entry"
        );
        // From stdin.
        expect(
            &run(&url, &["put", "default", "piped", "-"], b"from stdin"),
            0,
        );
        assert_eq!(
            run(&url, &["get", "default", "piped"], b"").stdout,
            b"from stdin"
        );

        // exists: keys on stdin, missing ones printed, exit 3.
        let out = run(&url, &["exists", "default"], b"reports/q3\npiped\n");
        expect(&out, 0);
        let out = run(&url, &["exists", "default"], b"reports/q3\nnot-there\n");
        expect(&out, 3);
        assert_eq!(text(&out.stdout).trim(), "not-there");

        expect(&run(&url, &["rm", "default", "piped"], b""), 0);
        let out = run(&url, &["rm", "default", "piped"], b"");
        expect(&out, 3);
        let out = run(&url, &["get", "default", "piped"], b"");
        expect(&out, 3);
        assert!(
            text(&out.stderr).contains("NOT_FOUND"),
            "{}",
            text(&out.stderr)
        );

        // Namespaces and content addressing.
        let out = run(
            &url,
            &["namespace", "create", "cas", "--content-addressed"],
            b"",
        );
        expect(&out, 0);
        let out = run(
            &url,
            &["namespace", "create", "cache", "--retain", "2"],
            b"",
        );
        expect(&out, 0);
        expect(&run(&url, &["namespace", "create", "cache"], b""), 2);
        expect(&run(&url, &["namespace", "create", "Bad Name"], b""), 2);
        // Retention changes: longer, durable, and never back from durable.
        let out = run(
            &url,
            &[
                "--json",
                "namespace",
                "set-retention",
                "cache",
                "--retain",
                "3",
            ],
            b"",
        );
        expect(&out, 0);
        let changed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(changed["retention"], "retain 3 epochs", "{changed}");
        let out = run(
            &url,
            &["namespace", "set-retention", "cas", "--durable"],
            b"",
        );
        expect(&out, 0);
        let out = run(
            &url,
            &["namespace", "set-retention", "cas", "--retain", "1"],
            b"",
        );
        expect(&out, 2);
        assert!(
            text(&out.stderr).contains("durable"),
            "{}",
            text(&out.stderr)
        );
        expect(&run(&url, &["namespace", "set-retention", "cas"], b""), 2);
        expect(
            &run(
                &url,
                &["namespace", "set-retention", "nope", "--durable"],
                b"",
            ),
            3,
        );
        let out = run(&url, &["--json", "namespace", "list"], b"");
        expect(&out, 0);
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["cache", "cas", "default"]);
        let out = run(&url, &["put", "cas", "--content", &file], b"");
        expect(&out, 0);
        let digest = text(&out.stdout).trim().to_string();
        assert_eq!(digest.len(), 64);
        let out = run(&url, &["get", "cas", &digest], b"");
        expect(&out, 0);
        assert!(out.stdout == content);
        let out = run(&url, &["exists", "cas"], format!("{digest}\n").as_bytes());
        expect(&out, 0);

        // ls: keys in order (a chunked blob once, its chunks never); --long,
        // --json, prefixes (hex in a content-addressed namespace), limits.
        expect(&run(&url, &["put", "default", "reports/q1", "-"], b"q1"), 0);
        let out = run(&url, &["ls", "default"], b"");
        expect(&out, 0);
        assert_eq!(text(&out.stdout), "reports/q1\nreports/q3\n");
        let out = run(
            &url,
            &["ls", "default", "--prefix", "reports/q3", "--long"],
            b"",
        );
        expect(&out, 0);
        let line = text(&out.stdout);
        assert!(
            line.contains(" 3000000 ") && line.trim_end().ends_with(" reports/q3"),
            "{line}"
        );
        let out = run(
            &url,
            &["--json", "ls", "default", "--start-after", "reports/q1"],
            b"",
        );
        expect(&out, 0);
        let entry: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(entry["key"], "reports/q3");
        assert_eq!(entry["size"], 3_000_000);
        assert_eq!(entry["chunked"], true);
        let out = run(&url, &["ls", "default", "--limit", "1"], b"");
        assert_eq!(text(&out.stdout), "reports/q1\n");
        let out = run(&url, &["ls", "cas", "--prefix", &digest[..6]], b"");
        expect(&out, 0);
        assert_eq!(text(&out.stdout).trim(), digest);
        expect(&run(&url, &["ls", "cas", "--prefix", "xyz"], b""), 2);
        expect(&run(&url, &["ls", "nosuch"], b""), 3);

        // Bad input: a clear message and a non-zero exit.
        let out = run(&url, &["put", "default", "k", "/no/such/file"], b"");
        expect(&out, 2);
        assert!(text(&out.stderr).contains("/no/such/file"));
        let out = run(&url, &["get", "cas", "not-a-digest"], b"");
        expect(&out, 2);
        assert!(
            text(&out.stderr).contains("SHA-256"),
            "{}",
            text(&out.stderr)
        );
        let out = run(&url, &["exists", "cas"], b"abc\n");
        expect(&out, 2);
        let out = run(&url, &["get", "nosuch", "k"], b"");
        expect(&out, 3);
        assert!(text(&out.stderr).contains("nosuch"));
        let out = run(&url, &["frobnicate"], b"");
        expect(&out, 2);

        // Cluster, epochs, nodes.
        let out = run(&url, &["cluster", "status"], b"");
        expect(&out, 0);
        assert!(
            text(&out.stdout).contains("shards:"),
            "{}",
            text(&out.stdout)
        );
        let out = run(&url, &["--json", "cluster", "status"], b"");
        expect(&out, 0);
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(status["nodes"].as_array().unwrap().len(), 3);
        assert_eq!(status["shards"].as_array().unwrap().len(), 2);
        let out = run(&url, &["--json", "epoch", "advance"], b"");
        expect(&out, 0);
        let epoch: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(epoch["epoch"], 2);
        expect(&run(&url, &["epoch", "advance", "--expect", "7"], b""), 1);
        let out = run(&url, &["node", "drain", "99"], b"");
        expect(&out, 3);
        let out = run(&url, &["--json", "node", "drain", "3"], b"");
        expect(&out, 0);
        let drained: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(drained["replicas_to_move"], 2);

        // Tokens: create (the secret once), list (roles, never secrets),
        // revoke; bad grants and unknown names with their exit codes.
        let out = run(
            &url,
            &[
                "token",
                "create",
                "ci",
                "--grant",
                "default=read,append-only",
            ],
            b"",
        );
        expect(&out, 0);
        let secret = text(&out.stdout).trim().to_string();
        assert!(secret.starts_with("tp_") && secret.len() == 67, "{secret}");
        let out = run(&url, &["--json", "token", "list"], b"");
        expect(&out, 0);
        let tokens: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(tokens[0]["name"], "ci");
        assert_eq!(tokens[0]["grants"][0]["roles"], "read,append-only");
        assert!(
            !text(&out.stdout).contains(&secret[3..]),
            "a secret was listed"
        );
        expect(
            &run(
                &url,
                &["token", "create", "ci", "--grant", "default=read"],
                b"",
            ),
            1,
        );
        expect(
            &run(
                &url,
                &["token", "create", "x", "--grant", "default=owner"],
                b"",
            ),
            2,
        );
        expect(
            &run(
                &url,
                &["token", "create", "y", "--grant", "nowhere=read"],
                b"",
            ),
            3,
        );
        expect(&run(&url, &["token", "revoke", "ci"], b""), 0);
        expect(&run(&url, &["token", "revoke", "ci"], b""), 3);

        // A split by hand: the new shard takes the upper half and is
        // published in the map; a bad position is a usage error.
        expect(&run(&url, &["shard", "split", "1", "--at", "zz"], b""), 2);
        let out = run(&url, &["--json", "shard", "split", "1"], b"");
        expect(&out, 0);
        let split: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(split["shard"], 1, "{split}");
        let child = split["child"].as_u64().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let out = run(&url, &["--json", "cluster", "status"], b"");
            expect(&out, 0);
            let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let ids: Vec<u64> = status["shards"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|s| s["id"].as_u64())
                .collect();
            if ids.contains(&child) {
                assert_eq!(ids.len(), 3, "{status}");
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "shard {child} not published: {status}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    })
    .await
    .unwrap();

    // Nobody listening: exit 4.
    let port = tidepool_testkit::free_port();
    let out = tokio::task::spawn_blocking(move || {
        run(
            &format!("http://127.0.0.1:{port}"),
            &["--timeout", "2", "cluster", "status"],
            b"",
        )
    })
    .await
    .unwrap();
    expect(&out, 4);
    assert!(text(&out.stderr).contains("cannot reach"));
    cluster.stop().await;
}

/// `tidectl bench`: a mix runs and reports every operation; a bench that
/// cannot work (unknown namespace) reports the errors by code and exits 1;
/// bad settings are usage errors.
/// Two `get -o` at once into one directory, to names that differ only in
/// their extension (`out.1`, `out.2`): each file holds its own blob. Before,
/// both wrote through `out.tidectl-partial`, and one exited 0 with bytes of
/// the other's blob in its file. `-o /dev/null` writes to the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_at_once_never_share_a_partial_file() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let url = cluster.url.clone();
    let dir = tempfile::tempdir().unwrap();
    let blobs: Vec<Vec<u8>> = (0..2u8)
        .map(|b| (0..3_000_000u32).map(|i| (i % 253) as u8 ^ b).collect())
        .collect();
    tokio::task::spawn_blocking(move || {
        for (i, blob) in blobs.iter().enumerate() {
            let out = run(&url, &["put", "default", &format!("b{i}"), "-"], blob);
            expect(&out, 0);
        }
        for _ in 0..3 {
            let outputs: Vec<String> = (0..2)
                .map(|i| dir.path().join(format!("out.{i}")).display().to_string())
                .collect();
            let running: Vec<_> = (0..2)
                .map(|i| {
                    Command::new(BIN)
                        .args(["--coordinator", &url, "--timeout", "20", "get", "default"])
                        .arg(format!("b{i}"))
                        .args(["-o", &outputs[i]])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            for (i, child) in running.into_iter().enumerate() {
                let output = child.wait_with_output().unwrap();
                expect(&output, 0);
                assert!(
                    std::fs::read(&outputs[i]).unwrap() == blobs[i],
                    "out.{i} is not blob {i}"
                );
            }
            let left: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("partial"))
                .collect();
            assert!(left.is_empty(), "{left:?}");
        }
        let out = run(&url, &["get", "default", "b0", "-o", "/dev/null"], b"");
        expect(&out, 0);
    })
    .await
    .unwrap();
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_reports_rates_latencies_and_errors_by_code() {
    let cluster = LocalCluster::start(3, 2, 3).await;
    let url = cluster.url.clone();
    tokio::task::spawn_blocking(move || {
        let out = run(
            &url,
            &[
                "--json",
                "bench",
                "default",
                "--seconds",
                "2",
                "--concurrency",
                "4",
                "--size",
                "512",
                "--keys",
                "50",
                "--mix",
                "put=1,get=2,exists=1,delete=1",
                "--distribution",
                "zipf",
                "--seed",
                "7",
            ],
            b"",
        );
        expect(&out, 0);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for op in ["put", "get", "exists", "delete"] {
            let row = &report["ops"][op];
            assert!(row["count"].as_u64().unwrap() > 0, "{op}: {report}");
            assert!(row["p50_us"].as_u64().unwrap() > 0, "{op}: {report}");
            assert!(row["p99_us"].as_u64() >= row["p50_us"].as_u64(), "{report}");
        }
        // Deletes in the mix make some gets miss: NOT_FOUND, not a failure.
        let get_errors = report["ops"]["get"]["errors"].as_object().unwrap();
        assert!(get_errors.keys().all(|c| c == "NOT_FOUND"), "{report}");
        // The progress went to stderr, the seed too.
        assert!(
            text(&out.stderr).contains("prefill: 50 keys"),
            "{}",
            text(&out.stderr)
        );

        // A fixed count of puts, the text table.
        let out = run(
            &url,
            &["bench", "default", "--seconds", "0", "--count", "40"],
            b"",
        );
        expect(&out, 0);
        let table = text(&out.stdout);
        assert!(table.contains("| put | 40 |"), "{table}");
        // Puts at a durability of their own.
        let out = run(
            &url,
            &[
                "bench",
                "default",
                "--seconds",
                "0",
                "--count",
                "20",
                "--durability",
                "synced",
            ],
            b"",
        );
        expect(&out, 0);
        assert!(text(&out.stdout).contains("| put | 20 |"), "{out:?}");

        // An unknown namespace: every op fails with its code, exit 1.
        let out = run(
            &url,
            &[
                "--json",
                "bench",
                "nope",
                "--seconds",
                "1",
                "--concurrency",
                "2",
            ],
            b"",
        );
        expect(&out, 1);
        // The report, then the failure (one JSON object per line).
        let stdout = text(&out.stdout);
        let mut lines = stdout.lines();
        let report: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        let failure: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        assert_eq!(failure["exit_code"], 1, "{failure}");
        assert!(
            report["ops"]["put"]["errors"]["NAMESPACE_NOT_FOUND"]
                .as_u64()
                .unwrap()
                > 0,
            "{report}"
        );
        // Bad settings: usage errors.
        expect(&run(&url, &["bench", "default", "--mix", "scan=1"], b""), 2);
        expect(&run(&url, &["bench", "default", "--keys", "0"], b""), 2);
        let out = run(
            &url,
            &["bench", "default", "--durability", "sometimes"],
            b"",
        );
        expect(&out, 2);
        assert!(
            text(&out.stderr).contains("`buffered` or `synced`"),
            "{out:?}"
        );
    })
    .await
    .unwrap();
    cluster.stop().await;
}

/// `get` to stdout streams: a blob much larger than the chunk size is not
/// held in memory whole before its first byte is printed (before, it was:
/// a blob larger than memory could not be read to stdout). The child's
/// peak memory is read while it waits on a full pipe after printing its
/// first bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_blob_to_stdout_is_streamed_not_held() {
    use std::io::Read;
    const SIZE: usize = 96 << 20;
    let cluster = LocalCluster::start(3, 2, 3).await;
    let url = cluster.url.clone();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big");
    let content: Vec<u8> = (0..SIZE as u32).map(|i| (i % 249) as u8).collect();
    std::fs::write(&file, &content).unwrap();
    let file = file.display().to_string();
    tokio::task::spawn_blocking(move || {
        expect(&run(&url, &["put", "default", "big", &file], b""), 0);
        let mut child = Command::new(BIN)
            .args([
                "--coordinator",
                &url,
                "--timeout",
                "60",
                "get",
                "default",
                "big",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut first = vec![0u8; 1 << 16];
        stdout.read_exact(&mut first).unwrap();
        // Let the child fill the pipe and block on it.
        std::thread::sleep(std::time::Duration::from_millis(500));
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        let peak_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/<pid>/status");
        let mut rest = Vec::with_capacity(SIZE);
        stdout.read_to_end(&mut rest).unwrap();
        let output = child.wait_with_output().unwrap();
        expect(&output, 0);
        first.extend_from_slice(&rest);
        assert!(
            first.len() == SIZE && first == content,
            "the bytes printed are the blob's"
        );
        println!("tidectl peak resident memory while printing: {peak_kib} KiB");
        assert!(
            peak_kib < (SIZE as u64 / 1024) * 2 / 3,
            "tidectl held {peak_kib} KiB for a {} MiB blob: not streamed",
            SIZE >> 20
        );
    })
    .await
    .unwrap();
    cluster.stop().await;
}
