//! The console drawn into ratatui's TestBackend from fixed stats.

use std::time::{Duration, Instant};

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use hkv_client::proto::stats::Stats;
use hkv_tui::app::{Action, App, Mode, View};
use ratatui::backend::TestBackend;
use ratatui::Terminal;
use serde_json::{json, Value};

fn shard(
    size: u64,
    cap: u64,
    evictions: u64,
    running: [u64; 3],
    waiting: [u64; 3],
    active: Option<&str>,
) -> serde_json::Value {
    json!({"size": size, "capacity": cap, "hits": 75, "misses": 25, "evictions": evictions, "rejections": 2,
           "ops": [1, 2, 3], "keys": [10, 20, 30], "fast_tier_bytes": 0, "host_tier_bytes": cap * 16,
           "lock": {"active": active, "running": running, "waiting": waiting, "waits": [4, 5, 6], "wait_ns": [1_000_000_000u64, 0, 0]}})
}

/// The fixture read as the typed document the daemon sends. Every key it
/// names must be a field of that document: the fixtures used to be fed to
/// the console as JSON, so a key renamed on either side read as zero and
/// every test still passed.
fn typed(v: &Value) -> Stats {
    let s: Stats = serde_json::from_value(v.clone()).expect("the fixture reads as a stats document");
    covered(v, &serde_json::to_value(&s).unwrap(), "stats");
    s
}

/// Every key of `want` is in `got`, recursively.
fn covered(want: &Value, got: &Value, at: &str) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (k, x) in w.iter().filter(|(_, x)| !x.is_null()) {
                let y = g.get(k).unwrap_or_else(|| panic!("{at}.{k} is not a field of the stats document"));
                covered(x, y, &format!("{at}.{k}"));
            }
        }
        (Value::Array(w), Value::Array(g)) => {
            assert_eq!(w.len(), g.len(), "{at}");
            for (i, (x, y)) in w.iter().zip(g).enumerate() {
                covered(x, y, &format!("{at}[{i}]"));
            }
        }
        _ => {}
    }
}

fn stats(evictions: u64, running_ck: bool) -> Stats {
    typed(&stats_json(evictions, running_ck))
}

fn stats_json(evictions: u64, running_ck: bool) -> Value {
    let mut v = stats_inner(evictions, running_ck);
    v["op_names"] = json!(["find", "contains", "insert_or_assign"]);
    // Op counters grow with `evictions`, so rates exist between two polls.
    for t in v["tables"].as_array_mut().unwrap() {
        for s in t["shards"].as_array_mut().unwrap() {
            s["ops"] = json!([evictions, 0, evictions / 100]);
            s["keys"] = json!([evictions * 1000, 0, evictions * 10]);
        }
    }
    v
}

/// A curve of 30 % at 1/8x up to 90 % at 8x.
fn curve() -> serde_json::Value {
    let p = [(0.125, 0.30), (0.25, 0.42), (0.5, 0.55), (1.0, 0.70), (2.0, 0.80), (4.0, 0.86), (8.0, 0.90)];
    p.iter().map(|&(f, h)| json!({"factor": f, "capacity": (2000.0 * f) as u64, "hit_rate": h})).collect()
}

fn stats_inner(evictions: u64, running_ck: bool) -> serde_json::Value {
    json!({
        "version": "0.1.0", "uptime_s": 3725.0, "backend": "cpu (2 shards)", "shards": 2, "connections": 3,
        "requests": 12345, "errors": 1, "in_flight": 0,
        "tables": [
            {"spec": {"name": "users", "dim": 32, "capacity": 2000, "policy": "lfu", "mode": "dual"}, "size": 0, "capacity": 0,
             "mrc": {"points": curve(), "measured_hit_rate": 0.75, "accesses": 1000, "sampled_accesses": 100, "tracked_keys": 50, "rate": 0.1, "memory_bytes": 4096, "dropped": 7},
             "shards": [shard(600, 1000, evictions, [0, 0, 1], [2, 3, 0], Some("inserter")), shard(400, 1000, 0, [0, 0, 0], [0, 0, 0], None)]},
            {"spec": {"name": "items", "dim": 8, "capacity": 2000, "policy": "lru", "mode": "single"}, "size": 0, "capacity": 0,
             "shards": [shard(10, 1000, 0, [0; 3], [0; 3], None), shard(10, 1000, 0, [0; 3], [0; 3], None)]}
        ],
        "checkpoint": if running_ck {
            json!({"running": {"id": "00ab", "entries_done": 250, "entries_total": 1000, "eta_s": 3.0}, "last": null, "next_in_s": null})
        } else {
            json!({"running": null, "last": {"id": "00aa", "entries": 999, "seconds": 1.5, "error": null}, "next_in_s": 42.0})
        }
    })
}

