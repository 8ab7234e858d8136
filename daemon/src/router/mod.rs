//! The router: tables spread over every shard actor. A batch is split by
//! `hkv_shard::hash::shard_of` (a mix independent of the bucket hashes), the
//! sub-batches run concurrently on their actors, and the answers are put back
//! in request order.
//!
//! # Layout
//! - `table`: [`Table`], table names and specs checked.
//! - `shards`: messages to the shard actors.
//! - `ops`: each table operation, split over the shards (and the feature requests).
//! - `merge`: sub-batch answers put back into one.
//! - `mrc`: the tables' miss-ratio curves and traces, from every shard.
//! - `split`: which shard each key goes to.
//! - `bounds`: the largest answer a request can get.
//! - this file: [`Router`] and its tables, created, built, installed and dropped.

mod bounds;
mod merge;
pub(crate) use merge::to_wire;
pub use merge::{ApplyAnswer, ExportAnswer, FindAnswer, WriteAnswer};
pub(crate) use ops::{step_of, summed_outcomes};
pub use ops::{Hashed, Part};
mod mrc;
mod ops;
mod shards;
mod split;
mod table;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use actix::Addr;
use futures::future::join_all;
use hkv_proto::{ErrorCode, ProtoError, TableInfo, TableSpec};
use hkv_shard::Backend;
use parking_lot::RwLock;

pub use hkv_proto::check_name;
pub use mrc::drain_samples;
pub use table::{shard_config, Table};

use crate::actor::{Direct, Open, ShardActor};
use crate::budget::Budget;
use crate::error::{err, shard_error};
use crate::features::Hasher;
use crate::frames::Frames;

/// Maps tables and keys to shard actors.
pub struct Router {
    actors: Vec<Addr<ShardActor>>,
    /// The same shards, for operations run on the calling thread (`Router::call_here`).
    direct: Vec<Direct>,
    backend: Backend,
    tables: RwLock<HashMap<String, Arc<Table>>>,
    /// Feature hashing (GPU when present).
    pub hasher: Arc<Hasher>,
    /// Sent frames given back for find answers to reuse.
    pub frames: Frames,
    /// Where shard calls' time goes (`stats.path`).
    pub path: crate::path::PathTimes,
    /// Table memory.
    pub budget: Arc<Budget>,
    /// The largest answer body (`limits.max_frame_bytes`).
    max_answer: u64,
    /// Counts table creations and drops: a checkpoint chain continues only
    /// while it is unchanged.
    generation: AtomicU64,
    /// The next [`TableId`].
    next_id: AtomicU64,
    /// The miss-ratio estimators' config of tables created from now on
    /// (None: the curves are off).
    pub mrc: Option<hkv_shard::mrc::MrcConfig>,
    /// On the CUDA backend, the GPU of each actor (shard i of every table
    /// lives on GPU `ordinals[i]`); empty on the CPU backend.
    pub ordinals: Vec<usize>,
    /// The CUDA kernel tuning every table created from now on gets (the
    /// `HKV_*` variables `hkvd` reads; the default otherwise).
    pub tuning: hkv_shard::CudaTuning,
    /// Names of the tables a restore loads: neither dropped nor created
    /// until it ends ([`Router::hold_for_restore`]).
    restoring: parking_lot::Mutex<Vec<String>>,
    /// Backed tables a restore changed whose rows are not yet checked
    /// against their clusters ([`Router::hold_unchecked`]): their requests
    /// wait ([`Router::wait_checked`]); `any_unchecked` says whether there
    /// are any (read alone, with no lock, by every request otherwise), and
    /// `checked` wakes the waiters when the check ends.
    unchecked: parking_lot::Mutex<Vec<String>>,
    any_unchecked: AtomicBool,
    checked: tokio::sync::Notify,
}

/// [`Router::hold_for_restore`]'s hold: the names are free again on drop.
pub struct RestoreHold<'a> {
    router: &'a Router,
    names: Vec<String>,
}

impl Drop for RestoreHold<'_> {
    fn drop(&mut self) {
        let mut held = self.router.restoring.lock();
        for n in &self.names {
            if let Some(i) = held.iter().position(|h| h == n) {
                held.swap_remove(i);
            }
        }
    }
}

