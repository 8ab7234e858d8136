//! The shards' answers to one request put back into one answer, in
//! request order, each of its own type.

use hkv_proto::{Cursor, Evicted, Op, ProtoError, Response, Summary};

use hkv_shard::{Filter, Outcome};

use super::split::Split;
use super::{Router, Table};
use crate::actor::ShardOp;
use crate::shard_ops::{Applied, Destination, Find, FindTo, Keys, Written};

/// A find's answer in arrays of the daemon, in request order.
pub struct FindAnswer {
    /// 1 where found.
    pub found: Vec<u8>,
    /// `dim` per key; zeros for a miss.
    pub values: Vec<f32>,
    /// Per key, when asked for.
    pub scores: Option<Vec<u64>>,
}

impl From<FindAnswer> for Response {
    fn from(a: FindAnswer) -> Response {
        Response::Find { found: a.found, values: a.values, scores: a.scores }
    }
}

/// A write's answer: summaries added, outcomes and find_or_insert values
/// in request order, evictions appended.
pub struct WriteAnswer {
    /// Counts.
    pub summary: Summary,
    /// Per key, when asked for.
    pub outcomes: Option<Vec<u8>>,
    /// find_or_insert's values.
    pub values: Option<Vec<f32>>,
    /// insert_and_evict's output.
    pub evicted: Option<Evicted>,
}

impl From<WriteAnswer> for Response {
    fn from(a: WriteAnswer) -> Response {
        Response::Write { summary: a.summary, outcomes: a.outcomes, values: a.values, evicted: a.evicted }
    }
}

/// apply_gradients' answer, in request order.
pub struct ApplyAnswer {
    /// Keys absent (not updated).
    pub missing: u64,
    /// 1 per key updated, when asked for.
    pub found: Option<Vec<u8>>,
    /// The values after the step (value dim a key), when asked for.
    pub values: Option<Vec<f32>>,
}

impl From<ApplyAnswer> for Response {
    fn from(a: ApplyAnswer) -> Response {
        Response::Applied { missing: a.missing, found: a.found, values: a.values }
    }
}

/// One export step's answer.
pub struct ExportAnswer {
    /// Where the next step starts; None after the last shard's last slot.
    pub next: Option<Cursor>,
    /// Keys.
    pub keys: Vec<u64>,
    /// `dim` per key.
    pub values: Vec<f32>,
    /// Per key.
    pub scores: Vec<u64>,
}

impl From<ExportAnswer> for Response {
    fn from(a: ExportAnswer) -> Response {
        Response::Export { next: a.next, keys: a.keys, values: a.values, scores: a.scores }
    }
}

