//! The C structs the kernels take by value, as #[repr(C)] Rust twins, and
//! the assert that ties each to the ABI list `kernels/abi.h`: a size or a
//! field offset that differs from the list fails `cargo build` (the CUDA
//! side asserts the same list with `static_assert`s when NVRTC compiles
//! the kernels).
//!
//! This file uses nothing but `hkv_kernels::assert_abi_layout!`: the tests
//! below compile it on its own, against an altered list, to show that a
//! mismatch is refused.

/// `HkvTable` of `kernels/abi.h`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct TableArgs {
    pub(super) digests: u64,
    pub(super) keys: u64,
    pub(super) scores: u64,
    pub(super) sizes: u64,
    pub(super) locks: u64,
    pub(super) fast: u64,
    pub(super) slices: u64,
    pub(super) fast_slots: u64,
    pub(super) nbuckets: u64,
    pub(super) slice_shift: u32,
    pub(super) dim: u32,
    pub(super) dual: u32,
    pub(super) pad: u32,
    /// Per launch: the key order of [`CudaTable::key_order`] (0: index order).
    ///
    /// [`CudaTable::key_order`]: super::CudaTable::key_order
    pub(super) order: u64,
}

/// `HkvScoring` of `kernels/abi.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ScoringArgs {
    pub(super) now_ns: u64,
    /// `hkv_kernels::abi::HKV_LRU` ... (`policy_code`).
    pub(super) policy: u32,
    pub(super) epoch: u32,
    pub(super) verbatim: u32,
    /// Lfu: 1 for `LfuTies::Lru` (packed frequency and stamp), 0 for plain frequencies.
    pub(super) lfu_lru: u32,
    /// Lookups: 1 when find hits refresh their scores (`reads_refresh`).
    pub(super) refresh: u32,
    /// Adaptive: every bucket's window share for this batch (slots,
    /// `crate::cpu::adapt::Window`); 0 for other policies.
    pub(super) window: u32,
    /// Adaptive: the sketch and its 64-byte lines (`super::adapt`); 0 for
    /// other policies.
    pub(super) sketch: u64,
    pub(super) sketch_lines: u64,
    /// Adaptive writer batches: a count, then (key, hits) pairs of the
    /// entries they evicted with find hits counted in their scores, folded
    /// into the sketch after the batch (`super::adapt`); 0 otherwise.
    pub(super) folds: u64,
}

/// `HkvFilter` of `kernels/abi.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct FilterArgs {
    pub(super) key_mask: u64,
    pub(super) key_pattern: u64,
    pub(super) min_score: u64,
    pub(super) max_score: u64,
}

/// `HkvSample` of `kernels/abi.h`: the miss-ratio sampler a lookup kernel
/// runs fused (`super::sampling`); `ring` 0 (the default): off.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SampleArgs {
    /// The ring's `cap` key slots and its 2 counters (slots claimed, accesses).
    pub(super) ring: u64,
    pub(super) counters: u64,
    pub(super) cap: u64,
    pub(super) seed: u64,
    pub(super) threshold: u64,
    /// The ring's `cap` tag bytes, one beside each key slot (issue 32).
    pub(super) tags: u64,
    /// This batch's tag (`mrc::tag`: the op's `mrc::Kind`, the batch's
    /// sequence number); only kinds 0 and 1 (lookups) count accesses.
    pub(super) tag: u64,
}

/// One optimizer step (HkvStep): [`crate::optim::Step`] as `step_keys` takes it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct StepArgs {
    pub(super) optimizer: u32,
    pub(super) dim: u32,
    pub(super) lr: f32,
    pub(super) eps: f32,
    pub(super) beta1: f32,
    pub(super) beta2: f32,
    pub(super) weight_decay: f32,
    pub(super) step_size: f32,
    pub(super) bias2_sqrt: f32,
    pub(super) pad: u32,
}

hkv_kernels::assert_abi_layout!(
    HkvTable => TableArgs,
    HkvScoring => ScoringArgs,
    HkvFilter => FilterArgs,
    HkvSample => SampleArgs,
    HkvStep => StepArgs,
);

