//! Glue between the daemon and `hkv-backing` (issue 34): each backed
//! table's tier, opened when the table is created (so that a bad URL, dead
//! seeds or a non-cluster server refuse `create-table`), drained when it is
//! dropped or the daemon stops, its stats for the stats document.
//!
//! The tiers run on a runtime of their own (two worker threads, made on the
//! first backed table): their connections and the write-back flusher never
//! run on the request executor, and a request awaits a tier through a
//! `JoinHandle`. The tiers sit in front of the router (`State::backing`;
//! the router knows nothing of them): `handle` sends a backed table's
//! requests here and opens / closes a tier with its table, the stats read
//! them, and shutdown drains them (the calls marked `HOOK(backing)`). This
//! module runs the cache's part through the router's typed operations.

mod order;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hkv_backing::{Backing, Fetched, Gap, Mode, ReadOut, Scan};
use hkv_proto::{ErrorCode, ProtoError, Request, Response, TableSpec, WriteOp};
use hkv_shard::{Outcome, ScorePolicy};
use parking_lot::RwLock;

use self::order::{Hold, Order, Snapshot};
use crate::config::backing_options;
use crate::error::shard_error;
use crate::router::{ApplyAnswer, FindAnswer, Router, Table, WriteAnswer};
use crate::shard_ops::Destination;

/// How long dropping a table or stopping the daemon waits for a table's
/// write-back queue to drain.
pub const DRAIN: Duration = Duration::from_secs(10);

/// Every backed table's tier, by table name.
#[derive(Default)]
pub struct Tiers {
    rt: OnceLock<tokio::runtime::Runtime>,
    tables: RwLock<HashMap<String, Arc<Entry>>>,
    /// Restored tables whose cluster could not be opened yet: their spec,
    /// the last attempt, why it failed, and whether the table existed
    /// before ([`Options::existing`]: restored, or holding rows). Their requests are
    /// refused (`backing_unavailable`) and the open is tried again by a
    /// request at most every [`REOPEN_EVERY`].
    waiting: parking_lot::Mutex<HashMap<String, Waiting>>,
    /// Whether `waiting` has any table: a request of a table without a
    /// tier reads only this (no lock) in the common case of none.
    any_waiting: AtomicBool,
}

/// A restored table waiting for its cluster ([`Tiers::waiting`]).
struct Waiting {
    spec: TableSpec,
    last: std::time::Instant,
    why: String,
    existing: bool,
}

/// How often a request of a restored table whose cluster is not open yet
/// tries to open it again.
const REOPEN_EVERY: Duration = Duration::from_secs(5);

/// One backed table: its tier, the keys its cache answered itself, and
/// the keys other hosts wrote since its last request.
struct Entry {
    backing: Backing,
    /// The write-back queue's bound in bytes (0: not write-back), counted
    /// against the host's memory at open ([`Tiers::open`]).
    queue_bound: u64,
    hits: AtomicU64,
    /// Keys of reads the cache missed that the cluster had (filled), had
    /// not (absent), did not answer in time (late) or failed to answer
    /// (unavailable): counted here, since a prefetch also reads keys the
    /// cache then answers, and erase_if reads keys it does not fill.
    filled: AtomicU64,
    /// Of `filled`, the keys answered from this host's write-back queue.
    filled_queued: AtomicU64,
    absent: AtomicU64,
    late: AtomicU64,
    unavailable: AtomicU64,
    /// The table's last read with misses missed nearly every key (a cold
    /// stream): the next find fetches its keys beside the cache's find
    /// ([`Prefetch`]).
    cold: AtomicBool,
    /// Filled by the table's stream consumer, emptied (erased from the
    /// cache) at the start of the table's next request: a read never sees
    /// a row another host's acknowledged write replaced, once this host
    /// has received the write.
    invalid: Arc<parking_lot::Mutex<Vec<u64>>>,
    /// Set by the consumer when other hosts' writes may have been missed
    /// (the stream trimmed entries it had not read, or it subscribed late
    /// after failing at first): the table's next request drops its whole
    /// cache, whose rows may be stale in ways no key list says.
    all_stale: Arc<AtomicBool>,
    consumer: tokio::task::JoinHandle<()>,
    /// The cache's changes in flight and its key groups' write counts
    /// ([`order`]): a request first waits for the work on its keys
    /// ([`Tiers::settle`]), so it sees every fill a read answered before it
    /// began; writes and fills are ordered so that no fill lands after a
    /// write it raced.
    order: Arc<parking_lot::Mutex<Order>>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.consumer.abort();
    }
}

