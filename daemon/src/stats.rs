//! Statistics: one JSON document (the `stats` request) and its Prometheus
//! rendering (`metrics`, and the optional loopback HTTP listener).

use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

use hkv_proto::TableSpec;
use hkv_shard::{Group, Op, ShardStats};
use serde::{Deserialize, Serialize};

use crate::server::State;

/// Everything the daemon reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DaemonStats {
    /// Crate version.
    pub version: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Backend in words.
    pub backend: String,
    /// Shard actors (devices or CPU shards).
    pub shards: usize,
    /// Where feature requests are hashed: "CPU" or "GPU 0 (name)".
    #[serde(default)]
    pub feature_hashing: String,
    /// Connections open now.
    pub connections: usize,
    /// Requests answered since start.
    pub requests: u64,
    /// Error responses since start.
    pub errors: u64,
    /// Requests running now.
    pub in_flight: usize,
    /// Per table.
    pub tables: Vec<TableStats>,
    /// Names of the operations, in the order of each shard's `ops` and `keys`.
    pub op_names: Vec<String>,
    /// Checkpoint status.
    pub checkpoint: crate::ckpt::CheckpointStats,
    /// Memory limits and what is held of them.
    #[serde(default)]
    pub memory: MemoryStats,
    /// Registered regions (memfds mapped for clients).
    #[serde(default)]
    pub regions: crate::region::RegionStats,
}

/// The memory budget and the request bytes in flight.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct MemoryStats {
    /// `limits.max_table_bytes` in force: device memory on CUDA, host memory on CPU.
    pub max_table_bytes: u64,
    /// Bytes of it granted to tables (each table's peak footprint).
    pub table_bytes: u64,
    /// `limits.max_host_tier_bytes` in force (CUDA; 0 on the CPU backend).
    pub max_host_tier_bytes: u64,
    /// Bytes of it granted to tables.
    pub host_tier_bytes: u64,
    /// Bytes of requests being received or run and of answers being built or sent.
    pub bytes_in_flight: u64,
    /// Requests refused because `limits.max_bytes_in_flight` was reached.
    pub in_flight_refusals: u64,
    /// Of `bytes_in_flight`, those of bodies over 64 KiB still arriving (at
    /// most 3/4 of `limits.max_bytes_in_flight`).
    #[serde(default)]
    pub receiving_bytes: u64,
}

/// One table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableStats {
    /// As created.
    pub spec: TableSpec,
    /// Entries over all shards.
    pub size: u64,
    /// Slots over all shards.
    pub capacity: u64,
    /// size / capacity.
    pub load_factor: f64,
    /// Largest shard size over the mean (1.0 = perfectly even).
    pub imbalance: f64,
    /// Per shard.
    pub shards: Vec<ShardStats>,
}

