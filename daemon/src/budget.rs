//! The memory budget: a table's memory is counted against explicit limits,
//! and against what the host and devices have free, before anything is
//! allocated, so that no client's numbers can make the daemon abort or be
//! killed for memory.
//!
//! A table is charged its *peak* footprint ([`TableConfig::peak_footprint`]):
//! its storage at `max_capacity` plus the half-size storage a last doubling
//! rebuilds from. Growth and `reserve` therefore never need more than the
//! table was granted at `create_table`, and the charge is released when the
//! table is dropped (after its last running request).

use std::sync::Arc;

use hkv_proto::{ErrorCode, ProtoError};
use hkv_shard::{Backend, Footprint, TableConfig};
use parking_lot::Mutex;
use serde::Serialize;

/// The limits and what tables hold of them.
#[derive(Debug)]
pub struct Budget {
    backend: Backend,
    /// The device of each shard (CUDA), for the free-memory check.
    ordinals: Vec<usize>,
    /// Bytes of the memory tables live in: device memory on CUDA, host
    /// memory on the CPU backend.
    table_limit: u64,
    /// Bytes of pinned host memory for CUDA tables' host tier.
    host_tier_limit: u64,
    used: Mutex<Footprint>,
}

/// The budget in numbers, for stats.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct BudgetStats {
    /// `limits.max_table_bytes` in force.
    pub max_table_bytes: u64,
    /// Bytes of it charged to tables (peak footprints).
    pub table_bytes: u64,
    /// `limits.max_host_tier_bytes` in force (CUDA), 0 on the CPU backend.
    pub max_host_tier_bytes: u64,
    /// Bytes of it charged to tables.
    pub host_tier_bytes: u64,
}

/// A table's share of the budget; given back on drop.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    held: Footprint,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock();
        used.device -= self.held.device;
        used.host -= self.held.host;
    }
}

/// `n` bytes for people: "1.50 GiB (1610612736 bytes)".
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} bytes");
    }
    let (mut v, mut u) = (n as f64 / 1024.0, 0);
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {} ({n} bytes)", UNITS[u])
}

/// A `/proc/meminfo` field in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// The cgroup's memory limit, when one is set (cgroup v2).
fn cgroup_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    std::fs::read_to_string(format!("/sys/fs/cgroup{}/memory.max", path.trim_end_matches('/')))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Host memory the daemon may use at most: RAM, or the cgroup's limit when lower.
pub fn host_memory() -> u64 {
    let ram = meminfo("MemTotal").unwrap_or(u64::MAX);
    cgroup_limit().map_or(ram, |c| c.min(ram))
}

/// Host memory free now (`MemAvailable`), when known.
fn host_available() -> Option<u64> {
    meminfo("MemAvailable")
}

impl Budget {
    /// The default `limits.max_table_bytes`: 3/4 of host memory (or of the
    /// address-space limit, when lower) on the CPU backend; 7/8 of the
    /// devices' memory on CUDA (the rest is left to the lanes' staging
    /// buffers, device batches and the driver).
    pub fn default_table_limit(backend: Backend, ordinals: &[usize]) -> u64 {
        match backend {
            Backend::Cuda => {
                let mut seen = ordinals.to_vec();
                seen.sort_unstable();
                seen.dedup();
                seen.iter().filter_map(|&o| hkv_shard::cuda::memory(o).ok()).map(|(_, total)| total / 8 * 7).sum()
            }
            // An address-space limit (RLIMIT_AS) bounds host tables too.
            _ => {
                let space = crate::memory::AddressSpace::of_process().limit().map_or(u64::MAX, |l| l / 4 * 3);
                (host_memory() / 4 * 3).min(space)
            }
        }
    }

    /// The default `limits.max_host_tier_bytes`: half of host memory (pinned
    /// memory cannot be swapped out).
    pub fn default_host_tier_limit() -> u64 {
        host_memory() / 2
    }

    /// A budget for shards on `ordinals` (their devices on CUDA).
    pub fn new(backend: Backend, ordinals: Vec<usize>, table_limit: u64, host_tier_limit: u64) -> Arc<Budget> {
        Arc::new(Budget { backend, ordinals, table_limit, host_tier_limit, used: Mutex::new(Footprint::default()) })
    }

    /// The limits and the charged bytes.
    pub fn stats(&self) -> BudgetStats {
        let used = *self.used.lock();
        let cuda = self.backend == Backend::Cuda;
        BudgetStats {
            max_table_bytes: self.table_limit,
            table_bytes: if cuda { used.device } else { used.host },
            max_host_tier_bytes: if cuda { self.host_tier_limit } else { 0 },
            host_tier_bytes: if cuda { used.host } else { 0 },
        }
    }

