//! Optimizers that run in the table: a table created with one stores, per
//! key, its `dim` values followed by the optimizer's state columns, and
//! [`Shard::apply_gradients`](crate::Shard::apply_gradients) applies one
//! step to the values and state of each key given a gradient row.
//!
//! | optimizer | state columns after the values | step (g = grad + weight_decay · w) |
//! |---|---|---|
//! | [`Optimizer::Sgd`] | none | w −= lr · g |
//! | [`Optimizer::Adagrad`] | `dim`: the sum of squares s | s += g²; w −= lr · g / (√s + eps) |
//! | [`Optimizer::RowwiseAdagrad`] | 1: the row's accumulator a | a += mean(g²); w −= lr · g / (√a + eps) |
//! | [`Optimizer::Adam`] | `2·dim`: m, then v | m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²; w −= (lr / (1−β1^t)) · m / (√v / √(1−β2^t) + eps) |
//!
//! Adagrad and Adam follow `torch.optim.Adagrad` (no lr decay, initial
//! accumulator 0) and `torch.optim.Adam` (L2 weight decay, not AdamW) for
//! a row that gets a gradient at every step; `t` is the step the caller
//! passes (1 for the first), one count for the whole table, as torch keeps
//! one per parameter tensor.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The optimizer a table's rows carry state for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    /// Plain SGD: no state.
    #[default]
    Sgd,
    /// Adagrad: a sum of squared gradients per value.
    Adagrad,
    /// Row-wise Adagrad: one accumulator per row (the mean of the squared gradients).
    RowwiseAdagrad,
    /// Adam: first and second moments per value.
    Adam,
}

impl Optimizer {
    /// State columns stored after `dim` values.
    pub fn state_cols(self, dim: usize) -> usize {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::Adagrad => dim,
            Optimizer::RowwiseAdagrad => 1,
            Optimizer::Adam => 2 * dim,
        }
    }

    /// Floats a stored row holds: the values and the state.
    pub fn row_dim(self, dim: usize) -> usize {
        dim + self.state_cols(dim)
    }
}

/// The hyperparameters of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Learning rate.
    pub lr: f32,
    /// Added to the denominator (Adagrad, row-wise Adagrad, Adam).
    pub eps: f32,
    /// Adam's first-moment decay.
    pub beta1: f32,
    /// Adam's second-moment decay.
    pub beta2: f32,
    /// L2 penalty added to the gradient (`g + weight_decay · w`).
    pub weight_decay: f32,
    /// The step number, from 1 (Adam's bias correction).
    pub step: u64,
}

impl Default for Hyper {
    fn default() -> Hyper {
        Hyper { lr: 0.01, eps: 1e-8, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, step: 1 }
    }
}

/// One optimizer step over rows of a table: which optimizer, the value
/// width, the hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// The table's optimizer.
    pub optimizer: Optimizer,
    /// Values per row (the gradients' width).
    pub dim: usize,
    /// This step's hyperparameters.
    pub hyper: Hyper,
    /// Sum the gradients of a key's occurrences in the batch first, then
    /// step the key once ([`sum_duplicates`]); without it each occurrence
    /// steps the row in turn.
    pub sum: bool,
}

impl Step {
    /// Floats of a stored row.
    pub fn row_dim(&self) -> usize {
        self.optimizer.row_dim(self.dim)
    }

    /// Refuses hyperparameters the step cannot use: non-finite numbers,
    /// a negative learning rate or eps, betas outside [0, 1), step 0 for Adam.
    pub fn check(&self) -> Result<()> {
        let h = &self.hyper;
        let bad = |what: &str| Err(Error::Optimizer(what.to_string()));
        for (name, v) in [("lr", h.lr), ("eps", h.eps), ("beta1", h.beta1), ("beta2", h.beta2)] {
            if !v.is_finite() {
                return bad(&format!("{name} {v} is not a finite number"));
            }
        }
        if !h.weight_decay.is_finite() {
            return bad(&format!("weight_decay {} is not a finite number", h.weight_decay));
        }
        if h.lr < 0.0 || h.eps < 0.0 {
            return bad(&format!("lr {} and eps {} must not be negative", h.lr, h.eps));
        }
        if self.optimizer == Optimizer::Adam {
            if !(0.0..1.0).contains(&h.beta1) || !(0.0..1.0).contains(&h.beta2) {
                return bad(&format!("Adam's beta1 {} and beta2 {} must lie in [0, 1)", h.beta1, h.beta2));
            }
            if h.step == 0 {
                return bad("Adam's step counts from 1 (the bias correction of step 0 divides by 0)");
            }
        }
        Ok(())
    }

