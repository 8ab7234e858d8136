//! The shards' answers to one request put back into one answer, in
//! request order.

use hkv_proto::{Evicted, Op, ProtoError, Response, Summary};

use crate::frames::AnswerFrame;
use hkv_shard::{Filter, Outcome};

use super::split::Split;
use super::{Router, Table};
use crate::actor::{Keys, SubOp, SubResult};
use crate::error::unexpected;

impl Router {
    /// Flags (contains, erase) of every shard in request order.
    pub(super) async fn flags(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<SubOp>,
        n: usize,
    ) -> Result<Vec<u8>, ProtoError> {
        let mut out = split.out(n, 1, 0u8);
        for (j, r) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            let SubResult::Flags(f) = r else { return Err(unexpected("a flags op")) };
            split.place(&mut out, j, f.into_iter().map(u8::from).collect(), 1);
        }
        Ok(out)
    }

    /// The answer to a write op: summaries added, outcomes and
    /// find_or_insert values in request order, evictions appended.
    pub(super) async fn writes(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<SubOp>,
        n: usize,
        want_outcomes: bool,
        code: Op,
    ) -> Result<Response, ProtoError> {
        let dim = t.config.dim;
        let mut summary = Summary::default();
        let mut outcomes = want_outcomes.then(|| split.out(n, 1, Outcome::Absent as u8));
        let mut values = (code == Op::FindOrInsert).then(|| split.out(n, dim, 0.0f32));
        let mut evicted = (code == Op::InsertAndEvict).then(Evicted::default);
        for (j, r) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            let SubResult::Write { summary: s, outcomes: o, values: v, evicted: e } = r else {
                return Err(unexpected("a write"));
            };
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

    /// The answer to a find with scores, or into an array the frame could
    /// not take: found flags, rows and scores in request order.
    pub(super) async fn finds(
        &self,
        t: &Table,
        split: &Split,
        ops: Vec<SubOp>,
        n: usize,
        scores: bool,
    ) -> Result<Response, ProtoError> {
        let dim = t.config.dim;
        let mut found = split.out(n, 1, 0u8);
        let mut values = split.out(n, dim, 0.0f32);
        let mut sc = scores.then(|| split.out(n, 1, 0u64));
        for (j, r) in self.fan_out(t, ops).await?.into_iter().enumerate() {
            let SubResult::Find { found: f, values: v, scores: s } = r else { return Err(unexpected("a find")) };
            split.place(&mut found, j, f.into_iter().map(u8::from).collect(), 1);
            split.place(&mut values, j, v, dim);
            if let (Some(dst), Some(s)) = (sc.as_mut(), s) {
                split.place(dst, j, s, 1);
            }
        }
        Ok(Response::Find { found, values, scores: sc })
    }

    /// find without scores into `frame` (whose values
    /// [`AnswerFrame::rows`] can cast): the one shard writes its
    /// answers there itself, or each shard's answers are placed there in
    /// request order.
    pub(super) async fn find_framed(
        &self,
        t: &Table,
        split: Split,
        keys: Vec<Keys>,
        mut frame: AnswerFrame,
    ) -> Result<Response, ProtoError> {
        let parts = match &split {
            Split::Whole => {
                let keys = keys.into_iter().next().expect("one shard's keys");
                let SubResult::Frame(frame) = self.call(t, 0, SubOp::FindInto { keys, frame }).await? else {
                    return Err(unexpected("a find"));
                };
                return Ok(frame.into_response());
            }
            Split::Parts(parts) => parts,
        };
        // The shards fill the frame one after the other, each writing its
        // keys' rows in place (`Shard::find_at`): no answer array per shard,
        // no copy on the router. A CPU shard spreads its part over every
        // core by itself; a CUDA shard's kernel writes its rows straight
        // into a pinned frame. While one request's part is on one shard,
        // other requests' parts keep the other shards busy.
        for (i, (keys, at)) in keys.into_iter().zip(parts).enumerate() {
            if keys.is_empty() {
                continue;
            }
            let SubResult::Frame(f) = self.call(t, i, SubOp::FindAt { keys, at: at.clone(), frame }).await? else {
                return Err(unexpected("a find"));
            };
            frame = f;
        }
        Ok(frame.into_response())
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
