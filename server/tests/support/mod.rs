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
    let (child, banner) = start_dev_banner(dir, extra);
    let url = banner[0]
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap()
        .trim_end_matches(',')
        .to_string();
    (child, url)
}

/// Starts dev mode like [`start_dev`]; returns the process and every line
/// of its ready banner.
pub fn start_dev_banner(dir: &std::path::Path, extra: &[&str]) -> (Child, Vec<String>) {
    std::fs::create_dir_all(dir).unwrap();
    let mut child = Command::new(BIN)
        .args(["dev", "--port", "0", "--data-dir"])
        .arg(dir)
        .args(extra)
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
    let banner = read_banner(&rx);
    match banner {
        Ok(banner) => (child, banner),
        Err(problem) => {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(dir.join("dev.log")).unwrap_or_default();
            panic!("{problem}\n--- dev.log\n{log}");
        }
    }
}

/// The banner's lines, up to the one saying how to stop.
fn read_banner(rx: &std::sync::mpsc::Receiver<String>) -> Result<Vec<String>, String> {
    let mut banner = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| "dev mode did not print its banner within 60 s".to_string())?;
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
