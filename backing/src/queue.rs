//! The write-back queue: rows waiting for the cluster, bounded in bytes.
//!
//! A row is `pending` (queued) or `sending` (in a batch the flusher has
//! sent and the cluster has not yet acknowledged); both count against the
//! bound and both are visible to reads, so a read never sees the cluster's
//! older row while a newer one waits here. A row whose batch failed goes
//! back to `pending` unless a newer write of its key arrived meanwhile;
//! nothing leaves the queue except by the cluster's acknowledgement.
//! A row queued set-if-absent (`nx`, a find_or_insert's new row) is sent
//! so; any later write of its key queued before it is sent replaces it
//! with a plain write, and a row queued while its key is being sent is
//! plain too (it follows this host's own write or erasure of the key).
//! Bytes: a row costs its value and key once while pending and once more
//! while a newer write of its key waits behind the batch sending it.
//!
//! Pending keys sit in one FIFO of first-queued order per group of the
//! table's layout, so that the flusher takes a batch for one node from
//! that node's groups only ([`Queue::take_groups`]): a stalled node's rows
//! wait in its own groups while the other nodes' rows are sent (one FIFO
//! for the whole queue let a stalled node's rows hold up everyone's).
//!
//! Costs: taking a batch costs its own rows (not a scan of everything
//! queued); a row's
//! values are shared (`Arc`) between `pending`, `sending` and the batch, so
//! moving a row to a batch copies no floats; the maps hash a key with the
//! layout's `mix` instead of SipHash.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::error::Error;

/// One queued row.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub score: u64,
    pub values: Arc<[f32]>,
    pub since: Instant,
    /// Sent set-if-absent: written only where the cluster has no row.
    pub nx: bool,
}

/// Hashes a `u64` key with the SplitMix64 finaliser (keys only).
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        crate::layout::mix(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(*b) ^ (self.0 >> 56);
        }
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = k;
    }
}

type Map = HashMap<u64, Entry, BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Default)]
struct State {
    pending: Map,
    /// Every pending key once, in its group's FIFO, in first-queued order
    /// (the flusher's order).
    order: Vec<VecDeque<u64>>,
    /// The group a take of several groups starts at, moved on each take
    /// so that no group of a node waits behind the others for ever.
    start: usize,
    sending: Map,
    bytes: u64,
    closed: bool,
    /// Given up ([`Queue::discard`]): failed rows are not sent again.
    discarded: bool,
}

/// A key's group (its FIFO in the queue).
pub(crate) type GroupOf = Box<dyn Fn(u64) -> usize + Send + Sync>;

/// The queue and its wake-ups.
pub(crate) struct Queue {
    state: Mutex<State>,
    group_of: GroupOf,
    /// Bytes a row costs here: its cluster value and its key.
    entry_bytes: u64,
    pub limit: u64,
    pub wait: Duration,
    /// Woken when bytes are freed (writers waiting for room).
    room: Notify,
    /// Woken when rows are queued or a flush is asked (the flusher).
    pub work: Notify,
    /// Woken when the queue may have emptied (flushes).
    idle: Notify,
}

/// What the flusher took: keys and their rows.
pub(crate) type Batch = Vec<(u64, Entry)>;

impl Queue {
    /// A queue of rows of `row_bytes`, bounded to `limit` bytes, whose
    /// writers wait up to `wait` for room; `groups` FIFOs, a key's given
    /// by `group_of` (below `groups`).
    pub fn new(row_bytes: usize, limit: u64, wait: Duration, groups: usize, group_of: GroupOf) -> Queue {
        let state = State { order: vec![VecDeque::new(); groups.max(1)], ..State::default() };
        Queue {
            state: Mutex::new(state),
            group_of,
            entry_bytes: row_bytes as u64 + 8,
            limit,
            wait,
            room: Notify::new(),
            work: Notify::new(),
            idle: Notify::new(),
        }
    }

