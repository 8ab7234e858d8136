//! One typed wrapper per kernel launch, each with its safety contract.

use super::*;

pub(super) const BLOCK: u32 = 256;

/// One block of 1024 threads: the launch of the block scans (`export_scan`,
/// `route_scan`, both on `hkv_block_scan`).
pub(crate) fn scan_config() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 }
}

/// Value bytes per region of [`CudaTable::key_order`] (at least; whole
/// buckets), and the most regions it counts.
pub(super) const REGION_BYTES: u64 = 2 << 20;

pub(super) const MAX_REGIONS: u64 = 1 << 16;

pub(super) fn blocks(threads: u64) -> Result<LaunchConfig> {
    crate::cuda::grid(threads, BLOCK)
}

/// The arguments `upsert_keys` and `update_keys` begin with, in their
/// order: table, scoring, keys, n, values, input scores, only, mode,
/// outcomes.
pub(super) fn write_args<'a>(
    b: &mut LaunchArgs<'a>,
    args: &'a TableArgs,
    sc: &'a ScoringArgs,
    n: &'a u64,
    mode: &'a i32,
    p: &'a Addrs,
) {
    b.arg(args).arg(sc).arg(&p.keys).arg(n).arg(&p.values).arg(&p.scores).arg(&p.only).arg(mode).arg(&p.outcomes);
}

/// The kernel arguments of a [`Ptrs`]: each buffer's address, 0 for none.
#[derive(Default)]
pub(super) struct Addrs {
    pub(super) keys: u64,
    pub(super) values: u64,
    pub(super) scores: u64,
    pub(super) found: u64,
    pub(super) outcomes: u64,
    pub(super) ptrs: u64,
    pub(super) only: u64,
    pub(super) at: u64,
    pub(super) lost: [u64; 4],
    pub(super) counters: u64,
}

impl Ptrs {
    /// The addresses for a launch over `n` keys with rows of `dim` floats;
    /// a buffer shorter than the launch needs is refused (with `at`, the
    /// rows' count is the caller's, checked against `at` by it).
    pub(super) fn addrs(&self, n: u64, dim: usize) -> Result<Addrs> {
        let n = usize::try_from(n).map_err(|_| Error::Config(format!("{n} keys in one launch")))?;
        let rows = if self.at.is_some() { 0 } else { n * dim };
        let lost = match self.lost {
            None => [0; 4],
            Some(l) => [
                arg("lost keys", Some(l.keys), n)?,
                arg("lost values", Some(l.values), n * dim)?,
                arg("lost scores", Some(l.scores), n)?,
                arg("lost kinds", Some(l.kinds), n)?,
            ],
        };
        Ok(Addrs {
            keys: arg("keys", self.keys, n)?,
            values: arg("values", self.values, rows)?,
            scores: arg("scores", self.scores, n)?,
            found: arg("flags", self.found, n)?,
            outcomes: arg("outcomes", self.outcomes, n)?,
            ptrs: arg("value addresses", self.ptrs, n)?,
            only: arg("key filter", self.only, n)?,
            at: arg("output rows", self.at, n)?,
            lost,
            counters: arg("counters", self.counters, NCOUNTERS)?,
        })
    }
}

