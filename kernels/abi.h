// The ABI between the Rust host (hkv-shard) and the kernels, kept in one
// list: every code and constant both sides use, every struct a kernel takes
// by value, and that struct's size and the offset of each of its fields.
//
// Both sides check themselves against this file:
// - CUDA: it is prepended to every module's source (before common.cuh), so
//   the static_asserts at its end run when NVRTC compiles the modules, as a
//   device opens: a struct that does not match the list stops the kernels
//   from loading, before any kernel runs.
// - Rust: hkv-kernels' build.rs reads this file (kernels/src/list.rs) and
//   makes each `#define HKV_*` a const of `hkv_kernels::abi` (no suffix:
//   u32; ULL: u64), and HKV_ABI_LAYOUT the macro
//   `hkv_kernels::assert_abi_layout!`, whose const asserts of size_of and
//   offset_of! hkv-shard runs on the #[repr(C)] twins of these structs
//   (shard/src/cuda/table/layout.rs): a mismatch fails `cargo build`.
// Codes are not copied: C uses the names below, Rust the consts of the
// same names; where Rust has its own enum (Outcome, Lost, mrc::Kind), a
// const assert ties each discriminant to its code here
// (shard/src/cuda/table/abi.rs).
//
// The format, which build.rs refuses to read otherwise: a code is one line
// `#define HKV_NAME <decimal or 0x hex literal>` (suffix ULL for a u64; an
// unsuffixed value must fit a C int). A struct's layout is one line
// `SIZE(Struct, bytes)` in HKV_ABI_LAYOUT, then one `AT(Struct, field,
// offset)` per field, in the field order.
//
// To add a code (say a score policy HKV_ADAPTIVE 5): one #define here, then
// use the name in the kernels and `hkv_kernels::abi::HKV_ADAPTIVE` in Rust
// (policy_code in shard/src/cuda/table/abi.rs). To add or change a field:
// change the struct here, its SIZE / AT lines, and its Rust twin in
// layout.rs; a new struct also gets a `Struct => RustType` in the
// assert_abi_layout! call there.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

// ---- codes and constants -------------------------------------------------------

// Slots per bucket (shard::BUCKET_SLOTS; the kernels' literal 128s).
#define HKV_BUCKET_SLOTS 128ULL
// The key of a free slot (shard::EMPTY_KEY).
#define HKV_EMPTY_KEY 0xFFFFFFFFFFFFFFFFULL
// The second bucket's seed in dual mode (shard::hash::DUAL_SEED).
#define HKV_DUAL_SEED 0x9e3779b97f4a7c15ULL
// The seed of a key's shard in a group (shard::hash::SHARD_SEED).
#define HKV_SHARD_SEED 0xd6e8feb86659fd93ULL

// HkvScoring::policy, in the order of ScorePolicy (policy_code).
#define HKV_LRU 0
#define HKV_LFU 1
#define HKV_EPOCH_LRU 2
#define HKV_EPOCH_LFU 3
#define HKV_CUSTOM 4
// The adaptive policy (table.cuh, "adaptive policy"; shard/src/cpu/adapt.rs).
#define HKV_ADAPTIVE 5
// Adaptive: the most of a bucket's main tier that is protected, in tenths (adapt::PROTECTED_TENTHS).
#define HKV_ADAPT_PROTECTED_TENTHS 8
// Adaptive: how much more frequent than the victim a window candidate must be to join the main tier (adapt::ADMIT_MARGIN).
#define HKV_ADAPT_ADMIT_MARGIN 1

// Lfu with LRU ties: the stamp's bits below the frequency (score::LFU_STAMP_BITS).
#define HKV_LFU_STAMP_BITS 40

// A key's outcome byte (shard::Outcome).
#define HKV_UPDATED 0
#define HKV_INSERTED 1
#define HKV_EVICTED 2
#define HKV_REJECTED 3
#define HKV_ABSENT 4

// Per-batch counters: indices into a launch's u64 counters.
#define HKV_C_HITS 0
#define HKV_C_UPDATED 1
#define HKV_C_INSERTED 2
#define HKV_C_EVICTED 3
#define HKV_C_REJECTED 4
#define HKV_C_ABSENT 5
#define HKV_C_LOST 6
#define HKV_C_ERASED 7
#define HKV_NCOUNTERS 8

