//! hkvctl: the command-line client of hkvd.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use hkv_client::{proto, Client, ClientError, Request, TableSpec};
use rand::Rng;

#[derive(Parser)]
#[command(name = "hkvctl", version, about = "Command-line client of hkvd")]
struct Cli {
    /// Socket path [default: $HKVD_SOCKET, else $XDG_RUNTIME_DIR/hkvd/hkvd.sock, else ./hkvd-run/hkvd.sock].
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Check that the daemon answers.
    Ping,
    /// Create a table spread over every shard.
    CreateTable {
        /// Table name (letters, digits, '_', '-', '.').
        name: String,
        /// f32 elements per value.
        #[arg(long)]
        dim: usize,
        /// Slots over all shards.
        #[arg(long)]
        capacity: u64,
        /// lru, lfu, epoch-lru, epoch-lfu or custom.
        #[arg(long, default_value = "lru")]
        policy: String,
        /// Dual-bucket mode (fills to ~98 % before evicting).
        #[arg(long)]
        dual: bool,
        /// Growth limit (slots); default: no growth.
        #[arg(long, default_value_t = 0)]
        max_capacity: u64,
        /// Device-memory budget for values in bytes (CUDA); default: all.
        #[arg(long)]
        fast_tier_bytes: Option<u64>,
        /// Default feature hash of the table: fingerprint64 or strong (needs --num-buckets).
        #[arg(long)]
        hash: Option<String>,
        /// Default num_buckets of feature requests (keys = hash % num_buckets).
        #[arg(long)]
        num_buckets: Option<u64>,
        /// SipHash key of the strong hash: K0,K1 (needs --hash strong).
        #[arg(long, value_delimiter = ',')]
        hash_key: Option<Vec<u64>>,
    },
    /// Keys of raw features: one line per feature, `FEATURE: KEY`.
    Hash {
        /// Features (strings, or int64 with --int; negative ones after `--`); or --from FILE.
        #[arg(required_unless_present = "from")]
        features: Vec<String>,
        #[command(flatten)]
        input: Input,
        #[command(flatten)]
        hash: HashArgs,
        /// Use this table's hash setting when no --kind / --num-buckets is given.
        #[arg(long)]
        table: Option<String>,
    },
    /// Hash features and find their keys in one request: one line per
    /// feature, `FEATURE: V1,V2,...` or `FEATURE: not found`.
    FindFeatures {
        /// Table name.
        table: String,
        /// Features (strings, or int64 with --int; negative ones after `--`); or --from FILE.
        #[arg(required_unless_present = "from")]
        features: Vec<String>,
        #[command(flatten)]
        input: Input,
        #[command(flatten)]
        hash: HashArgs,
    },
    /// Hash features and find_or_insert their keys: FEATURE=V1,V2,... entries
    /// (the values are inserted for absent keys); prints the stored values.
    FindOrInsertFeatures {
        /// Table name.
        table: String,
        /// FEATURE=V1,V2,... entries; or --from FILE (one entry each).
        #[arg(required_unless_present = "from")]
        entries: Vec<String>,
        #[command(flatten)]
        input: Input,
        #[command(flatten)]
        hash: HashArgs,
        /// One score per entry (lfu increments, custom scores).
        #[arg(long, value_delimiter = ',')]
        scores: Option<Vec<u64>>,
    },
    /// Drop a table.
    DropTable {
        /// Table name.
        name: String,
    },
    /// List tables.
    Tables,
    /// Write values: KEY=V1,V2,... (dim values each).
    Put {
        /// Table name.
        table: String,
        /// KEY=V1,V2,... entries.
        #[arg(required = true)]
        entries: Vec<String>,
        /// One score per entry (lfu increments, custom scores).
        #[arg(long, value_delimiter = ',')]
        scores: Option<Vec<u64>>,
    },
    /// Print values: one line per key, `KEY: V1,V2,...` or `KEY: not found`.
    Get {
        /// Table name.
        table: String,
        /// Keys.
        #[arg(required = true)]
        keys: Vec<u64>,
    },
    /// Write `count` keys from `start` with test values (key as f32 + position), for demos and benchmarks.
    Fill {
        /// Table name.
        table: String,
        /// Keys to write.
        #[arg(long)]
        count: u64,
        /// First key.
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// Keys per request.
        #[arg(long, default_value_t = 1 << 18)]
        batch: u64,
    },
    /// Remove keys.
    Erase {
        /// Table name.
        table: String,
        /// Keys.
        #[arg(required = true)]
        keys: Vec<u64>,
    },
    /// Statistics per table (and per shard with --json).
    Stats {
        /// Print the daemon's JSON document.
        #[arg(long)]
        json: bool,
    },
    /// Prometheus text.
    Metrics,
    /// Throughput over the socket: find and insert_or_assign beside the raw
    /// socket moving the same bytes.
    Bench(BenchArgs),
    /// Take a checkpoint now; with --wait, show its progress until it completes.
    Checkpoint {
        /// Wait for it, with a progress bar.
        #[arg(long)]
        wait: bool,
        /// A full checkpoint even when an incremental one is due.
        #[arg(long)]
        full: bool,
    },
    /// List checkpoints with size, entry counts and status.
    Checkpoints,
    /// Restore a checkpoint (an id from `checkpoints`, or latest) into the running daemon.
    Restore {
        /// Checkpoint id or `latest`.
        id: String,
    },
    /// Ask the daemon to finish in-flight requests and exit.
    Shutdown,
    /// The operator console (runs `hkvd top`, from beside hkvctl or from PATH).
    Top {
        /// Arguments passed on to `hkvd top`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// How features become keys; without --kind and --num-buckets the table's setting applies.
#[derive(clap::Args, Clone)]
struct HashArgs {
    /// fingerprint64 (TensorFlow to_hash_bucket_fast) or strong (to_hash_bucket_strong).
    #[arg(long)]
    kind: Option<String>,
    /// Keys are hash % num_buckets.
    #[arg(long)]
    num_buckets: Option<u64>,
    /// SipHash key of the strong hash: K0,K1 (needs --kind strong).
    #[arg(long, value_delimiter = ',')]
    key: Option<Vec<u64>>,
    /// The features are int64 (hashed as their decimal text, like as_string).
    #[arg(long)]
    int: bool,
}

/// Where features come from and how answers are printed.
#[derive(clap::Args, Clone)]
struct Input {
    /// Read the features (or FEATURE=V1,... entries) from FILE, `-` for
    /// standard input: one a line, or NUL-separated with -0. Sent in one request.
    #[arg(long, value_name = "FILE")]
    from: Option<PathBuf>,
    /// With --from: items are separated by NUL bytes, not newlines (features
    /// that hold newlines).
    #[arg(short = '0', long = "null", requires = "from")]
    null: bool,
    /// Print one JSON object a line ({"feature": .., "key": ..} / {"feature":
    /// .., "values": [..]} / {"feature": .., "found": false}).
    #[arg(long)]
    json: bool,
}

impl Input {
    /// The items: the arguments, or those of --from.
    fn items(&self, args: Vec<String>) -> Result<Vec<String>> {
        let Some(path) = &self.from else { return Ok(args) };
        if !args.is_empty() {
            bail!("give features as arguments or with --from, not both");
        }
        let mut bytes = vec![];
        if path.as_os_str() == "-" {
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).context("reading standard input")?;
        } else {
            bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        }
        let text = String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))?;
        let sep = if self.null { '\0' } else { '\n' };
        let mut items: Vec<String> = text.split(sep).map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()).collect();
        if items.last().is_some_and(|l| l.is_empty()) {
            items.pop();
        }
        Ok(items)
    }

    /// One answer line: `FEATURE: WHAT` (the feature escaped when a newline,
    /// tab, control character or backslash would make the line ambiguous),
    /// or a JSON object.
    fn line(&self, feature: &str, what: Answer) {
        if self.json {
            let v = match what {
                Answer::Key(k) => serde_json::json!({"feature": feature, "key": k}),
                Answer::Values(v) => serde_json::json!({"feature": feature, "values": v}),
                Answer::Missing => serde_json::json!({"feature": feature, "found": false}),
            };
            println!("{v}");
            return;
        }
        let shown: std::borrow::Cow<str> = if feature.chars().any(|c| c.is_control() || c == '\\') {
            feature.escape_default().to_string().into()
        } else {
            feature.into()
        };
        match what {
            Answer::Key(k) => println!("{shown}: {k}"),
            Answer::Values(v) => println!("{shown}: {}", fmt_values(v)),
            Answer::Missing => println!("{shown}: not found"),
        }
    }
}

