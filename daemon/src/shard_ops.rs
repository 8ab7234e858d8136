//! Every operation the router sends to one shard of a table: one type
//! each, with its own answer type ([`ShardOp`]), run on the shard's actor
//! thread. A find writes into a [`Destination`]: an answer frame, a
//! client's region, or arrays the daemon owns ([`Find`]).

use std::sync::Arc;

use hkv_proto::WriteOp;
use hkv_shard::cuda::ipc::{IpcEvent, IpcSpan};
use hkv_shard::cuda::table::{Counts, DeviceOp, IpcArrays, IpcOrder, IpcPart};
use hkv_shard::{Evictions, Export, Filter, Outcome, Rows, Shard, ShardStats, Summary};

use crate::actor::ShardOp;
use crate::mrc::{ShardCurve, ShardMrc, ShardTrace};

type Result<T> = std::result::Result<T, hkv_shard::Error>;

/// A shard's keys: a whole batch as sent, or this shard's part of a batch
/// the router split (and checked whole first, `hkv_shard::check::CheckedKeys`);
/// the shard checks them as it checks any caller's.
pub type Keys = Vec<u64>;

/// Where a find writes its answer in place: one found byte per row of the
/// answer and the rows (`Rows::Pinned` where the memory is page-locked for
/// the GPU). A response frame (`crate::frames`) and a client's claimed
/// region (`crate::region`) are destinations.
pub trait Destination: Send + 'static {
    /// The found bytes and the rows.
    fn answer(&mut self) -> (&mut [u8], Rows<'_>);
}

/// find into a [`Destination`]: the shard's keys at rows `at` of the
/// answer when several shards fill it in turn, else at rows `0..n`; every
/// target row written, misses with zeros (`hkv_shard::find_answer`).
/// Answers the destination and the hits.
pub struct FindTo<D> {
    /// The keys.
    pub keys: Keys,
    /// Their rows in the answer (increasing), when the batch was split.
    pub at: Option<Vec<u32>>,
    /// Where the rows go.
    pub dest: D,
}

impl<D: Destination> ShardOp for FindTo<D> {
    type Output = (D, usize);
    const WHAT: &'static str = "a find";
    fn run(mut self, s: &dyn Shard, _: Option<&ShardMrc>) -> Result<(D, usize)> {
        let (flags, rows) = self.dest.answer();
        let hits = hkv_shard::find_answer(s, &self.keys, self.at.as_deref(), rows, flags)?;
        Ok((self.dest, hits))
    }
}

/// find into arrays of the daemon (with scores, or an answer no frame takes).
pub struct Find {
    /// The keys.
    pub keys: Keys,
    /// Return scores.
    pub scores: bool,
}

/// The answer of [`Find`].
pub struct Found {
    /// Per key.
    pub found: Vec<bool>,
    /// `dim` per key; zeros for a miss.
    pub values: Vec<f32>,
    /// Per key, when asked for.
    pub scores: Option<Vec<u64>>,
}

impl ShardOp for Find {
    type Output = Found;
    const WHAT: &'static str = "a find";
    fn run(self, s: &dyn Shard, _: Option<&ShardMrc>) -> Result<Found> {
        let n = self.keys.len();
        let mut values = vec![0.0; n * s.dim()];
        let mut found = vec![false; n];
        let mut scores = self.scores.then(|| vec![0u64; n]);
        s.find(&self.keys, &mut values, &mut found, scores.as_deref_mut())?;
        Ok(Found { found, values, scores })
    }
}

/// contains: a flag per key.
pub struct Contains(pub Keys);

impl ShardOp for Contains {
    type Output = Vec<bool>;
    const WHAT: &'static str = "contains";
    fn run(self, s: &dyn Shard, _: Option<&ShardMrc>) -> Result<Vec<bool>> {
        let mut found = vec![false; self.0.len()];
        s.contains(&self.0, &mut found)?;
        Ok(found)
    }
}

/// erase: a flag per key, set where the key was there.
pub struct Erase(pub Keys);

impl ShardOp for Erase {
    type Output = Vec<bool>;
    const WHAT: &'static str = "erase";
    fn run(self, s: &dyn Shard, _: Option<&ShardMrc>) -> Result<Vec<bool>> {
        let mut erased = vec![false; self.0.len()];
        s.erase(&self.0, Some(&mut erased))?;
        Ok(erased)
    }
}

/// A write ([`WriteOp`]).
pub struct Write {
    /// Which.
    pub op: WriteOp,
    /// Keys.
    pub keys: Keys,
    /// Values or deltas.
    pub values: Vec<f32>,
    /// Scores.
    pub scores: Option<Vec<u64>>,
}

/// The answer of a write or [`AssignScores`].
pub struct Written {
    /// Counts.
    pub summary: Summary,
    /// Per key.
    pub outcomes: Vec<Outcome>,
    /// find_or_insert's values.
    pub values: Option<Vec<f32>>,
    /// insert_and_evict's output.
    pub evicted: Option<Evictions>,
}

