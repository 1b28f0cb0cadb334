//! Client write sessions: a retried write applies exactly once.
//!
//! A session is one sequential writer (an SDK keeps a pool of them): it
//! numbers its writes 1, 2, 3, ... and sends every attempt of a write with
//! the same number. Each write op in a Raft entry may carry a
//! [`SessionTag`]; when the entry is applied, the shard's [`Sessions`]
//! decide, in log order and so identically on every replica:
//!
//! | the shard knows the session as | the op's sequence | decision |
//! |---|---|---|
//! | unknown, op `opens` | any | apply; remember (sequence, outcome) |
//! | unknown, op does not open | any | refuse: `SessionExpired` |
//! | last applied `s` | `> s` | apply; remember (sequence, outcome) |
//! | last applied `s` | `= s` | duplicate: not applied, answer the remembered outcome |
//! | last applied `s` | `< s` | refuse: `Stale` (a newer write of the session applied) |
//!
//! This is the client-session design of the Raft dissertation (§6.3),
//! restricted to one write in flight per session so that one remembered
//! (sequence, outcome) per session suffices.
//!
//! Time is stamped into each tag by the leader that proposes it; the
//! shard's clock is the largest stamp applied. A leader's stamps run at
//! its monotonic clock's rate from the shard's clock as its replica applied
//! it ([`SessionClock`]), never from a wall clock: with wall-clock stamps a
//! leader hours ahead made the next sweep forget every session (a write
//! retried after that could open its session again and apply twice), and
//! one behind froze expiry until real time caught up. A session idle for
//! [`SESSION_TTL_MS`] is forgotten at the next sweep (every
//! [`SWEEP_EVERY_MS`] of shard clock); when [`MAX_SESSIONS`] are held, a
//! new session first evicts those idle for [`EVICTABLE_IDLE_MS`], and is
//! refused (`Full`) if none is.
//!
//! Restarts. The sessions are saved with the replica's application state,
//! together with `through`, the last entry whose decisions they hold; a
//! restarted replica may apply entries at or below `through` again (their
//! index changes may not have been durable). Those entries must not be
//! decided again: the table already holds their effect, so an original op
//! would now look like a duplicate of itself and its index change would be
//! lost. So the ops *not* applied in decided entries are remembered in
//! `skipped` (until the entry leaves the log), and an entry applied again
//! applies exactly the ops it applied the first time.

use std::collections::BTreeMap;

use crate::command::Reader;
use crate::error::{NodeError, Result};

/// A session idle this long (shard clock) is forgotten.
pub const SESSION_TTL_MS: u64 = 30 * 60 * 1000;
/// When the shard holds [`MAX_SESSIONS`], sessions idle this long may be
/// forgotten to make room.
pub const EVICTABLE_IDLE_MS: u64 = 5 * 60 * 1000;
/// Most sessions a shard remembers.
pub const MAX_SESSIONS: usize = 100_000;
/// How often (shard clock) idle sessions are swept.
pub const SWEEP_EVERY_MS: u64 = 60 * 1000;
/// Least shard-clock time between two evictions of a full table (each
/// walks every session).
const EVICT_EVERY_MS: u64 = 1000;

/// A write op's session: who wrote it, which of its writes it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionTag {
    /// The session (16 random bytes chosen by the client).
    pub id: u128,
    /// The write's number in the session.
    pub seq: u64,
    /// The client may start the session with this write.
    pub opens: bool,
    /// The proposing leader's session clock, milliseconds
    /// ([`SessionClock`]; older versions stamped their wall clock).
    pub time_ms: u64,
}

