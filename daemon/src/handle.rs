//! Answers one request: admin rights checked, the body decoded, the
//! answer's bytes counted, then the control operations here and the table
//! and feature operations through the router.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use hkv_proto::{Control, ErrorCode, Header, ProtoError, Request, Response};
use tracing::info;

use crate::admin::Peer;
use crate::router::Hashed;
use crate::state::InFlight;
use crate::state::State;

/// Answers one request: the answer, and its share of the bytes in flight
/// (held until it is sent).
#[tracing::instrument(level = "debug", skip_all, fields(op = hkv_proto::op::name_of(h.op), id = h.id))]
pub async fn handle(
    state: &Arc<State>,
    h: &Header,
    body: &[u8],
    peer: &Peer,
    ctx: crate::region::Ctx,
) -> (Response, Option<InFlight>) {
    let mut answer_bytes = None;
    match answer(state, h, body, peer, &mut answer_bytes, ctx).await {
        Ok(r) => (r, answer_bytes),
        Err(e) => (Response::Error(e), None),
    }
}

async fn answer(
    state: &Arc<State>,
    h: &Header,
    body: &[u8],
    peer: &Peer,
    answer_bytes: &mut Option<InFlight>,
    ctx: crate::region::Ctx,
) -> Result<Response, ProtoError> {
    if hkv_proto::Op::try_from(h.op).is_ok_and(hkv_proto::Op::is_admin) && !state.is_admin(peer) {
        let group = match (&state.config.admin_group, state.admin_gid) {
            (Some(name), Some(gid)) => format!("nor in the admin group {name} (gid {gid})"),
            _ => "and the daemon has no admin group (--admin-group)".into(),
        };
        return Err(ProtoError::new(
            ErrorCode::Forbidden,
            format!(
                "{} needs admin rights: uid {} is neither the daemon's user ({}) nor root, {group}",
                hkv_proto::op::name_of(h.op),
                peer.uid,
                state.uid
            ),
        ));
    }
    if hkv_proto::region::is_region(h) {
        return crate::region::answer(state, ctx, h, body).await;
    }
    let req = Request::decode(h, body)?;
    // A backed table a restore changed serves once its rows are checked
    // (before its table is looked up: the restore installs another).
    if let Some(name) = req.table() {
        state.router.wait_checked(name).await;
    }
    // A table this connection knew, dropped and created again since, is
    // refused once (`Conn::same_table`); an unknown one is the op's own
    // error.
    if let Some(t) = req.table().and_then(|name| state.router.table(name).ok()) {
        ctx.conn.same_table(&t)?;
    }
    // OUTCOMES on a read asks a backed table for each key's origin (other
    // tables ignore it, as PROTOCOL.md says).
    let origins = h.flags & hkv_proto::flags::OUTCOMES != 0;
    // Answers count against the bytes in flight before they are built: a
    // client that pipelines large finds without reading them is refused
    // instead of holding answers until memory runs out.
    let need = state.router.peak_bytes(&req);
    if need > 0 {
        let mut c = InFlight::total(state);
        let limit = state.config.limits.max_bytes_in_flight;
        if !c.add(need, limit) {
            state.stats.in_flight_refusals.fetch_add(1, Relaxed);
            if need > limit {
                // Alone past the limit: retrying never helps (a tester's
                // trace under a 256 KiB limit was told to retry).
                let (what, or) = match req {
                    Request::Control(hkv_proto::Control::Trace { .. }) => {
                        ("a trace (its sampled keys, their merge and its answer)", "")
                    }
                    _ => ("this request's answer", ", or send smaller batches"),
                };
                return Err(ProtoError::new(
                    ErrorCode::ResourceExhausted,
                    format!(
                        "{what} takes up to {need} bytes while it is built, more than limits.max_bytes_in_flight = \
                         {limit} allows in all: raise --max-bytes-in-flight (limits.max_bytes_in_flight) to at \
                         least {need}{or}"
                    ),
                ));
            }
            return Err(ProtoError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "{} bytes of requests and answers are already in flight (limits.max_bytes_in_flight = {}{}); \
                     this request's answer, taking up to {need} bytes while it is built, was not built: read the \
                     answers already sent for, retry, or send smaller batches",
                    state.stats.in_flight_bytes.load(Relaxed),
                    state.config.limits.max_bytes_in_flight,
                    state.memory.describe(),
                ),
            ));
        }
        *answer_bytes = Some(c);
    }
    match req {
        Request::Ping => Ok(Response::Empty),
        Request::Echo { reply_len, .. } => {
            if reply_len > state.config.limits.max_frame_bytes {
                return Err(ProtoError::new(ErrorCode::Oversized, "echo reply above limits.max_frame_bytes"));
            }
            Ok(state.router.frames.echo(reply_len as usize))
        }
        Request::Control(c) => control(state, c, peer, &ctx.conn).await,
        r @ (Request::Hash { .. } | Request::FindFeatures { .. } | Request::FindOrInsertFeatures { .. }) => {
            // The keys a backed table's fused ops hash to read through its
            // cluster as a find's or a find_or_insert's do.
            let hashed = state.router.hash_request(r).await?;
            let tier = match &hashed {
                Hashed::Find { t, .. } | Hashed::FindOrInsert { t, .. } => state.backing.backed(&t.spec.name).await?,
                Hashed::Keys(_) => None,
            };
            let (router, tiers) = (&state.router, &state.backing);
            match (hashed, tier) {
                (Hashed::Find { t, keys, scores }, Some(b)) => {
                    crate::backing::find_response(router, tiers, &b, &t, keys, scores, origins).await
                }
                (Hashed::FindOrInsert { t, keys, values, scores, outcomes }, Some(b)) => {
                    let op = hkv_proto::WriteOp::FindOrInsert;
                    crate::backing::write(router, tiers, &b, &t, op, keys, values, scores, outcomes)
                        .await
                        .map(Into::into)
                }
                (h, _) => router.answer_hashed(h).await,
            }
        }
        // A backed table's reads fill misses from its cluster and its
        // writes reach it (`crate::backing`); the rest is the cache's.
        table_op => {
            let tier = match table_op.table() {
                Some(name) => state.backing.backed(name).await?,
                None => None,
            };
            match tier {
                Some(tier) => crate::backing::execute(&state.router, &state.backing, tier, table_op, origins).await,
                None => state.router.execute(table_op).await,
            }
        }
    }
}