impl ShardOp for Write {
    type Output = Written;
    const WHAT: &'static str = "a write";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<Written> {
        let Write { op, keys, mut values, scores } = self;
        {
            let keys = &keys[..];
            let mut outcomes = vec![Outcome::Absent; keys.len()];
            let sc = scores.as_deref();
            let o = Some(&mut outcomes[..]);
            let (summary, values, evicted) = match op {
                WriteOp::InsertOrAssign => (t.insert_or_assign(keys, &values, sc, o)?, None, None),
                WriteOp::InsertAndEvict => {
                    let ev = t.insert_and_evict(keys, &values, sc, o)?;
                    (summarize(&outcomes), None, Some(ev))
                }
                WriteOp::FindOrInsert => {
                    let s = t.find_or_insert(keys, &mut values, sc, o)?;
                    (s, Some(values), None)
                }
                WriteOp::Assign => (t.assign(keys, &values, sc, o)?, None, None),
                WriteOp::AccumOrAssign => (t.accum_or_assign(keys, &values, sc, o)?, None, None),
                // load reports no per-key outcome: every one stays Absent.
                WriteOp::Load => (t.load(keys, &values, sc.unwrap_or(&[]))?, None, None),
            };
            Ok(Written { summary, outcomes, values, evicted })
        }
    }
}

fn summarize(outcomes: &[Outcome]) -> Summary {
    let mut s = Summary::default();
    for &o in outcomes {
        s.add(o);
    }
    s
}

/// apply_gradients: one optimizer step on the rows of present keys
/// (`Shard::apply_gradients`).
pub struct ApplyGradients {
    /// Keys.
    pub keys: Keys,
    /// Gradient rows, the value dim a key.
    pub grads: Vec<f32>,
    /// The optimizer, value dim and hyperparameters.
    pub step: hkv_shard::optim::Step,
    /// Return the updated values.
    pub values: bool,
}

/// The answer of [`ApplyGradients`].
pub struct Applied {
    /// Keys absent.
    pub missing: u64,
    /// Per key: present (updated).
    pub found: Vec<bool>,
    /// The values after the step, the value dim a key (zeros where
    /// absent), when asked for.
    pub values: Option<Vec<f32>>,
}

impl ShardOp for ApplyGradients {
    type Output = Applied;
    const WHAT: &'static str = "apply_gradients";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<Applied> {
        let n = self.keys.len();
        let mut found = vec![false; n];
        let mut values = self.values.then(|| vec![0.0f32; n * self.step.dim]);
        let missing = t.apply_gradients(&self.keys, &self.grads, &self.step, &mut found, values.as_deref_mut())?;
        Ok(Applied { missing, found, values })
    }
}

/// assign_scores.
pub struct AssignScores {
    /// Keys.
    pub keys: Keys,
    /// Scores.
    pub scores: Option<Vec<u64>>,
}

impl ShardOp for AssignScores {
    type Output = Written;
    const WHAT: &'static str = "assign_scores";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<Written> {
        let mut outcomes = vec![Outcome::Absent; self.keys.len()];
        let summary = t.assign_scores(&self.keys, self.scores.as_deref(), Some(&mut outcomes))?;
        Ok(Written { summary, outcomes, values: None, evicted: None })
    }
}

/// erase_if: the count erased.
pub struct EraseIf(pub Filter);

impl ShardOp for EraseIf {
    type Output = u64;
    const WHAT: &'static str = "erase_if";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<u64> {
        t.erase_if(&self.0)
    }
}

/// clear.
pub struct Clear;

impl ShardOp for Clear {
    type Output = ();
    const WHAT: &'static str = "clear";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.clear()
    }
}

/// export_batch_if of slots `[offset, offset + n)`; answers the entries
/// and the shard's capacity after the export (slots move when it grew).
pub struct ExportPart {
    /// First slot.
    pub offset: u64,
    /// Slots.
    pub n: u64,
    /// Predicate.
    pub filter: Filter,
}

impl ShardOp for ExportPart {
    type Output = (Export, u64);
    const WHAT: &'static str = "export";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<(Export, u64)> {
        let e = t.export_batch_if(self.offset, self.n, &self.filter)?;
        Ok((e, t.capacity()))
    }
}

/// set_global_epoch.
pub struct SetEpoch(pub u32);

impl ShardOp for SetEpoch {
    type Output = ();
    const WHAT: &'static str = "set_global_epoch";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.set_global_epoch(self.0);
        Ok(())
    }
}

/// reserve.
pub struct Reserve(pub u64);

impl ShardOp for Reserve {
    type Output = ();
    const WHAT: &'static str = "reserve";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.reserve(self.0)
    }
}

/// prepare_reserve: what a reserve needs allocated, the table unchanged.
pub struct PrepareReserve(pub u64);

