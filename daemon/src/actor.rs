//! `ShardActor`: the thread(s) owning one device and its shard of every table.
//!
//! Each device gets its own `SyncArbiter` (blocking work never runs on the
//! async executor); a CUDA context is bound to those threads. Messages carry
//! owned sub-batches and come back with owned results.

use std::sync::Arc;

use actix::prelude::*;
use hkv_proto::FindFrame;
use hkv_shard::{Backend, Evictions, Export, Filter, Outcome, Shard, Summary, TableConfig};
use zerocopy::FromBytes;

/// The found bytes and values of `frame` as the table writes them: None
/// unless the values are aligned for f32 (the router only builds frames
/// whose values start at a multiple of 4 bytes, in an allocation aligned
/// at least that much) and the host is little-endian (the wire's order), so
/// that the bytes sent are the floats as stored.
pub fn values_of(frame: &mut FindFrame) -> Option<(&mut [u8], &mut [f32])> {
    if !cfg!(target_endian = "little") {
        return None;
    }
    let (found, bytes) = frame.parts_mut();
    <[f32]>::mut_from_bytes(bytes).ok().map(|v| (found, v))
}

/// The actor of one device.
pub struct ShardActor {
    /// Device (or CPU shard) index.
    pub device: usize,
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
        keys: Vec<u64>,
        /// Return scores.
        scores: bool,
    },
    /// find written straight into the response frame (one shard holds
    /// every key; see [`values_of`]).
    FindInto {
        /// Keys.
        keys: Vec<u64>,
        /// The response, laid out; its found bytes and values are filled.
        frame: FindFrame,
    },
    /// find of one shard's part of a request, written straight into the
    /// response frame that every shard fills in turn (`Shard::find_at`).
    FindAt {
        /// This shard's keys.
        keys: Vec<u64>,
        /// Their rows in the request (increasing).
        at: Vec<u32>,
        /// The response, laid out; this shard's found bytes and values are filled.
        frame: FindFrame,
    },
    /// contains.
    Contains {
        /// Keys.
        keys: Vec<u64>,
    },
    /// A write op of `hkv_proto::msg::WRITE_OPS`.
    Write {
        /// Op code.
        op: u8,
        /// Keys.
        keys: Vec<u64>,
        /// Values or deltas.
        values: Vec<f32>,
        /// Scores.
        scores: Option<Vec<u64>>,
    },
    /// assign_scores.
    AssignScores {
        /// Keys.
        keys: Vec<u64>,
        /// Scores.
        scores: Option<Vec<u64>>,
    },
    /// erase.
    Erase {
        /// Keys.
        keys: Vec<u64>,
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
    Frame(FindFrame),
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
    /// erase_if count.
    Count(u64),
    /// export.
    Export(Export),
    /// Nothing to return.
    Unit,
}

/// Runs a sub-batch on a shard.
#[derive(Message)]
#[rtype(result = "Result<SubResult, hkv_shard::Error>")]
pub struct Call {
    /// The shard (of this actor's device).
    pub shard: Arc<dyn Shard>,
    /// What to do.
    pub op: SubOp,
}

/// Creates a shard on this actor's device.
#[derive(Message)]
#[rtype(result = "Result<Arc<dyn Shard>, hkv_shard::Error>")]
pub struct Create {
    /// Per-shard config.
    pub config: TableConfig,
    /// Backend.
    pub backend: Backend,
}

impl Handler<Create> for ShardActor {
    type Result = Result<Arc<dyn Shard>, hkv_shard::Error>;
    fn handle(&mut self, msg: Create, _: &mut SyncContext<Self>) -> Self::Result {
        let device = self.device;
        contained("create_table", || Ok(Arc::from(hkv_shard::open_on(msg.config, msg.backend, device)?)))
    }
}

