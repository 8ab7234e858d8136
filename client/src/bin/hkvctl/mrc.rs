//! `hkvctl mrc`: a table's live miss-ratio curve; `hkvctl trace`: its
//! sampled keys, for `hkv-sim --trace`.

use std::fmt::Write;

use anyhow::{bail, Result};
use hkv_client::proto::stats::{MrcStats, Stats, TableStats};
use hkv_client::proto::Policy;
use hkv_client::Client;

use crate::render;

/// `hkvctl mrc TABLE [--json]`.
pub fn mrc(c: &mut Client, table: &str, json: bool) -> Result<()> {
    let stats: Stats = render::doc(c.stats()?, "stats")?;
    let Some(t) = stats.tables.iter().find(|t| t.spec.name == table) else {
        bail!("no table named {table:?} (hkvctl tables lists them)");
    };
    let Some(m) = &t.mrc else {
        bail!("the daemon estimates no miss-ratio curves (started with --no-mrc, or [mrc] enabled = false)");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(m)?);
    } else {
        print!("{}", curve_table(table, t.spec.policy, m));
    }
    Ok(())
}

/// `hkvctl trace TABLE --seconds N --out FILE [--text]`.
pub fn trace(c: &mut Client, table: &str, seconds: u32, out: &std::path::Path, text: bool) -> Result<()> {
    use anyhow::Context;
    use std::io::Write;
    // The file is opened before the window, so that a path that cannot be
    // written fails now, not after `seconds` of collecting; it is emptied
    // only once the keys came (a failed trace leaves a file as it was).
    // An unknown table is refused before the file is touched or the
    // window announced.
    // A daemon without curves is refused here too, before the window is
    // announced (the progress line came before the daemon's refusal).
    let before = match table_stats(c, table)? {
        Some(t) => t,
        None => bail!("no table named {table:?}; create it first (hkvctl create-table)"),
    };
    // A table dropped (or dropped and made again) during the window is the
    // daemon's refusal (`unknown_table`, `bad_request`), never an empty trace.
    if before.mrc.is_none() {
        bail!(
            "the daemon samples no keys (started with --no-mrc, or [mrc] enabled = false): start it with the curves on"
        );
    }
    let spec = before.spec;
    let existed = out.exists();
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(out)
        .with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("collecting {table}'s sampled keys for {seconds} s ...");
    let started = std::time::Instant::now();
    let (keys, rate, truncated) = match c.trace(table, seconds) {
        Ok(got) => got,
        Err(e) => {
            if !existed {
                let _ = std::fs::remove_file(out);
            }
            return Err(e.into());
        }
    };
    // The answer does not say that the window was cut short (PROTOCOL.md:
    // the daemon collects for N seconds, less when it begins to drain),
    // but the daemon answers no sooner otherwise: an answer well before
    // the window's end is a drain's. A tester's trace of 5 s cut at 1 s
    // said "wrote 0 keys" and exited 0 as if the window had been whole.
    let took = started.elapsed().as_secs_f64();
    let cut_short = took + CUT_SHORT_SLACK_S < f64::from(seconds);
    if file.metadata().is_ok_and(|m| m.is_file()) {
        // (Not a pipe or a device such as /dev/stdout, which take no length.)
        file.set_len(0).with_context(|| format!("cannot write {}", out.display()))?;
    }
    let bytes: Vec<u8> = if text {
        keys.iter().map(|k| format!("{k}\n")).collect::<String>().into_bytes()
    } else {
        keys.iter().flat_map(|k| k.to_le_bytes()).collect()
    };
    file.write_all(&bytes).with_context(|| format!("cannot write {}", out.display()))?;
    println!(
        "wrote {} keys to {} ({}), sampled at rate {rate:.6}",
        keys.len(),
        out.display(),
        if text { "text" } else { "u64 LE" }
    );
    if cut_short {
        bail!(
            "the trace was cut short: the daemon began shutting down {took:.1} s into the {seconds} s window, so {} \
             holds the keys of those {took:.1} s only; trace again once the daemon is back",
            out.display()
        );
    }
    // The replay hint needs the table's capacity: a daemon that stopped
    // after answering the trace (a drain answers it early) leaves the
    // trace written and the hint out.
    let capacity = match stats_capacity(c, table) {
        Ok(c) => c,
        Err(e) => {
            println!("(no replay hint: the table's capacity could not be read: {e:#})");
            return Ok(());
        }
    };
    if keys.is_empty() {
        println!(
            "no sampled lookups of {table} during the window (the curves sample {:.4} % of keys): run the trace \
             longer, or while clients use the table",
            rate * 100.0
        );
        return Ok(());
    }
    if truncated {
        println!("truncated: the daemon left keys out to fit limits.max_frame_bytes; ask for fewer seconds");
    }
    // A spatial sample of rate r behaves as the whole stream in a cache r
    // times the size: replay it at capacity × rate, in whole 128-slot
    // buckets (hkv-sim rounds each capacity up to them) and, where that is
    // at least 1024 slots, in whole 1024s, so that 1/8x is whole buckets
    // too (a capacity of 1677 replayed its factors at 0.153 to 8.014).
    let exact = capacity as f64 * rate;
    let unit = if exact >= 1024.0 { 1024.0 } else { 128.0 };
    let scaled = ((exact / unit).round().max(1.0) * unit) as u64;
    // The table's bucket mode and, where hkv-sim replays it, its policy.
    let mut like = String::new();
    if spec.mode == hkv_client::proto::Mode::Dual {
        like += " --mode dual";
    }
    if matches!(spec.policy, Policy::Lfu | Policy::Adaptive) {
        like += &format!(" --policy {}", spec.policy.as_str());
    }
    if spec.policy == Policy::Lfu && spec.lfu_ties != hkv_client::proto::LfuTies::Lru {
        like += &format!(" --lfu-ties {}", spec.lfu_ties.as_str());
    }
    println!(
        "replay (a spatial sample: capacity {capacity} x rate): hkv-sim --trace {} --capacity {scaled} \
         --capacities 1/8x,1/4x,1/2x,1x,2x,4x,8x --batch 1{like}",
        out.display()
    );
    Ok(())
}

