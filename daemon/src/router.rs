//! The router: tables spread over every shard actor. A batch is split by
//! `hkv_shard::hash::shard_of` (a mix independent of the bucket hashes), the
//! sub-batches run concurrently on their actors, and the answers are put back
//! in request order.

use std::collections::HashMap;
use std::sync::Arc;

use actix::Addr;
use futures::future::join_all;
use hkv_proto::{op, Cursor, ErrorCode, Evicted, ProtoError, Request, Response, Summary, TableInfo, TableSpec};
use hkv_shard::hash::shard_of;
use hkv_shard::{Backend, BucketMode, Error as ShardError, Filter, Outcome, ScorePolicy, Shard, TableConfig};
use parking_lot::RwLock;

use crate::actor::{Call, Create, ShardActor, SubOp, SubResult};
use crate::features::Hasher;

/// A table: its spec, the per-shard config, and one shard per actor.
pub struct Table {
    /// As created.
    pub spec: TableSpec,
    /// Each shard's config.
    pub config: TableConfig,
    /// Shard `i` lives on actor `i`.
    pub shards: Vec<Arc<dyn Shard>>,
}

/// Maps tables and keys to shard actors.
pub struct Router {
    actors: Vec<Addr<ShardActor>>,
    backend: Backend,
    tables: RwLock<HashMap<String, Arc<Table>>>,
    /// Feature hashing (GPU when present).
    pub hasher: Arc<Hasher>,
}

fn err(code: ErrorCode, msg: impl Into<String>) -> ProtoError {
    ProtoError::new(code, msg)
}

/// Maps a shard error to the wire error with the matching code.
pub fn shard_error(e: ShardError) -> ProtoError {
    let code = match &e {
        ShardError::ReservedKey { .. } => ErrorCode::ReservedKey,
        ShardError::Length { what: "values" | "deltas", .. } => ErrorCode::WrongDim,
        ShardError::Length { .. } => ErrorCode::LengthMismatch,
        ShardError::ScoresNotAccepted { .. } | ShardError::ScoresRequired { .. } => ErrorCode::Scores,
        ShardError::Config(_) | ShardError::Capacity { .. } => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    };
    ProtoError::new(code, e.to_string())
}

/// Validates a table name: 1..=255 bytes of `[A-Za-z0-9_.-]`.
pub fn check_name(name: &str) -> Result<(), ProtoError> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ProtoError::bad_request(format!("table name {name:?}: use 1 to 255 letters, digits, '_', '-' or '.'")))
    }
}

/// The per-shard config of a table spec spread over `n` shards.
pub fn shard_config(spec: &TableSpec, n: usize) -> Result<TableConfig, ProtoError> {
    let policy: ScorePolicy = spec.policy.parse().map_err(|e: ShardError| ProtoError::bad_request(e.to_string()))?;
    let mode = match spec.mode.as_str() {
        "single" => BucketMode::Single,
        "dual" => BucketMode::Dual,
        m => return Err(ProtoError::bad_request(format!("mode {m:?}: use single or dual"))),
    };
    let per = |x: u64| x.div_ceil(n as u64);
    let config = TableConfig {
        capacity: per(spec.capacity),
        max_capacity: per(spec.max_capacity),
        max_load_factor: spec.max_load_factor.unwrap_or(0.5),
        dim: spec.dim,
        policy,
        mode,
        fast_tier_bytes: spec.fast_tier_bytes.map(per),
    };
    config.validate().map_err(|e| ProtoError::bad_request(e.to_string()))?;
    Ok(config)
}

/// Which shard each key goes to: per shard, the request indices.
fn split(keys: &[u64], n: usize) -> Vec<Vec<u32>> {
    let mut parts: Vec<Vec<u32>> = (0..n).map(|_| Vec::with_capacity(keys.len() / n + 16)).collect();
    for (i, &k) in keys.iter().enumerate() {
        parts[shard_of(k, n as u64) as usize].push(i as u32);
    }
    parts
}

fn gather<T: Copy>(src: &[T], idx: &[u32], width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(idx.len() * width);
    for &i in idx {
        let i = i as usize;
        out.extend_from_slice(&src[i * width..(i + 1) * width]);
    }
    out
}

