//! Checkpoints of every table into the sled catalog of `hkv-checkpoint`, and
//! restores through the router (so a checkpoint of N shards restores onto M).
//!
//! Export runs in the reader group in bounded chunks (`chunk_bytes`), so
//! writers wait at most one chunk at a time and every entry is copied whole.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hkv_checkpoint::{Catalog, ChunkWriter, Kind, Manifest, TableEntry};
use hkv_proto::{ErrorCode, ProtoError, Request, TableSpec};
use hkv_shard::{Filter, ScorePolicy};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

pub use hkv_proto::stats::{CheckpointStats, Finished, Listing, Progress, Restored};

use crate::router::Router;
use crate::server::State;

/// The `[checkpoint]` section of the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Seconds between scheduled checkpoints; none = only on demand.
    pub interval_s: Option<u64>,
    /// Complete checkpoints kept (plus the bases incremental ones need).
    pub keep: usize,
    /// Incremental checkpoints between two full ones; 0 = always full.
    pub full_every: u32,
    /// Target bytes per chunk.
    pub chunk_bytes: u64,
    /// Take a checkpoint after draining on SIGTERM / shutdown.
    pub on_shutdown: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { interval_s: None, keep: 3, full_every: 4, chunk_bytes: 8 << 20, on_shutdown: false }
    }
}

/// The daemon's checkpoints.
pub struct Checkpoints {
    catalog: Catalog,
    config: CheckpointConfig,
    running: Mutex<Option<Progress>>,
    last: Mutex<Option<Finished>>,
    next_due: Mutex<Option<Instant>>,
    /// Held by the one checkpoint or restore running, from the moment it
    /// is accepted: a checkpoint without `wait` claims it or answers busy.
    gate: Arc<tokio::sync::Mutex<()>>,
    incrementals: AtomicU32,
    /// The router's table generation when the last checkpoint began.
    chain_generation: AtomicU64,
    restoring: Mutex<Option<Progress>>,
    last_restore: Mutex<Option<Restored>>,
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

/// Whether an incremental checkpoint can find a table's changes by score:
/// lru and epoch-lru give every write (insert, assign, accum, find_or_insert
/// hit) the clock's score, which is at or above the watermark read before
/// the previous export; the writes that can score lower (a client's load
/// with verbatim scores, an epoch set lower) mark the table `untracked`.
/// lfu, epoch-lfu (an assign without scores keeps the old score) and custom
/// scores do not follow time: those tables are stored whole every time.
fn tracks_changes(policy: &str) -> bool {
    matches!(policy.parse(), Ok(ScorePolicy::Lru | ScorePolicy::EpochLru))
}

/// The entries of `c` that are live (in the sorted `live`) and not yet
/// loaded from a newer part of the chain; marks them loaded.
fn keep_newest(c: hkv_checkpoint::Chunk, live: &[u64], seen: &mut [bool]) -> hkv_checkpoint::Chunk {
    let dim = c.dim;
    let mut out = hkv_checkpoint::Chunk { dim, ..Default::default() };
    for (i, (&k, &s)) in c.keys.iter().zip(&c.scores).enumerate() {
        if let Ok(pos) = live.binary_search(&k) {
            if !std::mem::replace(&mut seen[pos], true) {
                out.keys.push(k);
                out.scores.push(s);
                out.values.extend_from_slice(&c.values[i * dim..(i + 1) * dim]);
            }
        }
    }
    out
}

/// The score a restored table's clock and epoch resume after
/// (`Shard::resume_after`): the clock its checkpoint recorded when each
/// shard's export ended, at or above every score a write gave. Not the
/// highest restored score: a client's `load` can store any score (2^64 − 1),
/// and resuming past it would give every later write that score for good.
fn resume_point(t: &TableEntry, m: &Manifest, max_restored: u64) -> u64 {
    if let Some(&clock) = t.clocks.iter().max() {
        return clock;
    }
    // Older manifests (no `clocks`): the highest restored score, capped at
    // the export-start watermark plus the checkpoint's duration in the
    // policy's clock units, above which no write (only a `load`) can score.
    let Some(&wm) = t.watermarks.iter().max() else { return max_restored };
    let took_ns = (m.finished_unix_ms.saturating_sub(m.created_unix_ms) + 1).saturating_mul(1_000_000);
    let cap = match t.policy.as_str().parse() {
        Ok(ScorePolicy::Lru) => wm.saturating_add(took_ns),
        Ok(ScorePolicy::EpochLru) => wm.saturating_add((took_ns >> 20) + 1),
        Ok(ScorePolicy::EpochLfu) => wm | 0xffff_ffff,
        _ => u64::MAX,
    };
    max_restored.min(cap)
}

/// The entries of `e` whose score is at least `wm`.
fn changed_since(e: hkv_shard::Export, wm: u64, dim: usize) -> hkv_shard::Export {
    let mut out = hkv_shard::Export::default();
    for (i, (&k, &s)) in e.keys.iter().zip(&e.scores).enumerate() {
        if s >= wm {
            out.keys.push(k);
            out.scores.push(s);
            out.values.extend_from_slice(&e.values[i * dim..(i + 1) * dim]);
        }
    }
    out
}

fn internal(e: impl std::fmt::Display) -> ProtoError {
    ProtoError::new(ErrorCode::Internal, e.to_string())
}

impl Checkpoints {
    /// Opens the catalog in `dir` and collects leftovers of interrupted checkpoints.
    pub fn open(dir: &std::path::Path, config: CheckpointConfig) -> anyhow::Result<Checkpoints> {
        let (catalog, rec) = Catalog::open_recovering(&dir.join("checkpoints"))?;
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
        let removed = catalog.collect(config.keep, None)?;
        if !removed.is_empty() {
            info!(removed = removed.len(), "collected leftovers of interrupted or expired checkpoints");
        }
        let next_due = config.interval_s.map(|s| Instant::now() + Duration::from_secs(s.max(1)));
        Ok(Checkpoints {
            catalog,
            config,
            running: Mutex::new(None),
            last: Mutex::new(None),
            next_due: Mutex::new(next_due),
            gate: Arc::new(tokio::sync::Mutex::new(())),
            incrementals: AtomicU32::new(u32::MAX),
            chain_generation: AtomicU64::new(u64::MAX),
            restoring: Mutex::new(None),
            last_restore: Mutex::new(None),
        })
    }

