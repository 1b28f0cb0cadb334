//! Every decoder of the engine's on-disk formats — WAL records and their
//! headers, the control file, segment headers, index blobs, bloom filters,
//! index entries in each format — fed well-formed inputs and thousands of
//! mutants of them (seeded; `FUZZ_SEED` replays, `FUZZ_CASES` runs more):
//! each returns a value or a typed error, never panics, and never makes one
//! allocation out of proportion to its input.

use tidepool_testkit::fuzz::{CountingAllocator, run_all};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[test]
fn every_on_disk_decoder_survives_hostile_bytes() {
    run_all(tidepool_engine::fuzzing::targets());
}
