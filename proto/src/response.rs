//! [`Response`]: the typed answers, their encoding and decoding (see
//! PROTOCOL.md).

use crate::body::{Reader, Writer};
use crate::error::{ErrorCode, ProtoError};
use crate::frame::{FindFrame, FrameBuf, FrameMemory};
use crate::op::Op;
use crate::request::{from_json, json};
use crate::types::{Cursor, Evicted, Summary};
use crate::{flags, Header, HEADER_LEN};

/// A response.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// No body (ping, clear, set_epoch, reserve, drop_table, shutdown).
    Empty,
    /// trace: a table's sampled keys.
    Trace {
        /// The rate they were sampled at (a spatial sample: every access
        /// of a sampled key is in it).
        rate: f64,
        /// Whether keys were left out to keep the answer within
        /// `limits.max_frame_bytes`.
        truncated: bool,
        /// The keys, in access order per shard, shard after shard.
        keys: Vec<u64>,
    },
    /// echo: how many bytes came back.
    Echo {
        /// Body bytes.
        len: usize,
    },
    /// find.
    Find {
        /// 1 = found, per key.
        found: Vec<u8>,
        /// dim floats per key; 0.0 for misses.
        values: Vec<f32>,
        /// Scores when asked for (0 for misses).
        scores: Option<Vec<u64>>,
    },
    /// contains.
    Contains {
        /// 1 = present, per key.
        found: Vec<u8>,
    },
    /// The write ops.
    Write {
        /// Counts.
        summary: Summary,
        /// Per-key outcome bytes when asked for.
        outcomes: Option<Vec<u8>>,
        /// find_or_insert: the values.
        values: Option<Vec<f32>>,
        /// insert_and_evict: what lost its slot.
        evicted: Option<Evicted>,
    },
    /// apply_gradients.
    Applied {
        /// Keys absent (not updated).
        missing: u64,
        /// With OUTCOMES: 1 per key updated, 0 per key absent.
        found: Option<Vec<u8>>,
        /// With OUTCOMES: the values after the step, the value dim per key
        /// (0.0 for absent keys).
        values: Option<Vec<f32>>,
    },
    /// erase and erase_if.
    Erased {
        /// Entries removed.
        count: u64,
        /// Per-key flags (erase with OUTCOMES).
        flags: Option<Vec<u8>>,
    },
    /// export.
    Export {
        /// Where to continue; none when the walk is over.
        next: Option<Cursor>,
        /// Keys.
        keys: Vec<u64>,
        /// Values.
        values: Vec<f32>,
        /// Scores.
        scores: Vec<u64>,
    },
    /// hash: one key per feature.
    Keys(Vec<u64>),
    /// create_table, list_tables, stats: a JSON document.
    Json(Vec<u8>),
    /// metrics: Prometheus text.
    Text(String),
    /// An error.
    Error(ProtoError),
    /// A backed table's find, find_features or contains answer with the
    /// per-key origins its request asked for (OUTCOMES): the answer's own
    /// fields, then `origins: u8s` ([`origin`] codes). Only a backed table
    /// answers so; any other table ignores the flag (PROTOCOL.md,
    /// "Backing tier: origins").
    Origins {
        /// A `Find` or `Contains` answer.
        answer: Box<Response>,
        /// One [`origin`] code per key.
        origins: Vec<u8>,
    },
    /// A response frame the server built in place ([`crate::FindFrame`]):
    /// [`HEADER_LEN`] bytes of header space, then the encoded body. Never
    /// decoded: the client sees the op's own response.
    Framed(FrameBuf),
}

impl Response {
    /// The whole frame answering request `id` of op `req_op`, reusing a
    /// [`Response::Framed`] buffer (its header is written in place).
    /// A frame too long for the header's length goes out as an `oversized`
    /// error instead.
    pub fn into_frame(self, req_op: impl Into<u8>, id: u64) -> FrameBuf {
        let req_op = req_op.into();
        match self {
            Response::Framed(mut frame) => {
                match crate::Header::write_into(req_op, flags::RESPONSE, id, frame.bytes_mut()) {
                    Ok(()) => frame,
                    Err(e) => FrameBuf::Vec(Response::Error(e).encode(req_op, id)),
                }
            }
            other => FrameBuf::Vec(other.encode(req_op, id)),
        }
    }

