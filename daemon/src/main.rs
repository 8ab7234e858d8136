//! `hkvd`: the daemon's command line.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use hkvd::config::Config;

#[derive(Parser)]
#[command(
    name = "hkvd",
    version,
    about = "Embedding tables in GPU (or host) memory as a cache, served over a Unix socket"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the daemon (CUDA shards when a GPU exists, else CPU shards).
    Serve(Box<Serve>),
    /// The operator console: tables, shards, lock groups, checkpoints, live.
    Top(Top),
}

#[derive(Args)]
struct Top {
    /// Socket path [default: $HKVD_SOCKET, else $XDG_RUNTIME_DIR/hkvd/hkvd.sock, else ./hkvd-run/hkvd.sock].
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Milliseconds between stats polls.
    #[arg(long, default_value_t = 250)]
    interval_ms: u64,
    /// Append a line per poll to this file (the console never logs to the screen).
    #[arg(long)]
    log: Option<PathBuf>,
}

#[derive(Args)]
struct Serve {
    /// TOML config file; flags override its values.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Socket path [default: $XDG_RUNTIME_DIR/hkvd/hkvd.sock, else ./hkvd-run/hkvd.sock].
    #[arg(long)]
    socket: Option<PathBuf>,
    /// State directory (checkpoints) [default: ./hkvd-state].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// auto, cpu or cuda [default: auto].
    #[arg(long)]
    backend: Option<hkvd::config::BackendChoice>,
    /// Shard actors: CPU shards [default: the number of cores], or CUDA
    /// shards spread round-robin over the GPUs [default: one per GPU].
    #[arg(long)]
    shards: Option<usize>,
    /// CUDA devices to use, comma separated (after CUDA_VISIBLE_DEVICES) [default: all].
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// Threads per shard actor [default: 4].
    #[arg(long)]
    threads_per_shard: Option<usize>,
    /// Largest request body, bytes [default: 1 GiB].
    #[arg(long)]
    max_frame_bytes: Option<u32>,
    /// Requests of one connection run at once [default: 64].
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Connections served at once [default: 1024].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Bytes of sent answers kept for later answers to reuse [default: 512 MiB; CUDA: 2 GiB].
    #[arg(long)]
    frame_cache_bytes: Option<u64>,
    /// Bytes all tables may hold at their peak: device memory on CUDA, host
    /// memory on the CPU backend [default: 7/8 of the GPUs' memory; CPU: 3/4 of RAM].
    #[arg(long)]
    max_table_bytes: Option<u64>,
    /// Pinned host memory for CUDA tables' host tiers, bytes [default: half of RAM].
    #[arg(long)]
    max_host_tier_bytes: Option<u64>,
    /// Bytes of requests being received or run and answers being built or
    /// sent, all connections [default: 4 GiB; at least twice max-frame-bytes].
    #[arg(long)]
    max_bytes_in_flight: Option<u64>,
    /// Seconds a started request body may go without a byte arriving before
    /// its connection is closed [default: 30].
    #[arg(long)]
    body_stall_seconds: Option<u64>,
    /// Seconds a connection with no request running may go without sending,
    /// while at least half of max-connections are open, before it is
    /// closed; 0 = never [default: 300].
    #[arg(long)]
    idle_seconds: Option<u64>,
    /// Seconds a region request waits for the client's wait event before it
    /// is answered `timeout` [default: 60].
    #[arg(long)]
    event_wait_seconds: Option<u64>,
    /// Seconds SIGTERM waits for in-flight requests before closing the
    /// remaining connections [default: 30].
    #[arg(long)]
    drain_seconds: Option<u64>,
    /// Bytes of registered regions (client memfds mapped), all connections [default: 64 GiB].
    #[arg(long)]
    max_region_bytes: Option<u64>,
    /// Bytes of registered regions of one connection [default: 16 GiB].
    #[arg(long)]
    max_region_bytes_per_connection: Option<u64>,
    /// Group allowed to run admin operations, besides the daemon's user and
    /// root; the socket and state directory get this group.
    #[arg(long)]
    admin_group: Option<String>,
    /// Group allowed to connect and run table operations (not admin
    /// operations); the socket and its directory get this group instead of
    /// the admin group, whose members then need this group to connect.
    #[arg(long)]
    client_group: Option<String>,
    /// Serve Prometheus metrics over HTTP on this loopback address, e.g. 127.0.0.1:9466.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Restore at start: latest, a checkpoint id, or none [default: latest].
    #[arg(long)]
    restore: Option<String>,
    /// Seconds between scheduled checkpoints [default: none, on demand only].
    #[arg(long)]
    checkpoint_interval: Option<u64>,
    /// Complete checkpoints kept [default: 3].
    #[arg(long)]
    checkpoint_keep: Option<usize>,
    /// Incremental checkpoints between full ones; 0 = always full [default: 4].
    #[arg(long)]
    checkpoint_full_every: Option<u32>,
    /// Take a checkpoint after draining on SIGTERM or shutdown.
    #[arg(long)]
    checkpoint_on_shutdown: bool,
    /// Turn the live miss-ratio curves off (no key is sampled).
    #[arg(long)]
    no_mrc: bool,
    /// Distinct sampled keys per table for the curves, split over its shards (about 120 bytes each) [default: 16384].
    #[arg(long)]
    mrc_max_keys: Option<usize>,
    /// Log filter (tracing env-filter syntax) [default: info, or $RUST_LOG].
    #[arg(long)]
    log: Option<String>,
}

