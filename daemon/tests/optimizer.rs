//! Tables with an optimizer and apply_gradients, through the real daemon:
//! every optimizer's rows (values and state) against a reference computed
//! here in f64, missing keys, duplicates, the refusals, and the state
//! surviving a checkpoint and a restart.

mod common;

use common::Daemon;
use hkv_backing::testkit::TestCluster;
use hkv_client::proto::{Hyper, Optimizer};
use hkv_client::{BackingMode, BackingSpec, Client, ErrorCode, TableSpec};

const DIM: usize = 4;

fn table(name: &str, optimizer: Optimizer) -> TableSpec {
    TableSpec { optimizer: Some(optimizer), ..TableSpec::new(name, DIM, 1 << 12) }
}

/// A deterministic pseudo-random float in [-1, 1).
fn noise(seed: u64) -> f32 {
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^= z >> 29;
    z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 32;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The reference: one step of `o` on a row of f64 (values then state),
/// written from the formulas of PROTOCOL.md, independently of the shard's code.
fn reference(o: Optimizer, row: &mut [f64], grad: &[f64], h: &Hyper) {
    let (lr, eps, b1, b2, wd) = (h.lr as f64, h.eps as f64, h.beta1 as f64, h.beta2 as f64, h.weight_decay as f64);
    let g: Vec<f64> = (0..DIM).map(|i| grad[i] + wd * row[i]).collect();
    match o {
        Optimizer::Sgd => (0..DIM).for_each(|i| row[i] -= lr * g[i]),
        Optimizer::Adagrad => {
            for i in 0..DIM {
                row[DIM + i] += g[i] * g[i];
                row[i] -= lr * g[i] / (row[DIM + i].sqrt() + eps);
            }
        }
        Optimizer::RowwiseAdagrad => {
            row[DIM] += g.iter().map(|x| x * x).sum::<f64>() / DIM as f64;
            let s = lr / (row[DIM].sqrt() + eps);
            (0..DIM).for_each(|i| row[i] -= s * g[i]);
        }
        Optimizer::Adam => {
            let t = h.step as i32;
            for i in 0..DIM {
                row[DIM + i] = b1 * row[DIM + i] + (1.0 - b1) * g[i];
                row[2 * DIM + i] = b2 * row[2 * DIM + i] + (1.0 - b2) * g[i] * g[i];
                let mhat = row[DIM + i] / (1.0 - b1.powi(t));
                let vhat = row[2 * DIM + i] / (1.0 - b2.powi(t));
                row[i] -= lr * mhat / (vhat.sqrt() + eps);
            }
        }
    }
}

/// Each optimizer, on a 3-shard table: rows inserted, then 6 steps of
/// gradients over a batch that also names absent keys; after each step the
/// returned values and the stored rows (values and state) match the
/// reference within 2e-5 (relative to 1), the absent keys are counted and
/// stay absent.
#[test]
fn every_optimizer_matches_the_reference() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    for (o, row_dim) in
        [(Optimizer::Sgd, 4), (Optimizer::Adagrad, 8), (Optimizer::RowwiseAdagrad, 5), (Optimizer::Adam, 12)]
    {
        let name = o.as_str();
        let info = c.create_table(table(name, o)).unwrap();
        assert_eq!((info.spec.dim, info.row_dim, info.spec.optimizer), (DIM, row_dim, Some(o)));
        let listed = c.tables().unwrap().into_iter().find(|t| t.spec.name == name).unwrap();
        assert_eq!(listed.row_dim(), row_dim);
        // 200 keys stored, with values and zero state.
        let keys: Vec<u64> = (1..=200).map(|k| k * 7_919).collect();
        let mut rows: Vec<Vec<f64>> = keys
            .iter()
            .map(|&k| (0..row_dim).map(|j| if j < DIM { noise(k + j as u64) as f64 } else { 0.0 }).collect())
            .collect();
        let flat: Vec<f32> = rows.iter().flatten().map(|&x| x as f32).collect();
        c.insert_or_assign(name, &keys, &flat, None).unwrap();
        // Batches: 120 stored keys and 30 absent ones, interleaved.
        let absent: Vec<u64> = (1..=30).map(|k| k * 7_919 + 1).collect();
        for step in 1..=6u64 {
            let h = Hyper { lr: 0.05, eps: 1e-3, beta1: 0.8, beta2: 0.95, weight_decay: 0.01, step, sum: false };
            let mut batch = Vec::new();
            let mut which = Vec::new();
            for i in 0..150 {
                if i % 5 == 4 {
                    batch.push(absent[i / 5]);
                    which.push(None);
                } else {
                    let at = (i * 7 + step as usize * 13) % 200;
                    if which.contains(&Some(at)) {
                        continue;
                    }
                    batch.push(keys[at]);
                    which.push(Some(at));
                }
            }
            let grads: Vec<f32> = (0..batch.len() * DIM).map(|j| noise(step * 100_003 + j as u64) * 0.5).collect();
            let (missing, got) = c.apply_gradients(name, h, &batch, &grads, true).unwrap();
            assert_eq!(missing, which.iter().filter(|w| w.is_none()).count() as u64, "{name} step {step}");
            let (found, values) = got.expect("values asked for");
            for (i, w) in which.iter().enumerate() {
                match w {
                    None => {
                        assert!(!found[i]);
                        assert!(values[i * DIM..(i + 1) * DIM].iter().all(|&x| x == 0.0));
                    }
                    Some(at) => {
                        assert!(found[i]);
                        let g: Vec<f64> = grads[i * DIM..(i + 1) * DIM].iter().map(|&x| x as f64).collect();
                        reference(o, &mut rows[*at], &g, &h);
                        for j in 0..DIM {
                            let (a, b) = (values[i * DIM + j] as f64, rows[*at][j]);
                            assert!((a - b).abs() < 2e-5, "{name} step {step} key {at} value {j}: {a} vs {b}");
                        }
                    }
                }
            }
        }
        let f = c.find(name, &keys).unwrap();
        assert!(f.found.iter().all(|&x| x));
        for (i, row) in rows.iter().enumerate() {
            for (j, &b) in row.iter().enumerate() {
                let a = f.values[i * row_dim + j] as f64;
                assert!((a - b).abs() < 2e-5 * (1.0 + b.abs()), "{name} stored key {i} column {j}: {a} vs {b}");
            }
        }
        let f = c.find(name, &absent).unwrap();
        assert!(f.found.iter().all(|&x| !x), "{name}: absent keys stay absent");
    }
}

