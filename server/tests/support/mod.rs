//! Shared by the server's process tests: starting `tidepool dev`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_tidepool");

/// Starts dev mode with its data in `dir`, on free ports; returns the
/// process and the coordinator URL from its ready banner.
pub fn start_dev(dir: &std::path::Path, extra: &[&str]) -> (DevChild, String) {
    let (child, banner) = start_dev_banner(dir, extra);
    (child, banner_url(&banner))
}

/// Starts dev mode like [`start_dev`]; returns the process and every line
/// of its ready banner.
pub fn start_dev_banner(dir: &std::path::Path, extra: &[&str]) -> (DevChild, Vec<String>) {
    start_dev_banner_within(dir, extra, Duration::from_secs(60))
}

/// [`start_dev_banner`], waiting up to `wait` for each banner line.
pub fn start_dev_banner_within(
    dir: &std::path::Path,
    extra: &[&str],
    wait: Duration,
) -> (DevChild, Vec<String>) {
    start_dev_banner_with(dir, extra, &[], wait)
}

/// [`start_dev_banner_within`] with environment variables `env` set.
pub fn start_dev_banner_with(
    dir: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
    wait: Duration,
) -> (DevChild, Vec<String>) {
    std::fs::create_dir_all(dir).unwrap();
    let mut child = Command::new(BIN)
        .args(["dev", "--port", "0", "--data-dir"])
        .arg(dir)
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        // Its log, for a failing test to show.
        .stderr(std::fs::File::create(dir.join("dev.log")).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let banner = read_banner(&rx, wait);
    match banner {
        Ok(banner) => (
            DevChild {
                child,
                log: dir.join("dev.log"),
            },
            banner,
        ),
        Err(problem) => {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(dir.join("dev.log")).unwrap_or_default();
            panic!("{problem}\n--- dev.log\n{log}");
        }
    }
}

/// A running `tidepool dev`, killed (SIGKILL) when dropped still running,
/// so a failing test leaves no cluster behind to slow the tests after it;
/// the last lines of its log are printed then if the test is failing.
#[derive(Debug)]
pub struct DevChild {
    child: Child,
    log: PathBuf,
}

impl std::ops::Deref for DevChild {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for DevChild {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for DevChild {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- the dev cluster's log (last lines)\n{}",
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
    }
}

/// The coordinator URL of a ready banner.
pub fn banner_url(banner: &[String]) -> String {
    banner[0]
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap()
        .trim_end_matches(',')
        .to_string()
}

/// The gateway's HTTP cache address in a ready banner.
pub fn banner_http_cache(banner: &[String]) -> std::net::SocketAddr {
    banner
        .iter()
        .find_map(|l| l.split("--remote_cache=http://").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP cache in {banner:?}"))
}

/// The `/metrics` URLs a ready banner lists: (process, host:port).
pub fn banner_metrics(banner: &[String]) -> Vec<(String, String)> {
    banner
        .iter()
        .filter(|l| l.trim_end().ends_with("/metrics"))
        .map(|l| {
            let (process, url) = l.trim().rsplit_once(' ').unwrap();
            let address = url
                .trim_start_matches("http://")
                .trim_end_matches("/metrics")
                .to_string();
            (process.to_string(), address)
        })
        .collect()
}

/// The banner's lines, up to the one saying how to stop.
fn read_banner(
    rx: &std::sync::mpsc::Receiver<String>,
    wait: Duration,
) -> Result<Vec<String>, String> {
    let mut banner = Vec::new();
    loop {
        let line = rx
            .recv_timeout(wait)
            .map_err(|_| format!("dev mode did not print its banner within {wait:?}"))?;
        if banner.is_empty() && !line.contains("ready") {
            return Err(format!("not a ready banner: {line}"));
        }
        let last = line.starts_with("Ctrl-C");
        banner.push(line);
        if last {
            return Ok(banner);
        }
    }
}

// restic, for the backup tests.

pub fn require(tool: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(found, "{tool} is not installed: run `make deps`");
}

/// `restic -r <repo> <args>` with a password and a cache of its own.
pub fn restic(repo: &str, cache: &Path, args: &[&str]) -> Output {
    let started = std::time::Instant::now();
    let output = Command::new("restic")
        .arg("-r")
        .arg(repo)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .env("RESTIC_PASSWORD", "correct horse battery staple")
        .output()
        .expect("restic runs");
    eprintln!(
        "restic {} -> {} in {:.1} s",
        args.join(" "),
        output.status,
        started.elapsed().as_secs_f64()
    );
    output
}

pub fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

pub fn ok(output: Output) -> String {
    assert!(output.status.success(), "restic failed:\n{}", text(&output));
    text(&output)
}

/// The bytes a `backup --json` added to the repository.
pub fn data_added(output: &str) -> u64 {
    output
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message_type"] == "summary")
        .and_then(|v| v["data_added"].as_u64())
        .unwrap_or_else(|| panic!("no summary in:\n{output}"))
}

/// A tree of `files` files (4 KiB to 1 MiB, random) in nested directories,
/// with a quarter of them copied again under `copies/` (duplicated content);
/// returns its size in bytes.
pub fn generate_tree(root: &Path, files: usize, seed: u64) -> u64 {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut total = 0;
    std::fs::create_dir_all(root.join("copies")).unwrap();
    for i in 0..files {
        let dir = root.join(format!("d{}/e{}", i % 7, i % 3));
        std::fs::create_dir_all(&dir).unwrap();
        let mut bytes = vec![0u8; rng.random_range(4 << 10..1 << 20)];
        rng.fill(&mut bytes[..]);
        std::fs::write(dir.join(format!("f{i}")), &bytes).unwrap();
        total += bytes.len() as u64;
        if i % 4 == 0 {
            std::fs::write(root.join("copies").join(format!("c{i}")), &bytes).unwrap();
            total += bytes.len() as u64;
        }
    }
    total
}

pub fn same_tree(a: &Path, b: &Path) {
    let mut stack = vec![PathBuf::new()];
    let mut files = 0;
    while let Some(relative) = stack.pop() {
        for entry in std::fs::read_dir(a.join(&relative)).unwrap() {
            let entry = entry.unwrap();
            let path = relative.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                stack.push(path);
            } else {
                let left = std::fs::read(a.join(&path)).unwrap();
                let right = std::fs::read(b.join(&path))
                    .unwrap_or_else(|e| panic!("{} not restored: {e}", path.display()));
                assert!(left == right, "{} differs after restore", path.display());
                files += 1;
            }
        }
    }
    assert!(files > 0);
}

/// A field of `/proc/PID/status` in KiB (`VmRSS:`, `RssAnon:`, ...), if the
/// process and the field exist.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The body of a plain HTTP/1.1 GET of `path` on a local port (`None` if
/// nothing answers).
pub fn http_get_text(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    // One write: a responder that answers after its first read and closes
    // could otherwise meet a closed socket.
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}
