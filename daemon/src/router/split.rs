//! Where a batch's keys go: per shard, the request rows of its keys
//! (`hkv_shard::hash::shard_of`, a mix independent of the bucket hashes),
//! and the sub-batches' answers put back in request order.

use hkv_shard::hash::shard_of;

/// Which shard each key goes to: per shard, the request indices.
fn split(keys: &[u64], n: usize) -> Vec<Vec<u32>> {
    let mut parts: Vec<Vec<u32>> = (0..n).map(|_| Vec::with_capacity(keys.len() / n + 16)).collect();
    for (i, &k) in keys.iter().enumerate() {
        parts[shard_of(k, n as u64) as usize].push(i as u32);
    }
    parts
}

fn gather<T: Copy>(src: &[T], idx: &[u32], width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(idx.len() * width);
    for &i in idx {
        let i = i as usize;
        out.extend_from_slice(&src[i * width..(i + 1) * width]);
    }
    out
}

fn scatter<T: Copy>(dst: &mut [T], idx: &[u32], src: &[T], width: usize) {
    for (j, &i) in idx.iter().enumerate() {
        let i = i as usize;
        dst[i * width..(i + 1) * width].copy_from_slice(&src[j * width..(j + 1) * width]);
    }
}

/// Where the keys of one request go. With one shard (one GPU) every key goes
/// there in request order: arrays are moved to it and its answers are moved
/// back, with no copy.
pub(super) enum Split {
    Whole,
    /// Per shard, the request indices of its keys.
    Parts(Vec<Vec<u32>>),
}

impl Split {
    pub(super) fn new(keys: &[u64], shards: usize) -> Split {
        if shards == 1 {
            Split::Whole
        } else {
            Split::Parts(split(keys, shards))
        }
    }

    /// Each shard's rows of `v` (`width` values per key), in shard order.
    pub(super) fn take<T: Copy>(&self, v: Vec<T>, width: usize) -> Vec<Vec<T>> {
        match self {
            Split::Whole => vec![v],
            Split::Parts(parts) => parts.iter().map(|p| gather(&v, p, width)).collect(),
        }
    }

    /// An answer array of `n` keys (`width` values each) for [`Split::place`]
    /// to fill: empty when whole, as the one shard's array replaces it.
    pub(super) fn out<T: Clone>(&self, n: usize, width: usize, fill: T) -> Vec<T> {
        match self {
            Split::Whole => Vec::new(),
            Split::Parts(_) => vec![fill; n * width],
        }
    }

    /// Puts shard `j`'s answer rows in request order.
    pub(super) fn place<T: Copy>(&self, dst: &mut Vec<T>, j: usize, src: Vec<T>, width: usize) {
        match self {
            Split::Whole => *dst = src,
            Split::Parts(parts) => scatter(dst, &parts[j], &src, width),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shard_moves_arrays_both_ways_and_several_restore_order() {
        let keys: Vec<u64> = (0..1000).collect();
        let whole = Split::new(&keys, 1);
        let request = keys.clone();
        let at = request.as_ptr();
        let taken = whole.take(request, 1);
        assert_eq!(taken[0].as_ptr(), at, "the request's array is moved to the shard, not copied");
        assert_eq!(taken, vec![keys.clone()]);
        let src = taken.into_iter().next().unwrap();
        let src_at = src.as_ptr();
        let mut out = whole.out(1000, 1, 0u64);
        whole.place(&mut out, 0, src, 1);
        assert_eq!(out.as_ptr(), src_at, "the shard's answer is moved, not copied");
        assert_eq!(out, keys);
        let parts = Split::new(&keys, 3);
        let mut back = parts.out(1000, 2, 0u64);
        let rows: Vec<u64> = keys.iter().flat_map(|&k| [k, k + 1]).collect();
        for (j, sub) in parts.take(rows.clone(), 2).into_iter().enumerate() {
            assert!(sub.chunks(2).all(|r| shard_of(r[0], 3) == j as u64));
            parts.place(&mut back, j, sub, 2);
        }
        assert_eq!(back, rows);
    }

    #[test]
    fn split_gather_scatter_restore_order() {
        let keys: Vec<u64> = (0..1000).collect();
        let parts = split(&keys, 3);
        assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), 1000);
        let mut back = vec![0u64; 1000];
        for p in &parts {
            let sub = gather(&keys, p, 1);
            assert!(sub.iter().all(|&k| shard_of(k, 3) == shard_of(sub[0], 3)));
            scatter(&mut back, p, &sub, 1);
        }
        assert_eq!(back, keys);
    }
}
