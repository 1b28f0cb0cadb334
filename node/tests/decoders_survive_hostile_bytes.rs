//! Every decoder of what a node reads from its disk or its peers —
//! commands, raft record metadata, the replica's application state with
//! its write sessions, the stored blob header, snapshot manifests, Raft
//! messages — fed well-formed inputs and thousands of mutants (seeded;
//! `FUZZ_SEED` replays, `FUZZ_CASES` runs more): each returns a value or a
//! typed error, never panics, never makes one allocation out of proportion
//! to its input.

use tidepool_testkit::fuzz::{CountingAllocator, run_all};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[test]
fn every_node_decoder_survives_hostile_bytes() {
    run_all(tidepool_node::fuzzing::targets());
}
