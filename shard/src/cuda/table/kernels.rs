//! Which kernel variant (threads per key) serves a batch: the choice
//! measured fastest on the H200 and the tuning that overrides it.

use super::*;

/// Threads per key forced by a tuning, when it names one of `built`.
pub(super) fn group_size(forced: Option<u32>, built: &[u64]) -> Option<u64> {
    forced.map(u64::from).filter(|g| built.contains(g))
}

/// Threads per key the lookup kernels are built for, and the writer
/// (upsert, update) kernels.
pub(super) const LOOKUP_GROUPS: [u64; 6] = [1, 2, 4, 8, 16, 32];

pub(super) const WRITE_GROUPS: [u64; 6] = [1, 2, 4, 8, 16, 32];

/// The kernel variant with `g` threads per key (`base` itself is the 8-thread one).
pub(super) fn kernel_name(base: &str, g: u64) -> String {
    if g == 8 {
        base.to_string()
    } else {
        format!("{base}_g{g}")
    }
}

pub(super) struct Funcs {
    /// Lookup kernels with 1 to 32 threads per key ([`LOOKUP_GROUPS`]) (see [`Funcs::lookup`]).
    pub(super) lookup: Vec<Variant>,
    /// The same for find_at (`lookup_at`: rows to given output rows).
    pub(super) lookup_at: Vec<Variant>,
    /// The same writing misses as zero rows (`lookup_findz`).
    pub(super) lookup_zero: Vec<Variant>,
    /// `lookup` and `lookup_zero` of a table whose reads refresh
    /// (`lookup_findr`, `lookup_findzr`), the only ones with the refresh's
    /// code.
    pub(super) lookup_refresh: Vec<Variant>,
    pub(super) lookup_zero_refresh: Vec<Variant>,
    /// Upsert and update kernels with 1 to 32 threads per key ([`WRITE_GROUPS`])
    /// (see [`Funcs::upsert`], [`Funcs::update`]).
    pub(super) upsert: Vec<Variant>,
    /// The upsert kernels of adaptive tables (`upsert_keys_a`), the only
    /// ones with the window rule's code.
    pub(super) upsert_adaptive: Vec<Variant>,
    /// The upsert kernels of verbatim writes (`upsert_keys_v`: loads and
    /// rehashes of every policy), the only ones that relocate.
    pub(super) upsert_verbatim: Vec<Variant>,
    pub(super) update: Vec<Variant>,
    /// The 2-thread update kernel held to 48 registers (`update_keys_g2_b5`).
    pub(super) update_bounded: Variant,
    /// The lock-free first launch of a large find_or_insert with 1 to 32
    /// threads per key ([`LOOKUP_GROUPS`]) (see [`Funcs::probe`]).
    pub(super) probe: Vec<Variant>,
    /// Optimizer step kernels with 1 to 32 threads per key ([`WRITE_GROUPS`]) (see [`Funcs::step`]).
    pub(super) step: Vec<Variant>,
    /// The 4-thread upsert kernel without lost outputs, held to 48
    /// registers (`upsert_keys_g4_b5`), and the adaptive tables' one.
    pub(super) upsert_bounded: Variant,
    pub(super) upsert_adaptive_bounded: Variant,
    /// Threads per key forced by the [`CudaTuning`] (the process's, or
    /// [`CudaTable::set_tuning`]) instead of the choice below.
    pub(super) forced_lookup: Option<u64>,
    pub(super) forced_write: Option<u64>,
    /// Key order by bucket region for value-copying launches on a table
    /// with a host tier ([`CudaTable::key_order`]); off with
    /// [`CudaTuning::index_order`].
    pub(super) region_order: bool,
    pub(super) order_count: CudaFunction,
    /// Reserved-key scan of keys the table did not check on the host
    /// ([`CudaTable::run_ipc`]).
    pub(super) keys_reserved: CudaFunction,
    pub(super) keys_gate: CudaFunction,
    /// The keys of one shard of a batch that every shard reads in place
    /// ([`CudaTable::run_ipc`] with a part).
    pub(super) shard_mask: CudaFunction,
    pub(super) order_write: CudaFunction,
    pub(super) erase: CudaFunction,
    pub(super) erase_if: CudaFunction,
    pub(super) clear: CudaFunction,
    pub(super) ex_count: CudaFunction,
    pub(super) ex_scan: CudaFunction,
    pub(super) ex_write: CudaFunction,
    /// Adaptive: a writer batch's keys into the sketch, a device batch's
    /// sampled accesses, the sketch's halving, and the find hits of a
    /// writer batch's evicted entries into the sketch (`super::adapt`).
    pub(super) adapt_count: CudaFunction,
    pub(super) adapt_sample: CudaFunction,
    pub(super) adapt_halve: CudaFunction,
    pub(super) adapt_fold: CudaFunction,
    /// A large find_or_insert's keys placed once ([`CudaTable::k_find_or_insert`]).
    pub(super) dedupe_claim: CudaFunction,
    pub(super) dedupe_lead: CudaFunction,
    pub(super) dedupe_fill: CudaFunction,
    /// apply_gradients summing a batch's repeated keys ([`CudaTable::k_sum`]).
    pub(super) sum_count: CudaFunction,
    pub(super) sum_add: CudaFunction,
    pub(super) sum_out: CudaFunction,
}

