// route family: the device-resident request path of a GPU group. A batch
// already on one GPU is split by owning shard on that GPU (a stable
// partition: keys bound for one shard keep their request order), exchanged
// with NCCL, served, exchanged back and put in request order again.
//
// route_count   dest[i] = shard_of(keys[i]); per 1024-key tile, keys per dest
// route_scan    exclusive scan of the tile counts (dest-major) -> offsets,
//               keys per dest -> totals (one block)
// route_scatter send_keys[p] = keys[i], pos[i] = p, p stable per dest
// rows_scatter_* dst[pos[i]] = src[i]     (rows of w words)
// rows_gather_*  dst[i] = src[pos[i]]     (where mask, if any, is set at pos[i])
// shard_mask    mask[i] = (shard_of(keys[i]) == d), for one shard d
// route_masks   masks[d * n + i] = (shard_of(keys[i]) == d), keys per d
//               added to totals: the peer path, where each owner serves its
//               keys straight out of every GPU's batch
//
// The shard mix mirrors shard/src/hash.rs::shard_of bit for bit.
// HKV_SHARD_SEED, HKV_ROUTE_MAX (shards at most) and HKV_TILE (keys per
// tile) are in abi.h.

__device__ __forceinline__ u32 hkv_shard_of(u64 key, u32 shards) {
    return (u32)__umul64hi(hkv_fmix64(key ^ HKV_SHARD_SEED), (u64)shards);
}

// Key i = blockIdx.x * 1024 + threadIdx.x: its shard (HKV_ROUTE_MAX past
// n), with the tile's keys per shard counted into c (HKV_ROUTE_MAX shared
// counters). Every thread of the block calls it; c is complete on return.
__device__ __forceinline__ u32 hkv_tile_shards(const u64* keys, u64 n, u32 shards, u32* c, u64* i) {
    if (threadIdx.x < HKV_ROUTE_MAX) c[threadIdx.x] = 0;
    __syncthreads();
    *i = (u64)blockIdx.x * HKV_TILE + threadIdx.x;
    u32 d = HKV_ROUTE_MAX;
    if (*i < n) {
        d = hkv_shard_of(keys[*i], shards);
        atomicAdd(&c[d], 1u);
    }
    __syncthreads();
    return d;
}

// Launch: ceil(n / 1024) blocks of 1024 threads. tile_counts[d * tiles + tile];
// mine (may be null): mine[i] = (dest[i] == me), the filter a shard uses to
// serve its own keys straight from the batch.
extern "C" __global__ void route_count(const u64* keys, u64 n, u32 shards, u8* dest, u32* tile_counts, u32 me,
                                       u8* mine) {
    __shared__ u32 c[HKV_ROUTE_MAX];
    u64 i;
    u32 d = hkv_tile_shards(keys, n, shards, c, &i);
    if (i < n) {
        dest[i] = (u8)d;
        if (mine) mine[i] = d == me;
    }
    if (threadIdx.x < shards) tile_counts[(u64)threadIdx.x * gridDim.x + blockIdx.x] = c[threadIdx.x];
}

// Launch: one block of 1024 threads. offsets[j] = sum of tile_counts[0..j)
// over the dest-major array of shards * tiles counts; totals[d] = keys for d.
extern "C" __global__ void route_scan(const u32* tile_counts, u64 tiles, u32 shards, u64* offsets, u64* totals) {
    u64 total = hkv_block_scan(tile_counts, tiles * shards, offsets);
    __syncthreads();
    if (threadIdx.x < shards) {
        u64 d = threadIdx.x;
        u64 start = tiles ? offsets[d * tiles] : 0;
        u64 end = d + 1 < shards ? offsets[(d + 1) * tiles] : total;
        totals[d] = end - start;
    }
}

// shard_mask: mask[i] = (shard_of(keys[i]) == d), one thread per key: the
// keys of shard d in a batch that every shard of a table reads in place
// (a client's device memory, hkvd). Any shard count.
extern "C" __global__ void shard_mask(const u64* keys, u64 n, u32 shards, u32 d, u8* mask) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) mask[i] = hkv_shard_of(keys[i], shards) == d;
}

