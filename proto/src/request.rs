//! [`Request`] and [`Control`]: the typed requests, their encoding and
//! decoding (see PROTOCOL.md).

use serde::{Deserialize, Serialize};

use crate::body::{Reader, Writer};
use crate::error::{ErrorCode, ProtoError};
use crate::op::{Op, WriteOp};
use crate::types::{CheckpointId, Cursor, FeatureHash, Features, Filter, HashKind, HashSpec, Hyper, TableSpec};
use crate::{flags, Header, HEADER_LEN};

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
        /// Which.
        id: CheckpointId,
    },
    /// The keys a table's miss-ratio curves sample, collected for
    /// `seconds` (1 to [`Control::MAX_TRACE_SECONDS`]).
    Trace {
        /// The table.
        table: String,
        /// How long to collect.
        seconds: u32,
    },
    /// Drains a backed table's write-back queue into its cluster; answers
    /// once every queued row is there (nothing to do on other tables).
    Flush {
        /// The table.
        table: String,
    },
}

impl Control {
    /// The longest trace a request may ask for.
    pub const MAX_TRACE_SECONDS: u32 = 3600;
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
        /// Which write.
        op: WriteOp,
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
    /// One optimizer step in a table created with an optimizer: for each
    /// present key, its values and optimizer state updated from its
    /// gradient row.
    ApplyGradients {
        /// Table.
        table: String,
        /// The step's hyperparameters.
        hyper: Hyper,
        /// Keys.
        keys: Vec<u64>,
        /// Gradient rows: the table's value dim (`spec.dim`) per key.
        grads: Vec<f32>,
        /// Return per-key found flags and the updated values (OUTCOMES).
        outcomes: bool,
    },
    /// A control request.
    Control(Control),
}

/// Writes the hyperparameters (28 bytes).
pub(crate) fn hyper_put(w: &mut Writer, h: &Hyper) {
    w.f32(h.lr).f32(h.eps).f32(h.beta1).f32(h.beta2).f32(h.weight_decay).u64(h.step);
}

/// Reads the hyperparameters.
pub(crate) fn hyper_get(r: &mut Reader<'_>) -> Result<Hyper, ProtoError> {
    Ok(Hyper {
        lr: r.f32("lr")?,
        eps: r.f32("eps")?,
        beta1: r.f32("beta1")?,
        beta2: r.f32("beta2")?,
        weight_decay: r.f32("weight_decay")?,
        step: r.u64("step")?,
        sum: false,
    })
}

fn hash_put(w: &mut Writer, h: &HashSpec) {
    match h {
        HashSpec::Table => {
            w.raw(&[0xFF]);
        }
        HashSpec::Given(f) => {
            w.raw(&[f.kind.code()]).u64(f.num_buckets).u64(f.key[0]).u64(f.key[1]);
        }
    }
}

