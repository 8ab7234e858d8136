// features family: raw categorical features to table keys, bit-identical to
// shard/src/features.rs (TensorFlow's to_hash_bucket_fast / _strong).
// Thread mapping: one thread per feature. int64 features are formatted as
// %lld decimal into a 20-byte per-thread scratch; strings are read in place
// from one byte buffer plus n + 1 offsets. Kind HKV_HASH_FINGERPRINT64 =
// FarmHash Fingerprint64, HKV_HASH_SIPHASH = SipHash-2-4 keyed by (k0, k1)
// (abi.h). key = hash % num_buckets (u64).

#define FH_K0 0xc3a5c85c97cb3127ULL
#define FH_K1 0xb492b66fbe98f273ULL
#define FH_K2 0x9ae16a3b2f90404fULL

__device__ __forceinline__ u64 fh_rot(u64 v, int r) { return (v >> r) | (v << (64 - r)); }
__device__ __forceinline__ u64 fh_rotl(u64 v, int r) { return (v << r) | (v >> (64 - r)); }
__device__ __forceinline__ u64 fh_mix(u64 v) { return v ^ (v >> 47); }

// Unaligned little-endian loads, byte by byte (works for local and global).
__device__ __forceinline__ u64 fh_fetch64(const unsigned char* p) {
    u64 r = 0;
#pragma unroll
    for (int j = 7; j >= 0; --j) r = (r << 8) | p[j];
    return r;
}
__device__ __forceinline__ u64 fh_fetch32(const unsigned char* p) {
    return (u64)p[0] | ((u64)p[1] << 8) | ((u64)p[2] << 16) | ((u64)p[3] << 24);
}

__device__ __forceinline__ u64 fh_len16(u64 u, u64 v, u64 mul) {
    u64 a = fh_mix((u ^ v) * mul);
    u64 b = fh_mix((v ^ a) * mul);
    return b * mul;
}

__device__ u64 fh_len0to16(const unsigned char* s, u64 n) {
    if (n >= 8) {
        u64 mul = FH_K2 + n * 2;
        u64 a = fh_fetch64(s) + FH_K2;
        u64 b = fh_fetch64(s + n - 8);
        u64 c = fh_rot(b, 37) * mul + a;
        u64 d = (fh_rot(a, 25) + b) * mul;
        return fh_len16(c, d, mul);
    }
    if (n >= 4) {
        u64 mul = FH_K2 + n * 2;
        u64 a = fh_fetch32(s);
        return fh_len16(n + (a << 3), fh_fetch32(s + n - 4), mul);
    }
    if (n > 0) {
        u32 a = s[0], b = s[n >> 1], c = s[n - 1];
        u32 y = a + (b << 8);
        u32 z = (u32)n + (c << 2);
        return fh_mix((u64)y * FH_K2 ^ (u64)z * FH_K0) * FH_K2;
    }
    return FH_K2;
}

__device__ u64 fh_len17to32(const unsigned char* s, u64 n) {
    u64 mul = FH_K2 + n * 2;
    u64 a = fh_fetch64(s) * FH_K1;
    u64 b = fh_fetch64(s + 8);
    u64 c = fh_fetch64(s + n - 8) * mul;
    u64 d = fh_fetch64(s + n - 16) * FH_K2;
    return fh_len16(fh_rot(a + b, 43) + fh_rot(c, 30) + d, a + fh_rot(b + FH_K2, 18) + c, mul);
}

__device__ u64 fh_len33to64(const unsigned char* s, u64 n) {
    u64 mul = FH_K2 + n * 2;
    u64 a = fh_fetch64(s) * FH_K2;
    u64 b = fh_fetch64(s + 8);
    u64 c = fh_fetch64(s + n - 8) * mul;
    u64 d = fh_fetch64(s + n - 16) * FH_K2;
    u64 y = fh_rot(a + b, 43) + fh_rot(c, 30) + d;
    u64 z = fh_len16(y, a + fh_rot(b + FH_K2, 18) + c, mul);
    u64 e = fh_fetch64(s + 16) * mul;
    u64 f = fh_fetch64(s + 24);
    u64 g = (y + fh_fetch64(s + n - 32)) * mul;
    u64 h = (z + fh_fetch64(s + n - 24)) * mul;
    return fh_len16(fh_rot(e + f, 43) + fh_rot(g, 30) + h, e + fh_rot(f + a, 18) + g, mul);
}

__device__ __forceinline__ void fh_weak32(const unsigned char* s, u64 a, u64 b, u64* o0, u64* o1) {
    u64 w = fh_fetch64(s), x = fh_fetch64(s + 8), y = fh_fetch64(s + 16), z = fh_fetch64(s + 24);
    a += w;
    b = fh_rot(b + a + z, 21);
    u64 c = a;
    a += x;
    a += y;
    b += fh_rot(a, 44);
    *o0 = a + z;
    *o1 = b + c;
}

