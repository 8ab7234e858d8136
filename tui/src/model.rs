//! Stats as plain numbers, from the typed stats document
//! (`hkv_proto::stats::Stats`, the one hkvctl reads): an answer that does
//! not read as one is an error of the poll (the console shows it), never a
//! page of zeros.

use hkv_client::proto::stats::{LockGroup, LockStats, Stats};

/// Lock-group state of one shard.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lock {
    /// `reader`, `updater`, `inserter` or empty.
    pub active: String,
    /// Running per group (reader, updater, inserter).
    pub running: [u64; 3],
    /// Waiting per group.
    pub waiting: [u64; 3],
    /// Acquisitions that waited, per group.
    pub waits: [u64; 3],
    /// Seconds spent waiting, per group.
    pub wait_s: [f64; 3],
}

/// One shard of one table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shard {
    /// Entries.
    pub size: u64,
    /// Slots.
    pub capacity: u64,
    /// Lookups that hit.
    pub hits: u64,
    /// Lookups that missed.
    pub misses: u64,
    /// Evictions.
    pub evictions: u64,
    /// Rejections.
    pub rejections: u64,
    /// Batches over all ops.
    pub ops: u64,
    /// Keys over all ops.
    pub keys: u64,
    /// Batches per op type (in the order of `Snapshot::op_names`).
    pub ops_by_type: Vec<u64>,
    /// Keys per op type.
    pub keys_by_type: Vec<u64>,
    /// Value bytes in device memory.
    pub fast_bytes: u64,
    /// Value bytes in host memory.
    pub host_bytes: u64,
    /// Lock state.
    pub lock: Lock,
}

/// One table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    /// Name.
    pub name: String,
    /// Dim.
    pub dim: u64,
    /// Policy.
    pub policy: String,
    /// Mode.
    pub mode: String,
    /// Per shard.
    pub shards: Vec<Shard>,
    /// The live miss-ratio curve: (capacity factor, estimated hit rate)
    /// points; empty when the daemon estimates none, or none yet.
    pub curve: Vec<(f64, f64)>,
    /// Whether the daemon keeps a curve for the table (not `--no-mrc`).
    pub curve_on: bool,
    /// Lookups the curve sampled: the daemon gives it points from 100 on.
    pub curve_sampled: u64,
    /// Sampled keys lost before the curve's estimator (issue 32): the
    /// curve is less exact when this is not 0.
    pub curve_dropped: u64,
    /// The table's Redis Cluster tier, when it has one.
    pub backing: Option<hkv_client::proto::stats::BackingStats>,
}

impl Table {
    /// Sum of a shard field.
    pub fn sum(&self, get: impl Fn(&Shard) -> u64) -> u64 {
        self.shards.iter().map(get).sum()
    }
    /// Entries.
    pub fn size(&self) -> u64 {
        self.sum(|s| s.size)
    }
    /// Slots.
    pub fn capacity(&self) -> u64 {
        self.sum(|s| s.capacity)
    }
    /// size / capacity in [0, 1].
    pub fn load(&self) -> f64 {
        let c = self.capacity();
        if c == 0 {
            0.0
        } else {
            (self.size() as f64 / c as f64).clamp(0.0, 1.0)
        }
    }
    /// Hit rate, if any lookups happened.
    pub fn hit_rate(&self) -> Option<f64> {
        let (h, m) = (self.sum(|s| s.hits), self.sum(|s| s.misses));
        (h + m > 0).then(|| h as f64 / (h + m) as f64)
    }
}

/// A checkpoint in progress.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Id.
    pub id: String,
    /// Entries written.
    pub done: u64,
    /// Entries in total.
    pub total: u64,
    /// Seconds left.
    pub eta_s: f64,
}

/// Checkpoint status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checkpoint {
    /// Running one.
    pub running: Option<Progress>,
    /// Last one: id, entries, seconds, error.
    pub last: Option<(String, u64, f64, Option<String>)>,
    /// Seconds to the next scheduled one.
    pub next_in_s: Option<f64>,
    /// The checkpoint the daemon restored (at start or by `restore`), with
    /// the entries it placed.
    pub restored: Option<(String, u64)>,
}

/// One stats document.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Daemon version.
    pub version: String,
    /// Uptime.
    pub uptime_s: f64,
    /// Backend in words.
    pub backend: String,
    /// Shards per table.
    pub shards: u64,
    /// Connections.
    pub connections: u64,
    /// Requests answered.
    pub requests: u64,
    /// Errors sent.
    pub errors: u64,
    /// Tables.
    pub tables: Vec<Table>,
    /// Checkpoints.
    pub checkpoint: Checkpoint,
    /// Names of the op types, in the order of `Shard::ops_by_type`.
    pub op_names: Vec<String>,
}

