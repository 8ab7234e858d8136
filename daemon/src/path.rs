//! Where a request's time goes in the daemon: per-stage sums since start,
//! read by `stats.path` (`hkv_proto::stats::PathStats` says what each
//! stage is). Two clock reads a stage, added with relaxed atomics: cheap
//! enough to stay on for every request.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use hkv_proto::stats::PathStats;

/// The sums, over every connection and shard call.
#[derive(Debug, Default)]
pub struct PathTimes {
    requests: AtomicU64,
    spawn: AtomicU64,
    handle: AtomicU64,
    write: AtomicU64,
    queue: AtomicU64,
    queued: AtomicU64,
    event_waits: AtomicU64,
    event_wait: AtomicU64,
    total: AtomicU64,
    calls: AtomicU64,
    mailbox: AtomicU64,
    shard: AtomicU64,
    wake: AtomicU64,
}

/// When a request reached each boundary: its body read, its task running,
/// its answer built.
#[derive(Debug, Clone, Copy)]
pub struct Stamps {
    /// The body was read (the request is known).
    pub read: Instant,
    /// Its task began.
    pub began: Instant,
    /// Its answer frame was built and queued for the writer.
    pub answered: Instant,
}

/// When a shard call's operation ran on its actor's thread.
#[derive(Debug, Clone, Copy)]
pub struct Ran {
    /// The operation began.
    pub began: Instant,
    /// It ended.
    pub ended: Instant,
}

fn ns(from: Instant, to: Instant) -> u64 {
    to.saturating_duration_since(from).as_nanos() as u64
}

impl PathTimes {
    /// A request whose answer began to be written at `writing` and was
    /// flushed at `written`; `queued`: it went through the writer task.
    pub fn request(&self, s: &Stamps, writing: Instant, written: Instant, queued: bool) {
        self.requests.fetch_add(1, Relaxed);
        self.spawn.fetch_add(ns(s.read, s.began), Relaxed);
        self.handle.fetch_add(ns(s.began, s.answered), Relaxed);
        self.write.fetch_add(ns(s.answered, written), Relaxed);
        self.queue.fetch_add(ns(s.answered, writing), Relaxed);
        self.queued.fetch_add(queued as u64, Relaxed);
        self.total.fetch_add(ns(s.read, written), Relaxed);
    }

    /// A wait for a client's CUDA event, from `from` until now.
    pub fn event_wait(&self, from: Instant) {
        self.event_waits.fetch_add(1, Relaxed);
        self.event_wait.fetch_add(ns(from, Instant::now()), Relaxed);
    }

    /// A shard call sent at `sent`, run as `ran`, its caller running again at `back`.
    pub fn call(&self, sent: Instant, ran: Ran, back: Instant) {
        self.calls.fetch_add(1, Relaxed);
        self.mailbox.fetch_add(ns(sent, ran.began), Relaxed);
        self.shard.fetch_add(ns(ran.began, ran.ended), Relaxed);
        self.wake.fetch_add(ns(ran.ended, back), Relaxed);
    }

    /// The sums as the stats document has them.
    pub fn stats(&self) -> PathStats {
        PathStats {
            requests: self.requests.load(Relaxed),
            spawn_ns: self.spawn.load(Relaxed),
            handle_ns: self.handle.load(Relaxed),
            write_ns: self.write.load(Relaxed),
            queue_ns: self.queue.load(Relaxed),
            queued: self.queued.load(Relaxed),
            event_waits: self.event_waits.load(Relaxed),
            event_wait_ns: self.event_wait.load(Relaxed),
            total_ns: self.total.load(Relaxed),
            shard_calls: self.calls.load(Relaxed),
            mailbox_ns: self.mailbox.load(Relaxed),
            shard_ns: self.shard.load(Relaxed),
            wake_ns: self.wake.load(Relaxed),
        }
    }
}
