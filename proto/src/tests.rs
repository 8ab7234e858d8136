//! Round trips of every request and response shape, frames built in place,
//! and the fuzzer's seed corpus.

use crate::frame::{FindFrame, FrameBuf};
use crate::*;

#[test]
fn a_request_whose_fields_do_not_fit_is_not_encoded() {
    let ok = Request::Find { table: "t".into(), keys: vec![1], scores: true };
    let f = ok.try_encode_into(7, Vec::new()).unwrap();
    assert_eq!(f, ok.encode(7));
    let long = Request::Find { table: "x".repeat(70_000), keys: vec![1], scores: false };
    let (e, buf) = long.try_encode_into(7, Vec::with_capacity(1 << 20)).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
    assert!(buf.capacity() >= 1 << 20, "the buffer comes back");
}

fn round(req: Request) {
    let f = req.encode(42);
    // Into a buffer that held a longer frame: the same bytes.
    assert_eq!(req.encode_into(42, vec![0xab; f.len() + 100]), f);
    let FrameCheck::Ready(h) = check_frame(&f, u32::MAX).unwrap() else { panic!() };
    assert_eq!(h.id, 42);
    assert_eq!(Request::decode(&h, &f[crate::HEADER_LEN..]).unwrap(), req);
}

fn round_resp(op: Op, resp: Response) {
    let f = resp.encode(op, 7);
    let FrameCheck::Ready(h) = check_frame(&f, u32::MAX).unwrap() else { panic!() };
    assert_eq!(Response::decode(&h, &f[crate::HEADER_LEN..]).unwrap(), resp);
}

#[test]
fn a_find_frame_built_in_place_decodes_as_a_find() {
    for n in [0usize, 1, 3, 4] {
        let dim = 2;
        let mut ff = FindFrame::new(n, dim);
        let (found, values) = ff.parts_mut();
        assert_eq!((found.len(), values.len()), (n, n * dim * 4));
        // Every other key found, with values k + 0.5, k + 1.5.
        let mut want_vals = vec![0.0f32; n * dim];
        let mut want_found = vec![0u8; n];
        for k in (0..n).step_by(2) {
            found[k] = 1;
            want_found[k] = 1;
            for j in 0..dim {
                let x = k as f32 + j as f32 + 0.5;
                values[(k * dim + j) * 4..(k * dim + j + 1) * 4].copy_from_slice(&x.to_le_bytes());
                want_vals[k * dim + j] = x;
            }
        }
        let want = Response::Find { found: want_found, values: want_vals, scores: None };
        let resp = ff.into_response();
        let copied = resp.encode(Op::Find, 9);
        let moved = resp.into_frame(Op::Find, 9);
        let moved = moved.bytes();
        assert_eq!(copied, moved, "n {n}");
        let FrameCheck::Ready(h) = check_frame(moved, u32::MAX).unwrap() else { panic!() };
        assert_eq!((h.op, h.id, h.flags), (Op::Find as u8, 9, flags::RESPONSE));
        assert_eq!(Response::decode(&h, &moved[crate::HEADER_LEN..]).unwrap(), want, "n {n}");
        // Into arrays that held a longer answer: the same answer, in
        // their memory.
        let (f, v) = (vec![7u8; n + 9], vec![7.0f32; (n + 9) * dim]);
        let (fp, vp) = (f.as_ptr(), v.as_ptr());
        let got = Response::decode_into(&h, &moved[crate::HEADER_LEN..], f, v).unwrap();
        let Response::Find { found, values, .. } = &got else { panic!() };
        assert_eq!((found.as_ptr(), values.as_ptr()), (fp, vp), "n {n}: memory reused");
        assert_eq!(got, want, "n {n}");
    }
}

