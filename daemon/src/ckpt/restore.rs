//! A restore: the chain of the checkpoint asked for (or the newest usable
//! one) verified and loaded into tables built beside the running ones,
//! which are swapped in only once every chunk verified.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkv_checkpoint::{Manifest, TableEntry};
use hkv_proto::{CheckpointId, ErrorCode, ProtoError, TableSpec};
use hkv_shard::ScorePolicy;
use tracing::{info, warn};

use super::{internal, Checkpoints, Progress, Restored};
use crate::router::{Part, Router, Table};

/// Threads reading (and verifying) a restore's chunks: a quarter of the
/// cores, 2 to 6. Verifying costs about as much as reading: on the H200
/// host (16 cores, an NVMe-backed disk) two readers were busy the whole of
/// a 1 GiB restore, at 0.77 of `dd iflag=direct`.
fn readers(config: &crate::config::CheckpointConfig) -> usize {
    config
        .restore_readers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get() / 4).clamp(2, 6))
}

/// Chunk buffers a restore reads ahead into (8 MiB chunks by default: 64
/// MiB with two readers): one per reader at work, one being split, and
/// the rest ahead of the splitter.
fn buffers(readers: usize) -> usize {
    2 * readers + 4
}

/// Where a restore's time went (the "restore stages" log line).
#[derive(Default)]
struct Stages {
    build: Duration,
    read: Duration,
    wait: Duration,
    split: Duration,
    load: Duration,
}

/// A chunk to read: the index of its table in the plan, its checkpoint,
/// and where it is.
type Work<'a> = (usize, u64, &'a hkv_checkpoint::ChunkRef);

/// Starts [`readers`] threads in `s` that read and verify the chunks of
/// `work`, each into a buffer taken from `pool` (so at most as many ahead
/// as the pool holds), one reading while another verifies (and the disk
/// has a read queued while a thread waits for a core). Each takes a
/// buffer, then the next chunk, so the lowest chunk not yet read always has
/// a buffer. Returns the chunks in `work`'s order, however the readers
/// finish them, and the readers (each answering how long it was busy).
#[allow(clippy::type_complexity)]
fn spawn_readers<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    catalog: &'env hkv_checkpoint::Catalog,
    work: &'env [Work<'env>],
    pool: std::sync::mpsc::Receiver<Vec<u8>>,
    readers: usize,
) -> (
    impl Iterator<Item = (usize, Result<hkv_checkpoint::chunk::Read, hkv_checkpoint::Error>)>,
    Vec<std::thread::ScopedJoinHandle<'scope, Duration>>,
) {
    let n = readers;
    let (tx, rx) = std::sync::mpsc::sync_channel(buffers(n));
    let (pool, next) = (Arc::new(std::sync::Mutex::new(pool)), Arc::new(AtomicUsize::new(0)));
    let readers = (0..n)
        .map(|_| {
            let (tx, pool, next) = (tx.clone(), pool.clone(), next.clone());
            s.spawn(move || {
                let mut busy = Duration::ZERO;
                // Bounded: one chunk of `work` per turn.
                while let Ok(buf) = pool.lock().map_err(drop).and_then(|p| p.recv().map_err(drop)) {
                    let j = next.fetch_add(1, Relaxed);
                    let Some((_, id, c)) = work.get(j) else { break };
                    let t0 = Instant::now();
                    let r = catalog.read_chunk_in(*id, c, buf);
                    busy += t0.elapsed();
                    let failed = r.is_err();
                    if tx.send((j, r)).is_err() || failed {
                        break;
                    }
                }
                busy
            })
        })
        .collect();
    let mut ahead = std::collections::BTreeMap::new();
    let mut due = 0;
    let in_order = std::iter::from_fn(move || loop {
        if let Some(r) = ahead.remove(&due) {
            due += 1;
            return Some((due - 1, r));
        }
        let (j, r) = rx.recv().ok()?;
        ahead.insert(j, r);
    });
    (in_order, readers)
}

