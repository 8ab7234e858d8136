//! A model of the adaptive policy's variants (issue 36), bucket for bucket
//! as hkv-sim drives the table (single mode, batches of 64, read-through:
//! find, hits refresh and count; then insert the misses), to try window
//! rules quickly. Standalone:
//!
//!     rustc --edition 2021 -O -o /tmp/adapt-model shard/bench/adapt_model.rs
//!     /tmp/adapt-model TRACE.bin SLOTS,SLOTS,...   # hit % per capacity
//!
//! Variants by environment variable (default: the first committed design,
//! a global share and ghosts, conservative counting):
//! PLAIN=1 counts a batch's keys first, plain increments (as committed
//! now); GB=1 ghosts per bucket; TB=1 window share per bucket; AB=1 a
//! ghost counts only if a reachable share would have kept the key;
//! INIT (share at start, 0..1), GAIN (step multiplier), PERIOD (halving
//! period per slot), WIDTH (sketch counters per slot and row), BLOCKED=1
//! one 64-byte sketch line per key, FIXED=N a fixed window of N slots,
//! GF / GFM (window ghosts of keys at least GF frequent do not grow the
//! window; GFM=1: they shrink it), DBG=1 prints the mean final window.
//! The committed policy is PLAIN=1 GB=1 TB=1 AB=1 BLOCKED=1 INIT=0.01.
//!
//! The second design (issue 36, on top of the committed one): SLRU=1 a
//! segmented main tier (bit 62 PROTECTED: a hit on a main entry protects
//! it; a full bucket first demotes its oldest protected entries while
//! more than PF tenths (default 8) of the main tier is protected; the victim is
//! the oldest unprotected main entry; a promoted window entry starts
//! unprotected); WS=1 an insert first moves the window's oldest entries to
//! the main tier while the window is over its share; MS=1 the share of
//! every bucket is the table-wide choice of the miniature simulations of
//! `shard/src/cpu/minisim.rs` (included below: the same code as the
//! policy's), fed as the table feeds them: a find's hits after the find,
//! the inserted misses after the insert; ghosts unused. The second
//! design is SLRU=1 WS=1 MS=1 on top of the committed variables. The
//! miniatures' constants (`minisim::Params`): MSW windows (percent,
//! comma-separated, ascending), MSS table slots per miniature slot, MSF
//! the frequency halving period per miniature slot, MSH the hit halving
//! period in percent of a miniature's capacity, MSM how far
//! ahead (1/1000) another miniature must be to take over. ADM=k: a
//! candidate joins the main tier only if more than k more frequent than
//! the victim (default 0, TinyLFU's rule); MSA=k the same in the
//! miniatures (default: the policy's, `minisim::ADMIT_MARGIN`, 1). The
//! policy as committed now: SLRU=1 WS=1 MS=1 ADM=1 on top of the first
//! design's variables; the rule before the margin: add MSA=0, ADM=0.
//! shard/bench/model_eval.py runs it over the traces and prints each
//! size's margin to the bar.
use std::collections::HashSet;
use std::env;

#[path = "../src/cpu/minisim.rs"]
#[allow(dead_code)]
mod minisim;

const S: usize = 128;
const MAIN: u64 = 1 << 63;
const PROT: u64 = 1 << 62;
const EMPTY: u64 = u64::MAX;

static BLOCKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `crate::hash` of the shard crate, for `minisim.rs`: its mix.
mod hash {
    pub fn fmix64(x: u64) -> u64 {
        super::fmix(x)
    }
}

fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[derive(Clone, Debug)]
struct P {
    plain: bool,        // plain (commutative) sketch increments, counted at batch start
    ghost_bucket: bool, // per-bucket ghosts
    target_bucket: bool,
    agebound: bool,
    period: u64,
    init: f64,  // initial window share
    gain: f64,  // step multiplier
    width: u64, // sketch width per slot
    fixed: Option<u32>,
    gf: u8,
    gfm: bool,
    slru: bool,
    pf10: usize,
    shrink: bool,
    ms: bool,
    msp: minisim::Params,
    adm: u8,
}

