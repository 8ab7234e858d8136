//! The reader of the ABI list (`kernels/abi.h`) and the Rust it becomes.
//!
//! `build.rs` runs [`parse`] and [`rust`] on `abi.h` and writes the result
//! to `$OUT_DIR/abi.rs`, which [`crate::abi`] includes; the tests run them
//! on altered copies of the list, to show that a mismatch is refused.
//! Only `std`: the build script compiles this file too.

use std::fmt;

/// The list: every code, and every struct's layout, in the file's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct List {
    /// `#define HKV_* <literal>` lines.
    pub codes: Vec<Code>,
    /// The `SIZE` / `AT` lines of `HKV_ABI_LAYOUT`, grouped by struct.
    pub structs: Vec<Layout>,
}

/// One code or constant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Code {
    /// Its name, the same in C and in Rust (`HKV_LRU`).
    pub name: String,
    /// Its value.
    pub value: u64,
    /// Whether it is a u64 (written with the suffix `ULL`); a u32 otherwise.
    pub wide: bool,
    /// The comment above its group of `#define`s, for the Rust docs.
    pub doc: String,
}

/// One struct a kernel takes by value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The C struct's name (`HkvTable`).
    pub name: String,
    /// `sizeof`, in bytes.
    pub size: u64,
    /// Each field's name and byte offset, in field order.
    pub fields: Vec<(String, u64)>,
}

/// A line of the list that does not follow its format (see `abi.h`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListError {
    /// The line's number, from 1.
    pub line: usize,
    /// What is wrong with it.
    pub what: String,
}

impl fmt::Display for ListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kernels/abi.h:{}: {} (the format is described at the top of the file)", self.line, self.what)
    }
}

impl std::error::Error for ListError {}

/// The macro whose continuation lines hold the layouts.
const LAYOUT_MACRO: &str = "HKV_ABI_LAYOUT";

/// Reads the list out of the text of `abi.h`.
pub fn parse(header: &str) -> Result<List, ListError> {
    let mut list = List { codes: vec![], structs: vec![] };
    // The comment block above the current group of #defines.
    let mut doc: Vec<&str> = vec![];
    let mut in_group = false;
    let mut lines = header.lines().enumerate().map(|(i, l)| (i + 1, l));
    while let Some((n, line)) = lines.next() {
        let err = |what: String| ListError { line: n, what };
        let t = line.trim();
        if let Some(c) = t.strip_prefix("//") {
            if std::mem::take(&mut in_group) {
                doc.clear();
            }
            doc.push(c.trim());
            continue;
        }
        let Some(def) = t.strip_prefix("#define ") else {
            (doc, in_group) = (vec![], false);
            continue;
        };
        in_group = true;
        let def = def.trim_start();
        let name_len = def.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(def.len());
        let (name, rest) = def.split_at(name_len);
        if rest.starts_with('(') {
            // A function-like macro: skip its continuation lines, reading
            // them when it is the layout list.
            let mut more = t.ends_with('\\');
            while more {
                let Some((n, l)) = lines.next() else { break };
                let l = l.trim();
                more = l.ends_with('\\');
                if name == LAYOUT_MACRO {
                    entry(&mut list, l.trim_end_matches('\\').trim()).map_err(|what| ListError { line: n, what })?;
                }
            }
            continue;
        }
        if !name.starts_with("HKV_") {
            return Err(err(format!("`{name}` is not named HKV_*")));
        }
        let (value, wide) = literal(rest.trim()).map_err(|w| err(format!("{name}: {w}")))?;
        if list.codes.iter().any(|c| c.name == name) {
            return Err(err(format!("{name} is defined twice")));
        }
        list.codes.push(Code { name: name.to_string(), value, wide, doc: doc.join(" ") });
    }
    if list.structs.is_empty() {
        return Err(ListError { line: 0, what: format!("no `#define {LAYOUT_MACRO}(SIZE, AT)` with entries") });
    }
    Ok(list)
}

/// A code's value: a decimal or 0x hex literal, with `ULL` for a u64.
fn literal(s: &str) -> Result<(u64, bool), String> {
    let (digits, wide) = match s.strip_suffix("ULL") {
        Some(d) => (d, true),
        None => (s, false),
    };
    let value = match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => digits.parse::<u64>(),
    }
    .map_err(|_| format!("`{s}` is not a decimal or hex literal (a derived value belongs outside the list)"))?;
    if !wide && value > i32::MAX as u64 {
        return Err(format!("{value} does not fit a C int: write it with ULL"));
    }
    Ok((value, wide))
}

