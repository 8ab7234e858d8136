//! A table as the router holds it: its spec, its per-shard config, and the
//! id its shards go by on the actors; names and specs are checked here.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use actix::Addr;
use futures::future::join_all;
use hkv_proto::{ErrorCode, ProtoError, TableSpec};
use hkv_shard::{BucketMode, Error as ShardError, ScorePolicy, TableConfig};

use crate::actor::{Close, ShardActor, TableId};
use crate::budget::Charge;

/// A table: its spec, the per-shard config, and the id its shards go by on
/// every actor (shard `i` lives on actor `i`).
pub struct Table {
    /// As created.
    pub spec: TableSpec,
    /// Each shard's config.
    pub config: TableConfig,
    /// The daemon's record that this table was written in a way an
    /// incremental checkpoint cannot find by score (a client's `load` with
    /// verbatim scores, an epoch set below the highest it ever had): set
    /// before such a write starts and again after it ends
    /// ([`Table::untracked_write`]); a checkpoint takes it (swaps in false)
    /// when it begins the table's export and then stores the table whole.
    /// Set after the end as well, so that a checkpoint that began while the
    /// write ran (and exported some slots before the write reached them) is
    /// followed by a whole one.
    pub untracked: AtomicBool,
    /// The highest epoch this table's shards ever had: set by clients, or
    /// resumed by a restore. An epoch set below it lets writes score below
    /// a watermark taken before.
    pub epoch: AtomicU32,
    /// Orders the writes that rewrite the table as a whole (a client's
    /// `load`, `clear`, `reserve`, an epoch set lower: held for writing)
    /// against a checkpoint's export of it (held for reading, from the
    /// first shard to the last): such a write is wholly before or wholly
    /// after the table's part of a checkpoint, never half in it.
    pub rewrite: tokio::sync::RwLock<()>,
    /// Which creation of a table of this name it is: its own id when
    /// created, that of the table it replaced when a restore installed it
    /// in place of one ([`Table::made`]).
    made: AtomicU64,
    /// Its shards on the actors, closed when the last request holding the
    /// table is done.
    owner: Owner,
}

impl Table {
    /// A table whose shards go by `id` on `actors` (not opened yet: the
    /// router sends `Open`), holding its share of the budget.
    pub(super) fn new(
        spec: TableSpec,
        config: TableConfig,
        id: TableId,
        actors: Vec<Addr<ShardActor>>,
        charge: Charge,
    ) -> Table {
        Table {
            spec,
            config,
            untracked: AtomicBool::new(false),
            epoch: AtomicU32::new(0),
            rewrite: tokio::sync::RwLock::new(()),
            made: AtomicU64::new(id),
            owner: Owner { id, actors, charge: Some(charge) },
        }
    }

    /// Marks the table untracked now and again when the returned guard is
    /// dropped (after the write it covers ended, however it ended).
    pub fn untracked_write(&self) -> UntrackedWrite<'_> {
        self.untracked.store(true, SeqCst);
        UntrackedWrite(self)
    }

    /// The id its shards go by on the actors.
    pub fn id(&self) -> TableId {
        self.owner.id
    }

    /// Which creation of a table of this name it is: a table dropped and
    /// created again is another, a table a restore replaced is the same
    /// (the same spec, its rows the checkpoint's). Clients that learned a
    /// table's spec are told when it changes (`region::Conn::same_table`).
    pub fn made(&self) -> u64 {
        self.made.load(Relaxed)
    }

    /// This table stands in for `old` (a restore's install).
    pub(super) fn replaces(&self, old: &Table) {
        self.made.store(old.made(), Relaxed);
    }

    /// Shards (one per actor).
    pub fn shards(&self) -> usize {
        self.owner.actors.len()
    }

    /// Closes the shards and waits until every actor dropped its own; then
    /// gives the table's memory back to the budget.
    pub(super) async fn close(mut self) {
        let charge = self.owner.charge.take();
        let (id, actors) = (self.owner.id, std::mem::take(&mut self.owner.actors));
        join_all(actors.iter().map(|a| a.send(Close { table: id, charge: None }))).await;
        drop(charge);
    }
}

/// A write an incremental checkpoint cannot find by score, running: marks
/// its table untracked again when dropped.
pub struct UntrackedWrite<'a>(&'a Table);

impl Drop for UntrackedWrite<'_> {
    fn drop(&mut self) {
        self.0.untracked.store(true, SeqCst);
    }
}

/// The shards of one table on the actors. Dropped without
/// [`Table::close`] (a table replaced by a restore, or the last request on
/// a dropped table ending), it tells every actor to drop its shard, and the
/// table's share of the budget goes with the last of them.
struct Owner {
    id: TableId,
    actors: Vec<Addr<ShardActor>>,
    charge: Option<Charge>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let charge = self.charge.take().map(Arc::new);
        for a in &self.actors {
            a.do_send(Close { table: self.id, charge: charge.clone() });
        }
    }
}

