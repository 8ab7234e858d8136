//! Every shard's miss-ratio estimator, by table: the periodic drain, a
//! table's curve for the stats, and traces of its sampled keys.

use std::sync::Arc;

use hkv_proto::ProtoError;

use super::{Router, Table};
use crate::actor::{SubOp, SubResult};
use crate::error::unexpected;
use crate::mrc::{MrcOp, MrcResult, ShardCurve, ShardTrace, DRAIN_EVERY};

impl Router {
    /// Runs `op` on every shard's estimator of `t`.
    async fn mrc_all(&self, t: &Table, op: impl Fn() -> MrcOp) -> Result<Vec<MrcResult>, ProtoError> {
        let ops = (0..t.shards()).map(|_| SubOp::Mrc(op())).collect();
        self.fan_out(t, ops)
            .await?
            .into_iter()
            .map(|r| match r {
                SubResult::Mrc(m) => Ok(m),
                _ => Err(unexpected("mrc")),
            })
            .collect()
    }

    /// Each shard's curve of `t` (drained first), or None when the curves are off.
    pub async fn mrc_curves(&self, t: &Table) -> Result<Option<Vec<ShardCurve>>, ProtoError> {
        if self.mrc.is_none() {
            return Ok(None);
        }
        let mut curves = vec![];
        for r in self.mrc_all(t, || MrcOp::Curve).await? {
            match r {
                MrcResult::Curve(c) => curves.push(*c),
                // A table created before the curves were on has none.
                _ => return Ok(None),
            }
        }
        Ok(Some(curves))
    }

    /// Starts a trace of `t`'s sampled keys on every shard, `max_keys` at most in all.
    pub async fn trace_start(&self, t: &Table, max_keys: usize) -> Result<(), ProtoError> {
        let per = max_keys / t.shards().max(1);
        self.mrc_all(t, || MrcOp::TraceStart { max_keys: per }).await.map(drop)
    }

    /// The trace of every shard of `t`, in shard order.
    pub async fn trace_take(&self, t: &Table) -> Result<Vec<ShardTrace>, ProtoError> {
        Ok(self
            .mrc_all(t, || MrcOp::TraceTake)
            .await?
            .into_iter()
            .filter_map(|r| match r {
                MrcResult::Trace(tr) => Some(tr),
                _ => None,
            })
            .collect())
    }
}

/// Drains every table's samples into its estimators every [`DRAIN_EVERY`]
/// until shutdown.
pub async fn drain_samples(router: Arc<Router>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(DRAIN_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        for t in router.tables() {
            // A table dropped meanwhile answers an error: nothing to drain.
            let _ = router.mrc_all(&t, || MrcOp::Drain).await;
        }
    }
}
