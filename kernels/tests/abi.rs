//! The CUDA side of the ABI check, shown on the host: `abi.h` (the list,
//! the structs the kernels take by value and the `static_assert`s between
//! them) is plain C++, so these tests compile it with `cc -x c++` as it
//! is, and altered, and see the asserts refuse every alteration. NVRTC
//! compiles the same text, at the head of every module, when a device
//! opens; only its spelling of offsetof differs (`HKV_OFFSETOF`), which the
//! ignored test `nvrtc_refuses_a_struct_that_differs_from_the_list`
//! (`shard/src/cuda/device.rs`) covers on a CUDA host. The Rust side's
//! tests are in `shard/src/cuda/table/layout.rs`.

use std::io::Write;
use std::process::{Command, Stdio};

use hkv_kernels::list::{parse, List};
use hkv_kernels::ABI;

/// Compiles `header` as C++17 with the host compiler; its stderr on failure.
fn compile(header: &str) -> Result<(), String> {
    let mut cc = Command::new("cc")
        .args(["-x", "c++", "-std=c++17", "-fsyntax-only", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the host C compiler `cc` runs");
    cc.stdin.take().expect("piped").write_all(header.as_bytes()).expect("writing to cc");
    let out = cc.wait_with_output().expect("cc finishes");
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `header` with its one line `from` replaced by `to`.
fn alter(header: &str, from: &str, to: &str) -> String {
    assert_eq!(header.matches(from).count(), 1, "`{from}` is one line of abi.h");
    header.replace(from, to)
}

fn list() -> List {
    parse(ABI).expect("abi.h reads")
}

#[test]
fn c_structs_match_the_list() {
    // The device's pointers are 64-bit, as this host's must be for the
    // host compile to stand for NVRTC's.
    const { assert!(cfg!(target_pointer_width = "64")) };
    compile(ABI).expect("abi.h compiles, every assert holding");
}

// Each size and offset of the list, changed by 8, must stop the compile
// with the static_assert of that very entry: no entry goes unasserted.
#[test]
fn c_side_refuses_every_altered_list_entry() {
    let list = list();
    let mut checked = 0;
    for s in &list.structs {
        let entries = std::iter::once((format!("SIZE({}, {})", s.name, s.size), format!("sizeof({})", s.name), s.size))
            .chain(
                s.fields.iter().map(|(f, at)| (format!("AT({}, {f}, {at})", s.name), format!("{}.{f}", s.name), *at)),
            );
        for (line, names, value) in entries {
            let altered = alter(ABI, &line, &line.replace(&format!("{value})"), &format!("{})", value + 8)));
            let err = compile(&altered).expect_err(&format!("abi.h with `{line}` altered compiles"));
            assert!(err.contains("static assertion failed"), "{line}: {err}");
            assert!(err.contains(&format!("{names} is not")), "{line} is not the entry refused: {err}");
            checked += 1;
        }
    }
    assert_eq!(checked, list.structs.iter().map(|s| 1 + s.fields.len()).sum::<usize>());
    assert!(checked >= 30, "{checked} entries");
}

// A C struct changed without its list entries: a field added, two fields
// swapped.
#[test]
fn c_side_refuses_an_altered_struct() {
    let added = alter(ABI, "    u32 epoch;\n", "    u32 epoch;\n    u32 added;\n");
    let err = compile(&added).expect_err("HkvScoring with a field added compiles");
    assert!(err.contains("static assertion failed"), "{err}");
    let swapped = alter(ABI, "    u64 min_score;\n    u64 max_score;\n", "    u64 max_score;\n    u64 min_score;\n");
    let err = compile(&swapped).expect_err("HkvFilter with two fields swapped compiles");
    assert!(err.contains("HkvFilter.min_score is not"), "{err}");
}

// Every field of every struct in abi.h is in the list, in order, so that
// each one's offset is asserted (a field added into padding would keep
// the size).
#[test]
fn every_c_field_is_in_the_list() {
    let list = list();
    let mut found = 0;
    let mut lines = ABI.lines();
    while let Some(l) = lines.next() {
        let Some(name) = l.strip_prefix("struct ").and_then(|r| r.strip_suffix(" {")) else { continue };
        let mut fields = vec![];
        for f in lines.by_ref() {
            if f.starts_with("};") {
                break;
            }
            let decl = f.split("//").next().unwrap_or("").trim();
            let field = decl.strip_suffix(';').and_then(|d| d.rsplit([' ', '*']).next());
            fields.push(field.unwrap_or_else(|| panic!("`{f}` of {name} is not a field declaration")).to_string());
        }
        let listed = list.structs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{name} is not listed"));
        let names: Vec<&str> = listed.fields.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(fields, names, "the fields of {name} and their list entries");
        found += 1;
    }
    assert_eq!(found, list.structs.len(), "a listed struct has no definition in abi.h");
}

#[test]
fn every_module_compiles_the_list_first() {
    for id in hkv_kernels::KernelId::ALL {
        assert!(id.source().starts_with(ABI), "{}", id.name());
    }
}
