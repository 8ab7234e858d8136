//! The Unix-socket server: accept loop, one task per connection reading
//! frames, one task per request (at most `max_in_flight` per connection), a
//! writer task per connection sending answers as they complete.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkv_proto::{
    check_frame, Control, ErrorCode, FrameBuf, FrameCheck, Header, ProtoError, Request, Response, HEADER_LEN,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{debug, info, warn};

use crate::admin::Peer;
use crate::config::Config;
use crate::router::Router;

/// Counters of the server itself.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections open now.
    pub connections: AtomicUsize,
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Requests answered.
    pub requests: AtomicU64,
    /// Error responses sent.
    pub errors: AtomicU64,
    /// Requests running now.
    pub in_flight: AtomicUsize,
    /// Bytes of request bodies being received or run, and of answers
    /// being built or sent, over every connection (bounded by
    /// `limits.max_bytes_in_flight`).
    pub in_flight_bytes: AtomicU64,
    /// Frames refused because that bound was reached.
    pub in_flight_refusals: AtomicU64,
    /// Of `in_flight_bytes`, those of bodies over [`SMALL_BODY`] bytes still
    /// arriving: at most 3/4 of the limit, so that uploads kept trickling
    /// cannot take what small requests and answers need.
    pub receiving_bytes: AtomicU64,
    /// Registered regions mapped now.
    pub regions: crate::region::Counters,
}

/// Everything the request handlers share.
pub struct State {
    /// Tables and shard actors.
    pub router: Router,
    /// The configuration in force.
    pub config: Config,
    /// When the daemon started.
    pub started: Instant,
    /// Set to true to drain and stop.
    pub shutdown: watch::Sender<bool>,
    /// The daemon's uid (admin rights).
    pub uid: u32,
    /// The admin group's gid, if configured.
    pub admin_gid: Option<u32>,
    /// Server counters.
    pub stats: ServerStats,
    /// Backend in words, for stats.
    pub backend: String,
    /// Checkpoints.
    pub checkpoints: Arc<crate::ckpt::Checkpoints>,
}

impl State {
    /// Whether `peer` may run admin operations: root, the daemon's user, or
    /// a member of the admin group (primary or supplementary).
    pub fn is_admin(&self, peer: &Peer) -> bool {
        peer.uid == 0 || peer.uid == self.uid || self.admin_gid.is_some_and(|g| peer.in_group(g))
    }
}

/// Binds the socket: creates its directory (mode 0750, in group `gid` when
/// given) when missing, replaces a stale socket file, refuses when another
/// daemon answers there, and gives the socket mode 0660 and group `gid`, so
/// that the admin group's members can connect.
pub fn bind(path: &Path, gid: Option<u32>) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let chgrp = |p: &Path| -> anyhow::Result<()> {
        if let Some(g) = gid {
            std::os::unix::fs::chown(p, None, Some(g))
                .map_err(|e| anyhow::anyhow!("cannot give {} the admin group (gid {g}): {e}", p.display()))?;
        }
        Ok(())
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Every directory hkvd creates gets the mode and group, not only the
        // last: a member of the group must be able to pass through each.
        let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && !d.exists()).collect();
        for d in missing.into_iter().rev() {
            std::fs::create_dir(d).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", d.display()))?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o750))?;
            chgrp(d)?;
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            anyhow::bail!(
                "{} exists and is not a socket; hkvd does not replace it: pick another --socket",
                path.display()
            );
        }
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another daemon is serving {}; stop it or pick another --socket", path.display());
        }
        std::fs::remove_file(path).map_err(|e| anyhow::anyhow!("cannot remove stale {}: {e}", path.display()))?;
    }
    let l = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot bind {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    chgrp(path)?;
    Ok(l)
}

