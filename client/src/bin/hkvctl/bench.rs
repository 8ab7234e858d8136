//! `hkvctl bench`: throughput over the socket and, with `--transport shm`,
//! through a registered memfd, with `--transport cuda-ipc` through device
//! memory registered with CUDA IPC (find and insert_or_assign beside the raw
//! socket moving the same bytes; with --features, the feature requests).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::io::Write;

use anyhow::{bail, Result};
use hkv_client::{proto, Client, ErrorCode, Request, TableSpec};
use rand::Rng;

/// A line on stdout, whose failure ends the bench: a reader that went
/// away (`hkvctl bench | head -1`) made `println!` panic, and the panic
/// hook's exit left the table behind. The error drops the table on its
/// way out, and main ends quietly with status 141 (cli.md).
macro_rules! say {
    ($($t:tt)*) => { writeln!(std::io::stdout().lock(), $($t)*)? };
}

/// The table a bench makes (`hkvctl-bench-PID`), dropped when the bench
/// ends, however it ends: done, failed, stopped by SIGINT, SIGTERM or
/// SIGHUP (a closed terminal), or its reader gone (stdout a closed pipe).
/// An interrupted bench used to leave its table behind, holding its
/// memory, and the next checkpoint saved it.
struct Scratch {
    socket: PathBuf,
    name: String,
    dropped: bool,
}

impl Scratch {
    /// Creates table `spec` on `c`. From just before, SIGINT, SIGTERM and
    /// SIGHUP drop it and end hkvctl with status 128 + the signal, as the signal
    /// would have.
    fn create(c: &mut Client, socket: &Path, spec: TableSpec) -> Result<Scratch> {
        let name = spec.name.clone();
        drop_on_signal(socket, &name)?;
        c.create_table(spec)?;
        Ok(Scratch { socket: socket.to_path_buf(), name, dropped: false })
    }

    /// Drops the table now (the bench is done).
    fn finish(mut self) -> Result<()> {
        self.dropped = true;
        drop_table(&self.socket, &self.name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.dropped {
            if let Err(e) = drop_table(&self.socket, &self.name) {
                let name = &self.name;
                let _ = writeln!(
                    std::io::stderr(),
                    "hkvctl bench: its table {name} was not dropped ({e:#}): hkvctl drop-table {name}"
                );
            }
        }
    }
}

/// Drops table `name` on its own connection (the bench's may be busy):
/// one already gone is fine; a daemon that does not answer does not keep
/// hkvctl from ending.
fn drop_table(socket: &Path, name: &str) -> Result<()> {
    let mut c = Client::connect(socket)?;
    c.set_timeout(Some(Duration::from_secs(10)))?;
    match c.drop_table(name) {
        Err(e) if e.code() != Some(ErrorCode::UnknownTable) => Err(e.into()),
        _ => Ok(()),
    }
}

/// Catches SIGINT, SIGTERM and SIGHUP from now on (the handlers are
/// installed before this returns); on any, a thread drops table `name` and
/// ends the process.
fn drop_on_signal(socket: &Path, name: &str) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut int, mut term, mut hup) = {
        let _in = rt.enter();
        (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?, signal(SignalKind::hangup())?)
    };
    let (socket, name) = (socket.to_path_buf(), name.to_string());
    std::thread::spawn(move || {
        let signal = rt.block_on(async {
            tokio::select! {
                _ = int.recv() => 2,
                _ = term.recv() => 15,
                _ = hup.recv() => 1,
            }
        });
        // Not eprintln!: after SIGHUP the terminal is gone, and its panic
        // would end this thread before the exit below.
        let said = match drop_table(&socket, &name) {
            Ok(()) => format!("hkvctl bench: stopped; its table {name} is dropped"),
            Err(e) => {
                format!("hkvctl bench: stopped; its table {name} was not dropped ({e:#}): hkvctl drop-table {name}")
            }
        };
        let _ = writeln!(std::io::stderr(), "{said}");
        std::process::exit(128 + signal);
    });
    Ok(())
}

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// Value dim.
    #[arg(long, default_value_t = 32)]
    pub dim: usize,
    /// Table capacity (slots); the table is filled to half.
    #[arg(long, default_value_t = 1 << 20)]
    pub capacity: u64,
    /// Keys per request, comma separated (each at least 1).
    #[arg(long, value_delimiter = ',', default_value = "65536,262144,1048576", value_parser = crate::cmd::at_least_1::<usize>)]
    pub batches: Vec<usize>,
    /// Concurrent client connections, comma separated (each at least 1).
    #[arg(long, value_delimiter = ',', default_value = "1,4", value_parser = crate::cmd::at_least_1::<usize>)]
    pub clients: Vec<usize>,
    /// Requests in flight per connection (at least 1).
    #[arg(long, default_value_t = 2, value_parser = crate::cmd::at_least_1::<usize>)]
    pub pipeline: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Untimed seconds of the same requests before each measurement, so
    /// that buffers on both ends exist before the clock starts (0: none).
    #[arg(long, default_value_t = 0.5)]
    pub warmup: f64,
    /// Print one JSON object per line and figure: transport, op, batch,
    /// clients, keys_per_s, bytes_per_s.
    #[arg(long)]
    pub json: bool,
    /// Transports measured side by side, comma separated: `socket` (arrays
    /// in the frames), `shm` (arrays in a registered memfd; find's rows
    /// written by the table straight into it), `cuda-ipc` (arrays in device
    /// memory of GPU 0 of this process, registered through CUDA IPC: needs
    /// a CUDA daemon serving that GPU). The raw socket (echo of the same
    /// bytes) is measured with any.
    #[arg(long, value_delimiter = ',', default_value = "socket")]
    pub transport: Vec<String>,
    /// What is measured, comma separated: `raw` (the socket echoing the
    /// bytes a find moves), `find`, `insert` (insert_or_assign). With fewer
    /// than all three, the daemon's `stats.path` holds only those requests
    /// (and the table's filling).
    #[arg(long, value_delimiter = ',', default_value = "raw,find,insert")]
    pub ops: Vec<String>,
    /// With `cuda-ipc`: each request names a done event, which the daemon
    /// records after the request's work and, on a table of one shard,
    /// answers before that work ran (PROTOCOL.md, "Events"); a request
    /// counts as done once its answer arrived and the event completed.
    #[arg(long)]
    pub done_event: bool,
    /// Measure feature requests instead: find with precomputed keys, fused
    /// find_features, and hash then find (two round trips), int64 features.
    #[arg(long)]
    pub features: bool,
}