/// [`Router::release_unchecked_after`]'s guard.
pub struct ReleaseUnchecked<'a>(&'a Router);

impl Drop for ReleaseUnchecked<'_> {
    fn drop(&mut self) {
        self.0.release_unchecked();
    }
}

impl Router {
    /// A router over these actors (one per device / CPU shard); feature
    /// batches are hashed on GPU `hash_gpu` when given.
    /// Answers are at most `max_answer` bytes (`limits.max_frame_bytes`).
    pub fn new(
        actors: Vec<(Addr<ShardActor>, Direct)>,
        backend: Backend,
        hash_gpu: Option<usize>,
        frame_cache: u64,
        budget: Arc<Budget>,
        max_answer: u32,
    ) -> Router {
        let hasher = Arc::new(Hasher::new(hash_gpu));
        let frames = match (backend, hash_gpu) {
            (Backend::Cuda, Some(ordinal)) => Frames::new(frame_cache).pinned(ordinal),
            _ => Frames::new(frame_cache),
        };
        let (actors, direct) = actors.into_iter().unzip();
        Router {
            actors,
            direct,
            backend,
            tables: RwLock::new(HashMap::new()),
            hasher,
            frames,
            path: Default::default(),
            budget,
            max_answer: (max_answer as u64).min(bounds::MAX_BODY),
            generation: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            mrc: None,
            ordinals: Vec::new(),
            tuning: hkv_shard::CudaTuning::default(),
            restoring: parking_lot::Mutex::new(Vec::new()),
            unchecked: parking_lot::Mutex::new(Vec::new()),
            any_unchecked: AtomicBool::new(false),
            checked: tokio::sync::Notify::new(),
        }
    }

