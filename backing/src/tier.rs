//! [`Backing`]: one table's tier in the cluster.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::Value;

use crate::cluster::{Cluster, Failure, Net};
use crate::error::Error;
use crate::layout::{decode_row, encode_row, Layout, GROUPS_PER_MASTER, LAYOUT};
use crate::queue::{Batch, Queue};
use crate::stats::{Counters, Stats};
use crate::stream::Invalidations;

/// How a table writes to its tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// The cache never writes to the cluster (inference).
    #[default]
    ReadOnly,
    /// A write is acknowledged after the cluster acknowledged it.
    WriteThrough,
    /// Writes and evictions are queued and sent in batches.
    WriteBack,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 3] = [Mode::ReadOnly, Mode::WriteThrough, Mode::WriteBack];

    /// The mode's name as flags and configs spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::ReadOnly => "read-only",
            Mode::WriteThrough => "write-through",
            Mode::WriteBack => "write-back",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Mode, Error> {
        Mode::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| Error::BadOption {
            name: "backing-mode",
            detail: format!("{s:?} is not a mode; use read-only, write-through or write-back"),
        })
    }
}

/// The most floats a stored row holds (values and optimizer state): the
/// daemon's limit on a table's row (`shard`'s `dim` above 65536 is refused).
pub const MAX_ROW: usize = 65536;

/// `n word`, with an `s` unless `n` is 1.
pub(crate) fn plural_n(n: u64, word: &str) -> String {
    format!("{n} {}", plural(n, word))
}

/// `word`, with an `s` unless `n` is 1.
pub(crate) fn plural(n: u64, word: &str) -> String {
    if n == 1 {
        word.to_string()
    } else {
        format!("{word}s")
    }
}

/// A tier's options. [`Options::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seed nodes, `redis://HOST:PORT` or `HOST:PORT`.
    pub seeds: Vec<String>,
    /// How writes reach the cluster.
    pub mode: Mode,
    /// How long a read waits for the cluster before it reports keys as not
    /// fetched in time.
    pub deadline: Duration,
    /// The write-back queue's bound in bytes (row values and keys).
    pub queue_bytes: u64,
    /// How long a writer waits for room in a full queue.
    pub queue_wait: Duration,
    /// Rows per write-back batch.
    pub batch_rows: usize,
    /// Connecting to a node.
    pub connect_timeout: Duration,
    /// One command's answer.
    pub response_timeout: Duration,
    /// Retries of a command (redirections, reconnections).
    pub retries: u32,
    /// Entries the table's stream keeps (approximately).
    pub stream_len: u64,
    /// Replicas each master must have acknowledged a write to (`WAIT`)
    /// before it counts as written; 0: the master's acknowledgement.
    pub wait_replicas: u32,
    /// How long `WAIT` waits for them (below `response_timeout`).
    pub wait_timeout: Duration,
    /// The bound in bytes (keys, plus 48 per entry) of the stream entries
    /// that wait on this host because the stream's node refused them (or
    /// did not answer): past it they are all replaced by one reset entry,
    /// which tells the other hosts to drop their whole cache of the table.
    pub unpublished_bytes: u64,
    /// What a row's floats are (hkvd's: `values`, or `OPTIMIZER over N
    /// values` for a table with an optimizer), kept in the table's meta
    /// hash by the first host: a host whose rows mean something else
    /// (another optimizer, another value width) is refused, as one with
    /// another row width is.
    pub row: String,
    /// The table existed before this open (a restore, or an open tried
    /// again after its cluster came back): its meta hash must be in the
    /// cluster, and a cluster without it is refused ([`Error::NoMeta`]),
    /// never adopted (no meta written there, nothing read or written).
    /// Seeds that answer from several clusters are then tried cluster by
    /// cluster for the one holding the meta hash, where a new table
    /// (`false`) refuses them ([`Error::SeedsSplit`]).
    pub existing: bool,
    /// How often the open tier reads the table's meta hash again: one
    /// that is gone is written back (where still absent), one that says
    /// another layout fails the table's requests that need the cluster
    /// ([`Error::MetaReplaced`]) until it agrees again.
    pub meta_every: Duration,
}

impl Options {
    /// Defaults: 250 ms deadline, a 64 MiB queue with a 2 s wait, batches of
    /// 4096 rows, 1 s connect, 1 s answer, 3 retries, 100 000 stream entries,
    /// 4 MiB of stream entries waiting (half a million keys).
    pub fn new(seeds: Vec<String>, mode: Mode) -> Options {
        Options {
            seeds,
            mode,
            deadline: Duration::from_millis(250),
            queue_bytes: 64 << 20,
            queue_wait: Duration::from_secs(2),
            batch_rows: 4096,
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            retries: 3,
            stream_len: 100_000,
            wait_replicas: 0,
            wait_timeout: Duration::from_millis(500),
            unpublished_bytes: 4 << 20,
            row: "values".into(),
            existing: false,
            meta_every: Duration::from_secs(5),
        }
    }

    /// These options with other seeds.
    pub fn with_seeds(self, seeds: Vec<String>) -> Options {
        Options { seeds, ..self }
    }

    /// The options' ranges for rows of `dim` floats (`Backing::open`
    /// checks them first; a caller may check them before its own checks).
    pub fn check(&self, dim: usize) -> Result<(), Error> {
        let bad = |name, detail: String| Err(Error::BadOption { name, detail });
        let ms = |d: Duration| d.as_millis();
        // The row's width first: the queue's bounds are counted in rows.
        if !(1..=MAX_ROW).contains(&dim) {
            return bad(
                "dim",
                format!("{dim}: a table's rows (values and optimizer state) hold 1 to {MAX_ROW} floats"),
            );
        }
        if !(1..=60_000).contains(&ms(self.deadline)) {
            return bad("deadline", format!("{:?}: use 1 ms to 60 s", self.deadline));
        }
        let entry = (16 + 4 * dim + 8) as u64;
        if self.queue_bytes < 4 * entry || self.queue_bytes > 64 << 30 {
            return bad(
                "queue_bytes",
                format!("{}: use at least 4 rows ({} bytes) and at most 64 GiB", self.queue_bytes, 4 * entry),
            );
        }
        if ms(self.queue_wait) > 600_000 {
            return bad("queue_wait", format!("{:?}: use at most 10 minutes", self.queue_wait));
        }
        if !(1..=1 << 20).contains(&self.batch_rows) {
            return bad("batch_rows", format!("{}: use 1 to 1048576", self.batch_rows));
        }
        for (name, d) in [("connect_timeout", self.connect_timeout), ("response_timeout", self.response_timeout)] {
            if !(1..=60_000).contains(&ms(d)) {
                return bad(name, format!("{d:?}: use 1 ms to 60 s"));
            }
        }
        if self.wait_replicas > 0 && self.mode == Mode::ReadOnly {
            return bad(
                "wait_replicas",
                format!(
                    "{}: a read-only table writes nothing to the cluster, so no write waits for replicas; leave it out \
                     (or 0), or use write-through or write-back",
                    self.wait_replicas
                ),
            );
        }
        if self.wait_replicas > 64 {
            return bad("wait_replicas", format!("{}: use 0 to 64", self.wait_replicas));
        }
        if self.wait_replicas > 0 && (self.wait_timeout.is_zero() || self.wait_timeout >= self.response_timeout) {
            return bad(
                "wait_timeout",
                format!(
                    "{:?}: use 1 ms to less than response_timeout ({:?})",
                    self.wait_timeout, self.response_timeout
                ),
            );
        }
        if !(1024..=1 << 30).contains(&self.unpublished_bytes) {
            return bad("unpublished_bytes", format!("{}: use 1 KiB to 1 GiB", self.unpublished_bytes));
        }
        if !(1..=3_600_000).contains(&ms(self.meta_every)) {
            return bad("meta_every", format!("{:?}: use 1 ms to 1 hour", self.meta_every));
        }
        if self.retries > 16 {
            return bad("retries", format!("{}: use at most 16", self.retries));
        }
        Ok(())
    }
}

/// What a read found for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetched {
    /// The row, from the cluster or the write-back queue.
    Found,
    /// The cluster has no row for the key.
    Absent,
    /// Not fetched before the deadline.
    Late,
    /// Its node failed; the read's `errors` name it.
    Unavailable,
}

/// A read's answer, in the order of the keys asked.
#[derive(Debug, Clone, Default)]
pub struct ReadOut {
    /// Per key.
    pub fetched: Vec<Fetched>,
    /// `dim` floats per key, written where `Found`.
    pub values: Vec<f32>,
    /// Scores where `Found`.
    pub scores: Vec<u64>,
    /// Versions where `Found` (0 for rows still in the queue).
    pub versions: Vec<u64>,
    /// One error per failed node (`Error::Unavailable`), or a bad row.
    pub errors: Vec<Error>,
}

impl ReadOut {
    /// Keys not answered (late or unavailable).
    pub fn unanswered(&self) -> usize {
        self.fetched.iter().filter(|f| matches!(f, Fetched::Late | Fetched::Unavailable)).count()
    }
}

/// Keys a `SCAN` page looks at (its `COUNT`): a node's keyspace holds
/// other tables' rows too, so a page is many keys per round trip.
const SCAN_COUNT: u64 = 1000;

/// A walk over a table's rows in the cluster: the masters to walk, the
/// one being walked and its `SCAN` cursor.
#[derive(Debug, Clone)]
pub struct Scan {
    nodes: Vec<String>,
    node: usize,
    cursor: u64,
}

