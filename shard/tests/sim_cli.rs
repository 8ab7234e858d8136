//! hkv-sim's options, as a newcomer gives them: values that made it run
//! forever or abort are refused or reported with exit status 1, and an
//! option the run chosen does not use is refused, naming the option. Each
//! run is bounded by `timeout`, and those that allocate much by `prlimit
//! --as`, so that a regression fails the test instead of taking the
//! machine.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};

/// Seconds any run here may take; a hang shows as `timeout`'s status 124.
const LIMIT: &str = "60";

/// hkv-sim under `timeout`, and under `prlimit --as=BYTES` when given.
fn sim(address_space: Option<u64>, args: &[&str]) -> Output {
    let mut c = match address_space {
        Some(bytes) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--as={bytes}")).arg("timeout");
            c
        }
        None => Command::new("timeout"),
    };
    c.args([LIMIT, env!("CARGO_BIN_EXE_hkv-sim")]).args(args).output().expect("timeout and prlimit run")
}

/// A refused run: exit status 1, an error naming `culprit`.
fn assert_refused(out: &Output, culprit: &str, args: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains(culprit), "{args:?}: the error names {culprit}: {err}");
}

fn assert_ok(out: &Output, args: &[&str]) {
    assert!(out.status.success(), "{args:?}: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
}

/// The story: `--alpha inf` (and `--alpha 1e309`, which parses as
/// infinity) was taken, and the Zipf sampler never returned: 100 % CPU,
/// nothing printed, with and without --mrc. NaN and 0 were refused; any
/// value that is not a finite positive number is now.
#[test]
fn a_non_finite_alpha_is_refused() {
    // `--alpha=-inf`: a value starting with `-` is given with `=`.
    for alpha in ["--alpha=inf", "--alpha=1e309", "--alpha=-inf", "--alpha=NaN"] {
        for mrc in [&[][..], &["--mrc"][..]] {
            let args = [&[alpha, "--capacity", "4096", "--stream-multiple", "1"][..], mrc].concat();
            assert_refused(&sim(None, &args), "--alpha", &args);
        }
    }
}

/// The story: the ceiling (the mass of the `capacity` most popular keys)
/// summed one power per key of the key space, so `--keyspace
/// 1099511627776 --capacity 128` replayed its 128 accesses and then spent
/// hours on 2^40 powers. Past 2^20 keys the tail is Euler–Maclaurin's;
/// the ceiling agrees with the sum of every term.
#[test]
fn a_huge_keyspace_reports_its_ceiling_at_once() {
    let ceiling = |keyspace: &str| {
        let args = ["--keyspace", keyspace, "--capacity", "128", "--stream-multiple", "1", "--batch", "32", "--json"];
        let out = sim(None, &args);
        assert_ok(&out, &args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let j: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a json line")).expect("json");
        j["ceiling_hit_rate"].as_f64().expect("a Zipf stream's ceiling")
    };
    let got = ceiling("1099511627776");
    assert!(got > 0.0 && got < 1.0, "{got}");
    // 2^21 keys: the tail past 2^20 estimated, against every term.
    let h = |n: u64| (1..=n).rev().map(|r| (r as f64).powf(-0.99)).sum::<f64>();
    let want = h(128) / h(1 << 21);
    let got = ceiling("2097152");
    assert!((got - want).abs() < 1e-12 * want, "ceiling {got}, every term summed {want}");
}

/// The story: `--mrc` holds the whole stream in memory; with
/// `--capacity 68719476736 --stream-multiple 1` it grew until an
/// allocation failed and the process aborted ("memory allocation of
/// 2147483648 bytes failed", exit 134) after 10 s. The stream is reserved
/// before it is drawn, fallibly, and a trace grows fallibly (/dev/zero
/// never ends), each an error naming the option.
#[test]
fn mrc_reports_a_stream_too_large_for_memory() {
    let args = ["--capacity", "68719476736", "--keyspace", "100", "--stream-multiple", "1", "--mrc"];
    assert_refused(&sim(Some(2_000_000_000), &args), "--stream-multiple", &args);
    let args = ["--trace", "/dev/zero", "--trace-format", "bin", "--capacity", "1024", "--mrc"];
    assert_refused(&sim(Some(200_000_000), &args), "--trace", &args);
}

/// The story: the exact LRU stack beside --mrc's estimate grows with the
/// distinct keys (some 40 bytes each), past what a stream that fits takes
/// (8 bytes an access): 4 Mi nearly all distinct keys fit as a stream in
/// 200 MB, not as a stack. Its growth is fallible now.
#[test]
fn mrc_reports_an_exact_stack_too_large_for_memory() {
    let args =
        ["--mrc", "--capacity", "1048576", "--keyspace", "1099511627776", "--alpha", "0.01", "--stream-multiple", "4"];
    assert_refused(&sim(Some(200_000_000), &args), "--keyspace", &args);
}

/// The story: a replay counts every distinct key's accesses (and the
/// ideal cache holds up to --capacity keys); a trace of ever new keys
/// grew them until an allocation failed and the process aborted. They
/// grow fallibly now: an error, exit 1.
#[test]
fn a_replay_reports_counts_too_large_for_memory() {
    let args = ["--trace", "/dev/urandom", "--trace-format", "bin", "--capacity", "128", "--batch", "32"];
    assert_refused(&sim(Some(200_000_000), &args), "--trace", &args);
}

/// A trace file in the temp directory, removed on drop.
struct Trace(PathBuf);

impl Trace {
    fn csv(name: &str) -> Trace {
        let p = std::env::temp_dir().join(format!("hkv-sim-cli-{}-{name}", std::process::id()));
        let mut f = std::fs::File::create(&p).expect("trace");
        for k in 0..200u64 {
            writeln!(f, "{},{k}", k % 7).expect("trace");
        }
        Trace(p)
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The story: options the run did not use were taken and dropped with
/// exit 0: `--mrc-keys 500` and `--mrc-seed 5` without --mrc,
/// `--lfu-ties lowest-slot --policy lru` (hkvctl refuses the tie rule of a
/// policy that is not lfu), and likewise the Zipf options with --trace
/// and the trace options without it. Each is refused, naming the option;
/// with what it needs, each is taken.
#[test]
fn an_option_the_run_does_not_use_is_refused() {
    let small = ["--capacity", "1024", "--stream-multiple", "1"];
    let trace = Trace::csv("keys.csv");
    let t = trace.0.to_str().expect("a UTF-8 temp path");
    let refused: &[(&str, &[&str])] = &[
        ("--mrc-keys", &["--mrc-keys", "500"]),
        ("--mrc-seed", &["--mrc-seed", "5"]),
        ("--lfu-ties", &["--lfu-ties", "lowest-slot", "--policy", "lru"]),
        ("--lfu-ties", &["--lfu-ties", "lru", "--policy", "adaptive"]),
        ("--lfu-ties", &["--lfu-ties", "lowest-slot", "--mrc"]),
        ("--trace-format", &["--trace-format", "bin"]),
        ("--csv-column", &["--csv-column", "1"]),
        ("--alpha", &["--alpha", "0.5", "--trace", t]),
        ("--keyspace", &["--keyspace", "10", "--trace", t]),
        ("--stream-multiple", &["--stream-multiple", "2", "--trace", t]),
        ("--seed", &["--seed", "3", "--trace", t]),
        ("--csv-column", &["--csv-column", "1", "--trace", t, "--trace-format", "text"]),
    ];
    for (culprit, extra) in refused {
        // The Zipf options are given once: with --trace, `small` is left out.
        let args = if extra.contains(&"--trace") { extra.to_vec() } else { [&small[..], extra].concat() };
        assert_refused(&sim(None, &args), culprit, &args);
    }
    let taken: &[&[&str]] = &[
        &["--mrc", "--mrc-keys", "500", "--mrc-seed", "5"],
        &["--policy", "lru,lfu", "--lfu-ties", "lowest-slot"],
        &["--alpha", "0.5", "--keyspace", "5000", "--seed", "3"],
    ];
    for extra in taken {
        let args = [&small[..], extra].concat();
        assert_ok(&sim(None, &args), &args);
    }
    let args = ["--trace", t, "--csv-column", "1", "--capacity", "128"];
    assert_ok(&sim(None, &args), &args);
}
