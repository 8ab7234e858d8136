//! The Adaptive policy's state for the CUDA backend (issue 36): the
//! frequency sketch on the device, sized for the table's largest size as
//! the CPU backend's (`crate::cpu::adapt`, whose rules the kernels follow:
//! `kernels/table.cuh`, "adaptive policy"), so that growth leaves it where
//! it is; on the host, the counted accesses and the halving of the sketch,
//! and the window share's miniatures (`crate::cpu::adapt::Window`, the CPU
//! backend's own type). The kernels take the share as a launch argument.
//!
//! A host batch feeds the miniatures from its host keys after it ran. A
//! device batch samples its accesses on the device (`adapt_sample`, the
//! miniatures' hash filter: about n / 16 384 keys of a 32 Mi-slot table)
//! and queues the copy of the sample to pinned memory behind its kernels
//! without waiting for them ([`Samples`]); the queue is settled (the
//! samples fed in the order their batches were queued) before any batch
//! that places keys reads the share, waiting for what is not done, and
//! without waiting once a batch's kernels are queued (feeding the
//! miniatures took 40-145 µs a batch on the H200's host: before the
//! kernels, the device waited for it; a refreshing find of 1 Mi keys ran
//! at 2.9 instead of 4.4 G keys/s). An inserter batch
//! runs alone, so every batch before it has finished and fed its sample:
//! the share it gets is the one the CPU backend computes after the same
//! batches.

use std::collections::VecDeque;

use super::*;
use crate::cpu::adapt::{sketch_lines, Window, ADMIT_MARGIN, PERIOD_PER_SLOT, PROTECTED_TENTHS};
use crate::cpu::minisim::sample_rate;
use cudarc::driver::{CudaEvent, PinnedHostSlice};

/// The Adaptive policy's buffers, the raw address the kernels take, and
/// the window share.
pub(super) struct DeviceAdapt {
    /// The sketch's `lines` lines of 64 counters, then the window bits: 4
    /// words a bucket of the table's largest size (`hkv_window_bits` in
    /// `kernels/table.cuh`).
    buf: CudaSlice<u8>,
    sketch: u64,
    lines: u64,
    /// Accesses counted in the sketch since it was last halved.
    counted: AtomicU64,
    /// The folds of the writer batch running (`ScoringArgs::folds`): a
    /// count, then room for a (key, hits) pair per key of the batch; and
    /// that room (0: no batch's folds pending).
    folds: Mutex<Option<CudaSlice<u64>>>,
    folds_addr: AtomicU64,
    fold_room: AtomicU64,
    /// The window share and its miniatures.
    pub(super) window: Window,
    /// Device batches' samples on their way to the miniatures.
    samples: Mutex<Samples>,
}

/// A device batch's sampled accesses: the count and (index, key) pairs the
/// kernel writes on the device, the part copied back with the count into
/// pinned memory, and the event after that copy.
struct SampleBuf {
    /// The count, then room for `pairs` pairs; and its address.
    _dev: CudaSlice<u64>,
    dev_addr: u64,
    pairs: usize,
    _host: PinnedHostSlice<u64>,
    /// Its address (the copy's destination).
    host_addr: u64,
    /// Pairs the host buffer holds after the count.
    host_pairs: usize,
    done: CudaEvent,
}

/// A sample queued behind its batch: its buffer, the pairs copied with the
/// count, and the table size the batch ran at.
struct Queued {
    buf: SampleBuf,
    copied: usize,
    slots: u64,
}

/// The queue of samples, in the order their batches were queued, and the
/// buffers free for the next.
#[derive(Default)]
struct Samples {
    queue: VecDeque<Queued>,
    free: Vec<SampleBuf>,
}

/// Device batches' samples in flight at most before a batch waits for
/// the oldest (`adapt_sample_device`).
const MAX_QUEUED: usize = 4;

/// Pairs copied back with a sample's count: the expected sample and room
/// for its spread (more are fetched in a second, waited copy).
fn expected_pairs(n: usize, rate: u64) -> usize {
    (n.div_ceil(rate as usize) * 2 + 256).min(n)
}

