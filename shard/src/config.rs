//! Table configuration: capacity, dim, score policy (and Lfu tie rule),
//! bucket mode, memory budget.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
pub use crate::score::{LfuTies, ScorePolicy};
use crate::{Backend, BUCKET_SLOTS};

/// Bytes of one bucket of the CPU backend in host memory (128 digests,
/// keys and scores, the occupancy bitmap and the writers' mutex, in a
/// 128-byte aligned struct; `cpu::storage` asserts it).
pub const CPU_BUCKET_BYTES: u64 = 2304;
impl std::str::FromStr for ScorePolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        ScorePolicy::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            Error::Config(format!("unknown policy {s:?}; use lru, lfu, epoch-lru, epoch-lfu, custom or adaptive"))
        })
    }
}

impl std::str::FromStr for LfuTies {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        LfuTies::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::Config(format!("unknown lfu tie rule {s:?}; use lru or lowest-slot")))
    }
}

/// Single bucket (one candidate bucket per key) or dual bucket (two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum BucketMode {
    /// One bucket per key: one digest line per lookup; first eviction near load 0.63.
    #[default]
    Single,
    /// Two independent buckets per key (paper §3.4): first eviction near load 0.98.
    Dual,
}

/// The shape and policy of one table (or of one shard of a table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TableConfig {
    /// Initial slots; rounded up to whole 128-slot buckets.
    pub capacity: u64,
    /// Largest capacity growth may reach; 0 means "same as capacity" (no growth).
    pub max_capacity: u64,
    /// Growth doubles the buckets before an insert batch would push
    /// size / capacity past this fraction, while below max_capacity.
    pub max_load_factor: f64,
    /// f32 elements per value.
    pub dim: usize,
    /// Score policy.
    pub policy: ScorePolicy,
    /// Bucket mode.
    pub mode: BucketMode,
    /// Bytes of values kept in device memory; the rest live in pinned host
    /// memory. `None` = all in device memory. The CPU backend only reports it.
    pub fast_tier_bytes: Option<u64>,
    /// Lfu only: how equal frequencies are told apart (see [`LfuTies`]).
    /// Absent from a serialized config it is [`LfuTies::Lru`], like every
    /// new table's: no stored format of this workspace holds a
    /// `TableConfig` (the daemon's catalog and checkpoints keep their own
    /// table spec), so the default decides what new tables get, and a
    /// fixed Lfu is what they should get. `lowest-slot` is for users who
    /// need the reference library's scores and victims.
    pub lfu_ties: LfuTies,
    /// CUDA backend only: the kernel choice forced for benchmarks (see
    /// [`CudaTuning`]); the default is what measured fastest. A value the
    /// process gives each table it opens, not part of a table's shape, so
    /// not serialized.
    #[serde(skip)]
    pub tuning: CudaTuning,
    /// Whether `find` hits refresh the found entries' scores as a write
    /// would (Lru, EpochLru, Adaptive: the clock; Lfu, EpochLfu: one more
    /// access) and, for Adaptive, count in its frequency sketch. `None`:
    /// the policy's default ([`ScorePolicy::reads_refresh_default`]).
    pub reads_refresh: Option<bool>,
}

/// Tuning of the CUDA backend's kernel choice, for benchmarks: the
/// default is what was measured fastest on the H200 (`shard/BENCHMARKS.md`).
/// The library reads no environment variable: binaries fill it from flags
/// or from the `HKV_*` variables with [`CudaTuning::from_vars`] and give it
/// to each table they open ([`TableConfig::tuning`]), or change it on an
/// open one (`CudaTable::set_tuning`, `GpuGroup::set_tuning`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaTuning {
    /// Threads per key of every lookup kernel (one of [`CudaTuning::GROUPS`]);
    /// `None`: chosen per batch.
    pub lookup_group: Option<u32>,
    /// Threads per key of every writer kernel (upsert, update).
    pub write_group: Option<u32>,
    /// Serve large host-tier batches in index order instead of grouped by
    /// bucket region.
    pub index_order: bool,
    /// How a large find_or_insert batch (above `SEQUENTIAL_BATCH` keys) is
    /// served; the other ways are kept for comparisons.
    pub find_or_insert: FindOrInsert,
}

/// How the CUDA backend serves a find_or_insert of more than
/// `SEQUENTIAL_BATCH` keys (`HKV_FIND_OR_INSERT`; `shard/BENCHMARKS.md`,
/// "Repeated keys placed once").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FindOrInsert {
    /// The default: repeated keys placed once. Where a repeat stores
    /// nothing its first occurrence did not (lru, epoch_lru, custom), each
    /// key's first occurrence is placed and the repeats take its answer: on
    /// a table with a host tier every key so, else the misses of the
    /// lock-free probe of the hits. Other policies: as `Probe`.
    #[default]
    Dedupe,
    /// The hits first, without locks (`probe_keys`), then one locked
    /// launch over the misses, repeats and all.
    Probe,
    /// One locked launch over every key.
    Locked,
}

