//! Registered regions (`PROTOCOL.md`, "Registered regions"): a client maps
//! memory once, registers it on its connection, and then names arrays in it
//! as `(region, offset, count)` instead of sending them; answers carry only
//! counts. This module holds the op codes, the `REGION` flag, the layout of
//! region requests (which arrays each op names, in which order, read or
//! written) and their small answers.

use crate::body::{Reader, Writer};
use crate::{ErrorCode, FeatureHash, Filter, HashSpec, Header, Hyper, Op, ProtoError, Summary};

/// Frame flag: the body names arrays in registered regions ([`RegionRequest`]).
/// Answers do not carry it (they are `RESPONSE` only).
pub const REGION: u16 = 0x0010;

/// `register_memfd`: body `u64 len`, one fd passed with the frame's bytes
/// (`SCM_RIGHTS`); answer `u32 region`, `u64 len`.
pub const REGISTER_MEMFD: u8 = Op::RegisterMemfd as u8;
/// `unregister`: body `u32 region`; answer empty.
pub const UNREGISTER: u8 = Op::Unregister as u8;
/// `register_cuda`: body `[u8; 16] device uuid`, `[u8; 64] CUipcMemHandle`,
/// `u64 len`; answer `u32 region`, `u64 len`.
pub const REGISTER_CUDA: u8 = Op::RegisterCuda as u8;
/// `register_cuda_event`: body `[u8; 16] device uuid`, `[u8; 64]
/// CUipcEventHandle`; answer `u32 event`.
pub const REGISTER_CUDA_EVENT: u8 = Op::RegisterCudaEvent as u8;

/// Frame flag, with [`REGION`]: the body ends with `u32 wait_event`, `u32
/// done_event` (ids from `register_cuda_event`, 0 for none).
pub const EVENTS: u16 = 0x0020;

/// A count in the answer to a request on device regions with a done event,
/// answered once its kernels were queued, before they ran: not counted.
pub const NOT_COUNTED: u64 = u64::MAX;

/// Bytes of a CUDA IPC handle (memory or event) on the wire.
pub const IPC_HANDLE_LEN: usize = 64;
/// Bytes of a device UUID on the wire (`cuDeviceGetUuid`).
pub const UUID_LEN: usize = 16;

/// The body of `register_cuda` / `register_cuda_event`: which GPU (its
/// UUID), the handle, and (memory) the bytes to register from the
/// allocation's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaRegistration {
    /// `cuDeviceGetUuid` of the GPU the allocation (event) belongs to.
    pub uuid: [u8; UUID_LEN],
    /// `cuIpcGetMemHandle` / `cuIpcGetEventHandle` bytes.
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Bytes registered from the allocation's start (memory only; 0 for events).
    pub len: u64,
}

impl CudaRegistration {
    /// The request frame: `register_cuda` when `event` is false, else `register_cuda_event`.
    pub fn encode(&self, id: u64, event: bool) -> Vec<u8> {
        let mut b = Vec::with_capacity(UUID_LEN + IPC_HANDLE_LEN + 8);
        b.extend_from_slice(&self.uuid);
        b.extend_from_slice(&self.handle);
        if !event {
            b.extend_from_slice(&self.len.to_le_bytes());
        }
        crate::frame(if event { REGISTER_CUDA_EVENT } else { REGISTER_CUDA }, 0, id, &b)
    }

    /// Parses the body of a `register_cuda` (`event` false) or
    /// `register_cuda_event` request.
    pub fn decode(body: &[u8], event: bool) -> Result<CudaRegistration, ProtoError> {
        let mut r = Reader::new(body);
        let mut uuid = [0u8; UUID_LEN];
        uuid.copy_from_slice(r.bytes(UUID_LEN, "device uuid")?);
        let mut handle = [0u8; IPC_HANDLE_LEN];
        handle.copy_from_slice(r.bytes(IPC_HANDLE_LEN, "ipc handle")?);
        let len = if event { 0 } else { r.u64("len")? };
        r.finish()?;
        Ok(CudaRegistration { uuid, handle, len })
    }
}

/// The answer to `register_cuda_event`: the event's id.
pub fn registered_event(id: u64, event: u32) -> Vec<u8> {
    crate::frame(REGISTER_CUDA_EVENT, crate::flags::RESPONSE, id, &event.to_le_bytes())
}

