//! Real `redis-server` clusters for tests and benchmarks (feature `testkit`).
//!
//! [`TestCluster::start`] runs `masters × (1 + replicas)` `redis-server`
//! processes on loopback ports, each in its own folder of one temporary
//! directory, joins them with `redis-cli --cluster create … --cluster-yes`
//! and waits until every node reports `cluster_state:ok`. Dropping the value
//! kills every process and removes the directory. Nodes persist with an
//! append-only file fsynced on every write, so a node killed with SIGKILL
//! and restarted still holds every write it acknowledged: a test can then
//! tell a lost write from the tier's own fault.
//!
//! Every wait here is bounded in time and says what it waited for.

use std::collections::HashMap;
use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::Value;

use crate::layout::{encode_row, Layout};

/// How long a cluster may take to form or heal before a test gives up.
const FORM_TIMEOUT: Duration = Duration::from_secs(60);

/// One `redis-server` process, alive or killed.
struct Node {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    cluster: bool,
    /// `requirepass` and `masterauth` when set.
    password: Option<String>,
}

impl Node {
    fn spawn(&mut self) -> io::Result<()> {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--daemonize", "no"])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("log"));
        if let Some(pw) = &self.password {
            cmd.args(["--requirepass", pw, "--masterauth", pw]);
        }
        if self.cluster {
            // A 1 s node timeout so that failover tests finish in seconds;
            // partial coverage so that the other nodes keep serving their
            // slots while one master is down (the daemon then reports that
            // node, not a cluster-wide CLUSTERDOWN).
            cmd.args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "1000"])
                .args(["--cluster-require-full-coverage", "no"])
                .args(["--cluster-allow-reads-when-down", "no"])
                // Replicas sync at once (the default waits 5 s), so that a
                // failover test can kill a master soon after forming.
                .args(["--repl-diskless-sync-delay", "0"]);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        self.child = Some(cmd.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("starting redis-server (install the redis-server package; test.sh does): {e}"),
            )
        })?);
        let r =
            wait_until(Duration::from_secs(10), &format!("redis-server on port {} to answer PING", self.port), || {
                cli_output(self.port, self.password.as_deref(), &["ping"]).map(|o| o.contains("PONG")).unwrap_or(false)
            });
        // The port is free when picked, not held: another test's server may
        // have taken it first, and then answers the PING while this one
        // exited. The server that answers must be this process.
        let pid = self.child.as_ref().map(Child::id).unwrap_or(0);
        let info = cli_output(self.port, self.password.as_deref(), &["info", "server"]).unwrap_or_default();
        let ours = info.lines().any(|l| l.trim() == format!("process_id:{pid}"));
        if r.is_err() || !ours {
            self.kill();
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("redis-server on port {} did not start as this cluster's node (port taken?)", self.port),
            ));
        }
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Redis Cluster of real `redis-server` processes on 127.0.0.1.
pub struct TestCluster {
    nodes: Vec<Node>,
    // Declared last: dropped after the processes are killed.
    _dir: tempfile::TempDir,
}

impl TestCluster {
    /// Starts `masters` masters, each with `replicas` replicas, and forms
    /// the cluster. Node `i < masters` starts as a master.
    pub fn start(masters: usize, replicas: usize) -> io::Result<TestCluster> {
        Self::start_with(masters, replicas, None)
    }

    /// [`TestCluster::start`] with every node asking clients for
    /// `password` (`requirepass`) and replicas giving it to their master
    /// (`masterauth`); `redis-cli` here authenticates with it.
    pub fn start_with_password(masters: usize, replicas: usize, password: &str) -> io::Result<TestCluster> {
        Self::start_with(masters, replicas, Some(password))
    }

    /// Forms a cluster on fresh ports, trying again (up to three times)
    /// when a port was taken by another process or `redis-cli --cluster
    /// create` did not finish in time (it waits for ever on a node that
    /// went away).
    fn start_with(masters: usize, replicas: usize, password: Option<&str>) -> io::Result<TestCluster> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(masters, replicas, password) {
                Ok(c) => return Ok(c),
                Err(e) if matches!(e.kind(), io::ErrorKind::AddrInUse | io::ErrorKind::TimedOut) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no cluster formed")))
    }

