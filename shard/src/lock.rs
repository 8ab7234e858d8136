//! The triple-group lock (paper §3.5): readers share with readers, updaters
//! with updaters, an inserter runs alone.
//!
//! The lock is phase-fair. A newcomer joins a running shareable group only
//! while no other group waits. When the last holder leaves and others wait,
//! the next waiting group in rotation (reader → updater → inserter) gets the
//! next phase, and all its waiters enter together (one, for inserters). So
//! no group starves and sharing still happens under mixed load.

use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

/// The three lock groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Group {
    /// find, contains, export: run together.
    Reader = 0,
    /// assign, assign_scores, accumulate on existing keys: run together.
    Updater = 1,
    /// anything that may allocate, evict or erase: runs alone.
    Inserter = 2,
}

impl Group {
    /// All groups, indexable by `as usize`.
    pub const ALL: [Group; 3] = [Group::Reader, Group::Updater, Group::Inserter];
}

/// A snapshot of the lock: who runs, who waits, how much waiting happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LockState {
    /// The group holding the lock, if any.
    pub active: Option<Group>,
    /// Operations running, per group (index = `Group as usize`).
    pub running: [u32; 3],
    /// Operations waiting, per group.
    pub waiting: [u32; 3],
    /// Acquisitions that had to wait, per group, since creation.
    pub waits: [u64; 3],
    /// Total nanoseconds spent waiting, per group.
    pub wait_ns: [u64; 3],
    /// Largest number of operations seen running at once, per group.
    pub max_running: [u32; 3],
    /// Times an entering operation found another group running, or another
    /// inserter. Always 0 unless the lock is broken.
    pub violations: u64,
}

#[derive(Debug, Default)]
struct Inner {
    s: LockState,
    /// The group granted the next phase, while its waiters are entering.
    turn: Option<Group>,
    /// Waiters of `turn` still to enter.
    admit: u32,
}

impl Inner {
    fn others_wait(&self, g: Group) -> bool {
        Group::ALL.iter().any(|&o| o != g && self.s.waiting[o as usize] > 0)
    }

    /// May a newcomer (not yet waiting) enter?
    fn newcomer_may_enter(&self, g: Group) -> bool {
        match self.s.active {
            None => self.turn.is_none(),
            Some(a) => a == g && g != Group::Inserter && self.turn.is_none() && !self.others_wait(g),
        }
    }
}

/// The lock. `acquire` returns a guard that releases on drop.
#[derive(Debug, Default)]
pub struct GroupLock {
    inner: Mutex<Inner>,
    cond: Condvar,
}

/// Holds one group's share of the lock.
#[derive(Debug)]
pub struct GroupGuard<'a> {
    lock: &'a GroupLock,
    group: Group,
}

impl GroupLock {
    /// A new idle lock.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks until `group` may run, then returns its guard.
    pub fn acquire(&self, group: Group) -> GroupGuard<'_> {
        let gi = group as usize;
        let mut inner = self.inner.lock();
        if !inner.newcomer_may_enter(group) {
            let start = Instant::now();
            inner.s.waiting[gi] += 1;
            inner.s.waits[gi] += 1;
            loop {
                self.cond.wait(&mut inner);
                if inner.turn == Some(group) && inner.admit > 0 {
                    inner.admit -= 1;
                    if inner.admit == 0 {
                        inner.turn = None;
                    }
                    break;
                }
            }
            inner.s.waiting[gi] -= 1;
            inner.s.wait_ns[gi] += start.elapsed().as_nanos() as u64;
        }
        let s = &mut inner.s;
        let others: u32 = Group::ALL.iter().filter(|&&o| o != group).map(|&o| s.running[o as usize]).sum();
        if others > 0 || (group == Group::Inserter && s.running[gi] > 0) {
            s.violations += 1;
        }
        s.active = Some(group);
        s.running[gi] += 1;
        s.max_running[gi] = s.max_running[gi].max(s.running[gi]);
        GroupGuard { lock: self, group }
    }

    /// A copy of the current state.
    pub fn state(&self) -> LockState {
        self.inner.lock().s.clone()
    }
}

impl Drop for GroupGuard<'_> {
    fn drop(&mut self) {
        let mut inner = self.lock.inner.lock();
        let gi = self.group as usize;
        inner.s.running[gi] -= 1;
        if inner.s.running[gi] > 0 {
            return;
        }
        inner.s.active = None;
        // Hand the next phase to the next waiting group in rotation.
        let next = (1..=3).map(|d| Group::ALL[(gi + d) % 3]).find(|&g| inner.s.waiting[g as usize] > 0);
        if let Some(g) = next {
            inner.turn = Some(g);
            inner.admit = if g == Group::Inserter { 1 } else { inner.s.waiting[g as usize] };
            drop(inner);
            self.lock.cond.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn readers_share_inserter_waits() {
        let lock = Arc::new(GroupLock::new());
        let r1 = lock.acquire(Group::Reader);
        let r2 = lock.acquire(Group::Reader);
        assert_eq!(lock.state().running, [2, 0, 0]);
        let l2 = lock.clone();
        let t = std::thread::spawn(move || {
            let _g = l2.acquire(Group::Inserter);
            l2.state()
        });
        while lock.state().waiting[2] == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop((r1, r2));
        let seen = t.join().unwrap();
        assert_eq!(seen.active, Some(Group::Inserter));
        assert_eq!(seen.running, [0, 0, 1]);
        let s = lock.state();
        assert_eq!(s.active, None);
        assert_eq!(s.waits[2], 1);
        assert_eq!(s.violations, 0);
    }
}
