//! The batch operations: [`Shard`] for [`CpuTable`].

use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;

use rayon::prelude::*;

use super::batch::{grain, run_batch, Acc, Outs, Rows, Scoring};
use super::storage::Storage;
use super::{CpuTable, PIPE, S};
use crate::check;
use crate::config::TableConfig;
use crate::error::{Error, Result};
use crate::lock::Group;
use crate::mrc::{Kind, Sampler, Samples};
use crate::{Evictions, Export, Filter, Op, Outcome, SampleDrain, Shard, ShardStats, Summary};

impl CpuTable {
    fn finish_insert(&self, st: &Storage, acc: &Acc) {
        self.size.fetch_add(acc.summary.inserted, Relaxed);
        self.counters.summary(&acc.summary);
        if let Some(a) = &self.adapt {
            a.fold();
            if a.age(st.nbuckets() * S as u64) {
                // The entries' find hits age with the sketch.
                st.buckets.par_iter().for_each(|bk| {
                    bk.each(|s| bk.set_score(s, super::adapt::halve_hits(bk.score(s))));
                });
            }
        }
    }

    /// Adaptive: counts the keys an insert-like batch writes (`idx`: only
    /// those) in the sketch, before the batch places any of them
    /// (`adapt`: the counts of a batch do not depend on their order).
    fn count_writes(&self, keys: &[u64], idx: Option<&[usize]>) {
        if let Some(a) = &self.adapt {
            match idx {
                Some(idx) => idx.iter().for_each(|&i| a.count(keys[i])),
                None => keys.iter().for_each(|&k| a.count(k)),
            }
        }
    }

    /// Adaptive, after a batch: its accesses (the keys the sketch counted,
    /// in index order) to the window share's miniatures (`adapt::Window`).
    /// `key(i)`: key `i` of the batch's `n` if it counts.
    fn observe(&self, st: &Storage, n: usize, key: impl Fn(usize) -> Option<u64> + Sync) {
        if let Some(a) = &self.adapt {
            a.window.observe(st.nbuckets() * S as u64, n, key);
        }
    }

    /// A find hit in a table whose reads refresh: the score a write
    /// without input would give (relaxed stores; readers that race on one
    /// entry write the same clock reading); Adaptive counts the hit in the
    /// score (`Scorer::on_read`, by compare-and-swap, so that hits of one
    /// key in a batch compose). Returns the score the find reports
    /// (`Scorer::read_answer`).
    #[inline]
    pub(super) fn refresh_read(&self, st: &Storage, b: usize, s: usize, scorer: &crate::score::Scorer) -> u64 {
        let bk = &st.buckets[b];
        let now = match &self.adapt {
            Some(a) => {
                a.counted_hit();
                // The score written by the compare-and-swap that succeeded.
                let mut now = 0;
                let _ = bk.scores[s].fetch_update(Relaxed, Relaxed, |old| {
                    now = scorer.on_read(old);
                    Some(now)
                });
                now
            }
            None => {
                let now = scorer.on_read(bk.score(s));
                bk.set_score(s, now);
                now
            }
        };
        scorer.read_answer(now)
    }

