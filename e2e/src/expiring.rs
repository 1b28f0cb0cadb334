//! Expiring writes: one writer storing new blobs in a namespace that keeps
//! one epoch (`scratch`), so that advancing the cluster epoch orders drops
//! (`docs/design/epochs-cluster.md`) that delete its blobs from segments
//! they share with durable data — under whatever faults a scenario
//! injects. The durable data is checked by the scenario's own checks (the
//! histories, the listing, the churn); this writer checks its own side:
//! every blob written since the last drop was applied everywhere is there
//! with its own bytes (checked before each advance and at the end), and
//! every blob written before an advance is gone once its drop applied.
//!
//! Why that is exact: once every shard has applied the drop below epoch
//! `c` (the scenario waits for it, `Expiring::applied`), every shard is at
//! epoch `c`, so a put that begins afterwards is stamped `c` or later, and
//! in a namespace that keeps one epoch it is dropped only once the cluster
//! reaches `c + 1` — which the scenario announces first
//! (`Expiring::advancing`). Puts under way across either call are not
//! counted.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tidepool_client::{Client, ErrorCode, RetentionPolicy};
use tokio::sync::watch;

/// The namespace (one epoch kept).
pub const NAMESPACE: &str = "scratch";

#[derive(Debug, Default)]
struct State {
    /// Changes at every `advancing` and `applied`.
    generation: u64,
    /// Between `advancing` and `applied`: a drop may be under way.
    dropping: bool,
    /// Keys acknowledged in the current generation, outside a drop.
    current: Vec<Vec<u8>>,
    puts: u64,
    failed: u64,
}

/// What the writer did.
#[derive(Debug)]
pub struct ExpiringLog {
    /// Puts acknowledged.
    pub puts: u64,
    /// Puts that failed.
    pub failed: u64,
    /// Keys acknowledged since the last drop was applied: all must be
    /// readable.
    pub current: Vec<Vec<u8>>,
}

/// The writer, running.
pub struct Expiring {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    state: Arc<Mutex<State>>,
}

impl Expiring {
    /// Creates the namespace and starts writing blobs of `size` bytes, at
    /// most `per_second` a second, each put with `timeout`.
    pub async fn start(
        client: Client,
        size: usize,
        per_second: u32,
        timeout: Duration,
    ) -> Expiring {
        client
            .create_namespace(NAMESPACE, false, RetentionPolicy::Epochs(1))
            .await
            .expect("the expiring namespace");
        let (stop, stopped) = watch::channel(false);
        let state = Arc::new(Mutex::new(State::default()));
        let client = client.with_timeout(timeout);
        let pace = Duration::from_secs(1) / per_second.max(1);
        let shared = state.clone();
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(pace);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for n in 0u64.. {
                ticker.tick().await;
                if *stopped.borrow() {
                    break;
                }
                let key = format!("scratch-{n}").into_bytes();
                let value = value_of(&key, size);
                let began = {
                    let s = shared.lock();
                    (s.generation, s.dropping)
                };
                let result = client.put(NAMESPACE, &key, &value).await;
                let mut s = shared.lock();
                match result {
                    Ok(_) => {
                        s.puts += 1;
                        if began == (s.generation, false) {
                            s.current.push(key);
                        }
                    }
                    Err(_) => s.failed += 1,
                }
            }
        });
        Expiring { stop, task, state }
    }

    /// The cluster epoch is about to advance: what is written from now on
    /// may be dropped. Returns the keys acknowledged since the last drop
    /// applied (to be gone once this one is).
    pub fn advancing(&self) -> Vec<Vec<u8>> {
        let mut s = self.state.lock();
        s.generation += 1;
        s.dropping = true;
        std::mem::take(&mut s.current)
    }

    /// The keys acknowledged since the last drop applied, so far.
    pub fn current(&self) -> Vec<Vec<u8>> {
        self.state.lock().current.clone()
    }

    /// Every shard has applied the drop that followed the advance.
    pub fn applied(&self) {
        let mut s = self.state.lock();
        s.generation += 1;
        s.dropping = false;
        s.current.clear();
    }

    /// Stops the writer after its put in progress.
    pub async fn stop(self) -> ExpiringLog {
        let _ = self.stop.send(true);
        self.task.await.expect("the expiring writer does not panic");
        let mut s = self.state.lock();
        ExpiringLog {
            puts: s.puts,
            failed: s.failed,
            current: std::mem::take(&mut s.current),
        }
    }
}

