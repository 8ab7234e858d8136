//! PROTOCOL.md's worked examples against a live daemon: every request
//! frame written out in hex there is sent byte for byte to
//! `hkvd serve --backend cpu --shards 3` on fresh state, and the answer must
//! equal, byte for byte, the answer frame the document shows next. A client
//! written from the document alone found the create_table answer 17 bytes
//! longer than the document said (the `lfu_ties` field); this keeps the
//! two from drifting apart again.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use common::Daemon;
use hkv_client::proto::HEADER_LEN;

const DOC: &str = include_str!("../../proto/PROTOCOL.md");

/// The frames of a section: each fenced block that starts with the magic,
/// as bytes (hex pairs; after the header's `|`, a line that is not hex is
/// the body's text).
fn frames(section: &str) -> Vec<Vec<u8>> {
    let mut out = vec![];
    let mut blocks = section.split("```").skip(1).step_by(2);
    for b in blocks.by_ref() {
        let b = b.trim();
        if !b.starts_with("48 4b 56 44") {
            continue;
        }
        let mut bytes = vec![];
        for line in b.lines() {
            let mut hex = true;
            let mut got = 0;
            for tok in line.split_whitespace() {
                if tok == "|" {
                    continue;
                }
                if hex && tok.len() == 2 && tok.chars().all(|c| c.is_ascii_hexdigit()) {
                    bytes.push(u8::from_str_radix(tok, 16).unwrap());
                    got += 1;
                } else {
                    hex = false;
                }
            }
            if got == 0 && bytes.len() >= HEADER_LEN {
                bytes.extend_from_slice(line.trim().as_bytes());
            }
        }
        out.push(bytes);
    }
    out
}

fn answer(s: &mut UnixStream) -> Vec<u8> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let len = u32::from_le_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut f = h.to_vec();
    f.resize(HEADER_LEN + len, 0);
    s.read_exact(&mut f[HEADER_LEN..]).unwrap();
    f
}

fn show(f: &[u8]) -> String {
    let (h, b) = f.split_at(HEADER_LEN.min(f.len()));
    format!("{:02x?} | {}", h, String::from_utf8_lossy(b))
}

#[test]
fn the_worked_examples_are_what_the_daemon_sends() {
    let start = DOC.find("\n## Worked example").expect("the worked example section");
    let section = &DOC[start..];
    let f = frames(section);
    assert!(f.len() >= 7, "{} frames found in the worked example", f.len());
    let d = Daemon::start(&["--shards", "3"]);
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let mut checked = 0;
    let mut i = 0;
    while i < f.len() {
        let is_request = f[i][6] & 1 == 0;
        if is_request && i + 1 < f.len() && f[i + 1][6] & 1 == 1 {
            s.write_all(&f[i]).unwrap();
            let got = answer(&mut s);
            assert_eq!(got, f[i + 1], "answer to frame {i}:\n got  {}\n doc  {}", show(&got), show(&f[i + 1]));
            checked += 1;
            i += 2;
        } else {
            i += 1;
        }
    }
    assert!(checked >= 3, "{checked} request/answer pairs checked");
    // The reserved key's answer, whose request the text describes.
    let req = hkv_client::Request::Find { table: "emb".into(), keys: vec![u64::MAX], scores: false }.encode(5);
    s.write_all(&req).unwrap();
    let got = answer(&mut s);
    assert_eq!(&got, f.last().unwrap(), "\n got  {}\n doc  {}", show(&got), show(f.last().unwrap()));
}

/// The edges of the table spec the document now states: `"hash": null` is
/// the same as no hash; a key given with `fingerprint64` (which takes
/// none, and would ignore it) is refused, in a table spec and in a
/// request's hash spec alike.
#[test]
fn hash_null_is_absent_and_a_key_without_a_keyed_hash_is_refused() {
    let d = Daemon::start(&[]);
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let mut call = |op: hkv_client::Op, body: &str, id: u64| {
        let mut f = vec![];
        hkv_client::proto::Header { op: op.into(), flags: 0, id, body_len: body.len() as u32 }.encode(&mut f);
        f.extend_from_slice(body.as_bytes());
        s.write_all(&f).unwrap();
        let a = answer(&mut s);
        (a[5], String::from_utf8_lossy(&a[HEADER_LEN..]).into_owned())
    };
    let (op, body) = call(hkv_client::Op::CreateTable, r#"{"name":"a","dim":2,"capacity":8,"hash":null}"#, 1);
    assert_eq!(op, 0x20, "{body}");
    assert!(!body.contains("\"hash\""), "{body}");
    let (op, body) = call(
        hkv_client::Op::CreateTable,
        r#"{"name":"b","dim":2,"capacity":8,"hash":{"kind":"fingerprint64","num_buckets":9,"key":[1,2]}}"#,
        2,
    );
    assert_eq!(op, 0xff, "{body}");
    assert!(body.contains("\"code\":\"bad_request\""), "{body}");
    let mut c = d.client();
    let keyed = hkv_client::FeatureHash { kind: hkv_client::HashKind::Fingerprint64, num_buckets: 9, key: [3, 4] };
    let e = c.hash("", hkv_client::HashSpec::Given(keyed), hkv_client::Features::Int64(vec![1, 2]));
    assert_eq!(e.unwrap_err().code(), Some(hkv_client::ErrorCode::BadRequest));
}
