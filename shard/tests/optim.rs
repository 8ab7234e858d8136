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
            let step =
                Step { optimizer: o, dim, hyper: Hyper { lr: 0.1, step: t, weight_decay: 0.01, ..Hyper::default() } };
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
    let step = Step { optimizer: o, dim, hyper: Hyper { lr: 0.1, step: 2, ..Hyper::default() } };
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
