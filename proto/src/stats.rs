//! The JSON documents of the `stats`, `list_checkpoints`, `checkpoint` and
//! `restore` answers, typed (PROTOCOL.md, "Stats" and "Checkpoint listing").
//! The daemon fills and writes them; `hkvctl` and the console read them.
//! Every struct reads missing fields as their defaults, so a document from
//! an older daemon (without the fields added since) still reads.

use serde::{Deserialize, Serialize};

use crate::types::TableSpec;

/// The `stats` answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// Daemon version.
    pub version: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Backend in words, e.g. `cpu (3 shards)`.
    pub backend: String,
    /// Shards per table (devices or CPU shards).
    pub shards: usize,
    /// Where feature requests are hashed: "CPU" or "GPU 0 (name)".
    pub feature_hashing: String,
    /// Connections open now.
    pub connections: usize,
    /// Requests answered since start.
    pub requests: u64,
    /// Error answers since start.
    pub errors: u64,
    /// Requests running now.
    pub in_flight: usize,
    /// Per table, sorted by name.
    pub tables: Vec<TableStats>,
    /// Names of the operations, indexing each shard's `ops` and `keys`.
    pub op_names: Vec<String>,
    /// Checkpoint status.
    pub checkpoint: CheckpointStats,
    /// Memory limits and what is held of them.
    pub memory: MemoryStats,
    /// Registered regions (client memfds the daemon maps).
    #[serde(default)]
    pub regions: RegionStats,
    /// Where requests' time went since start (`hkvctl stats --path`).
    #[serde(default)]
    pub path: PathStats,
}

/// `stats.path`: the time requests spent in each stage of the daemon,
/// summed since start, in nanoseconds (divide by the count beside it for a
/// mean). A request's stages, in order: `spawn` (its body read, to its
/// task running), `handle` (its task, until its answer frame is built;
/// this includes every shard call the request made), `write` (the answer
/// queued, to written and flushed to the socket); `total` is all three.
/// Each shard call inside `handle`: `mailbox` (sent, to its actor thread
/// starting it), `shard` (the operation on the shard, kernels and their
/// synchronisation included), `wake` (the operation done, to the request's
/// task running again). Inside `write`, `queue` is the part before the
/// answer's bytes began to go out (waiting for the connection's writer,
/// for the `queued` answers that another answer's write held up). Inside
/// `handle`, `event_wait` sums the waits for clients' CUDA wait events
/// (`event_waits` of them: those not already complete when looked at).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PathStats {
    /// Requests timed (every request answered).
    pub requests: u64,
    /// Sum of their `spawn` stages.
    pub spawn_ns: u64,
    /// Sum of their `handle` stages.
    pub handle_ns: u64,
    /// Sum of their `write` stages.
    pub write_ns: u64,
    /// Sum of the part of their `write` stages before the answer's bytes
    /// began to go out.
    pub queue_ns: u64,
    /// Answers handed to the connection's writer task (another answer
    /// was being written when theirs was built).
    pub queued: u64,
    /// Waits for a client's CUDA wait event that was not complete when
    /// its request arrived.
    pub event_waits: u64,
    /// Sum of those waits (part of `handle`).
    pub event_wait_ns: u64,
    /// Sum of their whole times in the daemon.
    pub total_ns: u64,
    /// Shard calls timed.
    pub shard_calls: u64,
    /// Sum of their `mailbox` stages.
    pub mailbox_ns: u64,
    /// Sum of their `shard` stages.
    pub shard_ns: u64,
    /// Sum of their `wake` stages.
    pub wake_ns: u64,
}

/// `stats.regions`: registered regions and their limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionStats {
    /// `limits.max_region_bytes`.
    pub max_region_bytes: u64,
    /// `limits.max_region_bytes_per_connection`.
    pub max_region_bytes_per_connection: u64,
    /// Regions mapped now (registered, or unregistered with requests in flight).
    pub regions: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// The memory budget and the request bytes in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
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
    pub receiving_bytes: u64,
}