impl Router {
    /// Flags (contains, erase) of every shard in request order.
    pub(super) async fn flags<O: ShardOp<Output = Vec<bool>>>(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<O>,
        n: usize,
    ) -> Result<Vec<u8>, ProtoError> {
        let mut out = split.out(n, 1, 0u8);
        for (j, f) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            split.place(&mut out, j, f.into_iter().map(u8::from).collect(), 1);
        }
        Ok(out)
    }

    /// The answer to a write op.
    pub(super) async fn writes<O: ShardOp<Output = Written>>(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<O>,
        n: usize,
        want_outcomes: bool,
        code: Op,
    ) -> Result<WriteAnswer, ProtoError> {
        let dim = t.config.dim;
        let mut summary = Summary::default();
        let mut outcomes = want_outcomes.then(|| split.out(n, 1, Outcome::Absent as u8));
        let mut values = (code == Op::FindOrInsert).then(|| split.out(n, dim, 0.0f32));
        let mut evicted = (code == Op::InsertAndEvict).then(Evicted::default);
        for (j, w) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            summary += to_wire(w.summary);
            if let Some(dst) = outcomes.as_mut() {
                split.place(dst, j, w.outcomes.into_iter().map(|o| o as u8).collect(), 1);
            }
            if let (Some(dst), Some(v)) = (values.as_mut(), w.values) {
                split.place(dst, j, v, dim);
            }
            if let (Some(dst), Some(e)) = (evicted.as_mut(), w.evicted) {
                dst.keys.extend_from_slice(&e.keys);
                dst.values.extend_from_slice(&e.values);
                dst.scores.extend_from_slice(&e.scores);
                dst.kinds.extend(e.kinds.iter().map(|k| *k as u8));
            }
        }
        Ok(WriteAnswer { summary, outcomes, values, evicted })
    }

    /// apply_gradients' answers merged: counts added, flags and values in
    /// request order (`dim`: the value dim).
    pub(super) async fn applied<O: ShardOp<Output = Applied>>(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<O>,
        n: usize,
        dim: usize,
        want: bool,
    ) -> Result<ApplyAnswer, ProtoError> {
        let mut missing = 0;
        let mut found = want.then(|| split.out(n, 1, 0u8));
        let mut values = want.then(|| split.out(n, dim, 0.0f32));
        for (j, a) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            missing += a.missing;
            if let Some(dst) = found.as_mut() {
                split.place(dst, j, a.found.into_iter().map(u8::from).collect(), 1);
            }
            if let (Some(dst), Some(v)) = (values.as_mut(), a.values) {
                split.place(dst, j, v, dim);
            }
        }
        Ok(ApplyAnswer { missing, found, values })
    }

    /// A find into arrays: found flags, rows and scores in request order.
    pub(super) async fn finds(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<Find>,
        n: usize,
        scores: bool,
    ) -> Result<FindAnswer, ProtoError> {
        let dim = t.config.dim;
        let mut found = split.out(n, 1, 0u8);
        let mut values = split.out(n, dim, 0.0f32);
        let mut sc = scores.then(|| split.out(n, 1, 0u64));
        for (j, f) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            split.place(&mut found, j, f.found.into_iter().map(u8::from).collect(), 1);
            split.place(&mut values, j, f.values, dim);
            if let (Some(dst), Some(s)) = (sc.as_mut(), f.scores) {
                split.place(dst, j, s, 1);
            }
        }
        Ok(FindAnswer { found, values, scores: sc })
    }

    /// find into `dest`: the one shard writes its answers there itself,
    /// or the shards fill it one after the other, each writing its keys'
    /// rows in place (`Shard::find_at`): no answer array per shard, no copy
    /// on the router. A CPU shard spreads its part over every core by
    /// itself; a CUDA shard's kernel writes its rows straight into pinned
    /// memory. While one request's part is on one shard, other requests'
    /// parts keep the other shards busy. Answers the destination and the hits.
    pub(super) async fn find_into<D: Destination>(
        &self,
        t: &Table,
        split: Split,
        keys: Vec<Keys>,
        mut dest: D,
    ) -> Result<(D, u64), ProtoError> {
        let parts = match split {
            Split::Whole => {
                let Some(keys) = keys.into_iter().next() else { return Ok((dest, 0)) };
                let (dest, hits) = self.call(t, 0, FindTo { keys, at: None, dest }).await?;
                return Ok((dest, hits as u64));
            }
            Split::Parts(parts) => parts,
        };
        let mut hits = 0;
        for (i, (keys, at)) in keys.into_iter().zip(parts).enumerate() {
            if keys.is_empty() {
                continue;
            }
            let (d, h) = self.call(t, i, FindTo { keys, at: Some(at), dest }).await?;
            dest = d;
            hits += h as u64;
        }
        Ok((dest, hits))
    }
}

/// Shard counts as wire counts.
pub(crate) fn to_wire(s: hkv_shard::Summary) -> Summary {
    Summary { updated: s.updated, inserted: s.inserted, evicted: s.evicted, rejected: s.rejected, absent: s.absent }
}

/// A wire filter as the shard's.
pub(super) fn to_filter(f: hkv_proto::Filter) -> Filter {
    Filter { key_mask: f.key_mask, key_pattern: f.key_pattern, min_score: f.min_score, max_score: f.max_score }
}
