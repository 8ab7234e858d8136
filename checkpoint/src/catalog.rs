//! The catalog: manifests and the `current` pointer in a [`Store`] (keys
//! `manifest/{id:016x}` and `current`; hex ids make key order id order), and
//! chunk bodies as plain files `chunks/{id:016x}/{table}.{shard:04}.{seq:08}`
//! written to a temporary name, fsynced and renamed, by a writer thread that
//! overlaps disk writes with the export.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::chunk::{self, Chunk};
use crate::manifest::{self, ChunkRef, Kind, Manifest, TableEntry};
use crate::{Error, Result, SledStore, Store, FORMAT_VERSION};

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn manifest_key(id: u64) -> String {
    format!("manifest/{id:016x}")
}

fn id_of(key: &str, prefix: &str) -> Option<u64> {
    key.strip_prefix(prefix).and_then(|r| u64::from_str_radix(&r[..16.min(r.len())], 16).ok())
}

/// A checkpoint as listed.
#[derive(Debug, Clone)]
pub struct Listed {
    /// Id.
    pub id: u64,
    /// The manifest, when it decodes.
    pub manifest: Option<Manifest>,
    /// `complete`, or why not.
    pub status: String,
}

/// Checkpoints: a catalog store plus a directory of chunk files.
#[derive(Clone)]
pub struct Catalog {
    store: Arc<dyn Store>,
    chunks: PathBuf,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Store(format!("{what} {}: {e}", path.display()))
}

impl Catalog {
    /// A catalog in `dir`: sled at `dir/catalog`, chunk files under `dir/chunks`.
    pub fn open(dir: &Path) -> Result<Catalog> {
        let chunks = dir.join("chunks");
        std::fs::create_dir_all(&chunks).map_err(|e| io_err("cannot create", &chunks, e))?;
        Ok(Catalog { store: Arc::new(SledStore::open(&dir.join("catalog"))?), chunks })
    }

    /// A catalog over any store, with chunk files under `chunks`.
    pub fn new(store: Arc<dyn Store>, chunks: PathBuf) -> Catalog {
        Catalog { store, chunks }
    }

    /// The directory of a checkpoint's chunk files.
    pub fn chunk_dir(&self, id: u64) -> PathBuf {
        self.chunks.join(format!("{id:016x}"))
    }

    /// The file of a chunk.
    pub fn chunk_path(&self, c: &ChunkRef) -> PathBuf {
        self.chunks.join(&c.key)
    }