/// The entries of a verified chunk for `into`, decoded straight into one
/// part per shard of it: only those live (in the sorted `live`, when a key
/// list decides) and not yet loaded from a newer part of the chain, which
/// are marked loaded in `seen`; `max_score` raised to their highest score.
fn split(
    v: hkv_checkpoint::chunk::View<'_>,
    into: &Table,
    live: Option<&[u64]>,
    seen: &mut [bool],
    max_score: &mut u64,
) -> Vec<Part> {
    let parts = v.split(
        into.shards(),
        |k| Router::shard_of(into, k),
        |k| match live {
            None => true,
            Some(live) => live.binary_search(&k).is_ok_and(|pos| !std::mem::replace(&mut seen[pos], true)),
        },
    );
    parts
        .into_iter()
        .map(|c| {
            *max_score = c.scores.iter().copied().fold(*max_score, u64::max);
            (c.keys, c.values, c.scores)
        })
        .collect()
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

/// What a restore is for, which decides what a refusal for a running
/// table that differs from the checkpoint tells the operator to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Occasion {
    /// A client's `restore` into the running daemon: drop the table, or
    /// restore elsewhere.
    Request,
    /// `--restore` at start, whose running tables are the config file's:
    /// dropping one is no answer (the next start declares it again); fix
    /// it in the config file, or start with `--restore none`.
    Start,
}

