//! An operator-minded tester's findings about what the daemon tells its
//! operators (metrics, stats, checkpoints, the memory budget), each against
//! a real daemon on a temporary socket.

mod common;

use common::Daemon;
use hkv_client::proto::{Mode, Policy};
use hkv_client::TableSpec;

/// The samples of metric `name` (with its labels) in a Prometheus text.
fn samples<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let bare = series.split('{').next()?;
            (bare == name).then(|| (series, value.parse().expect("a sample's value")))
        })
        .collect()
}

/// The one sample of `series` (name and labels exactly as printed).
fn sample(text: &str, series: &str) -> Option<f64> {
    let name = series.split('{').next().expect("name");
    samples(text, name).into_iter().find(|(s, _)| *s == series).map(|(_, v)| v)
}

/// Finding 4. `hkvctl mrc` said "too few sampled lookups for an estimate
/// yet" while Prometheus exported `hkvd_mrc_hit_rate` 0 at 1/8×–1/2× and
/// 0.234 at 1×–8× (and `stats --json` the same points) for a table that
/// measured 75 %: 4 lookups after a fill. Now a curve that is not ready has
/// no points and no hit-rate samples, and `hkvd_mrc_ready` says which.
#[test]
fn a_curve_with_too_few_samples_exports_no_estimate() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let spec = TableSpec { mode: Mode::Dual, policy: Policy::Lru, ..TableSpec::new("user_emb", 8, 65536) };
    c.create_table(spec).expect("create");
    let keys: Vec<u64> = (1..=50_000).collect();
    for b in keys.chunks(10_000) {
        c.insert_or_assign("user_emb", b, &vec![0.5; 8 * b.len()], None).expect("fill");
    }
    c.find("user_emb", &[1, 2, 3, 60_000]).expect("get");
    let s = c.stats_doc().expect("stats");
    let m = s.tables[0].mrc.as_ref().expect("curves are on by default");
    assert!(m.sampled_accesses < 100, "{} sampled lookups", m.sampled_accesses);
    assert!(m.points.is_empty(), "a curve that is not ready has no points: {:?}", m.points);
    let text = c.metrics().expect("metrics");
    assert_eq!(sample(&text, "hkvd_mrc_ready{table=\"user_emb\"}"), Some(0.0), "{text}");
    assert!(samples(&text, "hkvd_mrc_hit_rate").is_empty(), "hit rates of a curve that is not ready");
    // Enough lookups later it is an estimate, at every factor.
    let mut looked = 0u64;
    while c.stats_doc().expect("stats").tables[0].mrc.as_ref().expect("mrc").sampled_accesses < 100 {
        assert!(looked < 1 << 20, "{looked} lookups and still not 100 sampled");
        let b: Vec<u64> = (looked..looked + 1000).map(|k| k % 50_000 + 1).collect();
        c.find("user_emb", &b).expect("find");
        looked += 1000;
    }
    let s = c.stats_doc().expect("stats");
    assert_eq!(s.tables[0].mrc.as_ref().expect("mrc").points.len(), 7);
    let text = c.metrics().expect("metrics");
    assert_eq!(sample(&text, "hkvd_mrc_ready{table=\"user_emb\"}"), Some(1.0), "{text}");
    assert_eq!(samples(&text, "hkvd_mrc_hit_rate").len(), 7, "{text}");
}

/// The sum of the samples of `name` whose labels contain every one of `labels`.
fn total(text: &str, name: &str, labels: &[&str]) -> f64 {
    samples(text, name).into_iter().filter(|(s, _)| labels.iter().all(|l| s.contains(l))).map(|(_, v)| v).sum()
}