/// Removes the socket file on drop (the daemon's own, not an inherited one).
pub struct SocketFile(pub Option<PathBuf>);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Accepts until shutdown, then waits (up to `drain_seconds`) for every
/// connection to finish its in-flight requests.
pub async fn serve(state: Arc<State>, listener: UnixListener) {
    let mut stop = state.shutdown.subscribe();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let st = state.clone();
                    tasks.spawn(async move { connection(st, stream).await });
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.changed() => break,
        }
        while tasks.try_join_next().is_some() {}
    }
    drop(listener);
    info!(connections = tasks.len(), "draining");
    let drain = Duration::from_secs(state.config.limits.drain_seconds);
    if tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await.is_err() {
        warn!("drain timed out after {drain:?}; closing the remaining connections");
        tasks.abort_all();
    }
}

fn error_frame(id: u64, op: u8, e: ProtoError) -> FrameBuf {
    FrameBuf::Vec(Response::Error(e).encode(op, id))
}

/// Reads one header; `Ok(None)` is a clean close between frames.
async fn read_header<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<Option<[u8; HEADER_LEN]>> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut h[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed inside a frame header"))
            };
        }
        got += n;
    }
    Ok(Some(h))
}

async fn connection(state: Arc<State>, stream: UnixStream) {
    let st = &state.stats;
    st.accepted.fetch_add(1, Relaxed);
    let open = st.connections.fetch_add(1, Relaxed) + 1;
    let _open = scopeguard(|| {
        state.stats.connections.fetch_sub(1, Relaxed);
    });
    let peer = match stream.peer_cred() {
        Ok(c) => Arc::new(Peer::new(c.uid(), c.gid(), c.pid())),
        Err(e) => {
            warn!(error = %e, "no peer credentials; closing");
            return;
        }
    };
    let (rd, wr) = stream.into_split();
    // Read with recvmsg: fds sent with register_memfd frames are queued on `conn`.
    let conn = Arc::new(crate::region::Conn::default());
    let rd = crate::region::FdReader::new(rd, conn.clone());
    // Each answer travels with its share of the bytes in flight, given back
    // once it is written to the socket.
    let (tx, mut rx) = mpsc::channel::<(FrameBuf, Option<InFlight>)>(256);
    let sent = state.clone();
    let writer = tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(1 << 16, wr);
        while let Some(mut f) = rx.recv().await {
            // Everything queued, then a flush when nothing else is, so
            // answers never linger; each sent frame goes back for reuse.
            loop {
                if w.write_all(f.0.bytes()).await.is_err() {
                    return;
                }
                sent.router.frames.put(f.0);
                drop(f.1);
                match rx.try_recv() {
                    Ok(next) => f = next,
                    Err(_) => break,
                }
            }
            if w.flush().await.is_err() {
                return;
            }
        }
        let _ = w.flush().await;
    });
    if open > state.config.limits.max_connections {
        let e = ProtoError::new(
            ErrorCode::Busy,
            format!("{} connections are open (limits.max_connections); try again later", open - 1),
        );
        let _ = tx.send((error_frame(0, hkv_proto::op::ERROR, e), None)).await;
        drop(tx);
        let _ = writer.await;
        return;
    }
    let limits = &state.config.limits;
    let stall = Duration::from_secs(limits.body_stall_seconds.max(1));
    let sem = Arc::new(Semaphore::new(limits.max_in_flight));
    let mut rd = BufReader::with_capacity(1 << 16, rd);
    let mut stop = state.shutdown.subscribe();
    // A connection accepted as shutdown began must not wait for a change.
    let mut draining = *stop.borrow();
    loop {
        let frame_start = rd.get_ref().offset() - rd.buffer().len() as u64;
        let header = if draining {
            // Requests still arriving are answered `shutting_down` until
            // this connection's in-flight requests are done.
            tokio::select! {
                h = read_header(&mut rd) => h,
                _ = sem.acquire_many(limits.max_in_flight as u32) => break,
            }
        } else {
            tokio::select! {
                h = read_header(&mut rd) => h,
                _ = stop.changed() => {
                    draining = true;
                    continue;
                }
            }
        };
        let raw = match header {
            Ok(Some(h)) => h,
            Ok(None) => break,
            Err(e) => {
                debug!(error = %e, "connection closed mid-frame");
                break;
            }
        };
        let refusal = match check_frame(&raw, limits.max_frame_bytes) {
            Ok(FrameCheck::Ready(_)) | Ok(FrameCheck::NeedMore) => None,
            // Refused before allocation; the body is skipped unread.
            Ok(FrameCheck::Oversized(h)) => Some((
                h,
                ProtoError::new(
                    ErrorCode::Oversized,
                    format!(
                        "frame body of {} bytes is above limits.max_frame_bytes = {}; send smaller batches",
                        h.body_len, limits.max_frame_bytes
                    ),
                ),
            )),
            Err(e) => {
                st.errors.fetch_add(1, Relaxed);
                let _ = tx.send((error_frame(0, hkv_proto::op::ERROR, e), None)).await;
                break;
            }
        };
        let (h, refusal) = match refusal {
            Some((h, e)) => (h, Some(e)),
            None => {
                let h = Header::decode(&raw).expect("checked");
                let e = draining.then(|| {
                    ProtoError::new(
                        ErrorCode::ShuttingDown,
                        "the daemon is shutting down: requests sent before it began are answered, this one is not run",
                    )
                });
                (h, e)
            }
        };
        let body = match refusal {
            Some(e) => Err((e, 0)),
            None => match read_body(&mut rd, h.body_len as usize, &state, stall).await {
                Ok(b) => b,
                Err(e) => {
                    debug!(error = %e, "connection closed inside a frame body");
                    break;
                }
            },
        };
        let (body, charge) = match body {
            Ok(b) => b,
            Err((e, read)) => {
                st.errors.fetch_add(1, Relaxed);
                let _ = tx.send((error_frame(h.id, h.op, e), None)).await;
                let rest = h.body_len as u64 - read as u64;
                let skipped = tokio::io::copy(&mut (&mut rd).take(rest), &mut tokio::io::sink()).await;
                if skipped.map(|n| n < rest).unwrap_or(true) {
                    break;
                }
                continue;
            }
        };
        let ctx = conn.ctx(&h, frame_start);
        let Ok(permit) = sem.clone().acquire_owned().await else { break };
        let (state2, tx2, peer) = (state.clone(), tx.clone(), peer.clone());
        tokio::spawn(async move {
            state2.stats.in_flight.fetch_add(1, Relaxed);
            let (resp, answer) = handle(&state2, &h, &body, &peer, ctx).await;
            drop(body);
            drop(charge);
            state2.stats.in_flight.fetch_sub(1, Relaxed);
            state2.stats.requests.fetch_add(1, Relaxed);
            if matches!(resp, Response::Error(_)) {
                state2.stats.errors.fetch_add(1, Relaxed);
            }
            let _ = tx2.send((resp.into_frame(h.op, h.id), answer)).await;
            drop(permit);
        });
    }
    // Wait for this connection's in-flight requests, then let the writer finish.
    let _ = sem.acquire_many(limits.max_in_flight as u32).await;
    drop(tx);
    let _ = writer.await;
}

