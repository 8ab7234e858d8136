//! Invalidations: the table's stream read from where it stood at
//! subscription, other writers' entries turned into keys to drop.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::Value;

use crate::error::Error;
use crate::stats::Counters;
use crate::tier::{now_us, Core};

/// Entries per `XREAD`.
const COUNT: usize = 512;
/// How long one `XREAD` blocks: short, so that a consumer's owner can stop
/// it promptly, and under the connection's answer timeout.
const BLOCK: Duration = Duration::from_millis(100);

/// One write batch of another host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalidation {
    /// The keys it wrote.
    pub keys: Vec<u64>,
    /// Its rows' version.
    pub version: u64,
    /// The writer's id.
    pub origin: u64,
    /// When the cluster acknowledged it, µs since the Unix epoch (the
    /// writer's clock).
    pub acked_us: u64,
}

/// Why a consumer cannot know every key other hosts wrote since it read
/// last ([`Invalidations::take_gap`]): then every row cached from the
/// table may be stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gap {
    /// Entries it had not read were trimmed from the stream (`MAXLEN`):
    /// it fell behind by more than the stream keeps.
    Trimmed,
    /// The stream holds fewer entries than it read: the stream was
    /// deleted, or a failover promoted a replica that had not received
    /// them (entries, and maybe rows, the old master had acknowledged).
    WentBack,
    /// Another host published a reset entry: the entries of its writes
    /// that waited for the stream's node outgrew their bound there, and it
    /// replaced them with one entry that names no keys.
    Reset,
}

/// A consumer of one table's stream, on its own connection (its blocking
/// reads never hold up the table's).
pub struct Invalidations {
    core: Arc<Core>,
    /// A connection of its own to the stream's node; dropped on an error
    /// and made again (to the node the slot map names then) on next use.
    conn: Option<MultiplexedConnection>,
    /// A connection to the node importing the stream's slot, named by the
    /// last `ASK` (`HOST:PORT` as Redis wrote it), kept while reads are
    /// asked there.
    asked: Option<(String, MultiplexedConnection)>,
    key: String,
    last: String,
    /// Entries ever added to the stream up to `last` (its place in the
    /// stream's count, `XINFO STREAM`'s `entries-added`).
    read_to: u64,
    /// Entries this consumer had not read are unknown ([`Gap`]).
    gap: Option<Gap>,
    /// The stream's count is to be checked at the next read that
    /// succeeds, whether or not it brings entries, against this place of
    /// the consumer's (`read_to` then): a read failed (the stream's node
    /// down, a failover, a migration), or the check after a read did.
    check: Option<u64>,
    /// The log said the stream key holds another type (once, until a read
    /// succeeds again).
    warned_type: bool,
}

impl Invalidations {
    pub(crate) async fn open(core: Arc<Core>) -> Result<Invalidations, Error> {
        let key = core.layout.stream_key();
        // Where the stream stands: its last id and how many entries it
        // ever had (both 0 when it does not exist yet), in one answer.
        let (last, read_to) = match stream_info(&core, &key).await? {
            Some(i) => (i.last_id, i.added),
            None => ("0-0".into(), 0),
        };
        Ok(Invalidations {
            core,
            conn: None,
            asked: None,
            key,
            last,
            read_to,
            gap: None,
            check: None,
            warned_type: false,
        })
    }

