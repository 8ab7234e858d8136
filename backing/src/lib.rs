//! hkvd's backing tier: one table's rows in a Redis Cluster behind the
//! per-host cache. Reads of cache misses fetch from the cluster in the
//! same request, with a deadline and an answer per key; writes go through
//! to the cluster or into a bounded write-back queue; each acknowledged
//! write batch is published on the table's stream so that other hosts
//! drop what they cache. The key layout is specified byte by byte in
//! `proto/PROTOCOL.md` ("Backing tier").
//!
//! The crate knows nothing of the daemon: it takes keys, `f32` rows and
//! scores, and answers with rows and outcomes. All I/O goes through the
//! `redis` crate's cluster connection (no hand-written RESP).
//!
//! # Layout
//! - `tier`: [`Backing`] (open, read, write, insert_absent, erase, scan,
//!   flush, subscribe, stats), [`Options`], [`Mode`], [`Fetched`], [`ReadOut`], [`Scan`].
//! - `cluster`: seeds checked, the cluster connection, the slot map that
//!   names a failed node.
//! - `layout`: keys, groups, hash slots and the row encoding.
//! - `queue`: the write-back queue, bounded in bytes.
//! - `stream`: [`Invalidations`], the consumer of a table's stream.
//! - `stats`: counters and histograms, [`Stats`].
//! - `error`: [`Error`].
//! - `testkit` (feature `testkit`): real `redis-server` clusters for tests.
#![forbid(unsafe_code)]

mod cluster;
mod error;
pub mod layout;
mod queue;
mod stats;
mod stream;
#[cfg(feature = "testkit")]
pub mod testkit;
mod tier;

pub use cluster::parse_seeds;
pub use error::Error;
pub use stats::{HistogramSnapshot, Stats};
pub use stream::{Gap, Invalidation, Invalidations};
pub use tier::{Backing, Fetched, Mode, Options, ReadOut, Scan};
