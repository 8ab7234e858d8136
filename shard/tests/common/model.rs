//! A deliberately simple reference model of the table's bucket semantics:
//! buckets as vectors of optional slots, every rule written out as a loop.
//! It shares only the hash functions with the crate, so the crate's layout
//! tricks (SWAR digests, bitmaps, locks, parallel batches) are checked
//! against plain code.

#![allow(dead_code)]

use hkv_shard::hash::{bucket1, bucket2};
use hkv_shard::score::Scorer;
use hkv_shard::{BucketMode, Filter, Lost, Outcome, ScorePolicy, TableConfig, BUCKET_SLOTS};

#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub key: u64,
    pub score: u64,
    pub value: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct Model {
    pub cfg: TableConfig,
    pub buckets: Vec<Vec<Option<Slot>>>,
    pub epoch: u32,
}

fn new_buckets(n: u64) -> Vec<Vec<Option<Slot>>> {
    (0..n).map(|_| vec![None; BUCKET_SLOTS]).collect()
}

impl Model {
    pub fn new(cfg: TableConfig) -> Model {
        let n = cfg.capacity.div_ceil(BUCKET_SLOTS as u64).max(1);
        Model { cfg, buckets: new_buckets(n), epoch: 0 }
    }

    pub fn nb(&self) -> u64 {
        self.buckets.len() as u64
    }

    pub fn capacity(&self) -> u64 {
        self.nb() * BUCKET_SLOTS as u64
    }

    pub fn size(&self) -> u64 {
        self.buckets.iter().flatten().filter(|s| s.is_some()).count() as u64
    }

    fn candidates(&self, key: u64) -> Vec<usize> {
        let b1 = bucket1(key, self.nb()) as usize;
        if self.cfg.mode == BucketMode::Dual && self.nb() > 1 {
            vec![b1, bucket2(key, self.nb()) as usize]
        } else {
            vec![b1]
        }
    }

    pub fn locate(&self, key: u64) -> Option<(usize, usize)> {
        for b in self.candidates(key) {
            for (s, slot) in self.buckets[b].iter().enumerate() {
                if slot.as_ref().is_some_and(|x| x.key == key) {
                    return Some((b, s));
                }
            }
        }
        None
    }

    pub fn get(&self, key: u64) -> Option<&Slot> {
        self.locate(key).map(|(b, s)| self.buckets[b][s].as_ref().unwrap())
    }

    fn get_mut(&mut self, key: u64) -> Option<&mut Slot> {
        self.locate(key).map(|(b, s)| self.buckets[b][s].as_mut().unwrap())
    }

    fn make_room(&mut self, b: usize, depth: u32, path: &mut Vec<usize>) -> Option<usize> {
        for pass in 0..depth {
            for s in 0..self.buckets[b].len() {
                let k = self.buckets[b][s].as_ref().unwrap().key;
                let kc = self.candidates(k);
                let alt = if kc[0] == b { kc[1] } else { kc[0] };
                if path.contains(&alt) {
                    continue;
                }
                let free = if pass == 0 {
                    self.buckets[alt].iter().position(|x| x.is_none())
                } else {
                    path.push(alt);
                    let t = self.make_room(alt, 1, path);
                    path.pop();
                    t
                };
                if let Some(t) = free {
                    self.buckets[alt][t] = self.buckets[b][s].take();
                    return Some(s);
                }
            }
        }
        None
    }

    fn load(&self, b: usize) -> usize {
        self.buckets[b].iter().filter(|s| s.is_some()).count()
    }