const _: () = {
    assert!(PROTECTED_TENTHS as u64 == hkv_kernels::abi::HKV_ADAPT_PROTECTED_TENTHS as u64);
    assert!(ADMIT_MARGIN as u64 == hkv_kernels::abi::HKV_ADAPT_ADMIT_MARGIN as u64);
};

impl DeviceAdapt {
    /// A zeroed sketch for a table of at most `max_buckets` buckets, and
    /// the window share of a table now of `slots` slots.
    pub(super) fn new(stream: &Arc<CudaStream>, max_buckets: u64, slots: u64) -> Result<DeviceAdapt> {
        let lines = sketch_lines(max_buckets * S);
        let al = |what: &'static str| dev_err(what);
        let bytes = lines * 64 + max_buckets * 16;
        let buf = stream.alloc_zeros::<u8>(bytes as usize).map_err(al("allocating the sketch"))?;
        stream.synchronize().map_err(al("initialising the adaptive policy's state"))?;
        Ok(DeviceAdapt {
            sketch: ptr(&buf, stream),
            buf,
            lines,
            counted: AtomicU64::new(0),
            folds: Mutex::new(None),
            folds_addr: AtomicU64::new(0),
            fold_room: AtomicU64::new(0),
            window: Window::new(slots),
            samples: Mutex::new(Samples::default()),
        })
    }

    /// `sc` with this state's address and the window share. Only a batch
    /// that places keys reads the share, and it settles the samples of
    /// every batch before it first (`k_adapt_count`); the others settle
    /// after their kernels were queued (`adapt_sample_device`), so that
    /// the device does not wait for the miniatures.
    pub(super) fn args(&self, sc: ScoringArgs) -> ScoringArgs {
        let folds = if self.fold_room.load(Relaxed) > 0 { self.folds_addr.load(Relaxed) } else { 0 };
        ScoringArgs { sketch: self.sketch, sketch_lines: self.lines, window: self.window.bucket_slots(), folds, ..sc }
    }

    /// Feeds the queued samples to the miniatures in queue order: every
    /// one (`wait`: waiting for its batch), or those whose batches are done.
    fn settle(&self, wait: bool) -> Result<()> {
        let mut q = self.samples.lock();
        while let Some(front) = q.queue.front() {
            if !wait && !front.buf.done.is_complete() {
                break;
            }
            let Queued { buf, copied, slots } = q.queue.pop_front().expect("the front");
            let fed = Self::feed(&self.window, &buf, copied, slots);
            q.free.push(buf);
            fed?;
        }
        Ok(())
    }

    /// One sample's keys, in index order, to the miniatures.
    fn feed(window: &Window, buf: &SampleBuf, copied: usize, slots: u64) -> Result<()> {
        buf.done.synchronize().map_err(dev_err("waiting for a batch's sampled accesses"))?;
        // SAFETY: the copy into `host` is done (its event above); nothing
        // writes it until the buffer is queued again.
        let host = unsafe { std::slice::from_raw_parts(buf.host_addr as *const u64, 1 + 2 * buf.host_pairs) };
        let count = host[0] as usize;
        if count > buf.pairs {
            return Err(Error::Config(format!("{count} sampled accesses for room of {}", buf.pairs)));
        }
        let mut pairs: Vec<(u64, u64)> =
            host[1..1 + 2 * count.min(copied)].chunks_exact(2).map(|p| (p[0], p[1])).collect();
        if count > copied {
            let mut rest = vec![0u64; 2 * (count - copied)];
            let src = buf.dev_addr + (1 + 2 * copied as u64) * 8;
            // SAFETY: `src` holds the pairs past those copied, written by
            // the kernel that the event above followed; `rest` has room for
            // them; the copy is done when the call returns.
            unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(rest.as_mut_ptr().cast(), src, rest.len() * 8) }
                .result()
                .map_err(dev_err("copying a batch's sampled accesses to the host"))?;
            pairs.extend(rest.chunks_exact(2).map(|p| (p[0], p[1])));
        }
        pairs.sort_unstable_by_key(|p| p.0);
        window.observe_sampled(slots, pairs.into_iter().map(|p| p.1).collect());
        Ok(())
    }
}