    /// The whole frame answering request `id` of op `req_op` (the request's
    /// op byte, echoed). An answer with a field that does not fit the
    /// protocol (an array over 2^32 − 1 elements, a body of 4 GiB or more)
    /// goes out as the error naming it instead.
    ///
    /// The frame's memory is reserved once, at its exact size, and
    /// fallibly: an answer the process cannot allocate goes out as
    /// `resource_exhausted` instead of aborting the process.
    pub fn encode(&self, req_op: impl Into<u8>, id: u64) -> Vec<u8> {
        let req_op = req_op.into();
        let len = self.body_len();
        let w = match Writer::try_framed(len) {
            Some(w) => Some(w),
            // An error's few bytes: allocated as usual.
            None if matches!(self, Response::Error(_)) => Some(Writer::framed(len)),
            None => None,
        };
        let Some(mut w) = w else {
            let e = ProtoError::new(
                ErrorCode::ResourceExhausted,
                format!("an answer of {len} bytes could not be allocated; retry, or send smaller batches"),
            );
            return Response::Error(e).encode(req_op, id);
        };
        let (code, fl) = self.write(req_op, &mut w);
        debug_assert!(w.buf.len() <= HEADER_LEN + len, "body_len undercounts {self:?}");
        w.finish_frame(code, fl, id).unwrap_or_else(|(e, _)| Response::Error(e).encode(req_op, id))
    }

    /// The exact length of the encoded body (the frame without its
    /// header), computed before anything is allocated.
    pub fn body_len(&self) -> usize {
        // An array is a u32 count and its elements.
        let arr = |n: usize, w: usize| 4 + n.saturating_mul(w);
        match self {
            Response::Empty => 0,
            Response::Echo { len } => *len,
            Response::Find { found, values, scores } => {
                arr(found.len(), 1) + arr(values.len(), 4) + scores.as_ref().map_or(0, |s| arr(s.len(), 8))
            }
            Response::Contains { found } => arr(found.len(), 1),
            Response::Write { outcomes, values, evicted, .. } => {
                40 + outcomes.as_ref().map_or(0, |o| arr(o.len(), 1))
                    + values.as_ref().map_or(0, |v| arr(v.len(), 4))
                    + evicted.as_ref().map_or(0, |e| {
                        arr(e.keys.len(), 8) + arr(e.values.len(), 4) + arr(e.scores.len(), 8) + arr(e.kinds.len(), 1)
                    })
            }
            Response::Erased { flags: f, .. } => 8 + f.as_ref().map_or(0, |f| arr(f.len(), 1)),
            Response::Applied { found, values, .. } => {
                8 + found.as_ref().map_or(0, |f| arr(f.len(), 1)) + values.as_ref().map_or(0, |v| arr(v.len(), 4))
            }
            Response::Export { keys, values, scores, .. } => {
                12 + arr(keys.len(), 8) + arr(values.len(), 4) + arr(scores.len(), 8)
            }
            Response::Keys(k) => arr(k.len(), 8),
            Response::Trace { keys, .. } => 9 + arr(keys.len(), 8),
            Response::Json(j) => j.len(),
            Response::Text(t) => t.len(),
            Response::Error(e) => json(e).len(),
            Response::Framed(frame) => frame.bytes().len().saturating_sub(HEADER_LEN),
            Response::Origins { answer, origins } => answer.body_len() + arr(origins.len(), 1),
        }
    }