fn hash_get(r: &mut Reader<'_>) -> Result<HashSpec, ProtoError> {
    let code = r.u8("hash kind")?;
    let kind = match code {
        0xFF => return Ok(HashSpec::Table),
        0 => HashKind::Fingerprint64,
        1 => HashKind::Strong,
        c => {
            return Err(ProtoError::bad_request(format!(
                "bad features: hash kind {c} is unknown: use 0 (fingerprint64), 1 (strong) or 255 (the table's)"
            )))
        }
    };
    let num_buckets = r.u64("num_buckets")?;
    let key = [r.u64("hash key")?, r.u64("hash key")?];
    Ok(HashSpec::Given(FeatureHash { kind, num_buckets, key }))
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

pub(crate) fn json<T: Serialize>(x: &T) -> Vec<u8> {
    serde_json::to_vec(x).expect("plain data serializes")
}

/// Reads a JSON body `what` whose objects are PROTOCOL.md's. serde's
/// derived structs also read a JSON array, field by field in their order
/// (`create_table ["t", 4, 1000]` created a table, `"hash": ["strong", 5,
/// [1, 2]]` was a hash): a body or field that is an array where the value
/// read is an object (seen by writing the value back) is refused, naming it.
pub(crate) fn from_json<'a, T: Deserialize<'a> + Serialize>(b: &'a [u8], what: &str) -> Result<T, ProtoError> {
    let bad = |e: serde_json::Error| {
        ProtoError::bad_request(format!("{what}: {}", plain_types(&capped_quotes(&e.to_string()))))
    };
    let x: T = serde_json::from_slice(b).map_err(bad)?;
    let sent: serde_json::Value = serde_json::from_slice(b).map_err(bad)?;
    let read = serde_json::to_value(&x).map_err(bad)?;
    match array_for_object(&sent, &read) {
        None => Ok(x),
        Some(at) => {
            let at = if at.is_empty() { String::new() } else { format!(": field {at}") };
            Err(ProtoError::bad_request(format!(
                "{what}{at}: a JSON array where a JSON object is expected; send an object with named fields \
                 (PROTOCOL.md)"
            )))
        }
    }
}

/// Where `sent` has an array that was read as the object in `read` at the
/// same place: "" for the whole value, else the path (`hash`,
/// `backing.seeds[0]`). Fields that `read` leaves out are not looked into.
/// (The daemon's config file is checked with it too, as TOML turned JSON.)
pub fn array_for_object(sent: &serde_json::Value, read: &serde_json::Value) -> Option<String> {
    use serde_json::Value::{Array, Object};
    match (sent, read) {
        (Array(_), Object(_)) => Some(String::new()),
        (Object(s), Object(r)) => s.iter().find_map(|(k, v)| {
            let inner = array_for_object(v, r.get(k)?)?;
            Some(if inner.is_empty() || inner.starts_with('[') {
                format!("{k}{inner}")
            } else {
                format!("{k}.{inner}")
            })
        }),
        (Array(s), Array(r)) => s.iter().zip(r).enumerate().find_map(|(i, (v, w))| {
            let inner = array_for_object(v, w)?;
            Some(if inner.is_empty() || inner.starts_with('[') {
                format!("[{i}]{inner}")
            } else {
                format!("[{i}].{inner}")
            })
        }),
        _ => None,
    }
}

/// serde's message with each string it quotes from the body (an unknown
/// field or variant in backticks, a string value in double quotes) cut to
/// [`crate::error::QUOTED_CHARS`] characters, an ellipsis and its length:
/// a 1 MB unknown field name made a 1 MB error body.
fn capped_quotes(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len().min(1024));
    let mut rest = msg;
    while let Some(open) = rest.find(['`', '"']) {
        let delim = rest.as_bytes()[open];
        out.push_str(&rest[..=open]);
        let inner = &rest[open + 1..];
        // The closing delimiter: a backtick, or a double quote not escaped.
        let mut close = None;
        let mut escaped = false;
        for (i, b) in inner.bytes().enumerate() {
            if b == delim && !escaped {
                close = Some(i);
                break;
            }
            escaped = delim == b'"' && b == b'\\' && !escaped;
        }
        let Some(close) = close else {
            rest = inner;
            continue;
        };
        let quoted = &inner[..close];
        match quoted.char_indices().nth(crate::error::QUOTED_CHARS) {
            None => out.push_str(quoted),
            Some((end, _)) => {
                out.push_str(&quoted[..end]);
                out.push('…');
                out.push(delim as char);
                out.push_str(&format!(" ({} bytes)", quoted.len()));
                rest = &inner[close + 1..];
                continue;
            }
        }
        out.push(delim as char);
        rest = &inner[close + 1..];
    }
    out.push_str(rest);
    out
}

