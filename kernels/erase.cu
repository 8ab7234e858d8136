// erase family: erase (by key), erase_if (by predicate), clear, and the
// initialisation of fresh storage. Inserter group. erase: G = 16 threads per
// key with its buckets locked; erase_if: one warp per bucket; clear: one
// thread per slot.

template <int G>
__device__ __forceinline__ void erase_one(const HkvTable& t, const u64* keys, u64 n, const u8* only, u8* erased,
                                          u64* cnt) {
    HkvGroup<G> g;
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G;
    if (i >= n || (only && !only[i])) return;
    u64 key = keys[i];
    u64 b1, b2;
    u8 d;
    hkv_locate(t, key, &b1, &b2, &d);
    hkv_lock2(t, g, b1, b2);
    u64 b = b1;
    int s = hkv_find_in<G, true>(t, g, b1, key, d);
    if (s < 0 && b2 != b1) {
        b = b2;
        s = hkv_find_in<G, true>(t, g, b2, key, d);
    }
    if (s >= 0 && g.rank == 0) {
        u64 pos = b * 128 + s;
        t.keys[pos] = HKV_EMPTY_KEY;
        t.digests[pos] = hkv_empty_digest();
        t.scores[pos] = 0;
        t.sizes[b] -= 1;
    }
    hkv_unlock2(t, g, b1, b2);
    if (g.rank == 0) {
        if (erased) erased[i] = s >= 0;
        if (s >= 0) atomicAdd(cnt + HKV_C_ERASED, 1ULL);
    }
}

// only (may be null): process key i only where only[i] != 0.
extern "C" __global__ void erase_keys(HkvTable t, const u64* keys, u64 n, const u8* only, u8* erased,
                                      u64* counters) {
    HKV_COUNTERS_INIT
    erase_one<16>(t, keys, n, only, erased, hkv_cnt);
    hkv_flush_counters(hkv_cnt, counters);
}

// One warp per bucket: removes every entry matching f.
extern "C" __global__ void erase_if(HkvTable t, HkvFilter f, u64* counters) {
    HKV_COUNTERS_INIT
    u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x & 31;
    if (b < t.nbuckets) {
        u32 removed = 0;
        for (int j = 0; j < 4; ++j) {
            u64 pos = b * 128 + lane * 4 + j;
            u64 k = t.keys[pos];
            if (k != HKV_EMPTY_KEY && hkv_matches(f, k, t.scores[pos])) {
                t.keys[pos] = HKV_EMPTY_KEY;
                t.digests[pos] = hkv_empty_digest();
                t.scores[pos] = 0;
                removed++;
            }
        }
        for (int off = 16; off > 0; off >>= 1) removed += __shfl_xor_sync(0xffffffffu, removed, off);
        if (lane == 0 && removed) {
            t.sizes[b] -= (int)removed;
            atomicAdd(hkv_cnt + HKV_C_ERASED, (u64)removed);
        }
    }
    hkv_flush_counters(hkv_cnt, counters);
}

// Every slot free, sizes and locks zero.
extern "C" __global__ void clear_table(HkvTable t) {
    u64 pos = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (pos >= t.nbuckets * 128) return;
    t.keys[pos] = HKV_EMPTY_KEY;
    t.digests[pos] = hkv_empty_digest();
    t.scores[pos] = 0;
    if ((pos & 127) == 0) {
        t.sizes[pos >> 7] = 0;
        t.locks[pos >> 7] = 0;
    }
}