    /// The next entries of other writers, waiting up to 100 ms for one;
    /// empty when none came. Records each entry's staleness.
    pub async fn next(&mut self) -> Result<Vec<Invalidation>, Error> {
        // This host's writes whose entries could not be appended: tried
        // again here, as long as the table lives (its consumer's loop).
        if self.core.has_unpublished() {
            let _ = self.core.republish().await;
        }
        let slot = crate::layout::slot(self.core.layout.table().as_bytes());
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => match self.core.cluster.dedicated(slot, BLOCK).await {
                Ok(c) => c,
                Err(e) => {
                    // The node the slot map names is down: without reading
                    // the map again (a failover may have promoted a
                    // replica) this consumer would try the dead node until
                    // it came back.
                    self.read_failed().await;
                    if let Error::Unavailable { node, .. } = &e {
                        self.core.counters.node_error(node);
                    }
                    return Err(e);
                }
            },
        };
        let mut xread = redis::cmd("XREAD");
        xread.arg("COUNT").arg(COUNT).arg("BLOCK").arg(BLOCK.as_millis() as u64);
        xread.arg("STREAMS").arg(&self.key).arg(&self.last);
        // The node a failed read is counted against: the one it failed on.
        let mut asked: Option<String> = None;
        let read = match xread.query_async::<Value>(&mut conn).await {
            // The stream's slot is being migrated and its key has moved to
            // the importing node already: the read is asked there (ASKING,
            // then the read, on one connection), as every other command of
            // the tier follows ASK; without it this host heard no other
            // host's write until the migration ended.
            Err(e) if e.code() == Some("ASK") => match e.redirect_node().map(|(node, _)| node.to_string()) {
                Some(node) => {
                    let r = self.read_asking(&node, xread).await;
                    asked = Some(crate::cluster::node_name(&node));
                    r
                }
                None => Err(e),
            },
            other => other,
        };
        let v: Value = match read {
            Ok(v) => v,
            Err(e) => {
                if e.code() == Some("WRONGTYPE") && !self.warned_type {
                    self.warned_type = true;
                    tracing::warn!(table = %self.core.layout.table(), key = %self.key, "the table's stream key holds another type (another program wrote it): this host cannot hear other hosts' writes until it is deleted");
                }
                self.read_failed().await;
                return Err(unavailable(&self.core, e, asked));
            }
        };
        self.conn = Some(conn);
        self.warned_type = false;
        let mut read = 0usize;
        // The id of the first entry this read got: where it started.
        let mut first_read: Option<String> = None;
        let mut out = Vec::new();
        // XREAD answers [[stream, [[id, [field, value, ...]], ...]]] (or a
        // map of stream to entries under RESP3).
        let streams: Vec<&Value> = match &v {
            Value::Array(s) => s.iter().filter_map(|x| if let Value::Array(p) = x { p.get(1) } else { None }).collect(),
            Value::Map(m) => m.iter().map(|(_, e)| e).collect(),
            _ => Vec::new(),
        };
        for s in streams {
            for (id, fields) in entries(s) {
                read += 1;
                first_read.get_or_insert_with(|| id.clone());
                self.last = id;
                let (mut origin, mut version, mut acked_us, mut keys) = (0u64, 0u64, 0u64, Vec::new());
                let mut reset = false;
                for (f, val) in fields {
                    match f.as_slice() {
                        b"o" => origin = parse(&val),
                        b"v" => version = parse(&val),
                        b"t" => acked_us = parse(&val),
                        b"r" => reset = parse(&val) == 1,
                        b"k" => {
                            keys = val
                                .chunks_exact(8)
                                .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                                .collect()
                        }
                        _ => {}
                    }
                }
                if origin == self.core.origin {
                    continue;
                }
                self.core.counters.staleness.record(Duration::from_micros(now_us().saturating_sub(acked_us)));
                if reset {
                    self.gap = Some(Gap::Reset);
                    continue;
                }
                out.push(Invalidation { keys, version, origin, acked_us });
            }
        }
        // Entries trimmed from the stream's head (ever added less those
        // kept) beyond where this consumer stood were never read by it (a
        // pause longer than the stream's length of writes): say so, their
        // keys are lost. Trimming only ever grows, so a check after each
        // read that got entries sees every such loss. A stream that counts
        // fewer entries ever added than this consumer read went back (it
        // was deleted, or a failover promoted a replica behind the old
        // master): what it lost is unknown too. A failover fails a read
        // first, so the read after a failure checks even without entries.
        // A check that fails is made at the next read: the entries read
        // are returned (their keys are invalidated) either way.
        let before = self.check.unwrap_or(self.read_to);
        self.read_to += read as u64;
        if read > 0 || self.check.is_some() {
            match stream_info(&self.core, &self.key).await {
                Ok(info) => {
                    self.check = None;
                    match info {
                        None if self.read_to > 0 => self.went_back("0-0".into(), 0),
                        Some(i) if i.added < self.read_to => self.went_back(i.last_id, i.added),
                        Some(i) if i.added.saturating_sub(i.length) > before => {
                            self.gap = Some(Gap::Trimmed);
                            self.resync(&i, first_read.as_deref(), read as u64);
                        }
                        _ => {}
                    }
                }
                Err(_) => self.check = Some(before),
            }
        }
        // Counted as they are handed over, after the check's round trip: a
        // reader of the count (a test waiting for other hosts' writes) then
        // finds their keys with the caller, not still in flight here.
        Counters::add(&self.core.counters.invalidations, out.iter().map(|i| i.keys.len()).sum::<usize>());
        Ok(out)
    }

    /// `xread` on `node`, the importing node an `ASK` named, behind
    /// `ASKING` on the same connection (the flag lasts one command). The
    /// connection is kept for the next reads while the migration lasts;
    /// each read still goes to the slot's owner first, which redirects it
    /// only while the key is away (an aborted migration ends the ASKs).
    async fn read_asking(&mut self, node: &str, xread: redis::Cmd) -> redis::RedisResult<Value> {
        let mut conn = match self.asked.take() {
            Some((n, c)) if n == node => c,
            _ => self.core.cluster.dedicated_to(node, BLOCK).await.map_err(|e| {
                redis::RedisError::from((redis::ErrorKind::Io, "ASK target unreachable", e.to_string()))
            })?,
        };
        let mut pipe = redis::pipe();
        pipe.cmd("ASKING").add_command(xread);
        let mut answers = conn.req_packed_commands(&pipe, 0, 2).await?;
        self.asked = Some((node.to_string(), conn));
        match answers.pop() {
            Some(Value::ServerError(e)) => Err(e.into()),
            Some(v) => Ok(v),
            None => Err(redis::RedisError::from((redis::ErrorKind::Parse, "no answer to XREAD after ASKING"))),
        }
    }

    /// A read failed: the stream's slot may have moved (a failover, a
    /// migration), so the slot map is read again, and the stream's count
    /// is checked at the next read that succeeds.
    async fn read_failed(&mut self) {
        self.check = Some(self.check.unwrap_or(self.read_to));
        self.core.cluster.refresh_soon().await;
    }

    /// Whether, and why, entries of other hosts were lost to this
    /// consumer since the last call (then every row cached from the table
    /// may be stale); clears it.
    pub fn take_gap(&mut self) -> Option<Gap> {
        self.gap.take()
    }

    /// After a gap of trimmed entries, this consumer's place in the
    /// stream's count is that of the entries trimmed before the first it
    /// read, plus those it read: exact when the stream's first entry is
    /// still the first this read got (nothing trimmed since), else at
    /// least the entries trimmed by now. Without it the count stayed
    /// short by the entries lost, so each read after the gap found the
    /// gap again: a tester's paused reader logged the WARN 16 to 20 times
    /// in 40 ms and its cache was dropped twice.
    fn resync(&mut self, info: &StreamInfo, first_read: Option<&str>, read: u64) {
        let trimmed = info.added.saturating_sub(info.length);
        self.read_to = match (first_read, info.first_id.as_deref()) {
            (Some(a), Some(b)) if a == b => trimmed + read,
            _ => trimmed.max(self.read_to),
        };
    }

    /// The stream went back: read on from where it stands now (`last`,
    /// `added` entries ever), the loss noted.
    fn went_back(&mut self, last: String, added: u64) {
        self.last = last;
        self.read_to = added;
        self.gap = Some(Gap::WentBack);
    }

    /// Invalidations counted so far (keys).
    pub fn count(&self) -> u64 {
        self.core.counters.invalidations.load(Relaxed)
    }
}

