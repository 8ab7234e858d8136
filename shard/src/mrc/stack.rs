//! Exact LRU stack distances ([`LruStack`]), for `hkv-sim`'s exact curves
//! and the tests.

use std::collections::{HashMap, TryReserveError};
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes u64 keys for the stack's map with one multiply-xorshift round
/// (the keys may be sequential integers; SipHash would cost more than the
/// rest of a sampled access).
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    #[inline]
    fn write_u64(&mut self, k: u64) {
        let z = (k ^ (k >> 32)).wrapping_mul(0xd6e8_feb8_6659_fd93);
        self.0 = z ^ (z >> 32);
    }
}

type KeyMap = HashMap<u64, u32, BuildHasherDefault<KeyHasher>>;

/// Exact LRU stack distances: for each access, how many distinct other keys
/// were accessed since the key's previous access. A fully associative LRU
/// cache of `c` slots hits an access exactly when its distance is below `c`.
///
/// Each tracked key's last access time is marked in a Fenwick tree; the
/// distance is the count of marks after the key's own. Times are indices in
/// a window of about four times the tracked keys; when it fills, the times
/// are renumbered densely (amortised O(log n) per access).
#[derive(Debug, Clone, Default)]
pub struct LruStack {
    last: KeyMap,
    /// Fenwick tree over times: `tree[i]` (1-based) sums its range of marks.
    tree: Vec<u32>,
    now: u32,
}

impl LruStack {
    const MIN_WINDOW: usize = 1024;
    /// The most keys a stack tracks: the window of times (four per key)
    /// must stay below `u32::MAX`.
    pub const MAX_KEYS: usize = (1 << 30) - 1;

    /// An empty stack.
    pub fn new() -> LruStack {
        Self::with_capacity(0)
    }

    /// An empty stack with room for `keys` keys.
    pub fn with_capacity(keys: usize) -> LruStack {
        let window = (4 * keys).max(Self::MIN_WINDOW);
        LruStack { last: KeyMap::with_capacity_and_hasher(keys, Default::default()), tree: vec![0; window + 1], now: 0 }
    }

    /// Keys tracked.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }

    /// Records an access of `key`: its stack distance, or `None` for a
    /// key's first access (or the first since its removal). At most
    /// [`LruStack::MAX_KEYS`] keys are tracked (more panic).
    #[inline]
    pub fn access(&mut self, key: u64) -> Option<u64> {
        self.try_access(key).expect("memory for the LRU stack")
    }

    /// [`LruStack::access`], with the memory its map and window grow into
    /// allocated fallibly: a stream with more distinct keys than the host
    /// can track is an error for the caller to report (`hkv-sim --mrc`
    /// sized from a user's options), not an abort. The caller keeps the
    /// keys below [`LruStack::MAX_KEYS`].
    #[inline]
    pub fn try_access(&mut self, key: u64) -> Result<Option<u64>, TryReserveError> {
        if self.now as usize + 1 >= self.tree.len() {
            self.compact()?;
        }
        self.last.try_reserve(1)?;
        let t = self.now;
        self.now += 1;
        let prev = self.last.insert(key, t);
        let d = prev.map(|t0| {
            // Marks are at times below `t`, one per tracked key.
            let d = self.last.len() as u64 - self.prefix(t0) as u64;
            self.add(t0, -1);
            d
        });
        self.add(t, 1);
        Ok(d)
    }

    /// Stops tracking `key`.
    pub fn remove(&mut self, key: u64) {
        if let Some(t) = self.last.remove(&key) {
            self.add(t, -1);
        }
    }

    /// Marks at times `0..=t`.
    #[inline]
    fn prefix(&self, t: u32) -> u32 {
        let mut i = t as usize + 1;
        let mut s = 0;
        while i > 0 {
            s += self.tree[i];
            i &= i - 1;
        }
        s
    }

    #[inline]
    fn add(&mut self, t: u32, v: i32) {
        let mut i = t as usize + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(v);
            i += i & i.wrapping_neg();
        }
    }

    /// Renumbers the tracked keys' times `0..len` in their order and sizes
    /// the window to four times the keys.
    fn compact(&mut self) -> Result<(), TryReserveError> {
        let mut times: Vec<u32> = Vec::new();
        times.try_reserve_exact(self.last.len())?;
        times.extend(self.last.values().copied());
        times.sort_unstable();
        for t in self.last.values_mut() {
            *t = times.binary_search(t).expect("a tracked time") as u32;
        }
        let n = times.len();
        let window = (4 * n).max(Self::MIN_WINDOW);
        assert!(window < u32::MAX as usize, "LruStack tracks fewer than 2^30 keys");
        if window + 1 > self.tree.len() {
            self.tree.try_reserve_exact(window + 1 - self.tree.len())?;
        }
        // A Fenwick tree of ones at 0..n: cell i sums (i - lowbit(i), i].
        self.tree.clear();
        self.tree.resize(window + 1, 0);
        for i in 1..=window {
            let lo = i - (i & i.wrapping_neg());
            self.tree[i] = (i.min(n)).saturating_sub(lo) as u32;
        }
        self.now = n as u32;
        Ok(())
    }
}
