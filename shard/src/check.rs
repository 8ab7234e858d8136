//! Argument checks shared by every backend: a batch that fails one is
//! refused whole, before any lock is taken or anything is applied.

use crate::config::{ScorePolicy, TableConfig};
use crate::error::{Error, Result};
use crate::is_reserved;

/// An array must have `expected` elements.
pub fn len(what: &'static str, got: usize, expected: usize, detail: impl FnOnce() -> String) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Length { what, expected, got, detail: detail() })
    }
}

/// No key may be a reserved marker.
pub fn keys(keys: &[u64]) -> Result<()> {
    match keys.iter().position(|&k| is_reserved(k)) {
        Some(index) => Err(Error::ReservedKey { key: keys[index], index }),
        None => Ok(()),
    }
}

/// The target rows of [`crate::Shard::find_at`]: one per key, strictly
/// increasing, inside an answer of `rows` found bytes and `rows × dim`
/// values.
pub fn rows_at(config: &TableConfig, n: usize, at: &[u32], values: usize, rows: usize) -> Result<()> {
    per_key("target rows", at.len(), n)?;
    len("values", values, rows * config.dim, || format!("{rows} rows x dim {}", config.dim))?;
    if let Some(i) = at.windows(2).position(|w| w[0] >= w[1]) {
        return Err(Error::Config(format!("target rows must increase: row {} after {}", at[i + 1], at[i])));
    }
    match at.last() {
        Some(&last) if last as usize >= rows => {
            Err(Error::Config(format!("target row {last} outside an answer of {rows} rows")))
        }
        _ => Ok(()),
    }
}

/// One element per key.
fn per_key(what: &'static str, got: usize, n: usize) -> Result<()> {
    len(what, got, n, || format!("{n} keys"))
}

/// A value array must hold `n × dim` floats.
fn values(config: &TableConfig, what: &'static str, n: usize, got: usize) -> Result<()> {
    let dim = config.dim;
    len(what, got, n * dim, || format!("{n} keys x dim {dim}"))
}

/// Scores must fit the batch and the policy. `needed`: the op inserts, so
/// Custom needs them.
fn scores(config: &TableConfig, scores: Option<&[u64]>, n: usize, needed: bool) -> Result<()> {
    let policy = config.policy;
    match scores {
        Some(s) => {
            per_key("scores", s.len(), n)?;
            if !policy.takes_scores() {
                return Err(Error::ScoresNotAccepted { policy });
            }
        }
        None if needed && policy == ScorePolicy::Custom => return Err(Error::ScoresRequired { policy }),
        None => {}
    }
    Ok(())
}

/// find / contains: keys, the value array's length (find), one found flag
/// per key, the scores array's length when asked for.
pub fn lookup(
    config: &TableConfig,
    k: &[u64],
    value_len: Option<usize>,
    found_len: usize,
    score_len: Option<usize>,
) -> Result<()> {
    let n = k.len();
    keys(k)?;
    if let Some(v) = value_len {
        values(config, "values", n, v)?;
    }
    per_key("found", found_len, n)?;
    if let Some(s) = score_len {
        per_key("scores", s, n)?;
    }
    Ok(())
}

/// The writes: keys, `(name, length)` of the value or delta array if any,
/// caller scores against the policy (`inserts`: Custom needs them), one
/// outcome per key when asked for.
pub fn write(
    config: &TableConfig,
    k: &[u64],
    value_array: Option<(&'static str, usize)>,
    s: Option<&[u64]>,
    inserts: bool,
    outcome_len: Option<usize>,
) -> Result<()> {
    let n = k.len();
    keys(k)?;
    if let Some((what, got)) = value_array {
        values(config, what, n, got)?;
    }
    scores(config, s, n, inserts)?;
    if let Some(o) = outcome_len {
        per_key("outcomes", o, n)?;
    }
    Ok(())
}

/// erase: keys, one erased flag per key when asked for.
pub fn erase(k: &[u64], erased_len: Option<usize>) -> Result<()> {
    keys(k)?;
    match erased_len {
        Some(e) => per_key("erased", e, k.len()),
        None => Ok(()),
    }
}
