"""Starts a real hkvd (CPU backend) on a temporary socket for the tests."""

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hkvd  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def hkvd_binary() -> str:
    explicit = os.environ.get("HKVD_BIN")
    if explicit:
        return explicit
    for profile in ("release", "debug"):
        path = os.path.join(ROOT, "target", profile, "hkvd")
        if os.path.exists(path):
            return path
    pytest.fail("no hkvd binary: build it (cargo build --release -p hkvd) or set HKVD_BIN")


class Daemon:
    def __init__(self, tmp, *extra):
        self.socket = str(tmp / "hkvd.sock")
        self.proc = subprocess.Popen(
            [hkvd_binary(), "serve", "--backend", "cpu", "--shards", "2", "--log", "warn",
             "--socket", self.socket, "--state-dir", str(tmp / "state"), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"hkvd exited with {self.proc.returncode}")
            try:
                with hkvd.Client(self.socket) as c:
                    c.ping()
                return
            except (ConnectionError, OSError):
                time.sleep(0.05)
        pytest.fail("hkvd did not start")

    def client(self) -> "hkvd.Client":
        return hkvd.Client(self.socket)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()
