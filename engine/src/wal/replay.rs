//! Reading a log back in order, for recovery: every record from a start
//! position to the first one that is not valid.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::storage::{Storage, StorageFile};
use crate::types::{SegmentId, WalPosition};
use crate::wal::LogOptions;
use crate::wal::format::{HeaderRead, Kind, RECORD_HEADER_BYTES, RecordHeader, RecordView};
use crate::wal::segment::{HEADER_RECORD_BYTES, SegmentFile, SegmentHeader, parse_segment_name};

/// Bytes read from a segment at a time while replaying.
const CHUNK_BYTES: u64 = 4 << 20;

/// The readable segments of a log, and the files that are not (yet)
/// segments: spares never written, or garbage.
#[derive(Debug, Default)]
pub(crate) struct Segments {
    pub valid: BTreeMap<SegmentId, Arc<SegmentFile>>,
    pub unreadable: Vec<(SegmentId, String)>,
    /// The unreadable files of a segment's length whose header bytes are
    /// not all zero: written once, then damaged (a spare never activated
    /// has a header of zeros; activation writes the header before any
    /// record, and the first sync covering the segment covers it). Their
    /// sync marks still count: records a mark in them says were durable
    /// are not cut as a torn tail.
    pub damaged: BTreeMap<SegmentId, Arc<SegmentFile>>,
}

/// What a segment file's first record says.
enum Start {
    Header(SegmentHeader),
    /// Not a segment yet (a spare), or a file of the wrong length.
    Unwritten(String),
    /// Header bytes that are not zeros and not a valid header.
    Damaged(String),
}

/// Opens every segment file of the log and checks its header. A header
/// that cannot be read (an I/O error) fails the open: taken for a spare,
/// the segment and the records in it would be deleted.
pub(crate) fn open_segments(storage: &dyn Storage, opts: &LogOptions) -> Result<Segments> {
    let mut segments = Segments::default();
    let names = storage
        .list(&opts.dir)
        .map_err(|e| Error::io(&opts.dir, e))?;
    for name in names {
        let Some(id) = parse_segment_name(&name, opts.kind) else {
            continue;
        };
        let path = opts.dir.join(&name);
        let file = storage.open(&path).map_err(|e| Error::io(&path, e))?;
        match read_start(&*file, opts, id).map_err(|e| Error::io(&path, e))? {
            Start::Header(header) => {
                let segment = SegmentFile::new(id, path, file, header.epoch);
                segments.valid.insert(id, Arc::new(segment));
            }
            Start::Unwritten(reason) => segments.unreadable.push((id, reason)),
            Start::Damaged(reason) => {
                segments.unreadable.push((id, reason));
                let segment = SegmentFile::new(id, path, file, crate::types::Epoch(0));
                segments.damaged.insert(id, Arc::new(segment));
            }
        }
    }
    Ok(segments)
}

fn read_start(file: &dyn StorageFile, opts: &LogOptions, id: SegmentId) -> std::io::Result<Start> {
    if file.len() != opts.segment_size {
        return Ok(Start::Unwritten(format!(
            "file is {} bytes, segments are {}",
            file.len(),
            opts.segment_size
        )));
    }
    let mut bytes = [0u8; HEADER_RECORD_BYTES as usize];
    file.read_at(&mut bytes, 0)?;
    if bytes.iter().all(|b| *b == 0) {
        return Ok(Start::Unwritten("no segment header".into()));
    }
    let position = WalPosition(id.0 * opts.segment_size);
    let view = match RecordView::verify(position, &bytes) {
        Ok(view) => view,
        Err(m) => return Ok(Start::Damaged(m.0)),
    };
    if view.header.kind != Kind::SegmentHeader {
        return Ok(Start::Damaged(
            "first record is not a segment header".into(),
        ));
    }
    Ok(
        match SegmentHeader::decode(view.body, &opts.header(id, crate::types::Epoch(0))) {
            Ok(header) => Start::Header(header),
            Err(reason) => Start::Damaged(reason),
        },
    )
}

/// Why replay stopped.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Unwritten space or a missing segment: the log ends here.
    End,
    /// A record that is torn or corrupt.
    Bad {
        /// What was wrong.
        detail: String,
    },
}

