//! Statistics: one JSON document (the `stats` request) and its Prometheus
//! rendering (`metrics`, and the optional loopback HTTP listener).

use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

use hkv_proto::stats::{LockGroup, LockStats};
pub use hkv_proto::stats::{MemoryStats, ShardStats, Stats as DaemonStats, TableStats};
use hkv_shard::{Group, Op};

use crate::state::State;

/// A shard's counters as the stats document carries them (destructured
/// whole, so that a counter added to the shard is not silently left out).
fn shard_stats(s: hkv_shard::ShardStats) -> ShardStats {
    let hkv_shard::ShardStats {
        size,
        capacity,
        load_factor,
        ops,
        keys,
        hits,
        misses,
        inserts,
        evictions,
        rejections,
        fast_tier_bytes,
        host_tier_bytes,
        lock,
    } = s;
    let hkv_shard::LockState { active, running, waiting, waits, wait_ns, max_running, violations } = lock;
    let active = active.map(|g| match g {
        Group::Reader => LockGroup::Reader,
        Group::Updater => LockGroup::Updater,
        Group::Inserter => LockGroup::Inserter,
    });
    ShardStats {
        size,
        capacity,
        load_factor,
        ops,
        keys,
        hits,
        misses,
        inserts,
        evictions,
        rejections,
        fast_tier_bytes,
        host_tier_bytes,
        lock: LockStats { active, running, waiting, waits, wait_ns, max_running, violations },
    }
}

/// The op label of the export batches checkpoints take (`op_names`' last).
pub const CHECKPOINT_OP: &str = "checkpoint";

/// `shards` of `t` as reported: checkpoints' export batches moved from
/// `op="export"` to [`CHECKPOINT_OP`] (appended to `ops` and `keys`), and
/// the counters, the curve's (`mrc`) too, carried across restores
/// ([`crate::carried::Carried`]).
fn reported(
    state: &State,
    t: &crate::router::Table,
    shards: Vec<ShardStats>,
    mrc: Option<&mut hkv_proto::stats::MrcStats>,
) -> Vec<ShardStats> {
    let export = Op::ALL.iter().position(|&o| o == Op::Export);
    let mut cur: Vec<ShardStats> = shards
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            // Read after the shard's counters: a batch a checkpoint is
            // taking may be counted here and not there yet, never the
            // other way round (`Checkpoints::count_export`).
            let [batches, keys] = state.checkpoints.exports(t.id(), i);
            if let Some(e) = export {
                for (v, n) in [(&mut s.ops, batches), (&mut s.keys, keys)] {
                    if let Some(x) = v.get_mut(e) {
                        *x = x.saturating_sub(n);
                    }
                }
            }
            s.ops.push(batches);
            s.keys.push(keys);
            s
        })
        .collect();
    state.stats.reported.carry(t.made(), t.id(), &mut cur, mrc);
    cur
}

