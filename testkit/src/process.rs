//! A child process for tests of the real binaries: its stderr in a log
//! file, stopped with SIGTERM or SIGKILL, killed if still running when
//! dropped.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A running process.
#[derive(Debug)]
pub struct TestProcess {
    child: Child,
    /// Where its stderr goes.
    pub log_path: PathBuf,
}

impl TestProcess {
    /// Starts `program` with `args` (`RUST_LOG=info`), stderr to `log`.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(program: &str, args: &[S], log: PathBuf) -> Self {
        Self::spawn_with_env(program, args, &[], log)
    }

    /// [`TestProcess::spawn`] with `env` added to its environment.
    pub fn spawn_with_env<S: AsRef<std::ffi::OsStr>>(
        program: &str,
        args: &[S],
        env: &[(&str, &str)],
        log: PathBuf,
    ) -> Self {
        let out = std::fs::File::create(&log).expect("log file");
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        Self {
            child,
            log_path: log,
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL, and wait for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then its exit status (panics if it does not exit within
    /// 20 s, with its log).
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "process {pid} did not stop on SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TestProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
