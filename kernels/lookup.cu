// lookup family: find, contains and find* (value addresses). Reader group:
// no writer runs meanwhile, so no lock is taken. Thread mapping: G = 1, 2,
// 4, 8, 16 or 32 threads per key (each loads 128 / G digest bytes), 256 / G keys per
// 256-thread block; the host picks G per batch (Funcs in shard/src/cuda/table/kernels.rs).
// Memory traffic per key: the key, one digest line (two in dual mode), ~1 key
// read per digest match, and on a hit the value row read and written.
// The lookup_at kernels (AT, for find_at) write key i's row at row at[i] of
// the output instead, a miss as a row of zeros (flags stay at index i). The
// output may be a daemon's response frame in page-locked host memory, whose
// rows are aligned to 4 bytes only and cross PCIe as the device writes them:
// the warp writes its keys' rows one after the other, all 32 lanes 4 bytes
// each, so that each row goes in whole-row writes (a group's own stores
// would send 4 × G bytes at a time).

// The score a refreshing find reports for a hit whose score became `now`
// (Scorer::read_answer): adaptive leaves out the hit count (bits 0-3), whose
// value at a given key of a batch that holds the key more than once
// depends on the order its hits ran in.
__device__ __forceinline__ u64 hkv_read_answer(const HkvScoring& rs, u64 now) {
    return rs.policy == HKV_ADAPTIVE ? now & ~HKV_ADAPTIVE_HITS : now;
}

// A find hit in a table whose reads refresh (rs.refresh): its score
// becomes hkv_on_read of it, by CAS (hits of one key in a batch compose;
// adaptive counts the hit in the score, not in the sketch, so that a hit
// touches nothing but its entry); the score it reports goes to scores[i]
// (when given). The group's
// first thread, in the refreshing kernels only (lookup_findr,
// lookup_findzr): the others do not contain it. `old` is the score as read
// earlier (lookup_one), beside the row's copy instead of after it (a stale
// value only costs the CAS one retry).
__device__ __forceinline__ void hkv_refresh_hit(const HkvTable& t, const HkvScoring& rs, u64 pos, u64 old,
                                                u64* scores, u64 i) {
    unsigned long long* p = reinterpret_cast<unsigned long long*>(t.scores + pos);
    u64 nw = hkv_on_read(rs, old);
    while (nw != old) {
        u64 seen = atomicCAS(p, old, nw);
        if (seen == old) break;
        old = seen;
        nw = hkv_on_read(rs, old);
    }
    if (scores) scores[i] = hkv_read_answer(rs, nw);
}

// rs: the refresh of find hits (REFRESH kernels only; null or rs->refresh 0:
// none; find_at does not refresh, as on the CPU backend).
template <int G, bool AT, bool ZERO = false, bool REFRESH = false>
__device__ __forceinline__ void lookup_one(const HkvTable& t, const u64* keys, u64 n, float* values, u8* found,
                                           u64* scores, u64* ptrs, u64* cnt, const u8* only, const u32* at,
                                           const HkvSample& smp, u32* seen, const HkvScoring* rs) {
    HkvGroup<G> g;
    u64 i = hkv_key_index(t, ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G, n);
    bool active = i < n && !(only && !only[i]);
    u64 pos = 0;
    bool hit = false;
    u64 o = AT && active && at ? at[i] : i;
    u64 key = active ? keys[i] : 0;
    // A refreshing find reads the hit's score once its slot is known,
    // beside the row's copy (hkv_refresh_hit).
    const bool refresh = REFRESH && rs && rs->refresh && active && g.rank == 0;
    u64 sc_old = 0;
    if (active) {
        u64 b1, b2;
        u8 d;
        hkv_locate(t, key, &b1, &b2, &d);
        u64 b = b1;
        int s = hkv_find_in<G, false>(t, g, b1, key, d);
        if (s < 0 && b2 != b1) {
            b = b2;
            s = hkv_find_in<G, false>(t, g, b2, key, d);
        }
        hit = s >= 0;
        pos = b * 128 + s;
        if (g.rank == 0) {
            if (found) found[i] = hit;
            if (refresh && hit) {
                sc_old = __ldcg(t.scores + pos);
            } else if (hit && scores) {
                scores[i] = __ldg(t.scores + pos);
            }
            if (ptrs) ptrs[i] = hit ? (u64)hkv_row(t, pos) : 0;
            if (hit) atomicAdd(cnt + HKV_C_HITS, 1ULL);
        }
    }
    // The miss-ratio sampling filter, fused (the whole warp is here again),
    // each sampled key tagged with the table's answer (mrc::with_outcome).
    if (smp.ring)
        hkv_sample_warp(smp, active && g.rank == 0, key, seen,
                        HKV_TAG_OUTCOME_KNOWN | (hit ? HKV_TAG_OUTCOME_HIT : 0u));
    if (!values) {
        if (refresh && hit) hkv_refresh_hit(t, *rs, pos, sc_old, scores, i);
        return;
    }
    // find_at: the warp writes every row of its keys, one after the other.
    if (AT) {
        u32 lane = threadIdx.x & 31;
        u32 lead = __ballot_sync(0xffffffffu, active && g.rank == 0);
        float* dst = active ? values + o * t.dim : 0;
        const float* src = hit ? hkv_row(t, pos) : 0;
        while (lead) {
            int from = __ffs(lead) - 1;
            lead &= lead - 1;
            float* d = (float*)__shfl_sync(0xffffffffu, (u64)dst, from);
            const float* s = (const float*)__shfl_sync(0xffffffffu, (u64)src, from);
            for (u32 e = lane; e < t.dim; e += 32) d[e] = s ? __ldg(s + e) : 0.0f;
        }
        return;
    }
    // Rows in device memory: each group copies its own. Rows in host memory
    // (warp-uniform test: the table has a host tier): the warp copies them
    // together, in whole lines.
    bool host = hit && pos >= t.fast_slots;
    if (hit && !host) hkv_copy_row<G, false>(values + i * t.dim, hkv_row(t, pos), t.dim, g.rank);
    // ZERO (lookup_findz): a miss's row as zeros, each group its own.
    if (ZERO && active && !hit)
        for (u32 e = g.rank; e < t.dim; e += G) values[i * t.dim + e] = 0.0f;
    if (t.fast_slots < t.nbuckets * 128) {
        float* dst = host ? values + i * t.dim : 0;
        const float* src = host ? hkv_row(t, pos) : 0;
        hkv_copy_rows_warp<G>(g, host, dst, src, t.dim);
    }
    // The refresh after the copy's loads and stores went out.
    if (refresh && hit) hkv_refresh_hit(t, *rs, pos, sc_old, scores, i);
}

