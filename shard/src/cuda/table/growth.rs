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

    /// The bucket count a reserve of `capacity` slots grows to (doubling
    /// up to the config's maximum, as growth does), or `None` when the
    /// table has enough.
    pub(super) fn reserve_target(&self, capacity: u64) -> Option<u64> {
        let now = self.nbuckets();
        let mut nb = now;
        // Bounded: doubles up to max_buckets.
        while nb * S < capacity && nb * 2 <= self.config.max_buckets() {
            nb *= 2;
        }
        (nb > now).then_some(nb)
    }

    /// [`Shard::reserve`]: one rehash to the final size, into what
    /// [`Shard::prepare_reserve`] allocated when it was for this size.
    /// Caller holds the inserter group.
    pub(super) fn grow_to(&self, capacity: u64) -> Result<()> {
        let prepared = self.prepared.lock().take();
        match self.reserve_target(capacity) {
            Some(nb) => self.rehash_with(nb, prepared),
            None => Ok(()),
        }
    }

    /// [`Shard::prepare_reserve`]: allocates the storage a reserve of
    /// `capacity` grows into (device buffers, the pinned host tier,
    /// cleared) and export buffers for every slot of today's storage,
    /// the table unchanged. What was prepared before is freed first, so
    /// that two prepared storages are never held at once.
    pub(super) fn prepare_growth(&self, capacity: u64) -> Result<()> {
        *self.prepared.lock() = None;
        let Some(nbuckets) = self.reserve_target(capacity) else { return Ok(()) };
        let from = self.nbuckets();
        let p = self.with_lane(|l| {
            let s = l.stream.clone();
            let export = ExportBufs::alloc(&s, from as usize, (from * S) as usize, self.config.dim)?;
            // Synchronises the stream: the export buffers are zeroed too
            // before another lane's stream uses them.
            let storage = Storage::new(&self.dev, &self.config, &self.f.clear, &s, nbuckets)?;
            Ok(Prepared { nbuckets, from, storage, export })
        })?;
        *self.prepared.lock() = Some(p);
        Ok(())
    }

    /// Rebuilds the table with `nbuckets` buckets: every entry is exported
    /// into device buffers and loaded (scores verbatim) into new storage,
    /// which replaces the old one only once loaded: on any error the table
    /// is left as it was.
    pub(super) fn rehash(&self, nbuckets: u64) -> Result<()> {
        self.rehash_with(nbuckets, None)
    }

    /// [`CudaTable::rehash`] into what `prepared` allocated, when it was
    /// prepared for this growth (`nbuckets`, from today's bucket count):
    /// then nothing large is allocated (a lane's per-key outcome bytes
    /// remain); otherwise it allocates as it goes.
    pub(super) fn rehash_with(&self, nbuckets: u64, prepared: Option<Prepared>) -> Result<()> {
        let mut guard = self.storage.write();
        let old = &*guard;
        let prepared = prepared.filter(|p| p.nbuckets == nbuckets && p.from == old.nbuckets);
        let mut l = self.lane()?;
        let s = l.stream.clone();
        let dim = self.config.dim;
        let slots = old.nbuckets * S;
        let nb_old = old.nbuckets as usize;
        let (new, mut export) = match prepared {
            Some(p) => (Some(p.storage), p.export),
            None => (None, ExportBufs::alloc(&s, nb_old, 0, dim)?),
        };
        let (cp, op) = (DevPtr::of(&export.counts, &s), DevPtr::of(&export.offsets, &s));
        let all = filter_args(&Filter::ALL);
        // SAFETY: counts and offsets span every bucket of the old storage; count pass only
        unsafe { self.k_export(&s, old, 0, slots, all, cp, op, None) }?;
        let mut total = [0u64];
        s.memcpy_dtoh(&export.offsets.slice(nb_old..nb_old + 1), &mut total)
            .map_err(dev_err("reading the entry count"))?;
        s.synchronize().map_err(dev_err("counting entries for growth"))?;
        let size = total[0] as usize;
        export.fit(&s, size, dim)?;
        let out = ExportPtrs {
            keys: DevPtr::of(&export.keys, &s),
            values: DevPtr::of(&export.values, &s),
            scores: DevPtr::of(&export.scores, &s),
        };
        // SAFETY: counts / offsets span every bucket; the outputs hold at
        // least the `size` entries the count pass found.
        unsafe { self.k_export(&s, old, 0, slots, all, cp, op, Some(out)) }?;
        s.synchronize().map_err(dev_err("exporting for growth"))?;
        let new = match new {
            Some(st) => st,
            None => Storage::new(&self.dev, &self.config, &self.f.clear, &s, nbuckets)?,
        };
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
        drop(export);
        self.put_lane(l);
        Ok(())
    }
}

/// What a reserve allocated before growing ([`CudaTable::prepare_growth`]).
pub(super) struct Prepared {
    /// The bucket count it grows to.
    nbuckets: u64,
    /// The bucket count it grows from (a table grown meanwhile does not use it).
    from: u64,
    storage: Storage,
    export: ExportBufs,
}

/// The device buffers a rehash exports the old storage into: per old
/// bucket a count and an offset (one more), and keys, values and scores
/// for the entries.
pub(super) struct ExportBufs {
    counts: CudaSlice<u32>,
    offsets: CudaSlice<u64>,
    keys: CudaSlice<u64>,
    values: CudaSlice<f32>,
    scores: CudaSlice<u64>,
}

impl ExportBufs {
    /// Buffers for `buckets` buckets and `entries` entries of `dim` floats.
    fn alloc(s: &Arc<CudaStream>, buckets: usize, entries: usize, dim: usize) -> Result<ExportBufs> {
        let a = |what: &'static str| alloc_err(what);
        let n = entries.max(1);
        Ok(ExportBufs {
            counts: s.alloc_zeros::<u32>(buckets).map_err(a("allocating growth's bucket counts"))?,
            offsets: s.alloc_zeros::<u64>(buckets + 1).map_err(a("allocating growth's bucket offsets"))?,
            keys: s.alloc_zeros::<u64>(n).map_err(a("allocating growth's keys"))?,
            values: s.alloc_zeros::<f32>(n * dim).map_err(a("allocating growth's values"))?,
            scores: s.alloc_zeros::<u64>(n).map_err(a("allocating growth's scores"))?,
        })
    }

    /// Makes room for `entries` entries (a prepared set has room for every
    /// slot already).
    fn fit(&mut self, s: &Arc<CudaStream>, entries: usize, dim: usize) -> Result<()> {
        if self.keys.len() >= entries {
            return Ok(());
        }
        let a = |what: &'static str| alloc_err(what);
        self.keys = s.alloc_zeros::<u64>(entries).map_err(a("allocating growth's keys"))?;
        self.values = s.alloc_zeros::<f32>(entries * dim).map_err(a("allocating growth's values"))?;
        self.scores = s.alloc_zeros::<u64>(entries).map_err(a("allocating growth's scores"))?;
        Ok(())
    }
}
