//! The daemon's CPU time per key with the live miss-ratio curves on and off
//! (issue 32, item 15): paired rounds on the CPU backend.
//!
//! Each round starts two `hkvd serve --backend cpu`, one with the curves on
//! and one with `--no-mrc`, fills a table of `--capacity` slots to half in
//! each, and then, after a warm-up, sends `--batches` finds of `--batch`
//! random resident keys (every key found) to each, the two daemons'
//! batches interleaved (which goes first alternating), then as many
//! insert_or_assign batches the same way. The pair runs side by side so
//! that whatever else runs on the machine weighs on both alike. A daemon's
//! CPU time (the sum of its threads' run time,
//! `/proc/PID/task/*/schedstat`, ns) over each phase, divided by the keys,
//! is the figure: it includes the curves' every cost (the per-batch
//! filter, the 250 ms drains into the estimator). Prints one row per round
//! and the medians; a round where only one daemon's memory got transparent
//! huge pages is printed as left out (it would measure the pages, not the
//! curves).
//!
//! ```text
//! cargo build --release -p hkvd --bin hkvd --example mrc-cost
//! target/release/examples/mrc-cost [--rounds 8] [--batches 60] [--batch 65536] [--max-keys N] [--aa 1]
//! ```
//!
//! The daemon binary is `$HKVD_BIN`, else `hkvd` beside the example's
//! directory (`target/release/hkvd`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hkv_client::{Client, TableSpec};
use rand::{Rng, SeedableRng};

struct Args {
    rounds: usize,
    batches: usize,
    batch: usize,
    capacity: u64,
    dim: usize,
    /// `--mrc-max-keys` for the daemon with the curves (0: its default).
    max_keys: usize,
    /// `--aa 1`: both daemons without the curves, the harness's own bias.
    aa: bool,
}

fn args() -> Result<Args> {
    let mut a = Args { rounds: 8, batches: 60, batch: 65536, capacity: 1 << 20, dim: 32, max_keys: 0, aa: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v: usize = it.next().with_context(|| format!("{flag} needs a value"))?.parse()?;
        match flag.as_str() {
            "--rounds" => a.rounds = v,
            "--batches" => a.batches = v,
            "--batch" => a.batch = v,
            "--capacity" => a.capacity = v as u64,
            "--dim" => a.dim = v,
            "--max-keys" => a.max_keys = v,
            "--aa" => a.aa = v != 0,
            f => bail!("unknown flag {f} (--rounds, --batches, --batch, --capacity, --dim, --max-keys, --aa)"),
        }
    }
    Ok(a)
}

/// The daemon's threads' CPU time, ns.
fn cpu_ns(pid: u32) -> Result<u64> {
    let mut sum = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let s = std::fs::read_to_string(t?.path().join("schedstat")).unwrap_or_default();
        sum += s.split_whitespace().next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok(sum)
}

