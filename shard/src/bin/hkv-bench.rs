//! hkv-bench: the table's throughput with the protocol of `shard/TARGETS.md`.
//!
//! For each dim and load factor λ, the table is filled with unique keys to λ
//! (single mode cannot reach exactly 1.0 without eviction: it is filled with
//! up to 3 × capacity keys, the achieved λ is printed), then each operation
//! runs on batches of `--batch` keys, `--runs` times, and the median is
//! reported in billions of key-value pairs per second (B-KV/s):
//! - find, contains, assign: keys drawn from the inserted ones;
//! - insert_or_assign, insert_and_evict: keys never seen (misses that insert),
//!   erased again untimed afterwards so λ stays put (at λ = 1.0 they evict);
//! - find_or_insert: half inserted keys, half new ones (erased afterwards);
//! - export_batch, export_batch_if: as the reference's benchmark, the slots
//!   that hold about `--batch` entries at λ (`--batch` / λ × 0.995 slots)
//!   from slot 0, credited `--batch` keys (export_batch_if keeps scores at or
//!   above the median). With a host tier, slot 0 is in device memory; the
//!   same export from the first host-tier slot is printed under the table.
//!
//! With `--key-mix reference` (CUDA backend, device batches) the keys of
//! every operation but the exports are those of the reference's own
//! benchmark instead: 60 % the most recently inserted keys, then 40 % keys
//! never inserted (which miss, or are inserted and erased again untimed),
//! and the figures count keys per second in units of 2^30, as it does.
//!
//! With `--sample-rate R` (issue 27's cost check) the table samples keys
//! for miss-ratio curves at rate R (a sampler of threshold R × 2^64) and
//! every figure is measured twice, call by call alternating (off then on,
//! then on then off, ...): without sampling (first row) and with it (the
//! row marked `sampled`, its change in brackets). After each
//! sampled call the table's buffer (CUDA: device ring) is drained, untimed,
//! into an `Mrc` with the same fixed rate, as a daemon's actor would; the
//! samples and drops are printed under the table.
//!
//! find* and find_or_insert* return device addresses: CUDA backend on
//! device batches only. With `--host-buffers` the CUDA backend is timed
//! like the CPU one, through the table's calls on host arrays.
//! Beside it, the same find / insert workload on moka (a concurrent Rust
//! cache) of the same capacity, all cores, at the same λ.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use hkv_shard::mrc::{Mrc, MrcConfig, Sampler, Samples, SAMPLE_SEED};
use hkv_shard::{Backend, BucketMode, Filter, LfuTies, SampleDrain, ScorePolicy, Shard, TableConfig};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

#[derive(Parser, Debug)]
#[command(name = "hkv-bench", about = "Throughput of every table operation (B-KV/s), shard/TARGETS.md protocol")]
struct Args {
    /// The kernel tuning of the CUDA tables, from the `HKV_*` variables.
    #[arg(skip)]
    tuning: hkv_shard::CudaTuning,
    /// Backend: cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Table capacity in slots (the reference runs 128 Mi on the GPU).
    #[arg(long, default_value_t = 1 << 24)]
    capacity: u64,
    /// Keys per operation.
    #[arg(long, default_value_t = 1 << 20)]
    batch: usize,
    /// Timed runs per figure (the median is printed).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Value dims, comma separated.
    #[arg(long, default_value = "8,32,64", value_delimiter = ',')]
    dims: Vec<usize>,
    /// Load factors, comma separated.
    #[arg(long, default_value = "0.5,0.75,1.0", value_delimiter = ',')]
    lambdas: Vec<f64>,
    /// Bucket mode: single or dual.
    #[arg(long, default_value = "single")]
    mode: String,
    /// Score policy: lru, lfu, epoch-lru, epoch-lfu or adaptive (custom
    /// needs caller scores, which the benchmark does not pass).
    #[arg(long, default_value = "lru")]
    policy: ScorePolicy,
    /// Lfu tie rule: lru (least recently written of equal frequencies goes)
    /// or lowest-slot (the reference's rule).
    #[arg(long, default_value = "lru")]
    lfu_ties: LfuTies,
    /// Whether find hits refresh scores (true or false, as hkvctl's
    /// create-table takes it); default the policy's (on for adaptive only).
    #[arg(long)]
    reads_refresh: Option<bool>,
    /// Skip the moka comparison.
    #[arg(long)]
    no_moka: bool,
    /// Only these operations (comma separated names from the table header).
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// CUDA: bytes of values kept in device memory (the rest in pinned host memory); default all.
    #[arg(long)]
    fast_tier_bytes: Option<u64>,
    /// CUDA: time the table's calls on host arrays (wall clock, the copies
    /// to and from the device included) instead of device-resident batches.
    #[arg(long)]
    host_buffers: bool,
    /// Keys of each timed call: `hits` (this protocol: lookups and updates
    /// of inserted keys, inserts of new keys, find_or_insert half and half)
    /// or `reference` (the reference's benchmark: 60 % the most recently
    /// inserted keys then 40 % new keys for every operation, figures in
    /// 2^30 keys/s). `reference`: CUDA backend on device batches only.
    #[arg(long, default_value = "hits")]
    key_mix: String,
    /// Miss-ratio sampling: the share of keys sampled, in (0, 1]; every
    /// figure is then measured without and with sampling, alternating
    /// call by call (two rows per λ).
    #[arg(long)]
    sample_rate: Option<f64>,
    /// CUDA device batches, find_or_insert: each timed call draws its keys
    /// Zipf(ALPHA) over `--key-space` keys, with repeats (a training
    /// loop's ids before deduplication); at λ 1.0 the table stays full.
    #[arg(long)]
    zipf: Option<f64>,
    /// The keys `--zipf` draws from.
    #[arg(long, default_value_t = 1 << 24)]
    key_space: u64,
}