    fn try_start(masters: usize, replicas: usize, password: Option<&str>) -> io::Result<TestCluster> {
        let dir = tempfile::Builder::new().prefix("hkv-redis-").tempdir()?;
        let count = masters * (1 + replicas);
        let ports = free_ports(count)?;
        let mut nodes = Vec::with_capacity(count);
        for (i, port) in ports.into_iter().enumerate() {
            let node_dir = dir.path().join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir)?;
            nodes.push(Node { port, dir: node_dir, child: None, cluster: true, password: password.map(String::from) });
        }
        let mut cluster = TestCluster { nodes, _dir: dir };
        for node in &mut cluster.nodes {
            node.spawn()?;
        }
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        args.extend(["--cluster-replicas".into(), replicas.to_string(), "--cluster-yes".into()]);
        // Its output to a file (a pipe could fill while it waits), and a
        // deadline: it waits for ever for a node that went away.
        let log_path = cluster._dir.path().join("create.log");
        let log = std::fs::File::create(&log_path)?;
        let mut create = cli(password).args(&args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log).spawn()?;
        let start = Instant::now();
        let status = loop {
            if let Some(st) = create.try_wait()? {
                break st;
            }
            if start.elapsed() > FORM_TIMEOUT {
                let _ = create.kill();
                let _ = create.wait();
                return Err(io::Error::new(io::ErrorKind::TimedOut, "redis-cli --cluster create did not finish"));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if !status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            )));
        }
        cluster.wait_healthy()?;
        Ok(cluster)
    }

    /// The seed URLs, `redis://127.0.0.1:PORT`, one per node.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(|n| format!("redis://127.0.0.1:{}", n.port)).collect()
    }

    /// The seeds as `--backing` takes them, comma-separated.
    pub fn seed_arg(&self) -> String {
        self.seeds().join(",")
    }

    /// Every node's port, in start order.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// Kills node `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Restarts node `i` from its folder (its `nodes.conf` and append-only
    /// file), so it rejoins with its data.
    pub fn restart(&mut self, i: usize) -> io::Result<()> {
        self.nodes[i].spawn()
    }

    /// Stops node `i` with SIGSTOP: its sockets stay open and the kernel
    /// still accepts connections and buffers commands for it, but nothing
    /// answers (a node stalled by the host, not one that is down).
    pub fn pause(&self, i: usize) -> io::Result<()> {
        self.signal(i, "-STOP")
    }

    /// Resumes node `i` after [`TestCluster::pause`] (SIGCONT): it then
    /// runs the commands buffered meanwhile.
    pub fn resume(&self, i: usize) -> io::Result<()> {
        self.signal(i, "-CONT")
    }

    fn signal(&self, i: usize, sig: &str) -> io::Result<()> {
        let pid = self.nodes[i].child.as_ref().map(Child::id).ok_or_else(|| io::Error::other("node not running"))?;
        let st = Command::new("kill").arg(sig).arg(pid.to_string()).stdin(Stdio::null()).status()?;
        if st.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill {sig} {pid}: {st}")))
        }
    }

    /// The replica of node `i` (a master), as an index, if it has one.
    pub fn replica_of(&self, i: usize) -> Option<usize> {
        let info = self.cli(i, &["info", "replication"]).ok()?;
        let port: u16 = info
            .lines()
            .find(|l| l.starts_with("slave0:"))?
            .split(',')
            .find_map(|f| f.strip_prefix("port="))?
            .trim()
            .parse()
            .ok()?;
        self.nodes.iter().position(|n| n.port == port)
    }

    /// Which node (an index) serves each hash slot, from `CLUSTER NODES`
    /// as node 0 sees it.
    pub fn slot_owners(&self) -> Vec<usize> {
        let ports = self.ports();
        let mut owners = vec![usize::MAX; 16384];
        for line in self.cli(0, &["cluster", "nodes"]).unwrap_or_default().lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let Some(port) = f.get(1).and_then(|a| a.split('@').next()?.rsplit(':').next()?.parse::<u16>().ok()) else {
                continue;
            };
            let Some(i) = ports.iter().position(|&p| p == port) else { continue };
            for range in f.iter().skip(8).filter(|r| !r.starts_with('[')) {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) else { continue };
                owners[a..=b.min(16383)].iter_mut().for_each(|o| *o = i);
            }
        }
        assert!(owners.iter().all(|&o| o < ports.len()), "every slot has a master");
        owners
    }

    /// Whether node `i`'s process runs.
    pub fn alive(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    /// Runs `redis-cli -p PORT-of-node-i ARGS` and returns its stdout.
    pub fn cli(&self, i: usize, args: &[&str]) -> io::Result<String> {
        cli_output(self.nodes[i].port, self.password(), args)
    }

    fn password(&self) -> Option<&str> {
        self.nodes.first().and_then(|n| n.password.as_deref())
    }

    /// Node `i`'s cluster id.
    pub fn node_id(&self, i: usize) -> io::Result<String> {
        Ok(self.cli(i, &["cluster", "myid"])?.trim().to_string())
    }

    /// Whether node `i` is a master now (replicas are promoted on failover).
    pub fn is_master(&self, i: usize) -> bool {
        self.cli(i, &["role"]).map(|o| o.starts_with("master")).unwrap_or(false)
    }

    /// Waits until every live node says `cluster_state:ok`, they agree on
    /// who serves all 16384 slots, and every live replica's link to its
    /// master is up (a replica that never synced cannot take over).
    pub fn wait_healthy(&self) -> io::Result<()> {
        wait_until(FORM_TIMEOUT, "every live node to report cluster_state:ok and synced replicas", || {
            self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let info = cli_output(n.port, self.password(), &["cluster", "info"]).unwrap_or_default();
                let repl = cli_output(n.port, self.password(), &["info", "replication"]).unwrap_or_default();
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_assigned:16384")
                    && (repl.contains("role:master") || repl.contains("master_link_status:up"))
            }) && self.check_all_agree()
        })
    }

    fn check_all_agree(&self) -> bool {
        let live: Vec<&Node> = self.nodes.iter().filter(|n| n.child.is_some()).collect();
        let Some(first) = live.first() else { return false };
        cli(self.password())
            .args(["--cluster", "check", &format!("127.0.0.1:{}", first.port)])
            .stdin(Stdio::null())
            .output()
            .map(|o| {
                let s = String::from_utf8_lossy(&o.stdout);
                s.contains("[OK] All nodes agree about slots configuration.")
                    && s.contains("[OK] All 16384 slots covered.")
            })
            .unwrap_or(false)
    }

    /// Moves `slots` hash slots from node `from` to node `to` with
    /// `redis-cli --cluster reshard` (live migration, keys moved with
    /// MIGRATE while clients keep running).
    pub fn reshard(&self, from: usize, to: usize, slots: u32) -> io::Result<Output> {
        let (from_id, to_id) = (self.node_id(from)?, self.node_id(to)?);
        cli(self.password())
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", self.nodes[from].port)])
            .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .args(["--cluster-pipeline", "100"])
            .stdin(Stdio::null())
            .output()
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }
}

