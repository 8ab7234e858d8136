//! Growth: doubling the buckets and re-inserting every entry.

use std::sync::atomic::Ordering::Relaxed;

use super::batch::Scoring;
use super::storage::Storage;
use super::{CpuTable, S};
use crate::error::{Error, Result};
use crate::Summary;

impl CpuTable {
    /// Doubles the buckets while `incoming` more keys would pass the max load
    /// factor and the max capacity allows. Caller holds the inserter group.
    pub(super) fn grow_for(&self, incoming: usize) {
        let max_buckets = self.config.max_buckets();
        loop {
            let nb = self.storage.read().nbuckets();
            let cap = (nb * S as u64) as f64;
            let want = (self.size.load(Relaxed) + incoming as u64) as f64;
            if want <= self.config.max_load_factor * cap || nb * 2 > max_buckets {
                return;
            }
            // Without memory for the larger storage the table stays as it
            // is and keeps working as a cache: inserts evict instead.
            if self.rehash(nb * 2).is_err() {
                return;
            }
        }
    }

    /// Rebuilds the table with `nbuckets` buckets: entries are re-inserted in
    /// descending score order (key order on ties), so that if two-choice
    /// placement ever overflows, the lowest scores are the ones that go. In
    /// single mode doubling never overflows: `(h mod 2B) mod B = h mod B`, so
    /// bucket b's entries move to b or b + B only.
    pub(super) fn rehash(&self, nbuckets: u64) -> Result<()> {
        self.rehash_with(nbuckets, None)
    }

    /// The bucket count a reserve of `capacity` slots grows to (doubling
    /// up to the config's maximum), or `None` when the table has enough.
    pub(super) fn reserve_target(&self, capacity: u64) -> Option<u64> {
        let now = self.storage.read().nbuckets();
        let mut nb = now;
        // Bounded: doubles up to max_buckets.
        while nb * (S as u64) < capacity && nb * 2 <= self.config.max_buckets() {
            nb *= 2;
        }
        (nb > now).then_some(nb)
    }

    /// Allocates what a rehash to `nbuckets` needs (the storage, and an
    /// entry list long enough for every slot before it), without changing
    /// the table.
    pub(super) fn prepare(&self, nbuckets: u64) -> Result<Prepared> {
        let storage = Storage::new(nbuckets, self.config.dim)?;
        let mut entries = Vec::new();
        let slots = usize::try_from(nbuckets * S as u64).unwrap_or(usize::MAX);
        entries
            .try_reserve_exact(slots)
            .map_err(|_| Error::OutOfMemory("the entry list of a table's growth".into()))?;
        Ok(Prepared { nbuckets, storage, entries })
    }

    /// [`CpuTable::rehash`] into what `prepared` allocated (when it is for
    /// `nbuckets`): then it allocates nothing and cannot fail, since the
    /// table holds at most as many entries as it has slots, fewer than
    /// `nbuckets` give.
    pub(super) fn rehash_with(&self, nbuckets: u64, prepared: Option<Prepared>) -> Result<()> {
        let mut st = self.storage.write();
        let (new, mut entries) = match prepared.filter(|p| p.nbuckets == nbuckets) {
            Some(p) => (p.storage, p.entries),
            None => (Storage::new(nbuckets, self.config.dim)?, Vec::new()),
        };
        entries.clear();
        entries
            .try_reserve_exact(self.size.load(Relaxed) as usize)
            .map_err(|_| Error::OutOfMemory("the entry list of a table's growth".into()))?;
        for (b, bk) in st.buckets.iter().enumerate() {
            bk.each(|s| entries.push((bk.score(s), bk.key(s), b, s)));
        }
        entries.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let scorer = self.scorer();
        let mut summary = Summary::default();
        let mut row = vec![0.0; self.config.dim];
        for &(score, key, b, s) in &entries {
            st.read_row(b, s, &mut row);
            summary.add(self.upsert(&new, key, &row, Some(score), Scoring::Verbatim, &scorer, None, |_, _| {}));
        }
        // A two-choice overflow loses entries (an eviction swaps one for
        // another, a rejection drops the newcomer): size is what was placed.
        self.size.store(summary.inserted, Relaxed);
        self.counters.evictions.fetch_add(summary.evicted + summary.rejected, Relaxed);
        *st = new;
        Ok(())
    }
}

/// What a reserve allocated before growing ([`CpuTable::prepare`]).
pub(super) struct Prepared {
    nbuckets: u64,
    storage: Storage,
    entries: Vec<(u64, u64, usize, usize)>,
}
