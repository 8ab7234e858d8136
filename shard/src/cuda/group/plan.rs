//! Who sends what to whom: the all-to-all plans of the device route and
//! what each operation moves.

use super::*;

/// Exclusive prefix sums of a row of counts.
pub(super) fn starts(c: &[u64]) -> Vec<u64> {
    c.iter()
        .scan(0, |acc, &x| {
            let s = *acc;
            *acc += x;
            Some(s)
        })
        .collect()
}

/// Which buffer of a node an exchange reads or fills.
#[derive(Clone, Copy)]
pub(super) enum Buf {
    SendKeys,
    SendValues,
    SendScores,
    SendFound,
    RecvKeys,
    RecvValues,
    RecvScores,
    RecvFound,
}

/// Who sends what to whom in one all-to-all: rank r sends `lens[r][p] * w`
/// elements of its source buffer, from `send_at[r][p] * w`, to rank p,
/// which receives them into its target buffer at `recv_at[p][r] * w`;
/// target buffers are grown to `recv_size[r] * w` first.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) lens: Vec<Vec<u64>>,
    pub(super) send_at: Vec<Vec<u64>>,
    pub(super) recv_at: Vec<Vec<u64>>,
    pub(super) recv_size: Vec<u64>,
}

impl Plan {
    /// Segments packed in peer order on both sides, skipping each rank's
    /// own segment when `skip_self` (a rank serves its own keys in place).
    pub(super) fn packed(c: &[Vec<u64>], skip_self: bool) -> Plan {
        let nr = c.len();
        let lens: Vec<Vec<u64>> =
            (0..nr).map(|r| (0..nr).map(|p| if skip_self && p == r { 0 } else { c[r][p] }).collect()).collect();
        let send_at = c.iter().map(|row| starts(row)).collect();
        let cols: Vec<Vec<u64>> = (0..nr).map(|r| (0..nr).map(|p| lens[p][r]).collect()).collect();
        let recv_at = cols.iter().map(|col| starts(col)).collect();
        let recv_size: Vec<u64> = cols.iter().map(|col| col.iter().sum()).collect();
        Plan { lens, send_at, recv_at, recv_size }
    }

    /// The way back: what was received returns to where it was sent from,
    /// into buffers of `sizes[r]` keys.
    pub(super) fn back(&self, sizes: &[u64]) -> Plan {
        let nr = self.lens.len();
        let t = |m: &Vec<Vec<u64>>| -> Vec<Vec<u64>> { (0..nr).map(|r| (0..nr).map(|p| m[p][r]).collect()).collect() };
        Plan {
            lens: t(&self.lens),
            send_at: self.recv_at.clone(),
            recv_at: self.send_at.clone(),
            recv_size: sizes.to_vec(),
        }
    }
}

/// Keeps the first part of a batch (it holds the lock group) and folds
/// later parts into it.
pub(super) fn fold<'a>(first: &mut Option<Pending<'a>>, p: Pending<'a>) {
    match first {
        Some(f) => f.absorb(p),
        None => *first = Some(p),
    }
}

/// What an op moves: rows to the owners, rows and flags back.
pub(super) struct Moves {
    pub(super) values_in: bool,
    pub(super) values_out: bool,
    pub(super) found_out: bool,
    /// Misses leave the caller's rows untouched (find).
    pub(super) masked: bool,
}

pub(super) fn moves(op: DeviceOp) -> Result<Moves> {
    let m = |values_in, values_out, found_out, masked| Ok(Moves { values_in, values_out, found_out, masked });
    match op {
        DeviceOp::Find => m(false, true, true, true),
        DeviceOp::Contains | DeviceOp::Erase => m(false, false, true, false),
        DeviceOp::InsertOrAssign | DeviceOp::Assign => m(true, false, false, false),
        DeviceOp::FindOrInsert => m(true, true, false, false),
        other => Err(Error::Config(format!("{other:?} is not offered on a GPU group"))),
    }
}