    /// Status for stats.
    pub fn stats(&self) -> CheckpointStats {
        CheckpointStats {
            running: self.running.lock().clone(),
            last: self.last.lock().clone(),
            next_in_s: self.next_due.lock().map(|t| t.saturating_duration_since(Instant::now()).as_secs_f64()),
            interval_s: self.config.interval_s,
            // Polled several times a second: count keys, decode nothing.
            complete: self.catalog.count().unwrap_or(0),
            restoring: self.restoring.lock().clone(),
            last_restore: self.last_restore.lock().clone(),
        }
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

    /// Starts a checkpoint without waiting for it: claims the gate now (so
    /// a second request answers busy, however soon it follows), allocates
    /// the checkpoint's id and answers it; the checkpoint runs on.
    pub async fn start(state: Arc<State>, full: bool) -> Result<String, ProtoError> {
        let ck = state.checkpoints.clone();
        let Ok(gate) = ck.gate.clone().try_lock_owned() else {
            return Err(ProtoError::new(
                ErrorCode::Busy,
                "a checkpoint or restore is already running; watch it with hkvctl stats",
            ));
        };
        let c = ck.clone();
        let w = tokio::task::spawn_blocking(move || c.catalog.begin()).await.map_err(internal)?.map_err(internal)?;
        let id = format!("{:016x}", w.id());
        *ck.running.lock() = Some(Progress {
            id: id.clone(),
            kind: "starting".into(),
            entries_done: 0,
            entries_total: 0,
            bytes: 0,
            seconds: 0.0,
            rate: 0.0,
            eta_s: 0.0,
            mb_per_s: 0.0,
        });
        tokio::spawn(Self::run(state, full, gate, Some(w)));
        Ok(id)
    }

    /// Takes a checkpoint (one at a time: waits for a running checkpoint or
    /// restore to finish first); `full` forces a full one.
    pub async fn take(state: Arc<State>, full: bool) -> Result<Manifest, ProtoError> {
        let gate = state.checkpoints.gate.clone().lock_owned().await;
        Self::run(state, full, gate, None).await
    }

    /// Runs a checkpoint while holding the gate, into `w` when its id was
    /// already allocated.
    async fn run(
        state: Arc<State>,
        full: bool,
        _gate: tokio::sync::OwnedMutexGuard<()>,
        w: Option<ChunkWriter>,
    ) -> Result<Manifest, ProtoError> {
        let ck = state.checkpoints.clone();
        if let Some(s) = ck.config.interval_s {
            *ck.next_due.lock() = Some(Instant::now() + Duration::from_secs(s.max(1)));
        }
        let started = Instant::now();
        let st = state.clone();
        let result = tokio::task::spawn_blocking(move || st.checkpoints.write(&st.router, full, w))
            .await
            .map_err(internal)
            .and_then(|r| r);
        let seconds = started.elapsed().as_secs_f64();
        if result.is_err() {
            // The failed checkpoint's files (a full disk, say) go now: left
            // until the next start, they made every later checkpoint fail too.
            let c = ck.clone();
            match tokio::task::spawn_blocking(move || c.catalog.collect(c.config.keep, None)).await {
                Ok(Ok(removed)) if !removed.is_empty() => {
                    info!(removed = removed.len(), "removed the files of the failed checkpoint")
                }
                Ok(Err(e)) => warn!(error = %e, "removing the failed checkpoint's files failed"),
                _ => {}
            }
        }
        let finished = match &result {
            Ok(m) => {
                info!(id = %format!("{:016x}", m.id), entries = m.entries(), bytes = m.bytes(), seconds, "checkpoint complete");
                Finished {
                    id: format!("{:016x}", m.id),
                    kind: kind_name(&m.kind),
                    finished_unix_ms: m.finished_unix_ms,
                    entries: m.entries(),
                    bytes: m.bytes(),
                    seconds,
                    error: None,
                }
            }
            Err(e) => {
                warn!(error = %e.message, "checkpoint failed");
                let p = ck.running.lock().clone();
                Finished {
                    id: p.as_ref().map(|p| p.id.clone()).unwrap_or_default(),
                    kind: p.map(|p| p.kind).unwrap_or_default(),
                    finished_unix_ms: now_ms(),
                    entries: 0,
                    bytes: 0,
                    seconds,
                    error: Some(e.message.clone()),
                }
            }
        };
        *ck.running.lock() = None;
        *ck.last.lock() = Some(finished);
        result
    }

    /// The blocking body of a checkpoint.
    fn write(&self, router: &Router, force_full: bool, w: Option<ChunkWriter>) -> Result<Manifest, ProtoError> {
        // Read before the tables: a table created or dropped from here on
        // makes the next checkpoint full.
        let generation = router.generation();
        let tables = router.tables();
        // The base of an incremental: the newest checkpoint whose chain restores.
        let prev = self
            .catalog
            .list()
            .map_err(internal)?
            .into_iter()
            .filter(|l| l.status == "complete")
            .find_map(|l| l.manifest);
        let since = self.incrementals.load(Relaxed);
        let incremental = !force_full
            && self.config.full_every > 0
            && since < self.config.full_every
            && prev.is_some()
            && self.chain_generation.load(Relaxed) == generation;
        let kind = match (&prev, incremental) {
            (Some(p), true) => Kind::Incremental { base: p.id },
            _ => Kind::Full,
        };
        // Until this one completes, the next must not build on it.
        self.incrementals.store(u32::MAX, Relaxed);
        let mut w = match w {
            Some(w) => w,
            None => self.catalog.begin().map_err(internal)?,
        };
        let total: u64 = tables.iter().flat_map(|t| &t.shards).map(|s| s.size()).sum();
        let started = Instant::now();
        *self.running.lock() = Some(Progress {
            id: format!("{:016x}", w.id()),
            kind: kind_name(&kind),
            entries_done: 0,
            entries_total: total,
            bytes: 0,
            seconds: 0.0,
            rate: 0.0,
            eta_s: 0.0,
            mb_per_s: 0.0,
        });
        let mut entries = vec![];
        for t in &tables {
            let dim = t.config.dim;
            let prev_t = prev.as_ref().and_then(|p| p.tables.iter().find(|x| x.name == t.spec.name));
            // Cleared now: writes during this export set it again for the next one.
            let untracked = t.untracked.swap(false, Relaxed);
            let inc = incremental
                && tracks_changes(t.spec.policy.as_str())
                && !untracked
                && prev_t.is_some_and(|p| {
                    p.shards as usize == t.shards.len()
                        && p.dim == dim
                        && p.policy == t.spec.policy
                        && p.watermarks.len() == t.shards.len()
                });
            let slots = (self.config.chunk_bytes / (16 + 4 * dim as u64)).max(128);
            let keys_per_list = (self.config.chunk_bytes / 8).max(1024) as usize;
            let mut chunks = vec![];
            let mut key_lists = vec![];
            let mut marks = vec![];
            let mut clocks = vec![];
            let mut count = 0;
            for (i, shard) in t.shards.iter().enumerate() {
                // Read before exporting: every later write scores at least this.
                marks.push(shard.clock_score());
                let watermark = match (inc, prev_t) {
                    (true, Some(p)) => Some(p.watermarks[i]),
                    _ => None,
                };
                // Slots move when a shard grows (rehash) mid-export; then its
                // export starts over, so no entry is skipped.
                let (first_chunk, first_list, first_count) = (chunks.len(), key_lists.len(), count);
                let (mut offset, mut seq, mut kseq, mut attempt) = (0u64, 0u32, 0u32, 0);
                let mut live: Vec<u64> = vec![];
                let mut capacity = shard.capacity();
                loop {
                    if offset >= capacity {
                        let now = shard.capacity();
                        if now == capacity || attempt >= 3 {
                            break;
                        }
                        warn!(table = %t.spec.name, shard = i, "the shard grew during the checkpoint; exporting it again");
                        chunks.truncate(first_chunk);
                        key_lists.truncate(first_list);
                        live.clear();
                        count = first_count;
                        (offset, capacity) = (0, now);
                        attempt += 1;
                        continue;
                    }
                    let mut e = shard.export_batch_if(offset, slots, &Filter::ALL).map_err(internal)?;
                    offset += slots;
                    if let Some(wm) = watermark {
                        // One pass: every live key for the key list, and the
                        // entries written since the base for the chunk.
                        live.extend_from_slice(&e.keys);
                        if e.scores.iter().any(|&s| s < wm) {
                            e = changed_since(e, wm, dim);
                        }
                        if live.len() >= keys_per_list {
                            key_lists.push(w.write_keys(&t.spec.name, i as u32, kseq, &live).map_err(internal)?);
                            kseq += 1;
                            live.clear();
                        }
                    }
                    if e.keys.is_empty() {
                        continue;
                    }
                    let c =
                        w.write(&t.spec.name, i as u32, seq, dim, &e.keys, &e.scores, &e.values).map_err(internal)?;
                    seq += 1;
                    count += c.entries;
                    chunks.push(c);
                    let secs = started.elapsed().as_secs_f64();
                    if let Some(p) = self.running.lock().as_mut() {
                        p.entries_done = w.entries();
                        p.bytes = w.bytes();
                        p.seconds = secs;
                        p.rate = w.entries() as f64 / secs.max(1e-9);
                        p.mb_per_s = w.bytes() as f64 / 1e6 / secs.max(1e-9);
                        p.eta_s = total.saturating_sub(w.entries()) as f64 / p.rate.max(1e-9);
                    }
                }
                if watermark.is_some() {
                    // Always at least one list per shard: an empty one says "no keys".
                    key_lists.push(w.write_keys(&t.spec.name, i as u32, kseq, &live).map_err(internal)?);
                }
                // Read after exporting: every entry exported scored at most this
                // (except a client's verbatim `load`); a restore resumes from here.
                clocks.push(shard.clock_score());
            }
            entries.push(TableEntry {
                name: t.spec.name.clone(),
                dim,
                policy: t.spec.policy,
                mode: t.spec.mode,
                spec: serde_json::to_value(&t.spec).map_err(internal)?,
                shards: t.shards.len() as u32,
                entries: count,
                full: !inc,
                watermarks: marks,
                clocks,
                chunks,
                keys: key_lists,
            });
        }
        let m = w.commit(kind, entries, env!("CARGO_PKG_VERSION")).map_err(internal)?;
        self.chain_generation.store(generation, Relaxed);
        match kind {
            Kind::Full => self.incrementals.store(0, Relaxed),
            Kind::Incremental { .. } => self.incrementals.store(since.saturating_add(1), Relaxed),
        }
        if let Err(e) = self.catalog.collect(self.config.keep, None) {
            warn!(error = %e, "collecting old checkpoints failed");
        }
        Ok(m)
    }

    /// Restores `which` (`latest` or a hex id). With `latest`, a corrupt
    /// checkpoint is skipped with a warning and the previous complete one is
    /// tried. Nothing a client can see changes before every chunk of the
    /// chosen chain verified (see [`Checkpoints::load_chain`]).
    pub async fn restore(state: Arc<State>, which: &str) -> Result<Option<Restored>, ProtoError> {
        let ck = state.checkpoints.clone();
        let _gate = ck.gate.lock().await;
        let which = which.to_string();
        let st = state.clone();
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || st.checkpoints.restore_blocking(&st.router, &which, &handle))
            .await
            .map_err(internal)?
    }

