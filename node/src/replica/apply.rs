//! Applying committed entries to the engine. A Write only points the index
//! at the values already in the WAL (`Engine::apply_item`) — and, on the
//! replica that proposed it, reads the header of each value a put
//! overwrites or a delete removes, to answer which chunked blob it
//! replaced; touches, epoch
//! advances and epoch drops act at the entry's index on every replica, with
//! everything they depend on carried in the entry, so replicas agree.
//!
//! Sessioned ops (puts, deletes, touches a client retries) go through the
//! replica's [`Sessions`]: a duplicate or refused op is not applied, and an
//! entry decided before (applied again after a restart) applies exactly the
//! ops it applied the first time (see `session.rs`). A delete's `existed` is
//! decided here, in log order, and so is whether a put only-if-absent finds
//! its key free (if not, it is not applied, and a restart re-applying the
//! entry skips it as the first application did).

use prost011::Message as _;
use raft::eraftpb::{ConfChangeV2, Entry, EntryType};
use tidepool_engine::{
    AppendedItem, Decision, Durability, Engine, EntryInfo, Epoch, KeySpace, RelocationFilter, Tag,
};

use super::Replica;
use tidepool_proto::v1::{BlobKind, ChunkManifest, ReplacedChunks};

use crate::blob;
use crate::command::{Command, KEY_BYTES, WriteOp};
use crate::entry_context::traceparent;
use crate::error::{NodeError, Result};
use crate::names::{Meta, NameBatch};
use crate::raftlog::Retained;
use crate::session::{Admission, OpResult, Refusal, SessionTag, Sessions};
use crate::tracing_context::{Place, Step, entry_span};

/// What applying an entry's write ops did: each op's result, and the
/// chunked blobs its puts replaced by op ordinal (see `Outcome::Applied`).
type Applied = (Vec<OpResult>, Vec<(u32, ReplacedChunks)>);

/// Drops one namespace's entries, keeps the rest.
struct Namespace(u32);

impl RelocationFilter for Namespace {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        if entry.tag == Tag(self.0) {
            Decision::Drop
        } else {
            Decision::Keep
        }
    }
}

impl Replica {
    /// Applies committed entries in order and completes their proposals.
    pub(crate) fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<()> {
        for entry in entries {
            let index = entry.index;
            let place = Place {
                node_id: self.config.node_id,
                shard_id: self.shard_id(),
                term: entry.term,
            };
            let span = entry_span(Step::Apply, traceparent(&entry.context), place, index);
            let _entered = span.enter();
            let mut results = Vec::new();
            let mut replaced = Vec::new();
            if entry.entry_type == EntryType::EntryConfChangeV2 as i32 {
                let change = ConfChangeV2::decode(&entry.data[..])
                    .map_err(|e| NodeError::Malformed(format!("conf change at {index}: {e}")))?;
                let computed = self.raw.apply_conf_change(&change)?;
                // Applied again after a restart, an entry's configuration
                // is the one it made the first time, as recorded — not
                // raft-rs's recomputation on top of the newest one, which,
                // recorded, a second restart took for the entry's own.
                let conf_state = self
                    .log()
                    .recovered_conf_made_by(index)
                    .cloned()
                    .unwrap_or(computed);
                self.log().set_state(None, Some((&conf_state, index)))?;
            } else if entry.entry_type == EntryType::EntryNormal as i32 {
                (results, replaced) = self.apply_command(&entry)?;
            }
            // Decisions first, then the applied index (a snapshot between
            // the two sees sessions ahead of the index, never behind).
            let clock_ms = {
                let mut sessions = self.log().sessions();
                sessions.finish_entry(index, Vec::new());
                sessions.clock_ms()
            };
            if let Some(clock) = &self.config.session_clock {
                clock.applied(clock_ms);
            }
            self.log().set_applied(index);
            self.proposals.applied(index, entry.term, results, replaced);
        }
        Ok(())
    }

