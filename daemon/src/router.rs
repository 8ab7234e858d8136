//! The router: tables spread over every shard actor. A batch is split by
//! `hkv_shard::hash::shard_of` (a mix independent of the bucket hashes), the
//! sub-batches run concurrently on their actors, and the answers are put back
//! in request order.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use actix::Addr;
use futures::future::join_all;
use hkv_proto::{
    op, Cursor, ErrorCode, Evicted, FindFrame, FrameBuf, FrameMemory, ProtoError, Request, Response, Summary,
    TableInfo, TableSpec,
};
use hkv_shard::hash::shard_of;
use hkv_shard::{Backend, BucketMode, Error as ShardError, Filter, Outcome, ScorePolicy, Shard, TableConfig};
use parking_lot::{Mutex, RwLock};

use crate::actor::{values_of, Call, Create, ShardActor, SubOp, SubResult};
use crate::budget::{Budget, Charge};
use crate::features::Hasher;

/// A table: its spec, the per-shard config, and one shard per actor.
pub struct Table {
    /// As created.
    pub spec: TableSpec,
    /// Each shard's config.
    pub config: TableConfig,
    /// Shard `i` lives on actor `i`.
    pub shards: Vec<Arc<dyn Shard>>,
    /// Its share of the memory budget, given back when the last request
    /// holding the table is done.
    _charge: Charge,
    /// Set by writes whose scores may fall below the clock (a client's load
    /// with verbatim scores, an epoch set lower): the next incremental
    /// checkpoint cannot find them by score and stores this table whole.
    pub untracked: AtomicBool,
    /// The last epoch set, to tell when it goes down.
    pub epoch: AtomicU32,
}

/// Maps tables and keys to shard actors.
pub struct Router {
    actors: Vec<Addr<ShardActor>>,
    backend: Backend,
    tables: RwLock<HashMap<String, Arc<Table>>>,
    /// Feature hashing (GPU when present).
    pub hasher: Arc<Hasher>,
    /// Sent frames given back for find answers to reuse.
    pub frames: Frames,
    /// Table memory.
    pub budget: Arc<Budget>,
    /// The largest answer body (`limits.max_frame_bytes`).
    max_answer: u64,
    /// Counts table creations and drops: a checkpoint chain continues only
    /// while it is unchanged.
    generation: AtomicU64,
}

/// Frames given back once sent, whose memory find and echo answers reuse
/// instead of a fresh allocation each time (a find of 64 Ki keys of dim 32
/// answers 8.4 MB, of 1 Mi keys 135 MB). Keeps at most [`Frames::KEEP`]
/// buffers of [`Frames::MIN`] to [`Frames::MAX`] bytes, `total` bytes in
/// all (`limits.frame_cache_bytes`): smaller answers are cheap to zero, and
/// no more than that is held idle after a burst of large finds. The
/// default holds the answers in flight of 4 clients pipelining two finds
/// of 256 Ki keys of dim 32 each (CPU backend), or of 1 Mi keys (CUDA).
///
/// On the CUDA backend ([`Frames::pinned`]) find answers get page-locked
/// frames, into which the GPU copies the rows directly, as long as those
/// alive stay within the total; beyond it, ordinary memory.
pub struct Frames {
    pool: Mutex<Vec<FrameBuf>>,
    total: usize,
    /// The device whose context allocates pinned frames, and the pinned
    /// frames alive.
    pinned: Option<(usize, Arc<Live>)>,
}

/// Pinned frames alive: bytes and frames.
#[derive(Default)]
struct Live {
    bytes: AtomicUsize,
    frames: AtomicUsize,
}

/// A page-locked frame that counts itself out of [`Live`] when dropped.
struct PinnedFrame {
    mem: hkv_shard::cuda::HostFrame,
    live: Arc<Live>,
}

impl FrameMemory for PinnedFrame {
    fn bytes(&self) -> &[u8] {
        self.mem.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.mem.bytes_mut()
    }
    fn capacity(&self) -> usize {
        self.mem.capacity()
    }
    fn set_len(&mut self, len: usize) {
        self.mem.set_len(len)
    }
}

impl Drop for PinnedFrame {
    fn drop(&mut self) {
        self.live.bytes.fetch_sub(self.mem.capacity(), Relaxed);
        self.live.frames.fetch_sub(1, Relaxed);
    }
}

impl Default for Frames {
    fn default() -> Frames {
        Frames::new(Frames::DEFAULT_TOTAL)
    }
}

impl Frames {
    /// Buffers kept at most.
    pub const KEEP: usize = 16;
    /// Smallest buffer kept (bytes).
    pub const MIN: usize = 1 << 20;
    /// Largest buffer kept (bytes).
    pub const MAX: usize = 256 << 20;
    /// Bytes kept in all by default (CPU backend).
    pub const DEFAULT_TOTAL: u64 = 512 << 20;
    /// Bytes kept in all by default on the CUDA backend: the answers in
    /// flight of 4 clients pipelining two finds of 1 Mi keys of dim 32.
    pub const DEFAULT_TOTAL_CUDA: u64 = 2 << 30;

    /// The device whose context page-locks answer memory (CUDA backend).
    pub fn pinned_ordinal(&self) -> Option<usize> {
        self.pinned.as_ref().map(|p| p.0)
    }

    /// A cache of at most `total` bytes.
    pub fn new(total: u64) -> Frames {
        Frames { pool: Mutex::new(vec![]), total: usize::try_from(total).unwrap_or(usize::MAX), pinned: None }
    }

    /// Find answers get page-locked frames allocated in device
    /// `ordinal`'s context (see [`Frames`]).
    pub fn pinned(mut self, ordinal: usize) -> Frames {
        self.pinned = Some((ordinal, Arc::new(Live::default())));
        self
    }

