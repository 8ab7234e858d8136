//! `register_memfd`: the fd checked (a memfd, sealed against shrinking,
//! large enough), the caps, the mapping (page-locked on the CUDA backend).
//! `register_cuda`: the GPU named, the caps, the IPC handle opened and its
//! allocation's size checked. `register_cuda_event`: the event opened.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use hkv_proto::region::CudaRegistration;
use hkv_proto::{ErrorCode, ProtoError};
use hkv_region::Mapping;
use hkv_shard::cuda::ipc::{self, IpcEvent, IpcMem};

use super::{err, vet, Ctx, Mem, Region};
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
    reserve(state, ctx, len, "register_memfd")?;
    let map = match Mapping::map(fd, len as usize) {
        Ok(m) => m,
        Err(e) => {
            unreserve(state, ctx, len);
            return Err(ProtoError::bad_request(format!(
                "register_memfd: cannot map the memfd shared read-write ({e}): {}",
                unmappable(seals, &e)
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
    Ok((add(state, ctx, Mem::Host { pin, map }, len), len))
}

/// Why a memfd with `seals` could not be mapped shared read-write (`e`),
/// and what to do: every failure was said to be a write seal, also that
/// of an fd reopened read-only (EACCES) and of a hugetlb memfd on a host
/// without huge pages (ENOMEM).
fn unmappable(seals: rustix::fs::SealFlags, e: &std::io::Error) -> &'static str {
    use rustix::fs::SealFlags;
    use rustix::io::Errno;
    if seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
        return "the memfd is sealed with F_SEAL_WRITE or F_SEAL_FUTURE_WRITE, and the daemon writes answers into \
                regions: register a memfd without those seals";
    }
    match e.raw_os_error().map(Errno::from_raw_os_error) {
        Some(Errno::ACCESS) => {
            "the file descriptor is not open for writing (a memfd reopened O_RDONLY?): send one opened read-write"
        }
        Some(Errno::NOMEM) => {
            "the daemon's host has no memory for the mapping; for a hugetlb memfd (MFD_HUGETLB), no free huge pages \
             (vm.nr_hugepages): free some, or register an ordinary memfd"
        }
        _ => "register a memfd created with memfd_create(MFD_ALLOW_SEALING), open read-write",
    }
}

/// Counts `len` bytes against both caps, or says which one they pass.
fn reserve(state: &State, ctx: &Ctx, len: u64, what: &str) -> Result<(), ProtoError> {
    let limits = &state.config.limits;
    let conn_cap = limits.max_region_bytes_per_connection;
    let total_cap = limits.max_region_bytes;
    let c = &ctx.conn.bytes;
    if c.fetch_update(Relaxed, Relaxed, |b| b.checked_add(len).filter(|&t| t <= conn_cap)).is_err() {
        return Err(err(
            ErrorCode::ResourceExhausted,
            format!(
                "{what}: this connection has {} bytes of regions registered; {len} more would pass \
                 limits.max_region_bytes_per_connection = {conn_cap}: unregister regions (their bytes come back \
                 once their requests in flight are done), or register less",
                c.load(Relaxed)
            ),
        ));
    }
    if !crate::memory::fits_counted(&state.memory, len, &state.stats.in_flight_bytes) {
        c.fetch_sub(len, Relaxed);
        return Err(err(
            ErrorCode::ResourceExhausted,
            format!(
                "{what}: {len} bytes more would not fit the daemon's address space beside the requests in \
                 flight{}: unregister regions, or register less",
                state.memory.describe()
            ),
        ));
    }
    let total = &state.stats.regions.bytes;
    if total.fetch_update(Relaxed, Relaxed, |b| b.checked_add(len).filter(|&t| t <= total_cap)).is_err() {
        c.fetch_sub(len, Relaxed);
        return Err(err(
            ErrorCode::ResourceExhausted,
            format!(
                "{what}: {} bytes of regions are registered over all connections; {len} more would pass \
                 limits.max_region_bytes = {total_cap}: try again later, or register less",
                total.load(Relaxed)
            ),
        ));
    }
    Ok(())
}

/// Gives back what [`reserve`] counted, for a registration that failed after it.
fn unreserve(state: &State, ctx: &Ctx, len: u64) {
    ctx.conn.bytes.fetch_sub(len, Relaxed);
    state.stats.regions.bytes.fetch_sub(len, Relaxed);
}

/// Registers reserved memory under a new id; from here the [`Region`]
/// gives its bytes back when its last holder drops it.
fn add(state: &Arc<State>, ctx: &Ctx, mem: Mem, len: u64) -> u32 {
    state.stats.regions.regions.fetch_add(1, Relaxed);
    let region = Region { mem, len, conn_bytes: ctx.conn.bytes.clone(), state: state.clone() };
    let id = ctx.conn.next_id();
    ctx.conn.regions.lock().insert(id, Arc::new(region));
    id
}

/// The GPU, among those this daemon serves, that a registration names.
fn served_gpu(state: &State, reg: &CudaRegistration, what: &str) -> Result<usize, ProtoError> {
    let mut served = state.router.ordinals.clone();
    served.sort_unstable();
    served.dedup();
    if served.is_empty() {
        return Err(ProtoError::bad_request(format!(
            "{what}: this daemon runs the CPU backend and serves no GPU; register host memory with register_memfd \
             (a memfd) instead"
        )));
    }
    ipc::ordinal_of_uuid(&reg.uuid, &served).ok_or_else(|| {
        let names: Vec<String> =
            served.iter().map(|&o| ipc::device_uuid(o).map_or(format!("{o}"), |u| ipc::uuid_string(&u))).collect();
        ProtoError::bad_request(format!(
            "{what}: the memory is on GPU {}, which this daemon does not serve (it serves {})",
            ipc::uuid_string(&reg.uuid),
            names.join(", ")
        ))
    })
}

/// Why a handle the checking process would not open is refused.
fn refused(why: String) -> String {
    format!("the IPC handle is refused before the daemon opens it: {why}")
}

/// Checks and opens the IPC handle of a `register_cuda` request: first in
/// the checking process ([`vet`]), then here.
pub(super) async fn register_cuda(
    state: &Arc<State>,
    ctx: &Ctx,
    reg: CudaRegistration,
) -> Result<(u32, u64), ProtoError> {
    const WHAT: &str = "register_cuda";
    let ordinal = served_gpu(state, &reg, WHAT)?;
    let len = reg.len;
    if len == 0 {
        return Err(ProtoError::bad_request("register_cuda: 0 bytes asked for: register 1 byte or more"));
    }
    reserve(state, ctx, len, WHAT)?;
    // The first open in a process can take over 100 ms, and the check
    // starts a process: off the executor.
    let opened = tokio::task::spawn_blocking(move || {
        vet::check(&vet::Handle::Mem { ordinal, handle: reg.handle, len }).map_err(refused)?;
        IpcMem::open(ordinal, &reg.handle, len).map_err(|e| e.to_string())
    })
    .await;
    let mem = match opened {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            unreserve(state, ctx, len);
            return Err(ProtoError::bad_request(format!("{WHAT}: {e}")));
        }
        Err(e) => {
            unreserve(state, ctx, len);
            return Err(err(ErrorCode::Internal, format!("{WHAT}: the opening task failed: {e}")));
        }
    };
    Ok((add(state, ctx, Mem::Device(Arc::new(mem)), len), len))
}

/// Checks and opens the IPC handle of a `register_cuda_event` request.
pub(super) async fn register_event(state: &Arc<State>, ctx: &Ctx, reg: CudaRegistration) -> Result<u32, ProtoError> {
    const WHAT: &str = "register_cuda_event";
    let ordinal = served_gpu(state, &reg, WHAT)?;
    let ev = tokio::task::spawn_blocking(move || {
        vet::check(&vet::Handle::Event { ordinal, handle: reg.handle }).map_err(refused)?;
        IpcEvent::open(ordinal, &reg.handle).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| err(ErrorCode::Internal, format!("{WHAT}: the opening task failed: {e}")))?
    .map_err(|e| ProtoError::bad_request(format!("{WHAT}: {e}")))?;
    let id = ctx.conn.next_id();
    ctx.conn.events.lock().insert(id, Arc::new(ev));
    Ok(id)
}
