//! Resharding: every entry of a group onto another set of GPUs, GPU to GPU.

use super::*;

/// Slots exported per GPU per round while resharding.
pub(super) const RESHARD_CHUNK: u64 = 1 << 20;

impl GpuGroup {
    /// Moves every entry onto a new group on `ordinals` (same config, keys
    /// re-owned by `shard_of(key, ordinals.len())`), GPU to GPU over one
    /// communicator spanning both sets of GPUs; scores are kept. This group
    /// is left as it was. Returns the new group and the entries moved.
    pub fn reshard(&self, ordinals: &[usize]) -> Result<(GpuGroup, u64)> {
        let new = GpuGroup::new(self.config.clone(), ordinals)?;
        let mut all: Vec<usize> = self.ordinals.iter().chain(ordinals).copied().collect();
        all.sort_unstable();
        all.dedup();
        let mut nodes: Vec<Node> =
            all.iter().map(|&o| shared_device(o).and_then(|d| Node::new(&d))).collect::<Result<_>>()?;
        let comms = if all.len() > 1 { communicators(&nodes)? } else { vec![] };
        let old_of = |u: usize| self.ordinals.iter().position(|&o| o == all[u]);
        let new_of = |u: usize| ordinals.iter().position(|&o| o == all[u]);
        let m = ordinals.len();
        let dim = self.config.dim;
        let rounds = self.tables.iter().map(|t| t.capacity().div_ceil(RESHARD_CHUNK)).max().unwrap_or(0);
        let mut moved = 0;
        for round in 0..rounds {
            let offset = round * RESHARD_CHUNK;
            // Export a chunk on every old GPU, split it by new owner.
            let mut c = vec![vec![0u64; all.len()]; all.len()];
            // The partition lays segments out in new-rank order; the
            // communicator's ranks are the union's, so offsets are explicit.
            let mut send_at = vec![vec![0u64; all.len()]; all.len()];
            for (u, node) in nodes.iter_mut().enumerate() {
                let Some(r) = old_of(u) else { continue };
                let count = self.export_chunk(&self.tables[r], node, offset)?;
                moved += count;
                let s = node.stream.clone();
                // SAFETY: ex keys (in recv_keys) hold `count` keys.
                unsafe { node.partition(opt_ptr(&node.b.recv_keys, &s), count as usize, m) }?;
                ensure(&s, &mut node.b.send_values, count as usize * dim)?;
                ensure(&s, &mut node.b.send_scores, count as usize)?;
                // SAFETY: the exported rows and scores hold `count` entries;
                // the send buffers were sized for them; pos is this partition's.
                unsafe {
                    let b = &node.b;
                    node.scatter_values(opt_ptr(&b.recv_values, &s), opt_ptr(&b.send_values, &s), count as usize, dim)?;
                    node.scatter_u64(opt_ptr(&b.recv_scores, &s), opt_ptr(&b.send_scores, &s), count as usize)?;
                }
                let t = node.totals(m)?;
                let at = starts(&t);
                for (d, &x) in t.iter().enumerate() {
                    let to = all.iter().position(|&o| o == ordinals[d]).expect("member");
                    c[u][to] = x;
                    send_at[u][to] = at[d];
                }
            }
            let mut plan = Plan::packed(&c, false);
            plan.send_at = send_at;
            // Send, then load on the new owners.
            let received = plan.recv_size.clone();
            if all.len() > 1 {
                let mut refs: Vec<&mut Node> = nodes.iter_mut().collect();
                let arrays = [
                    (1, Buf::SendKeys, Buf::RecvKeys),
                    (dim, Buf::SendValues, Buf::RecvValues),
                    (1, Buf::SendScores, Buf::RecvScores),
                ];
                exchange_many(&comms, &mut refs, &plan, &arrays)?;
            } else {
                let node = &mut nodes[0];
                std::mem::swap(&mut node.b.send_keys, &mut node.b.recv_keys);
                std::mem::swap(&mut node.b.send_values, &mut node.b.recv_values);
                std::mem::swap(&mut node.b.send_scores, &mut node.b.recv_scores);
            }
            for (u, node) in nodes.iter_mut().enumerate() {
                let Some(d) = new_of(u) else { continue };
                let k = received[u] as usize;
                if k == 0 {
                    continue;
                }
                let s = node.stream.clone();
                let counters = node.zero_counters()?;
                let raw = node.recv_raw(counters, true);
                // SAFETY: the exchange sized and filled recv_* with k
                // entries on this GPU; synchronised by read_counters below.
                let p = unsafe { new.tables[d].enqueue(DeviceOp::Load, &s, k, raw) }?;
                let cn = node.read_counters()?;
                new.tables[d].complete(p, &cn);
            }
        }
        drop(comms);
        Ok((new, moved))
    }

    /// Exports slots `[offset, offset + RESHARD_CHUNK)` of `table` into the
    /// node's `recv_keys / recv_values / recv_scores`; returns the count.
    pub(super) fn export_chunk(&self, table: &CudaTable, node: &mut Node, offset: u64) -> Result<u64> {
        let s = node.stream.clone();
        let dim = self.config.dim;
        let chunk = RESHARD_CHUNK as usize;
        let nb = chunk / BUCKET_SLOTS + 2;
        let b = &mut node.b;
        ensure(&s, &mut b.recv_keys, chunk)?;
        ensure(&s, &mut b.recv_values, chunk * dim)?;
        ensure(&s, &mut b.recv_scores, chunk)?;
        ensure(&s, &mut b.ex_counts, nb)?;
        ensure(&s, &mut b.ex_offsets, nb + 1)?;
        let counters = node.zero_counters()?;
        let b = &node.b;
        let view = |x: &Option<CudaSlice<u64>>| DevPtr::of(x.as_ref().expect("ensured"), &s);
        let raw = Raw {
            p: Ptrs { counters: Some(counters), ..Ptrs::default() },
            export: Some(ExportArgs {
                out: ExportPtrs {
                    keys: view(&b.recv_keys),
                    values: DevPtr::of(b.recv_values.as_ref().expect("ensured"), &s),
                    scores: view(&b.recv_scores),
                },
                counts: DevPtr::of(b.ex_counts.as_ref().expect("ensured"), &s),
                offsets: view(&b.ex_offsets),
            }),
        };
        // SAFETY: the outputs hold a whole chunk of slots (every possible
        // match), counts / offsets its buckets; synchronised below.
        let p = unsafe { table.enqueue(DeviceOp::Export { offset, filter: Filter::ALL }, &s, chunk, raw) }?;
        let end = (offset + RESHARD_CHUNK).min(table.capacity());
        let spanned = if offset < end {
            ((end - 1) / BUCKET_SLOTS as u64 - offset / BUCKET_SLOTS as u64 + 1) as usize
        } else {
            0
        };
        let mut total = [0u64];
        if spanned > 0 {
            let o = node.b.ex_offsets.as_ref().expect("sized");
            s.memcpy_dtoh(&o.slice(spanned..spanned + 1), &mut total).map_err(dev_err("reading the export count"))?;
        }
        let cn = node.read_counters()?;
        table.complete(p, &cn);
        Ok(total[0])
    }
}