/// Where a leader stamps the sessioned writes it proposes on one shard: a
/// clock that runs at the node's monotonic rate from an anchor — the
/// shard's clock as the node's replica last applied it (0 on a shard that
/// applied no stamp yet), taken afresh at the first stamp of each term the
/// node leads in, and again whenever the applied clock is ahead of the
/// running one (another leader stamped further). No wall clock is read: a
/// clock's origin does not matter, only how fast it runs.
///
/// So the shard's clock (the largest stamp applied) never runs faster than
/// real time: in each term one leader stamps, from an anchor at most the
/// shard's clock when it is taken. A session is never forgotten sooner
/// than [`SESSION_TTL_MS`] of real time after its last write (a client may
/// retry a write that opens its session only within its re-open window,
/// far shorter). It may run slower (the time between a stamp and its apply
/// is lost at each anchoring; the shard's clock stands still while nothing
/// is stamped, and a leader that has not applied its predecessors' stamps
/// yet stamps behind them): sessions are then kept longer, which is safe.
///
/// The anchor is per term: a node that anchored while it led before, then
/// stood by while the shard was idle and another leader anchored at the
/// clock the idle time left standing, ran ahead of the shard by that idle
/// time when it led again — its first stamp jumped the shard's clock past
/// the TTL of sessions the other leader had just stamped, and a retry of
/// such a write opened its session again and applied twice. (An earlier
/// version anchored a replica that had applied no stamp at its wall clock:
/// a new leader not yet caught up with the shard's first stamps could jump
/// its clock by hours.)
#[derive(Debug, Default)]
pub struct SessionClock {
    state: parking_lot::Mutex<ClockState>,
}

#[derive(Debug, Default)]
struct ClockState {
    /// The shard's clock as the replica last applied it.
    applied_ms: u64,
    /// The running clock: its value at an instant, in the term it was
    /// anchored in.
    anchor: Option<Anchor>,
}

#[derive(Clone, Copy, Debug)]
struct Anchor {
    ms: u64,
    at: std::time::Instant,
    term: u64,
}

impl SessionClock {
    /// The shard's clock as the node's replica applied it (at its opening,
    /// after each entry, and when it installs a snapshot).
    pub fn applied(&self, clock_ms: u64) {
        self.state.lock().applied_ms = clock_ms;
    }

    /// A stamp for a write the node proposes now as leader in `term`.
    pub fn stamp(&self, term: u64) -> u64 {
        self.stamp_at(term, std::time::Instant::now())
    }

    /// A stamp at `now`.
    fn stamp_at(&self, term: u64, now: std::time::Instant) -> u64 {
        let mut state = self.state.lock();
        let running = state.anchor.filter(|a| a.term == term).map(|a| {
            a.ms.saturating_add(now.saturating_duration_since(a.at).as_millis() as u64)
        });
        match running {
            Some(ms) if ms >= state.applied_ms => ms,
            _ => {
                let ms = state.applied_ms;
                state.anchor = Some(Anchor { ms, at: now, term });
                ms
            }
        }
    }
}

/// Bytes of an encoded [`SessionTag`].
pub const TAG_BYTES: usize = 16 + 8 + 1 + 8;

impl SessionTag {
    /// Appends the tag's encoding.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.push(u8::from(self.opens));
        out.extend_from_slice(&self.time_ms.to_le_bytes());
    }

    /// Reads a tag.
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<SessionTag> {
        let id = u128::from_le_bytes(r.take(16)?.try_into().expect("16 bytes"));
        let seq = r.u64()?;
        let opens = match r.u8()? {
            0 => false,
            1 => true,
            other => return Err(NodeError::Malformed(format!("session opens flag {other}"))),
        };
        let time_ms = r.u64()?;
        Ok(SessionTag {
            id,
            seq,
            opens,
            time_ms,
        })
    }
}

/// Why a sessioned op was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The shard does not know the session and the op may not start it.
    Expired,
    /// A later write of the session was already applied.
    Stale,
    /// The shard holds too many sessions to start another.
    Full,
    /// A put only-if-absent found the key holding a blob (not a session
    /// decision: the session records nothing, a retry is decided again).
    Exists,
    /// The key's hash lies outside the range the group owned when the op
    /// applied (a split moved it: the client retries at the new owner with
    /// the same session number; the session records nothing here).
    WrongShard,
}

/// What applying one write op did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpResult {
    /// Applied (or a duplicate of an applied op). `existed`: for a delete,
    /// whether the key existed when it applied.
    Done {
        /// A delete found the key.
        existed: bool,
    },
    /// Not applied.
    Refused(Refusal),
}

impl OpResult {
    /// Applied, nothing to report.
    pub const DONE: OpResult = OpResult::Done { existed: false };
}