fn lock(l: &LockStats) -> Lock {
    let wide = |a: [u32; 3]| a.map(u64::from);
    Lock {
        active: match l.active {
            Some(LockGroup::Reader) => "reader",
            Some(LockGroup::Updater) => "updater",
            Some(LockGroup::Inserter) => "inserter",
            None => "",
        }
        .to_string(),
        running: wide(l.running),
        waiting: wide(l.waiting),
        waits: l.waits,
        wait_s: l.wait_ns.map(|ns| ns as f64 / 1e9),
    }
}

/// The plain numbers of a stats document.
pub fn snapshot(v: &Stats) -> Snapshot {
    let tables = v
        .tables
        .iter()
        .map(|t| Table {
            name: t.spec.name.clone(),
            dim: t.spec.dim as u64,
            policy: t.spec.policy.to_string(),
            mode: t.spec.mode.to_string(),
            curve: t.mrc.iter().flat_map(|m| &m.points).map(|p| (p.factor, p.hit_rate)).collect(),
            curve_dropped: t.mrc.as_ref().map_or(0, |m| m.dropped),
            curve_on: t.mrc.is_some(),
            curve_sampled: t.mrc.as_ref().map_or(0, |m| m.sampled_accesses),
            backing: t.backing.clone(),
            shards: t
                .shards
                .iter()
                .map(|x| Shard {
                    size: x.size,
                    capacity: x.capacity,
                    hits: x.hits,
                    misses: x.misses,
                    evictions: x.evictions,
                    rejections: x.rejections,
                    ops: x.ops.iter().sum(),
                    keys: x.keys.iter().sum(),
                    ops_by_type: x.ops.clone(),
                    keys_by_type: x.keys.clone(),
                    fast_bytes: x.fast_tier_bytes,
                    host_bytes: x.host_tier_bytes,
                    lock: lock(&x.lock),
                })
                .collect(),
        })
        .collect();
    let ck = &v.checkpoint;
    let running = ck.running.as_ref().map(|p| Progress {
        id: p.id.clone(),
        done: p.entries_done,
        total: p.entries_total,
        eta_s: p.eta_s,
    });
    let last = ck.last.as_ref().map(|l| (l.id.clone(), l.entries, l.seconds, l.error.clone()));
    Snapshot {
        version: v.version.clone(),
        uptime_s: v.uptime_s,
        backend: v.backend.clone(),
        shards: v.shards as u64,
        connections: v.connections as u64,
        requests: v.requests,
        errors: v.errors,
        tables,
        checkpoint: Checkpoint {
            running,
            last,
            next_in_s: ck.next_in_s,
            restored: ck.last_restore.as_ref().map(|r| (r.id.clone(), r.entries)),
        },
        op_names: v.op_names.clone(),
    }
}

/// Rates of one table between two snapshots, per second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    /// Batches per second.
    pub ops: f64,
    /// Keys per second.
    pub keys: f64,
    /// Evictions per second.
    pub evictions: f64,
    /// Rejections per second.
    pub rejections: f64,
}

/// Per op type: (name, batches/s, keys/s) of `now` against `before`, for
/// the types that ran.
pub fn rates_by_type(names: &[String], before: &Table, now: &Table, secs: f64) -> Vec<(String, f64, f64)> {
    let total = |t: &Table, i: usize, keys: bool| -> u64 {
        t.shards.iter().map(|s| if keys { &s.keys_by_type } else { &s.ops_by_type }).filter_map(|v| v.get(i)).sum()
    };
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let d = |keys| total(now, i, keys).saturating_sub(total(before, i, keys)) as f64 / secs.max(1e-6);
            (n.clone(), d(false), d(true))
        })
        .filter(|(_, o, _)| *o > 0.0)
        .collect()
}

/// Rates of `now` against `before` over `secs`; counters that went down
/// (a daemon restart) read as zero.
pub fn rates(before: &Table, now: &Table, secs: f64) -> Rates {
    let d = |g: fn(&Shard) -> u64| now.sum(g).saturating_sub(before.sum(g)) as f64 / secs.max(1e-6);
    Rates { ops: d(|s| s.ops), keys: d(|s| s.keys), evictions: d(|s| s.evictions), rejections: d(|s| s.rejections) }
}
