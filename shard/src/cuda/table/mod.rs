//! The CUDA backend: the table in one GPU's memory, every operation a kernel
//! of `hkv-kernels` (lookup, upsert, update, erase, export).
//!
//! Layout on the device: per bucket one 128-byte digest line, 128 keys, 128
//! scores, an occupancy count and a writer lock word. Values are addressed by
//! position `bucket * 128 + slot`: positions below the fast-tier budget live
//! in device memory, the rest in pinned, device-mapped host memory allocated
//! in slices of about 1 GiB, which kernels read and write through their
//! device addresses (no CPU thread on the data path). Large batches that
//! copy values of such a table serve their keys grouped by bucket region
//! (`CudaTable::key_order`), which the device reaches host rows in about
//! three times faster than in random order.
//!
//! Host arrays reach the device through the lane's pinned staging memory
//! (`staging`): one asynchronous transfer per array, one wait per batch.
//!
//! Concurrency: the same [`GroupLock`] as the CPU backend. Every batch runs
//! on a lane (a stream with its own reusable device buffers and staging
//! memory) taken from a pool, so reader batches (and updater batches) of
//! several threads run on several streams at once, while an inserter batch
//! runs alone. Inside a kernel, writers lock a key's candidate buckets (see `table.cuh`), so
//! results per key equal the CPU backend's whenever no two keys of a batch
//! share a bucket.
//!
//! Verbatim writes (load, and the re-insert of a growth) in dual mode move a
//! resident of a full candidate bucket to its other bucket before they
//! evict, as the CPU backend does (`kernels/upsert.cu`), and run in passes
//! ([`CudaTable::in_passes`]): a key that finds no room while the rest of its
//! launch holds the buckets it could move residents into is placed by a
//! later pass, so a table loaded onto its own layout gets every entry back.
//!
//! Deliberate difference from the CPU backend: growth re-inserts entries in
//! parallel, not in descending score order; in dual mode, where a rehash can
//! still overflow a bucket pair that relocation cannot relieve, which entry
//! is dropped may differ. A grow that fails leaves the table as it was.
//!
//! # Layout
//! - this file: [`CudaTable`], its construction and tuning.
//! - `abi`: the codes the kernels take, counters, raw pointers of a launch.
//! - `layout`: the C structs the kernels take by value, asserted against
//!   the ABI list `kernels/abi.h`.
//! - `kernels`: which kernel variant (threads per key) serves a batch.
//! - `launch`: one typed wrapper per kernel launch, with its safety contract.
//! - `storage`: device buffers and the pinned host tier.
//! - `lane`: streams with reusable buffers and staging memory.
//! - `growth`: doubling the buckets.
//! - `host_batch`: batches of host arrays (upload, rounds, fetch).
//! - `device_batch`: [`DeviceOp`], [`DeviceBatch`], [`CudaTable::run_device`]
//!   and the enqueue / complete pair the GPU group builds on.
//! - `ops`: the [`Shard`] operations.
//! - `adapt`: the Adaptive policy's state (the sketch on the device, the
//!   window share's miniatures on the host) and its count and halving
//!   launches.
//! - `sampling`: the ring of keys sampled for miss-ratio curves, the
//!   sampler argument the lookup and writer kernels take, and the drain.

mod abi;
mod adapt;
mod device_batch;
mod growth;
mod host_batch;
mod ipc_batch;
mod kernels;
mod lane;
mod launch;
mod layout;
mod ops;
mod sampling;
mod storage;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use hkv_kernels::KernelId;
use parking_lot::{Mutex, RwLock};

use crate::check;
use crate::config::{BucketMode, CudaTuning, FindOrInsert, LfuTies, ScorePolicy, TableConfig};
use crate::cpu::Counters;
use crate::cuda::staging::{Region, Staging};
use crate::cuda::{alloc_err, arg, dev_err, ensure, DevPtr, Device};
use crate::error::{Error, Result};
use crate::lock::{Group, GroupLock};
use crate::mrc::Kind;
use crate::score::{Clock, Scorer};
use std::collections::HashMap;

use crate::hash::{bucket1, bucket2};
use crate::{Evictions, Export, Filter, Lost, Op, Outcome, Shard, ShardStats, Summary, BUCKET_SLOTS, SEQUENTIAL_BATCH};
use abi::*;
use host_batch::*;
use kernels::*;
use lane::*;
use launch::*;
use layout::*;
use sampling::Sampling;
use storage::*;