/// Keys per request of the bench's filling of its table, at most (fewer
/// where the daemon's limits.max_frame_bytes takes fewer).
const FILL_BATCH: u64 = 1 << 18;

/// Refuses, before the table is made, a batch whose largest frame the
/// daemon would refuse (a find's answer, a write's body or, with
/// `features`, a feature request's body): `--batches 100000000` built 3 GB
/// of requests before the daemon's `oversized`.
fn check_batches(c: &mut Client, a: &BenchArgs, table: &str, features: bool) -> Result<()> {
    let dim = a.dim;
    let find_answer = |n: u64| 16u64.saturating_add(n.saturating_mul(1 + 4 * dim as u64));
    let frame = |n: u64| {
        let body = if features {
            crate::frame::body_len(
                |k| Request::FindFeatures {
                    table: table.into(),
                    hash: proto::HashSpec::Table,
                    features: proto::Features::Int64(vec![0; k]),
                    scores: false,
                },
                n,
            )
        } else {
            crate::frame::insert_body_len(table, dim, n)
        };
        find_answer(n).max(body)
    };
    if let Some(&most) = a.batches.iter().max() {
        let what = format!("a batch of {most} keys at dim {dim}");
        crate::frame::check(c, most as u64, &frame, &what, "--batches")?;
    }
    Ok(())
}

/// A figure of the text table, `width` wide with `precision` decimals,
/// or `-` for one not measured (`--ops`): it printed NaN.
fn cell(v: Option<f64>, width: usize, precision: usize) -> String {
    match v {
        Some(x) => format!("{x:>width$.precision$}"),
        None => format!("{:>width$}", "-"),
    }
}

/// Runs `run` on `clients` connections at once (each on its own thread);
/// returns keys per second over all of them: the keys they did over the
/// longest time one took.
fn across_clients(
    socket: &PathBuf,
    clients: usize,
    run: &(dyn Fn(&mut Client) -> Result<(u64, f64)> + Sync),
) -> Result<f64> {
    hkv_client::region::bench::across_threads(clients, &|| run(&mut Client::connect(socket)?))
}

/// One measurement: `clients` connections, each keeping `pipeline` requests
/// in flight for `warmup` seconds untimed and then for `seconds`; returns
/// keys per second of the timed part.
fn measure(
    socket: &PathBuf,
    a: &BenchArgs,
    clients: usize,
    make: &(dyn Fn(&mut rand::rngs::ThreadRng) -> Request + Sync),
) -> Result<f64> {
    across_clients(socket, clients, &|c| {
        let mut rng = rand::thread_rng();
        let reqs: Vec<Request> = (0..a.pipeline.max(1) + 1).map(|_| make(&mut rng)).collect();
        // The first large answers of a kind make the daemon allocate (and on
        // the CUDA backend page-lock) the frames it then keeps reusing, and
        // the client grow its buffers: a warm-up keeps that out of the figure.
        keep_busy(c, &reqs, a.pipeline, Duration::from_secs_f64(a.warmup))?;
        keep_busy(c, &reqs, a.pipeline, Duration::from_secs_f64(a.seconds))
    })
}

