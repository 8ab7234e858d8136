//! Daemon configuration: a TOML file (`--config`) and flags; flags win.
//! Each option is declared once, in [`Config`] and its sections.

use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, Command, FromArgMatches};
use hkv_proto::{BackingMode, BackingSpec, CheckpointId, TableSpec};
use hkv_shard::CudaTuning;
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

/// The smallest `limits.max_frame_bytes`: a frame's header and the
/// shortest bodies fit.
const MIN_FRAME_BYTES: u32 = 64;

/// `limits.max_frame_bytes` from the config file, its range said in the
/// error (the integer's type alone said "expected u32").
fn frame_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = i64::deserialize(d)?;
    u32::try_from(v).ok().filter(|&b| b >= MIN_FRAME_BYTES).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "limits.max_frame_bytes = {v} is out of range: {MIN_FRAME_BYTES} to {} bytes",
            u32::MAX
        ))
    })
}

/// Explicit limits, all enforced before allocation (`[limits]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "Limits ([limits] in the config file)")]
pub struct Limits {
    /// Largest frame body accepted, bytes (64 to 4294967295).
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u32).range(MIN_FRAME_BYTES as i64..))]
    #[serde(deserialize_with = "frame_bytes")]
    pub max_frame_bytes: u32,
    /// Requests of one connection executed at once; more wait (backpressure).
    #[arg(long, default_value_t = 64)]
    pub max_in_flight: usize,
    /// Connections served at once; more are refused with `busy`.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds SIGTERM waits for in-flight requests before closing the
    /// remaining connections, then as long for write-back queues to reach
    /// their clusters (rows left queued fail the exit); 0 waits for
    /// neither.
    #[arg(long, default_value_t = 30)]
    pub drain_seconds: u64,
    /// Bytes of sent answer frames kept for later find and echo answers to
    /// reuse (buffers of 1 MiB to 256 MiB, at most 16); 0 keeps none.
    /// Unset: 512 MiB on the CPU backend, 2 GiB on CUDA (page-locked there).
    #[arg(long)]
    pub frame_cache_bytes: Option<u64>,
    /// Bytes all tables may hold at their peak (their storage at
    /// max_capacity): device memory on CUDA, host memory on the CPU backend.
    /// Unset: 7/8 of the devices' memory on CUDA, 3/4 of host memory (or of
    /// the cgroup's limit, or of the address-space limit `ulimit -v` when
    /// lower) on the CPU backend.
    #[arg(long)]
    pub max_table_bytes: Option<u64>,
    /// Bytes of pinned host memory CUDA tables' host tiers may hold.
    /// Unset: half of host memory.
    #[arg(long)]
    pub max_host_tier_bytes: Option<u64>,
    /// Bytes of request bodies being received or run and of answers being
    /// built or sent, over every connection; a request past it is refused
    /// with `resource_exhausted`. At least twice max_frame_bytes.
    #[arg(long, default_value_t = 4 << 30)]
    pub max_bytes_in_flight: u64,
    /// Seconds a started request body, or a started frame header, may go
    /// without a byte arriving before its connection is closed (its memory
    /// is freed).
    #[arg(long, default_value_t = 30)]
    pub body_stall_seconds: u64,
    /// Seconds a connection with no request running may go without
    /// starting a frame, while at least half of max_connections are
    /// open, before it is closed (its slot, regions and events come
    /// back); 0 keeps idle connections open.
    #[arg(long, default_value_t = 300)]
    pub idle_seconds: u64,
    /// Seconds a region request may wait for the client's `wait_event`
    /// before it is answered `timeout` (and nothing of it run).
    #[arg(long, default_value_t = 60)]
    pub event_wait_seconds: u64,
    /// Bytes of registered regions (client memfds the daemon maps) over
    /// every connection; a registration past it gets `resource_exhausted`.
    #[arg(long, default_value_t = 64 << 30)]
    pub max_region_bytes: u64,
    /// Bytes of registered regions of one connection.
    #[arg(long, default_value_t = 16 << 30)]
    pub max_region_bytes_per_connection: u64,
}

/// What to restore at start (`restore`, `--restore`): `latest`, a
/// checkpoint id (hex, as `hkvctl checkpoints` lists them), or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Restore {
    /// Start with empty tables (every checkpoint stays on disk).
    None,
    /// This checkpoint, or the newest complete one.
    Checkpoint(CheckpointId),
}

impl std::fmt::Display for Restore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Restore::None => f.write_str("none"),
            Restore::Checkpoint(id) => id.fmt(f),
        }
    }
}

