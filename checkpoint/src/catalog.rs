//! The catalog: checkpoint directories `chunks/{id:016x}/` holding chunk
//! files `t{table:04}.{shard:04}.{seq:08}` (`table`: the table's index in
//! the manifest; written to a temporary name, fsynced and renamed by a
//! writer thread that overlaps disk writes with the export), key lists
//! `t{table:04}.{shard:04}.keys{seq:08}`, and last the checksummed
//! `MANIFEST`; and an index of them in a [`Store`] (keys `manifest/{id:016x}`
//! and `current`; hex ids make key order id order). The directories are the
//! truth: the index is checked against them at open and rebuilt from them
//! when it is lost or damaged.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::chunk::{self, Chunk};
use crate::manifest::{self, ChunkRef, Kind, Manifest, TableEntry};
use crate::{is_unwritable, Error, MemStore, Result, SledStore, Store, FORMAT_VERSION};

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "MANIFEST";

/// The file a restore that found a checkpoint corrupt leaves in its
/// directory: why (text). A restore that verifies it removes it.
pub const CORRUPT_FILE: &str = "CORRUPT";
/// The empty file that says a daemon wrote every file of a checkpoint, or
/// a restore read and verified every one ([`Catalog::mark_verified`]):
/// retention counts it restorable in later processes too.
pub const VERIFIED_FILE: &str = "VERIFIED";

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

/// What opening the catalog found and repaired, for the caller to log.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// The index could not be opened or read: why, and where its files were
    /// moved (they are kept for inspection, never deleted).
    pub damaged: Option<(String, PathBuf)>,
    /// Checkpoints whose directory verifies but the index lacked or held
    /// differently: indexed again from their directory.
    pub reindexed: Vec<u64>,
    /// Checkpoints of the earlier format (manifest only in the index) whose
    /// manifest was written into their directory.
    pub migrated: Vec<u64>,
    /// Index entries whose directory is gone: removed from the index.
    pub unindexed: Vec<u64>,
    /// Checkpoints whose directory `MANIFEST` was damaged while the index
    /// held a copy that verifies, as does every chunk it names: the
    /// directory's `MANIFEST` was rewritten from that copy.
    pub rewritten: Vec<u64>,
    /// Directories that hold a checkpoint which once completed (a damaged
    /// `MANIFEST`, or an index entry) but could not be repaired: moved aside
    /// to `chunks/{id:016x}.damaged-{ms}` (never deleted), with why.
    pub moved_aside: Vec<(u64, PathBuf, String)>,
    /// The file system could not be written (full, over quota, read-only):
    /// why. Nothing was moved aside or repaired; the index is held in
    /// memory, built from the directories, and checkpoints are paused.
    pub paused: Option<String>,
}

impl Recovery {
    /// Whether the index needed any repair.
    pub fn repaired(&self) -> bool {
        self.damaged.is_some()
            || !self.reindexed.is_empty()
            || !self.unindexed.is_empty()
            || !self.rewritten.is_empty()
            || !self.moved_aside.is_empty()
    }
}

/// A directory's manifest: verifying, damaged (why), or absent.
enum DirManifest {
    Valid(Manifest, Vec<u8>),
    Invalid(String),
    Missing,
}

/// Checkpoints: a catalog store plus a directory per checkpoint.
#[derive(Clone)]
pub struct Catalog {
    store: Arc<dyn Store>,
    chunks: PathBuf,
    /// Checkpoints a restore found a corrupt or missing file in (this
    /// process's knowledge, not persisted: the next restore finds it again).
    corrupt: Arc<Mutex<BTreeMap<u64, String>>>,
    /// Checkpoints this process knows are restorable: written by it
    /// ([`ChunkWriter::commit`]) or every file verified by it ([`Catalog::verify`],
    /// [`Catalog::mark_verified`] after a restore). Retention counts these
    /// and those an earlier process marked so ([`VERIFIED_FILE`]), unless
    /// found corrupt since.
    verified: Arc<Mutex<BTreeSet<u64>>>,
    /// Set when the catalog was opened on a file system that cannot be
    /// written: what failed, where, and the system's error. Nothing is
    /// written then: no checkpoint begins, nothing is collected or repaired.
    paused: Option<Arc<(String, PathBuf, String)>>,
    /// Checkpoints up to this id are never removed by retention
    /// ([`Catalog::keep_existing`]: a daemon started without restoring).
    kept_upto: Arc<Mutex<Option<u64>>>,
    /// Whether retention counts the marks earlier processes left
    /// ([`VERIFIED_FILE`]): only once the restore at start is done
    /// ([`Catalog::trust_marks`]), so that a checkpoint a restore is asked
    /// for is never removed before it runs.
    marks: Arc<std::sync::atomic::AtomicBool>,
    /// The checkpoint the tables were last restored from, kept with its
    /// chain until this process writes a newer one ([`Catalog::pin`]): the
    /// data the tables hold stays on disk after a restore of an older
    /// checkpoint, though newer ones are known restorable.
    pinned: Arc<Mutex<Option<u64>>>,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    if is_unwritable(&e) {
        // A full disk is not damage: the caller tells them apart by kind.
        return Error::Unwritable { what: what.into(), path: path.to_path_buf(), why: e.to_string() };
    }
    Error::Store(format!("{what} {}: {e}", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    sync_dir_io(dir).map_err(|e| io_err("cannot sync", dir, e))
}

/// Writes, syncs and removes 1 MiB in `dir`: whether the file system takes
/// writes (told apart from damage before a catalog is moved aside).
fn probe_writable(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(".hkvd-space-probe");
    let wrote = std::fs::File::create(&probe).and_then(|mut f| {
        f.write_all(&vec![0u8; 1 << 20])?;
        f.sync_data()
    });
    let _ = std::fs::remove_file(&probe);
    wrote
}

/// fsyncs a directory, so that the entries created, renamed or removed in
/// it are durable (a file's own fsync does not make its name durable).
fn sync_dir_io(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all())
}

impl Catalog {
    /// A catalog in `dir`: sled at `dir/catalog`, checkpoint directories
    /// under `dir/chunks`; the index is checked and repaired as
    /// [`Catalog::open_recovering`] does.
    pub fn open(dir: &Path) -> Result<Catalog> {
        Ok(Self::open_recovering(dir)?.0)
    }

    /// Opens the catalog in `dir`. If sled cannot be opened or read (an
    /// error or a panic), its directory is moved aside to
    /// `catalog.damaged-{ms}` and a new index is built from the checkpoint
    /// directories. Either way the index is then made to agree with the
    /// directories: every directory whose manifest verifies is indexed,
    /// entries without one are dropped, `current` names the newest.
    ///
    /// A file system that cannot be written (full, over quota, read-only)
    /// is not damage: nothing is moved aside; the catalog opens *paused*
    /// ([`Recovery::paused`]), its index held in memory and built from the
    /// directories, so that restores read and no checkpoint is written.
    pub fn open_recovering(dir: &Path) -> Result<(Catalog, Recovery)> {
        let chunks = dir.join("chunks");
        // Created where missing, and the new entries made durable before
        // anything in them counts.
        let made = std::fs::create_dir_all(&chunks)
            .and_then(|()| sync_dir_io(dir))
            .and_then(|()| dir.parent().filter(|p| p.is_dir()).map_or(Ok(()), sync_dir_io));
        if let Err(e) = made {
            if is_unwritable(&e) {
                let why = ("creating".into(), chunks.clone(), e.to_string());
                return Self::open_paused(chunks, why);
            }
            return Err(not_a_directory(&[dir, &chunks]).unwrap_or_else(|| io_err("cannot create", &chunks, e)));
        }
        let path = dir.join("catalog");
        let mut rec = Recovery::default();
        let first = SledStore::open(&path).and_then(|store| {
            let cat = Catalog::new(Arc::new(store), chunks.clone());
            cat.reconcile(&mut rec).map(|_| cat)
        });
        match first {
            Ok(cat) => Ok((cat, rec)),
            Err(e) if SledStore::is_locked_error(&e) => Err(e),
            Err(Error::Unwritable { what, path, why }) => Self::open_paused(chunks, (what, path, why)),
            Err(e) => {
                // sled can fail (or panic) for want of space without an I/O
                // error that says so: a file system that cannot take a
                // small write is full, not damaged, and the catalog stays.
                if let Err(io) = probe_writable(dir) {
                    if is_unwritable(&io) {
                        return Self::open_paused(chunks, ("writing".into(), dir.to_path_buf(), io.to_string()));
                    }
                }
                // Keep the damaged files: they are evidence, and deleting is never recovery.
                let aside = dir.join(format!("catalog.damaged-{}", now_ms()));
                if path.exists() {
                    std::fs::rename(&path, &aside).map_err(|e| io_err("cannot move aside", &path, e))?;
                    sync_dir(dir)?;
                }
                rec = Recovery { damaged: Some((e.to_string(), aside)), ..Recovery::default() };
                let store = match SledStore::open(&path) {
                    Ok(s) => s,
                    Err(Error::Unwritable { what, path, why }) => {
                        return Self::open_paused(chunks, (what, path, why));
                    }
                    Err(e) => return Err(e),
                };
                let cat = Catalog::new(Arc::new(store), chunks);
                cat.reconcile(&mut rec)?;
                Ok((cat, rec))
            }
        }
    }