    /// Gives a sent frame back.
    pub fn put(&self, frame: FrameBuf) {
        if (Self::MIN..=Self::MAX).contains(&frame.capacity()) {
            let mut p = self.pool.lock();
            let held: usize = p.iter().map(FrameBuf::capacity).sum();
            if p.len() < Self::KEEP && held.saturating_add(frame.capacity()) <= self.total {
                p.push(frame);
            }
        }
    }

    /// The frame of a find of `n` keys of `dim` floats: a kept buffer where
    /// one is large enough (the smallest such; its found bytes and values
    /// are stale, and the shards write every one of them), else zeroed.
    fn find_frame(&self, n: usize, dim: usize) -> FindFrame {
        let len = FindFrame::values_at(n) + n * dim * 4;
        match self.take(len).or_else(|| self.new_pinned(len)) {
            Some(buf) => FindFrame::reuse(buf, n, dim),
            None => FindFrame::new(n, dim),
        }
    }

    /// A new page-locked frame of `len` bytes where pinned frames are on
    /// and those alive stay within the total with it; None otherwise, or
    /// when the driver refuses (ordinary memory then does).
    fn new_pinned(&self, len: usize) -> Option<FrameBuf> {
        let (ordinal, live) = self.pinned.as_ref()?;
        if !(Self::MIN..=Self::MAX).contains(&len) {
            return None;
        }
        // No more alive than the cache keeps, in bytes and in frames, so
        // that pinned frames are allocated once and then reused.
        let bytes = live.bytes.fetch_add(len, Relaxed) + len;
        let frames = live.frames.fetch_add(1, Relaxed) + 1;
        let undo = || {
            live.bytes.fetch_sub(len, Relaxed);
            live.frames.fetch_sub(1, Relaxed);
        };
        if bytes > self.total || frames > Self::KEEP {
            undo();
            return None;
        }
        match hkv_shard::cuda::HostFrame::new(*ordinal, len) {
            // The frame's capacity is `len` (at least MIN), what its drop gives back.
            Ok(mem) => Some(FrameBuf::Other(Box::new(PinnedFrame { mem, live: live.clone() }))),
            Err(e) => {
                undo();
                tracing::warn!(error = %e, bytes = len, "no pinned frame; answering from ordinary memory");
                None
            }
        }
    }

    /// The answer to an echo of `len` bytes: zeros after the header space,
    /// in a kept buffer where one is large enough (zeroing memory already
    /// there costs less than faulting in a fresh allocation).
    pub fn echo(&self, len: usize) -> Response {
        let len = hkv_proto::HEADER_LEN + len;
        let buf = match self.take(len) {
            Some(mut buf) => {
                buf.set_len(len);
                buf.bytes_mut().fill(0);
                buf
            }
            None => FrameBuf::Vec(vec![0; len]),
        };
        Response::Framed(buf)
    }

    /// The smallest kept buffer of at least `len` bytes, if `len` is worth
    /// one ([`Frames::MIN`]).
    fn take(&self, len: usize) -> Option<FrameBuf> {
        if len < Self::MIN {
            return None;
        }
        let mut p = self.pool.lock();
        let fit = p.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
        fit.map(|(i, _)| i).map(|i| p.swap_remove(i))
    }

    /// Buffers kept now.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.pool.lock().len()
    }
}

/// The largest frame body the protocol can carry (`Header::body_len`).
const MAX_BODY: u64 = u32::MAX as u64;

/// Slots one export request walks at most: 16 Mi, fewer where every one of
/// them matching would pass `max_answer` bytes (keys, values, scores); 0
/// where not even one row fits.
fn export_slots(dim: usize, max_answer: u64) -> u64 {
    (1u64 << 24).min(max_answer.saturating_sub(64) / (16 + 4 * dim as u64))
}

fn err(code: ErrorCode, msg: impl Into<String>) -> ProtoError {
    ProtoError::new(code, msg)
}

/// Maps a shard error to the wire error with the matching code.
pub fn shard_error(e: ShardError) -> ProtoError {
    let code = match &e {
        ShardError::ReservedKey { .. } => ErrorCode::ReservedKey,
        ShardError::Length { what: "values" | "deltas", .. } => ErrorCode::WrongDim,
        ShardError::Length { .. } => ErrorCode::LengthMismatch,
        ShardError::ScoresNotAccepted { .. } | ShardError::ScoresRequired { .. } => ErrorCode::Scores,
        ShardError::Config(_) | ShardError::Capacity { .. } => ErrorCode::BadRequest,
        ShardError::OutOfMemory(_) => ErrorCode::ResourceExhausted,
        ShardError::Features(_) => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    };
    ProtoError::new(code, e.to_string())
}

/// Validates a table name: 1..=255 bytes of `[A-Za-z0-9_.-]` starting with
/// a letter, digit or '_' (so never `.`, `..`, a hidden chunk file name or
/// something a command line takes for a flag).
pub fn check_name(name: &str) -> Result<(), ProtoError> {
    let ok = name.len() <= 255
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ProtoError::bad_request(format!(
            "table name {name:?}: use 1 to 255 letters, digits, '_', '-' or '.', starting with a letter, digit or '_'"
        )))
    }
}

