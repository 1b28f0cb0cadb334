//! Shared by the server's process tests: starting `tidepool dev`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_tidepool");

/// Starts dev mode with its data in `dir`, on free ports; returns the
/// process and the coordinator URL from its ready banner.
pub fn start_dev(dir: &std::path::Path, extra: &[&str]) -> (Child, String) {
    let mut child = Command::new(BIN)
        .args(["dev", "--port", "0", "--data-dir"])
        .arg(dir)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("dev mode prints its banner within 60 s");
    assert!(line.contains("ready"), "{line}");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap()
        .trim_end_matches(',')
        .to_string();
    (child, url)
}