    /// Writes the body after room for the header into `w`; the header's
    /// op and flags.
    fn write(&self, req_op: u8, w: &mut Writer) -> (u8, u16) {
        let mut fl = flags::RESPONSE;
        let mut code = req_op;
        match self {
            Response::Empty => {}
            Response::Echo { len } => w.buf.resize(HEADER_LEN + *len, 0),
            Response::Find { found, values, scores } => {
                w.u8s(found).f32s(values);
                if let Some(s) = scores {
                    w.u64s(s);
                    fl |= flags::SCORES;
                }
            }
            Response::Contains { found } => {
                w.u8s(found);
            }
            Response::Write { summary, outcomes, values, evicted } => {
                let s = summary;
                w.u64(s.updated).u64(s.inserted).u64(s.evicted).u64(s.rejected).u64(s.absent);
                if let Some(o) = outcomes {
                    w.u8s(o);
                    fl |= flags::OUTCOMES;
                }
                if let Some(v) = values {
                    w.f32s(v);
                }
                if let Some(e) = evicted {
                    w.u64s(&e.keys).f32s(&e.values).u64s(&e.scores).u8s(&e.kinds);
                }
            }
            Response::Erased { count, flags: f } => {
                w.u64(*count);
                if let Some(f) = f {
                    w.u8s(f);
                    fl |= flags::OUTCOMES;
                }
            }
            Response::Applied { missing, found, values } => {
                w.u64(*missing);
                if let (Some(f), Some(v)) = (found, values) {
                    w.u8s(f).f32s(v);
                    fl |= flags::OUTCOMES;
                }
            }
            Response::Export { next, keys, values, scores } => {
                let c = next.unwrap_or(Cursor { shard: u32::MAX, offset: 0 });
                w.u32(c.shard).u64(c.offset).u64s(keys).f32s(values).u64s(scores);
            }
            Response::Keys(k) => {
                w.u64s(k);
            }
            Response::Trace { rate, truncated, keys } => {
                w.u64(rate.to_bits()).raw(&[u8::from(*truncated)]).u64s(keys);
            }
            Response::Json(j) => w.buf.extend_from_slice(j),
            Response::Text(t) => w.buf.extend_from_slice(t.as_bytes()),
            Response::Error(e) => {
                code = Op::Error.into();
                fl |= flags::ERROR;
                w.buf.extend(json(e));
            }
            Response::Framed(frame) => w.buf.extend_from_slice(&frame.bytes()[HEADER_LEN..]),
            Response::Origins { answer, origins } => {
                let (c, f) = answer.write(req_op, w);
                w.u8s(origins);
                (code, fl) = (c, f | flags::OUTCOMES);
            }
        }
        (code, fl)
    }

    /// Parses a response body.
    pub fn decode(h: &Header, body: &[u8]) -> Result<Response, ProtoError> {
        Self::decode_into(h, body, Vec::new(), Vec::new())
    }

