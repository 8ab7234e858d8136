// Shared device helpers of the table kernels (lookup, upsert, update, erase,
// export). They mirror shard/src/cpu.rs rule for rule: buckets of 128 slots,
// a one-line digest array per bucket, the lowest free slot for a newcomer,
// the minimum-score slot (lowest slot on ties) as the eviction victim, the
// score rules of shard/src/score.rs (Lfu with LRU ties included: the
// victim rule stays "minimum score", the recency is in the score).
//
// A key is served by a group of G threads of one warp (G = 1, 2, 4, 8, 16
// or 32; the host picks G per batch): thread r of the group owns slots
// [r * 128/G, (r + 1) * 128/G) of a bucket, so the group reads a digest
// line in one coalesced access and every group-wide choice ("lowest slot",
// "minimum score") is a ballot or a shuffle reduction in slot order. Fewer
// threads per key keep more keys in flight; the keys of one warp diverge
// (lock waits, hit or miss, free slot or victim scan), and diverged paths
// run one after another.
//
// Writers lock buckets with a spin lock per bucket (two buckets: lower index
// first). Reader kernels run with no writer on the table (the host-side lock
// groups guarantee it) and take no lock. Writer kernels read bucket state
// with ld.cg (L2), so that an entry written by another SM is seen.

// The structs the kernels take by value (HkvTable, HkvScoring, HkvFilter,
// HkvSample), the policies (HKV_LRU ...), outcomes (HKV_UPDATED ...) and
// counters (HKV_C_*) are in abi.h, prepended before this file and checked
// against the Rust side at build and load time.

// The key index served by thread slot j of an n-key launch (see HkvTable::order).
__device__ __forceinline__ u64 hkv_key_index(const HkvTable& t, u64 j, u64 n) {
    return t.order && j < n ? t.order[j] : j;
}

__device__ __forceinline__ bool hkv_matches(const HkvFilter& f, u64 key, u64 score) {
    return (key & f.key_mask) == f.key_pattern && score >= f.min_score && score <= f.max_score;
}

// A key's first bucket from its hash.
__device__ __forceinline__ u64 hkv_bucket1(const HkvTable& t, u64 h) { return (h & HKV_LOW56) % t.nbuckets; }