/// One table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableStats {
    /// As created, defaults filled in.
    pub spec: TableSpec,
    /// Entries over all shards.
    #[serde(default)]
    pub size: u64,
    /// Slots over all shards.
    #[serde(default)]
    pub capacity: u64,
    /// size / capacity.
    #[serde(default)]
    pub load_factor: f64,
    /// Largest shard size over the mean (1.0 = perfectly even).
    #[serde(default)]
    pub imbalance: f64,
    /// Per shard, in shard order.
    #[serde(default)]
    pub shards: Vec<ShardStats>,
    /// The live miss-ratio curve; absent when the daemon runs `--no-mrc`
    /// (or is older than the curves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mrc: Option<MrcStats>,
    /// The table's Redis Cluster tier; absent on a table without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<BackingStats>,
}

/// A backed table's tier (PROTOCOL.md, "Backing tier"): what its reads
/// found where, what its writes sent, the write-back window, errors per
/// node, latencies and staleness (quantiles within a factor of two: the
/// tier's histograms have power-of-two buckets).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BackingStats {
    /// `read-only`, `write-through` or `write-back`.
    pub mode: String,
    /// Keys of reads the cache answered.
    pub hits: u64,
    /// Keys missed by the cache and filled from the cluster, or from this
    /// host's write-back queue (rows written here that may not be in the
    /// cluster yet; those are also counted in `filled_queued`).
    pub filled: u64,
    /// Of `filled`, the keys this host's write-back queue answered.
    #[serde(default)]
    pub filled_queued: u64,
    /// Keys missed by the cache and absent from the cluster.
    pub absent: u64,
    /// Keys not fetched within the deadline.
    pub late: u64,
    /// Keys whose node failed.
    pub unavailable: u64,
    /// Rows written to the cluster.
    pub rows_written: u64,
    /// Row bytes read from the cluster.
    pub bytes_in: u64,
    /// Row bytes written to the cluster.
    pub bytes_out: u64,
    /// Rows in the write-back queue (the window a crash would lose).
    pub queue_rows: u64,
    /// Their bytes.
    pub queue_bytes: u64,
    /// The queue's bound.
    pub queue_limit_bytes: u64,
    /// Age of the oldest queued row, ms.
    pub queue_oldest_ms: u64,
    /// Writers refused with `resource_exhausted`.
    pub queue_full: u64,
    /// Keys invalidated by other hosts' writes.
    pub invalidations: u64,
    /// Stream entries of this host's acknowledged writes waiting to be
    /// appended (the stream's node refused them or did not answer); a
    /// reset entry counts one.
    #[serde(default)]
    pub unpublished_entries: u64,
    /// Their bytes (keys, and 48 per entry).
    #[serde(default)]
    pub unpublished_bytes: u64,
    /// Their bound: past it they are replaced by one reset entry.
    #[serde(default)]
    pub unpublished_limit_bytes: u64,
    /// Times the bound was reached (each made a reset entry, on which
    /// every other host drops its cache of the table).
    #[serde(default)]
    pub unpublished_resets: u64,
    /// Errors per node (`host:port`).
    pub node_errors: std::collections::BTreeMap<String, u64>,
    /// Fetch latency per batch, median and 99th percentile, µs.
    pub fetch_p50_us: u64,
    /// See `fetch_p50_us`.
    pub fetch_p99_us: u64,
    /// Time from another host's acknowledged write to its invalidation
    /// here, median and 99th percentile, µs.
    pub staleness_p50_us: u64,
    /// See `staleness_p50_us`.
    pub staleness_p99_us: u64,
}

