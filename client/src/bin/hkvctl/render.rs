//! How answers are printed: values, found rows, times, the stats table.

use anyhow::{Context, Result};
use hkv_client::proto::stats::{ShardStats, Stats};

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

/// The table `hkvctl stats` prints.
pub fn stats_table(v: &Stats) -> String {
    let mut out = format!(
        "hkvd {}  backend {}  hashing on {}  up {:.0}s  connections {}  requests {}  errors {}\n",
        v.version, v.backend, v.feature_hashing, v.uptime_s, v.connections, v.requests, v.errors
    );
    out += &format!(
        "{:<20} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6} {:>8} {:>12} {:>12}\n",
        "table", "dim", "policy", "mode", "size", "capacity", "load", "hit %", "evictions", "rejections"
    );
    for t in &v.tables {
        let sum = |f: fn(&ShardStats) -> u64| t.shards.iter().map(f).sum::<u64>();
        let (hits, misses) = (sum(|s| s.hits), sum(|s| s.misses));
        let rate =
            if hits + misses > 0 { format!("{:.2}", 100.0 * hits as f64 / (hits + misses) as f64) } else { "-".into() };
        out += &format!(
            "{:<20} {:>5} {:<9} {:<6} {:>12} {:>12} {:>6.3} {:>8} {:>12} {:>12}\n",
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
    }
    out
}
