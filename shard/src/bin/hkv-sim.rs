//! hkv-sim: cache quality of the table under a Zipfian key stream or a
//! user's own key trace.
//!
//! Replays a key stream in batches: each batch is first looked up (hits
//! counted), then written with insert_or_assign. Hit rates are per access
//! (issue 32): a key repeated inside a batch after a miss counts as a hit,
//! as the accesses made one at a time would find it, so that the figure
//! does not depend on `--batch`; the per-batch-lookup figure (every key of
//! a batch looked up before any is written, what a client's `find` of the
//! batch reports) is printed beside it, labelled. The stream is either
//! `stream-multiple × capacity` accesses drawn from Zipf(alpha) over
//! `keyspace` keys, or the keys of `--trace FILE` (u64 little-endian, or one
//! decimal key per line), replayed once. Beside the table, the same stream
//! runs through an ideal fully associative cache of the same capacity and
//! policy with the same batch semantics. Prints the hit rates, the load
//! factor at the first eviction (none when nothing was evicted), and the
//! top-N retention of the paper's Table 11: the share of the ideal
//! highest-scored N = capacity keys — the final contents of the ideal fully
//! associative cache of the same policy — that the table holds at the end.
//! For Lru these are exactly the N most recently accessed keys. Also
//! printed: the share of the N most frequently accessed keys held
//! (`popular_n_retention`), the same figure for the ideal cache, and, for a
//! Zipf stream, the hit rate ceiling (the probability mass of the
//! `capacity` most popular keys). `--capacities` repeats the replay at
//! several capacities (slot counts, or factors of `--capacity`), the same
//! stream each time, so that a user can see what a smaller or larger table
//! would hit before buying it.
//!
//! `--policy` takes a list (`lru,lfu,adaptive`): each policy replays the
//! same stream at every capacity, and a last table lists the per-access
//! hit rates side by side. A policy whose reads refresh scores (Adaptive
//! by default) is driven as a read-through cache: each batch is looked up
//! and only the keys it missed are written (`find`'s hits are its
//! accesses), so that each access counts once in its sketch; the others
//! write the whole batch, as before (their finds touch no score). The
//! ideal cache beside Adaptive is the exact LRU. Traces may also be
//! libCacheSim's `oracle` format (oracleGeneral: 24-byte records, the
//! u64 object id at byte 4) or `csv` (the key in column `--csv-column`,
//! a first line that does not parse is a header).
//!
//! `--mrc` instead measures the miss-ratio-curve estimator
//! (`hkv_shard::mrc`): the stream is fed once to the SHARDS estimate and to
//! an exact LRU stack, and the estimated hit rate is printed beside the
//! exact fully associative LRU hit rate at 1/8× to 8× `--capacity`, with
//! the mean absolute and worst errors and the cost of `observe` per key.
//!
//! An option the run chosen does not use (`--mrc-keys` without `--mrc`,
//! `--lfu-ties` without an lfu policy, a Zipf option with `--trace`) is
//! refused, and what the options make the simulator allocate (the
//! stream `--mrc` holds, the ideal cache, the per-key counts) is allocated
//! fallibly: too much for the host is an error naming the options, not an
//! abort.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, TryReserveError};
use std::fs::File;
use std::io::{BufRead, BufReader, Chain, Cursor, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use hkv_shard::cpu::CpuTable;
use hkv_shard::score::ManualClock;
use hkv_shard::{is_reserved, BucketMode, LfuTies, Outcome, ScorePolicy, Shard, TableConfig, BUCKET_SLOTS};
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};