    /// The catalog of a file system that cannot be written (`why`: what
    /// failed, where, the system's error): an index in memory built from
    /// the directories, nothing written, checkpoints paused.
    fn open_paused(chunks: PathBuf, why: (String, PathBuf, String)) -> Result<(Catalog, Recovery)> {
        let mut cat = Catalog::new(Arc::new(MemStore::default()), chunks);
        cat.paused = Some(Arc::new(why));
        let mut rec = Recovery { paused: cat.paused(), ..Recovery::default() };
        cat.reconcile(&mut rec)?;
        Ok((cat, rec))
    }

    /// Why checkpoints are paused (the file system cannot be written), if
    /// they are.
    pub fn paused(&self) -> Option<String> {
        self.paused_error().map(|e| e.to_string())
    }

    fn paused_error(&self) -> Option<Error> {
        self.paused.as_ref().map(|p| {
            let why = Error::Unwritable { what: p.0.clone(), path: p.1.clone(), why: p.2.clone() };
            Error::Paused(why.to_string())
        })
    }

    /// A catalog over any store, with checkpoint directories under `chunks`.
    pub fn new(store: Arc<dyn Store>, chunks: PathBuf) -> Catalog {
        Catalog {
            store,
            chunks,
            corrupt: Arc::default(),
            verified: Arc::default(),
            paused: None,
            kept_upto: Arc::default(),
            marks: Arc::default(),
            pinned: Arc::default(),
        }
    }

    /// Records that a restore found checkpoint `id` corrupt (a chunk that
    /// fails verification or is missing): [`Catalog::list`] says so, for it
    /// and for the incrementals built on it. The mark is also written into
    /// the checkpoint's directory ([`CORRUPT_FILE`]), so that a later
    /// process lists it too (a start refused by a corrupt checkpoint, then
    /// one with `--restore none`); where that cannot be written, this
    /// process alone knows.
    pub fn mark_corrupt(&self, id: u64, why: &str) {
        self.corrupt.lock().unwrap_or_else(|p| p.into_inner()).insert(id, why.to_string());
        if self.paused.is_none() {
            let _ = std::fs::write(self.chunk_dir(id).join(CORRUPT_FILE), why);
        }
        // No longer known restorable, here or in a later process.
        self.verified.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        let _ = std::fs::remove_file(self.chunk_dir(id).join(VERIFIED_FILE));
    }

    /// Records that every file of checkpoint `id` verified (a restore read
    /// them all, or this process wrote them): retention may count it as
    /// restorable, in later processes too ([`VERIFIED_FILE`]; a mark that
    /// cannot be written only leaves a later process to count it after
    /// its own restore).
    pub fn mark_verified(&self, id: u64) {
        self.verified.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
        if self.paused.is_none() {
            let _ = std::fs::write(self.chunk_dir(id).join(VERIFIED_FILE), b"");
        }
    }

    /// Forgets a corrupt mark (a restore of it verified after all).
    pub fn clear_corrupt(&self, id: u64) {
        self.corrupt.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        let _ = std::fs::remove_file(self.chunk_dir(id).join(CORRUPT_FILE));
    }

    /// Why checkpoint `id` was found corrupt, if it was (by this process,
    /// or by an earlier one that marked its directory).
    pub fn corrupt_reason(&self, id: u64) -> Option<String> {
        let mut marks = self.corrupt.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = marks.get(&id) {
            return Some(why.clone());
        }
        let why = std::fs::read_to_string(self.chunk_dir(id).join(CORRUPT_FILE)).ok()?;
        marks.insert(id, why.clone());
        Some(why)
    }

    /// The directory of a checkpoint.
    pub fn chunk_dir(&self, id: u64) -> PathBuf {
        self.chunks.join(format!("{id:016x}"))
    }

    /// The file of a chunk or key list.
    pub fn chunk_path(&self, c: &ChunkRef) -> PathBuf {
        self.chunks.join(&c.key)
    }

