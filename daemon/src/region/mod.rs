//! Registered regions (`PROTOCOL.md`, "Registered regions"): memory a client
//! shares with the daemon, so that a request's arrays are named, not sent.
//!
//! - [`FdReader`] reads a connection with `recvmsg`, so that file
//!   descriptors sent with a frame's bytes (`SCM_RIGHTS`) are received and
//!   queued on the connection ([`Conn`]) instead of being lost.
//! - `register_memfd` takes the oldest fd queued for its frame, checks that it
//!   is a memfd sealed against shrinking and large enough, maps it
//!   ([`hkv_region::Mapping`]) and gives it an id on this connection only.
//! - `register_cuda` opens a CUDA IPC handle of a client's device
//!   allocation ([`hkv_shard::cuda::ipc::IpcMem`]) on a GPU the daemon
//!   serves; `register_cuda_event` an interprocess event, which region
//!   requests with the `EVENTS` flag wait on and record.
//! - Region requests ([`hkv_proto::region::RegionRequest`]) check every
//!   reference, read their inputs, claim their outputs (no other request of
//!   this process may write or read an overlapping range meanwhile), run,
//!   and write their outputs into the client's memory: find writes its rows
//!   there straight from the table, other ops through their usual answer
//!   arrays.
//!
//! Files: this one (the connection's regions and fds, a region's life,
//! dispatch), `fd` ([`FdReader`]), `register` (the register ops' checks,
//! mapping and opening), `vet` (IPC handles opened first by a separate
//! process, since the driver's open can kill the process on bad ones), `run` (region requests), `device` (region
//! requests served by the table's kernels in the client's device memory).
//!
//! A region is released when unregistered or when its connection closes,
//! but each request holds its regions (an `Arc`) until it is done: the
//! mapping, and its bytes in the counters, go with the last of them.

mod arrays;
mod device;
mod fd;
mod register;
mod run;
pub mod vet;

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use hkv_proto::region::{self as wire, RegionRequest};
use hkv_proto::{ErrorCode, FrameBuf, Header, ProtoError, Response, HEADER_LEN};
use hkv_region::Mapping;
use hkv_shard::cuda::ipc::{IpcEvent, IpcMem};
use parking_lot::Mutex;

use crate::state::State;

pub use fd::FdReader;

/// The statistics of registered regions.
pub fn stats(state: &State) -> hkv_proto::stats::RegionStats {
    hkv_proto::stats::RegionStats {
        max_region_bytes: state.config.limits.max_region_bytes,
        max_region_bytes_per_connection: state.config.limits.max_region_bytes_per_connection,
        regions: state.stats.regions.regions.load(Relaxed),
        bytes: state.stats.regions.bytes.load(Relaxed),
    }
}

/// File descriptors queued on one connection at most; more are closed as
/// they arrive (one register frame needs one; a client pipelining
/// registrations may have a few on the way). A connection thus holds at
/// most this many besides its socket, which `limits.max_connections` is
/// sized by ([`crate::server::fds_per_connection`]).
pub const MAX_QUEUED_FDS: usize = 4;

/// One connection's regions and received file descriptors.
#[derive(Default)]
pub struct Conn {
    /// Received fds, each with the stream offset just past the read that
    /// brought it (it came with a byte before that offset).
    fds: Mutex<VecDeque<(OwnedFd, u64)>>,
    regions: Mutex<HashMap<u32, Arc<Region>>>,
    /// Interprocess events (`register_cuda_event`), numbered with the regions.
    events: Mutex<HashMap<u32, Arc<IpcEvent>>>,
    /// Bytes of this connection's regions still mapped.
    bytes: Arc<AtomicU64>,
    next: AtomicU32,
    /// Set when the peer has gone away.
    gone: std::sync::atomic::AtomicBool,
    /// Wakes the requests waiting on [`Conn::gone`].
    gone_wake: tokio::sync::Notify,
    /// A request answered once queued (`device::early`) and refused when
    /// it ran: the error of the connection's first region request after.
    refused: Mutex<Option<ProtoError>>,
    /// Per event id: the records that region requests of this connection
    /// will make of it as their done event, in the order the frames were
    /// read ([`Ctx::sequence`]).
    records: Mutex<HashMap<u32, Records>>,
    /// Wakes the requests waiting for an earlier request's record.
    recorded_wake: tokio::sync::Notify,
    /// The tables this connection's requests named, each with which
    /// creation of it it was then ([`Conn::same_table`]).
    used: Mutex<HashMap<String, u64>>,
}