/// Answers a control request (tables, stats, checkpoints, shutdown).
async fn control(
    state: &Arc<State>,
    c: Control,
    peer: &Peer,
    conn: &crate::region::Conn,
) -> Result<Response, ProtoError> {
    match c {
        Control::CreateTable(mut spec) => {
            if let Some(why) = state.router.unsupported(&spec) {
                return Err(ProtoError::new(ErrorCode::BadRequest, why));
            }
            // An empty password is none: kept, it would be listed and
            // checkpointed as a hidden one that no restore can fill in.
            crate::backing::drop_empty_passwords(&mut spec);
            // The spec and the budget first, then the cluster: a refused
            // create_table wrote a meta hash into it (a fuzzer's refused
            // table of another dim kept a later good one out), and one of
            // an existing name closed that table's tier on its way out.
            let table = state.router.prepare_table(spec.clone()).await?;
            if let Err(e) = state.backing.open(&spec).await {
                crate::router::Router::discard(table).await;
                return Err(e);
            }
            let name = spec.name.clone();
            let info = match state.router.add_table(table).await {
                Ok(info) => info,
                Err(e) => {
                    let _ = state.backing.close(&name).await;
                    return Err(e);
                }
            };
            if let Ok(t) = state.router.table(&name) {
                conn.made_table(&name, Some(t.made()));
            }
            info!(table = %info.spec.name, dim = info.spec.dim, capacity = info.capacity, "table created");
            Ok(Response::Json(serde_json::to_vec(&info).expect("serializes")))
        }
        Control::DropTable { name } => {
            // The table's write-back queue drains before the table goes: a
            // queue that cannot drain refuses the drop (nothing changes; the
            // table and its queue stay, to drain once the cluster is back).
            state.router.table(&name)?;
            state.backing.drain_before_drop(&name).await.map_err(|mut e| {
                e.message = format!("table {name:?} was not dropped: {}", e.message);
                e
            })?;
            state.router.drop_table(&name).await?;
            conn.made_table(&name, None);
            state.backing.close(&name).await?;
            info!(table = %name, "table dropped");
            Ok(Response::Empty)
        }
        Control::ListTables => {
            let mut list = vec![];
            for t in state.router.tables() {
                list.push(state.router.info(&t).await?);
            }
            Ok(Response::Json(serde_json::to_vec(&list).expect("serializes")))
        }
        Control::Stats => {
            Ok(Response::Json(serde_json::to_vec(&crate::stats::collect(state).await?).expect("serializes")))
        }
        Control::Metrics => Ok(Response::Text(crate::stats::prometheus(&crate::stats::collect(state).await?))),
        Control::Checkpoint { wait, full } => {
            if wait {
                let m = state.checkpoints.take(state.router.clone(), full).await?;
                let l = state.checkpoints.list()?.into_iter().find(|l| l.id == format!("{:016x}", m.id));
                Ok(Response::Json(serde_json::to_vec(&l).expect("serializes")))
            } else {
                // Busy unless this request claims the checkpoint now; the answer names its id.
                let id = state.checkpoints.start(state.router.clone(), full).await?;
                let answer = serde_json::json!({ "started": true, "id": id });
                Ok(Response::Json(serde_json::to_vec(&answer).expect("serializes")))
            }
        }
        Control::ListCheckpoints => {
            Ok(Response::Json(serde_json::to_vec(&state.checkpoints.list()?).expect("serializes")))
        }
        Control::Restore { id } => {
            // The backed tables it changes wait until their rows are checked.
            let _release = state.router.release_unchecked_after();
            let r = state.checkpoints.restore(state.router.clone(), id, crate::ckpt::Occasion::Request).await?;
            let r = r.ok_or_else(|| ProtoError::new(ErrorCode::NotFound, "there is no checkpoint to restore"))?;
            let names: Vec<String> = r.tables.iter().map(|(n, _)| n.clone()).collect();
            crate::backing::Tiers::log_unopened(&state.backing.sync(&state.router, &names).await);
            state.backing.reconcile_restored(&state.router, &names).await;
            Ok(Response::Json(serde_json::to_vec(&r).expect("serializes")))
        }
        Control::Trace { table, seconds } => trace(state, &table, seconds, conn.gone()).await,
        Control::Flush { table } => {
            // A table without a cluster has nothing queued.
            state.router.table(&table)?;
            state.backing.flush(&table, crate::backing::DRAIN).await?;
            Ok(Response::Empty)
        }
        Control::Shutdown => {
            info!(uid = peer.uid, "shutdown requested");
            let _ = state.shutdown.send(true);
            Ok(Response::Empty)
        }
    }
}