/// A kernel and the threads it gives each key.
#[derive(Clone)]
pub(super) struct Variant {
    pub(super) f: CudaFunction,
    pub(super) g: u64,
}

/// Load factor from which inserts take at least 2 threads per key: a nearly
/// full table's inserts scan 128 scores, which several threads do faster
/// (BENCHMARKS.md, "Kernel choice").
pub(super) const WRITER_PAIR_FROM: f64 = 0.875;

/// Fewest threads per key of an adaptive table's writes without lost
/// outputs (not in region order): the 4-thread adaptive kernel held to 48
/// registers (`upsert_keys_a_g4_b5`) ran them faster than the 1 or 2
/// threads chosen by the row's width. On the H200, 32 Mi slots, dim 32,
/// two rounds, B-KV/s at λ 0.5 / 1.0: insert_or_assign 1.17 / 0.53 with 2
/// threads, 1.46 / 0.53 with 4, 0.81 / 0.39 with 8; find_or_insert 1.51 /
/// 0.56, 1.81-1.83 / 0.80, 1.04 / 0.55. insert_and_evict (lost outputs:
/// the 4-thread kernel without the bound, 224 bytes of stack) was slower
/// on 4 at λ 0.5-0.75 and keeps the width's choice (shard/BENCHMARKS.md,
/// "Adaptive writes: four threads a key, full buckets' scans").
pub(super) const ADAPTIVE_WRITE_MIN: u64 = 4;

/// Widest row for which assign and accumulate take `update_keys_g2_b5` (48
/// registers: 5 blocks per SM): faster up to dim 32, slower at 64
/// (BENCHMARKS.md, "Kernel choice").
pub(super) const BOUNDED_UPDATE_DIM: usize = 32;

/// Threads per key of lookups and writes that copy rows of a table with a
/// host tier (batches in region order): fewer keys in flight keep the host
/// rows copied at one time close together (BENCHMARKS.md, "Kernel choice").
pub(super) const HOST_TIER_LOOKUP: u64 = 16;

pub(super) const HOST_TIER_WRITE: u64 = 8;

/// Threads per key so that each copies at most 8 16-byte pieces of a row
/// of `dim` floats (copies under a bucket lock wait once per 4 pieces).
pub(super) fn copy_threads(dim: usize) -> u64 {
    (dim.div_ceil(32) as u64).next_power_of_two()
}

/// Threads per key of an upsert that copies rows of `dim` floats: one per
/// 16 floats, measured fastest (BENCHMARKS.md, "Kernel choice").
pub(super) fn upsert_copy_threads(dim: usize) -> u64 {
    (dim.div_ceil(16) as u64).next_power_of_two()
}