fn render(app: &App, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| hkv_tui::ui::draw(f, app)).unwrap();
    let buf = t.backend().buffer().clone();
    (0..buf.area.height)
        .map(|y| (0..buf.area.width).map(|x| buf[(x, y)].symbol().to_string()).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

fn key(c: KeyCode) -> KeyEvent {
    KeyEvent::new(c, KeyModifiers::NONE)
}

fn app() -> App {
    let mut a = App::new("/tmp/hkvd.sock".into());
    let t0 = Instant::now();
    a.on_stats(&stats(100, false), t0);
    a.on_stats(&stats(300, false), t0 + Duration::from_secs(2));
    a
}

#[test]
fn overview_shows_what_the_stats_say() {
    let a = app();
    let s = render(&a, 140, 30);
    assert!(s.contains("hkvd 0.1.0") && s.contains("up 1h2m") && s.contains("cpu (2 shards)"), "{s}");
    // users: 1000 of 2000 slots = 50 %, hit rate 75 %.
    let users = s.lines().find(|l| l.contains("users")).unwrap();
    assert!(
        users.contains("1000") && users.contains("2000") && users.contains("50.0%") && users.contains("75.00"),
        "{users}"
    );
    let items = s.lines().find(|l| l.contains("items")).unwrap();
    assert!(items.contains("1.0%"), "{items}");
    // Eviction rate: (300 - 100) / 2 s = 100/s, in the row and, once users
    // is selected (items sorts first), in its sparkline panel.
    assert!(users.split_whitespace().rev().nth(2) == Some("100"), "{users}");
    let mut a = a;
    a.on_key(key(KeyCode::Down));
    let s = render(&a, 140, 30);
    assert!(s.contains("evictions/s 100"), "{s}");
    assert!(s.contains("active: inserter"), "{s}");
    // Summed over both shards: 6 + 6 inserter waits, 1 s + 1 s reader wait.
    let ins = s.lines().find(|l| l.contains("inserters")).unwrap();
    assert!(ins.contains(" 1 ") && ins.contains(" 12 "), "{ins}");
    let rd = s.lines().find(|l| l.contains("readers")).unwrap();
    assert!(rd.contains(" 2 ") && rd.contains("2.00"), "{rd}");
    assert!(s.contains("last checkpoint 00aa: 999 entries in 1.5s") && s.contains("next in 42s"), "{s}");
}

#[test]
fn table_and_device_views() {
    let mut a = app();
    a.on_key(key(KeyCode::Down));
    a.on_key(key(KeyCode::Tab));
    assert_eq!(a.view, View::Table);
    let s = render(&a, 140, 30);
    assert!(s.contains("users — dim 32, lfu, dual") && s.contains("load 50.0%  (1000 of 2000)"), "{s}");
    let row0 = s.lines().find(|l| l.trim_start().starts_with("│0 ") || l.contains("│0    ")).unwrap_or("");
    assert!(
        row0.contains("600")
            && row0.contains("300")
            && row0.contains("inserter")
            && row0.contains("0/0/1")
            && row0.contains("2/3/0"),
        "{s}"
    );
    // users, 2 shards: find (300-100)*2/2 s = 200 batches/s, 200k keys/s;
    // insert_or_assign (3-1)*2/2 = 2 batches/s; contains did not run.
    let find = s.lines().find(|l| l.contains("│find ")).expect("find row");
    assert!(find.contains("200 ") && find.contains("200.0k"), "{find}");
    assert!(s.lines().any(|l| l.contains("insert_or_assign") && l.contains(" 2 ")), "{s}");
    assert!(!s.lines().any(|l| l.contains("│contains")), "{s}");
    // The curve: capacity factors on x, hit rates up to 90 % on y (scale
    // 90 %), the measured 75 % beside the estimate at 1x. The table evicts
    // by LFU: title and legend say the curve is LRU's (issue 32), and the
    // legend counts the samples the estimator lost.
    assert!(s.contains("hit rate by capacity (LRU estimate; table evicts by lfu)"), "{s}");
    assert!(s.contains("measured 75.0% (lfu; LRU est. 70.0%)"), "{s}");
    assert!(s.contains("LRU estimate (7 samples dropped)"), "{s}");
    let axis = s.lines().find(|l| l.contains("1/8x")).expect("x axis");
    assert!(axis.contains("1x") && axis.contains("8x"), "{axis}");
    assert!(s.contains("│90%│"), "{s}");
    let with_curve = render(&a, 160, 45);
    assert!(
        with_curve.contains('⣿') || with_curve.chars().any(|c| ('\u{2801}'..='\u{28ff}').contains(&c)),
        "{with_curve}"
    );
    a.on_key(key(KeyCode::Tab));
    assert_eq!(a.view, View::Devices);
    let s = render(&a, 140, 30);
    let d0 = s.lines().find(|l| l.contains("│0 ")).unwrap();
    assert!(d0.contains("610") && d0.contains("2000"), "{d0}");
}

#[test]
fn help_filter_confirm_and_quit() {
    let mut a = app();
    a.on_key(key(KeyCode::Char('?')));
    assert_eq!(a.mode, Mode::Help);
    // Every help line whole (the longest was cut at the box's edge).
    let help = render(&a, 100, 30);
    assert!(help.contains("filter tables by name (enter keeps, esc clears)"), "{help}");
    assert!(help.contains("lock groups: readers and updaters share, inserters run alone"), "{help}");
    a.on_key(key(KeyCode::Char('x')));
    assert_eq!(a.mode, Mode::Normal);
    for k in [KeyCode::Char('/'), KeyCode::Char('i'), KeyCode::Char('t'), KeyCode::Enter] {
        a.on_key(key(k));
    }
    let s = render(&a, 140, 30);
    assert!(s.contains("tables matching /it") && s.contains("items") && !s.contains("users"), "{s}");
    a.on_key(key(KeyCode::Char('/')));
    a.on_key(key(KeyCode::Esc));
    assert!(render(&a, 140, 30).contains("users"));
    assert_eq!(a.on_key(key(KeyCode::Char('c'))), Action::None);
    assert!(render(&a, 100, 30).contains("Start a checkpoint now?"));
    assert_eq!(a.on_key(key(KeyCode::Char('n'))), Action::None);
    a.on_key(key(KeyCode::Char('c')));
    assert_eq!(a.on_key(key(KeyCode::Char('y'))), Action::Checkpoint);
    assert_eq!(a.on_key(key(KeyCode::Char('q'))), Action::Quit);
    assert_eq!(a.on_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)), Action::Quit);
}