/// Finding 8. A live restore installs new shards whose counters start at
/// 0: `hkvd_hits_total` went 6 → 0 (Prometheus reads a counter reset, and
/// rates jump); and every checkpoint counted as two client exports
/// (`hkvd_ops_total{op="export"}` +2 per checkpoint). Now every counter
/// series carries on across the restore, and checkpoints' export batches
/// are `op="checkpoint"`, not `op="export"`. (`hkvd_mrc_lookups_total`
/// still restarted: it is carried too.)
#[test]
fn counters_carry_on_across_a_restore_and_checkpoints_are_not_client_exports() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 2, 4096)).expect("create");
    let keys: Vec<u64> = (1..=300).collect();
    c.insert_or_assign("t", &keys, &vec![1.0; 2 * keys.len()], None).expect("insert");
    c.find("t", &keys).expect("find");
    let before = c.metrics().expect("metrics");
    c.checkpoint(true, false).expect("checkpoint");
    let after_ck = c.metrics().expect("metrics");
    let exports = |t: &str| total(t, "hkvd_ops_total", &["op=\"export\""]);
    assert_eq!(exports(&after_ck), exports(&before), "a checkpoint is not a client's export");
    assert!(total(&after_ck, "hkvd_ops_total", &["op=\"checkpoint\""]) >= 3.0, "one batch per shard at least");
    assert_eq!(total(&after_ck, "hkvd_keys_total", &["op=\"checkpoint\""]), 300.0, "{after_ck}");
    let doc = c.stats_doc().expect("stats");
    assert_eq!(doc.op_names.last().map(String::as_str), Some("checkpoint"));
    assert!(doc.tables[0].shards.iter().all(|s| s.ops.len() == doc.op_names.len()));
    c.find("t", &keys).expect("find");
    let pre = c.metrics().expect("metrics");
    c.restore(hkv_client::proto::CheckpointId::Latest).expect("live restore");
    let post = c.metrics().expect("metrics");
    // Every counter series of the table: none lower than before the restore.
    // The curve's lookups too (they restarted at 0 with the new shards).
    for name in [
        "hkvd_hits_total",
        "hkvd_misses_total",
        "hkvd_inserts_total",
        "hkvd_ops_total",
        "hkvd_keys_total",
        "hkvd_mrc_lookups_total",
    ] {
        for (series, v) in samples(&pre, name) {
            let now = sample(&post, series).unwrap_or_else(|| panic!("{series} gone after the restore"));
            assert!(now >= v, "{series}: {v} before the restore, {now} after");
        }
    }
    assert_eq!(total(&post, "hkvd_hits_total", &[]), 600.0, "two finds of 300 keys that hit");
    // And they keep counting on the restored shards.
    c.find("t", &keys).expect("find");
    let end = c.metrics().expect("metrics");
    assert_eq!(total(&end, "hkvd_hits_total", &[]), 900.0);
    assert_eq!(total(&end, "hkvd_mrc_lookups_total", &[]), 900.0, "three finds of 300 keys");
}

/// Finding 7. `stats --json` had `checkpoint.last.error` and the rest, but
/// Prometheus had no checkpoint metric at all: a daemon whose checkpoints
/// failed every time could not be alerted on. (Failures moving them:
/// `a_full_disk_pauses_checkpoints_and_room_resumes_them`.)
#[test]
fn checkpoints_are_in_the_metrics() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let text = c.metrics().expect("metrics");
    for (series, v) in [
        ("hkvd_checkpoint_last_success_timestamp_seconds", 0.0),
        ("hkvd_checkpoint_last_failure_timestamp_seconds", 0.0),
        ("hkvd_checkpoint_consecutive_failures", 0.0),
        ("hkvd_checkpoint_running", 0.0),
        ("hkvd_checkpoint_paused", 0.0),
        ("hkvd_checkpoint_last_duration_seconds", 0.0),
        ("hkvd_checkpoint_last_bytes", 0.0),
    ] {
        assert_eq!(sample(&text, series), Some(v), "{series} in\n{text}");
    }
    c.create_table(TableSpec::new("t", 4, 4096)).expect("create");
    let keys: Vec<u64> = (1..=1000).collect();
    c.insert_or_assign("t", &keys, &vec![1.0; 4 * keys.len()], None).expect("insert");
    let t0 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    c.checkpoint(true, false).expect("checkpoint");
    let text = c.metrics().expect("metrics");
    let at = sample(&text, "hkvd_checkpoint_last_success_timestamp_seconds").expect("last success");
    assert!(at >= t0 - 1.0 && at <= t0 + 60.0, "last success at {at}, asked at {t0}");
    assert!(sample(&text, "hkvd_checkpoint_last_bytes").expect("bytes") >= 1000.0 * 16.0, "{text}");
    assert!(sample(&text, "hkvd_checkpoint_last_duration_seconds").expect("duration") > 0.0);
    assert_eq!(sample(&text, "hkvd_checkpoint_consecutive_failures"), Some(0.0));
    assert_eq!(sample(&text, "hkvd_checkpoint_running"), Some(0.0));
}