/// A key named twice in one batch is stepped twice, in order; without
/// `values` the answer carries the count only.
#[test]
fn duplicates_step_twice() {
    let d = Daemon::start(&["--shards", "1"]);
    let mut c = d.client();
    c.create_table(table("t", Optimizer::Sgd)).unwrap();
    c.insert_or_assign("t", &[5], &[1.0; DIM], None).unwrap();
    let h = Hyper { lr: 0.5, ..Hyper::default() };
    let (missing, got) = c.apply_gradients("t", h, &[5, 5], &[1.0; 2 * DIM], false).unwrap();
    assert_eq!((missing, got), (0, None));
    assert_eq!(c.find("t", &[5]).unwrap().values, vec![0.0; DIM]);
}

/// What is refused, by code, with nothing applied.
#[test]
fn refusals() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(TableSpec::new("plain", DIM, 1024)).unwrap();
    c.create_table(table("adam", Optimizer::Adam)).unwrap();
    c.insert_or_assign("adam", &[1], &[1.0; 3 * DIM], None).unwrap();
    fn code<T: std::fmt::Debug>(r: hkv_client::Result<T>) -> Option<ErrorCode> {
        r.unwrap_err().code()
    }
    let h = Hyper::default();
    // No optimizer.
    assert_eq!(code(c.apply_gradients("plain", h, &[1], &[0.0; DIM], false)), Some(ErrorCode::BadRequest));
    // Gradients of another width.
    assert_eq!(code(c.apply_gradients("adam", h, &[1], &[0.0; DIM + 1], false)), Some(ErrorCode::WrongDim));
    // Adam's step 0, a NaN learning rate, beta2 of 1.
    for bad in [Hyper { step: 0, ..h }, Hyper { lr: f32::NAN, ..h }, Hyper { beta2: 1.0, ..h }] {
        assert_eq!(code(c.apply_gradients("adam", bad, &[1], &[1.0; DIM], false)), Some(ErrorCode::BadRequest));
    }
    // A reserved key.
    assert_eq!(code(c.apply_gradients("adam", h, &[u64::MAX], &[0.0; DIM], false)), Some(ErrorCode::ReservedKey));
    // Value arrays of the other ops are whole rows: the value dim alone is the wrong width.
    assert_eq!(code(c.insert_or_assign("adam", &[2], &[0.0; DIM], None)), Some(ErrorCode::WrongDim));
    // An optimizer whose rows would pass 65536 floats.
    let big = TableSpec { optimizer: Some(Optimizer::Adam), ..TableSpec::new("big", 30_000, 128) };
    assert_eq!(code(c.create_table(big)), Some(ErrorCode::BadRequest));
    assert_eq!(c.find("adam", &[1]).unwrap().values, vec![1.0; 3 * DIM], "nothing was applied");
}

