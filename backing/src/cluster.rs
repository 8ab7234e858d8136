//! The connection to the cluster: seeds checked one by one (so that a bad
//! URL, a dead seed and a non-cluster server each get their own error), the
//! slot map, one connection per node, and [`Cluster::run`], which sends a
//! batch of single-slot commands as one pipeline per node and follows the
//! cluster's redirections.

use std::time::{Duration, Instant};

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::future::join_all;
use parking_lot::{Mutex, RwLock};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};

use crate::error::Error;
use crate::layout::SLOTS;

/// The most rounds [`Cluster::run`] sends a batch's commands in (each
/// following the redirections of the one before), whatever the deadline.
pub const REDIRECT_ROUNDS: u32 = 64;

/// Timeouts and retries of the node connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Net {
    pub connect: Duration,
    pub response: Duration,
    pub retries: u32,
}

/// A seed as errors and logs show it: a password (`redis://:pw@…`,
/// `redis://user:pw@…`) replaced by `***`.
pub fn redact(seed: &str) -> String {
    match (seed.find("://"), seed.rfind('@')) {
        (Some(a), Some(b)) if b > a + 3 => {
            let user = seed[a + 3..b].split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &seed[..a + 3], &seed[b..])
        }
        (None, Some(b)) => format!("***{}", &seed[b..]),
        _ => seed.to_string(),
    }
}

/// The most seeds a table names: a few nodes find the rest of the cluster.
pub const MAX_SEEDS: usize = 64;

