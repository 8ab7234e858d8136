// Shared device helpers of the table kernels (lookup, upsert, update, erase,
// export). They mirror shard/src/cpu.rs rule for rule: buckets of 128 slots,
// a one-line digest array per bucket, the lowest free slot for a newcomer,
// the minimum-score slot (lowest slot on ties) as the eviction victim, the
// score rules of shard/src/score.rs.
//
// A key is served by a group of G threads of one warp (G = 4, 8, 16 or 32):
// thread r of the group owns slots [r * 128/G, (r + 1) * 128/G) of a bucket,
// so the group reads a digest line in one coalesced access and every
// group-wide choice ("lowest slot", "minimum score") is a ballot or a
// shuffle reduction in slot order.
//
// Writers lock buckets with a spin lock per bucket (two buckets: lower index
// first). Reader kernels run with no writer on the table (the host-side lock
// groups guarantee it) and take no lock. Writer kernels read bucket state
// with ld.cg (L2), so that an entry written by another SM is seen.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define HKV_EMPTY_KEY 0xFFFFFFFFFFFFFFFFULL

// Policies, in the order of ScorePolicy.
#define HKV_LRU 0
#define HKV_LFU 1
#define HKV_EPOCH_LRU 2
#define HKV_EPOCH_LFU 3
#define HKV_CUSTOM 4

// Outcomes, as shard::Outcome.
#define HKV_UPDATED 0
#define HKV_INSERTED 1
#define HKV_EVICTED 2
#define HKV_REJECTED 3
#define HKV_ABSENT 4

// Per-batch counters (u64 each).
#define HKV_C_HITS 0
#define HKV_C_UPDATED 1
#define HKV_C_INSERTED 2
#define HKV_C_EVICTED 3
#define HKV_C_REJECTED 4
#define HKV_C_ABSENT 5
#define HKV_C_LOST 6
#define HKV_C_ERASED 7
#define HKV_NCOUNTERS 8

// The table's device state, passed by value (mirrors cuda_table::TableArgs).
struct HkvTable {
    u8* digests;       // nbuckets * 128
    u64* keys;         // nbuckets * 128
    u64* scores;       // nbuckets * 128
    int* sizes;        // nbuckets: occupied slots
    int* locks;        // nbuckets: writer spin locks
    float* fast;       // values of positions < fast_slots, dim floats each
    float** slices;    // host-tier slices (device-mapped pointers)
    u64 fast_slots;
    u64 nbuckets;
    u32 slice_shift;   // slots per host slice = 1 << slice_shift
    u32 dim;
    u32 dual;
    u32 pad;
};

// How written keys are scored (mirrors cuda_table::ScoringArgs).
struct HkvScoring {
    u64 now_ns;
    u32 policy;
    u32 epoch;
    u32 verbatim;  // load: scores as given
    u32 pad;
};

// A key and score predicate (mirrors shard::Filter).
struct HkvFilter {
    u64 key_mask;
    u64 key_pattern;
    u64 min_score;
    u64 max_score;
};

__device__ __forceinline__ bool hkv_matches(const HkvFilter& f, u64 key, u64 score) {
    return (key & f.key_mask) == f.key_pattern && score >= f.min_score && score <= f.max_score;
}

__device__ __forceinline__ u8 hkv_digest(u64 key) { return (u8)(hkv_fmix64(key) >> 56); }

// Bucket 1 and digest; bucket 2 (dual mode) as shard::hash::bucket2.
__device__ __forceinline__ void hkv_locate(const HkvTable& t, u64 key, u64* b1, u64* b2, u8* d) {
    u64 h = hkv_fmix64(key);
    *b1 = (h & HKV_LOW56) % t.nbuckets;
    *d = (u8)(h >> 56);
    if (t.dual) {
        u64 x = (hkv_fmix64(key ^ HKV_DUAL_SEED) & HKV_LOW56) % t.nbuckets;
        if (x == *b1 && t.nbuckets > 1) x = (x + 1) % t.nbuckets;
        *b2 = x;
    } else {
        *b2 = *b1;
    }
}

// The value row of slot position `pos` (bucket * 128 + slot).
__device__ __forceinline__ float* hkv_row(const HkvTable& t, u64 pos) {
    if (pos < t.fast_slots) return t.fast + pos * t.dim;
    u64 q = pos - t.fast_slots;
    return t.slices[q >> t.slice_shift] + (q & ((1ULL << t.slice_shift) - 1)) * t.dim;
}

// ---- scores (shard/src/score.rs) ----------------------------------------

__device__ __forceinline__ u64 hkv_on_insert(const HkvScoring& s, bool has, u64 input) {
    u64 hi = (u64)s.epoch << 32;
    switch (s.policy) {
        case HKV_LRU: return s.now_ns;
        case HKV_LFU: return has ? input : 1;
        case HKV_EPOCH_LRU: return hi | ((s.now_ns >> 20) & 0xffffffffULL);
        case HKV_EPOCH_LFU: return hi | ((has ? input : 1) & 0xffffffffULL);
        default: return has ? input : 0;
    }
}

