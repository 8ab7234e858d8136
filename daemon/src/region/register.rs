//! `register_memfd`: the fd checked (a memfd, sealed against shrinking,
//! large enough), the caps, the mapping (page-locked on the CUDA backend).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use hkv_proto::{ErrorCode, ProtoError};
use hkv_region::Mapping;

use super::{err, Ctx, Region};
use crate::state::State;

/// Checks and maps the fd of a `register_memfd` request.
pub(super) fn register(state: &Arc<State>, ctx: &Ctx, len: u64) -> Result<(u32, u64), ProtoError> {
    use rustix::fs::SealFlags;
    let Some(fd) = ctx.fd.as_ref() else {
        return Err(ProtoError::bad_request(
            "register_memfd needs one file descriptor sent with the frame's bytes (SCM_RIGHTS, one sendmsg \
             for the whole frame); none came",
        ));
    };
    let seals = match rustix::fs::fcntl_get_seals(fd) {
        Ok(s) => s,
        Err(rustix::io::Errno::INVAL) => {
            return Err(ProtoError::bad_request(
                "register_memfd: the file descriptor is not a memfd (fcntl F_GET_SEALS refused it); create one \
                 with memfd_create(MFD_ALLOW_SEALING)",
            ))
        }
        Err(e) => return Err(ProtoError::bad_request(format!("register_memfd: fcntl F_GET_SEALS failed: {e}"))),
    };
    if !seals.contains(SealFlags::SHRINK) {
        return Err(ProtoError::bad_request(
            "register_memfd: the memfd is not sealed with F_SEAL_SHRINK: the daemon maps it, and a file that \
             shrinks under a mapping faults (SIGBUS) on the pages past its end; add the seal \
             (fcntl F_ADD_SEALS, F_SEAL_SHRINK) before sending it",
        ));
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| ProtoError::bad_request(format!("register_memfd: fstat failed: {e}")))?
        .st_size as u64;
    if len == 0 || len > size {
        return Err(ProtoError::bad_request(format!(
            "register_memfd: {len} bytes asked for, the memfd holds {size}: register 1 to {size} bytes"
        )));
    }
    if usize::try_from(len).is_err() {
        return Err(ProtoError::bad_request(format!("register_memfd: {len} bytes cannot be mapped here")));
    }
    let limits = &state.config.limits;
    let conn_cap = limits.max_region_bytes_per_connection;
    let total_cap = limits.max_region_bytes;
    let c = &ctx.conn.bytes;
    if c.fetch_update(Relaxed, Relaxed, |b| b.checked_add(len).filter(|&t| t <= conn_cap)).is_err() {
        return Err(err(
            ErrorCode::ResourceExhausted,
            format!(
                "register_memfd: this connection has {} bytes of regions mapped; {len} more would pass \
                 limits.max_region_bytes_per_connection = {conn_cap}: unregister regions (their bytes come back \
                 once their requests in flight are done), or register less",
                c.load(Relaxed)
            ),
        ));
    }
    let total = &state.stats.regions.bytes;
    if total.fetch_update(Relaxed, Relaxed, |b| b.checked_add(len).filter(|&t| t <= total_cap)).is_err() {
        c.fetch_sub(len, Relaxed);
        return Err(err(
            ErrorCode::ResourceExhausted,
            format!(
                "register_memfd: {} bytes of regions are mapped over all connections; {len} more would pass \
                 limits.max_region_bytes = {total_cap}: try again later, or register less",
                total.load(Relaxed)
            ),
        ));
    }
    let map = match Mapping::map(fd, len as usize) {
        Ok(m) => m,
        Err(e) => {
            c.fetch_sub(len, Relaxed);
            total.fetch_sub(len, Relaxed);
            return Err(ProtoError::bad_request(format!(
                "register_memfd: cannot map the memfd shared read-write ({e}); a memfd sealed with \
                 F_SEAL_WRITE or F_SEAL_FUTURE_WRITE cannot be registered"
            )));
        }
    };
    // On the CUDA backend the region is page-locked, so that the device
    // copies (or the lookup kernel writes) found rows straight into it;
    // where that fails (a memlock limit), it works unpinned.
    let pin = state.router.frames.pinned_ordinal().and_then(|o| match hkv_shard::pin::HostPin::new(o, map.clone()) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(error = %e, len, "a registered region stays unpinned");
            None
        }
    });
    // From here the Region gives the bytes back when its last holder drops it.
    state.stats.regions.regions.fetch_add(1, Relaxed);
    let region = Region { pin, map, len, conn_bytes: ctx.conn.bytes.clone(), state: state.clone() };
    let id = ctx.conn.next.fetch_add(1, Relaxed).wrapping_add(1);
    ctx.conn.regions.lock().insert(id, Arc::new(region));
    Ok((id, len))
}
