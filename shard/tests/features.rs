//! Feature hashing: the CPU hashes against reference values computed with
//! pyfarmhash (every length 0..=300, so every branch of farmhashna, and the
//! 128/192/256-byte loop boundaries), int64 edge values, and CPU = CUDA on
//! random inputs (on a GPU host, with --ignored).

use hkv_shard::features::{fingerprint64, format_i64, hash_features_cpu, key_of_i64, Features, HashKind};
use rand::{Rng, SeedableRng};

const VECTORS: &str = include_str!("data/fingerprint64.txt");

/// The byte stream the reference values were computed over (an LCG).
fn lcg_bytes(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x1234567;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

#[test]
fn fingerprint64_equals_the_reference_for_every_length_and_int64_edge() {
    let (mut lengths, mut ints) = (0, 0);
    for line in VECTORS.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let want: u64 = f[2].parse().unwrap();
        match f[0] {
            "bytes" => {
                let n: usize = f[1].parse().unwrap();
                assert_eq!(fingerprint64(&lcg_bytes(n)), want, "length {n}");
                lengths += 1;
            }
            "int" => {
                let x: i64 = f[1].parse().unwrap();
                assert_eq!(key_of_i64(HashKind::Fingerprint64, x, u64::MAX - 3), want % (u64::MAX - 3), "{x}");
                let mut b = [0u8; 20];
                let n = format_i64(x, &mut b);
                assert_eq!(fingerprint64(&b[..n]), want, "{x}");
                ints += 1;
            }
            other => panic!("unknown vector kind {other}"),
        }
    }
    assert_eq!((lengths, ints), (301, 79));
}

/// Random int64 features (with edge values mixed in) and strings of 0..=300 bytes.
fn random_features(seed: u64, n: usize) -> (Vec<i64>, Vec<u8>, Vec<u32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let edges = [0i64, -1, 1, i64::MIN, i64::MAX, 10, -10, 1_000_000_000_000_000_000];
    let ints = (0..n)
        .map(|i| if i % 7 == 0 { edges[i / 7 % edges.len()] } else { rng.gen::<i64>() >> rng.gen_range(0..64) })
        .collect();
    let mut bytes = vec![];
    let mut offsets = vec![0u32];
    for i in 0..n {
        let len = if i < 301 { i } else { rng.gen_range(0..=300) };
        bytes.extend((0..len).map(|_| rng.gen::<u8>()));
        offsets.push(bytes.len() as u32);
    }
    (ints, bytes, offsets)
}

#[test]
fn parallel_cpu_hashing_equals_one_thread() {
    let (ints, bytes, offsets) = random_features(3, 100_000);
    for kind in [HashKind::Fingerprint64, HashKind::Strong { k0: 1, k1: 2 }] {
        for f in [Features::Int64(&ints), Features::Strings { bytes: &bytes, offsets: &offsets }] {
            let (mut a, mut b) = (vec![0; f.len()], vec![0; f.len()]);
            hash_features_cpu(f, kind, 1 << 40, &mut a, true).unwrap();
            hash_features_cpu(f, kind, 1 << 40, &mut b, false).unwrap();
            assert_eq!(a, b);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_hashing_equals_cpu_on_random_input() {
    let device = hkv_shard::cuda::Device::open(0, None).expect("a CUDA device");
    let mut hasher = hkv_shard::cuda::FeatureHasher::new(&device).unwrap();
    for (seed, n) in [(1u64, 1usize), (2, 1000), (3, 300_000)] {
        let (ints, bytes, offsets) = random_features(seed, n);
        for kind in [HashKind::Fingerprint64, HashKind::Strong { k0: 0xDECAF, k1: 0xC0FFEE }] {
            for nb in [1u64, 1000, 1 << 40, u64::MAX - 3] {
                for f in [Features::Int64(&ints), Features::Strings { bytes: &bytes, offsets: &offsets }] {
                    let (mut cpu, mut gpu) = (vec![0; n], vec![7; n]);
                    hash_features_cpu(f, kind, nb, &mut cpu, true).unwrap();
                    hasher.hash(f, kind, nb, &mut gpu).unwrap();
                    if let Some(i) = (0..n).find(|&i| cpu[i] != gpu[i]) {
                        panic!("{kind:?} nb {nb} n {n}: feature {i} cpu {} gpu {}", cpu[i], gpu[i]);
                    }
                }
            }
        }
    }
    // Bad input is refused before any launch.
    let mut out = [0u64; 2];
    let bad = Features::Strings { bytes: b"abc", offsets: &[0, 2, 1] };
    assert!(hasher.hash(bad, HashKind::Fingerprint64, 10, &mut out).is_err());
    assert!(hasher.hash(Features::Int64(&[1, 2]), HashKind::Fingerprint64, 0, &mut out).is_err());
}