/// Reads the table's stream for as long as the table lives, retrying
/// every 200 ms while its node is down. A subscription that only succeeds
/// after a failed one starts from the stream's end then, and a stream
/// trimmed past what was read loses entries: either way other hosts'
/// writes may have been missed, and `all_stale` says so.
async fn consume(
    name: String,
    backing: Backing,
    invalid: Arc<parking_lot::Mutex<Vec<u64>>>,
    all_stale: Arc<AtomicBool>,
) {
    let (mut inv, mut failed) = (None, false);
    loop {
        if inv.is_none() {
            inv = backing.subscribe().await.ok();
            if inv.is_some() && failed {
                tracing::warn!(table = %name, "the table's stream was read again only after a failure: other hosts' writes meanwhile are unknown, so its cache is dropped");
                all_stale.store(true, Relaxed);
            }
            failed = inv.is_none();
        }
        let Some(i) = inv.as_mut() else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        match i.next().await {
            Ok(batches) => batches.into_iter().for_each(|b| invalid.lock().extend(b.keys)),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
        match i.take_gap() {
            Some(Gap::Trimmed) => {
                tracing::warn!(table = %name, "the table's stream was trimmed past entries this host had not read (it fell behind by more than the stream's length): their keys are unknown, so its cache is dropped");
                all_stale.store(true, Relaxed);
            }
            Some(Gap::Reset) => {
                tracing::warn!(table = %name, "another host published a reset on the table's stream (the entries of its writes that waited for the stream's node outgrew their bound): the keys it wrote are unknown, so this host's cache is dropped");
                all_stale.store(true, Relaxed);
            }
            Some(Gap::WentBack) => {
                tracing::warn!(table = %name, "the table's stream holds fewer entries than this host read (it was deleted, or a failover promoted a replica that had not received them): other hosts' writes may be unknown, so its cache is dropped");
                all_stale.store(true, Relaxed);
            }
            None => {}
        }
    }
}

/// What [`Tiers::flush_all`] could not drain.
#[derive(Debug)]
pub struct DrainFailed {
    /// Each table's error, `; `-separated.
    pub message: String,
    /// Every table's rows failed only their `WAIT`: the masters hold
    /// them, fewer of their replicas than asked.
    pub replicas_only: bool,
}

/// Drops each seed's empty password: `redis://:@HOST:PORT` becomes
/// `redis://HOST:PORT` and `redis://USER:@HOST:PORT` `redis://USER@HOST:PORT`
/// (the client sends no password for either). A tester's table created
/// with `redis://:@…` was listed as `redis://:***@…`, its checkpoint kept
/// the `***`, and the restart that restored it then asked for a password
/// that no line of the passwords file could give: hkvd did not start.
pub fn drop_empty_passwords(spec: &mut TableSpec) {
    if let Some(b) = spec.backing.as_mut() {
        for seed in &mut b.seeds {
            *seed = without_empty_password(seed);
        }
    }
}

/// One seed of [`drop_empty_passwords`].
fn without_empty_password(seed: &str) -> String {
    let (Some(a), Some(at)) = (seed.find("://"), seed.rfind('@')) else { return seed.to_string() };
    if at < a + 3 {
        return seed.to_string();
    }
    let user = match seed[a + 3..at].split_once(':') {
        Some((user, "")) => user,
        None if at == a + 3 => "",
        _ => return seed.to_string(),
    };
    let at_user = if user.is_empty() { String::new() } else { format!("{user}@") };
    format!("{}{at_user}{}", &seed[..a + 3], &seed[at + 1..])
}

/// A backed table's stats: the cache's hits beside the tier's own.
#[derive(Debug, Clone)]
pub struct TableStats {
    /// Keys of reads the cache answered (hits).
    pub hits: u64,
    /// Keys of reads the cache missed, filled from the cluster (or from
    /// this host's write-back queue: `filled_queued` of them).
    pub filled: u64,
    /// Of `filled`, the keys this host's write-back queue answered.
    pub filled_queued: u64,
    /// Keys of reads the cache missed that the cluster has not either.
    pub absent: u64,
    /// Keys of reads the cache missed that the cluster did not answer
    /// within the deadline.
    pub late: u64,
    /// Keys of reads the cache missed whose node failed.
    pub unavailable: u64,
    /// The tier's counters (of every key read from the cluster: a
    /// prefetch also reads keys the cache then answers; use the counts
    /// above for reads).
    pub tier: hkv_backing::Stats,
}

impl Drop for Tiers {
    fn drop(&mut self) {
        // Dropped on the executor at exit: a runtime may not block there.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// What a table's stored rows are, as its cluster's meta hash keeps it:
/// `values`, or `OPTIMIZER over N values` (the optimizer's state after
/// the values), so that hosts whose rows mean different things never
/// share a table.
fn row_meaning(spec: &TableSpec) -> String {
    match spec.optimizer {
        None => "values".into(),
        Some(o) => format!("{o} over {} values", spec.dim),
    }
}

/// A tier's error as a wire error: the user's mistakes are `bad_request`,
/// the cluster's faults `backing_unavailable`, a full queue
/// `resource_exhausted`.
pub fn wire(e: hkv_backing::Error) -> ProtoError {
    let code = match e.code() {
        "resource_exhausted" => ErrorCode::ResourceExhausted,
        "backing_unavailable" => ErrorCode::BackingUnavailable,
        _ => ErrorCode::BadRequest,
    };
    ProtoError::new(code, e.to_string())
}

impl Tiers {
    fn rt(&self) -> Result<&tokio::runtime::Runtime, ProtoError> {
        if let Some(rt) = self.rt.get() {
            return Ok(rt);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            // Three: each node's connection parses its answers on its own
            // task, and a cold read's three answers (about 1.6 ms of
            // parsing per 8192 rows on this crate's parser) are parsed side
            // by side instead of one after the other, none waiting for a
            // thread busy with another's decode: on the 2-core machine, a
            // 3-master cluster's cold reads ran ~4 % faster with three than
            // with two, ten runs each (`backing/BENCHMARKS.md`).
            .worker_threads(3)
            .thread_name("hkvd-backing")
            .enable_all()
            .build()
            .map_err(|e| ProtoError::new(ErrorCode::Internal, format!("starting the backing tier's runtime: {e}")))?;
        Ok(self.rt.get_or_init(|| rt))
    }

    /// Runs `f` on the tiers' runtime and waits for it.
    async fn on_rt<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, ProtoError> {
        self.rt()?
            .spawn(f)
            .await
            .map_err(|e| ProtoError::new(ErrorCode::Internal, format!("the backing tier's task failed: {e}")))
    }

    /// HOOK(backing) of create-table: opens the tier of a spec that names
    /// one (nothing for one that does not). Refuses the table when the
    /// cluster cannot be opened, or when its seeds answer from more than
    /// one cluster.
    pub async fn open(&self, spec: &TableSpec) -> Result<(), ProtoError> {
        self.open_as(spec, false).await
    }

    /// [`Tiers::open`]; with `existing`, for a table that existed before
    /// (restored, or holding rows): a cluster without its meta hash is refused,
    /// never adopted ([`Options::existing`]).
    async fn open_as(&self, spec: &TableSpec, existing: bool) -> Result<(), ProtoError> {
        let Some(b) = &spec.backing else { return Ok(()) };
        // Rows in the cluster are whole stored rows: values and optimizer state.
        let (name, dim, mut o) = (spec.name.clone(), spec.row_dim(), backing_options(b));
        o.row = row_meaning(spec);
        o.existing = existing;
        // The options' ranges before this host's memory: a bound over the
        // range is `bad_request` whatever the host has.
        o.check(dim).map_err(wire)?;
        let queue_bound = if o.mode == Mode::WriteBack { o.queue_bytes } else { 0 };
        self.check_queue_bound(&spec.name, queue_bound)?;
        let backing = self.on_rt(async move { Backing::open(&name, dim, o).await }).await?.map_err(wire)?;
        let invalid = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let all_stale = Arc::new(AtomicBool::new(false));
        let consumer =
            self.rt()?.spawn(consume(spec.name.clone(), backing.clone(), invalid.clone(), all_stale.clone()));
        let entry = Entry {
            backing,
            queue_bound,
            hits: AtomicU64::new(0),
            filled: AtomicU64::new(0),
            filled_queued: AtomicU64::new(0),
            absent: AtomicU64::new(0),
            late: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            cold: AtomicBool::new(false),
            invalid,
            all_stale,
            consumer,
            order: Order::new(),
        };
        // One tier per name: a second create_table of a backed name must
        // not replace (and then close) the running table's.
        let mut tables = self.tables.write();
        if tables.contains_key(&spec.name) {
            drop(tables);
            entry.consumer.abort();
            return Err(ProtoError::new(
                ErrorCode::TableExists,
                format!("table {:?} exists; drop it first", spec.name),
            ));
        }
        tables.insert(spec.name.clone(), Arc::new(entry));
        Ok(())
    }

    /// Refuses a write-back queue bound that, with the other tables'
    /// bounds, passes half of the memory this process may use (the host's,
    /// a cgroup's or the address-space limit, the least): a queue holds
    /// rows while their cluster is down, and a bound past memory let an
    /// outage grow the daemon past it (a tester's 64 GiB bound on a
    /// machine with less was accepted).
    fn check_queue_bound(&self, table: &str, bound: u64) -> Result<(), ProtoError> {
        if bound == 0 {
            return Ok(());
        }
        let space = crate::memory::AddressSpace::of_process().limit().unwrap_or(u64::MAX);
        let limit = crate::budget::host_memory().min(space) / 2;
        let others: u64 =
            self.tables.read().iter().filter(|(n, _)| n.as_str() != table).map(|(_, e)| e.queue_bound).sum();
        if others.saturating_add(bound) <= limit {
            return Ok(());
        }
        Err(ProtoError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "table {table:?}: a write-back queue of up to {bound} bytes, beside the {others} bytes other tables' \
                 queues may hold, passes {limit} bytes, half of the memory this daemon may use; give a smaller \
                 queue_bytes (--backing-queue-bytes)"
            ),
        ))
    }

    /// HOOK(backing) of drop-table (after the table is gone; drop-table
    /// drained the queue before, [`Tiers::flush`]) and of a create that
    /// failed after `open`: drains what was queued since, then forgets the
    /// tier. Rows that still cannot reach the cluster are given up (never
    /// sent later, where they could land over a newer write of a table of
    /// the same name), logged at ERROR, and named in the error.
    pub async fn close(&self, name: &str) -> Result<(), ProtoError> {
        self.unwait(name);
        let Some(e) = self.tables.write().remove(name) else { return Ok(()) };
        let b = e.backing.clone();
        let drained = self.on_rt(async move { b.flush(DRAIN).await }).await?;
        if let Err(err) = drained {
            let rows = e.backing.discard();
            tracing::error!(table = %name, rows, error = %err, "the dropped table's queued rows could not reach the cluster and were given up");
            return Err(ProtoError::new(
                ErrorCode::BackingUnavailable,
                format!(
                    "table {name:?} was dropped, but {rows} row(s) written while it was being dropped could not \
                     reach the cluster and were given up ({err})"
                ),
            ));
        }
        Ok(())
    }

    /// Forgets that `name` waits for its cluster.
    fn unwait(&self, name: &str) {
        let mut w = self.waiting.lock();
        w.remove(name);
        self.any_waiting.store(!w.is_empty(), Relaxed);
    }

    /// The tier of `name`, if it is backed.
    pub fn get(&self, name: &str) -> Option<Backing> {
        self.tables.read().get(name).map(|e| e.backing.clone())
    }

    /// The tier of `name` for a request: as [`Tiers::get`], but a restored
    /// table whose cluster could not be opened refuses the request
    /// (`backing_unavailable`), trying the open again first when the last
    /// try is [`REOPEN_EVERY`] old: serving it as a plain cache would
    /// acknowledge writes its cluster never gets.
    pub async fn backed(&self, name: &str) -> Result<Option<Backing>, ProtoError> {
        if let Some(b) = self.get(name) {
            return Ok(Some(b));
        }
        if !self.any_waiting.load(Relaxed) {
            return Ok(None);
        }
        let due = match self.waiting.lock().get_mut(name) {
            None => return Ok(None),
            Some(w) if w.last.elapsed() >= REOPEN_EVERY => {
                w.last = std::time::Instant::now();
                Some((w.spec.clone(), w.existing))
            }
            Some(_) => None,
        };
        if let Some((spec, existing)) = due {
            match self.open_as(&spec, existing).await {
                Ok(()) => {
                    self.unwait(name);
                    // Its restored rows were never checked against the
                    // cluster: the cache starts again from the cluster.
                    self.mark_all_stale(name);
                    tracing::info!(table = name, "a restored table's cluster is open now; its restored cache is dropped, its rows read from the cluster again");
                    return Ok(self.get(name));
                }
                Err(e) => {
                    if let Some(w) = self.waiting.lock().get_mut(name) {
                        w.why = e.message;
                    }
                }
            }
        }
        let why = self.waiting.lock().get(name).map(|w| w.why.clone()).unwrap_or_default();
        Err(ProtoError::new(
            ErrorCode::BackingUnavailable,
            format!(
                "table {name:?} was restored but its cluster could not be opened ({why}); its requests are \
                 refused until it can be (tried again at most every {} s), so that nothing is acknowledged that \
                 the cluster never gets",
                REOPEN_EVERY.as_secs()
            ),
        ))
    }

    /// Marks `name`'s whole cache stale: its next request drops it.
    fn mark_all_stale(&self, name: &str) {
        if let Some(e) = self.tables.read().get(name) {
            e.all_stale.store(true, Relaxed);
        }
    }

    /// After a restore: the backed tables among `names` whose cluster is
    /// open have their restored rows checked against the cluster
    /// ([`reconcile`]); one whose check fails has its cache dropped at its
    /// next request instead. A restored row is older than the cluster's
    /// when another host wrote or erased it since the checkpoint, or when
    /// this host's write-back queue lost it (SIGKILL): served as it was,
    /// it would differ from every other host's for good.
    pub async fn reconcile_restored(&self, router: &Arc<Router>, names: &[String]) {
        for name in names {
            let Some(tier) = self.get(name) else { continue };
            let Ok(t) = router.table(name) else { continue };
            match reconcile(router, self, &tier, &t).await {
                Ok((checked, replaced, erased)) => tracing::info!(
                    table = %name,
                    checked,
                    replaced,
                    erased,
                    "restored rows checked against the cluster: rows it holds in another version were replaced by its, rows it does not have erased"
                ),
                Err(e) => {
                    tracing::warn!(table = %name, error = %e.message, "restored rows could not be checked against the cluster: the table's cache is dropped at its next request");
                    self.mark_all_stale(name);
                }
            }
        }
    }

    /// Whether the table's whole cache must go ([`Entry::all_stale`],
    /// cleared by this), then the keys other hosts wrote since the table's
    /// last request and the keys whose queued find_or_insert row the
    /// cluster refused (write-back: it had another host's row, which the
    /// cache must not hide).
    fn take_invalid(&self, name: &str) -> (bool, Vec<u64>) {
        let Some(e) = self.tables.read().get(name).cloned() else { return (false, Vec::new()) };
        let mut keys = std::mem::take(&mut *e.invalid.lock());
        keys.extend(e.backing.take_conflicts());
        (e.all_stale.swap(false, Relaxed), keys)
    }

    /// Waits until the work on the cache registered before now (inserts
    /// of fills, writes) is done, where it touches any
    /// of `keys` (all of it for `None`: a request without keys).
    async fn settle(&self, name: &str, keys: Option<&[u64]>) {
        let Some(entry) = self.tables.read().get(name).cloned() else { return };
        let waits = entry.order.lock().waits(keys);
        order::wait_all(waits).await;
    }

    /// A write of `keys` (`None`: every key) begins ([`order`]): counted
    /// in its keys' groups, so that fills racing it drop those keys, and
    /// started once the earlier work on its keys is done. Hold the answer
    /// until both the cluster and the cache are updated. `None` for a
    /// table whose tier is gone.
    async fn begin_write(&self, name: &str, keys: Option<&[u64]>) -> Option<Hold> {
        let entry = self.tables.read().get(name).cloned()?;
        let (hold, waits) = Order::register(&entry.order, keys.map(<[u64]>::to_vec), true);
        order::wait_all(waits).await;
        Some(hold)
    }

    /// A fill's note of `keys`' groups before its fetch ([`order`]).
    fn snapshot(&self, name: &str, keys: &[u64]) -> Option<(Arc<parking_lot::Mutex<Order>>, Snapshot)> {
        let entry = self.tables.read().get(name).cloned()?;
        let snap = entry.order.lock().snapshot(keys);
        Some((entry.order.clone(), snap))
    }

    /// Counts a read's `hits` of `n` keys; a read that missed more than
    /// 15 of 16 keys makes the table's next find prefetch.
    fn count_hits(&self, name: &str, hits: usize, n: usize) {
        if let Some(e) = self.tables.read().get(name) {
            e.hits.fetch_add(hits as u64, Relaxed);
            e.cold.store(hits * 16 < n, Relaxed);
        }
    }

    /// Counts what the cluster said of a read's misses (`out`: the
    /// misses' part only, never the keys a prefetch read that the cache
    /// answered).
    fn count_misses(&self, name: &str, out: &ReadOut) {
        if let Some(e) = self.tables.read().get(name) {
            // The last count: rows the queue answered, which have no
            // version yet (the cluster's rows all have one).
            let mut n = [0u64; 5];
            for (f, &v) in out.fetched.iter().zip(&out.versions) {
                n[match f {
                    Fetched::Found => 0,
                    Fetched::Absent => 1,
                    Fetched::Late => 2,
                    Fetched::Unavailable => 3,
                }] += 1;
                n[4] += u64::from(*f == Fetched::Found && v == 0);
            }
            for (c, n) in [&e.filled, &e.absent, &e.late, &e.unavailable, &e.filled_queued].into_iter().zip(n) {
                if n > 0 {
                    c.fetch_add(n, Relaxed);
                }
            }
        }
    }

    /// On a table whose last read was cold: a fetch of all `keys`,
    /// noted ([`order`]) and begun now, beside the cache's find. Begun
    /// after the request's invalidations were taken, so its rows are no
    /// older than a fetch after the find would read.
    fn prefetch(&self, name: &str, tier: &Backing, keys: &[u64], since: Instant) -> Option<Prefetch> {
        let entry = self.tables.read().get(name).cloned()?;
        if !entry.cold.load(Relaxed) {
            return None;
        }
        let snap = entry.order.lock().snapshot(keys);
        let (b, k) = (tier.clone(), keys.to_vec());
        let deadline = since + b.deadline();
        let out = self.rt().ok()?.spawn(async move { b.read_by(&k, deadline).await });
        Some(Prefetch { order: entry.order.clone(), snap, out })
    }

    /// The keys the cache missed (`found[i] == 0`), fetched from the
    /// cluster and the rows found inserted into the cache (under its
    /// admission rules), the cache's hits counted: the misses' indices and
    /// the answer per missed key. Keys not answered (a node down, the
    /// deadline, counted from `since`: the request's start, so that the
    /// cache's search and the wait for earlier fills count against it)
    /// fail the request by name: never a made-up row. With
    /// `late_ok` (a request that asked for per-key origins) keys not
    /// fetched by the deadline are left `Late` for the answer to say so;
    /// a failed node still fails the request.
    ///
    /// With `answer` (a find's values, `dim` per key) the rows found are
    /// written there; the returned `ReadOut`'s values are not kept (the
    /// insert takes the fetched rows, without a copy when every miss was
    /// filled).
    ///
    /// Without `held` the rows are inserted after the answer, on a task of
    /// their own (the answer does not wait for the cache's insert; the
    /// table's next request on those keys does, [`Tiers::settle`]), and
    /// only those no write raced ([`order`]: noted before the fetch,
    /// checked after it). With `held`, a write of `keys` the caller holds
    /// (find_or_insert, apply_gradients, which then write them), no other
    /// write of them runs: every row found is in the cache when this
    /// returns.
    #[allow(clippy::too_many_arguments)]
    async fn fill(
        &self,
        router: &Arc<Router>,
        t: &Arc<Table>,
        tier: &Backing,
        keys: &[u64],
        found: &[u8],
        late_ok: bool,
        held: Option<&Hold>,
        pre: Option<Prefetch>,
        answer: Option<&mut [f32]>,
        since: Instant,
    ) -> Result<(Vec<usize>, ReadOut), ProtoError> {
        let table = t.spec.name.as_str();
        let miss: Vec<usize> = (0..keys.len()).filter(|&i| found[i] == 0).collect();
        self.count_hits(table, keys.len() - miss.len(), keys.len());
        if miss.is_empty() {
            if let Some(p) = pre {
                p.out.abort();
            }
            return Ok((miss, ReadOut::default()));
        }
        let mk: Vec<u64> = miss.iter().map(|&i| keys[i]).collect();
        let (snap, mut out, mk) = match pre {
            // Fetched beside the find: the misses' part of it.
            Some(p) => {
                let all = p.out.await.map_err(|e| {
                    ProtoError::new(ErrorCode::Internal, format!("the backing tier's task failed: {e}"))
                })?;
                let all_missed = miss.len() == keys.len();
                let snap = if all_missed { p.snap } else { p.snap.select(&miss) };
                let out = if all_missed { all } else { select(&all, &miss, t.config.dim) };
                (Some((p.order, snap)), out, mk)
            }
            None => {
                // Noted before the fetch: a write of these keys that begins
                // from here on makes the fill drop them ([`order`]).
                let snap = if held.is_some() { None } else { self.snapshot(table, &mk) };
                let (b, deadline) = (tier.clone(), since + tier.deadline());
                let (out, mk) = self
                    .on_rt(async move {
                        let out = b.read_by(&mk, deadline).await;
                        (out, mk)
                    })
                    .await?;
                (snap, out, mk)
            }
        };
        // Counted before a late or failed key fails the request: the
        // stats show why it failed.
        self.count_misses(table, &out);
        unanswered(table, &out, late_ok)?;
        let d = t.config.dim;
        let mut filled: Vec<usize> = (0..miss.len()).filter(|&j| out.fetched[j] == Fetched::Found).collect();
        if let Some(v) = answer {
            for &j in &filled {
                let i = miss[j];
                v[i * d..(i + 1) * d].copy_from_slice(&out.values[j * d..(j + 1) * d]);
            }
        }
        // The answer has every fetched row; the cache only those no write
        // raced. A table whose tier is gone caches none.
        let hold = match (held, snap) {
            (Some(_), _) => None,
            (None, Some((order, snap))) => Some(Order::admit(&order, &mk, &snap, &mut filled)),
            (None, None) => return Ok((miss, out)),
        };
        if !filled.is_empty() {
            let scores =
                (t.config.policy == ScorePolicy::Custom).then(|| filled.iter().map(|&j| out.scores[j]).collect());
            let fill_keys: Vec<u64> = filled.iter().map(|&j| mk[j]).collect();
            // Every miss filled and kept (a cold read): the fetched rows
            // are the insert's, in order, with no copy.
            let fill_values = if filled.len() == miss.len() {
                std::mem::take(&mut out.values)
            } else {
                let mut v = Vec::with_capacity(filled.len() * d);
                filled.iter().for_each(|&j| v.extend_from_slice(&out.values[j * d..(j + 1) * d]));
                v
            };
            let insert = {
                let (router, t) = (router.clone(), t.clone());
                async move { router.write(&t, WriteOp::InsertOrAssign, fill_keys, fill_values, scores, false).await }
            };
            if held.is_some() {
                insert.await?;
            } else {
                let name = t.spec.name.clone();
                tokio::spawn(async move {
                    // A row the cache refuses (admission) is still in
                    // the answer and in the cluster.
                    if let Err(e) = insert.await {
                        tracing::debug!(table = %name, "caching filled rows: {}", e.message);
                    }
                    drop(hold);
                });
                return Ok((miss, out));
            }
        }
        drop(hold);
        Ok((miss, out))
    }

    /// Flushes a write-back table's queue and starts a walk of the table's
    /// rows in the cluster (erase_if, clear): the walk then sees every row
    /// written before it began.
    async fn walk(&self, tier: &Backing) -> Result<Scan, ProtoError> {
        let b = tier.clone();
        self.on_rt(async move { b.flush(DRAIN).await.map(|()| b.scan()) }).await?.map_err(wire)
    }

    /// The walk's next keys, `None` at its end.
    async fn walk_next(&self, tier: &Backing, scan: &mut Scan) -> Result<Option<Vec<u64>>, ProtoError> {
        let (b, mut s) = (tier.clone(), scan.clone());
        let (r, s) = self
            .on_rt(async move {
                let r = b.scan_next(&mut s, WALK_BATCH).await;
                (r, s)
            })
            .await?;
        *scan = s;
        r.map_err(wire)
    }

    /// Erases `keys` from the cluster now (erase_if, clear).
    async fn erase_now(&self, tier: &Backing, keys: Vec<u64>) -> Result<(), ProtoError> {
        let b = tier.clone();
        self.on_rt(async move { b.erase_now(&keys).await }).await?.map_err(wire)
    }

    /// Writes rows to the table's tier as its mode says; the tier's own
    /// error inside ([`refused_write`] tells a write that may have
    /// reached some nodes from one refused before anything was sent).
    async fn write(
        &self,
        tier: &Backing,
        keys: Vec<u64>,
        values: Vec<f32>,
        scores: Vec<u64>,
    ) -> Result<Result<(), hkv_backing::Error>, ProtoError> {
        if keys.is_empty() {
            return Ok(Ok(()));
        }
        let b = tier.clone();
        self.on_rt(async move { b.write(&keys, &values, &scores).await }).await
    }

    /// find_or_insert's new rows, written to the cluster where it has none
    /// ([`Backing::insert_absent`]): per key, the cluster's row where it
    /// had one (write-through; write-back answers every key absent).
    async fn insert_absent(
        &self,
        tier: &Backing,
        keys: Vec<u64>,
        values: Vec<f32>,
        scores: Vec<u64>,
    ) -> Result<ReadOut, ProtoError> {
        if keys.is_empty() {
            return Ok(ReadOut::default());
        }
        let b = tier.clone();
        self.on_rt(async move { b.insert_absent(&keys, &values, &scores).await }).await?.map_err(wire)
    }

    /// `hkvctl flush TABLE`: waits until the table's write-back queue is empty.
    pub async fn flush(&self, name: &str, timeout: Duration) -> Result<(), ProtoError> {
        let Some(b) = self.backed(name).await? else { return Ok(()) };
        self.on_rt(async move { b.flush(timeout).await }).await?.map_err(wire)
    }

    /// Drains `name`'s queue before drop-table: as [`Tiers::flush`], but a
    /// table still waiting for its cluster (which has queued nothing)
    /// passes without trying it.
    pub async fn drain_before_drop(&self, name: &str) -> Result<(), ProtoError> {
        let Some(b) = self.get(name) else { return Ok(()) };
        self.on_rt(async move { b.flush(DRAIN).await }).await?.map_err(wire)
    }

    /// At start and after a restore: opens the tier of every table whose
    /// spec names a cluster and has none open (a restored table comes back
    /// with the backing it was checkpointed with, a table of the config
    /// file with the one it declares). Returns the tables whose cluster
    /// could not be opened, with why: their requests are refused
    /// ([`Tiers::backed`]) until a later try opens it.
    ///
    /// A table of `restored`, or one that holds rows here, existed before
    /// (a table of the config file starts empty), so its cluster must
    /// hold its meta hash: one that does not is refused, never
    /// adopted ([`Options::existing`]). A tester's restored table, whose
    /// seeds named nodes of two clusters, was opened on the other one
    /// while its own was stopped for 3 s: the restore's check erased all
    /// its rows from the cache, and new writes went to the wrong cluster.
    pub async fn sync(&self, router: &Router, restored: &[String]) -> Vec<(String, String)> {
        let mut failed = Vec::new();
        for t in router.tables() {
            if t.spec.backing.is_some() && self.get(&t.spec.name).is_none() {
                // A restored table was created on its cluster before, rows
                // or none (a tester's restored empty table adopted another
                // cluster). Otherwise rows say so; unknown counts as rows:
                // refusing a wrong cluster costs a wait, adopting one
                // costs the rows.
                let existing = restored.contains(&t.spec.name)
                    || router.sizes(&t).await.map_or(true, |s| s.iter().any(|s| s.0 > 0));
                if let Err(e) = self.open_as(&t.spec, existing).await {
                    let mut w = self.waiting.lock();
                    let waiting = Waiting {
                        spec: t.spec.clone(),
                        last: std::time::Instant::now(),
                        why: e.message.clone(),
                        existing,
                    };
                    w.insert(t.spec.name.clone(), waiting);
                    self.any_waiting.store(true, Relaxed);
                    failed.push((t.spec.name.clone(), e.message));
                }
            }
        }
        failed
    }

    /// Logs [`Tiers::sync`]'s failures.
    pub fn log_unopened(failed: &[(String, String)]) {
        for (name, why) in failed {
            tracing::error!(
                table = %name,
                "a restored table's cluster could not be opened ({why}); its requests are refused \
                 (backing_unavailable) until a later request opens it"
            );
        }
    }

    /// SIGTERM: drains every table's queue; the error names the tables
    /// whose rows did not all reach the cluster.
    pub async fn flush_all(&self, timeout: Duration) -> Result<(), DrainFailed> {
        let all: Vec<(String, Backing)> =
            self.tables.read().iter().map(|(n, e)| (n.clone(), e.backing.clone())).collect();
        // All at once: one deadline for every table, not one each.
        let drains = all
            .into_iter()
            .map(|(name, b)| async move { (name, self.on_rt(async move { b.flush(timeout).await }).await) });
        let (mut failed, mut replicas_only) = (Vec::new(), true);
        for (name, drained) in futures::future::join_all(drains).await {
            match drained {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    replicas_only &= matches!(e, hkv_backing::Error::FlushTimeout { replicas_only: true, .. });
                    failed.push(format!("{name}: {e}"));
                }
                Err(e) => {
                    replicas_only = false;
                    failed.push(format!("{name}: {}", e.message));
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(DrainFailed { message: failed.join("; "), replicas_only })
        }
    }

    /// Each backed table's stats.
    pub fn stats(&self) -> Vec<(String, TableStats)> {
        let mut v: Vec<_> = self
            .tables
            .read()
            .iter()
            .map(|(n, e)| {
                let s = TableStats {
                    hits: e.hits.load(Relaxed),
                    filled: e.filled.load(Relaxed),
                    filled_queued: e.filled_queued.load(Relaxed),
                    absent: e.absent.load(Relaxed),
                    late: e.late.load(Relaxed),
                    unavailable: e.unavailable.load(Relaxed),
                    tier: e.backing.stats(),
                };
                (n.clone(), s)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// HOOK(backing) of every table request on a backed table: reads fill
/// their misses from the cluster in the same request, writes reach the
/// cluster as the table's mode says, the rest runs as on any table. The
/// socket's requests come here; region requests call [`find`],
/// [`contains`] and [`write`] themselves. With `origins` (the request's
/// OUTCOMES flag) a find's or contains' answer carries each key's origin.
pub async fn execute(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: Backing,
    req: Request,
    origins: bool,
) -> Result<Response, ProtoError> {
    match req {
        Request::Find { table, keys, scores } => {
            let t = router.table(&table)?;
            find_response(router, tiers, &tier, &t, keys, scores, origins).await
        }
        Request::Contains { table, keys } => {
            let t = router.table(&table)?;
            let (found, o) = contains_with_origins(router, tiers, &tier, &t, keys, origins).await?;
            Ok(with_origins(Response::Contains { found }, o))
        }
        Request::Write { op, table, keys, values, scores, outcomes } => {
            let t = router.table(&table)?;
            write(router, tiers, &tier, &t, op, keys, values, scores, outcomes).await.map(Into::into)
        }
        Request::ApplyGradients { table, hyper, keys, grads, outcomes } => {
            let t = router.table(&table)?;
            apply_gradients(router, tiers, &tier, &t, hyper, keys, grads, outcomes).await.map(Into::into)
        }
        Request::Erase { table, keys, outcomes } => {
            let t = router.table(&table)?;
            let (count, flags) = erase(router, tiers, &tier, &t, keys, outcomes).await?;
            Ok(Response::Erased { count, flags })
        }
        Request::EraseIf { table, filter } => {
            let t = router.table(&table)?;
            let count = erase_if(router, tiers, &tier, &t, filter).await?;
            Ok(Response::Erased { count, flags: None })
        }
        Request::Clear { table } => {
            let t = router.table(&table)?;
            clear(router, tiers, &tier, &t).await?;
            Ok(Response::Empty)
        }
        other => {
            if let Some(table) = other.table() {
                invalidate(router, tiers, &*router.table(table)?, None).await?;
            }
            router.execute(other).await
        }
    }
}

/// Erases the rows other hosts wrote since the last request (the table's
/// stream), so that this request reads them from the cluster again.
///
/// Rows that earlier reads filled are put in the cache after their answers:
/// every request first waits for those
/// of its `keys` (all of them for `None`) and of the stale keys, so that
/// it sees them (a key an answered read filled is a hit, not a second
/// fetch) and no such insert lands after a write or an erase.
async fn invalidate(router: &Router, tiers: &Tiers, t: &Table, keys: Option<&[u64]>) -> Result<(), ProtoError> {
    tiers.settle(&t.spec.name, keys).await;
    let (all_stale, mut stale) = tiers.take_invalid(&t.spec.name);
    if all_stale {
        // Every row the cache holds is also in the cluster or the write-back
        // queue (reads see the queue): dropping them all loses nothing but
        // a read-only table's own writes, which live in its cache only.
        let _held = tiers.begin_write(&t.spec.name, None).await;
        router.execute(Request::Clear { table: t.spec.name.clone() }).await?;
    }
    if !stale.is_empty() {
        stale.sort_unstable();
        stale.dedup();
        // Another host's write: its erase here is a write of this order,
        // so that a fill that fetched the old rows does not keep them.
        let _held = tiers.begin_write(&t.spec.name, Some(&stale)).await;
        router.erase(t, stale, false).await?;
    }
    Ok(())
}

/// A fetch of a find's keys begun beside the cache's find
/// ([`Tiers::prefetch`]): the note of the keys' groups taken before it,
/// and its task.
struct Prefetch {
    order: Arc<parking_lot::Mutex<Order>>,
    snap: Snapshot,
    out: tokio::task::JoinHandle<ReadOut>,
}

/// The part of a read's answer for the keys at `idx`.
fn select(all: &ReadOut, idx: &[usize], dim: usize) -> ReadOut {
    let mut values = Vec::with_capacity(idx.len() * dim);
    idx.iter().for_each(|&i| values.extend_from_slice(&all.values[i * dim..(i + 1) * dim]));
    ReadOut {
        fetched: idx.iter().map(|&i| all.fetched[i]).collect(),
        values,
        scores: idx.iter().map(|&i| all.scores[i]).collect(),
        versions: idx.iter().map(|&i| all.versions[i]).collect(),
        errors: all.errors.clone(),
    }
}

/// A read whose keys were not all answered fails the request by name:
/// the first failed node (`backing_unavailable`), else `timeout`. With
/// `late_ok` (origins asked for) late keys are left for the answer to say.
fn unanswered(table: &str, out: &ReadOut, late_ok: bool) -> Result<(), ProtoError> {
    let n = if late_ok { out.fetched.iter().filter(|f| **f == Fetched::Unavailable).count() } else { out.unanswered() };
    if n == 0 {
        return Ok(());
    }
    Err(match out.errors.first() {
        Some(e) => wire(e.clone()),
        None => ProtoError::new(
            ErrorCode::Timeout,
            format!(
                "{} keys of table {table:?} were not fetched from its cluster within the deadline",
                out.unanswered()
            ),
        ),
    })
}

/// An answer with its origins array, when asked for.
pub fn with_origins(answer: Response, origins: Option<Vec<u8>>) -> Response {
    match origins {
        Some(origins) => Response::Origins { answer: Box::new(answer), origins },
        None => answer,
    }
}

/// Each key's origin code (`hkv_proto::origin`): the cache's hits, then
/// what the cluster said of each miss.
fn origin_codes(found: &[u8], miss: &[usize], rows: &ReadOut) -> Vec<u8> {
    use hkv_proto::origin;
    let mut o: Vec<u8> = found.iter().map(|&f| if f == 1 { origin::HIT } else { origin::ABSENT }).collect();
    for (j, &i) in miss.iter().enumerate() {
        o[i] = match rows.fetched[j] {
            Fetched::Found => origin::FILLED,
            Fetched::Absent => origin::ABSENT,
            Fetched::Late | Fetched::Unavailable => origin::LATE,
        };
    }
    o
}

/// Marks found the misses (`miss`: their indices among the request's
/// keys) that the cluster answered in `rows`, calling `each(j, i)` for
/// each: its place among the misses and among the keys.
fn mark_filled(found: &mut [u8], miss: &[usize], rows: &ReadOut, mut each: impl FnMut(usize, usize)) {
    for (j, &i) in miss.iter().enumerate() {
        if rows.fetched[j] == Fetched::Found {
            found[i] = 1;
            each(j, i);
        }
    }
}

/// find on a backed table: hits refresh their scores, misses are read
/// from the cluster, inserted and returned, in the same request.
pub async fn find(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
    scores: bool,
) -> Result<FindAnswer, ProtoError> {
    Ok(find_with_origins(router, tiers, tier, t, keys, scores, false).await?.0)
}

/// A backed table's find as the socket answers it. Without scores or
/// origins the cache writes its hits straight into the response frame and
/// the rows filled from the cluster are written beside them, as a table
/// without a cluster answers (no answer arrays, no copy of the rows on the
/// way out); else [`find_with_origins`].
pub async fn find_response(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
    scores: bool,
    origins: bool,
) -> Result<Response, ProtoError> {
    let frame = if scores || origins { None } else { router.answer_frame(keys.len(), t.config.dim) };
    let Some(frame) = frame else {
        let (a, o) = find_with_origins(router, tiers, tier, t, keys, scores, origins).await?;
        return Ok(with_origins(a.into(), o));
    };
    Ok(find_to(router, tiers, tier, t, keys, frame).await?.0.into_response())
}

/// A backed table's find written in place into `dest` (a response frame,
/// a client's region): the cache writes its hits there, and the rows
/// filled from the cluster are written beside them (no answer arrays, no
/// copy of the rows on the way out). Answers `dest` and the keys found.
pub async fn find_to<D: Destination>(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
    dest: D,
) -> Result<(D, u64), ProtoError> {
    let since = Instant::now();
    invalidate(router, tiers, t, Some(&keys)).await?;
    let pre = tiers.prefetch(&t.spec.name, tier, &keys, since);
    let (mut dest, _) = router.find_to(t, keys.clone(), dest).await?;
    let (found, rows) = dest.answer();
    let values = rows.into_values();
    let hits = found.to_vec();
    let (miss, rows) = tiers.fill(router, t, tier, &keys, &hits, false, None, pre, Some(values), since).await?;
    mark_filled(found, &miss, &rows, |_, _| {});
    let count = found.iter().filter(|&&f| f == 1).count() as u64;
    Ok((dest, count))
}

/// [`find`], and with `origins` each key's origin (keys not fetched by the
/// deadline are then answered as not found, origin `LATE`, instead of
/// failing the request).
pub async fn find_with_origins(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
    scores: bool,
    origins: bool,
) -> Result<(FindAnswer, Option<Vec<u8>>), ProtoError> {
    let since = Instant::now();
    invalidate(router, tiers, t, Some(&keys)).await?;
    // Scores when asked: the misses' are written into them too.
    let FindAnswer { mut found, mut values, scores: got } = router.find_rows(t, keys.clone(), scores).await?;
    let mut got = got.unwrap_or_default();
    let (miss, rows) =
        tiers.fill(router, t, tier, &keys, &found, origins, None, None, Some(&mut values), since).await?;
    let codes = origins.then(|| origin_codes(&found, &miss, &rows));
    mark_filled(&mut found, &miss, &rows, |j, i| {
        if let Some(s) = got.get_mut(i) {
            *s = rows.scores[j];
        }
    });
    Ok((FindAnswer { found, values, scores: scores.then_some(got) }, codes))
}

/// contains on a backed table: a key the cluster has is present (and now cached).
pub async fn contains(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
) -> Result<Vec<u8>, ProtoError> {
    Ok(contains_with_origins(router, tiers, tier, t, keys, false).await?.0)
}

/// [`contains`], and with `origins` each key's origin (as
/// [`find_with_origins`]).
pub async fn contains_with_origins(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
    origins: bool,
) -> Result<(Vec<u8>, Option<Vec<u8>>), ProtoError> {
    let since = Instant::now();
    invalidate(router, tiers, t, Some(&keys)).await?;
    let mut found = router.contains(t, keys.clone()).await?;
    let (miss, rows) = tiers.fill(router, t, tier, &keys, &found, origins, None, None, None, since).await?;
    let codes = origins.then(|| origin_codes(&found, &miss, &rows));
    mark_filled(&mut found, &miss, &rows, |_, _| {});
    Ok((found, codes))
}

/// A write on a backed table: find_or_insert reads through on every
/// backed table, and unless the table is read-only writes its new rows
/// set-if-absent (a row another host wrote first wins, and is answered and
/// cached under write-through); other writes reach the cluster unless the
/// table is read-only.
#[allow(clippy::too_many_arguments)]
pub async fn write(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    op: WriteOp,
    keys: Vec<u64>,
    mut values: Vec<f32>,
    mut scores: Option<Vec<u64>>,
    outcomes: bool,
) -> Result<WriteAnswer, ProtoError> {
    // The cache's own checks, first: the arrays are read below (and sent
    // to the cluster) before the cache sees them.
    router.check_write(t, op, &keys, values.len(), scores.as_deref(), outcomes)?;
    invalidate(router, tiers, t, Some(&keys)).await?;
    // Held until the cluster and the cache have the rows ([`order`]).
    let held = tiers.begin_write(&t.spec.name, Some(&keys)).await;
    if op != WriteOp::FindOrInsert && tier.mode() == Mode::ReadOnly {
        return router.write(t, op, keys, values, scores, outcomes).await;
    }
    let tier = tier.clone();
    match op {
        WriteOp::FindOrInsert => {
            // Rows the cluster has win over the request's initial
            // values: fill the misses first, then insert the rest
            // in the cluster where it still has none (another host may
            // insert the same keys meanwhile), and here: the request's
            // rows, or the cluster's where another host's won.
            let d = t.config.dim;
            let now = rows_now(router, tiers, &tier, t, &keys, held.as_ref(), true).await?;
            // The row a key has now (the cache's, else the cluster's) is its
            // initial row too: the cache may not keep it through the batch
            // (admission, or a batch larger than the cache evicting its own
            // keys), and its find_or_insert then inserts or answers this.
            let custom = t.config.policy == ScorePolicy::Custom;
            for i in (0..keys.len()).filter(|&i| now.exists[i]) {
                values[i * d..(i + 1) * d].copy_from_slice(&now.rows[i * d..(i + 1) * d]);
            }
            for (j, &i) in now.miss.iter().enumerate() {
                if let (Some(s), true) = (scores.as_mut().filter(|_| custom), now.read.fetched[j] == Fetched::Found) {
                    s[i] = now.read.scores[j];
                }
            }
            let new: Vec<usize> = now
                .miss
                .iter()
                .zip(&now.read.fetched)
                .filter(|(_, f)| **f == Fetched::Absent)
                .map(|(&i, _)| i)
                .collect();
            let nk: Vec<u64> = new.iter().map(|&i| keys[i]).collect();
            let nv: Vec<f32> = new.iter().flat_map(|&i| values[i * d..(i + 1) * d].iter().copied()).collect();
            let ns: Vec<u64> = scores.as_ref().map(|s| new.iter().map(|&i| s[i]).collect()).unwrap_or_default();
            if tier.mode() != Mode::ReadOnly {
                let theirs = tiers.insert_absent(&tier, nk, nv, ns).await?;
                for (j, &i) in new.iter().enumerate() {
                    if theirs.fetched[j] != Fetched::Found {
                        continue;
                    }
                    values[i * d..(i + 1) * d].copy_from_slice(&theirs.values[j * d..(j + 1) * d]);
                    if let Some(s) = scores.as_mut().filter(|_| custom) {
                        s[i] = theirs.scores[j];
                    }
                }
            }
            router.write(t, op, keys, values, scores, outcomes).await
        }
        WriteOp::AccumOrAssign => {
            // Read, add, write: each key's row now is the cache's, else
            // the cluster's (a row only the cluster has counts as
            // present); the request's deltas add to it in order (a key
            // given twice adds both), an absent key takes its delta as its
            // row. The rows go to the cluster first, then into the cache,
            // so a row the cache cannot keep (admission, or a batch larger
            // than the cache) is still in the cluster with its deltas.
            let n = keys.len();
            let d = t.config.dim;
            let RowsNow { rows: base, exists, .. } =
                rows_now(router, tiers, &tier, t, &keys, held.as_ref(), true).await?;
            let (mut uk, mut urows, mut uscores) = (Vec::new(), Vec::new(), Vec::new());
            let mut at: HashMap<u64, usize> = HashMap::with_capacity(n);
            let mut first = vec![false; n];
            for i in 0..n {
                let delta = &values[i * d..(i + 1) * d];
                match at.get(&keys[i]) {
                    Some(&u) => {
                        urows[u * d..(u + 1) * d].iter_mut().zip(delta).for_each(|(r, x)| *r += x);
                        if let Some(s) = &scores {
                            uscores[u] = s[i];
                        }
                    }
                    None => {
                        at.insert(keys[i], uk.len());
                        first[i] = true;
                        uk.push(keys[i]);
                        if exists[i] {
                            urows.extend(base[i * d..(i + 1) * d].iter().zip(delta).map(|(r, x)| r + x));
                        } else {
                            urows.extend_from_slice(delta);
                        }
                        uscores.push(scores.as_ref().map_or(0, |s| s[i]));
                    }
                }
            }
            let sent = tiers
                .write(&tier, uk.clone(), urows.clone(), if scores.is_some() { uscores.clone() } else { Vec::new() })
                .await;
            refused_write(router, t, &keys, sent).await?;
            let w =
                router.write(t, WriteOp::InsertOrAssign, uk, urows, scores.is_some().then_some(uscores), true).await?;
            let placed = w.outcomes.unwrap_or_default();
            // Per request key: present before (here or in the cluster), or
            // a repeat of a key, is updated; else what the cache did.
            let mut summary = hkv_shard::Summary::default();
            let per: Vec<u8> = (0..n)
                .map(|i| {
                    let o = if exists[i] || !first[i] {
                        Outcome::Updated
                    } else {
                        placed.get(at[&keys[i]]).copied().and_then(Outcome::from_u8).unwrap_or(Outcome::Inserted)
                    };
                    summary.add(o);
                    o as u8
                })
                .collect();
            let summary = crate::router::to_wire(summary);
            Ok(WriteAnswer { summary, outcomes: outcomes.then_some(per), values: None, evicted: None })
        }
        WriteOp::Assign => {
            // Assign changes rows that exist: on a backed table, those the
            // cluster has count too (read into the cache first); a key in
            // neither is absent, and nothing of it is written anywhere.
            let exist = rows_now(router, tiers, &tier, t, &keys, held.as_ref(), false).await?.exists;
            let d = t.config.dim;
            let have: Vec<usize> = (0..keys.len()).filter(|&i| exist[i]).collect();
            let sent = tiers
                .write(
                    &tier,
                    have.iter().map(|&i| keys[i]).collect(),
                    have.iter().flat_map(|&i| values[i * d..(i + 1) * d].iter().copied()).collect(),
                    scores.as_ref().map(|s| have.iter().map(|&i| s[i]).collect()).unwrap_or_default(),
                )
                .await;
            refused_write(router, t, &keys, sent).await?;
            let mut r = router.write(t, op, keys, values, scores, true).await?;
            // A row the cluster has that the cache did not keep was
            // assigned there: updated, not absent.
            let mut out = r.outcomes.take().unwrap_or_default();
            for (o, &e) in out.iter_mut().zip(&exist) {
                if e && *o == Outcome::Absent as u8 {
                    *o = Outcome::Updated as u8;
                    r.summary.absent -= 1;
                    r.summary.updated += 1;
                }
            }
            r.outcomes = outcomes.then_some(out);
            Ok(r)
        }
        _ => {
            // The cluster first: a write it refuses is not applied
            // here either (write-through), or waits in the queue
            // (write-back). Every row the cache holds is then also
            // in the cluster or the queue, so what the cache evicts
            // is never lost.
            let sent = tiers.write(&tier, keys.clone(), values.clone(), scores.clone().unwrap_or_default()).await;
            refused_write(router, t, &keys, sent).await?;
            router.write(t, op, keys, values, scores, outcomes).await
        }
    }
}

/// What `keys` have now, for a write that builds on it: the cache's rows,
/// else the cluster's (the cache's misses read through and filled into it,
/// as a find would, waited for).
struct RowsNow {
    /// The cache's misses (indices into `keys`) and what the cluster said of them.
    miss: Vec<usize>,
    read: ReadOut,
    /// `dim` per key, the row each has now (zeros for none); empty unless asked for.
    rows: Vec<f32>,
    /// Per key: the cache or the cluster has a row.
    exists: Vec<bool>,
    /// On a custom table, with the rows: the score each key's row has now
    /// (0 for none); else empty.
    scores: Vec<u64>,
}

async fn rows_now(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: &[u64],
    held: Option<&Hold>,
    want_rows: bool,
) -> Result<RowsNow, ProtoError> {
    let since = Instant::now();
    // A custom table's scores are the caller's: a write that builds on a
    // row keeps its score.
    let custom = want_rows && t.config.policy == ScorePolicy::Custom;
    let (found, mut rows, mut scores) = if want_rows {
        let a = router.find_rows(t, keys.to_vec(), custom).await?;
        (a.found, a.values, a.scores.unwrap_or_default())
    } else {
        (router.contains(t, keys.to_vec()).await?, Vec::new(), Vec::new())
    };
    let answer = if want_rows { Some(&mut rows[..]) } else { None };
    let (miss, read) = tiers.fill(router, t, tier, keys, &found, false, held, None, answer, since).await?;
    let mut exists: Vec<bool> = found.iter().map(|&f| f == 1).collect();
    for (j, &i) in miss.iter().enumerate() {
        let got = read.fetched[j] == Fetched::Found;
        exists[i] |= got;
        if let (true, Some(s)) = (got, scores.get_mut(i)) {
            *s = read.scores[j];
        }
    }
    Ok(RowsNow { miss, read, rows, exists, scores })
}

/// A write the cluster refused (`sent`: its answer) may still have
/// reached some of its nodes (a write spans nodes; there is no
/// transaction across them): the request's keys leave the cache, so that
/// it never serves a row that differs from the cluster's (a later read
/// fetches whichever row the cluster kept), and the error says so. A
/// write refused before anything was sent (a full write-back queue, a
/// replaced meta hash) changed nothing: its error goes back as it is.
async fn refused_write(
    router: &Arc<Router>,
    t: &Arc<Table>,
    keys: &[u64],
    sent: Result<Result<(), hkv_backing::Error>, ProtoError>,
) -> Result<(), ProtoError> {
    let e = match sent {
        Ok(Ok(())) => return Ok(()),
        Err(e) => return Err(e),
        Ok(Err(e)) if !e.may_have_landed() => return Err(wire(e)),
        Ok(Err(e)) => wire(e),
    };
    router.erase(t, keys.to_vec(), false).await?;
    Err(partly_applied(e, "the write", "its keys were dropped from this cache"))
}

/// `e` (a cluster's refusal) saying that `what` may have reached some of
/// the cluster's nodes and what this cache did about it (`done`).
fn partly_applied(mut e: ProtoError, what: &str, done: &str) -> ProtoError {
    e.message = format!(
        "{}; {what} may have reached some of the cluster's nodes: {done}, so that reads return whichever rows \
         the cluster kept",
        e.message
    );
    e
}

/// apply_gradients on a backed table. Each key's row now (the cache's,
/// else the cluster's, read through as a find would) is stepped here with
/// the shards' own arithmetic ([`hkv_shard::optim::Step::apply`], bit for
/// bit what either backend computes), a key given twice stepped twice in
/// request order. The stepped rows (values and optimizer state) go to the
/// cluster first, then the cache steps the rows it holds (the same rows,
/// so the same bits): a row the cache cannot hold is stepped all the same,
/// and one the cache evicts was never ahead of the cluster. A key in
/// neither is missing.
/// A read-only table never writes its cluster: the step is its cache's
/// alone, on the rows the cache holds once its misses are read through.
#[allow(clippy::too_many_arguments)]
pub async fn apply_gradients(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    hyper: hkv_proto::Hyper,
    keys: Vec<u64>,
    grads: Vec<f32>,
    outcomes: bool,
) -> Result<ApplyAnswer, ProtoError> {
    let (mut hyper, mut keys, mut grads) = (hyper, keys, grads);
    if hyper.sum {
        // Repeated keys' gradients summed here, once: the cluster's rows
        // and the cache's are then stepped from the same gradients.
        if outcomes {
            return Err(crate::router::summed_outcomes());
        }
        let d = t.spec.dim;
        if grads.len() == keys.len() * d {
            if let Some((k, g, _)) = hkv_shard::optim::sum_duplicates(&keys, &grads, d) {
                (keys, grads) = (k, g);
            }
        }
        hyper.sum = false;
    }
    invalidate(router, tiers, t, Some(&keys)).await?;
    if tier.mode() == Mode::ReadOnly {
        let held = tiers.begin_write(&t.spec.name, Some(&keys)).await;
        rows_now(router, tiers, tier, t, &keys, held.as_ref(), false).await?;
        return router.apply_gradients(t, hyper, keys, grads, outcomes).await;
    }
    let step = crate::router::step_of(t, hyper)?;
    let (n, d, w) = (keys.len(), step.dim, t.config.dim);
    // The checks the shards open with, before anything is read or written.
    hkv_shard::optim::check_batch(w, &step, n, grads.len(), n, None).map_err(shard_error)?;
    hkv_shard::check::keys(&keys).map_err(shard_error)?;
    if outcomes {
        router.bound("apply_gradients", n, d, 1 + 4 * d as u64, 64)?;
    }
    // Held until the cluster has the stepped rows ([`order`]).
    let held = tiers.begin_write(&t.spec.name, Some(&keys)).await;
    let RowsNow { rows, exists, scores, .. } = rows_now(router, tiers, tier, t, &keys, held.as_ref(), true).await?;
    let (mut uk, mut urows, mut uscores) = (Vec::new(), Vec::new(), Vec::new());
    let mut at: HashMap<u64, usize> = HashMap::with_capacity(n);
    let mut found = vec![0u8; n];
    let mut after = if outcomes { vec![0.0f32; n * d] } else { Vec::new() };
    for i in (0..n).filter(|&i| exists[i]) {
        let u = *at.entry(keys[i]).or_insert_with(|| {
            uk.push(keys[i]);
            urows.extend_from_slice(&rows[i * w..(i + 1) * w]);
            // A custom row keeps its score (a step does not change it).
            uscores.extend(scores.get(i));
            uk.len() - 1
        });
        let row = &mut urows[u * w..(u + 1) * w];
        step.apply(row, &grads[i * d..(i + 1) * d]);
        found[i] = 1;
        if outcomes {
            after[i * d..(i + 1) * d].copy_from_slice(&row[..d]);
        }
    }
    let missing = found.iter().filter(|&&f| f == 0).count() as u64;
    if !uk.is_empty() {
        let sent = tiers.write(tier, uk, urows, uscores).await;
        refused_write(router, t, &keys, sent).await?;
        // The cache steps the rows it holds itself, from the same rows to
        // the same bits, and scores them as any apply_gradients does (a
        // custom score stays, lfu counts no access); a row it no longer
        // holds is in the cluster, stepped.
        router.apply_gradients(t, hyper, keys, grads, false).await?;
    }
    Ok(ApplyAnswer { missing, found: outcomes.then_some(found), values: outcomes.then_some(after) })
}

/// erase on a backed table: the cluster first (write-through: deleted
/// there and announced to other hosts; write-back: queued), then the
/// cache, so that a read after it never fills the erased row back. A
/// read-only table erases from its cache only.
pub async fn erase(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    keys: Vec<u64>,
    outcomes: bool,
) -> Result<(u64, Option<Vec<u8>>), ProtoError> {
    hkv_shard::check::keys(&keys).map_err(shard_error)?;
    invalidate(router, tiers, t, Some(&keys)).await?;
    let _held = tiers.begin_write(&t.spec.name, Some(&keys)).await;
    if tier.mode() != Mode::ReadOnly && !keys.is_empty() {
        let (b, k) = (tier.clone(), keys.clone());
        let sent = tiers.on_rt(async move { b.erase(&k).await }).await;
        // Refused by some node: others may have erased their rows.
        refused_write(router, t, &keys, sent).await?;
    }
    router.erase(t, keys, outcomes).await
}

/// Checks every row `t`'s cache holds against the cluster (the table's
/// requests wait meanwhile): a row the cluster (or the write-back queue)
/// has otherwise replaces it, one the cluster does not have is erased.
/// Answers the rows checked, replaced and erased.
async fn reconcile(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
) -> Result<(u64, u64, u64), ProtoError> {
    let _held = tiers.begin_write(&t.spec.name, None).await;
    let d = t.config.dim;
    let (mut checked, mut replaced, mut erased) = (0u64, 0u64, 0u64);
    let mut cursor = Some(hkv_proto::Cursor::default());
    while let Some(c) = cursor {
        // Writes of present keys and erases move no entry: the cursor stays valid.
        let e = router.export(t, c, WALK_BATCH as u64, hkv_proto::Filter::default()).await?;
        cursor = e.next;
        if e.keys.is_empty() {
            continue;
        }
        checked += e.keys.len() as u64;
        let (b, k) = (tier.clone(), e.keys.clone());
        let out = tiers.on_rt(async move { b.read(&k).await }).await?;
        unanswered(&t.spec.name, &out, false)?;
        let (mut gone, mut newer, mut rows, mut scores) = (vec![], vec![], vec![], vec![]);
        for (i, &k) in e.keys.iter().enumerate() {
            match out.fetched[i] {
                Fetched::Found => {
                    let (have, want) = (&e.values[i * d..(i + 1) * d], &out.values[i * d..(i + 1) * d]);
                    if have.iter().zip(want).any(|(x, y)| x.to_bits() != y.to_bits()) {
                        newer.push(k);
                        rows.extend_from_slice(want);
                        scores.push(out.scores[i]);
                    }
                }
                _ => gone.push(k),
            }
        }
        if !newer.is_empty() {
            replaced += newer.len() as u64;
            let scores = (t.config.policy == ScorePolicy::Custom).then_some(scores);
            router.write(t, WriteOp::InsertOrAssign, newer, rows, scores, false).await?;
        }
        if !gone.is_empty() {
            erased += gone.len() as u64;
            router.erase(t, gone, false).await?;
        }
    }
    Ok((checked, replaced, erased))
}

/// Keys of a walk of the cluster handled at once (erase_if, clear).
const WALK_BATCH: usize = 4096;

/// erase_if on a backed table. Unless the table is read-only (a
/// write-back table's queue flushed first): the rows the cache holds that
/// match, by their scores in the cache, are erased from the cluster
/// (announced to other hosts, as an erase) and then from the cache; then
/// a walk of the cluster's rows erases those the cache does not hold that
/// match by the score they were written with. Answers the keys erased,
/// each once (the walk may see a key twice: the second time the cluster
/// no longer has it). A read-only table erases from its cache only (the
/// rows read through again).
pub async fn erase_if(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    filter: hkv_proto::Filter,
) -> Result<u64, ProtoError> {
    invalidate(router, tiers, t, None).await?;
    let _held = tiers.begin_write(&t.spec.name, None).await;
    if tier.mode() == Mode::ReadOnly {
        return match router.execute(Request::EraseIf { table: t.spec.name.clone(), filter }).await? {
            Response::Erased { count, .. } => Ok(count),
            _ => Ok(0),
        };
    }
    match erase_if_walk(router, tiers, tier, t, filter).await {
        Err(e) if e.code == ErrorCode::BackingUnavailable => {
            // Some nodes may have erased their matching rows: the cache's go too.
            router.execute(Request::EraseIf { table: t.spec.name.clone(), filter }).await?;
            Err(partly_applied(e, "the erase", "the matching rows were dropped from this cache"))
        }
        walked => walked,
    }
}

/// erase_if's erases in the cluster and the cache (the table held).
async fn erase_if_walk(
    router: &Arc<Router>,
    tiers: &Tiers,
    tier: &Backing,
    t: &Arc<Table>,
    filter: hkv_proto::Filter,
) -> Result<u64, ProtoError> {
    let mut scan = tiers.walk(tier).await?;
    let mut erased = 0u64;
    let mut cursor = Some(hkv_proto::Cursor::default());
    while let Some(c) = cursor {
        // Erasing frees slots and moves none: the export's cursor stays valid.
        let e = router.export(t, c, WALK_BATCH as u64, filter).await?;
        cursor = e.next;
        if !e.keys.is_empty() {
            erased += e.keys.len() as u64;
            tiers.erase_now(tier, e.keys.clone()).await?;
            router.erase(t, e.keys, false).await?;
        }
    }
    let scored = |s: u64| (filter.min_score..=filter.max_score).contains(&s);
    while let Some(mut keys) = tiers.walk_next(tier, &mut scan).await? {
        keys.retain(|&k| k & filter.key_mask == filter.key_pattern);
        if keys.is_empty() {
            continue;
        }
        let cached = router.contains(t, keys.clone()).await?;
        let ask: Vec<u64> = keys.iter().zip(&cached).filter(|(_, &c)| c == 0).map(|(&k, _)| k).collect();
        if ask.is_empty() {
            continue;
        }
        let (b, k) = (tier.clone(), ask.clone());
        let out = tiers.on_rt(async move { b.read(&k).await }).await?;
        unanswered(&t.spec.name, &out, false)?;
        let hit: Vec<u64> = ask
            .iter()
            .zip(&out.fetched)
            .zip(&out.scores)
            .filter_map(|((&k, f), &s)| (*f == Fetched::Found && scored(s)).then_some(k))
            .collect();
        if !hit.is_empty() {
            erased += hit.len() as u64;
            tiers.erase_now(tier, hit).await?;
        }
    }
    Ok(erased)
}

/// clear on a backed table. Unless the table is read-only, every row of
/// the table in the cluster is erased first (a write-back table's queue
/// flushed, then a walk of the cluster, each batch's keys announced to
/// other hosts, as an erase), then the cache; the table's meta hash stays,
/// so the table keeps its layout. A read-only table clears its cache only.
pub async fn clear(router: &Arc<Router>, tiers: &Tiers, tier: &Backing, t: &Arc<Table>) -> Result<(), ProtoError> {
    invalidate(router, tiers, t, None).await?;
    let _held = tiers.begin_write(&t.spec.name, None).await;
    if tier.mode() != Mode::ReadOnly {
        let walked = async {
            let mut scan = tiers.walk(tier).await?;
            while let Some(keys) = tiers.walk_next(tier, &mut scan).await? {
                tiers.erase_now(tier, keys).await?;
            }
            Ok::<(), ProtoError>(())
        }
        .await;
        if let Err(e) = walked {
            if e.code != ErrorCode::BackingUnavailable {
                return Err(e);
            }
            // Some rows may be gone from the cluster: the cache clears too.
            router.execute(Request::Clear { table: t.spec.name.clone() }).await?;
            return Err(partly_applied(e, "the clear", "this cache was cleared"));
        }
    }
    router.execute(Request::Clear { table: t.spec.name.clone() }).await.map(drop)
}

/// A table's stats as the stats document carries them.
pub fn wire_stats(s: &TableStats) -> hkv_proto::stats::BackingStats {
    let t = &s.tier;
    hkv_proto::stats::BackingStats {
        mode: t.mode.clone(),
        hits: s.hits,
        filled: s.filled,
        filled_queued: s.filled_queued,
        absent: s.absent,
        late: s.late,
        unavailable: s.unavailable,
        rows_written: t.rows_written,
        bytes_in: t.bytes_in,
        bytes_out: t.bytes_out,
        queue_rows: t.queue_rows,
        queue_bytes: t.queue_bytes,
        queue_limit_bytes: t.queue_limit_bytes,
        queue_oldest_ms: t.queue_oldest_ms,
        queue_full: t.queue_full,
        invalidations: t.invalidations,
        unpublished_entries: t.unpublished_entries,
        unpublished_bytes: t.unpublished_bytes,
        unpublished_limit_bytes: t.unpublished_limit_bytes,
        unpublished_resets: t.unpublished_resets,
        node_errors: t.node_errors.clone(),
        fetch_p50_us: t.fetch_us.quantile_us(0.5),
        fetch_p99_us: t.fetch_us.quantile_us(0.99),
        staleness_p50_us: t.staleness_us.quantile_us(0.5),
        staleness_p99_us: t.staleness_us.quantile_us(0.99),
    }
}

/// The backed tables' lines of the Prometheus text.
pub fn prometheus(o: &mut String, d: &hkv_proto::stats::Stats) {
    use std::fmt::Write;
    type Get = fn(&hkv_proto::stats::BackingStats) -> u64;
    let series: [(&str, &str, &str, Get); 19] = [
        ("backing_hits_total", "counter", "Read keys the cache answered.", |b| b.hits),
        ("backing_filled_total", "counter", "Read keys filled from the cluster (or the write-back queue).", |b| {
            b.filled
        }),
        ("backing_filled_queued_total", "counter", "Read keys filled from this host's write-back queue.", |b| {
            b.filled_queued
        }),
        ("backing_absent_total", "counter", "Read keys absent from cache and cluster.", |b| b.absent),
        ("backing_late_total", "counter", "Read keys not fetched within the deadline.", |b| b.late),
        ("backing_unavailable_total", "counter", "Read keys whose node failed.", |b| b.unavailable),
        ("backing_rows_written_total", "counter", "Rows written to the cluster.", |b| b.rows_written),
        ("backing_bytes_in_total", "counter", "Row bytes read from the cluster.", |b| b.bytes_in),
        ("backing_bytes_out_total", "counter", "Row bytes written to the cluster.", |b| b.bytes_out),
        ("backing_queue_rows", "gauge", "Rows in the write-back queue.", |b| b.queue_rows),
        ("backing_queue_bytes", "gauge", "Bytes in the write-back queue.", |b| b.queue_bytes),
        ("backing_queue_oldest_ms", "gauge", "Age of the oldest queued row.", |b| b.queue_oldest_ms),
        ("backing_queue_limit_bytes", "gauge", "The write-back queue's bound.", |b| b.queue_limit_bytes),
        ("backing_queue_full_total", "counter", "Writers refused by a full write-back queue.", |b| b.queue_full),
        (
            "backing_invalidations_total",
            "counter",
            "Keys named by other hosts' stream entries heard here, cached here or not.",
            |b| b.invalidations,
        ),
        ("backing_unpublished_entries", "gauge", "Stream entries of this host's writes waiting to be appended.", |b| {
            b.unpublished_entries
        }),
        ("backing_unpublished_bytes", "gauge", "Bytes of the stream entries waiting.", |b| b.unpublished_bytes),
        ("backing_unpublished_limit_bytes", "gauge", "The waiting stream entries' bound.", |b| {
            b.unpublished_limit_bytes
        }),
        ("backing_unpublished_resets_total", "counter", "Times the waiting stream entries became one reset.", |b| {
            b.unpublished_resets
        }),
    ];
    for (name, kind, help, get) in series {
        let _ = writeln!(o, "# HELP hkvd_{name} {help}\n# TYPE hkvd_{name} {kind}");
        for t in &d.tables {
            if let Some(b) = &t.backing {
                let _ = writeln!(o, "hkvd_{name}{{table=\"{}\"}} {}", t.spec.name, get(b));
            }
        }
    }
    // Quantiles of the fetch latency and the staleness (time from another
    // host's acknowledged write to its invalidation here), microseconds:
    // the top of the power-of-two bucket they fall in, as in the stats.
    type Pair = fn(&hkv_proto::stats::BackingStats) -> (u64, u64);
    let quantiles: [(&str, &str, Pair); 2] = [
        ("backing_fetch_us", "Time to fetch a read's misses from the cluster.", |b| (b.fetch_p50_us, b.fetch_p99_us)),
        ("backing_staleness_us", "Time from another host's write to its invalidation here.", |b| {
            (b.staleness_p50_us, b.staleness_p99_us)
        }),
    ];
    for (name, help, get) in quantiles {
        let _ = writeln!(o, "# HELP hkvd_{name} {help}\n# TYPE hkvd_{name} gauge");
        for t in &d.tables {
            if let Some(b) = &t.backing {
                let (p50, p99) = get(b);
                let table = &t.spec.name;
                let _ = writeln!(o, "hkvd_{name}{{table=\"{table}\",quantile=\"0.5\"}} {p50}");
                let _ = writeln!(o, "hkvd_{name}{{table=\"{table}\",quantile=\"0.99\"}} {p99}");
            }
        }
    }
    let _ = writeln!(
        o,
        "# HELP hkvd_backing_node_errors_total Errors per cluster node.\n# TYPE hkvd_backing_node_errors_total counter"
    );
    for t in &d.tables {
        for (node, n) in t.backing.iter().flat_map(|b| &b.node_errors) {
            let _ = writeln!(o, "hkvd_backing_node_errors_total{{table=\"{}\",node=\"{node}\"}} {n}", t.spec.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hkv_proto::{BackingMode, BackingSpec};

    /// An empty password is no password (see [`drop_empty_passwords`]).
    #[test]
    fn empty_passwords_are_dropped() {
        for (given, kept) in [
            ("redis://:@127.0.0.1:1", "redis://127.0.0.1:1"),
            ("redis://default:@127.0.0.1:1", "redis://default@127.0.0.1:1"),
            ("redis://@127.0.0.1:1", "redis://127.0.0.1:1"),
            ("redis://:pw@127.0.0.1:1", "redis://:pw@127.0.0.1:1"),
            ("redis://u:pw@127.0.0.1:1", "redis://u:pw@127.0.0.1:1"),
            ("127.0.0.1:1", "127.0.0.1:1"),
        ] {
            assert_eq!(without_empty_password(given), kept, "{given}");
            let mut spec = TableSpec::new("t", 4, 64);
            spec.backing = Some(BackingSpec::from_list(given, BackingMode::ReadOnly));
            drop_empty_passwords(&mut spec);
            let b = spec.backing.unwrap();
            assert_eq!(b.seeds, vec![kept.to_string()]);
            assert!(!b.redacted().password_hidden() || given.contains("pw@"), "{given}: listed with a hidden password");
        }
    }

    /// The daemon's TOML names a table's backing as the protocol does.
    #[test]
    fn toml_tables_name_their_backing() {
        let c: crate::config::Config = toml::from_str(
            r#"
            [[table]]
            name = "emb"
            dim = 16
            capacity = 4096
            backing = { seeds = ["redis://127.0.0.1:7001", "127.0.0.1:7002"], mode = "write-back", queue_bytes = 1048576 }
            [[table]]
            name = "plain"
            dim = 4
            capacity = 1024
            "#,
        )
        .unwrap();
        let b = c.tables[0].backing.as_ref().unwrap();
        assert_eq!(b.mode, BackingMode::WriteBack);
        assert_eq!(b.seeds.len(), 2);
        let o = backing_options(b);
        assert_eq!((o.mode, o.queue_bytes), (Mode::WriteBack, 1 << 20));
        assert!(c.tables[1].backing.is_none());
        let bad = toml::from_str::<crate::config::Config>(
            "[[table]]\nname = \"x\"\ndim = 1\ncapacity = 1\nbacking = { seeds = [], mode = \"sideways\" }",
        );
        assert!(bad.unwrap_err().to_string().contains("sideways"));
    }
}