impl std::str::FromStr for Restore {
    type Err = String;
    fn from_str(s: &str) -> Result<Restore, String> {
        match s {
            "none" => Ok(Restore::None),
            _ => {
                s.parse().map(Restore::Checkpoint).map_err(|e: hkv_proto::ProtoError| format!("{}; or none", e.message))
            }
        }
    }
}

impl TryFrom<String> for Restore {
    type Error = String;
    fn try_from(s: String) -> Result<Restore, String> {
        s.parse()
    }
}

impl From<Restore> for String {
    fn from(r: Restore) -> String {
        r.to_string()
    }
}

/// The whole configuration of `hkvd serve`, declared once: each field is
/// one option, with its TOML key (the field's name, in its section), its
/// flag (`#[arg]`), its default (`default_value_t`, which the TOML file's
/// defaults come from too, through [`Default`]) and its help (the doc
/// comment). [`Config::layered`] puts the flags given over a file's values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Socket path. Unset: `$HKVD_SOCKET`, else
    /// `$XDG_RUNTIME_DIR/hkvd/hkvd.sock` when that directory exists, else
    /// `./hkvd-run/hkvd.sock`.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// State directory (checkpoints). Unset: `./hkvd-state`.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Directory of the CUDA kernels compiled for this host's GPUs (a cache:
    /// without it every start compiles). Unset: `$HKV_KERNEL_CACHE`, else
    /// `kernels` in the state directory.
    #[arg(long)]
    pub kernel_cache_dir: Option<PathBuf>,
    /// `auto` (CUDA when a driver and a device answer, else the CPU), `cpu`
    /// or `cuda`.
    #[arg(long, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Shard actors: CPU shards (unset: the number of cores), or CUDA
    /// shards spread round-robin over the GPUs (unset: one per GPU).
    #[arg(long)]
    pub shards: Option<usize>,
    /// CUDA devices to use, comma separated (ordinals as CUDA numbers them
    /// after `CUDA_VISIBLE_DEVICES`). Unset: every visible device.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Threads per shard actor, 1 to 64, so that readers and updaters of one
    /// shard can run together.
    #[arg(long, default_value_t = 4)]
    pub threads_per_shard: usize,
    /// A group (name) whose members may run admin operations, besides the
    /// daemon's own user and root; the socket and state directory get this
    /// group.
    #[arg(long)]
    pub admin_group: Option<String>,
    /// A group (name) whose members may connect and run table operations
    /// but not admin operations: the socket and its directory get this
    /// group instead of the admin group (admins then connect as members of
    /// it too). Unset: the socket's group is the admin group.
    #[arg(long)]
    pub client_group: Option<String>,
    /// Loopback address for a Prometheus HTTP listener, e.g. `127.0.0.1:9466`.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// What to restore at start: `latest`, a checkpoint id, or `none`.
    #[arg(long, default_value_t = Restore::Checkpoint(CheckpointId::Latest))]
    pub restore: Restore,
    /// Limits.
    #[command(flatten)]
    pub limits: Limits,
    /// Checkpoints.
    #[command(flatten)]
    pub checkpoint: CheckpointConfig,
    /// Live miss-ratio curves (`[mrc]`).
    #[command(flatten)]
    pub mrc: MrcSettings,
    /// The CUDA kernel tuning every table gets: no option of its own, but
    /// the `HKV_LOOKUP_GROUP`, `HKV_WRITE_GROUP` and `HKV_KEY_ORDER`
    /// variables, which `hkvd` reads ([`hkv_shard::CudaTuning::from_vars`]);
    /// the default is what measured fastest.
    #[arg(skip)]
    #[serde(skip)]
    pub cuda_tuning: CudaTuning,
    /// Tables created at start (`[[table]]`, the file only).
    #[arg(skip)]
    #[serde(rename = "table")]
    pub tables: Vec<TableSpec>,
}

/// The defaults of an options struct: what its flags give when none is
/// passed. The `default_value_t`s are the one place each default is
/// written; a TOML file's missing keys get the same values through this.
fn defaults<T: Args + FromArgMatches>() -> T {
    let cmd = T::augment_args(Command::new("defaults").no_binary_name(true));
    let m = cmd.try_get_matches_from(std::iter::empty::<&str>()).expect("the options parse with no flag");
    T::from_arg_matches(&m).expect("the defaults are values of their options")
}

