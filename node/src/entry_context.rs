//! What a Raft entry's context carries (the `context` field raft-rs keeps
//! with each entry, stored with it in the WAL and sent with it to
//! followers): whether every replica must sync the entry before it counts
//! toward the commit, and the trace context of its span
//! (`tracing_context`).
//!
//! Layout: an optional marker byte (`S`), then the `traceparent` (W3C,
//! ASCII beginning with its version `00`) or nothing. An untraced entry
//! that needs no sync has an empty context, as before the marker existed;
//! a node that predates it reads a marked context as an unreadable trace
//! context (no span) and syncs as its configuration says.

/// Marks an entry every replica syncs before acknowledging it.
const SYNC: u8 = b'S';

/// How durable an entry must be on each replica that acknowledges it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EntrySync {
    /// As the replica's configuration says (`raft.durability`).
    #[default]
    AsConfigured,
    /// Synced to disk first, whatever the configuration: a request asked
    /// for `DURABILITY_SYNCED` on a cluster configured `buffered`. Since a
    /// commit needs a majority of acknowledgements, a committed marked
    /// entry is on the disks of a majority.
    Always,
}

/// The context of an entry proposed with `sync` and `traceparent` (empty:
/// untraced).
pub(crate) fn encode(sync: EntrySync, traceparent: Vec<u8>) -> Vec<u8> {
    match sync {
        EntrySync::AsConfigured => traceparent,
        EntrySync::Always => {
            let mut context = Vec::with_capacity(1 + traceparent.len());
            context.push(SYNC);
            context.extend_from_slice(&traceparent);
            context
        }
    }
}

/// Whether an entry with this context must be synced on every replica.
pub(crate) fn must_sync(context: &[u8]) -> bool {
    context.first() == Some(&SYNC)
}

/// The trace context in an entry's context (empty: untraced).
pub(crate) fn traceparent(context: &[u8]) -> &[u8] {
    if must_sync(context) {
        &context[1..]
    } else {
        context
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_and_the_trace_context_come_back_apart() {
        let traced = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec();
        for (sync, parent) in [
            (EntrySync::AsConfigured, Vec::new()),
            (EntrySync::AsConfigured, traced.clone()),
            (EntrySync::Always, Vec::new()),
            (EntrySync::Always, traced.clone()),
        ] {
            let context = encode(sync, parent.clone());
            assert_eq!(must_sync(&context), sync == EntrySync::Always);
            assert_eq!(traceparent(&context), &parent[..]);
        }
        // Contexts written before the marker existed.
        assert!(!must_sync(b""));
        assert!(!must_sync(&traced));
        assert_eq!(encode(EntrySync::AsConfigured, Vec::new()), b"");
    }
}