#[test]
fn checkpoint_progress_and_daemon_down() {
    let mut a = app();
    a.on_stats(&stats(300, true), Instant::now() + Duration::from_secs(3));
    let s = render(&a, 120, 30);
    assert!(s.contains("checkpoint 00ab: 250/1000 entries, ETA 3s"), "{s}");
    a.on_down("connection refused".into());
    let s = render(&a, 120, 30);
    assert!(s.contains("hkvd down") && s.contains("connection refused") && s.contains("reconnecting"), "{s}");
    a.on_stats(&stats(0, false), Instant::now() + Duration::from_secs(4));
    assert!(render(&a, 120, 30).contains("reconnected"));
}

/// A narrow terminal drops the overview's least important columns instead
/// of cutting every column short: the ones it keeps are whole.
#[test]
fn a_narrow_overview_keeps_whole_columns() {
    let a = app();
    let users = |s: &str| s.lines().find(|l| l.contains("users")).unwrap().to_string();
    let head = |s: &str| s.lines().find(|l| l.contains("table") && l.contains("size")).unwrap().to_string();
    let wide = render(&a, 140, 30);
    for c in ["dim", "policy", "mode", "capacity", "load", "hit %", "ops/s", "keys/s", "evict/s", "reject/s"] {
        assert!(head(&wide).contains(c), "140 columns: {c} in {}", head(&wide));
    }
    let s = render(&a, 80, 24);
    let (h, u) = (head(&s), users(&s));
    for c in ["size", "capacity", "load", "hit %", "ops/s", "keys/s"] {
        assert!(h.contains(c), "80 columns: {c} in {h}");
    }
    for c in ["reject/s", "mode", "policy"] {
        assert!(!h.contains(c), "80 columns: {c} dropped from {h}");
    }
    assert!(u.contains("1000") && u.contains("2000") && u.contains("50.0%") && u.contains("75.00"), "{u}");
    // At 60x16 the list keeps room for both tables (items: 20 of 2000).
    let s = render(&a, 60, 16);
    let h = head(&s);
    let i = s.lines().find(|l| l.contains("items") && l.contains("%")).unwrap_or_else(|| panic!("{s}"));
    for c in ["size", "load", "hit %"] {
        assert!(h.contains(c), "60 columns: {c} in {h}");
    }
    assert!(i.contains("20") && i.contains("1.0%") && i.contains("75.00"), "{i}");
    assert!(users(&s).contains("50.0%"), "{s}");
    // The table view (users selected): its shards' rows, whole columns.
    let mut a = a;
    a.on_key(key(KeyCode::Down));
    a.on_key(key(KeyCode::Tab));
    for (w, h) in [(80, 24), (60, 16)] {
        let s = render(&a, w, h);
        let head = s.lines().find(|l| l.contains("shard ")).unwrap_or_else(|| panic!("{s}"));
        for c in ["size", "load", "hit %", "evictions"] {
            assert!(head.contains(c), "{w}x{h}: {c} in {head}");
        }
        let row = s.lines().find(|l| l.contains("600")).unwrap_or_else(|| panic!("{w}x{h}: shard 0's row\n{s}"));
        assert!(row.contains("60.0%") && row.contains("75.00") && row.contains("300"), "{row}");
    }
    // The devices view: whole columns at 80.
    a.on_key(key(KeyCode::Tab));
    let s = render(&a, 80, 24);
    let head = s.lines().find(|l| l.contains("entries")).unwrap_or_else(|| panic!("{s}"));
    for c in ["device", "capacity", "load", "device memory"] {
        assert!(head.contains(c), "{c} in {head}");
    }
}