/// What serde lets through in a file's `[[table]]`s and the protocol's
/// checks never see: `max_load_factor = nan` or `inf` (JSON has neither:
/// the file's value became null on its way to the table, so the table
/// grew at the default with `hkvctl tables --json` saying null); and a
/// hash `key` of another length than 2 or not of integers (`[1, 2, 3]`
/// was cut to `[1, 2]`, `[1, 2, "x"]` taken as `[1, 2]`). Errors name the
/// place, as `table[0].hash.key`.
fn check_tables(c: &Config, sent: &toml::Table) -> Result<(), String> {
    for (i, t) in c.tables.iter().enumerate() {
        if let Some(f) = t.max_load_factor.filter(|f| !f.is_finite()) {
            return Err(format!("table[{i}].max_load_factor = {f}: use a number in (0, 1]"));
        }
    }
    let tables = sent.get("table").and_then(toml::Value::as_array).map_or(&[][..], Vec::as_slice);
    for (i, t) in tables.iter().enumerate() {
        let Some(key) = t.get("hash").and_then(|h| h.get("key")) else { continue };
        let ok =
            key.as_array().is_some_and(|k| k.len() == 2 && k.iter().all(|v| v.as_integer().is_some_and(|n| n >= 0)));
        if !ok {
            return Err(format!(
                "table[{i}].hash.key = {key}: use an array of 2 integers, 0 to 9223372036854775807 (the SipHash key)"
            ));
        }
    }
    Ok(())
}

/// The ids (= field names = TOML keys) of an options struct's flags.
fn ids<T: Args>() -> Vec<String> {
    T::augment_args(Command::new("ids")).get_arguments().map(|a| a.get_id().to_string()).collect()
}

impl Default for Config {
    fn default() -> Self {
        defaults()
    }
}

impl Default for Limits {
    fn default() -> Self {
        defaults()
    }
}

impl Default for MrcSettings {
    fn default() -> Self {
        defaults()
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        defaults()
    }
}

impl Config {
    /// The most bytes a config file may hold: a config is a few KiB (a
    /// `[[table]]` takes a few lines), and `--config /dev/zero` was read
    /// until memory ran out.
    pub const MAX_FILE_BYTES: u64 = 16 << 20;

