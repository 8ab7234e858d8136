//! # hkvd: the embedding-cache daemon
//!
//! An actix `System` with one [`actor::ShardActor`] per device (per CPU shard
//! on hosts without GPUs) owning that device's shard of every table, a
//! [`router::Router`] that spreads every table over them by messages, and a
//! Unix-socket [`server`] speaking `proto/PROTOCOL.md`.
//!
//! # Layout
//! - [`actor`] is the shard actor: the shards it owns, and its messages
//!   (a split batch's keys arrive checked, [`actor::Keys`], and are not
//!   scanned again).
//! - [`router`] maps tables and keys to actors and merges their answers.
//! - [`frames`] keeps sent frames for find and echo answers to reuse; a
//!   find answer's frame is typed, [`frames::AnswerFrame`]: ordinary or
//!   page-locked memory the GPU writes into.
//! - [`features`] hashes raw features into keys (on the GPU when present).
//! - [`budget`] counts table memory against limits before it is allocated.
//! - [`ckpt`] takes and restores checkpoints.
//! - [`state`] is what the request handlers share, and the server's counters.
//! - [`server`] binds the socket, accepts connections, drains on shutdown.
//! - [`connection`] reads one connection's frames and writes its answers.
//! - [`handle`] answers one request.
//! - [`memory`] checks large allocations against the address-space limit.
//! - [`admin`] says who may run admin operations and read the state directory.
//! - [`backing`] is the glue to each backed table's Redis Cluster tier
//!   (`hkv-backing`), in front of the router, reached from `handle`.
//! - [`mrc`] keeps each shard's miss-ratio estimator and combines a table's curve.
//! - [`region`] registers client memory (memfds) and runs requests naming arrays in it.
//! - [`stats`] renders statistics as JSON and Prometheus text.
//! - [`config`] holds the TOML configuration, its defaults and checks
//!   ([`config::BackendChoice`]: auto, cpu or cuda).
//! - [`error`] maps shard errors to wire errors.
//! - this file: [`run`], start to finish.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod actor;
pub mod admin;
pub mod backing;
pub mod budget;
pub mod carried;
pub mod ckpt;
pub mod config;
pub mod connection;
pub mod error;
pub mod features;
pub mod frames;
pub mod handle;
pub mod memory;
pub mod mrc;
pub mod path;
pub mod region;
pub mod router;
pub mod server;
pub mod shard_ops;
pub mod state;
pub mod stats;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use hkv_shard::Backend;
use tracing::{error, info, warn};

use crate::actor::ShardActor;
use crate::config::{BackendChoice, Config};
use crate::router::Router;
use crate::server::SocketFile;
use crate::state::State;

