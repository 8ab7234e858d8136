//! Frame memory: [`FrameBuf`] (a vector or memory the daemon supplies,
//! [`FrameMemory`]) and [`FindFrame`], a find answer laid out before the
//! table runs.

use crate::error::{ErrorCode, ProtoError};
use crate::HEADER_LEN;

/// The counts to write (zero when they do not fit) and the error then.
fn split(c: Result<(u32, u32), ProtoError>) -> ((u32, u32), Option<ProtoError>) {
    match c {
        Ok(c) => (c, None),
        Err(e) => ((0, 0), Some(e)),
    }
}

/// Memory an answer frame can live in besides a `Vec<u8>`: pinned host
/// memory that a GPU writes rows into directly, for instance.
pub trait FrameMemory: Send + Sync {
    /// The frame's bytes.
    fn bytes(&self) -> &[u8];
    /// The frame's bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// The most bytes the frame can have.
    fn capacity(&self) -> usize;
    /// Makes the frame `len` bytes (at most [`FrameMemory::capacity`]); the
    /// bytes that come into it hold what the memory held (never anything
    /// uninitialised).
    fn set_len(&mut self, len: usize);
    /// The memory as `Any`, so that whoever supplied it can take its own
    /// type back when the frame is given back (the daemon keeps page-locked
    /// frames typed for reuse).
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// A frame's memory is a [`FrameMemory`] too, so that [`FindFrame`] can lay
/// an answer out in either.
impl FrameMemory for FrameBuf {
    fn bytes(&self) -> &[u8] {
        FrameBuf::bytes(self)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        FrameBuf::bytes_mut(self)
    }
    fn capacity(&self) -> usize {
        FrameBuf::capacity(self)
    }
    fn set_len(&mut self, len: usize) {
        FrameBuf::set_len(self, len)
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// The bytes of a frame: a vector, or other memory ([`FrameMemory`]).
pub enum FrameBuf {
    /// Heap memory.
    Vec(Vec<u8>),
    /// Other memory.
    Other(Box<dyn FrameMemory>),
}

impl FrameBuf {
    /// The frame's bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            FrameBuf::Vec(v) => v,
            FrameBuf::Other(m) => m.bytes(),
        }
    }

    /// The frame's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            FrameBuf::Vec(v) => v,
            FrameBuf::Other(m) => m.bytes_mut(),
        }
    }

    /// The most bytes the frame can have without new memory.
    pub fn capacity(&self) -> usize {
        match self {
            FrameBuf::Vec(v) => v.capacity(),
            FrameBuf::Other(m) => m.capacity(),
        }
    }

    /// Makes the frame `len` bytes: bytes already in it keep their values,
    /// new ones are zero, or for other memory hold what it held. Other
    /// memory cannot grow past its capacity: such a frame becomes a
    /// zeroed vector.
    pub fn set_len(&mut self, len: usize) {
        match self {
            FrameBuf::Vec(v) => v.resize(len, 0),
            FrameBuf::Other(m) if len <= m.capacity() => m.set_len(len),
            FrameBuf::Other(_) => *self = FrameBuf::Vec(vec![0; len]),
        }
    }
}

impl std::fmt::Debug for FrameBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if matches!(self, FrameBuf::Vec(_)) { "Vec" } else { "Other" };
        write!(f, "FrameBuf::{kind}({} bytes)", self.bytes().len())
    }
}

/// A copy is a vector of the same bytes.
impl Clone for FrameBuf {
    fn clone(&self) -> FrameBuf {
        FrameBuf::Vec(self.bytes().to_vec())
    }
}

/// Frames are equal when their bytes are.
impl PartialEq for FrameBuf {
    fn eq(&self, o: &FrameBuf) -> bool {
        self.bytes() == o.bytes()
    }
}

/// A find response laid out in one frame before the table answers, so
/// that the answers are written where they are sent from: header space, a
/// `u32` count and one found byte per key, a `u32` count and `dim` f32 per
/// key (no scores). From [`FindFrame::new`] every byte starts at zero; from
/// [`FindFrame::reuse`] the found bytes and values hold what the buffer
/// held, and whoever fills the frame writes every one of them. `B`: the
/// memory, a [`FrameBuf`] or a type of the daemon's that it keeps typed
/// ([`FindFrame::memory_mut`]) until it is sent.
#[derive(Debug)]
pub struct FindFrame<B = FrameBuf> {
    frame: B,
    n: usize,
    /// Set when the counts do not fit the protocol: the frame is refused
    /// by [`FindFrame::into_parts`].
    too_long: Option<ProtoError>,
}

