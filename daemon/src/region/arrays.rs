//! A region request's arrays: each reference resolved against its slot and
//! registered region and checked (bounds, alignment, counts against the
//! keys), inputs read, outputs claimed in a memfd region or copied back to
//! a device region.

use std::collections::HashMap;
use std::sync::Arc;

use hkv_proto::region::{self as wire, Count, RegionRef, RegionRequest, Slot};
use hkv_proto::{ErrorCode, ProtoError};
use hkv_region::{ClaimError, ClaimMut, Mapping};
use hkv_shard::cuda::ipc::IpcEvent;
use zerocopy::{Immutable, IntoBytes};

use super::{err, not_registered, Region};
use crate::error::shard_error;

/// One checked reference: its region and its element count.
pub struct Arr {
    pub slot: Slot,
    pub r: RegionRef,
    pub region: Arc<Region>,
}

impl Arr {
    /// The mapping of a memfd region (only those are claimed).
    fn map(&self) -> &Arc<Mapping> {
        self.region.host().expect("claims are made on memfd regions only")
    }

    fn claim_err(&self, e: ClaimError) -> ProtoError {
        match e {
            ClaimError::Busy => err(
                ErrorCode::Busy,
                format!(
                    "{}: region {} bytes {}.. overlap an array another request in flight writes, or another \
                     array of this request (outputs may not overlap anything); nothing was applied",
                    self.slot.name, self.r.region, self.r.offset
                ),
            ),
            ClaimError::OutOfBounds => wire::bad_ref(self.slot.name, &self.r, "past the end of the region"),
            ClaimError::Misaligned => {
                wire::bad_ref(self.slot.name, &self.r, "offset not a multiple of the element size")
            }
        }
    }

    pub(super) fn claim_mut<T>(&self) -> Result<ClaimMut<T>, ProtoError> {
        self.map().claim_mut::<T>(self.r.offset, self.r.count).map_err(|e| self.claim_err(e))
    }

    pub(super) fn read<T: zerocopy::FromBytes + zerocopy::IntoBytes + Clone + Default>(
        &self,
    ) -> Result<Vec<T>, ProtoError> {
        let mut v = vec![T::default(); self.r.count as usize];
        match self.region.device() {
            // A device copy waits for the GPU: the worker says it blocks
            // (the runtime is multi-threaded), so other tasks move on.
            Some(m) => {
                tokio::task::block_in_place(|| m.read::<u8>(self.r.offset, v.as_mut_bytes())).map_err(shard_error)?
            }
            None => self.map().read(self.r.offset, &mut v).map_err(|e| self.claim_err(e))?,
        }
        Ok(v)
    }

    /// The array as an output: claimed in a memfd region; in a device
    /// region, where the staged answer is copied to.
    pub(super) fn out<T: zerocopy::FromBytes + zerocopy::IntoBytes>(
        &self,
        host: fn(ClaimMut<T>) -> Out,
    ) -> Result<Out, ProtoError> {
        match self.region.device() {
            Some(m) => Ok(Out::Dev(m.clone(), self.r.offset)),
            None => Ok(host(self.claim_mut()?)),
        }
    }
}

