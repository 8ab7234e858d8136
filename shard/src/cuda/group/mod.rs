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
//! [`Route::Auto`] sends lookups (find, find*, contains) the peer way and
//! every other operation the device way: the faster of the two for each on
//! the H200 pair (`daemon/BENCHMARKS.md`).
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
//! - this file: [`GpuGroup`] (construction, [`GpuGroup::batch`],
//!   [`GpuGroup::run`] and its one-GPU path), [`Route`], [`RankBatch`].
//! - `plan`: who sends what to whom in an all-to-all; what each op moves.
//! - `node`: one GPU's streams, route kernels and scratch, and the masks /
//!   partition / scatter / gather steps the routes share.
//! - `nccl`: loading NCCL, [`NCCL_ENV_DEFAULTS`], communicators, exchanges.
//! - `device_route`, `peer_route` (with enabling peer access), `host_route`:
//!   the three routes.
//! - `reshard`: [`GpuGroup::reshard`].

mod device_route;
mod host_route;
mod nccl;
mod node;
mod peer_route;
mod plan;
mod reshard;

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DeviceRepr, PushKernelArg};
use cudarc::nccl::{group_end, group_start, Comm, NcclType};
use hkv_kernels::KernelId;
use parking_lot::Mutex;

use crate::config::TableConfig;
use crate::cuda::table::{
    opt_ptr, ptr, scan_config, Counts, CudaTable, DeviceOp, ExportArgs, ExportPtrs, Pending, Ptrs, Raw,
};
use crate::cuda::{dev_err, ensure, grid, shared_device, DevPtr, Device, FeatureHasher};
use crate::error::{Error, Result};
use crate::features::{Features, HashKind};
use crate::hash::shard_of;
use crate::{Filter, Shard, BUCKET_SLOTS};
use cudarc::driver::sys::CUcontext;
use nccl::*;
pub use nccl::{nccl_version, NCCL_ENV_DEFAULTS};
use node::*;
use peer_route::*;
use plan::*;

/// Most GPUs in a group (the route kernels count per destination in
/// shared memory).
pub const MAX_GPUS: usize = 8;

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

    /// Sets the miss-ratio sampler of every GPU's table
    /// ([`Shard::set_sampler`]): the keys each route serves are sampled on
    /// the GPU that owns them, once each.
    pub fn set_sampler(&self, sampler: Option<crate::mrc::Sampler>) {
        for t in &self.tables {
            t.set_sampler(sampler);
        }
    }

    /// Drains every GPU's table in rank order ([`Shard::drain_samples`]),
    /// the counts summed: one GPU's keys after another's, each GPU's in the
    /// order it ran its parts.
    pub fn drain_samples(&self, out: &mut crate::mrc::Samples) -> crate::SampleDrain {
        let mut sum = crate::SampleDrain::default();
        for t in &self.tables {
            let d = t.drain_samples(out);
            sum.accesses += d.accesses;
            sum.sampled += d.sampled;
            sum.dropped += d.dropped;
        }
        sum
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
                let b = RankBatch {
                    n,
                    keys: s.alloc_zeros(n.max(1)).map_err(a)?,
                    values: s.alloc_zeros((n * dim).max(1)).map_err(a)?,
                    found: s.alloc_zeros(n.max(1)).map_err(a)?,
                };
                // Allocated and zeroed before any other stream touches them
                // (hash_features writes keys on the hasher's stream): the
                // context tracks no events (Device::open).
                s.synchronize().map_err(a)?;
                Ok(b)
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
                keys: Some(DevPtr::of(&b.keys, &s)),
                values: Some(DevPtr::of(&b.values, &s)),
                found: Some(DevPtr::of(&b.found, &s)),
                counters: Some(counters),
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
        let e = moves(DeviceOp::FindPtr).err().expect("refused");
        assert!(matches!(e, Error::Config(_)), "{e}");
    }

    #[test]
    fn without_nccl_or_a_driver_the_answer_is_an_error() {
        // On a host without NCCL this is a clear error; with it, a version.
        match nccl_version() {
            Ok(v) => assert!(v >= 20000, "{v}"),
            Err(e) => assert!(matches!(e, Error::Unavailable(_) | Error::Device(_)), "{e}"),
        }
        if crate::cuda_unavailable().is_some() {
            let e = GpuGroup::new(TableConfig::new(1024, 4), &[0]).expect_err("no GPU here").to_string();
            assert!(!e.is_empty());
        }
        let e = GpuGroup::new(TableConfig::new(1024, 4), &[0, 0]).expect_err("duplicate");
        assert!(matches!(e, Error::Config(_)), "{e}");
    }
}
