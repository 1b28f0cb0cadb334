//! `tidectl load` and `tidectl verify`: a write load for exercising a
//! cluster while it restarts, scales or upgrades, and the check that every
//! write it saw acknowledged is still there, intact.
//!
//! Each blob's content is derived from its key (SHA-256 blocks of the key
//! and a counter), so the record of acknowledged keys is all `verify`
//! needs. The record is appended and flushed per acknowledgement: a load
//! killed mid-run still leaves every acknowledged key on file.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::json;
use tidepool_client::Client;

use crate::{Failure, Outcome, print};

/// The blob stored under `key`: `size` bytes of SHA-256(key ‖ block
/// number) blocks.
pub fn content(key: &str, size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size + 32);
    let mut block = 0u64;
    while out.len() < size {
        let mut input = key.as_bytes().to_vec();
        input.extend_from_slice(&block.to_le_bytes());
        out.extend_from_slice(&tidepool_client::sha256(&input));
        block += 1;
    }
    out.truncate(size);
    out
}

/// What a load run saw.
#[derive(Debug, Default)]
struct Tally {
    acknowledged: u64,
    failed: u64,
    /// Acknowledged puts the record could not be given (`verify` would
    /// not check them, and pass).
    unrecorded: u64,
    /// Times of acknowledgements, since the start.
    last_ack: Duration,
    longest_gap: Duration,
    longest_gap_at: Duration,
    /// The longest an acknowledged put took (what one caller waited).
    slowest: Duration,
}

impl Tally {
    fn ack(&mut self, at: Duration) {
        let gap = at.saturating_sub(self.last_ack);
        if gap > self.longest_gap {
            self.longest_gap = gap;
            self.longest_gap_at = self.last_ack;
        }
        self.last_ack = self.last_ack.max(at);
        self.acknowledged += 1;
    }
}

/// Settings of `tidectl load`.
#[derive(Debug)]
pub struct Load {
    pub namespace: String,
    pub seconds: u64,
    pub size: usize,
    pub writers: usize,
    pub prefix: String,
    pub record: Option<PathBuf>,
    pub stop_file: Option<PathBuf>,
}

/// Writes until the time is up (or the stop file appears).
pub async fn load(json: bool, client: &Client, settings: Load) -> Outcome {
    let record = match &settings.record {
        Some(path) => Some(Arc::new(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| crate::usage(format!("cannot open {}: {e}", path.display())))?,
        ))),
        None => None,
    };
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let deadline = (settings.seconds > 0).then(|| started + Duration::from_secs(settings.seconds));
    let stop_file = settings.stop_file.clone();
    let done = move || {
        deadline.is_some_and(|d| Instant::now() >= d)
            || stop_file.as_deref().is_some_and(Path::exists)
    };
    let mut writers = Vec::new();
    for writer in 0..settings.writers.max(1) {
        let client = client.clone();
        let tally = tally.clone();
        let record = record.clone();
        let done = done.clone();
        let namespace = settings.namespace.clone();
        let prefix = settings.prefix.clone();
        let size = settings.size;
        writers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !done() {
                let key = format!("{prefix}-{writer}-{n}");
                n += 1;
                let value = content(&key, size);
                let began = Instant::now();
                match client.put(&namespace, key.as_bytes(), &value).await {
                    Ok(_) => {
                        let recorded = match &record {
                            Some(record) => {
                                let mut file = record.lock();
                                writeln!(file, "{key} {size}").and_then(|()| file.flush())
                            }
                            None => Ok(()),
                        };
                        let mut t = tally.lock();
                        if let Err(e) = recorded {
                            if t.unrecorded == 0 {
                                eprintln!("the record cannot be written: {e}");
                            }
                            t.unrecorded += 1;
                        }
                        t.ack(started.elapsed());
                        t.slowest = t.slowest.max(began.elapsed());
                    }
                    Err(e) => {
                        eprintln!(
                            "{:.3}s put {key}: failed: {e}",
                            started.elapsed().as_secs_f64()
                        );
                        tally.lock().failed += 1;
                    }
                }
            }
        }));
    }
    for writer in writers {
        let _ = writer.await;
    }
    let elapsed = started.elapsed();
    let mut t = tally.lock();
    // The time from the last acknowledgement to the end is a gap too.
    let tail = elapsed.saturating_sub(t.last_ack);
    if tail > t.longest_gap {
        t.longest_gap = tail;
        t.longest_gap_at = t.last_ack;
    }
    let rate = t.acknowledged as f64 / elapsed.as_secs_f64().max(1e-9);
    print(
        json,
        json!({
            "acknowledged": t.acknowledged,
            "failed": t.failed,
            "seconds": elapsed.as_secs_f64(),
            "puts_per_second": rate,
            "longest_gap_ms": t.longest_gap.as_millis() as u64,
            "longest_gap_at_s": t.longest_gap_at.as_secs_f64(),
            "slowest_put_ms": t.slowest.as_millis() as u64,
        }),
        format!(
            "{} acknowledged, {} failed in {:.1} s ({rate:.1} puts/s); longest gap between acknowledgements {} ms, from {:.1} s; slowest acknowledged put {} ms",
            t.acknowledged,
            t.failed,
            elapsed.as_secs_f64(),
            t.longest_gap.as_millis(),
            t.longest_gap_at.as_secs_f64(),
            t.slowest.as_millis()
        ),
    );
    if t.failed > 0 {
        return Err(Failure {
            code: 1,
            message: format!("{} puts failed", t.failed),
        });
    }
    if t.unrecorded > 0 {
        return Err(Failure {
            code: 1,
            message: format!(
                "{} acknowledged puts are missing from the record: a verify of it would not check them",
                t.unrecorded
            ),
        });
    }
    Ok(())
}