/// Whether sampling is on for each of the two calls of run `run`: off
/// first in even runs, on first in odd ones, so that neither side always
/// follows the other (a call after an insert's untimed restore, say).
fn sample_order(run: usize) -> [bool; 2] {
    if run.is_multiple_of(2) {
        [false, true]
    } else {
        [true, false]
    }
}

/// Sampling during a benchmark (`--sample-rate`): the sampler set on the
/// table for the sampled calls, and the estimator the drains feed.
struct SampleRun {
    sampler: Sampler,
    mrc: Mrc,
    buf: Samples,
    total: SampleDrain,
}

impl SampleRun {
    fn new(rate: Option<f64>) -> Result<Option<SampleRun>> {
        let Some(r) = rate else { return Ok(None) };
        if !(r > 0.0 && r <= 1.0) {
            bail!("--sample-rate must be in (0, 1], not {r}");
        }
        let threshold = if r >= 1.0 { u64::MAX } else { (r * 18_446_744_073_709_551_616.0) as u64 };
        // A budget large enough that the estimator keeps the rate it is given.
        let cfg = MrcConfig { max_keys: 1 << 22, seed: SAMPLE_SEED, initial_rate: r, reads_refresh: false };
        Ok(Some(SampleRun {
            sampler: Sampler { seed: SAMPLE_SEED, threshold },
            mrc: Mrc::new(cfg, 0),
            buf: Samples::default(),
            total: SampleDrain::default(),
        }))
    }

    /// Drains the table into the estimator (untimed).
    fn drain(&mut self, t: &dyn Shard) {
        self.buf.clear();
        self.mrc.set_capacity(t.capacity());
        let d = t.drain_samples(&mut self.buf);
        self.mrc.observe_samples(&self.buf, d.accesses, d.threshold);
        self.total.accesses += d.accesses;
        self.total.sampled += d.sampled;
        self.total.dropped += d.dropped;
    }

    /// The CPU filter's cost per key (ns, the least of 20 passes over a
    /// batch of `n` keys, so a loaded machine inflates it least): the hash
    /// and comparison of every key and the copy of the sampled ones, what
    /// the CPU backend adds to a batch.
    fn filter_ns(&self, n: usize) -> f64 {
        let keys: Vec<u64> = (0..n as u64).map(splitmix64).collect();
        let mut local = Vec::new();
        let mut best = f64::MAX;
        for _ in 0..20 {
            local.clear();
            let t = Instant::now();
            for &k in &keys {
                if self.sampler.sampled(k) {
                    local.push(k);
                }
            }
            std::hint::black_box(&local);
            best = best.min(t.elapsed().as_secs_f64());
        }
        best * 1e9 / n as f64
    }

    fn summary(&self, batch: usize) -> String {
        let c = self.mrc.curve();
        format!(
            "sampling at rate {:.4}: the CPU filter {:.2} ns/key (least of 20 passes over {batch} keys); {} accesses, {} keys sampled, {} dropped (buffer full); estimated LRU hit rate at 1× / 2× capacity: {:.3} / {:.3}",
            self.sampler.rate(),
            self.filter_ns(batch),
            self.total.accesses,
            self.total.sampled,
            self.total.dropped,
            c.points[3].hit_rate,
            c.points[4].hit_rate
        )
    }
}

const OPS: [&str; 10] = [
    "insert_or_assign",
    "find",
    "find_or_insert",
    "assign",
    "find*",
    "find_or_insert*",
    "insert_and_evict",
    "export_batch",
    "export_batch_if",
    "contains",
];

/// The policy as printed: Lfu with its tie rule.
fn policy_name(a: &Args) -> String {
    let p = match a.policy {
        ScorePolicy::Lfu => format!("lfu ({} ties)", a.lfu_ties.name()),
        p => p.name().to_string(),
    };
    match a.reads_refresh {
        Some(on) => format!("{p} (reads refresh {})", if on { "on" } else { "off" }),
        None => p,
    }
}