/// Picks the backend and the shard actors: for each, the device ordinal it
/// opens its shards on (CUDA), or its index (CPU).
fn backend(config: &Config) -> anyhow::Result<(Backend, Vec<usize>, String)> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let cpu = |why: &str| {
        if let Some(d) = &config.devices {
            warn!(devices = ?d, "devices (--devices, or the config file's devices) names CUDA devices; the CPU backend has none and ignores it");
        }
        let n = config.shards.unwrap_or(cores).max(1);
        (Backend::Cpu, (0..n).collect(), format!("cpu ({n} shard{}{why})", if n == 1 { "" } else { "s" }))
    };
    let gpus = |found: Vec<hkv_shard::cuda::DeviceInfo>| -> anyhow::Result<(Backend, Vec<usize>, String)> {
        let chosen: Vec<hkv_shard::cuda::DeviceInfo> = match &config.devices {
            None => found,
            Some(want) => want
                .iter()
                .map(|o| {
                    found.iter().find(|d| d.ordinal == *o).cloned().ok_or_else(|| {
                        anyhow::anyhow!(
                            "--devices {o}: no such CUDA device (visible: {})",
                            found.iter().map(|d| d.ordinal.to_string()).collect::<Vec<_>>().join(", ")
                        )
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        };
        anyhow::ensure!(!chosen.is_empty(), "--devices names no device");
        let n = config.shards.unwrap_or(chosen.len()).max(1);
        let ordinals: Vec<usize> = (0..n).map(|i| chosen[i % chosen.len()].ordinal).collect();
        let names: Vec<String> = chosen.iter().map(|d| format!("{} {}", d.ordinal, d.name)).collect();
        // Socket batches are split on the host and need no NCCL; say
        // whether the GPU-to-GPU paths (hkv_shard::multi) could run here.
        let nccl = match (chosen.len(), hkv_shard::multi::nccl_version()) {
            (1, _) => String::new(),
            (_, Ok(v)) => format!("; NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100),
            (_, Err(e)) => {
                warn!(reason = %e, "NCCL unavailable: GPU-to-GPU paths are off");
                "; NCCL unavailable".into()
            }
        };
        let what = format!(
            "cuda ({} GPU{}: {}; {n} shard{}{nccl})",
            chosen.len(),
            if chosen.len() == 1 { "" } else { "s" },
            names.join(", "),
            if n == 1 { "" } else { "s" }
        );
        Ok((Backend::Cuda, ordinals, what))
    };
    match config.backend {
        BackendChoice::Cpu => Ok(cpu("")),
        BackendChoice::Auto => match hkv_shard::cuda::probe() {
            Ok(devices) => gpus(devices),
            Err(reason) => {
                info!(%reason, "using the CPU backend");
                Ok(cpu(", CUDA unavailable"))
            }
        },
        BackendChoice::Cuda => gpus(hkv_shard::cuda::probe().context("--backend cuda")?),
    }
}

/// Runs the daemon until SIGTERM, SIGINT or a shutdown request; returns
/// after in-flight requests are answered.
pub fn run(mut config: Config) -> anyhow::Result<()> {
    config.check()?;
    if let Some(p) = config.checkpoint.backing_passwords.as_deref().filter(|p| !p.exists()) {
        tracing::warn!(
            "checkpoint.backing_passwords (--backing-passwords) {} does not exist (yet): a restore of a table whose \
             cluster asks for a password will need it",
            p.display()
        );
    }
    // Connections each take descriptors: as many as the limit allows.
    let open_files = server::raise_open_files();
    let fit = server::connections_for(open_files);
    if config.limits.max_connections > fit {
        warn!(
            open_files,
            configured = config.limits.max_connections,
            max_connections = fit,
            "limits.max_connections lowered to what the open-file limit (RLIMIT_NOFILE) allows, with {} descriptors \
             kept for checkpoints and {} per connection; raise the limit (LimitNOFILE=) for more",
            server::FD_RESERVE,
            server::fds_per_connection()
        );
        config.limits.max_connections = fit;
    }
    // Before anything is written: no file of the daemon is readable by others.
    let admin_gid =
        config.admin_group.as_deref().map(|g| admin::group_gid("admin_group (--admin-group)", g)).transpose()?;
    let modes = admin::Modes { gid: admin_gid };
    modes.apply_umask();
    modes.secure(&config.state_path())?;
    hkv_shard::cuda::set_cache_dir(config.kernel_cache_path());
    let (backend, ordinals, backend_name) = backend(&config)?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if matches!(backend, Backend::Cpu) && ordinals.len() >= cores {
        // The shards' actors already keep every core busy: a batch split
        // over the rayon pool inside a shard only adds its spinning workers.
        hkv_shard::cpu::set_parallel_batches(false);
    }
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 16);
    let system = actix_rt::System::with_tokio_rt(move || {
        tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build().expect("tokio runtime")
    });
    system.block_on(async move {
        let router = start_router(&config, backend, &ordinals).await?;
        // Who may connect: the client group where there is one, else the admins.
        let client_gid =
            config.client_group.as_deref().map(|g| admin::group_gid("client_group (--client-group)", g)).transpose()?;
        let (listener, socket_file) = listen(&config, client_gid.or(admin_gid))?;
        let checkpoints = Arc::new(crate::ckpt::Checkpoints::open(&config.state_path(), config.checkpoint.clone())?);
        let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self")?);
        let (shutdown, _) = tokio::sync::watch::channel(false);
        let state = Arc::new(State {
            router: Arc::new(router),
            config: config.clone(),
            started: Instant::now(),
            shutdown,
            uid,
            admin_gid,
            stats: Default::default(),
            backend: backend_name.clone(),
            checkpoints,
            memory: crate::memory::AddressSpace::of_process(),
            backing: crate::backing::Tiers::default(),
        });
        if let Some(limit) = state.memory.limit() {
            info!(
                limit,
                reserve = state.memory.reserve(),
                "the address space is limited (RLIMIT_AS): large bodies, answers and regions are checked against it"
            );
        }
        // Bound before a restore, which may take long: a taken address
        // stops the start at once.
        let metrics = match &config.metrics_listen {
            Some(addr) => {
                let addr: std::net::SocketAddr = addr.parse().with_context(|| format!("metrics_listen {addr:?}"))?;
                Some(stats::bind_metrics(addr).await?)
            }
            None => None,
        };
        let restored = match config.restore {
            config::Restore::Checkpoint(which) => restore_at_start(&state, which).await?,
            config::Restore::None => {
                state.checkpoints.keep_existing();
                Vec::new()
            }
        };
        open_tiers_at_start(&state, &restored).await?;
        state.checkpoints.retain().await;
        state.checkpoints.schedule(state.router.clone(), state.shutdown.subscribe());
        if let Some(listener) = metrics {
            let st = state.clone();
            tokio::spawn(async move {
                if let Err(e) = stats::http_listener(st, listener).await {
                    warn!(error = %e, "metrics listener stopped");
                }
            });
        }
        tokio::spawn(drain_on_signal(state.clone()));
        if config.mrc.enabled {
            tokio::spawn(crate::router::drain_samples(state.router.clone(), state.shutdown.subscribe()));
        }
        info!(
            socket = %socket_file.0.as_deref().map(|p| p.display().to_string()).unwrap_or_else(|| "inherited".into()),
            backend = %backend_name,
            tables = state.router.tables().len(),
            "hkvd ready"
        );
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        server::serve(state.clone(), listener).await;
        // HOOK(backing): every backed table's write-back queue drains
        // before exit (for up to drain_seconds); rows that could not reach
        // the cluster are named, at ERROR and in the exit status.
        // `--drain-seconds 0` waits for nothing (it waited 1 s).
        let mut failed = None;
        let drain = std::time::Duration::from_secs(config.limits.drain_seconds);
        if let Err(e) = state.backing.flush_all(drain).await {
            if e.replicas_only {
                error!(
                    error = %e.message,
                    "backing: queued write-back rows were NOT all acknowledged as the tables' wait_replicas asks \
                     within drain_seconds: their masters hold them, but fewer of the masters' replicas than asked \
                     do, so a master lost before its replicas get them loses them"
                );
            } else {
                error!(
                    error = %e.message,
                    "backing: queued write-back rows were NOT all acknowledged by the cluster within drain_seconds; \
                     those not acknowledged are lost with this exit (rows still in flight may have landed)"
                );
            }
            failed = Some(format!(
                "write-back rows were not all acknowledged by the cluster within {}s ({}); raise \
                 --drain-seconds or bring the cluster back before stopping",
                drain.as_secs(),
                e.message
            ));
        }
        // A final checkpoint that fails is the operator's data not saved:
        // said at ERROR and in the exit status, never a clean exit.
        if config.checkpoint.on_shutdown {
            info!("final checkpoint before exit");
            if let Err(e) = state.checkpoints.take(state.router.clone(), false).await {
                error!(
                    error = %e.message,
                    "the final checkpoint FAILED: writes since the last complete checkpoint are lost with this exit"
                );
                let what = format!(
                    "the final checkpoint (--checkpoint-on-shutdown) failed: {}; the tables' state since the \
                     last complete checkpoint (hkvctl checkpoints) was not saved",
                    e.message
                );
                failed = Some(failed.map_or(what.clone(), |f| format!("{f}; {what}")));
            }
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        drop(socket_file);
        info!(requests = state.stats.requests.load(std::sync::atomic::Ordering::Relaxed), "stopped");
        actix_rt::System::current().stop();
        match failed {
            None => Ok(()),
            Some(e) => anyhow::bail!("{e}"),
        }
    })
}

/// One actor of `threads` threads per device (or CPU shard). The actor
/// library panics when the system refuses a thread (too many shards and
/// threads for the process's limits): that is this start's clear error,
/// not a panic's message and backtrace.
fn start_actors(
    ordinals: &[usize],
    threads: usize,
) -> anyhow::Result<Vec<(actix::Addr<ShardActor>, crate::actor::Direct)>> {
    let total = ordinals.len() * threads;
    // Their stacks first, against the address space's limit: a thread
    // whose stack was mapped but whose signal stack then was not aborts
    // the process from inside the standard library (a tester's start
    // under `prlimit --as` ended so, with exit code 134, about once in
    // eight), where a refusal here is the same clear error every time.
    let space = crate::memory::AddressSpace::of_process();
    let need = total as u64 * thread_bytes();
    if !space.fits_mapped(need) {
        anyhow::bail!(
            "could not start the shards' {total} threads ({} shards x {threads}, --threads-per-shard): their \
             stacks need {need} bytes of address space{}; lower --shards or --threads-per-shard, or raise the \
             limit",
            ordinals.len(),
            space.describe()
        );
    }
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let started = std::panic::catch_unwind(|| {
        ordinals.iter().map(|&device| ShardActor::start(device, threads)).collect::<Vec<_>>()
    });
    std::panic::set_hook(hook);
    started.map_err(|p| {
        let why = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("a thread could not be started");
        let why = plain_os_error(why);
        anyhow::anyhow!(
            "could not start the shards' {} threads ({} shards x {threads}, --threads-per-shard): {why}; \
             lower --shards or --threads-per-shard, or raise the limits on this process's threads and memory",
            total,
            ordinals.len()
        )
    })
}

/// Address space a shard thread maps: its stack (the standard library's
/// 2 MiB, or `RUST_MIN_STACK`), and 64 KiB for its guard page and signal
/// stack.
fn thread_bytes() -> u64 {
    let stack = std::env::var("RUST_MIN_STACK").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(2 << 20);
    stack + (64 << 10)
}

/// `why` with the debug text of an OS error in it (`Os { code: 11, kind:
/// WouldBlock, message: "..." }`, what the thread library's panic holds)
/// written as the error displays itself: `Resource temporarily
/// unavailable (os error 11)`. Any other text is returned as it is.
fn plain_os_error(why: &str) -> String {
    const OS: &str = "Os { code: ";
    let Some(start) = why.find(OS) else { return why.to_string() };
    let rest = &why[start + OS.len()..];
    let code = rest.split(|c: char| !c.is_ascii_digit() && c != '-').next().and_then(|n| n.parse().ok());
    match (code, rest.find(" }")) {
        (Some(code), Some(end)) => {
            let tail = &rest[end + " }".len()..];
            format!("{}{}{tail}", &why[..start], std::io::Error::from_raw_os_error(code))
        }
        _ => why.to_string(),
    }
}

/// The shard actors (one per device or CPU shard), the memory budget, and
/// the router over them with the configured tables.
async fn start_router(config: &Config, backend: Backend, ordinals: &[usize]) -> anyhow::Result<Router> {
    let threads = config.threads_per_shard.max(1);
    let actors = start_actors(ordinals, threads)?;
    let hash_gpu = (backend == Backend::Cuda).then(|| ordinals[0]);
    let frame_cache = config.limits.frame_cache_bytes.unwrap_or(if backend == Backend::Cuda {
        frames::Frames::DEFAULT_TOTAL_CUDA
    } else {
        frames::Frames::DEFAULT_TOTAL
    });
    let budget = budget::Budget::new(
        backend,
        ordinals.to_vec(),
        config.limits.max_table_bytes.unwrap_or_else(|| budget::Budget::default_table_limit(backend, ordinals)),
        config.limits.max_host_tier_bytes.unwrap_or_else(budget::Budget::default_host_tier_limit),
    );
    let limits = budget.stats();
    info!(
        max_table_bytes = limits.max_table_bytes,
        max_host_tier_bytes = limits.max_host_tier_bytes,
        "table memory budget"
    );
    let mut router = Router::new(actors, backend, hash_gpu, frame_cache, budget, config.limits.max_frame_bytes);
    router.mrc = config.mrc.config();
    router.tuning = config.cuda_tuning;
    if backend == Backend::Cuda {
        router.ordinals = ordinals.to_vec();
    }
    for spec in &config.tables {
        let mut spec = spec.clone();
        if let Some(why) = router.unsupported(&spec) {
            warn!("{why}; made without it");
            spec.fast_tier_bytes = None;
        }
        router.create_table(spec.clone()).await.map_err(|e| {
            // Some refusals name the table already.
            let named = format!("table {:?}: ", spec.name);
            if e.message.starts_with(&named) {
                anyhow::anyhow!("{}", e.message)
            } else {
                anyhow::anyhow!("{named}{}", e.message)
            }
        })?;
    }
    Ok(router)
}

/// The listening socket: the one systemd passes (socket activation), else
/// the configured path, bound here.
fn listen(config: &Config, socket_gid: Option<u32>) -> anyhow::Result<(tokio::net::UnixListener, SocketFile)> {
    let mut fds = listenfd::ListenFd::from_env();
    Ok(match fds.take_unix_listener(0)? {
        Some(l) => {
            l.set_nonblocking(true)?;
            info!("using the socket passed by systemd");
            (tokio::net::UnixListener::from_std(l)?, SocketFile(None))
        }
        None => {
            let path = config.socket_path();
            (server::bind(&path, socket_gid)?, SocketFile(Some(path)))
        }
    })
}

/// Opens the clusters of the tables that name one, restored or declared
/// by the config file ([`crate::backing::Tiers::sync`]). A table the config
/// declares with a cluster that cannot be opened stops the start, naming
/// it, as `create_table` refuses one; a restored one waits for its
/// cluster, its requests refused meanwhile.
async fn open_tiers_at_start(state: &State, restored: &[String]) -> anyhow::Result<()> {
    // The restored backed tables serve once their rows are checked.
    let _release = state.router.release_unchecked_after();
    let failed = state.backing.sync(&state.router, restored).await;
    let declared = |name: &str| state.config.tables.iter().any(|s| s.name == name && s.backing.is_some());
    if let Some((name, why)) = failed.iter().find(|(n, _)| declared(n)) {
        anyhow::bail!(
            "table {name:?} of the config file: its cluster cannot be opened ({why}); hkvd did not start, so \
             that the table does not acknowledge writes its cluster never gets"
        );
    }
    crate::backing::Tiers::log_unopened(&failed);
    // Restored rows the cluster has since replaced or erased.
    state.backing.reconcile_restored(&state.router, restored).await;
    Ok(())
}

/// Restores `--restore` before serving; refuses to start rather than
/// silently serve without the data, and says how to start anyway (every
/// file stays on disk). Returns the tables restored.
async fn restore_at_start(state: &State, which: hkv_proto::CheckpointId) -> anyhow::Result<Vec<String>> {
    match state.checkpoints.restore(state.router.clone(), which, crate::ckpt::Occasion::Start).await {
        Ok(Some(r)) => {
            for s in &r.skipped {
                warn!("skipped an unusable checkpoint: {s}");
            }
            info!(id = %r.id, tables = ?r.tables, entries = r.entries, dropped = ?r.dropped, "restored");
            Ok(r.tables.into_iter().map(|(name, _)| name).collect())
        }
        Ok(None) => {
            // Nothing restorable, but checkpoints that could not be read
            // exist: serving empty tables now would pass for "no data"
            // (issue 32). Only the operator's --restore none does that.
            let aside = state.checkpoints.set_aside();
            if !aside.is_empty() {
                anyhow::bail!(
                    "restore {which}: no checkpoint can be restored, but {} checkpoint director{} could not be \
                     read and {} set aside (never deleted):\n  {}\n\
                     hkvd did not start, so that empty tables do not pass for the data in them. Each holds a \
                     checkpoint whose MANIFEST (or a file it names) is damaged (the WARN lines above say why). \
                     To get one back, repair its files (a MANIFEST can be restored from a backup of the \
                     catalog or the directory), rename it to chunks/<id> (the 16 hex digits before \
                     .damaged-), and start hkvd again. To start with empty tables and keep them on disk, \
                     use --restore none.",
                    aside.len(),
                    if aside.len() == 1 { "y" } else { "ies" },
                    if aside.len() == 1 { "was" } else { "were" },
                    aside.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join("\n  ")
                );
            }
            info!("no checkpoint to restore");
            Ok(Vec::new())
        }
        // An empty (or new) state directory: "every checkpoint is kept"
        // would speak of checkpoints that are not there.
        Err(_) if state.checkpoints.list().is_ok_and(|l| l.is_empty()) => anyhow::bail!(
            "restore {which}: there are no checkpoints in {} (is --state-dir the directory that holds them?); \
             hkvd did not start. To start with empty tables, use --restore none, or --restore latest, which \
             starts empty when there is no checkpoint.",
            state.config.state_path().join("checkpoints").display()
        ),
        Err(e) => anyhow::bail!(
            "restore {which}: {}\n\
             hkvd did not start, so that no checkpointed data is silently lost; every checkpoint is kept. \
             To start with empty tables and keep the checkpoints on disk, use --restore none \
             (hkvctl restore ID can try one later); to try one checkpoint, use --restore ID \
             (hkvctl checkpoints lists the ids of a running daemon's state directory).",
            e.message
        ),
    }
}

/// Starts draining on SIGTERM, SIGINT or SIGHUP. SIGUSR1 and SIGUSR2
/// (whose default action killed the daemon at once, with no drain and no
/// final checkpoint: an operator's log-reopen habit lost a table) are
/// logged and ignored, as is SIGXFSZ (a file-size limit reached), and so is each drain signal after the first, said
/// at WARN so that an operator waiting on a slow stop sees why.
async fn drain_on_signal(state: Arc<State>) {
    use tokio::signal::unix::{signal, SignalKind};
    let xfsz = SignalKind::from_raw(rustix::process::Signal::XFSZ.as_raw());
    let (Ok(mut term), Ok(mut int), Ok(mut hup), Ok(mut usr1), Ok(mut usr2), Ok(mut fsize)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
        signal(SignalKind::user_defined1()),
        signal(SignalKind::user_defined2()),
        signal(xfsz),
    ) else {
        warn!("cannot install signal handlers");
        return;
    };
    // SIGHUP (the terminal of a foreground daemon closed) drains as SIGTERM
    // does: its default action killed the daemon at once, with no drain and
    // no --checkpoint-on-shutdown checkpoint (a tester's finding).
    let mut draining = false;
    loop {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = hup.recv() => "SIGHUP",
            _ = usr1.recv() => {
                warn!("SIGUSR1 ignored: hkvd has no action for it (SIGTERM drains and exits; logs go to stderr, nothing to reopen)");
                continue;
            }
            _ = usr2.recv() => {
                warn!("SIGUSR2 ignored: hkvd has no action for it (SIGTERM drains and exits)");
                continue;
            }
            // Its default action killed the daemon at a checkpoint past a
            // file-size limit (`prlimit --fsize`, systemd's LimitFSIZE=),
            // with nothing logged and every table lost. Caught, the write
            // fails with EFBIG instead, and checkpoints pause as on a full
            // disk.
            _ = fsize.recv() => {
                warn!("SIGXFSZ: a write went past the process's file-size limit (RLIMIT_FSIZE: prlimit --fsize, systemd's LimitFSIZE=); it failed with EFBIG, and checkpoints pause as on a full disk until one fits");
                continue;
            }
        };
        if draining {
            warn!(
                "{name} ignored: already stopping (in-flight requests, then write-back queues, then the final \
                 checkpoint if asked, each bounded; see --drain-seconds); SIGKILL stops at once, losing what \
                 those steps would keep"
            );
            continue;
        }
        info!("{name}: draining");
        draining = true;
        let _ = state.shutdown.send(true);
    }
}
