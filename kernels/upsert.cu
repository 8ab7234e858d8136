// upsert family: insert_or_assign, insert_and_evict, find_or_insert,
// find_or_insert*, load and the insert phase of accum_or_assign: the write
// path of paper Algorithms 2 and 3, exactly as CpuTable::upsert. Inserter
// group. Thread mapping: G = 1, 2, 4, 8, 16 or 32 threads per key, picked by the
// host per batch, 256 / G keys per 256-thread block; the key's candidate
// buckets are locked for the whole operation.
// insert_and_evict compacts what lost its slot on the GPU (order unspecified).
// A verbatim write (load, rehash) in dual mode whose two buckets are full
// relocates a resident before it evicts (below); with HKV_SCORES_DEFER it
// then leaves a key it still cannot place to a later launch.
// mode: HKV_UP_INSERT, _FIND_OR_INSERT, _ACCUM or _FIND_OR_INSERT_PTR (abi.h).
// Adaptive (sc.sketch non-null): a newcomer follows the window rule of
// table.cuh ("adaptive policy"); adapt_count has counted the batch's keys.

// ---- relocation (verbatim writes in dual mode) -------------------------------
// A restore or a rehash places entries that all fit the table, but which
// bucket of its two a key took depends on the order keys arrive, and in one
// launch thousands of keys race: a key can find both its buckets full while
// the table still has room (issue 32: 1 384 entries of a 95 %-full lfu
// table dropped by a restore). As CpuTable::make_room does, a verbatim
// write whose candidates are both full first moves a resident of one of
// them to that resident's other bucket (one step), or a resident of that
// bucket on to its own other bucket first (two steps). The buckets moved
// into are only try-locked (a lock already held is passed over), so two
// groups never wait on each other; every key moved has both its buckets
// locked meanwhile, so no other group looks for it in between.

// Takes bucket b's lock if it is free; whether it did (to every thread).
template <int G>
__device__ __forceinline__ bool hkv_try_lock(const HkvTable& t, const HkvGroup<G>& g, u64 b) {
    int got = 0;
    if (g.rank == 0) got = hkv_cas_acquire(t.locks + b) == 0;
    return g.bcast(got, 0) != 0;
}

template <int G>
__device__ __forceinline__ void hkv_unlock1(const HkvTable& t, const HkvGroup<G>& g, u64 b) {
    g.sync();
    if (g.rank == 0) hkv_store_release(t.locks + b);
}

// Lowest free slot of locked bucket b from its digest line, or -1.
template <int G>
__device__ __forceinline__ int hkv_free_in(const HkvTable& t, const HkvGroup<G>& g, u64 b) {
    HkvBits<128 / G> f;
    hkv_match<G, true>(t.digests + b * 128, g.rank, hkv_empty_digest(), f, 0, (HkvBits<128 / G>*)0);
    return hkv_free_slot<G>(g, f);
}

// Moves the entry at position `from` to the free position `to` (both
// buckets locked) and frees `from`; on an adaptive table (sc.sketch), with
// its window bit.
template <int G>
__device__ __forceinline__ void hkv_move(const HkvTable& t, const HkvScoring& sc, const HkvGroup<G>& g, u64 from,
                                         u64 to) {
    hkv_copy_row<G, true>(hkv_row(t, to), hkv_row(t, from), t.dim, g.rank);
    if (g.rank == 0) {
        u64 bf = from / 128, bt = to / 128;
        t.keys[to] = __ldcg(t.keys + from);
        t.digests[to] = __ldcg(t.digests + from);
        const u64 score = __ldcg(t.scores + from);
        t.scores[to] = score;
        hkv_window_mark(sc, to, !(score & HKV_ADAPTIVE_MAIN));
        hkv_window_mark(sc, from, false);
        t.sizes[bt] = __ldcg(t.sizes + bt) + 1;
        t.keys[from] = HKV_EMPTY_KEY;
        t.digests[from] = hkv_empty_digest();
        t.scores[from] = 0;
        t.sizes[bf] = __ldcg(t.sizes + bf) - 1;
    }
    g.sync();
}

