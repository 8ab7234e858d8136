// update family: assign, assign_scores and the accumulate phase of
// accum_or_assign, on present keys only. Updater group: batches of this
// family may run together, so a key's buckets are locked around its score
// and row writes; no key moves meanwhile, so the slot is looked up without
// the lock (update_keys*).
// Thread mapping: G = 1, 2, 4, 8, 16 or 32 threads per key, picked by the host.
// mode: HKV_UPD_ASSIGN, _SCORES or _ACCUM (abi.h).

template <int G, bool PRELOAD>
__device__ __forceinline__ void update_one(const HkvTable& t, const HkvScoring& sc, const u64* keys, u64 n,
                                           const float* values, const u64* scores_in, const u8* only, int mode,
                                           u8* outcomes, u8* absent, u64* cnt, const HkvSample& smp, u32* seen) {
    HkvGroup<G> g;
    u64 i = hkv_key_index(t, ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G, n);
    bool active = i < n && !(only && !only[i]);
    u64 key = active ? keys[i] : 0;
    // The miss-ratio sampling filter, fused: the whole warp is here.
    if (smp.ring) hkv_sample_warp(smp, active && g.rank == 0, key, seen);
    if (!active) return;
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
    // PRELOAD: assign loads a row of up to 32 G floats into registers
    // before it waits for the lock, so that only its stores happen under the
    // lock (dim 64: 3-5 % faster on the H200). Not in update_keys_g2_b5,
    // held to 48 registers: dims 8 and 32 ran 12 % slower with it.
    const u32 n4 = t.dim / 4;
    const bool pre = PRELOAD && s >= 0 && mode == HKV_UPD_ASSIGN && (t.dim & 3) == 0 && n4 <= 8 * G;
    float4 r[8];
    if (pre) {
        const float4* src = reinterpret_cast<const float4*>(values + i * t.dim);
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (g.rank + k * G < n4) r[k] = __ldg(src + g.rank + k * G);
    }
    hkv_lock2_wait(t, g, b1, b2, first);
    if (s >= 0) {
        u64 pos = b * 128 + s;
        float* row = hkv_row(t, pos);
        u64 old = hkv_needs_old(sc, has, mode != HKV_UPD_ACCUM) ? __ldcg(t.scores + pos) : 0;
        u64 ns;
        if (pre) {
            float4* dst = reinterpret_cast<float4*>(row);
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (g.rank + k * G < n4) dst[g.rank + k * G] = r[k];
            ns = hkv_on_update(sc, old, has, in);
        } else if (mode == HKV_UPD_ASSIGN) {
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
// only (may be null): process key i only where only[i] != 0. smp: the
// miss-ratio sampler (table.cuh; ring null: off), which samples the keys
// processed.
#define HKV_UPDATE_KERNEL(NAME, G, BOUNDS, PRELOAD)                                                                 \
    extern "C" __global__ void BOUNDS NAME(HkvTable t, HkvScoring sc, const u64* keys, u64 n, const float* values,  \
                                    const u64* scores_in, const u8* only, int mode, u8* outcomes, u8* absent,       \
                                    u64* counters, HkvSample smp) {                                                 \
        HKV_SAMPLE_INIT                                                                                             \
        HKV_COUNTERS_INIT                                                                                           \
        update_one<G, PRELOAD>(t, sc, keys, n, values, scores_in, only, mode, outcomes, absent, hkv_cnt, smp,      \
                               &hkv_seen);                                                                          \
        hkv_flush_counters(hkv_cnt, counters);                                                                      \
        hkv_flush_sample(smp, &hkv_seen);                                                                           \
    }

// update_keys: 8 threads per key; the _gN variants: N. update_keys_g2_b5:
// 2 threads per key, at most 48 registers so that 5 blocks of 256 fit an SM
// (the compiler's own choice, 64, fits 4): faster for rows of up to 32
// floats, slower for 64 (measured on the H200, shard/BENCHMARKS.md).
HKV_UPDATE_KERNEL(update_keys, 8, , true)
HKV_UPDATE_KERNEL(update_keys_g1, 1, , true)
HKV_UPDATE_KERNEL(update_keys_g2, 2, , true)
HKV_UPDATE_KERNEL(update_keys_g4, 4, , true)
HKV_UPDATE_KERNEL(update_keys_g16, 16, , true)
HKV_UPDATE_KERNEL(update_keys_g32, 32, , true)
HKV_UPDATE_KERNEL(update_keys_g2_b5, 2, __launch_bounds__(256, 5), false)
