//! A TCP proxy the harness puts on every path from one node to a peer, so
//! it can cut that path (refuse new connections and reset open ones) and
//! heal it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// One direction of one path: `listen` → `target`.
pub struct Proxy {
    /// Where the proxy listens.
    pub address: SocketAddr,
    blocked: Arc<AtomicBool>,
    /// Bumped on every block, so open connections end.
    generation: watch::Sender<u64>,
    accepted: Arc<AtomicU64>,
}

impl Proxy {
    /// Starts a proxy to `target` on a free loopback port.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let blocked = Arc::new(AtomicBool::new(false));
        let generation = watch::Sender::new(0u64);
        let accepted = Arc::new(AtomicU64::new(0));
        let (b, g, a) = (blocked.clone(), generation.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if b.load(Ordering::SeqCst) {
                    drop(inbound); // refused: the peer sees a reset
                    continue;
                }
                a.fetch_add(1, Ordering::Relaxed);
                let mut cut = g.subscribe();
                let started = *cut.borrow_and_update();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (mut ir, mut iw) = inbound.into_split();
                    let (mut or, mut ow) = outbound.into_split();
                    tokio::select! {
                        _ = tokio::io::copy(&mut ir, &mut ow) => {}
                        _ = tokio::io::copy(&mut or, &mut iw) => {}
                        _ = cut.wait_for(|g| *g != started) => {}
                    }
                });
            }
        });
        Proxy {
            address,
            blocked,
            generation,
            accepted,
        }
    }

    /// Cuts the path: open connections end, new ones are refused.
    pub fn block(&self) {
        self.blocked.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Heals the path.
    pub fn unblock(&self) {
        self.blocked.store(false, Ordering::SeqCst);
    }

    /// Whether the path is cut.
    pub fn is_blocked(&self) -> bool {
        self.blocked.load(Ordering::SeqCst)
    }

    /// Connections let through so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}
