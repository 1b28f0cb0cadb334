//! Checkpoints: a consistent set of an engine's files that another directory
//! can be filled with and opened as an engine holding the same data — how a
//! replication layer ships a shard's state to a new replica.
//!
//! A checkpoint is what a crash would leave behind at one instant, minus the
//! garbage: the control region of a fresh snapshot (taken after flushing
//! every cell, so it replays nothing written before it), every value WAL
//! segment up to the synced watermark, and the index segments that snapshot
//! references, up to the index log's synced watermark. Every byte it lists is
//! below a synced watermark, so no writer touches it any more; the files stay
//! readable through open handles even if relocation deletes them meanwhile.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::control::{CONTROL_FILE, ControlData};
use crate::engine::{Engine, Inner};
use crate::error::{Error, Result};
use crate::storage::StorageFile;
use crate::types::WalPosition;
use crate::wal::segment::SegmentFile;

/// Where a checkpoint file's bytes come from.
#[derive(Clone, Debug)]
enum Source {
    /// The control region, encoded at checkpoint time.
    Memory(Arc<Vec<u8>>),
    /// An open segment file (kept readable while the checkpoint lives).
    File(Arc<dyn StorageFile>),
}

/// One file of a checkpoint.
#[derive(Clone, Debug)]
pub struct CheckpointFile {
    /// Path relative to the engine directory.
    pub path: PathBuf,
    /// Bytes to copy, from offset 0.
    pub len: u64,
    /// Length of the file to create: the bytes past `len` are zeros.
    pub file_len: u64,
    source: Source,
}

impl CheckpointFile {
    /// Reads `buf.len()` bytes at `offset` (inside `0..len`).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|end| *end <= self.len)
            .ok_or_else(|| {
                Error::Config(format!(
                    "read of {} bytes at {offset} past the end ({}) of checkpoint file {}",
                    buf.len(),
                    self.len,
                    self.path.display()
                ))
            })?;
        match &self.source {
            Source::Memory(bytes) => {
                buf.copy_from_slice(&bytes[offset as usize..end as usize]);
                Ok(())
            }
            Source::File(file) => file
                .read_at(buf, offset)
                .map_err(|e| Error::io(&self.path, e)),
        }
    }
}

/// A consistent set of engine files; see the module docs. Holding it keeps
/// the files it lists readable.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The engine's directory (where its files are named).
    dir: PathBuf,
    /// The files, segments first and the control file last — a receiver that
    /// writes them in this order has no control file until it has the rest,
    /// so a partial copy never opens as an engine.
    pub files: Vec<CheckpointFile>,
    /// The opaque application state recorded in it.
    pub app_state: Vec<u8>,
    /// The value WAL position the copy ends at.
    pub wal_end: WalPosition,
}

impl Checkpoint {
    /// Total bytes to copy.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }

    /// Writes the checkpoint into `dir` on `storage`, which must hold no
    /// engine files: a local copy that opens as an engine with exactly the
    /// checkpoint's state (how a shard split starts its new group from the
    /// parent's state, `docs/design/splits.md`). A file the checkpoint
    /// lists whole — a segment entirely below its log's synced watermark,
    /// which nothing writes again — becomes a hard link to the engine's
    /// file where the storage allows (no bytes copied; either engine
    /// deleting its name leaves the other's); the rest is copied. Files
    /// are written in the checkpoint's order, the control file last, each
    /// synced, then the directories: a copy cut short has no control file
    /// and never opens as an engine. Returns the bytes copied (not linked).
    pub fn materialize(&self, storage: &dyn crate::storage::Storage, dir: &Path) -> Result<u64> {
        let mut copied = 0;
        let mut dirs = std::collections::BTreeSet::new();
        for file in &self.files {
            let path = dir.join(&file.path);
            let parent = path.parent().unwrap_or(dir).to_path_buf();
            if dirs.insert(parent.clone()) {
                storage
                    .create_dir_all(&parent)
                    .map_err(|e| Error::io(&parent, e))?;
            }
            let whole = file.len == file.file_len && matches!(file.source, Source::File(_));
            // The engine's file may be gone (relocated away) since the
            // checkpoint: its open handle still reads, so copy then.
            if whole && storage.hard_link(&self.dir.join(&file.path), &path).is_ok() {
                continue;
            }
            // Written under a temporary name and renamed once synced: a
            // copy cut short leaves no file under its name (a control file
            // created but not yet written made the copy an engine that
            // never opened). Blocks for the bytes copied only: the rest of
            // a tail segment is allocated as the new engine writes it, as
            // its own are.
            let partial = path.with_extension(match path.extension() {
                Some(ext) => format!("{}.partial", ext.to_string_lossy()),
                None => "partial".to_string(),
            });
            if storage.exists(&partial) {
                storage
                    .remove(&partial)
                    .map_err(|e| Error::io(&partial, e))?;
            }
            let out = storage
                .create_sparse(&partial, file.file_len, file.len)
                .map_err(|e| Error::io(&partial, e))?;
            let mut buf = vec![0; (1 << 20).min(file.len as usize)];
            let mut offset = 0;
            while offset < file.len {
                let n = (file.len - offset).min(buf.len() as u64) as usize;
                file.read_at(&mut buf[..n], offset)?;
                out.write_at(&buf[..n], offset)
                    .map_err(|e| Error::io(&path, e))?;
                offset += n as u64;
            }
            out.sync_all().map_err(|e| Error::io(&path, e))?;
            drop(out);
            storage
                .rename(&partial, &path)
                .map_err(|e| Error::io(&path, e))?;
            copied += file.len;
        }
        // Children first, the engine's directory last.
        for parent in dirs.iter().rev() {
            storage.sync_dir(parent).map_err(|e| Error::io(parent, e))?;
        }
        Ok(copied)
    }
}

