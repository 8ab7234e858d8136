//! Argument checks shared by every backend: a batch that fails one is
//! refused whole, before any lock is taken or anything is applied.

use crate::config::{ScorePolicy, TableConfig};
use crate::error::{Error, Result};
use crate::is_reserved;

/// Keys scanned once for reserved markers: only [`CheckedKeys::check`]
/// makes one (by scanning), and [`CheckedKeys::parts`] takes parts of one
/// (which hold only its keys). Whoever splits a batch over several shards
/// checks it whole this way first, so that no shard applies its part of a
/// batch another would refuse; each shard still checks its own part, as it
/// checks every caller's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedKeys(Vec<u64>);

impl CheckedKeys {
    /// `keys` once scanned: the error of [`keys`] when one is reserved.
    pub fn check(k: Vec<u64>) -> Result<CheckedKeys> {
        keys(&k)?;
        Ok(CheckedKeys(k))
    }

    /// Per part, the keys at its indices (each below [`CheckedKeys::len`]), in that order.
    pub fn parts(self, parts: &[Vec<u32>]) -> Vec<CheckedKeys> {
        parts.iter().map(|p| CheckedKeys(p.iter().map(|&i| self.0[i as usize]).collect())).collect()
    }

    /// The keys, as a vector.
    pub fn into_vec(self) -> Vec<u64> {
        self.0
    }

    /// The keys.
    pub fn as_slice(&self) -> &[u64] {
        &self.0
    }

    /// Keys.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

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
    keys(k)?;
    write_arrays(config, k.len(), value_array, s, inserts, outcome_len)
}

/// [`write`]'s checks but the keys' scan, for `n` keys (checked already,
/// [`CheckedKeys`]).
pub fn write_arrays(
    config: &TableConfig,
    n: usize,
    value_array: Option<(&'static str, usize)>,
    s: Option<&[u64]>,
    inserts: bool,
    outcome_len: Option<usize>,
) -> Result<()> {
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

#[cfg(test)]
mod checked_tests {
    use super::*;
    use crate::RESERVED_KEY_MIN;

    #[test]
    fn checked_keys_refuse_a_reserved_key_and_split_into_parts() {
        let bad = vec![1, RESERVED_KEY_MIN, 3];
        assert!(matches!(CheckedKeys::check(bad), Err(Error::ReservedKey { index: 1, .. })));
        let k = CheckedKeys::check(vec![5, 6, 7, 8]).unwrap();
        let parts = k.parts(&[vec![0, 2], vec![1, 3]]);
        assert_eq!(parts[0].as_slice(), &[5, 7]);
        assert_eq!(parts[1].as_slice(), &[6, 8]);
    }
}
