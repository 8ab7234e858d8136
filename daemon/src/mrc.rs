//! Live miss-ratio curves (issue 27): each shard of a table samples the keys
//! of its lookups and writes (`Shard::set_sampler`: a spatial hash filter,
//! in the kernels on CUDA), the shard's actor drains them every
//! [`DRAIN_EVERY`] and before stats into that shard's [`hkv_shard::mrc::Mrc`]
//! (a SHARDS estimator), and the stats combine the shards' curves into the
//! table's.
//!
//! # Why a table's curve is the shards' mean
//! A key's shard is a hash of the key (`hkv_shard::hash::shard_of`), so each
//! shard sees every access of a hash-chosen 1/n of the keys: a spatial
//! sample of the table's stream, as SHARDS' own filter is. A shard of `c/n`
//! slots facing `1/n` of the keys behaves as the table of `c` slots facing
//! all of them, so the table's hit rate at `f × capacity` is estimated by
//! each shard's at `f × its capacity`, averaged with the shards' accesses
//! as weights (the hit rate of the union of their streams).
//!
//! # Traces
//! While a trace is being taken ([`MrcOp::TraceStart`]), each drain also
//! appends the sampled keys (after the estimator's current filter) to the
//! shard's trace, up to a bound; [`MrcOp::TraceTake`] hands them over with
//! the rate they were sampled at.

use std::sync::Arc;
use std::time::Duration;

use hkv_shard::mrc::{Curve, Mrc, MrcConfig};
use hkv_shard::Shard;
use parking_lot::Mutex;

/// How often every shard's samples are drained into its estimator. A drain
/// takes the table's inserter lock group for a moment, so it runs on this
/// tick and before stats, never per request.
pub const DRAIN_EVERY: Duration = Duration::from_millis(250);

/// One shard's estimator and trace, owned by its actor beside the shard.
pub struct ShardMrc {
    inner: Mutex<Inner>,
}

struct Inner {
    mrc: Mrc,
    buf: Vec<u64>,
    trace: Option<Trace>,
}

struct Trace {
    keys: Vec<u64>,
    max_keys: usize,
    truncated: bool,
}

/// What the estimator of one shard is asked.
#[derive(Debug)]
pub enum MrcOp {
    /// Drain the shard's samples into its estimator.
    Drain,
    /// Drain, then the curve at the shard's capacity.
    Curve,
    /// Start collecting sampled keys (at most `max_keys`; an earlier trace
    /// is dropped).
    TraceStart {
        /// The bound.
        max_keys: usize,
    },
    /// Drain, then hand over the trace collected since `TraceStart`.
    TraceTake,
}

/// One shard's curve.
#[derive(Debug, Clone)]
pub struct ShardCurve {
    /// At the shard's capacity.
    pub curve: Curve,
    /// The estimator's memory, bytes.
    pub memory: u64,
}

/// One shard's trace.
#[derive(Debug, Clone, Default)]
pub struct ShardTrace {
    /// Sampled keys, in access order.
    pub keys: Vec<u64>,
    /// The rate they were sampled at (the lowest over the trace).
    pub rate: f64,
    /// Whether keys were left out past the bound.
    pub truncated: bool,
}

/// What the estimator answers.
#[derive(Debug)]
pub enum MrcResult {
    /// Nothing (drain, trace start, or the curves are off).
    Unit,
    /// A curve.
    Curve(Box<ShardCurve>),
    /// A trace.
    Trace(ShardTrace),
}

impl ShardMrc {
    /// An estimator for `shard`, whose sampler it sets.
    pub fn open(shard: &dyn Shard, cfg: MrcConfig) -> Arc<ShardMrc> {
        let mrc = Mrc::new(cfg);
        shard.set_sampler(Some(mrc.sampler()));
        Arc::new(ShardMrc { inner: Mutex::new(Inner { mrc, buf: Vec::new(), trace: None }) })
    }

    /// Moves the shard's samples into the estimator (and the trace), then
    /// sets the shard's sampler to the estimator's current filter.
    fn drain(&self, shard: &dyn Shard) {
        let mut g = self.inner.lock();
        let Inner { mrc, buf, trace } = &mut *g;
        buf.clear();
        let before = mrc.sampler();
        let d = shard.drain_samples(buf);
        // Keys the buffer dropped were a stretch of the stream the sample
        // misses: count only the accesses the kept keys stand for, or the
        // estimator would take the gap for hits of hot keys.
        let seen = d.sampled + d.dropped;
        let accesses = if d.dropped == 0 || seen == 0 {
            d.accesses
        } else {
            (d.accesses as u128 * d.sampled as u128 / seen as u128) as u64
        };
        mrc.observe_sampled(buf, accesses);
        let sampler = mrc.sampler();
        if let Some(t) = trace {
            for &k in buf.iter().filter(|&&k| sampler.sampled(k)) {
                if t.keys.len() == t.max_keys {
                    t.truncated = true;
                    break;
                }
                t.keys.push(k);
            }
        }
        // The rate only drops, when the tracked keys overflow the budget.
        if sampler != before {
            shard.set_sampler(Some(sampler));
        }
    }

