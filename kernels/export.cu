// export family: export_batch(_if) over slot positions [offset, end),
// compacted on the GPU in slot order: count per bucket (one warp each), an
// exclusive scan of the counts (one block), then each bucket's warp writes
// its matches at its offset. Reader group.

__device__ __forceinline__ u32 export_mask(const HkvTable& t, u64 b, u32 lane, u64 offset, u64 end,
                                           const HkvFilter& f) {
    u32 m = 0;
    for (int j = 0; j < 4; ++j) {
        u64 pos = b * 128 + lane * 4 + j;
        if (pos < offset || pos >= end) continue;
        u64 k = __ldg(t.keys + pos);
        if (k != HKV_EMPTY_KEY && hkv_matches(f, k, __ldg(t.scores + pos))) m |= 1u << j;
    }
    return m;
}

// counts[b - offset / 128] = matching entries of bucket b.
extern "C" __global__ void export_count(HkvTable t, u64 offset, u64 end, HkvFilter f, u32* counts) {
    u64 first = offset / 128;
    u64 b = first + ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x & 31;
    if (b * 128 >= end) return;
    u32 c = __popc(export_mask(t, b, lane, offset, end, f));
    for (int off = 16; off > 0; off >>= 1) c += __shfl_xor_sync(0xffffffffu, c, off);
    if (lane == 0) counts[b - first] = c;
}

// offsets[i] = sum of counts[0..i), offsets[n] = total. One block of 1024 threads.
extern "C" __global__ void export_scan(const u32* counts, u64 n, u64* offsets) {
    u64 total = hkv_block_scan(counts, n, offsets);
    if (threadIdx.x == 1023) offsets[n] = total;
}

// Keys and scores are written by the lane that found them; the values of
// the warp's matches are then copied by the whole warp, row after row in
// output order, so that each read covers whole lines of the (mostly
// adjacent) source rows. Blocks of 256 threads.
extern "C" __global__ void export_write(HkvTable t, u64 offset, u64 end, HkvFilter f, const u64* offsets,
                                       u64* keys_out, float* values_out, u64* scores_out) {
    __shared__ u64 rows[8][128];
    u64 first = offset / 128;
    u64 b = first + ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    if (b * 128 >= end) return;
    u32 m = export_mask(t, b, lane, offset, end, f);
    u32 c = __popc(m), incl = c;
    for (int off = 1; off < 32; off <<= 1) {
        u32 v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= (u32)off) incl += v;
    }
    u32 total = __shfl_sync(0xffffffffu, incl, 31);
    u64 base = offsets[b - first];
    u32 local = incl - c;
    while (m) {
        int j = __ffs(m) - 1;
        m &= m - 1;
        u64 pos = b * 128 + lane * 4 + j;
        keys_out[base + local] = __ldg(t.keys + pos);
        scores_out[base + local] = __ldg(t.scores + pos);
        rows[warp][local] = pos;
        local++;
    }
    if (!values_out || total == 0) return;
    __syncwarp();
    u32 dim = t.dim;
    if ((dim & 3) == 0) {
        u32 n4 = dim / 4;
        u64 all = (u64)total * n4;
        float4* o = reinterpret_cast<float4*>(values_out + base * dim);
        for (u64 e = lane; e < all; e += 32) {
            u32 r = (u32)(e / n4), k = (u32)(e % n4);
            o[e] = __ldg(reinterpret_cast<const float4*>(hkv_row(t, rows[warp][r])) + k);
        }
    } else {
        u64 all = (u64)total * dim;
        float* o = values_out + base * dim;
        for (u64 e = lane; e < all; e += 32) {
            u32 r = (u32)(e / dim), k = (u32)(e % dim);
            o[e] = __ldg(hkv_row(t, rows[warp][r]) + k);
        }
    }
}
