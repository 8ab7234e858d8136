//! Checkpoints through the real daemon: round trips for every policy and
//! mode (4 shards onto 3), crashes while writing and while restoring,
//! corrupted chunks, traffic during a checkpoint, config mismatches,
//! incremental chains, retention, the schedule and the final checkpoint.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::Daemon;
use hkv_client::{Client, Filter, TableSpec};

fn spec(name: &str, dim: usize, capacity: u64, policy: &str, mode: &str) -> TableSpec {
    TableSpec { policy: policy.into(), mode: mode.into(), ..TableSpec::new(name, dim, capacity) }
}

/// Every entry of a table: key -> (value bits, score).
fn snapshot(c: &mut Client, table: &str) -> BTreeMap<u64, (Vec<u32>, u64)> {
    let (k, v, s) = c.export_all(table, Filter::default()).unwrap();
    let dim = if k.is_empty() { 0 } else { v.len() / k.len() };
    k.iter()
        .enumerate()
        .map(|(i, &key)| (key, (v[i * dim..(i + 1) * dim].iter().map(|x| x.to_bits()).collect(), s[i])))
        .collect()
}

fn fill(c: &mut Client, table: &str, dim: usize, keys: std::ops::Range<u64>, scores: bool) {
    let keys: Vec<u64> = keys.collect();
    for part in keys.chunks(1 << 16) {
        let vals: Vec<f32> = part.iter().flat_map(|&k| (0..dim).map(move |d| k as f32 * 0.5 + d as f32)).collect();
        let sc: Vec<u64> = part.iter().map(|k| k % 1000 + 1).collect();
        c.insert_or_assign(table, part, &vals, scores.then_some(&sc[..])).unwrap();
    }
}

#[test]
fn every_policy_and_mode_round_trips_bit_for_bit_from_4_shards_onto_3() {
    let d = Daemon::start(&["--shards", "4"]);
    let mut c = d.client();
    let mut before = BTreeMap::new();
    for policy in ["lru", "lfu", "epoch-lru", "epoch-lfu", "custom"] {
        for mode in ["single", "dual"] {
            let name = format!("{policy}-{mode}");
            c.create_table(spec(&name, 3, 1 << 15, policy, mode)).unwrap();
            c.set_epoch(&name, 7).unwrap();
            let takes = !matches!(policy, "lru" | "epoch-lru");
            fill(&mut c, &name, 3, 1..5001, takes);
            // Updates so that scores differ from their first write.
            fill(&mut c, &name, 3, 1..1001, takes);
            before.insert(name.clone(), snapshot(&mut c, &name));
            assert_eq!(before[&name].len(), 5000);
        }
    }
    let l = c.checkpoint(true, false).unwrap();
    assert_eq!(l["entries"], 50_000);
    let d = d.restart(&["--shards", "3"]);
    let mut c = d.client();
    for (name, snap) in &before {
        let t = c.tables().unwrap().into_iter().find(|t| &t.spec.name == name).expect("table restored");
        assert_eq!(t.shards, 3);
        assert_eq!(&snapshot(&mut c, name), snap, "{name}: keys, value bits and scores survive");
    }
}

