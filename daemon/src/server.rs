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
/// given) when missing, replaces a stale socket file, refuses when another
/// daemon answers there, and gives the socket mode 0660 and group `gid`, so
/// that the admin group's members can connect.
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

/// Removes the socket file on drop (the daemon's own, not an inherited one).
pub struct SocketFile(pub Option<PathBuf>);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Accepts until shutdown, then waits (up to `drain_seconds`) for every
/// connection to finish its in-flight requests.
pub async fn serve(state: Arc<State>, listener: UnixListener) {
    let mut stop = state.shutdown.subscribe();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let st = state.clone();
                    tasks.spawn(async move { connection(st, stream).await });
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
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
