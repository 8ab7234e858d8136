//! hkvd in front of a Redis Cluster against a plain client of the same
//! `redis` crate (issue 34's bars), end to end: a real 3-master
//! `redis-server` cluster on loopback (`hkv_backing::testkit`), real `hkvd`
//! processes on Unix sockets, the Rust client. Prints one table.
//!
//! - cold: `find` of keys every one of which the cache misses and the
//!   cluster has, against pipelined slot-grouped `MGET`s of the same keys
//!   (the table is made again before each hkvd round, so every key is a
//!   miss);
//! - warm: a Zipf stream over the same keys through a cache smaller than
//!   them (the hit ratio printed is measured from the daemon's stats)
//!   against `MGET`s of the same stream;
//! - write-back: `insert_or_assign` into a write-back table far smaller
//!   than the rows written (most are evicted), then `flush`, against
//!   pipelined `MSET`s of the same rows;
//! - staleness: daemon A writes (write-through) at a paced rate, daemon B
//!   backed by the same table reports the time from each write's
//!   acknowledgement to its invalidation (B's stats).
//!
//! Rounds alternate plain, hkvd, plain, hkvd …; medians are printed, and
//! the median of the rounds' ratios.
//!
//! ```text
//! cargo build --release -p hkvd
//! cargo run --release -p hkvd --example backing-bench -- [KEYS] [BATCH] [ROUNDS] [WARM_CAPACITY] [WRITES_PER_S]
//! ```
//! Defaults 200000 8192 5 49152 10000; dim 32. `HKV_BENCH_ONLY=cold,cold2,cold-shm,cold2-shm,warm,warm2,warm-shm,wb,stale`
//! runs some of them (`cold2`, `warm2`: the cold and warm streams with two
//! requests in flight on both sides, hkvd's through `send_find` /
//! `recv_found`, the plain client's as two batches of `MGET`s at once;
//! `warm2` and `warm-shm` need `warm`; `-shm`: hkvd's finds through a
//! registered memfd, `find_in`). `HKVD_BIN` names the
//! daemon binary (default: `hkvd` beside the example's directory);
//! `HKV_BENCH_DAEMON_ARGS` adds options to its `hkvd serve` (e.g.
//! `--no-mrc`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hkv_backing::layout::Layout;
use hkv_backing::testkit::{PlainClient, TestCluster};
use hkv_backing::{Backing, Mode, Options};
use hkv_client::{BackingMode, BackingSpec, Client, TableSpec};
use rand::SeedableRng;
use rand_distr::Distribution;

const DIM: usize = 32;

fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One `hkvd serve --backend cpu --shards 2` (`HKV_BENCH_SHARDS`) on a socket in a temporary
/// directory; killed on drop.
struct Daemon {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start() -> Daemon {
        let bin = std::env::var_os("HKVD_BIN").map(PathBuf::from).unwrap_or_else(|| {
            let exe = std::env::current_exe().expect("current_exe");
            exe.parent().and_then(|d| d.parent()).expect("target dir").join("hkvd")
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("hkvd.sock");
        let child = Command::new(&bin)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--log", "warn", "--backend", "cpu", "--shards"])
            .arg(std::env::var("HKV_BENCH_SHARDS").unwrap_or_else(|_| "2".into()))
            .args(std::env::var("HKV_BENCH_DAEMON_ARGS").unwrap_or_default().split_whitespace())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {} (cargo build --release -p hkvd): {e}", bin.display()));
        let t = Instant::now();
        while Client::connect(&socket).and_then(|mut c| c.ping()).is_err() {
            assert!(t.elapsed() < Duration::from_secs(60), "hkvd did not answer within 60 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Daemon { child, socket, _dir: dir }
    }

    fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Finds of `chunks` on `table` with `depth` requests in flight on the
/// connection (each answer must find every key).
fn hkvd_finds(c: &mut Client, table: &str, chunks: std::slice::Chunks<'_, u64>, depth: usize) {
    let mut in_flight = 0;
    for ch in chunks {
        if in_flight == depth {
            assert!(c.recv_found().expect("find").1.found.iter().all(|x| *x));
            in_flight -= 1;
        }
        c.send_find(table, ch).expect("send a find");
        in_flight += 1;
    }
    for _ in 0..in_flight {
        assert!(c.recv_found().expect("find").1.found.iter().all(|x| *x));
    }
}

/// The same finds through a registered memfd (`find_in`): the keys are
/// written into the region, the found flags and rows read from it; one
/// output area per request in flight.
struct Shm {
    region: hkv_client::region::Region,
    batch: u64,
}

impl Shm {
    fn new(c: &mut Client, batch: usize, depth: usize) -> Shm {
        let b = batch as u64;
        let region = c.register_memfd(depth as u64 * b * (8 + 1 + 4 * DIM as u64)).expect("register a memfd");
        Shm { region, batch: b }
    }

    fn finds(&self, c: &mut Client, table: &str, chunks: std::slice::Chunks<'_, u64>, depth: usize) {
        use hkv_client::proto::Op;
        let b = self.batch;
        let area = |slot: u64| slot * b * (8 + 1 + 4 * DIM as u64);
        let mut row = vec![0f32; DIM];
        // Answers may come in another order than the requests: each frees
        // the area of the request it answers.
        let mut in_flight: Vec<(u64, u64, u64)> = Vec::new(); // (id, slot, keys)
        let check = |c: &mut Client, in_flight: &mut Vec<(u64, u64, u64)>, row: &mut [f32]| -> u64 {
            let (id, a) = c.recv_region(u8::from(Op::Find)).expect("find");
            let i = in_flight.iter().position(|x| x.0 == id).expect("an answer to a request in flight");
            let (_, slot, n) = in_flight.swap_remove(i);
            assert!(matches!(a, hkv_client::proto::region::RegionAnswer::Count(h) if h == n), "{a:?}");
            // Read one row back, as a client would use them.
            self.region.read(area(slot) + b * 9, row).expect("read a row");
            slot
        };
        let mut free: Vec<u64> = (0..depth as u64).rev().collect();
        for ch in chunks {
            if free.is_empty() {
                free.push(check(c, &mut in_flight, &mut row));
            }
            let (slot, n) = (free.pop().unwrap(), ch.len() as u64);
            let at = area(slot);
            self.region.write(at, ch).expect("write keys");
            let refs = vec![
                self.region.at::<u64>(at, n),
                self.region.at::<u8>(at + b * 8, n),
                self.region.at::<f32>(at + b * 9, n * DIM as u64),
            ];
            let id =
                c.send_region(&hkv_client::region::keyed(u8::from(Op::Find), table, refs, false, false)).expect("send");
            in_flight.push((id, slot, n));
        }
        while !in_flight.is_empty() {
            check(c, &mut in_flight, &mut row);
        }
    }
}

/// The plain client's `MGET`s of `chunks` with `depth` batches in flight.
async fn plain_gets(plain: &PlainClient, layout: &Layout, chunks: std::slice::Chunks<'_, u64>, depth: usize) {
    use futures::StreamExt;
    let mut s = futures::stream::iter(chunks).map(|c| plain.run(PlainClient::mget(layout, c))).buffered(depth);
    while let Some(v) = s.next().await {
        assert!(!v.is_empty());
    }
}

/// User plus system CPU seconds of the processes `pids` so far.
fn cpu_secs(pids: &[u32]) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .map(|s| {
            // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
            let rest: Vec<&str> = s[s.rfind(')').map_or(0, |i| i + 2)..].split_whitespace().collect();
            let f = |i: usize| rest.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            (f(14) + f(15)) / tick
        })
        .sum()
}

/// Keys per second of `keys` keys read by `f`; the CPU seconds `cpu`
/// measures over it are added to `acc`.
fn timed(keys: usize, cpu: &impl Fn() -> [f64; 3], acc: &mut [f64; 3], f: impl FnOnce()) -> f64 {
    let c0 = cpu();
    let t = Instant::now();
    f();
    let rate = keys as f64 / t.elapsed().as_secs_f64();
    let c1 = cpu();
    for i in 0..3 {
        acc[i] += c1[i] - c0[i];
    }
    rate
}

/// Prints CPU ms per request (of `requests` over the rounds) of the
/// client, the cluster and the daemon over the plain and the hkvd rounds.
fn print_cpu(what: &str, batch: usize, requests: f64, plain: [f64; 3], hkvd: [f64; 3]) {
    let per = |c: [f64; 3]| {
        let ms = |x: f64| 1e3 * x / requests;
        format!("client {:.2}, cluster {:.2}, daemon {:.2}", ms(c[0]), ms(c[1]), ms(c[2]))
    };
    println!("{what}, CPU ms per request of {batch} keys: plain rounds {}; hkvd rounds {}", per(plain), per(hkvd));
}

/// The processes whose command name is `name`.
fn pids_named(name: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == name))
        .collect()
}

fn spec(name: &str, capacity: u64, seeds: &str, mode: BackingMode) -> TableSpec {
    TableSpec { backing: Some(BackingSpec::from_list(seeds, mode)), ..TableSpec::new(name, DIM, capacity) }
}

fn remake(c: &mut Client, s: TableSpec) {
    let _ = c.drop_table(&s.name);
    c.create_table(s).expect("create the backed table");
}

fn backing(c: &mut Client, table: &str) -> hkv_client::proto::stats::BackingStats {
    let s = c.stats_doc().expect("stats");
    s.tables.into_iter().find(|t| t.spec.name == table).and_then(|t| t.backing).expect("a backed table's stats")
}

struct Row {
    what: &'static str,
    plain: f64,
    hkvd: f64,
    ratio: f64,
    bar: &'static str,
    note: String,
}

fn main() {
    let (n, batch, rounds) = (arg(1, 200_000), arg(2, 8192), arg(3, 5));
    let (warm_cap, rate) = (arg(4, 49_152) as u64, arg(5, 10_000));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let cluster = TestCluster::start(3, 0).expect("start a redis-server cluster");
    let seeds = cluster.seed_arg();
    let a = Daemon::start();
    let mut ca = a.client();
    let plain = rt.block_on(PlainClient::connect(&cluster.seeds()[0]));
    // The layout of a table is fixed by its name, dim and group count; a
    // read-only tier opened here names it for the plain client.
    let layout_of = |table: &str| {
        let o = Options::new(cluster.seeds(), Mode::ReadOnly);
        rt.block_on(Backing::open(table, DIM, o)).expect("open the tier").layout().clone()
    };
    let keys: Vec<u64> = (1..=n as u64).map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 2).collect();
    let row: Vec<f32> = (0..DIM).map(|i| i as f32 * 0.5).collect();
    let mut rows = Vec::new();

