//! One GPU of a group: its streams, route kernels and scratch, and the
//! split / scatter / gather steps the routes share.

use super::*;

/// Keys per tile of the route kernels (`HKV_TILE` of kernels/abi.h).
pub(super) const TILE: u64 = hkv_kernels::abi::HKV_TILE as u64;

// The route kernels count a tile's keys per shard in HKV_ROUTE_MAX slots.
const _: () = assert!(MAX_GPUS <= hkv_kernels::abi::HKV_ROUTE_MAX as usize);

pub(super) struct RouteFns {
    pub(super) count: CudaFunction,
    pub(super) scan: CudaFunction,
    pub(super) scatter: CudaFunction,
    pub(super) masks: CudaFunction,
    pub(super) scatter_u64: CudaFunction,
    pub(super) gather_u8: CudaFunction,
    pub(super) scatter_f32: CudaFunction,
    pub(super) gather_f32: CudaFunction,
    pub(super) scatter_f128: CudaFunction,
    pub(super) gather_f128: CudaFunction,
}

impl RouteFns {
    pub(super) fn load(dev: &Device) -> Result<RouteFns> {
        let m = dev.module(KernelId::Route);
        let get = |name: &str| m.load_function(name).map_err(|e| Error::Device(format!("kernel {name}: {e:?}")));
        Ok(RouteFns {
            count: get("route_count")?,
            scan: get("route_scan")?,
            scatter: get("route_scatter")?,
            masks: get("route_masks")?,
            scatter_u64: get("rows_scatter_u64")?,
            gather_u8: get("rows_gather_u8")?,
            scatter_f32: get("rows_scatter_f32")?,
            gather_f32: get("rows_gather_f32")?,
            scatter_f128: get("rows_scatter_f128")?,
            gather_f128: get("rows_gather_f128")?,
        })
    }
}

/// Scratch of one GPU, grown as batches need.
#[derive(Default)]
pub(super) struct Bufs {
    pub(super) dest: Option<CudaSlice<u8>>,
    pub(super) masks: Option<CudaSlice<u8>>,
    pub(super) pulled_keys: Option<CudaSlice<u64>>,
    pub(super) pulled_only: Option<CudaSlice<u8>>,
    pub(super) pulled_values: Option<CudaSlice<f32>>,
    pub(super) tile_counts: Option<CudaSlice<u32>>,
    pub(super) offsets: Option<CudaSlice<u64>>,
    pub(super) totals: Option<CudaSlice<u64>>,
    pub(super) pos: Option<CudaSlice<u32>>,
    pub(super) send_keys: Option<CudaSlice<u64>>,
    pub(super) send_values: Option<CudaSlice<f32>>,
    pub(super) send_scores: Option<CudaSlice<u64>>,
    pub(super) send_found: Option<CudaSlice<u8>>,
    pub(super) recv_keys: Option<CudaSlice<u64>>,
    pub(super) recv_values: Option<CudaSlice<f32>>,
    pub(super) recv_scores: Option<CudaSlice<u64>>,
    pub(super) recv_found: Option<CudaSlice<u8>>,
    pub(super) counters: Option<CudaSlice<u64>>,
    pub(super) local_counters: Option<CudaSlice<u64>>,
    pub(super) ex_counts: Option<CudaSlice<u32>>,
    pub(super) ex_offsets: Option<CudaSlice<u64>>,
}

/// One GPU of a group: its stream (also its communicator's), route kernels
/// and scratch.
pub(super) struct Node {
    pub(super) dev: Arc<Device>,
    pub(super) stream: Arc<CudaStream>,
    /// Serves the parts of a device-route batch while `stream` moves them.
    pub(super) serve: Arc<CudaStream>,
    pub(super) f: RouteFns,
    pub(super) b: Bufs,
    pub(super) hasher: Option<FeatureHasher>,
    /// Host buffers of the host route: this GPU as a batch's source, and as
    /// the owner of keys.
    pub(super) host: (HostSource, HostOwner),
}

/// A GPU's batch on the host (host route), and its results in request order.
#[derive(Default)]
pub(super) struct HostSource {
    pub(super) keys: Vec<u64>,
    pub(super) values: Vec<f32>,
    pub(super) out_found: Vec<u8>,
    pub(super) out_rows: Vec<f32>,
}

/// The keys a GPU owns in a host-route batch, where each came from, and
/// what its table answered.
#[derive(Default)]
pub(super) struct HostOwner {
    pub(super) keys: Vec<u64>,
    pub(super) values: Vec<f32>,
    pub(super) origin: Vec<(u32, u32)>,
    pub(super) found: Vec<u8>,
    pub(super) rows: Vec<f32>,
}

