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
    client_port: u16,
    /// Everything after `etcd` on its command line (to start it again).
    args: Vec<std::ffi::OsString>,
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
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        if let Some((cert, key, ca)) = tls {
            args.extend(["--cert-file".into(), cert.into()]);
            args.extend(["--key-file".into(), key.into()]);
            args.extend(["--trusted-ca-file".into(), ca.into()]);
            args.push("--client-cert-auth".into());
        }
        args.extend(["--name".into(), "test".into()]);
        args.extend(["--data-dir".into(), dir.path().join("data").into()]);
        for (flag, value) in [
            ("--listen-client-urls", &url),
            ("--advertise-client-urls", &url),
            ("--listen-peer-urls", &peer_url),
            ("--initial-advertise-peer-urls", &peer_url),
            ("--initial-cluster", &format!("test={peer_url}")),
        ] {
            args.extend([flag.into(), value.into()]);
        }
        let child = Self::spawn(dir.path(), &args);
        let mut server = EtcdServer {
            child,
            url,
            client_port: client,
            args,
            _dir: dir,
        };
        server.wait_ready();
        server
    }

    fn spawn(dir: &Path, args: &[std::ffi::OsString]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("etcd.log"))
            .expect("etcd log");
        Command::new("etcd")
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run etcd ({e}); install it with `make deps` (Debian etcd-server)")
            })
    }

    /// Kills etcd with SIGKILL (its data stays; [`EtcdServer::restart`]
    /// starts it again).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A copy of etcd's data as it is now (etcd is stopped for the copy and
    /// started again): what restoring a backup later puts back.
    pub fn save_data(&mut self) -> tempfile::TempDir {
        self.kill();
        let saved = tempfile::tempdir().expect("a temporary directory");
        copy_dir(&self.data_dir().join("data"), &saved.path().join("data"));
        self.restart();
        saved
    }

    /// Replaces etcd's data with `saved` (from [`EtcdServer::save_data`])
    /// and starts it again: a store restored from an older backup.
    pub fn restore_data(&mut self, saved: &Path) {
        self.kill();
        let data = self.data_dir().join("data");
        std::fs::remove_dir_all(&data).expect("remove etcd's data");
        copy_dir(&saved.join("data"), &data);
        self.restart();
    }

    /// Kills etcd, deletes its data and starts it again, empty, on the same
    /// ports: etcd's volume lost under its clients.
    pub fn lose_data(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.data_dir().join("data")).expect("remove etcd's data");
        self.restart();
    }

    /// Starts etcd again on its data directory and ports, and waits until
    /// it accepts clients.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(self.data_dir(), &self.args);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let port = self.client_port;
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

/// Copies the tree at `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create a directory");
    for entry in std::fs::read_dir(from).expect("read a directory") {
        let entry = entry.expect("a directory entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a file");
        }
    }
}