    // Cold: the cluster holds every key (written by the plain client).
    let cold = layout_of("cold");
    for c in keys.chunks(batch) {
        rt.block_on(plain.run(PlainClient::mset(&cold, c, &row)));
    }
    let want = |what: &str| std::env::var("HKV_BENCH_ONLY").map_or(true, |o| o.split(',').any(|w| w == what));
    // CPU seconds of (this client, the cluster, the daemon).
    let cpu = || [cpu_secs(&[std::process::id()]), cpu_secs(&pids_named("redis-server")), cpu_secs(&[a.child.id()])];
    // With one request in flight (`cold`), then two on both sides (`cold2`).
    // `-shm`: hkvd's finds through a registered memfd (`find_in`).
    for (what, depth, shm) in [("cold", 1, false), ("cold2", 2, false), ("cold-shm", 1, true), ("cold2-shm", 2, true)] {
        if !want(what) {
            continue;
        }
        let region = shm.then(|| Shm::new(&mut ca, batch, depth));
        let (mut p, mut h, mut cpu_p, mut cpu_h) = (vec![], vec![], [0.0; 3], [0.0; 3]);
        for _ in 0..rounds {
            p.push(timed(n, &cpu, &mut cpu_p, || rt.block_on(plain_gets(&plain, &cold, keys.chunks(batch), depth))));
            remake(&mut ca, spec("cold", 2 * n as u64, &seeds, BackingMode::ReadOnly));
            h.push(timed(n, &cpu, &mut cpu_h, || match &region {
                Some(r) => r.finds(&mut ca, "cold", keys.chunks(batch), depth),
                None => hkvd_finds(&mut ca, "cold", keys.chunks(batch), depth),
            }));
        }
        print_cpu(what, batch, (rounds * n) as f64 / batch as f64, cpu_p, cpu_h);
        let b = backing(&mut ca, "cold");
        let ratios: Vec<f64> = h.iter().zip(&p).map(|(h, p)| h / p).collect();
        eprintln!("{what}: ratio per round {}", ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(" "));
        let ratio = median(ratios);
        rows.push(Row {
            what: match (depth, shm) {
                (1, false) => "cold read-through (find, every key a miss)",
                (_, false) => "cold, 2 requests in flight on both sides",
                (1, true) => "cold, through a memfd region",
                (_, true) => "cold, memfd, 2 in flight on both sides",
            },
            plain: median(p),
            hkvd: median(h),
            ratio,
            bar: ">= 0.80",
            note: format!(
                "last round: {} filled, {} hits; fetch p50 <= {} us per request of {batch}",
                b.filled, b.hits, b.fetch_p50_us
            ),
        });
    }