    /// Reads a directory's manifest.
    fn dir_manifest(&self, id: u64) -> DirManifest {
        let path = self.chunk_dir(id).join(MANIFEST_FILE);
        match read_manifest_file(&path) {
            Ok(b) => match manifest::decode(id, &b) {
                Ok(m) => DirManifest::Valid(m, b),
                Err(e) => DirManifest::Invalid(e.to_string()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => DirManifest::Missing,
            Err(e) => DirManifest::Invalid(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// The checkpoint directories moved aside (`chunks/{id:016x}.damaged-{ms}`,
    /// by this open or an earlier one), sorted: they are never read again,
    /// nor deleted, until an operator repairs one and renames it back.
    pub fn set_aside(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.chunks)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|d| d.file_name().to_string_lossy().contains(".damaged-") && d.path().is_dir())
            .map(|d| d.path())
            .collect();
        v.sort();
        v
    }

    /// Ids of the checkpoint directories.
    fn dir_ids(&self) -> BTreeSet<u64> {
        let mut ids = BTreeSet::new();
        if let Ok(dirs) = std::fs::read_dir(&self.chunks) {
            for d in dirs.flatten() {
                let name = d.file_name().to_string_lossy().into_owned();
                if name.len() == 16 && d.path().is_dir() {
                    if let Ok(id) = u64::from_str_radix(&name, 16) {
                        ids.insert(id);
                    }
                }
            }
        }
        ids
    }

    /// Makes the index agree with the directories (see `open_recovering`).
    fn reconcile(&self, rec: &mut Recovery) -> Result<()> {
        let mut indexed: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for key in self.store.keys("manifest/")? {
            if let Some(id) = id_of(&key, "manifest/") {
                indexed.insert(id, self.store.get(&key)?.unwrap_or_default());
            }
        }
        let mut newest = None;
        let mut changed = false;
        let mut dirs = self.dir_ids();
        dirs.extend(indexed.keys().copied());
        for id in dirs {
            let in_index = indexed.get(&id);
            // The index's copy, when it verifies (it is only ever written
            // after the directory's MANIFEST, so it proves the checkpoint
            // once completed).
            let copy = in_index.and_then(|b| manifest::decode(id, b).ok().map(|m| (m, b.clone())));
            let is_dir = self.chunk_dir(id).is_dir();
            match self.dir_manifest(id) {
                DirManifest::Valid(_, bytes) => {
                    if in_index != Some(&bytes) {
                        self.store.put(&manifest_key(id), &bytes)?;
                        if self.paused.is_none() {
                            rec.reindexed.push(id);
                        }
                        changed = true;
                    }
                    newest = Some(id);
                }
                // Paused (nothing can be written): only what verifies is
                // indexed; repairs and moves wait for a start that can write.
                _ if self.paused.is_some() => {}
                _ if !is_dir => {
                    // The directory is gone: nothing to restore from.
                    if in_index.is_some() {
                        self.store.remove(&manifest_key(id))?;
                        rec.unindexed.push(id);
                        changed = true;
                    }
                }
                DirManifest::Missing if copy.is_some() => {
                    // A checkpoint of the earlier format, or a deleted MANIFEST:
                    // give it its directory manifest back.
                    let bytes = copy.map(|(_, b)| b).unwrap_or_default();
                    self.write_dir_manifest(id, &bytes)?;
                    rec.migrated.push(id);
                    newest = Some(id);
                }
                // No manifest anywhere: an interrupted checkpoint, for `collect`.
                DirManifest::Missing if in_index.is_none() => {}
                DirManifest::Invalid(why) => {
                    // A damaged MANIFEST. With a good copy in the index whose
                    // every chunk verifies, the file is rewritten from it;
                    // otherwise the files are kept for inspection, out of the way.
                    let checked = copy.map(|(m, bytes)| (self.verify(std::slice::from_ref(&m), |_| ()), bytes));
                    match checked {
                        Some((Ok(()), bytes)) => {
                            self.write_dir_manifest(id, &bytes)?;
                            rec.rewritten.push(id);
                            newest = Some(id);
                        }
                        Some((Err(e), _)) => {
                            let why = format!(
                                "its MANIFEST is damaged ({why}) and a file the catalog's copy names does not verify ({e})"
                            );
                            rec.moved_aside.push(self.move_aside(id, why)?);
                        }
                        None => {
                            let why =
                                format!("its MANIFEST is damaged ({why}) and the catalog holds no copy that verifies");
                            rec.moved_aside.push(self.move_aside(id, why)?);
                        }
                    }
                    if rec.moved_aside.last().is_some_and(|m| m.0 == id) && in_index.is_some() {
                        self.store.remove(&manifest_key(id))?;
                        changed = true;
                    }
                }
                DirManifest::Missing => {
                    // The index named it (so it once completed), but its copy
                    // does not verify and the MANIFEST file is gone.
                    let why = "its MANIFEST is missing and the catalog's copy does not verify".to_string();
                    rec.moved_aside.push(self.move_aside(id, why)?);
                    self.store.remove(&manifest_key(id))?;
                    changed = true;
                }
            }
        }
        if let Some(id) = newest {
            if self.current()? != Some(id) {
                self.store.put("current", &id.to_le_bytes())?;
                changed = true;
            }
        }
        if changed {
            self.store.flush()?;
        }
        Ok(())
    }

    /// Moves a checkpoint directory to `chunks/{id:016x}.damaged-{ms}` (a
    /// name the catalog no longer reads, never deleted).
    fn move_aside(&self, id: u64, why: String) -> Result<(u64, PathBuf, String)> {
        let dir = self.chunk_dir(id);
        let aside = self.chunks.join(format!("{id:016x}.damaged-{}", now_ms()));
        std::fs::rename(&dir, &aside).map_err(|e| io_err("cannot move aside", &dir, e))?;
        sync_dir(&self.chunks)?;
        Ok((id, aside, why))
    }

    /// Writes a directory's manifest: temporary name, fsync, rename, fsync
    /// of the directory. From the rename on, the checkpoint is complete.
    fn write_dir_manifest(&self, id: u64, bytes: &[u8]) -> Result<()> {
        let dir = self.chunk_dir(id);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let path = dir.join(MANIFEST_FILE);
        let mut f = std::fs::File::create(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
        f.write_all(bytes).map_err(|e| io_err("cannot write", &tmp, e))?;
        f.sync_all().map_err(|e| io_err("cannot sync", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io_err("cannot rename", &tmp, e))?;
        sync_dir(&dir)
    }

    /// Bytes of the catalog store and every checkpoint file.
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
        if let Some(e) = self.paused_error() {
            return Err(e);
        }
        let last = self.all_ids()?.into_iter().max().unwrap_or(0);
        let created = now_ms();
        let id = created.max(last + 1);
        let dir = self.chunk_dir(id);
        std::fs::create_dir(&dir).map_err(|e| io_err("cannot create", &dir, e))?;
        // The new directory's entry is durable before anything in it counts.
        sync_dir(&self.chunks)?;
        // The writer thread: write and fsync each file, rename it into
        // place, and hand its buffer back for the next chunk.
        let (tx, rx) = sync_channel::<Job>(3);
        let (spent, pool) = channel::<Vec<u8>>();
        let thread = std::thread::Builder::new()
            .name("hkvd-ckpt-write".into())
            .spawn(move || -> Result<()> {
                let mut direct = Direct::default();
                for Job { path, buf, at } in rx {
                    let mut tmp = path.clone().into_os_string();
                    tmp.push(".tmp");
                    let tmp = PathBuf::from(tmp);
                    direct.write(&tmp, &buf[at])?;
                    std::fs::rename(&tmp, &path).map_err(|e| io_err("cannot rename", &tmp, e))?;
                    let _ = spent.send(buf);
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
            pool,
            thread: Some(thread),
            dir,
        })
    }

    /// Ids that have a directory or an index entry.
    fn all_ids(&self) -> Result<BTreeSet<u64>> {
        let mut ids: BTreeSet<u64> =
            self.store.keys("manifest/")?.iter().filter_map(|k| id_of(k, "manifest/")).collect();
        ids.extend(self.dir_ids());
        Ok(ids)
    }

    /// How many checkpoints are indexed (read from the keys alone).
    pub fn count(&self) -> Result<usize> {
        Ok(self.store.keys("manifest/")?.len())
    }

    /// Every indexed checkpoint, newest first. Status: `complete`;
    /// `corrupt: …` once a restore found one of its files corrupt or
    /// missing; `unusable: base … is missing` (or `… is corrupt`) for an
    /// incremental whose chain is broken; or the manifest's own error.
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
        let kinds: BTreeMap<u64, Kind> =
            out.iter().filter_map(|l| l.manifest.as_ref().map(|m| (l.id, m.kind))).collect();
        for l in out.iter_mut().filter(|l| l.manifest.is_some()) {
            if let Some(why) = self.corrupt_reason(l.id) {
                l.status = format!("corrupt: {why}");
                continue;
            }
            // Walk the chain of bases (bounded: ids only go down).
            let mut at = kinds.get(&l.id).copied();
            while let Some(Kind::Incremental { base }) = at {
                if base >= l.id || !kinds.contains_key(&base) {
                    l.status = format!("unusable: base {base:016x} is missing");
                    break;
                }
                if self.corrupt_reason(base).is_some() {
                    l.status = format!("unusable: base {base:016x} is corrupt");
                    break;
                }
                at = kinds.get(&base).copied();
            }
        }
        Ok(out)
    }

    /// A checkpoint's manifest: from the index, else from its directory.
    pub fn manifest(&self, id: u64) -> Result<Manifest> {
        match self.store.get(&manifest_key(id))? {
            Some(b) => manifest::decode(id, &b),
            None => match self.dir_manifest(id) {
                DirManifest::Valid(m, _) => Ok(m),
                DirManifest::Invalid(why) => Err(Error::CorruptManifest { id, why }),
                DirManifest::Missing => Err(Error::NotFound(format!("{id:016x}"))),
            },
        }
    }

    /// The id the `current` pointer names.
    pub fn current(&self) -> Result<Option<u64>> {
        Ok(self.store.get("current")?.and_then(|b| b.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)))
    }

    /// Reads and verifies one chunk.
    pub fn read_chunk(&self, id: u64, c: &ChunkRef) -> Result<Chunk> {
        chunk::decode(id, &c.key, &self.read_whole(id, c)?, c.checksum)
    }

    /// The bytes of chunk or key list `c` of checkpoint `id`, read buffered
    /// after [`Catalog::open_chunk`] checked the file.
    fn read_whole(&self, id: u64, c: &ChunkRef) -> Result<Vec<u8>> {
        let mut b = Vec::new();
        self.read_buffered(id, c, &mut b)?;
        Ok(b)
    }

    /// Chunk or key list `c` of checkpoint `id` read without `O_DIRECT`
    /// into `buf` (its bytes only, at most the manifest's length), after
    /// [`Catalog::open_chunk`] checked the file.
    fn read_buffered(&self, id: u64, c: &ChunkRef, buf: &mut Vec<u8>) -> Result<()> {
        let (f, len) = self.open_chunk(id, c, false)?;
        buf.clear();
        buf.reserve(len);
        std::io::Read::read_to_end(&mut std::io::Read::take(&f, len as u64), buf)
            .map_err(|_| Error::MissingChunk { id, chunk: c.key.clone() })?;
        Ok(())
    }

    /// Opens chunk or key list `c` of checkpoint `id` for reading (with
    /// `O_DIRECT` when `direct`): a regular file of exactly the bytes its
    /// manifest says, checked before a byte is read or a buffer sized.
    /// Returns the file and its length. A file grown past its manifest's
    /// size was read whole at its size on disk before its header was
    /// checked: a tester's `truncate -s 100G` of one chunk aborted the
    /// daemon (a 100 GiB allocation), at start or at a restore that threw
    /// away every live table. A FIFO in a chunk's place hung the start
    /// (opened without `O_NONBLOCK`, it waits for a writer). An open that
    /// fails (missing, no permission) is `MissingChunk`, an error of the
    /// open itself where `O_DIRECT` is refused (for the caller to retry
    /// buffered).
    fn open_chunk(&self, id: u64, c: &ChunkRef, direct: bool) -> Result<(std::fs::File, usize), OpenError> {
        let path = self.chunk_path(c);
        let f = open_nonblocking(&path, direct).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported if direct => OpenError::NoDirect,
            _ => OpenError::Failed(Error::MissingChunk { id, chunk: c.key.clone() }),
        })?;
        let corrupt = |why: String| OpenError::Failed(Error::CorruptChunk { id, chunk: c.key.clone(), why });
        let meta = f.metadata().map_err(|e| corrupt(format!("cannot stat {}: {e}", path.display())))?;
        if !meta.is_file() {
            return Err(corrupt(format!("{} is {}, not a regular file", path.display(), file_kind(&meta))));
        }
        if meta.len() != c.bytes {
            return Err(corrupt(format!("{} bytes on disk, the manifest says {}", meta.len(), c.bytes)));
        }
        let len = usize::try_from(c.bytes)
            .map_err(|_| corrupt(format!("the manifest says {} bytes, more than this machine addresses", c.bytes)))?;
        Ok((f, len))
    }

    /// Reads one chunk file into `buf` (grown when too small, else reused:
    /// a fresh buffer per chunk costs page faults and zeroing each time)
    /// as `dd iflag=direct` does, bypassing the page cache: the bytes are
    /// read once, by the disk into `buf`, with no copy from a cache nor
    /// cache pages to allocate and evict. Where the file system refuses
    /// `O_DIRECT` (tmpfs) the file is read buffered. Returns where in `buf`
    /// the file's bytes lie; verify them with [`chunk::verify`].
    pub fn read_into(&self, id: u64, c: &ChunkRef, buf: &mut Vec<u8>) -> Result<std::ops::Range<usize>> {
        let missing = || Error::MissingChunk { id, chunk: c.key.clone() };
        match self.open_chunk(id, c, true) {
            Ok((f, len)) => match read_direct(&f, len, buf) {
                Ok(r) => return Ok(r),
                // EINVAL (tmpfs), EOPNOTSUPP: this file system does not do O_DIRECT.
                Err(e) if matches!(e.kind(), std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported) => {}
                Err(_) => return Err(missing()),
            },
            Err(OpenError::NoDirect) => {}
            Err(OpenError::Failed(e)) => return Err(e),
        }
        self.read_buffered(id, c, buf)?;
        Ok(0..buf.len())
    }

    /// Reads one chunk into `buf` ([`Catalog::read_into`]) and verifies it;
    /// its entries are decoded as they are taken ([`chunk::View::split`]).
    pub fn read_chunk_in(&self, id: u64, c: &ChunkRef, mut buf: Vec<u8>) -> Result<chunk::Read> {
        let at = self.read_into(id, c, &mut buf)?;
        chunk::Read::verify(id, &c.key, buf, at, c.checksum)
    }

    /// Reads and verifies one key list.
    pub fn read_keys(&self, id: u64, c: &ChunkRef) -> Result<Vec<u64>> {
        chunk::decode_keys(id, &c.key, &self.read_whole(id, c)?, c.checksum)
    }

    /// The manifests to apply to restore `id`: its full base first. A base
    /// that is missing or whose manifest does not verify is
    /// [`Error::BrokenChain`], naming it.
    pub fn chain(&self, id: u64) -> Result<Vec<Manifest>> {
        let mut chain = vec![self.manifest(id)?];
        while let Some(Kind::Incremental { base }) = chain.last().map(|m| m.kind) {
            if chain.len() > 100_000 || chain.iter().any(|m| m.id == base) {
                return Err(Error::CorruptManifest { id, why: "its chain of bases loops".into() });
            }
            let m = self.manifest(base).map_err(|e| Error::BrokenChain {
                id,
                base,
                why: match e {
                    Error::NotFound(_) => "missing".into(),
                    e => format!("unusable ({e})"),
                },
            })?;
            chain.push(m);
        }
        chain.reverse();
        Ok(chain)
    }

    /// Reads every chunk and key list of a chain and checks its checksum, so
    /// that a restore never loads half a table. Calls `progress(bytes)` per file.
    pub fn verify(&self, chain: &[Manifest], mut progress: impl FnMut(u64)) -> Result<()> {
        for m in chain {
            for t in &m.tables {
                for c in &t.chunks {
                    self.read_chunk(m.id, c)?;
                    progress(c.bytes);
                }
                for c in &t.keys {
                    self.read_keys(m.id, c)?;
                    progress(c.bytes);
                }
            }
            self.mark_verified(m.id);
        }
        Ok(())
    }

    /// Keeps every checkpoint that exists now out of retention's reach:
    /// [`Catalog::collect`] removes none of them, however many newer ones
    /// are taken (a daemon started with empty tables, `--restore none`,
    /// keeps the data it did not restore on disk).
    pub fn keep_existing(&self) {
        *self.kept_upto.lock().unwrap_or_else(|p| p.into_inner()) = self.dir_ids().last().copied();
    }

    /// From now on retention counts the checkpoints earlier processes
    /// marked restorable ([`VERIFIED_FILE`]): called once the restore at
    /// start is done (or skipped).
    pub fn trust_marks(&self) {
        self.marks.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The tables now hold checkpoint `id`'s data (a restore): retention
    /// keeps it and its chain until this process writes a newer one.
    pub fn pin(&self, id: u64) {
        *self.pinned.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    }

    /// Removes leftovers of interrupted checkpoints and, by retention,
    /// complete checkpoints older than the newest `keep` *restorable* ones.
    /// A checkpoint counts as restorable only when every checkpoint of its
    /// chain was verified, by this process or an earlier one (a restore
    /// read them, or a daemon wrote them: [`Catalog::mark_verified`]) and
    /// none was found corrupt since; retention keeps the newest
    /// `keep` of those with their chains, keeps every checkpoint newer than
    /// the oldest of them (verified or not: one not yet verified is not
    /// deleted in favour of older ones), and removes only what is older.
    /// With fewer than `keep` restorable checkpoints it removes nothing, so
    /// a lowered `keep` never deletes what a restore may still need.
    ///
    /// A leftover is provably interrupted: its directory has no `MANIFEST`
    /// file and the index has no entry for it (both are written only once
    /// every chunk is durable), and it is not `running`. A directory whose
    /// `MANIFEST` is damaged is never collected: the next open repairs it
    /// or moves it aside. What is complete is read from the directories,
    /// not the index, so a damaged index never causes a deletion. Returns
    /// the ids removed.
    pub fn collect(&self, keep: usize, running: Option<u64>) -> Result<Vec<u64>> {
        if self.paused.is_some() {
            return Ok(vec![]);
        }
        let mut complete: BTreeMap<u64, Manifest> = BTreeMap::new();
        let mut leftovers = vec![];
        let indexed: BTreeSet<u64> =
            self.store.keys("manifest/")?.iter().filter_map(|k| id_of(k, "manifest/")).collect();
        for id in self.dir_ids() {
            match self.dir_manifest(id) {
                DirManifest::Valid(m, _) => {
                    complete.insert(id, m);
                }
                DirManifest::Missing if Some(id) != running && !indexed.contains(&id) => leftovers.push(id),
                _ => {}
            }
        }
        // Per complete checkpoint, its chain (itself first), when whole.
        let chain_of = |m: &Manifest| -> Option<Vec<u64>> {
            let mut ids = vec![];
            let mut next = Some(m);
            while let Some(x) = next {
                if ids.contains(&x.id) {
                    return None;
                }
                ids.push(x.id);
                next = match x.kind {
                    Kind::Incremental { base } => Some(complete.get(&base)?),
                    Kind::Full => None,
                };
            }
            Some(ids)
        };
        // Known restorable: verified by this process, or marked so by an
        // earlier one and not found corrupt since (a daemon restarted
        // between checkpoints knew only the one it restored and the one it
        // wrote, so a keep of 3 or more removed nothing, ever: a tester's
        // state directory grew to 28 checkpoints, 1.9 GB, under keep 6).
        let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let marks = self.marks.load(std::sync::atomic::Ordering::Relaxed);
        for &id in complete.keys().filter(|_| marks) {
            if !verified.contains(&id)
                && self.chunk_dir(id).join(VERIFIED_FILE).exists()
                && self.corrupt_reason(id).is_none()
            {
                verified.insert(id);
            }
        }
        let mut retained: BTreeSet<u64> = BTreeSet::new();
        let mut counted = 0;
        let mut cutoff = None;
        for m in complete.values().rev() {
            if counted == keep.max(1) {
                break;
            }
            let Some(chain) = chain_of(m) else { continue };
            if chain.iter().all(|id| verified.contains(id)) {
                retained.extend(chain);
                counted += 1;
                cutoff = Some(m.id);
            }
        }
        let pinned = *self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(chain) = pinned.and_then(|id| complete.get(&id)).and_then(&chain_of) {
            retained.extend(chain);
        }
        // Fewer restorable checkpoints than `keep`: nothing is expired.
        let cutoff = if counted == keep.max(1) { cutoff } else { None };
        let mut removed = vec![];
        let kept_upto = *self.kept_upto.lock().unwrap_or_else(|p| p.into_inner());
        let expired =
            |id: u64| cutoff.is_some_and(|c| id < c) && !retained.contains(&id) && kept_upto.is_none_or(|k| id > k);
        for (&id, _) in complete.iter().filter(|(id, _)| expired(**id)) {
            // Index first, then the directory's manifest: from then on the
            // rest is a leftover, whatever happens next.
            self.store.remove(&manifest_key(id))?;
            self.store.flush()?;
            let dir = self.chunk_dir(id);
            let mf = dir.join(MANIFEST_FILE);
            std::fs::remove_file(&mf).map_err(|e| io_err("cannot remove", &mf, e))?;
            sync_dir(&dir)?;
            std::fs::remove_dir_all(&dir).map_err(|e| io_err("cannot remove", &dir, e))?;
            removed.push(id);
        }
        for id in leftovers {
            self.store.remove(&manifest_key(id))?;
            let dir = self.chunk_dir(id);
            std::fs::remove_dir_all(&dir).map_err(|e| io_err("cannot remove", &dir, e))?;
            removed.push(id);
        }
        // Index entries whose directory is gone.
        let dirs = self.dir_ids();
        for key in self.store.keys("manifest/")? {
            if id_of(&key, "manifest/").is_some_and(|id| !dirs.contains(&id) && Some(id) != running) {
                self.store.remove(&key)?;
            }
        }
        self.store.flush()?;
        removed.sort_unstable();
        Ok(removed)
    }
}

/// Writes files as `dd oflag=direct conv=fsync` does, bypassing the page
/// cache: measured on a 1 GiB table (4 Mi × dim 64, 2 cores), two thirds of
/// a checkpoint's CPU time was the kernel copying buffered writes into the
/// page cache (`copy_folio_from_iter_atomic`), which the disk never
/// needed. The block-aligned part of a file goes through an `O_DIRECT`
/// descriptor from where it lies when that is aligned (chunks are encoded
/// so), else from a copy in an aligned buffer; its tail (under one block)
/// through an ordinary descriptor; then `fdatasync`. Where the file
/// system refuses `O_DIRECT` (tmpfs says EINVAL), every file is written
/// buffered from then on (EOPNOTSUPP likewise).
#[derive(Default)]
struct Direct {
    buf: Vec<u8>,
    refused: bool,
}

/// `O_DIRECT` alignment of addresses, lengths and offsets: the largest
/// logical block size in common use.
const BLOCK: usize = 4096;

impl Direct {
    fn write(&mut self, path: &Path, bytes: &[u8]) -> Result<()> {
        let body = bytes.len() / BLOCK * BLOCK;
        if !self.refused && body > 0 {
            match self.write_direct(path, bytes, body) {
                Ok(()) => return Ok(()),
                // EINVAL (tmpfs), EOPNOTSUPP: this file system does not do O_DIRECT.
                Err(e) if matches!(e.kind(), std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported) => {
                    self.refused = true
                }
                Err(e) => return Err(io_err("cannot write", path, e)),
            }
        }
        let mut f = std::fs::File::create(path).map_err(|e| io_err("cannot create", path, e))?;
        f.write_all(bytes).map_err(|e| io_err("cannot write", path, e))?;
        f.sync_data().map_err(|e| io_err("cannot sync", path, e))
    }

    fn write_direct(&mut self, path: &Path, bytes: &[u8], body: usize) -> std::io::Result<()> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(path)?;
        if (bytes.as_ptr() as usize).is_multiple_of(BLOCK) {
            // Encoded in place at an aligned address (chunks): no copy.
            (&f).write_all(&bytes[..body])?;
        } else {
            if self.buf.len() < body + BLOCK {
                self.buf = vec![0; body + BLOCK];
            }
            let skip = (BLOCK - self.buf.as_ptr() as usize % BLOCK) % BLOCK;
            let aligned = &mut self.buf[skip..skip + body];
            aligned.copy_from_slice(&bytes[..body]);
            (&f).write_all(aligned)?;
        }
        if body < bytes.len() {
            let tail = std::fs::OpenOptions::new().write(true).open(path)?;
            tail.write_all_at(&bytes[body..], body as u64)?;
        }
        f.sync_data()
    }
}

/// Why [`Catalog::open_chunk`] did not open a chunk.
enum OpenError {
    /// `O_DIRECT` was asked for and this file system refuses it.
    NoDirect,
    /// The chunk is missing, or not what its manifest says.
    Failed(Error),
}

impl From<OpenError> for Error {
    fn from(e: OpenError) -> Error {
        match e {
            OpenError::Failed(e) => e,
            // (Only an open with `O_DIRECT` says this.)
            OpenError::NoDirect => Error::Store("the file system refused O_DIRECT".into()),
        }
    }
}

/// Opens `path` for reading without waiting: `O_NONBLOCK` makes a FIFO
/// open at once (it changes nothing for a regular file's reads), so that
/// the caller can refuse what is not a regular file.
fn open_nonblocking(path: &Path, direct: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut flags = rustix::fs::OFlags::NONBLOCK;
    if direct {
        flags |= rustix::fs::OFlags::DIRECT;
    }
    std::fs::OpenOptions::new().read(true).custom_flags(flags.bits() as i32).open(path)
}

/// The most bytes a `MANIFEST` file is read to: a manifest names each
/// chunk in about 150 bytes of JSON, so 256 MiB name 13 TB of 8 MiB
/// chunks; a larger file is damage, and is not read into memory whole.
const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// The bytes of the `MANIFEST` file at `path`, refused (`InvalidData`)
/// when it is not a regular file (a FIFO would hang the start) or is
/// larger than [`MAX_MANIFEST_BYTES`].
fn read_manifest_file(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = open_nonblocking(path, false)?;
    let meta = f.metadata()?;
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    if !meta.is_file() {
        return Err(bad(format!("{}, not a regular file", file_kind(&meta))));
    }
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(bad(format!("{} bytes, more than a manifest's {MAX_MANIFEST_BYTES}", meta.len())));
    }
    let mut b = Vec::with_capacity(meta.len() as usize);
    std::io::Read::read_to_end(&mut std::io::Read::take(&f, MAX_MANIFEST_BYTES), &mut b)?;
    Ok(b)
}

/// The first of `paths` that exists and is no directory (a dangling
/// symlink, a regular file), as an error that says what it is and what
/// to do: creating the directories said "File exists" of a regular file
/// where `chunks` goes.
fn not_a_directory(paths: &[&Path]) -> Option<Error> {
    paths.iter().find_map(|p| {
        let meta = std::fs::symlink_metadata(p).ok()?;
        let kind = match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => return None,
            Ok(m) if m.is_file() => "a regular file",
            Ok(m) => file_kind(&m),
            Err(_) if meta.file_type().is_symlink() => "a symlink to nothing",
            Err(_) => file_kind(&meta),
        };
        Some(Error::Store(format!(
            "{} is {kind}, where hkvd keeps checkpoints in a directory: move it away (hkvd creates the \
             directory), or give --state-dir another path",
            p.display()
        )))
    })
}

