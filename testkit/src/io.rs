//! What the kernel says this process did to disks.

use std::path::Path;

fn proc_self_io(field: &str) -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(": "))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/io"))
        .trim()
        .parse()
        .expect("number")
}

/// Bytes this process caused to be read from block devices so far
/// (`read_bytes` of `/proc/self/io`).
pub fn process_read_bytes() -> u64 {
    proc_self_io("read_bytes")
}

/// Bytes this process caused to be written to block devices so far
/// (`write_bytes` of `/proc/self/io`: counted when a page is dirtied, so
/// writes through a memory mapping count too).
pub fn process_write_bytes() -> u64 {
    proc_self_io("write_bytes")
}

/// Whether `path` is on a file system backed by a block device (not tmpfs),
/// so `/proc/self/io` sees its reads and writes.
pub fn on_block_device(path: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut best: Option<(usize, String)> = None;
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() >= 3
            && path.starts_with(fields[1])
            && best.as_ref().is_none_or(|(len, _)| fields[1].len() > *len)
        {
            best = Some((fields[1].len(), fields[2].to_string()));
        }
    }
    best.is_some_and(|(_, fs)| !matches!(fs.as_str(), "tmpfs" | "ramfs"))
}
