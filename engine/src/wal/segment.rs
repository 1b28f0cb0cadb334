//! Segment files: naming, the header record that starts each one, and the
//! in-memory handles of sealed and active segments.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use crate::storage::{Mapping, ReadMapping, StorageFile};
use crate::types::{Epoch, SegmentId};
use crate::wal::format::{self, Kind, RECORD_HEADER_BYTES};

/// Magic bytes at the start of every segment header body.
const MAGIC: &[u8; 8] = b"TIDEPOOL";
/// Version of the log format described in `format/` that this build
/// writes: 2 added single entries (record kind 6).
pub(crate) const FORMAT_VERSION: u32 = 2;
/// The oldest version this build reads. One segment never holds two
/// versions: recovery resumes writing in a fresh segment. (Going back to a
/// build that reads only version 1 is not supported; such a build also
/// refuses the control file's version 2.)
const OLDEST_FORMAT_VERSION: u32 = 1;
/// Bytes of a segment header body.
const HEADER_BODY_BYTES: usize = 56;
/// Bytes a segment header record occupies.
pub(crate) const HEADER_RECORD_BYTES: u64 = (RECORD_HEADER_BYTES + HEADER_BODY_BYTES) as u64;

/// Which log a segment belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum LogKind {
    /// The value WAL.
    Values = 1,
    /// The index log.
    Index = 2,
}

impl LogKind {
    /// File extension of the log's segments.
    pub fn extension(self) -> &'static str {
        match self {
            LogKind::Values => "wal",
            LogKind::Index => "idx",
        }
    }
}

/// Path of segment `id` in `dir`.
pub(crate) fn segment_path(dir: &Path, kind: LogKind, id: SegmentId) -> PathBuf {
    dir.join(format!("{:016x}.{}", id.0, kind.extension()))
}

/// The segment id a file name stands for, if it is one of ours.
pub(crate) fn parse_segment_name(name: &str, kind: LogKind) -> Option<SegmentId> {
    let (stem, ext) = name.split_once('.')?;
    if ext != kind.extension() || stem.len() != 16 {
        return None;
    }
    u64::from_str_radix(stem, 16).ok().map(SegmentId)
}

/// The content of a segment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    pub kind: LogKind,
    pub log_id: [u8; 16],
    pub id: SegmentId,
    pub segment_size: u64,
    pub epoch: Epoch,
}

impl SegmentHeader {
    /// Encodes the header body.
    pub fn encode(&self) -> [u8; HEADER_BODY_BYTES] {
        let mut body = [0u8; HEADER_BODY_BYTES];
        body[0..8].copy_from_slice(MAGIC);
        body[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        body[12] = self.kind as u8;
        body[16..32].copy_from_slice(&self.log_id);
        body[32..40].copy_from_slice(&self.id.0.to_le_bytes());
        body[40..48].copy_from_slice(&self.segment_size.to_le_bytes());
        body[48..52].copy_from_slice(&self.epoch.0.to_le_bytes());
        body
    }

    /// Decodes and checks a header body against what the log expects.
    pub fn decode(body: &[u8], expected: &SegmentHeader) -> Result<SegmentHeader, String> {
        if body.len() != HEADER_BODY_BYTES || &body[0..8] != MAGIC {
            return Err("not a Tidepool segment header".into());
        }
        let version = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(format!(
                "log format version {version}, this build reads {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}"
            ));
        }
        let header = SegmentHeader {
            kind: if body[12] == LogKind::Index as u8 {
                LogKind::Index
            } else {
                LogKind::Values
            },
            log_id: body[16..32].try_into().expect("16 bytes"),
            id: SegmentId(u64::from_le_bytes(
                body[32..40].try_into().expect("8 bytes"),
            )),
            segment_size: u64::from_le_bytes(body[40..48].try_into().expect("8 bytes")),
            epoch: Epoch(u32::from_le_bytes(
                body[48..52].try_into().expect("4 bytes"),
            )),
        };
        if body[12] != expected.kind as u8 {
            return Err("segment of another log kind".into());
        }
        if header.log_id != expected.log_id {
            return Err("segment of another engine (log id differs)".into());
        }
        if header.id != expected.id {
            return Err(format!(
                "header names {}, file is {}",
                header.id, expected.id
            ));
        }
        if header.segment_size != expected.segment_size {
            return Err(format!(
                "segment size {} differs from the configured {}",
                header.segment_size, expected.segment_size
            ));
        }
        Ok(header)
    }

    /// Writes the header record at the start of `buf`.
    pub fn write_record(&self, buf: &mut [u8], base: u64) {
        let record = &mut buf[..HEADER_RECORD_BYTES as usize];
        format::write_plain(
            record,
            crate::types::WalPosition(base),
            Kind::SegmentHeader,
            &self.encode(),
        );
    }
}

/// A segment file that can be read.
#[derive(Debug)]
pub(crate) struct SegmentFile {
    pub id: SegmentId,
    pub path: PathBuf,
    pub file: Arc<dyn StorageFile>,
    pub epoch: Epoch,
    /// A read-only mapping of the file, made on first use by logs that read
    /// through one (`None` inside: mapping failed; reads use `pread`).
    pub reader: OnceLock<Option<ReadMapping>>,
}

impl SegmentFile {
    /// A readable segment.
    pub fn new(id: SegmentId, path: PathBuf, file: Arc<dyn StorageFile>, epoch: Epoch) -> Self {
        Self {
            id,
            path,
            file,
            epoch,
            reader: OnceLock::new(),
        }
    }

    /// The file's read-only mapping, made now if needed; `None` if the
    /// file cannot be mapped.
    pub fn mapped(&self) -> Option<&ReadMapping> {
        self.reader
            .get_or_init(|| self.file.map_read().ok())
            .as_ref()
    }
}

/// The segment writers append to.
#[derive(Debug)]
pub(crate) struct Active {
    pub segment: Arc<SegmentFile>,
    pub mapping: Mapping,
    /// Log position of the segment's first byte.
    pub base: u64,
    /// Whether the unwritten rest of the segment is in page-sized folios
    /// (mapped so, or changed to them by the allocator since).
    pub page_folios: AtomicBool,
}

/// A pre-created, mapped segment file waiting to become active.
#[derive(Debug)]
pub(crate) struct Spare {
    pub id: SegmentId,
    pub path: PathBuf,
    pub file: Arc<dyn StorageFile>,
    pub mapping: Mapping,
    /// Whether it was mapped with page-sized folios.
    pub page_folios: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_1_segments_still_read_and_unknown_versions_do_not() {
        let header = SegmentHeader {
            kind: LogKind::Values,
            log_id: [7; 16],
            id: SegmentId(3),
            segment_size: 1 << 20,
            epoch: Epoch(2),
        };
        let mut body = header.encode();
        assert_eq!(SegmentHeader::decode(&body, &header), Ok(header));
        for (version, reads) in [(0u32, false), (1, true), (2, true), (3, false)] {
            body[8..12].copy_from_slice(&version.to_le_bytes());
            assert_eq!(
                SegmentHeader::decode(&body, &header).is_ok(),
                reads,
                "version {version}"
            );
        }
    }
}
