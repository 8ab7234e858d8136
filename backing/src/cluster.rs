//! The connection to the cluster: seeds checked one by one (so that a bad
//! URL, a dead seed and a non-cluster server each get their own error), the
//! crate's cluster connection, and our own copy of the slot map, used only
//! to name the node behind a failed slot.

use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};

use crate::error::Error;
use crate::layout::SLOTS;

/// Timeouts and retries of the cluster connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Net {
    pub connect: Duration,
    pub response: Duration,
    pub retries: u32,
}

/// Parses `--backing`'s seeds: `redis://HOST:PORT` or `HOST:PORT`, TCP only.
pub fn parse_seeds(seeds: &[String]) -> Result<Vec<ConnectionInfo>, Error> {
    if seeds.is_empty() {
        return Err(Error::BadUrl { url: String::new(), detail: "no seed given".into() });
    }
    seeds
        .iter()
        .map(|s| {
            let s = s.trim();
            let bad = |detail: String| Error::BadUrl { url: s.to_string(), detail };
            if s.is_empty() {
                return Err(bad("empty seed".into()));
            }
            let url = if s.contains("://") { s.to_string() } else { format!("redis://{s}") };
            if !url.starts_with("redis://") {
                return Err(bad("only redis:// (TCP) seeds name cluster nodes".into()));
            }
            let info = url.as_str().into_connection_info().map_err(|e| bad(e.to_string()))?;
            match info.addr() {
                ConnectionAddr::Tcp(host, port) if !host.is_empty() && *port != 0 => Ok(info),
                _ => Err(bad("a seed needs a host and a port".into())),
            }
        })
        .collect()
}

fn name(info: &ConnectionInfo) -> String {
    match info.addr() {
        ConnectionAddr::Tcp(h, p) => format!("{h}:{p}"),
        other => other.to_string(),
    }
}

/// Probes each seed with a plain connection: the first that answers
/// `CLUSTER INFO` as a cluster node wins; a non-cluster server is refused
/// by name; none answering is `Unreachable`.
async fn probe(seeds: &[ConnectionInfo], net: Net) -> Result<(), Error> {
    let mut last = String::from("no seed");
    for info in seeds {
        let node = name(info);
        let client = redis::Client::open(info.clone()).map_err(|e| Error::BadUrl { url: node.clone(), detail: e.to_string() })?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(net.connect))
            .set_response_timeout(Some(net.response));
        let mut conn = match client.get_multiplexed_async_connection_with_config(&cfg).await {
            Ok(c) => c,
            Err(e) => {
                last = format!("{node}: {e}");
                continue;
            }
        };
        let info: Result<String, _> = redis::cmd("CLUSTER").arg("INFO").query_async(&mut conn).await;
        return match info {
            Ok(text) if text.contains("cluster_state:") => Ok(()),
            Ok(text) => Err(Error::NotCluster { node, detail: text.lines().next().unwrap_or("").to_string() }),
            Err(e) => Err(Error::NotCluster { node, detail: e.to_string() }),
        };
    }
    Err(Error::Unreachable { seeds: seeds.iter().map(name).collect::<Vec<_>>().join(","), detail: last })
}

/// Which node serves which slots, as `CLUSTER SLOTS` said last.
#[derive(Debug, Default)]
struct Topology {
    /// `(first, last, "host:port")`, sorted.
    ranges: Vec<(u16, u16, String)>,
}

impl Topology {
    fn node(&self, slot: u16) -> Option<&str> {
        let i = self.ranges.partition_point(|r| r.1 < slot);
        self.ranges.get(i).filter(|r| r.0 <= slot).map(|r| r.2.as_str())
    }

    fn masters(&self) -> usize {
        let mut m: Vec<&str> = self.ranges.iter().map(|r| r.2.as_str()).collect();
        m.sort_unstable();
        m.dedup();
        m.len()
    }
}

/// A connected cluster.
pub(crate) struct Cluster {
    pub conn: ClusterConnection,
    client: ClusterClient,
    topo: RwLock<Topology>,
    refreshed: Mutex<Option<Instant>>,
}

