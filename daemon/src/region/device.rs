//! Region requests on a client's device memory served by the table's
//! kernels in place (`CudaTable::run_ipc`): find, contains, erase without
//! OUTCOMES, insert_or_assign, assign, accum_or_assign, find_or_insert,
//! insert_and_evict without SCORES or OUTCOMES, and apply_gradients (its
//! optimizer step a kernel, with or without OUTCOMES), on a table whose shards'
//! GPUs all reach the regions (the regions' own GPU, or another with peer
//! access to it, over NVLink or PCIe). With one shard, it serves the whole
//! batch; with several, each shard serves its own keys of the batch in
//! place (a mask of them made on the GPU, `IpcPart`), all at once, after
//! one scan of the keys for reserved markers before a write (not
//! insert_and_evict, whose compacted outputs the shards would share, nor a
//! find with scores). With a done event on a table of one shard the answer
//! goes as soon as the kernels are queued (`early`). Everything else is
//! staged by `run`.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use futures::future::join_all;
use hkv_proto::region::{Head, RegionAnswer, RegionRequest, NOT_COUNTED};
use hkv_proto::{ErrorCode, Op, ProtoError, Summary};
use hkv_shard::cuda::ipc::{IpcEvent, IpcSpan};
use hkv_shard::cuda::table::{Counts, DeviceOp, IpcArrays, IpcPart};

use super::arrays::Arr;
use super::err;
use crate::error::shard_error;
use crate::router::{to_wire, Table};
use crate::shard_ops::{CheckIpcKeys, RunIpc};
use crate::state::State;

/// The answer of a batch run in place, from its counts.
fn answer(op: DeviceOp, c: Counts) -> RegionAnswer {
    match op {
        DeviceOp::Find | DeviceOp::Contains => RegionAnswer::Count(c.hits),
        DeviceOp::Erase => RegionAnswer::Count(c.erased),
        DeviceOp::ApplyGradients(_) => RegionAnswer::Count(c.summary.absent),
        DeviceOp::InsertAndEvict => RegionAnswer::Evict(to_wire(c.summary), c.lost),
        _ => RegionAnswer::Write(to_wire(c.summary)),
    }
}

/// Takes one of the `limits.max_in_flight` places of requests answered
/// early whose batches still run, over every connection (an early answer
/// frees its connection's in-flight slot, so this keeps a client that sends
/// them faster than the GPU serves them from piling up); false when none is
/// free, and the request is then answered once done.
fn take_early_place(state: &State) -> bool {
    let cap = state.config.limits.max_in_flight as u64;
    state.stats.regions.early.fetch_update(Relaxed, Relaxed, |e| (e < cap).then_some(e + 1)).is_ok()
}

/// A request with a done event on a table of one shard, holding an early
/// place ([`take_early_place`]): answered as soon as its kernels are
/// queued and the event recorded, before they ran, with every count
/// [`NOT_COUNTED`] (the client's stream waits on the event for the
/// outputs); the batch completes on the actor meanwhile, holding the
/// regions, and gives the place back. A request refused before it was
/// queued answers its error; one refused once it ran (a write with a
/// reserved key: nothing of it written) leaves its error for the first
/// region request of the connection after that, which answers it instead
/// of running.
async fn early(
    state: &Arc<State>,
    conn: &Arc<super::Conn>,
    t: &Arc<Table>,
    op: DeviceOp,
    arrays: IpcArrays,
    done: Option<Arc<IpcEvent>>,
) -> Result<RegionAnswer, ProtoError> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let told = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (state, t, conn, answered) = (state.clone(), t.clone(), conn.clone(), told.clone());
    let run = tokio::spawn(async move {
        // Queued: the request is answered early (below), so an error after
        // this is the connection's to report.
        let queued: Box<dyn FnOnce() + Send> = Box::new(move || {
            answered.store(true, Relaxed);
            let _ = tx.send(());
        });
        // On this task's thread (moved off the executor), not the shard's
        // actor: the batch holds it until the GPU has run it, and the
        // actor's next request (the client's next one, answered early or
        // not) would wait behind that in its mailbox. Requests still meet
        // in the table's lock groups, in the order they took them.
        let r = state.router.call_here(&t, 0, RunIpc { op, arrays, part: None, done, queued: Some(queued) });
        state.stats.regions.early.fetch_sub(1, Relaxed);
        if let Err(e) = &r {
            tracing::warn!(error = %e.message, "a device region request failed after it was answered");
            if told.load(Relaxed) {
                let mut slot = conn.refused.lock();
                if slot.is_none() {
                    *slot = Some(err(
                        e.code,
                        format!(
                            "an earlier {op:?} request on table {:?}, answered once queued, was refused when it \
                             ran: {}; this request was not run",
                            t.spec.name, e.message
                        ),
                    ));
                }
            }
        }
        r
    });
    if rx.await.is_ok() {
        let n = NOT_COUNTED;
        return Ok(match op {
            DeviceOp::Find | DeviceOp::Contains | DeviceOp::Erase | DeviceOp::ApplyGradients(_) => {
                RegionAnswer::Count(n)
            }
            _ => RegionAnswer::Write(Summary { updated: n, inserted: n, evicted: n, rejected: n, absent: n }),
        });
    }
    // Refused before it was queued: its error (or, had it run, its counts).
    let c = run.await.map_err(|e| err(ErrorCode::Internal, format!("the request's task failed: {e}")))??;
    Ok(answer(op, c))
}