/// Finding 9 (and finding 7's failures). docs/checkpoints.md says a full
/// disk pauses checkpoints (`checkpoint.paused`, `resource_exhausted`);
/// with a 3 MiB tmpfs state directory filled while hkvd ran, each attempt
/// failed with "No space left on device" at WARN and nothing paused (only a
/// disk full at start-up did). Now a write that finds the file system full
/// pauses them; each later attempt is refused `resource_exhausted` until a
/// probe write finds room, and then they resume without a restart.
///
/// The state directory is a real 4 MiB tmpfs mounted in a private mount
/// namespace (`unshare -Urm`, no root needed where user namespaces are
/// allowed), filled from outside through `/proc/PID/root`.
#[test]
fn a_full_disk_pauses_checkpoints_and_room_resumes_them() {
    use hkv_client::ErrorCode;
    if !std::process::Command::new("unshare").args(["-Urm", "true"]).status().is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: unshare -Urm is not allowed here (no user namespaces), so no tmpfs to fill");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let socket = dir.path().join("run").join("hkvd.sock");
    let inner = common::command(dir.path(), &[]);
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["-Urm", "sh", "-c", "mount -t tmpfs -o size=4m tmpfs \"$0\" && exec \"$@\""]).arg(&state);
    cmd.arg(inner.get_program()).args(inner.get_args()).stdin(std::process::Stdio::null());
    let child = cmd.spawn().expect("spawn unshare hkvd");
    let mut d = Daemon { child: Some(child), dir, socket };
    d.wait_ready();
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 8, 8192)).expect("create");
    let keys: Vec<u64> = (1..=4000).collect();
    c.insert_or_assign("t", &keys, &vec![1.0; 8 * keys.len()], None).expect("insert");
    c.checkpoint(true, false).expect("a checkpoint while there is room");
    // Fill the tmpfs as the daemon sees it.
    let fill = std::path::PathBuf::from(format!("/proc/{}/root{}/fill", d.pid(), state.display()));
    let mut f = std::fs::File::create(&fill).expect("filler");
    let mb = vec![7u8; 1 << 20];
    while std::io::Write::write_all(&mut f, &mb).is_ok() {}
    drop(f);
    let e = c.checkpoint(true, false).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    let s = c.stats_doc().expect("stats");
    assert!(s.checkpoint.paused.is_some(), "checkpoint.paused: {:?}", s.checkpoint);
    let text = c.metrics().expect("metrics");
    assert_eq!(sample(&text, "hkvd_checkpoint_paused"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "hkvd_checkpoint_consecutive_failures"), Some(1.0));
    assert!(sample(&text, "hkvd_checkpoint_last_failure_timestamp_seconds").expect("failure ts") > 0.0);
    // A checkpoint without wait is refused at once too.
    let e = c.checkpoint(false, false).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    let text = c.metrics().expect("metrics");
    assert_eq!(sample(&text, "hkvd_checkpoint_consecutive_failures"), Some(2.0));
    // Room again: the next checkpoint resumes them.
    std::fs::remove_file(&fill).expect("remove the filler");
    c.checkpoint(true, false).expect("a checkpoint once there is room");
    let s = c.stats_doc().expect("stats");
    assert!(s.checkpoint.paused.is_none(), "{:?}", s.checkpoint.paused);
    let text = c.metrics().expect("metrics");
    assert_eq!(sample(&text, "hkvd_checkpoint_paused"), Some(0.0));
    assert_eq!(sample(&text, "hkvd_checkpoint_consecutive_failures"), Some(0.0));
}