impl CudaTable {
    /// For a launch of `n` keys (device address `keys`) that copies value
    /// rows (`copies`) of a table with a host tier: the keys' indices in
    /// the order of their first bucket's region, about 2 MiB of value rows
    /// (see `order_count` in lookup.cu): the device reaches host rows about
    /// three times faster so grouped (BENCHMARKS.md, "Kernel choice").
    /// None, and index order, otherwise, for batches of up to
    /// [`SEQUENTIAL_BATCH`] keys and for batches too large for u32
    /// indices. Returned with the table arguments that carry it; the
    /// buffer is freed in stream order when dropped.
    ///
    /// # Safety
    /// `keys` holds `n` keys on this device, alive until `l` is synchronised.
    pub(super) unsafe fn key_order(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        n: u64,
        keys: u64,
        copies: bool,
    ) -> Result<(Option<CudaSlice<u32>>, TableArgs)> {
        if !copies || st.host_slots == 0 || !self.f.region_order || n <= SEQUENTIAL_BATCH as u64 || n > u32::MAX as u64
        {
            return Ok((None, st.args));
        }
        let bucket_bytes = S * self.config.dim as u64 * 4;
        let mut shift = 0u32;
        while (bucket_bytes << shift) < REGION_BYTES || (st.nbuckets >> shift) >= MAX_REGIONS {
            shift += 1;
        }
        let regions = (st.nbuckets >> shift) + 1;
        let a = |e| dev_err("allocating the key order")(e);
        let counts = l.alloc_zeros::<u32>(regions as usize).map_err(a)?;
        // SAFETY: export_scan writes every offset below before it is read.
        let next = unsafe { l.alloc::<u64>(regions as usize + 1) }.map_err(a)?;
        // SAFETY: order_write writes order[0..n] before the launch that reads it.
        let order = unsafe { l.alloc::<u32>(n as usize) }.map_err(a)?;
        let (c, x, o) = (ptr(&counts, l), ptr(&next, l), ptr(&order, l));
        let mut b = l.launch_builder(&self.f.order_count);
        b.arg(&st.args).arg(&keys).arg(&n).arg(&shift).arg(&c);
        // SAFETY: reads keys[0..n]; every key's region (b1 >> shift) is
        // below `regions`, the length of counts.
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching order_count"))?;
        let mut b = l.launch_builder(&self.f.ex_scan);
        b.arg(&c).arg(&regions).arg(&x);
        // SAFETY: reads counts[0..regions], writes next[0..=regions].
        unsafe { b.launch(scan_config()) }.map_err(dev_err("launching export_scan"))?;
        let mut b = l.launch_builder(&self.f.order_write);
        b.arg(&st.args).arg(&keys).arg(&n).arg(&shift).arg(&x).arg(&o);
        // SAFETY: as order_count; the offsets of the regions sum to n, so
        // each key gets one distinct entry of order[0..n].
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching order_write"))?;
        Ok((Some(order), TableArgs { order: o, ..st.args }))
    }