/// One row to send: borrowed from a request or from a queued batch (no
/// copy of its values before they are encoded into the command). Empty
/// values (a row has at least one float): the key is erased. `nx`: set
/// only where the cluster has no row of the key (find_or_insert's new
/// rows).
pub(crate) struct Row<'a> {
    pub key: u64,
    pub score: u64,
    pub values: &'a [f32],
    pub nx: bool,
}

/// What [`Core::send`] made of a batch of rows.
pub(crate) struct Sent {
    /// Per row: not acknowledged (to be retried, or failed).
    pub failed: Vec<bool>,
    /// Rows sent set-if-absent whose key the cluster already had: the
    /// row's index and the cluster's row (encoded), which stays. Such a
    /// row is done (never retried): the cluster's row is the key's.
    pub kept: Vec<(usize, Vec<u8>)>,
    /// One per failed node.
    pub errors: Vec<Error>,
}

/// The shared part of a tier: what the flusher and the handles use.
pub(crate) struct Core {
    pub cluster: Cluster,
    pub layout: Layout,
    pub mode: Mode,
    pub options: Options,
    pub counters: Counters,
    pub queue: Queue,
    /// This handle's id on the stream, so a reader skips its own writes.
    pub origin: u64,
    clock: AtomicU64,
    /// Keys whose queued set-if-absent row the cluster refused (it had a
    /// row already), for the cache to drop ([`Backing::take_conflicts`]).
    conflicts: parking_lot::Mutex<Vec<u64>>,
    /// Stream entries of acknowledged writes that could not be appended
    /// (the stream's node refused or was down), oldest first: appended
    /// before the next entry, and retried by the table's stream consumer
    /// ([`Core::republish`]), so that other hosts hear every write, late
    /// rather than never. Bounded in bytes ([`Unpublished`]).
    unpublished: parking_lot::Mutex<Unpublished>,
    /// The connection the stream's entries are appended on, to the node
    /// named with it, made on first use; its answers are awaited up to
    /// [`STALL_LIMIT`] ([`Core::append`]).
    appender: parking_lot::Mutex<Option<(String, redis::aio::MultiplexedConnection)>>,
    /// Set while the table's meta hash says another layout than this
    /// handle's ([`Core::check_meta`]): the table's requests that need the
    /// cluster fail with it, and the write-back queue is held.
    meta_error: parking_lot::Mutex<Option<Error>>,
    /// When each write-back batch in flight was sent, by node: a flush
    /// that times out names the nodes that have not answered.
    in_flight: parking_lot::Mutex<std::collections::HashMap<String, Vec<Instant>>>,
    /// Keys announced again once their nodes answer ([`Doubts`]).
    doubts: parking_lot::Mutex<Doubts>,
    /// Per node, its failed writes (rows and stream entries)
    /// ([`Core::write_failed`]): what a flush that times out reports.
    write_failures: parking_lot::Mutex<std::collections::BTreeMap<String, WriteFailures>>,
}

/// A node's failed writes: how many, and the words of the last (a flush
/// that times out says why: a `WAIT` shortfall reads as one, not as a
/// node down).
#[derive(Clone, Default)]
struct WriteFailures {
    count: u64,
    last: String,
}

/// Keys whose rows in the cluster other hosts may not have heard of, to be
/// announced again on the stream ([`Core::settle_doubts`]):
/// - the keys of a write a node failed or did not answer in time: a
///   stalled node runs the commands buffered for it when it resumes, so
///   the write may land after the writer was told it failed, and no entry
///   named those keys (a tester's other host served the old rows of 31
///   such keys with no end);
/// - the keys of a stream entry whose node answered only after it stalled:
///   a failover meanwhile may have promoted a replica without it (a
///   tester's entry was answered, then gone with the demoted master, and
///   the other host served 76 old rows with no end). Such keys are
///   announced again only if the node that answered no longer serves the
///   stream's slot by then (else the entry stands, once).
///
/// Announced once every node named answers again (a node no longer
/// serving slots counts as answered: its late writes are not read) and
/// `2 × response_timeout` after the last doubt, so that a resumed master
/// learns of its demotion first. Another host then drops those keys and
/// reads whatever the cluster kept. Bounded like the waiting entries: past
/// `unpublished_bytes` a reset is announced instead.
#[derive(Debug, Default)]
struct Doubts {
    /// The keys (a write retried by its client adds them once).
    keys: std::collections::HashSet<u64>,
    /// Past the bound, or a reset entry in doubt: a reset is announced.
    reset: bool,
    /// The nodes that must answer first.
    nodes: Vec<String>,
    /// When the last doubt came.
    last: Option<Instant>,
    /// Stream entries that landed late: per stream node that answered,
    /// their keys, or a reset (`None`).
    landed_late: Vec<(String, Option<Vec<u8>>)>,
}

impl Doubts {
    /// Keys of a write `node` failed.
    fn add(&mut self, keys: impl Iterator<Item = u64>, node: &str, limit: u64) {
        if !self.reset {
            self.keys.extend(keys);
            if 8 * self.keys.len() as u64 + ENTRY_OVERHEAD > limit {
                self.keys = Default::default();
                self.reset = true;
            }
        }
        if !self.nodes.iter().any(|n| n == node) {
            self.nodes.push(node.to_string());
        }
        self.last = Some(Instant::now());
    }

    /// An entry `node` answered after it stalled (its keys, `None` for a
    /// reset).
    fn landed_late(&mut self, node: String, keys: Option<Vec<u8>>, limit: u64) {
        let bytes: u64 = self.landed_late.iter().map(|(_, k)| k.as_ref().map_or(0, |k| k.len() as u64)).sum();
        if bytes + keys.as_ref().map_or(0, |k| k.len() as u64) + ENTRY_OVERHEAD > limit {
            self.landed_late.retain(|(n, _)| *n != node);
            self.landed_late.push((node, None));
        } else {
            self.landed_late.push((node, keys));
        }
        self.last = Some(Instant::now());
    }
}

/// How long an append its node has not answered may still land, and is
/// awaited on its connection for: a node that stalls (stopped, swapping)
/// runs the commands buffered for it when it resumes, so an entry sent
/// again meanwhile would be appended twice. The entry waits meanwhile,
/// with those behind it; past this it is sent again (and may then be in
/// the stream twice).
const STALL_LIMIT: Duration = Duration::from_secs(60);

/// Bytes counted per waiting stream entry beside its keys: its version,
/// time and the vector's header.
const ENTRY_OVERHEAD: u64 = 48;

/// The stream entries that wait to be appended, bounded in bytes. Past the
/// bound they are replaced by one reset entry (`r` = 1, no keys): readers
/// then drop their whole cache of the table, which covers every write it
/// replaced. While a reset waits, later entries are folded into it too
/// (it is appended after their writes were acknowledged), so an outage of
/// the stream's node costs this host a few bytes, however long it lasts.
#[derive(Debug, Default)]
pub(crate) struct Unpublished {
    /// Each: version, keys (u64 LE), acknowledgement time (µs).
    entries: std::collections::VecDeque<(u64, Vec<u8>, u64)>,
    /// Their bytes ([`ENTRY_OVERHEAD`] each, and the keys).
    bytes: u64,
    /// A reset entry waiting, ahead of `entries`: the newest version and
    /// the oldest acknowledgement it replaces.
    reset: Option<(u64, u64)>,
    /// Times the bound was reached.
    pub resets: u64,
    /// Entries whose append their node has not answered within the
    /// response timeout, and their bytes: each may still land, and is
    /// awaited ([`STALL_LIMIT`]); nothing is taken while any is.
    stalled: (u64, u64),
}

impl Unpublished {
    /// Adds an entry, or folds it into a reset (one waiting, or made now
    /// because the bound is reached); whether a reset was made now.
    fn push(&mut self, version: u64, keys: &[u8], acked: u64, limit: u64) -> bool {
        let cost = ENTRY_OVERHEAD + keys.len() as u64;
        if self.reset.is_some() {
            self.fold(version, acked);
            return false;
        }
        if self.bytes + cost <= limit {
            self.entries.push_back((version, keys.to_vec(), acked));
            self.bytes += cost;
            return false;
        }
        let newest = self.entries.iter().map(|e| e.0).fold(version, u64::max);
        let oldest = self.entries.iter().map(|e| e.2).fold(acked, u64::min);
        self.entries.clear();
        self.bytes = 0;
        self.reset = Some((newest, oldest));
        self.resets += 1;
        true
    }

    /// Folds an entry of `version`, acknowledged at `acked`, into the
    /// reset waiting (made if none is).
    fn fold(&mut self, version: u64, acked: u64) {
        self.reset = Some(self.reset.map_or((version, acked), |(v, t)| (v.max(version), t.min(acked))));
    }

    /// The next to append: the reset first, then the oldest entry; none
    /// while an append is stalled (its entry is ahead of them, and may
    /// land yet).
    fn take(&mut self) -> Option<Waiting> {
        if self.stalled.0 > 0 {
            return None;
        }
        if let Some((v, t)) = self.reset.take() {
            return Some(Waiting::Reset(v, t));
        }
        let (v, k, t) = self.entries.pop_front()?;
        self.bytes -= ENTRY_OVERHEAD + k.len() as u64;
        Some(Waiting::Entry(v, k, t))
    }

    /// What [`Unpublished::take`] gave, back in front after its append
    /// failed. Entries that came meanwhile were later writes: they stay
    /// behind it, or were folded into it; an entry is dropped when a
    /// reset made meanwhile covers it.
    fn put_back(&mut self, w: Waiting) {
        match w {
            Waiting::Reset(v, t) => self.fold(v, t),
            Waiting::Entry(v, k, t) if self.reset.is_none() => {
                self.bytes += ENTRY_OVERHEAD + k.len() as u64;
                self.entries.push_front((v, k, t));
            }
            Waiting::Entry(..) => {}
        }
    }

