//! One connection: frames read as they arrive (one task per request, at
//! most `max_in_flight` at once), request bodies and answers counted
//! against `max_bytes_in_flight`, a writer task sending answers as they
//! complete.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use hkv_proto::{check_frame, ErrorCode, FrameBuf, FrameCheck, Header, ProtoError, Response, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};
use tracing::{debug, info, warn};

use crate::admin::Peer;
use crate::handle::handle;
use crate::path::Stamps;
use crate::state::{InFlight, State};

fn error_frame(id: u64, op: u8, e: ProtoError) -> FrameBuf {
    FrameBuf::Vec(Response::Error(e).encode(op, id))
}

/// How long a refused connection is kept to read what its peer sent.
pub(crate) const REFUSE_LINGER: Duration = Duration::from_millis(250);

/// Refused connections kept at once; past them one is closed as soon as
/// its answer is written, so that peers that never close cannot hold
/// descriptors beyond `limits.max_connections` (the daemon's reserve).
const REFUSE_LINGERING: usize = 32;

static LINGERING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Tells a peer that cannot be served why (`e`, a frame of id 0), then
/// reads and drops what it sent until it closes, for at most `linger`,
/// before closing. A socket closed with bytes unread resets its peer,
/// whose read then fails before it reaches the answer: clients over the
/// connection limit saw "connection reset" (or a broken pipe on their
/// request), not `busy`.
pub(crate) async fn refuse(mut stream: UnixStream, e: ProtoError, linger: Duration) {
    let frame = Response::Error(e).encode(hkv_proto::Op::Error, 0);
    let lingering = LINGERING.fetch_add(1, Relaxed) < REFUSE_LINGERING;
    let _ = tokio::time::timeout(linger, async {
        stream.write_all(&frame).await?;
        stream.shutdown().await?;
        let mut drop = [0u8; 4096];
        while lingering && stream.read(&mut drop).await? > 0 {}
        Ok::<(), std::io::Error>(())
    })
    .await;
    LINGERING.fetch_sub(1, Relaxed);
}

/// Reads one header; `Ok(None)` is a clean close between frames. Its
/// first byte may take `idle` (None: forever), after which the connection
/// closes if `may_close()` says so (it then gave its slot back; a
/// connection whose requests are still running is not idle), else it waits
/// again; once the header has begun, the rest must come within `stall`.
/// Either wait passed is a `TimedOut` error: the connection closes.
async fn read_header<R: AsyncReadExt + Unpin>(
    r: &mut R,
    idle: Option<Duration>,
    stall: Duration,
    may_close: impl Fn() -> bool,
) -> std::io::Result<Option<[u8; HEADER_LEN]>> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let wait = if got == 0 { idle } else { Some(stall) };
        let n = match wait {
            None => r.read(&mut h[got..]).await?,
            // `read` is cancel-safe: a timed-out read took no byte.
            Some(t) => match tokio::time::timeout(t, r.read(&mut h[got..])).await {
                Ok(n) => n?,
                Err(_) if got == 0 && !may_close() => continue,
                Err(_) => {
                    let what = if got == 0 { "no request came" } else { "a frame header stopped arriving" };
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, what));
                }
            },
        };
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

/// An answer to send, with its share of the bytes in flight (given back
/// once it is written to the socket) and, for a request that ran, when it
/// passed each stage (`crate::path`).
type Answer = (FrameBuf, Option<InFlight>, Option<Stamps>);