    /// Applies one normal entry; returns what each of its write ops did,
    /// and the chunked blobs its puts replaced (only when this replica
    /// proposed the entry: see [`Outcome::Applied`](super::proposals::Outcome)).
    fn apply_command(&mut self, entry: &Entry) -> Result<Applied> {
        if entry.data.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let engine = self.engine().clone();
        let space = self.space;
        let names = self.names;
        match Command::decode(&entry.data)? {
            Command::Write(ops) => {
                let appended = self.log().appended(entry.index)?;
                if appended.items.len() != ops.len() {
                    return Err(NodeError::Malformed(format!(
                        "entry {} has {} ops and {} items",
                        entry.index,
                        ops.len(),
                        appended.items.len()
                    )));
                }
                let target = Target {
                    engine: &engine,
                    space,
                    names,
                    range: self.log().range(),
                    answered: self.proposals.waits_for(entry.index, entry.term),
                };
                let mut sessions = self.log().sessions();
                return apply_write(&target, &mut sessions, entry.index, &ops, &appended.items);
            }
            Command::Touch {
                key,
                epoch,
                session,
                ..
            } => {
                let range = self.log().range();
                let mut sessions = self.log().sessions();
                let first_time = !sessions.decided(entry.index);
                if first_time && !owns(range, &key) {
                    sessions.finish_entry(entry.index, vec![0]);
                    return Ok((vec![OpResult::Refused(Refusal::WrongShard)], Vec::new()));
                }
                // `existed`: whether the blob was still there (a delete or a
                // dropped epoch may have applied since the touch was asked).
                let decided = decide_op(&mut sessions, entry.index, 0, session.as_ref(), |_| {
                    let found = engine.touch_to(space, &key, Epoch(epoch), Durability::Buffered)?;
                    Ok(Some(found))
                })?;
                if first_time {
                    // Decided under the same hold as the decision (see
                    // `apply_write`).
                    let skipped = if decided.applied { Vec::new() } else { vec![0] };
                    sessions.finish_entry(entry.index, skipped);
                }
                return Ok((vec![decided.result], Vec::new()));
            }
            Command::AdvanceEpoch(epoch) => {
                if Epoch(epoch) > engine.epoch() {
                    engine.advance_epoch(Epoch(epoch))?;
                }
            }
            Command::DropEpochs { namespace, below } => {
                // A drop past the current epoch, or one the retention the
                // group holds does not allow (computed under a shorter one
                // that a retain entry since replaced), is refused by every
                // replica alike: nothing to do.
                let epoch = engine.epoch();
                let retained = self.log().retained().get(&namespace).copied();
                if retained.is_some_and(|r| !r.allows_drop(below, epoch.0)) {
                    tracing::warn!(
                        shard_id = self.shard_id(),
                        namespace,
                        below,
                        ?retained,
                        epoch = epoch.0,
                        "epoch drop refused: the recorded retention keeps those epochs"
                    );
                } else if Epoch(below) <= epoch {
                    engine.drop_epochs_below(Epoch(below), &Namespace(namespace))?;
                    // The dropped blobs' names leave the index in the
                    // background (`sweep.rs`: the recorded drop is what it
                    // sweeps to); a listing skips them meanwhile.
                    self.log().record_drop(namespace, below);
                    self.drop_to_compact = Some((entry.index, false));
                }
            }
            Command::Split { child, at } => self.apply_split(entry.index, child, at)?,
            Command::Retain {
                namespace,
                epochs,
                map_version,
            } => {
                let retained = Retained {
                    epochs,
                    map_version,
                };
                if self.log().record_retain(namespace, retained) {
                    // Saved at once (an engine snapshot): the application
                    // state is saved only at snapshots, and after a crash
                    // the entries since the last one apply again — a drop
                    // before this entry was then judged under the older
                    // retention saved and the newest epoch the engine
                    // recovered, a mix no replica ever had, and could
                    // apply on that replica alone. Now no entry before a
                    // retain entry applies again after it. (Rare: one per
                    // retention change per shard.)
                    engine.flush()?;
                } else {
                    tracing::info!(
                        shard_id = self.shard_id(),
                        namespace,
                        map_version,
                        "retain entry from an older map than the group holds: ignored"
                    );
                }
            }
            Command::Noop => {}
        }
        Ok((Vec::new(), Vec::new()))
    }

    /// After a restart, re-applies the applied entries whose index effects
    /// the engine may have lost: those recorded at or after the engine's
    /// `recovered_replay_from`. (Entries above the applied index come back
    /// from raft-rs as committed entries, as usual.) Applying is idempotent.
    pub(crate) fn reapply_after_restart(&mut self) -> Result<()> {
        let replay_from = self.engine().recovered_replay_from();
        let (first, applied) = (self.log().first(), self.log().applied());
        for index in first..=applied {
            if self.log().position(index).is_some_and(|p| p >= replay_from) {
                let entry = self.log().entry(index)?;
                if entry.entry_type == EntryType::EntryNormal as i32 {
                    self.apply_command(&entry)?;
                }
            }
        }
        Ok(())
    }
}