#[derive(Parser, Debug)]
#[command(name = "hkv-sim", about = "Cache quality of the HKV table vs an ideal fully associative cache")]
struct Args {
    /// Table capacity in slots, rounded up to whole 128-slot buckets (what
    /// follows from it follows the rounded slots; --mrc does not round).
    #[arg(long, default_value_t = 1 << 20)]
    capacity: u64,
    /// Capacities to replay the same stream at, comma separated: slot
    /// counts (`262144`) or factors of --capacity, rounded
    /// (`1/8x,1/2x,1x,2x,8x`).
    /// Default: --capacity alone.
    #[arg(long, value_delimiter = ',')]
    capacities: Vec<String>,
    /// Zipf exponent of the key popularity, finite and above 0.
    #[arg(long, default_value_t = 0.99)]
    alpha: f64,
    /// Distinct keys in the stream's universe (default: 10 × --capacity,
    /// rounded).
    #[arg(long)]
    keyspace: Option<u64>,
    /// Accesses = stream-multiple × --capacity, rounded.
    #[arg(long, default_value_t = 5.0)]
    stream_multiple: f64,
    /// Replay this key trace instead of a Zipf stream (--alpha,
    /// --keyspace, --stream-multiple and --seed are then refused). A pipe
    /// or FIFO (`/dev/stdin`, `<(zcat t.gz)`) is read once, so it takes
    /// one policy and one capacity.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Trace format (with --trace only): `bin` (u64 little-endian keys, 8
    /// bytes each), `text` (one decimal key per line, blank lines
    /// skipped), `oracle`
    /// (libCacheSim's oracleGeneral: u32 time, u64 id, u32 size, i64
    /// next access; the id is the key), `csv` (the key in column
    /// --csv-column; a field may be in double quotes) or `auto` (oracle for a name containing
    /// `oracleGeneral`, csv for a name ending in `.csv`, else text when the
    /// first 4 KiB are printable ASCII and white space, else bin).
    /// Checked before the trace is opened (a FIFO without a writer blocks
    /// the open).
    #[arg(long, default_value = "auto", value_parser = ["bin", "text", "oracle", "csv", "auto"])]
    trace_format: String,
    /// With a csv --trace: the 0-based column holding the key.
    #[arg(long, default_value_t = 0)]
    csv_column: usize,
    /// Score policies, comma separated: lru, lfu, adaptive.
    #[arg(long, default_value = "lru")]
    policy: String,
    /// Lfu tie rule (refused unless --policy lists lfu): lru (the least
    /// recently written of equal frequencies goes) or lowest-slot (the
    /// reference library's rule).
    #[arg(long, default_value = "lru")]
    lfu_ties: String,
    /// Bucket mode: single or dual.
    #[arg(long, default_value = "single")]
    mode: String,
    /// Random seed of the Zipf stream.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keys per batch.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Compare the miss-ratio-curve estimate (SHARDS) with the exact fully
    /// associative LRU at 1/8× to 8× --capacity, instead of replaying the
    /// table (--policy other than lru, --mode dual and --capacities are
    /// refused with it).
    #[arg(long)]
    mrc: bool,
    /// With --mrc (refused without): distinct sampled keys tracked (the
    /// estimator's budget).
    #[arg(long, default_value_t = hkv_shard::mrc::DEFAULT_MAX_KEYS)]
    mrc_keys: usize,
    /// With --mrc (refused without): the sampling hash's seed (default:
    /// the library's).
    #[arg(long)]
    mrc_seed: Option<u64>,
    /// Print one JSON object as the last line (with several capacities:
    /// `{"runs": [one object per capacity]}`).
    #[arg(long)]
    json: bool,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Ideal fully associative cache with the table's batch semantics.
trait Ideal {
    fn contains(&self, key: u64) -> bool;
    /// Keys held.
    fn len(&self) -> usize;
    /// Every key held.
    fn keys(&self) -> Result<Vec<u64>, TryReserveError>;
    /// Room for `n` more keys, up to the capacity, so that the map's
    /// growth is a reported error, not an abort.
    fn reserve(&mut self, n: usize) -> Result<(), TryReserveError>;
    /// Writes one key (refresh or insert, evicting the global minimum).
    fn write(&mut self, key: u64, now: u64);
}

/// The keys of `map`, in a vector allocated fallibly.
fn keys_of<V>(map: &HashMap<u64, V>) -> Result<Vec<u64>, TryReserveError> {
    let mut keys = Vec::new();
    keys.try_reserve_exact(map.len())?;
    keys.extend(map.keys().copied());
    Ok(keys)
}

/// Exact LRU: a recency-ordered set.
struct IdealLru {
    cap: usize,
    last: HashMap<u64, u64>,
    order: BTreeSet<(u64, u64)>,
}

impl Ideal for IdealLru {
    fn contains(&self, key: u64) -> bool {
        self.last.contains_key(&key)
    }
    fn len(&self) -> usize {
        self.last.len()
    }
    fn keys(&self) -> Result<Vec<u64>, TryReserveError> {
        keys_of(&self.last)
    }
    fn reserve(&mut self, n: usize) -> Result<(), TryReserveError> {
        // One over the capacity: a newcomer is inserted before the
        // eviction.
        self.last.try_reserve(n.min((self.cap + 1).saturating_sub(self.last.len())))
    }
    fn write(&mut self, key: u64, now: u64) {
        if let Some(t) = self.last.insert(key, now) {
            self.order.remove(&(t, key));
        } else if self.last.len() > self.cap {
            let (t, victim) = self.order.pop_first().expect("non-empty");
            debug_assert!(t <= now);
            self.last.remove(&victim);
        }
        self.order.insert((now, key));
    }
}

/// Exact LFU with the table's rules: count while resident, newcomers always
/// admitted with count 1, the minimum count (least recent on ties) evicted.
struct IdealLfu {
    cap: usize,
    entry: HashMap<u64, (u64, u64)>,
    order: BTreeSet<(u64, u64, u64)>,
}

impl Ideal for IdealLfu {
    fn contains(&self, key: u64) -> bool {
        self.entry.contains_key(&key)
    }
    fn len(&self) -> usize {
        self.entry.len()
    }
    fn keys(&self) -> Result<Vec<u64>, TryReserveError> {
        keys_of(&self.entry)
    }
    fn reserve(&mut self, n: usize) -> Result<(), TryReserveError> {
        self.entry.try_reserve(n.min(self.cap.saturating_sub(self.entry.len())))
    }
    fn write(&mut self, key: u64, now: u64) {
        match self.entry.get(&key).copied() {
            Some((c, t)) => {
                self.order.remove(&(c, t, key));
                self.entry.insert(key, (c + 1, now));
                self.order.insert((c + 1, now, key));
            }
            None => {
                if self.entry.len() == self.cap {
                    let (_, _, victim) = self.order.pop_first().expect("non-empty");
                    self.entry.remove(&victim);
                }
                self.entry.insert(key, (1, now));
                self.order.insert((1, now, key));
            }
        }
    }
}

/// Σ_{r=1..n} r^-alpha: the first [`HARMONIC_TERMS`] terms summed from
/// the small ones up for accuracy, the rest by Euler–Maclaurin. The story:
/// every term was summed, so `--keyspace 1099511627776 --capacity 128`
/// replayed 640 accesses and then spent hours on the ceiling's 2^40 powers.
fn harmonic(n: u64, alpha: f64) -> f64 {
    let head: f64 = (1..=n.min(HARMONIC_TERMS)).rev().map(|r| (r as f64).powf(-alpha)).sum();
    if n <= HARMONIC_TERMS {
        return head;
    }
    // Σ_{r=a..b} f(r) ≈ ∫_a^b f + (f(a) + f(b))/2 + (f'(b) - f'(a))/12,
    // f(x) = x^-alpha; the next term, of order alpha³ a^(-alpha-3) / 720,
    // is below 1e-20 of the sum (at least 1) at a = 2^20.
    let (a, b) = ((HARMONIC_TERMS + 1) as f64, n as f64);
    let f = |x: f64| x.powf(-alpha);
    let df = |x: f64| -alpha * x.powf(-alpha - 1.0);
    // ∫_a^b x^-alpha dx = a^(1-alpha) · ((b/a)^(1-alpha) - 1) / (1 - alpha),
    // written with expm1 so that alpha near 1 loses nothing (ln(b/a) at 1).
    let (s, l) = (1.0 - alpha, (b / a).ln());
    let integral = if s == 0.0 { l } else { a.powf(s) * (s * l).exp_m1() / s };
    head + integral + (f(a) + f(b)) / 2.0 + (df(b) - df(a)) / 12.0
}

/// The terms of [`harmonic`] summed one by one.
const HARMONIC_TERMS: u64 = 1 << 20;

/// How a trace file is laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TraceFormat {
    /// u64 little-endian keys.
    Bin,
    /// One decimal key per line.
    Text,
    /// libCacheSim's oracleGeneral records (24 bytes, id at byte 4).
    Oracle,
    /// Comma-separated values, the key in one column.
    Csv,
}

impl TraceFormat {
    fn name(self) -> &'static str {
        match self {
            TraceFormat::Bin => "bin",
            TraceFormat::Text => "text",
            TraceFormat::Oracle => "oracle",
            TraceFormat::Csv => "csv",
        }
    }

    /// The format asked, or for `auto` guessed from the name or from
    /// `head`, the trace's first bytes: text when they are printable ASCII
    /// and white space (binary keys are that only by a vanishing chance; a
    /// text trace with a typo is still read as text, so the error names
    /// the line).
    fn pick(asked: &str, path: &Path, head: &[u8]) -> Result<TraceFormat> {
        match asked {
            "bin" => Ok(TraceFormat::Bin),
            "text" => Ok(TraceFormat::Text),
            "oracle" => Ok(TraceFormat::Oracle),
            "csv" => Ok(TraceFormat::Csv),
            "auto" if path.to_string_lossy().contains("oracleGeneral") => Ok(TraceFormat::Oracle),
            "auto" if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) => Ok(TraceFormat::Csv),
            "auto" => {
                if head.is_empty() {
                    bail!("trace {} is empty", path.display());
                }
                let text = head.iter().all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace());
                Ok(if text { TraceFormat::Text } else { TraceFormat::Bin })
            }
            f => bail!("--trace-format must be bin, text, oracle, csv or auto, not {f:?}"),
        }
    }
}

/// The bytes `--trace-format auto` looks at.
const HEAD: usize = 4096;