/// Collects the current statistics.
pub fn collect(state: &State) -> DaemonStats {
    let tables = state
        .router
        .tables()
        .iter()
        .map(|t| {
            let shards: Vec<ShardStats> = t.shards.iter().map(|s| s.stats()).collect();
            let size: u64 = shards.iter().map(|s| s.size).sum();
            let capacity: u64 = shards.iter().map(|s| s.capacity).sum();
            let mean = size as f64 / shards.len().max(1) as f64;
            let max = shards.iter().map(|s| s.size).max().unwrap_or(0) as f64;
            TableStats {
                spec: t.spec.clone(),
                size,
                capacity,
                load_factor: size as f64 / capacity.max(1) as f64,
                imbalance: if mean > 0.0 { max / mean } else { 1.0 },
                shards,
            }
        })
        .collect();
    let s = &state.stats;
    DaemonStats {
        version: env!("CARGO_PKG_VERSION").into(),
        uptime_s: state.started.elapsed().as_secs_f64(),
        backend: state.backend.clone(),
        shards: state.router.shards(),
        feature_hashing: state.router.hasher.place.clone(),
        connections: s.connections.load(Relaxed),
        requests: s.requests.load(Relaxed),
        errors: s.errors.load(Relaxed),
        in_flight: s.in_flight.load(Relaxed),
        tables,
        op_names: Op::ALL.iter().map(|o| o.name().to_string()).collect(),
        checkpoint: state.checkpoints.stats(),
        memory: {
            let b = state.router.budget.stats();
            MemoryStats {
                max_table_bytes: b.max_table_bytes,
                table_bytes: b.table_bytes,
                max_host_tier_bytes: b.max_host_tier_bytes,
                host_tier_bytes: b.host_tier_bytes,
                bytes_in_flight: s.in_flight_bytes.load(Relaxed),
                in_flight_refusals: s.in_flight_refusals.load(Relaxed),
                receiving_bytes: s.receiving_bytes.load(Relaxed),
            }
        },
        regions: crate::region::stats(state),
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP hkvd_{name} {help}\n# TYPE hkvd_{name} {kind}");
}

/// Prometheus text exposition of the statistics.
pub fn prometheus(d: &DaemonStats) -> String {
    let mut o = String::new();
    family(&mut o, "up", "gauge", "1 while the daemon serves.");
    let _ = writeln!(o, "hkvd_up 1");
    family(&mut o, "uptime_seconds", "gauge", "Seconds since start.");
    let _ = writeln!(o, "hkvd_uptime_seconds {:.3}", d.uptime_s);
    family(&mut o, "connections", "gauge", "Open client connections.");
    let _ = writeln!(o, "hkvd_connections {}", d.connections);
    family(&mut o, "requests_total", "counter", "Requests answered.");
    let _ = writeln!(o, "hkvd_requests_total {}", d.requests);
    family(&mut o, "errors_total", "counter", "Error responses sent.");
    let _ = writeln!(o, "hkvd_errors_total {}", d.errors);
    let m = &d.memory;
    family(&mut o, "table_budget_bytes", "gauge", "limits.max_table_bytes: memory all tables may hold at their peak.");
    let _ = writeln!(o, "hkvd_table_budget_bytes {}", m.max_table_bytes);
    family(&mut o, "table_granted_bytes", "gauge", "Bytes of the table budget granted to tables.");
    let _ = writeln!(o, "hkvd_table_granted_bytes {}", m.table_bytes);
    family(
        &mut o,
        "bytes_in_flight",
        "gauge",
        "Bytes of requests being received or run and answers being built or sent.",
    );
    let _ = writeln!(o, "hkvd_bytes_in_flight {}", m.bytes_in_flight);
    family(&mut o, "regions", "gauge", "Registered regions (client memfds) mapped.");
    let _ = writeln!(o, "hkvd_regions {}", d.regions.regions);
    family(&mut o, "region_bytes", "gauge", "Bytes of registered regions mapped.");
    let _ = writeln!(o, "hkvd_region_bytes {}", d.regions.bytes);
    type Get = fn(&ShardStats) -> f64;
    let gauges: [(&str, &str, &str, Get); 10] = [
        ("size", "gauge", "Entries stored.", |s| s.size as f64),
        ("capacity", "gauge", "Slots.", |s| s.capacity as f64),
        ("load_factor", "gauge", "Size over capacity.", |s| s.load_factor),
        ("hits_total", "counter", "Lookups that found their key.", |s| s.hits as f64),
        ("misses_total", "counter", "Lookups that did not.", |s| s.misses as f64),
        ("inserts_total", "counter", "Keys placed in a free slot.", |s| s.inserts as f64),
        ("evictions_total", "counter", "Entries evicted for a newcomer.", |s| s.evictions as f64),
        ("rejections_total", "counter", "Newcomers refused by admission control.", |s| s.rejections as f64),
        ("fast_tier_bytes", "gauge", "Value bytes in device memory.", |s| s.fast_tier_bytes as f64),
        ("host_tier_bytes", "gauge", "Value bytes in host memory.", |s| s.host_tier_bytes as f64),
    ];
    for (name, kind, help, get) in gauges {
        family(&mut o, name, kind, help);
        for t in &d.tables {
            for (i, s) in t.shards.iter().enumerate() {
                let _ = writeln!(o, "hkvd_{name}{{table=\"{}\",shard=\"{i}\"}} {}", t.spec.name, get(s));
            }
        }
    }
    family(&mut o, "ops_total", "counter", "Batches per operation.");
    family(&mut o, "keys_total", "counter", "Keys per operation.");
    for t in &d.tables {
        for (i, s) in t.shards.iter().enumerate() {
            for (k, op) in d.op_names.iter().enumerate() {
                let l = format!("{{table=\"{}\",shard=\"{i}\",op=\"{op}\"}}", t.spec.name);
                let _ = writeln!(o, "hkvd_ops_total{l} {}", s.ops.get(k).unwrap_or(&0));
                let _ = writeln!(o, "hkvd_keys_total{l} {}", s.keys.get(k).unwrap_or(&0));
            }
        }
    }
    family(&mut o, "lock_running", "gauge", "Operations running per lock group.");
    family(&mut o, "lock_waiting", "gauge", "Operations waiting per lock group.");
    family(&mut o, "lock_waits_total", "counter", "Acquisitions that waited, per lock group.");
    for t in &d.tables {
        for (i, s) in t.shards.iter().enumerate() {
            for g in Group::ALL {
                let gi = g as usize;
                let name = ["reader", "updater", "inserter"][gi];
                let l = format!("{{table=\"{}\",shard=\"{i}\",group=\"{name}\"}}", t.spec.name);
                let _ = writeln!(o, "hkvd_lock_running{l} {}", s.lock.running[gi]);
                let _ = writeln!(o, "hkvd_lock_waiting{l} {}", s.lock.waiting[gi]);
                let _ = writeln!(o, "hkvd_lock_waits_total{l} {}", s.lock.waits[gi]);
            }
        }
    }
    o
}

/// Serves `GET /metrics` on a loopback TCP address until shutdown.
pub async fn http_listener(state: std::sync::Arc<State>, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if !addr.ip().is_loopback() {
        anyhow::bail!("metrics_listen {addr} is not a loopback address; hkvd serves metrics on loopback only");
    }
    let l = tokio::net::TcpListener::bind(addr).await?;
    let mut stop = state.shutdown.subscribe();
    loop {
        let (mut s, _) = tokio::select! {
            r = l.accept() => r?,
            _ = stop.changed() => return Ok(()),
        };
        let st = state.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap_or(0);
            let ok = buf[..n].starts_with(b"GET /metrics");
            let (status, body) = if ok {
                ("200 OK", prometheus(&collect(&st)))
            } else {
                ("404 Not Found", "try GET /metrics\n".to_string())
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
        });
    }
}
