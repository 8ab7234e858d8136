//! NCCL: loading it, its environment, communicators and the grouped
//! all-to-all exchanges.

use super::*;

/// The NCCL version (e.g. 22803 for 2.28.3), or a clear error when the
/// library cannot be loaded. Never panics.
pub fn nccl_version() -> Result<i32> {
    // SAFETY: only tries to load the library; no NCCL call is made.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        let so2 = ["/usr/lib/x86_64-linux-gnu/libnccl.so.2", "/usr/lib64/libnccl.so.2", "/usr/local/lib/libnccl.so.2"]
            .iter()
            .find(|p| std::path::Path::new(p).exists());
        let hint = match so2 {
            Some(p) => format!(
                "; {p} exists but only libnccl.so is looked for: link libnccl.so to it in a directory on LD_LIBRARY_PATH"
            ),
            None => String::new(),
        };
        return Err(Error::Unavailable(format!("NCCL (libnccl.so) cannot be loaded{hint}")));
    }
    cudarc::nccl::result::get_nccl_version().map_err(|e| Error::Device(format!("ncclGetVersion: {e:?}")))
}

pub(super) fn nccl_err(what: &str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> Error + '_ {
    move |e| Error::Device(format!("NCCL {what}: {e:?}"))
}

/// NCCL settings a process should have in its environment before its
/// first group, each unless already set. The library sets no variable (it
/// cannot do so safely once threads run): a binary sets these in `main`
/// before it starts any thread.
/// - `NCCL_P2P_NVL_CHUNKSIZE=2097152`: 2 MiB chunks over NVLink, 9 % faster
///   all-to-all of a 1 Mi-key batch than NCCL's 512 KiB on the H200 pair.
/// - `NCCL_NVLS_ENABLE=0`: NVLink multicast, not needed here, can take the
///   GPUs of a shared host out of service.
pub const NCCL_ENV_DEFAULTS: [(&str, &str); 2] = [("NCCL_P2P_NVL_CHUNKSIZE", "2097152"), ("NCCL_NVLS_ENABLE", "0")];

/// NCCL communicators over `nodes` (one rank each, on the node's stream).
pub(super) fn communicators(nodes: &[Node]) -> Result<Vec<Comm>> {
    nccl_version()?;
    Comm::from_devices(nodes.iter().map(|n| n.stream.clone()).collect()).map_err(nccl_err("creating communicators"))
}

/// All-to-alls of one plan over `comms` (rank r on `nodes[r]`), in one
/// NCCL group: `(w, from, to)` each, `w` elements per key from each node's
/// `from` buffer into its `to`.
pub(super) fn exchange_many(
    comms: &[Comm],
    nodes: &mut [&mut Node],
    plan: &Plan,
    arrays: &[(usize, Buf, Buf)],
) -> Result<()> {
    let nr = nodes.len();
    for &(w, _, to) in arrays {
        ensure_target(nodes, plan, w, to)?;
    }
    group_start().map_err(nccl_err("group start"))?;
    let mut result = Ok(());
    for &(w, from, to) in arrays {
        for r in 0..nr {
            let b = &mut nodes[r].b;
            for p in 0..nr {
                let res = send_recv_buf(&comms[r], p, b, plan, r, w, from, to);
                if result.is_ok() {
                    result = res;
                }
            }
        }
    }
    group_end().map_err(nccl_err("group end"))?;
    result
}

/// Grows each node's `to` buffer to the plan's `recv_size * w`.
pub(super) fn ensure_target(nodes: &mut [&mut Node], plan: &Plan, w: usize, to: Buf) -> Result<()> {
    for (r, node) in nodes.iter_mut().enumerate() {
        let need = plan.recv_size[r] as usize * w;
        let s = node.stream.clone();
        let b = &mut node.b;
        match to {
            Buf::RecvKeys => ensure(&s, &mut b.recv_keys, need)?,
            Buf::RecvValues => ensure(&s, &mut b.recv_values, need)?,
            Buf::RecvScores => ensure(&s, &mut b.recv_scores, need)?,
            Buf::RecvFound => ensure(&s, &mut b.recv_found, need)?,
            Buf::SendValues => ensure(&s, &mut b.send_values, need)?,
            Buf::SendFound => ensure(&s, &mut b.send_found, need)?,
            Buf::SendKeys => ensure(&s, &mut b.send_keys, need)?,
            Buf::SendScores => ensure(&s, &mut b.send_scores, need)?,
        }
    }
    Ok(())
}

/// Queues rank r's part of one array's all-to-all with peer `p`.
#[allow(clippy::too_many_arguments)]
pub(super) fn send_recv_buf(
    comm: &Comm,
    p: usize,
    b: &mut Bufs,
    plan: &Plan,
    r: usize,
    w: usize,
    from: Buf,
    to: Buf,
) -> Result<()> {
    let (so, sn) = (plan.send_at[r][p] as usize * w, plan.lens[r][p] as usize * w);
    let (ro, rn) = (plan.recv_at[r][p] as usize * w, plan.lens[p][r] as usize * w);
    match (from, to) {
        (Buf::SendKeys, Buf::RecvKeys) => send_recv(comm, p, &b.send_keys, so, sn, &mut b.recv_keys, ro, rn),
        (Buf::SendValues, Buf::RecvValues) => send_recv(comm, p, &b.send_values, so, sn, &mut b.recv_values, ro, rn),
        (Buf::SendScores, Buf::RecvScores) => send_recv(comm, p, &b.send_scores, so, sn, &mut b.recv_scores, ro, rn),
        (Buf::RecvValues, Buf::SendValues) => send_recv(comm, p, &b.recv_values, so, sn, &mut b.send_values, ro, rn),
        (Buf::RecvFound, Buf::SendFound) => send_recv(comm, p, &b.recv_found, so, sn, &mut b.send_found, ro, rn),
        _ => unreachable!("no such exchange"),
    }
}

/// Queues (inside a group) rank `comm`'s send of `sn` elements of `from`
/// at `so` to `peer` and its receive of `rn` elements into `to` at `ro`.
#[allow(clippy::too_many_arguments)]
pub(super) fn send_recv<T: NcclType + DeviceRepr>(
    comm: &Comm,
    peer: usize,
    from: &Option<CudaSlice<T>>,
    so: usize,
    sn: usize,
    to: &mut Option<CudaSlice<T>>,
    ro: usize,
    rn: usize,
) -> Result<()> {
    if sn > 0 {
        let f = from.as_ref().expect("sized");
        comm.send(&f.slice(so..so + sn), peer as i32).map_err(nccl_err("send"))?;
    }
    if rn > 0 {
        let t = to.as_mut().expect("sized");
        comm.recv(&mut t.slice_mut(ro..ro + rn), peer as i32).map_err(nccl_err("recv"))?;
    }
    Ok(())
}
