//! Checkpoints of every table into the sled catalog of `hkv-checkpoint`, and
//! restores through the router (so a checkpoint of N shards restores onto M).
//!
//! Export runs in the reader group in bounded chunks (`chunk_bytes`), so
//! writers wait at most one chunk at a time and every entry is copied whole.
//!
//! # Layout
//! - `schedule`: one checkpoint or restore at a time, started, taken,
//!   scheduled, and its outcome recorded.
//! - `write`: a checkpoint written, each shard exported in bounded batches
//!   through its actor.
//! - `restore`: a chain of checkpoints verified and loaded through the router.
//! - this file: the catalog opened, status and listings.

mod restore;
mod schedule;
mod write;

pub use hkv_proto::stats::{CheckpointStats, Finished, Listing, Progress, Restored};
pub use restore::Occasion;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hkv_checkpoint::{Catalog, Kind};
use hkv_proto::{ErrorCode, ProtoError};
use parking_lot::Mutex;

use tracing::{info, warn};

use crate::actor::TableId;
use crate::config::CheckpointConfig;

/// How the daemon's checkpoints went, for stats and Prometheus (an
/// operator's tester found no checkpoint metric at all, so a failing or
/// stuck checkpoint could not be alerted on).
#[derive(Debug, Clone, Default)]
struct Outcomes {
    /// The last checkpoint that completed.
    last_ok: Option<Finished>,
    /// When the last one failed (or was refused), ms since the Unix epoch (0: none yet).
    last_failed_unix_ms: u64,
    /// Attempts that failed since the last that completed.
    consecutive_failures: u64,
}

/// The daemon's checkpoints.
pub struct Checkpoints {
    catalog: Catalog,
    config: CheckpointConfig,
    running: Mutex<Option<Progress>>,
    last: Mutex<Option<Finished>>,
    outcomes: Mutex<Outcomes>,
    next_due: Mutex<Option<Instant>>,
    /// Held by the one checkpoint or restore running, from the moment it
    /// is accepted: a checkpoint without `wait` claims it or answers busy.
    gate: Arc<tokio::sync::Mutex<()>>,
    incrementals: AtomicU32,
    /// The router's table generation when the last checkpoint began.
    chain_generation: AtomicU64,
    restoring: Mutex<Option<Progress>>,
    last_restore: Mutex<Option<Restored>>,
    /// Export batches and keys checkpoints asked of each shard (by table
    /// id and shard), which the shards count as exports: the stats move
    /// them from `op="export"` (a client's) to `op="checkpoint"`.
    exports: Mutex<HashMap<(TableId, usize), [u64; 2]>>,
    /// The checkpoint store's directory (`<state>/checkpoints`).
    dir: std::path::PathBuf,
    /// Why checkpoints are paused since a write found the file system
    /// full, over quota or read-only while the daemon ran (the catalog's
    /// own pause is the one found at start-up); cleared by the first
    /// attempt that finds room again ([`Checkpoints::room`]).
    full: Mutex<Option<String>>,
}

/// When a checkpoint `interval_s` seconds from now is due; None where
/// that is past what an `Instant` holds (`Config::check` refuses such an
/// interval; `Instant + Duration` panicked the start).
fn due_in(interval_s: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_secs(interval_s.max(1)))
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn kind_name(k: &Kind) -> String {
    match k {
        Kind::Full => "full".into(),
        Kind::Incremental { base } => format!("incremental on {base:016x}"),
    }
}

fn internal(e: impl std::fmt::Display) -> ProtoError {
    ProtoError::new(ErrorCode::Internal, e.to_string())
}