/// Collects the current statistics (each shard's from its actor).
pub async fn collect(state: &State) -> Result<DaemonStats, hkv_proto::ProtoError> {
    let mut per_table = vec![];
    for t in state.router.tables() {
        // Curves first: their drain counts the latest accesses too.
        let curves = state.router.mrc_curves(&t).await?;
        let shards = state.router.shard_stats(&t).await?;
        per_table.push((t, shards, curves));
    }
    {
        let live: Vec<_> = per_table.iter().map(|(t, _, _)| t.id()).collect();
        state.checkpoints.forget_exports(&live);
        let made: Vec<_> = per_table.iter().map(|(t, _, _)| t.made()).collect();
        state.stats.reported.retain(&made);
    }
    let backed = state.backing.stats();
    let tables = per_table
        .into_iter()
        .map(|(t, shards, curves)| {
            let shards: Vec<ShardStats> = shards.into_iter().map(shard_stats).collect();
            // The curve's measured hit rate is over the lookups the curve
            // saw: those of the shards now (a restore starts both afresh).
            let (hits, misses) = shards.iter().fold((0u64, 0u64), |(h, m), s| (h + s.hits, m + s.misses));
            let measured = (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64);
            let mut mrc = curves.map(|c| crate::mrc::combine(&c, measured));
            let shards = reported(state, &t, shards, mrc.as_mut());
            let size: u64 = shards.iter().map(|s| s.size).sum();
            let capacity: u64 = shards.iter().map(|s| s.capacity).sum();
            let mean = size as f64 / shards.len().max(1) as f64;
            let max = shards.iter().map(|s| s.size).max().unwrap_or(0) as f64;
            TableStats {
                spec: t.spec.redacted(),
                size,
                capacity,
                load_factor: size as f64 / capacity.max(1) as f64,
                imbalance: if mean > 0.0 { max / mean } else { 1.0 },
                shards,
                mrc,
                // HOOK(backing): the table's tier, when it has one.
                backing: backed.iter().find(|(n, _)| *n == t.spec.name).map(|(_, b)| crate::backing::wire_stats(b)),
            }
        })
        .collect();
    let s = &state.stats;
    Ok(DaemonStats {
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
        op_names: Op::ALL.iter().map(|o| o.name().to_string()).chain([CHECKPOINT_OP.to_string()]).collect(),
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
        path: {
            let mut p = s.path.stats();
            let calls = state.router.path.stats();
            (p.shard_calls, p.mailbox_ns, p.shard_ns, p.wake_ns) =
                (calls.shard_calls, calls.mailbox_ns, calls.shard_ns, calls.wake_ns);
            p
        },
    })
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
    let p = &d.path;
    family(&mut o, "requests_timed_total", "counter", "Requests whose stages stats.path sums.");
    let _ = writeln!(o, "hkvd_requests_timed_total {}", p.requests);
    family(&mut o, "request_stage_seconds_total", "counter", "Seconds requests spent in each stage (stats.path).");
    for (stage, ns) in [
        ("spawn", p.spawn_ns),
        ("handle", p.handle_ns),
        ("write", p.write_ns),
        ("queue", p.queue_ns),
        ("event_wait", p.event_wait_ns),
        ("total", p.total_ns),
    ] {
        let _ = writeln!(o, "hkvd_request_stage_seconds_total{{stage=\"{stage}\"}} {}", ns as f64 / 1e9);
    }
    family(
        &mut o,
        "answers_queued_total",
        "counter",
        "Answers that waited for the connection's writer (stats.path queued).",
    );
    let _ = writeln!(o, "hkvd_answers_queued_total {}", p.queued);
    family(
        &mut o,
        "event_waits_total",
        "counter",
        "Waits for clients' CUDA events not complete on arrival (stats.path).",
    );
    let _ = writeln!(o, "hkvd_event_waits_total {}", p.event_waits);
    family(&mut o, "shard_calls_timed_total", "counter", "Shard calls whose stages stats.path sums.");
    let _ = writeln!(o, "hkvd_shard_calls_timed_total {}", p.shard_calls);
    family(
        &mut o,
        "shard_call_stage_seconds_total",
        "counter",
        "Seconds shard calls spent in each stage (stats.path).",
    );
    for (stage, ns) in [("mailbox", p.mailbox_ns), ("shard", p.shard_ns), ("wake", p.wake_ns)] {
        let _ = writeln!(o, "hkvd_shard_call_stage_seconds_total{{stage=\"{stage}\"}} {}", ns as f64 / 1e9);
    }
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
    // Each family's samples together, after its HELP and TYPE (the text
    // format asks it; the two families' lines alternated before).
    for (name, help, per_op) in [
        (
            "ops_total",
            "Batches per operation (op=\"checkpoint\": export batches checkpoints took; op=\"export\": clients').",
            (|s| &s.ops) as fn(&ShardStats) -> &Vec<u64>,
        ),
        ("keys_total", "Keys per operation.", |s| &s.keys),
    ] {
        family(&mut o, name, "counter", help);
        for t in &d.tables {
            for (i, s) in t.shards.iter().enumerate() {
                for (k, op) in d.op_names.iter().enumerate() {
                    let l = format!("{{table=\"{}\",shard=\"{i}\",op=\"{op}\"}}", t.spec.name);
                    let _ = writeln!(o, "hkvd_{name}{l} {}", per_op(s).get(k).unwrap_or(&0));
                }
            }
        }
    }
    family(
        &mut o,
        "mrc_hit_rate",
        "gauge",
        "Estimated hit rate of an LRU cache of factor × the table's capacity (no samples until hkvd_mrc_ready is 1).",
    );
    for t in &d.tables {
        // `combine` leaves a curve that is not ready without points.
        for p in t.mrc.iter().flat_map(|m| &m.points) {
            let _ =
                writeln!(o, "hkvd_mrc_hit_rate{{table=\"{}\",factor=\"{}\"}} {}", t.spec.name, p.factor, p.hit_rate);
        }
    }
    // One sample per table with a curve, each family after its HELP.
    type PerCurve = fn(&hkv_proto::stats::MrcStats) -> f64;
    let per_curve: [(&str, &str, &str, PerCurve); 5] = [
        (
            "mrc_ready",
            "gauge",
            "1 once the table's miss-ratio curve has sampled enough lookups for an estimate (hkvd_mrc_hit_rate has samples), else 0.",
            |m| f64::from(u8::from(crate::mrc::ready(m.sampled_accesses) && !m.points.is_empty())),
        ),
        ("mrc_sampling_rate", "gauge", "Share of the table's keys its miss-ratio curve samples.", |m| m.rate),
        (
            "mrc_sampled_dropped_total",
            "counter",
            "Sampled keys lost before the miss-ratio estimator (a shard's sample buffer full).",
            |m| m.dropped as f64,
        ),
        (
            "mrc_lookups_dropped_total",
            "counter",
            "Lookups left out of the miss-ratio curve with the sampled keys dropped.",
            |m| m.dropped_lookups as f64,
        ),
        ("mrc_lookups_total", "counter", "Lookups the table's miss-ratio curve has observed.", |m| m.accesses as f64),
    ];
    for (name, kind, help, value) in per_curve {
        family(&mut o, name, kind, help);
        for t in &d.tables {
            if let Some(m) = &t.mrc {
                let _ = writeln!(o, "hkvd_{name}{{table=\"{}\"}} {}", t.spec.name, value(m));
            }
        }
    }
    let ck = &d.checkpoint;
    let ok = ck.last_ok.as_ref();
    for (name, kind, help, v) in [
        (
            "checkpoint_last_success_timestamp_seconds",
            "gauge",
            "When the last checkpoint completed, Unix seconds (0 before the first).",
            ok.map_or(0.0, |f| f.finished_unix_ms as f64 / 1e3),
        ),
        (
            "checkpoint_last_failure_timestamp_seconds",
            "gauge",
            "When the last checkpoint failed or was refused, Unix seconds (0 before the first).",
            ck.last_failed_unix_ms as f64 / 1e3,
        ),
        (
            "checkpoint_consecutive_failures",
            "gauge",
            "Checkpoints failed since the last that completed (stats: checkpoint.last.error).",
            ck.consecutive_failures as f64,
        ),
        (
            "checkpoint_running",
            "gauge",
            "1 while a checkpoint runs, else 0.",
            f64::from(u8::from(ck.running.is_some())),
        ),
        (
            "checkpoint_paused",
            "gauge",
            "1 while checkpoints are paused (the state directory cannot be written: stats checkpoint.paused), else 0.",
            f64::from(u8::from(ck.paused.is_some())),
        ),
        (
            "checkpoint_last_duration_seconds",
            "gauge",
            "Seconds the last completed checkpoint took.",
            ok.map_or(0.0, |f| f.seconds),
        ),
        (
            "checkpoint_last_bytes",
            "gauge",
            "Chunk bytes the last completed checkpoint wrote.",
            ok.map_or(0.0, |f| f.bytes as f64),
        ),
    ] {
        family(&mut o, name, kind, help);
        let _ = writeln!(o, "hkvd_{name} {v}");
    }
    // HOOK(backing): each backed table's tier.
    crate::backing::prometheus(&mut o, d);
    for (name, kind, help, per_group) in [
        (
            "lock_running",
            "gauge",
            "Operations running per lock group.",
            (|s, g| s.lock.running[g] as u64) as fn(&ShardStats, usize) -> u64,
        ),
        ("lock_waiting", "gauge", "Operations waiting per lock group.", |s, g| s.lock.waiting[g] as u64),
        ("lock_waits_total", "counter", "Acquisitions that waited, per lock group.", |s, g| s.lock.waits[g]),
    ] {
        family(&mut o, name, kind, help);
        for t in &d.tables {
            for (i, s) in t.shards.iter().enumerate() {
                for g in Group::ALL {
                    let gi = g as usize;
                    let group = ["reader", "updater", "inserter"][gi];
                    let l = format!("{{table=\"{}\",shard=\"{i}\",group=\"{group}\"}}", t.spec.name);
                    let _ = writeln!(o, "hkvd_{name}{l} {}", per_group(s, gi));
                }
            }
        }
    }
    o
}

