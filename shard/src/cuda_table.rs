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
//! several threads run on several streams at once, while an inserter batch runs alone. Inside a
//! kernel, writers lock a key's candidate buckets (see `table.cuh`), so
//! results per key equal the CPU backend's whenever no two keys of a batch
//! share a bucket.
//!
//! Deliberate difference from the CPU backend: growth re-inserts entries in
//! parallel, not in descending score order; in dual mode, where a rehash can
//! overflow a bucket pair, which entry is dropped may differ.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use hkv_kernels::KernelId;
use parking_lot::{Mutex, RwLock};

use crate::check;
use crate::config::{BucketMode, CudaTuning, LfuTies, ScorePolicy, TableConfig};
use crate::cpu::Counters;
use crate::cuda::{dev_err, ensure, Device};
use crate::error::{Error, Result};
use crate::lock::{Group, GroupLock};
use crate::score::{Clock, Scorer, SystemClock};
use crate::staging::{Region, Staging};
use std::collections::HashMap;

use crate::hash::{bucket1, bucket2};
use crate::{Evictions, Export, Filter, Lost, Op, Outcome, Shard, ShardStats, Summary, BUCKET_SLOTS, SEQUENTIAL_BATCH};

const S: u64 = BUCKET_SLOTS as u64;
const BLOCK: u32 = 256;
/// Bytes per host-tier slice (rounded down to a power of two of rows).
const SLICE_BYTES: u64 = 1 << 30;

const C_HITS: usize = 0;
const C_UPDATED: usize = 1;
const C_LOST: usize = 6;
const C_ERASED: usize = 7;
const NCOUNTERS: usize = 8;

const UP_INSERT: i32 = 0;
const UP_FIND_OR_INSERT: i32 = 1;
const UP_ACCUM: i32 = 2;
const UP_FIND_OR_INSERT_PTR: i32 = 3;
const UPD_ASSIGN: i32 = 0;
const UPD_SCORES: i32 = 1;
const UPD_ACCUM: i32 = 2;

/// `HkvTable` of `table.cuh`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct TableArgs {
    digests: u64,
    keys: u64,
    scores: u64,
    sizes: u64,
    locks: u64,
    fast: u64,
    slices: u64,
    fast_slots: u64,
    nbuckets: u64,
    slice_shift: u32,
    dim: u32,
    dual: u32,
    pad: u32,
    /// Per launch: the key order of [`CudaTable::key_order`] (0: index order).
    order: u64,
}

/// `HkvScoring` of `table.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ScoringArgs {
    now_ns: u64,
    policy: u32,
    epoch: u32,
    verbatim: u32,
    /// Lfu: 1 for [`LfuTies::Lru`] (packed frequency and stamp), 0 for plain frequencies.
    lfu_lru: u32,
}

/// `HkvFilter` of `table.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FilterArgs {
    key_mask: u64,
    key_pattern: u64,
    min_score: u64,
    max_score: u64,
}

// SAFETY: plain #[repr(C)] structs of integers whose layout matches the C
// structs the kernels take by value (HkvTable, HkvScoring, HkvFilter in
// kernels/table.cuh): same field order, types and padding.
unsafe impl DeviceRepr for TableArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for ScoringArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for FilterArgs {}

fn policy_code(p: ScorePolicy) -> u32 {
    match p {
        ScorePolicy::Lru => 0,
        ScorePolicy::Lfu => 1,
        ScorePolicy::EpochLru => 2,
        ScorePolicy::EpochLfu => 3,
        ScorePolicy::Custom => 4,
    }
}

fn filter_args(f: &Filter) -> FilterArgs {
    FilterArgs { key_mask: f.key_mask, key_pattern: f.key_pattern, min_score: f.min_score, max_score: f.max_score }
}

/// The device address of a buffer, for a kernel argument (event tracking
/// is off for the table's context: every lane synchronises its own stream).
pub(crate) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

/// The device address of a buffer, or 0 when there is none.
pub(crate) fn opt_ptr<T>(s: &Option<CudaSlice<T>>, stream: &CudaStream) -> u64 {
    s.as_ref().map_or(0, |s| ptr(s, stream))
}

/// Threads per key forced by a tuning, when it names one of `built`.
fn group_size(forced: Option<u32>, built: &[u64]) -> Option<u64> {
    forced.map(u64::from).filter(|g| built.contains(g))
}

/// Threads per key the lookup kernels are built for, and the writer
/// (upsert, update) kernels.
const LOOKUP_GROUPS: [u64; 6] = [1, 2, 4, 8, 16, 32];
const WRITE_GROUPS: [u64; 6] = [1, 2, 4, 8, 16, 32];

/// The kernel variant with `g` threads per key (`base` itself is the 8-thread one).
fn kernel_name(base: &str, g: u64) -> String {
    if g == 8 {
        base.to_string()
    } else {
        format!("{base}_g{g}")
    }
}

/// One block of 1024 threads: the launch of the block scans (`export_scan`,
/// `route_scan`, both on `hkv_block_scan`).
pub(crate) fn scan_config() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 }
}

/// Value bytes per region of [`CudaTable::key_order`] (at least; whole
/// buckets), and the most regions it counts.
const REGION_BYTES: u64 = 2 << 20;
const MAX_REGIONS: u64 = 1 << 16;

fn blocks(threads: u64) -> Result<LaunchConfig> {
    crate::cuda::grid(threads, BLOCK)
}

/// The table's device memory. The buffers are held for the raw addresses
/// in `args`, through which the kernels use them.
#[allow(dead_code)]
struct Storage {
    digests: CudaSlice<u8>,
    keys: CudaSlice<u64>,
    scores: CudaSlice<u64>,
    sizes: CudaSlice<i32>,
    locks: CudaSlice<i32>,
    fast: Option<CudaSlice<f32>>,
    host: Vec<PinnedHostSlice<f32>>,
    _slice_ptrs: CudaSlice<u64>,
    nbuckets: u64,
    fast_slots: u64,
    host_slots: u64,
    args: TableArgs,
}

impl Storage {
    /// Allocates and clears storage of `nbuckets` buckets for `config` on
    /// `dev` (`clear`: the `clear_table` kernel), waiting for the clear.
    fn new(
        dev: &Device,
        config: &TableConfig,
        clear: &CudaFunction,
        stream: &Arc<CudaStream>,
        nbuckets: u64,
    ) -> Result<Storage> {
        let dim = config.dim as u64;
        let slots = nbuckets * S;
        let row = dim * 4;
        let fast_slots = match config.fast_tier_bytes {
            Some(b) => (b / row).min(slots),
            None => slots,
        };
        let host_slots = slots - fast_slots;
        let al = |what: &'static str| dev_err(what);
        let digests = stream.alloc_zeros::<u8>(slots as usize).map_err(al("allocating digests"))?;
        let keys = stream.alloc_zeros::<u64>(slots as usize).map_err(al("allocating keys"))?;
        let scores = stream.alloc_zeros::<u64>(slots as usize).map_err(al("allocating scores"))?;
        let sizes = stream.alloc_zeros::<i32>(nbuckets as usize).map_err(al("allocating bucket sizes"))?;
        let locks = stream.alloc_zeros::<i32>(nbuckets as usize).map_err(al("allocating bucket locks"))?;
        let fast = if fast_slots > 0 {
            Some(stream.alloc_zeros::<f32>((fast_slots * dim) as usize).map_err(al("allocating device values"))?)
        } else {
            None
        };
        // Host tier: slices of 2^shift rows, pinned and mapped into the device's address space.
        let mut shift = 0u32;
        while (2u64 << shift) * row <= SLICE_BYTES {
            shift += 1;
        }
        let per = 1u64 << shift;
        let mut host = vec![];
        let mut slice_ptrs = vec![];
        let mut left = host_slots;
        while left > 0 {
            let rows = left.min(per);
            let (h, dp) = host_slice(dev, (rows * dim) as usize)?;
            slice_ptrs.push(dp);
            host.push(h);
            left -= rows;
        }
        if slice_ptrs.is_empty() {
            slice_ptrs.push(0);
        }
        let dslices = stream.clone_htod(&slice_ptrs).map_err(al("copying slice pointers"))?;
        let args = TableArgs {
            digests: ptr(&digests, stream),
            keys: ptr(&keys, stream),
            scores: ptr(&scores, stream),
            sizes: ptr(&sizes, stream),
            locks: ptr(&locks, stream),
            fast: opt_ptr(&fast, stream),
            slices: ptr(&dslices, stream),
            fast_slots,
            nbuckets,
            slice_shift: shift,
            dim: dim as u32,
            dual: (config.mode == BucketMode::Dual) as u32,
            pad: 0,
            order: 0,
        };
        let st = Storage {
            digests,
            keys,
            scores,
            sizes,
            locks,
            fast,
            host,
            _slice_ptrs: dslices,
            nbuckets,
            fast_slots,
            host_slots,
            args,
        };
        let mut l = stream.launch_builder(clear);
        l.arg(&st.args);
        // SAFETY: clear_table(t) writes keys, digests and scores of positions
        // < nbuckets * 128 and sizes / locks of buckets < nbuckets, all inside
        // the buffers just allocated with exactly those lengths.
        unsafe { l.launch(blocks(slots)?) }.map_err(dev_err("launching clear_table"))?;
        stream.synchronize().map_err(dev_err("initialising the table"))?;
        Ok(st)
    }
}

/// One host-tier slice of `len` values (cuMemHostAlloc), zeroed and mapped
/// into the device's address space, and its device address.
fn host_slice(dev: &Device, len: usize) -> Result<(PinnedHostSlice<f32>, u64)> {
    use cudarc::driver::sys;
    let al = |e| dev_err("allocating pinned host values")(e);
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: the memory is zeroed right below before any use.
    let mut h = unsafe { dev.ctx.alloc_pinned_with_flags::<f32>(len, flags) }.map_err(al)?;
    let hp = h.as_mut_ptr().map_err(al)?;
    // SAFETY: hp points to len f32 just allocated and owned by `h`.
    unsafe { std::ptr::write_bytes(hp, 0, len) };
    let mut dp: sys::CUdeviceptr = 0;
    // SAFETY: hp was allocated by cuMemHostAlloc with DEVICEMAP in this
    // context; the call writes one device pointer to `dp`.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dp, hp as *mut _, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Device(format!("cuMemHostGetDevicePointer: {r:?}")));
    }
    Ok((h, dp))
}

