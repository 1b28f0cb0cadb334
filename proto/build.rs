//! Generates the Rust code for `proto/tidepool/v1/*.proto` with tonic.
//!
//! `protoc` comes from Debian's `protobuf-compiler` package (`make deps`); see
//! the crate docs for why. `PROTOC` overrides the binary as usual.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "tidepool/v1/common.proto",
        "tidepool/v1/blob.proto",
        "tidepool/v1/cluster.proto",
        "tidepool/v1/coordinator.proto",
        "tidepool/v1/node.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    if std::env::var_os("PROTOC").is_none() && which("protoc").is_none() {
        return Err(
            "protoc not found: run `make deps` (installs Debian's protobuf-compiler) \
                    or set PROTOC to a protoc binary"
                .into(),
        );
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Blob content as `Bytes`: a received message's content is a slice
        // of the buffer it was decoded from, and content to send is sliced
        // from a stored value, with no copy either way.
        .bytes(".tidepool.v1.PutRequest.data")
        .bytes(".tidepool.v1.GetResponse.data")
        .compile_protos(&files, &["."])?;
    Ok(())
}

fn which(binary: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}
