//! The host route: split on the host, as the daemon's router does (kept
//! for comparison).

use super::*;

impl GpuGroup {
    pub(super) fn run_host(
        &self,
        op: DeviceOp,
        mv: &Moves,
        nodes: &mut [Node],
        b: &mut [RankBatch],
        n: &[usize],
    ) -> Result<Counts> {
        let nr = nodes.len();
        let dim = self.config.dim;
        // Host buffers are kept from batch to batch: fresh ones would cost a
        // page fault per 4 KiB on every batch.
        let mut src: Vec<HostSource> = nodes.iter_mut().map(|nd| std::mem::take(&mut nd.host.0)).collect();
        let mut own: Vec<HostOwner> = nodes.iter_mut().map(|nd| std::mem::take(&mut nd.host.1)).collect();
        for o in own.iter_mut() {
            o.keys.clear();
            o.values.clear();
            o.origin.clear();
        }
        if let Some(&big) = n.iter().find(|&&m| u32::try_from(m).is_err()) {
            return Err(Error::Config(format!("{big} keys on one GPU: the host route takes at most 2^32 - 1")));
        }
        // To the host, split by owner there.
        for (r, node) in nodes.iter().enumerate() {
            let s = &node.stream;
            let h = &mut src[r];
            h.keys.resize(n[r], 0);
            s.memcpy_dtoh(&b[r].keys.slice(..n[r]), &mut h.keys).map_err(dev_err("copying keys to the host"))?;
            if mv.values_in {
                h.values.resize(n[r] * dim, 0.0);
                s.memcpy_dtoh(&b[r].values.slice(..n[r] * dim), &mut h.values).map_err(dev_err("copying rows"))?;
            }
            s.synchronize().map_err(dev_err("copying a batch to the host"))?;
            for (i, &k) in h.keys.iter().enumerate() {
                let o = &mut own[shard_of(k, nr as u64) as usize];
                o.keys.push(k);
                o.origin.push((r as u32, i as u32));
                if mv.values_in {
                    o.values.extend_from_slice(&h.values[i * dim..(i + 1) * dim]);
                }
            }
        }
        // Each part to its owner.
        let received: Vec<u64> = own.iter().map(|o| o.keys.len() as u64).collect();
        for (d, node) in nodes.iter_mut().enumerate() {
            let s = node.stream.clone();
            let m = own[d].keys.len();
            ensure(&s, &mut node.b.recv_keys, m)?;
            ensure(&s, &mut node.b.recv_values, m * dim)?;
            ensure(&s, &mut node.b.recv_found, m)?;
            if m > 0 {
                let k = node.b.recv_keys.as_mut().expect("sized");
                s.memcpy_htod(&own[d].keys, &mut k.slice_mut(..m)).map_err(dev_err("copying keys"))?;
                if mv.values_in {
                    let v = node.b.recv_values.as_mut().expect("sized");
                    s.memcpy_htod(&own[d].values, &mut v.slice_mut(..m * dim)).map_err(dev_err("copying rows"))?;
                }
            }
        }
        let pending = self.serve(op, nodes, &received)?;
        // Results back to the host, into request order, and to the callers.
        for (r, node) in nodes.iter().enumerate() {
            let h = &mut src[r];
            h.out_found.clear();
            h.out_found.resize(if mv.found_out { n[r] } else { 0 }, 0);
            h.out_rows.resize(if mv.values_out { n[r] * dim } else { 0 }, 0.0);
            if mv.masked {
                let s = &node.stream;
                s.memcpy_dtoh(&b[r].values.slice(..n[r] * dim), &mut h.out_rows).map_err(dev_err("copying rows"))?;
            }
        }
        for (d, node) in nodes.iter().enumerate() {
            let s = &node.stream;
            let o = &mut own[d];
            let m = o.keys.len();
            o.found.resize(m, 0);
            o.rows.resize(m * dim, 0.0);
            if m > 0 {
                if mv.found_out {
                    s.memcpy_dtoh(&node.b.recv_found.as_ref().expect("sized").slice(..m), &mut o.found)
                        .map_err(dev_err("copying flags"))?;
                }
                if mv.values_out {
                    let from = node.b.recv_values.as_ref().expect("sized").slice(..m * dim);
                    s.memcpy_dtoh(&from, &mut o.rows).map_err(dev_err("copying rows"))?;
                }
            }
            s.synchronize().map_err(dev_err("serving a batch"))?;
            for (j, &(r, i)) in o.origin.iter().enumerate() {
                let (r, i) = (r as usize, i as usize);
                if mv.found_out {
                    src[r].out_found[i] = o.found[j];
                }
                if mv.values_out && (!mv.masked || o.found[j] != 0) {
                    src[r].out_rows[i * dim..(i + 1) * dim].copy_from_slice(&o.rows[j * dim..(j + 1) * dim]);
                }
            }
        }
        for (r, node) in nodes.iter().enumerate() {
            let s = &node.stream;
            if mv.found_out && n[r] > 0 {
                s.memcpy_htod(&src[r].out_found, &mut b[r].found.slice_mut(..n[r]))
                    .map_err(dev_err("copying flags"))?;
            }
            if mv.values_out && n[r] > 0 {
                s.memcpy_htod(&src[r].out_rows, &mut b[r].values.slice_mut(..n[r] * dim))
                    .map_err(dev_err("copying rows"))?;
            }
        }
        let counts = self.finish(nodes, pending);
        for ((node, s), o) in nodes.iter_mut().zip(src).zip(own) {
            node.host = (s, o);
        }
        counts
    }
}