impl ShardOp for PrepareReserve {
    type Output = ();
    const WHAT: &'static str = "reserve";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.prepare_reserve(self.0)
    }
}

/// cancel_reserve: what a prepare kept, freed.
pub struct CancelReserve;

impl ShardOp for CancelReserve {
    type Output = ();
    const WHAT: &'static str = "reserve";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.cancel_reserve();
        Ok(())
    }
}

/// Entries and slots.
pub struct Size;

impl ShardOp for Size {
    type Output = (u64, u64);
    const WHAT: &'static str = "size";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<(u64, u64)> {
        Ok((t.size(), t.capacity()))
    }
}

/// Counters and lock state.
pub struct Stats;

impl ShardOp for Stats {
    type Output = ShardStats;
    const WHAT: &'static str = "stats";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<ShardStats> {
        Ok(t.stats())
    }
}

/// clock_score: the lowest score a write made from now on can get.
pub struct ClockScore;

impl ShardOp for ClockScore {
    type Output = u64;
    const WHAT: &'static str = "clock_score";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<u64> {
        Ok(t.clock_score())
    }
}

/// prefault: a restore's new table's pages touched while its chunks are
/// read, until the flag is set (`Shard::prefault`).
pub struct Prefault(pub std::sync::Arc<std::sync::atomic::AtomicBool>);

impl ShardOp for Prefault {
    type Output = ();
    const WHAT: &'static str = "prefault";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.prefault(&self.0);
        Ok(())
    }
}

/// resume_after: clock and epoch moved past a restore's scores.
pub struct ResumeAfter(pub u64);

impl ShardOp for ResumeAfter {
    type Output = ();
    const WHAT: &'static str = "resume_after";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.resume_after(self.0);
        Ok(())
    }
}

/// Drains the shard's samples into its miss-ratio estimator (nothing when
/// the curves are off).
pub struct MrcDrain;

impl ShardOp for MrcDrain {
    type Output = ();
    const WHAT: &'static str = "the miss-ratio curve";
    fn run(self, t: &dyn Shard, mrc: Option<&ShardMrc>) -> Result<()> {
        if let Some(m) = mrc {
            m.drain(t);
        }
        Ok(())
    }
}

/// The shard's curve, drained first (None when the shard has no estimator).
pub struct MrcCurve;

impl ShardOp for MrcCurve {
    type Output = Option<ShardCurve>;
    const WHAT: &'static str = "the miss-ratio curve";
    fn run(self, t: &dyn Shard, mrc: Option<&ShardMrc>) -> Result<Option<ShardCurve>> {
        Ok(mrc.map(|m| m.curve(t)))
    }
}

/// Starts a trace of the shard's sampled keys (at most `max_keys`).
pub struct TraceStart {
    /// The bound.
    pub max_keys: usize,
}

impl ShardOp for TraceStart {
    type Output = ();
    const WHAT: &'static str = "a trace";
    fn run(self, t: &dyn Shard, mrc: Option<&ShardMrc>) -> Result<()> {
        if let Some(m) = mrc {
            m.trace_start(t, self.max_keys);
        }
        Ok(())
    }
}

/// The trace collected since [`TraceStart`] (None without an estimator).
pub struct TraceTake;

impl ShardOp for TraceTake {
    type Output = Option<ShardTrace>;
    const WHAT: &'static str = "a trace";
    fn run(self, t: &dyn Shard, mrc: Option<&ShardMrc>) -> Result<Option<ShardTrace>> {
        Ok(mrc.map(|m| m.trace_take(t)))
    }
}

/// An operation on a client's device memory in place (`Shard::run_ipc`):
/// `done` recorded after its last write, `queued` called once its kernels
/// are queued.
pub struct RunIpc {
    /// Which.
    pub op: DeviceOp,
    /// The client's arrays.
    pub arrays: IpcArrays,
    /// This shard's keys of a batch every shard reads, when split.
    pub part: Option<IpcPart>,
    /// The client's done event.
    pub done: Option<Arc<IpcEvent>>,
    /// Told when the kernels are queued.
    pub queued: Option<Box<dyn FnOnce() + Send>>,
}

impl ShardOp for RunIpc {
    type Output = Counts;
    const WHAT: &'static str = "a request on device memory";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<Counts> {
        let order = IpcOrder { wait: None, done: self.done.as_deref(), queued: self.queued };
        t.run_ipc(self.op, &self.arrays, self.part, order)
    }
}

/// Refuses keys in a client's device memory that hold a reserved marker
/// (`Shard::check_ipc_keys`), before any shard writes its part.
pub struct CheckIpcKeys(pub IpcSpan<u64>);

impl ShardOp for CheckIpcKeys {
    type Output = ();
    const WHAT: &'static str = "a key check on device memory";
    fn run(self, t: &dyn Shard, _: Option<&ShardMrc>) -> Result<()> {
        t.check_ipc_keys(&self.0)
    }
}