/// A trace file opened for one replay: its first [`HEAD`] bytes, already
/// read (to detect the format), then the rest of the file.
///
/// The story: detection read the head, then the replay opened the path
/// again. A regular file starts over; a pipe, a FIFO or a `<(…)` does not,
/// so the first 4 KiB of every piped trace were silently dropped (99488 of
/// 100000 keys, and a text key cut in two). Now the file is opened once
/// and the head is replayed from memory before the rest.
struct Opened {
    head: Vec<u8>,
    file: File,
}

impl Opened {
    fn open(path: &Path) -> Result<Opened> {
        let mut file = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
        let mut head = vec![0; HEAD];
        let got = read_full(&mut file, &mut head).with_context(|| format!("reading trace {}", path.display()))?;
        head.truncate(got);
        Ok(Opened { head, file })
    }

    /// Every byte of the trace, from the first.
    fn reader(self) -> TraceReader {
        BufReader::with_capacity(1 << 20, Cursor::new(self.head).chain(self.file))
    }
}

type TraceReader = BufReader<Chain<Cursor<Vec<u8>>, File>>;

/// Where the keys come from: a Zipf stream or a trace file, read a batch at
/// a time (a trace is streamed, never held whole). One lives per replay, so
/// the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Source {
    Zipf { zipf: Zipf<f64>, rng: rand::rngs::StdRng, seed: u64, left: u64, keyspace: u64 },
    Trace { path: PathBuf, format: TraceFormat, reader: TraceReader, read: u64, line: String, column: usize },
}

impl Source {
    fn zipf(keyspace: u64, alpha: f64, seed: u64, total: u64) -> Result<Source> {
        let zipf = Zipf::new(keyspace, alpha).context("zipf parameters")?;
        Ok(Source::Zipf { zipf, rng: rand::rngs::StdRng::seed_from_u64(seed), seed, left: total, keyspace })
    }

    fn trace(path: &Path, format: TraceFormat, column: usize, opened: Opened) -> Source {
        Source::Trace {
            path: path.to_path_buf(),
            format,
            reader: opened.reader(),
            read: 0,
            line: String::new(),
            column,
        }
    }

    /// Replaces `keys` with up to `n` next keys; empty at the end.
    fn next_batch(&mut self, keys: &mut Vec<u64>, n: usize) -> Result<()> {
        keys.clear();
        match self {
            Source::Zipf { zipf, rng, seed, left, .. } => {
                let n = n.min(*left as usize);
                for _ in 0..n {
                    let rank = zipf.sample(rng) as u64;
                    keys.push(splitmix64(rank ^ seed.rotate_left(32)) >> 1);
                }
                *left -= n as u64;
            }
            Source::Trace { path, format: TraceFormat::Bin, reader, read, .. } => {
                let mut b = [0u8; 8];
                while keys.len() < n {
                    let got = read_full(reader, &mut b).with_context(|| format!("reading trace {}", path.display()))?;
                    match got {
                        0 => break,
                        8 => {}
                        _ => bail!(
                            "trace {} ends with {got} bytes, not a whole u64 key (a text trace? use --trace-format text)",
                            path.display()
                        ),
                    }
                    let k = u64::from_le_bytes(b);
                    if is_reserved(k) {
                        bail!("trace {}: key {} (index {}) is one of the table's reserved keys (u64::MAX - 3 ..= u64::MAX)", path.display(), k, *read);
                    }
                    keys.push(k);
                    *read += 1;
                }
            }
            Source::Trace { path, format: TraceFormat::Oracle, reader, read, .. } => {
                let mut b = [0u8; 24];
                while keys.len() < n {
                    let got = read_full(reader, &mut b).with_context(|| format!("reading trace {}", path.display()))?;
                    match got {
                        0 => break,
                        24 => {}
                        _ => bail!(
                            "trace {} ends with {got} bytes, not a whole 24-byte oracleGeneral record",
                            path.display()
                        ),
                    }
                    let k = u64::from_le_bytes(b[4..12].try_into().expect("8 bytes"));
                    if is_reserved(k) {
                        bail!(
                            "trace {}: key {} (record {}) is one of the table's reserved keys",
                            path.display(),
                            k,
                            *read
                        );
                    }
                    keys.push(k);
                    *read += 1;
                }
            }
            Source::Trace { path, format: TraceFormat::Csv, reader, read, line, column } => {
                while keys.len() < n {
                    line.clear();
                    if read_text_line(reader, line, path, *read + 1)? == 0 {
                        break;
                    }
                    *read += 1;
                    let t = line.trim();
                    if t.is_empty() {
                        continue;
                    }
                    // A binary file read as csv: its first "line" was
                    // taken as a header and the trace said it held no keys.
                    let binary = || {
                        anyhow::anyhow!(
                            "trace {} line {}: not CSV text (control bytes; a binary trace? use --trace-format bin or oracle)",
                            path.display(),
                            *read
                        )
                    };
                    let field = match csv_field(t, *column) {
                        CsvField::Field(f) => f,
                        _ if has_control(t) => return Err(binary()),
                        CsvField::Short(columns) => bail!(
                            "trace {} line {}: {columns} comma-separated columns; --csv-column {} needs at least {}",
                            path.display(),
                            *read,
                            *column,
                            *column + 1
                        ),
                        CsvField::Unclosed => bail!(
                            "trace {} line {}: a quoted field is not closed on its line (a line break inside quotes is not read)",
                            path.display(),
                            *read
                        ),
                    };
                    let k = match field.parse::<u64>() {
                        Ok(k) => k,
                        Err(_) if has_control(t) => return Err(binary()),
                        Err(_) if *read == 1 => continue, // a header
                        Err(_) => bail!(
                            "trace {} line {}: column {} ({field:?}) is not a decimal u64 key",
                            path.display(),
                            *read,
                            *column
                        ),
                    };
                    if is_reserved(k) {
                        bail!("trace {} line {}: key {k} is one of the table's reserved keys", path.display(), *read);
                    }
                    keys.push(k);
                }
            }
            Source::Trace { path, format: TraceFormat::Text, reader, read, line, .. } => {
                while keys.len() < n {
                    line.clear();
                    if read_text_line(reader, line, path, *read + 1)? == 0 {
                        break;
                    }
                    *read += 1;
                    let t = line.trim();
                    if t.is_empty() {
                        continue;
                    }
                    let k: u64 = t.parse().with_context(|| {
                        let shown: String = t.chars().take(40).collect();
                        let more = if shown.len() < t.len() { "…" } else { "" };
                        format!(
                            "trace {} line {}: {shown:?}{more} is not a decimal u64 key \
                             (a binary trace? use --trace-format bin)",
                            path.display(),
                            *read
                        )
                    })?;
                    if is_reserved(k) {
                        bail!(
                            "trace {} line {}: key {k} is one of the table's reserved keys (u64::MAX - 3 ..= u64::MAX)",
                            path.display(),
                            *read
                        );
                    }
                    keys.push(k);
                }
            }
        }
        Ok(())
    }
}

