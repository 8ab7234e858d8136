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
//! While a trace is being taken ([`ShardMrc::trace_start`]), each drain also
//! appends the sampled keys (after the estimator's current filter) to the
//! shard's trace, up to a bound; [`ShardMrc::trace_take`] hands them over with
//! the rate they were sampled at.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use hkv_shard::mrc::{Curve, Mrc, MrcConfig, Sampler, Samples};
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

impl Drop for ShardMrc {
    fn drop(&mut self) {
        HELD.fetch_sub(self.inner.get_mut().mrc.memory_bytes() as u64, SeqCst);
    }
}

struct Inner {
    mrc: Mrc,
    buf: Samples,
    trace: Option<Trace>,
}

struct Trace {
    keys: Vec<u64>,
    max_keys: usize,
    truncated: bool,
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
#[derive(Debug, Clone)]
pub struct ShardTrace {
    /// Sampled keys, in access order.
    pub keys: Vec<u64>,
    /// The filter they all pass (the lowest rate over the trace).
    pub sampler: Sampler,
    /// Whether keys were left out past the bound.
    pub truncated: bool,
}

/// Bytes all open estimators hold ([`Mrc::memory_bytes`], reserved when
/// one opens), process-wide: the share they may take is of the process's
/// memory, not of one table's.
static HELD: AtomicU64 = AtomicU64::new(0);

/// The most bytes all tables' estimators may hold together: 1/16 of host
/// memory (RAM, or the cgroup's limit) or of the address-space limit,
/// whichever is lower. Each estimator reserves its whole `max_keys` × 120
/// bytes when it opens, whatever the table's size, and outside the table
/// budget: an operator's tester gave `--mrc-max-keys 1048576` and made
/// tables of 256 slots; the 43rd exhausted the address space (an
/// infallible allocation, so an abort), while `hkvd_table_granted_bytes`
/// said 57 600 bytes.
pub fn share() -> u64 {
    let space = crate::memory::AddressSpace::of_process().limit().unwrap_or(u64::MAX);
    crate::budget::host_memory().min(space) / 16
}

/// The keys an estimator asked for `want` keys may track beside `held`
/// bytes of others within `share` bytes: all of them while they fit, else
/// what is left, never below `MIN_SHARD_KEYS` (256 keys, 30 KiB: every
/// table keeps a rough curve).
fn keys_within(want: usize, held: u64, share: u64) -> usize {
    let left = share.saturating_sub(held) / Mrc::BYTES_PER_KEY as u64;
    want.min(usize::try_from(left).unwrap_or(usize::MAX)).max(MIN_SHARD_KEYS.min(want))
}

/// The fewest keys an estimator opened past the share tracks
/// (`MrcSettings::MIN_SHARD_KEYS`, the least a shard gets anyway).
const MIN_SHARD_KEYS: usize = 256;

impl ShardMrc {
    /// An estimator for `shard`, whose sampler it sets. It tracks
    /// `cfg.max_keys` keys, or fewer where all estimators would hold more
    /// than their [`share`] of memory (its stats' `memory_bytes` says).
    pub fn open(shard: &dyn Shard, cfg: MrcConfig, table: &str, index: usize) -> Arc<ShardMrc> {
        let share = share();
        let mut keys = 0;
        let _ = HELD.fetch_update(SeqCst, SeqCst, |held| {
            // At least 1: what `Mrc::new` tracks and `Drop` gives back.
            keys = keys_within(cfg.max_keys, held, share).max(1);
            Some(held + (keys * Mrc::BYTES_PER_KEY) as u64)
        });
        if keys < cfg.max_keys {
            tracing::warn!(
                table,
                shard = index,
                wanted = cfg.max_keys,
                keys,
                share,
                "the curves' estimators hold their share of memory (1/16 of host memory or the address-space \
                 limit): this table's curve on this shard tracks fewer keys, so its estimate is coarser; lower \
                 --mrc-max-keys or drop tables"
            );
        }
        let mrc = Mrc::new(MrcConfig { max_keys: keys, ..cfg }, shard.capacity());
        shard.set_sampler(Some(mrc.sampler()));
        Arc::new(ShardMrc { inner: Mutex::new(Inner { mrc, buf: Samples::default(), trace: None }) })
    }