impl CudaTable {
    /// Adaptive, a writer batch with policy scores: counts its `n` keys
    /// (those `only` lets through, when given) in the sketch before its
    /// rounds run (`adapt_count`), as the CPU backend counts a batch's
    /// keys before placing any. `counted`: how many that is (for the
    /// halving period). No-op for other policies.
    ///
    /// # Safety
    /// `keys` holds `n` keys and `only`, when given, `n` flags, alive until
    /// `l` is synchronised.
    pub(super) unsafe fn k_adapt_count(
        &self,
        l: &Arc<CudaStream>,
        keys: DevPtr<u64>,
        n: u64,
        only: Option<DevPtr<u8>>,
        counted: u64,
    ) -> Result<()> {
        let Some(a) = &self.adapt else { return Ok(()) };
        // The share this batch reads (its scoring, after this) follows
        // every device batch before it.
        a.settle(true)?;
        if n == 0 {
            return Ok(());
        }
        // Room for the batch's folds (an entry evicted per key at most),
        // their count cleared on the batch's stream.
        {
            let mut f = a.folds.lock();
            crate::cuda::ensure(l, &mut f, 1 + 2 * n as usize)?;
            let at = ptr(f.as_ref().expect("ensured"), l);
            // SAFETY: the buffer holds at least its count word.
            unsafe { cudarc::driver::sys::cuMemsetD8Async(at, 0, 8, l.cu_stream()) }
                .result()
                .map_err(dev_err("clearing a batch's folds"))?;
            a.folds_addr.store(at, Relaxed);
            a.fold_room.store(n, Relaxed);
        }
        let sc = self.scoring(false);
        let k = arg("keys", Some(keys), n as usize)?;
        let o = arg("key filter", only, n as usize)?;
        let mut b = l.launch_builder(&self.f.adapt_count);
        b.arg(&sc).arg(&k).arg(&n).arg(&o);
        // SAFETY: adapt_count reads keys[0..n] and only[0..n] (where
        // non-null), both that long (checked by `arg`), and increments
        // counters of the sketch, whose lines sc.sketch_lines describes.
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching adapt_count"))?;
        a.counted.fetch_add(counted, Relaxed);
        Ok(())
    }

    /// Adaptive, after a batch of a table of `st`'s size: its accesses
    /// (the keys the sketch counted, in index order) to the window share's
    /// miniatures. No-op for other policies.
    /// `key(i)`: key `i` of the batch's `n` if it counts.
    pub(super) fn adapt_observe(&self, st: &Storage, n: usize, key: impl Fn(usize) -> Option<u64> + Sync) {
        if let Some(a) = &self.adapt {
            a.window.observe(st.nbuckets * S, n, key);
        }
    }