/// Column `column` of a CSV line, as [`csv_field`] finds it.
enum CsvField<'a> {
    /// The field, out of its quotes and trimmed of white space.
    Field(Cow<'a, str>),
    /// The line has only this many columns.
    Short(usize),
    /// A quote opened on the line is not closed on it.
    Unclosed,
}

/// Field `column` of a CSV line (RFC 4180: a field in double quotes may hold
/// commas, and `""` in it is one quote). The story: `"1"` was refused as
/// not a decimal key, and a quoted comma in an earlier column moved the key.
fn csv_field(line: &str, column: usize) -> CsvField<'_> {
    if !line.contains('"') {
        return match line.split(',').nth(column) {
            Some(f) => CsvField::Field(Cow::Borrowed(f.trim())),
            None => CsvField::Short(line.split(',').count()),
        };
    }
    let (mut at, mut field, mut quoted) = (0, String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            '"' => quoted = !quoted,
            ',' if !quoted => {
                if at == column {
                    return CsvField::Field(Cow::Owned(field.trim().to_string()));
                }
                at += 1;
                field.clear();
            }
            c => field.push(c),
        }
    }
    match (quoted, at == column) {
        (true, _) => CsvField::Unclosed,
        (false, true) => CsvField::Field(Cow::Owned(field.trim().to_string())),
        (false, false) => CsvField::Short(at + 1),
    }
}

/// Whether a text line holds control characters other than tabs: a binary
/// file's, not a CSV file's.
fn has_control(line: &str) -> bool {
    line.chars().any(|c| c.is_control() && c != '\t')
}

/// One line of a text or csv trace into `line` (0 at the end); a line
/// that is not UTF-8 is refused by its number (line `no`), as a binary
/// file read as text would be.
fn read_text_line(reader: &mut impl BufRead, line: &mut String, path: &Path, no: u64) -> Result<usize> {
    reader.read_line(line).map_err(|e| {
        if e.kind() == std::io::ErrorKind::InvalidData {
            anyhow::anyhow!(
                "trace {} line {no}: not UTF-8 text (a binary trace? use --trace-format bin or oracle)",
                path.display()
            )
        } else {
            anyhow::Error::new(e).context(format!("reading trace {}", path.display()))
        }
    })
}