    /// Whether anything waits.
    fn is_empty(&self) -> bool {
        self.reset.is_none() && self.entries.is_empty() && self.stalled.0 == 0
    }

    /// Entries waiting (a reset counts one) and their bytes.
    pub fn window(&self) -> (u64, u64) {
        let reset = u64::from(self.reset.is_some());
        (self.entries.len() as u64 + reset + self.stalled.0, self.bytes + reset * ENTRY_OVERHEAD + self.stalled.1)
    }
}

/// What [`Core::republish`] appends next.
enum Waiting {
    Reset(u64, u64),
    Entry(u64, Vec<u8>, u64),
}

impl Waiting {
    /// Its bytes as [`Unpublished`] counts them.
    fn bytes(&self) -> u64 {
        match self {
            Waiting::Reset(..) => ENTRY_OVERHEAD,
            Waiting::Entry(_, k, _) => ENTRY_OVERHEAD + k.len() as u64,
        }
    }
}

/// What became of an append ([`Core::append`]).
enum Appended {
    /// The entry is in the stream.
    Done,
    /// Its node has not answered within the response timeout: the entry
    /// is awaited on its connection, and waits if it does not land.
    Stalled,
    /// It is not in the stream: the node refused it, or could not be
    /// reached.
    Failed(Waiting, Error),
}

/// Closes the queue when the last handle goes: the flusher then sends
/// what is queued and stops.
struct CloseOnDrop(Arc<Core>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.queue.close();
    }
}

/// One table's tier in a Redis Cluster. Cheap to clone; every method runs
/// on the tokio runtime it was opened on.
#[derive(Clone)]
pub struct Backing {
    core: Arc<Core>,
    _close: Arc<CloseOnDrop>,
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backing").field("table", &self.core.layout.table()).field("mode", &self.core.mode).finish()
    }
}

/// Checks that `values` holds `dim` floats per key and `scores` none or
/// one per key.
fn check_rows(keys: &[u64], values: &[f32], scores: &[u64], dim: usize) -> Result<(), Error> {
    if values.len() != keys.len() * dim || !(scores.is_empty() || scores.len() == keys.len()) {
        return Err(Error::BadOption {
            name: "rows",
            detail: format!("{} keys need {} values and 0 or {} scores", keys.len(), keys.len() * dim, keys.len()),
        });
    }
    Ok(())
}

/// The rows to send for `keys` (checked by [`check_rows`]; a missing score
/// is 0), set-if-absent when `nx`.
fn rows<'a>(keys: &[u64], values: &'a [f32], scores: &[u64], dim: usize, nx: bool) -> Vec<Row<'a>> {
    keys.iter()
        .enumerate()
        .map(|(i, &key)| Row {
            key,
            score: scores.get(i).copied().unwrap_or(0),
            values: &values[i * dim..(i + 1) * dim],
            nx,
        })
        .collect()
}

impl Backing {
    /// Connects to the cluster and opens `table` (rows of `dim` floats):
    /// checks the seeds and options, reads the table's meta hash or writes
    /// it (groups = 32 × masters), and in write-back mode starts the
    /// flusher. Needs a tokio runtime with the time driver.
    pub async fn open(table: &str, dim: usize, options: Options) -> Result<Backing, Error> {
        options.check(dim)?;
        if table.is_empty() || table.contains(['{', '}']) {
            return Err(Error::BadOption {
                name: "table",
                detail: format!(
                    "{table:?}: a table name may not be empty or hold a brace ('{{' or '}}'); the cluster's keys put \
                     it inside a hash tag"
                ),
            });
        }
        let net =
            Net { connect: options.connect_timeout, response: options.response_timeout, retries: options.retries };
        let (cluster, groups) = if options.existing {
            open_existing(table, dim, &options, net).await?
        } else {
            let cluster = Cluster::open(table, &options.seeds, net, true).await?;
            let groups = meta(&cluster, table, dim, &options.row, true).await?;
            (cluster, groups)
        };
        let layout = Layout::new(table, dim, groups);
        let of = layout.clone();
        let group_of = Box::new(move |k| of.group(k) as usize);
        let queue =
            Queue::new(layout.row_bytes(), options.queue_bytes, options.queue_wait, layout.groups() as usize, group_of);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
        let origin = (u64::from(std::process::id()) << 40) ^ nanos;
        let core = Arc::new(Core {
            cluster,
            layout,
            mode: options.mode,
            options,
            counters: Counters::default(),
            queue,
            origin,
            clock: AtomicU64::new(0),
            conflicts: parking_lot::Mutex::new(Vec::new()),
            unpublished: parking_lot::Mutex::new(Unpublished::default()),
            appender: parking_lot::Mutex::new(None),
            meta_error: parking_lot::Mutex::new(None),
            in_flight: parking_lot::Mutex::new(std::collections::HashMap::new()),
            doubts: parking_lot::Mutex::new(Doubts::default()),
            write_failures: parking_lot::Mutex::new(std::collections::BTreeMap::new()),
        });
        if core.mode == Mode::WriteBack {
            tokio::spawn(flusher(core.clone()));
        }
        tokio::spawn(watch_meta(Arc::downgrade(&core), core.options.meta_every));
        tokio::spawn(watch_doubts(Arc::downgrade(&core)));
        Ok(Backing { _close: Arc::new(CloseOnDrop(core.clone())), core })
    }

    /// The table's layout in the cluster.
    pub fn layout(&self) -> &Layout {
        &self.core.layout
    }

    /// How long a read waits for the cluster ([`Options::deadline`]).
    pub fn deadline(&self) -> Duration {
        self.core.options.deadline
    }

    /// The table's mode.
    pub fn mode(&self) -> Mode {
        self.core.mode
    }

    /// Reads `keys` with the table's deadline.
    pub async fn read(&self, keys: &[u64]) -> ReadOut {
        self.read_by(keys, Instant::now() + self.core.options.deadline).await
    }

