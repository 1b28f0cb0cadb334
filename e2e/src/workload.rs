//! The workload: concurrent clients doing puts, gets, batch-exists,
//! deletes and touches on a small set of keys (so they contend), each
//! operation recorded with its invocation and completion time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_client::{Client, ErrorCode};
use tokio::sync::watch;

use crate::history::{Event, Nanos, Op, Status};

/// Shape of the load.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Concurrent clients.
    pub clients: usize,
    /// Distinct keys.
    pub keys: u32,
    /// Deadline of each operation (retries included).
    pub op_timeout: Duration,
    /// The SDK's hedge delay (`ClientConfig::hedge_after`): an attempt
    /// unanswered this long runs on while the operation tries another
    /// replica. Default: the SDK's.
    pub hedge_after: Option<Duration>,
    /// Seed of every client's choices.
    pub seed: u64,
    /// Least time between the starts of one client's operations (`None`:
    /// back to back). A paced workload's load does not depend on how fast
    /// the host is.
    pub pace: Option<Duration>,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            clients: 6,
            keys: 24,
            op_timeout: Duration::from_secs(5),
            hedge_after: Some(tidepool_client::DEFAULT_HEDGE_AFTER),
            seed: 1,
            pace: None,
        }
    }
}

/// What the clients did.
#[derive(Debug)]
pub struct Recorder {
    start: Instant,
    events: Mutex<Vec<Event>>,
    errors: Mutex<BTreeMap<String, u64>>,
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
            events: Mutex::new(Vec::new()),
            errors: Mutex::new(BTreeMap::new()),
        })
    }

    /// Nanoseconds since the start.
    pub fn now(&self) -> Nanos {
        self.start.elapsed().as_nanos() as Nanos
    }

    fn record(&self, event: Event) {
        if let Status::Failed(code) = &event.status {
            *self.errors.lock().entry(code.clone()).or_default() += 1;
        }
        self.events.lock().push(event);
    }

    /// Every event so far.
    pub fn history(&self) -> Vec<Event> {
        self.events.lock().clone()
    }

    /// Failed operations by error code.
    pub fn errors(&self) -> BTreeMap<String, u64> {
        self.errors.lock().clone()
    }

    /// The longest stretch in `[from, to]` without a completed
    /// acknowledged write, in seconds.
    pub fn longest_write_gap(&self, from: Nanos, to: Nanos) -> f64 {
        longest_write_gap(&self.events.lock(), from, to)
    }

    /// Acknowledged operations.
    pub fn acknowledged(&self) -> usize {
        self.events
            .lock()
            .iter()
            .filter(|e| e.status == Status::Ok)
            .count()
    }
}

/// The longest stretch in `[from, to]` of `history` without a completed
/// acknowledged write (put or delete), in seconds.
pub fn longest_write_gap(history: &[Event], from: Nanos, to: Nanos) -> f64 {
    longest_write_gap_at(history, from, to).0
}

/// [`longest_write_gap`], and when that stretch began.
pub fn longest_write_gap_at(history: &[Event], from: Nanos, to: Nanos) -> (f64, Nanos) {
    let mut done: Vec<Nanos> = history
        .iter()
        .filter(|e| matches!(e.op, Op::Put(_) | Op::Delete(_)) && e.status == Status::Ok)
        .map(|e| e.completed)
        .filter(|t| *t >= from && *t <= to)
        .collect();
    done.sort_unstable();
    done.push(to);
    let (mut last, mut gap, mut at) = (from, 0, from);
    for t in done {
        if t - last > gap {
            (gap, at) = (t - last, last);
        }
        last = t;
    }
    (gap as f64 / 1e9, at)
}

/// The content a put of value `id` writes: the id, then bytes derived from
/// it (so a read of anything else is recognised).
pub fn content(id: u64) -> Vec<u8> {
    let len = 16 + (id % 997) as usize;
    let mut bytes = id.to_le_bytes().to_vec();
    bytes.extend((0..len).map(|i| (id as usize).wrapping_mul(31).wrapping_add(i) as u8));
    bytes
}

/// The value id a read returned, or `u64::MAX - 1` for bytes no put
/// wrote.
fn decode(bytes: &[u8]) -> u64 {
    if bytes.len() < 8 {
        return u64::MAX - 1;
    }
    let id = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if content(id) == bytes {
        id
    } else {
        u64::MAX - 1
    }
}

/// The name the workload stores key number `key` under.
pub fn key_name(key: u32) -> Vec<u8> {
    format!("e2e-key-{key}").into_bytes()
}

fn failed(error: &tidepool_client::Error) -> Status {
    // The first few failures whole (the report counts codes only): what
    // a failed scenario's output needs to tell why.
    static PRINTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if PRINTED.fetch_add(1, Ordering::Relaxed) < 20 {
        eprintln!("workload: an operation failed: {error}");
    }
    Status::Failed(error.code().as_str_name().to_string())
}

