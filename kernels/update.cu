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
    bool has = scores_in != 0;
    u64 in = has ? scores_in[i] : 0;
    if (values) hkv_prefetch_row<G>(g, values + i * t.dim, t.dim);
    // PRELOAD: assign loads a row of up to 32 G floats into registers
    // before it waits for the lock, so that only its stores happen under the
    // lock (dim 64: 3-5 % faster on the H200). Not in update_keys_g2_b5,
    // held to 48 registers: dims 8 and 32 ran 12 % slower with it.
    const u32 n4 = t.dim / 4;
    bool pre = false;
    float4 r[8];
    // The lock's first attempt overlaps the lookup, and the preload the
    // wait for it (keys are stable under the updater group, see
    // hkv_lock2_start).
    const HkvLocked loc = hkv_find_locked<G, false>(t, g, key, nullptr, nullptr, [&](u64, int s) {
        pre = PRELOAD && s >= 0 && mode == HKV_UPD_ASSIGN && (t.dim & 3) == 0 && n4 <= 8 * G;
        if (pre) {
            const float4* src = reinterpret_cast<const float4*>(values + i * t.dim);
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (g.rank + k * G < n4) r[k] = __ldg(src + g.rank + k * G);
        }
    });
    const int s = loc.s;
    if (s >= 0) {
        u64 pos = loc.b * 128 + s;
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
    hkv_unlock2(t, g, loc.b1, loc.b2);
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

// ---- apply_gradients: an optimizer step in place -----------------------------
// One step of the table's optimizer (shard/src/optim.rs) on each present
// key's row, under both bucket locks like the update family above (updater
// group): the step reads the row's values and state from L2 and writes them
// back before the unlock, so a row is stepped whole, and two occurrences of
// one key in a launch are stepped one after the other (the host runs
// duplicates in rounds, in index order). Every operation is the CPU's, in
// its order, rounded as the CPU rounds it (explicit _rn intrinsics: no
// contraction into fused multiply-adds), so both backends step a row to the
// same bits; the row-wise mean is summed by one thread, in index order, for
// the same reason. Adam's bias terms come from the host (HkvStep), computed
// as optim.rs computes them. A present key's score is refreshed as assign
// refreshes it. found (may be null): 1 for a present key. updated (may be
// null): the key's values after its step, or zeros for an absent key.

// The gradient of value e: grad + weight_decay * w.
__device__ __forceinline__ float hkv_grad(const HkvStep& st, float grad, float w) {
    return __fadd_rn(grad, __fmul_rn(st.weight_decay, w));
}

template <int G>
__device__ __forceinline__ void step_row(const HkvGroup<G>& g, const HkvStep& st, float* row, const float* grad,
                                         float* out) {
    const u32 d = st.dim;
    float* state = row + d;
    switch (st.optimizer) {
        case HKV_OPT_SGD:
            for (u32 e = g.rank; e < d; e += G) {
                float w = __ldcg(row + e);
                float x = hkv_grad(st, grad[e], w);
                w = __fsub_rn(w, __fmul_rn(st.lr, x));
                row[e] = w;
                if (out) out[e] = w;
            }
            break;
        case HKV_OPT_ADAGRAD:
            for (u32 e = g.rank; e < d; e += G) {
                float w = __ldcg(row + e);
                float x = hkv_grad(st, grad[e], w);
                float s = __fadd_rn(__ldcg(state + e), __fmul_rn(x, x));
                w = __fsub_rn(w, __fmul_rn(st.lr, __fdiv_rn(x, __fadd_rn(__fsqrt_rn(s), st.eps))));
                state[e] = s;
                row[e] = w;
                if (out) out[e] = w;
            }
            break;
        case HKV_OPT_ROWWISE_ADAGRAD: {
            float a = 0.0f;
            if (g.rank == 0) {
                float sum = 0.0f;
                for (u32 e = 0; e < d; ++e) {
                    float x = hkv_grad(st, grad[e], __ldcg(row + e));
                    sum = __fadd_rn(sum, __fmul_rn(x, x));
                }
                a = __fadd_rn(__ldcg(state), __fdiv_rn(sum, (float)d));
                state[0] = a;
            }
            a = __shfl_sync(g.mask, a, 0, G);
            float scale = __fdiv_rn(st.lr, __fadd_rn(__fsqrt_rn(a), st.eps));
            for (u32 e = g.rank; e < d; e += G) {
                float w = __ldcg(row + e);
                float x = hkv_grad(st, grad[e], w);
                w = __fsub_rn(w, __fmul_rn(scale, x));
                row[e] = w;
                if (out) out[e] = w;
            }
            break;
        }
        default: {  // HKV_OPT_ADAM: m, then v, after the values
            float* m = state;
            float* v = state + d;
            const float c1 = __fsub_rn(1.0f, st.beta1), c2 = __fsub_rn(1.0f, st.beta2);
            for (u32 e = g.rank; e < d; e += G) {
                float w = __ldcg(row + e);
                float x = hkv_grad(st, grad[e], w);
                float me = __ldcg(m + e), ve = __ldcg(v + e);
                me = __fadd_rn(me, __fmul_rn(__fsub_rn(x, me), c1));
                ve = __fadd_rn(__fmul_rn(ve, st.beta2), __fmul_rn(__fmul_rn(c2, x), x));
                float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(ve), st.bias2_sqrt), st.eps);
                w = __fsub_rn(w, __fmul_rn(st.step_size, __fdiv_rn(me, denom)));
                m[e] = me;
                v[e] = ve;
                row[e] = w;
                if (out) out[e] = w;
            }
            break;
        }
    }
}

