//! hkvctl: the command-line client of hkvd.
//!
//! # Layout
//! - [`cmd`]: the command line ([`cmd::Cli`], [`cmd::Cmd`]).
//! - [`tables`]: create-table, drop-table, tables.
//! - [`entries`]: put, get, fill, erase.
//! - [`features`]: hash, find-features, find-or-insert-features; the hash
//!   flags, `--from` input and the answer lines.
//! - [`checkpoint`]: checkpoint, checkpoints, restore.
//! - [`frame`]: requests too large for the daemon, refused before they are
//!   built.
//! - [`mrc`]: mrc (a table's miss-ratio curve), trace (its sampled keys).
//! - [`render`]: printing values, times and the stats table.
//! - [`bench`]: `hkvctl bench`.
//! - this file: dispatch, `top`, exit codes.

#![forbid(unsafe_code)]

mod bench;
mod checkpoint;
mod cmd;
mod entries;
mod features;
mod frame;
mod mrc;
mod render;
mod tables;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use hkv_client::{proto, Client, ClientError};

use crate::cmd::{Cli, Cmd};

/// `hkvctl top`: runs `hkvd top` (beside hkvctl, else from PATH).
fn top(socket: &Path, args: &[String]) -> Result<()> {
    let beside = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.join("hkvd"))).filter(|p| p.exists());
    let hkvd = beside.unwrap_or_else(|| PathBuf::from("hkvd"));
    let status = std::process::Command::new(&hkvd)
        .arg("top")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .status()
        .with_context(|| format!("cannot run {}", hkvd.display()))?;
    if !status.success() {
        bail!("hkvd top exited with {status}");
    }
    Ok(())
}

/// Seconds hkvctl waits for an answer unless told (`--timeout`).
const DEFAULT_TIMEOUT_S: f64 = 60.0;

fn run(cli: Cli) -> Result<()> {
    let socket = cli.socket.clone().unwrap_or_else(|| {
        let runtime_dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
        // An empty HKVD_SOCKET is unset, as `hkvd serve` takes it (hkvctl
        // tried to connect to "" and failed with "Invalid argument").
        let named = std::env::var_os("HKVD_SOCKET").filter(|s| !s.is_empty());
        proto::client_socket_path(named.map(Into::into), runtime_dir.as_deref())
    });
    let cmd = match cli.cmd {
        Cmd::Bench(a) => return bench::bench(socket, a),
        Cmd::Top { args } => return top(&socket, &args),
        cmd => cmd,
    };
    let c = &mut Client::connect(&socket)?;
    // A daemon that stops answering (stopped with SIGSTOP, wedged) ends
    // the command with an error instead of a wait without end; commands
    // whose answer comes when long work is done wait as long as it takes
    // (the list `--timeout`'s help and cli.md give: keep them the same).
    let waits_for_work = matches!(
        cmd,
        Cmd::Restore { .. }
            | Cmd::Trace { .. }
            | Cmd::Flush { .. }
            | Cmd::Clear { .. }
            | Cmd::DropTable { .. }
            | Cmd::Shutdown
    );
    let timeout = cli.timeout.unwrap_or(if waits_for_work { 0.0 } else { DEFAULT_TIMEOUT_S });
    c.set_timeout(Some(std::time::Duration::from_secs_f64(timeout)))?;
    match cmd {
        Cmd::Ping => {
            let t = Instant::now();
            c.ping()?;
            println!("hkvd at {} answered in {:.3} ms", socket.display(), t.elapsed().as_secs_f64() * 1e3);
        }
        Cmd::CreateTable(a) => tables::create(c, a)?,
        Cmd::DropTable { name } => {
            c.drop_table(&name)?;
            println!("dropped {name}");
            checkpoint::note_drop_undone_at_start(c, &name);
        }
        Cmd::Clear { table } => {
            c.clear(&table)?;
            println!("cleared {table}");
        }
        Cmd::Flush { table } => {
            c.flush(&table)?;
            println!("flushed {table}");
        }
        Cmd::Tables { json } => tables::list(c, json)?,
        Cmd::Put { table, entries, scores } => entries::put(c, &table, &entries, scores)?,
        Cmd::Get { table, keys } => entries::get(c, &table, &keys)?,
        Cmd::Hash { features, input, hash, table } => features::hash(c, features, &input, &hash, table)?,
        Cmd::FindFeatures { table, features, input, hash } => {
            features::find_features(c, &table, features, &input, &hash)?
        }
        Cmd::FindOrInsertFeatures { table, entries, input, hash, scores } => {
            features::find_or_insert_features(c, &table, entries, &input, &hash, scores)?
        }
        Cmd::Fill { table, count, start, batch } => entries::fill(c, &table, count, start, batch)?,
        Cmd::Erase { table, keys } => entries::erase(c, &table, &keys)?,
        Cmd::Stats { json } => {
            let v = c.stats()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", render::stats_table(&render::doc(v, "stats")?));
            }
        }
        Cmd::Mrc { table, json } => mrc::mrc(c, &table, json)?,
        Cmd::Trace { table, seconds, out, text } => mrc::trace(c, &table, seconds, &out, text)?,
        Cmd::Metrics => print!("{}", c.metrics()?),
        Cmd::Checkpoint { wait, full } => checkpoint::checkpoint(c, wait, full)?,
        Cmd::Checkpoints => checkpoint::checkpoints(c)?,
        Cmd::Restore { id } => checkpoint::restore(c, &socket, id)?,
        Cmd::Shutdown => {
            c.shutdown()?;
            // Answered as the drain begins: the daemon's exit status and
            // any rows it could not drain are in its log (cli.md).
            println!("hkvd is draining and will exit (its log says how the drain ended)");
        }
        Cmd::Bench(_) | Cmd::Top { .. } => unreachable!("handled before connecting"),
    }
    Ok(())
}