/// Runs the clients until `stop` turns true.
pub async fn run(
    client: Client,
    workload: Workload,
    recorder: Arc<Recorder>,
    stop: watch::Receiver<bool>,
) {
    let client = client
        .with_timeout(workload.op_timeout)
        .with_hedge_after(workload.hedge_after);
    let mut tasks = Vec::new();
    for c in 0..workload.clients {
        // Each client counts its own attempts.
        let counter = Arc::new(AtomicU64::new(0));
        let client = client.counting_attempts(counter.clone());
        let recorder = recorder.clone();
        let stop = stop.clone();
        let workload = workload.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng =
                SmallRng::seed_from_u64(workload.seed ^ (c as u64).wrapping_mul(0x9e37_79b9));
            let mut seq = 0u64;
            let mut last_start: Option<tokio::time::Instant> = None;
            while !*stop.borrow() {
                if let Some(pace) = workload.pace {
                    if let Some(last) = last_start {
                        tokio::time::sleep_until(last + pace).await;
                    }
                    last_start = Some(tokio::time::Instant::now());
                }
                let key = rng.random_range(0..workload.keys);
                let name = key_name(key);
                let invoked = recorder.now();
                let attempts_before = counter.load(Ordering::Relaxed);
                let attempts = || (counter.load(Ordering::Relaxed) - attempts_before) as u32;
                let roll = rng.random_range(0..100);
                let (op, status) = if roll < 40 {
                    seq += 1;
                    let id = ((c as u64) << 40) | seq;
                    let status = match client.put("default", &name, &content(id)).await {
                        Ok(_) => Status::Ok,
                        Err(e) => failed(&e),
                    };
                    (Op::Put(id), status)
                } else if roll < 75 {
                    match client.get("default", &name).await {
                        Ok(bytes) => (Op::Read(Some(decode(&bytes))), Status::Ok),
                        Err(e) if e.code() == ErrorCode::NotFound => (Op::Read(None), Status::Ok),
                        Err(e) => (Op::Read(None), failed(&e)),
                    }
                } else if roll < 85 {
                    // batch-exists of this key and two others: record each.
                    let others = [
                        key,
                        rng.random_range(0..workload.keys),
                        rng.random_range(0..workload.keys),
                    ];
                    let names: Vec<Vec<u8>> = others.iter().map(|k| key_name(*k)).collect();
                    let result = client.batch_exists("default", &names).await;
                    let completed = recorder.now();
                    for (i, k) in others.iter().enumerate() {
                        let (op, status) = match &result {
                            Ok(present) => (Op::Exists(present[i]), Status::Ok),
                            Err(e) => (Op::Exists(false), failed(e)),
                        };
                        recorder.record(Event {
                            client: c,
                            key: *k,
                            op,
                            invoked,
                            completed,
                            status,
                            attempts: attempts(),
                        });
                    }
                    continue;
                } else if roll < 95 {
                    match client.delete("default", &name).await {
                        Ok(existed) => (Op::Delete(Some(existed)), Status::Ok),
                        Err(e) => (Op::Delete(None), failed(&e)),
                    }
                } else {
                    match client.touch("default", &name).await {
                        Ok(_) => (Op::Exists(true), Status::Ok),
                        Err(e) if e.code() == ErrorCode::NotFound => {
                            (Op::Exists(false), Status::Ok)
                        }
                        Err(e) => (Op::Exists(false), failed(&e)),
                    }
                };
                let completed = recorder.now();
                recorder.record(Event {
                    client: c,
                    key,
                    op,
                    invoked,
                    completed,
                    status,
                    attempts: attempts(),
                });
            }
        }));
    }
    for task in tasks {
        // A client that panicked (a bug in the workload or the SDK) fails
        // the run; its operations were missing from the history.
        task.await.expect("a workload client panicked");
    }
}

/// How long the read-back may go on retrying a key that fails to read.
pub const READ_BACK_PATIENCE: Duration = Duration::from_secs(60);

/// After the clients stopped: a read of every key, recorded as client
/// `workload.clients` — so a write acknowledged just before the end that
/// no client read again is checked too. A read that fails is recorded and
/// tried again (the cluster may still be settling) until one answers or
/// [`READ_BACK_PATIENCE`] has passed; returns the keys no read answered.
/// A failed read says nothing of the key, so the checkers leave it out:
/// a key whose every read failed would hide a lost write.
pub async fn read_back(client: &Client, workload: &Workload, recorder: &Recorder) -> Vec<u32> {
    let client = client.clone().with_timeout(workload.op_timeout);
    let deadline = tokio::time::Instant::now() + READ_BACK_PATIENCE;
    let mut unread = Vec::new();
    for key in 0..workload.keys {
        loop {
            let invoked = recorder.now();
            let (op, status) = match client.get("default", &key_name(key)).await {
                Ok(bytes) => (Op::Read(Some(decode(&bytes))), Status::Ok),
                Err(e) if e.code() == ErrorCode::NotFound => (Op::Read(None), Status::Ok),
                Err(e) => (Op::Read(None), failed(&e)),
            };
            let answered = status == Status::Ok;
            recorder.record(Event {
                client: workload.clients,
                key,
                op,
                invoked,
                completed: recorder.now(),
                status,
                attempts: 0,
            });
            if answered {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                unread.push(key);
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    unread
}
