//! Fuzzes what the daemon does with admin and sizing requests before any
//! memory is allocated: every create_table body goes through the name and
//! hash checks, the per-shard config and the memory budget exactly as
//! `Router::create_table` runs them, and every reserve through the growth
//! limit. A request's numbers may be refused, never panic (capacity 2^62
//! once panicked a shard worker with "capacity overflow", 2^40 at dim 4
//! aborted the daemon on an 8.8 TB allocation).

#![no_main]

use hkv_proto::{check_frame, Control, FrameCheck, Request, HEADER_LEN};
use hkv_shard::Backend;
use hkvd::budget::Budget;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(FrameCheck::Ready(h)) = check_frame(data, 1 << 20) else { return };
    let body = &data[HEADER_LEN..HEADER_LEN + h.body_len as usize];
    let Ok(req) = Request::decode(&h, body) else { return };
    let budget = Budget::new(Backend::Cpu, vec![0, 1, 2], 1 << 30, 0);
    match req {
        Request::Control(Control::CreateTable(spec)) => {
            if hkvd::router::check_name(&spec.name).is_err() {
                return;
            }
            if let Some(hash) = &spec.hash {
                if hkvd::features::check(hash).is_err() {
                    return;
                }
            }
            let Ok(config) = hkvd::router::shard_config(&spec, 3) else { return };
            if let Ok(charge) = budget.charge(&spec.name, "fuzz", &config) {
                // What was granted fits the budget, and the table's largest
                // storage is countable.
                assert!(budget.stats().table_bytes <= 1 << 30);
                assert!(config.peak_footprint(Backend::Cpu).is_some());
                drop(charge);
            }
            assert_eq!(budget.stats().table_bytes, 0, "a refused or dropped table holds nothing");
        }
        Request::Reserve { capacity, .. } => {
            let config = hkv_shard::TableConfig { max_capacity: capacity, ..hkv_shard::TableConfig::new(128, 4) };
            let _ = config.validate();
            let _ = config.max_buckets();
            let _ = config.peak_footprint(Backend::Cpu);
            let _ = config.peak_footprint(Backend::Cuda);
        }
        _ => {}
    }
});