    /// Charges table `name`, one shard of `config` on each of the budget's
    /// shards, or says why it does not fit; nothing is allocated either way.
    /// `shape` says what was asked for, in the request's numbers.
    pub fn charge(self: &Arc<Budget>, name: &str, shape: &str, config: &TableConfig) -> Result<Charge, ProtoError> {
        let n = self.ordinals.len() as u64;
        let overflow = || {
            ProtoError::new(
                ErrorCode::ResourceExhausted,
                format!("table {name:?}: {shape} is too large to count in bytes; no host holds it"),
            )
        };
        let cuda = self.backend == Backend::Cuda;
        let backend = if cuda { Backend::Cuda } else { Backend::Cpu };
        let peak = config.peak_footprint(backend).and_then(|f| f.times(n)).ok_or_else(overflow)?;
        let first = config.footprint_at(backend, config.buckets()).ok_or_else(overflow)?;
        let exhausted = |m: String| ProtoError::new(ErrorCode::ResourceExhausted, format!("table {name:?}: {m}"));
        let mut used = self.used.lock();
        let (what, need, held, limit, key) = if cuda {
            ("device memory", peak.device, used.device, self.table_limit, "limits.max_table_bytes")
        } else {
            ("host memory", peak.host, used.host, self.table_limit, "limits.max_table_bytes")
        };
        if held.checked_add(need).is_none_or(|t| t > limit) {
            return Err(exhausted(format!(
                "needs up to {} of {what} ({shape}), but {key} is {} and other tables hold {}; \
                 create a smaller table, drop one, or raise {key}",
                bytes(need),
                bytes(limit),
                bytes(held)
            )));
        }
        if cuda && used.host.checked_add(peak.host).is_none_or(|t| t > self.host_tier_limit) {
            return Err(exhausted(format!(
                "needs up to {} of pinned host memory for values beyond fast_tier_bytes ({shape}), but \
                 limits.max_host_tier_bytes is {} and other tables hold {}; raise fast_tier_bytes or the limit",
                bytes(peak.host),
                bytes(self.host_tier_limit),
                bytes(used.host)
            )));
        }
        // What is allocated now must also be free now.
        let host_now = first.host.saturating_mul(n);
        if let Some(avail) = host_available().filter(|&a| host_now > a) {
            return Err(exhausted(format!(
                "needs {} of host memory now ({shape}), but only {} is available on this host",
                bytes(host_now),
                bytes(avail)
            )));
        }
        if cuda {
            let mut per_device: Vec<(usize, u64)> = vec![];
            for &o in &self.ordinals {
                match per_device.iter_mut().find(|(d, _)| *d == o) {
                    Some((_, b)) => *b = b.saturating_add(first.device),
                    None => per_device.push((o, first.device)),
                }
            }
            for (o, need) in per_device {
                if let Ok((free, _)) = hkv_shard::cuda::memory(o) {
                    if need > free {
                        return Err(exhausted(format!(
                            "needs {} of device memory on GPU {o} now ({shape}), but only {} is free there",
                            bytes(need),
                            bytes(free)
                        )));
                    }
                }
            }
        }
        used.device += peak.device;
        used.host += peak.host;
        Ok(Charge { budget: self.clone(), held: peak })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(capacity: u64, max: u64, dim: usize) -> TableConfig {
        TableConfig { capacity, max_capacity: max, dim, ..TableConfig::default() }
    }

    #[test]
    fn tables_are_charged_their_peak_and_released_on_drop() {
        let b = Budget::new(Backend::Cpu, vec![0, 1], 64 << 20, 0);
        let at = |buckets| cfg(1 << 16, 0, 8).footprint_at(Backend::Cpu, buckets).unwrap().host;
        let c = b.charge("a", "a", &cfg(1 << 16, 0, 8)).unwrap();
        assert_eq!(b.stats().table_bytes, 2 * at(512));
        // A growable table holds its largest storage plus the half it grows from.
        let g = b.charge("g", "g", &cfg(1 << 16, 1 << 17, 8)).unwrap();
        assert_eq!(b.stats().table_bytes, 2 * at(512) + 2 * (at(1024) + at(512)));
        drop(c);
        drop(g);
        assert_eq!(b.stats().table_bytes, 0);
    }

    #[test]
    fn too_large_tables_are_refused_with_their_sizes() {
        let b = Budget::new(Backend::Cpu, vec![0], 1 << 30, 0);
        let e = b.charge("big", "big", &cfg(1 << 40, 0, 4)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ResourceExhausted);
        assert!(e.message.contains("limits.max_table_bytes"), "{}", e.message);
        let e = b.charge("huge", "huge", &cfg(1 << 62, 0, 4)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ResourceExhausted, "{}", e.message);
        let e = b.charge("grows", "grows", &cfg(128, 1 << 62, 4)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ResourceExhausted, "{}", e.message);
        assert_eq!(b.stats().table_bytes, 0);
    }
}