/// Bytes counted in one of the server's byte counters, up to a cap: in
/// `in_flight_bytes` a request body as it arrives or an answer until it is
/// sent, in `receiving_bytes` a large body until it is complete; given back
/// on drop.
pub struct InFlight {
    state: Arc<State>,
    counter: fn(&ServerStats) -> &AtomicU64,
    bytes: u64,
}

impl InFlight {
    /// A share of `ServerStats::in_flight_bytes`.
    pub(crate) fn total(state: &Arc<State>) -> InFlight {
        InFlight { state: state.clone(), counter: |s| &s.in_flight_bytes, bytes: 0 }
    }

    /// A share of `ServerStats::receiving_bytes`.
    fn receiving(state: &Arc<State>) -> InFlight {
        InFlight { state: state.clone(), counter: |s| &s.receiving_bytes, bytes: 0 }
    }

    /// Counts `n` more bytes, unless the counter would then pass `cap`.
    pub(crate) fn add(&mut self, n: u64, cap: u64) -> bool {
        let counter = (self.counter)(&self.state.stats);
        let ok = counter.fetch_update(Relaxed, Relaxed, |b| b.checked_add(n).filter(|&t| t <= cap)).is_ok();
        if ok {
            self.bytes += n;
        }
        ok
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        (self.counter)(&self.state.stats).fetch_sub(self.bytes, Relaxed);
    }
}

