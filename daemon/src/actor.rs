//! `ShardActor`: the thread(s) owning one device and its shard of every table.
//!
//! Each device gets its own `SyncArbiter` (blocking work never runs on the
//! async executor); a CUDA context is bound to those threads. The shards
//! live in the actor: the router names a table by its [`TableId`] and sends
//! [`Open`], [`On`] (one message type per operation) and [`Close`]; no shard is reachable from anywhere
//! else, so no table lock is ever taken on the async executor. Messages
//! carry owned sub-batches and come back with owned results.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use hkv_shard::mrc::MrcConfig;
use hkv_shard::{Backend, Shard, TableConfig};
use parking_lot::RwLock;

use crate::budget::Charge;
use crate::mrc::ShardMrc;
use crate::path::Ran;

/// Names a table to the actors: unique for the daemon's life (a restore
/// builds a table of the same name beside the running one).
pub type TableId = u64;

/// The shards of one device, by table: shared by that device's actor
/// threads, touched by nothing else.
type Shards = Arc<RwLock<HashMap<TableId, Arc<dyn Shard>>>>;

/// The actor of one device: each of its threads (`threads_per_shard`, so
/// that readers run in parallel in the table's own lock groups) serves
/// messages on the shards they own together.
pub struct ShardActor {
    /// Its shards, which its threads share with [`Direct`] calls.
    own: Direct,
}

/// One device's shards, for running an operation on the calling thread
/// instead of the actor's ([`Direct::run`]): what the router does for a
/// request whose wait for an actor thread would cost more than its work
/// (a request on a client's device memory). Creations and drops still go
/// through the actor ([`Open`], [`Close`]).
#[derive(Clone)]
pub struct Direct {
    /// Device (or CPU shard) index.
    device: usize,
    /// This device's shard of every table.
    shards: Shards,
    /// The miss-ratio estimators of those shards, by table (`crate::mrc`).
    mrcs: Arc<RwLock<HashMap<TableId, Arc<ShardMrc>>>>,
}

impl ShardActor {
    /// Starts the actor of device (or CPU shard) `device` on `threads`
    /// threads; also returns the direct line to its shards.
    pub fn start(device: usize, threads: usize) -> (Addr<ShardActor>, Direct) {
        let own = Direct { device, shards: Shards::default(), mrcs: Arc::default() };
        let line = own.clone();
        (SyncArbiter::start(threads.max(1), move || ShardActor { own: own.clone() }), line)
    }
}

impl Direct {
    fn shard(&self, table: TableId) -> Result<Arc<dyn Shard>, hkv_shard::Error> {
        self.shards.read().get(&table).cloned().ok_or_else(|| {
            hkv_shard::Error::Device(format!("table {table} has no shard on device {}; it was dropped", self.device))
        })
    }

    /// Runs `op` on this device's shard of `table`, on the calling thread
    /// (a panic inside it is this call's error), and says when it ran.
    /// The caller must be a thread that may block (an actor thread, or
    /// the executor's inside `block_in_place`).
    pub fn run<O: ShardOp>(&self, table: TableId, op: O) -> (Result<O::Output, hkv_shard::Error>, Ran) {
        let began = Instant::now();
        let r = self.shard(table).and_then(|shard| {
            let mrc = self.mrcs.read().get(&table).cloned();
            contained(O::WHAT, || op.run(&*shard, mrc.as_deref()))
        });
        (r, Ran { began, ended: Instant::now() })
    }
}

impl Actor for ShardActor {
    type Context = SyncContext<Self>;
}

/// One operation on one device's shard of a table, run on that device's
/// actor thread: each is its own message ([`On`]) with its own result
/// type, so an answer never needs to be told apart from another op's
/// (the operations are in `crate::shard_ops`).
pub trait ShardOp: Send + 'static {
    /// What it answers.
    type Output: Send + 'static;
    /// What it is, for the error of a panic inside it.
    const WHAT: &'static str;
    /// Runs on the shard (and its miss-ratio estimator, when the curves are on).
    fn run(self, shard: &dyn Shard, mrc: Option<&ShardMrc>) -> Result<Self::Output, hkv_shard::Error>;
}

/// Runs `op` on this device's shard of `table`.
pub struct On<O> {
    /// The table.
    pub table: TableId,
    /// What to do.
    pub op: O,
}

impl<O: ShardOp> Message for On<O> {
    type Result = (Result<O::Output, hkv_shard::Error>, Ran);
}

impl<O: ShardOp> Handler<On<O>> for ShardActor {
    type Result = MessageResult<On<O>>;
    fn handle(&mut self, msg: On<O>, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(self.own.run(msg.table, msg.op))
    }
}

/// Creates this device's shard of a table.
#[derive(Message)]
#[rtype(result = "Result<(), hkv_shard::Error>")]
pub struct Open {
    /// The table.
    pub table: TableId,
    /// Per-shard config.
    pub config: TableConfig,
    /// Backend.
    pub backend: Backend,
    /// Its miss-ratio estimator's config (None: the curves are off).
    pub mrc: Option<MrcConfig>,
    /// The table's name, for the log.
    pub name: Arc<str>,
    /// This shard's index among the table's, for the log.
    pub shard: usize,
}

/// Drops this device's shard of a table (a call running on it finishes first).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Close {
    /// The table.
    pub table: TableId,
    /// The table's share of the memory budget, given back once every
    /// device dropped its shard (when the router does not wait for them).
    pub charge: Option<Arc<Charge>>,
}

impl Handler<Open> for ShardActor {
    type Result = Result<(), hkv_shard::Error>;
    fn handle(&mut self, msg: Open, _: &mut SyncContext<Self>) -> Self::Result {
        let own = &self.own;
        let device = own.device;
        let shard: Arc<dyn Shard> =
            contained("create_table", || Ok(Arc::from(hkv_shard::open_on(msg.config, msg.backend, device)?)))?;
        if let Some(cfg) = msg.mrc {
            own.mrcs.write().insert(msg.table, ShardMrc::open(&*shard, cfg, &msg.name, msg.shard));
        }
        own.shards.write().insert(msg.table, shard);
        Ok(())
    }
}

impl Handler<Close> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Close, _: &mut SyncContext<Self>) {
        self.own.mrcs.write().remove(&msg.table);
        let shard = self.own.shards.write().remove(&msg.table);
        // Freed here, on the actor's thread (a CUDA shard binds its context).
        drop(shard);
        drop(msg.charge);
    }
}

/// What a caught panic said.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown".into())
}

/// Runs `f`, turning a panic into an error: a bug hit by one request fails
/// that request, and the actor's thread lives on to serve the next one
/// (a thread that died would leave every later request without an answer).
fn contained<T>(what: &str, f: impl FnOnce() -> Result<T, hkv_shard::Error>) -> Result<T, hkv_shard::Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = panic_text(p.as_ref());
        tracing::error!(panic = %why, "{what} panicked; the request failed, the shard actor goes on");
        Err(hkv_shard::Error::Device(format!("{what} failed inside the daemon ({why}); please report it")))
    })
}