impl Handler<Call> for ShardActor {
    type Result = Result<SubResult, hkv_shard::Error>;
    fn handle(&mut self, msg: Call, _: &mut SyncContext<Self>) -> Self::Result {
        contained("a table operation", || execute(&*msg.shard, msg.op))
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

/// Runs `op` on `t` (on the calling thread).
pub fn execute(t: &dyn Shard, op: SubOp) -> Result<SubResult, hkv_shard::Error> {
    use hkv_proto::op as code;
    let dim = t.dim();
    Ok(match op {
        SubOp::Find { keys, scores } => {
            let mut values = vec![0.0; keys.len() * dim];
            let mut found = vec![false; keys.len()];
            let mut sc = scores.then(|| vec![0u64; keys.len()]);
            t.find(&keys, &mut values, &mut found, sc.as_deref_mut())?;
            SubResult::Find { found, values, scores: sc }
        }
        SubOp::FindInto { keys, mut frame } => {
            let mut found = vec![false; keys.len()];
            let (flags, values) = values_of(&mut frame).expect("aligned: checked by the router");
            t.find(&keys, values, &mut found, None)?;
            // The frame's buffer may hold an earlier answer: misses get zeros.
            let dim = t.config().dim;
            for ((b, &f), row) in flags.iter_mut().zip(&found).zip(values.chunks_exact_mut(dim)) {
                *b = u8::from(f);
                if !f {
                    row.fill(0.0);
                }
            }
            SubResult::Frame(frame)
        }
        SubOp::FindAt { keys, at, mut frame } => {
            let (flags, values) = values_of(&mut frame).expect("aligned: checked by the router");
            t.find_at(&keys, &at, values, flags)?;
            SubResult::Frame(frame)
        }
        SubOp::Contains { keys } => {
            let mut found = vec![false; keys.len()];
            t.contains(&keys, &mut found)?;
            SubResult::Flags(found)
        }
        SubOp::Write { op, keys, mut values, scores } => {
            let mut outcomes = vec![Outcome::Absent; keys.len()];
            let sc = scores.as_deref();
            let o = Some(&mut outcomes[..]);
            let (summary, values, evicted) = match op {
                code::INSERT_OR_ASSIGN => (t.insert_or_assign(&keys, &values, sc, o)?, None, None),
                code::INSERT_AND_EVICT => {
                    let ev = t.insert_and_evict(&keys, &values, sc, o)?;
                    (summarize(&outcomes), None, Some(ev))
                }
                code::FIND_OR_INSERT => {
                    let s = t.find_or_insert(&keys, &mut values, sc, o)?;
                    (s, Some(values), None)
                }
                code::ASSIGN => (t.assign(&keys, &values, sc, o)?, None, None),
                code::ACCUM_OR_ASSIGN => (t.accum_or_assign(&keys, &values, sc, o)?, None, None),
                // load reports no per-key outcome: every one stays Absent.
                code::LOAD => (t.load(&keys, &values, sc.unwrap_or(&[]))?, None, None),
                other => unreachable!("router sends only write ops here, got {other:#x}"),
            };
            SubResult::Write { summary, outcomes, values, evicted }
        }
        SubOp::AssignScores { keys, scores } => {
            let mut outcomes = vec![Outcome::Absent; keys.len()];
            let summary = t.assign_scores(&keys, scores.as_deref(), Some(&mut outcomes))?;
            SubResult::Write { summary, outcomes, values: None, evicted: None }
        }
        SubOp::Erase { keys } => {
            let mut erased = vec![false; keys.len()];
            t.erase(&keys, Some(&mut erased))?;
            SubResult::Flags(erased)
        }
        SubOp::EraseIf(f) => SubResult::Count(t.erase_if(&f)?),
        SubOp::Clear => {
            t.clear()?;
            SubResult::Unit
        }
        SubOp::Export { offset, n, filter } => SubResult::Export(t.export_batch_if(offset, n, &filter)?),
        SubOp::SetEpoch(e) => {
            t.set_global_epoch(e);
            SubResult::Unit
        }
        SubOp::Reserve(c) => {
            t.reserve(c)?;
            SubResult::Unit
        }
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
