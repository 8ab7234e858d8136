//! The [`Shard`] operations of [`CudaTable`].

use super::*;

impl Shard for CudaTable {
    fn config(&self) -> &TableConfig {
        &self.config
    }

    fn capacity(&self) -> u64 {
        self.nbuckets() * S
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
        self.find_rows(keys, values, false, found, scores)
    }

    fn find_into(&self, keys: &[u64], rows: crate::Rows<'_>, found: &mut [bool]) -> Result<usize> {
        let pinned = matches!(rows, crate::Rows::Pinned(_));
        self.find_rows(keys, rows.into_values(), pinned, found, None)
    }

    /// Into page-locked host memory mapped for the device (a daemon's
    /// [`crate::cuda::HostFrame`]), the lookup kernel writes each row at its
    /// target row itself, a miss as zeros, and only the flags come back
    /// through the lane: no copy of a row on the host. Other memory gets the
    /// rows through [`Shard::find`].
    fn find_at(&self, keys: &[u64], at: &[u32], rows: crate::Rows<'_>, found: &mut [u8]) -> Result<usize> {
        let rows_len = |r: &crate::Rows<'_>| match r {
            crate::Rows::Host(v) => v.len(),
            crate::Rows::Pinned(p) => p.len(),
        };
        let n = keys.len();
        check::keys(keys)?;
        check::rows_at(&self.config, n, at, rows_len(&rows), found.len())?;
        let rows = match rows {
            crate::Rows::Pinned(p) => p,
            crate::Rows::Host(values) => return crate::find_at_by_find(self, keys, at, values, found),
        };
        let dst = rows.device();
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        self.read_batch(Op::Find, keys, |st, l, base| {
            let s = l.stream.clone();
            let p = Ptrs {
                at: Some(Self::upload(&s, &mut l.stage, &mut l.at, at)?),
                values: Some(dst),
                found: Some(Self::scratch(&s, &mut l.flags, n)?),
                ..base
            };
            // SAFETY: keys, at and the flags sized for these n keys; at is
            // strictly increasing and below found.len() (checked), and the
            // rows, mapped host memory (a HostFrame's, by their type), hold
            // found.len() rows (checked) and are borrowed mutably for this
            // call, which waits for the kernel (read_counters synchronises
            // the stream).
            unsafe { self.k_lookup(&s, st, n as u64, p) }?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let hits = self.read_counters(l)?.hits;
            for (&r, &x) in at.iter().zip(l.stage.read(&f)) {
                found[r as usize] = x;
            }
            Ok(hits)
        })
    }

    fn contains(&self, keys: &[u64], found: &mut [bool]) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, None, found.len(), None)?;
        self.read_batch(Op::Contains, keys, |st, l, base| {
            let s = l.stream.clone();
            let p = Ptrs { found: Some(Self::scratch(&s, &mut l.flags, n)?), ..base };
            // SAFETY: keys uploaded, flags sized above for these n keys
            unsafe { self.k_lookup(&s, st, n as u64, p) }?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let c = self.read_counters(l)?;
            for (o, x) in found.iter_mut().zip(l.stage.read(&f)) {
                *o = *x != 0;
            }
            Ok(c.hits)
        })
    }

    fn insert_or_assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        Ok(self.upsert_batch(Op::InsertOrAssign, keys, values, scores, false, outcomes, false)?.0.summary)
    }

    fn insert_and_evict(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Evictions> {
        Ok(self.upsert_batch(Op::InsertAndEvict, keys, values, scores, false, outcomes, true)?.1)
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
        if n == 0 {
            return Ok(Summary::default());
        }
        let want = outcomes.is_some();
        let (c, _, raw) = self.with_lane(|l| {
            self.upsert_host(l, UP_FIND_OR_INSERT, keys, n, Rows::InOut(values), scores, false, None, want, false)
        })?;
        set_outcomes(outcomes, &raw, None);
        self.counters.lookups(c.summary.updated, n);
        Ok(c.summary)
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
        self.update_batch(Op::Assign, UPD_ASSIGN, keys, Some(values), scores, outcomes)
    }

    fn assign_scores(&self, keys: &[u64], scores: Option<&[u64]>, outcomes: Option<&mut [Outcome]>) -> Result<Summary> {
        check::write(&self.config, keys, None, scores, false, outcomes.as_ref().map(|o| o.len()))?;
        self.update_batch(Op::AssignScores, UPD_SCORES, keys, None, scores, outcomes)
    }

    /// In place on the device (`step_keys`), in the updater group: each
    /// present row's values and state are read and written under its
    /// buckets' locks, bit for bit the CPU backend's step. Duplicates are
    /// stepped one after the other: in index order up to
    /// [`SEQUENTIAL_BATCH`] keys (rounds), in no set order above.
    fn apply_gradients(
        &self,
        keys: &[u64],
        grads: &[f32],
        step: &crate::optim::Step,
        found: &mut [bool],
        updated: Option<&mut [f32]>,
    ) -> Result<u64> {
        let (n, d) = (keys.len(), step.dim);
        crate::optim::check_apply(self.config.dim, step, keys, grads, found, updated.as_deref())?;
        if let Some(r) =
            crate::optim::apply_summed(keys, grads, step, found, |k, g, s, f| self.apply_gradients(k, g, s, f, None))
        {
            return r;
        }
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(Op::ApplyGradients, n);
        if n == 0 {
            return Ok(0);
        }
        let guard = self.storage.read();
        let st = &*guard;
        let want = updated.is_some();
        let (summary, flags, rows) = self.with_lane(|l| {
            let s = l.stream.clone();
            let mut p = Ptrs {
                keys: Some(Self::upload(&s, &mut l.stage, &mut l.keys, keys)?),
                values: Some(Self::upload(&s, &mut l.stage, &mut l.values, grads)?),
                found: Some(Self::scratch(&s, &mut l.flags, n)?),
                counters: Some(DevPtr::of(&l.counters, &s)),
                sample: self.sample_args(&s, Kind::Update),
                ..Ptrs::default()
            };
            if want {
                p.updated = Some(Self::scratch(&s, &mut l.lost_values, n * d)?);
            }
            self.zero_counters(l)?;
            let sc = self.scoring(false);
            self.in_rounds(l, keys, st.nbuckets, None, |_, o| {
                // SAFETY: keys and grads uploaded, flags and updated rows
                // sized above for these n keys; the table's rows hold
                // step.row_dim() floats (check_apply); flags2 by in_rounds.
                unsafe { self.k_step(&s, st, sc, n as u64, step, Ptrs { only: o, ..p }) }
            })?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let r = Self::fetch(&s, &mut l.stage, &l.lost_values, if want { n * d } else { 0 })?;
            let c = self.read_counters(l)?;
            Ok((c.summary, l.stage.read(&f).to_vec(), l.stage.read(&r).to_vec()))
        })?;
        for (o, &x) in found.iter_mut().zip(&flags) {
            *o = x != 0;
        }
        if let Some(u) = updated {
            u.copy_from_slice(&rows);
        }
        Ok(summary.absent)
    }

    fn accum_or_assign(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        mut outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check::write(
            &self.config,
            keys,
            Some(("deltas", deltas.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        if n == 0 {
            let _g = self.lock.acquire(Group::Updater);
            self.counters.op(Op::AccumOrAssign, 0);
            return Ok(Summary::default());
        }
        let mut l = self.lane()?;
        // Phase 1, updater group: accumulate into present keys, flag absent ones.
        let (first, absent) = {
            let _g = self.lock.acquire(Group::Updater);
            self.counters.op(Op::AccumOrAssign, n);
            let guard = self.storage.read();
            let st = &*guard;
            let want = outcomes.is_some();
            let (summary, absent) = self.update_host(&mut l, st, UPD_ACCUM, keys, Some(deltas), scores, false, true)?;
            if want {
                // Present keys: Updated; the others are decided in phase 2.
                set_outcomes(
                    outcomes.as_deref_mut(),
                    &vec![Outcome::Updated as u8; n],
                    Some(&absent.iter().map(|&a| (a == 0) as u8).collect::<Vec<_>>()),
                );
            }
            (summary, absent)
        };
        if first.absent == 0 {
            self.put_lane(l);
            return Ok(first);
        }
        // Phase 2, inserter group: insert the absent keys in index order
        // (another batch may have inserted some meanwhile: those accumulate).
        let _g = self.lock.acquire(Group::Inserter);
        let want = outcomes.is_some();
        let (c, _, raw) = self.upsert_host(
            &mut l,
            UP_ACCUM,
            keys,
            first.absent as usize,
            Rows::In(deltas),
            scores,
            false,
            Some(&absent),
            want,
            false,
        )?;
        set_outcomes(outcomes, &raw, Some(&absent));
        self.put_lane(l);
        Ok(Summary { absent: 0, ..first }.merge(c.summary))
    }

    fn erase(&self, keys: &[u64], erased: Option<&mut [bool]>) -> Result<usize> {
        let n = keys.len();
        check::erase(keys, erased.as_ref().map(|e| e.len()))?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Erase, n);
        if n == 0 {
            return Ok(0);
        }
        let guard = self.storage.read();
        let st = &*guard;
        let count = self.with_lane(|l| {
            let s = l.stream.clone();
            let p = Ptrs {
                keys: Some(Self::upload(&s, &mut l.stage, &mut l.keys, keys)?),
                found: Some(Self::scratch(&s, &mut l.flags, n)?),
                ..Ptrs::default()
            };
            self.zero_counters(l)?;
            let p = Ptrs { counters: Some(DevPtr::of(&l.counters, &s)), ..p };
            self.in_rounds(l, keys, st.nbuckets, None, |_, o| {
                // SAFETY: keys uploaded and erased flags sized above for these n keys, flags2 by in_rounds
                unsafe { self.k_erase(&s, st, n as u64, Ptrs { only: o, ..p }) }
            })?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, if erased.is_some() { n } else { 0 })?;
            let c = self.read_counters(l)?;
            if let Some(out) = erased {
                for (o, x) in out.iter_mut().zip(l.stage.read(&f)) {
                    *o = *x != 0;
                }
            }
            Ok(c.erased)
        })?;
        self.size.fetch_sub(count, Relaxed);
        Ok(count as usize)
    }

    fn erase_if(&self, filter: &Filter) -> Result<u64> {
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::EraseIf, 0);
        let guard = self.storage.read();
        let st = &*guard;
        let removed = self.with_lane(|l| {
            self.zero_counters(l)?;
            let c = ptr(&l.counters, &l.stream);
            let fa = filter_args(filter);
            let mut b = l.stream.launch_builder(&self.f.erase_if);
            b.arg(&st.args).arg(&fa).arg(&c);
            // SAFETY: erase_if visits buckets < nbuckets (one warp each) of
            // the table described by args and writes 8 counters.
            unsafe { b.launch(blocks(st.nbuckets * 32)?) }.map_err(dev_err("launching erase_if"))?;
            let c = self.read_counters(l)?;
            Ok(c.erased)
        })?;
        self.size.fetch_sub(removed, Relaxed);
        Ok(removed)
    }

    fn clear(&self) -> Result<()> {
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Clear, 0);
        let guard = self.storage.read();
        let st = &*guard;
        self.with_lane(|l| {
            let mut b = l.stream.launch_builder(&self.f.clear);
            b.arg(&st.args);
            // SAFETY: clear_table writes positions < nbuckets * 128 and
            // buckets < nbuckets of the table described by args.
            unsafe { b.launch(blocks(st.nbuckets * S)?) }.map_err(dev_err("launching clear_table"))?;
            l.stream.synchronize().map_err(dev_err("synchronizing"))
        })?;
        self.size.store(0, Relaxed);
        Ok(())
    }

    fn export_batch_if(&self, offset: u64, n: u64, filter: &Filter) -> Result<Export> {
        let _g = self.lock.acquire(Group::Reader);
        let guard = self.storage.read();
        let st = &*guard;
        let cap = st.nbuckets * S;
        let end = offset.saturating_add(n).min(cap);
        if offset >= end {
            self.counters.op(Op::Export, 0);
            return Ok(Export::default());
        }
        let dim = self.config.dim;
        let out = self.with_lane(|l| {
            let s = l.stream.clone();
            let nb = ((end - 1) / S - offset / S + 1) as usize;
            let counts = Self::scratch(&s, &mut l.counts, nb)?;
            let offsets = Self::scratch(&s, &mut l.offsets, nb + 1)?;
            let fa = filter_args(filter);
            // SAFETY: counts and offsets were sized above for the nb buckets of the range; count pass only
            unsafe { self.k_export(&s, st, offset, end, fa, counts, offsets, None) }?;
            let total = Self::fetch(&s, &mut l.stage, &l.offsets, nb + 1)?;
            l.stage.sync(&s)?;
            let m = l.stage.read(&total)[nb] as usize;
            let mut e = Export { keys: vec![0; m], values: vec![0.0; m * dim], scores: vec![0; m] };
            if m > 0 {
                let out = ExportPtrs {
                    keys: Self::scratch(&s, &mut l.keys, m)?,
                    values: Self::scratch(&s, &mut l.values, m * dim)?,
                    scores: Self::scratch(&s, &mut l.scores, m)?,
                };
                // SAFETY: the outputs were sized above for the m matches the count pass found
                unsafe { self.k_export(&s, st, offset, end, fa, counts, offsets, Some(out)) }?;
                let k = Self::fetch(&s, &mut l.stage, &l.keys, m)?;
                let v = Self::fetch(&s, &mut l.stage, &l.values, m * dim)?;
                let sc = Self::fetch(&s, &mut l.stage, &l.scores, m)?;
                l.stage.sync(&s)?;
                l.stage.read_into(&k, &mut e.keys);
                l.stage.read_into(&v, &mut e.values);
                l.stage.read_into(&sc, &mut e.scores);
            }
            Ok(e)
        })?;
        self.counters.op(Op::Export, out.keys.len());
        Ok(out)
    }

    fn reserve(&self, capacity: u64) -> Result<()> {
        let max = self.config.max_buckets() * S;
        if capacity > max {
            return Err(Error::Capacity { requested: capacity, max });
        }
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Reserve, 0);
        self.grow_to(capacity)
    }

    fn prepare_reserve(&self, capacity: u64) -> Result<()> {
        let max = self.config.max_buckets() * S;
        if capacity > max {
            return Err(Error::Capacity { requested: capacity, max });
        }
        self.prepare_growth(capacity)
    }

    fn cancel_reserve(&self) {
        *self.prepared.lock() = None;
    }

    fn load(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<Summary> {
        let n = keys.len();
        check::len("scores", scores.len(), n, || format!("{n} keys"))?;
        Ok(self.upsert_batch(Op::Load, keys, values, Some(scores), true, None, false)?.0.summary)
    }

    fn set_sampler(&self, sampler: Option<crate::mrc::Sampler>) {
        self.set_sampling(sampler);
    }

    fn drain_samples(&self, out: &mut crate::mrc::Samples) -> crate::SampleDrain {
        self.drain_ring(out)
    }

    fn stats(&self) -> ShardStats {
        let (fast, host) = {
            let s = self.storage.read();
            (s.fast_slots, s.host_slots)
        };
        let row = self.config.dim as u64 * 4;
        self.counters.stats(self.size(), self.capacity(), fast * row, host * row, self.lock.state())
    }

    fn resume_after(&self, max_score: u64) {
        crate::score::resume_after(self.config.policy, self.config.lfu_ties, max_score, &*self.clock, &self.epoch);
    }

    fn clock_score(&self) -> u64 {
        Scorer {
            policy: self.config.policy,
            now_ns: self.clock.now_ns(),
            epoch: self.epoch.load(Relaxed),
            lfu_ties: self.config.lfu_ties,
        }
        .clock_floor()
    }

    fn run_ipc(&self, op: DeviceOp, arrays: &IpcArrays, part: Option<IpcPart>, order: IpcOrder<'_>) -> Result<Counts> {
        CudaTable::run_ipc(self, op, arrays, part, order)
    }

    fn check_ipc_keys(&self, keys: &crate::cuda::ipc::IpcSpan<u64>) -> Result<()> {
        CudaTable::check_ipc_keys(self, keys)
    }
}

