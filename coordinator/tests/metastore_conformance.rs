//! One suite, two metadata stores: the embedded one and a real etcd
//! (Debian's `etcd-server`, started on free ports). Whatever the
//! coordinator relies on — revisions, compare-and-swap transactions,
//! leases, ordered watches from a revision — must behave the same on both.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{
    Compare, EmbeddedStore, EtcdStore, MetaError, MetaStore, Op, WatchEvent,
};
use tidepool_testkit::EtcdServer;

fn put(key: &str, value: &[u8]) -> Op {
    Op::Put {
        key: key.into(),
        value: value.to_vec(),
        lease: None,
    }
}

async fn keys_and_revisions(store: &dyn MetaStore) {
    assert_eq!(store.get("/t/a").await.unwrap(), None);
    let r1 = store.put("/t/b", b"2".to_vec()).await.unwrap();
    let r2 = store.put("/t/a", b"1".to_vec()).await.unwrap();
    let r3 = store.put("/u/c", b"3".to_vec()).await.unwrap();
    assert!(r1 < r2 && r2 < r3, "revisions grow: {r1} {r2} {r3}");
    let a = store.get("/t/a").await.unwrap().unwrap();
    assert_eq!(
        (a.value.as_slice(), a.mod_revision, a.create_revision),
        (&b"1"[..], r2, r2)
    );
    let listed: Vec<String> = store
        .list("/t/")
        .await
        .unwrap()
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(listed, vec!["/t/a", "/t/b"], "prefix, in key order");

    let r4 = store.put("/t/a", b"1'".to_vec()).await.unwrap();
    let a = store.get("/t/a").await.unwrap().unwrap();
    assert_eq!(
        (a.mod_revision, a.create_revision),
        (r4, r2),
        "create revision stays"
    );
    let r5 = store.delete("/t/b").await.unwrap();
    assert!(r5 > r4);
    assert_eq!(store.get("/t/b").await.unwrap(), None);
    assert_eq!(store.list("/t/").await.unwrap().len(), 1);
}

async fn transactions_compare_and_swap(store: &dyn MetaStore) {
    // Create only if absent: exactly one of two racers wins.
    let first = store
        .txn(
            vec![Compare::Absent("/cas/map".into())],
            vec![put("/cas/map", b"v1")],
        )
        .await
        .unwrap();
    let second = store
        .txn(
            vec![Compare::Absent("/cas/map".into())],
            vec![put("/cas/map", b"other")],
        )
        .await
        .unwrap();
    assert!(first.succeeded && !second.succeeded);
    assert_eq!(
        second.revision, first.revision,
        "a failed txn changes nothing"
    );
    let map = store.get("/cas/map").await.unwrap().unwrap();
    assert_eq!(map.value, b"v1");

    // Swap on the revision read; a stale revision fails and writes nothing.
    let swapped = store
        .txn(
            vec![Compare::ModRevision("/cas/map".into(), map.mod_revision)],
            vec![put("/cas/map", b"v2"), put("/cas/version", b"2")],
        )
        .await
        .unwrap();
    assert!(swapped.succeeded);
    let stale = store
        .txn(
            vec![Compare::ModRevision("/cas/map".into(), map.mod_revision)],
            vec![put("/cas/map", b"v3"), put("/cas/version", b"3")],
        )
        .await
        .unwrap();
    assert!(!stale.succeeded);
    assert_eq!(store.get("/cas/map").await.unwrap().unwrap().value, b"v2");
    assert_eq!(
        store.get("/cas/version").await.unwrap().unwrap().value,
        b"2"
    );
    // Both keys changed in one revision.
    assert_eq!(
        store
            .get("/cas/version")
            .await
            .unwrap()
            .unwrap()
            .mod_revision,
        swapped.revision
    );

    // Every comparison must hold (a fencing token and the map together).
    store.put("/cas/leader", b"gen-7".to_vec()).await.unwrap();
    let fenced = store
        .txn(
            vec![
                Compare::Value("/cas/leader".into(), b"gen-6".to_vec()),
                Compare::ModRevision("/cas/map".into(), swapped.revision),
            ],
            vec![put("/cas/map", b"from a deposed leader")],
        )
        .await
        .unwrap();
    assert!(!fenced.succeeded);
    let allowed = store
        .txn(
            vec![
                Compare::Value("/cas/leader".into(), b"gen-7".to_vec()),
                Compare::ModRevision("/cas/map".into(), swapped.revision),
            ],
            vec![
                put("/cas/map", b"v3"),
                Op::Delete {
                    key: "/cas/version".into(),
                },
            ],
        )
        .await
        .unwrap();
    assert!(allowed.succeeded);
    assert_eq!(store.get("/cas/version").await.unwrap(), None);
}

