//! Body building blocks: strings and raw little-endian arrays with counts.

use crate::error::{ErrorCode, ProtoError};

/// Appends body fields. A field whose length does not fit its count field
/// (a name over 65535 bytes, an array over 2^32 − 1 elements) is noted, not
/// silently cut: [`Writer::check`] then refuses the frame.
#[derive(Debug, Default)]
pub struct Writer {
    /// The bytes so far.
    pub buf: Vec<u8>,
    too_long: Option<String>,
}

impl Writer {
    /// A writer with room for `n` bytes.
    pub fn with_capacity(n: usize) -> Writer {
        Writer { buf: Vec::with_capacity(n), too_long: None }
    }
    /// A writer for a whole frame: room for the header first, filled in by
    /// [`Writer::finish_frame`], so the body is never copied behind a header.
    pub fn framed(body_capacity: usize) -> Writer {
        let mut buf = Vec::with_capacity(crate::HEADER_LEN + body_capacity);
        buf.resize(crate::HEADER_LEN, 0);
        Writer { buf, too_long: None }
    }

    /// [`Writer::framed`] whose memory is reserved fallibly: None where the
    /// process cannot allocate it (an answer that cannot be allocated is
    /// refused, never an abort).
    pub fn try_framed(body_capacity: usize) -> Option<Writer> {
        let mut buf = Vec::new();
        buf.try_reserve_exact(crate::HEADER_LEN.checked_add(body_capacity)?).ok()?;
        buf.resize(crate::HEADER_LEN, 0);
        Some(Writer { buf, too_long: None })
    }

    /// [`Writer::framed`] in `buf`, whose contents go and whose memory is
    /// reused (a sender that keeps its last frame's buffer).
    pub fn framed_in(mut buf: Vec<u8>, body_capacity: usize) -> Writer {
        buf.clear();
        buf.reserve(crate::HEADER_LEN + body_capacity);
        buf.resize(crate::HEADER_LEN, 0);
        Writer { buf, too_long: None }
    }

    /// Whether every field fit its count and a framed buffer's body fits
    /// the header's 32-bit length; the error names the field.
    pub fn check(&self) -> Result<(), ProtoError> {
        if let Some(what) = &self.too_long {
            return Err(ProtoError::bad_request(what.clone()));
        }
        crate::header::body_len(self.buf.len().saturating_sub(crate::HEADER_LEN)).map(|_| ())
    }

    /// Refuses the request (at [`Writer::check`]) for the reason `what`.
    pub(crate) fn note(&mut self, what: String) {
        self.too_long.get_or_insert(what);
    }

    /// Writes the header of a [`Writer::framed`] buffer and returns the
    /// frame, after [`Writer::check`]: a field that did not fit is refused,
    /// with the buffer (so that its memory is kept).
    #[allow(clippy::result_large_err)]
    pub fn finish_frame(mut self, op: impl Into<u8>, flags: u16, id: u64) -> Result<Vec<u8>, (ProtoError, Vec<u8>)> {
        if let Err(e) = self.check() {
            return Err((e, self.buf));
        }
        match crate::Header::write_into(op, flags, id, &mut self.buf) {
            Ok(()) => Ok(self.buf),
            Err(e) => Err((e, self.buf)),
        }
    }

