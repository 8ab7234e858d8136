//! A table spread over several GPUs of one host, with NCCL between them.
//!
//! A [`GpuGroup`] holds one [`CudaTable`] per GPU; a key belongs to GPU
//! `hash::shard_of(key, gpus)`, the mix the daemon's router uses, so a
//! group and a daemon with one shard per GPU agree on every key's owner.
//!
//! Batches that already sit on the GPUs (in-process callers, keys hashed
//! from raw features on the GPU: [`GpuGroup::hash_features`]) take one of
//! two device-resident paths:
//! - [`Route::Peer`] (the default for lookups, [`Route::Auto`], where every
//!   pair of GPUs has peer access): a mask kernel marks each key's owner; each GPU
//!   serves its own batch's keys in place while it pulls every other
//!   batch's keys and masks (and the rows of writes) with copy-engine
//!   transfers and serves the keys it owns there, on a second stream. Found
//!   rows and flags are written straight into the requesting GPU's batch
//!   over the link, already in request order: no split, no gather, no host
//!   round trip before the lookups.
//! - [`Route::Device`] (the default for writes): each GPU splits its keys by owner on the GPU (a
//!   stable partition, `kernels/route.cu`); only the per-owner counts cross
//!   to the host. Each GPU then serves its own keys in place on a second
//!   stream while NCCL (grouped sends and receives, one all-to-all) carries
//!   the other keys and rows to their owners, who serve them too; a second
//!   all-to-all carries results back and a gather kernel puts them in
//!   request order.
//!
//! On the H200 pair the peer route ran finds in 0.41–0.47 ms against
//! 0.64–0.69 ms on the device route, and the device route insert_or_assign
//! in 1.01–1.09 ms against 1.11–1.16 ms on the peer route (four runs of
//! `hkv-multi-bench`, see `daemon/BENCHMARKS.md`), so [`Route::Auto`] sends
//! lookups (find, find*, contains) the peer way and every other operation
//! the device way. find_or_insert on the peer route would also read its
//! rows over the link while holding bucket locks (insert_or_assign did so
//! at 22 ms a batch before its rows were pulled first).
//! [`Route::Host`] does what the daemon's router does with a socket batch:
//! copy to the host, split there, copy each part to its owner and back; it
//! is kept for comparison (`hkv-multi-bench`).
//!
//! [`GpuGroup::reshard`] moves every entry of a group onto another set of
//! GPUs, GPU to GPU: each old GPU exports its entries in chunks, splits them
//! by their new owner and sends them over one communicator spanning both
//! sets; the new owners load them with their scores kept.
//!
//! NCCL is loaded at run time; [`nccl_version`] says whether it can be, and
//! a one-GPU group never touches it. Keep NVLink multicast off
//! (`NCCL_NVLS_ENABLE=0`): binaries set [`NCCL_ENV_DEFAULTS`] in `main`.
//!
//! # Layout
//! - [`GpuGroup`]: construction, [`GpuGroup::batch`], [`GpuGroup::run`],
//!   [`GpuGroup::reshard`].
//! - `Node`: one GPU's stream, route kernels and scratch buffers, and the
//!   masks / partition / all-to-all / gather steps the paths share.
//! - `peer_access`: enables peer access (contexts and the stream-ordered
//!   pool) between every pair.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DeviceRepr, PushKernelArg};
use cudarc::nccl::{group_end, group_start, Comm, NcclType};
use hkv_kernels::KernelId;
use parking_lot::Mutex;

use crate::config::TableConfig;
use crate::cuda::table::{opt_ptr, ptr, scan_config, Counts, CudaTable, DeviceOp, Pending, Ptrs, Raw};
use crate::cuda::{dev_err, ensure, grid, shared_device, Device, FeatureHasher};
use crate::error::{Error, Result};
use crate::features::{Features, HashKind};
use crate::hash::shard_of;
use crate::{Filter, Shard, BUCKET_SLOTS};

/// Most GPUs in a group (the route kernels count per destination in
/// shared memory).
pub const MAX_GPUS: usize = 8;
const TILE: u64 = 1024;
/// Slots exported per GPU per round while resharding.
const RESHARD_CHUNK: u64 = 1 << 20;

/// The NCCL version (e.g. 22803 for 2.28.3), or a clear error when the
/// library cannot be loaded. Never panics.
pub fn nccl_version() -> Result<i32> {
    // SAFETY: only tries to load the library; no NCCL call is made.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        let so2 = ["/usr/lib/x86_64-linux-gnu/libnccl.so.2", "/usr/lib64/libnccl.so.2", "/usr/local/lib/libnccl.so.2"]
            .iter()
            .find(|p| std::path::Path::new(p).exists());
        let hint = match so2 {
            Some(p) => format!(
                "; {p} exists but only libnccl.so is looked for: link libnccl.so to it in a directory on LD_LIBRARY_PATH"
            ),
            None => String::new(),
        };
        return Err(Error::Unavailable(format!("NCCL (libnccl.so) cannot be loaded{hint}")));
    }
    cudarc::nccl::result::get_nccl_version().map_err(|e| Error::Device(format!("ncclGetVersion: {e:?}")))
}

