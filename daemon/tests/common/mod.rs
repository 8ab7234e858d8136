//! Starts the real `hkvd` binary on a temporary socket and state directory.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use hkv_client::proto::{Header, HEADER_LEN};
use hkv_client::{Client, ErrorCode, Response};

pub struct Daemon {
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

/// The hkvd binary: `$HKVD_BIN` when set, else the one cargo built.
#[allow(dead_code)]
pub fn hkvd_bin() -> PathBuf {
    std::env::var_os("HKVD_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_hkvd")), PathBuf::from)
}

/// The command line `Daemon` runs, for tests that need the process itself.
pub fn command(root: &Path, extra: &[&str]) -> Command {
    command_at(&root.join("run").join("hkvd.sock"), &root.join("state"), extra)
}

/// `hkvd serve --backend cpu --shards 3` on `socket` and `state`, plus
/// `extra` (which may name another backend or shard count). The binary is
/// `$HKVD_BIN` when set (a GPU host that runs test binaries built
/// elsewhere), else the one cargo built beside the tests.
fn command_at(socket: &Path, state: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(hkvd_bin());
    cmd.arg("serve")
        .arg("--socket")
        .arg(socket)
        .arg("--state-dir")
        .arg(state)
        .args(["--log", "warn"])
        .args(if extra.contains(&"--backend") { &[][..] } else { &["--backend", "cpu"][..] })
        .args(if extra.contains(&"--shards") { &[][..] } else { &["--shards", "3"][..] })
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

impl Daemon {
    /// `hkvd serve --backend cpu --shards 3` plus `extra` (see
    /// `command_at`), on a fresh socket.
    pub fn start(extra: &[&str]) -> Daemon {
        Self::start_env(extra, &[])
    }

    /// [`Daemon::start`] with extra environment variables.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("run").join("hkvd.sock");
        Self::start_in_env(dir, socket, extra, env)
    }

    /// [`Daemon::start`] under an address-space limit of `bytes`
    /// (`prlimit --as`): a test that sends hostile input fails, instead of
    /// taking the machine down, if a regression lets the daemon allocate
    /// what a request asks for.
    pub fn start_limited(bytes: u64, extra: &[&str]) -> Daemon {
        Self::start_under(&[&format!("--as={bytes}")], extra)
    }

    /// [`Daemon::start`] under `prlimit` with `limits` (e.g. `--as=BYTES`,
    /// `--nofile=N`).
    pub fn start_under(limits: &[&str], extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("run").join("hkvd.sock");
        let inner = command_at(&socket, &dir.path().join("state"), extra);
        let mut cmd = Command::new("prlimit");
        cmd.args(limits).arg("--").arg(inner.get_program()).args(inner.get_args());
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
        let child = cmd.spawn().expect("spawn prlimit hkvd (prlimit is in util-linux)");
        let mut d = Daemon { child: Some(child), dir, socket };
        d.wait_ready();
        d
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().expect("try_wait").is_none())
    }

    /// Resident memory of the process, bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("status");
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS");
        kb * 1024
    }

    pub fn start_in(dir: tempfile::TempDir, socket: PathBuf, extra: &[&str]) -> Daemon {
        Self::start_in_env(dir, socket, extra, &[])
    }

    fn start_in_env(dir: tempfile::TempDir, socket: PathBuf, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let mut cmd = command_at(&socket, &dir.path().join("state"), extra);
        cmd.envs(env.iter().copied()).stderr(Stdio::inherit());
        let child = cmd.spawn().expect("spawn hkvd");
        let mut d = Daemon { child: Some(child), dir, socket };
        d.wait_ready();
        d
    }

    /// Waits until the daemon answers a ping: up to 120 s, since a CUDA
    /// daemon on a fresh machine compiles its kernels with NVRTC before it
    /// serves (over 20 s with a cold kernel cache); a daemon that exits
    /// fails at once.
    pub fn wait_ready(&mut self) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(120) {
            if let Some(st) = self.child.as_mut().and_then(|c| c.try_wait().expect("try_wait")) {
                panic!("hkvd exited before serving: {st}");
            }
            if let Ok(mut c) = Client::connect(&self.socket) {
                if c.ping().is_ok() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("hkvd did not answer on {} within 120 s", self.socket.display());
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends a signal by name (TERM, INT) with kill(1).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().expect("kill");
        assert!(ok.success());
    }

    /// Stops with SIGTERM, waits, and starts again on the same state
    /// directory with `extra` flags.
    pub fn restart(mut self, extra: &[&str]) -> Daemon {
        if self.child.is_some() {
            self.signal("TERM");
            assert_eq!(self.wait(Duration::from_secs(60)), 0);
        }
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
        let socket = self.socket.clone();
        Daemon::start_in(dir, socket, extra)
    }

    /// Kills with SIGKILL (a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill");
            c.wait().expect("wait");
        }
    }

    /// Waits for the process to exit; returns its exit code.
    pub fn wait(&mut self, within: Duration) -> i32 {
        let mut child = self.child.take().expect("running");
        let t = Instant::now();
        loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                return st.code().unwrap_or(-1);
            }
            if t.elapsed() > within {
                let _ = child.kill();
                panic!("hkvd did not exit within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Writes raw bytes, reads one response frame.
pub fn raw_call(s: &mut UnixStream, bytes: &[u8]) -> (Header, Response) {
    s.write_all(bytes).unwrap();
    read_answer(s)
}

/// Reads one response frame.
pub fn read_answer(s: &mut UnixStream) -> (Header, Response) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = Header::decode(&h).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    (h, Response::decode(&h, &body).unwrap())
}

/// Asserts an error answer with `code` whose message names `culprit` (the
/// table, field, limit, index or id at fault), never its English wording.
#[allow(dead_code)]
pub fn expect_error(r: Response, code: ErrorCode, culprit: &str) {
    match r {
        Response::Error(e) => {
            assert_eq!(e.code, code, "{e:?}");
            assert!(e.message.contains(culprit), "message {:?} does not name {culprit:?}", e.message);
        }
        r => panic!("expected {code:?}, got {r:?}"),
    }
}

/// Asserts an error answer with `code`.
#[allow(dead_code)]
pub fn expect_code(r: Response, code: ErrorCode) {
    match r {
        Response::Error(e) => assert_eq!(e.code, code, "{e:?}"),
        r => panic!("expected {code:?}, got {r:?}"),
    }
}

/// Runs this test binary's ignored test `child` as another user through
/// `setpriv` (`ids`: its uid/gid/group options), with `HKVD_TEST_SOCKET`
/// and `HKVD_TEST_EXPECT` set, and asserts that it passed. Needs root.
pub fn run_child_as(ids: &[&str], child: &str, socket: &Path, expect: &str) {
    let out = Command::new("/usr/bin/setpriv")
        .args(ids)
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", child, "--ignored", "--nocapture"])
        .env("HKVD_TEST_SOCKET", socket)
        .env("HKVD_TEST_EXPECT", expect)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The daemon's address space now, from /proc.
pub fn vm_size(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmSize");
    kb * 1024
}

/// Sets the soft address-space limit of process `pid` (the hard one stays,
/// so that it can be raised again).
pub fn set_as_limit(pid: u32, limit: &str) {
    let ok = std::process::Command::new("prlimit")
        .args([&format!("--pid={pid}"), &format!("--as={limit}:")])
        .status()
        .expect("prlimit (util-linux)")
        .success();
    assert!(ok, "prlimit --pid {pid} --as={limit}");
}