/// Memory of a fixed capacity standing in for pinned memory.
struct Fixed(Vec<u8>, usize);
impl crate::FrameMemory for Fixed {
    fn bytes(&self) -> &[u8] {
        &self.0[..self.1]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0[..self.1]
    }
    fn capacity(&self) -> usize {
        self.0.len()
    }
    fn set_len(&mut self, len: usize) {
        assert!(len <= self.0.len());
        self.1 = len;
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

#[test]
fn a_find_frame_in_other_memory_sends_the_same_bytes() {
    let (n, dim) = (5usize, 3usize);
    let fill = |ff: &mut FindFrame| {
        let (found, values) = ff.parts_mut();
        found.fill(1);
        for (i, b) in values.iter_mut().enumerate() {
            *b = i as u8;
        }
    };
    let mut a = FindFrame::new(n, dim);
    fill(&mut a);
    // Stale bytes in a larger memory: every byte sent is still written.
    let mut b = FindFrame::reuse(FrameBuf::Other(Box::new(Fixed(vec![0xee; 4096], 0))), n, dim);
    fill(&mut b);
    let (a, b) = (a.into_response().into_frame(Op::Find, 3), b.into_response().into_frame(Op::Find, 3));
    assert!(matches!(b, FrameBuf::Other(_)));
    assert_eq!(a.bytes(), b.bytes());
    // Other memory cannot grow past its capacity: a zeroed vector then.
    let mut small = FrameBuf::Other(Box::new(Fixed(vec![0xee; 16], 16)));
    small.set_len(100);
    assert!(matches!(&small, FrameBuf::Vec(v) if v.len() == 100 && v.iter().all(|&x| x == 0)));
}

#[test]
fn requests_round_trip() {
    let t = "emb".to_string();
    round(Request::Ping);
    round(Request::Echo { reply_len: 100, padding: 12 });
    round(Request::Find { table: t.clone(), keys: vec![1, 2], scores: true });
    round(Request::Contains { table: t.clone(), keys: vec![3] });
    for op in WriteOp::ALL {
        round(Request::Write {
            op,
            table: t.clone(),
            keys: vec![1],
            values: vec![0.5, 1.5],
            scores: Some(vec![9]),
            outcomes: true,
        });
    }
    round(Request::AssignScores { table: t.clone(), keys: vec![1], scores: None, outcomes: false });
    round(Request::Erase { table: t.clone(), keys: vec![1, 2, 3], outcomes: true });
    round(Request::EraseIf { table: t.clone(), filter: Filter { min_score: 3, ..Filter::default() } });
    round(Request::Clear { table: t.clone() });
    round(Request::Export {
        table: t.clone(),
        cursor: Cursor { shard: 2, offset: 128 },
        max_slots: 4096,
        filter: Filter::default(),
    });
    round(Request::SetEpoch { table: t.clone(), epoch: 5 });
    round(Request::Reserve { table: t.clone(), capacity: 1 << 20 });
    let strong = FeatureHash { kind: HashKind::Strong, num_buckets: 10, key: [1, 2] };
    round(Request::Hash {
        table: String::new(),
        hash: HashSpec::Given(strong),
        features: Features::Int64(vec![-1, 5]),
    });
    round(Request::FindFeatures {
        table: t.clone(),
        hash: HashSpec::Table,
        features: Features::strings(&["a", "", "bcd"]),
        scores: true,
    });
    round(Request::FindOrInsertFeatures {
        table: t,
        hash: HashSpec::Given(FeatureHash::fingerprint64(1 << 20)),
        features: Features::Int64(vec![7]),
        values: vec![0.5, 1.5],
        scores: Some(vec![3]),
        outcomes: true,
    });
    round(Request::Control(Control::CreateTable(TableSpec::new("x", 8, 1024))));
    round(Request::Control(Control::DropTable { name: "x".into() }));
    round(Request::Control(Control::Flush { table: "x".into() }));
    round(Request::Control(Control::Checkpoint { wait: true, full: false }));
    round(Request::Control(Control::Restore { id: CheckpointId::Latest }));
    round(Request::Control(Control::Restore { id: CheckpointId::Id(0xff) }));
    round(Request::Control(Control::Trace { table: "t".into(), seconds: 5 }));
    for c in [Control::ListTables, Control::Stats, Control::Metrics, Control::Shutdown, Control::ListCheckpoints] {
        round(Request::Control(c));
    }
}

#[test]
fn trace_bodies_are_as_specified() {
    // PROTOCOL.md, "trace": f64 bits, a truncated byte, then u64s.
    let f = Response::Trace { rate: 0.5, truncated: false, keys: vec![9] }.encode(Op::Trace, 1);
    let body = &f[crate::HEADER_LEN..];
    assert_eq!(body, [&0.5f64.to_bits().to_le_bytes()[..], &[0], &1u32.to_le_bytes(), &9u64.to_le_bytes()].concat());
    let h = crate::Header { op: Op::Trace.into(), flags: 0, id: 1, body_len: 0 };
    for bad in [r#"{"table":"t","seconds":0}"#, r#"{"table":"t","seconds":3601}"#, r#"{"table":"t"}"#] {
        assert!(Request::decode(&h, bad.as_bytes()).is_err(), "{bad}");
    }
}

#[test]
fn responses_round_trip() {
    round_resp(Op::Ping, Response::Empty);
    round_resp(Op::Echo, Response::Echo { len: 33 });
    round_resp(Op::Find, Response::Find { found: vec![1, 0], values: vec![1.0, 0.0], scores: Some(vec![5, 0]) });
    round_resp(Op::Contains, Response::Contains { found: vec![1] });
    let summary = Summary { updated: 1, inserted: 2, evicted: 3, rejected: 4, absent: 5 };
    round_resp(Op::InsertOrAssign, Response::Write { summary, outcomes: Some(vec![1]), values: None, evicted: None });
    round_resp(Op::FindOrInsert, Response::Write { summary, outcomes: None, values: Some(vec![2.0]), evicted: None });
    let ev = Evicted { keys: vec![4], values: vec![1.0], scores: vec![2], kinds: vec![0] };
    round_resp(Op::InsertAndEvict, Response::Write { summary, outcomes: None, values: None, evicted: Some(ev) });
    round_resp(Op::Erase, Response::Erased { count: 2, flags: Some(vec![1, 1, 0]) });
    round_resp(Op::EraseIf, Response::Erased { count: 2, flags: None });
    round_resp(
        Op::Export,
        Response::Export {
            next: Some(Cursor { shard: 1, offset: 9 }),
            keys: vec![1],
            values: vec![0.5],
            scores: vec![3],
        },
    );
    round_resp(Op::Export, Response::Export { next: None, keys: vec![], values: vec![], scores: vec![] });
    round_resp(Op::Stats, Response::Json(b"{\"a\":1}".to_vec()));
    round_resp(Op::Hash, Response::Keys(vec![1, 2, 3]));
    round_resp(Op::Trace, Response::Trace { rate: 0.015625, truncated: true, keys: vec![7, 1 << 40] });
    round_resp(Op::FindFeatures, Response::Find { found: vec![1], values: vec![1.0], scores: None });
    round_resp(
        Op::FindOrInsertFeatures,
        Response::Write { summary, outcomes: Some(vec![1]), values: Some(vec![2.0]), evicted: None },
    );
    round_resp(Op::Metrics, Response::Text("hkvd_up 1\n".into()));
    round_resp(Op::Find, Response::Error(ProtoError::new(ErrorCode::UnknownTable, "no table \"x\"")));
}

#[test]
fn unknown_op_and_trailing_bytes_are_named() {
    let f = crate::frame(0x77, 0, 1, b"");
    let FrameCheck::Ready(h) = check_frame(&f, 100).unwrap() else { panic!() };
    assert_eq!(Request::decode(&h, b"").unwrap_err().code, ErrorCode::UnknownOp);
    let mut f = Request::Clear { table: "t".into() }.encode(1);
    f.push(0);
    f[16] += 1;
    let FrameCheck::Ready(h) = check_frame(&f, 100).unwrap() else { panic!() };
    assert_eq!(Request::decode(&h, &f[20..]).unwrap_err().code, ErrorCode::BadRequest);
    // A load's scores without the SCORES flag: the error names the flag.
    let load = Request::Write {
        op: WriteOp::Load,
        table: "t".into(),
        keys: vec![1],
        values: vec![1.0],
        scores: Some(vec![5]),
        outcomes: false,
    };
    let mut f = load.encode(1);
    let flags = u16::from_le_bytes([f[6], f[7]]) & !crate::header::flags::SCORES;
    f[6..8].copy_from_slice(&flags.to_le_bytes());
    let FrameCheck::Ready(h) = check_frame(&f, 1000).unwrap() else { panic!() };
    let e = Request::decode(&h, &f[20..]).unwrap_err();
    assert!(e.code == ErrorCode::BadRequest && e.message.contains("SCORES header flag"), "{e:?}");
    assert!(e.message.contains("which load requires"), "{e:?}");
}

/// Writes the fuzzer's seed corpus: one encoded frame of every request and
/// response shape, into `proto/fuzz/corpus/frame`:
/// `cargo test -p hkv-proto -- --ignored corpus`
#[test]
#[ignore = "writes the fuzz seed corpus"]
fn write_fuzz_corpus() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join("corpus").join("frame");
    std::fs::create_dir_all(&dir).unwrap();
    let t = "emb".to_string();
    let mut frames: Vec<Vec<u8>> = vec![
        Request::Ping.encode(1),
        Request::Echo { reply_len: 64, padding: 8 }.encode(2),
        Request::Find { table: t.clone(), keys: vec![1, 2, 3], scores: true }.encode(3),
        Request::Contains { table: t.clone(), keys: vec![9] }.encode(4),
        Request::AssignScores { table: t.clone(), keys: vec![1], scores: Some(vec![2]), outcomes: true }.encode(5),
        Request::Erase { table: t.clone(), keys: vec![1, 2], outcomes: true }.encode(6),
        Request::EraseIf { table: t.clone(), filter: Filter::default() }.encode(7),
        Request::Clear { table: t.clone() }.encode(8),
        Request::Export { table: t.clone(), cursor: Cursor::default(), max_slots: 128, filter: Filter::default() }
            .encode(9),
        Request::SetEpoch { table: t.clone(), epoch: 3 }.encode(10),
        Request::Reserve { table: t.clone(), capacity: 4096 }.encode(11),
        Request::Control(Control::CreateTable(TableSpec::new("emb", 4, 1024))).encode(12),
        Request::Control(Control::DropTable { name: "emb".into() }).encode(13),
        Request::Control(Control::Stats).encode(14),
        Response::Find { found: vec![1, 0], values: vec![1.0, 2.0], scores: None }.encode(Op::Find, 15),
        Response::Error(ProtoError::new(ErrorCode::Truncated, "x")).encode(Op::Find, 16),
        Response::Export { next: None, keys: vec![1], values: vec![0.5], scores: vec![2] }.encode(Op::Export, 17),
        Request::Hash {
            table: String::new(),
            hash: HashSpec::Given(FeatureHash::fingerprint64(1000)),
            features: Features::Int64(vec![-1, 7]),
        }
        .encode(18),
        Request::FindFeatures {
            table: t.clone(),
            hash: HashSpec::Table,
            features: Features::strings(&["a", "bc"]),
            scores: true,
        }
        .encode(19),
        Request::FindOrInsertFeatures {
            table: t.clone(),
            hash: HashSpec::Given(FeatureHash { kind: HashKind::Strong, num_buckets: 9, key: [1, 2] }),
            features: Features::strings(&["x"]),
            values: vec![0.5; 4],
            scores: None,
            outcomes: true,
        }
        .encode(20),
    ];
    for (i, code) in WriteOp::ALL.iter().enumerate() {
        let req = Request::Write {
            op: *code,
            table: t.clone(),
            keys: vec![5, 6],
            values: vec![0.5; 4],
            scores: Some(vec![1, 2]),
            outcomes: true,
        };
        frames.push(req.encode(100 + i as u64));
    }
    let pipelined: Vec<u8> = frames[..4].concat();
    frames.push(pipelined);
    for (i, f) in frames.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), f).unwrap();
    }
}

