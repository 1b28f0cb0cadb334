//! Traces through Raft: the spans a traced write gets on its way through
//! the shard's log.
//!
//! - The leader's shard owner makes one `raft.propose` span per entry it
//!   proposes for traced writes: a child of the first traced request of the
//!   group-committed batch, linked to every other traced request in it. It
//!   ends when the entry is applied (or fails).
//! - The entry carries that span's `traceparent` in its Raft context (the
//!   `context` field of the entry, stored with it in the WAL: 55 bytes, only
//!   on traced entries).
//! - Followers make `raft.append` (until the entry is durable in their WAL)
//!   and every replica `raft.apply` (applying it), children of
//!   `raft.propose`.
//!
//! Nothing here runs unless the process exports spans
//! (`tidepool_security::trace_context::exporting`): untraced writes carry no
//! span and entries no context.

use tidepool_security::trace_context;
use tracing::Span;

/// Where a replica's span happens: its node, shard and the Raft term.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    pub node_id: u64,
    pub shard_id: u32,
    pub term: u64,
}

/// The span of an entry proposed at `place` for `spans` (the traced
/// requests of its batch) and the `traceparent` the entry carries; a
/// disabled span and no context when nothing in the batch is sampled.
pub(crate) fn propose_span(spans: &[Span], place: Place, ops: usize) -> (Span, Vec<u8>) {
    let Some(first) = spans.first() else {
        return (Span::none(), Vec::new());
    };
    let span = tracing::info_span!(
        target: "tidepool_node::raft",
        parent: first,
        "raft.propose",
        node_id = place.node_id,
        shard_id = place.shard_id,
        term = place.term,
        ops,
        traced_requests = spans.len()
    );
    for other in &spans[1..] {
        trace_context::link(&span, other);
    }
    match trace_context::traceparent(&span) {
        Some(traceparent) => (span, traceparent),
        None => (Span::none(), Vec::new()),
    }
}

/// Which step of an entry a replica traces.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step {
    /// A follower appending it to its log (until durable).
    Append,
    /// A replica applying it.
    Apply,
}

/// The span of `step` at `place` for the entry at `index` whose context
/// is `traceparent` (a disabled span for an untraced entry); `place.term`
/// is the entry's term.
pub(crate) fn entry_span(step: Step, traceparent: &[u8], place: Place, index: u64) -> Span {
    if traceparent.is_empty() || !trace_context::exporting() {
        return Span::none();
    }
    let Place {
        node_id,
        shard_id,
        term,
    } = place;
    let parent = trace_context::from_traceparent(traceparent);
    trace_context::continued(parent, || match step {
        Step::Append => tracing::info_span!(
            target: "tidepool_node::raft",
            parent: None,
            "raft.append",
            node_id,
            shard_id,
            term,
            index
        ),
        Step::Apply => tracing::info_span!(
            target: "tidepool_node::raft",
            parent: None,
            "raft.apply",
            node_id,
            shard_id,
            term,
            index
        ),
    })
}