    /// Reads `keys`: queued rows first, the rest with one `MGET` per group,
    /// all sent at once (the cluster connection writes the commands bound
    /// for one node together, so a batch costs about one round trip per
    /// node); keys whose group did not answer by `deadline` are `Late`,
    /// and so are those of a group whose answer came but is still to be
    /// decoded a tenth of the deadline (at least 5 ms) past it (decoding
    /// 64 KiB rows took longer than the wait itself: a read of wide rows
    /// answered up to 2x past its deadline with every key found).
    pub async fn read_by(&self, keys: &[u64], deadline: Instant) -> ReadOut {
        let core = &self.core;
        let dim = core.layout.dim();
        let start = Instant::now();
        let mut out = ReadOut {
            fetched: vec![Fetched::Absent; keys.len()],
            values: vec![0.0; keys.len() * dim],
            scores: vec![0; keys.len()],
            versions: vec![0; keys.len()],
            errors: Vec::new(),
        };
        if let Some(e) = core.meta_error() {
            out.fetched.fill(Fetched::Unavailable);
            out.errors.push(e);
            Counters::add(&core.counters.keys_read, keys.len());
            Counters::add(&core.counters.unavailable, keys.len());
            return out;
        }
        let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); core.layout.groups() as usize];
        // Keys answered by the queue: its rows, or its erasures (absent).
        let mut queued = Vec::new();
        if !core.queue.is_empty() {
            queued = vec![false; keys.len()];
            let mut n = 0;
            core.queue.lookup_many(keys, |i, e| {
                queued[i] = true;
                if e.values.is_empty() {
                    return;
                }
                out.fetched[i] = Fetched::Found;
                out.values[i * dim..(i + 1) * dim].copy_from_slice(&e.values);
                out.scores[i] = e.score;
                n += 1;
            });
            Counters::add(&core.counters.found_queued, n);
        }
        for (i, &k) in keys.iter().enumerate() {
            if !queued.get(i).copied().unwrap_or(false) {
                by_group[core.layout.group(k) as usize].push(i);
            }
        }
        let deadline = tokio::time::Instant::from_std(deadline);
        let groups: Vec<(u32, &Vec<usize>)> =
            by_group.iter().enumerate().filter(|(_, ix)| !ix.is_empty()).map(|(g, ix)| (g as u32, ix)).collect();
        let mut key = Vec::new();
        let cmds: Vec<(u16, redis::Cmd)> = groups
            .iter()
            .map(|&(g, ix)| {
                let mut cmd = redis::cmd("MGET");
                for &i in ix {
                    core.layout.write_row_key(keys[i], &mut key);
                    cmd.arg(&key[..]);
                }
                (core.layout.slot_of_group(g), cmd)
            })
            .collect();
        let results = core.cluster.run(cmds, deadline).await;
        let mut failed_nodes: Vec<String> = Vec::new();
        let mut spent: Vec<Vec<Value>> = Vec::new();
        // Answers that came by the deadline are decoded until a tenth of
        // the deadline past it (at least 5 ms): time enough for the rows
        // of the nodes that answered while another was waited for (their
        // keys are not late), not for 38 MB of 64 KiB rows (past it, an
        // answer's keys are late, as they would be had it come a moment
        // later).
        let cutoff = deadline + (core.options.deadline / 10).max(Duration::from_millis(5));
        for (&(g, ix), r) in groups.iter().zip(results) {
            let r = match r {
                Ok(v) if tokio::time::Instant::now() >= cutoff => {
                    spent.push(vec![v]);
                    Err(Failure::Late)
                }
                r => r,
            };
            // An `MGET` answers an array of bulk strings and nils: its rows
            // are decoded where the parser left them (no conversion of the
            // array into a vector of options first); any other answer
            // goes through the crate's conversion (its result, or its error).
            let rows = match r.map(|v| match v {
                Value::Array(rows) if rows.iter().all(|r| matches!(r, Value::BulkString(_) | Value::Nil)) => Ok(rows),
                v => <Vec<Option<Vec<u8>>> as redis::FromRedisValue>::from_redis_value(v)
                    .map(|rows| rows.into_iter().map(|r| r.map_or(Value::Nil, Value::BulkString)).collect()),
            }) {
                Ok(Ok(rows)) if rows.len() == ix.len() => rows,
                Err(Failure::Late) => {
                    ix.iter().for_each(|&i| out.fetched[i] = Fetched::Late);
                    continue;
                }
                other => {
                    let (node, detail) = match other {
                        Err(Failure::Node { node, detail }) => (node, detail),
                        Ok(Err(e)) => (core.cluster.node_of(core.layout.slot_of_group(g)), format!("MGET answer: {e}")),
                        _ => (
                            core.cluster.node_of(core.layout.slot_of_group(g)),
                            "MGET answered another count of rows".into(),
                        ),
                    };
                    ix.iter().for_each(|&i| out.fetched[i] = Fetched::Unavailable);
                    core.counters.node_error(&node);
                    if !failed_nodes.contains(&node) {
                        failed_nodes.push(node.clone());
                        out.errors.push(Error::Unavailable { node, detail });
                    }
                    continue;
                }
            };
            let mut bytes_in = 0;
            for (&i, row) in ix.iter().zip(&rows) {
                let Value::BulkString(row) = row else { continue };
                bytes_in += row.len();
                match decode_row(row, &mut out.values[i * dim..(i + 1) * dim]) {
                    Some((version, score)) => {
                        out.fetched[i] = Fetched::Found;
                        out.versions[i] = version;
                        out.scores[i] = score;
                    }
                    None => {
                        out.fetched[i] = Fetched::Unavailable;
                        out.errors.push(Error::BadRow {
                            table: core.layout.table().into(),
                            key: keys[i],
                            len: row.len(),
                            want: core.layout.row_bytes(),
                        });
                    }
                }
            }
            Counters::add(&core.counters.bytes_in, bytes_in);
            spent.push(rows);
        }
        // The parser's row buffers are freed on a task of their own, after
        // the rows are answered (inline outside a runtime): one free per
        // row (a 144-byte row takes glibc's slow path) is about a sixth of
        // the tier's thread in a cold read (`BENCHMARKS.md`).
        if let (false, Ok(rt)) = (spent.is_empty(), tokio::runtime::Handle::try_current()) {
            rt.spawn(async move { drop(spent) });
        }
        let c = &core.counters;
        Counters::add(&c.keys_read, keys.len());
        for f in &out.fetched {
            Counters::add(
                match f {
                    Fetched::Found => &c.found,
                    Fetched::Absent => &c.absent,
                    Fetched::Late => &c.late,
                    Fetched::Unavailable => &c.unavailable,
                },
                1,
            );
        }
        c.fetch.record(start.elapsed());
        out
    }

    /// Writes rows as the mode says: write-through sends them and returns
    /// after the cluster acknowledged them (and their stream entry);
    /// write-back queues them (waiting for room, `QueueFull` after the
    /// queue's wait); read-only refuses. `scores` may be empty (score 0).
    pub async fn write(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<(), Error> {
        let dim = self.core.layout.dim();
        check_rows(keys, values, scores, dim)?;
        self.core.meta_ok()?;
        match self.core.mode {
            Mode::ReadOnly => Err(Error::ReadOnly { table: self.core.layout.table().into() }),
            Mode::WriteThrough => self.send_now(&rows(keys, values, scores, dim, false)).await,
            Mode::WriteBack => self.enqueue(keys, values, scores, dim, false).await,
        }
    }

    /// find_or_insert's write of the rows the cluster did not have when
    /// it was read: each row is set only where the cluster still has no
    /// row of its key (`SET key row NX GET`, one per key, pipelined per
    /// node as a batch's other commands), so that of several hosts that
    /// insert a key at once one row wins and none overwrites another's
    /// (or a later write).
    ///
    /// Write-through: answers, per key, `Found` with the cluster's row
    /// where it had one already (that row, not the one given, is the
    /// key's now) and `Absent` where the given row was written; rows not
    /// acknowledged fail it, as [`Backing::write`]. Write-back: the rows
    /// are queued to be sent so, and all are answered `Absent`; a key
    /// whose row the cluster then refuses is reported by
    /// [`Backing::take_conflicts`]. Read-only refuses.
    pub async fn insert_absent(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<ReadOut, Error> {
        let dim = self.core.layout.dim();
        check_rows(keys, values, scores, dim)?;
        self.core.meta_ok()?;
        let mut out = ReadOut {
            fetched: vec![Fetched::Absent; keys.len()],
            values: Vec::new(),
            scores: vec![0; keys.len()],
            versions: vec![0; keys.len()],
            errors: Vec::new(),
        };
        match self.core.mode {
            Mode::ReadOnly => return Err(Error::ReadOnly { table: self.core.layout.table().into() }),
            Mode::WriteBack => {
                self.enqueue(keys, values, scores, dim, true).await?;
                return Ok(out);
            }
            Mode::WriteThrough => {}
        }
        let Sent { kept, mut errors, .. } = self.core.send(&rows(keys, values, scores, dim, true), false).await;
        if !errors.is_empty() {
            return Err(errors.swap_remove(0));
        }
        if !kept.is_empty() {
            out.values = vec![0.0; keys.len() * dim];
        }
        for (i, row) in kept {
            match decode_row(&row, &mut out.values[i * dim..(i + 1) * dim]) {
                Some((version, score)) => {
                    out.fetched[i] = Fetched::Found;
                    out.versions[i] = version;
                    out.scores[i] = score;
                }
                None => {
                    return Err(Error::BadRow {
                        table: self.core.layout.table().into(),
                        key: keys[i],
                        len: row.len(),
                        want: self.core.layout.row_bytes(),
                    })
                }
            }
        }
        Ok(out)
    }

    /// Keys whose queued find_or_insert row (write-back) the cluster
    /// refused since the last call, because it had a row of the key
    /// already: the cache's row of such a key is not the cluster's, so
    /// the caller drops it (its next read fetches the cluster's).
    pub fn take_conflicts(&self) -> Vec<u64> {
        std::mem::take(&mut *self.core.conflicts.lock())
    }

    /// Erases `keys` from the cluster as the mode says: write-through
    /// deletes them (`DEL` per group, then their stream entry, so that
    /// other hosts drop them) before returning; write-back queues the
    /// erasures (a read of a queued erasure finds the key absent);
    /// read-only refuses.
    pub async fn erase(&self, keys: &[u64]) -> Result<(), Error> {
        self.core.meta_ok()?;
        match self.core.mode {
            Mode::ReadOnly => Err(Error::ReadOnly { table: self.core.layout.table().into() }),
            Mode::WriteThrough => self.erase_now(keys).await,
            Mode::WriteBack => self.enqueue(keys, &[], &[], 0, false).await,
        }
    }

    /// Erases `keys` from the cluster now, whatever the writing mode: the
    /// `DEL`s and their stream entry are acknowledged before it returns,
    /// as write-through's erase. For erase_if and clear, which walk the
    /// cluster (a write-back table's queue flushed first). Read-only
    /// refuses.
    pub async fn erase_now(&self, keys: &[u64]) -> Result<(), Error> {
        if self.core.mode == Mode::ReadOnly {
            return Err(Error::ReadOnly { table: self.core.layout.table().into() });
        }
        self.core.meta_ok()?;
        let rows: Vec<Row> = keys.iter().map(|&key| Row { key, score: 0, values: &[], nx: false }).collect();
        self.send_now(&rows).await
    }

    /// Starts a walk of the table's rows in the cluster, over the masters
    /// that serve slots now ([`Backing::scan_next`]).
    pub fn scan(&self) -> Scan {
        Scan { nodes: self.core.cluster.master_nodes(), node: 0, cursor: 0 }
    }

    /// The walk's next keys of the table's rows (about `count`, at least
    /// one), `None` once every master has been walked: `SCAN` with the
    /// table's `MATCH` pattern on one master after the other, the keys of
    /// other tables dropped. As `SCAN` guarantees, a row present for the
    /// whole walk is seen (maybe twice); rows written during it, or in
    /// slots that migrate during it, may be missed. A master that fails
    /// ends the walk with `Unavailable`, naming it.
    pub async fn scan_next(&self, scan: &mut Scan, count: usize) -> Result<Option<Vec<u64>>, Error> {
        let (core, mut keys) = (&self.core, Vec::new());
        core.meta_ok()?;
        let pattern = core.layout.scan_pattern();
        while keys.len() < count {
            let Some(node) = scan.nodes.get(scan.node) else { break };
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(scan.cursor).arg("MATCH").arg(&pattern[..]).arg("COUNT").arg(SCAN_COUNT);
            let failed = |detail: String| {
                core.counters.node_error(node);
                Error::Unavailable { node: node.clone(), detail: format!("SCAN: {detail}") }
            };
            let v = core.cluster.on_node(node, cmd).await.map_err(failed)?;
            let (cursor, page): (u64, Vec<Vec<u8>>) =
                redis::FromRedisValue::from_redis_value(v).map_err(|e| failed(e.to_string()))?;
            keys.extend(page.iter().filter_map(|k| core.layout.parse_row_key(k)));
            scan.cursor = cursor;
            if cursor == 0 {
                scan.node += 1;
            }
        }
        Ok((!keys.is_empty()).then_some(keys))
    }

    /// Write-through's half of `write` and `erase`: `rows` sent, the first
    /// error (if any) answered once every node has answered.
    async fn send_now(&self, rows: &[Row<'_>]) -> Result<(), Error> {
        let Sent { mut errors, .. } = self.core.send(rows, false).await;
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.swap_remove(0))
        }
    }

    /// Write-back's half of `write` and `erase` (an erasure: no values,
    /// `dim` 0): queued and counted, `QueueFull` counted too.
    async fn enqueue(&self, keys: &[u64], values: &[f32], scores: &[u64], dim: usize, nx: bool) -> Result<(), Error> {
        Counters::add(&self.core.counters.queued_total, keys.len());
        let r = self.core.queue.push(keys, values, scores, dim, nx).await;
        if r.is_err() {
            Counters::add(&self.core.counters.queue_full, 1);
        }
        r
    }

    /// Waits until the write-back queue is empty (`FlushTimeout` naming
    /// the rows left after `timeout`). Immediate in other modes.
    pub async fn flush(&self, timeout: Duration) -> Result<(), Error> {
        if !self.core.queue.is_empty() {
            // A held queue does not drain.
            self.core.meta_ok()?;
        }
        let before = self.core.write_failures.lock().clone();
        self.core.queue.drain(timeout).await.map_err(|e| match e {
            Error::FlushTimeout { .. } if self.core.meta_error().is_some() => self.core.meta_error().unwrap_or(e),
            Error::FlushTimeout { rows, .. } => {
                let (mut short, mut other) = (false, false);
                // Failed writes only, each counted with its words: the node
                // errors of every kind (the stream's reads too) named a
                // node "25 failed commands" with no last failure.
                let mut failed: Vec<String> = (self.core.write_failures.lock().iter())
                    .filter_map(|(n, f)| {
                        let new = f.count - before.get(n).map_or(0, |b| b.count);
                        if new == 0 {
                            return None;
                        }
                        match f.last.starts_with("WAIT") {
                            true => short = true,
                            false => other = true,
                        }
                        Some(format!("{n}: {new} failed {}, the last: {}", plural(new, "command"), f.last))
                    })
                    .collect();
                // A node that answers nothing (stopped, swapping) fails no
                // command before the batch's own deadline: named as silent,
                // not as slow (a tester's SIGSTOPped master was "no node
                // failed a command meanwhile").
                let silent = self.core.silent_nodes();
                other |= !silent.is_empty();
                failed.extend(silent.iter().map(|(n, waited)| {
                    format!(
                        "{n} has not answered the batch sent to it {} ms ago (stopped, swapping or overloaded: its \
                         rows wait for it)",
                        waited.as_millis()
                    )
                }));
                let nodes = if failed.is_empty() {
                    "no node failed a command meanwhile, and every node answered within the response timeout: the \
                     writes are slower than the flush's timeout; retry"
                        .into()
                } else if short {
                    format!(
                        "{}; the masters took the rows, but fewer of their replicas acknowledged them than the \
                         table's wait_replicas ({}) asks: attach replicas to every master (redis-cli --cluster \
                         add-node NEW:PORT ANY:PORT --cluster-slave), or drop-table once they are there and create \
                         the table again with a lower --backing-wait-replicas",
                        failed.join(", "),
                        self.core.options.wait_replicas
                    )
                } else {
                    format!("{}; retry when the nodes accept writes again", failed.join(", "))
                };
                Error::FlushTimeout { rows, nodes, replicas_only: short && !other }
            }
            e => e,
        })
    }

    /// Gives the write-back queue up ([`Queue::discard`]); the rows
    /// dropped. For a table that is gone: its rows must not land later.
    pub fn discard(&self) -> u64 {
        self.core.queue.discard()
    }

    /// Starts reading the table's stream from its current end: what other
    /// hosts write from now on comes back as invalidations.
    pub async fn subscribe(&self) -> Result<Invalidations, Error> {
        Invalidations::open(self.core.clone()).await
    }

    /// The tier's stats now.
    pub fn stats(&self) -> Stats {
        let c = &self.core.counters;
        let (queue_rows, queue_bytes, oldest) = self.core.queue.window();
        let ((unpublished_entries, unpublished_bytes), unpublished_resets) = {
            let u = self.core.unpublished.lock();
            (u.window(), u.resets)
        };
        let l = |a: &AtomicU64| a.load(Relaxed);
        Stats {
            mode: self.core.mode.as_str().into(),
            groups: self.core.layout.groups(),
            keys_read: l(&c.keys_read),
            found: l(&c.found) + l(&c.found_queued),
            found_queued: l(&c.found_queued),
            absent: l(&c.absent),
            late: l(&c.late),
            unavailable: l(&c.unavailable),
            rows_written: l(&c.rows_written),
            write_batches: l(&c.write_batches),
            bytes_in: l(&c.bytes_in),
            bytes_out: l(&c.bytes_out),
            queue_rows,
            queue_bytes,
            queue_limit_bytes: if self.core.mode == Mode::WriteBack { self.core.queue.limit } else { 0 },
            queue_oldest_ms: oldest.as_millis() as u64,
            queued_total: l(&c.queued_total),
            queue_full: l(&c.queue_full),
            invalidations: l(&c.invalidations),
            unpublished_entries,
            unpublished_bytes,
            unpublished_limit_bytes: self.core.options.unpublished_bytes,
            unpublished_resets,
            node_errors: c.node_errors.lock().clone(),
            fetch_us: c.fetch.snapshot(),
            write_us: c.write.snapshot(),
            staleness_us: c.staleness.snapshot(),
        }
    }
}