pub use abi::Counts;
pub(crate) use abi::{opt_ptr, ptr, ExportPtrs, LostPtrs, Ptrs};
pub use device_batch::{DeviceBatch, DeviceOp, DeviceRun};
pub(crate) use device_batch::{ExportArgs, Pending, Raw};
pub use ipc_batch::{IpcArrays, IpcLost, IpcOrder, IpcPart};
pub(crate) use launch::scan_config;

const S: u64 = BUCKET_SLOTS as u64;

/// The table on one CUDA device. See the module docs.
pub struct CudaTable {
    config: TableConfig,
    dev: Arc<Device>,
    f: Funcs,
    /// Replaced whole by a grow, only once the new storage holds every entry.
    storage: RwLock<Storage>,
    lanes: Mutex<Vec<Lane>>,
    lock: GroupLock,
    size: AtomicU64,
    epoch: AtomicU32,
    clock: Arc<dyn Clock>,
    counters: Counters,
    /// The sampler and ring of miss-ratio sampling ([`Shard::set_sampler`]).
    sampling: Sampling,
    /// Fault injection for tests ([`CudaTable::fail_next_grow`]).
    fail_grow: std::sync::atomic::AtomicBool,
    /// The Adaptive policy's device state; `None` for every other policy.
    adapt: Option<adapt::DeviceAdapt>,
    /// What a reserve allocated in advance ([`Shard::prepare_reserve`]).
    prepared: Mutex<Option<growth::Prepared>>,
}

impl std::fmt::Debug for CudaTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTable").field("config", &self.config).field("device", &self.dev.info.name).finish()
    }
}

impl CudaTable {
    /// A table on `dev`, on the process's clock (`score::process_clock`).
    pub fn new(config: TableConfig, dev: Arc<Device>) -> Result<CudaTable> {
        Self::with_clock(config, dev, crate::score::process_clock())
    }

    /// A table reading Lru / EpochLru time from `clock`.
    pub fn with_clock(config: TableConfig, dev: Arc<Device>, clock: Arc<dyn Clock>) -> Result<CudaTable> {
        config.validate()?;
        // The device's context has no event tracking (Device::open, whose
        // SAFETY argument this table keeps): every buffer the table uses is
        // used on one lane's stream at a time, and each batch synchronises
        // its stream before its lane is returned to the pool or its buffers
        // are reallocated; storage is replaced only under the inserter
        // group, after every lane is idle.
        let get = |id: KernelId, name: &str| {
            dev.module(id).load_function(name).map_err(|e| Error::Device(format!("kernel {name}: {e:?}")))
        };
        let tuning = config.tuning;
        let variants = |id: KernelId, base: &str, gs: &[u64]| -> Result<Vec<Variant>> {
            gs.iter().map(|&g| Ok(Variant { f: get(id, &kernel_name(base, g))?, g })).collect()
        };
        let f = Funcs {
            lookup: variants(KernelId::Lookup, "lookup_find", &LOOKUP_GROUPS)?,
            lookup_at: variants(KernelId::Lookup, "lookup_at", &LOOKUP_GROUPS)?,
            lookup_zero: variants(KernelId::Lookup, "lookup_findz", &LOOKUP_GROUPS)?,
            lookup_refresh: variants(KernelId::Lookup, "lookup_findr", &LOOKUP_GROUPS)?,
            lookup_zero_refresh: variants(KernelId::Lookup, "lookup_findzr", &LOOKUP_GROUPS)?,
            upsert: variants(KernelId::Upsert, "upsert_keys", &WRITE_GROUPS)?,
            upsert_adaptive: variants(KernelId::Upsert, "upsert_keys_a", &WRITE_GROUPS)?,
            upsert_verbatim: variants(KernelId::Upsert, "upsert_keys_v", &WRITE_GROUPS)?,
            update: variants(KernelId::Update, "update_keys", &WRITE_GROUPS)?,
            update_bounded: Variant { f: get(KernelId::Update, "update_keys_g2_b5")?, g: 2 },
            step: variants(KernelId::Update, "step_keys", &WRITE_GROUPS)?,
            probe: variants(KernelId::Upsert, "probe_keys", &LOOKUP_GROUPS)?,
            upsert_bounded: Variant { f: get(KernelId::Upsert, "upsert_keys_g4_b5")?, g: 4 },
            upsert_adaptive_bounded: Variant { f: get(KernelId::Upsert, "upsert_keys_a_g4_b5")?, g: 4 },
            forced_lookup: group_size(tuning.lookup_group, &LOOKUP_GROUPS),
            forced_write: group_size(tuning.write_group, &WRITE_GROUPS),
            region_order: !tuning.index_order,
            order_count: get(KernelId::Lookup, "order_count")?,
            keys_reserved: get(KernelId::Lookup, "keys_reserved")?,
            keys_gate: get(KernelId::Lookup, "keys_gate")?,
            shard_mask: get(KernelId::Route, "shard_mask")?,
            order_write: get(KernelId::Lookup, "order_write")?,
            erase: get(KernelId::Erase, "erase_keys")?,
            erase_if: get(KernelId::Erase, "erase_if")?,
            clear: get(KernelId::Erase, "clear_table")?,
            ex_count: get(KernelId::Export, "export_count")?,
            ex_scan: get(KernelId::Export, "export_scan")?,
            ex_write: get(KernelId::Export, "export_write")?,
            adapt_count: get(KernelId::Upsert, "adapt_count")?,
            adapt_sample: get(KernelId::Upsert, "adapt_sample")?,
            adapt_halve: get(KernelId::Upsert, "adapt_halve")?,
            adapt_fold: get(KernelId::Upsert, "adapt_fold")?,
            dedupe_claim: get(KernelId::Upsert, "dedupe_claim")?,
            sum_count: get(KernelId::Update, "sum_count")?,
            sum_add: get(KernelId::Update, "sum_add")?,
            sum_out: get(KernelId::Update, "sum_out")?,
            dedupe_lead: get(KernelId::Upsert, "dedupe_lead")?,
            dedupe_fill: get(KernelId::Upsert, "dedupe_fill")?,
        };
        let stream = dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let storage = Storage::new(&dev, &config, &f.clear, &stream, config.buckets())?;
        let adapt = match config.policy {
            ScorePolicy::Adaptive => {
                Some(adapt::DeviceAdapt::new(&stream, config.max_buckets(), config.buckets() * S)?)
            }
            _ => None,
        };
        Ok(CudaTable {
            config,
            dev,
            f,
            storage: RwLock::new(storage),
            lanes: Mutex::new(vec![]),
            lock: GroupLock::new(),
            size: AtomicU64::new(0),
            epoch: AtomicU32::new(0),
            clock,
            counters: Counters::default(),
            sampling: Sampling::default(),
            fail_grow: std::sync::atomic::AtomicBool::new(false),
            adapt,
            prepared: Mutex::new(None),
        })
    }