// The other candidate bucket of the key at position `pos` of bucket b.
__device__ __forceinline__ u64 hkv_other_bucket(const HkvTable& t, u64 b, u64 pos) {
    u64 c1, c2;
    u8 d;
    hkv_locate(t, __ldcg(t.keys + pos), &c1, &c2, &d);
    return c1 == b ? c2 : c1;
}

// Frees a slot of the full, locked bucket b (one of the writer's
// candidates b1, b2) by moving a resident to its other bucket: one with a
// free slot (one step), or, with DEEP, one that frees a slot the same way
// first (two steps). Residents are tried slot by slot, the group's
// threads taking interleaved slots; in one step the other bucket's size
// skips full ones before a lock is tried. b1 and b2 are never moved into
// (the writer holds them: a try-lock of them would fail anyway). Returns
// the freed slot of b, or -1.
template <int G, bool DEEP>
__device__ int hkv_make_room(const HkvTable& t, const HkvScoring& sc, const HkvGroup<G>& g, u64 b, u64 b1, u64 b2) {
    for (int j = 0; j < 128 / G; ++j) {
        int s = j * G + (int)g.rank;
        u64 alt = hkv_other_bucket(t, b, b * 128 + s);
        bool cand = alt != b1 && alt != b2 && (DEEP || __ldcg(t.sizes + alt) < 128);
        for (u32 m = g.ballot(cand); m; m &= m - 1) {
            int r = __ffs(m) - 1;
            u64 a = g.bcast(alt, r);
            int from = j * G + r;
            if (!hkv_try_lock(t, g, a)) continue;
            int to = hkv_free_in<G>(t, g, a);
            if (DEEP && to < 0) to = hkv_make_room<G, false>(t, sc, g, a, b1, b2);
            if (to >= 0) hkv_move<G>(t, sc, g, b * 128 + from, a * 128 + to);
            hkv_unlock1<G>(t, g, a);
            if (to >= 0) return from;
        }
    }
    return -1;
}

// A slot freed by relocation for a verbatim write whose candidates b1, b2
// are both full: one step from b1, then from b2, then two steps from each.
// Sets *b to the bucket; returns the slot, or -1.
template <int G>
__device__ int hkv_relocate(const HkvTable& t, const HkvScoring& sc, const HkvGroup<G>& g, u64 b1, u64 b2, u64* b) {
    *b = b1;
    int s = hkv_make_room<G, false>(t, sc, g, b1, b1, b2);
    if (s < 0) {
        *b = b2;
        s = hkv_make_room<G, false>(t, sc, g, b2, b1, b2);
    }
    if (s < 0) {
        *b = b1;
        s = hkv_make_room<G, true>(t, sc, g, b1, b1, b2);
    }
    if (s < 0) {
        *b = b2;
        s = hkv_make_room<G, true>(t, sc, g, b2, b1, b2);
    }
    return s;
}

