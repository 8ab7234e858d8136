//! hkv-sim on key traces the tests write: both trace formats (given and
//! detected) replay the same keys, hit rates are exact where the access
//! pattern decides them, `--capacities` replays the same trace at each
//! capacity, a run without eviction reports no first-eviction load factor,
//! and the Lfu tie rules keep (or lose) newcomers as issue 27 describes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A trace file in the temp directory, removed on drop.
struct Trace(PathBuf);

impl Trace {
    fn bin(name: &str, keys: &[u64]) -> Trace {
        let mut bytes = Vec::with_capacity(keys.len() * 8);
        for k in keys {
            bytes.extend_from_slice(&k.to_le_bytes());
        }
        Trace::raw(name, &bytes)
    }

    fn text(name: &str, keys: &[u64]) -> Trace {
        let mut s = String::new();
        for (i, k) in keys.iter().enumerate() {
            s.push_str(&format!("{k}\n"));
            if i == 3 {
                s.push('\n'); // blank lines are skipped
            }
        }
        Trace::raw(name, s.as_bytes())
    }

    fn raw(name: &str, bytes: &[u8]) -> Trace {
        let p = std::env::temp_dir().join(format!("hkv-sim-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        Trace(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hkv-sim")).args(args).output().expect("hkv-sim runs")
}

/// The JSON object of a successful run (its last line).
fn sim_json(trace: &Trace, args: &[&str]) -> Value {
    let mut all = vec!["--trace", trace.path().to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let out = sim(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{args:?}: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

fn cycle(distinct: u64, times: usize) -> Vec<u64> {
    (0..times).flat_map(|_| (0..distinct).map(|i| i * 0x9e37_79b9 + 7)).collect()
}

/// 100 keys, ten times, in one bucket of 128: every access after the first
/// pass hits, nothing is evicted, and the report says so (it used to print
/// the final load factor as the first eviction's).
#[test]
fn both_formats_replay_the_same_keys_and_no_eviction_reports_none() {
    let keys = cycle(100, 10);
    let (bin, text) = (Trace::bin("fit.bin", &keys), Trace::text("fit.txt", &keys));
    let mut runs = vec![];
    for (t, format) in [(&bin, "bin"), (&bin, "auto"), (&text, "text"), (&text, "auto")] {
        let j = sim_json(t, &["--capacity", "128", "--batch", "10", "--trace-format", format]);
        assert_eq!(j["trace_format"], if t.path() == bin.path() { "bin" } else { "text" }, "{format}");
        assert_eq!((j["accesses"].as_u64(), j["distinct_keys"].as_u64()), (Some(1000), Some(100)));
        assert_eq!((j["hits"].as_u64(), j["ideal_hits"].as_u64()), (Some(900), Some(900)), "{format}");
        assert!((j["hit_rate"].as_f64().unwrap() - 0.9).abs() < 1e-12, "{format}");
        assert!(j["first_eviction_load_factor"].is_null(), "{format}: {j}");
        assert_eq!(j["evicted"], false);
        assert!((j["final_load_factor"].as_f64().unwrap() - 100.0 / 128.0).abs() < 1e-12);
        assert!(j["ceiling_hit_rate"].is_null(), "a trace has no Zipf ceiling");
        runs.push(j);
    }
    let strip = |j: &Value| {
        let mut j = j.clone();
        for f in ["trace", "trace_format", "seconds"] {
            j.as_object_mut().unwrap().remove(f);
        }
        j
    };
    assert!(runs.iter().all(|j| strip(j) == strip(&runs[0])), "the formats replay the same keys");
    let out = sim(&["--trace", text.path().to_str().unwrap(), "--capacity", "128", "--batch", "10"]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.lines().any(|l| l.starts_with("first-eviction load factor") && l.ends_with("none")), "{s}");
}

/// A cycle of 200 keys: at 128 slots Lru never hits (table and ideal); at
/// 256 (2 buckets, dual mode) everything after the first pass does.
#[test]
fn capacities_replay_the_same_trace_at_each_capacity() {
    let t = Trace::bin("cycle.bin", &cycle(200, 5));
    let j = sim_json(&t, &["--capacity", "256", "--capacities", "1/2x,1x", "--mode", "dual", "--batch", "10"]);
    let runs = j["runs"].as_array().expect("one object per capacity");
    let got: Vec<(u64, u64, u64)> = runs
        .iter()
        .map(|r| (r["capacity"].as_u64().unwrap(), r["hits"].as_u64().unwrap(), r["ideal_hits"].as_u64().unwrap()))
        .collect();
    assert_eq!(got, [(128, 0, 0), (256, 800, 800)]);
    assert_eq!(runs[0]["first_eviction_load_factor"].as_f64(), Some(1.0), "one bucket evicts when full");
    assert!(runs[1]["first_eviction_load_factor"].is_null());
    // Slot counts work as well as factors.
    let j = sim_json(&t, &["--capacities", "256", "--mode", "dual", "--batch", "10"]);
    assert_eq!(j["capacity"].as_u64(), Some(256));
}

/// Issue 27 in one bucket: 128 keys once, then two newcomers alternating.
/// With LRU ties the newcomers take the two oldest slots and hit from their
/// second access on, as in the ideal Lfu; with the reference's lowest-slot
/// rule each takes slot 0 from the other and never hits.
#[test]
fn lfu_ties_keep_alternating_newcomers() {
    let mut keys: Vec<u64> = (1..=128).collect();
    keys.extend([1000u64, 1001].repeat(10));
    let t = Trace::text("lfu.txt", &keys);
    let args = ["--capacity", "128", "--batch", "1", "--policy", "lfu", "--lfu-ties"];
    let lru = sim_json(&t, &[&args[..], &["lru"]].concat());
    let counts = |j: &Value| (j["accesses"].as_u64(), j["hits"].as_u64(), j["ideal_hits"].as_u64());
    assert_eq!(counts(&lru), (Some(148), Some(18), Some(18)));
    assert_eq!(lru["top_n_retention"].as_f64(), Some(1.0));
    let slot = sim_json(&t, &[&args[..], &["lowest-slot"]].concat());
    assert_eq!(counts(&slot), (Some(148), Some(0), Some(18)));
    assert!((slot["top_n_retention"].as_f64().unwrap() - 127.0 / 128.0).abs() < 1e-12);
}

#[test]
fn bad_traces_are_refused_with_the_place() {
    let t = Trace::raw("bad.txt", b"12\n13\nfourteen\n");
    let out = sim(&["--trace", t.path().to_str().unwrap(), "--capacity", "128"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 3") && err.contains("fourteen"), "{err}");
    let t = Trace::raw("short.bin", &[1, 2, 3, 4, 5, 6, 7, 8, 9, 0xff, 0xfe]);
    let out = sim(&["--trace", t.path().to_str().unwrap(), "--capacity", "128"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("3 bytes"), "{err}");
    let t = Trace::bin("reserved.bin", &[5, u64::MAX]);
    let out = sim(&["--trace", t.path().to_str().unwrap(), "--capacity", "128"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("reserved") && err.contains("index 1"), "{err}");
    // A binary file read as csv (or text) is refused by its line, naming the binary formats.
    let t = Trace::raw("binary.csv", b"1,2\n3,4\n\xff\xfe\x00\x01,5\n");
    let out = sim(&["--trace", t.path().to_str().unwrap(), "--capacity", "128"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("line 3: not UTF-8") && err.contains("--trace-format bin"), "{err}");
}

/// Issue 32, item 17. The story: with its default `--batch 1024`, hkv-sim
/// looked a whole batch up before writing it, so a key repeated inside a
/// batch counted as two misses, and bursty traffic read 4.5–35 pp below the
/// per-access hit rate (what `--batch 1` and the miss-ratio curve report).
/// Now `hit_rate` is per access at any batch size, and the per-batch-lookup
/// figure is reported beside it as `batch_hit_rate`.
#[test]
fn hit_rates_are_per_access_whatever_the_batch() {
    // Runs of four of each key, the runs inside one batch: per access
    // three of four hit; per batch lookup none does.
    let runs: Vec<u64> = (0..4096u64).flat_map(|i| [i * 0x9e37_79b9 + 11; 4]).collect();
    let t = Trace::bin("runs.bin", &runs);
    let j = sim_json(&t, &["--capacity", "65536", "--batch", "1024"]);
    assert!((j["hit_rate"].as_f64().unwrap() - 0.75).abs() < 1e-12, "{j}");
    assert!((j["ideal_hit_rate"].as_f64().unwrap() - 0.75).abs() < 1e-12, "{j}");
    assert_eq!(j["batch_hit_rate"].as_f64().unwrap(), 0.0, "{j}");
    // Bursty reuse (runs of 1 to 4, then revisits) at a capacity that
    // evicts: batch 1024 per access agrees with batch 1 (where the two
    // figures are one), the batch-lookup figure reads well below.
    let mut x = 5u64;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x >> 33
    };
    let mut keys = vec![];
    while keys.len() < 200_000 {
        let k = if next() % 2 == 0 { next() % 20_000 } else { 1_000_000 + next() };
        keys.extend(std::iter::repeat_n(k, 1 + (next() % 4) as usize));
    }
    let t = Trace::bin("bursty.bin", &keys);
    let one = sim_json(&t, &["--capacity", "8192", "--batch", "1"]);
    let big = sim_json(&t, &["--capacity", "8192", "--batch", "1024"]);
    let (h1, h) = (one["hit_rate"].as_f64().unwrap(), big["hit_rate"].as_f64().unwrap());
    let hb = big["batch_hit_rate"].as_f64().unwrap();
    eprintln!("bursty: per access {h1:.4} (batch 1), {h:.4} (batch 1024); per batch lookup {hb:.4}");
    assert!((h - h1).abs() < 0.005, "per access: batch 1024 {h}, batch 1 {h1}");
    assert!(h1 - hb > 0.2, "per batch lookup {hb} against per access {h1}");
    assert_eq!(one["batch_hit_rate"], one["hit_rate"]);
}

/// Issue 36: libCacheSim's oracleGeneral records and CSV columns replay the
/// same keys as the plain trace, and `--policy` runs each policy in turn.
#[test]
fn oracle_and_csv_traces_and_a_policy_list() {
    let keys = cycle(100, 10);
    let bin = Trace::bin("p.bin", &keys);
    let mut oracle = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        oracle.extend_from_slice(&(i as u32).to_le_bytes());
        oracle.extend_from_slice(&k.to_le_bytes());
        oracle.extend_from_slice(&1u32.to_le_bytes());
        oracle.extend_from_slice(&(-1i64).to_le_bytes());
    }
    let oracle = Trace::raw("p.oracleGeneral.bin", &oracle);
    let csv: String = std::iter::once("time,key\n".to_string())
        .chain(keys.iter().enumerate().map(|(i, k)| format!("{i},{k}\n")))
        .collect();
    let csv = Trace::raw("p.csv", csv.as_bytes());
    let args = ["--capacity", "128", "--batch", "10", "--policy", "lru,adaptive"];
    let base = sim_json(&bin, &args);
    let oj = sim_json(&oracle, &args);
    let cj = sim_json(&csv, &[&args[..], &["--csv-column", "1"]].concat());
    for j in [&oj, &cj] {
        for (a, b) in j["runs"].as_array().unwrap().iter().zip(base["runs"].as_array().unwrap()) {
            assert_eq!((a["hits"].as_u64(), a["accesses"].as_u64()), (b["hits"].as_u64(), Some(1000)));
        }
    }
    assert_eq!(oj["runs"][0]["trace_format"], "oracle");
    assert_eq!(cj["runs"][0]["trace_format"], "csv");
    let policies: Vec<&str> = base["runs"].as_array().unwrap().iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["lru", "adaptive"]);
    assert!(base["runs"].as_array().unwrap().iter().all(|r| r["hits"].as_u64() == Some(900)), "100 keys fit");
}

/// The child's output once it exits; killed (and the test failed) after a
/// minute, so that a trace reader stuck on a pipe fails the test instead of
/// hanging it.
fn output_within_a_minute(mut child: Child) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("hkv-sim still runs after a minute: {:?}", child.wait_with_output());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The JSON object of a run that succeeded (its last line).
fn json_of(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// The story: `--trace-format auto` read a trace's first 4 KiB to guess
/// its format, then opened the path again to replay it. A pipe, a FIFO or a
/// `<(…)` does not start over, so `cat rep.bin | hkv-sim --trace
/// /dev/stdin` silently replayed 99488 of 100000 keys, and a text trace lost
/// its first lines and had the key at the 4 KiB mark cut in two. Now the
/// file is opened once and every key is replayed; a pipe that several
/// replays would have to read again is refused, naming it.
#[test]
fn a_piped_trace_is_read_whole() {
    let keys: Vec<u64> = (0..20_000u64).map(|i| i * 0x9e37_79b9 + 7).collect();
    let bin: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    let text: String = keys.iter().map(|k| format!("{k}\n")).collect();
    let args = ["--capacity", "1024", "--batch", "64", "--json"];
    let fifo = std::env::temp_dir().join(format!("hkv-sim-{}-fifo", std::process::id()));
    for (bytes, format) in [(bin, "bin"), (text.into_bytes(), "text")] {
        let check = |out: &Output, how: &str| {
            let j = json_of(out);
            let got = (j["trace_format"].as_str(), j["accesses"].as_u64(), j["distinct_keys"].as_u64());
            assert_eq!(got, (Some(format), Some(20_000), Some(20_000)), "{format} trace through {how}");
        };
        // A pipe on stdin.
        let mut child = Command::new(env!("CARGO_BIN_EXE_hkv-sim"))
            .args(["--trace", "/dev/stdin"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let b = bytes.clone();
        let writer = std::thread::spawn(move || stdin.write_all(&b));
        check(&output_within_a_minute(child), "a pipe");
        writer.join().unwrap().unwrap();
        // A FIFO (the writer blocks until hkv-sim opens it; left behind if
        // hkv-sim never does, the test having failed).
        let _ = std::fs::remove_file(&fifo);
        assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success(), "mkfifo");
        let f = fifo.clone();
        std::thread::spawn(move || std::fs::File::create(f).and_then(|mut w| w.write_all(&bytes)));
        let child = Command::new(env!("CARGO_BIN_EXE_hkv-sim"))
            .arg("--trace")
            .arg(&fifo)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        check(&output_within_a_minute(child), "a FIFO");
    }
    // Two capacities would read the FIFO twice: refused before it is opened.
    let out = sim(&["--trace", fifo.to_str().unwrap(), "--capacity", "1024", "--capacities", "1x,2x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--trace"), "{err}");
    std::fs::remove_file(&fifo).unwrap();
}

/// The story: the table rounds its capacity up to whole 128-slot buckets,
/// but hkv-sim derived the rest from the flag: `--capacity 1 --batch 1
/// --stream-multiple 100` replayed 100 accesses over 10 keys through 128
/// slots and warned that --batch 1 was above a quarter of the capacity;
/// `--capacity 1099511627776 --stream-multiple 1` was refused as a
/// `--keyspace` the user never gave. Now the stream, the keyspace and the
/// note follow the table's slots, and a derived value out of range names
/// the flags given.
#[test]
fn what_follows_from_the_capacity_follows_the_tables_slots() {
    let out = sim(&["--capacity", "1", "--batch", "1", "--stream-multiple", "100", "--json"]);
    let j = json_of(&out);
    let got = (j["capacity"].as_u64(), j["keyspace"].as_u64(), j["accesses"].as_u64());
    assert_eq!(got, (Some(128), Some(1280), Some(12_800)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("--batch"), "batch 1 is no quarter of 128 slots: {err}");
    let out = sim(&["--capacity", "1099511627776", "--stream-multiple", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--capacity 1099511627776"), "{err}");
}

/// The story: `--mrc` replays no table; it compares the estimated and the
/// exact LRU curves at fixed factors of --capacity. A `--policy lfu`,
/// `--mode dual` or `--capacities` given with it was dropped (a note on
/// stderr, exit 0), so the LRU curve could be read as the one asked for.
/// Each is refused now, naming the flag; `--policy lru` is what --mrc
/// measures and is taken.
#[test]
fn mrc_refuses_the_table_replay_flags() {
    for extra in [["--policy", "lfu"], ["--mode", "dual"], ["--capacities", "1x,2x"]] {
        let out = sim(&[&["--mrc", "--capacity", "1024", "--stream-multiple", "2"][..], &extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(extra[0]), "{extra:?}: {err}");
    }
    let out = sim(&["--mrc", "--capacity", "1024", "--stream-multiple", "2", "--policy", "lru"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The story: a binary trace forced to `--trace-format csv` was read as one
/// line of NUL-filled text, taken as a header, and reported as holding no
/// keys; and a quoted field (`"1"`, what many CSV writers put out) was
/// refused as not a decimal key, while a quoted comma in an earlier column
/// would have moved the key. Now the binary file is refused as not CSV
/// text, at its line, and quoted fields are read as RFC 4180 has them.
#[test]
fn csv_reads_quoted_fields_and_refuses_binary() {
    let keys = cycle(100, 10);
    let bin = Trace::bin("q.bin", &keys);
    let base = sim_json(&bin, &["--capacity", "128", "--batch", "10"]);
    let csv: String = std::iter::once("\"name, first\",\"key\"\n".to_string())
        .chain(keys.iter().enumerate().map(|(i, k)| format!("\"user {i}, \"\"x\"\"\",\"{k}\"\n")))
        .collect();
    let csv = Trace::raw("q.csv", csv.as_bytes());
    let j = sim_json(&csv, &["--capacity", "128", "--batch", "10", "--csv-column", "1"]);
    let counts = |j: &Value| (j["accesses"].as_u64(), j["distinct_keys"].as_u64(), j["hits"].as_u64());
    assert_eq!(counts(&j), counts(&base));
    assert_eq!(counts(&j), (Some(1000), Some(100), Some(900)));
    // Small keys: valid UTF-8, no line break, one "line" of NULs.
    let small = Trace::bin("small.bin", &(1..=9).collect::<Vec<u64>>());
    let out = sim(&["--trace", small.path().to_str().unwrap(), "--trace-format", "csv", "--capacity", "128"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("line 1: not CSV text"), "{err}");
}

/// A bad --trace-format is refused before the trace is opened: opening a
/// FIFO that no one writes blocks, and the refusal came only after it.
#[test]
fn a_bad_trace_format_is_refused_before_the_trace_is_opened() {
    let fifo = std::env::temp_dir().join(format!("hkv-sim-{}-nowriter", std::process::id()));
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success(), "mkfifo");
    let child = Command::new(env!("CARGO_BIN_EXE_hkv-sim"))
        .args(["--trace", fifo.to_str().unwrap(), "--trace-format", "nope"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within_a_minute(child);
    let _ = std::fs::remove_file(&fifo);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("'nope'") && err.contains("bin, text, oracle, csv, auto"), "{err}");
}