fn config(a: Serve) -> anyhow::Result<Config> {
    let mut c = match &a.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    c.socket = a.socket.or(c.socket);
    c.state_dir = a.state_dir.or(c.state_dir);
    if let Some(b) = a.backend {
        c.backend = b;
    }
    c.shards = a.shards.or(c.shards);
    c.devices = a.devices.or(c.devices);
    if let Some(t) = a.threads_per_shard {
        c.threads_per_shard = t;
    }
    if let Some(x) = a.max_frame_bytes {
        c.limits.max_frame_bytes = x;
    }
    if let Some(x) = a.max_in_flight {
        c.limits.max_in_flight = x;
    }
    if let Some(x) = a.max_connections {
        c.limits.max_connections = x;
    }
    if let Some(x) = a.frame_cache_bytes {
        c.limits.frame_cache_bytes = Some(x);
    }
    c.limits.max_table_bytes = a.max_table_bytes.or(c.limits.max_table_bytes);
    c.limits.max_host_tier_bytes = a.max_host_tier_bytes.or(c.limits.max_host_tier_bytes);
    if let Some(x) = a.max_bytes_in_flight {
        c.limits.max_bytes_in_flight = x;
    }
    if let Some(x) = a.body_stall_seconds {
        c.limits.body_stall_seconds = x;
    }
    if let Some(x) = a.idle_seconds {
        c.limits.idle_seconds = x;
    }
    if let Some(x) = a.event_wait_seconds {
        c.limits.event_wait_seconds = x;
    }
    if let Some(x) = a.drain_seconds {
        c.limits.drain_seconds = x;
    }
    if let Some(x) = a.max_region_bytes {
        c.limits.max_region_bytes = x;
    }
    if let Some(x) = a.max_region_bytes_per_connection {
        c.limits.max_region_bytes_per_connection = x;
    }
    c.admin_group = a.admin_group.or(c.admin_group);
    c.client_group = a.client_group.or(c.client_group);
    c.metrics_listen = a.metrics_listen.or(c.metrics_listen);
    if let Some(r) = a.restore {
        c.restore = r;
    }
    c.checkpoint.interval_s = a.checkpoint_interval.or(c.checkpoint.interval_s);
    if let Some(k) = a.checkpoint_keep {
        c.checkpoint.keep = k;
    }
    if let Some(k) = a.checkpoint_full_every {
        c.checkpoint.full_every = k;
    }
    c.checkpoint.on_shutdown |= a.checkpoint_on_shutdown;
    if a.no_mrc {
        c.mrc.enabled = false;
    }
    if let Some(k) = a.mrc_max_keys {
        c.mrc.max_keys = k;
    }
    c.check()?;
    Ok(c)
}

/// Transparent huge pages for the host memory of tables. Lookups touch table
/// memory at random, so with 4 KiB pages nearly every one also misses the
/// TLB; on the 2-core development machine, the CPU table's finds ran 30-80 %
/// faster on huge pages (`shard/BENCHMARKS.md`). Linux in the common
/// `madvise` mode gives them only to memory that asks, and glibc's malloc
/// asks when `glibc.malloc.hugetlb=1` is in `GLIBC_TUNABLES` at process
/// start; so, unless `HKVD_HUGE_PAGES=0`, hkvd re-executes itself (same pid,
/// same descriptors: systemd and socket activation are unaffected) with it
/// set. Returns what applies, in words; returns only without re-executing.
fn huge_pages() -> String {
    const TUNABLE: &str = "glibc.malloc.hugetlb=1";
    if std::env::var("HKVD_HUGE_PAGES").is_ok_and(|v| v == "0") {
        return "off (HKVD_HUGE_PAGES=0)".into();
    }
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    if tunables.split(':').any(|t| t == TUNABLE) {
        return format!("on ({TUNABLE})");
    }
    if tunables.contains("glibc.malloc.hugetlb") {
        return format!("as GLIBC_TUNABLES={tunables} says");
    }
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if mode.contains("[always]") {
        return "on (transparent huge pages: always)".into();
    }
    if !mode.contains("[madvise]") || !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return "unavailable (transparent huge pages off, or not glibc on Linux)".into();
    }
    let Ok(exe) = std::env::current_exe() else {
        return "off (the executable's path is unknown)".into();
    };
    let value = if tunables.is_empty() { TUNABLE.to_string() } else { format!("{tunables}:{TUNABLE}") };
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(exe);
    if let Some(arg0) = args.next() {
        std::os::unix::process::CommandExt::arg0(&mut cmd, arg0);
    }
    let err = std::os::unix::process::CommandExt::exec(cmd.args(args).env("GLIBC_TUNABLES", value));
    format!("off (re-executing with {TUNABLE} failed: {err})")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Top(t) => {
            let socket = t.socket.unwrap_or_else(hkv_proto::client_socket_path);
            match hkv_tui::run(socket, std::time::Duration::from_millis(t.interval_ms.max(50)), t.log) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("hkvd top: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Serve(a) => {
            // Before any thread starts: this may re-execute the process.
            let huge = huge_pages();
            let filter = a.log.clone().or_else(|| std::env::var("RUST_LOG").ok()).unwrap_or_else(|| "info".into());
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init();
            tracing::info!(huge_pages = %huge, "host memory for tables");
            // The CUDA kernel tuning knobs (HKV_LOOKUP_GROUP, HKV_WRITE_GROUP, HKV_KEY_ORDER): the library reads no environment.
            let tuning = hkv_shard::CudaTuning::from_vars(|k| std::env::var(k).ok()).map(hkv_shard::cuda::set_tuning);
            match tuning.map_err(anyhow::Error::from).and_then(|()| config(*a)).and_then(hkvd::run) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("hkvd: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}
