//! The user documentation against a live daemon: every fenced ```` ```sh ````
//! block of README.md and docs/*.md runs, in order, with bash (`set -e -o
//! pipefail`) against a fresh `hkvd serve` per page, with `hkvctl`, `hkvd`
//! and the other binaries of the workspace first on `PATH` and
//! `HKVD_SOCKET` naming the test daemon; it must exit 0, and where a
//! ```` ```text output ```` block follows it, print exactly that. A block
//! that cannot run here says so with `no-run` (`sh no-run`: it builds with
//! cargo, needs a GPU or systemd, or serves forever). The README was once 668
//! lines whose commands nobody ran; this keeps what it and docs/ show true.
//!
//! The Python blocks run in `python/tests/test_docs.py` with the same rules.
//! Fence info strings are a closed list, so a block cannot escape the test
//! by a misspelt language; relative links between the pages must resolve,
//! anchors included.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::Daemon;

/// One fenced block of a page.
struct Block {
    /// The info string after the opening fence.
    info: String,
    body: String,
    /// 1-based line of the opening fence.
    line: usize,
}

/// Info strings a page may use. `sh` and `python` run; `no-run` after
/// either skips it; `text output` is the exact stdout of the block before it.
const KNOWN: &[&str] =
    &["sh", "sh no-run", "python", "python no-run", "text output", "text", "toml", "rust", "ini", "json"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// README.md and every docs/*.md, sorted.
fn pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    pages.insert(0, root().join("README.md"));
    pages
}

fn blocks(text: &str) -> Vec<Block> {
    let mut out = vec![];
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => open = Some(Block { info: info.trim().into(), body: String::new(), line: i + 1 }),
            (Some(_), Some("")) => out.push(open.take().expect("open block")),
            (Some(b), _) => {
                b.body.push_str(line);
                b.body.push('\n');
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "a fence is never closed");
    out
}

/// Blocks that run, each with the output it must print when the page shows
/// one.
fn runnable<'a>(blocks: &'a [Block], lang: &str) -> Vec<(&'a Block, Option<&'a str>)> {
    let mut out = vec![];
    for (i, b) in blocks.iter().enumerate() {
        if b.info == lang {
            let expect = blocks.get(i + 1).filter(|n| n.info == "text output").map(|n| n.body.as_str());
            out.push((b, expect));
        }
    }
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// Trailing white space is not part of what a page shows.
fn trimmed(s: &str) -> String {
    s.lines().map(str::trim_end).collect::<Vec<_>>().join("\n").trim_end().to_string()
}

#[test]
fn every_block_has_a_known_info_string_and_outputs_follow_a_block_that_runs() {
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        let b = blocks(&text);
        for (i, block) in b.iter().enumerate() {
            let at = format!("{}:{}", rel(&page), block.line);
            assert!(
                KNOWN.contains(&block.info.as_str()),
                "{at}: fence info {:?} is none of {KNOWN:?} (a shell block is `sh`, or `sh no-run` when it cannot run in a test)",
                block.info
            );
            if block.info == "text output" {
                let prev = i.checked_sub(1).map(|p| b[p].info.as_str());
                assert!(
                    matches!(prev, Some("sh" | "python")),
                    "{at}: a `text output` block must follow a block that runs, not {prev:?}"
                );
            }
        }
    }
}

#[test]
fn the_readme_is_a_front_page() {
    let text = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let lines = text.lines().count();
    assert!(lines <= 150, "README.md has {lines} lines; keep it to 150 and put the rest in docs/");
    let first = &blocks(&text)[0];
    assert!(
        first.body.contains("cargo run --release -p hkvd -- serve") && first.body.contains("./test.sh"),
        "the README's first block is the two commands: start the daemon, run the tests"
    );
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_`
/// dropped, spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = vec![];
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Every Markdown file of the repository (the other pages link into docs/).
fn markdown(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read dir") {
        let p = e.expect("dir entry").path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() && !name.starts_with('.') && name != "target" {
            markdown(&p, out);
        } else if name.ends_with(".md") {
            out.push(p);
        }
    }
}

#[test]
fn links_between_pages_resolve() {
    let mut all = vec![];
    markdown(&root(), &mut all);
    for page in all {
        let text = std::fs::read_to_string(&page).expect("read page");
        let dir = page.parent().expect("page dir");
        for (i, line) in text.lines().enumerate() {
            for part in line.split("](").skip(1) {
                let Some(target) = part.split(')').next() else { continue };
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
                let path = if file.is_empty() { page.clone() } else { dir.join(file) };
                let at = format!("{}:{}", rel(&page), i + 1);
                assert!(path.exists(), "{at}: link to {target}: {} does not exist", path.display());
                if !anchor.is_empty() && path.extension().is_some_and(|e| e == "md") {
                    let there = std::fs::read_to_string(&path).expect("read link target");
                    assert!(
                        anchors(&there).iter().any(|a| a == anchor),
                        "{at}: no heading #{anchor} in {}",
                        rel(&path)
                    );
                }
            }
        }
    }
}

/// Where the binaries are: beside `$HKVD_BIN` when set, else beside the
/// `hkvd` cargo built for this test. `hkvctl`, `hkv-sim` and `hkv-bench` are other
/// packages' binaries, built by `cargo test --workspace` (as ./test.sh runs
/// it) or `cargo build --release -p hkv-client -p hkv-shard --bins`.
fn bin_dir() -> PathBuf {
    let hkvd = std::env::var_os("HKVD_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_hkvd")), PathBuf::from);
    let dir = hkvd.parent().expect("bin dir").to_path_buf();
    for b in ["hkvd", "hkvctl", "hkv-sim", "hkv-bench"] {
        assert!(
            dir.join(b).exists(),
            "{} is missing: build it (cargo build --release -p hkv-client -p hkv-shard --bins, or cargo test --workspace)",
            dir.join(b).display()
        );
    }
    dir
}

#[test]
fn shell_blocks_run_against_a_live_daemon() {
    let bins = bin_dir();
    let path = format!("{}:{}", bins.display(), std::env::var("PATH").unwrap_or_default());
    let (mut ran, mut skipped) = (0, 0);
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        let b = blocks(&text);
        skipped += b.iter().filter(|b| b.info == "sh no-run").count();
        let run = runnable(&b, "sh");
        if run.is_empty() {
            continue;
        }
        // One daemon and one working directory per page: its blocks build
        // on each other, as a reader's commands do.
        let d = Daemon::start(&["--shards", "2"]);
        let work = tempfile::tempdir().expect("tempdir");
        for (block, expect) in run {
            let at = format!("{}:{}", rel(&page), block.line);
            let out = Command::new("timeout")
                .args(["120", "bash", "-e", "-o", "pipefail", "-c", &block.body])
                .current_dir(work.path())
                .env("PATH", &path)
                .env("HKVD_SOCKET", &d.socket)
                .env_remove("XDG_RUNTIME_DIR")
                .stdin(Stdio::null())
                .output()
                .expect("run bash");
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(
                out.status.success(),
                "{at}: block exited with {}\n--- block\n{}--- stdout\n{stdout}--- stderr\n{stderr}",
                out.status,
                block.body
            );
            if let Some(expect) = expect {
                assert_eq!(trimmed(&stdout), trimmed(expect), "{at}: the output differs from the page's");
            }
            ran += 1;
        }
    }
    eprintln!("docs: {ran} shell blocks ran, {skipped} marked no-run");
    assert!(ran >= 10, "only {ran} shell blocks ran");
}
