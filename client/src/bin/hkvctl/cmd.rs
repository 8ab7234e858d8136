//! The command line: [`Cli`] and its subcommands, [`Cmd`].

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::bench::BenchArgs;
use crate::features::{HashArgs, Input};
use crate::tables::CreateTable;

#[derive(Parser)]
#[command(name = "hkvctl", version, about = "Command-line client of hkvd")]
pub struct Cli {
    /// Socket path [default: $HKVD_SOCKET, else $XDG_RUNTIME_DIR/hkvd/hkvd.sock, else ./hkvd-run/hkvd.sock].
    #[arg(long, global = true, display_order = 1000)]
    pub socket: Option<PathBuf>,
    /// Seconds to wait for each answer of the daemon before giving up, a
    /// fraction allowed (0: forever) [default: 60; forever for restore,
    /// trace, flush, clear, drop-table and shutdown, which answer when
    /// their work is done].
    #[arg(long, global = true, value_parser = seconds, display_order = 1001)]
    pub timeout: Option<f64>,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Check that the daemon answers.
    Ping,
    /// Create a table spread over every shard.
    CreateTable(CreateTable),
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
    /// Erase every entry of a table; a backed table that writes (write-through, write-back) erases its rows from its cluster too.
    Clear {
        /// Table name.
        table: String,
    },
    /// Drain a backed table's write-back queue into its cluster (returns once every queued row is there).
    Flush {
        /// Table name.
        table: String,
    },
    /// List tables (--json: each table's spec in full, the lfu tie rule
    /// and hash setting included).
    Tables {
        /// Print the daemon's JSON list (the table info of PROTOCOL.md).
        #[arg(long)]
        json: bool,
    },
    /// Write values: KEY=V1,V2,... (a row each: dim values, then an
    /// optimizer table's state columns).
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
        /// Keys per request (at least 1).
        #[arg(long, default_value_t = 1 << 18, value_parser = at_least_1::<u64>)]
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
    /// A table's live miss-ratio curve: the hit rate an LRU cache of 1/8x to
    /// 8x its capacity would have had on its keys.
    Mrc {
        /// Table name.
        table: String,
        /// Print the curve's JSON (the stats document's `tables[].mrc`).
        #[arg(long)]
        json: bool,
    },
    /// The keys a table's curves sample, collected for some seconds and
    /// written for `hkv-sim --trace` (prints the replay command).
    Trace {
        /// Table name.
        table: String,
        /// Seconds to collect (1 to 3600).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=3600))]
        seconds: u32,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// One decimal key per line instead of u64 little-endian.
        #[arg(long)]
        text: bool,
    },
    /// Prometheus text.
    Metrics,
    /// Throughput over the socket: find and insert_or_assign beside the raw
    /// socket moving the same bytes, on a table `hkvctl-bench-PID` it
    /// creates (admin) and drops when it ends, stopped by SIGINT, SIGTERM
    /// or SIGHUP or by a reader that went away included.
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
        #[arg(value_parser = |s: &str| s.parse::<hkv_client::proto::CheckpointId>().map_err(|e| e.message))]
        id: hkv_client::proto::CheckpointId,
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

/// `--timeout`: seconds, zero or more, a fraction allowed.
/// Seconds in a year: the longest --timeout.
const YEAR: f64 = 365.0 * 86400.0;

fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        // At most a year: a larger one (1e20) is no Duration, and hkvctl
        // panicked making it; 0 waits forever.
        Ok(v) if v.is_finite() && (0.0..=YEAR).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds (0 to {YEAR}, e.g. 0.5; 0 waits forever)")),
    }
}

/// A count of at least 1 (fill's `--batch`, bench's `--batches`,
/// `--clients`, `--pipeline`): a bench of 0 keys, clients or requests in
/// flight measured nothing and printed NaN rows with status 0; clap's own
/// range check then said `0 is not in 1..18446744073709551615`.
pub fn at_least_1<T: std::str::FromStr + PartialOrd + From<u8>>(s: &str) -> Result<T, String> {
    match s.parse::<T>() {
        Ok(v) if v >= T::from(1) => Ok(v),
        Ok(_) => Err("must be at least 1".into()),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}
