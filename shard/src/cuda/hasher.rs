//! Feature hashing on the GPU (`features.cu`).

use super::*;

/// Hashes raw features on one device (`features.cu`), reusing its device
/// buffers from batch to batch: each input array goes to the device in one
/// copy, the keys come back in one.
pub struct FeatureHasher {
    stream: Arc<CudaStream>,
    f_int64: CudaFunction,
    f_strings: CudaFunction,
    ints: Option<CudaSlice<i64>>,
    bytes: Option<CudaSlice<u8>>,
    offsets: Option<CudaSlice<u32>>,
    keys: Option<CudaSlice<u64>>,
}

impl FeatureHasher {
    /// A hasher on `device`'s own stream.
    pub fn new(device: &Device) -> Result<FeatureHasher> {
        let stream = device.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let m = device.module(KernelId::Features);
        Ok(FeatureHasher {
            stream,
            f_int64: m.load_function("features_int64").map_err(dev_err("features_int64"))?,
            f_strings: m.load_function("features_strings").map_err(dev_err("features_strings"))?,
            ints: None,
            bytes: None,
            offsets: None,
            keys: None,
        })
    }

    /// Hashes `features` into `out` (one key per feature), exactly as
    /// [`crate::features::hash_features_cpu`]. Returns the kernel's time in
    /// milliseconds (CUDA events around the launch).
    pub fn hash(&mut self, features: Features<'_>, kind: HashKind, num_buckets: u64, out: &mut [u64]) -> Result<f32> {
        let n = features.len();
        if out.len() != n {
            return Err(Error::Length {
                what: "keys",
                expected: n,
                got: out.len(),
                detail: "one key per feature".into(),
            });
        }
        let Some((start, end)) = self.launch(features, kind, num_buckets, None)? else {
            return Ok(0.0);
        };
        let s = self.stream.clone();
        let keys = self.keys.as_ref().expect("ensured");
        s.memcpy_dtoh(&keys.slice(..n), out).map_err(dev_err("copying keys"))?;
        s.synchronize().map_err(dev_err("synchronizing"))?;
        start.elapsed_ms(&end).map_err(dev_err("reading events"))
    }

    /// Hashes `features` into the first keys of `out`, a buffer on this
    /// hasher's device, where they stay (the device-resident path of a GPU
    /// group). Returns when the keys are written.
    pub fn hash_on_device(
        &mut self,
        features: Features<'_>,
        kind: HashKind,
        num_buckets: u64,
        out: &mut CudaSlice<u64>,
    ) -> Result<()> {
        let n = features.len();
        if out.len() < n {
            return Err(Error::Length {
                what: "keys",
                expected: n,
                got: out.len(),
                detail: "a device buffer of one key per feature or more".into(),
            });
        }
        let (dst, _) = cudarc::driver::DevicePtrMut::device_ptr_mut(out, &self.stream);
        self.launch(features, kind, num_buckets, Some(dst))?;
        self.stream.synchronize().map_err(dev_err("synchronizing"))
    }

    /// Copies the features in and launches the kernel writing keys to `dst`
    /// (a device address of at least `n` keys) or to the hasher's own
    /// buffer; returns the events around the launch (None: no features).
    fn launch(
        &mut self,
        features: Features<'_>,
        kind: HashKind,
        num_buckets: u64,
        dst: Option<u64>,
    ) -> Result<Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>> {
        crate::features::check_buckets(num_buckets)?;
        features.validate()?;
        let n = features.len();
        if n == 0 {
            return Ok(None);
        }
        let (k0, k1) = match kind {
            HashKind::Fingerprint64 => (0u64, 0u64),
            HashKind::Strong { k0, k1 } => (k0, k1),
        };
        // The kernels' kind (kernels/abi.h).
        let code = match kind {
            HashKind::Fingerprint64 => hkv_kernels::abi::HKV_HASH_FINGERPRINT64,
            HashKind::Strong { .. } => hkv_kernels::abi::HKV_HASH_SIPHASH,
        } as i32;
        let (s, n64) = (self.stream.clone(), n as u64);
        let out = match dst {
            Some(d) => d,
            None => {
                ensure(&s, &mut self.keys, n)?;
                let (p, _) = cudarc::driver::DevicePtr::device_ptr(self.keys.as_ref().expect("ensured"), &s);
                p
            }
        };
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start;
        match features {
            Features::Int64(v) => {
                ensure(&s, &mut self.ints, n)?;
                let ints = self.ints.as_mut().expect("ensured");
                s.memcpy_htod(v, &mut ints.slice_mut(..n)).map_err(dev_err("copying features"))?;
                let mut launch = s.launch_builder(&self.f_int64);
                launch.arg(&*ints).arg(&n64).arg(&code).arg(&k0).arg(&k1).arg(&num_buckets).arg(&out);
                start = s.record_event(timing).map_err(dev_err("recording an event"))?;
                // SAFETY: features_int64(x, n, kind, k0, k1, num_buckets, out)
                // reads x[0..n] and writes out[0..n]; x holds at least n i64,
                // `out` at least n u64 (the hasher's buffer, ensured above, or
                // the caller's, checked by hash_on_device), threads with an
                // index >= n return at once, and num_buckets >= 1 was checked.
                unsafe { launch.launch(grid(n64, 1024)?) }.map_err(dev_err("launching features_int64"))?;
            }
            Features::Strings { bytes, offsets } => {
                ensure(&s, &mut self.bytes, bytes.len())?;
                ensure(&s, &mut self.offsets, n + 1)?;
                let (db, dofs) = (self.bytes.as_mut().expect("ensured"), self.offsets.as_mut().expect("ensured"));
                if !bytes.is_empty() {
                    s.memcpy_htod(bytes, &mut db.slice_mut(..bytes.len())).map_err(dev_err("copying bytes"))?;
                }
                s.memcpy_htod(offsets, &mut dofs.slice_mut(..n + 1)).map_err(dev_err("copying offsets"))?;
                let mut launch = s.launch_builder(&self.f_strings);
                launch.arg(&*db).arg(&*dofs).arg(&n64).arg(&code).arg(&k0).arg(&k1).arg(&num_buckets).arg(&out);
                start = s.record_event(timing).map_err(dev_err("recording an event"))?;
                // SAFETY: features_strings(bytes, offsets, n, kind, k0, k1,
                // num_buckets, out) reads offsets[0..=n], bytes in
                // [offsets[i], offsets[i+1]) and writes out[0..n]. validate()
                // checked that the offsets are non-decreasing and end within
                // `bytes`, which was copied whole into a buffer at least that
                // long; offsets holds n + 1 and `out` n elements; num_buckets >= 1.
                unsafe { launch.launch(grid(n64, 1024)?) }.map_err(dev_err("launching features_strings"))?;
            }
        }
        let end = s.record_event(timing).map_err(dev_err("recording an event"))?;
        Ok(Some((start, end)))
    }
}
