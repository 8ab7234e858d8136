//! Typed requests and responses, and their encoding (see PROTOCOL.md).

use serde::{Deserialize, Serialize};

use crate::body::{Reader, Writer};
use crate::error::{ErrorCode, ProtoError};
use crate::{flags, op, Header, HEADER_LEN};

/// Per-outcome counts of a write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Keys that were present.
    pub updated: u64,
    /// Keys placed in a free slot.
    pub inserted: u64,
    /// Keys placed by evicting another entry.
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

impl std::fmt::Display for Summary {
    /// "N inserted, N updated, N evicted another entry, N rejected" (keys
    /// placed by eviction count as inserted too).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} inserted, {} updated, {} evicted another entry, {} rejected",
            self.inserted + self.evicted,
            self.updated,
            self.evicted,
            self.rejected
        )
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
    /// `fingerprint64` (TensorFlow's `to_hash_bucket_fast`) or `strong`
    /// (SipHash-2-4 keyed by `key`, TensorFlow's `to_hash_bucket_strong`).
    #[serde(default = "default_hash_kind")]
    pub kind: String,
    /// Keys are `hash % num_buckets`: 1 to 2^64 - 4.
    pub num_buckets: u64,
    /// The SipHash key of `strong` (ignored by `fingerprint64`).
    #[serde(default)]
    pub key: [u64; 2],
}

fn default_hash_kind() -> String {
    "fingerprint64".into()
}

impl FeatureHash {
    /// Fingerprint64 into `num_buckets` buckets.
    pub fn fingerprint64(num_buckets: u64) -> FeatureHash {
        FeatureHash { kind: default_hash_kind(), num_buckets, key: [0, 0] }
    }