/// Parses the body of a `register_cuda_event` answer.
pub fn decode_registered_event(body: &[u8]) -> Result<u32, ProtoError> {
    let mut r = Reader::new(body);
    let x = r.u32("event")?;
    r.finish()?;
    Ok(x)
}

/// Whether a frame belongs to this module: a region op, or a table op with
/// the `REGION` flag.
pub fn is_region(h: &Header) -> bool {
    matches!(h.op, REGISTER_MEMFD | UNREGISTER | REGISTER_CUDA | REGISTER_CUDA_EVENT)
        || (h.flags & REGION != 0 && slots_known(h.op))
}

fn slots_known(code: u8) -> bool {
    matches!(
        Op::try_from(code),
        Ok(Op::Find
            | Op::Contains
            | Op::InsertOrAssign
            | Op::InsertAndEvict
            | Op::FindOrInsert
            | Op::Assign
            | Op::AssignScores
            | Op::AccumOrAssign
            | Op::Erase
            | Op::Export
            | Op::Load
            | Op::FindFeatures
            | Op::FindOrInsertFeatures
            | Op::ApplyGradients)
    )
}

/// An array in a registered region: `count` elements from byte `offset`.
/// 20 bytes on the wire: `u32 region`, `u64 offset`, `u64 count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionRef {
    /// The id `register_memfd` answered.
    pub region: u32,
    /// Byte offset in the region; a multiple of the element size.
    pub offset: u64,
    /// Elements (floats for value arrays: n × dim).
    pub count: u64,
}

impl RegionRef {
    /// A reference.
    pub fn new(region: u32, offset: u64, count: u64) -> RegionRef {
        RegionRef { region, offset, count }
    }
}

/// Element type of an array slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// Bytes (found flags, outcomes, kinds, feature bytes).
    U8,
    /// u32 (string offsets).
    U32,
    /// u64 (keys, scores) and i64 (int64 features).
    U64,
    /// f32 (values, deltas).
    F32,
}

impl Elem {
    /// Bytes per element; offsets must be multiples of it.
    pub fn size(self) -> u64 {
        match self {
            Elem::U8 => 1,
            Elem::U32 | Elem::F32 => 4,
            Elem::U64 => 8,
        }
    }
}

/// Whether the daemon reads or writes an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Read only.
    In,
    /// Written only.
    Out,
    /// Read, then written (find_or_insert's values).
    InOut,
}

/// How many elements an array slot must have, given n keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Exactly n (n is the keys' count, or the features').
    N,
    /// Exactly n × dim.
    NDim,
    /// Exactly n × the table's value dim (`spec.dim`, without the
    /// optimizer's state columns): apply_gradients' gradients and values.
    NValues,
    /// Any: this slot sets n (keys, int64 features).
    SetsN,
    /// n + 1 string offsets, or 0 (this slot sets n).
    Offsets,
    /// Any (feature bytes).
    Any,
    /// Capacity c of an output list (export's, insert_and_evict's evicted
    /// entries): c, set by the first such slot.
    Cap,
    /// c × dim.
    CapDim,
}

/// One array a region request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Its name in messages and `PROTOCOL.md`.
    pub name: &'static str,
    /// Element type.
    pub elem: Elem,
    /// Read or written.
    pub dir: Dir,
    /// Count rule.
    pub count: Count,
}

const fn slot(name: &'static str, elem: Elem, dir: Dir, count: Count) -> Slot {
    Slot { name, elem, dir, count }
}