/// Parses `--backing`'s seeds: `redis://HOST:PORT` or `HOST:PORT`, TCP only,
/// with an optional password (`redis://:PASSWORD@HOST:PORT`) or ACL user
/// and password (`redis://USER:PASSWORD@HOST:PORT`): the first seed's are
/// used for every node of the cluster.
pub fn parse_seeds(seeds: &[String]) -> Result<Vec<ConnectionInfo>, Error> {
    if seeds.is_empty() {
        return Err(Error::BadUrl { url: String::new(), detail: "no seed given".into() });
    }
    if seeds.len() > MAX_SEEDS {
        return Err(Error::BadOption {
            name: "backing seeds",
            detail: format!(
                "{} seeds given, at most {MAX_SEEDS}: a few nodes of the cluster find the rest",
                seeds.len()
            ),
        });
    }
    seeds
        .iter()
        .map(|s| {
            let s = s.trim();
            let bad = |detail: String| Error::BadUrl { url: clip(&redact(s)), detail };
            if s.is_empty() {
                return Err(bad("empty seed".into()));
            }
            let url = if s.contains("://") { s.to_string() } else { format!("redis://{s}") };
            if !url.starts_with("redis://") {
                return Err(bad("only redis:// (TCP) seeds name cluster nodes".into()));
            }
            // The address is what follows the credentials. The URL parser
            // would take `HOST` alone as port 6379 and keep a query or a
            // fragment unread: a seed names its node's port, and nothing
            // else.
            let addr = url["redis://".len()..].rsplit_once('@').map_or(&url["redis://".len()..], |(_, a)| a);
            if addr.contains(['?', '#']) {
                return Err(bad(
                    "a query (?...) or fragment (#...) names nothing here; write the node's address alone".into(),
                ));
            }
            // Any path, `/` and `/0` too: the docs say a seed names a node
            // and nothing else (`/0` and `/` were accepted, `/5` refused).
            if let Some((node, path)) = addr.split_once('/') {
                return Err(bad(format!(
                    "{:?} is followed by a path (/{}), which names nothing here: a cluster has database 0 only; \
                     write HOST:PORT alone",
                    clip(node),
                    clip(path)
                )));
            }
            let hostport = addr;
            // Blanks around a seed are trimmed (as `--backing`'s list
            // trims them after each comma); one inside its address made
            // the URL parser answer "did not parse", naming nothing.
            if hostport.contains(char::is_whitespace) {
                return Err(bad(format!("{:?} holds a blank; write HOST:PORT without blanks", clip(hostport))));
            }
            let port = hostport
                .rsplit_once(':')
                .filter(|(h, p)| !h.is_empty() && !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .map(|(_, p)| p);
            let Some(port) = port else {
                return Err(bad(format!(
                    "{:?} has no port; name the node's port (HOST:PORT), there is no default",
                    clip(hostport)
                )));
            };
            // `127.0.0.1:99999` got the URL parser's "InvalidClientConfig",
            // which named neither the port nor its range.
            if !port.parse::<u16>().is_ok_and(|p| p != 0) {
                return Err(bad(format!("port {} is out of range: a port is 1 to 65535", clip(port))));
            }
            let info = url.as_str().into_connection_info().map_err(|e| bad(clip(&e.to_string())))?;
            if info.redis_settings().db() != 0 {
                return Err(bad(format!(
                    "database {}: a cluster has database 0 only (leave the path out)",
                    info.redis_settings().db()
                )));
            }
            match info.addr() {
                ConnectionAddr::Tcp(host, port) if !host.is_empty() && *port != 0 => Ok(info),
                _ => Err(bad("a seed needs a host and a port".into())),
            }
        })
        .collect::<Result<Vec<_>, Error>>()
        .and_then(|infos| {
            // The first seed's credentials are every node's: a later seed
            // that names others would be ignored, and a restart that asks
            // for them refused, so it is refused here.
            let creds = |i: &ConnectionInfo| {
                (i.redis_settings().username().map(str::to_owned), i.redis_settings().password().map(str::to_owned))
            };
            let first = creds(&infos[0]);
            for (n, info) in infos.iter().enumerate() {
                if infos[..n].iter().any(|i| name(i) == name(info)) {
                    return Err(Error::BadOption {
                        name: "backing seeds",
                        detail: format!("{} is given twice; name each node once", clip(&name(info))),
                    });
                }
            }
            for (n, (info, raw)) in infos.iter().zip(seeds).enumerate().skip(1) {
                let c = creds(info);
                if c != (None, None) && c != first {
                    return Err(Error::BadUrl {
                        url: clip(&redact(raw.trim())),
                        detail: format!(
                            "seed {} gives other credentials than the first seed, whose credentials are used for \
                             every node: give them on the first seed (or the same on every seed)",
                            n + 1
                        ),
                    });
                }
            }
            Ok(infos)
        })
}

/// `cluster 1: A, B; cluster 2: C` for seed groups ([`seed_clusters`]),
/// each seed as errors show it (password hidden, long input clipped).
pub(crate) fn describe_groups(seeds: &[String], groups: &[Vec<usize>]) -> String {
    let seed = |i: usize| clip(&redact(seeds[i].trim()));
    (groups.iter().enumerate())
        .map(|(n, g)| format!("cluster {}: {}", n + 1, g.iter().map(|&i| seed(i)).collect::<Vec<_>>().join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

fn name(info: &ConnectionInfo) -> String {
    match info.addr() {
        ConnectionAddr::Tcp(h, p) => node_addr(h, *p),
        other => other.to_string(),
    }
}

/// A node's address as errors, logs and stats show it and as the slot map
/// keys it: `HOST:PORT`, an IPv6 host in brackets (`[::1]:7101`, never
/// the ambiguous `::1:7101` that Redis itself writes in `MOVED`).
pub(crate) fn node_addr(host: &str, port: u16) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A redirection's target as Redis writes it (`V6:PORT` unbracketed) in
/// the form errors, logs and stats name nodes ([`node_addr`]).
pub(crate) fn node_name(addr: &str) -> String {
    match split_addr(addr) {
        Some((h, p)) => node_addr(h, p),
        None => addr.to_string(),
    }
}

/// `HOST:PORT`, `[V6]:PORT` or Redis's `V6:PORT` (a redirection's target)
/// as the host to connect to (brackets dropped) and the port.
fn split_addr(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host, port.parse().ok()?)).filter(|(h, _)| !h.is_empty())
}

/// A node's address as `from` (`HOST:PORT`, the node that named it)
/// wrote it, where an empty host (`:7320`) is `from`'s own: a node that
/// never met another (a one-master cluster made with `CLUSTER
/// ADDSLOTSRANGE`) does not know its address and names itself so, in
/// `CLUSTER SLOTS` and `MOVED` alike, meaning "the host you reached me
/// at" (a tester's one-master cluster was refused with "node :7320: not
/// HOST:PORT").
fn resolve(host: &str, port: u16, from: &str) -> Arc<str> {
    let host = if host.is_empty() { split_addr(from).map_or("", |(h, _)| h) } else { host };
    node_addr(host, port).into()
}

/// A redirection's target (`HOST:PORT`, Redis's `V6:PORT`, or `:PORT`)
/// sent by node `from`, as [`resolve`] reads it.
fn target_of(addr: &str, from: &str) -> Option<Arc<str>> {
    let (host, port) = addr.rsplit_once(':')?;
    Some(resolve(host.trim_start_matches('[').trim_end_matches(']'), port.parse().ok()?, from))
}

/// Probes each seed with a plain connection: the first that answers
/// `CLUSTER INFO` as a cluster node wins; a non-cluster server is refused
/// by name; none answering is `Unreachable`.
async fn probe(seeds: &[ConnectionInfo], net: Net) -> Result<(), Error> {
    let mut last = String::from("no seed");
    for info in seeds {
        let node = name(info);
        let client = redis::Client::open(info.clone())
            .map_err(|e| Error::BadUrl { url: clip(&node), detail: clip(&e.to_string()) })?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(net.connect))
            .set_response_timeout(Some(net.response));
        let mut conn = match client.get_multiplexed_async_connection_with_config(&cfg).await {
            Ok(c) => c,
            Err(e) if e.kind() == redis::ErrorKind::AuthenticationFailed => {
                return Err(Error::Auth { node: clip(&node), detail: clip(&e.to_string()) })
            }
            // Bytes came back that are not Redis's protocol (an HTTP
            // server's page): the seed is something else, not down.
            Err(e) if e.kind() == redis::ErrorKind::Parse => {
                let detail = e.to_string().lines().next().unwrap_or("").trim().to_string();
                return Err(Error::NotRedis { node: clip(&node), detail: clip(&detail) });
            }
            Err(e) => {
                last = clip(&format!("{node}: {e}"));
                continue;
            }
        };
        let info: Result<String, _> = redis::cmd("CLUSTER").arg("INFO").query_async(&mut conn).await;
        return match info {
            Ok(text) if text.contains("cluster_state:") => Ok(()),
            Ok(text) => Err(Error::NotCluster { node, detail: text.lines().next().unwrap_or("").to_string() }),
            Err(e) if e.code() == Some("NOAUTH") || e.kind() == redis::ErrorKind::AuthenticationFailed => {
                Err(Error::Auth { node, detail: e.to_string() })
            }
            Err(e) => Err(Error::NotCluster { node, detail: e.to_string() }),
        };
    }
    Err(Error::Unreachable { seeds: seeds.iter().map(|s| clip(&name(s))).collect::<Vec<_>>().join(","), detail: last })
}

/// The seeds that answer, grouped by the cluster they belong to, each
/// group in the seeds' order, groups in the order of their first seed;
/// seeds that do not answer (down, stalled past the response timeout) are
/// in none. Every seed is asked at once for its `CLUSTER MYID` and
/// `CLUSTER NODES`: a seed is in a group when its id is among the node
/// ids of the group's first seed (a tester's table named a node of each of
/// two clusters, was accepted, and a restart that found one of them
/// stopped opened the table on the other).
pub(crate) async fn seed_clusters(seeds: &[ConnectionInfo], net: Net) -> Vec<Vec<usize>> {
    let ask = seeds.iter().map(|info| async move {
        let client = redis::Client::open(info.clone()).ok()?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(net.connect))
            .set_response_timeout(Some(net.response));
        let mut conn = client.get_multiplexed_async_connection_with_config(&cfg).await.ok()?;
        let id: String = redis::cmd("CLUSTER").arg("MYID").query_async(&mut conn).await.ok()?;
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(&mut conn).await.ok()?;
        let ids: Vec<String> = nodes.lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect();
        Some((id.trim().to_string(), ids))
    });
    let answers = join_all(ask).await;
    // Each group: its seeds and the node ids its first seed knows.
    let mut groups: Vec<(Vec<usize>, Vec<String>)> = Vec::new();
    for (i, a) in answers.into_iter().enumerate() {
        let Some((id, ids)) = a else { continue };
        match groups.iter_mut().find(|(_, known)| known.contains(&id)) {
            Some((members, _)) => members.push(i),
            None => groups.push((vec![i], ids)),
        }
    }
    groups.into_iter().map(|(members, _)| members).collect()
}

