//! The one crash-safe way to replace a small file: write a temporary file,
//! sync it, rename it over the target, sync the directory.
//!
//! After a crash at any step the target holds either its old content or the
//! new one, never a mix: the rename is atomic, and it only happens once the
//! new bytes are durable.

use std::io;
use std::path::{Path, PathBuf};

use super::Storage;

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Replaces `path` with `bytes`, crash-safely:
/// 1. create `<path>.tmp` (removing a leftover one) and write the bytes;
/// 2. sync the temporary file;
/// 3. rename it over `path`;
/// 4. sync the directory, making the rename durable.
pub fn write_file_atomically(storage: &dyn Storage, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let temp = temp_path(path);
    if storage.exists(&temp) {
        storage.remove(&temp)?;
    }
    let file = storage.create(&temp, bytes.len() as u64)?;
    if !bytes.is_empty() {
        file.write_at(bytes, 0)?;
    }
    file.sync_all()?;
    drop(file);
    storage.rename(&temp, path)?;
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    storage.sync_dir(dir)
}

/// The whole content of `path`, or `None` if it does not exist.
pub fn read_whole_file(storage: &dyn Storage, path: &Path) -> io::Result<Option<Vec<u8>>> {
    if !storage.exists(path) {
        return Ok(None);
    }
    let file = storage.open(path)?;
    let mut bytes = vec![0; file.len() as usize];
    file.read_at(&mut bytes, 0)?;
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::super::{FaultConfig, FaultStorage};
    use super::*;

    #[test]
    fn every_crash_point_leaves_old_or_new_content() {
        let dir = Path::new("/db");
        let path = dir.join("control");
        for crash_at in 1..=6 {
            let storage = FaultStorage::new(FaultConfig::default());
            storage.create_dir_all(dir).unwrap();
            write_file_atomically(&storage, &path, b"old").unwrap();
            storage.crash_at_op(storage.ops() + crash_at);
            let result = write_file_atomically(&storage, &path, b"new content");
            for seed in 0..8 {
                let after = storage.reboot(seed);
                let content = read_whole_file(&after, &path)
                    .unwrap()
                    .expect("target exists");
                assert!(
                    content == b"old" || content == b"new content",
                    "crash at op {crash_at}, seed {seed}: {content:?}"
                );
                if result.is_ok() {
                    assert_eq!(content, b"new content", "acknowledged write lost");
                }
            }
        }
    }
}