    /// Queues rows, all or none: waits up to `wait` for room for the
    /// whole write, then queues every row at once, or none (`QueueFull`)
    /// when the room did not come; a write that needs more than the whole
    /// bound is refused at once (`QueueTooSmall`). A key already pending
    /// is replaced in place (its bytes are counted once, and so are a key
    /// given twice). With `nx` the rows are to be sent set-if-absent,
    /// unless the key is already queued (then they are plain writes, see
    /// the module's docs).
    ///
    /// (It queued chunks of half the bound one after the other: a write
    /// that timed out on a later chunk was refused with its first chunks
    /// queued, and they reached the cluster, and reads, after the writer
    /// was told nothing was written.)
    pub async fn push(&self, keys: &[u64], values: &[f32], scores: &[u64], dim: usize, nx: bool) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let start = Instant::now();
        let distinct: std::collections::HashSet<u64, BuildHasherDefault<KeyHasher>> = keys.iter().copied().collect();
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            let need = {
                let mut s = self.state.lock();
                let need = distinct.iter().filter(|k| !s.pending.contains_key(k)).count() as u64 * self.entry_bytes;
                if need > self.limit {
                    return Err(Error::QueueTooSmall { batch_bytes: need, limit_bytes: self.limit });
                }
                if s.bytes + need <= self.limit {
                    let now = Instant::now();
                    s.pending.reserve(distinct.len());
                    for (i, &k) in keys.iter().enumerate() {
                        let score = scores.get(i).copied().unwrap_or(0);
                        let row: Arc<[f32]> = values[i * dim..(i + 1) * dim].into();
                        // A replaced row keeps its age and its place: the
                        // window is how long the oldest unsent write has
                        // waited.
                        match s.pending.get_mut(&k) {
                            Some(old) => {
                                old.score = score;
                                old.values = row;
                                old.nx = false;
                            }
                            None => {
                                let nx = nx && !s.sending.contains_key(&k);
                                s.pending.insert(k, Entry { score, values: row, since: now, nx });
                                s.order[(self.group_of)(k)].push_back(k);
                            }
                        }
                    }
                    s.bytes += need;
                    break;
                }
                need
            };
            self.work.notify_one();
            if tokio::time::timeout_at(deadline, room).await.is_err() {
                let s = self.state.lock();
                return Err(Error::QueueFull {
                    batch_bytes: need,
                    queued_bytes: s.bytes,
                    limit_bytes: self.limit,
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
        }
        self.work.notify_one();
        Ok(())
    }

    /// The newest queued row of each key (pending before sending), under
    /// one lock: `f(i, entry)` for each `keys[i]` queued.
    pub fn lookup_many(&self, keys: &[u64], mut f: impl FnMut(usize, &Entry)) {
        let s = self.state.lock();
        for (i, k) in keys.iter().enumerate() {
            if let Some(e) = s.pending.get(k).or_else(|| s.sending.get(k)) {
                f(i, e);
            }
        }
    }

    /// Whether nothing is queued (a cheap check before per-key lookups).
    pub fn is_empty(&self) -> bool {
        let s = self.state.lock();
        s.pending.is_empty() && s.sending.is_empty()
    }

    /// [`Queue::take_groups`] of every group.
    #[cfg(test)]
    pub fn take(&self, max: usize) -> Batch {
        let all: Vec<usize> = (0..self.state.lock().order.len()).collect();
        self.take_groups(&all, max)
    }

    /// Moves up to `max` pending rows of `groups` (one node's), each
    /// group's oldest first, to `sending`; the groups are taken in turn
    /// from one that moves on with each take. A key already being sent
    /// stays pending until its batch settles: a key is in one batch at a
    /// time, so its writes reach the cluster in order however many
    /// batches are in flight.
    pub fn take_groups(&self, groups: &[usize], max: usize) -> Batch {
        let mut guard = self.state.lock();
        let s = &mut *guard;
        let mut batch = Vec::new();
        if groups.is_empty() {
            return batch;
        }
        s.start = s.start.wrapping_add(1);
        let first = s.start % groups.len();
        for &g in groups[first..].iter().chain(&groups[..first]) {
            let Some(order) = s.order.get_mut(g) else { continue };
            // Keys passed over because a batch is sending them: at most
            // the rows in flight, put back in front in their order.
            let mut held = Vec::new();
            while batch.len() < max {
                let Some(k) = order.pop_front() else { break };
                if s.sending.contains_key(&k) {
                    held.push(k);
                    continue;
                }
                if let Some(e) = s.pending.remove(&k) {
                    s.sending.insert(k, e.clone());
                    batch.push((k, e));
                }
            }
            for k in held.into_iter().rev() {
                order.push_front(k);
            }
            if batch.len() >= max {
                break;
            }
        }
        batch
    }

    /// Settles a sent batch: acknowledged rows leave, failed rows return
    /// to `pending` unless a newer write of the key is pending.
    pub fn settle(&self, batch: Batch, failed: &[bool]) {
        let mut s = self.state.lock();
        // Failed rows go back in front (they are the oldest), in order.
        for ((k, e), failed) in batch.into_iter().zip(failed).rev() {
            s.sending.remove(&k);
            if *failed && !s.discarded && !s.pending.contains_key(&k) {
                s.pending.insert(k, e);
                s.order[(self.group_of)(k)].push_front(k);
            } else {
                s.bytes -= self.entry_bytes;
            }
        }
        drop(s);
        self.room.notify_waiters();
        self.idle.notify_waiters();
    }

    /// Rows and bytes queued, the age of the oldest.
    pub fn window(&self) -> (u64, u64, Duration) {
        let s = self.state.lock();
        // The front of each group's FIFO is its oldest pending row (rows
        // keep their place when replaced, failed ones go back in front);
        // `sending` holds at most the rows in flight.
        let fronts = s.order.iter().filter_map(|o| o.front().and_then(|k| s.pending.get(k)).map(|e| e.since));
        let oldest = s.sending.values().map(|e| e.since).chain(fronts).min();
        ((s.pending.len() + s.sending.len()) as u64, s.bytes, oldest.map(|t| t.elapsed()).unwrap_or_default())
    }

    /// Waits until the queue is empty or `timeout` passed.
    pub async fn drain(&self, timeout: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            let rows = {
                let s = self.state.lock();
                (s.pending.len() + s.sending.len()) as u64
            };
            if rows == 0 {
                return Ok(());
            }
            self.work.notify_one();
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return Err(Error::FlushTimeout { rows: self.window().0, nodes: String::new(), replicas_only: false });
            }
        }
    }

    /// Gives the queue up: its pending rows are dropped and a batch in
    /// flight that fails is not sent again, so that nothing of it can land
    /// in the cluster later (over a newer write of another table of the
    /// same name). Returns the rows dropped (not counting those in flight).
    pub fn discard(&self) -> u64 {
        let mut s = self.state.lock();
        let rows = s.pending.len() as u64;
        s.bytes -= rows * self.entry_bytes;
        s.pending.clear();
        s.order.iter_mut().for_each(VecDeque::clear);
        s.closed = true;
        s.discarded = true;
        drop(s);
        self.work.notify_one();
        self.room.notify_waiters();
        self.idle.notify_waiters();
        rows
    }

    /// Marks the queue closed: the flusher empties it and stops.
    pub fn close(&self) {
        self.state.lock().closed = true;
        self.work.notify_one();
    }

    pub fn closed(&self) -> bool {
        self.state.lock().closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(b: &Batch) -> Vec<u64> {
        b.iter().map(|(k, _)| *k).collect()
    }

    /// Batches come oldest first; a key being sent is held back (its newer
    /// write waits for the batch); a failed batch's rows come back in front
    /// unless a newer write of the key is pending; bytes return to zero.
    #[test]
    fn take_is_fifo_and_holds_keys_in_flight() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let q = Queue::new(8, 1 << 20, Duration::from_secs(1), 1, Box::new(|_| 0));
        rt.block_on(q.push(&[1, 2, 3, 4], &[1.0, 2.0, 3.0, 4.0], &[], 1, false)).unwrap();
        let a = q.take(2);
        assert_eq!(keys(&a), vec![1, 2]);
        // A newer write of key 1 while its batch is out; key 5 is new.
        rt.block_on(q.push(&[1, 5], &[10.0, 5.0], &[], 1, false)).unwrap();
        let b = q.take(10);
        assert_eq!(keys(&b), vec![3, 4, 5], "key 1 waits for the batch sending it");
        let mut seen = Vec::new();
        q.lookup_many(&[1, 2, 9], |i, e| seen.push((i, e.values[0])));
        assert_eq!(seen, vec![(0, 10.0), (1, 2.0)], "reads see the newest queued row");
        // Batch a fails: key 2 returns in front, key 1's newer row stays.
        q.settle(a, &[true, true]);
        q.settle(b, &[false, false, false]);
        let c = q.take(10);
        assert_eq!(keys(&c), vec![2, 1]);
        assert_eq!(c[1].1.values[0], 10.0);
        q.settle(c, &[false, false]);
        assert_eq!(q.window().0, 0);
        assert_eq!(q.window().1, 0, "every byte counted is returned");
    }

    /// A set-if-absent row stays so only while nothing else of its key is
    /// queued: a later write replaces it with a plain one, and one queued
    /// while its key is being sent is plain (it follows this host's own
    /// write or erasure of the key).
    #[test]
    fn set_if_absent_rows_yield_to_other_writes_of_their_key() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let q = Queue::new(8, 1 << 20, Duration::from_secs(1), 1, Box::new(|_| 0));
        rt.block_on(q.push(&[1, 2], &[1.0, 2.0], &[], 1, true)).unwrap();
        rt.block_on(q.push(&[3], &[], &[], 0, false)).unwrap();
        rt.block_on(q.push(&[2], &[20.0], &[], 1, false)).unwrap();
        let a = q.take(10);
        let nx: Vec<(u64, bool)> = a.iter().map(|(k, e)| (*k, e.nx)).collect();
        assert_eq!(nx, vec![(1, true), (2, false), (3, false)]);
        // Key 3's erasure is being sent: an insert of it is plain.
        rt.block_on(q.push(&[3, 4], &[3.0, 4.0], &[], 1, true)).unwrap();
        q.settle(a, &[false, false, false]);
        let b = q.take(10);
        let nx: Vec<(u64, bool)> = b.iter().map(|(k, e)| (*k, e.nx)).collect();
        assert_eq!(nx, vec![(3, false), (4, true)]);
        q.settle(b, &[false, false]);
        assert_eq!(q.window().1, 0);
    }

    /// A write is queued whole or not at all. A tester's write-back write,
    /// refused with `resource_exhausted` behind a stopped master, had its
    /// first chunks (half the bound each) queued already: they reached
    /// the cluster and other hosts' reads after the writer was told
    /// nothing was written. Now a write waits for room for all its rows,
    /// and one larger than the whole bound is refused at once; a key
    /// given twice costs its bytes once (it counted twice and the extra
    /// bytes were never given back).
    #[test]
    fn a_write_is_queued_whole_or_not_at_all() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        // Rows of 8 bytes and their 8-byte keys: room for 10 rows.
        let q = Queue::new(8, 160, Duration::from_millis(50), 1, Box::new(|_| 0));
        let ones = |n: usize| vec![1.0f32; n];
        rt.block_on(q.push(&[1, 2, 3, 4], &ones(4), &[], 1, false)).unwrap();
        // 8 more rows while nothing drains: room for 6 only.
        let late: Vec<u64> = (10..18).collect();
        let e = rt.block_on(q.push(&late, &ones(8), &[], 1, false)).unwrap_err();
        assert!(matches!(e, Error::QueueFull { .. }), "{e}");
        let mut seen = 0;
        q.lookup_many(&late, |_, _| seen += 1);
        assert_eq!(seen, 0, "no row of a refused write is queued");
        assert_eq!(q.window().0, 4);
        // More than the whole bound: refused at once, without the wait.
        let many: Vec<u64> = (100..111).collect();
        let start = Instant::now();
        let e = rt.block_on(q.push(&many, &ones(11), &[], 1, false)).unwrap_err();
        assert!(matches!(e, Error::QueueTooSmall { .. }), "{e}");
        assert!(start.elapsed() < Duration::from_millis(40), "refused at once");
        // A key twice costs once; every byte comes back.
        rt.block_on(q.push(&[7, 7, 1], &ones(3), &[], 1, false)).unwrap();
        assert_eq!((q.window().0, q.window().1), (5, 5 * 16));
        let all = q.take(100);
        q.settle(all, &[false; 5]);
        assert_eq!(q.window().1, 0, "every byte counted is returned");
    }
}