    /// Reads a TOML file; unknown keys are errors that name the key. The
    /// file is a regular file or a pipe (`--config <(…)`), of at most
    /// [`Config::MAX_FILE_BYTES`].
    pub fn from_file(path: &Path) -> anyhow::Result<Config> {
        use std::io::Read;
        use std::os::unix::fs::FileTypeExt;
        let cannot = |e: std::io::Error| anyhow::anyhow!("cannot read config {}: {e}", path.display());
        let f = std::fs::File::open(path).map_err(cannot)?;
        let kind = f.metadata().map_err(cannot)?.file_type();
        let what = if kind.is_dir() {
            Some("a directory")
        } else if kind.is_char_device() || kind.is_block_device() {
            Some("a device")
        } else if kind.is_socket() {
            Some("a socket")
        } else {
            None
        };
        if let Some(what) = what {
            anyhow::bail!("config {} is {what}, not a file: give --config a TOML file", path.display());
        }
        let mut bytes = Vec::new();
        f.take(Self::MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(cannot)?;
        anyhow::ensure!(
            bytes.len() as u64 <= Self::MAX_FILE_BYTES,
            "config {} is larger than {} MiB: a config file holds a few KiB of TOML; is it the right file?",
            path.display(),
            Self::MAX_FILE_BYTES >> 20
        );
        let text = String::from_utf8(bytes)
            .map_err(|e| anyhow::anyhow!("config {} is not UTF-8 text ({e})", path.display()))?;
        Self::from_toml(&text).map_err(|e| anyhow::anyhow!("config {}: {e}", path.display()))
    }

    /// A config file's text as a [`Config`]. serde reads a TOML array into
    /// a table's keys field by field, in their order (`hash = ["strong",
    /// 1000000, [1, 2]]` was a hash, `table = [["t", 4, 4096]]` a table, as
    /// JSON arrays were in the protocol's bodies): an array where a table
    /// goes is refused, naming it.
    fn from_toml(text: &str) -> Result<Config, String> {
        let c: Config = toml::from_str(text).map_err(|e| e.to_string())?;
        let sent: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        check_tables(&c, &sent)?;
        let json = |v: serde_json::Result<serde_json::Value>| v.map_err(|e| e.to_string());
        match hkv_proto::request::array_for_object(
            &json(serde_json::to_value(&sent))?,
            &json(serde_json::to_value(&c))?,
        ) {
            None => Ok(c),
            Some(at) => Err(format!(
                "{}: an array where a table is expected; write a table with named keys (`[[table]]` with `name = …`, \
                 `hash = {{ kind = …, num_buckets = … }}`)",
                if at.is_empty() { "the file" } else { &at }
            )),
        }
    }

    /// The configuration from the command line: `flags` (what
    /// [`FromArgMatches`] made of `given`, the matches of a command that
    /// flattens [`Config`]) over the TOML file `file`, if any. Flags win:
    /// each option given on the command line replaces the file's value;
    /// the others keep the file's (or, missing there, the default).
    pub fn layered(flags: Config, given: &ArgMatches, file: Option<&Path>) -> anyhow::Result<Config> {
        let Some(path) = file else { return Ok(flags) };
        // The two meet as documents: each option's TOML key is its field's
        // name, which is also its clap id, in the section (struct) that
        // declares it, so a flag given replaces exactly its key.
        let from_file = Config::from_file(path)?;
        let mut doc = serde_json::to_value(&from_file)?;
        let ours = serde_json::to_value(&flags)?;
        let sections =
            [("limits", ids::<Limits>()), ("checkpoint", ids::<CheckpointConfig>()), ("mrc", ids::<MrcSettings>())];
        for id in ids::<Config>() {
            if given.value_source(&id) != Some(ValueSource::CommandLine) {
                continue;
            }
            let section = sections.iter().find(|(_, ids)| ids.contains(&id)).map(|(s, _)| *s);
            let (to, from) = match section {
                Some(s) => (&mut doc[s], &ours[s]),
                None => (&mut doc, &ours),
            };
            to[&id] = from[&id].clone();
        }
        let mut c: Config = serde_json::from_value(doc)?;
        c.cuda_tuning = flags.cuda_tuning;
        Ok(c)
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
        if let Some(n) = self.checkpoint.restore_readers {
            anyhow::ensure!(
                (1..=64).contains(&n),
                "checkpoint.restore_readers (--restore-readers) must be 1 to 64, not {n}"
            );
        }
        for (i, t) in self.tables.iter().enumerate() {
            hkv_proto::check_name(&t.name)
                .map_err(|e| anyhow::anyhow!("[[table]] entry {} of the config file: {}", i + 1, e.message))?;
            anyhow::ensure!(
                !self.tables[..i].iter().any(|u| u.name == t.name),
                "table {} is declared twice ([[table]] entries {} and {} of the config file)",
                hkv_proto::quoted(&t.name),
                self.tables.iter().position(|u| u.name == t.name).unwrap_or(0) + 1,
                i + 1
            );
            // The cluster's options are options: checked here, before any
            // cluster is opened (their errors read "its cluster cannot be
            // opened (backing option queue_bytes: 0: …)"). The row's
            // width is the table's own check, at its creation.
            if let Some(b) = &t.backing {
                match backing_options(b).check(t.row_dim()) {
                    Err(hkv_backing::Error::BadOption { name: "dim", .. }) | Ok(()) => {}
                    Err(e) => anyhow::bail!(
                        "table {} ([[table]] entry {} of the config file): {e}",
                        hkv_proto::quoted(&t.name),
                        i + 1
                    ),
                }
            }
        }
        anyhow::ensure!(
            self.threads_per_shard <= 64,
            "threads_per_shard (--threads-per-shard) must be 1 to 64, not {}",
            self.threads_per_shard
        );
        if let Some(n) = self.shards {
            anyhow::ensure!((1..=1024).contains(&n), "shards (--shards) must be 1 to 1024, not {n}");
        }
        if let Some(s) = self.checkpoint.interval_s {
            anyhow::ensure!(
                (1..=CheckpointConfig::MAX_INTERVAL_S).contains(&s),
                "checkpoint.interval_s (--checkpoint-interval) must be 1 to {} seconds (a year), not {s}; \
                 leave it unset for checkpoints on demand only",
                CheckpointConfig::MAX_INTERVAL_S
            );
        }
        self.check_state_dir()?;
        if let Some(addr) = &self.metrics_listen {
            let a: std::net::SocketAddr = addr.parse().map_err(|e| {
                anyhow::anyhow!(
                    "metrics_listen (--metrics-listen) {addr:?} is not an address ({e}): \
                     give an IP address and a port, e.g. 127.0.0.1:9466"
                )
            })?;
            anyhow::ensure!(
                a.ip().is_loopback(),
                "metrics_listen {addr}: the metrics listener serves loopback addresses only (e.g. 127.0.0.1:9466)"
            );
        }
        anyhow::ensure!(
            l.max_frame_bytes >= MIN_FRAME_BYTES,
            "limits.max_frame_bytes must be at least {MIN_FRAME_BYTES}"
        );
        let k = self.mrc.max_keys;
        anyhow::ensure!(
            !self.mrc.enabled || (MrcSettings::MIN_KEYS..=MrcSettings::MAX_KEYS).contains(&k),
            "mrc.max_keys (--mrc-max-keys) must be {} to {} sampled keys per table, not {k} \
             (fewer estimate nothing; more cost {} bytes each); --no-mrc turns the curves off",
            MrcSettings::MIN_KEYS,
            MrcSettings::MAX_KEYS,
            hkv_shard::mrc::Mrc::BYTES_PER_KEY
        );
        self.check_passwords_file()
    }

    /// The state directory, where it exists but is no directory: a
    /// dangling symlink said "cannot create …: File exists (os error 17)".
    fn check_state_dir(&self) -> anyhow::Result<()> {
        let dir = self.state_path();
        let Ok(meta) = std::fs::symlink_metadata(&dir) else { return Ok(()) };
        let shown = dir.display();
        if meta.file_type().is_symlink() && std::fs::metadata(&dir).is_err() {
            let to = std::fs::read_link(&dir).map(|t| t.display().to_string()).unwrap_or_default();
            anyhow::bail!(
                "state_dir (--state-dir) {shown} is a symlink to {to}, which does not exist: create that \
                 directory, or give --state-dir another path"
            );
        }
        anyhow::ensure!(
            std::fs::metadata(&dir).is_ok_and(|m| m.is_dir()),
            "state_dir (--state-dir) {shown} exists and is not a directory: move it away, or give --state-dir \
             another path"
        );
        Ok(())
    }

    /// `checkpoint.backing_passwords`: checked at start as well as at each
    /// restore that reads it (which may come after the file was made or
    /// changed): a file others may read stops the start; a missing one
    /// does not.
    fn check_passwords_file(&self) -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let Some(p) = &self.checkpoint.backing_passwords else { return Ok(()) };
        let what = "checkpoint.backing_passwords (--backing-passwords)";
        let meta = match std::fs::metadata(p) {
            // (Logged at start: `crate::run`.)
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            m => m.map_err(|e| anyhow::anyhow!("{what} {}: {e}", p.display()))?,
        };
        anyhow::ensure!(meta.is_file(), "{what} {} is not a file", p.display());
        let mode = meta.permissions().mode() & 0o777;
        anyhow::ensure!(
            mode & 0o077 == 0,
            "{what} {} may be read by others than its owner (mode {mode:o}): chmod 600 it",
            p.display()
        );
        Ok(())
    }