    /// `u16` length + UTF-8 bytes. A string over 65535 bytes is noted for
    /// [`Writer::check`] (and written cut at a character boundary).
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        if end < s.len() {
            self.note(format!("a name of {} bytes does not fit the protocol's 65535", s.len()));
            while !s.is_char_boundary(end) {
                end -= 1;
            }
        }
        self.u16(u16::try_from(end).expect("cut to u16::MAX above"));
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
        self
    }
    /// One `u16`.
    pub fn u16(&mut self, x: u16) -> &mut Self {
        self.buf.extend_from_slice(&x.to_le_bytes());
        self
    }
    /// One `u32`.
    pub fn u32(&mut self, x: u32) -> &mut Self {
        self.buf.extend_from_slice(&x.to_le_bytes());
        self
    }
    /// One `u64`.
    pub fn u64(&mut self, x: u64) -> &mut Self {
        self.buf.extend_from_slice(&x.to_le_bytes());
        self
    }
    /// One `f32` (its bits, little-endian).
    pub fn f32(&mut self, x: f32) -> &mut Self {
        self.u32(x.to_bits())
    }
    /// `u32` count + raw `u64`s.
    pub fn u64s(&mut self, xs: &[u64]) -> &mut Self {
        self.le_array(xs, u64::to_le_bytes)
    }
    /// `u32` count + raw `f32`s.
    pub fn f32s(&mut self, xs: &[f32]) -> &mut Self {
        self.le_array(xs, f32::to_le_bytes)
    }
    /// `u32` count + raw `u32`s.
    pub fn u32s(&mut self, xs: &[u32]) -> &mut Self {
        self.le_array(xs, u32::to_le_bytes)
    }
    /// `u32` count + raw `i64`s.
    pub fn i64s(&mut self, xs: &[i64]) -> &mut Self {
        self.le_array(xs, i64::to_le_bytes)
    }
    /// `u32` count + the elements as `W` little-endian bytes each, written in
    /// one pass over a pre-sized buffer (the compiler turns it into a copy).
    fn le_array<T: Copy, const W: usize>(&mut self, xs: &[T], le: fn(T) -> [u8; W]) -> &mut Self {
        self.count(xs.len());
        let at = self.buf.len();
        self.buf.resize(at + xs.len() * W, 0);
        for (dst, &x) in self.buf[at..].chunks_exact_mut(W).zip(xs) {
            dst.copy_from_slice(&le(x));
        }
        self
    }
    /// `u32` count + raw bytes.
    pub fn u8s(&mut self, xs: &[u8]) -> &mut Self {
        self.count(xs.len());
        self.buf.extend_from_slice(xs);
        self
    }
    /// An array's `u32` element count; one that does not fit is noted.
    fn count(&mut self, n: usize) {
        let c = u32::try_from(n).unwrap_or_else(|_| {
            self.note(format!("an array of {n} elements does not fit the protocol's 32-bit count"));
            u32::MAX
        });
        self.u32(c);
    }

    /// Raw bytes, no count.
    pub fn raw(&mut self, xs: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(xs);
        self
    }
}