impl Checkpoints {
    /// Restores `which` (the newest or one by id). With `latest`, a corrupt
    /// checkpoint is skipped with a warning and the previous complete one is
    /// tried. Nothing a client can see changes before every chunk of the
    /// chosen chain verified (see [`Checkpoints::load_chain`]).
    pub async fn restore(
        self: &Arc<Self>,
        router: Arc<Router>,
        which: CheckpointId,
        occasion: Occasion,
    ) -> Result<Option<Restored>, ProtoError> {
        let _gate = self.gate.lock().await;
        let ck = self.clone();
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || ck.restore_blocking(&router, which, occasion, &handle))
            .await
            .map_err(internal)?
    }

    fn restore_blocking(
        &self,
        router: &Router,
        which: CheckpointId,
        occasion: Occasion,
        rt: &tokio::runtime::Handle,
    ) -> Result<Option<Restored>, ProtoError> {
        let started = Instant::now();
        let candidates: Vec<u64> = match which {
            CheckpointId::Latest => self
                .catalog
                .list()
                .map_err(internal)?
                .into_iter()
                .filter(|l| l.manifest.is_some())
                .map(|l| l.id)
                .collect(),
            CheckpointId::Id(id) => vec![id],
        };
        if candidates.is_empty() {
            return Ok(None);
        }
        let mut skipped = vec![];
        // Checkpoints found unusable by this restore, with why: a candidate
        // whose chain holds one is skipped without reading it again.
        let mut bad: Vec<u64> = vec![];
        // Whether every failure so far was a damaged file or broken chain.
        let mut all_damaged = true;
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
                self.load_chain(router, &chain, occasion, rt, &progress).map(|l| (chain, l))
            });
            match loaded {
                Ok((chain, (loaded, dropped, bytes))) => {
                    *self.restoring.lock() = None;
                    for m in &chain {
                        self.catalog.clear_corrupt(m.id);
                        // Restorable: every file it needs was just read and verified.
                        self.catalog.mark_verified(m.id);
                    }
                    if let Some(m) = chain.last() {
                        self.catalog.pin(m.id);
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
                    let (why, broken, damaged) = match f {
                        Failure::Refused(e) => {
                            *self.restoring.lock() = None;
                            return Err(e);
                        }
                        Failure::Known(b) if b == id => ("it was found corrupt above".to_string(), false, true),
                        Failure::Known(b) => (format!("its base {b:016x} was found unusable above"), false, true),
                        Failure::Unusable(e) => {
                            let damaged = e.damaged_checkpoint();
                            if let Some(d) = damaged {
                                self.catalog.mark_corrupt(d, &e.to_string());
                                bad.push(d);
                            }
                            let broken = matches!(
                                e,
                                hkv_checkpoint::Error::BrokenChain { .. } | hkv_checkpoint::Error::NotFound(_)
                            );
                            (e.to_string(), broken, damaged.is_some() || broken)
                        }
                    };
                    all_damaged &= damaged;
                    let line = format!("checkpoint {id:016x} not restored: {why}");
                    if which != CheckpointId::Latest {
                        *self.restoring.lock() = None;
                        // An id the catalog does not list, or a chain whose
                        // base is gone, is the caller's to fix, not the daemon's.
                        let listed = self.catalog.list().is_ok_and(|l| l.iter().any(|l| l.id == id));
                        let code = match (!listed || broken, damaged) {
                            (true, _) => ErrorCode::NotFound,
                            // The checkpoint's files, not the daemon, are at fault.
                            (false, true) => ErrorCode::CorruptCheckpoint,
                            (false, false) => ErrorCode::Internal,
                        };
                        return Err(ProtoError::new(
                            code,
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
            if all_damaged { ErrorCode::CorruptCheckpoint } else { ErrorCode::Internal },
            format!("no usable checkpoint among the {tried} tried:\n  {}", skipped.join("\n  ")),
        ))
    }

    /// Per table of `target` whose key lists decide (`has_live`), every
    /// key it held, sorted.
    fn live_keys(
        &self,
        target: &Manifest,
        tables: &[&TableEntry],
        has_live: &[bool],
    ) -> Result<Vec<Option<Vec<u64>>>, Failure> {
        let mut lives = vec![];
        for (t, &live) in tables.iter().zip(has_live) {
            lives.push(if live {
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
        Ok(lives)
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
        occasion: Occasion,
        rt: &tokio::runtime::Handle,
        progress: &dyn Fn(&str, u64, u64, u64, u64),
    ) -> Result<Loaded, Failure> {
        let target = chain.last().ok_or_else(|| Failure::Refused(internal("an empty chain")))?;
        // Its tables are neither dropped nor created until it ends, from
        // before the running ones are looked at.
        let _held = router.hold_for_restore(target.tables.iter().map(|t| t.name.clone()).collect());
        // Check every table before loading any.
        check_compatible(router, target, occasion)?;
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
        let work: Vec<Work> = plan
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
        let lives = self.live_keys(target, &plan.iter().map(|(t, _)| *t).collect::<Vec<_>>(), &has_live)?;
        let mut seen: Vec<Vec<bool>> = lives.iter().map(|l| vec![false; l.as_ref().map_or(0, |k| k.len())]).collect();
        let mut max_score = vec![0u64; plan.len()];
        let (mut done, mut bytes) = (0u64, 0u64);
        let check_dim = |i: usize, id: u64, c: &hkv_checkpoint::ChunkRef, dim: usize| {
            if dim == plan[i].0.dim {
                return Ok(());
            }
            Err(Failure::Unusable(hkv_checkpoint::Error::CorruptChunk {
                id,
                chunk: c.key.clone(),
                why: format!("dim {dim}, the manifest says {}", plan[i].0.dim),
            }))
        };
        let mut built: Vec<Option<Arc<Table>>> = vec![None; plan.len()];
        let running: Vec<Option<Arc<Table>>> = plan.iter().map(|(t, _)| router.table(&t.name).ok()).collect();
        let mut stages = Stages::default();
        let lost = std::thread::scope(|s| -> Result<Vec<u64>, Failure> {
            // The readers read each chunk with O_DIRECT into one of
            // `buffers` reused buffers and verify it, up to that many ahead of
            // the splitter (this thread), which hands the buffer back once
            // it decoded the entries into per-shard arrays; the loader
            // thread sends those to the shards while the next chunk splits.
            // The disk reads from the first moment, while the tables are
            // built (see `build_tables`), the shards load, and this thread splits.
            let readers = readers(&self.config);
            let buffers = buffers(readers);
            let (pool_tx, pool_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(buffers);
            for _ in 0..buffers {
                let _ = pool_tx.send(vec![]);
            }
            let (rx, readers) = spawn_readers(s, &self.catalog, &work, pool_rx, readers);
            let (load_tx, load_rx) = std::sync::mpsc::sync_channel::<(usize, Arc<Table>, Vec<Part>)>(1);
            let tables = plan.len();
            let loader = s.spawn(move || -> Result<(Vec<u64>, Duration), Failure> {
                let mut lost = vec![0u64; tables];
                let mut busy = Duration::ZERO;
                for (i, table, parts) in load_rx {
                    let t0 = Instant::now();
                    let s = rt.block_on(router.load_parts(&table, parts)).map_err(Failure::Refused)?;
                    busy += t0.elapsed();
                    // Evicted: a restored entry lost its slot to another; rejected: one never placed.
                    lost[i] += s.evicted + s.rejected;
                }
                Ok((lost, busy))
            });
            let entries: Vec<&TableEntry> = plan.iter().map(|(t, _)| *t).collect();
            let t0 = Instant::now();
            built = build_tables(router, rt, target, &entries, &running, self.config.backing_passwords.as_deref())?;
            stages.build = t0.elapsed();
            // The built tables' memory faulted in beside the loads, on the
            // shards' spare actor threads, until the loads end: the
            // kernel's zeroing of fresh pages (most of a restore's CPU, all
            // of a table's pages with huge pages) then runs while the
            // loads wait for the disk, not only in them.
            struct Stop(Arc<AtomicBool>);
            impl Drop for Stop {
                fn drop(&mut self) {
                    self.0.store(true, Relaxed);
                }
            }
            let stop = Stop(Arc::new(AtomicBool::new(false)));
            let fresh: Vec<Arc<Table>> = built.iter().flatten().cloned().collect();
            let flag = stop.0.clone();
            s.spawn(move || {
                for t in fresh {
                    // A prefault is only ever a head start: its failure changes nothing.
                    let _ = rt.block_on(router.on_each(&t, || crate::shard_ops::Prefault(flag.clone())));
                }
            });
            let split_all = || -> Result<(), Failure> {
                let mut waited = Instant::now();
                for (j, r) in rx {
                    stages.wait += waited.elapsed();
                    let (i, id, c) = work[j];
                    let read = r.map_err(Failure::Unusable)?;
                    check_dim(i, id, c, read.view().dim)?;
                    done += read.view().n as u64;
                    bytes += c.bytes;
                    if let Some(b) = &built[i] {
                        let t0 = Instant::now();
                        let parts = split(read.view(), b, lives[i].as_deref(), &mut seen[i], &mut max_score[i]);
                        stages.split += t0.elapsed();
                        if parts.iter().any(|p| !p.0.is_empty()) && load_tx.send((i, b.clone(), parts)).is_err() {
                            // The loader stopped on an error, which it returns.
                            break;
                        }
                    }
                    let _ = pool_tx.send(read.into_buf());
                    progress("load", target.id, done, total, bytes);
                    waited = Instant::now();
                }
                Ok(())
            };
            let split_result = split_all();
            drop(stop);
            // Ends the loader's loop, and the reader's wait for a buffer.
            drop((load_tx, pool_tx));
            let loaded =
                loader.join().map_err(|_| Failure::Refused(internal("the restore's loader thread panicked")))?;
            stages.read = readers.into_iter().map(|r| r.join().unwrap_or_default()).sum();
            split_result?;
            let (lost, busy) = loaded?;
            stages.load = busy;
            Ok(lost)
        })?;
        let mut lost = lost;
        if done < total {
            // The reader stopped without an error: cannot happen, but never install a partial table.
            return Err(Failure::Refused(internal("the chunk reader stopped early")));
        }
        info!(
            build_s = stages.build.as_secs_f64(),
            read_s = stages.read.as_secs_f64(),
            wait_for_reads_s = stages.wait.as_secs_f64(),
            split_s = stages.split.as_secs_f64(),
            load_s = stages.load.as_secs_f64(),
            "restore stages (read: the reader busy reading and verifying; load: the shards busy loading)"
        );
        // Every chunk verified: from here on the restore changes what clients see.
        // A restore ends the chain: the next checkpoint is full.
        self.incrementals.store(u32::MAX, Relaxed);
        // Backed tables serve again once their rows are checked against
        // their clusters (the caller's `Router::release_unchecked`).
        router.hold_unchecked(
            built
                .iter()
                .zip(&running)
                .filter_map(|(b, r)| b.as_ref().or(r.as_ref()))
                .filter(|t| t.spec.backing.is_some())
                .map(|t| t.spec.name.clone()),
        );
        for i in 0..plan.len() {
            let (Some(r), None) = (&running[i], &built[i]) else { continue };
            rt.block_on(router.clear(r)).map_err(Failure::Refused)?;
            let mut buf = vec![];
            for &(_, id, c) in work.iter().filter(|w| w.0 == i) {
                let read = self.catalog.read_chunk_in(id, c, buf).map_err(|e| Failure::Refused(internal(e)))?;
                let parts = split(read.view(), r, lives[i].as_deref(), &mut seen[i], &mut max_score[i]);
                let s = rt.block_on(router.load_parts(r, parts)).map_err(Failure::Refused)?;
                lost[i] += s.evicted + s.rejected;
                buf = read.into_buf();
            }
        }
        router.install(built.iter().flatten().cloned().collect());
        let tables: Vec<Option<&Arc<Table>>> =
            built.iter().zip(&running).map(|(b, r)| b.as_ref().or(r.as_ref())).collect();
        let (placed_all, dropped) = settle(router, rt, target, &tables, &max_score, &lost)?;
        Ok((placed_all, dropped, bytes))
    }
}

/// Per table the entries placed, per table those dropped, and chunk bytes read.
/// A count per table name.
type PerTable = Vec<(String, u64)>;

/// After a restore's entries are in: each table's clock and epoch moved past
/// them, its change tracking reset, and per table the entries placed and
/// those dropped (`lost`), with a warning where any were.
fn settle(
    router: &Router,
    rt: &tokio::runtime::Handle,
    target: &Manifest,
    tables: &[Option<&Arc<Table>>],
    max_score: &[u64],
    lost: &[u64],
) -> Result<(PerTable, PerTable), Failure> {
    let (mut placed_all, mut dropped) = (vec![], vec![]);
    for (i, t) in target.tables.iter().enumerate() {
        let Some(table) = tables[i] else { continue };
        let resume = resume_point(t, target, max_score[i]);
        rt.block_on(router.resume_after(table, resume)).map_err(Failure::Refused)?;
        // The shards' epoch moved up to the restored one (`resume_after`): a
        // client's epoch below it is a lowered epoch (issue 32). The table
        // stays marked untracked by the restore's own loads; the chain ended
        // anyway, so the next checkpoint is full.
        if matches!(t.policy.as_str().parse(), Ok(ScorePolicy::EpochLru | ScorePolicy::EpochLfu)) {
            table.epoch.fetch_max((resume >> 32) as u32, std::sync::atomic::Ordering::SeqCst);
        }
        let sizes = rt.block_on(router.sizes(table)).map_err(Failure::Refused)?;
        let placed = sizes.iter().map(|s| s.0).sum();
        if lost[i] > 0 {
            warn!(
                table = %t.name,
                dropped = lost[i],
                placed,
                capacity = sizes.iter().map(|s| s.1).sum::<u64>(),
                "restore could not place every entry: buckets overflowed (the table cannot grow further)"
            );
        }
        placed_all.push((t.name.clone(), placed));
        dropped.push((t.name.clone(), lost[i]));
    }
    Ok((placed_all, dropped))
}

/// A table spec as a manifest holds it. A manifest written before specs
/// carried `lfu_ties` is of a daemon whose lfu tables used the reference's
/// rule (plain frequencies as scores): its tables restore as `lowest-slot`,
/// so their scores keep their meaning; a spec that names the rule keeps it.
/// Tables of other policies restore with the default rule, which they do
/// not use (a daemon before 2026-12-04 let a config file name
/// `lowest-slot` for them; tables are now refused that).
pub(crate) fn manifest_spec(v: &serde_json::Value) -> Result<TableSpec, serde_json::Error> {
    let mut spec: TableSpec = serde_json::from_value(v.clone())?;
    if spec.policy != hkv_proto::Policy::Lfu {
        spec.lfu_ties = hkv_proto::LfuTies::Lru;
    } else if v.get("lfu_ties").is_none() {
        spec.lfu_ties = hkv_proto::LfuTies::LowestSlot;
    }
    Ok(spec)
}

/// Builds every table of `target` before any entry is read (invisible to
/// clients until installed): missing ones first, from the checkpoint's
/// specs (they must fit), then copies of the `running` ones with their
/// running specs (None: no room for a copy, restored in place). A backed
/// table's cluster password, which checkpoints do not keep, comes from the
/// `passwords` file ([`with_password`]).
fn build_tables(
    router: &Router,
    rt: &tokio::runtime::Handle,
    target: &Manifest,
    tables: &[&TableEntry],
    running: &[Option<Arc<Table>>],
    passwords: Option<&Path>,
) -> Result<Vec<Option<Arc<Table>>>, Failure> {
    let mut built = vec![None; tables.len()];
    for pass in [false, true] {
        for (i, t) in tables.iter().enumerate() {
            if running[i].is_some() != pass {
                continue;
            }
            let spec: TableSpec = match &running[i] {
                Some(r) => r.spec.clone(),
                None => {
                    let spec = manifest_spec(&t.spec).map_err(|e| {
                        Failure::Unusable(hkv_checkpoint::Error::CorruptManifest {
                            id: target.id,
                            why: format!("table {:?}: spec: {e}", t.name),
                        })
                    })?;
                    with_password(spec, passwords).map_err(|mut e| {
                        e.message =
                            format!("checkpoint {:016x} not restored (nothing was changed): {}", target.id, e.message);
                        Failure::Refused(e)
                    })?
                }
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
    Ok(built)
}

/// A restored spec whose backing's password was hidden when it was
/// checkpointed (seeds keep `***`, so that no password lies in clear in
/// the state directory), with the password the operator gave: the line
/// `TABLE PASSWORD` of the `passwords` file (`--backing-passwords`; `#`
/// starts a comment line; the password is the rest of the line after the
/// blanks that follow the name). The file must be readable by its owner
/// only. Without it, or without the table's line, the restore is refused
/// (`bad_request`, naming the table and what to do).
fn with_password(spec: TableSpec, passwords: Option<&Path>) -> Result<TableSpec, ProtoError> {
    let Some(backing) = spec.backing.as_ref().filter(|b| b.password_hidden()) else { return Ok(spec) };
    let refuse = |why: String| {
        ProtoError::new(
            ErrorCode::BadRequest,
            format!(
                "table {:?} is backed by a cluster that asks for a password, which checkpoints do not keep: {why}",
                spec.name
            ),
        )
    };
    let Some(path) = passwords else {
        return Err(refuse(format!(
            "start hkvd with --backing-passwords FILE (checkpoint.backing_passwords), FILE holding the line `{} PASSWORD` \
             (the table's name alone if its cluster asks for none: a table created with an empty password)",
            spec.name
        )));
    };
    let meta = std::fs::metadata(path).map_err(|e| refuse(format!("{}: {e}", path.display())))?;
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(refuse(format!(
                "{} may be read by others than its owner (mode {:o}): chmod 600 it",
                path.display(),
                meta.permissions().mode() & 0o777
            )));
        }
    }
    let text = std::fs::read_to_string(path).map_err(|e| refuse(format!("{}: {e}", path.display())))?;
    // The table's name alone on its line: no password. A table created
    // with an empty one (`redis://:@…`, before create-table dropped it)
    // was checkpointed as `redis://:***@…`, and no line could say so.
    let password = text.lines().filter(|l| !l.trim_start().starts_with('#')).find_map(|l| {
        let (name, rest) = l.trim().split_once(char::is_whitespace).unwrap_or((l.trim(), ""));
        (name == spec.name).then(|| rest.trim_start().to_string())
    });
    match password {
        Some(pw) => {
            let mut spec = TableSpec { backing: Some(backing.with_password(&pw)), ..spec };
            crate::backing::drop_empty_passwords(&mut spec);
            Ok(spec)
        }
        None => Err(refuse(format!(
            "{} has no line `{} PASSWORD` (the table's name alone if its cluster asks for none)",
            path.display(),
            spec.name
        ))),
    }
}

/// Refuses a checkpoint whose tables differ from running tables of the
/// same names in dim (the stored row's width, optimizer state included),
/// optimizer or policy, saying what to do for the `occasion`. Differences
/// the rows survive (backing, capacity) are logged, once no table refused
/// it: a tester was told a capacity was kept by a restore then refused.
/// The refusal names every table that differs, each with its differences
/// (a tester's four tables took four refused restores, one name each).
fn check_compatible(router: &Router, target: &Manifest, occasion: Occasion) -> Result<(), Failure> {
    let mut kept = vec![];
    let mut refused: Vec<(&str, String)> = vec![];
    for t in &target.tables {
        let Ok(running) = router.table(&t.name) else { continue };
        let mut diff = vec![];
        let optimizer = manifest_spec(&t.spec).map(|s| s.optimizer).unwrap_or(running.spec.optimizer);
        if running.config.dim != t.dim {
            // Rows hold an optimizer's state after the values: their width
            // is what must match.
            diff.push(if running.spec.optimizer.is_none() && optimizer.is_none() {
                format!("dim {} here, {} in the checkpoint", running.config.dim, t.dim)
            } else {
                format!("rows of {} floats here, {} in the checkpoint", running.config.dim, t.dim)
            });
        }
        if running.spec.optimizer != optimizer {
            let name = |o: Option<hkv_proto::Optimizer>| o.map_or("none", |o| o.as_str());
            diff.push(format!(
                "optimizer {} here, {} in the checkpoint",
                name(running.spec.optimizer),
                name(optimizer)
            ));
        }
        if running.spec.policy != t.policy {
            diff.push(format!("policy {} here, {} in the checkpoint", running.spec.policy, t.policy));
        }
        // Lfu scores mean different things under the two tie rules.
        // (Lfu only: epoch-lfu scores have no bits for a stamp, its rule is fixed.)
        let lfu = t.policy == hkv_proto::Policy::Lfu;
        let ties = manifest_spec(&t.spec).map(|s| s.lfu_ties).unwrap_or(running.spec.lfu_ties);
        if lfu && running.spec.lfu_ties != ties {
            diff.push(format!("lfu_ties {} here, {ties} in the checkpoint", running.spec.lfu_ties));
        }
        // Differences the rows survive: the running spec (create-table's
        // or the config file's) is kept, and said so, never silently.
        if let Ok(saved) = manifest_spec(&t.spec) {
            let shown = |b: &Option<hkv_proto::BackingSpec>| {
                b.as_ref().map_or("none".to_string(), |b| {
                    let b = b.redacted();
                    format!("{} {}", b.mode.as_str(), b.seeds.join(","))
                })
            };
            let (here, there) = (shown(&running.spec.backing), shown(&saved.backing));
            if here != there {
                kept.push((
                    &t.name,
                    format!(
                        "the running table's backing is kept: {here} here, {there} in the checkpoint \
                         (a table made by create-table or the config file keeps its own spec)"
                    ),
                ));
            }
            // Nor is any other difference of the spec kept silently (a
            // newcomer's dual table restored into a single one with no
            // word).
            let (r, c) = (&running.spec, &saved);
            let others = [
                ("mode", r.mode.as_str().to_string(), c.mode.as_str().to_string()),
                ("max_capacity", r.max_capacity.to_string(), c.max_capacity.to_string()),
                ("max_load_factor", format!("{:?}", r.max_load_factor), format!("{:?}", c.max_load_factor)),
                ("fast_tier_bytes", format!("{:?}", r.fast_tier_bytes), format!("{:?}", c.fast_tier_bytes)),
                ("reads_refresh", format!("{:?}", r.reads_refresh), format!("{:?}", c.reads_refresh)),
            ];
            for (what, here, there) in others.into_iter().filter(|(_, h, t)| h != t) {
                kept.push((
                    &t.name,
                    format!(
                        "the running table's {what} is kept: {here} here, {there} in the checkpoint (a table made \
                         by create-table or the config file keeps its own spec)"
                    ),
                ));
            }
            if running.spec.capacity != saved.capacity {
                kept.push((
                    &t.name,
                    format!(
                        "the running table's capacity is kept: {} here, {} in the checkpoint (as asked for; \
                         each rounded up to whole buckets); entries that do not fit are evicted and counted as \
                         dropped",
                        running.spec.capacity, saved.capacity
                    ),
                ));
            }
        }
        if !diff.is_empty() {
            refused.push((&t.name, diff.join(", ")));
        }
    }
    if !refused.is_empty() {
        let names: Vec<String> = refused.iter().map(|(n, _)| format!("{n:?}")).collect();
        let (them, each) = if refused.len() == 1 { ("the table", "its") } else { ("the tables", "each one's") };
        let what = match occasion {
            Occasion::Request => format!("drop {them} or restore elsewhere"),
            Occasion::Start => format!(
                "{them} {} the config file's: make {each} [[table]] {} match the checkpoint (or remove it, \
                 and the checkpoint's own spec applies), or start with --restore none to start with empty \
                 tables and keep the checkpoint on disk",
                if refused.len() == 1 { "is" } else { "are" },
                names.join(", ")
            ),
        };
        let tables: Vec<String> = refused.iter().map(|(n, d)| format!("table {n:?}: {d}")).collect();
        return Err(Failure::Refused(ProtoError::bad_request(format!(
            "checkpoint {:016x} cannot be restored into {}; {what}",
            target.id,
            tables.join("; ")
        ))));
    }
    for (table, why) in kept {
        warn!(table = %table, checkpoint = %format!("{:016x}", target.id), "{why}");
    }
    Ok(())
}

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
    use hkv_checkpoint::Kind;

    fn entry(policy: &str, watermarks: Vec<u64>, clocks: Vec<u64>) -> TableEntry {
        TableEntry {
            name: "t".into(),
            dim: 1,
            policy: policy.parse().expect("a policy name"),
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

    /// Lfu tables were created with the reference's tie rule before specs
    /// named it; their manifests (no `lfu_ties`) hold plain frequencies, so
    /// they restore as lowest-slot, while a spec that names a rule keeps it.
    #[test]
    fn an_old_manifest_restores_with_the_lowest_slot_rule() {
        let old = serde_json::json!({"name":"t","dim":4,"capacity":1024,"policy":"lfu","mode":"dual"});
        assert_eq!(manifest_spec(&old).unwrap().lfu_ties, hkv_proto::LfuTies::LowestSlot);
        for ties in hkv_proto::LfuTies::ALL {
            let mut spec = hkv_proto::TableSpec::new("t", 4, 1024);
            spec.lfu_ties = *ties;
            // An lru table's rule is the default whatever its manifest says
            // (a config file could name lowest-slot for it before it was refused).
            let v = serde_json::to_value(&spec).unwrap();
            assert_eq!(manifest_spec(&v).unwrap().lfu_ties, hkv_proto::LfuTies::Lru);
            spec.policy = hkv_proto::Policy::Lfu;
            let v = serde_json::to_value(&spec).unwrap();
            assert_eq!(manifest_spec(&v).unwrap().lfu_ties, *ties);
        }
        // A spec sent without the field (a client older than it) gets lru.
        let sent: hkv_proto::TableSpec = serde_json::from_value(old).unwrap();
        assert_eq!(sent.lfu_ties, hkv_proto::LfuTies::Lru);
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