    /// Bytes of the catalog store and every chunk file.
    pub fn disk_bytes(&self) -> Result<u64> {
        let mut total = self.store.disk_bytes()?;
        for d in std::fs::read_dir(&self.chunks).map_err(|e| io_err("cannot list", &self.chunks, e))?.flatten() {
            for f in std::fs::read_dir(d.path()).into_iter().flatten().flatten() {
                total += f.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        Ok(total)
    }

    /// The store.
    pub fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// Starts a checkpoint: allocates an id above every existing one.
    pub fn begin(&self) -> Result<ChunkWriter> {
        let last = self.all_ids()?.into_iter().max().unwrap_or(0);
        let created = now_ms();
        let id = created.max(last + 1);
        let dir = self.chunk_dir(id);
        std::fs::create_dir_all(&dir).map_err(|e| io_err("cannot create", &dir, e))?;
        // The writer thread: fsync each file, rename it into place.
        let (tx, rx) = sync_channel::<(PathBuf, Vec<u8>)>(3);
        let thread = std::thread::Builder::new()
            .name("hkvd-ckpt-write".into())
            .spawn(move || -> Result<()> {
                for (path, bytes) in rx {
                    let tmp = path.with_extension("tmp");
                    let mut f = std::fs::File::create(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
                    f.write_all(&bytes).map_err(|e| io_err("cannot write", &tmp, e))?;
                    f.sync_data().map_err(|e| io_err("cannot sync", &tmp, e))?;
                    std::fs::rename(&tmp, &path).map_err(|e| io_err("cannot rename", &tmp, e))?;
                }
                Ok(())
            })
            .map_err(|e| Error::Store(format!("cannot start the checkpoint writer: {e}")))?;
        Ok(ChunkWriter {
            cat: self.clone(),
            id,
            created,
            bytes: 0,
            entries: 0,
            tx: Some(tx),
            thread: Some(thread),
            dir,
        })
    }

    /// Ids that have a chunk or a manifest.
    fn all_ids(&self) -> Result<BTreeSet<u64>> {
        let mut ids: BTreeSet<u64> =
            self.store.keys("manifest/")?.iter().filter_map(|k| id_of(k, "manifest/")).collect();
        if let Ok(dirs) = std::fs::read_dir(&self.chunks) {
            ids.extend(dirs.flatten().filter_map(|d| u64::from_str_radix(&d.file_name().to_string_lossy(), 16).ok()));
        }
        Ok(ids)
    }

    /// How many checkpoints have a manifest (read from the keys alone).
    pub fn count(&self) -> Result<usize> {
        Ok(self.store.keys("manifest/")?.len())
    }

    /// Every checkpoint with a manifest, newest first.
    pub fn list(&self) -> Result<Vec<Listed>> {
        let mut out = vec![];
        for key in self.store.keys("manifest/")?.into_iter().rev() {
            let Some(id) = id_of(&key, "manifest/") else { continue };
            let listed = match self.store.get(&key)?.map(|b| manifest::decode(id, &b)) {
                Some(Ok(m)) => Listed { id, manifest: Some(m), status: "complete".into() },
                Some(Err(e)) => Listed { id, manifest: None, status: e.to_string() },
                None => continue,
            };
            out.push(listed);
        }
        Ok(out)
    }

    /// A checkpoint's manifest.
    pub fn manifest(&self, id: u64) -> Result<Manifest> {
        match self.store.get(&manifest_key(id))? {
            Some(b) => manifest::decode(id, &b),
            None => Err(Error::NotFound(format!("{id:016x}"))),
        }
    }

    /// The id the `current` pointer names.
    pub fn current(&self) -> Result<Option<u64>> {
        Ok(self.store.get("current")?.and_then(|b| b.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8")))))
    }

    /// Reads and verifies one chunk.
    pub fn read_chunk(&self, id: u64, c: &ChunkRef) -> Result<Chunk> {
        let b = std::fs::read(self.chunk_path(c)).map_err(|_| Error::MissingChunk { id, chunk: c.key.clone() })?;
        chunk::decode(id, &c.key, &b, c.checksum)
    }

    /// The manifests to apply to restore `id`: its full base first.
    pub fn chain(&self, id: u64) -> Result<Vec<Manifest>> {
        let mut chain = vec![self.manifest(id)?];
        while let Kind::Incremental { base } = chain.last().expect("non-empty").kind {
            chain.push(self.manifest(base)?);
        }
        chain.reverse();
        Ok(chain)
    }

    /// Reads every chunk of a chain and checks its checksum, so that a
    /// restore never loads half a table. Calls `progress(bytes)` per chunk.
    pub fn verify(&self, chain: &[Manifest], mut progress: impl FnMut(u64)) -> Result<()> {
        for m in chain {
            for t in &m.tables {
                for c in &t.chunks {
                    self.read_chunk(m.id, c)?;
                    progress(c.bytes);
                }
            }
        }
        Ok(())
    }

    /// Removes leftovers of interrupted checkpoints (chunks without a
    /// manifest, except those of `running`) and complete checkpoints beyond
    /// the newest `keep` (keeping the bases incremental ones need). Returns
    /// the ids removed.
    pub fn collect(&self, keep: usize, running: Option<u64>) -> Result<Vec<u64>> {
        let listed = self.list()?;
        let mut retained: BTreeSet<u64> = BTreeSet::new();
        for l in listed.iter().filter(|l| l.manifest.is_some()).take(keep.max(1)) {
            let mut m = l.manifest.clone();
            while let Some(x) = m {
                retained.insert(x.id);
                m = match x.kind {
                    Kind::Incremental { base } => self.manifest(base).ok(),
                    Kind::Full => None,
                };
            }
        }
        let mut removed = vec![];
        for id in self.all_ids()? {
            if retained.contains(&id) || Some(id) == running {
                continue;
            }
            // Manifest first: from then on the rest is a leftover.
            self.store.remove(&manifest_key(id))?;
            self.store.flush()?;
            let dir = self.chunk_dir(id);
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(|e| io_err("cannot remove", &dir, e))?;
            }
            removed.push(id);
        }
        if !removed.is_empty() {
            self.store.flush()?;
        }
        Ok(removed)
    }
}

/// Writes the chunks of one checkpoint, then commits its manifest.
pub struct ChunkWriter {
    cat: Catalog,
    id: u64,
    created: u64,
    bytes: u64,
    entries: u64,
    tx: Option<SyncSender<(PathBuf, Vec<u8>)>>,
    thread: Option<JoinHandle<Result<()>>>,
    dir: PathBuf,
}

impl ChunkWriter {
    /// Waits for the writer thread; its first error, if any.
    fn finish_writes(&mut self) -> Result<()> {
        drop(self.tx.take());
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::Store("the checkpoint writer thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for ChunkWriter {
    fn drop(&mut self) {
        let _ = self.finish_writes();
    }
}

impl ChunkWriter {
    /// The checkpoint id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Entries written so far.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Stores one chunk.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        table: &str,
        shard: u32,
        seq: u32,
        dim: usize,
        keys: &[u64],
        scores: &[u64],
        values: &[f32],
    ) -> Result<ChunkRef> {
        let key = format!("{:016x}/{table}.{shard:04}.{seq:08}", self.id);
        let (b, checksum) = chunk::encode(dim, keys, scores, values);
        let len = b.len() as u64;
        let sent = self.tx.as_ref().map(|tx| tx.send((self.dir.join(format!("{table}.{shard:04}.{seq:08}")), b)));
        if !matches!(sent, Some(Ok(()))) {
            // The writer stopped: report its error.
            self.finish_writes()?;
            return Err(Error::Store("the checkpoint writer stopped".into()));
        }
        self.bytes += len;
        self.entries += keys.len() as u64;
        Ok(ChunkRef { key, shard, entries: keys.len() as u64, bytes: len, checksum })
    }

    /// Flushes the chunks, then writes and flushes the manifest, then the
    /// `current` pointer: a crash at any point leaves either the previous
    /// complete checkpoint current, or this one complete.
    pub fn commit(mut self, kind: Kind, tables: Vec<TableEntry>, daemon_version: &str) -> Result<Manifest> {
        // Every chunk file is synced and renamed; make the renames durable.
        self.finish_writes()?;
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(|e| io_err("cannot sync", &self.dir, e))?;
        let m = Manifest {
            format: FORMAT_VERSION,
            id: self.id,
            created_unix_ms: self.created,
            finished_unix_ms: now_ms(),
            daemon_version: daemon_version.into(),
            kind,
            tables,
        };
        let s = &self.cat.store;
        s.flush()?;
        s.put(&manifest_key(self.id), &manifest::encode(&m))?;
        s.flush()?;
        s.put("current", &self.id.to_le_bytes())?;
        s.flush()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str, chunks: Vec<ChunkRef>, full: bool) -> TableEntry {
        TableEntry {
            name: name.into(),
            dim: 2,
            policy: "lru".into(),
            mode: "single".into(),
            spec: serde_json::json!({}),
            shards: 1,
            entries: chunks.iter().map(|c| c.entries).sum(),
            full,
            watermarks: vec![0],
            chunks,
        }
    }

    #[test]
    fn write_list_chain_collect() {
        let dir = tempfile::tempdir().unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let mut w = cat.begin().unwrap();
        let c = w.write("t", 0, 0, 2, &[1, 2], &[5, 6], &[0.5; 4]).unwrap();
        let a = w.commit(Kind::Full, vec![table("t", vec![c], true)], "test").unwrap();
        let mut w = cat.begin().unwrap();
        assert!(w.id() > a.id);
        let c = w.write("t", 0, 0, 2, &[3], &[7], &[1.5; 2]).unwrap();
        let b = w.commit(Kind::Incremental { base: a.id }, vec![table("t", vec![c], false)], "test").unwrap();
        // An interrupted third one: chunks, no manifest.
        let mut w = cat.begin().unwrap();
        let leftover = w.id();
        w.write("t", 0, 0, 2, &[9], &[9], &[0.0; 2]).unwrap();
        drop(w);
        assert!(cat.chunk_dir(leftover).exists());
        assert_eq!(cat.current().unwrap(), Some(b.id));
        let listed = cat.list().unwrap();
        assert_eq!(listed.iter().map(|l| l.id).collect::<Vec<_>>(), [b.id, a.id]);
        let chain = cat.chain(b.id).unwrap();
        assert_eq!(chain.iter().map(|m| m.id).collect::<Vec<_>>(), [a.id, b.id]);
        cat.verify(&chain, |_| ()).unwrap();
        let ch = cat.read_chunk(b.id, &b.tables[0].chunks[0]).unwrap();
        assert_eq!((ch.keys, ch.scores, ch.values), (vec![3], vec![7], vec![1.5, 1.5]));
        // keep = 1 still keeps a (b's base); the leftover goes.
        assert_eq!(cat.collect(1, None).unwrap(), [leftover]);
        assert!(!cat.chunk_dir(leftover).exists());
        assert_eq!(cat.list().unwrap().len(), 2);
        // Corrupt a chunk: verify names checkpoint and chunk.
        let key = &a.tables[0].chunks[0].key;
        let path = cat.chunk_path(&a.tables[0].chunks[0]);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[30] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = cat.verify(&chain, |_| ()).unwrap_err().to_string();
        assert!(e.contains(&format!("{:016x}", a.id)) && e.contains(key), "{e}");
    }
}
