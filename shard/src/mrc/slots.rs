//! The estimator's key → entry map ([`Slots`]).

use super::NIL;

/// The estimator's key → entry map: open addressing with linear probing in
/// a power-of-two table at most half full, deletions by backward shift (so
/// no tombstones). Unlike a general map, the slot a key starts at is known
/// before the probe, so a drain fetches it ahead ([`Slots::prefetch`]).
#[derive(Debug, Clone)]
pub(super) struct Slots {
    /// `(key, entry)`; entry `NIL`: empty.
    slots: Vec<(u64, u32)>,
    len: usize,
    shift: u32,
}

impl Slots {
    pub(super) fn new(keys: usize) -> Slots {
        let n = (2 * keys).next_power_of_two().max(16);
        Slots { slots: vec![(0, NIL); n], len: 0, shift: 64 - n.trailing_zeros() }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Fibonacci hashing: the multiply's high bits, so that sequential
        // keys spread.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(super) fn prefetch(&self, key: u64) {
        crate::cpu::prefetch::prefetch(&self.slots[self.home(key)]);
    }

    /// The slot holding `key`, probing linearly from its home.
    #[inline]
    fn position(&self, key: u64) -> Option<usize> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let (k, e) = self.slots[i];
            if e == NIL {
                return None;
            }
            if k == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<u32> {
        self.position(key).map(|i| self.slots[i].1)
    }

    /// Inserts `key` (not present) → `e`.
    pub(super) fn insert(&mut self, key: u64, e: u32) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        while self.slots[i].1 != NIL {
            i = (i + 1) & mask;
        }
        self.slots[i] = (key, e);
        self.len += 1;
        debug_assert!(2 * self.len <= self.slots.len() + 2, "the table stays at most half full");
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let i = self.position(key)?;
        let e = self.slots[i].1;
        // Backward shift: move each later key of the run into the hole if
        // its home is not between the hole and it.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        while self.slots[j].1 != NIL {
            let home = self.home(self.slots[j].0);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = (0, NIL);
        self.len -= 1;
        Some(e)
    }
}
