//! Requests on a client's device memory (CUDA IPC regions): the table's
//! kernels read the keys and write rows, flags and evicted entries where
//! the client's arrays are, with no copy through host memory.

use super::*;
use crate::cuda::ipc::{IpcEvent, IpcSpan};

/// The arrays of one request in a client's device memory
/// ([`CudaTable::run_ipc`]): `keys` sets n; the others, where the op uses
/// them, hold n elements (n × dim floats for rows).
#[derive(Clone)]
pub struct IpcArrays {
    /// Keys in.
    pub keys: IpcSpan<u64>,
    /// Rows: out (find), in (writes), in and out (find_or_insert); out
    /// (apply_gradients, optional): each key's values after its step, n ×
    /// the step's dim.
    pub values: Option<IpcSpan<f32>>,
    /// apply_gradients: the gradients in, n × the step's dim.
    pub grads: Option<IpcSpan<f32>>,
    /// Found / erased flags out.
    pub found: Option<IpcSpan<u8>>,
    /// Scores out (find).
    pub scores: Option<IpcSpan<u64>>,
    /// insert_and_evict: evicted keys, rows, scores and kinds out, from
    /// their start (the answer's count says how many).
    pub lost: Option<IpcLost>,
}

/// insert_and_evict's outputs in client memory: keys, rows, scores, kinds.
pub type IpcLost = (IpcSpan<u64>, IpcSpan<f32>, IpcSpan<u64>, IpcSpan<u8>);

impl IpcArrays {
    /// Keys only (contains, erase without flags).
    pub fn keys(keys: IpcSpan<u64>) -> IpcArrays {
        IpcArrays { keys, values: None, grads: None, found: None, scores: None, lost: None }
    }
}

/// How a request on client memory is ordered with the client's own work
/// ([`CudaTable::run_ipc`]).
#[derive(Default)]
pub struct IpcOrder<'a> {
    /// The stream waits for this event before the first read of the arrays.
    pub wait: Option<&'a IpcEvent>,
    /// Recorded on the stream after the last write into the arrays.
    pub done: Option<&'a IpcEvent>,
    /// Called once the batch is queued on the GPU (and `done` recorded),
    /// before it has run: a caller may answer its client then.
    pub queued: Option<Box<dyn FnOnce() + Send + 'a>>,
}

/// One shard's part of a batch that every shard of a table reads in place:
/// the keys `hash::shard_of(key, shards) == shard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcPart {
    /// This shard.
    pub shard: u32,
    /// The table's shards.
    pub shards: u32,
}

