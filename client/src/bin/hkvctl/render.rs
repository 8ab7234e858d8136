//! How answers are printed: values, found rows, times, the stats table.

use anyhow::{Context, Result};
use hkv_client::proto::stats::{BackingStats, PathStats, ShardStats, Stats};

/// `YYYY-MM-DD HH:MM:SS` (UTC) of a Unix time in ms.
pub fn fmt_time(ms: u64) -> String {
    let s = ms / 1000;
    let (days, rem) = (s / 86400, s % 86400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// One line per label: `LABEL: V1,V2,...` or `LABEL: not found`.
pub fn print_found<L: std::fmt::Display>(labels: &[L], f: &hkv_client::Found) {
    let dim = if labels.is_empty() { 0 } else { f.values.len() / labels.len() };
    for (i, l) in labels.iter().enumerate() {
        if f.found[i] {
            println!("{l}: {}", fmt_values(&f.values[i * dim..(i + 1) * dim]));
        } else {
            println!("{l}: not found");
        }
    }
}

/// Values as `V1,V2,...`.
pub fn fmt_values(v: &[f32]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

/// A JSON answer read as its typed document (`proto::stats`).
pub fn doc<T: serde::de::DeserializeOwned>(v: serde_json::Value, what: &str) -> Result<T> {
    serde_json::from_value(v).with_context(|| format!("the daemon's {what} answer does not read"))
}

/// The width of a column of table names: 20, or the longest name's up to
/// 40, so that the columns after it line up (a longer name widens its own
/// row only, not every row).
pub fn name_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(|n| n.chars().count()).max().unwrap_or(0).clamp(20, 40)
}

/// The table `hkvctl stats` prints.
pub fn stats_table(v: &Stats) -> String {
    let w = name_width(v.tables.iter().map(|t| t.spec.name.as_str()));
    let mut out = format!(
        "hkvd {}  backend {}  hashing on {}  up {:.0}s  connections {}  requests {}  errors {}\n",
        v.version, v.backend, v.feature_hashing, v.uptime_s, v.connections, v.requests, v.errors
    );
    out += &format!(
        "{:<w$} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6} {:>8} {:>12} {:>12}\n",
        "table", "dim", "policy", "mode", "size", "capacity", "load", "hit %", "evictions", "rejections"
    );
    for t in &v.tables {
        let sum = |f: fn(&ShardStats) -> u64| t.shards.iter().map(f).sum::<u64>();
        let (hits, misses) = (sum(|s| s.hits), sum(|s| s.misses));
        let rate =
            if hits + misses > 0 { format!("{:.2}", 100.0 * hits as f64 / (hits + misses) as f64) } else { "-".into() };
        out += &format!(
            "{:<w$} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6.3} {:>8} {:>12} {:>12}\n",
            t.spec.name,
            t.spec.dim,
            t.spec.policy.as_str(),
            t.spec.mode.as_str(),
            t.size,
            t.capacity,
            t.load_factor,
            rate,
            sum(|s| s.evictions),
            sum(|s| s.rejections)
        );
        if let Some(b) = &t.backing {
            out += &backing_line(b);
        }
    }
    out += &path_line(&v.path);
    out
}

/// A backed table's line under its row: its cluster's part of the reads,
/// its write-back queue, its stream entries waiting and its failed
/// commands (`--json` has every field).
fn backing_line(b: &BackingStats) -> String {
    let mut line = format!(
        "  backing {}: filled {} (queued {})  absent {}  late {}  unavailable {}  written {}  fetch p99 {} us",
        b.mode, b.filled, b.filled_queued, b.absent, b.late, b.unavailable, b.rows_written, b.fetch_p99_us
    );
    if b.queue_limit_bytes > 0 {
        line += &format!(
            "; queue {} rows, {} of {} bytes, oldest {} ms, {} refused full",
            b.queue_rows, b.queue_bytes, b.queue_limit_bytes, b.queue_oldest_ms, b.queue_full
        );
    }
    if b.unpublished_entries > 0 || b.unpublished_resets > 0 {
        line += &format!(
            "; unpublished {} entries, {} bytes, {} resets",
            b.unpublished_entries, b.unpublished_bytes, b.unpublished_resets
        );
    }
    let errors: u64 = b.node_errors.values().sum();
    if errors > 0 {
        let nodes: Vec<String> = b.node_errors.iter().map(|(n, c)| format!("{n} {c}")).collect();
        line += &format!("; node errors {}", nodes.join(", "));
    }
    line + "\n"
}

/// Where requests' time went in the daemon (`stats.path`), as means in
/// microseconds: per request, then per shard call.
fn path_line(p: &PathStats) -> String {
    if p.requests == 0 {
        return String::new();
    }
    let us = |ns: u64, n: u64| ns as f64 / n.max(1) as f64 / 1e3;
    let r = p.requests;
    let mut line = format!(
        "request path, mean us over {r} requests: spawn {:.1}  handle {:.1}  write {:.1} (of it {:.1} behind other answers; {} answers queued)  \
         total {:.1}",
        us(p.spawn_ns, r),
        us(p.handle_ns, r),
        us(p.write_ns, r),
        us(p.queue_ns, r),
        p.queued,
        us(p.total_ns, r)
    );
    if p.event_waits > 0 {
        line += &format!("; {} CUDA event waits: mean {:.1}", p.event_waits, us(p.event_wait_ns, p.event_waits));
    }
    if p.shard_calls > 0 {
        let c = p.shard_calls;
        line += &format!(
            "; over {c} shard calls: mailbox {:.1}  shard {:.1}  wake {:.1}",
            us(p.mailbox_ns, c),
            us(p.shard_ns, c),
            us(p.wake_ns, c)
        );
    }
    line + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_table_name_widens_its_column() {
        assert_eq!(name_width(["t"].into_iter()), 20);
        assert_eq!(name_width(std::iter::empty()), 20);
        let long = "a_rather_long_table_name_for_embeddings";
        assert_eq!(name_width(["t", long].into_iter()), long.len());
    }

    /// `hkvctl stats` showed nothing of a table's cluster (its queue, its
    /// fills), only `--json` did, though the docs said it counts them.
    #[test]
    fn stats_table_shows_a_backed_table_s_cluster() {
        let mut s = Stats::default();
        let mut t = hkv_client::proto::stats::TableStats {
            spec: hkv_client::proto::TableSpec::new("emb", 4, 64),
            size: 0,
            capacity: 64,
            load_factor: 0.0,
            imbalance: 1.0,
            shards: Vec::new(),
            mrc: None,
            backing: None,
        };
        let mut b = BackingStats { mode: "write-back".into(), filled: 7, queue_rows: 3, ..Default::default() };
        b.queue_limit_bytes = 1024;
        b.node_errors.insert("127.0.0.1:7001".into(), 2);
        t.backing = Some(b);
        s.tables.push(t);
        let out = stats_table(&s);
        assert!(out.contains("backing write-back: filled 7"), "{out}");
        assert!(out.contains("queue 3 rows"), "{out}");
        assert!(out.contains("node errors 127.0.0.1:7001 2"), "{out}");
    }

    #[test]
    fn stats_table_shows_the_request_path_in_microseconds() {
        let mut s = Stats::default();
        assert!(!stats_table(&s).contains("request path"));
        s.path = PathStats {
            requests: 4,
            spawn_ns: 8_000,
            handle_ns: 400_000,
            write_ns: 20_000,
            queue_ns: 4_000,
            queued: 1,
            event_waits: 2,
            event_wait_ns: 50_000,
            total_ns: 428_000,
            shard_calls: 2,
            mailbox_ns: 10_000,
            shard_ns: 300_000,
            wake_ns: 6_000,
        };
        let t = stats_table(&s);
        assert!(
            t.contains("over 4 requests: spawn 2.0  handle 100.0  write 5.0 (of it 1.0 behind other answers; 1 answers queued)  total 107.0"),
            "{t}"
        );
        assert!(t.contains("2 CUDA event waits: mean 25.0"), "{t}");
        assert!(t.contains("over 2 shard calls: mailbox 5.0  shard 150.0  wake 3.0"), "{t}");
    }
}
