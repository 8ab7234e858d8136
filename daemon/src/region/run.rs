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

use hkv_proto::region::{Dir, Elem, Head, RegionAnswer, RegionRequest};
use hkv_proto::{ErrorCode, Op, ProtoError};
use hkv_region::ClaimMut;

use hkv_shard::cuda::ipc::IpcEvent;

use super::arrays::{put, resolve, Arr, Out};
use super::{err, not_event, Region};
use crate::error::shard_error;
use crate::router::Table;
use crate::shard_ops::Destination;
use crate::state::{InFlight, State};

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
                 limits.max_frame_bytes = {}; send smaller batches, or start hkvd with a larger \
                 --max-frame-bytes",
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

/// The array of slot `name`, which the op's layout names (`resolve`
/// made one per slot).
fn need<'a>(arrs: &'a [Arr], name: &str) -> Result<&'a Arr, ProtoError> {
    named(arrs, name).ok_or_else(|| err(ErrorCode::Internal, format!("a region request without its {name}")))
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
    after: Option<(u32, u64)>,
    req: RegionRequest,
) -> Result<RegionAnswer, ProtoError> {
    if let Some(e) = conn.refused.lock().take() {
        return Err(e);
    }
    // A backed table a restore changed serves once its rows are checked
    // (before its table is looked up: the restore installs another).
    state.router.wait_checked(&req.table).await;
    let t = state.router.table(&req.table)?;
    conn.same_table(&t)?;
    let dim = t.config.dim;
    let (arrs, n) = resolve(regions, known_events, &req, dim, t.spec.dim)?;
    if req.op == u8::from(Op::InsertAndEvict) && need(&arrs, "evicted_keys")?.r.count < n as u64 {
        return Err(err(
            ErrorCode::LengthMismatch,
            format!(
                "evicted_keys: room for {} entries, but insert_and_evict of {n} keys may evict or refuse {n}; \
                 nothing was applied",
                need(&arrs, "evicted_keys")?.r.count
            ),
        ));
    }
    if req.outcomes && matches!(req.head, Head::Apply(hkv_proto::Hyper { sum: true, .. })) {
        return Err(crate::router::summed_outcomes());
    }
    let (wait, done) = events(known_events, &req)?;
    // The wait happens here, on the host, before the request reaches a
    // shard: the daemon's streams never wait on a client's event, and no
    // path after this one waits again.
    if let (Some(w), Some((id, _))) = (&wait, req.events) {
        // The earlier requests of this connection that record this event
        // (their done event) record it first: the poll then sees theirs.
        if let Some((event, need)) = after {
            conn.recorded(event, need).await;
        }
        wait_for_event(state, conn, w, id).await?;
    }
    let device = arrs.iter().any(|a| a.region.device().is_some());
    if device && arrs.iter().any(|a| a.region.host().is_some()) {
        return Err(ProtoError::bad_request(
            "the arrays of one request lie all in memfd regions or all in CUDA regions; this one names both",
        ));
    }
    // A backed table's requests are staged: their misses are read from
    // its cluster (`crate::backing`) before the answer is written.
    let backed = state.backing.backed(&req.table).await?;
    if device && backed.is_none() {
        if let Some(a) = super::device::run(state, conn, &t, &req, &arrs, n, &done).await? {
            return Ok(a);
        }
    }
    let _charge = charge(state, &req, &arrs)?;
    let a = staged(state, &t, req, &arrs, n, device, backed).await?;
    if let Some(d) = done {
        blocking(move || d.record_now()).await?;
    }
    Ok(a)
}

