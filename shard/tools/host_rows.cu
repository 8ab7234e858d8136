// How fast the device reaches rows of mapped, pinned host memory, by how
// far the rows are spread and in what order they come. Each figure: one
// kernel moving 512 Ki rows of 256 bytes (16 threads per row, 16 bytes
// each) between the host buffer and device memory, best of 5, GB/s.
// Build and run on a GPU host: nvcc -O3 -arch=sm_90 -o host_rows host_rows.cu -lcuda && ./host_rows [MODE]
// (needs 16 GiB of pinned host memory). MODE: hostalloc (cudaHostAlloc,
// what the table uses; the default), register (mmap + cudaHostRegister) or
// register-thp (the same with 2 MiB transparent huge pages asked for) or
// vmm (host NUMA memory from cuMemCreate, mapped for the device at the
// allocation granularity; build with -lcuda). The table's host tier is laid out
// and read the same way (shard/BENCHMARKS.md, "The host tier").
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <vector>

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e = (x);                                                         \
        if (e != cudaSuccess) {                                                      \
            printf("%s: %s\n", #x, cudaGetErrorString(e));                           \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)
#define CU(x)                                                                        \
    do {                                                                             \
        CUresult e = (x);                                                            \
        if (e != CUDA_SUCCESS) {                                                     \
            const char* m = 0;                                                       \
            cuGetErrorString(e, &m);                                                 \
            printf("%s: %s\n", #x, m ? m : "?");                                     \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)
typedef unsigned long long u64;

__global__ void gather(const float4* src, const u64* idx, float4* dst, u64 n, int n4) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * n4) return;
    dst[t] = src[idx[t / n4] * n4 + t % n4];
}

__global__ void scatter(float4* dst, const u64* idx, const float4* src, u64 n, int n4) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * n4) return;
    dst[idx[t / n4] * n4 + t % n4] = src[t];
}

// Row indices below `rows`: random, then sorted by index >> shift (shift
// -1: left random; 0: fully sorted; 64: sequential instead).
static void make_rows(std::vector<u64>& idx, u64 rows, int shift) {
    for (u64 i = 0; i < idx.size(); ++i) idx[i] = shift == 64 ? i % rows : (((u64)rand() << 31) ^ rand()) % rows;
    if (shift >= 0 && shift < 64)
        std::sort(idx.begin(), idx.end(), [shift](u64 a, u64 b) { return (a >> shift) < (b >> shift); });
}

int main(int argc, char** argv) {
    const char* mode = argc > 1 ? argv[1] : "hostalloc";
    bool reg = strncmp(mode, "register", 8) == 0, thp = strcmp(mode, "register-thp") == 0;
    bool vmm = strcmp(mode, "vmm") == 0;
    if (!reg && !vmm && strcmp(mode, "hostalloc") != 0) {
        printf("unknown mode %s: hostalloc, register, register-thp or vmm\n", mode);
        return 2;
    }
    const int dim = 64, n4 = dim / 4;
    const u64 n = 1 << 19;
    float* dout;
    u64* didx;
    CK(cudaMalloc(&dout, n * dim * 4));
    CK(cudaMalloc(&didx, n * 8));
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    srand(7);
    struct Order {
        const char* name;
        int shift;  // in rows of 256 bytes
    };
    const Order orders[] = {{"random", -1}, {"sequential", 64}, {"sorted", 0},   {"by 2 MiB", 13},
                            {"by 64 MiB", 18}, {"by 1 GiB", 22}};
    const double sizes[] = {0.25, 1, 4, 16};
    std::vector<u64> idx(n);
    printf("%s\n%-10s %-11s %-6s %9s\n", mode, "spread", "order", "dir", "GB/s");
    for (double gib : sizes) {
        u64 bytes = (u64)(gib * (1ull << 30));
        void* h = 0;
        float* dh = 0;
        CUmemGenericAllocationHandle handle = 0;
        CUdeviceptr vp = 0;
        if (vmm) {
            CK(cudaFree(0));
            int dev = 0, numa = 0;
            cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev);
            CUmemAllocationProp prop = {};
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
            prop.location.id = numa < 0 ? 0 : numa;
            size_t gran = 0;
            CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
            printf("vmm: host NUMA node %d, granularity %zu\n", prop.location.id, gran);
            CU(cuMemCreate(&handle, bytes, &prop, 0));
            CU(cuMemAddressReserve(&vp, bytes, 1 << 30, 0, 0));
            CU(cuMemMap(vp, bytes, 0, handle, 0));
            CUmemAccessDesc desc = {};
            desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = dev;
            desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            CU(cuMemSetAccess(vp, bytes, &desc, 1));
            CU(cuMemsetD8(vp, 0, bytes));
            dh = (float*)vp;
        } else if (reg) {
            h = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (h == MAP_FAILED) return 1;
            if (thp) madvise(h, bytes, MADV_HUGEPAGE);
            memset(h, 0, bytes);
            CK(cudaHostRegister(h, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
        } else {
            CK(cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
            memset(h, 0, bytes);
        }
        if (!vmm) CK(cudaHostGetDevicePointer((void**)&dh, h, 0));
        u64 rows = bytes / (dim * 4);
        for (const Order& o : orders) {
            if (gib < 16 && o.shift >= 0 && o.shift < 64) continue;  // orders only matter when spread wide
            make_rows(idx, rows, o.shift);
            CK(cudaMemcpy(didx, idx.data(), n * 8, cudaMemcpyHostToDevice));
            for (int write = 0; write < 2; ++write) {
                float best = 1e9;
                for (int rep = 0; rep < 5; ++rep) {
                    cudaEventRecord(a);
                    if (write) scatter<<<(n * n4 + 255) / 256, 256>>>((float4*)dh, didx, (const float4*)dout, n, n4);
                    else gather<<<(n * n4 + 255) / 256, 256>>>((const float4*)dh, didx, (float4*)dout, n, n4);
                    cudaEventRecord(b);
                    CK(cudaEventSynchronize(b));
                    float ms;
                    cudaEventElapsedTime(&ms, a, b);
                    best = std::min(best, ms);
                }
                printf("%5.2f GiB  %-11s %-6s %9.2f\n", gib, o.name, write ? "write" : "read", n * dim * 4 / best / 1e6);
            }
        }
        if (vmm) {
            CU(cuMemUnmap(vp, bytes));
            CU(cuMemAddressFree(vp, bytes));
            CU(cuMemRelease(handle));
        } else if (reg) {
            CK(cudaHostUnregister(h));
            munmap(h, bytes);
        } else {
            CK(cudaFreeHost(h));
        }
    }
    return 0;
}