// LOST: whether the lost_* outputs may be given (insert_and_evict); the
// variants without them are smaller. ADAPT: the kernels of adaptive tables
// (the window rule and bits); the others carry none of its code. RELOC:
// the kernels of verbatim writes (loads, rehashes), the only ones with the
// relocation above: compiled into every writer it took 32 more registers
// (64 -> 96: 2 blocks of 256 an SM instead of 4) and 432 bytes of spills
// in the 48-register kernel, for a path only verbatim writes take.
template <int G, bool LOST, bool ADAPT, bool RELOC>
__device__ __forceinline__ void upsert_one(const HkvTable& t, const HkvScoring& sc, const u64* keys, u64 n,
                                           float* values, const u64* scores_in, const u8* only, int mode,
                                           u8* outcomes, u64* ptrs, u64* lost_keys, float* lost_values,
                                           u64* lost_scores, u8* lost_kinds, u64* cnt, u64* gcnt,
                                           const HkvSample& smp, u32* seen) {
    HkvGroup<G> g;
    u64 i = hkv_key_index(t, ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G, n);
    bool active = i < n && !(only && !only[i]);
    u64 key = active ? keys[i] : 0;
    // The miss-ratio sampling filter, fused: the whole warp is here.
    if (smp.ring) hkv_sample_warp(smp, active && g.rank == 0, key, seen);
    if (!active) return;
    bool has = scores_in != 0;
    u64 in = has ? scores_in[i] : 0;
    float* vin = values ? values + i * t.dim : 0;
    hkv_prefetch_row<G>(g, vin, t.dim);
    u64 ptr = 0;
    int out;
    HkvBits<128 / G> free1, free2;
    const HkvLocked loc = hkv_find_locked<G, true>(t, g, key, &free1, &free2);
    const u64 b1 = loc.b1, b2 = loc.b2;
    const u8 d = loc.d;
    u64 b = loc.b;
    int s = loc.s;
    if (s >= 0) {
        u64 pos = b * 128 + s;
        float* row = hkv_row(t, pos);
        u64 old = !sc.verbatim && hkv_needs_old(sc, has, false) ? __ldcg(t.scores + pos) : 0;
        u64 ns = sc.verbatim ? in : hkv_on_upsert(sc, old, has, in);
        if (mode == HKV_UP_INSERT) hkv_copy_row<G, false>(row, vin, t.dim, g.rank);
        else if (mode == HKV_UP_FIND_OR_INSERT) hkv_copy_row<G, true>(vin, row, t.dim, g.rank);
        else if (mode == HKV_UP_ACCUM) hkv_add_row<G>(row, vin, t.dim, g.rank);
        ptr = (u64)row;
        if (g.rank == 0) {
            t.scores[pos] = ns;
            // A verbatim score may move an adaptive entry between tiers.
            if (ADAPT && sc.verbatim) hkv_window_mark(sc, pos, !(ns & HKV_ADAPTIVE_MAIN));
        }
        out = HKV_UPDATED;
    } else {
        u64 score = sc.verbatim ? in : hkv_on_insert(sc, has, in);
        u64 adm = sc.verbatim ? score : hkv_admission(sc, score);
        // Adaptive, policy scores (the batch's keys are in the sketch: adapt_count).
        const bool adapt = ADAPT && !sc.verbatim && sc.sketch;
        u64 tb = b1;
        if (b2 != b1 && __ldcg(t.sizes + b2) < __ldcg(t.sizes + b1)) tb = b2;
        int fs = hkv_free_slot<G>(g, tb == b1 ? free1 : free2);
        // Both candidates full: a verbatim write relocates before it evicts.
        if (RELOC && fs < 0 && sc.verbatim && b2 != b1) fs = hkv_relocate<G>(t, sc, g, b1, b2, &tb);
        if (fs >= 0) {
            if (adapt) hkv_adapt_fill<G>(t, sc, g, tb, fs);
            b = tb;
            s = fs;
            out = HKV_INSERTED;
        } else if (sc.verbatim == HKV_SCORES_DEFER) {
            out = HKV_ABSENT;
        } else if (adapt) {
            // Inlined in the kernel held to 48 registers (a call there
            // spills around it: +16 % insert_or_assign at λ 1.0, H200).
            if (LOST) hkv_adapt_room<G>(t, sc, g, b1, b2, &b, &s);
            else hkv_adapt_room_in<G>(t, sc, g, b1, b2, &b, &s);
            if (g.rank == 0) hkv_adapt_evicted(sc, t, b * 128 + s);
            out = HKV_EVICTED;
        } else {
            int ms;
            u64 mv;
            hkv_min_slot<G>(t, g, b1, &ms, &mv);
            b = b1;
            if (b2 != b1) {
                int ms2;
                u64 mv2;
                hkv_min_slot<G>(t, g, b2, &ms2, &mv2);
                if (mv2 < mv) {
                    b = b2;
                    ms = ms2;
                    mv = mv2;
                }
            }
            s = ms;
            out = adm < mv ? HKV_REJECTED : HKV_EVICTED;
        }
        u64 pos = b * 128 + s;
        float* row = out == HKV_ABSENT ? 0 : hkv_row(t, pos);
        if (LOST && (out == HKV_EVICTED || out == HKV_REJECTED) && lost_keys) {
            // The entry that leaves: the resident one, or the refused input.
            u64 at = 0;
            if (g.rank == 0) at = atomicAdd(gcnt + HKV_C_LOST, 1ULL);
            at = g.bcast(at, 0);
            if (g.rank == 0) {
                lost_keys[at] = out == HKV_EVICTED ? __ldcg(t.keys + pos) : key;
                lost_scores[at] = out == HKV_EVICTED ? __ldcg(t.scores + pos) : score;
                lost_kinds[at] = out == HKV_EVICTED ? HKV_LOST_EVICTED : HKV_LOST_REJECTED;
            }
            hkv_copy_row<G, true>(lost_values + at * t.dim, out == HKV_EVICTED ? row : vin, t.dim, g.rank);
            g.sync();
        }
        if (out == HKV_INSERTED || out == HKV_EVICTED) {
            if (g.rank == 0) {
                t.keys[pos] = key;
                t.digests[pos] = d;
                t.scores[pos] = score;
                // (A policy's newcomer got its window bit in the adaptive paths.)
                if (ADAPT && sc.verbatim) hkv_window_mark(sc, pos, !(score & HKV_ADAPTIVE_MAIN));
                if (out == HKV_INSERTED) t.sizes[b] += 1;
            }
            if (mode != HKV_UP_FIND_OR_INSERT_PTR) hkv_copy_row<G, false>(row, vin, t.dim, g.rank);
            ptr = (u64)row;
        }
    }
    hkv_unlock2(t, g, b1, b2);
    if (g.rank == 0) {
        if (outcomes) outcomes[i] = (u8)out;
        if (ptrs) ptrs[i] = ptr;
        atomicAdd(cnt + HKV_C_UPDATED + out, 1ULL);
    }
}