/// Bodies up to this size are not counted among those still arriving (each
/// connection receives one body at a time, so they hold at most
/// `max_connections` × 64 KiB): a small request is served while large
/// uploads hold at most 3/4 of the bytes in flight.
pub const SMALL_BODY: usize = 64 << 10;

/// Reads a body of `len` bytes, allocating memory as its bytes arrive (a
/// header alone reserves nothing, so declared lengths cost no memory), each
/// step counted against `limits.max_bytes_in_flight`. Past that limit,
/// the error to answer and the bytes read so far. An `Err` of the outer
/// result is the connection failing, or a body that stopped arriving for
/// `stall` (its memory would otherwise be held for good).
#[allow(clippy::type_complexity)]
async fn read_body<R: AsyncReadExt + Unpin>(
    rd: &mut R,
    len: usize,
    state: &Arc<State>,
    stall: Duration,
) -> std::io::Result<Result<(Vec<u8>, InFlight), (ProtoError, usize)>> {
    /// The first allocation; each later one doubles what arrived (large
    /// reallocations move pages, they do not copy them).
    const FIRST: usize = 1 << 20;
    let mut body = Vec::new();
    let mut charge = InFlight::total(state);
    let mut arriving = InFlight::receiving(state);
    while body.len() < len {
        if body.capacity() == body.len() {
            let step = (len - body.len()).min(body.len().max(FIRST));
            let limit = state.config.limits.max_bytes_in_flight;
            let refused = if len > SMALL_BODY && !arriving.add(step as u64, limit / 4 * 3) {
                Some(format!(
                    "{} bytes of large request bodies are still arriving (at most 3/4 of \
                     limits.max_bytes_in_flight = {limit}); this {len}-byte request was not run: \
                     retry, or send smaller batches",
                    state.stats.receiving_bytes.load(Relaxed)
                ))
            } else if !charge.add(step as u64, limit) {
                Some(format!(
                    "{} bytes of requests and answers are already in flight \
                     (limits.max_bytes_in_flight = {limit}); this {len}-byte request was not run: \
                     retry, or send smaller batches",
                    state.stats.in_flight_bytes.load(Relaxed)
                ))
            } else {
                None
            };
            if let Some(why) = refused {
                state.stats.in_flight_refusals.fetch_add(1, Relaxed);
                return Ok(Err((ProtoError::new(ErrorCode::ResourceExhausted, why), body.len())));
            }
            body.try_reserve_exact(step).map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e))?;
        }
        let room = (body.capacity() - body.len()).min(len - body.len());
        let read = tokio::time::timeout(stall, (&mut *rd).take(room as u64).read_buf(&mut body)).await;
        match read {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                warn!(got = body.len(), len, "a request body stopped arriving; closing its connection");
                return Err(std::io::ErrorKind::TimedOut.into());
            }
        }
    }
    Ok(Ok((body, charge)))
}

struct Guard<F: FnMut()>(F);
impl<F: FnMut()> Drop for Guard<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}
fn scopeguard<F: FnMut()>(f: F) -> Guard<F> {
    Guard(f)
}

