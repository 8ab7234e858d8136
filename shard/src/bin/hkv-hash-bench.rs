//! hkv-hash-bench: feature hashing throughput (features → keys,
//! FarmHash Fingerprint64 % num_buckets), GPU and CPU.
//!
//! For int64 features and for strings of 8 to 64 bytes, at each batch size:
//! the GPU kernel alone (CUDA events around the launch), the GPU end to end
//! from host memory (copy in, kernel, keys back; wall clock), the CPU on one
//! thread and on every core. Medians of `--runs` runs after one warm-up, in
//! million features per second.

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use hkv_shard::features::{hash_features_cpu, Features, HashKind};
use rand::{Rng, SeedableRng};

#[derive(Parser, Debug)]
#[command(name = "hkv-hash-bench", about = "Feature hashing throughput, GPU and CPU (M features/s)")]
struct Args {
    /// Batch sizes, comma separated.
    #[arg(long, default_value = "1048576,16777216", value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Timed runs per figure (the median is printed).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Skip the GPU columns.
    #[arg(long)]
    cpu_only: bool,
    /// Hash kind: fingerprint64 or strong.
    #[arg(long, default_value = "fingerprint64")]
    kind: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let a = Args::parse();
    let kind = match a.kind.as_str() {
        "fingerprint64" => HashKind::Fingerprint64,
        "strong" => HashKind::Strong { k0: 0x0123_4567_89ab_cdef, k1: 0xfedc_ba98_7654_3210 },
        k => anyhow::bail!("unknown hash kind {k:?}: use fingerprint64 or strong"),
    };
    let nb = 1u64 << 40;
    let mut gpu = if a.cpu_only {
        None
    } else {
        match hkv_shard::cuda::Device::open(0, None) {
            Ok(d) => {
                println!("GPU: {} (driver {})", d.info.name, d.info.driver_version);
                let h = hkv_shard::cuda::FeatureHasher::new(&d)?;
                Some((d, h))
            }
            Err(e) => {
                println!("GPU columns skipped: {e}");
                None
            }
        }
    };
    println!("CPU: {} threads; hash {:?}, num_buckets 2^40, runs {}", rayon::current_num_threads(), kind, a.runs);
    println!();
    println!("| features | n | GPU kernel | GPU end to end | CPU 1 thread | CPU all cores |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for &n in &a.sizes {
        let ints: Vec<i64> = (0..n).map(|_| rng.gen::<i64>() >> rng.gen_range(0..64)).collect();
        let mut bytes = Vec::with_capacity(n * 36);
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u32);
        for _ in 0..n {
            let len = rng.gen_range(8..=64);
            bytes.extend((0..len).map(|_| rng.gen_range(b'a'..=b'z')));
            offsets.push(bytes.len() as u32);
        }
        for (label, f) in [
            ("int64", Features::Int64(&ints)),
            ("string 8-64 B", Features::Strings { bytes: &bytes, offsets: &offsets }),
        ] {
            let mut out = vec![0u64; n];
            let rate = |s: f64| n as f64 / s / 1e6;
            let (mut kern, mut e2e) = (vec![], vec![]);
            if let Some((_, h)) = gpu.as_mut() {
                h.hash(f, kind, nb, &mut out)?;
                for _ in 0..a.runs {
                    let t = Instant::now();
                    let ms = h.hash(f, kind, nb, &mut out)?;
                    e2e.push(rate(t.elapsed().as_secs_f64()));
                    kern.push(rate(ms as f64 / 1e3));
                }
            }
            let mut cpu = |parallel: bool| -> Result<f64> {
                let runs = if parallel { a.runs } else { a.runs.min(3) };
                let mut v = vec![];
                for _ in 0..runs {
                    let t = Instant::now();
                    hash_features_cpu(f, kind, nb, &mut out, parallel)?;
                    v.push(rate(t.elapsed().as_secs_f64()));
                }
                Ok(median(v))
            };
            let (one, all) = (cpu(false)?, cpu(true)?);
            let g = |v: Vec<f64>| if v.is_empty() { "-".to_string() } else { format!("{:.0}", median(v)) };
            println!("| {label} | {n} | {} | {} | {one:.1} | {all:.1} |", g(kern), g(e2e));
        }
    }
    println!();
    println!("Unit: million features per second (median). GPU kernel: CUDA events around the launch;");
    println!("end to end: host features in, keys back in host memory, wall clock.");
    Ok(())
}
