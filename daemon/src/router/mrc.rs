//! Every shard's miss-ratio estimator, by table: the periodic drain, a
//! table's curve for the stats, and traces of its sampled keys.

use std::sync::Arc;

use hkv_proto::ProtoError;

use super::{Router, Table};
use crate::mrc::{ShardCurve, ShardTrace, DRAIN_EVERY};
use crate::shard_ops::{MrcCurve, MrcDrain, TraceStart, TraceTake};

impl Router {
    /// Each shard's curve of `t` (drained first), or None when the curves are off.
    pub async fn mrc_curves(&self, t: &Table) -> Result<Option<Vec<ShardCurve>>, ProtoError> {
        if self.mrc.is_none() {
            return Ok(None);
        }
        // A table created before the curves were on has none.
        Ok(self.on_each(t, || MrcCurve).await?.into_iter().collect())
    }

    /// Starts a trace of `t`'s sampled keys on every shard, `max_keys` at most in all.
    pub async fn trace_start(&self, t: &Table, max_keys: usize) -> Result<(), ProtoError> {
        let per = max_keys / t.shards().max(1);
        self.on_each(t, || TraceStart { max_keys: per }).await.map(drop)
    }

    /// The trace of every shard of `t`, in shard order.
    pub async fn trace_take(&self, t: &Table) -> Result<Vec<ShardTrace>, ProtoError> {
        Ok(self.on_each(t, || TraceTake).await?.into_iter().flatten().collect())
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
            let _ = router.on_each(&t, || MrcDrain).await;
        }
    }
}
