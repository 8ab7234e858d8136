//! The peer route: each owner serves its keys straight out of every
//! GPU's batch over peer access.

use super::*;

/// Enables peer access between every pair of `nodes`' GPUs, for plain
/// allocations and for the stream-ordered pool the batches come from; false
/// when a pair has none (the peer route is then refused, the others work).
pub(super) fn peer_access(nodes: &[Node]) -> bool {
    use cudarc::driver::sys::{
        cuCtxEnablePeerAccess, cuDeviceCanAccessPeer, cuDeviceGetDefaultMemPool, cuMemPoolSetAccess, CUmemAccessDesc,
        CUmemAccess_flags, CUmemLocation, CUmemLocationType, CUresult,
    };
    for a in nodes {
        for b in nodes {
            if Arc::ptr_eq(&a.dev, &b.dev) {
                continue;
            }
            let (da, db) = (a.dev.ctx.cu_device(), b.dev.ctx.cu_device());
            let mut can = 0;
            // SAFETY: both devices are valid ordinals of an initialised
            // driver; `can` is a local out-parameter.
            let r = unsafe { cuDeviceCanAccessPeer(&mut can, da, db) };
            if r != CUresult::CUDA_SUCCESS || can == 0 || a.dev.ctx.bind_to_thread().is_err() {
                return false;
            }
            // SAFETY: a's context is current on this thread; b's context
            // lives as long as the group (the nodes hold both devices).
            let r = unsafe { cuCtxEnablePeerAccess(b.dev.ctx.cu_ctx(), 0) };
            if r != CUresult::CUDA_SUCCESS && r != CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                return false;
            }
            // Stream-ordered allocations (every batch and scratch buffer)
            // come from b's default pool, which needs its own grant.
            let mut pool = std::ptr::null_mut();
            // SAFETY: `pool` is a local out-parameter; db is valid.
            if unsafe { cuDeviceGetDefaultMemPool(&mut pool, db) } != CUresult::CUDA_SUCCESS {
                return false;
            }
            let desc = CUmemAccessDesc {
                location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: da },
                flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one descriptor, alive for the call; the pool is b's.
            if unsafe { cuMemPoolSetAccess(pool, &desc, 1) } != CUresult::CUDA_SUCCESS {
                return false;
            }
        }
    }
    true
}

impl GpuGroup {
    /// The peer route: each owner serves its keys of every GPU's batch in
    /// place, over peer pointers, filtered by the batch's owner masks.
    pub(super) fn run_peer(
        &self,
        op: DeviceOp,
        nodes: &mut [Node],
        b: &mut [RankBatch],
        n: &[usize],
    ) -> Result<Counts> {
        if !self.peer {
            return Err(Error::Unavailable(format!(
                "GPUs {:?}: not every pair has peer access; use the device route",
                self.ordinals
            )));
        }
        let ready = self.mark_owners(nodes, b, n)?;
        let pending = self.serve_from_peers(op, nodes, b, n, &ready)?;
        self.finish_peer(op, nodes, pending)
    }

    /// Marks each key's owner in every GPU's masks; returns where each
    /// GPU's masks are done.
    fn mark_owners(&self, nodes: &mut [Node], b: &[RankBatch], n: &[usize]) -> Result<Vec<cudarc::driver::CudaEvent>> {
        let nr = nodes.len();
        for (q, node) in nodes.iter_mut().enumerate() {
            let s = node.stream.clone();
            // SAFETY: b[q].keys holds b[q].n >= n[q] keys on this GPU.
            unsafe { node.masks(ptr(&b[q].keys, &s), n[q], nr) }?;
            node.zero_counters()?;
        }
        // The masks of batch q are done where `ready[q]` is recorded.
        let ready: Vec<cudarc::driver::CudaEvent> = nodes
            .iter()
            .map(|node| node.stream.record_event(None).map_err(dev_err("recording an event")))
            .collect::<Result<_>>()?;
        Ok(ready)
    }