/// A stream with its reusable device buffers; one batch at a time.
struct Lane {
    stream: Arc<CudaStream>,
    keys: Option<CudaSlice<u64>>,
    values: Option<CudaSlice<f32>>,
    scores: Option<CudaSlice<u64>>,
    flags: Option<CudaSlice<u8>>,
    flags2: Option<CudaSlice<u8>>,
    counters: CudaSlice<u64>,
    lost_keys: Option<CudaSlice<u64>>,
    lost_values: Option<CudaSlice<f32>>,
    lost_scores: Option<CudaSlice<u64>>,
    lost_kinds: Option<CudaSlice<u8>>,
    counts: Option<CudaSlice<u32>>,
    offsets: Option<CudaSlice<u64>>,
    /// find_at's output rows.
    at: Option<CudaSlice<u32>>,
    /// Pinned memory the batch's host arrays pass through.
    stage: Staging,
}

struct Funcs {
    /// Lookup kernels with 1 to 32 threads per key ([`LOOKUP_GROUPS`]) (see [`Funcs::lookup`]).
    lookup: Vec<Variant>,
    /// The same for find_at (`lookup_at`: rows to given output rows).
    lookup_at: Vec<Variant>,
    /// Upsert and update kernels with 1 to 32 threads per key ([`WRITE_GROUPS`])
    /// (see [`Funcs::upsert`], [`Funcs::update`]).
    upsert: Vec<Variant>,
    update: Vec<Variant>,
    /// The 2-thread update kernel held to 48 registers (`update_keys_g2_b5`).
    update_bounded: Variant,
    /// The 4-thread upsert kernel without lost outputs, held to 48
    /// registers (`upsert_keys_g4_b5`).
    upsert_bounded: Variant,
    /// Threads per key forced by the [`CudaTuning`] (the process's, or
    /// [`CudaTable::set_tuning`]) instead of the choice below.
    forced_lookup: Option<u64>,
    forced_write: Option<u64>,
    /// Key order by bucket region for value-copying launches on a table
    /// with a host tier ([`CudaTable::key_order`]); off with
    /// [`CudaTuning::index_order`].
    region_order: bool,
    order_count: CudaFunction,
    order_write: CudaFunction,
    erase: CudaFunction,
    erase_if: CudaFunction,
    clear: CudaFunction,
    ex_count: CudaFunction,
    ex_scan: CudaFunction,
    ex_write: CudaFunction,
}

/// A kernel and the threads it gives each key.
#[derive(Clone)]
struct Variant {
    f: CudaFunction,
    g: u64,
}

/// Load factor from which inserts take at least 2 threads per key (4 for
/// insert_or_assign, see [`Funcs::upsert`]): in a nearly full table most
/// inserts scan a bucket's 128 scores for the minimum, which several
/// threads do faster; below it, 1 thread per key keeps more keys in flight
/// (measured on the H200, shard/BENCHMARKS.md).
const WRITER_PAIR_FROM: f64 = 0.875;

/// Widest row for which assign and accumulate take `update_keys_g2_b5`, 2
/// threads per key held to 48 registers (5 blocks of 256 per SM instead of
/// 4). Measured on the H200 (128 Mi slots; 64 Mi at dim 64), assign B-KV/s
/// at λ 0.5 / 1.0: dim 8 3.602 / 3.587 → 3.854 / 3.777, dim 32 3.206 /
/// 3.200 → 3.335 / 3.237, but dim 64 2.551 / 2.588 → 2.274 / 2.303.
const BOUNDED_UPDATE_DIM: usize = 32;

/// Threads per key of lookups and writes that copy rows of a table with a
/// host tier (batches in region order, [`CudaTable::key_order`]): fewer
/// keys in flight keep the host rows being copied at one time closer
/// together. At dim 64 with half the rows in host memory, 8 / 16 measured
/// 19–24 % faster than the device-memory choices (find 0.143 → 0.177,
/// insert_or_assign 0.150 → 0.168 B-KV/s, λ 0.5, H200); lookups with 16
/// another 4 % (find 0.171 → 0.179; 32: 0.174), writes with 32 4 % slower
/// than with 16, with 8 3 % faster than with 16 (insert_or_assign,
/// find_or_insert and assign, the reference's keys, every λ; 4: 5–10 %
/// slower than 16).
const HOST_TIER_LOOKUP: u64 = 16;
const HOST_TIER_WRITE: u64 = 8;

/// Threads per key so that each copies at most 8 16-byte pieces of a row
/// of `dim` floats (copies under a bucket lock wait once per 4 pieces).
fn copy_threads(dim: usize) -> u64 {
    (dim.div_ceil(32) as u64).next_power_of_two()
}

/// Threads per key of an upsert that copies rows of `dim` floats: one per
/// 16 floats (4 pieces of 16 bytes each). Measured on the H200 (128 Mi
/// slots, λ 0.5): at dim 32, 2 threads give insert_or_assign 2.30 B-KV/s
/// against 1.79 with 1 (find_or_insert 2.42 / 1.97); at dim 8, 1 and 2
/// are equal (2.42 / 2.41); at dim 64 (64 Mi slots, λ 1.0), 4 threads give
/// insert_or_assign 1.15 against 1.06 with 2 (find_or_insert 1.39 / 1.31).
fn upsert_copy_threads(dim: usize) -> u64 {
    (dim.div_ceil(16) as u64).next_power_of_two()
}

/// The variant of `vs` with the fewest threads per key, at least `g`.
fn pick(vs: &[Variant], g: u64) -> &Variant {
    vs.iter().find(|v| v.g >= g).unwrap_or(&vs[vs.len() - 1])
}

impl Funcs {
    /// The lookup kernel for a batch of rows of `dim` floats: 1 thread per
    /// key when no values are copied out (contains, find*), else 2, or one
    /// per 16 floats of a wide row; 16 for a batch in region order
    /// (`ordered`, a table with a host tier). `at`: the find_at kernel.
    fn lookup(&self, values: bool, dim: usize, ordered: bool, at: bool) -> &Variant {
        let g = if ordered {
            HOST_TIER_LOOKUP
        } else if values {
            (2 * copy_threads(dim)).max(2)
        } else {
            1
        };
        pick(if at { &self.lookup_at } else { &self.lookup }, self.forced_lookup.unwrap_or(g))
    }

    /// The upsert kernel for a table at `load`: 1 thread per key, from
    /// [`WRITER_PAIR_FROM`] on 2, or 4 for a plain insert (`plain`:
    /// insert_or_assign, nothing copied out), and one per 16 floats of a
    /// copied row ([`upsert_copy_threads`]); 8 for a batch in region order.
    /// Measured on the H200 at λ 1.0 (128 Mi slots), B-KV/s with 2 / 4
    /// threads: insert_or_assign dim 8 1.320 / 1.459, dim 32 1.259 / 1.443;
    /// insert_and_evict dim 8 0.905 / 0.820, dim 32 0.877 / 0.820.
    /// Four threads without lost outputs (`lost`: insert_and_evict) take
    /// the variant held to 48 registers.
    fn upsert(&self, load: f64, values: bool, dim: usize, ordered: bool, plain: bool, lost: bool) -> &Variant {
        let scan = match (load >= WRITER_PAIR_FROM, plain) {
            (false, _) => 1,
            (true, false) => 2,
            (true, true) => 4,
        };
        let g = if ordered {
            HOST_TIER_WRITE
        } else if values {
            scan.max(upsert_copy_threads(dim))
        } else {
            scan
        };
        match pick(&self.upsert, self.forced_write.unwrap_or(g)) {
            v if v.g == 4 && !lost => &self.upsert_bounded,
            v => v,
        }
    }

    /// The update kernel: 2 threads per key (measured faster than 1 at
    /// every load), or enough for the row copy; 8 for a batch in region
    /// order. Rows of up to [`BOUNDED_UPDATE_DIM`] floats take the variant
    /// held to 48 registers.
    fn update(&self, dim: usize, ordered: bool) -> &Variant {
        let g = if ordered { HOST_TIER_WRITE } else { copy_threads(dim).max(2) };
        match self.forced_write {
            None if g == 2 && dim <= BOUNDED_UPDATE_DIM => &self.update_bounded,
            forced => pick(&self.update, forced.unwrap_or(g)),
        }
    }
}

/// The arguments `upsert_keys` and `update_keys` begin with, in their
/// order: table, scoring, keys, n, values, input scores, only, mode,
/// outcomes.
fn write_args<'a>(
    b: &mut LaunchArgs<'a>,
    args: &'a TableArgs,
    sc: &'a ScoringArgs,
    n: &'a u64,
    mode: &'a i32,
    p: &'a Ptrs,
) {
    b.arg(args).arg(sc).arg(&p.keys).arg(n).arg(&p.values).arg(&p.scores).arg(&p.only).arg(mode).arg(&p.outcomes);
}

/// Device pointers of one kernel call (0 = none).
#[derive(Default, Clone, Copy)]
pub(crate) struct Ptrs {
    pub(crate) keys: u64,
    pub(crate) values: u64,
    pub(crate) scores: u64,
    pub(crate) found: u64,
    pub(crate) outcomes: u64,
    pub(crate) ptrs: u64,
    pub(crate) only: u64,
    /// Lookups: each key's output row (u32 each; 0: key i to row i).
    pub(crate) at: u64,
    pub(crate) lost: [u64; 4],
    pub(crate) counters: u64,
}

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
    /// Fault injection for tests ([`CudaTable::fail_next_grow`]).
    fail_grow: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for CudaTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTable").field("config", &self.config).field("device", &self.dev.info.name).finish()
    }
}

/// Per-batch results read back from the counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    /// Hits (lookups).
    pub hits: u64,
    /// Outcome counts.
    pub summary: Summary,
    /// Entries in the insert_and_evict output.
    pub lost: u64,
    /// Entries erased.
    pub erased: u64,
}

impl Counts {
    /// Sums the counts of two batches (or of two GPUs' parts of one).
    pub fn merge(self, o: Counts) -> Counts {
        Counts {
            hits: self.hits + o.hits,
            summary: self.summary.merge(o.summary),
            lost: self.lost + o.lost,
            erased: self.erased + o.erased,
        }
    }
}

fn counts(c: &[u64]) -> Counts {
    Counts {
        hits: c[C_HITS],
        summary: Summary {
            updated: c[C_UPDATED],
            inserted: c[C_UPDATED + 1],
            evicted: c[C_UPDATED + 2],
            rejected: c[C_UPDATED + 3],
            absent: c[C_UPDATED + 4],
        },
        lost: c[C_LOST],
        erased: c[C_ERASED],
    }
}

