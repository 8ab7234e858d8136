//! `hkvd top` in a real terminal: tmux runs it against a real daemon while a
//! client drives load; capture-pane shows the table, a load factor that rises
//! as keys are inserted, evictions once the table is full, and a clean exit
//! on `q`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::Daemon;
use hkv_client::TableSpec;

struct Tmux {
    server: String,
    session: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .args(["-L", &self.server])
            .args(args)
            .env("TERM", "xterm-256color")
            .output()
            .expect("tmux (Debian package tmux) is needed for this test");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn capture(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", &self.session])
    }

    /// Captures until `pred` holds (10 s at most); returns the last capture.
    fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let t = Instant::now();
        loop {
            let s = self.capture();
            if pred(&s) {
                return s;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}; screen:\n{s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        self.run(&["kill-server"]);
    }
}

/// The load percentage in the table's overview row.
fn load(screen: &str, table: &str) -> Option<f64> {
    let row = screen.lines().find(|l| l.contains(table))?;
    row.split_whitespace().find(|w| w.ends_with('%'))?.trim_end_matches('%').parse().ok()
}

/// The last evictions/s figure of the sparkline panel.
fn evictions(screen: &str) -> Option<f64> {
    let i = screen.find("evictions/s ")?;
    let rest = &screen[i + "evictions/s ".len()..];
    let tok = rest.split_whitespace().next()?;
    let (num, mult) = match tok.chars().last()? {
        'k' => (&tok[..tok.len() - 1], 1e3),
        'M' => (&tok[..tok.len() - 1], 1e6),
        _ => (tok, 1.0),
    };
    num.parse::<f64>().ok().map(|x| x * mult)
}

#[test]
fn top_under_tmux_shows_rising_load_evictions_and_exits_cleanly() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("emb", 4, 3 * 256)).unwrap();
    let tmux = Tmux { server: format!("hkvd-top-test-{}", std::process::id()), session: "top".into() };
    // The shell records the exit status (tmux 3.3's pane_dead_status is
    // empty here), written aside and renamed: the file appears whole (a
    // redirection creates it empty before the status is written).
    let status_file = d.dir.path().join("top.status");
    let cmd = format!(
        "{} top --socket {} --interval-ms 100; echo $? > {f}.tmp; mv {f}.tmp {f}",
        env!("CARGO_BIN_EXE_hkvd"),
        d.socket.display(),
        f = status_file.display()
    );
    tmux.run(&["new-session", "-d", "-s", &tmux.session, "-x", "150", "-y", "40", &cmd]);
    tmux.run(&["set-option", "-t", &tmux.session, "remain-on-exit", "on"]);
    let s = tmux.wait_for("the table row", |s| load(s, "emb").is_some());
    assert!(s.contains("hkvd 0.1.0") && s.contains("Overview"), "{s}");
    assert_eq!(load(&s, "emb"), Some(0.0));
    // A terminal too small for the views says so; grown again, the views return.
    tmux.run(&["resize-window", "-t", &tmux.session, "-x", "40", "-y", "10"]);
    tmux.wait_for("the too-small notice", |s| s.contains("needs 60x16") && s.contains("40x10"));
    tmux.run(&["resize-window", "-t", &tmux.session, "-x", "150", "-y", "40"]);
    tmux.wait_for("the views again", |s| load(s, "emb").is_some());
    // Insert a third of the capacity: the load factor rises.
    let keys: Vec<u64> = (1..=256).collect();
    c.insert_or_assign("emb", &keys, &vec![0.5; 256 * 4], None).unwrap();
    let s = tmux.wait_for("the load to rise", |s| load(s, "emb").unwrap_or(0.0) > 30.0);
    assert!(load(&s, "emb").unwrap() < 40.0, "{s}");
    // Keep inserting new keys into the full table: evictions show up.
    let mut next = 1000u64;
    let t = Instant::now();
    let s = loop {
        let keys: Vec<u64> = (next..next + 512).collect();
        next += 512;
        c.insert_or_assign("emb", &keys, &vec![1.5; 512 * 4], None).unwrap();
        let s = tmux.capture();
        if evictions(&s).unwrap_or(0.0) > 0.0 {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no evictions shown:\n{s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(load(&s, "emb").unwrap() > 60.0, "{s}");
    // tab shows the table by shard, with its eviction counts.
    tmux.run(&["send-keys", "-t", &tmux.session, "Tab"]);
    let s = tmux.wait_for("the table view", |s| s.contains("emb — dim 4"));
    assert!(s.contains("shards") && s.contains("evictions"), "{s}");
    // A daemon that stops answering (SIGSTOP) is reported within the
    // answer timeout (5 s), not waited for; it answers again: the banner goes.
    d.signal("STOP");
    tmux.wait_for("the not-answering banner", |s| s.contains("hkvd down") && s.contains("did not answer in time"));
    d.signal("CONT");
    tmux.wait_for("the banner to go", |s| !s.contains("hkvd down") && s.contains("emb — dim 4"));
    // The daemon goes away: the console says so; it comes back: reconnected.
    drop(c);
    let mut d = d;
    d.signal("TERM");
    assert_eq!(d.wait(Duration::from_secs(30)), 0);
    tmux.wait_for("the daemon-down banner", |s| s.contains("hkvd down") && s.contains("reconnecting"));
    let d = d.restart(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("after", 2, 256)).unwrap();
    tmux.wait_for("the reconnection", |s| s.contains("reconnected") && s.contains("after") && !s.contains("hkvd down"));
    // q quits with status 0.
    tmux.run(&["send-keys", "-t", &tmux.session, "q"]);
    let t = Instant::now();
    loop {
        if let Ok(st) = std::fs::read_to_string(&status_file) {
            assert_eq!(st.trim(), "0", "hkvd top exited with status {st}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "hkvd top did not exit on q:\n{}", tmux.capture());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The daemon never noticed anything wrong.
    assert_eq!(c.stats().unwrap()["errors"], 0);
}

/// `hkvd top` with no terminal (a pipe, cron, CI) panicked inside
/// ratatui's `init` with a backtrace; it now exits 1 with a message, and
/// leaves the daemon alone.
#[test]
fn without_a_terminal_top_exits_1_without_a_panic() {
    let d = Daemon::start(&[]);
    let out = Command::new(env!("CARGO_BIN_EXE_hkvd"))
        .args(["top", "--socket"])
        .arg(&d.socket)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run hkvd top");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    d.client().ping().expect("the daemon still serves");
}

/// The console's model fed the stats document of a real daemon: each
/// figure it shows comes from a field the daemon fills. The console used to
/// read the stats as a JSON value with defaults, and its tests wrote their
/// own JSON, so a field renamed in the daemon showed as zero while every
/// test passed.
#[test]
fn the_console_model_reads_a_real_daemons_stats() {
    let d = Daemon::start(&["--shards", "2"]);
    let mut c = d.client();
    c.create_table(TableSpec::new("emb", 4, 4096)).unwrap();
    let keys: Vec<u64> = (1..=1000).collect();
    c.insert_or_assign("emb", &keys, &vec![0.5; 1000 * 4], None).unwrap();
    let probe: Vec<u64> = (501..=1500).collect();
    c.find("emb", &probe).unwrap();
    assert_eq!(c.find("nope", &[1]).unwrap_err().code(), Some(hkv_client::proto::ErrorCode::UnknownTable));
    c.checkpoint(true, true).unwrap();
    let doc = c.stats_doc().unwrap();
    let s = hkv_tui::model::snapshot(&doc);
    assert_eq!(s.version, env!("CARGO_PKG_VERSION"));
    assert!(s.uptime_s > 0.0 && s.backend.starts_with("cpu"), "{} {}", s.uptime_s, s.backend);
    assert_eq!((s.shards, s.connections), (2, 1));
    assert!(s.requests >= 4 && s.errors >= 1, "{} requests, {} errors", s.requests, s.errors);
    let t = &s.tables[0];
    assert_eq!((t.name.as_str(), t.dim, t.policy.as_str(), t.mode.as_str()), ("emb", 4, "lru", "single"));
    assert_eq!(t.shards.len(), 2);
    assert_eq!((t.size(), t.sum(|x| x.hits), t.sum(|x| x.misses)), (1000, 500, 500));
    assert!(t.capacity() >= 4096 && t.load() > 0.0, "{} {}", t.capacity(), t.load());
    assert_eq!(t.hit_rate(), Some(0.5));
    let find = s.op_names.iter().position(|n| n == "find").expect("find is named");
    let insert = s.op_names.iter().position(|n| n == "insert_or_assign").expect("insert_or_assign is named");
    let by = |i: usize| {
        t.shards.iter().map(|x| (x.ops_by_type[i], x.keys_by_type[i])).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    assert_eq!(by(find).1, 1000);
    assert_eq!(by(insert).1, 1000);
    assert!(by(find).0 >= 1 && t.sum(|x| x.ops) >= 2 && t.sum(|x| x.keys) >= 2000);
    assert!(t.sum(|x| x.fast_bytes + x.host_bytes) > 0, "the table's bytes are counted");
    let (id, entries, _, error) = s.checkpoint.last.clone().expect("the checkpoint just taken");
    assert_eq!((id.len(), entries, error), (16, 1000, None));
    // Two polls make rates, as the console draws them.
    let mut app = hkv_tui::app::App::new(d.socket.display().to_string());
    let t0 = Instant::now();
    app.on_stats(&doc, t0);
    c.find("emb", &keys).unwrap();
    app.on_stats(&c.stats_doc().unwrap(), t0 + Duration::from_secs(1));
    let r = app.rates["emb"];
    assert!(r.ops >= 1.0 && r.keys >= 1000.0, "{r:?}");
}
