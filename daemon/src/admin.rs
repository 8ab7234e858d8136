//! Who may do what, and who may read what the daemon writes.
//!
//! Any peer that can open the socket (mode 0660: the daemon's user and the
//! socket's group) runs table operations, reads and writes alike, `reserve`
//! and `clear` included: `reserve` only allocates memory the table was
//! granted when it was created (the memory budget charges a table its
//! storage at `max_capacity`), and `clear` does no more than erasing every
//! key, which any client may do. Admin operations are those that change
//! what the daemon holds or keeps beyond one table's contents: create_table
//! (it commits memory), drop_table, checkpoint (disk), restore (replaces
//! data) and shutdown. They are allowed to root, the daemon's own user and
//! members of the admin group (primary or supplementary).
//!
//! Everything the daemon writes under its state directory (checkpoints,
//! catalog, kernel cache) holds or reveals table data: the directory is
//! 0700 and its files 0600, or 0750 / 0640 with the admin group as their
//! group when one is configured (directories set-group-id, so that new
//! files take that group); the daemon sets its umask to match, so that no
//! file is ever created readable by others.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use tracing::info;

/// The peer of a connection, from `SO_PEERCRED` and `/proc/PID/status`.
#[derive(Debug, Clone)]
pub struct Peer {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary group ids (empty when the process could not be read).
    pub groups: Vec<u32>,
}

impl Peer {
    /// A peer with its supplementary groups read from `/proc/{pid}/status`
    /// (the groups of the process itself, as `setpriv` or `newgrp` left them).
    pub fn new(uid: u32, gid: u32, pid: Option<i32>) -> Peer {
        let groups = pid.map(supplementary_groups).unwrap_or_default();
        Peer { uid, gid, groups }
    }

    /// Whether the peer is in group `gid`, as primary or supplementary group.
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// The `Groups:` line of `/proc/{pid}/status`.
fn supplementary_groups(pid: i32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .map(|g| g.split_whitespace().filter_map(|x| x.parse().ok()).collect())
        })
        .unwrap_or_default()
}

/// The gid of a group name, read from /etc/group; `what` names the
/// option that gave it (`admin_group (--admin-group)`) in the error.
pub fn group_gid(what: &str, name: &str) -> anyhow::Result<u32> {
    let text = std::fs::read_to_string("/etc/group")?;
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let n = f.next()?;
            let gid = f.nth(1)?.parse().ok()?;
            (n == name).then_some(gid)
        })
        .next()
        .ok_or_else(|| anyhow::anyhow!("{what}: group {name:?} is not in /etc/group"))
}

/// The modes of the state directory and its files.
#[derive(Debug, Clone, Copy)]
pub struct Modes {
    /// The admin group, which may read checkpoints.
    pub gid: Option<u32>,
}

impl Modes {
    /// 0700, or 0750 with an admin group and the set-group-id bit, so that
    /// what is created inside belongs to the admin group too.
    pub fn dir(self) -> u32 {
        if self.gid.is_some() {
            0o2750
        } else {
            0o700
        }
    }

    /// The umask that gives new files 0600 (0640) and directories 0700 (0750).
    pub fn umask(self) -> u32 {
        if self.gid.is_some() {
            0o027
        } else {
            0o077
        }
    }

    /// Sets the process's umask, so that every file the daemon creates from
    /// now on has no more than these modes.
    pub fn apply_umask(self) {
        rustix::process::umask(rustix::fs::Mode::from_raw_mode(self.umask()));
    }

