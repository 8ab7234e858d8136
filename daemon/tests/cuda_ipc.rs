//! Device regions over CUDA IPC, with a real daemon process: the test
//! process owns the device memory (a CUDA IPC handle does not open in the
//! process that exported it, so the daemon is always another process) and
//! registers it with `register_cuda`; region requests through it give the
//! socket's answers; bad handles, UUIDs, lengths and references are refused
//! with their reason; events order the client's stream with the daemon's; a
//! client killed mid-request leaves nothing registered.
//!
//! Only the CPU test runs without a GPU; the others are
//! `#[ignore = "needs a CUDA device"]`:
//! `cargo test --release -p hkvd --test cuda_ipc -- --ignored`.
//!
//! Hostile input goes to a daemon under an address-space limit (`prlimit
//! --as`), as in `shm.rs`: a CPU daemon under 6 GiB, the CUDA daemon that
//! `register_cuda` is fuzzed on under its address space once its device
//! is open and a table made plus 16 GiB, set on the running daemon: the
//! driver maps its context and every device allocation into the process's
//! address space (on the H200: 13 GiB once a context is open, then each
//! allocation's size), and a daemon started under 64 GiB could not
//! allocate a table's first buffers.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{expect_code, expect_error, raw_call, set_as_limit, vm_size, Daemon};
use hkv_client::proto::region::{CudaRegistration, RegionAnswer, RegionRef, RegionRequest, NOT_COUNTED};
use hkv_client::proto::{ErrorCode, Op, WriteOp};
use hkv_client::region::{keyed, with_events, CudaRegion};
use hkv_client::{Client, ClientError, TableSpec};
use hkv_region::cuda::cudarc::driver::{CudaContext, CudaStream};
use hkv_region::cuda::{self, DeviceAlloc, IpcEvent};

const LIMIT: u64 = 6 << 30;
/// Address space a CUDA daemon may take beyond what it holds once its
/// device is open and a table made (module docs): a context alone takes
/// about 13 GiB, so the limit is set on the running daemon (`prlimit --pid`).
const CUDA_HEADROOM: u64 = 16 << 30;

fn code(e: ClientError) -> (ErrorCode, String) {
    match e {
        ClientError::Daemon(p) => (p.code, p.message),
        e => panic!("expected a daemon error, got {e}"),
    }
}

fn regions(c: &mut Client) -> (u64, u64) {
    let s = c.stats().unwrap();
    (s["regions"]["regions"].as_u64().unwrap(), s["regions"]["bytes"].as_u64().unwrap())
}