impl Engine {
    /// Takes a checkpoint: flushes every cell, writes a snapshot and lists the
    /// files that hold exactly the engine's state as of this call, for a
    /// copy elsewhere (see [`Checkpoint`]). Relocation and epoch drops wait
    /// while it is taken; writes do not. Writes that complete during the
    /// call may or may not be in it.
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        let inner = &*self.inner;
        inner.health.check()?;
        let _no_relocation = inner.relocation.take_turn_first();
        crate::flush::flush_all(inner)?;
        crate::snapshot::write_snapshot_then(inner, |control| capture(inner, control))
    }
}

/// Lists the files of `control` (just made durable), under the snapshot
/// lock so no index garbage collection runs in between.
fn capture(inner: &Inner, control: &ControlData) -> Result<Checkpoint> {
    let dir = &inner.config.dir;
    let mut files = Vec::new();
    let wal_end = inner.values.synced();
    let wal_size = inner.config.wal_segment_bytes;
    for segment in inner.values.segments() {
        if let Some(file) = segment_file(dir, &segment, wal_size, wal_end.0)? {
            files.push(file);
        }
    }
    let index_size = inner.config.index_segment_bytes;
    let referenced = control.index_segments();
    let index_end = inner.index.log.synced().0;
    for segment in inner.index.log.segments() {
        if referenced.contains(&segment.id)
            && let Some(file) = segment_file(dir, &segment, index_size, index_end)?
        {
            files.push(file);
        }
    }
    let bytes = control.encode();
    files.push(CheckpointFile {
        path: PathBuf::from(CONTROL_FILE),
        len: bytes.len() as u64,
        file_len: bytes.len() as u64,
        source: Source::Memory(Arc::new(bytes)),
    });
    Ok(Checkpoint {
        dir: dir.clone(),
        files,
        app_state: control.app_state.clone(),
        wal_end,
    })
}

/// The part of `segment` below `end` (a synced watermark), if any.
fn segment_file(
    dir: &Path,
    segment: &SegmentFile,
    size: u64,
    end: u64,
) -> Result<Option<CheckpointFile>> {
    let start = segment.id.0 * size;
    if start >= end {
        return Ok(None);
    }
    let path = segment
        .path
        .strip_prefix(dir)
        .map_err(|_| {
            Error::Config(format!(
                "segment {} outside the engine",
                segment.path.display()
            ))
        })?
        .to_path_buf();
    Ok(Some(CheckpointFile {
        path,
        len: (end - start).min(size),
        file_len: size,
        source: Source::File(segment.file.clone()),
    }))
}

/// Whether `dir` holds an engine: its control file, written when the
/// engine was created and only ever replaced atomically since. An engine
/// opened on a directory without one starts empty.
pub fn engine_exists(storage: &dyn crate::storage::Storage, dir: &Path) -> bool {
    storage.exists(&dir.join(CONTROL_FILE))
}

/// Whether `relative` (a path inside an engine directory) names a file of
/// the engine: its control file, or a segment of its value or index log —
/// what a checkpoint holds, and all [`remove_engine_files`] removes. A
/// replication layer accepts no other name from a peer: a file it could
/// not remove again stayed for good (and, named again, blocked every later
/// copy).
pub fn is_engine_file(relative: &Path) -> bool {
    use crate::wal::segment::{LogKind, parse_segment_name};
    let parts: Option<Vec<&str>> = relative
        .components()
        .map(|c| match c {
            std::path::Component::Normal(name) => name.to_str(),
            _ => None,
        })
        .collect();
    match parts.as_deref() {
        Some([file]) => *file == CONTROL_FILE,
        Some([dir, file]) => match (*dir, *file) {
            ("wal", file) => parse_segment_name(file, LogKind::Values).is_some(),
            ("index", file) => parse_segment_name(file, LogKind::Index).is_some(),
            _ => false,
        },
        _ => false,
    }
}

/// Deletes every file of the engine that lived in `dir` (it must be
/// closed), leaving the directories: how a replication layer empties a
/// directory before copying a checkpoint into it. Files that are not the
/// engine's are left alone.
pub fn remove_engine_files(storage: &dyn crate::storage::Storage, dir: &Path) -> Result<()> {
    use crate::wal::segment::{LogKind, parse_segment_name};
    for (sub, kind) in [
        ("wal", Some(LogKind::Values)),
        ("index", Some(LogKind::Index)),
        ("", None),
    ] {
        let path = dir.join(sub);
        if !storage.exists(&path) {
            continue;
        }
        let names = storage.list(&path).map_err(|e| Error::io(&path, e))?;
        let mut removed = false;
        for name in names {
            let ours = match kind {
                Some(kind) => parse_segment_name(&name, kind).is_some(),
                None => name == CONTROL_FILE || name.starts_with(&format!("{CONTROL_FILE}.")),
            };
            if ours {
                let file = path.join(&name);
                storage.remove(&file).map_err(|e| Error::io(&file, e))?;
                removed = true;
            }
        }
        if removed {
            storage.sync_dir(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    Ok(())
}