/// Waits until the work of event `id`'s last record is done, polling it
/// from a blocking thread (a few microseconds apart at first, at most
/// 50 µs apart for the first 10 ms, then up to a millisecond), for at
/// most `limits.event_wait_seconds`, and no longer than the peer is there. A stream made to wait on a client's event
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
    let from = Instant::now();
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
            // Short pauses while the wait is short (an event recorded after
            // a step's queued kernels is typically done within a few
            // milliseconds, and every microsecond slept past it is the
            // request's latency); up to 1 ms once it has lasted 10 ms.
            let cap = if start.elapsed() < Duration::from_millis(10) {
                Duration::from_micros(50)
            } else {
                Duration::from_millis(1)
            };
            pause = (pause * 2).min(cap);
        }
    })
    .await
    .map_err(|e| err(ErrorCode::Internal, format!("a waiting task failed: {e}")))??;
    state.stats.path.event_wait(from);
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
    backed: Option<hkv_backing::Backing>,
) -> Result<RegionAnswer, ProtoError> {
    let dim = t.config.dim;
    // Inputs are copied in first (a client writing them meanwhile changes
    // only what it asks), then outputs claimed for the whole request.
    let keys: Vec<u64> = match (&req.head, req.op) {
        (Head::Export { .. }, _) => Vec::new(),
        (Head::Features { hash, strings }, _) => {
            let features = if *strings {
                hkv_proto::Features::Strings {
                    offsets: need(arrs, "offsets")?.read()?,
                    bytes: need(arrs, "bytes")?.read()?,
                }
            } else {
                hkv_proto::Features::Int64(need(arrs, "features")?.read()?)
            };
            hash_features(state, t, hash.clone(), features).await?
        }
        _ => need(arrs, "keys")?.read()?,
    };
    if keys.len() != n && !matches!(req.head, Head::Export { .. }) {
        return Err(err(ErrorCode::Internal, "hashing gave a key count unlike the features'"));
    }
    let grads: Option<Vec<f32>> = named(arrs, "grads").map(|a| a.read()).transpose()?;
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
            Elem::U64 => a.out(Out::U64)?,
            Elem::F32 => a.out(Out::F32)?,
            Elem::U32 => return Err(err(ErrorCode::Internal, format!("{}: no op writes u32 arrays", a.slot.name))),
        };
        out.push((a.slot.name, claim));
    }
    let mut take = |name: &str| out.iter().position(|(n, _)| *n == name).map(|i| out.swap_remove(i).1);
    let code = match Op::try_from(req.op)? {
        Op::FindFeatures => Op::Find,
        Op::FindOrInsertFeatures => Op::FindOrInsert,
        c => c,
    };
    let router = &state.router;
    match (code, req.head) {
        (Op::Find, _) if !req.scores && !device => {
            let (Some(Out::U8(found)), Some(Out::F32(values))) = (take("found"), take("values")) else {
                return Err(err(ErrorCode::Internal, "find's outputs are its found flags and values"));
            };
            let region = need(arrs, "values")?.region.clone();
            let rows = ClaimedRows { found, values, region };
            let (_, hits) = match &backed {
                Some(b) => crate::backing::find_to(router, &state.backing, b, t, keys, rows).await?,
                None => router.find_to(t, keys, rows).await?,
            };
            Ok(RegionAnswer::Count(hits))
        }
        (Op::Find, _) => {
            let r = match &backed {
                Some(b) => crate::backing::find(router, &state.backing, b, t, keys, true).await?,
                None => router.find_rows(t, keys, true).await?,
            };
            let hits = r.found.iter().filter(|&&f| f == 1).count() as u64;
            put(take("found"), &r.found)?;
            put(take("values"), &r.values)?;
            put(take("scores"), r.scores.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Count(hits))
        }
        (Op::Contains, _) => {
            let found = match &backed {
                Some(b) => crate::backing::contains(router, &state.backing, b, t, keys).await?,
                None => router.contains(t, keys).await?,
            };
            put(take("found"), &found)?;
            Ok(RegionAnswer::Count(found.iter().filter(|&&f| f == 1).count() as u64))
        }
        (Op::Erase, _) => {
            let (count, flags) = match &backed {
                Some(b) => crate::backing::erase(router, &state.backing, b, t, keys, req.outcomes).await?,
                None => router.erase(t, keys, req.outcomes).await?,
            };
            put(take("erased"), flags.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Count(count))
        }
        (Op::AssignScores, _) => {
            let r = router.assign_scores(t, keys, scores_in, req.outcomes).await?;
            put(take("outcomes"), r.outcomes.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Write(r.summary))
        }
        (Op::ApplyGradients, Head::Apply(hyper)) => {
            let grads = grads.unwrap_or_default();
            let r = match &backed {
                Some(b) => {
                    crate::backing::apply_gradients(router, &state.backing, b, t, hyper, keys, grads, req.outcomes)
                        .await?
                }
                None => router.apply_gradients(t, hyper, keys, grads, req.outcomes).await?,
            };
            put(take("found"), r.found.as_deref().unwrap_or(&[]))?;
            put(take("values"), r.values.as_deref().unwrap_or(&[]))?;
            Ok(RegionAnswer::Count(r.missing))
        }
        (Op::Export, Head::Export { shard, offset, max_slots, filter }) => {
            let cap = need(arrs, "keys")?.r.count;
            if cap == 0 {
                return Err(ProtoError::bad_request("export: the output arrays have room for no entry"));
            }
            let cursor = hkv_proto::Cursor { shard, offset };
            let r = router.export(t, cursor, max_slots.min(cap), filter).await?;
            let count = r.keys.len().min(cap as usize);
            put(take("keys"), &r.keys[..count])?;
            put(take("values"), &r.values[..count * dim])?;
            put(take("scores"), &r.scores[..count])?;
            let (next_shard, next_offset) = r.next.map_or((u32::MAX, 0), |c| (c.shard, c.offset));
            Ok(RegionAnswer::Export { next_shard, next_offset, count: count as u64 })
        }
        (code, _) => {
            let Some(op) = code.write() else {
                return Err(ProtoError::bad_request(format!("{} is not served through regions", code.name())));
            };
            let values = values_in.unwrap_or_default();
            let r = match &backed {
                Some(b) => {
                    crate::backing::write(router, &state.backing, b, t, op, keys, values, scores_in, req.outcomes)
                        .await?
                }
                None => router.write(t, op, keys, values, scores_in, req.outcomes).await?,
            };
            let room = named(arrs, "evicted_keys").map_or(0, |a| a.r.count as usize);
            put(take("outcomes"), r.outcomes.as_deref().unwrap_or(&[]))?;
            if let Some(v) = r.values {
                put(take("values"), &v)?;
            }
            if let Some(e) = r.evicted {
                let count = e.keys.len().min(room);
                put(take("evicted_keys"), &e.keys[..count])?;
                put(take("evicted_values"), &e.values[..count * dim])?;
                put(take("evicted_scores"), &e.scores[..count])?;
                put(take("evicted_kinds"), &e.kinds[..count])?;
                return Ok(RegionAnswer::Evict(r.summary, count as u64));
            }
            Ok(RegionAnswer::Write(r.summary))
        }
    }
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

/// A find's destination in a client's memfd region: the claimed found
/// bytes and values, the table writing each row there with no answer array
/// in between; `Rows::Pinned` where the region is page-locked on the CUDA
/// backend, else `Rows::Host`.
struct ClaimedRows {
    found: ClaimMut<u8>,
    values: ClaimMut<f32>,
    region: Arc<Region>,
}

impl Destination for ClaimedRows {
    fn answer(&mut self) -> (&mut [u8], hkv_shard::Rows<'_>) {
        let values = self.values.as_mut_slice();
        let rows = match &self.region.mem {
            super::Mem::Host { pin: Some(p), .. } => p.rows(values),
            _ => hkv_shard::Rows::Host(values),
        };
        (self.found.as_mut_slice(), rows)
    }
}
