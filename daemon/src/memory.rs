//! The process's address space, where it is limited (`RLIMIT_AS`: `prlimit
//! --as`, `ulimit -v`, systemd's `LimitAS=`): every large allocation the
//! daemon makes for a client (a request body, an answer, a registered
//! region's mapping) is first checked against what the limit leaves, and
//! refused as `resource_exhausted` where it would not fit. An allocation
//! that fails past that check is refused the same way where it is made
//! fallibly (bodies, answer frames); the check keeps the rest from ever
//! failing, since a failed infallible allocation aborts the process.
//!
//! Without a limit the counters of the bytes in flight and the regions'
//! caps are the only bounds, as before.

use std::sync::atomic::Ordering::Relaxed;

/// Allocations below this are not checked: they are many and small, and
/// the reserve covers them.
pub const LARGE: u64 = 1 << 20;

/// The address-space limit and what is kept free below it.
#[derive(Debug, Clone, Copy)]
pub struct AddressSpace {
    /// The soft `RLIMIT_AS` in bytes, None where unlimited.
    limit: Option<u64>,
}

impl AddressSpace {
    /// The process's limit as it is now.
    pub fn of_process() -> AddressSpace {
        let r = rustix::process::getrlimit(rustix::process::Resource::As);
        AddressSpace { limit: r.current }
    }

    /// The limit in bytes, None where unlimited.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Kept free below the limit for thread stacks, small allocations and
    /// the tables' own growth: 1/16 of the limit, at least 256 MiB.
    pub fn reserve(&self) -> u64 {
        self.limit.map_or(0, |l| (l / 16).max(256 << 20))
    }

    /// Whether `n` more bytes fit in the address space beside what is
    /// mapped now and `pending` bytes counted for allocations that may not
    /// have been made yet (counted twice where they were: this errs on the
    /// side of refusing). Always true without a limit.
    pub fn fits(&self, n: u64, pending: u64) -> bool {
        let Some(limit) = self.limit else { return true };
        let Some(mapped) = mapped_bytes() else { return true };
        mapped.saturating_add(pending).saturating_add(n).saturating_add(self.reserve()) <= limit
    }

    /// Whether `n` more bytes fit beside what is mapped now, without the
    /// reserve (for the start's own threads, mapped before any client
    /// comes). Always true without a limit.
    pub fn fits_mapped(&self, n: u64) -> bool {
        let Some(limit) = self.limit else { return true };
        let Some(mapped) = mapped_bytes() else { return true };
        mapped.saturating_add(n) <= limit
    }

    /// For error messages: the limit and what is mapped, or nothing
    /// without a limit.
    pub fn describe(&self) -> String {
        match (self.limit, mapped_bytes()) {
            (Some(l), Some(m)) => format!("; the address space is limited to {l} bytes (RLIMIT_AS), {m} are mapped"),
            _ => String::new(),
        }
    }
}

/// The process's virtual size (`VmSize` of `/proc/self/status`).
fn mapped_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmSize:"))?;
    let kb: u64 = line.trim_start_matches("VmSize:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// Whether `n` more bytes counted in `counter` (whose other bytes are
/// pending allocations) fit the address space; small amounts always do.
pub(crate) fn fits_counted(space: &AddressSpace, n: u64, counter: &std::sync::atomic::AtomicU64) -> bool {
    n < LARGE || space.fits(n, counter.load(Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mapped_size_is_read_and_a_limit_below_it_refuses() {
        let mapped = mapped_bytes().expect("VmSize in /proc/self/status");
        assert!(mapped > 1 << 20);
        assert!(AddressSpace { limit: None }.fits(u64::MAX / 2, 0));
        let tight = AddressSpace { limit: Some(mapped + (512 << 20)) };
        assert!(tight.fits(64 << 20, 0));
        assert!(!tight.fits(1 << 30, 0), "1 GiB more does not fit 512 MiB of room");
        assert!(!tight.fits(64 << 20, 1 << 30), "pending bytes count");
    }
}