impl CudaTuning {
    /// The threads per key the kernels are built for.
    pub const GROUPS: [u32; 6] = [1, 2, 4, 8, 16, 32];

    /// Tuning from the variables `HKV_LOOKUP_GROUP`, `HKV_WRITE_GROUP`
    /// (1|2|4|8|16|32), `HKV_KEY_ORDER` (`index` or `region`) and
    /// `HKV_FIND_OR_INSERT` (`dedupe`, the default, `probe` or `locked`), read
    /// through `get` (a binary passes `|k| std::env::var(k).ok()`).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<CudaTuning> {
        let group = |var: &str| -> Result<Option<u32>> {
            let Some(v) = get(var) else { return Ok(None) };
            match v.trim().parse::<u32>() {
                Ok(g) if Self::GROUPS.contains(&g) => Ok(Some(g)),
                _ => Err(Error::Config(format!("{var}={v:?}: use one of 1, 2, 4, 8, 16, 32"))),
            }
        };
        let index_order = match get("HKV_KEY_ORDER").as_deref().map(str::trim) {
            None | Some("region") => false,
            Some("index") => true,
            Some(v) => return Err(Error::Config(format!("HKV_KEY_ORDER={v:?}: use index or region"))),
        };
        let find_or_insert = match get("HKV_FIND_OR_INSERT").as_deref().map(str::trim) {
            None | Some("dedupe") => FindOrInsert::Dedupe,
            Some("probe") => FindOrInsert::Probe,
            Some("locked") => FindOrInsert::Locked,
            Some(v) => return Err(Error::Config(format!("HKV_FIND_OR_INSERT={v:?}: use dedupe, probe or locked"))),
        };
        Ok(CudaTuning {
            lookup_group: group("HKV_LOOKUP_GROUP")?,
            write_group: group("HKV_WRITE_GROUP")?,
            index_order,
            find_or_insert,
        })
    }

    /// Checks the forced group sizes.
    pub fn validate(&self) -> Result<()> {
        for (what, g) in [("lookup_group", self.lookup_group), ("write_group", self.write_group)] {
            if let Some(g) = g.filter(|g| !Self::GROUPS.contains(g)) {
                return Err(Error::Config(format!("{what} {g}: use one of 1, 2, 4, 8, 16, 32")));
            }
        }
        Ok(())
    }
}

impl Default for TableConfig {
    fn default() -> Self {
        TableConfig {
            capacity: 1 << 20,
            max_capacity: 0,
            max_load_factor: 0.5,
            dim: 32,
            policy: ScorePolicy::Lru,
            mode: BucketMode::Single,
            fast_tier_bytes: None,
            lfu_ties: LfuTies::Lru,
            tuning: CudaTuning::default(),
            reads_refresh: None,
        }
    }
}

impl TableConfig {
    /// A config with the given capacity and dim and defaults otherwise.
    pub fn new(capacity: u64, dim: usize) -> Self {
        TableConfig { capacity, dim, ..Default::default() }
    }