    /// Creates the state directory `dir` if needed and gives it, and what
    /// the daemon keeps in it (`checkpoints/`, `kernels/`), these modes (an
    /// older daemon left 0755 / 0644 behind) and the admin group. Nothing
    /// else below `dir` is touched: it may be a directory shared with others.
    pub fn secure(self, dir: &Path) -> anyhow::Result<()> {
        // Every directory created on the way gets the modes and group, so
        // that the admin group can reach the state directory.
        let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && !d.exists()).collect();
        let mut fixed = 0usize;
        for d in missing.into_iter().rev() {
            std::fs::create_dir(d).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", d.display()))?;
            if d != dir {
                self.fix(d, &std::fs::symlink_metadata(d)?, &mut fixed)?;
            }
        }
        fixed = 0;
        self.fix(dir, &std::fs::symlink_metadata(dir)?, &mut fixed)?;
        for own in ["checkpoints", "kernels"] {
            if dir.join(own).exists() {
                self.walk(&dir.join(own), &mut fixed)?;
            }
        }
        if fixed > 0 {
            info!(dir = %dir.display(), fixed, "state files no longer readable by others");
        }
        Ok(())
    }

    fn walk(self, path: &Path, fixed: &mut usize) -> anyhow::Result<()> {
        let meta = std::fs::symlink_metadata(path)?;
        if meta.file_type().is_symlink() {
            return Ok(());
        }
        self.fix(path, &meta, fixed)?;
        if meta.is_dir() {
            let what = |e: std::io::Error| anyhow::anyhow!("cannot read {}: {e}", path.display());
            for entry in std::fs::read_dir(path).map_err(what)? {
                self.walk(&entry.map_err(what)?.path(), fixed)?;
            }
        }
        Ok(())
    }

    fn fix(self, path: &Path, meta: &std::fs::Metadata, fixed: &mut usize) -> anyhow::Result<()> {
        let old = meta.mode() & 0o7777;
        let new = if meta.is_dir() { self.dir() } else { old & !self.umask() };
        let what = |e: std::io::Error| anyhow::anyhow!("cannot secure {}: {e}", path.display());
        if old != new {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(new)).map_err(what)?;
            *fixed += 1;
        }
        if let Some(gid) = self.gid.filter(|&g| g != meta.gid()) {
            std::os::unix::fs::lchown(path, None, Some(gid)).map_err(|e| {
                // Only root gives a file a group its owner is not in (a
                // tester's daemon user outside admin_group got "Operation
                // not permitted" and no hint).
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    anyhow::anyhow!(
                        "cannot give {} the admin group (gid {gid}): {e}. The daemon's user must be a member of \
                         admin_group (usermod -aG GROUP USER, or SupplementaryGroups=GROUP in its systemd unit)",
                        path.display()
                    )
                } else {
                    what(e)
                }
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_in_their_supplementary_groups() {
        let me = Peer::new(0, 5, Some(std::process::id() as i32));
        assert!(me.in_group(5));
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Groups:")).unwrap();
        for g in line["Groups:".len()..].split_whitespace() {
            assert!(me.in_group(g.parse().unwrap()), "group {g}");
        }
        assert!(!Peer::new(1, 1, None).in_group(2));
    }

    /// A nested state directory's parents were created 0750 root:root, so
    /// the admin group could not reach it.
    #[test]
    fn every_directory_created_for_the_state_gets_the_group() {
        let d = tempfile::tempdir().unwrap();
        let gid = std::fs::metadata(d.path()).unwrap().gid() + 1; // any group: root may give it
        let state = d.path().join("a").join("b");
        Modes { gid: Some(gid) }.secure(&state).unwrap();
        for p in [d.path().join("a"), state] {
            let m = std::fs::metadata(&p).unwrap();
            assert_eq!((m.gid(), m.mode() & 0o7777), (gid, 0o2750), "{}", p.display());
        }
    }

    #[test]
    fn secure_tightens_an_old_state_dir() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        std::fs::create_dir_all(state.join("checkpoints")).unwrap();
        std::fs::write(state.join("checkpoints").join("db"), b"x").unwrap();
        std::fs::write(state.join("notes.txt"), b"not ours").unwrap();
        for p in [state.clone(), state.join("checkpoints")] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        for f in ["checkpoints/db", "notes.txt"] {
            std::fs::set_permissions(state.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        Modes { gid: None }.secure(&state).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&state), 0o700);
        assert_eq!(mode(&state.join("checkpoints")), 0o700);
        assert_eq!(mode(&state.join("checkpoints/db")), 0o600);
        assert_eq!(mode(&state.join("notes.txt")), 0o644, "a file the daemon does not own is left alone");
    }
}
