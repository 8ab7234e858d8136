//! The device route: split on the GPU, NCCL there and back.

use super::*;

impl GpuGroup {
    /// The device route: each GPU splits its keys by owner on the GPU and
    /// serves its own part (staged by the split) on its serve stream while
    /// NCCL carries the other parts to their owners, who serve them too; a
    /// second all-to-all brings the results back and a gather restores
    /// request order.
    pub(super) fn run_nccl(
        &self,
        op: DeviceOp,
        mv: &Moves,
        nodes: &mut [Node],
        b: &mut [RankBatch],
        n: &[usize],
    ) -> Result<Counts> {
        let nr = nodes.len();
        let dim = self.config.dim;
        let (placed, c) = self.split_by_owner(mv, nodes, b, n)?;
        let plan = Plan::packed(&c, true);
        for (r, node) in nodes.iter_mut().enumerate() {
            let (s, m) = (node.stream.clone(), plan.recv_size[r] as usize);
            let bf = &mut node.b;
            ensure(&s, &mut bf.recv_keys, m)?;
            ensure(&s, &mut bf.recv_values, m * dim)?;
            ensure(&s, &mut bf.recv_found, m)?;
            ensure(&s, &mut bf.send_values, n[r] * dim)?;
            ensure(&s, &mut bf.send_found, n[r])?;
        }
        let mut forward = vec![(1, Buf::SendKeys, Buf::RecvKeys)];
        if mv.values_in {
            forward.push((dim, Buf::SendValues, Buf::RecvValues));
        }
        let mut refs: Vec<&mut Node> = nodes.iter_mut().collect();
        exchange_many(&self.comms, &mut refs, &plan, &forward)?;
        let pending = self.serve_parts(op, nodes, &plan, &placed, &c, n)?;
        self.return_results(mv, nodes, &plan, b, n)?;
        let mut counts = Counts::default();
        for (r, mut p) in pending.into_iter().enumerate() {
            let cn = nodes[r].read_counters_with(true)?;
            let keys = (0..nr).map(|q| c[q][r]).sum::<u64>() as usize;
            self.tables[r].book(op, keys);
            p.set_keys(keys);
            counts = counts.merge(self.tables[r].complete(p, &cn));
        }
        Ok(counts)
    }

    /// Splits every GPU's batch by owner into its send buffers (keys, and
    /// rows when the op writes them); returns where each split is done and
    /// the keys per (source, owner).
    fn split_by_owner(
        &self,
        mv: &Moves,
        nodes: &mut [Node],
        b: &[RankBatch],
        n: &[usize],
    ) -> Result<(Vec<cudarc::driver::CudaEvent>, Vec<Vec<u64>>)> {
        let nr = nodes.len();
        let dim = self.config.dim;
        for (r, node) in nodes.iter_mut().enumerate() {
            let s = node.stream.clone();
            // SAFETY: b[r].keys holds b[r].n >= n[r] keys on this GPU.
            unsafe { node.partition(ptr(&b[r].keys, &s), n[r], nr) }?;
            node.zero_counters()?;
            node.zero_local_counters()?;
            if mv.values_in {
                ensure(&s, &mut node.b.send_values, n[r] * dim)?;
                let dst = opt_ptr(&node.b.send_values, &s);
                // SAFETY: both hold n[r] rows; pos is this partition's.
                unsafe { node.scatter_values(ptr(&b[r].values, &s), dst, n[r], dim) }?;
            }
        }
        // The split is done where `placed` is recorded.
        let placed: Vec<cudarc::driver::CudaEvent> = nodes
            .iter()
            .map(|node| node.stream.record_event(None).map_err(dev_err("recording an event")))
            .collect::<Result<_>>()?;
        let c: Vec<Vec<u64>> = nodes.iter().map(|node| node.totals(nr)).collect::<Result<_>>()?;
        Ok((placed, c))
    }