/// Whether the file system of `dir` takes a write: 1 MiB written, synced
/// and removed. Err: why not, when it is full, over quota, read-only or
/// the file too large for the process (EFBIG: `RLIMIT_FSIZE`); other
/// errors (damage, a missing directory) are not a want of room and say Ok.
fn probe(dir: &std::path::Path) -> Result<(), String> {
    use std::io::ErrorKind::{FileTooLarge, QuotaExceeded, ReadOnlyFilesystem, StorageFull};
    use std::io::Write;
    let path = dir.join(".room-probe");
    let r = std::fs::File::create(&path).and_then(|mut f| {
        f.write_all(&vec![0u8; 1 << 20])?;
        f.sync_all()
    });
    let _ = std::fs::remove_file(&path);
    match r {
        Err(e) if matches!(e.kind(), StorageFull | QuotaExceeded | ReadOnlyFilesystem | FileTooLarge) => {
            Err(format!("writing 1 MiB to {} failed ({e})", path.display()))
        }
        _ => Ok(()),
    }
}

/// A checkpoint store error as a wire error: a file system that cannot be
/// written (full, over quota, read-only; or since start-up: checkpoints
/// paused) is `resource_exhausted`; the rest `internal`.
fn store_error(e: hkv_checkpoint::Error) -> ProtoError {
    use hkv_checkpoint::Error::{Paused, Unwritable};
    match e {
        e @ (Unwritable { .. } | Paused(_)) => ProtoError::new(ErrorCode::ResourceExhausted, e.to_string()),
        e => internal(e),
    }
}

impl Checkpoints {
    /// Opens the catalog in `dir` and collects leftovers of interrupted checkpoints.
    pub fn open(dir: &std::path::Path, config: CheckpointConfig) -> anyhow::Result<Checkpoints> {
        let (catalog, rec) = Catalog::open_recovering(&dir.join("checkpoints"))?;
        if let Some(why) = &rec.paused {
            warn!(
                reason = %why,
                "CHECKPOINTS ARE PAUSED: the state directory's file system cannot be written; hkvd serves, \
                 restores from the checkpoint directories, and takes no checkpoint until restarted with space"
            );
        }
        if let Some((why, aside)) = &rec.damaged {
            warn!(
                error = %why,
                moved_to = %aside.display(),
                rebuilt = rec.reindexed.len(),
                "the checkpoint catalog was damaged: it was moved aside and rebuilt from the checkpoint directories"
            );
        } else if !rec.reindexed.is_empty() || !rec.unindexed.is_empty() {
            warn!(
                reindexed = ?rec.reindexed.iter().map(|i| format!("{i:016x}")).collect::<Vec<_>>(),
                unindexed = ?rec.unindexed.iter().map(|i| format!("{i:016x}")).collect::<Vec<_>>(),
                "the checkpoint catalog disagreed with the checkpoint directories; it was rebuilt from them"
            );
        }
        if !rec.migrated.is_empty() {
            info!(
                checkpoints = ?rec.migrated.iter().map(|i| format!("{i:016x}")).collect::<Vec<_>>(),
                "wrote missing directory manifests (earlier format, or deleted) from the catalog's copies"
            );
        }
        for id in &rec.rewritten {
            warn!(
                checkpoint = %format!("{id:016x}"),
                "the checkpoint's MANIFEST file was damaged; it was rewritten from the catalog's copy, which verifies, as does every chunk it names"
            );
        }
        for (id, aside, why) in &rec.moved_aside {
            warn!(
                checkpoint = %format!("{id:016x}"),
                moved_to = %aside.display(),
                reason = %why,
                "a checkpoint directory could not be repaired: it was moved aside (not deleted) and is no longer listed"
            );
        }
        // Leftovers only: retention counts checkpoints verified restorable,
        // none yet (see `retain`, after the restore at start).
        let removed = catalog.collect(config.keep, None)?;
        if !removed.is_empty() {
            info!(removed = removed.len(), "collected leftovers of interrupted checkpoints");
        }
        let next_due = config.interval_s.and_then(due_in);
        Ok(Checkpoints {
            catalog,
            config,
            running: Mutex::new(None),
            last: Mutex::new(None),
            outcomes: Mutex::new(Outcomes::default()),
            next_due: Mutex::new(next_due),
            gate: Arc::new(tokio::sync::Mutex::new(())),
            incrementals: AtomicU32::new(u32::MAX),
            chain_generation: AtomicU64::new(u64::MAX),
            restoring: Mutex::new(None),
            last_restore: Mutex::new(None),
            exports: Mutex::new(HashMap::new()),
            dir: dir.join("checkpoints"),
            full: Mutex::new(None),
        })
    }

