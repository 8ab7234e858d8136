//! The order of a backed table's cache changes (issue 34): a read-through
//! fill never puts a row in the cache that a write it raced replaced.
//!
//! The bug this fixes: a fill of key k fetched k from the cluster, a
//! write of k (or an erase) then updated the cluster and the cache, and
//! the fill's insert landed after that, so the cache kept the old row
//! (or a row of an erased key) while the cluster held the new one.
//!
//! Every change of a table's cache goes through one [`Order`] (one lock
//! per table):
//! - A **write** of keys K (insert_or_assign, assign, accum_or_assign,
//!   apply_gradients, find_or_insert's new rows, erase, the erase of keys
//!   other hosts wrote; clear and erase_if for every key), in one section
//!   under the lock, adds one to `begun` and to `running` of each key's
//!   group, registers itself as work on K and takes the work already
//!   registered on any key of K; it waits for that work to end, then
//!   updates the cluster, then the cache; then, under the lock, takes one
//!   off `running` and ends its work ([`Hold`] dropped).
//! - A **fill** of the missed keys M, under the lock before its fetch
//!   begins, notes `begun` of each key's group ([`Snapshot`]; "none" where
//!   a write of the group is running); after the fetch, in one section
//!   under the lock ([`Order::admit`]), keeps a fetched row only where its
//!   group's `begun` is the noted one, and registers the insert of the
//!   kept rows as work on their keys; it inserts them and ends the work.
//!
//! Why a kept row is never older in the cache than a write of its key:
//! take a fill F of k noted at time S, admitted at A (S < fetch < A), and
//! a write W of k whose section under the lock is at B.
//! - B < S, W still running at S: F noted "none", k is dropped.
//! - B < S, W ended before S: W's cluster update was acknowledged before
//!   S, so the fetch saw it (or a later one).
//! - S < B < A: `begun` of k's group moved, k is dropped.
//! - A < B: F's insert is registered at B (or already done), W waits for
//!   it, so W's cache update lands after F's insert.
//!
//! A write by another host reaches this one as an invalidation of k
//! (`consume`), sent once the cluster had the row; its erase is a write
//! of this order, so the same cases hold with W = that erase. Two writes
//! of one key run one after the other (the later waits for the earlier),
//! so cluster and cache get them in the same order. Nothing waits for
//! work registered after it, so nothing waits in a circle. Keys that
//! share a group only drop more rows than needed: such a key is fetched
//! again at its next read.
//!
//! The cost: a fill reads and compares one counter per missed key, a
//! write bumps one per key, each under the table's lock; a fill never
//! waits for a write and a write never waits for a fetch (only for
//! inserts already admitted and earlier writes of its keys).

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{OwnedRwLockWriteGuard, RwLock};

/// Groups of keys whose writes are counted together: 4096 × 12 bytes per
/// backed table; two keys share a group (and a dropped fill) with
/// probability 1/4096.
const GROUPS: usize = 4096;

/// A snapshot value no group reaches: a write of the group was running.
const RUNNING: u64 = u64::MAX;

fn group(k: u64) -> usize {
    (hkv_backing::layout::mix(k) >> (64 - GROUPS.trailing_zeros())) as usize
}

/// One table's cache changes in flight and its groups' write counts.
pub(super) struct Order {
    work: Vec<Arc<Work>>,
    begun: Box<[u64]>,
    running: Box<[u32]>,
}

/// One piece of work on the cache: its keys (`None`: every key),
/// whether it is a write (counted in `running`), and a lock its owner holds
/// until it ends.
pub(super) struct Work {
    keys: Option<Keys>,
    write: bool,
    done: Arc<RwLock<()>>,
}

/// A piece of work's keys as an open-addressed set (at most half full):
/// a request's settle asks each piece of work in flight whether it
/// touches any of the request's keys, one probe per key, and the set is
/// built in one pass (a sorted vector and a binary search per key of the
/// next request cost ~0.3 ms of a cold find's critical path at 8192 keys).
struct Keys {
    slots: Box<[u64]>,
    /// Whether `u64::MAX`, the empty slot's mark, is one of the keys.
    max: bool,
}

impl Keys {
    fn new(keys: &[u64]) -> Keys {
        let mut slots = vec![u64::MAX; (2 * keys.len()).next_power_of_two().max(2)].into_boxed_slice();
        let mut max = false;
        for &k in keys {
            if k == u64::MAX {
                max = true;
                continue;
            }
            let mut i = Keys::home(k, slots.len());
            while slots[i] != u64::MAX && slots[i] != k {
                i = (i + 1) & (slots.len() - 1);
            }
            slots[i] = k;
        }
        Keys { slots, max }
    }

