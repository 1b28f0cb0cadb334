//! The strict checker: is each key's history linearizable as a register?
//!
//! Every operation must take effect at a single point between its
//! invocation and its completion, and the sequence of those points must
//! be a legal run of a register (absent, or holding one value): a read
//! returns what the register holds, `exists` says whether it holds
//! anything, a put stores its value, a delete empties it and — when its
//! answer is known — reports whether it held something. A write that failed
//! or timed out is indeterminate: it may take effect at any point after its
//! invocation, or never (its completion is taken as infinitely late, so it
//! can be placed after everything that was observed). A delete or put that
//! "takes effect twice" has no single point that explains both effects and
//! is a violation here, where the per-key conditions of `history.rs` may
//! let it pass.
//!
//! The search is the Wing–Gong algorithm with Lowe's memoisation (as
//! porcupine does it): walk the events in time order keeping a linked list
//! of calls and returns not yet linearized; at a call, try to linearize
//! that operation now (if it is legal in the current state and this
//! (set of linearized operations, state) was not tried before); at a return
//! whose operation is not linearized yet, undo the last choice. Keys are
//! independent (a register per key), so each is searched alone.

use std::collections::{BTreeMap, HashSet};

use crate::history::{Event, Nanos, Op, Status, Violation};

/// Most search steps per key before giving up (reported as a violation:
/// undecided is not a pass).
const MAX_STEPS: u64 = 50_000_000;

/// What the register holds: a value id, or nothing.
type State = Option<u64>;

/// One operation as the search sees it.
#[derive(Clone, Debug)]
struct Operation {
    call: Nanos,
    /// `Nanos::MAX` for an indeterminate write.
    ret: Nanos,
    kind: Kind,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Put(u64),
    /// A delete and, if known, whether it found a value.
    Delete(Option<bool>),
    Read(Option<u64>),
    Exists(bool),
}

impl Kind {
    /// The state after this operation from `state`, if it is legal there.
    fn step(self, state: State) -> Option<State> {
        match self {
            Kind::Put(v) => Some(Some(v)),
            Kind::Delete(None) => Some(None),
            Kind::Delete(Some(existed)) => (state.is_some() == existed).then_some(None),
            Kind::Read(seen) => (state == seen).then_some(state),
            Kind::Exists(present) => (state.is_some() == present).then_some(state),
        }
    }
}

/// The operations of a key the search considers: acknowledged operations,
/// and failed writes whose outcome is unknown (indeterminate). Failed reads
/// and writes refused for sure say nothing.
fn operations(events: &[&Event]) -> Vec<(Operation, Event)> {
    events
        .iter()
        .filter(|e| e.status.may_have_applied())
        .filter_map(|e| {
            let ok = e.status == Status::Ok;
            let kind = match (&e.op, ok) {
                (Op::Put(v), _) => Kind::Put(*v),
                (Op::Delete(existed), true) => Kind::Delete(*existed),
                (Op::Delete(_), false) => Kind::Delete(None),
                (Op::Read(seen), true) => Kind::Read(*seen),
                (Op::Exists(present), true) => Kind::Exists(*present),
                _ => return None,
            };
            let ret = if ok { e.completed } else { Nanos::MAX };
            Some((
                Operation {
                    call: e.invoked,
                    ret,
                    kind,
                },
                (*e).clone(),
            ))
        })
        .collect()
}

/// Checks every key; one violation per key that has no linearization.
pub fn check(history: &[Event]) -> Vec<Violation> {
    let mut by_key: BTreeMap<u32, Vec<&Event>> = BTreeMap::new();
    for e in history {
        by_key.entry(e.key).or_default().push(e);
    }
    by_key
        .into_iter()
        .filter_map(|(key, events)| check_key(key, &events))
        .collect()
}

/// A doubly linked list of call and return entries, with O(1) removal and
/// reinsertion in LIFO order ("dancing links"). Node 0 is the head.
struct Entries {
    next: Vec<usize>,
    prev: Vec<usize>,
    /// Per node: (operation, is the call).
    what: Vec<(usize, bool)>,
    /// Per operation: its return node.
    ret_node: Vec<usize>,
}

const NIL: usize = usize::MAX;

impl Entries {
    fn new(ops: &[Operation]) -> Entries {
        let mut events: Vec<(Nanos, bool, usize)> = Vec::with_capacity(ops.len() * 2);
        for (i, op) in ops.iter().enumerate() {
            // Calls before returns at equal times: operations that touch
            // count as concurrent (the permissive reading).
            events.push((op.call, false, i));
            events.push((op.ret, true, i));
        }
        events.sort_unstable();
        let n = events.len() + 1;
        let mut entries = Entries {
            next: (1..=n).map(|i| if i == n { NIL } else { i }).collect(),
            prev: (0..n).map(|i| i.wrapping_sub(1)).collect(),
            what: vec![(usize::MAX, false); n],
            ret_node: vec![0; ops.len()],
        };
        entries.prev[0] = NIL;
        for (node, (_, is_return, op)) in events.into_iter().enumerate() {
            entries.what[node + 1] = (op, !is_return);
            if is_return {
                entries.ret_node[op] = node + 1;
            }
        }
        entries
    }

