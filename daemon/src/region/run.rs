//! Region requests: references resolved and checked, the daemon's copies
//! bounded and counted, inputs read, outputs claimed, the op run, outputs
//! written; find straight into the client's memory on the shard's actor.
//! Requests on device regions go to `device` first; those it does not
//! serve on the GPU are staged here (inputs copied from the device, outputs
//! copied back).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkv_proto::region::{self as wire, Count, Dir, Elem, Head, RegionAnswer, RegionRef, RegionRequest, Slot};
use hkv_proto::{ErrorCode, Op, ProtoError, Request, Response};
use hkv_region::{ClaimError, ClaimMut, Mapping};
use hkv_shard::Shard;
use parking_lot::Mutex;
use zerocopy::{Immutable, IntoBytes};

use hkv_shard::cuda::ipc::IpcEvent;

use super::{err, not_event, not_registered, Region, ShardFn};
use crate::actor::{SubOp, SubResult};
use crate::error::shard_error;
use crate::router::Table;
use crate::state::{InFlight, State};

/// One checked reference: its region and its element count.
pub(super) struct Arr {
    pub(super) slot: Slot,
    pub(super) r: RegionRef,
    pub(super) region: Arc<Region>,
}

impl Arr {
    /// The mapping of a memfd region (only those are claimed).
    fn map(&self) -> &Arc<Mapping> {
        self.region.host().expect("claims are made on memfd regions only")
    }

    fn claim_err(&self, e: ClaimError) -> ProtoError {
        match e {
            ClaimError::Busy => err(
                ErrorCode::Busy,
                format!(
                    "{}: region {} bytes {}.. overlap an array another request in flight writes, or another \
                     array of this request (outputs may not overlap anything); nothing was applied",
                    self.slot.name, self.r.region, self.r.offset
                ),
            ),
            ClaimError::OutOfBounds => wire::bad_ref(self.slot.name, &self.r, "past the end of the region"),
            ClaimError::Misaligned => {
                wire::bad_ref(self.slot.name, &self.r, "offset not a multiple of the element size")
            }
        }
    }

    fn claim_mut<T>(&self) -> Result<ClaimMut<T>, ProtoError> {
        self.map().claim_mut::<T>(self.r.offset, self.r.count).map_err(|e| self.claim_err(e))
    }

    fn read<T: zerocopy::FromBytes + zerocopy::IntoBytes + Clone + Default>(&self) -> Result<Vec<T>, ProtoError> {
        let mut v = vec![T::default(); self.r.count as usize];
        match self.region.device() {
            // A device copy waits for the GPU: the worker says it blocks
            // (the runtime is multi-threaded), so other tasks move on.
            Some(m) => {
                tokio::task::block_in_place(|| m.read::<u8>(self.r.offset, v.as_mut_bytes())).map_err(shard_error)?
            }
            None => self.map().read(self.r.offset, &mut v).map_err(|e| self.claim_err(e))?,
        }
        Ok(v)
    }

    /// The array as an output: claimed in a memfd region; in a device
    /// region, where the staged answer is copied to.
    fn out<T: zerocopy::FromBytes + zerocopy::IntoBytes>(
        &self,
        host: fn(ClaimMut<T>) -> Out,
    ) -> Result<Out, ProtoError> {
        match self.region.device() {
            Some(m) => Ok(Out::Dev(m.clone(), self.r.offset)),
            None => Ok(host(self.claim_mut()?)),
        }
    }
}