struct Sim {
    p: P,
    nb: usize,
    keys: Vec<u64>,
    scores: Vec<u64>,
    pos: std::collections::HashMap<u64, usize>,
    sketch: Vec<u8>,
    mask: u64,
    counted: u64,
    period: u64,
    // global
    ghosts: Vec<u32>,
    target: f64,
    from_w: f64,
    from_m: f64,
    // per bucket
    bt: Vec<f64>,
    bw: Vec<f64>,
    bm: Vec<f64>,
    bevw: Vec<u32>,
    bevm: Vec<u32>,
    slots: u64,
    chooser: Option<minisim::Chooser>,
}

fn sidx(key: u64, row: usize, mask: u64) -> usize {
    if BLOCKED.load(std::sync::atomic::Ordering::Relaxed) {
        // one 64-byte line per key, a counter in each 16-byte quarter
        let h = fmix(key ^ 0x9e37_79b9_7f4a_7c15);
        let lines = (mask + 1) * 4 / 64;
        let line = (h >> 16) % lines;
        return (line * 64) as usize + row * 16 + ((h >> (4 * row)) & 15) as usize;
    }
    let h = fmix(key ^ 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(row as u64 + 1));
    row * (mask as usize + 1) + (h & mask) as usize
}

impl Sim {
    fn new(p: P, slots: u64) -> Sim {
        let nb = (slots as usize).div_ceil(S);
        let slots = (nb * S) as u64;
        let width = (slots * p.width).next_power_of_two();
        Sim {
            nb,
            keys: vec![EMPTY; nb * S],
            scores: vec![0; nb * S],
            pos: std::collections::HashMap::new(),
            sketch: vec![0; width as usize * 4],
            mask: width - 1,
            counted: 0,
            period: slots * p.period,
            ghosts: vec![0; slots as usize],
            target: slots as f64 * p.init,
            from_w: 1.0,
            from_m: 1.0,
            bt: vec![S as f64 * p.init; nb],
            bw: vec![1.0; nb],
            bm: vec![1.0; nb],
            bevw: vec![0; nb],
            bevm: vec![0; nb],
            chooser: p.ms.then(|| minisim::Chooser::with(slots, p.msp.clone())),
            slots,
            p,
        }
    }
    fn freq(&self, k: u64) -> u8 {
        (0..4).map(|r| self.sketch[sidx(k, r, self.mask)]).min().unwrap()
    }
    fn count(&mut self, k: u64) {
        if self.p.plain {
            for r in 0..4 {
                let i = sidx(k, r, self.mask);
                if self.sketch[i] < 15 {
                    self.sketch[i] += 1;
                }
            }
        } else {
            let f = self.freq(k);
            if f < 15 {
                for r in 0..4 {
                    let i = sidx(k, r, self.mask);
                    if self.sketch[i] == f {
                        self.sketch[i] += 1;
                    }
                }
            }
        }
        self.counted += 1;
    }
    fn age(&mut self) {
        if self.counted >= self.period {
            self.counted = 0;
            for c in &mut self.sketch {
                *c >>= 1;
            }
        }
    }
    fn bucket(&self, k: u64) -> usize {
        ((fmix(k) & ((1 << 56) - 1)) % self.nb as u64) as usize
    }
    fn find(&self, b: usize, k: u64) -> Option<usize> {
        self.pos.get(&k).map(|&i| i - b * S)
    }
    fn win_slots(&self, b: usize) -> u32 {
        if let Some(f) = self.p.fixed {
            return f;
        }
        if let Some(c) = &self.chooser {
            return c.bucket_window();
        }
        let w = if self.p.target_bucket {
            self.bt[b]
        } else {
            self.target.clamp(0.0, self.slots as f64) * S as f64 / self.slots as f64
        };
        (w as u32).clamp(1, S as u32 - 1)
    }
    // tiers: (window count, oldest window, oldest main)
    fn tiers(&self, b: usize) -> (u32, Option<(usize, u64)>, Option<(usize, u64)>) {
        let (mut w, mut ow, mut om) = (0, None::<(usize, u64)>, None::<(usize, u64)>);
        for s in 0..S {
            if self.keys[b * S + s] == EMPTY {
                continue;
            }
            let sc = self.scores[b * S + s];
            let o = if sc & MAIN == 0 {
                w += 1;
                &mut ow
            } else {
                &mut om
            };
            if o.is_none_or(|(_, x)| sc < x) {
                *o = Some((s, sc));
            }
        }
        (w, ow, om)
    }
    fn on_miss(&mut self, b: usize, k: u64) {
        if self.p.ms {
            return;
        }
        let h = fmix(k ^ 0x0123_4567);
        if self.p.ghost_bucket {
            let gi = b * S + (h % S as u64) as usize;
            let v = self.ghosts[gi];
            let fp = ((h >> 48) as u32) | 1; // 16 bits, nonzero
            if v == 0 || (v >> 16) != fp {
                return;
            }
            self.ghosts[gi] = 0;
            let window = v & 0x8000 != 0;
            let stamp = v & 0x7fff;
            let ws = self.win_slots(b);
            let (age, room) = if window {
                ((self.bevw[b].wrapping_sub(stamp)) & 0x7fff, S as u32 - ws)
            } else {
                ((self.bevm[b].wrapping_sub(stamp)) & 0x7fff, ws)
            };
            if self.p.agebound && age >= room {
                return;
            }
            if window && self.freq(k) >= self.p.gf {
                if self.p.gfm {
                    self.credit(b, false);
                }
                return;
            }
            self.credit(b, window);
        } else {
            let gi = (h % self.ghosts.len() as u64) as usize;
            let v = self.ghosts[gi];
            if v == 0 || v >> 2 != (h >> 34) as u32 {
                return;
            }
            self.ghosts[gi] = 0;
            self.credit(b, v & 1 != 0);
        }
    }
    fn credit(&mut self, b: usize, window: bool) {
        let g = self.p.gain;
        if self.p.target_bucket {
            let (w, m) = (self.bw[b].max(1.0), self.bm[b].max(1.0));
            if window {
                self.bt[b] = (self.bt[b] + g * (m / w).max(1.0)).min(S as f64);
            } else {
                self.bt[b] = (self.bt[b] - g * (w / m).max(1.0)).max(0.0);
            }
        } else {
            let (w, m) = (self.from_w.max(1.0), self.from_m.max(1.0));
            let slots = self.slots as f64;
            if window {
                self.target = (self.target + g * (m / w).floor().max(1.0)).min(slots);
            } else {
                self.target = (self.target - g * (w / m).floor().max(1.0)).max(0.0);
            }
        }
    }
    fn on_evict(&mut self, b: usize, k: u64, window: bool) {
        if self.p.ms {
            return;
        }
        let h = fmix(k ^ 0x0123_4567);
        if self.p.ghost_bucket {
            let gi = b * S + (h % S as u64) as usize;
            let fp = ((h >> 48) as u32) | 1;
            let stamp = if window { self.bevw[b] } else { self.bevm[b] } & 0x7fff;
            self.ghosts[gi] = fp << 16 | if window { 0x8000 } else { 0 } | stamp;
            if window {
                self.bevw[b] = self.bevw[b].wrapping_add(1);
            } else {
                self.bevm[b] = self.bevm[b].wrapping_add(1);
            }
        } else {
            let gi = (h % self.ghosts.len() as u64) as usize;
            self.ghosts[gi] = ((h >> 34) as u32) << 2 | 2 | window as u32;
        }
        if self.p.target_bucket {
            if window {
                self.bw[b] += 1.0
            } else {
                self.bm[b] += 1.0
            }
            if self.bw[b] + self.bm[b] > S as f64 {
                self.bw[b] /= 2.0;
                self.bm[b] /= 2.0;
            }
        } else {
            if window {
                self.from_w += 1.0
            } else {
                self.from_m += 1.0
            }
            if self.from_w + self.from_m > self.slots as f64 {
                self.from_w = (self.from_w / 2.0).floor();
                self.from_m = (self.from_m / 2.0).floor();
            }
        }
    }
    fn refresh(&self, sc: u64, now: u64) -> u64 {
        if self.p.slru && sc & MAIN != 0 {
            MAIN | PROT | now
        } else {
            (sc & MAIN) | now
        }
    }
    // WS: the window's oldest entries to the main tier (unprotected) while
    // the window is over its share.
    fn shrink(&mut self, b: usize) {
        loop {
            let (w, ow, _) = self.tiers(b);
            match ow {
                Some((c, sc)) if w > self.win_slots(b) => self.scores[b * S + c] = sc | MAIN,
                _ => return,
            }
        }
    }
    // SLRU: the oldest protected entries lose protection while more than
    // PF of the main tier is protected.
    fn demote(&mut self, b: usize) {
        let r = b * S..b * S + S;
        let main = self.scores[r.clone()].iter().zip(&self.keys[r.clone()]).filter(|(&s, &k)| k != EMPTY && s & MAIN != 0).count();
        let mut prot = self.scores[r.clone()].iter().zip(&self.keys[r.clone()]).filter(|(&s, &k)| k != EMPTY && s & PROT != 0).count();
        while prot * 10 > self.p.pf10 * main {
            let (i, _) = r
                .clone()
                .filter(|&i| self.keys[i] != EMPTY && self.scores[i] & PROT != 0)
                .map(|i| (i, self.scores[i]))
                .min_by_key(|&(_, s)| s)
                .unwrap();
            self.scores[i] &= !PROT;
            prot -= 1;
        }
    }
    fn insert(&mut self, k: u64, now: u64, counted: bool) {
        if !counted {
            self.count(k);
        }
        let b = self.bucket(k);
        if let Some(s) = self.find(b, k) {
            let i = b * S + s;
            self.scores[i] = self.refresh(self.scores[i], now);
            return;
        }
        self.on_miss(b, k);
        if self.p.shrink {
            self.shrink(b);
        }
        if let Some(s) = (0..S).find(|&s| self.keys[b * S + s] == EMPTY) {
            let (w, ow, _) = self.tiers(b);
            if let Some((c, sc)) = ow.filter(|_| w >= self.win_slots(b)) {
                self.scores[b * S + c] = sc | MAIN;
            }
            self.keys[b * S + s] = k;
            self.pos.insert(k, b * S + s);
            self.scores[b * S + s] = now;
            return;
        }
        if self.p.slru {
            self.demote(b);
        }
        let (w, ow, om) = self.tiers(b);
        let win = self.win_slots(b);
        let (slot, window) = match (ow, om) {
            (Some((c, _)), Some((v, _))) if w >= win => {
                let (fc, fv) = (self.freq(self.keys[b * S + c]), self.freq(self.keys[b * S + v]));
                if fc > fv.saturating_add(self.p.adm) {
                    self.scores[b * S + c] |= MAIN;
                    (v, false)
                } else {
                    (c, true)
                }
            }
            (_, Some((v, _))) => (v, false),
            (Some((c, _)), None) => (c, true),
            _ => unreachable!(),
        };
        let old = self.keys[b * S + slot];
        self.on_evict(b, old, window);
        self.pos.remove(&old);
        self.keys[b * S + slot] = k;
        self.pos.insert(k, b * S + slot);
        self.scores[b * S + slot] = now;
    }
}

