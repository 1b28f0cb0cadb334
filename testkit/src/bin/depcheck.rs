//! `depcheck`: fails when a crate depends on something it must not.
//!
//! Usage: `depcheck [path/to/Cargo.toml]` (defaults to the workspace it was
//! built in). Runs `cargo metadata` and checks `tidepool_testkit::depcheck::RULES`.

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let manifest = std::env::args()
        .nth(1)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml").to_string());
    match run(&manifest) {
        Ok(0) => {
            println!(
                "depcheck: {} dependency rules hold",
                tidepool_testkit::depcheck::RULES.len()
            );
            ExitCode::SUCCESS
        }
        Ok(_) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("depcheck: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(manifest: &str) -> Result<usize, String> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--manifest-path",
            manifest,
        ])
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cargo metadata failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("cargo metadata printed invalid JSON: {e}"))?;
    let violations =
        tidepool_testkit::depcheck::check(&metadata, tidepool_testkit::depcheck::RULES)
            .map_err(|e| e.to_string())?;
    for violation in &violations {
        eprintln!("depcheck: {violation}");
    }
    Ok(violations.len())
}