/// What one feature got.
enum Answer<'a> {
    Key(u64),
    Values(&'a [f32]),
    Missing,
}

impl HashArgs {
    fn spec(&self) -> Result<proto::HashSpec> {
        Ok(match feature_hash("--kind", &self.kind, self.num_buckets, &self.key)? {
            None => proto::HashSpec::Table,
            Some(h) => proto::HashSpec::Given(h),
        })
    }

    fn features(&self, items: &[String]) -> Result<proto::Features> {
        if self.int {
            let v = items
                .iter()
                .map(|x| x.trim().parse::<i64>().with_context(|| format!("{x:?} is not an int64 feature")))
                .collect::<Result<Vec<_>>>()?;
            Ok(proto::Features::Int64(v))
        } else {
            Ok(proto::Features::strings(items))
        }
    }
}

/// A hash setting from its flags: none without a kind or bucket count; a
/// kind (`flag`) without --num-buckets is an error.
fn feature_hash(
    flag: &str,
    kind: &Option<String>,
    num_buckets: Option<u64>,
    key: &Option<Vec<u64>>,
) -> Result<Option<proto::FeatureHash>> {
    if let Some(k) = key {
        let key_flag = if flag == "--hash" { "--hash-key" } else { "--key" };
        if kind.as_deref() != Some("strong") {
            bail!("{key_flag} is the SipHash key of the strong hash: add {flag} strong");
        }
        if k.len() != 2 {
            bail!("{key_flag} takes two u64 numbers, K0,K1; got {}", k.len());
        }
    }
    Ok(match (kind, num_buckets) {
        (None, None) => None,
        (_, None) => bail!("{flag} needs --num-buckets"),
        (kind, Some(num_buckets)) => Some(proto::FeatureHash {
            kind: kind.clone().unwrap_or_else(|| "fingerprint64".into()),
            num_buckets,
            key: key.as_ref().map(|k| [k[0], k.get(1).copied().unwrap_or(0)]).unwrap_or([0, 0]),
        }),
    })
}