/// Resolves and checks every reference of `req` against its slot and
/// region (bounds, alignment, counts); returns them with n and the output
/// capacity.
fn resolve(
    regions: &HashMap<u32, Arc<Region>>,
    events: Option<&HashMap<u32, Arc<IpcEvent>>>,
    req: &RegionRequest,
    dim: usize,
) -> Result<(Vec<Arr>, usize), ProtoError> {
    let slots = req.slots();
    let mut arrs = Vec::with_capacity(slots.len());
    for (slot, r) in slots.into_iter().zip(&req.refs) {
        let Some(region) = regions.get(&r.region).cloned() else {
            if events.is_some_and(|e| e.contains_key(&r.region)) {
                return Err(wire::bad_ref(slot.name, r, "that id is an event (register_cuda_event), not memory"));
            }
            return Err(not_registered(r.region));
        };
        let size = slot.elem.size();
        let bytes = r.count.checked_mul(size).ok_or_else(|| wire::bad_ref(slot.name, r, "count overflows"))?;
        let end = r.offset.checked_add(bytes).ok_or_else(|| wire::bad_ref(slot.name, r, "offset + bytes overflows"))?;
        if end > region.len {
            return Err(wire::bad_ref(
                slot.name,
                r,
                &format!("ends at byte {end}, past the end of the {}-byte region", region.len),
            ));
        }
        if r.offset % size != 0 {
            return Err(wire::bad_ref(slot.name, r, &format!("offset is not a multiple of {size} (the element size)")));
        }
        arrs.push(Arr { slot, r: *r, region });
    }
    // n from the keys (or features), then every count checked against it.
    let mut n = None;
    let mut cap = None;
    for a in &arrs {
        match a.slot.count {
            Count::SetsN => n = Some(a.r.count),
            Count::Offsets => n = Some(a.r.count.saturating_sub(1)),
            Count::Cap if cap.is_none() => cap = Some(a.r.count),
            _ => {}
        }
    }
    let n = n.unwrap_or(0);
    if n > u32::MAX as u64 {
        return Err(ProtoError::bad_request(format!("{n} keys in one request; send at most {} per request", u32::MAX)));
    }
    let cap = cap.unwrap_or(0);
    let dim = dim as u64;
    for a in &arrs {
        let want = match a.slot.count {
            Count::N => Some(n),
            Count::NDim => n.checked_mul(dim),
            Count::Cap => Some(cap),
            Count::CapDim => cap.checked_mul(dim),
            Count::SetsN | Count::Offsets | Count::Any => continue,
        };
        if want != Some(a.r.count) {
            let code = if matches!(a.slot.count, Count::NDim | Count::CapDim) {
                ErrorCode::WrongDim
            } else {
                ErrorCode::LengthMismatch
            };
            return Err(err(
                code,
                format!(
                    "{}: {} elements, but {} are needed ({n} keys{}, dim {dim}); nothing was applied",
                    a.slot.name,
                    a.r.count,
                    want.map_or("more than 2^64".into(), |w| w.to_string()),
                    if cap > 0 { format!(", room for {cap} entries") } else { String::new() }
                ),
            ));
        }
    }
    Ok((arrs, n as usize))
}

/// The daemon's own copies of a region request: its inputs, and the answer
/// arrays of every op but find without scores (written in place). Bounded
/// like a socket request's body (`limits.max_frame_bytes`, else
/// `oversized`) and counted, until the request is done, against
/// `limits.max_bytes_in_flight` (else `resource_exhausted`), so that a
/// client with a large region cannot make the daemon copy more than a
/// client of the socket could send.
fn charge(state: &Arc<State>, req: &RegionRequest, arrs: &[Arr]) -> Result<InFlight, ProtoError> {
    let in_place = req.op == u8::from(Op::Find) && !req.scores;
    let bytes: u64 = arrs
        .iter()
        .filter(|a| a.slot.dir != Dir::Out || !in_place)
        .map(|a| a.r.count.saturating_mul(a.slot.elem.size()))
        .fold(0u64, u64::saturating_add);
    let limits = &state.config.limits;
    if bytes > u64::from(limits.max_frame_bytes) {
        return Err(err(
            ErrorCode::Oversized,
            format!(
                "this region request would have the daemon copy {bytes} bytes of its arrays, above \
                 limits.max_frame_bytes = {}; send smaller batches",
                limits.max_frame_bytes
            ),
        ));
    }
    let mut c = InFlight::total(state);
    if !c.add(bytes, limits.max_bytes_in_flight) {
        state.stats.in_flight_refusals.fetch_add(1, Relaxed);
        return Err(err(
            ErrorCode::ResourceExhausted,
            format!(
                "{} bytes of requests and answers are already in flight (limits.max_bytes_in_flight = {}{}); \
                 this region request's {bytes} bytes of copies were not made: retry, or send smaller batches",
                state.stats.in_flight_bytes.load(Relaxed),
                limits.max_bytes_in_flight,
                state.memory.describe()
            ),
        ));
    }
    Ok(c)
}