fn scatter<T: Copy>(dst: &mut [T], idx: &[u32], src: &[T], width: usize) {
    for (j, &i) in idx.iter().enumerate() {
        let i = i as usize;
        dst[i * width..(i + 1) * width].copy_from_slice(&src[j * width..(j + 1) * width]);
    }
}

fn to_wire(s: hkv_shard::Summary) -> Summary {
    Summary { updated: s.updated, inserted: s.inserted, evicted: s.evicted, rejected: s.rejected, absent: s.absent }
}

impl Router {
    /// A router over these actors (one per device / CPU shard); feature
    /// batches are hashed on GPU `hash_gpu` when given.
    pub fn new(actors: Vec<Addr<ShardActor>>, backend: Backend, hash_gpu: Option<usize>) -> Router {
        let hasher = Arc::new(Hasher::new(hash_gpu));
        Router { actors, backend, tables: RwLock::new(HashMap::new()), hasher }
    }

    /// Shards per table.
    pub fn shards(&self) -> usize {
        self.actors.len()
    }

    /// Every table, by name.
    pub fn tables(&self) -> Vec<Arc<Table>> {
        let mut v: Vec<_> = self.tables.read().values().cloned().collect();
        v.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        v
    }

    /// A table by name.
    pub fn table(&self, name: &str) -> Result<Arc<Table>, ProtoError> {
        self.tables.read().get(name).cloned().ok_or_else(|| {
            err(ErrorCode::UnknownTable, format!("no table named {name:?}; create it first (hkvctl create-table)"))
        })
    }

    /// The listing of a table.
    pub fn info(t: &Table) -> TableInfo {
        TableInfo {
            spec: t.spec.clone(),
            size: t.shards.iter().map(|s| s.size()).sum(),
            capacity: t.shards.iter().map(|s| s.capacity()).sum(),
            shards: t.shards.len() as u32,
        }
    }

    /// Creates a table on every actor.
    pub async fn create_table(&self, spec: TableSpec) -> Result<TableInfo, ProtoError> {
        check_name(&spec.name)?;
        if let Some(h) = &spec.hash {
            crate::features::check(h)?;
        }
        if self.tables.read().contains_key(&spec.name) {
            return Err(err(ErrorCode::TableExists, format!("table {:?} exists; drop it first", spec.name)));
        }
        let config = shard_config(&spec, self.actors.len())?;
        let created =
            join_all(self.actors.iter().map(|a| a.send(Create { config: config.clone(), backend: self.backend })))
                .await;
        let mut shards = Vec::with_capacity(created.len());
        for r in created {
            let shard = r.map_err(|e| err(ErrorCode::Internal, format!("shard actor gone: {e}")))?;
            shards.push(shard.map_err(shard_error)?);
        }
        let table = Arc::new(Table { spec: spec.clone(), config, shards });
        let mut tables = self.tables.write();
        if tables.contains_key(&spec.name) {
            return Err(err(ErrorCode::TableExists, format!("table {:?} exists; drop it first", spec.name)));
        }
        tables.insert(spec.name.clone(), table.clone());
        Ok(Self::info(&table))
    }