/// Where a Write's items go.
struct Target<'a> {
    engine: &'a Engine,
    space: KeySpace,
    /// The name index.
    names: KeySpace,
    /// The hash range the group owns (`None`: not recorded, not checked).
    range: Option<(u64, u64)>,
    /// Whether this replica proposed the entry and waits for its answer
    /// (what a put replaced is read only then).
    answered: bool,
}

/// Whether a group owning `range` owns `key` (a storage key: its first 8
/// bytes, big-endian, are its hash position).
fn owns(range: Option<(u64, u64)>, key: &[u8; KEY_BYTES]) -> bool {
    range.is_none_or(|(start, end)| {
        let position = tidepool_proto::hash_position(key);
        start <= position && position <= end
    })
}

/// One op's fate: what it answered, and whether it was applied.
struct Decided {
    result: OpResult,
    applied: bool,
}

/// Applies a Write's ops in order through the sessions; records which were
/// not applied. An entry decided before applies what it applied then.
/// Returns the ops' results and, when the entry is answered here, the
/// chunked blobs its puts replaced by op ordinal.
fn apply_write(
    target: &Target<'_>,
    sessions: &mut Sessions,
    index: u64,
    ops: &[WriteOp],
    items: &[AppendedItem],
) -> Result<Applied> {
    let first_time = !sessions.decided(index);
    let mut results = Vec::with_capacity(ops.len());
    let mut replaced = Vec::new();
    let mut skipped = Vec::new();
    let mut names = NameBatch::new(target.engine, target.names);
    for (ordinal, (op, item)) in ops.iter().zip(items).enumerate() {
        // Checked when the op is first decided, against the range as of
        // this entry (a restart re-applying the entry repeats the decision
        // recorded then, whatever the range has become since).
        if first_time && !owns(target.range, &op.key) {
            skipped.push(ordinal as u32);
            results.push(OpResult::Refused(Refusal::WrongShard));
            continue;
        }
        let decided = decide_op(sessions, index, ordinal, op.session.as_ref(), |first| {
            // Whether a delete finds the key, and whether a put only if
            // absent may apply, decided in log order the first time.
            let existed = first && (op.value.is_none() || op.if_absent) && exists(target, &op.key)?;
            if existed && op.if_absent {
                return Ok(None);
            }
            // Read in log order, just before the put overwrites it or the
            // delete removes it, and only by an application that is this
            // op's one and only (`first`: not a duplicate, not a
            // re-application), for a put that is not itself a chunk
            // (chunks never overwrite blobs) and a delete of a key that
            // held something.
            if first
                && target.answered
                && !op.if_absent
                && match op.value.as_deref() {
                    Some(value) => {
                        blob::decode(value).is_ok_and(|(h, _)| h.kind != BlobKind::Chunk)
                    }
                    None => existed,
                }
                && let Some(chunks) = replaced_chunks(target, &op.key)
            {
                replaced.push((ordinal as u32, chunks));
            }
            target.engine.apply_item(item)?;
            Ok(Some(existed))
        })?;
        if !decided.applied {
            skipped.push(ordinal as u32);
        } else if !op.name.is_empty() && owns(target.range, &op.key) {
            // Never a name outside the range as it is now, so a finished
            // sweep's record (`names::swept`) stays true even
            // if an entry from before a split were applied again after a
            // restart (today the split's checkpoint flushes the engine, so
            // none is).
            index_name(&mut names, op)?;
        } else if op.name.is_empty() && unnamed_listable(op) {
            // Proposed by an older version (no names in its commands): the
            // index cannot list this blob, so listings must not claim to
            // be complete (a garbage collector would delete what it
            // references).
            names.mark_incomplete();
        }
        results.push(decided.result);
    }
    // After the items: a crash between the two re-applies the entry.
    names.commit(Durability::Buffered)?;
    // The entry decided, under the same hold of the sessions as the
    // decisions: a snapshot taking the sessions between the two (the
    // engine's background one) saved the ops' records with the entry not
    // decided, and re-applied after a crash the entry found its own ops
    // duplicates and skipped them — an applied write lost on the replica.
    if first_time {
        sessions.finish_entry(index, skipped);
    }
    Ok((results, replaced))
}