#[test]
fn a_crash_mid_checkpoint_leaves_the_previous_one_intact_and_is_collected() {
    let mut d = Daemon::start(&["--shards", "2", "--checkpoint-full-every", "0"]);
    let mut c = d.client();
    c.create_table(spec("big", 32, 1 << 21, "lru", "single")).unwrap();
    fill(&mut c, "big", 32, 0..600_000, false);
    let a = c.checkpoint(true, false).unwrap();
    let a_id = a["id"].as_str().unwrap().to_string();
    fill(&mut c, "big", 32, 600_000..1_200_000, false);
    c.checkpoint(false, false).unwrap();
    // Kill as soon as the second checkpoint has written something.
    let t0 = Instant::now();
    let b_id = loop {
        let st = c.stats().unwrap();
        if let Some(p) = st["checkpoint"]["running"].as_object() {
            if p["entries_done"].as_u64().unwrap_or(0) > 0 {
                break p["id"].as_str().unwrap().to_string();
            }
        }
        assert_eq!(st["checkpoint"]["last"]["id"], a["id"], "the checkpoint finished before the crash: {st}");
        assert!(t0.elapsed() < Duration::from_secs(30));
    };
    d.kill();
    let root = d.dir.path().to_path_buf();
    // Also crash during the restore that follows, then restore for real.
    let mut child = common::command(&root, &["--shards", "2"]).stderr(std::process::Stdio::null()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(150));
    child.kill().unwrap();
    child.wait().unwrap();
    let d = d.restart(&["--shards", "2"]);
    let mut c = d.client();
    let listed = c.checkpoints().unwrap();
    let ids: Vec<&str> = listed.as_array().unwrap().iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [a_id.as_str()], "the interrupted checkpoint is not listed");
    assert_eq!(c.tables().unwrap()[0].size, 600_000, "the previous checkpoint restored whole");
    let f = c.find("big", &[5, 599_999, 600_000]).unwrap();
    assert_eq!(f.found, [true, true, false]);
    assert_eq!(f.values[32..64].iter().map(|v| *v as u64).collect::<Vec<_>>()[0], 299_999);
    // Its leftover chunks were collected at start.
    drop(c);
    let mut d = d;
    d.signal("TERM");
    assert_eq!(d.wait(Duration::from_secs(60)), 0);
    let cat = hkv_checkpoint::Catalog::open(&root.join("state").join("checkpoints")).unwrap();
    let b = u64::from_str_radix(&b_id, 16).unwrap();
    assert!(!cat.chunk_dir(b).exists(), "leftover chunks of {b_id} remain");
}

#[test]
fn a_corrupt_chunk_is_named_and_latest_falls_back_to_the_previous_checkpoint() {
    let d = Daemon::start(&["--checkpoint-full-every", "0"]);
    let mut c = d.client();
    c.create_table(spec("t", 4, 1 << 14, "custom", "dual")).unwrap();
    fill(&mut c, "t", 4, 1..2001, true);
    let a = c.checkpoint(true, false).unwrap();
    let snap_a = snapshot(&mut c, "t");
    fill(&mut c, "t", 4, 2001..3001, true);
    let b = c.checkpoint(true, false).unwrap();
    let b_id = b["id"].as_str().unwrap().to_string();
    let mut d = d;
    d.signal("TERM");
    assert_eq!(d.wait(Duration::from_secs(30)), 0);
    // Flip one byte in the middle of one of b's chunks.
    let root = d.dir.path().to_path_buf();
    let chunk_key = {
        let cat = hkv_checkpoint::Catalog::open(&root.join("state").join("checkpoints")).unwrap();
        let m = cat.manifest(u64::from_str_radix(&b_id, 16).unwrap()).unwrap();
        let key = m.tables[0].chunks[0].key.clone();
        let path = cat.chunk_path(&m.tables[0].chunks[0]);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        key
    };
    // Restoring it by id fails and names checkpoint and chunk.
    let out = common::command(&root, &["--restore", &b_id]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&b_id) && err.contains(&chunk_key) && err.contains("corrupt"), "{err}");
    // `latest` skips it with a warning and restores a, whole.
    let d = d.restart(&[]);
    let mut c = d.client();
    assert_eq!(snapshot(&mut c, "t"), snap_a);
    assert_ne!(a["id"], b["id"]);
    let st = c.stats().unwrap();
    assert_eq!(st["tables"][0]["size"], 2000);
}

#[test]
fn clients_keep_working_during_a_checkpoint_and_no_value_is_torn() {
    let d = Daemon::start(&["--checkpoint-full-every", "0"]);
    let mut c = d.client();
    let dim = 16;
    c.create_table(spec("t", dim, 1 << 19, "lru", "single")).unwrap();
    for part in (0..200_000u64).collect::<Vec<_>>().chunks(1 << 16) {
        let rows: Vec<f32> = part.iter().flat_map(|&k| std::iter::repeat_n(k as f32, dim)).collect();
        c.insert_or_assign("t", part, &rows, None).unwrap();
    }
    let socket = d.socket.clone();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for w in 0..4u64 {
            let (socket, stop) = (socket.clone(), &stop);
            s.spawn(move || {
                let mut c = Client::connect(&socket).unwrap();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Every value is `dim` copies of one number: a torn copy would mix two.
                    let keys: Vec<u64> = (0..2000).map(|j| (i * 2000 + j * 7 + w) % 200_000).collect();
                    let v = (w * 1_000_000 + i) as f32;
                    c.insert_or_assign("t", &keys, &vec![v; keys.len() * dim], None).unwrap();
                    let f = c.find("t", &keys).unwrap();
                    assert!(f.found.iter().all(|&x| x));
                    i += 1;
                }
            });
        }
        for _ in 0..3 {
            c.checkpoint(true, false).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(c.stats().unwrap()["errors"], 0);
    let d = d.restart(&[]);
    let mut c = d.client();
    let (k, v, _) = c.export_all("t", Filter::default()).unwrap();
    assert_eq!(k.len(), 200_000);
    for row in v.chunks(dim) {
        assert!(row.iter().all(|x| x.to_bits() == row[0].to_bits()), "torn value {row:?}");
    }
}

