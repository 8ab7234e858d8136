// hash family: bucket and digest of keys, as the table computes them.
// Thread mapping: one thread per key. Memory traffic per key: 8 bytes read,
// 9 bytes written.

extern "C" __global__ void hash_locate(const u64* keys, u64 n, u64 buckets, u64* bucket_out, u8* digest_out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 h = hkv_fmix64(keys[i]);
    bucket_out[i] = (h & HKV_LOW56) % buckets;
    digest_out[i] = hkv_key_digest(h);
}