/// Reads body fields in order; every shortfall is a `truncated` error that
/// names the field.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Reads `buf` from the start.
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ProtoError> {
        if self.buf.len() < n {
            return Err(ProtoError::new(
                ErrorCode::Truncated,
                format!("body ends inside {what}: {n} bytes needed, {} left", self.buf.len()),
            ));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Fails unless everything was read.
    pub fn finish(&self) -> Result<(), ProtoError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::bad_request(format!("{} unexpected bytes after the body's last field", self.buf.len())))
        }
    }

    /// `n` raw bytes (a fixed-size field).
    pub fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], ProtoError> {
        self.take(n, what)
    }

    /// A `str` field.
    pub fn str(&mut self, what: &str) -> Result<&'a str, ProtoError> {
        let n = self.u16(what)? as usize;
        let b = self.take(n, what)?;
        std::str::from_utf8(b).map_err(|e| ProtoError::bad_request(format!("{what} is not UTF-8: {e}")))
    }
    /// A `u8`.
    pub fn u8(&mut self, what: &str) -> Result<u8, ProtoError> {
        Ok(self.take(1, what)?[0])
    }
    /// A `u16`.
    pub fn u16(&mut self, what: &str) -> Result<u16, ProtoError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    /// A `u32`.
    pub fn u32(&mut self, what: &str) -> Result<u32, ProtoError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A `u64`.
    pub fn u64(&mut self, what: &str) -> Result<u64, ProtoError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// A counted array of `W`-byte little-endian elements.
    fn le_array<T, const W: usize>(&mut self, what: &str, from: fn([u8; W]) -> T) -> Result<Vec<T>, ProtoError> {
        let b = self.array(W, what)?;
        Ok(b.chunks_exact(W).map(|c| from(c.try_into().expect("W bytes"))).collect())
    }

    fn array(&mut self, width: usize, what: &str) -> Result<&'a [u8], ProtoError> {
        let n = self.u32(what)? as usize;
        let bytes = n.checked_mul(width).ok_or_else(|| ProtoError::bad_request(format!("{what}: count overflows")))?;
        self.take(bytes, what)
    }
    /// One `f32` (its bits, little-endian).
    pub fn f32(&mut self, what: &str) -> Result<f32, ProtoError> {
        Ok(f32::from_bits(self.u32(what)?))
    }
    /// A `u64s` array.
    pub fn u64s(&mut self, what: &str) -> Result<Vec<u64>, ProtoError> {
        self.le_array(what, u64::from_le_bytes)
    }
    /// A `f32s` array.
    pub fn f32s(&mut self, what: &str) -> Result<Vec<f32>, ProtoError> {
        self.f32s_into(what, Vec::new())
    }
    /// A `f32s` array into `out`, whose memory is reused (what it held is
    /// replaced).
    pub fn f32s_into(&mut self, what: &str, mut out: Vec<f32>) -> Result<Vec<f32>, ProtoError> {
        let b = self.array(4, what)?;
        out.clear();
        out.extend(b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))));
        Ok(out)
    }
    /// A `u32s` array.
    pub fn u32s(&mut self, what: &str) -> Result<Vec<u32>, ProtoError> {
        self.le_array(what, u32::from_le_bytes)
    }
    /// An `i64s` array.
    pub fn i64s(&mut self, what: &str) -> Result<Vec<i64>, ProtoError> {
        self.le_array(what, i64::from_le_bytes)
    }
    /// A `u8s` array.
    pub fn u8s(&mut self, what: &str) -> Result<Vec<u8>, ProtoError> {
        self.u8s_into(what, Vec::new())
    }
    /// A `u8s` array into `out`, whose memory is reused (what it held is
    /// replaced).
    pub fn u8s_into(&mut self, what: &str, mut out: Vec<u8>) -> Result<Vec<u8>, ProtoError> {
        let b = self.array(1, what)?;
        out.clear();
        out.extend_from_slice(b);
        Ok(out)
    }
    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_round_trip_and_truncation_is_named() {
        let mut w = Writer::default();
        w.str("emb").u64s(&[1, u64::MAX]).f32s(&[0.5, -2.0]).u8s(&[1, 0]).u64(7);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.str("table").unwrap(), "emb");
        assert_eq!(r.u64s("keys").unwrap(), [1, u64::MAX]);
        assert_eq!(r.f32s("values").unwrap(), [0.5, -2.0]);
        assert_eq!(r.u8s("flags").unwrap(), [1, 0]);
        assert_eq!(r.u64("x").unwrap(), 7);
        r.finish().unwrap();
        let cut = &w.buf[..w.buf.len() - 30];
        let mut r = Reader::new(cut);
        r.str("table").unwrap();
        let e = r.u64s("keys").map(|_| ()).and_then(|_| r.f32s("values").map(|_| ())).unwrap_err();
        assert_eq!(e.code, ErrorCode::Truncated);
        assert!(e.message.contains("values") || e.message.contains("keys"), "{e}");
    }

    /// A name over 65535 bytes used to be cut silently, possibly inside a
    /// UTF-8 character; it is now refused by `check`, and what is written
    /// stays valid UTF-8.
    #[test]
    fn names_too_long_for_their_count_are_refused() {
        let mut w = Writer::default();
        w.str("ok");
        assert!(w.check().is_ok());
        let long = "é".repeat(40_000); // 80000 bytes, 2 per character
        w.str(&long);
        let e = w.check().unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.str("a").unwrap(), "ok");
        let cut = r.str("b").unwrap();
        assert_eq!(cut.len(), 65534, "cut at a character boundary");
    }

    /// An array's count used to be an `as u32` cast; one past 2^32 − 1 is
    /// noted and the frame refused (no 4-billion-element array needed to
    /// show it: the count is what is checked).
    #[test]
    fn counts_too_large_for_u32_are_refused() {
        let mut w = Writer::framed(0);
        w.count(u32::MAX as usize);
        assert!(w.check().is_ok());
        w.count(u32::MAX as usize + 1);
        let e = w.check().unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
        let (e, _) = w.finish_frame(crate::Op::Find, 0, 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
    }
}
