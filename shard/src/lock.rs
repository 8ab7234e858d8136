//! The triple-group lock (paper §3.5): readers share with readers, updaters
//! with updaters, an inserter runs alone.
//!
//! A group may enter when the lock is idle, or when its own (shareable) group
//! is active and no other group is waiting: waiting groups block newcomers,
//! so a stream of readers cannot starve an inserter. State is observable.

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
    /// Times the admission rule found two groups running together or two
    /// inserters at once. Always 0 unless the lock is broken.
    pub violations: u64,
}

/// The lock. `acquire` returns a guard that releases on drop.
#[derive(Debug, Default)]
pub struct GroupLock {
    state: Mutex<LockState>,
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

    fn may_enter(s: &LockState, g: Group) -> bool {
        match s.active {
            None => true,
            Some(a) if a == g && g != Group::Inserter => {
                // Same shareable group: join unless another group waits.
                Group::ALL.iter().all(|&o| o == g || s.waiting[o as usize] == 0)
            }
            _ => false,
        }
    }

    /// Blocks until `group` may run, then returns its guard.
    pub fn acquire(&self, group: Group) -> GroupGuard<'_> {
        let gi = group as usize;
        let mut s = self.state.lock();
        if !Self::may_enter(&s, group) {
            let start = Instant::now();
            s.waiting[gi] += 1;
            s.waits[gi] += 1;
            while !Self::may_enter(&s, group) {
                self.cond.wait(&mut s);
            }
            s.waiting[gi] -= 1;
            s.wait_ns[gi] += start.elapsed().as_nanos() as u64;
        }
        s.active = Some(group);
        s.running[gi] += 1;
        s.max_running[gi] = s.max_running[gi].max(s.running[gi]);
        let others = Group::ALL.iter().filter(|&&o| o != group).map(|&o| s.running[o as usize]).sum::<u32>();
        if others > 0 || (group == Group::Inserter && s.running[gi] > 1) {
            s.violations += 1;
        }
        GroupGuard { lock: self, group }
    }

    /// A copy of the current state.
    pub fn state(&self) -> LockState {
        self.state.lock().clone()
    }
}

impl Drop for GroupGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.lock.state.lock();
        let gi = self.group as usize;
        s.running[gi] -= 1;
        if s.running[gi] == 0 {
            s.active = None;
            drop(s);
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
