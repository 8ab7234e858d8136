//! The write-back queue: rows waiting for the cluster, bounded in bytes.
//!
//! A row is `pending` (queued) or `sending` (in a batch the flusher has
//! sent and the cluster has not yet acknowledged); both count against the
//! bound and both are visible to reads, so a read never sees the cluster's
//! older row while a newer one waits here. A row whose batch failed goes
//! back to `pending` unless a newer write of its key arrived meanwhile;
//! nothing leaves the queue except by the cluster's acknowledgement.
//! Bytes: a row costs its value and key once while pending and once more
//! while a newer write of its key waits behind the batch sending it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::error::Error;

/// One queued row.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub score: u64,
    pub values: Box<[f32]>,
    pub since: Instant,
}

#[derive(Debug, Default)]
struct State {
    pending: HashMap<u64, Entry>,
    sending: HashMap<u64, Entry>,
    bytes: u64,
    closed: bool,
}

/// The queue and its wake-ups.
#[derive(Debug)]
pub(crate) struct Queue {
    state: Mutex<State>,
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
    pub fn new(row_bytes: usize, limit: u64, wait: Duration) -> Queue {
        Queue {
            state: Mutex::new(State::default()),
            entry_bytes: row_bytes as u64 + 8,
            limit,
            wait,
            room: Notify::new(),
            work: Notify::new(),
            idle: Notify::new(),
        }
    }

    /// Queues rows, waiting up to `wait` for room; a key already pending is
    /// replaced in place (its bytes are counted once).
    pub async fn push(&self, keys: &[u64], values: &[f32], scores: &[u64], dim: usize) -> Result<(), Error> {
        // Chunks of at most half the bound, so that one large write never
        // needs more room than the queue has.
        let per_chunk = ((self.limit / 2) / self.entry_bytes).max(1) as usize;
        let deadline = tokio::time::Instant::now() + self.wait;
        let start = Instant::now();
        let mut done = 0;
        while done < keys.len() {
            let end = (done + per_chunk).min(keys.len());
            loop {
                let room = self.room.notified();
                tokio::pin!(room);
                room.as_mut().enable();
                {
                    let mut s = self.state.lock();
                    let new = keys[done..end].iter().filter(|k| !s.pending.contains_key(k)).count() as u64;
                    let need = new * self.entry_bytes;
                    if s.bytes + need <= self.limit {
                        let now = Instant::now();
                        for (i, &k) in keys.iter().enumerate().take(end).skip(done) {
                            let e = Entry {
                                score: scores.get(i).copied().unwrap_or(0),
                                values: values[i * dim..(i + 1) * dim].into(),
                                since: now,
                            };
                            // A replaced row keeps its age: the window is
                            // how long the oldest unsent write has waited.
                            match s.pending.get_mut(&k) {
                                Some(old) => {
                                    old.score = e.score;
                                    old.values = e.values;
                                }
                                None => {
                                    s.pending.insert(k, e);
                                }
                            }
                        }
                        s.bytes += need;
                        break;
                    }
                }
                self.work.notify_one();
                if tokio::time::timeout_at(deadline, room).await.is_err() {
                    let s = self.state.lock();
                    return Err(Error::QueueFull {
                        queued_bytes: s.bytes,
                        limit_bytes: self.limit,
                        waited_ms: start.elapsed().as_millis() as u64,
                    });
                }
            }
            done = end;
        }
        self.work.notify_one();
        Ok(())
    }

    /// The newest queued row of `key`, pending before sending.
    pub fn lookup(&self, key: u64) -> Option<Entry> {
        let s = self.state.lock();
        s.pending.get(&key).or_else(|| s.sending.get(&key)).cloned()
    }

    /// Whether nothing is queued (a cheap check before per-key lookups).
    pub fn is_empty(&self) -> bool {
        let s = self.state.lock();
        s.pending.is_empty() && s.sending.is_empty()
    }

    /// Moves up to `max` pending rows, oldest first, to `sending`. A key
    /// already being sent stays pending until its batch settles: a key is
    /// in one batch at a time, so its writes reach the cluster in order
    /// however many batches are in flight.
    pub fn take(&self, max: usize) -> Batch {
        let mut s = self.state.lock();
        let mut keys: Vec<(Instant, u64)> =
            s.pending.iter().filter(|(k, _)| !s.sending.contains_key(k)).map(|(k, e)| (e.since, *k)).collect();
        if keys.len() > max {
            keys.select_nth_unstable(max);
            keys.truncate(max);
        }
        let mut batch = Vec::with_capacity(keys.len());
        for (_, k) in keys {
            if let Some(e) = s.pending.remove(&k) {
                s.sending.insert(k, e.clone());
                batch.push((k, e));
            }
        }
        batch
    }

    /// Settles a sent batch: acknowledged rows leave, failed rows return
    /// to `pending` unless a newer write of the key is pending.
    pub fn settle(&self, batch: Batch, failed: &[bool]) {
        let mut s = self.state.lock();
        for ((k, e), failed) in batch.into_iter().zip(failed) {
            s.sending.remove(&k);
            if *failed && !s.pending.contains_key(&k) {
                s.pending.insert(k, e);
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
        let oldest = s.pending.values().chain(s.sending.values()).map(|e| e.since).min();
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
                return Err(Error::FlushTimeout { rows: self.window().0 });
            }
        }
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
