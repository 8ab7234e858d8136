//! Feature hashing in the daemon: raw features to keys on the GPU when one
//! is present (and the backend is not forced to cpu), else on every core.
//! Batches below [`GPU_MIN`] features stay on the CPU, where a round trip to
//! the device would cost more than the hashing.

use hkv_proto::{ErrorCode, FeatureHash, Features as WireFeatures, HashSpec, ProtoError, TableSpec};
use hkv_shard::features::{hash_features_cpu, Features, HashKind};
use parking_lot::Mutex;
use tracing::{info, warn};

use crate::error::shard_error;

/// Smallest batch hashed on the GPU.
pub const GPU_MIN: usize = 16 * 1024;

struct Gpu {
    hasher: Mutex<hkv_shard::cuda::FeatureHasher>,
    // The context and modules the hasher's kernels live in (shared with the
    // CUDA shards of device 0).
    _device: std::sync::Arc<hkv_shard::cuda::Device>,
}

/// Hashes features for the router.
pub struct Hasher {
    gpu: Option<Gpu>,
    /// Where hashing runs, in words (for stats).
    pub place: String,
}

impl Hasher {
    /// Uses device `gpu` (the daemon's first GPU) when given and it opens,
    /// else the CPU.
    pub fn new(gpu: Option<usize>) -> Hasher {
        if let Some(ordinal) = gpu {
            match hkv_shard::cuda::shared_device(ordinal)
                .and_then(|d| Ok(Gpu { hasher: Mutex::new(hkv_shard::cuda::FeatureHasher::new(&d)?), _device: d }))
            {
                Ok(g) => {
                    let place = format!("GPU {ordinal} ({})", g._device.info.name);
                    info!(on = %place, "feature hashing");
                    return Hasher { gpu: Some(g), place };
                }
                Err(hkv_shard::Error::Unavailable(why)) => info!(%why, "feature hashing on the CPU"),
                Err(e) => warn!(error = %e, "feature hashing on the CPU: the GPU could not be used"),
            }
        }
        Hasher { gpu: None, place: "CPU".into() }
    }

    /// Hashes one batch (blocking: call from a blocking context).
    pub fn hash(&self, f: &WireFeatures, kind: HashKind, num_buckets: u64) -> Result<Vec<u64>, ProtoError> {
        let f = match f {
            WireFeatures::Int64(v) => Features::Int64(v),
            WireFeatures::Strings { bytes, offsets } => Features::Strings { bytes, offsets },
        };
        let mut out = vec![0u64; f.len()];
        match &self.gpu {
            Some(g) if f.len() >= GPU_MIN => g.hasher.lock().hash(f, kind, num_buckets, &mut out).map(|_| ()),
            _ => hash_features_cpu(f, kind, num_buckets, &mut out, true),
        }
        .map_err(shard_error)?;
        Ok(out)
    }
}

/// The hash a request asks for: its own, or its table's.
pub fn resolve(spec: HashSpec, table: Option<&TableSpec>) -> Result<(HashKind, u64), ProtoError> {
    let h: FeatureHash = match spec {
        HashSpec::Given(h) => h,
        HashSpec::Table => match table {
            Some(t) => t.hash.clone().ok_or_else(|| {
                ProtoError::bad_request(format!(
                    "table {:?} has no hash setting: name a hash kind and num_buckets, or create the table with one",
                    t.name
                ))
            })?,
            None => return Err(ProtoError::bad_request("the table's hash was asked for, but no table was named")),
        },
    };
    check(&h)?;
    let kind = match h.kind {
        hkv_proto::HashKind::Fingerprint64 => HashKind::Fingerprint64,
        hkv_proto::HashKind::Strong => HashKind::Strong { k0: h.key[0], k1: h.key[1] },
    };
    Ok((kind, h.num_buckets))
}

/// Checks a hash setting: num_buckets in range (the kind is typed), and
/// no key with `fingerprint64`, which has none (it would be ignored).
pub fn check(h: &FeatureHash) -> Result<(), ProtoError> {
    if h.kind == hkv_proto::HashKind::Fingerprint64 && h.key != [0, 0] {
        return Err(ProtoError::new(
            ErrorCode::BadRequest,
            format!(
                "bad features: hash key {:?} given with kind fingerprint64, which takes no key; use kind strong \
                 for a keyed hash, or send [0, 0]",
                h.key
            ),
        ));
    }
    hkv_shard::features::check_buckets(h.num_buckets).map_err(|e| ProtoError::new(ErrorCode::BadRequest, e.to_string()))
}