impl CudaTable {
    /// A table on `dev`, on the system clock.
    pub fn new(config: TableConfig, dev: Arc<Device>) -> Result<CudaTable> {
        Self::with_clock(config, dev, Arc::new(SystemClock::default()))
    }

    /// A table reading Lru / EpochLru time from `clock`.
    pub fn with_clock(config: TableConfig, dev: Arc<Device>, clock: Arc<dyn Clock>) -> Result<CudaTable> {
        config.validate()?;
        // SAFETY: every buffer the table uses is used on one lane's stream
        // at a time, and each batch synchronises its stream before its lane
        // is returned to the pool or its buffers are reallocated; storage is
        // replaced only under the inserter group, after every lane is idle.
        unsafe { dev.ctx.disable_event_tracking() };
        let get = |id: KernelId, name: &str| {
            dev.module(id).load_function(name).map_err(|e| Error::Device(format!("kernel {name}: {e:?}")))
        };
        let tuning = crate::cuda::tuning();
        let variants = |id: KernelId, base: &str, gs: &[u64]| -> Result<Vec<Variant>> {
            gs.iter().map(|&g| Ok(Variant { f: get(id, &kernel_name(base, g))?, g })).collect()
        };
        let f = Funcs {
            lookup: variants(KernelId::Lookup, "lookup_find", &LOOKUP_GROUPS)?,
            lookup_at: variants(KernelId::Lookup, "lookup_at", &LOOKUP_GROUPS)?,
            upsert: variants(KernelId::Upsert, "upsert_keys", &WRITE_GROUPS)?,
            update: variants(KernelId::Update, "update_keys", &WRITE_GROUPS)?,
            update_bounded: Variant { f: get(KernelId::Update, "update_keys_g2_b5")?, g: 2 },
            upsert_bounded: Variant { f: get(KernelId::Upsert, "upsert_keys_g4_b5")?, g: 4 },
            forced_lookup: group_size(tuning.lookup_group, &LOOKUP_GROUPS),
            forced_write: group_size(tuning.write_group, &WRITE_GROUPS),
            region_order: !tuning.index_order,
            order_count: get(KernelId::Lookup, "order_count")?,
            order_write: get(KernelId::Lookup, "order_write")?,
            erase: get(KernelId::Erase, "erase_keys")?,
            erase_if: get(KernelId::Erase, "erase_if")?,
            clear: get(KernelId::Erase, "clear_table")?,
            ex_count: get(KernelId::Export, "export_count")?,
            ex_scan: get(KernelId::Export, "export_scan")?,
            ex_write: get(KernelId::Export, "export_write")?,
        };
        let stream = dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let storage = Storage::new(&dev, &config, &f.clear, &stream, config.buckets())?;
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
            fail_grow: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Forces (or frees) the kernel choice of later batches (benchmarks).
    pub fn set_tuning(&mut self, t: CudaTuning) -> Result<()> {
        t.validate()?;
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

    fn lane(&self) -> Result<Lane> {
        if let Some(l) = self.lanes.lock().pop() {
            return Ok(l);
        }
        let stream = self.dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let counters = stream.alloc_zeros::<u64>(NCOUNTERS).map_err(dev_err("allocating counters"))?;
        Ok(Lane {
            stream,
            keys: None,
            values: None,
            scores: None,
            flags: None,
            flags2: None,
            counters,
            lost_keys: None,
            lost_values: None,
            lost_scores: None,
            lost_kinds: None,
            counts: None,
            offsets: None,
            at: None,
            stage: Staging::new(self.dev.ctx.clone()),
        })
    }

    /// Returns a lane to the pool once its batch is over (a lane whose
    /// stream fails is dropped).
    fn put_lane(&self, mut l: Lane) {
        if l.stage.reset(&l.stream).is_ok() {
            self.lanes.lock().push(l);
        }
    }

    fn scoring(&self, verbatim: bool) -> ScoringArgs {
        ScoringArgs {
            now_ns: self.clock.now_ns(),
            policy: policy_code(self.config.policy),
            epoch: self.epoch.load(Relaxed),
            verbatim: verbatim as u32,
            lfu_lru: (self.config.lfu_ties == LfuTies::Lru) as u32,
        }
    }

    // ---- kernel launches (raw device pointers, one stream) ----------------

    fn zero_counters(&self, l: &mut Lane) -> Result<()> {
        l.stream.memset_zeros(&mut l.counters).map_err(dev_err("clearing counters"))
    }

    /// Waits for the lane and reads its counters (with whatever else was
    /// fetched into its staging memory before).
    fn read_counters(&self, l: &mut Lane) -> Result<Counts> {
        // SAFETY: the counters buffer holds NCOUNTERS values and lives as long as the lane.
        let r = unsafe { l.stage.fetch(&l.stream, ptr(&l.counters, &l.stream), NCOUNTERS) }?;
        l.stage.sync(&l.stream)?;
        Ok(counts(l.stage.read(&r)))
    }

    /// For a launch of `n` keys (device address `keys`) that copies value
    /// rows (`copies`) of a table with a host tier: the keys' indices in
    /// the order of their first bucket's region, about 2 MiB of value rows
    /// (see `order_count` in lookup.cu). Rows in mapped host memory come
    /// about three times faster when the rows copied at one time lie close
    /// together (random 256-byte rows of a 16 GiB tier: 7.8 GB/s; the same
    /// rows grouped by 2 MiB region: 24 GB/s, measured on the H200).
    /// None, and index order, otherwise, for batches of up to
    /// [`SEQUENTIAL_BATCH`] keys and for batches too large for u32
    /// indices. Returned with the table arguments that carry it; the
    /// buffer is freed in stream order when dropped.
    ///
    /// # Safety
    /// `keys` holds `n` keys on this device, alive until `l` is synchronised.
    unsafe fn key_order(
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
    /// is synchronised.
    unsafe fn k_lookup(&self, l: &Arc<CudaStream>, st: &Storage, n: u64, p: Ptrs) -> Result<()> {
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let v = self.f.lookup(p.values != 0, self.config.dim, order.is_some(), p.at != 0);
        let mut b = l.launch_builder(&v.f);
        if p.at != 0 {
            b.arg(&args).arg(&p.keys).arg(&n).arg(&p.at).arg(&p.values).arg(&p.found).arg(&c);
        } else {
            b.arg(&args)
                .arg(&p.keys)
                .arg(&n)
                .arg(&p.values)
                .arg(&p.found)
                .arg(&p.scores)
                .arg(&p.ptrs)
                .arg(&c)
                .arg(&p.only);
        }
        // SAFETY: lookup_find (lookup_at) reads keys[0..n], only[0..n]
        // (at[0..n]) where non-null and the table (args describe live
        // buffers of this storage), and writes, where non-null,
        // values[0..n*dim] (with at: rows at[i] < the caller's row count),
        // found[0..n], scores[0..n], ptrs[0..n] and 8 counters; every
        // non-null buffer was sized for that by the caller.
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err(if p.at != 0 {
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
    /// until `l` is synchronised.
    unsafe fn k_upsert(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        mode: i32,
        p: Ptrs,
    ) -> Result<()> {
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let lost = p.lost[0] != 0;
        let plain = mode == UP_INSERT && !lost;
        let v = self.f.upsert(self.load(st), p.values != 0, self.config.dim, order.is_some(), plain, lost);
        let mut b = l.launch_builder(&v.f);
        write_args(&mut b, &args, &sc, &n, &mode, &p);
        b.arg(&p.ptrs).arg(&p.lost[0]).arg(&p.lost[1]).arg(&p.lost[2]).arg(&p.lost[3]).arg(&c);
        // SAFETY: upsert_keys reads keys[0..n], values[0..n*dim] (or writes
        // them for find_or_insert), scores[0..n] and only[0..n] where
        // non-null, locks and writes the table described by args, and
        // writes outcomes[0..n], ptrs[0..n], at most n entries to each lost_*
        // array (sized for n keys, n*dim values) and 8 counters.
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err("launching upsert_keys"))?;
        Ok(())
    }

    /// Launches `update_keys` on stream `l`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.values` (n × dim floats), `p.scores`,
    /// `p.only`, `p.outcomes`, `p.found` (absent flags; n each) are 0 or
    /// device buffers that long; `p.counters` holds 8 u64; all stay alive
    /// until `l` is synchronised.
    unsafe fn k_update(
        &self,
        l: &Arc<CudaStream>,
        st: &Storage,
        sc: ScoringArgs,
        n: u64,
        mode: i32,
        p: Ptrs,
    ) -> Result<()> {
        let c = p.counters;
        let (order, args) = self.key_order(l, st, n, p.keys, p.values != 0)?;
        let v = self.f.update(self.config.dim, order.is_some());
        let mut b = l.launch_builder(&v.f);
        write_args(&mut b, &args, &sc, &n, &mode, &p);
        b.arg(&p.found).arg(&c);
        // SAFETY: update_keys reads keys[0..n], values[0..n*dim] and
        // scores[0..n] where non-null, writes present entries of the table
        // under its bucket locks, and writes outcomes[0..n] and absent
        // flags[0..n] where non-null and 8 counters.
        unsafe { b.launch(blocks(n * v.g)?) }.map_err(dev_err("launching update_keys"))?;
        Ok(())
    }

    /// Launches `erase_keys` on stream `l`.
    ///
    /// # Safety
    /// `p.keys` holds `n` keys; `p.only` and `p.found` (erased flags) are 0
    /// or `n` bytes; `p.counters` holds 8 u64; all stay alive until `l` is
    /// synchronised.
    unsafe fn k_erase(&self, l: &CudaStream, st: &Storage, n: u64, p: Ptrs) -> Result<()> {
        let c = p.counters;
        let mut b = l.launch_builder(&self.f.erase);
        b.arg(&st.args).arg(&p.keys).arg(&n).arg(&p.only).arg(&p.found).arg(&c);
        // SAFETY: erase_keys reads keys[0..n], writes table entries under
        // their bucket locks, erased[0..n] where non-null, and 8 counters.
        unsafe { b.launch(blocks(n * 16)?) }.map_err(dev_err("launching erase_keys"))?;
        Ok(())
    }

    /// Export of positions [offset, end): counts, scan, write (all on stream `l`).
    ///
    /// # Safety
    /// `counts` holds one u32 and `offsets` one u64 more than the buckets the
    /// range spans; `out` is zeros (count only) or keys, values (× dim) and
    /// scores buffers long enough for every match of the range; all stay
    /// alive until `l` is synchronised.
    #[allow(clippy::too_many_arguments)]
    unsafe fn k_export(
        &self,
        l: &CudaStream,
        st: &Storage,
        offset: u64,
        end: u64,
        f: FilterArgs,
        counts: u64,
        offsets: u64,
        out: [u64; 3],
    ) -> Result<()> {
        let nb = (end - 1) / S - offset / S + 1;
        let mut b = l.launch_builder(&self.f.ex_count);
        b.arg(&st.args).arg(&offset).arg(&end).arg(&f).arg(&counts);
        // SAFETY: export_count reads table positions in [offset, end) and
        // writes counts[0..nb], nb = the buckets the range spans.
        unsafe { b.launch(blocks(nb * 32)?) }.map_err(dev_err("launching export_count"))?;
        let mut b = l.launch_builder(&self.f.ex_scan);
        b.arg(&counts).arg(&nb).arg(&offsets);
        // SAFETY: export_scan reads counts[0..nb] and writes offsets[0..=nb].
        unsafe { b.launch(scan_config()) }.map_err(dev_err("launching export_scan"))?;
        if out[0] != 0 {
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

    // ---- growth -------------------------------------------------------------

    /// Doubles the buckets while `incoming` more keys would pass the max load
    /// factor and the max capacity allows. Caller holds the inserter group.
    fn grow_for(&self, incoming: usize) -> Result<()> {
        let max_buckets = self.config.max_buckets();
        loop {
            let nb = self.nbuckets();
            let cap = (nb * S) as f64;
            let want = (self.size.load(Relaxed) + incoming as u64) as f64;
            if want <= self.config.max_load_factor * cap || nb * 2 > max_buckets {
                return Ok(());
            }
            self.rehash(nb * 2)?;
        }
    }

    fn nbuckets(&self) -> u64 {
        self.storage.read().nbuckets
    }

    /// Makes the next grow fail after its new storage is loaded, as a
    /// device error would; for tests of the failure path only.
    #[doc(hidden)]
    pub fn fail_next_grow(&self) {
        self.fail_grow.store(true, Relaxed);
    }

    /// Rebuilds the table with `nbuckets` buckets: every entry is exported
    /// into device buffers and loaded (scores verbatim) into new storage,
    /// which replaces the old one only once loaded: on any error the table
    /// is left as it was.
    fn rehash(&self, nbuckets: u64) -> Result<()> {
        let mut guard = self.storage.write();
        let old = &*guard;
        let mut l = self.lane()?;
        let s = l.stream.clone();
        let dim = self.config.dim;
        let slots = old.nbuckets * S;
        let nb_old = old.nbuckets as usize;
        let counts = s.alloc_zeros::<u32>(nb_old).map_err(dev_err("allocating"))?;
        let offsets = s.alloc_zeros::<u64>(nb_old + 1).map_err(dev_err("allocating"))?;
        let (cp, op) = (ptr(&counts, &s), ptr(&offsets, &s));
        let all = filter_args(&Filter::ALL);
        // SAFETY: counts and offsets span every bucket of the old storage; count pass only
        unsafe { self.k_export(&s, old, 0, slots, all, cp, op, [0, 0, 0]) }?;
        let mut total = [0u64];
        s.memcpy_dtoh(&offsets.slice(nb_old..nb_old + 1), &mut total).map_err(dev_err("reading the entry count"))?;
        s.synchronize().map_err(dev_err("counting entries for growth"))?;
        let size = total[0] as usize;
        let keys = s.alloc_zeros::<u64>(size.max(1)).map_err(dev_err("allocating"))?;
        let values = s.alloc_zeros::<f32>((size * dim).max(1)).map_err(dev_err("allocating"))?;
        let scores = s.alloc_zeros::<u64>(size.max(1)).map_err(dev_err("allocating"))?;
        let out = [ptr(&keys, &s), ptr(&values, &s), ptr(&scores, &s)];
        // SAFETY: counts / offsets span every bucket; the outputs hold the
        // `size` entries the count pass found.
        unsafe { self.k_export(&s, old, 0, slots, all, cp, op, out) }?;
        s.synchronize().map_err(dev_err("exporting for growth"))?;
        drop(counts);
        let new = Storage::new(&self.dev, &self.config, &self.f.clear, &s, nbuckets)?;
        self.zero_counters(&mut l)?;
        let p = Ptrs { keys: out[0], values: out[1], scores: out[2], ..Ptrs::default() };
        // SAFETY: keys, values and scores hold the `size` exported entries; the counters are the lane's
        unsafe {
            self.k_upsert(
                &s,
                &new,
                self.scoring(true),
                size as u64,
                UP_INSERT,
                Ptrs { counters: ptr(&l.counters, &s), ..p },
            )
        }?;
        let c = self.read_counters(&mut l)?;
        if self.fail_grow.swap(false, Relaxed) {
            return Err(Error::Device("growing the table: injected failure".into()));
        }
        // Only now, with every entry in the new storage, is the old one dropped.
        *guard = new;
        self.size.store(c.summary.inserted, Relaxed);
        self.counters.evictions.fetch_add(c.summary.evicted + c.summary.rejected, Relaxed);
        drop((keys, values, scores, offsets));
        self.put_lane(l);
        Ok(())
    }

    // ---- host-buffer batches -------------------------------------------------

    /// Copies `src` into the lane buffer `buf` (grown as needed) through
    /// the lane's staging memory; returns the buffer's address.
    fn upload<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        stage: &mut Staging,
        buf: &mut Option<CudaSlice<T>>,
        src: &[T],
    ) -> Result<u64> {
        ensure(stream, buf, src.len())?;
        let dst = ptr(buf.as_ref().expect("ensured"), stream);
        // SAFETY: `buf` holds at least src.len() elements and belongs to the
        // lane, whose stream orders this copy before the kernels reading it.
        unsafe { stage.upload(stream, src, dst) }?;
        Ok(dst)
    }

    fn scratch<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        buf: &mut Option<CudaSlice<T>>,
        n: usize,
    ) -> Result<u64> {
        ensure(stream, buf, n)?;
        Ok(ptr(buf.as_ref().expect("ensured"), stream))
    }

    /// Queues the transfer of the first `len` elements of the lane buffer
    /// `buf` into the lane's staging memory (read after `stage.sync`).
    fn fetch<T: DeviceRepr>(
        stream: &Arc<CudaStream>,
        stage: &mut Staging,
        buf: &Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<Region<T>> {
        let src = match buf {
            Some(b) if b.len() >= len => ptr(b, stream),
            _ if len == 0 => 0,
            _ => panic!("fetching {len} elements from a lane buffer sized for fewer"),
        };
        // SAFETY: `buf` holds at least len elements and belongs to the lane;
        // its stream orders this copy after the kernels writing it.
        unsafe { stage.fetch(stream, src, len) }
    }

    /// Rounds that give a small batch the CPU backend's index order: keys
    /// sharing a candidate bucket run in index order, each round in
    /// parallel. `None`: one launch (no shared bucket, or a batch above
    /// [`SEQUENTIAL_BATCH`] keys, whose order is unspecified).
    fn rounds(&self, keys: &[u64], nbuckets: u64) -> Option<(Vec<u32>, u32)> {
        if keys.len() < 2 || keys.len() > SEQUENTIAL_BATCH {
            return None;
        }
        let dual = self.config.mode == BucketMode::Dual;
        let mut last: HashMap<u64, u32> = HashMap::with_capacity(keys.len() * 2);
        let mut round = vec![0u32; keys.len()];
        let mut max = 0;
        for (i, &k) in keys.iter().enumerate() {
            let b1 = bucket1(k, nbuckets);
            let b2 = if dual { bucket2(k, nbuckets) } else { b1 };
            let r = match last.get(&b1).copied().max(last.get(&b2).copied()) {
                Some(x) => x + 1,
                None => 0,
            };
            round[i] = r;
            max = max.max(r);
            last.insert(b1, r);
            last.insert(b2, r);
        }
        (max > 0).then_some((round, max))
    }

    /// Runs `launch` once per round of `keys` (see [`Self::rounds`]), with
    /// the lane's flags2 buffer holding which keys run (also restricted to
    /// `only`, when given). Counters accumulate over the rounds.
    fn in_rounds(
        &self,
        l: &mut Lane,
        keys: &[u64],
        nbuckets: u64,
        only: Option<&[u8]>,
        mut launch: impl FnMut(&Lane, u64) -> Result<()>,
    ) -> Result<()> {
        let s = l.stream.clone();
        match self.rounds(keys, nbuckets) {
            None => {
                let p = match only {
                    Some(o) => Self::upload(&s, &mut l.stage, &mut l.flags2, o)?,
                    None => 0,
                };
                launch(l, p)
            }
            Some((round, max)) => {
                let mut flags = vec![0u8; keys.len()];
                for r in 0..=max {
                    let mut any = false;
                    for i in 0..keys.len() {
                        flags[i] = (round[i] == r && only.is_none_or(|o| o[i] != 0)) as u8;
                        any |= flags[i] != 0;
                    }
                    if any {
                        // Each round's flags take their own staging region: no wait
                        // before flags is rewritten for the next round.
                        let p = Self::upload(&s, &mut l.stage, &mut l.flags2, &flags)?;
                        launch(l, p)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The shared body of insert_or_assign, insert_and_evict, load,
    /// find_or_insert and the insert phase of accum_or_assign. Caller holds
    /// the inserter group and has checked the arguments. `only`: the keys to
    /// process (accum_or_assign's absent ones). Returns the counts, what lost
    /// its slot, and the raw outcome bytes when asked for.
    #[allow(clippy::too_many_arguments)]
    fn upsert_host(
        &self,
        l: &mut Lane,
        mode: i32,
        keys: &[u64],
        incoming: usize,
        values: Rows<'_>,
        scores: Option<&[u64]>,
        verbatim: bool,
        only: Option<&[u8]>,
        want_outcomes: bool,
        keep_lost: bool,
    ) -> Result<(Counts, Evictions, Vec<u8>)> {
        self.grow_for(incoming)?;
        let guard = self.storage.read();
        let st = &*guard;
        let s = l.stream.clone();
        let dim = self.config.dim;
        let n = keys.len();
        let mut p = Ptrs {
            keys: Self::upload(&s, &mut l.stage, &mut l.keys, keys)?,
            values: Self::upload(&s, &mut l.stage, &mut l.values, values.input())?,
            counters: ptr(&l.counters, &s),
            ..Ptrs::default()
        };
        if let Some(sc) = scores {
            p.scores = Self::upload(&s, &mut l.stage, &mut l.scores, sc)?;
        }
        if want_outcomes {
            p.outcomes = Self::scratch(&s, &mut l.flags, n)?;
        }
        if keep_lost {
            p.lost = [
                Self::scratch(&s, &mut l.lost_keys, n)?,
                Self::scratch(&s, &mut l.lost_values, n * dim)?,
                Self::scratch(&s, &mut l.lost_scores, n)?,
                Self::scratch(&s, &mut l.lost_kinds, n)?,
            ];
        }
        self.zero_counters(l)?;
        let sc = self.scoring(verbatim);
        self.in_rounds(l, keys, st.nbuckets, only, |_, o| {
            // SAFETY: keys, values, scores, outcomes and the lost buffers were uploaded or sized above for
            // these n keys, flags2 by in_rounds
            unsafe { self.k_upsert(&s, st, sc, n as u64, mode, Ptrs { only: o, ..p }) }
        })?;
        let rows = match values {
            Rows::InOut(_) => Some(Self::fetch(&s, &mut l.stage, &l.values, n * dim)?),
            Rows::In(_) => None,
        };
        let flags = Self::fetch(&s, &mut l.stage, &l.flags, if want_outcomes { n } else { 0 })?;
        let c = self.read_counters(l)?;
        if let (Some(r), Rows::InOut(out)) = (&rows, values) {
            l.stage.read_into(r, out);
        }
        let raw = l.stage.read(&flags).to_vec();
        let mut lost = Evictions::default();
        if keep_lost && c.lost > 0 {
            let m = c.lost as usize;
            let k = Self::fetch(&s, &mut l.stage, &l.lost_keys, m)?;
            let v = Self::fetch(&s, &mut l.stage, &l.lost_values, m * dim)?;
            let sc = Self::fetch(&s, &mut l.stage, &l.lost_scores, m)?;
            let kinds = Self::fetch(&s, &mut l.stage, &l.lost_kinds, m)?;
            l.stage.sync(&s)?;
            lost.keys = l.stage.read(&k).to_vec();
            lost.values = l.stage.read(&v).to_vec();
            lost.scores = l.stage.read(&sc).to_vec();
            lost.kinds =
                l.stage.read(&kinds).iter().map(|&k| if k == 0 { Lost::Evicted } else { Lost::Rejected }).collect();
        }
        self.size.fetch_add(c.summary.inserted, Relaxed);
        self.counters.summary(&c.summary);
        Ok((c, lost, raw))
    }

    fn with_lane<R>(&self, f: impl FnOnce(&mut Lane) -> Result<R>) -> Result<R> {
        let mut l = self.lane()?;
        let r = f(&mut l);
        if r.is_ok() {
            self.put_lane(l);
        }
        r
    }

    /// A reader-group batch of `keys` (`op`): takes the group and counts the
    /// op; unless the batch is empty, runs `f` on a lane with the storage
    /// and `Ptrs` holding the uploaded keys and the lane's counters,
    /// cleared; counts the hits `f` returns as lookups.
    fn read_batch(
        &self,
        op: Op,
        keys: &[u64],
        f: impl FnOnce(&Storage, &mut Lane, Ptrs) -> Result<u64>,
    ) -> Result<usize> {
        let n = keys.len();
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(op, n);
        if n == 0 {
            return Ok(0);
        }
        let guard = self.storage.read();
        let st = &*guard;
        let hits = self.with_lane(|l| {
            let s = l.stream.clone();
            let keys = Self::upload(&s, &mut l.stage, &mut l.keys, keys)?;
            self.zero_counters(l)?;
            let counters = ptr(&l.counters, &s);
            f(st, l, Ptrs { keys, counters, ..Ptrs::default() })
        })?;
        self.counters.lookups(hits, n);
        Ok(hits as usize)
    }

    #[allow(clippy::too_many_arguments)]
    fn upsert_batch(
        &self,
        op: Op,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        verbatim: bool,
        outcomes: Option<&mut [Outcome]>,
        keep_lost: bool,
    ) -> Result<(Counts, Evictions)> {
        let n = keys.len();
        // Verbatim scores (load) are checked by the caller, not against the policy.
        let policy_scores = if !verbatim { scores } else { None };
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            policy_scores,
            !verbatim,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(op, n);
        if n == 0 {
            return Ok(Default::default());
        }
        let want = outcomes.is_some();
        let (c, lost, raw) = self.with_lane(|l| {
            self.upsert_host(l, UP_INSERT, keys, n, Rows::In(values), scores, verbatim, None, want, keep_lost)
        })?;
        set_outcomes(outcomes, &raw, None);
        Ok((c, lost))
    }

    fn update_batch(
        &self,
        op: Op,
        mode: i32,
        keys: &[u64],
        values: Option<&[f32]>,
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(op, n);
        if n == 0 {
            return Ok(Summary::default());
        }
        let guard = self.storage.read();
        let st = &*guard;
        let want = outcomes.is_some();
        let (summary, raw) = self.with_lane(|l| self.update_host(l, st, mode, keys, values, scores, want, false))?;
        set_outcomes(outcomes, &raw, None);
        Ok(summary)
    }

    /// An update kernel over `keys` in rounds; returns the summary and the
    /// raw outcomes (when asked); with `flag_absent`, the lane's flags
    /// buffer ends up holding 1 for each absent key (downloaded into the
    /// returned vector instead of outcomes).
    #[allow(clippy::too_many_arguments)]
    fn update_host(
        &self,
        l: &mut Lane,
        st: &Storage,
        mode: i32,
        keys: &[u64],
        values: Option<&[f32]>,
        scores: Option<&[u64]>,
        want_outcomes: bool,
        flag_absent: bool,
    ) -> Result<(Summary, Vec<u8>)> {
        let s = l.stream.clone();
        let n = keys.len();
        let mut p = Ptrs {
            keys: Self::upload(&s, &mut l.stage, &mut l.keys, keys)?,
            counters: ptr(&l.counters, &s),
            ..Ptrs::default()
        };
        if let Some(v) = values {
            p.values = Self::upload(&s, &mut l.stage, &mut l.values, v)?;
        }
        if let Some(sc) = scores {
            p.scores = Self::upload(&s, &mut l.stage, &mut l.scores, sc)?;
        }
        if want_outcomes {
            p.outcomes = Self::scratch(&s, &mut l.flags, n)?;
        }
        if flag_absent {
            p.found = Self::scratch(&s, &mut l.lost_kinds, n)?;
        }
        self.zero_counters(l)?;
        let sc = self.scoring(false);
        self.in_rounds(l, keys, st.nbuckets, None, |_, o| {
            // SAFETY: keys, values, scores, outcomes and absent flags were uploaded or sized above for these
            // n keys, flags2 by in_rounds
            unsafe { self.k_update(&s, st, sc, n as u64, mode, Ptrs { only: o, ..p }) }
        })?;
        let flags = if flag_absent {
            Self::fetch(&s, &mut l.stage, &l.lost_kinds, n)?
        } else {
            Self::fetch(&s, &mut l.stage, &l.flags, if want_outcomes { n } else { 0 })?
        };
        let c = self.read_counters(l)?;
        Ok((c.summary, l.stage.read(&flags).to_vec()))
    }
}

/// The value rows of an upsert: uploaded only, or uploaded and then
/// overwritten with the stored rows (find_or_insert).
enum Rows<'a> {
    In(&'a [f32]),
    InOut(&'a mut [f32]),
}

impl Rows<'_> {
    fn input(&self) -> &[f32] {
        match self {
            Rows::In(v) => v,
            Rows::InOut(v) => v,
        }
    }
}

/// Writes raw outcome bytes into the caller's array (only where `mask` is
/// non-zero, when given).
fn set_outcomes(out: Option<&mut [Outcome]>, raw: &[u8], mask: Option<&[u8]>) {
    if let Some(o) = out {
        for (i, (d, &r)) in o.iter_mut().zip(raw).enumerate() {
            if mask.is_none_or(|m| m[i] != 0) {
                *d = Outcome::from_u8(r).unwrap_or(Outcome::Absent);
            }
        }
    }
}

/// An operation on device-resident buffers ([`CudaTable::run_device`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceOp {
    /// Values, found flags and scores of `keys`.
    Find,
    /// Device addresses of the values of `keys` (0 for misses), into `ptrs`.
    FindPtr,
    /// Found flags.
    Contains,
    /// Upsert `values`.
    InsertOrAssign,
    /// Upsert, with what lost its slot compacted into the `lost_*` buffers.
    InsertAndEvict,
    /// Stored rows of present keys into `values`; the given rows inserted otherwise.
    FindOrInsert,
    /// Present or newly inserted keys' value addresses into `ptrs` (0 if
    /// refused); new rows are left for the caller to write.
    FindOrInsertPtr,
    /// Overwrite present keys' values.
    Assign,
    /// Remove keys.
    Erase,
    /// Insert or overwrite `values` with the given `scores` kept verbatim
    /// (restores and resharding).
    Load,
    /// Export `n` slots from `offset`, compacted into `out_*`.
    Export {
        /// First slot position.
        offset: u64,
        /// Predicate.
        filter: Filter,
    },
}

/// Device buffers for batches of up to `n` keys (see [`CudaTable::run_device`]).
pub struct DeviceBatch {
    /// Capacity in keys.
    pub n: usize,
    /// Keys in.
    pub keys: CudaSlice<u64>,
    /// Values in or out, `n * dim`.
    pub values: CudaSlice<f32>,
    /// Scores out (find).
    pub scores: CudaSlice<u64>,
    /// Found / erased flags out.
    pub found: CudaSlice<u8>,
    /// Outcomes out.
    pub outcomes: CudaSlice<u8>,
    /// Value addresses out.
    pub ptrs: CudaSlice<u64>,
    /// insert_and_evict output: keys, values, scores, kinds.
    pub lost_keys: CudaSlice<u64>,
    /// insert_and_evict output values.
    pub lost_values: CudaSlice<f32>,
    /// insert_and_evict output scores.
    pub lost_scores: CudaSlice<u64>,
    /// insert_and_evict output kinds (0 evicted, 1 rejected).
    pub lost_kinds: CudaSlice<u8>,
    /// Export output keys (`n`).
    pub out_keys: CudaSlice<u64>,
    /// Export output values.
    pub out_values: CudaSlice<f32>,
    /// Export output scores.
    pub out_scores: CudaSlice<u64>,
    counts: CudaSlice<u32>,
    offsets: CudaSlice<u64>,
    counters: CudaSlice<u64>,
    /// The stream every operation on this batch runs on.
    pub stream: Arc<CudaStream>,
}

/// What [`CudaTable::run_device`] measured and counted.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRun {
    /// Kernel time between CUDA events, in milliseconds.
    pub ms: f32,
    /// Counts of the batch.
    pub counts: Counts,
}

impl CudaTable {
    /// Allocates device buffers for batches of up to `n` keys, on a new stream.
    pub fn device_batch(&self, n: usize) -> Result<DeviceBatch> {
        let s = self.dev.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let dim = self.config.dim;
        let n1 = n.max(1);
        let a = |e| dev_err("allocating a device batch")(e);
        let nb = n1 / BUCKET_SLOTS + 2;
        Ok(DeviceBatch {
            n,
            keys: s.alloc_zeros(n1).map_err(a)?,
            values: s.alloc_zeros(n1 * dim).map_err(a)?,
            scores: s.alloc_zeros(n1).map_err(a)?,
            found: s.alloc_zeros(n1).map_err(a)?,
            outcomes: s.alloc_zeros(n1).map_err(a)?,
            ptrs: s.alloc_zeros(n1).map_err(a)?,
            lost_keys: s.alloc_zeros(n1).map_err(a)?,
            lost_values: s.alloc_zeros(n1 * dim).map_err(a)?,
            lost_scores: s.alloc_zeros(n1).map_err(a)?,
            lost_kinds: s.alloc_zeros(n1).map_err(a)?,
            out_keys: s.alloc_zeros(n1 + BUCKET_SLOTS).map_err(a)?,
            out_values: s.alloc_zeros((n1 + BUCKET_SLOTS) * dim).map_err(a)?,
            out_scores: s.alloc_zeros(n1 + BUCKET_SLOTS).map_err(a)?,
            counts: s.alloc_zeros(nb).map_err(a)?,
            offsets: s.alloc_zeros(nb + 1).map_err(a)?,
            counters: s.alloc_zeros(NCOUNTERS).map_err(a)?,
            stream: s,
        })
    }

    /// Runs `op` on the first `n` keys of `b` (already on the device), under
    /// the op's lock group; results stay in `b`. Returns the kernel time
    /// (CUDA events) and the batch's counts.
    pub fn run_device(&self, op: DeviceOp, b: &mut DeviceBatch, n: usize) -> Result<DeviceRun> {
        if n > b.n {
            return Err(Error::Config(format!("{n} keys for a device batch of {}", b.n)));
        }
        let s = b.stream.clone();
        s.memset_zeros(&mut b.counters).map_err(dev_err("clearing counters"))?;
        let raw = Raw {
            p: Ptrs {
                keys: ptr(&b.keys, &s),
                values: ptr(&b.values, &s),
                scores: ptr(&b.scores, &s),
                found: ptr(&b.found, &s),
                ptrs: ptr(&b.ptrs, &s),
                lost: [ptr(&b.lost_keys, &s), ptr(&b.lost_values, &s), ptr(&b.lost_scores, &s), ptr(&b.lost_kinds, &s)],
                counters: ptr(&b.counters, &s),
                ..Ptrs::default()
            },
            out: [ptr(&b.out_keys, &s), ptr(&b.out_values, &s), ptr(&b.out_scores, &s)],
            counts: ptr(&b.counts, &s),
            offsets: ptr(&b.offsets, &s),
        };
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = s.record_event(timing).map_err(dev_err("recording an event"))?;
        // SAFETY: every pointer is one of the batch's buffers, allocated by
        // device_batch for `b.n` >= n keys (n × dim floats, and the export
        // outputs for n + 128 slots, at least the matches of n slots), and
        // the stream is synchronised below before the batch can be reused.
        let pending = unsafe { self.enqueue(op, &s, n, raw) }?;
        let end = s.record_event(timing).map_err(dev_err("recording an event"))?;
        let c = s.clone_dtoh(&b.counters).map_err(dev_err("reading counters"))?;
        s.synchronize().map_err(dev_err("synchronizing"))?;
        let ms = start.elapsed_ms(&end).map_err(dev_err("reading events"))?;
        Ok(DeviceRun { ms, counts: self.complete(pending, &c) })
    }

    /// Takes `op`'s lock group and launches it on stream `s` over `n` keys at
    /// the device addresses of `r`, without waiting. The batch's counters
    /// (`r.p.counters`, 8 u64, zeroed by the caller) are read after the
    /// stream is synchronised and handed to [`CudaTable::complete`] with the
    /// returned [`Pending`], which holds the lock group until then.
    ///
    /// # Safety
    /// Every non-zero address of `r` is a buffer on this table's device,
    /// sized for `n` keys as the op's kernel needs (see `k_lookup`,
    /// `k_upsert`, `k_update`, `k_erase`; export outputs for every match of
    /// `n` slots), alive and untouched by other streams until `s` is
    /// synchronised.
    pub(crate) unsafe fn enqueue(&self, op: DeviceOp, s: &Arc<CudaStream>, n: usize, r: Raw) -> Result<Pending<'_>> {
        // SAFETY: forwarded contract; the lock group is taken here.
        let p = unsafe { self.enqueue_in(op, s, n, r, Some(n)) }?;
        self.book(op, n);
        Ok(p)
    }

    /// [`CudaTable::enqueue`] of the first part of one batch served in
    /// parts: takes the lock group and makes room for `incoming` keys (an
    /// upper bound of the batch); the other parts follow with
    /// [`CudaTable::enqueue_held`]. The caller books the batch
    /// ([`CudaTable::book`], [`Pending::set_keys`]).
    ///
    /// # Safety
    /// As [`CudaTable::enqueue`].
    pub(crate) unsafe fn enqueue_first(
        &self,
        op: DeviceOp,
        s: &Arc<CudaStream>,
        n: usize,
        r: Raw,
        incoming: usize,
    ) -> Result<Pending<'_>> {
        // SAFETY: forwarded contract; the lock group is taken here.
        unsafe { self.enqueue_in(op, s, n, r, Some(incoming)) }
    }

    /// A further part of the batch begun by [`CudaTable::enqueue_first`],
    /// inside the lock group its [`Pending`] holds (which must not complete
    /// before this part's stream is synchronised); fold the returned
    /// [`Pending`] into it with [`Pending::absorb`].
    ///
    /// # Safety
    /// As [`CudaTable::enqueue`].
    pub(crate) unsafe fn enqueue_held(
        &self,
        op: DeviceOp,
        s: &Arc<CudaStream>,
        n: usize,
        r: Raw,
    ) -> Result<Pending<'_>> {
        // SAFETY: forwarded contract; the caller holds the group.
        unsafe { self.enqueue_in(op, s, n, r, None) }
    }

    /// Counts one `op` of `keys` keys in the table's stats.
    pub(crate) fn book(&self, op: DeviceOp, keys: usize) {
        let stat = match op {
            DeviceOp::Find | DeviceOp::FindPtr => Op::Find,
            DeviceOp::Contains => Op::Contains,
            DeviceOp::InsertOrAssign | DeviceOp::Load => Op::InsertOrAssign,
            DeviceOp::InsertAndEvict => Op::InsertAndEvict,
            DeviceOp::FindOrInsert | DeviceOp::FindOrInsertPtr => Op::FindOrInsert,
            DeviceOp::Assign => Op::Assign,
            DeviceOp::Erase => Op::Erase,
            DeviceOp::Export { .. } => Op::Export,
        };
        self.counters.op(stat, keys);
    }

    /// `incoming`: when this call begins a batch, the keys to make room
    /// for (takes the lock group and grows the table); None for a further
    /// part.
    unsafe fn enqueue_in(
        &self,
        op: DeviceOp,
        s: &Arc<CudaStream>,
        n: usize,
        r: Raw,
        incoming: Option<usize>,
    ) -> Result<Pending<'_>> {
        let group = match op {
            DeviceOp::Find | DeviceOp::FindPtr | DeviceOp::Contains | DeviceOp::Export { .. } => Group::Reader,
            DeviceOp::Assign => Group::Updater,
            _ => Group::Inserter,
        };
        // From here on, an early return drops `pending`, which waits for
        // `s` before it lets the lock group go.
        let pending = Pending {
            op,
            n,
            streams: vec![s.clone()],
            synchronized: false,
            _guard: incoming.map(|_| self.lock.acquire(group)),
        };
        if let Some(total) = incoming {
            if group == Group::Inserter && op != DeviceOp::Erase {
                self.grow_for(total)?;
            }
        }
        let st_guard = self.storage.read();
        let st = &*st_guard;
        let base = Ptrs { keys: r.p.keys, counters: r.p.counters, only: r.p.only, ..Ptrs::default() };
        let p = r.p;
        let n64 = n as u64;
        // SAFETY: the caller's contract covers every address passed on.
        unsafe {
            match op {
                DeviceOp::Find => {
                    let p = Ptrs { values: p.values, found: p.found, scores: p.scores, ..base };
                    self.k_lookup(s, st, n64, p)?
                }
                DeviceOp::FindPtr => self.k_lookup(s, st, n64, Ptrs { ptrs: p.ptrs, ..base })?,
                DeviceOp::Contains => self.k_lookup(s, st, n64, Ptrs { found: p.found, ..base })?,
                DeviceOp::InsertOrAssign | DeviceOp::InsertAndEvict | DeviceOp::FindOrInsert => {
                    let mut q = Ptrs { values: p.values, ..base };
                    if op == DeviceOp::InsertAndEvict {
                        q.lost = p.lost;
                    }
                    let mode = if op == DeviceOp::FindOrInsert { UP_FIND_OR_INSERT } else { UP_INSERT };
                    self.k_upsert(s, st, self.scoring(false), n64, mode, q)?
                }
                DeviceOp::Load => {
                    let q = Ptrs { values: p.values, scores: p.scores, ..base };
                    self.k_upsert(s, st, self.scoring(true), n64, UP_INSERT, q)?
                }
                DeviceOp::FindOrInsertPtr => self.k_upsert(
                    s,
                    st,
                    self.scoring(false),
                    n64,
                    UP_FIND_OR_INSERT_PTR,
                    Ptrs { ptrs: p.ptrs, ..base },
                )?,
                DeviceOp::Assign => {
                    self.k_update(s, st, self.scoring(false), n64, UPD_ASSIGN, Ptrs { values: p.values, ..base })?
                }
                DeviceOp::Erase => self.k_erase(s, st, n64, Ptrs { found: p.found, ..base })?,
                DeviceOp::Export { offset, filter } => {
                    let cap = st.nbuckets * S;
                    let end = offset.saturating_add(n64).min(cap);
                    if offset < end {
                        self.k_export(s, st, offset, end, filter_args(&filter), r.counts, r.offsets, r.out)?;
                    }
                }
            }
        }
        Ok(pending)
    }

    /// Books a finished [`CudaTable::enqueue`]: `c` are its 8 counters,
    /// read after its stream was synchronised. Releases the lock group.
    pub(crate) fn complete(&self, mut pending: Pending<'_>, c: &[u64]) -> Counts {
        pending.synchronized = true;
        let counts = counts(c);
        match pending.op {
            DeviceOp::Find | DeviceOp::FindPtr | DeviceOp::Contains => self.counters.lookups(counts.hits, pending.n),
            DeviceOp::Erase => {
                self.size.fetch_sub(counts.erased, Relaxed);
            }
            DeviceOp::Export { .. } | DeviceOp::Assign => {}
            DeviceOp::Load => {
                self.size.fetch_add(counts.summary.inserted, Relaxed);
                self.counters.evictions.fetch_add(counts.summary.evicted + counts.summary.rejected, Relaxed);
            }
            _ => {
                self.size.fetch_add(counts.summary.inserted, Relaxed);
                self.counters.summary(&counts.summary);
            }
        }
        counts
    }
}

/// Device addresses of one batch for [`CudaTable::enqueue`] (0 = none).
#[derive(Default, Clone, Copy)]
pub(crate) struct Raw {
    /// Keys, values, scores, found flags, pointers, lost outputs, counters.
    pub(crate) p: Ptrs,
    /// Export outputs: keys, values, scores.
    pub(crate) out: [u64; 3],
    /// Export scratch: per-bucket counts (u32) and offsets (u64, one more).
    pub(crate) counts: u64,
    pub(crate) offsets: u64,
}

/// A launched batch whose lock group is held until [`CudaTable::complete`].
/// Dropped without it (an error path), it first waits for every stream its
/// parts launched on, so that no kernel still runs on the table's storage
/// once the group is released (a grow could free it).
pub(crate) struct Pending<'a> {
    op: DeviceOp,
    n: usize,
    /// The streams the batch's kernels run on.
    streams: Vec<Arc<CudaStream>>,
    /// Set by [`CudaTable::complete`], whose caller synchronised them.
    synchronized: bool,
    /// Declared last: dropped after [`Pending::drop`] has synchronised.
    _guard: Option<crate::lock::GroupGuard<'a>>,
}

impl Pending<'_> {
    /// Folds a further part of the same batch into this one (its keys are
    /// booked with this one's counters, its stream waited for with this one's).
    pub(crate) fn absorb(&mut self, mut part: Pending<'_>) {
        self.n += part.n;
        for s in std::mem::take(&mut part.streams) {
            if !self.streams.iter().any(|x| Arc::ptr_eq(x, &s)) {
                self.streams.push(s);
            }
        }
    }

    /// Sets the keys the batch is booked with (its parts may have launched
    /// over filtered ranges).
    pub(crate) fn set_keys(&mut self, n: usize) {
        self.n = n;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.synchronized {
            for s in &self.streams {
                // Best effort on an error path: a stream that cannot be
                // waited for has failed, and its kernels with it.
                let _ = s.synchronize();
            }
        }
    }
}

impl Shard for CudaTable {
    fn config(&self) -> &TableConfig {
        &self.config
    }

    fn capacity(&self) -> u64 {
        self.nbuckets() * S
    }

    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }

    fn set_global_epoch(&self, epoch: u32) {
        self.epoch.store(epoch, Relaxed);
    }

    fn find(&self, keys: &[u64], values: &mut [f32], found: &mut [bool], scores: Option<&mut [u64]>) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, Some(values.len()), found.len(), scores.as_ref().map(|s| s.len()))?;
        let dim = self.config.dim;
        self.read_batch(Op::Find, keys, |st, l, base| {
            let s = l.stream.clone();
            let mut p = Ptrs {
                values: Self::scratch(&s, &mut l.values, n * dim)?,
                found: Self::scratch(&s, &mut l.flags, n)?,
                ..base
            };
            if scores.is_some() {
                p.scores = Self::scratch(&s, &mut l.scores, n)?;
            }
            // SAFETY: keys uploaded, values / flags / scores sized above for these n keys
            unsafe { self.k_lookup(&s, st, n as u64, p) }?;
            // Values into pinned memory (a daemon's response frame) come
            // straight from the device once every key is known to hit: no
            // staging copy. Else they pass through the staging memory.
            let direct = crate::cuda::is_pinned_host(values.as_ptr() as *const u8, std::mem::size_of_val(values));
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let v = if direct { None } else { Some(Self::fetch(&s, &mut l.stage, &l.values, n * dim)?) };
            let sc = Self::fetch(&s, &mut l.stage, &l.scores, if scores.is_some() { n } else { 0 })?;
            let c = self.read_counters(l)?;
            for (o, x) in found.iter_mut().zip(l.stage.read(&f)) {
                *o = *x != 0;
            }
            if direct && c.hits == n as u64 {
                let bytes = std::mem::size_of_val(values);
                // SAFETY: `values` is page-locked host memory of `bytes`
                // bytes (checked above), borrowed mutably for this call,
                // which waits for the copy below; the lane's values buffer
                // holds n * dim floats written by the lookup, ordered
                // before the copy by the stream.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                        values.as_mut_ptr() as *mut std::ffi::c_void,
                        p.values,
                        bytes,
                        s.cu_stream(),
                    )
                }
                .result()
                .map_err(dev_err("copying rows into a pinned frame"))?;
                s.synchronize().map_err(dev_err("synchronizing"))?;
                if let Some(out) = scores {
                    l.stage.read_into(&sc, out);
                }
                return Ok(c.hits);
            }
            let v = match v {
                Some(v) => v,
                None => {
                    let v = Self::fetch(&s, &mut l.stage, &l.values, n * dim)?;
                    l.stage.sync(&s)?;
                    v
                }
            };
            if c.hits == n as u64 {
                // Every key hit: the rows (and scores) come straight back.
                l.stage.read_into(&v, values);
                if let Some(out) = scores {
                    l.stage.read_into(&sc, out);
                }
                return Ok(c.hits);
            }
            // Misses leave the caller's rows untouched: copy the hits only.
            let (v, sc) = (l.stage.read(&v), l.stage.read(&sc));
            for i in (0..n).filter(|&i| found[i]) {
                values[i * dim..(i + 1) * dim].copy_from_slice(&v[i * dim..(i + 1) * dim]);
            }
            if let Some(out) = scores {
                for i in (0..n).filter(|&i| found[i]) {
                    out[i] = sc[i];
                }
            }
            Ok(c.hits)
        })
    }

    /// Into page-locked host memory mapped for the device (a daemon's
    /// [`crate::cuda::HostFrame`]), the lookup kernel writes each row at its
    /// target row itself, a miss as zeros, and only the flags come back
    /// through the lane: no copy of a row on the host. Other memory gets the
    /// rows through [`Shard::find`].
    fn find_at(&self, keys: &[u64], at: &[u32], values: &mut [f32], found: &mut [u8]) -> Result<usize> {
        let n = keys.len();
        check::keys(keys)?;
        check::rows_at(&self.config, n, at, values.len(), found.len())?;
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let bytes = std::mem::size_of_val(values);
        let Some(rows) = crate::cuda::device_address_of_host(values.as_ptr() as *const u8, bytes) else {
            return crate::find_at_by_find(self, keys, at, values, found);
        };
        self.read_batch(Op::Find, keys, |st, l, base| {
            let s = l.stream.clone();
            let p = Ptrs {
                at: Self::upload(&s, &mut l.stage, &mut l.at, at)?,
                values: rows,
                found: Self::scratch(&s, &mut l.flags, n)?,
                ..base
            };
            // SAFETY: keys, at and the flags sized for these n keys; at is
            // strictly increasing and below found.len() (checked), and
            // values, mapped host memory (looked up above), holds
            // found.len() rows (checked) and is borrowed mutably for this
            // call, which waits for the kernel (read_counters synchronises
            // the stream).
            unsafe { self.k_lookup(&s, st, n as u64, p) }?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let hits = self.read_counters(l)?.hits;
            for (&r, &x) in at.iter().zip(l.stage.read(&f)) {
                found[r as usize] = x;
            }
            Ok(hits)
        })
    }

    fn contains(&self, keys: &[u64], found: &mut [bool]) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, None, found.len(), None)?;
        self.read_batch(Op::Contains, keys, |st, l, base| {
            let s = l.stream.clone();
            let p = Ptrs { found: Self::scratch(&s, &mut l.flags, n)?, ..base };
            // SAFETY: keys uploaded, flags sized above for these n keys
            unsafe { self.k_lookup(&s, st, n as u64, p) }?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, n)?;
            let c = self.read_counters(l)?;
            for (o, x) in found.iter_mut().zip(l.stage.read(&f)) {
                *o = *x != 0;
            }
            Ok(c.hits)
        })
    }

    fn insert_or_assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        Ok(self.upsert_batch(Op::InsertOrAssign, keys, values, scores, false, outcomes, false)?.0.summary)
    }

    fn insert_and_evict(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Evictions> {
        Ok(self.upsert_batch(Op::InsertAndEvict, keys, values, scores, false, outcomes, true)?.1)
    }

    fn find_or_insert(
        &self,
        keys: &[u64],
        values: &mut [f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::FindOrInsert, n);
        if n == 0 {
            return Ok(Summary::default());
        }
        let want = outcomes.is_some();
        let (c, _, raw) = self.with_lane(|l| {
            self.upsert_host(l, UP_FIND_OR_INSERT, keys, n, Rows::InOut(values), scores, false, None, want, false)
        })?;
        set_outcomes(outcomes, &raw, None);
        self.counters.lookups(c.summary.updated, n);
        Ok(c.summary)
    }

    fn assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            scores,
            false,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        self.update_batch(Op::Assign, UPD_ASSIGN, keys, Some(values), scores, outcomes)
    }

    fn assign_scores(&self, keys: &[u64], scores: Option<&[u64]>, outcomes: Option<&mut [Outcome]>) -> Result<Summary> {
        check::write(&self.config, keys, None, scores, false, outcomes.as_ref().map(|o| o.len()))?;
        self.update_batch(Op::AssignScores, UPD_SCORES, keys, None, scores, outcomes)
    }

    fn accum_or_assign(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        mut outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check::write(
            &self.config,
            keys,
            Some(("deltas", deltas.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        if n == 0 {
            let _g = self.lock.acquire(Group::Updater);
            self.counters.op(Op::AccumOrAssign, 0);
            return Ok(Summary::default());
        }
        let mut l = self.lane()?;
        // Phase 1, updater group: accumulate into present keys, flag absent ones.
        let (first, absent) = {
            let _g = self.lock.acquire(Group::Updater);
            self.counters.op(Op::AccumOrAssign, n);
            let guard = self.storage.read();
            let st = &*guard;
            let want = outcomes.is_some();
            let (summary, absent) = self.update_host(&mut l, st, UPD_ACCUM, keys, Some(deltas), scores, false, true)?;
            if want {
                // Present keys: Updated; the others are decided in phase 2.
                set_outcomes(
                    outcomes.as_deref_mut(),
                    &vec![Outcome::Updated as u8; n],
                    Some(&absent.iter().map(|&a| (a == 0) as u8).collect::<Vec<_>>()),
                );
            }
            (summary, absent)
        };
        if first.absent == 0 {
            self.put_lane(l);
            return Ok(first);
        }
        // Phase 2, inserter group: insert the absent keys in index order
        // (another batch may have inserted some meanwhile: those accumulate).
        let _g = self.lock.acquire(Group::Inserter);
        let want = outcomes.is_some();
        let (c, _, raw) = self.upsert_host(
            &mut l,
            UP_ACCUM,
            keys,
            first.absent as usize,
            Rows::In(deltas),
            scores,
            false,
            Some(&absent),
            want,
            false,
        )?;
        set_outcomes(outcomes, &raw, Some(&absent));
        self.put_lane(l);
        Ok(Summary { absent: 0, ..first }.merge(c.summary))
    }

    fn erase(&self, keys: &[u64], erased: Option<&mut [bool]>) -> Result<usize> {
        let n = keys.len();
        check::erase(keys, erased.as_ref().map(|e| e.len()))?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Erase, n);
        if n == 0 {
            return Ok(0);
        }
        let guard = self.storage.read();
        let st = &*guard;
        let count = self.with_lane(|l| {
            let s = l.stream.clone();
            let p = Ptrs {
                keys: Self::upload(&s, &mut l.stage, &mut l.keys, keys)?,
                found: Self::scratch(&s, &mut l.flags, n)?,
                ..Ptrs::default()
            };
            self.zero_counters(l)?;
            let p = Ptrs { counters: ptr(&l.counters, &s), ..p };
            self.in_rounds(l, keys, st.nbuckets, None, |_, o| {
                // SAFETY: keys uploaded and erased flags sized above for these n keys, flags2 by in_rounds
                unsafe { self.k_erase(&s, st, n as u64, Ptrs { only: o, ..p }) }
            })?;
            let f = Self::fetch(&s, &mut l.stage, &l.flags, if erased.is_some() { n } else { 0 })?;
            let c = self.read_counters(l)?;
            if let Some(out) = erased {
                for (o, x) in out.iter_mut().zip(l.stage.read(&f)) {
                    *o = *x != 0;
                }
            }
            Ok(c.erased)
        })?;
        self.size.fetch_sub(count, Relaxed);
        Ok(count as usize)
    }

    fn erase_if(&self, filter: &Filter) -> Result<u64> {
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::EraseIf, 0);
        let guard = self.storage.read();
        let st = &*guard;
        let removed = self.with_lane(|l| {
            self.zero_counters(l)?;
            let c = ptr(&l.counters, &l.stream);
            let fa = filter_args(filter);
            let mut b = l.stream.launch_builder(&self.f.erase_if);
            b.arg(&st.args).arg(&fa).arg(&c);
            // SAFETY: erase_if visits buckets < nbuckets (one warp each) of
            // the table described by args and writes 8 counters.
            unsafe { b.launch(blocks(st.nbuckets * 32)?) }.map_err(dev_err("launching erase_if"))?;
            let c = self.read_counters(l)?;
            Ok(c.erased)
        })?;
        self.size.fetch_sub(removed, Relaxed);
        Ok(removed)
    }

    fn clear(&self) -> Result<()> {
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Clear, 0);
        let guard = self.storage.read();
        let st = &*guard;
        self.with_lane(|l| {
            let mut b = l.stream.launch_builder(&self.f.clear);
            b.arg(&st.args);
            // SAFETY: clear_table writes positions < nbuckets * 128 and
            // buckets < nbuckets of the table described by args.
            unsafe { b.launch(blocks(st.nbuckets * S)?) }.map_err(dev_err("launching clear_table"))?;
            l.stream.synchronize().map_err(dev_err("synchronizing"))
        })?;
        self.size.store(0, Relaxed);
        Ok(())
    }

    fn export_batch_if(&self, offset: u64, n: u64, filter: &Filter) -> Result<Export> {
        let _g = self.lock.acquire(Group::Reader);
        let guard = self.storage.read();
        let st = &*guard;
        let cap = st.nbuckets * S;
        let end = offset.saturating_add(n).min(cap);
        if offset >= end {
            self.counters.op(Op::Export, 0);
            return Ok(Export::default());
        }
        let dim = self.config.dim;
        let out = self.with_lane(|l| {
            let s = l.stream.clone();
            let nb = ((end - 1) / S - offset / S + 1) as usize;
            let counts = Self::scratch(&s, &mut l.counts, nb)?;
            let offsets = Self::scratch(&s, &mut l.offsets, nb + 1)?;
            let fa = filter_args(filter);
            // SAFETY: counts and offsets were sized above for the nb buckets of the range; count pass only
            unsafe { self.k_export(&s, st, offset, end, fa, counts, offsets, [0, 0, 0]) }?;
            let total = Self::fetch(&s, &mut l.stage, &l.offsets, nb + 1)?;
            l.stage.sync(&s)?;
            let m = l.stage.read(&total)[nb] as usize;
            let mut e = Export { keys: vec![0; m], values: vec![0.0; m * dim], scores: vec![0; m] };
            if m > 0 {
                let out = [
                    Self::scratch(&s, &mut l.keys, m)?,
                    Self::scratch(&s, &mut l.values, m * dim)?,
                    Self::scratch(&s, &mut l.scores, m)?,
                ];
                // SAFETY: the outputs were sized above for the m matches the count pass found
                unsafe { self.k_export(&s, st, offset, end, fa, counts, offsets, out) }?;
                let k = Self::fetch(&s, &mut l.stage, &l.keys, m)?;
                let v = Self::fetch(&s, &mut l.stage, &l.values, m * dim)?;
                let sc = Self::fetch(&s, &mut l.stage, &l.scores, m)?;
                l.stage.sync(&s)?;
                l.stage.read_into(&k, &mut e.keys);
                l.stage.read_into(&v, &mut e.values);
                l.stage.read_into(&sc, &mut e.scores);
            }
            Ok(e)
        })?;
        self.counters.op(Op::Export, out.keys.len());
        Ok(out)
    }

    fn reserve(&self, capacity: u64) -> Result<()> {
        let max = self.config.max_buckets() * S;
        if capacity > max {
            return Err(Error::Capacity { requested: capacity, max });
        }
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Reserve, 0);
        loop {
            let nb = self.nbuckets();
            if nb * S >= capacity || nb * 2 > self.config.max_buckets() {
                return Ok(());
            }
            self.rehash(nb * 2)?;
        }
    }

    fn load(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<Summary> {
        let n = keys.len();
        check::len("scores", scores.len(), n, || format!("{n} keys"))?;
        Ok(self.upsert_batch(Op::Load, keys, values, Some(scores), true, None, false)?.0.summary)
    }

    fn stats(&self) -> ShardStats {
        let (fast, host) = {
            let s = self.storage.read();
            (s.fast_slots, s.host_slots)
        };
        let row = self.config.dim as u64 * 4;
        self.counters.stats(self.size(), self.capacity(), fast * row, host * row, self.lock.state())
    }

    fn resume_after(&self, max_score: u64) {
        crate::score::resume_after(self.config.policy, self.config.lfu_ties, max_score, &*self.clock, &self.epoch);
    }

    fn clock_score(&self) -> u64 {
        Scorer {
            policy: self.config.policy,
            now_ns: self.clock.now_ns(),
            epoch: self.epoch.load(Relaxed),
            lfu_ties: self.config.lfu_ties,
        }
        .clock_floor()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_copies_get_one_thread_per_32_floats() {
        let got: Vec<u64> = [1, 8, 32, 33, 64, 100, 128, 256, 512].iter().map(|&d| copy_threads(d)).collect();
        assert_eq!(got, [1, 1, 1, 2, 2, 4, 4, 8, 16]);
    }

    #[test]
    fn upsert_row_copies_get_one_thread_per_16_floats() {
        let got: Vec<u64> = [1, 8, 16, 17, 32, 64, 128].iter().map(|&d| upsert_copy_threads(d)).collect();
        assert_eq!(got, [1, 1, 1, 2, 2, 4, 8]);
    }

    #[test]
    fn kernel_names_follow_the_threads_per_key() {
        assert_eq!(kernel_name("upsert_keys", 8), "upsert_keys");
        assert_eq!(kernel_name("upsert_keys", 1), "upsert_keys_g1");
        assert_eq!(kernel_name("lookup_find", 16), "lookup_find_g16");
    }

    #[test]
    fn every_kernel_variant_the_host_asks_for_is_built() {
        use hkv_kernels::KernelId;
        let asked = [
            (KernelId::Lookup, "lookup_find", &LOOKUP_GROUPS[..]),
            (KernelId::Lookup, "lookup_at", &LOOKUP_GROUPS[..]),
            (KernelId::Upsert, "upsert_keys", &WRITE_GROUPS[..]),
            (KernelId::Update, "update_keys", &WRITE_GROUPS[..]),
        ];
        for (id, name) in [(KernelId::Upsert, "upsert_keys_g4_b5"), (KernelId::Update, "update_keys_g2_b5")] {
            assert!(id.symbols().contains(&name), "{name} is not built in {id:?}");
        }
        for (id, base, gs) in asked {
            for &g in gs {
                let name = kernel_name(base, g);
                assert!(id.symbols().contains(&name.as_str()), "{name} is not built in {id:?}");
            }
        }
    }
}
