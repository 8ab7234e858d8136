//! The table operations: each request split over the shards (checked whole
//! first when it is split), run on their actors, its answers merged; and
//! the feature requests, hashed and then run as the finds and writes they
//! are, without a round trip through a wire request.

use std::sync::atomic::Ordering::SeqCst;

use hkv_proto::{Cursor, ErrorCode, FindFrame, Op, ProtoError, Request, Response, Summary, WriteOp};
use hkv_shard::check::{self, CheckedKeys};
use hkv_shard::ScorePolicy;

use super::bounds::{export_slots, find_per_key, write_per_key};
use super::merge::{to_filter, ApplyAnswer, ExportAnswer, FindAnswer, WriteAnswer};
use super::split::Split;
use super::{Router, Table};
use crate::error::{err, shard_error};
use crate::frames::Framed;
use crate::shard_ops::{self as op, Destination, Keys};

/// One shard's part of a load: keys, values (dim per key), scores.
pub type Part = (Vec<u64>, Vec<f32>, Vec<u64>);

/// Each shard's keys: a batch that goes whole to one shard as sent (that
/// shard checks it); a split one checked here whole, once, then with
/// `more` (the op's other checks, given the key count), so that a bad batch
/// is refused before any shard runs.
fn shard_keys(
    split: &Split,
    keys: Vec<u64>,
    more: impl FnOnce(usize) -> hkv_shard::Result<()>,
) -> Result<Vec<Keys>, ProtoError> {
    match split {
        Split::Whole => Ok(vec![keys]),
        Split::Parts(parts) => {
            let n = keys.len();
            let k = CheckedKeys::check(keys).map_err(shard_error)?;
            more(n).map_err(shard_error)?;
            Ok(k.parts(parts).into_iter().map(CheckedKeys::into_vec).collect())
        }
    }
}

/// A load's scores: one per key, stored verbatim whatever the policy.
fn load_scores(scores: Option<&[u64]>) -> Result<(), ProtoError> {
    match scores {
        Some(_) => Ok(()),
        None => Err(err(ErrorCode::Scores, "load needs a score per key (sent with the SCORES flag)")),
    }
}

/// The arrays of a write `code` of `n` keys: `values` floats (deltas for
/// accum_or_assign), and scores as the policy takes them (a load's, one a
/// key, whatever the policy: as `Shard::load` checks them).
fn write_arrays(t: &Table, code: WriteOp, n: usize, values: usize, scores: Option<&[u64]>) -> hkv_shard::Result<()> {
    if code == WriteOp::Load {
        check::len("scores", scores.map_or(0, <[u64]>::len), n, || format!("{n} keys"))?;
        return check::write_arrays(&t.config, n, Some(("values", values)), None, false, None);
    }
    let what = if code == WriteOp::AccumOrAssign { "deltas" } else { "values" };
    check::write_arrays(&t.config, n, Some((what, values)), scores, code != WriteOp::Assign, None)
}

/// apply_gradients with both SUM and OUTCOMES: refused.
pub(crate) fn summed_outcomes() -> ProtoError {
    ProtoError::bad_request(
        "apply_gradients: SUM (repeated keys' gradients summed, one step per key) answers no flags or values per \
         occurrence; send it without OUTCOMES, or without SUM",
    )
}

/// The optimizer step of a request on `t`, which must have been created
/// with an optimizer (else `bad_request`).
pub(crate) fn step_of(t: &Table, hyper: hkv_proto::Hyper) -> Result<hkv_shard::optim::Step, ProtoError> {
    use hkv_shard::optim::Optimizer as O;
    let Some(o) = t.spec.optimizer else {
        return Err(ProtoError::bad_request(format!(
            "apply_gradients: table {:?} has no optimizer; create it with \"optimizer\" (sgd, adagrad, \
             rowwise_adagrad or adam) to keep the optimizer's state in its rows",
            t.spec.name
        )));
    };
    let optimizer = match o {
        hkv_proto::Optimizer::Sgd => O::Sgd,
        hkv_proto::Optimizer::Adagrad => O::Adagrad,
        hkv_proto::Optimizer::RowwiseAdagrad => O::RowwiseAdagrad,
        hkv_proto::Optimizer::Adam => O::Adam,
    };
    let h = hkv_shard::optim::Hyper {
        lr: hyper.lr,
        eps: hyper.eps,
        beta1: hyper.beta1,
        beta2: hyper.beta2,
        weight_decay: hyper.weight_decay,
        step: hyper.step,
    };
    let step = hkv_shard::optim::Step { optimizer, dim: t.spec.dim, hyper: h, sum: hyper.sum };
    step.check().map_err(shard_error)?;
    Ok(step)
}

