//! # hkv-tui: `hkvd top`, the operator console
//!
//! Polls the daemon's stats over the socket a few times a second (on its own
//! thread, so a slow or dead daemon never blocks drawing) and shows, per
//! table and per shard, load factor gauges, hit rate, operations per second,
//! eviction and rejection rates as sparklines, bytes per memory tier, the
//! lock-group state, and the checkpoint status. Logs go to a file, never to
//! the screen it draws on.
//!
//! # Layout
//! - [`model`] reads the typed stats document (`hkv_proto::stats::Stats`;
//!   an answer that does not read is an error the console shows) and
//!   computes rates between polls.
//! - [`app`] holds the console state and handles keys.
//! - [`curve`] draws the selected table's miss-ratio curve.
//! - [`ui`] draws it (tested with ratatui's `TestBackend`).
//! - this file: [`run`], the terminal loop.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod app;
pub mod curve;
pub mod model;
pub mod ui;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use crossterm::event::{self, Event, KeyEventKind};

use crate::app::{Action, App};

/// How long the poller waits for an answer before it reports the daemon
/// down (at least four polls' intervals).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// What the poller thread reports.
enum Update {
    Stats(Box<hkv_client::proto::stats::Stats>),
    Down(String),
    CheckpointStarted(Result<(), String>),
}

/// Runs the console against the daemon at `socket` until the user quits.
pub fn run(socket: PathBuf, interval: Duration, log: Option<PathBuf>) -> anyhow::Result<()> {
    // ratatui::init panics without a terminal (hkvd top under a pipe, cron
    // or CI did): say so instead.
    anyhow::ensure!(
        std::io::stdin().is_terminal() && std::io::stdout().is_terminal(),
        "needs a terminal, and stdin or stdout is not one \
         (hkvctl stats, hkvctl stats --json and hkvctl metrics print the same figures)"
    );
    let mut logf = match &log {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("--log {}", p.display()))?,
        ),
        None => None,
    };
    let (tx, rx) = mpsc::channel::<Update>();
    let (cmd_tx, cmd_rx) = mpsc::channel::<()>();
    let sock = socket.clone();
    std::thread::Builder::new().name("hkvd-top-poll".into()).spawn(move || {
        let mut client: Option<hkv_client::Client> = None;
        loop {
            if client.is_none() {
                // A daemon that stops answering (stopped, wedged, or a
                // socket nobody serves) is reported down, not waited for.
                client = hkv_client::Client::connect(&sock)
                    .and_then(|mut c| c.set_timeout(Some(ANSWER_TIMEOUT.max(4 * interval))).map(|()| c))
                    .ok();
            }
            let update = match client.as_mut().map(|c| c.stats_doc()) {
                Some(Ok(v)) => Update::Stats(Box::new(v)),
                Some(Err(e)) => {
                    client = None;
                    Update::Down(e.to_string())
                }
                None => Update::Down(format!("cannot connect to {}", sock.display())),
            };
            if tx.send(update).is_err() {
                return;
            }
            while let Ok(()) = cmd_rx.try_recv() {
                let r = match client.as_mut() {
                    Some(c) => c.checkpoint(false, false).map(|_| ()).map_err(|e| e.to_string()),
                    None => Err("the daemon is down".into()),
                };
                if tx.send(Update::CheckpointStarted(r)).is_err() {
                    return;
                }
            }
            std::thread::sleep(interval);
        }
    })?;

    let mut terminal = ratatui::try_init().context("setting up the terminal")?;
    let mut app = App::new(socket.display().to_string());
    let result = (|| -> anyhow::Result<()> {
        let mut last_draw = Instant::now() - Duration::from_secs(1);
        loop {
            while let Ok(u) = rx.try_recv() {
                match u {
                    Update::Stats(v) => app.on_stats(&v, Instant::now()),
                    Update::Down(e) => app.on_down(e),
                    Update::CheckpointStarted(r) => app.on_checkpoint_started(r),
                }
                if let Some(f) = logf.as_mut() {
                    // Unix time in seconds (ms precision), then the status line.
                    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                    let _ = writeln!(f, "{:.3} {}", t.as_secs_f64(), app.status_line());
                }
            }
            if last_draw.elapsed() >= Duration::from_millis(100) || app.dirty {
                terminal.draw(|f| ui::draw(f, &app))?;
                app.dirty = false;
                last_draw = Instant::now();
            }
            if event::poll(Duration::from_millis(50))? {
                match event::read()? {
                    Event::Key(k) if k.kind == KeyEventKind::Press => match app.on_key(k) {
                        Action::Quit => return Ok(()),
                        Action::Checkpoint => {
                            let _ = cmd_tx.send(());
                        }
                        Action::None => {}
                    },
                    Event::Resize(..) => app.dirty = true,
                    _ => {}
                }
            }
        }
    })();
    ratatui::restore();
    result
}