/// The chunks of the chunked blob stored under `key`, if an SDK upload
/// stored one there (a manifest with a nonce). Only the stored value's
/// header is read unless it is a manifest (not checked: a manifest is
/// then read whole and checked). Best effort: a failed read loses only
/// the chance to delete the old chunks (logged), never the write.
fn replaced_chunks(target: &Target<'_>, key: &[u8; KEY_BYTES]) -> Option<ReplacedChunks> {
    let read = || -> Result<Option<ReplacedChunks>> {
        let Some(head) = target
            .engine
            .get_head_unchecked(target.space, key, blob::HEADER_BYTES)?
        else {
            return Ok(None);
        };
        if blob::decode_head(&head.prefix, head.len)?.kind != BlobKind::Manifest {
            return Ok(None);
        }
        let Some(value) = target.engine.get(target.space, key)? else {
            return Ok(None);
        };
        let (header, content) = blob::decode(&value)?;
        if header.kind != BlobKind::Manifest {
            return Ok(None);
        }
        let manifest = <ChunkManifest as prost::Message>::decode(content)
            .map_err(|e| NodeError::Malformed(format!("a stored manifest: {e}")))?;
        Ok((manifest.nonce != 0).then_some(ReplacedChunks {
            nonce: manifest.nonce,
            count: manifest.chunks.len() as u64,
        }))
    };
    read().unwrap_or_else(|error| {
        tracing::warn!(
            %error,
            "the blob a put replaces could not be read: if it was chunked, its chunks stay"
        );
        None
    })
}

/// Records an applied op in the name index.
fn index_name(names: &mut NameBatch<'_>, op: &WriteOp) -> Result<()> {
    match &op.value {
        Some(value) => {
            let (header, _) = blob::decode(value)?;
            if header.kind == BlobKind::Chunk {
                // Never listed, and what the key held before is gone: a
                // chunk put under a listed blob's key (no SDK makes one;
                // its chunk keys are hashes) unlists it. Versions before
                // this one sent chunks without names.
                return names.remove(op.namespace, &op.name).map(|_| ());
            }
            let meta = Meta {
                kind: header.kind as u8,
                size: header.size,
                sha256: header.sha256,
            };
            names.insert(op.namespace, &op.name, &meta)
        }
        None => names.remove(op.namespace, &op.name).map(|_| ()),
    }
}

/// Whether an applied op without a name stored a blob a listing would
/// show: a put of anything but an SDK chunk.
fn unnamed_listable(op: &WriteOp) -> bool {
    op.value
        .as_deref()
        .is_some_and(|value| blob::decode(value).map_or(true, |(h, _)| h.kind != BlobKind::Chunk))
}

fn exists(target: &Target<'_>, key: &[u8; KEY_BYTES]) -> Result<bool> {
    Ok(target.engine.exists(target.space, key)?)
}