#[test]
fn tiny_terminals_and_odd_stats_do_not_panic() {
    let a = app();
    // Below 60x16 a notice instead of cut views; from there, the views.
    let s = render(&a, 40, 10);
    assert!(s.contains("needs 60x16") && s.contains("40x10"), "{s}");
    let s = render(&a, 60, 16);
    assert!(s.contains("hkvd 0.1.0"), "{s}");
    for (w, h) in [(1, 1), (2, 3), (10, 2), (40, 10), (300, 5)] {
        render(&a, w, h);
    }
    let mut b = App::new("s".into());
    for v in [
        json!({}),
        json!({"tables": [{"spec": {"name": "x", "dim": 1, "capacity": 0}, "shards": []}]}),
        json!({"checkpoint": {"running": {"entries_total": 0}}}),
    ] {
        b.on_stats(&typed(&v), Instant::now());
        render(&b, 80, 24);
        render(&b, 40, 10);
    }
}

/// A backed table's view shows its cluster: where reads were answered,
/// the write-back queue (the window a crash would lose), staleness.
#[test]
fn a_backed_tables_view_shows_its_cluster() {
    let mut v = stats_json(100, false);
    v["tables"][0]["backing"] = json!({
        "mode": "write-back", "hits": 900, "filled": 80, "absent": 20, "late": 0, "unavailable": 0,
        "rows_written": 5000, "bytes_in": 10240, "bytes_out": 655360, "queue_rows": 12, "queue_bytes": 1536,
        "queue_limit_bytes": 67108864, "queue_oldest_ms": 35, "queue_full": 0, "invalidations": 7,
        "node_errors": {"127.0.0.1:7001": 2}, "fetch_p50_us": 410, "fetch_p99_us": 1900,
        "staleness_p50_us": 3000, "staleness_p99_us": 21000
    });
    let mut a = App::new("/tmp/hkvd.sock".into());
    a.on_stats(&typed(&v), Instant::now());
    a.on_key(key(KeyCode::Down));
    a.on_key(key(KeyCode::Tab));
    assert_eq!(a.view, View::Table);
    let s = render(&a, 160, 40);
    assert!(s.contains("cluster (write-back)"), "{s}");
    assert!(s.contains("cache 90.0%") && s.contains("filled 8.0%") && s.contains("absent 2.0%"), "{s}");
    assert!(s.contains("queue: 12 rows") && s.contains("oldest 35 ms"), "{s}");
    assert!(s.contains("staleness p50 3000 µs, p99 21000 µs") && s.contains("node errors 2"), "{s}");
    assert!(!s.contains("unheard"), "no stream entries wait: {s}");
    // Stream entries of this host's writes waiting for the stream's node.
    v["tables"][0]["backing"]["unpublished_entries"] = json!(3);
    v["tables"][0]["backing"]["unpublished_bytes"] = json!(2048);
    v["tables"][0]["backing"]["unpublished_limit_bytes"] = json!(4 << 20);
    v["tables"][0]["backing"]["unpublished_resets"] = json!(1);
    a.on_stats(&typed(&v), Instant::now());
    let s = render(&a, 200, 40);
    assert!(s.contains("unheard: 3 stream entries") && s.contains("1 resets"), "{s}");
    // A table without a cluster shows no such panel.
    let mut b = App::new("/tmp/hkvd.sock".into());
    b.on_stats(&stats(100, false), Instant::now());
    b.on_key(key(KeyCode::Down));
    b.on_key(key(KeyCode::Tab));
    assert!(!render(&b, 160, 40).contains("cluster ("));
}