__device__ u64 fh_fingerprint64(const unsigned char* s, u64 n) {
    if (n <= 16) return fh_len0to16(s, n);
    if (n <= 32) return fh_len17to32(s, n);
    if (n <= 64) return fh_len33to64(s, n);
    const u64 seed = 81;
    u64 x = seed, y = seed * FH_K1 + 113;
    u64 z = fh_mix(y * FH_K2 + 113) * FH_K2;
    u64 v0 = 0, v1 = 0, w0 = 0, w1 = 0;
    x = x * FH_K2 + fh_fetch64(s);
    const unsigned char* end = s + ((n - 1) / 64) * 64;
    const unsigned char* last64 = end + ((n - 1) & 63) - 63;
    do {
        x = fh_rot(x + y + v0 + fh_fetch64(s + 8), 37) * FH_K1;
        y = fh_rot(y + v1 + fh_fetch64(s + 48), 42) * FH_K1;
        x ^= w1;
        y += v0 + fh_fetch64(s + 40);
        z = fh_rot(z + w0, 33) * FH_K1;
        fh_weak32(s, v1 * FH_K1, x + w0, &v0, &v1);
        fh_weak32(s + 32, z + w1, y + fh_fetch64(s + 16), &w0, &w1);
        u64 t = z; z = x; x = t;
        s += 64;
    } while (s != end);
    u64 mul = FH_K1 + ((z & 0xff) << 1);
    s = last64;
    w0 += ((n - 1) & 63);
    v0 += w0;
    w0 += v0;
    x = fh_rot(x + y + v0 + fh_fetch64(s + 8), 37) * mul;
    y = fh_rot(y + v1 + fh_fetch64(s + 48), 42) * mul;
    x ^= w1 * 9;
    y += v0 * 9 + fh_fetch64(s + 40);
    z = fh_rot(z + w0, 33) * mul;
    fh_weak32(s, v1 * mul, x + w0, &v0, &v1);
    fh_weak32(s + 32, z + w1, y + fh_fetch64(s + 16), &w0, &w1);
    u64 t = z; z = x; x = t;
    return fh_len16(fh_len16(v0, w0, mul) + fh_mix(y) * FH_K0 + z, fh_len16(v1, w1, mul) + x, mul);
}

#define SIP_ROUND(v0, v1, v2, v3)                                            \
    do {                                                                     \
        v0 += v1; v1 = fh_rotl(v1, 13) ^ v0; v0 = fh_rotl(v0, 32);           \
        v2 += v3; v3 = fh_rotl(v3, 16) ^ v2;                                 \
        v0 += v3; v3 = fh_rotl(v3, 21) ^ v0;                                 \
        v2 += v1; v1 = fh_rotl(v1, 17) ^ v2; v2 = fh_rotl(v2, 32);           \
    } while (0)

__device__ u64 fh_siphash24(u64 k0, u64 k1, const unsigned char* s, u64 n) {
    u64 v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    u64 v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    u64 full = n / 8 * 8;
    for (u64 i = 0; i < full; i += 8) {
        u64 m = fh_fetch64(s + i);
        v3 ^= m;
        SIP_ROUND(v0, v1, v2, v3);
        SIP_ROUND(v0, v1, v2, v3);
        v0 ^= m;
    }
    u64 last = n << 56;
    for (u64 j = 0; full + j < n; ++j) last |= (u64)s[full + j] << (8 * j);
    v3 ^= last;
    SIP_ROUND(v0, v1, v2, v3);
    SIP_ROUND(v0, v1, v2, v3);
    v0 ^= last;
    v2 ^= 0xff;
    SIP_ROUND(v0, v1, v2, v3);
    SIP_ROUND(v0, v1, v2, v3);
    SIP_ROUND(v0, v1, v2, v3);
    SIP_ROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}

__device__ __forceinline__ u64 fh_hash(int kind, u64 k0, u64 k1, const unsigned char* s, u64 n) {
    return kind == HKV_HASH_FINGERPRINT64 ? fh_fingerprint64(s, n) : fh_siphash24(k0, k1, s, n);
}

// %lld text of x into buf (at most 20 bytes); returns the length. Eight
// digits at a time in 32-bit arithmetic after two 64-bit divisions.
__device__ __forceinline__ u64 fh_format_i64(long long x, unsigned char* buf) {
    u64 u = x < 0 ? (u64)0 - (u64)x : (u64)x;
    unsigned char tmp[20];
    int n = 0;
    while (u >= 100000000ULL) {
        u64 q = u / 100000000ULL;
        u32 r = (u32)(u - q * 100000000ULL);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            tmp[n++] = (unsigned char)('0' + r % 10);
            r /= 10;
        }
        u = q;
    }
    u32 r = (u32)u;
    do {
        tmp[n++] = (unsigned char)('0' + r % 10);
        r /= 10;
    } while (r != 0);
    int len = 0;
    if (x < 0) buf[len++] = '-';
    while (n > 0) buf[len++] = tmp[--n];
    return (u64)len;
}

extern "C" __global__ void features_int64(const long long* x, u64 n, int kind, u64 k0, u64 k1, u64 num_buckets,
                                          u64* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned char buf[20];
    u64 len = fh_format_i64(x[i], buf);
    out[i] = fh_hash(kind, k0, k1, buf, len) % num_buckets;
}

extern "C" __global__ void features_strings(const unsigned char* bytes, const u32* offsets, u64 n, int kind, u64 k0,
                                            u64 k1, u64 num_buckets, u64* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 a = offsets[i], b = offsets[i + 1];
    out[i] = fh_hash(kind, k0, k1, bytes + a, (u64)(b - a)) % num_buckets;
}