/// Microseconds since the Unix epoch.
pub(crate) fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

impl Core {
    /// The next version: microseconds since the epoch, strictly above the
    /// last one this handle gave.
    fn version(&self) -> u64 {
        let now = now_us();
        let mut last = self.clock.load(Relaxed);
        loop {
            let v = now.max(last + 1);
            match self.clock.compare_exchange_weak(last, v, Relaxed, Relaxed) {
                Ok(_) => return v,
                Err(l) => last = l,
            }
        }
    }

    /// Sends rows: one `MSET` per group, one `DEL` per group of the
    /// erasures and one `SET key row NX GET` per set-if-absent row, all at
    /// once (one pipeline per node), then one stream entry naming the keys
    /// the cluster acknowledged writing. Returns which rows failed, the
    /// set-if-absent rows whose key the cluster had already (with its
    /// row), and one error per failed node. The keys of failed rows are
    /// [`Doubts`] unless `queued` (the write-back queue sends them again,
    /// and their entry follows that send).
    pub(crate) async fn send(self: &Arc<Self>, rows: &[Row<'_>], queued: bool) -> Sent {
        let start = Instant::now();
        let version = self.version();
        let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); self.layout.groups() as usize];
        for (i, r) in rows.iter().enumerate() {
            by_group[self.layout.group(r.key) as usize].push(i);
        }
        // Per group: one MSET of its rows, one DEL of its erasures; one
        // SET NX per set-if-absent row (Redis has no multi-key form).
        let mut parts: Vec<(u32, Vec<usize>)> = Vec::new();
        for (g, ix) in by_group.into_iter().enumerate() {
            let (nx, ix): (Vec<usize>, Vec<usize>) = ix.into_iter().partition(|&i| rows[i].nx);
            let (dels, sets): (Vec<usize>, Vec<usize>) = ix.into_iter().partition(|&i| rows[i].values.is_empty());
            parts.extend([sets, dels].into_iter().filter(|p| !p.is_empty()).map(|p| (g as u32, p)));
            parts.extend(nx.into_iter().map(|i| (g as u32, vec![i])));
        }
        let groups: Vec<(u32, &Vec<usize>)> = parts.iter().map(|(g, ix)| (*g, ix)).collect();
        let (mut buf, mut key) = (Vec::new(), Vec::new());
        let cmds: Vec<(u16, redis::Cmd)> = groups
            .iter()
            .map(|&(g, ix)| {
                let first = &rows[ix[0]];
                let erase = first.values.is_empty();
                let mut cmd = redis::cmd(if first.nx {
                    "SET"
                } else if erase {
                    "DEL"
                } else {
                    "MSET"
                });
                for &i in ix {
                    self.layout.write_row_key(rows[i].key, &mut key);
                    cmd.arg(&key[..]);
                    if !erase {
                        buf.clear();
                        encode_row(version, rows[i].score, rows[i].values, &mut buf);
                        cmd.arg(&buf[..]);
                    }
                }
                if first.nx {
                    // Redis 7: NX with GET answers the row it kept, or nil
                    // where it set ours.
                    cmd.arg("NX").arg("GET");
                }
                (self.layout.slot_of_group(g), cmd)
            })
            .collect();
        // Writes wait for the cluster as long as a command may take (the
        // read deadline is for reads); a row not acknowledged is failed.
        let deadline = tokio::time::Instant::now() + self.options.response_timeout * (self.options.retries + 2);
        let (mut results, took) = self.cluster.run_at(cmds, deadline).await;
        // A set-if-absent row the cluster refused is done whatever `WAIT`
        // says: nothing of ours was written.
        let mut kept = Vec::new();
        let mut refused = vec![false; groups.len()];
        for (p, (&(_, ix), r)) in groups.iter().zip(&mut results).enumerate() {
            if !rows[ix[0]].nx {
                continue;
            }
            match r {
                Ok(redis::Value::Nil) => {}
                Ok(redis::Value::BulkString(row)) => {
                    Counters::add(&self.counters.bytes_in, row.len());
                    kept.push((ix[0], std::mem::take(row)));
                    refused[p] = true;
                }
                Ok(other) => {
                    let node = self.cluster.node_of(self.layout.slot_of_group(groups[p].0));
                    *r = Err(Failure::Node { node, detail: format!("SET NX GET answered {other:?}") });
                }
                Err(_) => {}
            }
        }
        if self.options.wait_replicas > 0 {
            self.wait_replicas(&took, &mut results).await;
        }
        let mut failed = vec![false; rows.len()];
        let mut errors = Vec::new();
        let mut nodes: Vec<String> = Vec::new();
        let mut acked: Vec<u8> = Vec::with_capacity(rows.len() * 8);
        for ((&(g, ix), r), refused) in groups.iter().zip(results).zip(refused) {
            if refused {
                continue;
            }
            match r {
                Ok(_) => ix.iter().for_each(|&i| acked.extend_from_slice(&rows[i].key.to_le_bytes())),
                Err(f) => {
                    ix.iter().for_each(|&i| failed[i] = true);
                    let (node, detail) = match f {
                        Failure::Node { node, detail } => (node, detail),
                        Failure::Late => (self.cluster.node_of(self.layout.slot_of_group(g)), "timed out".into()),
                    };
                    self.write_failed(&node, &detail);
                    // The node may still run it: announced again later.
                    if !queued {
                        self.doubts.lock().add(ix.iter().map(|&i| rows[i].key), &node, self.options.unpublished_bytes);
                    }
                    if !nodes.contains(&node) {
                        nodes.push(node.clone());
                        errors.push(Error::Unavailable { node, detail });
                    }
                }
            }
        }
        let sent = acked.len() / 8;
        Counters::add(&self.counters.rows_written, sent);
        Counters::add(&self.counters.bytes_out, sent * self.layout.row_bytes());
        Counters::add(&self.counters.write_batches, 1);
        if sent > 0 {
            // Rows the cluster acknowledged stand even when the stream's
            // node refuses their entry: the entry waits on this host and
            // is appended once that node accepts again (`republish`), so
            // other hosts hear the write late; failing the request would
            // tell the writer its rows did not land (a retried
            // accum_or_assign or apply_gradients would apply twice).
            self.publish(version, &acked).await;
        }
        self.counters.write.record(start.elapsed());
        Sent { failed, kept, errors }
    }

    /// `WAIT`s on every node that took a write of the batch (`took`, per
    /// command: the nodes that acknowledged it, a migration's importing
    /// node among them where a key was asked there) for `wait_replicas`
    /// replicas to have it; a command fails when one of its nodes' replicas
    /// did not all acknowledge within `wait_timeout`.
    async fn wait_replicas(&self, took: &[Vec<Arc<str>>], results: &mut [Result<redis::Value, Failure>]) {
        let mut nodes: Vec<&Arc<str>> =
            took.iter().zip(results.iter()).filter(|(_, r)| r.is_ok()).flat_map(|(t, _)| t).collect();
        nodes.sort_unstable();
        nodes.dedup();
        let (want, ms) = (self.options.wait_replicas, self.options.wait_timeout.as_millis() as u64);
        let waits = nodes.iter().map(|n| self.cluster.on_node(n, redis::cmd("WAIT").arg(want).arg(ms).clone()));
        let answers = futures_util::future::join_all(waits).await;
        for (node, a) in nodes.into_iter().zip(answers) {
            let detail = match a {
                Ok(redis::Value::Int(got)) if got >= i64::from(want) => continue,
                Ok(redis::Value::Int(got)) => format!("WAIT: {got} of {want} replicas acknowledged within {ms} ms"),
                Ok(v) => format!("WAIT answered {v:?}, not a count of replicas"),
                Err(e) => format!("WAIT: {e}"),
            };
            for (t, r) in took.iter().zip(results.iter_mut()) {
                if r.is_ok() && t.contains(node) {
                    *r = Err(Failure::Node { node: node.to_string(), detail: detail.clone() });
                }
            }
        }
    }

    /// A write (rows, or a stream entry) failed on `node`: counted in
    /// `node_errors` and, with `detail`, among the failed writes a flush
    /// that times out names.
    fn write_failed(&self, node: &str, detail: &str) {
        self.counters.node_error(node);
        let mut failures = self.write_failures.lock();
        let f = failures.entry(node.to_string()).or_default();
        f.count += 1;
        f.last = detail.to_string();
    }

    /// Publishes a write's entry: appended at once when none waits, else
    /// after those waiting; one that cannot be appended waits with them
    /// ([`Core::unpublished`]), and the write stands. An entry whose own
    /// append failed is not tried again here (a stream node that does not
    /// answer would hold the write for a second timeout): the table's
    /// consumer retries it.
    async fn publish(self: &Arc<Self>, version: u64, keys: &[u8]) {
        let acked = now_us();
        if !self.has_unpublished() {
            if let Appended::Failed(Waiting::Entry(v, k, t), _) =
                self.append(Waiting::Entry(version, keys.to_vec(), acked)).await
            {
                self.hold(v, &k, t);
            }
            return;
        }
        self.hold(version, keys, acked);
        let _ = self.republish().await;
    }

    /// An entry that waits, behind those waiting ([`Unpublished::push`]).
    fn hold(&self, version: u64, keys: &[u8], acked: u64) {
        let limit = self.options.unpublished_bytes;
        if self.unpublished.lock().push(version, keys, acked, limit) {
            tracing::warn!(table = %self.layout.table(), limit_bytes = limit, "the table's stream entries waiting for the stream's node reached their bound: they are replaced by one reset entry, and other hosts drop their whole cache of the table when it is appended");
        }
    }

    /// Appends the unpublished entries, a reset first, then oldest first,
    /// stopping at the first that fails (it and those after it wait for
    /// the next try) or stalls.
    pub(crate) async fn republish(self: &Arc<Self>) -> Result<(), Error> {
        loop {
            let Some(next) = self.unpublished.lock().take() else { return Ok(()) };
            match self.append(next).await {
                Appended::Done => {}
                Appended::Stalled => return Ok(()),
                Appended::Failed(w, e) => {
                    self.unpublished.lock().put_back(w);
                    return Err(e);
                }
            }
        }
    }

    /// Whether entries wait to be appended.
    pub(crate) fn has_unpublished(&self) -> bool {
        !self.unpublished.lock().is_empty()
    }

    /// Appends `{o: origin, v: version, t: ack µs, k: keys (u64 LE)}` to
    /// the table's stream (with `r: 1` for a reset, which names no keys),
    /// trimmed to about `stream_len` entries, waiting up to the response
    /// timeout for the node.
    ///
    /// An `XADD` is sent once: a node that does not answer may be stalled
    /// with the command in its socket, and runs it when it resumes, so
    /// sending it again would append the entry twice (a tester's stopped
    /// stream node got each such entry two or three times). Past the
    /// response timeout the entry is left to a task that awaits its
    /// answer on its connection, for up to [`STALL_LIMIT`], and puts it
    /// back among the waiting entries unless it landed. A refusal (a
    /// redirection, `WRONGTYPE`) was not run: a redirected entry is sent
    /// again through the cluster's redirections at once.
    async fn append(self: &Arc<Self>, w: Waiting) -> Appended {
        let slot = crate::layout::slot(self.layout.table().as_bytes());
        let (version, keys, acked_us, reset) = match &w {
            Waiting::Reset(v, t) => (*v, &[][..], *t, true),
            Waiting::Entry(v, k, t) => (*v, &k[..], *t, false),
        };
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.layout.stream_key()).arg("MAXLEN").arg("~").arg(self.options.stream_len).arg("*");
        cmd.arg("o").arg(self.origin).arg("v").arg(version).arg("t").arg(acked_us).arg("k").arg(keys);
        if reset {
            cmd.arg("r").arg(1);
        }
        let bytes = w.bytes();
        let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, mut rx) = tokio::sync::oneshot::channel::<(Result<(), Error>, Waiting)>();
        let (core, gave_up) = (self.clone(), abandoned.clone());
        // The node it is sent to (`xadd` follows the slot map).
        let answered = self.cluster.node_of(slot);
        tokio::spawn(async move {
            let r = core.xadd(slot, cmd).await;
            if let Err(Error::Unavailable { node, detail }) = &r {
                core.write_failed(node, &format!("the table's stream entry: {detail}"));
            }
            // Under the lock: the caller either takes the answer or has
            // given up on it (and counted the entry stalled), never neither.
            let mut u = core.unpublished.lock();
            if gave_up.load(Relaxed) {
                u.stalled = (u.stalled.0 - 1, u.stalled.1 - bytes);
                if r.is_err() {
                    u.put_back(w);
                } else {
                    // Landed after a stall: a failover meanwhile may
                    // have lost it ([`Doubts`]).
                    let keys = match w {
                        Waiting::Reset(..) => None,
                        Waiting::Entry(_, k, _) => Some(k),
                    };
                    core.doubts.lock().landed_late(answered, keys, core.options.unpublished_bytes);
                }
            } else if let Err((Err(_), w)) = tx.send((r, w)) {
                u.put_back(w);
            }
        });
        let got = match tokio::time::timeout(self.options.response_timeout, &mut rx).await {
            Ok(got) => got.ok(),
            Err(_) => {
                let mut u = self.unpublished.lock();
                match rx.try_recv() {
                    Ok(got) => Some(got),
                    Err(_) => {
                        abandoned.store(true, Relaxed);
                        u.stalled = (u.stalled.0 + 1, u.stalled.1 + bytes);
                        drop(u);
                        let detail =
                            format!("the table's stream entry: no answer within {:?}", self.options.response_timeout);
                        self.write_failed(&self.cluster.node_of(slot), &detail);
                        return Appended::Stalled;
                    }
                }
            }
        };
        match got {
            Some((Ok(()), _)) => Appended::Done,
            Some((Err(e), w)) => Appended::Failed(w, e),
            // The task ended without an answer (it panicked): its entry is
            // lost, as a crash of this host would lose it.
            None => Appended::Done,
        }
    }

    /// Sends one `XADD` on the appending connection, made to the stream's
    /// node if needed; a refusal that redirects it is sent again through
    /// the cluster's redirections.
    async fn xadd(&self, slot: u16, cmd: redis::Cmd) -> Result<(), Error> {
        let node = self.cluster.node_of(slot);
        let cached = self.appender.lock().as_ref().filter(|(n, _)| *n == node).map(|(_, c)| c.clone());
        let mut conn = match cached {
            Some(c) => c,
            None => {
                let c = self.cluster.dedicated(slot, STALL_LIMIT).await?;
                *self.appender.lock() = Some((node.clone(), c.clone()));
                c
            }
        };
        let e = match redis::aio::ConnectionLike::req_packed_command(&mut conn, &cmd).await {
            Ok(redis::Value::ServerError(e)) => redis::RedisError::from(e),
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        if matches!(e.code(), Some("MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN")) {
            self.cluster.refresh_soon().await;
            return self.cluster.one(slot, cmd).await.map(drop);
        }
        if e.code().is_none() {
            // The connection failed (not the command): made again next time.
            *self.appender.lock() = None;
        }
        Err(Error::Unavailable { node, detail: format!("XADD {}: {e}", self.layout.stream_key()) })
    }
}