/// The optimizer's state lives in the rows: a checkpoint and a restart
/// bring back values and state, and the optimizer with the spec; the next
/// step continues from the restored state.
#[test]
fn state_survives_a_checkpoint_and_a_restart() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(table("ada", Optimizer::Adagrad)).unwrap();
    let keys: Vec<u64> = (1..=50).collect();
    c.insert_or_assign("ada", &keys, &vec![0.5; 50 * 2 * DIM], None).unwrap();
    let h = Hyper { lr: 0.1, ..Hyper::default() };
    c.apply_gradients("ada", h, &keys, &vec![0.25; 50 * DIM], false).unwrap();
    let before = c.find("ada", &keys).unwrap().values;
    assert!((before[DIM] - (0.5 + 0.0625)).abs() < 1e-6, "the state column accumulated g²: {}", before[DIM]);
    c.checkpoint(true, false).unwrap();
    let d = d.restart(&[]);
    let mut c = d.client();
    let t = c.tables().unwrap().into_iter().find(|t| t.spec.name == "ada").unwrap();
    assert_eq!((t.spec.optimizer, t.row_dim), (Some(Optimizer::Adagrad), 2 * DIM));
    assert_eq!(c.find("ada", &keys).unwrap().values, before, "values and state restored bit for bit");
    c.apply_gradients("ada", h, &keys, &vec![0.25; 50 * DIM], false).unwrap();
    let after = c.find("ada", &keys).unwrap().values;
    assert!((after[DIM] - (0.5 + 2.0 * 0.0625)).abs() < 1e-6, "{}", after[DIM]);
}