/// A failed read of the stream, counted against the node it failed on:
/// `asked`, the importing node an `ASK` sent it to, else the slot's owner.
fn unavailable(core: &Core, e: redis::RedisError, asked: Option<String>) -> Error {
    let node = asked.unwrap_or_else(|| core.cluster.node_of(crate::layout::slot(core.layout.table().as_bytes())));
    core.counters.node_error(&node);
    Error::Unavailable { node, detail: format!("stream {}: {e}", core.layout.stream_key()) }
}

/// What `XINFO STREAM` says of a stream: entries kept, entries ever
/// added, the last id.
struct StreamInfo {
    length: u64,
    added: u64,
    last_id: String,
    /// The id of its first entry, if it has one.
    first_id: Option<String>,
}

/// `XINFO STREAM key`; `None` when the stream does not exist.
async fn stream_info(core: &Core, key: &str) -> Result<Option<StreamInfo>, Error> {
    let slot = crate::layout::slot(core.layout.table().as_bytes());
    let v = match core.cluster.one(slot, redis::cmd("XINFO").arg("STREAM").arg(key).clone()).await {
        Ok(v) => v,
        Err(Error::Unavailable { detail, .. }) if detail.contains("no such key") => return Ok(None),
        Err(e) => return Err(e),
    };
    // RESP2: [field, value, ...]; RESP3: a map.
    let pairs: Vec<(&Value, &Value)> = match &v {
        Value::Array(a) => a.chunks_exact(2).map(|c| (&c[0], &c[1])).collect(),
        Value::Map(m) => m.iter().map(|(a, b)| (a, b)).collect(),
        _ => Vec::new(),
    };
    let (mut info, mut seen) = (StreamInfo { length: 0, added: 0, last_id: "0-0".into(), first_id: None }, 0);
    for (f, val) in pairs {
        let int = || match val {
            Value::Int(n) => Some(*n as u64),
            other => bytes(other).and_then(|b| std::str::from_utf8(&b).ok()?.parse().ok()),
        };
        match bytes(f).as_deref() {
            Some(b"length") => info.length = int().unwrap_or(0),
            Some(b"entries-added") => {
                info.added = int().unwrap_or(0);
                seen += 1;
            }
            Some(b"first-entry") => {
                info.first_id = match val {
                    Value::Array(e) => e.first().and_then(bytes).and_then(|b| String::from_utf8(b).ok()),
                    _ => None,
                }
            }
            Some(b"last-generated-id") => {
                info.last_id = bytes(val).and_then(|b| String::from_utf8(b).ok()).unwrap_or_else(|| "0-0".into())
            }
            _ => {}
        }
    }
    if seen == 0 {
        return Err(Error::Unavailable {
            node: core.cluster.node_of(slot),
            detail: format!("XINFO STREAM {key}: no entries-added field (the stream needs Redis 7.0 or later)"),
        });
    }
    Ok(Some(info))
}

fn parse(v: &[u8]) -> u64 {
    std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

/// A stream entry: its id and its (field, value) pairs.
type Entry = (String, Vec<(Vec<u8>, Vec<u8>)>);

/// `[[id, [f, v, ...]], ...]` → `(id, [(f, v)])`.
fn entries(v: &Value) -> Vec<Entry> {
    let Value::Array(items) = v else { return Vec::new() };
    items
        .iter()
        .filter_map(|e| {
            let Value::Array(pair) = e else { return None };
            let id = String::from_utf8(bytes(pair.first()?)?).ok()?;
            let fields = match pair.get(1)? {
                Value::Array(f) => f.chunks_exact(2).filter_map(|c| Some((bytes(&c[0])?, bytes(&c[1])?))).collect(),
                Value::Map(m) => m.iter().filter_map(|(a, b)| Some((bytes(a)?, bytes(b)?))).collect(),
                _ => Vec::new(),
            };
            Some((id, fields))
        })
        .collect()
}