/// The decision for a sessioned op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Apply it, then [`Sessions::record`] its outcome.
    Apply,
    /// Already applied: do not apply; this was the outcome.
    Duplicate(OpResult),
    /// Do not apply.
    Refused(Refusal),
}

/// What the shard remembers of one session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    /// The last sequence applied.
    seq: u64,
    /// Its outcome (a delete found the key).
    existed: bool,
    /// Shard clock when it applied.
    active_ms: u64,
}

/// The sessions of one shard replica. Deterministic: two replicas that
/// apply the same entries hold the same sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sessions {
    records: BTreeMap<u128, Record>,
    /// Largest stamp applied.
    clock_ms: u64,
    /// Shard clock at the last sweep of idle sessions.
    swept_ms: u64,
    /// Shard clock at the last eviction from a full table.
    evicted_ms: u64,
    /// The last entry index whose decisions are recorded here.
    through: u64,
    /// Entries at or below `through` with ops that were not applied:
    /// index → op ordinals.
    skipped: BTreeMap<u64, Vec<u32>>,
}

impl Sessions {
    /// Sessions of a replica that starts (or installs a snapshot) at
    /// `index`: every entry up to it is decided.
    pub fn starting_at(index: u64) -> Sessions {
        Sessions {
            through: index,
            ..Sessions::default()
        }
    }

    /// The sessions of a new group that starts at `index` with this one's
    /// state (a split, `docs/design/splits.md`): the same sessions and
    /// clock, every entry up to `index` decided and nothing skipped (the
    /// new group's log numbers entries afresh).
    pub fn restarted_at(self, index: u64) -> Sessions {
        Sessions {
            through: index,
            skipped: BTreeMap::new(),
            ..self
        }
    }

    /// Whether entry `index` was decided already (it is being applied again
    /// after a restart): apply exactly the ops [`Sessions::was_applied`]
    /// names, decide nothing.
    pub fn decided(&self, index: u64) -> bool {
        index <= self.through
    }

    /// Whether op `ordinal` of decided entry `index` was applied.
    pub fn was_applied(&self, index: u64, ordinal: usize) -> bool {
        self.skipped
            .get(&index)
            .is_none_or(|ops| !ops.contains(&(ordinal as u32)))
    }

    /// Decides an op of the entry being applied.
    pub fn admit(&mut self, tag: &SessionTag) -> Admission {
        self.advance_clock(tag.time_ms);
        let known = self.records.get(&tag.id).map(|r| (r.seq, r.existed));
        match known {
            Some((seq, existed)) if tag.seq == seq => {
                Admission::Duplicate(OpResult::Done { existed })
            }
            Some((seq, _)) if tag.seq < seq => Admission::Refused(Refusal::Stale),
            Some(_) => Admission::Apply,
            None if !tag.opens => Admission::Refused(Refusal::Expired),
            None if self.records.len() < MAX_SESSIONS || self.evict_idle() => Admission::Apply,
            None => Admission::Refused(Refusal::Full),
        }
    }

    /// Remembers an applied op's outcome.
    pub fn record(&mut self, tag: &SessionTag, existed: bool) {
        self.records.insert(
            tag.id,
            Record {
                seq: tag.seq,
                existed,
                active_ms: self.clock_ms,
            },
        );
    }

    /// Entry `index` is decided; `skipped` lists its ops not applied.
    pub fn finish_entry(&mut self, index: u64, skipped: Vec<u32>) {
        self.through = self.through.max(index);
        if !skipped.is_empty() {
            self.skipped.insert(index, skipped);
        }
    }

    /// Entries before `first` left the log: they are never applied again.
    pub fn forget_before(&mut self, first: u64) {
        self.skipped = self.skipped.split_off(&first);
    }

