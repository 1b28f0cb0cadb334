//! The etcd-backed metadata store (etcd v3 API through `etcd-client`).
//! Keys are UTF-8 strings; revisions are etcd's. A watch runs in a task
//! that forwards etcd's events and closes the channel when etcd's stream
//! ends or is canceled (for example after a compaction).

use std::time::Duration;

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use tokio::sync::mpsc;

use super::{
    Compare, KeyValue, LeaseId, MetaError, MetaResult, MetaStore, Op, TxnOutcome, WatchEvent,
};

/// Events a watcher may have unread before it is closed.
const WATCH_BUFFER: usize = 4_096;

/// A store on an etcd cluster.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").finish()
    }
}

fn unavailable(e: etcd_client::Error) -> MetaError {
    MetaError::Unavailable(e.to_string())
}

/// etcd's answer for an expired or unknown lease (its only form is the
/// message text).
fn lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

fn revision(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn convert(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: revision(kv.create_revision()),
        mod_revision: revision(kv.mod_revision()),
        lease: (kv.lease() != 0).then_some(LeaseId(kv.lease())),
    }
}

impl EtcdStore {
    /// Connects to etcd at `endpoints` (for example `http://127.0.0.1:2379`).
    pub async fn connect(
        endpoints: &[String],
        tls: Option<&tidepool_security::TlsFiles>,
    ) -> MetaResult<Self> {
        let mut options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(10));
        if let Some(files) = tls {
            let read = |path: &std::path::Path| {
                std::fs::read(path).map_err(|e| {
                    MetaError::Unavailable(format!("etcd tls: {}: {e}", path.display()))
                })
            };
            let identity = etcd_client::Identity::from_pem(read(&files.cert)?, read(&files.key)?);
            let ca = etcd_client::Certificate::from_pem(read(&files.ca)?);
            options = options.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(ca)
                    .identity(identity),
            );
        }
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(unavailable)?;
        Ok(EtcdStore { client })
    }
}

#[tonic::async_trait]
impl MetaStore for EtcdStore {
    async fn get(&self, key: &str) -> MetaResult<Option<KeyValue>> {
        let response = self
            .client
            .kv_client()
            .get(key, None)
            .await
            .map_err(unavailable)?;
        Ok(response.kvs().first().map(convert))
    }

    async fn list(&self, prefix: &str) -> MetaResult<Vec<KeyValue>> {
        let response = self
            .client
            .kv_client()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(unavailable)?;
        let mut kvs: Vec<KeyValue> = response.kvs().iter().map(convert).collect();
        kvs.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(kvs)
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> MetaResult<TxnOutcome> {
        let compares: Vec<EtcdCompare> = compares
            .into_iter()
            .map(|c| match c {
                Compare::Absent(key) => EtcdCompare::create_revision(key, CompareOp::Equal, 0),
                Compare::ModRevision(key, rev) => {
                    EtcdCompare::mod_revision(key, CompareOp::Equal, signed(rev))
                }
                Compare::Value(key, value) => EtcdCompare::value(key, CompareOp::Equal, value),
            })
            .collect();
        let ops: Vec<TxnOp> = ops
            .into_iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => {
                    TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l.0)))
                }
                Op::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        let response = self
            .client
            .kv_client()
            .txn(Txn::new().when(compares).and_then(ops))
            .await
            .map_err(unavailable)?;
        Ok(TxnOutcome {
            succeeded: response.succeeded(),
            revision: response.header().map_or(0, |h| revision(h.revision())),
        })
    }

    async fn grant_lease(&self, ttl: Duration) -> MetaResult<LeaseId> {
        let seconds = lease_seconds(ttl);
        let response = self
            .client
            .lease_client()
            .grant(seconds, None)
            .await
            .map_err(unavailable)?;
        Ok(LeaseId(response.id()))
    }

    async fn keep_alive(&self, lease: LeaseId) -> MetaResult<bool> {
        let renew = async {
            let (mut keeper, mut stream) = self.client.lease_client().keep_alive(lease.0).await?;
            keeper.keep_alive().await?;
            stream.message().await
        };
        match renew.await {
            Ok(Some(response)) => Ok(response.ttl() > 0),
            Ok(None) => Err(MetaError::Unavailable("keep-alive stream closed".into())),
            Err(e) if lease_not_found(&e) => Ok(false),
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> MetaResult<()> {
        match self.client.lease_client().revoke(lease.0).await {
            Ok(_) => Ok(()),
            // Revoking an expired lease is done already.
            Err(e) if lease_not_found(&e) => Ok(()),
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn watch(
        &self,
        prefix: &str,
        from_revision: u64,
    ) -> MetaResult<mpsc::Receiver<WatchEvent>> {
        let mut options = WatchOptions::new().with_prefix();
        if from_revision != 0 {
            options = options.with_start_revision(signed(from_revision));
        }
        let mut stream = self
            .client
            .watch_client()
            .watch(prefix, Some(options))
            .await
            .map_err(unavailable)?;
        // The first response confirms the watch (or says it was compacted).
        let first = stream
            .message()
            .await
            .map_err(unavailable)?
            .ok_or_else(|| MetaError::Unavailable("watch stream closed".into()))?;
        if first.compact_revision() > 0 {
            return Err(MetaError::Compacted {
                requested: from_revision,
                oldest: revision(first.compact_revision()),
            });
        }
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let forward = |response: &etcd_client::WatchResponse, tx: &mpsc::Sender<WatchEvent>| {
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                let event = match event.event_type() {
                    EventType::Put => WatchEvent::Put(convert(kv)),
                    EventType::Delete => WatchEvent::Delete {
                        key: String::from_utf8_lossy(kv.key()).into_owned(),
                        mod_revision: revision(kv.mod_revision()),
                    },
                };
                if tx.try_send(event).is_err() {
                    return false;
                }
            }
            !response.canceled()
        };
        if !forward(&first, &tx) {
            return Err(MetaError::Unavailable("watch canceled".into()));
        }
        tokio::spawn(async move {
            while let Ok(Some(response)) = stream.message().await {
                if !forward(&response, &tx) {
                    break;
                }
            }
        });
        Ok(rx)
    }
}

/// The whole seconds of an etcd lease for `ttl`, rounded up: etcd grants
/// whole seconds, and the leader steps down up to 5/6 of `ttl` after its
/// last renewal, assuming the store holds the lease that long. Rounded
/// down (2.5 s granted as 2), the lease could expire while the leader still
/// acted, and a second coordinator win meanwhile. Longer is the safe side:
/// another waits a little more to win.
fn lease_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000).max(1)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod lease_tests {
    use std::time::Duration;

    #[test]
    fn a_lease_is_granted_in_whole_seconds_rounded_up() {
        assert_eq!(super::lease_seconds(Duration::from_millis(2_500)), 3);
        assert_eq!(super::lease_seconds(Duration::from_millis(6_000)), 6);
        assert_eq!(super::lease_seconds(Duration::from_millis(6_001)), 7);
        assert_eq!(super::lease_seconds(Duration::from_millis(10)), 1);
    }
}