    /// The wire code of the kind, or an error naming the known kinds.
    pub fn code(&self) -> Result<u8, ProtoError> {
        match self.kind.as_str() {
            "fingerprint64" => Ok(0),
            "strong" => Ok(1),
            k => Err(ProtoError::bad_request(format!(
                "bad features: hash kind {k:?} is unknown: use fingerprint64 or strong"
            ))),
        }
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
    pub fn strings<S: AsRef<[u8]>>(items: &[S]) -> Features {
        let mut bytes = vec![];
        let mut offsets = vec![0u32];
        for s in items {
            bytes.extend_from_slice(s.as_ref());
            offsets.push(bytes.len() as u32);
        }
        Features::Strings { bytes, offsets }
    }
}

fn hash_put(w: &mut Writer, h: &HashSpec) {
    match h {
        HashSpec::Table => {
            w.raw(&[0xFF]);
        }
        HashSpec::Given(f) => {
            // An unknown kind name goes out as code 0xFE, which the daemon refuses.
            w.raw(&[f.code().unwrap_or(0xFE)]).u64(f.num_buckets).u64(f.key[0]).u64(f.key[1]);
        }
    }
}

fn hash_get(r: &mut Reader<'_>) -> Result<HashSpec, ProtoError> {
    let code = r.u8("hash kind")?;
    let kind = match code {
        0xFF => return Ok(HashSpec::Table),
        0 => "fingerprint64",
        1 => "strong",
        c => {
            return Err(ProtoError::bad_request(format!(
                "bad features: hash kind {c} is unknown: use 0 (fingerprint64), 1 (strong) or 255 (the table's)"
            )))
        }
    };
    let num_buckets = r.u64("num_buckets")?;
    let key = [r.u64("hash key")?, r.u64("hash key")?];
    Ok(HashSpec::Given(FeatureHash { kind: kind.into(), num_buckets, key }))
}

fn features_put(w: &mut Writer, f: &Features) {
    match f {
        Features::Int64(v) => {
            w.raw(&[0]).i64s(v);
        }
        Features::Strings { bytes, offsets } => {
            w.raw(&[1]).u32s(offsets).u8s(bytes);
        }
    }
}

fn features_get(r: &mut Reader<'_>) -> Result<Features, ProtoError> {
    match r.u8("feature type")? {
        0 => Ok(Features::Int64(r.i64s("int64 features")?)),
        1 => {
            let offsets = r.u32s("string offsets")?;
            Ok(Features::Strings { offsets, bytes: r.u8s("string bytes")? })
        }
        t => Err(ProtoError::bad_request(format!(
            "bad features: feature type {t} is unknown: use 0 (int64) or 1 (strings)"
        ))),
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
    /// `lru`, `lfu`, `epoch-lru`, `epoch-lfu` or `custom`.
    #[serde(default = "default_policy")]
    pub policy: String,
    /// `single` or `dual`.
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Device-memory byte budget for values over all shards (CUDA); none = all.
    #[serde(default)]
    pub fast_tier_bytes: Option<u64>,
    /// Growth threshold (default 0.5).
    #[serde(default)]
    pub max_load_factor: Option<f64>,
    /// The hash feature requests use when they name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<FeatureHash>,
}

fn default_policy() -> String {
    "lru".into()
}
fn default_mode() -> String {
    "single".into()
}

impl TableSpec {
    /// A spec with defaults for everything but name, dim and capacity.
    pub fn new(name: &str, dim: usize, capacity: u64) -> TableSpec {
        TableSpec {
            name: name.into(),
            dim,
            capacity,
            max_capacity: 0,
            policy: default_policy(),
            mode: default_mode(),
            fast_tier_bytes: None,
            max_load_factor: None,
            hash: None,
        }
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
}

/// Control requests (JSON bodies where they have one).
#[derive(Debug, Clone, PartialEq)]
pub enum Control {
    /// Create a table (admin).
    CreateTable(TableSpec),
    /// Drop a table (admin).
    DropTable {
        /// Its name.
        name: String,
    },
    /// List tables.
    ListTables,
    /// Daemon, table and shard statistics as JSON.
    Stats,
    /// Prometheus text.
    Metrics,
    /// Drain and exit (admin).
    Shutdown,
    /// Start a checkpoint (admin). With `wait`, answer when it is complete.
    Checkpoint {
        /// Answer only once the checkpoint is complete.
        wait: bool,
        /// Force a full checkpoint (else the schedule decides).
        full: bool,
    },
    /// List checkpoints.
    ListCheckpoints,
    /// Restore a checkpoint (`latest` or an id) into the running daemon (admin).
    Restore {
        /// `latest` or a hex id.
        id: String,
    },
}

/// A request.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Liveness.
    Ping,
    /// Raw bandwidth: the daemon replies with `reply_len` zero bytes; `padding`
    /// bytes are sent along to mimic a request's size.
    Echo {
        /// Bytes wanted back.
        reply_len: u32,
        /// Bytes sent along.
        padding: usize,
    },
    /// Values (and optionally scores) of keys.
    Find {
        /// Table.
        table: String,
        /// Keys.
        keys: Vec<u64>,
        /// Return scores too.
        scores: bool,
    },
    /// Presence of keys.
    Contains {
        /// Table.
        table: String,
        /// Keys.
        keys: Vec<u64>,
    },
    /// insert_or_assign, insert_and_evict, find_or_insert, assign,
    /// accum_or_assign or load (the op code says which).
    Write {
        /// One of the write op codes.
        op: u8,
        /// Table.
        table: String,
        /// Keys.
        keys: Vec<u64>,
        /// Values or deltas, dim per key.
        values: Vec<f32>,
        /// Scores (required by load and by the custom policy).
        scores: Option<Vec<u64>>,
        /// Return per-key outcomes.
        outcomes: bool,
    },
    /// Write scores of present keys.
    AssignScores {
        /// Table.
        table: String,
        /// Keys.
        keys: Vec<u64>,
        /// Scores (policy rules apply; none refreshes clock policies).
        scores: Option<Vec<u64>>,
        /// Return per-key outcomes.
        outcomes: bool,
    },
    /// Remove keys.
    Erase {
        /// Table.
        table: String,
        /// Keys.
        keys: Vec<u64>,
        /// Return per-key erased flags.
        outcomes: bool,
    },
    /// Remove every matching entry.
    EraseIf {
        /// Table.
        table: String,
        /// Predicate.
        filter: Filter,
    },
    /// Remove everything.
    Clear {
        /// Table.
        table: String,
    },
    /// One chunk of a table walk.
    Export {
        /// Table.
        table: String,
        /// Where to start.
        cursor: Cursor,
        /// Slots to scan at most.
        max_slots: u64,
        /// Predicate.
        filter: Filter,
    },
    /// Set the epoch of epoch policies.
    SetEpoch {
        /// Table.
        table: String,
        /// Epoch.
        epoch: u32,
    },
    /// Grow to at least this many slots over all shards.
    Reserve {
        /// Table.
        table: String,
        /// Slots.
        capacity: u64,
    },
    /// Features to keys. `table` may be empty unless `hash` is the table's.
    Hash {
        /// Table whose hash setting applies, or "".
        table: String,
        /// The hash.
        hash: HashSpec,
        /// The features.
        features: Features,
    },
    /// Features to keys, then find: one round trip.
    FindFeatures {
        /// Table.
        table: String,
        /// The hash.
        hash: HashSpec,
        /// The features.
        features: Features,
        /// Return scores too.
        scores: bool,
    },
    /// Features to keys, then find_or_insert.
    FindOrInsertFeatures {
        /// Table.
        table: String,
        /// The hash.
        hash: HashSpec,
        /// The features.
        features: Features,
        /// Values inserted for absent keys, dim per feature.
        values: Vec<f32>,
        /// Scores (custom and lfu policies).
        scores: Option<Vec<u64>>,
        /// Return per-key outcomes.
        outcomes: bool,
    },
    /// A control request.
    Control(Control),
}

/// The write op codes carried by [`Request::Write`].
pub const WRITE_OPS: [u8; 6] =
    [op::INSERT_OR_ASSIGN, op::INSERT_AND_EVICT, op::FIND_OR_INSERT, op::ASSIGN, op::ACCUM_OR_ASSIGN, op::LOAD];

/// The name of an op code, for messages.
pub fn op_name(code: u8) -> &'static str {
    match code {
        op::PING => "ping",
        op::ECHO => "echo",
        op::FIND => "find",
        op::CONTAINS => "contains",
        op::INSERT_OR_ASSIGN => "insert_or_assign",
        op::INSERT_AND_EVICT => "insert_and_evict",
        op::FIND_OR_INSERT => "find_or_insert",
        op::ASSIGN => "assign",
        op::ASSIGN_SCORES => "assign_scores",
        op::ACCUM_OR_ASSIGN => "accum_or_assign",
        op::ERASE => "erase",
        op::ERASE_IF => "erase_if",
        op::CLEAR => "clear",
        op::EXPORT => "export",
        op::LOAD => "load",
        op::SET_EPOCH => "set_epoch",
        op::RESERVE => "reserve",
        op::CREATE_TABLE => "create_table",
        op::DROP_TABLE => "drop_table",
        op::LIST_TABLES => "list_tables",
        op::STATS => "stats",
        op::METRICS => "metrics",
        op::SHUTDOWN => "shutdown",
        op::CHECKPOINT => "checkpoint",
        op::LIST_CHECKPOINTS => "list_checkpoints",
        op::RESTORE => "restore",
        op::HASH => "hash",
        op::FIND_FEATURES => "find_features",
        op::FIND_OR_INSERT_FEATURES => "find_or_insert_features",
        _ => "unknown",
    }
}

fn filter_put(w: &mut Writer, f: &Filter) {
    w.u64(f.key_mask).u64(f.key_pattern).u64(f.min_score).u64(f.max_score);
}

fn filter_get(r: &mut Reader<'_>) -> Result<Filter, ProtoError> {
    Ok(Filter {
        key_mask: r.u64("filter")?,
        key_pattern: r.u64("filter")?,
        min_score: r.u64("filter")?,
        max_score: r.u64("filter")?,
    })
}

fn features_bytes(f: &Features) -> usize {
    match f {
        Features::Int64(v) => v.len() * 8,
        Features::Strings { bytes, offsets } => bytes.len() + offsets.len() * 4,
    }
}

fn json<T: Serialize>(x: &T) -> Vec<u8> {
    serde_json::to_vec(x).expect("plain data serializes")
}

fn from_json<'a, T: Deserialize<'a>>(b: &'a [u8], what: &str) -> Result<T, ProtoError> {
    serde_json::from_slice(b).map_err(|e| ProtoError::bad_request(format!("{what}: {e}")))
}

impl Request {
    /// The op code.
    pub fn op(&self) -> u8 {
        match self {
            Request::Ping => op::PING,
            Request::Echo { .. } => op::ECHO,
            Request::Find { .. } => op::FIND,
            Request::Contains { .. } => op::CONTAINS,
            Request::Write { op, .. } => *op,
            Request::AssignScores { .. } => op::ASSIGN_SCORES,
            Request::Erase { .. } => op::ERASE,
            Request::EraseIf { .. } => op::ERASE_IF,
            Request::Clear { .. } => op::CLEAR,
            Request::Export { .. } => op::EXPORT,
            Request::SetEpoch { .. } => op::SET_EPOCH,
            Request::Reserve { .. } => op::RESERVE,
            Request::Hash { .. } => op::HASH,
            Request::FindFeatures { .. } => op::FIND_FEATURES,
            Request::FindOrInsertFeatures { .. } => op::FIND_OR_INSERT_FEATURES,
            Request::Control(c) => match c {
                Control::CreateTable(_) => op::CREATE_TABLE,
                Control::DropTable { .. } => op::DROP_TABLE,
                Control::ListTables => op::LIST_TABLES,
                Control::Stats => op::STATS,
                Control::Metrics => op::METRICS,
                Control::Shutdown => op::SHUTDOWN,
                Control::Checkpoint { .. } => op::CHECKPOINT,
                Control::ListCheckpoints => op::LIST_CHECKPOINTS,
                Control::Restore { .. } => op::RESTORE,
            },
        }
    }

