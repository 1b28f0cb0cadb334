//! Raft traffic to peers: one task and one bounded queue per peer node,
//! each holding a long-lived `RaftTransport.Send` stream that carries
//! batches of messages (for all shared shards) as opaque bytes.
//!
//! A message that finds its peer's queue full is dropped — Raft resends —
//! so a slow or unreachable peer never blocks the shard owners or the
//! other peers. A broken stream is reopened with backoff; messages queued
//! while a peer is unreachable are discarded (they would be stale).
//!
//! A peer sent nothing for a whole tick gets an empty batch: the peer's
//! quiesced followers learn from it that this node lives
//! (`liveness.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use prost011::Message as _;
use raft::eraftpb::Message;
use tidepool_proto::v1::raft_transport_client::RaftTransportClient;
use tidepool_proto::v1::{RaftBatch, RaftEnvelope};
use tokio::sync::mpsc;

use super::{MAX_GRPC_MESSAGE, Node};
use crate::shard::Outgoing;

/// Messages queued per peer before new ones are dropped.
const PEER_QUEUE: usize = 4_096;
/// Most messages per batch on the wire.
const BATCH_MESSAGES: usize = 512;
/// A batch takes no more messages once it holds this many bytes (so the
/// receiver can bound what it decodes: see `raft_batch_limit`).
pub(crate) const BATCH_BYTES: usize = 16 << 20;

/// Outgoing Raft traffic of a node.
pub(crate) struct Transport {
    node_id: u64,
    /// Most time between two batches to a connected peer.
    keepalive: Duration,
    runtime: tokio::runtime::Handle,
    addresses: RwLock<HashMap<u64, String>>,
    peers: Mutex<HashMap<u64, (String, mpsc::Sender<RaftEnvelope>)>>,
    node: RwLock<Weak<Node>>,
    security: tidepool_security::Security,
}

impl Transport {
    /// A transport for node `node_id` dialling with `security`, sending
    /// each connected peer a batch at least every `keepalive`; must be
    /// created in a tokio runtime.
    pub fn new(
        node_id: u64,
        security: tidepool_security::Security,
        keepalive: Duration,
    ) -> Arc<Transport> {
        Arc::new(Transport {
            node_id,
            keepalive,
            security,
            runtime: tokio::runtime::Handle::current(),
            addresses: RwLock::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            node: RwLock::new(Weak::new()),
        })
    }

    /// The node, for metrics.
    pub fn set_node(&self, node: Weak<Node>) {
        *self.node.write() = node;
    }

    /// Records where node `id` is reached.
    pub fn set_address(&self, id: u64, address: String) {
        self.addresses.write().insert(id, address);
    }

    /// Where node `id` is reached.
    pub fn address(&self, id: u64) -> Option<String> {
        self.addresses.read().get(&id).cloned()
    }

    fn queue(&self, to: u64) -> Option<mpsc::Sender<RaftEnvelope>> {
        let address = self.address(to)?;
        let mut peers = self.peers.lock();
        if let Some((known, tx)) = peers.get(&to)
            && *known == address
            && !tx.is_closed()
        {
            return Some(tx.clone());
        }
        // New peer, or its address changed: a new sender task.
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        self.runtime.spawn(run_peer(
            (self.node_id, to),
            address.clone(),
            self.security.clone(),
            self.keepalive,
            rx,
        ));
        peers.insert(to, (address, tx.clone()));
        Some(tx)
    }

    fn count_dropped(&self) {
        if let Some(node) = self.node.read().upgrade() {
            node.metrics.raft_messages_dropped.inc();
        }
    }
}

impl Outgoing for Transport {
    fn send(&self, shard: u32, message: Message) {
        let Some(queue) = self.queue(message.to) else {
            self.count_dropped();
            return;
        };
        let envelope = RaftEnvelope {
            shard_id: shard,
            message: message.encode_to_vec(),
        };
        if queue.try_send(envelope).is_err() {
            self.count_dropped();
        }
    }

    fn split_off(&self, shard: u32) {
        let Some(node) = self.node.read().upgrade() else {
            return;
        };
        // Opening replicas reads their logs: not on the owner's thread.
        let spawned = std::thread::Builder::new()
            .name(format!("split-{shard}"))
            .spawn(move || node.open_split_children());
        if let Err(error) = spawned {
            tracing::warn!(shard, %error, "cannot start a thread to open split-off groups");
        }
    }
}

/// Sends everything queued for peer `to`, reconnecting as needed, and an
/// empty batch after a `keepalive` with nothing sent.
async fn run_peer(
    (from, to): (u64, u64),
    address: String,
    security: tidepool_security::Security,
    keepalive: Duration,
    mut queue: mpsc::Receiver<RaftEnvelope>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let endpoint = match security.endpoint(&address) {
            Ok(endpoint) => endpoint
                .connect_timeout(Duration::from_secs(1))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5)),
            Err(error) => {
                tracing::error!(to, %address, %error, "bad peer address; dropping its traffic");
                while queue.recv().await.is_some() {}
                return;
            }
        };
        let channel = match security.connect(&endpoint).await {
            Ok(channel) => channel,
            Err(error) => {
                tracing::debug!(to, %address, %error, "peer unreachable");
                // What queued up meanwhile is stale: Raft resends.
                while queue.try_recv().is_ok() {}
                if queue.is_closed() {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let mut client =
            RaftTransportClient::new(channel).max_encoding_message_size(MAX_GRPC_MESSAGE);
        let (stream_tx, stream_rx) = mpsc::channel::<RaftBatch>(8);
        let call = client.send(tokio_stream::wrappers::ReceiverStream::new(stream_rx));
        tokio::pin!(call);
        let mut ticks = tokio::time::interval(keepalive);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sent = false;
        loop {
            tokio::select! {
                result = &mut call => {
                    if let Err(status) = result {
                        tracing::debug!(to, %status, "raft stream ended");
                    }
                    break;
                }
                _ = ticks.tick() => {
                    if !std::mem::take(&mut sent) {
                        let batch = RaftBatch { from_node: from, to_node: to, messages: Vec::new() };
                        // Full (the stream is backed up): a batch is on its way anyway.
                        if let Err(mpsc::error::TrySendError::Closed(_)) = stream_tx.try_send(batch) {
                            break;
                        }
                    }
                }
                first = queue.recv() => {
                    let Some(first) = first else { return };
                    let mut bytes = first.message.len();
                    let mut messages = vec![first];
                    while messages.len() < BATCH_MESSAGES && bytes < BATCH_BYTES {
                        match queue.try_recv() {
                            Ok(more) => {
                                bytes += more.message.len();
                                messages.push(more);
                            }
                            Err(_) => break,
                        }
                    }
                    let batch = RaftBatch { from_node: from, to_node: to, messages };
                    if stream_tx.send(batch).await.is_err() {
                        break;
                    }
                    sent = true;
                }
            }
        }
        tokio::time::sleep(backoff).await;
    }
}
