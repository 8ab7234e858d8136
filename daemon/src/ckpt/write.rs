//! A checkpoint written: every table, each shard exported by its actor in
//! batches of about `chunk_bytes`, each batch written out as a chunk before
//! the next is asked for; incremental checkpoints keep only the entries
//! scored at or above the previous watermark, and the live keys.

use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::time::Instant;

use hkv_checkpoint::{ChunkWriter, Kind, Manifest, TableEntry};
use hkv_proto::ProtoError;
use hkv_shard::{Filter, ScorePolicy};
use tracing::warn;

use super::{internal, kind_name, Checkpoints, Progress};
use crate::router::{Router, Table};

/// Whether an incremental checkpoint can find a table's changes by score:
/// lru and epoch-lru give every write (insert, assign, accum, find_or_insert
/// hit) the clock's score, which is at or above the watermark read before
/// the previous export. The writes that can score lower are recorded as a
/// fact, not inferred: a client's load with verbatim scores and an epoch
/// set below the highest the table ever had mark the table `untracked`
/// before they start and after they end (`Table::untracked_write`), and a
/// clock found below the previous watermark stores the table whole too.
/// lfu, epoch-lfu (an assign without scores keeps the old score) and
/// custom scores do not follow time: those tables are stored whole every
/// time.
fn tracks_changes(policy: &str) -> bool {
    matches!(policy.parse(), Ok(ScorePolicy::Lru | ScorePolicy::EpochLru))
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

impl Checkpoints {
    /// The blocking body of a checkpoint: each shard is exported in batches
    /// of `chunk_bytes` by its actor (messages sent through `rt`), each
    /// batch written out before the next is asked for.
    pub(super) fn write(
        &self,
        router: &Router,
        rt: &tokio::runtime::Handle,
        force_full: bool,
        w: Option<ChunkWriter>,
    ) -> Result<Manifest, ProtoError> {
        // Read with the tables: a table created or dropped from here on
        // makes the next checkpoint full.
        let (generation, tables) = router.tables_at();
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
            None => self.catalog.begin().map_err(|e| self.store_error(e))?,
        };
        let mut total = 0;
        for t in &tables {
            total += rt.block_on(router.sizes(t))?.iter().map(|s| s.0).sum::<u64>();
        }
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
        let mut x = Export { router, rt, w: &mut w, started: Instant::now(), total };
        let mut entries = vec![];
        for (index, t) in tables.iter().enumerate() {
            let prev_t = prev.as_ref().and_then(|p| p.tables.iter().find(|e| e.name == t.spec.name));
            entries.push(self.export_table(&mut x, t, index as u32, prev_t, incremental)?);
        }
        let m = w.commit(kind, entries, env!("CARGO_PKG_VERSION")).map_err(|e| self.store_error(e))?;
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

    /// One table's part of a checkpoint (the `index`th of its manifest):
    /// every shard exported, whole or
    /// (`incremental`, where the table allows it) only what changed since
    /// `prev_t`.
    fn export_table(
        &self,
        x: &mut Export,
        t: &Table,
        index: u32,
        prev_t: Option<&TableEntry>,
        incremental: bool,
    ) -> Result<TableEntry, ProtoError> {
        let dim = t.config.dim;
        // No load, clear, reserve or lowered epoch runs on the table from
        // here until its last shard is exported: each is wholly before or
        // wholly after this checkpoint's part of it.
        let _whole = x.rt.block_on(t.rewrite.read());
        // Taken now: an untracked write that ends from here on (or starts)
        // marks the table again, so the next checkpoint stores it whole.
        let untracked = t.untracked.swap(false, SeqCst);
        // Read before exporting: every later write scores at least this.
        let mut marks = vec![];
        for i in 0..t.shards() {
            marks.push(x.rt.block_on(x.router.clock_score(t, i))?);
        }
        let inc = incremental
            && tracks_changes(t.spec.policy.as_str())
            && !untracked
            && prev_t.is_some_and(|p| {
                p.shards as usize == t.shards()
                    && p.dim == dim
                    && p.policy == t.spec.policy
                    && p.watermarks.len() == t.shards()
                    // A clock below the previous watermark (an epoch set
                    // lower and still in force, the epoch-lru clock's low
                    // 32 bits wrapped): writes since may score below it.
                    && marks.iter().zip(&p.watermarks).all(|(now, then)| now >= then)
            });
        let mut out = Parts::default();
        let mut clocks = vec![];
        for i in 0..t.shards() {
            let watermark = match (inc, prev_t) {
                (true, Some(p)) => Some(p.watermarks[i]),
                _ => None,
            };
            self.export_shard(x, (t, index), i, watermark, &mut out)?;
            // Read after exporting: every entry exported scored at most this
            // (except a client's verbatim `load`); a restore resumes from here.
            clocks.push(x.rt.block_on(x.router.clock_score(t, i))?);
        }
        Ok(TableEntry {
            name: t.spec.name.clone(),
            dim,
            policy: t.spec.policy,
            mode: t.spec.mode,
            // Passwords of a backing's seeds stay out of the state
            // directory: a restore takes them from `backing_passwords`.
            spec: serde_json::to_value(t.spec.redacted()).map_err(internal)?,
            shards: t.shards() as u32,
            entries: out.count,
            full: !inc,
            watermarks: marks,
            clocks,
            chunks: out.chunks,
            keys: out.key_lists,
        })
    }

    /// Shard `i` of `t` exported by its actor in batches of about
    /// `chunk_bytes`, each written as a chunk before the next is asked for;
    /// with a `watermark`, only entries scored at or above it, plus lists of
    /// every live key.
    fn export_shard(
        &self,
        x: &mut Export,
        (t, index): (&Table, u32),
        i: usize,
        watermark: Option<u64>,
        out: &mut Parts,
    ) -> Result<(), ProtoError> {
        let dim = t.config.dim;
        let name = &t.spec.name;
        let slots = (self.config.chunk_bytes / (16 + 4 * dim as u64)).max(128);
        let keys_per_list = (self.config.chunk_bytes / 8).max(1024) as usize;
        // Slots move when a shard grows (rehash) mid-export; then its
        // export starts over, so no entry is skipped.
        let (first_chunk, first_list, first_count) = (out.chunks.len(), out.key_lists.len(), out.count);
        let (mut offset, mut seq, mut kseq, mut attempt) = (0u64, 0u32, 0u32, 0);
        let mut live: Vec<u64> = vec![];
        let capacity_now = |x: &Export| Ok::<_, ProtoError>(x.rt.block_on(x.router.sizes(t))?[i].1);
        let mut capacity = capacity_now(x)?;
        loop {
            if offset >= capacity {
                let now = capacity_now(x)?;
                if now == capacity {
                    break;
                }
                if attempt >= 3 {
                    // Exported while its slots moved: entries may be missing.
                    return Err(ProtoError::new(
                        hkv_proto::ErrorCode::Busy,
                        format!(
                            "table {name:?} shard {i} grew during each of 4 exports; the checkpoint \
                             was not taken: retry once it has stopped growing (or reserve its capacity first)"
                        ),
                    ));
                }
                warn!(table = %name, shard = i, "the shard grew during the checkpoint; exporting it again");
                out.chunks.truncate(first_chunk);
                out.key_lists.truncate(first_list);
                live.clear();
                out.count = first_count;
                (offset, capacity) = (0, now);
                attempt += 1;
                continue;
            }
            // Counted as the checkpoint's before the shard counts it as an
            // export: the stats read the shard's counters first, so they
            // never see a checkpoint's batch as a client's.
            self.count_export(t.id(), i, 1, slots);
            let (mut e, _) = match x.rt.block_on(x.router.export_part(t, i, offset, slots, Filter::ALL)) {
                Ok(r) => r,
                Err(err) => {
                    self.uncount_export(t.id(), i, 1, slots);
                    return Err(err);
                }
            };
            // The shard counted the keys it found, at most `slots`.
            self.uncount_export(t.id(), i, 0, slots - e.keys.len() as u64);
            offset += slots;
            if let Some(wm) = watermark {
                // One pass: every live key for the key list, and the
                // entries written since the base for the chunk.
                live.extend_from_slice(&e.keys);
                if e.scores.iter().any(|&s| s < wm) {
                    e = changed_since(e, wm, dim);
                }
                if live.len() >= keys_per_list {
                    out.key_lists.push(x.w.write_keys(index, i as u32, kseq, &live).map_err(|e| self.store_error(e))?);
                    kseq += 1;
                    live.clear();
                }
            }
            if e.keys.is_empty() {
                continue;
            }
            let c =
                x.w.write(index, i as u32, seq, dim, &e.keys, &e.scores, &e.values).map_err(|e| self.store_error(e))?;
            seq += 1;
            out.count += c.entries;
            out.chunks.push(c);
            self.report(x);
        }
        if watermark.is_some() {
            // Always at least one list per shard: an empty one says "no keys".
            out.key_lists.push(x.w.write_keys(index, i as u32, kseq, &live).map_err(|e| self.store_error(e))?);
        }
        Ok(())
    }

    /// The running checkpoint's progress, for stats.
    fn report(&self, x: &Export) {
        let (w, secs) = (&x.w, x.started.elapsed().as_secs_f64());
        if let Some(p) = self.running.lock().as_mut() {
            p.entries_done = w.entries();
            p.bytes = w.bytes();
            p.seconds = secs;
            p.rate = w.entries() as f64 / secs.max(1e-9);
            p.mb_per_s = w.bytes() as f64 / 1e6 / secs.max(1e-9);
            p.eta_s = x.total.saturating_sub(w.entries()) as f64 / p.rate.max(1e-9);
        }
    }
}

/// A checkpoint being exported: the router whose actors export the shards
/// (messages sent through `rt`), the writer of its chunks, and its
/// progress.
struct Export<'a> {
    router: &'a Router,
    rt: &'a tokio::runtime::Handle,
    w: &'a mut ChunkWriter,
    started: Instant,
    total: u64,
}

/// One table's chunks and key lists so far, and its entries.
#[derive(Default)]
struct Parts {
    chunks: Vec<hkv_checkpoint::ChunkRef>,
    key_lists: Vec<hkv_checkpoint::ChunkRef>,
    count: u64,
}