/// A newcomer's daemon under a file-size limit (`prlimit --fsize`,
/// systemd's `LimitFSIZE=`) was killed by SIGXFSZ at its first checkpoint
/// past the limit (exit 153, nothing logged, every table lost), where the
/// docs say EFBIG pauses checkpoints as a full disk does. Now the signal
/// is caught: the write fails with EFBIG, the checkpoint is refused with
/// `resource_exhausted`, checkpoints pause, and the daemon serves on.
#[test]
fn a_file_size_limit_pauses_checkpoints_instead_of_killing_the_daemon() {
    use hkv_client::ErrorCode;
    let mut d = Daemon::start_under(&["--fsize=300000"], &[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 32, 65536)).expect("create");
    let keys: Vec<u64> = (1..=20_000).collect();
    c.insert_or_assign("t", &keys, &vec![1.5; 32 * keys.len()], None).expect("insert");
    let e = c.checkpoint(true, false).expect_err("2.5 MB of rows past a 300 kB file-size limit");
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    assert!(d.alive(), "hkvd was killed by the file-size limit");
    let mut c = d.client();
    let s = c.stats_doc().expect("stats");
    assert!(s.checkpoint.paused.is_some(), "checkpoint.paused: {:?}", s.checkpoint);
    let found = c.find("t", &keys[..100]).expect("find after the refused checkpoint");
    assert!(found.values.iter().all(|&v| v == 1.5), "the rows are still served");
}

/// `max_load_factor` without `max_capacity` was refused by hkvctl only: a
/// config file's `[[table]]` and the Python client created such a table
/// silently, with a threshold it never uses. The daemon refuses it now.
#[test]
fn a_growth_threshold_without_room_to_grow_is_refused() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let spec = TableSpec { max_load_factor: Some(0.7), ..TableSpec::new("t", 4, 1024) };
    let e = c.create_table(spec.clone()).expect_err("max_load_factor without max_capacity");
    assert_eq!(e.code(), Some(hkv_client::ErrorCode::BadRequest), "{e}");
    assert!(e.to_string().contains("give max_capacity"), "{e}");
    c.create_table(TableSpec { max_capacity: 4096, ..spec }).expect("with room to grow");
}

/// A newcomer restored a checkpoint of a dual table into a running single
/// one: it stayed single, and only a capacity difference was logged. Every
/// difference of the spec the restore keeps is said at WARN now.
#[test]
fn a_restore_into_a_table_of_another_bucket_mode_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log");
    let mut cmd = common::command(dir.path(), &[]);
    cmd.stderr(std::fs::File::create(&log).expect("log file"));
    let socket = dir.path().join("run").join("hkvd.sock");
    let mut d = Daemon { child: Some(cmd.spawn().expect("spawn hkvd")), dir, socket };
    d.wait_ready();
    let mut c = d.client();
    c.create_table(TableSpec { mode: Mode::Dual, ..TableSpec::new("t", 4, 4096) }).expect("create dual");
    c.insert_or_assign("t", &[1, 2], &[1.0; 8], None).expect("insert");
    c.checkpoint(true, false).expect("checkpoint");
    c.drop_table("t").expect("drop");
    c.create_table(TableSpec::new("t", 4, 4096)).expect("create single");
    c.restore(hkv_client::proto::CheckpointId::Latest).expect("restore into the running table");
    assert_eq!(c.find("t", &[1, 2]).expect("find").found, vec![true, true], "the rows were restored");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("mode is kept: single here, dual in the checkpoint"), "{text}");
}

