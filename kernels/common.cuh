// Shared device helpers of the HKV kernels. NVRTC receives this text
// prepended to each module (cudarc passes no in-memory headers).
// The hashing mirrors shard/src/hash.rs bit for bit: bucket from the low 56
// bits of fmix64(key), digest from the top byte.

#define HKV_BUCKET_SLOTS 128ULL
#define HKV_LOW56 0x00FFFFFFFFFFFFFFULL
#define HKV_DUAL_SEED 0x9e3779b97f4a7c15ULL

// Murmur3's 64-bit finalizer.
__device__ __forceinline__ unsigned long long hkv_fmix64(unsigned long long k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

// A key's digest from its hash: the top byte, its low bit flipped where it
// would equal the free-slot digest (the top byte of fmix64 of the empty key).
__device__ __forceinline__ unsigned char hkv_key_digest(unsigned long long h) {
    unsigned char d = (unsigned char)(h >> 56);
    return d == (unsigned char)(hkv_fmix64(0xFFFFFFFFFFFFFFFFULL) >> 56) ? d ^ 1 : d;
}

// One block of 1024 threads: offsets[j] = counts[0] + ... + counts[j - 1]
// for j < len; returns the total of all len counts (to every thread).
// Each thread sums a contiguous run, the runs are scanned in shared memory.
__device__ __forceinline__ unsigned long long hkv_block_scan(const unsigned* counts, unsigned long long len,
                                                             unsigned long long* offsets) {
    __shared__ unsigned long long part[1024];
    unsigned long long per = (len + 1023) / 1024;
    unsigned long long lo = threadIdx.x * per, hi = lo + per < len ? lo + per : len;
    unsigned long long sum = 0;
    for (unsigned long long j = lo; j < hi; ++j) sum += counts[j];
    part[threadIdx.x] = sum;
    __syncthreads();
    for (int off = 1; off < 1024; off <<= 1) {
        unsigned long long v = threadIdx.x >= (unsigned)off ? part[threadIdx.x - off] : 0;
        __syncthreads();
        part[threadIdx.x] += v;
        __syncthreads();
    }
    unsigned long long run = part[threadIdx.x] - sum;
    for (unsigned long long j = lo; j < hi; ++j) {
        offsets[j] = run;
        run += counts[j];
    }
    return part[1023];
}
