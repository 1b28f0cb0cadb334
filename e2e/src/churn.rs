//! Churn: one writer that keeps overwriting a few larger blobs, so the
//! nodes' segments fill with dead values and relocation (space
//! reclamation, `docs/design/relocation.md`) runs under whatever faults a
//! scenario injects. Each key is written by this writer alone, with
//! versions that only grow, so after it stops a key must hold its last
//! acknowledged version or a later one whose put was not acknowledged
//! (indeterminate), byte for byte.

use std::collections::BTreeMap;
use std::time::Duration;

use tidepool_client::{Client, ErrorCode};
use tokio::sync::watch;

/// Name of churn key `key` (namespace `default`, apart from the workload's).
pub fn churn_key(key: u32) -> Vec<u8> {
    format!("churn-{key}").into_bytes()
}

/// The content of version `version` of churn key `key`: the key and the
/// version, then `size - 12` bytes derived from both.
pub fn churn_content(key: u32, version: u64, size: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(size.max(12));
    bytes.extend_from_slice(&key.to_le_bytes());
    bytes.extend_from_slice(&version.to_le_bytes());
    let seed = u64::from(key).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ version.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    bytes.extend((12..size).map(|i| {
        let x = seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x ^ (x >> 29) ^ (x >> 47)) as u8
    }));
    bytes
}

/// What the writer did.
#[derive(Debug, Default)]
pub struct ChurnLog {
    /// Per key: the last version acknowledged.
    pub acknowledged: BTreeMap<u32, u64>,
    /// Per key: the last version attempted.
    pub attempted: BTreeMap<u32, u64>,
    /// Puts acknowledged.
    pub puts: u64,
    /// Puts that failed (indeterminate).
    pub failed: u64,
    /// Size of each value.
    pub size: usize,
}

/// The writer, running.
pub struct Churn {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<ChurnLog>,
}

impl Churn {
    /// Starts overwriting `keys` blobs of `size` bytes in turn, at most
    /// `per_second` puts a second, each put with `timeout` (retries
    /// included).
    pub fn start(
        client: Client,
        keys: u32,
        size: usize,
        per_second: u32,
        timeout: Duration,
    ) -> Churn {
        let (stop, stopped) = watch::channel(false);
        let client = client.with_timeout(timeout);
        let pace = Duration::from_secs(1) / per_second.max(1);
        let task = tokio::spawn(async move {
            let mut log = ChurnLog {
                size,
                ..ChurnLog::default()
            };
            let mut ticker = tokio::time::interval(pace);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            'writing: for version in 1u64.. {
                for key in 0..keys {
                    ticker.tick().await;
                    if *stopped.borrow() {
                        break 'writing;
                    }
                    log.attempted.insert(key, version);
                    let content = churn_content(key, version, size);
                    match client.put("default", &churn_key(key), &content).await {
                        Ok(_) => {
                            log.acknowledged.insert(key, version);
                            log.puts += 1;
                        }
                        Err(_) => log.failed += 1,
                    }
                }
            }
            log
        });
        Churn { stop, task }
    }

    /// Stops the writer after its put in progress; what it did.
    pub async fn stop(self) -> ChurnLog {
        let _ = self.stop.send(true);
        self.task.await.expect("the churn writer does not panic")
    }
}

impl ChurnLog {
    /// Reads every churn key back (linearizably, after the writer stopped):
    /// each must hold its last acknowledged version or a later attempted
    /// one, with exactly that version's bytes; a key never acknowledged
    /// may be absent.
    pub async fn verify(&self, client: &Client) -> Result<(), String> {
        for (&key, &attempted) in &self.attempted {
            let acknowledged = self.acknowledged.get(&key).copied();
            let bytes = match client.get("default", &churn_key(key)).await {
                Ok(bytes) => bytes,
                Err(e) if e.code() == ErrorCode::NotFound && acknowledged.is_none() => continue,
                Err(e) => {
                    return Err(format!(
                        "churn key {key}: {e} (version {acknowledged:?} acknowledged)"
                    ));
                }
            };
            let version = match bytes.get(4..12) {
                Some(v) => u64::from_le_bytes(v.try_into().expect("8 bytes")),
                None => 0,
            };
            if bytes != churn_content(key, version, self.size) {
                return Err(format!(
                    "churn key {key}: {} bytes that no put wrote (they claim version {version})",
                    bytes.len()
                ));
            }
            if acknowledged.is_some_and(|a| version < a) || version > attempted {
                return Err(format!(
                    "churn key {key}: holds version {version}; acknowledged {acknowledged:?}, attempted up to {attempted}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_differ_by_key_and_version_and_carry_both() {
        let a = churn_content(3, 7, 100);
        assert_eq!(a.len(), 100);
        assert_eq!(u32::from_le_bytes(a[0..4].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(a[4..12].try_into().unwrap()), 7);
        assert_ne!(a, churn_content(3, 8, 100));
        assert_ne!(a[12..], churn_content(4, 7, 100)[12..]);
        assert_eq!(a, churn_content(3, 7, 100));
    }
}
