//! `ShardActor`: the thread(s) owning one device and its shard of every table.
//!
//! Each device gets its own `SyncArbiter` (blocking work never runs on the
//! async executor); a CUDA context is bound to those threads. The shards
//! live in the actor: the router names a table by its [`TableId`] and sends
//! [`Open`], [`Call`] and [`Close`]; no shard is reachable from anywhere
//! else, so no table lock is ever taken on the async executor. Messages
//! carry owned sub-batches and come back with owned results.

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;
use hkv_proto::WriteOp;
use hkv_shard::check::CheckedKeys;
use hkv_shard::{Backend, Evictions, Export, Filter, Outcome, Shard, ShardStats, Summary, TableConfig};
use parking_lot::RwLock;

use crate::budget::Charge;
use crate::frames::AnswerFrame;
use crate::mrc::{MrcOp, MrcResult, ShardMrc};
use hkv_shard::mrc::MrcConfig;

/// Names a table to the actors: unique for the daemon's life (a restore
/// builds a table of the same name beside the running one).
pub type TableId = u64;

/// The shards of one device, by table: shared by that device's actor
/// threads, touched by nothing else.
type Shards = Arc<RwLock<HashMap<TableId, Arc<dyn Shard>>>>;

/// The actor of one device: each of its threads (`threads_per_shard`, so
/// that readers run in parallel in the table's own lock groups) serves
/// messages on the shards they own together.
pub struct ShardActor {
    /// Device (or CPU shard) index.
    device: usize,
    /// This device's shard of every table.
    shards: Shards,
    /// The miss-ratio estimators of those shards, by table (`crate::mrc`).
    mrcs: Arc<RwLock<HashMap<TableId, Arc<ShardMrc>>>>,
}

impl ShardActor {
    /// Starts the actor of device (or CPU shard) `device` on `threads` threads.
    pub fn start(device: usize, threads: usize) -> Addr<ShardActor> {
        let shards = Shards::default();
        let mrcs = Arc::<RwLock<HashMap<TableId, Arc<ShardMrc>>>>::default();
        SyncArbiter::start(threads.max(1), move || ShardActor { device, shards: shards.clone(), mrcs: mrcs.clone() })
    }

    fn shard(&self, table: TableId) -> Result<Arc<dyn Shard>, hkv_shard::Error> {
        self.shards.read().get(&table).cloned().ok_or_else(|| {
            hkv_shard::Error::Device(format!("table {table} has no shard on device {}; it was dropped", self.device))
        })
    }
}

impl Actor for ShardActor {
    type Context = SyncContext<Self>;
}

/// One shard's part of a request.
#[derive(Debug)]
pub enum SubOp {
    /// find.
    Find {
        /// Keys.
        keys: Keys,
        /// Return scores.
        scores: bool,
    },
    /// find written straight into the response frame (one shard holds
    /// every key; see [`AnswerFrame::rows`]).
    FindInto {
        /// Keys.
        keys: Keys,
        /// The response, laid out; its found bytes and values are filled.
        frame: AnswerFrame,
    },
    /// find of one shard's part of a request, written straight into the
    /// response frame that every shard fills in turn (`Shard::find_at`).
    FindAt {
        /// This shard's keys.
        keys: Keys,
        /// Their rows in the request (increasing).
        at: Vec<u32>,
        /// The response, laid out; this shard's found bytes and values are filled.
        frame: AnswerFrame,
    },
    /// contains.
    Contains {
        /// Keys.
        keys: Keys,
    },
    /// A write.
    Write {
        /// Which.
        op: WriteOp,
        /// Keys.
        keys: Keys,
        /// Values or deltas.
        values: Vec<f32>,
        /// Scores.
        scores: Option<Vec<u64>>,
    },
    /// assign_scores.
    AssignScores {
        /// Keys.
        keys: Keys,
        /// Scores.
        scores: Option<Vec<u64>>,
    },
    /// erase.
    Erase {
        /// Keys.
        keys: Keys,
    },
    /// erase_if.
    EraseIf(Filter),
    /// clear.
    Clear,
    /// export_batch_if.
    Export {
        /// First slot.
        offset: u64,
        /// Slots.
        n: u64,
        /// Predicate.
        filter: Filter,
    },
    /// set_global_epoch.
    SetEpoch(u32),
    /// reserve.
    Reserve(u64),
    /// Size and capacity.
    Size,
    /// Counters and lock state.
    Stats,
    /// clock_score.
    ClockScore,
    /// resume_after.
    ResumeAfter(u64),
    /// The shard's miss-ratio estimator (`crate::mrc`).
    Mrc(MrcOp),
    /// Work given as a function of the shard: requests whose arrays live in
    /// registered regions (`crate::region`).
    With(crate::region::ShardFn),
}