/// The records of one event that this connection's requests announced
/// (their frames named it as done event), and those finished.
#[derive(Default)]
struct Records {
    /// Records announced so far; the next request's ticket.
    announced: u64,
    /// Every ticket below this one is finished.
    done: u64,
    /// Tickets finished above `done`.
    above: std::collections::BTreeSet<u64>,
}

/// A request's place among the records of its done event: finished when
/// dropped (the request recorded the event, or ended without recording
/// it), which lets the requests that wait for that record go on.
pub struct RecordTicket {
    conn: Arc<Conn>,
    event: u32,
    n: u64,
}

impl Drop for RecordTicket {
    fn drop(&mut self) {
        let mut all = self.conn.records.lock();
        if let Some(r) = all.get_mut(&self.event) {
            r.above.insert(self.n);
            while r.above.remove(&r.done) {
                r.done += 1;
            }
        }
        drop(all);
        self.conn.recorded_wake.notify_waiters();
    }
}

impl Conn {
    /// The peer went away: its regions and events are released now (each
    /// request still running holds its own, released when it is done),
    /// and the requests that wait on time for it ([`Conn::gone`]: a
    /// trace) end early.
    pub fn close(&self) {
        self.gone.store(true, Relaxed);
        self.gone_wake.notify_waiters();
        self.fds.lock().clear();
        let regions = std::mem::take(&mut *self.regions.lock());
        let events = std::mem::take(&mut *self.events.lock());
        drop((regions, events));
    }

    /// Refuses, once, a request naming table `t` when the table this
    /// connection last used by that name was dropped and another created
    /// under it since (by another connection): a client that learned the
    /// old one's dim and optimizer would read the new one's rows as
    /// those (a tester's training module read a re-made table's optimizer
    /// state as values, the row width being the same). The next request
    /// runs on the new table. Tables this connection created or dropped
    /// itself are known to it ([`Conn::made_table`]).
    pub fn same_table(&self, t: &crate::router::Table) -> Result<(), ProtoError> {
        let name = &t.spec.name;
        let mut used = self.used.lock();
        let was = match used.get_mut(name.as_str()) {
            Some(made) => std::mem::replace(made, t.made()),
            None => {
                used.insert(name.clone(), t.made());
                return Ok(());
            }
        };
        if was == t.made() {
            return Ok(());
        }
        Err(err(
            ErrorCode::UnknownTable,
            format!(
                "table {name:?} was dropped and created again since this connection last used it; nothing of this \
                 request was run. Its spec, rows and optimizer state are the new table's: learn them again (a \
                 training module: make a new one), then send the request again"
            ),
        ))
    }

    /// This connection created table `name` (`Some` of its
    /// [`Table::made`](crate::router::Table::made)) or dropped it (`None`).
    pub fn made_table(&self, name: &str, made: Option<u64>) {
        let mut used = self.used.lock();
        match made {
            Some(made) => {
                used.insert(name.to_string(), made);
            }
            None => {
                used.remove(name);
            }
        }
    }

    /// Whether the peer has gone away ([`Conn::close`]).
    pub fn is_gone(&self) -> bool {
        self.gone.load(Relaxed)
    }

    /// Resolves once the peer has gone away ([`Conn::close`]).
    pub async fn gone(&self) {
        loop {
            let woken = self.gone_wake.notified();
            if self.gone.load(Relaxed) {
                return;
            }
            woken.await;
        }
    }

    fn push_fd(&self, fd: OwnedFd, end: u64) {
        let mut q = self.fds.lock();
        if q.len() < MAX_QUEUED_FDS {
            q.push_back((fd, end));
        }
    }