template <int G>
__device__ __forceinline__ void step_one(const HkvTable& t, const HkvScoring& sc, const HkvStep& st, const u64* keys,
                                         u64 n, const float* grads, const u8* only, u8* found, float* updated,
                                         u64* cnt, const HkvSample& smp, u32* seen) {
    HkvGroup<G> g;
    u64 i = hkv_key_index(t, ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G, n);
    bool active = i < n && !(only && !only[i]);
    u64 key = active ? keys[i] : 0;
    if (smp.ring) hkv_sample_warp(smp, active && g.rank == 0, key, seen);
    if (!active) return;
    const float* grad = grads + i * st.dim;
    hkv_prefetch_row<G>(g, grad, st.dim);
    float* out = updated ? updated + i * st.dim : 0;
    const HkvLocked loc = hkv_find_locked<G, false>(t, g, key, nullptr, nullptr);
    const int s = loc.s;
    if (s >= 0) {
        u64 pos = loc.b * 128 + s;
        step_row<G>(g, st, hkv_row(t, pos), grad, out);
        u64 old = hkv_needs_old(sc, false, true) ? __ldcg(t.scores + pos) : 0;
        if (g.rank == 0) t.scores[pos] = hkv_on_update(sc, old, false, 0);
    }
    hkv_unlock2(t, g, loc.b1, loc.b2);
    if (s < 0 && out)
        for (u32 e = g.rank; e < st.dim; e += G) out[e] = 0.0f;
    if (g.rank == 0) {
        int o = s >= 0 ? HKV_UPDATED : HKV_ABSENT;
        if (found) found[i] = s >= 0;
        atomicAdd(cnt + HKV_C_UPDATED + o, 1ULL);
    }
}

// grads: n x st.dim gradients; only (may be null): process key i only where
// only[i] != 0; smp: the miss-ratio sampler, which samples the keys stepped.
#define HKV_STEP_KERNEL(NAME, G)                                                                                    \
    extern "C" __global__ void NAME(HkvTable t, HkvScoring sc, HkvStep st, const u64* keys, u64 n,                  \
                                    const float* grads, const u8* only, u8* found, float* updated, u64* counters,   \
                                    HkvSample smp) {                                                                \
        HKV_SAMPLE_INIT                                                                                             \
        HKV_COUNTERS_INIT                                                                                           \
        step_one<G>(t, sc, st, keys, n, grads, only, found, updated, hkv_cnt, smp, &hkv_seen);                      \
        hkv_flush_counters(hkv_cnt, counters);                                                                      \
        hkv_flush_sample(smp, &hkv_seen);                                                                           \
    }

