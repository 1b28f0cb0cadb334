//! Turning replica outcomes and engine errors into the stable error codes
//! clients see, with the hints they need to retry (leader, map version,
//! shard).

use tidepool_proto::ErrorInfo;
use tidepool_proto::v1::ErrorCode;

use super::Node;
use crate::error::NodeError;
use crate::replica::{Outcome, ReadOutcome};

impl Node {
    /// `NOT_LEADER` for `shard_id`, naming `leader` when known. Never names
    /// this node (a leader whose role is changing says so, with a
    /// retry-after instead of a hint).
    pub(crate) fn not_leader(&self, shard_id: u32, leader: u64) -> ErrorInfo {
        let leader = if leader == self.config.node_id {
            0
        } else {
            leader
        };
        let mut info = self.error(
            ErrorCode::NotLeader,
            match leader {
                0 => format!("shard {shard_id} has no known leader (it may be changing)"),
                id => format!(
                    "node {} does not lead shard {shard_id}; node {id} does",
                    self.config.node_id
                ),
            },
        );
        info.detail.shard_id = Some(shard_id);
        if leader != 0 {
            info.detail.leader_hint = self.address_of(leader);
            info.detail.leader_silent_ms = self.leader_silent_ms(shard_id, leader);
        } else {
            info.detail.retry_after_ms = self.config.raft.tick_ms as u32 * 5;
        }
        info
    }

    /// How long this node's replica of `shard_id` has not heard from
    /// `leader`, in milliseconds, once that is more than two heartbeat
    /// intervals: a hint to clients that the leader may be gone.
    fn leader_silent_ms(&self, shard_id: u32, leader: u64) -> Option<u32> {
        let status = self.shard(shard_id)?.state().status?;
        let raft = &self.config.raft;
        (status.leader == leader && status.leader_silent_ticks > 2 * raft.heartbeat_ticks as u64)
            .then(|| u32::try_from(status.leader_silent_ticks * raft.tick_ms).unwrap_or(u32::MAX))
    }

    /// The error for a proposal that did not apply.
    pub(crate) fn outcome_error(&self, shard_id: u32, outcome: Outcome) -> ErrorInfo {
        let mut info = match outcome {
            Outcome::Applied { .. } => self.error(ErrorCode::Internal, "applied is not an error"),
            Outcome::NotLeader { leader } => return self.not_leader(shard_id, leader),
            Outcome::Dropped => self.error(
                ErrorCode::NoQuorum,
                format!(
                    "shard {shard_id} changed leader before the write committed; it was not applied, retry"
                ),
            ),
            Outcome::TooLarge { max } => self.error(
                ErrorCode::ValueTooLarge,
                format!("the entry exceeds the {max}-byte maximum"),
            ),
            Outcome::Overloaded => {
                let mut info = self.error(
                    ErrorCode::Overloaded,
                    format!("shard {shard_id} has too many requests queued"),
                );
                info.detail.retry_after_ms = 50;
                info
            }
            Outcome::Failed(reason) => self.error(
                ErrorCode::NoQuorum,
                format!("shard {shard_id} is unavailable: {reason}"),
            ),
        };
        info.detail.shard_id = Some(shard_id);
        info
    }

    /// The error for a read that may not be served.
    pub(crate) fn read_error(&self, shard_id: u32, outcome: ReadOutcome) -> ErrorInfo {
        match outcome {
            ReadOutcome::Ready => self.error(ErrorCode::Internal, "ready is not an error"),
            ReadOutcome::NotLeader { leader } => self.not_leader(shard_id, leader),
            ReadOutcome::Failed(reason) => {
                let mut info = self.error(
                    ErrorCode::NoQuorum,
                    format!("shard {shard_id} cannot serve the read: {reason}"),
                );
                info.detail.shard_id = Some(shard_id);
                info
            }
        }
    }

    /// The error for a failure of an admin call on this node's replica of
    /// `shard_id`: a replica that failed or whose files are missing needs
    /// an operator (or the coordinator's rebuild), not a retry elsewhere,
    /// so it is `INTERNAL` there; otherwise as [`Node::internal_error`].
    pub(crate) fn admin_error(&self, shard_id: u32, error: NodeError) -> ErrorInfo {
        match error {
            NodeError::Failed(_) | NodeError::FilesMissing(_) => {
                tracing::error!(shard_id, %error, "admin call failed");
                let mut info =
                    self.error(ErrorCode::Internal, format!("shard {shard_id}: {error}"));
                info.detail.shard_id = Some(shard_id);
                info
            }
            error => self.internal_error(shard_id, error),
        }
    }

    /// The error for an engine or node failure while serving.
    ///
    /// A replica that is down — its engine poisoned by a failed write or
    /// sync, closed under the request, the replica failed, its files gone —
    /// answers `NO_QUORUM`, as its owner answers the requests it fails: the
    /// other replicas hold the shard, so the client tries them. (It was
    /// `INTERNAL`, which no client retries: a replica directory deleted
    /// under a leader failed the reads that were between their lease check
    /// and the engine, found by the e2e soak.)
    pub(crate) fn internal_error(&self, shard_id: u32, error: NodeError) -> ErrorInfo {
        use tidepool_engine::Error as EngineError;
        let code = match &error {
            NodeError::Engine(EngineError::DiskFull(_)) => ErrorCode::DiskFull,
            NodeError::Engine(EngineError::Corrupt { .. }) => ErrorCode::Corrupt,
            NodeError::Engine(EngineError::Closed | EngineError::Poisoned(_))
            | NodeError::Failed(_)
            | NodeError::FilesMissing(_) => ErrorCode::NoQuorum,
            NodeError::Malformed(_) => ErrorCode::Corrupt,
            _ => ErrorCode::Internal,
        };
        if code == ErrorCode::Internal {
            tracing::error!(shard_id, %error, "request failed");
        }
        let message = match code {
            ErrorCode::NoQuorum => format!(
                "shard {shard_id} is unavailable on node {}: {error}",
                self.config.node_id
            ),
            _ => format!("shard {shard_id}: {error}"),
        };
        let mut info = self.error(code, message);
        info.detail.shard_id = Some(shard_id);
        info
    }
}