/// Resolves and checks every reference of `req` against its slot and
/// region (bounds, alignment, counts; `dim` the table's row width,
/// `values_dim` its value dim without optimizer state); returns them with n.
pub(super) fn resolve(
    regions: &HashMap<u32, Arc<Region>>,
    events: Option<&HashMap<u32, Arc<IpcEvent>>>,
    req: &RegionRequest,
    dim: usize,
    values_dim: usize,
) -> Result<(Vec<Arr>, usize), ProtoError> {
    let slots = req.slots();
    let mut arrs = Vec::with_capacity(slots.len());
    for (slot, r) in slots.into_iter().zip(&req.refs) {
        let Some(region) = regions.get(&r.region).cloned() else {
            if events.is_some_and(|e| e.contains_key(&r.region)) {
                return Err(wire::bad_ref(slot.name, r, "that id is an event (register_cuda_event), not memory"));
            }
            return Err(not_registered(r.region));
        };
        let size = slot.elem.size();
        let bytes = r.count.checked_mul(size).ok_or_else(|| wire::bad_ref(slot.name, r, "count overflows"))?;
        let end = r.offset.checked_add(bytes).ok_or_else(|| wire::bad_ref(slot.name, r, "offset + bytes overflows"))?;
        if end > region.len {
            return Err(wire::bad_ref(
                slot.name,
                r,
                &format!("ends at byte {end}, past the end of the {}-byte region", region.len),
            ));
        }
        if r.offset % size != 0 {
            return Err(wire::bad_ref(slot.name, r, &format!("offset is not a multiple of {size} (the element size)")));
        }
        arrs.push(Arr { slot, r: *r, region });
    }
    // n from the keys (or features), then every count checked against it.
    let mut n = None;
    let mut cap = None;
    for a in &arrs {
        match a.slot.count {
            Count::SetsN => n = Some(a.r.count),
            Count::Offsets => n = Some(a.r.count.saturating_sub(1)),
            Count::Cap if cap.is_none() => cap = Some(a.r.count),
            _ => {}
        }
    }
    let n = n.unwrap_or(0);
    if n > u32::MAX as u64 {
        return Err(ProtoError::bad_request(format!("{n} keys in one request; send at most {} per request", u32::MAX)));
    }
    let cap = cap.unwrap_or(0);
    let dim = dim as u64;
    for a in &arrs {
        let want = match a.slot.count {
            Count::N => Some(n),
            Count::NDim => n.checked_mul(dim),
            Count::NValues => n.checked_mul(values_dim as u64),
            Count::Cap => Some(cap),
            Count::CapDim => cap.checked_mul(dim),
            Count::SetsN | Count::Offsets | Count::Any => continue,
        };
        if want != Some(a.r.count) {
            let code = if matches!(a.slot.count, Count::NDim | Count::CapDim | Count::NValues) {
                ErrorCode::WrongDim
            } else {
                ErrorCode::LengthMismatch
            };
            return Err(err(
                code,
                format!(
                    "{}: {} elements, but {} are needed ({n} keys{}, dim {}); nothing was applied",
                    a.slot.name,
                    a.r.count,
                    want.map_or("more than 2^64".into(), |w| w.to_string()),
                    if cap > 0 { format!(", room for {cap} entries") } else { String::new() },
                    if a.slot.count == Count::NValues { values_dim as u64 } else { dim }
                ),
            ));
        }
    }
    Ok((arrs, n as usize))
}

/// An output array: claimed in a memfd region, or a device region and the
/// byte offset that the answer is copied to.
pub(super) enum Out {
    U8(ClaimMut<u8>),
    U64(ClaimMut<u64>),
    F32(ClaimMut<f32>),
    Dev(Arc<hkv_shard::cuda::ipc::IpcMem>, u64),
}

/// Writes `src` (or as much as fits) into an output array.
pub(super) fn put<T: IntoBytes + Immutable>(o: Option<Out>, src: &[T]) -> Result<(), ProtoError> {
    let src = src.as_bytes();
    let copy = |d: &mut [u8]| {
        let k = d.len().min(src.len());
        d[..k].copy_from_slice(&src[..k]);
    };
    match o {
        None => {}
        Some(Out::U8(mut c)) => copy(c.as_mut_slice()),
        Some(Out::U64(mut c)) => copy(c.as_mut_slice().as_mut_bytes()),
        Some(Out::F32(mut c)) => copy(c.as_mut_slice().as_mut_bytes()),
        Some(Out::Dev(m, offset)) => tokio::task::block_in_place(|| m.write::<u8>(offset, src)).map_err(shard_error)?,
    }
    Ok(())
}