/// The variant of `vs` with the fewest threads per key, at least `g`.
pub(super) fn pick(vs: &[Variant], g: u64) -> &Variant {
    vs.iter().find(|v| v.g >= g).unwrap_or(&vs[vs.len() - 1])
}

impl Funcs {
    /// The lookup kernel for a batch of rows of `dim` floats: 1 thread per
    /// key when no values are copied out (contains, find*), else 2, or one
    /// per 16 floats of a wide row; 16 for a batch in region order
    /// (`ordered`, a table with a host tier). `at`: the find_at kernel;
    /// `zero`: the kernel that writes misses as zero rows.
    pub(super) fn lookup(
        &self,
        values: bool,
        dim: usize,
        ordered: bool,
        at: bool,
        zero: bool,
        refresh: bool,
    ) -> &Variant {
        let g = if ordered {
            HOST_TIER_LOOKUP
        } else if values {
            (2 * copy_threads(dim)).max(2)
        } else {
            1
        };
        let vs = match (at, zero, refresh) {
            (true, ..) => &self.lookup_at,
            (false, true, false) => &self.lookup_zero,
            (false, true, true) => &self.lookup_zero_refresh,
            (false, false, false) => &self.lookup,
            (false, false, true) => &self.lookup_refresh,
        };
        pick(vs, self.forced_lookup.unwrap_or(g))
    }

    /// The upsert kernel for a table at `load`: 1 thread per key, from
    /// [`WRITER_PAIR_FROM`] on 2, or 4 for a plain insert (`plain`:
    /// insert_or_assign, nothing copied out), and one per 16 floats of a
    /// copied row ([`upsert_copy_threads`]); 8 for a batch in region order
    /// (BENCHMARKS.md, "Kernel choice"). Four threads without lost outputs
    /// (`lost`: insert_and_evict) take the variant held to 48 registers.
    /// An `adaptive` table's kernels are its own (`upsert_keys_a`, at least
    /// [`ADAPTIVE_WRITE_MIN`] threads a key), and a
    /// `verbatim` write's (scores kept as given: a load, a rehash) are
    /// `upsert_keys_v`, whatever the policy.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn upsert(
        &self,
        load: f64,
        values: bool,
        dim: usize,
        ordered: bool,
        plain: bool,
        lost: bool,
        adaptive: bool,
        verbatim: bool,
    ) -> &Variant {
        let scan = match (load >= WRITER_PAIR_FROM, plain) {
            (false, _) => 1,
            (true, false) => 2,
            (true, true) => 4,
        };
        let g = if ordered {
            HOST_TIER_WRITE
        } else if values {
            scan.max(upsert_copy_threads(dim))
        } else {
            scan
        };
        let g = if adaptive && !verbatim && !ordered && !lost { g.max(ADAPTIVE_WRITE_MIN) } else { g };
        let (all, bounded) = match (verbatim, adaptive) {
            (true, _) => (&self.upsert_verbatim, None),
            (false, false) => (&self.upsert, Some(&self.upsert_bounded)),
            (false, true) => (&self.upsert_adaptive, Some(&self.upsert_adaptive_bounded)),
        };
        match (pick(all, self.forced_write.unwrap_or(g)), bounded) {
            (v, Some(b)) if v.g == 4 && !lost => b,
            (v, _) => v,
        }
    }

    /// The update kernel: 2 threads per key (measured faster than 1 at
    /// every load), or enough for the row copy; 8 for a batch in region
    /// order. Rows of up to [`BOUNDED_UPDATE_DIM`] floats take the variant
    /// held to 48 registers.
    pub(super) fn update(&self, dim: usize, ordered: bool) -> &Variant {
        let g = if ordered { HOST_TIER_WRITE } else { copy_threads(dim).max(2) };
        match self.forced_write {
            None if g == 2 && dim <= BOUNDED_UPDATE_DIM => &self.update_bounded,
            forced => pick(&self.update, forced.unwrap_or(g)),
        }
    }

    /// The probe kernel of a large find_or_insert: the lookup's choice
    /// ([`Funcs::lookup`]), as it copies rows out as a find does.
    pub(super) fn probe(&self, values: bool, dim: usize, ordered: bool) -> &Variant {
        let g = self.lookup(values, dim, ordered, false, false, false).g;
        pick(&self.probe, g)
    }

    /// The optimizer step kernel for rows of `dim` values ([`step_threads`];
    /// 8 for a batch in region order).
    pub(super) fn step(&self, dim: usize, ordered: bool) -> &Variant {
        let g = if ordered { HOST_TIER_WRITE } else { step_threads(dim) };
        pick(&self.step, self.forced_write.unwrap_or(g))
    }
}