impl Node {
    pub(super) fn new(dev: &Arc<Device>) -> Result<Node> {
        // Both streams at the default priority: with the serve stream below
        // the main one, finds ran 15 % slower on the H200 pair.
        let stream = dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let serve = dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let mut b = Bufs::default();
        ensure(&stream, &mut b.counters, 8)?;
        ensure(&stream, &mut b.local_counters, 8)?;
        Ok(Node { f: RouteFns::load(dev)?, dev: dev.clone(), stream, serve, b, hasher: None, host: Default::default() })
    }

    /// Row kernels move `w` words per key: float4 when the row allows.
    pub(super) fn row_width(dim: usize) -> (bool, u64) {
        if dim.is_multiple_of(4) {
            (true, dim as u64 / 4)
        } else {
            (false, dim as u64)
        }
    }

    /// Splits `n` keys at `keys` by owner (of `shards`) into `send_keys`
    /// (stable), recording each key's place in `pos`; queues the copy of the
    /// per-owner totals, read by [`Node::totals`].
    ///
    /// # Safety
    /// `keys` is a device buffer of this node's GPU holding `n` keys, alive
    /// until the stream is synchronised.
    pub(super) unsafe fn partition(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe {
            self.count(keys, n, shards)?;
            self.place(keys, n, shards)
        }
    }

    /// The first half of [`Node::partition`]: each key's owner into `dest`
    /// and per-tile counts.
    ///
    /// # Safety
    /// As [`Node::partition`].
    pub(super) unsafe fn count(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
        let s = self.stream.clone();
        let tiles = (n as u64).div_ceil(TILE).max(1);
        let b = &mut self.b;
        ensure(&s, &mut b.dest, n)?;
        ensure(&s, &mut b.tile_counts, (tiles as usize) * shards)?;
        if n == 0 {
            return Ok(());
        }
        let (n64, nr) = (n as u64, shards as u32);
        let (dest, tc) = (opt_ptr(&b.dest, &s), opt_ptr(&b.tile_counts, &s));
        // No GPU's own keys filtered out (the kernel's `me` / `mine`).
        let (me, mine) = (u32::MAX, 0u64);
        let tiles_cfg = grid(n64, TILE as u32)?;
        let mut l = s.launch_builder(&self.f.count);
        l.arg(&keys).arg(&n64).arg(&nr).arg(&dest).arg(&tc).arg(&me).arg(&mine);
        // SAFETY: route_count reads keys[0..n] and writes dest[0..n],
        // and tile_counts[0..shards * tiles], all
        // sized above.
        unsafe { l.launch(tiles_cfg) }.map_err(dev_err("launching route_count"))?;
        Ok(())
    }

    /// The second half of [`Node::partition`], after [`Node::count`].
    ///
    /// # Safety
    /// As [`Node::partition`].
    pub(super) unsafe fn place(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
        let s = self.stream.clone();
        let tiles = (n as u64).div_ceil(TILE).max(1);
        let b = &mut self.b;
        ensure(&s, &mut b.pos, n)?;
        ensure(&s, &mut b.send_keys, n)?;
        ensure(&s, &mut b.offsets, (tiles as usize) * shards)?;
        ensure(&s, &mut b.totals, MAX_GPUS)?;
        if n == 0 {
            s.memset_zeros(b.totals.as_mut().expect("ensured")).map_err(dev_err("clearing totals"))?;
            return Ok(());
        }
        let (n64, nr) = (n as u64, shards as u32);
        let (dest, tc, off, tot) =
            (opt_ptr(&b.dest, &s), opt_ptr(&b.tile_counts, &s), opt_ptr(&b.offsets, &s), opt_ptr(&b.totals, &s));
        let (send, pos) = (opt_ptr(&b.send_keys, &s), opt_ptr(&b.pos, &s));
        let tiles_cfg = grid(n64, TILE as u32)?;
        let mut l = s.launch_builder(&self.f.scan);
        l.arg(&tc).arg(&tiles).arg(&nr).arg(&off).arg(&tot);
        // SAFETY: route_scan reads shards * tiles counts (written by count)
        // and writes as many offsets and `shards` totals.
        unsafe { l.launch(scan_config()) }.map_err(dev_err("launching route_scan"))?;
        let mut l = s.launch_builder(&self.f.scatter);
        l.arg(&keys).arg(&n64).arg(&nr).arg(&dest).arg(&off).arg(&send).arg(&pos);
        // SAFETY: route_scatter writes each of the n keys once into
        // send_keys[0..n] and pos[0..n].
        unsafe { l.launch(tiles_cfg) }.map_err(dev_err("launching route_scatter"))?;
        Ok(())
    }

