//! Requests too large for the daemon, refused before they are built.
//!
//! `bench --batches 100000000` built 3 GB of requests, and `fill --batch
//! 9000000` at dim 32 3.5 GB, before the daemon refused them as
//! `oversized`. The daemon does not report `limits.max_frame_bytes`; its
//! echo tells whether a size passes it (`reply_len` above the limit is
//! `oversized`, the test a request body and an answer get too), so the
//! largest request of a command is asked about first with an echo of its
//! size, which costs no more than the request would. A size refused is
//! followed by a search for the limit itself (echoes, bisected), so that
//! the refusal can name a count that passes: under a 4096-byte limit `fill
//! --count 1000` was refused by the daemon with "fill sends --batch 262144
//! keys a request", and bench filled its table in 4.4 MB requests whatever
//! `--batches` said.

use anyhow::{bail, Result};
use hkv_client::{proto, Client, ErrorCode, Request};

/// The limit is searched for up to this size: the echoes of a search cost
/// up to twice the limit in answers, and a larger limit is not one a
/// request of a command's usual size runs into.
const SEARCH_UP_TO: u64 = 64 << 20;

/// The smallest `limits.max_frame_bytes` a daemon takes (a header and a
/// small body).
const MIN_FRAME: u64 = 64;

/// The default `limits.max_frame_bytes` (PROTOCOL.md, "Limits"), for the
/// hint of a refusal.
const DEFAULT_MAX_FRAME: u64 = 1 << 30;

/// Bytes of the body of `make(n)`: the encodings of 1 and 2 keys, grown
/// linearly (a request's arrays each take a fixed size per key).
pub fn body_len(make: impl Fn(usize) -> Request, n: u64) -> u64 {
    let len = |k: usize| (make(k).encode(0).len() - proto::HEADER_LEN) as u64;
    let (one, two) = (len(1), len(2));
    one.saturating_add((two - one).saturating_mul(n.saturating_sub(1)))
}

/// Bytes of the body of an insert_or_assign of `n` rows of `dim` floats
/// into `table`.
pub fn insert_body_len(table: &str, dim: usize, n: u64) -> u64 {
    body_len(
        |k| Request::Write {
            op: proto::WriteOp::InsertOrAssign,
            table: table.into(),
            keys: vec![0; k],
            values: vec![0.0; k * dim],
            scores: None,
            outcomes: false,
        },
        n,
    )
}

/// Refuses a request of `n` keys whose largest frame (its body or its
/// answer), `frame(n)` bytes, the daemon would refuse as `oversized`:
/// above the protocol's 32-bit frame length, or, asked with an echo, above
/// the daemon's `limits.max_frame_bytes`. `what` names the request in the
/// message (`a find of 1000 keys at dim 32`), `flag` the option to lower;
/// the message gives the most keys that pass.
pub fn check(c: &mut Client, n: u64, frame: &dyn Fn(u64) -> u64, what: &str, flag: &str) -> Result<()> {
    let bytes = frame(n);
    let most = |limit: u64| most_keys(frame, limit);
    if bytes > u64::from(u32::MAX) {
        bail!(
            "{what} takes {bytes} bytes in one frame, above the largest frame of the protocol (4 GiB, its 32-bit \
             length): give {flag} at most {} (at most {} under the daemon's default limits.max_frame_bytes, 1 GiB)",
            most(u64::from(u32::MAX)),
            most(DEFAULT_MAX_FRAME)
        );
    }
    if passes(c, bytes)? {
        return Ok(());
    }
    match limit(c, bytes)? {
        Some(limit) if most(limit) == 0 => bail!(
            "{what} takes {bytes} bytes in one frame, and even one key is above the daemon's \
             limits.max_frame_bytes ({limit} bytes): raise the limit"
        ),
        Some(limit) => bail!(
            "{what} takes {bytes} bytes in one frame, above the daemon's limits.max_frame_bytes ({limit} bytes): \
             give {flag} at most {}",
            most(limit)
        ),
        None => bail!(
            "{what} takes {bytes} bytes in one frame, above the daemon's limits.max_frame_bytes: give a smaller \
             {flag} (at most {} under the default limit, 1 GiB)",
            most(DEFAULT_MAX_FRAME)
        ),
    }
}

/// The most keys, up to `want`, of a request whose largest frame is
/// `frame(n)` bytes that the daemon takes: for a command that splits its
/// work into requests of its own size (bench's filling of its table).
/// An error when not even one key passes.
pub fn fitting(c: &mut Client, want: u64, frame: &dyn Fn(u64) -> u64) -> Result<u64> {
    let bytes = frame(want);
    if bytes <= u64::from(u32::MAX) && passes(c, bytes)? {
        return Ok(want);
    }
    // A limit above the searched sizes passes SEARCH_UP_TO at least.
    let limit = limit(c, bytes.min(u64::from(u32::MAX)))?.unwrap_or(SEARCH_UP_TO);
    match most_keys(frame, limit).min(want) {
        0 => bail!("one key takes {} bytes in one frame, above the daemon's limits.max_frame_bytes ({limit} bytes): raise the limit", frame(1)),
        n => Ok(n),
    }
}

/// Whether the daemon takes a frame of `bytes` (asked with an echo).
fn passes(c: &mut Client, bytes: u64) -> Result<bool> {
    match c.call(&Request::Echo { reply_len: bytes as u32, padding: 0 }) {
        Ok(_) => Ok(true),
        Err(e) if e.code() == Some(ErrorCode::Oversized) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The daemon's `limits.max_frame_bytes`, known to be below `refused`:
/// the largest echo it takes, bisected; none when that is above
/// [`SEARCH_UP_TO`] (not searched: the echoes would cost as much).
fn limit(c: &mut Client, refused: u64) -> Result<Option<u64>> {
    let top = refused.saturating_sub(1).min(SEARCH_UP_TO);
    if top < refused - 1 && passes(c, top)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (MIN_FRAME, top);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if passes(c, mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(Some(lo))
}

/// The most keys whose frame fits `limit` bytes (`frame` grows with the keys).
fn most_keys(frame: &dyn Fn(u64) -> u64, limit: u64) -> u64 {
    let (mut lo, mut hi) = (0u64, limit);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if frame(mid) <= limit {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_len_is_the_encoded_body() {
        let make = |n: usize| Request::Write {
            op: proto::WriteOp::InsertOrAssign,
            table: "t".into(),
            keys: vec![7; n],
            values: vec![1.0; n * 3],
            scores: None,
            outcomes: false,
        };
        let n = 1000;
        assert_eq!(body_len(make, n as u64), (make(n).encode(0).len() - proto::HEADER_LEN) as u64);
    }

    #[test]
    fn most_keys_is_the_last_that_fits() {
        let frame = |n: u64| 16 + n * 129;
        let most = most_keys(&frame, 1 << 30);
        assert!(frame(most) <= 1 << 30 && frame(most + 1) > 1 << 30);
    }
}
