//! Daemon configuration: a TOML file (`--config`) and flags; flags win.

use std::path::{Path, PathBuf};

use hkv_proto::TableSpec;
use serde::{Deserialize, Serialize};

/// Which backend the daemon runs on (`backend`, `--backend`), spelled
/// `auto`, `cpu` or `cuda` in the TOML file and on the command line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when a driver and a device answer, else the CPU.
    #[default]
    Auto,
    /// Host memory, every core.
    Cpu,
    /// The CUDA devices (`devices`, or every visible one); refused at start
    /// when none answers.
    Cuda,
}

impl BackendChoice {
    /// The spelling in the file and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<BackendChoice, String> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" => Ok(BackendChoice::Cuda),
            _ => Err(format!("backend {s:?}: use auto, cpu or cuda")),
        }
    }
}

/// Explicit limits, all enforced before allocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest frame body accepted, bytes.
    pub max_frame_bytes: u32,
    /// Requests of one connection executed at once; more wait (backpressure).
    pub max_in_flight: usize,
    /// Connections served at once; more are refused with `busy`.
    pub max_connections: usize,
    /// Seconds to wait for in-flight requests on shutdown.
    pub drain_seconds: u64,
    /// Bytes of sent answer frames kept for later find and echo answers to
    /// reuse (buffers of 1 MiB to 256 MiB, at most 16); 0 keeps none.
    /// Unset: 512 MiB on the CPU backend, 2 GiB on CUDA (page-locked there).
    pub frame_cache_bytes: Option<u64>,
    /// Bytes all tables may hold at their peak (their storage at
    /// max_capacity): device memory on CUDA, host memory on the CPU backend.
    /// Unset: 7/8 of the devices' memory on CUDA, 3/4 of host memory (or of
    /// the cgroup's limit) on the CPU backend.
    pub max_table_bytes: Option<u64>,
    /// Bytes of pinned host memory CUDA tables' host tiers may hold.
    /// Unset: half of host memory.
    pub max_host_tier_bytes: Option<u64>,
    /// Bytes of request bodies being received or run and of answers being
    /// built or sent, over every connection; a request past it is refused
    /// with `resource_exhausted`. At least max_frame_bytes.
    pub max_bytes_in_flight: u64,
    /// Seconds a started request body, or a started frame header, may go
    /// without a byte arriving before its connection is closed (its memory
    /// is freed).
    pub body_stall_seconds: u64,
    /// Seconds a connection with no request running may go without
    /// starting a frame, while at least half of `max_connections` are
    /// open, before it is closed (its slot, regions and events come
    /// back); 0 keeps idle connections open.
    pub idle_seconds: u64,
    /// Seconds a region request may wait for the client's `wait_event`
    /// before it is answered `timeout` (and nothing of it run).
    pub event_wait_seconds: u64,
    /// Bytes of registered regions (client memfds the daemon maps) over
    /// every connection; a registration past it gets `resource_exhausted`.
    pub max_region_bytes: u64,
    /// Bytes of registered regions of one connection.
    pub max_region_bytes_per_connection: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 1 << 30,
            max_in_flight: 64,
            max_connections: 1024,
            drain_seconds: 30,
            frame_cache_bytes: None,
            max_table_bytes: None,
            max_host_tier_bytes: None,
            max_bytes_in_flight: 4 << 30,
            body_stall_seconds: 30,
            idle_seconds: 300,
            event_wait_seconds: 60,
            max_region_bytes: 64 << 30,
            max_region_bytes_per_connection: 16 << 30,
        }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Socket path; default `$XDG_RUNTIME_DIR/hkvd/hkvd.sock` or `./hkvd-run/hkvd.sock`.
    pub socket: Option<PathBuf>,
    /// State directory (checkpoints); default `./hkvd-state`.
    pub state_dir: Option<PathBuf>,
    /// `auto`, `cpu` or `cuda`.
    pub backend: BackendChoice,
    /// Shard actors: CPU shards (default: the number of cores), or CUDA
    /// shards spread round-robin over the GPUs (default: one per GPU).
    pub shards: Option<usize>,
    /// CUDA devices to use (ordinals as CUDA numbers them after
    /// `CUDA_VISIBLE_DEVICES`); none = every visible device.
    pub devices: Option<Vec<usize>>,
    /// Threads per shard actor, so that readers and updaters of one shard can
    /// run together.
    pub threads_per_shard: usize,
    /// A group (name) whose members may run admin operations, besides the
    /// daemon's own user and root.
    pub admin_group: Option<String>,
    /// A group (name) whose members may connect and run table operations
    /// but not admin operations: the socket and its directory get this
    /// group instead of the admin group (admins then connect as members of
    /// it too). Unset: the socket's group is the admin group.
    pub client_group: Option<String>,
    /// Loopback address for a Prometheus HTTP listener, e.g. `127.0.0.1:9466`.
    pub metrics_listen: Option<String>,
    /// Limits.
    pub limits: Limits,
    /// Checkpoints.
    pub checkpoint: CheckpointConfig,
    /// Live miss-ratio curves (`[mrc]`).
    pub mrc: MrcSettings,
    /// What to restore at start: `latest`, a checkpoint id, or `none`.
    pub restore: String,
    /// Tables created at start.
    #[serde(rename = "table")]
    pub tables: Vec<TableSpec>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: None,
            state_dir: None,
            backend: BackendChoice::Auto,
            shards: None,
            devices: None,
            threads_per_shard: 4,
            admin_group: None,
            client_group: None,
            metrics_listen: None,
            limits: Limits::default(),
            checkpoint: Default::default(),
            mrc: MrcSettings::default(),
            restore: "latest".into(),
            tables: vec![],
        }
    }
}

