//! A TCP proxy a test puts on a path to a server, so it can cut that path
//! (refuse new connections and reset open ones), freeze it (accept new
//! connections and never answer them), heal it, or black-hole one
//! connection: forward a given number of bytes and then nothing more in
//! either direction, the sockets kept open — what a peer whose host froze,
//! or a middlebox that lost the flow, looks like from the other end.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// No black hole armed.
const UNARMED: u64 = u64::MAX;

/// One direction of one path: `listen` → `target`.
pub struct Proxy {
    /// Where the proxy listens.
    pub address: SocketAddr,
    shared: Arc<Shared>,
    /// Bumped on every block, so open connections end.
    generation: watch::Sender<u64>,
}

struct Shared {
    blocked: AtomicBool,
    frozen: AtomicBool,
    accepted: AtomicU64,
    /// The first connection whose target has sent this many bytes stops
    /// forwarding (one connection only; [`UNARMED`]: none).
    black_hole_after: AtomicU64,
    black_holed: AtomicU64,
}

impl Proxy {
    /// Starts a proxy to `target` on a free loopback port.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let shared = Arc::new(Shared {
            blocked: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            black_hole_after: AtomicU64::new(UNARMED),
            black_holed: AtomicU64::new(0),
        });
        let generation = watch::Sender::new(0u64);
        let (s, g) = (shared.clone(), generation.clone());
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                // The generation first, then the flags: a cut between the
                // two is seen either way (read after the flags, a cut that
                // came between left this connection open through it).
                let mut cut = g.subscribe();
                let started = *cut.borrow_and_update();
                if s.blocked.load(Ordering::SeqCst) {
                    drop(inbound); // refused: the peer sees a reset
                    continue;
                }
                if s.frozen.load(Ordering::SeqCst) {
                    held.push(inbound); // accepted, never read nor answered
                    continue;
                }
                held.clear();
                s.accepted.fetch_add(1, Ordering::Relaxed);
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    let silent = AtomicBool::new(false);
                    tokio::select! {
                        () = pump(ir, ow, &silent, None) => {}
                        () = pump(or, iw, &silent, Some(&s)) => {}
                        _ = cut.wait_for(|g| *g != started) => {}
                    }
                });
            }
        });
        Proxy {
            address,
            shared,
            generation,
        }
    }

    /// Cuts the path: open connections end, new ones are refused.
    pub fn block(&self) {
        self.shared.blocked.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Freezes the path, as a server whose host hangs: open connections
    /// end, new ones are accepted (by the kernel, then the proxy) and never
    /// answered.
    pub fn freeze(&self) {
        self.shared.frozen.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Heals the path.
    pub fn unblock(&self) {
        self.shared.blocked.store(false, Ordering::SeqCst);
        self.shared.frozen.store(false, Ordering::SeqCst);
    }

    /// Whether the path is cut.
    pub fn is_blocked(&self) -> bool {
        self.shared.blocked.load(Ordering::SeqCst)
    }

    /// Connections let through so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Arms a black hole: the first connection (open or new) over which the
    /// target has sent `bytes` bytes in all forwards exactly those and then
    /// nothing more either way, its sockets left open; other connections
    /// are not touched. One connection only.
    pub fn black_hole_after(&self, bytes: u64) {
        self.shared.black_hole_after.store(bytes, Ordering::SeqCst);
    }

    /// Connections black-holed so far.
    pub fn black_holed(&self) -> u64 {
        self.shared.black_holed.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until either closes. `counted`: the direction
/// from the target, which a black hole counts. Once the connection is
/// `silent` the pump forwards nothing more, holds its sockets and never
/// returns.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    silent: &AtomicBool,
    counted: Option<&Shared>,
) {
    let mut buffer = vec![0u8; 64 << 10];
    let mut sent = 0u64;
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n as u64,
        };
        if silent.load(Ordering::SeqCst) {
            break;
        }
        let mut n = n;
        if let Some(shared) = counted {
            let limit = shared.black_hole_after.load(Ordering::SeqCst);
            if limit != UNARMED && sent + n >= limit {
                // This connection takes the black hole (unless another took
                // it first): forward up to the limit, then go silent.
                if shared
                    .black_hole_after
                    .compare_exchange(limit, UNARMED, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    n = limit.saturating_sub(sent);
                    silent.store(true, Ordering::SeqCst);
                    shared.black_holed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        if to.write_all(&buffer[..n as usize]).await.is_err() {
            break;
        }
        sent += n;
        if silent.load(Ordering::SeqCst) {
            break;
        }
    }
    if silent.load(Ordering::SeqCst) {
        // Black-holed: neither end hears of anything again, not even a close.
        let _held = (from, to);
        std::future::pending::<()>().await;
    }
}
