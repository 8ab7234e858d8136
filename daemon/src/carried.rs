//! Counters carried across live restores: a restore installs new shards
//! whose counters start at 0, and an operator's tester saw
//! `hkvd_hits_total` go 6 → 0, which Prometheus reads as a counter reset
//! (rates jump). The totals carry on instead: the new shards' counts are
//! added to what was reported before, and no counter is ever reported
//! below its last value. Held by [`crate::state::ServerStats`], used by
//! [`crate::stats`].

use std::collections::HashMap;

use hkv_proto::stats::{MrcStats, ShardStats};

/// Applies `f` to each counter of `s` and the same counter of `other`
/// (the gauges, sizes and lock state now, stay `s`'s).
fn each_counter(s: &mut ShardStats, other: &ShardStats, f: fn(u64, u64) -> u64) {
    for (a, &b) in [
        (&mut s.hits, &other.hits),
        (&mut s.misses, &other.misses),
        (&mut s.inserts, &other.inserts),
        (&mut s.evictions, &other.evictions),
        (&mut s.rejections, &other.rejections),
        (&mut s.lock.violations, &other.lock.violations),
    ] {
        *a = f(*a, b);
    }
    for (a, b) in s.ops.iter_mut().zip(&other.ops).chain(s.keys.iter_mut().zip(&other.keys)) {
        *a = f(*a, *b);
    }
    for (a, b) in s.lock.waits.iter_mut().zip(other.lock.waits).chain(s.lock.wait_ns.iter_mut().zip(other.lock.wait_ns))
    {
        *a = f(*a, b);
    }
}

/// The miss-ratio curve's counters, in [`Reported::curve_base`]'s order.
fn curve_counters(m: &mut MrcStats) -> [&mut u64; 3] {
    [&mut m.accesses, &mut m.dropped, &mut m.dropped_lookups]
}

/// What the stats last reported of one table.
struct Reported {
    /// The shards' table id (a restore's new shards have another).
    id: u64,
    /// Per shard: the totals of the table's earlier shards.
    base: Vec<ShardStats>,
    /// Per shard: the counters last reported.
    last: Vec<ShardStats>,
    /// The curve's counters (`accesses`, `dropped`, `dropped_lookups`):
    /// the totals of the table's earlier shards, and as last reported.
    curve_base: [u64; 3],
    curve_last: [u64; 3],
}

/// Every table's counters as last reported, by the table's
/// [`crate::router::Table::made`] (which a restore keeps while it installs
/// new shards). Table ids are unique within the process.
#[derive(Default)]
pub struct Carried(parking_lot::Mutex<HashMap<u64, Reported>>);

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Carried({} tables)", self.0.lock().len())
    }
}

impl Carried {
    /// Carries the counters of `shards` (and of `mrc`, the table's curve)
    /// of the table made as `made`, whose shards have the id `id` now.
    pub fn carry(&self, made: u64, id: u64, shards: &mut [ShardStats], mrc: Option<&mut MrcStats>) {
        let mut all = self.0.lock();
        let r = all.entry(made).or_insert_with(|| Reported {
            id,
            base: vec![],
            last: vec![],
            curve_base: [0; 3],
            curve_last: [0; 3],
        });
        if r.id != id {
            r.base = std::mem::take(&mut r.last);
            r.curve_base = r.curve_last;
            r.id = id;
        }
        for (i, s) in shards.iter_mut().enumerate() {
            if let Some(b) = r.base.get(i) {
                each_counter(s, b, u64::saturating_add);
            }
            if let Some(l) = r.last.get(i) {
                each_counter(s, l, u64::max);
            }
        }
        r.last = shards.to_vec();
        if let Some(m) = mrc {
            for (i, c) in curve_counters(m).into_iter().enumerate() {
                *c = c.saturating_add(r.curve_base[i]).max(r.curve_last[i]);
                r.curve_last[i] = *c;
            }
        }
    }

    /// Forgets the tables not `made` (dropped).
    pub fn retain(&self, made: &[u64]) {
        self.0.lock().retain(|m, _| made.contains(m));
    }
}
