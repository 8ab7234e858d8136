//! The plain data requests and responses carry: write summaries, filters,
//! export cursors, feature hashes, table specs.

use serde::{Deserialize, Serialize};

use crate::error::ProtoError;

/// Per-outcome counts of a write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Keys that were present.
    pub updated: u64,
    /// Keys placed in a free slot (those placed by evicting another entry
    /// are `evicted`, not here: [`Summary::inserted_total`] counts both).
    pub inserted: u64,
    /// Keys placed by evicting another entry (inserted too).
    pub evicted: u64,
    /// Keys refused by admission control.
    pub rejected: u64,
    /// Keys absent for an update-only op.
    pub absent: u64,
}

impl std::ops::AddAssign for Summary {
    fn add_assign(&mut self, o: Summary) {
        self.updated += o.updated;
        self.inserted += o.inserted;
        self.evicted += o.evicted;
        self.rejected += o.rejected;
        self.absent += o.absent;
    }
}

impl Summary {
    /// Keys the write placed, in a free slot or by evicting another entry:
    /// the "N inserted" of hkvctl (and the Python client's
    /// `Summary.inserted_total`).
    pub fn inserted_total(&self) -> u64 {
        self.inserted + self.evicted
    }
}

impl std::fmt::Display for Summary {
    /// "N inserted (M of them by evicting another entry), N updated, N
    /// rejected", and "N absent" for an update-only op that found some
    /// keys absent: each key counted once.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} inserted", self.inserted_total())?;
        if self.evicted > 0 {
            write!(f, " ({} of them by evicting another entry)", self.evicted)?;
        }
        write!(f, ", {} updated, {} rejected", self.updated, self.rejected)?;
        if self.absent > 0 {
            write!(f, ", {} absent", self.absent)?;
        }
        Ok(())
    }
}

/// A predicate on key and score (see PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filter {
    /// Bits of the key compared.
    pub key_mask: u64,
    /// Their required value.
    pub key_pattern: u64,
    /// Smallest matching score.
    pub min_score: u64,
    /// Largest matching score.
    pub max_score: u64,
}

impl Default for Filter {
    fn default() -> Self {
        Filter { key_mask: 0, key_pattern: 0, min_score: 0, max_score: u64::MAX }
    }
}

/// Where an export continues: shard index and slot offset in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// Shard index.
    pub shard: u32,
    /// Slot offset within the shard.
    pub offset: u64,
}

/// Entries that lost their slot (or were refused) in insert_and_evict.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Evicted {
    /// Keys.
    pub keys: Vec<u64>,
    /// Values, dim per key.
    pub values: Vec<f32>,
    /// Scores.
    pub scores: Vec<u64>,
    /// 0 = evicted resident, 1 = rejected input.
    pub kinds: Vec<u8>,
}

/// How feature bytes become keys: `hash(bytes) % num_buckets`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeatureHash {
    /// The hash function.
    #[serde(default)]
    pub kind: HashKind,
    /// Keys are `hash % num_buckets`: 1 to 2^64 - 4.
    pub num_buckets: u64,
    /// The SipHash key of `strong` (ignored by `fingerprint64`).
    #[serde(default)]
    pub key: [u64; 2],
}

impl FeatureHash {
    /// Fingerprint64 into `num_buckets` buckets.
    pub fn fingerprint64(num_buckets: u64) -> FeatureHash {
        FeatureHash { kind: HashKind::Fingerprint64, num_buckets, key: [0, 0] }
    }
}

/// The hash a feature request uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashSpec {
    /// The table's `hash` setting.
    Table,
    /// This one.
    Given(FeatureHash),
}

/// Raw categorical features.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Features {
    /// int64 features, hashed as their decimal text.
    Int64(Vec<i64>),
    /// Strings: feature `i` is `bytes[offsets[i] .. offsets[i + 1]]`.
    Strings {
        /// Every feature's bytes, back to back.
        bytes: Vec<u8>,
        /// `n + 1` offsets.
        offsets: Vec<u32>,
    },
}