    /// Started without a restore (`--restore none`): every checkpoint on
    /// disk now stays there, whatever retention would say once newer ones
    /// are taken (docs/checkpoints.md).
    pub fn keep_existing(&self) {
        self.catalog.keep_existing();
    }

    /// Retention (`keep`) once the restore at start is done: only then is
    /// it known which checkpoints are restorable, and retention counts
    /// only those (`Catalog::collect`).
    pub async fn retain(self: &Arc<Self>) {
        let _gate = self.gate.lock().await;
        let ck = self.clone();
        // Checkpoints earlier processes wrote or verified count from now on.
        self.catalog.trust_marks();
        match tokio::task::spawn_blocking(move || ck.catalog.collect(ck.config.keep, None)).await {
            Ok(Ok(removed)) if !removed.is_empty() => info!(
                removed = ?removed.iter().map(|i| format!("{i:016x}")).collect::<Vec<_>>(),
                keep = self.config.keep,
                "removed checkpoints older than the newest restorable ones (checkpoint.keep)"
            ),
            Ok(Err(e)) => warn!(error = %e, "removing old checkpoints failed"),
            _ => {}
        }
    }

    /// Checkpoint directories moved aside because they could not be read
    /// or repaired (see [`hkv_checkpoint::Catalog::set_aside`]).
    pub fn set_aside(&self) -> Vec<std::path::PathBuf> {
        self.catalog.set_aside()
    }

    /// Status for stats.
    pub fn stats(&self) -> CheckpointStats {
        // Cloned out first: a guard taken in the literal below would live
        // to its end, and a second lock of the same mutex would wait on it.
        let outcomes = self.outcomes.lock().clone();
        CheckpointStats {
            running: self.running.lock().clone(),
            last: self.last.lock().clone(),
            next_in_s: self.next_due.lock().map(|t| t.saturating_duration_since(Instant::now()).as_secs_f64()),
            interval_s: self.config.interval_s,
            // Polled several times a second: count keys, decode nothing.
            complete: self.catalog.count().unwrap_or(0),
            restoring: self.restoring.lock().clone(),
            last_restore: self.last_restore.lock().clone(),
            paused: self.catalog.paused().or_else(|| self.full.lock().clone()),
            last_ok: outcomes.last_ok,
            last_failed_unix_ms: outcomes.last_failed_unix_ms,
            consecutive_failures: outcomes.consecutive_failures,
        }
    }

    /// A checkpoint store error as a wire error ([`store_error`]); a file
    /// system that cannot be written pauses checkpoints until one finds
    /// room again. An operator's tester filled a 3 MiB state directory:
    /// every attempt failed with "No space left on device" at WARN, while
    /// docs/checkpoints.md promised a pause (`checkpoint.paused`).
    fn store_error(&self, e: hkv_checkpoint::Error) -> ProtoError {
        if let hkv_checkpoint::Error::Unwritable { .. } = &e {
            self.pause(e.to_string());
        }
        store_error(e)
    }

    /// Pauses checkpoints for want of room (`why`), saying so once.
    fn pause(&self, why: String) {
        let mut full = self.full.lock();
        if full.is_none() {
            warn!(
                reason = %why,
                "CHECKPOINTS ARE PAUSED: the state directory's file system cannot be written; hkvd serves, and \
                 each later checkpoint first checks for room and resumes them once there is some"
            );
        }
        *full = Some(why);
    }