#[derive(clap::Args, Clone)]
struct BenchArgs {
    /// Value dim.
    #[arg(long, default_value_t = 32)]
    dim: usize,
    /// Table capacity (slots); the table is filled to half.
    #[arg(long, default_value_t = 1 << 20)]
    capacity: u64,
    /// Keys per request, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "65536,262144,1048576")]
    batches: Vec<usize>,
    /// Concurrent client connections, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    clients: Vec<usize>,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 2)]
    pipeline: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Untimed seconds of the same requests before each measurement, so
    /// that buffers on both ends exist before the clock starts (0: none).
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Print one JSON object per line and figure: transport, op, batch,
    /// clients, keys_per_s, bytes_per_s.
    #[arg(long)]
    json: bool,
    /// Transports measured side by side, comma separated: `socket` (arrays
    /// in the frames), `shm` (arrays in a registered memfd; find's rows
    /// written by the table straight into it). The raw socket (echo of the
    /// same bytes) is measured with either.
    #[arg(long, value_delimiter = ',', default_value = "socket")]
    transport: Vec<String>,
    /// Measure feature requests instead: find with precomputed keys, fused
    /// find_features, and hash then find (two round trips), int64 features.
    #[arg(long)]
    features: bool,
}

fn parse_entry(s: &str) -> Result<(u64, Vec<f32>)> {
    let (k, v) = s.split_once('=').with_context(|| format!("{s:?}: expected KEY=V1,V2,..."))?;
    let key = k.trim().parse().with_context(|| format!("{k:?} is not a u64 key"))?;
    let vals = v
        .split(',')
        .map(|x| x.trim().parse::<f32>().with_context(|| format!("{x:?} is not a number")))
        .collect::<Result<Vec<_>>>()?;
    Ok((key, vals))
}