// values: input rows (find_or_insert: in and out; null for find_or_insert*).
// scores_in, only, outcomes, ptrs and the lost_* outputs may be null; with
// only, key i is processed only where only[i] != 0. Kernels built without
// LOST ignore the lost_* outputs. smp: the miss-ratio sampler (table.cuh;
// ring null: off), which samples the keys processed.
#define HKV_UPSERT_KERNEL(NAME, G, BOUNDS, LOST, ADAPT, RELOC)                                                     \
    extern "C" __global__ void BOUNDS NAME(HkvTable t, HkvScoring sc, const u64* keys, u64 n, float* values,       \
                                           const u64* scores_in, const u8* only, int mode, u8* outcomes,           \
                                           u64* ptrs, u64* lost_keys, float* lost_values, u64* lost_scores,        \
                                           u8* lost_kinds, u64* counters, HkvSample smp) {                         \
        HKV_SAMPLE_INIT                                                                                            \
        HKV_COUNTERS_INIT                                                                                          \
        upsert_one<G, LOST, ADAPT, RELOC>(t, sc, keys, n, values, scores_in, only, mode, outcomes, ptrs, lost_keys, \
                                          lost_values, lost_scores, lost_kinds, hkv_cnt, counters, smp, &hkv_seen); \
        hkv_flush_counters(hkv_cnt, counters);                                                                     \
        hkv_flush_sample(smp, &hkv_seen);                                                                          \
    }

