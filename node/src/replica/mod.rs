//! One shard replica: a raft-rs `RawNode` whose storage is the Raft log on
//! the shard's engine, driven by exactly one owner through the Ready
//! checklist (`ready.rs`), applying committed entries to the engine
//! (`apply.rs`).
//!
//! The replica does no network I/O: messages to send come out of
//! [`Replica::handle_ready`], messages received go in through
//! [`Replica::step`], time through [`Replica::tick`]. The engine is its only
//! I/O. So the same code runs under the gRPC transport and under the
//! simulated network of the cluster tests.

mod apply;
mod proposals;
mod quiesce;
mod read;
mod ready;
mod split;
mod sweep;
mod transfer;
mod votes;

use std::sync::Arc;

use raft::eraftpb::{ConfChangeV2, Message, MessageType};
use raft::{RawNode, StateRole};
use tidepool_engine::{Durability, Engine, KeySpace};
use tidepool_proto::v1::NodeAddress;

use crate::command::Command;
use crate::entry_context::EntrySync;
use crate::error::{NodeError, Result};
use crate::raftlog::{RaftLog, SnapshotSender, SplitChild};
use crate::snapshot::Outbox;
use crate::store::ReplicaStore;

/// Name of the engine key space holding a replica's blobs.
pub const BLOB_KEY_SPACE: &str = "blobs";
use proposals::Proposals;
pub use proposals::{Completion, Outcome};
pub use quiesce::QUIESCE_CONTEXT;
use quiesce::Quiescence;
use read::Reads;
pub use read::{LeaseClock, LeaseGate, ReadCompletion, ReadOutcome, safe_lease};
pub use split::{CRASH_POINT_VAR, SPLIT_TEMP_PREFIX};
pub use sweep::SWEPT_LOG;
use sweep::Sweeping;
use transfer::TransferState;
pub use transfer::{HEARD_WITHIN_HEARTBEATS, MAX_HELD_BYTES, MAX_LAG_ENTRIES};
pub use votes::HELD_CONTEXT;
use votes::VoteHold;

/// Settings of a replica.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// The shard.
    pub shard_id: u32,
    /// This replica's Raft id: the node id.
    pub node_id: u64,
    /// This node's gRPC address, where peers fetch its snapshots.
    pub address: String,
    /// Ticks without a heartbeat before a follower campaigns: at least
    /// this many (what check-quorum and the leader lease count on) ...
    pub election_ticks: usize,
    /// ... and fewer than this many more, drawn anew at every reset (Raft's
    /// randomized election timeout; raft-rs's default spread is
    /// `election_ticks`, which lets a frozen leader's shard wait up to twice
    /// the timeout).
    pub election_spread_ticks: usize,
    /// Ticks between a leader's heartbeats.
    pub heartbeat_ticks: usize,
    /// Durability an entry needs before this replica acknowledges it.
    pub durability: Durability,
    /// Largest command accepted for proposal, bytes.
    pub max_command_bytes: usize,
    /// Largest batch of entries per append message, bytes.
    pub max_message_bytes: u64,
    /// Compact the log once it holds this many applied entries...
    pub compact_log_entries: u64,
    /// ... or its records span this many WAL bytes. A follower further
    /// behind than `compact_log_entries` is caught up by a snapshot.
    pub compact_log_bytes: u64,
    /// A snapshot transfer that pulls nothing for this many ticks counts as
    /// failed, and the leader sends a new one.
    pub snapshot_idle_ticks: u32,
    /// Hash snapshots on the Raft thread (deterministic tests only: it
    /// blocks the shard while the whole snapshot is read).
    pub hash_snapshots_inline: bool,
    /// After opening, campaign within a few ticks if no leader is heard of,
    /// instead of a whole election timeout: after a whole-cluster restart
    /// the shard has a leader sooner. Harmless when a leader exists: with
    /// pre-vote and check-quorum, voters that hear from a leader reject it.
    pub early_campaign: bool,
    /// The hash range (inclusive) a group founded by this replica owns,
    /// recorded in its replicated state; writes applied outside it are
    /// refused with `WRONG_SHARD`. `None`: not recorded (not checked).
    /// Unused by a replica that exists already or joins a group: its range
    /// is the group's.
    pub range: Option<(u64, u64)>,
    /// Where the replica shows the range its group owns, updated as soon
    /// as it changes (opened, a split applied, a snapshot installed) and
    /// before any read completes after the change: a node routing and
    /// serving reads by it never reads a key the group gave away.
    pub range_cell: Option<RangeCell>,
    /// Where the replica shows its shard's session clock as applied (at
    /// its opening, after each entry, at a snapshot's install): the node
    /// stamps the sessioned writes it proposes from it
    /// ([`crate::session::SessionClock`]).
    pub session_clock: Option<Arc<crate::session::SessionClock>>,
    /// The ids of the namespaces the node's map names (shared by the
    /// node's replicas): after a split, the replica sweeps those
    /// namespaces' names outside its range from its name index (the index
    /// cannot name its namespaces). `None`: only namespaces with an epoch
    /// drop applied are swept.
    pub namespaces: Option<NamespaceIds>,
    /// Serve linearizable reads on the leader's lease for this long after
    /// a majority confirmed its leadership (at most [`read::safe_lease`]
    /// of the Raft timings: `read.rs` says why that is safe). `None`: every
    /// read batch costs a heartbeat round.
    pub lease: Option<std::time::Duration>,
    /// The clock the lease runs on.
    pub lease_clock: LeaseClock,
    /// Where a leader shows until when the node may serve linearizable
    /// reads on its lease without asking the owner (`read.rs`, "Reads
    /// without the owner"). `None`: every read is asked of the owner.
    pub lease_gate: Option<LeaseGate>,
    /// A leader with nothing in flight for this many ticks quiesces its
    /// group: it and its followers stop ticking until something wakes them
    /// (`quiesce.rs`). 0: never. Only where something wakes the followers
    /// of a silent leader's node ([`Replica::leader_lost`]).
    pub quiesce_ticks: u32,
}