    /// [`Response::decode`] that reads a find answer's arrays into `found`
    /// and `values`, reusing their memory (a client that hands each answer
    /// back allocates nothing for the next); other answers drop them.
    pub fn decode_into(h: &Header, body: &[u8], found: Vec<u8>, values: Vec<f32>) -> Result<Response, ProtoError> {
        let mut r = Reader::new(body);
        let has_outcomes = h.flags & flags::OUTCOMES != 0;
        let op = Op::try_from(h.op)
            .map_err(|_| ProtoError::new(ErrorCode::UnknownOp, format!("response op {:#04x}", h.op)))?;
        let resp = match op {
            o @ (Op::RegisterMemfd | Op::Unregister | Op::RegisterCuda | Op::RegisterCudaEvent) => {
                return Err(ProtoError::bad_request(format!(
                    "the answer to {o} is decoded by hkv_proto::region (PROTOCOL.md, \"Registered regions\")"
                )))
            }
            Op::Error => return Ok(Response::Error(from_json(body, "error body")?)),
            Op::Ping | Op::Clear | Op::SetEpoch | Op::Reserve | Op::DropTable | Op::Shutdown | Op::Flush => {
                Response::Empty
            }
            Op::Echo => Response::Echo { len: r.rest().len() },
            Op::Hash => Response::Keys(r.u64s("keys")?),
            Op::Find | Op::FindFeatures => {
                let found = r.u8s_into("found", found)?;
                let values = r.f32s_into("values", values)?;
                let scores = if h.flags & flags::SCORES != 0 { Some(r.u64s("scores")?) } else { None };
                with_origins(Response::Find { found, values, scores }, has_outcomes, &mut r)?
            }
            Op::Contains => with_origins(Response::Contains { found: r.u8s("found")? }, has_outcomes, &mut r)?,
            o @ (Op::InsertOrAssign
            | Op::InsertAndEvict
            | Op::FindOrInsert
            | Op::Assign
            | Op::AccumOrAssign
            | Op::Load
            | Op::AssignScores
            | Op::FindOrInsertFeatures) => {
                let summary = Summary {
                    updated: r.u64("summary")?,
                    inserted: r.u64("summary")?,
                    evicted: r.u64("summary")?,
                    rejected: r.u64("summary")?,
                    absent: r.u64("summary")?,
                };
                let outcomes = if has_outcomes { Some(r.u8s("outcomes")?) } else { None };
                let values = if matches!(o, Op::FindOrInsert | Op::FindOrInsertFeatures) {
                    Some(r.f32s("values")?)
                } else {
                    None
                };
                let evicted = if o == Op::InsertAndEvict {
                    Some(Evicted {
                        keys: r.u64s("evicted keys")?,
                        values: r.f32s("evicted values")?,
                        scores: r.u64s("evicted scores")?,
                        kinds: r.u8s("evicted kinds")?,
                    })
                } else {
                    None
                };
                Response::Write { summary, outcomes, values, evicted }
            }
            Op::ApplyGradients => {
                let missing = r.u64("missing")?;
                let (found, values) =
                    if has_outcomes { (Some(r.u8s("found")?), Some(r.f32s("values")?)) } else { (None, None) };
                Response::Applied { missing, found, values }
            }
            Op::Erase | Op::EraseIf => {
                let count = r.u64("count")?;
                let flags = if has_outcomes { Some(r.u8s("erased")?) } else { None };
                Response::Erased { count, flags }
            }
            Op::Export => {
                let shard = r.u32("next shard")?;
                let offset = r.u64("next offset")?;
                let next = (shard != u32::MAX).then_some(Cursor { shard, offset });
                Response::Export { next, keys: r.u64s("keys")?, values: r.f32s("values")?, scores: r.u64s("scores")? }
            }
            Op::CreateTable | Op::ListTables | Op::Stats | Op::Checkpoint | Op::ListCheckpoints | Op::Restore => {
                Response::Json(r.rest().to_vec())
            }
            Op::Trace => Response::Trace {
                rate: f64::from_bits(r.u64("rate")?),
                truncated: r.u8("truncated")? != 0,
                keys: r.u64s("keys")?,
            },
            Op::Metrics => Response::Text(
                String::from_utf8(r.rest().to_vec()).map_err(|e| ProtoError::bad_request(format!("metrics: {e}")))?,
            ),
        };
        r.finish()?;
        Ok(resp)
    }
}

/// A find or contains answer, wrapped with the `origins` array that
/// follows it when the answer's OUTCOMES flag says it is there.
fn with_origins(answer: Response, has: bool, r: &mut Reader) -> Result<Response, ProtoError> {
    if !has {
        return Ok(answer);
    }
    Ok(Response::Origins { answer: Box::new(answer), origins: r.u8s("origins")? })
}

/// The per-key origin codes of a backed table's read answer (the
/// `origins` array): where each key's answer came from.
pub mod origin {
    /// The table's cache held the key.
    pub const HIT: u8 = 0;
    /// The cache missed; the row was read from the cluster (and cached).
    pub const FILLED: u8 = 1;
    /// Neither the cache nor the cluster has the key.
    pub const ABSENT: u8 = 2;
    /// The cache missed and the cluster did not answer within the table's
    /// deadline: the key is reported as not found, not as absent.
    pub const LATE: u8 = 3;
}

