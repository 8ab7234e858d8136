//! Feature requests through the real daemon: hash, find_features and
//! find_or_insert_features equal hashing on the client and then the keyed
//! ops; bad input is refused with nothing applied (hkvctl's feature
//! commands: client/tests/cli.rs).

mod common;

use common::Daemon;
use hkv_client::{ErrorCode, FeatureHash, Features, HashSpec, TableSpec};
use hkv_shard::features::{fingerprint64, key_of_i64, siphash24, HashKind};

#[test]
fn feature_ops_equal_hash_then_keyed_ops() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let nb = 1_000_003u64;
    let spec = TableSpec { hash: Some(FeatureHash::fingerprint64(nb)), ..TableSpec::new("ads", 2, 1 << 14) };
    c.create_table(spec).unwrap();

    // hash: TensorFlow's vectors, with and without the table's setting.
    let tf = Features::strings(&["a", "b", "c", "d"]);
    let raw = c.hash("", HashSpec::Given(FeatureHash::fingerprint64(u64::MAX - 3)), tf.clone()).unwrap();
    let want = [12917804110809363939u64, 11795596070477164822, 11430444447143000872, 4470636696479570465];
    assert_eq!(raw, want.map(|h| h % (u64::MAX - 3)));
    assert_eq!(c.hash("ads", HashSpec::Table, tf).unwrap(), want.map(|h| h % nb));
    let ints: Vec<i64> = (0..40_000).map(|i| (i as i64 - 20_000) * 1_000_003).chain([i64::MIN, i64::MAX]).collect();
    let keys = c.hash("ads", HashSpec::Table, Features::Int64(ints.clone())).unwrap();
    assert_eq!(keys, ints.iter().map(|&x| key_of_i64(HashKind::Fingerprint64, x, nb)).collect::<Vec<_>>());
    let strong = FeatureHash { kind: hkv_client::HashKind::Strong, num_buckets: 100, key: [5, 6] };
    let k = c.hash("", HashSpec::Given(strong), Features::strings(&["xyz"])).unwrap();
    assert_eq!(k, [siphash24(5, 6, b"xyz") % 100]);

    // find_or_insert_features inserts under the hashed keys...
    let names: Vec<String> = (0..500).map(|i| format!("user:{i}")).collect();
    let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let w = c.find_or_insert_features("ads", HashSpec::Table, Features::strings(&names), &values, None).unwrap();
    assert_eq!(w.summary.inserted, 500);
    assert_eq!(w.values.unwrap(), values);
    // ...which find with client-side keys sees, and find_features equals.
    let keys: Vec<u64> = names.iter().map(|n| fingerprint64(n.as_bytes()) % nb).collect();
    let by_key = c.find("ads", &keys).unwrap();
    assert!(by_key.found.iter().all(|&f| f));
    assert_eq!(by_key.values, values);
    let mut probe = names.clone();
    probe.push("never seen".into());
    let f = c.find_features("ads", HashSpec::Table, Features::strings(&probe), false).unwrap();
    assert_eq!(f.values[..1000], values[..]);
    assert!(!f.found[500]);

    // Bad input: a clear error, nothing applied, the daemon keeps serving.
    let size = || c_size(&d);
    let before = size();
    let bad = [
        (Features::Strings { bytes: b"abc".to_vec(), offsets: vec![0, 2, 1] }, HashSpec::Table),
        (Features::Strings { bytes: b"abc".to_vec(), offsets: vec![0, 2, 9] }, HashSpec::Table),
        (Features::Int64(vec![1, 2]), HashSpec::Given(FeatureHash::fingerprint64(0))),
    ];
    for (features, hash) in bad {
        let e = c.find_or_insert_features("ads", hash, features, &[0.0; 4], None).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    }
    let e = c.find_or_insert_features("ads", HashSpec::Table, Features::Int64(vec![1, 2]), &[0.0; 3], None);
    assert_eq!(e.unwrap_err().code(), Some(ErrorCode::WrongDim));
    c.create_table(TableSpec::new("plain", 2, 1024)).unwrap();
    let e = c.find_features("plain", HashSpec::Table, Features::Int64(vec![1]), false).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    assert!(e.to_string().contains("\"plain\""), "{e}");
    let bad_spec = TableSpec { hash: Some(FeatureHash::fingerprint64(0)), ..TableSpec::new("bad", 2, 1024) };
    assert_eq!(c.create_table(bad_spec).unwrap_err().code(), Some(ErrorCode::BadRequest));
    assert_eq!(size(), before, "refused requests changed nothing");
    c.ping().unwrap();
    let st = c.stats().unwrap();
    assert_eq!(st["feature_hashing"], "CPU", "a --backend cpu daemon hashes on the CPU");
}

fn c_size(d: &Daemon) -> u64 {
    d.client().tables().unwrap().iter().map(|t| t.size).sum()
}