    /// Places an absent key. Returns the outcome and what was lost.
    fn place(
        &mut self,
        key: u64,
        value: &[f32],
        score: u64,
        admission: u64,
        verbatim: bool,
    ) -> (Outcome, Option<(Slot, Lost)>) {
        let c = self.candidates(key);
        // The less loaded candidate, the first on ties.
        let mut target = c[0];
        if c.len() == 2 && self.load(c[1]) < self.load(c[0]) {
            target = c[1];
        }
        if let Some(s) = self.buckets[target].iter().position(|x| x.is_none()) {
            self.buckets[target][s] = Some(Slot { key, score, value: value.to_vec() });
            return (Outcome::Inserted, None);
        }
        // Verbatim loads in dual mode first free a slot of a candidate (b1
        // first) by moving residents on, two steps at most (CpuTable::make_room).
        if verbatim && c.len() == 2 {
            for &b in &c {
                if let Some(s) = self.make_room(b, 2, &mut c.clone()) {
                    self.buckets[b][s] = Some(Slot { key, score, value: value.to_vec() });
                    return (Outcome::Inserted, None);
                }
            }
        }
        // Full: the candidate with the lowest minimum (the first on ties),
        // and in it the lowest slot holding that minimum.
        let mut best: Option<(usize, usize, u64)> = None;
        for &b in &c {
            for (s, slot) in self.buckets[b].iter().enumerate() {
                let sc = slot.as_ref().unwrap().score;
                if best.is_none_or(|(_, _, m)| sc < m) {
                    best = Some((b, s, sc));
                }
            }
        }
        let (b, s, min) = best.unwrap();
        // Sanity of the model itself: nothing in the candidates is below min.
        assert!(c.iter().all(|&b| self.buckets[b].iter().all(|x| x.as_ref().unwrap().score >= min)));
        if admission < min {
            return (Outcome::Rejected, Some((Slot { key, score, value: value.to_vec() }, Lost::Rejected)));
        }
        let old = self.buckets[b][s].replace(Slot { key, score, value: value.to_vec() }).unwrap();
        (Outcome::Evicted, Some((old, Lost::Evicted)))
    }

    fn grow_for(&mut self, incoming: usize) {
        let max_buckets = self.cfg.max_buckets();
        loop {
            let nb = self.nb();
            let want = (self.size() + incoming as u64) as f64;
            if want <= self.cfg.max_load_factor * (nb * BUCKET_SLOTS as u64) as f64 || nb * 2 > max_buckets {
                return;
            }
            self.rehash(nb * 2);
        }
    }

    pub fn rehash(&mut self, nb: u64) {
        let mut all: Vec<Slot> = self.buckets.drain(..).flatten().flatten().collect();
        all.sort_by(|a, b| b.score.cmp(&a.score).then(a.key.cmp(&b.key)));
        self.buckets = new_buckets(nb);
        for e in all {
            self.place(e.key, &e.value, e.score, e.score, true);
        }
    }

    fn scorer(&self, now: u64) -> Scorer {
        Scorer { policy: self.cfg.policy, now_ns: now, epoch: self.epoch, lfu_ties: self.cfg.lfu_ties }
    }

    pub fn find(&self, keys: &[u64]) -> Vec<Option<(Vec<f32>, u64)>> {
        keys.iter().map(|&k| self.get(k).map(|s| (s.value.clone(), s.score))).collect()
    }

    /// insert_or_assign / insert_and_evict / load (verbatim).
    pub fn upsert(
        &mut self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        now: u64,
        verbatim: bool,
    ) -> (Vec<Outcome>, Vec<(Slot, Lost)>) {
        let dim = self.cfg.dim;
        self.grow_for(keys.len());
        let sc = self.scorer(now);
        let mut outs = vec![];
        let mut lost = vec![];
        for (i, &k) in keys.iter().enumerate() {
            let input = scores.map(|s| s[i]);
            let v = &values[i * dim..(i + 1) * dim];
            if let Some(slot) = self.get_mut(k) {
                slot.value = v.to_vec();
                slot.score = if verbatim { input.unwrap() } else { sc.on_upsert(slot.score, input) };
                outs.push(Outcome::Updated);
                continue;
            }
            let score = if verbatim { input.unwrap() } else { sc.on_insert(input) };
            let adm = if verbatim { score } else { sc.admission(score) };
            let (o, l) = self.place(k, v, score, adm, verbatim);
            outs.push(o);
            lost.extend(l);
        }
        (outs, lost)
    }

    pub fn find_or_insert(
        &mut self,
        keys: &[u64],
        values: &mut [f32],
        scores: Option<&[u64]>,
        now: u64,
    ) -> Vec<Outcome> {
        let dim = self.cfg.dim;
        self.grow_for(keys.len());
        let sc = self.scorer(now);
        let mut outs = vec![];
        for (i, &k) in keys.iter().enumerate() {
            let input = scores.map(|s| s[i]);
            let row = &mut values[i * dim..(i + 1) * dim];
            if let Some(slot) = self.get_mut(k) {
                row.copy_from_slice(&slot.value);
                slot.score = sc.on_upsert(slot.score, input);
                outs.push(Outcome::Updated);
                continue;
            }
            let score = sc.on_insert(input);
            let (o, _) = self.place(k, row, score, sc.admission(score), false);
            outs.push(o);
        }
        outs
    }