impl Router {
    /// Executes a table request (on the cache alone: a backed table's
    /// requests reach it through `crate::backing`, which calls this).
    pub async fn execute(&self, req: Request) -> Result<Response, ProtoError> {
        let t = self.table(req.table().unwrap_or_default())?;
        match req {
            Request::Find { keys, scores, .. } => self.find(&t, keys, scores).await,
            Request::Contains { keys, .. } => Ok(Response::Contains { found: self.contains(&t, keys).await? }),
            Request::Erase { keys, outcomes, .. } => {
                let (count, flags) = self.erase(&t, keys, outcomes).await?;
                Ok(Response::Erased { count, flags })
            }
            Request::Write { op: code, keys, values, scores, outcomes, .. } => {
                self.write(&t, code, keys, values, scores, outcomes).await.map(Into::into)
            }
            Request::AssignScores { keys, scores, outcomes, .. } => {
                self.assign_scores(&t, keys, scores, outcomes).await.map(Into::into)
            }
            Request::EraseIf { filter, .. } => {
                let f = to_filter(filter);
                let count = self.on_each(&t, || op::EraseIf(f)).await?.into_iter().sum();
                Ok(Response::Erased { count, flags: None })
            }
            Request::Clear { .. } => {
                let _whole = t.rewrite.write().await;
                self.clear(&t).await?;
                Ok(Response::Empty)
            }
            Request::SetEpoch { epoch, .. } => {
                // Below the highest epoch the table ever had (a restored one
                // included): later writes may score below the last watermark.
                let lower = epoch < t.epoch.fetch_max(epoch, SeqCst);
                let _whole = if lower { Some(t.rewrite.write().await) } else { None };
                let _mark = lower.then(|| t.untracked_write());
                self.on_each(&t, || op::SetEpoch(epoch)).await?;
                Ok(Response::Empty)
            }
            Request::Reserve { capacity, .. } => {
                let _whole = t.rewrite.write().await;
                self.reserve(&t, capacity).await
            }
            Request::Export { cursor, max_slots, filter, .. } => {
                self.export(&t, cursor, max_slots, filter).await.map(Into::into)
            }
            Request::ApplyGradients { hyper, keys, grads, outcomes, .. } => {
                self.apply_gradients(&t, hyper, keys, grads, outcomes).await.map(Into::into)
            }
            other => Err(ProtoError::bad_request(format!("{} is not a table operation", other.op().name()))),
        }
    }

    /// find: without scores, the answers are written where they are sent
    /// from, the response frame (see [`Router::find_into`]).
    async fn find(&self, t: &Table, keys: Vec<u64>, scores: bool) -> Result<Response, ProtoError> {
        let (n, dim) = (keys.len(), t.config.dim);
        self.bound("find", n, dim, find_per_key(dim, scores), 16)?;
        if !scores {
            if let Some(frame) = self.answer_frame(n, dim) {
                return Ok(self.find_framed(t, keys, frame).await?.into_response());
            }
        }
        self.find_rows(t, keys, scores).await.map(Into::into)
    }

    /// A find answer's frame for `n` keys of `dim` floats that tables
    /// write their rows into, when the frames give one that takes rows.
    pub fn answer_frame(&self, n: usize, dim: usize) -> Option<Framed> {
        if !FindFrame::values_at(n).is_multiple_of(4) {
            return None;
        }
        self.frames.find_frame(n, dim).framed()
    }

    /// find written into `frame` ([`Router::answer_frame`]), whose found
    /// bytes and rows the caller may complete before it is sent (the
    /// backing tier writes there the rows it fills).
    pub async fn find_framed(&self, t: &Table, keys: Vec<u64>, frame: Framed) -> Result<Framed, ProtoError> {
        let split = Split::new(&keys, t.shards());
        let keys = shard_keys(&split, keys, |_| Ok(()))?;
        Ok(self.find_into(t, split, keys, frame).await?.0)
    }

    /// find into arrays of the daemon.
    pub async fn find_rows(&self, t: &Table, keys: Vec<u64>, scores: bool) -> Result<FindAnswer, ProtoError> {
        let n = keys.len();
        let split = Split::new(&keys, t.shards());
        let keys = shard_keys(&split, keys, |_| Ok(()))?;
        let ops = keys.into_iter().map(|keys| op::Find { keys, scores }).collect();
        self.finds(t, &split, ops, n, scores).await
    }