fn run(p: &P, trace: &[u64], slots: u64) -> f64 {
    let mut sim = Sim::new(p.clone(), slots);
    let mut hits = 0u64;
    let mut now = 1u64;
    let mut seen = HashSet::new();
    let mut missed = Vec::new();
    for batch in trace.chunks(64) {
        now += 1;
        missed.clear();
        seen.clear();
        let mut found = vec![false; batch.len()];
        for (i, &k) in batch.iter().enumerate() {
            let b = sim.bucket(k);
            if let Some(s) = sim.find(b, k) {
                found[i] = true;
                hits += 1;
                let j = b * S + s;
                sim.scores[j] = sim.refresh(sim.scores[j], now);
                sim.count(k);
            }
        }
        for (i, &k) in batch.iter().enumerate() {
            if !seen.insert(k) && !found[i] {
                hits += 1;
            }
            if !found[i] {
                missed.push(k);
            }
        }
        if let Some(c) = &mut sim.chooser {
            // As the table feeds them: a find's hits after the find, the
            // written keys after the insert (cpu::adapt::Window::observe).
            c.batch(batch.iter().zip(&found).filter(|(_, &f)| f).map(|(&k, _)| k));
        }
        if p.plain {
            for &k in &missed {
                sim.count(k);
            }
        }
        for &k in &missed {
            sim.insert(k, now, p.plain);
        }
        sim.age();
        if let Some(c) = &mut sim.chooser {
            c.batch(missed.iter().copied());
        }
    }
    if env::var("DBG").is_ok() {
        if let Some(c) = &sim.chooser {
            eprintln!("slots {} rate {} sampled accesses {} final window {} %", slots, c.rate(), c.accesses(), c.window_percent());
        }
        let avg: f64 = (0..sim.nb).map(|b| sim.win_slots(b) as f64).sum::<f64>() / sim.nb as f64;
        eprintln!("slots {} avg window {:.1}", slots, avg);
    }
    100.0 * hits as f64 / trace.len() as f64
}

