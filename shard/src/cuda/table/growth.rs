//! Growth: the rehash into doubled storage, swapped in only once loaded.

use super::*;

impl CudaTable {
    /// Doubles the buckets while `incoming` more keys would pass the max load
    /// factor and the max capacity allows. Caller holds the inserter group.
    pub(super) fn grow_for(&self, incoming: usize) -> Result<()> {
        let max_buckets = self.config.max_buckets();
        loop {
            let nb = self.nbuckets();
            let cap = (nb * S) as f64;
            let want = (self.size.load(Relaxed) + incoming as u64) as f64;
            if want <= self.config.max_load_factor * cap || nb * 2 > max_buckets {
                return Ok(());
            }
            self.rehash(nb * 2)?;
        }
    }

    pub(super) fn nbuckets(&self) -> u64 {
        self.storage.read().nbuckets
    }

    /// Makes the next grow fail after its new storage is loaded, as a
    /// device error would; for tests of the failure path only.
    #[doc(hidden)]
    pub fn fail_next_grow(&self) {
        self.fail_grow.store(true, Relaxed);
    }

    /// Rebuilds the table with `nbuckets` buckets: every entry is exported
    /// into device buffers and loaded (scores verbatim) into new storage,
    /// which replaces the old one only once loaded: on any error the table
    /// is left as it was.
    pub(super) fn rehash(&self, nbuckets: u64) -> Result<()> {
        let mut guard = self.storage.write();
        let old = &*guard;
        let mut l = self.lane()?;
        let s = l.stream.clone();
        let dim = self.config.dim;
        let slots = old.nbuckets * S;
        let nb_old = old.nbuckets as usize;
        let counts = s.alloc_zeros::<u32>(nb_old).map_err(dev_err("allocating"))?;
        let offsets = s.alloc_zeros::<u64>(nb_old + 1).map_err(dev_err("allocating"))?;
        let (cp, op) = (DevPtr::of(&counts, &s), DevPtr::of(&offsets, &s));
        let all = filter_args(&Filter::ALL);
        // SAFETY: counts and offsets span every bucket of the old storage; count pass only
        unsafe { self.k_export(&s, old, 0, slots, all, cp, op, None) }?;
        let mut total = [0u64];
        s.memcpy_dtoh(&offsets.slice(nb_old..nb_old + 1), &mut total).map_err(dev_err("reading the entry count"))?;
        s.synchronize().map_err(dev_err("counting entries for growth"))?;
        let size = total[0] as usize;
        let keys = s.alloc_zeros::<u64>(size.max(1)).map_err(dev_err("allocating"))?;
        let values = s.alloc_zeros::<f32>((size * dim).max(1)).map_err(dev_err("allocating"))?;
        let scores = s.alloc_zeros::<u64>(size.max(1)).map_err(dev_err("allocating"))?;
        let out = ExportPtrs {
            keys: DevPtr::of(&keys, &s),
            values: DevPtr::of(&values, &s),
            scores: DevPtr::of(&scores, &s),
        };
        // SAFETY: counts / offsets span every bucket; the outputs hold the
        // `size` entries the count pass found.
        unsafe { self.k_export(&s, old, 0, slots, all, cp, op, Some(out)) }?;
        s.synchronize().map_err(dev_err("exporting for growth"))?;
        drop(counts);
        let new = Storage::new(&self.dev, &self.config, &self.f.clear, &s, nbuckets)?;
        self.zero_counters(&mut l)?;
        let p = Ptrs {
            keys: Some(out.keys.take(size)),
            values: Some(out.values.take(size * dim)),
            scores: Some(out.scores.take(size)),
            ..Ptrs::default()
        };
        let p = Ptrs { counters: Some(DevPtr::of(&l.counters, &s)), ..p };
        // Loaded in passes (dual mode): a key that finds both its buckets
        // full is placed after the rest, by relocation, before any entry is evicted.
        let deferrals = self.in_passes(&mut l, size, None, |l, sc, only, out| {
            let only = match only {
                Some(m) => Some(Self::upload(&s, &mut l.stage, &mut l.flags2, m)?),
                None => None,
            };
            // SAFETY: keys, values and scores hold the `size` exported entries; the counters are the lane's,
            // outcomes sized by in_passes, only uploaded above for `size` keys
            unsafe { self.k_upsert(&s, &new, sc, size as u64, UP_INSERT, Ptrs { only, outcomes: Some(out), ..p }) }
        })?;
        let mut c = self.read_counters(&mut l)?;
        c.summary.absent -= deferrals;
        if self.fail_grow.swap(false, Relaxed) {
            return Err(Error::Device("growing the table: injected failure".into()));
        }
        // Only now, with every entry in the new storage, is the old one dropped.
        *guard = new;
        self.size.store(c.summary.inserted, Relaxed);
        self.counters.evictions.fetch_add(c.summary.evicted + c.summary.rejected, Relaxed);
        drop((keys, values, scores, offsets));
        self.put_lane(l);
        Ok(())
    }
}