/// The table of one figure: the options' capacity, mode, policy, tie
/// rule, reads refresh, fast tier and tuning, at `dim`.
fn table_config(a: &Args, mode: BucketMode, dim: usize) -> TableConfig {
    let mut cfg = TableConfig::new(a.capacity, dim)
        .mode(mode)
        .policy(a.policy)
        .lfu_ties(a.lfu_ties)
        .reads_refresh(a.reads_refresh);
    cfg.fast_tier_bytes = a.fast_tier_bytes;
    cfg.tuning = a.tuning;
    cfg
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Unique keys: a bijective mix of a counter, top bit cleared (never reserved).
struct KeyGen(u64);
impl KeyGen {
    fn take(&mut self, n: usize) -> Vec<u64> {
        let v = (self.0..self.0 + n as u64).map(|i| splitmix64(i) >> 1).collect();
        self.0 += n as u64;
        v
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time<F: FnMut()>(mut f: F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

struct Bench<'a> {
    t: &'a dyn Shard,
    dim: usize,
    batch: usize,
    runs: usize,
    keys: Vec<u64>,
    gen: KeyGen,
    rng: rand::rngs::StdRng,
}

impl Bench<'_> {
    fn existing(&mut self) -> Vec<u64> {
        (0..self.batch).map(|_| self.keys[self.rng.gen_range(0..self.keys.len())]).collect()
    }

    fn fill_to(&mut self, lambda: f64) -> Result<()> {
        let cap = self.t.capacity();
        let target = (lambda.min(1.0) * cap as f64) as u64;
        let mut budget = 3 * cap;
        while self.t.size() < target && budget > 0 {
            // Towards a full table, whole batches: the last free slots of
            // single mode fill only through eviction, one batch at a time.
            let left = if lambda >= 1.0 { self.batch } else { (target - self.t.size()) as usize };
            let n = left.clamp(1, self.batch).min(budget as usize);
            let k = self.gen.take(n);
            self.t.insert_or_assign(&k, &vec![0.5; n * self.dim], None, None)?;
            self.keys.extend_from_slice(&k);
            budget -= n as u64;
        }
        Ok(())
    }

    /// Median B-KV/s of `runs` timed calls of `op` (None: not on this
    /// backend); with `sampling`, also with the sampler on, the calls
    /// alternating.
    fn measure(
        &mut self,
        op: &str,
        lambda: f64,
        sampling: &mut Option<SampleRun>,
    ) -> Result<Option<(f64, Option<f64>)>> {
        let n = self.batch;
        let mut secs = [vec![], vec![]];
        // HKV_BENCH_CALLS: each timed call's time and the adaptive
        // window share after it, on stderr (a diagnosis of a figure).
        let calls = std::env::var_os("HKV_BENCH_CALLS").is_some();
        for _ in 0..self.runs {
            match sampling {
                None => match self.once(op, lambda)? {
                    Some(x) => {
                        if calls {
                            let w = self.t.adaptive_window();
                            eprintln!("call {op} λ {lambda} {:.1} µs, window {w:?}, size {}", x * 1e6, self.t.size());
                        }
                        secs[0].push(x)
                    }
                    None => return Ok(None),
                },
                Some(sr) => {
                    for on in sample_order(secs[0].len()) {
                        let i = on as usize;
                        self.t.set_sampler(on.then_some(sr.sampler));
                        let Some(x) = self.once(op, lambda)? else {
                            self.t.set_sampler(None);
                            return Ok(None);
                        };
                        secs[i].push(x);
                        sr.drain(self.t);
                    }
                    self.t.set_sampler(None);
                }
            }
        }
        let rate = |s: &[f64]| n as f64 / median(s.to_vec()) / 1e9;
        Ok(Some((rate(&secs[0]), (!secs[1].is_empty()).then(|| rate(&secs[1])))))
    }

    /// Seconds of one timed call of `op` (None: not on this backend).
    fn once(&mut self, op: &str, lambda: f64) -> Result<Option<f64>> {
        let (dim, n) = (self.dim, self.batch);
        {
            let s = match op {
                "find" => {
                    let k = self.existing();
                    let (mut v, mut f) = (vec![0.0; n * dim], vec![false; n]);
                    time(|| {
                        self.t.find(&k, &mut v, &mut f, None).expect("find");
                    })
                }
                "contains" => {
                    let k = self.existing();
                    let mut f = vec![false; n];
                    time(|| {
                        self.t.contains(&k, &mut f).expect("contains");
                    })
                }
                "assign" => {
                    let k = self.existing();
                    let v = vec![1.5; n * dim];
                    time(|| {
                        self.t.assign(&k, &v, None, None).expect("assign");
                    })
                }
                "insert_or_assign" | "insert_and_evict" => {
                    let k = self.gen.take(n);
                    let v = vec![2.5; n * dim];
                    let s = time(|| {
                        if op == "insert_or_assign" {
                            self.t.insert_or_assign(&k, &v, None, None).expect("insert");
                        } else {
                            self.t.insert_and_evict(&k, &v, None, None).expect("insert_and_evict");
                        }
                    });
                    self.restore(&k, lambda)?;
                    s
                }
                "find_or_insert" => {
                    let mut k = self.existing();
                    let new = self.gen.take(n / 2);
                    k[..n / 2].copy_from_slice(&new);
                    let mut v = vec![3.5; n * dim];
                    let s = time(|| {
                        self.t.find_or_insert(&k, &mut v, None, None).expect("find_or_insert");
                    });
                    self.restore(&new, lambda)?;
                    s
                }
                "export_batch" | "export_batch_if" => {
                    let filter = if op == "export_batch" { Filter::ALL } else { self.median_filter(0)? };
                    let slots = export_slots(n, lambda);
                    time(|| {
                        self.t.export_batch_if(0, slots, &filter).expect("export");
                    })
                }
                _ => return Ok(None),
            };
            Ok(Some(s))
        }
    }

    fn median_filter(&self, off: u64) -> Result<Filter> {
        let e = self.t.export_batch(off, 4096)?;
        let mut s = e.scores;
        s.sort_unstable();
        Ok(Filter::score_at_least(s.get(s.len() / 2).copied().unwrap_or(0)))
    }

    /// Undo an insert batch (untimed) so that λ stays where it was; at λ = 1
    /// the table stays full either way.
    fn restore(&mut self, new: &[u64], lambda: f64) -> Result<()> {
        if lambda < 1.0 {
            self.t.erase(new, None)?;
            self.fill_to(lambda)?;
        } else {
            self.keys.extend_from_slice(new);
        }
        Ok(())
    }
}

fn moka_row(cap: u64, dim: usize, batch: usize, runs: usize, lambdas: &[f64]) -> Vec<(f64, f64, f64)> {
    let cache: moka::sync::Cache<u64, Arc<[f32]>> = moka::sync::Cache::new(cap);
    let mut gen = KeyGen(1 << 40);
    let mut keys: Vec<u64> = vec![];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let value: Arc<[f32]> = vec![0.5f32; dim].into();
    let mut out = vec![];
    for &lambda in lambdas {
        let target = (lambda * cap as f64) as usize;
        while keys.len() < target {
            let k = gen.take((target - keys.len()).min(batch));
            k.par_iter().for_each(|&x| cache.insert(x, value.clone()));
            keys.extend(k);
        }
        cache.run_pending_tasks();
        let mut find = vec![];
        let mut insert = vec![];
        for _ in 0..runs {
            let k: Vec<u64> = (0..batch).map(|_| keys[rng.gen_range(0..keys.len())]).collect();
            let mut out = vec![0.0f32; batch * dim];
            find.push(time(|| {
                out.par_chunks_mut(dim).zip(&k).for_each(|(row, key)| {
                    if let Some(v) = cache.get(key) {
                        row.copy_from_slice(&v);
                    }
                })
            }));
            let k = gen.take(batch);
            let vals: Vec<f32> = vec![2.5; batch * dim];
            insert.push(time(|| {
                vals.par_chunks(dim).zip(&k).for_each(|(row, &key)| cache.insert(key, row.into()));
                cache.run_pending_tasks();
            }));
            k.par_iter().for_each(|x| cache.invalidate(x));
            cache.run_pending_tasks();
        }
        let b = batch as f64 / 1e9;
        out.push((lambda, b / median(insert), b / median(find)));
    }
    out
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    // The library reads no environment: the kernel cache and the tuning
    // knobs (HKV_LOOKUP_GROUP, HKV_WRITE_GROUP, HKV_KEY_ORDER) come in here.
    if let Some(dir) = hkv_shard::cuda::default_kernel_cache_dir(None, |k| std::env::var_os(k)) {
        hkv_shard::cuda::set_cache_dir(dir);
    }
    a.tuning = hkv_shard::CudaTuning::from_vars(|k| std::env::var(k).ok())?;
    let backend = match a.backend.as_str() {
        // Auto: the CUDA protocol (device buffers, event timing) on a GPU host.
        "auto" if hkv_shard::cuda::probe().is_ok() => Backend::Cuda,
        "auto" => Backend::Cpu,
        "cpu" => Backend::Cpu,
        "cuda" => Backend::Cuda,
        b => bail!("--backend must be auto, cpu or cuda, not {b:?}"),
    };
    let mode = match a.mode.as_str() {
        "single" => BucketMode::Single,
        "dual" => BucketMode::Dual,
        m => bail!("--mode must be single or dual, not {m:?}"),
    };
    if a.runs == 0 || a.batch == 0 || a.capacity < a.batch as u64 {
        bail!("--runs and --batch must be positive and --capacity at least --batch");
    }
    let reference_mix = match a.key_mix.as_str() {
        "hits" => false,
        "reference" => true,
        m => bail!("--key-mix must be hits or reference, not {m:?}"),
    };
    if a.policy == ScorePolicy::Custom {
        bail!(
            "--policy custom needs caller scores, which hkv-bench does not pass; use lru, lfu, epoch-lru, epoch-lfu or adaptive"
        );
    }
    if a.zipf.is_some() && (backend != Backend::Cuda || a.host_buffers || reference_mix) {
        bail!("--zipf draws the keys of device batches: CUDA backend, without --host-buffers or --key-mix reference");
    }
    if backend == Backend::Cuda && !a.host_buffers {
        return cuda_bench::run(&a, mode, reference_mix);
    }
    if reference_mix {
        bail!("--key-mix reference needs the CUDA backend on device batches (not --host-buffers)");
    }
    println!(
        "hkv-bench: backend {}{}, {} mode, {} policy, capacity {}, batch {}, median of {} runs, {} threads, B-KV/s",
        a.backend,
        if a.host_buffers { " on host arrays (wall clock, copies included)" } else { "" },
        a.mode,
        policy_name(&a),
        a.capacity,
        a.batch,
        a.runs,
        rayon::current_num_threads()
    );
    for &dim in &a.dims {
        let t = hkv_shard::open(table_config(&a, mode, dim), backend).context("opening the table")?;
        println!(
            "\ndim = {dim}, capacity {}, {:.1} GB values\n",
            t.capacity(),
            t.capacity() as f64 * dim as f64 * 4e-9
        );
        println!("| λ | {} |", OPS.join(" | "));
        println!("|---:|{}", "---:|".repeat(OPS.len()));
        let mut b = Bench {
            t: &*t,
            dim,
            batch: a.batch,
            runs: a.runs,
            keys: vec![],
            gen: KeyGen(0),
            rng: rand::rngs::StdRng::seed_from_u64(dim as u64),
        };
        let mut sampling = SampleRun::new(a.sample_rate)?;
        for &lambda in &a.lambdas {
            b.fill_to(lambda)?;
            let achieved = t.load_factor();
            let mut row = format!("| {lambda:.2}");
            if (achieved - lambda).abs() > 0.01 {
                row = format!("| {lambda:.2} (got {achieved:.3})");
            }
            let mut sampled_row = format!("{} sampled", row);
            for op in OPS {
                if !a.ops.is_empty() && !a.ops.iter().any(|o| o == op) {
                    row += " | -";
                    sampled_row += " | -";
                    continue;
                }
                match b.measure(op, lambda, &mut sampling)? {
                    Some((x, on)) => {
                        row += &format!(" | {x:.5}");
                        match on {
                            Some(y) => sampled_row += &format!(" | {y:.5} ({:+.1} %)", 100.0 * (y / x - 1.0)),
                            None => sampled_row += " | -",
                        }
                    }
                    None => {
                        row += " | n/a";
                        sampled_row += " | n/a";
                    }
                }
            }
            println!("{row} |");
            if sampling.is_some() {
                println!("{sampled_row} |");
            }
        }
        if let Some(sr) = &sampling {
            println!("\n{}", sr.summary(a.batch));
        }
        drop(b);
        drop(t);
        if !a.no_moka {
            println!("\nmoka 0.12 sync::Cache, same capacity, dim {dim}, all cores (B-KV/s)\n");
            println!("| λ | insert | find |\n|---:|---:|---:|");
            for (l, ins, find) in moka_row(a.capacity, dim, a.batch, a.runs, &a.lambdas) {
                println!("| {l:.2} | {ins:.5} | {find:.5} |");
            }
        }
    }
    Ok(())
}

/// Slots an export walks to return about `n` entries at load `lambda`, as
/// the reference's benchmark (`n / λ × 0.995`).
fn export_slots(n: usize, lambda: f64) -> u64 {
    ((n as f64 / lambda.max(0.01)) * 0.995).ceil() as u64
}

/// The CUDA backend on device-resident batches, timed with CUDA events
/// around the kernels (the protocol of shard/TARGETS.md).
mod cuda_bench {
    use super::*;
    use hkv_shard::cuda_table::{CudaTable, DeviceBatch, DeviceOp};

    /// The reference library's figures on the H200 (shard/TARGETS.md):
    /// (dim, capacity, hybrid, λ) → the row in OPS order (NaN: not measured).
    fn reference(dim: usize, capacity: u64, hybrid: bool, lambda: f64) -> Option<[f64; 10]> {
        let n = f64::NAN;
        let rows: [[f64; 10]; 3] = match (dim, capacity, hybrid) {
            (8, c, false) if c == 128 << 20 => [
                [2.079, 3.445, 2.196, 3.566, 7.273, 2.371, 1.952, 7.192, 8.446, 4.918],
                [1.994, 3.504, 2.129, 3.119, 6.241, 2.201, 1.971, 7.541, 8.680, 5.125],
                [1.370, 3.835, 1.195, 3.067, 4.678, 1.319, 0.812, 7.401, 7.690, 5.258],
            ],
            (32, c, false) if c == 128 << 20 => [
                [2.140, 3.445, 2.152, 2.915, 6.813, 2.280, 1.690, 1.219, 1.327, 5.064],
                [1.935, 3.481, 1.970, 2.950, 6.366, 2.229, 1.518, 1.069, 1.296, 5.146],
                [1.289, 3.641, 1.271, 3.040, 4.459, 1.292, 0.769, 0.979, 1.253, 4.693],
            ],
            (64, c, false) if c == 64 << 20 => [
                [1.770, 3.513, 1.912, 2.839, 7.396, 2.387, 1.505, 0.588, 0.700, 4.782],
                [1.716, 3.489, 1.774, 2.743, 6.542, 2.259, 1.467, 0.460, 0.680, 5.131],
                [1.261, 3.481, 1.221, 2.903, 4.701, 1.344, 0.785, 0.347, 0.673, 4.800],
            ],
            (64, c, true) if c == 128 << 20 => [
                [0.153, 0.190, 0.151, 0.187, 6.798, 2.406, n, 0.588, 0.699, 4.816],
                [0.154, 0.193, 0.152, 0.189, 6.402, 2.265, n, 0.445, 0.676, 5.222],
                [0.146, 0.189, 0.145, 0.184, 4.520, 1.323, n, 0.343, 0.681, 5.083],
            ],
            _ => return None,
        };
        let i = [0.5, 0.75, 1.0].iter().position(|&l| (l - lambda).abs() < 1e-9)?;
        Some(rows[i])
    }

    struct Ctx<'a> {
        t: &'a CudaTable,
        b: DeviceBatch,
        dim: usize,
        n: usize,
        runs: usize,
        keys: Vec<u64>,
        gen: KeyGen,
        rng: rand::rngs::StdRng,
        /// Buffers for exports of more slots than a batch.
        xb: Option<DeviceBatch>,
        /// The reference's key mix and unit (`--key-mix reference`).
        reference_mix: bool,
        /// Hits of the last find.
        find_hits: u64,
        /// `--zipf`: find_or_insert's key ranks.
        zipf: Option<rand_distr::Zipf<f64>>,
    }

    impl Ctx<'_> {
        fn upload_keys(&mut self, k: &[u64]) -> Result<()> {
            self.b.stream.memcpy_htod(k, &mut self.b.keys.slice_mut(..k.len()))?;
            Ok(())
        }

        fn upload_values(&mut self, x: f32) -> Result<()> {
            let v = vec![x; self.n * self.dim];
            self.b.stream.memcpy_htod(&v, &mut self.b.values.slice_mut(..v.len()))?;
            Ok(())
        }

        /// Keys likely resident: drawn from the most recent `capacity` inserted.
        fn existing(&mut self) -> Vec<u64> {
            let cap = self.t.capacity() as usize;
            let lo = self.keys.len().saturating_sub(cap);
            (0..self.n).map(|_| self.keys[self.rng.gen_range(lo..self.keys.len())]).collect()
        }

        /// The keys of one timed call of a non-export operation, and those
        /// of them that are new (to be erased again after an insert).
        /// Default: lookups and updates take `existing` keys, inserts new
        /// ones, find_or_insert half of each. The reference's mix: for
        /// every operation the 60 % most recently inserted keys, in order,
        /// then 40 % new ones (its create_keys_for_hitrate, last_insert).
        fn keys_for(&mut self, op: &str) -> (Vec<u64>, Vec<u64>) {
            let n = self.n;
            if self.reference_mix {
                // Fewer inserted keys than 60 % of a batch (a small table): all of them.
                let hits = ((n as f64 * 0.6) as usize).min(self.keys.len());
                let new = self.gen.take(n - hits);
                let mut k = self.keys[self.keys.len() - hits..].to_vec();
                k.extend_from_slice(&new);
                return (k, new);
            }
            match op {
                "insert_or_assign" | "insert_and_evict" => {
                    let k = self.gen.take(n);
                    (k.clone(), k)
                }
                "find_or_insert" | "find_or_insert*" if self.zipf.is_some() => {
                    use rand_distr::Distribution;
                    let z = self.zipf.expect("checked");
                    let k: Vec<u64> = (0..n).map(|_| splitmix64(z.sample(&mut self.rng) as u64) >> 1).collect();
                    (k.clone(), k)
                }
                "find_or_insert" | "find_or_insert*" => {
                    let mut k = self.existing();
                    let new = self.gen.take(n / 2);
                    k[..n / 2].copy_from_slice(&new);
                    (k, new)
                }
                _ => (self.existing(), vec![]),
            }
        }

        fn run(&mut self, op: DeviceOp, n: usize) -> Result<f64> {
            let r = self.t.run_device(op, &mut self.b, n)?;
            if matches!(op, DeviceOp::Find) {
                self.find_hits = r.counts.hits;
            }
            Ok(r.ms as f64)
        }

        /// One timed export of `slots` slots from `offset` (ms), on a batch
        /// large enough for them.
        fn export(&mut self, op: &str, slots: u64, offset: u64) -> Result<f64> {
            let filter = if op == "export_batch" {
                Filter::ALL
            } else {
                let e = self.t.export_batch(offset, 4096)?;
                let mut s = e.scores;
                s.sort_unstable();
                Filter::score_at_least(s.get(s.len() / 2).copied().unwrap_or(0))
            };
            let slots = slots.min(self.t.capacity() - offset) as usize;
            if self.xb.as_ref().is_none_or(|b| b.n < slots) {
                self.xb = None; // the old buffers go before the larger ones come
                self.xb = Some(self.t.device_batch(slots)?);
            }
            let b = self.xb.as_mut().expect("export batch");
            Ok(self.t.run_device(DeviceOp::Export { offset, filter }, b, slots)?.ms as f64)
        }

        /// The export figure (B-KV/s, median) from the first host-tier slot
        /// of a hybrid table, credited as the main figure.
        fn export_host_tier(&mut self, op: &str, lambda: f64, first_host_slot: u64) -> Result<f64> {
            let slots = export_slots(self.n, lambda);
            self.rate(|c| c.export(op, slots, first_host_slot))
        }

        /// B-KV/s of a batch of `n` keys from the median of `runs` timed
        /// calls of `once` (ms each) after one warm-up call.
        fn rate(&mut self, mut once: impl FnMut(&mut Self) -> Result<f64>) -> Result<f64> {
            let mut ms = vec![];
            for run in 0..=self.runs {
                let t = once(self)?;
                if run > 0 {
                    ms.push(t);
                }
            }
            Ok(self.figure(ms))
        }

        /// The figure of a batch from its calls' times (ms).
        fn figure(&self, ms: Vec<f64>) -> f64 {
            let unit = if self.reference_mix { (1u64 << 30) as f64 } else { 1e9 };
            self.n as f64 / (median(ms) / 1e3) / unit
        }

        fn fill_to(&mut self, lambda: f64) -> Result<()> {
            let cap = self.t.capacity();
            let target = (lambda.min(1.0) * cap as f64) as u64;
            let mut budget = 3 * cap;
            self.upload_values(0.5)?;
            while self.t.size() < target && budget > 0 {
                // As in the CPU path: whole batches towards a full table.
                let left = if lambda >= 1.0 { self.n } else { (target - self.t.size()) as usize };
                let n = left.clamp(1, self.n).min(budget as usize);
                let k = self.gen.take(n);
                self.upload_keys(&k)?;
                self.run(DeviceOp::InsertOrAssign, n)?;
                self.keys.extend_from_slice(&k);
                budget -= n as u64;
            }
            Ok(())
        }

        /// Untimed: erase `new` again and top the table up, so λ stays put.
        fn restore(&mut self, new: &[u64], lambda: f64) -> Result<()> {
            if lambda < 1.0 {
                self.upload_keys(new)?;
                self.run(DeviceOp::Erase, new.len())?;
                self.fill_to(lambda)?;
            } else {
                self.keys.extend_from_slice(new);
            }
            Ok(())
        }

        /// Median B-KV/s of `runs` timed calls after one warm-up; with
        /// `sampling`, also with the sampler on, the calls alternating.
        fn measure(&mut self, op: &str, lambda: f64, sampling: &mut Option<SampleRun>) -> Result<(f64, Option<f64>)> {
            let Some(sr) = sampling else {
                return Ok((self.rate(|c| c.once(op, lambda))?, None));
            };
            let mut ms = [vec![], vec![]];
            for run in 0..=self.runs {
                for on in sample_order(run) {
                    let i = on as usize;
                    self.t.set_sampler(on.then_some(sr.sampler));
                    let r = self.once(op, lambda);
                    self.t.set_sampler(None);
                    sr.drain(self.t);
                    if run > 0 {
                        ms[i].push(r?);
                    }
                }
            }
            let [off, on] = ms;
            Ok((self.figure(off), Some(self.figure(on))))
        }

        /// One timed call of `op` at `lambda` (ms).
        fn once(&mut self, op: &str, lambda: f64) -> Result<f64> {
            let n = self.n;
            Ok(match op {
                "find" | "find*" | "contains" => {
                    let (k, _) = self.keys_for(op);
                    self.upload_keys(&k)?;
                    let d = match op {
                        "find" => DeviceOp::Find,
                        "find*" => DeviceOp::FindPtr,
                        _ => DeviceOp::Contains,
                    };
                    self.run(d, n)?
                }
                "assign" => {
                    let (k, _) = self.keys_for(op);
                    self.upload_keys(&k)?;
                    self.upload_values(1.5)?;
                    self.run(DeviceOp::Assign, n)?
                }
                "insert_or_assign" | "insert_and_evict" => {
                    let (k, new) = self.keys_for(op);
                    self.upload_keys(&k)?;
                    self.upload_values(2.5)?;
                    let d = if op == "insert_or_assign" { DeviceOp::InsertOrAssign } else { DeviceOp::InsertAndEvict };
                    let t = self.run(d, n)?;
                    self.restore(&new, lambda)?;
                    t
                }
                "find_or_insert" | "find_or_insert*" => {
                    let (k, new) = self.keys_for(op);
                    self.upload_keys(&k)?;
                    self.upload_values(3.5)?;
                    let d = if op == "find_or_insert" { DeviceOp::FindOrInsert } else { DeviceOp::FindOrInsertPtr };
                    let t = self.run(d, n)?;
                    self.restore(&new, lambda)?;
                    t
                }
                "export_batch" | "export_batch_if" => self.export(op, export_slots(n, lambda), 0)?,
                _ => bail!("unknown op {op}"),
            })
        }
    }

    /// Device-to-device copy bandwidth (bytes read + written per second).
    fn copy_bandwidth(t: &CudaTable) -> Result<f64> {
        let s = t.device().ctx.new_stream()?;
        let n = 1usize << 29; // 4 GiB of u64
        let a = s.alloc_zeros::<u64>(n)?;
        let mut b = s.alloc_zeros::<u64>(n)?;
        let mut v = vec![];
        for _ in 0..6 {
            let e0 = s.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            s.memcpy_dtod(&a, &mut b)?;
            let e1 = s.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            v.push(2.0 * (n * 8) as f64 / (e0.elapsed_ms(&e1)? as f64 / 1e3));
        }
        Ok(median(v))
    }

    pub fn run(a: &Args, mode: BucketMode, reference_mix: bool) -> Result<()> {
        let dev = hkv_shard::cuda::shared_device(0)?;
        println!(
            "hkv-bench: CUDA on {} (compute {}.{}), {} mode, {} policy, capacity {}, batch {}, median of {} runs after a warm-up, CUDA-event timing, {}",
            dev.info.name,
            dev.info.compute_capability.0,
            dev.info.compute_capability.1,
            a.mode,
            super::policy_name(a),
            a.capacity,
            a.batch,
            a.runs,
            if reference_mix {
                "the reference's key mix (60 % most recently inserted keys, 40 % new), 2^30 keys/s"
            } else {
                "B-KV/s"
            }
        );
        let mut copy_bw = None;
        for &dim in &a.dims {
            let t = CudaTable::new(super::table_config(a, mode, dim), dev.clone()).context("creating the table")?;
            let st = t.stats();
            let hybrid = st.host_tier_bytes > 0;
            println!(
                "\ndim = {dim}, capacity {}, {:.1} GB values in device memory{}\n",
                t.capacity(),
                st.fast_tier_bytes as f64 / 1e9,
                if hybrid {
                    format!(" + {:.1} GB in pinned host memory", st.host_tier_bytes as f64 / 1e9)
                } else {
                    String::new()
                }
            );
            println!("| λ | {} |", OPS.join(" | "));
            println!("|---:|{}", "---:|".repeat(OPS.len()));
            let b = t.device_batch(a.batch)?;
            let mut c = Ctx {
                t: &t,
                b,
                dim,
                n: a.batch,
                runs: a.runs,
                keys: vec![],
                gen: KeyGen(0),
                rng: rand::rngs::StdRng::seed_from_u64(dim as u64),
                xb: None,
                reference_mix,
                find_hits: 0,
                zipf: a.zipf.map(|s| rand_distr::Zipf::new(a.key_space, s)).transpose()?,
            };
            let mut find32 = None;
            let first_host_slot = st.fast_tier_bytes / (dim as u64 * 4);
            let mut host_exports = vec![];
            let mut hit_lines = vec![];
            let mut sampling = SampleRun::new(a.sample_rate)?;
            for &lambda in &a.lambdas {
                c.fill_to(lambda)?;
                let achieved = t.load_factor();
                let mut row = format!("| {lambda:.2}");
                if (achieved - lambda).abs() > 0.01 {
                    row = format!("| {lambda:.2} (got {achieved:.3})");
                }
                let mut sampled_row = format!("{} sampled", row);
                let reference = reference(dim, t.capacity(), hybrid, lambda);
                for (j, op) in OPS.iter().enumerate() {
                    if !a.ops.is_empty() && !a.ops.iter().any(|o| o == op) {
                        row += " | -";
                        sampled_row += " | -";
                        continue;
                    }
                    let (x, on) = c.measure(op, lambda, &mut sampling)?;
                    if let Some(y) = on {
                        sampled_row += &format!(" | {y:.3} ({:+.1} %)", 100.0 * (y / x - 1.0));
                    }
                    if hybrid && op.starts_with("export") {
                        host_exports.push((lambda, *op, c.export_host_tier(op, lambda, first_host_slot)?));
                    }
                    if *op == "find" && dim == 32 && lambda == 1.0 && !reference_mix {
                        find32 = Some(x);
                    }
                    match reference.map(|r| r[j]).filter(|r| r.is_finite()) {
                        Some(r) => row += &format!(" | {x:.3} ({:.2}×)", x / r),
                        None => row += &format!(" | {x:.3}"),
                    }
                }
                println!("{row} |");
                if sampling.is_some() {
                    println!("{sampled_row} |");
                }
                if reference_mix && (a.ops.is_empty() || a.ops.iter().any(|o| o == "find")) {
                    hit_lines.push(format!(
                        "find at λ {lambda:.2}: {:.1} % of the keys found",
                        100.0 * c.find_hits as f64 / a.batch as f64
                    ));
                }
            }
            for l in hit_lines {
                println!("{l}");
            }
            if let Some(sr) = &sampling {
                println!("{}", sr.summary(a.batch));
            }
            for (lambda, op, x) in host_exports {
                let unit = if reference_mix { "2^30 keys/s" } else { "B-KV/s" };
                println!("{op} at λ {lambda:.2} from the first host-tier slot (values over PCIe): {x:.3} {unit}");
            }
            if let Some(f) = find32 {
                let bw = match copy_bw {
                    Some(b) => b,
                    None => {
                        let b = copy_bandwidth(&t)?;
                        copy_bw = Some(b);
                        b
                    }
                };
                println!(
                    "\nfind at dim 32, λ 1.0: {:.3} B-KV/s × 424 B/key = {:.2} TB/s, {:.0} % of the device-to-device copy ({:.2} TB/s read + write)",
                    f,
                    f * 424.0 / 1e3,
                    100.0 * f * 424e9 / bw,
                    bw / 1e12
                );
            }
        }
        println!(
            "\n(×: ratio to the reference library on the H200, shard/TARGETS.md, where the configuration matches.)"
        );
        Ok(())
    }
}