    /// Adam's step size `lr / (1 − β1^t)` and `√(1 − β2^t)`, in f32 as
    /// [`Step::apply`] uses them (the CUDA backend's kernel takes them
    /// from here, so that both backends step a row to the same bits).
    pub fn adam_terms(&self) -> (f32, f32) {
        let h = &self.hyper;
        let t = h.step.min(i32::MAX as u64) as i32;
        let bias1 = 1.0 - h.beta1.powi(t);
        let bias2_sqrt = (1.0 - h.beta2.powi(t)).sqrt();
        (h.lr / bias1, bias2_sqrt)
    }

    /// Applies the step to one stored `row` (`row_dim()` floats) given its
    /// `grad` (`dim` floats).
    pub fn apply(&self, row: &mut [f32], grad: &[f32]) {
        let d = self.dim;
        let h = &self.hyper;
        let (w, state) = row.split_at_mut(d);
        let g = |i: usize, w: &[f32]| grad[i] + h.weight_decay * w[i];
        match self.optimizer {
            Optimizer::Sgd => {
                for i in 0..d {
                    let gi = g(i, w);
                    w[i] -= h.lr * gi;
                }
            }
            Optimizer::Adagrad => {
                for i in 0..d {
                    let gi = g(i, w);
                    state[i] += gi * gi;
                    w[i] -= h.lr * (gi / (state[i].sqrt() + h.eps));
                }
            }
            Optimizer::RowwiseAdagrad => {
                let mut sum = 0.0f32;
                for i in 0..d {
                    let gi = g(i, w);
                    sum += gi * gi;
                }
                state[0] += sum / d as f32;
                let scale = h.lr / (state[0].sqrt() + h.eps);
                for i in 0..d {
                    let gi = g(i, w);
                    w[i] -= scale * gi;
                }
            }
            Optimizer::Adam => {
                let (m, v) = state.split_at_mut(d);
                let (step_size, bias2_sqrt) = self.adam_terms();
                for i in 0..d {
                    let gi = g(i, w);
                    m[i] += (gi - m[i]) * (1.0 - h.beta1);
                    v[i] = v[i] * h.beta2 + (1.0 - h.beta2) * gi * gi;
                    let denom = v[i].sqrt() / bias2_sqrt + h.eps;
                    w[i] -= step_size * (m[i] / denom);
                }
            }
        }
    }
}

/// Checks a step for a table whose rows hold `row_dim` floats: usable
/// hyperparameters, and rows of the values and the optimizer's state.
pub fn check_step(row_dim: usize, step: &Step) -> Result<()> {
    step.check()?;
    if step.dim == 0 || step.row_dim() != row_dim {
        return Err(Error::Optimizer(format!(
            "{:?} over {} values needs rows of {} floats; this table's rows hold {row_dim}",
            step.optimizer,
            step.dim,
            step.row_dim()
        )));
    }
    Ok(())
}

/// Checks an apply_gradients batch: the table has rows of `step.row_dim()`
/// floats, `grads` holds `dim` per key, the outputs one entry (`dim`
/// floats) per key, the hyperparameters are usable.
pub fn check_batch(
    row_dim: usize,
    step: &Step,
    n: usize,
    grads: usize,
    found: usize,
    updated: Option<usize>,
) -> Result<()> {
    check_step(row_dim, step)?;
    crate::check::len("grads", grads, n * step.dim, || format!("{n} keys, dim {}", step.dim))?;
    crate::check::len("found", found, n, || format!("{n} keys"))?;
    if let Some(u) = updated {
        if step.sum {
            return Err(Error::Optimizer(
                "a step that sums repeated keys' gradients answers no updated values (one row per key, not per \
                 occurrence); ask for one or the other"
                    .into(),
            ));
        }
        crate::check::len("updated values", u, n * step.dim, || format!("{n} keys, dim {}", step.dim))?;
    }
    Ok(())
}

/// Checks an apply_gradients call on a table whose rows hold `row_dim`
/// floats, before anything is locked: the batch ([`check_batch`]: the
/// step, and gradients and outputs sized for the keys) and the keys (no
/// reserved marker). Every backend's `apply_gradients` opens with it.
pub fn check_apply(
    row_dim: usize,
    step: &Step,
    keys: &[u64],
    grads: &[f32],
    found: &[bool],
    updated: Option<&[f32]>,
) -> Result<()> {
    check_batch(row_dim, step, keys.len(), grads.len(), found.len(), updated.map(<[f32]>::len))?;
    crate::check::keys(keys)
}

