//! Registered regions over real memfds, real sockets and a real daemon:
//! region requests give the socket's answers; bad memfds, bad references,
//! other connections' ids and registrations past the caps are refused
//! with their reason; a client killed mid-request or unregistering
//! mid-request leaves nothing mapped. Hostile cases run the daemon under
//! an address-space limit (`prlimit --as`).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{expect_code, expect_error, raw_call, Daemon};
use hkv_client::proto::region::{self as wire, Head, RegionAnswer, RegionRef, RegionRequest};
use hkv_client::proto::{ErrorCode, Op};
use hkv_client::region::keyed;
use hkv_client::{Client, ClientError, Features, HashSpec, Summary, TableSpec};

const LIMIT: u64 = 6 << 30;

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

/// Every op through a region equals the same op through the socket, on
/// one shard (find written by the table in place) and three (each shard's
/// rows in turn).
#[test]
fn region_requests_answer_as_the_socket_does() {
    for shards in ["1", "3"] {
        let d = Daemon::start(&["--shards", shards]);
        let mut c = d.client();
        let dim = 4u64;
        let mut spec = TableSpec::new("t", dim as usize, 4096);
        spec.hash = Some(hkv_client::FeatureHash::fingerprint64(1 << 40));
        c.create_table(spec).unwrap();
        let r = c.register_memfd(1 << 20).unwrap();
        let n = 300u64;
        // Layout: keys at 0, values at 4096, found at 65536, out values at 69632, outcomes at 200000.
        let keys: Vec<u64> = (1..=n).collect();
        let values: Vec<f32> = (0..n * dim).map(|x| x as f32 * 0.5).collect();
        r.write(0, &keys).unwrap();
        r.write(4096, &values).unwrap();
        let s = c
            .write_in(
                u8::from(Op::InsertOrAssign),
                "t",
                r.at::<u64>(0, n),
                r.at::<f32>(4096, n * dim),
                None,
                Some(r.at::<u8>(200000, n)),
            )
            .unwrap();
        assert_eq!(s, Summary { inserted: n, ..Default::default() });
        let mut outcomes = vec![9u8; n as usize];
        r.read(200000, &mut outcomes).unwrap();
        assert!(outcomes.iter().all(|&o| o == 1), "{outcomes:?}");
        // find of present and absent keys: rows and flags as the socket's; the
        // output area holds garbage first (misses must be written as zeros).
        let probe: Vec<u64> = (n - 100..n + 100).collect();
        let m = probe.len() as u64;
        r.write(0, &probe).unwrap();
        r.write(65536, &vec![7u8; m as usize]).unwrap();
        r.write(69632, &vec![9.5f32; (m * dim) as usize]).unwrap();
        let hits = c.find_in("t", r.at::<u64>(0, m), r.at::<u8>(65536, m), r.at::<f32>(69632, m * dim)).unwrap();
        let want = c.find("t", &probe).unwrap();
        assert_eq!(hits, 101);
        let mut found = vec![0u8; m as usize];
        let mut got = vec![0f32; (m * dim) as usize];
        r.read(65536, &mut found).unwrap();
        r.read(69632, &mut got).unwrap();
        assert_eq!(found, want.found.iter().map(|&f| u8::from(f)).collect::<Vec<_>>());
        assert_eq!(got, want.values);
        // find with scores (the socket's path, rows copied in).
        let req = keyed(
            u8::from(Op::Find),
            "t",
            vec![r.at::<u64>(0, m), r.at::<u8>(65536, m), r.at::<f32>(69632, m * dim), r.at::<u64>(300000, m)],
            true,
            false,
        );
        assert_eq!(c.region_call(&req).unwrap(), RegionAnswer::Count(101));
        let ws = c.find_with_scores("t", &probe).unwrap();
        let mut sc = vec![0u64; m as usize];
        r.read(300000, &mut sc).unwrap();
        assert_eq!(Some(sc), ws.scores);
        // contains and erase with flags.
        assert_eq!(c.contains_in("t", r.at::<u64>(0, m), r.at::<u8>(65536, m)).unwrap(), 101);
        assert_eq!(c.erase_in("t", r.at::<u64>(0, 10), Some(r.at::<u8>(65536, 10))).unwrap(), 10);
        let mut erased = vec![0u8; 10];
        r.read(65536, &mut erased).unwrap();
        assert_eq!(erased, vec![1; 10]);
        // find_or_insert: values read, then written back in place.
        r.write(0, &keys[..20]).unwrap();
        r.write(4096, &vec![-1.0f32; (20 * dim) as usize]).unwrap();
        let s = c
            .write_in(u8::from(Op::FindOrInsert), "t", r.at::<u64>(0, 20), r.at::<f32>(4096, 20 * dim), None, None)
            .unwrap();
        assert_eq!((s.updated, s.inserted), (20, 0));
        let mut back = vec![0f32; (20 * dim) as usize];
        r.read(4096, &mut back).unwrap();
        assert_eq!(back, values[..(20 * dim) as usize]);
        // accum_or_assign adds the deltas.
        r.write(4096, &vec![1.0f32; (20 * dim) as usize]).unwrap();
        c.write_in(u8::from(Op::AccumOrAssign), "t", r.at::<u64>(0, 20), r.at::<f32>(4096, 20 * dim), None, None)
            .unwrap();
        assert_eq!(c.find("t", &[1]).unwrap().values, vec![1.0, 1.5, 2.0, 2.5]);
        // insert_and_evict: its evicted arrays are outputs with room for n.
        let ev = keyed(
            u8::from(Op::InsertAndEvict),
            "t",
            vec![
                r.at::<u64>(0, 20),
                r.at::<f32>(4096, 20 * dim),
                r.at::<u64>(400000, 20),
                r.at::<f32>(401000, 20 * dim),
                r.at::<u64>(402000, 20),
                r.at::<u8>(403000, 20),
            ],
            false,
            false,
        );
        assert!(matches!(c.region_call(&ev).unwrap(), RegionAnswer::Evict(s, 0) if s.updated == 20));
        // export walks the table into the region.
        let (mut total, mut cursor) = (0u64, (0u32, 0u64));
        loop {
            let req = RegionRequest {
                op: u8::from(Op::Export),
                scores: false,
                outcomes: false,
                table: "t".into(),
                head: Head::Export {
                    shard: cursor.0,
                    offset: cursor.1,
                    max_slots: 1 << 20,
                    filter: Default::default(),
                },
                refs: vec![r.at::<u64>(500000, 1000), r.at::<f32>(510000, 1000 * dim), r.at::<u64>(530000, 1000)],
                events: None,
            };
            let RegionAnswer::Export { next_shard, next_offset, count } = c.region_call(&req).unwrap() else {
                panic!()
            };
            total += count;
            if next_shard == u32::MAX {
                break;
            }
            cursor = (next_shard, next_offset);
        }
        assert_eq!(total, c.tables().unwrap()[0].size);
        // find_features with int64 features in the region equals the socket's.
        let feats: Vec<i64> = (1..=50).collect();
        r.write(600000, &feats).unwrap();
        let req = RegionRequest {
            op: u8::from(Op::FindFeatures),
            scores: false,
            outcomes: false,
            table: "t".into(),
            head: Head::Features { hash: HashSpec::Table, strings: false },
            refs: vec![r.at::<i64>(600000, 50), r.at::<u8>(65536, 50), r.at::<f32>(69632, 50 * dim)],
            events: None,
        };
        let want = c.find_features("t", HashSpec::Table, Features::Int64(feats.clone()), false).unwrap();
        let RegionAnswer::Count(h) = c.region_call(&req).unwrap() else { panic!() };
        assert_eq!(h as usize, want.found.iter().filter(|&&f| f).count());
        assert_eq!(regions(&mut c), (1, 1 << 20));
        c.unregister(r.id()).unwrap();
        assert_eq!(regions(&mut c), (0, 0));
    }
}