    fn restore_blocking(
        &self,
        router: &Router,
        which: &str,
        rt: &tokio::runtime::Handle,
    ) -> Result<Option<Restored>, ProtoError> {
        let started = Instant::now();
        let candidates: Vec<u64> = if which == "latest" {
            self.catalog.list().map_err(internal)?.into_iter().filter(|l| l.manifest.is_some()).map(|l| l.id).collect()
        } else {
            let id = u64::from_str_radix(which, 16).map_err(|_| {
                ProtoError::bad_request(format!(
                    "checkpoint id {which:?}: use `latest` or an id from `hkvctl checkpoints`"
                ))
            })?;
            vec![id]
        };
        if candidates.is_empty() {
            return Ok(None);
        }
        let mut skipped = vec![];
        // Checkpoints found unusable by this restore, with why: a candidate
        // whose chain holds one is skipped without reading it again.
        let mut bad: Vec<u64> = vec![];
        let tried = candidates.len();
        for id in candidates {
            let progress = |phase: &str, id: u64, done: u64, total: u64, bytes: u64| {
                let secs = started.elapsed().as_secs_f64();
                let rate = done as f64 / secs.max(1e-9);
                *self.restoring.lock() = Some(Progress {
                    id: format!("{id:016x}"),
                    kind: phase.into(),
                    entries_done: done,
                    entries_total: total,
                    bytes,
                    seconds: secs,
                    rate,
                    eta_s: total.saturating_sub(done) as f64 / rate.max(1e-9),
                    mb_per_s: bytes as f64 / 1e6 / secs.max(1e-9),
                });
            };
            let loaded = self.catalog.chain(id).map_err(Failure::Unusable).and_then(|chain| {
                if let Some(b) = bad.iter().find(|b| chain.iter().any(|m| m.id == **b)) {
                    return Err(Failure::Known(*b));
                }
                self.load_chain(router, &chain, rt, &progress).map(|l| (chain, l))
            });
            match loaded {
                Ok((chain, (loaded, dropped, bytes))) => {
                    *self.restoring.lock() = None;
                    for m in &chain {
                        self.catalog.clear_corrupt(m.id);
                    }
                    let seconds = started.elapsed().as_secs_f64();
                    let r = Restored {
                        id: format!("{:016x}", chain.last().map_or(id, |m| m.id)),
                        skipped,
                        entries: loaded.iter().map(|(_, n)| n).sum(),
                        tables: loaded,
                        dropped,
                        bytes,
                        seconds,
                        mb_per_s: bytes as f64 / 1e6 / seconds.max(1e-9),
                    };
                    info!(
                        id = %r.id,
                        tables = r.tables.len(),
                        entries = r.entries,
                        dropped = r.dropped.iter().map(|(_, n)| n).sum::<u64>(),
                        seconds = r.seconds,
                        mb_per_s = r.mb_per_s,
                        "checkpoint restored"
                    );
                    *self.last_restore.lock() = Some(r.clone());
                    return Ok(Some(r));
                }
                Err(f) => {
                    // One line per checkpoint tried, naming it and why.
                    let (why, broken) = match f {
                        Failure::Refused(e) => {
                            *self.restoring.lock() = None;
                            return Err(e);
                        }
                        Failure::Known(b) if b == id => ("it was found corrupt above".to_string(), false),
                        Failure::Known(b) => (format!("its base {b:016x} was found unusable above"), false),
                        Failure::Unusable(e) => {
                            if let Some(d) = e.damaged_checkpoint() {
                                self.catalog.mark_corrupt(d, &e.to_string());
                                bad.push(d);
                            }
                            let broken = matches!(
                                e,
                                hkv_checkpoint::Error::BrokenChain { .. } | hkv_checkpoint::Error::NotFound(_)
                            );
                            (e.to_string(), broken)
                        }
                    };
                    let line = format!("checkpoint {id:016x} not restored: {why}");
                    if which != "latest" {
                        *self.restoring.lock() = None;
                        // An id the catalog does not list, or a chain whose
                        // base is gone, is the caller's to fix, not the daemon's.
                        let listed = self.catalog.list().is_ok_and(|l| l.iter().any(|l| l.id == id));
                        let not_found = !listed || broken;
                        return Err(ProtoError::new(
                            if not_found { ErrorCode::NotFound } else { ErrorCode::Internal },
                            if why.contains("hkvctl checkpoints") {
                                why.clone()
                            } else {
                                format!("{why}; restore another complete checkpoint instead (hkvctl checkpoints)")
                            },
                        ));
                    }
                    warn!(checkpoint = %format!("{id:016x}"), reason = %why, "checkpoint skipped; trying the previous complete one");
                    skipped.push(line);
                }
            }
        }
        *self.restoring.lock() = None;
        Err(ProtoError::new(
            ErrorCode::Internal,
            format!("no usable checkpoint among the {tried} tried:\n  {}", skipped.join("\n  ")),
        ))
    }