/// Serves one connection until the peer closes it, or until shutdown once
/// its in-flight requests are answered.
pub(crate) async fn connection(state: Arc<State>, stream: UnixStream) {
    let st = &state.stats;
    st.accepted.fetch_add(1, Relaxed);
    let open = st.connections.fetch_add(1, Relaxed) + 1;
    if open > state.config.limits.max_connections {
        // Refused: not counted as open while it lingers (its slot is not
        // taken from a client that comes once one frees).
        st.connections.fetch_sub(1, Relaxed);
        let e = ProtoError::new(
            ErrorCode::Busy,
            format!("{} connections are open (limits.max_connections); try again later", open - 1),
        );
        refuse(stream, e, REFUSE_LINGER).await;
        return;
    }
    // Set once this connection took itself out of the count to close for
    // idleness ([`read_header`]'s `may_close`): not counted out twice.
    let released = std::sync::atomic::AtomicBool::new(false);
    let _open = scopeguard(|| {
        if !released.load(Relaxed) {
            state.stats.connections.fetch_sub(1, Relaxed);
        }
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
    let (tx, rx) = mpsc::channel::<Answer>(256);
    let out: Out = Arc::new(tokio::sync::Mutex::new(BufWriter::with_capacity(1 << 16, wr)));
    let writer = tokio::spawn(write_answers(state.clone(), out.clone(), rx));
    let limits = &state.config.limits;
    let stall = Duration::from_secs(limits.body_stall_seconds.max(1));
    let idle = (limits.idle_seconds > 0).then(|| Duration::from_secs(limits.idle_seconds));
    let sem = Arc::new(Semaphore::new(limits.max_in_flight));
    // Idle means nothing running, while at least half the slots are taken:
    // a quiet client keeps its connection until others need the slots. The
    // count is taken down in the same step as the check, so that idle
    // connections timing out together close only until fewer than half
    // remain (each checked the count at once and all of them closed).
    let may_close = || {
        if sem.available_permits() < limits.max_in_flight {
            return false;
        }
        let half = limits.max_connections.div_ceil(2);
        let claimed = state.stats.connections.fetch_update(Relaxed, Relaxed, |n| (n >= half).then(|| n - 1)).is_ok();
        if claimed {
            released.store(true, Relaxed);
        }
        claimed
    };
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
                h = read_header(&mut rd, None, stall, || false) => h,
                _ = sem.acquire_many(limits.max_in_flight as u32) => break,
            }
        } else {
            tokio::select! {
                h = read_header(&mut rd, idle, stall, may_close) => h,
                _ = stop.changed() => {
                    draining = true;
                    continue;
                }
            }
        };
        let raw = match header {
            Ok(Some(h)) => h,
            Ok(None) => break,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                info!(reason = %e, "closing a connection (limits.idle_seconds, limits.body_stall_seconds)");
                break;
            }
            Err(e) => {
                debug!(error = %e, "connection closed mid-frame");
                break;
            }
        };
        let (h, refusal) = match admit(&raw, limits.max_frame_bytes, draining) {
            Ok(admitted) => admitted,
            Err(e) => {
                st.errors.fetch_add(1, Relaxed);
                let _ = tx.send((error_frame(0, hkv_proto::Op::Error.into(), e), None, None)).await;
                break;
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
                let _ = tx.send((error_frame(h.id, h.op, e), None, None)).await;
                let rest = h.body_len as u64 - read as u64;
                if let Err(e) = skip(&mut rd, rest, stall).await {
                    if e.kind() == std::io::ErrorKind::TimedOut {
                        info!(reason = %e, "closing a connection (limits.body_stall_seconds)");
                    } else {
                        debug!(error = %e, "connection closed inside a refused frame body");
                    }
                    break;
                }
                // The fds that came with the refused frame are closed.
                drop(conn.ctx(&h, frame_start));
                continue;
            }
        };
        let read = Instant::now();
        let mut ctx = conn.ctx(&h, frame_start);
        ctx.sequence(&h, &body);
        let Ok(permit) = sem.clone().acquire_owned().await else { break };
        let (state, tx, peer, out) = (state.clone(), tx.clone(), peer.clone(), out.clone());
        tokio::spawn(async move {
            // A bug hit by one request fails that request, with an answer:
            // its client is not left waiting, and the connection goes on.
            let served = AssertUnwindSafe(run(&state, &h, body, charge, &peer, ctx, read)).catch_unwind().await;
            let answer = served.unwrap_or_else(|p| {
                let why = crate::actor::panic_text(p.as_ref());
                tracing::error!(panic = %why, op = h.op, "a request's task panicked; it is answered internal");
                state.stats.errors.fetch_add(1, Relaxed);
                let e = ProtoError::new(
                    ErrorCode::Internal,
                    format!("the daemon failed serving this request ({why}); please report it"),
                );
                (error_frame(h.id, h.op, e), None, None)
            });
            // Written here when no other answer is being written (one
            // hand-off fewer), else queued for the writer task.
            match out.try_lock() {
                Ok(mut w) => {
                    let _ = write_now(&state, &mut w, answer).await;
                }
                Err(_) => {
                    let _ = tx.send(answer).await;
                }
            }
            drop(permit);
        });
    }
    // The peer is gone or done: its regions and events go now, its traces
    // end; then wait for its in-flight requests and let the writer finish.
    conn.close();
    let _ = sem.acquire_many(limits.max_in_flight as u32).await;
    drop(tx);
    let _ = writer.await;
}

/// The connection's writing half: an answer is written by its request's
/// task when no other is being written (`write_now`), else by the writer
/// task (`write_answers`).
type Out = Arc<tokio::sync::Mutex<BufWriter<OwnedWriteHalf>>>;

/// Writes one answer into `w` (unflushed): its frame goes back for reuse,
/// its bytes in flight are given back, its stamps (with when its write
/// began) kept in `timed` until the flush.
async fn put(
    state: &State,
    w: &mut BufWriter<OwnedWriteHalf>,
    f: Answer,
    timed: &mut Vec<(Stamps, Instant)>,
) -> std::io::Result<()> {
    let writing = Instant::now();
    w.write_all(f.0.bytes()).await?;
    state.router.frames.put(f.0);
    drop(f.1);
    timed.extend(f.2.map(|s| (s, writing)));
    Ok(())
}