/// Hostile apply_gradients frames, to a daemon under an address-space
/// limit: counts past the body, gradients of the wrong width, a body over
/// the frame limit, bad hyperparameters and the region form without its
/// arrays are refused by code, and the daemon keeps serving.
#[test]
fn hostile_frames_are_refused_under_a_memory_limit() {
    use common::{expect_code, raw_call};
    use hkv_client::{Request, Response};
    use std::os::unix::net::UnixStream;

    let mut d = Daemon::start_limited(6 << 30, &["--max-frame-bytes", "65536"]);
    let mut c = d.client();
    c.create_table(table("adam", Optimizer::Adam)).unwrap();
    c.insert_or_assign("adam", &[1], &[0.5; 3 * DIM], None).unwrap();
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let req = |keys: Vec<u64>, grads: Vec<f32>, hyper: Hyper| Request::ApplyGradients {
        table: "adam".into(),
        hyper,
        keys,
        grads,
        outcomes: true,
    };
    let good = req(vec![1], vec![0.1; DIM], Hyper::default()).encode(7);
    // The keys' count says 2^32 − 1 (offset: header 20, table 2 + 4, hyper 28).
    let mut huge = good.clone();
    huge[54..58].copy_from_slice(&u32::MAX.to_le_bytes());
    expect_code(raw_call(&mut s, &huge).1, ErrorCode::Truncated);
    // The gradients' count past the body.
    let mut past = good.clone();
    past[66..70].copy_from_slice(&1_000_000u32.to_le_bytes());
    expect_code(raw_call(&mut s, &past).1, ErrorCode::Truncated);
    // Gradients one float short of n × dim.
    expect_code(raw_call(&mut s, &req(vec![1], vec![0.1; DIM - 1], Hyper::default()).encode(8)).1, ErrorCode::WrongDim);
    // A body over --max-frame-bytes.
    let big = req((1..=4000).collect(), vec![0.0; 4000 * DIM], Hyper::default()).encode(9);
    expect_code(raw_call(&mut s, &big).1, ErrorCode::Oversized);
    // Infinite weight decay, Adam's step 0.
    for h in [Hyper { weight_decay: f32::INFINITY, ..Hyper::default() }, Hyper { step: 0, ..Hyper::default() }] {
        expect_code(raw_call(&mut s, &req(vec![1], vec![0.1; DIM], h).encode(10)).1, ErrorCode::BadRequest);
    }
    // The region form naming a region that was never registered.
    let region = hkv_client::proto::region::RegionRequest {
        op: hkv_client::proto::Op::ApplyGradients as u8,
        scores: false,
        outcomes: false,
        table: "adam".into(),
        head: hkv_client::proto::region::Head::Apply(Hyper::default()),
        refs: vec![hkv_client::proto::region::RegionRef::new(77, 0, 1); 2],
        events: None,
    };
    expect_code(raw_call(&mut s, &region.encode(11)).1, ErrorCode::NotFound);
    assert!(d.alive(), "the daemon is still running");
    match raw_call(&mut s, &good).1 {
        Response::Applied { missing: 0, found: Some(f), values: Some(v) } => {
            assert_eq!((f, v.len()), (vec![1], DIM));
        }
        r => panic!("{r:?}"),
    }
    // Only the last request stepped the row: m = 0.9 · 0.5 + 0.1 · 0.1.
    let m = c.find("adam", &[1]).unwrap().values[DIM];
    assert!((m - 0.46).abs() < 1e-6, "first moment {m}: the refused requests applied nothing");
}

/// A 3-master cluster and two daemons (kept alive with it), a client of each.
fn two_hosts() -> (TestCluster, [Daemon; 2], Client, Client) {
    let cluster = TestCluster::start(3, 0).expect("start a redis-server cluster (test.sh installs redis-server)");
    let hosts = [Daemon::start(&[]), Daemon::start(&[])];
    let (ca, cb) = (hosts[0].client(), hosts[1].client());
    (cluster, hosts, ca, cb)
}