impl Cluster {
    /// Checks the seeds and connects.
    pub async fn open(seeds: &[String], net: Net) -> Result<Cluster, Error> {
        let infos = parse_seeds(seeds)?;
        probe(&infos, net).await?;
        let client = builder(&infos, net).build().map_err(|e| Error::BadUrl { url: seeds.join(","), detail: e.to_string() })?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| Error::Unreachable { seeds: seeds.join(","), detail: e.to_string() })?;
        let cluster = Cluster { conn, client, topo: RwLock::new(Topology::default()), refreshed: Mutex::new(None) };
        cluster.refresh().await?;
        Ok(cluster)
    }

    /// A second connection, for blocking reads (the stream consumer) that
    /// must not hold up the table's reads and writes.
    pub async fn second_connection(&self) -> Result<ClusterConnection, Error> {
        self.client
            .get_async_connection()
            .await
            .map_err(|e| Error::Unavailable { node: "cluster".into(), detail: e.to_string() })
    }

    /// Masters serving slots.
    pub fn masters(&self) -> usize {
        self.topo.read().masters()
    }

    /// The node serving `slot`, as last seen, or `cluster`.
    pub fn node_of(&self, slot: u16) -> String {
        self.topo.read().node(slot).unwrap_or("cluster").to_string()
    }

    /// Re-reads the slot map, at most every 500 ms (a storm of failed
    /// slots asks once).
    pub async fn refresh_soon(&self) {
        {
            let mut last = self.refreshed.lock();
            if last.is_some_and(|t| t.elapsed() < Duration::from_millis(500)) {
                return;
            }
            *last = Some(Instant::now());
        }
        let _ = self.refresh().await;
    }

    async fn refresh(&self) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let v = conn
            .route_command(redis::cmd("CLUSTER").arg("SLOTS").clone(), RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
            .await
            .map_err(|e| Error::Unavailable { node: "cluster".into(), detail: format!("CLUSTER SLOTS: {e}") })?;
        let mut ranges = Vec::new();
        if let Value::Array(items) = v {
            for item in items {
                let Value::Array(f) = item else { continue };
                let (Some(Value::Int(a)), Some(Value::Int(b)), Some(Value::Array(master))) = (f.first(), f.get(1), f.get(2)) else {
                    continue;
                };
                let host = match master.first() {
                    Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                    Some(Value::SimpleString(h)) => h.clone(),
                    _ => continue,
                };
                let Some(Value::Int(port)) = master.get(1) else { continue };
                let (Ok(a), Ok(b)) = (u16::try_from(*a), u16::try_from(*b)) else { continue };
                if a < SLOTS && b < SLOTS {
                    ranges.push((a, b, format!("{host}:{port}")));
                }
            }
        }
        ranges.sort();
        *self.refreshed.lock() = Some(Instant::now());
        *self.topo.write() = Topology { ranges };
        Ok(())
    }
}

fn builder(infos: &[ConnectionInfo], net: Net) -> ClusterClientBuilder {
    // Retries follow MOVED / ASK during migrations and reconnect after a
    // reset; few, with short waits, so that a dead node shows as an error
    // well inside a request's deadline instead of after many seconds.
    ClusterClientBuilder::new(infos.to_vec())
        .connection_timeout(net.connect)
        .response_timeout(net.response)
        .retries(net.retries)
        .min_retry_wait(10)
        .max_retry_wait(200)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_checked() {
        let ok = parse_seeds(&["redis://127.0.0.1:7001".into(), "127.0.0.1:7002".into()]).unwrap();
        assert_eq!(ok.len(), 2);
        for bad in ["", "http://x:1", "unix:///tmp/s", "redis://", "redis://h:notaport", "rediss://h:1"] {
            let e = parse_seeds(&[bad.to_string()]).unwrap_err();
            assert!(matches!(e, Error::BadUrl { .. }), "{bad:?} gave {e:?}");
        }
        assert!(matches!(parse_seeds(&[]), Err(Error::BadUrl { .. })));
    }
}