/// Opens the cluster of a table that existed before ([`Options::existing`])
/// and reads its meta hash, which must be there: through all the seeds
/// when those that answer are one cluster, else through each cluster's
/// seeds in turn until one holds the meta hash. A cluster without it is
/// never adopted: the answer is then [`Error::NoMeta`].
async fn open_existing(table: &str, dim: usize, options: &Options, net: Net) -> Result<(Cluster, u32), Error> {
    let infos = crate::cluster::parse_seeds(&options.seeds)?;
    let groups = crate::cluster::seed_clusters(&infos, net).await;
    let tries: Vec<Vec<String>> = if groups.len() <= 1 {
        vec![options.seeds.clone()]
    } else {
        tracing::warn!(table, seeds = %crate::cluster::describe_groups(&options.seeds, &groups), "the table's seeds belong to more than one cluster: it is opened on the one that holds its meta hash");
        groups.iter().map(|g| g.iter().map(|&i| options.seeds[i].clone()).collect()).collect()
    };
    let mut last = None;
    for seeds in tries {
        let opened = match Cluster::open(table, &seeds, net, false).await {
            Ok(cluster) => meta(&cluster, table, dim, &options.row, false).await.map(|g| (cluster, g)),
            Err(e) => Err(e),
        };
        match opened {
            Ok(done) => return Ok(done),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::Unreachable { seeds: String::new(), detail: "no seed given".into() }))
}