/// Ticks without a snapshot chunk pulled after which a transfer counts as
/// failed: the leader sends a new snapshot, and a receiver gives up its
/// stream (`ReplicaConfig::snapshot_idle_ticks` by default).
pub const SNAPSHOT_IDLE_TICKS: u32 = 50;

/// A replica's current range, shared with whoever routes to it.
pub type RangeCell = Arc<parking_lot::RwLock<Option<(u64, u64)>>>;

/// The ids of the namespaces a node's cluster map names.
pub type NamespaceIds = Arc<arc_swap::ArcSwap<Vec<u32>>>;

impl ReplicaConfig {
    /// Defaults for `shard_id` on node `node_id`.
    pub fn new(shard_id: u32, node_id: u64) -> Self {
        Self {
            shard_id,
            node_id,
            election_ticks: 10,
            election_spread_ticks: 3,
            heartbeat_ticks: 2,
            durability: Durability::Synced,
            address: String::new(),
            max_command_bytes: 4 << 20,
            max_message_bytes: 1 << 20,
            compact_log_entries: 10_000,
            compact_log_bytes: 512 << 20,
            snapshot_idle_ticks: SNAPSHOT_IDLE_TICKS,
            hash_snapshots_inline: false,
            early_campaign: false,
            range: None,
            range_cell: None,
            session_clock: None,
            namespaces: None,
            lease: None,
            lease_clock: LeaseClock::Monotonic,
            lease_gate: None,
            quiesce_ticks: 0,
        }
    }
}