/// Whether a connection's failure is the node refusing the credentials
/// (`WRONGPASS`, `NOAUTH`, the client's authentication failure).
pub(crate) fn is_auth_refusal(detail: &str) -> bool {
    ["WRONGPASS", "NOAUTH", "AuthenticationFailed", "authentication failed", "Authentication failed"]
        .iter()
        .any(|w| detail.contains(w))
}

/// At most this many characters of a user's input are echoed in an
/// error: a 100 000-character host name was echoed twice in a 200 KB
/// error.
pub const ECHO_CHARS: usize = 200;

/// `text` as errors echo it: its first [`ECHO_CHARS`] characters, then
/// `…` when there were more.
pub fn clip(text: &str) -> String {
    match text.char_indices().nth(ECHO_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// A failed command.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// Its node had not answered by the deadline.
    Late,
    /// Its node failed (or it was redirected more often than retries allow).
    Node { node: String, detail: String },
}

/// Which node serves each slot, from `CLUSTER SLOTS`, patched by `MOVED`.
#[derive(Debug)]
struct Topology {
    slots: Vec<Option<Arc<str>>>,
    /// One more with each change of `slots` (readers of the whole map
    /// keep what they derived from it until this moves).
    generation: u64,
}

/// A connected cluster: our own slot map and one multiplexed connection
/// per node.
///
/// Why not the crate's `ClusterConnection`: while it recovers from one dead
/// node it holds up the commands of every node (measured on a 3-master
/// cluster with one master killed: every read of the live masters timed
/// out, rounds of 4 s, until the node came back). Routing here keeps a dead
/// node's slots failing fast and the others served.
pub(crate) struct Cluster {
    seeds: Vec<ConnectionInfo>,
    net: Net,
    topo: RwLock<Topology>,
    conns: Mutex<HashMap<Arc<str>, MultiplexedConnection>>,
    /// Nodes whose last connection attempt failed, and when to try again:
    /// a dead node costs each request nothing until then.
    down: Mutex<HashMap<Arc<str>, (Instant, String)>>,
    refreshed: Mutex<Option<Instant>>,
    /// Slots that a `MOVED` moved to another node since the slot map's
    /// last logged change: counted in the next one, with those the map
    /// itself changed (a graceful failover's slots come mostly one by one
    /// through `MOVED`, and a tester's 5461-slot master logged `slots=27`).
    moved: Mutex<std::collections::BTreeSet<u16>>,
    /// The table whose tier this is (named in the log).
    table: String,
}

impl Cluster {
    /// Checks the seeds and reads the slot map. With `one_cluster`, seeds
    /// that answer from more than one cluster are refused
    /// ([`Error::SeedsSplit`], naming which seeds belong together).
    pub async fn open(table: &str, seeds: &[String], net: Net, one_cluster: bool) -> Result<Cluster, Error> {
        let infos = parse_seeds(seeds)?;
        probe(&infos, net).await?;
        if one_cluster {
            let groups = seed_clusters(&infos, net).await;
            if groups.len() > 1 {
                return Err(Error::SeedsSplit { groups: describe_groups(seeds, &groups) });
            }
        }
        let cluster = Cluster {
            seeds: infos,
            net,
            topo: RwLock::new(Topology { slots: vec![None; SLOTS as usize], generation: 0 }),
            conns: Mutex::new(HashMap::new()),
            down: Mutex::new(HashMap::new()),
            refreshed: Mutex::new(None),
            moved: Mutex::new(std::collections::BTreeSet::new()),
            table: table.to_string(),
        };
        cluster.refresh().await?;
        if cluster.masters() == 0 {
            return Err(Error::Unreachable {
                seeds: seeds.iter().map(|s| clip(&redact(s))).collect::<Vec<_>>().join(","),
                detail: "the cluster serves no slots yet".into(),
            });
        }
        let unserved = cluster.unserved();
        if !unserved.is_empty() {
            return Err(Error::SlotsUnserved { table: table.into(), ranges: unserved });
        }
        cluster.check_credentials().await?;
        Ok(cluster)
    }

    /// The hash slots no master serves, as ranges (`5461-10922, 16000`);
    /// empty when every slot is served. (A cluster with unassigned slots
    /// was accepted, and every request on a key of theirs failed.)
    fn unserved(&self) -> String {
        let t = self.topo.read();
        let mut ranges: Vec<String> = Vec::new();
        let mut slot = 0;
        while slot < t.slots.len() {
            if t.slots[slot].is_some() {
                slot += 1;
                continue;
            }
            let first = slot;
            while slot < t.slots.len() && t.slots[slot].is_none() {
                slot += 1;
            }
            ranges.push(if slot - 1 == first { first.to_string() } else { format!("{first}-{}", slot - 1) });
        }
        if ranges.len() > 8 {
            let n = ranges.len();
            ranges.truncate(8);
            ranges.push(format!("… {} ranges in all", n));
        }
        ranges.join(", ")
    }

    /// Connects to every master at once: one that refuses the seed's
    /// credentials ([`Error::Auth`], naming it) refuses the table, as the
    /// seed itself would have. (An ACL user present on one node only made
    /// `create-table` answer `backing_unavailable … retry`, as if a node
    /// were down.) A master that cannot be reached is left for the
    /// requests to find.
    async fn check_credentials(&self) -> Result<(), Error> {
        let masters: Vec<Arc<str>> = self.master_nodes().into_iter().map(Arc::from).collect();
        let tries = masters.iter().map(|n| self.conn(n, self.net.response));
        for (node, r) in masters.iter().zip(join_all(tries).await) {
            if let Err(detail) = r {
                if is_auth_refusal(&detail) {
                    return Err(Error::Auth { node: node.to_string(), detail });
                }
            }
        }
        Ok(())
    }

    /// Masters serving slots.
    pub fn masters(&self) -> usize {
        self.master_nodes().len()
    }

    /// The masters serving slots (`HOST:PORT`), as last seen, sorted.
    pub fn master_nodes(&self) -> Vec<String> {
        let t = self.topo.read();
        let mut m: Vec<&str> = t.slots.iter().flatten().map(|s| &**s).collect();
        m.sort_unstable();
        m.dedup();
        m.into_iter().map(String::from).collect()
    }

    /// The node serving `slot`, as last seen, or `cluster`.
    pub fn node_of(&self, slot: u16) -> String {
        self.topo.read().slots[slot as usize].as_deref().unwrap_or("cluster").to_string()
    }

    /// A `MOVED` named `node` for `slot`: the slot map says so now, and
    /// a move from another node counts in the next logged change.
    fn patch(&self, slot: u16, node: Arc<str>) {
        let mut topo = self.topo.write();
        let old = &mut topo.slots[slot as usize];
        if old.as_ref() != Some(&node) {
            if old.is_some() {
                self.moved.lock().insert(slot);
            }
            *old = Some(node);
            topo.generation += 1;
        }
    }

    /// The slot map's generation: it moves whenever the map changes.
    pub fn generation(&self) -> u64 {
        self.topo.read().generation
    }

    fn node_arc(&self, slot: u16) -> Option<Arc<str>> {
        self.topo.read().slots[slot as usize].clone()
    }

    /// A connection to `node`, made on first use.
    async fn conn(&self, node: &Arc<str>, response: Duration) -> Result<MultiplexedConnection, String> {
        if let Some(c) = self.conns.lock().get(node) {
            return Ok(c.clone());
        }
        if let Some((until, why)) = self.down.lock().get(node) {
            if Instant::now() < *until {
                return Err(format!("{why} (its last connection attempt, under 200 ms ago)"));
            }
        }
        let c = self.connect(node, response).await.inspect_err(|e| self.note_down(node, e))?;
        self.note_up(node);
        self.conns.lock().insert(node.clone(), c.clone());
        Ok(c)
    }

    /// A connection to `node` failed: it is tried again no sooner than in
    /// 200 ms, and the log says so once, until it answers again.
    fn note_down(&self, node: &Arc<str>, e: &str) {
        let was = self.down.lock().insert(node.clone(), (Instant::now() + Duration::from_millis(200), e.to_string()));
        if was.is_none() {
            tracing::warn!(table = %self.table, %node, error = %e, "a cluster node cannot be reached; its slots' misses and writes fail until it (or a replica taking over) answers");
        }
    }

    /// A connection to `node` was made.
    fn note_up(&self, node: &Arc<str>) {
        if self.down.lock().remove(node).is_some() {
            tracing::info!(table = %self.table, %node, "a cluster node answers again");
        }
    }

    async fn connect(&self, node: &str, response: Duration) -> Result<MultiplexedConnection, String> {
        // The node's address with the first seed's credentials.
        let (host, port) = split_addr(node).ok_or_else(|| format!("{node}: not HOST:PORT"))?;
        let info = self.seeds[0].clone().set_addr(ConnectionAddr::Tcp(host.to_string(), port));
        let client = redis::Client::open(info).map_err(|e| e.to_string())?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.net.connect))
            .set_response_timeout(Some(response));
        client.get_multiplexed_async_connection_with_config(&cfg).await.map_err(|e| e.to_string())
    }

    /// A connection of its own to the node serving `slot`, for blocking
    /// reads (the stream consumer) that must not hold up other commands.
    pub async fn dedicated(&self, slot: u16, block: Duration) -> Result<MultiplexedConnection, Error> {
        self.dedicated_to(&self.node_of(slot), block).await
    }

    /// A connection of its own to `node` (`HOST:PORT`, or a redirection's
    /// target as Redis writes it), for blocking reads; the node's name as
    /// [`node_addr`] writes it comes with it.
    pub async fn dedicated_to(&self, node: &str, block: Duration) -> Result<MultiplexedConnection, Error> {
        let node: Arc<str> = node_name(node).into();
        match self.connect(&node, block + self.net.response).await {
            Ok(c) => {
                self.note_up(&node);
                Ok(c)
            }
            Err(detail) => {
                self.note_down(&node, &detail);
                Err(Error::Unavailable { node: node.to_string(), detail })
            }
        }
    }

    fn forget(&self, node: &Arc<str>) {
        self.conns.lock().remove(node);
    }

    /// Runs one command per entry, each on the node serving its slot: one
    /// pipeline per node, all nodes at once, so a batch costs one round
    /// trip per node. `MOVED` patches the slot map and resends, `ASK`
    /// resends to the importing node behind `ASKING`, `TRYAGAIN` /
    /// `CLUSTERDOWN` / `LOADING` resend after 25 ms, a failed connection
    /// resends when a fresh slot map names another node (a failover), and
    /// once to the same node on a new connection (a node restarted since
    /// its pooled connection was made); all within the deadline, with at
    /// most `retries` rounds in which a node failed (redirections alone do
    /// not count: a reshard redirects many commands) and
    /// [`REDIRECT_ROUNDS`] in all.
    ///
    /// A command of several keys (`MGET`, `MSET`, `DEL`) answered
    /// `TRYAGAIN` or `ASK` is resent as one command per key, each
    /// following its own `ASK`, and their answers merged into its own: a
    /// slot being migrated answers a multi-key command whose keys are
    /// split between the two nodes with `TRYAGAIN` (and the importing node
    /// answers one whose keys it lacks with `TRYAGAIN` too) for as long as
    /// the migration lasts, while it serves each key alone.
    pub async fn run(&self, cmds: Vec<(u16, Cmd)>, deadline: tokio::time::Instant) -> Vec<Result<Value, Failure>> {
        self.run_at(cmds, deadline).await.0
    }

    /// [`Cluster::run`], and per command the nodes that answered it
    /// without an error: the node it was last sent to, or for a command
    /// split into one per key, each key's (a migration's source and its
    /// importing node). A write's `WAIT` goes to each of them.
    pub async fn run_at(
        &self,
        cmds: Vec<(u16, Cmd)>,
        deadline: tokio::time::Instant,
    ) -> (Vec<Result<Value, Failure>>, Vec<Vec<Arc<str>>>) {
        // Commands move into the pipelines; the few a round resends are
        // cloned back out of them (a batch's rows are not copied per send).
        let (mut slots, mut cmds): (Vec<u16>, Vec<Cmd>) = cmds.into_iter().unzip();
        let n = cmds.len();
        // Commands split into one per key: each parent, what it was, and
        // its children (appended after the batch's own commands).
        let mut splits: Vec<(usize, Multi, std::ops::Range<usize>)> = Vec::new();
        let mut out: Vec<Option<Result<Value, Failure>>> = vec![None; cmds.len()];
        // The node whose answer is in `out`, where it is not an error.
        let mut at: Vec<Option<Arc<str>>> = vec![None; cmds.len()];
        let mut todo: Vec<(usize, Option<Arc<str>>)> = (0..cmds.len()).map(|i| (i, None)).collect();
        let mut resent_same = vec![false; cmds.len()];
        // Whether a command's last answer was a redirection.
        let mut redirected = vec![false; cmds.len()];
        // Rounds in which a node failed count against `retries`; rounds
        // that only followed redirections (a reshard's MOVED, ASK and
        // TRYAGAIN, which are normal while slots move) are bounded by the
        // deadline and REDIRECT_ROUNDS alone.
        let (mut failed_rounds, mut rounds) = (0u32, 0u32);
        while !todo.is_empty() {
            let last = failed_rounds == self.net.retries + 1 || rounds + 1 == REDIRECT_ROUNDS;
            rounds += 1;
            let mut failed = false;
            let mut by_node: HashMap<Arc<str>, Vec<(usize, bool)>> = HashMap::new();
            for (i, ask) in todo.drain(..) {
                let asking = ask.is_some();
                match ask.or_else(|| self.node_arc(slots[i])) {
                    Some(node) => by_node.entry(node).or_default().push((i, asking)),
                    None => {
                        out[i] = Some(Err(Failure::Node {
                            node: "cluster".into(),
                            detail: format!("no node serves hash slot {} (the cluster has no master for it)", slots[i]),
                        }))
                    }
                }
            }
            let sends = by_node.into_iter().map(|(node, ix)| {
                let mut pipe = redis::pipe();
                let mut count = 0;
                for &(i, asking) in &ix {
                    if asking {
                        pipe.cmd("ASKING");
                        count += 1;
                    }
                    pipe.add_command(std::mem::take(&mut cmds[i]));
                    count += 1;
                }
                async move {
                    let r = tokio::time::timeout_at(deadline, async {
                        let mut c = self.conn(&node, self.net.response).await?;
                        c.req_packed_commands(&pipe, 0, count).await.map_err(|e| {
                            self.forget(&node);
                            e.to_string()
                        })
                    })
                    .await;
                    (node, ix, r, pipe)
                }
            });
            let (mut refresh, mut pause) = (false, false);
            let mut dead: Vec<(usize, Arc<str>)> = Vec::new();
            let results = join_all(sends).await;
            for (node, ix, r, pipe) in results {
                // What a failed or redirected command is resent as: its
                // copy in the pipeline (ASKING skipped), cloned only then.
                let sent: Vec<&Cmd> = pipe.cmd_iter().filter(|c| !is_asking(c)).collect();
                let resend = |cmds: &mut Vec<Cmd>, p: usize, i: usize| {
                    if let Some(c) = sent.get(p) {
                        cmds[i] = (*c).clone();
                    }
                };
                let values = match r {
                    Err(_) => {
                        // The node's answer is still coming on the pooled
                        // connection: a later command sent there would wait
                        // behind it (a late read of 64 MB of rows held up
                        // the next request's reads for as long), so the
                        // next command gets a connection of its own.
                        self.forget(&node);
                        ix.iter().for_each(|&(i, _)| out[i] = Some(Err(Failure::Late)));
                        continue;
                    }
                    Ok(Err(detail)) => {
                        (refresh, failed) = (true, true);
                        for (p, &(i, _)) in ix.iter().enumerate() {
                            redirected[i] = false;
                            out[i] = Some(Err(Failure::Node { node: node.to_string(), detail: detail.clone() }));
                            dead.push((i, node.clone()));
                            resend(&mut cmds, p, i);
                        }
                        continue;
                    }
                    Ok(Ok(v)) => v,
                };
                let mut values = values.into_iter();
                for (p, &(i, asking)) in ix.iter().enumerate() {
                    if asking {
                        values.next();
                    }
                    let v = values.next().unwrap_or(Value::Nil);
                    let Value::ServerError(e) = &v else {
                        out[i] = Some(Ok(v));
                        at[i] = Some(node.clone());
                        continue;
                    };
                    let detail = e.details().unwrap_or("").to_string();
                    out[i] =
                        Some(Err(Failure::Node { node: node.to_string(), detail: format!("{} {detail}", e.code()) }));
                    if last {
                        continue;
                    }
                    let target = detail.split(' ').nth(1).and_then(|t| target_of(t, &node));
                    if matches!(e.code(), "MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN") {
                        resend(&mut cmds, p, i);
                    }
                    redirected[i] = matches!(e.code(), "MOVED" | "ASK" | "TRYAGAIN");
                    if matches!(e.code(), "ASK" | "TRYAGAIN") {
                        if let Some((multi, keys)) = split(&cmds[i]) {
                            // Sent to the slot's owner, each: a key it
                            // still has is served there, one that moved is
                            // asked of the importing node.
                            let first = cmds.len();
                            for c in keys {
                                slots.push(slots[i]);
                                cmds.push(c);
                                out.push(None);
                                at.push(None);
                                resent_same.push(false);
                                redirected.push(false);
                                todo.push((cmds.len() - 1, None));
                            }
                            splits.push((i, multi, first..cmds.len()));
                            continue;
                        }
                    }
                    match e.code() {
                        "MOVED" => {
                            if let Some(t) = target {
                                self.patch(slots[i], t);
                            }
                            refresh = true;
                            todo.push((i, None));
                        }
                        "ASK" => todo.push((i, target)),
                        "TRYAGAIN" => {
                            pause = true;
                            todo.push((i, None));
                        }
                        "CLUSTERDOWN" | "LOADING" | "MASTERDOWN" => {
                            (pause, failed) = (true, true);
                            todo.push((i, None));
                        }
                        _ => {}
                    }
                }
            }
            if refresh {
                self.refresh_soon().await;
            }
            if !last {
                for (i, node) in dead {
                    // Another node serves the slot now (a failover), or the
                    // node's pooled connection died while the node lived
                    // (restarted, a reset): resent, to the same node once
                    // on a fresh connection. A node that is down refuses
                    // that connection at once.
                    match self.node_arc(slots[i]) {
                        Some(n) if n != node => todo.push((i, None)),
                        Some(_) if !resent_same[i] => {
                            resent_same[i] = true;
                            todo.push((i, None));
                        }
                        _ => {}
                    }
                }
            }
            if pause && !todo.is_empty() {
                tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + Duration::from_millis(25))).await;
            }
            failed_rounds += u32::from(failed);
            if tokio::time::Instant::now() >= deadline {
                // Commands still being redirected (slots moving) are late,
                // not failed: their nodes are up.
                for (i, _) in todo.drain(..) {
                    if redirected[i] {
                        out[i] = Some(Err(Failure::Late));
                    }
                }
            }
        }
        let mut out: Vec<Result<Value, Failure>> = out.into_iter().map(|o| o.unwrap_or(Err(Failure::Late))).collect();
        // A command answered with an error has no node that took it.
        let mut nodes: Vec<Vec<Arc<str>>> =
            at.into_iter().zip(&out).map(|(a, o)| a.filter(|_| o.is_ok()).into_iter().collect()).collect();
        let mut children = out.split_off(n).into_iter();
        let mut child_nodes = nodes.split_off(n).into_iter();
        for (parent, multi, range) in splits {
            out[parent] = merge(multi, children.by_ref().take(range.len()).collect());
            let mut took: Vec<Arc<str>> = child_nodes.by_ref().take(range.len()).flatten().collect();
            took.sort_unstable();
            took.dedup();
            nodes[parent] = took;
        }
        (out, nodes)
    }

    /// Runs one command on `node` (`HOST:PORT`) itself, on its shared
    /// connection (`WAIT` counts the writes sent on that connection).
    pub async fn on_node(&self, node: &str, cmd: Cmd) -> Result<Value, String> {
        let node: Arc<str> = node.into();
        let mut c = self.conn(&node, self.net.response).await?;
        c.req_packed_command(&cmd).await.map_err(|e| {
            self.forget(&node);
            e.to_string()
        })
    }

    /// Runs one command on the node serving `slot`.
    pub async fn one(&self, slot: u16, cmd: Cmd) -> Result<Value, Error> {
        let deadline = tokio::time::Instant::now() + self.net.response * (self.net.retries + 2);
        match self.run(vec![(slot, cmd)], deadline).await.pop() {
            Some(Ok(v)) => Ok(v),
            Some(Err(Failure::Node { node, detail })) => Err(Error::Unavailable { node, detail }),
            _ => Err(Error::Unavailable { node: self.node_of(slot), detail: "timed out".into() }),
        }
    }

    /// Re-reads the slot map, at most every 250 ms (a storm of failed
    /// slots asks once).
    pub async fn refresh_soon(&self) {
        {
            let mut last = self.refreshed.lock();
            if last.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
                return;
            }
            *last = Some(Instant::now());
        }
        let _ = self.refresh().await;
    }

    /// Asks the known nodes, then the seeds, for `CLUSTER SLOTS`; the first
    /// answer wins.
    async fn refresh(&self) -> Result<(), Error> {
        let mut nodes: Vec<Arc<str>> = {
            let t = self.topo.read();
            let mut n: Vec<Arc<str>> = t.slots.iter().flatten().cloned().collect();
            n.sort_unstable();
            n.dedup();
            n
        };
        nodes.extend(self.seeds.iter().map(|s| Arc::<str>::from(name(s))));
        let mut last = String::from("no node");
        for node in nodes {
            let mut c = match self.conn(&node, self.net.response).await {
                Ok(c) => c,
                Err(e) => {
                    last = format!("{node}: {e}");
                    continue;
                }
            };
            match redis::cmd("CLUSTER").arg("SLOTS").query_async::<Value>(&mut c).await {
                Ok(v) => {
                    let slots = parse_slots(v, &node);
                    if slots.iter().any(Option::is_some) {
                        let mut topo = self.topo.write();
                        let mut moved = std::mem::take(&mut *self.moved.lock());
                        let changed = topo.slots.iter().zip(&slots).enumerate();
                        moved.extend(changed.filter(|(_, (a, b))| a.is_some() && a != b).map(|(s, _)| s as u16));
                        let moved = moved.len();
                        if moved > 0 {
                            tracing::info!(table = %self.table, slots = moved, from = %node, "the cluster's slot map changed (a failover or a reshard)");
                        }
                        *topo = Topology { slots, generation: topo.generation + 1 };
                        drop(topo);
                        *self.refreshed.lock() = Some(Instant::now());
                        return Ok(());
                    }
                    last = format!("{node}: serves no slots");
                }
                Err(e) => {
                    self.forget(&node);
                    last = format!("{node}: {e}");
                }
            }
        }
        Err(Error::Unavailable { node: "cluster".into(), detail: format!("CLUSTER SLOTS: {last}") })
    }
}