/// An operator's tester: after `/it` and Enter (which keeps the filter),
/// Esc quit the console instead of clearing the filter, though the help
/// says "esc clears". Esc now clears a kept filter first, and quits only
/// when none is set.
#[test]
fn esc_clears_a_kept_filter_before_it_quits() {
    let mut a = app();
    for k in [KeyCode::Char('/'), KeyCode::Char('i'), KeyCode::Char('t'), KeyCode::Enter] {
        a.on_key(key(k));
    }
    assert!(!render(&a, 140, 30).contains("users"));
    assert_eq!(a.on_key(key(KeyCode::Esc)), Action::None, "Esc with a filter kept clears it");
    assert!(a.filter.is_empty());
    assert!(render(&a, 140, 30).contains("users"));
    assert_eq!(a.on_key(key(KeyCode::Esc)), Action::Quit, "Esc without a filter quits");
}

/// The same tester: at 80x24 the lock-groups panel cut a column mid-word
/// (`waiting    w`), against "the least important ones are left out
/// rather than every column cut short"; at 60x16 the checkpoint status
/// line was cut off (a daemon's ids have 16 digits). The panel keeps whole
/// columns; the status line takes the longest form that fits.
#[test]
fn the_lock_panel_and_the_checkpoint_line_fit_small_terminals() {
    let mut v = stats_json(300, false);
    v["checkpoint"]["last"] = json!({"id": "000001a2468b1985", "entries": 123456, "seconds": 12.5, "error": null});
    let mut a = App::new("/tmp/hkvd.sock".into());
    a.on_stats(&typed(&v), Instant::now());
    a.on_key(key(KeyCode::Down));
    let titles = ["group", "running", "waiting", "waits", "wait", "s"];
    for (w, h) in [(80, 24), (100, 30), (140, 30)] {
        let s = render(&a, w, h);
        let head = s.lines().find(|l| l.contains("││group")).unwrap_or_else(|| panic!("{w}x{h}: lock header\n{s}"));
        let panel = head.rsplit("││").next().expect("the lock panel").trim_end_matches('│');
        assert!(panel.split_whitespace().all(|t| titles.contains(&t)), "{w}x{h}: a column cut: {panel:?}");
        assert!(panel.contains("running") && panel.contains("waiting"), "{w}x{h}: {panel:?}");
        let readers = s.lines().find(|l| l.contains("readers")).expect("readers");
        let cells = readers.rsplit("││").next().expect("panel").trim_end_matches('│').split_whitespace().count();
        assert_eq!(cells, panel.split_whitespace().count() - usize::from(panel.contains("wait s")), "{w}x{h}");
    }
    for (w, h) in [(60, 16), (80, 24)] {
        let s = render(&a, w, h);
        let line = s.lines().find(|l| l.contains("123456")).unwrap_or_else(|| panic!("{w}x{h}: status line\n{s}"));
        assert!(line.contains("12.5s") && line.contains("next") && line.contains("42s"), "{w}x{h}: {line:?}");
    }
    assert!(render(&a, 80, 24).contains("last checkpoint 000001a2468b1985: 123456 entries in 12.5s  next in 42s"));
    // A failed one keeps FAILED and the schedule, the error cut with "…".
    v["checkpoint"]["last"] = json!({"id": "000001a2468b1985", "entries": 0, "seconds": 0.1,
        "error": "cannot write /var/lib/hkvd/checkpoints/chunks/000001a2468b1985/t0000.tmp: No space left on device"});
    a.on_stats(&typed(&v), Instant::now());
    let s = render(&a, 60, 16);
    let line = s.lines().find(|l| l.contains("FAILED")).unwrap_or_else(|| panic!("{s}"));
    assert!(line.contains('…') && line.trim_end().ends_with("next 42s"), "{line:?}");
}