fn table_dim(c: &mut Client, table: &str) -> Result<usize> {
    let t =
        c.tables()?.into_iter().find(|t| t.spec.name == table).with_context(|| format!("no table named {table:?}"))?;
    Ok(t.spec.dim)
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of a Unix time in ms.
fn fmt_time(ms: u64) -> String {
    let s = ms / 1000;
    let (days, rem) = (s / 86400, s % 86400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// One line per label: `LABEL: V1,V2,...` or `LABEL: not found`.
fn print_found<L: std::fmt::Display>(labels: &[L], f: &hkv_client::Found) {
    let dim = if labels.is_empty() { 0 } else { f.values.len() / labels.len() };
    for (i, l) in labels.iter().enumerate() {
        if f.found[i] {
            println!("{l}: {}", fmt_values(&f.values[i * dim..(i + 1) * dim]));
        } else {
            println!("{l}: not found");
        }
    }
}

fn fmt_values(v: &[f32]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

fn stats_table(v: &serde_json::Value) -> String {
    let mut out = format!(
        "hkvd {}  backend {}  hashing on {}  up {:.0}s  connections {}  requests {}  errors {}\n",
        v["version"].as_str().unwrap_or("?"),
        v["backend"].as_str().unwrap_or("?"),
        v["feature_hashing"].as_str().unwrap_or("?"),
        v["uptime_s"].as_f64().unwrap_or(0.0),
        v["connections"],
        v["requests"],
        v["errors"]
    );
    out += &format!(
        "{:<20} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6} {:>8} {:>12} {:>12}\n",
        "table", "dim", "policy", "mode", "size", "capacity", "load", "hit %", "evictions", "rejections"
    );
    for t in v["tables"].as_array().into_iter().flatten() {
        let sum =
            |f: &str| t["shards"].as_array().into_iter().flatten().map(|s| s[f].as_u64().unwrap_or(0)).sum::<u64>();
        let (hits, misses) = (sum("hits"), sum("misses"));
        let rate =
            if hits + misses > 0 { format!("{:.2}", 100.0 * hits as f64 / (hits + misses) as f64) } else { "-".into() };
        out += &format!(
            "{:<20} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6.3} {:>8} {:>12} {:>12}\n",
            t["spec"]["name"].as_str().unwrap_or("?"),
            t["spec"]["dim"].as_u64().unwrap_or(0),
            t["spec"]["policy"].as_str().unwrap_or("?"),
            t["spec"]["mode"].as_str().unwrap_or("?"),
            t["size"].as_u64().unwrap_or(0),
            t["capacity"].as_u64().unwrap_or(0),
            t["load_factor"].as_f64().unwrap_or(0.0),
            rate,
            sum("evictions"),
            sum("rejections")
        );
    }
    out
}

/// Runs `run` on `clients` connections at once (each on its own thread);
/// returns keys per second over all of them: the keys they did over the
/// longest time one took.
fn across_clients(
    socket: &PathBuf,
    clients: usize,
    run: &(dyn Fn(&mut Client) -> Result<(u64, f64)> + Sync),
) -> Result<f64> {
    let results: Vec<Result<(u64, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..clients).map(|_| s.spawn(move || run(&mut Client::connect(socket)?))).collect();
        hs.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    let (mut keys, mut secs) = (0u64, 0f64);
    for r in results {
        let (k, s) = r?;
        keys += k;
        secs = secs.max(s);
    }
    Ok(keys as f64 / secs)
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
fn bench_features(socket: PathBuf, a: BenchArgs) -> Result<()> {
    let mut c = Client::connect(&socket)?;
    let table = format!("hkvctl-bench-{}", std::process::id());
    let nb = 1u64 << 40;
    c.create_table(TableSpec {
        hash: Some(proto::FeatureHash::fingerprint64(nb)),
        ..TableSpec::new(&table, a.dim, a.capacity)
    })?;
    let fill = (a.capacity / 2) as i64;
    let mut resident = Vec::with_capacity(fill as usize);
    let mut x = 1i64;
    while x <= fill {
        let n = (fill + 1 - x).min(1 << 18);
        let f: Vec<i64> = (x..x + n).collect();
        let keys = c.hash(&table, proto::HashSpec::Table, proto::Features::Int64(f))?;
        c.insert_or_assign(&table, &keys, &vec![0.5; keys.len() * a.dim], None)?;
        resident.extend(keys);
        x += n;
    }
    println!(
        "hkvctl bench --features: table dim {}, capacity {}, {fill} int64 features resident; {} s per figure after {} s warm-up, pipeline {}",
        a.dim, a.capacity, a.seconds, a.warmup, a.pipeline
    );
    println!(
        "{:>8} {:>7} {:>16} {:>18} {:>16} {:>12}",
        "batch", "clients", "find keys/s", "find_features/s", "hash+find/s", "fused/find"
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
                println!(
                    "{}",
                    serde_json::json!({"batch": batch, "clients": clients, "dim": a.dim, "find_keys_per_s": find,
                        "find_features_per_s": fused, "hash_then_find_per_s": two, "fused_over_find": fused / find})
                );
            } else {
                println!(
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
    c.drop_table(&table)?;
    Ok(())
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

fn bench(socket: PathBuf, a: BenchArgs) -> Result<()> {
    if a.features {
        return bench_features(socket, a);
    }
    for t in &a.transport {
        if !matches!(t.as_str(), "socket" | "shm") {
            bail!("--transport {t}: use socket or shm");
        }
    }
    let mut c = Client::connect(&socket)?;
    let table = format!("hkvctl-bench-{}", std::process::id());
    c.create_table(TableSpec::new(&table, a.dim, a.capacity))?;
    let fill = (a.capacity / 2) as usize;
    let mut key = 1u64;
    while (key as usize) <= fill {
        let n = (fill + 1 - key as usize).min(1 << 18);
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
        println!("{info}");
    }
    if !a.json {
        println!(
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
            let raw = measure(&socket, &a, clients, &|_| Request::Echo { reply_len: reply, padding: batch * 8 })?;
            let figure = |transport: &str, op: &str, kps: f64, per_key: f64| {
                println!(
                    "{}",
                    serde_json::json!({"transport": transport, "op": op, "batch": batch, "clients": clients,
                        "dim": a.dim, "keys_per_s": kps, "bytes_per_s": kps * per_key})
                );
            };
            if a.json {
                figure("raw_socket", "echo", raw, row_bytes(1));
            }
            for transport in &a.transport {
                let (find, insert) = if transport == "shm" {
                    let plan = hkv_client::region::bench::Plan {
                        table: table.clone(),
                        dim: a.dim,
                        batch,
                        resident,
                        pipeline: a.pipeline,
                        warmup: a.warmup,
                        seconds: a.seconds,
                    };
                    hkv_client::region::bench::measure(&socket, clients, &plan)?
                } else {
                    let t = table.clone();
                    let find = measure(&socket, &a, clients, &|rng| Request::Find {
                        table: t.clone(),
                        keys: (0..batch).map(|_| rng.gen_range(1..=resident)).collect(),
                        scores: false,
                    })?;
                    let t = table.clone();
                    let dim = a.dim;
                    let insert = measure(&socket, &a, clients, &|rng| Request::Write {
                        op: proto::op::INSERT_OR_ASSIGN,
                        table: t.clone(),
                        keys: (0..batch).map(|_| rng.gen_range(1..=resident)).collect(),
                        values: vec![1.5; batch * dim],
                        scores: None,
                        outcomes: false,
                    })?;
                    (find, insert)
                };
                let gb = |kps: f64| kps * row_bytes(1) / 1e9;
                if a.json {
                    figure(transport, "find", find, row_bytes(1));
                    figure(transport, "insert_or_assign", insert, ins_bytes);
                } else {
                    println!(
                        "{:>8} {:>7} {:>9} {:>14.0} {:>10.2} {:>14.0} {:>10.2} {:>9.0}% {:>14.0} {:>10.2}",
                        batch,
                        clients,
                        transport,
                        find,
                        gb(find),
                        raw,
                        gb(raw),
                        100.0 * find / raw,
                        insert,
                        insert * ins_bytes / 1e9
                    );
                }
            }
        }
    }
    c.drop_table(&table)?;
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    let socket = cli.socket.clone().unwrap_or_else(proto::client_socket_path);
    if let Cmd::Bench(a) = cli.cmd {
        return bench(socket, a);
    }
    if let Cmd::Top { args } = &cli.cmd {
        let beside =
            std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.join("hkvd"))).filter(|p| p.exists());
        let hkvd = beside.unwrap_or_else(|| PathBuf::from("hkvd"));
        let status = std::process::Command::new(&hkvd)
            .arg("top")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .status()
            .with_context(|| format!("cannot run {}", hkvd.display()))?;
        if !status.success() {
            bail!("hkvd top exited with {status}");
        }
        return Ok(());
    }
    let mut c = Client::connect(&socket)?;
    match cli.cmd {
        Cmd::Ping => {
            let t = Instant::now();
            c.ping()?;
            println!("hkvd at {} answered in {:.3} ms", socket.display(), t.elapsed().as_secs_f64() * 1e3);
        }
        Cmd::CreateTable {
            name,
            dim,
            capacity,
            policy,
            dual,
            max_capacity,
            fast_tier_bytes,
            hash,
            num_buckets,
            hash_key,
        } => {
            let hash = feature_hash("--hash", &hash, num_buckets, &hash_key)?;
            let spec = TableSpec {
                max_capacity,
                policy,
                mode: if dual { "dual" } else { "single" }.into(),
                fast_tier_bytes,
                hash,
                ..TableSpec::new(&name, dim, capacity)
            };
            let info = c.create_table(spec)?;
            println!("created {name}: dim {dim}, capacity {} over {} shards", info.capacity, info.shards);
        }
        Cmd::DropTable { name } => {
            c.drop_table(&name)?;
            println!("dropped {name}");
        }
        Cmd::Tables => {
            println!(
                "{:<20} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6}",
                "table", "dim", "policy", "mode", "size", "capacity", "shards"
            );
            for t in c.tables()? {
                println!(
                    "{:<20} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6}",
                    t.spec.name, t.spec.dim, t.spec.policy, t.spec.mode, t.size, t.capacity, t.shards
                );
            }
        }
        Cmd::Put { table, entries, scores } => {
            let dim = table_dim(&mut c, &table)?;
            let mut keys = vec![];
            let mut values = vec![];
            for e in &entries {
                let (k, v) = parse_entry(e)?;
                if v.len() != dim {
                    bail!("{e:?} has {} values; table {table} has dim {dim}", v.len());
                }
                keys.push(k);
                values.extend(v);
            }
            println!("{}", c.insert_or_assign(&table, &keys, &values, scores.as_deref())?);
        }
        Cmd::Get { table, keys } => {
            let f = c.find(&table, &keys)?;
            print_found(&keys, &f);
        }
        Cmd::Hash { features, input, hash, table } => {
            let features = input.items(features)?;
            let keys = c.hash(table.as_deref().unwrap_or(""), hash.spec()?, hash.features(&features)?)?;
            for (f, k) in features.iter().zip(keys) {
                input.line(f, Answer::Key(k));
            }
        }
        Cmd::FindFeatures { table, features, input, hash } => {
            let features = input.items(features)?;
            let f = c.find_features(&table, hash.spec()?, hash.features(&features)?, false)?;
            let dim = if features.is_empty() { 0 } else { f.values.len() / features.len() };
            for (i, feature) in features.iter().enumerate() {
                let row = &f.values[i * dim..(i + 1) * dim];
                input.line(feature, if f.found[i] { Answer::Values(row) } else { Answer::Missing });
            }
        }
        Cmd::FindOrInsertFeatures { table, entries, input, hash, scores } => {
            let entries = input.items(entries)?;
            let dim = table_dim(&mut c, &table)?;
            let mut names = vec![];
            let mut values = vec![];
            for e in &entries {
                let (f, v) = e.rsplit_once('=').with_context(|| format!("{e:?}: expected FEATURE=V1,V2,..."))?;
                let v = v
                    .split(',')
                    .map(|x| x.trim().parse::<f32>().with_context(|| format!("{x:?} is not a number")))
                    .collect::<Result<Vec<_>>>()?;
                if v.len() != dim {
                    bail!("{e:?} has {} values; table {table} has dim {dim}", v.len());
                }
                names.push(f.to_string());
                values.extend(v);
            }
            let w =
                c.find_or_insert_features(&table, hash.spec()?, hash.features(&names)?, &values, scores.as_deref())?;
            let stored = w.values.unwrap_or_default();
            for (i, f) in names.iter().enumerate() {
                input.line(f, Answer::Values(&stored[i * dim..(i + 1) * dim]));
            }
            if !input.json {
                println!("{}", w.summary);
            }
        }
        Cmd::Fill { table, count, start, batch } => {
            let dim = table_dim(&mut c, &table)?;
            let t = Instant::now();
            let mut s = proto::Summary::default();
            let mut k = start;
            while k < start + count {
                let n = batch.max(1).min(start + count - k);
                let keys: Vec<u64> = (k..k + n).collect();
                let values: Vec<f32> = keys.iter().flat_map(|&x| (0..dim).map(move |d| x as f32 + d as f32)).collect();
                s += c.insert_or_assign(&table, &keys, &values, None)?;
                k += n;
            }
            let secs = t.elapsed().as_secs_f64();
            println!("wrote {count} keys in {secs:.2}s ({:.0} keys/s): {s}", count as f64 / secs);
        }
        Cmd::Erase { table, keys } => {
            let n = c.erase(&table, &keys)?;
            println!("erased {n} of {} keys", keys.len());
        }
        Cmd::Stats { json } => {
            let v = c.stats()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", stats_table(&v));
            }
        }
        Cmd::Metrics => print!("{}", c.metrics()?),
        Cmd::Checkpoint { wait, full } => {
            let before = c.stats()?["checkpoint"]["last"]["finished_unix_ms"].clone();
            // Daemons before protocol 1's `id` field answered only `started`.
            // With --wait, a running checkpoint or restore is waited for, then
            // this one is taken (as the protocol's `wait: true` does).
            let mut said = false;
            let started = loop {
                match c.checkpoint(false, full) {
                    Err(e) if wait && e.code() == Some(proto::ErrorCode::Busy) => {
                        if !said {
                            eprintln!("waiting for the running checkpoint or restore to finish");
                            said = true;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    r => break r?,
                }
            };
            let id = started["id"].as_str().map(str::to_string);
            if !wait {
                match &id {
                    Some(id) => println!("checkpoint {id} started; `hkvctl stats` shows its progress"),
                    None => println!("checkpoint started; `hkvctl stats` shows its progress"),
                }
                return Ok(());
            }
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let st = c.stats()?;
                let ck = &st["checkpoint"];
                if let Some(p) = ck["running"].as_object() {
                    let (done, total) =
                        (p["entries_done"].as_u64().unwrap_or(0), p["entries_total"].as_u64().unwrap_or(0));
                    let frac = if total > 0 { (done as f64 / total as f64).min(1.0) } else { 0.0 };
                    let bar = "#".repeat((frac * 30.0) as usize) + &"-".repeat(30 - (frac * 30.0) as usize);
                    let line = format!(
                        "checkpoint {} [{bar}] {done}/{total} entries, {:.1} MB, {:.0} MB/s, {:.0} entries/s, ETA {:.0}s",
                        p["id"].as_str().unwrap_or("?"),
                        p["bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
                        p["mb_per_s"].as_f64().unwrap_or(0.0),
                        p["rate"].as_f64().unwrap_or(0.0),
                        p["eta_s"].as_f64().unwrap_or(0.0)
                    );
                    if tty {
                        eprint!("\r{line}");
                    }
                } else if id.as_deref().map_or(ck["last"]["finished_unix_ms"] != before, |id| ck["last"]["id"] == id) {
                    if tty {
                        eprintln!();
                    }
                    let l = &ck["last"];
                    if let Some(e) = l["error"].as_str() {
                        bail!("checkpoint failed: {e}");
                    }
                    let (mb, secs) =
                        (l["bytes"].as_u64().unwrap_or(0) as f64 / 1e6, l["seconds"].as_f64().unwrap_or(0.0));
                    println!(
                        "checkpoint {} complete ({}): {} entries, {mb:.1} MB in {secs:.2}s ({:.0} MB/s)",
                        l["id"].as_str().unwrap_or("?"),
                        l["kind"].as_str().unwrap_or("?"),
                        l["entries"],
                        mb / secs.max(1e-9)
                    );
                    break;
                }
            }
        }
        Cmd::Checkpoints => {
            println!("{:<18} {:<20} {:<30} {:>12} {:>10}  status", "id", "created (UTC)", "kind", "entries", "MB");
            for l in c.checkpoints()?.as_array().into_iter().flatten() {
                let ms = l["created_unix_ms"].as_u64().unwrap_or(0);
                println!(
                    "{:<18} {:<20} {:<30} {:>12} {:>10.1}  {}",
                    l["id"].as_str().unwrap_or("?"),
                    fmt_time(ms),
                    l["kind"].as_str().unwrap_or("?"),
                    l["entries"].as_u64().unwrap_or(0),
                    l["bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
                    l["status"].as_str().unwrap_or("?")
                );
            }
        }
        Cmd::Restore { id } => {
            // The restore answers when done; a second connection shows its progress meanwhile.
            let socket = socket.clone();
            let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let watcher = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
                let done = done.clone();
                std::thread::spawn(move || {
                    let Ok(mut w) = Client::connect(&socket) else { return };
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(200));
                        let Ok(st) = w.stats() else { return };
                        if let Some(p) = st["checkpoint"]["restoring"].as_object() {
                            eprint!(
                                "\rrestore {} {}: {}/{} entries, {:.1} MB, {:.0} MB/s   ",
                                p["id"].as_str().unwrap_or("?"),
                                p["kind"].as_str().unwrap_or("?"),
                                p["entries_done"].as_u64().unwrap_or(0),
                                p["entries_total"].as_u64().unwrap_or(0),
                                p["bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
                                p["mb_per_s"].as_f64().unwrap_or(0.0)
                            );
                        }
                    }
                })
            });
            let r = c.restore(&id);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            if let Some(w) = watcher {
                let _ = w.join();
                eprintln!();
            }
            let r = r?;
            for s in r["skipped"].as_array().into_iter().flatten() {
                eprintln!("hkvctl: warning: skipped {}", s.as_str().unwrap_or("?"));
            }
            for d in r["dropped"].as_array().into_iter().flatten() {
                if d[1].as_u64().unwrap_or(0) > 0 {
                    eprintln!("hkvctl: warning: table {} could not place {} entries of the checkpoint", d[0], d[1]);
                }
            }
            println!(
                "restored checkpoint {} in {:.2}s ({:.0} MB/s): {} entries, tables {}, dropped {}",
                r["id"].as_str().unwrap_or("?"),
                r["seconds"].as_f64().unwrap_or(0.0),
                r["mb_per_s"].as_f64().unwrap_or(0.0),
                r["entries"],
                r["tables"],
                r["dropped"]
            );
        }
        Cmd::Shutdown => {
            c.shutdown()?;
            println!("hkvd is draining and will exit");
        }
        Cmd::Bench(_) | Cmd::Top { .. } => unreachable!(),
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hkvctl: {e:#}");
            match e.downcast_ref::<ClientError>() {
                Some(ClientError::Io { .. }) => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}
