//! The tier against a plain client of the same `redis` crate on a real
//! 3-master cluster started here (loopback, `redis-server`): cold reads
//! (every key present in the cluster) through `Backing::read` against
//! pipelined slot-grouped `MGET`s sent one pipeline per node; writes
//! through the write-back queue (write, then flush) against pipelined
//! `MSET`s. Runs alternate, A B A B …; the table prints medians.
//!
//! `hkv-backing-bench [KEYS] [DIM] [BATCH] [ROUNDS]` (defaults 200000 32
//! 8192 5); `HKV_BENCH_BATCH_ROWS=N` sets the tier's write-back batch size.

use std::time::{Duration, Instant};

use hkv_backing::testkit::{PlainClient as Plain, TestCluster};
use hkv_backing::{Backing, Fetched, Mode, Options};

fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (n, dim, batch, rounds) = (arg(1, 200_000), arg(2, 32), arg(3, 8192), arg(4, 5));
    let cluster = tokio::task::block_in_place(|| TestCluster::start(3, 0)).expect("start redis-server cluster");
    let mut o = Options::new(cluster.seeds(), Mode::WriteBack);
    o.deadline = Duration::from_secs(10);
    o.queue_bytes = 1 << 30;
    // HKV_BENCH_BATCH_ROWS: the write-back batch size to try (default the tier's).
    if let Some(b) = std::env::var("HKV_BENCH_BATCH_ROWS").ok().and_then(|v| v.parse().ok()) {
        o.batch_rows = b;
    }
    let tier = Backing::open("bench", dim, o).await.unwrap();
    let layout = tier.layout().clone();
    let plain = Plain::connect(&cluster.seeds()[0]).await;
    let keys: Vec<u64> = (0..n as u64).map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    let row: Vec<f32> = (0..dim).map(|i| i as f32).collect();
    let rows: Vec<f32> = keys.iter().flat_map(|_| row.iter().copied()).collect();

    // Fill the cluster once with the plain client.
    for c in keys.chunks(batch) {
        plain.run(Plain::mset(&layout, c, &row)).await;
    }

    let (mut plain_read, mut tier_read, mut plain_write, mut tier_write) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let t = Instant::now();
        for c in keys.chunks(batch) {
            let v = plain.run(Plain::mget(&layout, c)).await;
            assert!(!v.is_empty());
        }
        plain_read.push(n as f64 / t.elapsed().as_secs_f64());

        let t = Instant::now();
        for c in keys.chunks(batch) {
            let out = tier.read(c).await;
            assert!(out.fetched.iter().all(|f| *f == Fetched::Found));
        }
        tier_read.push(n as f64 / t.elapsed().as_secs_f64());

        let t = Instant::now();
        for c in keys.chunks(batch) {
            plain.run(Plain::mset(&layout, c, &row)).await;
        }
        plain_write.push(n as f64 / t.elapsed().as_secs_f64());

        let t = Instant::now();
        for (i, c) in keys.chunks(batch).enumerate() {
            tier.write(c, &rows[i * batch * dim..][..c.len() * dim], &[]).await.unwrap();
        }
        tier.flush(Duration::from_secs(120)).await.unwrap();
        tier_write.push(n as f64 / t.elapsed().as_secs_f64());
    }
    let ratios = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(t, p)| t / p).collect());
    let (read_ratio, write_ratio) = (ratios(&tier_read, &plain_read), ratios(&tier_write, &plain_write));
    let s = tier.stats();
    println!("{n} keys, dim {dim}, batches of {batch}, 3 masters on loopback, {rounds} alternated rounds (medians)");
    println!("{:<44} {:>14} {:>8}", "", "keys/s", "ratio");
    let (pr, tr, pw, tw) = (median(plain_read), median(tier_read), median(plain_write), median(tier_write));
    println!("{:<44} {:>14.0} {:>8}", "plain client: pipelined slot-grouped MGET", pr, "1.00");
    println!("{:<44} {:>14.0} {:>8.2}", "hkv-backing read (cold, every key found)", tr, tr / pr);
    println!("{:<44} {:>14.0} {:>8}", "plain client: pipelined slot-grouped MSET", pw, "1.00");
    println!("{:<44} {:>14.0} {:>8.2}", "hkv-backing write-back (write + flush)", tw, tw / pw);
    println!("median of the rounds' ratios: read {read_ratio:.2}, write-back {write_ratio:.2}");
    println!(
        "tier: fetch p50 {} µs p99 {} µs per batch; write p50 {} µs per batch; {} rows written",
        s.fetch_us.quantile_us(0.5),
        s.fetch_us.quantile_us(0.99),
        s.write_us.quantile_us(0.5),
        s.rows_written
    );
}