/// Flushes `w`, then records the flushed answers' times (`stats.path`;
/// `queued`: they went through the writer task).
async fn flush(
    state: &State,
    w: &mut BufWriter<OwnedWriteHalf>,
    timed: &mut Vec<(Stamps, Instant)>,
    queued: bool,
) -> std::io::Result<()> {
    w.flush().await?;
    let written = Instant::now();
    for (s, writing) in timed.drain(..) {
        state.stats.path.request(&s, writing, written, queued);
    }
    Ok(())
}

/// Writes and flushes one answer (its stamps kept aside: no list to
/// allocate for one request).
async fn write_now(state: &State, w: &mut BufWriter<OwnedWriteHalf>, f: Answer) -> std::io::Result<()> {
    let (frame, charge, stamps) = f;
    let writing = Instant::now();
    put(state, w, (frame, charge, None), &mut Vec::new()).await?;
    flush(state, w, &mut Vec::new(), false).await?;
    if let Some(s) = stamps {
        state.stats.path.request(&s, writing, Instant::now(), false);
    }
    Ok(())
}

/// Writes the answers queued for it as they come: everything queued, then
/// a flush when nothing else is, so answers never linger.
async fn write_answers(state: Arc<State>, out: Out, mut rx: mpsc::Receiver<Answer>) {
    let mut timed: Vec<(Stamps, Instant)> = Vec::new();
    while let Some(mut f) = rx.recv().await {
        let mut w = out.lock().await;
        loop {
            if put(&state, &mut w, f, &mut timed).await.is_err() {
                return;
            }
            match rx.try_recv() {
                Ok(next) => f = next,
                Err(_) => break,
            }
        }
        if flush(&state, &mut w, &mut timed, true).await.is_err() {
            return;
        }
    }
    let _ = out.lock().await.flush().await;
}

/// The header of a frame whose body may be read, or of one to refuse
/// (oversized: its body is skipped unread; or sent while draining). An
/// `Err` is a header that cannot be decoded: the connection closes.
fn admit(
    raw: &[u8; HEADER_LEN],
    max_frame_bytes: u32,
    draining: bool,
) -> Result<(Header, Option<ProtoError>), ProtoError> {
    match check_frame(raw, max_frame_bytes)? {
        FrameCheck::Oversized(h) => {
            let e = ProtoError::new(
                ErrorCode::Oversized,
                format!(
                    "frame body of {} bytes is above limits.max_frame_bytes = {max_frame_bytes}; send smaller batches \
                     (hkvctl: --batch), or start hkvd with a larger --max-frame-bytes",
                    h.body_len
                ),
            );
            Ok((h, Some(e)))
        }
        FrameCheck::Ready(_) | FrameCheck::NeedMore => {
            let h = Header::decode(raw)?;
            let e = draining.then(|| {
                ProtoError::new(
                    ErrorCode::ShuttingDown,
                    "the daemon is shutting down: requests sent before it began are answered, this one is not run",
                )
            });
            Ok((h, e))
        }
    }
}

/// Runs one request, counted among those in flight, and frames its answer.
async fn run(
    state: &Arc<State>,
    h: &Header,
    body: Vec<u8>,
    charge: InFlight,
    peer: &Peer,
    ctx: crate::region::Ctx,
    read: Instant,
) -> Answer {
    let began = Instant::now();
    state.stats.in_flight.fetch_add(1, Relaxed);
    let (resp, answer) = handle(state, h, &body, peer, ctx).await;
    drop(body);
    drop(charge);
    state.stats.in_flight.fetch_sub(1, Relaxed);
    state.stats.requests.fetch_add(1, Relaxed);
    if matches!(resp, Response::Error(_)) {
        state.stats.errors.fetch_add(1, Relaxed);
    }
    let frame = resp.into_frame(h.op, h.id);
    (frame, answer, Some(Stamps { read, began, answered: Instant::now() }))
}

/// Reads and drops the `len` bytes left of a refused frame's body (its
/// answer was already sent), through a fixed buffer: nothing is allocated
/// or counted for them. A body that gets no byte for `stall` is a
/// `TimedOut` error, as one being read is ([`read_body`]): a peer that
/// announced 4 GiB and went silent held its slot for good, and eight such
/// held every slot of `--max-connections 8`.
async fn skip<R: AsyncReadExt + Unpin>(rd: &mut R, mut len: u64, stall: Duration) -> std::io::Result<()> {
    let mut drop = [0u8; 8192];
    while len > 0 {
        let room = drop.len().min(usize::try_from(len).unwrap_or(usize::MAX));
        match tokio::time::timeout(stall, rd.read(&mut drop[..room])).await {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(Ok(n)) => len -= n as u64,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the body of a refused frame stopped arriving",
                ))
            }
        }
    }
    Ok(())
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
                     (limits.max_bytes_in_flight = {limit}{}); this {len}-byte request was not run: \
                     retry, or send smaller batches",
                    state.stats.in_flight_bytes.load(Relaxed),
                    state.memory.describe()
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
