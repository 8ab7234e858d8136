//! What every request handler shares: the router, the configuration, the
//! checkpoints and the server's counters.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use crate::admin::Peer;
use crate::ckpt::Checkpoints;
use crate::config::Config;
use crate::router::Router;

/// Counters of the server itself.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections open now.
    pub connections: AtomicUsize,
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Requests answered.
    pub requests: AtomicU64,
    /// Error responses sent.
    pub errors: AtomicU64,
    /// Requests running now.
    pub in_flight: AtomicUsize,
    /// Bytes of request bodies being received or run, and of answers
    /// being built or sent, over every connection (bounded by
    /// `limits.max_bytes_in_flight`).
    pub in_flight_bytes: AtomicU64,
    /// Frames refused because that bound was reached.
    pub in_flight_refusals: AtomicU64,
    /// Of `in_flight_bytes`, those of bodies over 64 KiB (`connection::SMALL_BODY`) bytes still
    /// arriving: at most 3/4 of the limit, so that uploads kept trickling
    /// cannot take what small requests and answers need.
    pub receiving_bytes: AtomicU64,
    /// Registered regions mapped now.
    pub regions: RegionCounters,
    /// Where requests' time goes (`stats.path`).
    pub path: crate::path::PathTimes,
    /// The tables' counters as last reported, carried across restores.
    pub reported: crate::carried::Carried,
}

/// Everything the request handlers share.
pub struct State {
    /// Tables and shard actors.
    pub router: Arc<Router>,
    /// The configuration in force.
    pub config: Config,
    /// When the daemon started.
    pub started: Instant,
    /// Set to true to drain and stop.
    pub shutdown: watch::Sender<bool>,
    /// The daemon's uid (admin rights).
    pub uid: u32,
    /// The admin group's gid, if configured.
    pub admin_gid: Option<u32>,
    /// Server counters.
    pub stats: ServerStats,
    /// Backend in words, for stats.
    pub backend: String,
    /// Checkpoints.
    pub checkpoints: Arc<Checkpoints>,
    /// The address-space limit large allocations are checked against.
    pub memory: crate::memory::AddressSpace,
    /// Each backed table's Redis Cluster tier (`crate::backing`), in front
    /// of the router: the router knows nothing of it.
    pub backing: crate::backing::Tiers,
}

impl State {
    /// Whether `peer` may run admin operations: root, the daemon's user, or
    /// a member of the admin group (primary or supplementary).
    pub fn is_admin(&self, peer: &Peer) -> bool {
        peer.uid == 0 || peer.uid == self.uid || self.admin_gid.is_some_and(|g| peer.in_group(g))
    }
}

/// Bytes counted in one of the server's byte counters, up to a cap: in
/// `in_flight_bytes` a request body as it arrives or an answer until it is
/// sent, in `receiving_bytes` a large body until it is complete; given back
/// on drop.
pub struct InFlight {
    state: Arc<State>,
    counter: fn(&ServerStats) -> &AtomicU64,
    bytes: u64,
    /// Whether large amounts are checked against the address space: the
    /// total's shares are; a share of `receiving_bytes` is also counted in
    /// the total, which checks it once.
    space: bool,
}

impl InFlight {
    /// A share of `ServerStats::in_flight_bytes`.
    pub(crate) fn total(state: &Arc<State>) -> InFlight {
        InFlight { state: state.clone(), counter: |s| &s.in_flight_bytes, bytes: 0, space: true }
    }

    /// A share of `ServerStats::receiving_bytes`.
    pub(crate) fn receiving(state: &Arc<State>) -> InFlight {
        InFlight { state: state.clone(), counter: |s| &s.receiving_bytes, bytes: 0, space: false }
    }

    /// Counts `n` more bytes, unless the counter would then pass `cap`,
    /// or (a large `n` in the total) the bytes would not fit the address
    /// space beside what is mapped and counted ([`crate::memory`]).
    pub(crate) fn add(&mut self, n: u64, cap: u64) -> bool {
        let counter = (self.counter)(&self.state.stats);
        if self.space && !crate::memory::fits_counted(&self.state.memory, n, &self.state.stats.in_flight_bytes) {
            return false;
        }
        let ok = counter.fetch_update(Relaxed, Relaxed, |b| b.checked_add(n).filter(|&t| t <= cap)).is_ok();
        if ok {
            self.bytes += n;
        }
        ok
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        (self.counter)(&self.state.stats).fetch_sub(self.bytes, Relaxed);
    }
}

/// Region counters over every connection (in `ServerStats`).
#[derive(Debug, Default)]
pub struct RegionCounters {
    /// Regions mapped now (registered, or unregistered with requests in flight).
    pub regions: AtomicU64,
    /// Their bytes.
    pub bytes: AtomicU64,
    /// Device-region requests answered early whose batches still run
    /// (`crate::region`'s early answers), at most `limits.max_in_flight`.
    pub early: AtomicU64,
}
