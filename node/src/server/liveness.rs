//! When each peer node was last heard from, and the watcher that wakes
//! followers (quiesced ones above all) whose leader's node went silent
//! (`docs/design/quiescence.md`).
//!
//! Every Raft batch a peer sends counts, empty ones too: the transport
//! sends one each tick to a peer it had nothing else for
//! (`transport.rs`), so a live node is never silent for long even when
//! every group it leads is quiesced.

use std::collections::HashMap;
use std::sync::Weak;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Node;

/// When each peer node was last heard from.
#[derive(Debug, Default)]
pub(crate) struct PeerLiveness {
    heard: Mutex<HashMap<u64, Instant>>,
}

impl PeerLiveness {
    /// Node `from` sent a batch now.
    pub fn heard(&self, from: u64) {
        self.heard.lock().insert(from, Instant::now());
    }

    /// How long node `id` has been silent (`None`: never heard).
    pub fn silent_for(&self, id: u64) -> Option<Duration> {
        self.heard.lock().get(&id).map(Instant::elapsed)
    }
}

/// Every tick until the node stops or is dropped: tells each follower
/// whose leader's node has been silent for `silence` (a node never heard
/// from is left alone: a follower learns its leader from a batch, which
/// counts).
pub(crate) async fn watch(node: Weak<Node>, tick: Duration, silence: Duration) {
    let Some(mut stopping) = node.upgrade().map(|node| node.stopping.subscribe()) else {
        return;
    };
    let stopped = async move {
        let _ = stopping.wait_for(|stopping| *stopping).await;
    };
    tokio::pin!(stopped);
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = ticks.tick() => {}
        }
        let Some(node) = node.upgrade() else {
            return;
        };
        for shard in node.hosted_shards() {
            let Some(leader) = shard.following() else {
                continue;
            };
            let silent = node
                .liveness
                .silent_for(leader)
                .is_some_and(|silent| silent >= silence);
            if silent && leader != node.config.node_id {
                tracing::debug!(
                    shard = shard.shard_id,
                    leader,
                    "leader's node silent: the follower may elect"
                );
                shard.leader_lost(leader);
            }
        }
    }
}