    /// The socket path after defaults.
    pub fn socket_path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| hkv_proto::default_socket_path(None))
    }

    /// The state directory after defaults.
    pub fn state_path(&self) -> PathBuf {
        self.state_dir.clone().unwrap_or_else(|| PathBuf::from("hkvd-state"))
    }

    /// The kernel cache directory after defaults.
    pub fn kernel_cache_path(&self) -> PathBuf {
        self.kernel_cache_dir.clone().unwrap_or_else(|| self.state_path().join("kernels"))
    }
}

/// The `[mrc]` section: live miss-ratio curves (daemon/src/mrc.rs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "Miss-ratio curves ([mrc] in the config file)")]
pub struct MrcSettings {
    /// Turn the live miss-ratio curves off: no key is sampled (in the file,
    /// `enabled = false`; by default every table's curve is estimated).
    #[arg(long = "no-mrc", action = ArgAction::SetFalse)]
    pub enabled: bool,
    /// Distinct sampled keys tracked per table, split evenly over its
    /// shards (each at least 256): the memory, about `120 × max_keys`
    /// bytes per table (1.9 MiB at the default 16384), and the CPU time
    /// per key, which grow with the sampling rate; the rate adapts to it.
    #[arg(long = "mrc-max-keys", value_name = "KEYS", default_value_t = hkv_shard::mrc::DEFAULT_MAX_KEYS)]
    pub max_keys: usize,
}

impl MrcSettings {
    /// The fewest keys a curve is worth estimating from.
    pub const MIN_KEYS: usize = hkv_shard::mrc::MIN_KEYS;
    /// The fewest keys one shard's estimator tracks.
    pub const MIN_SHARD_KEYS: usize = 256;
    /// The most (120 MiB per table).
    pub const MAX_KEYS: usize = hkv_shard::mrc::MAX_KEYS;

    /// The estimator's config, or None when off.
    pub fn config(&self) -> Option<hkv_shard::mrc::MrcConfig> {
        self.enabled.then(|| hkv_shard::mrc::MrcConfig { max_keys: self.max_keys, ..Default::default() })
    }
}

impl CheckpointConfig {
    /// The longest `interval_s`: a year. `18446744073709551615` panicked
    /// the start ("overflow when adding duration to instant").
    pub const MAX_INTERVAL_S: u64 = 365 * 24 * 3600;
}