// upsert_keys: 8 threads per key; the _gN variants: N. upsert_keys_g4_b5:
// 4 threads per key, no lost outputs (every upsert but insert_and_evict),
// at most 48 registers so that 5 blocks of 256 fit an SM (the compiler's
// own choice, 64, fits 4; a few bytes spill): at dim 64 2-4 % faster up to
// λ 0.75, level at 1.0 (measured on the H200, shard/BENCHMARKS.md).
HKV_UPSERT_KERNEL(upsert_keys, 8, , true, false, false)
HKV_UPSERT_KERNEL(upsert_keys_g1, 1, , true, false, false)
HKV_UPSERT_KERNEL(upsert_keys_g2, 2, , true, false, false)
HKV_UPSERT_KERNEL(upsert_keys_g4, 4, , true, false, false)
HKV_UPSERT_KERNEL(upsert_keys_g16, 16, , true, false, false)
HKV_UPSERT_KERNEL(upsert_keys_g32, 32, , true, false, false)
HKV_UPSERT_KERNEL(upsert_keys_g4_b5, 4, __launch_bounds__(256, 5), false, false, false)
// The same for adaptive tables: upsert_keys_a, upsert_keys_a_gN, held to
// 64 registers so that 4 blocks of 256 fit an SM instead of 3 (71-80
// registers of their own, 24-84 bytes of spills so): on the H200, 32 Mi
// slots, dim 32, two rounds alternated, find_or_insert and
// insert_and_evict at λ 1.0 5-6 % faster, the writers at λ 0.5 within 1 %
// (shard/BENCHMARKS.md, "Repeated keys placed once").
HKV_UPSERT_KERNEL(upsert_keys_a, 8, __launch_bounds__(256, 4), true, true, false)
HKV_UPSERT_KERNEL(upsert_keys_a_g1, 1, __launch_bounds__(256, 4), true, true, false)
HKV_UPSERT_KERNEL(upsert_keys_a_g2, 2, __launch_bounds__(256, 4), true, true, false)
HKV_UPSERT_KERNEL(upsert_keys_a_g4, 4, __launch_bounds__(256, 4), true, true, false)
HKV_UPSERT_KERNEL(upsert_keys_a_g16, 16, __launch_bounds__(256, 4), true, true, false)
HKV_UPSERT_KERNEL(upsert_keys_a_g32, 32, __launch_bounds__(256, 4), true, true, false)
HKV_UPSERT_KERNEL(upsert_keys_a_g4_b5, 4, __launch_bounds__(256, 5), false, true, false)
// Verbatim writes (sc.verbatim: loads, rehashes) of every policy:
// upsert_keys_v, upsert_keys_v_gN, the only kernels that relocate. Built
// with the adaptive tables' window marks, which do nothing without a sketch.
HKV_UPSERT_KERNEL(upsert_keys_v, 8, , true, true, true)
HKV_UPSERT_KERNEL(upsert_keys_v_g1, 1, , true, true, true)
HKV_UPSERT_KERNEL(upsert_keys_v_g2, 2, , true, true, true)
HKV_UPSERT_KERNEL(upsert_keys_v_g4, 4, , true, true, true)
HKV_UPSERT_KERNEL(upsert_keys_v_g16, 16, , true, true, true)
HKV_UPSERT_KERNEL(upsert_keys_v_g32, 32, , true, true, true)

// ---- find_or_insert of a large batch: each key placed once --------------------
// A key that comes many times in a batch and is absent serialised in
// upsert_one on its buckets' locks, one occurrence after another (13 M
// keys/s for Zipf keys new to the table, H200), and on a table with a host
// tier the probe below cost 30 %: its hits read host rows in a launch of
// their own, the misses' inserts write them in the next, so the link's two
// directions never ran together. So where a repeat does not change what
// its first occurrence stores (lru, epoch_lru, custom without input
// scores), the keys of a large find_or_insert are deduplicated first: every
// key on a table with a host tier (dedupe_claim), the misses elsewhere
// (claimed in probe_keys); where a key repeats, dedupe_lead makes each
// key's first occurrence (the lowest index) the one that upsert_keys
// places, and dedupe_fill gives every repeat its answer. A batch without
// repeats pays for the cleared set and the claims only.

#define HKV_NO_LEAD 0xFFFFFFFFu

// Key i (a thread for it): finds or claims its key's slot of the
// open-addressed set `slots` (mask + 1 u32, at least 1.5 times the keys,
// all 0 before: a slot holds an occurrence's index + 1), lowers the slot's
// index to its own if smaller, leaves the slot in lead[i], and sets
// first[i] to whether it claimed the slot; an occurrence that finds its
// key claimed sets *repeats (so do the claims that an earlier occurrence
// then lowers: it finds the key).
__device__ __forceinline__ void hkv_dedupe_claim(const u64* keys, u64 i, u64 key, u32* slots, u64 mask, u32* lead,
                                                 u8* first, u32* repeats) {
    const u32 me = (u32)i + 1;
    u64 h = hkv_fmix64(key ^ 0x2545f4914f6cdd1dULL) & mask;
    bool claimed = false;
    for (;;) {
        u32 c = __ldcg(slots + h);
        if (c == 0) {
            c = atomicCAS(slots + h, 0u, me);
            if (c == 0) {
                claimed = true;
                break;
            }
        }
        // A claimed slot's index only ever moves to another occurrence of its key.
        if (__ldg(keys + c - 1) == key) {
            atomicMin(slots + h, me);
            *repeats = 1;
            break;
        }
        h = (h + 1) & mask;
    }
    lead[i] = (u32)h;
    first[i] = claimed;
}