__device__ __forceinline__ u64 hkv_admission(const HkvScoring& s, u64 score) {
    return (s.policy == HKV_LFU || s.policy == HKV_LRU) ? 0xFFFFFFFFFFFFFFFFULL : score;
}

__device__ __forceinline__ u64 hkv_on_upsert(const HkvScoring& s, u64 old, bool has, u64 input) {
    switch (s.policy) {
        case HKV_LFU: {
            u64 inc = has ? input : 1;
            u64 r = old + inc;
            return r < old ? 0xFFFFFFFFFFFFFFFFULL : r;
        }
        case HKV_EPOCH_LFU: {
            u64 low = (old & 0xffffffffULL) + ((has ? input : 1) & 0xffffffffULL);
            if (low > 0xffffffffULL) low = 0xffffffffULL;
            return ((u64)s.epoch << 32) | low;
        }
        default: return hkv_on_insert(s, has, input);
    }
}

__device__ __forceinline__ u64 hkv_on_update(const HkvScoring& s, u64 old, bool has, u64 input) {
    if (!has && (s.policy == HKV_LFU || s.policy == HKV_EPOCH_LFU || s.policy == HKV_CUSTOM)) return old;
    return hkv_on_upsert(s, old, has, input);
}

// ---- groups of G threads --------------------------------------------------

template <int G>
struct HkvGroup {
    u32 rank, base, mask;
    __device__ __forceinline__ HkvGroup() {
        u32 lane = threadIdx.x & 31;
        rank = lane & (G - 1);
        base = lane & ~(G - 1);
        mask = (G == 32) ? 0xffffffffu : (((1u << G) - 1) << base);
    }
    __device__ __forceinline__ u32 ballot(bool p) const {
        u32 b = __ballot_sync(mask, p);
        return G == 32 ? b : (b >> base) & ((1u << G) - 1);
    }
    __device__ __forceinline__ int bcast(int v, int src) const { return __shfl_sync(mask, v, src, G); }
    __device__ __forceinline__ u64 bcast(u64 v, int src) const { return __shfl_sync(mask, v, src, G); }
    __device__ __forceinline__ void sync() const { __syncwarp(mask); }
};

// Loads that see other SMs' writes (writers) or may use the read-only path (readers).
template <bool CG>
__device__ __forceinline__ u64 hkv_ld(const u64* p) {
    if (CG) return __ldcg(p);
    return __ldg(p);
}

// Bit i set: slot rank * (128 / G) + i has digest d.
template <int G, bool CG>
__device__ __forceinline__ u32 hkv_match(const u8* line, u32 rank, u8 d) {
    constexpr int SPT = 128 / G;
    u32 pat = 0x01010101u * d;
    u32 w[SPT / 4];
    if constexpr (SPT == 32) {
        const uint4* q = reinterpret_cast<const uint4*>(line) + rank * 2;
        uint4 v = CG ? __ldcg(q) : __ldg(q);
        uint4 u = CG ? __ldcg(q + 1) : __ldg(q + 1);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
        w[4] = u.x; w[5] = u.y; w[6] = u.z; w[7] = u.w;
    } else if constexpr (SPT == 16) {
        uint4 v = CG ? __ldcg(reinterpret_cast<const uint4*>(line) + rank) : __ldg(reinterpret_cast<const uint4*>(line) + rank);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (SPT == 8) {
        uint2 v = CG ? __ldcg(reinterpret_cast<const uint2*>(line) + rank) : __ldg(reinterpret_cast<const uint2*>(line) + rank);
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = CG ? __ldcg(reinterpret_cast<const u32*>(line) + rank) : __ldg(reinterpret_cast<const u32*>(line) + rank);
    }
    u32 m = 0;
#pragma unroll
    for (int i = 0; i < SPT / 4; ++i) {
        u32 x = __vcmpeq4(w[i], pat);
        u32 c = ((x >> 7) & 1u) | ((x >> 14) & 2u) | ((x >> 21) & 4u) | ((x >> 28) & 8u);
        m |= c << (4 * i);
    }
    return m;
}

// The slot of `key` in bucket b, or -1 (every thread gets the answer).
template <int G, bool CG>
__device__ __forceinline__ int hkv_find_in(const HkvTable& t, const HkvGroup<G>& g, u64 b, u64 key, u8 d) {
    constexpr int SPT = 128 / G;
    u32 m = hkv_match<G, CG>(t.digests + b * 128, g.rank, d);
    int mine = -1;
    while (m) {
        int i = __ffs(m) - 1;
        m &= m - 1;
        int s = g.rank * SPT + i;
        if (hkv_ld<CG>(t.keys + b * 128 + s) == key) {
            mine = s;
            break;
        }
    }
    u32 who = g.ballot(mine >= 0);
    if (!who) return -1;
    return g.bcast(mine, __ffs(who) - 1);
}

// Lowest free slot of bucket b, or -1 (writers, bucket locked).
template <int G>
__device__ __forceinline__ int hkv_free_slot(const HkvTable& t, const HkvGroup<G>& g, u64 b, u8 empty_d) {
    constexpr int SPT = 128 / G;
    u32 m = hkv_match<G, true>(t.digests + b * 128, g.rank, empty_d);
    int mine = -1;
    while (m) {
        int i = __ffs(m) - 1;
        m &= m - 1;
        int s = g.rank * SPT + i;
        if (__ldcg(t.keys + b * 128 + s) == HKV_EMPTY_KEY) {
            mine = s;
            break;
        }
    }
    u32 who = g.ballot(mine >= 0);
    if (!who) return -1;
    return g.bcast(mine, __ffs(who) - 1);
}

// Minimum score of a full bucket and its slot (lowest slot on ties).
template <int G>
__device__ __forceinline__ void hkv_min_slot(const HkvTable& t, const HkvGroup<G>& g, u64 b, int* slot, u64* score) {
    constexpr int SPT = 128 / G;
    const int first = g.rank * SPT;
    int bs = first;
    u64 bv = __ldcg(t.scores + b * 128 + first);
#pragma unroll
    for (int i = 1; i < SPT; ++i) {
        u64 v = __ldcg(t.scores + b * 128 + first + i);
        if (v < bv) {
            bv = v;
            bs = first + i;
        }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) {
        u64 ov = __shfl_xor_sync(g.mask, bv, off, G);
        int os = __shfl_xor_sync(g.mask, bs, off, G);
        if (ov < bv || (ov == bv && os < bs)) {
            bv = ov;
            bs = os;
        }
    }
    *slot = bs;
    *score = bv;
}

// Writer locks: the group's first thread spins with an acquire CAS; the
// release store that unlocks publishes the group's writes (ordered before it
// by the group's __syncwarp). Lower bucket index first.
__device__ __forceinline__ int hkv_cas_acquire(int* p) {
    int old;
    asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(p) : "memory");
    return old;
}