    /// Runs `op` on this shard's estimator.
    pub fn execute(&self, shard: &dyn Shard, op: MrcOp) -> MrcResult {
        match op {
            MrcOp::Drain => {
                self.drain(shard);
                MrcResult::Unit
            }
            MrcOp::Curve => {
                self.drain(shard);
                let g = self.inner.lock();
                let memory = g.mrc.memory_bytes() as u64;
                MrcResult::Curve(Box::new(ShardCurve { curve: g.mrc.curve(shard.capacity()), memory }))
            }
            MrcOp::TraceStart { max_keys } => {
                self.drain(shard);
                self.inner.lock().trace = Some(Trace { keys: Vec::new(), max_keys, truncated: false });
                MrcResult::Unit
            }
            MrcOp::TraceTake => {
                self.drain(shard);
                let mut g = self.inner.lock();
                let rate = g.mrc.rate();
                let t = g.trace.take().unwrap_or(Trace { keys: vec![], max_keys: 0, truncated: false });
                // Keys sampled at a higher rate early on are filtered again
                // at the last one, so the whole trace is one spatial sample.
                let sampler = g.mrc.sampler();
                let keys = t.keys.into_iter().filter(|&k| sampler.sampled(k)).collect();
                MrcResult::Trace(ShardTrace { keys, rate, truncated: t.truncated })
            }
        }
    }
}

/// A table's curve from its shards' (see the module docs): per factor, the
/// access-weighted mean of the shards' hit rates at that factor of their
/// capacities; capacities summed.
pub fn combine(shards: &[ShardCurve], measured_hit_rate: Option<f64>) -> hkv_proto::stats::MrcStats {
    let accesses: u64 = shards.iter().map(|s| s.curve.accesses).sum();
    let n = hkv_shard::mrc::FACTORS.len();
    let points = (0..n)
        .map(|i| {
            let factor = hkv_shard::mrc::FACTORS[i];
            let capacity = shards.iter().filter_map(|s| s.curve.points.get(i)).map(|p| p.capacity).sum();
            let hit_rate = if accesses == 0 {
                0.0
            } else {
                shards
                    .iter()
                    .filter_map(|s| s.curve.points.get(i).map(|p| p.hit_rate * s.curve.accesses as f64))
                    .sum::<f64>()
                    / accesses as f64
            };
            hkv_proto::stats::MrcPoint { factor, capacity, hit_rate }
        })
        .collect();
    let rate = if accesses == 0 {
        shards.iter().map(|s| s.curve.rate).fold(1.0, f64::min)
    } else {
        shards.iter().map(|s| s.curve.rate * s.curve.accesses as f64).sum::<f64>() / accesses as f64
    };
    hkv_proto::stats::MrcStats {
        points,
        measured_hit_rate,
        accesses,
        sampled_accesses: shards.iter().map(|s| s.curve.sampled_accesses).sum(),
        tracked_keys: shards.iter().map(|s| s.curve.tracked_keys).sum(),
        rate,
        memory_bytes: shards.iter().map(|s| s.memory).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hkv_shard::mrc::MrcPoint;

    fn shard(accesses: u64, capacity: u64, hit: f64) -> ShardCurve {
        let points = hkv_shard::mrc::FACTORS
            .iter()
            .map(|&factor| MrcPoint {
                factor,
                capacity: (capacity as f64 * factor) as u64,
                hit_rate: hit * factor.min(1.0),
            })
            .collect();
        ShardCurve {
            curve: Curve { points, accesses, sampled_accesses: accesses / 10, tracked_keys: 100, rate: 0.1 },
            memory: 1000,
        }
    }

    #[test]
    fn the_table_curve_weighs_shards_by_their_accesses() {
        let m = combine(&[shard(300, 800, 0.9), shard(100, 800, 0.5)], Some(0.8));
        let one = m.points.iter().find(|p| p.factor == 1.0).unwrap();
        assert_eq!(one.capacity, 1600);
        assert!((one.hit_rate - 0.8).abs() < 1e-12, "{}", one.hit_rate);
        assert_eq!((m.accesses, m.sampled_accesses, m.tracked_keys, m.memory_bytes), (400, 40, 200, 2000));
        assert_eq!(m.measured_hit_rate, Some(0.8));
        let empty = combine(&[shard(0, 8, 0.0)], None);
        assert!(empty.points.iter().all(|p| p.hit_rate == 0.0));
    }
}