/// One shard's answer.
#[derive(Debug)]
pub enum SubResult {
    /// find.
    Find {
        /// Found flags.
        found: Vec<bool>,
        /// Values.
        values: Vec<f32>,
        /// Scores, if asked for.
        scores: Option<Vec<u64>>,
    },
    /// find written into its response frame.
    Frame(AnswerFrame),
    /// contains / erase flags.
    Flags(Vec<bool>),
    /// Writes.
    Write {
        /// Counts.
        summary: Summary,
        /// Per key.
        outcomes: Vec<Outcome>,
        /// find_or_insert values.
        values: Option<Vec<f32>>,
        /// insert_and_evict output.
        evicted: Option<Evictions>,
    },
    /// erase_if count; clock_score.
    Count(u64),
    /// export, and the shard's capacity after it (slots move when it grew).
    Export(Export, u64),
    /// Entries and slots.
    Size {
        /// Entries.
        size: u64,
        /// Slots.
        capacity: u64,
    },
    /// Counters and lock state.
    Stats(Box<ShardStats>),
    /// Nothing to return.
    Unit,
    /// The miss-ratio estimator's answer (`MrcResult::Unit` when the
    /// curves are off).
    Mrc(MrcResult),
    /// A request on a client's device memory (`CudaTable::run_ipc`).
    Counts(hkv_shard::cuda::table::Counts),
}

/// Runs a sub-batch on this device's shard of a table.
#[derive(Message)]
#[rtype(result = "Result<SubResult, hkv_shard::Error>")]
pub struct Call {
    /// The table.
    pub table: TableId,
    /// What to do.
    pub op: SubOp,
}

/// Creates this device's shard of a table.
#[derive(Message)]
#[rtype(result = "Result<(), hkv_shard::Error>")]
pub struct Open {
    /// The table.
    pub table: TableId,
    /// Per-shard config.
    pub config: TableConfig,
    /// Backend.
    pub backend: Backend,
    /// Its miss-ratio estimator's config (None: the curves are off).
    pub mrc: Option<MrcConfig>,
}

/// Drops this device's shard of a table (a call running on it finishes first).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Close {
    /// The table.
    pub table: TableId,
    /// The table's share of the memory budget, given back once every
    /// device dropped its shard (when the router does not wait for them).
    pub charge: Option<Arc<Charge>>,
}

impl Handler<Open> for ShardActor {
    type Result = Result<(), hkv_shard::Error>;
    fn handle(&mut self, msg: Open, _: &mut SyncContext<Self>) -> Self::Result {
        let device = self.device;
        let shard: Arc<dyn Shard> =
            contained("create_table", || Ok(Arc::from(hkv_shard::open_on(msg.config, msg.backend, device)?)))?;
        if let Some(cfg) = msg.mrc {
            self.mrcs.write().insert(msg.table, ShardMrc::open(&*shard, cfg));
        }
        self.shards.write().insert(msg.table, shard);
        Ok(())
    }
}

impl Handler<Close> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Close, _: &mut SyncContext<Self>) {
        self.mrcs.write().remove(&msg.table);
        let shard = self.shards.write().remove(&msg.table);
        // Freed here, on the actor's thread (a CUDA shard binds its context).
        drop(shard);
        drop(msg.charge);
    }
}

impl Handler<Call> for ShardActor {
    type Result = Result<SubResult, hkv_shard::Error>;
    fn handle(&mut self, msg: Call, _: &mut SyncContext<Self>) -> Self::Result {
        let shard = self.shard(msg.table)?;
        if let SubOp::Mrc(op) = msg.op {
            let mrc = self.mrcs.read().get(&msg.table).cloned();
            let r = contained("the miss-ratio curve", || Ok(mrc.map(|m| m.execute(&*shard, op))));
            return Ok(SubResult::Mrc(r?.unwrap_or(MrcResult::Unit)));
        }
        contained("a table operation", || execute(&*shard, msg.op))
    }
}

/// Runs `f`, turning a panic into an error: a bug hit by one request fails
/// that request, and the actor's thread lives on to serve the next one
/// (a thread that died would leave every later request without an answer).
fn contained<T>(what: &str, f: impl FnOnce() -> Result<T, hkv_shard::Error>) -> Result<T, hkv_shard::Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        tracing::error!(panic = %why, "{what} panicked; the request failed, the shard actor goes on");
        Err(hkv_shard::Error::Device(format!("{what} failed inside the daemon ({why}); please report it")))
    })
}

