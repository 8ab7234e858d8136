//! hkv-multi-bench: aggregate throughput of a table over 1, 2, 4 ... GPUs
//! (`GpuGroup`), for batches that already sit on the GPUs.
//!
//! For each GPU count k: one table of `--capacity` slots per GPU is filled
//! to `--load` with fresh keys, then `--runs` batches of `--batch` keys per
//! GPU are timed (wall clock, every GPU finished) for find (keys inserted
//! earlier, nearly all hits) and insert_or_assign (fresh keys, evicting at
//! λ 1.0), on the device-resident routes (split on the GPU and NCCL
//! all-to-all; or each owner serving its keys out of every GPU's batch over
//! peer access) and the host route (split on the host, as the daemon's
//! router does).
//! Prints medians in million keys per second, aggregated over the GPUs, and
//! the scaling over one GPU.

#![forbid(unsafe_code)]

use anyhow::{bail, Result};
use clap::Parser;
use hkv_shard::cuda_table::DeviceOp;
use hkv_shard::multi::{GpuGroup, RankBatch, Route};
use hkv_shard::{ScorePolicy, TableConfig};

#[derive(Parser, Debug)]
#[command(name = "hkv-multi-bench", about = "Aggregate find / insert_or_assign over several GPUs (M keys/s)")]
struct Args {
    /// GPU counts to measure, comma separated (GPUs 0..k each time).
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Floats per value.
    #[arg(long, default_value_t = 32)]
    dim: usize,
    /// Slots per GPU.
    #[arg(long, default_value_t = 1 << 26)]
    capacity: u64,
    /// Keys per GPU per batch.
    #[arg(long, default_value_t = 1 << 20)]
    batch: usize,
    /// Load factor reached before timing.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Timed batches per figure (the median is printed).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Skip the host route (it is slow: every batch crosses PCIe twice).
    #[arg(long)]
    no_host: bool,
    /// Skip the peer route (each GPU serves its keys straight out of every
    /// GPU's batch over NVLink; measured whenever peer access exists).
    #[arg(long)]
    no_peer: bool,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) >> 1 // below the reserved keys
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Puts keys `splitmix(first + r * stride + i)` into every rank's batch.
fn load_keys(g: &GpuGroup, b: &mut [RankBatch], n: usize, first: u64, stride: u64) -> Result<()> {
    for (r, rb) in b.iter_mut().enumerate() {
        let keys: Vec<u64> = (0..n as u64).map(|i| splitmix(first + r as u64 * stride + i)).collect();
        let s = g.stream(r);
        s.memcpy_htod(&keys, &mut rb.keys.slice_mut(..n))?;
        s.synchronize()?;
    }
    Ok(())
}

fn main() -> Result<()> {
    // Before any thread starts: NCCL reads these when the first group is made.
    for (k, v) in hkv_shard::multi::NCCL_ENV_DEFAULTS {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
    let a = Args::parse();
    if let Some(dir) = hkv_shard::cuda::default_kernel_cache_dir(None, |k| std::env::var_os(k)) {
        hkv_shard::cuda::set_cache_dir(dir);
    }
    // The library reads no environment: the tuning knobs (HKV_LOOKUP_GROUP,
    // HKV_WRITE_GROUP, HKV_KEY_ORDER) come in here, into each table's config.
    let tuning = hkv_shard::CudaTuning::from_vars(|k| std::env::var(k).ok())?;
    let devices = hkv_shard::cuda::probe().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("GPUs: {} x {} (driver {})", devices.len(), devices[0].name, devices[0].driver_version);
    match hkv_shard::multi::nccl_version() {
        Ok(v) => println!("NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100),
        Err(e) => println!("NCCL: {e}"),
    }
    println!(
        "dim {}, {} slots per GPU, batch {} keys per GPU, λ {:.2}, median of {} runs\n",
        a.dim, a.capacity, a.batch, a.load, a.runs
    );
    println!("{:>4} {:>16} {:>9} {:>9} {:>12} {:>8}", "GPUs", "op", "route", "ms", "M keys/s", "scaling");
    let mut base: Vec<(String, f64)> = vec![];
    for &k in &a.gpus {
        if k == 0 || k > devices.len() {
            bail!("{k} GPUs asked for, {} present", devices.len());
        }
        let ordinals: Vec<usize> = (0..k).collect();
        let cfg = TableConfig { tuning, ..TableConfig::new(a.capacity, a.dim).policy(ScorePolicy::Lru) };
        let g = GpuGroup::new(cfg, &ordinals)?;
        let mut b = g.batch(a.batch)?;
        for (r, rb) in b.iter_mut().enumerate() {
            let row: Vec<f32> = (0..a.batch * a.dim).map(|i| (i % 1000) as f32).collect();
            g.stream(r).memcpy_htod(&row, &mut rb.values)?;
        }
        let n = vec![a.batch; k];
        // Keys are numbered: batch j of the fill uses numbers from j * k * batch.
        let per_round = (k * a.batch) as u64;
        let target = (a.load * (a.capacity * k as u64) as f64) as u64;
        let mut next = 0u64;
        while next < target {
            load_keys(&g, &mut b, a.batch, next, a.batch as u64)?;
            g.run(DeviceOp::InsertOrAssign, Route::Device, &mut b, &n)?;
            next += per_round;
        }
        println!(
            "  ({k} GPU{}: {} entries after {} inserted, λ {:.3})",
            if k > 1 { "s" } else { "" },
            g.size(),
            next,
            g.size() as f64 / (a.capacity * k as u64) as f64
        );
        let mut routes = vec![Route::Device];
        if k > 1 {
            if !a.no_peer && g.peer_access() {
                routes.push(Route::Peer);
            }
            if !a.no_host {
                routes.push(Route::Host);
            }
        }
        for route in routes {
            for (name, op) in [("find", DeviceOp::Find), ("insert_or_assign", DeviceOp::InsertOrAssign)] {
                let mut ms = vec![];
                for run in 0..=a.runs {
                    if op == DeviceOp::Find {
                        // The most recent fill batches: resident.
                        let from = next.saturating_sub(per_round * (1 + run as u64 % 4));
                        load_keys(&g, &mut b, a.batch, from, a.batch as u64)?;
                    } else {
                        load_keys(&g, &mut b, a.batch, next, a.batch as u64)?;
                        next += per_round;
                    }
                    let r = g.run(op, route, &mut b, &n)?;
                    if run > 0 {
                        ms.push(r.ms);
                    }
                }
                let m = median(ms);
                let rate = (k * a.batch) as f64 / m / 1e3;
                let scaling = match base.iter().find(|(l, _)| l == name) {
                    Some((_, one)) => format!("{:.2}x", rate / one),
                    None => {
                        base.push((name.to_string(), rate));
                        "1.00x".into()
                    }
                };
                let label = format!("{route:?}").to_lowercase();
                println!("{k:>4} {name:>16} {label:>9} {m:>9.3} {rate:>12.1} {scaling:>8}");
            }
        }
    }
    Ok(())
}