impl<B: FrameMemory + Into<FrameBuf>> FindFrame<B> {
    /// The response to send: the frame, or an `oversized` error instead
    /// when the counts do not fit the protocol.
    pub fn into_response(self) -> Response {
        match self.into_parts() {
            Ok(frame) => Response::Framed(frame.into()),
            Err(e) => Response::Error(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Evicted;

    /// Every answer's frame is reserved once at its exact size: a find
    /// with scores once reserved only its rows, and the scores made the
    /// buffer double (a 1 GiB answer asked the allocator for 2 GiB, and
    /// under an address-space limit the daemon aborted).
    #[test]
    fn frames_are_allocated_at_their_exact_size() {
        let answers = [
            Response::Find { found: vec![1; 7], values: vec![0.5; 21], scores: Some(vec![9; 7]) },
            Response::Find { found: vec![1; 7], values: vec![0.5; 21], scores: None },
            Response::Write {
                summary: Summary::default(),
                outcomes: Some(vec![1; 3]),
                values: Some(vec![1.0; 6]),
                evicted: Some(Evicted { keys: vec![1], values: vec![2.0; 2], scores: vec![3], kinds: vec![0] }),
            },
            Response::Export { next: None, keys: vec![1, 2], values: vec![0.0; 4], scores: vec![5, 6] },
            Response::Trace { rate: 0.5, truncated: true, keys: vec![1, 2, 3] },
            Response::Keys(vec![4; 10]),
            Response::Erased { count: 2, flags: Some(vec![1, 0]) },
            Response::Applied { missing: 1, found: Some(vec![1, 0]), values: Some(vec![0.5; 4]) },
            Response::Applied { missing: 0, found: None, values: None },
            Response::Contains { found: vec![1, 0, 1] },
            Response::Origins {
                answer: Box::new(Response::Find { found: vec![1, 0], values: vec![0.5; 6], scores: Some(vec![4, 0]) }),
                origins: vec![origin::HIT, origin::ABSENT],
            },
            Response::Error(ProtoError::bad_request("no")),
        ];
        for r in answers {
            let f = r.encode(Op::Find, 1);
            assert_eq!(f.len(), HEADER_LEN + r.body_len(), "{r:?}");
            assert_eq!(f.capacity(), f.len(), "{r:?}: reserved once, exactly");
        }
    }

    /// A backed table's answers with origins: OUTCOMES set, the array after
    /// the answer's own fields, decoded back; without the flag the same
    /// answer has not a byte more.
    #[test]
    fn origins_follow_find_and_contains_answers() {
        let find = Response::Find { found: vec![1, 0, 1], values: vec![1.0; 6], scores: None };
        for (op, answer) in [
            (Op::Find, find.clone()),
            (Op::FindFeatures, find),
            (Op::Contains, Response::Contains { found: vec![0, 1] }),
        ] {
            let n = match &answer {
                Response::Find { found, .. } | Response::Contains { found } => found.len(),
                _ => unreachable!(),
            };
            let with = Response::Origins { answer: Box::new(answer.clone()), origins: vec![origin::LATE; n] };
            let (plain, flagged) = (answer.encode(op, 7), with.encode(op, 7));
            assert_eq!(flagged.len(), plain.len() + 4 + n);
            assert_eq!(&flagged[HEADER_LEN..plain.len()], &plain[HEADER_LEN..], "the answer's own fields first");
            let h = Header::decode(flagged[..HEADER_LEN].try_into().unwrap()).unwrap();
            assert_eq!(h.flags, flags::RESPONSE | flags::OUTCOMES);
            assert_eq!(Response::decode(&h, &flagged[HEADER_LEN..]).unwrap(), with);
            let h = Header::decode(plain[..HEADER_LEN].try_into().unwrap()).unwrap();
            assert_eq!(h.flags, flags::RESPONSE);
            assert_eq!(Response::decode(&h, &plain[HEADER_LEN..]).unwrap(), answer);
        }
    }

    /// An answer the process cannot allocate is an error frame, not an abort.
    #[test]
    fn an_answer_that_cannot_be_allocated_is_resource_exhausted() {
        let f = Response::Echo { len: usize::MAX / 2 }.encode(Op::Echo, 7);
        let h = Header::decode(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        match Response::decode(&h, &f[HEADER_LEN..]).unwrap() {
            Response::Error(e) => assert_eq!(e.code, ErrorCode::ResourceExhausted),
            other => panic!("{other:?}"),
        }
    }
}
