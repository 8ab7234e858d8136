//! Checkpoint commands: `checkpoint` (with a progress bar under --wait),
//! `checkpoints`, `restore`.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};
use hkv_client::proto::stats::{Listing, Restored, Started, Stats};
use hkv_client::{proto, Client};

use crate::render::{doc, fmt_time};

/// `hkvctl checkpoint [--wait] [--full]`.
pub fn checkpoint(c: &mut Client, wait: bool, full: bool) -> Result<()> {
    let finished = |st: &Stats| st.checkpoint.last.as_ref().map(|l| l.finished_unix_ms);
    let before = finished(&doc(c.stats()?, "stats")?);
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
    let started: Started = doc(started, "checkpoint")?;
    let id = (!started.id.is_empty()).then_some(started.id);
    if !wait {
        match &id {
            Some(id) => println!("checkpoint {id} started; `hkvctl stats` shows its progress"),
            None => println!("checkpoint started; `hkvctl stats` shows its progress"),
        }
        return Ok(());
    }
    follow(c, id.as_deref(), before)
}

/// Shows the progress of checkpoint `id` (or, from a daemon that names
/// none, of the next one to finish after `before`) until it completes.
fn follow(c: &mut Client, id: Option<&str>, before: Option<u64>) -> Result<()> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let st: Stats = doc(c.stats()?, "stats")?;
        let ck = &st.checkpoint;
        if let Some(p) = &ck.running {
            let (done, total) = (p.entries_done, p.entries_total);
            let frac = if total > 0 { (done as f64 / total as f64).min(1.0) } else { 0.0 };
            let bar = "#".repeat((frac * 30.0) as usize) + &"-".repeat(30 - (frac * 30.0) as usize);
            let line = format!(
                "checkpoint {} [{bar}] {done}/{total} entries, {:.1} MB, {:.0} MB/s, {:.0} entries/s, ETA {:.0}s",
                p.id,
                p.bytes as f64 / 1e6,
                p.mb_per_s,
                p.rate,
                p.eta_s
            );
            if tty {
                eprint!("\r{line}");
            }
        } else if let Some(l) = ck.last.as_ref().filter(|l| match &id {
            Some(id) => l.id == *id,
            None => Some(l.finished_unix_ms) != before,
        }) {
            if tty {
                eprintln!();
            }
            if let Some(e) = &l.error {
                bail!("checkpoint failed: {e}");
            }
            let (mb, secs) = (l.bytes as f64 / 1e6, l.seconds);
            println!(
                "checkpoint {} complete ({}): {} entries, {mb:.1} MB in {secs:.2}s ({:.0} MB/s)",
                l.id,
                l.kind,
                l.entries,
                mb / secs.max(1e-9)
            );
            break;
        }
    }
    Ok(())
}

/// `hkvctl checkpoints`: one line per checkpoint.
pub fn checkpoints(c: &mut Client) -> Result<()> {
    println!("{:<18} {:<20} {:<30} {:>12} {:>10}  status", "id", "created (UTC)", "kind", "entries", "MB");
    for l in doc::<Vec<Listing>>(c.checkpoints()?, "list_checkpoints")? {
        println!(
            "{:<18} {:<20} {:<30} {:>12} {:>10.1}  {}",
            l.id,
            fmt_time(l.created_unix_ms),
            l.kind,
            l.entries,
            l.bytes as f64 / 1e6,
            l.status
        );
    }
    Ok(())
}

/// After `drop-table NAME`: when the newest complete checkpoint holds the
/// table, a start (which restores it) brings the table back; says so.
pub fn note_drop_undone_at_start(c: &mut Client, name: &str) {
    let Ok(list) = c.checkpoints().map_err(anyhow::Error::from).and_then(|v| doc::<Vec<Listing>>(v, "checkpoints"))
    else {
        return;
    };
    if let Some(l) = list.iter().find(|l| l.status == "complete") {
        if l.tables.iter().any(|(t, _)| t == name) {
            println!(
                "note: checkpoint {} ({}) holds {name}: a daemon start restores it and brings {name} back; take \
                 a checkpoint (hkvctl checkpoint) to keep it dropped",
                l.id,
                fmt_time(l.created_unix_ms)
            );
        }
    }
}

/// `hkvctl restore ID`; a second connection shows its progress on a terminal.
pub fn restore(c: &mut Client, socket: &Path, id: proto::CheckpointId) -> Result<()> {
    // The restore answers when done; a second connection shows its progress meanwhile.
    let socket = socket.to_path_buf();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
        let done = done.clone();
        std::thread::spawn(move || {
            let Ok(mut w) = Client::connect(&socket) else { return };
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let Ok(st) = w.stats().map_err(anyhow::Error::from).and_then(|v| doc::<Stats>(v, "stats")) else {
                    return;
                };
                if let Some(p) = &st.checkpoint.restoring {
                    eprint!(
                        "\rrestore {} {}: {}/{} entries, {:.1} MB, {:.0} MB/s   ",
                        p.id,
                        p.kind,
                        p.entries_done,
                        p.entries_total,
                        p.bytes as f64 / 1e6,
                        p.mb_per_s
                    );
                }
            }
        })
    });
    let r = c.restore(id);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(w) = watcher {
        let _ = w.join();
        eprintln!();
    }
    let r: Restored = doc(r?, "restore")?;
    for s in &r.skipped {
        eprintln!("hkvctl: warning: skipped {s}");
    }
    for (table, n) in &r.dropped {
        if *n > 0 {
            // The name as JSON text (quoted), as this line has always shown it.
            let table = serde_json::Value::from(table.as_str());
            eprintln!("hkvctl: warning: table {table} could not place {n} entries of the checkpoint");
        }
    }
    let tables: Vec<String> = r.tables.iter().map(|(t, n)| format!("{t} ({n} entries)")).collect();
    println!(
        "restored checkpoint {} in {:.2}s ({:.0} MB/s): {} entries; tables: {}",
        r.id,
        r.seconds,
        r.mb_per_s,
        r.entries,
        if tables.is_empty() { "none".to_string() } else { tables.join(", ") }
    );
    Ok(())
}