impl Features {
    /// Number of features.
    pub fn len(&self) -> usize {
        match self {
            Features::Int64(v) => v.len(),
            Features::Strings { offsets, .. } => offsets.len().saturating_sub(1),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Strings from a list (builds the buffer and offsets).
    ///
    /// # Panics
    /// When the strings total 4 GiB or more; [`Features::try_strings`]
    /// refuses them instead.
    pub fn strings<S: AsRef<[u8]>>(items: &[S]) -> Features {
        Features::try_strings(items).unwrap_or_else(|e| panic!("{}", e.message))
    }

    /// [`Features::strings`], or an error when the strings total 4 GiB or
    /// more (their offsets are `u32`s).
    pub fn try_strings<S: AsRef<[u8]>>(items: &[S]) -> Result<Features, ProtoError> {
        let mut bytes = vec![];
        let mut offsets = Vec::with_capacity(items.len() + 1);
        offsets.push(0u32);
        for s in items {
            bytes.extend_from_slice(s.as_ref());
            offsets.push(u32::try_from(bytes.len()).map_err(|_| {
                ProtoError::bad_request(format!(
                    "features of {} bytes or more do not fit the protocol's 32-bit offsets; send smaller batches",
                    bytes.len()
                ))
            })?);
        }
        Ok(Features::Strings { bytes, offsets })
    }
}

/// A table to create: the whole table, which the daemon spreads over its shards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableSpec {
    /// Table name (1 to 255 bytes of letters, digits, `_`, `-`, `.`).
    pub name: String,
    /// f32 elements per value.
    pub dim: usize,
    /// Slots over all shards.
    pub capacity: u64,
    /// Growth limit over all shards; 0 or absent = no growth.
    #[serde(default)]
    pub max_capacity: u64,
    /// The score policy.
    #[serde(default)]
    pub policy: Policy,
    /// The bucket mode.
    #[serde(default)]
    pub mode: Mode,
    /// Device-memory byte budget for values over all shards (CUDA); none = all.
    #[serde(default)]
    pub fast_tier_bytes: Option<u64>,
    /// Growth threshold (default 0.5).
    #[serde(default)]
    pub max_load_factor: Option<f64>,
    /// The hash feature requests use when they name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<FeatureHash>,
    /// Policy lfu: how entries of equal frequency are told apart (absent:
    /// `lru`; a checkpoint manifest written before the field existed
    /// restores as `lowest-slot`, the rule its tables had).
    #[serde(default)]
    pub lfu_ties: LfuTies,
    /// The Redis Cluster behind the table (absent: none, the table is the
    /// cache alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<BackingSpec>,
    /// Whether `find` hits refresh scores (an adaptive entry's also
    /// counting the hit in its score); absent: the policy's default (on for `adaptive`,
    /// off for the others, whose finds touch no score as in HKV), except
    /// on a table with `backing` on the CPU backend, where it is on (a
    /// backed table's find hits refresh their rows, `docs/backing.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads_refresh: Option<bool>,
    /// The optimizer `apply_gradients` runs in the table (absent: none):
    /// each stored row is then `dim` values followed by its state columns
    /// ([`Optimizer::state_cols`]), and every other op reads and writes
    /// whole rows of [`TableSpec::row_dim`] floats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<Optimizer>,
}

/// The optimizer a table runs for `apply_gradients` (PROTOCOL.md,
/// "apply_gradients").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Optimizer {
    /// Plain SGD (no state).
    #[serde(rename = "sgd")]
    Sgd,
    /// Adagrad (a sum of squares per value).
    #[serde(rename = "adagrad")]
    Adagrad,
    /// Row-wise Adagrad (one accumulator per row).
    #[serde(rename = "rowwise_adagrad")]
    RowwiseAdagrad,
    /// Adam (two moments per value).
    #[serde(rename = "adam")]
    Adam,
}

impl Optimizer {
    /// State columns stored after `dim` values: sgd 0, adagrad dim,
    /// rowwise_adagrad 1, adam 2 × dim.
    pub fn state_cols(self, dim: usize) -> usize {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::Adagrad => dim,
            Optimizer::RowwiseAdagrad => 1,
            Optimizer::Adam => 2 * dim,
        }
    }
}

/// The hyperparameters of one `apply_gradients` request: `f32 lr`, `f32
/// eps`, `f32 beta1`, `f32 beta2`, `f32 weight_decay`, `u64 step` on the
/// wire (28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Hyper {
    /// Learning rate.
    pub lr: f32,
    /// Added to the denominator (adagrad, rowwise_adagrad, adam).
    pub eps: f32,
    /// Adam's first-moment decay.
    pub beta1: f32,
    /// Adam's second-moment decay.
    pub beta2: f32,
    /// L2 penalty: the step uses `grad + weight_decay × value`.
    pub weight_decay: f32,
    /// The step number from 1 (Adam's bias correction).
    pub step: u64,
    /// Sum the gradients of a key's occurrences before its one step: the
    /// `SUM` flag of the frame (not in the 28 bytes).
    #[serde(default)]
    pub sum: bool,
}

