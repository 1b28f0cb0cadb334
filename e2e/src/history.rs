//! The history a workload records, and the checker.
//!
//! Every put writes a unique value (its id is in the content), so a read
//! names the write it observed. For each key the checker demands what a
//! linearizable register guarantees, in the three forms the issue names:
//!
//! 1. **no value from nowhere**: a read that returns value `v` overlaps or
//!    follows the invocation of the put of `v`;
//! 2. **nothing acknowledged lost, nothing stale**: a read that returns `v`
//!    (or nothing) must not begin after another write was acknowledged
//!    entirely after the write it saw — an acknowledged put that completed
//!    before the read began is visible unless a later write could explain
//!    it;
//! 3. **no resurrection**: a delete acknowledged before a read began hides
//!    every value written entirely before the delete was invoked.
//!
//! A write that failed or timed out is *indeterminate*: it may or may not
//! have taken effect, at any time after its invocation. It can explain a
//! read, but never proves one stale.
//!
//! These conditions are fast and name what is wrong, but they are not
//! linearizability: they let one delete explain two absences, so a write
//! that takes effect twice passes them. [`check_all`] adds the strict
//! search of `linearizable.rs` (a single point per operation).

use std::collections::BTreeMap;

/// Nanoseconds since the workload began.
pub type Nanos = u64;

/// What an operation did to, or saw of, its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Stored value `id`.
    Put(u64),
    /// Removed the key; for an acknowledged delete, whether it found a
    /// value (`None` when unknown).
    Delete(Option<bool>),
    /// Read: `Some(id)` seen, or `None` (absent).
    Read(Option<u64>),
    /// Asked whether the key exists (or touched it).
    Exists(bool),
}

/// Whether an operation's effect is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Acknowledged (for reads: answered).
    Ok,
    /// Failed, with its code: a write may still have applied if the code
    /// says its outcome is unknown ([`Status::may_have_applied`]).
    Failed(String),
}

/// Codes of a failed write whose outcome the SDK leaves open
/// (`docs/design/client.md`, "What a write's error says"): `TIMEOUT`, and
/// `SESSION_EXPIRED` (an attempt older than the session window may have
/// applied). Every other refusal says nothing was stored, and the checkers
/// hold the SDK to it: such a write is no candidate for any read.
pub const OUTCOME_UNKNOWN: [&str; 2] = ["TIMEOUT", "SESSION_EXPIRED"];

impl Status {
    /// Whether a write with this status may have taken effect:
    /// acknowledged, or failed with an unknown outcome.
    pub fn may_have_applied(&self) -> bool {
        match self {
            Status::Ok => true,
            Status::Failed(code) => OUTCOME_UNKNOWN.contains(&code.as_str()),
        }
    }
}

/// One operation: invoked, completed, outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Client that ran it.
    pub client: usize,
    /// The key (index into the workload's key set).
    pub key: u32,
    /// What it did.
    pub op: Op,
    /// When it was invoked.
    pub invoked: Nanos,
    /// When it returned.
    pub completed: Nanos,
    /// Its outcome.
    pub status: Status,
    /// Attempts the SDK made (1: answered at once).
    pub attempts: u32,
}

/// A violation, with the events of its key that explain it.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The key.
    pub key: u32,
    /// What is wrong.
    pub what: String,
    /// The offending read, then the writes involved, by time.
    pub slice: Vec<Event>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "key {}: {}", self.key, self.what)?;
        for e in &self.slice {
            writeln!(
                f,
                "  client {} {:?} [{:.3} s .. {:.3} s] {:?}",
                e.client,
                e.op,
                e.invoked as f64 / 1e9,
                e.completed as f64 / 1e9,
                e.status
            )?;
        }
        Ok(())
    }
}

struct Write<'a> {
    event: &'a Event,
    value: Option<u64>,
    acked: bool,
}

/// Both checkers: the per-key conditions, then (if they pass) the strict
/// linearizability search.
pub fn check_all(history: &[Event]) -> Vec<Violation> {
    let violations = check(history);
    if !violations.is_empty() {
        return violations;
    }
    crate::linearizable::check(history)
}