    /// What the frame with header `h`, which started at stream offset
    /// `start`, takes from its connection, in the order frames are read:
    /// fds that came before it (with earlier frames) are closed, and a
    /// `register_memfd` frame takes the oldest one left; a region request
    /// holds the connection's regions as they are now, so that an
    /// `unregister` read after it cannot overtake it.
    ///
    /// Fds that came with this frame's bytes and that it does not take
    /// are closed now, not when the next frame arrives: a client sending
    /// pings with fds attached, and then nothing, held them for good.
    pub fn ctx(self: &Arc<Self>, h: &Header, start: u64) -> Ctx {
        let mut q = self.fds.lock();
        while q.front().is_some_and(|&(_, end)| end <= start) {
            q.pop_front();
        }
        let fd = if h.op == wire::REGISTER_MEMFD { q.pop_front().map(|(fd, _)| fd) } else { None };
        let frame_end = start + HEADER_LEN as u64 + u64::from(h.body_len);
        while q.front().is_some_and(|&(_, end)| end <= frame_end) {
            q.pop_front();
        }
        drop(q);
        let regions = wire::is_region(h).then(|| self.regions.lock().clone());
        let events = regions.is_some().then(|| self.events.lock().clone());
        Ctx { conn: self.clone(), fd, regions, events, after: None, ticket: None, unregistered: None }
    }

    /// Resolves once the first `need` records of `event` announced on this
    /// connection are finished (or the peer has gone away).
    async fn recorded(&self, event: u32, need: u64) {
        loop {
            let woken = self.recorded_wake.notified();
            let done = self.records.lock().get(&event).is_none_or(|r| r.done >= need);
            if done || self.is_gone() {
                return;
            }
            tokio::select! {
                _ = woken => {}
                _ = self.gone() => return,
            }
        }
    }

    /// A new id, for a region or an event.
    fn next_id(&self) -> u32 {
        self.next.fetch_add(1, Relaxed).wrapping_add(1)
    }
}

/// What a request of a connection brings to [`answer`].
pub struct Ctx {
    /// Its connection.
    pub conn: Arc<Conn>,
    /// The fd that came with a `register_memfd` frame.
    pub fd: Option<OwnedFd>,
    /// The connection's regions when the frame was read (region requests).
    regions: Option<HashMap<u32, Arc<Region>>>,
    /// Its events then (region requests).
    events: Option<HashMap<u32, Arc<IpcEvent>>>,
    /// Its wait event and how many of its records, announced by earlier
    /// requests of the connection, must be finished before it is polled.
    after: Option<(u32, u64)>,
    /// Its place among its done event's records.
    ticket: Option<RecordTicket>,
    /// An `unregister`'s id and what it took off the connection when its
    /// frame was read ([`Ctx::sequence`]).
    unregistered: Option<(u32, Taken)>,
}

/// What an `unregister` took off its connection: the region, or whether
/// an event of that id was there.
struct Taken {
    region: Option<Arc<Region>>,
    event: bool,
}

impl Taken {
    /// Takes region (or event) `id` off `conn`.
    fn from(conn: &Conn, id: u32) -> Taken {
        let region = conn.regions.lock().remove(&id);
        let event = region.is_none() && conn.events.lock().remove(&id).is_some();
        Taken { region, event }
    }
}

impl Ctx {
    /// Gives the request its place among the connection's requests (call
    /// in the order frames are read, before any is run).
    ///
    /// An `unregister` takes its region (or event) off the connection now,
    /// not when its task runs: the requests read after it then hold the
    /// regions without it ([`Conn::ctx`]) and are answered `not_found`
    /// for it, as PROTOCOL.md says. Taken when the task ran, a find sent
    /// in the same write as the unregister before it was run on the
    /// region (100 times of 100).
    ///
    /// A region request's events are ordered with those of the requests
    /// read before it: a request whose wait event is the done event of
    /// earlier requests still running polls it only once they recorded it,
    /// so a client may send a request that follows another's writes
    /// without waiting for that one's answer (PROTOCOL.md, "Events").
    pub fn sequence(&mut self, h: &Header, body: &[u8]) {
        if h.op == wire::UNREGISTER {
            // A body that does not decode takes nothing: its task answers the error.
            if let Ok(id) = wire::decode_small(h, body) {
                self.unregistered = Some((id as u32, Taken::from(&self.conn, id as u32)));
            }
            return;
        }
        if self.regions.is_none() || h.flags & wire::EVENTS == 0 || body.len() < 8 {
            return;
        }
        let at = body.len() - 8;
        let word = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().expect("4 bytes"));
        let (wait, done) = (word(at), word(at + 4));
        let mut all = self.conn.records.lock();
        if wait != 0 {
            if let Some(r) = all.get(&wait).filter(|r| r.done < r.announced) {
                self.after = Some((wait, r.announced));
            }
        }
        if done != 0 {
            let r = all.entry(done).or_default();
            self.ticket = Some(RecordTicket { conn: self.conn.clone(), event: done, n: r.announced });
            r.announced += 1;
        }
    }
}