    // Warm: a Zipf stream over the same keys (rank 1 the hottest); the
    // cache holds fewer rows than the keys.
    if want("warm") {
        let zipf = rand_distr::Zipf::new(n as u64, 1.05).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(34);
        let stream: Vec<u64> = (0..2 * n).map(|_| keys[zipf.sample(&mut rng) as usize - 1]).collect();
        let warm = cold.clone();
        remake(&mut ca, spec("cold", warm_cap, &seeds, BackingMode::ReadOnly));
        for c in stream.chunks(batch) {
            ca.find("cold", c).expect("warm-up find");
        }
        let (mut p, mut h, mut hit, mut cpu_p, mut cpu_h) = (vec![], vec![], vec![], [0.0; 3], [0.0; 3]);
        for _ in 0..rounds {
            let k = stream.len();
            p.push(timed(k, &cpu, &mut cpu_p, || rt.block_on(plain_gets(&plain, &warm, stream.chunks(batch), 1))));
            let before = backing(&mut ca, "cold");
            h.push(timed(k, &cpu, &mut cpu_h, || hkvd_finds(&mut ca, "cold", stream.chunks(batch), 1)));
            let after = backing(&mut ca, "cold");
            let (hits, filled) = (after.hits - before.hits, after.filled - before.filled);
            hit.push(hits as f64 / (hits + filled).max(1) as f64);
        }
        // The ceiling of a warm find here: the same stream from a table
        // without a cluster that holds every key (no fills, no refresh).
        let mut local = vec![];
        ca.create_table(TableSpec::new("local", DIM, 2 * n as u64)).unwrap();
        let values: Vec<f32> = keys.iter().flat_map(|_| row.iter().copied()).collect();
        for (k, v) in keys.chunks(batch).zip(values.chunks(batch * DIM)) {
            ca.insert_or_assign("local", k, v, None).unwrap();
        }
        for _ in 0..rounds {
            let t = Instant::now();
            for c in stream.chunks(batch) {
                assert!(ca.find("local", c).expect("find").found.iter().all(|x| *x));
            }
            local.push(stream.len() as f64 / t.elapsed().as_secs_f64());
        }
        // The same through a registered memfd (`warm-shm`).
        let mut local_shm = vec![];
        if want("warm-shm") {
            let r = Shm::new(&mut ca, batch, 1);
            for _ in 0..rounds {
                let t = Instant::now();
                r.finds(&mut ca, "local", stream.chunks(batch), 1);
                local_shm.push(stream.len() as f64 / t.elapsed().as_secs_f64());
            }
        }
        ca.drop_table("local").unwrap();
        let pm = median(p.clone());
        let ratio = median(h.iter().zip(&p).map(|(h, p)| h / p).collect());
        rows.push(Row {
            what: "warm (Zipf 1.05, find)",
            plain: pm,
            hkvd: median(h),
            ratio,
            bar: ">= 5",
            note: format!("cache hits {:.1} % (capacity {warm_cap} of {n} keys)", 100.0 * median(hit)),
        });
        print_cpu("warm", batch, (rounds * stream.len()) as f64 / batch as f64, cpu_p, cpu_h);
        let lm = median(local);
        rows.push(Row {
            what: "  same stream, table without cluster",
            plain: pm,
            hkvd: lm,
            ratio: lm / pm,
            bar: "",
            note: "every key cached: the ceiling of a find here".into(),
        });
        if !local_shm.is_empty() {
            let lm = median(local_shm);
            rows.push(Row {
                what: "  same, through a memfd region",
                plain: pm,
                hkvd: lm,
                ratio: lm / pm,
                bar: "",
                note: "every key cached: the ceiling of a region find here".into(),
            });
        }
        // Both clients with two requests in flight: one request's misses
        // are fetched while the other's hits are answered (the plain
        // client's two batches go to the cluster at once).
        let (mut p2, mut h2) = (vec![], vec![]);
        for _ in 0..if want("warm2") { rounds } else { 0 } {
            let k = stream.len();
            p2.push(timed(k, &cpu, &mut [0.0; 3], || rt.block_on(plain_gets(&plain, &warm, stream.chunks(batch), 2))));
            h2.push(timed(k, &cpu, &mut [0.0; 3], || hkvd_finds(&mut ca, "cold", stream.chunks(batch), 2)));
        }
        if want("warm2") {
            let ratio = median(h2.iter().zip(&p2).map(|(h, p)| h / p).collect());
            let ratio1 = median(h2.iter().zip(&p).map(|(h, p)| h / p).collect());
            rows.push(Row {
                what: "warm, 2 requests in flight on both sides",
                plain: median(p2),
                hkvd: median(h2),
                ratio,
                bar: ">= 5",
                note: format!("hkvd (2 in flight) / plain (1 in flight): {ratio1:.2}"),
            });
        }
        // The warm stream through a registered memfd, against the plain
        // client's rounds above (one request in flight on both sides).
        if want("warm-shm") {
            let r = Shm::new(&mut ca, batch, 1);
            let (mut p3, mut h3) = (vec![], vec![]);
            for _ in 0..rounds {
                let k = stream.len();
                p3.push(timed(k, &cpu, &mut [0.0; 3], || {
                    rt.block_on(plain_gets(&plain, &warm, stream.chunks(batch), 1))
                }));
                h3.push(timed(k, &cpu, &mut [0.0; 3], || r.finds(&mut ca, "cold", stream.chunks(batch), 1)));
            }
            rows.push(Row {
                what: "warm, through a memfd region",
                plain: median(p3.clone()),
                hkvd: median(h3.clone()),
                ratio: median(h3.iter().zip(&p3).map(|(h, p)| h / p).collect()),
                bar: ">= 5",
                note: String::new(),
            });
        }
        ca.drop_table("cold").unwrap();
    }