    /// Moves the shard's samples into the estimator (and the trace), then
    /// sets the shard's sampler to the estimator's current filter.
    pub fn drain(&self, shard: &dyn Shard) {
        let mut g = self.inner.lock();
        let Inner { mrc, buf, trace } = &mut *g;
        buf.clear();
        let before = mrc.sampler();
        let d = shard.drain_samples(buf);
        mrc.set_capacity(shard.capacity());
        // Keys a full buffer dropped (the CUDA ring at GPU rates; the CPU
        // buffer lowers its rate instead) are a stretch of the stream the
        // sample misses: count only the lookups the kept keys stand for, or
        // the estimator would take the gap for hits of hot keys; and show
        // the count beside the curve.
        let seen = d.sampled + d.dropped;
        let accesses = if d.dropped == 0 || seen == 0 {
            d.accesses
        } else {
            (d.accesses as u128 * d.sampled as u128 / seen as u128) as u64
        };
        mrc.observe_samples(buf, accesses, d.threshold);
        mrc.add_dropped(d.dropped, d.accesses - accesses);
        let sampler = mrc.sampler();
        if let Some(t) = trace {
            for k in buf.lookups().filter(|&k| sampler.sampled(k)) {
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

    /// Drains, then the curve at the shard's capacity.
    pub fn curve(&self, shard: &dyn Shard) -> ShardCurve {
        self.drain(shard);
        let g = self.inner.lock();
        ShardCurve { curve: g.mrc.curve(), memory: g.mrc.memory_bytes() as u64 }
    }

    /// Drains, then starts collecting sampled keys (at most `max_keys`;
    /// an earlier trace is dropped).
    pub fn trace_start(&self, shard: &dyn Shard, max_keys: usize) {
        self.drain(shard);
        self.inner.lock().trace = Some(Trace { keys: Vec::new(), max_keys, truncated: false });
    }

    /// Drains, then hands over the trace collected since [`ShardMrc::trace_start`].
    pub fn trace_take(&self, shard: &dyn Shard) -> ShardTrace {
        self.drain(shard);
        let mut g = self.inner.lock();
        let t = g.trace.take().unwrap_or(Trace { keys: vec![], max_keys: 0, truncated: false });
        // Keys sampled at a higher rate early on are filtered again
        // at the last one, so the whole trace is one spatial sample.
        let sampler = g.mrc.sampler();
        let keys = t.keys.into_iter().filter(|&k| sampler.sampled(k)).collect();
        ShardTrace { keys, sampler, truncated: t.truncated }
    }
}

/// A table's trace from its shards': every key filtered at the lowest
/// rate of any shard (one spatial sample of the table), and the shards'
/// streams merged in proportion (key `j` of a shard holding `n` goes at
/// `j / n` of the trace). Shards see a hash-partitioned share of the same
/// traffic at the same time, so that stands for the order the keys came in,
/// which the shards do not record. Returns the keys, the rate and whether
/// any shard left keys out past its bound.
pub fn merge_traces(traces: Vec<ShardTrace>) -> (Vec<u64>, f64, bool) {
    let Some(lowest) = traces.iter().map(|t| t.sampler).min_by_key(|s| s.threshold) else {
        return (vec![], 1.0, false);
    };
    let truncated = traces.iter().any(|t| t.truncated);
    let mut timed: Vec<(f64, u64)> = vec![];
    for t in &traces {
        let n = t.keys.len().max(1) as f64;
        timed.extend(t.keys.iter().enumerate().filter(|(_, &k)| lowest.sampled(k)).map(|(j, &k)| (j as f64 / n, k)));
    }
    // Stable: keys of one shard keep their order.
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    (timed.into_iter().map(|(_, k)| k).collect(), lowest.rate(), truncated)
}

/// The fewest sampled lookups a table's curve needs before it has points.
/// Below it an estimate is noise: one sampled miss of a new key reads as
/// 0 %, one hit as 100 % at every size (the same bar as `hkvctl mrc`'s).
pub const MIN_SAMPLED: u64 = 100;

/// Whether a curve of `sampled_accesses` sampled lookups is an estimate.
pub fn ready(sampled_accesses: u64) -> bool {
    sampled_accesses >= MIN_SAMPLED
}

/// A table's curve from its shards' (see the module docs): per factor, the
/// access-weighted mean of the shards' hit rates at that factor of their
/// capacities; capacities summed. No points while the shards have sampled
/// fewer than [`MIN_SAMPLED`] lookups in all: an operator's tester found
/// `stats` and `metrics` exporting 0 % at 1/8×–1/2× and 23 % at 1×–8× from
/// 4 lookups of a table that measured 75 %, while `hkvctl mrc` said the
/// estimate was not ready.
pub fn combine(shards: &[ShardCurve], measured_hit_rate: Option<f64>) -> hkv_proto::stats::MrcStats {
    let accesses: u64 = shards.iter().map(|s| s.curve.accesses).sum();
    let sampled_accesses = shards.iter().map(|s| s.curve.sampled_accesses).sum();
    let n = if ready(sampled_accesses) { hkv_shard::mrc::FACTORS.len() } else { 0 };
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
        sampled_accesses,
        tracked_keys: shards.iter().map(|s| s.curve.tracked_keys).sum(),
        dropped: shards.iter().map(|s| s.curve.dropped).sum(),
        dropped_lookups: shards.iter().map(|s| s.curve.dropped_lookups).sum(),
        rate,
        memory_bytes: shards.iter().map(|s| s.memory).sum(),
    }
}

/// The most keys a trace holds over all of a table's shards (128 MiB of
/// keys); the bytes a trace takes while it runs and is merged, counted
/// against the bytes in flight, are [`TRACE_PEAK_BYTES`].
pub const TRACE_MAX_KEYS: usize = 16 << 20;

/// The shards' keys, the merge's (position, key) pairs and the answer:
/// at most 3 × 8 bytes per key alive at once, plus the frame.
pub const TRACE_PEAK_BYTES: u64 = TRACE_MAX_KEYS as u64 * 8 * 4;

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
            curve: Curve {
                points,
                accesses,
                sampled_accesses: accesses / 10,
                tracked_keys: 100,
                rate: 0.1,
                dropped: 3,
                dropped_lookups: 30,
            },
            memory: 1000,
        }
    }