#define HKV_LOOKUP_KERNEL_T(NAME, G, Z, R)                                                                      \
    extern "C" __global__ void NAME(HkvTable t, const u64* keys, u64 n, float* values, u8* found, u64* scores,     \
                                    u64* ptrs, u64* counters, const u8* only, HkvSample smp, HkvScoring rs) {      \
        HKV_SAMPLE_INIT                                                                                            \
        HKV_COUNTERS_INIT                                                                                          \
        lookup_one<G, false, Z, R>(t, keys, n, values, found, scores, ptrs, hkv_cnt, only, 0, smp, &hkv_seen, &rs); \
        hkv_flush_counters(hkv_cnt, counters);                                                                     \
        hkv_flush_sample(smp, &hkv_seen);                                                                          \
    }
#define HKV_LOOKUP_KERNEL(NAME, G) HKV_LOOKUP_KERNEL_T(NAME, G, false, false)
#define HKV_LOOKUPZ_KERNEL(NAME, G) HKV_LOOKUP_KERNEL_T(NAME, G, true, false)
#define HKV_LOOKUPR_KERNEL(NAME, G) HKV_LOOKUP_KERNEL_T(NAME, G, false, true)
#define HKV_LOOKUPZR_KERNEL(NAME, G) HKV_LOOKUP_KERNEL_T(NAME, G, true, true)

#define HKV_LOOKUP_AT_KERNEL(NAME, G)                                                                           \
    extern "C" __global__ void NAME(HkvTable t, const u64* keys, u64 n, const u32* at, float* values, u8* found,   \
                                    u64* counters, const u8* only, HkvSample smp) {                                \
        HKV_SAMPLE_INIT                                                                                            \
        HKV_COUNTERS_INIT                                                                                          \
        lookup_one<G, true>(t, keys, n, values, found, 0, 0, hkv_cnt, only, at, smp, &hkv_seen, 0);               \
        hkv_flush_counters(hkv_cnt, counters);                                                                     \
        hkv_flush_sample(smp, &hkv_seen);                                                                          \
    }

// smp: the miss-ratio sampler (table.cuh; ring null: off), which samples
// the keys looked up; rs.refresh: hits refresh their scores (reads_refresh,
// hkv_refresh_hit). values / found / scores / ptrs may each be null. Misses leave values
// untouched. With only (may be null), key i is looked up only where
// only[i] != 0: nothing of the others is written. lookup_find: 8 threads per key; lookup_find_gN: N.
HKV_LOOKUP_KERNEL(lookup_find, 8)
HKV_LOOKUP_KERNEL(lookup_find_g1, 1)
HKV_LOOKUP_KERNEL(lookup_find_g2, 2)
HKV_LOOKUP_KERNEL(lookup_find_g4, 4)
HKV_LOOKUP_KERNEL(lookup_find_g16, 16)
HKV_LOOKUP_KERNEL(lookup_find_g32, 32)