/// Finding 5. With `--mrc-max-keys 1048576` every table's curve
/// estimators reserve up to 1 Mi × 120 bytes whatever the table's size,
/// none of it in the table budget: ten tables of 256 slots filled with
/// 1.2 M keys each grew RSS by 804 MB while `hkvd_table_granted_bytes`
/// stayed 57 600, and the 43rd table exhausted the address space (an
/// infallible allocation: an abort). Now all tables' estimators together
/// hold at most 1/16 of host memory (or of the address-space limit); an
/// estimator opened past that share tracks fewer keys. Forty tiny tables
/// under a 4 GiB address-space limit: the daemon serves on, and the
/// estimators' memory stays within the share.
#[test]
fn curve_estimators_stay_within_their_share_of_memory() {
    let limit: u64 = 4 << 30;
    let mut d = Daemon::start_limited(limit, &["--mrc-max-keys", "1048576"]);
    let mut c = d.client();
    for i in 0..40 {
        c.create_table(TableSpec::new(&format!("t{i}"), 1, 256)).expect("create a tiny table");
    }
    assert!(d.alive(), "the daemon died creating tables");
    let s = c.stats_doc().expect("stats");
    let curves: u64 = s.tables.iter().filter_map(|t| t.mrc.as_ref()).map(|m| m.memory_bytes).sum();
    // The share, plus each shard's floor of 256 keys past it.
    let floor = 40 * 3 * 256 * 120;
    assert!(curves <= limit / 16 + floor, "the curves hold {curves} bytes");
    let keys: Vec<u64> = (1..=100_000).collect();
    c.insert_or_assign("t39", &keys, &vec![0.0; keys.len()], None).expect("the last table serves");
    c.find("t39", &keys).expect("find");
}

/// `KEY=value` of a unit file (the last setting wins, as in systemd).
fn unit_value(text: &str, key: &str) -> Option<String> {
    text.lines().rev().find_map(|l| l.trim().strip_prefix(key)?.strip_prefix('=')).map(str::to_string)
}

/// Finding 13 (the units). `TimeoutStopSec=90` was less than a stop can
/// take (30 s drain + 30 s write-back + the final checkpoint): systemd
/// killed hkvd mid-checkpoint. And hkvd.socket made /run/hkvd root:root
/// 0750 before the service first ran, so no client could reach the socket
/// its mode let them use. (`systemd-analyze verify` stays clean:
/// tests/systemd.rs.)
#[test]
fn the_units_let_a_stop_finish_and_clients_reach_the_socket() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let service = std::fs::read_to_string(dir.join("hkvd.service")).expect("hkvd.service");
    let socket = std::fs::read_to_string(dir.join("hkvd.socket")).expect("hkvd.socket");
    let stop = unit_value(&service, "TimeoutStopSec").expect("TimeoutStopSec");
    let secs: u64 = match stop.strip_suffix("min") {
        Some(m) => m.parse::<u64>().expect("minutes") * 60,
        None => stop.trim_end_matches('s').parse().expect("seconds"),
    };
    assert!(secs >= 30 + 30 + 300, "TimeoutStopSec={stop}: drain, write-back and a final checkpoint");
    assert_eq!(unit_value(&socket, "DirectoryMode").as_deref(), Some("0755"));
    assert_eq!(unit_value(&service, "RuntimeDirectoryMode").as_deref(), Some("0755"));
    assert_eq!(unit_value(&socket, "SocketMode").as_deref(), Some("0660"), "the socket's mode says who connects");
    // The admin_group conflict is written down where it bites.
    assert!(service.contains("RestrictSUIDSGID=no") && service.contains("SupplementaryGroups="), "{service}");
}