    /// Drops a table; requests already running on it finish first.
    pub fn drop_table(&self, name: &str) -> Result<(), ProtoError> {
        self.tables
            .write()
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| err(ErrorCode::UnknownTable, format!("no table named {name:?}")))
    }

    async fn call(&self, table: &Table, i: usize, op: SubOp) -> Result<SubResult, ProtoError> {
        self.actors[i]
            .send(Call { shard: table.shards[i].clone(), op })
            .await
            .map_err(|e| err(ErrorCode::Internal, format!("shard {i} actor gone: {e}")))?
            .map_err(|e| {
                // A device failure (out of memory, a lost GPU) fails the
                // requests that touched that shard, and says which one.
                let device = matches!(e, ShardError::Device(_));
                let mut pe = shard_error(e);
                if device {
                    pe.message = format!("shard {i}: {}", pe.message);
                }
                pe
            })
    }

    /// Runs one sub-op per shard (in parallel) and returns the results in shard order.
    async fn fan_out(&self, table: &Table, ops: Vec<SubOp>) -> Result<Vec<SubResult>, ProtoError> {
        join_all(ops.into_iter().enumerate().map(|(i, op)| self.call(table, i, op))).await.into_iter().collect()
    }

    /// Checks a keyed request before any shard sees it, so that a bad batch
    /// is refused whole. `inserts`: Custom tables need scores. `verbatim`:
    /// scores are stored as given (load), whatever the policy.
    fn validate(
        t: &Table,
        keys: &[u64],
        values: Option<&[f32]>,
        scores: Option<&[u64]>,
        inserts: bool,
        verbatim: bool,
    ) -> Result<(), ProtoError> {
        let n = keys.len();
        if let Some(i) = keys.iter().position(|&k| hkv_shard::is_reserved(k)) {
            return Err(shard_error(ShardError::ReservedKey { key: keys[i], index: i }));
        }
        if let Some(v) = values {
            if v.len() != n * t.config.dim {
                return Err(err(
                    ErrorCode::WrongDim,
                    format!(
                        "{} floats for {n} keys, but table {:?} has dim {} and needs {}",
                        v.len(),
                        t.spec.name,
                        t.config.dim,
                        n * t.config.dim
                    ),
                ));
            }
        }
        let policy = t.config.policy;
        match scores {
            Some(s) if s.len() != n => {
                Err(err(ErrorCode::LengthMismatch, format!("{} scores for {n} keys; send one score per key", s.len())))
            }
            Some(_) if !policy.takes_scores() && !verbatim => {
                Err(shard_error(ShardError::ScoresNotAccepted { policy }))
            }
            None if inserts && policy == ScorePolicy::Custom => Err(shard_error(ShardError::ScoresRequired { policy })),
            _ => Ok(()),
        }
    }

    /// Executes a feature request: hash (on the GPU when present), then,
    /// for the fused ops, find or find_or_insert with the keys.
    pub async fn features(&self, req: Request) -> Result<Response, ProtoError> {
        let (table, hash) = match &req {
            Request::Hash { table, hash, .. }
            | Request::FindFeatures { table, hash, .. }
            | Request::FindOrInsertFeatures { table, hash, .. } => (table, hash),
            _ => return Err(err(ErrorCode::Internal, "not a feature request")),
        };
        let t = if table.is_empty() && matches!(req, Request::Hash { .. }) { None } else { Some(self.table(table)?) };
        let (kind, num_buckets) = crate::features::resolve(hash.clone(), t.as_deref())?;
        // Values, scores and dim are checked by find / find_or_insert below,
        // before anything is applied; hashing changes nothing.
        let hasher = self.hasher.clone();
        let (keys, req) = tokio::task::spawn_blocking(move || {
            let r = match &req {
                Request::Hash { features, .. }
                | Request::FindFeatures { features, .. }
                | Request::FindOrInsertFeatures { features, .. } => hasher.hash(features, kind, num_buckets),
                _ => unreachable!("checked above"),
            };
            (r, req)
        })
        .await
        .map_err(|e| err(ErrorCode::Internal, format!("hashing task failed: {e}")))?;
        let keys = keys?;
        match req {
            Request::Hash { .. } => Ok(Response::Keys(keys)),
            Request::FindFeatures { table, scores, .. } => self.execute(Request::Find { table, keys, scores }).await,
            Request::FindOrInsertFeatures { table, values, scores, outcomes, .. } => {
                self.execute(Request::Write { op: op::FIND_OR_INSERT, table, keys, values, scores, outcomes }).await
            }
            _ => unreachable!("checked above"),
        }
    }

    /// Executes a table request.
    pub async fn execute(&self, req: Request) -> Result<Response, ProtoError> {
        let t = self.table(req.table().unwrap_or_default())?;
        let n_shards = t.shards.len();
        let dim = t.config.dim;
        match req {
            Request::Find { keys, scores, .. } => {
                Self::validate(&t, &keys, None, None, false, false)?;
                let n = keys.len();
                if n_shards == 1 {
                    // One shard (one GPU): its answer is already in request order.
                    let SubResult::Find { found, values, scores } =
                        self.call(&t, 0, SubOp::Find { keys, scores }).await?
                    else {
                        unreachable!()
                    };
                    return Ok(Response::Find { found: found.into_iter().map(u8::from).collect(), values, scores });
                }
                let parts = split(&keys, n_shards);
                let ops = parts.iter().map(|p| SubOp::Find { keys: gather(&keys, p, 1), scores }).collect();
                let mut found = vec![0u8; n];
                let mut values = vec![0.0f32; n * dim];
                let mut sc = scores.then(|| vec![0u64; n]);
                for (p, r) in parts.iter().zip(self.fan_out(&t, ops).await?) {
                    let SubResult::Find { found: f, values: v, scores: s } = r else { unreachable!() };
                    for (j, &i) in p.iter().enumerate() {
                        found[i as usize] = f[j] as u8;
                    }
                    scatter(&mut values, p, &v, dim);
                    if let (Some(dst), Some(s)) = (sc.as_mut(), s) {
                        scatter(dst, p, &s, 1);
                    }
                }
                Ok(Response::Find { found, values, scores: sc })
            }
            Request::Contains { keys, .. } => {
                Self::validate(&t, &keys, None, None, false, false)?;
                let parts = split(&keys, n_shards);
                let ops = parts.iter().map(|p| SubOp::Contains { keys: gather(&keys, p, 1) }).collect();
                let found = self.flags(&t, &parts, ops, keys.len()).await?;
                Ok(Response::Contains { found })
            }
            Request::Erase { keys, outcomes, .. } => {
                Self::validate(&t, &keys, None, None, false, false)?;
                let parts = split(&keys, n_shards);
                let ops = parts.iter().map(|p| SubOp::Erase { keys: gather(&keys, p, 1) }).collect();
                let flags = self.flags(&t, &parts, ops, keys.len()).await?;
                let count = flags.iter().filter(|&&f| f == 1).count() as u64;
                Ok(Response::Erased { count, flags: outcomes.then_some(flags) })
            }
            Request::Write { op: code, keys, values, scores, outcomes, .. } => {
                let inserts = code != op::ASSIGN;
                Self::validate(&t, &keys, Some(&values), scores.as_deref(), inserts, code == op::LOAD)?;
                if code == op::LOAD && scores.is_none() {
                    return Err(err(
                        ErrorCode::LengthMismatch,
                        "load needs a score per key (sent with the SCORES flag)",
                    ));
                }
                let n = keys.len();
                if n_shards == 1 {
                    // One shard: the batch goes as it came, no gather.
                    let parts = vec![(0..n as u32).collect::<Vec<u32>>()];
                    let ops = vec![SubOp::Write { op: code, keys, values, scores }];
                    return self.writes(&t, &parts, ops, n, outcomes, code).await;
                }
                let parts = split(&keys, n_shards);
                let ops = parts
                    .iter()
                    .map(|p| SubOp::Write {
                        op: code,
                        keys: gather(&keys, p, 1),
                        values: gather(&values, p, dim),
                        scores: scores.as_ref().map(|s| gather(s, p, 1)),
                    })
                    .collect();
                self.writes(&t, &parts, ops, n, outcomes, code).await
            }
            Request::AssignScores { keys, scores, outcomes, .. } => {
                Self::validate(&t, &keys, None, scores.as_deref(), false, false)?;
                let parts = split(&keys, n_shards);
                let ops = parts
                    .iter()
                    .map(|p| SubOp::AssignScores {
                        keys: gather(&keys, p, 1),
                        scores: scores.as_ref().map(|s| gather(s, p, 1)),
                    })
                    .collect();
                self.writes(&t, &parts, ops, keys.len(), outcomes, op::ASSIGN_SCORES).await
            }
            Request::EraseIf { filter, .. } => {
                let f = to_filter(filter);
                let ops = (0..n_shards).map(|_| SubOp::EraseIf(f)).collect();
                let mut count = 0;
                for r in self.fan_out(&t, ops).await? {
                    if let SubResult::Count(c) = r {
                        count += c;
                    }
                }
                Ok(Response::Erased { count, flags: None })
            }
            Request::Clear { .. } => {
                self.fan_out(&t, (0..n_shards).map(|_| SubOp::Clear).collect()).await?;
                Ok(Response::Empty)
            }
            Request::SetEpoch { epoch, .. } => {
                self.fan_out(&t, (0..n_shards).map(|_| SubOp::SetEpoch(epoch)).collect()).await?;
                Ok(Response::Empty)
            }
            Request::Reserve { capacity, .. } => {
                let per = capacity.div_ceil(n_shards as u64);
                self.fan_out(&t, (0..n_shards).map(|_| SubOp::Reserve(per)).collect()).await?;
                Ok(Response::Empty)
            }
            Request::Export { cursor, max_slots, filter, .. } => {
                let i = cursor.shard as usize;
                if i >= n_shards {
                    return Err(ProtoError::bad_request(format!(
                        "export cursor shard {i}: the table has {n_shards} shards"
                    )));
                }
                let max_slots = max_slots.clamp(1, 1 << 24);
                let op = SubOp::Export { offset: cursor.offset, n: max_slots, filter: to_filter(filter) };
                let SubResult::Export(e) = self.call(&t, i, op).await? else { unreachable!() };
                let end = cursor.offset.saturating_add(max_slots);
                let next = if end < t.shards[i].capacity() {
                    Some(Cursor { shard: i as u32, offset: end })
                } else if i + 1 < n_shards {
                    Some(Cursor { shard: i as u32 + 1, offset: 0 })
                } else {
                    None
                };
                Ok(Response::Export { next, keys: e.keys, values: e.values, scores: e.scores })
            }
            other => Err(ProtoError::bad_request(format!(
                "{} is not a table operation",
                hkv_proto::msg::op_name(other.op())
            ))),
        }
    }

    async fn flags(&self, t: &Table, parts: &[Vec<u32>], ops: Vec<SubOp>, n: usize) -> Result<Vec<u8>, ProtoError> {
        let mut out = vec![0u8; n];
        for (p, r) in parts.iter().zip(self.fan_out(t, ops).await?) {
            let SubResult::Flags(f) = r else { unreachable!() };
            for (j, &i) in p.iter().enumerate() {
                out[i as usize] = f[j] as u8;
            }
        }
        Ok(out)
    }

    async fn writes(
        &self,
        t: &Table,
        parts: &[Vec<u32>],
        ops: Vec<SubOp>,
        n: usize,
        want_outcomes: bool,
        code: u8,
    ) -> Result<Response, ProtoError> {
        let dim = t.config.dim;
        let mut summary = Summary::default();
        let mut outcomes = vec![Outcome::Absent as u8; if want_outcomes { n } else { 0 }];
        let mut values = (code == op::FIND_OR_INSERT).then(|| vec![0.0f32; n * dim]);
        let mut evicted = (code == op::INSERT_AND_EVICT).then(Evicted::default);
        for (p, r) in parts.iter().zip(self.fan_out(t, ops).await?) {
            let SubResult::Write { summary: s, outcomes: o, values: v, evicted: e } = r else { unreachable!() };
            summary += to_wire(s);
            if want_outcomes && !o.is_empty() {
                for (j, &i) in p.iter().enumerate() {
                    outcomes[i as usize] = o[j] as u8;
                }
            }
            if let (Some(dst), Some(v)) = (values.as_mut(), v) {
                scatter(dst, p, &v, dim);
            }
            if let (Some(dst), Some(e)) = (evicted.as_mut(), e) {
                dst.keys.extend_from_slice(&e.keys);
                dst.values.extend_from_slice(&e.values);
                dst.scores.extend_from_slice(&e.scores);
                dst.kinds.extend(e.kinds.iter().map(|k| *k as u8));
            }
        }
        Ok(Response::Write { summary, outcomes: want_outcomes.then_some(outcomes), values, evicted })
    }
}

fn to_filter(f: hkv_proto::Filter) -> Filter {
    Filter { key_mask: f.key_mask, key_pattern: f.key_pattern, min_score: f.min_score, max_score: f.max_score }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_gather_scatter_restore_order() {
        let keys: Vec<u64> = (0..1000).collect();
        let parts = split(&keys, 3);
        assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), 1000);
        let mut back = vec![0u64; 1000];
        for p in &parts {
            let sub = gather(&keys, p, 1);
            assert!(sub.iter().all(|&k| shard_of(k, 3) == shard_of(sub[0], 3)));
            scatter(&mut back, p, &sub, 1);
        }
        assert_eq!(back, keys);
    }

    #[test]
    fn names_and_configs_are_checked() {
        assert!(check_name("emb_v2.users-1").is_ok());
        assert!(check_name("").is_err() && check_name("a b").is_err() && check_name(&"x".repeat(256)).is_err());
        let c = shard_config(&TableSpec::new("t", 8, 1000), 4).unwrap();
        assert_eq!(c.capacity, 250);
        let mut bad = TableSpec::new("t", 8, 1000);
        bad.policy = "fifo".into();
        assert!(shard_config(&bad, 1).unwrap_err().message.contains("fifo"));
    }
}