/// The per-shard config of a table spec spread over `n` shards.
pub fn shard_config(spec: &TableSpec, n: usize) -> Result<TableConfig, ProtoError> {
    let policy: ScorePolicy =
        spec.policy.as_str().parse().map_err(|e: ShardError| ProtoError::bad_request(e.to_string()))?;
    if spec.lfu_ties != hkv_proto::LfuTies::Lru && policy != ScorePolicy::Lfu {
        return Err(ProtoError::bad_request(format!(
            "lfu_ties {} is for policy lfu, not {}",
            spec.lfu_ties,
            spec.policy.as_str()
        )));
    }
    let mode = match spec.mode.as_str() {
        "single" => BucketMode::Single,
        "dual" => BucketMode::Dual,
        m => return Err(ProtoError::bad_request(format!("mode {m:?}: use single or dual"))),
    };
    // Checked in the request's own numbers; the per-shard ones below are rounded.
    if spec.max_capacity != 0 && spec.max_capacity < spec.capacity {
        return Err(ProtoError::bad_request(format!(
            "max_capacity {} is below capacity {}; use 0 for a table that does not grow",
            spec.max_capacity, spec.capacity
        )));
    }
    // Sizes that cannot even be counted in bytes are memory no host has,
    // whatever the shard count: the same answer as the budget's refusals.
    // A table with an optimizer stores its state beside the values: its
    // shards' rows are `row_dim` floats, and so are its value arrays on
    // the wire (every op but apply_gradients).
    let row_dim = spec.row_dim();
    if spec.optimizer.is_some() && row_dim > 1 << 16 {
        return Err(ProtoError::bad_request(format!(
            "invalid table config: dim {} with optimizer {} makes rows of {row_dim} floats; rows hold 65536 at most",
            spec.dim,
            spec.optimizer.map_or("", |o| o.as_str())
        )));
    }
    let slot_bytes = (row_dim as u64).saturating_mul(4).saturating_add(145);
    let dim_ok = (1..=1 << 16).contains(&spec.dim); // else the config check below names the dim
    if dim_ok && spec.capacity.max(spec.max_capacity).checked_mul(slot_bytes).is_none() {
        return Err(ProtoError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "table {:?}: capacity {} (max_capacity {}) at dim {} is too large to count in bytes; no host holds it",
                spec.name, spec.capacity, spec.max_capacity, spec.dim
            ),
        ));
    }
    let per = |x: u64| x.div_ceil(n as u64);
    let config = TableConfig {
        capacity: per(spec.capacity),
        max_capacity: per(spec.max_capacity),
        max_load_factor: spec.max_load_factor.unwrap_or(0.5),
        dim: row_dim,
        policy,
        mode,
        fast_tier_bytes: spec.fast_tier_bytes.map(per),
        // Lru (the crate's default) unless the spec asks for the reference's
        // rule; a manifest written before `lfu_ties` existed restores as
        // lowest-slot (ckpt::restore), since its scores are plain frequencies.
        lfu_ties: match spec.lfu_ties {
            hkv_proto::LfuTies::Lru => hkv_shard::LfuTies::Lru,
            hkv_proto::LfuTies::LowestSlot => hkv_shard::LfuTies::LowestSlot,
        },
        // The process's, which the router gives every table (Router::tuning).
        tuning: Default::default(),
        reads_refresh: spec.reads_refresh,
    };
    config.validate().map_err(|e| ProtoError::bad_request(e.to_string()))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hkv_proto::check_name;

    #[test]
    fn names_and_configs_are_checked() {
        assert!(check_name("emb_v2.users-1").is_ok());
        assert!(check_name("").is_err() && check_name("a b").is_err() && check_name(&"x".repeat(256)).is_err());
        for bad in [".", "..", ".hidden", "-flag", "a/b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name("_x").is_ok() && check_name("9.a-b").is_ok());
        // Uncountable sizes are resource_exhausted on any shard count.
        for shards in [1, 3] {
            let e = shard_config(&TableSpec::new("t", 4, 1 << 62), shards).unwrap_err();
            assert_eq!(e.code, ErrorCode::ResourceExhausted, "{shards}: {}", e.message);
        }
        let e = shard_config(&TableSpec::new("t", 1 << 20, 1 << 62), 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
        assert!(e.message.contains("dim"), "{}", e.message);
        let c = shard_config(&TableSpec::new("t", 8, 1000), 4).unwrap();
        assert_eq!(c.capacity, 250);
        let bad = serde_json::from_str::<TableSpec>(r#"{"name":"t","dim":8,"capacity":1000,"policy":"fifo"}"#);
        assert!(bad.unwrap_err().to_string().contains("fifo"));
        // The lfu tie rule names a rule of lfu tables only (hkvctl, the
        // protocol and the config file alike).
        let mut s = TableSpec { lfu_ties: hkv_proto::LfuTies::LowestSlot, ..TableSpec::new("t", 8, 1024) };
        let e = shard_config(&s, 1).unwrap_err();
        assert!(e.message.contains("lfu_ties lowest-slot is for policy lfu, not lru"), "{}", e.message);
        s.policy = hkv_proto::Policy::Lfu;
        assert_eq!(shard_config(&s, 1).unwrap().lfu_ties, hkv_shard::LfuTies::LowestSlot);
    }
}