    pub fn assign(&mut self, keys: &[u64], values: Option<&[f32]>, scores: Option<&[u64]>, now: u64) -> Vec<Outcome> {
        let dim = self.cfg.dim;
        let sc = self.scorer(now);
        keys.iter()
            .enumerate()
            .map(|(i, &k)| match self.get_mut(k) {
                Some(slot) => {
                    if let Some(v) = values {
                        slot.value = v[i * dim..(i + 1) * dim].to_vec();
                    }
                    slot.score = sc.on_update(slot.score, scores.map(|s| s[i]));
                    Outcome::Updated
                }
                None => Outcome::Absent,
            })
            .collect()
    }

    pub fn accum_or_assign(&mut self, keys: &[u64], deltas: &[f32], scores: Option<&[u64]>, now: u64) -> Vec<Outcome> {
        let dim = self.cfg.dim;
        let sc = self.scorer(now);
        let mut outs = vec![Outcome::Absent; keys.len()];
        let mut absent = vec![];
        // Phase 1: present keys.
        for (i, &k) in keys.iter().enumerate() {
            let input = scores.map(|s| s[i]);
            match self.get_mut(k) {
                Some(slot) => {
                    for (v, d) in slot.value.iter_mut().zip(&deltas[i * dim..(i + 1) * dim]) {
                        *v += d;
                    }
                    slot.score = sc.on_upsert(slot.score, input);
                    outs[i] = Outcome::Updated;
                }
                None => absent.push(i),
            }
        }
        if absent.is_empty() {
            return outs;
        }
        // Phase 2: absent keys, in index order (a duplicate inserted earlier
        // in this phase accumulates).
        self.grow_for(absent.len());
        for i in absent {
            let input = scores.map(|s| s[i]);
            let d = &deltas[i * dim..(i + 1) * dim];
            if let Some(slot) = self.get_mut(keys[i]) {
                for (v, x) in slot.value.iter_mut().zip(d) {
                    *v += x;
                }
                slot.score = sc.on_upsert(slot.score, input);
                outs[i] = Outcome::Updated;
                continue;
            }
            let score = sc.on_insert(input);
            outs[i] = self.place(keys[i], d, score, sc.admission(score), false).0;
        }
        outs
    }

    pub fn erase(&mut self, keys: &[u64]) -> Vec<bool> {
        keys.iter()
            .map(|&k| match self.locate(k) {
                Some((b, s)) => {
                    self.buckets[b][s] = None;
                    true
                }
                None => false,
            })
            .collect()
    }

    pub fn erase_if(&mut self, f: &Filter) -> u64 {
        let mut n = 0;
        for slot in self.buckets.iter_mut().flatten() {
            if slot.as_ref().is_some_and(|x| f.matches(x.key, x.score)) {
                *slot = None;
                n += 1;
            }
        }
        n
    }

    pub fn clear(&mut self) {
        for slot in self.buckets.iter_mut().flatten() {
            *slot = None;
        }
    }

    /// Occupied slots as (bucket, slot, key, score), in slot order.
    pub fn slots(&self) -> Vec<(u64, usize, u64, u64)> {
        let mut v = vec![];
        for (b, bk) in self.buckets.iter().enumerate() {
            for (s, slot) in bk.iter().enumerate() {
                if let Some(x) = slot {
                    v.push((b as u64, s, x.key, x.score));
                }
            }
        }
        v
    }

    /// export_batch_if over a slot range: (keys, values, scores).
    pub fn export(&self, offset: u64, n: u64, f: &Filter) -> (Vec<u64>, Vec<f32>, Vec<u64>) {
        let (mut k, mut v, mut s) = (vec![], vec![], vec![]);
        let end = offset.saturating_add(n).min(self.capacity());
        for i in offset..end.max(offset) {
            let (b, sl) = ((i / 128) as usize, (i % 128) as usize);
            if let Some(x) = &self.buckets[b][sl] {
                if f.matches(x.key, x.score) {
                    k.push(x.key);
                    v.extend_from_slice(&x.value);
                    s.push(x.score);
                }
            }
        }
        (k, v, s)
    }
}

/// A policy-appropriate scores argument: None for clock policies.
pub fn scores_for(policy: ScorePolicy, raw: &[u64]) -> Option<Vec<u64>> {
    policy.takes_scores().then(|| raw.to_vec())
}