/// The device op that serves `req` on `t` in place, if any.
fn device_op(t: &Table, req: &RegionRequest) -> Result<Option<DeviceOp>, ProtoError> {
    let plain_write = !req.scores && !req.outcomes;
    let Ok(op) = Op::try_from(req.op) else { return Ok(None) };
    Ok(Some(match op {
        Op::Find => DeviceOp::Find,
        Op::Contains => DeviceOp::Contains,
        Op::Erase if !req.outcomes => DeviceOp::Erase,
        Op::InsertOrAssign if plain_write => DeviceOp::InsertOrAssign,
        Op::Assign if plain_write => DeviceOp::Assign,
        Op::AccumOrAssign if plain_write => DeviceOp::AccumOrAssign,
        Op::FindOrInsert if plain_write => DeviceOp::FindOrInsert,
        Op::InsertAndEvict if plain_write => DeviceOp::InsertAndEvict,
        Op::ApplyGradients => match req.head {
            Head::Apply(hyper) => DeviceOp::ApplyGradients(crate::router::step_of(t, hyper)?),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    }))
}

/// Serves `req` on the GPU when it can (see the module); `None` when the
/// request is to be staged.
pub(super) async fn run(
    state: &Arc<State>,
    conn: &Arc<super::Conn>,
    t: &Arc<Table>,
    req: &RegionRequest,
    arrs: &[Arr],
    n: usize,
    done: &Option<Arc<IpcEvent>>,
) -> Result<Option<RegionAnswer>, ProtoError> {
    let Some(op) = device_op(t, req)? else { return Ok(None) };
    let shards = t.shards();
    if shards > 1 && (op == DeviceOp::InsertAndEvict || req.scores) {
        return Ok(None);
    }
    let ordinals = &state.router.ordinals;
    if ordinals.len() != shards {
        return Ok(None);
    }
    // Every shard's GPU must reach every array: its own GPU's memory, or
    // another's over peer access (else the request is staged).
    let mut mems: Vec<&Arc<hkv_shard::cuda::ipc::IpcMem>> = Vec::new();
    for a in arrs {
        match a.region.device() {
            Some(m) if !mems.iter().any(|x| Arc::ptr_eq(x, m)) => mems.push(m),
            Some(_) => {}
            None => return Ok(None),
        }
    }
    if !mems.iter().all(|m| ordinals.iter().all(|&o| m.reachable_from(o))) {
        return Ok(None);
    }
    // Rows of the op: apply_gradients' gradients and values hold the
    // table's values only (its rows also hold the optimizer's state).
    let dim = match op {
        DeviceOp::ApplyGradients(step) => step.dim as u64,
        _ => t.config.dim as u64,
    };
    let find = |name: &str| arrs.iter().find(|a| a.slot.name == name);
    // Each span: the reference's first `count` elements (the evicted
    // arrays hold c >= n entries; the kernel writes at most n).
    fn span<T>(a: &Arr, count: u64) -> Result<IpcSpan<T>, ProtoError> {
        let m = a.region.device().expect("device regions only");
        m.span::<T>(a.r.offset, count).map_err(shard_error)
    }
    let n64 = n as u64;
    let keys = span::<u64>(find("keys").expect("keyed ops name keys"), n64)?;
    let values = find("values").map(|a| span::<f32>(a, n64 * dim)).transpose()?;
    let found = find("found").or_else(|| find("erased")).map(|a| span::<u8>(a, n64)).transpose()?;
    let scores = match (op, find("scores")) {
        (DeviceOp::Find, Some(a)) => Some(span::<u64>(a, n64)?),
        _ => None,
    };
    let lost = match op {
        DeviceOp::InsertAndEvict => {
            let get = |name: &str| find(name).ok_or_else(|| err(ErrorCode::Internal, format!("no {name}")));
            Some((
                span::<u64>(get("evicted_keys")?, n64)?,
                span::<f32>(get("evicted_values")?, n64 * dim)?,
                span::<u64>(get("evicted_scores")?, n64)?,
                span::<u8>(get("evicted_kinds")?, n64)?,
            ))
        }
        _ => None,
    };
    let grads = find("grads").map(|a| span::<f32>(a, n64 * dim)).transpose()?;
    let arrays = IpcArrays { keys, values, grads, found, scores, lost };
    let c = if shards == 1 && done.is_some() && op != DeviceOp::InsertAndEvict && take_early_place(state) {
        return early(state, conn, t, op, arrays, done.clone()).await.map(Some);
    } else if shards == 1 {
        // On this thread: the batch's kernels take tens of microseconds,
        // and the hand-offs to the actor's thread and back cost as much.
        state.router.call_here(t, 0, RunIpc { op, arrays, part: None, done: done.clone(), queued: None })?
    } else {
        if !matches!(op, DeviceOp::Find | DeviceOp::Contains) {
            state.router.call(t, 0, CheckIpcKeys(arrays.keys.clone())).await?;
        }
        let parts = (0..shards).map(|i| {
            let arrays = arrays.clone();
            let part = IpcPart { shard: i as u32, shards: shards as u32 };
            state.router.call(t, i, RunIpc { op, arrays, part: Some(part), done: None, queued: None })
        });
        let mut total = Counts::default();
        for r in join_all(parts).await {
            total = total.merge(r?);
        }
        // Every part is done: the event completes as soon as it is recorded.
        if let Some(d) = done.clone() {
            tokio::task::spawn_blocking(move || d.record_now())
                .await
                .map_err(|e| err(ErrorCode::Internal, format!("recording the done event: {e}")))?
                .map_err(shard_error)?;
        }
        total
    };
    Ok(Some(answer(op, c)))
}