/// serde's message with the Rust type names it expects (`expected usize`,
/// `expected struct TableSpec`) said in JSON's words, for clients that
/// know no Rust.
fn plain_types(msg: &str) -> String {
    const WORDS: [(&str, &str); 12] = [
        ("u8", "an integer from 0 to 255"),
        ("u16", "an integer from 0 to 65535"),
        ("u32", "an integer from 0 to 4294967295"),
        ("u64", "an integer from 0 to 2^64 - 1"),
        ("usize", "an integer from 0 to 2^64 - 1"),
        ("i32", "an integer"),
        ("i64", "an integer"),
        ("f32", "a number"),
        ("f64", "a number"),
        ("bool", "true or false"),
        ("a string", "a string"),
        ("char", "a one-character string"),
    ];
    let mut out = msg.to_string();
    if let Some(at) = out.find("expected struct ") {
        let end = out[at + 16..].find(|c: char| !c.is_alphanumeric() && c != '_').map_or(out.len(), |e| at + 16 + e);
        out.replace_range(at..end, "expected a JSON object");
    }
    for (rust, json) in WORDS {
        for tail in [" at ", ""] {
            let from = format!("expected {rust}{tail}");
            if out.contains(&from) && (!tail.is_empty() || out.ends_with(&from)) {
                out = out.replace(&from, &format!("expected {json}{tail}"));
            }
        }
    }
    out
}

impl Request {
    /// The op.
    pub fn op(&self) -> Op {
        match self {
            Request::Ping => Op::Ping,
            Request::Echo { .. } => Op::Echo,
            Request::Find { .. } => Op::Find,
            Request::Contains { .. } => Op::Contains,
            Request::Write { op, .. } => Op::from(*op),
            Request::AssignScores { .. } => Op::AssignScores,
            Request::Erase { .. } => Op::Erase,
            Request::EraseIf { .. } => Op::EraseIf,
            Request::Clear { .. } => Op::Clear,
            Request::Export { .. } => Op::Export,
            Request::SetEpoch { .. } => Op::SetEpoch,
            Request::Reserve { .. } => Op::Reserve,
            Request::Hash { .. } => Op::Hash,
            Request::FindFeatures { .. } => Op::FindFeatures,
            Request::FindOrInsertFeatures { .. } => Op::FindOrInsertFeatures,
            Request::ApplyGradients { .. } => Op::ApplyGradients,
            Request::Control(c) => match c {
                Control::CreateTable(_) => Op::CreateTable,
                Control::DropTable { .. } => Op::DropTable,
                Control::ListTables => Op::ListTables,
                Control::Stats => Op::Stats,
                Control::Metrics => Op::Metrics,
                Control::Shutdown => Op::Shutdown,
                Control::Checkpoint { .. } => Op::Checkpoint,
                Control::ListCheckpoints => Op::ListCheckpoints,
                Control::Restore { .. } => Op::Restore,
                Control::Trace { .. } => Op::Trace,
                Control::Flush { .. } => Op::Flush,
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
            | Request::FindOrInsertFeatures { table, .. }
            | Request::ApplyGradients { table, .. } => Some(table),
            _ => None,
        }
    }

    /// Whether only admins may send it.
    pub fn is_admin(&self) -> bool {
        self.op().is_admin()
    }
}

impl Request {
    /// The whole frame with request id `id`.
    ///
    /// # Panics
    /// When a field does not fit the protocol; senders of fields a user
    /// chose use [`Request::try_encode_into`].
    pub fn encode(&self, id: u64) -> Vec<u8> {
        self.encode_into(id, Vec::new())
    }

    /// [`Request::encode`] into `buf`, whose contents go and whose memory
    /// is reused; returns it holding the frame.
    ///
    /// # Panics
    /// When a field does not fit the protocol (see [`Request::try_encode_into`]).
    pub fn encode_into(&self, id: u64, buf: Vec<u8>) -> Vec<u8> {
        self.try_encode_into(id, buf).unwrap_or_else(|(e, _)| panic!("{}", e.message))
    }