/// One shard replica.
pub struct Replica {
    config: ReplicaConfig,
    /// Set once the replica failed; every later call refuses.
    failed: Option<String>,
    /// The replica's directory (engine slots).
    store: ReplicaStore,
    /// The engine key space of blob values.
    space: KeySpace,
    /// The engine key space of the name index (`crate::names`).
    names: KeySpace,
    raw: RawNode<RaftLog>,
    proposals: Proposals,
    reads: Reads,
    /// Proposals held during a leadership transfer; when peers answered.
    transfer: TransferState,
    /// Followers being sent a snapshot: chunks pulled when last looked at,
    /// and ticks since that changed.
    snapshot_watch: std::collections::BTreeMap<u64, (u64, u32)>,
    /// Followers going on from the log after a snapshot, further behind
    /// than the log keeps for a follower: the index they matched when last
    /// looked at, and ticks since that changed (`ready.rs`,
    /// `maybe_compact`).
    catch_up: std::collections::BTreeMap<u64, (u64, u32)>,
    /// The index of an epoch drop applied that no compaction has reached
    /// yet, and whether one was forced since: the first compaction after
    /// it, and the one that reaches it, go ahead whatever the limits
    /// (`maybe_compact`).
    drop_to_compact: Option<(u64, bool)>,
    /// Sweeping the name index (names outside the range, dropped ones).
    sweeping: Sweeping,
    /// Whether the group stopped ticking, having nothing to do.
    quiescence: Quiescence,
    /// The hold on a founding replica's votes (`votes.rs`).
    votes: VoteHold,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("shard", &self.config.shard_id)
            .field("node", &self.config.node_id)
            .field("role", &self.raw.raft.state)
            .field("term", &self.raw.raft.term)
            .finish()
    }
}

/// A snapshot of a replica's Raft state, for status reports and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// Whether this replica leads.
    pub is_leader: bool,
    /// The leader it knows of (0: none).
    pub leader: u64,
    /// Current term.
    pub term: u64,
    /// Highest index known committed.
    pub commit: u64,
    /// Highest index applied to the engine.
    pub applied: u64,
    /// First index still in the log (entries before it are compacted).
    pub first_index: u64,
    /// Last index in the log.
    pub last_index: u64,
    /// Voters and learners.
    pub voters: Vec<u64>,
    /// Learners.
    pub learners: Vec<u64>,
    /// Raft index of the entry that made this configuration.
    pub conf_index: u64,
    /// Epoch drops applied: (namespace id, blobs below this epoch gone).
    pub drops: Vec<(u32, u32)>,
    /// Retentions recorded by retain entries, by namespace id.
    pub retained: Vec<(u32, crate::raftlog::Retained)>,
    /// On a leader: entries the slowest voter has yet to append (its
    /// matched index behind the last index); 0 on followers.
    pub append_lag: u64,
    /// On a follower that knows its leader: ticks since it last heard from
    /// it (an append or a heartbeat); 0 otherwise.
    pub leader_silent_ticks: u64,
    /// The hash range the group owns, as replicated (`None`: not
    /// recorded).
    pub range: Option<(u64, u64)>,
    /// The groups split off this one.
    pub children: Vec<SplitChild>,
    /// Whether the group is quiesced (not ticking; `quiesce.rs`).
    pub quiesced: bool,
    /// Whether this replica, having founded its group, holds its votes
    /// until it catches up with a leader (`votes.rs`).
    pub votes_held: bool,
}