    /// Restores a chain: each table of its last checkpoint gets exactly the
    /// entries it held then, each loaded once with its score; every entry
    /// that could not be placed is counted. Returns per table the entries
    /// placed and dropped, and the chunk bytes read.
    ///
    /// Everything that can be refused is checked first: dims and policies,
    /// then every table is *built* (charged to the memory budget) before any
    /// entry is read: the missing ones from the checkpoint's specs, and a
    /// fresh copy of each running one with its running spec. A refusal
    /// (`resource_exhausted`, …) drops what was built and restores nothing.
    ///
    /// Then one pass reads the chain: a reader thread reads and verifies
    /// each chunk (its checksum) while this thread loads the previous one
    /// into the built tables, so disk reads overlap loading and each chunk
    /// is read once. Built tables are invisible to clients: a corrupt or
    /// missing chunk found half way drops them, and nothing a client sees
    /// has changed. Only when every chunk verified are they swapped in, all
    /// at once ([`Router::install`]); writes made to a restored table while
    /// the restore ran are replaced with it.
    ///
    /// A running table for which the budget has no room for a copy is
    /// restored in place instead: its chunks are verified in the same pass,
    /// and only after every chunk of the chain verified is it emptied and
    /// loaded (a second read of its chunks).
    fn load_chain(
        &self,
        router: &Router,
        chain: &[Manifest],
        rt: &tokio::runtime::Handle,
        progress: &dyn Fn(&str, u64, u64, u64, u64),
    ) -> Result<Loaded, Failure> {
        let target = chain.last().ok_or_else(|| Failure::Refused(internal("an empty chain")))?;
        // Check every table before loading any.
        for t in &target.tables {
            if let Ok(running) = router.table(&t.name) {
                let mut diff = vec![];
                if running.spec.dim != t.dim {
                    diff.push(format!("dim {} here, {} in the checkpoint", running.spec.dim, t.dim));
                }
                if running.spec.policy != t.policy {
                    diff.push(format!("policy {} here, {} in the checkpoint", running.spec.policy, t.policy));
                }
                if !diff.is_empty() {
                    return Err(Failure::Refused(ProtoError::bad_request(format!(
                        "checkpoint {:016x} cannot be restored into table {:?}: {}; drop the table or restore elsewhere",
                        target.id,
                        t.name,
                        diff.join(", ")
                    ))));
                }
            }
        }
        // Per table, the manifests to apply: from the last holding it whole.
        let plan: Vec<(&TableEntry, Vec<(u64, &TableEntry)>)> = target
            .tables
            .iter()
            .map(|t| {
                let from = chain.iter().rposition(|m| m.tables.iter().any(|x| x.name == t.name && x.full)).unwrap_or(0);
                let parts =
                    chain[from..].iter().filter_map(|m| m.tables.iter().find(|x| x.name == t.name).map(|x| (m.id, x)));
                (t, parts.collect())
            })
            .collect();
        // Every chunk, in the order it is applied: per table, newest part
        // first when a key list decides (the first version of a key seen wins).
        let has_live: Vec<bool> = plan.iter().map(|(t, _)| !t.full && !t.keys.is_empty()).collect();
        let work: Vec<(usize, u64, &hkv_checkpoint::ChunkRef)> = plan
            .iter()
            .enumerate()
            .flat_map(|(i, (_, parts))| {
                let order: Vec<&(u64, &TableEntry)> =
                    if has_live[i] { parts.iter().rev().collect() } else { parts.iter().collect() };
                order.into_iter().flat_map(move |(id, te)| te.chunks.iter().map(move |c| (i, *id, c)))
            })
            .collect();
        let total: u64 = work.iter().map(|(_, _, c)| c.entries).sum();
        // An incremental's key lists name every key the table held: older
        // parts of the chain load only those (erasures and evictions since
        // the base stay gone), and each key only from its newest part.
        let mut lives: Vec<Option<Vec<u64>>> = vec![];
        for (i, (t, _)) in plan.iter().enumerate() {
            lives.push(if has_live[i] {
                let mut keys = vec![];
                for c in &t.keys {
                    keys.extend(self.catalog.read_keys(target.id, c).map_err(Failure::Unusable)?);
                }
                keys.sort_unstable();
                keys.dedup();
                Some(keys)
            } else {
                None
            });
        }
        let mut seen: Vec<Vec<bool>> = lives.iter().map(|l| vec![false; l.as_ref().map_or(0, |k| k.len())]).collect();
        let mut max_score = vec![0u64; plan.len()];
        let mut lost = vec![0u64; plan.len()];
        let (mut done, mut bytes) = (0u64, 0u64);
        // Loads one verified chunk into `into`.
        let mut apply = |i: usize, mut chunk: hkv_checkpoint::Chunk, into: &crate::router::Table| {
            if let Some(live) = &lives[i] {
                chunk = keep_newest(chunk, live, &mut seen[i]);
            }
            if chunk.keys.is_empty() {
                return Ok(());
            }
            max_score[i] = chunk.scores.iter().copied().fold(max_score[i], u64::max);
            let s = rt
                .block_on(router.load_into(into, chunk.keys, chunk.values, chunk.scores))
                .map_err(Failure::Refused)?;
            // Evicted: a restored entry lost its slot to another; rejected: one never placed.
            lost[i] += s.evicted + s.rejected;
            Ok(())
        };
        let check_dim = |i: usize, id: u64, c: &hkv_checkpoint::ChunkRef, chunk: &hkv_checkpoint::Chunk| {
            if chunk.dim == plan[i].0.dim {
                return Ok(());
            }
            Err(Failure::Unusable(hkv_checkpoint::Error::CorruptChunk {
                id,
                chunk: c.key.clone(),
                why: format!("dim {}, the manifest says {}", chunk.dim, plan[i].0.dim),
            }))
        };
        let mut built: Vec<Option<Arc<crate::router::Table>>> = vec![None; plan.len()];
        let running: Vec<Option<Arc<crate::router::Table>>> =
            plan.iter().map(|(t, _)| router.table(&t.name).ok()).collect();
        let consumed = std::sync::atomic::AtomicU64::new(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| -> Result<(), Failure> {
            // Tells the prefetcher to stop however this scope is left.
            struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Relaxed);
                }
            }
            let _stop = Stop(&stop);
            // Reads the chunk files in order into the page cache, up to
            // 512 MB ahead of the loader, from before the tables are built:
            // zeroing a large table's memory takes seconds of CPU, during
            // which the disk would otherwise sit idle. Correctness never
            // depends on it (the reader verifies what it reads itself).
            let (work, catalog, consumed, stop) = (&work, &self.catalog, &consumed, &stop);
            s.spawn(move || {
                let mut buf = vec![];
                let mut ahead = 0u64;
                for (_, _, c) in work.iter() {
                    while ahead.saturating_sub(consumed.load(Relaxed)) > 512 << 20 {
                        if stop.load(Relaxed) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    if stop.load(Relaxed) {
                        return;
                    }
                    buf.clear();
                    let read = std::fs::File::open(catalog.chunk_path(c))
                        .and_then(|mut f| std::io::Read::read_to_end(&mut f, &mut buf));
                    if read.is_err() {
                        return;
                    }
                    ahead += c.bytes;
                }
            });
            // Build every table before reading any entry: missing ones first
            // (they must fit), then copies of running ones (in place if not).
            for pass in [false, true] {
                for (i, (t, _)) in plan.iter().enumerate() {
                    if running[i].is_some() != pass {
                        continue;
                    }
                    let spec: TableSpec = match &running[i] {
                        Some(r) => r.spec.clone(),
                        None => serde_json::from_value(t.spec.clone()).map_err(|e| {
                            Failure::Unusable(hkv_checkpoint::Error::CorruptManifest {
                                id: target.id,
                                why: format!("table {:?}: spec: {e}", t.name),
                            })
                        })?,
                    };
                    match rt.block_on(router.build_table(spec)) {
                        Ok(b) => built[i] = Some(b),
                        // No room for a copy of a running table: restore it in place.
                        Err(e) if pass && e.code == ErrorCode::ResourceExhausted => {
                            info!(table = %t.name, reason = %e.message, "no memory for a copy: the table is restored in place after verification");
                        }
                        Err(mut e) => {
                            e.message = format!(
                                "checkpoint {:016x} not restored (nothing was changed): table {:?}: {}",
                                target.id, t.name, e.message
                            );
                            return Err(Failure::Refused(e));
                        }
                    }
                }
            }
            // The reader: reads and verifies each chunk while the previous
            // one loads; four in flight (32 MiB by default).
            let (tx, rx) = std::sync::mpsc::sync_channel(4);
            s.spawn(move || {
                for (j, (_, id, c)) in work.iter().enumerate() {
                    let r = catalog.read_chunk(*id, c);
                    let failed = r.is_err();
                    if tx.send((j, r)).is_err() || failed {
                        return;
                    }
                }
            });
            for (j, r) in rx {
                let (i, id, c) = work[j];
                let chunk = r.map_err(Failure::Unusable)?;
                check_dim(i, id, c, &chunk)?;
                done += chunk.keys.len() as u64;
                bytes += c.bytes;
                consumed.store(bytes, Relaxed);
                if let Some(b) = &built[i] {
                    apply(i, chunk, b)?;
                }
                progress("load", target.id, done, total, bytes);
            }
            Ok(())
        })?;
        if done < total {
            // The reader stopped without an error: cannot happen, but never install a partial table.
            return Err(Failure::Refused(internal("the chunk reader stopped early")));
        }
        // Every chunk verified: from here on the restore changes what clients see.
        // A restore ends the chain: the next checkpoint is full.
        self.incrementals.store(u32::MAX, Relaxed);
        for (i, (t, _)) in plan.iter().enumerate() {
            let (Some(r), None) = (&running[i], &built[i]) else { continue };
            rt.block_on(router.execute(Request::Clear { table: t.name.clone() })).map_err(Failure::Refused)?;
            for &(_, id, c) in work.iter().filter(|w| w.0 == i) {
                let chunk = self.catalog.read_chunk(id, c).map_err(|e| Failure::Refused(internal(e)))?;
                apply(i, chunk, r)?;
            }
        }
        let mut fresh = vec![];
        for (i, b) in built.iter().enumerate() {
            if let (Some(b), Some(r)) = (b, &running[i]) {
                b.epoch.store(r.epoch.load(Relaxed), Relaxed);
            }
            fresh.extend(b.clone());
        }
        router.install(fresh);
        let (mut placed_all, mut dropped) = (vec![], vec![]);
        for (i, (t, _)) in plan.iter().enumerate() {
            let Some(table) = built[i].as_ref().or(running[i].as_ref()) else { continue };
            let resume = resume_point(t, target, max_score[i]);
            for shard in &table.shards {
                shard.resume_after(resume);
            }
            // What the restore wrote is the state at the checkpoint, not a change since.
            table.untracked.store(false, Relaxed);
            let placed = table.shards.iter().map(|s| s.size()).sum();
            if lost[i] > 0 {
                warn!(
                    table = %t.name,
                    dropped = lost[i],
                    placed,
                    capacity = table.shards.iter().map(|s| s.capacity()).sum::<u64>(),
                    "restore could not place every entry: buckets overflowed (the table cannot grow further)"
                );
            }
            placed_all.push((t.name.clone(), placed));
            dropped.push((t.name.clone(), lost[i]));
        }
        Ok((placed_all, dropped, bytes))
    }
}