    /// The table it addresses, if any.
    pub fn table(&self) -> Option<&str> {
        match self {
            Request::Find { table, .. }
            | Request::Contains { table, .. }
            | Request::Write { table, .. }
            | Request::AssignScores { table, .. }
            | Request::Erase { table, .. }
            | Request::EraseIf { table, .. }
            | Request::Clear { table }
            | Request::Export { table, .. }
            | Request::SetEpoch { table, .. }
            | Request::Reserve { table, .. }
            | Request::Hash { table, .. }
            | Request::FindFeatures { table, .. }
            | Request::FindOrInsertFeatures { table, .. } => Some(table),
            _ => None,
        }
    }

    /// Whether only admins may send it.
    pub fn is_admin(&self) -> bool {
        is_admin_op(self.op())
    }
}

/// Whether op code `code` is an admin operation (decided from the header
/// alone, so that a peer without rights learns nothing from the decoder).
pub fn is_admin_op(code: u8) -> bool {
    matches!(code, op::CREATE_TABLE | op::DROP_TABLE | op::SHUTDOWN | op::CHECKPOINT | op::RESTORE)
}

impl Request {
    /// The whole frame with request id `id`.
    pub fn encode(&self, id: u64) -> Vec<u8> {
        self.encode_into(id, Vec::new())
    }

    /// [`Request::encode`] into `buf`, whose contents go and whose memory
    /// is reused; returns it holding the frame. A field too long for the
    /// protocol is cut: senders use [`Request::try_encode_into`].
    pub fn encode_into(&self, id: u64, buf: Vec<u8>) -> Vec<u8> {
        let (w, fl) = self.writer(buf);
        w.finish_frame(self.op(), fl, id)
    }

    /// [`Request::encode_into`], or an error naming the field that does not
    /// fit the protocol (a table name over 65535 bytes, an array over
    /// 2^32 − 1 elements, a body over 4 GiB − 1); the buffer comes back
    /// with the error so that its memory is kept.
    #[allow(clippy::result_large_err)]
    pub fn try_encode_into(&self, id: u64, buf: Vec<u8>) -> Result<Vec<u8>, (ProtoError, Vec<u8>)> {
        let (w, fl) = self.writer(buf);
        match w.check() {
            Ok(()) => Ok(w.finish_frame(self.op(), fl, id)),
            Err(e) => Err((e, w.buf)),
        }
    }

    /// The body written after room for the header, and the header's flags.
    fn writer(&self, buf: Vec<u8>) -> (Writer, u16) {
        let mut w = Writer::framed_in(buf, 64);
        let mut fl = 0u16;
        match self {
            Request::Ping => {}
            Request::Echo { reply_len, padding } => {
                w.u32(*reply_len);
                w.buf.resize(HEADER_LEN + 4 + padding, 0);
            }
            Request::Find { table, keys, scores } => {
                w.buf.reserve(2 + table.len() + 4 + keys.len() * 8);
                w.str(table).u64s(keys);
                if *scores {
                    fl |= flags::SCORES;
                }
            }
            Request::Contains { table, keys } => {
                w.str(table).u64s(keys);
            }
            Request::Write { table, keys, values, scores, outcomes, .. } => {
                w.buf.reserve(16 + table.len() + keys.len() * 8 + values.len() * 4);
                w.str(table).u64s(keys).f32s(values);
                if let Some(s) = scores {
                    w.u64s(s);
                    fl |= flags::SCORES;
                }
                if *outcomes {
                    fl |= flags::OUTCOMES;
                }
            }
            Request::AssignScores { table, keys, scores, outcomes } => {
                w.str(table).u64s(keys);
                if let Some(s) = scores {
                    w.u64s(s);
                    fl |= flags::SCORES;
                }
                if *outcomes {
                    fl |= flags::OUTCOMES;
                }
            }
            Request::Erase { table, keys, outcomes } => {
                w.str(table).u64s(keys);
                if *outcomes {
                    fl |= flags::OUTCOMES;
                }
            }
            Request::EraseIf { table, filter } => {
                w.str(table);
                filter_put(&mut w, filter);
            }
            Request::Clear { table } => {
                w.str(table);
            }
            Request::Export { table, cursor, max_slots, filter } => {
                w.str(table).u32(cursor.shard).u64(cursor.offset).u64(*max_slots);
                filter_put(&mut w, filter);
            }
            Request::SetEpoch { table, epoch } => {
                w.str(table).u32(*epoch);
            }
            Request::Reserve { table, capacity } => {
                w.str(table).u64(*capacity);
            }
            Request::Hash { table, hash, features } => {
                w.buf.reserve(64 + table.len() + features_bytes(features));
                w.str(table);
                hash_put(&mut w, hash);
                features_put(&mut w, features);
            }
            Request::FindFeatures { table, hash, features, scores } => {
                w.buf.reserve(64 + table.len() + features_bytes(features));
                w.str(table);
                hash_put(&mut w, hash);
                features_put(&mut w, features);
                if *scores {
                    fl |= flags::SCORES;
                }
            }
            Request::FindOrInsertFeatures { table, hash, features, values, scores, outcomes } => {
                w.buf.reserve(64 + table.len() + features_bytes(features) + values.len() * 4);
                w.str(table);
                hash_put(&mut w, hash);
                features_put(&mut w, features);
                w.f32s(values);
                if let Some(s) = scores {
                    w.u64s(s);
                    fl |= flags::SCORES;
                }
                if *outcomes {
                    fl |= flags::OUTCOMES;
                }
            }
            Request::Control(c) => match c {
                Control::CreateTable(spec) => w.buf.extend(json(spec)),
                Control::DropTable { name } => w.buf.extend(json(&serde_json::json!({ "name": name }))),
                Control::Checkpoint { wait, full } => {
                    w.buf.extend(json(&serde_json::json!({ "wait": wait, "full": full })))
                }
                Control::Restore { id } => w.buf.extend(json(&serde_json::json!({ "id": id }))),
                _ => {}
            },
        }
        (w, fl)
    }