/// The arrays a region request of `code` names, in body order. `scores` /
/// `outcomes`: the frame's SCORES / OUTCOMES flags; `strings`: feature type
/// 1 (features ops only).
pub fn slots(code: u8, scores: bool, outcomes: bool, strings: bool) -> Vec<Slot> {
    use {Count::*, Dir::*, Elem::*};
    let Ok(code) = Op::try_from(code) else { return Vec::new() };
    let keys = slot("keys", U64, In, SetsN);
    let mut s = Vec::new();
    let features = |s: &mut Vec<Slot>| {
        if strings {
            s.push(slot("offsets", U32, In, Offsets));
            s.push(slot("bytes", U8, In, Any));
        } else {
            s.push(slot("features", U64, In, SetsN));
        }
    };
    match code {
        Op::Find | Op::FindFeatures => {
            if code == Op::Find {
                s.push(keys);
            } else {
                features(&mut s);
            }
            s.push(slot("found", U8, Out, N));
            s.push(slot("values", F32, Out, NDim));
            if scores {
                s.push(slot("scores", U64, Out, N));
            }
        }
        Op::Contains => {
            s.push(keys);
            s.push(slot("found", U8, Out, N));
        }
        Op::Erase => {
            s.push(keys);
            if outcomes {
                s.push(slot("erased", U8, Out, N));
            }
        }
        Op::AssignScores => {
            s.push(keys);
            if scores {
                s.push(slot("scores", U64, In, N));
            }
            if outcomes {
                s.push(slot("outcomes", U8, Out, N));
            }
        }
        Op::ApplyGradients => {
            s.push(keys);
            s.push(slot("grads", F32, In, NValues));
            if outcomes {
                s.push(slot("found", U8, Out, N));
                s.push(slot("values", F32, Out, NValues));
            }
        }
        Op::Export => {
            s.push(slot("keys", U64, Out, Cap));
            s.push(slot("values", F32, Out, CapDim));
            s.push(slot("scores", U64, Out, Cap));
        }
        _ => {
            // The write ops.
            if code == Op::FindOrInsertFeatures {
                features(&mut s);
            } else {
                s.push(keys);
            }
            let inout = matches!(code, Op::FindOrInsert | Op::FindOrInsertFeatures);
            s.push(slot("values", F32, if inout { InOut } else { In }, NDim));
            if scores {
                s.push(slot("scores", U64, In, N));
            }
            if outcomes && code != Op::Load {
                s.push(slot("outcomes", U8, Out, N));
            }
            if code == Op::InsertAndEvict {
                s.push(slot("evicted_keys", U64, Out, Cap));
                s.push(slot("evicted_values", F32, Out, CapDim));
                s.push(slot("evicted_scores", U64, Out, Cap));
                s.push(slot("evicted_kinds", U8, Out, Cap));
            }
        }
    }
    s
}

/// What comes between `table` and the array references.
#[derive(Debug, Clone, PartialEq)]
pub enum Head {
    /// Nothing (keyed ops).
    None,
    /// export: `u32 shard`, `u64 offset`, `u64 max_slots`, `filter`.
    Export {
        /// Shard to scan.
        shard: u32,
        /// First slot.
        offset: u64,
        /// Slots to scan at most (also bounded by the output capacity).
        max_slots: u64,
        /// Predicate.
        filter: Filter,
    },
    /// apply_gradients: the hyperparameters (28 bytes).
    Apply(Hyper),
    /// feature ops: `hash`, `u8 type` (0 int64, 1 strings).
    Features {
        /// The hash.
        hash: HashSpec,
        /// Feature type.
        strings: bool,
    },
}

/// A table request whose arrays live in registered regions.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionRequest {
    /// The table op code.
    pub op: u8,
    /// SCORES flag.
    pub scores: bool,
    /// OUTCOMES flag.
    pub outcomes: bool,
    /// Table.
    pub table: String,
    /// Op-specific fields before the references.
    pub head: Head,
    /// One reference per [`slots`] entry, in that order.
    pub refs: Vec<RegionRef>,
    /// With the [`EVENTS`] flag: `(wait_event, done_event)`, each an id from
    /// `register_cuda_event` or 0 for none.
    pub events: Option<(u32, u32)>,
}

impl RegionRequest {
    /// The slots of this request.
    pub fn slots(&self) -> Vec<Slot> {
        let strings = matches!(self.head, Head::Features { strings: true, .. });
        slots(self.op, self.scores, self.outcomes, strings)
    }