/// Each bad memfd is refused with what is wrong with it, and the daemon
/// keeps serving: no fd, an unsealed memfd, one smaller than asked, a pipe,
/// a regular file, a write-sealed memfd.
#[test]
fn bad_memfds_are_refused_with_their_reason() {
    let d = Daemon::start_limited(LIMIT, &[]);
    let mut c = d.client();
    // No fd with the frame.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    expect_code(raw_call(&mut s, &wire::register_memfd(5, 4096)).1, ErrorCode::BadRequest);
    // Unsealed.
    let fd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 8192).unwrap();
    let (e, m) = code(c.register_fd(fd.as_fd(), 4096).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest);
    assert!(m.contains("F_SEAL_SHRINK"), "{m}");
    // Sealed, but too small; and 0 bytes.
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK).unwrap();
    assert_eq!(code(c.register_fd(fd.as_fd(), 8193).unwrap_err()).0, ErrorCode::BadRequest);
    assert_eq!(code(c.register_fd(fd.as_fd(), 0).unwrap_err()).0, ErrorCode::BadRequest);
    assert!(c.register_fd(fd.as_fd(), 8192).is_ok());
    // A pipe and a regular file are not memfds.
    let (rd, _wr) = std::io::pipe().unwrap();
    assert_eq!(code(c.register_fd(rd.as_fd(), 4096).unwrap_err()).0, ErrorCode::BadRequest);
    let f = tempfile::tempfile().unwrap();
    f.set_len(1 << 16).unwrap();
    assert_eq!(code(c.register_fd(f.as_fd(), 4096).unwrap_err()).0, ErrorCode::BadRequest);
    // Write-sealed: cannot be mapped writable.
    let w = hkv_region::create_memfd("w", 4096).unwrap();
    let w2 = rustix::fs::memfd_create("w2", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&w2, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&w2, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::WRITE).unwrap();
    assert_eq!(code(c.register_fd(w2.as_fd(), 4096).unwrap_err()).0, ErrorCode::BadRequest);
    assert!(c.register_fd(w.as_fd(), 4096).is_ok());
    assert_eq!(regions(&mut c), (2, 8192 + 4096));
    // An fd sent with a ping is closed, not taken by the register after it.
    let ping = hkv_client::proto::frame(u8::from(Op::Ping), 0, 7, &[]);
    let fds = [w.as_fd()];
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
    anc.push(rustix::net::SendAncillaryMessage::ScmRights(&fds));
    let io = [std::io::IoSlice::new(&ping)];
    assert_eq!(rustix::net::sendmsg(&s, &io, &mut anc, rustix::net::SendFlags::empty()).unwrap(), ping.len());
    assert_eq!(common::read_answer(&mut s).0.id, 7);
    expect_code(raw_call(&mut s, &wire::register_memfd(8, 4096)).1, ErrorCode::BadRequest);
    c.ping().unwrap();
    let mut d = d;
    assert!(d.alive());
}

