//! The tier against real `redis-server` clusters on loopback ports: what
//! is written reads back bit for bit, the write-back queue drains, a node
//! killed mid-load, a failover, a live slot migration, a deadline, and
//! hostile options. Every loop is bounded in count and time.

use std::time::{Duration, Instant};

use hkv_backing::testkit::{dead_port, TestCluster, TestServer};
use hkv_backing::{Backing, Error, Fetched, Gap, Mode, Options};

const DIM: usize = 8;

/// A row's values, a function of key and generation, with awkward bit
/// patterns (negative zero, subnormals, NaN payloads) that must survive.
fn row(key: u64, gen: u32) -> Vec<f32> {
    (0..DIM as u64)
        .map(|j| match (key + j) % 5 {
            0 => -0.0,
            1 => f32::from_bits(1 + (key as u32 ^ gen)),
            2 => f32::from_bits(0x7fc0_0000 | (key as u32 & 0xffff)),
            _ => (key as f32) * 0.5 + j as f32 + gen as f32,
        })
        .collect()
}

fn rows(keys: &[u64], gen: u32) -> Vec<f32> {
    keys.iter().flat_map(|&k| row(k, gen)).collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn options(c: &TestCluster, mode: Mode) -> Options {
    Options::new(c.seeds(), mode)
}

/// Runs blocking test-kit work (processes, sleeps) off the async workers.
/// The master of table `table`'s stream (a 3-master cluster), and 20 keys
/// whose rows live on the other masters, written once (generation 1).
async fn off_the_stream_node(c: &TestCluster, b: &Backing, table: &str) -> (usize, Vec<u64>) {
    let layout = b.layout().clone();
    let owner = |slot: u16| {
        let slot = slot.to_string();
        (0..3).find(|&i| c.cli(i, &["cluster", "countkeysinslot", &slot]).is_ok_and(|o| o.trim() != "0"))
    };
    let m = owner(hkv_backing::layout::slot(table.as_bytes())).expect("the stream's master");
    let candidates: Vec<u64> = (0..200).collect();
    b.write(&candidates, &rows(&candidates, 1), &[]).await.unwrap();
    let keys =
        candidates.into_iter().filter(|&k| owner(layout.slot_of_group(layout.group(k))) != Some(m)).take(20).collect();
    (m, keys)
}

/// Marks hash slot `slot` (which holds keys) migrating from its master to
/// the next of a 3-master cluster, and importing there, moving no key.
/// Returns (source, destination).
fn start_migration(c: &TestCluster, slot: &str) -> (usize, usize) {
    let src = (0..3)
        .find(|&i| c.cli(i, &["cluster", "countkeysinslot", slot]).is_ok_and(|o| o.trim() != "0"))
        .expect("the slot's master");
    let dst = (src + 1) % 3;
    let (sid, did) = (c.node_id(src).unwrap(), c.node_id(dst).unwrap());
    c.cli(dst, &["cluster", "setslot", slot, "importing", &sid]).unwrap();
    c.cli(src, &["cluster", "setslot", slot, "migrating", &did]).unwrap();
    (src, dst)
}

/// Stalls the migration of table `table`'s stream slot half way (a
/// 3-master cluster): the slot migrating from its master to the next,
/// the stream key moved already. Returns (source, destination).
fn stream_half_migrated(c: &TestCluster, table: &str) -> (usize, usize) {
    let (src, dst) = start_migration(c, &hkv_backing::layout::slot(table.as_bytes()).to_string());
    let stream = format!("hkv:{{{table}}}:stream");
    let dst_port = c.ports()[dst].to_string();
    let out = c.cli(src, &["migrate", "127.0.0.1", &dst_port, &stream, "0", "5000"]).unwrap();
    assert_eq!(out.trim(), "OK", "MIGRATE of the stream key");
    (src, dst)
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn cluster(masters: usize, replicas: usize) -> TestCluster {
    TestCluster::start(masters, replicas)
        .expect("start a redis-server cluster (is redis-server installed? test.sh installs it)")
}

/// Reads `keys` until every one is answered or `limit` passes.
async fn read_all(b: &Backing, keys: &[u64], limit: Duration) -> hkv_backing::ReadOut {
    let start = Instant::now();
    loop {
        let out = b.read(keys).await;
        if out.unanswered() == 0 || start.elapsed() > limit {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_returns_what_was_written_bit_for_bit() {
    let c = cluster(3, 0);
    let b = Backing::open("emb", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    assert_eq!(b.layout().groups(), 96, "32 groups per master");
    let keys: Vec<u64> = (0..5000u64).map(|i| i * 7919 + 3).collect();
    let scores: Vec<u64> = keys.iter().map(|k| k ^ 0xabcd).collect();
    b.write(&keys, &rows(&keys, 1), &scores).await.unwrap();

    let mut asked = keys.clone();
    asked.extend([1u64, 2, u64::MAX - 9]); // never written
    let out = b.read(&asked).await;
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    for (i, &k) in asked.iter().enumerate() {
        if i < keys.len() {
            assert_eq!(out.fetched[i], Fetched::Found, "key {k}");
            assert!(same_bits(&out.values[i * DIM..(i + 1) * DIM], &row(k, 1)), "key {k}");
            assert_eq!(out.scores[i], scores[i]);
            assert!(out.versions[i] > 0);
        } else {
            assert_eq!(out.fetched[i], Fetched::Absent, "key {k}");
        }
    }
    // The rows are spread: every node holds some of the table.
    for i in 0..3 {
        let n: u64 = c.cli(i, &["dbsize"]).unwrap().trim().parse().unwrap();
        assert!(n > 1000, "node {i} holds {n} keys");
    }
    let s = b.stats();
    assert_eq!((s.found, s.absent, s.rows_written), (5000, 3, 5000));
    assert!(s.fetch_us.count() >= 1 && s.bytes_in == 5000 * (16 + 4 * DIM as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_back_is_visible_while_queued_and_drains() {
    let c = cluster(3, 0);
    let b = Backing::open("wb", DIM, options(&c, Mode::WriteBack)).await.unwrap();
    let keys: Vec<u64> = (1..=20_000u64).collect();
    for chunk in keys.chunks(2000) {
        b.write(chunk, &rows(chunk, 2), &[]).await.unwrap();
    }
    // Whatever has or has not been sent yet, reads see the newest rows.
    let out = b.read(&keys[..3000]).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found));
    assert!(same_bits(&out.values, &rows(&keys[..3000], 2)));
    b.flush(Duration::from_secs(20)).await.unwrap();
    let s = b.stats();
    assert_eq!((s.queue_rows, s.queue_bytes, s.rows_written), (0, 0, 20_000));
    assert!(s.queue_limit_bytes > 0);
    // A fresh handle (nothing queued) reads the same rows from the cluster.
    let fresh = Backing::open("wb", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let out = fresh.read(&keys).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found));
    assert!(same_bits(&out.values, &rows(&keys, 2)));
    assert!(matches!(fresh.write(&keys[..1], &row(1, 0), &[]).await, Err(Error::ReadOnly { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_killed_and_restarted_mid_load() {
    let mut c = cluster(3, 0);
    let mut o = options(&c, Mode::WriteThrough);
    o.deadline = Duration::from_secs(2);
    let wt = Backing::open("crash", DIM, o.clone()).await.unwrap();
    let mut wbo = o.clone();
    wbo.mode = Mode::WriteBack;
    wbo.queue_bytes = 256 << 10;
    wbo.queue_wait = Duration::from_millis(300);
    let wb = Backing::open("crash_wb", DIM, wbo).await.unwrap();
    let victim = format!("127.0.0.1:{}", c.ports()[1]);

    let mut acked: Vec<u64> = Vec::new();
    let mut named_victim = false;
    let mut refused = 0;
    let (mut wb_acked, mut queue_full) = (Vec::new(), false);
    for round in 0..40u64 {
        if round == 10 {
            blocking(|| c.kill(1));
        }
        if round == 30 {
            blocking(|| c.restart(1)).unwrap();
        }
        let keys: Vec<u64> = (round * 500..(round + 1) * 500).collect();
        match wt.write(&keys, &rows(&keys, 3), &[]).await {
            Ok(()) => acked.extend(&keys),
            Err(Error::Unavailable { node, .. }) => {
                named_victim |= node == victim;
                refused += 1;
            }
            Err(e) => panic!("write-through gave {e:?}"),
        }
        match wb.write(&keys, &rows(&keys, 4), &[]).await {
            Ok(()) => wb_acked.extend(&keys),
            Err(Error::QueueFull { .. }) => queue_full = true,
            Err(e) => panic!("write-back gave {e:?}"),
        }
        // The live nodes keep serving reads meanwhile.
        let out = wt.read(&acked[acked.len().saturating_sub(200)..]).await;
        assert!(out.fetched.iter().all(|f| matches!(f, Fetched::Found | Fetched::Unavailable | Fetched::Late)));
        for e in &out.errors {
            assert!(matches!(e, Error::Unavailable { node, .. } if *node == victim), "round {round}: {e:?}");
        }
    }
    assert!(refused > 0 && named_victim, "writes to the dead node were refused naming it ({refused} refused)");
    assert!(queue_full, "the write-back queue filled while a node was down and refused with resource_exhausted");
    blocking(|| c.wait_healthy()).unwrap();
    // Nothing acknowledged is lost: the node persisted every write it
    // acknowledged (appendfsync always), the queue kept what it could not send.
    wb.flush(Duration::from_secs(30)).await.unwrap();
    let out = read_all(&wt, &acked, Duration::from_secs(10)).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found), "{:?}", out.errors);
    assert!(same_bits(&out.values, &rows(&acked, 3)));
    let out = read_all(&wb, &wb_acked, Duration::from_secs(10)).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found), "{:?}", out.errors);
    assert!(same_bits(&out.values, &rows(&wb_acked, 4)));
    let s = wt.stats();
    assert!(s.node_errors.get(&victim).copied().unwrap_or(0) > 0, "{:?}", s.node_errors);
    assert_eq!(wb.stats().queue_rows, 0);
}

/// A node restarted while nothing was in flight: the connection pooled
/// before is dead, and the first read after the restart is served on a
/// new one (it failed with a broken pipe, the next one passing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_read_after_a_node_restart_is_served() {
    let mut c = cluster(3, 0);
    let b = Backing::open("restart", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let keys: Vec<u64> = (1..=3000u64).collect();
    b.write(&keys, &rows(&keys, 5), &[]).await.unwrap();
    let out = b.read(&keys).await;
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    blocking(|| {
        c.kill(1);
        c.restart(1).unwrap();
        c.wait_healthy().unwrap();
    });
    for attempt in 0..3 {
        let out = b.read(&keys).await;
        assert!(out.errors.is_empty(), "read {attempt} after the restart: {:?}", out.errors);
        assert!(out.fetched.iter().all(|f| *f == Fetched::Found), "read {attempt}");
        assert!(same_bits(&out.values, &rows(&keys, 5)));
    }
    b.write(&keys[..10], &rows(&keys[..10], 6), &[]).await.expect("a write after the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_failover_with_replicas() {
    let mut c = cluster(3, 1);
    let b = Backing::open("fo", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let keys: Vec<u64> = (0..6000u64).collect();
    b.write(&keys, &rows(&keys, 5), &[]).await.unwrap();
    // Replication is asynchronous: give the replicas the rows before the
    // master dies (the tier does not ask for WAIT).
    blocking(|| std::thread::sleep(Duration::from_millis(500)));
    let replicas: Vec<usize> = (0..6).filter(|&i| !c.is_master(i)).collect();
    assert_eq!(replicas.len(), 3, "3 masters, 3 replicas");
    let victim = (0..6).find(|&i| c.is_master(i)).unwrap();
    blocking(|| c.kill(victim));
    blocking(|| {
        hkv_backing::testkit::wait_until(Duration::from_secs(30), "a replica to take over", || {
            replicas.iter().any(|&i| c.is_master(i))
        })
    })
    .unwrap();
    let out = read_all(&b, &keys, Duration::from_secs(20)).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found), "{:?}", out.errors);
    assert!(same_bits(&out.values, &rows(&keys, 5)));
    // Writes go to the new master.
    let mut ok = false;
    for _ in 0..50 {
        if b.write(&keys, &rows(&keys, 6), &[]).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ok, "writes resume after the failover");
    let out = read_all(&b, &keys, Duration::from_secs(10)).await;
    assert!(same_bits(&out.values, &rows(&keys, 6)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_during_reads_and_writes() {
    let c = cluster(3, 0);
    let b = Backing::open("mig", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let keys: Vec<u64> = (0..8000u64).collect();
    b.write(&keys, &rows(&keys, 7), &[]).await.unwrap();
    let seeds = c.ports();
    let resharding = std::thread::spawn(move || {
        // A second handle on the same processes: reshard 2000 slots live.
        let out = std::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", seeds[0])])
            .args(["--cluster-from", &node_id(seeds[0]), "--cluster-to", &node_id(seeds[1])])
            .args(["--cluster-slots", "2000", "--cluster-yes", "--cluster-pipeline", "50"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    });
    let start = Instant::now();
    let (mut rounds, mut hiccups) = (0u32, 0u32);
    let mut gen = 7;
    while !resharding.is_finished() && start.elapsed() < Duration::from_secs(120) && rounds < 10_000 {
        let chunk = &keys[(rounds as usize * 400) % 8000..][..400];
        // Never a wrong row: each read is the row of the current or the
        // previous generation (a write may fail mid-migration).
        let out = b.read(chunk).await;
        for (i, &k) in chunk.iter().enumerate() {
            if out.fetched[i] == Fetched::Found {
                let v = &out.values[i * DIM..(i + 1) * DIM];
                assert!((7..=gen).any(|g| same_bits(v, &row(k, g))), "key {k} read a row it was never given");
            }
        }
        hiccups += out.unanswered() as u32;
        // A reshard's redirections are followed, never failures (a key
        // may at worst be late while its slot moves).
        let redirect = |e: &str| ["MOVED", "ASK ", "TRYAGAIN"].iter().any(|r| e.contains(r));
        assert!(!out.errors.iter().any(|e| redirect(&e.to_string())), "{:?}", out.errors);
        assert!(!out.fetched.contains(&Fetched::Unavailable), "{:?}", out.errors);
        gen += 1;
        if let Err(e) = b.write(&keys, &rows(&keys, gen), &[]).await {
            assert!(!redirect(&e.to_string()), "a write failed on a redirection: {e}");
            hiccups += 1;
        }
        rounds += 1;
    }
    resharding.join().unwrap();
    blocking(|| c.wait_healthy()).unwrap();
    b.write(&keys, &rows(&keys, gen + 1), &[]).await.unwrap();
    let out = read_all(&b, &keys, Duration::from_secs(10)).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found));
    assert!(same_bits(&out.values, &rows(&keys, gen + 1)));
    eprintln!("migration: {rounds} rounds of reads and writes, {hiccups} keys or writes retried");
    assert!(rounds > 0);
}

fn node_id(port: u16) -> String {
    let out =
        std::process::Command::new("redis-cli").args(["-p", &port.to_string(), "cluster", "myid"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_reports_late_keys_and_serves_the_rest() {
    let c = cluster(3, 0);
    let mut o = options(&c, Mode::WriteThrough);
    // A deadline the healthy nodes' answers meet on a loaded 2-core
    // machine (at 150 ms a run there had every key late, the two healthy
    // masters' too: "late 3000 found 0"), far below the pause.
    o.deadline = Duration::from_millis(600);
    o.response_timeout = Duration::from_secs(10);
    let b = Backing::open("slow", DIM, o).await.unwrap();
    let keys: Vec<u64> = (0..3000u64).collect();
    b.write(&keys, &rows(&keys, 8), &[]).await.unwrap();
    // Node 2 stops answering clients for 4 s.
    blocking(|| c.cli(2, &["client", "pause", "4000", "ALL"])).unwrap();
    let t = Instant::now();
    let out = b.read(&keys).await;
    let took = t.elapsed();
    assert!(took < Duration::from_millis(2500), "the read returned at its deadline, not when the node woke: {took:?}");
    let late = out.fetched.iter().filter(|f| **f == Fetched::Late).count();
    let found = out.fetched.iter().filter(|f| **f == Fetched::Found).count();
    assert!(late > 300 && found > 1000 && late + found == keys.len(), "late {late} found {found}");
    for (i, f) in out.fetched.iter().enumerate() {
        if *f == Fetched::Found {
            assert!(same_bits(&out.values[i * DIM..(i + 1) * DIM], &row(keys[i], 8)));
        }
    }
    assert_eq!(b.stats().late, late as u64);
    tokio::time::sleep(Duration::from_millis(4000).saturating_sub(t.elapsed()) + Duration::from_millis(100)).await;
    assert_eq!(read_all(&b, &keys, Duration::from_secs(5)).await.unanswered(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidations_reach_other_handles_with_their_staleness() {
    let c = cluster(3, 0);
    let a = Backing::open("shared", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let b = Backing::open("shared", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let mut on_a = a.subscribe().await.unwrap();
    let mut on_b = b.subscribe().await.unwrap();
    let mut written = Vec::new();
    for round in 0..20u64 {
        let keys: Vec<u64> = (round * 50..round * 50 + 50).collect();
        a.write(&keys, &rows(&keys, 9), &[]).await.unwrap();
        written.extend(keys);
    }
    let mut seen = Vec::new();
    let start = Instant::now();
    while seen.len() < written.len() && start.elapsed() < Duration::from_secs(10) {
        for inv in on_b.next().await.unwrap() {
            assert!(inv.version > 0 && inv.acked_us > 0);
            seen.extend(inv.keys);
        }
    }
    // Within a batch keys come in group order; batches come in order.
    assert_eq!(seen.len(), written.len());
    for (s, w) in seen.chunks(50).zip(written.chunks(50)) {
        let mut s = s.to_vec();
        s.sort_unstable();
        assert_eq!(s, w, "every acknowledged write reached the other handle, batch by batch");
    }
    assert!(on_a.next().await.unwrap().is_empty(), "a handle skips its own writes");
    let s = b.stats();
    assert_eq!(s.invalidations, written.len() as u64);
    assert_eq!(s.staleness_us.count(), 20);
    assert!(s.staleness_us.quantile_us(0.99) < 1_000_000, "{:?}", s.staleness_us);
}

/// A consumer that falls behind by more than the stream's length (the
/// stream trimmed entries it never read) is told so (`take_gap`): those
/// writes' keys are unknown. One that keeps up is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_behind_a_trimmed_stream_is_told_of_the_gap() {
    let c = cluster(3, 0);
    let writer =
        Backing::open("trim", DIM, Options { stream_len: 300, ..options(&c, Mode::WriteThrough) }).await.unwrap();
    let reader = Backing::open("trim", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    // One consumer from before the stream existed, one from its first entry.
    let (mut behind, mut along) = (reader.subscribe().await.unwrap(), reader.subscribe().await.unwrap());
    writer.write(&[0], &row(0, 1), &[]).await.unwrap();
    let mut later = reader.subscribe().await.unwrap();
    let mut heard = along.next().await.unwrap().len() as u64;
    for k in 1..2500u64 {
        writer.write(&[k], &row(k, 1), &[]).await.unwrap();
        if k % 100 == 99 {
            while heard < k + 1 {
                heard += along.next().await.unwrap().len() as u64;
                assert_eq!(along.take_gap(), None, "a consumer that keeps up misses nothing");
            }
        }
    }
    for (who, c) in [("from the start", &mut behind), ("from the first entry", &mut later)] {
        let mut got = c.next().await.unwrap();
        let mut gap = c.take_gap();
        while !got.is_empty() && gap.is_none() {
            got = c.next().await.unwrap();
            gap = c.take_gap();
        }
        assert_eq!(gap, Some(Gap::Trimmed), "2500 entries written, about 300 kept: the consumer {who} that read none");
    }
}

/// A tester's reader, paused while the stream was trimmed past it, was
/// told of the gap at each of its next reads (the WARN 16 to 20 times in
/// 40 ms, its cache dropped twice): its count of entries read stayed
/// short by the entries lost. Now it is told once per gap, however many
/// reads it takes to catch up with the entries kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_of_trimmed_entries_is_told_once() {
    let c = cluster(3, 0);
    let writer =
        Backing::open("trim1", DIM, Options { stream_len: 1500, ..options(&c, Mode::WriteThrough) }).await.unwrap();
    let reader = Backing::open("trim1", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let mut behind = reader.subscribe().await.unwrap();
    for k in 0..4000u64 {
        writer.write(&[k], &row(k, 1), &[]).await.unwrap();
    }
    // About 1500 entries kept: three reads or more of 512 to catch up.
    let (mut gaps, mut reads, mut heard) = (0, 0, 0);
    loop {
        let got = behind.next().await.unwrap();
        gaps += usize::from(behind.take_gap() == Some(Gap::Trimmed));
        if got.is_empty() {
            break;
        }
        (reads, heard) = (reads + 1, heard + got.len());
        assert!(reads < 100, "the reader never caught up");
    }
    assert!(reads >= 3 && (1500..4000).contains(&heard), "{reads} reads, {heard} entries heard");
    assert_eq!(gaps, 1, "one gap, told once");
    // The writes after it are heard without a gap.
    for k in 0..600u64 {
        writer.write(&[k], &row(k, 2), &[]).await.unwrap();
    }
    let mut more = 0;
    while more < 600 {
        let got = behind.next().await.unwrap();
        assert!(!got.is_empty(), "600 entries written, {more} heard");
        more += got.len();
        assert_eq!(behind.take_gap(), None, "no gap after catching up");
    }
}

/// A consumer whose stream holds fewer entries than it read (the stream
/// deleted, as a failover onto a replica that had not received them
/// leaves it) is told so once, and reads the stream's new entries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_stream_went_back_is_told() {
    let c = cluster(3, 0);
    let writer = Backing::open("back", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let reader = Backing::open("back", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let mut r = reader.subscribe().await.unwrap();
    let mut heard = 0;
    for k in 0..5u64 {
        writer.write(&[k], &row(k, 1), &[]).await.unwrap();
    }
    while heard < 5 {
        heard += r.next().await.unwrap().len();
        assert_eq!(r.take_gap(), None);
    }
    let key = "hkv:{back}:stream";
    let owner = (0..3).find(|&i| c.cli(i, &["exists", key]).is_ok_and(|o| o.trim() == "1")).expect("the stream");
    c.cli(owner, &["del", key]).unwrap();
    writer.write(&[7], &row(7, 2), &[]).await.unwrap();
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while got.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the entry after the stream went back was not read");
        got = r.next().await.unwrap();
    }
    assert_eq!(got[0].keys, vec![7], "the new stream's entry is read");
    assert_eq!(r.take_gap(), Some(Gap::WentBack));
    writer.write(&[8], &row(8, 2), &[]).await.unwrap();
    let mut more = Vec::new();
    while more.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the next entry was not read");
        more = r.next().await.unwrap();
    }
    assert_eq!((more[0].keys.clone(), r.take_gap()), (vec![8], None), "told once, and reading on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_options_get_clear_errors() {
    let open = |seeds: Vec<String>| Backing::open("h", DIM, Options::new(seeds, Mode::WriteThrough));
    for bad in ["", "http://127.0.0.1:1", "redis://", "127.0.0.1:notaport", "unix:///tmp/x"] {
        assert!(matches!(open(vec![bad.into()]).await, Err(Error::BadUrl { .. })), "{bad:?}");
    }
    // A seed without a port was sent to 6379 (`no backing seed answered
    // (127.0.0.1:6379)`), and a query or a fragment was kept unread: each
    // is refused as a bad URL, before any connection.
    for bad in [
        "127.0.0.1",
        "redis://127.0.0.1",
        "redis://:pw@127.0.0.1",
        "redis://127.0.0.1/",
        "[::1]",
        "redis://127.0.0.1:1?x=1",
        "redis://127.0.0.1:1#frag",
        "127.0.0.1:1?x",
    ] {
        let got = open(vec![bad.into()]).await;
        assert!(matches!(got, Err(Error::BadUrl { .. })), "{bad:?}: {got:?}");
    }
    let dead = format!("127.0.0.1:{}", dead_port().unwrap());
    match open(vec![dead.clone()]).await {
        Err(e @ Error::Unreachable { .. }) => assert_eq!(e.code(), "backing_unavailable"),
        other => panic!("{other:?}"),
    }
    let plain = blocking(TestServer::start).unwrap();
    match open(vec![plain.url()]).await {
        Err(Error::NotCluster { node, .. }) => assert!(plain.url().ends_with(&node), "{node}"),
        other => panic!("{other:?}"),
    }
    // A server of another protocol (a web server's page) is named as such,
    // in one line, not as a seed that did not answer.
    let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web_addr = web.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        // Bounded: the tier tries a seed once or twice.
        for s in web.incoming().take(4) {
            let Ok(mut s) = s else { return };
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            let _ = s.read(&mut [0u8; 1024]);
            let _ = s.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n<html><body>no</body></html>\n");
        }
    });
    match open(vec![web_addr.clone()]).await {
        Err(e @ Error::NotRedis { .. }) => {
            let text = e.to_string();
            assert_eq!(e.code(), "invalid_argument");
            assert!(
                text.contains(&web_addr) && text.contains("not as a Redis server") && !text.contains('\n'),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    let c = cluster(3, 0);
    // A dead seed before a live one: the live one serves.
    let mut seeds = vec![dead];
    seeds.extend(c.seeds());
    Backing::open("h", DIM, Options::new(seeds, Mode::WriteThrough)).await.unwrap();
    assert!(matches!(Backing::open("h", DIM + 1, options(&c, Mode::ReadOnly)).await, Err(Error::Mismatch { .. })));
    assert!(matches!("write-sideways".parse::<Mode>(), Err(Error::BadOption { name: "backing-mode", .. })));
    for tweak in [
        (|o: &mut Options| o.deadline = Duration::ZERO) as fn(&mut Options),
        |o| o.queue_bytes = 10,
        |o| o.batch_rows = 0,
        |o| o.retries = 1000,
        |o| o.response_timeout = Duration::from_secs(3600),
    ] {
        let mut o = options(&c, Mode::WriteBack);
        tweak(&mut o);
        assert!(matches!(Backing::open("h2", DIM, o).await, Err(Error::BadOption { .. })));
    }
    // `wait_replicas` on a read-only table (which writes nothing to the
    // cluster) was accepted and meant nothing.
    let mut o = options(&c, Mode::ReadOnly);
    o.wait_replicas = 3;
    assert!(matches!(Backing::open("h2", DIM, o).await, Err(Error::BadOption { name: "wait_replicas", .. })));
    assert!(matches!(
        Backing::open("a{b}", DIM, options(&c, Mode::ReadOnly)).await,
        Err(Error::BadOption { name: "table", .. })
    ));
    let b = Backing::open("h", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    assert!(matches!(b.write(&[1, 2], &[0.0; DIM], &[]).await, Err(Error::BadOption { .. })));
}

/// An IPv6 seed was shown as `::1:7101`, which reads as a host `::1:7101`
/// without a port or a port of another host: errors (and so logs and
/// stats, which name nodes the same way) show `[::1]:7101`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_node_is_shown_in_brackets() {
    let port = dead_port().unwrap();
    for seed in [format!("redis://[::1]:{port}"), format!("[::1]:{port}")] {
        match Backing::open("v6", DIM, Options::new(vec![seed.clone()], Mode::ReadOnly)).await {
            Err(Error::Unreachable { seeds, detail }) => {
                assert_eq!(seeds, format!("[::1]:{port}"), "{seed}");
                assert!(detail.starts_with(&format!("[::1]:{port}: ")), "{detail}");
            }
            other => panic!("{seed}: {other:?}"),
        }
    }
}

/// A password in the seed URL is passed on to every node: a cluster
/// started with `requirepass` / `masterauth` (replicas authenticate to
/// their masters) is refused without it or with a wrong one (the error
/// does not show the password), served with `redis://:PW@…`, and with an
/// ACL user's `redis://USER:PW@…`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_the_seed_url_is_passed_on() {
    let c = blocking(|| TestCluster::start_with_password(3, 1, "s3cret-pw"))
        .expect("start a redis-server cluster with requirepass");
    let port = c.ports()[0];
    let open = |seed: String, mode| Backing::open("pw", DIM, Options::new(vec![seed], mode));
    let e = open(format!("redis://127.0.0.1:{port}"), Mode::WriteThrough).await.unwrap_err();
    assert!(matches!(e, Error::Auth { .. }), "{e:?}");
    let e = open(format!("redis://:wrong-pw@127.0.0.1:{port}"), Mode::WriteThrough).await.unwrap_err();
    assert!(matches!(e, Error::Auth { .. }) && e.code() == "invalid_argument", "{e:?}");
    assert!(!e.to_string().contains("wrong-pw"), "{e}");
    let e = open("redis://:bad-pw@127.0.0.1:notaport".into(), Mode::WriteThrough).await.unwrap_err();
    assert!(matches!(e, Error::BadUrl { .. }) && !e.to_string().contains("bad-pw"), "{e}");

    let b = open(format!("redis://:s3cret-pw@127.0.0.1:{port}"), Mode::WriteThrough).await.unwrap();
    let keys: Vec<u64> = (0..2000u64).collect();
    b.write(&keys, &rows(&keys, 4), &[]).await.unwrap();
    let out = b.read(&keys).await;
    assert!(out.errors.is_empty() && out.fetched.iter().all(|f| *f == Fetched::Found), "{:?}", out.errors);
    assert!(same_bits(&out.values, &rows(&keys, 4)), "rows from all three masters");

    // An ACL user on the seed only: the other masters refuse it. That
    // answered `backing_unavailable … retry` (a node "down") for a table
    // that did not exist; it is the credentials' refusal, naming the node.
    let ok = blocking(|| c.cli(0, &["acl", "setuser", "hkv", "on", ">user-pw", "~*", "&*", "+@all"])).unwrap();
    assert!(ok.contains("OK"), "{ok}");
    let e = open(format!("redis://hkv:user-pw@127.0.0.1:{port}"), Mode::ReadOnly).await.unwrap_err();
    match &e {
        Error::Auth { node, .. } => assert_ne!(node, &format!("127.0.0.1:{port}"), "{e}"),
        _ => panic!("{e:?}"),
    }
    assert_eq!(e.code(), "invalid_argument");
    // An ACL user on every node (ACLs are per node).
    for i in 0..c.ports().len() {
        let ok = blocking(|| c.cli(i, &["acl", "setuser", "hkv", "on", ">user-pw", "~*", "&*", "+@all"])).unwrap();
        assert!(ok.contains("OK"), "{ok}");
    }
    let u = open(format!("redis://hkv:user-pw@127.0.0.1:{port}"), Mode::ReadOnly).await.unwrap();
    assert!(same_bits(&u.read(&keys).await.values, &rows(&keys, 4)));
}

/// An erase reaches the cluster: write-through deletes the rows before it
/// returns (and other hosts are told); write-back queues the erasure, a
/// read of a queued erasure finds the key absent, and after the flush the
/// cluster has no row; read-only refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erases_reach_the_cluster() {
    let c = cluster(3, 0);
    let wt = Backing::open("er", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let wb = Backing::open("er", DIM, options(&c, Mode::WriteBack)).await.unwrap();
    let ro = Backing::open("er", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let mut inv = ro.subscribe().await.unwrap();
    let keys: Vec<u64> = (1..=1000u64).collect();
    wt.write(&keys, &rows(&keys, 1), &[]).await.unwrap();
    wt.erase(&keys[..400]).await.unwrap();
    let out = ro.read(&keys).await;
    assert!(out.fetched[..400].iter().all(|f| *f == Fetched::Absent));
    assert!(out.fetched[400..].iter().all(|f| *f == Fetched::Found));
    // The other handle hears of the erasures on the stream.
    let mut heard = std::collections::HashSet::new();
    let start = Instant::now();
    while heard.len() < 1400 && start.elapsed() < Duration::from_secs(5) {
        for i in inv.next().await.unwrap() {
            heard.extend(i.keys);
        }
    }
    assert!(keys[..400].iter().all(|k| heard.contains(k)), "erased keys announced");

    wb.erase(&keys[400..700]).await.unwrap();
    let out = wb.read(&keys[400..]).await;
    assert!(out.fetched[..300].iter().all(|f| *f == Fetched::Absent), "a queued erasure reads as absent");
    assert!(out.fetched[300..].iter().all(|f| *f == Fetched::Found));
    wb.flush(Duration::from_secs(10)).await.unwrap();
    let out = ro.read(&keys).await;
    assert_eq!(out.fetched.iter().filter(|f| **f == Fetched::Found).count(), 300);
    assert!(same_bits(&out.values[700 * DIM..], &rows(&keys[700..], 1)));
    assert!(matches!(ro.erase(&keys).await, Err(Error::ReadOnly { .. })));
}

/// `wait_replicas`: a write counts once that many replicas of each master
/// have it (`WAIT`); asking for more replicas than there are fails the
/// write by node (`backing_unavailable`), and a write-back queue keeps
/// such rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wait_for_replicas() {
    let c = cluster(3, 1);
    let mut one = options(&c, Mode::WriteThrough);
    one.wait_replicas = 1;
    // A replica answers `WAIT` within milliseconds when idle, but the CI's
    // two cores also run the other tests' clusters (0 of 1 acknowledged in
    // 500 ms failed a fresh-clone run once): give the write that must pass
    // room, the one that must fail below keeps its short wait.
    one.wait_timeout = Duration::from_secs(5);
    one.response_timeout = Duration::from_secs(10);
    let b = Backing::open("wr", DIM, one).await.unwrap();
    let keys: Vec<u64> = (0..500u64).collect();
    b.write(&keys, &rows(&keys, 2), &[]).await.unwrap();
    let mut two = options(&c, Mode::WriteThrough);
    two.wait_replicas = 2;
    two.wait_timeout = Duration::from_millis(200);
    let b2 = Backing::open("wr", DIM, two.clone()).await.unwrap();
    let e = b2.write(&keys, &rows(&keys, 3), &[]).await.unwrap_err();
    assert_eq!(e.code(), "backing_unavailable", "{e:?}");
    assert!(e.to_string().contains("WAIT"), "{e}");
    two.mode = Mode::WriteBack;
    let q = Backing::open("wr", DIM, two).await.unwrap();
    q.write(&keys[..10], &rows(&keys[..10], 5), &[]).await.unwrap();
    assert!(q.flush(Duration::from_millis(800)).await.is_err(), "rows without their replicas stay queued");
    assert_eq!(q.stats().queue_rows, 10);
    let mut bad = options(&c, Mode::WriteThrough);
    bad.wait_replicas = 1;
    bad.wait_timeout = bad.response_timeout;
    assert!(matches!(Backing::open("wr", DIM, bad).await, Err(Error::BadOption { name: "wait_timeout", .. })));
}

/// A walk of the table's rows (`scan`, `scan_next`) sees every row of the
/// table on every master and no row of another table (`w2` shares the
/// prefix `hkv:{w`); `erase_now` deletes rows under write-back without the
/// queue; with a master down the walk stops with `Unavailable` naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_sees_every_row_of_its_table_only() {
    let mut c = cluster(3, 0);
    let w = Backing::open("w", DIM, options(&c, Mode::WriteBack)).await.unwrap();
    let other = Backing::open("w2", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let keys: Vec<u64> = (1..=5000u64).map(|k| k * 7919).collect();
    w.write(&keys, &rows(&keys, 1), &[]).await.unwrap();
    w.flush(Duration::from_secs(10)).await.unwrap();
    other.write(&keys[..100], &rows(&keys[..100], 1), &[]).await.unwrap();
    let walk = |b: Backing| async move {
        let (mut scan, mut seen, mut pages) = (b.scan(), std::collections::BTreeSet::new(), 0);
        while let Some(page) = b.scan_next(&mut scan, 1000).await.unwrap() {
            assert!(!page.is_empty());
            seen.extend(page);
            pages += 1;
            assert!(pages < 1000, "the walk ends");
        }
        seen
    };
    let seen = walk(w.clone()).await;
    assert_eq!(seen, keys.iter().copied().collect(), "every row of w, none of w2");
    assert_eq!(walk(other.clone()).await.len(), 100);

    // erase_now: gone from the cluster at once, though the table writes back.
    w.erase_now(&keys[..1000]).await.unwrap();
    assert_eq!(w.stats().queue_rows, 0);
    let ro = Backing::open("w", DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let out = ro.read(&keys).await;
    assert!(out.fetched[..1000].iter().all(|f| *f == Fetched::Absent));
    assert!(out.fetched[1000..].iter().all(|f| *f == Fetched::Found));
    assert_eq!(walk(w.clone()).await.len(), 4000);
    assert!(matches!(ro.erase_now(&keys).await, Err(Error::ReadOnly { .. })));

    // A master down: the walk fails by node instead of passing it by.
    let port = c.ports()[1];
    blocking(|| c.kill(1));
    let (mut scan, mut failed) = (w.scan(), None);
    for _ in 0..100 {
        match w.scan_next(&mut scan, 1000).await {
            Ok(Some(_)) => continue,
            Ok(None) => break,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    match failed {
        Some(Error::Unavailable { node, .. }) => assert!(node.ends_with(&format!(":{port}")), "{node}"),
        other => panic!("a walk past a dead master gave {other:?}"),
    }
}

/// `insert_absent` (find_or_insert's new rows) never overwrites a row:
/// two handles (two hosts) inserting the same keys at once each get, per
/// key, either "written" or the other's row, and exactly one wins; a key
/// already written keeps its row. Under write-back the refused keys are
/// reported by `take_conflicts` once the queue is flushed, and a later
/// write of a queued key is sent as a plain write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_absent_sets_only_where_the_cluster_has_no_row() {
    let c = cluster(3, 0);
    let a = Backing::open("nx", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let b = Backing::open("nx", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let keys: Vec<u64> = (1..=3000u64).collect();
    let (ra, rb) = (rows(&keys, 1), rows(&keys, 2));
    let (oa, ob) = tokio::join!(a.insert_absent(&keys, &ra, &[]), b.insert_absent(&keys, &rb, &[]));
    let (oa, ob) = (oa.unwrap(), ob.unwrap());
    let truth = b.read(&keys).await;
    for (i, &k) in keys.iter().enumerate() {
        let at = i * DIM..(i + 1) * DIM;
        let (wa, wb) = (oa.fetched[i] == Fetched::Absent, ob.fetched[i] == Fetched::Absent);
        assert!(wa != wb, "key {k}: exactly one handle writes it (a {:?}, b {:?})", oa.fetched[i], ob.fetched[i]);
        let winner = if wa { &ra[at.clone()] } else { &rb[at.clone()] };
        assert!(same_bits(&truth.values[at.clone()], winner), "key {k}: the cluster has the winner's row");
        let loser = if wa { &ob.values } else { &oa.values };
        assert!(same_bits(&loser[at], winner), "key {k}: the other handle is answered the winner's row");
    }
    // A trained row is never overwritten by an insert of the key.
    a.write(&keys[..10], &rows(&keys[..10], 7), &[]).await.unwrap();
    let o = b.insert_absent(&keys[..10], &rows(&keys[..10], 3), &[]).await.unwrap();
    assert!(o.fetched.iter().all(|&f| f == Fetched::Found) && same_bits(&o.values, &rows(&keys[..10], 7)));

    // Write-back: queued, then refused where the cluster has a row.
    let w = Backing::open("nx", DIM, options(&c, Mode::WriteBack)).await.unwrap();
    let fresh: Vec<u64> = (10_001..=10_010u64).collect();
    let o = w.insert_absent(&keys[..20], &rows(&keys[..20], 4), &[]).await.unwrap();
    assert!(o.fetched.iter().all(|&f| f == Fetched::Absent), "queued: answered later");
    w.insert_absent(&fresh, &rows(&fresh, 4), &[]).await.unwrap();
    // A plain write of a queued key replaces its set-if-absent row.
    w.write(&keys[10..20], &rows(&keys[10..20], 5), &[]).await.unwrap();
    w.flush(Duration::from_secs(5)).await.unwrap();
    let mut refused = w.take_conflicts();
    refused.sort_unstable();
    // Keys 1-10 have trained rows: refused. Keys 11-20 are refused too
    // when the queue sent their set-if-absent rows before the plain write
    // replaced them (the sender runs on its own); never any other key.
    assert!(
        keys[..10].iter().all(|k| refused.contains(k)) && refused.iter().all(|k| keys[..20].contains(k)),
        "the queued rows the cluster refused: {refused:?}"
    );
    assert!(w.take_conflicts().is_empty());
    let out = a.read(&keys[..20]).await;
    assert!(same_bits(&out.values[..10 * DIM], &rows(&keys[..10], 7)), "the trained rows stay");
    assert!(same_bits(&out.values[10 * DIM..], &rows(&keys[10..20], 5)), "the plain write went");
    let out = a.read(&fresh).await;
    assert!(same_bits(&out.values, &rows(&fresh, 4)), "fresh keys are written");
    assert!(matches!(
        Backing::open("nx", DIM, options(&c, Mode::ReadOnly))
            .await
            .unwrap()
            .insert_absent(&fresh, &rows(&fresh, 4), &[])
            .await,
        Err(Error::ReadOnly { .. })
    ));
}

/// A slot in the middle of its migration answers a multi-key command whose
/// keys are split between the two nodes (and the importing node one whose
/// keys it lacks) with TRYAGAIN for as long as the migration lasts. Reads
/// of such a group waited for the migration's end (late at the deadline)
/// and writes failed with TRYAGAIN once theirs passed (a tester stalled a
/// migration by hand): now such a command is resent one key at a time,
/// each key following its own ASK, so the group is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_split_by_a_stalled_migration_is_served() {
    let c = cluster(3, 0);
    let mut o = options(&c, Mode::WriteThrough);
    o.deadline = Duration::from_secs(2);
    let b = Backing::open("tg", DIM, o).await.unwrap();
    let layout = b.layout().clone();
    let g = layout.group(0);
    // Four rows of one group, and a fifth key of it that has none.
    let all: Vec<u64> = (0..100_000u64).filter(|&k| layout.group(k) == g).take(5).collect();
    let keys = &all[..4];
    b.write(keys, &rows(keys, 3), &[]).await.unwrap();
    let slot = layout.slot_of_group(g).to_string();
    let ports = c.ports();
    let (src, dst) = start_migration(&c, &slot);
    // One of the group's rows moves; the others stay: the migration stalls.
    let client = redis::Client::open(format!("redis://127.0.0.1:{}", ports[src])).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let migrate = |ks: &[u64]| {
        let mut m = redis::cmd("MIGRATE");
        m.arg("127.0.0.1").arg(ports[dst]).arg("").arg(0).arg(5000).arg("KEYS");
        ks.iter().for_each(|&k| {
            m.arg(layout.row_key(k));
        });
        m
    };
    migrate(&keys[..1]).query_async::<()>(&mut conn).await.unwrap();
    let t = Instant::now();
    let out = b.read(&all).await;
    let read_took = t.elapsed();
    assert!(out.errors.is_empty(), "{:?} after {read_took:?}", out.errors);
    assert_eq!(out.fetched, [[Fetched::Found; 4].as_slice(), &[Fetched::Absent]].concat(), "after {read_took:?}");
    assert!(same_bits(&out.values[..4 * DIM], &rows(keys, 3)));
    // Writes of the split group land (MSET and DEL split alike).
    let t = Instant::now();
    let wrote = b.write(keys, &rows(keys, 4), &[]).await;
    let write_took = t.elapsed();
    assert!(wrote.is_ok(), "{wrote:?} after {write_took:?}");
    b.erase(&keys[..2]).await.unwrap();
    let out = b.read(&all).await;
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let want = [[Fetched::Absent; 2].as_slice(), &[Fetched::Found; 2], &[Fetched::Absent]].concat();
    assert_eq!(out.fetched, want);
    assert!(same_bits(&out.values[2 * DIM..4 * DIM], &rows(&keys[2..], 4)));
    eprintln!("during the stalled migration: read {read_took:?}, write {write_took:?}");
    // Served at once (about 1 ms) against waiting for the migration to end
    // until the 2 s deadline (the read gave up with TRYAGAIN after 1.66 s
    // before): 1 s separates the two with room for a loaded machine.
    let at_once = Duration::from_secs(1);
    assert!(read_took < at_once && write_took < at_once, "read {read_took:?}, write {write_took:?}");
    // The migration ends: the rows are where the cluster says.
    migrate(&keys[2..]).query_async::<()>(&mut conn).await.unwrap();
    for i in [dst, src, (dst + 1) % 3] {
        c.cli(i, &["cluster", "setslot", &slot, "node", &c.node_id(dst).unwrap()]).unwrap();
    }
    let out = read_all(&b, &all, Duration::from_secs(5)).await;
    assert_eq!(out.fetched, want);
    assert!(same_bits(&out.values[2 * DIM..4 * DIM], &rows(&keys[2..], 4)));
}

/// While the stream's slot was half migrated (the source MIGRATING, the
/// target IMPORTING, the stream key moved already, the slot not yet
/// reassigned), every XREAD of a reader got `ASK` and failed: the reader
/// heard no other host's write until the migration ended (a tester's
/// reader stayed stale for the whole stalled migration). The read now
/// follows `ASK` to the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_follows_ask_to_a_stream_being_migrated() {
    let c = cluster(3, 0);
    let a = Backing::open("askst", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let b = Backing::open("askst", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let mut inv = b.subscribe().await.unwrap();
    // Reads until `key` is invalidated (bounded: 100 reads of at most
    // 100 ms each, or 5 s); how long it took.
    async fn heard(inv: &mut hkv_backing::Invalidations, key: u64) -> Option<Duration> {
        let t = Instant::now();
        for _ in 0..100 {
            if let Ok(got) = inv.next().await {
                if got.iter().any(|i| i.keys.contains(&key)) {
                    return Some(t.elapsed());
                }
            }
            if t.elapsed() > Duration::from_secs(5) {
                break;
            }
        }
        None
    }
    a.write(&[1], &row(1, 1), &[]).await.unwrap();
    assert!(heard(&mut inv, 1).await.is_some(), "the stream works before the migration");
    // Stall the migration of the stream's slot half way.
    stream_half_migrated(&c, "askst");
    a.write(&[2], &row(2, 1), &[]).await.unwrap();
    let took = heard(&mut inv, 2).await;
    eprintln!("write heard during the migration after {took:?}");
    assert!(took.is_some_and(|t| t < Duration::from_secs(2)), "the reader did not hear the write: {took:?}");
    // And on: a later write is heard too, on the kept connection.
    a.write(&[3], &row(3, 1), &[]).await.unwrap();
    assert!(heard(&mut inv, 3).await.is_some());
}

/// The stream entries of writes whose rows landed but whose XADD was
/// refused waited on the writer without bound (a tester's 3 000 refused
/// writes of 1 024 keys grew the daemon by 29 MB). They are bounded in
/// bytes: past the bound they become one reset entry, which has every
/// reader drop its cache of the table, and later entries fold into it
/// until it is appended; the stats show what waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_stream_entries_are_bounded_by_a_reset() {
    let c = cluster(3, 0);
    let mut o = options(&c, Mode::WriteThrough);
    o.unpublished_bytes = 64 << 10;
    let a = Backing::open("ub", DIM, o).await.unwrap();
    // The stream's key holds a hash: every XADD is refused (WRONGTYPE),
    // the rows land.
    let slot = hkv_backing::layout::slot(b"ub").to_string();
    let m = (0..3)
        .find(|&i| c.cli(i, &["cluster", "countkeysinslot", &slot]).is_ok_and(|o| o.trim() != "0"))
        .expect("the stream's master");
    let stream = "hkv:{ub}:stream";
    c.cli(m, &["del", stream]).unwrap();
    c.cli(m, &["hset", stream, "x", "y"]).unwrap();
    let keys: Vec<u64> = (0..1024).collect();
    let values = rows(&keys, 1);
    let mut most = 0;
    for _ in 0..100 {
        a.write(&keys, &values, &[]).await.unwrap();
        most = most.max(a.stats().unpublished_bytes);
    }
    let s = a.stats();
    eprintln!(
        "100 refused writes of 1024 keys: at most {most} bytes waited (bound {}), {} now in {} entries, {} resets",
        s.unpublished_limit_bytes, s.unpublished_bytes, s.unpublished_entries, s.unpublished_resets
    );
    assert!(most <= 64 << 10, "{most}");
    assert_eq!((s.unpublished_entries, s.unpublished_resets, s.unpublished_limit_bytes), (1, 1, 64 << 10));
    // The key is freed: the next write appends the reset (its own entry
    // folded in), the one after its own entry; a reader hears both.
    c.cli(m, &["del", stream]).unwrap();
    let b = Backing::open("ub", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let mut inv = b.subscribe().await.unwrap();
    a.write(&[5000], &row(5000, 1), &[]).await.unwrap();
    a.write(&[5001], &row(5001, 1), &[]).await.unwrap();
    assert_eq!((a.stats().unpublished_entries, a.stats().unpublished_bytes), (0, 0));
    let (mut gap, mut heard) = (None, Vec::new());
    for _ in 0..20 {
        heard.extend(inv.next().await.unwrap().into_iter().flat_map(|i| i.keys));
        gap = gap.or(inv.take_gap());
        if heard.contains(&5001) {
            break;
        }
    }
    assert_eq!((gap, heard), (Some(Gap::Reset), vec![5001]));
}

/// A write whose rows landed but whose stream entry's node did not answer
/// waits for that node once, then returns: the entry waits for the
/// table's consumer. (The bound on waiting entries first tried a failed
/// entry's append again at once, holding such a write for two timeouts.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_node_holds_a_write_for_one_timeout() {
    let c = cluster(3, 0);
    let mut o = options(&c, Mode::WriteThrough);
    // A timeout long enough that the bar below leaves a loaded machine
    // 800 ms past one timeout while staying under two.
    o.response_timeout = Duration::from_secs(1);
    o.retries = 0;
    let b = Backing::open("sl", DIM, o).await.unwrap();
    // Keys whose rows live on the other masters.
    let (m, keys) = off_the_stream_node(&c, &b, "sl").await;
    // Paused past two timeouts, so that a write waiting twice is not
    // answered early by the node's resuming.
    c.cli(m, &["client", "pause", "6000", "WRITE"]).unwrap();
    let t = Instant::now();
    b.write(&keys, &rows(&keys, 2), &[]).await.unwrap();
    let took = t.elapsed();
    eprintln!("the write returned after {took:?}");
    // One timeout (1 s) against two: a write that waits twice takes at
    // least 2 s however fast the machine, so 1.8 s separates them.
    assert!(took < Duration::from_millis(1800), "the write waits for the stream's node once: {took:?}");
    assert_eq!(b.stats().unpublished_entries, 1);
}

/// A flush that times out names the nodes that failed meanwhile (a tester
/// got only "see errors per node").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_that_times_out_names_the_failing_node() {
    let mut c = cluster(3, 0);
    let b = Backing::open("ft", DIM, options(&c, Mode::WriteBack)).await.unwrap();
    let port = c.ports()[1];
    blocking(|| c.kill(1));
    let keys: Vec<u64> = (0..3000u64).collect();
    b.write(&keys, &rows(&keys, 2), &[]).await.unwrap();
    let e = b.flush(Duration::from_millis(1500)).await.unwrap_err();
    assert!(matches!(e, Error::FlushTimeout { .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}: ")), "{e}");
    b.discard();
}

/// `wait_replicas` WAITed only on each group's slot owner: while a slot
/// migrated, the rows of a group that were written to the importing node
/// (its per-key commands followed `ASK` there) were never WAITed on
/// there, so a write counted as replicated whose rows on the importing
/// node no replica had. The WAIT now goes to every node that took a
/// write of the batch: with the importing node's replica down, the write
/// fails naming that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_redirected_by_ask_wait_for_the_importing_nodes_replicas() {
    let mut c = cluster(3, 1);
    let mut o = options(&c, Mode::WriteThrough);
    o.wait_replicas = 1;
    // Room for a loaded CI machine in the WAIT that must pass (as
    // `writes_wait_for_replicas`); the one that must fail waits it out.
    o.wait_timeout = Duration::from_secs(2);
    o.response_timeout = Duration::from_secs(5);
    let b = Backing::open("wask", DIM, o).await.unwrap();
    let layout = b.layout().clone();
    let g = layout.group(0);
    let keys: Vec<u64> = (0..100_000u64).filter(|&k| layout.group(k) == g).take(4).collect();
    b.write(&keys, &rows(&keys, 1), &[]).await.unwrap();
    let slot = layout.slot_of_group(g).to_string();
    let ports = c.ports();
    let owner = |c: &TestCluster| {
        (0..6).find(|&i| {
            c.is_master(i) && c.cli(i, &["cluster", "countkeysinslot", &slot]).is_ok_and(|o| o.trim() != "0")
        })
    };
    let src = owner(&c).expect("the slot's master");
    let dst = (0..6).find(|&i| i != src && c.is_master(i)).expect("another master");
    let (sid, did) = (c.node_id(src).unwrap(), c.node_id(dst).unwrap());
    c.cli(dst, &["cluster", "setslot", &slot, "importing", &sid]).unwrap();
    c.cli(src, &["cluster", "setslot", &slot, "migrating", &did]).unwrap();
    // One row of the group moves to dst: the group's MSET splits, its
    // first key's SET asked of dst.
    let client = redis::Client::open(format!("redis://127.0.0.1:{}", ports[src])).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut migrate = redis::cmd("MIGRATE");
    migrate.arg("127.0.0.1").arg(ports[dst]).arg(layout.row_key(keys[0])).arg(0).arg(5000);
    migrate.query_async::<()>(&mut conn).await.unwrap();
    b.write(&keys, &rows(&keys, 2), &[]).await.expect("every node's replica acknowledges");
    let replica = c.replica_of(dst).expect("dst's replica");
    blocking(|| c.kill(replica));
    let t = Instant::now();
    let e = b.write(&keys, &rows(&keys, 3), &[]).await.expect_err("a row on dst that no replica has");
    eprintln!("failed after {:?}: {e}", t.elapsed());
    match &e {
        Error::Unavailable { node, detail } => {
            assert_eq!(node, &format!("127.0.0.1:{}", ports[dst]), "{e}");
            assert!(detail.contains("WAIT"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

/// A reader that followed `ASK` to the node importing the stream's slot
/// counted that node's failure against the slot's owner, which had
/// answered (its `ASK`): the stats blamed a live node and not the dead
/// one. The failure is now counted against the node that failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_ask_target_of_the_stream_is_the_node_counted() {
    let mut c = cluster(3, 0);
    let a = Backing::open("askf", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let b = Backing::open("askf", DIM, options(&c, Mode::WriteThrough)).await.unwrap();
    let mut inv = b.subscribe().await.unwrap();
    a.write(&[1], &row(1, 1), &[]).await.unwrap();
    let (src, dst) = stream_half_migrated(&c, "askf");
    let ports = c.ports();
    // The reader reads on dst, asked there; then dst dies.
    for _ in 0..5 {
        inv.next().await.unwrap();
    }
    blocking(|| c.kill(dst));
    let mut failed = 0;
    for _ in 0..5 {
        failed += usize::from(inv.next().await.is_err());
    }
    assert!(failed > 0, "reads of a dead ASK target fail");
    let errors = b.stats().node_errors;
    eprintln!("errors per node: {errors:?}");
    let (at_src, at_dst) = (format!("127.0.0.1:{}", ports[src]), format!("127.0.0.1:{}", ports[dst]));
    assert!(errors.get(&at_dst).is_some_and(|&n| n > 0), "the dead node counted: {errors:?}");
    assert!(!errors.contains_key(&at_src), "the live owner that answered ASK is not: {errors:?}");
}

/// With the stream's node stopped (SIGSTOP: its sockets stay open and
/// buffer what is sent, nothing answers), a write-through write whose rows
/// landed on the other masters waited out several response timeouts for
/// its stream entry, and the entry's appends sent meanwhile all ran when
/// the node resumed: other hosts read the same write twice (or more).
/// The write now waits for the stream's node once, and the entry is in
/// the stream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_stream_node_gets_a_write_s_entry_once() {
    let c = cluster(3, 0);
    let mut o = options(&c, Mode::WriteThrough);
    // A timeout long enough that the bar below leaves a loaded machine
    // 800 ms past one timeout while staying under two.
    o.response_timeout = Duration::from_secs(1);
    let b = Backing::open("stop", DIM, o).await.unwrap();
    let (m, keys) = off_the_stream_node(&c, &b, "stop").await;
    // The writer's own consumer retries its waiting entries, as the
    // daemon's does.
    let mut inv = b.subscribe().await.unwrap();
    let stream = "hkv:{stop}:stream";
    let entries = || c.cli(m, &["xlen", stream]).unwrap().trim().parse::<u64>().unwrap();
    let before = entries();
    c.pause(m).unwrap();
    let t = Instant::now();
    let wrote = b.write(&keys, &rows(&keys, 2), &[]).await;
    let took = t.elapsed();
    // The consumer runs on while the node is stopped, then after it resumes.
    let t2 = Instant::now();
    while t2.elapsed() < Duration::from_secs(3) {
        let _ = inv.next().await;
    }
    c.resume(m).unwrap();
    let t3 = Instant::now();
    while t3.elapsed() < Duration::from_secs(3) {
        let _ = inv.next().await;
    }
    let after = entries();
    let all = c.cli(m, &["xrange", stream, "-", "+"]).unwrap();
    eprintln!("the write returned {wrote:?} after {took:?}; entries {before} -> {after}; stats {:?}", b.stats());
    wrote.unwrap();
    assert_eq!(b.stats().unpublished_entries, 0, "the entry was appended");
    assert_eq!(after - before, 1, "one entry for one write:\n{all}");
    // One timeout (1 s) against two or more (three before: 1.5 s at a
    // 500 ms timeout): a write that waits twice takes at least 2 s however
    // fast the machine, so 1.8 s separates them.
    assert!(took < Duration::from_millis(1800), "the write waits for the stream's node once: {took:?}");
}

// A tester's cold read of 2000 rows of dim 16384 (128 MB) with a 300 ms
// deadline took 1.9 s before failing `timeout`. The deadline bounded the
// wait for answers only: rows that came just in time were then decoded
// past it (reads of 600 such rows at 100 ms took up to 227 ms, every key
// found), and a late answer kept coming on the node's pooled
// connection, so the next read's commands waited behind it and were late
// too. Now an answer not decoded by the deadline is late, and a node that
// was late gets a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_bounds_a_read_of_wide_rows() {
    const WIDE: usize = 16384;
    let c = cluster(3, 0);
    let mut o = Options::new(c.seeds(), Mode::WriteThrough);
    o.deadline = Duration::from_millis(100);
    o.response_timeout = Duration::from_secs(5);
    let b = Backing::open("wide", WIDE, o).await.unwrap();
    let keys: Vec<u64> = (0..1500u64).collect();
    let row: Vec<f32> = (0..WIDE).map(|j| j as f32).collect();
    for chunk in keys.chunks(100) {
        let v: Vec<f32> = chunk.iter().flat_map(|_| row.iter().copied()).collect();
        b.write(chunk, &v, &[]).await.unwrap();
    }
    let mut worst = Duration::ZERO;
    for _ in 0..4 {
        let t = Instant::now();
        let out = b.read(&keys).await;
        worst = worst.max(t.elapsed());
        for (i, f) in out.fetched.iter().enumerate() {
            assert!(matches!(f, Fetched::Found | Fetched::Late), "key {i}: {f:?}");
            if *f == Fetched::Found {
                assert!(same_bits(&out.values[i * WIDE..(i + 1) * WIDE], &row));
            }
        }
        // A read with a deadline too short for its 96 MB: its answers
        // are still coming when it returns. The next read, of 3 rows, is
        // not queued behind them on the same connection (the nodes may
        // still be busy sending them: on a loaded 2-core CI machine a
        // 100 ms deadline was too short for it, so it gets 2 s here).
        let late = b.read_by(&keys, std::time::Instant::now() + Duration::from_millis(5)).await;
        assert!(late.fetched.contains(&Fetched::Late));
        let small = b.read_by(&keys[..3], std::time::Instant::now() + Duration::from_secs(2)).await;
        assert_eq!(small.fetched, vec![Fetched::Found; 3], "a small read after a late one");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Not a timing bar (benchmarks give those): a bound far past the
    // deadline's scheduling noise on a loaded machine and below what the
    // bug took (a 300 ms deadline's read took 1.9 s; 100 ms ones up to
    // 2.2 s through the daemon).
    eprintln!("the slowest read with a 100 ms deadline took {worst:?}");
    assert!(worst < Duration::from_millis(500), "a read with a 100 ms deadline took {worst:?}");
}

/// A tester's table named a node of each of two clusters; it was
/// accepted, and a restart that found its own cluster's seed stopped for
/// 3 s opened it on the other cluster: the restore's check erased every
/// restored row from the cache and new writes, and a new meta hash, went
/// to the wrong cluster. Now a new table refuses seeds of two clusters,
/// naming which is which, and a table that existed before opens only on
/// a cluster holding its meta hash: one without it is refused and gets
/// nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_of_two_clusters_are_refused_and_an_existing_table_never_adopts_another() {
    let (one, two) = (cluster(3, 0), cluster(3, 0));
    let mixed = vec![one.seeds()[0].clone(), one.seeds()[1].clone(), two.seeds()[0].clone()];
    match Backing::open("split", DIM, options(&one, Mode::WriteThrough).with_seeds(mixed.clone())).await {
        Err(e @ Error::SeedsSplit { .. }) => {
            assert_eq!(e.code(), "invalid_argument");
            let Error::SeedsSplit { groups } = &e else { unreachable!() };
            let want = format!("cluster 1: {}, {}; cluster 2: {}", mixed[0], mixed[1], mixed[2]);
            assert_eq!(groups, &want, "{e}");
        }
        other => panic!("seeds of two clusters were not refused: {other:?}"),
    }
    let meta_on = |c: &TestCluster| (0..3).any(|i| c.cli(i, &["exists", "hkv:{split}:meta"]).unwrap().trim() == "1");
    assert!(!meta_on(&one) && !meta_on(&two), "a refused table writes no meta hash");

    // A table that existed before, on a cluster without its meta hash:
    // refused as unavailable, nothing written there.
    let existing =
        |seeds: Vec<String>| Options { existing: true, ..options(&one, Mode::WriteThrough).with_seeds(seeds) };
    match Backing::open("split", DIM, existing(two.seeds())).await {
        Err(e @ Error::NoMeta { .. }) => assert_eq!(e.code(), "backing_unavailable"),
        other => panic!("a cluster without the table's meta hash was adopted: {other:?}"),
    }
    assert!(!meta_on(&two), "no meta hash is made on a cluster the table was not created on");

    // Created on cluster one; opened again with the other cluster's seed
    // first, it opens on the cluster that holds its meta hash.
    let b = Backing::open("split", DIM, options(&one, Mode::WriteThrough)).await.unwrap();
    b.write(&[1, 2, 3], &rows(&[1, 2, 3], 1), &[]).await.unwrap();
    let again = Backing::open("split", DIM, existing(vec![two.seeds()[0].clone(), one.seeds()[0].clone()]))
        .await
        .expect("opened on the cluster holding its meta hash");
    let out = again.read(&[1, 2, 3]).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found) && same_bits(&out.values, &rows(&[1, 2, 3], 1)));
    again.write(&[4], &row(4, 1), &[]).await.unwrap();
    assert!(!meta_on(&two), "nothing of the table reaches the other cluster");
    assert_eq!(two.cli(0, &["dbsize"]).unwrap().trim(), "0");
}

/// A tester stopped one master (SIGSTOP) under write-back: of 20 000
/// queued rows, 7 650 were the stopped node's, yet the queue stayed at
/// 20 000 for 2 s and came down to 7 650 only after about 10 s (batches
/// spanned every node, so each waited for the stopped one); a SIGKILL
/// then lost healthy nodes' rows. Now each node's rows are sent apart:
/// the healthy nodes' rows reach the cluster well within the stall, the
/// stopped node's wait and drain once it resumes, and a key written twice
/// meanwhile ends with its later row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_master_holds_up_only_its_own_write_back_rows() {
    let c = cluster(3, 0);
    let table = "stall";
    let b = Backing::open(table, DIM, options(&c, Mode::WriteBack)).await.unwrap();
    let owners = c.slot_owners();
    let layout = b.layout().clone();
    let node = |k: u64| owners[layout.slot_of_group(layout.group(k)) as usize];
    // Not the stream's master: a stopped stream node costs each write
    // one response timeout for its entry, once (a test of its own).
    let stalled = (0..3).find(|&i| i != owners[hkv_backing::layout::slot(table.as_bytes()) as usize]).unwrap();
    let keys: Vec<u64> = (1..=20_000u64).collect();
    let theirs: Vec<u64> = keys.iter().copied().filter(|&k| node(k) == stalled).collect();
    assert!(theirs.len() > 3000 && theirs.len() < 10_000, "{} rows on the stalled node", theirs.len());

    let healthy: Vec<u64> = keys.iter().copied().filter(|&k| node(k) != stalled).collect();
    let seed = c.seeds()[(stalled + 1) % 3].clone();
    let others = Backing::open(table, DIM, Options::new(vec![seed], Mode::ReadOnly)).await.unwrap();

    c.pause(stalled).unwrap();
    let start = Instant::now();
    for chunk in keys.chunks(2000) {
        b.write(chunk, &rows(chunk, 1), &[]).await.unwrap();
    }
    // A later write of the stalled node's keys, queued behind the first.
    b.write(&theirs, &rows(&theirs, 2), &[]).await.unwrap();
    let landed = |out: &hkv_backing::ReadOut| {
        out.fetched.iter().all(|f| *f == Fetched::Found) && same_bits(&out.values, &rows(&healthy, 1))
    };
    let mut out = others.read(&healthy).await;
    while !landed(&out) && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        out = others.read(&healthy).await;
    }
    let took = start.elapsed();
    assert!(landed(&out), "the healthy nodes' rows never reached the cluster while one node stalled");
    assert!(took < Duration::from_secs(3), "the healthy nodes' rows took {took:?} while one node stalled");
    // Only the stalled node's rows wait (a key counts twice while its
    // first row is in flight and its later one queued behind it). A
    // healthy node's batch is readable in the cluster a moment before its
    // acknowledgement settles it here, so the count is awaited briefly
    // (CI once read 13 236 in that moment).
    let waiting = theirs.len() as u64..=2 * theirs.len() as u64;
    let settled = Instant::now();
    let mut left = b.stats().queue_rows;
    while !waiting.contains(&left) && settled.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = b.stats().queue_rows;
    }
    assert!(waiting.contains(&left), "{left} rows queued, {} of them the stalled node's", theirs.len());

    blocking(|| c.resume(stalled)).unwrap();
    b.flush(Duration::from_secs(30)).await.unwrap();
    let fresh = Backing::open(table, DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let out = read_all(&fresh, &theirs, Duration::from_secs(10)).await;
    assert!(out.fetched.iter().all(|f| *f == Fetched::Found), "the stalled node's rows drained");
    assert!(same_bits(&out.values, &rows(&theirs, 2)), "each key ends with its later row");
    assert_eq!(b.stats().queue_rows, 0);
}

/// The node of a 3-master cluster that serves the slot of `tag` (it must
/// hold a key there).
fn owner_of(c: &TestCluster, tag: &str) -> usize {
    let slot = hkv_backing::layout::slot(tag.as_bytes()).to_string();
    (0..3)
        .find(|&i| c.cli(i, &["cluster", "countkeysinslot", &slot]).is_ok_and(|o| o.trim() != "0"))
        .expect("the slot's master")
}

/// An open table never read its meta hash again. A tester deleted it (or
/// restarted its node empty) while host A had the table open: host B's
/// create-table then wrote a meta hash of its own (another group count
/// after masters were added, or another dim), and A and B read and wrote
/// different keys, each seeing the other's rows absent, with nothing said.
/// Now each open tier reads it again every `meta_every`: a lost one is
/// written back with its layout (so a later opener gets it), and one that
/// says another layout fails the table's requests that need the cluster
/// (`backing_unavailable`) until it agrees again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_meta_hash_comes_back_and_a_replaced_one_stops_the_table() {
    let c = cluster(3, 0);
    let table = "metaw";
    let mut o = options(&c, Mode::WriteBack);
    o.meta_every = Duration::from_millis(200);
    let a = Backing::open(table, DIM, o).await.unwrap();
    let keys: Vec<u64> = (0..50).collect();
    a.write(&keys, &rows(&keys, 1), &[]).await.unwrap();
    a.flush(Duration::from_secs(10)).await.unwrap();
    let node = owner_of(&c, table);
    let meta = format!("hkv:{{{table}}}:meta");
    let groups = a.layout().groups().to_string();

    // Deleted: back within the period, with A's layout.
    assert_eq!(blocking(|| c.cli(node, &["del", &meta])).unwrap().trim(), "1");
    let back = || c.cli(node, &["hget", &meta, "groups"]).map(|g| g.trim() == groups).unwrap_or(false);
    blocking(|| hkv_backing::testkit::wait_until(Duration::from_secs(3), "the meta hash written back", back)).unwrap();
    assert_eq!(blocking(|| c.cli(node, &["hget", &meta, "dim"])).unwrap().trim(), DIM.to_string());
    // So B, opening now with another dim, is refused as before the loss.
    let b = Backing::open(table, DIM / 2, options(&c, Mode::ReadOnly)).await;
    assert!(matches!(b, Err(Error::Mismatch { .. })), "{b:?}");

    // Replaced with another layout: A's requests that need the cluster
    // fail (its queue held), naming the meta hash, until it agrees again.
    blocking(|| c.cli(node, &["del", &meta])).unwrap();
    let other = (DIM / 2).to_string();
    let hset = ["hset", &meta, "layout", "1", "dim", &other, "groups", "7", "row", "values"];
    blocking(|| c.cli(node, &hset)).unwrap();
    let refused = || async {
        let out = a.read(&keys).await;
        out.errors.iter().any(|e| matches!(e, Error::MetaReplaced { .. }))
            && out.fetched.iter().all(|f| *f == Fetched::Unavailable)
    };
    let start = Instant::now();
    while !refused().await && start.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused().await, "reads refused while the meta hash says another layout");
    let e = a.write(&keys, &rows(&keys, 2), &[]).await.unwrap_err();
    assert!(matches!(e, Error::MetaReplaced { .. }) && e.code() == "backing_unavailable", "{e}");
    assert!(!e.may_have_landed(), "nothing of it was sent");
    assert_eq!(a.stats().queue_rows, 0, "nothing of the refused write was queued");

    // Put back: A serves again.
    blocking(|| c.cli(node, &["hset", &meta, "dim", &DIM.to_string(), "groups", &groups])).unwrap();
    let start = Instant::now();
    while refused().await && start.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = a.read(&keys).await;
    assert!(out.errors.is_empty() && same_bits(&out.values, &rows(&keys, 1)), "{:?}", out.errors);
}

/// A write-back write refused with `resource_exhausted` was partly
/// applied: the queue took it in chunks of half its bound, and a write
/// whose later chunk found no room before the writer's wait had its first
/// chunks queued already; they reached the cluster once the stalled master
/// resumed, though the writer was told the write failed. Now a write is
/// queued whole or not at all, and one larger than the whole queue is
/// refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_the_full_queue_refuses_leaves_nothing_behind() {
    let c = cluster(3, 0);
    let table = "qfull";
    let mut o = options(&c, Mode::WriteBack);
    // Room for 64 rows (each its value and its 8-byte key).
    let entry = (16 + 4 * DIM + 8) as u64;
    o.queue_bytes = 64 * entry;
    // Long enough that "at once" below can be given a loaded machine's
    // margin and still be told from a wait.
    o.queue_wait = Duration::from_secs(2);
    let b = Backing::open(table, DIM, o).await.unwrap();
    let owners = c.slot_owners();
    let layout = b.layout().clone();
    let stream = owners[hkv_backing::layout::slot(table.as_bytes()) as usize];
    let stalled = (0..3).find(|&i| i != stream).unwrap();
    let theirs: Vec<u64> =
        (0..100_000u64).filter(|&k| owners[layout.slot_of_group(layout.group(k)) as usize] == stalled).collect();
    c.pause(stalled).unwrap();
    // 20 rows that cannot drain, then 60 more of the stalled node's keys:
    // they fit the bound, not beside the 20.
    b.write(&theirs[..20], &rows(&theirs[..20], 1), &[]).await.unwrap();
    let refused = &theirs[20..80];
    let e = b.write(refused, &rows(refused, 1), &[]).await.unwrap_err();
    assert!(matches!(e, Error::QueueFull { .. }) && e.code() == "resource_exhausted", "{e}");
    // More than the whole bound: at once, without the wait.
    let huge = &theirs[100..200];
    let start = Instant::now();
    let e = b.write(huge, &rows(huge, 1), &[]).await.unwrap_err();
    assert!(matches!(e, Error::QueueTooSmall { .. }) && e.code() == "resource_exhausted", "{e}");
    // At once (milliseconds) against after the 2 s wait, which no machine
    // can make shorter: 1 s separates them.
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "refused at once, not after the wait: {took:?}");
    assert_eq!(b.stats().queue_rows, 20);

    blocking(|| c.resume(stalled)).unwrap();
    b.flush(Duration::from_secs(30)).await.unwrap();
    let fresh = Backing::open(table, DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let out = read_all(&fresh, &theirs[..200], Duration::from_secs(10)).await;
    let found: Vec<usize> = (0..200).filter(|&i| out.fetched[i] == Fetched::Found).collect();
    assert_eq!(found, (0..20).collect::<Vec<_>>(), "only the accepted write's rows are in the cluster");
}

/// A cluster with hash slots that no master serves was accepted, and the
/// table's requests on keys of those slots failed later ("no node serves
/// slot 12758"): it is refused at open, naming the slot ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_unserved_slots_is_refused() {
    let c = cluster(3, 0);
    // Each node forgets the slots' master itself (gossip tells no node to).
    // The master that serves them first: until it forgets them, its
    // heartbeats claim them, and a node that forgot them already takes the
    // claim (an unassigned slot goes to whoever claims it). With the
    // master last, a heartbeat in between put the slots back on a node
    // that had forgotten them, for good (the wait below timed out in 1 of 3
    // runs on a loaded 2-core machine), so a node that still lists them is
    // told again.
    let serves_them = |i: usize| {
        c.cli(i, &["cluster", "nodes"]).is_ok_and(|o| {
            o.lines().any(|l| l.contains("myself") && l.split_whitespace().any(|f| f.ends_with("-16383")))
        })
    };
    let mut order: Vec<usize> = (0..3).collect();
    blocking(|| order.sort_by_key(|&i| !serves_them(i)));
    for i in order {
        let out = blocking(|| c.cli(i, &["cluster", "delslotsrange", "16000", "16383"])).unwrap();
        assert!(out.contains("OK"), "{out}");
    }
    let unassigned = || {
        let listing: Vec<usize> =
            (0..3).filter(|&i| c.cli(i, &["cluster", "slots"]).is_ok_and(|o| o.contains("16383"))).collect();
        for &i in &listing {
            let _ = c.cli(i, &["cluster", "delslotsrange", "16000", "16383"]);
        }
        listing.is_empty()
    };
    blocking(|| hkv_backing::testkit::wait_until(Duration::from_secs(10), "the slots unassigned", unassigned)).unwrap();
    let e = Backing::open("holes", DIM, options(&c, Mode::WriteThrough)).await.unwrap_err();
    assert!(matches!(e, Error::SlotsUnserved { .. }) && e.code() == "invalid_argument", "{e:?}");
    assert!(e.to_string().contains("16000-16383"), "{e}");
}

/// The keys other hosts hear of through `inv` within `limit`.
async fn heard(inv: &mut hkv_backing::Invalidations, limit: Duration) -> std::collections::HashSet<u64> {
    let (t, mut keys) = (Instant::now(), std::collections::HashSet::new());
    while t.elapsed() < limit {
        if let Ok(batch) = inv.next().await {
            batch.into_iter().for_each(|i| keys.extend(i.keys));
        }
    }
    keys
}

/// A tester's host A wrote 100 keys write-through while the master of 31
/// of them was stopped (SIGSTOP): the write failed for those 31, but the
/// master ran the `MSET` buffered for it when it resumed, and no stream
/// entry ever named them, so host B served its old rows of them with no
/// end. Now the keys of a write a node failed are announced again once
/// that node answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_a_stopped_master_ran_late_is_announced() {
    let c = cluster(3, 0);
    let table = "ranlate";
    let mut o = options(&c, Mode::WriteThrough);
    o.response_timeout = Duration::from_millis(500);
    let a = Backing::open(table, DIM, o).await.unwrap();
    // Keys off the stream's master: the one stopped holds them.
    let (stream, keys) = off_the_stream_node(&c, &a, table).await;
    let slots = c.slot_owners();
    let layout = a.layout().clone();
    let stopped = slots[layout.slot_of_group(layout.group(keys[0])) as usize];
    assert_ne!(stopped, stream);
    let theirs: Vec<u64> =
        keys.iter().copied().filter(|&k| slots[layout.slot_of_group(layout.group(k)) as usize] == stopped).collect();
    let b = Backing::open(table, DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let mut inv = b.subscribe().await.unwrap();

    c.pause(stopped).unwrap();
    let wrote = a.write(&theirs, &rows(&theirs, 2), &[]).await;
    assert!(wrote.is_err(), "the stopped master cannot acknowledge: {wrote:?}");
    blocking(|| std::thread::sleep(Duration::from_millis(500)));
    c.resume(stopped).unwrap();
    // It ran the write when it resumed.
    let fresh = Backing::open(table, DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let out = read_all(&fresh, &theirs, Duration::from_secs(10)).await;
    assert!(same_bits(&out.values, &rows(&theirs, 2)), "the stopped master ran the write it failed");
    // And B hears of those keys.
    let got = heard(&mut inv, Duration::from_secs(6)).await;
    let missing: Vec<u64> = theirs.iter().copied().filter(|k| !got.contains(k)).collect();
    assert!(
        missing.is_empty(),
        "B never heard of {} of {} keys the cluster now holds: {missing:?}",
        missing.len(),
        theirs.len()
    );
}

/// A tester stopped the master of a table's stream (SIGSTOP) until its
/// replica took over, with a write-through write in between: the write's
/// stream entry, buffered on the stopped master, was answered when it
/// resumed and then lost with its demotion (the new master never had it),
/// so another host served the old rows of every key of the write with no
/// end. Now an entry answered only after its node stalled is announced
/// again when that node no longer serves the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_lost_with_a_demoted_stream_master_is_announced_again() {
    let c = cluster(3, 1);
    let table = "demoted";
    let mut o = options(&c, Mode::WriteThrough);
    o.response_timeout = Duration::from_millis(500);
    let a = Backing::open(table, DIM, o).await.unwrap();
    let slot = hkv_backing::layout::slot(table.as_bytes()).to_string();
    let owner = |c: &TestCluster| {
        (0..6).find(|&i| {
            c.is_master(i) && c.cli(i, &["cluster", "countkeysinslot", &slot]).is_ok_and(|o| o.trim() != "0")
        })
    };
    let stream = owner(&c).expect("the stream's master");
    let replica = c.replica_of(stream).expect("its replica");
    let layout = a.layout().clone();
    let candidates: Vec<u64> = (0..200).collect();
    a.write(&candidates, &rows(&candidates, 1), &[]).await.unwrap();
    let stream_port = c.ports()[stream].to_string();
    let on_stream = |k: u64| {
        let s = layout.slot_of_group(layout.group(k)).to_string();
        c.cli(stream, &["cluster", "countkeysinslot", &s]).is_ok_and(|o| o.trim() != "0")
    };
    let keys: Vec<u64> = candidates.iter().copied().filter(|&k| !on_stream(k)).take(20).collect();
    assert_eq!(keys.len(), 20, "keys off the stream's master ({stream_port})");
    let b = Backing::open(table, DIM, options(&c, Mode::ReadOnly)).await.unwrap();
    let mut inv = b.subscribe().await.unwrap();

    c.pause(stream).unwrap();
    // The rows land on the other masters; the entry waits on the stopped one.
    a.write(&keys, &rows(&keys, 2), &[]).await.unwrap();
    blocking(|| {
        hkv_backing::testkit::wait_until(Duration::from_secs(30), "the replica to take over", || c.is_master(replica))
    })
    .unwrap();
    c.resume(stream).unwrap();
    blocking(|| {
        hkv_backing::testkit::wait_until(Duration::from_secs(30), "the old master to follow", || !c.is_master(stream))
    })
    .unwrap();
    // B reads the stream only now, from the new master.
    let got = heard(&mut inv, Duration::from_secs(8)).await;
    let missing: Vec<u64> = keys.iter().copied().filter(|k| !got.contains(k)).collect();
    assert!(missing.is_empty(), "B never heard of {} of {} keys written: {missing:?}", missing.len(), keys.len());
}