/// A write-through backed table with an optimizer: apply_gradients steps a
/// row only the cluster had (read into A's cache first) and a row A had,
/// and sends the stepped rows, state included, to the cluster: a third
/// daemon reads them through, bit for bit.
#[test]
fn a_backed_table_sends_stepped_rows_and_state_to_its_cluster() {
    let (cluster, _hosts, mut ca, mut cb) = two_hosts();
    let spec = |mode| TableSpec {
        backing: Some(BackingSpec::from_list(&cluster.seed_arg(), mode)),
        ..table("ada", Optimizer::Adagrad)
    };
    ca.create_table(spec(BackingMode::WriteThrough)).unwrap();
    cb.create_table(spec(BackingMode::WriteThrough)).unwrap();
    // Key 1 written by B (in the cluster, not in A's cache), key 2 by A.
    cb.insert_or_assign("ada", &[1], &[1.0; 2 * DIM], None).unwrap();
    ca.insert_or_assign("ada", &[2], &[2.0; 2 * DIM], None).unwrap();
    let h = Hyper { lr: 0.5, ..Hyper::default() };
    let (missing, got) = ca.apply_gradients("ada", h, &[1, 2, 3], &[1.0; 3 * DIM], true).unwrap();
    assert_eq!(missing, 1, "key 3 is nowhere");
    assert_eq!(got.unwrap().0, vec![true, true, false]);
    let here = ca.find("ada", &[1, 2]).unwrap().values;
    // Key 1: state 1 + 1 = 2, value 1 − 0.5 / (√2 + eps).
    assert!((here[DIM] - 2.0).abs() < 1e-6 && (here[0] - (1.0 - 0.5 / 2f32.sqrt())).abs() < 1e-6, "{here:?}");
    // A third daemon's empty cache reads the rows from the cluster (an
    // erase on B would erase them from the cluster too).
    let c3 = Daemon::start(&[]);
    let mut cc = c3.client();
    cc.create_table(spec(BackingMode::ReadOnly)).unwrap();
    let there = cc.find("ada", &[1, 2]).unwrap();
    assert!(there.found.iter().all(|&f| f));
    assert_eq!(
        there.values.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        here.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "values and state through the cluster, bit for bit"
    );
}

/// A backed table whose cache holds fewer rows than one step: every row
/// the cluster has is stepped all the same (the step runs on the rows
/// read through, and the cluster gets them first), a key given twice is
/// stepped twice, and another daemon reads the stepped rows and state.
#[test]
fn a_backed_step_larger_than_the_cache_steps_every_row() {
    let (cluster, _hosts, mut ca, mut cb) = two_hosts();
    let spec = |mode, capacity| TableSpec {
        backing: Some(BackingSpec::from_list(&cluster.seed_arg(), mode)),
        optimizer: Some(Optimizer::Adagrad),
        ..TableSpec::new("small", DIM, capacity)
    };
    // A's cache: 128 slots. B writes 2000 rows into the cluster.
    ca.create_table(spec(BackingMode::WriteThrough, 128)).unwrap();
    cb.create_table(spec(BackingMode::WriteThrough, 1 << 13)).unwrap();
    let n = 2000u64;
    let keys: Vec<u64> = (1..=n).collect();
    cb.insert_or_assign("small", &keys, &vec![1.0; keys.len() * 2 * DIM], None).unwrap();
    // Key 1 twice, at both ends.
    let mut step_keys = keys.clone();
    step_keys.push(1);
    let h = Hyper { lr: 0.5, ..Hyper::default() };
    let grads = vec![1.0; step_keys.len() * DIM];
    let (missing, got) = ca.apply_gradients("small", h, &step_keys, &grads, true).unwrap();
    assert_eq!(missing, 0, "every key is in the cluster");
    let (found, values) = got.unwrap();
    assert!(found.iter().all(|&f| f));
    // Adagrad from value 1, state 1, gradient 1: state 2, value 1 − 0.5/√2;
    // key 1's second step: state 3, value 1 − 0.5/√2 − 0.5/√3.
    let once = values[DIM];
    assert!((once - (1.0 - 0.5 / 2f32.sqrt())).abs() < 1e-6, "{once}");
    let twice = values[n as usize * DIM];
    assert!((twice - (once - 0.5 / 3f32.sqrt())).abs() < 1e-6, "{twice}");
    // A fresh daemon reads every stepped row from the cluster.
    let c3 = Daemon::start(&[]);
    let mut cc = c3.client();
    cc.create_table(spec(BackingMode::ReadOnly, 1 << 13)).unwrap();
    let there = cc.find("small", &keys).unwrap();
    assert!(there.found.iter().all(|&f| f), "every row in the cluster");
    for (i, row) in there.values.chunks(2 * DIM).enumerate() {
        let (value, state) = if i == 0 { (twice, 3.0) } else { (once, 2.0) };
        assert!(row[..DIM].iter().all(|x| x.to_bits() == value.to_bits()), "key {}: {row:?}", i + 1);
        assert!(row[DIM..].iter().all(|&x| x == state), "key {}: {row:?}", i + 1);
    }
}