/// Checks a whole history against the per-key conditions; returns every
/// violation found.
pub fn check(history: &[Event]) -> Vec<Violation> {
    let mut by_key: BTreeMap<u32, Vec<&Event>> = BTreeMap::new();
    for e in history {
        by_key.entry(e.key).or_default().push(e);
    }
    let mut violations = Vec::new();
    for (key, events) in by_key {
        let writes: Vec<Write<'_>> = events
            .iter()
            .filter(|e| e.status.may_have_applied())
            .filter_map(|e| {
                let value = match e.op {
                    Op::Put(v) => Some(v),
                    Op::Delete(_) => None,
                    _ => return None,
                };
                Some(Write {
                    event: e,
                    value,
                    acked: e.status == Status::Ok,
                })
            })
            .collect();
        for read in events.iter().filter(|e| e.status == Status::Ok) {
            let seen: Option<Option<u64>> = match read.op {
                Op::Read(v) => Some(v),
                Op::Exists(true) => Some(Some(u64::MAX)), // some value
                Op::Exists(false) => Some(None),
                _ => None,
            };
            let Some(seen) = seen else { continue };
            if let Some(v) = check_read(read, seen, &writes) {
                let mut slice = vec![(*read).clone()];
                slice.extend(
                    writes
                        .iter()
                        .filter(|w| w.event.invoked <= read.completed)
                        .map(|w| w.event.clone()),
                );
                violations.push(Violation {
                    key,
                    what: v,
                    slice,
                });
            }
        }
    }
    violations
}

