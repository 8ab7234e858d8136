//! Hostile input to the daemon's start: its options, its config file and
//! the files of its state directory. Each daemon here runs under an
//! address-space limit (`prlimit --as`), so that a regression that
//! allocates what a file says fails the test (an abort, exit 134) instead
//! of exhausting the machine's memory; and each start that should fail is
//! given a deadline, so that one that hangs fails too.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Daemon;
use hkv_client::proto::CheckpointId;
use hkv_client::{ErrorCode, TableSpec};

/// The address space a CPU daemon with three shards gets here: a few times
/// what it maps when idle, far below the machine's memory.
const LIMIT: u64 = 6 << 30;

/// `inner` under `prlimit --as=LIMIT`.
fn limited(inner: &Command) -> Command {
    let mut cmd = Command::new("prlimit");
    cmd.arg(format!("--as={LIMIT}")).arg("--").arg(inner.get_program()).args(inner.get_args());
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    cmd
}

/// Runs `hkvd serve` in `root` (its socket and state directory, as
/// `common::command`) with `extra` under the address-space limit, and
/// waits up to 60 s for it to exit: its exit code and what it wrote on
/// stderr. A start that does not end in time is killed and fails the test.
fn start_fails(root: &Path, extra: &[&str]) -> (i32, String) {
    let mut child = limited(&common::command(root, extra)).stderr(Stdio::piped()).spawn().expect("spawn prlimit hkvd");
    let t = Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!("hkvd {extra:?} did not exit within 60 s: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("wait");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A daemon that served in `d`'s state directory, stopped; the directory.
fn stopped(mut d: Daemon) -> tempfile::TempDir {
    d.signal("TERM");
    assert_eq!(d.wait(Duration::from_secs(60)), 0);
    std::mem::replace(&mut d.dir, tempfile::tempdir().expect("tempdir"))
}

/// `hkvd serve` in `dir` with `extra`, under the address-space limit.
fn start_limited_in(dir: tempfile::TempDir, extra: &[&str]) -> Daemon {
    let child = limited(&common::command(dir.path(), extra)).stderr(Stdio::inherit()).spawn().expect("spawn");
    let socket = dir.path().join("run").join("hkvd.sock");
    let mut d = Daemon { child: Some(child), dir, socket };
    d.wait_ready();
    d
}

/// A state directory holding one checkpoint of table `t` (4 × 1000
/// entries of dim 4 over 3 shards); the path of its first chunk.
fn one_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 4, 4096)).unwrap();
    let keys: Vec<u64> = (1..1000).collect();
    c.insert_or_assign("t", &keys, &vec![0.5; keys.len() * 4], None).unwrap();
    c.checkpoint(true, true).unwrap();
    let dir = stopped(d);
    let chunks = dir.path().join("state/checkpoints/chunks");
    let ckpt = std::fs::read_dir(&chunks).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
    let chunk = ckpt.join("t0000.0000.00000000");
    assert!(chunk.is_file(), "{}", chunk.display());
    (dir, chunk)
}

/// A tester's finding (HIGH): a chunk file grown past its size
/// (`truncate -s 100G`) aborted the daemon at start ("memory allocation of
/// 107374186496 bytes failed", SIGABRT, exit 134): the chunk was read
/// whole at its size on disk before its header was checked. Worse, a
/// daemon started with `--restore none` aborted at `hkvctl restore
/// latest`, losing every live table. The start now refuses the checkpoint,
/// naming the chunk and both sizes (exit 1), and the live restore is
/// refused while the daemon serves on. A FIFO in the chunk's place hung
/// the start; it is refused too.
#[test]
fn a_chunk_grown_past_its_manifest_or_a_fifo_is_refused_not_read() {
    let (dir, chunk) = one_checkpoint();
    let on_disk = std::fs::metadata(&chunk).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&chunk).unwrap().set_len(100 << 30).unwrap();
    let (code, err) = start_fails(dir.path(), &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("t0000.0000.00000000"), "{err}");
    assert!(err.contains(&format!("{} bytes on disk, the manifest says {on_disk}", 100u64 << 30)), "{err}");

    let d = start_limited_in(dir, &["--restore", "none"]);
    let mut c = d.client();
    c.create_table(TableSpec::new("live", 4, 4096)).unwrap();
    c.insert_or_assign("live", &[7], &[1.0; 4], None).unwrap();
    let e = c.restore(CheckpointId::Latest).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::CorruptCheckpoint), "{e}");
    let mut c = d.client();
    assert_eq!(c.find("live", &[7]).unwrap().values, [1.0; 4], "the live table is kept");
    let dir = stopped(d);

    std::fs::remove_file(&chunk).unwrap();
    assert!(Command::new("mkfifo").arg(&chunk).status().unwrap().success());
    let (code, err) = start_fails(dir.path(), &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("t0000.0000.00000000") && err.contains("FIFO"), "{err}");
}