/// The found and value counts of `n` keys of `dim` floats as the
/// protocol's `u32`s, or an `oversized` error naming them.
fn counts(n: usize, dim: usize) -> Result<(u32, u32), ProtoError> {
    let values = n.checked_mul(dim);
    match (u32::try_from(n), values.map(u32::try_from)) {
        (Ok(n), Some(Ok(v))) => Ok((n, v)),
        _ => Err(ProtoError::new(
            ErrorCode::Oversized,
            format!("a find answer of {n} keys of {dim} floats does not fit the protocol's 32-bit counts; send smaller batches"),
        )),
    }
}

impl FindFrame<FrameBuf> {
    /// The frame for `n` keys of `dim` floats.
    pub fn new(n: usize, dim: usize) -> FindFrame {
        let values = FindFrame::values_at(n);
        let mut frame = vec![0u8; values + n * dim * 4];
        let (count, too_long) = split(counts(n, dim));
        frame[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&count.0.to_le_bytes());
        frame[values - 4..values].copy_from_slice(&count.1.to_le_bytes());
        FindFrame { frame: FrameBuf::Vec(frame), n, too_long }
    }

    /// Where the values of `n` keys start in the frame.
    pub fn values_at(n: usize) -> usize {
        HEADER_LEN + 8 + n
    }
}

impl<B: FrameMemory> FindFrame<B> {
    /// The frame for `n` keys of `dim` floats in the memory of `buf`, an
    /// earlier frame, without zeroing it: the found bytes and values keep
    /// whatever `buf` held up to its length (the rest is zero), so the
    /// caller must write every one of them before the frame is sent.
    /// Memory other than a [`FrameBuf`] must hold the frame's length
    /// ([`FrameMemory::capacity`]).
    pub fn reuse(mut buf: B, n: usize, dim: usize) -> FindFrame<B> {
        let values = FindFrame::values_at(n);
        buf.set_len(values + n * dim * 4);
        // The header space is written when the frame is sent (`Response::into_frame`).
        let b = buf.bytes_mut();
        let (count, too_long) = split(counts(n, dim));
        b[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&count.0.to_le_bytes());
        b[values - 4..values].copy_from_slice(&count.1.to_le_bytes());
        FindFrame { frame: buf, n, too_long }
    }

    /// The keys answered.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether no key is.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Where the found bytes lie in the frame ([`FindFrame::values_at`]:
    /// where the values start).
    pub fn found_range(&self) -> std::ops::Range<usize> {
        HEADER_LEN + 4..HEADER_LEN + 4 + self.n
    }

    /// The frame's memory as its own type, for a writer that needs more
    /// than bytes (a GPU writing into page-locked memory): the found bytes
    /// lie at [`FindFrame::found_range`], the values from
    /// [`FindFrame::values_at`] on.
    pub fn memory_mut(&mut self) -> &mut B {
        &mut self.frame
    }

    /// The found bytes and the values' little-endian bytes.
    pub fn parts_mut(&mut self) -> (&mut [u8], &mut [u8]) {
        let (head, values) = self.frame.bytes_mut().split_at_mut(FindFrame::values_at(self.n));
        (&mut head[HEADER_LEN + 4..HEADER_LEN + 4 + self.n], values)
    }

    /// The frame to send, or the `oversized` error to send instead when
    /// the counts do not fit the protocol (see `FindFrame::into_response`).
    pub fn into_parts(self) -> Result<B, ProtoError> {
        match self.too_long {
            None => Ok(self.frame),
            Some(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::response::Response;

    /// The counts used to be `as u32` casts: n × dim past 2^32 − 1 went out
    /// modulo 2^32. They are checked, and such an answer is refused.
    #[test]
    fn counts_that_do_not_fit_are_refused() {
        assert_eq!(counts(3, 4).unwrap(), (3, 12));
        assert_eq!(counts(1 << 20, (1 << 12) - 1).unwrap(), (1 << 20, u32::MAX - (1 << 20) + 1));
        let e = counts(1 << 20, 1 << 12).unwrap_err();
        assert_eq!(e.code, ErrorCode::Oversized, "{e}");
        assert!(counts(u32::MAX as usize + 1, 1).is_err());
        let f = FindFrame { frame: FrameBuf::Vec(vec![0; HEADER_LEN + 8]), n: 0, too_long: counts(1 << 33, 1).err() };
        assert!(matches!(f.into_response(), Response::Error(e) if e.code == ErrorCode::Oversized));
    }
}
