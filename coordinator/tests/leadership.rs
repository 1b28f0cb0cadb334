//! Leadership and fencing on both metadata stores (etcd real): one of two
//! coordinators leads; the other cannot change the map; a leader whose
//! key was replaced behind its back (as when its lease expired and another
//! won) cannot write either, however it still believes it leads; the new
//! leader can; a leader that stops resigns so the other takes over at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{
    Compare, EmbeddedStore, EtcdStore, KeyValue, LeaseId, MetaResult, MetaStore, Op, TxnOutcome,
    WatchEvent,
};
use tidepool_coordinator::{CoordinatorConfig, CoordinatorError, Shared};
use tidepool_testkit::EtcdServer;
use tokio::sync::watch;

fn config(lease_ms: u64) -> CoordinatorConfig {
    CoordinatorConfig {
        leader_lease_ms: lease_ms,
        key_prefix: "/lead/".into(),
        ..CoordinatorConfig::default()
    }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn bump(shared: &Shared) -> Result<u64, CoordinatorError> {
    shared
        .update_map(|map| {
            map.replication_factor += 1;
            Ok(Some(Vec::new()))
        })
        .await
        .map(|m| m.version)
}

async fn fencing(store: Arc<dyn MetaStore>) {
    // a renews (and rechecks its key) only every 10 s: it will not notice
    // being deposed during the test, so only the fence can stop it.
    let a = Shared::new(
        config(60_000),
        "a".into(),
        "http://a".into(),
        store.clone(),
        Default::default(),
    );
    let b = Shared::new(
        config(1_000),
        "b".into(),
        "http://b".into(),
        store.clone(),
        Default::default(),
    );
    a.ensure_cluster().await.unwrap();
    b.ensure_cluster().await.unwrap();
    let (stop_a, stop_a_rx) = watch::channel(false);
    let (stop_b, stop_b_rx) = watch::channel(false);
    tokio::spawn(a.clone().campaign(stop_a_rx));
    until("a to lead", || a.leadership().is_some()).await;
    tokio::spawn(b.clone().campaign(stop_b_rx));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(b.leadership().is_none(), "one leader at a time");

    let v1 = bump(&a).await.unwrap();
    assert!(matches!(bump(&b).await, Err(CoordinatorError::NotLeader)));

    // Depose a behind its back: its key goes, b wins and writes.
    store.delete(&a.keys.leader()).await.unwrap();
    until("b to lead", || b.leadership().is_some()).await;
    assert!(a.leadership().is_some(), "a has not noticed yet");
    let v2 = bump(&b).await.unwrap();
    assert_eq!(v2, v1 + 1);
    // Whatever a believes, its write is refused and changes nothing.
    let result = bump(&a).await;
    assert!(
        matches!(result, Err(CoordinatorError::NotLeader)),
        "{result:?}"
    );
    assert!(a.leadership().is_none(), "a stepped down");
    let stored = store.get(&a.keys.map()).await.unwrap().unwrap();
    let map = tidepool_coordinator::schema::decode_map(&stored.value).unwrap();
    assert_eq!(map.version, v2);

    // A leader that stops resigns: c takes over well before b's lease
    // would have expired.
    let c = Shared::new(
        config(1_000),
        "c".into(),
        "http://c".into(),
        store.clone(),
        Default::default(),
    );
    let (stop_c, stop_c_rx) = watch::channel(false);
    tokio::spawn(c.clone().campaign(stop_c_rx));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(c.leadership().is_none());
    let stopped = Instant::now();
    stop_b.send_replace(true);
    until("c to lead", || c.leadership().is_some()).await;
    assert!(
        stopped.elapsed() < Duration::from_millis(900),
        "{:?}",
        stopped.elapsed()
    );
    assert!(b.leadership().is_none());
    stop_a.send_replace(true);
    stop_c.send_replace(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_on_the_embedded_store() {
    fencing(Arc::new(EmbeddedStore::in_memory())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_on_etcd() {
    let etcd = EtcdServer::start();
    let store = EtcdStore::connect(std::slice::from_ref(&etcd.url), None)
        .await
        .unwrap();
    fencing(Arc::new(store)).await;
}

/// The embedded store, with lease renewals that can be made to hang (as
/// etcd's do when it stops answering one coordinator), and transactions
/// that can be made slow (`slow_txn_ms`).
struct HangingRenewals {
    inner: EmbeddedStore,
    hang: std::sync::atomic::AtomicBool,
    slow_txn_ms: std::sync::atomic::AtomicU64,
}

#[tonic::async_trait]
impl MetaStore for HangingRenewals {
    async fn get(&self, key: &str) -> MetaResult<Option<KeyValue>> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> MetaResult<Vec<KeyValue>> {
        self.inner.list(prefix).await
    }
    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> MetaResult<TxnOutcome> {
        let slow = self.slow_txn_ms.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(slow)).await;
        self.inner.txn(compares, ops).await
    }
    async fn grant_lease(&self, ttl: Duration) -> MetaResult<LeaseId> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> MetaResult<bool> {
        if self.hang.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.keep_alive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> MetaResult<()> {
        self.inner.revoke(lease).await
    }
    async fn watch(
        &self,
        prefix: &str,
        from_revision: u64,
    ) -> MetaResult<tokio::sync::mpsc::Receiver<WatchEvent>> {
        self.inner.watch(prefix, from_revision).await
    }
}

/// A leader whose lease renewals get no answer steps down before its
/// lease can expire (so before another coordinator can win): before, it
/// waited on the renewal for as long as the store client let it (10 s for
/// etcd, longer than the lease), and for ever on a renewal that hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_renewals_hang_steps_down_within_its_lease() {
    const LEASE: Duration = Duration::from_millis(3_000);
    let store = Arc::new(HangingRenewals {
        inner: EmbeddedStore::in_memory(),
        hang: std::sync::atomic::AtomicBool::new(false),
        slow_txn_ms: Default::default(),
    });
    let a = Shared::new(
        config(LEASE.as_millis() as u64),
        "a".into(),
        "http://a".into(),
        store.clone(),
        Default::default(),
    );
    a.ensure_cluster().await.unwrap();
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(a.clone().campaign(stop_rx));
    until("a to lead", || a.leadership().is_some()).await;
    // Renewed a few times first.
    tokio::time::sleep(LEASE).await;
    assert!(
        a.leadership().is_some(),
        "renewals that answer keep it leading"
    );
    let led = a.leadership().map(|l| l.generation);
    store.hang.store(true, std::sync::atomic::Ordering::SeqCst);
    let hung = Instant::now();
    // Stepped down: not leading, or leading again under a new election.
    until("a to step down", || {
        a.leadership().map(|l| l.generation) != led
    })
    .await;
    let took = hung.elapsed();
    println!("stepped down {took:?} after renewals began to hang (lease {LEASE:?})");
    assert!(
        took < LEASE,
        "stepped down only after {took:?}, its lease being {LEASE:?}"
    );
    stop.send_replace(true);
}

/// A coordinator that wins the leader key only after half its lease went
/// by (the store slow to take the key) does not lead on that lease, which
/// another could win before its first renewal; it leads once the store
/// answers in time. Before, its lease was counted from when it began to
/// lead, after the win and the nodes' maps were asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_win_that_took_half_the_lease_is_given_back() {
    const LEASE: Duration = Duration::from_millis(2_000);
    let store = Arc::new(HangingRenewals {
        inner: EmbeddedStore::in_memory(),
        hang: std::sync::atomic::AtomicBool::new(false),
        slow_txn_ms: Default::default(),
    });
    let a = Shared::new(
        config(LEASE.as_millis() as u64),
        "a".into(),
        "http://a".into(),
        store.clone(),
        Default::default(),
    );
    a.ensure_cluster().await.unwrap();
    store
        .slow_txn_ms
        .store(1_200, std::sync::atomic::Ordering::SeqCst);
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(a.clone().campaign(stop_rx));
    let watching = Instant::now();
    while watching.elapsed() < LEASE * 2 {
        assert!(
            a.leadership().is_none(),
            "led on a lease more than half gone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    store
        .slow_txn_ms
        .store(0, std::sync::atomic::Ordering::SeqCst);
    until("a to lead", || a.leadership().is_some()).await;
    stop.send_replace(true);
}

/// A cluster follows its own map key only: another cluster sharing the
/// store under a longer key prefix (`/lead/map-b/` beside `/lead/`) writes
/// a map under a key the first's watch also covers. Before, the first
/// cluster took that map for its own once its version was higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_follows_only_its_own_map() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let a = Shared::new(
        config(1_000),
        "a".into(),
        "http://a".into(),
        store.clone(),
        Default::default(),
    );
    let b = Shared::new(
        CoordinatorConfig {
            key_prefix: "/lead/map-b/".into(),
            ..config(1_000)
        },
        "b".into(),
        "http://b".into(),
        store.clone(),
        Default::default(),
    );
    a.ensure_cluster().await.unwrap();
    b.ensure_cluster().await.unwrap();
    a.load_map().await.unwrap();
    b.load_map().await.unwrap();
    let own = a.map().cluster_id.clone();
    assert_ne!(b.map().cluster_id, own);
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(a.clone().follow_map(stop_rx.clone()));
    tokio::spawn(b.clone().campaign(stop_rx));
    until("b to lead", || b.leadership().is_some()).await;
    // b's leader key is under a's watch too (and was no map): a's watch
    // starts again after a pause; b's map changes come once it has.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut version = 0;
    for _ in 0..3 {
        version = bump(&b).await.unwrap();
    }
    assert!(version > a.map().version);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.map().cluster_id, own, "a took b's map for its own");
    stop.send_replace(true);
}