    /// find written in place into `dest` (a client's region); answers it and the hits.
    pub async fn find_to<D: Destination>(&self, t: &Table, keys: Vec<u64>, dest: D) -> Result<(D, u64), ProtoError> {
        let split = Split::new(&keys, t.shards());
        let keys = shard_keys(&split, keys, |_| Ok(()))?;
        self.find_into(t, split, keys, dest).await
    }

    /// contains: 1 per key present, in request order.
    pub async fn contains(&self, t: &Table, keys: Vec<u64>) -> Result<Vec<u8>, ProtoError> {
        let (n, split) = (keys.len(), Split::new(&keys, t.shards()));
        let keys = shard_keys(&split, keys, |_| Ok(()))?;
        self.flags(t, &split, keys.into_iter().map(op::Contains).collect(), n).await
    }

    /// erase: the count erased, and a flag per key when asked for.
    pub async fn erase(&self, t: &Table, keys: Vec<u64>, outcomes: bool) -> Result<(u64, Option<Vec<u8>>), ProtoError> {
        let (n, split) = (keys.len(), Split::new(&keys, t.shards()));
        let keys = shard_keys(&split, keys, |_| Ok(()))?;
        let flags = self.flags(t, &split, keys.into_iter().map(op::Erase).collect(), n).await?;
        let count = flags.iter().filter(|&&f| f == 1).count() as u64;
        Ok((count, outcomes.then_some(flags)))
    }

    /// A write op ([`WriteOp`]).
    pub async fn write(
        &self,
        t: &Table,
        code: WriteOp,
        keys: Vec<u64>,
        values: Vec<f32>,
        scores: Option<Vec<u64>>,
        outcomes: bool,
    ) -> Result<WriteAnswer, ProtoError> {
        let dim = t.config.dim;
        self.bound(Op::from(code).name(), keys.len(), dim, write_per_key(code, dim, outcomes), 64)?;
        let split = Split::new(&keys, t.shards());
        let n = keys.len();
        // Held until every shard answered (or the request is dropped).
        let (mut _whole, mut _mark) = (None, None);
        if code == WriteOp::Load {
            load_scores(scores.as_deref())?;
        }
        let keys = shard_keys(&split, keys, |n| write_arrays(t, code, n, values.len(), scores.as_deref()))?;
        if code == WriteOp::Load {
            // A load places entries as they were: no per-key outcome, and
            // scores an incremental checkpoint cannot tell from older ones.
            // Not during the table's export by a checkpoint (`rewrite`).
            _whole = Some(t.rewrite.write().await);
            _mark = Some(t.untracked_write());
        }
        let outcomes = outcomes && code != WriteOp::Load;
        let mut scores = scores.map(|s| split.take(s, 1).into_iter());
        let ops = keys
            .into_iter()
            .zip(split.take(values, dim))
            .map(|(keys, values)| op::Write { op: code, keys, values, scores: scores.as_mut().and_then(|s| s.next()) })
            .collect();
        self.writes(t, &split, ops, n, outcomes, code.into()).await
    }

    /// Every check [`Router::write`] makes of a request, on the whole
    /// batch, before anything is read or written: for a backed table's
    /// writes, which work on the arrays before the cache sees them.
    pub(crate) fn check_write(
        &self,
        t: &Table,
        code: WriteOp,
        keys: &[u64],
        values: usize,
        scores: Option<&[u64]>,
        outcomes: bool,
    ) -> Result<(), ProtoError> {
        let (n, dim) = (keys.len(), t.config.dim);
        self.bound(Op::from(code).name(), n, dim, write_per_key(code, dim, outcomes), 64)?;
        if code == WriteOp::Load {
            load_scores(scores)?;
        }
        check::keys(keys).map_err(shard_error)?;
        write_arrays(t, code, n, values, scores).map_err(shard_error)
    }