    #[inline]
    fn home(k: u64, len: usize) -> usize {
        hkv_backing::layout::mix(k) as usize & (len - 1)
    }

    fn has(&self, k: u64) -> bool {
        if k == u64::MAX {
            return self.max;
        }
        let mut i = Keys::home(k, self.slots.len());
        loop {
            match self.slots[i] {
                s if s == k => return true,
                u64::MAX => return false,
                _ => i = (i + 1) & (self.slots.len() - 1),
            }
        }
    }

    /// Each key once, in no particular order.
    fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots.iter().copied().filter(|&k| k != u64::MAX).chain(self.max.then_some(u64::MAX))
    }
}

impl Work {
    fn touches(&self, keys: Option<&[u64]>) -> bool {
        match (&self.keys, keys) {
            (Some(mine), Some(ks)) => ks.iter().any(|&k| mine.has(k)),
            _ => true,
        }
    }
}

/// What a fill saw before its fetch: per missed key, `begun` of its group
/// or [`RUNNING`].
pub(super) struct Snapshot(Vec<u64>);

impl Snapshot {
    /// The note of the keys at `idx` of those noted.
    pub(super) fn select(&self, idx: &[usize]) -> Snapshot {
        Snapshot(idx.iter().map(|&i| self.0[i]).collect())
    }
}

/// Registered work; dropping it ends the work (under the lock) and then
/// wakes whoever waits for it.
pub(super) struct Hold {
    order: Arc<Mutex<Order>>,
    work: Arc<Work>,
    _done: OwnedRwLockWriteGuard<()>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.order.lock().end(&self.work);
    }
}

/// A lock to wait on: the end of one piece of work.
pub(super) type Wait = Arc<RwLock<()>>;

/// Waits until each piece of work ended.
pub(super) async fn wait_all(waits: Vec<Wait>) {
    for w in waits {
        drop(w.read().await);
    }
}

impl Order {
    pub(super) fn new() -> Arc<Mutex<Order>> {
        Arc::new(Mutex::new(Order { work: Vec::new(), begun: vec![0; GROUPS].into(), running: vec![0; GROUPS].into() }))
    }

    /// The work registered now that touches any of `keys` (all of it for `None`).
    pub(super) fn waits(&self, keys: Option<&[u64]>) -> Vec<Wait> {
        self.work.iter().filter(|w| w.touches(keys)).map(|w| w.done.clone()).collect()
    }

    /// A fill's note before its fetch of `keys`.
    pub(super) fn snapshot(&self, keys: &[u64]) -> Snapshot {
        Snapshot(
            keys.iter()
                .map(|&k| {
                    let g = group(k);
                    if self.running[g] > 0 {
                        RUNNING
                    } else {
                        self.begun[g]
                    }
                })
                .collect(),
        )
    }

    /// Registers work on `keys` (`None`: every key) and returns it with the
    /// work registered before that touches them. A write first counts
    /// itself in its keys' groups.
    pub(super) fn register(this: &Arc<Mutex<Order>>, keys: Option<Vec<u64>>, write: bool) -> (Hold, Vec<Wait>) {
        let set = keys.as_deref().map(Keys::new);
        let mut o = this.lock();
        if write {
            o.count(set.as_ref(), true);
        }
        let waits = o.waits(keys.as_deref());
        let done = Arc::new(RwLock::new(()));
        let guard = done.clone().try_write_owned().expect("a new lock is free");
        let work = Arc::new(Work { keys: set, write, done });
        o.work.push(work.clone());
        (Hold { order: this.clone(), work, _done: guard }, waits)
    }

    /// A fill's rows after its fetch: of `filled` (indices into `keys`,
    /// the keys `snap` was taken of), keeps those whose group saw no write
    /// begin since `snap` and none running then, and registers their
    /// insert, in one section under the lock.
    ///
    /// The insert is registered on all of `filled`'s keys, kept or not
    /// (their set made before the lock is taken): a dropped key only makes
    /// a later request of it wait for an insert that leaves it out.
    pub(super) fn admit(this: &Arc<Mutex<Order>>, keys: &[u64], snap: &Snapshot, filled: &mut Vec<usize>) -> Hold {
        let kept = Keys::new(&filled.iter().map(|&j| keys[j]).collect::<Vec<_>>());
        let mut o = this.lock();
        filled.retain(|&j| o.begun[group(keys[j])] == snap.0[j]);
        let done = Arc::new(RwLock::new(()));
        let guard = done.clone().try_write_owned().expect("a new lock is free");
        let work = Arc::new(Work { keys: Some(kept), write: false, done });
        o.work.push(work.clone());
        Hold { order: this.clone(), work, _done: guard }
    }