fn nccl_err(what: &str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> Error + '_ {
    move |e| Error::Device(format!("NCCL {what}: {e:?}"))
}

/// How a group batch reaches the GPUs that own its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Route {
    /// For lookups (find, find*, contains) [`Route::Peer`] where every pair
    /// of GPUs has peer access; for every other operation, and without peer
    /// access, [`Route::Device`]. The default: the faster of the two for
    /// each on the H200 pair.
    #[default]
    Auto,
    /// Split on the GPU, NCCL all-to-all there and back.
    Device,
    /// Copy to the host, split there, copy each part to its owner and back.
    Host,
    /// No split and no exchange: each GPU serves the keys it owns straight
    /// out of every GPU's batch, reading keys and rows and writing results
    /// over NVLink (CUDA peer access), in request order where they are.
    /// Needs peer access between every pair ([`GpuGroup::peer_access`]).
    Peer,
}

/// One GPU's part of a group batch: buffers on that GPU, sized for `n` keys.
pub struct RankBatch {
    /// Capacity in keys.
    pub n: usize,
    /// Keys in.
    pub keys: CudaSlice<u64>,
    /// Values in (writes) or out (find, find_or_insert), `n * dim`.
    pub values: CudaSlice<f32>,
    /// Found flags out (find, contains), erased flags (erase).
    pub found: CudaSlice<u8>,
}

/// What [`GpuGroup::run`] did.
#[derive(Debug, Clone, Default)]
pub struct GroupRun {
    /// Wall time of the whole batch, every GPU finished, in milliseconds.
    pub ms: f64,
    /// Counts summed over the owners.
    pub counts: Counts,
}

struct RouteFns {
    count: CudaFunction,
    scan: CudaFunction,
    scatter: CudaFunction,
    masks: CudaFunction,
    scatter_u64: CudaFunction,
    gather_u8: CudaFunction,
    scatter_f32: CudaFunction,
    gather_f32: CudaFunction,
    scatter_f128: CudaFunction,
    gather_f128: CudaFunction,
}