    /// Forces (or frees) the kernel choice of later batches (benchmarks).
    pub fn set_tuning(&mut self, t: CudaTuning) -> Result<()> {
        t.validate()?;
        self.config.tuning = t;
        self.f.forced_lookup = group_size(t.lookup_group, &LOOKUP_GROUPS);
        self.f.forced_write = group_size(t.write_group, &WRITE_GROUPS);
        self.f.region_order = !t.index_order;
        Ok(())
    }

    /// Entries over slots of storage `st` (what the writer kernel choice goes by).
    fn load(&self, st: &Storage) -> f64 {
        self.size.load(Relaxed) as f64 / (st.nbuckets * S).max(1) as f64
    }

    /// The device the table lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    fn scoring(&self, verbatim: bool) -> ScoringArgs {
        let sc = ScoringArgs {
            now_ns: self.clock.now_ns(),
            policy: policy_code(self.config.policy),
            epoch: self.epoch.load(Relaxed),
            verbatim: if verbatim { SCORES_VERBATIM } else { SCORES_POLICY },
            lfu_lru: (self.config.lfu_ties == LfuTies::Lru) as u32,
            refresh: 0,
            window: 0,
            sketch: 0,
            sketch_lines: 0,
            folds: 0,
        };
        match &self.adapt {
            Some(a) => a.args(sc),
            None => sc,
        }
    }

    /// The scoring a lookup takes: for a find (`find`) in a table whose
    /// reads refresh, hits get the score a write without input gives them
    /// (the CPU backend's `find`; `find_at` and `contains` refresh nothing).
    fn read_scoring(&self, find: bool) -> ScoringArgs {
        ScoringArgs { refresh: (find && self.config.refreshes_reads()) as u32, ..self.scoring(false) }
    }

    /// Verbatim scores, and a key the kernel cannot place without evicting
    /// left for a later pass ([`CudaTable::in_passes`]).
    fn scoring_deferred(&self) -> ScoringArgs {
        ScoringArgs { verbatim: SCORES_DEFER, ..self.scoring(true) }
    }
}