    /// The shard's clock: the largest stamp applied.
    pub fn clock_ms(&self) -> u64 {
        self.clock_ms
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    fn advance_clock(&mut self, time_ms: u64) {
        self.clock_ms = self.clock_ms.max(time_ms);
        if self.clock_ms >= self.swept_ms.saturating_add(SWEEP_EVERY_MS) {
            self.swept_ms = self.clock_ms;
            self.forget_idle(SESSION_TTL_MS);
        }
    }

    /// Makes room in a full table; whether there is room now.
    fn evict_idle(&mut self) -> bool {
        if self.clock_ms >= self.evicted_ms.saturating_add(EVICT_EVERY_MS) {
            self.evicted_ms = self.clock_ms;
            self.forget_idle(EVICTABLE_IDLE_MS);
        }
        self.records.len() < MAX_SESSIONS
    }

    fn forget_idle(&mut self, idle_ms: u64) {
        let clock = self.clock_ms;
        self.records
            .retain(|_, r| r.active_ms.saturating_add(idle_ms) > clock);
    }

    /// Appends the encoding (for the replica's application state).
    pub fn encode(&self, out: &mut Vec<u8>) {
        for v in [self.clock_ms, self.swept_ms, self.evicted_ms, self.through] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.records.len() as u32).to_le_bytes());
        for (id, r) in &self.records {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&r.seq.to_le_bytes());
            out.extend_from_slice(&r.active_ms.to_le_bytes());
            out.push(u8::from(r.existed));
        }
        out.extend_from_slice(&(self.skipped.len() as u32).to_le_bytes());
        for (index, ops) in &self.skipped {
            out.extend_from_slice(&index.to_le_bytes());
            out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
            for op in ops {
                out.extend_from_slice(&op.to_le_bytes());
            }
        }
    }

    /// Reads what [`Sessions::encode`] wrote.
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Sessions> {
        let mut sessions = Sessions {
            clock_ms: r.u64()?,
            swept_ms: r.u64()?,
            evicted_ms: r.u64()?,
            through: r.u64()?,
            ..Sessions::default()
        };
        let count = r.u32()?;
        for _ in 0..count {
            let id = u128::from_le_bytes(r.take(16)?.try_into().expect("16 bytes"));
            let seq = r.u64()?;
            let active_ms = r.u64()?;
            let existed = r.u8()? != 0;
            sessions.records.insert(
                id,
                Record {
                    seq,
                    existed,
                    active_ms,
                },
            );
        }
        let entries = r.u32()?;
        for _ in 0..entries {
            let index = r.u64()?;
            let n = r.u32()? as usize;
            // Bounded by the bytes left, so a damaged count fails cleanly.
            let mut ops = Vec::with_capacity(n.min(r.bytes.len() / 4));
            for _ in 0..n {
                ops.push(r.u32()?);
            }
            sessions.skipped.insert(index, ops);
        }
        Ok(sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(id: u128, seq: u64, opens: bool, time_ms: u64) -> SessionTag {
        SessionTag {
            id,
            seq,
            opens,
            time_ms,
        }
    }

    /// Admits and, if admitted, records (as applying would).
    fn apply(s: &mut Sessions, t: SessionTag, existed: bool) -> Admission {
        let admission = s.admit(&t);
        if admission == Admission::Apply {
            s.record(&t, existed);
        }
        admission
    }

    #[test]
    fn a_duplicate_answers_the_first_outcome_and_a_stale_copy_is_refused() {
        let mut s = Sessions::default();
        assert_eq!(apply(&mut s, tag(7, 1, true, 10), true), Admission::Apply);
        // The retry of write 1 (the shard found the key on the first copy).
        assert_eq!(
            apply(&mut s, tag(7, 1, true, 20), false),
            Admission::Duplicate(OpResult::Done { existed: true })
        );
        assert_eq!(apply(&mut s, tag(7, 2, false, 30), false), Admission::Apply);
        // A late copy of write 1 after write 2 applied: never applied.
        assert_eq!(
            apply(&mut s, tag(7, 1, true, 40), false),
            Admission::Refused(Refusal::Stale)
        );
        // Gaps are fine: the session's other writes went to other shards.
        assert_eq!(apply(&mut s, tag(7, 9, false, 50), false), Admission::Apply);
    }

    #[test]
    fn an_unknown_session_is_started_only_by_an_opening_write() {
        let mut s = Sessions::default();
        assert_eq!(
            apply(&mut s, tag(1, 5, false, 10), false),
            Admission::Refused(Refusal::Expired)
        );
        assert_eq!(apply(&mut s, tag(1, 5, true, 10), false), Admission::Apply);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn idle_sessions_expire_by_the_shard_clock() {
        let mut s = Sessions::default();
        apply(&mut s, tag(1, 1, true, 1_000), false);
        apply(&mut s, tag(2, 1, true, 1_000 + SESSION_TTL_MS / 2), false);
        // Just under the TTL for session 1: still known.
        let t = 1_000 + SESSION_TTL_MS - 1;
        assert_eq!(apply(&mut s, tag(1, 2, false, t), false), Admission::Apply);
        // Session 2 idles past the TTL (a sweep runs once a minute of clock).
        let later = 1_000 + SESSION_TTL_MS / 2 + SESSION_TTL_MS + SWEEP_EVERY_MS;
        assert_eq!(
            apply(&mut s, tag(2, 2, false, later), false),
            Admission::Refused(Refusal::Expired)
        );
        // A clock that goes backwards (another leader's) never un-expires.
        assert_eq!(
            apply(&mut s, tag(2, 2, false, 5), false),
            Admission::Refused(Refusal::Expired)
        );
    }

    #[test]
    fn a_full_table_evicts_only_long_idle_sessions() {
        let mut s = Sessions::default();
        for id in 0..MAX_SESSIONS as u128 {
            apply(&mut s, tag(id, 1, true, 0), false);
        }
        // All were active at 0; at 1 s none is evictable.
        let new = tag(u128::MAX, 1, true, 1_000);
        assert_eq!(s.admit(&new), Admission::Refused(Refusal::Full));
        // Keep one busy, then let the rest idle past the eviction bound.
        apply(&mut s, tag(3, 2, false, EVICTABLE_IDLE_MS), false);
        let new = tag(u128::MAX, 1, true, EVICTABLE_IDLE_MS + 1);
        assert_eq!(apply(&mut s, new, false), Admission::Apply);
        assert_eq!(s.len(), 2, "session 3 and the new one");
    }

    #[test]
    fn decided_entries_apply_exactly_what_they_applied() {
        let mut s = Sessions::starting_at(10);
        assert!(s.decided(10) && !s.decided(11));
        s.finish_entry(11, vec![1]);
        s.finish_entry(12, Vec::new());
        assert!(s.decided(12));
        assert!(s.was_applied(11, 0) && !s.was_applied(11, 1) && s.was_applied(12, 1));
        s.forget_before(12);
        assert!(s.was_applied(11, 1), "entry 11 left the log");
    }

    #[test]
    fn sessions_round_trip_and_damage_is_an_error() {
        let mut s = Sessions::starting_at(3);
        apply(&mut s, tag(u128::MAX - 1, 4, true, 77), true);
        apply(&mut s, tag(5, 1, true, 80), false);
        s.finish_entry(4, vec![0, 2]);
        let mut bytes = Vec::new();
        s.encode(&mut bytes);
        let mut r = Reader {
            bytes: &bytes,
            at: 0,
        };
        assert_eq!(Sessions::decode(&mut r).unwrap(), s);
        assert_eq!(r.at, bytes.len());
        for cut in 0..bytes.len() {
            let mut r = Reader {
                bytes: &bytes[..cut],
                at: 0,
            };
            assert!(Sessions::decode(&mut r).is_err(), "cut at {cut}");
        }
    }

    /// Stamps run at the monotonic clock's rate from the shard's applied
    /// clock (no wall clock is read), and a node whose running clock fell
    /// behind what another node stamped catches up with the applied clock.
    #[test]
    fn stamps_follow_the_applied_clock() {
        let start = std::time::Instant::now();
        let at = |ms: u64| start + std::time::Duration::from_millis(ms);

        // A new shard: its clock starts at 0.
        let clock = SessionClock::default();
        assert_eq!(clock.stamp_at(1, at(0)), 0);
        assert_eq!(clock.stamp_at(1, at(250)), 250);
        // A replica that opened empty and stamped meanwhile: once it has
        // the shard's clock (a snapshot installed), it stamps from that.
        let clock = SessionClock::default();
        assert_eq!(clock.stamp_at(1, at(0)), 0);
        clock.applied(2_000_000);
        assert_eq!(clock.stamp_at(1, at(1_000)), 2_000_000);
        assert_eq!(clock.stamp_at(1, at(3_000)), 2_002_000);

        // A shard with a clock: stamps start from it and advance at the
        // monotonic rate.
        let clock = SessionClock::default();
        clock.applied(1_000_000);
        assert_eq!(clock.stamp_at(1, at(0)), 1_000_000);
        assert_eq!(clock.stamp_at(1, at(60_000)), 1_060_000);
        // Its own stamps applied: nothing changes.
        clock.applied(1_060_000);
        assert_eq!(clock.stamp_at(1, at(61_000)), 1_061_000);
        // Another node stamped further (its anchor was later): the running
        // clock catches up with the applied one and runs on from there.
        clock.applied(1_100_000);
        assert_eq!(clock.stamp_at(1, at(62_000)), 1_100_000);
        assert_eq!(clock.stamp_at(1, at(63_000)), 1_101_000);
        // An applied clock that goes back (a snapshot from a replica that
        // applied less) never moves stamps back.
        clock.applied(5);
        assert_eq!(clock.stamp_at(1, at(64_000)), 1_102_000);

        // A shard's sessions, stamped so, are swept no sooner than their
        // TTL of real time: a write every minute, and the first session is
        // still remembered 29 minutes on.
        let mut sessions = Sessions::default();
        let clock = SessionClock::default();
        clock.applied(1_000);
        apply(
            &mut sessions,
            tag(1, 1, true, clock.stamp_at(1, at(0))),
            false,
        );
        clock.applied(sessions.clock_ms());
        for minute in 1..30 {
            let stamp = clock.stamp_at(1, at(minute * 60_000));
            apply(
                &mut sessions,
                tag(u128::from(minute) + 1, 1, true, stamp),
                false,
            );
            clock.applied(sessions.clock_ms());
        }
        assert_eq!(
            apply(
                &mut sessions,
                tag(1, 1, false, clock.stamp_at(1, at(29 * 60_000 + 1))),
                false
            ),
            Admission::Duplicate(OpResult::DONE),
            "session 1 is remembered 29 minutes on"
        );
    }

    /// A node that led before an idle spell and leads again after another
    /// leader stamped does not run ahead of the shard: its running clock
    /// from the earlier term (40 minutes on) would have swept the session
    /// the other leader just stamped, and the retry of that write, opening
    /// its session again, would have applied twice.
    #[test]
    fn a_leader_anchors_afresh_in_each_term() {
        let start = std::time::Instant::now();
        let at = |ms: u64| start + std::time::Duration::from_millis(ms);
        let (first, second) = (SessionClock::default(), SessionClock::default());
        let mut sessions = Sessions::default();
        let applied = |sessions: &Sessions| {
            first.applied(sessions.clock_ms());
            second.applied(sessions.clock_ms());
        };
        // Term 5: the first node leads and stamps; then nothing is written
        // for 40 minutes (the shard's clock stands still).
        let stamp = first.stamp_at(5, at(0));
        assert_eq!(
            apply(&mut sessions, tag(9, 1, true, stamp), false),
            Admission::Apply
        );
        applied(&sessions);
        // Term 6: the second node leads, anchors at the standing clock,
        // and a write of session 7 applies.
        let stamp = second.stamp_at(6, at(40 * 60_000));
        assert_eq!(stamp, sessions.clock_ms());
        assert_eq!(
            apply(&mut sessions, tag(7, 1, true, stamp), true),
            Admission::Apply
        );
        applied(&sessions);
        // Term 7, a minute later: the first node leads again, and the
        // write's retry reaches it.
        let stamp = first.stamp_at(7, at(41 * 60_000));
        assert!(stamp < sessions.clock_ms() + 60_000, "stamp {stamp}");
        assert_eq!(
            apply(&mut sessions, tag(7, 1, true, stamp), false),
            Admission::Duplicate(OpResult::Done { existed: true })
        );
        // Within a term the clock runs on as before.
        assert_eq!(first.stamp_at(7, at(42 * 60_000)), stamp + 60_000);
    }
}