fn named<'a>(arrs: &'a [Arr], name: &str) -> Option<&'a Arr> {
    arrs.iter().find(|a| a.slot.name == name)
}

fn need<'a>(arrs: &'a [Arr], name: &str) -> &'a Arr {
    named(arrs, name).expect("slot of this op")
}

/// The events a request names (`EVENTS` flag), each checked.
type Events = (Option<Arc<IpcEvent>>, Option<Arc<IpcEvent>>);

fn events(known: Option<&HashMap<u32, Arc<IpcEvent>>>, req: &RegionRequest) -> Result<Events, ProtoError> {
    let Some((wait, done)) = req.events else { return Ok((None, None)) };
    let get = |id: u32| -> Result<Option<Arc<IpcEvent>>, ProtoError> {
        if id == 0 {
            return Ok(None);
        }
        known.and_then(|k| k.get(&id)).cloned().map(Some).ok_or_else(|| not_event(id))
    };
    Ok((get(wait)?, get(done)?))
}

/// Runs one region request.
pub(super) async fn run(
    state: &Arc<State>,
    conn: &Arc<super::Conn>,
    regions: &HashMap<u32, Arc<Region>>,
    known_events: Option<&HashMap<u32, Arc<IpcEvent>>>,
    req: RegionRequest,
) -> Result<RegionAnswer, ProtoError> {
    let t = state.router.table(&req.table)?;
    let dim = t.config.dim;
    let (arrs, n) = resolve(regions, known_events, &req, dim)?;
    if req.op == u8::from(Op::InsertAndEvict) && need(&arrs, "evicted_keys").r.count < n as u64 {
        return Err(err(
            ErrorCode::LengthMismatch,
            format!(
                "evicted_keys: room for {} entries, but insert_and_evict of {n} keys may evict or refuse {n}; \
                 nothing was applied",
                need(&arrs, "evicted_keys").r.count
            ),
        ));
    }
    let (wait, done) = events(known_events, &req)?;
    // The wait happens here, on the host, before the request reaches a
    // shard: the daemon's streams never wait on a client's event, and no
    // path after this one waits again.
    if let (Some(w), Some((id, _))) = (&wait, req.events) {
        wait_for_event(state, conn, w, id).await?;
    }
    let device = arrs.iter().any(|a| a.region.device().is_some());
    if device && arrs.iter().any(|a| a.region.host().is_some()) {
        return Err(ProtoError::bad_request(
            "the arrays of one request lie all in memfd regions or all in CUDA regions; this one names both",
        ));
    }
    if device {
        if let Some(a) = super::device::run(state, &t, &req, &arrs, n, &done).await? {
            return Ok(a);
        }
    }
    let _charge = charge(state, &req, &arrs)?;
    let a = staged(state, &t, req, &arrs, n, device).await?;
    if let Some(d) = done {
        blocking(move || d.record_now()).await?;
    }
    Ok(a)
}

/// Waits until the work of event `id`'s last record is done, polling it
/// from a blocking thread (a few microseconds apart at first, then up to a
/// millisecond), for at most `limits.event_wait_seconds`, and no longer
/// than the peer is there. A stream made to wait on a client's event
/// instead could not be undone: a client killed before its record ran
/// froze every table on that GPU for good, and a slow one held up the
/// requests of every other client queued behind it.
async fn wait_for_event(
    state: &Arc<State>,
    conn: &Arc<super::Conn>,
    ev: &Arc<IpcEvent>,
    id: u32,
) -> Result<(), ProtoError> {
    let limit = Duration::from_secs(state.config.limits.event_wait_seconds.max(1));
    // Most events are done by the time their request arrives.
    if ev.query().map_err(shard_error)? {
        return Ok(());
    }
    let (ev, conn) = (ev.clone(), conn.clone());
    let waited = tokio::task::spawn_blocking(move || -> Result<bool, ProtoError> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            if ev.query().map_err(shard_error)? {
                return Ok(true);
            }
            if conn.is_gone() || start.elapsed() >= limit {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    })
    .await
    .map_err(|e| err(ErrorCode::Internal, format!("a waiting task failed: {e}")))??;
    if waited {
        return Ok(());
    }
    Err(err(
        ErrorCode::Timeout,
        format!(
            "event {id}: the work recorded on it was not done within limits.event_wait_seconds = {} s (or the \
             client went away); nothing of this request was run. Record the event before sending the request, \
             on a stream whose work completes",
            limit.as_secs()
        ),
    ))
}