/// Reads the table's meta hash, writing it first if the table is new
/// (`create`); without `create`, a cluster that has no meta hash for the
/// table is refused ([`Error::NoMeta`]) and nothing is written to it.
async fn meta(cluster: &Cluster, table: &str, dim: usize, row: &str, create: bool) -> Result<u32, Error> {
    let key = Layout::meta_key(table);
    let slot = crate::layout::slot(table.as_bytes());
    if !create {
        let exists = cluster.one(slot, redis::cmd("EXISTS").arg(&key).clone()).await?;
        if exists != Value::Int(1) {
            return Err(Error::NoMeta { table: table.into(), key, nodes: cluster.master_nodes().join(",") });
        }
    }
    let groups = GROUPS_PER_MASTER * cluster.masters().max(1) as u32;
    // The table's own keys hold what the layout says, or nothing yet: a
    // key another program gave another type is named, not met later as a
    // node's WRONGTYPE.
    let stream = Layout::stream_key_of(table);
    for (k, want) in [(&key, "hash"), (&stream, "stream")] {
        let t = cluster.one(slot, redis::cmd("TYPE").arg(k).clone()).await?;
        let t: String = redis::FromRedisValue::from_redis_value(t).unwrap_or_default();
        if t != "none" && t != want {
            return Err(Error::Mismatch {
                table: table.into(),
                detail: format!("{k} holding a {t}, where the layout keeps a {want} (another program wrote it)"),
            });
        }
    }
    // HSETNX per field: two hosts creating the table at once both end up
    // reading the same fields back, whichever wrote each first. (A meta
    // hash written before `row` existed takes this host's.)
    write_meta_absent(
        cluster,
        &key,
        slot,
        &(Some(u64::from(LAYOUT)), Some(dim as u64), Some(u64::from(groups)), Some(row.into())),
    )
    .await?;
    let (layout, stored_dim, groups, stored_row) = read_meta(cluster, &key, slot).await?.map_err(|e| {
        Error::Mismatch { table: table.into(), detail: format!("a meta hash {key} that does not parse ({e})") }
    })?;
    let mismatch = |detail: String| Error::Mismatch { table: table.into(), detail };
    let shown = |v: Option<u64>| v.map_or_else(|| "none".to_string(), |v| v.to_string());
    if layout != Some(u64::from(LAYOUT)) {
        return Err(mismatch(format!("layout {}, this daemon writes layout {LAYOUT}", shown(layout))));
    }
    let stored_row = stored_row.unwrap_or_else(|| "none".into());
    if stored_dim != Some(dim as u64) || stored_row != row {
        return Err(mismatch(format!(
            "rows of {} floats ({stored_row}), this table's rows are {dim} floats ({row}): give this table the \
             same dim and optimizer",
            shown(stored_dim)
        )));
    }
    match groups {
        Some(g @ 1..=65_536) => Ok(g as u32),
        g => Err(mismatch(format!("groups {}, not 1 to 65536", shown(g)))),
    }
}

/// The meta hash's fields as `HMGET … layout dim groups row` answers them.
type MetaFields = (Option<u64>, Option<u64>, Option<u64>, Option<String>);

/// Reads the meta hash `key` (in `slot`): its fields, or why they do not
/// parse (the inner error); the outer one is the node's.
async fn read_meta(cluster: &Cluster, key: &str, slot: u16) -> Result<Result<MetaFields, String>, Error> {
    let cmd = redis::cmd("HMGET").arg(key).arg("layout").arg("dim").arg("groups").arg("row").clone();
    let v = cluster.one(slot, cmd).await?;
    Ok(<MetaFields as redis::FromRedisValue>::from_redis_value(v).map_err(|e| e.to_string()))
}

/// Writes each field of `m` into the meta hash `key` where it is absent
/// (`HSETNX`: of several hosts writing at once, the first wins each field).
async fn write_meta_absent(cluster: &Cluster, key: &str, slot: u16, m: &MetaFields) -> Result<(), Error> {
    let text = |v: Option<u64>| v.unwrap_or_default().to_string();
    let fields =
        [("layout", text(m.0)), ("dim", text(m.1)), ("groups", text(m.2)), ("row", m.3.clone().unwrap_or_default())];
    for (f, v) in &fields {
        cluster.one(slot, redis::cmd("HSETNX").arg(key).arg(*f).arg(v).clone()).await?;
    }
    Ok(())
}

/// A meta hash's fields as errors show them.
fn describe_meta(m: &MetaFields) -> String {
    let shown = |v: Option<u64>| v.map_or_else(|| "none".to_string(), |v| v.to_string());
    format!(
        "layout {}, dim {}, groups {}, row {:?}",
        shown(m.0),
        shown(m.1),
        shown(m.2),
        m.3.as_deref().unwrap_or("none")
    )
}

/// Reads the table's meta hash again every `every`, for as long as the
/// tier is open ([`Core::check_meta`]). (An open table never looked at
/// it again: a tester's meta hash, deleted, or lost with a node restarted
/// empty, let another host create the table anew with another group
/// count, and the two hosts then read and wrote different keys, each
/// believing the other's rows absent.)
/// Announces [`Doubts`] once they settle, every 250 ms, while the tier
/// lives.
async fn watch_doubts(core: std::sync::Weak<Core>) {
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Some(core) = core.upgrade() else { return };
        core.settle_doubts().await;
    }
}

async fn watch_meta(core: std::sync::Weak<Core>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(core) = core.upgrade() else { return };
        if core.queue.closed() && core.queue.is_empty() {
            return;
        }
        core.check_meta().await;
    }
}

impl Core {
    /// Announces the [`Doubts`] on the stream once `2 × response_timeout`
    /// passed since the last and every node they name that still serves
    /// slots answers a `PING` (after the commands buffered before it).
    async fn settle_doubts(self: &Arc<Self>) {
        let (nodes, last) = {
            let d = self.doubts.lock();
            match d.last {
                Some(t) if t.elapsed() >= 2 * self.options.response_timeout => (d.nodes.clone(), d.last),
                _ => return,
            }
        };
        self.cluster.refresh_soon().await;
        let masters = self.cluster.master_nodes();
        for n in nodes.iter().filter(|n| masters.contains(n)) {
            let ping = self.cluster.on_node(n, redis::cmd("PING"));
            if !matches!(tokio::time::timeout(self.options.response_timeout, ping).await, Ok(Ok(_))) {
                return;
            }
        }
        let stream = self.cluster.node_of(crate::layout::slot(self.layout.table().as_bytes()));
        let (mut keys, mut reset, late) = {
            let mut d = self.doubts.lock();
            if d.last != last {
                return; // more came meanwhile: they settle first
            }
            let d = std::mem::take(&mut *d);
            let keys: Vec<u8> = d.keys.into_iter().flat_map(u64::to_le_bytes).collect();
            (keys, d.reset, d.landed_late)
        };
        // Entries whose node still serves the stream stand.
        let mut nodes = nodes;
        for (n, k) in late.into_iter().filter(|(n, _)| *n != stream) {
            match k {
                Some(k) if !reset => keys.extend_from_slice(&k),
                _ => reset = true,
            }
            if !nodes.contains(&n) {
                nodes.push(n);
            }
        }
        if !reset && keys.is_empty() {
            return;
        }
        let table = self.layout.table();
        if reset {
            tracing::warn!(table, nodes = %nodes.join(","), "the keys of writes a node left in doubt (it failed or stalled mid-write, or a failover may have lost their stream entry) outgrew the bound of waiting entries: a reset is announced, and other hosts drop their cache of the table");
            self.unpublished.lock().fold(self.version(), now_us());
            let _ = self.republish().await;
        } else {
            tracing::info!(table, keys = keys.len() / 8, nodes = %nodes.join(","), "announcing again the keys of writes a node left in doubt (it failed or stalled mid-write, or a failover may have lost their stream entry): other hosts read them from the cluster again");
            self.publish(self.version(), &keys).await;
        }
    }

