//! More of the tier against real `redis-server` processes on loopback
//! ports: a one-master cluster whose node never learnt its address, what
//! a flush that times out names, and how long a write-through write
//! waits for a node that does not answer. (Beside `cluster.rs`, whose
//! helpers the few used here copy.)

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hkv_backing::testkit::{dead_port, wait_until, TestCluster};
use hkv_backing::{Backing, Error, Fetched, Mode, Options};

const DIM: usize = 8;

fn rows(keys: &[u64], gen: u32) -> Vec<f32> {
    keys.iter().flat_map(|&k| (0..DIM as u64).map(move |j| (k * 8 + j) as f32 + gen as f32 * 0.5)).collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn cluster(masters: usize, replicas: usize) -> TestCluster {
    TestCluster::start(masters, replicas)
        .expect("start a redis-server cluster (is redis-server installed? test.sh installs it)")
}

/// One cluster-mode `redis-server` that has met no other node and serves
/// every slot (`CLUSTER ADDSLOTSRANGE 0 16383`): it never learnt its own
/// address, so `CLUSTER SLOTS` and `CLUSTER NODES` name it `:PORT`.
struct Alone {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Alone {
    fn start() -> Alone {
        let dir = tempfile::Builder::new().prefix("hkv-redis-").tempdir().unwrap();
        let port = dead_port().unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--daemonize", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
            .arg("--dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (test.sh installs it)");
        let alone = Alone { port, child, _dir: dir };
        wait_until(Duration::from_secs(10), "the lone node to answer PING", || alone.cli(&["ping"]).contains("PONG"))
            .unwrap();
        let pid = alone.child.id();
        assert!(
            alone.cli(&["info", "server"]).lines().any(|l| l.trim() == format!("process_id:{pid}")),
            "port {port} answered by another process"
        );
        assert_eq!(alone.cli(&["cluster", "addslotsrange", "0", "16383"]).trim(), "OK");
        wait_until(Duration::from_secs(10), "the lone node's cluster_state:ok", || {
            alone.cli(&["cluster", "info"]).contains("cluster_state:ok")
        })
        .unwrap();
        alone
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Alone {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tester's one-master cluster (a redis-server given every slot with
/// `cluster addslotsrange 0 16383`) names itself `:7320@17320
/// myself,master`, without a host, and `create-table` answered
/// `backing_unavailable: node :7320: :7320: not HOST:PORT`. An empty host
/// is the host the node was reached at, as Redis clients read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_master_cluster_that_never_learnt_its_address_is_used() {
    let n = blocking(Alone::start);
    assert!(n.cli(&["cluster", "nodes"]).contains(&format!(" :{}@", n.port)), "the node knows no address of its own");
    let seed = format!("redis://127.0.0.1:{}", n.port);
    let b = Backing::open("alone", DIM, Options::new(vec![seed.clone()], Mode::WriteThrough)).await.unwrap();
    let other = Backing::open("alone", DIM, Options::new(vec![seed], Mode::ReadOnly)).await.unwrap();
    let mut inv = other.subscribe().await.unwrap();
    let keys: Vec<u64> = (0..500).collect();
    b.write(&keys, &rows(&keys, 1), &[]).await.unwrap();
    let out = other.read(&keys).await;
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found));
    assert!(same_bits(&out.values, &rows(&keys, 1)));
    // The stream is read from the node as well.
    let (t, mut heard) = (Instant::now(), std::collections::HashSet::new());
    while heard.len() < keys.len() && t.elapsed() < Duration::from_secs(5) {
        inv.next().await.unwrap().into_iter().for_each(|i| heard.extend(i.keys));
    }
    assert_eq!(heard.len(), keys.len(), "the other handle heard the write");
    assert_eq!(b.stats().node_errors, Default::default());
}

/// A tester's flush, with a master and its replica stopped, answered
/// `…7302: 264 failed commands, the last: timed out (…), …7303: 25 failed
/// commands; retry …`: the flush counted every node error (the stream
/// reader's, a stream entry's) while only failed row writes kept their
/// words. Now it names the nodes whose writes failed (rows, or stream
/// entries), each with its last failure; the stream reader's failures
/// stay in `node_errors`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_that_times_out_gives_each_node_its_last_failure() {
    // Five masters: with two killed, the other three are still a
    // majority and keep serving their slots.
    let mut c = cluster(5, 0);
    let table = "flushlast";
    let b = Backing::open(table, DIM, Options::new(c.seeds(), Mode::WriteBack)).await.unwrap();
    let owners = c.slot_owners();
    let layout = b.layout().clone();
    let node = |k: u64| owners[layout.slot_of_group(layout.group(k)) as usize];
    let stream = owners[hkv_backing::layout::slot(table.as_bytes()) as usize];
    let rows_node = (stream + 1) % 5;
    // Rows on every node but the stream's: the rows of `rows_node` fail,
    // the others land, and their stream entries fail.
    let keys: Vec<u64> = (0..4000u64).filter(|&k| node(k) != stream).collect();
    let ports = c.ports();
    blocking(|| {
        c.kill(stream);
        c.kill(rows_node);
    });
    // The table's stream reader runs as the daemon's does, failing on the
    // stream's node (and appending the waiting entries again).
    let mut inv = b.subscribe().await.ok();
    let reader = tokio::spawn(async move {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(6) {
            let ok = match inv.as_mut() {
                Some(i) => i.next().await.is_ok(),
                None => false,
            };
            if !ok {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    b.write(&keys, &rows(&keys, 1), &[]).await.unwrap();
    let e = b.flush(Duration::from_secs(3)).await.unwrap_err();
    let Error::FlushTimeout { nodes, .. } = &e else { panic!("{e}") };
    // Each node named with failed commands comes with its last failure.
    for (i, port) in ports.iter().enumerate() {
        let Some(at) = nodes.find(&format!("127.0.0.1:{port}: ")) else { continue };
        let clause = nodes[at..].split("; ").next().unwrap();
        let clause = clause.split(", 127.0.0.1:").next().unwrap();
        assert!(clause.contains(", the last: "), "node {i} ({port}) is named without its last failure: {nodes}");
    }
    assert!(nodes.contains(&format!("127.0.0.1:{}: ", ports[rows_node])), "{nodes}");
    assert!(nodes.contains(&format!("127.0.0.1:{}: ", ports[stream])), "its stream entries failed: {nodes}");
    assert!(b.stats().node_errors.contains_key(&format!("127.0.0.1:{}", ports[stream])));
    reader.await.unwrap();
    b.discard();
}

/// How long a write-through write waits for a master that does not
/// answer (stopped: its socket accepts, nothing answers): it fails naming
/// the node within its deadline, the response timeout × (retries + 2),
/// and one response timeout more for its stream entry when the silent
/// master holds the table's stream. The docs give what this measures
/// with the default options (a tester measured 3.01 to 3.03 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_write_to_a_silent_master_ends_within_its_deadline() {
    let c = cluster(3, 0);
    let table = "silentw";
    let opts = Options::new(c.seeds(), Mode::WriteThrough);
    let bound = opts.response_timeout * (opts.retries + 3);
    let b = Backing::open(table, DIM, opts).await.unwrap();
    let owners = c.slot_owners();
    let layout = b.layout().clone();
    let node = |k: u64| owners[layout.slot_of_group(layout.group(k)) as usize];
    let stream = owners[hkv_backing::layout::slot(table.as_bytes()) as usize];
    let ports = c.ports();
    for (silent, &port) in ports.iter().enumerate() {
        // Rows on the silent master and on the others.
        let mut keys: Vec<u64> = (0..4000u64).filter(|&k| node(k) == silent).take(50).collect();
        keys.extend((0..4000u64).filter(|&k| node(k) != silent).take(50));
        // A node resumed a moment ago may still be counted down (its
        // last connection attempt, made while it was stopped, failed
        // under 200 ms ago).
        let t = Instant::now();
        while let Err(e) = b.write(&keys, &rows(&keys, 1), &[]).await {
            assert!(t.elapsed() < Duration::from_secs(10), "before stopping node {silent}: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        blocking(|| c.pause(silent)).unwrap();
        let t = Instant::now();
        let e = b.write(&keys, &rows(&keys, 2), &[]).await.unwrap_err();
        let took = t.elapsed();
        blocking(|| c.resume(silent).and_then(|_| c.wait_healthy())).unwrap();
        let what = if silent == stream { "a stopped master holding the stream" } else { "a stopped master" };
        eprintln!("a write-through write to {what} ({}) failed after {took:?}: {e}", port);
        assert!(matches!(&e, Error::Unavailable { node, .. } if *node == format!("127.0.0.1:{port}")), "{e}");
        assert!(took <= bound + Duration::from_millis(300), "{took:?}, past the deadline and the entry's {bound:?}");
    }
}