    /// Adaptive, a device batch (its keys in device memory), queued on
    /// stream `l` after its kernels: samples the accesses the sketch counted
    /// (its `n` keys that `only` and, for a find, `found` let through) on
    /// the device and queues their copy to the host, for the miniatures
    /// (module docs: fed when the queue is settled). No-op for other
    /// policies.
    ///
    /// # Safety
    /// `keys` holds `n` keys, `only` and `found`, when given, `n` flags of
    /// device memory of this table's context, alive until `l` has run the
    /// work queued here.
    pub(super) unsafe fn adapt_sample_device(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        keys: DevPtr<u64>,
        n: usize,
        only: Option<DevPtr<u8>>,
        found: Option<DevPtr<u8>>,
    ) -> Result<()> {
        let Some(a) = &self.adapt else { return Ok(()) };
        if n == 0 {
            return Ok(());
        }
        let slots = st.nbuckets * S;
        let rate = sample_rate(slots);
        let want = expected_pairs(n, rate);
        // The samples of finished batches to the miniatures, while this
        // batch's kernels run (a failed copy leaves the share where it
        // was; the batch that places keys next settles with a wait and
        // reports it); with MAX_QUEUED samples in flight and none of their
        // buffers free, the oldest are waited for instead of a new buffer
        // allocated (pinned memory: its allocation stalls the device).
        let _ = a.settle(false);
        let fits = |b: &SampleBuf| b.pairs >= n && b.host_pairs >= want;
        let mut q = a.samples.lock();
        if !q.free.iter().any(fits) && q.queue.len() >= MAX_QUEUED {
            drop(q);
            a.settle(true)?;
            q = a.samples.lock();
        }
        let at = q.free.iter().position(fits);
        let buf = match at {
            Some(i) => q.free.swap_remove(i),
            None => {
                // Free buffers too small for this batch would only pile up
                // as batches grow: they go (none is in use).
                q.free.clear();
                let al = |what: &'static str| dev_err(what);
                let dev = l.alloc_zeros::<u64>(1 + 2 * n).map_err(al("allocating a sample buffer"))?;
                let host_pairs = want.max(4096).min(n.max(1));
                // SAFETY: read only after a copy into it finished (`feed`).
                let mut host = unsafe { l.context().alloc_pinned::<u64>(1 + 2 * host_pairs) }
                    .map_err(al("allocating a pinned sample buffer"))?;
                let host_addr = host.as_mut_ptr().map_err(al("allocating a pinned sample buffer"))? as u64;
                let done = l.context().new_event(None).map_err(al("creating an event"))?;
                SampleBuf { dev_addr: ptr(&dev, l), _dev: dev, pairs: n, _host: host, host_addr, host_pairs, done }
            }
        };
        let out = buf.dev_addr;
        let k = arg("keys", Some(keys), n)?;
        let o = arg("key filter", only, n)?;
        let f = arg("found flags", found, n)?;
        let n64 = n as u64;
        let copied = want.min(buf.host_pairs);
        let queued = (|| -> Result<()> {
            // SAFETY: `out` is the buffer's first word, its count.
            unsafe { cudarc::driver::sys::cuMemsetD8Async(out, 0, 8, l.cu_stream()) }
                .result()
                .map_err(dev_err("clearing a sample's count"))?;
            let mut b = l.launch_builder(&self.f.adapt_sample);
            b.arg(&k).arg(&n64).arg(&o).arg(&f).arg(&rate).arg(&out);
            // SAFETY: adapt_sample reads keys[0..n], only[0..n] and
            // found[0..n] where non-null (lengths checked by `arg`) and
            // writes the count and at most n pairs: the buffer holds
            // 1 + 2 × pairs words, pairs >= n.
            unsafe { b.launch(blocks(n64)?) }.map_err(dev_err("launching adapt_sample"))?;
            // SAFETY: the host buffer holds 1 + 2 × host_pairs words, at
            // least the 1 + 2 × copied copied; read after `done`.
            unsafe {
                cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                    buf.host_addr as *mut std::ffi::c_void,
                    out,
                    (1 + 2 * copied) * 8,
                    l.cu_stream(),
                )
            }
            .result()
            .map_err(dev_err("copying a batch's sampled accesses to the host"))?;
            buf.done.record(l).map_err(dev_err("recording an event"))
        })();
        match queued {
            Ok(()) => {
                q.queue.push_back(Queued { buf, copied, slots });
                Ok(())
            }
            Err(e) => {
                // Not queued: the buffer may still be written by the stream.
                drop(buf);
                Err(e)
            }
        }
    }

    /// Adaptive, after a batch's stream was synchronised: the samples of
    /// finished batches (its own among them) to the miniatures now, so
    /// that the next batch that places keys does not wait for them before
    /// its kernels (feeding took 40-145 µs a batch on the H200's host).
    /// No-op for other policies.
    pub(super) fn adapt_done(&self) {
        if let Some(a) = &self.adapt {
            // A failed copy leaves the share where it was; the batch that
            // places keys next settles with a wait and reports it.
            let _ = a.settle(false);
        }
    }

    /// Adaptive: `hits` accesses a refreshing find's kernel counted in
    /// its entries' scores (towards the halving period).
    pub(super) fn adapt_counted(&self, hits: u64) {
        if let Some(a) = &self.adapt {
            a.counted.fetch_add(hits, Relaxed);
        }
    }

    /// Adaptive, at a writer batch's end (its group still held): halves
    /// every sketch counter, and the find hits every entry's score counted,
    /// once the accesses counted reach 10 × the table's slots
    /// (`adapt_halve`; the CPU backend's `Adapt::age`).
    pub(super) fn k_adapt_age(&self, l: &CudaStream, st: &Storage) -> Result<()> {
        let Some(a) = &self.adapt else { return Ok(()) };
        if a.fold_room.load(Relaxed) > 0 {
            // The find hits of the entries the batch evicted, into the
            // sketch (`adapt_fold`; the CPU backend's `Adapt::fold`).
            let sc = self.scoring(false);
            let room = a.fold_room.swap(0, Relaxed);
            let mut b = l.launch_builder(&self.f.adapt_fold);
            b.arg(&sc).arg(&room);
            // SAFETY: adapt_fold reads the count and the pairs below it and
            // below `room` of sc.folds, which holds 1 + 2 × room words
            // (k_adapt_count), and updates the words of the sketch.
            unsafe { b.launch(blocks(room)?) }.map_err(dev_err("launching adapt_fold"))?;
        }
        if a.counted.load(Relaxed) < st.nbuckets * S * PERIOD_PER_SLOT {
            return Ok(());
        }
        a.counted.store(0, Relaxed);
        let sc = self.scoring(false);
        let mut b = l.launch_builder(&self.f.adapt_halve);
        b.arg(&sc).arg(&st.args);
        // SAFETY: adapt_halve rewrites the sketch's lines * 16 words, the
        // buffer's whole length, and the scores of the table's occupied
        // slots (its writer group held: no kernel reads or writes them).
        unsafe { b.launch(blocks((a.lines * 16).max(st.nbuckets * S))?) }.map_err(dev_err("launching adapt_halve"))?;
        Ok(())
    }
}

