//! The device-batch API: operations on buffers already on the GPU, and
//! the enqueue / complete pair the GPU group builds on.

use super::*;

/// An operation on device-resident buffers ([`CudaTable::run_device`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceOp {
    /// One optimizer step on present keys' rows in place
    /// ([`crate::Shard::apply_gradients`]): `values` holds the gradients,
    /// n × the step's dim; the found flags and, where given, each key's
    /// values after the step are written.
    ApplyGradients(crate::optim::Step),
    /// Values, found flags and scores of `keys`.
    Find,
    /// Device addresses of the values of `keys` (0 for misses), into `ptrs`.
    FindPtr,
    /// Found flags.
    Contains,
    /// Upsert `values`.
    InsertOrAssign,
    /// Upsert, with what lost its slot compacted into the `lost_*` buffers.
    InsertAndEvict,
    /// Stored rows of present keys into `values`; the given rows inserted otherwise.
    FindOrInsert,
    /// Present or newly inserted keys' value addresses into `ptrs` (0 if
    /// refused); new rows are left for the caller to write.
    FindOrInsertPtr,
    /// Overwrite present keys' values.
    Assign,
    /// Add `values` (deltas) to present keys' values; insert absent keys
    /// with the deltas as their values (one upsert launch, inserter group).
    AccumOrAssign,
    /// Remove keys.
    Erase,
    /// Insert or overwrite `values` with the given `scores` kept verbatim
    /// (restores and resharding).
    Load,
    /// Export `n` slots from `offset`, compacted into `out_*`.
    Export {
        /// First slot position.
        offset: u64,
        /// Predicate.
        filter: Filter,
    },
}

/// Device buffers for batches of up to `n` keys (see [`CudaTable::run_device`]).
pub struct DeviceBatch {
    /// Capacity in keys.
    pub n: usize,
    /// Keys in.
    pub keys: CudaSlice<u64>,
    /// Values in or out, `n * dim`.
    pub values: CudaSlice<f32>,
    /// Scores out (find).
    pub scores: CudaSlice<u64>,
    /// Found / erased flags out.
    pub found: CudaSlice<u8>,
    /// Outcomes out.
    pub outcomes: CudaSlice<u8>,
    /// Value addresses out.
    pub ptrs: CudaSlice<u64>,
    /// insert_and_evict output: keys, values, scores, kinds.
    pub lost_keys: CudaSlice<u64>,
    /// insert_and_evict output values.
    pub lost_values: CudaSlice<f32>,
    /// insert_and_evict output scores.
    pub lost_scores: CudaSlice<u64>,
    /// insert_and_evict output kinds (0 evicted, 1 rejected).
    pub lost_kinds: CudaSlice<u8>,
    /// Export output keys (`n`).
    pub out_keys: CudaSlice<u64>,
    /// Export output values.
    pub out_values: CudaSlice<f32>,
    /// Export output scores.
    pub out_scores: CudaSlice<u64>,
    counts: CudaSlice<u32>,
    offsets: CudaSlice<u64>,
    counters: CudaSlice<u64>,
    /// The stream every operation on this batch runs on.
    pub stream: Arc<CudaStream>,
}

/// What [`CudaTable::run_device`] measured and counted.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRun {
    /// Kernel time between CUDA events, in milliseconds.
    pub ms: f32,
    /// Counts of the batch.
    pub counts: Counts,
}