/// Where and why replay stopped.
#[derive(Debug)]
pub(crate) struct ReplayEnd {
    /// Position of the first byte that is not part of a valid record.
    pub end: WalPosition,
    pub stop: Stop,
}

/// Visits every valid record from `from` (a record boundary) in order.
/// Segment headers are checked, not visited; pads are followed.
pub(crate) fn replay(
    opts: &LogOptions,
    segments: &BTreeMap<SegmentId, Arc<SegmentFile>>,
    from: WalPosition,
    mut visit: impl FnMut(WalPosition, &RecordView<'_>) -> Result<()>,
) -> Result<ReplayEnd> {
    let size = opts.segment_size;
    let mut position = from.0;
    loop {
        let id = SegmentId(position / size);
        let Some(segment) = segments.get(&id) else {
            return Ok(end(position, Stop::End));
        };
        let mut reader = ChunkReader::new(&*segment.file, size);
        let mut offset = position % size;
        if offset == 0 {
            // The header was checked when the segment was opened.
            offset = HEADER_RECORD_BYTES;
            position += HEADER_RECORD_BYTES;
        }
        loop {
            if size - offset < RECORD_HEADER_BYTES as u64 {
                position = (id.0 + 1) * size;
                break;
            }
            let bytes = reader
                .get(offset, RECORD_HEADER_BYTES)
                .map_err(|e| Error::io(&segment.path, e))?;
            let header = match RecordHeader::decode(bytes) {
                HeaderRead::Unwritten => return Ok(end(position, Stop::End)),
                HeaderRead::Invalid => return Ok(bad(position, "invalid record header")),
                HeaderRead::Header(header) => header,
            };
            let len = if header.kind == Kind::Pad {
                RECORD_HEADER_BYTES
            } else {
                header.record_len()
            };
            if offset + len as u64 > size {
                return Ok(bad(position, "record runs past the end of its segment"));
            }
            let bytes = reader
                .get(offset, len)
                .map_err(|e| Error::io(&segment.path, e))?;
            let view = match RecordView::verify(WalPosition(position), bytes) {
                Ok(view) => view,
                Err(malformed) => return Ok(bad(position, &malformed.0)),
            };
            match view.header.kind {
                Kind::Pad => {
                    position = (id.0 + 1) * size;
                    break;
                }
                Kind::SegmentHeader => return Ok(bad(position, "segment header inside a segment")),
                Kind::Entry | Kind::IndexBlob => visit(WalPosition(position), &view)?,
                Kind::SyncMark => {}
            }
            position += len as u64;
            offset += len as u64;
        }
    }
}

fn end(position: u64, stop: Stop) -> ReplayEnd {
    ReplayEnd {
        end: WalPosition(position),
        stop,
    }
}

fn bad(position: u64, detail: &str) -> ReplayEnd {
    end(
        position,
        Stop::Bad {
            detail: detail.to_string(),
        },
    )
}

/// Sequential reads of one segment through a large buffer.
struct ChunkReader<'a> {
    file: &'a dyn StorageFile,
    size: u64,
    buf: Vec<u8>,
    buf_offset: u64,
}

impl<'a> ChunkReader<'a> {
    fn new(file: &'a dyn StorageFile, size: u64) -> Self {
        Self {
            file,
            size,
            buf: Vec::new(),
            buf_offset: 0,
        }
    }

    fn get(&mut self, offset: u64, len: usize) -> std::io::Result<&[u8]> {
        let buffered_end = self.buf_offset + self.buf.len() as u64;
        if offset < self.buf_offset || offset + len as u64 > buffered_end {
            let read_len = (len as u64).max(CHUNK_BYTES).min(self.size - offset);
            self.buf.resize(read_len as usize, 0);
            self.file.read_at(&mut self.buf, offset)?;
            self.buf_offset = offset;
        }
        let start = (offset - self.buf_offset) as usize;
        Ok(&self.buf[start..start + len])
    }
}