/// The Rust side of the ABI check, shown: this file is compiled on its own
/// by `rustc`, against the Rust that `hkv-kernels`' build.rs makes of the
/// list (`hkv_kernels::list`), as it is and altered, and the build must
/// fail exactly when the two disagree. (The CUDA side's tests are in
/// `kernels/tests/abi.rs`.)
#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use hkv_kernels::list::{parse, rust};
    use hkv_kernels::ABI;

    const SELF: &str = include_str!("layout.rs");

    /// A directory of its own for each compile.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hkv-abi-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("a scratch directory");
        d
    }

    fn rustc(dir: &Path, args: &[&str]) -> std::process::Output {
        Command::new("rustc").current_dir(dir).args(["--edition", "2021"]).args(args).output().expect("rustc runs")
    }

    /// Builds the crate `hkv_kernels`'s ABI module from `header`, then this
    /// file (`layout`) against it; the second build's stderr if it fails.
    fn build(name: &str, header: &str, layout: &str) -> Result<(), String> {
        let dir = scratch(name);
        let list = parse(header).expect("the altered list still reads");
        std::fs::write(dir.join("kernels.rs"), format!("pub mod abi {{\n{}\n}}\n", rust(&list))).expect("write");
        let k = rustc(&dir, &["--crate-type", "rlib", "--crate-name", "hkv_kernels", "kernels.rs"]);
        assert!(k.status.success(), "{}", String::from_utf8_lossy(&k.stderr));
        // The file is a module of a crate of its own, as of `table` here.
        std::fs::write(dir.join("layout.rs"), format!("#![allow(dead_code)]\nmod layout {{\n{layout}\n}}\n"))
            .expect("write");
        let out = rustc(
            &dir,
            &["--crate-type", "lib", "--emit", "metadata", "--extern", "hkv_kernels=libhkv_kernels.rlib", "layout.rs"],
        );
        let _ = std::fs::remove_dir_all(&dir);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn alter(text: &str, from: &str, to: &str) -> String {
        assert_eq!(text.matches(from).count(), 1, "`{from}` appears once");
        text.replace(from, to)
    }

    #[test]
    fn rust_structs_match_the_list() {
        build("same", ABI, SELF).expect("layout.rs builds against the list as it is");
    }

    // A list entry changed and the Rust struct not: the const asserts of
    // assert_abi_layout! fail the build (E0080, a const that cannot be
    // evaluated), naming the entry.
    #[test]
    fn rust_side_refuses_an_altered_list() {
        for (from, to, names) in [
            ("AT(HkvScoring, epoch, 12)", "AT(HkvScoring, epoch, 16)", "HkvScoring.epoch is not at the offset 16"),
            ("SIZE(HkvSample, 56)", "SIZE(HkvSample, 64)", "the size of HkvSample is not the 64"),
        ] {
            let err = build("list", &alter(ABI, from, to), SELF).expect_err(&format!("built with `{to}`"));
            assert!(err.contains("error[E0080]"), "{to}: {err}");
            assert!(err.contains(names), "{to}: {err}");
        }
    }

    // The Rust struct changed and the list not: a field added, two fields
    // swapped.
    #[test]
    fn rust_side_refuses_an_altered_struct() {
        let added =
            alter(SELF, "    pub(super) epoch: u32,\n", "    pub(super) epoch: u32,\n    pub(super) added: u32,\n");
        let err = build("added", ABI, &added).expect_err("ScoringArgs with a field added builds");
        assert!(err.contains("error[E0080]"), "{err}");
        let swapped = alter(
            SELF,
            "    pub(super) min_score: u64,\n    pub(super) max_score: u64,\n",
            "    pub(super) max_score: u64,\n    pub(super) min_score: u64,\n",
        );
        let err = build("swapped", ABI, &swapped).expect_err("FilterArgs with two fields swapped builds");
        assert!(err.contains("HkvFilter.min_score is not at the offset 16"), "{err}");
    }

    // Every field of every struct here is in the list under the same name,
    // in order (the asserts check the list's fields; this, that there are
    // no others).
    #[test]
    fn every_rust_field_is_in_the_list() {
        let list = parse(ABI).expect("abi.h reads");
        let call = SELF.split("assert_abi_layout!(").nth(1).expect("the assert_abi_layout! call");
        let pairs: Vec<(&str, &str)> = call
            .split(");")
            .next()
            .expect("its arguments")
            .split(',')
            .filter_map(|p| p.split_once("=>"))
            .map(|(c, r)| (c.trim(), r.trim()))
            .collect();
        assert_eq!(pairs.len(), list.structs.len(), "every listed struct has its Rust twin");
        for (c, r) in pairs {
            let body = SELF
                .split(&format!(" struct {r} {{\n"))
                .nth(1)
                .and_then(|b| b.split("\n}").next())
                .unwrap_or_else(|| panic!("struct {r}"));
            let fields: Vec<&str> = body
                .lines()
                .map(str::trim)
                .filter(|l| !l.starts_with("//"))
                .filter_map(|l| l.strip_prefix("pub(super) ").and_then(|l| l.split_once(':')).map(|(f, _)| f))
                .collect();
            let listed = list.structs.iter().find(|s| s.name == c).unwrap_or_else(|| panic!("{c} is not listed"));
            let names: Vec<&str> = listed.fields.iter().map(|(f, _)| f.as_str()).collect();
            assert_eq!(fields, names, "the fields of {r} and the list's of {c}");
        }
    }
}