    /// The shared body of insert_or_assign, insert_and_evict and load.
    #[allow(clippy::too_many_arguments)]
    fn upsert_batch(
        &self,
        op: Op,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        scoring: Scoring,
        outcomes: Option<&mut [Outcome]>,
        keep_lost: bool,
    ) -> Result<Acc> {
        let n = keys.len();
        // Verbatim scores (load) are checked by the caller, not against the policy.
        let policy = matches!(scoring, Scoring::Policy);
        let policy_scores = if policy { scores } else { None };
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            policy_scores,
            policy,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(op, n);
        if op != Op::Load {
            self.samples.record(keys, Kind::Write);
        }
        self.grow_for(n);
        let st = self.storage.read();
        let scorer = self.scorer();
        let dim = self.config.dim;
        if policy {
            self.count_writes(keys, None);
        }
        let acc = run_batch(n, Outs { outcomes, ..Outs::default() }, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            let mut lost = keep_lost.then(Evictions::default);
            // Two groups of keys ahead, their buckets' lines; one group
            // ahead (lines arrived), the slots they will likely take.
            let group = |i: usize| &keys[i.min(r.end)..r.end.min(i + PIPE)];
            self.touch(&st, group(r.start));
            self.touch(&st, group(r.start + PIPE));
            self.touch_rows(&st, group(r.start));
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, group(i + 2 * PIPE));
                    self.touch_rows(&st, group(i + PIPE));
                }
                let input = scores.map(|s| s[i]);
                let v = &values[i * dim..(i + 1) * dim];
                let o = self.upsert(&st, keys[i], v, input, scoring, &scorer, lost.as_mut(), |b, s| {
                    st.write_row(b, s, v);
                    let bk = &st.buckets[b];
                    bk.set_score(
                        s,
                        match scoring {
                            Scoring::Verbatim => input.unwrap_or(0),
                            Scoring::Policy => scorer.on_upsert(bk.score(s), input),
                        },
                    );
                });
                acc.summary.add(o);
                outs.outcome(j, o);
            }
            acc.lost = lost.unwrap_or_default();
            acc
        });
        self.finish_insert(&st, &acc);
        if policy {
            self.observe(&st, keys.len(), |i| Some(keys[i]));
        }
        Ok(acc)
    }

    /// An update-only batch (assign, assign_scores): `f(i, bucket, slot)` on
    /// every present key under its bucket's mutex.
    fn update_batch(
        &self,
        op: Op,
        keys: &[u64],
        outcomes: Option<&mut [Outcome]>,
        f: &(dyn Fn(&Storage, usize, usize, usize) + Sync),
    ) -> Result<Summary> {
        let n = keys.len();
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(op, n);
        self.samples.record(keys, Kind::Update);
        let st = self.storage.read();
        let acc = run_batch(
            n,
            Outs { outcomes, ..Outs::default() },
            self.config.dim,
            &|r: Range<usize>, mut outs: Outs<'_>| {
                let mut acc = Acc::default();
                for (j, i) in r.clone().enumerate() {
                    if j % PIPE == 0 {
                        self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                    }
                    let o = match self.with_entry_mut(&st, keys[i], |b, s| f(&st, i, b, s)) {
                        Some(()) => Outcome::Updated,
                        None => Outcome::Absent,
                    };
                    acc.summary.add(o);
                    outs.outcome(j, o);
                }
                acc
            },
        );
        Ok(acc.summary)
    }

    /// accum_or_assign's first phase, in the updater group: adds the deltas
    /// of present keys; the indices of absent keys are in `absent`.
    fn accumulate_present(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Acc {
        let (n, dim) = (keys.len(), self.config.dim);
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(Op::AccumOrAssign, n);
        self.samples.record(keys, Kind::Write);
        let st = self.storage.read();
        let scorer = self.scorer();
        let outs = Outs { outcomes, ..Outs::default() };
        run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let input = scores.map(|s| s[i]);
                let hit = self.with_entry_mut(&st, keys[i], |b, s| {
                    st.add_row(b, s, &deltas[i * dim..(i + 1) * dim]);
                    let bk = &st.buckets[b];
                    bk.set_score(s, scorer.on_upsert(bk.score(s), input));
                });
                if hit.is_some() {
                    acc.summary.add(Outcome::Updated);
                    outs.outcome(j, Outcome::Updated);
                } else {
                    acc.absent.push(i);
                }
            }
            acc
        })
    }

    /// accum_or_assign's second phase, in the inserter group: inserts the
    /// keys at indices `idx` (ascending) with their delta as the value;
    /// their outcomes are in `placed`.
    fn insert_absent(&self, keys: &[u64], deltas: &[f32], scores: Option<&[u64]>, idx: &[usize]) -> Acc {
        let dim = self.config.dim;
        let delta = |i: usize| &deltas[i * dim..(i + 1) * dim];
        let _g = self.lock.acquire(Group::Inserter);
        self.grow_for(idx.len());
        let st = self.storage.read();
        let scorer = self.scorer();
        self.count_writes(keys, Some(idx));
        let acc = run_batch(idx.len(), Outs::default(), dim, &|r: Range<usize>, _outs: Outs<'_>| {
            let mut acc = Acc::default();
            for &i in &idx[r] {
                let input = scores.map(|s| s[i]);
                let o = self.upsert(&st, keys[i], delta(i), input, Scoring::Policy, &scorer, None, |b, s| {
                    st.add_row(b, s, delta(i));
                    let bk = &st.buckets[b];
                    bk.set_score(s, scorer.on_upsert(bk.score(s), input));
                });
                acc.summary.add(o);
                acc.placed.push((i, o));
            }
            acc
        });
        self.finish_insert(&st, &acc);
        self.observe(&st, idx.len(), |j| Some(keys[idx[j]]));
        acc
    }
}

