//! The 20-byte frame header, its codec, and the cheap "is a whole frame
//! buffered?" check.

use crate::error::{ErrorCode, ProtoError};

/// The first four bytes of every frame: `"HKVD"`.
pub const MAGIC: [u8; 4] = *b"HKVD";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 20;

/// Frame flags.
pub mod flags {
    /// Set on every frame the daemon sends.
    pub const RESPONSE: u16 = 0x0001;
    /// A scores array is present (requests) or wanted (find).
    pub const SCORES: u16 = 0x0002;
    /// Per-key outcomes are wanted / present.
    pub const OUTCOMES: u16 = 0x0004;
    /// The frame is an error.
    pub const ERROR: u16 = 0x0008;
    /// apply_gradients: sum the gradients of a key's occurrences, then
    /// step it once.
    pub const SUM: u16 = 0x0040;
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Operation code.
    pub op: u8,
    /// Flags (see [`flags`]).
    pub flags: u16,
    /// Request id, echoed by responses.
    pub id: u64,
    /// Body bytes after the header.
    pub body_len: u32,
}

impl Header {
    /// The 20 header bytes.
    pub fn bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.op;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        b
    }

    /// Appends the 20 header bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.bytes());
    }

    /// Writes the header of a frame laid out with [`HEADER_LEN`] bytes of
    /// header space first (`frame`: the whole frame, body after the space).
    /// A body of 4 GiB or more does not fit the header's length: refused,
    /// and nothing is written.
    pub fn write_into(op: impl Into<u8>, flags: u16, id: u64, frame: &mut [u8]) -> Result<(), ProtoError> {
        let body_len = body_len(frame.len().saturating_sub(HEADER_LEN))?;
        frame[..HEADER_LEN].copy_from_slice(&Header { op: op.into(), flags, id, body_len }.bytes());
        Ok(())
    }

    /// Parses 20 header bytes: magic, then version, are checked.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, ProtoError> {
        if b[0..4] != MAGIC {
            return Err(ProtoError::new(
                ErrorCode::BadMagic,
                format!("frame starts with {:02x?}, not \"HKVD\"; is this an hkvd client?", &b[0..4]),
            ));
        }
        if b[4] != VERSION {
            return Err(ProtoError::new(
                ErrorCode::BadVersion,
                format!("protocol version {} is not supported; this daemon speaks version {VERSION}", b[4]),
            ));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        Ok(Header {
            op: b[5],
            flags: u16_at(6),
            id: u64::from_le_bytes(id),
            body_len: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
        })
    }
}

/// What [`check_frame`] found at the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameCheck {
    /// Fewer bytes than a header, or than the header's body: read more.
    NeedMore,
    /// A whole frame: its header; it spans `HEADER_LEN + body_len` bytes.
    Ready(Header),
    /// A valid header whose body exceeds the limit: skip `body_len` bytes.
    Oversized(Header),
}

/// The cheap check before any parse: is a whole frame buffered? Validates
/// magic, version and the size limit from the header alone, so an oversized
/// frame is refused before anything is allocated for it.
pub fn check_frame(buf: &[u8], max_body: u32) -> Result<FrameCheck, ProtoError> {
    let Some(h) = buf.get(..HEADER_LEN) else { return Ok(FrameCheck::NeedMore) };
    let h = Header::decode(h.try_into().expect("HEADER_LEN bytes"))?;
    if h.body_len > max_body {
        return Ok(FrameCheck::Oversized(h));
    }
    if buf.len() < HEADER_LEN + h.body_len as usize {
        return Ok(FrameCheck::NeedMore);
    }
    Ok(FrameCheck::Ready(h))
}

/// The header's 32-bit length of a body of `len` bytes, or an `oversized`
/// error: the one place a body length becomes a `u32`.
pub fn body_len(len: usize) -> Result<u32, ProtoError> {
    u32::try_from(len).map_err(|_| {
        ProtoError::new(
            ErrorCode::Oversized,
            format!("a frame body of {len} bytes does not fit the header's 32-bit length; send smaller batches"),
        )
    })
}

/// Encodes a whole frame: header plus `body` (any op byte, known or not:
/// tests and tools build raw frames with it).
///
/// # Panics
/// When `body` is 4 GiB or more, which no frame can carry.
pub fn frame(op: impl Into<u8>, flags: u16, id: u64, body: &[u8]) -> Vec<u8> {
    let body_len = body_len(body.len()).unwrap_or_else(|e| panic!("{}", e.message));
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    Header { op: op.into(), flags, id, body_len }.encode(&mut out);
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Op;

    #[test]
    fn header_round_trip_and_checks() {
        let f = frame(Op::Find, flags::SCORES, 0x0102_0304_0506_0708, b"abc");
        assert_eq!(&f[..4], b"HKVD");
        assert_eq!(&f[8..16], &[8, 7, 6, 5, 4, 3, 2, 1], "little-endian id");
        assert_eq!(check_frame(&f[..10], 100).unwrap(), FrameCheck::NeedMore);
        assert_eq!(check_frame(&f[..22], 100).unwrap(), FrameCheck::NeedMore);
        let FrameCheck::Ready(h) = check_frame(&f, 100).unwrap() else { panic!() };
        assert_eq!((h.op, h.flags, h.id, h.body_len), (Op::Find as u8, flags::SCORES, 0x0102_0304_0506_0708, 3));
        assert!(matches!(check_frame(&f, 2).unwrap(), FrameCheck::Oversized(_)));
        let mut bad = f.clone();
        bad[0] = b'X';
        assert_eq!(check_frame(&bad, 100).unwrap_err().code, ErrorCode::BadMagic);
        let mut bad = f;
        bad[4] = 9;
        assert_eq!(check_frame(&bad, 100).unwrap_err().code, ErrorCode::BadVersion);
    }

    /// The header's length used to be a plain `as u32` cast: a body of 4 GiB
    /// or more got the length modulo 2^32 and the peer read garbage. Such a
    /// body is refused now, by name.
    #[test]
    fn a_body_too_long_for_the_header_is_refused() {
        assert_eq!(body_len(u32::MAX as usize).unwrap(), u32::MAX);
        let e = body_len(u32::MAX as usize + 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::Oversized, "{e}");
        let mut f = vec![0u8; HEADER_LEN + 3];
        Header::write_into(Op::Ping, 0, 5, &mut f).unwrap();
        let h = Header::decode(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((h.op, h.id, h.body_len), (Op::Ping as u8, 5, 3));
    }
}