/// A table's live miss-ratio curve (PROTOCOL.md, "Miss-ratio curves"): the
/// hit rate a fully associative LRU cache of each size would have had on
/// the table's lookups since it was created (the clients' writes placing
/// and refreshing keys, not counted as lookups), estimated from a spatial
/// sample. The curve is LRU's whatever the table's own policy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MrcStats {
    /// One point per capacity factor, 1/8× to 8×, increasing.
    pub points: Vec<MrcPoint>,
    /// The table's own hit rate, hits / (hits + misses) of its shards'
    /// lookups (None before any lookup).
    pub measured_hit_rate: Option<f64>,
    /// Keys of lookups (find, contains, find_or_insert) observed: the
    /// references the hit rates count. It and the two `dropped` counters
    /// carry on across a live restore.
    pub accesses: u64,
    /// Of them, lookups of sampled keys.
    pub sampled_accesses: u64,
    /// Sampled keys lost before they reached the estimator (a shard's
    /// buffer full between two drains), since the table was created; 0
    /// unless sampling fell behind, which makes the curve less exact.
    pub dropped: u64,
    /// Lookups those dropped keys stood for, left out of `accesses` (the
    /// curve covers `accesses` of the `accesses + dropped_lookups` served).
    pub dropped_lookups: u64,
    /// Distinct sampled keys tracked now, over all shards.
    pub tracked_keys: u64,
    /// The sampling rate (access-weighted mean over shards).
    pub rate: f64,
    /// Memory of the estimators, bytes.
    pub memory_bytes: u64,
}

/// One point of a miss-ratio curve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MrcPoint {
    /// The capacity as a factor of the table's.
    pub factor: f64,
    /// Slots.
    pub capacity: u64,
    /// Estimated hit rate, 0 to 1.
    pub hit_rate: f64,
}

/// Counters of one shard since its table was created.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ShardStats {
    /// Entries stored.
    pub size: u64,
    /// Slots.
    pub capacity: u64,
    /// size / capacity.
    pub load_factor: f64,
    /// Batches per operation, indexed like [`Stats::op_names`].
    pub ops: Vec<u64>,
    /// Keys per operation, indexed like [`Stats::op_names`].
    pub keys: Vec<u64>,
    /// Lookups (find, contains, find_or_insert) that found their key.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Keys placed in a free slot.
    pub inserts: u64,
    /// Keys placed by evicting another entry.
    pub evictions: u64,
    /// Keys refused by admission control.
    pub rejections: u64,
    /// Value bytes in the fast (device) tier.
    pub fast_tier_bytes: u64,
    /// Value bytes in the host tier.
    pub host_tier_bytes: u64,
    /// Lock-group state.
    pub lock: LockStats,
}

/// A lock group of a shard's triple-group lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockGroup {
    /// find, contains, export.
    Reader,
    /// assign, assign_scores, accumulate on existing keys.
    Updater,
    /// Anything that may allocate, evict or erase.
    Inserter,
}

/// A shard's lock: who runs, who waits, how much waiting happened. The
/// arrays are indexed reader, updater, inserter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LockStats {
    /// The group holding the lock, if any.
    pub active: Option<LockGroup>,
    /// Operations running, per group.
    pub running: [u32; 3],
    /// Operations waiting, per group.
    pub waiting: [u32; 3],
    /// Acquisitions that had to wait, per group.
    pub waits: [u64; 3],
    /// Nanoseconds spent waiting, per group.
    pub wait_ns: [u64; 3],
    /// Most operations seen running at once, per group.
    pub max_running: [u32; 3],
    /// Entries that found the lock in a state it must never be in (always 0).
    pub violations: u64,
}

/// Checkpoint status (`stats.checkpoint`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointStats {
    /// The one running, if any.
    pub running: Option<Progress>,
    /// The last one finished (or failed).
    pub last: Option<Finished>,
    /// Seconds until the next scheduled one.
    pub next_in_s: Option<f64>,
    /// The schedule.
    pub interval_s: Option<u64>,
    /// Checkpoints with a manifest in the store.
    pub complete: usize,
    /// The restore running, if any (kind: `load`: chunks read, verified and
    /// loaded into tables not yet visible).
    pub restoring: Option<Progress>,
    /// The last restore, with what it could not place.
    pub last_restore: Option<Restored>,
    /// Why checkpoints are paused (the state directory's file system is
    /// full or read-only), if they are; restores still read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused: Option<String>,
    /// The last checkpoint that completed (`last` may be a failure since).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_ok: Option<Finished>,
    /// When the last attempt failed or was refused, ms since the Unix
    /// epoch (0: none since the daemon started).
    pub last_failed_unix_ms: u64,
    /// Attempts that failed since the last that completed.
    pub consecutive_failures: u64,
}

