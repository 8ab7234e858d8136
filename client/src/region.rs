//! Registered regions (`proto/PROTOCOL.md`, "Registered regions"): memory
//! this process shares with hkvd, so that requests name their arrays
//! instead of sending them and answers carry only counts.
//!
//! ```no_run
//! # fn main() -> hkv_client::Result<()> {
//! let mut c = hkv_client::Client::connect("/run/user/1000/hkvd/hkvd.sock")?;
//! let (n, dim) = (1024u64, 32u64);
//! // keys, then found flags, then values: one region for all three.
//! let r = c.register_memfd(n * 8 + n + n * dim * 4)?;
//! let keys: Vec<u64> = (1..=n).collect();
//! r.write(0, &keys)?;
//! let hits = c.find_in("emb", r.at::<u64>(0, n), r.at::<u8>(n * 8, n), r.at::<f32>(n * 9, n * dim))?;
//! let mut row = vec![0f32; dim as usize];
//! r.read(n * 9, &mut row)?; // key 1's values
//! # Ok(()) }
//! ```
//!
//! The daemon writes outputs while a call is in progress and never after
//! its answer: reuse or read the arrays once the call returned (with
//! [`Client::send_region`], once its answer was received).
//!
//! Device memory registers the same way through CUDA IPC
//! ([`Client::register_cuda`], a [`CudaRegion`]); its references are
//! ordinary [`RegionRef`]s, so [`Client::find_in`], [`Client::write_in`]
//! and the others take either kind (the arrays of one request must all lie
//! in memfd regions or all in device regions). A request can carry
//! interprocess events ([`with_events`], [`Client::register_cuda_event`])
//! so that the daemon's stream waits for the client's writes on the GPU.

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use hkv_proto::region::{self as wire, CudaRegistration, Head, RegionAnswer, RegionRef, RegionRequest};
use hkv_proto::{Header, Op, Response, Summary, HEADER_LEN};
use hkv_region::cuda::{IpcEvent, MemExport};
use hkv_region::Mapping;
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::{io, Client, ClientError, Result};

/// A memfd registered on one connection and mapped in this process.
pub struct Region {
    id: u32,
    len: u64,
    map: Arc<Mapping>,
    _fd: OwnedFd,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("id", &self.id).field("len", &self.len).finish()
    }
}

fn claim(e: hkv_region::ClaimError) -> ClientError {
    ClientError::Protocol(format!("region access refused: {e:?} (past the end, misaligned, or in use)"))
}

impl Region {
    /// The id the daemon gave it (valid on its connection only).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds no byte (never: registration refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A reference to `count` elements of `T` from byte `offset`.
    pub fn at<T>(&self, offset: u64, count: u64) -> RegionRef {
        let _ = std::marker::PhantomData::<T>;
        RegionRef::new(self.id, offset, count)
    }

    /// Copies `src` into the region at byte `offset`.
    pub fn write<T: IntoBytes + Immutable>(&self, offset: u64, src: &[T]) -> Result<()> {
        self.map.write(offset, src).map_err(claim)
    }

    /// Copies from the region at byte `offset` into `dst`.
    pub fn read<T: FromBytes + IntoBytes>(&self, offset: u64, dst: &mut [T]) -> Result<()> {
        self.map.read(offset, dst).map_err(claim)
    }

    /// The mapping (for claimed slices of it, see `hkv_region`).
    pub fn mapping(&self) -> &Arc<Mapping> {
        &self.map
    }
}

/// Device memory registered on one connection through CUDA IPC
/// ([`Client::register_cuda`]): the allocation holding a device pointer,
/// registered from its base. References made with [`CudaRegion::at`] count
/// from the pointer given at registration, not from the allocation's base.
#[derive(Debug, Clone)]
pub struct CudaRegion {
    id: u32,
    len: u64,
    export: MemExport,
}

impl CudaRegion {
    /// The id the daemon gave it (valid on its connection only).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes registered, from the allocation's base.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds no byte (never: registration refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation as exported: device UUID, IPC handle, base, size, and
    /// the registered pointer's offset from the base.
    pub fn export(&self) -> &MemExport {
        &self.export
    }