impl Replica {
    /// Opens the replica in `store` (creating it if empty). A new replica
    /// with `initial_voters` founds the group; one with none waits to be
    /// added. Snapshots it prepares as a leader are offered in `outbox`.
    pub fn open(
        config: ReplicaConfig,
        store: ReplicaStore,
        outbox: Arc<Outbox>,
        initial_voters: &[u64],
    ) -> Result<Replica> {
        let engine = store.open_live()?;
        let space = engine.key_space(BLOB_KEY_SPACE)?;
        let names = engine.key_space(crate::names::NAMES_KEY_SPACE)?;
        // A founding replica records that it holds its votes first
        // (`votes.rs`): a crash right after the founding must not forget it.
        let mut log =
            RaftLog::open_with_range(engine, space, initial_voters, config.range, |voters| {
                if votes::holds_when_founding(config.node_id, voters) {
                    store.hold_votes()?;
                }
                Ok(())
            })?;
        let mut sender = SnapshotSender::new(
            config.shard_id,
            NodeAddress {
                node_id: config.node_id,
                address: config.address.clone(),
            },
            outbox,
        );
        sender.hash_inline = config.hash_snapshots_inline;
        log.set_snapshot_sender(sender);
        let raft_config = raft::Config {
            id: config.node_id,
            election_tick: config.election_ticks,
            min_election_tick: config.election_ticks,
            max_election_tick: config.election_ticks + config.election_spread_ticks.max(1),
            heartbeat_tick: config.heartbeat_ticks,
            applied: log.applied(),
            max_size_per_msg: config.max_message_bytes,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            ..raft::Config::default()
        };
        raft_config.validate()?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let raw = RawNode::new(&raft_config, log, &logger)?;
        let mut replica = Replica {
            config,
            failed: None,
            store,
            space,
            names,
            raw,
            proposals: Proposals::default(),
            reads: Reads::default(),
            transfer: TransferState::default(),
            snapshot_watch: Default::default(),
            catch_up: Default::default(),
            drop_to_compact: None,
            sweeping: Sweeping::default(),
            quiescence: Quiescence::default(),
            votes: VoteHold::default(),
        };
        replica.open_vote_hold();
        replica.reapply_after_restart()?;
        // After the entries applied again: a blob stored before the index
        // existed may be one a crash left to be applied again.
        crate::names::check_complete(replica.engine(), names, space)?;
        // Applied again: snapshots may move the replay position on.
        replica.engine().release_replay_hold();
        replica.show_range();
        replica.show_session_clock();
        replica.reads.never_answered = replica.config.durability == Durability::Synced
            && replica.raw.raft.term <= crate::raftlog::FOUNDING_TERM;
        let voters = replica.voters_sorted();
        let rank = voters.iter().position(|id| *id == replica.config.node_id);
        if let Some(rank) = rank.filter(|_| replica.config.early_campaign) {
            // Between 2 ticks and half an election timeout; with leases,
            // after the quiet ticks that follow an opening, unless this
            // replica never answered a leader (`read.rs`). Each voter of
            // the group takes its own tick in that window, in a turn that
            // rotates with the shard: voters that all campaigned in one
            // tick would each vote for itself and wait a whole election
            // timeout (one start in nine with three voters drawing from
            // three ticks), and the first to campaign is the shard's
            // leader, spread over the nodes.
            let ticks = replica.config.election_ticks as u64;
            let (earliest, latest) = match replica.config.lease {
                Some(_) if !replica.reads.never_answered => (ticks, ticks + (ticks / 2).max(2)),
                _ => (2, (ticks / 2).max(3)),
            };
            let count = voters.len() as u64;
            let turn = (rank as u64 + u64::from(replica.config.shard_id)) % count;
            let step = ((latest - earliest) / count).max(1);
            replica.transfer.campaign_at = Some(earliest + turn * step);
        }
        Ok(replica)
    }

    /// The group's voters, by id.
    pub(crate) fn voters_sorted(&self) -> Vec<u64> {
        let mut voters: Vec<u64> = self.raw.raft.prs().conf().voters().ids().iter().collect();
        voters.sort_unstable();
        voters
    }

    /// Shows the shard's session clock as applied in the configured
    /// clock.
    pub(crate) fn show_session_clock(&mut self) {
        if let Some(clock) = self.config.session_clock.clone() {
            clock.applied(self.log().sessions().clock_ms());
        }
    }

    /// Shows the group's range in the configured cell, and has the engine's
    /// background relocation drop the blobs outside it (a split group's
    /// keys of the other half: never read or written here again).
    pub(crate) fn show_range(&mut self) {
        let range = self.log().range();
        if let Some(cell) = &self.config.range_cell {
            *cell.write() = range;
        }
        // A new range, or a new engine (a snapshot): look again.
        self.sweeping = Sweeping::default();
        if let Some(range) = range {
            let shed = split::OutsideRange {
                blobs: self.space,
                range,
            };
            self.engine().set_relocation_filter(Arc::new(shed));
        }
    }

    /// The shard.
    pub fn shard_id(&self) -> u32 {
        self.config.shard_id
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        self.raw.store().engine()
    }