#[test]
fn a_table_with_another_dim_or_policy_refuses_the_checkpoint() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    c.create_table(spec("emb", 4, 4096, "lfu", "single")).unwrap();
    fill(&mut c, "emb", 4, 1..100, true);
    c.checkpoint(true, false).unwrap();
    let mut d = d;
    d.signal("TERM");
    assert_eq!(d.wait(Duration::from_secs(30)), 0);
    let root = d.dir.path().to_path_buf();
    let cfg = root.join("other.toml");
    std::fs::write(&cfg, "[[table]]\nname = \"emb\"\ndim = 8\ncapacity = 4096\npolicy = \"lru\"\n").unwrap();
    let out = common::command(&root, &["--config", cfg.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("dim 8 here, 4 in the checkpoint") && err.contains("policy lru here, lfu in the checkpoint"),
        "{err}"
    );
    // --restore none starts anyway.
    let d = d.restart(&["--config", cfg.to_str().unwrap(), "--restore", "none"]);
    assert_eq!(d.client().tables().unwrap()[0].size, 0);
}

#[test]
fn incremental_checkpoints_carry_only_changes_and_restore_the_latest_state() {
    let d = Daemon::start(&["--checkpoint-full-every", "3"]);
    let mut c = d.client();
    c.create_table(spec("lru", 2, 1 << 15, "lru", "single")).unwrap();
    c.create_table(spec("cus", 2, 1 << 15, "custom", "single")).unwrap();
    fill(&mut c, "lru", 2, 0..10_000, false);
    fill(&mut c, "cus", 2, 0..1000, true);
    let full = c.checkpoint(true, false).unwrap();
    assert_eq!(full["kind"], "full");
    std::thread::sleep(Duration::from_millis(5));
    // Change 100 values and add 50 keys.
    c.insert_or_assign("lru", &(0..100).collect::<Vec<_>>(), &[9.0; 200], None).unwrap();
    c.insert_or_assign("lru", &(20_000..20_050).collect::<Vec<_>>(), &[7.0; 100], None).unwrap();
    let inc = c.checkpoint(true, false).unwrap();
    assert!(inc["kind"].as_str().unwrap().starts_with("incremental on"), "{inc}");
    let lru_entries = inc["tables"].as_array().unwrap().iter().find(|t| t[0] == "lru").unwrap()[1].as_u64().unwrap();
    assert_eq!(lru_entries, 150, "only what changed");
    let want = snapshot(&mut c, "lru");
    let want_cus = snapshot(&mut c, "cus");
    let d = d.restart(&[]);
    let mut c = d.client();
    assert_eq!(snapshot(&mut c, "lru"), want);
    assert_eq!(snapshot(&mut c, "cus"), want_cus);
}

#[test]
fn retention_schedule_and_final_checkpoint() {
    let d = Daemon::start(&["--checkpoint-keep", "2", "--checkpoint-full-every", "0", "--checkpoint-interval", "1"]);
    let mut c = d.client();
    c.create_table(spec("t", 2, 4096, "lru", "single")).unwrap();
    fill(&mut c, "t", 2, 0..100, false);
    let t0 = Instant::now();
    while c.checkpoints().unwrap().as_array().unwrap().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the 1 s schedule never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        c.checkpoint(true, true).unwrap();
    }
    assert_eq!(c.checkpoints().unwrap().as_array().unwrap().len(), 2, "keep = 2");
    let st = c.stats().unwrap();
    assert!(st["checkpoint"]["next_in_s"].as_f64().unwrap() <= 1.0);
    // The final checkpoint on SIGTERM holds writes made after the last one.
    let d = d.restart(&["--checkpoint-on-shutdown"]);
    let mut c = d.client();
    c.insert_or_assign("t", &[5000], &[1.0, 2.0], None).unwrap();
    let d = d.restart(&[]);
    assert_eq!(d.client().find("t", &[5000]).unwrap().values, [1.0, 2.0]);
}