fn main() {
    let args: Vec<String> = env::args().collect();
    let trace_path = &args[1];
    let caps: Vec<u64> = args[2].split(',').map(|s| s.parse().unwrap()).collect();
    BLOCKED.store(env::var("BLOCKED").is_ok(), std::sync::atomic::Ordering::Relaxed);
    let bytes = std::fs::read(trace_path).unwrap();
    let trace: Vec<u64> = bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
    let e = |n: &str, d: &str| env::var(n).unwrap_or(d.to_string());
    let p = P {
        plain: e("PLAIN", "0") == "1",
        ghost_bucket: e("GB", "0") == "1",
        target_bucket: e("TB", "0") == "1",
        agebound: e("AB", "0") == "1",
        period: e("PERIOD", "10").parse().unwrap(),
        init: e("INIT", "0.5").parse().unwrap(),
        gain: e("GAIN", "1").parse().unwrap(),
        width: e("WIDTH", "8").parse().unwrap(),
        fixed: env::var("FIXED").ok().map(|s| s.parse().unwrap()),
        gf: e("GF", "99").parse().unwrap(),
        gfm: e("GFM", "0") == "1",
        slru: e("SLRU", "0") == "1",
        pf10: e("PF", "8").parse().unwrap(),
        shrink: e("WS", "0") == "1",
        ms: e("MS", "0") == "1",
        adm: e("ADM", "0").parse().unwrap(),
        msp: {
            let d = minisim::Params::default();
            minisim::Params {
                windows: env::var("MSW").map(|w| w.split(',').map(|x| x.parse().unwrap()).collect()).unwrap_or(d.windows),
                sampled_slots: e("MSS", &d.sampled_slots.to_string()).parse().unwrap(),
                freq_period: e("MSF", &d.freq_period.to_string()).parse().unwrap(),
                hit_period_percent: e("MSH", &d.hit_period_percent.to_string()).parse().unwrap(),
                margin: e("MSM", &d.margin.to_string()).parse().unwrap(),
                admit_margin: e("MSA", &d.admit_margin.to_string()).parse().unwrap(),
            }
        },
    };
    let out: Vec<String> = caps.iter().map(|&c| format!("{:.2}", run(&p, &trace, c))).collect();
    println!("{}", out.join(" "));
}