    fn count(&mut self, keys: Option<&Keys>, up: bool) {
        let mut bump = |g: usize| {
            if up {
                self.begun[g] += 1;
                self.running[g] += 1;
            } else {
                self.running[g] -= 1;
            }
        };
        match keys {
            Some(ks) => ks.iter().for_each(|k| bump(group(k))),
            None => (0..GROUPS).for_each(bump),
        }
    }

    fn end(&mut self, work: &Arc<Work>) {
        if work.write {
            self.count(work.keys.as_ref(), false);
        }
        self.work.retain(|w| !Arc::ptr_eq(w, work));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(o: &Arc<Mutex<Order>>, keys: &[u64]) -> Snapshot {
        o.lock().snapshot(keys)
    }

    /// The four cases of the module's argument, one key each.
    #[test]
    fn a_fill_keeps_only_rows_no_write_raced() {
        let o = Order::new();
        let keys = [1u64, 2, 3, 4];
        // Key 1: a write running when the fill noted it.
        let (w1, _) = Order::register(&o, Some(vec![1]), true);
        // Key 4: a write that ended before the note.
        drop(Order::register(&o, Some(vec![4]), true).0);
        let snap = fill(&o, &keys);
        drop(w1);
        // Key 2: a write begun between the note and the admission.
        let (w2, waits) = Order::register(&o, Some(vec![2]), true);
        assert!(waits.is_empty());
        let mut filled = vec![0, 1, 2, 3];
        let ins = Order::admit(&o, &keys, &snap, &mut filled);
        assert_eq!(filled, vec![2, 3], "keys 3 and 4 kept");
        // Key 3: a write after the admission waits for the insert.
        let (_w3, waits) = Order::register(&o, Some(vec![3, 9]), true);
        assert_eq!(waits.len(), 1);
        assert!(waits[0].try_read().is_err(), "the insert is running");
        drop(ins);
        assert!(waits[0].try_read().is_ok(), "and wakes the write when done");
        drop(w2);
    }

    /// A write of every key (clear) drops every fill noted before it ends,
    /// waits for all work, and counts down to nothing.
    #[test]
    fn a_write_of_every_key_waits_for_all_and_drops_all() {
        let o = Order::new();
        let (other, _) = Order::register(&o, Some(vec![7]), false);
        let (all, waits) = Order::register(&o, None, true);
        assert_eq!(waits.len(), 1);
        let snap = fill(&o, &[5, 6]);
        drop(all);
        let mut filled = vec![0, 1];
        drop(Order::admit(&o, &[5, 6], &snap, &mut filled));
        assert!(filled.is_empty());
        drop(other);
        let g = o.lock();
        assert!(g.running.iter().all(|&r| r == 0) && g.work.is_empty());
    }

    /// The key set answers exactly, whatever the keys: colliding homes,
    /// repeats, the empty slot's mark `u64::MAX`, none at all.
    #[test]
    fn a_work_key_set_holds_its_keys_and_no_other() {
        let keys: Vec<u64> = (0..3000u64).map(|i| i * 7919).chain([u64::MAX, 0, 7919, u64::MAX - 1]).collect();
        let set = Keys::new(&keys);
        assert!(keys.iter().all(|&k| set.has(k)));
        assert!((0..3000u64).map(|i| i * 7919 + 1).all(|k| !set.has(k)));
        let mut all: Vec<u64> = set.iter().collect();
        all.sort_unstable();
        let mut want = keys.clone();
        want.sort_unstable();
        want.dedup();
        assert_eq!(all, want);
        let none = Keys::new(&[]);
        assert!(!none.has(0) && !none.has(u64::MAX) && none.iter().next().is_none());
        let max_only = Keys::new(&[u64::MAX]);
        assert!(max_only.has(u64::MAX) && !max_only.has(1));
    }

    /// Two writes of one key: the second waits for the first.
    #[test]
    fn writes_of_one_key_run_in_turn() {
        let o = Order::new();
        let (first, _) = Order::register(&o, Some(vec![3, 1]), true);
        let (_second, waits) = Order::register(&o, Some(vec![2, 3]), true);
        assert_eq!(waits.len(), 1);
        let (_third, waits) = Order::register(&o, Some(vec![4]), true);
        assert!(waits.is_empty(), "other keys do not wait");
        drop(first);
    }
}