/// Answers a trace request: starts a trace on every shard of `table`,
/// waits `seconds` (less when the daemon begins to drain or the peer goes
/// away), and answers the
/// merged keys ([`crate::mrc::merge_traces`]), at most what fits in
/// `limits.max_frame_bytes` and [`crate::mrc::TRACE_MAX_KEYS`] (the rest left out, `truncated` set).
async fn trace(
    state: &State,
    table: &str,
    seconds: u32,
    peer_gone: impl std::future::Future<Output = ()>,
) -> Result<hkv_proto::Response, hkv_proto::ProtoError> {
    let router = &state.router;
    if router.mrc.is_none() {
        return Err(hkv_proto::ProtoError::bad_request(
            "the daemon samples no keys (started with --no-mrc or [mrc] enabled = false); start it with the curves on",
        ));
    }
    let t = router.table(table)?;
    // The answer: 8 bytes of rate, 1 truncated byte, a u32 count, 8 per key;
    // at most TRACE_MAX_KEYS over every shard (what `handle` counted).
    let max_keys = ((state.config.limits.max_frame_bytes as usize).saturating_sub(64) / 8)
        .min(crate::mrc::TRACE_MAX_KEYS)
        / t.shards().max(1);
    router.trace_start(&t, max_keys).await?;
    let mut stop = state.shutdown.subscribe();
    tokio::select! {
        _ = tokio::time::sleep(std::time::Duration::from_secs(seconds as u64)) => {}
        _ = stop.changed() => {}
        // Nobody to answer: the trace ends, its keys are dropped.
        _ = peer_gone => {}
    }
    let (keys, rate, truncated) = crate::mrc::merge_traces(router.trace_take(&t).await?);
    // A table dropped (or dropped and made again) meanwhile: its keys are
    // not the table's of that name now, and an empty trace read as "too
    // few lookups" (a newcomer's finding). A live restore keeps the table.
    match router.table(table) {
        Err(_) => Err(hkv_proto::ProtoError::new(
            hkv_proto::ErrorCode::UnknownTable,
            format!("table {table:?} was dropped during the trace's window; no keys are given"),
        )),
        Ok(now) if now.made() != t.made() => Err(hkv_proto::ProtoError::bad_request(format!(
            "table {table:?} was dropped and created again during the trace's window; no keys are given: trace it again"
        ))),
        Ok(_) => Ok(hkv_proto::Response::Trace { rate, truncated, keys }),
    }
}