    /// For the peer route: `masks[d * n + i] = (owner of key i == d)` for
    /// every owner d of `shards`, and the keys per owner into `totals`
    /// (read by [`Node::read_counters_and_totals`]).
    ///
    /// # Safety
    /// As [`Node::partition`].
    pub(super) unsafe fn masks(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
        let s = self.stream.clone();
        let b = &mut self.b;
        ensure(&s, &mut b.masks, n * shards)?;
        ensure(&s, &mut b.totals, MAX_GPUS)?;
        s.memset_zeros(b.totals.as_mut().expect("ensured")).map_err(dev_err("clearing totals"))?;
        if n == 0 {
            return Ok(());
        }
        let (n64, nr) = (n as u64, shards as u32);
        let (masks, tot) = (opt_ptr(&b.masks, &s), opt_ptr(&b.totals, &s));
        let cfg = grid(n64, TILE as u32)?;
        let mut l = s.launch_builder(&self.f.masks);
        l.arg(&keys).arg(&n64).arg(&nr).arg(&masks).arg(&tot);
        // SAFETY: route_masks reads keys[0..n] and writes masks[0..shards * n]
        // and totals[0..shards], sized above.
        unsafe { l.launch(cfg) }.map_err(dev_err("launching route_masks"))?;
        Ok(())
    }

    /// The per-owner key counts of the last [`Node::partition`] (waits for it).
    pub(super) fn totals(&self, shards: usize) -> Result<Vec<u64>> {
        let mut t = vec![0u64; MAX_GPUS];
        let b = self.b.totals.as_ref().expect("partitioned");
        self.stream.memcpy_dtoh(b, &mut t).map_err(dev_err("reading route totals"))?;
        self.stream.synchronize().map_err(dev_err("partitioning a batch"))?;
        t.truncate(shards);
        Ok(t)
    }

    /// `dst[pos[i]] = src[i]` for `n` rows of `dim` floats.
    ///
    /// # Safety
    /// `src` and `dst` hold `n * dim` floats on this GPU; `pos` is the last
    /// partition's, of at least `n` keys.
    pub(super) unsafe fn scatter_values(&self, src: u64, dst: u64, n: usize, dim: usize) -> Result<()> {
        let (f128, w) = Self::row_width(dim);
        let f = if f128 { &self.f.scatter_f128 } else { &self.f.scatter_f32 };
        let pos = opt_ptr(&self.b.pos, &self.stream);
        let n64 = n as u64;
        let (dest, me) = (0u64, u32::MAX);
        let mut l = self.stream.launch_builder(f);
        l.arg(&src).arg(&dst).arg(&pos).arg(&n64).arg(&w).arg(&dest).arg(&me);
        // SAFETY: per the contract, n rows of w words at src and dst.
        unsafe { l.launch(grid(n64 * w, 256)?) }.map_err(dev_err("launching rows_scatter"))?;
        Ok(())
    }

    /// `dst[pos[i]] = src[i]` for `n` u64.
    ///
    /// # Safety
    /// As [`Node::scatter_values`], one u64 per key.
    pub(super) unsafe fn scatter_u64(&self, src: u64, dst: u64, n: usize) -> Result<()> {
        let pos = opt_ptr(&self.b.pos, &self.stream);
        let (n64, w) = (n as u64, 1u64);
        let (dest, me) = (0u64, u32::MAX);
        let mut l = self.stream.launch_builder(&self.f.scatter_u64);
        l.arg(&src).arg(&dst).arg(&pos).arg(&n64).arg(&w).arg(&dest).arg(&me);
        // SAFETY: per the contract, n u64 at src and dst.
        unsafe { l.launch(grid(n64, 256)?) }.map_err(dev_err("launching rows_scatter_u64"))?;
        Ok(())
    }