    /// The whole frame with request id `id`.
    ///
    /// # Panics
    /// When the table name is longer than 65535 bytes.
    pub fn encode(&self, id: u64) -> Vec<u8> {
        let mut w = Writer::framed_in(Vec::new(), 64 + self.table.len() + 20 * self.refs.len());
        w.str(&self.table);
        match &self.head {
            Head::None => {}
            Head::Apply(h) => crate::request::hyper_put(&mut w, h),
            Head::Export { shard, offset, max_slots, filter } => {
                w.u32(*shard).u64(*offset).u64(*max_slots);
                w.u64(filter.key_mask).u64(filter.key_pattern).u64(filter.min_score).u64(filter.max_score);
            }
            Head::Features { hash, strings } => {
                match hash {
                    HashSpec::Table => {
                        w.raw(&[0xFF]);
                    }
                    HashSpec::Given(f) => {
                        w.raw(&[f.kind.code()]).u64(f.num_buckets).u64(f.key[0]).u64(f.key[1]);
                    }
                }
                w.raw(&[u8::from(*strings)]);
            }
        }
        for r in &self.refs {
            w.u32(r.region).u64(r.offset).u64(r.count);
        }
        let mut fl = REGION;
        if let Some((wait, done)) = self.events {
            w.u32(wait).u32(done);
            fl |= EVENTS;
        }
        if self.scores {
            fl |= crate::flags::SCORES;
        }
        if self.outcomes {
            fl |= crate::flags::OUTCOMES;
        }
        if matches!(self.head, Head::Apply(crate::Hyper { sum: true, .. })) {
            fl |= crate::flags::SUM;
        }
        w.finish_frame(self.op, fl, id)
            .unwrap_or_else(|(e, _)| panic!("a region request that does not fit the protocol: {e}"))
    }

    /// Parses a body sent with the `REGION` flag.
    pub fn decode(h: &Header, body: &[u8]) -> Result<RegionRequest, ProtoError> {
        let mut r = Reader::new(body);
        let scores = h.flags & crate::flags::SCORES != 0;
        let outcomes = h.flags & crate::flags::OUTCOMES != 0;
        if !slots_known(h.op) {
            return Err(ProtoError::bad_request(format!(
                "the REGION flag is not defined for {}",
                crate::op::name_of(h.op)
            )));
        }
        let table = r.str("table")?.to_string();
        let head = match Op::try_from(h.op)? {
            Op::Export => Head::Export {
                shard: r.u32("shard")?,
                offset: r.u64("offset")?,
                max_slots: r.u64("max_slots")?,
                filter: Filter {
                    key_mask: r.u64("filter")?,
                    key_pattern: r.u64("filter")?,
                    min_score: r.u64("filter")?,
                    max_score: r.u64("filter")?,
                },
            },
            Op::ApplyGradients => Head::Apply(crate::Hyper {
                sum: h.flags & crate::flags::SUM != 0,
                ..crate::request::hyper_get(&mut r)?
            }),
            Op::FindFeatures | Op::FindOrInsertFeatures => {
                let code = r.u8("hash kind")?;
                let hash = match code {
                    0xFF => HashSpec::Table,
                    0 | 1 => {
                        let kind = if code == 0 { crate::HashKind::Fingerprint64 } else { crate::HashKind::Strong };
                        let num_buckets = r.u64("num_buckets")?;
                        let key = [r.u64("hash key")?, r.u64("hash key")?];
                        HashSpec::Given(FeatureHash { kind, num_buckets, key })
                    }
                    c => {
                        return Err(ProtoError::bad_request(format!(
                            "bad features: hash kind {c} is unknown: use 0 (fingerprint64), 1 (strong) or 255 (the table's)"
                        )))
                    }
                };
                let strings = match r.u8("feature type")? {
                    0 => false,
                    1 => true,
                    t => {
                        return Err(ProtoError::bad_request(format!(
                            "feature type {t} is unknown: use 0 (int64) or 1 (strings)"
                        )))
                    }
                };
                Head::Features { hash, strings }
            }
            _ => Head::None,
        };
        let mut req = RegionRequest { op: h.op, scores, outcomes, table, head, refs: Vec::new(), events: None };
        for s in req.slots() {
            let what = s.name;
            req.refs.push(RegionRef { region: r.u32(what)?, offset: r.u64(what)?, count: r.u64(what)? });
        }
        if h.flags & EVENTS != 0 {
            req.events = Some((r.u32("wait_event")?, r.u32("done_event")?));
        }
        r.finish()?;
        Ok(req)
    }
}