/// What a file that is not a regular file is, in words.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "something else"
    }
}

/// Reads `len` bytes of file `f` (opened with `O_DIRECT`, its length
/// checked against its manifest: [`Catalog::open_chunk`]) into a
/// block-aligned place of `buf` (`len` rounded up to a block); where they
/// lie (fewer bytes where the file ended sooner, which verifying finds).
fn read_direct(f: &std::fs::File, len: usize, buf: &mut Vec<u8>) -> std::io::Result<std::ops::Range<usize>> {
    use std::io::Read;
    let want = len.div_ceil(BLOCK) * BLOCK;
    if buf.len() < want + BLOCK {
        *buf = vec![0; want + BLOCK];
    }
    let at = (BLOCK - buf.as_ptr() as usize % BLOCK) % BLOCK;
    let dst = &mut buf[at..at + want];
    let mut got = 0;
    // Bounded: each read returns at least one byte or ends the loop.
    while got < len {
        match (&*f).read(&mut dst[got..])? {
            0 => break,
            r => got += r,
        }
    }
    Ok(at..at + got.min(len))
}

/// Writes the chunks of one checkpoint, then commits its manifest.
pub struct ChunkWriter {
    cat: Catalog,
    id: u64,
    created: u64,
    bytes: u64,
    entries: u64,
    tx: Option<SyncSender<Job>>,
    /// Buffers the writer thread is done with, reused: a fresh 8 MiB
    /// buffer per chunk costs page faults and zeroing each time.
    pool: Receiver<Vec<u8>>,
    thread: Option<JoinHandle<Result<()>>>,
    dir: PathBuf,
}