/// A client written from PROTOCOL.md alone got JSON errors naming Rust
/// types ("expected usize"); they are said in JSON's words now.
#[test]
fn json_errors_name_no_rust_types() {
    for body in [
        r#"{"name":"t","dim":-1,"capacity":8}"#,
        r#"{"name":"t","dim":1.5,"capacity":8}"#,
        r#"{"name":"t","dim":2,"capacity":"8"}"#,
        r#"[1,2]"#,
    ] {
        let h = Header { op: Op::CreateTable.into(), flags: 0, id: 1, body_len: body.len() as u32 };
        let e = Request::decode(&h, body.as_bytes()).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        for rust in ["usize", "u64", "u32", "struct ", "TableSpec"] {
            assert!(!e.message.contains(rust), "{body}: {}", e.message);
        }
    }
}

/// A table spec names its backing tier in JSON; a spec without one is
/// encoded exactly as before the field existed.
#[test]
fn table_specs_carry_their_backing() {
    use crate::{BackingMode, BackingSpec, TableSpec};
    let plain = serde_json::to_string(&TableSpec::new("t", 4, 1024)).unwrap();
    assert!(!plain.contains("backing"));
    let spec = TableSpec {
        backing: Some(BackingSpec::from_list("redis://127.0.0.1:7001, 127.0.0.1:7002", BackingMode::WriteThrough)),
        ..TableSpec::new("t", 4, 1024)
    };
    let json = serde_json::to_string(&spec).unwrap();
    assert!(
        json.contains(r#""backing":{"seeds":["redis://127.0.0.1:7001","127.0.0.1:7002"],"mode":"write-through"}"#),
        "{json}"
    );
    assert_eq!(serde_json::from_str::<TableSpec>(&json).unwrap(), spec);
    let bad = r#"{"name":"t","dim":1,"capacity":1,"backing":{"seeds":["h:1"],"mode":"sideways"}}"#;
    assert!(serde_json::from_str::<TableSpec>(bad).unwrap_err().to_string().contains("sideways"));
    let unknown = r#"{"name":"t","dim":1,"capacity":1,"backing":{"seeds":["h:1"],"colour":"red"}}"#;
    assert!(serde_json::from_str::<TableSpec>(unknown).is_err());
    assert_eq!("write-back".parse::<BackingMode>().unwrap(), BackingMode::WriteBack);
}

/// Checkpoints keep a backing's seeds redacted: a password becomes `***`
/// (a user name stays, a seed without a password is left alone), which
/// says that a restore needs the password again; `with_password` puts one
/// back, percent-encoded, in every seed that had one.
#[test]
fn backing_passwords_are_hidden_and_given_back() {
    use crate::{BackingMode, BackingSpec};
    let spec = BackingSpec::from_list(
        "redis://:pw@h:1,redis://bob:pw@h:2,redis://bob@h:3,h:4,redis://h:5",
        BackingMode::WriteThrough,
    );
    assert!(!spec.password_hidden());
    let hidden = spec.redacted();
    assert_eq!(hidden.seeds, ["redis://:***@h:1", "redis://bob:***@h:2", "redis://bob@h:3", "h:4", "redis://h:5"]);
    assert!(hidden.password_hidden());
    assert!(!BackingSpec::from_list("redis://bob@h:3,h:4", BackingMode::ReadOnly).redacted().password_hidden());
    // An empty password is not hidden: a restore could never fill it in
    // (a config-file table with `redis://:@…` is not made passwordless by
    // create-table's normalisation).
    let empty = BackingSpec::from_list("redis://:@h:6,redis://bob:@h:7", BackingMode::ReadOnly).redacted();
    assert_eq!(empty.seeds, ["redis://:@h:6", "redis://bob:@h:7"]);
    assert!(!empty.password_hidden());
    let back = hidden.with_password("p@ss:w/rd é");
    assert_eq!(back.seeds[0], "redis://:p%40ss%3Aw%2Frd%20%C3%A9@h:1");
    assert_eq!(back.seeds[1], "redis://bob:p%40ss%3Aw%2Frd%20%C3%A9@h:2");
    assert_eq!(back.seeds[2..], spec.seeds[2..]);
    assert!(!back.password_hidden());
}

/// A write's summary as hkvctl prints it: each key counted once.
#[test]
fn a_summary_counts_each_key_once() {
    let s = Summary { updated: 1, inserted: 2, evicted: 3, rejected: 4, absent: 0 };
    assert_eq!(s.to_string(), "5 inserted (3 of them by evicting another entry), 1 updated, 4 rejected");
    assert_eq!(s.inserted_total(), 5, "the inserted the line counts");
    let s = Summary { inserted: 2, absent: 7, ..Default::default() };
    assert_eq!(s.to_string(), "2 inserted, 0 updated, 0 rejected, 7 absent");
}

/// Errors print the code as the documents name it.
#[test]
fn error_codes_print_their_wire_names() {
    assert_eq!(ErrorCode::NotFound.to_string(), "not_found");
    assert_eq!(ErrorCode::BackingUnavailable.to_string(), "backing_unavailable");
    assert_eq!(ProtoError::new(ErrorCode::UnknownTable, "x").to_string(), "unknown_table: x");
}

/// A create_table whose max_load_factor is NaN or infinite is refused
/// before it is sent: JSON carries neither, serde writes null, and the
/// daemon took that for "the default" (a tester's `--max-load-factor nan`
/// made a table that grew at 0.5).
#[test]
fn a_load_factor_json_cannot_carry_is_refused() {
    for f in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let spec = TableSpec { max_load_factor: Some(f), ..TableSpec::new("x", 8, 1024) };
        let (e, _) = Request::Control(Control::CreateTable(spec)).try_encode_into(1, Vec::new()).unwrap_err();
        assert!(e.message.contains("max_load_factor") && e.message.contains("(0, 1]"), "{}", e.message);
    }
    let ok = TableSpec { max_load_factor: Some(0.75), ..TableSpec::new("x", 8, 1024) };
    assert!(Request::Control(Control::CreateTable(ok)).try_encode_into(1, Vec::new()).is_ok());
}

