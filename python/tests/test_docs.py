"""The ```python blocks of README.md and docs/*.md against a live daemon.

The shell blocks run in daemon/tests/docs.rs; this is its Python half, with
the same rules (docs/developing.md, "These docs"): each page's blocks run in
order, in one namespace, in a temporary directory, against a fresh daemon
whose socket is $HKVD_SOCKET; a ```text output block after one is the exact
stdout it must print; ```python no-run blocks are skipped.
"""

import contextlib
import io
import pathlib

import pytest

from conftest import ROOT, Daemon

PAGES = [pathlib.Path(ROOT) / "README.md"] + sorted((pathlib.Path(ROOT) / "docs").glob("*.md"))


def blocks(text):
    """(info, body, line) of every fenced block."""
    out, info, body, start = [], None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if info is None and line.startswith("```"):
            info, body, start = line[3:].strip(), [], n
        elif info is not None and line == "```":
            out.append((info, "\n".join(body) + "\n", start))
            info = None
        elif info is not None:
            body.append(line)
    return out


def trimmed(s):
    return "\n".join(line.rstrip() for line in s.splitlines()).rstrip()


def runnable(page):
    b = blocks(page.read_text())
    out = []
    for i, (info, body, line) in enumerate(b):
        if info == "python":
            expect = b[i + 1][1] if i + 1 < len(b) and b[i + 1][0] == "text output" else None
            out.append((body, line, expect))
    return out


def test_pages_have_python_blocks():
    assert sum(len(runnable(p)) for p in PAGES) >= 3


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    d = Daemon(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HKVD_SOCKET", d.socket)
    namespace = {"__name__": "__docs__"}
    try:
        for body, line, expect in runnable(page):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    exec(compile(body, f"{page.name}:{line}", "exec"), namespace)
                except Exception as e:
                    pytest.fail(f"{page.name}:{line}: {type(e).__name__}: {e}\n{body}")
            if expect is not None:
                assert trimmed(out.getvalue()) == trimmed(expect), f"{page.name}:{line}: output differs"
    finally:
        for v in namespace.values():
            if hasattr(v, "close") and type(v).__module__.startswith("hkvd"):
                with contextlib.suppress(Exception):
                    v.close()
        d.stop()
