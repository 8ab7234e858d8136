//! `Shard::apply_gradients`: the CPU backend's in-place step against the
//! trait's default (find, step on the host, assign), which the CUDA backend
//! serves with, on the same tables and gradients: the same rows, bit for
//! bit, for every optimizer, over a batch large enough to run on several
//! cores and holding absent keys.

use hkv_shard::optim::{Hyper, Optimizer, Step};
use hkv_shard::{apply_gradients_by_find, open, Backend, TableConfig};

fn noise(seed: u64) -> f32 {
    let z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (seed >> 7);
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

#[test]
fn in_place_equals_find_and_assign() {
    let dim = 8;
    for o in [Optimizer::Sgd, Optimizer::Adagrad, Optimizer::RowwiseAdagrad, Optimizer::Adam] {
        let w = o.row_dim(dim);
        let a = open(TableConfig::new(1 << 15, w), Backend::Cpu).unwrap();
        let b = open(TableConfig::new(1 << 15, w), Backend::Cpu).unwrap();
        let keys: Vec<u64> = (1..=10_000).collect();
        let rows: Vec<f32> = (0..keys.len() * w).map(|i| noise(i as u64)).collect();
        a.insert_or_assign(&keys, &rows, None, None).unwrap();
        b.insert_or_assign(&keys, &rows, None, None).unwrap();
        // 8000 present keys (distinct) and 1000 absent.
        let batch: Vec<u64> =
            (0..9_000u64).map(|i| if i % 9 == 8 { 1_000_000 + i } else { 1 + (i * 7) % 10_000 }).collect();
        for t in 1..=3u64 {
            let step = Step {
                optimizer: o,
                dim,
                hyper: Hyper { lr: 0.1, step: t, weight_decay: 0.01, ..Hyper::default() },
                sum: false,
            };
            let grads: Vec<f32> = (0..batch.len() * dim).map(|i| noise(t * 1_000_003 + i as u64)).collect();
            let (mut fa, mut fb) = (vec![false; batch.len()], vec![false; batch.len()]);
            let (mut ua, mut ub) = (vec![1.0f32; batch.len() * dim], vec![1.0f32; batch.len() * dim]);
            let ma = a.apply_gradients(&batch, &grads, &step, &mut fa, Some(&mut ua)).unwrap();
            let mb = apply_gradients_by_find(&*b, &batch, &grads, &step, &mut fb, Some(&mut ub)).unwrap();
            assert_eq!((ma, mb), (1000, 1000), "{o:?}");
            assert_eq!(fa, fb);
            assert_eq!(
                ua.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                ub.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{o:?} step {t}"
            );
        }
        let (mut va, mut vb) = (vec![0.0; keys.len() * w], vec![0.0; keys.len() * w]);
        let (mut fa, mut fb) = (vec![false; keys.len()], vec![false; keys.len()]);
        a.find(&keys, &mut va, &mut fa, None).unwrap();
        b.find(&keys, &mut vb, &mut fb, None).unwrap();
        assert_eq!(
            va.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            vb.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{o:?}"
        );
        assert!(va != rows, "{o:?}: the rows moved");
        assert_eq!(a.size(), 10_000, "absent keys are not inserted");
        assert_eq!(a.stats().ops[14], 3, "counted as apply_gradients");
    }
}

/// Duplicate keys in a batch (of at most `SEQUENTIAL_BATCH` keys, run in
/// index order by both): each occurrence steps the row as the previous one
/// left it, in place and in the default alike, bit for bit.
#[test]
fn duplicates_step_in_order_in_both() {
    let dim = 4;
    let o = Optimizer::Adam;
    let w = o.row_dim(dim);
    let a = open(TableConfig::new(1 << 12, w), Backend::Cpu).unwrap();
    let b = open(TableConfig::new(1 << 12, w), Backend::Cpu).unwrap();
    let keys: Vec<u64> = (1..=100).collect();
    let rows: Vec<f32> = (0..keys.len() * w).map(|i| noise(i as u64)).collect();
    a.insert_or_assign(&keys, &rows, None, None).unwrap();
    b.insert_or_assign(&keys, &rows, None, None).unwrap();
    let batch: Vec<u64> = (0..300u64).map(|i| 1 + (i * i) % 120).collect(); // repeats, and keys 101..120 absent
    let step = Step { optimizer: o, dim, hyper: Hyper { lr: 0.1, step: 2, ..Hyper::default() }, sum: false };
    let grads: Vec<f32> = (0..batch.len() * dim).map(|i| noise(77 + i as u64)).collect();
    let (mut fa, mut fb) = (vec![false; batch.len()], vec![false; batch.len()]);
    let (mut ua, mut ub) = (vec![0.0f32; batch.len() * dim], vec![0.0f32; batch.len() * dim]);
    let ma = a.apply_gradients(&batch, &grads, &step, &mut fa, Some(&mut ua)).unwrap();
    let mb = apply_gradients_by_find(&*b, &batch, &grads, &step, &mut fb, Some(&mut ub)).unwrap();
    assert_eq!(ma, mb);
    assert!(ma > 0 && fa == fb);
    assert_eq!(ua.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), ub.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    let (mut va, mut vb) = (vec![0.0; keys.len() * w], vec![0.0; keys.len() * w]);
    a.find(&keys, &mut va, &mut vec![false; keys.len()], None).unwrap();
    b.find(&keys, &mut vb, &mut vec![false; keys.len()], None).unwrap();
    assert_eq!(va.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), vb.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
}

/// apply_gradients with `sum`: each repeated key's gradients summed
/// (`sum_duplicates`), then one step per key, on the CPU backend in place
/// and through the trait's default alike; the same as an unsummed step of
/// the distinct keys with the summed rows; the found flags per occurrence;
/// the sum does not depend on the order of the occurrences; keys that
/// occur once keep their gradient bit for bit.
#[test]
fn summed_repeats_step_once_per_key() {
    let dim = 5;
    for o in [Optimizer::Sgd, Optimizer::Adagrad, Optimizer::RowwiseAdagrad, Optimizer::Adam] {
        let w = o.row_dim(dim);
        let keys: Vec<u64> = (1..=200).collect();
        let rows: Vec<f32> = (0..keys.len() * w).map(|i| noise(i as u64)).collect();
        let tables: Vec<_> = (0..3).map(|_| open(TableConfig::new(1 << 12, w), Backend::Cpu).unwrap()).collect();
        for t in &tables {
            t.insert_or_assign(&keys, &rows, None, None).unwrap();
        }
        // Hot keys repeat hundreds of times; keys 201..240 are absent.
        let batch: Vec<u64> = (0..6000u64).map(|i| 1 + (i * i * 7 + i) % 240 / (1 + (i % 3) * 30)).collect();
        let grads: Vec<f32> = (0..batch.len() * dim).map(|i| noise(91 + i as u64) * 1e-3).collect();
        let hyper = Hyper { lr: 0.1, step: 1, weight_decay: 0.01, ..Hyper::default() };
        let summed = Step { optimizer: o, dim, hyper, sum: true };
        let (mut fa, mut fb) = (vec![false; batch.len()], vec![false; batch.len()]);
        let ma = tables[0].apply_gradients(&batch, &grads, &summed, &mut fa, None).unwrap();
        let mb = apply_gradients_by_find(&*tables[1], &batch, &grads, &summed, &mut fb, None).unwrap();
        let (uniq, sums, own) = hkv_shard::optim::sum_duplicates(&batch, &grads, dim).expect("keys repeat");
        let one = Step { sum: false, ..summed };
        let mut fu = vec![false; uniq.len()];
        let mc = tables[2].apply_gradients(&uniq, &sums, &one, &mut fu, None).unwrap();
        assert_eq!(ma, mb, "{o:?}");
        assert_eq!(ma, mc, "{o:?}: missing counts distinct keys");
        assert_eq!(ma, uniq.iter().filter(|&&k| k > 200).count() as u64);
        assert_eq!(fa, fb);
        assert!(fa.iter().zip(&own).all(|(&f, &u)| f == fu[u]), "{o:?}: each occurrence has its key's flag");
        let bits = |t: &dyn hkv_shard::Shard| {
            let mut v = vec![0.0f32; keys.len() * w];
            t.find(&keys, &mut v, &mut vec![false; keys.len()], None).unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&*tables[0]), bits(&*tables[1]), "{o:?}");
        assert_eq!(bits(&*tables[0]), bits(&*tables[2]), "{o:?}");
        // With updated values asked for: refused, nothing stepped.
        let before = bits(&*tables[0]);
        let mut u = vec![0.0f32; batch.len() * dim];
        let e = tables[0].apply_gradients(&batch, &grads, &summed, &mut fa, Some(&mut u)).unwrap_err();
        assert!(matches!(e, hkv_shard::Error::Optimizer(_)), "{e}");
        assert_eq!(bits(&*tables[0]), before);
    }
}