/// Runs `f` off the executor (a wait on the GPU).
async fn blocking(f: impl FnOnce() -> hkv_shard::Result<()> + Send + 'static) -> Result<(), ProtoError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| err(ErrorCode::Internal, format!("a waiting task failed: {e}")))?
        .map_err(shard_error)
}

/// A region request served through the daemon's memory: inputs read,
/// outputs claimed (memfd) or copied back (device), the op run.
async fn staged(
    state: &Arc<State>,
    t: &Arc<Table>,
    req: RegionRequest,
    arrs: &[Arr],
    n: usize,
    device: bool,
) -> Result<RegionAnswer, ProtoError> {
    let dim = t.config.dim;
    // Inputs are copied in first (a client writing them meanwhile changes
    // only what it asks), then outputs claimed for the whole request.
    let keys: Vec<u64> = match (&req.head, req.op) {
        (Head::Export { .. }, _) => Vec::new(),
        (Head::Features { hash, strings }, _) => {
            let features = if *strings {
                hkv_proto::Features::Strings {
                    offsets: need(arrs, "offsets").read()?,
                    bytes: need(arrs, "bytes").read()?,
                }
            } else {
                hkv_proto::Features::Int64(need(arrs, "features").read()?)
            };
            hash_features(state, t, hash.clone(), features).await?
        }
        _ => need(arrs, "keys").read()?,
    };
    if keys.len() != n && !matches!(req.head, Head::Export { .. }) {
        return Err(err(ErrorCode::Internal, "hashing gave a key count unlike the features'"));
    }
    let values_in: Option<Vec<f32>> = match named(arrs, "values") {
        Some(a) if a.slot.dir != Dir::Out => Some(a.read()?),
        _ => None,
    };
    let scores_in: Option<Vec<u64>> = match named(arrs, "scores") {
        Some(a) if a.slot.dir == Dir::In => Some(a.read()?),
        _ => None,
    };
    let mut out: Vec<(&str, Out)> = Vec::new();
    for a in arrs.iter().filter(|a| a.slot.dir != Dir::In) {
        let claim = match a.slot.elem {
            Elem::U8 => a.out(Out::U8)?,
            Elem::U32 => unreachable!("no u32 outputs"),
            Elem::U64 => a.out(Out::U64)?,
            Elem::F32 => a.out(Out::F32)?,
        };
        out.push((a.slot.name, claim));
    }
    let mut take = |name: &str| out.iter().position(|(n, _)| *n == name).map(|i| out.swap_remove(i).1);
    let code = match Op::try_from(req.op)? {
        Op::FindFeatures => Op::Find,
        Op::FindOrInsertFeatures => Op::FindOrInsert,
        c => c,
    };
    let table = req.table.clone();
    let router = &state.router;
    match code {
        Op::Find if !req.scores && !device => {
            let (Some(Out::U8(found)), Some(Out::F32(values))) = (take("found"), take("values")) else {
                unreachable!("find's outputs")
            };
            let region = need(arrs, "values").region.clone();
            find(state, t, keys, found, values, region).await.map(RegionAnswer::Count)
        }
        Op::Find => {
            let r = router.execute(Request::Find { table, keys, scores: true }).await?;
            let Response::Find { found, values, scores } = r else { return Err(unexpected()) };
            let hits = found.iter().filter(|&&f| f == 1).count() as u64;
            put(take("found"), &found)?;
            put(take("values"), &values)?;
            put(take("scores"), scores.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Count(hits))
        }
        Op::Contains => {
            let r = router.execute(Request::Contains { table, keys }).await?;
            let Response::Contains { found } = r else { return Err(unexpected()) };
            put(take("found"), &found)?;
            Ok(RegionAnswer::Count(found.iter().filter(|&&f| f == 1).count() as u64))
        }
        Op::Erase => {
            let r = router.execute(Request::Erase { table, keys, outcomes: req.outcomes }).await?;
            let Response::Erased { count, flags } = r else { return Err(unexpected()) };
            put(take("erased"), flags.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Count(count))
        }
        Op::AssignScores => {
            let r = router
                .execute(Request::AssignScores { table, keys, scores: scores_in, outcomes: req.outcomes })
                .await?;
            let Response::Write { summary, outcomes, .. } = r else { return Err(unexpected()) };
            put(take("outcomes"), outcomes.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Write(summary))
        }
        Op::Export => {
            let Head::Export { shard, offset, max_slots, filter } = req.head else { unreachable!() };
            let cap = need(arrs, "keys").r.count;
            if cap == 0 {
                return Err(ProtoError::bad_request("export: the output arrays have room for no entry"));
            }
            let cursor = hkv_proto::Cursor { shard, offset };
            let r = router.execute(Request::Export { table, cursor, max_slots: max_slots.min(cap), filter }).await?;
            let Response::Export { next, keys, values, scores } = r else { return Err(unexpected()) };
            let count = keys.len().min(cap as usize);
            put(take("keys"), &keys[..count])?;
            put(take("values"), &values[..count * dim])?;
            put(take("scores"), &scores[..count])?;
            let (next_shard, next_offset) = next.map_or((u32::MAX, 0), |c| (c.shard, c.offset));
            Ok(RegionAnswer::Export { next_shard, next_offset, count: count as u64 })
        }
        _ => {
            let Some(op) = code.write() else { return Err(unexpected()) };
            let values = values_in.unwrap_or_default();
            let r = router
                .execute(Request::Write { op, table, keys, values, scores: scores_in, outcomes: req.outcomes })
                .await?;
            let Response::Write { summary, outcomes, values, evicted } = r else { return Err(unexpected()) };
            let room = named(arrs, "evicted_keys").map_or(0, |a| a.r.count as usize);
            put(take("outcomes"), outcomes.as_deref().unwrap_or(&[]))?;
            if let Some(v) = values {
                put(take("values"), &v)?;
            }
            if let Some(e) = evicted {
                let count = e.keys.len().min(room);
                put(take("evicted_keys"), &e.keys[..count])?;
                put(take("evicted_values"), &e.values[..count * dim])?;
                put(take("evicted_scores"), &e.scores[..count])?;
                put(take("evicted_kinds"), &e.kinds[..count])?;
                return Ok(RegionAnswer::Evict(summary, count as u64));
            }
            Ok(RegionAnswer::Write(summary))
        }
    }
}

