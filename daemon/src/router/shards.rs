//! The router's messages to the shard actors: one shard's call, a call on
//! every shard, and the queries a table's listing, stats and checkpoints need.

use std::time::Instant;

use futures::future::join_all;
use hkv_proto::{ErrorCode, ProtoError, TableInfo};
use hkv_shard::{Error as ShardError, Filter};

use super::{Router, Table};
use crate::actor::{On, ShardOp};
use crate::error::{err, shard_error};
use crate::shard_ops::{Clear, ClockScore, ExportPart, ResumeAfter, Size, Stats};

impl Router {
    /// Runs `op` on shard `i` of `table` (on its actor).
    pub(crate) async fn call<O: ShardOp>(&self, table: &Table, i: usize, op: O) -> Result<O::Output, ProtoError> {
        let sent = Instant::now();
        let (r, ran) = self.actors[i]
            .send(On { table: table.id(), op })
            .await
            .map_err(|e| err(ErrorCode::Internal, format!("shard {i} actor gone: {e}")))?;
        self.path.call(sent, ran, Instant::now());
        answer(i, r)
    }

    /// Runs `op` on shard `i` of `table` on this thread, in
    /// `block_in_place`, instead of on the shard's actor: for a short
    /// operation whose two thread hand-offs (to the actor's thread and
    /// back) would cost more than it does, such as a request on a client's
    /// device memory (`crate::region::device`). The table's own lock groups
    /// order it against the actor's calls as they order those among
    /// themselves.
    pub(crate) fn call_here<O: ShardOp>(&self, table: &Table, i: usize, op: O) -> Result<O::Output, ProtoError> {
        let sent = Instant::now();
        let (r, ran) = tokio::task::block_in_place(|| self.direct[i].run(table.id(), op));
        self.path.call(sent, ran, Instant::now());
        answer(i, r)
    }

    /// Runs one op per shard (in parallel) and returns the answers in shard order.
    pub(super) async fn fan_out<O: ShardOp>(&self, table: &Table, ops: Vec<O>) -> Result<Vec<O::Output>, ProtoError> {
        join_all(ops.into_iter().enumerate().map(|(i, op)| self.call(table, i, op))).await.into_iter().collect()
    }

    /// Runs `op()` on every shard (in parallel); the answers in shard order.
    pub(crate) async fn on_each<O: ShardOp>(
        &self,
        t: &Table,
        op: impl Fn() -> O,
    ) -> Result<Vec<O::Output>, ProtoError> {
        self.fan_out(t, (0..t.shards()).map(|_| op()).collect()).await
    }

    /// The listing of a table.
    pub async fn info(&self, t: &Table) -> Result<TableInfo, ProtoError> {
        let sizes = self.sizes(t).await?;
        // A backing's password stays in the daemon; whether reads refresh
        // is said even where the policy's default decided it.
        let mut spec = t.spec.redacted();
        spec.reads_refresh = Some(t.config.refreshes_reads());
        Ok(TableInfo {
            spec,
            size: sizes.iter().map(|s| s.0).sum(),
            capacity: sizes.iter().map(|s| s.1).sum(),
            shards: t.shards() as u32,
            row_dim: t.config.dim,
        })
    }

    /// Each shard's entries and slots.
    pub async fn sizes(&self, t: &Table) -> Result<Vec<(u64, u64)>, ProtoError> {
        self.on_each(t, || Size).await
    }

    /// Each shard's counters and lock state.
    pub async fn shard_stats(&self, t: &Table) -> Result<Vec<hkv_shard::ShardStats>, ProtoError> {
        self.on_each(t, || Stats).await
    }

    /// Shard `i`'s `clock_score` (the lowest score a write made from now on can get).
    pub async fn clock_score(&self, t: &Table, i: usize) -> Result<u64, ProtoError> {
        self.call(t, i, ClockScore).await
    }

    /// Entries of shard `i` in slots `[offset, offset + n)` matching
    /// `filter`, and the shard's capacity after the export.
    pub async fn export_part(
        &self,
        t: &Table,
        i: usize,
        offset: u64,
        n: u64,
        filter: Filter,
    ) -> Result<(hkv_shard::Export, u64), ProtoError> {
        self.call(t, i, ExportPart { offset, n, filter }).await
    }

    /// Moves every shard's clock and epoch past a restore's scores (`Shard::resume_after`).
    pub async fn resume_after(&self, t: &Table, score: u64) -> Result<(), ProtoError> {
        self.on_each(t, || ResumeAfter(score)).await.map(drop)
    }

    /// Empties every shard of `t`.
    pub async fn clear(&self, t: &Table) -> Result<(), ProtoError> {
        self.on_each(t, || Clear).await.map(drop)
    }
}

/// A shard call's answer as the request's: a device failure (out of
/// memory, a lost GPU) fails the requests that touched that shard, and
/// says which one.
fn answer<T>(i: usize, r: Result<T, ShardError>) -> Result<T, ProtoError> {
    r.map_err(|e| {
        let device = matches!(e, ShardError::Device(_));
        let mut pe = shard_error(e);
        if device {
            pe.message = format!("shard {i}: {}", pe.message);
        }
        pe
    })
}