    /// Parses a request body. Errors name the field at fault.
    pub fn decode(h: &Header, body: &[u8]) -> Result<Request, ProtoError> {
        let mut r = Reader::new(body);
        let scores = h.flags & flags::SCORES != 0;
        let outcomes = h.flags & flags::OUTCOMES != 0;
        let req = match h.op {
            op::PING => Request::Ping,
            op::ECHO => {
                let reply_len = r.u32("reply_len")?;
                let padding = r.rest().len();
                Request::Echo { reply_len, padding }
            }
            op::FIND => Request::Find { table: r.str("table")?.into(), keys: r.u64s("keys")?, scores },
            op::CONTAINS => Request::Contains { table: r.str("table")?.into(), keys: r.u64s("keys")? },
            o if WRITE_OPS.contains(&o) => {
                let table = r.str("table")?.into();
                let keys = r.u64s("keys")?;
                let values = r.f32s("values")?;
                let scores = if scores { Some(r.u64s("scores")?) } else { None };
                Request::Write { op: o, table, keys, values, scores, outcomes }
            }
            op::ASSIGN_SCORES => {
                let table = r.str("table")?.into();
                let keys = r.u64s("keys")?;
                let scores = if scores { Some(r.u64s("scores")?) } else { None };
                Request::AssignScores { table, keys, scores, outcomes }
            }
            op::ERASE => Request::Erase { table: r.str("table")?.into(), keys: r.u64s("keys")?, outcomes },
            op::ERASE_IF => Request::EraseIf { table: r.str("table")?.into(), filter: filter_get(&mut r)? },
            op::CLEAR => Request::Clear { table: r.str("table")?.into() },
            op::EXPORT => {
                let table = r.str("table")?.into();
                let cursor = Cursor { shard: r.u32("shard")?, offset: r.u64("offset")? };
                let max_slots = r.u64("max_slots")?;
                Request::Export { table, cursor, max_slots, filter: filter_get(&mut r)? }
            }
            op::SET_EPOCH => Request::SetEpoch { table: r.str("table")?.into(), epoch: r.u32("epoch")? },
            op::RESERVE => Request::Reserve { table: r.str("table")?.into(), capacity: r.u64("capacity")? },
            op::HASH => Request::Hash {
                table: r.str("table")?.into(),
                hash: hash_get(&mut r)?,
                features: features_get(&mut r)?,
            },
            op::FIND_FEATURES => Request::FindFeatures {
                table: r.str("table")?.into(),
                hash: hash_get(&mut r)?,
                features: features_get(&mut r)?,
                scores,
            },
            op::FIND_OR_INSERT_FEATURES => {
                let table = r.str("table")?.into();
                let hash = hash_get(&mut r)?;
                let features = features_get(&mut r)?;
                let values = r.f32s("values")?;
                let scores = if scores { Some(r.u64s("scores")?) } else { None };
                Request::FindOrInsertFeatures { table, hash, features, values, scores, outcomes }
            }
            op::CREATE_TABLE => Request::Control(Control::CreateTable(from_json(r.rest(), "create_table body")?)),
            op::DROP_TABLE => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Drop {
                    name: String,
                }
                let d: Drop = from_json(r.rest(), "drop_table body")?;
                Request::Control(Control::DropTable { name: d.name })
            }
            op::CHECKPOINT => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Ck {
                    #[serde(default)]
                    wait: bool,
                    #[serde(default)]
                    full: bool,
                }
                let c: Ck = if r.remaining() == 0 {
                    Ck { wait: false, full: false }
                } else {
                    from_json(r.rest(), "checkpoint body")?
                };
                Request::Control(Control::Checkpoint { wait: c.wait, full: c.full })
            }
            op::LIST_CHECKPOINTS => Request::Control(Control::ListCheckpoints),
            op::RESTORE => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Re {
                    id: String,
                }
                let x: Re = from_json(r.rest(), "restore body")?;
                Request::Control(Control::Restore { id: x.id })
            }
            op::LIST_TABLES => Request::Control(Control::ListTables),
            op::STATS => Request::Control(Control::Stats),
            op::METRICS => Request::Control(Control::Metrics),
            op::SHUTDOWN => Request::Control(Control::Shutdown),
            o => {
                return Err(ProtoError::new(
                    ErrorCode::UnknownOp,
                    format!("op code {o:#04x} is not part of protocol version 1"),
                ))
            }
        };
        r.finish()?;
        Ok(req)
    }
}

/// A response.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// No body (ping, clear, set_epoch, reserve, drop_table, shutdown).
    Empty,
    /// echo: how many bytes came back.
    Echo {
        /// Body bytes.
        len: usize,
    },
    /// find.
    Find {
        /// 1 = found, per key.
        found: Vec<u8>,
        /// dim floats per key; 0.0 for misses.
        values: Vec<f32>,
        /// Scores when asked for (0 for misses).
        scores: Option<Vec<u64>>,
    },
    /// contains.
    Contains {
        /// 1 = present, per key.
        found: Vec<u8>,
    },
    /// The write ops.
    Write {
        /// Counts.
        summary: Summary,
        /// Per-key outcome bytes when asked for.
        outcomes: Option<Vec<u8>>,
        /// find_or_insert: the values.
        values: Option<Vec<f32>>,
        /// insert_and_evict: what lost its slot.
        evicted: Option<Evicted>,
    },
    /// erase and erase_if.
    Erased {
        /// Entries removed.
        count: u64,
        /// Per-key flags (erase with OUTCOMES).
        flags: Option<Vec<u8>>,
    },
    /// export.
    Export {
        /// Where to continue; none when the walk is over.
        next: Option<Cursor>,
        /// Keys.
        keys: Vec<u64>,
        /// Values.
        values: Vec<f32>,
        /// Scores.
        scores: Vec<u64>,
    },
    /// hash: one key per feature.
    Keys(Vec<u64>),
    /// create_table, list_tables, stats: a JSON document.
    Json(Vec<u8>),
    /// metrics: Prometheus text.
    Text(String),
    /// An error.
    Error(ProtoError),
    /// A response frame the server built in place ([`FindFrame`]):
    /// [`HEADER_LEN`] bytes of header space, then the encoded body. Never
    /// decoded: the client sees the op's own response.
    Framed(FrameBuf),
}

