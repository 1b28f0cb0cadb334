//! The embedded metadata store: the whole state in memory under one lock,
//! optionally saved to a file after every change (dev mode keeps its
//! cluster across restarts). Leases are not saved: keys attached to one
//! are gone after a restart, as they would be once the lease expired.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{
    Compare, KeyValue, LeaseId, MetaError, MetaResult, MetaStore, Op, TxnOutcome, WatchEvent,
};

/// Changes kept for watches that start in the past.
const HISTORY: usize = 10_000;
/// Events a watcher may have unread before it is closed.
const WATCH_BUFFER: usize = 4_096;

#[derive(Clone)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

#[derive(Default)]
struct State {
    revision: u64,
    keys: BTreeMap<String, KeyValue>,
    leases: HashMap<i64, Lease>,
    next_lease: i64,
    history: VecDeque<WatchEvent>,
    /// Lowest revision a watch may start from.
    oldest: u64,
    watchers: Vec<(String, mpsc::Sender<WatchEvent>)>,
}

/// What the file holds.
#[derive(Serialize, Deserialize)]
struct Saved {
    revision: u64,
    keys: Vec<(String, Vec<u8>, u64, u64)>,
}

/// The embedded store.
pub struct EmbeddedStore {
    state: Arc<Mutex<State>>,
    path: Option<PathBuf>,
    /// The `flock`ed `<file>.lock` beside a saved store's file: a second
    /// store on the file would overwrite the first's changes with its own.
    _lock: Option<std::fs::File>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("path", &self.path)
            .finish()
    }
}

fn file_error(path: &Path, e: impl std::fmt::Display) -> MetaError {
    MetaError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Takes the exclusive hold on `<path>.lock` (an `flock`, let go when
/// the file closes, also when the process dies). The store's file itself
/// is replaced on every save, so it cannot carry the lock.
fn lock_beside(path: &Path) -> MetaResult<std::fs::File> {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock_path = PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| file_error(&lock_path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(file_error(
            path,
            "in use by another coordinator (its .lock file is held)",
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(file_error(&lock_path, e)),
    }
}

impl EmbeddedStore {
    /// A store in memory only.
    pub fn in_memory() -> Self {
        Self::with_state(State::default(), None)
    }

    /// A store saved to `path` after every change (created if missing).
    pub fn open(path: &Path) -> MetaResult<Self> {
        let lock = lock_beside(path)?;
        let mut state = State::default();
        match std::fs::read(path) {
            Ok(bytes) => {
                let saved: Saved =
                    serde_json::from_slice(&bytes).map_err(|e| file_error(path, e))?;
                state.revision = saved.revision;
                for (key, value, create_revision, mod_revision) in saved.keys {
                    let kv = KeyValue {
                        key: key.clone(),
                        value,
                        create_revision,
                        mod_revision,
                        lease: None,
                    };
                    state.keys.insert(key, kv);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(file_error(path, e)),
        }
        state.oldest = state.revision + 1;
        let mut store = Self::with_state(state, Some(path.to_path_buf()));
        store._lock = Some(lock);
        Ok(store)
    }

    fn with_state(state: State, path: Option<PathBuf>) -> Self {
        let state = Arc::new(Mutex::new(state));
        // Leases expire on their own when a runtime is there to run the
        // sweeper; every call also expires what is due first.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep(Arc::downgrade(&state)));
        }
        EmbeddedStore {
            state,
            path,
            _lock: None,
        }
    }

    fn save(&self, state: &State) -> MetaResult<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let saved = Saved {
            revision: state.revision,
            keys: state
                .keys
                .values()
                .filter(|kv| kv.lease.is_none())
                .map(|kv| {
                    (
                        kv.key.clone(),
                        kv.value.clone(),
                        kv.create_revision,
                        kv.mod_revision,
                    )
                })
                .collect(),
        };
        let bytes = serde_json::to_vec(&saved).map_err(|e| file_error(path, e))?;
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| file_error(path, e))
    }
}

/// Expires leases every 100 ms while the store exists.
async fn sweep(state: Weak<Mutex<State>>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(state) = state.upgrade() else { return };
        state.lock().expire();
    }
}

impl State {
    /// Deletes the keys of every lease past its deadline, one revision per
    /// lease.
    fn expire(&mut self) {
        let now = Instant::now();
        let due: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.end_lease(id);
        }
    }

    fn end_lease(&mut self, id: i64) {
        let Some(lease) = self.leases.remove(&id) else {
            return;
        };
        let keys: Vec<String> = lease
            .keys
            .into_iter()
            .filter(|k| {
                self.keys
                    .get(k)
                    .is_some_and(|kv| kv.lease == Some(LeaseId(id)))
            })
            .collect();
        if keys.is_empty() {
            return;
        }
        self.revision += 1;
        for key in keys {
            self.keys.remove(&key);
            self.publish(WatchEvent::Delete {
                key,
                mod_revision: self.revision,
            });
        }
    }

    fn holds(&self, compare: &Compare) -> bool {
        match compare {
            Compare::Absent(key) => !self.keys.contains_key(key),
            Compare::ModRevision(key, revision) => self
                .keys
                .get(key)
                .is_some_and(|kv| kv.mod_revision == *revision),
            Compare::Value(key, value) => self.keys.get(key).is_some_and(|kv| kv.value == *value),
        }
    }

    fn publish(&mut self, event: WatchEvent) {
        self.watchers.retain(|(prefix, tx)| {
            !event.key().starts_with(prefix.as_str()) || tx.try_send(event.clone()).is_ok()
        });
        self.history.push_back(event);
        while self.history.len() > HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.oldest = old.revision() + 1;
            }
        }
    }
}