    /// Before a checkpoint: while checkpoints are paused for want of room,
    /// whether there is room again (a probe write, [`probe`]): if so they
    /// resume, else the attempt is refused `resource_exhausted`. A failure
    /// that was not an I/O error of the store (sled can fail for want of
    /// space without one) is told apart the same way, in
    /// [`Checkpoints::failed`].
    async fn room(self: &Arc<Self>) -> Result<(), ProtoError> {
        if self.full.lock().is_none() {
            return Ok(());
        }
        let dir = self.dir.clone();
        match tokio::task::spawn_blocking(move || probe(&dir)).await.map_err(internal)? {
            Err(why) => {
                self.pause(why.clone());
                Err(ProtoError::new(
                    ErrorCode::ResourceExhausted,
                    format!(
                        "checkpoints are paused: {why}; free space on the state directory's file system (or make \
                         it writable), and the next checkpoint resumes them"
                    ),
                ))
            }
            Ok(()) => {
                info!("the state directory's file system takes writes again: checkpoints resume");
                *self.full.lock() = None;
                Ok(())
            }
        }
    }

    /// A failed checkpoint's error, as answered: one that was not already
    /// a full file system's (`resource_exhausted`) but happened on a file
    /// system the probe finds full is one, and pauses checkpoints.
    async fn failed(self: &Arc<Self>, e: ProtoError) -> ProtoError {
        if e.code == ErrorCode::ResourceExhausted && self.full.lock().is_some() {
            return e;
        }
        let dir = self.dir.clone();
        match tokio::task::spawn_blocking(move || probe(&dir)).await {
            Ok(Err(why)) => {
                self.pause(why.clone());
                ProtoError::new(ErrorCode::ResourceExhausted, format!("{}; {why}", e.message))
            }
            _ => e,
        }
    }

    /// Counts `batches` export batches of `keys` keys a checkpoint asks of
    /// shard `shard` of table `table`.
    fn count_export(&self, table: TableId, shard: usize, batches: u64, keys: u64) {
        let mut g = self.exports.lock();
        let e = g.entry((table, shard)).or_default();
        e[0] += batches;
        e[1] += keys;
    }

    /// Takes back what [`Checkpoints::count_export`] counted and the shard did not.
    fn uncount_export(&self, table: TableId, shard: usize, batches: u64, keys: u64) {
        if let Some(e) = self.exports.lock().get_mut(&(table, shard)) {
            e[0] = e[0].saturating_sub(batches);
            e[1] = e[1].saturating_sub(keys);
        }
    }

    /// The export batches and keys checkpoints took from shard `shard` of
    /// table `table` (the table's instance: a restore's new shards count
    /// from 0, as the shards' own counters do).
    pub fn exports(&self, table: TableId, shard: usize) -> [u64; 2] {
        self.exports.lock().get(&(table, shard)).copied().unwrap_or_default()
    }

    /// Forgets the export counts of tables not in `live` (dropped, or
    /// replaced by a restore).
    pub fn forget_exports(&self, live: &[TableId]) {
        self.exports.lock().retain(|(t, _), _| live.contains(t));
    }

    /// Every checkpoint, newest first.
    pub fn list(&self) -> Result<Vec<Listing>, ProtoError> {
        Ok(self
            .catalog
            .list()
            .map_err(internal)?
            .into_iter()
            .map(|l| match l.manifest {
                Some(m) => Listing {
                    id: format!("{:016x}", m.id),
                    created_unix_ms: m.created_unix_ms,
                    kind: kind_name(&m.kind),
                    tables: m.tables.iter().map(|t| (t.name.clone(), t.entries)).collect(),
                    entries: m.entries(),
                    bytes: m.bytes(),
                    status: l.status,
                },
                None => Listing {
                    id: format!("{:016x}", l.id),
                    created_unix_ms: 0,
                    kind: "?".into(),
                    tables: vec![],
                    entries: 0,
                    bytes: 0,
                    status: l.status,
                },
            })
            .collect())
    }
}