// Launch: ceil(n / 1024) blocks of 1024 threads; totals (shards u64) zeroed
// by the caller.
extern "C" __global__ void route_masks(const u64* keys, u64 n, u32 shards, u8* masks, u64* totals) {
    __shared__ u32 c[HKV_ROUTE_MAX];
    u64 i;
    u32 d = hkv_tile_shards(keys, n, shards, c, &i);
    if (i < n)
        for (u32 r = 0; r < shards; ++r) masks[(u64)r * n + i] = r == d;
    if (threadIdx.x < shards && c[threadIdx.x])
        atomicAdd((unsigned long long*)&totals[threadIdx.x], (unsigned long long)c[threadIdx.x]);
}

// Launch: as route_count. Each key's place among the keys of its tile bound
// for the same shard comes from warp ballots, so the partition is stable.
extern "C" __global__ void route_scatter(const u64* keys, u64 n, u32 shards, const u8* dest, const u64* offsets,
                                         u64* send_keys, u32* pos) {
    __shared__ u32 wt[HKV_ROUTE_MAX][32];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 i = (u64)blockIdx.x * HKV_TILE + threadIdx.x;
    bool valid = i < n;
    u32 d = valid ? dest[i] : 0xffu;
    u32 before = 0;
    for (u32 r = 0; r < shards; ++r) {
        u32 m = __ballot_sync(0xffffffffu, d == r);
        if (d == r) before = __popc(m & ((1u << lane) - 1u));
        if (lane == 0) wt[r][warp] = __popc(m);
    }
    __syncthreads();
    if (warp < shards) {
        u32 v = wt[warp][lane], incl = v;
        for (int off = 1; off < 32; off <<= 1) {
            u32 t = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= (u32)off) incl += t;
        }
        wt[warp][lane] = incl - v;
    }
    __syncthreads();
    if (valid) {
        u64 p = offsets[(u64)d * gridDim.x + blockIdx.x] + wt[d][warp] + before;
        send_keys[p] = keys[i];
        pos[i] = (u32)p;
    }
}

// Rows i with dest[i] == me are skipped (dest may be null): a shard's own
// keys are served in place and never staged.
template <typename T>
__device__ __forceinline__ void rows_scatter(const T* src, T* dst, const u32* pos, u64 n, u64 w, const u8* dest,
                                             u32 me) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n * w) return;
    u64 i = e / w, j = e - i * w;
    if (dest && dest[i] == me) return;
    dst[(u64)pos[i] * w + j] = src[e];
}

template <typename T>
__device__ __forceinline__ void rows_gather(const T* src, T* dst, const u32* pos, const u8* mask, u64 n, u64 w,
                                            const u8* dest, u32 me) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n * w) return;
    u64 i = e / w, j = e - i * w;
    if (dest && dest[i] == me) return;
    u64 p = pos[i];
    if (mask && !mask[p]) return;
    dst[e] = src[p * w + j];
}

// The row kernels over words of type T.
// Launch: ceil(n * w / 256) blocks of 256 threads.
#define HKV_SCATTER_KERNEL(NAME, T)                                                                              \
    extern "C" __global__ void NAME(const T* src, T* dst, const u32* pos, u64 n, u64 w, const u8* dest, u32 me) { \
        rows_scatter<T>(src, dst, pos, n, w, dest, me);                                                           \
    }
#define HKV_GATHER_KERNEL(NAME, T)                                                                               \
    extern "C" __global__ void NAME(const T* src, T* dst, const u32* pos, const u8* mask, u64 n, u64 w,          \
                                    const u8* dest, u32 me) {                                                     \
        rows_gather<T>(src, dst, pos, mask, n, w, dest, me);                                                      \
    }

HKV_GATHER_KERNEL(rows_gather_u8, u8)
HKV_SCATTER_KERNEL(rows_scatter_u64, u64)
HKV_SCATTER_KERNEL(rows_scatter_f32, float)
HKV_GATHER_KERNEL(rows_gather_f32, float)
HKV_SCATTER_KERNEL(rows_scatter_f128, float4)
HKV_GATHER_KERNEL(rows_gather_f128, float4)