/// Answers one request.
#[tracing::instrument(level = "debug", skip_all, fields(op = hkv_proto::msg::op_name(h.op), id = h.id))]
/// The answer, and its share of the bytes in flight (held until it is sent).
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
    if hkv_proto::msg::is_admin_op(h.op) && !state.is_admin(peer) {
        let group = match (&state.config.admin_group, state.admin_gid) {
            (Some(name), Some(gid)) => format!("nor in the admin group {name} (gid {gid})"),
            _ => "and the daemon has no admin group (--admin-group)".into(),
        };
        return Err(ProtoError::new(
            ErrorCode::Forbidden,
            format!(
                "{} needs admin rights: uid {} is neither the daemon's user ({}) nor root, {group}",
                hkv_proto::msg::op_name(h.op),
                peer.uid,
                state.uid
            ),
        ));
    }
    if hkv_proto::region::is_region(h) {
        return crate::region::answer(state, ctx, h, body).await;
    }
    let req = Request::decode(h, body)?;
    // Answers count against the bytes in flight before they are built: a
    // client that pipelines large finds without reading them is refused
    // instead of holding answers until memory runs out.
    let need = state.router.answer_bytes(&req);
    if need > 0 {
        let mut c = InFlight::total(state);
        if !c.add(need, state.config.limits.max_bytes_in_flight) {
            state.stats.in_flight_refusals.fetch_add(1, Relaxed);
            return Err(ProtoError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "{} bytes of requests and answers are already in flight (limits.max_bytes_in_flight = {}); \
                     this request's answer of up to {need} bytes was not built: read the answers already sent \
                     for, retry, or send smaller batches",
                    state.stats.in_flight_bytes.load(Relaxed),
                    state.config.limits.max_bytes_in_flight
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
        Request::Control(c) => match c {
            Control::CreateTable(spec) => {
                let info = state.router.create_table(spec).await?;
                info!(table = %info.spec.name, dim = info.spec.dim, capacity = info.capacity, "table created");
                Ok(Response::Json(serde_json::to_vec(&info).expect("serializes")))
            }
            Control::DropTable { name } => {
                state.router.drop_table(&name)?;
                info!(table = %name, "table dropped");
                Ok(Response::Empty)
            }
            Control::ListTables => {
                let list: Vec<_> = state.router.tables().iter().map(|t| Router::info(t)).collect();
                Ok(Response::Json(serde_json::to_vec(&list).expect("serializes")))
            }
            Control::Stats => {
                Ok(Response::Json(serde_json::to_vec(&crate::stats::collect(state)).expect("serializes")))
            }
            Control::Metrics => Ok(Response::Text(crate::stats::prometheus(&crate::stats::collect(state)))),
            Control::Checkpoint { wait, full } => {
                use crate::ckpt::Checkpoints;
                if wait {
                    let m = Checkpoints::take(state.clone(), full).await?;
                    let l = state.checkpoints.list()?.into_iter().find(|l| l.id == format!("{:016x}", m.id));
                    Ok(Response::Json(serde_json::to_vec(&l).expect("serializes")))
                } else {
                    // Busy unless this request claims the checkpoint now; the answer names its id.
                    let id = Checkpoints::start(state.clone(), full).await?;
                    let answer = serde_json::json!({ "started": true, "id": id });
                    Ok(Response::Json(serde_json::to_vec(&answer).expect("serializes")))
                }
            }
            Control::ListCheckpoints => {
                Ok(Response::Json(serde_json::to_vec(&state.checkpoints.list()?).expect("serializes")))
            }
            Control::Restore { id } => {
                let r = crate::ckpt::Checkpoints::restore(state.clone(), &id).await?;
                let r = r.ok_or_else(|| ProtoError::new(ErrorCode::NotFound, "there is no checkpoint to restore"))?;
                Ok(Response::Json(serde_json::to_vec(&r).expect("serializes")))
            }
            Control::Shutdown => {
                info!(uid = peer.uid, "shutdown requested");
                let _ = state.shutdown.send(true);
                Ok(Response::Empty)
            }
        },
        r @ (Request::Hash { .. } | Request::FindFeatures { .. } | Request::FindOrInsertFeatures { .. }) => {
            state.router.features(r).await
        }
        table_op => state.router.execute(table_op).await,
    }
}