#[tonic::async_trait]
impl MetaStore for EmbeddedStore {
    async fn get(&self, key: &str) -> MetaResult<Option<KeyValue>> {
        let mut state = self.state.lock();
        state.expire();
        Ok(state.keys.get(key).cloned())
    }

    async fn list(&self, prefix: &str) -> MetaResult<Vec<KeyValue>> {
        let mut state = self.state.lock();
        state.expire();
        Ok(state
            .keys
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, kv)| kv.clone())
            .collect())
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> MetaResult<TxnOutcome> {
        let mut state = self.state.lock();
        state.expire();
        if !compares.iter().all(|c| state.holds(c)) {
            return Ok(TxnOutcome {
                succeeded: false,
                revision: state.revision,
            });
        }
        for op in &ops {
            if let Op::Put {
                lease: Some(lease), ..
            } = op
                && !state.leases.contains_key(&lease.0)
            {
                return Err(MetaError::Unavailable(format!(
                    "lease {} has expired or does not exist",
                    lease.0
                )));
            }
        }
        let changes = ops.iter().any(|op| match op {
            Op::Put { .. } => true,
            Op::Delete { key } => state.keys.contains_key(key),
        });
        if !changes {
            return Ok(TxnOutcome {
                succeeded: true,
                revision: state.revision,
            });
        }
        // Applied to the state, then saved; if the save fails the state is
        // put back and nobody hears of the change (before, a failed save
        // left it applied and watched: the caller saw an error for a change
        // the coordinator then acted on, and a restart lost it).
        // (An in-memory store cannot fail to save: nothing to undo.)
        let undo = self
            .path
            .is_some()
            .then(|| (state.revision, state.keys.clone(), state.leases.clone()));
        let mut events = Vec::new();
        state.revision += 1;
        let revision = state.revision;
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    let create_revision = state
                        .keys
                        .get(&key)
                        .map_or(revision, |kv| kv.create_revision);
                    if let Some(old) = state.keys.get(&key).and_then(|kv| kv.lease)
                        && Some(old) != lease
                        && let Some(l) = state.leases.get_mut(&old.0)
                    {
                        l.keys.remove(&key);
                    }
                    if let Some(lease) = lease
                        && let Some(l) = state.leases.get_mut(&lease.0)
                    {
                        l.keys.insert(key.clone());
                    }
                    let kv = KeyValue {
                        key: key.clone(),
                        value,
                        create_revision,
                        mod_revision: revision,
                        lease,
                    };
                    state.keys.insert(key, kv.clone());
                    events.push(WatchEvent::Put(kv));
                }
                Op::Delete { key } => {
                    if state.keys.remove(&key).is_some() {
                        events.push(WatchEvent::Delete {
                            key,
                            mod_revision: revision,
                        });
                    }
                }
            }
        }
        // Saved even when only leased keys changed: the revision must keep
        // growing across restarts.
        if let Err(error) = self.save(&state) {
            if let Some(undo) = undo {
                (state.revision, state.keys, state.leases) = undo;
            }
            return Err(error);
        }
        for event in events {
            state.publish(event);
        }
        Ok(TxnOutcome {
            succeeded: true,
            revision,
        })
    }

    async fn grant_lease(&self, ttl: Duration) -> MetaResult<LeaseId> {
        let mut state = self.state.lock();
        state.next_lease += 1;
        let id = state.next_lease;
        state.leases.insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + ttl,
                keys: BTreeSet::new(),
            },
        );
        Ok(LeaseId(id))
    }

    async fn keep_alive(&self, lease: LeaseId) -> MetaResult<bool> {
        let mut state = self.state.lock();
        state.expire();
        Ok(match state.leases.get_mut(&lease.0) {
            Some(l) => {
                l.deadline = Instant::now() + l.ttl;
                true
            }
            None => false,
        })
    }

    async fn revoke(&self, lease: LeaseId) -> MetaResult<()> {
        let mut state = self.state.lock();
        state.end_lease(lease.0);
        self.save(&state)
    }

    async fn watch(
        &self,
        prefix: &str,
        from_revision: u64,
    ) -> MetaResult<mpsc::Receiver<WatchEvent>> {
        let mut state = self.state.lock();
        state.expire();
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        if from_revision != 0 && from_revision <= state.revision {
            if from_revision < state.oldest {
                return Err(MetaError::Compacted {
                    requested: from_revision,
                    oldest: state.oldest,
                });
            }
            for event in state
                .history
                .iter()
                .filter(|e| e.revision() >= from_revision && e.key().starts_with(prefix))
            {
                if tx.try_send(event.clone()).is_err() {
                    return Err(MetaError::Unavailable(
                        "too much history for one watch; start later".into(),
                    ));
                }
            }
        }
        state.watchers.push((prefix.to_string(), tx));
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A change whose save fails is not made: reads and watchers see the
    /// store as before it, and the next change that saves goes on from
    /// there.
    #[tokio::test]
    async fn a_change_that_cannot_be_saved_is_not_made() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("store");
        std::fs::create_dir(&home).unwrap();
        let store = EmbeddedStore::open(&home.join("metadata.json")).unwrap();
        let put = |value: &[u8]| Op::Put {
            key: "/k".into(),
            value: value.to_vec(),
            lease: None,
        };
        let first = store.txn(vec![], vec![put(b"one")]).await.unwrap();
        let mut events = store.watch("/k", 0).await.unwrap();
        // Nowhere to write the file now.
        std::fs::remove_dir_all(&home).unwrap();
        assert!(store.txn(vec![], vec![put(b"two")]).await.is_err());
        let kv = store.get("/k").await.unwrap().unwrap();
        assert_eq!(kv.value, b"one");
        assert_eq!(kv.mod_revision, first.revision);
        assert!(events.try_recv().is_err(), "nobody heard of the change");
        std::fs::create_dir(&home).unwrap();
        let third = store.txn(vec![], vec![put(b"three")]).await.unwrap();
        assert_eq!(third.revision, first.revision + 1);
        match events.try_recv() {
            Ok(WatchEvent::Put(kv)) => assert_eq!(kv.value, b"three"),
            other => panic!("{other:?}"),
        }
    }
}
