//! Table commands: `create-table`, `drop-table`, `tables`.

use anyhow::Result;
use hkv_client::{proto, Client, TableSpec};

use crate::features::{feature_hash, name};

/// The flags of `create-table`.
#[derive(clap::Args)]
pub struct CreateTable {
    /// Table name (letters, digits, '_', '-', '.').
    pub name: String,
    /// f32 elements per value.
    #[arg(long)]
    pub dim: usize,
    /// Slots over all shards.
    #[arg(long)]
    pub capacity: u64,
    /// lru, lfu, epoch-lru, epoch-lfu, custom or adaptive.
    #[arg(long, default_value = "lru", value_parser = name::<proto::Policy>)]
    pub policy: proto::Policy,
    /// Policy lfu only: which of equal frequencies goes, lru (least
    /// recently written; the default) or lowest-slot (the reference's rule;
    /// scores are plain frequencies).
    #[arg(long, value_parser = name::<proto::LfuTies>)]
    pub lfu_ties: Option<proto::LfuTies>,
    /// The optimizer apply_gradients runs in the table (sgd, adagrad,
    /// rowwise_adagrad or adam): each row stores its state after the values.
    #[arg(long, value_parser = name::<proto::Optimizer>)]
    pub optimizer: Option<proto::Optimizer>,
    /// Whether find hits refresh scores (true or false); default: on for
    /// adaptive and for a table with --backing (not custom), off for the
    /// others.
    #[arg(long)]
    pub reads_refresh: Option<bool>,
    /// Dual-bucket mode (fills to ~98 % before evicting).
    #[arg(long)]
    pub dual: bool,
    /// Growth limit (slots); 0: no growth.
    #[arg(long, default_value_t = 0)]
    pub max_capacity: u64,
    /// The load (size / capacity) past which a table with --max-capacity
    /// grows, in (0, 1]; default 0.5.
    #[arg(long, value_parser = load_factor)]
    pub max_load_factor: Option<f64>,
    /// Device-memory budget for values in bytes (CUDA); default: all.
    #[arg(long)]
    pub fast_tier_bytes: Option<u64>,
    /// Default feature hash of the table: fingerprint64 or strong (needs --num-buckets).
    #[arg(long, value_parser = name::<proto::HashKind>)]
    pub hash: Option<proto::HashKind>,
    /// Default num_buckets of feature requests (keys = hash % num_buckets).
    #[arg(long)]
    pub num_buckets: Option<u64>,
    /// SipHash key of the strong hash: K0,K1 (needs --hash strong).
    #[arg(long, value_delimiter = ',')]
    pub hash_key: Option<Vec<u64>>,
    /// Seed nodes of a Redis Cluster behind the table: URL[,URL...]
    /// (redis://HOST:PORT or HOST:PORT); misses are read from it.
    #[arg(long)]
    pub backing: Option<String>,
    /// How writes reach the cluster: read-only, write-through or
    /// write-back (needs --backing).
    #[arg(long, value_parser = name::<proto::BackingMode>)]
    pub backing_mode: Option<proto::BackingMode>,
    /// Replicas of each master that must acknowledge a write (Redis
    /// `WAIT`) before it counts as written (needs --backing).
    #[arg(long)]
    pub backing_wait_replicas: Option<u32>,
    /// How long a read of cache misses waits for the cluster, ms (1 to
    /// 60000; default 250; needs --backing).
    #[arg(long)]
    pub backing_deadline_ms: Option<u64>,
    /// The write-back queue's bound in bytes (default 64 MiB; needs
    /// --backing).
    #[arg(long)]
    pub backing_queue_bytes: Option<u64>,
}