impl CudaTable {
    /// Runs `op` (find, contains, erase, insert_or_assign, assign,
    /// accum_or_assign, find_or_insert, insert_and_evict or
    /// apply_gradients) on the keys of `a`, in the
    /// client's memory, under the op's lock group; a find writes misses as
    /// rows of zeros. With `part`, only the keys of that shard are served
    /// and nothing of the others is written (not for insert_and_evict, whose
    /// outputs are compacted, nor a find with scores). With `wait`, the
    /// stream waits for that event before the first read of `a`; with
    /// `done`, it records that event after the last write into `a`.
    /// Without `part`, a write checks the keys on the device and refuses
    /// the batch whole ([`Error::ReservedKey`], nothing written) when one
    /// is a reserved marker: a refusal known only once the batch ran, after
    /// `order.queued` was called (with a part, the caller checks the whole batch
    /// first: [`CudaTable::check_ipc_keys`]); a find or contains answers
    /// such keys as misses. `order.queued` is called once the batch is on
    /// the GPU's queue. Returns when the batch is done, with its counts.
    pub fn run_ipc(&self, op: DeviceOp, a: &IpcArrays, part: Option<IpcPart>, order: IpcOrder<'_>) -> Result<Counts> {
        let IpcOrder { wait, done, queued } = order;
        let n = a.keys.len();
        if part.is_some() && (op == DeviceOp::InsertAndEvict || a.scores.is_some()) {
            return Err(Error::Config(format!("{op:?} with compacted outputs or scores is not served in parts")));
        }
        let dim = self.config.dim;
        let writes = !matches!(op, DeviceOp::Find | DeviceOp::Contains);
        let want = |what: &str, have: Option<usize>, need: usize| match have {
            Some(h) if h == need => Ok(()),
            Some(h) => Err(Error::Config(format!("{what}: {h} elements for {n} keys (need {need})"))),
            None => Err(Error::Config(format!("{op:?} on client memory needs its {what}"))),
        };
        let values = a.values.as_ref().map(IpcSpan::len);
        match op {
            DeviceOp::Find => {
                want("values", values, n * dim)?;
                want("found flags", a.found.as_ref().map(IpcSpan::len), n)?;
            }
            DeviceOp::Contains => want("found flags", a.found.as_ref().map(IpcSpan::len), n)?,
            DeviceOp::Erase => {}
            DeviceOp::InsertOrAssign | DeviceOp::Assign | DeviceOp::FindOrInsert | DeviceOp::AccumOrAssign => {
                want("values", values, n * dim)?
            }
            DeviceOp::ApplyGradients(step) => {
                crate::optim::check_step(dim, &step)?;
                want("gradients", a.grads.as_ref().map(IpcSpan::len), n * step.dim)?;
                if values.is_some() {
                    want("updated values", values, n * step.dim)?;
                }
                if let Some(f) = &a.found {
                    want("found flags", Some(f.len()), n)?;
                }
            }
            DeviceOp::InsertAndEvict => {
                want("values", values, n * dim)?;
                let Some(l) = &a.lost else {
                    return Err(Error::Config("insert_and_evict needs its evicted arrays".into()));
                };
                for (what, have, need) in [
                    ("evicted keys", l.0.len(), n),
                    ("evicted values", l.1.len(), n * dim),
                    ("evicted scores", l.2.len(), n),
                    ("evicted kinds", l.3.len(), n),
                ] {
                    want(what, Some(have), need)?;
                }
            }
            _ => return Err(Error::Config(format!("{op:?} does not run on client memory"))),
        }
        if let Some(s) = &a.scores {
            want("scores", Some(s.len()), n)?;
        }
        let ordinal = self.dev.info.ordinal;
        let mut mems = vec![a.keys.mem(), a.values.as_ref().map_or(a.keys.mem(), IpcSpan::mem)];
        mems.extend(a.grads.as_ref().map(IpcSpan::mem));
        mems.extend(a.found.as_ref().map(IpcSpan::mem));
        mems.extend(a.scores.as_ref().map(IpcSpan::mem));
        if let Some(l) = &a.lost {
            mems.extend([l.0.mem(), l.1.mem(), l.2.mem(), l.3.mem()]);
        }
        if let Some(m) = mems.into_iter().find(|m| !m.reachable_from(ordinal)) {
            return Err(Error::Config(format!(
                "client memory on GPU {} is out of reach of a table on GPU {ordinal} (no peer access)",
                m.ordinal()
            )));
        }
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let mut l = self.lane()?;
        let s = l.stream.clone();
        if let Some(e) = wait {
            e.wait_on(&s)?;
        }
        // A write of the whole batch: its keys scanned for reserved markers
        // on the device, and the batch's key filter made from the scan, so
        // that a refused batch changes nothing and nothing waits for the
        // scan (the refusal is reported when the batch is done).
        let gate = writes && n > 0 && part.is_none();
        let only = match part {
            Some(p) if n > 0 => Some(self.shard_mask(&mut l, &a.keys, p)?),
            _ if gate => Some(self.reserved_gate(&mut l, &a.keys)?),
            _ => None,
        };
        self.zero_counters(&mut l)?;
        // apply_gradients reads its gradients where other writes read
        // their rows, and writes the updated values as its own output.
        let (values, updated) = match op {
            DeviceOp::ApplyGradients(_) => (a.grads.as_ref().map(IpcSpan::ptr), a.values.as_ref().map(IpcSpan::ptr)),
            _ => (a.values.as_ref().map(IpcSpan::ptr), None),
        };
        let raw = Raw {
            p: Ptrs {
                keys: Some(a.keys.ptr()),
                values,
                updated,
                found: a.found.as_ref().map(IpcSpan::ptr),
                scores: a.scores.as_ref().map(IpcSpan::ptr),
                lost: a.lost.as_ref().map(|(k, v, sc, kd)| LostPtrs {
                    keys: k.ptr(),
                    values: v.ptr(),
                    scores: sc.ptr(),
                    kinds: kd.ptr(),
                }),
                counters: Some(DevPtr::of(&l.counters, &s)),
                only,
                zero_misses: true,
                ..Ptrs::default()
            },
            export: None,
        };
        // SAFETY: every address is a checked span of an allocation opened
        // for this process (`IpcMem`, kept open by `a` until after the
        // stream is synchronised below) or the lane's own counters; each
        // holds what the op's kernel needs for n keys (checked above).
        let pending = unsafe { self.enqueue(op, &s, n, raw) }?;
        if let Some(e) = done {
            e.record(&s)?;
        }
        let early = queued.is_some();
        if let Some(q) = queued {
            q();
        }
        // SAFETY: the counters buffer holds NCOUNTERS values and lives as long as the lane.
        let r = unsafe { l.stage.fetch(&s, ptr(&l.counters, &s), NCOUNTERS) }?;
        let scan = match gate {
            // SAFETY: the scan's word, the lane's offsets buffer (reserved_gate).
            true => Some(unsafe { l.stage.fetch::<u64>(&s, opt_ptr(&l.offsets, &s), 1) }?),
            false => None,
        };
        l.stage.sync(&s)?;
        let c = l.stage.read(&r).to_vec();
        let found = scan.map_or(0, |r| l.stage.read(&r)[0]);
        let counts = self.complete(pending, &c);
        if early {
            // The client has its answer: the next batch on this lane need
            // not clear the counters before its kernels.
            self.clear_counters_behind(&mut l);
        }
        self.put_lane(l);
        if found != 0 {
            return Err(self.reserved_key(&a.keys, found)?);
        }
        Ok(counts)
    }