/// Memory an answer frame can live in besides a `Vec<u8>`: pinned host
/// memory that a GPU writes rows into directly, for instance.
pub trait FrameMemory: Send + Sync {
    /// The frame's bytes.
    fn bytes(&self) -> &[u8];
    /// The frame's bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// The most bytes the frame can have.
    fn capacity(&self) -> usize;
    /// Makes the frame `len` bytes (at most [`FrameMemory::capacity`]); the
    /// bytes that come into it hold what the memory held (never anything
    /// uninitialised).
    fn set_len(&mut self, len: usize);
}

/// The bytes of a frame: a vector, or other memory ([`FrameMemory`]).
pub enum FrameBuf {
    /// Heap memory.
    Vec(Vec<u8>),
    /// Other memory.
    Other(Box<dyn FrameMemory>),
}

impl FrameBuf {
    /// The frame's bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            FrameBuf::Vec(v) => v,
            FrameBuf::Other(m) => m.bytes(),
        }
    }

    /// The frame's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            FrameBuf::Vec(v) => v,
            FrameBuf::Other(m) => m.bytes_mut(),
        }
    }

    /// The most bytes the frame can have without new memory.
    pub fn capacity(&self) -> usize {
        match self {
            FrameBuf::Vec(v) => v.capacity(),
            FrameBuf::Other(m) => m.capacity(),
        }
    }

    /// Makes the frame `len` bytes: bytes already in it keep their values,
    /// new ones are zero, or for other memory hold what it held. Other
    /// memory cannot grow past its capacity: such a frame becomes a
    /// zeroed vector.
    pub fn set_len(&mut self, len: usize) {
        match self {
            FrameBuf::Vec(v) => v.resize(len, 0),
            FrameBuf::Other(m) if len <= m.capacity() => m.set_len(len),
            FrameBuf::Other(_) => *self = FrameBuf::Vec(vec![0; len]),
        }
    }
}

impl std::fmt::Debug for FrameBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if matches!(self, FrameBuf::Vec(_)) { "Vec" } else { "Other" };
        write!(f, "FrameBuf::{kind}({} bytes)", self.bytes().len())
    }
}

/// A copy is a vector of the same bytes.
impl Clone for FrameBuf {
    fn clone(&self) -> FrameBuf {
        FrameBuf::Vec(self.bytes().to_vec())
    }
}

/// Frames are equal when their bytes are.
impl PartialEq for FrameBuf {
    fn eq(&self, o: &FrameBuf) -> bool {
        self.bytes() == o.bytes()
    }
}

/// A find response laid out in one frame before the table answers, so
/// that the answers are written where they are sent from: header space, a
/// `u32` count and one found byte per key, a `u32` count and `dim` f32 per
/// key (no scores). From [`FindFrame::new`] every byte starts at zero; from
/// [`FindFrame::reuse`] the found bytes and values hold what the buffer
/// held, and whoever fills the frame writes every one of them.
#[derive(Debug)]
pub struct FindFrame {
    frame: FrameBuf,
    n: usize,
}

impl FindFrame {
    /// The frame for `n` keys of `dim` floats.
    pub fn new(n: usize, dim: usize) -> FindFrame {
        let values = FindFrame::values_at(n);
        let mut frame = vec![0u8; values + n * dim * 4];
        frame[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&(n as u32).to_le_bytes());
        frame[values - 4..values].copy_from_slice(&((n * dim) as u32).to_le_bytes());
        FindFrame { frame: FrameBuf::Vec(frame), n }
    }

    /// The frame for `n` keys of `dim` floats in the memory of `buf`, an
    /// earlier frame, without zeroing it: the found bytes and values keep
    /// whatever `buf` held up to its length (the rest is zero), so the
    /// caller must write every one of them before the frame is sent.
    pub fn reuse(mut buf: FrameBuf, n: usize, dim: usize) -> FindFrame {
        let values = FindFrame::values_at(n);
        buf.set_len(values + n * dim * 4);
        // The header space is written when the frame is sent (`Response::into_frame`).
        let b = buf.bytes_mut();
        b[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&(n as u32).to_le_bytes());
        b[values - 4..values].copy_from_slice(&((n * dim) as u32).to_le_bytes());
        FindFrame { frame: buf, n }
    }

    /// Where the values of `n` keys start in the frame.
    pub fn values_at(n: usize) -> usize {
        HEADER_LEN + 8 + n
    }

    /// The found bytes and the values' little-endian bytes.
    pub fn parts_mut(&mut self) -> (&mut [u8], &mut [u8]) {
        let (head, values) = self.frame.bytes_mut().split_at_mut(FindFrame::values_at(self.n));
        (&mut head[HEADER_LEN + 4..HEADER_LEN + 4 + self.n], values)
    }

    /// The response to send.
    pub fn into_response(self) -> Response {
        Response::Framed(self.frame)
    }
}

impl Response {
    /// The whole frame answering request `id` of op `req_op`, reusing a
    /// [`Response::Framed`] buffer (its header is written in place).
    pub fn into_frame(self, req_op: u8, id: u64) -> FrameBuf {
        match self {
            Response::Framed(mut frame) => {
                crate::Header::write_into(req_op, flags::RESPONSE, id, frame.bytes_mut());
                frame
            }
            other => FrameBuf::Vec(other.encode(req_op, id)),
        }
    }