    #[test]
    fn estimators_past_their_share_track_fewer_keys() {
        let b = Mrc::BYTES_PER_KEY as u64;
        assert_eq!(keys_within(1000, 0, 10_000 * b), 1000, "all of them while they fit");
        assert_eq!(keys_within(1000, 9_500 * b, 10_000 * b), 500, "what is left");
        assert_eq!(keys_within(1000, 10_000 * b, 10_000 * b), MIN_SHARD_KEYS, "never below the floor");
        assert_eq!(keys_within(100, u64::MAX, 0), 100, "a smaller ask than the floor is kept");
    }

    #[test]
    fn the_table_curve_weighs_shards_by_their_accesses() {
        let m = combine(&[shard(3000, 800, 0.9), shard(1000, 800, 0.5)], Some(0.8));
        let one = m.points.iter().find(|p| p.factor == 1.0).unwrap();
        assert_eq!(one.capacity, 1600);
        assert!((one.hit_rate - 0.8).abs() < 1e-12, "{}", one.hit_rate);
        assert_eq!((m.accesses, m.sampled_accesses, m.tracked_keys, m.memory_bytes), (4000, 400, 200, 2000));
        assert_eq!((m.dropped, m.dropped_lookups), (6, 60), "the shards' dropped keys and lookups summed");
        assert_eq!(m.measured_hit_rate, Some(0.8));
        let empty = combine(&[shard(0, 8, 0.0)], None);
        assert!(empty.points.is_empty(), "no lookups, no estimate");
        // 99 sampled lookups (990 / 10) are noise: no points; 100 are a curve.
        assert!(combine(&[shard(990, 8, 0.5)], None).points.is_empty());
        assert_eq!(combine(&[shard(1000, 8, 0.5)], None).points.len(), hkv_shard::mrc::FACTORS.len());
    }
}
