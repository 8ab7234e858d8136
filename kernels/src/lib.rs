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

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The shared helpers, prepended to every module's source.
pub const COMMON: &str = include_str!("../common.cuh");

/// A kernel module (one `.cu` file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `hash.cu`: `hash_locate`.
    Hash,
    /// `features.cu`: `features_int64`, `features_strings`.
    Features,
}

impl KernelId {
    /// Every module.
    pub const ALL: [KernelId; 2] = [KernelId::Hash, KernelId::Features];

    /// The module's name (its file stem).
    pub fn name(self) -> &'static str {
        match self {
            KernelId::Hash => "hash",
            KernelId::Features => "features",
        }
    }

    /// The full source NVRTC compiles: the shared helpers, then the module.
    pub fn source(self) -> String {
        let body = match self {
            KernelId::Hash => include_str!("../hash.cu"),
            KernelId::Features => include_str!("../features.cu"),
        };
        format!("{COMMON}\n{body}")
    }

    /// The kernels the module defines.
    pub fn symbols(self) -> &'static [&'static str] {
        match self {
            KernelId::Hash => &["hash_locate"],
            KernelId::Features => &["features_int64", "features_strings"],
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
                assert!(src.contains(&format!("__global__ void {s}(")), "{s} not in {}", id.name());
            }
        }
    }
}
