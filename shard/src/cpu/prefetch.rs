//! One of the CPU backend's two `unsafe` calls (the other commits a
//! table's pages, `storage::commit`): the prefetch hint (also used by
//! the miss-ratio estimator, `crate::mrc`, whose drains run on cold memory). Plain loads in
//! its place (results fed to `black_box`) must complete before they retire
//! and so keep far fewer misses in flight; through hkvd on two cores finds
//! ran 25–60 % faster with the instruction (`daemon/BENCHMARKS.md`).

use super::LINE_FLOATS;

/// Starts fetching every 64-byte line of a row of 4-byte values (rows may
/// start mid-line: the last element's line too).
#[inline(always)]
pub(super) fn prefetch_row<T>(row: &[T]) {
    for x in row.iter().step_by(LINE_FLOATS).chain(row.last()) {
        prefetch(x);
    }
}

/// Starts fetching the cache line that holds `x` into every cache level.
/// One of the two items of the CPU backend allowed `unsafe` (the backend
/// denies it).
#[allow(unsafe_code)]
#[inline(always)]
pub(crate) fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it reads nothing architecturally and
    // never faults (and `x` is a live reference). The intrinsic is unsafe
    // only as a target-feature function; SSE is in x86-64's baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(x as *const T as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