    /// Refuses `keys` ([`Error::ReservedKey`]) when one is a reserved
    /// marker, scanning them on the device: what [`CudaTable::run_ipc`] does
    /// before a write, for a batch that every shard then serves in parts.
    pub fn check_ipc_keys(&self, keys: &IpcSpan<u64>) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        self.dev.ctx.bind_to_thread().map_err(dev_err("binding the device's context"))?;
        let mut l = self.lane()?;
        let r = self.refuse_reserved(&mut l, keys);
        self.put_lane(l);
        r
    }

    /// The mask of `part`'s keys, in the lane's second flag buffer.
    fn shard_mask(&self, l: &mut Lane, keys: &IpcSpan<u64>, part: IpcPart) -> Result<DevPtr<u8>> {
        let s = l.stream.clone();
        let n = keys.len() as u64;
        ensure(&s, &mut l.flags2, keys.len())?;
        let mask = DevPtr::of(l.flags2.as_ref().expect("ensured"), &s).take(keys.len());
        let (k, m) = (keys.ptr().addr(), mask.addr());
        let mut b = s.launch_builder(&self.f.shard_mask);
        b.arg(&k).arg(&n).arg(&part.shards).arg(&part.shard).arg(&m);
        // SAFETY: reads keys[0..n] (a checked span of an open allocation),
        // writes mask[0..n] (the lane's buffer, ensured for n).
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching shard_mask"))?;
        Ok(mask)
    }

    /// Scans `keys` on the device for reserved markers; the first one found
    /// refuses the batch.
    fn refuse_reserved(&self, l: &mut Lane, keys: &IpcSpan<u64>) -> Result<()> {
        let s = l.stream.clone();
        let o = self.k_keys_reserved(l, keys)?;
        // SAFETY: `o` holds one u64 of the lane, alive until the lane goes.
        let r = unsafe { l.stage.fetch::<u64>(&s, o, 1) }?;
        l.stage.sync(&s)?;
        match l.stage.read(&r)[0] {
            0 => Ok(()),
            found => Err(self.reserved_key(keys, found)?),
        }
    }

    /// Queues the scan of `keys` for reserved markers into the lane's
    /// offsets word (`keys_reserved`: n − the first one's index, 0 when
    /// none); returns the word's address.
    fn k_keys_reserved(&self, l: &mut Lane, keys: &IpcSpan<u64>) -> Result<u64> {
        let s = l.stream.clone();
        let n = keys.len() as u64;
        ensure(&s, &mut l.offsets, 1)?;
        let out = l.offsets.as_mut().expect("ensured");
        s.memset_zeros(out).map_err(dev_err("clearing the key scan"))?;
        let o = ptr(out, &s);
        let k = keys.ptr().addr();
        let mut b = s.launch_builder(&self.f.keys_reserved);
        b.arg(&k).arg(&n).arg(&o);
        // SAFETY: reads keys[0..n] (a checked span of an open allocation)
        // and writes out[0], the lane's buffer of at least one u64.
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching keys_reserved"))?;
        Ok(o)
    }

    /// The scan of `keys` ([`CudaTable::k_keys_reserved`]) and, after it,
    /// the batch's key filter in the lane's second flag buffer: every key
    /// when none is reserved, none when one is. Nothing waits.
    fn reserved_gate(&self, l: &mut Lane, keys: &IpcSpan<u64>) -> Result<DevPtr<u8>> {
        let s = l.stream.clone();
        let n = keys.len() as u64;
        let o = self.k_keys_reserved(l, keys)?;
        ensure(&s, &mut l.flags2, keys.len())?;
        let mask = DevPtr::of(l.flags2.as_ref().expect("ensured"), &s).take(keys.len());
        let m = mask.addr();
        let mut b = s.launch_builder(&self.f.keys_gate);
        b.arg(&o).arg(&n).arg(&m);
        // SAFETY: reads the scan's word (the lane's, written before on this
        // stream) and writes mask[0..n] (the lane's buffer, ensured for n).
        unsafe { b.launch(blocks(n)?) }.map_err(dev_err("launching keys_gate"))?;
        Ok(mask)
    }

    /// The refusal of `keys` whose scan found `found` (n − the first
    /// reserved key's index): that key, read from the client's memory.
    fn reserved_key(&self, keys: &IpcSpan<u64>, found: u64) -> Result<Error> {
        let index = (keys.len() as u64 - found) as usize;
        let mut key = [0u64];
        keys.mem().read(keys.ptr().addr() - keys.mem().addr() + 8 * index as u64, &mut key)?;
        Ok(Error::ReservedKey { key: key[0], index })
    }
}