    /// Holds `names` for a restore until the hold drops: drop_table and
    /// create_table of them are refused `busy` meanwhile. A tester's table
    /// dropped and made again (another dim, an optimizer) while a live
    /// restore ran was replaced by the checkpoint's, silently, and one
    /// dropped during an in-place restore was gone though the restore
    /// answered its rows. Taken under the tables' lock, so that a create
    /// or drop is either seen by the restore or refused.
    pub fn hold_for_restore(&self, names: Vec<String>) -> RestoreHold<'_> {
        let _tables = self.tables.write();
        self.restoring.lock().extend(names.iter().cloned());
        RestoreHold { router: self, names }
    }

    /// A restore is about to change what clients see of `names`, backed
    /// tables whose restored rows must be checked against their clusters
    /// before they serve (docs/backing.md, "Checkpoints"): their requests
    /// wait from now until [`Router::release_unchecked`]. Before, a live
    /// restore's readers got the checkpoint's rows, older than rows the
    /// cluster held (a tester: 19 of 2 449 reads over 10 restores), between
    /// the install and the check.
    pub fn hold_unchecked(&self, names: impl IntoIterator<Item = String>) {
        let mut u = self.unchecked.lock();
        u.extend(names);
        if !u.is_empty() {
            self.any_unchecked.store(true, Relaxed);
        }
    }

    /// The check after a restore ended (or the restore failed): the
    /// tables [`Router::hold_unchecked`] held serve again. Restores run one
    /// at a time, so every held name goes.
    pub fn release_unchecked(&self) {
        let mut u = self.unchecked.lock();
        u.clear();
        self.any_unchecked.store(false, Relaxed);
        drop(u);
        self.checked.notify_waiters();
    }

    /// [`Router::release_unchecked`] when the guard drops, whatever the
    /// restore and its check did (an error, a panic).
    pub fn release_unchecked_after(&self) -> ReleaseUnchecked<'_> {
        ReleaseUnchecked(self)
    }

    /// Waits while a restore holds `name` unchecked ([`Router::hold_unchecked`]).
    pub async fn wait_checked(&self, name: &str) {
        while self.any_unchecked.load(Relaxed) {
            let woken = self.checked.notified();
            tokio::pin!(woken);
            // Registered before the set is read: a release in between wakes it.
            woken.as_mut().enable();
            if !self.unchecked.lock().iter().any(|n| n == name) {
                return;
            }
            woken.await;
        }
    }

    /// `busy` while a restore holds `name` (call with the tables' lock held).
    fn not_restoring(&self, name: &str, what: &str) -> Result<(), ProtoError> {
        if self.restoring.lock().iter().any(|n| n == name) {
            return Err(err(
                ErrorCode::Busy,
                format!(
                    "a restore of table {name:?} is running: it cannot be {what} until the restore ends; try again"
                ),
            ));
        }
        Ok(())
    }

    /// Shards per table.
    pub fn shards(&self) -> usize {
        self.actors.len()
    }

    /// Every table, by name.
    pub fn tables(&self) -> Vec<Arc<Table>> {
        self.tables_at().1
    }

    /// The table generation and every table, by name, read together (under
    /// the lock that creations, drops and installs change both under): a
    /// checkpoint that finds the generation it built its chain at knows
    /// each name still names the table its previous checkpoint exported,
    /// not one dropped and created again in between.
    pub fn tables_at(&self) -> (u64, Vec<Arc<Table>>) {
        let tables = self.tables.read();
        let generation = self.generation.load(Relaxed);
        let mut v: Vec<_> = tables.values().cloned().collect();
        v.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        (generation, v)
    }

    /// A table by name.
    pub fn table(&self, name: &str) -> Result<Arc<Table>, ProtoError> {
        self.tables.read().get(name).cloned().ok_or_else(|| {
            err(
                ErrorCode::UnknownTable,
                format!("no table named {}; create it first (hkvctl create-table)", hkv_proto::quoted(name)),
            )
        })
    }

    /// Why `spec` asks for something this daemon's backend has not: the
    /// CPU backend keeps every value in host memory, so a fast tier's size
    /// means nothing there. A request naming it is refused
    /// (`crate::handle`); a table of the config file is made without it, with
    /// a warning (a config written for a GPU host still starts on one
    /// without a GPU).
    pub fn unsupported(&self, spec: &TableSpec) -> Option<String> {
        (self.backend == Backend::Cpu && spec.fast_tier_bytes.is_some()).then(|| {
            format!(
                "table {:?}: fast_tier_bytes sizes a CUDA table's values in GPU memory; this daemon runs the CPU \
                 backend, which keeps every value in host memory: leave it out",
                spec.name
            )
        })
    }

    /// Creates a table on every actor.
    pub async fn create_table(&self, spec: TableSpec) -> Result<TableInfo, ProtoError> {
        let table = self.prepare_table(spec).await?;
        self.add_table(table).await
    }

    /// Checks a new table's spec and builds it, charged to the budget but
    /// not visible ([`Router::add_table`] makes it so): the first half of
    /// create_table, so that what the spec or the budget refuses is
    /// refused before anything else (a backed table's cluster) is touched.
    pub async fn prepare_table(&self, spec: TableSpec) -> Result<Arc<Table>, ProtoError> {
        check_name(&spec.name)?;
        // hkvctl refused it, the config file and the Python client did
        // not (a newcomer's table kept a threshold it never uses). Not in
        // `build_table`: a checkpoint's older spec still restores.
        if let (Some(f), 0) = (spec.max_load_factor, spec.max_capacity) {
            return Err(ProtoError::bad_request(format!(
                "max_load_factor {f} is the load past which a table grows: give max_capacity too (above capacity)"
            )));
        }
        if self.tables.read().contains_key(&spec.name) {
            return Err(err(ErrorCode::TableExists, format!("table {:?} exists; drop it first", spec.name)));
        }
        self.not_restoring(&spec.name, "created")?;
        self.build_table(spec).await
    }

    /// Makes a table [`Router::prepare_table`] built visible, unless one of
    /// its name was made meanwhile (then it is closed, its memory given
    /// back, and the answer is `table_exists`).
    pub async fn add_table(&self, table: Arc<Table>) -> Result<TableInfo, ProtoError> {
        let refused = {
            let mut tables = self.tables.write();
            let name = &table.spec.name;
            let refused = if tables.contains_key(name) {
                Some(err(ErrorCode::TableExists, format!("table {name:?} exists; drop it first")))
            } else {
                self.not_restoring(name, "created").err()
            };
            if refused.is_none() {
                tables.insert(name.clone(), table.clone());
                self.generation.fetch_add(1, Relaxed);
            }
            refused
        };
        if let Some(e) = refused {
            Self::discard(table).await;
            return Err(e);
        }
        self.info(&table).await
    }

    /// Closes a table no one else holds (one built and never made visible).
    pub async fn discard(table: Arc<Table>) {
        if let Some(t) = Arc::into_inner(table) {
            t.close().await;
        }
    }

    /// Builds a table on every actor, charged to the budget, without making
    /// it visible: a restore fills such tables and then [`Router::install`]s
    /// them, so nothing it refuses or fails on is ever seen half loaded.
    pub async fn build_table(&self, spec: TableSpec) -> Result<Arc<Table>, ProtoError> {
        check_name(&spec.name)?;
        if let Some(h) = &spec.hash {
            crate::features::check(h)?;
        }
        let mut config = hkv_shard::TableConfig { tuning: self.tuning, ..shard_config(&spec, self.actors.len())? };
        // A backed table's find hits refresh their scores (issue 34): the
        // find does it as it reads the row (`reads_refresh`, on both
        // backends), unless the spec says otherwise. A custom table's
        // scores are the caller's.
        if spec.backing.is_some() && spec.reads_refresh.is_none() && config.policy != hkv_shard::ScorePolicy::Custom {
            config.reads_refresh = Some(true);
        }
        let n = self.actors.len();
        let shape = format!(
            "capacity {}, max_capacity {}, dim {}, {n} shard{}",
            spec.capacity,
            spec.max_capacity,
            spec.dim,
            if n == 1 { "" } else { "s" }
        );
        let charge = self.budget.charge(&spec.name, &shape, &config)?;
        let id = self.next_id.fetch_add(1, Relaxed);
        // Owned from here on: a shard some actor failed to create is closed
        // with the others when this table is dropped.
        let table = Table::new(spec, config, id, self.actors.clone(), charge);
        // The curves' budget is the table's, split over its shards: each
        // shard's estimator samples a hash-chosen share of the keys, and the
        // table's curve is their mean, as accurate as one estimator of the
        // whole budget, at the same cost per key whatever the shard count
        // (issue 32: a budget per shard multiplied the sampled keys, and
        // the CPU time per key, by the shards).
        let mrc = self.mrc.map(|c| hkv_shard::mrc::MrcConfig {
            max_keys: (c.max_keys / n).max(crate::config::MrcSettings::MIN_SHARD_KEYS),
            reads_refresh: table.config.refreshes_reads(),
            ..c
        });
        let name: Arc<str> = Arc::from(table.spec.name.as_str());
        let opened = join_all(self.actors.iter().enumerate().map(|(shard, a)| {
            let config = table.config.clone();
            a.send(Open { table: id, config, backend: self.backend, mrc, name: name.clone(), shard })
        }))
        .await;
        let mut failed = None;
        for r in opened {
            let r = r.map_err(|e| err(ErrorCode::Internal, format!("shard actor gone: {e}")));
            if let Err(e) = r.and_then(|r| r.map_err(shard_error)) {
                failed.get_or_insert(e);
            }
        }
        match failed {
            None => Ok(Arc::new(table)),
            Some(e) => {
                table.close().await;
                Err(e)
            }
        }
    }

    /// Makes built tables visible at once, replacing tables of the same
    /// names (requests already running on those finish on them).
    pub fn install(&self, built: Vec<Arc<Table>>) {
        let mut tables = self.tables.write();
        for t in built {
            if let Some(old) = tables.get(&t.spec.name) {
                t.replaces(old);
            }
            tables.insert(t.spec.name.clone(), t);
        }
        self.generation.fetch_add(1, Relaxed);
    }

    /// Drops a table; requests already running on it finish first. When
    /// none is, its shards are gone (and its memory back in the budget)
    /// when this returns.
    pub async fn drop_table(&self, name: &str) -> Result<(), ProtoError> {
        let removed = {
            let mut tables = self.tables.write();
            if tables.contains_key(name) {
                self.not_restoring(name, "dropped")?;
            }
            self.generation.fetch_add(1, Relaxed);
            tables.remove(name)
        };
        let t = removed
            .ok_or_else(|| err(ErrorCode::UnknownTable, format!("no table named {}", hkv_proto::quoted(name))))?;
        if let Some(t) = Arc::into_inner(t) {
            t.close().await;
        }
        Ok(())
    }
}