/// A table whose curve has too few sampled lookups (the daemon sends no
/// points) says so, and does not blame --no-mrc.
#[test]
fn a_curve_that_is_not_ready_says_so() {
    let mut v = stats_json(300, false);
    v["tables"][0]["mrc"]["points"] = json!([]);
    v["tables"][0]["mrc"]["sampled_accesses"] = json!(4);
    let mut a = App::new("/tmp/hkvd.sock".into());
    a.on_stats(&typed(&v), Instant::now());
    a.on_key(key(KeyCode::Down));
    a.on_key(key(KeyCode::Tab));
    let s = render(&a, 140, 30);
    assert!(s.contains("no estimate yet: 4 of 100 sampled lookups") && !s.contains("--no-mrc"), "{s}");
    a.on_key(key(KeyCode::Up));
    assert!(render(&a, 140, 30).contains("--no-mrc"), "items has no curve at all");
}

/// A tester's finding: the help box had a fixed width, and its first line
/// read `q, Esc, Ctrl-C   quit (the terminal is restored; Esc clears a
/// filt` at 200, 120 and 100 columns alike. The box is as wide as its
/// longest line; on a narrower terminal the lines wrap, nothing is lost.
#[test]
fn the_help_box_holds_its_longest_line() {
    let mut a = app();
    a.on_key(key(KeyCode::Char('?')));
    let quit = "q, Esc, Ctrl-C   quit (the terminal is restored; Esc clears a filter first)";
    for w in [200, 120, 100, 80] {
        let s = render(&a, w, 30);
        assert!(s.contains(quit), "{w} columns:\n{s}");
    }
    // At the smallest console the long lines wrap: every word is there.
    let s = render(&a, 60, 16);
    let words: Vec<&str> = s.split(['│', ' ']).collect();
    for w in quit.split(' ').chain("lock groups: readers and updaters share, inserters run alone".split(' ')) {
        assert!(words.contains(&w), "{w:?} missing at 60x16:\n{s}");
    }
}

/// The same tester, at 200 columns: the name column (table, shard,
/// device, operation) took what the other columns left, some 96 cells,
/// and pushed them to the far right; at 80 the header line was cut
/// mid-value (`1 conn  114.8`). Name columns are as wide as their names
/// (at most 32 cells), and the header leaves out whole items.
#[test]
fn name_columns_fit_their_names_and_the_header_drops_whole_items() {
    let mut a = app();
    let gap = |s: &str, first: &str, next: &str| {
        let l = s.lines().find(|l| l.contains(first) && l.contains(next)).unwrap_or_else(|| panic!("{s}"));
        l.find(next).unwrap() - l.find(first).unwrap()
    };
    let s = render(&a, 200, 40);
    // "table" padded to 8 cells, a space, then "dim".
    assert!(gap(&s, "table", "dim") <= 10, "{s}");
    a.on_key(key(KeyCode::Down));
    a.on_key(key(KeyCode::Tab));
    let s = render(&a, 200, 45);
    assert!(gap(&s, "shard", "size") <= 7, "{s}");
    // insert_or_assign, the longest operation, then its figures.
    assert!(gap(&s, "operation", "batches/s") <= 18, "{s}");
    a.on_key(key(KeyCode::Tab));
    let s = render(&a, 200, 40);
    assert!(gap(&s, "device", "tables") <= 9, "{s}");
    // A long name is cut at the cap rather than pushing the columns out.
    let mut v = stats_json(100, false);
    v["tables"][0]["spec"]["name"] = json!("n".repeat(80));
    let mut b = App::new("/tmp/hkvd.sock".into());
    b.on_stats(&typed(&v), Instant::now());
    let s = render(&b, 200, 40);
    assert!(gap(&s, "table", "dim") <= 34, "{s}");
    // The header: whole items at any width, the socket going first.
    let full = render(&a, 200, 40).lines().next().unwrap().to_string();
    let items: Vec<&str> = full.split("  ").map(str::trim).filter(|i| !i.is_empty()).collect();
    assert!(items.contains(&"3 conn") && items.contains(&"/tmp/hkvd.sock"), "{full}");
    for w in [80, 70, 60] {
        let head = render(&a, w, 24).lines().next().unwrap().to_string();
        for i in head.split("  ").map(str::trim).filter(|i| !i.is_empty()) {
            assert!(items.contains(&i), "{w} columns: {i:?} is cut in {head:?}");
        }
        assert!(head.contains("up 1h2m") && head.contains("1 err"), "{w}: {head:?}");
    }
}
