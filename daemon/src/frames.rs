//! Frames given back once sent, whose memory the next find and echo
//! answers reuse; on the CUDA backend, page-locked frames the GPU writes
//! find answers into.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use hkv_proto::{FindFrame, FrameBuf, FrameMemory, Response};
use hkv_shard::Rows;
use parking_lot::Mutex;
use zerocopy::FromBytes;

use crate::shard_ops::Destination;

/// Frames given back once sent, whose memory find and echo answers reuse
/// instead of a fresh allocation each time (a find of 64 Ki keys of dim 32
/// answers 8.4 MB, of 1 Mi keys 135 MB). Keeps at most [`Frames::KEEP`]
/// buffers of [`Frames::MIN`] to [`Frames::MAX`] bytes, `total` bytes in
/// all (`limits.frame_cache_bytes`): smaller answers are cheap to zero, and
/// no more than that is held idle after a burst of large finds. The
/// default holds the answers in flight of 4 clients pipelining two finds
/// of 256 Ki keys of dim 32 each (CPU backend), or of 1 Mi keys (CUDA).
///
/// On the CUDA backend ([`Frames::pinned`]) find answers get page-locked
/// frames, into which the GPU copies the rows directly, as long as those
/// alive stay within the total; beyond it, ordinary memory.
pub struct Frames {
    pool: Mutex<Vec<Kept>>,
    total: usize,
    /// The device whose context allocates pinned frames, and the pinned
    /// frames alive.
    pinned: Option<(usize, Arc<Live>)>,
}

/// Pinned frames alive: bytes and frames.
#[derive(Default)]
struct Live {
    bytes: AtomicUsize,
    frames: AtomicUsize,
}

/// A kept frame, with its type.
enum Kept {
    /// Ordinary memory.
    Plain(FrameBuf),
    /// Page-locked memory.
    Pinned(PinnedFrame),
}

impl Kept {
    fn capacity(&self) -> usize {
        match self {
            Kept::Plain(b) => b.capacity(),
            Kept::Pinned(p) => p.mem.capacity(),
        }
    }
}

/// A find answer's frame, its memory typed: ordinary, or page-locked so
/// that the GPU writes the rows into it ([`Rows::Pinned`]).
#[derive(Debug)]
pub enum AnswerFrame {
    /// Ordinary memory.
    Plain(FindFrame),
    /// A page-locked frame.
    Pinned(FindFrame<PinnedFrame>),
}

impl AnswerFrame {
    /// The found bytes and the rows as the table writes them: None unless
    /// the values are aligned for f32 (the router only builds frames whose
    /// values start at a multiple of 4 bytes, in an allocation aligned at
    /// least that much) and the host is little-endian (the wire's order),
    /// so that the bytes sent are the floats as stored.
    pub fn rows(&mut self) -> Option<(&mut [u8], Rows<'_>)> {
        if !cfg!(target_endian = "little") {
            return None;
        }
        match self {
            AnswerFrame::Plain(f) => {
                let (found, bytes) = f.parts_mut();
                <[f32]>::mut_from_bytes(bytes).ok().map(|v| (found, Rows::Host(v)))
            }
            AnswerFrame::Pinned(f) => {
                let (found, at) = (f.found_range(), FindFrame::values_at(f.len()));
                let (head, rows) = f.memory_mut().mem.split_rows(at)?;
                Some((&mut head[found], Rows::Pinned(rows)))
            }
        }
    }

    /// The frame as a find's destination, when the table can write its
    /// rows there ([`AnswerFrame::rows`]).
    pub fn framed(mut self) -> Option<Framed> {
        self.rows().is_some().then_some(Framed(self))
    }

    /// The response to send (see [`FindFrame::into_response`]).
    pub fn into_response(self) -> Response {
        match self {
            AnswerFrame::Plain(f) => f.into_response(),
            AnswerFrame::Pinned(f) => f.into_response(),
        }
    }
}

/// A response frame whose rows a table writes ([`AnswerFrame::framed`]).
pub struct Framed(AnswerFrame);

impl Framed {
    /// The response to send.
    pub fn into_response(self) -> Response {
        self.0.into_response()
    }
}

impl Destination for Framed {
    fn answer(&mut self) -> (&mut [u8], Rows<'_>) {
        // Whether a frame takes rows depends on its alignment alone, which
        // `framed` checked and nothing changes.
        self.0.rows().expect("a framed frame takes rows")
    }
}

/// A page-locked frame that counts itself out of `Live` when dropped.
pub struct PinnedFrame {
    mem: hkv_shard::cuda::HostFrame,
    live: Arc<Live>,
}

impl FrameMemory for PinnedFrame {
    fn bytes(&self) -> &[u8] {
        self.mem.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.mem.bytes_mut()
    }
    fn capacity(&self) -> usize {
        self.mem.capacity()
    }
    fn set_len(&mut self, len: usize) {
        self.mem.set_len(len)
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

impl std::fmt::Debug for PinnedFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedFrame({} bytes)", self.mem.bytes().len())
    }
}