/// The exponent `E` of a repeated key's fixed-point sum: `2^E` scales its
/// gradients so that `count` of them, each at most `max` in magnitude
/// (positive and finite), sum to less than `2^62`: `count · max` (in f64)
/// lies below `2^(62 − E)`. The CUDA kernel `sum_add` computes the same.
fn sum_exponent(count: u32, max: f32) -> i32 {
    let x = f64::from(count) * f64::from(max);
    62 - (((x.to_bits() >> 52) & 0x7ff) as i32 - 1022)
}

/// `2^e` as an f64 (`e` within the normal range).
fn pow2(e: i32) -> f64 {
    f64::from_bits(((1023 + e) as u64) << 52)
}

/// A key's summed gradient element from its fixed-point sum `acc`
/// (scaled by `2^e`): through f64, each conversion rounded to nearest.
fn sum_value(acc: i64, e: i32) -> f32 {
    ((acc as f64) * pow2(-e)) as f32
}

/// The fixed-point form of gradient element `g` at scale `2^e`.
fn sum_term(g: f32, e: i32) -> i64 {
    (f64::from(g) * pow2(e)).round_ties_even() as i64
}

/// The largest magnitude of a gradient row, as f32 bits (NaN above every
/// finite value and infinity).
fn max_bits(g: &[f32]) -> u32 {
    g.iter().map(|x| x.to_bits() & 0x7fff_ffff).max().unwrap_or(0)
}

/// apply_gradients with `sum` ([`Step::sum`]): the distinct keys of `keys`
/// in order of first occurrence, each with one gradient row, and the index
/// of each key's entry among them; `None` when no key repeats (the batch
/// steps as it is).
///
/// A key that occurs once keeps its gradient bit for bit. A repeated key's
/// rows are summed exactly, element by element, in 64-bit fixed point: its
/// count `c` and largest element magnitude `m` give the scale `2^E`
/// ([`sum_exponent`]: `c · m < 2^(62 − E)`), each element is rounded to the
/// nearest multiple of `2^−E` (ties to even), the integers are added, and
/// the sum is rounded to f64 and then to f32. Integer sums do not depend on
/// their order, so the CUDA backend, which adds with atomics in any order,
/// gets the same bits. All elements zero sum to 0.0; a row holding a NaN
/// or an infinity makes every element of its key's sum NaN.
pub fn sum_duplicates(keys: &[u64], grads: &[f32], dim: usize) -> Option<(Vec<u64>, Vec<f32>, Vec<usize>)> {
    let n = keys.len();
    let mut at: std::collections::HashMap<u64, usize> = std::collections::HashMap::with_capacity(n);
    let mut own = Vec::with_capacity(n);
    let mut uniq = Vec::new();
    for &k in keys {
        let u = *at.entry(k).or_insert_with(|| {
            uniq.push(k);
            uniq.len() - 1
        });
        own.push(u);
    }
    if uniq.len() == n {
        return None;
    }
    let m = uniq.len();
    let (mut count, mut max) = (vec![0u32; m], vec![0u32; m]);
    for (i, &u) in own.iter().enumerate() {
        count[u] += 1;
        max[u] = max[u].max(max_bits(&grads[i * dim..(i + 1) * dim]));
    }
    // Each key's scale, for a repeated key with finite, not all zero rows.
    let exp: Vec<Option<i32>> = (0..m)
        .map(|u| {
            (count[u] > 1 && max[u] != 0 && max[u] < 0x7f80_0000)
                .then(|| sum_exponent(count[u], f32::from_bits(max[u])))
        })
        .collect();
    let mut acc = vec![0i64; m * dim];
    let mut out = vec![0.0f32; m * dim];
    for (i, &u) in own.iter().enumerate() {
        let g = &grads[i * dim..(i + 1) * dim];
        if count[u] == 1 {
            out[u * dim..(u + 1) * dim].copy_from_slice(g);
        } else if let Some(e) = exp[u] {
            for (a, &x) in acc[u * dim..(u + 1) * dim].iter_mut().zip(g) {
                *a = a.wrapping_add(sum_term(x, e));
            }
        }
    }
    for u in (0..m).filter(|&u| count[u] > 1) {
        let o = &mut out[u * dim..(u + 1) * dim];
        match exp[u] {
            Some(e) => o.iter_mut().zip(&acc[u * dim..(u + 1) * dim]).for_each(|(x, &a)| *x = sum_value(a, e)),
            None if max[u] >= 0x7f80_0000 => o.fill(f32::NAN),
            None => {} // all zero
        }
    }
    Some((uniq, out, own))
}