impl CudaTable {
    /// Allocates device buffers for batches of up to `n` keys, on a new stream.
    pub fn device_batch(&self, n: usize) -> Result<DeviceBatch> {
        let s = self.dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let dim = self.config.dim;
        let n1 = n.max(1);
        let a = |e| dev_err("allocating a device batch")(e);
        let nb = n1 / BUCKET_SLOTS + 2;
        Ok(DeviceBatch {
            n,
            keys: s.alloc_zeros(n1).map_err(a)?,
            values: s.alloc_zeros(n1 * dim).map_err(a)?,
            scores: s.alloc_zeros(n1).map_err(a)?,
            found: s.alloc_zeros(n1).map_err(a)?,
            outcomes: s.alloc_zeros(n1).map_err(a)?,
            ptrs: s.alloc_zeros(n1).map_err(a)?,
            lost_keys: s.alloc_zeros(n1).map_err(a)?,
            lost_values: s.alloc_zeros(n1 * dim).map_err(a)?,
            lost_scores: s.alloc_zeros(n1).map_err(a)?,
            lost_kinds: s.alloc_zeros(n1).map_err(a)?,
            out_keys: s.alloc_zeros(n1 + BUCKET_SLOTS).map_err(a)?,
            out_values: s.alloc_zeros((n1 + BUCKET_SLOTS) * dim).map_err(a)?,
            out_scores: s.alloc_zeros(n1 + BUCKET_SLOTS).map_err(a)?,
            counts: s.alloc_zeros(nb).map_err(a)?,
            offsets: s.alloc_zeros(nb + 1).map_err(a)?,
            counters: s.alloc_zeros(NCOUNTERS).map_err(a)?,
            stream: s,
        })
    }

    /// Runs `op` on the first `n` keys of `b` (already on the device), under
    /// the op's lock group; results stay in `b`. Returns the kernel time
    /// (CUDA events) and the batch's counts.
    pub fn run_device(&self, op: DeviceOp, b: &mut DeviceBatch, n: usize) -> Result<DeviceRun> {
        if n > b.n {
            return Err(Error::Config(format!("{n} keys for a device batch of {}", b.n)));
        }
        let s = b.stream.clone();
        s.memset_zeros(&mut b.counters).map_err(dev_err("clearing counters"))?;
        let raw = Raw {
            p: Ptrs {
                keys: Some(DevPtr::of(&b.keys, &s)),
                values: Some(DevPtr::of(&b.values, &s)),
                scores: Some(DevPtr::of(&b.scores, &s)),
                // A step that sums repeated keys answers no flag per key.
                found: match op {
                    DeviceOp::ApplyGradients(step) if step.sum => None,
                    _ => Some(DevPtr::of(&b.found, &s)),
                },
                ptrs: Some(DevPtr::of(&b.ptrs, &s)),
                lost: Some(LostPtrs {
                    keys: DevPtr::of(&b.lost_keys, &s),
                    values: DevPtr::of(&b.lost_values, &s),
                    scores: DevPtr::of(&b.lost_scores, &s),
                    kinds: DevPtr::of(&b.lost_kinds, &s),
                }),
                counters: Some(DevPtr::of(&b.counters, &s)),
                ..Ptrs::default()
            },
            export: Some(ExportArgs {
                out: ExportPtrs {
                    keys: DevPtr::of(&b.out_keys, &s),
                    values: DevPtr::of(&b.out_values, &s),
                    scores: DevPtr::of(&b.out_scores, &s),
                },
                counts: DevPtr::of(&b.counts, &s),
                offsets: DevPtr::of(&b.offsets, &s),
            }),
        };
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = s.record_event(timing).map_err(dev_err("recording an event"))?;
        // SAFETY: every pointer is one of the batch's buffers, allocated by
        // device_batch for `b.n` >= n keys (n × dim floats, and the export
        // outputs for n + 128 slots, at least the matches of n slots), and
        // the stream is synchronised below before the batch can be reused.
        let pending = unsafe { self.enqueue(op, &s, n, raw) }?;
        let end = s.record_event(timing).map_err(dev_err("recording an event"))?;
        let c = s.clone_dtoh(&b.counters).map_err(dev_err("reading counters"))?;
        s.synchronize().map_err(dev_err("synchronizing"))?;
        let ms = start.elapsed_ms(&end).map_err(dev_err("reading events"))?;
        Ok(DeviceRun { ms, counts: self.complete(pending, &c) })
    }