impl Shard for CpuTable {
    fn config(&self) -> &TableConfig {
        &self.config
    }

    fn capacity(&self) -> u64 {
        self.storage.read().nbuckets() * S as u64
    }

    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }

    fn set_global_epoch(&self, epoch: u32) {
        self.epoch.store(epoch, Relaxed);
    }

    fn adaptive_window(&self) -> Option<u32> {
        self.adapt.as_ref().map(|a| a.window.bucket_slots())
    }

    fn find(&self, keys: &[u64], values: &mut [f32], found: &mut [bool], scores: Option<&mut [u64]>) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, Some(values.len()), found.len(), scores.as_ref().map(|s| s.len()))?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Find, n);
        let st = self.storage.read();
        let dim = self.config.dim;
        let refresh = self.config.refreshes_reads().then(|| self.scorer());
        let outs = Outs { values: Some(values), found: Some(&mut *found), scores, outcomes: None };
        let acc = run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            let part = &keys[r];
            self.lookup_pipelined(&st, part, outs.values.is_some(), |j, hit| {
                if let Some((b, s)) = hit {
                    if let Some(v) = outs.values.as_deref_mut() {
                        st.read_row(b, s, &mut v[j * dim..(j + 1) * dim]);
                    }
                    let now = refresh.as_ref().map(|sc| self.refresh_read(&st, b, s, sc));
                    if let Some(sc) = outs.scores.as_deref_mut() {
                        sc[j] = now.unwrap_or_else(|| st.buckets[b].score(s));
                    }
                    acc.hits += 1;
                }
                outs.found(j, hit.is_some());
            });
            acc
        });
        self.samples.record_lookups(keys, &|i| found[i]);
        if refresh.is_some() {
            let found = &*found;
            self.observe(&st, n, |i| found[i].then_some(keys[i]));
        }
        self.counters.lookups(acc.hits, n);
        Ok(acc.hits as usize)
    }

    fn find_at(&self, keys: &[u64], at: &[u32], rows: crate::Rows<'_>, found: &mut [u8]) -> Result<usize> {
        let values = rows.into_values();
        let n = keys.len();
        check::keys(keys)?;
        check::rows_at(&self.config, n, at, values.len(), found.len())?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Find, n);
        let st = self.storage.read();
        let hits = self.find_rows(&st, keys, at, Rows { base: 0, values, found: &mut *found }, grain(n));
        self.samples.record_lookups(keys, &|i| found[at[i] as usize] != 0);
        if self.config.refreshes_reads() {
            let found = &*found;
            self.observe(&st, n, |i| (found[at[i] as usize] != 0).then_some(keys[i]));
        }
        self.counters.lookups(hits, n);
        Ok(hits as usize)
    }

    fn contains(&self, keys: &[u64], found: &mut [bool]) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, None, found.len(), None)?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Contains, n);
        let st = self.storage.read();
        let outs = Outs { found: Some(found), ..Outs::default() };
        let acc = run_batch(n, outs, self.config.dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            self.lookup_pipelined(&st, &keys[r], false, |j, hit| {
                outs.found(j, hit.is_some());
                acc.hits += hit.is_some() as u64;
            });
            acc
        });
        self.samples.record_lookups(keys, &|i| found[i]);
        self.counters.lookups(acc.hits, n);
        Ok(acc.hits as usize)
    }

    fn insert_or_assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let acc = self.upsert_batch(Op::InsertOrAssign, keys, values, scores, Scoring::Policy, outcomes, false)?;
        Ok(acc.summary)
    }

    fn insert_and_evict(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Evictions> {
        let acc = self.upsert_batch(Op::InsertAndEvict, keys, values, scores, Scoring::Policy, outcomes, true)?;
        Ok(acc.lost)
    }

    fn load(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<Summary> {
        let n = keys.len();
        check::len("scores", scores.len(), n, || format!("{n} keys"))?;
        let acc = self.upsert_batch(Op::Load, keys, values, Some(scores), Scoring::Verbatim, None, false)?;
        Ok(acc.summary)
    }

    fn find_or_insert(
        &self,
        keys: &[u64],
        values: &mut [f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::FindOrInsert, n);
        self.samples.record(keys, Kind::FindOrInsert);
        self.grow_for(n);
        let st = self.storage.read();
        let scorer = self.scorer();
        let dim = self.config.dim;
        self.count_writes(keys, None);
        let outs = Outs { values: Some(values), outcomes, ..Outs::default() };
        let acc = run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            let mut input_row = vec![0.0f32; dim];
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let input = scores.map(|s| s[i]);
                let row = &mut outs.values.as_deref_mut().expect("values given")[j * dim..(j + 1) * dim];
                input_row.copy_from_slice(row);
                let o = self.upsert(&st, keys[i], &input_row, input, Scoring::Policy, &scorer, None, |b, s| {
                    st.read_row(b, s, row);
                    let bk = &st.buckets[b];
                    bk.set_score(s, scorer.on_upsert(bk.score(s), input));
                });
                acc.hits += (o == Outcome::Updated) as u64;
                acc.summary.add(o);
                outs.outcome(j, o);
            }
            acc
        });
        self.finish_insert(&st, &acc);
        self.observe(&st, n, |i| Some(keys[i]));
        self.counters.lookups(acc.hits, n);
        Ok(acc.summary)
    }

    fn assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            scores,
            false,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let scorer = self.scorer();
        let dim = self.config.dim;
        self.update_batch(Op::Assign, keys, outcomes, &|st, i, b, s| {
            st.write_row(b, s, &values[i * dim..(i + 1) * dim]);
            let bk = &st.buckets[b];
            bk.set_score(s, scorer.on_update(bk.score(s), scores.map(|x| x[i])));
        })
    }

    fn assign_scores(&self, keys: &[u64], scores: Option<&[u64]>, outcomes: Option<&mut [Outcome]>) -> Result<Summary> {
        check::write(&self.config, keys, None, scores, false, outcomes.as_ref().map(|o| o.len()))?;
        let scorer = self.scorer();
        self.update_batch(Op::AssignScores, keys, outcomes, &|st, i, b, s| {
            let bk = &st.buckets[b];
            bk.set_score(s, scorer.on_update(bk.score(s), scores.map(|x| x[i])));
        })
    }

    fn accum_or_assign(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        mut outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        check::write(
            &self.config,
            keys,
            Some(("deltas", deltas.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        // Phase 1, updater group: accumulate into present keys.
        let mut first = self.accumulate_present(keys, deltas, scores, outcomes.as_deref_mut());
        if first.absent.is_empty() {
            return Ok(first.summary);
        }
        // Phase 2, inserter group: insert the absent keys, in index order
        // (another batch may have inserted some meanwhile: accumulate those).
        first.absent.sort_unstable();
        let acc = self.insert_absent(keys, deltas, scores, &first.absent);
        if let Some(out) = outcomes {
            for &(i, o) in &acc.placed {
                out[i] = o;
            }
        }
        Ok(first.summary.merge(acc.summary))
    }

    fn apply_gradients(
        &self,
        keys: &[u64],
        grads: &[f32],
        step: &crate::optim::Step,
        found: &mut [bool],
        updated: Option<&mut [f32]>,
    ) -> Result<u64> {
        let (n, d, w) = (keys.len(), step.dim, self.config.dim);
        crate::optim::check_apply(w, step, keys, grads, found, updated.as_deref())?;
        if let Some(r) =
            crate::optim::apply_summed(keys, grads, step, found, |k, g, s, f| self.apply_gradients(k, g, s, f, None))
        {
            return r;
        }
        // In place, in the updater group as accum_or_assign's first phase:
        // each row read, stepped and written under its bucket's mutex.
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(Op::ApplyGradients, n);
        self.samples.record(keys, Kind::Update);
        let st = self.storage.read();
        let scorer = self.scorer();
        // `values` of the split outputs carries the updated values (d a key).
        let outs = Outs { values: updated, found: Some(found), ..Outs::default() };
        let acc = run_batch(n, outs, d, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            let mut row = vec![0.0f32; w];
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let hit = self.with_entry_mut(&st, keys[i], |b, s| {
                    st.read_row(b, s, &mut row);
                    step.apply(&mut row, &grads[i * d..(i + 1) * d]);
                    st.write_row(b, s, &row);
                    let bk = &st.buckets[b];
                    bk.set_score(s, scorer.on_update(bk.score(s), None));
                });
                if let Some(u) = outs.values.as_deref_mut() {
                    let dst = &mut u[j * d..(j + 1) * d];
                    match hit {
                        Some(()) => dst.copy_from_slice(&row[..d]),
                        None => dst.fill(0.0),
                    }
                }
                outs.found(j, hit.is_some());
                acc.hits += hit.is_some() as u64;
            }
            acc
        });
        Ok(n as u64 - acc.hits)
    }

    fn erase(&self, keys: &[u64], erased: Option<&mut [bool]>) -> Result<usize> {
        let n = keys.len();
        check::erase(keys, erased.as_ref().map(|e| e.len()))?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Erase, n);
        let st = self.storage.read();
        let outs = Outs { found: erased, ..Outs::default() };
        let acc = run_batch(n, outs, self.config.dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let hit = self.with_entry_mut(&st, keys[i], |b, s| st.buckets[b].remove(s)).is_some();
                outs.found(j, hit);
                acc.hits += hit as u64;
            }
            acc
        });
        self.size.fetch_sub(acc.hits, Relaxed);
        Ok(acc.hits as usize)
    }

    fn erase_if(&self, filter: &Filter) -> Result<u64> {
        use rayon::prelude::*;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::EraseIf, 0);
        let st = self.storage.read();
        // One task per bucket range: no two tasks touch a bucket.
        let removed: u64 = st
            .buckets
            .par_iter()
            .map(|bk| {
                let mut removed = 0;
                bk.each(|s| {
                    if filter.matches(bk.key(s), bk.score(s)) {
                        bk.remove(s);
                        removed += 1;
                    }
                });
                removed
            })
            .sum();
        self.size.fetch_sub(removed, Relaxed);
        Ok(removed)
    }

    fn clear(&self) -> Result<()> {
        use rayon::prelude::*;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Clear, 0);
        let st = self.storage.read();
        st.buckets.par_iter().for_each(|bk| bk.each(|s| bk.remove(s)));
        self.size.store(0, Relaxed);
        Ok(())
    }

    fn export_batch_if(&self, offset: u64, n: u64, filter: &Filter) -> Result<Export> {
        let _g = self.lock.acquire(Group::Reader);
        let st = self.storage.read();
        let cap = st.nbuckets() * S as u64;
        let end = offset.saturating_add(n).min(cap);
        let mut out = Export::default();
        if offset >= end {
            self.counters.op(Op::Export, 0);
            return Ok(out);
        }
        let (first, last) = (offset / S as u64, (end - 1) / S as u64);
        for b in first..=last {
            let bk = &st.buckets[b as usize];
            let lo = if b == first { (offset % S as u64) as usize } else { 0 };
            let hi = if b == last { ((end - 1) % S as u64) as usize + 1 } else { S };
            bk.each(|s| {
                if s >= lo && s < hi && filter.matches(bk.key(s), bk.score(s)) {
                    out.keys.push(bk.key(s));
                    out.scores.push(bk.score(s));
                    st.push_row(b as usize, s, &mut out.values);
                }
            });
        }
        self.counters.op(Op::Export, out.keys.len());
        Ok(out)
    }

    fn reserve(&self, capacity: u64) -> Result<()> {
        let max = self.config.max_buckets() * S as u64;
        if capacity > max {
            return Err(Error::Capacity { requested: capacity, max });
        }
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Reserve, 0);
        let prepared = self.prepared.lock().take();
        // One rehash to the final size (its bucket count a power-of-two
        // multiple of today's, as doubling gave): a shard grows wholly or
        // not at all. With a prepared allocation for that size it cannot fail.
        match self.reserve_target(capacity) {
            Some(nb) => self.rehash_with(nb, prepared),
            None => Ok(()),
        }
    }

    fn prepare_reserve(&self, capacity: u64) -> Result<()> {
        let max = self.config.max_buckets() * S as u64;
        if capacity > max {
            return Err(Error::Capacity { requested: capacity, max });
        }
        // Dropped first: never two prepared storages at once.
        *self.prepared.lock() = None;
        if let Some(nb) = self.reserve_target(capacity) {
            *self.prepared.lock() = Some(self.prepare(nb)?);
        }
        Ok(())
    }

    fn cancel_reserve(&self) {
        *self.prepared.lock() = None;
    }

    fn prefault(&self, stop: &std::sync::atomic::AtomicBool) {
        // One atomic no-op write per 4 KiB page (`fetch_or(0)` faults the
        // page in writable and leaves a concurrent load's value as it is),
        // the storage lock taken per 2 MiB so that a growth never waits long.
        const PAGE: usize = 4096 / 4;
        const STEP: usize = 512 * PAGE;
        let mut at = 0;
        // Bounded: `at` rises by STEP each turn up to the values' length.
        loop {
            if stop.load(Relaxed) {
                return;
            }
            let st = self.storage.read();
            let Some(part) = st.values.get(at..) else { return };
            for v in part.iter().take(STEP).step_by(PAGE) {
                v.fetch_or(0, Relaxed);
            }
            at += STEP;
        }
    }

    fn resume_after(&self, max_score: u64) {
        crate::score::resume_after(self.config.policy, self.config.lfu_ties, max_score, &*self.clock, &self.epoch);
    }

    fn clock_score(&self) -> u64 {
        self.scorer().clock_floor()
    }

    fn set_sampler(&self, sampler: Option<Sampler>) {
        self.samples.set(sampler);
    }

    fn drain_samples(&self, out: &mut Samples) -> SampleDrain {
        self.samples.drain(out)
    }

    fn stats(&self) -> ShardStats {
        let capacity = self.capacity();
        // Host memory holds every value.
        self.counters.stats(self.size(), capacity, 0, capacity * self.config.dim as u64 * 4, self.lock.state())
    }
}