/// The `[checkpoint]` section of the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "Checkpoints ([checkpoint] in the config file)")]
pub struct CheckpointConfig {
    /// Seconds between scheduled checkpoints, 1 to 31536000 (a year).
    /// Unset: only on demand.
    #[arg(long = "checkpoint-interval", value_name = "SECONDS")]
    pub interval_s: Option<u64>,
    /// Complete checkpoints kept (plus the bases incremental ones need).
    #[arg(long = "checkpoint-keep", value_name = "N", default_value_t = 3)]
    pub keep: usize,
    /// Incremental checkpoints between two full ones; 0 = always full.
    #[arg(long = "checkpoint-full-every", value_name = "N", default_value_t = 4)]
    pub full_every: u32,
    /// Target bytes per chunk file (at least 64 KiB).
    #[arg(long = "checkpoint-chunk-bytes", value_name = "BYTES", default_value_t = 8 << 20)]
    pub chunk_bytes: u64,
    /// Take a checkpoint after draining on SIGTERM / shutdown.
    #[arg(long = "checkpoint-on-shutdown")]
    pub on_shutdown: bool,
    /// Threads reading (and verifying) a restore's chunks, 1 to 64. Unset:
    /// a quarter of the cores, 2 to 6.
    #[arg(long = "restore-readers", value_name = "N")]
    pub restore_readers: Option<usize>,
    /// A file of `TABLE PASSWORD` lines, readable by its owner only, that
    /// a restore takes backed tables' cluster passwords from: checkpoints
    /// keep seed URLs with `***` for the password. Unset: a backed table
    /// whose seeds had one is not restored (the restore is refused).
    #[arg(long = "backing-passwords", value_name = "FILE")]
    pub backing_passwords: Option<PathBuf>,
}