// HkvScoring::verbatim: scores by the policy's rules; as given (a load, a
// rehash); or as given, and a key whose candidate buckets stay full after
// relocation (upsert.cu) is left out, with outcome HKV_ABSENT, for a later
// launch to place (CudaTable's load in passes) instead of evicting.
#define HKV_SCORES_POLICY 0
#define HKV_SCORES_VERBATIM 1
#define HKV_SCORES_DEFER 2

// upsert_keys' mode (upsert.cu).
#define HKV_UP_INSERT 0
#define HKV_UP_FIND_OR_INSERT 1
#define HKV_UP_ACCUM 2
#define HKV_UP_FIND_OR_INSERT_PTR 3

// update_keys' mode (update.cu).
#define HKV_UPD_ASSIGN 0
#define HKV_UPD_SCORES 1
#define HKV_UPD_ACCUM 2

// step_keys' optimizer (update.cu; shard::optim::Optimizer, optimizer_code).
#define HKV_OPT_SGD 0
#define HKV_OPT_ADAGRAD 1
#define HKV_OPT_ROWWISE_ADAGRAD 2
#define HKV_OPT_ADAM 3

// insert_and_evict's lost kind byte (shard::Lost).
#define HKV_LOST_EVICTED 0
#define HKV_LOST_REJECTED 1

// features_int64 / features_strings' kind (features::HashKind).
#define HKV_HASH_FINGERPRINT64 0
#define HKV_HASH_SIPHASH 1

// A sample tag's kind, its low 2 bits (mrc::Kind); kinds up to
// HKV_TAG_FIND_OR_INSERT are lookups.
#define HKV_TAG_LOOKUP 0
#define HKV_TAG_FIND_OR_INSERT 1
#define HKV_TAG_WRITE 2
#define HKV_TAG_UPDATE 3
// A lookup's answer in its tag (mrc::OUTCOME_KNOWN, mrc::OUTCOME_HIT): bit 2
// set by the lookup kernels, bit 3 where the key was found.
#define HKV_TAG_OUTCOME_KNOWN 4
#define HKV_TAG_OUTCOME_HIT 8

// Route kernels: the most shards of a group (at least cuda::MAX_GPUS) and
// the keys of a tile (group::node::TILE).
#define HKV_ROUTE_MAX 8
#define HKV_TILE 1024

// ---- structs the kernels take by value ------------------------------------------

// The table's device state (table.cuh).
struct HkvTable {
    u8* digests;       // nbuckets * 128
    u64* keys;         // nbuckets * 128
    u64* scores;       // nbuckets * 128
    int* sizes;        // nbuckets: occupied slots
    int* locks;        // nbuckets: writer spin locks
    float* fast;       // values of positions < fast_slots, dim floats each
    float** slices;    // host-tier slices (device-mapped pointers)
    u64 fast_slots;
    u64 nbuckets;
    u32 slice_shift;   // slots per host slice = 1 << slice_shift
    u32 dim;
    u32 dual;
    u32 pad;
    const u32* order;  // per launch: thread slot j serves key order[j] (null: key j)
};

// How written keys are scored.
struct HkvScoring {
    u64 now_ns;
    u32 policy;    // HKV_LRU ...
    u32 epoch;
    u32 verbatim;  // HKV_SCORES_POLICY, _VERBATIM or _DEFER
    u32 lfu_lru;   // Lfu: 1 = frequency << 40 | stamp (LfuTies::Lru), 0 = plain frequency
    u32 refresh;   // lookups: a hit's score becomes what a write without input gives it (reads_refresh)
    u32 window;    // adaptive: every bucket's window share for this batch, 1..127 slots (adapt::Window)
    u8* sketch;    // adaptive: the frequency sketch, sketch_lines lines of 64 bytes (8 words of 16 4-bit counters; else null)
    u64 sketch_lines;  // a power of two
    u64* folds;    // adaptive writer batches: count, then (key, hits) pairs of the entries evicted with find hits (else null)
};

// A key and score predicate (shard::Filter).
struct HkvFilter {
    u64 key_mask;
    u64 key_pattern;
    u64 min_score;
    u64 max_score;
};

// A launch's miss-ratio sampler (table.cuh, "miss-ratio sampling"); ring
// null: sampling off.
struct HkvSample {
    u64* ring;       // cap keys
    u64* counters;   // 2: slots claimed, accesses
    u64 cap;
    u64 seed;
    u64 threshold;
    u8* tags;        // cap tag bytes, one beside each key slot
    u64 tag;         // this batch's tag (mrc::tag): kind in bits 0-1, batch sequence in 2-7
};

