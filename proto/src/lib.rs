//! # hkv-proto: the wire format shared by the daemon, clients and console
//!
//! Frames are a 20-byte little-endian header plus a body; bulk arrays are raw
//! little-endian elements, control messages are JSON. The byte-level spec is
//! `proto/PROTOCOL.md`. This crate knows nothing of devices or sockets: it
//! turns bytes into [`Request`]s and [`Response`]s and back.
//!
//! # Layout
//! - this file: [`Header`] and its codec ([`check_frame`]), op codes, flags.
//! - [`body`] has the array reader and writer.
//! - [`msg`] holds the typed [`Request`] and [`Response`] with encode / decode.
//! - [`error`] holds the [`ProtoError`] codes shared by both sides.
//! - [`region`] holds registered regions: their ops, the `REGION` flag,
//!   requests naming arrays in them and their small answers.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![deny(clippy::host_endian_bytes, clippy::big_endian_bytes)]

pub mod body;
pub mod error;
pub mod msg;
pub mod region;

pub use error::{ErrorCode, ProtoError};
pub use msg::{
    Control, Cursor, Evicted, FeatureHash, Features, Filter, FindFrame, FrameBuf, FrameMemory, HashSpec, Request,
    Response, Summary, TableInfo, TableSpec,
};

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
}

/// Operation codes.
#[allow(missing_docs)]
pub mod op {
    pub const PING: u8 = 0x01;
    pub const ECHO: u8 = 0x02;
    pub const FIND: u8 = 0x10;
    pub const CONTAINS: u8 = 0x11;
    pub const INSERT_OR_ASSIGN: u8 = 0x12;
    pub const INSERT_AND_EVICT: u8 = 0x13;
    pub const FIND_OR_INSERT: u8 = 0x14;
    pub const ASSIGN: u8 = 0x15;
    pub const ASSIGN_SCORES: u8 = 0x16;
    pub const ACCUM_OR_ASSIGN: u8 = 0x17;
    pub const ERASE: u8 = 0x18;
    pub const ERASE_IF: u8 = 0x19;
    pub const CLEAR: u8 = 0x1A;
    pub const EXPORT: u8 = 0x1B;
    pub const LOAD: u8 = 0x1C;
    pub const SET_EPOCH: u8 = 0x1D;
    pub const RESERVE: u8 = 0x1E;
    pub const CREATE_TABLE: u8 = 0x20;
    pub const DROP_TABLE: u8 = 0x21;
    pub const LIST_TABLES: u8 = 0x22;
    pub const STATS: u8 = 0x23;
    pub const METRICS: u8 = 0x24;
    pub const SHUTDOWN: u8 = 0x25;
    pub const CHECKPOINT: u8 = 0x26;
    pub const LIST_CHECKPOINTS: u8 = 0x27;
    pub const RESTORE: u8 = 0x28;
    pub const HASH: u8 = 0x30;
    pub const FIND_FEATURES: u8 = 0x31;
    pub const FIND_OR_INSERT_FEATURES: u8 = 0x32;
    pub const ERROR: u8 = 0xFF;
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
    pub fn write_into(op: u8, flags: u16, id: u64, frame: &mut [u8]) {
        let body_len = (frame.len() - HEADER_LEN) as u32;
        frame[..HEADER_LEN].copy_from_slice(&Header { op, flags, id, body_len }.bytes());
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

/// Where clients and the daemon look for the socket when none is given:
/// `$HKVD_SOCKET` (clients only, see [`client_socket_path`]), else
/// `$XDG_RUNTIME_DIR/hkvd/hkvd.sock` when that directory exists, else
/// `./hkvd-run/hkvd.sock`.
pub fn default_socket_path() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if std::path::Path::new(&d).is_dir() => std::path::Path::new(&d).join("hkvd").join("hkvd.sock"),
        _ => std::path::PathBuf::from("hkvd-run").join("hkvd.sock"),
    }
}

/// The socket a client uses without `--socket`: `$HKVD_SOCKET`, else
/// [`default_socket_path`].
pub fn client_socket_path() -> std::path::PathBuf {
    std::env::var_os("HKVD_SOCKET").map(Into::into).unwrap_or_else(default_socket_path)
}

/// Encodes a whole frame: header plus `body`.
pub fn frame(op: u8, flags: u16, id: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    Header { op, flags, id, body_len: body.len() as u32 }.encode(&mut out);
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_checks() {
        let f = frame(op::FIND, flags::SCORES, 0x0102_0304_0506_0708, b"abc");
        assert_eq!(&f[..4], b"HKVD");
        assert_eq!(&f[8..16], &[8, 7, 6, 5, 4, 3, 2, 1], "little-endian id");
        assert_eq!(check_frame(&f[..10], 100).unwrap(), FrameCheck::NeedMore);
        assert_eq!(check_frame(&f[..22], 100).unwrap(), FrameCheck::NeedMore);
        let FrameCheck::Ready(h) = check_frame(&f, 100).unwrap() else { panic!() };
        assert_eq!((h.op, h.flags, h.id, h.body_len), (op::FIND, flags::SCORES, 0x0102_0304_0506_0708, 3));
        assert!(matches!(check_frame(&f, 2).unwrap(), FrameCheck::Oversized(_)));
        let mut bad = f.clone();
        bad[0] = b'X';
        assert_eq!(check_frame(&bad, 100).unwrap_err().code, ErrorCode::BadMagic);
        let mut bad = f;
        bad[4] = 9;
        assert_eq!(check_frame(&bad, 100).unwrap_err().code, ErrorCode::BadVersion);
    }
}