/// Sends `reqs` in turn, `pipeline` in flight, until `time` has passed, then
/// waits for the answers still due; returns the keys answered and the
/// seconds taken.
fn keep_busy(c: &mut Client, reqs: &[Request], pipeline: usize, time: Duration) -> Result<(u64, f64)> {
    let per = match &reqs[0] {
        Request::Find { keys, .. } | Request::Write { keys, .. } => keys.len() as u64,
        Request::FindFeatures { features, .. } => features.len() as u64,
        Request::Echo { padding, .. } => (*padding / 8) as u64,
        _ => 1,
    };
    let start = Instant::now();
    let (mut sent, mut done) = (0usize, 0u64);
    for _ in 0..pipeline.max(1) {
        c.send(&reqs[sent % reqs.len()])?;
        sent += 1;
    }
    // Answers go back to the client for the next ones to be read into, as a
    // loop of same-sized finds would do.
    while start.elapsed() < time {
        let (_, r) = c.recv()?;
        c.recycle(hkv_client::ok(r)?);
        done += per;
        c.send(&reqs[sent % reqs.len()])?;
        sent += 1;
    }
    for _ in 0..pipeline.max(1) {
        let (_, r) = c.recv()?;
        c.recycle(hkv_client::ok(r)?);
        done += per;
    }
    Ok((done, start.elapsed().as_secs_f64()))
}

/// `hkvctl bench --features`: int64 features 1..=fill hashed with the
/// table's Fingerprint64 setting; the same lookups three ways.
pub fn bench_features(socket: PathBuf, a: BenchArgs) -> Result<()> {
    let mut c = Client::connect(&socket)?;
    let table = format!("hkvctl-bench-{}", std::process::id());
    check_batches(&mut c, &a, &table, true)?;
    let nb = 1u64 << 40;
    let scratch = Scratch::create(
        &mut c,
        &socket,
        TableSpec { hash: Some(proto::FeatureHash::fingerprint64(nb)), ..TableSpec::new(&table, a.dim, a.capacity) },
    )?;
    let fill = (a.capacity / 2) as i64;
    // Requests the daemon's frame limit takes, whatever --batches says (the
    // insert's body is larger than the hash's, and than its answer).
    let insert = |n: u64| crate::frame::insert_body_len(&table, a.dim, n);
    let chunk = crate::frame::fitting(&mut c, (fill as u64).clamp(1, FILL_BATCH), &insert)? as i64;
    let mut resident = Vec::with_capacity(fill as usize);
    let mut x = 1i64;
    while x <= fill {
        let n = (fill + 1 - x).min(chunk);
        let f: Vec<i64> = (x..x + n).collect();
        let keys = c.hash(&table, proto::HashSpec::Table, proto::Features::Int64(f))?;
        c.insert_or_assign(&table, &keys, &vec![0.5; keys.len() * a.dim], None)?;
        resident.extend(keys);
        x += n;
    }
    say!(
        "hkvctl bench --features: table dim {}, capacity {}, {fill} int64 features resident; {} s per figure after {} s warm-up, pipeline {}",
        a.dim, a.capacity, a.seconds, a.warmup, a.pipeline
    );
    say!(
        "{:>8} {:>7} {:>16} {:>18} {:>16} {:>12}",
        "batch",
        "clients",
        "find keys/s",
        "find_features/s",
        "hash+find/s",
        "fused/find"
    );
    for &batch in &a.batches {
        for &clients in &a.clients {
            let (t, r) = (table.clone(), &resident);
            let find = measure(&socket, &a, clients, &|rng| Request::Find {
                table: t.clone(),
                keys: (0..batch).map(|_| r[rng.gen_range(0..r.len())]).collect(),
                scores: false,
            })?;
            let t = table.clone();
            let fused = measure(&socket, &a, clients, &|rng| Request::FindFeatures {
                table: t.clone(),
                hash: proto::HashSpec::Table,
                features: proto::Features::Int64((0..batch).map(|_| rng.gen_range(1..=fill)).collect()),
                scores: false,
            })?;
            let two = hash_then_find(&socket, &a, clients, &table, batch, fill)?;
            if a.json {
                say!(
                    "{}",
                    serde_json::json!({"batch": batch, "clients": clients, "dim": a.dim, "find_keys_per_s": find,
                        "find_features_per_s": fused, "hash_then_find_per_s": two, "fused_over_find": fused / find})
                );
            } else {
                say!(
                    "{:>8} {:>7} {:>16.0} {:>18.0} {:>16.0} {:>11.0}%",
                    batch,
                    clients,
                    find,
                    fused,
                    two,
                    100.0 * fused / find
                );
            }
        }
    }
    scratch.finish()
}