    /// The whole frame answering request `id` of op `req_op`.
    pub fn encode(&self, req_op: u8, id: u64) -> Vec<u8> {
        let mut w = Writer::framed(64);
        let mut fl = flags::RESPONSE;
        let mut code = req_op;
        match self {
            Response::Empty => {}
            Response::Echo { len } => w.buf.resize(HEADER_LEN + *len, 0),
            Response::Find { found, values, scores } => {
                w = Writer::framed(16 + found.len() + values.len() * 4);
                w.u8s(found).f32s(values);
                if let Some(s) = scores {
                    w.u64s(s);
                    fl |= flags::SCORES;
                }
            }
            Response::Contains { found } => {
                w.u8s(found);
            }
            Response::Write { summary, outcomes, values, evicted } => {
                let s = summary;
                w.u64(s.updated).u64(s.inserted).u64(s.evicted).u64(s.rejected).u64(s.absent);
                if let Some(o) = outcomes {
                    w.u8s(o);
                    fl |= flags::OUTCOMES;
                }
                if let Some(v) = values {
                    w.f32s(v);
                }
                if let Some(e) = evicted {
                    w.u64s(&e.keys).f32s(&e.values).u64s(&e.scores).u8s(&e.kinds);
                }
            }
            Response::Erased { count, flags: f } => {
                w.u64(*count);
                if let Some(f) = f {
                    w.u8s(f);
                    fl |= flags::OUTCOMES;
                }
            }
            Response::Export { next, keys, values, scores } => {
                let c = next.unwrap_or(Cursor { shard: u32::MAX, offset: 0 });
                w.u32(c.shard).u64(c.offset).u64s(keys).f32s(values).u64s(scores);
            }
            Response::Keys(k) => {
                w = Writer::framed(8 + k.len() * 8);
                w.u64s(k);
            }
            Response::Json(j) => w.buf.extend_from_slice(j),
            Response::Text(t) => w.buf.extend_from_slice(t.as_bytes()),
            Response::Error(e) => {
                code = op::ERROR;
                fl |= flags::ERROR;
                w.buf.extend(json(e));
            }
            Response::Framed(frame) => w.buf.extend_from_slice(&frame.bytes()[HEADER_LEN..]),
        }
        w.finish_frame(code, fl, id)
    }

    /// Parses a response body.
    pub fn decode(h: &Header, body: &[u8]) -> Result<Response, ProtoError> {
        Self::decode_into(h, body, Vec::new(), Vec::new())
    }