/// Threads per key of an optimizer step over rows of `dim` values: one
/// per 8 values, at least 2 and at most 32 (a step reads and writes the
/// values, the state and the gradient, several times the work of a copy).
pub(super) fn step_threads(dim: usize) -> u64 {
    (dim.div_ceil(8) as u64).next_power_of_two().clamp(2, 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn row_copies_get_one_thread_per_32_floats() {
        let got: Vec<u64> = [1, 8, 32, 33, 64, 100, 128, 256, 512].iter().map(|&d| copy_threads(d)).collect();
        assert_eq!(got, [1, 1, 1, 2, 2, 4, 4, 8, 16]);
    }

    #[test]
    pub(super) fn upsert_row_copies_get_one_thread_per_16_floats() {
        let got: Vec<u64> = [1, 8, 16, 17, 32, 64, 128].iter().map(|&d| upsert_copy_threads(d)).collect();
        assert_eq!(got, [1, 1, 1, 2, 2, 4, 8]);
    }

    #[test]
    pub(super) fn kernel_names_follow_the_threads_per_key() {
        assert_eq!(kernel_name("upsert_keys", 8), "upsert_keys");
        assert_eq!(kernel_name("upsert_keys", 1), "upsert_keys_g1");
        assert_eq!(kernel_name("lookup_find", 16), "lookup_find_g16");
    }

    #[test]
    pub(super) fn every_kernel_variant_the_host_asks_for_is_built() {
        use hkv_kernels::KernelId;
        let asked = [
            (KernelId::Lookup, "lookup_find", &LOOKUP_GROUPS[..]),
            (KernelId::Lookup, "lookup_at", &LOOKUP_GROUPS[..]),
            (KernelId::Lookup, "lookup_findz", &LOOKUP_GROUPS[..]),
            (KernelId::Lookup, "lookup_findr", &LOOKUP_GROUPS[..]),
            (KernelId::Lookup, "lookup_findzr", &LOOKUP_GROUPS[..]),
            (KernelId::Upsert, "upsert_keys", &WRITE_GROUPS[..]),
            (KernelId::Upsert, "upsert_keys_a", &WRITE_GROUPS[..]),
            (KernelId::Upsert, "upsert_keys_v", &WRITE_GROUPS[..]),
            (KernelId::Update, "update_keys", &WRITE_GROUPS[..]),
            (KernelId::Update, "step_keys", &WRITE_GROUPS[..]),
            (KernelId::Upsert, "probe_keys", &LOOKUP_GROUPS[..]),
        ];
        let bounded = [
            (KernelId::Upsert, "upsert_keys_g4_b5"),
            (KernelId::Upsert, "upsert_keys_a_g4_b5"),
            (KernelId::Update, "update_keys_g2_b5"),
        ];
        for (id, name) in bounded {
            assert!(id.symbols().contains(&name), "{name} is not built in {id:?}");
        }
        for (id, base, gs) in asked {
            for &g in gs {
                let name = kernel_name(base, g);
                assert!(id.symbols().contains(&name.as_str()), "{name} is not built in {id:?}");
            }
        }
    }
}