impl Config {
    /// Reads a TOML file; unknown keys are errors that name the key.
    pub fn from_file(path: &Path) -> anyhow::Result<Config> {
        let text =
            std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read config {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("config {}: {e}", path.display()))
    }

    /// Checks values that flags and files cannot get wrong one by one.
    pub fn check(&self) -> anyhow::Result<()> {
        let l = &self.limits;
        anyhow::ensure!(
            l.max_bytes_in_flight >= 2 * l.max_frame_bytes as u64,
            "limits.max_bytes_in_flight ({}) is below twice limits.max_frame_bytes ({}): \
             a request of the largest size and its answer could never be in flight together",
            l.max_bytes_in_flight,
            l.max_frame_bytes
        );
        let at_least_one = [
            ("limits.max_in_flight (--max-in-flight)", l.max_in_flight as u64),
            ("limits.max_connections (--max-connections)", l.max_connections as u64),
            ("limits.body_stall_seconds (--body-stall-seconds)", l.body_stall_seconds),
            ("threads_per_shard (--threads-per-shard)", self.threads_per_shard as u64),
            ("checkpoint.keep (--checkpoint-keep)", self.checkpoint.keep as u64),
        ];
        for (what, v) in at_least_one {
            anyhow::ensure!(v >= 1, "{what} must be at least 1");
        }
        anyhow::ensure!(
            self.checkpoint.chunk_bytes >= 64 << 10,
            "checkpoint.chunk_bytes must be at least 65536 (64 KiB), not {}: smaller chunks make one file per bucket",
            self.checkpoint.chunk_bytes
        );
        if let Some(n) = self.shards {
            anyhow::ensure!((1..=1024).contains(&n), "shards (--shards) must be 1 to 1024, not {n}");
        }
        if let Some(s) = self.checkpoint.interval_s {
            anyhow::ensure!(s >= 1, "checkpoint.interval_s (--checkpoint-interval) must be at least 1 second");
        }
        if let Some(addr) = &self.metrics_listen {
            let a: std::net::SocketAddr =
                addr.parse().map_err(|e| anyhow::anyhow!("metrics_listen {addr:?} is not an address: {e}"))?;
            anyhow::ensure!(
                a.ip().is_loopback(),
                "metrics_listen {addr}: the metrics listener serves loopback addresses only (e.g. 127.0.0.1:9466)"
            );
        }
        anyhow::ensure!(l.max_frame_bytes >= 64, "limits.max_frame_bytes must be at least 64");
        let k = self.mrc.max_keys;
        anyhow::ensure!(
            !self.mrc.enabled || (MrcSettings::MIN_KEYS..=MrcSettings::MAX_KEYS).contains(&k),
            "mrc.max_keys (--mrc-max-keys) must be {} to {} sampled keys per table, not {k} \
             (fewer estimate nothing; more cost {} bytes each); --no-mrc turns the curves off",
            MrcSettings::MIN_KEYS,
            MrcSettings::MAX_KEYS,
            hkv_shard::mrc::Mrc::BYTES_PER_KEY
        );
        Ok(())
    }

    /// The socket path after defaults.
    pub fn socket_path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(hkv_proto::default_socket_path)
    }

    /// The state directory after defaults.
    pub fn state_path(&self) -> PathBuf {
        self.state_dir.clone().unwrap_or_else(|| PathBuf::from("hkvd-state"))
    }
}

/// The `[mrc]` section: live miss-ratio curves (daemon/src/mrc.rs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MrcSettings {
    /// Sample every table's keys and estimate its curve (`--no-mrc`: off).
    pub enabled: bool,
    /// Distinct sampled keys tracked per table, split evenly over its
    /// shards (each at least [`MrcSettings::MIN_SHARD_KEYS`]): the memory,
    /// about `120 × max_keys` bytes per table (1.9 MiB at the default
    /// 16384), and the CPU time per key, which grow with the sampling
    /// rate; the rate adapts to it.
    pub max_keys: usize,
}