async fn wait_gone(store: &dyn MetaStore, key: &str, within: Duration) {
    let start = Instant::now();
    while store.get(key).await.unwrap().is_some() {
        assert!(start.elapsed() < within, "{key} outlived its lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn leases(store: &dyn MetaStore) {
    let lease = store.grant_lease(Duration::from_secs(2)).await.unwrap();
    let op = |key: &str| Op::Put {
        key: key.into(),
        value: b"alive".to_vec(),
        lease: Some(lease),
    };
    assert!(
        store
            .txn(vec![], vec![op("/nodes/1"), op("/nodes/2")])
            .await
            .unwrap()
            .succeeded
    );
    assert_eq!(
        store.get("/nodes/1").await.unwrap().unwrap().lease,
        Some(lease)
    );
    // Kept alive past its TTL, it stays.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(store.keep_alive(lease).await.unwrap());
    }
    assert!(store.get("/nodes/1").await.unwrap().is_some());
    // Left alone, it expires with its keys (etcd may take a little longer
    // than the TTL).
    wait_gone(store, "/nodes/2", Duration::from_secs(15)).await;
    assert_eq!(store.get("/nodes/1").await.unwrap(), None);
    assert!(
        !store.keep_alive(lease).await.unwrap(),
        "an expired lease is not renewed"
    );

    // Revoking deletes at once; revoking again is fine.
    let lease = store.grant_lease(Duration::from_secs(60)).await.unwrap();
    let key = Op::Put {
        key: "/nodes/3".into(),
        value: b"x".to_vec(),
        lease: Some(lease),
    };
    store.txn(vec![], vec![key]).await.unwrap();
    store.revoke(lease).await.unwrap();
    assert_eq!(store.get("/nodes/3").await.unwrap(), None);
    store.revoke(lease).await.unwrap();
}

async fn next(rx: &mut tokio::sync::mpsc::Receiver<WatchEvent>) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a watch event within 10 s")
        .expect("the watch is open")
}

async fn watches(store: &dyn MetaStore) {
    let start = store.put("/w/a", b"1".to_vec()).await.unwrap();
    store.put("/other", b"not watched".to_vec()).await.unwrap();
    store.put("/w/b", b"2".to_vec()).await.unwrap();
    // From a past revision: the history, then what comes next, in order.
    let mut from_past = store.watch("/w/", start).await.unwrap();
    let mut from_now = store.watch("/w/", 0).await.unwrap();
    store.delete("/w/a").await.unwrap();
    let r = store.put("/w/c", b"3".to_vec()).await.unwrap();

    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(next(&mut from_past).await);
    }
    let keys: Vec<(&str, bool)> = seen
        .iter()
        .map(|e| (e.key(), matches!(e, WatchEvent::Put(_))))
        .collect();
    assert_eq!(
        keys,
        vec![
            ("/w/a", true),
            ("/w/b", true),
            ("/w/a", false),
            ("/w/c", true)
        ]
    );
    assert!(seen.windows(2).all(|w| w[0].revision() < w[1].revision()));
    assert_eq!(seen[3].revision(), r);

    let live = [next(&mut from_now).await, next(&mut from_now).await];
    assert_eq!((live[0].key(), live[1].key()), ("/w/a", "/w/c"));
    assert!(matches!(live[0], WatchEvent::Delete { .. }));
}

async fn suite(store: Arc<dyn MetaStore>) {
    keys_and_revisions(store.as_ref()).await;
    transactions_compare_and_swap(store.as_ref()).await;
    watches(store.as_ref()).await;
    leases(store.as_ref()).await;
}

#[tokio::test]
async fn embedded_store_conforms() {
    suite(Arc::new(EmbeddedStore::in_memory())).await;
}

#[tokio::test]
async fn etcd_store_conforms() {
    let etcd = EtcdServer::start();
    let store = EtcdStore::connect(std::slice::from_ref(&etcd.url), None)
        .await
        .unwrap();
    suite(Arc::new(store)).await;
}

#[tokio::test]
async fn embedded_store_keeps_its_keys_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.json");
    let revision = {
        let store = EmbeddedStore::open(&path).unwrap();
        store.put("/map", b"v1".to_vec()).await.unwrap();
        let lease = store.grant_lease(Duration::from_secs(60)).await.unwrap();
        let ephemeral = Op::Put {
            key: "/nodes/1".into(),
            value: b"alive".to_vec(),
            lease: Some(lease),
        };
        store.txn(vec![], vec![ephemeral]).await.unwrap().revision
    };
    let store = EmbeddedStore::open(&path).unwrap();
    // One store per file: a second would overwrite the first's changes.
    match EmbeddedStore::open(&path) {
        Err(MetaError::File { message, .. }) => assert!(message.contains("in use"), "{message}"),
        other => panic!("a second store opened a file in use: {other:?}"),
    }
    let map = store.get("/map").await.unwrap().unwrap();
    assert_eq!(map.value, b"v1");
    assert_eq!(
        store.get("/nodes/1").await.unwrap(),
        None,
        "leased keys do not survive"
    );
    let next = store.put("/map", b"v2".to_vec()).await.unwrap();
    assert!(next > revision, "revisions keep growing across restarts");
    // History before the restart is gone; a watch from there says so.
    assert!(matches!(
        store.watch("/", map.mod_revision).await,
        Err(MetaError::Compacted { .. })
    ));
    std::fs::write(&path, b"not json").unwrap();
    assert!(matches!(
        EmbeddedStore::open(&path),
        Err(MetaError::File { .. })
    ));
}