/// `hkvd serve` with the default log level (info) in `root`, with
/// `extra`, and the environment `env`, under the address-space limit:
/// its exit code and stderr (`start_fails` runs `common::command`, which
/// logs warnings only).
fn start_fails_at_info(root: &Path, extra: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut inner = Command::new(common::hkvd_bin());
    inner.arg("serve").arg("--backend").arg("cpu").arg("--state-dir").arg(root.join("state"));
    if !extra.contains(&"--socket") {
        inner.arg("--socket").arg(root.join("run/hkvd.sock"));
    }
    inner.args(extra);
    let out = limited(&inner).envs(env.iter().copied()).env_remove("RUST_LOG").output().expect("spawn prlimit hkvd");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A tester's hostile starts, each refused with exit 1 and a message that
/// names the option (or file, or variable) and its range, before any INFO
/// line: `--checkpoint-interval 18446744073709551615` panicked (exit 101,
/// "overflow when adding duration to instant"); `--config /dev/zero` was
/// read until memory ran out; `HKV_FIND_OR_INSERT=bogus` was "invalid
/// table config"; a socket path too long said "shorter than SUN_LEN" with
/// no length; a state directory that is a dangling symlink, and a
/// `checkpoints/chunks` that is a regular file, said "File exists"; and
/// `--shards 0` was refused after "INFO hkvd: host memory for tables".
#[test]
fn hostile_starts_are_refused_with_the_option_and_its_range() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let refused = |extra: &[&str], env: &[(&str, &str)], says: &str| {
        let (code, err) = start_fails_at_info(root, extra, env);
        assert_eq!(code, 1, "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("INFO"), "{extra:?}: logged before the refusal: {err}");
    };
    refused(&["--checkpoint-interval", "18446744073709551615"], &[], "--checkpoint-interval) must be 1 to 31536000");
    let config = root.join("hkvd.toml");
    std::fs::write(&config, "[checkpoint]\ninterval_s = 9223372036854775807\n").unwrap();
    refused(&["--config", config.to_str().unwrap()], &[], "must be 1 to 31536000");
    refused(&["--config", "/dev/zero"], &[], "/dev/zero is a device");
    refused(&[], &[("HKV_FIND_OR_INSERT", "bogus")], "environment variable HKV_FIND_OR_INSERT");
    let long = root.join("s".repeat(120));
    refused(&["--socket", long.to_str().unwrap()], &[], "a Unix socket's path holds at most 107");
    refused(&["--shards", "0"], &[], "must be 1 to 1024, not 0");
    refused(&["--metrics-listen", "localhost:9466"], &[], "e.g. 127.0.0.1:9466");

    std::os::unix::fs::symlink(root.join("gone"), root.join("state")).unwrap();
    refused(&[], &[], "which does not exist");
    std::fs::remove_file(root.join("state")).unwrap();
    std::fs::create_dir_all(root.join("state/checkpoints")).unwrap();
    std::fs::write(root.join("state/checkpoints/chunks"), "").unwrap();
    let (code, err) = start_fails_at_info(root, &[], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("chunks is a regular file"), "{err}");
}