/// A shard's keys: as sent, for the shard to check (a batch that goes
/// whole to one shard), or part of a split batch the router checked whole
/// (`hkv_shard::check::CheckedKeys`), which the shard does not scan again.
#[derive(Debug)]
pub enum Keys {
    /// Not yet checked.
    Sent(Vec<u64>),
    /// Checked by the router.
    Checked(CheckedKeys),
}

impl Keys {
    /// Keys.
    pub fn len(&self) -> usize {
        match self {
            Keys::Sent(k) => k.len(),
            Keys::Checked(k) => k.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` on the keys; checked ones inside their scope, so that the
    /// shard's own check passes them without a scan.
    fn scope<R>(&self, f: impl FnOnce(&[u64]) -> R) -> R {
        match self {
            Keys::Sent(k) => f(k),
            Keys::Checked(k) => k.scope(f),
        }
    }
}

/// One shard's part of a write.
fn write(
    t: &dyn Shard,
    op: WriteOp,
    keys: &[u64],
    mut values: Vec<f32>,
    scores: Option<Vec<u64>>,
) -> Result<SubResult, hkv_shard::Error> {
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
    Ok(SubResult::Write { summary, outcomes, values, evicted })
}

/// Runs `op` on `t` (on the calling thread: an actor's).
fn execute(t: &dyn Shard, op: SubOp) -> Result<SubResult, hkv_shard::Error> {
    let dim = t.dim();
    Ok(match op {
        SubOp::Find { keys, scores } => {
            let mut values = vec![0.0; keys.len() * dim];
            let mut found = vec![false; keys.len()];
            let mut sc = scores.then(|| vec![0u64; keys.len()]);
            keys.scope(|k| t.find(k, &mut values, &mut found, sc.as_deref_mut()))?;
            SubResult::Find { found, values, scores: sc }
        }
        SubOp::FindInto { keys, mut frame } => {
            let mut found = vec![false; keys.len()];
            let (flags, mut rows) = frame.rows().expect("aligned: checked by the router");
            keys.scope(|k| t.find_into(k, rows.reborrow(), &mut found))?;
            // The frame's buffer may hold an earlier answer: misses get zeros.
            let dim = t.config().dim;
            let values = rows.into_values();
            for ((b, &f), row) in flags.iter_mut().zip(&found).zip(values.chunks_exact_mut(dim)) {
                *b = u8::from(f);
                if !f {
                    row.fill(0.0);
                }
            }
            SubResult::Frame(frame)
        }
        SubOp::FindAt { keys, at, mut frame } => {
            let (flags, rows) = frame.rows().expect("aligned: checked by the router");
            keys.scope(|k| t.find_at(k, &at, rows, flags))?;
            SubResult::Frame(frame)
        }
        SubOp::Contains { keys } => {
            let mut found = vec![false; keys.len()];
            keys.scope(|k| t.contains(k, &mut found))?;
            SubResult::Flags(found)
        }
        SubOp::Write { op, keys, values, scores } => keys.scope(|k| write(t, op, k, values, scores))?,
        SubOp::AssignScores { keys, scores } => {
            let mut outcomes = vec![Outcome::Absent; keys.len()];
            let summary = keys.scope(|k| t.assign_scores(k, scores.as_deref(), Some(&mut outcomes)))?;
            SubResult::Write { summary, outcomes, values: None, evicted: None }
        }
        SubOp::Erase { keys } => {
            let mut erased = vec![false; keys.len()];
            keys.scope(|k| t.erase(k, Some(&mut erased)))?;
            SubResult::Flags(erased)
        }
        SubOp::EraseIf(f) => SubResult::Count(t.erase_if(&f)?),
        SubOp::Clear => {
            t.clear()?;
            SubResult::Unit
        }
        SubOp::Export { offset, n, filter } => {
            let e = t.export_batch_if(offset, n, &filter)?;
            SubResult::Export(e, t.capacity())
        }
        SubOp::SetEpoch(e) => {
            t.set_global_epoch(e);
            SubResult::Unit
        }
        SubOp::Reserve(c) => {
            t.reserve(c)?;
            SubResult::Unit
        }
        SubOp::Size => SubResult::Size { size: t.size(), capacity: t.capacity() },
        SubOp::Stats => SubResult::Stats(Box::new(t.stats())),
        SubOp::ClockScore => SubResult::Count(t.clock_score()),
        SubOp::ResumeAfter(s) => {
            t.resume_after(s);
            SubResult::Unit
        }
        // Answered by the actor, which owns the estimators.
        SubOp::Mrc(_) => SubResult::Mrc(MrcResult::Unit),
        SubOp::With(f) => (f.0)(t)?,
    })
}

fn summarize(outcomes: &[Outcome]) -> Summary {
    let mut s = Summary::default();
    for &o in outcomes {
        s.add(o);
    }
    s
}
