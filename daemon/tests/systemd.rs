//! systemd integration: the unit files verify, readiness is reported through
//! NOTIFY_SOCKET, and a socket passed by socket activation is served.

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

use hkv_client::Client;

/// Kills the child when a test fails before reaping it.
struct Reap(std::process::Child);
impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn units() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd")
}

#[test]
fn unit_files_pass_systemd_analyze_verify() {
    let dir = tempfile::tempdir().unwrap();
    let service = std::fs::read_to_string(units().join("hkvd.service")).unwrap();
    // verify checks that ExecStart names an executable: point it at ours.
    let service = service.replace("/usr/local/bin/hkvd", env!("CARGO_BIN_EXE_hkvd"));
    let set = |key: &str| service.lines().any(|l| l.trim_start().starts_with(key));
    assert!(!set("PrivateDevices="), "PrivateDevices would hide /dev/nvidia*");
    assert!(set("Type=notify") && set("RuntimeDirectory=") && set("StateDirectory="));
    std::fs::write(dir.path().join("hkvd.service"), service).unwrap();
    std::fs::copy(units().join("hkvd.socket"), dir.path().join("hkvd.socket")).unwrap();
    std::fs::copy(units().join("hkvd-checkpoint.timer"), dir.path().join("hkvd-checkpoint.timer")).unwrap();
    // The checkpoint service calls hkvctl: any executable stands in for it here.
    let ck = std::fs::read_to_string(units().join("hkvd-checkpoint.service")).unwrap();
    std::fs::write(dir.path().join("hkvd-checkpoint.service"), ck.replace("/usr/local/bin/hkvctl", "/bin/true"))
        .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(dir.path().join("hkvd.socket"))
        .arg(dir.path().join("hkvd.service"))
        .arg(dir.path().join("hkvd-checkpoint.service"))
        .arg(dir.path().join("hkvd-checkpoint.timer"))
        .output()
        .expect("systemd-analyze (package systemd) is needed for this test");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "warnings: {}", String::from_utf8_lossy(&out.stderr));
    // The example config parses.
    hkvd::config::Config::from_file(&units().join("hkvd.toml")).unwrap();
}

#[test]
fn readiness_and_stopping_are_notified() {
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify");
    let rx = UnixDatagram::bind(&notify).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let socket = dir.path().join("s.sock");
    let mut child = Reap(
        Command::new(env!("CARGO_BIN_EXE_hkvd"))
            .args(["serve", "--backend", "cpu", "--shards", "1", "--log", "warn", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env("NOTIFY_SOCKET", &notify)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut buf = [0u8; 256];
    let n = rx.recv(&mut buf).unwrap();
    assert_eq!(buf[..n].trim_ascii(), b"READY=1");
    // Ready means serving.
    Client::connect(&socket).unwrap().ping().unwrap();
    Command::new("kill").arg("-TERM").arg(child.0.id().to_string()).status().unwrap();
    let n = rx.recv(&mut buf).unwrap();
    assert_eq!(buf[..n].trim_ascii(), b"STOPPING=1");
    assert_eq!(child.0.wait().unwrap().code(), Some(0));
}

#[test]
fn socket_activation_serves_the_inherited_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("activated.sock");
    let _act = Reap(
        Command::new("systemd-socket-activate")
            .arg("-l")
            .arg(&socket)
            .arg(env!("CARGO_BIN_EXE_hkvd"))
            .args(["serve", "--backend", "cpu", "--shards", "1", "--log", "warn", "--socket"])
            .arg(dir.path().join("never-bound.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("systemd-socket-activate (package systemd) is needed for this test"),
    );
    let mut client = None;
    for _ in 0..200 {
        if let Ok(mut c) = Client::connect(&socket) {
            if c.ping().is_ok() {
                client = Some(c);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let mut c = client.expect("hkvd answered on the activated socket");
    c.create_table(hkv_client::TableSpec::new("t", 2, 256)).unwrap();
    assert!(!dir.path().join("never-bound.sock").exists(), "the inherited socket is used, none is bound");
    c.shutdown().unwrap();
}
