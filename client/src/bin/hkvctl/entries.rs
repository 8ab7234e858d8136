//! Entry commands: `put`, `get`, `fill`, `erase`.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use hkv_client::{proto, Client};

use crate::render::print_found;

pub fn parse_entry(s: &str) -> Result<(u64, Vec<f32>)> {
    let (k, v) = s.split_once('=').with_context(|| format!("{s:?}: expected KEY=V1,V2,..."))?;
    let key = k.trim().parse().with_context(|| format!("{k:?} is not a u64 key"))?;
    let vals = v.split(',').map(parse_value).collect::<Result<Vec<_>>>()?;
    Ok((key, vals))
}

/// One float32 value of an entry: a number, `nan`, `inf` or `-inf`; a
/// finite number beyond float32's range is refused (it would be stored as
/// an infinity).
pub fn parse_value(x: &str) -> Result<f32> {
    let x = x.trim();
    let v = x.parse::<f32>().with_context(|| format!("{x:?} is not a number"))?;
    if v.is_infinite() && !x.trim_start_matches(['+', '-']).to_ascii_lowercase().starts_with("inf") {
        bail!("{x:?} does not fit a float32 (at most about 3.4e38 in magnitude; write inf for an infinity)");
    }
    Ok(v)
}

/// Table `table` as the daemon lists it.
pub fn table_info(c: &mut Client, table: &str) -> Result<proto::TableInfo> {
    c.tables()?
        .into_iter()
        .find(|t| t.spec.name == table)
        .with_context(|| format!("no table named {table:?}; create it first (hkvctl create-table)"))
}

/// Refuses an entry of `got` values for table `t`'s rows, saying what a
/// row holds (an optimizer's state columns after the dim's values).
pub fn check_width(entry: &str, got: usize, t: &proto::TableInfo) -> Result<()> {
    let w = t.row_dim();
    if got == w {
        return Ok(());
    }
    let name = &t.spec.name;
    if w == t.spec.dim {
        bail!("{entry:?} has {got} values; table {name} has dim {w}");
    }
    bail!(
        "{entry:?} has {got} values; a row of table {name} has {w}: its dim {} and {} columns of its optimizer's \
         state (give them as 0 for a new row)",
        t.spec.dim,
        w - t.spec.dim
    );
}

/// `hkvctl put TABLE KEY=V1,V2,...`.
pub fn put(c: &mut Client, table: &str, entries: &[String], scores: Option<Vec<u64>>) -> Result<()> {
    let info = table_info(c, table)?;
    let mut keys = vec![];
    let mut values = vec![];
    let mut given = std::collections::HashMap::new();
    for e in entries {
        let (k, v) = parse_entry(e)?;
        check_width(e, v.len(), &info)?;
        // One batch writes a key given twice twice, in no set order: which
        // value stays is not said, and the summary would count the key twice.
        if let Some(first) = given.insert(k, e) {
            bail!("key {k} is given twice ({first:?} and {e:?}); give each key once");
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

/// The first of the reserved keys, which no table stores.
const FIRST_RESERVED: u64 = 0xFFFF_FFFF_FFFF_FFFC;

/// `hkvctl fill`: keys `start..start + count`, values derived from the key.
pub fn fill(c: &mut Client, table: &str, count: u64, start: u64, batch: u64) -> Result<()> {
    let info = table_info(c, table)?;
    if info.spec.policy == proto::Policy::Custom {
        bail!("table {table} has policy custom: each key needs a score, which fill does not give (use put --scores)");
    }
    // The keys end at start + count - 1, which must be below the reserved
    // keys (PROTOCOL.md: 0xFFFF_FFFF_FFFF_FFFC and above).
    let end = match start.checked_add(count) {
        Some(end) if end <= FIRST_RESERVED => end,
        _ => bail!(
            "--start {start} --count {count} passes the largest key ({}; the keys from {FIRST_RESERVED:#x} on are \
             reserved): at most {} keys from {start}",
            FIRST_RESERVED - 1,
            FIRST_RESERVED.saturating_sub(start)
        ),
    };
    let dim = info.row_dim();
    // The largest request, refused before it is built when the daemon
    // would refuse it (its body is the larger frame: the answer is a
    // summary), with the --batch that passes.
    let frame = |n: u64| crate::frame::insert_body_len(table, dim, n);
    let most = batch.min(count);
    crate::frame::check(c, most, &frame, &format!("a write of {most} keys of {dim} values"), "--batch")?;
    let t = Instant::now();
    let mut s = proto::Summary::default();
    let mut k = start;
    while k < end {
        let n = batch.min(end - k); // batch >= 1 (the flag's range)
        let keys: Vec<u64> = (k..k + n).collect();
        let values: Vec<f32> = keys.iter().flat_map(|&x| (0..dim).map(move |d| x as f32 + d as f32)).collect();
        s += c.insert_or_assign(table, &keys, &values, None).map_err(|e| match e.code() {
            Some(proto::ErrorCode::Oversized) => {
                anyhow::anyhow!("{e} (fill sends {most} keys a request: give a smaller --batch)")
            }
            _ => e.into(),
        })?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_beyond_float32_are_refused_and_infinities_taken() {
        assert_eq!(
            parse_entry("7=1.5,-2,inf,-Infinity").unwrap(),
            (7, vec![1.5, -2.0, f32::INFINITY, f32::NEG_INFINITY])
        );
        assert!(parse_entry("7=nan").unwrap().1[0].is_nan());
        let e = parse_entry("7=1e40").unwrap_err().to_string();
        assert!(e.contains("does not fit a float32"), "{e}");
        assert!(parse_entry("7=-1e39").is_err());
        assert!(parse_entry("7=x").unwrap_err().to_string().contains("is not a number"));
    }
}