/// One line of `HKV_ABI_LAYOUT`: `SIZE(Struct, n)` or `AT(Struct, field, n)`.
fn entry(list: &mut List, l: &str) -> Result<(), String> {
    let bad = || format!("`{l}` is neither `SIZE(Struct, bytes)` nor `AT(Struct, field, offset)`");
    let (kind, args) = l.split_once('(').ok_or_else(bad)?;
    let args: Vec<&str> = args.strip_suffix(')').ok_or_else(bad)?.split(',').map(str::trim).collect();
    let number = |s: &str| s.parse::<u64>().map_err(|_| bad());
    match (kind.trim(), args.as_slice()) {
        ("SIZE", [name, size]) => {
            if list.structs.iter().any(|s| s.name == *name) {
                return Err(format!("SIZE({name}) appears twice"));
            }
            list.structs.push(Layout { name: name.to_string(), size: number(size)?, fields: vec![] });
        }
        ("AT", [name, field, offset]) => {
            let s = list.structs.last_mut().filter(|s| s.name == *name);
            let s =
                s.ok_or_else(|| format!("AT({name}, {field}, ..) does not follow SIZE({name}, ..) and its fields"))?;
            s.fields.push((field.to_string(), number(offset)?));
        }
        _ => return Err(bad()),
    }
    Ok(())
}

/// The Rust source of [`crate::abi`]: a const per code, and the macro
/// `assert_abi_layout!` that asserts a Rust twin of each struct.
pub fn rust(list: &List) -> String {
    let mut o = String::from("// Generated by hkv-kernels' build.rs from kernels/abi.h: edit that file.\n\n");
    for c in &list.codes {
        let (ty, value) = if c.wide { ("u64", format!("{:#x}", c.value)) } else { ("u32", c.value.to_string()) };
        let doc = if c.doc.is_empty() { String::new() } else { format!("{} ", c.doc) };
        o += &format!("/// {doc}(kernels/abi.h)\npub const {}: {ty} = {value};\n", c.name);
    }
    let pattern: Vec<String> =
        list.structs.iter().enumerate().map(|(i, s)| format!("{} => $t{i}:ty", s.name)).collect();
    let names: Vec<&str> = list.structs.iter().map(|s| s.name.as_str()).collect();
    o += &format!(
        "\n/// Asserts at compile time that each Rust struct named has the size and\n\
         /// field offsets that kernels/abi.h lists for the C struct it stands\n\
         /// for. Every struct of the list is named, in the list's order:\n\
         /// `assert_abi_layout!({});`\n\
         #[macro_export]\nmacro_rules! assert_abi_layout {{\n    ({} $(,)?) => {{\n        const _: () = {{\n",
        names.iter().map(|n| format!("{n} => RustType")).collect::<Vec<_>>().join(", "),
        pattern.join(", ")
    );
    for (i, s) in list.structs.iter().enumerate() {
        o += &format!(
            "            assert!(::core::mem::size_of::<$t{i}>() == {}, \"the size of {} is not the {} of kernels/abi.h\");\n",
            s.size, s.name, s.size
        );
        for (f, at) in &s.fields {
            o += &format!(
                "            assert!(::core::mem::offset_of!($t{i}, {f}) == {at}, \"{}.{f} is not at the offset {at} of kernels/abi.h\");\n",
                s.name
            );
        }
    }
    o += "        };\n    };\n}\n";
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_list() {
        let l = parse(crate::ABI).expect("abi.h reads");
        let lru = l.codes.iter().find(|c| c.name == "HKV_LRU").expect("HKV_LRU");
        assert_eq!((lru.value, lru.wide), (0, false));
        let seed = l.codes.iter().find(|c| c.name == "HKV_DUAL_SEED").expect("HKV_DUAL_SEED");
        assert_eq!((seed.value, seed.wide), (0x9e37_79b9_7f4a_7c15, true));
        let t = l.structs.iter().find(|s| s.name == "HkvTable").expect("HkvTable");
        assert_eq!(t.size, 96);
        assert_eq!(t.fields.last(), Some(&("order".to_string(), 88)));
    }

    // A list build.rs cannot read fails the build, naming the line that is
    // wrong, rather than leaving a code or a field out.
    #[test]
    fn refuses_what_it_cannot_read() {
        let layout = "#define HKV_ABI_LAYOUT(SIZE, AT) \\\n    SIZE(A, 8) \\\n    AT(A, x, 0)\n";
        assert!(parse(layout).is_ok());
        for (bad, line) in [
            ("#define HKV_X (1 << 3)\n", 1),
            ("#define HKV_X 3000000000\n", 1),
            ("#define OTHER 1\n", 1),
            ("#define HKV_X 1\n#define HKV_X 2\n", 2),
            ("#define HKV_ABI_LAYOUT(SIZE, AT) \\\n    AT(A, x, 0)\n", 2),
            ("#define HKV_ABI_LAYOUT(SIZE, AT) \\\n    SIZE(A, 8) \\\n    AT(A, x)\n", 3),
        ] {
            let text = if bad.contains("LAYOUT") { bad.to_string() } else { format!("{bad}{layout}") };
            assert_eq!(parse(&text).err().map(|e| e.line), Some(line), "{bad}");
        }
        assert_eq!(parse("#define HKV_X 1\n").err().map(|e| e.line), Some(0), "no layout");
    }
}