/// Polls the daemon's stats until `want` regions (count, bytes) remain.
fn wait_regions(c: &mut Client, want: (u64, u64)) {
    let t = Instant::now();
    while regions(c) != want {
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}, want {want:?}", regions(c));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// GPU 0's primary context and a stream of it.
fn gpu() -> (Arc<CudaContext>, Arc<CudaStream>) {
    cuda::available().expect("a CUDA device");
    let ctx = CudaContext::new(0).expect("context on GPU 0");
    let stream = ctx.new_stream().expect("stream");
    (ctx, stream)
}

/// `hkvd serve --backend cuda --shards S` plus `extra`.
fn cuda_daemon(shards: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--backend", "cuda", "--shards", shards];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

/// Device memory of this process, seen through a registered region:
/// offsets are the region's (from the registered pointer), copies go
/// through `stream` and wait for it.
struct Dev {
    alloc: DeviceAlloc,
    stream: Arc<CudaStream>,
    /// The registered pointer's offset in the allocation.
    at: u64,
}

impl Dev {
    fn put<T: zerocopy::IntoBytes + zerocopy::Immutable>(&self, off: u64, src: &[T]) {
        self.alloc.write(&self.stream, self.at + off, src).unwrap();
    }
    fn get<T: zerocopy::FromBytes + zerocopy::IntoBytes + Clone + Default>(&self, off: u64, n: u64) -> Vec<T> {
        let mut v = vec![T::default(); n as usize];
        self.alloc.read(&self.stream, self.at + off, &mut v).unwrap();
        v
    }
    fn fill(&self, off: u64, bytes: u64, value: u8) {
        self.alloc.fill(&self.stream, self.at + off, bytes as usize, value).unwrap();
        self.stream.synchronize().unwrap();
    }
}

/// A CPU daemon serves no GPU: register_cuda and register_cuda_event are
/// `bad_request`, naming the CPU backend and register_memfd, and the
/// connection and the daemon keep serving (memfd regions included).
#[test]
fn a_cpu_daemon_refuses_device_registrations_and_keeps_serving() {
    let mut d = Daemon::start_limited(LIMIT, &[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 4, 1024)).unwrap();
    let reg = CudaRegistration { uuid: [7; 16], handle: [9; 64], len: 4096 };
    let (e, m) = code(c.register_cuda_raw(&reg).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    let (e, m) = code(c.register_cuda_event_raw(&reg).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    // The same as raw frames; a body one byte short is `truncated`.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    expect_code(raw_call(&mut s, &reg.encode(3, false)).1, ErrorCode::BadRequest);
    expect_code(raw_call(&mut s, &reg.encode(4, true)).1, ErrorCode::BadRequest);
    let mut f = reg.encode(5, false);
    f.pop();
    let len = (f.len() - 20) as u32;
    f[16..20].copy_from_slice(&len.to_le_bytes());
    expect_error(raw_call(&mut s, &f).1, ErrorCode::Truncated, "len");
    // Nothing was registered; the connections keep serving, memfds included.
    assert_eq!(regions(&mut c), (0, 0));
    c.insert_or_assign("t", &[1, 2], &[1.0; 8], None).unwrap();
    let r = c.register_memfd(4096).unwrap();
    r.write(0, &[1u64, 3]).unwrap();
    assert_eq!(c.find_in("t", r.at::<u64>(0, 2), r.at::<u8>(16, 2), r.at::<f32>(32, 8)).unwrap(), 1);
    expect_code(raw_call(&mut s, &reg.encode(6, false)).1, ErrorCode::BadRequest);
    assert!(d.alive());
}

/// Where a client that has no GPU learns so before sending anything.
#[test]
fn register_cuda_without_a_device_says_so_before_sending() {
    if cuda::available().is_ok() {
        return;
    }
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let e = c.register_cuda(0x7f00_0000_0000, 4096).unwrap_err();
    assert!(matches!(e, ClientError::Cuda(cuda::CudaError::Unavailable(_))), "{e}");
    c.ping().unwrap();
}

// Region offsets (from the registered pointer) of the arrays below.
const KEYS: u64 = 0;
const VALUES: u64 = 64 << 10;
const FOUND: u64 = 128 << 10;
const OUT: u64 = 192 << 10;
const OUTCOMES: u64 = 256 << 10;
const SCORES: u64 = 320 << 10;
const EV_KEYS: u64 = 384 << 10;
const EV_VALUES: u64 = 448 << 10;
const EV_SCORES: u64 = 512 << 10;
const EV_KINDS: u64 = 576 << 10;

/// Every op through a device region equals the same op through the socket
/// on a twin table: one shard (find, contains, erase, insert_or_assign,
/// assign, find_or_insert and insert_and_evict on the client's arrays in
/// place; the others staged) and two shards (everything staged). A find's
/// misses are rows of 0.0 over garbage.
#[test]
#[ignore = "needs a CUDA device"]
fn device_regions_answer_as_the_socket_does() {
    let (ctx, stream) = gpu();
    for shards in ["1", "2"] {
        let d = cuda_daemon(shards, &[]);
        let mut c = d.client();
        let dim = 4u64;
        for t in ["d", "s"] {
            c.create_table(TableSpec::new(t, dim as usize, 1 << 14)).unwrap();
        }
        // Registered from 4 KiB into the allocation, so every reference
        // exercises the offset CudaRegion::at adds.
        let alloc = DeviceAlloc::new(&ctx, 8 << 20).unwrap();
        let at = 4096u64;
        let r: CudaRegion = c.register_cuda(alloc.ptr() + at, (8 << 20) - 2 * at).unwrap();
        assert_eq!(r.export().offset, at);
        assert_eq!(r.len(), (8 << 20) - at);
        assert_eq!(regions(&mut c), (1, r.len()));
        let m = Dev { alloc, stream: stream.clone(), at };
        let n = 300u64;
        let keys: Vec<u64> = (1..=n).collect();
        let values: Vec<f32> = (0..n * dim).map(|x| x as f32 * 0.5).collect();

        // insert_or_assign in place.
        m.put(KEYS, &keys);
        m.put(VALUES, &values);
        let got = c.insert_or_assign_in("d", r.at::<u64>(KEYS, n), r.at::<f32>(VALUES, n * dim), None).unwrap();
        assert_eq!(got, c.insert_or_assign("s", &keys, &values, None).unwrap(), "{shards} shards");

        // find of present and absent keys over garbage outputs.
        let probe: Vec<u64> = (n - 100..n + 100).collect();
        let p = probe.len() as u64;
        m.put(KEYS, &probe);
        m.fill(FOUND, p, 7);
        m.fill(OUT, p * dim * 4, 0x41);
        let hits = c.find_in("d", r.at::<u64>(KEYS, p), r.at::<u8>(FOUND, p), r.at::<f32>(OUT, p * dim)).unwrap();
        let want = c.find("s", &probe).unwrap();
        assert_eq!(hits, 101);
        assert_eq!(m.get::<u8>(FOUND, p), want.found.iter().map(|&f| u8::from(f)).collect::<Vec<_>>());
        assert_eq!(m.get::<f32>(OUT, p * dim), want.values, "{shards} shards: rows (misses 0.0)");

        // find with SCORES (staged): the scores of the same table's socket find.
        m.fill(OUT, p * dim * 4, 0x41);
        let req = keyed(
            u8::from(Op::Find),
            "d",
            vec![r.at::<u64>(KEYS, p), r.at::<u8>(FOUND, p), r.at::<f32>(OUT, p * dim), r.at::<u64>(SCORES, p)],
            true,
            false,
        );
        assert_eq!(c.region_call(&req).unwrap(), RegionAnswer::Count(101));
        let ws = c.find_with_scores("d", &probe).unwrap();
        assert_eq!(Some(m.get::<u64>(SCORES, p)), ws.scores);
        assert_eq!(m.get::<f32>(OUT, p * dim), ws.values);

        // contains.
        m.fill(FOUND, p, 7);
        assert_eq!(c.contains_in("d", r.at::<u64>(KEYS, p), r.at::<u8>(FOUND, p)).unwrap(), 101);
        let present = c.contains("s", &probe).unwrap();
        assert_eq!(m.get::<u8>(FOUND, p), present.iter().map(|&f| u8::from(f)).collect::<Vec<_>>());

        // insert_or_assign with OUTCOMES (staged): new and present keys.
        let more: Vec<u64> = (n - 20..n + 30).collect();
        let mv: Vec<f32> = (0..more.len() as u64 * dim).map(|x| 100.0 + x as f32).collect();
        let k = more.len() as u64;
        m.put(KEYS, &more);
        m.put(VALUES, &mv);
        let got = c
            .write_in(
                u8::from(Op::InsertOrAssign),
                "d",
                r.at::<u64>(KEYS, k),
                r.at::<f32>(VALUES, k * dim),
                None,
                Some(r.at::<u8>(OUTCOMES, k)),
            )
            .unwrap();
        let want = c.write(WriteOp::InsertOrAssign, "s", &more, &mv, None).unwrap();
        assert_eq!(got, want.summary);
        assert_eq!(m.get::<u8>(OUTCOMES, k), want.outcomes);

        // find_or_insert in place: values read, then written back.
        let foi: Vec<u64> = (n + 10..n + 60).collect();
        let k = foi.len() as u64;
        m.put(KEYS, &foi);
        m.put(VALUES, &vec![-1.0f32; (k * dim) as usize]);
        let got = c
            .write_in(u8::from(Op::FindOrInsert), "d", r.at::<u64>(KEYS, k), r.at::<f32>(VALUES, k * dim), None, None)
            .unwrap();
        let (summary, back) = c.find_or_insert("s", &foi, &vec![-1.0f32; (k * dim) as usize], None).unwrap();
        assert_eq!(got, summary);
        assert_eq!(m.get::<f32>(VALUES, k * dim), back);

        // assign in place (present and absent keys).
        let asg: Vec<u64> = (n - 10..n + 70).step_by(2).collect();
        let k = asg.len() as u64;
        let av = vec![9.0f32; (k * dim) as usize];
        m.put(KEYS, &asg);
        m.put(VALUES, &av);
        let got = c
            .write_in(u8::from(Op::Assign), "d", r.at::<u64>(KEYS, k), r.at::<f32>(VALUES, k * dim), None, None)
            .unwrap();
        assert_eq!(got, c.assign("s", &asg, &av, None).unwrap());

        // accum_or_assign (staged).
        let deltas = vec![1.0f32; (k * dim) as usize];
        m.put(VALUES, &deltas);
        let got = c
            .write_in(u8::from(Op::AccumOrAssign), "d", r.at::<u64>(KEYS, k), r.at::<f32>(VALUES, k * dim), None, None)
            .unwrap();
        assert_eq!(got, c.accum_or_assign("s", &asg, &deltas, None).unwrap());

        // insert_and_evict in place: evicted arrays with room for every key.
        let ins: Vec<u64> = (n + 100..n + 140).collect();
        let k = ins.len() as u64;
        let iv = vec![2.5f32; (k * dim) as usize];
        m.put(KEYS, &ins);
        m.put(VALUES, &iv);
        let ev = keyed(
            u8::from(Op::InsertAndEvict),
            "d",
            vec![
                r.at::<u64>(KEYS, k),
                r.at::<f32>(VALUES, k * dim),
                r.at::<u64>(EV_KEYS, k),
                r.at::<f32>(EV_VALUES, k * dim),
                r.at::<u64>(EV_SCORES, k),
                r.at::<u8>(EV_KINDS, k),
            ],
            false,
            false,
        );
        let RegionAnswer::Evict(got, evicted) = c.region_call(&ev).unwrap() else { panic!("not an evict answer") };
        let (summary, want) = c.insert_and_evict("s", &ins, &iv, None).unwrap();
        assert_eq!((got, evicted), (summary, want.keys.len() as u64));

        // erase in place, then with OUTCOMES (staged).
        m.put(KEYS, &keys[..20]);
        assert_eq!(c.erase_in("d", r.at::<u64>(KEYS, 10), None).unwrap(), c.erase("s", &keys[..10]).unwrap());
        m.put(KEYS, &keys[10..30]);
        m.fill(OUTCOMES, 20, 7);
        let erased = c.erase_in("d", r.at::<u64>(KEYS, 20), Some(r.at::<u8>(OUTCOMES, 20))).unwrap();
        assert_eq!(erased, c.erase("s", &keys[10..30]).unwrap());
        assert_eq!(m.get::<u8>(OUTCOMES, 20), vec![1; 20]);

        // Both tables hold the same entries.
        let all: Vec<u64> = (1..=n + 200).collect();
        let (a, b) = (c.find("d", &all).unwrap(), c.find("s", &all).unwrap());
        assert_eq!((a.found, a.values), (b.found, b.values), "{shards} shards: the tables differ");

        c.unregister(r.id()).unwrap();
        wait_regions(&mut c, (0, 0));
        drop(m);
    }
}

/// Each bad registration or reference of device memory is refused with
/// its documented code and reason, nothing is written into the client's
/// memory, and the daemon keeps serving: a handle that does not open, a
/// UUID the daemon does not serve, 0 bytes or more than the allocation,
/// past the per-connection cap, references past the end, overflowing or
/// misaligned, another connection's region, a memfd and a device region in
/// one request, an event named as memory and memory named as an event.
#[test]
#[ignore = "needs a CUDA device"]
fn bad_device_registrations_and_references_are_refused() {
    use rand::RngCore;
    let (ctx, stream) = gpu();
    let cap = 4u64 << 20;
    let mut d = cuda_daemon("1", &["--max-region-bytes-per-connection", &cap.to_string()]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 4, 1024)).unwrap();
    c.insert_or_assign("t", &[1, 2], &[1.0; 8], None).unwrap();
    let uuid = cuda::device_uuid(0).unwrap();
    let alloc = DeviceAlloc::new(&ctx, 2 << 20).unwrap();
    ctx.bind_to_thread().unwrap();
    let export = cuda::export_memory(alloc.ptr()).unwrap();
    assert_eq!(export.size, 2 << 20);

    // Registrations.
    let mut junk = [0u8; 64];
    rand::thread_rng().fill_bytes(&mut junk);
    let (e, m) = code(c.register_cuda_raw(&CudaRegistration { uuid, handle: junk, len: 4096 }).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    let (e, m) = code(
        c.register_cuda_raw(&CudaRegistration { uuid: [0xEE; 16], handle: export.handle, len: 4096 }).unwrap_err(),
    );
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    let (e, m) = code(c.register_cuda_raw(&CudaRegistration { uuid, handle: export.handle, len: 0 }).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    let too_long = CudaRegistration { uuid, handle: export.handle, len: export.size + 1 };
    let (e, m) = code(c.register_cuda_raw(&too_long).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    // The client refuses the same before sending.
    assert!(matches!(c.register_cuda(alloc.ptr() + 8, export.size), Err(ClientError::Request(_))));
    let (e, m) = code(c.register_cuda_event_raw(&CudaRegistration { uuid, handle: junk, len: 0 }).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    assert_eq!(regions(&mut c), (0, 0), "a refused registration registered something");

    // A good one, then past the cap.
    let r = c.register_cuda(alloc.ptr(), export.size).unwrap();
    let big = DeviceAlloc::new(&ctx, 3 << 20).unwrap();
    let (e, m) = code(c.register_cuda(big.ptr(), 3 << 20).unwrap_err());
    assert_eq!(e, ErrorCode::ResourceExhausted, "{m}");
    assert!(m.contains("limits.max_region_bytes_per_connection"), "{m}");
    assert_eq!(regions(&mut c), (1, 2 << 20));

    // References.
    let m = Dev { alloc, stream: stream.clone(), at: 0 };
    m.put(0, &[1u64, 2]);
    m.fill(1024, 4096, 0xAB);
    let untouched = |m: &Dev| assert!(m.get::<u8>(1024, 4096).iter().all(|&x| x == 0xAB), "the region was written");
    let id = r.id();
    let len = export.size;
    let find = |keys: RegionRef, found: RegionRef, values: RegionRef| {
        keyed(u8::from(Op::Find), "t", vec![keys, found, values], false, false)
    };
    let ok_keys = RegionRef::new(id, 0, 2);
    let ok_found = RegionRef::new(id, 1024, 2);
    let ok_values = RegionRef::new(id, 2048, 8);
    // The code, and the array (or region) at fault.
    let unknown = format!("region {}", id + 100);
    let cases: Vec<(RegionRequest, ErrorCode, &str)> = vec![
        (find(RegionRef::new(id, len - 8, 2), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(ok_keys, ok_found, RegionRef::new(id, len - 16, 8)), ErrorCode::BadRequest, "values"),
        (find(RegionRef::new(id, 0, u64::MAX / 4), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(RegionRef::new(id, u64::MAX - 7, 1), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(RegionRef::new(id, 4, 2), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(ok_keys, ok_found, RegionRef::new(id, 2050, 8)), ErrorCode::BadRequest, "values"),
        (find(ok_keys, ok_found, RegionRef::new(id, 2048, 7)), ErrorCode::WrongDim, "values"),
        (find(ok_keys, RegionRef::new(id, 1024, 3), ok_values), ErrorCode::LengthMismatch, "found"),
        (find(ok_keys, ok_found, RegionRef::new(id + 100, 2048, 8)), ErrorCode::NotFound, &unknown),
    ];
    for (req, want, culprit) in cases {
        let (e, msg) = code(c.region_call(&req).unwrap_err());
        assert_eq!(e, want, "{msg}");
        assert!(msg.contains(culprit), "{msg} does not name {culprit}");
        untouched(&m);
    }
    // A write with a bad output reference applies nothing.
    m.put(0, &[7u64, 8]);
    let w = keyed(
        u8::from(Op::InsertOrAssign),
        "t",
        vec![ok_keys, RegionRef::new(id, 2048, 8), RegionRef::new(id, len + 64, 2)],
        false,
        true,
    );
    assert_eq!(code(c.region_call(&w).unwrap_err()).0, ErrorCode::BadRequest);
    assert_eq!(c.tables().unwrap()[0].size, 2);
    m.put(0, &[1u64, 2]);

    // Another connection cannot name this connection's region.
    let mut other = d.client();
    let (e, msg) = code(other.region_call(&find(ok_keys, ok_found, ok_values)).unwrap_err());
    assert_eq!(e, ErrorCode::NotFound, "{msg}");
    assert_eq!(code(other.unregister(id).unwrap_err()).0, ErrorCode::NotFound);
    untouched(&m);

    // A memfd and a device region in one request.
    let host = c.register_memfd(4096).unwrap();
    host.write(0, &[1u64, 2]).unwrap();
    let (e, msg) = code(c.region_call(&find(host.at::<u64>(0, 2), ok_found, ok_values)).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{msg}");
    let (e, _) = code(c.region_call(&find(ok_keys, host.at::<u8>(64, 2), host.at::<f32>(128, 8))).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest);
    untouched(&m);

    // An event is no memory; memory (or nothing) is no event.
    let event = IpcEvent::new(&ctx).unwrap();
    let ev = c.register_cuda_event(&event).unwrap();
    let (e, msg) = code(c.region_call(&find(RegionRef::new(ev, 0, 2), ok_found, ok_values)).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{msg}");
    for bad in [(id, 0), (0, id), (ev + 100, 0)] {
        let (e, msg) = code(c.region_call(&with_events(find(ok_keys, ok_found, ok_values), bad.0, bad.1)).unwrap_err());
        assert_eq!(e, ErrorCode::NotFound, "{bad:?}: {msg}");
    }
    untouched(&m);
    assert_eq!(regions(&mut c).1, (2 << 20) + 4096, "events count nothing against the caps");

    // Still serving: this connection, through the device region, and others.
    assert_eq!(c.find_in("t", ok_keys, ok_found, ok_values).unwrap(), 2);
    assert_eq!(m.get::<u8>(1024, 2), vec![1, 1]);
    other.ping().unwrap();
    c.unregister(ev).unwrap();
    c.unregister(id).unwrap();
    c.unregister(host.id()).unwrap();
    wait_regions(&mut c, (0, 0));
    assert!(d.alive());
}

/// Events: the daemon reads a request's keys only after the work the client
/// recorded on the wait event (here: a busy stream, then the keys copied in
/// on it; without the wait the daemon would read zeros and find nothing),
/// and records the done event after its writes, so the client's stream,
/// waiting on it, reads the rows the socket's find gives.
#[test]
#[ignore = "needs a CUDA device"]
fn events_order_the_clients_stream_with_the_daemons() {
    let (ctx, stream) = gpu();
    let d = cuda_daemon("1", &[]);
    let mut c = d.client();
    let (n, dim) = (1u64 << 16, 8u64);
    c.create_table(TableSpec::new("t", dim as usize, 1 << 18)).unwrap();
    let keys: Vec<u64> = (1..=n).collect();
    let values: Vec<f32> = (0..n * dim).map(|x| x as f32).collect();
    c.insert_or_assign("t", &keys, &values, None).unwrap();
    let len = n * 8 + n + n * dim * 4;
    let alloc = DeviceAlloc::new(&ctx, len as usize).unwrap();
    let r = c.register_cuda(alloc.ptr(), len).unwrap();
    let src = DeviceAlloc::new(&ctx, (n * 8) as usize).unwrap();
    src.write(&stream, 0, &keys).unwrap();
    let scratch = DeviceAlloc::new(&ctx, 512 << 20).unwrap();
    let (wait, done) = (IpcEvent::new(&ctx).unwrap(), IpcEvent::new(&ctx).unwrap());
    let (wait_id, done_id) = (c.register_cuda_event(&wait).unwrap(), c.register_cuda_event(&done).unwrap());
    let m = Dev { alloc, stream: stream.clone(), at: 0 };
    let want = c.find("t", &keys).unwrap();
    // The stream's copy itself, waited for on the host: the keys land.
    m.fill(0, n * 8, 0);
    m.alloc.copy_from(&stream, 0, &src, 0, (n * 8) as usize).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(m.get::<u64>(0, 4), vec![1, 2, 3, 4], "the test's own copy of the keys");
    for round in 0..3 {
        // The region's keys are zeros until the stream, busy for tens of
        // milliseconds first, copies them in.
        m.fill(0, n * 8, 0);
        m.fill(n * 8, n, 7);
        m.fill(n * 9, n * dim * 4, 0x41);
        stream.synchronize().unwrap();
        for _ in 0..200 {
            scratch.fill(&stream, 0, 512 << 20, round as u8).unwrap();
        }
        m.alloc.copy_from(&stream, 0, &src, 0, (n * 8) as usize).unwrap();
        wait.record(&stream).unwrap();
        let req = keyed(
            u8::from(Op::Find),
            "t",
            vec![r.at::<u64>(0, n), r.at::<u8>(n * 8, n), r.at::<f32>(n * 9, n * dim)],
            false,
            false,
        );
        let id = c.send_region(&with_events(req, wait_id, done_id)).unwrap();
        let (got, a) = c.recv_region(u8::from(Op::Find)).unwrap();
        // With a done event the daemon answers once the lookup is queued,
        // uncounted; the event orders the client's stream after it.
        assert_eq!((got, a), (id, RegionAnswer::Count(NOT_COUNTED)), "round {round}");
        done.wait_on(&stream).unwrap();
        let flags = m.get::<u8>(n * 8, n);
        let count = |v: u8| flags.iter().filter(|&&f| f == v).count();
        let keys_now = m.get::<u64>(0, 4);
        let path = c.stats_doc().unwrap().path;
        assert!(
            flags.iter().all(|&f| f == 1),
            "round {round}: found flags: {} ones, {} zeros, {} still 7 (not written), first bad at {:?}; \
             the region's first keys now {keys_now:?}; the daemon waited on {} events ({} us in all)",
            count(1),
            count(0),
            count(7),
            flags.iter().position(|&f| f != 1),
            path.event_waits,
            path.event_wait_ns / 1000
        );
        assert_eq!(m.get::<f32>(n * 9, n * dim), want.values, "round {round}");
        done.synchronize().unwrap();
    }
    c.unregister(wait_id).unwrap();
    c.unregister(done_id).unwrap();
    c.unregister(r.id()).unwrap();
    wait_regions(&mut c, (0, 0));
}

/// A request whose wait event is the done event of an earlier request of
/// the connection, sent before that one's answer was read, polls it only
/// once that request recorded it: a find sent right behind a write that
/// first waits for a busy client stream reads the written rows (before,
/// it polled the event's earlier state, complete, and read the old ones).
#[test]
#[ignore = "needs a CUDA device"]
fn a_request_waiting_on_an_earlier_requests_done_event_follows_its_writes() {
    let (ctx, stream) = gpu();
    let d = cuda_daemon("1", &[]);
    let mut c = d.client();
    let (n, dim) = (1u64 << 14, 8u64);
    c.create_table(TableSpec::new("t", dim as usize, 1 << 16)).unwrap();
    let keys: Vec<u64> = (1..=n).collect();
    let old: Vec<f32> = vec![-1.0; (n * dim) as usize];
    let new: Vec<f32> = (0..n * dim).map(|x| x as f32).collect();
    c.insert_or_assign("t", &keys, &old, None).unwrap();
    // keys | new rows | found flags | rows found
    let len = n * 8 + 2 * n * dim * 4 + n;
    let alloc = DeviceAlloc::new(&ctx, len as usize).unwrap();
    let r = c.register_cuda(alloc.ptr(), len).unwrap();
    let scratch = DeviceAlloc::new(&ctx, 512 << 20).unwrap();
    let events: Vec<IpcEvent> = (0..3).map(|_| IpcEvent::new(&ctx).unwrap()).collect();
    let ids: Vec<u32> = events.iter().map(|e| c.register_cuda_event(e).unwrap()).collect();
    let m = Dev { alloc, stream: stream.clone(), at: 0 };
    m.put(0, &keys);
    m.put(n * 8, &new);
    let (k, v) = (r.at::<u64>(0, n), r.at::<f32>(n * 8, n * dim));
    let (f, out) = (r.at::<u8>(n * 8 + n * dim * 4, n), r.at::<f32>(n * 9 + n * dim * 4, n * dim));
    for round in 0..3u8 {
        m.fill(n * 9 + n * dim * 4, n * dim * 4, 0);
        stream.synchronize().unwrap();
        // The write waits for a stream busy for tens of milliseconds.
        for _ in 0..200 {
            scratch.fill(&stream, 0, 512 << 20, round).unwrap();
        }
        events[0].record(&stream).unwrap();
        let write = with_events(keyed(u8::from(Op::InsertOrAssign), "t", vec![k, v], false, false), ids[0], ids[1]);
        let find = with_events(keyed(u8::from(Op::Find), "t", vec![k, f, out], false, false), ids[1], ids[2]);
        let w = c.send_region(&write).unwrap();
        let q = c.send_region(&find).unwrap();
        // Answered in either order, each with its own op.
        let mut answers: Vec<(u64, u8)> = (0..2)
            .map(|_| {
                let (h, body) = c.recv_frame().unwrap();
                assert!(RegionAnswer::decode(h.op, &body).is_ok(), "round {round}: op {} answered {body:?}", h.op);
                (h.id, h.op)
            })
            .collect();
        answers.sort_unstable();
        assert_eq!(answers, [(w, u8::from(Op::InsertOrAssign)), (q, u8::from(Op::Find))], "round {round}");
        events[2].wait_on(&stream).unwrap();
        stream.synchronize().unwrap();
        let got = m.get::<f32>(n * 9 + n * dim * 4, n * dim);
        let stale = got.iter().zip(&new).filter(|(a, b)| a != b).count();
        assert_eq!(stale, 0, "round {round}: {stale} of {} floats not the written rows", n * dim);
        // Put the old rows back for the next round.
        c.insert_or_assign("t", &keys, &old, None).unwrap();
    }
    for id in ids {
        c.unregister(id).unwrap();
    }
    c.unregister(r.id()).unwrap();
    wait_regions(&mut c, (0, 0));
}

/// A write with a done event is answered once queued, before the device
/// has scanned its keys for reserved markers; a batch holding one writes
/// nothing, and its refusal is the answer of the first region request of
/// the connection that comes after the daemon saw the batch end (which
/// does not run), naming the key; the requests after that run as usual.
#[test]
#[ignore = "needs a CUDA device"]
fn a_write_refused_after_its_early_answer_is_told_on_a_later_request() {
    let (ctx, stream) = gpu();
    let d = cuda_daemon("1", &[]);
    let mut c = d.client();
    let (n, dim) = (4096u64, 8u64);
    c.create_table(TableSpec::new("t", dim as usize, 1 << 16)).unwrap();
    let mut keys: Vec<u64> = (1..=n).collect();
    keys[100] = u64::MAX;
    let values: Vec<f32> = (0..n * dim).map(|x| x as f32).collect();
    let len = n * 8 + n * dim * 4 + n;
    let alloc = DeviceAlloc::new(&ctx, len as usize).unwrap();
    let r = c.register_cuda(alloc.ptr(), len).unwrap();
    let done = IpcEvent::new(&ctx).unwrap();
    let done_id = c.register_cuda_event(&done).unwrap();
    let m = Dev { alloc, stream: stream.clone(), at: 0 };
    m.put(0, &keys);
    m.put(n * 8, &values);
    let (k, v, f) = (r.at::<u64>(0, n), r.at::<f32>(n * 8, n * dim), r.at::<u8>(n * 8 + n * dim * 4, n));
    let write = with_events(keyed(u8::from(Op::InsertOrAssign), "t", vec![k, v], false, false), 0, done_id);
    let id = c.send_region(&write).unwrap();
    match c.recv_region(u8::from(Op::InsertOrAssign)) {
        // Answered once queued: the refusal comes with the next request.
        Ok((got, RegionAnswer::Write(s))) => {
            assert_eq!((got, s.inserted), (id, NOT_COUNTED), "an early answer");
            done.synchronize().unwrap();
            // The refusal is known once the daemon has seen the batch end
            // (just after the event completes): a later request gets it.
            let find = keyed(u8::from(Op::Find), "t", vec![k, f, v], false, false);
            let start = Instant::now();
            let e = loop {
                match c.region_call(&find) {
                    Err(e) => break e,
                    Ok(_) => assert!(start.elapsed() < Duration::from_secs(5), "no refusal told in 5 s"),
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            let (code, msg) = code(e);
            assert_eq!(code, ErrorCode::ReservedKey, "{msg}");
            assert!(msg.contains("was refused when it ran") && msg.contains("not run"), "{msg}");
            assert!(msg.contains(&u64::MAX.to_string()) || msg.contains("index 100"), "names the key: {msg}");
        }
        // Refused before it was answered (no early place): the same error.
        Err(e) => assert_eq!(code(e).0, ErrorCode::ReservedKey),
        Ok(a) => panic!("unexpected answer {a:?}"),
    }
    // Nothing of the batch was written.
    let none = c.find("t", &keys[..100]).unwrap();
    assert!(none.found.iter().all(|&x| !x), "a refused batch writes nothing");
    // The next request runs: the same batch without the marker (the
    // finds above wrote their zero rows over the values: put them back).
    keys[100] = 101;
    m.put(0, &keys);
    m.put(n * 8, &values);
    let write = keyed(u8::from(Op::InsertOrAssign), "t", vec![k, v], false, false);
    assert!(matches!(c.region_call(&write).unwrap(), RegionAnswer::Write(s) if s.inserted == n));
    let all = c.find("t", &keys).unwrap();
    assert!(all.found.iter().all(|&x| x));
    let bad = all.values.iter().zip(&values).position(|(a, b)| a != b);
    assert!(bad.is_none(), "rows differ from float {bad:?} on");
    c.unregister(done_id).unwrap();
    c.unregister(r.id()).unwrap();
    wait_regions(&mut c, (0, 0));
}

/// Bytes of the child's allocation in
/// `a_client_killed_mid_request_leaves_nothing_registered`: 8 output areas
/// of 2^20 keys' flags and rows of dim 8, and the keys.
const CHILD_KEYS: u64 = 1 << 20;
const CHILD_DIM: u64 = 8;

/// The child of `a_client_killed_mid_request_leaves_nothing_registered`:
/// registers a device allocation, sends big finds writing into it without
/// reading the answers, says so, and waits to be killed.
#[test]
#[ignore = "run as a child process by a_client_killed_mid_request_leaves_nothing_registered"]
fn child_sends_device_finds() {
    let Ok(socket) = std::env::var("HKVD_TEST_SOCKET") else { return };
    let (ctx, stream) = gpu();
    let mut c = Client::connect(socket).unwrap();
    let (n, dim) = (CHILD_KEYS, CHILD_DIM);
    let per = (n + n * dim * 4).next_multiple_of(8);
    let len = n * 8 + 8 * per;
    let alloc = DeviceAlloc::new(&ctx, len as usize).unwrap();
    alloc.write(&stream, 0, &(1..=n).collect::<Vec<u64>>()).unwrap();
    let r = c.register_cuda(alloc.ptr(), len).unwrap();
    for i in 0..8 {
        let base = n * 8 + i * per;
        let req = keyed(
            u8::from(Op::Find),
            "t",
            vec![r.at::<u64>(0, n), r.at::<u8>(base, n), r.at::<f32>(base + n, n * dim)],
            false,
            false,
        );
        c.send_region(&req).unwrap();
    }
    println!("sent");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// A client killed (SIGKILL) while big finds write into its device region:
/// the daemon lives on, releases the region once those finds are done
/// (stats), its hold on the child's memory goes (the device's free memory
/// comes back: an IPC mapping left open would keep the child's allocation
/// alive), and another client's device region is still served.
#[test]
#[ignore = "needs a CUDA device"]
fn a_client_killed_mid_request_leaves_nothing_registered() {
    let (ctx, stream) = gpu();
    let mut d = cuda_daemon("1", &[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", CHILD_DIM as usize, 1 << 21)).unwrap();
    let keys: Vec<u64> = (1..=CHILD_KEYS).collect();
    for chunk in keys.chunks(1 << 18) {
        c.insert_or_assign("t", chunk, &vec![0.5; chunk.len() * CHILD_DIM as usize], None).unwrap();
    }
    // This client's own device region, used between the kills.
    let mine = DeviceAlloc::new(&ctx, 1 << 20).unwrap();
    let r = c.register_cuda(mine.ptr(), 1 << 20).unwrap();
    let m = Dev { alloc: mine, stream: stream.clone(), at: 0 };
    m.put(0, &[1u64, 2, CHILD_KEYS + 1]);
    let child_bytes = CHILD_KEYS * 8 + 8 * (CHILD_KEYS + CHILD_KEYS * CHILD_DIM * 4).next_multiple_of(8);
    let mut baseline = None;
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_sends_device_finds", "--ignored", "--nocapture"])
            .env("HKVD_TEST_SOCKET", &d.socket)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("sent") {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the child ended without sending");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        wait_regions(&mut c, (1, 1 << 20));
        assert!(d.alive(), "hkvd died");
        assert_eq!(c.find("t", &[1, 2]).unwrap().found, vec![true, true]);
        assert_eq!(c.find_in("t", r.at::<u64>(0, 3), r.at::<u8>(64, 3), r.at::<f32>(128, 3 * CHILD_DIM)).unwrap(), 2);
        assert_eq!(m.get::<u8>(64, 3), vec![1, 1, 0]);
        // The device's free memory comes back: after the first round, once
        // it stops rising, it is the baseline (the daemon may have grown
        // its own buffers); after the others, it returns to within half the
        // child's allocation of it. A mapping of the child's memory left
        // open would hold all of it, each round.
        let free = || ctx.mem_get_info().unwrap().0 as u64;
        let t = Instant::now();
        match baseline {
            None => {
                let mut last = free();
                loop {
                    std::thread::sleep(Duration::from_millis(500));
                    let now = free();
                    if now <= last + (1 << 20) || t.elapsed() > Duration::from_secs(30) {
                        baseline = Some(now.max(last));
                        break;
                    }
                    last = now;
                }
            }
            Some(base) => {
                while free() + child_bytes / 2 < base {
                    assert!(
                        t.elapsed() < Duration::from_secs(30),
                        "round {round}: {} MiB of device memory still held after the child died",
                        (base - free()) >> 20
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
    c.unregister(r.id()).unwrap();
    wait_regions(&mut c, (0, 0));
}

/// The child of `a_client_event_that_never_completes_costs_only_its_requests`:
/// registers a device allocation and an event, gates its stream on a word
/// nobody writes, records the event behind the gate, sends a find and a
/// find_or_insert that wait on it, says so, and waits to be killed.
#[test]
#[ignore = "run as a child process by a_client_event_that_never_completes_costs_only_its_requests"]
fn child_waits_on_a_stalled_event() {
    let Ok(socket) = std::env::var("HKVD_TEST_SOCKET") else { return };
    let (ctx, stream) = gpu();
    let mut c = Client::connect(socket).unwrap();
    let (n, dim) = (1u64 << 10, 8u64);
    let len = 64 << 20;
    // Never dropped: a drop waits for the context's work, which the gate
    // holds for good (the parent kills this process).
    let alloc = std::mem::ManuallyDrop::new(DeviceAlloc::new(&ctx, len as usize).unwrap());
    alloc.write(&stream, 0, &(1..=n).collect::<Vec<u64>>()).unwrap();
    let r = c.register_cuda(alloc.ptr(), len).unwrap();
    let wait = IpcEvent::new(&ctx).unwrap();
    let wait_id = c.register_cuda_event(&wait).unwrap();
    let gate_at = len - 4;
    alloc.gate(&stream, gate_at).unwrap();
    wait.record(&stream).unwrap();
    let refs = |base: u64| vec![r.at::<u64>(0, n), r.at::<u8>(base, n), r.at::<f32>(base + n, n * dim)];
    c.send_region(&with_events(keyed(u8::from(Op::Find), "t", refs(8 * n), false, false), wait_id, 0)).unwrap();
    let foi = vec![r.at::<u64>(0, n), r.at::<f32>(1 << 20, n * dim)];
    c.send_region(&with_events(keyed(u8::from(WriteOp::FindOrInsert), "t", foi, false, false), wait_id, 0)).unwrap();
    println!("sent");
    std::io::stdout().flush().unwrap();
    // Alive, and slow: the daemon answers `timeout` after its limit.
    for _ in 0..2 {
        match c.recv_frame() {
            Err(ClientError::Daemon(p)) => assert_eq!(p.code, ErrorCode::Timeout, "{}", p.message),
            r => panic!("a stalled wait is answered timeout, not {r:?}"),
        }
    }
    println!("answered");
    std::io::stdout().flush().unwrap();
    // Two more, then the kill.
    c.send_region(&with_events(keyed(u8::from(Op::Find), "t", refs(8 * n), false, false), wait_id, 0)).unwrap();
    c.send_region(&with_events(keyed(u8::from(Op::Find), "t", refs(8 * n), false, false), wait_id, 0)).unwrap();
    println!("sent again");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

/// A client registered 64 MiB and an event, queued 12 s of GPU work and
/// the event's record, sent a find and a find_or_insert waiting on it, and
/// was SIGKILLed: from then on finds, inserts and stats on every table got
/// no answer, ping stopped 3 s later, SIGTERM did not stop the daemon, and
/// the dead client's allocation stayed mapped (the daemon's shared stream
/// waited on an event that would never be recorded). While such a client
/// was alive and slow, its waits held up other clients' requests for
/// seconds. Now the wait is a host-side poll with a deadline: other
/// clients are served meanwhile, the slow client's requests are answered
/// `timeout`, and a dead client's requests end and its regions go.
#[test]
#[ignore = "needs a CUDA device"]
fn a_client_event_that_never_completes_costs_only_its_requests() {
    let mut d = cuda_daemon("1", &["--event-wait-seconds", "4"]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 8, 1 << 16)).unwrap();
    c.create_table(TableSpec::new("u", 8, 1 << 16)).unwrap();
    c.insert_or_assign("t", &[1, 2], &[0.5; 16], None).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_waits_on_a_stalled_event", "--ignored", "--nocapture"])
        .env("HKVD_TEST_SOCKET", &d.socket)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut wait_for = |what: &str| {
        let mut line = String::new();
        while !line.contains(what) {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the child ended before {what:?}");
        }
    };
    // Every other client's request is answered at once meanwhile.
    let prompt = |c: &mut Client, round: &str| {
        for i in 0..10u64 {
            let t = Instant::now();
            assert_eq!(c.find("t", &[1, 2]).unwrap().found, vec![true, true]);
            c.insert_or_assign("t", &[100 + i], &[1.0; 8], None).unwrap();
            c.insert_or_assign("u", &[100 + i], &[1.0; 8], None).unwrap();
            c.stats().unwrap();
            c.ping().unwrap();
            assert!(t.elapsed() < Duration::from_secs(1), "{round}: a request took {:?}", t.elapsed());
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_for("sent");
    prompt(&mut c, "while the child is alive and stalled");
    let t = Instant::now();
    wait_for("answered");
    assert!(t.elapsed() < Duration::from_secs(10), "the stalled requests were answered after {:?}", t.elapsed());
    wait_for("sent again");
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap();
    child.wait().unwrap();
    prompt(&mut c, "after the child was killed");
    wait_regions(&mut c, (0, 0));
    assert!(d.alive());
    drop(c);
    d.signal("TERM");
    assert_eq!(d.wait(Duration::from_secs(30)), 0, "SIGTERM stops the daemon");
}

/// The process that opens CUDA IPC handles before the daemon does
/// (`hkvd check-ipc-handles`, `region::vet`): it answers every line, one
/// answer each, in order; a handle that does not open (all zeros here, on
/// any host) and a malformed line are errors, not deaths; it exits when
/// its input closes. Runs with or without a GPU.
#[test]
fn the_handle_checker_answers_each_line_and_ends_with_its_input() {
    let mut child = Command::new(common::hkvd_bin())
        .arg("check-ipc-handles")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let zeros = "00".repeat(64);
    write!(input, "mem 0 64 {zeros}\nevent 0 {zeros}\nopen sesame\nmem 0 x {zeros}\n").unwrap();
    input.flush().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    for what in ["a zero memory handle", "a zero event handle", "an unknown line", "a bad length"] {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.starts_with("err "), "{what}: {line:?}");
    }
    drop(input);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the checker did not exit when its input closed");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

/// Issue 32, finding 23: one run lost the daemon (the connection closed,
/// later connects were refused, nothing in the log) after an allocation
/// had been registered through eight byte-flipped copies of its handle on
/// two connections; the replay did not reproduce it. This fuzzes
/// `register_cuda` harder than that, with the daemon under an
/// address-space limit (a runaway allocation fails instead of taking the
/// machine down): four connections at once, each 150 registrations of one
/// allocation through its handle with 1 to 8 random bytes flipped (or
/// none), through its UUID flipped, and with bad lengths, while a fifth
/// connection keeps finding through its own registration of the same
/// allocation. A flipped UUID or a bad length is refused (`bad_request`);
/// a flipped handle is refused or, where the driver does not read the
/// bytes flipped, opens the same allocation (a contains through it finds
/// the keys stored there); the daemon answers pings and the finds
/// throughout, and ends with only the fifth connection's region.
///
/// What is known now: outside the daemon (a Python ctypes harness on the
/// H200), `cuIpcOpenMemHandle` itself kills the process that opens some
/// byte-flipped handles (SIGSEGV; with opens on several threads at once
/// also glibc's "malloc(): unsorted double linked list corrupted" abort,
/// the daemon's lost run), in about one run in 16 of 4 800 flipped opens,
/// opens serialised on one thread and nothing ever closed included. So
/// the daemon no longer opens a handle first: a separate process
/// (`region::vet`) opens and closes it, and a handle that kills that
/// process is refused (`bad_request`).
#[test]
#[ignore = "needs a CUDA device"]
fn fuzzed_cuda_registrations_from_several_connections_never_take_the_daemon_down() {
    use rand::{Rng, SeedableRng};
    let (ctx, stream) = gpu();
    let mut d = Daemon::start(&["--backend", "cuda", "--shards", "1"]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 4, 1024)).unwrap();
    set_as_limit(d.pid(), &(vm_size(d.pid()) + CUDA_HEADROOM).to_string());
    let n = 64u64;
    let keys: Vec<u64> = (1..=n).collect();
    let values: Vec<f32> = (0..n * 4).map(|x| x as f32).collect();
    c.insert_or_assign("t", &keys, &values, None).unwrap();
    let alloc = DeviceAlloc::new(&ctx, 64 << 20).unwrap();
    ctx.bind_to_thread().unwrap();
    let export = cuda::export_memory(alloc.ptr()).unwrap();
    let r = c.register_cuda(alloc.ptr(), export.size).unwrap();
    let m = Dev { alloc, stream, at: 0 };
    m.put(KEYS, &keys);
    let socket = d.socket.clone();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + t);
                let mut c = Client::connect(&socket).unwrap();
                let (mut ok, mut opened_flipped, mut refused) = (0, 0, 0);
                for i in 0..150 {
                    let mut reg = CudaRegistration { uuid: export.uuid, handle: export.handle, len: export.size };
                    match i % 5 {
                        0 => {}
                        1 => reg.uuid[rng.gen_range(0..16)] ^= 1 << rng.gen_range(0..8),
                        2 => reg.len = [0, export.size + 1, u64::MAX][rng.gen_range(0..3)],
                        _ => {
                            for _ in 0..rng.gen_range(1..=8) {
                                reg.handle[rng.gen_range(0..64)] ^= rng.gen_range(1..=255u8);
                            }
                        }
                    }
                    let flipped = reg.handle != export.handle;
                    match c.register_cuda_raw(&reg) {
                        Ok((id, _)) => {
                            assert!(i % 5 == 0 || flipped, "registration {i}: a bad UUID or length was accepted");
                            // The same allocation: its keys are found through the region.
                            let found = RegionRef::new(id, FOUND + 4096 * (t + 1), n);
                            let hits = c.contains_in("t", RegionRef::new(id, KEYS, n), found).unwrap();
                            assert_eq!(hits, n, "registration {i} (handle flipped: {flipped}) maps other memory");
                            ok += 1;
                            opened_flipped += u32::from(flipped);
                            c.unregister(id).unwrap();
                        }
                        Err(e) => {
                            let (code, msg) = code(e);
                            assert_ne!(i % 5, 0, "the valid handle was refused: {code:?}: {msg}");
                            // A flipped length past the connection's region
                            // limit is refused by the limit, before any open.
                            let over = code == ErrorCode::ResourceExhausted && msg.contains("max_region_bytes");
                            assert!(code == ErrorCode::BadRequest || over, "registration {i}: {code:?}: {msg}");
                            refused += 1;
                            if msg.contains("killed the process") || msg.contains("reading the") {
                                eprintln!("registration {i} of connection {t}: {msg}");
                            }
                        }
                    }
                }
                c.ping().unwrap();
                (ok, opened_flipped, refused)
            })
        })
        .collect();
    // Meanwhile: pings and finds through the fifth connection's region
    // (bounded: at most 20 000 rounds and 120 s, the fuzzers done first).
    let start = Instant::now();
    let mut rounds = 0;
    while threads.iter().any(|t| !t.is_finished()) && rounds < 20_000 && start.elapsed() < Duration::from_secs(120) {
        c.ping().unwrap();
        m.fill(OUT, n * 16, 0x41);
        assert_eq!(c.find_in("t", r.at::<u64>(KEYS, n), r.at::<u8>(FOUND, n), r.at::<f32>(OUT, n * 4)).unwrap(), n);
        assert_eq!(m.get::<f32>(OUT, n * 4), values, "round {rounds}: the rows");
        rounds += 1;
    }
    let mut total = (0, 0, 0);
    for t in threads {
        let (ok, flipped, refused) = t.join().expect("a fuzzing connection failed");
        total = (total.0 + ok, total.1 + flipped, total.2 + refused);
    }
    eprintln!("{total:?} registered / of them through flipped handles / refused; {rounds} finds meanwhile");
    assert_eq!(total.0 + total.2, 4 * 150, "every registration answered: {total:?}");
    assert!(total.0 - total.1 == 120 && total.2 >= 120, "{total:?} registered / flipped / refused");
    assert!(d.alive(), "hkvd died");
    c.ping().unwrap();
    assert_eq!(c.find_in("t", r.at::<u64>(KEYS, n), r.at::<u8>(FOUND, n), r.at::<f32>(OUT, n * 4)).unwrap(), n);
    wait_regions(&mut c, (1, export.size));
    c.unregister(r.id()).unwrap();
    wait_regions(&mut c, (0, 0));
}

/// Issue 32, items 14 and 21: finds over CUDA IPC at 3.3 G keys/s had 3.6 %
/// of their lookups reach the miss-ratio curve, and nothing said so. Finds
/// of 4 Mi keys through a device region, as fast as one client sends them,
/// for a second: the ring overflows in the first 250 ms, and the stats say
/// how many sampled keys and how many lookups the curve left out
/// (`dropped`, `dropped_lookups`, the same in Prometheus); the lookups
/// counted and those left out are every lookup served.
#[test]
#[ignore = "needs a CUDA device"]
fn finds_at_gpu_rates_account_for_every_lookup() {
    let (ctx, stream) = gpu();
    let d = cuda_daemon("1", &[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 4, 1 << 20)).unwrap();
    let stored: Vec<u64> = (1..=1u64 << 19).collect();
    for part in stored.chunks(1 << 16) {
        c.insert_or_assign("t", part, &vec![1.0; part.len() * 4], None).unwrap();
    }
    let n = 4u64 << 20;
    let bytes = n * (8 + 1 + 16);
    let alloc = DeviceAlloc::new(&ctx, bytes as usize).unwrap();
    let r = c.register_cuda(alloc.ptr(), bytes).unwrap();
    let m = Dev { alloc, stream, at: 0 };
    let keys: Vec<u64> = (0..n).map(|i| stored[(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 45) as usize]).collect();
    m.put(0, &keys);
    let (k, f, v) = (r.at::<u64>(0, n), r.at::<u8>(n * 8, n), r.at::<f32>(n * 9, n * 4));
    let start = Instant::now();
    let mut finds = 0u64;
    // Bounded: one second, at most 10 000 finds.
    while start.elapsed() < Duration::from_secs(1) && finds < 10_000 {
        assert_eq!(c.find_in("t", k, f, v).unwrap(), n);
        finds += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let served = finds * n;
    let stats = c.stats_doc().unwrap();
    let mrc = stats.tables[0].mrc.as_ref().expect("curves are on by default");
    eprintln!(
        "{served} lookups in {secs:.2} s ({:.2} G keys/s): {} counted, {} left out, {} sampled, {} samples dropped",
        served as f64 / secs / 1e9,
        mrc.accesses,
        mrc.dropped_lookups,
        mrc.sampled_accesses,
        mrc.dropped
    );
    assert!(mrc.dropped > 0 && mrc.dropped_lookups > 0, "the first interval overflows the ring");
    assert_eq!(mrc.accesses + mrc.dropped_lookups, served, "every lookup counted or counted as left out");
    let metrics = c.metrics().unwrap();
    for (name, want) in
        [("hkvd_mrc_sampled_dropped_total", mrc.dropped), ("hkvd_mrc_lookups_dropped_total", mrc.dropped_lookups)]
    {
        let line = format!("{name}{{table=\"t\"}} {want}");
        assert!(metrics.lines().any(|l| l == line), "{line} not in the metrics");
    }
    c.unregister(r.id()).unwrap();
}
