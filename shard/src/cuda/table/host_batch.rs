//! Batches of host arrays: upload, launch in index-order rounds, fetch.

use super::*;

impl CudaTable {
    /// Rounds that give a small batch the CPU backend's index order: keys
    /// sharing a candidate bucket run in index order, each round in
    /// parallel. `None`: one launch (no shared bucket, or a batch above
    /// [`SEQUENTIAL_BATCH`] keys, whose order is unspecified).
    pub(super) fn rounds(&self, keys: &[u64], nbuckets: u64) -> Option<(Vec<u32>, u32)> {
        if keys.len() < 2 || keys.len() > SEQUENTIAL_BATCH {
            return None;
        }
        let dual = self.config.mode == BucketMode::Dual;
        let mut last: HashMap<u64, u32> = HashMap::with_capacity(keys.len() * 2);
        let mut round = vec![0u32; keys.len()];
        let mut max = 0;
        for (i, &k) in keys.iter().enumerate() {
            let b1 = bucket1(k, nbuckets);
            let b2 = if dual { bucket2(k, nbuckets) } else { b1 };
            let r = match last.get(&b1).copied().max(last.get(&b2).copied()) {
                Some(x) => x + 1,
                None => 0,
            };
            round[i] = r;
            max = max.max(r);
            last.insert(b1, r);
            last.insert(b2, r);
        }
        (max > 0).then_some((round, max))
    }