/// serde's derived structs read a JSON array field by field, so
/// `create_table ["t",4,1000]` created a table and `checkpoint [true,true]`,
/// `restore ["latest"]`, `drop_table ["t"]`, `trace ["t",1]` and
/// `flush ["t"]` ran; a `hash` of `["strong",5,[1,2]]` was a hash. Every
/// body and nested object is a JSON object in PROTOCOL.md: arrays are
/// refused, naming the body or field.
#[test]
fn json_arrays_are_not_objects() {
    let refused = [
        (Op::CreateTable, r#"["t",4,1000]"#, "create_table body:"),
        (Op::CreateTable, r#"{"name":"t","dim":4,"capacity":1000,"hash":["strong",5,[1,2]]}"#, "field hash"),
        (Op::CreateTable, r#"{"name":"t","dim":4,"capacity":1000,"backing":[["h:1"]]}"#, "field backing"),
        (Op::Checkpoint, "[true,true]", "checkpoint body"),
        (Op::Checkpoint, "[]", "checkpoint body"),
        (Op::Restore, r#"["latest"]"#, "restore body"),
        (Op::DropTable, r#"["t"]"#, "drop_table body"),
        (Op::Trace, r#"["t",1]"#, "trace body"),
        (Op::Flush, r#"["t"]"#, "flush body"),
    ];
    for (op, body, culprit) in refused {
        let h = Header { op: op.into(), flags: 0, id: 1, body_len: body.len() as u32 };
        let e = Request::decode(&h, body.as_bytes()).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{body}");
        assert!(e.message.contains(culprit), "{body}: {}", e.message);
    }
    // Arrays the spec does define still read: a hash key, the seeds.
    let body = r#"{"name":"t","dim":4,"capacity":1000,"hash":{"kind":"strong","num_buckets":5,"key":[1,2]},
        "backing":{"seeds":["h:1","h:2"]}}"#;
    let h = Header { op: Op::CreateTable.into(), flags: 0, id: 1, body_len: body.len() as u32 };
    assert!(Request::decode(&h, body.as_bytes()).is_ok());
}

/// Error messages quoted a client's whole string: a 1 MB table name or
/// unknown field gave a 1 MB error body. They quote at most
/// `QUOTED_CHARS` characters now, then an ellipsis and the length.
#[test]
fn quoted_client_strings_are_capped() {
    assert_eq!(crate::quoted("t1"), "\"t1\"");
    let long = "a".repeat(1 << 20);
    let q = crate::quoted(&long);
    assert!(q.len() < 100 && q.contains("1048576 bytes") && q.contains('…'), "{q}");
    // Cut at a character, not inside one.
    assert!(crate::quoted(&"é".repeat(100)).contains("200 bytes"));
    let field = format!(r#"{{"name":"t","dim":4,"capacity":8,"{long}":1}}"#);
    let value = format!(r#"{{"name":"t","dim":4,"capacity":8,"policy":"{long}"}}"#);
    let number = format!(r#"{{"name":"t","dim":4,"capacity":"{long}"}}"#);
    for body in [field, value, number] {
        let h = Header { op: Op::CreateTable.into(), flags: 0, id: 1, body_len: body.len() as u32 };
        let e = Request::decode(&h, body.as_bytes()).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.len() < 1000 && e.message.contains("1048576 bytes"), "{}", &e.message[..200]);
    }
}