#[test]
fn sums_are_exact_and_in_no_order() {
    use hkv_shard::optim::sum_duplicates;
    let dim = 3;
    // Key 7 three times with exactly representable values, key 9 once.
    let keys = [7u64, 9, 7, 7];
    let g = [0.5f32, -1.25, 3.0, 1e-7, 2.0, -3.0, 0.25, 0.25, 0.0, 0.125, 1.0, 1.5];
    let (uniq, sums, own) = sum_duplicates(&keys, &g, dim).unwrap();
    assert_eq!(uniq, [7, 9]);
    assert_eq!(own, [0, 1, 0, 0]);
    assert_eq!(&sums[..3], &[0.875, 0.0, 4.5]);
    assert_eq!(sums[3..].iter().map(|x| x.to_bits()).collect::<Vec<_>>(), [1e-7f32, 2.0, -3.0].map(f32::to_bits));
    assert!(sum_duplicates(&[1, 2, 3], &[0.0; 9], dim).is_none(), "nothing repeats");
    // Many small terms against one large: every order gives the same bits,
    // within an f32 rounding of the exact sum.
    let n = 4000;
    let mut grads: Vec<f32> = (0..n).map(|i| noise(i as u64) * 1e-6).collect();
    grads[17] = 3.5;
    let keys = vec![5u64; n];
    let base = sum_duplicates(&keys, &grads, 1).unwrap().1[0];
    let exact: f64 = grads.iter().map(|&x| f64::from(x)).sum();
    assert!((f64::from(base) - exact).abs() <= exact.abs() * 1.2e-7, "{base} against {exact}");
    for seed in 1..5u64 {
        let mut p = grads.clone();
        for i in (1..n).rev() {
            p.swap(i, (noise(seed * 7919 + i as u64).abs() * i as f32) as usize % (i + 1));
        }
        assert_eq!(sum_duplicates(&keys, &p, 1).unwrap().1[0].to_bits(), base.to_bits(), "order {seed}");
    }
    // Zeros sum to zero; a NaN or an infinity makes the whole row NaN.
    let (_, s, _) = sum_duplicates(&[1, 1, 2, 2], &[0.0, 0.0, 0.0, -0.0, 1.0, 2.0, f32::INFINITY, 0.0], 2).unwrap();
    assert_eq!(&s[..2], &[0.0, 0.0]);
    assert!(s[2].is_nan() && s[3].is_nan());
    // Magnitudes near f32's extremes neither overflow nor vanish.
    let (_, s, _) = sum_duplicates(&[1, 1, 2, 2], &[3.0e38, -1.0e38, 1.0e-40, 2.0e-40], 1).unwrap();
    assert_eq!(s[0], 3.0e38f32 - 1.0e38f32);
    assert_eq!(s[1], 1.0e-40f32 + 2.0e-40f32);
}