// One thread per key: dedupe_claim's claim for each key that only (when
// given) flags; first[i] = 0 and lead[i] = HKV_NO_LEAD for the others.
extern "C" __global__ void dedupe_claim(const u64* keys, u64 n, const u8* only, u32* slots, u64 mask, u32* lead,
                                        u8* first, u32* repeats) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (only && !only[i]) {
        first[i] = 0;
        lead[i] = HKV_NO_LEAD;
        return;
    }
    hkv_dedupe_claim(keys, i, keys[i], slots, mask, lead, first, repeats);
}

// One thread per key, after the claims, where a key repeats (*repeats;
// else first[] is already right and nothing runs): first[i] = 1 where key
// i is its key's first occurrence (upsert_keys' only), else 0; lead[i]
// becomes the first occurrence's index for a repeat, HKV_NO_LEAD for the
// others.
extern "C" __global__ void dedupe_lead(u64 n, const u32* slots, u32* lead, u8* first, const u32* repeats) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || !*repeats || lead[i] == HKV_NO_LEAD) return;
    const u32 l = __ldcg(slots + lead[i]) - 1;
    first[i] = l == (u32)i;
    lead[i] = l == (u32)i ? HKV_NO_LEAD : l;
}

// One thread per key, after upsert_keys placed the first occurrences, where
// a key repeats (*repeats; most keys of a batch are no repeat, so a group
// per key cost more than the copies it shares): a repeat (lead[i] set)
// takes its first occurrence's row (values, where given: find_or_insert's
// rows out) and address (ptrs, where given), and the outcome updated
// (rejected where its first occurrence was: the same input against the
// same bucket), counted and sampled as upsert_keys counts and samples the
// keys it serves. The rows are copied by the whole warp, its repeats' rows
// one after another (a thread per row read 32 rows apart at once: dim 64
// ran at half dim 8's rate).
extern "C" __global__ void dedupe_fill(const u64* keys, u64 n, const u32* lead, float* values, u64 dim,
                                       u8* outcomes, u64* ptrs, u64* counters, HkvSample smp, const u32* repeats) {
    if (!*repeats) return;
    HKV_SAMPLE_INIT
    HKV_COUNTERS_INIT
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 j = i < n ? lead[i] : HKV_NO_LEAD;
    bool rep = j != HKV_NO_LEAD;
    if (smp.ring) hkv_sample_warp(smp, rep, rep ? keys[i] : 0, &hkv_seen);
    const int o = rep && outcomes[j] == HKV_REJECTED ? HKV_REJECTED : HKV_UPDATED;
    // A first occurrence is no repeat: no row this kernel reads is written in it.
    if (values) {
        HkvGroup<1> g;
        hkv_copy_rows_warp<1>(g, rep && o == HKV_UPDATED, values + i * dim, values + (u64)j * dim, (u32)dim);
    }
    if (rep) {
        outcomes[i] = (u8)o;
        if (ptrs) ptrs[i] = o == HKV_UPDATED ? ptrs[j] : 0;
        atomicAdd(hkv_cnt + HKV_C_UPDATED + o, 1ULL);
    }
    hkv_flush_counters(hkv_cnt, counters);
    hkv_flush_sample(smp, &hkv_seen);
}