/// The answer to a region request: the small parts only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionAnswer {
    /// find, find_features, contains: `u64 hits`; erase: `u64 erased`;
    /// apply_gradients: `u64 missing`.
    Count(u64),
    /// Write ops: `summary`.
    Write(Summary),
    /// insert_and_evict: `summary`, `u64 evicted` (entries written to the
    /// evicted arrays, from their start).
    Evict(Summary, u64),
    /// export: `u32 next_shard`, `u64 next_offset`, `u64 count` (entries
    /// written to the output arrays, from their start).
    Export {
        /// The next cursor's shard, or `u32::MAX` at the end.
        next_shard: u32,
        /// The next cursor's offset (0 at the end).
        next_offset: u64,
        /// Entries written.
        count: u64,
    },
}

fn summary_put(w: &mut Writer, s: &Summary) {
    w.u64(s.updated).u64(s.inserted).u64(s.evicted).u64(s.rejected).u64(s.absent);
}

fn summary_get(r: &mut Reader<'_>) -> Result<Summary, ProtoError> {
    Ok(Summary {
        updated: r.u64("summary")?,
        inserted: r.u64("summary")?,
        evicted: r.u64("summary")?,
        rejected: r.u64("summary")?,
        absent: r.u64("summary")?,
    })
}

impl RegionAnswer {
    /// The answer frame to request `id` of op `req_op` (flags `RESPONSE`).
    pub fn encode(&self, req_op: u8, id: u64) -> Vec<u8> {
        let mut w = Writer::framed_in(Vec::new(), 64);
        match self {
            RegionAnswer::Count(c) => {
                w.u64(*c);
            }
            RegionAnswer::Write(s) => summary_put(&mut w, s),
            RegionAnswer::Evict(s, n) => {
                summary_put(&mut w, s);
                w.u64(*n);
            }
            RegionAnswer::Export { next_shard, next_offset, count } => {
                w.u32(*next_shard).u64(*next_offset).u64(*count);
            }
        }
        w.finish_frame(req_op, crate::flags::RESPONSE, id)
            .unwrap_or_else(|(e, _)| crate::Response::Error(e).encode(req_op, id))
    }

    /// Parses the answer body to a region request of op `req_op`.
    pub fn decode(req_op: u8, body: &[u8]) -> Result<RegionAnswer, ProtoError> {
        let mut r = Reader::new(body);
        let a = match Op::try_from(req_op)? {
            Op::Find | Op::FindFeatures | Op::Contains | Op::Erase | Op::ApplyGradients => {
                RegionAnswer::Count(r.u64("count")?)
            }
            Op::InsertAndEvict => RegionAnswer::Evict(summary_get(&mut r)?, r.u64("evicted")?),
            Op::Export => RegionAnswer::Export {
                next_shard: r.u32("next_shard")?,
                next_offset: r.u64("next_offset")?,
                count: r.u64("count")?,
            },
            _ => RegionAnswer::Write(summary_get(&mut r)?),
        };
        r.finish()?;
        Ok(a)
    }
}

/// A `register_memfd` frame (the fd goes with it as `SCM_RIGHTS`).
pub fn register_memfd(id: u64, len: u64) -> Vec<u8> {
    crate::frame(REGISTER_MEMFD, 0, id, &len.to_le_bytes())
}

/// An `unregister` frame.
pub fn unregister(id: u64, region: u32) -> Vec<u8> {
    crate::frame(UNREGISTER, 0, id, &region.to_le_bytes())
}

/// The answer to `register_memfd`: region id and the length registered.
pub fn registered(id: u64, region: u32, len: u64) -> Vec<u8> {
    registered_as(REGISTER_MEMFD, id, region, len)
}

fn registered_as(op: u8, id: u64, region: u32, len: u64) -> Vec<u8> {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&region.to_le_bytes());
    b[4..].copy_from_slice(&len.to_le_bytes());
    crate::frame(op, crate::flags::RESPONSE, id, &b)
}

/// The answer to `register_cuda`: region id and the length registered.
pub fn registered_cuda(id: u64, region: u32, len: u64) -> Vec<u8> {
    registered_as(REGISTER_CUDA, id, region, len)
}

/// Parses the body of a `register_memfd` (or `register_cuda`) answer:
/// region id and length.
pub fn decode_registered(body: &[u8]) -> Result<(u32, u64), ProtoError> {
    let mut r = Reader::new(body);
    let x = (r.u32("region")?, r.u64("len")?);
    r.finish()?;
    Ok(x)
}