    /// Launches each GPU's own keys (staged by the split, once it is done)
    /// and then the keys it received, on its serve stream. Until each
    /// [`Pending`] completes, it holds its table's lock group, and waits for
    /// its streams if dropped on an error path.
    fn serve_parts(
        &self,
        op: DeviceOp,
        nodes: &[Node],
        plan: &Plan,
        placed: &[cudarc::driver::CudaEvent],
        c: &[Vec<u64>],
        n: &[usize],
    ) -> Result<Vec<Pending<'_>>> {
        let (nr, dim) = (nodes.len(), self.config.dim);
        // Each GPU's own keys are served once the exchange is queued: NCCL's
        // kernels take their SMs before the table's kernel fills the rest.
        let incoming: usize = n.iter().sum();
        let mut pending: Vec<Pending<'_>> = Vec::with_capacity(nr);
        for (r, node) in nodes.iter().enumerate() {
            let (s, sv, bf) = (&node.stream, &node.serve, &node.b);
            sv.wait(&placed[r]).map_err(dev_err("ordering streams"))?;
            let at = plan.send_at[r][r] as usize;
            let p = Ptrs {
                keys: DevPtr::of_opt(&bf.send_keys, s).map(|p| p.skip(at)),
                values: DevPtr::of_opt(&bf.send_values, s).map(|p| p.skip(at * dim)),
                found: DevPtr::of_opt(&bf.send_found, s).map(|p| p.skip(at)),
                counters: DevPtr::of_opt(&bf.local_counters, s),
                ..Ptrs::default()
            };
            let raw = Raw { p, ..Raw::default() };
            // SAFETY: [at, at + c[r][r]) of the send buffers holds this
            // GPU's own keys and rows, and its results land there; the serve
            // stream waits for the split (`placed`) and the main stream
            // joins it before the end.
            pending.push(unsafe { self.tables[r].enqueue_first(op, sv, c[r][r] as usize, raw, incoming) }?);
        }
        for (r, node) in nodes.iter().enumerate() {
            let (s, sv) = (&node.stream, &node.serve);
            sv.join(s).map_err(dev_err("ordering streams"))?;
            let counters = DevPtr::of(node.b.counters.as_ref().expect("allocated by Node::new"), s);
            let raw = node.recv_raw(counters, false);
            // SAFETY: the received keys (rows) fill the recv buffers, sized
            // by run_nccl; the serve stream waits for their arrival and is joined
            // before the end.
            let part = unsafe { self.tables[r].enqueue_held(op, sv, plan.recv_size[r] as usize, raw) }?;
            pending[r].absorb(part);
        }
        Ok(pending)
    }

    /// Carries the results back to the GPUs the keys came from (once the
    /// owners are done) and gathers them into request order.
    fn return_results(
        &self,
        mv: &Moves,
        nodes: &mut [Node],
        plan: &Plan,
        b: &mut [RankBatch],
        n: &[usize],
    ) -> Result<()> {
        let dim = self.config.dim;
        let mut backward = vec![];
        if mv.found_out {
            backward.push((1, Buf::RecvFound, Buf::SendFound));
        }
        if mv.values_out {
            backward.push((dim, Buf::RecvValues, Buf::SendValues));
        }
        if !backward.is_empty() {
            for node in nodes.iter() {
                node.stream.join(&node.serve).map_err(dev_err("ordering streams"))?;
            }
            let sizes: Vec<u64> = n.iter().map(|&x| x as u64).collect();
            let mut refs: Vec<&mut Node> = nodes.iter_mut().collect();
            exchange_many(&self.comms, &mut refs, &plan.back(&sizes), &backward)?;
        }
        for (r, node) in nodes.iter().enumerate() {
            let s = &node.stream;
            let found = opt_ptr(&node.b.send_found, s);
            // SAFETY: send_found / send_values hold the n[r] results in
            // partition order (sized by run_nccl), b[r] n[r] keys.
            unsafe {
                if mv.found_out {
                    node.gather_u8(found, ptr(&b[r].found, s), n[r])?;
                }
                if mv.values_out {
                    let mask = if mv.masked { found } else { 0 };
                    let src = opt_ptr(&node.b.send_values, s);
                    node.gather_values(src, ptr(&b[r].values, s), mask, n[r], dim)?;
                }
            }
        }
        for node in nodes.iter() {
            node.stream.join(&node.serve).map_err(dev_err("ordering streams"))?;
        }
        Ok(())
    }
}
