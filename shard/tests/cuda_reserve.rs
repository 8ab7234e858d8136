//! Reserve on the CUDA backend is all or nothing (issue 32), on a GPU host
//! with `--ignored`. A binary of its own: it holds nearly all of the GPU's
//! memory for a moment, which would fail CUDA tests running beside it.

use std::sync::Arc;

use hkv_shard::cuda::{self, Device};
use hkv_shard::cuda_table::CudaTable;
use hkv_shard::{Error, Shard, TableConfig};

fn device() -> Arc<Device> {
    if let Some(dir) = cuda::default_kernel_cache_dir(None, |k| std::env::var_os(k)) {
        cuda::set_cache_dir(dir);
    }
    cuda::shared_device(0).expect("CUDA device 0")
}

/// Free device memory, once every stream's frees are done (allocations are
/// stream-ordered: a freed buffer returns to the device at a synchronisation).
fn free(dev: &Device) -> u64 {
    dev.ctx.synchronize().expect("synchronize");
    dev.ctx.mem_get_info().expect("cuMemGetInfo").0 as u64
}

/// Issue 32: a `reserve` that failed part-way (one shard could not
/// allocate its larger storage, another could) left the other shards
/// grown; the CPU backend then learnt to prepare every shard first, the
/// CUDA backend grew shard by shard. Two CUDA shards of one table, with
/// device memory for one shard's growth and not two: the first prepares,
/// the second is refused as out of memory, both cancel and are as they
/// were (capacity, size, values) with the prepared memory given back.
/// With the memory free, both prepare; then, with the rest of the device
/// taken, both still grow, into what they prepared.
#[test]
#[ignore = "needs a CUDA device"]
fn a_reserve_that_cannot_grow_every_shard_grows_none() {
    let dev = device();
    let dim = 1024;
    let cfg = TableConfig::new(1 << 12, dim).max_capacity(1 << 22);
    let shards: Vec<CudaTable> = (0..2).map(|_| CudaTable::new(cfg.clone(), dev.clone()).expect("table")).collect();
    let keys: Vec<u64> = (1..=1000).collect();
    let values: Vec<f32> = (0..keys.len() * dim).map(|i| i as f32).collect();
    for t in &shards {
        t.insert_or_assign(&keys, &values, None, None).unwrap();
    }
    let before = shards[0].capacity();
    let intact = |t: &CudaTable, what: &str| {
        let mut v = vec![0f32; values.len()];
        let mut f = vec![false; keys.len()];
        assert_eq!(t.find(&keys, &mut v, &mut f, None).unwrap(), keys.len(), "{what}: every key");
        assert!(v == values, "{what}: every value");
        assert_eq!(t.size(), keys.len() as u64, "{what}");
    };
    // Per shard 2^20 slots of 4 KiB: 4 GiB of values.
    let want = 1u64 << 20;
    let grow = want * dim as u64 * 4;

    // A prepare holds the grown storage without growing; a cancel gives it back.
    let f0 = free(&dev);
    shards[0].prepare_reserve(want).unwrap();
    let f1 = free(&dev);
    assert!(f0 - f1 >= grow, "prepared: {} bytes held, the values alone take {grow}", f0 - f1);
    assert_eq!(shards[0].capacity(), before);
    intact(&shards[0], "prepared");
    shards[0].cancel_reserve();
    assert!(free(&dev) + (64 << 20) >= f0, "cancelled: {} of {f0} bytes free again", free(&dev));

    // Room for one shard's growth and not two.
    let stream = dev.ctx.new_stream().expect("stream");
    let hog = stream.alloc_zeros::<u8>((free(&dev) - grow * 3 / 2) as usize).expect("the hog");
    shards[0].prepare_reserve(want).unwrap();
    let e = shards[1].prepare_reserve(want).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    for t in &shards {
        t.cancel_reserve();
    }
    for (i, t) in shards.iter().enumerate() {
        assert_eq!(t.capacity(), before, "shard {i} did not grow");
        intact(t, "after the refused reserve");
    }
    drop(hog);

    // Both prepare; then reserve allocates nothing large: with all but
    // 256 MiB of the device taken, both still grow.
    for t in &shards {
        t.prepare_reserve(want).unwrap();
    }
    let hog = stream.alloc_zeros::<u8>((free(&dev) - (256 << 20)) as usize).expect("the hog");
    for (i, t) in shards.iter().enumerate() {
        t.reserve(want).unwrap_or_else(|e| panic!("shard {i}: reserve into the prepared storage: {e}"));
        assert!(t.capacity() >= want, "shard {i} grown to {}", t.capacity());
        intact(t, "grown");
    }
    drop(hog);
}
