//! A real etcd server (Debian's `etcd-server`) for tests: its own data
//! directory and free loopback ports, killed when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `etcd`.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    /// Client URL, `http://127.0.0.1:<port>` (`https://` with TLS).
    pub url: String,
    _dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts `etcd` and waits (up to 20 s) until it accepts clients.
    /// Panics with the reason (and install hint) if it cannot start.
    pub fn start() -> EtcdServer {
        Self::start_with(None)
    }

    /// Starts `etcd` serving clients over mutual TLS: its certificate and
    /// key, and the CA client certificates must chain to (`https://`
    /// URL).
    pub fn start_tls(cert: &Path, key: &Path, ca: &Path) -> EtcdServer {
        Self::start_with(Some((cert, key, ca)))
    }

    fn start_with(tls: Option<(&Path, &Path, &Path)>) -> EtcdServer {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (client, peer) = (crate::free_port(), crate::free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("etcd log");
        let mut command = Command::new("etcd");
        if let Some((cert, key, ca)) = tls {
            command
                .arg("--cert-file")
                .arg(cert)
                .arg("--key-file")
                .arg(key)
                .arg("--trusted-ca-file")
                .arg(ca)
                .arg("--client-cert-auth");
        }
        let child = command
            .args(["--name", "test"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run etcd ({e}); install it with `make deps` (Debian etcd-server)")
            });
        let mut server = EtcdServer {
            child,
            url,
            _dir: dir,
        };
        server.wait_ready(client);
        server
    }

    fn wait_ready(&mut self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("etcd exited with {status}:\n{}", self.log());
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd never listened:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What etcd logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data_dir().join("etcd.log")).unwrap_or_default()
    }

    fn data_dir(&self) -> &Path {
        self._dir.path()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
