//! Entry commands: `put`, `get`, `fill`, `erase`.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use hkv_client::{proto, Client};

use crate::render::print_found;

pub fn parse_entry(s: &str) -> Result<(u64, Vec<f32>)> {
    let (k, v) = s.split_once('=').with_context(|| format!("{s:?}: expected KEY=V1,V2,..."))?;
    let key = k.trim().parse().with_context(|| format!("{k:?} is not a u64 key"))?;
    let vals = v
        .split(',')
        .map(|x| x.trim().parse::<f32>().with_context(|| format!("{x:?} is not a number")))
        .collect::<Result<Vec<_>>>()?;
    Ok((key, vals))
}

/// The width of table `table`'s rows on the wire (its dim, plus an
/// optimizer's state columns).
pub fn table_dim(c: &mut Client, table: &str) -> Result<usize> {
    let t =
        c.tables()?.into_iter().find(|t| t.spec.name == table).with_context(|| format!("no table named {table:?}"))?;
    Ok(t.row_dim())
}

/// `hkvctl put TABLE KEY=V1,V2,...`.
pub fn put(c: &mut Client, table: &str, entries: &[String], scores: Option<Vec<u64>>) -> Result<()> {
    let dim = table_dim(c, table)?;
    let mut keys = vec![];
    let mut values = vec![];
    for e in entries {
        let (k, v) = parse_entry(e)?;
        if v.len() != dim {
            bail!("{e:?} has {} values; table {table} has dim {dim}", v.len());
        }
        keys.push(k);
        values.extend(v);
    }
    println!("{}", c.insert_or_assign(table, &keys, &values, scores.as_deref())?);
    Ok(())
}

/// `hkvctl get TABLE KEY...`.
pub fn get(c: &mut Client, table: &str, keys: &[u64]) -> Result<()> {
    let f = c.find(table, keys)?;
    print_found(keys, &f);
    Ok(())
}

/// `hkvctl fill`: keys `start..start + count`, values derived from the key.
pub fn fill(c: &mut Client, table: &str, count: u64, start: u64, batch: u64) -> Result<()> {
    let dim = table_dim(c, table)?;
    let t = Instant::now();
    let mut s = proto::Summary::default();
    let mut k = start;
    while k < start + count {
        let n = batch.max(1).min(start + count - k);
        let keys: Vec<u64> = (k..k + n).collect();
        let values: Vec<f32> = keys.iter().flat_map(|&x| (0..dim).map(move |d| x as f32 + d as f32)).collect();
        s += c.insert_or_assign(table, &keys, &values, None)?;
        k += n;
    }
    let secs = t.elapsed().as_secs_f64();
    println!("wrote {count} keys in {secs:.2}s ({:.0} keys/s): {s}", count as f64 / secs);
    Ok(())
}

/// `hkvctl erase TABLE KEY...`.
pub fn erase(c: &mut Client, table: &str, keys: &[u64]) -> Result<()> {
    let n = c.erase(table, keys)?;
    println!("erased {n} of {} keys", keys.len());
    Ok(())
}
