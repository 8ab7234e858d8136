//! The CUDA module: a clear error, never a panic, without a driver or a
//! device; on a GPU host, the hash kernel equals the CPU hash bit for bit and
//! a warm kernel cache skips NVRTC.

use hkv_kernels::KernelId;
use hkv_shard::cuda::{self, Device};
use hkv_shard::hash::locate;
use rand::{Rng, SeedableRng};

#[test]
fn probe_never_panics_and_says_why() {
    match cuda::probe() {
        Ok(devices) => assert!(!devices.is_empty()),
        Err(e) => assert!(e.to_string().contains("CUDA"), "{e}"),
    }
    // Asking for the CUDA backend gives an error that names the reason.
    let e =
        hkv_shard::open(hkv_shard::TableConfig::new(256, 1), hkv_shard::Backend::Cuda).err().expect("not built yet");
    assert!(e.to_string().contains("CUDA"), "{e}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn hash_kernel_equals_the_cpu_hash_and_a_warm_cache_skips_nvrtc() {
    let cache = std::env::temp_dir().join(format!("hkv-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let dev = Device::open(0, Some(&cache)).expect("device 0");
    println!("{:?}", dev.info);
    assert_eq!(dev.nvrtc_compiles, KernelId::ALL.len(), "a cold cache compiles every module");
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut keys: Vec<u64> = (0..(1 << 20)).map(|_| rng.gen()).collect();
    keys.extend([0, 1, u64::MAX - 4, 1 << 63]);
    for buckets in [1u64, 7, 8192, 1 << 20, (1 << 40) + 3] {
        let (b, d) = dev.hash_locate(&keys, buckets).unwrap();
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!((b[i], d[i]), locate(k, buckets), "key {k:#x}, {buckets} buckets");
        }
    }
    drop(dev);
    let warm = Device::open(0, Some(&cache)).unwrap();
    assert_eq!(warm.nvrtc_compiles, 0, "a warm cache must not call NVRTC");
    assert_eq!(warm.hash_locate(&[42], 10).unwrap(), (vec![locate(42, 10).0], vec![locate(42, 10).1]));
    let _ = std::fs::remove_dir_all(&cache);
}
