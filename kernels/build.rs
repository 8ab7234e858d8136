//! Turns the ABI list, `abi.h`, into the Rust consts and the layout macro
//! of `hkv_kernels::abi` (see `src/list.rs`).

#[path = "src/list.rs"]
#[allow(dead_code)]
mod list;

fn main() {
    println!("cargo:rerun-if-changed=abi.h");
    println!("cargo:rerun-if-changed=src/list.rs");
    let header = std::fs::read_to_string("abi.h").expect("kernels/abi.h is readable");
    let parsed = list::parse(&header).unwrap_or_else(|e| panic!("{e}"));
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("abi.rs");
    std::fs::write(&out, list::rust(&parsed)).expect("writing $OUT_DIR/abi.rs");
}