/// Features per second of `hash`, then `find` with the keys (two round
/// trips per batch, `a.pipeline` batches in flight per connection).
fn hash_then_find(
    socket: &PathBuf,
    a: &BenchArgs,
    clients: usize,
    table: &str,
    batch: usize,
    fill: i64,
) -> Result<f64> {
    across_clients(socket, clients, &|c| {
        let mut rng = rand::thread_rng();
        let reqs: Vec<Request> = (0..a.pipeline.max(1) + 1)
            .map(|_| Request::Hash {
                table: table.into(),
                hash: proto::HashSpec::Table,
                features: proto::Features::Int64((0..batch).map(|_| rng.gen_range(1..=fill)).collect()),
            })
            .collect();
        let mut run = |time: Duration| -> Result<(u64, f64)> {
            let start = Instant::now();
            let (mut sent, mut done) = (0usize, 0u64);
            let mut ids = std::collections::HashSet::new();
            for _ in 0..a.pipeline.max(1) {
                ids.insert(c.send(&reqs[sent % reqs.len()])?);
                sent += 1;
            }
            let mut outstanding = a.pipeline.max(1);
            while outstanding > 0 {
                let (id, r) = c.recv()?;
                if ids.remove(&id) {
                    let hkv_client::Response::Keys(keys) = hkv_client::ok(r)? else { bail!("hash: unexpected answer") };
                    c.send(&Request::Find { table: table.into(), keys, scores: false })?;
                } else {
                    hkv_client::ok(r)?;
                    done += batch as u64;
                    outstanding -= 1;
                    if start.elapsed() < time {
                        ids.insert(c.send(&reqs[sent % reqs.len()])?);
                        sent += 1;
                        outstanding += 1;
                    }
                }
            }
            Ok((done, start.elapsed().as_secs_f64()))
        };
        run(Duration::from_secs_f64(a.warmup))?;
        run(Duration::from_secs_f64(a.seconds))
    })
}