    /// `dst[i] = src[pos[i]]` for `n` rows of `dim` floats, where `mask` is
    /// 0 or `mask[pos[i]]` is set.
    ///
    /// # Safety
    /// `src` holds `n * dim` floats (and `mask` n bytes) in partition order,
    /// `dst` `n * dim` floats, on this GPU.
    pub(super) unsafe fn gather_values(&self, src: u64, dst: u64, mask: u64, n: usize, dim: usize) -> Result<()> {
        let (f128, w) = Self::row_width(dim);
        let f = if f128 { &self.f.gather_f128 } else { &self.f.gather_f32 };
        let pos = opt_ptr(&self.b.pos, &self.stream);
        let n64 = n as u64;
        let (dest, me) = (0u64, u32::MAX);
        let mut l = self.stream.launch_builder(f);
        l.arg(&src).arg(&dst).arg(&pos).arg(&mask).arg(&n64).arg(&w).arg(&dest).arg(&me);
        // SAFETY: per the contract.
        unsafe { l.launch(grid(n64 * w, 256)?) }.map_err(dev_err("launching rows_gather"))?;
        Ok(())
    }

    /// `dst[i] = src[pos[i]]` for `n` bytes.
    ///
    /// # Safety
    /// `src` and `dst` hold `n` bytes on this GPU.
    pub(super) unsafe fn gather_u8(&self, src: u64, dst: u64, n: usize) -> Result<()> {
        let pos = opt_ptr(&self.b.pos, &self.stream);
        let (n64, w, mask) = (n as u64, 1u64, 0u64);
        let (dest, me) = (0u64, u32::MAX);
        let mut l = self.stream.launch_builder(&self.f.gather_u8);
        l.arg(&src).arg(&dst).arg(&pos).arg(&mask).arg(&n64).arg(&w).arg(&dest).arg(&me);
        // SAFETY: per the contract.
        unsafe { l.launch(grid(n64, 256)?) }.map_err(dev_err("launching rows_gather_u8"))?;
        Ok(())
    }

    /// The counters of the last batch; with `local`, added to those of its
    /// in-place part. One wait for the stream.
    pub(super) fn read_counters_with(&self, local: bool) -> Result<Vec<u64>> {
        let mut out = [0u64; 16];
        let (a, b) = out.split_at_mut(8);
        let s = &self.stream;
        s.memcpy_dtoh(self.b.counters.as_ref().expect("allocated"), a).map_err(dev_err("reading counters"))?;
        if local {
            let l = self.b.local_counters.as_ref().expect("allocated");
            s.memcpy_dtoh(l, b).map_err(dev_err("reading counters"))?;
        }
        s.synchronize().map_err(dev_err("finishing a batch"))?;
        let (a, b) = out.split_at(8);
        Ok(a.iter().zip(b).map(|(x, y)| x + y).collect())
    }

    /// The counters of the last batch and the per-owner totals of the last
    /// [`Node::masks`] (or partition), with one wait for the stream.
    pub(super) fn read_counters_and_totals(&self, shards: usize) -> Result<(Vec<u64>, Vec<u64>)> {
        let (mut c, mut t) = (vec![0u64; 8], vec![0u64; MAX_GPUS]);
        let s = &self.stream;
        s.memcpy_dtoh(self.b.counters.as_ref().expect("allocated"), &mut c).map_err(dev_err("reading counters"))?;
        s.memcpy_dtoh(self.b.totals.as_ref().expect("allocated"), &mut t).map_err(dev_err("reading totals"))?;
        s.synchronize().map_err(dev_err("finishing a batch"))?;
        t.truncate(shards);
        Ok((c, t))
    }

    /// The batch of received keys: keys, rows, found flags (and scores, for
    /// loads) at the recv buffers (none where a buffer is missing), with
    /// `counters`.
    pub(super) fn recv_raw(&self, counters: DevPtr<u64>, scores: bool) -> Raw {
        let (s, b) = (&self.stream, &self.b);
        Raw {
            p: Ptrs {
                keys: DevPtr::of_opt(&b.recv_keys, s),
                values: DevPtr::of_opt(&b.recv_values, s),
                found: DevPtr::of_opt(&b.recv_found, s),
                scores: if scores { DevPtr::of_opt(&b.recv_scores, s) } else { None },
                counters: Some(counters),
                ..Ptrs::default()
            },
            ..Raw::default()
        }
    }

    pub(super) fn read_counters(&self) -> Result<Vec<u64>> {
        self.read_counters_with(false)
    }

    pub(super) fn zero_counters(&mut self) -> Result<DevPtr<u64>> {
        let c = self.b.counters.as_mut().expect("allocated");
        self.stream.memset_zeros(c).map_err(dev_err("clearing counters"))?;
        Ok(DevPtr::of(c, &self.stream))
    }

    pub(super) fn zero_local_counters(&mut self) -> Result<DevPtr<u64>> {
        let c = self.b.local_counters.as_mut().expect("allocated");
        self.stream.memset_zeros(c).map_err(dev_err("clearing counters"))?;
        Ok(DevPtr::of(c, &self.stream))
    }
}