    fn unlink(&mut self, node: usize) {
        let (p, n) = (self.prev[node], self.next[node]);
        self.next[p] = n;
        if n != NIL {
            self.prev[n] = p;
        }
    }

    fn relink(&mut self, node: usize) {
        let (p, n) = (self.prev[node], self.next[node]);
        self.next[p] = node;
        if n != NIL {
            self.prev[n] = node;
        }
    }

    /// Takes operation `op` (whose call is `call`) out of the list.
    fn lift(&mut self, call: usize, op: usize) {
        self.unlink(call);
        self.unlink(self.ret_node[op]);
    }

    /// Puts it back (the reverse of the last `lift`).
    fn unlift(&mut self, call: usize, op: usize) {
        self.relink(self.ret_node[op]);
        self.relink(call);
    }
}

/// Searches one key's history; a violation if it has no linearization.
fn check_key(key: u32, events: &[&Event]) -> Option<Violation> {
    let with_events = operations(events);
    let ops: Vec<Operation> = with_events.iter().map(|(o, _)| o.clone()).collect();
    let mut entries = Entries::new(&ops);
    let words = ops.len().div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut tried: HashSet<(Vec<u64>, State)> = HashSet::new();
    let mut stack: Vec<(usize, usize, State)> = Vec::new();
    let mut state: State = None;
    let mut node = entries.next[0];
    // The deepest partial linearization, and the operation it got stuck on.
    let mut deepest = (0usize, None::<usize>);
    let mut steps = 0u64;
    while entries.next[0] != NIL {
        steps += 1;
        if steps > MAX_STEPS {
            return Some(violation(
                key,
                format!("undecided: the search gave up after {MAX_STEPS} steps"),
                &with_events,
                deepest.1,
            ));
        }
        let (op, is_call) = entries.what[node];
        if is_call {
            if let Some(next_state) = ops[op].kind.step(state) {
                linearized[op / 64] |= 1 << (op % 64);
                if tried.insert((linearized.clone(), next_state)) {
                    stack.push((node, op, state));
                    state = next_state;
                    entries.lift(node, op);
                    node = entries.next[0];
                    continue;
                }
                linearized[op / 64] &= !(1 << (op % 64));
            }
            node = entries.next[node];
        } else {
            // `op` returned but was not linearized: undo the last choice.
            if stack.len() >= deepest.0 {
                deepest = (stack.len(), Some(op));
            }
            let Some((call, last, before)) = stack.pop() else {
                return Some(violation(
                    key,
                    "not linearizable: no order of single effects explains the history".into(),
                    &with_events,
                    deepest.1,
                ));
            };
            entries.unlift(call, last);
            linearized[last / 64] &= !(1 << (last % 64));
            state = before;
            node = entries.next[call];
        }
    }
    None
}