    /// Runs `f` on the Raft state machine, unless the replica failed. A
    /// failed engine, or a panic inside raft-rs (which it uses for storage
    /// errors it cannot handle), fails the replica for good: like a crashed
    /// process, it must be reopened, and its durable state is intact.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(reason) = &self.failed {
            return Err(NodeError::Failed(reason.clone()));
        }
        if let Err(error) = self.engine().health() {
            return Err(self.fail(error.to_string()));
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self))) {
            Ok(Err(error @ NodeError::Engine(_))) => Err(self.fail(error.to_string())),
            Ok(result) => result,
            Err(_) => Err(self.fail("raft-rs panicked".into())),
        }
    }

    fn fail(&mut self, reason: String) -> NodeError {
        self.fail_held(&reason);
        self.proposals.fail_all(&reason);
        self.reads.fail_all(&ReadOutcome::Failed(reason.clone()));
        self.failed = Some(reason.clone());
        self.show_lease();
        NodeError::Failed(reason)
    }

    /// Advances the logical clock by one tick (none passes for a
    /// quiesced replica).
    pub fn tick(&mut self) -> Result<()> {
        if self.is_quiesced() {
            return Ok(());
        }
        self.guarded(|r| {
            r.raw.tick();
            r.transfer_tick();
            r.maybe_campaign_early()?;
            r.expire_reads();
            r.watch_snapshots();
            r.sweep_names();
            // An aborted transfer ends in a tick.
            r.release_held()?;
            r.maybe_quiesce();
            Ok(())
        })
    }

    /// On the leader: a follower in snapshot state whose transfer pulled
    /// nothing for `snapshot_idle_ticks` (the message was lost, or the
    /// receiver gave up) is reported failed, so raft-rs sends another; a
    /// follower catching up after a snapshot whose matched index did not
    /// move for as long no longer holds the log's entries.
    fn watch_snapshots(&mut self) {
        if self.raw.raft.state != StateRole::Leader {
            self.snapshot_watch.clear();
            self.catch_up.clear();
            return;
        }
        let sending: Vec<u64> = self
            .raw
            .raft
            .prs()
            .iter()
            .filter(|(_, p)| p.state == raft::ProgressState::Snapshot)
            .map(|(id, _)| *id)
            .collect();
        self.snapshot_watch.retain(|id, _| sending.contains(id));
        for id in sending {
            let pulls = self.raw.store().snapshot_pulls(id);
            let watch = self.snapshot_watch.entry(id).or_insert((pulls, 0));
            if watch.0 == pulls {
                watch.1 += 1;
            } else {
                *watch = (pulls, 0);
            }
            if watch.1 > self.config.snapshot_idle_ticks {
                tracing::warn!(
                    to = id,
                    pulls,
                    idle_ticks = watch.1,
                    "snapshot transfer given up: no chunk pulled for the idle bound; the follower will be sent a new snapshot"
                );
                self.snapshot_watch.remove(&id);
                self.catch_up.remove(&id);
                self.raw.report_snapshot(id, raft::SnapshotStatus::Failure);
            }
        }
        let prs = self.raw.raft.prs();
        let kept =
            (self.raw.raft.raft_log.applied).saturating_sub(self.config.compact_log_entries / 2);
        let idle_bound = self.config.snapshot_idle_ticks;
        self.catch_up.retain(|id, watch| {
            let Some(progress) = prs.get(*id) else {
                return false;
            };
            if progress.state != raft::ProgressState::Snapshot && progress.matched >= kept {
                return false; // within what the log keeps anyway
            }
            if progress.state == raft::ProgressState::Snapshot || progress.matched != watch.0 {
                *watch = (progress.matched, 0);
                return true;
            }
            watch.1 += 1;
            if watch.1 > idle_bound {
                tracing::warn!(
                    to = id,
                    matched = progress.matched,
                    idle_ticks = watch.1,
                    "catch-up after a snapshot stalled: the log no longer keeps the follower's entries"
                );
                return false;
            }
            true
        });
    }

    /// Takes in a message from a peer.
    pub fn step(&mut self, message: Message) -> Result<()> {
        self.guarded(|r| {
            r.note_heard(&message);
            r.before_step(&message);
            let vote = matches!(
                message.get_msg_type(),
                MessageType::MsgRequestVote | MessageType::MsgRequestPreVote
            );
            if vote && message.context != raft::CAMPAIGN_TRANSFER && r.quiet_after_open() {
                // Not yet: a lease this voter helped confirm may still run.
                return Ok(());
            }
            if r.held_back(&message) {
                // A founding replica not caught up yet (`votes.rs`).
                return Ok(());
            }
            let quiesce = (message.msg_type() == MessageType::MsgHeartbeat
                && message.context == QUIESCE_CONTEXT)
                .then_some((message.from, message.term));
            // The commit index as the leader sent it (`votes.rs`).
            let (kind, from, term, commit) = (
                message.msg_type(),
                message.from,
                message.term,
                message.commit,
            );
            let mut message = message;
            r.when_entries_were_lost(&mut message);
            match r.raw.step(message) {
                // Messages from peers outside the configuration are dropped.
                Err(raft::Error::StepPeerNotFound) => {}
                other => other?,
            }
            r.note_caught_up(kind, from, term, commit, quiesce.is_some());
            if let Some((from, term)) = quiesce {
                r.after_quiesce_heartbeat(from, term);
            }
            // A completed transfer ends when a message makes this replica
            // a follower.
            r.release_held()
        })
    }

    /// Gives `done` back if this replica may propose; otherwise completes
    /// it (failed, or not the leader) and returns what the proposing call
    /// returns.
    fn may_propose(&mut self, done: Completion) -> std::result::Result<Completion, Result<()>> {
        self.wake();
        if let Some(reason) = &self.failed {
            done(Outcome::Failed(reason.clone()));
            return Err(Err(NodeError::Failed(reason.clone())));
        }
        if self.raw.raft.state != StateRole::Leader {
            done(Outcome::NotLeader {
                leader: self.raw.raft.leader_id,
            });
            return Err(Ok(()));
        }
        Ok(done)
    }

    /// Proposes a command; `done` is called once it is applied, or with the
    /// reason it will not be. Fails at once if this replica does not lead.
    pub fn propose(&mut self, command: &Command, done: Completion) -> Result<()> {
        self.propose_traced(command, EntrySync::AsConfigured, Vec::new(), done)
    }

    /// [`Replica::propose`], the entry synced by every replica before it
    /// counts if `sync` says so, and carrying `traceparent` (the W3C trace
    /// context of its span, or empty) in its context, so followers trace
    /// their append and apply as children of it (`entry_context`).
    pub fn propose_traced(
        &mut self,
        command: &Command,
        sync: EntrySync,
        traceparent: Vec<u8>,
        done: Completion,
    ) -> Result<()> {
        let done = match self.may_propose(done) {
            Ok(done) => done,
            Err(refused) => return refused,
        };
        // Stamped here, on the leader's thread in the term it proposes in
        // (`session::SessionClock`): a stamp taken by the request before
        // this replica lost and regained leadership would run from its
        // earlier term's anchor.
        let stamp = match &self.config.session_clock {
            Some(clock) if command.has_sessions() => Some(clock.stamp(self.raw.raft.term)),
            _ => None,
        };
        let data = command.encode_stamped(stamp);
        if data.len() > self.config.max_command_bytes {
            done(Outcome::TooLarge {
                max: self.config.max_command_bytes,
            });
            return Ok(());
        }
        let context = crate::entry_context::encode(sync, traceparent);
        match self.hold_if_transferring(data, context, done) {
            Some((data, context, done)) => self.propose_encoded(data, context, done),
            None => Ok(()),
        }
    }

    /// Proposes an encoded command on this leader.
    fn propose_encoded(&mut self, data: Vec<u8>, context: Vec<u8>, done: Completion) -> Result<()> {
        let before = self.raw.raft.raft_log.last_index();
        match self.raw.propose(context, data) {
            Ok(()) => {
                let index = self.raw.raft.raft_log.last_index();
                debug_assert_eq!(index, before + 1);
                self.proposals.add(index, self.raw.raft.term, done);
                Ok(())
            }
            Err(raft::Error::ProposalDropped) => {
                done(Outcome::NotLeader {
                    leader: self.raw.raft.leader_id,
                });
                Ok(())
            }
            Err(error) => {
                done(Outcome::Failed(error.to_string()));
                Err(error.into())
            }
        }
    }

    /// Proposes a membership change (leader only).
    pub fn propose_conf_change(&mut self, change: ConfChangeV2, done: Completion) -> Result<()> {
        let done = match self.may_propose(done) {
            Ok(done) => done,
            Err(refused) => return refused,
        };
        match self.raw.propose_conf_change(Vec::new(), change) {
            Ok(()) => {
                let index = self.raw.raft.raft_log.last_index();
                self.proposals.add(index, self.raw.raft.term, done);
                Ok(())
            }
            Err(error) => {
                done(Outcome::Failed(error.to_string()));
                Ok(())
            }
        }
    }

    /// Starts an election now (tests and leader transfers).
    pub fn campaign(&mut self) -> Result<()> {
        self.wake();
        self.guarded(|r| Ok(r.raw.campaign()?))
    }

    /// Whether the replica failed and must be reopened.
    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The replica's directory.
    pub fn store(&self) -> &ReplicaStore {
        &self.store
    }

    /// Whether a snapshot message carries state this replica lacks (its
    /// files are worth fetching); otherwise raft-rs answers it without
    /// installing anything.
    pub fn needs_snapshot(&self, message: &Message) -> bool {
        message.get_snapshot().get_metadata().index > self.raw.raft.raft_log.committed
    }

    /// Tells raft-rs (on the leader) that sending a snapshot to `to`
    /// failed, so it tries again.
    pub fn report_snapshot_failure(&mut self, to: u64) {
        if self.failed.is_none() {
            self.catch_up.remove(&to);
            self.raw.report_snapshot(to, raft::SnapshotStatus::Failure);
        }
    }

    /// The replica's current Raft term.
    pub fn term(&self) -> u64 {
        self.raw.raft.term
    }

    /// The replica's Raft state.
    pub fn status(&self) -> ReplicaStatus {
        let raft = &self.raw.raft;
        let conf = self.raw.store().conf_state();
        let last_index = raft.raft_log.last_index();
        let append_lag = if raft.state == StateRole::Leader {
            raft.prs()
                .iter()
                .filter(|(id, _)| conf.voters.contains(id))
                .map(|(_, progress)| last_index.saturating_sub(progress.matched))
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let leader_silent_ticks = if raft.state == StateRole::Follower && raft.leader_id != 0 {
            raft.election_elapsed as u64
        } else {
            0
        };
        ReplicaStatus {
            quiesced: self.is_quiesced(),
            votes_held: self.holds_votes(),
            append_lag,
            leader_silent_ticks,
            is_leader: raft.state == StateRole::Leader,
            leader: raft.leader_id,
            term: raft.term,
            commit: raft.raft_log.committed,
            applied: raft.raft_log.applied,
            first_index: self.raw.store().first(),
            last_index: raft.raft_log.last_index(),
            voters: conf.voters.clone(),
            learners: conf.learners.clone(),
            conf_index: self.raw.store().conf_index(),
            range: self.raw.store().range(),
            children: self.raw.store().children().to_vec(),
            drops: self
                .raw
                .store()
                .drops()
                .iter()
                .map(|(n, b)| (*n, *b))
                .collect(),
            retained: self
                .raw
                .store()
                .retained()
                .iter()
                .map(|(n, r)| (*n, *r))
                .collect(),
        }
    }

    fn log(&mut self) -> &mut RaftLog {
        self.raw.mut_store()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        // A proposal never answered would leave its client waiting.
        self.fail_held("the replica closed");
        self.proposals.fail_all("the replica closed");
        self.reads
            .fail_all(&ReadOutcome::Failed("the replica closed".into()));
        if let Some(gate) = &self.config.lease_gate {
            gate.show(None);
        }
    }
}

#[cfg(test)]
mod tests;
