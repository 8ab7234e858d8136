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