__device__ __forceinline__ void hkv_store_release(int* p) {
    asm volatile("st.release.gpu.global.b32 [%0], 0;" ::"l"(p) : "memory");
}

__device__ __forceinline__ void hkv_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

template <int G>
__device__ __forceinline__ void hkv_lock2(const HkvTable& t, const HkvGroup<G>& g, u64 b1, u64 b2) {
    if (g.rank == 0) {
        u64 lo = b1 < b2 ? b1 : b2, hi = b1 < b2 ? b2 : b1;
        while (hkv_cas_acquire(t.locks + lo) != 0) __nanosleep(32);
        if (hi != lo)
            while (hkv_cas_acquire(t.locks + hi) != 0) __nanosleep(32);
    }
    g.sync();
}

template <int G>
__device__ __forceinline__ void hkv_unlock2(const HkvTable& t, const HkvGroup<G>& g, u64 b1, u64 b2) {
    g.sync();
    if (g.rank == 0) {
        if (b2 != b1) hkv_store_release(t.locks + b2);
        hkv_store_release(t.locks + b1);
    }
}

// Starts fetching a bucket's digest line (and sizes word) into L2 while the
// lock is being taken.
__device__ __forceinline__ void hkv_prefetch_bucket(const HkvTable& t, u64 b) {
    hkv_prefetch_l2(t.digests + b * 128);
    hkv_prefetch_l2(t.sizes + b);
}

// ---- value rows, copied by the group ---------------------------------------

template <int G, bool CG>
__device__ __forceinline__ void hkv_copy_row(float* dst, const float* src, u32 dim, u32 rank) {
    if ((dim & 3) == 0) {
        const float4* s = reinterpret_cast<const float4*>(src);
        float4* o = reinterpret_cast<float4*>(dst);
        for (u32 i = rank; i < dim / 4; i += G) o[i] = CG ? __ldcg(s + i) : __ldg(s + i);
    } else {
        for (u32 i = rank; i < dim; i += G) dst[i] = CG ? __ldcg(src + i) : __ldg(src + i);
    }
}

template <int G>
__device__ __forceinline__ void hkv_add_row(float* dst, const float* delta, u32 dim, u32 rank) {
    for (u32 i = rank; i < dim; i += G) dst[i] = __ldcg(dst + i) + delta[i];
}

// ---- per-block counters ------------------------------------------------------

// Adds the block's counts to the batch counters (every thread of the block calls it).
__device__ __forceinline__ void hkv_flush_counters(u64* shared, u64* global) {
    __syncthreads();
    if (threadIdx.x < HKV_NCOUNTERS && shared[threadIdx.x] != 0) atomicAdd(global + threadIdx.x, shared[threadIdx.x]);
}

#define HKV_COUNTERS_INIT                                         \
    __shared__ u64 hkv_cnt[HKV_NCOUNTERS];                        \
    if (threadIdx.x < HKV_NCOUNTERS) hkv_cnt[threadIdx.x] = 0;    \
    __syncthreads();