/// Decides one op and applies it with `apply` (given whether this is its
/// first application, so outcomes are computed; it returns whether a
/// delete found the key, or `None` if a put only-if-absent did and was not
/// applied).
fn decide_op(
    sessions: &mut Sessions,
    index: u64,
    ordinal: usize,
    session: Option<&SessionTag>,
    apply: impl FnOnce(bool) -> Result<Option<bool>>,
) -> Result<Decided> {
    if sessions.decided(index) {
        // Applied again after a restart: exactly as the first time; nobody
        // waits for the answer.
        let applied = sessions.was_applied(index, ordinal);
        if applied {
            apply(false)?;
        }
        return Ok(Decided {
            result: OpResult::DONE,
            applied,
        });
    }
    let admission = match session {
        Some(tag) => sessions.admit(tag),
        None => Admission::Apply,
    };
    Ok(match admission {
        Admission::Apply => match apply(true)? {
            Some(existed) => {
                if let Some(tag) = session {
                    sessions.record(tag, existed);
                }
                Decided {
                    result: OpResult::Done { existed },
                    applied: true,
                }
            }
            None => Decided {
                result: OpResult::Refused(Refusal::Exists),
                applied: false,
            },
        },
        Admission::Duplicate(result) => Decided {
            result,
            applied: false,
        },
        Admission::Refused(why) => Decided {
            result: OpResult::Refused(why),
            applied: false,
        },
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tidepool_engine::storage::{FaultStorage, Storage};

    use super::*;
    use crate::session::SessionTag;

    /// Applying a write entry records its ops' sessions and the entry as
    /// decided in one hold of the sessions: nobody taking the sessions in
    /// between (the engine's background snapshot) may see an op's record
    /// without its entry decided — re-applied after a crash, that entry
    /// found its own ops duplicates and skipped them. Before, an entry
    /// whose ops all applied was marked decided only later, by the caller.
    #[test]
    fn a_write_entry_is_decided_with_its_ops_sessions() {
        let storage: Arc<dyn Storage> = Arc::new(FaultStorage::default());
        let engine = Engine::open_with_storage(crate::sim::engine_config(), storage).unwrap();
        let space = engine.key_space(crate::replica::BLOB_KEY_SPACE).unwrap();
        let names = engine.key_space(crate::names::NAMES_KEY_SPACE).unwrap();
        let tag = SessionTag {
            id: 7,
            seq: 1,
            opens: true,
            time_ms: 1_000,
        };
        let op = WriteOp {
            session: Some(tag),
            ..crate::sim::put_op([3; 32], b"value".to_vec())
        };
        let ops = vec![op];
        let item = tidepool_engine::ItemInput {
            space,
            op: tidepool_engine::ItemOp::Put,
            key: &ops[0].key,
            value: ops[0].value.as_deref().unwrap(),
            epoch: Epoch(1),
            tag: Tag(1),
        };
        let appended = engine.append(b"entry 5", &[item]).unwrap();
        let target = Target {
            engine: &engine,
            space,
            names,
            range: None,
            answered: true,
        };
        let mut sessions = Sessions::starting_at(4);
        let (results, replaced) =
            apply_write(&target, &mut sessions, 5, &ops, &appended.items).unwrap();
        assert_eq!(results, vec![OpResult::Done { existed: false }]);
        assert!(replaced.is_empty());
        assert!(
            sessions.decided(5),
            "the entry is decided in the same hold as its ops' records"
        );
        assert!(sessions.was_applied(5, 0));
    }

    /// What a put replaced is read where it applies, in log order: the
    /// chunks of a manifest it overwrites (nonce, count), for the op that
    /// overwrote it in the entry (a batch's second put of the key names
    /// the first's manifest), only when this replica waits for the answer,
    /// never for a chunk's put, a put only if absent, or a manifest without
    /// a nonce.
    #[test]
    fn a_put_names_the_chunked_blob_it_overwrites() {
        use prost::Message as _;
        let storage: Arc<dyn Storage> = Arc::new(FaultStorage::default());
        let engine = Engine::open_with_storage(crate::sim::engine_config(), storage).unwrap();
        let space = engine.key_space(crate::replica::BLOB_KEY_SPACE).unwrap();
        let names = engine.key_space(crate::names::NAMES_KEY_SPACE).unwrap();
        let manifest = |nonce: u64, chunks: usize| {
            let content = ChunkManifest {
                size: 1,
                sha256: vec![0; 32],
                chunks: vec![Default::default(); chunks],
                nonce,
            }
            .encode_to_vec();
            blob::encode(BlobKind::Manifest, &blob::sha256(&content), &content)
        };
        let data = |kind: BlobKind| blob::encode(kind, &blob::sha256(b"x"), b"x");
        let mut index = 10;
        let mut apply = |ops: Vec<WriteOp>, answered: bool| {
            index += 1;
            let items: Vec<_> = ops
                .iter()
                .map(|op| tidepool_engine::ItemInput {
                    space,
                    op: tidepool_engine::ItemOp::Put,
                    key: &op.key,
                    value: op.value.as_deref().unwrap(),
                    epoch: Epoch(1),
                    tag: Tag(1),
                })
                .collect();
            let appended = engine.append(b"entry", &items).unwrap();
            let target = Target {
                engine: &engine,
                space,
                names,
                range: None,
                answered,
            };
            let mut sessions = Sessions::starting_at(index - 1);
            apply_write(&target, &mut sessions, index, &ops, &appended.items)
                .unwrap()
                .1
        };
        let key = [5; 32];
        let put = |value: Vec<u8>| crate::sim::put_op(key, value);
        let chunks = |nonce, count| ReplacedChunks { nonce, count };
        assert!(apply(vec![put(manifest(7, 3))], true).is_empty());
        // Not answered here (a follower): nothing read.
        assert!(apply(vec![put(data(BlobKind::Data))], false).is_empty());
        assert!(apply(vec![put(manifest(8, 2))], true).is_empty());
        // A batch: a plain put over manifest 8, then manifest 9, then a
        // plain put over manifest 9.
        let replaced = apply(
            vec![
                put(data(BlobKind::Data)),
                put(manifest(9, 4)),
                put(data(BlobKind::Data)),
            ],
            true,
        );
        assert_eq!(replaced, vec![(0, chunks(8, 2)), (2, chunks(9, 4))]);
        // A chunk's put, a put only if absent, a manifest without a nonce.
        apply(vec![put(manifest(10, 1))], true);
        assert!(apply(vec![put(data(BlobKind::Chunk))], true).is_empty());
        apply(vec![put(manifest(11, 1))], true);
        let absent = WriteOp {
            if_absent: true,
            ..put(data(BlobKind::Data))
        };
        assert!(apply(vec![absent], true).is_empty());
        apply(vec![put(manifest(0, 6))], true);
        assert!(apply(vec![put(data(BlobKind::Data))], true).is_empty());
    }
}