impl CudaTable {
    /// Adaptive: checks that every window entry of the table (an occupied
    /// slot whose score has [`crate::score::ADAPTIVE_MAIN`] clear) has its
    /// window bit, which the writer kernels keep so that a fill reads the
    /// window's scores only. The bits may name more slots (emptied ones,
    /// checked and cleared by the next fill of their bucket). The first
    /// bucket missing a bit is the error; nothing to check on another
    /// policy. For tests; waits for the table's work.
    #[doc(hidden)]
    pub fn check_window_bits(&self) -> Result<()> {
        let Some(a) = &self.adapt else { return Ok(()) };
        let st = self.storage.read();
        self.with_lane(|l| {
            let s = &l.stream;
            self.dev.ctx.synchronize().map_err(dev_err("waiting for the table"))?;
            let digests = s.clone_dtoh(&st.digests).map_err(dev_err("copying digests"))?;
            let scores = s.clone_dtoh(&st.scores).map_err(dev_err("copying scores"))?;
            let buf = s.clone_dtoh(&a.buf).map_err(dev_err("copying window bits"))?;
            s.synchronize().map_err(dev_err("copying the buckets"))?;
            let bits = &buf[(a.lines * 64) as usize..];
            for b in 0..st.nbuckets as usize {
                for slot in 0..128 {
                    let pos = b * 128 + slot;
                    let window =
                        digests[pos] != crate::hash::EMPTY_DIGEST && scores[pos] & crate::score::ADAPTIVE_MAIN == 0;
                    let bit = bits[pos / 8] >> (pos % 8) & 1 == 1;
                    if window && !bit {
                        return Err(Error::Device(format!("bucket {b}: window slot {slot} without its bit")));
                    }
                }
            }
            Ok(())
        })
    }
}
