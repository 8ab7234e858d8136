// hash family: bucket and digest of keys, as the table computes them.
// Thread mapping: one thread per key. Memory traffic per key: 8 bytes read,
// 9 bytes written.

extern "C" __global__ void hash_locate(const unsigned long long* keys, unsigned long long n,
                                       unsigned long long buckets, unsigned long long* bucket_out,
                                       unsigned char* digest_out) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long h = hkv_fmix64(keys[i]);
    bucket_out[i] = (h & HKV_LOW56) % buckets;
    digest_out[i] = hkv_key_digest(h);
}