impl ExpiringLog {
    /// Every blob written since the last drop was applied is readable.
    pub async fn verify(&self, client: &Client) -> Result<(), String> {
        verify_present(client, &self.current).await
    }
}

/// A blob's bytes: its key, repeated to `size` bytes (so a read that
/// returns another key's blob is caught).
fn value_of(key: &[u8], size: usize) -> Vec<u8> {
    key.iter()
        .copied()
        .cycle()
        .take(size.max(key.len()))
        .collect()
}

/// Each of `keys` holds its own blob. Read failures are retried for a
/// while (the cluster may be settling after a fault).
async fn verify_present(client: &Client, keys: &[Vec<u8>]) -> Result<(), String> {
    for key in keys {
        let name = String::from_utf8_lossy(key);
        let mut tries = 0;
        loop {
            tries += 1;
            match client.get(NAMESPACE, key).await {
                Ok(bytes) if bytes == value_of(key, bytes.len()) && bytes.len() >= key.len() => {
                    break;
                }
                Ok(bytes) => {
                    return Err(format!(
                        "{name} holds {} bytes that are not its blob",
                        bytes.len()
                    ));
                }
                Err(e) if e.code() == ErrorCode::NotFound => {
                    return Err(format!(
                        "{name} was written after the last drop and is gone"
                    ));
                }
                Err(e) if tries < 30 => {
                    eprintln!("expiring: reading {name} failed ({e}); again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(format!("{name}: {e}")),
            }
        }
    }
    Ok(())
}

/// Each of `keys` is gone (their epoch's drop applied everywhere). A key
/// still read is asked again for a while (a split's new group not yet in
/// the map when the drop was reported done applies it once published);
/// one that stays is a blob that survived its drop.
async fn verify_gone(client: &Client, keys: &[Vec<u8>]) -> Result<(), String> {
    for key in keys {
        let name = String::from_utf8_lossy(key);
        let mut tries = 0;
        loop {
            tries += 1;
            match client.get(NAMESPACE, key).await {
                Err(e) if e.code() == ErrorCode::NotFound => break,
                Ok(_) if tries < 30 => {
                    eprintln!("expiring: {name} is still there after its drop; again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(_) => {
                    return Err(format!(
                        "{name} was written before the epoch advanced and survived its drop"
                    ));
                }
                Err(e) if tries < 30 => {
                    eprintln!("expiring: reading {name} failed ({e}); again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(format!("{name}: {e}")),
            }
        }
    }
    Ok(())
}

/// Advances the cluster epoch (announcing it to `expiring` first) and
/// waits until every shard has applied the drop of [`NAMESPACE`] that
/// follows, at most `timeout`; then tells `expiring`. Returns the new
/// epoch.
pub async fn advance_and_drop(
    cluster: &crate::cluster::Cluster,
    admin: &Client,
    expiring: &Expiring,
    timeout: Duration,
) -> u64 {
    // What was written since the last drop is there now, and will be gone
    // once the drop that follows this advance applied everywhere.
    if let Err(e) = verify_present(admin, &expiring.current()).await {
        panic!("expiring blobs before an advance: {e}");
    }
    let doomed = expiring.advancing();
    let epoch = admin.advance_epoch(None).await.expect("advance the epoch");
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let status = cluster.status().await;
        let done = status
            .as_ref()
            .and_then(|s| s.epochs.as_ref())
            .is_some_and(|e| {
                e.namespaces.iter().any(|n| {
                    n.namespace == NAMESPACE
                        && n.drop_below >= epoch
                        && n.shards_done == n.shards_total
                })
            });
        if done {
            expiring.applied();
            if let Err(e) = verify_gone(admin, &doomed).await {
                panic!("expiring blobs after their drop: {e}");
            }
            return epoch;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the drop below epoch {epoch} was not applied everywhere in {timeout:?}: {:?}\n{}",
            status.and_then(|s| s.epochs),
            cluster.log_tails()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