/// The request body of `register_memfd` (`u64 len`) or `unregister`
/// (`u32 region`), as a u64.
pub fn decode_small(h: &Header, body: &[u8]) -> Result<u64, ProtoError> {
    let mut r = Reader::new(body);
    let x = if h.op == REGISTER_MEMFD { r.u64("len")? } else { u64::from(r.u32("region")?) };
    r.finish()?;
    Ok(x)
}

/// An error answer for `ErrorCode::BadRequest` about a reference.
pub fn bad_ref(slot: &str, r: &RegionRef, why: &str) -> ProtoError {
    ProtoError::new(
        ErrorCode::BadRequest,
        format!("{slot}: region {} offset {} count {}: {why}; nothing was applied", r.region, r.offset, r.count),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HEADER_LEN;

    #[test]
    fn region_requests_and_answers_round_trip() {
        let req = RegionRequest {
            op: u8::from(Op::InsertAndEvict),
            scores: true,
            outcomes: true,
            table: "t".into(),
            head: Head::None,
            refs: (0..8).map(|i| RegionRef::new(i, 8 * i as u64, 3)).collect(),
            events: None,
        };
        let f = req.encode(9);
        let h = Header::decode(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert!(is_region(&h));
        assert_eq!(RegionRequest::decode(&h, &f[HEADER_LEN..]).unwrap(), req);
        // One reference short: truncated, naming the slot.
        let e = RegionRequest::decode(&h, &f[HEADER_LEN..f.len() - 20]).unwrap_err();
        assert_eq!(e.code, ErrorCode::Truncated);
        assert!(e.message.contains("evicted_kinds"), "{}", e.message);
        let feat = RegionRequest {
            op: u8::from(Op::FindFeatures),
            scores: false,
            outcomes: false,
            table: "t".into(),
            head: Head::Features { hash: HashSpec::Given(FeatureHash::fingerprint64(99)), strings: true },
            refs: vec![RegionRef::new(1, 0, 4); 4],
            events: Some((3, 0)),
        };
        let f = feat.encode(1);
        let h = Header::decode(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.flags & EVENTS, EVENTS);
        assert_eq!(RegionRequest::decode(&h, &f[HEADER_LEN..]).unwrap(), feat);
        let apply = RegionRequest {
            op: u8::from(Op::ApplyGradients),
            scores: false,
            outcomes: true,
            table: "t".into(),
            head: Head::Apply(Hyper { lr: 0.25, step: 7, ..Hyper::default() }),
            refs: vec![RegionRef::new(1, 0, 4); 4],
            events: None,
        };
        assert_eq!(apply.slots().iter().map(|s| s.name).collect::<Vec<_>>(), ["keys", "grads", "found", "values"]);
        let f = apply.encode(2);
        let h = Header::decode(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert!(is_region(&h));
        assert_eq!(RegionRequest::decode(&h, &f[HEADER_LEN..]).unwrap(), apply);
        let reg = CudaRegistration { uuid: [7; UUID_LEN], handle: [9; IPC_HANDLE_LEN], len: 1 << 20 };
        for event in [false, true] {
            let f = reg.encode(5, event);
            let h = Header::decode(f[..HEADER_LEN].try_into().unwrap()).unwrap();
            assert!(is_region(&h));
            let back = CudaRegistration::decode(&f[HEADER_LEN..], event).unwrap();
            assert_eq!(back, CudaRegistration { len: if event { 0 } else { reg.len }, ..reg });
            assert_eq!(f.len(), HEADER_LEN + 80 + if event { 0 } else { 8 });
        }
        for a in [
            RegionAnswer::Count(5),
            RegionAnswer::Write(Summary { inserted: 3, ..Default::default() }),
            RegionAnswer::Evict(Summary::default(), 2),
            RegionAnswer::Export { next_shard: 1, next_offset: 2, count: 3 },
        ] {
            let code = match a {
                RegionAnswer::Count(_) => u8::from(Op::Find),
                RegionAnswer::Write(_) => u8::from(Op::InsertOrAssign),
                RegionAnswer::Evict(..) => u8::from(Op::InsertAndEvict),
                RegionAnswer::Export { .. } => u8::from(Op::Export),
            };
            let f = a.encode(code, 4);
            assert_eq!(RegionAnswer::decode(code, &f[HEADER_LEN..]).unwrap(), a);
            assert_eq!(u16::from_le_bytes([f[6], f[7]]), crate::flags::RESPONSE);
        }
    }
}