/// The metrics listener's socket, bound at start so that a taken or
/// refused address stops the start with its reason.
pub async fn bind_metrics(addr: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    if !addr.ip().is_loopback() {
        anyhow::bail!("metrics_listen {addr} is not a loopback address; hkvd serves metrics on loopback only");
    }
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("metrics_listen {addr} (--metrics-listen): cannot listen there: {e}"))
}

/// Serves `GET /metrics` on the bound loopback listener until shutdown.
///
/// The port is open to every local user, so it holds few descriptors: at
/// most [`METRICS_CONNECTIONS`] connections at once (one past them is
/// closed at once), each closed after [`METRICS_SECONDS`] whatever it
/// sends; and a failed accept (the process out of descriptors) is retried,
/// never the listener's end. An independent tester held 385 idle
/// connections to it: the daemon ran out of descriptors (checkpoints
/// refused `busy`), and the listener died on the first `EMFILE` for good.
pub async fn http_listener(state: std::sync::Arc<State>, l: tokio::net::TcpListener) -> anyhow::Result<()> {
    let mut stop = state.shutdown.subscribe();
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS));
    let mut last_warned = None::<std::time::Instant>;
    loop {
        let accepted = tokio::select! {
            r = l.accept() => r,
            _ = stop.changed() => return Ok(()),
        };
        let mut s = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                if last_warned.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(10)) {
                    tracing::warn!(error = %e, "metrics: accept failed; retrying");
                    last_warned = Some(std::time::Instant::now());
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Too many at once: this one is closed unanswered.
            continue;
        };
        let st = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let limit = std::time::Duration::from_secs(METRICS_SECONDS);
            let _ = tokio::time::timeout(limit, answer_metrics(&st, &mut s)).await;
        });
    }
}

/// Reads one request from `s` and answers it: the metrics for `GET
/// /metrics`, else 404.
async fn answer_metrics(st: &State, s: &mut tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap_or(0);
    let ok = buf[..n].starts_with(b"GET /metrics");
    let (status, body) = if !ok {
        ("404 Not Found", "try GET /metrics\n".to_string())
    } else {
        match collect(st).await {
            Ok(d) => ("200 OK", prometheus(&d)),
            Err(e) => ("500 Internal Server Error", format!("{}\n", e.message)),
        }
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(head.as_bytes()).await;
    let _ = s.write_all(body.as_bytes()).await;
}

/// Metrics connections served at once ([`http_listener`]).
pub const METRICS_CONNECTIONS: usize = 16;

/// Seconds a metrics connection may take, from accept to answer.
pub const METRICS_SECONDS: u64 = 10;