/// A registered region; unmapped (closed), and counted out, when the last
/// holder drops it.
pub struct Region {
    mem: Mem,
    len: u64,
    conn_bytes: Arc<AtomicU64>,
    state: Arc<State>,
}

/// A region's memory.
enum Mem {
    /// A client's memfd, mapped.
    Host {
        /// On the CUDA backend, the mapping page-locked (dropped first:
        /// fields drop in order, and the pin unregisters before the mapping
        /// can go).
        pin: Option<hkv_shard::pin::HostPin>,
        map: Arc<Mapping>,
    },
    /// A client's device allocation, opened from its IPC handle.
    Device(Arc<IpcMem>),
}

impl Region {
    /// The mapping of a memfd region.
    fn host(&self) -> Option<&Arc<Mapping>> {
        match &self.mem {
            Mem::Host { map, .. } => Some(map),
            Mem::Device(_) => None,
        }
    }

    /// The allocation of a CUDA region.
    fn device(&self) -> Option<&Arc<IpcMem>> {
        match &self.mem {
            Mem::Device(m) => Some(m),
            Mem::Host { .. } => None,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.conn_bytes.fetch_sub(self.len, Relaxed);
        self.state.stats.regions.bytes.fetch_sub(self.len, Relaxed);
        self.state.stats.regions.regions.fetch_sub(1, Relaxed);
    }
}

fn err(code: ErrorCode, msg: impl Into<String>) -> ProtoError {
    ProtoError::new(code, msg)
}

/// Answers a frame that [`wire::is_region`] claims.
pub async fn answer(state: &Arc<State>, ctx: Ctx, h: &Header, body: &[u8]) -> Result<Response, ProtoError> {
    let frame = match h.op {
        wire::REGISTER_MEMFD => {
            let len = wire::decode_small(h, body)?;
            let (id, len) = register::register(state, &ctx, len)?;
            wire::registered(h.id, id, len)
        }
        wire::REGISTER_CUDA => {
            let reg = wire::CudaRegistration::decode(body, false)?;
            let (id, len) = register::register_cuda(state, &ctx, reg).await?;
            wire::registered_cuda(h.id, id, len)
        }
        wire::REGISTER_CUDA_EVENT => {
            let reg = wire::CudaRegistration::decode(body, true)?;
            let id = register::register_event(state, &ctx, reg).await?;
            wire::registered_event(h.id, id)
        }
        wire::UNREGISTER => {
            // Taken off the connection when the frame was read (`Ctx::sequence`).
            let (id, taken) = match ctx.unregistered {
                Some(t) => t,
                None => {
                    let id = wire::decode_small(h, body)? as u32;
                    (id, Taken::from(&ctx.conn, id))
                }
            };
            let Taken { region, event } = taken;
            if region.is_none() && !event {
                return Err(not_registered(id));
            }
            // A device region's handle is closed off the executor (the
            // driver may wait for work in flight on it).
            if let Some(r) = region.filter(|r| r.device().is_some()) {
                let _ = tokio::task::spawn_blocking(move || drop(r)).await;
            }
            hkv_proto::frame(wire::UNREGISTER, hkv_proto::flags::RESPONSE, h.id, &[])
        }
        _ => {
            let req = RegionRequest::decode(h, body)?;
            let none = HashMap::new();
            let regions = ctx.regions.as_ref().unwrap_or(&none);
            run::run(state, &ctx.conn, regions, ctx.events.as_ref(), ctx.after, req).await?.encode(h.op, h.id)
        }
    };
    Ok(Response::Framed(FrameBuf::Vec(frame)))
}

fn not_event(id: u32) -> ProtoError {
    err(
        ErrorCode::NotFound,
        format!("event {id} is not registered on this connection (register it with register_cuda_event first)"),
    )
}

fn not_registered(id: u32) -> ProtoError {
    err(
        ErrorCode::NotFound,
        format!(
            "region {id} is not registered on this connection (regions belong to the connection that \
             registered them, until unregistered or closed)"
        ),
    )
}
