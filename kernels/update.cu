// update family: assign, assign_scores and the accumulate phase of
// accum_or_assign, on present keys only. Updater group: batches of this
// family may run together, so a key's buckets are locked around its score
// and row writes; no key moves meanwhile, so the slot is looked up without
// the lock (update_keys*).
// Thread mapping: G = 1, 2, 4, 8, 16 or 32 threads per key, picked by the host.

#define HKV_UPD_ASSIGN 0
#define HKV_UPD_SCORES 1
#define HKV_UPD_ACCUM 2

template <int G>
__device__ __forceinline__ void update_one(const HkvTable& t, const HkvScoring& sc, const u64* keys, u64 n,
                                           const float* values, const u64* scores_in, const u8* only, int mode,
                                           u8* outcomes, u8* absent, u64* cnt) {
    HkvGroup<G> g;
    u64 i = hkv_key_index(t, ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G, n);
    if (i >= n || (only && !only[i])) return;
    u64 key = keys[i];
    u64 b1, b2;
    u8 d;
    hkv_locate(t, key, &b1, &b2, &d);
    bool has = scores_in != 0;
    u64 in = has ? scores_in[i] : 0;
    if (values) hkv_prefetch_row<G>(g, values + i * t.dim, t.dim);
    // The lock's first attempt overlaps the lookup (keys are stable under
    // the updater group, see hkv_lock2_start).
    int first = hkv_lock2_start(t, g, b1, b2);
    u64 b = b1;
    int s = hkv_find_in<G, false>(t, g, b1, key, d);
    if (s < 0 && b2 != b1) {
        b = b2;
        s = hkv_find_in<G, false>(t, g, b2, key, d);
    }
    hkv_lock2_wait(t, g, b1, b2, first);
    if (s >= 0) {
        u64 pos = b * 128 + s;
        float* row = hkv_row(t, pos);
        u64 old = __ldcg(t.scores + pos);
        u64 ns;
        if (mode == HKV_UPD_ASSIGN) {
            hkv_copy_row<G, false>(row, values + i * t.dim, t.dim, g.rank);
            ns = hkv_on_update(sc, old, has, in);
        } else if (mode == HKV_UPD_SCORES) {
            ns = hkv_on_update(sc, old, has, in);
        } else {
            hkv_add_row<G>(row, values + i * t.dim, t.dim, g.rank);
            ns = hkv_on_upsert(sc, old, has, in);
        }
        if (g.rank == 0) t.scores[pos] = ns;
    }
    hkv_unlock2(t, g, b1, b2);
    if (g.rank == 0) {
        int out = s >= 0 ? HKV_UPDATED : HKV_ABSENT;
        if (outcomes) outcomes[i] = (u8)out;
        if (absent) absent[i] = s < 0;
        atomicAdd(cnt + HKV_C_UPDATED + out, 1ULL);
    }
}

// values: rows (assign) or deltas (accumulate); null for assign_scores.
// only (may be null): process key i only where only[i] != 0.
#define HKV_UPDATE_KERNEL(NAME, G, BOUNDS)                                                                         \
    extern "C" __global__ void BOUNDS NAME(HkvTable t, HkvScoring sc, const u64* keys, u64 n, const float* values, \
                                    const u64* scores_in, const u8* only, int mode, u8* outcomes, u8* absent,      \
                                    u64* counters) {                                                               \
        HKV_COUNTERS_INIT                                                                                          \
        update_one<G>(t, sc, keys, n, values, scores_in, only, mode, outcomes, absent, hkv_cnt);                   \
        hkv_flush_counters(hkv_cnt, counters);                                                                     \
    }

// update_keys: 8 threads per key; the _gN variants: N. update_keys_g2_b5:
// 2 threads per key, at most 48 registers so that 5 blocks of 256 fit an SM
// (the compiler's own choice, 64, fits 4): faster for rows of up to 32
// floats, slower for 64 (measured on the H200, shard/BENCHMARKS.md).
HKV_UPDATE_KERNEL(update_keys, 8, )
HKV_UPDATE_KERNEL(update_keys_g1, 1, )
HKV_UPDATE_KERNEL(update_keys_g2, 2, )
HKV_UPDATE_KERNEL(update_keys_g4, 4, )
HKV_UPDATE_KERNEL(update_keys_g16, 16, )
HKV_UPDATE_KERNEL(update_keys_g32, 32, )
HKV_UPDATE_KERNEL(update_keys_g2_b5, 2, __launch_bounds__(256, 5))