    /// Launches `lookup_find` on stream `l`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.values` (n × dim floats), `p.found`,
    /// `p.scores`, `p.ptrs`, `p.only` (n each) are 0 or device buffers that
    /// long; or, with `p.at` (n rows, each below some `rows`), `p.values`
    /// holds `rows` rows, in device memory or in host memory mapped for the
    /// device, `p.found` n flags, and `p.scores`, `p.ptrs` and `p.only` are
    /// 0; `p.counters` holds 8 u64; all stay alive until `l`
    /// is synchronised. `p.sample` is off or this table's
    /// [`CudaTable::sample_args`]: the kernel samples the keys it serves.
    pub(super) unsafe fn k_lookup(&self, l: &Arc<CudaStream>, st: &Storage, n: u64, p: Ptrs) -> Result<()> {
        let at = p.at.is_some();
        let zero = p.zero_misses && !at;
        let smp = p.sample;
        let rs = self.read_scoring(p.find && !at);
        let p = p.addrs(n, self.config.dim)?;
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let v = self.f.lookup(p.values != 0, self.config.dim, order.is_some(), at, zero, rs.refresh != 0);
        let mut b = l.launch_builder(&v.f);
        if at {
            b.arg(&args).arg(&p.keys).arg(&n).arg(&p.at).arg(&p.values).arg(&p.found).arg(&c).arg(&p.only).arg(&smp);
        } else {
            b.arg(&args)
                .arg(&p.keys)
                .arg(&n)
                .arg(&p.values)
                .arg(&p.found)
                .arg(&p.scores)
                .arg(&p.ptrs)
                .arg(&c)
                .arg(&p.only)
                .arg(&smp)
                .arg(&rs);
        }
        // SAFETY: lookup_find (lookup_at) reads keys[0..n], only[0..n]
        // (at[0..n]) where non-null and the table (args describe live
        // buffers of this storage), and writes, where non-null,
        // values[0..n*dim] (with at: rows at[i] < the caller's row count),
        // found[0..n], scores[0..n], ptrs[0..n] and 8 counters; every
        // non-null buffer was sized for that by the caller. With a sampler
        // (smp.ring non-null: sample_args), it writes ring slots below
        // smp.cap (the ring's length) and atomically adds to the ring's 2
        // counters; the ring lives as long as the table. With rs.refresh
        // it rewrites the scores of hit entries of the table and (adaptive)
        // increments sketch counters, inside buffers rs describes.
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err(if at {
            "launching lookup_at"
        } else {
            "launching lookup_find"
        }))?;
        Ok(())
    }

    /// Launches `upsert_keys` on stream `l`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.values` (n × dim floats, or 0 for
    /// find_or_insert*), `p.scores`, `p.only`, `p.outcomes`, `p.ptrs` (n
    /// each) and the four `p.lost` arrays (n entries, n × dim floats) are 0
    /// or device buffers that long; `p.counters` holds 8 u64; all stay alive
    /// until `l` is synchronised. `p.sample` as [`CudaTable::k_lookup`].
    pub(super) unsafe fn k_upsert(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        mode: i32,
        p: Ptrs,
    ) -> Result<()> {
        let lost = p.lost.is_some();
        let smp = p.sample;
        let p = p.addrs(n, self.config.dim)?;
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let plain = mode == UP_INSERT && !lost;
        let adaptive = self.adapt.is_some();
        let verbatim = sc.verbatim != SCORES_POLICY;
        let v = self.f.upsert(
            self.load(st),
            p.values != 0,
            self.config.dim,
            order.is_some(),
            plain,
            lost,
            adaptive,
            verbatim,
        );
        let mut b = l.launch_builder(&v.f);
        write_args(&mut b, &args, &sc, &n, &mode, &p);
        b.arg(&p.ptrs).arg(&p.lost[0]).arg(&p.lost[1]).arg(&p.lost[2]).arg(&p.lost[3]).arg(&c).arg(&smp);
        // SAFETY: upsert_keys reads keys[0..n], values[0..n*dim] (or writes
        // them for find_or_insert), scores[0..n] and only[0..n] where
        // non-null, locks and writes the table described by args, and
        // writes outcomes[0..n], ptrs[0..n], at most n entries to each lost_*
        // array (sized for n keys, n*dim values) and 8 counters; with a
        // sampler, ring slots below smp.cap and the ring's 2 counters (as
        // k_lookup).
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err("launching upsert_keys"))?;
        Ok(())
    }

    /// Launches `update_keys` on stream `l`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.values` (n × dim floats), `p.scores`,
    /// `p.only`, `p.outcomes`, `p.found` (absent flags; n each) are 0 or
    /// device buffers that long; `p.counters` holds 8 u64; all stay alive
    /// until `l` is synchronised. `p.sample` as [`CudaTable::k_lookup`].
    pub(super) unsafe fn k_update(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        mode: i32,
        p: Ptrs,
    ) -> Result<()> {
        let smp = p.sample;
        let p = p.addrs(n, self.config.dim)?;
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let v = self.f.update(self.config.dim, order.is_some());
        let mut b = l.launch_builder(&v.f);
        write_args(&mut b, &args, &sc, &n, &mode, &p);
        b.arg(&p.found).arg(&c).arg(&smp);
        // SAFETY: update_keys reads keys[0..n], values[0..n*dim] and
        // scores[0..n] where non-null, writes present entries of the table
        // under its bucket locks, and writes outcomes[0..n] and absent
        // flags[0..n] where non-null and 8 counters; with a sampler, ring
        // slots below smp.cap and the ring's 2 counters (as k_lookup).
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err("launching update_keys"))?;
        Ok(())
    }

    /// Whether a find_or_insert (or find_or_insert*) of `n` keys takes
    /// more than one locked launch ([`CudaTable::k_find_or_insert`]):
    /// above [`SEQUENTIAL_BATCH`] keys, whose order is unspecified, unless
    /// the tuning keeps one locked launch ([`FindOrInsert::Locked`]).
    /// Adaptive too: a hit only changes its own score (a main-tier entry
    /// becomes protected), by the probe's compare-and-swap; the tier moves
    /// that other entries make happen when a newcomer is placed, in the
    /// locked launch after.
    pub(super) fn probes(&self, n: u64) -> bool {
        n > SEQUENTIAL_BATCH as u64 && self.config.tuning.find_or_insert != FindOrInsert::Locked
    }

    /// Whether a large find_or_insert places each key once
    /// ([`FindOrInsert::Dedupe`]): where a repeat would store nothing its
    /// first occurrence did not (lru and epoch_lru whatever scores come
    /// in, custom without input scores; lfu counts every occurrence and a
    /// custom input score is each occurrence's own).
    fn dedupes(&self, n: u64, scores: bool) -> bool {
        self.config.tuning.find_or_insert == FindOrInsert::Dedupe
            && n < u32::MAX as u64
            && match self.config.policy {
                ScorePolicy::Lru | ScorePolicy::EpochLru => true,
                ScorePolicy::Custom => !scores,
                _ => false,
            }
    }

    /// A find_or_insert (`mode` [`UP_FIND_OR_INSERT`], or
    /// [`UP_FIND_OR_INSERT_PTR`] with `p.ptrs` and no values) of `n` keys
    /// on stream `l`, for every way into the table (host arrays, device
    /// batches, CUDA IPC): one `upsert_keys` launch, or, where
    /// [`CudaTable::probes`] and `scratch` (a lane's reusable bytes, grown
    /// here) is given:
    /// - [`FindOrInsert::Probe`], and `Dedupe` where it does not apply:
    ///   `probe_keys` (the keys present, without locks: repeated keys no
    ///   longer wait on each other's bucket locks), then `upsert_keys` over
    ///   the misses;
    /// - `Dedupe` ([`CudaTable::dedupes`]): on a table with a host tier,
    ///   every key, elsewhere the probe's misses, deduplicated
    ///   (`dedupe_claim`, `dedupe_lead`); `upsert_keys` over each key's
    ///   first occurrence; its repeats take its answer (`dedupe_fill`). A
    ///   host tier's hits are read in the launch that writes its misses
    ///   (the probe's own launch cost it 30 %: `shard/BENCHMARKS.md`,
    ///   "Repeated keys placed once").
    ///
    /// # Safety
    /// As [`CudaTable::k_upsert`] for find_or_insert (no lost outputs);
    /// `scratch` is not in use on another stream, and stays alive and
    /// untouched until `l` is synchronised.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k_find_or_insert(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        mode: i32,
        p: Ptrs,
        scratch: Option<&mut Option<CudaSlice<u8>>>,
    ) -> Result<()> {
        debug_assert!(matches!(mode, UP_FIND_OR_INSERT | UP_FIND_OR_INSERT_PTR) && p.lost.is_none());
        let Some(buf) = scratch.filter(|_| self.probes(n)) else {
            // SAFETY: the caller's contract.
            return unsafe { self.k_upsert(l, st, sc, n, mode, p) };
        };
        if !self.dedupes(n, p.scores.is_some()) {
            let m = CudaTable::scratch(l, buf, n as usize)?;
            // SAFETY: the caller's contract; `m` holds n bytes, which
            // probe_keys writes for every key, before upsert_keys reads them.
            return unsafe {
                self.k_probe(l, st, sc, n, p, m, None)?;
                self.k_upsert(l, st, sc, n, mode, Ptrs { only: Some(m), ..p })
            };
        }
        let s = Dedupe::new(l, buf, n as usize)?;
        // SAFETY: the caller's contract; the scratch's parts hold n flags,
        // n outcomes, n leads and the set, which each launch writes before
        // the next reads them, on stream l.
        unsafe {
            if st.host_slots == 0 {
                self.k_probe(l, st, sc, n, p, s.first, Some(&s))?;
            } else {
                self.k_dedupe_claim(l, n, p.keys, p.only, &s)?;
            }
            self.k_dedupe_lead(l, n, &s)?;
            let outcomes = p.outcomes.unwrap_or(s.outcomes);
            self.k_upsert(l, st, sc, n, mode, Ptrs { only: Some(s.first), outcomes: Some(outcomes), ..p })?;
            self.k_dedupe_fill(l, n, Ptrs { outcomes: Some(outcomes), ..p }, &s)
        }
    }

    /// Before `step_keys` of an apply_gradients that sums repeated keys
    /// (`Step::sum`): the keys `only` flags (all when `None`) deduplicated
    /// (`dedupe_claim`, `dedupe_lead`; the scratch in `dedupe`), and each
    /// key's gradient made at its first occurrence (`sum_count`,
    /// `sum_add`, `sum_out`; in `sums`): its own for a key that occurs
    /// once, else the fixed-point sum of its occurrences'
    /// (`optim::sum_duplicates`, bit for bit). Returns the first
    /// occurrences' flags (the step's only flags) and those gradients.
    ///
    /// # Safety
    /// `keys` holds `n` keys, `only` is `None` or `n` flags, `grads` holds
    /// `n × dim` floats, all alive until `l` is synchronised; `dedupe` and
    /// `sums` are buffers that nothing else uses until then.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k_sum(
        &self,
        l: &Arc<CudaStream>,
        n: u64,
        dim: usize,
        keys: Option<DevPtr<u64>>,
        only: Option<DevPtr<u8>>,
        grads: Option<DevPtr<f32>>,
        dedupe: &mut Option<CudaSlice<u8>>,
        sums: &mut Option<CudaSlice<u8>>,
    ) -> Result<(DevPtr<u8>, DevPtr<f32>)> {
        let (nu, nd) = (n as usize, n as usize * dim);
        let g = arg("gradients", grads, nd)?;
        let s = Dedupe::new(l, dedupe, nu)?;
        // SAFETY: the caller's contract; `s` was carved for n keys.
        unsafe {
            self.k_dedupe_claim(l, n, keys, only, &s)?;
            self.k_dedupe_lead(l, n, &s)?;
        }
        // The sums' parts: acc (n × dim i64), cnt and max (n u32 each),
        // zeroed, then the gradients out (n × dim f32).
        let (cnt_at, max_at, out_at) = (8 * nd, 8 * nd + 4 * nu, 8 * nd + 8 * nu);
        ensure(l, sums, out_at + 4 * nd)?;
        let b = sums.as_mut().expect("ensured");
        l.memset_zeros(&mut b.slice_mut(0..out_at)).map_err(dev_err("clearing the sums"))?;
        let all = DevPtr::of(b, l);
        let (acc, cnt, max, out) =
            (all.addr(), all.skip(cnt_at).addr(), all.skip(max_at).addr(), all.skip(out_at).addr());
        let (_, _, lead, first, repeats) = s.args();
        let d = dim as u64;
        let mut b = l.launch_builder(&self.f.sum_count);
        b.arg(&g).arg(&d).arg(&n).arg(&first).arg(&lead).arg(&repeats).arg(&cnt).arg(&max);
        // SAFETY: reads grads[0..n*dim], first, lead (n each) and the
        // repeats word; adds into cnt and max below the first occurrences' indices (< n).
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching sum_count"))?;
        let mut b = l.launch_builder(&self.f.sum_add);
        b.arg(&g).arg(&d).arg(&n).arg(&first).arg(&lead).arg(&repeats).arg(&cnt).arg(&max).arg(&acc);
        // SAFETY: as sum_count, and adds into acc[0..n*dim].
        unsafe { b.launch(blocks(n * d)?) }.map_err(dev_err("launching sum_add"))?;
        let mut b = l.launch_builder(&self.f.sum_out);
        b.arg(&g).arg(&d).arg(&n).arg(&first).arg(&cnt).arg(&max).arg(&acc).arg(&out);
        // SAFETY: reads what the two above wrote; writes out[0..n*dim].
        unsafe { b.launch(blocks(n * d)?) }.map_err(dev_err("launching sum_out"))?;
        Ok((s.first, DevPtr::from_raw(out, nd)))
    }

    /// Launches `dedupe_claim` on stream `l` over the keys `only` flags
    /// (all when `None`): `s.first` flags the first to claim each key,
    /// `s.lead` holds each key's slot in the set, `s.repeats` whether any
    /// key repeats.
    ///
    /// # Safety
    /// `keys` holds `n` keys and `only` is `None` or `n` flags, alive until
    /// `l` is synchronised; `s` as [`Dedupe::new`] made it for `n` keys.
    unsafe fn k_dedupe_claim(
        &self,
        l: &Arc<CudaStream>,
        n: u64,
        keys: Option<DevPtr<u64>>,
        only: Option<DevPtr<u8>>,
        s: &Dedupe,
    ) -> Result<()> {
        let keys = arg("keys", keys, n as usize)?;
        let only = arg("only flags", only, n as usize)?;
        let (slots, mask, lead, first, repeats) = s.args();
        let mut b = l.launch_builder(&self.f.dedupe_claim);
        b.arg(&keys).arg(&n).arg(&only).arg(&slots).arg(&mask).arg(&lead).arg(&first).arg(&repeats);
        // SAFETY: reads keys[0..n] and only[0..n] where non-null, claims
        // entries of slots[0..=mask] (zeroed, more than n: a free one is
        // always found), writes lead[0..n], first[0..n] and the repeats word.
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching dedupe_claim"))?;
        Ok(())
    }

    /// Launches `dedupe_lead` on stream `l`, after the claims: where a key
    /// repeats, `s.first` flags each key's first occurrence and `s.lead`
    /// gives each repeat its first occurrence.
    ///
    /// # Safety
    /// `s` as the claims (`k_dedupe_claim` or `k_probe`) left it for `n` keys.
    unsafe fn k_dedupe_lead(&self, l: &Arc<CudaStream>, n: u64, s: &Dedupe) -> Result<()> {
        let (slots, _, lead, first, repeats) = s.args();
        let mut b = l.launch_builder(&self.f.dedupe_lead);
        b.arg(&n).arg(&slots).arg(&lead).arg(&first).arg(&repeats);
        // SAFETY: reads the repeats word, lead[0..n] (slots below mask + 1,
        // or HKV_NO_LEAD) and those slots, rewrites lead[0..n] and first[0..n].
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching dedupe_lead"))?;
        Ok(())
    }

    /// Launches `dedupe_fill` on stream `l`: where a key repeats, each repeat
    /// takes its first occurrence's row (`p.values`), address (`p.ptrs`)
    /// and outcome (`p.outcomes`, required), counted into `p.counters` and
    /// sampled as the upsert samples.
    ///
    /// # Safety
    /// As [`CudaTable::k_upsert`] for find_or_insert, with `p.outcomes`
    /// holding `n` outcomes; `s` as `k_dedupe_lead` left it.
    unsafe fn k_dedupe_fill(&self, l: &Arc<CudaStream>, n: u64, p: Ptrs, s: &Dedupe) -> Result<()> {
        let smp = p.sample;
        let p = p.addrs(n, self.config.dim)?;
        let (_, _, lead, _, repeats) = s.args();
        let dim = self.config.dim as u64;
        let mut b = l.launch_builder(&self.f.dedupe_fill);
        b.arg(&p.keys).arg(&n).arg(&lead).arg(&p.values).arg(&dim).arg(&p.outcomes).arg(&p.ptrs);
        b.arg(&p.counters).arg(&smp).arg(&repeats);
        // SAFETY: reads keys[0..n], lead[0..n] and the outcomes, rows
        // (values[0..n*dim]) and addresses (ptrs[0..n]) of first
        // occurrences, writes those of the repeats, 8 counters and, with a
        // sampler, ring slots below smp.cap and its 2 counters (as k_lookup).
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching dedupe_fill"))?;
        Ok(())
    }

    /// Launches `probe_keys` on stream `l`: the first launch of a large
    /// find_or_insert (find_or_insert* without values), which serves the
    /// keys present without locks and writes into `miss` 1 for the others
    /// and 0 for each key it serves or `p.only` leaves out; with `dedupe`,
    /// it claims the others in its set (`dedupe_claim`'s rule: `miss`, its
    /// first-occurrence flags, then says which claimed their key first).
    ///
    /// # Safety
    /// As [`CudaTable::k_upsert`] for find_or_insert (no lost outputs);
    /// `miss` holds `n` bytes, alive until `l` is synchronised; `dedupe`
    /// as [`Dedupe::new`] made it for `n` keys.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k_probe(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        p: Ptrs,
        miss: DevPtr<u8>,
        dedupe: Option<&Dedupe>,
    ) -> Result<()> {
        let smp = p.sample;
        let p = p.addrs(n, self.config.dim)?;
        let miss = arg("miss flags", Some(miss), n as usize)?;
        let (slots, mask, lead, _, repeats) = dedupe.map_or((0, 0, 0, 0, 0), Dedupe::args);
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let v = self.f.probe(p.values != 0, self.config.dim, order.is_some());
        let mut b = l.launch_builder(&v.f);
        b.arg(&args).arg(&sc).arg(&p.keys).arg(&n).arg(&p.values).arg(&p.scores).arg(&p.only).arg(&p.outcomes);
        b.arg(&p.ptrs).arg(&miss).arg(&slots).arg(&mask).arg(&lead).arg(&repeats).arg(&c).arg(&smp);
        // SAFETY: probe_keys reads keys[0..n], scores[0..n] and only[0..n]
        // where non-null and the table (no writer runs on it meanwhile: the
        // caller holds the inserter group and launches on one stream), and
        // writes present keys' scores, values[0..n*dim], outcomes[0..n],
        // ptrs[0..n] where non-null, miss[0..n] and 8 counters; with a set
        // (slots non-null) claims its entries and writes lead[0..n] and the
        // repeats word as dedupe_claim; with a sampler, ring slots below
        // smp.cap and its 2 counters (as k_lookup).
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err("launching probe_keys"))?;
        Ok(())
    }

    /// Launches `step_keys` on stream `l`: one optimizer step on the rows
    /// of the present keys of `p.keys`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.values` holds the n × `step.dim`
    /// gradients; `p.only`, `p.found` (n each) and `p.updated` (n ×
    /// `step.dim` floats) are 0 or device buffers that long; `p.counters`
    /// holds 8 u64; all stay alive until `l` is synchronised. The table's
    /// rows hold `step.row_dim()` floats (the caller checked). `p.sample` as
    /// [`CudaTable::k_lookup`].
    pub(super) unsafe fn k_step(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        step: &crate::optim::Step,
        p: Ptrs,
    ) -> Result<()> {
        let smp = p.sample;
        let updated = p.updated;
        let p = p.addrs(n, step.dim)?;
        let out = arg("updated values", updated, n as usize * step.dim)?;
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, true)?;
        let v = self.f.step(step.dim, order.is_some());
        let sa = step_args(step);
        let mut b = l.launch_builder(&v.f);
        b.arg(&args).arg(&sc).arg(&sa).arg(&p.keys).arg(&n).arg(&p.values).arg(&p.only).arg(&p.found).arg(&out);
        b.arg(&c).arg(&smp);
        // SAFETY: step_keys reads keys[0..n], grads[0..n*dim] and
        // only[0..n] where non-null, steps present rows of the table (of
        // row_dim floats) under their bucket locks, and writes found[0..n]
        // and updated[0..n*dim] where non-null and 8 counters; with a
        // sampler, ring slots below smp.cap and its 2 counters (as k_lookup).
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err("launching step_keys"))?;
        Ok(())
    }

    /// Launches `erase_keys` on stream `l`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.only` and `p.found` (erased flags) are 0
    /// or `n` bytes; `p.counters` holds 8 u64; all stay alive until `l` is
    /// synchronised.
    pub(super) unsafe fn k_erase(&self, l: &CudaStream, st: &Storage, n: u64, p: Ptrs) -> Result<()> {
        let p = p.addrs(n, self.config.dim)?;
        let c = p.counters;
        let mut b = l.launch_builder(&self.f.erase);
        b.arg(&st.args).arg(&p.keys).arg(&n).arg(&p.only).arg(&p.found).arg(&c);
        // SAFETY: erase_keys reads keys[0..n], writes table entries under
        // their bucket locks, erased[0..n] where non-null, and 8 counters.
        unsafe { b.launch(blocks(n * 16)?) }.map_err(dev_err("launching erase_keys"))?;
        Ok(())
    }

    /// Export of positions [offset, end): counts, scan, write (all on stream
    /// `l`); counts and offsets too short for the buckets of the range are
    /// refused.
    ///
    /// # Safety
    /// `out` is `None` (count only) or keys, values (× dim) and scores
    /// buffers long enough for every match of the range; all stay alive
    /// until `l` is synchronised.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k_export(
        &self,
        l: &CudaStream,
        st: &Storage,
        offset: u64,
        end: u64,
        f: FilterArgs,
        counts: DevPtr<u32>,
        offsets: DevPtr<u64>,
        out: Option<ExportPtrs>,
    ) -> Result<()> {
        let nb = (end - 1) / S - offset / S + 1;
        let spans = usize::try_from(nb).map_err(|_| Error::Config(format!("an export over {nb} buckets")))?;
        let (counts, offsets) = (arg("counts", Some(counts), spans)?, arg("offsets", Some(offsets), spans + 1)?);
        let mut b = l.launch_builder(&self.f.ex_count);
        b.arg(&st.args).arg(&offset).arg(&end).arg(&f).arg(&counts);
        // SAFETY: export_count reads table positions in [offset, end) and
        // writes counts[0..nb], nb = the buckets the range spans.
        unsafe { b.launch(blocks(nb * 32)?) }.map_err(dev_err("launching export_count"))?;
        let mut b = l.launch_builder(&self.f.ex_scan);
        b.arg(&counts).arg(&nb).arg(&offsets);
        // SAFETY: export_scan reads counts[0..nb] and writes offsets[0..=nb].
        unsafe { b.launch(scan_config()) }.map_err(dev_err("launching export_scan"))?;
        if let Some(o) = out {
            let out = [o.keys.addr(), o.values.addr(), o.scores.addr()];
            let mut b = l.launch_builder(&self.f.ex_write);
            b.arg(&st.args).arg(&offset).arg(&end).arg(&f).arg(&offsets).arg(&out[0]).arg(&out[1]).arg(&out[2]);
            // SAFETY: export_write writes offsets[nb] entries in total to
            // keys_out, values_out (dim each) and scores_out, which the
            // caller sized for at least that many (or for every slot of the
            // range).
            unsafe { b.launch(blocks(nb * 32)?) }.map_err(dev_err("launching export_write"))?;
        }
        Ok(())
    }
}