/// How much earlier than the window's end a trace's answer must come to
/// be a window cut short: the daemon's timer and the answer's way back
/// take milliseconds, a drain cuts at any moment.
const CUT_SHORT_SLACK_S: f64 = 0.25;

/// Table `table` as the stats document has it (none: no such table).
fn table_stats(c: &mut Client, table: &str) -> Result<Option<TableStats>> {
    let stats: Stats = render::doc(c.stats()?, "stats")?;
    Ok(stats.tables.into_iter().find(|t| t.spec.name == table))
}

/// The table's slots over all shards.
fn stats_capacity(c: &mut Client, table: &str) -> Result<u64> {
    let t = c.tables()?.into_iter().find(|t| t.spec.name == table);
    Ok(t.map(|t| t.capacity).unwrap_or(0))
}

/// The curve as a table: one line per capacity factor; the table's own
/// capacity (factor 1) is marked with its measured hit rate. The curve is
/// an LRU cache's whatever the table's `policy`; on a table of another
/// policy the header says so and the mark names the policy measured
/// (issue 32), so that the two figures are not read as one model's.
pub fn curve_table(table: &str, policy: Policy, m: &MrcStats) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{table}: {} lookups, {} sampled ({} keys tracked, rate {:.4} %, {} KiB)",
        m.accesses,
        m.sampled_accesses,
        m.tracked_keys,
        m.rate * 100.0,
        m.memory_bytes >> 10
    );
    if m.dropped > 0 {
        let _ = writeln!(
            o,
            "{} sampled keys dropped before the estimator (sampling fell behind): the curve is less exact",
            m.dropped
        );
    }
    if policy != Policy::Lru {
        let _ = writeln!(
            o,
            "estimates are an LRU cache's hit rates; this table evicts by {policy}, its measured hit rate is {policy}'s"
        );
    }
    // Below this many sampled lookups an estimate is noise (one sampled
    // miss of a new key reads as 0 %, one hit as 100 % at every size).
    if m.sampled_accesses < MIN_SAMPLED {
        let _ = writeln!(
            o,
            "too few sampled lookups for an estimate yet: {} of the {MIN_SAMPLED} needed (at rate {:.4} %, about {} \
             lookups)",
            m.sampled_accesses,
            m.rate * 100.0,
            (MIN_SAMPLED as f64 / m.rate.max(1e-9)).ceil() as u64
        );
        // No estimate to show: a header over no lines read as a broken table.
        return o;
    }
    let _ = writeln!(o, "{:>7} {:>12} {:>12}", "factor", "capacity", "LRU est. hit");
    for p in &m.points {
        let mark = match (p.factor == 1.0, m.measured_hit_rate) {
            (true, Some(h)) if policy == Policy::Lru => format!("  <- this table: measured {:.2} %", h * 100.0),
            (true, Some(h)) => format!("  <- this table ({policy}): measured {:.2} %", h * 100.0),
            (true, None) => "  <- this table (no lookups yet)".into(),
            _ => String::new(),
        };
        let _ = writeln!(
            o,
            "{:>7} {:>12} {:>12}{mark}",
            factor(p.factor),
            p.capacity,
            format!("{:.2}%", p.hit_rate * 100.0)
        );
    }
    o
}