impl Default for Hyper {
    fn default() -> Hyper {
        Hyper { lr: 0.01, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, step: 1, sum: false }
    }
}

/// A table's backing tier: seed nodes of a Redis Cluster and how writes
/// reach it (`PROTOCOL.md`, "Backing tier").
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackingSpec {
    /// Seed nodes, `redis://HOST:PORT` or `HOST:PORT`.
    pub seeds: Vec<String>,
    /// How writes reach the cluster.
    #[serde(default)]
    pub mode: BackingMode,
    /// How long a read of cache misses waits for the cluster, ms
    /// (absent: 250).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// The write-back queue's bound in bytes (absent: 64 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_bytes: Option<u64>,
    /// Replicas of each master that must acknowledge a write (`WAIT`)
    /// before it counts as written (absent or 0: the master's
    /// acknowledgement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_replicas: Option<u32>,
}

impl BackingSpec {
    /// The spec as listings show it and checkpoints keep it: each seed's
    /// password replaced by [`BackingSpec::HIDDEN`]
    /// (`redis://:***@HOST:PORT`, `redis://USER:***@HOST:PORT`). An empty
    /// password is left as it is: hidden, it would make a restore ask for
    /// a password no passwords file can give (a tester's daemon did not
    /// start).
    pub fn redacted(&self) -> BackingSpec {
        let hide = |seed: &String| match userinfo(seed).and_then(|(a, b)| Some((a, b, seed[a..b].split_once(':')?))) {
            Some((a, b, (user, pw))) if !pw.is_empty() => {
                format!("{}{user}:{}{}", &seed[..a], BackingSpec::HIDDEN, &seed[b..])
            }
            _ => seed.clone(),
        };
        BackingSpec { seeds: self.seeds.iter().map(hide).collect(), ..self.clone() }
    }

    /// What [`BackingSpec::redacted`] puts where a seed's password was.
    pub const HIDDEN: &'static str = "***";

    /// Whether a seed's password is [`BackingSpec::HIDDEN`]: a spec read
    /// back from a checkpoint, which needs the password again before its
    /// cluster can be opened ([`BackingSpec::with_password`]).
    pub fn password_hidden(&self) -> bool {
        self.seeds.iter().any(|s| {
            userinfo(s).is_some_and(|(a, b)| s[a..b].split_once(':').is_some_and(|(_, pw)| pw == BackingSpec::HIDDEN))
        })
    }

    /// The spec with each hidden password replaced by `password`
    /// (percent-encoded into the URL as RFC 3986 wants, so any byte may be
    /// in it).
    pub fn with_password(&self, password: &str) -> BackingSpec {
        let mut encoded = String::new();
        for b in password.bytes() {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                encoded.push(b as char);
            } else {
                encoded.push_str(&format!("%{b:02X}"));
            }
        }
        let fill = |seed: &String| match userinfo(seed) {
            Some((a, b)) => match seed[a..b].split_once(':') {
                Some((user, pw)) if pw == BackingSpec::HIDDEN => {
                    format!("{}{user}:{encoded}{}", &seed[..a], &seed[b..])
                }
                _ => seed.clone(),
            },
            None => seed.clone(),
        };
        BackingSpec { seeds: self.seeds.iter().map(fill).collect(), ..self.clone() }
    }

    /// Seeds from `--backing`'s comma-separated list.
    pub fn from_list(list: &str, mode: BackingMode) -> BackingSpec {
        BackingSpec {
            seeds: list.split(',').map(|s| s.trim().to_string()).collect(),
            mode,
            deadline_ms: None,
            queue_bytes: None,
            wait_replicas: None,
        }
    }
}

/// Where a seed URL's user information (`USER:PASSWORD`, before the `@`)
/// starts and ends, when it has some.
fn userinfo(seed: &str) -> Option<(usize, usize)> {
    match (seed.find("://"), seed.rfind('@')) {
        (Some(a), Some(b)) if b > a + 3 => Some((a + 3, b)),
        _ => None,
    }
}

/// How a backed table writes to its cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum BackingMode {
    /// The cache never writes to the cluster (inference).
    #[default]
    #[serde(rename = "read-only")]
    ReadOnly,
    /// A write is acknowledged after the cluster acknowledged it.
    #[serde(rename = "write-through")]
    WriteThrough,
    /// Writes and evictions are queued and sent in batches.
    #[serde(rename = "write-back")]
    WriteBack,
}

