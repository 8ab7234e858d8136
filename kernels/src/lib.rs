//! # hkv-kernels: the table's CUDA C sources
//!
//! One `.cu` file per kernel family, shared helpers in `common.cuh`, all
//! embedded in the binary. The CUDA module of `hkv-shard` compiles them with
//! NVRTC for the device's architecture at start and caches the result on
//! disk. Kernel symbols are named `{op}_{variant}`.
//!
//! # Layout
//! - this file: [`KernelId`], every module, with its source and symbols.
//! - `common.cuh`: hashing helpers shared by every module.
//! - `hash.cu`: bucket and digest of keys.
//! - `features.cu`: raw features to keys (Fingerprint64, SipHash-2-4).
//! - `table.cuh`: the table's device layout and shared per-key helpers (the
//!   miss-ratio sampling filter the lookup and writer kernels run among them),
//!   prepended (after `common.cuh`) to the table families:
//!   `lookup.cu` (find, contains, find*), `upsert.cu` (every insert path),
//!   `update.cu` (assign, assign_scores, accumulate), `erase.cu` (erase,
//!   erase_if, clear), `export.cu` (export_batch(_if), compacted).
//! - `route.cu`: the device-resident path of a GPU group: split a batch by
//!   owning shard on the GPU, put rows back in request order.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The shared helpers, prepended to every module's source.
pub const COMMON: &str = include_str!("../common.cuh");
/// The table layout and per-key helpers, prepended to the table families.
pub const TABLE: &str = include_str!("../table.cuh");

/// A kernel module (one `.cu` file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `hash.cu`: `hash_locate`.
    Hash,
    /// `features.cu`: `features_int64`, `features_strings`.
    Features,
    /// `lookup.cu`: `lookup_find` (and its `_gN` variants), `order_count`, `order_write`, `keys_reserved`.
    Lookup,
    /// `upsert.cu`: `upsert_keys` (and its `_gN` variants).
    Upsert,
    /// `update.cu`: `update_keys` (and its `_gN` variants).
    Update,
    /// `erase.cu`: `erase_keys`, `erase_if`, `clear_table`.
    Erase,
    /// `export.cu`: `export_count`, `export_scan`, `export_write`.
    Export,
    /// `route.cu`: `route_count`, `route_scan`, `route_scatter`, `route_masks`, `shard_mask`, `rows_*`.
    Route,
}

impl KernelId {
    /// Every module.
    pub const ALL: [KernelId; 8] = [
        KernelId::Hash,
        KernelId::Features,
        KernelId::Lookup,
        KernelId::Upsert,
        KernelId::Update,
        KernelId::Erase,
        KernelId::Export,
        KernelId::Route,
    ];

    /// The module's name (its file stem).
    pub fn name(self) -> &'static str {
        match self {
            KernelId::Hash => "hash",
            KernelId::Features => "features",
            KernelId::Lookup => "lookup",
            KernelId::Upsert => "upsert",
            KernelId::Update => "update",
            KernelId::Erase => "erase",
            KernelId::Export => "export",
            KernelId::Route => "route",
        }
    }

    /// The full source NVRTC compiles: the shared helpers, then the module.
    pub fn source(self) -> String {
        let (table, body) = match self {
            KernelId::Hash => (false, include_str!("../hash.cu")),
            KernelId::Features => (false, include_str!("../features.cu")),
            KernelId::Lookup => (true, include_str!("../lookup.cu")),
            KernelId::Upsert => (true, include_str!("../upsert.cu")),
            KernelId::Update => (true, include_str!("../update.cu")),
            KernelId::Erase => (true, include_str!("../erase.cu")),
            KernelId::Export => (true, include_str!("../export.cu")),
            KernelId::Route => (false, include_str!("../route.cu")),
        };
        if table {
            format!("{COMMON}\n{TABLE}\n{body}")
        } else {
            format!("{COMMON}\n{body}")
        }
    }

    /// The kernels the module defines.
    pub fn symbols(self) -> &'static [&'static str] {
        match self {
            KernelId::Hash => &["hash_locate"],
            KernelId::Features => &["features_int64", "features_strings"],
            KernelId::Lookup => &[
                "lookup_find",
                "lookup_find_g1",
                "lookup_find_g2",
                "lookup_find_g4",
                "lookup_find_g16",
                "lookup_find_g32",
                "lookup_findz",
                "lookup_findz_g1",
                "lookup_findz_g2",
                "lookup_findz_g4",
                "lookup_findz_g16",
                "lookup_findz_g32",
                "lookup_at",
                "lookup_at_g1",
                "lookup_at_g2",
                "lookup_at_g4",
                "lookup_at_g16",
                "lookup_at_g32",
                "order_count",
                "order_write",
                "keys_reserved",
            ],
            KernelId::Upsert => &[
                "upsert_keys",
                "upsert_keys_g1",
                "upsert_keys_g2",
                "upsert_keys_g4",
                "upsert_keys_g16",
                "upsert_keys_g32",
                "upsert_keys_g4_b5",
            ],
            KernelId::Update => &[
                "update_keys",
                "update_keys_g1",
                "update_keys_g2",
                "update_keys_g4",
                "update_keys_g16",
                "update_keys_g32",
                "update_keys_g2_b5",
            ],
            KernelId::Erase => &["erase_keys", "erase_if", "clear_table"],
            KernelId::Export => &["export_count", "export_scan", "export_write"],
            KernelId::Route => &[
                "route_count",
                "route_scan",
                "route_scatter",
                "route_masks",
                "shard_mask",
                "rows_gather_u8",
                "rows_scatter_u64",
                "rows_scatter_f32",
                "rows_gather_f32",
                "rows_scatter_f128",
                "rows_gather_f128",
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_symbol_is_defined_in_its_source() {
        for id in KernelId::ALL {
            let src = id.source();
            assert!(src.contains("hkv_fmix64"), "{} lacks the shared helpers", id.name());
            for s in id.symbols() {
                let defined = src.contains(&format!("__global__ void {s}(")) || src.contains(&format!("_KERNEL({s},"));
                assert!(defined, "{s} not in {}", id.name());
            }
        }
    }
}