/// The fewest sampled lookups whose curve `mrc` prints.
const MIN_SAMPLED: u64 = 100;

/// `1/8x` .. `8x`.
fn factor(f: f64) -> String {
    if f >= 1.0 {
        format!("{f}x")
    } else {
        format!("1/{}x", (1.0 / f).round())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hkv_client::proto::stats::MrcPoint;

    #[test]
    fn the_table_marks_the_current_capacity() {
        let points = [0.5, 1.0, 2.0]
            .iter()
            .map(|&factor| MrcPoint { factor, capacity: (1024.0 * factor) as u64, hit_rate: factor / 4.0 })
            .collect();
        let m = MrcStats {
            points,
            measured_hit_rate: Some(0.2512),
            accesses: 1000,
            sampled_accesses: 100,
            ..Default::default()
        };
        let s = curve_table("t", Policy::Lru, &m);
        assert!(s.contains("  1/2x          512       12.50%\n"), "{s}");
        assert!(s.contains("     1x         1024       25.00%  <- this table: measured 25.12 %\n"), "{s}");
        assert!(s.contains("LRU est. hit"), "{s}");
        assert!(!s.contains("evicts by") && !s.contains("dropped"), "{s}");
    }

    /// Issue 32: on an LFU table the LRU estimate stood next to the LFU
    /// table's measured hit rate with nothing saying they are two models.
    #[test]
    fn a_non_lru_table_says_the_curve_is_lru() {
        let points = vec![MrcPoint { factor: 1.0, capacity: 1024, hit_rate: 0.25 }];
        let m = MrcStats {
            points,
            measured_hit_rate: Some(0.3),
            accesses: 1000,
            sampled_accesses: 200,
            dropped: 4,
            ..Default::default()
        };
        let s = curve_table("t", Policy::Lfu, &m);
        assert!(s.contains("estimates are an LRU cache's hit rates; this table evicts by lfu"), "{s}");
        assert!(s.contains("<- this table (lfu): measured 30.00 %"), "{s}");
        assert!(s.contains("4 sampled keys dropped"), "{s}");
    }

    /// A tester's find: with one sampled lookup the curve read 100 % at
    /// every size; too few samples now print no estimate. Then a tester
    /// found the header of the curve's columns printed over no estimates:
    /// the message alone is printed.
    #[test]
    fn too_few_samples_print_no_estimate() {
        let points = vec![MrcPoint { factor: 1.0, capacity: 1024, hit_rate: 1.0 }];
        let m = MrcStats {
            points,
            measured_hit_rate: Some(0.0),
            accesses: 1,
            sampled_accesses: 1,
            rate: 0.03,
            ..Default::default()
        };
        let s = curve_table("t", Policy::Lru, &m);
        assert!(s.contains("too few sampled lookups for an estimate yet: 1 of the 100 needed"), "{s}");
        assert!(!s.contains("LRU est. hit") && !s.contains("1024"), "{s}");
        assert!(!s.contains("100.00%"), "{s}");
    }
}