/// The cluster tier's options from a table's backing spec (the daemon's
/// `backing` module opens tiers with them; [`Config::check`] checks a
/// config file's with them before any cluster is opened).
pub fn backing_options(spec: &BackingSpec) -> hkv_backing::Options {
    let mode = match spec.mode {
        BackingMode::ReadOnly => hkv_backing::Mode::ReadOnly,
        BackingMode::WriteThrough => hkv_backing::Mode::WriteThrough,
        BackingMode::WriteBack => hkv_backing::Mode::WriteBack,
    };
    let mut o = hkv_backing::Options::new(spec.seeds.clone(), mode);
    if let Some(ms) = spec.deadline_ms {
        o.deadline = std::time::Duration::from_millis(ms);
    }
    if let Some(b) = spec.queue_bytes {
        o.queue_bytes = b;
    }
    if let Some(n) = spec.wait_replicas {
        o.wait_replicas = n;
    }
    o
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
        // Arrays where tables go (serde would read them field by field).
        let t = "[[table]]\nname = \"t\"\ndim = 4\ncapacity = 4096\n";
        let e = Config::from_toml(&format!("{t}hash = [\"strong\", 1000000, [1, 2]]")).unwrap_err();
        assert!(e.starts_with("table[0].hash: an array where a table is expected"), "{e}");
        let e = Config::from_toml("table = [[\"t\", 4, 4096]]").unwrap_err();
        assert!(e.starts_with("table[0]: an array"), "{e}");
        let ok = Config::from_toml(&format!("{t}hash = {{ kind = \"strong\", num_buckets = 1000000, key = [1, 2] }}"));
        assert!(ok.is_ok(), "{ok:?}");
        // A frame limit outside 64..=u32::MAX is refused with its range.
        for bad in ["10", "-5", "5000000000"] {
            let e = toml::from_str::<Config>(&format!("[limits]\nmax_frame_bytes = {bad}")).unwrap_err().to_string();
            assert!(e.contains(&format!("max_frame_bytes = {bad} is out of range: 64 to 4294967295 bytes")), "{e}");
        }
        // The backend keeps its spellings; another is refused by name.
        for b in ["auto", "cpu", "cuda"] {
            let c: Config = toml::from_str(&format!("backend = {b:?}")).unwrap();
            assert_eq!(c.backend.to_string(), b);
            assert_eq!(b.parse::<BackendChoice>(), Ok(c.backend));
        }
        assert!(toml::from_str::<Config>("backend = \"gpu\"").unwrap_err().to_string().contains("gpu"));
        assert!("gpu".parse::<BackendChoice>().unwrap_err().contains("\"gpu\""));
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
        assert!(bad(|c| c.threads_per_shard = 100_000).contains("1 to 64"));
        let twice = |c: &mut Config| {
            c.tables = vec![TableSpec::new("a", 2, 64), TableSpec::new("t", 2, 64), TableSpec::new("t", 4, 64)]
        };
        assert!(bad(twice).contains("table \"t\" is declared twice ([[table]] entries 2 and 3"), "{}", bad(twice));
        assert!(bad(|c| c.checkpoint.keep = 0).contains("--checkpoint-keep"));
        assert!(bad(|c| c.checkpoint.interval_s = Some(0)).contains("--checkpoint-interval"));
        assert!(bad(|c| c.metrics_listen = Some("0.0.0.0:9466".into())).contains("loopback"));
        assert!(bad(|c| c.limits.max_bytes_in_flight = 1 << 30).contains("twice"));
        assert!(bad(|c| c.checkpoint.chunk_bytes = 0).contains("chunk_bytes"));
        assert!(bad(|c| c.mrc.max_keys = 0).contains("--mrc-max-keys"));
        assert!(bad(|c| c.mrc.max_keys = usize::MAX).contains("--mrc-max-keys"));
        let off: Config = toml::from_str("[mrc]\nenabled = false\nmax_keys = 0").unwrap();
        assert!(off.check().is_ok() && off.mrc.config().is_none());
        // The passwords file: others may read it, stop; missing, go on.
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        let mut c = Config::default();
        c.checkpoint.backing_passwords = Some(pw.clone());
        assert!(c.check().is_ok(), "a file made later");
        std::fs::write(&pw, "t secret\n").unwrap();
        std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("mode 644): chmod 600 it"));
        std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(c.check().is_ok());
        c.checkpoint.backing_passwords = Some(dir.path().to_path_buf());
        assert!(c.check().unwrap_err().to_string().contains("is not a file"));
    }

    /// A tester's hostile config files and flags: `max_load_factor = nan`
    /// or `inf` started a table that grew at the default (JSON made the
    /// value null); a hash `key = [1, 2, 3]` was cut to `[1, 2]` and `[1,
    /// 2, "x"]` taken; `--checkpoint-interval 18446744073709551615`
    /// panicked the start; backing options were told as "its cluster
    /// cannot be opened"; a 5000-character table name was echoed whole,
    /// twice; a state directory that is a dangling symlink said "File
    /// exists"; `--metrics-listen localhost:9466` gave no hint. Each is
    /// refused, naming the place (and the culprit, capped).
    #[test]
    fn hostile_values_are_refused_naming_the_place() {
        let t = "[[table]]\nname = \"t\"\ndim = 4\ncapacity = 4096\nmax_capacity = 8192\n";
        for f in ["nan", "inf", "-inf", "+nan"] {
            let e = Config::from_toml(&format!("{t}max_load_factor = {f}")).unwrap_err();
            assert!(e.starts_with("table[0].max_load_factor"), "{e}");
        }
        assert!(Config::from_toml(&format!("{t}max_load_factor = 0.75")).is_ok());
        for key in ["[1, 2, 3]", "[1, 2, \"x\"]", "[1, 2.5]", "[-1, 2]", "\"ab\"", "[]"] {
            let e = Config::from_toml(&format!("{t}hash = {{ kind = \"strong\", num_buckets = 10, key = {key} }}"))
                .unwrap_err();
            assert!(e.starts_with("table[0].hash.key") || e.contains("key"), "{key}: {e}");
        }
        let k = Config::from_toml(&format!(
            "{t}[[table]]\nname = \"u\"\ndim = 4\ncapacity = 64\nhash = {{ num_buckets = 10, key = [1, 2, 3] }}"
        ));
        assert!(k.unwrap_err().starts_with("table[1].hash.key"));

        let bad = |edit: &dyn Fn(&mut Config)| {
            let mut c = Config::default();
            edit(&mut c);
            c.check().unwrap_err().to_string()
        };
        for s in [u64::MAX, i64::MAX as u64, CheckpointConfig::MAX_INTERVAL_S + 1] {
            assert!(bad(&|c| c.checkpoint.interval_s = Some(s)).contains("--checkpoint-interval"));
        }
        let mut c = Config::default();
        c.checkpoint.interval_s = Some(CheckpointConfig::MAX_INTERVAL_S);
        assert!(c.check().is_ok());

        let backed = |edit: fn(&mut hkv_proto::BackingSpec)| {
            let mut spec = TableSpec::new("t", 4, 4096);
            let mut b: hkv_proto::BackingSpec =
                serde_json::from_value(serde_json::json!({ "seeds": ["127.0.0.1:1"] })).unwrap();
            edit(&mut b);
            spec.backing = Some(b);
            bad(&move |c| c.tables = vec![spec.clone()])
        };
        assert!(backed(|b| b.queue_bytes = Some(0)).contains("backing option queue_bytes"));
        assert!(backed(|b| b.deadline_ms = Some(0)).contains("backing option deadline"));
        assert!(backed(|b| {
            b.mode = BackingMode::ReadOnly;
            b.wait_replicas = Some(3)
        })
        .contains("backing option wait_replicas"));

        let long = "n".repeat(5000);
        let e = bad(&|c| c.tables = vec![TableSpec::new(&long, 4, 64)]);
        assert!(e.starts_with("[[table]] entry 1") && e.len() < 400, "{e}");

        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("state");
        std::os::unix::fs::symlink(dir.path().join("gone"), &link).unwrap();
        assert!(bad(&|c| c.state_dir = Some(link.clone())).contains("does not exist"));
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(bad(&|c| c.state_dir = Some(file.clone())).contains("not a directory"));

        let e = bad(&|c| c.metrics_listen = Some("localhost:9466".into()));
        assert!(e.contains("127.0.0.1:9466"), "{e}");
    }

    /// `--config /dev/zero` was read until memory ran out: a config file
    /// is a regular file or a pipe, of at most 16 MiB. (`/dev/zero` itself
    /// is tried under an address-space limit, in
    /// daemon/tests/startup_input.rs.)
    #[test]
    fn a_config_file_is_bounded() {
        let e = Config::from_file(Path::new("/dev/null")).unwrap_err().to_string();
        assert!(e.contains("/dev/null is a device"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        assert!(Config::from_file(dir.path()).unwrap_err().to_string().contains("a directory"));
        let big = dir.path().join("big.toml");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(Config::MAX_FILE_BYTES + 1).unwrap();
        assert!(Config::from_file(&big).unwrap_err().to_string().contains("larger than 16 MiB"));
    }

    /// The options used to be written three times (this file, then twice
    /// in main.rs); now each is declared once. The defaults stay what the
    /// docs say, a flag given wins over the file, a key in the file wins
    /// over the default, and a flag not given leaves the file's value.
    #[test]
    fn each_option_is_declared_once_and_flags_win_over_the_file() {
        let d = Config::default();
        assert_eq!(
            (d.backend, d.threads_per_shard, d.restore),
            (BackendChoice::Auto, 4, Restore::Checkpoint(CheckpointId::Latest))
        );
        let l = &d.limits;
        assert_eq!((l.max_frame_bytes, l.max_in_flight, l.max_connections, l.drain_seconds), (1 << 30, 64, 1024, 30));
        assert_eq!((l.frame_cache_bytes, l.max_table_bytes, l.max_host_tier_bytes), (None, None, None));
        assert_eq!(
            (l.max_bytes_in_flight, l.body_stall_seconds, l.idle_seconds, l.event_wait_seconds),
            (4 << 30, 30, 300, 60)
        );
        assert_eq!((l.max_region_bytes, l.max_region_bytes_per_connection), (64 << 30, 16 << 30));
        let k = &d.checkpoint;
        assert_eq!((k.interval_s, k.keep, k.full_every, k.chunk_bytes, k.on_shutdown), (None, 3, 4, 8 << 20, false));
        assert_eq!((d.mrc.enabled, d.mrc.max_keys), (true, hkv_shard::mrc::DEFAULT_MAX_KEYS));
        assert_eq!(toml::from_str::<Config>("").unwrap(), d, "an empty file is the defaults");

        let dir = std::env::temp_dir().join(format!("hkvd-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("hkvd.toml");
        std::fs::write(
            &file,
            "threads_per_shard = 7\nrestore = \"none\"\n[limits]\nmax_in_flight = 9\nmax_connections = 11\n\
             [checkpoint]\non_shutdown = true\nkeep = 5\n[mrc]\nenabled = false\n",
        )
        .unwrap();
        let parse = |args: &[&str], file: Option<&Path>| {
            let cmd = Config::augment_args(Command::new("serve"));
            let m = cmd.try_get_matches_from(std::iter::once("serve").chain(args.iter().copied())).unwrap();
            Config::layered(Config::from_arg_matches(&m).unwrap(), &m, file).unwrap()
        };
        let args = ["--max-in-flight", "3", "--checkpoint-keep", "2", "--backend", "cpu", "--restore", "00ff"];
        let c = parse(&args, Some(&file));
        assert_eq!((c.limits.max_in_flight, c.checkpoint.keep, c.backend), (3, 2, BackendChoice::Cpu), "flags");
        assert_eq!(c.restore, Restore::Checkpoint(CheckpointId::Id(0xff)), "flag");
        assert_eq!((c.limits.max_connections, c.threads_per_shard, c.checkpoint.on_shutdown), (11, 7, true), "file");
        assert!(!c.mrc.enabled, "file");
        assert_eq!((c.limits.drain_seconds, c.checkpoint.full_every), (30, 4), "defaults");
        let c = parse(&["--no-mrc", "--checkpoint-on-shutdown", "--devices", "0,2"], None);
        assert!(!c.mrc.enabled && c.checkpoint.on_shutdown);
        assert_eq!((c.devices, c.limits.max_in_flight), (Some(vec![0, 2]), 64));
        assert_eq!(parse(&[], Some(&file)).restore, Restore::None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