    /// Takes `op`'s lock group and launches it on stream `s` over `n` keys at
    /// the device addresses of `r`, without waiting. The batch's counters
    /// (`r.p.counters`, 8 u64, zeroed by the caller) are read after the
    /// stream is synchronised and handed to [`CudaTable::complete`] with the
    /// returned [`Pending`], which holds the lock group until then.
    ///
    /// # Safety
    /// Every non-zero address of `r` is a buffer on this table's device,
    /// sized for `n` keys as the op's kernel needs (see `k_lookup`,
    /// `k_upsert`, `k_update`, `k_erase`; export outputs for every match of
    /// `n` slots), alive and untouched by other streams until `s` is
    /// synchronised.
    pub(crate) unsafe fn enqueue(&self, op: DeviceOp, s: &Arc<CudaStream>, n: usize, r: Raw) -> Result<Pending<'_>> {
        // SAFETY: forwarded contract; the lock group is taken here.
        let p = unsafe { self.enqueue_in(op, s, n, r, Some(n)) }?;
        self.book(op, n);
        Ok(p)
    }

    /// [`CudaTable::enqueue`] of the first part of one batch served in
    /// parts: takes the lock group and makes room for `incoming` keys (an
    /// upper bound of the batch); the other parts follow with
    /// [`CudaTable::enqueue_held`]. The caller books the batch
    /// ([`CudaTable::book`], [`Pending::set_keys`]).
    ///
    /// # Safety
    /// As [`CudaTable::enqueue`].
    pub(crate) unsafe fn enqueue_first(
        &self,
        op: DeviceOp,
        s: &Arc<CudaStream>,
        n: usize,
        r: Raw,
        incoming: usize,
    ) -> Result<Pending<'_>> {
        // SAFETY: forwarded contract; the lock group is taken here.
        unsafe { self.enqueue_in(op, s, n, r, Some(incoming)) }
    }

    /// A further part of the batch begun by [`CudaTable::enqueue_first`],
    /// inside the lock group its [`Pending`] holds (which must not complete
    /// before this part's stream is synchronised); fold the returned
    /// [`Pending`] into it with [`Pending::absorb`].
    ///
    /// # Safety
    /// As [`CudaTable::enqueue`].
    pub(crate) unsafe fn enqueue_held(
        &self,
        op: DeviceOp,
        s: &Arc<CudaStream>,
        n: usize,
        r: Raw,
    ) -> Result<Pending<'_>> {
        // SAFETY: forwarded contract; the caller holds the group.
        unsafe { self.enqueue_in(op, s, n, r, None) }
    }

    /// Counts one `op` of `keys` keys in the table's stats.
    pub(crate) fn book(&self, op: DeviceOp, keys: usize) {
        let stat = match op {
            DeviceOp::Find | DeviceOp::FindPtr => Op::Find,
            DeviceOp::Contains => Op::Contains,
            DeviceOp::InsertOrAssign | DeviceOp::Load => Op::InsertOrAssign,
            DeviceOp::InsertAndEvict => Op::InsertAndEvict,
            DeviceOp::FindOrInsert | DeviceOp::FindOrInsertPtr => Op::FindOrInsert,
            DeviceOp::Assign => Op::Assign,
            DeviceOp::AccumOrAssign => Op::AccumOrAssign,
            DeviceOp::ApplyGradients(_) => Op::ApplyGradients,
            DeviceOp::Erase => Op::Erase,
            DeviceOp::Export { .. } => Op::Export,
        };
        self.counters.op(stat, keys);
    }

    /// `incoming`: when this call begins a batch, the keys to make room
    /// for (takes the lock group and grows the table); None for a further
    /// part.
    pub(super) unsafe fn enqueue_in(
        &self,
        op: DeviceOp,
        s: &Arc<CudaStream>,
        n: usize,
        r: Raw,
        incoming: Option<usize>,
    ) -> Result<Pending<'_>> {
        let group = match op {
            DeviceOp::Find | DeviceOp::FindPtr | DeviceOp::Contains | DeviceOp::Export { .. } => Group::Reader,
            DeviceOp::Assign | DeviceOp::ApplyGradients(_) => Group::Updater,
            _ => Group::Inserter,
        };
        // From here on, an early return drops `pending`, which waits for
        // `s` before it lets the lock group go.
        let mut pending = Pending {
            op,
            n,
            streams: vec![s.clone()],
            lanes: Vec::new(),
            synchronized: false,
            _guard: incoming.map(|_| self.lock.acquire(group)),
        };
        if let Some(total) = incoming {
            if group == Group::Inserter && op != DeviceOp::Erase {
                self.grow_for(total)?;
            }
        }
        let st_guard = self.storage.read();
        let st = &*st_guard;
        // The kernel of a sampled op samples the keys this part serves
        // (`only`) as it reads them (fused); erase, load and export are not
        // sampled.
        let sampled = !matches!(op, DeviceOp::Erase | DeviceOp::Load | DeviceOp::Export { .. });
        let kind = match op {
            DeviceOp::Find | DeviceOp::FindPtr | DeviceOp::Contains => Kind::Lookup,
            DeviceOp::FindOrInsert | DeviceOp::FindOrInsertPtr => Kind::FindOrInsert,
            DeviceOp::Assign | DeviceOp::ApplyGradients(_) => Kind::Update,
            _ => Kind::Write,
        };
        let sample = if sampled { self.sample_args(s, kind) } else { SampleArgs::default() };
        let base = Ptrs { keys: r.p.keys, counters: r.p.counters, only: r.p.only, sample, ..Ptrs::default() };
        let p = r.p;
        let n64 = n as u64;
        // Adaptive: a write's keys into the sketch before the kernel places
        // them; a find's hits count in their scores as the kernel refreshes
        // them. The hits of a device batch are not known here: the halving
        // period counts its keys (those of a part included) instead.
        let writes = matches!(
            op,
            DeviceOp::InsertOrAssign
                | DeviceOp::InsertAndEvict
                | DeviceOp::FindOrInsert
                | DeviceOp::FindOrInsertPtr
                | DeviceOp::AccumOrAssign
        );
        if let (true, Some(k)) = (writes, p.keys) {
            // SAFETY: the caller's contract: keys and only hold n entries.
            unsafe { self.k_adapt_count(s, k, n64, p.only, n64) }?;
        }
        if op == DeviceOp::Find && self.config.refreshes_reads() {
            self.adapt_counted(n64);
        }
        // SAFETY: the caller's contract covers every address passed on.
        unsafe {
            match op {
                DeviceOp::Find => {
                    let p = Ptrs {
                        values: p.values,
                        found: p.found,
                        scores: p.scores,
                        zero_misses: p.zero_misses,
                        find: true,
                        ..base
                    };
                    self.k_lookup(s, st, n64, p)?
                }
                DeviceOp::FindPtr => self.k_lookup(s, st, n64, Ptrs { ptrs: p.ptrs, ..base })?,
                DeviceOp::Contains => self.k_lookup(s, st, n64, Ptrs { found: p.found, ..base })?,
                DeviceOp::FindOrInsert | DeviceOp::FindOrInsertPtr => {
                    let (q, mode) = match op {
                        DeviceOp::FindOrInsert => (Ptrs { values: p.values, ..base }, UP_FIND_OR_INSERT),
                        _ => (Ptrs { ptrs: p.ptrs, ..base }, UP_FIND_OR_INSERT_PTR),
                    };
                    // A large batch's scratch is a lane's buffer, the
                    // lane held by `pending` until `s` is synchronised.
                    let miss = if self.probes(n64) { Some(&mut pending.hold(self.lane()?).fior) } else { None };
                    self.k_find_or_insert(s, st, self.scoring(false), n64, mode, q, miss)?
                }
                DeviceOp::InsertOrAssign | DeviceOp::InsertAndEvict => {
                    let mut q = Ptrs { values: p.values, ..base };
                    if op == DeviceOp::InsertAndEvict {
                        q.lost = p.lost;
                    }
                    self.k_upsert(s, st, self.scoring(false), n64, UP_INSERT, q)?
                }
                DeviceOp::Load => {
                    let q = Ptrs { values: p.values, scores: p.scores, ..base };
                    self.k_upsert(s, st, self.scoring(true), n64, UP_INSERT, q)?
                }
                DeviceOp::AccumOrAssign => {
                    let q = Ptrs { values: p.values, ..base };
                    self.k_upsert(s, st, self.scoring(false), n64, UP_ACCUM, q)?
                }
                DeviceOp::Assign => {
                    self.k_update(s, st, self.scoring(false), n64, UPD_ASSIGN, Ptrs { values: p.values, ..base })?
                }
                DeviceOp::ApplyGradients(step) => {
                    crate::optim::check_step(self.config.dim, &step)?;
                    let mut q = Ptrs { values: p.values, found: p.found, updated: p.updated, ..base };
                    if step.sum && n64 > 0 {
                        if p.found.is_some() || p.updated.is_some() {
                            return Err(Error::Optimizer(
                                "a step that sums repeated keys' gradients answers no flags or values per key".into(),
                            ));
                        }
                        // The scratch is a lane's, held by `pending` until
                        // `s` is synchronised.
                        let l = pending.hold(self.lane()?);
                        let (first, sums) =
                            self.k_sum(s, n64, step.dim, p.keys, p.only, p.values, &mut l.fior, &mut l.sums)?;
                        q = Ptrs { values: Some(sums), only: Some(first), ..q };
                    }
                    self.k_step(s, st, self.scoring(false), n64, &step, q)?
                }
                DeviceOp::Erase => self.k_erase(s, st, n64, Ptrs { found: p.found, ..base })?,
                DeviceOp::Export { offset, filter } => {
                    let cap = st.nbuckets * S;
                    let end = offset.saturating_add(n64).min(cap);
                    let Some(x) = r.export else {
                        return Err(Error::Config("an export without output buffers".into()));
                    };
                    if offset < end {
                        self.k_export(s, st, offset, end, filter_args(&filter), x.counts, x.offsets, Some(x.out))?;
                    }
                }
            }
        }
        if writes || op == DeviceOp::Load {
            self.k_adapt_age(s, st)?;
        }
        // Adaptive: the accesses counted (a write's keys in the sketch, a
        // refreshing find's hits in their scores), sampled for the window share's
        // miniatures. A find without found flags leaves its hits unknown
        // and feeds nothing.
        let read = op == DeviceOp::Find && self.config.refreshes_reads() && p.found.is_some();
        if let (true, Some(k)) = (writes || read, p.keys) {
            // SAFETY: the caller's contract: keys, only and found hold n
            // entries, alive until `s` is synchronised.
            unsafe { self.adapt_sample_device(s, st, k, n, p.only, if read { p.found } else { None }) }?;
        }
        Ok(pending)
    }

    /// Books a finished [`CudaTable::enqueue`]: `c` are its 8 counters,
    /// read after its stream was synchronised. Returns the lanes it held
    /// to the pool and releases the lock group.
    pub(crate) fn complete(&self, mut pending: Pending<'_>, c: &[u64]) -> Counts {
        pending.synchronized = true;
        for l in pending.lanes.drain(..) {
            self.put_lane(l);
        }
        let counts = counts(c);
        match pending.op {
            DeviceOp::Find | DeviceOp::FindPtr | DeviceOp::Contains => self.counters.lookups(counts.hits, pending.n),
            DeviceOp::Erase => {
                self.size.fetch_sub(counts.erased, Relaxed);
            }
            DeviceOp::Export { .. } | DeviceOp::Assign => {}
            DeviceOp::FindOrInsert | DeviceOp::FindOrInsertPtr => {
                // A lookup as well as a write, counted as the host batch
                // counts it (`Shard::find_or_insert`): its hits are the
                // keys found (updated), its lookups every key it served,
                // found or placed or refused (with a part's mask, only that
                // part's keys), so run_device, run_ipc and the GPU group's
                // parts report the same hit rate (issue 32).
                let s = counts.summary;
                self.size.fetch_add(s.inserted, Relaxed);
                self.counters.summary(&s);
                self.counters.lookups(s.updated, (s.updated + s.inserted + s.evicted + s.rejected) as usize);
            }
            DeviceOp::Load => {
                self.size.fetch_add(counts.summary.inserted, Relaxed);
                self.counters.evictions.fetch_add(counts.summary.evicted + counts.summary.rejected, Relaxed);
            }
            _ => {
                self.size.fetch_add(counts.summary.inserted, Relaxed);
                self.counters.summary(&counts.summary);
            }
        }
        self.adapt_done();
        counts
    }
}

