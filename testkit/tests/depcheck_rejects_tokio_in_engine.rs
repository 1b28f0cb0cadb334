//! Adding `tokio` to the engine's dependencies makes the dependency check
//! fail, naming the rule. Runs the real `depcheck` binary on a copy of this
//! workspace whose `engine/Cargo.toml` gained the forbidden dependency.

use std::path::Path;
use std::process::Command;

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create dir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(&name));
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).expect("copy file");
        }
    }
}

fn run_depcheck(manifest: &Path) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_depcheck"))
        .arg(manifest)
        .env("CARGO_NET_OFFLINE", "true")
        .output()
        .expect("run depcheck");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

#[test]
fn tokio_in_engine_breaks_the_named_rule() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace");
    let copy = tempfile::tempdir().expect("tempdir");
    copy_tree(workspace, copy.path());

    let (ok, text) = run_depcheck(&copy.path().join("Cargo.toml"));
    assert!(ok, "the unmodified workspace must pass:\n{text}");

    let engine_manifest = copy.path().join("engine/Cargo.toml");
    let manifest = std::fs::read_to_string(&engine_manifest).expect("read engine manifest");
    let manifest = manifest.replacen(
        "[dependencies]\n",
        "[dependencies]\ntokio.workspace = true\n",
        1,
    );
    assert!(
        manifest.contains("tokio.workspace"),
        "engine manifest has no [dependencies]"
    );
    std::fs::write(&engine_manifest, manifest).expect("write engine manifest");

    let (ok, text) = run_depcheck(&copy.path().join("Cargo.toml"));
    assert!(!ok, "depcheck passed with tokio in the engine:\n{text}");
    assert!(
        text.contains("dependency rule `engine-is-synchronous-and-standalone` broken")
            && text.contains("tidepool-engine -> tokio"),
        "the failure must name the rule and the path:\n{text}"
    );
}