/// Two hosts never share a cluster table whose rows mean different
/// things: the first host's optimizer and value width are kept in the
/// table's meta hash, and a host that opens the name with another
/// optimizer, another value width (the same row width) or none is
/// refused by name (each would have stepped the other's state as values).
#[test]
fn a_backed_table_is_refused_when_its_rows_mean_something_else() {
    let (cluster, _hosts, mut ca, mut cb) = two_hosts();
    let spec = |optimizer, dim| TableSpec {
        backing: Some(BackingSpec::from_list(&cluster.seed_arg(), BackingMode::WriteThrough)),
        optimizer,
        ..TableSpec::new("m", dim, 1 << 10)
    };
    // Adagrad over 2 values: rows of 4 floats.
    ca.create_table(spec(Some(Optimizer::Adagrad), 2)).unwrap();
    for (optimizer, dim) in [(Some(Optimizer::Sgd), 4), (None, 4), (Some(Optimizer::RowwiseAdagrad), 3)] {
        let e = cb.create_table(spec(optimizer, dim)).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{optimizer:?} {dim}: {e}");
        assert!(e.to_string().contains("adagrad over 2 values"), "{e}");
    }
    // The same rows are shared.
    cb.create_table(spec(Some(Optimizer::Adagrad), 2)).unwrap();
    assert!(cb.tables().unwrap().iter().any(|t| t.spec.name == "m"));
}

/// A backed custom-policy table: a step keeps each row's own score, in
/// the cache and in the cluster (another host fills the row with it),
/// whether the row was cached or only in the cluster.
#[test]
fn a_backed_step_keeps_custom_scores() {
    use hkv_client::Policy;

    let (cluster, _hosts, mut ca, mut cb) = two_hosts();
    let spec = |mode| TableSpec {
        backing: Some(BackingSpec::from_list(&cluster.seed_arg(), mode)),
        policy: Policy::Custom,
        ..table("cs", Optimizer::Sgd)
    };
    ca.create_table(spec(BackingMode::WriteThrough)).unwrap();
    cb.create_table(spec(BackingMode::WriteThrough)).unwrap();
    // Key 1 in A's cache (score 777), key 2 only in the cluster (B wrote it, score 555).
    ca.insert_or_assign("cs", &[1], &[1.0; DIM], Some(&[777])).unwrap();
    cb.insert_or_assign("cs", &[2], &[2.0; DIM], Some(&[555])).unwrap();
    let h = Hyper { lr: 0.5, ..Hyper::default() };
    let (missing, _) = ca.apply_gradients("cs", h, &[1, 2], &[1.0; 2 * DIM], false).unwrap();
    assert_eq!(missing, 0);
    let here = ca.find_with_scores("cs", &[1, 2]).unwrap();
    assert_eq!(here.scores, Some(vec![777, 555]), "A's cache");
    let c3 = Daemon::start(&[]);
    let mut cc = c3.client();
    cc.create_table(spec(BackingMode::ReadOnly)).unwrap();
    let there = cc.find_with_scores("cs", &[1, 2]).unwrap();
    assert_eq!(there.values, vec![0.5, 0.5, 0.5, 0.5, 1.5, 1.5, 1.5, 1.5], "stepped rows in the cluster");
    assert_eq!(there.scores, Some(vec![777, 555]), "scores in the cluster");
}