    /// Builder: set the policy.
    pub fn policy(mut self, policy: ScorePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Builder: set the bucket mode.
    pub fn mode(mut self, mode: BucketMode) -> Self {
        self.mode = mode;
        self
    }

    /// Builder: set the Lfu tie rule.
    pub fn lfu_ties(mut self, ties: LfuTies) -> Self {
        self.lfu_ties = ties;
        self
    }

    /// Builder: whether find hits refresh scores (`None`: the policy's default).
    pub fn reads_refresh(mut self, on: Option<bool>) -> Self {
        self.reads_refresh = on;
        self
    }

    /// Whether find hits refresh scores in this table.
    pub fn refreshes_reads(&self) -> bool {
        self.reads_refresh.unwrap_or_else(|| self.policy.reads_refresh_default())
    }

    /// Builder: set the maximum capacity (enables growth when above capacity).
    pub fn max_capacity(mut self, max: u64) -> Self {
        self.max_capacity = max;
        self
    }

    /// Checks the config; every problem is named.
    pub fn validate(&self) -> Result<()> {
        self.tuning.validate()?;
        if self.dim == 0 {
            return Err(Error::Config("dim must be at least 1".into()));
        }
        if self.dim > 1 << 16 {
            return Err(Error::Config(format!("dim {} is above the limit of 65536", self.dim)));
        }
        if self.capacity == 0 {
            return Err(Error::Config("capacity must be at least 1".into()));
        }
        if self.policy == ScorePolicy::Custom && self.reads_refresh == Some(true) {
            return Err(Error::Config(
                "reads_refresh with policy custom: a custom table's scores are the caller's, which a find does not \
                 change (reads refresh applies to lru, lfu, epoch-lru, epoch-lfu and adaptive)"
                    .into(),
            ));
        }
        if self.max_capacity != 0 && self.max_capacity < self.capacity {
            return Err(Error::Config(format!(
                "max_capacity {} is below capacity {}",
                self.max_capacity, self.capacity
            )));
        }
        if !(self.max_load_factor > 0.0 && self.max_load_factor <= 1.0) {
            return Err(Error::Config(format!("max_load_factor {} must be in (0, 1]", self.max_load_factor)));
        }
        if self.buckets().checked_mul(BUCKET_SLOTS as u64 * self.dim as u64).is_none() {
            return Err(Error::Config("capacity x dim overflows".into()));
        }
        Ok(())
    }

    /// Buckets at the initial capacity.
    pub fn buckets(&self) -> u64 {
        self.capacity.div_ceil(BUCKET_SLOTS as u64).max(1)
    }

    /// The largest bucket count growth may reach. Growth doubles, so
    /// `max_capacity` is rounded up to the initial buckets times a power of
    /// two: `reserve(max_capacity)` then reaches it (rounding down left the
    /// table short of a capacity it had said it could hold).
    pub fn max_buckets(&self) -> u64 {
        let want = self.max_capacity.max(self.capacity).div_ceil(BUCKET_SLOTS as u64).max(1);
        let mut b = self.buckets();
        while b < want {
            b = b.saturating_mul(2);
        }
        b
    }

    /// The memory one shard of this config holds at `buckets` buckets on
    /// `backend` (`Auto` counts as CPU); `None` when it overflows a u64.
    pub fn footprint_at(&self, backend: Backend, buckets: u64) -> Option<Footprint> {
        let slots = buckets.checked_mul(BUCKET_SLOTS as u64)?;
        let row = (self.dim as u64).checked_mul(4)?;
        match backend {
            Backend::Cpu | Backend::Auto => {
                let meta = buckets.checked_mul(CPU_BUCKET_BYTES)?;
                Some(Footprint { device: 0, host: meta.checked_add(slots.checked_mul(row)?)?.checked_add(64)? })
            }
            Backend::Cuda => {
                // Per slot a digest, a key and a score; per bucket a size and a lock.
                let meta = slots.checked_mul(17)?.checked_add(buckets.checked_mul(8)?)?;
                let fast = self.fast_tier_bytes.map_or(slots, |b| (b / row.max(1)).min(slots));
                let device = meta.checked_add(fast.checked_mul(row)?)?;
                Some(Footprint { device, host: (slots - fast).checked_mul(row)? })
            }
        }
    }

    /// The most memory one shard of this config can ever hold: at its
    /// largest bucket count, plus, when it may grow, the half-size storage
    /// that a last doubling rebuilds from while the new one is filled.
    pub fn peak_footprint(&self, backend: Backend) -> Option<Footprint> {
        let (first, last) = (self.buckets(), self.max_buckets());
        let top = self.footprint_at(backend, last)?;
        if last <= first {
            return Some(top);
        }
        let half = self.footprint_at(backend, (last / 2).max(first))?;
        Some(Footprint { device: top.device.checked_add(half.device)?, host: top.host.checked_add(half.host)? })
    }
}

/// Bytes of table memory, by where they live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Footprint {
    /// Device memory (CUDA backend).
    pub device: u64,
    /// Host memory: every byte of a CPU table, the pinned value tier of a
    /// CUDA table.
    pub host: u64,
}

impl Footprint {
    /// `self × n`, `None` on overflow.
    pub fn times(self, n: u64) -> Option<Footprint> {
        Some(Footprint { device: self.device.checked_mul(n)?, host: self.host.checked_mul(n)? })
    }
}

#[cfg(test)]
mod tuning_tests {
    use super::{CudaTuning, FindOrInsert};

    fn vars<'a>(v: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| v.iter().find(|(n, _)| *n == k).map(|(_, x)| x.to_string())
    }

    #[test]
    fn tuning_comes_from_the_variables_a_binary_passes() {
        assert_eq!(CudaTuning::from_vars(vars(&[])).unwrap(), CudaTuning::default());
        let t = CudaTuning::from_vars(vars(&[("HKV_LOOKUP_GROUP", "16"), ("HKV_KEY_ORDER", "index")])).unwrap();
        assert_eq!(t, CudaTuning { lookup_group: Some(16), index_order: true, ..CudaTuning::default() });
        assert_eq!(CudaTuning::default().find_or_insert, FindOrInsert::Dedupe);
        for (v, way) in
            [("dedupe", FindOrInsert::Dedupe), ("probe", FindOrInsert::Probe), ("locked", FindOrInsert::Locked)]
        {
            let t = CudaTuning::from_vars(vars(&[("HKV_FIND_OR_INSERT", v)])).unwrap();
            assert_eq!(t.find_or_insert, way, "{v}");
        }
        let bad = [
            ("HKV_WRITE_GROUP", "3"),
            ("HKV_LOOKUP_GROUP", "x"),
            ("HKV_KEY_ORDER", "random"),
            ("HKV_FIND_OR_INSERT", "x"),
        ];
        for bad in bad {
            let e = CudaTuning::from_vars(vars(&[bad])).unwrap_err().to_string();
            assert!(e.contains(bad.0), "{e}");
        }
        assert!(CudaTuning { write_group: Some(64), ..Default::default() }.validate().is_err());
    }
}
