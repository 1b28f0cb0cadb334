//! What the SDK decodes from nodes' replies — chunk manifests and error
//! details — fed well-formed inputs and thousands of mutants (seeded;
//! `FUZZ_SEED` replays, `FUZZ_CASES` runs more): a typed error, never a
//! panic or an allocation out of proportion to the input.

use prost::Message as _;
use tidepool_client::proto::v1::{ChunkManifest, ChunkRef, ErrorCode, ErrorDetail};
use tidepool_testkit::fuzz::{CountingAllocator, Decode, run_all};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[test]
fn replies_the_sdk_decodes_survive_hostile_bytes() {
    let manifest = ChunkManifest {
        size: 10 << 20,
        sha256: vec![1; 32],
        chunks: (0..3)
            .map(|i| ChunkRef {
                key: vec![i; 32],
                size: 4 << 20,
                sha256: vec![i; 32],
            })
            .collect(),
        nonce: 77,
    };
    let status = tidepool_client::proto::status_with_detail(ErrorDetail {
        code: ErrorCode::NotLeader as i32,
        message: "node 1 does not lead shard 2; node 3 does".into(),
        map_version: 4,
        ..ErrorDetail::default()
    });
    let targets: Vec<(&str, Vec<Vec<u8>>, Decode)> = vec![
        (
            "chunk manifest",
            vec![manifest.encode_to_vec()],
            Box::new(|b| ChunkManifest::decode(b).is_ok()),
        ),
        (
            "error details",
            vec![status.details().to_vec()],
            Box::new(|b| {
                let status =
                    tonic::Status::with_details(tonic::Code::Unavailable, "x", b.to_vec().into());
                tidepool_client::proto::error_detail(&status).is_some()
            }),
        ),
    ];
    run_all(targets);
}