/// Per table the entries placed, per table those dropped, and chunk bytes read.
type Loaded = (Vec<(String, u64)>, Vec<(String, u64)>, u64);

/// Why a chain was not restored.
enum Failure {
    /// Its files: corrupt, missing or unreadable (with `latest`, the
    /// previous complete checkpoint is tried).
    Unusable(hkv_checkpoint::Error),
    /// Refused or failed as a request (returned as it is).
    Refused(ProtoError),
    /// Its chain holds a checkpoint this restore already found unusable
    /// (that one's id): skipped without reading it again.
    Known(u64),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(policy: &str, watermarks: Vec<u64>, clocks: Vec<u64>) -> TableEntry {
        TableEntry {
            name: "t".into(),
            dim: 1,
            policy: policy.parse().unwrap(),
            mode: hkv_proto::Mode::Single,
            spec: serde_json::json!({}),
            shards: 1,
            entries: 1,
            full: true,
            watermarks,
            clocks,
            chunks: vec![],
            keys: vec![],
        }
    }

    /// A loaded score of 2^64 - 1 made every later write score 2^64 - 1 after
    /// a restart (the clock resumed past the highest restored score). The
    /// recorded clock decides now; older manifests cap the restored maximum.
    #[test]
    fn the_clock_resumes_from_the_recorded_clock_or_a_capped_maximum() {
        let m = Manifest {
            format: 1,
            id: 1,
            created_unix_ms: 1000,
            finished_unix_ms: 1009,
            daemon_version: "t".into(),
            kind: Kind::Full,
            tables: vec![],
        };
        assert_eq!(resume_point(&entry("lru", vec![5, 7], vec![90, 80]), &m, u64::MAX), 90);
        // No clocks: capped at the watermark plus 10 ms in ns.
        assert_eq!(resume_point(&entry("lru", vec![5, 7], vec![]), &m, u64::MAX), 7 + 10_000_000);
        assert_eq!(resume_point(&entry("lru", vec![5, 7], vec![]), &m, 6), 6, "a legit maximum stays");
        let wm = (3u64 << 32) | 100;
        assert_eq!(resume_point(&entry("epoch-lru", vec![wm], vec![]), &m, u64::MAX) >> 32, 3);
        assert_eq!(resume_point(&entry("epoch-lfu", vec![3 << 32], vec![]), &m, u64::MAX), (3 << 32) | 0xffff_ffff);
        assert_eq!(resume_point(&entry("lru", vec![], vec![]), &m, 42), 42, "nothing recorded: today's rule");
    }
}