impl CudaTable {
    /// find into `values`: `pinned` when they lie in a page-locked frame
    /// ([`crate::Rows::Pinned`]), whose rows come straight from the device once
    /// every key is known to hit; else they pass through the staging memory.
    fn find_rows(
        &self,
        keys: &[u64],
        values: &mut [f32],
        pinned: bool,
        found: &mut [bool],
        scores: Option<&mut [u64]>,
    ) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, Some(values.len()), found.len(), scores.as_ref().map(|s| s.len()))?;
        let dim = self.config.dim;
        self.read_batch(Op::Find, keys, |st, l, base| {
            let s = l.stream.clone();
            let mut p = Ptrs {
                values: Some(Self::scratch(&s, &mut l.values, n * dim)?),
                found: Some(Self::scratch(&s, &mut l.flags, n)?),
                find: true,
                ..base
            };
            if scores.is_some() {
                p.scores = Some(Self::scratch(&s, &mut l.scores, n)?);
            }
            // SAFETY: keys uploaded, values / flags / scores sized above for these n keys
            unsafe { self.k_lookup(&s, st, n as u64, p) }?;
            if self.config.refreshes_reads() {
                // Adaptive: the find's hits (counted in their scores), to
                // the window share's miniatures, sampled on the device
                // behind the find.
                // SAFETY: keys and found flags are the lane's, n each, kept
                // until the stream has run this.
                unsafe { self.adapt_sample_device(&s, st, base.keys.expect("keys uploaded"), n, None, p.found) }?;
            }
            let direct = pinned;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let v = if direct { None } else { Some(Self::fetch(&s, &mut l.stage, &l.values, n * dim)?) };
            let sc = Self::fetch(&s, &mut l.stage, &l.scores, if scores.is_some() { n } else { 0 })?;
            let c = self.read_counters(l)?;
            if self.config.refreshes_reads() {
                self.adapt_counted(c.hits);
                self.adapt_done();
            }
            for (o, x) in found.iter_mut().zip(l.stage.read(&f)) {
                *o = *x != 0;
            }
            if direct && c.hits == n as u64 {
                let bytes = std::mem::size_of_val(values);
                // SAFETY: `values` is page-locked host memory of `bytes`
                // bytes (a HostFrame's rows, by the caller's type), borrowed mutably for this call,
                // which waits for the copy below; the lane's values buffer
                // holds n * dim floats written by the lookup, ordered
                // before the copy by the stream.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                        values.as_mut_ptr() as *mut std::ffi::c_void,
                        arg("values", p.values, n * dim)?,
                        bytes,
                        s.cu_stream(),
                    )
                }
                .result()
                .map_err(dev_err("copying rows into a pinned frame"))?;
                s.synchronize().map_err(dev_err("synchronizing"))?;
                if let Some(out) = scores {
                    l.stage.read_into(&sc, out);
                }
                return Ok(c.hits);
            }
            let v = match v {
                Some(v) => v,
                None => {
                    let v = Self::fetch(&s, &mut l.stage, &l.values, n * dim)?;
                    l.stage.sync(&s)?;
                    v
                }
            };
            if c.hits == n as u64 {
                // Every key hit: the rows (and scores) come straight back.
                l.stage.read_into(&v, values);
                if let Some(out) = scores {
                    l.stage.read_into(&sc, out);
                }
                return Ok(c.hits);
            }
            // Misses leave the caller's rows untouched: copy the hits only.
            let (v, sc) = (l.stage.read(&v), l.stage.read(&sc));
            for i in (0..n).filter(|&i| found[i]) {
                values[i * dim..(i + 1) * dim].copy_from_slice(&v[i * dim..(i + 1) * dim]);
            }
            if let Some(out) = scores {
                for i in (0..n).filter(|&i| found[i]) {
                    out[i] = sc[i];
                }
            }
            Ok(c.hits)
        })
    }
}