/// Makes the log end at `end` for good, before new writes go to a fresh
/// segment. In this order, so that a crash between any two steps leaves a
/// log that a later recovery cuts at the same place:
/// 1. sync every segment from `from` to `end`, so what a crashed process
///    left in the page cache is durable before anything depends on it;
/// 2. delete every segment file after `end`'s segment and sync the
///    directory: they can only hold records past the end (never
///    acknowledged as durable), which must never become reachable;
/// 3. if `end` is inside a segment, write a pad record there and sync it, so
///    later replays skip whatever torn bytes follow in that segment and go
///    on to the (now absent) next segment.
///
/// Step 2 must precede step 3: with the pad in place but the later segments
/// still there, a replay would jump over the torn record into records that
/// follow it — a gap in the log.
///
/// Returns the segment new writes must start in.
pub(crate) fn seal_tail(
    storage: &dyn Storage,
    opts: &LogOptions,
    segments: &BTreeMap<SegmentId, Arc<SegmentFile>>,
    from: WalPosition,
    end: WalPosition,
) -> Result<SegmentId> {
    let size = opts.segment_size;
    for segment in segments
        .range(SegmentId(from.0 / size)..=SegmentId(end.0 / size))
        .map(|(_, s)| s)
    {
        segment
            .file
            .sync_all()
            .map_err(|e| Error::io(&segment.path, e))?;
    }
    let offset = end.0 % size;
    let next = if offset == 0 {
        SegmentId(end.0 / size)
    } else {
        SegmentId(end.0 / size + 1)
    };
    remove_segments_from(storage, opts, next)?;
    if offset == 0 {
        return Ok(next);
    }
    let Some(segment) = segments.get(&SegmentId(end.0 / size)) else {
        // The segment is gone (damage accepted by the recovery mode):
        // nothing to pad.
        return Ok(next);
    };
    if size - offset >= RECORD_HEADER_BYTES as u64 {
        let mut pad = [0u8; RECORD_HEADER_BYTES];
        crate::wal::format::write_pad(&mut pad, end);
        segment
            .file
            .write_at(&pad, offset)
            .map_err(|e| Error::io(&segment.path, e))?;
        segment
            .file
            .sync_range(offset, RECORD_HEADER_BYTES as u64)
            .map_err(|e| Error::io(&segment.path, e))?;
    }
    Ok(next)
}

/// Deletes segment files with ids at or after `from` (spares, or segments
/// past the recovered end of the log) and syncs the directory.
pub(crate) fn remove_segments_from(
    storage: &dyn Storage,
    opts: &LogOptions,
    from: SegmentId,
) -> Result<()> {
    let names = storage
        .list(&opts.dir)
        .map_err(|e| Error::io(&opts.dir, e))?;
    let mut removed = false;
    for name in names {
        if let Some(id) = parse_segment_name(&name, opts.kind)
            && id >= from
        {
            let path = opts.dir.join(&name);
            storage.remove(&path).map_err(|e| Error::io(&path, e))?;
            removed = true;
        }
    }
    if removed {
        storage
            .sync_dir(&opts.dir)
            .map_err(|e| Error::io(&opts.dir, e))?;
    }
    Ok(())
}

/// The highest synced watermark claimed by a valid sync mark at or after
/// `from`, found by checking every 8-byte boundary (the records around a
/// damaged one cannot be trusted to say where the next starts). A mark's
/// checksum covers its position, so garbage does not pass for one.
pub(crate) fn scan_sync_marks(
    opts: &LogOptions,
    segments: &BTreeMap<SegmentId, Arc<SegmentFile>>,
    from: WalPosition,
) -> Result<u64> {
    let size = opts.segment_size;
    let mark_len = crate::wal::format::record_len(8);
    let mut highest = 0;
    for (id, segment) in segments.range(SegmentId(from.0 / size)..) {
        let base = id.0 * size;
        let mut reader = ChunkReader::new(&*segment.file, size);
        let mut offset = from.0.saturating_sub(base).max(HEADER_RECORD_BYTES);
        while offset + mark_len as u64 <= size {
            let bytes = reader
                .get(offset, mark_len)
                .map_err(|e| Error::io(&segment.path, e))?;
            if bytes[4] == Kind::SyncMark as u8
                && let Ok(view) = RecordView::verify(WalPosition(base + offset), bytes)
                && view.header.kind == Kind::SyncMark
            {
                let synced = u64::from_le_bytes(view.body.try_into().expect("8-byte mark"));
                highest = highest.max(synced);
            }
            offset += 8;
        }
    }
    Ok(highest)
}
