// Shared device helpers of the HKV kernels. NVRTC receives this text
// prepended to each module (cudarc passes no in-memory headers), after
// abi.h (u64 / u32 / u8, the codes and seeds).
// The hashing mirrors shard/src/hash.rs bit for bit: bucket from the low 56
// bits of fmix64(key), digest from the top byte.

#define HKV_LOW56 0x00FFFFFFFFFFFFFFULL

// Murmur3's 64-bit finalizer.
__device__ __forceinline__ u64 hkv_fmix64(u64 k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

// The digest of a free slot: the top byte of fmix64 of the empty key (~0).
__device__ __forceinline__ u8 hkv_empty_digest() { return (u8)(hkv_fmix64(0xFFFFFFFFFFFFFFFFULL) >> 56); }

// A key's digest from its hash: the top byte, its low bit flipped where it
// would equal the free-slot digest (shard/src/hash.rs).
__device__ __forceinline__ u8 hkv_key_digest(u64 h) {
    u8 d = (u8)(h >> 56);
    return d == hkv_empty_digest() ? d ^ 1 : d;
}

// The miss-ratio sampling filter's hash (hkv_sample_warp in table.cuh): splitmix64's finalizer of key ^ seed, mrc::sample_hash bit for
// bit (checked against mrc::SAMPLE_HASH_VECTORS by tests/cuda.rs).
__device__ __forceinline__ u64 hkv_sample_hash(u64 key, u64 seed) {
    u64 z = key ^ seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// One block of 1024 threads: offsets[j] = counts[0] + ... + counts[j - 1]
// for j < len; returns the total of all len counts (to every thread).
// Each thread sums a contiguous run, the runs are scanned in shared memory.
__device__ __forceinline__ u64 hkv_block_scan(const u32* counts, u64 len, u64* offsets) {
    __shared__ u64 part[1024];
    u64 per = (len + 1023) / 1024;
    u64 lo = threadIdx.x * per, hi = lo + per < len ? lo + per : len;
    u64 sum = 0;
    for (u64 j = lo; j < hi; ++j) sum += counts[j];
    part[threadIdx.x] = sum;
    __syncthreads();
    for (int off = 1; off < 1024; off <<= 1) {
        u64 v = threadIdx.x >= (u32)off ? part[threadIdx.x - off] : 0;
        __syncthreads();
        part[threadIdx.x] += v;
        __syncthreads();
    }
    u64 run = part[threadIdx.x] - sum;
    for (u64 j = lo; j < hi; ++j) {
        offsets[j] = run;
        run += counts[j];
    }
    return part[1023];
}