/// Sent as other memory.
impl From<PinnedFrame> for FrameBuf {
    fn from(p: PinnedFrame) -> FrameBuf {
        FrameBuf::Other(Box::new(p))
    }
}

impl Drop for PinnedFrame {
    fn drop(&mut self) {
        self.live.bytes.fetch_sub(self.mem.capacity(), Relaxed);
        self.live.frames.fetch_sub(1, Relaxed);
    }
}

impl Default for Frames {
    fn default() -> Frames {
        Frames::new(Frames::DEFAULT_TOTAL)
    }
}

impl Frames {
    /// Buffers kept at most.
    pub const KEEP: usize = 16;
    /// Smallest buffer kept (bytes).
    pub const MIN: usize = 1 << 20;
    /// Largest buffer kept (bytes).
    pub const MAX: usize = 256 << 20;
    /// Bytes kept in all by default (CPU backend).
    pub const DEFAULT_TOTAL: u64 = 512 << 20;
    /// Bytes kept in all by default on the CUDA backend: the answers in
    /// flight of 4 clients pipelining two finds of 1 Mi keys of dim 32.
    pub const DEFAULT_TOTAL_CUDA: u64 = 2 << 30;

    /// A cache of at most `total` bytes.
    pub fn new(total: u64) -> Frames {
        Frames { pool: Mutex::new(vec![]), total: usize::try_from(total).unwrap_or(usize::MAX), pinned: None }
    }

    /// Find answers get page-locked frames allocated in device
    /// `ordinal`'s context (see [`Frames`]).
    pub fn pinned(mut self, ordinal: usize) -> Frames {
        self.pinned = Some((ordinal, Arc::new(Live::default())));
        self
    }

    /// The device whose context page-locks answer memory (CUDA backend).
    pub fn pinned_ordinal(&self) -> Option<usize> {
        self.pinned.as_ref().map(|p| p.0)
    }

    /// Gives a sent frame back. A page-locked frame gets its type back
    /// (other memory of a type not the daemon's is dropped).
    pub fn put(&self, frame: FrameBuf) {
        if (Self::MIN..=Self::MAX).contains(&frame.capacity()) {
            let frame = match frame {
                FrameBuf::Vec(v) => Kept::Plain(FrameBuf::Vec(v)),
                FrameBuf::Other(m) => match m.into_any().downcast::<PinnedFrame>() {
                    Ok(p) => Kept::Pinned(*p),
                    Err(_) => return,
                },
            };
            let mut p = self.pool.lock();
            let held: usize = p.iter().map(Kept::capacity).sum();
            if p.len() < Self::KEEP && held.saturating_add(frame.capacity()) <= self.total {
                p.push(frame);
            }
        }
    }

    /// The frame of a find of `n` keys of `dim` floats: a kept buffer where
    /// one is large enough (the smallest such; its found bytes and values
    /// are stale, and the shards write every one of them), else zeroed.
    pub(crate) fn find_frame(&self, n: usize, dim: usize) -> AnswerFrame {
        let len = FindFrame::values_at(n) + n * dim * 4;
        match self.take(len).or_else(|| self.new_pinned(len).map(Kept::Pinned)) {
            Some(Kept::Plain(buf)) => AnswerFrame::Plain(FindFrame::reuse(buf, n, dim)),
            Some(Kept::Pinned(p)) => AnswerFrame::Pinned(FindFrame::reuse(p, n, dim)),
            None => AnswerFrame::Plain(FindFrame::new(n, dim)),
        }
    }

    /// A new page-locked frame of `len` bytes where pinned frames are on
    /// and those alive stay within the total with it; None otherwise, or
    /// when the driver refuses (ordinary memory then does).
    fn new_pinned(&self, len: usize) -> Option<PinnedFrame> {
        let (ordinal, live) = self.pinned.as_ref()?;
        if !(Self::MIN..=Self::MAX).contains(&len) {
            return None;
        }
        // No more alive than the cache keeps, in bytes and in frames, so
        // that pinned frames are allocated once and then reused.
        let bytes = live.bytes.fetch_add(len, Relaxed) + len;
        let frames = live.frames.fetch_add(1, Relaxed) + 1;
        let undo = || {
            live.bytes.fetch_sub(len, Relaxed);
            live.frames.fetch_sub(1, Relaxed);
        };
        if bytes > self.total || frames > Self::KEEP {
            undo();
            return None;
        }
        match hkv_shard::cuda::HostFrame::new(*ordinal, len) {
            // The frame's capacity is `len` (at least MIN), what its drop gives back.
            Ok(mem) => Some(PinnedFrame { mem, live: live.clone() }),
            Err(e) => {
                undo();
                tracing::warn!(error = %e, bytes = len, "no pinned frame; answering from ordinary memory");
                None
            }
        }
    }