/// [`Shard::apply_gradients`](crate::Shard::apply_gradients) with
/// `step.sum` on the host: the batch's repeated keys summed
/// ([`sum_duplicates`]), `apply` run on the distinct keys with the step
/// unsummed, the found flags given back per occurrence. `None` when
/// `step.sum` is off (the caller steps the batch itself).
pub fn apply_summed(
    keys: &[u64],
    grads: &[f32],
    step: &Step,
    found: &mut [bool],
    apply: impl FnOnce(&[u64], &[f32], &Step, &mut [bool]) -> Result<u64>,
) -> Option<Result<u64>> {
    if !step.sum {
        return None;
    }
    let one = Step { sum: false, ..*step };
    let Some((uniq, sums, own)) = sum_duplicates(keys, grads, step.dim) else {
        return Some(apply(keys, grads, &one, found));
    };
    let mut f = vec![false; uniq.len()];
    Some(apply(&uniq, &sums, &one, &mut f).inspect(|_| {
        for (o, &u) in found.iter_mut().zip(&own) {
            *o = f[u];
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(optimizer: Optimizer, dim: usize, hyper: Hyper) -> Step {
        Step { optimizer, dim, hyper, sum: false }
    }

    #[test]
    fn row_widths() {
        assert_eq!(Optimizer::Sgd.row_dim(8), 8);
        assert_eq!(Optimizer::Adagrad.row_dim(8), 16);
        assert_eq!(Optimizer::RowwiseAdagrad.row_dim(8), 9);
        assert_eq!(Optimizer::Adam.row_dim(8), 24);
    }

    /// One step of each optimizer on a 2-value row, against the formulas
    /// worked out by hand (f64, compared within 1e-6).
    #[test]
    fn one_step_by_hand() {
        let h = Hyper { lr: 0.5, eps: 0.1, beta1: 0.9, beta2: 0.99, weight_decay: 0.0, step: 1 };
        let g = [2.0f32, -1.0];
        let mut r = vec![1.0f32, 1.0];
        step(Optimizer::Sgd, 2, h).apply(&mut r, &g);
        assert_eq!(r, vec![0.0, 1.5]);
        let mut r = vec![1.0f32, 1.0, 0.0, 0.0];
        step(Optimizer::Adagrad, 2, h).apply(&mut r, &g);
        let want = [1.0 - 0.5 * 2.0 / (2.0 + 0.1), 1.0 + 0.5 * 1.0 / (1.0 + 0.1), 4.0, 1.0];
        for (a, b) in r.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{r:?} {want:?}");
        }
        let mut r = vec![1.0f32, 1.0, 0.0];
        step(Optimizer::RowwiseAdagrad, 2, h).apply(&mut r, &g);
        let acc: f64 = 2.5;
        let want = [1.0 - 0.5 * 2.0 / (acc.sqrt() + 0.1), 1.0 + 0.5 / (acc.sqrt() + 0.1), acc];
        for (a, b) in r.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{r:?} {want:?}");
        }
        // Adam's first step moves every value by about lr (m̂ / √v̂ = ±1).
        let mut r = vec![1.0f32, 1.0, 0.0, 0.0, 0.0, 0.0];
        step(Optimizer::Adam, 2, Hyper { eps: 0.0, ..h }).apply(&mut r, &g);
        assert!((r[0] - 0.5).abs() < 1e-5 && (r[1] - 1.5).abs() < 1e-5, "{r:?}");
    }

    #[test]
    fn bad_hyperparameters_are_refused() {
        let ok = step(Optimizer::Adam, 4, Hyper::default());
        assert!(ok.check().is_ok());
        for h in [
            Hyper { lr: f32::NAN, ..Hyper::default() },
            Hyper { lr: -1.0, ..Hyper::default() },
            Hyper { beta1: 1.0, ..Hyper::default() },
            Hyper { step: 0, ..Hyper::default() },
            Hyper { weight_decay: f32::INFINITY, ..Hyper::default() },
        ] {
            assert!(matches!(step(Optimizer::Adam, 4, h).check(), Err(Error::Optimizer(_))), "{h:?}");
        }
        assert!(check_batch(12, &ok, 1, 4, 1, None).is_ok());
        assert!(check_batch(8, &ok, 1, 4, 1, None).is_err());
        assert!(check_batch(12, &ok, 1, 3, 1, None).is_err());
        let (grads, found) = ([0.0f32; 4], [false]);
        assert!(check_apply(12, &ok, &[7], &grads, &found, None).is_ok());
        assert!(check_apply(12, &ok, &[7], &grads, &found, Some(&[0.0; 3])).is_err());
        assert!(matches!(
            check_apply(12, &ok, &[crate::RESERVED_KEY_MIN], &grads, &found, None),
            Err(Error::ReservedKey { index: 0, .. })
        ));
    }
}