/// A plain (non-cluster) `redis-server`, for tests of what a tier refuses.
pub struct TestServer {
    node: Node,
    _dir: tempfile::TempDir,
}

impl TestServer {
    /// Starts one standalone server on a free loopback port.
    pub fn start() -> io::Result<TestServer> {
        let dir = tempfile::Builder::new().prefix("hkv-redis-").tempdir()?;
        let port = free_ports(1)?[0];
        let mut node = Node { port, dir: dir.path().to_path_buf(), child: None, cluster: false, password: None };
        node.spawn()?;
        Ok(TestServer { node, _dir: dir })
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.node.port)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.node.kill();
    }
}

/// A loopback port nobody listens on (for "unreachable seed" tests).
pub fn dead_port() -> io::Result<u16> {
    Ok(free_ports(1)?[0])
}

/// `count` ports whose cluster bus ports (port + 10000) are free as well.
/// The kernel picks them (bind to port 0); a port taken by someone else
/// between this check and redis-server's bind fails that start loudly.
fn free_ports(count: usize) -> io::Result<Vec<u16>> {
    let mut ports = Vec::with_capacity(count);
    let mut held = Vec::new();
    for _ in 0..count * 50 {
        if ports.len() == count {
            break;
        }
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if port > 55_000 || ports.contains(&port) {
            held.push(l);
            continue;
        }
        if let Ok(bus) = TcpListener::bind(("127.0.0.1", port + 10_000)) {
            ports.push(port);
            held.push(bus);
        }
        held.push(l);
    }
    if ports.len() < count {
        return Err(io::Error::other("no free loopback ports below 55000"));
    }
    Ok(ports)
}

/// `redis-cli`, authenticating with `password` when given (through
/// `REDISCLI_AUTH`, so it is not on the command line).
fn cli(password: Option<&str>) -> Command {
    let mut c = Command::new("redis-cli");
    if let Some(pw) = password {
        c.env("REDISCLI_AUTH", pw);
    }
    c
}

