// update family: assign, assign_scores and the accumulate phase of
// accum_or_assign, on present keys only. Updater group: batches of this
// family may run together, so buckets are locked per key as writers do
// (update_keys*), or, in the update_slot_keys* variants, only the key's
// slot is locked: its key word is swapped for HKV_LOCKED_KEY while the row
// and score are written (no inserter or reader runs meanwhile, so nobody
// else sees the marker).
// Thread mapping: G = 1, 2, 4, 8 or 16 threads per key, picked by the host.

#define HKV_UPD_ASSIGN 0
#define HKV_UPD_SCORES 1
#define HKV_UPD_ACCUM 2

// A reserved key (shard::RESERVED_KEY_MIN ..= u64::MAX): marks a slot being updated.
#define HKV_LOCKED_KEY 0xFFFFFFFFFFFFFFFEULL

__device__ __forceinline__ u64 hkv_cas64_acquire(u64* p, u64 cmp, u64 val) {
    u64 old;
    asm volatile("atom.acquire.gpu.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(cmp), "l"(val) : "memory");
    return old;
}

__device__ __forceinline__ void hkv_store_release64(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Finds `key` in bucket b and locks its slot (key word swapped for
// HKV_LOCKED_KEY); returns the slot, or -1 when the key is absent. The
// compare-and-swap is the key comparison. A candidate found locked (the
// same key in another group, or another key of the same digest) is
// retried after the group has let go of everything, so no group waits
// while it holds a slot.
template <int G>
__device__ __forceinline__ int hkv_claim(const HkvTable& t, const HkvGroup<G>& g, u64 b, u64 key, u8 d) {
    constexpr int SPT = 128 / G;
    HkvBits<SPT> m;
    hkv_match<G, true>(t.digests + b * 128, g.rank, d, m, 0, (HkvBits<SPT>*)0);
    for (;;) {
        bool busy = false;
        int mine = hkv_first(m, g.rank, [&](int s) {
            hkv_prefetch_l2(t.scores + b * 128 + s);
            u64 old = hkv_cas64_acquire(t.keys + b * 128 + s, key, HKV_LOCKED_KEY);
            busy |= old == HKV_LOCKED_KEY;
            return old == key;
        });
        u32 who = g.ballot(mine >= 0);
        if (who) return g.bcast(mine, __ffs(who) - 1);
        if (!g.ballot(busy)) return -1;
        __nanosleep(64);
    }
}

template <int G, bool SLOT>
__device__ __forceinline__ void update_one(const HkvTable& t, const HkvScoring& sc, const u64* keys, u64 n,
                                           const float* values, const u64* scores_in, const u8* only, int mode,
                                           u8* outcomes, u8* absent, u64* cnt) {
    HkvGroup<G> g;
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G;
    if (i >= n || (only && !only[i])) return;
    u64 key = keys[i];
    u64 b1, b2;
    u8 d;
    hkv_locate(t, key, &b1, &b2, &d);
    if (g.rank == 0) {
        hkv_prefetch_bucket(t, b1);
        if (b2 != b1) hkv_prefetch_bucket(t, b2);
    }
    bool has = scores_in != 0;
    u64 in = has ? scores_in[i] : 0;
    if (values) hkv_prefetch_row<G>(g, values + i * t.dim, t.dim);
    if (!SLOT) hkv_lock2(t, g, b1, b2);
    u64 b = b1;
    int s = SLOT ? hkv_claim<G>(t, g, b1, key, d) : hkv_find_in<G, true>(t, g, b1, key, d);
    if (s < 0 && b2 != b1) {
        b = b2;
        s = SLOT ? hkv_claim<G>(t, g, b2, key, d) : hkv_find_in<G, true>(t, g, b2, key, d);
    }
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
        if (SLOT) {
            // The row and score are written before the key comes back.
            g.sync();
            if (g.rank == 0) hkv_store_release64(t.keys + pos, key);
        }
    }
    if (!SLOT) hkv_unlock2(t, g, b1, b2);
    if (g.rank == 0) {
        int out = s >= 0 ? HKV_UPDATED : HKV_ABSENT;
        if (outcomes) outcomes[i] = (u8)out;
        if (absent) absent[i] = s < 0;
        atomicAdd(cnt + HKV_C_UPDATED + out, 1ULL);
    }
}

// values: rows (assign) or deltas (accumulate); null for assign_scores.
// only (may be null): process key i only where only[i] != 0.
#define HKV_UPDATE_KERNEL(NAME, G, SLOT)                                                                        \
    extern "C" __global__ void NAME(HkvTable t, HkvScoring sc, const u64* keys, u64 n, const float* values,        \
                                    const u64* scores_in, const u8* only, int mode, u8* outcomes, u8* absent,      \
                                    u64* counters) {                                                               \
        HKV_COUNTERS_INIT                                                                                          \
        update_one<G, SLOT>(t, sc, keys, n, values, scores_in, only, mode, outcomes, absent, hkv_cnt);            \
        hkv_flush_counters(hkv_cnt, counters);                                                                     \
    }

// update_keys: 8 threads per key; the _gN variants: N. update_slot_keys*:
// the same with slot locks.
HKV_UPDATE_KERNEL(update_keys, 8, false)
HKV_UPDATE_KERNEL(update_keys_g1, 1, false)
HKV_UPDATE_KERNEL(update_keys_g2, 2, false)
HKV_UPDATE_KERNEL(update_keys_g4, 4, false)
HKV_UPDATE_KERNEL(update_keys_g16, 16, false)
HKV_UPDATE_KERNEL(update_slot_keys, 8, true)
HKV_UPDATE_KERNEL(update_slot_keys_g1, 1, true)
HKV_UPDATE_KERNEL(update_slot_keys_g2, 2, true)
HKV_UPDATE_KERNEL(update_slot_keys_g4, 4, true)
HKV_UPDATE_KERNEL(update_slot_keys_g16, 16, true)
