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
            // The daemon's refusal points to `hkvctl stats`, whose text has
            // no checkpoint line: `checkpoints` lists the running one.
            Err(e) if e.code() == Some(proto::ErrorCode::Busy) => bail!(
                "a checkpoint or restore is already running: `hkvctl checkpoints` shows its progress (--wait takes \
                 this one after it)"
            ),
            r => break r?,
        }
    };
    let started: Started = doc(started, "checkpoint")?;
    let id = (!started.id.is_empty()).then_some(started.id);
    if !wait {
        match &id {
            Some(id) => println!("checkpoint {id} started; `hkvctl checkpoints` shows its progress"),
            None => println!("checkpoint started; `hkvctl checkpoints` shows its progress"),
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
        let ours_running = ck.running.as_ref().is_some_and(|p| id.is_none_or(|id| p.id == id));
        let ours_last = ck.last.as_ref().is_some_and(|l| id.is_some_and(|id| l.id == id));
        if let (Some(id), false, false) = (id, ours_running, ours_last) {
            // Another checkpoint (the schedule's, another client's) ran
            // after ours between two polls: `last` is that one. Ours is
            // among the complete ones, or it failed (a tester's --wait
            // polled for good, 9 of 40 tries under --checkpoint-interval 1).
            if let Some(done) = listed(c, id)? {
                if tty {
                    eprintln!();
                }
                return done;
            }
        }
        if let Some(p) = &ck.running {
            if tty && ours_running {
                eprint!("\r{}\x1b[K", progress_line(p, columns()));
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

/// Checkpoint `id` as the listing has it, once it is neither running nor
/// the last to finish: `Some(Ok)` (said complete) when it is listed,
/// `Some(Err)` when it is not (it failed: a failed checkpoint leaves no
/// listing); `None` while it may still be running (the stats and the
/// listing were read at different moments: the listing is read again
/// after a running check).
fn listed(c: &mut Client, id: &str) -> Result<Option<Result<()>>> {
    let list: Vec<Listing> = doc(c.checkpoints()?, "list_checkpoints")?;
    if let Some(l) = list.iter().find(|l| l.id == id) {
        if l.status != "complete" {
            return Ok(Some(Err(anyhow::anyhow!("checkpoint {id} is listed as: {}", l.status))));
        }
        println!(
            "checkpoint {id} complete ({}): {} entries, {:.1} MB (another checkpoint finished since; `hkvctl \
             checkpoints` lists both)",
            l.kind,
            l.entries,
            l.bytes as f64 / 1e6
        );
        return Ok(Some(Ok(())));
    }
    // Not listed: still running (between the two reads), or failed.
    let st: Stats = doc(c.stats()?, "stats")?;
    if st.checkpoint.running.as_ref().is_some_and(|p| p.id == id) {
        return Ok(None);
    }
    let list: Vec<Listing> = doc(c.checkpoints()?, "list_checkpoints")?;
    if list.iter().any(|l| l.id == id) {
        return listed(c, id);
    }
    Ok(Some(Err(anyhow::anyhow!(
        "checkpoint {id} failed: it is no longer running and not among the checkpoints, and another finished \
         since (the daemon's log says why it failed; `hkvctl checkpoints` lists those kept)"
    ))))
}

/// The progress line of checkpoint `p` in at most `width` columns: the
/// id and counts first, then the bar, rate and ETA while they fit (a
/// line wider than the terminal wraps at each redraw instead of being
/// overwritten: a tester's 100-column pane filled with copies of it).
fn progress_line(p: &proto::stats::Progress, width: usize) -> String {
    let (done, total) = (p.entries_done, p.entries_total);
    let frac = if total > 0 { (done as f64 / total as f64).min(1.0) } else { 0.0 };
    let bar = |n: usize| {
        let k = (frac * n as f64) as usize;
        format!(" [{}{}]", "#".repeat(k), "-".repeat(n - k))
    };
    let mut line = format!("checkpoint {} {done}/{total} entries", p.id);
    if line.chars().count() > width {
        // Narrower than the essentials: the counts, else the percentage.
        let short = format!("{done}/{total} ({:.0}%)", frac * 100.0);
        let pct = format!("{:.0}%", frac * 100.0);
        return if short.chars().count() <= width { short } else { pct.chars().take(width).collect() };
    }
    for part in [
        format!(", {:.1} MB", p.bytes as f64 / 1e6),
        format!(", {:.0} MB/s", p.mb_per_s),
        format!(", ETA {:.0}s", p.eta_s),
        format!(", {:.0} entries/s", p.rate),
    ] {
        if line.chars().count() + part.chars().count() <= width {
            line.push_str(&part);
        }
    }
    // The bar after the id takes what room is left, up to 30 marks.
    let room = width.saturating_sub(line.chars().count() + 3).min(30);
    if room >= 5 {
        let at = line.find(' ').and_then(|i| line[i + 1..].find(' ').map(|j| i + 1 + j)).unwrap_or(line.len());
        line.insert_str(at, &bar(room));
    }
    line
}

/// The terminal's width in columns, from stderr (where the progress line
/// goes), else `$COLUMNS`, else 80; one less, so that the cursor never
/// reaches the last column (some terminals wrap there).
fn columns() -> usize {
    let cols = rustix::termios::tcgetwinsize(std::io::stderr())
        .ok()
        .map(|w| w.ws_col as usize)
        .filter(|&c| c > 0)
        .or_else(|| std::env::var("COLUMNS").ok()?.parse().ok())
        .unwrap_or(80);
    cols.saturating_sub(1).max(1)
}

/// `hkvctl checkpoints`: one line per checkpoint, the one being written first.
pub fn checkpoints(c: &mut Client) -> Result<()> {
    println!("{:<18} {:<20} {:<30} {:>12} {:>10}  status", "id", "created (UTC)", "kind", "entries", "MB");
    // The one being written is not in the store's list until it is
    // complete: its row comes from the stats.
    if let Some(p) = doc::<Stats>(c.stats()?, "stats")?.checkpoint.running {
        println!(
            "{:<18} {:<20} {:<30} {:>12} {:>10.1}  writing ({}/{} entries, ETA {:.0}s)",
            p.id,
            "-",
            p.kind,
            p.entries_done,
            p.bytes as f64 / 1e6,
            p.entries_done,
            p.entries_total,
            p.eta_s
        );
    }
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
                    let line = format!(
                        "restore {} {}: {}/{} entries, {:.1} MB, {:.0} MB/s",
                        p.id,
                        p.kind,
                        p.entries_done,
                        p.entries_total,
                        p.bytes as f64 / 1e6,
                        p.mb_per_s
                    );
                    // Cut to the terminal, so that each redraw overwrites the last.
                    eprint!("\r{}\x1b[K", line.chars().take(columns()).collect::<String>());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn running() -> proto::stats::Progress {
        proto::stats::Progress {
            id: "0000019ae1c2d3f4".into(),
            kind: "full".into(),
            entries_done: 1_250_000,
            entries_total: 5_000_000,
            bytes: 160_000_000,
            seconds: 2.0,
            rate: 625_000.0,
            eta_s: 6.0,
            mb_per_s: 80.0,
        }
    }

    #[test]
    fn the_progress_line_fits_the_terminal() {
        for width in [8, 20, 30, 45, 60, 79, 99, 200] {
            let line = progress_line(&running(), width);
            assert!(line.chars().count() <= width, "{width}: {line:?} is {} wide", line.chars().count());
            assert!(!line.is_empty());
        }
        // Wide: every field and the whole bar.
        let wide = progress_line(&running(), 200);
        assert!(wide.contains("[#######-----------------------]"), "{wide}");
        for part in ["1250000/5000000 entries", "160.0 MB", "80 MB/s", "ETA 6s", "625000 entries/s"] {
            assert!(wide.contains(part), "{part} not in {wide}");
        }
        // Narrow: the id and counts stay, the bar and rates go first.
        let narrow = progress_line(&running(), 60);
        assert!(narrow.starts_with("checkpoint 0000019ae1c2d3f4"), "{narrow}");
        assert!(narrow.contains("1250000/5000000"), "{narrow}");
        // Narrower than the essentials: the percentage.
        assert_eq!(progress_line(&running(), 30), "1250000/5000000 (25%)");
        assert_eq!(progress_line(&running(), 8), "25%");
    }
}