// lookup_findz: as lookup_find, a miss's row written as zeros (where only
// lets the key through): a client's device arrays (hkvd), answered as the
// socket answers.
HKV_LOOKUPZ_KERNEL(lookup_findz, 8)
HKV_LOOKUPZ_KERNEL(lookup_findz_g1, 1)
HKV_LOOKUPZ_KERNEL(lookup_findz_g2, 2)
HKV_LOOKUPZ_KERNEL(lookup_findz_g4, 4)
HKV_LOOKUPZ_KERNEL(lookup_findz_g16, 16)
HKV_LOOKUPZ_KERNEL(lookup_findz_g32, 32)

// lookup_findr, lookup_findzr: lookup_find and lookup_findz of a table
// whose reads refresh (rs.refresh), the only ones that contain the refresh
// of a hit (hkv_refresh_hit).
HKV_LOOKUPR_KERNEL(lookup_findr, 8)
HKV_LOOKUPR_KERNEL(lookup_findr_g1, 1)
HKV_LOOKUPR_KERNEL(lookup_findr_g2, 2)
HKV_LOOKUPR_KERNEL(lookup_findr_g4, 4)
HKV_LOOKUPR_KERNEL(lookup_findr_g16, 16)
HKV_LOOKUPR_KERNEL(lookup_findr_g32, 32)
HKV_LOOKUPZR_KERNEL(lookup_findzr, 8)
HKV_LOOKUPZR_KERNEL(lookup_findzr_g1, 1)
HKV_LOOKUPZR_KERNEL(lookup_findzr_g2, 2)
HKV_LOOKUPZR_KERNEL(lookup_findzr_g4, 4)
HKV_LOOKUPZR_KERNEL(lookup_findzr_g16, 16)
HKV_LOOKUPZR_KERNEL(lookup_findzr_g32, 32)

// find_at: key i's flag into found[i], its row into row at[i] of values
// (4-byte aligned; at null: row i), a miss as zeros; with only (may be
// null), nothing of key i is written where only[i] == 0. lookup_at: 8
// threads per key; lookup_at_gN: N.
HKV_LOOKUP_AT_KERNEL(lookup_at, 8)
HKV_LOOKUP_AT_KERNEL(lookup_at_g1, 1)
HKV_LOOKUP_AT_KERNEL(lookup_at_g2, 2)
HKV_LOOKUP_AT_KERNEL(lookup_at_g4, 4)
HKV_LOOKUP_AT_KERNEL(lookup_at_g16, 16)
HKV_LOOKUP_AT_KERNEL(lookup_at_g32, 32)

// ---- key order for tables with a host tier -----------------------------------
// The device reaches rows in mapped host memory about three times faster
// when the rows in flight at one time lie within some hundred MiB of each
// other than when they are spread over the whole tier (page translation).
// Writer and lookup launches that copy values of such a table therefore
// serve their keys in the order of their first bucket's region (1 << shift
// buckets): order_count counts the keys per region, export_scan turns the
// counts into offsets, order_write places each key's index at its region's
// next offset (order within a region unspecified). One thread per key.

// keys_reserved: whether keys[0..n] hold a reserved marker (>= 2^64 - 4,
// refused as input): *out = n - (the lowest such index), left 0 when none
// (zeroed by the caller). One thread per key.
extern "C" __global__ void keys_reserved(const u64* keys, u64 n, u64* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (keys[i] >= 0xFFFFFFFFFFFFFFFCULL) atomicMax(out, n - i);
}

// keys_gate: after keys_reserved, the batch's key filter: only[i] = 1 when
// no key of the batch is reserved (*found, keys_reserved's output, 0), else
// 0, so that a write refused for a reserved key changes nothing without the
// host waiting for the scan first. One thread per key.
extern "C" __global__ void keys_gate(const u64* found, u64 n, u8* only) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    only[i] = __ldcg(found) == 0;
}

extern "C" __global__ void order_count(HkvTable t, const u64* keys, u64 n, u32 shift, u32* counts) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(counts + (hkv_bucket1(t, hkv_fmix64(keys[i])) >> shift), 1u);
}

extern "C" __global__ void order_write(HkvTable t, const u64* keys, u64 n, u32 shift, u64* next, u32* order) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 region = hkv_bucket1(t, hkv_fmix64(keys[i])) >> shift;
    order[atomicAdd(next + region, 1ULL)] = (u32)i;
}