/// A multi-key command that a migration may split: what its per-key
/// commands' answers merge into.
#[derive(Debug, Clone, Copy)]
enum Multi {
    /// `MGET` → `GET`s: the array of their answers.
    Get,
    /// `MSET` → `SET`s: `OK`.
    Set,
    /// `DEL` → `DEL`s: the sum of their counts.
    Del,
}

/// `cmd` as one command per key, when it is an `MGET`, `MSET` or `DEL` of
/// more than one key.
fn split(cmd: &Cmd) -> Option<(Multi, Vec<Cmd>)> {
    let mut args = cmd.args_iter().map(|a| match a {
        redis::Arg::Simple(b) => b,
        _ => &[],
    });
    let name = args.next()?.to_ascii_uppercase();
    let rest: Vec<&[u8]> = args.collect();
    let (multi, per_key) = match &name[..] {
        b"MGET" => (Multi::Get, 1),
        b"MSET" => (Multi::Set, 2),
        b"DEL" => (Multi::Del, 1),
        _ => return None,
    };
    if rest.len() <= per_key || rest.len() % per_key != 0 {
        return None;
    }
    let single = match multi {
        Multi::Get => "GET",
        Multi::Set => "SET",
        Multi::Del => "DEL",
    };
    let cmds = rest
        .chunks_exact(per_key)
        .map(|a| {
            let mut c = redis::cmd(single);
            a.iter().for_each(|b| {
                c.arg(*b);
            });
            c
        })
        .collect();
    Some((multi, cmds))
}