    /// apply_gradients: one step of the table's optimizer on the rows of
    /// the present keys; with `values`, their flags and values after it.
    pub async fn apply_gradients(
        &self,
        t: &Table,
        hyper: hkv_proto::Hyper,
        keys: Vec<u64>,
        grads: Vec<f32>,
        values: bool,
    ) -> Result<ApplyAnswer, ProtoError> {
        let step = step_of(t, hyper)?;
        let (n, d) = (keys.len(), step.dim);
        if values && step.sum {
            return Err(summed_outcomes());
        }
        if values {
            self.bound("apply_gradients", n, d, 1 + 4 * d as u64, 64)?;
        }
        let split = Split::new(&keys, t.shards());
        let rows = t.config.dim;
        let keys = shard_keys(&split, keys, |n| hkv_shard::optim::check_batch(rows, &step, n, grads.len(), n, None))?;
        let ops = keys
            .into_iter()
            .zip(split.take(grads, d))
            .map(|(keys, grads)| op::ApplyGradients { keys, grads, step, values })
            .collect();
        self.applied(t, &split, ops, n, d, values).await
    }

    /// assign_scores.
    pub async fn assign_scores(
        &self,
        t: &Table,
        keys: Vec<u64>,
        scores: Option<Vec<u64>>,
        outcomes: bool,
    ) -> Result<WriteAnswer, ProtoError> {
        // A custom table's scores are the caller's: without them there is nothing to assign.
        let policy = t.config.policy;
        if policy == ScorePolicy::Custom && scores.is_none() {
            return Err(shard_error(hkv_shard::Error::ScoresRequired { policy }));
        }
        let (n, split) = (keys.len(), Split::new(&keys, t.shards()));
        let keys =
            shard_keys(&split, keys, |n| check::write_arrays(&t.config, n, None, scores.as_deref(), false, None))?;
        let mut scores = scores.map(|s| split.take(s, 1).into_iter());
        let ops = keys
            .into_iter()
            .map(|keys| op::AssignScores { keys, scores: scores.as_mut().and_then(|s| s.next()) })
            .collect();
        self.writes(t, &split, ops, n, outcomes, Op::AssignScores).await
    }

    async fn reserve(&self, t: &Table, capacity: u64) -> Result<Response, ProtoError> {
        let n_shards = t.shards();
        let most = t.config.max_buckets() * 128 * n_shards as u64;
        if capacity > most {
            return Err(ProtoError::bad_request(format!(
                "cannot reserve {capacity} slots: table {:?} grows to {most} at most; \
                 create it with a larger max_capacity",
                t.spec.name
            )));
        }
        let per = capacity.div_ceil(n_shards as u64);
        // All or nothing: every shard first allocates what it will need
        // (the table unchanged); if one cannot, every shard frees what it
        // allocated and the table stays as it was. Then each grows into
        // what it allocated (no large allocation left on either backend).
        if let Err(e) = self.on_each(t, || op::PrepareReserve(per)).await {
            let _ = self.on_each(t, || op::CancelReserve).await;
            return Err(e);
        }
        self.on_each(t, || op::Reserve(per)).await?;
        Ok(Response::Empty)
    }

