//! `hkvd`: the daemon's command line.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
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
    /// The operator console: a live view of tables, shards, lock groups and checkpoints.
    Top(Top),
    /// Internal: the process a serving daemon starts to open CUDA IPC
    /// handles before it opens them itself (lines on stdin, answers on stdout).
    #[command(name = "check-ipc-handles", hide = true)]
    CheckIpcHandles,
}

#[derive(Args)]
#[command(after_help = "Environment:
  HKVD_SOCKET        the socket when --socket is not given
  XDG_RUNTIME_DIR    the socket's directory when neither --socket nor HKVD_SOCKET names one")]
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
#[command(after_help = ENVIRONMENT)]
struct Serve {
    /// TOML config file; flags override its values.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Log filter (tracing env-filter syntax) [default: $RUST_LOG, else info].
    #[arg(long)]
    log: Option<String>,
    /// Every other option: declared once, with its TOML key, in
    /// daemon/src/config.rs.
    #[command(flatten)]
    options: Config,
}

/// The environment variables `hkvd serve` reads (the libraries read none).
const ENVIRONMENT: &str = "\
Environment:
  HKVD_SOCKET        the socket when neither --socket nor the file names one (the path hkvctl and the clients use)
  XDG_RUNTIME_DIR    the socket's directory when none of those names one
  HKV_KERNEL_CACHE   the kernel cache directory when neither --kernel-cache-dir nor the file names one
  HKV_LOOKUP_GROUP   CUDA: threads per key of every lookup kernel (1|2|4|8|16|32; default: chosen per batch)
  HKV_WRITE_GROUP    CUDA: threads per key of every writer kernel (1|2|4|8|16|32)
  HKV_KEY_ORDER      CUDA: large host-tier batches in `index` or `region` order (default region)
  HKV_FIND_OR_INSERT CUDA: a find_or_insert of more than 4096 keys: `dedupe` (default), `probe` or `locked`
  HKVD_HUGE_PAGES    0: do not re-execute with glibc.malloc.hugetlb=1 for huge pages
  GLIBC_TUNABLES     kept; glibc.malloc.hugetlb=1 is added to it (see HKVD_HUGE_PAGES)
  RUST_LOG           the log filter when --log is not given";

/// The configuration: the flags over the file, then what the environment
/// gives for options left unset.
fn config(a: Serve, given: &clap::ArgMatches) -> anyhow::Result<Config> {
    let mut c = Config::layered(a.options, given, a.config.as_deref())?;
    if c.socket.is_none() {
        // The path the clients take from the same variables, so that one
        // `export HKVD_SOCKET=...` points the daemon and its clients at one socket.
        let runtime_dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
        let named = std::env::var_os("HKVD_SOCKET").filter(|s| !s.is_empty()).map(PathBuf::from);
        c.socket = Some(hkv_proto::client_socket_path(named, runtime_dir.as_deref()));
    }
    if c.kernel_cache_dir.is_none() {
        c.kernel_cache_dir = std::env::var_os("HKV_KERNEL_CACHE").map(PathBuf::from);
    }
    // The CUDA kernel tuning knobs: the library reads no environment.
    c.cuda_tuning = hkv_shard::CudaTuning::from_vars(|k| std::env::var(k).ok()).map_err(|e| match e {
        // (Its message began "invalid table config:", of a variable.)
        hkv_shard::Error::Config(why) => {
            anyhow::anyhow!("environment variable {why}; unset it, or see `hkvd serve --help` (Environment)")
        }
        e => anyhow::anyhow!("the environment: {e}"),
    })?;
    c.check()?;
    // A socket hkvd binds itself (systemd's socket activation passes one
    // bound): std's refusal said "path must be shorter than SUN_LEN".
    if std::env::var_os("LISTEN_FDS").is_none() {
        let path = c.socket_path();
        let len = path.as_os_str().len();
        anyhow::ensure!(
            len < SUN_PATH_BYTES,
            "socket (--socket) {}: {len} bytes, where a Unix socket's path holds at most {} \
             ({SUN_PATH_BYTES} bytes with its NUL); pick a shorter path",
            path.display(),
            SUN_PATH_BYTES - 1
        );
    }
    Ok(c)
}

/// The bytes of `sockaddr_un.sun_path` on Linux, its closing NUL included.
const SUN_PATH_BYTES: usize = 108;

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
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match cli.cmd {
        Cmd::CheckIpcHandles => match hkvd::region::vet::serve_checks() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("hkvd {}: {e}", hkvd::region::vet::SUBCOMMAND);
                ExitCode::from(1)
            }
        },
        Cmd::Top(t) => {
            let socket = t.socket.unwrap_or_else(|| {
                let runtime_dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
                hkv_proto::client_socket_path(std::env::var_os("HKVD_SOCKET").map(Into::into), runtime_dir.as_deref())
            });
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
            let (filter, from) = match (a.log.clone(), std::env::var("RUST_LOG").ok()) {
                (Some(f), _) => (f, "--log"),
                (None, Some(f)) => (f, "RUST_LOG"),
                (None, None) => ("info".into(), "the default"),
            };
            // A filter that does not parse is refused, not dropped: a
            // daemon that logged nothing at all would hide its errors. So
            // is a bare word that is no level: it parses as a target
            // (`warning` logged the target "warning" alone, which is
            // nothing: a tester's typo silenced every error).
            if let Some(word) = bare_target(&filter) {
                eprintln!(
                    "hkvd: {from} {filter:?}: {word:?} is not a level (trace, debug, info, warn, error, off); \
                     a target needs its level, as in {word}=debug"
                );
                return ExitCode::from(2);
            }
            let filter = match tracing_subscriber::EnvFilter::try_new(&filter) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("hkvd: {from} {filter:?} is not a log filter ({e}); use a level such as info or warn, or directives such as hkvd=debug,warn");
                    return ExitCode::from(2);
                }
            };
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init();
            let given = matches.subcommand_matches("serve").expect("the serve subcommand was parsed");
            // The options are checked before the first line is logged: a
            // refusal used to come after an INFO line, as if hkvd started.
            let checked = config(*a, given).inspect(|_| tracing::info!(huge_pages = %huge, "host memory for tables"));
            match checked.and_then(hkvd::run) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("hkvd: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

/// The first directive of log filter `filter` that is a bare word but no
/// level (`warning`, `hkvd`): EnvFilter takes it as a target logged at
/// every level, and every other target then logs nothing.
fn bare_target(filter: &str) -> Option<&str> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    filter.split(',').map(str::trim).filter(|d| !d.is_empty()).find(|d| {
        !d.contains(['=', '[', ':'])
            && !d.bytes().all(|b| b.is_ascii_digit())
            && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(d))
    })
}
