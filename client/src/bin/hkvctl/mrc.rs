//! `hkvctl mrc`: a table's live miss-ratio curve; `hkvctl trace`: its
//! sampled keys, for `hkv-sim --trace`.

use std::fmt::Write;

use anyhow::{bail, Result};
use hkv_client::proto::stats::{MrcStats, Stats};
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
        print!("{}", curve_table(table, m));
    }
    Ok(())
}

/// `hkvctl trace TABLE --seconds N --out FILE [--text]`.
pub fn trace(c: &mut Client, table: &str, seconds: u32, out: &std::path::Path, text: bool) -> Result<()> {
    use anyhow::Context;
    eprintln!("collecting {table}'s sampled keys for {seconds} s ...");
    let (keys, rate, truncated) = c.trace(table, seconds)?;
    let bytes: Vec<u8> = if text {
        keys.iter().map(|k| format!("{k}\n")).collect::<String>().into_bytes()
    } else {
        keys.iter().flat_map(|k| k.to_le_bytes()).collect()
    };
    std::fs::write(out, bytes).with_context(|| format!("cannot write {}", out.display()))?;
    let capacity = stats_capacity(c, table)?;
    println!(
        "wrote {} keys to {} ({}), sampled at rate {rate:.6}",
        keys.len(),
        out.display(),
        if text { "text" } else { "u64 LE" }
    );
    if keys.is_empty() {
        println!("no lookups or writes reached {table} during the window: run the trace while clients use the table");
        return Ok(());
    }
    if truncated {
        println!("truncated: the daemon left keys out to fit limits.max_frame_bytes; ask for fewer seconds");
    }
    // A spatial sample of rate r behaves as the whole stream in a cache r
    // times the size: replay it at capacity × rate.
    let scaled = ((capacity as f64 * rate).round() as u64).max(1);
    println!(
        "replay (a spatial sample: capacity {capacity} x rate): hkv-sim --trace {} --capacity {scaled} \
         --capacities 1/8x,1/4x,1/2x,1x,2x,4x,8x --batch 1",
        out.display()
    );
    Ok(())
}

/// The table's slots over all shards.
fn stats_capacity(c: &mut Client, table: &str) -> Result<u64> {
    let t = c.tables()?.into_iter().find(|t| t.spec.name == table);
    Ok(t.map(|t| t.capacity).unwrap_or(0))
}

/// The curve as a table: one line per capacity factor; the table's own
/// capacity (factor 1) is marked with its measured hit rate.
pub fn curve_table(table: &str, m: &MrcStats) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{table}: {} accesses, {} sampled ({} keys tracked, rate {:.4} %, {} KiB)",
        m.accesses,
        m.sampled_accesses,
        m.tracked_keys,
        m.rate * 100.0,
        m.memory_bytes >> 10
    );
    let _ = writeln!(o, "{:>7} {:>12} {:>10}", "factor", "capacity", "est. hit");
    for p in &m.points {
        let mark = match (p.factor == 1.0, m.measured_hit_rate) {
            (true, Some(h)) => format!("  <- this table: measured {:.2} %", h * 100.0),
            (true, None) => "  <- this table (no lookups yet)".into(),
            _ => String::new(),
        };
        let _ = writeln!(o, "{:>7} {:>12} {:>9.2}%{mark}", factor(p.factor), p.capacity, p.hit_rate * 100.0);
    }
    o
}

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
        let m = MrcStats { points, measured_hit_rate: Some(0.2512), accesses: 10, ..Default::default() };
        let s = curve_table("t", &m);
        assert!(s.contains("  1/2x          512     12.50%\n"), "{s}");
        assert!(s.contains("     1x         1024     25.00%  <- this table: measured 25.12 %\n"), "{s}");
    }
}