impl TableSpec {
    /// The spec as listings and stats show it: a backing's passwords
    /// hidden ([`BackingSpec::redacted`]); the table keeps the real one.
    pub fn redacted(&self) -> TableSpec {
        TableSpec { backing: self.backing.as_ref().map(BackingSpec::redacted), ..self.clone() }
    }

    /// A spec with defaults for everything but name, dim and capacity.
    pub fn new(name: &str, dim: usize, capacity: u64) -> TableSpec {
        TableSpec {
            name: name.into(),
            dim,
            capacity,
            max_capacity: 0,
            policy: Policy::Lru,
            mode: Mode::Single,
            fast_tier_bytes: None,
            max_load_factor: None,
            hash: None,
            lfu_ties: LfuTies::Lru,
            backing: None,
            reads_refresh: None,
            optimizer: None,
        }
    }

    /// Floats of one stored row: `dim`, plus the optimizer's state
    /// columns. Every op but apply_gradients reads and writes rows of this
    /// width (the wire's "dim" of value arrays).
    pub fn row_dim(&self) -> usize {
        self.dim + self.optimizer.map_or(0, |o| o.state_cols(self.dim))
    }
}

/// A table as listed by the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableInfo {
    /// The spec it was created with.
    pub spec: TableSpec,
    /// Entries over all shards.
    pub size: u64,
    /// Slots over all shards.
    pub capacity: u64,
    /// Shards it is spread over.
    pub shards: u32,
    /// Floats of a stored row ([`TableSpec::row_dim`]): the width of the
    /// value arrays of every op but apply_gradients. Absent from daemons
    /// older than the field: then `spec.dim`.
    #[serde(default)]
    pub row_dim: usize,
}

impl TableInfo {
    /// The width of the table's value arrays on the wire.
    pub fn row_dim(&self) -> usize {
        if self.row_dim == 0 {
            self.spec.row_dim()
        } else {
            self.row_dim
        }
    }
}

/// `as_str`, `Display`, `FromStr` (whose error lists the names) and `ALL`
/// for an enum of names that travel as text (JSON, TOML, CLI flags); serde
/// spells them the same through `rename`.
macro_rules! names {
    ($ty:ident, $what:literal, { $($v:ident = $s:literal,)* }) => {
        impl $ty {
            /// Every value.
            pub const ALL: &'static [$ty] = &[$($ty::$v),*];

            /// The name, as configs, flags and JSON spell it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$v => $s,)*
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = ProtoError;

            fn from_str(s: &str) -> Result<$ty, ProtoError> {
                $ty::ALL.iter().copied().find(|x| x.as_str() == s).ok_or_else(|| {
                    let names: Vec<&str> = $ty::ALL.iter().map(|x| x.as_str()).collect();
                    ProtoError::bad_request(format!(
                        concat!("unknown ", $what, " {:?}; use {}"),
                        s,
                        names.join(", ")
                    ))
                })
            }
        }
    };
}

/// A table's score policy: which entry a full bucket evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Policy {
    /// Least recently written goes.
    #[default]
    #[serde(rename = "lru")]
    Lru,
    /// Least frequently written goes.
    #[serde(rename = "lfu")]
    Lfu,
    /// Lru within the epoch set by `set_epoch`.
    #[serde(rename = "epoch-lru")]
    EpochLru,
    /// Lfu within the epoch.
    #[serde(rename = "epoch-lfu")]
    EpochLfu,
    /// Scores given by the client.
    #[serde(rename = "custom")]
    Custom,
    /// A window-TinyLFU per bucket whose window share adapts (issue 36):
    /// frequent keys survive scans, recent ones survive bursts.
    #[serde(rename = "adaptive")]
    Adaptive,
}
names!(Policy, "policy", { Lru = "lru", Lfu = "lfu", EpochLru = "epoch-lru", EpochLfu = "epoch-lfu", Custom = "custom", Adaptive = "adaptive", });

/// A table's bucket mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Mode {
    /// One bucket per key.
    #[default]
    #[serde(rename = "single")]
    Single,
    /// The emptier of two buckets per key.
    #[serde(rename = "dual")]
    Dual,
}
names!(Mode, "mode", { Single = "single", Dual = "dual", });

/// How an lfu table tells entries of equal frequency apart (which one a
/// full bucket evicts); docs/tables.md, "Lfu scores", says what exported scores hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum LfuTies {
    /// The least recently written goes; scores pack the frequency (high 24
    /// bits) and a ~ms clock (low 40 bits).
    #[default]
    #[serde(rename = "lru")]
    Lru,
    /// The reference library's rule: the lowest slot goes; scores are plain
    /// frequencies.
    #[serde(rename = "lowest-slot")]
    LowestSlot,
}
names!(LfuTies, "lfu tie rule", { Lru = "lru", LowestSlot = "lowest-slot", });
names!(BackingMode, "backing mode", { ReadOnly = "read-only", WriteThrough = "write-through", WriteBack = "write-back", });
names!(Optimizer, "optimizer", { Sgd = "sgd", Adagrad = "adagrad", RowwiseAdagrad = "rowwise_adagrad", Adam = "adam", });