impl RouteFns {
    fn load(dev: &Device) -> Result<RouteFns> {
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
struct Bufs {
    dest: Option<CudaSlice<u8>>,
    masks: Option<CudaSlice<u8>>,
    pulled_keys: Option<CudaSlice<u64>>,
    pulled_only: Option<CudaSlice<u8>>,
    pulled_values: Option<CudaSlice<f32>>,
    tile_counts: Option<CudaSlice<u32>>,
    offsets: Option<CudaSlice<u64>>,
    totals: Option<CudaSlice<u64>>,
    pos: Option<CudaSlice<u32>>,
    send_keys: Option<CudaSlice<u64>>,
    send_values: Option<CudaSlice<f32>>,
    send_scores: Option<CudaSlice<u64>>,
    send_found: Option<CudaSlice<u8>>,
    recv_keys: Option<CudaSlice<u64>>,
    recv_values: Option<CudaSlice<f32>>,
    recv_scores: Option<CudaSlice<u64>>,
    recv_found: Option<CudaSlice<u8>>,
    counters: Option<CudaSlice<u64>>,
    local_counters: Option<CudaSlice<u64>>,
    ex_counts: Option<CudaSlice<u32>>,
    ex_offsets: Option<CudaSlice<u64>>,
}

/// One GPU of a group: its stream (also its communicator's), route kernels
/// and scratch.
struct Node {
    dev: Arc<Device>,
    stream: Arc<CudaStream>,
    /// Serves the parts of a device-route batch while `stream` moves them.
    serve: Arc<CudaStream>,
    f: RouteFns,
    b: Bufs,
    hasher: Option<FeatureHasher>,
    /// Host buffers of the host route: this GPU as a batch's source, and as
    /// the owner of keys.
    host: (HostSource, HostOwner),
}

/// A GPU's batch on the host (host route), and its results in request order.
#[derive(Default)]
struct HostSource {
    keys: Vec<u64>,
    values: Vec<f32>,
    out_found: Vec<u8>,
    out_rows: Vec<f32>,
}

/// The keys a GPU owns in a host-route batch, where each came from, and
/// what its table answered.
#[derive(Default)]
struct HostOwner {
    keys: Vec<u64>,
    values: Vec<f32>,
    origin: Vec<(u32, u32)>,
    found: Vec<u8>,
    rows: Vec<f32>,
}

/// Exclusive prefix sums of a row of counts.
fn starts(c: &[u64]) -> Vec<u64> {
    c.iter()
        .scan(0, |acc, &x| {
            let s = *acc;
            *acc += x;
            Some(s)
        })
        .collect()
}

impl Node {
    fn new(dev: &Arc<Device>) -> Result<Node> {
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
    fn row_width(dim: usize) -> (bool, u64) {
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
    unsafe fn partition(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
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
    unsafe fn count(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
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
    unsafe fn place(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
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
    unsafe fn masks(&mut self, keys: u64, n: usize, shards: usize) -> Result<()> {
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
    fn totals(&self, shards: usize) -> Result<Vec<u64>> {
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
    unsafe fn scatter_values(&self, src: u64, dst: u64, n: usize, dim: usize) -> Result<()> {
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
    unsafe fn scatter_u64(&self, src: u64, dst: u64, n: usize) -> Result<()> {
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
    unsafe fn gather_values(&self, src: u64, dst: u64, mask: u64, n: usize, dim: usize) -> Result<()> {
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
    unsafe fn gather_u8(&self, src: u64, dst: u64, n: usize) -> Result<()> {
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
    fn read_counters_with(&self, local: bool) -> Result<Vec<u64>> {
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
    fn read_counters_and_totals(&self, shards: usize) -> Result<(Vec<u64>, Vec<u64>)> {
        let (mut c, mut t) = (vec![0u64; 8], vec![0u64; MAX_GPUS]);
        let s = &self.stream;
        s.memcpy_dtoh(self.b.counters.as_ref().expect("allocated"), &mut c).map_err(dev_err("reading counters"))?;
        s.memcpy_dtoh(self.b.totals.as_ref().expect("allocated"), &mut t).map_err(dev_err("reading totals"))?;
        s.synchronize().map_err(dev_err("finishing a batch"))?;
        t.truncate(shards);
        Ok((c, t))
    }

    /// The batch of received keys: keys, rows, found flags (and scores, for
    /// loads) at the recv buffers (0 where a buffer is missing), with
    /// `counters`.
    fn recv_raw(&self, counters: u64, scores: bool) -> Raw {
        let (s, b) = (&self.stream, &self.b);
        Raw {
            p: Ptrs {
                keys: opt_ptr(&b.recv_keys, s),
                values: opt_ptr(&b.recv_values, s),
                found: opt_ptr(&b.recv_found, s),
                scores: if scores { opt_ptr(&b.recv_scores, s) } else { 0 },
                counters,
                ..Ptrs::default()
            },
            ..Raw::default()
        }
    }

    fn read_counters(&self) -> Result<Vec<u64>> {
        self.read_counters_with(false)
    }

    fn zero_counters(&mut self) -> Result<u64> {
        let c = self.b.counters.as_mut().expect("allocated");
        self.stream.memset_zeros(c).map_err(dev_err("clearing counters"))?;
        Ok(ptr(c, &self.stream))
    }

    fn zero_local_counters(&mut self) -> Result<u64> {
        let c = self.b.local_counters.as_mut().expect("allocated");
        self.stream.memset_zeros(c).map_err(dev_err("clearing counters"))?;
        Ok(ptr(c, &self.stream))
    }
}

/// Which buffer of a node an exchange reads or fills.
#[derive(Clone, Copy)]
enum Buf {
    SendKeys,
    SendValues,
    SendScores,
    SendFound,
    RecvKeys,
    RecvValues,
    RecvScores,
    RecvFound,
}

/// Who sends what to whom in one all-to-all: rank r sends `lens[r][p] * w`
/// elements of its source buffer, from `send_at[r][p] * w`, to rank p,
/// which receives them into its target buffer at `recv_at[p][r] * w`;
/// target buffers are grown to `recv_size[r] * w` first.
#[derive(Debug, Clone)]
struct Plan {
    lens: Vec<Vec<u64>>,
    send_at: Vec<Vec<u64>>,
    recv_at: Vec<Vec<u64>>,
    recv_size: Vec<u64>,
}

impl Plan {
    /// Segments packed in peer order on both sides, skipping each rank's
    /// own segment when `skip_self` (a rank serves its own keys in place).
    fn packed(c: &[Vec<u64>], skip_self: bool) -> Plan {
        let nr = c.len();
        let lens: Vec<Vec<u64>> =
            (0..nr).map(|r| (0..nr).map(|p| if skip_self && p == r { 0 } else { c[r][p] }).collect()).collect();
        let send_at = c.iter().map(|row| starts(row)).collect();
        let cols: Vec<Vec<u64>> = (0..nr).map(|r| (0..nr).map(|p| lens[p][r]).collect()).collect();
        let recv_at = cols.iter().map(|col| starts(col)).collect();
        let recv_size: Vec<u64> = cols.iter().map(|col| col.iter().sum()).collect();
        Plan { lens, send_at, recv_at, recv_size }
    }

    /// The way back: what was received returns to where it was sent from,
    /// into buffers of `sizes[r]` keys.
    fn back(&self, sizes: &[u64]) -> Plan {
        let nr = self.lens.len();
        let t = |m: &Vec<Vec<u64>>| -> Vec<Vec<u64>> { (0..nr).map(|r| (0..nr).map(|p| m[p][r]).collect()).collect() };
        Plan {
            lens: t(&self.lens),
            send_at: self.recv_at.clone(),
            recv_at: self.send_at.clone(),
            recv_size: sizes.to_vec(),
        }
    }
}

/// All-to-alls of one plan over `comms` (rank r on `nodes[r]`), in one
/// NCCL group: `(w, from, to)` each, `w` elements per key from each node's
/// `from` buffer into its `to`.
fn exchange_many(comms: &[Comm], nodes: &mut [&mut Node], plan: &Plan, arrays: &[(usize, Buf, Buf)]) -> Result<()> {
    let nr = nodes.len();
    for &(w, _, to) in arrays {
        ensure_target(nodes, plan, w, to)?;
    }
    group_start().map_err(nccl_err("group start"))?;
    let mut result = Ok(());
    for &(w, from, to) in arrays {
        for r in 0..nr {
            let b = &mut nodes[r].b;
            for p in 0..nr {
                let res = send_recv_buf(&comms[r], p, b, plan, r, w, from, to);
                if result.is_ok() {
                    result = res;
                }
            }
        }
    }
    group_end().map_err(nccl_err("group end"))?;
    result
}

/// Grows each node's `to` buffer to the plan's `recv_size * w`.
fn ensure_target(nodes: &mut [&mut Node], plan: &Plan, w: usize, to: Buf) -> Result<()> {
    for (r, node) in nodes.iter_mut().enumerate() {
        let need = plan.recv_size[r] as usize * w;
        let s = node.stream.clone();
        let b = &mut node.b;
        match to {
            Buf::RecvKeys => ensure(&s, &mut b.recv_keys, need)?,
            Buf::RecvValues => ensure(&s, &mut b.recv_values, need)?,
            Buf::RecvScores => ensure(&s, &mut b.recv_scores, need)?,
            Buf::RecvFound => ensure(&s, &mut b.recv_found, need)?,
            Buf::SendValues => ensure(&s, &mut b.send_values, need)?,
            Buf::SendFound => ensure(&s, &mut b.send_found, need)?,
            Buf::SendKeys => ensure(&s, &mut b.send_keys, need)?,
            Buf::SendScores => ensure(&s, &mut b.send_scores, need)?,
        }
    }
    Ok(())
}

/// Queues rank r's part of one array's all-to-all with peer `p`.
#[allow(clippy::too_many_arguments)]
fn send_recv_buf(
    comm: &Comm,
    p: usize,
    b: &mut Bufs,
    plan: &Plan,
    r: usize,
    w: usize,
    from: Buf,
    to: Buf,
) -> Result<()> {
    let (so, sn) = (plan.send_at[r][p] as usize * w, plan.lens[r][p] as usize * w);
    let (ro, rn) = (plan.recv_at[r][p] as usize * w, plan.lens[p][r] as usize * w);
    match (from, to) {
        (Buf::SendKeys, Buf::RecvKeys) => send_recv(comm, p, &b.send_keys, so, sn, &mut b.recv_keys, ro, rn),
        (Buf::SendValues, Buf::RecvValues) => send_recv(comm, p, &b.send_values, so, sn, &mut b.recv_values, ro, rn),
        (Buf::SendScores, Buf::RecvScores) => send_recv(comm, p, &b.send_scores, so, sn, &mut b.recv_scores, ro, rn),
        (Buf::RecvValues, Buf::SendValues) => send_recv(comm, p, &b.recv_values, so, sn, &mut b.send_values, ro, rn),
        (Buf::RecvFound, Buf::SendFound) => send_recv(comm, p, &b.recv_found, so, sn, &mut b.send_found, ro, rn),
        _ => unreachable!("no such exchange"),
    }
}

/// Queues (inside a group) rank `comm`'s send of `sn` elements of `from`
/// at `so` to `peer` and its receive of `rn` elements into `to` at `ro`.
#[allow(clippy::too_many_arguments)]
fn send_recv<T: NcclType + DeviceRepr>(
    comm: &Comm,
    peer: usize,
    from: &Option<CudaSlice<T>>,
    so: usize,
    sn: usize,
    to: &mut Option<CudaSlice<T>>,
    ro: usize,
    rn: usize,
) -> Result<()> {
    if sn > 0 {
        let f = from.as_ref().expect("sized");
        comm.send(&f.slice(so..so + sn), peer as i32).map_err(nccl_err("send"))?;
    }
    if rn > 0 {
        let t = to.as_mut().expect("sized");
        comm.recv(&mut t.slice_mut(ro..ro + rn), peer as i32).map_err(nccl_err("recv"))?;
    }
    Ok(())
}

/// Keeps the first part of a batch (it holds the lock group) and folds
/// later parts into it.
fn fold<'a>(first: &mut Option<Pending<'a>>, p: Pending<'a>) {
    match first {
        Some(f) => f.absorb(p),
        None => *first = Some(p),
    }
}

/// What an op moves: rows to the owners, rows and flags back.
struct Moves {
    values_in: bool,
    values_out: bool,
    found_out: bool,
    /// Misses leave the caller's rows untouched (find).
    masked: bool,
}

fn moves(op: DeviceOp) -> Result<Moves> {
    let m = |values_in, values_out, found_out, masked| Ok(Moves { values_in, values_out, found_out, masked });
    match op {
        DeviceOp::Find => m(false, true, true, true),
        DeviceOp::Contains | DeviceOp::Erase => m(false, false, true, false),
        DeviceOp::InsertOrAssign | DeviceOp::Assign => m(true, false, false, false),
        DeviceOp::FindOrInsert => m(true, true, false, false),
        other => Err(Error::Config(format!("{other:?} is not offered on a GPU group"))),
    }
}

/// A table over several GPUs. See the module docs.
pub struct GpuGroup {
    config: TableConfig,
    ordinals: Vec<usize>,
    tables: Vec<CudaTable>,
    comms: Vec<Comm>,
    nodes: Mutex<Vec<Node>>,
    /// Every GPU of the group can read and write every other's memory.
    peer: bool,
}

// SAFETY: the NCCL communicators (raw handles, hence not Send / Sync by
// themselves) are only used while `nodes` is locked, so never by two
// threads at once; NCCL allows a communicator to be used from any thread
// under that condition. Everything else is Send + Sync.
unsafe impl Send for GpuGroup {}
// SAFETY: as above.
unsafe impl Sync for GpuGroup {}

impl std::fmt::Debug for GpuGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuGroup").field("ordinals", &self.ordinals).field("config", &self.config).finish()
    }
}

/// NCCL settings a process should have in its environment before its
/// first group, each unless already set. The library sets no variable (it
/// cannot do so safely once threads run): a binary sets these in `main`
/// before it starts any thread.
/// - `NCCL_P2P_NVL_CHUNKSIZE=2097152`: 2 MiB chunks over NVLink, 9 % faster
///   all-to-all of a 1 Mi-key batch than NCCL's 512 KiB on the H200 pair.
/// - `NCCL_NVLS_ENABLE=0`: NVLink multicast, not needed here, can take the
///   GPUs of a shared host out of service.
pub const NCCL_ENV_DEFAULTS: [(&str, &str); 2] = [("NCCL_P2P_NVL_CHUNKSIZE", "2097152"), ("NCCL_NVLS_ENABLE", "0")];

/// NCCL communicators over `nodes` (one rank each, on the node's stream).
fn communicators(nodes: &[Node]) -> Result<Vec<Comm>> {
    nccl_version()?;
    Comm::from_devices(nodes.iter().map(|n| n.stream.clone()).collect()).map_err(nccl_err("creating communicators"))
}

/// Enables peer access between every pair of `nodes`' GPUs, for plain
/// allocations and for the stream-ordered pool the batches come from; false
/// when a pair has none (the peer route is then refused, the others work).
fn peer_access(nodes: &[Node]) -> bool {
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
    /// One table of `config` on each GPU of `ordinals` (distinct, at most
    /// [`MAX_GPUS`]); the capacity is per GPU. NCCL is needed for two or more,
    /// with [`NCCL_ENV_DEFAULTS`] in the environment.
    pub fn new(config: TableConfig, ordinals: &[usize]) -> Result<GpuGroup> {
        if ordinals.is_empty() || ordinals.len() > MAX_GPUS {
            return Err(Error::Config(format!("a GPU group has 1 to {MAX_GPUS} GPUs, not {}", ordinals.len())));
        }
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() {
            return Err(Error::Config(format!("GPU {ordinals:?}: each GPU may appear once in a group")));
        }
        let mut tables = vec![];
        let mut nodes = vec![];
        for &o in ordinals {
            let dev = shared_device(o)?;
            tables.push(CudaTable::new(config.clone(), dev.clone())?);
            nodes.push(Node::new(&dev)?);
        }
        let comms = if ordinals.len() > 1 { communicators(&nodes)? } else { vec![] };
        let peer = peer_access(&nodes);
        Ok(GpuGroup { config, ordinals: ordinals.to_vec(), tables, comms, nodes: Mutex::new(nodes), peer })
    }

    /// Forces (or frees) the kernel choice of every GPU's table (benchmarks).
    pub fn set_tuning(&mut self, t: crate::config::CudaTuning) -> Result<()> {
        self.tables.iter_mut().try_for_each(|tb| tb.set_tuning(t))
    }

    /// Whether [`Route::Peer`] can run: every pair of the group's GPUs has
    /// peer access (NVLink or PCIe), enabled when the group was made.
    pub fn peer_access(&self) -> bool {
        self.peer
    }

    /// The GPUs, in rank order.
    pub fn ordinals(&self) -> &[usize] {
        &self.ordinals
    }

    /// The tables, in rank order (the one on GPU `ordinals()[r]` holds the
    /// keys with `shard_of(key, gpus) == r`).
    pub fn tables(&self) -> &[CudaTable] {
        &self.tables
    }

    /// Entries over every GPU.
    pub fn size(&self) -> u64 {
        self.tables.iter().map(|t| t.size()).sum()
    }

    /// The stream every operation of rank `r` runs on: fill a
    /// [`RankBatch`] on it (or synchronise with it) before [`GpuGroup::run`].
    pub fn stream(&self, r: usize) -> Arc<CudaStream> {
        self.nodes.lock()[r].stream.clone()
    }

    /// Hashes raw `features` on GPU `r` (as
    /// [`crate::features::hash_features_cpu`]) into the first keys of
    /// `b.keys`, where they stay for [`GpuGroup::run`]: the keys of a
    /// feature batch never visit the host. Returns the number of keys.
    pub fn hash_features(
        &self,
        r: usize,
        features: Features<'_>,
        kind: HashKind,
        num_buckets: u64,
        b: &mut RankBatch,
    ) -> Result<usize> {
        let mut nodes = self.nodes.lock();
        let node = nodes
            .get_mut(r)
            .ok_or_else(|| Error::Config(format!("no rank {r} in a group of {}", self.tables.len())))?;
        if node.hasher.is_none() {
            node.hasher = Some(FeatureHasher::new(&node.dev)?);
        }
        let n = features.len();
        if n > b.n {
            return Err(Error::Config(format!("{n} features for a batch of {}", b.n)));
        }
        node.hasher.as_mut().expect("made").hash_on_device(features, kind, num_buckets, &mut b.keys)?;
        Ok(n)
    }

    /// Buffers for batches of up to `n` keys on every GPU, in rank order.
    pub fn batch(&self, n: usize) -> Result<Vec<RankBatch>> {
        let nodes = self.nodes.lock();
        let dim = self.config.dim;
        nodes
            .iter()
            .map(|node| {
                let s = &node.stream;
                let a = |e| dev_err("allocating a group batch")(e);
                Ok(RankBatch {
                    n,
                    keys: s.alloc_zeros(n.max(1)).map_err(a)?,
                    values: s.alloc_zeros((n * dim).max(1)).map_err(a)?,
                    found: s.alloc_zeros(n.max(1)).map_err(a)?,
                })
            })
            .collect()
    }

    /// Runs `op` (find, contains, insert_or_assign, find_or_insert, assign
    /// or erase) on the first `n[r]` keys of each `b[r]`: every key is served
    /// by the GPU that owns it and the results land in `b[r]` in request
    /// order, as the single-GPU `run_device` leaves them. Returns when every
    /// GPU is done.
    pub fn run(&self, op: DeviceOp, route: Route, b: &mut [RankBatch], n: &[usize]) -> Result<GroupRun> {
        let mv = moves(op)?;
        let nr = self.tables.len();
        if b.len() != nr || n.len() != nr {
            return Err(Error::Config(format!("{} batches and {} lengths for {nr} GPUs", b.len(), n.len())));
        }
        if let Some(r) = (0..nr).find(|&r| n[r] > b[r].n) {
            return Err(Error::Config(format!("{} keys for a batch of {} on rank {r}", n[r], b[r].n)));
        }
        let mut nodes = self.nodes.lock();
        let t0 = Instant::now();
        let counts = if nr == 1 {
            self.run_local(op, &mut nodes[0], &mut b[0], n[0])?
        } else {
            let route = match route {
                Route::Auto if self.peer && matches!(op, DeviceOp::Find | DeviceOp::FindPtr | DeviceOp::Contains) => {
                    Route::Peer
                }
                Route::Auto => Route::Device,
                r => r,
            };
            match route {
                Route::Auto | Route::Device => self.run_nccl(op, &mv, &mut nodes, b, n)?,
                Route::Host => self.run_host(op, &mv, &mut nodes, b, n)?,
                Route::Peer => self.run_peer(op, &mut nodes, b, n)?,
            }
        };
        Ok(GroupRun { ms: t0.elapsed().as_secs_f64() * 1e3, counts })
    }

    /// One GPU: the batch goes straight to its table.
    fn run_local(&self, op: DeviceOp, node: &mut Node, b: &mut RankBatch, n: usize) -> Result<Counts> {
        let s = node.stream.clone();
        let counters = node.zero_counters()?;
        let raw = Raw {
            p: Ptrs {
                keys: ptr(&b.keys, &s),
                values: ptr(&b.values, &s),
                found: ptr(&b.found, &s),
                counters,
                ..Ptrs::default()
            },
            ..Raw::default()
        };
        // SAFETY: the batch's buffers hold b.n >= n keys (n × dim floats) on
        // this GPU, and the stream is synchronised by read_counters.
        let pending = unsafe { self.tables[0].enqueue(op, &s, n, raw) }?;
        let c = node.read_counters()?;
        Ok(self.tables[0].complete(pending, &c))
    }

    /// Enqueues `op` on every rank over what it received (`recv_*`).
    fn serve<'a>(&'a self, op: DeviceOp, nodes: &mut [Node], received: &[u64]) -> Result<Vec<Pending<'a>>> {
        let dim = self.config.dim;
        let mut pending = vec![];
        for (r, node) in nodes.iter_mut().enumerate() {
            let m = received[r] as usize;
            let s = node.stream.clone();
            ensure(&s, &mut node.b.recv_keys, m)?;
            ensure(&s, &mut node.b.recv_values, m * dim)?;
            ensure(&s, &mut node.b.recv_found, m)?;
            let counters = node.zero_counters()?;
            let raw = node.recv_raw(counters, false);
            // SAFETY: the recv buffers were sized for the m keys (m × dim
            // floats) this rank received. Each stream is synchronised by
            // read_counters before the buffers change.
            pending.push(unsafe { self.tables[r].enqueue(op, &s, m, raw) }?);
        }
        Ok(pending)
    }

    fn finish(&self, nodes: &[Node], pending: Vec<Pending<'_>>) -> Result<Counts> {
        let mut total = Counts::default();
        for (r, p) in pending.into_iter().enumerate() {
            let c = nodes[r].read_counters()?;
            total = total.merge(self.tables[r].complete(p, &c));
        }
        Ok(total)
    }

    /// The device route: each GPU splits its keys by owner on the GPU and
    /// serves its own part (staged by the split) on its serve stream while
    /// NCCL carries the other parts to their owners, who serve them too; a
    /// second all-to-all brings the results back and a gather restores
    /// request order.
    fn run_nccl(
        &self,
        op: DeviceOp,
        mv: &Moves,
        nodes: &mut [Node],
        b: &mut [RankBatch],
        n: &[usize],
    ) -> Result<Counts> {
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
        // Each GPU's own keys are served once the exchange is queued: NCCL's
        // kernels take their SMs before the table's kernel fills the rest.
        // Until `pending` completes, each holds its table's lock group, and
        // waits for its streams if dropped on an error path.
        let incoming: usize = n.iter().sum();
        let mut pending: Vec<Pending<'_>> = Vec::with_capacity(nr);
        for (r, node) in nodes.iter().enumerate() {
            let (s, sv, bf) = (&node.stream, &node.serve, &node.b);
            sv.wait(&placed[r]).map_err(dev_err("ordering streams"))?;
            let at = plan.send_at[r][r];
            let p = Ptrs {
                keys: opt_ptr(&bf.send_keys, s) + at * 8,
                values: opt_ptr(&bf.send_values, s) + at * dim as u64 * 4,
                found: opt_ptr(&bf.send_found, s) + at,
                counters: opt_ptr(&bf.local_counters, s),
                ..Ptrs::default()
            };
            // SAFETY: [at, at + c[r][r]) of the send buffers holds this
            // GPU's own keys and rows, and its results land there; the serve
            // stream waits for the split (`placed`) and the main stream
            // joins it before the end.
            let raw = Raw { p, ..Raw::default() };
            pending.push(unsafe { self.tables[r].enqueue_first(op, sv, c[r][r] as usize, raw, incoming) }?);
        }
        for (r, node) in nodes.iter().enumerate() {
            let (s, sv) = (&node.stream, &node.serve);
            sv.join(s).map_err(dev_err("ordering streams"))?;
            let raw = node.recv_raw(opt_ptr(&node.b.counters, s), false);
            // SAFETY: the received keys (rows) fill the recv buffers, sized
            // above; the serve stream waits for their arrival and is joined
            // before the end.
            let part = unsafe { self.tables[r].enqueue_held(op, sv, plan.recv_size[r] as usize, raw) }?;
            pending[r].absorb(part);
        }
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
            // partition order (sized above), b[r] n[r] keys.
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

    /// The peer route: each owner serves its keys of every GPU's batch in
    /// place, over peer pointers, filtered by the batch's owner masks.
    fn run_peer(&self, op: DeviceOp, nodes: &mut [Node], b: &mut [RankBatch], n: &[usize]) -> Result<Counts> {
        if !self.peer {
            return Err(Error::Unavailable(format!(
                "GPUs {:?}: not every pair has peer access; use the device route",
                self.ordinals
            )));
        }
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
        let incoming: usize = n.iter().sum();
        let mut pending: Vec<Option<Pending<'_>>> = (0..nr).map(|_| None).collect();
        // Rows the owner only reads are pulled with the keys; rows it writes
        // (find, find_or_insert) are written straight into the batch.
        let mv = moves(op)?;
        let pull_values = mv.values_in && !mv.values_out;
        let dim = self.config.dim;
        // Addresses of every batch and its masks, on its own GPU.
        let addr: Vec<(u64, u64, u64, u64)> = nodes
            .iter()
            .enumerate()
            .map(|(q, nd)| {
                let sq = &nd.stream;
                (ptr(&b[q].keys, sq), ptr(&b[q].values, sq), ptr(&b[q].found, sq), opt_ptr(&nd.b.masks, sq))
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
            let counters = opt_ptr(&node.b.counters, &s);
            let (pk, po, pv) = (
                opt_ptr(&node.b.pulled_keys, &s),
                opt_ptr(&node.b.pulled_only, &s),
                opt_ptr(&node.b.pulled_values, &s),
            );
            let mut at = 0u64;
            // Its own batch first, then the others'.
            for q in (0..nr).map(|k| (r + k) % nr) {
                let st = if q == r { &s } else { &other };
                let (keys, values, found, masks) = addr[q];
                let mut p = Ptrs { keys, values, found, only: masks + (r * n[q]) as u64, counters, ..Ptrs::default() };
                if q != r && n[q] > 0 {
                    let cp = |dst: u64, src: u64, bytes: usize| {
                        // SAFETY: both ranges are live device buffers of
                        // `bytes` (sized above / the caller's batch), on the
                        // contexts named; the stream orders the copy.
                        unsafe {
                            cudarc::driver::result::memcpy_peer_async(ctxs[r], dst, ctxs[q], src, bytes, st.cu_stream())
                        }
                        .map_err(dev_err("copying from a peer"))
                    };
                    // Keys and masks are read many times per key (remote
                    // loads would sit on each lookup's critical path): one
                    // copy-engine transfer each.
                    cp(pk + at * 8, p.keys, n[q] * 8)?;
                    cp(po + at, p.only, n[q])?;
                    p.keys = pk + at * 8;
                    p.only = po + at;
                    if pull_values {
                        cp(pv + at * dim as u64 * 4, p.values, n[q] * dim * 4)?;
                        p.values = pv + at * dim as u64 * 4;
                    }
                    at += n[q] as u64;
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

    fn run_host(
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
    fn export_chunk(&self, table: &CudaTable, node: &mut Node, offset: u64) -> Result<u64> {
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
        let raw = Raw {
            p: Ptrs { counters, ..Ptrs::default() },
            out: [opt_ptr(&b.recv_keys, &s), opt_ptr(&b.recv_values, &s), opt_ptr(&b.recv_scores, &s)],
            counts: opt_ptr(&b.ex_counts, &s),
            offsets: opt_ptr(&b.ex_offsets, &s),
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

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // ranks index several matrices at once
mod tests {
    use super::*;

    #[test]
    fn starts_are_exclusive_prefix_sums() {
        assert_eq!(starts(&[3, 0, 2, 5]), vec![0, 3, 3, 5]);
        assert_eq!(starts(&[]), Vec::<u64>::new());
    }

    /// Every element rank r sends to p, as (send offset, recv offset) pairs
    /// of each key, over all parts.
    fn moves_of(parts: &[Plan]) -> Vec<Vec<Vec<(u64, u64)>>> {
        let nr = parts[0].lens.len();
        let mut m = vec![vec![vec![]; nr]; nr];
        for part in parts {
            for r in 0..nr {
                for p in 0..nr {
                    for k in 0..part.lens[r][p] {
                        m[r][p].push((part.send_at[r][p] + k, part.recv_at[p][r] + k));
                    }
                }
            }
        }
        m
    }

    #[test]
    fn the_way_back_returns_each_key_to_where_it_came_from() {
        let c = vec![vec![2, 3], vec![4, 1]];
        let fwd = Plan::packed(&c, true);
        let back = fwd.back(&[5, 5]);
        let f = moves_of(std::slice::from_ref(&fwd));
        let b = moves_of(std::slice::from_ref(&back));
        for r in 0..2 {
            for p in 0..2 {
                let there: Vec<(u64, u64)> = f[r][p].iter().map(|&(s, d)| (d, s)).collect();
                assert_eq!(b[p][r], there, "{r} -> {p} and back");
            }
        }
        assert_eq!(back.recv_size, vec![5, 5]);
    }

    #[test]
    fn only_the_group_ops_are_offered() {
        for op in [
            DeviceOp::Find,
            DeviceOp::Contains,
            DeviceOp::InsertOrAssign,
            DeviceOp::FindOrInsert,
            DeviceOp::Assign,
            DeviceOp::Erase,
        ] {
            assert!(moves(op).is_ok(), "{op:?}");
        }
        let e = moves(DeviceOp::FindPtr).err().expect("refused").to_string();
        assert!(e.contains("not offered on a GPU group"), "{e}");
    }

    #[test]
    fn without_nccl_or_a_driver_the_answer_is_an_error() {
        // On a host without NCCL this is a clear error; with it, a version.
        match nccl_version() {
            Ok(v) => assert!(v >= 20000, "{v}"),
            Err(e) => assert!(e.to_string().contains("NCCL"), "{e}"),
        }
        if crate::cuda_unavailable().is_some() {
            let e = GpuGroup::new(TableConfig::new(1024, 4), &[0]).expect_err("no GPU here").to_string();
            assert!(!e.is_empty());
        }
        let e = GpuGroup::new(TableConfig::new(1024, 4), &[0, 0]).expect_err("duplicate").to_string();
        assert!(e.contains("once"), "{e}");
    }
}