/// References past the end, with overflowing counts or offsets, misaligned,
/// with wrong counts, or naming another connection's region are refused,
/// and nothing is written into the client's memory.
#[test]
fn bad_references_are_refused_and_nothing_is_written() {
    let mut d = Daemon::start_limited(LIMIT, &[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 4, 1024)).unwrap();
    c.insert_or_assign("t", &[1, 2], &[1.0; 8], None).unwrap();
    let r = c.register_memfd(65536).unwrap();
    r.write(0, &[1u64, 2]).unwrap();
    r.write(1024, &[0xABu8; 4096]).unwrap();
    let untouched = |r: &hkv_client::region::Region| {
        let mut b = vec![0u8; 4096];
        r.read(1024, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0xAB), "the region was written");
    };
    let id = r.id();
    let find = |keys: RegionRef, found: RegionRef, values: RegionRef| {
        keyed(u8::from(Op::Find), "t", vec![keys, found, values], false, false)
    };
    let ok_keys = RegionRef::new(id, 0, 2);
    let ok_found = RegionRef::new(id, 1024, 2);
    let ok_values = RegionRef::new(id, 2048, 8);
    // The code, and the array (or region) at fault.
    let unknown = format!("region {}", id + 1);
    let cases: Vec<(RegionRequest, ErrorCode, &str)> = vec![
        (find(RegionRef::new(id, 65536 - 8, 2), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(RegionRef::new(id, 0, u64::MAX / 4), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(RegionRef::new(id, u64::MAX - 7, 1), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(RegionRef::new(id, 4, 2), ok_found, ok_values), ErrorCode::BadRequest, "keys"),
        (find(ok_keys, ok_found, RegionRef::new(id, 2050, 8)), ErrorCode::BadRequest, "values"),
        (find(ok_keys, ok_found, RegionRef::new(id, 2048, 7)), ErrorCode::WrongDim, "values"),
        (find(ok_keys, RegionRef::new(id, 1024, 3), ok_values), ErrorCode::LengthMismatch, "found"),
        (find(ok_keys, ok_found, RegionRef::new(id + 1, 2048, 8)), ErrorCode::NotFound, &unknown),
        // Outputs overlapping each other.
        (find(ok_keys, ok_found, RegionRef::new(id, 1024, 8)), ErrorCode::Busy, "values"),
    ];
    for (req, want, culprit) in cases {
        let (e, m) = code(c.region_call(&req).unwrap_err());
        assert_eq!(e, want, "{m}");
        assert!(m.contains(culprit), "{m} does not name {culprit}");
        untouched(&r);
    }
    // A write op with a bad output reference applies nothing.
    let size = c.tables().unwrap()[0].size;
    r.write(0, &[7u64, 8]).unwrap();
    let w = keyed(
        u8::from(Op::InsertOrAssign),
        "t",
        vec![ok_keys, RegionRef::new(id, 2048, 8), RegionRef::new(id, 70000, 2)],
        false,
        true,
    );
    assert_eq!(code(c.region_call(&w).unwrap_err()).0, ErrorCode::BadRequest);
    assert_eq!(c.tables().unwrap()[0].size, size);
    // Another connection cannot name this connection's region.
    let mut other = d.client();
    r.write(0, &[1u64, 2]).unwrap();
    let (e, m) = code(other.region_call(&find(ok_keys, ok_found, ok_values)).unwrap_err());
    assert_eq!(e, ErrorCode::NotFound, "{m}");
    assert_eq!(code(other.unregister(id).unwrap_err()).0, ErrorCode::NotFound);
    untouched(&r);
    // A truncated reference list and the flag on an op without arrays.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let mut f = find(ok_keys, ok_found, ok_values).encode(3);
    f.truncate(f.len() - 4);
    let len = (f.len() - 20) as u32;
    f[16..20].copy_from_slice(&len.to_le_bytes());
    expect_error(raw_call(&mut s, &f).1, ErrorCode::Truncated, "values");
    // The daemon still serves both connections.
    assert_eq!(c.find_in("t", ok_keys, ok_found, ok_values).unwrap(), 2);
    other.ping().unwrap();
    assert!(d.alive());
}

/// Registration past the per-connection or the total cap is refused with
/// `resource_exhausted`, naming the limit; unregistering gives it back.
#[test]
fn registration_is_capped_per_connection_and_in_total() {
    let d = Daemon::start_limited(
        LIMIT,
        &["--max-region-bytes-per-connection", "1048576", "--max-region-bytes", "1572864"],
    );
    let mut a = d.client();
    let mut b = d.client();
    let r1 = a.register_memfd(1 << 20).unwrap();
    let (e, m) = code(a.register_memfd(4096).unwrap_err());
    assert_eq!(e, ErrorCode::ResourceExhausted);
    assert!(m.contains("limits.max_region_bytes_per_connection"), "{m}");
    let (e, m) = code(b.register_memfd(1 << 20).unwrap_err());
    assert_eq!(e, ErrorCode::ResourceExhausted);
    assert!(m.contains("limits.max_region_bytes "), "{m}");
    let _r2 = b.register_memfd(512 << 10).unwrap();
    let s = a.stats().unwrap();
    assert!(a.metrics().unwrap().contains("hkvd_region_bytes 1572864"));
    assert_eq!(s["regions"]["bytes"], 1572864);
    assert_eq!(s["regions"]["max_region_bytes"], 1572864);
    a.unregister(r1.id()).unwrap();
    a.register_memfd(4096).unwrap();
    // Closing a connection releases its regions.
    drop(b);
    let t = Instant::now();
    while regions(&mut a).1 != 4096 {
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", regions(&mut a));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Lines of /proc/PID/maps naming a client memfd.
fn memfd_maps(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap().lines().filter(|l| l.contains("hkvd-region")).count()
}

fn wait_released(c: &mut Client, pid: u32) {
    let t = Instant::now();
    while regions(c) != (0, 0) || memfd_maps(pid) != 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}, {} maps", regions(c), memfd_maps(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The child of `a_client_killed_mid_request_leaves_nothing_mapped`:
/// registers a region, sends finds writing into it without reading the
/// answers, says so, and waits to be killed.
#[test]
#[ignore = "run as a child process by a_client_killed_mid_request_leaves_nothing_mapped"]
fn child_sends_finds_into_its_region() {
    let Ok(socket) = std::env::var("HKVD_TEST_SOCKET") else { return };
    let mut c = Client::connect(socket).unwrap();
    let (n, dim) = (1u64 << 18, 8u64);
    let per = n * 9 + n * dim * 4;
    let r = c.register_memfd(8 + 8 * per).unwrap();
    r.write(0, &(1..=n).collect::<Vec<u64>>()).unwrap();
    for i in 0..8 {
        let base = n * 8 + i * (n + n * dim * 4);
        let base = base.next_multiple_of(8);
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

/// A client killed (SIGKILL) while finds write into its region: the daemon
/// lives on, unmaps the region once those finds are done, and its stats and
/// /proc/PID/maps show nothing left.
#[test]
fn a_client_killed_mid_request_leaves_nothing_mapped() {
    let mut d = Daemon::start_limited(LIMIT, &[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 8, 1 << 19)).unwrap();
    let keys: Vec<u64> = (1..=1 << 18).collect();
    c.insert_or_assign("t", &keys, &vec![0.5; keys.len() * 8], None).unwrap();
    for _ in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_sends_finds_into_its_region", "--ignored", "--nocapture"])
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
        wait_released(&mut c, d.pid());
        assert!(d.alive(), "hkvd died");
        assert_eq!(c.find("t", &[1, 2]).unwrap().found, vec![true, true]);
    }
}

/// Unregister while requests using the region are in flight: answered at
/// once, the finds complete and answer, and the region goes with the last.
#[test]
fn unregister_while_requests_are_in_flight() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 8, 1 << 19)).unwrap();
    let n = 1u64 << 17;
    let keys: Vec<u64> = (1..=n).collect();
    c.insert_or_assign("t", &keys, &vec![0.5; keys.len() * 8], None).unwrap();
    let per = n + n * 32;
    let r = c.register_memfd(n * 8 + 4 * per).unwrap();
    r.write(0, &keys).unwrap();
    let mut ids = vec![];
    for i in 0..4 {
        let base = n * 8 + i * per;
        let req = keyed(
            u8::from(Op::Find),
            "t",
            vec![r.at::<u64>(0, n), r.at::<u8>(base, n), r.at::<f32>(base + n, n * 8)],
            false,
            false,
        );
        ids.push(c.send_region(&req).unwrap());
    }
    c.send_raw(&wire::unregister(99, r.id())).unwrap();
    let mut answered = 0;
    for _ in 0..5 {
        let (h, body) = c.recv_frame().unwrap();
        if h.id == 99 {
            assert_eq!(h.op, wire::UNREGISTER);
        } else {
            assert!(ids.contains(&h.id));
            assert_eq!(RegionAnswer::decode(u8::from(Op::Find), &body).unwrap(), RegionAnswer::Count(n));
            answered += 1;
        }
    }
    assert_eq!(answered, 4);
    let mut found = vec![0u8; n as usize];
    r.read(n * 8 + 3 * per, &mut found).unwrap();
    assert!(found.iter().all(|&f| f == 1));
    let (e, _) = code(c.find_in("t", r.at::<u64>(0, n), r.at::<u8>(n * 8, n), r.at::<f32>(n * 9, n * 8)).unwrap_err());
    assert_eq!(e, ErrorCode::NotFound);
    wait_released(&mut c, d.pid());
}

/// String features (Arrow offsets and bytes in the region),
/// find_or_insert_features, load with scores and assign_scores through a
/// region equal their socket forms.
#[test]
fn feature_and_score_ops_through_a_region() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let mut spec = TableSpec::new("t", 2, 4096);
    spec.policy = hkv_client::proto::Policy::Lfu;
    // Plain counts: the reference tie rule (the default rule packs a clock into lfu scores).
    spec.lfu_ties = hkv_client::proto::LfuTies::LowestSlot;
    spec.hash = Some(hkv_client::FeatureHash::fingerprint64(1 << 30));
    c.create_table(spec).unwrap();
    let r = c.register_memfd(1 << 16).unwrap();
    let names = ["apple", "pear", "", "fig"];
    let mut offsets = vec![0u32];
    let mut bytes = vec![];
    for n in names {
        bytes.extend_from_slice(n.as_bytes());
        offsets.push(bytes.len() as u32);
    }
    r.write(0, &offsets).unwrap();
    r.write(64, &bytes).unwrap();
    r.write(128, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).unwrap();
    let feats = |len: u64| vec![r.at::<u32>(0, 5), r.at::<u8>(64, len)];
    let mut refs = feats(bytes.len() as u64);
    refs.push(r.at::<f32>(128, 8));
    refs.push(r.at::<u8>(256, 4));
    let req = RegionRequest {
        op: u8::from(Op::FindOrInsertFeatures),
        scores: false,
        outcomes: true,
        table: "t".into(),
        head: Head::Features { hash: HashSpec::Table, strings: true },
        refs,
        events: None,
    };
    let RegionAnswer::Write(s) = c.region_call(&req).unwrap() else { panic!() };
    assert_eq!(s.inserted, 4);
    let mut o = [0u8; 4];
    r.read(256, &mut o).unwrap();
    assert_eq!(o, [1; 4]);
    let keys = c.hash("t", HashSpec::Table, Features::strings(&names)).unwrap();
    assert_eq!(c.find("t", &keys).unwrap().values, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    // The same features found through the region.
    let mut refs = feats(bytes.len() as u64);
    refs.extend([r.at::<u8>(300, 4), r.at::<f32>(320, 8)]);
    let req = RegionRequest { op: u8::from(Op::FindFeatures), outcomes: false, refs, ..req };
    assert_eq!(c.region_call(&req).unwrap(), RegionAnswer::Count(4));
    let mut v = [0f32; 8];
    r.read(320, &mut v).unwrap();
    assert_eq!(v, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    // Offsets past the bytes: the socket's error.
    let mut refs = feats(3);
    refs.extend([r.at::<u8>(300, 4), r.at::<f32>(320, 8)]);
    let (e, m) = code(c.region_call(&RegionRequest { refs, ..req }).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest, "{m}");
    // load keeps scores verbatim; assign_scores adds (lfu) and reports outcomes.
    r.write(1024, &keys).unwrap();
    r.write(2048, &[10u64, 20, 30, 40]).unwrap();
    let load = keyed(
        u8::from(Op::Load),
        "t",
        vec![r.at::<u64>(1024, 4), r.at::<f32>(128, 8), r.at::<u64>(2048, 4)],
        true,
        false,
    );
    assert!(matches!(c.region_call(&load).unwrap(), RegionAnswer::Write(s) if s.updated == 4));
    let asg = keyed(
        u8::from(Op::AssignScores),
        "t",
        vec![r.at::<u64>(1024, 4), r.at::<u64>(2048, 4), r.at::<u8>(3000, 4)],
        true,
        true,
    );
    assert!(matches!(c.region_call(&asg).unwrap(), RegionAnswer::Write(s) if s.updated == 4));
    assert_eq!(c.find_with_scores("t", &keys).unwrap().scores, Some(vec![20, 40, 60, 80]));
    // Scores on an op without SCORES: the region request is as long as the flags say.
    let bad = keyed(
        u8::from(Op::Find),
        "t",
        vec![r.at::<u64>(1024, 4), r.at::<u8>(300, 4), r.at::<f32>(320, 8)],
        false,
        false,
    );
    let mut f = bad.encode(5);
    f.extend_from_slice(&[0u8; 20]);
    let len = (f.len() - 20) as u32;
    f[16..20].copy_from_slice(&len.to_le_bytes());
    c.send_raw(&f).unwrap();
    let e = c.recv_frame().unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
}

/// On the CUDA backend a region is page-locked when registered: finds into
/// it (one shard: the device copies the rows in; two shards on one GPU: the
/// lookup kernel writes them in place) equal the socket's answers.
#[test]
#[ignore = "needs a CUDA device"]
fn regions_on_the_cuda_backend_answer_as_the_socket_does() {
    for shards in ["1", "2"] {
        let d = Daemon::start(&["--backend", "cuda", "--shards", shards]);
        let mut c = d.client();
        c.create_table(TableSpec::new("t", 16, 1 << 16)).unwrap();
        let n = 5000u64;
        let keys: Vec<u64> = (1..=n).collect();
        let values: Vec<f32> = (0..n * 16).map(|x| x as f32).collect();
        c.insert_or_assign("t", &keys, &values, None).unwrap();
        let r = c.register_memfd(4 << 20).unwrap();
        let probe: Vec<u64> = (n / 2..n + n / 2).collect();
        let m = probe.len() as u64;
        r.write(0, &probe).unwrap();
        r.write(1 << 20, &vec![3.5f32; (m * 16) as usize]).unwrap();
        let hits = c.find_in("t", r.at::<u64>(0, m), r.at::<u8>(65536, m), r.at::<f32>(1 << 20, m * 16)).unwrap();
        let want = c.find("t", &probe).unwrap();
        assert_eq!(hits as usize, want.found.iter().filter(|&&f| f).count());
        let mut got = vec![0f32; (m * 16) as usize];
        r.read(1 << 20, &mut got).unwrap();
        assert_eq!(got, want.values, "{shards} shards");
        c.unregister(r.id()).unwrap();
        assert_eq!(regions(&mut c), (0, 0));
    }
}

/// The daemon's copies of a region request are bounded like a socket
/// request's body: a write whose arrays pass `limits.max_frame_bytes` is
/// `oversized`, while a find whose rows are written in place is not.
#[test]
fn region_copies_are_bounded_like_socket_bodies() {
    let d = Daemon::start_limited(LIMIT, &["--max-frame-bytes", "65536"]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 32, 1 << 14)).unwrap();
    let r = c.register_memfd(4 << 20).unwrap();
    let n = 4096u64;
    r.write(0, &(1..=n).collect::<Vec<u64>>()).unwrap();
    let (e, m) = code(c.insert_or_assign_in("t", r.at::<u64>(0, n), r.at::<f32>(65536, n * 32), None).unwrap_err());
    assert_eq!(e, ErrorCode::Oversized);
    assert!(m.contains("limits.max_frame_bytes"), "{m}");
    assert_eq!(c.tables().unwrap()[0].size, 0);
    // 4096 keys (32 KiB copied) find 4096 rows of 128 bytes in place.
    assert_eq!(c.find_in("t", r.at::<u64>(0, n), r.at::<u8>(32768, n), r.at::<f32>(65536, n * 32)).unwrap(), 0);
    // A smaller write passes.
    c.insert_or_assign_in("t", r.at::<u64>(0, 64), r.at::<f32>(65536, 64 * 32), None).unwrap();
    assert_eq!(c.find_in("t", r.at::<u64>(0, n), r.at::<u8>(32768, n), r.at::<f32>(65536, n * 32)).unwrap(), 64);
}

/// An unregister and a find of its region sent in one write: the find
/// was run on the region (100 times of 100), though PROTOCOL.md says an
/// unregister read first always takes effect first. The unregister's
/// task took the region off the connection only when it ran, after the
/// find had been read holding it; the region now goes as the unregister
/// is read.
#[test]
fn an_unregister_read_first_is_never_overtaken() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("t", 2, 1024)).unwrap();
    for _ in 0..50 {
        let r = c.register_memfd(4096).unwrap();
        r.write(0, &[1u64, 2]).unwrap();
        let find = keyed(
            u8::from(Op::Find),
            "t",
            vec![r.at::<u64>(0, 2), r.at::<u8>(16, 2), r.at::<f32>(32, 4)],
            false,
            false,
        );
        let mut both = wire::unregister(1 << 40, r.id());
        both.extend(find.encode((1 << 40) + 1));
        c.send_raw(&both).unwrap();
        let mut got = vec![];
        for _ in 0..2 {
            got.push(match c.recv_frame() {
                Ok((h, _)) => Ok(h.op),
                Err(e) => Err(code(e).0),
            });
        }
        assert!(got.contains(&Ok(wire::UNREGISTER)) && got.contains(&Err(ErrorCode::NotFound)), "{got:?}");
    }
}

/// Every memfd the daemon could not map was said to carry a write seal,
/// also one reopened read-only (EACCES), which has none: the seal is named
/// only when the fd has it, else what the mapping's errno means.
#[test]
fn an_unmappable_memfd_is_refused_with_its_own_reason() {
    let d = Daemon::start_limited(LIMIT, &[]);
    let mut c = d.client();
    let fd = hkv_region::create_memfd("ro", 8192).unwrap();
    let ro = std::fs::File::open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd))).unwrap();
    let (e, m) = code(c.register_fd(ro.as_fd(), 4096).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest);
    assert!(!m.contains("F_SEAL_WRITE"), "{m}");
    let w = rustix::fs::memfd_create("w", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&w, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&w, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::WRITE).unwrap();
    let (e, m) = code(c.register_fd(w.as_fd(), 4096).unwrap_err());
    assert_eq!(e, ErrorCode::BadRequest);
    assert!(m.contains("F_SEAL_WRITE"), "{m}");
}