// ---- find_or_insert of a large batch: the hits first, without locks ----------
// A batch whose keys repeat (Zipf traffic: the hottest key of a 1 Mi-key
// batch may come tens of thousands of times) serialised in upsert_one on
// its buckets' locks, one occurrence after another. So a large
// find_or_insert (above SEQUENTIAL_BATCH keys, whose order is unspecified)
// runs in two launches: probe_keys serves every key present when the batch
// starts with no lock (no other kernel of the table runs meanwhile: the
// batch holds the inserter group, and the probe is a launch of its own),
// copying its row out (find_or_insert*: its row's address) and refreshing
// its score as upsert_one would, and flags the others in `miss`; then
// upsert_keys runs with only = miss. A score whose new value does not
// depend on the old one is stored (the occurrences of a key in a batch
// store the same value); one that does (lfu, epoch-lfu) is updated with a
// compare-and-swap loop, so each occurrence counts.
template <int G>
__device__ __forceinline__ void probe_one(const HkvTable& t, const HkvScoring& sc, const u64* keys, u64 n,
                                          float* values, const u64* scores_in, const u8* only, u8* outcomes,
                                          u64* ptrs, u8* miss, u32* slots, u64 mask, u32* lead, u32* repeats,
                                          u64* cnt, const HkvSample& smp, u32* seen) {
    HkvGroup<G> g;
    u64 i = hkv_key_index(t, ((u64)blockIdx.x * blockDim.x + threadIdx.x) / G, n);
    bool active = i < n && !(only && !only[i]);
    u64 key = active ? keys[i] : 0;
    int s = -1;
    u64 b = 0;
    if (active) {
        u64 b1, b2;
        u8 d;
        hkv_locate(t, key, &b1, &b2, &d);
        b = b1;
        s = hkv_find_in<G, true>(t, g, b1, key, d);
        if (s < 0 && b2 != b1) {
            b = b2;
            s = hkv_find_in<G, true>(t, g, b2, key, d);
        }
    }
    // The sampler counts the hits here and upsert_keys the others: the
    // whole warp calls it, converged.
    __syncwarp();
    if (smp.ring) hkv_sample_warp(smp, active && s >= 0 && g.rank == 0, key, seen);
    // Every key of the launch gets its flag, 0 where `only` leaves it out,
    // so that the flags need no clearing (they are a lane's reused buffer).
    // Deduplicating (slots given), a miss is claimed (hkv_dedupe_claim):
    // its flag says whether it was the first to claim its key.
    if (!active || s < 0) {
        if (i < n && g.rank == 0) {
            if (slots && active) {
                hkv_dedupe_claim(keys, i, key, slots, mask, lead, miss, repeats);
            } else {
                miss[i] = (u8)active;
                if (slots) lead[i] = HKV_NO_LEAD;
            }
        }
        return;
    }
    u64 pos = b * 128 + s;
    float* row = hkv_row(t, pos);
    if (values) hkv_copy_row<G, true>(values + i * t.dim, row, t.dim, g.rank);
    if (g.rank == 0) {
        bool has = scores_in != 0;
        u64 in = has ? scores_in[i] : 0;
        if (hkv_needs_old(sc, has, false)) {
            u64 old = __ldcg(t.scores + pos);
            for (;;) {
                u64 seen_old = atomicCAS(t.scores + pos, old, hkv_on_upsert(sc, old, has, in));
                if (seen_old == old) break;
                old = seen_old;
            }
        } else {
            t.scores[pos] = hkv_on_upsert(sc, 0, has, in);
        }
        miss[i] = 0;
        if (slots) lead[i] = HKV_NO_LEAD;
        if (outcomes) outcomes[i] = HKV_UPDATED;
        if (ptrs) ptrs[i] = (u64)row;
        atomicAdd(cnt + HKV_C_UPDATED, 1ULL);
    }
}

// values: out (find_or_insert's rows of the hits), null for find_or_insert*;
// scores_in, only, outcomes and ptrs may be null; miss: n flags out, 1
// where key i is served and absent (upsert_keys' only), 0 elsewhere.
// slots (null: no deduplication), mask, lead and repeats: dedupe_claim's,
// for the misses (miss then flags the first to claim each key).
#define HKV_PROBE_KERNEL(NAME, G)                                                                                   \
    extern "C" __global__ void NAME(HkvTable t, HkvScoring sc, const u64* keys, u64 n, float* values,               \
                                    const u64* scores_in, const u8* only, u8* outcomes, u64* ptrs, u8* miss,        \
                                    u32* slots, u64 mask, u32* lead, u32* repeats, u64* counters, HkvSample smp) {  \
        HKV_SAMPLE_INIT                                                                                             \
        HKV_COUNTERS_INIT                                                                                           \
        probe_one<G>(t, sc, keys, n, values, scores_in, only, outcomes, ptrs, miss, slots, mask, lead, repeats,     \
                     hkv_cnt, smp, &hkv_seen);                                                                      \
        hkv_flush_counters(hkv_cnt, counters);                                                                      \
        hkv_flush_sample(smp, &hkv_seen);                                                                           \
    }

