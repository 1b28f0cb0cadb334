//! The wire contract from another language: a Python client (Debian's
//! `python3-grpcio`, stubs generated from `proto/` by Debian's `protoc` and
//! `grpc_python_plugin`) against a real `tidepool dev` cluster. The checks
//! are in `tests/python/wire_contract.py`: a put and a get round trip,
//! `NOT_FOUND` and `NAMESPACE_NOT_FOUND` with their stable codes, and a
//! `NOT_LEADER` whose leader hint the client follows to complete the
//! write — each error a `google.rpc.Status` packing the `ErrorDetail`.

mod support;

use std::path::Path;
use std::process::Command;
/// Debian's interpreter, which `make deps` gives `python3-grpcio`.
const PYTHON: &str = "/usr/bin/python3";
const GRPC_PYTHON_PLUGIN: &str = "/usr/bin/grpc_python_plugin";

/// Generates the Python stubs of `proto/` (and the status message) into
/// `out`.
fn generate_stubs(out: &Path) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let protos: Vec<_> = std::fs::read_dir(repo.join("proto/tidepool/v1"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "proto"))
        .collect();
    let status = Command::new("protoc")
        .arg("-I")
        .arg(repo.join("proto"))
        .arg("-I")
        .arg(repo.join("server/tests/python"))
        .arg(format!("--python_out={}", out.display()))
        .arg(format!("--grpc_python_out={}", out.display()))
        .arg(format!(
            "--plugin=protoc-gen-grpc_python={GRPC_PYTHON_PLUGIN}"
        ))
        .args(&protos)
        .arg(repo.join("server/tests/python/rpc_status.proto"))
        .status()
        .expect("protoc runs (make deps installs protobuf-compiler-grpc)");
    assert!(status.success(), "protoc generated the Python stubs");
}

#[test]
fn a_python_grpc_client_reads_every_error_of_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let stubs = dir.path().join("stubs");
    std::fs::create_dir_all(&stubs).unwrap();
    generate_stubs(&stubs);

    let (cluster, url) = support::start_dev(&dir.path().join("data"), &["--insecure"]);

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/wire_contract.py");
    let output = Command::new(PYTHON)
        .arg(&script)
        .arg(&stubs)
        .arg(&url)
        .output()
        .expect("python3 runs (make deps installs python3-grpcio)");
    drop(cluster);
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "the Python client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
