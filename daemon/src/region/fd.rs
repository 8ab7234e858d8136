//! [`FdReader`]: a connection's read half read with `recvmsg`, so that
//! file descriptors sent with `SCM_RIGHTS` are queued on its [`Conn`].

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, Interest, ReadBuf};
use tokio::net::unix::OwnedReadHalf;

use super::Conn;

/// The read half of a connection, read with `recvmsg` so that fds sent
/// with `SCM_RIGHTS` are queued on [`Conn`]; counts the bytes read.
pub struct FdReader {
    half: OwnedReadHalf,
    conn: Arc<Conn>,
    offset: u64,
}

impl FdReader {
    /// Reads `half`, queueing fds on `conn`.
    pub fn new(half: OwnedReadHalf, conn: Arc<Conn>) -> FdReader {
        FdReader { half, conn, offset: 0 }
    }

    /// Bytes read from the socket so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl AsyncRead for FdReader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            ready!(this.half.as_ref().poll_read_ready(cx))?;
            // At most 256 KiB a call: the part of a large body made
            // initialised here is about to be overwritten, and stays in cache.
            let want = buf.remaining().min(256 << 10);
            let dst = buf.initialize_unfilled_to(want);
            let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut anc = RecvAncillaryBuffer::new(&mut space);
            let stream = this.half.as_ref();
            let r = stream.try_io(Interest::READABLE, || {
                let mut iov = [io::IoSliceMut::new(dst)];
                rustix::net::recvmsg(stream, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC).map_err(io::Error::from)
            });
            match r {
                Ok(m) => {
                    let n = m.bytes;
                    let end = this.offset + n as u64;
                    for msg in anc.drain() {
                        if let RecvAncillaryMessage::ScmRights(fds) = msg {
                            for fd in fds {
                                this.conn.push_fd(fd, end);
                            }
                        }
                    }
                    this.offset = end;
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}