    /// Each GPU serves its keys of its own batch on its main stream and,
    /// pulled over the link, of every other batch on its serve stream.
    /// Until each [`Pending`] completes, it holds its table's lock group,
    /// and waits for its streams if dropped on an error path.
    fn serve_from_peers(
        &self,
        op: DeviceOp,
        nodes: &mut [Node],
        b: &[RankBatch],
        n: &[usize],
        ready: &[cudarc::driver::CudaEvent],
    ) -> Result<Vec<Option<Pending<'_>>>> {
        let nr = nodes.len();
        let incoming: usize = n.iter().sum();
        let mut pending: Vec<Option<Pending<'_>>> = (0..nr).map(|_| None).collect();
        // Rows the owner only reads are pulled with the keys; rows it writes
        // (find, find_or_insert) are written straight into the batch.
        let mv = moves(op)?;
        let pull_values = mv.values_in && !mv.values_out;
        let dim = self.config.dim;
        // Addresses of every batch and its masks, on its own GPU.
        type Batch = (DevPtr<u64>, DevPtr<f32>, DevPtr<u8>, Option<DevPtr<u8>>);
        let addr: Vec<Batch> = nodes
            .iter()
            .enumerate()
            .map(|(q, nd)| {
                let sq = &nd.stream;
                let (k, v, f) = (DevPtr::of(&b[q].keys, sq), DevPtr::of(&b[q].values, sq), DevPtr::of(&b[q].found, sq));
                (k, v, f, DevPtr::of_opt(&nd.b.masks, sq))
            })
            .collect();
        let ctxs: Vec<_> = nodes.iter().map(|nd| nd.dev.ctx.cu_ctx()).collect();
        for (r, node) in nodes.iter_mut().enumerate() {
            // Its own keys on the main stream, the others' (pulled over the
            // link first) on the serve stream, at the same time.
            let s = node.stream.clone();
            let other = node.serve.clone();
            let theirs: usize = (0..nr).filter(|&q| q != r).map(|q| n[q]).sum();
            ensure(&s, &mut node.b.pulled_keys, theirs)?;
            ensure(&s, &mut node.b.pulled_only, theirs)?;
            if pull_values {
                ensure(&s, &mut node.b.pulled_values, theirs * dim)?;
            }
            // The serve stream starts after the main stream's allocations
            // (stream-ordered) and every batch's masks.
            other.join(&s).map_err(dev_err("ordering streams"))?;
            for (q, ev) in ready.iter().enumerate() {
                if q != r {
                    other.wait(ev).map_err(dev_err("ordering streams"))?;
                }
            }
            let counters = DevPtr::of_opt(&node.b.counters, &s);
            let (pk, po, pv) = (
                DevPtr::of_opt(&node.b.pulled_keys, &s),
                DevPtr::of_opt(&node.b.pulled_only, &s),
                DevPtr::of_opt(&node.b.pulled_values, &s),
            );
            let mut at = 0usize;
            // Its own batch first, then the others'.
            for q in (0..nr).map(|k| (r + k) % nr) {
                let st = if q == r { &s } else { &other };
                let (keys, values, found, masks) = addr[q];
                let mut p = Ptrs {
                    keys: Some(keys),
                    values: Some(values),
                    found: Some(found),
                    only: masks.map(|m| m.skip(r * n[q]).take(n[q])),
                    counters,
                    ..Ptrs::default()
                };
                if q != r && n[q] > 0 {
                    let ends = (ctxs[r], ctxs[q]);
                    // Keys and masks are read many times per key (remote
                    // loads would sit on each lookup's critical path): one
                    // copy-engine transfer each.
                    p.keys = pull(ends, st, pk.map(|x| x.skip(at)), p.keys, n[q])?;
                    p.only = pull(ends, st, po.map(|x| x.skip(at)), p.only, n[q])?;
                    if pull_values {
                        p.values = pull(ends, st, pv.map(|x| x.skip(at * dim)), p.values, n[q] * dim)?;
                    }
                    at += n[q];
                }
                let raw = Raw { p, ..Raw::default() };
                // SAFETY: b[q] holds n[q] keys (rows, flags) on GPU q, which
                // this GPU reaches through peer access (checked above); the
                // masks of q hold n[q] bytes for owner r, and the pulled
                // copies n[q] keys, bytes and rows. The stream waited for q's
                // masks; q's stream waits for it before the batch ends, and
                // every stream is synchronised before run returns.
                let part = unsafe {
                    match pending[r] {
                        None => self.tables[r].enqueue_first(op, st, n[q], raw, incoming),
                        Some(_) => self.tables[r].enqueue_held(op, st, n[q], raw),
                    }
                }?;
                fold(&mut pending[r], part);
            }
            s.join(&other).map_err(dev_err("ordering streams"))?;
        }
        Ok(pending)
    }

    /// Every GPU waits for the others to be done with its batch; then each
    /// table books its keys of every batch.
    fn finish_peer(&self, op: DeviceOp, nodes: &[Node], pending: Vec<Option<Pending<'_>>>) -> Result<Counts> {
        let nr = nodes.len();
        let served: Vec<cudarc::driver::CudaEvent> = nodes
            .iter()
            .map(|node| node.stream.record_event(None).map_err(dev_err("recording an event")))
            .collect::<Result<_>>()?;
        for (q, node) in nodes.iter().enumerate() {
            for (r, ev) in served.iter().enumerate() {
                if r != q {
                    node.stream.wait(ev).map_err(dev_err("ordering streams"))?;
                }
            }
        }
        let mut counts = Counts::default();
        let mut keys = vec![0u64; nr];
        let mut cn = vec![];
        for node in nodes.iter() {
            let (c, t) = node.read_counters_and_totals(nr)?;
            cn.push(c);
            for (r, t) in t.into_iter().enumerate() {
                keys[r] += t;
            }
        }
        for (r, p) in pending.into_iter().enumerate() {
            self.tables[r].book(op, keys[r] as usize);
            if let Some(mut p) = p {
                p.set_keys(keys[r] as usize);
                counts = counts.merge(self.tables[r].complete(p, &cn[r]));
            }
        }
        Ok(counts)
    }
}

/// Copies the first `len` elements of `src` (on the context `ctxs.1`)
/// into `dst` (on `ctxs.0`) on the copy engines, ordered on `st`; returns
/// the copy.
pub(super) fn pull<T>(
    ctxs: (CUcontext, CUcontext),
    st: &CudaStream,
    dst: Option<DevPtr<T>>,
    src: Option<DevPtr<T>>,
    len: usize,
) -> Result<Option<DevPtr<T>>> {
    let (Some(dst), Some(src)) = (dst, src) else {
        return Err(Error::Device("a peer copy without its buffer".into()));
    };
    let (dst, src) = (dst.take(len), src.take(len));
    let bytes = len * std::mem::size_of::<T>();
    // SAFETY: both views hold `len` elements (take
    // checks), on the contexts named; the stream
    // orders the copy before the kernels reading it.
    unsafe { cudarc::driver::result::memcpy_peer_async(ctxs.0, dst.addr(), ctxs.1, src.addr(), bytes, st.cu_stream()) }
        .map_err(dev_err("copying from a peer"))?;
    Ok(Some(dst))
}
