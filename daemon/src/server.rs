//! The Unix-socket server: the socket bound with its mode and group, the
//! accept loop (one task per [`crate::connection`]), draining on shutdown.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tracing::{info, warn};

use crate::connection::connection;
use crate::state::State;

/// Binds the socket: creates its directory (mode 0750, in group `gid` when
/// given) when missing, opens an existing one to group `gid`
/// ([`open_to_group`]), replaces a stale socket file, refuses when another
/// daemon answers there, and gives the socket mode 0660 and group `gid`, so
/// that the group's members can connect.
pub fn bind(path: &Path, gid: Option<u32>) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let chgrp = |p: &Path| -> anyhow::Result<()> {
        if let Some(g) = gid {
            std::os::unix::fs::chown(p, None, Some(g))
                .map_err(|e| anyhow::anyhow!("cannot give {} the admin group (gid {g}): {e}", p.display()))?;
        }
        Ok(())
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Every directory hkvd creates gets the mode and group, not only the
        // last: a member of the group must be able to pass through each.
        let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && !d.exists()).collect();
        for d in missing.into_iter().rev() {
            std::fs::create_dir(d).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", d.display()))?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o750))?;
            chgrp(d)?;
        }
        if let Some(g) = gid {
            open_to_group(dir, path, g)?;
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            anyhow::bail!(
                "{} exists and is not a socket; hkvd does not replace it: pick another --socket",
                path.display()
            );
        }
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another daemon is serving {}; stop it or pick another --socket", path.display());
        }
        std::fs::remove_file(path).map_err(|e| anyhow::anyhow!("cannot remove stale {}: {e}", path.display()))?;
    }
    let l = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot bind {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    chgrp(path)?;
    Ok(l)
}

/// Lets members of group `gid` pass through `dir`, the socket's directory,
/// when it already existed: a start without the group (or with another)
/// left it 0750 in the daemon's own group, and members were refused the
/// socket although the socket itself was theirs. A directory anyone may
/// pass through, or the group already may, is left as it is. One of the
/// daemon's user that holds nothing but the socket is hkvd's: it gets the
/// group and mode 0750, as if hkvd created it now. Any other (someone
/// else's, or one holding other files, such as a home directory) is not
/// hkvd's to open: the start is refused, naming it and what to do.
fn open_to_group(dir: &Path, socket: &Path, gid: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(dir).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o001 != 0 || (meta.gid() == gid && mode & 0o010 != 0) {
        return Ok(());
    }
    let only_the_socket = || -> std::io::Result<bool> {
        for entry in std::fs::read_dir(dir)? {
            if Some(entry?.file_name().as_os_str()) != socket.file_name() {
                return Ok(false);
            }
        }
        Ok(true)
    };
    if meta.uid() == rustix::process::geteuid().as_raw() && only_the_socket().unwrap_or(false) {
        let what = |e: std::io::Error| {
            anyhow::anyhow!("cannot give the socket's directory {} group gid {gid}: {e}", dir.display())
        };
        std::os::unix::fs::chown(dir, None, Some(gid)).map_err(what)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode((mode & 0o7700) | 0o050)).map_err(what)?;
        info!(dir = %dir.display(), gid, "the socket's directory now lets the socket's group in");
        return Ok(());
    }
    anyhow::bail!(
        "the socket's directory {} (mode {:o}, uid {}, gid {}) does not let group gid {gid} (--client-group, \
         else --admin-group) pass, so its members could not use the socket, and hkvd does not change it: it \
         is not a directory of hkvd's alone. Run `chgrp {gid} {dir} && chmod g+x {dir}` (or o+x), or pick a \
         --socket in a directory of its own, which hkvd creates or fixes",
        dir.display(),
        mode,
        meta.uid(),
        meta.gid(),
        dir = dir.display()
    )
}

/// Removes the socket file on drop (the daemon's own, not an inherited one).
pub struct SocketFile(pub Option<PathBuf>);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// File descriptors kept for the daemon itself, beyond its connections:
/// the checkpoint writer's chunk files, the catalog, the listener, the
/// metrics listener, the kernel cache, the CUDA driver's device files.
pub const FD_RESERVE: u64 = 256;

/// The most file descriptors one connection holds: its socket and the fds
/// queued on it ([`crate::region::MAX_QUEUED_FDS`]).
pub fn fds_per_connection() -> u64 {
    1 + crate::region::MAX_QUEUED_FDS as u64
}

/// Raises the soft limit of open files to the hard one (a daemon of many
/// connections needs more than the usual 1024), and returns the soft
/// limit in force.
pub fn raise_open_files() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let r = getrlimit(Resource::Nofile);
    if r.current != r.maximum {
        let raised = rustix::process::Rlimit { current: r.maximum, maximum: r.maximum };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            warn!(error = %e, "cannot raise the soft limit of open files to the hard one");
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// The connections that fit `open_files`: what is left after the
/// daemon's own reserve, each connection taking its socket and queued fds.
pub fn connections_for(open_files: u64) -> usize {
    let fit = open_files.saturating_sub(FD_RESERVE) / fds_per_connection();
    usize::try_from(fit).unwrap_or(usize::MAX).max(1)
}

/// A descriptor held in reserve, given up to accept one connection when
/// the process is out of descriptors, so that the peer is told `busy`
/// instead of waiting in the backlog.
struct Spare(Option<std::fs::File>);

impl Spare {
    fn new() -> Spare {
        Spare(std::fs::File::open("/dev/null").ok())
    }

    /// Accepts one connection on the spare descriptor, answers it `busy`
    /// and closes it.
    async fn refuse_one(&mut self, listener: &UnixListener) {
        self.0 = None;
        if let Ok(Ok((stream, _))) = tokio::time::timeout(Duration::from_millis(10), listener.accept()).await {
            let e = hkv_proto::ProtoError::new(
                hkv_proto::ErrorCode::Busy,
                "the daemon is out of file descriptors (its open-file limit); try again later",
            );
            // Inline (the spare is the only descriptor to spare): the
            // accept loop waits at most this long.
            crate::connection::refuse(stream, e, Duration::from_millis(50)).await;
        }
        *self = Spare::new();
    }
}

/// Accepts until shutdown, then waits (up to `drain_seconds`) for every
/// connection to finish its in-flight requests.
pub async fn serve(state: Arc<State>, listener: UnixListener) {
    let mut stop = state.shutdown.subscribe();
    let mut tasks = tokio::task::JoinSet::new();
    let mut spare = Spare::new();
    let (mut failures, mut last_warned) = (0u64, None::<std::time::Instant>);
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let st = state.clone();
                    tasks.spawn(async move { connection(st, stream).await });
                }
                Err(e) => {
                    failures += 1;
                    // One line every 10 s, with the count, not one per failure.
                    if last_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                        warn!(error = %e, failures, "accept failed");
                        last_warned = Some(std::time::Instant::now());
                    }
                    let out_of_fds = matches!(e.raw_os_error(), Some(code) if code == rustix::io::Errno::MFILE.raw_os_error() || code == rustix::io::Errno::NFILE.raw_os_error());
                    if out_of_fds {
                        spare.refuse_one(&listener).await;
                    } else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            },
            _ = stop.changed() => break,
        }
        while tasks.try_join_next().is_some() {}
    }
    drop(listener);
    info!(connections = tasks.len(), "draining");
    let drain = Duration::from_secs(state.config.limits.drain_seconds);
    if tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await.is_err() {
        warn!("drain timed out after {drain:?}; closing the remaining connections");
        tasks.abort_all();
    }
}
