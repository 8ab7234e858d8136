//! The conformance suite on the CPU backend.

mod common;

use hkv_shard::cpu::CpuTable;
use hkv_shard::{Shard, TableConfig};

fn make(cfg: TableConfig) -> Box<dyn Shard> {
    Box::new(CpuTable::new(cfg).expect("valid config"))
}

conformance_suite!(make);

/// The CPU backend drains each batch's sampled keys in index order.
#[test]
fn sampling_keeps_index_order() {
    common::conformance::sampling_sees_every_batch(make, true)
}

#[test]
fn bad_config_is_refused() {
    for cfg in common::conformance::bad_config_is_refused() {
        let err = CpuTable::new(cfg.clone()).expect_err("must refuse");
        assert!(matches!(err, hkv_shard::Error::Config(_)), "{cfg:?}: {err}");
    }
}

#[test]
fn auto_backend_falls_back_to_cpu() {
    let t = hkv_shard::open(TableConfig::new(256, 2), hkv_shard::Backend::Auto).unwrap();
    assert_eq!(t.capacity(), 256);
}