/// The parts of a deduplicating find_or_insert's scratch, carved from a
/// lane's bytes: the first occurrences' flags (upsert_keys' only),
/// outcomes (for a caller that takes none), each key's lead, the set of
/// keys (`dedupe_claim`: a power of two of u32, at least 1.5 × n) and the
/// word that says whether a key repeats, the last two zeroed. About 20
/// bytes a key (the lane's buffer grows to a power of two: up to 40).
pub(super) struct Dedupe {
    first: DevPtr<u8>,
    outcomes: DevPtr<u8>,
    lead: DevPtr<u32>,
    slots: DevPtr<u32>,
    repeats: DevPtr<u32>,
}

impl Dedupe {
    /// Carves `buf` (grown as needed) for `n` keys, the set and the
    /// repeats word zeroed on `l`.
    fn new(l: &Arc<CudaStream>, buf: &mut Option<CudaSlice<u8>>, n: usize) -> Result<Dedupe> {
        let slots = (n + n / 2).next_power_of_two();
        let lead_at = (2 * n).next_multiple_of(4);
        let slots_at = lead_at + 4 * n;
        let len = slots_at + 4 * (slots + 1);
        ensure(l, buf, len)?;
        let b = buf.as_mut().expect("ensured");
        l.memset_zeros(&mut b.slice_mut(slots_at..len)).map_err(dev_err("clearing the key set"))?;
        let all = DevPtr::of(b, l);
        let words = |at: usize, len: usize| DevPtr::<u32>::from_raw(all.skip(at).addr(), len);
        Ok(Dedupe {
            first: all.take(n),
            outcomes: all.skip(n).take(n),
            lead: words(lead_at, n),
            slots: words(slots_at, slots),
            repeats: words(slots_at + 4 * slots, 1),
        })
    }

    /// The kernels' arguments: the set's address and mask, the leads, the
    /// first-occurrence flags and the repeats word.
    fn args(&self) -> (u64, u64, u64, u64, u64) {
        (self.slots.addr(), self.slots.len() as u64 - 1, self.lead.addr(), self.first.addr(), self.repeats.addr())
    }
}