/// A file for the writer thread: its bytes are `buf[at]`.
struct Job {
    path: PathBuf,
    buf: Vec<u8>,
    at: std::ops::Range<usize>,
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

    /// Stores one chunk of the table at index `table` in the manifest's
    /// table list (files are named by that index, never by the table's
    /// name, whose 255 bytes would not fit a file name with the suffixes).
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        table: u32,
        shard: u32,
        seq: u32,
        dim: usize,
        keys: &[u64],
        scores: &[u64],
        values: &[f32],
    ) -> Result<ChunkRef> {
        let name = format!("t{table:04}.{shard:04}.{seq:08}");
        let key = format!("{:016x}/{name}", self.id);
        // Encoded straight into a block-aligned place of a reused buffer,
        // which the writer thread writes with O_DIRECT as it is.
        let n = chunk::encoded_len(keys.len(), values.len());
        let mut buf = self.pool.try_recv().unwrap_or_default();
        if buf.len() < n + BLOCK {
            buf = vec![0; n + BLOCK];
        }
        let at = (BLOCK - buf.as_ptr() as usize % BLOCK) % BLOCK;
        let checksum = chunk::encode_into(&mut buf[at..at + n], dim, keys, scores, values);
        let len = n as u64;
        self.send(self.dir.join(name), buf, at..at + n)?;
        self.bytes += len;
        self.entries += keys.len() as u64;
        Ok(ChunkRef { key, shard, entries: keys.len() as u64, bytes: len, checksum })
    }

    /// Stores one key list (the live keys of a shard, or a part of them)
    /// of the table at index `table` in the manifest.
    pub fn write_keys(&mut self, table: u32, shard: u32, seq: u32, keys: &[u64]) -> Result<ChunkRef> {
        let name = format!("t{table:04}.{shard:04}.keys{seq:08}");
        let key = format!("{:016x}/{name}", self.id);
        let (b, checksum) = chunk::encode_keys(keys);
        let len = b.len() as u64;
        let all = 0..b.len();
        self.send(self.dir.join(name), b, all)?;
        self.bytes += len;
        Ok(ChunkRef { key, shard, entries: keys.len() as u64, bytes: len, checksum })
    }

    fn send(&mut self, path: PathBuf, buf: Vec<u8>, at: std::ops::Range<usize>) -> Result<()> {
        let sent = self.tx.as_ref().map(|tx| tx.send(Job { path, buf, at }));
        if !matches!(sent, Some(Ok(()))) {
            // The writer stopped: report its error.
            self.finish_writes()?;
            return Err(Error::Store("the checkpoint writer stopped".into()));
        }
        Ok(())
    }

    /// Flushes the chunks, then writes and flushes the manifest, then the
    /// `current` pointer: a crash at any point leaves either the previous
    /// complete checkpoint current, or this one complete.
    pub fn commit(mut self, kind: Kind, tables: Vec<TableEntry>, daemon_version: &str) -> Result<Manifest> {
        // Every chunk file is synced and renamed; make the renames durable.
        self.finish_writes()?;
        sync_dir(&self.dir)?;
        let m = Manifest {
            format: FORMAT_VERSION,
            id: self.id,
            created_unix_ms: self.created,
            finished_unix_ms: now_ms(),
            daemon_version: daemon_version.into(),
            kind,
            tables,
        };
        let bytes = manifest::encode(&m);
        // The directory's manifest is the commit point; the index follows it
        // and is rebuilt from it if this process dies before the flush.
        self.cat.write_dir_manifest(self.id, &bytes)?;
        // Every file was written and synced by this process just now.
        self.cat.mark_verified(self.id);
        // The tables' data is in a newer checkpoint than the one restored.
        *self.cat.pinned.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let s = &self.cat.store;
        let indexed = s
            .put(&manifest_key(self.id), &bytes)
            .and_then(|_| s.put("current", &self.id.to_le_bytes()))
            .and_then(|_| s.flush());
        if let Err(e) = indexed {
            return Err(Error::Store(format!(
                "checkpoint {:016x} is complete on disk, but the catalog could not index it ({e}); \
                 it is indexed again at the next start",
                self.id
            )));
        }
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
            policy: hkv_proto::Policy::Lru,
            mode: hkv_proto::Mode::Single,
            spec: serde_json::json!({}),
            shards: 1,
            entries: chunks.iter().map(|c| c.entries).sum(),
            full,
            watermarks: vec![0],
            clocks: vec![0],
            chunks,
            keys: vec![],
        }
    }

    #[test]
    fn write_list_chain_collect() {
        let dir = tempfile::tempdir().unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let mut w = cat.begin().unwrap();
        let c = w.write(0, 0, 0, 2, &[1, 2], &[5, 6], &[0.5; 4]).unwrap();
        let a = w.commit(Kind::Full, vec![table("t", vec![c], true)], "test").unwrap();
        let mut w = cat.begin().unwrap();
        assert!(w.id() > a.id);
        let c = w.write(0, 0, 0, 2, &[3], &[7], &[1.5; 2]).unwrap();
        let b = w.commit(Kind::Incremental { base: a.id }, vec![table("t", vec![c], false)], "test").unwrap();
        // An interrupted third one: chunks, no manifest.
        let mut w = cat.begin().unwrap();
        let leftover = w.id();
        w.write(0, 0, 0, 2, &[9], &[9], &[0.0; 2]).unwrap();
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

    /// Issue 24, finding 1: a damaged sled catalog made every checkpoint look
    /// like a leftover, and start-up deleted them all. Now each damage is
    /// repaired from the directories and nothing that verifies is deleted.
    #[test]
    fn a_damaged_index_is_rebuilt_from_the_directories_and_nothing_is_deleted() {
        type Damage = fn(&Path);
        let db = |p: &Path| p.join("catalog").join("db");
        let damages: [(&str, Damage); 6] = [
            ("truncate to 0", |p| {
                std::fs::File::options().write(true).open(p.join("catalog/db")).unwrap().set_len(0).unwrap()
            }),
            ("truncate to half", |p| {
                let f = std::fs::File::options().write(true).open(p.join("catalog/db")).unwrap();
                let n = f.metadata().unwrap().len();
                f.set_len(n / 2).unwrap();
            }),
            ("zero", |p| {
                let n = std::fs::metadata(p.join("catalog/db")).unwrap().len() as usize;
                std::fs::write(p.join("catalog/db"), vec![0u8; n]).unwrap();
            }),
            ("delete", |p| std::fs::remove_dir_all(p.join("catalog")).unwrap()),
            ("flip bytes", |p| {
                let mut b = std::fs::read(p.join("catalog/db")).unwrap();
                for i in (0..b.len()).step_by(97) {
                    b[i] ^= 0x5a;
                }
                std::fs::write(p.join("catalog/db"), b).unwrap();
            }),
            ("garbage file for a directory", |p| {
                std::fs::remove_dir_all(p.join("catalog")).unwrap();
                std::fs::write(p.join("catalog"), b"not a database").unwrap();
            }),
        ];
        for (what, damage) in damages {
            let dir = tempfile::tempdir().unwrap();
            let mut ids = vec![];
            {
                let cat = Catalog::open(dir.path()).unwrap();
                for i in 0..3u64 {
                    let mut w = cat.begin().unwrap();
                    let c = w.write(0, 0, 0, 2, &[i], &[i], &[0.5; 2]).unwrap();
                    ids.push(w.commit(Kind::Full, vec![table("t", vec![c], true)], "test").unwrap().id);
                }
                // An interrupted fourth: a leftover to collect.
                let mut w = cat.begin().unwrap();
                w.write(0, 0, 0, 2, &[9], &[9], &[0.0; 2]).unwrap();
            }
            assert!(db(dir.path()).exists());
            damage(dir.path());
            let (cat, rec) = Catalog::open_recovering(dir.path()).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(rec.repaired(), "{what}: {rec:?}");
            let listed: Vec<u64> = cat.list().unwrap().iter().filter(|l| l.manifest.is_some()).map(|l| l.id).collect();
            assert_eq!(listed, [ids[2], ids[1], ids[0]], "{what}");
            assert_eq!(cat.current().unwrap(), Some(ids[2]), "{what}");
            assert_eq!(cat.collect(3, None).unwrap().len(), 1, "{what}: only the leftover goes");
            for id in &ids {
                assert!(cat.chunk_dir(*id).join(MANIFEST_FILE).exists(), "{what}: {id:x} deleted");
                cat.verify(&cat.chain(*id).unwrap(), |_| ()).unwrap();
            }
        }
    }

    /// A chain F1 <- I2 <- I3 in a fresh directory.
    fn chain_of_three() -> (tempfile::TempDir, [u64; 3]) {
        let dir = tempfile::tempdir().unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let mut ids = [0; 3];
        for (i, k) in [1u64, 2, 3].into_iter().enumerate() {
            let mut w = cat.begin().unwrap();
            let c = w.write(0, 0, 0, 2, &[k, k + 10], &[k, k], &[0.5; 4]).unwrap();
            let kind = if i == 0 { Kind::Full } else { Kind::Incremental { base: ids[i - 1] } };
            ids[i] = w.commit(kind, vec![table("t", vec![c], i == 0)], "test").unwrap().id;
        }
        (dir, ids)
    }

    fn aside(root: &Path, id: u64) -> Vec<PathBuf> {
        let prefix = format!("{id:016x}.damaged-");
        std::fs::read_dir(root.join("chunks"))
            .unwrap()
            .flatten()
            .filter(|d| d.file_name().to_string_lossy().starts_with(&prefix))
            .map(|d| d.path())
            .collect()
    }

    /// Found testing issue 24: flipping byte 0 of an incremental's MANIFEST
    /// (or truncating it to 100 bytes) made the next open drop it from the
    /// index as "unindexed" and `collect` delete its directory with every
    /// good chunk, although the catalog held a copy that verified; damaging
    /// a base's MANIFEST that way broke the chain on top of it, which still
    /// listed as complete. Now a damaged MANIFEST is rewritten from the
    /// index's copy when that copy and its chunks verify; otherwise the
    /// directory is moved aside, never deleted, and the incrementals on it
    /// list as unusable, naming the missing base.
    #[test]
    fn a_damaged_manifest_is_rewritten_from_the_index_or_moved_aside_never_deleted() {
        type Damage = fn(&Path);
        let damages: [(&str, Damage); 3] = [
            ("flip byte 0", |p| {
                let mut b = std::fs::read(p).unwrap();
                b[0] ^= 0xff;
                std::fs::write(p, b).unwrap();
            }),
            ("truncate to 100 bytes", |p| std::fs::File::options().write(true).open(p).unwrap().set_len(100).unwrap()),
            ("zero", |p| std::fs::write(p, vec![0u8; std::fs::metadata(p).unwrap().len() as usize]).unwrap()),
        ];
        for (what, damage) in damages {
            for victim in [1, 2] {
                let (dir, ids) = chain_of_three();
                let id = ids[victim];
                damage(&dir.path().join(format!("chunks/{id:016x}/{MANIFEST_FILE}")));
                let (cat, rec) = Catalog::open_recovering(dir.path()).unwrap();
                assert_eq!(rec.rewritten, [id], "{what}: {rec:?}");
                assert!(rec.moved_aside.is_empty() && rec.unindexed.is_empty(), "{what}: {rec:?}");
                assert_eq!(cat.collect(3, None).unwrap(), Vec::<u64>::new(), "{what}");
                let listed = cat.list().unwrap();
                assert!(listed.iter().all(|l| l.status == "complete"), "{what}: {listed:?}");
                assert_eq!(listed.len(), 3);
                let chain = cat.chain(ids[2]).unwrap();
                cat.verify(&chain, |_| ()).unwrap();
                // The file itself verifies again: a later open finds nothing to repair.
                drop(cat);
                let (_, rec) = Catalog::open_recovering(dir.path()).unwrap();
                assert!(!rec.repaired(), "{what}: {rec:?}");
            }
        }
    }

    #[test]
    fn a_damaged_manifest_without_a_verifying_copy_is_moved_aside_and_its_chain_says_so() {
        // The index's copy is good, but a chunk is not: moved aside.
        let (dir, ids) = chain_of_three();
        let i2 = dir.path().join(format!("chunks/{:016x}", ids[1]));
        std::fs::write(i2.join(MANIFEST_FILE), b"garbage").unwrap();
        let chunk = i2.join("t0000.0000.00000000");
        let mut b = std::fs::read(&chunk).unwrap();
        b[25] ^= 1;
        std::fs::write(&chunk, b).unwrap();
        let (cat, rec) = Catalog::open_recovering(dir.path()).unwrap();
        assert_eq!(rec.moved_aside.len(), 1, "{rec:?}");
        assert_eq!(rec.moved_aside[0].0, ids[1]);
        assert!(rec.moved_aside[0].2.contains("does not verify"), "{rec:?}");
        let moved = aside(dir.path(), ids[1]);
        assert_eq!(moved.len(), 1);
        assert!(moved[0].join("t0000.0000.00000000").exists(), "the chunks are kept");
        assert_eq!(cat.collect(3, None).unwrap(), Vec::<u64>::new());
        assert!(moved[0].exists(), "collect leaves what was moved aside");
        let listed = cat.list().unwrap();
        let i3 = listed.iter().find(|l| l.id == ids[2]).unwrap();
        assert_eq!(i3.status, format!("unusable: base {:016x} is missing", ids[1]));
        let e = cat.chain(ids[2]).unwrap_err();
        assert!(matches!(e, Error::BrokenChain { base, .. } if base == ids[1]), "{e}");
        assert!(e.to_string().contains(&format!("{:016x}", ids[1])), "{e}");
        assert_eq!(listed.iter().find(|l| l.id == ids[0]).unwrap().status, "complete");

        // No copy at all (the catalog is gone too): moved aside, not deleted.
        let (dir, ids) = chain_of_three();
        std::fs::write(dir.path().join(format!("chunks/{:016x}/{MANIFEST_FILE}", ids[2])), b"x").unwrap();
        std::fs::remove_dir_all(dir.path().join("catalog")).unwrap();
        let (cat, rec) = Catalog::open_recovering(dir.path()).unwrap();
        assert_eq!(rec.moved_aside.iter().map(|m| m.0).collect::<Vec<_>>(), [ids[2]], "{rec:?}");
        assert!(rec.moved_aside[0].2.contains("no copy"), "{rec:?}");
        assert_eq!(aside(dir.path(), ids[2]).len(), 1);
        assert_eq!(cat.current().unwrap(), Some(ids[1]));

        // A damaged MANIFEST found while running: collect leaves it alone.
        let (dir, ids) = chain_of_three();
        let cat = Catalog::open(dir.path()).unwrap();
        std::fs::write(dir.path().join(format!("chunks/{:016x}/{MANIFEST_FILE}", ids[2])), b"x").unwrap();
        assert_eq!(cat.collect(1, None).unwrap(), Vec::<u64>::new());
        assert!(cat.chunk_dir(ids[2]).join("t0000.0000.00000000").exists());
    }

    /// O_DIRECT writes (or the buffered fallback) give back exactly the
    /// bytes: an aligned body and a tail, from aligned and unaligned
    /// memory, shorter than a block, and rewritten shorter.
    #[test]
    fn files_written_directly_read_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let mut direct = Direct::default();
        let data: Vec<u8> = (0..3 * BLOCK + 2 * BLOCK + 123).map(|i| (i * 7 % 251) as u8).collect();
        for (i, len) in [3 * BLOCK + 123, 2 * BLOCK, 100, 0, 5 * BLOCK + 1].into_iter().enumerate() {
            for skip in [0, 1] {
                let bytes = &data[skip..skip + len];
                let path = dir.path().join(format!("f{i}"));
                direct.write(&path, bytes).unwrap();
                assert_eq!(std::fs::read(&path).unwrap(), bytes, "len {len}, skip {skip}");
            }
        }
    }

    /// Files read with O_DIRECT (or the buffered fallback) into a reused
    /// buffer give back exactly their bytes, whatever their length, with
    /// a buffer grown, shrunk to nothing, or left over from a longer file;
    /// a missing file is `MissingChunk`.
    #[test]
    fn files_read_directly_read_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let chunks = dir.path().join("chunks/0000000000000001");
        std::fs::create_dir_all(&chunks).unwrap();
        let data: Vec<u8> = (0..5 * BLOCK + 7).map(|i| (i * 13 % 253) as u8).collect();
        let mut buf = vec![];
        for len in [3 * BLOCK + 123, 2 * BLOCK, 100, 0, 5 * BLOCK + 7, 1] {
            std::fs::write(chunks.join("f"), &data[..len]).unwrap();
            let c = ChunkRef { key: "0000000000000001/f".into(), shard: 0, entries: 0, bytes: len as u64, checksum: 0 };
            let at = cat.read_into(1, &c, &mut buf).unwrap();
            assert_eq!(&buf[at], &data[..len], "len {len}");
        }
        let gone = ChunkRef { key: "0000000000000001/gone".into(), shard: 0, entries: 0, bytes: 1, checksum: 0 };
        assert!(matches!(cat.read_into(1, &gone, &mut buf), Err(Error::MissingChunk { .. })));
    }

    /// A tester's `truncate -s 100G` of one chunk aborted the daemon: the
    /// chunk was read whole at its size on disk (a 100 GiB buffer) before
    /// its header was checked. A FIFO in a chunk's place hung the start.
    /// Now a chunk or key list that is not a regular file of the size its
    /// manifest says is `CorruptChunk` before a byte of it is read: the
    /// reused buffer is not grown past the manifest's size, and a FIFO
    /// is refused at once (the read runs in a thread, so that a hang
    /// fails the test instead of hanging it).
    #[test]
    fn a_chunk_that_is_not_what_its_manifest_says_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let mut w = cat.begin().unwrap();
        let c = w.write(0, 0, 0, 2, &[1, 2], &[5, 6], &[0.5; 4]).unwrap();
        let k = w.write_keys(0, 0, 0, &[1, 2]).unwrap();
        let mut t = table("t", vec![c.clone()], false);
        t.keys = vec![k.clone()];
        let m = w.commit(Kind::Full, vec![t], "test").unwrap();
        let corrupt = |r: Result<()>, what: &ChunkRef| match r {
            Err(Error::CorruptChunk { id, chunk, .. }) => assert_eq!((id, &chunk), (m.id, &what.key)),
            r => panic!("{:?}: {r:?}", what.key),
        };
        let mut buf = vec![];
        for r in [&c, &k] {
            let path = cat.chunk_path(r);
            let bytes = std::fs::read(&path).unwrap();
            // Grown (sparse): 64 MiB on disk, a few dozen bytes in the manifest.
            std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(64 << 20).unwrap();
            corrupt(cat.read_into(m.id, r, &mut buf).map(drop), r);
            assert!(buf.capacity() < 1 << 20, "a buffer of {} bytes for a chunk of {}", buf.capacity(), r.bytes);
            corrupt(cat.read_chunk(m.id, r).map(drop), r);
            corrupt(cat.read_keys(m.id, r).map(drop), r);
            // A FIFO, a directory, a link to /dev/zero.
            std::fs::remove_file(&path).unwrap();
            assert!(std::process::Command::new("mkfifo").arg(&path).status().unwrap().success());
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::scope(|s| {
                let (cat, owned) = (&cat, r.clone());
                s.spawn(move || tx.send(cat.read_into(m.id, &owned, &mut vec![]).map(drop)).unwrap());
                let got = rx.recv_timeout(std::time::Duration::from_secs(10));
                if got.is_err() {
                    // Lets the blocked open go, so that the test ends.
                    drop(std::fs::OpenOptions::new().write(true).open(&path));
                }
                corrupt(got.expect("a read of a FIFO returns"), r);
            });
            corrupt(cat.read_chunk(m.id, r).map(drop), r);
            std::fs::remove_file(&path).unwrap();
            std::fs::create_dir(&path).unwrap();
            corrupt(cat.read_into(m.id, r, &mut buf).map(drop), r);
            std::fs::remove_dir(&path).unwrap();
            std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
            corrupt(cat.read_into(m.id, r, &mut buf).map(drop), r);
            corrupt(cat.read_keys(m.id, r).map(drop), r);
            std::fs::remove_file(&path).unwrap();
            std::fs::write(&path, bytes).unwrap();
        }
        cat.verify(&cat.chain(m.id).unwrap(), |_| ()).unwrap();
    }

    /// A regular file or a dangling symlink where `chunks` goes said
    /// "cannot create …/chunks: File exists": the error now says what the
    /// path is (and what to do).
    #[test]
    fn a_file_where_the_chunks_directory_goes_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let chunks = dir.path().join("chunks");
        std::fs::write(&chunks, "").unwrap();
        let e = Catalog::open(dir.path()).err().expect("refused");
        assert!(matches!(&e, Error::Store(m) if m.contains("is a regular file")), "{e}");
        std::fs::remove_file(&chunks).unwrap();
        std::os::unix::fs::symlink(dir.path().join("gone"), &chunks).unwrap();
        let e = Catalog::open(dir.path()).err().expect("refused");
        assert!(matches!(&e, Error::Store(m) if m.contains("is a symlink to nothing")), "{e}");
    }

    /// Checkpoints written before file names held the table's index name
    /// their files after the table (`{table}.{shard:04}.{seq:08}`): they
    /// read unchanged, since a reader opens the path its manifest names.
    #[test]
    fn a_checkpoint_of_the_name_based_layout_still_reads() {
        let dir = tempfile::tempdir().unwrap();
        let id = 0x1a2_34c2_ece4u64;
        let cdir = dir.path().join(format!("chunks/{id:016x}"));
        std::fs::create_dir_all(&cdir).unwrap();
        let (b, checksum) = chunk::encode(2, &[4, 5], &[1, 2], &[0.5, 1.5, 2.5, 3.5]);
        std::fs::write(cdir.join("emb.0000.00000000"), &b).unwrap();
        let (kb, ksum) = chunk::encode_keys(&[4, 5]);
        std::fs::write(cdir.join("emb.0000.keys00000000"), &kb).unwrap();
        let c = ChunkRef {
            key: format!("{id:016x}/emb.0000.00000000"),
            shard: 0,
            entries: 2,
            bytes: b.len() as u64,
            checksum,
        };
        let k = ChunkRef {
            key: format!("{id:016x}/emb.0000.keys00000000"),
            shard: 0,
            entries: 2,
            bytes: kb.len() as u64,
            checksum: ksum,
        };
        let mut t = table("emb", vec![c], true);
        t.keys = vec![k];
        let m = Manifest {
            format: FORMAT_VERSION,
            id,
            created_unix_ms: 1,
            finished_unix_ms: 2,
            daemon_version: "old".into(),
            kind: Kind::Full,
            tables: vec![t],
        };
        std::fs::write(cdir.join(MANIFEST_FILE), manifest::encode(&m)).unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let chain = cat.chain(id).unwrap();
        cat.verify(&chain, |_| ()).unwrap();
        assert_eq!(cat.read_chunk(id, &chain[0].tables[0].chunks[0]).unwrap().keys, [4, 5]);
        assert_eq!(cat.read_keys(id, &chain[0].tables[0].keys[0]).unwrap(), [4, 5]);
    }

    #[test]
    fn a_checkpoint_marked_corrupt_lists_so_and_so_do_the_incrementals_on_it() {
        let (dir, ids) = chain_of_three();
        let cat = Catalog::open(dir.path()).unwrap();
        cat.mark_corrupt(ids[0], "chunk x is corrupt");
        let listed = cat.list().unwrap();
        let status = |id: u64| listed.iter().find(|l| l.id == id).unwrap().status.clone();
        assert_eq!(status(ids[0]), "corrupt: chunk x is corrupt");
        assert_eq!(status(ids[1]), format!("unusable: base {:016x} is corrupt", ids[0]));
        assert_eq!(status(ids[2]), format!("unusable: base {:016x} is corrupt", ids[0]));
        cat.clear_corrupt(ids[0]);
        assert!(cat.list().unwrap().iter().all(|l| l.status == "complete"));
    }
}