fn unexpected() -> ProtoError {
    err(ErrorCode::Internal, "the table answered a region request unexpectedly; please report it")
}

/// An output array: claimed in a memfd region, or a device region and the
/// byte offset that the answer is copied to.
enum Out {
    U8(ClaimMut<u8>),
    U64(ClaimMut<u64>),
    F32(ClaimMut<f32>),
    Dev(Arc<hkv_shard::cuda::ipc::IpcMem>, u64),
}

/// Writes `src` (or as much as fits) into an output array.
fn put<T: IntoBytes + Immutable>(o: Option<Out>, src: &[T]) -> Result<(), ProtoError> {
    let src = src.as_bytes();
    let copy = |d: &mut [u8]| {
        let k = d.len().min(src.len());
        d[..k].copy_from_slice(&src[..k]);
    };
    match o {
        None => {}
        Some(Out::U8(mut c)) => copy(c.as_mut_slice()),
        Some(Out::U64(mut c)) => copy(c.as_mut_slice().as_mut_bytes()),
        Some(Out::F32(mut c)) => copy(c.as_mut_slice().as_mut_bytes()),
        Some(Out::Dev(m, offset)) => tokio::task::block_in_place(|| m.write::<u8>(offset, src)).map_err(shard_error)?,
    }
    Ok(())
}