/// Reads back every key of `record` and compares it with what `load`
/// wrote.
pub async fn verify(json: bool, client: &Client, namespace: &str, record: &Path) -> Outcome {
    let text = std::fs::read_to_string(record)
        .map_err(|e| crate::usage(format!("cannot read {}: {e}", record.display())))?;
    let mut entries = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (key, size) = line
            .rsplit_once(' ')
            .and_then(|(k, s)| Some((k.to_string(), s.trim().parse::<usize>().ok()?)))
            .ok_or_else(|| crate::usage(format!("bad record line {line:?}")))?;
        entries.push((key, size));
    }
    let total = entries.len();
    let queue = Arc::new(Mutex::new(entries));
    let bad = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut readers = Vec::new();
    for _ in 0..8 {
        let (client, queue, bad) = (client.clone(), queue.clone(), bad.clone());
        let namespace = namespace.to_string();
        readers.push(tokio::spawn(async move {
            loop {
                let Some((key, size)) = queue.lock().pop() else {
                    return;
                };
                match client.get(&namespace, key.as_bytes()).await {
                    Ok(value) if value == content(&key, size) => {}
                    Ok(value) => bad.lock().push(format!(
                        "{key}: {} bytes, not what was written",
                        value.len()
                    )),
                    Err(e) => bad.lock().push(format!("{key}: {e}")),
                }
            }
        }));
    }
    for reader in readers {
        let _ = reader.await;
    }
    let bad = bad.lock();
    for line in bad.iter().take(20) {
        eprintln!("{line}");
    }
    print(
        json,
        json!({"checked": total, "bad": bad.len()}),
        format!(
            "{total} acknowledged blobs checked: {} intact, {} missing or wrong",
            total - bad.len(),
            bad.len()
        ),
    );
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Failure {
            code: 1,
            message: format!("{} acknowledged blobs are missing or wrong", bad.len()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_a_function_of_the_key() {
        assert_eq!(content("a-0-1", 100), content("a-0-1", 100));
        assert_ne!(content("a-0-1", 100), content("a-0-2", 100));
        assert_eq!(content("k", 0).len(), 0);
        assert_eq!(content("k", 33).len(), 33);
        assert_eq!(&content("k", 64)[..33], &content("k", 33)[..]);
    }

    #[test]
    fn the_longest_gap_is_between_acknowledgements() {
        let mut t = Tally::default();
        for ms in [100, 200, 1_700, 1_750] {
            t.ack(Duration::from_millis(ms));
        }
        assert_eq!(t.acknowledged, 4);
        assert_eq!(t.longest_gap, Duration::from_millis(1_500));
        assert_eq!(t.longest_gap_at, Duration::from_millis(200));
        // Acknowledgements of concurrent writers may arrive out of order.
        t.ack(Duration::from_millis(1_720));
        assert_eq!(t.last_ack, Duration::from_millis(1_750));
    }
}