struct Daemon {
    child: Child,
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(curves: bool, max_keys: usize) -> Result<Daemon> {
    let bin = std::env::var_os("HKVD_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let exe = std::env::current_exe().expect("exe");
        exe.parent().and_then(|d| d.parent()).expect("target/release").join("hkvd")
    });
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("s.sock");
    let mut cmd = Command::new(&bin);
    cmd.args(["serve", "--backend", "cpu", "--log", "warn", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("st"))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if !curves {
        cmd.arg("--no-mrc");
    } else if max_keys > 0 {
        cmd.args(["--mrc-max-keys", &max_keys.to_string()]);
    }
    let child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
    for _ in 0..100 {
        if socket.exists() {
            return Ok(Daemon { child, _dir: dir, socket });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("hkvd did not open its socket")
}

/// One daemon of a pair, filled and warmed up.
struct Side {
    d: Daemon,
    c: Client,
}

impl Side {
    fn new(a: &Args, curves: bool) -> Result<Side> {
        let d = start(curves, a.max_keys)?;
        let mut c = Client::connect(&d.socket)?;
        c.create_table(TableSpec::new("t", a.dim, a.capacity))?;
        let resident = a.capacity / 2;
        for lo in (1..=resident).step_by(1 << 16) {
            let keys: Vec<u64> = (lo..(lo + (1 << 16)).min(resident + 1)).collect();
            c.insert_or_assign("t", &keys, &vec![0.5; keys.len() * a.dim], None)?;
        }
        Ok(Side { d, c })
    }

    fn cpu(&self) -> Result<u64> {
        cpu_ns(self.d.child.id())
    }

    /// The daemon's memory in transparent huge pages, MiB (AnonHugePages).
    fn huge_mib(&self) -> u64 {
        let r = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", self.d.child.id())).unwrap_or_default();
        let kb =
            r.lines().find(|l| l.starts_with("AnonHugePages:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
        kb.unwrap_or(0u64) >> 10
    }
}

/// One round: per daemon (with the curves, without), (find, insert_or_assign)
/// daemon ns per key, and its memory in huge pages (MiB).
struct Round {
    ns: [(f64, f64); 2],
    huge: [u64; 2],
}

fn run(a: &Args, seed: u64) -> Result<Round> {
    // Which daemon starts (and fills) first alternates with the rounds.
    let on = !a.aa;
    let mut sides = if seed.is_multiple_of(2) {
        [Side::new(a, on)?, Side::new(a, false)?]
    } else {
        let off = Side::new(a, false)?;
        [Side::new(a, on)?, off]
    };
    let resident = a.capacity / 2;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut keys = || -> Vec<u64> { (0..a.batch).map(|_| rng.gen_range(1..=resident)).collect() };
    let values = vec![1.5f32; a.batch * a.dim];
    // Warm-up: the estimator's rate settles, the frames are allocated.
    for _ in 0..a.batches / 4 + 2 {
        let (f, w) = (keys(), keys());
        for s in &mut sides {
            s.c.find("t", &f)?;
            s.c.insert_or_assign("t", &w, &values, None)?;
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut out = [(0.0, 0.0); 2];
    let n = (a.batches * a.batch) as f64;
    for phase in 0..2 {
        let batches: Vec<Vec<u64>> = (0..a.batches).map(|_| keys()).collect();
        let t0 = [sides[0].cpu()?, sides[1].cpu()?];
        for (i, k) in batches.iter().enumerate() {
            for j in [i % 2, 1 - i % 2] {
                let c = &mut sides[j].c;
                if phase == 0 {
                    let f = c.find("t", k)?;
                    anyhow::ensure!(f.found.iter().all(|&x| x), "every key resident");
                } else {
                    c.insert_or_assign("t", k, &values, None)?;
                }
            }
        }
        for j in 0..2 {
            let ns = (sides[j].cpu()? - t0[j]) as f64 / n;
            if phase == 0 {
                out[j].0 = ns;
            } else {
                out[j].1 = ns;
            }
        }
    }
    Ok(Round { ns: out, huge: [sides[0].huge_mib(), sides[1].huge_mib()] })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn main() -> Result<()> {
    let a = args()?;
    println!(
        "daemon CPU ns per key, CPU backend, dim {}, capacity {} (half resident), {} batches of {} keys per phase, curves on vs --no-mrc",
        a.dim, a.capacity, a.batches, a.batch
    );
    println!(
        "{:>5} {:>9} {:>9} {:>7} {:>9} {:>9} {:>7}",
        "round", "find on", "find off", "on/off", "ins on", "ins off", "on/off"
    );
    let (mut fr, mut ir) = (vec![], vec![]);
    let (mut fon, mut foff, mut ion, mut ioff) = (vec![], vec![], vec![], vec![]);
    for r in 0..a.rounds {
        let Round { ns: res, huge } = run(&a, r as u64)?;
        let ([on, off], (f, w)) = (res, (res[0].0 / res[1].0, res[0].1 / res[1].1));
        // The table's memory in huge pages or not moves a find by 30-80 %
        // (shard/BENCHMARKS.md), and a busy machine's kernel does not always
        // give them: a round where one daemon got them and the other did not
        // measures the pages, not the curves, and is left out of the medians.
        if (huge[0] > 64) != (huge[1] > 64) {
            println!("{:>5} left out: huge pages {} MiB with the curves, {} MiB without", r + 1, huge[0], huge[1]);
            continue;
        }
        println!("{:>5} {:>9.1} {:>9.1} {:>7.3} {:>9.1} {:>9.1} {:>7.3}", r + 1, on.0, off.0, f, on.1, off.1, w);
        fr.push(f);
        ir.push(w);
        fon.push(on.0);
        foff.push(off.0);
        ion.push(on.1);
        ioff.push(off.1);
    }
    println!(
        "{:>5} {:>9.1} {:>9.1} {:>7.3} {:>9.1} {:>9.1} {:>7.3}",
        "med",
        median(fon),
        median(foff),
        median(fr),
        median(ion),
        median(ioff),
        median(ir)
    );
    Ok(())
}