    /// A reference to `count` elements of `T` from byte `offset` past the
    /// pointer given to [`Client::register_cuda`] (its offset in the
    /// allocation added). Not checked here: the daemon checks every
    /// reference against the registered length.
    pub fn at<T>(&self, offset: u64, count: u64) -> RegionRef {
        let _ = std::marker::PhantomData::<T>;
        RegionRef::new(self.id, self.export.offset.wrapping_add(offset), count)
    }
}

/// `req` with the `EVENTS` flag: the daemon waits for event `wait` (0:
/// none) before it reads the request's arrays, and records event `done`
/// (0: none) once its writes into them are enqueued. Both are ids from
/// [`Client::register_cuda_event`] on the same connection.
///
/// A stream that waits on `done` waits for the daemon's last record of it
/// *made before the wait call* (`cuStreamWaitEvent`): wait on it once the
/// answer arrived (or once something else told the client that the
/// daemon recorded it), not right after sending.
pub fn with_events(mut req: RegionRequest, wait: u32, done: u32) -> RegionRequest {
    req.events = Some((wait, done));
    req
}

impl Client {
    /// Registers device memory through CUDA IPC: the allocation holding
    /// device pointer `ptr` is exported ([`hkv_region::cuda::export_memory`],
    /// so a CUDA context must be current on the calling thread) and
    /// registered from its base, with `offset + len` bytes (`offset` =
    /// `ptr` − base): exactly what reaches the end of `[ptr, ptr + len)`, so
    /// the caps count what the client asked for, not the rest of a larger
    /// allocation (PyTorch's caching allocator hands out tensors inside
    /// big segments). [`CudaRegion::at`] then counts offsets from `ptr`.
    ///
    /// The daemon must run the CUDA backend and serve the allocation's GPU,
    /// and must be another process (a handle does not open in the process
    /// that exported it). `len` must be at least 1 and `[ptr, ptr + len)`
    /// within the allocation (checked before anything is sent).
    pub fn register_cuda(&mut self, ptr: u64, len: u64) -> Result<CudaRegion> {
        let export = hkv_region::cuda::export_memory(ptr)?;
        let reg = export.offset.checked_add(len).filter(|&end| len >= 1 && end <= export.size).ok_or_else(|| {
            ClientError::Request(hkv_proto::ProtoError::bad_request(format!(
                "register_cuda: {len} bytes from 0x{ptr:x} (offset {} in its allocation) do not fit the {}-byte allocation at 0x{:x}; register 1 to {} bytes",
                export.offset,
                export.size,
                export.base,
                export.size - export.offset
            )))
        })?;
        let (id, len) =
            self.register_cuda_raw(&CudaRegistration { uuid: export.uuid, handle: export.handle, len: reg })?;
        Ok(CudaRegion { id, len, export })
    }