    /// The answer to an echo of `len` bytes: zeros after the header space,
    /// in a kept buffer where one is large enough (zeroing memory already
    /// there costs less than faulting in a fresh allocation).
    pub fn echo(&self, len: usize) -> Response {
        let len = hkv_proto::HEADER_LEN + len;
        let buf = match self.take(len).map(|k| match k {
            Kept::Plain(b) => b,
            Kept::Pinned(p) => p.into(),
        }) {
            Some(mut buf) => {
                buf.set_len(len);
                buf.bytes_mut().fill(0);
                buf
            }
            None => FrameBuf::Vec(vec![0; len]),
        };
        Response::Framed(buf)
    }

    /// The smallest kept buffer of at least `len` bytes, if `len` is worth
    /// one ([`Frames::MIN`]).
    fn take(&self, len: usize) -> Option<Kept> {
        if len < Self::MIN {
            return None;
        }
        let mut p = self.pool.lock();
        let fit = p.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
        fit.map(|(i, _)| i).map(|i| p.swap_remove(i))
    }

    /// Buffers kept now.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.pool.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_reused_without_zeroing_and_bounded() {
        let f = Frames::default();
        f.put(FrameBuf::Vec(vec![0xAB; 2 << 20]));
        f.put(FrameBuf::Vec(vec![0xCD; 1000])); // too small to keep
        f.put(FrameBuf::Vec(vec![0xEF; 257 << 20])); // too large to keep
        assert_eq!(f.kept(), 1);
        // 10 000 keys of dim 32: 1.29 MB, reuses the 2 MiB buffer as it is.
        let AnswerFrame::Plain(mut frame) = f.find_frame(10_000, 32) else { panic!("a Vec") };
        assert_eq!(f.kept(), 0);
        let (found, values) = frame.parts_mut();
        assert_eq!(found.len(), 10_000);
        assert_eq!(values.len(), 10_000 * 32 * 4);
        assert!(found.iter().chain(values.iter()).all(|&b| b == 0xAB), "stale bytes: the shards overwrite them");
        // No buffer kept: a zeroed frame.
        let AnswerFrame::Plain(mut fresh) = f.find_frame(10_000, 32) else { panic!("a Vec") };
        assert!(fresh.parts_mut().1.iter().all(|&b| b == 0));
        for _ in 0..2 * Frames::KEEP {
            f.put(FrameBuf::Vec(vec![0; 1 << 20]));
        }
        assert_eq!(f.kept(), Frames::KEEP);
        // A request larger than every kept buffer gets a fresh one.
        let AnswerFrame::Plain(mut big) = f.find_frame(20_000, 32) else { panic!("a Vec") };
        assert!(big.parts_mut().1.iter().all(|&b| b == 0));
        assert_eq!(f.kept(), Frames::KEEP);
        // No more than the total is held: two 200 MiB buffers of 512 MiB, not three.
        let f = Frames::new(512 << 20);
        for _ in 0..3 {
            f.put(FrameBuf::Vec(vec![0; 200 << 20]));
        }
        assert_eq!(f.kept(), 2);
        // A cache of 0 bytes keeps nothing.
        let f = Frames::new(0);
        f.put(FrameBuf::Vec(vec![0; 2 << 20]));
        assert_eq!(f.kept(), 0);
        // Pinned frames asked for where no CUDA device answers: an
        // ordinary zeroed frame, and nothing counted as alive.
        if hkv_shard::cuda::probe().is_err() {
            let f = Frames::new(1 << 30).pinned(0);
            let AnswerFrame::Plain(mut frame) = f.find_frame(10_000, 32) else { panic!("a Vec") };
            assert!(frame.parts_mut().1.iter().all(|&b| b == 0));
            let live = &f.pinned.as_ref().expect("pinned").1;
            assert_eq!((live.bytes.load(Relaxed), live.frames.load(Relaxed)), (0, 0));
        }
    }

    /// A pinned frame is handed to the shard as pinned rows, and once sent
    /// and given back it is kept with its type: the next find reuses it as
    /// a pinned frame, with no new allocation.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn pinned_frames_come_back_typed() {
        let f = Frames::new(1 << 30).pinned(0);
        let mut a = f.find_frame(10_000, 32);
        assert!(matches!(a, AnswerFrame::Pinned(_)), "a pinned frame");
        assert!(matches!(a.rows(), Some((found, Rows::Pinned(r))) if found.len() == 10_000 && r.len() == 320_000));
        let Response::Framed(buf) = a.into_response() else { panic!("a frame") };
        f.put(buf);
        assert_eq!(f.kept(), 1);
        let b = f.find_frame(9_000, 32);
        assert!(matches!(b, AnswerFrame::Pinned(_)), "reused with its type");
        let live = &f.pinned.as_ref().expect("pinned").1;
        assert_eq!(live.frames.load(Relaxed), 1, "no second allocation");
    }
}