/// The hash of feature requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum HashKind {
    /// Fingerprint64 (TensorFlow's `to_hash_bucket_fast`).
    #[default]
    #[serde(rename = "fingerprint64")]
    Fingerprint64,
    /// SipHash-2-4 keyed by the setting's `key` (TensorFlow's
    /// `to_hash_bucket_strong`).
    #[serde(rename = "strong")]
    Strong,
}
names!(HashKind, "hash kind", { Fingerprint64 = "fingerprint64", Strong = "strong", });

impl HashKind {
    /// The wire code: 0 fingerprint64, 1 strong.
    pub fn code(self) -> u8 {
        match self {
            HashKind::Fingerprint64 => 0,
            HashKind::Strong => 1,
        }
    }
}

/// Which checkpoint a restore loads: the newest complete one, or one by
/// id. Travels as text: `latest`, or the id in hex (parsed as a base-16
/// `u64`: leading zeros may be left out, case does not matter; written as
/// 16 digits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum CheckpointId {
    /// The newest complete checkpoint (a corrupt one is skipped).
    Latest,
    /// This one.
    Id(u64),
}

impl std::fmt::Display for CheckpointId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointId::Latest => f.write_str("latest"),
            CheckpointId::Id(id) => write!(f, "{id:016x}"),
        }
    }
}

impl std::str::FromStr for CheckpointId {
    type Err = ProtoError;

    fn from_str(s: &str) -> Result<CheckpointId, ProtoError> {
        if s == "latest" {
            return Ok(CheckpointId::Latest);
        }
        u64::from_str_radix(s, 16).map(CheckpointId::Id).map_err(|_| {
            ProtoError::bad_request(format!("checkpoint id {s:?}: use `latest` or an id from `hkvctl checkpoints`"))
        })
    }
}

impl TryFrom<String> for CheckpointId {
    type Error = String;

    fn try_from(s: String) -> Result<CheckpointId, String> {
        s.parse().map_err(|e: ProtoError| e.message)
    }
}

impl From<CheckpointId> for String {
    fn from(c: CheckpointId) -> String {
        c.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Configs, flags and JSON keep their exact text.
    #[test]
    fn names_parse_print_and_serialise_as_before() {
        for &p in Policy::ALL {
            assert_eq!(p.as_str().parse::<Policy>().unwrap(), p);
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{p}\""));
        }
        assert_eq!(Policy::EpochLfu.to_string(), "epoch-lfu");
        let e = "fifo".parse::<Policy>().unwrap_err();
        assert_eq!(e.code, crate::ErrorCode::BadRequest, "{e}");
        assert!(e.message.contains("\"fifo\""), "{e}");
        assert_eq!("dual".parse::<Mode>().unwrap(), Mode::Dual);
        assert_eq!(serde_json::to_string(&HashKind::Strong).unwrap(), "\"strong\"");
        let spec: TableSpec = serde_json::from_str(r#"{"name":"t","dim":4,"capacity":8,"policy":"epoch-lfu","mode":"dual","hash":{"kind":"strong","num_buckets":9,"key":[1,2]}}"#).unwrap();
        assert_eq!((spec.policy, spec.mode, spec.hash.unwrap().kind), (Policy::EpochLfu, Mode::Dual, HashKind::Strong));
        let spec: TableSpec = serde_json::from_str(r#"{"name":"t","dim":4,"capacity":8}"#).unwrap();
        assert_eq!(spec, TableSpec::new("t", 4, 8));
        assert_eq!("latest".parse::<CheckpointId>().unwrap(), CheckpointId::Latest);
        assert_eq!("FF".parse::<CheckpointId>().unwrap(), CheckpointId::Id(255));
        assert_eq!(CheckpointId::Id(255).to_string(), "00000000000000ff");
        assert!("xyz".parse::<CheckpointId>().unwrap_err().message.contains("\"xyz\""));
        let e = serde_json::from_str::<TableSpec>(r#"{"name":"t","dim":4,"capacity":8,"policy":"fifo"}"#).unwrap_err();
        assert!(e.to_string().contains("fifo"), "{e}");
    }
}
