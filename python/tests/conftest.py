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


class RedisCluster:
    """A 3-master Redis Cluster of real redis-server processes on loopback
    ports, each in its own folder of ``tmp`` (as backing/src/testkit.rs
    starts them for the Rust tests)."""

    def __init__(self, tmp):
        import socket

        self.procs = []
        self.ports = []
        while len(self.ports) < 3:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port < 55000 and port not in self.ports:
                self.ports.append(port)
        for port in self.ports:
            d = tmp / f"redis-{port}"
            d.mkdir()
            self.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--dir", str(d), "--logfile", str(d / "log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        for port in self.ports:
            self._wait(lambda: b"PONG" in self._cli(port, "ping"), f"redis-server on {port}")
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-yes"], check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        for port in self.ports:
            self._wait(lambda: b"cluster_state:ok" in self._cli(port, "cluster", "info"), "cluster_state:ok")

    @staticmethod
    def _cli(port, *args) -> bytes:
        r = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, stdin=subprocess.DEVNULL)
        return r.stdout

    @staticmethod
    def _wait(ok, what):
        deadline = time.time() + 30
        while not ok():
            if time.time() > deadline:
                pytest.fail(f"waited 30 s for {what}")
            time.sleep(0.05)

    def seeds(self) -> str:
        return ",".join(f"redis://127.0.0.1:{p}" for p in self.ports)

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def redis_cluster(tmp_path):
    c = RedisCluster(tmp_path)
    yield c
    c.stop()
