//! Manifests: what a checkpoint holds. JSON followed by a u64 xxh3-64 of the
//! JSON bytes (little-endian).

use hkv_proto::{Mode, Policy};
use serde::{Deserialize, Serialize};

use crate::{Error, Result, FORMAT_VERSION};

/// Full, or incremental on top of an earlier checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Every entry of every table.
    Full,
    /// Entries whose score passed the previous checkpoint's watermark, for
    /// tables whose policy grows scores with time; everything for the others.
    Incremental {
        /// The checkpoint this one extends.
        base: u64,
    },
}

/// One stored chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Store key.
    pub key: String,
    /// Shard it was exported from.
    pub shard: u32,
    /// Entries.
    pub entries: u64,
    /// Bytes.
    pub bytes: u64,
    /// xxh3-64 of the chunk (also stored in the chunk).
    pub checksum: u64,
}

/// One table in a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    /// Name.
    pub name: String,
    /// f32 per value.
    pub dim: usize,
    /// Score policy (stored as its name: `lru`, `epoch-lfu` ...).
    pub policy: Policy,
    /// Bucket mode (stored as its name: `single` or `dual`).
    pub mode: Mode,
    /// The daemon's full table spec, as it was created.
    pub spec: serde_json::Value,
    /// Shards it had.
    pub shards: u32,
    /// Entries stored in this checkpoint.
    pub entries: u64,
    /// Whether this table's entries are complete here (false: only what
    /// changed since the base checkpoint).
    pub full: bool,
    /// Per shard: the score a write had when the export began; the next
    /// incremental exports entries at or above it.
    pub watermarks: Vec<u64>,
    /// Per shard: the clock score (`Shard::clock_score`) read when its
    /// export ended. Every entry a write scored is at or below it, so a
    /// restore resumes the clock from here, not from the highest restored
    /// score (which a client's `load` can set to anything). Empty in
    /// manifests written before it was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clocks: Vec<u64>,
    /// The chunks, in export order.
    pub chunks: Vec<ChunkRef>,
    /// Incremental checkpoints of a table not stored whole: every key the
    /// table held when its shard was exported (key lists, one or more per
    /// shard), so that a restore drops the keys erased or evicted since the
    /// base. Empty when `full`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<ChunkRef>,
}

/// A checkpoint's manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// Id (increasing; the creation time in ms, made unique).
    pub id: u64,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Completion time, ms since the Unix epoch.
    pub finished_unix_ms: u64,
    /// The daemon version that wrote it.
    pub daemon_version: String,
    /// Full or incremental.
    pub kind: Kind,
    /// Tables.
    pub tables: Vec<TableEntry>,
}

impl Manifest {
    /// Entries over all tables.
    pub fn entries(&self) -> u64 {
        self.tables.iter().map(|t| t.entries).sum()
    }
    /// Chunk and key-list bytes over all tables.
    pub fn bytes(&self) -> u64 {
        self.tables.iter().flat_map(|t| t.chunks.iter().chain(&t.keys)).map(|c| c.bytes).sum()
    }
}

/// Encodes a manifest with its checksum.
pub fn encode(m: &Manifest) -> Vec<u8> {
    let mut b = serde_json::to_vec(m).expect("manifest serializes");
    let sum = xxhash_rust::xxh3::xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// Verifies and decodes a manifest.
pub fn decode(id: u64, b: &[u8]) -> Result<Manifest> {
    let corrupt = |why: String| Error::CorruptManifest { id, why };
    if b.len() < 8 {
        return Err(corrupt("too short".into()));
    }
    let (json, sum) = b.split_at(b.len() - 8);
    let stored = u64::from_le_bytes(sum.try_into().map_err(|_| corrupt("too short".into()))?);
    if xxhash_rust::xxh3::xxh3_64(json) != stored {
        return Err(corrupt("checksum mismatch".into()));
    }
    let m: Manifest = serde_json::from_slice(json).map_err(|e| corrupt(e.to_string()))?;
    if m.id != id {
        return Err(corrupt(format!("it names checkpoint {:016x}", m.id)));
    }
    if m.format != FORMAT_VERSION {
        return Err(corrupt(format!("format version {}, this build reads {FORMAT_VERSION}", m.format)));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Manifests written while the policy and mode were plain strings read
    /// unchanged: the typed fields keep the same JSON text.
    #[test]
    fn a_manifest_written_with_string_policies_still_reads() {
        let old = r#"{"format":1,"id":7,"created_unix_ms":1,"finished_unix_ms":2,"daemon_version":"0.1.0",
            "kind":{"incremental":{"base":5}},
            "tables":[{"name":"emb","dim":4,"policy":"epoch-lfu","mode":"dual",
              "spec":{"name":"emb","dim":4,"capacity":1024,"policy":"epoch-lfu","mode":"dual"},
              "shards":2,"entries":3,"full":true,"watermarks":[0,0],
              "chunks":[{"key":"c","shard":0,"entries":3,"bytes":64,"checksum":9}]}]}"#
            .replace(['\n', ' '], "");
        let old = old.replace("\"format\":1", &format!("\"format\":{FORMAT_VERSION}"));
        let mut bytes = old.clone().into_bytes();
        bytes.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(old.as_bytes()).to_le_bytes());
        let m = decode(7, &bytes).unwrap();
        assert_eq!((m.tables[0].policy, m.tables[0].mode), (Policy::EpochLfu, Mode::Dual));
        assert_eq!(m.kind, Kind::Incremental { base: 5 });
        // Written back, the same document.
        let again = encode(&m);
        let value = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).unwrap();
        assert_eq!(value(&again[..again.len() - 8]), value(old.as_bytes()));
    }
}