/// A reader that goes away (`hkvctl metrics | head -1`) ends hkvctl
/// quietly with status 141 (128 + SIGPIPE, what a shell reports for other
/// tools killed by it), instead of the panic of `println!` on a closed
/// pipe.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
        if msg.is_some_and(|m| m.contains("Broken pipe")) {
            std::process::exit(141);
        }
        default(info)
    }));
}

/// What a wait that ran out of time adds to its error: the `--timeout`
/// it ran under and how to wait longer (the error named neither).
fn timeout_hint(e: &anyhow::Error, timeout: Option<f64>) -> Option<String> {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    let Some(ClientError::Io { cause, .. }) = e.downcast_ref::<ClientError>() else { return None };
    if !matches!(cause.kind(), WouldBlock | TimedOut) {
        return None;
    }
    Some(match timeout {
        Some(t) => format!("hkvctl waits --timeout {t} s for each answer: raise it, or give 0 to wait forever"),
        None => format!(
            "hkvctl waits {DEFAULT_TIMEOUT_S} s (the default --timeout) for each answer: raise --timeout, or \
             give 0 to wait forever"
        ),
    })
}

/// Whether `e` is a write to a reader that went away (`hkvctl bench |
/// head -1`): a command that writes its lines through `Result`s rather
/// than `println!` (bench, which drops its table first) ends with it.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))
}

fn main() -> ExitCode {
    quiet_on_broken_pipe();
    let cli = Cli::parse();
    if let Cmd::CreateTable(a) = &cli.cmd {
        if let Some(flag) = a.without_backing() {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            cmd.build();
            let sub = cmd.find_subcommand_mut("create-table").expect("create-table is a command");
            sub.error(
                clap::error::ErrorKind::MissingRequiredArgument,
                format!("{flag} needs --backing (the seed nodes of the table's Redis Cluster)"),
            )
            .exit();
        }
    }
    let timeout = cli.timeout;
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if broken_pipe(&e) => ExitCode::from(141),
        Err(e) => {
            match timeout_hint(&e, timeout) {
                Some(hint) => eprintln!("hkvctl: {e:#}; {hint}"),
                None => eprintln!("hkvctl: {e:#}"),
            }
            match e.downcast_ref::<ClientError>() {
                Some(ClientError::Io { .. }) => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}