// One optimizer step (step_keys in update.cu; shard::optim::Step): a row
// holds `dim` values, then the optimizer's state (optim.rs's table).
struct HkvStep {
    u32 optimizer;     // HKV_OPT_SGD ...
    u32 dim;           // values per row: the gradients' width
    float lr;
    float eps;
    float beta1;
    float beta2;
    float weight_decay;
    float step_size;   // Adam: lr / (1 - beta1^t), as the host computes it
    float bias2_sqrt;  // Adam: sqrt(1 - beta2^t), as the host computes it
    u32 pad;
};

// ---- the layout list, and its asserts ------------------------------------------

#define HKV_ABI_LAYOUT(SIZE, AT)      \
    SIZE(HkvTable, 96)                \
    AT(HkvTable, digests, 0)          \
    AT(HkvTable, keys, 8)             \
    AT(HkvTable, scores, 16)          \
    AT(HkvTable, sizes, 24)           \
    AT(HkvTable, locks, 32)           \
    AT(HkvTable, fast, 40)            \
    AT(HkvTable, slices, 48)          \
    AT(HkvTable, fast_slots, 56)      \
    AT(HkvTable, nbuckets, 64)        \
    AT(HkvTable, slice_shift, 72)     \
    AT(HkvTable, dim, 76)             \
    AT(HkvTable, dual, 80)            \
    AT(HkvTable, pad, 84)             \
    AT(HkvTable, order, 88)           \
    SIZE(HkvScoring, 56)              \
    AT(HkvScoring, now_ns, 0)         \
    AT(HkvScoring, policy, 8)         \
    AT(HkvScoring, epoch, 12)         \
    AT(HkvScoring, verbatim, 16)      \
    AT(HkvScoring, lfu_lru, 20)       \
    AT(HkvScoring, refresh, 24)       \
    AT(HkvScoring, window, 28)        \
    AT(HkvScoring, sketch, 32)        \
    AT(HkvScoring, sketch_lines, 40)  \
    AT(HkvScoring, folds, 48)         \
    SIZE(HkvFilter, 32)               \
    AT(HkvFilter, key_mask, 0)        \
    AT(HkvFilter, key_pattern, 8)     \
    AT(HkvFilter, min_score, 16)      \
    AT(HkvFilter, max_score, 24)      \
    SIZE(HkvSample, 56)               \
    AT(HkvSample, ring, 0)            \
    AT(HkvSample, counters, 8)        \
    AT(HkvSample, cap, 16)            \
    AT(HkvSample, seed, 24)           \
    AT(HkvSample, threshold, 32)      \
    AT(HkvSample, tags, 40)           \
    AT(HkvSample, tag, 48)            \
    SIZE(HkvStep, 40)                 \
    AT(HkvStep, optimizer, 0)         \
    AT(HkvStep, dim, 4)               \
    AT(HkvStep, lr, 8)                \
    AT(HkvStep, eps, 12)              \
    AT(HkvStep, beta1, 16)            \
    AT(HkvStep, beta2, 20)            \
    AT(HkvStep, weight_decay, 24)     \
    AT(HkvStep, step_size, 28)        \
    AT(HkvStep, bias2_sqrt, 32)       \
    AT(HkvStep, pad, 36)

// offsetof without <cstddef>, which NVRTC does not have. NVRTC has
// __builtin_offsetof from 13.4 on; before, its EDG front end's __INTADDR__
// turns the address of a member of a null object into a constant (the
// fallback NVIDIA's libcu++ uses for NVRTC). The host compiler of the tests
// (kernels/tests/abi.rs) takes the second branch.
#if defined(__CUDACC_RTC__) && (__CUDACC_VER_MAJOR__ < 13 || (__CUDACC_VER_MAJOR__ == 13 && __CUDACC_VER_MINOR__ < 4))
#define HKV_OFFSETOF(T, f) ((u64)__INTADDR__(&(((T*)0)->f)))
#else
#define HKV_OFFSETOF(T, f) __builtin_offsetof(T, f)
#endif

#define HKV_ABI_SIZE(T, n) static_assert(sizeof(T) == n, "sizeof(" #T ") is not the " #n " of kernels/abi.h");
#define HKV_ABI_AT(T, f, o) \
    static_assert(HKV_OFFSETOF(T, f) == o, #T "." #f " is not at the offset " #o " of kernels/abi.h");
HKV_ABI_LAYOUT(HKV_ABI_SIZE, HKV_ABI_AT)