/// The device buffers of one batch for [`CudaTable::enqueue`].
#[derive(Default, Clone, Copy)]
pub(crate) struct Raw {
    /// Keys, values, scores, found flags, pointers, lost outputs, counters.
    pub(crate) p: Ptrs,
    /// An export's outputs and scratch.
    pub(crate) export: Option<ExportArgs>,
}

/// An export's outputs (for every match of its slots) and scratch:
/// per-bucket counts and offsets (one more), for the buckets it spans.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExportArgs {
    pub(crate) out: ExportPtrs,
    pub(crate) counts: DevPtr<u32>,
    pub(crate) offsets: DevPtr<u64>,
}

/// A launched batch whose lock group is held until [`CudaTable::complete`].
/// Dropped without it (an error path), it first waits for every stream its
/// parts launched on, so that no kernel still runs on the table's storage
/// once the group is released (a grow could free it).
pub(crate) struct Pending<'a> {
    op: DeviceOp,
    n: usize,
    /// The streams the batch's kernels run on.
    streams: Vec<Arc<CudaStream>>,
    /// Lanes of this table whose buffers the kernels use (a large
    /// find_or_insert's miss flags), back to its pool once the streams are
    /// synchronised; dropped with their buffers on an error path, after
    /// the wait.
    lanes: Vec<Lane>,
    /// Set by [`CudaTable::complete`], whose caller synchronised them.
    synchronized: bool,
    /// Declared last: dropped after [`Pending::drop`] has synchronised.
    _guard: Option<crate::lock::GroupGuard<'a>>,
}

impl Pending<'_> {
    /// Folds a further part of the same batch into this one (its keys are
    /// booked with this one's counters, its stream waited for with this one's).
    pub(crate) fn absorb(&mut self, mut part: Pending<'_>) {
        self.n += part.n;
        for s in std::mem::take(&mut part.streams) {
            if !self.streams.iter().any(|x| Arc::ptr_eq(x, &s)) {
                self.streams.push(s);
            }
        }
        self.lanes.append(&mut part.lanes);
    }

    /// Holds `l` until the batch's streams are synchronised; returns it for use.
    fn hold(&mut self, l: Lane) -> &mut Lane {
        self.lanes.push(l);
        self.lanes.last_mut().expect("just pushed")
    }

    /// Sets the keys the batch is booked with (its parts may have launched
    /// over filtered ranges).
    pub(crate) fn set_keys(&mut self, n: usize) {
        self.n = n;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.synchronized {
            for s in &self.streams {
                // Best effort on an error path: a stream that cannot be
                // waited for has failed, and its kernels with it.
                let _ = s.synchronize();
            }
        }
    }
}