    /// Runs `launch` once per round of `keys` (see [`Self::rounds`]), with
    /// the lane's flags2 buffer holding which keys run (also restricted to
    /// `only`, when given). Counters accumulate over the rounds.
    pub(super) fn in_rounds(
        &self,
        l: &mut Lane,
        keys: &[u64],
        nbuckets: u64,
        only: Option<&[u8]>,
        mut launch: impl FnMut(&mut Lane, Option<DevPtr<u8>>) -> Result<()>,
    ) -> Result<()> {
        let s = l.stream.clone();
        match self.rounds(keys, nbuckets) {
            None => {
                let p = match only {
                    Some(o) => Some(Self::upload(&s, &mut l.stage, &mut l.flags2, o)?),
                    None => None,
                };
                launch(l, p)
            }
            Some((round, max)) => {
                let mut flags = vec![0u8; keys.len()];
                for r in 0..=max {
                    let mut any = false;
                    for i in 0..keys.len() {
                        flags[i] = (round[i] == r && only.is_none_or(|o| o[i] != 0)) as u8;
                        any |= flags[i] != 0;
                    }
                    if any {
                        // Each round's flags take their own staging region: no wait
                        // before flags is rewritten for the next round.
                        let p = Some(Self::upload(&s, &mut l.stage, &mut l.flags2, &flags)?);
                        launch(l, p)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Runs a verbatim write (a load, a rehash) of `n` keys in passes,
    /// `launch(lane, scoring, only)` launching it over the keys `only`
    /// flags (all when `None`; the caller's `first` mask in the first pass)
    /// with outcomes into `outcomes` (the lane's flags buffer, sized here
    /// and handed to `launch`). Dual mode: the kernel relocates a resident
    /// before it gives up on a key whose two buckets are full, but in one
    /// launch thousands of keys hold and try-lock buckets at once, so a
    /// relocation can fail for want of a lock that is free a moment later;
    /// each pass but the last leaves such keys in place (`HKV_SCORES_DEFER`,
    /// outcome absent) and the next runs them alone, with nothing racing
    /// them; the last pass (after [`DEFER_PASSES`], or once a pass placed
    /// none of them) evicts or refuses as the policy says. Single mode: one
    /// pass (a key has no other bucket). Returns the deferrals the counters
    /// hold as `absent` (every deferred key was run again after).
    pub(super) fn in_passes(
        &self,
        l: &mut Lane,
        n: usize,
        first: Option<&[u8]>,
        mut launch: impl FnMut(&mut Lane, ScoringArgs, Option<&[u8]>, DevPtr<u8>) -> Result<()>,
    ) -> Result<u64> {
        let s = l.stream.clone();
        let outcomes = Self::scratch(&s, &mut l.flags, n)?;
        if self.config.mode != BucketMode::Dual {
            launch(l, self.scoring(true), first, outcomes)?;
            return Ok(0);
        }
        let mut mask = first.map(<[u8]>::to_vec);
        let (mut deferrals, mut left, mut defer) = (0u64, u64::MAX, true);
        // Bounded: DEFER_PASSES deferring passes at most, then the last.
        for pass in 1.. {
            let sc = if defer { self.scoring_deferred() } else { self.scoring(true) };
            launch(l, sc, mask.as_deref(), outcomes)?;
            if !defer {
                break;
            }
            let absent = self.read_counters(l)?.summary.absent;
            let now = absent - deferrals;
            deferrals = absent;
            if now == 0 {
                break;
            }
            // Another deferring pass only while the last one placed some.
            defer = pass < DEFER_PASSES && now < left;
            left = now;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            l.stage.sync(&s)?;
            // A key the caller left out has no outcome written: its byte is stale.
            let absent = Outcome::Absent as u8;
            let out = l.stage.read(&f);
            mask = Some(match first {
                Some(m) => out.iter().zip(m).map(|(&o, &m)| u8::from(o == absent && m != 0)).collect(),
                None => out.iter().map(|&o| u8::from(o == absent)).collect(),
            });
        }
        Ok(deferrals)
    }

    /// The shared body of insert_or_assign, insert_and_evict, load,
    /// find_or_insert and the insert phase of accum_or_assign. Caller holds
    /// the inserter group and has checked the arguments. `only`: the keys to
    /// process (accum_or_assign's absent ones). Returns the counts, what lost
    /// its slot, and the raw outcome bytes when asked for.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn upsert_host(
        &self,
        l: &mut Lane,
        mode: i32,
        keys: &[u64],
        incoming: usize,
        values: Rows<'_>,
        scores: Option<&[u64]>,
        verbatim: bool,
        only: Option<&[u8]>,
        want_outcomes: bool,
        keep_lost: bool,
    ) -> Result<(Counts, Evictions, Vec<u8>)> {
        self.grow_for(incoming)?;
        let guard = self.storage.read();
        let st = &*guard;
        let s = l.stream.clone();
        let dim = self.config.dim;
        let n = keys.len();
        let mut p = Ptrs {
            keys: Some(Self::upload(&s, &mut l.stage, &mut l.keys, keys)?),
            values: Some(Self::upload(&s, &mut l.stage, &mut l.values, values.input())?),
            counters: Some(DevPtr::of(&l.counters, &s)),
            ..Ptrs::default()
        };
        if !verbatim && only.is_none() {
            // The keys of a client's write (not a load, nor accum_or_assign's
            // insert phase, whose keys were sampled in its update phase): the
            // kernel samples them (fused), each once over the rounds.
            let kind = if matches!(mode, UP_FIND_OR_INSERT | UP_FIND_OR_INSERT_PTR) {
                Kind::FindOrInsert
            } else {
                Kind::Write
            };
            p.sample = self.sample_args(&s, kind);
        }
        if let Some(sc) = scores {
            p.scores = Some(Self::upload(&s, &mut l.stage, &mut l.scores, sc)?);
        }
        if want_outcomes {
            p.outcomes = Some(Self::scratch(&s, &mut l.flags, n)?);
        }
        if keep_lost {
            p.lost = Some(LostPtrs {
                keys: Self::scratch(&s, &mut l.lost_keys, n)?,
                values: Self::scratch(&s, &mut l.lost_values, n * dim)?,
                scores: Self::scratch(&s, &mut l.lost_scores, n)?,
                kinds: Self::scratch(&s, &mut l.lost_kinds, n)?,
            });
        }
        self.zero_counters(l)?;
        if !verbatim && self.adapt.is_some() {
            // Adaptive: the batch's keys into the sketch before any is placed.
            let counted = only.map_or(n, |o| o.iter().filter(|&&x| x != 0).count()) as u64;
            let o = match only {
                Some(o) => Some(Self::upload(&s, &mut l.stage, &mut l.flags2, o)?),
                None => None,
            };
            let k = p.keys.expect("keys uploaded");
            // SAFETY: keys uploaded above and the flags here, n each.
            unsafe { self.k_adapt_count(&s, k, n as u64, o, counted) }?;
        }
        let nb = st.nbuckets;
        let deferrals = if verbatim {
            self.in_passes(l, n, only, |l, sc, only, out| {
                self.in_rounds(l, keys, nb, only, |_, o| {
                    // SAFETY: keys, values, scores and the lost buffers were uploaded or sized above for these
                    // n keys, outcomes by in_passes, flags2 by in_rounds
                    unsafe { self.k_upsert(&s, st, sc, n as u64, mode, Ptrs { only: o, outcomes: Some(out), ..p }) }
                })
            })?
        } else {
            let sc = self.scoring(false);
            let find_or_insert = matches!(mode, UP_FIND_OR_INSERT | UP_FIND_OR_INSERT_PTR);
            self.in_rounds(l, keys, nb, only, |l, o| {
                let q = Ptrs { only: o, ..p };
                // SAFETY: keys, values, scores, outcomes and the lost buffers were uploaded or sized above for
                // these n keys, flags2 by in_rounds; the find_or_insert scratch is the lane's, synchronised with it
                unsafe {
                    if find_or_insert {
                        self.k_find_or_insert(&s, st, sc, n as u64, mode, q, Some(&mut l.fior))
                    } else {
                        self.k_upsert(&s, st, sc, n as u64, mode, q)
                    }
                }
            })?;
            0
        };
        self.k_adapt_age(&s, st)?;
        if !verbatim {
            match only {
                // Sampled on the device from the uploaded keys, behind the
                // batch (a filter of every key on the host took longer than
                // the batch's kernels on the H200).
                // SAFETY: the keys were uploaded above, n of them, into the
                // lane's buffer, which stays until the stream has run this.
                None => unsafe { self.adapt_sample_device(&s, st, p.keys.expect("keys uploaded"), n, None, None) }?,
                // (The lane's flag buffer went to the rounds: filtered here.)
                Some(o) => self.adapt_observe(st, n, |i| (o[i] != 0).then_some(keys[i])),
            }
        }
        let rows = match values {
            Rows::InOut(_) => Some(Self::fetch(&s, &mut l.stage, &l.values, n * dim)?),
            Rows::In(_) => None,
        };
        let flags = Self::fetch(&s, &mut l.stage, &l.flags, if want_outcomes { n } else { 0 })?;
        let mut c = self.read_counters(l)?;
        self.adapt_done();
        c.summary.absent -= deferrals;
        if let (Some(r), Rows::InOut(out)) = (&rows, values) {
            l.stage.read_into(r, out);
        }
        let raw = l.stage.read(&flags).to_vec();
        let mut lost = Evictions::default();
        if keep_lost && c.lost > 0 {
            let m = c.lost as usize;
            let k = Self::fetch(&s, &mut l.stage, &l.lost_keys, m)?;
            let v = Self::fetch(&s, &mut l.stage, &l.lost_values, m * dim)?;
            let sc = Self::fetch(&s, &mut l.stage, &l.lost_scores, m)?;
            let kinds = Self::fetch(&s, &mut l.stage, &l.lost_kinds, m)?;
            l.stage.sync(&s)?;
            lost.keys = l.stage.read(&k).to_vec();
            lost.values = l.stage.read(&v).to_vec();
            lost.scores = l.stage.read(&sc).to_vec();
            lost.kinds = l.stage.read(&kinds).iter().map(|&k| lost_kind(k)).collect();
        }
        self.size.fetch_add(c.summary.inserted, Relaxed);
        self.counters.summary(&c.summary);
        Ok((c, lost, raw))
    }

    /// A reader-group batch of `keys` (`op`): takes the group and counts the
    /// op; unless the batch is empty, runs `f` on a lane with the storage
    /// and `Ptrs` holding the uploaded keys, the lane's counters, cleared,
    /// and the sampler (`f` launches one lookup over the keys, which
    /// samples them); counts the hits `f` returns as lookups.
    pub(super) fn read_batch(
        &self,
        op: Op,
        keys: &[u64],
        f: impl FnOnce(&Storage, &mut Lane, Ptrs) -> Result<u64>,
    ) -> Result<usize> {
        let n = keys.len();
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(op, n);
        if n == 0 {
            return Ok(0);
        }
        let guard = self.storage.read();
        let st = &*guard;
        let hits = self.with_lane(|l| {
            let s = l.stream.clone();
            let keys = Self::upload(&s, &mut l.stage, &mut l.keys, keys)?;
            self.zero_counters(l)?;
            let counters = Some(DevPtr::of(&l.counters, &s));
            // The lookup kernel samples the keys (fused), once per batch.
            let sample = self.sample_args(&s, Kind::Lookup);
            f(st, l, Ptrs { keys: Some(keys), counters, sample, ..Ptrs::default() })
        })?;
        self.counters.lookups(hits, n);
        Ok(hits as usize)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn upsert_batch(
        &self,
        op: Op,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        verbatim: bool,
        outcomes: Option<&mut [Outcome]>,
        keep_lost: bool,
    ) -> Result<(Counts, Evictions)> {
        let n = keys.len();
        // Verbatim scores (load) are checked by the caller, not against the policy.
        let policy_scores = if !verbatim { scores } else { None };
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            policy_scores,
            !verbatim,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(op, n);
        if n == 0 {
            return Ok(Default::default());
        }
        let want = outcomes.is_some();
        let (c, lost, raw) = self.with_lane(|l| {
            self.upsert_host(l, UP_INSERT, keys, n, Rows::In(values), scores, verbatim, None, want, keep_lost)
        })?;
        set_outcomes(outcomes, &raw, None);
        Ok((c, lost))
    }

    pub(super) fn update_batch(
        &self,
        op: Op,
        mode: i32,
        keys: &[u64],
        values: Option<&[f32]>,
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(op, n);
        if n == 0 {
            return Ok(Summary::default());
        }
        let guard = self.storage.read();
        let st = &*guard;
        let want = outcomes.is_some();
        let (summary, raw) = self.with_lane(|l| self.update_host(l, st, mode, keys, values, scores, want, false))?;
        set_outcomes(outcomes, &raw, None);
        Ok(summary)
    }

    /// An update kernel over `keys` in rounds; returns the summary and the
    /// raw outcomes (when asked); with `flag_absent`, the lane's flags
    /// buffer ends up holding 1 for each absent key (downloaded into the
    /// returned vector instead of outcomes).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn update_host(
        &self,
        l: &mut Lane,
        st: &Storage,
        mode: i32,
        keys: &[u64],
        values: Option<&[f32]>,
        scores: Option<&[u64]>,
        want_outcomes: bool,
        flag_absent: bool,
    ) -> Result<(Summary, Vec<u8>)> {
        let s = l.stream.clone();
        let n = keys.len();
        let mut p = Ptrs {
            keys: Some(Self::upload(&s, &mut l.stage, &mut l.keys, keys)?),
            counters: Some(DevPtr::of(&l.counters, &s)),
            ..Ptrs::default()
        };
        // The kernel samples the keys (fused), each once over the rounds:
        // accum_or_assign's update phase (`flag_absent`) is a write that
        // may insert, assign and assign_scores refresh present keys only.
        p.sample = self.sample_args(&s, if flag_absent { Kind::Write } else { Kind::Update });
        if let Some(v) = values {
            p.values = Some(Self::upload(&s, &mut l.stage, &mut l.values, v)?);
        }
        if let Some(sc) = scores {
            p.scores = Some(Self::upload(&s, &mut l.stage, &mut l.scores, sc)?);
        }
        if want_outcomes {
            p.outcomes = Some(Self::scratch(&s, &mut l.flags, n)?);
        }
        if flag_absent {
            p.found = Some(Self::scratch(&s, &mut l.lost_kinds, n)?);
        }
        self.zero_counters(l)?;
        let sc = self.scoring(false);
        self.in_rounds(l, keys, st.nbuckets, None, |_, o| {
            // SAFETY: keys, values, scores, outcomes and absent flags were uploaded or sized above for these
            // n keys, flags2 by in_rounds
            unsafe { self.k_update(&s, st, sc, n as u64, mode, Ptrs { only: o, ..p }) }
        })?;
        let flags = if flag_absent {
            Self::fetch(&s, &mut l.stage, &l.lost_kinds, n)?
        } else {
            Self::fetch(&s, &mut l.stage, &l.flags, if want_outcomes { n } else { 0 })?
        };
        let c = self.read_counters(l)?;
        Ok((c.summary, l.stage.read(&flags).to_vec()))
    }
}

/// The value rows of an upsert: uploaded only, or uploaded and then
/// overwritten with the stored rows (find_or_insert).
pub(super) enum Rows<'a> {
    In(&'a [f32]),
    InOut(&'a mut [f32]),
}

impl Rows<'_> {
    pub(super) fn input(&self) -> &[f32] {
        match self {
            Rows::In(v) => v,
            Rows::InOut(v) => v,
        }
    }
}

/// Writes raw outcome bytes into the caller's array (only where `mask` is
/// non-zero, when given).
pub(super) fn set_outcomes(out: Option<&mut [Outcome]>, raw: &[u8], mask: Option<&[u8]>) {
    if let Some(o) = out {
        for (i, (d, &r)) in o.iter_mut().zip(raw).enumerate() {
            if mask.is_none_or(|m| m[i] != 0) {
                *d = Outcome::from_u8(r).unwrap_or(Outcome::Absent);
            }
        }
    }
}