    /// Sends `register_cuda` with any UUID, handle and length (the daemon
    /// decides); returns the region id and the length registered.
    pub fn register_cuda_raw(&mut self, reg: &CudaRegistration) -> Result<(u32, u64)> {
        let id = self.next_id;
        self.next_id += 1;
        self.w.write_all(&reg.encode(id, false)).map_err(io("sending register_cuda"))?;
        let (h, body) = self.recv_frame()?;
        check_id(&h, id)?;
        wire::decode_registered(&body).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Registers an interprocess event for requests [`with_events`];
    /// returns its id (released by [`Client::unregister`] or with the
    /// connection).
    pub fn register_cuda_event(&mut self, event: &IpcEvent) -> Result<u32> {
        self.register_cuda_event_raw(&CudaRegistration { uuid: event.uuid(), handle: event.handle(), len: 0 })
    }

    /// Sends `register_cuda_event` with any UUID and handle (`len` is not
    /// sent); returns the event id.
    pub fn register_cuda_event_raw(&mut self, reg: &CudaRegistration) -> Result<u32> {
        let id = self.next_id;
        self.next_id += 1;
        self.w.write_all(&reg.encode(id, true)).map_err(io("sending register_cuda_event"))?;
        let (h, body) = self.recv_frame()?;
        check_id(&h, id)?;
        wire::decode_registered_event(&body).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Creates a sealed memfd of `len` bytes, maps it, and registers it on
    /// this connection.
    pub fn register_memfd(&mut self, len: u64) -> Result<Region> {
        let fd = hkv_region::create_memfd("hkvd-region", len).map_err(io("creating a memfd"))?;
        let map = Mapping::map(&fd, len as usize).map_err(io("mapping a memfd"))?;
        let id = self.register_fd(fd.as_fd(), len)?;
        Ok(Region { id, len, map, _fd: fd })
    }

    /// Sends `register_memfd` with `fd` (any fd: the daemon decides) and
    /// returns the region id.
    pub fn register_fd(&mut self, fd: std::os::fd::BorrowedFd<'_>, len: u64) -> Result<u32> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let id = self.next_id;
        self.next_id += 1;
        let frame = wire::register_memfd(id, len);
        let fds = [fd];
        let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        anc.push(SendAncillaryMessage::ScmRights(&fds));
        let sent = rustix::net::sendmsg(&self.w, &[IoSlice::new(&frame)], &mut anc, SendFlags::NOSIGNAL)
            .map_err(|e| io("sending register_memfd")(e.into()))?;
        self.w.write_all(&frame[sent..]).map_err(io("sending register_memfd"))?;
        let (h, body) = self.recv_frame()?;
        check_id(&h, id)?;
        wire::decode_registered(&body).map(|(r, _)| r).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Unregisters a region (the daemon unmaps it once its requests in
    /// flight are done): a memfd or a device region, or an event.
    pub fn unregister(&mut self, region: u32) -> Result<()> {
        let id = self.next_id;
        self.next_id += 1;
        self.w.write_all(&wire::unregister(id, region)).map_err(io("sending unregister"))?;
        let (h, _) = self.recv_frame()?;
        check_id(&h, id)
    }

    /// Reads one answer frame whole, whatever it answers (region answers
    /// and others pipelined with them); error frames become
    /// [`ClientError::Daemon`].
    pub fn recv_frame(&mut self) -> Result<(Header, Vec<u8>)> {
        let mut h = [0u8; HEADER_LEN];
        self.r.read_exact(&mut h).map_err(io("reading a response header"))?;
        let h = Header::decode(&h).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let mut body = vec![0u8; h.body_len as usize];
        self.r.read_exact(&mut body).map_err(io("reading a response body"))?;
        if h.op == u8::from(Op::Error) {
            if let Ok(Response::Error(e)) = Response::decode(&h, &body) {
                return Err(ClientError::Daemon(e));
            }
            return Err(ClientError::Protocol("undecodable error frame".into()));
        }
        Ok((h, body))
    }

    /// Sends a region request without waiting; returns its id.
    pub fn send_region(&mut self, req: &RegionRequest) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.w.write_all(&req.encode(id)).map_err(io("sending a region request"))?;
        Ok(id)
    }

    /// Receives the next answer to a region request of op `req_op`.
    pub fn recv_region(&mut self, req_op: u8) -> Result<(u64, RegionAnswer)> {
        let (h, body) = self.recv_frame()?;
        let a = RegionAnswer::decode(req_op, &body).map_err(|e| ClientError::Protocol(e.to_string()))?;
        Ok((h.id, a))
    }

    /// Sends a region request and waits for its answer.
    pub fn region_call(&mut self, req: &RegionRequest) -> Result<RegionAnswer> {
        let id = self.send_region(req)?;
        let (got, a) = self.recv_region(req.op)?;
        if got != id {
            return Err(ClientError::Protocol(format!("answer to request {got} while waiting for {id}")));
        }
        Ok(a)
    }

    /// find with every array in regions: `keys` (n u64), `found` (n bytes,
    /// 1/0), `values` (n × dim f32, misses 0.0). Returns the hits.
    pub fn find_in(&mut self, table: &str, keys: RegionRef, found: RegionRef, values: RegionRef) -> Result<u64> {
        let req = keyed(u8::from(Op::Find), table, vec![keys, found, values], false, false);
        count(self.region_call(&req)?)
    }

    /// contains: `found` (n bytes). Returns the keys present.
    pub fn contains_in(&mut self, table: &str, keys: RegionRef, found: RegionRef) -> Result<u64> {
        count(self.region_call(&keyed(u8::from(Op::Contains), table, vec![keys, found], false, false))?)
    }

    /// A write op (insert_or_assign, find_or_insert, assign, accum_or_assign,
    /// load) with its arrays in regions: `values` (n × dim; written back by
    /// find_or_insert), optional `scores` (n u64) and `outcomes` (n bytes).
    pub fn write_in(
        &mut self,
        code: u8,
        table: &str,
        keys: RegionRef,
        values: RegionRef,
        scores: Option<RegionRef>,
        outcomes: Option<RegionRef>,
    ) -> Result<Summary> {
        let mut refs = vec![keys, values];
        refs.extend(scores);
        refs.extend(outcomes);
        let req = keyed(code, table, refs, scores.is_some(), outcomes.is_some());
        match self.region_call(&req)? {
            RegionAnswer::Write(s) | RegionAnswer::Evict(s, _) => Ok(s),
            a => Err(ClientError::Protocol(format!("unexpected answer {a:?}"))),
        }
    }

    /// insert_or_assign with its arrays in regions.
    pub fn insert_or_assign_in(
        &mut self,
        table: &str,
        keys: RegionRef,
        values: RegionRef,
        scores: Option<RegionRef>,
    ) -> Result<Summary> {
        self.write_in(u8::from(Op::InsertOrAssign), table, keys, values, scores, None)
    }

    /// erase; `erased` (n bytes) when given. Returns the count erased.
    pub fn erase_in(&mut self, table: &str, keys: RegionRef, erased: Option<RegionRef>) -> Result<u64> {
        let mut refs = vec![keys];
        refs.extend(erased);
        count(self.region_call(&keyed(u8::from(Op::Erase), table, refs, false, erased.is_some()))?)
    }
}

/// A keyed region request (no head).
pub fn keyed(code: u8, table: &str, refs: Vec<RegionRef>, scores: bool, outcomes: bool) -> RegionRequest {
    RegionRequest { op: code, scores, outcomes, table: table.into(), head: Head::None, refs, events: None }
}

fn count(a: RegionAnswer) -> Result<u64> {
    match a {
        RegionAnswer::Count(c) => Ok(c),
        a => Err(ClientError::Protocol(format!("unexpected answer {a:?}"))),
    }
}

fn check_id(h: &Header, id: u64) -> Result<()> {
    if h.id != id {
        return Err(ClientError::Protocol(format!("answer to request {} while waiting for {id}", h.id)));
    }
    Ok(())
}

impl Client {
    /// Keeps `pipeline` region requests in flight until `time` has passed,
    /// then waits for those still due; returns the requests answered and
    /// the seconds taken (`hkvctl bench --transport shm`). `make(slot)`
    /// builds a request whose outputs lie in output area `slot` (0 to
    /// `pipeline` − 1): a slot is given again only once the request that
    /// used it was answered, so outputs in flight never overlap.
    pub fn keep_busy_region(
        &mut self,
        pipeline: usize,
        time: std::time::Duration,
        make: &mut dyn FnMut(usize) -> RegionRequest,
    ) -> Result<(u64, f64)> {
        self.keep_busy_region_then(pipeline, time, make, &mut || Ok(()))
    }

    /// [`Client::keep_busy_region`], running `answered` after each answer
    /// before the request counts as done and its slot is reused (such as a
    /// wait for the request's done event, when the daemon answers before
    /// its kernels ran).
    pub fn keep_busy_region_then(
        &mut self,
        pipeline: usize,
        time: std::time::Duration,
        make: &mut dyn FnMut(usize) -> RegionRequest,
        answered: &mut dyn FnMut() -> Result<()>,
    ) -> Result<(u64, f64)> {
        let start = std::time::Instant::now();
        let pipeline = pipeline.max(1);
        let mut slots = std::collections::HashMap::new();
        let mut code = u8::from(Op::Find);
        for slot in 0..pipeline {
            let req = make(slot);
            code = req.op;
            slots.insert(self.send_region(&req)?, slot);
        }
        let mut done = 0u64;
        while !slots.is_empty() {
            let (id, _) = self.recv_region(code)?;
            let slot =
                slots.remove(&id).ok_or_else(|| ClientError::Protocol(format!("answer to unknown request {id}")))?;
            answered()?;
            done += 1;
            if start.elapsed() < time {
                slots.insert(self.send_region(&make(slot))?, slot);
            }
        }
        Ok((done, start.elapsed().as_secs_f64()))
    }
}

/// `hkvctl bench --transport shm,cuda-ipc`: find and insert_or_assign
/// with every array in a region registered by each client connection: a
/// memfd (`shm`), or device memory on GPU 0 registered through CUDA IPC
/// (`cuda-ipc`).
pub mod bench {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;

    use hkv_proto::region::{RegionRef, RegionRequest};
    use hkv_proto::Op;
    use hkv_region::cuda::cudarc::driver::{CudaContext, CudaStream};
    use hkv_region::cuda::{CudaError, DeviceAlloc, IpcEvent};
    use rand::Rng;
    use zerocopy::{Immutable, IntoBytes};

    use super::{keyed, with_events, CudaRegion, Region};
    use crate::{Client, Result};

    /// What one figure runs.
    #[derive(Debug, Clone)]
    pub struct Plan {
        /// Table (filled with keys 1..=resident).
        pub table: String,
        /// Its dim.
        pub dim: usize,
        /// Keys per request.
        pub batch: usize,
        /// Keys drawn from 1..=resident.
        pub resident: u64,
        /// Requests in flight per connection.
        pub pipeline: usize,
        /// Untimed seconds first.
        pub warmup: f64,
        /// Timed seconds.
        pub seconds: f64,
        /// With [`Transport::CudaIpc`]: each request names a done event
        /// (`EVENTS`), which the daemon records after the request's work
        /// and, on a table of one shard, answers before that work ran; a
        /// request then counts as done once its answer arrived and the
        /// event completed (`cuEventSynchronize`), as a client that reads
        /// the outputs on the host would wait.
        pub done_event: bool,
    }

    /// Where each connection's arrays live.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Transport {
        /// A sealed memfd (`register_memfd`).
        Shm,
        /// Device memory on GPU 0 of this process, allocated with
        /// `cuMemAlloc` ([`DeviceAlloc`]) and registered through CUDA IPC
        /// (`register_cuda`).
        CudaIpc,
    }

    /// Checks that `transport` can run here: for [`Transport::CudaIpc`], a
    /// CUDA driver with a device (else the reason, one line).
    pub fn check(transport: Transport) -> Result<()> {
        if transport == Transport::CudaIpc {
            hkv_region::cuda::available()?;
        }
        Ok(())
    }

    /// Keys per second of find and of insert_or_assign over `clients`
    /// connections at once, each with its own region: `pipeline + 1` key
    /// sets (random resident keys), `pipeline` output areas (found and
    /// values), one values array for the inserts.
    pub fn measure(socket: &Path, clients: usize, p: &Plan, transport: Transport) -> Result<(f64, f64)> {
        let (find, insert) = measure_ops(socket, clients, p, transport, true, true)?;
        Ok((find.unwrap_or(f64::NAN), insert.unwrap_or(f64::NAN)))
    }

    /// [`measure`] of the ops asked for only (`None` for one not measured).
    pub fn measure_ops(
        socket: &Path,
        clients: usize,
        p: &Plan,
        transport: Transport,
        find: bool,
        insert: bool,
    ) -> Result<(Option<f64>, Option<f64>)> {
        check(transport)?;
        let run = |insert: bool| across_threads(clients, &|| one(socket, p, insert, transport));
        Ok((find.then(|| run(false)).transpose()?, insert.then(|| run(true)).transpose()?))
    }

    /// Runs `run` on `clients` threads at once, each returning the keys it
    /// moved and the seconds it took; keys per second over all of them (the
    /// slowest thread's time). Shared by every transport's benchmark.
    pub fn across_threads<E: Send>(
        clients: usize,
        run: &(dyn Fn() -> std::result::Result<(u64, f64), E> + Sync),
    ) -> std::result::Result<f64, E> {
        let results: Vec<std::result::Result<(u64, f64), E>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..clients).map(|_| s.spawn(run)).collect();
            hs.into_iter().map(|h| h.join().expect("bench thread")).collect()
        });
        let (mut keys, mut secs) = (0u64, 0f64);
        for r in results {
            let (k, s) = r?;
            keys += k;
            secs = secs.max(s);
        }
        Ok(keys as f64 / secs)
    }

    /// One connection's registered memory.
    enum Mem {
        Shm(Region),
        /// The region, then the allocation it names (dropped after the
        /// region is unregistered) and the stream that fills it.
        Cuda(CudaRegion, DeviceAlloc, Arc<CudaStream>),
    }

    impl Mem {
        fn new(c: &mut Client, transport: Transport, len: u64) -> Result<Mem> {
            Ok(match transport {
                Transport::Shm => Mem::Shm(c.register_memfd(len)?),
                Transport::CudaIpc => {
                    let driver = |call| {
                        move |e: hkv_region::cuda::cudarc::driver::DriverError| CudaError::Driver { call, result: e.0 }
                    };
                    let ctx = CudaContext::new(0).map_err(driver("creating a context on GPU 0"))?;
                    let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
                    let alloc = DeviceAlloc::new(&ctx, len as usize)?;
                    let r = c.register_cuda(alloc.ptr(), len)?;
                    Mem::Cuda(r, alloc, stream)
                }
            })
        }

        fn write<T: IntoBytes + Immutable>(&self, offset: u64, src: &[T]) -> Result<()> {
            match self {
                Mem::Shm(r) => r.write(offset, src),
                Mem::Cuda(_, a, s) => Ok(a.write(s, offset, src)?),
            }
        }

        fn at<T>(&self, offset: u64, count: u64) -> RegionRef {
            match self {
                Mem::Shm(r) => r.at::<T>(offset, count),
                Mem::Cuda(r, ..) => r.at::<T>(offset, count),
            }
        }

        fn id(&self) -> u32 {
            match self {
                Mem::Shm(r) => r.id(),
                Mem::Cuda(r, ..) => r.id(),
            }
        }
    }

    fn one(socket: &Path, p: &Plan, insert: bool, transport: Transport) -> Result<(u64, f64)> {
        let mut c = Client::connect(socket)?;
        let (n, dim) = (p.batch as u64, p.dim as u64);
        let sets = p.pipeline.max(1) as u64 + 1;
        let keys_bytes = n * 8;
        // Each output area: n found bytes, padded to 8, then n × dim floats.
        let found_bytes = n.next_multiple_of(8);
        let area = found_bytes + n * dim * 4;
        let outputs = sets * keys_bytes;
        let len = outputs + p.pipeline.max(1) as u64 * area;
        let r = Mem::new(&mut c, transport, len)?;
        let mut rng = rand::thread_rng();
        for s in 0..sets {
            let keys: Vec<u64> = (0..n).map(|_| rng.gen_range(1..=p.resident)).collect();
            r.write(s * keys_bytes, &keys)?;
        }
        // The inserts read their values from the first output area.
        r.write(outputs + found_bytes, &vec![1.5f32; (n * dim) as usize])?;
        let mut sent = 0u64;
        let mut make = |slot: usize| -> RegionRequest {
            let k = r.at::<u64>((sent % sets) * keys_bytes, n);
            sent += 1;
            let base = outputs + slot as u64 * area;
            if insert {
                keyed(
                    u8::from(Op::InsertOrAssign),
                    &p.table,
                    vec![k, r.at::<f32>(outputs + found_bytes, n * dim)],
                    false,
                    false,
                )
            } else {
                keyed(
                    u8::from(Op::Find),
                    &p.table,
                    vec![k, r.at::<u8>(base, n), r.at::<f32>(base + found_bytes, n * dim)],
                    false,
                    false,
                )
            }
        };
        let event = match (&r, p.done_event) {
            (Mem::Cuda(_, _, stream), true) => {
                let e = IpcEvent::new(stream.context())?;
                let id = c.register_cuda_event(&e)?;
                Some((e, id))
            }
            _ => None,
        };
        let mut make = |slot: usize| match &event {
            Some((_, id)) => with_events(make(slot), 0, *id),
            None => make(slot),
        };
        let mut answered = || match &event {
            Some((e, _)) => Ok(e.synchronize()?),
            None => Ok(()),
        };
        c.keep_busy_region_then(p.pipeline, Duration::from_secs_f64(p.warmup), &mut make, &mut answered)?;
        let (done, secs) =
            c.keep_busy_region_then(p.pipeline, Duration::from_secs_f64(p.seconds), &mut make, &mut answered)?;
        c.unregister(r.id())?;
        Ok((done * n, secs))
    }
}