/// Why `read` (which saw `seen`) is impossible, if it is.
fn check_read(read: &Event, seen: Option<u64>, writes: &[Write<'_>]) -> Option<String> {
    // Candidate writes the read may have observed.
    let candidates: Vec<&Write<'_>> = writes
        .iter()
        .filter(|w| match (seen, w.value) {
            (Some(u64::MAX), Some(_)) => true, // exists: any put
            (Some(v), Some(w)) => v == w,
            (None, None) => true,
            _ => false,
        })
        .filter(|w| w.event.invoked < read.completed)
        .collect();
    if candidates.is_empty() {
        if let Some(v) = seen {
            if v == u64::MAX {
                return Some("exists=true, but no put was invoked before it returned".into());
            }
            return Some(format!(
                "read value {v}, which no put invoked before the read wrote"
            ));
        }
        // Absent: fine unless an acknowledged put completed before the read
        // began (then that put is lost: no delete can explain it).
        return writes
            .iter()
            .find(|w| w.value.is_some() && w.acked && w.event.completed < read.invoked)
            .map(|w| {
                format!(
                    "read nothing, but put of {:?} was acknowledged before the read began and no delete was invoked",
                    w.value
                )
            });
    }
    // The read is fine if some candidate was not superseded: no other
    // acknowledged write lies entirely between that candidate's completion
    // (or, if indeterminate, its invocation is no bound) and the read's
    // invocation.
    // The read is explained by a candidate that nothing provably
    // superseded: an indeterminate candidate may have applied just before
    // the read; an acknowledged one is superseded by another acknowledged
    // write that began after it completed and completed before the read
    // began.
    //
    // A candidate is superseded exactly when it completed before the
    // latest invocation among the acknowledged, different writes that
    // completed before the read began: one pass over the writes per read,
    // not one per candidate (long soaks have thousands of writes a key).
    let latest_superseding = writes
        .iter()
        .filter(|w| {
            let different = match (seen, w.value) {
                (Some(u64::MAX), Some(_)) => false,
                (a, b) => a != b,
            };
            different && w.acked && w.event.completed < read.invoked
        })
        .map(|w| w.event.invoked)
        .max();
    let superseded = |c: &Write<'_>| latest_superseding.is_some_and(|t| c.event.completed < t);
    let explained = candidates.iter().any(|c| !c.acked || !superseded(c));
    if explained {
        return None;
    }
    Some(match seen {
        Some(u64::MAX) => {
            "exists=true after every put was overwritten by an acknowledged delete".into()
        }
        Some(v) => {
            format!("read value {v}, overwritten by an acknowledged write before the read began")
        }
        None => "read nothing after an acknowledged put that followed every delete".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(client: usize, op: Op, invoked: u64, completed: u64, ok: bool) -> Event {
        Event {
            client,
            key: 1,
            op,
            invoked,
            completed,
            status: if ok {
                Status::Ok
            } else {
                Status::Failed("TIMEOUT".into())
            },
            attempts: 1,
        }
    }

    #[test]
    fn a_linearizable_history_passes() {
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            ev(1, Op::Read(Some(1)), 5, 15, true), // overlaps the put
            ev(0, Op::Put(2), 20, 30, true),
            ev(1, Op::Read(Some(1)), 25, 28, true), // put 2 not yet visible
            ev(1, Op::Read(Some(2)), 31, 35, true),
            ev(0, Op::Delete(Some(true)), 40, 50, true),
            ev(1, Op::Read(None), 45, 55, true),
            ev(1, Op::Exists(false), 60, 61, true),
            ev(0, Op::Put(3), 70, 80, false), // indeterminate
            ev(1, Op::Read(Some(3)), 200, 210, true), // it applied later
        ];
        assert!(check(&h).is_empty(), "{:?}", check(&h));
    }

    #[test]
    fn a_lost_acknowledged_put_is_caught() {
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            ev(1, Op::Read(None), 20, 30, true),
        ];
        let v = check(&h);
        assert_eq!(v.len(), 1);
        assert!(v[0].what.contains("acknowledged"), "{}", v[0]);
    }

    #[test]
    fn a_stale_read_is_caught() {
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            ev(0, Op::Put(2), 20, 30, true),
            ev(1, Op::Read(Some(1)), 40, 50, true),
        ];
        assert_eq!(check(&h).len(), 1);
    }

    #[test]
    fn a_resurrected_key_is_caught() {
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            ev(0, Op::Delete(Some(true)), 20, 30, true),
            ev(1, Op::Read(Some(1)), 40, 50, true),
            ev(1, Op::Exists(true), 60, 70, true),
        ];
        assert_eq!(check(&h).len(), 2, "{:?}", check(&h));
    }

    #[test]
    fn a_value_never_written_is_caught() {
        let h = vec![
            ev(1, Op::Read(Some(9)), 0, 5, true),
            ev(0, Op::Put(9), 10, 20, true),
        ];
        assert_eq!(check(&h).len(), 1);
    }

    #[test]
    fn failed_writes_explain_but_never_convict() {
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            ev(0, Op::Put(2), 20, 30, false),
            ev(1, Op::Read(Some(1)), 40, 50, true), // put 2 may not have applied
            ev(1, Op::Read(Some(2)), 60, 70, true), // or it did
        ];
        assert!(check(&h).is_empty(), "{:?}", check(&h));
    }

    /// A write refused with a code that says nothing was stored
    /// (`DISK_FULL`, `PERMISSION_DENIED`, ...) explains no read: a read of
    /// its value, or of nothing after it deleted, convicts the SDK's or the
    /// node's refusal — in both checkers. (Before, every failed write was
    /// treated as possibly applied.)
    #[test]
    fn writes_refused_for_sure_explain_nothing() {
        let refused = |mut e: Event| {
            e.status = Status::Failed("DISK_FULL".into());
            e
        };
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            refused(ev(0, Op::Put(2), 20, 30, true)),
            ev(1, Op::Read(Some(2)), 40, 50, true),
        ];
        assert_eq!(check(&h).len(), 1, "{:?}", check(&h));
        assert_eq!(crate::linearizable::check(&h).len(), 1);
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            refused(ev(0, Op::Delete(None), 20, 30, true)),
            ev(1, Op::Read(None), 40, 50, true),
        ];
        assert_eq!(check(&h).len(), 1, "{:?}", check(&h));
        assert_eq!(crate::linearizable::check(&h).len(), 1);
        // An unknown outcome still explains both.
        let unknown = |mut e: Event| {
            e.status = Status::Failed("SESSION_EXPIRED".into());
            e
        };
        let h = vec![
            ev(0, Op::Put(1), 0, 10, true),
            unknown(ev(0, Op::Put(2), 20, 30, true)),
            ev(1, Op::Read(Some(2)), 40, 50, true),
        ];
        assert!(check(&h).is_empty(), "{:?}", check(&h));
        assert!(crate::linearizable::check(&h).is_empty());
    }
}