/// Hashes region features as a feature request would.
async fn hash_features(
    state: &Arc<State>,
    t: &Arc<Table>,
    hash: hkv_proto::HashSpec,
    features: hkv_proto::Features,
) -> Result<Vec<u64>, ProtoError> {
    let (kind, num_buckets) = crate::features::resolve(hash, Some(&t.spec))?;
    let hasher = state.router.hasher.clone();
    tokio::task::spawn_blocking(move || hasher.hash(&features, kind, num_buckets))
        .await
        .map_err(|e| err(ErrorCode::Internal, format!("hashing task failed: {e}")))?
}

/// find straight into the client's memory: the table writes each row into
/// the claimed values, no answer array in between. One shard:
/// `Shard::find_into`, then the flags and zeroed misses; several: each
/// shard's keys with `Shard::find_at`, one shard after the other (the
/// claims are one `&mut`). The values go as `Rows::Pinned` where `region`
/// (theirs) is page-locked on the CUDA backend, else as `Rows::Host`.
async fn find(
    state: &Arc<State>,
    t: &Arc<Table>,
    keys: Vec<u64>,
    found: ClaimMut<u8>,
    values: ClaimMut<f32>,
    region: Arc<Region>,
) -> Result<u64, ProtoError> {
    if let Some(i) = keys.iter().position(|&k| hkv_shard::is_reserved(k)) {
        return Err(shard_error(hkv_shard::Error::ReservedKey { key: keys[i], index: i }));
    }
    let shards = t.shards();
    let count = |r: SubResult| match r {
        SubResult::Count(c) => Ok(c),
        _ => Err(unexpected()),
    };
    if shards == 1 {
        let (mut found, mut values) = (found, values);
        let f = move |s: &dyn Shard| {
            let (flags, values) = (found.as_mut_slice(), values.as_mut_slice());
            let mut hit = vec![false; keys.len()];
            let hits = s.find_into(&keys, rows(&region, values), &mut hit)?;
            let dim = s.dim();
            for ((b, &h), row) in flags.iter_mut().zip(&hit).zip(values.chunks_exact_mut(dim.max(1))) {
                *b = u8::from(h);
                if !h {
                    row.fill(0.0);
                }
            }
            Ok(SubResult::Count(hits as u64))
        };
        return count(state.router.call(t, 0, SubOp::With(ShardFn(Box::new(f)))).await?);
    }
    let mut parts: Vec<Vec<u32>> = (0..shards).map(|_| Vec::with_capacity(keys.len() / shards + 16)).collect();
    for (i, &k) in keys.iter().enumerate() {
        parts[hkv_shard::hash::shard_of(k, shards as u64) as usize].push(i as u32);
    }
    let out = Arc::new(Mutex::new((found, values)));
    let mut hits = 0;
    for (i, at) in parts.into_iter().enumerate() {
        if at.is_empty() {
            continue;
        }
        let ks: Vec<u64> = at.iter().map(|&j| keys[j as usize]).collect();
        let (out, region) = (out.clone(), region.clone());
        let f = move |s: &dyn Shard| {
            let mut g = out.lock();
            let (found, values) = &mut *g;
            let h = s.find_at(&ks, &at, rows(&region, values.as_mut_slice()), found.as_mut_slice())?;
            Ok(SubResult::Count(h as u64))
        };
        hits += count(state.router.call(t, i, SubOp::With(ShardFn(Box::new(f)))).await?)?;
    }
    Ok(hits)
}

/// A find's destination in `region`: pinned rows where it is page-locked.
fn rows<'a>(region: &Region, values: &'a mut [f32]) -> hkv_shard::Rows<'a> {
    match &region.mem {
        super::Mem::Host { pin: Some(p), .. } => p.rows(values),
        _ => hkv_shard::Rows::Host(values),
    }
}