// Bucket 1 and digest; bucket 2 (dual mode) as shard::hash::bucket2.
__device__ __forceinline__ void hkv_locate(const HkvTable& t, u64 key, u64* b1, u64* b2, u8* d) {
    u64 h = hkv_fmix64(key);
    *b1 = hkv_bucket1(t, h);
    *d = hkv_key_digest(h);
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

// Lfu with LRU ties (score::LFU_STAMP_BITS, score::LFU_MAX_FREQUENCY): the
// frequency in the high 24 bits, the batch's clock in ~ms in the low 40, so
// that hkv_min_slot's "minimum score" evicts the least frequent entry and,
// among equal frequencies, the least recently written. HKV_LFU_STAMP_BITS
// is in abi.h.
#define HKV_LFU_MAX_FREQ ((1ULL << (64 - HKV_LFU_STAMP_BITS)) - 1)
#define HKV_LFU_STAMP_MASK ((1ULL << HKV_LFU_STAMP_BITS) - 1)

// An Lfu score of frequency f written now (Scorer::lfu).
__device__ __forceinline__ u64 hkv_lfu(const HkvScoring& s, u64 f) {
    if (!s.lfu_lru) return f;
    u64 stamp = s.now_ns >> 20;
    if (stamp > HKV_LFU_STAMP_MASK) stamp = HKV_LFU_STAMP_MASK;
    return ((f < HKV_LFU_MAX_FREQ ? f : HKV_LFU_MAX_FREQ) << HKV_LFU_STAMP_BITS) | stamp;
}

// Adaptive: the bit of a main-tier entry's score (score::ADAPTIVE_MAIN); clear: window.
#define HKV_ADAPTIVE_MAIN (1ULL << 63)
// Adaptive: the bit of a protected main-tier entry (score::ADAPTIVE_PROTECTED); clear: probation.
#define HKV_ADAPTIVE_PROTECTED (1ULL << 62)
// Adaptive: a score's find hits (bits 0-3; score::ADAPTIVE_HITS), and the
// largest clock reading it holds, shifted past them (ADAPTIVE_STAMP_MAX).
#define HKV_ADAPTIVE_HITS 15ULL
#define HKV_ADAPTIVE_STAMP_MAX ((1ULL << 58) - 1)

// Adaptive: the window bits, 4 words a bucket after the sketch's lines (one
// allocation, sized for the table's largest size): bit s of bucket b is set
// for every slot that holds a window entry (occupied, HKV_ADAPTIVE_MAIN
// clear), so that a fill reads the window's scores only (hkv_adapt_fill).
// A superset: a write that empties a slot (erase, erase_if, clear, a
// rehash's old storage) leaves its bit, which a fill checks against the
// slot and clears. Every write that makes a window entry sets its bit: the
// adaptive fill and room paths (a newcomer), a verbatim write (a load, a
// rehash) and a relocation's move. Bits change only under the bucket's lock,
// by atomics (a group's threads may share a word).
__device__ __forceinline__ u32* hkv_window_bits(const HkvScoring& s) {
    return reinterpret_cast<u32*>(s.sketch + s.sketch_lines * 64);
}

// Adaptive (s.sketch non-null): position pos holds a window entry
// (`window`) or not; nothing for other policies.
__device__ __forceinline__ void hkv_window_mark(const HkvScoring& s, u64 pos, bool window) {
    if (!s.sketch) return;
    u32* w = hkv_window_bits(s) + (pos >> 5);
    const u32 m = 1u << (pos & 31);
    if (window) atomicOr(w, m);
    else atomicAnd(w, ~m);
}

__device__ __forceinline__ u64 hkv_on_insert(const HkvScoring& s, bool has, u64 input);

// Adaptive (Scorer::adaptive_refresh): `old` refreshed (the clock now, a
// main-tier entry protected) with `hits` more find hits counted in its
// bits 0-3 (saturating at 15).
__device__ __forceinline__ u64 hkv_adaptive_refresh(const HkvScoring& s, u64 old, u64 hits) {
    u64 h = (old & HKV_ADAPTIVE_HITS) + hits;
    return ((old & HKV_ADAPTIVE_MAIN) ? (HKV_ADAPTIVE_MAIN | HKV_ADAPTIVE_PROTECTED) : 0) |
           hkv_on_insert(s, false, 0) | (h < HKV_ADAPTIVE_HITS ? h : HKV_ADAPTIVE_HITS);
}

__device__ __forceinline__ u64 hkv_on_insert(const HkvScoring& s, bool has, u64 input) {
    u64 hi = (u64)s.epoch << 32;
    switch (s.policy) {
        case HKV_LRU: return s.now_ns;
        case HKV_ADAPTIVE: return (s.now_ns < HKV_ADAPTIVE_STAMP_MAX ? s.now_ns : HKV_ADAPTIVE_STAMP_MAX) << 4;
        case HKV_LFU: return hkv_lfu(s, has ? input : 1);
        case HKV_EPOCH_LRU: return hi | ((s.now_ns >> 20) & 0xffffffffULL);
        case HKV_EPOCH_LFU: return hi | ((has ? input : 1) & 0xffffffffULL);
        default: return has ? input : 0;
    }
}

__device__ __forceinline__ u64 hkv_admission(const HkvScoring& s, u64 score) {
    return (s.policy == HKV_LFU || s.policy == HKV_LRU || s.policy == HKV_ADAPTIVE) ? 0xFFFFFFFFFFFFFFFFULL : score;
}

__device__ __forceinline__ u64 hkv_on_upsert(const HkvScoring& s, u64 old, bool has, u64 input) {
    switch (s.policy) {
        case HKV_LFU: {
            u64 inc = has ? input : 1;
            u64 f = s.lfu_lru ? old >> HKV_LFU_STAMP_BITS : old;
            u64 r = f + inc;
            return hkv_lfu(s, r < f ? 0xFFFFFFFFFFFFFFFFULL : r);
        }
        case HKV_EPOCH_LFU: {
            u64 low = (old & 0xffffffffULL) + ((has ? input : 1) & 0xffffffffULL);
            if (low > 0xffffffffULL) low = 0xffffffffULL;
            return ((u64)s.epoch << 32) | low;
        }
        // A main-tier entry written or read again is protected (SLRU); its
        // find hits stay counted (writes count in the sketch).
        case HKV_ADAPTIVE: return hkv_adaptive_refresh(s, old, 0);
        default: return hkv_on_insert(s, has, input);
    }
}

// Whether a present key's new score (hkv_on_upsert, or hkv_on_update when
// `update`) depends on its old one; when not, the old score is not read.
__device__ __forceinline__ bool hkv_needs_old(const HkvScoring& s, bool has, bool update) {
    return s.policy == HKV_LFU || s.policy == HKV_EPOCH_LFU || s.policy == HKV_ADAPTIVE ||
           (update && !has && s.policy == HKV_CUSTOM);
}

__device__ __forceinline__ u64 hkv_on_update(const HkvScoring& s, u64 old, bool has, u64 input) {
    if (!has && (s.policy == HKV_LFU || s.policy == HKV_EPOCH_LFU || s.policy == HKV_CUSTOM)) return old;
    return hkv_on_upsert(s, old, has, input);
}

// The score of a find hit in a table whose reads refresh (Scorer::on_read):
// what a write without input gives it; Custom scores stay.
__device__ __forceinline__ u64 hkv_on_read(const HkvScoring& s, u64 old) {
    if (s.policy == HKV_ADAPTIVE) return hkv_adaptive_refresh(s, old, 1);
    return s.policy == HKV_CUSTOM ? old : hkv_on_upsert(s, old, false, 0);
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

// Starts fetching the line of p into L2.
__device__ __forceinline__ void hkv_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Loads that see other SMs' writes (writers) or may use the read-only path (readers).
template <bool CG>
__device__ __forceinline__ u64 hkv_ld(const u64* p) {
    if (CG) return __ldcg(p);
    return __ldg(p);
}

// Match bits of one thread's SPT = 128 / G slots: bit i of w[k] stands for
// slot rank * SPT + 64 * k + i.
template <int SPT>
struct HkvBits {
    static constexpr int W = SPT > 64 ? 2 : 1;
    u64 w[W];
};

// Four digest bytes against a repeated pattern: bit j set where byte j matches.
__device__ __forceinline__ u32 hkv_cmp4(u32 x, u32 pat) {
    u32 e = __vcmpeq4(x, pat);
    return ((e >> 7) & 1u) | ((e >> 14) & 2u) | ((e >> 21) & 4u) | ((e >> 28) & 8u);
}

// The thread's slots whose digest is d (into m) and, when m2 is given, d2
// (into *m2), from one read of its part of the digest line.
template <int G, bool CG>
__device__ __forceinline__ void hkv_match(const u8* line, u32 rank, u8 d, HkvBits<128 / G>& m, u8 d2,
                                          HkvBits<128 / G>* m2) {
    constexpr int SPT = 128 / G;
    constexpr int NW = SPT / 4;
    u32 w[NW];
    const u8* p = line + rank * SPT;
    if constexpr (SPT >= 16) {
        const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
        for (int j = 0; j < SPT / 16; ++j) {
            uint4 v = CG ? __ldcg(q + j) : __ldg(q + j);
            w[4 * j] = v.x;
            w[4 * j + 1] = v.y;
            w[4 * j + 2] = v.z;
            w[4 * j + 3] = v.w;
        }
    } else if constexpr (SPT == 8) {
        uint2 v = CG ? __ldcg(reinterpret_cast<const uint2*>(p)) : __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x;
        w[1] = v.y;
    } else {
        w[0] = CG ? __ldcg(reinterpret_cast<const u32*>(p)) : __ldg(reinterpret_cast<const u32*>(p));
    }
    u32 pat = 0x01010101u * d, pat2 = 0x01010101u * d2;
#pragma unroll
    for (int k = 0; k < HkvBits<SPT>::W; ++k) {
        m.w[k] = 0;
        if (m2) m2->w[k] = 0;
    }
#pragma unroll
    for (int j = 0; j < NW; ++j) {
        m.w[j / 16] |= (u64)hkv_cmp4(w[j], pat) << (4 * (j % 16));
        if (m2) m2->w[j / 16] |= (u64)hkv_cmp4(w[j], pat2) << (4 * (j % 16));
    }
}

// The lowest slot among the candidate bits m of bucket b that holds `key`,
// or -1 (every thread of the group gets the answer).
template <int G, bool CG>
__device__ __forceinline__ int hkv_scan(const HkvTable& t, const HkvGroup<G>& g, u64 b, u64 key,
                                        const HkvBits<128 / G>& m) {
    constexpr int SPT = 128 / G;
    int mine = -1;
#pragma unroll
    for (int k = 0; k < HkvBits<SPT>::W && mine < 0; ++k) {
        u64 x = m.w[k];
        while (x) {
            int s = g.rank * SPT + 64 * k + __ffsll(x) - 1;
            x &= x - 1;
            if (hkv_ld<CG>(t.keys + b * 128 + s) == key) {
                mine = s;
                break;
            }
        }
    }
    u32 who = g.ballot(mine >= 0);
    if (!who) return -1;
    return g.bcast(mine, __ffs(who) - 1);
}

// The slot of `key` in bucket b, or -1 (every thread gets the answer).
template <int G, bool CG>
__device__ __forceinline__ int hkv_find_in(const HkvTable& t, const HkvGroup<G>& g, u64 b, u64 key, u8 d) {
    HkvBits<128 / G> m;
    hkv_match<G, CG>(t.digests + b * 128, g.rank, d, m, 0, (HkvBits<128 / G>*)0);
    return hkv_scan<G, CG>(t, g, b, key, m);
}

// Writers (bucket locked): the slot of `key` in bucket b or -1, and the
// bucket's free-slot candidates (empty digest) into *free, from one read of
// the digest line.
template <int G>
__device__ __forceinline__ int hkv_find_write(const HkvTable& t, const HkvGroup<G>& g, u64 b, u64 key, u8 d,
                                              HkvBits<128 / G>* free) {
    HkvBits<128 / G> m;
    hkv_match<G, true>(t.digests + b * 128, g.rank, d, m, hkv_empty_digest(), free);
    return hkv_scan<G, true>(t, g, b, key, m);
}

// Lowest free slot of a bucket from its free-digest bits (no key has the
// free-slot digest, so they need no key read), or -1.
template <int G>
__device__ __forceinline__ int hkv_free_slot(const HkvGroup<G>& g, const HkvBits<128 / G>& free) {
    constexpr int SPT = 128 / G;
    int mine = -1;
#pragma unroll
    for (int k = HkvBits<SPT>::W - 1; k >= 0; --k)
        if (free.w[k]) mine = g.rank * SPT + 64 * k + __ffsll(free.w[k]) - 1;
    u32 who = g.ballot(mine >= 0);
    if (!who) return -1;
    return g.bcast(mine, __ffs(who) - 1);
}

// Minimum score of a full bucket and its slot (lowest slot on ties).
// The group reads the score array in passes of 16 * G contiguous bytes:
// in pass j thread r takes slots 2 * (G * j + r) and the one after it, so
// that the threads of a group together read whole 32-byte sectors (a
// thread reading only its own contiguous slots would fetch each sector from
// L2 twice, 16 bytes at a time). Each thread visits its slots in increasing
// order and keeps the first of equal scores; the reduction then prefers the
// lower slot.
template <int G>
__device__ __forceinline__ void hkv_min_slot(const HkvTable& t, const HkvGroup<G>& g, u64 b, int* slot, u64* score) {
    constexpr int SPT = 128 / G;
    static_assert(SPT >= 2, "a thread scans at least two slots");
    const u64* line = t.scores + b * 128;
    int bs = 2 * g.rank;
    u64 bv = 0xFFFFFFFFFFFFFFFFULL;
    // Every score line of the bucket in flight at once, spread over the group.
#pragma unroll
    for (int j = g.rank; j < 8; j += G) hkv_prefetch_l2(line + 16 * j);
    const ulonglong2* q = reinterpret_cast<const ulonglong2*>(line) + g.rank;
    // Loads in flight per thread: 16 pairs of scores, 8 from 4 threads per
    // key on (which copy wider rows and would otherwise need more than 64
    // registers, 3 blocks per SM instead of 4).
    constexpr int UNROLL = G >= 4 ? 8 : 16;
#pragma unroll UNROLL
    for (int j = 0; j < SPT / 2; ++j) {
        ulonglong2 v = __ldcg(q + G * j);
        int s = 2 * (G * j + (int)g.rank);
        if (v.x < bv) {
            bv = v.x;
            bs = s;
        }
        if (v.y < bv) {
            bv = v.y;
            bs = s + 1;
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

// Writer locks: a lock word per bucket, lower bucket index first. The
// group's first thread spins with an acquire CAS; the release store that
// unlocks publishes the group's writes (ordered before it by the group's
// __syncwarp).
__device__ __forceinline__ int hkv_cas_acquire(int* p) {
    int old;
    asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(p) : "memory");
    return old;
}

__device__ __forceinline__ int hkv_cas_relaxed(int* p) {
    int old;
    asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(p) : "memory");
    return old;
}

__device__ __forceinline__ void hkv_store_release(int* p) {
    asm volatile("st.release.gpu.global.b32 [%0], 0;" ::"l"(p) : "memory");
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

// Updaters: no key or digest changes while an updater batch runs (the
// updater group excludes inserters), so their slot lookup needs no lock.
// hkv_lock2_start issues the first attempt on the lower bucket's lock and
// returns without waiting for it, so that its round trip overlaps the
// lookup; hkv_lock2_wait completes the locking. Unlock with hkv_unlock2.
// The CAS is relaxed and no acquire fence follows it: under the lock an
// updater writes a row and a score and reads only a score and (accumulate)
// the row, both from L2 (ld.cg), the device's point of coherence; each of
// these accesses is issued after the CAS has returned (they depend on its
// result, and the asm's memory clobber keeps the compiler from moving
// them); the previous holder's writes were performed in L2 before its
// release store, which the CAS saw. So the holder reads and overwrites the
// latest values. The fence cost a gpu-scope round trip per key: assign ran
// 3-7 % faster at dim 64 without it (H200, shard/BENCHMARKS.md).
template <int G>
__device__ __forceinline__ int hkv_lock2_start(const HkvTable& t, const HkvGroup<G>& g, u64 b1, u64 b2) {
    return g.rank == 0 ? hkv_cas_relaxed(t.locks + (b1 < b2 ? b1 : b2)) : 0;
}

template <int G>
__device__ __forceinline__ void hkv_lock2_wait(const HkvTable& t, const HkvGroup<G>& g, u64 b1, u64 b2,
                                               int first) {
    if (g.rank == 0) {
        u64 lo = b1 < b2 ? b1 : b2, hi = b1 < b2 ? b2 : b1;
        for (int old = first; old != 0; old = hkv_cas_relaxed(t.locks + lo)) __nanosleep(32);
        if (hi != lo)
            while (hkv_cas_relaxed(t.locks + hi) != 0) __nanosleep(32);
    }
    g.sync();
}

// Starts fetching the lines of a dim-float row into L2 (the group's threads
// share the work), so that a copy under a bucket lock waits on L2 only.
template <int G>
__device__ __forceinline__ void hkv_prefetch_row(const HkvGroup<G>& g, const float* row, u32 dim) {
    if (!row) return;
    for (u32 off = g.rank * 32; off < dim; off += G * 32) hkv_prefetch_l2(row + off);
    if (g.rank == 0 && dim > 1) hkv_prefetch_l2(row + dim - 1);
}

// Starts fetching a bucket's digest line (and sizes word) into L2 while the
// lock is being taken.
__device__ __forceinline__ void hkv_prefetch_bucket(const HkvTable& t, u64 b) {
    hkv_prefetch_l2(t.digests + b * 128);
    hkv_prefetch_l2(t.sizes + b);
}

// ---- a writer's key, found under its buckets' locks ------------------------
// The prologue of every writer kernel (upsert_one, update_one, step_one):
// the key's candidate buckets located and both locked, and its slot found
// in them, b1 first. Unlock with hkv_unlock2 of the result's b1 and b2.
// Inserters (INSERTER): keys move under the inserter group, so the key is
// looked up only once the locks are held (ld.cg), and the free-slot
// candidates of each bucket searched come from the same read of its digest
// line, into *free1 and *free2 (free2 only when b2 was searched: the key
// is not in b1 and b2 != b1); the buckets' lines are prefetched while the
// locks are taken.
// Updaters (!INSERTER): no key moves under the updater group, so the
// lookup overlaps the lock's first attempt (hkv_lock2_start) and may take
// the read-only path; overlap(b, s) runs once the key is found and before
// the wait for the lock, for work that needs no lock (update_one's
// preload of a row into registers). free1 and free2 are not used (null).
// (The free bits are out-parameters rather than fields of HkvLocked: as
// fields they cost upsert_keys_g1 32 more bytes of stack, ptxas for sm_90.)
struct HkvLocked {
    u64 b1, b2;  // the candidate buckets, both locked (b2 == b1 when the key has one)
    u64 b;       // the bucket holding the key; when absent, the last one searched
    int s;       // the key's slot in b, or -1
    u8 d;        // the key's digest
};

struct HkvNoOverlap {
    __device__ __forceinline__ void operator()(u64, int) const {}
};

template <int G, bool INSERTER, class Overlap = HkvNoOverlap>
__device__ __forceinline__ HkvLocked hkv_find_locked(const HkvTable& t, const HkvGroup<G>& g, u64 key,
                                                     HkvBits<128 / G>* free1, HkvBits<128 / G>* free2,
                                                     Overlap overlap = Overlap()) {
    HkvLocked k;
    hkv_locate(t, key, &k.b1, &k.b2, &k.d);
    if constexpr (INSERTER) {
        if (g.rank == 0) {
            hkv_prefetch_bucket(t, k.b1);
            if (k.b2 != k.b1) hkv_prefetch_bucket(t, k.b2);
        }
        hkv_lock2(t, g, k.b1, k.b2);
        k.b = k.b1;
        k.s = hkv_find_write<G>(t, g, k.b1, key, k.d, free1);
        if (k.s < 0 && k.b2 != k.b1) {
            k.b = k.b2;
            k.s = hkv_find_write<G>(t, g, k.b2, key, k.d, free2);
        }
    } else {
        int first = hkv_lock2_start(t, g, k.b1, k.b2);
        k.b = k.b1;
        k.s = hkv_find_in<G, false>(t, g, k.b1, key, k.d);
        if (k.s < 0 && k.b2 != k.b1) {
            k.b = k.b2;
            k.s = hkv_find_in<G, false>(t, g, k.b2, key, k.d);
        }
        overlap(k.b, k.s);
        hkv_lock2_wait(t, g, k.b1, k.b2, first);
    }
    return k;
}

// ---- value rows, copied by the group ---------------------------------------

// Each thread loads up to four 16-byte pieces before storing them, so that
// a row in mapped host memory costs one round trip rather than one per piece.
template <int G, bool CG>
__device__ __forceinline__ void hkv_copy_row(float* __restrict__ dst, const float* __restrict__ src, u32 dim,
                                             u32 rank) {
    if ((dim & 3) == 0) {
        const float4* s = reinterpret_cast<const float4*>(src);
        float4* o = reinterpret_cast<float4*>(dst);
        u32 n4 = dim / 4;
        for (u32 base = rank; base < n4; base += 4 * G) {
            float4 r[4];
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (base + k * G < n4) r[k] = CG ? __ldcg(s + base + k * G) : __ldg(s + base + k * G);
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (base + k * G < n4) o[base + k * G] = r[k];
        }
    } else {
        for (u32 i = rank; i < dim; i += G) dst[i] = CG ? __ldcg(src + i) : __ldg(src + i);
    }
}

// The whole warp copies the rows of those of its groups that pass `want`
// (group-uniform): rows of n4 16-byte pieces (dim % 4 == 0), as many rows
// at a time as fit in 32 lanes, so that each row is read in whole lines.
// Every lane of the warp calls it. For rows in mapped host memory, where
// the size of each read decides the speed.
template <int G>
__device__ __forceinline__ void hkv_copy_rows_warp(const HkvGroup<G>& g, bool want, float* dst, const float* src,
                                                   u32 dim) {
    u32 lane = threadIdx.x & 31;
    u32 lead = __ballot_sync(0xffffffffu, want && g.rank == 0);
    if ((dim & 3) != 0) {
        while (lead) {
            int from = __ffs(lead) - 1;
            lead &= lead - 1;
            float* o = (float*)__shfl_sync(0xffffffffu, (u64)dst, from);
            const float* s = (const float*)__shfl_sync(0xffffffffu, (u64)src, from);
            for (u32 e = lane; e < dim; e += 32) o[e] = __ldg(s + e);
        }
        return;
    }
    u32 n4 = dim / 4;
    u32 per = n4 >= 32 ? 1 : 32 / n4;
    u32 r = n4 >= 32 ? 0 : lane / n4;
    u32 first = n4 >= 32 ? lane : lane % n4;
    u32 step = n4 >= 32 ? 32 : n4;
    while (lead) {
        u32 sel = 0;
        for (u32 k = 0; k < per && lead; ++k) {
            sel |= lead & (0u - lead);
            lead &= lead - 1;
        }
        bool mine = r < (u32)__popc(sel);
        u32 x = sel;
        for (u32 k = 0; k < r && x; ++k) x &= x - 1;
        int from = mine ? __ffs(x) - 1 : 0;
        float4* o = (float4*)__shfl_sync(0xffffffffu, (u64)dst, from);
        const float4* s = (const float4*)__shfl_sync(0xffffffffu, (u64)src, from);
        if (mine) {
            float4 v[4];
            for (u32 e = first; e < n4; e += 4 * step) {
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (e + k * step < n4) v[k] = __ldg(s + e + k * step);
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (e + k * step < n4) o[e + k * step] = v[k];
            }
        }
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

// ---- miss-ratio sampling -----------------------------------------------------
// The miss-ratio curves' sampling filter (shard/src/mrc.rs, issue 27), run
// by the lookup, upsert and update kernels on the keys they read anyway: no
// launch and no second read of the keys. Each key a kernel serves is
// counted as an access if the kernel serves a lookup; those with
// hkv_sample_hash(key, seed) < threshold are appended, with the batch's tag
// byte beside each, to the shard's ring (shard/src/cuda/table/sampling.rs): `cap`
// keys and two counters, counters[0] = keys appended (claimed slots) since
// the last drain, counters[1] = accesses since the last drain. A warp with
// sampled keys claims their slots with one atomicAdd on counters[0] and
// writes each key, in lane order from its base, only where its slot is
// below cap; the claims past cap are the dropped keys (counters[0] - cap).
// Accesses are summed per block in shared memory and added with one
// atomicAdd per block. The host drains the ring only while no batch of the
// table runs, reads counters[0] and slots [0, min(counters[0], cap)), and
// zeroes both counters, so the slots restart at 0: no tail, no wrap-around.
// A batch's keys come back a warp at a time, in the order the warps ran.

// A launch's sampler is an HkvSample (abi.h); ring null: sampling off.

// Declares and zeroes the block's access count; a __syncthreads must follow
// before hkv_sample_warp (HKV_COUNTERS_INIT's).
#define HKV_SAMPLE_INIT            \
    __shared__ u32 hkv_seen;       \
    if (threadIdx.x == 0) hkv_seen = 0;

// Every thread of the warp calls it, converged, with sampling on (smp.ring
// non-null); `live`: this thread stands for key `key` (one thread per key)
// and the key is served. Counts the warp's live keys into *seen and appends
// its sampled ones (hkv_sample_hash(key, seed) < threshold) to the ring,
// writing only slots below cap, each with the batch's tag and `outcome`'s
// bits (a lookup's answer: HKV_TAG_OUTCOME_KNOWN, HKV_TAG_OUTCOME_HIT; 0
// from the writer kernels).
__device__ __forceinline__ void hkv_sample_warp(const HkvSample& smp, bool live, u64 key, u32* seen,
                                                u32 outcome = 0) {
    u32 lane = threadIdx.x & 31;
    bool take = live && hkv_sample_hash(key, smp.seed) < smp.threshold;
    u32 taken = __ballot_sync(0xffffffffu, take);
    u32 lives = __ballot_sync(0xffffffffu, live);
    if (lane == 0 && lives) atomicAdd(seen, (u32)__popc(lives));
    if (!taken) return;
    int first = __ffs(taken) - 1;
    u64 base = 0;
    if ((int)lane == first) base = atomicAdd(smp.counters, (u64)__popc(taken));
    base = __shfl_sync(0xffffffffu, base, first);
    if (take) {
        u64 slot = base + (u64)__popc(taken & ((1u << lane) - 1));
        if (slot < smp.cap) {
            smp.ring[slot] = key;
            smp.tags[slot] = (u8)(smp.tag | outcome);
        }
    }
}

// Adds the block's accesses to the ring's counter (every thread of the block
// calls it, after a __syncthreads that follows the last hkv_sample_warp:
// hkv_flush_counters').
// Only lookups (tag kinds HKV_TAG_LOOKUP and HKV_TAG_FIND_OR_INSERT: find,
// contains, find_or_insert) are accesses, the references the table's hit
// rate counts; writes are sampled (tagged) but not counted (issue 32).
__device__ __forceinline__ void hkv_flush_sample(const HkvSample& smp, const u32* seen) {
    if (smp.ring && (smp.tag & 3) <= HKV_TAG_FIND_OR_INSERT && threadIdx.x == 0 && *seen)
        atomicAdd(smp.counters + 1, (u64)*seen);
}

// ---- adaptive policy ---------------------------------------------------------
// shard/src/cpu/adapt.rs rule for rule (its module docs say why): a
// window-TinyLFU in each bucket with a segmented main tier, the window's
// share one for the table, chosen between batches on the host and passed in
// HkvScoring::window. The sketch is in HkvScoring (null: not adaptive).
// Choices equal the CPU backend's key for key: the sketch only grows by
// increments whose order does not matter (adapt_count, before a writer
// batch's rounds; adapt_fold, the find hits of the entries it evicted,
// after them), a find hit counts in its entry's score (bits 0-3, by CAS),
// the share is fixed for the batch, and a bucket's scores change only under
// its lock or by a find's CAS outside writer batches. A window candidate
// and its victim compare estimates: sketch plus hits (hkv_estimate).
// Memory traffic of a newcomer to full candidates: the group reads 128
// digests and scores of each candidate to choose the bucket, of the chosen
// one again, and once more per window entry moved by a shrink (only after
// the share fell) and per protected entry demoted (about one per insert
// once the main tier is 80 % protected); the two keys the frequency test
// reads; one score written per change. Mostly L2 hits after the first read.

// A key's 4 sketch counters: 4-bit counters in one 64-bit word (16 of
// them), the counter of row r one of the 4 nibbles of the word's quarter r
// (adapt::sketch_slot): returns the word's index, and in sh each counter's
// bit shift in it.
__device__ __forceinline__ u64 hkv_sketch_word(u64 key, u64 lines, u32* sh) {
    u64 h = hkv_fmix64(key ^ 0x9e3779b97f4a7c15ULL);
#pragma unroll
    for (int r = 0; r < 4; ++r) sh[r] = (u32)(r * 4 + ((h >> (2 * r)) & 3)) * 4;
    return (h >> 16) & (lines * 8 - 1);
}

// The least of the 4 counters of the sketch word w (shifts sh): the
// sketch's estimate of a key's recent accesses (0..15).
__device__ __forceinline__ u32 hkv_sketch_min(u64 w, const u32* sh) {
    u32 f = 15;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        u32 c = (u32)(w >> sh[r]) & 15;
        f = c < f ? c : f;
    }
    return f;
}

// The sketch's estimate of key's recent accesses (0..15).
__device__ __forceinline__ u32 hkv_frequency(const HkvScoring& s, u64 key) {
    u32 sh[4];
    u64 i = hkv_sketch_word(key, s.sketch_lines, sh);
    return hkv_sketch_min(__ldcg(reinterpret_cast<const u64*>(s.sketch) + i), sh);
}

// The estimate the window rule compares for a resident key of score
// `score` (Adapt::estimate): the sketch's count plus the find hits its
// score counted, at most 15.
__device__ __forceinline__ u32 hkv_estimate(const HkvScoring& s, u64 key, u64 score) {
    u32 f = hkv_frequency(s, key) + (u32)(score & HKV_ADAPTIVE_HITS);
    return f < 15 ? f : 15;
}

// Adaptive, a writer batch with policy scores: the entry at pos is about
// to be evicted; the find hits its score counted go to sc.folds (when
// given) for adapt_fold after the batch (Adapt::evicted). The batch's
// folds have room for one per key.
__device__ __forceinline__ void hkv_adapt_evicted(const HkvScoring& sc, const HkvTable& t, u64 pos) {
    if (!sc.folds) return;
    u64 hits = __ldcg(t.scores + pos) & HKV_ADAPTIVE_HITS;
    if (!hits) return;
    u64 j = atomicAdd(reinterpret_cast<unsigned long long*>(sc.folds), 1ULL);
    sc.folds[1 + 2 * j] = __ldcg(t.keys + pos);
    sc.folds[2 + 2 * j] = hits;
}

// One access counted in sketch word p, read as old (shifts sh): each of
// the key's counters one more, saturating at 15 (Adapt::count); one
// compare-and-swap of the word (again only when another access changed it
// first). A counter at 15 is never added to, so nothing carries into its
// neighbour.
__device__ __forceinline__ void hkv_sketch_add(unsigned long long* p, u64 old, const u32* sh) {
    for (;;) {
        u64 inc = 0;
#pragma unroll
        for (int r = 0; r < 4; ++r) inc |= (((old >> sh[r]) & 15) < 15 ? 1ULL : 0ULL) << sh[r];
        if (!inc) return;
        u64 seen = atomicCAS(p, old, old + inc);
        if (seen == old) return;
        old = seen;
    }
}

// One access of key in the sketch: a read of its word, then its CAS.
__device__ __forceinline__ void hkv_sketch_count(const HkvScoring& s, u64 key) {
    u32 sh[4];
    u64 i = hkv_sketch_word(key, s.sketch_lines, sh);
    unsigned long long* p = reinterpret_cast<unsigned long long*>(s.sketch) + i;
    hkv_sketch_add(p, __ldcg(reinterpret_cast<const u64*>(p)), sh);
}

// How the adaptive paths of the writer kernels below are compiled was
// measured (H200, 1 Mi-key batches, shard/BENCHMARKS.md): a fill inlined
// everywhere; the room path inlined in the kernel held to 48 registers
// (upsert_keys_g4_b5, where a call spills around it) and a call elsewhere.

// A bucket's tiers: window entries and protected entries among its occupied
// slots, and the oldest entry (minimum score, lowest slot on ties) of the
// window, the main tier and its protected part (adapt::plan's `oldest`);
// slot -1: none. Every thread of the group gets the answer.
struct HkvTiers {
    int window, occupied, prot;
    int ow, om, op;
    u64 ows, oms, ops;
};

__device__ __forceinline__ void hkv_tiers_min(u64* v, int* o, u64 v2, int o2) {
    if (o2 >= 0 && (*o < 0 || v2 < *v || (v2 == *v && o2 < *o))) {
        *v = v2;
        *o = o2;
    }
}

// Each thread of the group reads its own 128 / G contiguous slots, the 4
// slots' scores at once, so that the loads of a scan are independent and
// few (a scan runs with the bucket locked: its length is what other keys of
// the bucket wait for). The minima take the lowest slot on ties whatever
// the order of visits.
// The buckets scanned are full (the writers' room path, whose candidates
// have no free slot): every slot holds an entry, so no digest is read.
template <int G>
__device__ __forceinline__ HkvTiers hkv_tiers(const HkvTable& t, const HkvGroup<G>& g, u64 b) {
    const u64 none = 0xFFFFFFFFFFFFFFFFULL;
    HkvTiers r = {0, 0, 0, -1, -1, -1, none, none, none};
    constexpr int P = 128 / G;
    const int first = (int)g.rank * P;
    const u64* sp = t.scores + b * 128 + first;
#pragma unroll 2
    for (int c = 0; c < P; c += 4) {
        u64 sc4[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) sc4[k] = __ldcg(sp + c + k);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u64 sc = sc4[k];
            int s = first + c + k;
            ++r.occupied;
            if (sc & HKV_ADAPTIVE_MAIN) {
                hkv_tiers_min(&r.oms, &r.om, sc, s);
                if (sc & HKV_ADAPTIVE_PROTECTED) {
                    ++r.prot;
                    hkv_tiers_min(&r.ops, &r.op, sc, s);
                }
            } else {
                ++r.window;
                hkv_tiers_min(&r.ows, &r.ow, sc, s);
            }
        }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) {
        r.window += __shfl_xor_sync(g.mask, r.window, off, G);
        r.occupied += __shfl_xor_sync(g.mask, r.occupied, off, G);
        r.prot += __shfl_xor_sync(g.mask, r.prot, off, G);
        u64 v = __shfl_xor_sync(g.mask, r.ows, off, G);
        int o = __shfl_xor_sync(g.mask, r.ow, off, G);
        hkv_tiers_min(&r.ows, &r.ow, v, o);
        v = __shfl_xor_sync(g.mask, r.oms, off, G);
        o = __shfl_xor_sync(g.mask, r.om, off, G);
        hkv_tiers_min(&r.oms, &r.om, v, o);
        v = __shfl_xor_sync(g.mask, r.ops, off, G);
        o = __shfl_xor_sync(g.mask, r.op, off, G);
        hkv_tiers_min(&r.ops, &r.op, v, o);
    }
    return r;
}

// Bucket b (locked), whose tiers are r, before a newcomer: while the window
// holds more than `bound` entries, its oldest moves to the main tier
// (unprotected). Returns the tiers after when `after`; else only the
// window count is kept up to date (the last move needs no rescan). A
// rescan per further move: the share moves between batches only.
template <int G>
__device__ __forceinline__ HkvTiers hkv_adapt_shrink(const HkvTable& t, const HkvScoring& s, const HkvGroup<G>& g,
                                                     u64 b, int bound, HkvTiers r, bool after) {
    while (r.window > bound && r.ow >= 0) {
        if (g.rank == 0) {
            t.scores[b * 128 + r.ow] = r.ows | HKV_ADAPTIVE_MAIN;
            hkv_window_mark(s, b * 128 + r.ow, false);
        }
        g.sync();
        if (!after && r.window - 1 <= bound) {
            --r.window;
            break;
        }
        r = hkv_tiers<G>(t, g, b);
    }
    return r;
}

// Filling bucket b (locked): a newcomer takes free slot fs. The window is
// kept under its share, its oldest entries moving to the main tier. The
// window's slots come from the bucket's window bits, each checked against
// its digest and score (a bit whose slot was emptied or holds a main-tier
// entry is stale: cleared here), so that only the window's scores are read,
// not the bucket's 128. Each thread of the group takes the bits of its own
// 128 / G slots.
template <int G>
__device__ __forceinline__ void hkv_adapt_fill(const HkvTable& t, const HkvScoring& s, const HkvGroup<G>& g, u64 b,
                                            int fs) {
    constexpr int P = 128 / G;
    const int first = (int)g.rank * P;
    u32* bits = hkv_window_bits(s) + b * 4;
    const int bound = (int)s.window - 1;
    // Without reading a score: no more bits than the bound (the window,
    // at most as many entries, stays), or one bit where the bound is none
    // (at most that entry, which moves to the main tier: setting the main
    // bit of a stale bit's slot changes nothing, an emptied slot's score
    // being ignored until a write replaces it).
    {
        u32 w[4];
        // (The newcomer's free slot is not the window's, whatever its bit.)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = __ldcg(bits + k) & (k == fs >> 5 ? ~(1u << (fs & 31)) : ~0u);
        const int n = __popc(w[0]) + __popc(w[1]) + __popc(w[2]) + __popc(w[3]);
        if (n <= bound || (n == 1 && bound == 0)) {
            if (g.rank == 0) {
                if (n > bound) {
                    const int k = w[0] ? 0 : w[1] ? 1 : w[2] ? 2 : 3;
                    const int o = 32 * k + __ffs(w[k]) - 1;
                    atomicOr(reinterpret_cast<unsigned long long*>(t.scores + b * 128 + o), HKV_ADAPTIVE_MAIN);
                    atomicAnd(bits + k, ~(1u << (o & 31)));
                }
                atomicOr(bits + (fs >> 5), 1u << (fs & 31));
            }
            g.sync();
            return;
        }
    }
    const u64* sp = t.scores + b * 128;
    const u8* dp = t.digests + b * 128;
    const u32 empty = hkv_empty_digest();
    u32 mine[4];
    int window = 0;
    u64 ows = 0xFFFFFFFFFFFFFFFFULL;
    int ow = -1;
    // This thread's slots, 4 scores and 4 digests a load where any of the
    // 4 has its bit (independent loads, as hkv_tiers: the bucket is locked
    // while they are waited for; a loop over the set bits, a score and a
    // digest load each, waited for them one by one), each set bit's slot
    // checked (shard/BENCHMARKS.md, "Adaptive fills: the window's scan").
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int lo = first > 32 * k ? first - 32 * k : 0;
        const int hi = first + P < 32 * (k + 1) ? first + P - 32 * k : 32;
        mine[k] = 0;
        if (lo >= hi) continue;
        const u32 range = (hi - lo == 32 ? 0xFFFFFFFFu : ((1u << (hi - lo)) - 1)) << lo;
        u32 m = __ldcg(bits + k) & range, stale = 0;
#pragma unroll 1
        for (int c = lo; c < hi; c += 4) {
            const u32 m4 = (m >> c) & 15u;
            if (!m4) continue;
            const int s0 = 32 * k + c;
            u64 sc4[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) sc4[j] = __ldcg(sp + s0 + j);
            const u32 d4 = __ldcg(reinterpret_cast<const u32*>(dp + s0));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (!(m4 >> j & 1)) continue;
                const int slot = s0 + j;
                if (slot == fs) {
                    // The newcomer's free slot: its bit stays (set below).
                    m &= ~(1u << (slot & 31));
                } else if (((d4 >> (8 * j)) & 0xFF) == empty || (sc4[j] & HKV_ADAPTIVE_MAIN)) {
                    stale |= 1u << (slot & 31);
                } else {
                    hkv_tiers_min(&ows, &ow, sc4[j], slot);
                }
            }
        }
        if (stale) atomicAnd(bits + k, ~stale);
        mine[k] = m & ~stale;
        window += __popc(mine[k]);
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) {
        window += __shfl_xor_sync(g.mask, window, off, G);
        u64 v = __shfl_xor_sync(g.mask, ows, off, G);
        int o = __shfl_xor_sync(g.mask, ow, off, G);
        hkv_tiers_min(&ows, &ow, v, o);
    }
    while (window > bound && ow >= 0) {
        if (g.rank == 0) {
            t.scores[b * 128 + ow] = ows | HKV_ADAPTIVE_MAIN;
            atomicAnd(bits + (ow >> 5), ~(1u << (ow & 31)));
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (k == ow >> 5) mine[k] &= ~(1u << (ow & 31));
        if (--window <= bound) break;
        // A further move (the share fell since the last batch): the oldest
        // of the window's remaining slots.
        ows = 0xFFFFFFFFFFFFFFFFULL;
        ow = -1;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            for (u32 x = mine[k]; x; x &= x - 1) {
                const int slot = 32 * k + __ffs(x) - 1;
                hkv_tiers_min(&ows, &ow, __ldcg(sp + slot), slot);
            }
#pragma unroll
        for (int off = G / 2; off > 0; off >>= 1) {
            u64 v = __shfl_xor_sync(g.mask, ows, off, G);
            int o = __shfl_xor_sync(g.mask, ow, off, G);
            hkv_tiers_min(&ows, &ow, v, o);
        }
    }
    // The newcomer is a window entry.
    if (g.rank == 0) atomicOr(bits + (fs >> 5), 1u << (fs & 31));
    g.sync();
}

// Full candidates b1, b2 (locked): the bucket with the older minimum (b1 on
// ties), then its window rule (adapt::plan): the window shrinks to its
// share, the oldest protected entries lose protection while more than 80 %
// of the main tier is protected, then into *b and *slot the slot to evict
// (a candidate that wins moves to the main tier, unprotected). The scan
// that chose the bucket serves the rule; a single demotion (the steady
// state) updates the tiers without a rescan.
template <int G>
__device__ __forceinline__ void hkv_adapt_room_in(const HkvTable& t, const HkvScoring& s, const HkvGroup<G>& g,
                                                  u64 b1, u64 b2, u64* b, int* slot) {
    HkvTiers r = hkv_tiers<G>(t, g, b1);
    *b = b1;
    if (b2 != b1) {
        HkvTiers r2 = hkv_tiers<G>(t, g, b2);
        u64 m1 = r.ow >= 0 ? r.ows : r.oms, m2 = r2.ow >= 0 ? r2.ows : r2.oms;
        if (m2 < m1) {
            *b = b2;
            r = r2;
        }
    }
    u64 base = *b * 128;
    int win = (int)s.window;
    r = hkv_adapt_shrink<G>(t, s, g, *b, win, r, true);
    while (r.prot * 10 > HKV_ADAPT_PROTECTED_TENTHS * (r.occupied - r.window) && r.op >= 0) {
        u64 demoted = r.ops & ~HKV_ADAPTIVE_PROTECTED;
        if (g.rank == 0) t.scores[base + r.op] = demoted;
        g.sync();
        if ((r.prot - 1) * 10 > HKV_ADAPT_PROTECTED_TENTHS * (r.occupied - r.window)) {
            r = hkv_tiers<G>(t, g, *b);
            continue;
        }
        // The last demotion: the main tier's minimum may now be this entry.
        --r.prot;
        hkv_tiers_min(&r.oms, &r.om, demoted, r.op);
        break;
    }
    int victim = 0;
    if (g.rank == 0) {
        if (r.ow >= 0 && r.om >= 0 && r.window >= win) {
            if (hkv_estimate(s, __ldcg(t.keys + base + r.ow), r.ows) >
                hkv_estimate(s, __ldcg(t.keys + base + r.om), r.oms) + HKV_ADAPT_ADMIT_MARGIN) {
                t.scores[base + r.ow] = r.ows | HKV_ADAPTIVE_MAIN;
                hkv_window_mark(s, base + r.ow, false);
                victim = r.om;
            } else {
                victim = r.ow;
            }
        } else if (r.om >= 0) {
            victim = r.om;
        } else {
            victim = r.ow;
        }
    }
    // The newcomer, a window entry, takes the victim's slot.
    if (g.rank == 0) hkv_window_mark(s, base + victim, true);
    *slot = g.bcast(victim, 0);
}

// hkv_adapt_room as a call, for the writer kernels without a register
// bound (inlined, it cost find_or_insert at λ 1.0 9 % on the H200).
template <int G>
__device__ __noinline__ void hkv_adapt_room(const HkvTable& t, const HkvScoring& s, const HkvGroup<G>& g, u64 b1,
                                               u64 b2, u64* b, int* slot) {
    hkv_adapt_room_in<G>(t, s, g, b1, b2, b, slot);
}