    /// One export step from `cursor`.
    pub async fn export(
        &self,
        t: &Table,
        cursor: Cursor,
        max_slots: u64,
        filter: hkv_proto::Filter,
    ) -> Result<ExportAnswer, ProtoError> {
        let (i, n_shards, dim) = (cursor.shard as usize, t.shards(), t.config.dim);
        if i >= n_shards {
            return Err(ProtoError::bad_request(format!("export cursor shard {i}: the table has {n_shards} shards")));
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
        let (e, capacity) = self.export_part(t, i, cursor.offset, max_slots, to_filter(filter)).await?;
        let end = cursor.offset.saturating_add(max_slots);
        let next = if end < capacity {
            Some(Cursor { shard: i as u32, offset: end })
        } else if i + 1 < n_shards {
            Some(Cursor { shard: i as u32 + 1, offset: 0 })
        } else {
            None
        };
        Ok(ExportAnswer { next, keys: e.keys, values: e.values, scores: e.scores })
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
        Ok(self.write(t, WriteOp::Load, keys, values, Some(scores), false).await?.summary)
    }

    /// Loads entries already split by shard (`parts[i]`: the keys, values
    /// and scores of the keys [`Router::shard_of`] gives shard `i`, as a
    /// restore decodes them), scores verbatim, each shard checking its own
    /// part. Ordered against checkpoints as [`Router::load_into`] is.
    pub async fn load_parts(&self, t: &Table, parts: Vec<Part>) -> Result<Summary, ProtoError> {
        if parts.len() != t.shards() {
            return Err(err(
                ErrorCode::Internal,
                format!("{} parts for the {} shards of table {:?}", parts.len(), t.shards(), t.spec.name),
            ));
        }
        let n: usize = parts.iter().map(|p| p.0.len()).sum();
        self.bound(Op::Load.name(), n, t.config.dim, write_per_key(WriteOp::Load, t.config.dim, false), 64)?;
        let _whole = t.rewrite.write().await;
        let _mark = t.untracked_write();
        let ops: Vec<op::Write> = parts
            .into_iter()
            .map(|(keys, values, scores)| op::Write { op: WriteOp::Load, keys, values, scores: Some(scores) })
            .collect();
        let mut summary = Summary::default();
        for w in self.fan_out(t, ops).await? {
            summary += super::merge::to_wire(w.summary);
        }
        Ok(summary)
    }

    /// The shard of `t` that `key` goes to.
    pub fn shard_of(t: &Table, key: u64) -> usize {
        match t.shards() {
            1 => 0,
            n => hkv_shard::hash::shard_of(key, n as u64) as usize,
        }
    }

    /// Executes a feature request: hash (on the GPU when present), then,
    /// for the fused ops, find or find_or_insert with the keys.
    pub async fn features(&self, req: Request) -> Result<Response, ProtoError> {
        let hashed = self.hash_request(req).await?;
        self.answer_hashed(hashed).await
    }

    /// A feature request's keys, hashed (on the GPU when present), with
    /// what the fused ops do with them.
    pub async fn hash_request(&self, req: Request) -> Result<Hashed, ProtoError> {
        let (table, hash, features, then) = match req {
            Request::Hash { table, hash, features } => (table, hash, features, Then::Keys),
            Request::FindFeatures { table, hash, features, scores } => (table, hash, features, Then::Find { scores }),
            Request::FindOrInsertFeatures { table, hash, features, values, scores, outcomes } => {
                (table, hash, features, Then::FindOrInsert { values, scores, outcomes })
            }
            other => return Err(ProtoError::bad_request(format!("{} is not a feature request", other.op().name()))),
        };
        let t = match then {
            Then::Keys if table.is_empty() => None,
            _ => Some(self.table(&table)?),
        };
        let (kind, num_buckets) = crate::features::resolve(hash, t.as_deref().map(|t| &t.spec))?;
        if matches!(then, Then::Keys) {
            self.bound("hash", features.len(), 0, 8, 8)?;
        }
        // Values, scores and dim are checked by find / find_or_insert,
        // before anything is applied; hashing changes nothing.
        let hasher = self.hasher.clone();
        let keys = tokio::task::spawn_blocking(move || hasher.hash(&features, kind, num_buckets))
            .await
            .map_err(|e| err(ErrorCode::Internal, format!("hashing task failed: {e}")))??;
        Ok(match (then, t) {
            (Then::Find { scores }, Some(t)) => Hashed::Find { t, keys, scores },
            (Then::FindOrInsert { values, scores, outcomes }, Some(t)) => {
                Hashed::FindOrInsert { t, keys, values, scores, outcomes }
            }
            _ => Hashed::Keys(keys),
        })
    }

    /// Answers a hashed feature request on the cache.
    pub async fn answer_hashed(&self, h: Hashed) -> Result<Response, ProtoError> {
        match h {
            Hashed::Keys(keys) => Ok(Response::Keys(keys)),
            Hashed::Find { t, keys, scores } => self.find(&t, keys, scores).await,
            Hashed::FindOrInsert { t, keys, values, scores, outcomes } => {
                self.write(&t, WriteOp::FindOrInsert, keys, values, scores, outcomes).await.map(Into::into)
            }
        }
    }
}

/// What a feature request does with its hashed keys.
enum Then {
    Keys,
    Find { scores: bool },
    FindOrInsert { values: Vec<f32>, scores: Option<Vec<u64>>, outcomes: bool },
}

/// A feature request after hashing ([`Router::hash_request`]).
pub enum Hashed {
    /// hash: the keys are the answer.
    Keys(Vec<u64>),
    /// find_features: find them.
    Find {
        /// The table.
        t: std::sync::Arc<Table>,
        /// Hashed keys.
        keys: Vec<u64>,
        /// Return scores.
        scores: bool,
    },
    /// find_or_insert_features: find_or_insert them.
    FindOrInsert {
        /// The table.
        t: std::sync::Arc<Table>,
        /// Hashed keys.
        keys: Vec<u64>,
        /// Values to insert.
        values: Vec<f32>,
        /// Scores.
        scores: Option<Vec<u64>>,
        /// Per-key outcomes asked for.
        outcomes: bool,
    },
}