    /// The error the table's requests that need the cluster fail with
    /// while its meta hash says another layout.
    fn meta_error(&self) -> Option<Error> {
        self.meta_error.lock().clone()
    }

    /// `Err` while the table's meta hash says another layout.
    fn meta_ok(&self) -> Result<(), Error> {
        self.meta_error().map_or(Ok(()), Err)
    }

    /// The nodes with a write-back batch in flight for longer than the
    /// response timeout, and how long the oldest has waited.
    fn silent_nodes(&self) -> Vec<(String, Duration)> {
        let limit = self.options.response_timeout;
        let mut v: Vec<(String, Duration)> = (self.in_flight.lock().iter())
            .filter_map(|(n, at)| at.iter().map(Instant::elapsed).max().map(|w| (n.clone(), w)))
            .filter(|(_, w)| *w > limit)
            .collect();
        v.sort();
        v
    }

    /// This handle's meta fields.
    fn own_meta(&self) -> MetaFields {
        let l = &self.layout;
        (Some(u64::from(LAYOUT)), Some(l.dim() as u64), Some(u64::from(l.groups())), Some(self.options.row.clone()))
    }

    /// Reads the table's meta hash: a field that is gone (the hash
    /// deleted, or lost with its node) is written back with this handle's
    /// value where still absent (`HSETNX`: of several hosts doing so, the
    /// first wins each field), said at WARN; a hash that then says another
    /// layout than this handle's sets [`Core::meta_error`] (said at ERROR),
    /// one that agrees clears it. A node that does not answer changes
    /// nothing: it is read again at the next check.
    pub(crate) async fn check_meta(&self) {
        let table = self.layout.table();
        let key = Layout::meta_key(table);
        let slot = crate::layout::slot(table.as_bytes());
        let read = || async {
            match read_meta(&self.cluster, &key, slot).await {
                Ok(m) => Some(m),
                Err(Error::Unavailable { detail, .. }) if detail.starts_with("WRONGTYPE") => {
                    Some(Err(format!("a key of another type ({detail})")))
                }
                Err(_) => None,
            }
        };
        let ours = self.own_meta();
        let Some(mut got) = read().await else { return };
        if let Ok(m) = &got {
            if m.0.is_none() || m.1.is_none() || m.2.is_none() || m.3.is_none() {
                if write_meta_absent(&self.cluster, &key, slot, &ours).await.is_err() {
                    return;
                }
                tracing::warn!(table, key = %key, was = %describe_meta(m), "the table's meta hash was gone from the cluster (deleted, or its node restarted without its data): this host wrote its layout back, so that a host that opens the table now gets the layout of the hosts that use it");
                let Some(again) = read().await else { return };
                got = again;
            }
        }
        let found = match &got {
            Ok(m) if *m == ours => {
                if self.meta_error.lock().take().is_some() {
                    tracing::info!(table, key = %key, "the table's meta hash agrees with this host's layout again: its requests reach the cluster again");
                }
                return;
            }
            Ok(m) => describe_meta(m),
            Err(e) => format!("what does not parse as a meta hash ({e})"),
        };
        let (_, dim, groups, row) = &ours;
        let e = Error::MetaReplaced {
            table: table.into(),
            key: key.clone(),
            found,
            ours: describe_meta(&ours),
            restore: format!(
                "layout {LAYOUT} dim {} groups {} row {:?}",
                dim.unwrap_or_default(),
                groups.unwrap_or_default(),
                row.as_deref().unwrap_or_default()
            ),
        };
        let mut held = self.meta_error.lock();
        if held.as_ref() != Some(&e) {
            tracing::error!(table, error = %e, "the table's meta hash in the cluster says another layout than this host's");
            *held = Some(e);
        }
    }
}

/// Batches of the write-back queue in flight at once per node: one being
/// answered while the next is written. Each batch holds the rows of one
/// node's groups, so a node that stalls holds up its own rows only.
const NODE_DEPTH: usize = 2;

/// How long a node whose batch failed waits before its next batch: from
/// 20 ms, doubled by each failure up to 1 s, reset by a success.
const FIRST_PAUSE: Duration = Duration::from_millis(20);

/// Sends the write-back queue until the queue is closed and empty: for
/// each node the slot map names, batches of the rows of its groups, up to
/// [`NODE_DEPTH`] in flight per node. A node's failed batch goes back to
/// the queue and that node's next batch waits a pause that doubles to
/// 1 s; the other nodes' batches go on meanwhile. (With batches across
/// every node, 4 in flight, one stopped master held up the rows of the
/// healthy ones for as long as it stalled: a tester's 20 000 queued rows
/// stayed queued for 2 s and took 10 s to come down to the stalled node's
/// 7 650, and a SIGKILL meanwhile lost 1 066 rows of healthy nodes.)
async fn flusher(core: Arc<Core>) {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    use std::collections::HashMap;
    let mut inflight = FuturesUnordered::new();
    let mut busy: HashMap<String, usize> = HashMap::new();
    // Per node that failed: not before when, and the pause after the next failure.
    let mut paused: HashMap<String, (tokio::time::Instant, Duration)> = HashMap::new();
    // The groups of each node, made again only when the slot map changed
    // (the loop runs at every write's wake-up).
    let mut by_node: (Option<u64>, Vec<(String, Vec<usize>)>) = (None, Vec::new());
    loop {
        let now = tokio::time::Instant::now();
        let mut wake = now + Duration::from_millis(100);
        let generation = core.cluster.generation();
        if by_node.0 != Some(generation) {
            by_node = (Some(generation), core.groups_by_node());
        }
        // A replaced meta hash holds the queue: its rows are this
        // layout's, and would land where the table's other hosts do not
        // read (or read rows of another width).
        let held = core.meta_error.lock().is_some();
        for (node, groups) in by_node.1.iter().filter(|_| !held) {
            if let Some(&(until, _)) = paused.get(node) {
                if until > now {
                    wake = wake.min(until);
                    continue;
                }
            }
            let n = busy.entry(node.clone()).or_default();
            while *n < NODE_DEPTH {
                let batch: Batch = core.queue.take_groups(groups, core.options.batch_rows);
                if batch.is_empty() {
                    break;
                }
                *n += 1;
                inflight.push(send_batch(core.clone(), node.clone(), batch));
            }
        }
        if inflight.is_empty() && core.queue.closed() && core.queue.is_empty() {
            return;
        }
        tokio::select! {
            Some((node, ok)) = inflight.next(), if !inflight.is_empty() => {
                if let Some(n) = busy.get_mut(&node) {
                    *n = n.saturating_sub(1);
                }
                if ok {
                    paused.remove(&node);
                } else {
                    let pause = paused.get(&node).map_or(FIRST_PAUSE, |p| p.1);
                    paused.insert(node, (tokio::time::Instant::now() + pause, (pause * 2).min(Duration::from_secs(1))));
                }
            }
            _ = core.queue.work.notified() => {}
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

impl Core {
    /// The layout's groups by the node the slot map names for each (a
    /// group whose slot has no node is under `cluster`), sorted by node.
    fn groups_by_node(&self) -> Vec<(String, Vec<usize>)> {
        let mut by: std::collections::BTreeMap<String, Vec<usize>> = std::collections::BTreeMap::new();
        for g in 0..self.layout.groups() {
            by.entry(self.cluster.node_of(self.layout.slot_of_group(g))).or_default().push(g as usize);
        }
        by.into_iter().collect()
    }
}

/// Sends one batch (of `node`'s groups) and settles it; the node, and
/// whether it all went.
async fn send_batch(core: Arc<Core>, node: String, batch: Batch) -> (String, bool) {
    let sent_at = Instant::now();
    core.in_flight.lock().entry(node.clone()).or_default().push(sent_at);
    let r = send_batch_now(&core, batch).await;
    if let Some(v) = core.in_flight.lock().get_mut(&node) {
        if let Some(i) = v.iter().position(|t| *t == sent_at) {
            v.swap_remove(i);
        }
    }
    (node, r)
}

/// [`send_batch`]'s send: whether it all went.
async fn send_batch_now(core: &Arc<Core>, batch: Batch) -> bool {
    let rows: Vec<Row> =
        batch.iter().map(|(k, e)| Row { key: *k, score: e.score, values: &e.values, nx: e.nx }).collect();
    let Sent { failed, kept, errors } = core.send(&rows, true).await;
    drop(rows);
    // Before the rows leave the queue: once `flush` returns, the cache's
    // rows the cluster refused are known.
    if !kept.is_empty() {
        core.conflicts.lock().extend(kept.iter().map(|&(i, _)| batch[i].0));
    }
    core.queue.settle(batch, &failed);
    !failed.iter().any(|f| *f) && errors.is_empty()
}