    /// [`Request::encode_into`], or an error naming the field that does not
    /// fit the protocol (a table name over 65535 bytes, an array over
    /// 2^32 − 1 elements, a body over 4 GiB − 1); the buffer comes back
    /// with the error so that its memory is kept.
    #[allow(clippy::result_large_err)]
    pub fn try_encode_into(&self, id: u64, buf: Vec<u8>) -> Result<Vec<u8>, (ProtoError, Vec<u8>)> {
        let (w, fl) = self.writer(buf);
        w.finish_frame(self.op(), fl, id)
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
            Request::ApplyGradients { table, hyper, keys, grads, outcomes } => {
                w.buf.reserve(64 + table.len() + keys.len() * 8 + grads.len() * 4);
                w.str(table);
                hyper_put(&mut w, hyper);
                w.u64s(keys).f32s(grads);
                if *outcomes {
                    fl |= flags::OUTCOMES;
                }
                if hyper.sum {
                    fl |= flags::SUM;
                }
            }
            Request::Control(c) => match c {
                Control::CreateTable(spec) => {
                    // JSON has no NaN or infinity: serde writes null, which
                    // the daemon reads as "the default".
                    if let Some(f) = spec.max_load_factor.filter(|f| !f.is_finite()) {
                        w.note(format!("max_load_factor {f} is not a number in (0, 1]"));
                    }
                    w.buf.extend(json(spec))
                }
                Control::DropTable { name } => w.buf.extend(json(&serde_json::json!({ "name": name }))),
                Control::Checkpoint { wait, full } => {
                    w.buf.extend(json(&serde_json::json!({ "wait": wait, "full": full })))
                }
                Control::Restore { id } => w.buf.extend(json(&serde_json::json!({ "id": id }))),
                Control::Trace { table, seconds } => {
                    w.buf.extend(json(&serde_json::json!({ "table": table, "seconds": seconds })))
                }
                Control::Flush { table } => w.buf.extend(json(&serde_json::json!({ "table": table }))),
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
        let req = match Op::try_from(h.op)? {
            o @ (Op::RegisterMemfd | Op::Unregister | Op::RegisterCuda | Op::RegisterCudaEvent) => {
                return Err(ProtoError::bad_request(format!(
                    "{o} is a region op: decode it with hkv_proto::region (PROTOCOL.md, \"Registered regions\")"
                )))
            }
            Op::Ping => Request::Ping,
            Op::Echo => {
                let reply_len = r.u32("reply_len")?;
                let padding = r.rest().len();
                Request::Echo { reply_len, padding }
            }
            Op::Find => Request::Find { table: r.str("table")?.into(), keys: r.u64s("keys")?, scores },
            Op::Contains => Request::Contains { table: r.str("table")?.into(), keys: r.u64s("keys")? },
            o @ (Op::InsertOrAssign
            | Op::InsertAndEvict
            | Op::FindOrInsert
            | Op::Assign
            | Op::AccumOrAssign
            | Op::Load) => {
                let op = o.write().expect("a write op");
                let table = r.str("table")?.into();
                let keys = r.u64s("keys")?;
                let values = r.f32s("values")?;
                if !scores && r.remaining() > 0 {
                    // The likely cause of bytes after the values: scores
                    // sent without the flag that says they are there.
                    return Err(ProtoError::bad_request(format!(
                        "{} unexpected bytes after the values: a scores array needs the SCORES header flag (0x0002){}",
                        r.remaining(),
                        if o == Op::Load { ", which load requires" } else { "" }
                    )));
                }
                let scores = if scores { Some(r.u64s("scores")?) } else { None };
                Request::Write { op, table, keys, values, scores, outcomes }
            }
            Op::AssignScores => {
                let table = r.str("table")?.into();
                let keys = r.u64s("keys")?;
                let scores = if scores { Some(r.u64s("scores")?) } else { None };
                Request::AssignScores { table, keys, scores, outcomes }
            }
            Op::Erase => Request::Erase { table: r.str("table")?.into(), keys: r.u64s("keys")?, outcomes },
            Op::EraseIf => Request::EraseIf { table: r.str("table")?.into(), filter: filter_get(&mut r)? },
            Op::Clear => Request::Clear { table: r.str("table")?.into() },
            Op::Export => {
                let table = r.str("table")?.into();
                let cursor = Cursor { shard: r.u32("shard")?, offset: r.u64("offset")? };
                let max_slots = r.u64("max_slots")?;
                Request::Export { table, cursor, max_slots, filter: filter_get(&mut r)? }
            }
            Op::SetEpoch => Request::SetEpoch { table: r.str("table")?.into(), epoch: r.u32("epoch")? },
            Op::Reserve => Request::Reserve { table: r.str("table")?.into(), capacity: r.u64("capacity")? },
            Op::Hash => Request::Hash {
                table: r.str("table")?.into(),
                hash: hash_get(&mut r)?,
                features: features_get(&mut r)?,
            },
            Op::FindFeatures => Request::FindFeatures {
                table: r.str("table")?.into(),
                hash: hash_get(&mut r)?,
                features: features_get(&mut r)?,
                scores,
            },
            Op::FindOrInsertFeatures => {
                let table = r.str("table")?.into();
                let hash = hash_get(&mut r)?;
                let features = features_get(&mut r)?;
                let values = r.f32s("values")?;
                let scores = if scores { Some(r.u64s("scores")?) } else { None };
                Request::FindOrInsertFeatures { table, hash, features, values, scores, outcomes }
            }
            Op::ApplyGradients => {
                let table = r.str("table")?.into();
                let hyper = Hyper { sum: h.flags & flags::SUM != 0, ..hyper_get(&mut r)? };
                let keys = r.u64s("keys")?;
                let grads = r.f32s("grads")?;
                Request::ApplyGradients { table, hyper, keys, grads, outcomes }
            }
            Op::CreateTable => Request::Control(Control::CreateTable(from_json(r.rest(), "create_table body")?)),
            Op::DropTable => {
                #[derive(Deserialize, Serialize)]
                #[serde(deny_unknown_fields)]
                struct Drop {
                    name: String,
                }
                let d: Drop = from_json(r.rest(), "drop_table body")?;
                Request::Control(Control::DropTable { name: d.name })
            }
            Op::Checkpoint => {
                #[derive(Deserialize, Serialize)]
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
            Op::ListCheckpoints => Request::Control(Control::ListCheckpoints),
            Op::Restore => {
                #[derive(Deserialize, Serialize)]
                #[serde(deny_unknown_fields)]
                struct Re {
                    id: CheckpointId,
                }
                let x: Re = from_json(r.rest(), "restore body")?;
                Request::Control(Control::Restore { id: x.id })
            }
            Op::Trace => {
                #[derive(Deserialize, Serialize)]
                #[serde(deny_unknown_fields)]
                struct Tr {
                    table: String,
                    seconds: u32,
                }
                let x: Tr = from_json(r.rest(), "trace body")?;
                if !(1..=Control::MAX_TRACE_SECONDS).contains(&x.seconds) {
                    return Err(ProtoError::bad_request(format!(
                        "trace seconds {}: use 1 to {}",
                        x.seconds,
                        Control::MAX_TRACE_SECONDS
                    )));
                }
                Request::Control(Control::Trace { table: x.table, seconds: x.seconds })
            }
            Op::Flush => {
                #[derive(Deserialize, Serialize)]
                #[serde(deny_unknown_fields)]
                struct Fl {
                    table: String,
                }
                let x: Fl = from_json(r.rest(), "flush body")?;
                Request::Control(Control::Flush { table: x.table })
            }
            Op::ListTables => Request::Control(Control::ListTables),
            Op::Stats => Request::Control(Control::Stats),
            Op::Metrics => Request::Control(Control::Metrics),
            Op::Shutdown => Request::Control(Control::Shutdown),
            Op::Error => {
                return Err(ProtoError::new(ErrorCode::UnknownOp, "op code 0xff is the error frame's, not a request"))
            }
        };
        r.finish()?;
        Ok(req)
    }
}