    // Write-back of evictions: a table of 16384 rows takes n rows.
    if want("wb") {
        let wkeys: Vec<u64> = keys.iter().map(|k| k ^ (1 << 62)).collect();
        let values: Vec<f32> = wkeys.iter().flat_map(|_| row.iter().copied()).collect();
        let wb = layout_of("wb");
        let (mut p, mut h, mut evicted) = (vec![], vec![], vec![]);
        for _ in 0..rounds {
            let t = Instant::now();
            for c in wkeys.chunks(batch) {
                rt.block_on(plain.run(PlainClient::mset(&wb, c, &row)));
            }
            p.push(n as f64 / t.elapsed().as_secs_f64());
            remake(&mut ca, spec("wb", 16_384, &seeds, BackingMode::WriteBack));
            let t = Instant::now();
            let mut ev = 0;
            for (i, c) in wkeys.chunks(batch).enumerate() {
                let w = ca.insert_or_assign("wb", c, &values[i * batch * DIM..][..c.len() * DIM], None).expect("write");
                ev += w.evicted;
            }
            ca.flush("wb").expect("flush");
            h.push(n as f64 / t.elapsed().as_secs_f64());
            evicted.push(ev as f64);
        }
        let b = backing(&mut ca, "wb");
        let ratio = median(h.iter().zip(&p).map(|(h, p)| h / p).collect());
        rows.push(Row {
            what: "write-back (insert_or_assign + flush)",
            plain: median(p),
            hkvd: median(h),
            ratio,
            bar: ">= 0.80",
            note: format!("{:.0} evicted per round, last round {} rows written", median(evicted), b.rows_written),
        });
        ca.drop_table("wb").unwrap();
    }

    // Staleness: A writes at `rate` keys/s in batches of 100 for 10 s; B
    // (another daemon, read-only on the same table) drops what A wrote.
    if !want("stale") {
        return print(&rows, n, batch, rounds);
    }
    let bd = Daemon::start();
    let mut cb = bd.client();
    ca.create_table(spec("st", 1 << 16, &seeds, BackingMode::WriteThrough)).unwrap();
    cb.create_table(spec("st", 1 << 16, &seeds, BackingMode::ReadOnly)).unwrap();
    let per = 100usize;
    let period = Duration::from_secs_f64(per as f64 / rate as f64);
    let start = Instant::now();
    let mut sent = 0usize;
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(10) {
        let ks: Vec<u64> = (0..per as u64).map(|j| (i * per as u64 + j) % 50_000 + 1).collect();
        ca.insert_or_assign("st", &ks, &vec![1.0; per * DIM], None).expect("write");
        sent += per;
        i += 1;
        let next = period * i as u32;
        if let Some(d) = next.checked_sub(start.elapsed()) {
            std::thread::sleep(d);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(500));
    let s = backing(&mut cb, "st");
    print(&rows, n, batch, rounds);
    println!(
        "staleness A -> B at {:.0} writes/s for {secs:.1} s: p50 <= {} us, p99 <= {} us (bar p99 <= 50 ms); {} invalidated keys",
        sent as f64 / secs,
        s.staleness_p50_us,
        s.staleness_p99_us,
        s.invalidations
    );
}

fn print(rows: &[Row], n: usize, batch: usize, rounds: usize) {
    println!(
        "{n} keys, dim {DIM}, batches of {batch}, {rounds} alternated rounds, 3 redis-server masters and hkvd (cpu, 2 shards) on loopback"
    );
    println!("{:<42} {:>12} {:>12} {:>7} {:>8}  notes", "", "plain keys/s", "hkvd keys/s", "ratio", "bar");
    for r in rows {
        println!("{:<42} {:>12.0} {:>12.0} {:>7.2} {:>8}  {}", r.what, r.plain, r.hkvd, r.ratio, r.bar, r.note);
    }
}
