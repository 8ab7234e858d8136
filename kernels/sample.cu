// sample family: the miss-ratio curves' sampling filter (shard/src/mrc.rs,
// issue 27). For a batch of keys already on the device, keeps each key whose
// sample hash is below the threshold and appends it to the shard's ring.
//
// The ring (shard/src/cuda/table/sampling.rs): `cap` keys and two counters,
// counters[0] = keys appended (claimed slots) since the last drain,
// counters[1] = accesses (keys filtered) since the last drain. A block
// claims the slots of its sampled keys with one atomicAdd on counters[0] and
// writes a key only where its slot is below `cap`; the claims past `cap` are
// the dropped keys (counters[0] - cap). The host drains the ring only while
// no batch of the table runs (under the inserter lock group), reads
// counters[0] and slots [0, min(counters[0], cap)), and zeroes both counters,
// so the slots restart at 0: no tail, no wrap-around.
//
// Thread mapping: blocks of 1024 threads, one key per thread, in runs of
// 1024 consecutive keys (grid-stride). Within a run, keys keep index order
// (a block-wide exclusive scan of the warps' ballots); the runs take their
// slots in the order the device runs them, so a launch of one block (the
// host's choice for batches up to 4096 keys) appends in index order.
// Memory traffic per key: one 8-byte read (and `only`'s byte where given),
// one 8-byte write per sampled key; two atomics per run of 1024 keys.

// hkv_sample_hash (common.cuh) is mrc::sample_hash, bit for bit (checked
// against mrc::SAMPLE_HASH_VECTORS by tests/cuda.rs). The lookup kernels run
// the same filter fused (hkv_sample_warp in table.cuh).

// keys[0..n] (only those with only[i] != 0 where `only` is non-null) are
// counted in counters[1]; the ones with hkv_sample_hash(key, seed) <
// threshold are appended to ring[0..cap) at counters[0]. blockDim.x = 1024.
extern "C" __global__ void sample_keys(const u64* keys, u64 n, const u8* only, u64 seed, u64 threshold, u64* ring,
                                       u64 cap, u64* counters) {
    __shared__ u32 before[32];
    __shared__ u32 live_in[32];
    __shared__ u64 base;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 start = (u64)blockIdx.x * blockDim.x; start < n; start += stride) {
        u64 i = start + threadIdx.x;
        bool live = i < n && (only == 0 || only[i] != 0);
        u64 k = live ? keys[i] : 0;
        bool take = live && hkv_sample_hash(k, seed) < threshold;
        u32 taken = __ballot_sync(0xffffffffu, take);
        u32 lives = __ballot_sync(0xffffffffu, live);
        if (lane == 0) {
            before[warp] = __popc(taken);
            live_in[warp] = __popc(lives);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 total = 0, accessed = 0;
            for (u32 w = 0; w < warps; ++w) {
                u32 c = before[w];
                before[w] = total;
                total += c;
                accessed += live_in[w];
            }
            base = total ? atomicAdd(counters, (u64)total) : 0;
            if (accessed) atomicAdd(counters + 1, (u64)accessed);
        }
        __syncthreads();
        if (take) {
            u64 slot = base + before[warp] + __popc(taken & ((1u << lane) - 1));
            if (slot < cap) ring[slot] = k;
        }
        __syncthreads();  // before[] and base are rewritten by the next run
    }
}