impl MrcSettings {
    /// The fewest keys a curve is worth estimating from.
    pub const MIN_KEYS: usize = 256;
    /// The fewest keys one shard's estimator tracks.
    pub const MIN_SHARD_KEYS: usize = 256;
    /// The most (120 MiB per table).
    pub const MAX_KEYS: usize = 1 << 20;

    /// The estimator's config, or None when off.
    pub fn config(&self) -> Option<hkv_shard::mrc::MrcConfig> {
        self.enabled.then(|| hkv_shard::mrc::MrcConfig { max_keys: self.max_keys, ..Default::default() })
    }
}

impl Default for MrcSettings {
    fn default() -> Self {
        MrcSettings { enabled: true, max_keys: hkv_shard::mrc::DEFAULT_MAX_KEYS }
    }
}

/// The `[checkpoint]` section of the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Seconds between scheduled checkpoints; none = only on demand.
    pub interval_s: Option<u64>,
    /// Complete checkpoints kept (plus the bases incremental ones need).
    pub keep: usize,
    /// Incremental checkpoints between two full ones; 0 = always full.
    pub full_every: u32,
    /// Target bytes per chunk.
    pub chunk_bytes: u64,
    /// Take a checkpoint after draining on SIGTERM / shutdown.
    pub on_shutdown: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { interval_s: None, keep: 3, full_every: 4, chunk_bytes: 8 << 20, on_shutdown: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_with_tables_and_limits() {
        let c: Config = toml::from_str(
            r#"
            socket = "/tmp/x.sock"
            backend = "cpu"
            shards = 3
            [limits]
            max_frame_bytes = 1024
            [[table]]
            name = "emb"
            dim = 16
            capacity = 4096
            policy = "lfu"
            mode = "dual"
            "#,
        )
        .unwrap();
        assert_eq!(c.shards, Some(3));
        assert_eq!(c.backend, BackendChoice::Cpu);
        assert_eq!(c.limits.max_frame_bytes, 1024);
        assert_eq!(c.limits.max_in_flight, 64);
        assert_eq!(c.tables[0].policy, hkv_proto::Policy::Lfu);
        assert!(toml::from_str::<Config>("sockett = 1").unwrap_err().to_string().contains("sockett"));
        // The backend keeps its spellings; another is refused by name.
        for b in ["auto", "cpu", "cuda"] {
            let c: Config = toml::from_str(&format!("backend = {b:?}")).unwrap();
            assert_eq!(c.backend.to_string(), b);
            assert_eq!(b.parse::<BackendChoice>(), Ok(c.backend));
        }
        assert!(toml::from_str::<Config>("backend = \"gpu\"").unwrap_err().to_string().contains("gpu"));
        assert_eq!("gpu".parse::<BackendChoice>().unwrap_err(), "backend \"gpu\": use auto, cpu or cuda");
    }

    /// Zero limits, a zero or huge shard count and a metrics address off
    /// loopback used to start silently (or, for 100000 shards, panic).
    #[test]
    fn senseless_values_are_named_at_start() {
        let bad = |edit: fn(&mut Config)| {
            let mut c = Config::default();
            edit(&mut c);
            c.check().unwrap_err().to_string()
        };
        assert!(Config::default().check().is_ok());
        assert!(bad(|c| c.limits.max_in_flight = 0).contains("--max-in-flight"));
        assert!(bad(|c| c.limits.max_connections = 0).contains("--max-connections"));
        assert!(bad(|c| c.shards = Some(0)).contains("--shards"));
        assert!(bad(|c| c.shards = Some(100_000)).contains("1 to 1024"));
        assert!(bad(|c| c.checkpoint.keep = 0).contains("--checkpoint-keep"));
        assert!(bad(|c| c.checkpoint.interval_s = Some(0)).contains("--checkpoint-interval"));
        assert!(bad(|c| c.metrics_listen = Some("0.0.0.0:9466".into())).contains("loopback"));
        assert!(bad(|c| c.limits.max_bytes_in_flight = 1 << 30).contains("twice"));
        assert!(bad(|c| c.checkpoint.chunk_bytes = 0).contains("chunk_bytes"));
        assert!(bad(|c| c.mrc.max_keys = 0).contains("--mrc-max-keys"));
        assert!(bad(|c| c.mrc.max_keys = usize::MAX).contains("--mrc-max-keys"));
        let off: Config = toml::from_str("[mrc]\nenabled = false\nmax_keys = 0").unwrap();
        assert!(off.check().is_ok() && off.mrc.config().is_none());
    }
}