/// The answer of a split command from its per-key answers (a server's
/// refusal is a node's failure by then): the first node's failure if one
/// failed, else late if one was, else the merged answer.
fn merge(multi: Multi, answers: Vec<Result<Value, Failure>>) -> Result<Value, Failure> {
    let mut values = Vec::with_capacity(answers.len());
    let mut late = false;
    for a in answers {
        match a {
            Ok(v) => values.push(v),
            Err(f @ Failure::Node { .. }) => return Err(f),
            Err(Failure::Late) => late = true,
        }
    }
    if late {
        return Err(Failure::Late);
    }
    Ok(match multi {
        Multi::Get => Value::Array(values),
        Multi::Set => Value::Okay,
        Multi::Del => Value::Int(values.iter().map(|v| if let Value::Int(n) = v { *n } else { 0 }).sum()),
    })
}

fn is_asking(c: &Cmd) -> bool {
    c.args_iter().next().is_some_and(|a| matches!(a, redis::Arg::Simple(b) if b.eq_ignore_ascii_case(b"ASKING")))
}

/// `CLUSTER SLOTS`' answer, given by node `from`, as a slot → master
/// table (a master without a host is `from`'s host, [`resolve`]).
fn parse_slots(v: Value, from: &str) -> Vec<Option<Arc<str>>> {
    let mut slots = vec![None; SLOTS as usize];
    let Value::Array(items) = v else { return slots };
    for item in items {
        let Value::Array(f) = item else { continue };
        let (Some(Value::Int(a)), Some(Value::Int(b)), Some(Value::Array(master))) = (f.first(), f.get(1), f.get(2))
        else {
            continue;
        };
        let host = match master.first() {
            Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
            Some(Value::SimpleString(h)) => h.clone(),
            _ => continue,
        };
        let Some(Value::Int(port)) = master.get(1) else { continue };
        let Ok(port) = u16::try_from(*port) else { continue };
        let node = resolve(host.trim_start_matches('[').trim_end_matches(']'), port, from);
        let (a, b) = ((*a).clamp(0, SLOTS as i64 - 1) as usize, (*b).clamp(0, SLOTS as i64 - 1) as usize);
        for s in &mut slots[a..=b] {
            *s = Some(node.clone());
        }
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_checked() {
        let ok = parse_seeds(&["redis://127.0.0.1:7001".into(), "127.0.0.1:7002".into()]).unwrap();
        assert_eq!(ok.len(), 2);
        for bad in [
            "",
            "http://x:1",
            "unix:///tmp/s",
            "redis://",
            "redis://h:notaport",
            "rediss://h:1",
            "redis://h:1/5",
            "redis://h:1/0",
            "redis://h:1/",
            "h:1/0",
            "redis://:pw@h:1/",
        ] {
            let e = parse_seeds(&[bad.to_string()]).unwrap_err();
            assert!(matches!(e, Error::BadUrl { .. }), "{bad:?} gave {e:?}");
        }
        assert!(matches!(parse_seeds(&[]), Err(Error::BadUrl { .. })));
        // `127.0.0.1:99999` got the URL parser's "did not parse -
        // InvalidClientConfig": the port and its range are named.
        for bad in ["127.0.0.1:99999", "redis://127.0.0.1:65536", "127.0.0.1:0", "redis://:pw@h:123456789012345678901"]
        {
            match parse_seeds(&[bad.to_string()]) {
                Err(Error::BadUrl { detail, .. }) => assert!(detail.contains("out of range"), "{bad:?}: {detail}"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        // Blanks around a seed are trimmed, as `--backing`'s list trims
        // them after a comma; one inside the address is named.
        assert_eq!(name(&parse_seeds(&[" 127.0.0.1:7001\t".into()]).unwrap()[0]), "127.0.0.1:7001");
        for bad in ["127.0.0.1 :7001", "127.0.0.1: 7001", "redis://:pw@127.0.0.1 :7001"] {
            match parse_seeds(&[bad.to_string()]) {
                Err(Error::BadUrl { detail, .. }) => assert!(detail.contains("blank"), "{bad:?}: {detail}"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        // A tester's 100 000-character host name was echoed twice in a
        // 200 KB error: echoed input is clipped to 200 characters.
        let long = "h".repeat(100_000);
        for seed in [long.clone(), format!("redis://{long}/x:1"), format!("{long}:1?q")] {
            let e = parse_seeds(&[seed]).unwrap_err().to_string();
            assert!(e.len() < 1000 && e.contains(&format!("{}…", "h".repeat(ECHO_CHARS))), "{} bytes", e.len());
        }
        // At most 64 seeds, each node once.
        let many: Vec<String> = (0..65).map(|i| format!("127.0.0.1:{}", 7000 + i)).collect();
        assert!(parse_seeds(&many).unwrap_err().to_string().contains("at most 64"));
        let twice = ["127.0.0.1:7001".to_string(), "redis://127.0.0.1:7001".to_string()];
        assert!(parse_seeds(&twice).unwrap_err().to_string().contains("127.0.0.1:7001 is given twice"));
        // An IPv6 node is named in brackets, whether a seed, a slot map's
        // entry or a redirection's target (Redis writes `::1:7101`), and
        // its brackets are dropped to connect.
        let v6 = parse_seeds(&["redis://[::1]:7101".into()]).unwrap();
        assert_eq!(name(&v6[0]), "[::1]:7101");
        assert_eq!(split_addr("::1:7101"), Some(("::1", 7101)));
        assert_eq!(split_addr("[::1]:7101"), Some(("::1", 7101)));
        assert_eq!(split_addr("127.0.0.1:7101"), Some(("127.0.0.1", 7101)));
        assert_eq!(node_addr("::1", 7101), "[::1]:7101");
        let entry = |host: &str| {
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(16383),
                Value::Array(vec![Value::BulkString(host.into()), Value::Int(7101)]),
            ])])
        };
        assert_eq!(parse_slots(entry("::1"), "10.0.0.9:7100")[5].as_deref(), Some("[::1]:7101"));
        assert_eq!(parse_slots(entry("10.0.0.1"), "10.0.0.9:7100")[5].as_deref(), Some("10.0.0.1:7101"));
        // A node that never met another names itself without a host: the
        // host it was reached at, whether in the slot map or a `MOVED`.
        assert_eq!(parse_slots(entry(""), "10.0.0.9:7100")[5].as_deref(), Some("10.0.0.9:7101"));
        assert_eq!(parse_slots(entry(""), "[::1]:7100")[5].as_deref(), Some("[::1]:7101"));
        assert_eq!(target_of(":7101", "10.0.0.9:7100").as_deref(), Some("10.0.0.9:7101"));
        assert_eq!(target_of("::1:7101", "10.0.0.9:7100").as_deref(), Some("[::1]:7101"));
        // Credentials: the first seed's, repeated or left out on the others.
        let same = ["redis://:pw@127.0.0.1:7001", "127.0.0.1:7002", "redis://:pw@127.0.0.1:7003"];
        assert_eq!(parse_seeds(&same.map(String::from)).unwrap().len(), 3);
        for other in [["127.0.0.1:7001", "redis://:pw@127.0.0.1:7002"], ["redis://:a@h:1", "redis://u:a@h:2"]] {
            let e = parse_seeds(&other.map(String::from)).unwrap_err();
            assert!(e.to_string().contains("other credentials than the first seed"), "{other:?}: {e}");
            assert!(!e.to_string().contains(":pw@") && !e.to_string().contains(":a@"), "the password is hidden: {e}");
        }
    }
}