    /// [`Response::decode`] that reads a find answer's arrays into `found`
    /// and `values`, reusing their memory (a client that hands each answer
    /// back allocates nothing for the next); other answers drop them.
    pub fn decode_into(h: &Header, body: &[u8], found: Vec<u8>, values: Vec<f32>) -> Result<Response, ProtoError> {
        let mut r = Reader::new(body);
        let has_outcomes = h.flags & flags::OUTCOMES != 0;
        let resp = match h.op {
            op::ERROR => return Ok(Response::Error(from_json(body, "error body")?)),
            op::PING | op::CLEAR | op::SET_EPOCH | op::RESERVE | op::DROP_TABLE | op::SHUTDOWN => Response::Empty,
            op::ECHO => Response::Echo { len: r.rest().len() },
            op::HASH => Response::Keys(r.u64s("keys")?),
            op::FIND | op::FIND_FEATURES => {
                let found = r.u8s_into("found", found)?;
                let values = r.f32s_into("values", values)?;
                let scores = if h.flags & flags::SCORES != 0 { Some(r.u64s("scores")?) } else { None };
                Response::Find { found, values, scores }
            }
            op::CONTAINS => Response::Contains { found: r.u8s("found")? },
            o if WRITE_OPS.contains(&o) || o == op::ASSIGN_SCORES || o == op::FIND_OR_INSERT_FEATURES => {
                let summary = Summary {
                    updated: r.u64("summary")?,
                    inserted: r.u64("summary")?,
                    evicted: r.u64("summary")?,
                    rejected: r.u64("summary")?,
                    absent: r.u64("summary")?,
                };
                let outcomes = if has_outcomes { Some(r.u8s("outcomes")?) } else { None };
                let values = if matches!(o, op::FIND_OR_INSERT | op::FIND_OR_INSERT_FEATURES) {
                    Some(r.f32s("values")?)
                } else {
                    None
                };
                let evicted = if o == op::INSERT_AND_EVICT {
                    Some(Evicted {
                        keys: r.u64s("evicted keys")?,
                        values: r.f32s("evicted values")?,
                        scores: r.u64s("evicted scores")?,
                        kinds: r.u8s("evicted kinds")?,
                    })
                } else {
                    None
                };
                Response::Write { summary, outcomes, values, evicted }
            }
            op::ERASE | op::ERASE_IF => {
                let count = r.u64("count")?;
                let flags = if has_outcomes { Some(r.u8s("erased")?) } else { None };
                Response::Erased { count, flags }
            }
            op::EXPORT => {
                let shard = r.u32("next shard")?;
                let offset = r.u64("next offset")?;
                let next = (shard != u32::MAX).then_some(Cursor { shard, offset });
                Response::Export { next, keys: r.u64s("keys")?, values: r.f32s("values")?, scores: r.u64s("scores")? }
            }
            op::CREATE_TABLE | op::LIST_TABLES | op::STATS | op::CHECKPOINT | op::LIST_CHECKPOINTS | op::RESTORE => {
                Response::Json(r.rest().to_vec())
            }
            op::METRICS => Response::Text(
                String::from_utf8(r.rest().to_vec()).map_err(|e| ProtoError::bad_request(format!("metrics: {e}")))?,
            ),
            o => return Err(ProtoError::new(ErrorCode::UnknownOp, format!("response op {o:#04x}"))),
        };
        r.finish()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{check_frame, FrameCheck};

    #[test]
    fn a_request_whose_fields_do_not_fit_is_not_encoded() {
        let ok = Request::Find { table: "t".into(), keys: vec![1], scores: true };
        let f = ok.try_encode_into(7, Vec::new()).unwrap();
        assert_eq!(f, ok.encode(7));
        let long = Request::Find { table: "x".repeat(70_000), keys: vec![1], scores: false };
        let (e, buf) = long.try_encode_into(7, Vec::with_capacity(1 << 20)).unwrap_err();
        assert!(e.message.contains("70000 bytes"), "{e}");
        assert!(buf.capacity() >= 1 << 20, "the buffer comes back");
    }

    fn round(req: Request) {
        let f = req.encode(42);
        // Into a buffer that held a longer frame: the same bytes.
        assert_eq!(req.encode_into(42, vec![0xab; f.len() + 100]), f);
        let FrameCheck::Ready(h) = check_frame(&f, u32::MAX).unwrap() else { panic!() };
        assert_eq!(h.id, 42);
        assert_eq!(Request::decode(&h, &f[crate::HEADER_LEN..]).unwrap(), req);
    }

    fn round_resp(op: u8, resp: Response) {
        let f = resp.encode(op, 7);
        let FrameCheck::Ready(h) = check_frame(&f, u32::MAX).unwrap() else { panic!() };
        assert_eq!(Response::decode(&h, &f[crate::HEADER_LEN..]).unwrap(), resp);
    }

    #[test]
    fn a_find_frame_built_in_place_decodes_as_a_find() {
        for n in [0usize, 1, 3, 4] {
            let dim = 2;
            let mut ff = FindFrame::new(n, dim);
            let (found, values) = ff.parts_mut();
            assert_eq!((found.len(), values.len()), (n, n * dim * 4));
            // Every other key found, with values k + 0.5, k + 1.5.
            let mut want_vals = vec![0.0f32; n * dim];
            let mut want_found = vec![0u8; n];
            for k in (0..n).step_by(2) {
                found[k] = 1;
                want_found[k] = 1;
                for j in 0..dim {
                    let x = k as f32 + j as f32 + 0.5;
                    values[(k * dim + j) * 4..(k * dim + j + 1) * 4].copy_from_slice(&x.to_le_bytes());
                    want_vals[k * dim + j] = x;
                }
            }
            let want = Response::Find { found: want_found, values: want_vals, scores: None };
            let resp = ff.into_response();
            let copied = resp.encode(op::FIND, 9);
            let moved = resp.into_frame(op::FIND, 9);
            let moved = moved.bytes();
            assert_eq!(copied, moved, "n {n}");
            let FrameCheck::Ready(h) = check_frame(moved, u32::MAX).unwrap() else { panic!() };
            assert_eq!((h.op, h.id, h.flags), (op::FIND, 9, flags::RESPONSE));
            assert_eq!(Response::decode(&h, &moved[crate::HEADER_LEN..]).unwrap(), want, "n {n}");
            // Into arrays that held a longer answer: the same answer, in
            // their memory.
            let (f, v) = (vec![7u8; n + 9], vec![7.0f32; (n + 9) * dim]);
            let (fp, vp) = (f.as_ptr(), v.as_ptr());
            let got = Response::decode_into(&h, &moved[crate::HEADER_LEN..], f, v).unwrap();
            let Response::Find { found, values, .. } = &got else { panic!() };
            assert_eq!((found.as_ptr(), values.as_ptr()), (fp, vp), "n {n}: memory reused");
            assert_eq!(got, want, "n {n}");
        }
    }

    /// Memory of a fixed capacity standing in for pinned memory.
    struct Fixed(Vec<u8>, usize);
    impl crate::FrameMemory for Fixed {
        fn bytes(&self) -> &[u8] {
            &self.0[..self.1]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0[..self.1]
        }
        fn capacity(&self) -> usize {
            self.0.len()
        }
        fn set_len(&mut self, len: usize) {
            assert!(len <= self.0.len());
            self.1 = len;
        }
    }

    #[test]
    fn a_find_frame_in_other_memory_sends_the_same_bytes() {
        let (n, dim) = (5usize, 3usize);
        let fill = |ff: &mut FindFrame| {
            let (found, values) = ff.parts_mut();
            found.fill(1);
            for (i, b) in values.iter_mut().enumerate() {
                *b = i as u8;
            }
        };
        let mut a = FindFrame::new(n, dim);
        fill(&mut a);
        // Stale bytes in a larger memory: every byte sent is still written.
        let mut b = FindFrame::reuse(FrameBuf::Other(Box::new(Fixed(vec![0xee; 4096], 0))), n, dim);
        fill(&mut b);
        let (a, b) = (a.into_response().into_frame(op::FIND, 3), b.into_response().into_frame(op::FIND, 3));
        assert!(matches!(b, FrameBuf::Other(_)));
        assert_eq!(a.bytes(), b.bytes());
        // Other memory cannot grow past its capacity: a zeroed vector then.
        let mut small = FrameBuf::Other(Box::new(Fixed(vec![0xee; 16], 16)));
        small.set_len(100);
        assert!(matches!(&small, FrameBuf::Vec(v) if v.len() == 100 && v.iter().all(|&x| x == 0)));
    }

    #[test]
    fn requests_round_trip() {
        let t = "emb".to_string();
        round(Request::Ping);
        round(Request::Echo { reply_len: 100, padding: 12 });
        round(Request::Find { table: t.clone(), keys: vec![1, 2], scores: true });
        round(Request::Contains { table: t.clone(), keys: vec![3] });
        for op in WRITE_OPS {
            round(Request::Write {
                op,
                table: t.clone(),
                keys: vec![1],
                values: vec![0.5, 1.5],
                scores: Some(vec![9]),
                outcomes: true,
            });
        }
        round(Request::AssignScores { table: t.clone(), keys: vec![1], scores: None, outcomes: false });
        round(Request::Erase { table: t.clone(), keys: vec![1, 2, 3], outcomes: true });
        round(Request::EraseIf { table: t.clone(), filter: Filter { min_score: 3, ..Filter::default() } });
        round(Request::Clear { table: t.clone() });
        round(Request::Export {
            table: t.clone(),
            cursor: Cursor { shard: 2, offset: 128 },
            max_slots: 4096,
            filter: Filter::default(),
        });
        round(Request::SetEpoch { table: t.clone(), epoch: 5 });
        round(Request::Reserve { table: t.clone(), capacity: 1 << 20 });
        let strong = FeatureHash { kind: "strong".into(), num_buckets: 10, key: [1, 2] };
        round(Request::Hash {
            table: String::new(),
            hash: HashSpec::Given(strong),
            features: Features::Int64(vec![-1, 5]),
        });
        round(Request::FindFeatures {
            table: t.clone(),
            hash: HashSpec::Table,
            features: Features::strings(&["a", "", "bcd"]),
            scores: true,
        });
        round(Request::FindOrInsertFeatures {
            table: t,
            hash: HashSpec::Given(FeatureHash::fingerprint64(1 << 20)),
            features: Features::Int64(vec![7]),
            values: vec![0.5, 1.5],
            scores: Some(vec![3]),
            outcomes: true,
        });
        round(Request::Control(Control::CreateTable(TableSpec::new("x", 8, 1024))));
        round(Request::Control(Control::DropTable { name: "x".into() }));
        round(Request::Control(Control::Checkpoint { wait: true, full: false }));
        round(Request::Control(Control::Restore { id: "latest".into() }));
        for c in [Control::ListTables, Control::Stats, Control::Metrics, Control::Shutdown, Control::ListCheckpoints] {
            round(Request::Control(c));
        }
    }

    #[test]
    fn responses_round_trip() {
        round_resp(op::PING, Response::Empty);
        round_resp(op::ECHO, Response::Echo { len: 33 });
        round_resp(op::FIND, Response::Find { found: vec![1, 0], values: vec![1.0, 0.0], scores: Some(vec![5, 0]) });
        round_resp(op::CONTAINS, Response::Contains { found: vec![1] });
        let summary = Summary { updated: 1, inserted: 2, evicted: 3, rejected: 4, absent: 5 };
        round_resp(
            op::INSERT_OR_ASSIGN,
            Response::Write { summary, outcomes: Some(vec![1]), values: None, evicted: None },
        );
        round_resp(
            op::FIND_OR_INSERT,
            Response::Write { summary, outcomes: None, values: Some(vec![2.0]), evicted: None },
        );
        let ev = Evicted { keys: vec![4], values: vec![1.0], scores: vec![2], kinds: vec![0] };
        round_resp(op::INSERT_AND_EVICT, Response::Write { summary, outcomes: None, values: None, evicted: Some(ev) });
        round_resp(op::ERASE, Response::Erased { count: 2, flags: Some(vec![1, 1, 0]) });
        round_resp(op::ERASE_IF, Response::Erased { count: 2, flags: None });
        round_resp(
            op::EXPORT,
            Response::Export {
                next: Some(Cursor { shard: 1, offset: 9 }),
                keys: vec![1],
                values: vec![0.5],
                scores: vec![3],
            },
        );
        round_resp(op::EXPORT, Response::Export { next: None, keys: vec![], values: vec![], scores: vec![] });
        round_resp(op::STATS, Response::Json(b"{\"a\":1}".to_vec()));
        round_resp(op::HASH, Response::Keys(vec![1, 2, 3]));
        round_resp(op::FIND_FEATURES, Response::Find { found: vec![1], values: vec![1.0], scores: None });
        round_resp(
            op::FIND_OR_INSERT_FEATURES,
            Response::Write { summary, outcomes: Some(vec![1]), values: Some(vec![2.0]), evicted: None },
        );
        round_resp(op::METRICS, Response::Text("hkvd_up 1\n".into()));
        round_resp(op::FIND, Response::Error(ProtoError::new(ErrorCode::UnknownTable, "no table \"x\"")));
    }

    #[test]
    fn unknown_op_and_trailing_bytes_are_named() {
        let f = crate::frame(0x77, 0, 1, b"");
        let FrameCheck::Ready(h) = check_frame(&f, 100).unwrap() else { panic!() };
        assert_eq!(Request::decode(&h, b"").unwrap_err().code, ErrorCode::UnknownOp);
        let mut f = Request::Clear { table: "t".into() }.encode(1);
        f.push(0);
        f[16] += 1;
        let FrameCheck::Ready(h) = check_frame(&f, 100).unwrap() else { panic!() };
        assert_eq!(Request::decode(&h, &f[20..]).unwrap_err().code, ErrorCode::BadRequest);
    }
}

/// Writes the fuzzer's seed corpus: one encoded frame of every request and
/// response shape. `HKV_WRITE_CORPUS=proto/fuzz/corpus/frame cargo test -p hkv-proto -- --ignored corpus`
#[cfg(test)]
#[test]
#[ignore = "writes the fuzz seed corpus"]
fn write_fuzz_corpus() {
    let dir = std::path::PathBuf::from(std::env::var("HKV_WRITE_CORPUS").expect("HKV_WRITE_CORPUS=dir"));
    std::fs::create_dir_all(&dir).unwrap();
    let t = "emb".to_string();
    let mut frames: Vec<Vec<u8>> = vec![
        Request::Ping.encode(1),
        Request::Echo { reply_len: 64, padding: 8 }.encode(2),
        Request::Find { table: t.clone(), keys: vec![1, 2, 3], scores: true }.encode(3),
        Request::Contains { table: t.clone(), keys: vec![9] }.encode(4),
        Request::AssignScores { table: t.clone(), keys: vec![1], scores: Some(vec![2]), outcomes: true }.encode(5),
        Request::Erase { table: t.clone(), keys: vec![1, 2], outcomes: true }.encode(6),
        Request::EraseIf { table: t.clone(), filter: Filter::default() }.encode(7),
        Request::Clear { table: t.clone() }.encode(8),
        Request::Export { table: t.clone(), cursor: Cursor::default(), max_slots: 128, filter: Filter::default() }
            .encode(9),
        Request::SetEpoch { table: t.clone(), epoch: 3 }.encode(10),
        Request::Reserve { table: t.clone(), capacity: 4096 }.encode(11),
        Request::Control(Control::CreateTable(TableSpec::new("emb", 4, 1024))).encode(12),
        Request::Control(Control::DropTable { name: "emb".into() }).encode(13),
        Request::Control(Control::Stats).encode(14),
        Response::Find { found: vec![1, 0], values: vec![1.0, 2.0], scores: None }.encode(op::FIND, 15),
        Response::Error(ProtoError::new(ErrorCode::Truncated, "x")).encode(op::FIND, 16),
        Response::Export { next: None, keys: vec![1], values: vec![0.5], scores: vec![2] }.encode(op::EXPORT, 17),
        Request::Hash {
            table: String::new(),
            hash: HashSpec::Given(FeatureHash::fingerprint64(1000)),
            features: Features::Int64(vec![-1, 7]),
        }
        .encode(18),
        Request::FindFeatures {
            table: t.clone(),
            hash: HashSpec::Table,
            features: Features::strings(&["a", "bc"]),
            scores: true,
        }
        .encode(19),
        Request::FindOrInsertFeatures {
            table: t.clone(),
            hash: HashSpec::Given(FeatureHash { kind: "strong".into(), num_buckets: 9, key: [1, 2] }),
            features: Features::strings(&["x"]),
            values: vec![0.5; 4],
            scores: None,
            outcomes: true,
        }
        .encode(20),
    ];
    for (i, code) in WRITE_OPS.iter().enumerate() {
        let req = Request::Write {
            op: *code,
            table: t.clone(),
            keys: vec![5, 6],
            values: vec![0.5; 4],
            scores: Some(vec![1, 2]),
            outcomes: true,
        };
        frames.push(req.encode(100 + i as u64));
    }
    let pipelined: Vec<u8> = frames[..4].concat();
    frames.push(pipelined);
    for (i, f) in frames.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), f).unwrap();
    }
}
