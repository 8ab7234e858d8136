//! Requests too large for the daemon, refused before they are built.
//!
//! `bench --batches 100000000` built 3 GB of requests, and `fill --batch
//! 9000000` at dim 32 3.5 GB, before the daemon refused them as
//! `oversized`. The daemon does not report `limits.max_frame_bytes`; its
//! echo tells whether a size passes it (`reply_len` above the limit is
//! `oversized`, the test a request body and an answer get too), so a
//! request that large is asked about first with an echo of its size, which
//! costs no more than the request would.

use anyhow::{bail, Result};
use hkv_client::{proto, Client, ErrorCode, Request};

/// Frames up to this size are sent without asking: building one that is
/// then refused costs little.
const ASK_ABOVE: u64 = 64 << 20;

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
/// message (`a find of 1000 keys at dim 32`), `flag` the option to lower.
pub fn check(c: &mut Client, n: u64, frame: &dyn Fn(u64) -> u64, what: &str, flag: &str) -> Result<()> {
    let bytes = frame(n);
    if bytes <= ASK_ABOVE {
        return Ok(());
    }
    let most = |limit: u64| most_keys(frame, limit);
    if bytes > u64::from(u32::MAX) {
        bail!(
            "{what} takes {bytes} bytes in one frame, above the largest frame of the protocol (4 GiB, its 32-bit \
             length): give {flag} at most {} (at most {} under the daemon's default limits.max_frame_bytes, 1 GiB)",
            most(u64::from(u32::MAX)),
            most(DEFAULT_MAX_FRAME)
        );
    }
    match c.call(&Request::Echo { reply_len: bytes as u32, padding: 0 }) {
        Err(e) if e.code() == Some(ErrorCode::Oversized) => bail!(
            "{what} takes {bytes} bytes in one frame, above the daemon's limits.max_frame_bytes: give a smaller \
             {flag} (at most {} under the default limit, 1 GiB)",
            most(DEFAULT_MAX_FRAME)
        ),
        r => {
            r?;
            Ok(())
        }
    }
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