impl CreateTable {
    /// The first of the cluster's flags given without `--backing`: a usage
    /// error. (Not clap's `requires`: its usage line then listed the flag
    /// given as if it were required too.)
    pub fn without_backing(&self) -> Option<&'static str> {
        if self.backing.is_some() {
            return None;
        }
        [
            ("--backing-mode", self.backing_mode.is_some()),
            ("--backing-wait-replicas", self.backing_wait_replicas.is_some()),
            ("--backing-deadline-ms", self.backing_deadline_ms.is_some()),
            ("--backing-queue-bytes", self.backing_queue_bytes.is_some()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }
}

/// `hkvctl create-table`.
pub fn create(c: &mut Client, a: CreateTable) -> Result<()> {
    let CreateTable {
        name,
        dim,
        capacity,
        policy,
        lfu_ties,
        optimizer,
        reads_refresh,
        dual,
        max_capacity,
        max_load_factor,
        fast_tier_bytes,
        hash,
        num_buckets,
        hash_key,
        backing,
        backing_mode,
        backing_wait_replicas,
        backing_deadline_ms,
        backing_queue_bytes,
    } = a;
    let hash = feature_hash("--hash", &hash, num_buckets, &hash_key)?;
    // The tie rule is lfu's: another policy's table would list one it does
    // not follow (epoch-lfu always keeps the lowest slot).
    if lfu_ties.is_some() && policy != proto::Policy::Lfu {
        anyhow::bail!("--lfu-ties is for --policy lfu, not {}", policy.as_str());
    }
    // The growth threshold is for a table that grows.
    if max_load_factor.is_some() && max_capacity == 0 {
        anyhow::bail!("--max-load-factor is the load past which a table grows: give --max-capacity too");
    }
    // Only a write-back table has a queue to bound.
    let mode = backing_mode.unwrap_or_default();
    if backing_queue_bytes.is_some() && mode != proto::BackingMode::WriteBack {
        anyhow::bail!("--backing-queue-bytes bounds a write-back table's queue; this table is {}", mode.as_str());
    }
    let spec = TableSpec {
        max_capacity,
        policy,
        mode: if dual { proto::Mode::Dual } else { proto::Mode::Single },
        fast_tier_bytes,
        hash,
        lfu_ties: lfu_ties.unwrap_or_default(),
        max_load_factor,
        backing: backing.map(|list| proto::BackingSpec {
            wait_replicas: backing_wait_replicas,
            deadline_ms: backing_deadline_ms,
            queue_bytes: backing_queue_bytes,
            ..proto::BackingSpec::from_list(&list, mode)
        }),
        reads_refresh,
        optimizer,
        ..TableSpec::new(&name, dim, capacity)
    };
    let info = c.create_table(spec)?;
    match optimizer {
        Some(o) => println!(
            "created {name}: dim {dim} with {o} state (rows of {}), capacity {} over {}",
            info.row_dim(),
            info.capacity,
            shards(info.shards)
        ),
        None => println!("created {name}: dim {dim}, capacity {} over {}", info.capacity, shards(info.shards)),
    }
    Ok(())
}

/// `hkvctl tables`: one line per table; `--json`: the daemon's list.
pub fn list(c: &mut Client, json: bool) -> Result<()> {
    let tables = c.tables()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&tables)?);
        return Ok(());
    }
    let w = crate::render::name_width(tables.iter().map(|t| t.spec.name.as_str()));
    // 15: the longest optimizer name, rowwise_adagrad (it pushed the
    // backing column out of line at 14).
    println!(
        "{:<w$} {:>5} {:<9} {:<6} {:<7} {:>12} {:>12} {:>6} {:<15} backing",
        "table", "dim", "policy", "mode", "reads", "size", "capacity", "shards", "optimizer"
    );
    for t in tables {
        // The cluster a table is backed by, its password hidden (as the
        // daemon lists it): the mode, then the seeds.
        let backing = t.spec.backing.as_ref().map_or_else(
            || "-".to_string(),
            |b| {
                let b = b.redacted();
                format!("{} {}", b.mode.as_str(), b.seeds.join(","))
            },
        );
        println!(
            "{:<w$} {:>5} {:<9} {:<6} {:<7} {:>12} {:>12} {:>6} {:<15} {}",
            t.spec.name,
            t.spec.dim,
            t.spec.policy.as_str(),
            t.spec.mode.as_str(),
            // Whether find hits refresh scores (a daemon that predates the
            // field lists it only where the spec set it).
            match t.spec.reads_refresh {
                Some(true) => "refresh",
                Some(false) => "-",
                None => "?",
            },
            t.size,
            t.capacity,
            t.shards,
            t.spec.optimizer.map_or_else(|| "-".to_string(), |o| o.to_string()),
            backing
        );
    }
    Ok(())
}

/// A load factor in (0, 1] (`nan` and `inf` parse as floats, but JSON
/// carries neither: the daemon would have taken the default).
fn load_factor(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("{s:?} is not a load factor in (0, 1] (e.g. 0.75)")),
    }
}

/// "1 shard", "2 shards".
fn shards(n: u32) -> String {
    format!("{n} shard{}", if n == 1 { "" } else { "s" })
}