/// The per-shard config of a table spec spread over `n` shards.
pub fn shard_config(spec: &TableSpec, n: usize) -> Result<TableConfig, ProtoError> {
    let policy: ScorePolicy = spec.policy.parse().map_err(|e: ShardError| ProtoError::bad_request(e.to_string()))?;
    let mode = match spec.mode.as_str() {
        "single" => BucketMode::Single,
        "dual" => BucketMode::Dual,
        m => return Err(ProtoError::bad_request(format!("mode {m:?}: use single or dual"))),
    };
    // Checked in the request's own numbers; the per-shard ones below are rounded.
    if spec.max_capacity != 0 && spec.max_capacity < spec.capacity {
        return Err(ProtoError::bad_request(format!(
            "max_capacity {} is below capacity {}; use 0 for a table that does not grow",
            spec.max_capacity, spec.capacity
        )));
    }
    // Sizes that cannot even be counted in bytes are memory no host has,
    // whatever the shard count: the same answer as the budget's refusals.
    let slot_bytes = (spec.dim as u64).saturating_mul(4).saturating_add(145);
    let dim_ok = (1..=1 << 16).contains(&spec.dim); // else the config check below names the dim
    if dim_ok && spec.capacity.max(spec.max_capacity).checked_mul(slot_bytes).is_none() {
        return Err(ProtoError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "table {:?}: capacity {} (max_capacity {}) at dim {} is too large to count in bytes; no host holds it",
                spec.name, spec.capacity, spec.max_capacity, spec.dim
            ),
        ));
    }
    let per = |x: u64| x.div_ceil(n as u64);
    let config = TableConfig {
        capacity: per(spec.capacity),
        max_capacity: per(spec.max_capacity),
        max_load_factor: spec.max_load_factor.unwrap_or(0.5),
        dim: spec.dim,
        policy,
        mode,
        fast_tier_bytes: spec.fast_tier_bytes.map(per),
        // The reference's rule (plain frequencies) until the table spec
        // carries the choice: PROTOCOL.md and the checkpoints of existing
        // lfu tables hold plain frequencies, and a restore into a table
        // packing frequency and stamp would rank every restored entry below
        // new ones (issue 27; hkv_shard::LfuTies).
        lfu_ties: hkv_shard::LfuTies::LowestSlot,
    };
    config.validate().map_err(|e| ProtoError::bad_request(e.to_string()))?;
    Ok(config)
}

/// Answer bytes a find takes per key.
fn find_per_key(dim: usize, scores: bool) -> u64 {
    1 + 4 * dim as u64 + if scores { 8 } else { 0 }
}

/// Answer bytes a write op takes per key: insert_and_evict up to a key,
/// row, score and kind besides the outcome; find_or_insert a row.
fn write_per_key(code: u8, dim: usize, outcomes: bool) -> u64 {
    let rows = match code {
        op::INSERT_AND_EVICT => 17 + 4 * dim as u64,
        op::FIND_OR_INSERT => 4 * dim as u64,
        _ => 0,
    };
    rows + u64::from(outcomes)
}

/// Which shard each key goes to: per shard, the request indices.
fn split(keys: &[u64], n: usize) -> Vec<Vec<u32>> {
    let mut parts: Vec<Vec<u32>> = (0..n).map(|_| Vec::with_capacity(keys.len() / n + 16)).collect();
    for (i, &k) in keys.iter().enumerate() {
        parts[shard_of(k, n as u64) as usize].push(i as u32);
    }
    parts
}

fn gather<T: Copy>(src: &[T], idx: &[u32], width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(idx.len() * width);
    for &i in idx {
        let i = i as usize;
        out.extend_from_slice(&src[i * width..(i + 1) * width]);
    }
    out
}

fn scatter<T: Copy>(dst: &mut [T], idx: &[u32], src: &[T], width: usize) {
    for (j, &i) in idx.iter().enumerate() {
        let i = i as usize;
        dst[i * width..(i + 1) * width].copy_from_slice(&src[j * width..(j + 1) * width]);
    }
}

/// Where the keys of one request go. With one shard (one GPU) every key goes
/// there in request order: arrays are moved to it and its answers are moved
/// back, with no copy.
enum Split {
    Whole,
    /// Per shard, the request indices of its keys.
    Parts(Vec<Vec<u32>>),
}

impl Split {
    fn new(keys: &[u64], shards: usize) -> Split {
        if shards == 1 {
            Split::Whole
        } else {
            Split::Parts(split(keys, shards))
        }
    }

    /// Each shard's rows of `v` (`width` values per key), in shard order.
    fn take<T: Copy>(&self, v: Vec<T>, width: usize) -> Vec<Vec<T>> {
        match self {
            Split::Whole => vec![v],
            Split::Parts(parts) => parts.iter().map(|p| gather(&v, p, width)).collect(),
        }
    }

    /// An answer array of `n` keys (`width` values each) for [`Split::place`]
    /// to fill: empty when whole, as the one shard's array replaces it.
    fn out<T: Clone>(&self, n: usize, width: usize, fill: T) -> Vec<T> {
        match self {
            Split::Whole => Vec::new(),
            Split::Parts(_) => vec![fill; n * width],
        }
    }

    /// Puts shard `j`'s answer rows in request order.
    fn place<T: Copy>(&self, dst: &mut Vec<T>, j: usize, src: Vec<T>, width: usize) {
        match self {
            Split::Whole => *dst = src,
            Split::Parts(parts) => scatter(dst, &parts[j], &src, width),
        }
    }
}

fn to_wire(s: hkv_shard::Summary) -> Summary {
    Summary { updated: s.updated, inserted: s.inserted, evicted: s.evicted, rejected: s.rejected, absent: s.absent }
}

impl Router {
    /// A router over these actors (one per device / CPU shard); feature
    /// batches are hashed on GPU `hash_gpu` when given.
    /// Answers are at most `max_answer` bytes (`limits.max_frame_bytes`).
    pub fn new(
        actors: Vec<Addr<ShardActor>>,
        backend: Backend,
        hash_gpu: Option<usize>,
        frame_cache: u64,
        budget: Arc<Budget>,
        max_answer: u32,
    ) -> Router {
        let hasher = Arc::new(Hasher::new(hash_gpu));
        let frames = match (backend, hash_gpu) {
            (Backend::Cuda, Some(ordinal)) => Frames::new(frame_cache).pinned(ordinal),
            _ => Frames::new(frame_cache),
        };
        Router {
            actors,
            backend,
            tables: RwLock::new(HashMap::new()),
            hasher,
            frames,
            budget,
            max_answer: (max_answer as u64).min(MAX_BODY),
            generation: AtomicU64::new(0),
        }
    }