fn cli_output(port: u16, password: Option<&str>, args: &[&str]) -> io::Result<String> {
    let out =
        cli(password).args(["-h", "127.0.0.1", "-p", &port.to_string()]).args(args).stdin(Stdio::null()).output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `ok` every 50 ms until it holds or `limit` has passed.
pub fn wait_until(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) -> io::Result<()> {
    let start = Instant::now();
    loop {
        if ok() {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("waited {limit:?} for {what}")));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where a node keeps its files (for a test that reads a node's log).
pub fn node_dir(cluster: &TestCluster, i: usize) -> &Path {
    &cluster.nodes[i].dir
}

/// The benchmarks' yardstick: a plain client of the same `redis` crate
/// with its own slot map and one multiplexed connection per master, which
/// sends one pipeline of slot-grouped commands per master, every master at
/// once (what the tier does, without a cache, a queue or a stream).
pub struct PlainClient {
    conns: HashMap<String, MultiplexedConnection>,
    slots: Vec<String>,
}

impl PlainClient {
    /// Connects to the cluster that `seed` (a `redis://` URL) belongs to.
    pub async fn connect(seed: &str) -> PlainClient {
        let mut c = redis::Client::open(seed).unwrap().get_multiplexed_async_connection().await.unwrap();
        let v: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut c).await.unwrap();
        let mut slots = vec![String::new(); 16384];
        let Value::Array(items) = v else { panic!("CLUSTER SLOTS: {v:?}") };
        for item in items {
            let Value::Array(f) = item else { continue };
            let (Value::Int(a), Value::Int(b), Value::Array(m)) = (&f[0], &f[1], &f[2]) else { continue };
            let (Value::BulkString(h), Value::Int(p)) = (&m[0], &m[1]) else { continue };
            let node = format!("{}:{p}", String::from_utf8_lossy(h));
            (*a as usize..=*b as usize).for_each(|s| slots[s] = node.clone());
        }
        let mut conns = HashMap::new();
        for node in slots.iter().filter(|n| !n.is_empty()) {
            if !conns.contains_key(node) {
                let c = redis::Client::open(format!("redis://{node}"))
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap();
                conns.insert(node.clone(), c);
            }
        }
        PlainClient { conns, slots }
    }

    /// One pipeline per node of one command per group, all nodes at once.
    pub async fn run(&self, cmds: Vec<(u16, redis::Cmd)>) -> Vec<Value> {
        let mut by_node: HashMap<&str, redis::Pipeline> = HashMap::new();
        for (slot, cmd) in cmds {
            by_node.entry(&self.slots[slot as usize]).or_insert_with(redis::pipe).add_command(cmd);
        }
        let futs = by_node.into_iter().map(|(node, pipe)| {
            let mut c = self.conns[node].clone();
            async move {
                let n = pipe.cmd_iter().count();
                c.req_packed_commands(&pipe, 0, n).await.unwrap()
            }
        });
        futures_util::future::join_all(futs).await.into_iter().flatten().collect()
    }

    /// One `MGET` per group of `keys`.
    pub fn mget(layout: &Layout, keys: &[u64]) -> Vec<(u16, redis::Cmd)> {
        group(layout, keys)
            .into_iter()
            .map(|(g, ks)| {
                let mut c = redis::cmd("MGET");
                ks.iter().for_each(|&k| {
                    c.arg(layout.row_key(k));
                });
                (layout.slot_of_group(g), c)
            })
            .collect()
    }

    /// One `MSET` per group of `keys`, each row `row` (version 1, score 0).
    pub fn mset(layout: &Layout, keys: &[u64], row: &[f32]) -> Vec<(u16, redis::Cmd)> {
        let mut buf = Vec::new();
        group(layout, keys)
            .into_iter()
            .map(|(g, ks)| {
                let mut c = redis::cmd("MSET");
                for k in ks {
                    buf.clear();
                    encode_row(1, 0, row, &mut buf);
                    c.arg(layout.row_key(k)).arg(&buf[..]);
                }
                (layout.slot_of_group(g), c)
            })
            .collect()
    }
}

fn group(layout: &Layout, keys: &[u64]) -> Vec<(u32, Vec<u64>)> {
    let mut g: HashMap<u32, Vec<u64>> = HashMap::new();
    keys.iter().for_each(|&k| g.entry(layout.group(k)).or_default().push(k));
    g.into_iter().collect()
}
