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
//! - this file: [`Store`] (the engine boundary), [`SledStore`], [`MemStore`]
//!   (the index while the disk cannot be written), errors.
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
    /// The file system holding the checkpoints cannot be written (full,
    /// over quota, read-only): not damage; what is on disk still reads.
    #[error(
        "{what} {path} failed ({why}): the file system is full, over quota or read-only; \
         free space (or make it writable)"
    )]
    Unwritable {
        /// What was being done.
        what: String,
        /// The path.
        path: std::path::PathBuf,
        /// The system's error.
        why: String,
    },
    /// The catalog was opened on a file system that could not be written
    /// ([`Error::Unwritable`], the reason): no checkpoint is taken until
    /// the daemon opens it again.
    #[error("checkpoints are paused since start-up: {0}; restart hkvd once there is room to take them again")]
    Paused(String),
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

/// Whether an I/O error means the file system cannot take writes (full,
/// over quota, read-only), as opposed to damage.
pub fn is_unwritable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{QuotaExceeded, ReadOnlyFilesystem, StorageFull};
    matches!(e.kind(), StorageFull | QuotaExceeded | ReadOnlyFilesystem)
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

/// An index held in memory only: the catalog's store while the file
/// system cannot be written (checkpoints paused), built from the
/// directories at open so that restores still read.
#[derive(Default)]
pub struct MemStore {
    map: std::sync::Mutex<std::collections::BTreeMap<String, Vec<u8>>>,
}

impl MemStore {
    fn map(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for MemStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.map().insert(key.into(), value.to_vec());
        Ok(())
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.map().get(key).cloned())
    }
    fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        Ok(self.map().keys().filter(|k| k.starts_with(prefix)).cloned().collect())
    }
    fn remove(&self, key: &str) -> Result<()> {
        self.map().remove(key);
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn disk_bytes(&self) -> Result<u64> {
        Ok(0)
    }
}

/// sled 0.34 as the catalog store.
pub struct SledStore {
    db: sled::Db,
    path: std::path::PathBuf,
}

impl SledStore {
    /// A sled error as ours: a full or read-only file system is
    /// [`Error::Unwritable`], not damage.
    fn err(&self, what: &str, e: sled::Error) -> Error {
        match e {
            sled::Error::Io(io) if is_unwritable(&io) => {
                Error::Unwritable { what: what.into(), path: self.path.clone(), why: io.to_string() }
            }
            e => Error::Store(e.to_string()),
        }
    }
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
    /// an error (sled's panics included), never a crash. The database's
    /// lock is asked for again for up to 2 s: a store of this process
    /// just dropped, or of a process that just exited, can still hold it
    /// for a moment after the last handle went (seen as an intermittent
    /// "could not acquire lock" when a test reopened a catalog at once).
    pub fn open(path: &std::path::Path) -> Result<SledStore> {
        let start = std::time::Instant::now();
        loop {
            match Self::open_once(path) {
                Err(e) if Self::is_locked_error(&e) && start.elapsed() < std::time::Duration::from_secs(2) => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                // Said for an operator (the substring keeps `is_locked_error` true).
                Err(e) if Self::is_locked_error(&e) => {
                    return Err(Error::Store(format!(
                        "{} is held by another process (could not acquire lock): is another hkvd running \
                         with this state directory? Give each daemon its own --state-dir",
                        path.display()
                    )))
                }
                r => return r,
            }
        }
    }

    fn open_once(path: &std::path::Path) -> Result<SledStore> {
        guarded("open", || {
            let db = sled::Config::new()
                .path(path)
                // Durability comes from explicit flushes at the points the format
                // needs them; no background flush thread competes with them.
                .flush_every_ms(None)
                .cache_capacity(64 << 20)
                .open()
                .map_err(|e| match e {
                    // A full or read-only file system is not damage (issue 32).
                    sled::Error::Io(io) if is_unwritable(&io) => Error::Unwritable {
                        what: "opening the catalog".into(),
                        path: path.to_path_buf(),
                        why: io.to_string(),
                    },
                    e => Error::Store(format!("cannot open {}: {e}", path.display())),
                })?;
            Ok(SledStore { db, path: path.to_path_buf() })
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
            self.db.insert(key.as_bytes(), value).map_err(|e| self.err("writing the catalog", e))?;
            Ok(())
        })
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        guarded("get", || {
            Ok(self.db.get(key.as_bytes()).map_err(|e| self.err("reading the catalog", e))?.map(|v| v.to_vec()))
        })
    }
    fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        guarded("scan", || {
            self.db
                .scan_prefix(prefix.as_bytes())
                .keys()
                .map(|k| {
                    k.map(|k| String::from_utf8_lossy(&k).into_owned()).map_err(|e| self.err("reading the catalog", e))
                })
                .collect()
        })
    }
    fn remove(&self, key: &str) -> Result<()> {
        guarded("remove", || {
            self.db.remove(key.as_bytes()).map_err(|e| self.err("writing the catalog", e))?;
            Ok(())
        })
    }
    fn flush(&self) -> Result<()> {
        guarded("flush", || {
            self.db.flush().map_err(|e| self.err("flushing the catalog", e))?;
            Ok(())
        })
    }
    fn disk_bytes(&self) -> Result<u64> {
        guarded("size", || self.db.size_on_disk().map_err(|e| self.err("sizing the catalog", e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk is not damage (issue 32): ENOSPC, EDQUOT and EROFS are
    /// "cannot be written"; other errors (a garbled file) are not.
    #[test]
    fn a_full_or_read_only_file_system_is_unwritable_not_damaged() {
        for errno in [28, 122, 30] {
            assert!(is_unwritable(&std::io::Error::from_raw_os_error(errno)), "errno {errno}");
        }
        for errno in [2, 5, 13, 21] {
            assert!(!is_unwritable(&std::io::Error::from_raw_os_error(errno)), "errno {errno}");
        }
        assert!(!is_unwritable(&std::io::Error::new(std::io::ErrorKind::InvalidData, "garbled")));
    }
}
