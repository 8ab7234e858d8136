//! How large an answer can be: requests whose answer would pass
//! `limits.max_frame_bytes` are refused before they run, and every answer's
//! most bytes are counted against the bytes in flight before it is built.

use hkv_proto::{ErrorCode, ProtoError, Request, WriteOp};

use super::Router;
use crate::error::err;

/// The largest frame body the protocol can carry (`Header::body_len`).
pub(super) const MAX_BODY: u64 = u32::MAX as u64;

/// Slots one export request walks at most: 16 Mi, fewer where every one of
/// them matching would pass `max_answer` bytes (keys, values, scores); 0
/// where not even one row fits.
pub(super) fn export_slots(dim: usize, max_answer: u64) -> u64 {
    (1u64 << 24).min(max_answer.saturating_sub(64) / (16 + 4 * dim as u64))
}

/// Answer bytes a find takes per key.
pub(super) fn find_per_key(dim: usize, scores: bool) -> u64 {
    1 + 4 * dim as u64 + if scores { 8 } else { 0 }
}

/// Answer bytes a write op takes per key: insert_and_evict up to a key,
/// row, score and kind besides the outcome; find_or_insert a row.
pub(super) fn write_per_key(code: WriteOp, dim: usize, outcomes: bool) -> u64 {
    let rows = match code {
        WriteOp::InsertAndEvict => 17 + 4 * dim as u64,
        WriteOp::FindOrInsert => 4 * dim as u64,
        _ => 0,
    };
    rows + u64::from(outcomes)
}

impl Router {
    /// The most memory answering `req` takes at once, counted against the
    /// bytes in flight before anything is built: the largest answer
    /// ([`Router::answer_bytes`]) times the copies of it alive together.
    /// A find without scores is written by the table into its frame (one
    /// copy); the other answers are built as arrays, then encoded into the
    /// frame (two); find_or_insert, insert_and_evict and the feature ops
    /// also hold the merged per-shard parts or the hashed keys while the
    /// answer is built (three). A trace holds its shards' keys, their
    /// merge and the answer, for as long as it runs
    /// ([`crate::mrc::TRACE_PEAK_BYTES`]).
    pub fn peak_bytes(&self, req: &Request) -> u64 {
        if let Request::Control(hkv_proto::Control::Trace { .. }) = req {
            return crate::mrc::TRACE_PEAK_BYTES;
        }
        let copies = match req {
            Request::Find { scores: false, .. } | Request::Echo { .. } => 1,
            Request::Write { op: WriteOp::FindOrInsert | WriteOp::InsertAndEvict, .. }
            | Request::FindFeatures { .. }
            | Request::FindOrInsertFeatures { .. }
            | Request::Hash { .. } => 3,
            _ => 2,
        };
        self.answer_bytes(req).saturating_mul(copies)
    }

    /// The most bytes the answer to `req` can take (the bounds [`Router::bound`]
    /// checks); 0 for answers that are small whatever the request.
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
                times(features.len(), write_per_key(WriteOp::FindOrInsert, dim(table), *outcomes), 64)
            }
            Request::Hash { features, .. } => times(features.len(), 8, 8),
            Request::Contains { keys, .. } | Request::Erase { keys, .. } | Request::AssignScores { keys, .. } => {
                times(keys.len(), 1, 64)
            }
            Request::ApplyGradients { table, keys, outcomes: true, .. } => {
                let d = self.table(table).map_or(0, |t| t.spec.dim);
                times(keys.len(), 1 + 4 * d as u64, 64)
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
    pub(crate) fn bound(&self, what: &str, n: usize, dim: usize, per_key: u64, fixed: u64) -> Result<(), ProtoError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