// probe_keys: 8 threads per key; the _gN variants: N.
HKV_PROBE_KERNEL(probe_keys, 8)
HKV_PROBE_KERNEL(probe_keys_g1, 1)
HKV_PROBE_KERNEL(probe_keys_g2, 2)
HKV_PROBE_KERNEL(probe_keys_g4, 4)
HKV_PROBE_KERNEL(probe_keys_g16, 16)
HKV_PROBE_KERNEL(probe_keys_g32, 32)

// Adaptive: counts keys[0..n] (where only, when given, is non-zero) in the
// sketch, each one access (hkv_sketch_count), before a writer batch's
// rounds. One thread per key.
extern "C" __global__ void adapt_count(HkvScoring sc, const u64* keys, u64 n, const u8* only) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || (only && !only[i])) return;
    hkv_sketch_count(sc, keys[i]);
}

// Adaptive: the accesses of a device batch that the window share's
// miniatures sample (minisim::sampled at divisor `rate`): key i, where
// only[i] and found[i] are set (each where non-null), whose hash falls on
// the divisor goes to out as the pair (i, key), at a place taken from the
// count in out[0] (pairs from out[1]). The host restores index order. One
// thread per key; reads the keys and flags, writes about n / rate pairs.
extern "C" __global__ void adapt_sample(const u64* keys, u64 n, const u8* only, const u8* found, u64 rate,
                                        u64* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || (only && !only[i]) || (found && !found[i])) return;
    u64 key = keys[i];
    if (rate > 1 && ((hkv_fmix64(key ^ 0x5bd1e995ULL) >> 20) % rate) != 0) return;
    u64 j = atomicAdd(reinterpret_cast<unsigned long long*>(out), 1ULL);
    out[1 + 2 * j] = i;
    out[2 + 2 * j] = key;
}

// Adaptive: after a writer batch, the find hits of the entries it evicted
// (sc.folds: a count, then (key, hits) pairs) into their keys' sketch
// counters, saturating at 15 (Adapt::fold; order-free). One thread per
// pair of room for `room`.
extern "C" __global__ void adapt_fold(HkvScoring sc, u64 room) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= room || i >= sc.folds[0]) return;
    u64 key = sc.folds[1 + 2 * i], hits = sc.folds[2 + 2 * i];
    u32 sh[4];
    unsigned long long* p = reinterpret_cast<unsigned long long*>(sc.sketch) + hkv_sketch_word(key, sc.sketch_lines, sh);
    u64 old = __ldcg(reinterpret_cast<const u64*>(p));
    for (;;) {
        u64 nw = old;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            u64 c = ((old >> sh[r]) & 15) + hits;
            nw = (nw & ~(15ULL << sh[r])) | ((c < 15 ? c : 15) << sh[r]);
        }
        if (nw == old) return;
        u64 seen = atomicCAS(p, old, nw);
        if (seen == old) return;
        old = seen;
    }
}

// Adaptive: halves every sketch counter (TinyLFU's reset, Adapt::age) and
// the find hits every occupied slot's score counted (adapt::halve_hits).
// One thread per 4-byte word (8 counters) of the sketch's sketch_lines * 64
// bytes and per slot of the table, whichever are more.
extern "C" __global__ void adapt_halve(HkvScoring sc, HkvTable t) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < sc.sketch_lines * 16) {
        u32* w = reinterpret_cast<u32*>(sc.sketch) + i;
        *w = (*w >> 1) & 0x77777777u;
    }
    if (i < t.nbuckets * 128 && t.keys[i] != HKV_EMPTY_KEY) {
        u64 v = t.scores[i];
        t.scores[i] = (v & ~HKV_ADAPTIVE_HITS) | ((v & HKV_ADAPTIVE_HITS) >> 1);
    }
}
