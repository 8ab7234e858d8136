//! # hkv-checkpoint: checkpoints of hkvd tables in an embedded store
//!
//! A checkpoint is a directory of **chunks** (exported entries of one table
//! shard: keys, scores, values; and, for incremental checkpoints, the live
//! keys of each shard), each a file with its own xxh3 checksum, and a
//! **manifest** (tables, their specs, entry counts, the chunk list) written
//! last into the same directory as `MANIFEST`, checksummed and fsynced. The
//! sled catalog indexes the manifests and the `current` pointer; when it is
//! lost or damaged it is rebuilt from the directories ([`Recovery`]), and a
//! damaged `MANIFEST` from the index's copy. A directory with no manifest
//! anywhere (file or index) is a leftover of an interrupted checkpoint and is
//! collected; one that once completed never is (outside retention): if it
//! cannot be repaired it is moved aside.
//! The byte layout is in `checkpoint/FORMAT.md`.
//!
//! # Layout
//! - this file: [`Store`] (the engine boundary), [`SledStore`], errors.
//! - [`chunk`] encodes and verifies chunks.
//! - [`manifest`] holds [`Manifest`] and its checksummed encoding.
//! - [`catalog`] writes, lists, verifies, retains and collects checkpoints.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod catalog;
pub mod chunk;
pub mod manifest;

pub use catalog::{Catalog, ChunkWriter, Listed, Recovery};
pub use chunk::Chunk;
pub use manifest::{ChunkRef, Kind, Manifest, TableEntry};

/// Our own format version, in every chunk and manifest.
pub const FORMAT_VERSION: u32 = 1;

/// What checkpoint operations fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store engine failed (I/O, corruption it detected itself).
    #[error("checkpoint store: {0}")]
    Store(String),
    /// A chunk's bytes do not match its checksum or length.
    #[error("checkpoint {id:016x}: chunk {chunk} is corrupt ({why}); it cannot be restored")]
    CorruptChunk {
        /// Checkpoint id.
        id: u64,
        /// Chunk key.
        chunk: String,
        /// What did not match.
        why: String,
    },
    /// A manifest does not match its checksum or cannot be parsed.
    #[error("checkpoint {id:016x}: manifest is corrupt ({why})")]
    CorruptManifest {
        /// Checkpoint id.
        id: u64,
        /// What did not match.
        why: String,
    },
    /// A chunk named by a manifest is missing.
    #[error("checkpoint {id:016x}: chunk {chunk} is missing")]
    MissingChunk {
        /// Checkpoint id.
        id: u64,
        /// Chunk key.
        chunk: String,
    },
    /// No such checkpoint.
    #[error("no complete checkpoint {0}")]
    NotFound(String),
    /// An incremental checkpoint whose base (or a base further down its
    /// chain) is missing or unusable: it cannot be restored on its own.
    #[error(
        "checkpoint {id:016x} cannot be restored: it is incremental and its base {base:016x} is {why}; \
         restore a checkpoint whose chain is complete (hkvctl checkpoints lists them)"
    )]
    BrokenChain {
        /// The checkpoint asked for.
        id: u64,
        /// The base that is missing or unusable.
        base: u64,
        /// Why it is unusable (`missing`, or its own error).
        why: String,
    },
}

impl Error {
    /// The checkpoint whose files this error is about (a corrupt or missing
    /// chunk, a corrupt manifest), for marking it corrupt.
    pub fn damaged_checkpoint(&self) -> Option<u64> {
        match self {
            Error::CorruptChunk { id, .. } | Error::MissingChunk { id, .. } | Error::CorruptManifest { id, .. } => {
                Some(*id)
            }
            _ => None,
        }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The storage engine behind the catalog: a flat ordered key-value map.
/// Keeping it this small lets the engine change (by export and import)
/// without touching the format.
pub trait Store: Send + Sync {
    /// Writes a value.
    fn put(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Reads a value.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Keys starting with `prefix`, in order.
    fn keys(&self, prefix: &str) -> Result<Vec<String>>;
    /// Removes a key.
    fn remove(&self, key: &str) -> Result<()>;
    /// Makes every write so far durable.
    fn flush(&self) -> Result<()>;
    /// Bytes the store occupies on disk.
    fn disk_bytes(&self) -> Result<u64>;
}

/// sled 0.34 as the catalog store.
pub struct SledStore {
    db: sled::Db,
}

fn store_err(e: sled::Error) -> Error {
    Error::Store(e.to_string())
}

/// Runs a sled call so that a panic inside sled (it panics on some damaged
/// files instead of returning an error) becomes an error, never an abort.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Store(format!("{what}: sled panicked: {msg}")))
        }
    }
}

impl SledStore {
    /// Opens (or creates) the database directory. A damaged database gives
    /// an error (sled's panics included), never a crash.
    pub fn open(path: &std::path::Path) -> Result<SledStore> {
        guarded("open", || {
            let db = sled::Config::new()
                .path(path)
                // Durability comes from explicit flushes at the points the format
                // needs them; no background flush thread competes with them.
                .flush_every_ms(None)
                .cache_capacity(64 << 20)
                .open()
                .map_err(|e| Error::Store(format!("cannot open {}: {e}", path.display())))?;
            Ok(SledStore { db })
        })
    }

    /// Whether an open error means another process holds the database (not
    /// damage: the files must not be touched).
    pub fn is_locked_error(e: &Error) -> bool {
        matches!(e, Error::Store(m) if m.contains("could not acquire lock"))
    }
}

impl Store for SledStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        guarded("put", || {
            self.db.insert(key.as_bytes(), value).map_err(store_err)?;
            Ok(())
        })
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        guarded("get", || Ok(self.db.get(key.as_bytes()).map_err(store_err)?.map(|v| v.to_vec())))
    }
    fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        guarded("scan", || {
            self.db
                .scan_prefix(prefix.as_bytes())
                .keys()
                .map(|k| k.map(|k| String::from_utf8_lossy(&k).into_owned()).map_err(store_err))
                .collect()
        })
    }
    fn remove(&self, key: &str) -> Result<()> {
        guarded("remove", || {
            self.db.remove(key.as_bytes()).map_err(store_err)?;
            Ok(())
        })
    }
    fn flush(&self) -> Result<()> {
        guarded("flush", || {
            self.db.flush().map_err(store_err)?;
            Ok(())
        })
    }
    fn disk_bytes(&self) -> Result<u64> {
        guarded("size", || self.db.size_on_disk().map_err(store_err))
    }
}
