//! What a sample was: the operation's [`Kind`], the batch's [`tag`], and
//! a drain's [`Samples`].

use serde::{Deserialize, Serialize};

/// What a sampled key's operation was, as the estimator reads it (issue
/// 32: a write that follows a lookup of the same key is not another
/// reference). The low two bits of a sample's tag ([`tag`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Kind {
    /// find, find_at, contains: a reference, counted as a hit or a miss;
    /// it moves nothing (the table's finds do not touch scores). What the
    /// client does next with the key (writes it back, inserts it after a
    /// miss, or nothing) decides what the cache holds.
    Lookup = 0,
    /// find_or_insert: a reference, then the key is written (a miss
    /// inserted, a hit's score refreshed): a plain LRU access.
    FindOrInsert = 1,
    /// insert_or_assign, insert_and_evict, accum_or_assign: the key placed
    /// or refreshed; not a reference.
    Write = 2,
    /// assign, assign_scores: the key refreshed where present; not a
    /// reference.
    Update = 3,
}

impl Kind {
    /// Whether the operation is a reference (counted in the table's hits
    /// and misses, and in [`SampleDrain::accesses`](crate::SampleDrain)).
    pub const fn is_lookup(self) -> bool {
        matches!(self, Kind::Lookup | Kind::FindOrInsert)
    }

    pub(super) fn of(tag: u8) -> Kind {
        match tag & 3 {
            0 => Kind::Lookup,
            1 => Kind::FindOrInsert,
            2 => Kind::Write,
            _ => Kind::Update,
        }
    }
}

/// A sample's tag byte: the [`Kind`] in bits 0–1, the lookup's outcome in
/// the table in bits 2–3 ([`OUTCOME_KNOWN`], [`OUTCOME_HIT`]; both clear
/// where the sampler does not know it: writes, and the CUDA kernels' rings),
/// and the batch's sequence number modulo 16 in bits 4–7, so that a drain
/// shows where one batch ends and the next begins (a change of
/// [`batch_of`]). The CUDA kernels write the byte the host gives them
/// beside each key of their ring (`HkvSample::tag`).
pub const fn tag(kind: Kind, batch: u32) -> u8 {
    kind as u8 | ((batch & 15) as u8) << 4
}

/// Set in a lookup's tag where the sampler saw the table's answer: the
/// key's hit or miss is [`OUTCOME_HIT`].
pub const OUTCOME_KNOWN: u8 = 1 << 2;
/// With [`OUTCOME_KNOWN`]: the table found the key.
pub const OUTCOME_HIT: u8 = 1 << 3;

/// `t` (a [`tag`]) with the outcome of the key `hit` in the table.
pub const fn with_outcome(t: u8, hit: bool) -> u8 {
    t | OUTCOME_KNOWN | if hit { OUTCOME_HIT } else { 0 }
}

/// The table's answer to a sampled lookup, where its tag carries one.
pub const fn outcome(t: u8) -> Option<bool> {
    if t & OUTCOME_KNOWN == 0 {
        None
    } else {
        Some(t & OUTCOME_HIT != 0)
    }
}

/// The tag's kind and batch, without the key's outcome: equal for every
/// key of one batch.
pub const fn batch_of(t: u8) -> u8 {
    t & !(OUTCOME_KNOWN | OUTCOME_HIT)
}

/// Sampled keys and their tags ([`tag`]), in the order they were drained.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Samples {
    /// The keys.
    pub keys: Vec<u64>,
    /// One tag per key.
    pub tags: Vec<u8>,
}

impl Samples {
    /// Empties both.
    pub fn clear(&mut self) {
        self.keys.clear();
        self.tags.clear();
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Appends `keys`, all with tag `t`.
    pub fn push_batch(&mut self, keys: &[u64], t: u8) {
        self.keys.extend_from_slice(keys);
        self.tags.resize(self.keys.len(), t);
    }

    /// Keeps the keys whose sampling hash (seed `seed`) is below `threshold`,
    /// each with its tag, in order.
    pub fn retain_below(&mut self, seed: u64, threshold: u64) {
        let mut j = 0;
        for i in 0..self.keys.len() {
            if super::sample_hash(self.keys[i], seed) < threshold {
                self.keys[j] = self.keys[i];
                self.tags[j] = self.tags[i];
                j += 1;
            }
        }
        self.keys.truncate(j);
        self.tags.truncate(j);
    }

    /// Appends `keys`, each with its own tag.
    pub fn push_tagged(&mut self, keys: &[u64], tags: &[u8]) {
        debug_assert_eq!(keys.len(), tags.len());
        self.keys.extend_from_slice(keys);
        self.tags.extend_from_slice(tags);
    }

    /// The keys of lookups (find, contains, find_or_insert) only.
    pub fn lookups(&self) -> impl Iterator<Item = u64> + '_ {
        self.keys.iter().zip(&self.tags).filter(|(_, &t)| Kind::of(t).is_lookup()).map(|(&k, _)| k)
    }
}