pub fn bench(socket: PathBuf, a: BenchArgs) -> Result<()> {
    if a.features {
        return bench_features(socket, a);
    }
    for o in &a.ops {
        if !matches!(o.as_str(), "raw" | "find" | "insert") {
            bail!("--ops {o}: use raw, find or insert");
        }
    }
    if a.done_event && !a.transport.iter().any(|t| t == "cuda-ipc") {
        bail!("--done-event is for --transport cuda-ipc (events order device work; other transports have none)");
    }
    for t in &a.transport {
        if !matches!(t.as_str(), "socket" | "shm" | "cuda-ipc") {
            bail!("--transport {t}: use socket, shm or cuda-ipc");
        }
        if t == "cuda-ipc" {
            if let Err(e) = hkv_region::cuda::available() {
                bail!("--transport cuda-ipc needs a CUDA device in this process: {e}");
            }
        }
    }
    let mut c = Client::connect(&socket)?;
    let table = format!("hkvctl-bench-{}", std::process::id());
    check_batches(&mut c, &a, &table, false)?;
    let scratch = Scratch::create(&mut c, &socket, TableSpec::new(&table, a.dim, a.capacity))?;
    let fill = (a.capacity / 2) as usize;
    // Requests the daemon's frame limit takes, whatever --batches says
    // (they were 1 << 18 keys, 34 MB at dim 32, however small the limit).
    let insert = |n: u64| crate::frame::insert_body_len(&table, a.dim, n);
    let chunk = crate::frame::fitting(&mut c, (fill as u64).clamp(1, FILL_BATCH), &insert)? as usize;
    let mut key = 1u64;
    while (key as usize) <= fill {
        let n = (fill + 1 - key as usize).min(chunk);
        let keys: Vec<u64> = (key..key + n as u64).collect();
        c.insert_or_assign(&table, &keys, &vec![0.5; n * a.dim], None)?;
        key += n as u64;
    }
    let resident = fill as u64;
    // With --json, stdout holds the JSON lines only.
    let info = format!(
        "hkvctl bench: table dim {}, capacity {}, {} keys resident; {} s per figure after {} s warm-up, pipeline {}",
        a.dim, a.capacity, resident, a.seconds, a.warmup, a.pipeline
    );
    if a.json {
        eprintln!("{info}");
    } else {
        say!("{info}");
        say!(
            "{:>8} {:>7} {:>9} {:>14} {:>10} {:>14} {:>10} {:>10} {:>14} {:>10}",
            "batch",
            "clients",
            "transport",
            "find keys/s",
            "find GB/s",
            "raw keys/s",
            "raw GB/s",
            "find/raw",
            "insert keys/s",
            "ins GB/s"
        );
    }
    let row_bytes = |n: usize| (n * 8 + n * (1 + 4 * a.dim)) as f64;
    let ins_bytes = (12 + 4 * a.dim) as f64;
    for &batch in &a.batches {
        for &clients in &a.clients {
            // The same bytes each way: keys in, flags and values out.
            let reply = (batch * (1 + 4 * a.dim) + 8) as u32;
            let want = |op: &str| a.ops.iter().any(|o| o == op);
            // None: not measured (--ops), `-` in the text table.
            let raw = if want("raw") {
                Some(measure(&socket, &a, clients, &|_| Request::Echo { reply_len: reply, padding: batch * 8 })?)
            } else {
                None
            };
            let figure = |transport: &str, op: &str, kps: f64, per_key: f64| -> Result<()> {
                say!(
                    "{}",
                    serde_json::json!({"transport": transport, "op": op, "batch": batch, "clients": clients,
                        "dim": a.dim, "keys_per_s": kps, "bytes_per_s": kps * per_key})
                );
                Ok(())
            };
            if let (true, Some(raw)) = (a.json, raw) {
                figure("raw_socket", "echo", raw, row_bytes(1))?;
            }
            for transport in &a.transport {
                let region = match transport.as_str() {
                    "shm" => Some(hkv_client::region::bench::Transport::Shm),
                    "cuda-ipc" => Some(hkv_client::region::bench::Transport::CudaIpc),
                    _ => None,
                };
                let (find, insert) = if let Some(region) = region {
                    let plan = hkv_client::region::bench::Plan {
                        table: table.clone(),
                        dim: a.dim,
                        batch,
                        resident,
                        pipeline: a.pipeline,
                        warmup: a.warmup,
                        seconds: a.seconds,
                        done_event: a.done_event,
                    };
                    let (f, i) = hkv_client::region::bench::measure_ops(
                        &socket,
                        clients,
                        &plan,
                        region,
                        want("find"),
                        want("insert"),
                    )?;
                    (f, i)
                } else {
                    let t = table.clone();
                    let find = if want("find") {
                        Some(measure(&socket, &a, clients, &|rng| Request::Find {
                            table: t.clone(),
                            keys: (0..batch).map(|_| rng.gen_range(1..=resident)).collect(),
                            scores: false,
                        })?)
                    } else {
                        None
                    };
                    let t = table.clone();
                    let dim = a.dim;
                    let insert = if want("insert") {
                        Some(measure(&socket, &a, clients, &|rng| Request::Write {
                            op: proto::WriteOp::InsertOrAssign,
                            table: t.clone(),
                            keys: (0..batch).map(|_| rng.gen_range(1..=resident)).collect(),
                            values: vec![1.5; batch * dim],
                            scores: None,
                            outcomes: false,
                        })?)
                    } else {
                        None
                    };
                    (find, insert)
                };
                let gb = |kps: Option<f64>| kps.map(|k| k * row_bytes(1) / 1e9);
                if a.json {
                    // An op not measured has no line (rather than a null figure).
                    if let Some(find) = find {
                        figure(transport, "find", find, row_bytes(1))?;
                    }
                    if let Some(insert) = insert {
                        figure(transport, "insert_or_assign", insert, ins_bytes)?;
                    }
                } else {
                    let ratio = match (find, raw) {
                        (Some(f), Some(r)) => format!("{:>9.0}%", 100.0 * f / r),
                        _ => format!("{:>10}", "-"),
                    };
                    say!(
                        "{:>8} {:>7} {:>9} {} {} {} {} {ratio} {} {}",
                        batch,
                        clients,
                        transport,
                        cell(find, 14, 0),
                        cell(gb(find), 10, 2),
                        cell(raw, 14, 0),
                        cell(gb(raw), 10, 2),
                        cell(insert, 14, 0),
                        cell(insert.map(|i| i * ins_bytes / 1e9), 10, 2)
                    );
                }
            }
        }
    }
    scratch.finish()
}