// step_keys: 8 threads per key; the _gN variants: N.
HKV_STEP_KERNEL(step_keys, 8)
HKV_STEP_KERNEL(step_keys_g1, 1)
HKV_STEP_KERNEL(step_keys_g2, 2)
HKV_STEP_KERNEL(step_keys_g4, 4)
HKV_STEP_KERNEL(step_keys_g16, 16)
HKV_STEP_KERNEL(step_keys_g32, 32)

// apply_gradients with summed repeats (optim::sum_duplicates, bit for bit):
// after dedupe_claim / dedupe_lead, first[i] flags each key's first
// occurrence and lead[i] (where the key repeats) the first occurrence of a
// repeat; a key left out (only) has neither. cnt and maxbits (n u32, zero)
// and acc (n x dim i64, zero) are indexed by first occurrence.

#define HKV_SUM_NO_LEAD 0xFFFFFFFFu

// The first occurrence of key i, HKV_SUM_NO_LEAD for a key left out.
__device__ __forceinline__ u32 hkv_sum_first(u64 i, const u8* first, const u32* lead, const u32* repeats) {
    if (first[i]) return (u32)i;
    return *repeats ? lead[i] : HKV_SUM_NO_LEAD;
}

// The exponent E of a repeated key's fixed-point sum: count * max (in f64)
// lies below 2^(62 - E), so that count terms sum below 2^62.
__device__ __forceinline__ int hkv_sum_exp(u32 count, u32 maxbits) {
    double x = __dmul_rn((double)count, (double)__uint_as_float(maxbits));
    return 62 - ((int)((__double_as_longlong(x) >> 52) & 0x7ff) - 1022);
}

// One thread per key: its occurrence counted, and its row's largest
// magnitude (f32 bits: NaN above infinity above every finite value) kept,
// in its first occurrence's entry.
extern "C" __global__ void sum_count(const float* grads, u64 dim, u64 n, const u8* first, const u32* lead,
                                     const u32* repeats, u32* cnt, u32* maxbits) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32 f = hkv_sum_first(i, first, lead, repeats);
    if (f == HKV_SUM_NO_LEAD) return;
    u32 m = 0;
    for (u64 e = 0; e < dim; ++e) m = max(m, __float_as_uint(grads[i * dim + e]) & 0x7fffffffu);
    atomicAdd(cnt + f, 1u);
    atomicMax(maxbits + f, m);
}

// One thread per gradient element of a repeated key: its fixed-point term
// (rounded to nearest, ties to even) added to its first occurrence's sum.
// Integer sums do not depend on the order of the adds.
extern "C" __global__ void sum_add(const float* grads, u64 dim, u64 n, const u8* first, const u32* lead,
                                   const u32* repeats, const u32* cnt, const u32* maxbits, long long* acc) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * dim || !*repeats) return;
    const u64 i = t / dim, e = t % dim;
    const u32 f = hkv_sum_first(i, first, lead, repeats);
    if (f == HKV_SUM_NO_LEAD) return;
    const u32 c = cnt[f], m = maxbits[f];
    if (c <= 1 || m == 0 || m >= 0x7f800000u) return;
    const long long q = __double2ll_rn(ldexp((double)grads[t], hkv_sum_exp(c, m)));
    atomicAdd((unsigned long long*)(acc + (u64)f * dim + e), (unsigned long long)q);
}

// One thread per gradient element of a first occurrence: the gradient its
// key steps with, into out: its own where the key occurs once, else the
// sum (through f64, rounded to nearest at each step), 0 where every
// element is zero, NaN where one is not finite.
extern "C" __global__ void sum_out(const float* grads, u64 dim, u64 n, const u8* first, const u32* cnt,
                                   const u32* maxbits, const long long* acc, float* out) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * dim) return;
    const u64 i = t / dim;
    if (!first[i]) return;
    const u32 c = cnt[i], m = maxbits[i];
    float r;
    if (c <= 1) r = grads[t];
    else if (m >= 0x7f800000u) r = __int_as_float(0x7fc00000);
    else if (m == 0) r = 0.0f;
    else r = __double2float_rn(ldexp(__ll2double_rn(acc[t]), -hkv_sum_exp(c, m)));
    out[t] = r;
}