    /// Table creations and drops so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(Relaxed)
    }

    /// Shards per table.
    pub fn shards(&self) -> usize {
        self.actors.len()
    }

    /// Every table, by name.
    pub fn tables(&self) -> Vec<Arc<Table>> {
        let mut v: Vec<_> = self.tables.read().values().cloned().collect();
        v.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        v
    }

    /// A table by name.
    pub fn table(&self, name: &str) -> Result<Arc<Table>, ProtoError> {
        self.tables.read().get(name).cloned().ok_or_else(|| {
            err(ErrorCode::UnknownTable, format!("no table named {name:?}; create it first (hkvctl create-table)"))
        })
    }

    /// The listing of a table.
    pub fn info(t: &Table) -> TableInfo {
        TableInfo {
            spec: t.spec.clone(),
            size: t.shards.iter().map(|s| s.size()).sum(),
            capacity: t.shards.iter().map(|s| s.capacity()).sum(),
            shards: t.shards.len() as u32,
        }
    }

    /// Creates a table on every actor.
    pub async fn create_table(&self, spec: TableSpec) -> Result<TableInfo, ProtoError> {
        check_name(&spec.name)?;
        if let Some(h) = &spec.hash {
            crate::features::check(h)?;
        }
        if self.tables.read().contains_key(&spec.name) {
            return Err(err(ErrorCode::TableExists, format!("table {:?} exists; drop it first", spec.name)));
        }
        let table = self.build_table(spec).await?;
        let mut tables = self.tables.write();
        if tables.contains_key(&table.spec.name) {
            return Err(err(ErrorCode::TableExists, format!("table {:?} exists; drop it first", table.spec.name)));
        }
        tables.insert(table.spec.name.clone(), table.clone());
        self.generation.fetch_add(1, Relaxed);
        Ok(Self::info(&table))
    }

    /// Builds a table on every actor, charged to the budget, without making
    /// it visible: a restore fills such tables and then [`Router::install`]s
    /// them, so nothing it refuses or fails on is ever seen half loaded.
    pub async fn build_table(&self, spec: TableSpec) -> Result<Arc<Table>, ProtoError> {
        check_name(&spec.name)?;
        if let Some(h) = &spec.hash {
            crate::features::check(h)?;
        }
        let config = shard_config(&spec, self.actors.len())?;
        let n = self.actors.len();
        let shape = format!(
            "capacity {}, max_capacity {}, dim {}, {n} shard{}",
            spec.capacity,
            spec.max_capacity,
            spec.dim,
            if n == 1 { "" } else { "s" }
        );
        let charge = self.budget.charge(&spec.name, &shape, &config)?;
        let created =
            join_all(self.actors.iter().map(|a| a.send(Create { config: config.clone(), backend: self.backend })))
                .await;
        let mut shards = Vec::with_capacity(created.len());
        for r in created {
            let shard = r.map_err(|e| err(ErrorCode::Internal, format!("shard actor gone: {e}")))?;
            shards.push(shard.map_err(shard_error)?);
        }
        Ok(Arc::new(Table {
            spec,
            config,
            shards,
            _charge: charge,
            untracked: AtomicBool::new(false),
            epoch: AtomicU32::new(0),
        }))
    }

    /// Makes built tables visible at once, replacing tables of the same
    /// names (requests already running on those finish on them).
    pub fn install(&self, built: Vec<Arc<Table>>) {
        let mut tables = self.tables.write();
        for t in built {
            tables.insert(t.spec.name.clone(), t);
        }
        self.generation.fetch_add(1, Relaxed);
    }

    /// Loads entries with their scores verbatim into `t` (registered or
    /// only built), split over its shards as any write is.
    pub async fn load_into(
        &self,
        t: &Table,
        keys: Vec<u64>,
        values: Vec<f32>,
        scores: Vec<u64>,
    ) -> Result<Summary, ProtoError> {
        Self::validate(t, &keys, Some(&values), Some(&scores), true, true)?;
        let (n, split) = (keys.len(), Split::new(&keys, t.shards.len()));
        let dim = t.config.dim;
        let ops = split
            .take(keys, 1)
            .into_iter()
            .zip(split.take(values, dim))
            .zip(split.take(scores, 1))
            .map(|((keys, values), scores)| SubOp::Write { op: op::LOAD, keys, values, scores: Some(scores) })
            .collect();
        match self.writes(t, &split, ops, n, false, op::LOAD).await? {
            Response::Write { summary, .. } => Ok(summary),
            _ => Err(err(ErrorCode::Internal, "load answered something else than a write summary")),
        }
    }

    /// Drops a table; requests already running on it finish first.
    pub fn drop_table(&self, name: &str) -> Result<(), ProtoError> {
        let removed = self.tables.write().remove(name);
        self.generation.fetch_add(1, Relaxed);
        removed.map(|_| ()).ok_or_else(|| err(ErrorCode::UnknownTable, format!("no table named {name:?}")))
    }

    pub(crate) async fn call(&self, table: &Table, i: usize, op: SubOp) -> Result<SubResult, ProtoError> {
        self.actors[i]
            .send(Call { shard: table.shards[i].clone(), op })
            .await
            .map_err(|e| err(ErrorCode::Internal, format!("shard {i} actor gone: {e}")))?
            .map_err(|e| {
                // A device failure (out of memory, a lost GPU) fails the
                // requests that touched that shard, and says which one.
                let device = matches!(e, ShardError::Device(_));
                let mut pe = shard_error(e);
                if device {
                    pe.message = format!("shard {i}: {}", pe.message);
                }
                pe
            })
    }

    /// Runs one sub-op per shard (in parallel) and returns the results in shard order.
    async fn fan_out(&self, table: &Table, ops: Vec<SubOp>) -> Result<Vec<SubResult>, ProtoError> {
        join_all(ops.into_iter().enumerate().map(|(i, op)| self.call(table, i, op))).await.into_iter().collect()
    }

    /// Checks a keyed request before any shard sees it, so that a bad batch
    /// is refused whole. `inserts`: Custom tables need scores. `verbatim`:
    /// scores are stored as given (load), whatever the policy.
    fn validate(
        t: &Table,
        keys: &[u64],
        values: Option<&[f32]>,
        scores: Option<&[u64]>,
        inserts: bool,
        verbatim: bool,
    ) -> Result<(), ProtoError> {
        let n = keys.len();
        if let Some(i) = keys.iter().position(|&k| hkv_shard::is_reserved(k)) {
            return Err(shard_error(ShardError::ReservedKey { key: keys[i], index: i }));
        }
        if let Some(v) = values {
            if v.len() != n * t.config.dim {
                return Err(err(
                    ErrorCode::WrongDim,
                    format!(
                        "{} floats for {n} keys, but table {:?} has dim {} and needs {}",
                        v.len(),
                        t.spec.name,
                        t.config.dim,
                        n * t.config.dim
                    ),
                ));
            }
        }
        let policy = t.config.policy;
        match scores {
            Some(s) if s.len() != n => {
                Err(err(ErrorCode::LengthMismatch, format!("{} scores for {n} keys; send one score per key", s.len())))
            }
            Some(_) if !policy.takes_scores() && !verbatim => {
                Err(shard_error(ShardError::ScoresNotAccepted { policy }))
            }
            None if inserts && policy == ScorePolicy::Custom => Err(shard_error(ShardError::ScoresRequired { policy })),
            _ => Ok(()),
        }
    }

    /// Executes a feature request: hash (on the GPU when present), then,
    /// for the fused ops, find or find_or_insert with the keys.
    pub async fn features(&self, req: Request) -> Result<Response, ProtoError> {
        let (table, hash) = match &req {
            Request::Hash { table, hash, .. }
            | Request::FindFeatures { table, hash, .. }
            | Request::FindOrInsertFeatures { table, hash, .. } => (table, hash),
            _ => return Err(err(ErrorCode::Internal, "not a feature request")),
        };
        let t = if table.is_empty() && matches!(req, Request::Hash { .. }) { None } else { Some(self.table(table)?) };
        let (kind, num_buckets) = crate::features::resolve(hash.clone(), t.as_deref())?;
        if let Request::Hash { features, .. } = &req {
            self.bound("hash", features.len(), 0, 8, 8)?;
        }
        // Values, scores and dim are checked by find / find_or_insert below,
        // before anything is applied; hashing changes nothing.
        let hasher = self.hasher.clone();
        let (keys, req) = tokio::task::spawn_blocking(move || {
            let r = match &req {
                Request::Hash { features, .. }
                | Request::FindFeatures { features, .. }
                | Request::FindOrInsertFeatures { features, .. } => hasher.hash(features, kind, num_buckets),
                _ => unreachable!("checked above"),
            };
            (r, req)
        })
        .await
        .map_err(|e| err(ErrorCode::Internal, format!("hashing task failed: {e}")))?;
        let keys = keys?;
        match req {
            Request::Hash { .. } => Ok(Response::Keys(keys)),
            Request::FindFeatures { table, scores, .. } => self.execute(Request::Find { table, keys, scores }).await,
            Request::FindOrInsertFeatures { table, values, scores, outcomes, .. } => {
                self.execute(Request::Write { op: op::FIND_OR_INSERT, table, keys, values, scores, outcomes }).await
            }
            _ => unreachable!("checked above"),
        }
    }

    /// find without scores into `frame` (whose values [`values_of`] can
    /// cast): the one shard writes its answers there itself, or each
    /// shard's answers are placed there in request order.
    async fn find_framed(
        &self,
        t: &Table,
        split: Split,
        keys: Vec<u64>,
        mut frame: FindFrame,
    ) -> Result<Response, ProtoError> {
        if let Split::Whole = split {
            let SubResult::Frame(frame) = self.call(t, 0, SubOp::FindInto { keys, frame }).await? else {
                unreachable!()
            };
            return Ok(frame.into_response());
        }
        // The shards fill the frame one after the other, each writing its
        // keys' rows in place (`Shard::find_at`): no answer array per shard,
        // no copy on the router. A CPU shard spreads its part over every
        // core by itself; a CUDA shard's kernel writes its rows straight
        // into a pinned frame. While one request's part is on one shard,
        // other requests' parts keep the other shards busy.
        let Split::Parts(parts) = &split else { unreachable!() };
        for (i, (keys, at)) in split.take(keys, 1).into_iter().zip(parts).enumerate() {
            if keys.is_empty() {
                continue;
            }
            let SubResult::Frame(f) = self.call(t, i, SubOp::FindAt { keys, at: at.clone(), frame }).await? else {
                unreachable!()
            };
            frame = f;
        }
        Ok(frame.into_response())
    }

    /// Executes a table request.
    pub async fn execute(&self, req: Request) -> Result<Response, ProtoError> {
        let t = self.table(req.table().unwrap_or_default())?;
        let n_shards = t.shards.len();
        let dim = t.config.dim;
        match req {
            Request::Find { keys, scores, .. } => {
                Self::validate(&t, &keys, None, None, false, false)?;
                let n = keys.len();
                self.bound("find", n, dim, find_per_key(dim, scores), 16)?;
                let split = Split::new(&keys, n_shards);
                // Without scores the answers are written where they are sent
                // from: by the shard itself when it holds every key; CPU
                // shards each write their keys' rows in turn; CUDA shards'
                // answers are placed into the frame.
                if !scores && FindFrame::values_at(n).is_multiple_of(4) {
                    let mut frame = self.frames.find_frame(n, dim);
                    if values_of(&mut frame).is_some() {
                        return self.find_framed(&t, split, keys, frame).await;
                    }
                }
                let ops = split.take(keys, 1).into_iter().map(|keys| SubOp::Find { keys, scores }).collect();
                let mut found = split.out(n, 1, 0u8);
                let mut values = split.out(n, dim, 0.0f32);
                let mut sc = scores.then(|| split.out(n, 1, 0u64));
                for (j, r) in self.fan_out(&t, ops).await?.into_iter().enumerate() {
                    let SubResult::Find { found: f, values: v, scores: s } = r else { unreachable!() };
                    split.place(&mut found, j, f.into_iter().map(u8::from).collect(), 1);
                    split.place(&mut values, j, v, dim);
                    if let (Some(dst), Some(s)) = (sc.as_mut(), s) {
                        split.place(dst, j, s, 1);
                    }
                }
                Ok(Response::Find { found, values, scores: sc })
            }
            Request::Contains { keys, .. } => {
                Self::validate(&t, &keys, None, None, false, false)?;
                let (n, split) = (keys.len(), Split::new(&keys, n_shards));
                let ops = split.take(keys, 1).into_iter().map(|keys| SubOp::Contains { keys }).collect();
                let found = self.flags(&t, &split, ops, n).await?;
                Ok(Response::Contains { found })
            }
            Request::Erase { keys, outcomes, .. } => {
                Self::validate(&t, &keys, None, None, false, false)?;
                let (n, split) = (keys.len(), Split::new(&keys, n_shards));
                let ops = split.take(keys, 1).into_iter().map(|keys| SubOp::Erase { keys }).collect();
                let flags = self.flags(&t, &split, ops, n).await?;
                let count = flags.iter().filter(|&&f| f == 1).count() as u64;
                Ok(Response::Erased { count, flags: outcomes.then_some(flags) })
            }
            Request::Write { op: code, keys, values, scores, outcomes, .. } => {
                let per_key = write_per_key(code, dim, outcomes);
                self.bound(hkv_proto::msg::op_name(code), keys.len(), dim, per_key, 64)?;
                let inserts = code != op::ASSIGN;
                if code == op::LOAD && scores.is_none() {
                    return Err(err(ErrorCode::Scores, "load needs a score per key (sent with the SCORES flag)"));
                }
                Self::validate(&t, &keys, Some(&values), scores.as_deref(), inserts, code == op::LOAD)?;
                // load places entries as they were; it reports no per-key outcome.
                let outcomes = outcomes && code != op::LOAD;
                if code == op::LOAD {
                    t.untracked.store(true, Relaxed);
                }
                let (n, split) = (keys.len(), Split::new(&keys, n_shards));
                let mut scores = scores.map(|s| split.take(s, 1).into_iter());
                let ops = split
                    .take(keys, 1)
                    .into_iter()
                    .zip(split.take(values, dim))
                    .map(|(keys, values)| SubOp::Write {
                        op: code,
                        keys,
                        values,
                        scores: scores.as_mut().and_then(|s| s.next()),
                    })
                    .collect();
                self.writes(&t, &split, ops, n, outcomes, code).await
            }
            Request::AssignScores { keys, scores, outcomes, .. } => {
                // A custom table's scores are the caller's: without them there is nothing to assign.
                let needs = t.config.policy == ScorePolicy::Custom;
                Self::validate(&t, &keys, None, scores.as_deref(), needs, false)?;
                let (n, split) = (keys.len(), Split::new(&keys, n_shards));
                let mut scores = scores.map(|s| split.take(s, 1).into_iter());
                let ops = split
                    .take(keys, 1)
                    .into_iter()
                    .map(|keys| SubOp::AssignScores { keys, scores: scores.as_mut().and_then(|s| s.next()) })
                    .collect();
                self.writes(&t, &split, ops, n, outcomes, op::ASSIGN_SCORES).await
            }
            Request::EraseIf { filter, .. } => {
                let f = to_filter(filter);
                let ops = (0..n_shards).map(|_| SubOp::EraseIf(f)).collect();
                let mut count = 0;
                for r in self.fan_out(&t, ops).await? {
                    if let SubResult::Count(c) = r {
                        count += c;
                    }
                }
                Ok(Response::Erased { count, flags: None })
            }
            Request::Clear { .. } => {
                self.fan_out(&t, (0..n_shards).map(|_| SubOp::Clear).collect()).await?;
                Ok(Response::Empty)
            }
            Request::SetEpoch { epoch, .. } => {
                if epoch < t.epoch.swap(epoch, Relaxed) {
                    t.untracked.store(true, Relaxed);
                }
                self.fan_out(&t, (0..n_shards).map(|_| SubOp::SetEpoch(epoch)).collect()).await?;
                Ok(Response::Empty)
            }
            Request::Reserve { capacity, .. } => {
                let most = t.config.max_buckets() * 128 * n_shards as u64;
                if capacity > most {
                    return Err(ProtoError::bad_request(format!(
                        "cannot reserve {capacity} slots: table {:?} grows to {most} at most; \
                         create it with a larger max_capacity",
                        t.spec.name
                    )));
                }
                let per = capacity.div_ceil(n_shards as u64);
                self.fan_out(&t, (0..n_shards).map(|_| SubOp::Reserve(per)).collect()).await?;
                Ok(Response::Empty)
            }
            Request::Export { cursor, max_slots, filter, .. } => {
                let i = cursor.shard as usize;
                if i >= n_shards {
                    return Err(ProtoError::bad_request(format!(
                        "export cursor shard {i}: the table has {n_shards} shards"
                    )));
                }
                let most = export_slots(dim, self.max_answer);
                if most == 0 {
                    return Err(err(
                        ErrorCode::Oversized,
                        format!(
                            "one exported row of dim {dim} takes {} bytes, above limits.max_frame_bytes = {}",
                            16 + 4 * dim as u64 + 64,
                            self.max_answer
                        ),
                    ));
                }
                let max_slots = max_slots.clamp(1, most);
                let op = SubOp::Export { offset: cursor.offset, n: max_slots, filter: to_filter(filter) };
                let SubResult::Export(e) = self.call(&t, i, op).await? else { unreachable!() };
                let end = cursor.offset.saturating_add(max_slots);
                let next = if end < t.shards[i].capacity() {
                    Some(Cursor { shard: i as u32, offset: end })
                } else if i + 1 < n_shards {
                    Some(Cursor { shard: i as u32 + 1, offset: 0 })
                } else {
                    None
                };
                Ok(Response::Export { next, keys: e.keys, values: e.values, scores: e.scores })
            }
            other => Err(ProtoError::bad_request(format!(
                "{} is not a table operation",
                hkv_proto::msg::op_name(other.op())
            ))),
        }
    }

    /// The most bytes the answer to `req` can take (the bounds [`Router::bound`]
    /// checks), counted against the bytes in flight before it is built; 0
    /// for answers that are small whatever the request.
    pub fn answer_bytes(&self, req: &Request) -> u64 {
        let dim = |name: &str| self.table(name).map_or(0, |t| t.config.dim);
        let times = |n: usize, per: u64, fixed: u64| (n as u64).saturating_mul(per).saturating_add(fixed);
        // An answer past the frame limit is refused as `oversized` before it
        // is built; it never holds more than that.
        let most = match req {
            Request::Echo { reply_len, .. } => *reply_len as u64,
            Request::Find { table, keys, scores } => times(keys.len(), find_per_key(dim(table), *scores), 16),
            Request::FindFeatures { table, features, scores, .. } => {
                times(features.len(), find_per_key(dim(table), *scores), 16)
            }
            Request::Write { op: code, table, keys, outcomes, .. } => {
                times(keys.len(), write_per_key(*code, dim(table), *outcomes), 64)
            }
            Request::FindOrInsertFeatures { table, features, outcomes, .. } => {
                times(features.len(), write_per_key(op::FIND_OR_INSERT, dim(table), *outcomes), 64)
            }
            Request::Hash { features, .. } => times(features.len(), 8, 8),
            Request::Contains { keys, .. } | Request::Erase { keys, .. } | Request::AssignScores { keys, .. } => {
                times(keys.len(), 1, 64)
            }
            Request::Export { table, max_slots, .. } => {
                let d = dim(table);
                let slots = (*max_slots).clamp(1, export_slots(d, self.max_answer).max(1));
                slots.saturating_mul(16 + 4 * d as u64).saturating_add(64)
            }
            _ => 0,
        };
        most.min(self.max_answer)
    }

    /// Refuses, before it runs, a request of `n` keys whose answer would take
    /// `per_key` bytes a key plus `fixed` bytes, beyond the largest answer.
    fn bound(&self, what: &str, n: usize, dim: usize, per_key: u64, fixed: u64) -> Result<(), ProtoError> {
        let size = (n as u64).saturating_mul(per_key).saturating_add(fixed);
        if size <= self.max_answer {
            return Ok(());
        }
        Err(err(
            ErrorCode::Oversized,
            format!(
                "the answer to a {what} of {n} keys of dim {dim} would be {size} bytes, above \
                 limits.max_frame_bytes = {}; send at most {} keys per {what}",
                self.max_answer,
                self.max_answer.saturating_sub(fixed) / per_key.max(1)
            ),
        ))
    }

    async fn flags(&self, t: &Table, split: &Split, ops: Vec<SubOp>, n: usize) -> Result<Vec<u8>, ProtoError> {
        let mut out = split.out(n, 1, 0u8);
        for (j, r) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            let SubResult::Flags(f) = r else { unreachable!() };
            split.place(&mut out, j, f.into_iter().map(u8::from).collect(), 1);
        }
        Ok(out)
    }

    async fn writes(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<SubOp>,
        n: usize,
        want_outcomes: bool,
        code: u8,
    ) -> Result<Response, ProtoError> {
        let dim = t.config.dim;
        let mut summary = Summary::default();
        let mut outcomes = want_outcomes.then(|| split.out(n, 1, Outcome::Absent as u8));
        let mut values = (code == op::FIND_OR_INSERT).then(|| split.out(n, dim, 0.0f32));
        let mut evicted = (code == op::INSERT_AND_EVICT).then(Evicted::default);
        for (j, r) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            let SubResult::Write { summary: s, outcomes: o, values: v, evicted: e } = r else { unreachable!() };
            summary += to_wire(s);
            if let Some(dst) = outcomes.as_mut() {
                split.place(dst, j, o.into_iter().map(|o| o as u8).collect(), 1);
            }
            if let (Some(dst), Some(v)) = (values.as_mut(), v) {
                split.place(dst, j, v, dim);
            }
            if let (Some(dst), Some(e)) = (evicted.as_mut(), e) {
                dst.keys.extend_from_slice(&e.keys);
                dst.values.extend_from_slice(&e.values);
                dst.scores.extend_from_slice(&e.scores);
                dst.kinds.extend(e.kinds.iter().map(|k| *k as u8));
            }
        }
        Ok(Response::Write { summary, outcomes, values, evicted })
    }
}