/// The report: the operation the deepest attempt could not place, and
/// every operation of the key that overlaps the second before it.
fn violation(
    key: u32,
    what: String,
    ops: &[(Operation, Event)],
    stuck: Option<usize>,
) -> Violation {
    let mut slice = Vec::new();
    if let Some(stuck) = stuck {
        let (op, event) = &ops[stuck];
        let from = op.call.saturating_sub(1_000_000_000);
        slice.push(event.clone());
        // The put of the value it read, however long before.
        if let Kind::Read(Some(v)) = op.kind {
            slice.extend(
                ops.iter()
                    .filter(|(o, _)| matches!(o.kind, Kind::Put(p) if p == v))
                    .map(|(_, e)| e.clone()),
            );
        }
        slice.extend(
            ops.iter()
                .enumerate()
                .filter(|(i, (o, _))| *i != stuck && o.call <= op.ret && o.ret >= from)
                .map(|(_, (_, e))| e.clone()),
        );
    }
    Violation {
        key,
        what: match stuck {
            Some(_) => format!("{what} (first line: the operation it could not place)"),
            None => what,
        },
        slice,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn ev(client: usize, op: Op, invoked_ms: f64, completed_ms: f64, ok: bool) -> Event {
        Event {
            client,
            key: 1,
            op,
            invoked: (invoked_ms * MS as f64) as u64,
            completed: (completed_ms * MS as f64) as u64,
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
            ev(0, Op::Put(1), 0.0, 10.0, true),
            ev(1, Op::Read(Some(1)), 5.0, 15.0, true),
            ev(0, Op::Put(2), 20.0, 30.0, true),
            ev(1, Op::Read(Some(1)), 25.0, 28.0, true),
            ev(1, Op::Read(Some(2)), 31.0, 35.0, true),
            ev(0, Op::Delete(Some(true)), 40.0, 50.0, true),
            ev(1, Op::Read(None), 45.0, 55.0, true),
            ev(1, Op::Exists(false), 60.0, 61.0, true),
            ev(0, Op::Put(3), 70.0, 80.0, false), // indeterminate
            ev(1, Op::Read(None), 90.0, 91.0, true), // not yet...
            ev(1, Op::Read(Some(3)), 200.0, 210.0, true), // ...then it applied
            ev(0, Op::Delete(None), 300.0, 310.0, false), // may never apply
            ev(1, Op::Read(Some(3)), 400.0, 410.0, true),
        ];
        assert!(check(&h).is_empty(), "{:?}", check(&h));
    }

    /// The history of the bug report: c5's delete (one call, 16 attempts)
    /// removed the value before the reads that found nothing, and its
    /// retried copy erased c2's acknowledged put 1.7 s later. The per-key
    /// conditions of `history::check` let an overlapping delete explain
    /// both absences; a single linearization point cannot.
    #[test]
    fn a_write_that_takes_effect_twice_is_a_violation() {
        let h = vec![
            ev(2, Op::Put(4467), 35_591.7, 35_593.0, true),
            ev(2, Op::Read(Some(4467)), 35_593.1, 35_594.9, true),
            ev(5, Op::Delete(Some(true)), 35_593.4, 37_323.8, true),
            ev(2, Op::Read(None), 35_595.0, 36_806.4, true),
            ev(1, Op::Read(None), 36_810.0, 36_812.0, true),
            ev(2, Op::Put(4575), 37_320.5, 37_322.5, true),
            ev(2, Op::Read(None), 37_324.6, 37_326.4, true),
        ];
        assert!(
            crate::history::check(&h).is_empty(),
            "the fast checks alone miss it"
        );
        let found = check(&h);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].what.contains("not linearizable"), "{}", found[0]);
    }

    #[test]
    fn a_delete_whose_answer_contradicts_the_order_is_a_violation() {
        // The put completed before the delete began, nothing else ran: the
        // delete must have found the value.
        let h = vec![
            ev(0, Op::Put(1), 0.0, 10.0, true),
            ev(1, Op::Delete(Some(false)), 20.0, 30.0, true),
        ];
        assert_eq!(check(&h).len(), 1);
        let h = vec![
            ev(0, Op::Put(1), 0.0, 10.0, true),
            ev(1, Op::Delete(Some(false)), 5.0, 30.0, true), // overlaps: may precede
        ];
        assert!(check(&h).is_empty());
    }

    #[test]
    fn lost_stale_and_resurrected_values_are_violations() {
        let lost = vec![
            ev(0, Op::Put(1), 0.0, 10.0, true),
            ev(1, Op::Read(None), 20.0, 30.0, true),
        ];
        let stale = vec![
            ev(0, Op::Put(1), 0.0, 10.0, true),
            ev(0, Op::Put(2), 20.0, 30.0, true),
            ev(1, Op::Read(Some(1)), 40.0, 50.0, true),
        ];
        let resurrected = vec![
            ev(0, Op::Put(1), 0.0, 10.0, true),
            ev(0, Op::Delete(Some(true)), 20.0, 30.0, true),
            ev(1, Op::Exists(true), 60.0, 70.0, true),
        ];
        for h in [lost, stale, resurrected] {
            assert_eq!(check(&h).len(), 1, "{h:?}");
        }
    }

    #[test]
    fn many_concurrent_indeterminate_writes_stay_tractable() {
        // 12 clients, 600 operations on one key, a third of the writes
        // indeterminate: a sequential history with stragglers.
        let mut h = Vec::new();
        for i in 0..600u64 {
            let t = i as f64 * 10.0;
            let client = (i % 12) as usize;
            match i % 3 {
                0 => h.push(ev(client, Op::Put(i), t, t + 5.0, i % 9 != 0)),
                1 => h.push(ev(client, Op::Read(Some(i - 1)), t, t + 5.0, true)),
                _ => h.push(ev(client, Op::Delete(Some(true)), t, t + 5.0, true)),
            }
        }
        // Reads after an indeterminate put that did apply are fine; make
        // every put in that pattern one that applied (reads saw it).
        assert!(check(&h).is_empty(), "{:?}", check(&h).first());
    }
}