/// Reads until `b` is full or the input ends; returns the bytes read.
fn read_full(r: &mut impl Read, b: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < b.len() {
        match r.read(&mut b[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// One capacity of `--capacities`: slots, or a factor `P/Qx` / `Fx` of base.
fn parse_capacity(s: &str, base: u64) -> Result<u64> {
    let s = s.trim();
    let cap = if let Some(f) = s.strip_suffix('x') {
        let (p, q) = match f.split_once('/') {
            Some((p, q)) => (p.trim().parse::<f64>(), q.trim().parse::<f64>()),
            None => (f.trim().parse::<f64>(), Ok(1.0)),
        };
        let (p, q) = (p.ok(), q.ok());
        match (p, q) {
            (Some(p), Some(q)) if p > 0.0 && q > 0.0 && (p / q).is_finite() => (base as f64 * p / q).round() as u64,
            _ => bail!("--capacities: {s:?} is not a factor such as 1/8x, 0.5x or 2x"),
        }
    } else {
        s.parse::<u64>()
            .with_context(|| format!("--capacities: {s:?} is neither a slot count nor a factor such as 2x"))?
    };
    if cap == 0 || cap > MAX_COUNT {
        bail!("--capacities: {s:?} gives {cap} slots; 1 to {MAX_COUNT} are replayed");
    }
    Ok(cap)
}

/// What one replay measured.
struct Run {
    capacity: u64,
    accesses: u64,
    hits: u64,
    ideal_hits: u64,
    distinct: u64,
    /// Per access: a repeat of a key inside a batch after a miss is a hit.
    hit_rate: f64,
    ideal_hit_rate: f64,
    /// Per batch lookup: every key of a batch looked up before any is
    /// written, so a repeat of a missed key misses again.
    batch_hit_rate: f64,
    ideal_batch_hit_rate: f64,
    ceiling: Option<f64>,
    first_eviction: Option<f64>,
    top_n_retention: f64,
    popular_n_retention: f64,
    ideal_popular: f64,
    final_load_factor: f64,
    seconds: f64,
}

/// Replays `source` through a table of `capacity` slots and the ideal cache.
fn replay(a: &Args, cfg: &TableConfig, mut source: Source) -> Result<Run> {
    let started = Instant::now();
    let policy = cfg.policy;
    let read_through = cfg.refreshes_reads();
    let clock = ManualClock::new(1 << 20);
    let table = CpuTable::with_clock(cfg.clone(), clock.clone() as Arc<_>)?;
    let capacity = table.capacity();
    let mut ideal: Box<dyn Ideal> = match policy {
        ScorePolicy::Lru | ScorePolicy::Adaptive => {
            Box::new(IdealLru { cap: capacity as usize, last: HashMap::new(), order: BTreeSet::new() })
        }
        _ => Box::new(IdealLfu { cap: capacity as usize, entry: HashMap::new(), order: BTreeSet::new() }),
    };
    // Per key: (latest access, accesses) — the ideal scores for top-N.
    let mut truth: HashMap<u64, (u64, u64)> = HashMap::new();
    let (mut hits, mut ideal_hits, mut done) = (0u64, 0u64, 0u64);
    let (mut batch_hits, mut ideal_batch_hits) = (0u64, 0u64);
    let mut seen = std::collections::HashSet::new();
    let mut first_eviction: Option<f64> = None;
    let mut keys = buffer(a.batch, 0u64, "the buffers of --batch")?;
    let mut found = buffer(a.batch, false, "the buffers of --batch")?;
    let mut vals = buffer(a.batch, 0.0f32, "the buffers of --batch")?;
    let mut outcomes = buffer(a.batch, Outcome::Absent, "the buffers of --batch")?;
    let ones = buffer(a.batch, 1u64, "the buffers of --batch")?;
    let mut missed = buffer(a.batch, 0u64, "the buffers of --batch")?;
    seen.try_reserve(a.batch).map_err(|_| anyhow::anyhow!("out of memory: the keys of --batch {}", a.batch))?;
    let mut step = 1u64;
    loop {
        source.next_batch(&mut keys, a.batch)?;
        let n = keys.len();
        if n == 0 {
            break;
        }
        // The story: the ideal cache and the per-key counts grew until an
        // allocation failed and the process aborted (exit 134); they grow
        // fallibly now, a batch's worth ahead (their tree nodes are small
        // and come after the maps' large tables).
        if truth.try_reserve(n).is_err() || ideal.reserve(n).is_err() {
            bail!(
                "out of memory: the ideal cache ({} keys of {capacity}) and the per-key counts ({} distinct keys, \
                 {done} accesses in) could not grow: give a smaller --capacity, or a stream of fewer distinct keys \
                 (--keyspace, --stream-multiple, or a shorter --trace)",
                ideal.len(),
                truth.len()
            );
        }
        let table_hits = table.find(&keys, &mut vals[..n], &mut found[..n], None)? as u64;
        let ideal_found: Vec<bool> = keys.iter().map(|&k| ideal.contains(k)).collect();
        let ideal_batch = ideal_found.iter().filter(|&&f| f).count() as u64;
        batch_hits += table_hits;
        ideal_batch_hits += ideal_batch;
        // Per access (issue 32): a key repeated in the batch after a miss
        // is a hit, its first occurrence's write having brought it in, as
        // the batch's accesses made one at a time would find it.
        seen.clear();
        let (mut refill, mut ideal_refill) = (0u64, 0u64);
        for (i, &k) in keys.iter().enumerate() {
            if !seen.insert(k) {
                refill += u64::from(!found[i]);
                ideal_refill += u64::from(!ideal_found[i]);
            }
        }
        hits += table_hits + refill;
        ideal_hits += ideal_batch + ideal_refill;
        // One clock step per batch, in the ~ms unit Lfu stamps count in
        // (ns >> 20), so that every batch writes a later stamp.
        step += 1;
        clock.set(step << 20);
        let size0 = table.size();
        let scores = (policy == ScorePolicy::Lfu).then(|| &ones[..n]);
        if read_through {
            // Only the misses are written (a read-through fill).
            missed.clear();
            missed.extend(keys.iter().zip(&found[..n]).filter(|(_, &f)| !f).map(|(&k, _)| k));
            let m = missed.len();
            table.insert_or_assign(&missed, &vals[..m], scores.map(|s| &s[..m]), Some(&mut outcomes[..m]))?;
            outcomes[m..n].fill(Outcome::Updated);
        } else {
            table.insert_or_assign(&keys, &vals[..n], scores, Some(&mut outcomes[..n]))?;
        }
        if first_eviction.is_none() {
            if let Some(i) = outcomes[..n].iter().position(|o| matches!(o, Outcome::Evicted | Outcome::Rejected)) {
                let placed = outcomes[..i].iter().filter(|o| **o == Outcome::Inserted).count() as u64;
                first_eviction = Some((size0 + placed) as f64 / capacity as f64);
            }
        }
        for (i, &k) in keys.iter().enumerate() {
            let at = done + i as u64;
            ideal.write(k, at);
            let e = truth.entry(k).or_insert((0, 0));
            *e = (at, e.1 + 1);
        }
        done += n as u64;
    }
    if done == 0 {
        return Err(no_keys(a));
    }

    // Top-N: the ideal cache's final contents, held by the table?
    let retention = |keys: &[u64]| -> Result<f64> {
        let mut present = buffer(keys.len(), false, "the retention flags")?;
        table.contains(keys, &mut present)?;
        Ok(if keys.is_empty() { 1.0 } else { present.iter().filter(|&&p| p).count() as f64 / keys.len() as f64 })
    };
    let oom = |what: &str| {
        anyhow::anyhow!(
            "out of memory: {what} ({} distinct keys) could not be allocated: give a smaller --capacity, or a stream of \
             fewer distinct keys",
            truth.len()
        )
    };
    let top_n_retention = retention(&ideal.keys().map_err(|_| oom("the ideal cache's keys"))?)?;
    // The N most frequently accessed keys (latest access breaks ties).
    let mut ranked: Vec<(u64, u64, u64)> = Vec::new();
    ranked.try_reserve_exact(truth.len()).map_err(|_| oom("the keys ranked by accesses"))?;
    ranked.extend(truth.iter().map(|(&k, &(last, count))| (count, last, k)));
    let n_top = (capacity as usize).min(ranked.len());
    if n_top < ranked.len() {
        ranked.select_nth_unstable_by(n_top - 1, |a, b| b.cmp(a));
    }
    let popular: Vec<u64> = ranked[..n_top].iter().map(|t| t.2).collect();
    let popular_n_retention = retention(&popular)?;
    let ideal_popular = popular.iter().filter(|&&k| ideal.contains(k)).count() as f64 / n_top.max(1) as f64;
    let ceiling = match &source {
        &Source::Zipf { keyspace, .. } => Some(harmonic(capacity.min(keyspace), a.alpha) / harmonic(keyspace, a.alpha)),
        Source::Trace { .. } => None,
    };
    Ok(Run {
        capacity,
        accesses: done,
        hits,
        ideal_hits,
        distinct: truth.len() as u64,
        hit_rate: hits as f64 / done as f64,
        ideal_hit_rate: ideal_hits as f64 / done as f64,
        batch_hit_rate: batch_hits as f64 / done as f64,
        ideal_batch_hit_rate: ideal_batch_hits as f64 / done as f64,
        ceiling,
        first_eviction,
        top_n_retention,
        popular_n_retention,
        ideal_popular,
        final_load_factor: table.load_factor(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The error of a stream that held no keys, naming its trace.
fn no_keys(a: &Args) -> anyhow::Error {
    match &a.trace {
        Some(p) => anyhow::anyhow!("trace {} holds no keys", p.display()),
        None => anyhow::anyhow!("the stream holds no keys"),
    }
}

/// `n` copies of `v`, allocated fallibly: `what` names them in the error
/// (batch buffers: --batch is up to 16 Mi keys).
fn buffer<T: Clone>(n: usize, v: T, what: &str) -> Result<Vec<T>> {
    let mut b = Vec::new();
    b.try_reserve_exact(n)
        .map_err(|_| anyhow::anyhow!("out of memory: {what} ({n} entries) could not be allocated"))?;
    b.resize(n, v);
    Ok(b)
}

/// Bytes, in GiB for a message.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn pct(x: Option<f64>) -> String {
    x.map_or("n/a".into(), |x| format!("{:.3}%", x * 100.0))
}

/// The largest --capacity, --keyspace and stream (accesses) the simulator
/// takes: far past what it replays in an hour, short of the overflows and
/// allocations that larger values run into.
const MAX_COUNT: u64 = 1 << 40;
/// The largest --batch (the table's batch buffers are this many keys).
const MAX_BATCH: usize = 1 << 24;

fn main() -> Result<()> {
    hkv_shard::cli::quiet_on_broken_pipe();
    let matches = Args::command().get_matches();
    let a = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Given on the command line, not left at its default.
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let policies: Vec<ScorePolicy> = a
        .policy
        .split(',')
        .map(|p| match p.trim().parse() {
            Ok(p @ (ScorePolicy::Lru | ScorePolicy::Lfu | ScorePolicy::Adaptive)) => Ok(p),
            _ => bail!(
                "--policy {:?}: use lru, lfu or adaptive, comma separated (the ideal cache is defined for those)",
                p.trim()
            ),
        })
        .collect::<Result<_>>()?;
    let lfu_ties: LfuTies = a.lfu_ties.parse().context("--lfu-ties")?;
    // The story: --mrc replays no table, and the estimator is the LRU
    // curve at fixed factors; a --policy lfu, --mode or --capacities given
    // with it was noted on stderr and dropped, so a user could read the
    // LRU curve as the one of the policy or capacities asked for. They are
    // refused instead.
    if a.mrc {
        let asked = [
            (policies != [ScorePolicy::Lru], "--policy", a.policy.clone()),
            (a.mode != "single", "--mode", a.mode.clone()),
            (!a.capacities.is_empty(), "--capacities", a.capacities.join(",")),
        ];
        if let Some((_, flag, value)) = asked.iter().find(|(given, ..)| *given) {
            bail!(
                "--mrc compares the estimated and the exact fully associative LRU curves at 1/8x to 8x --capacity \
                 and replays no table: {flag} {value} is for table replays; drop it, or --mrc"
            );
        }
    }
    // The story: an option the run does not use was taken and dropped
    // (`--mrc-keys 500` without --mrc, `--lfu-ties lowest-slot --policy
    // lru`, `--alpha 2 --trace t.bin`: exit 0), so a user could take the
    // figures for ones the option shaped. Each is refused, naming what it
    // needs. (--policy lru and --mode single with --mrc are what --mrc
    // measures, and are taken.)
    let zipf = "describes the Zipf stream, and --trace replays the trace's keys instead: drop it";
    let unused = [
        ("mrc_keys", "--mrc-keys", a.mrc, "is the budget of --mrc's estimator: add --mrc, or drop it"),
        ("mrc_seed", "--mrc-seed", a.mrc, "is the seed of --mrc's sampling hash: add --mrc, or drop it"),
        (
            "lfu_ties",
            "--lfu-ties",
            policies.contains(&ScorePolicy::Lfu),
            "is the tie rule of --policy lfu, and no run here is lfu: drop it, or list lfu in --policy",
        ),
        ("trace_format", "--trace-format", a.trace.is_some(), "is the format of --trace FILE: add --trace, or drop it"),
        (
            "csv_column",
            "--csv-column",
            a.trace.is_some(),
            "is the key's column of a csv --trace: add --trace, or drop it",
        ),
        ("alpha", "--alpha", a.trace.is_none(), zipf),
        ("keyspace", "--keyspace", a.trace.is_none(), zipf),
        ("stream_multiple", "--stream-multiple", a.trace.is_none(), zipf),
        ("seed", "--seed", a.trace.is_none(), zipf),
    ];
    if let Some((_, flag, _, why)) = unused.iter().find(|(id, _, used, _)| given(id) && !used) {
        bail!("{flag} has no effect here: it {why}");
    }
    let mode = match a.mode.as_str() {
        "single" => BucketMode::Single,
        "dual" => BucketMode::Dual,
        m => bail!("--mode must be single or dual, not {m:?}"),
    };
    if a.capacity == 0 || a.capacity > MAX_COUNT {
        bail!("--capacity must be 1 to {MAX_COUNT}, not {}", a.capacity);
    }
    if a.batch == 0 || a.batch > MAX_BATCH {
        bail!("--batch must be 1 to {MAX_BATCH}, not {}", a.batch);
    }
    // The table rounds its capacity up to whole buckets; what follows from
    // the capacity (the stream's length, the default keyspace, the
    // factors of --capacities, the batch note) follows the table's slots,
    // not the flag. The story: `--capacity 1 --stream-multiple 100` replayed
    // 100 accesses over 10 keys through a table of 128 slots, and warned
    // that --batch 1 was above a quarter of the capacity. --mrc builds no
    // table: its capacity is the flag's.
    let slots = |c: u64| TableConfig::new(c, 1).buckets() * BUCKET_SLOTS as u64;
    let capacity = if a.mrc { a.capacity } else { slots(a.capacity) };
    let cap_words = if capacity == a.capacity {
        format!("--capacity {capacity}")
    } else {
        format!("--capacity {} (rounded up to {capacity} slots, whole buckets of {BUCKET_SLOTS})", a.capacity)
    };
    if capacity != a.capacity {
        let follow =
            if a.trace.is_none() { "; the stream's length and the default --keyspace follow the slots" } else { "" };
        eprintln!("hkv-sim: note: {cap_words}{follow}");
    }
    // The story: `--alpha inf` (or 1e309, which parses as infinity) was
    // taken, and the Zipf sampler never returned.
    if !(a.alpha.is_finite() && a.alpha > 0.0) {
        bail!("--alpha must be a finite number > 0, not {}", a.alpha);
    }
    let keyspace = match a.keyspace {
        Some(k) if k == 0 || k > MAX_COUNT => bail!("--keyspace must be 1 to {MAX_COUNT}, not {k}"),
        Some(k) => k,
        // Unused by a trace, so not checked then.
        None if a.trace.is_none() && capacity * 10 > MAX_COUNT => bail!(
            "the default --keyspace, 10 × {cap_words}, is {} keys, above {MAX_COUNT}: give --keyspace, or a smaller --capacity",
            capacity * 10
        ),
        None => capacity * 10,
    };
    let (lo, hi) = (hkv_shard::mrc::MIN_KEYS, hkv_shard::mrc::MAX_KEYS);
    if a.mrc && !(lo..=hi).contains(&a.mrc_keys) {
        bail!("--mrc-keys must be {lo} to {hi} (the daemon's mrc.max_keys range), not {}", a.mrc_keys);
    }
    // The same stream at every capacity: its size follows --capacity.
    let total = a.stream_multiple * capacity as f64;
    if a.trace.is_none() && !(total >= 1.0 && total <= MAX_COUNT as f64) {
        bail!("--stream-multiple {} × {cap_words} must come to 1 to {MAX_COUNT} accesses", a.stream_multiple,);
    }
    let total = total as u64;
    let capacities: Vec<u64> = if a.capacities.is_empty() {
        vec![capacity]
    } else {
        a.capacities.iter().map(|c| parse_capacity(c, capacity)).collect::<Result<_>>()?
    };
    // Against the smallest table replayed, which it misleads most.
    let smallest = capacities.iter().map(|&c| slots(c)).min().expect("one capacity at least");
    if !a.mrc && a.batch as u64 > smallest / 4 {
        eprintln!(
            "hkv-sim: note: --batch {} is above a quarter of the table's {smallest} slots{}: nothing is evicted within \
             a batch, so the per-access hit rates come out above what accesses made one at a time get (docs/sizing.md)",
            a.batch,
            if capacities.len() > 1 {
                " (the smallest of --capacities)".to_string()
            } else if capacity != a.capacity {
                format!(" (--capacity {})", a.capacity)
            } else {
                String::new()
            },
        );
    }
    // The trace is opened once here and its head read to detect the
    // format; the first replay reads on from there, later ones open the
    // file again, which only a regular file allows.
    let replays = if a.mrc { 1 } else { policies.len() * capacities.len() };
    let mut opened = None;
    let format = match &a.trace {
        Some(p) => {
            let meta = std::fs::metadata(p).with_context(|| format!("opening trace {}", p.display()))?;
            if !meta.is_file() && replays > 1 {
                bail!(
                    "--trace {} is not a regular file (a pipe or FIFO?) and can be read only once, but {replays} \
                     replays were asked (--policy × --capacities): save the trace to a file, or give one policy \
                     and one capacity",
                    p.display()
                );
            }
            let o = Opened::open(p)?;
            let f = TraceFormat::pick(&a.trace_format, p, &o.head)?;
            if given("csv_column") && f != TraceFormat::Csv {
                bail!(
                    "--csv-column has no effect here: trace {} is read as {} (--trace-format), not csv; drop it",
                    p.display(),
                    f.name()
                );
            }
            opened = Some(o);
            Some(f)
        }
        None => None,
    };
    if a.mrc {
        let source = match (&a.trace, format) {
            (Some(p), Some(f)) => Source::trace(p, f, a.csv_column, opened.take().map_or_else(|| Opened::open(p), Ok)?),
            _ => Source::zipf(keyspace, a.alpha, a.seed, total)?,
        };
        let stream = match &a.trace {
            Some(p) => format!("trace {}", p.display()),
            None => format!("keyspace {keyspace}, alpha {}, seed {}", a.alpha, a.seed),
        };
        return mrc_compare(&a, source, &stream);
    }

    let mut runs = Vec::new();
    for (policy, cap) in policies.iter().flat_map(|&p| capacities.iter().map(move |&c| (p, c))) {
        let cfg = TableConfig::new(cap, 1).policy(policy).mode(mode).lfu_ties(lfu_ties);
        let source = match (&a.trace, format) {
            (Some(p), Some(f)) => Source::trace(p, f, a.csv_column, opened.take().map_or_else(|| Opened::open(p), Ok)?),
            _ => Source::zipf(keyspace, a.alpha, a.seed, total)?,
        };
        let r = replay(&a, &cfg, source)?;
        let stream = match (&a.trace, format) {
            (Some(p), Some(f)) => format!("trace {} ({}, {} distinct keys)", p.display(), f.name(), r.distinct),
            _ => format!("keyspace {keyspace}, alpha {}, seed {}", a.alpha, a.seed),
        };
        println!(
            "hkv-sim: {} mode, {} policy{}, capacity {}, {stream}, {} accesses in batches of {}",
            a.mode,
            policy.name(),
            if policy == ScorePolicy::Lfu { format!(" ({} ties)", lfu_ties.name()) } else { String::new() },
            r.capacity,
            r.accesses,
            a.batch
        );
        println!("{:<36} {:>10}", "metric", "value");
        println!("{:<36} {:>9.3}%", "hit rate per access (table)", r.hit_rate * 100.0);
        println!("{:<36} {:>9.3}%", "hit rate per access (ideal)", r.ideal_hit_rate * 100.0);
        println!("{:<36} {:>9.3}%", "hit rate per batch lookup (table)", r.batch_hit_rate * 100.0);
        println!("{:<36} {:>9.3}%", "hit rate per batch lookup (ideal)", r.ideal_batch_hit_rate * 100.0);
        println!("{:<36} {:>10}", "hit rate ceiling (top-capacity mass)", pct(r.ceiling));
        println!("{:<36} {:>+9.3} pp", "table - ideal", (r.hit_rate - r.ideal_hit_rate) * 100.0);
        match r.first_eviction {
            Some(f) => println!("{:<36} {:>10.4}", "first-eviction load factor", f),
            None => println!("{:<36} {:>10}", "first-eviction load factor", "none"),
        }
        println!("{:<36} {:>9.3}%", "top-N retention", r.top_n_retention * 100.0);
        println!("{:<36} {:>9.3}%", "popular-N retention (table)", r.popular_n_retention * 100.0);
        println!("{:<36} {:>9.3}%", "popular-N retention (ideal)", r.ideal_popular * 100.0);
        println!("{:<36} {:>10.4}", "final load factor", r.final_load_factor);
        println!("{:<36} {:>9.1}s", "wall time", r.seconds);
        runs.push((policy, r));
    }
    if policies.len() > 1 {
        println!("hit rates per access (%), by policy:");
        print!("{:>12}", "capacity");
        for p in &policies {
            print!(" {:>9}", p.name());
        }
        println!(" {:>9}", "exact-lru");
        for (i, &cap) in capacities.iter().enumerate() {
            let _ = cap;
            let row: Vec<&Run> = (0..policies.len()).map(|j| &runs[j * capacities.len() + i].1).collect();
            print!("{:>12}", row[0].capacity);
            for r in &row {
                print!(" {:>9.3}", r.hit_rate * 100.0);
            }
            let lru = row.iter().zip(&policies).find(|(_, p)| **p != ScorePolicy::Lfu).map(|(r, _)| r.ideal_hit_rate);
            println!(" {:>9}", lru.map_or("-".into(), |h| format!("{:.3}", h * 100.0)));
        }
    }
    let runs: Vec<Run> = runs.into_iter().map(|(_, r)| r).collect();
    if runs.len() > 1 && policies.len() == 1 {
        println!("hit rates per access:");
        println!(
            "{:>12} {:>8} {:>10} {:>10} {:>10} {:>10}",
            "capacity", "factor", "table", "ideal", "diff pp", "top-N"
        );
        for r in &runs {
            println!(
                "{:>12} {:>8.3} {:>9.3}% {:>9.3}% {:>+10.3} {:>9.3}%",
                r.capacity,
                r.capacity as f64 / capacity as f64,
                r.hit_rate * 100.0,
                r.ideal_hit_rate * 100.0,
                (r.hit_rate - r.ideal_hit_rate) * 100.0,
                r.top_n_retention * 100.0
            );
        }
    }
    if a.json {
        let obj = |(i, r): (usize, &Run)| {
            let policy = policies[i / capacities.len()];
            serde_json::json!({
                "mode": a.mode, "policy": policy.name(),
                "lfu_ties": (policy == ScorePolicy::Lfu).then(|| lfu_ties.name()), "capacity": r.capacity,
                "keyspace": if a.trace.is_some() { None } else { Some(keyspace) },
                "trace": a.trace.as_ref().map(|p| p.display().to_string()), "trace_format": format.map(|f| f.name()),
                "distinct_keys": r.distinct,
                "alpha": if a.trace.is_some() { None } else { Some(a.alpha) },
                "accesses": r.accesses, "hits": r.hits, "ideal_hits": r.ideal_hits, "batch": a.batch, "seed": a.seed,
                "hit_rate": r.hit_rate, "ideal_hit_rate": r.ideal_hit_rate, "ceiling_hit_rate": r.ceiling,
                "batch_hit_rate": r.batch_hit_rate, "ideal_batch_hit_rate": r.ideal_batch_hit_rate,
                "first_eviction_load_factor": r.first_eviction, "evicted": r.first_eviction.is_some(),
                "top_n_retention": r.top_n_retention, "popular_n_retention": r.popular_n_retention,
                "ideal_popular_n_retention": r.ideal_popular, "final_load_factor": r.final_load_factor,
                "seconds": r.seconds,
            })
        };
        let j = match runs.as_slice() {
            [r] => obj((0, r)),
            rs => serde_json::json!({ "runs": rs.iter().enumerate().map(obj).collect::<Vec<_>>() }),
        };
        println!("{j}");
    }
    Ok(())
}

/// `--mrc`: the SHARDS estimate beside the exact LRU hit rates, and the
/// cost of `observe`.
fn mrc_compare(a: &Args, mut source: Source, stream: &str) -> Result<()> {
    use hkv_shard::mrc::{LruStack, Mrc, MrcConfig, FACTORS};
    let mut cfg = MrcConfig { max_keys: a.mrc_keys, ..MrcConfig::default() };
    if let Some(s) = a.mrc_seed {
        cfg.seed = s;
    }
    let mut mrc = Mrc::new(cfg, a.capacity);
    let mut exact = LruStack::new();
    let caps: Vec<u64> = FACTORS.iter().map(|f| (a.capacity as f64 * f).round() as u64).collect();
    let mut exact_hits = vec![0u64; caps.len()];
    // The whole stream in memory (8 bytes an access), so that observe is
    // timed alone. The story: its growth aborted the process ("memory
    // allocation of 2147483648 bytes failed", exit 134) where the host
    // could not hold it; it is allocated fallibly now, a Zipf stream's
    // whole length before the first key is drawn.
    let (mut all, mut keys): (Vec<u64>, _) = (Vec::new(), buffer(a.batch, 0u64, "the buffers of --batch")?);
    if let Source::Zipf { left, .. } = &source {
        let n = *left;
        all.try_reserve_exact(n as usize).map_err(|_| {
            anyhow::anyhow!(
                "out of memory: --mrc holds the whole stream, 8 bytes an access, and {n} accesses \
                 (--stream-multiple {} × --capacity {}) take {}, which could not be allocated: give a smaller \
                 --stream-multiple or --capacity",
                a.stream_multiple,
                a.capacity,
                gib(n.saturating_mul(8))
            )
        })?;
    }
    loop {
        source.next_batch(&mut keys, a.batch)?;
        if keys.is_empty() {
            break;
        }
        all.try_reserve(keys.len()).map_err(|_| {
            anyhow::anyhow!(
                "out of memory: --mrc holds the whole trace, 8 bytes a key, and its keys past the first {} ({}) \
                 could not be allocated: give --trace a shorter trace",
                all.len(),
                gib(all.len() as u64 * 8)
            )
        })?;
        all.extend_from_slice(&keys);
    }
    let done = all.len() as u64;
    if done == 0 {
        return Err(no_keys(a));
    }
    let t = thread_seconds();
    for b in all.chunks(a.batch) {
        mrc.observe(b);
    }
    let observe_s = thread_seconds() - t;
    // The exact stack takes some 40 bytes a distinct key, and its growth
    // is fallible too.
    let grown = |why: &str, held: usize, at: usize| {
        anyhow::anyhow!(
            "{why}: --mrc's exact LRU stack could not track more than the {held} distinct keys it holds ({at} \
             accesses in): give a smaller --keyspace or --stream-multiple, or a trace of fewer keys"
        )
    };
    for (i, &k) in all.iter().enumerate() {
        if exact.len() >= LruStack::MAX_KEYS {
            return Err(grown("too many keys", exact.len(), i));
        }
        let held = exact.len();
        if let Some(d) = exact.try_access(k).map_err(|_| grown("out of memory", held, i))? {
            for (h, &c) in exact_hits.iter_mut().zip(&caps) {
                *h += u64::from(d < c);
            }
        }
    }
    // The cost of observe at the rate reached: the stream's last batches
    // of BENCH_KEYS keys observed again, each timed on the wall clock (the
    // least disturbed is the cost on an idle core).
    const BENCH_KEYS: usize = 256 * 1024;
    let tail = &all[all.len().saturating_sub(10 * BENCH_KEYS)..];
    let curve = mrc.curve();
    let mut costs: Vec<f64> = tail
        .chunks(BENCH_KEYS)
        .map(|b| {
            let t = Instant::now();
            mrc.observe(b);
            t.elapsed().as_secs_f64() * 1e9 / b.len() as f64
        })
        .collect();
    costs.sort_by(f64::total_cmp);
    let (bench_ns, bench_median) = (costs[0], costs[costs.len() / 2]);
    println!(
        "hkv-sim --mrc: capacity {}, {stream}, {done} accesses, {} distinct keys; SHARDS budget {} keys (~{} KiB), seed {:#x}",
        a.capacity,
        exact.len(),
        cfg.max_keys,
        mrc.memory_bytes() / 1024,
        cfg.seed
    );
    println!(
        "sampling rate {:.6}, {} sampled accesses, {} keys tracked",
        curve.rate, curve.sampled_accesses, curve.tracked_keys
    );
    println!("{:>8} {:>12} {:>10} {:>10} {:>10}", "factor", "capacity", "shards", "exact", "diff pp");
    let (mut sum, mut worst) = (0.0f64, 0.0f64);
    let mut rows = Vec::new();
    for (p, &h) in curve.points.iter().zip(&exact_hits) {
        let ex = h as f64 / done as f64;
        let diff = (p.hit_rate - ex) * 100.0;
        sum += diff.abs();
        worst = worst.max(diff.abs());
        println!(
            "{:>8.3} {:>12} {:>9.3}% {:>9.3}% {:>+10.3}",
            p.factor,
            p.capacity,
            p.hit_rate * 100.0,
            ex * 100.0,
            diff
        );
        rows.push(serde_json::json!({"factor": p.factor, "capacity": p.capacity, "shards": p.hit_rate, "exact": ex}));
    }
    let mae = sum / curve.points.len() as f64;
    println!("mean absolute error {mae:.3} pp, worst {worst:.3} pp");
    println!(
        "observe: {:.2} ns/key over the whole stream from the start (batches of {}, {}); \
         at the rate reached, {bench_ns:.2} ns/key (median {bench_median:.2}) on batches of {} keys ({} batches, wall clock, least)",
        observe_s * 1e9 / done as f64,
        a.batch,
        if cpu_clock() { "thread CPU time" } else { "wall clock" },
        BENCH_KEYS.min(tail.len()),
        costs.len()
    );
    if a.json {
        let j = serde_json::json!({
            "capacity": a.capacity, "accesses": done, "distinct_keys": exact.len(), "max_keys": cfg.max_keys,
            "memory_bytes": mrc.memory_bytes(), "rate": curve.rate, "sampled_accesses": curve.sampled_accesses,
            "tracked_keys": curve.tracked_keys, "points": rows, "mae_pp": mae, "worst_pp": worst,
            "observe_ns_per_key": bench_ns, "stream_observe_ns_per_key": observe_s * 1e9 / done as f64,
        });
        println!("{j}");
    }
    Ok(())
}

/// Whether [`thread_seconds`] reads this thread's CPU time (Linux) rather
/// than the wall clock: on a shared machine the CPU time is what a cost is.
fn cpu_clock() -> bool {
    std::fs::read_to_string("/proc/thread-self/schedstat").is_ok()
}

/// This thread's time on a CPU (the first field of
/// `/proc/thread-self/schedstat`, ns), else the wall clock, in seconds.
fn thread_seconds() -> f64 {
    let cpu = std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
    match cpu {
        Some(ns) => ns as f64 * 1e-9,
        None => {
            static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
            START.get_or_init(Instant::now).elapsed().as_secs_f64()
        }
    }
}