/// A checkpoint (or restore) in progress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Progress {
    /// Id (hex).
    pub id: String,
    /// `full` or `incremental` (`load` for a restore).
    pub kind: String,
    /// Entries written so far.
    pub entries_done: u64,
    /// Entries in the tables when it began (an upper bound for incremental ones).
    pub entries_total: u64,
    /// Bytes written so far.
    pub bytes: u64,
    /// Seconds since it began.
    pub seconds: f64,
    /// Entries per second so far.
    pub rate: f64,
    /// Seconds left at this rate.
    pub eta_s: f64,
    /// Chunk megabytes (10^6 B) per second so far.
    pub mb_per_s: f64,
}

/// The last checkpoint attempt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Finished {
    /// Id (hex), when it got one.
    pub id: String,
    /// `full` or `incremental`.
    pub kind: String,
    /// Completion time, ms since the Unix epoch.
    pub finished_unix_ms: u64,
    /// Entries.
    pub entries: u64,
    /// Bytes.
    pub bytes: u64,
    /// Duration.
    pub seconds: f64,
    /// The error, if it failed.
    pub error: Option<String>,
}

/// A checkpoint as listed (`list_checkpoints`, and `checkpoint` with wait).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Listing {
    /// Id (hex).
    pub id: String,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// `full` or `incremental on <base>`.
    pub kind: String,
    /// Table names and entry counts.
    pub tables: Vec<(String, u64)>,
    /// Entries.
    pub entries: u64,
    /// Chunk bytes.
    pub bytes: u64,
    /// `complete` or the problem.
    pub status: String,
}

/// What a restore loaded (the `restore` answer, and `stats.checkpoint.last_restore`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Restored {
    /// The checkpoint restored (hex).
    pub id: String,
    /// Checkpoints skipped because they were corrupt, with the reason.
    pub skipped: Vec<String>,
    /// Tables and the entries they hold after the restore.
    pub tables: Vec<(String, u64)>,
    /// Per table, the entries of the checkpoint that could not be placed
    /// (refused by a full bucket, or evicted by another restored entry).
    pub dropped: Vec<(String, u64)>,
    /// Entries placed, over all tables.
    pub entries: u64,
    /// Chunk bytes read and loaded.
    pub bytes: u64,
    /// Seconds, verification included.
    pub seconds: f64,
    /// Chunk megabytes (10^6 B) per second, verification included.
    pub mb_per_s: f64,
}

/// The `checkpoint` answer without wait: the checkpoint now being taken.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Started {
    /// Always true.
    pub started: bool,
    /// Its id (16 hex digits).
    pub id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document from before `feature_hashing`, `memory` and the restore
    /// fields existed still reads, with those at their defaults.
    #[test]
    fn an_older_document_reads() {
        let old = serde_json::json!({
            "version": "0.1.0", "uptime_s": 1.5, "backend": "cpu (2 shards)", "shards": 2,
            "connections": 1, "requests": 9, "errors": 0, "in_flight": 1,
            "tables": [{"spec": {"name": "t", "dim": 4, "capacity": 64}, "size": 3, "capacity": 64,
                        "load_factor": 0.05, "imbalance": 1.0,
                        "shards": [{"size": 3, "capacity": 64, "ops": [1], "keys": [3],
                                    "lock": {"active": "reader", "running": [1, 0, 0]}}]}],
            "op_names": ["find"],
            "checkpoint": {"running": {"id": "00000000000000ff", "entries_done": 5, "entries_total": 10},
                           "last": null, "next_in_s": null, "interval_s": null, "complete": 0}
        });
        let s: Stats = serde_json::from_value(old).unwrap();
        assert_eq!(s.tables[0].shards[0].lock.active, Some(LockGroup::Reader));
        assert_eq!(s.checkpoint.running.as_ref().unwrap().entries_done, 5);
        assert_eq!((s.feature_hashing.as_str(), s.memory), ("", MemoryStats::default()));
        assert_eq!(s.regions, RegionStats::default());
    }
}