fn to_filter(f: hkv_proto::Filter) -> Filter {
    Filter { key_mask: f.key_mask, key_pattern: f.key_pattern, min_score: f.min_score, max_score: f.max_score }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shard_moves_arrays_both_ways_and_several_restore_order() {
        let keys: Vec<u64> = (0..1000).collect();
        let whole = Split::new(&keys, 1);
        let request = keys.clone();
        let at = request.as_ptr();
        let taken = whole.take(request, 1);
        assert_eq!(taken[0].as_ptr(), at, "the request's array is moved to the shard, not copied");
        assert_eq!(taken, vec![keys.clone()]);
        let src = taken.into_iter().next().unwrap();
        let src_at = src.as_ptr();
        let mut out = whole.out(1000, 1, 0u64);
        whole.place(&mut out, 0, src, 1);
        assert_eq!(out.as_ptr(), src_at, "the shard's answer is moved, not copied");
        assert_eq!(out, keys);
        let parts = Split::new(&keys, 3);
        let mut back = parts.out(1000, 2, 0u64);
        let rows: Vec<u64> = keys.iter().flat_map(|&k| [k, k + 1]).collect();
        for (j, sub) in parts.take(rows.clone(), 2).into_iter().enumerate() {
            assert!(sub.chunks(2).all(|r| shard_of(r[0], 3) == j as u64));
            parts.place(&mut back, j, sub, 2);
        }
        assert_eq!(back, rows);
    }

    #[test]
    fn split_gather_scatter_restore_order() {
        let keys: Vec<u64> = (0..1000).collect();
        let parts = split(&keys, 3);
        assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), 1000);
        let mut back = vec![0u64; 1000];
        for p in &parts {
            let sub = gather(&keys, p, 1);
            assert!(sub.iter().all(|&k| shard_of(k, 3) == shard_of(sub[0], 3)));
            scatter(&mut back, p, &sub, 1);
        }
        assert_eq!(back, keys);
    }

    #[test]
    fn an_export_answer_always_fits_a_frame() {
        assert_eq!(export_slots(32, MAX_BODY), 1 << 24);
        for dim in [1usize, 32, 64, 1000, 1 << 16] {
            let s = export_slots(dim, MAX_BODY);
            assert!(s >= 1 && s * (16 + 4 * dim as u64) + 64 <= MAX_BODY, "dim {dim}: {s} slots");
        }
        assert!(export_slots(64, MAX_BODY) < 1 << 24, "dim 64 rows of 16 Mi slots would pass 4 GiB");
        assert_eq!(export_slots(65536, 4096), 0, "no row of dim 65536 fits 4 KiB");
    }

    #[test]
    fn names_and_configs_are_checked() {
        assert!(check_name("emb_v2.users-1").is_ok());
        assert!(check_name("").is_err() && check_name("a b").is_err() && check_name(&"x".repeat(256)).is_err());
        for bad in [".", "..", ".hidden", "-flag", "a/b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name("_x").is_ok() && check_name("9.a-b").is_ok());
        // Uncountable sizes are resource_exhausted on any shard count.
        for shards in [1, 3] {
            let e = shard_config(&TableSpec::new("t", 4, 1 << 62), shards).unwrap_err();
            assert_eq!(e.code, ErrorCode::ResourceExhausted, "{shards}: {}", e.message);
        }
        let e = shard_config(&TableSpec::new("t", 1 << 20, 1 << 62), 1).unwrap_err();
        assert!(e.message.contains("dim 1048576 is above the limit"), "{}", e.message);
        let c = shard_config(&TableSpec::new("t", 8, 1000), 4).unwrap();
        assert_eq!(c.capacity, 250);
        let mut bad = TableSpec::new("t", 8, 1000);
        bad.policy = "fifo".into();
        assert!(shard_config(&bad, 1).unwrap_err().message.contains("fifo"));
    }

    #[test]
    fn frames_are_reused_without_zeroing_and_bounded() {
        let f = Frames::default();
        f.put(FrameBuf::Vec(vec![0xAB; 2 << 20]));
        f.put(FrameBuf::Vec(vec![0xCD; 1000])); // too small to keep
        f.put(FrameBuf::Vec(vec![0xEF; 257 << 20])); // too large to keep
        assert_eq!(f.kept(), 1);
        // 10 000 keys of dim 32: 1.29 MB, reuses the 2 MiB buffer as it is.
        let mut frame = f.find_frame(10_000, 32);
        assert_eq!(f.kept(), 0);
        let (found, values) = frame.parts_mut();
        assert_eq!(found.len(), 10_000);
        assert_eq!(values.len(), 10_000 * 32 * 4);
        assert!(found.iter().chain(values.iter()).all(|&b| b == 0xAB), "stale bytes: the shards overwrite them");
        // No buffer kept: a zeroed frame.
        let mut fresh = f.find_frame(10_000, 32);
        assert!(fresh.parts_mut().1.iter().all(|&b| b == 0));
        for _ in 0..2 * Frames::KEEP {
            f.put(FrameBuf::Vec(vec![0; 1 << 20]));
        }
        assert_eq!(f.kept(), Frames::KEEP);
        // A request larger than every kept buffer gets a fresh one.
        let mut big = f.find_frame(20_000, 32);
        assert!(big.parts_mut().1.iter().all(|&b| b == 0));
        assert_eq!(f.kept(), Frames::KEEP);
        // No more than the total is held: two 200 MiB buffers of 512 MiB, not three.
        let f = Frames::new(512 << 20);
        for _ in 0..3 {
            f.put(FrameBuf::Vec(vec![0; 200 << 20]));
        }
        assert_eq!(f.kept(), 2);
        // A cache of 0 bytes keeps nothing.
        let f = Frames::new(0);
        f.put(FrameBuf::Vec(vec![0; 2 << 20]));
        assert_eq!(f.kept(), 0);
        // Pinned frames asked for where no CUDA device answers: an
        // ordinary zeroed frame, and nothing counted as alive.
        if hkv_shard::cuda::probe().is_err() {
            let f = Frames::new(1 << 30).pinned(0);
            let mut frame = f.find_frame(10_000, 32);
            assert!(frame.parts_mut().1.iter().all(|&b| b == 0));
            let live = &f.pinned.as_ref().expect("pinned").1;
            assert_eq!((live.bytes.load(Relaxed), live.frames.load(Relaxed)), (0, 0));
        }
    }
}
