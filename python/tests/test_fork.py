"""A client used after fork(): the child is refused, the parent goes on.

The story: a ``Client`` shared across ``os.fork()`` left one socket to two
processes. Each sent its requests on it and read whatever answer came
next, so within a few requests both failed with ``ProtocolError('answer to
unknown request 4')``, ``bad frame header …``, or a ``WrongDim`` naming an
array of 16843009 elements (a row of 1.0 floats read as a count); a
request whose answer the other process took was a wrong answer or a hang.
Now a client refuses every request in a process other than the one that
connected it (``hkvd.WrongProcess``, before anything is sent or read), and
its ``close()`` there sends nothing, so the parent's connection, regions
included, is untouched.
"""

import json
import os
import signal
import time

import numpy as np
import pytest

import hkvd


def in_child(body, timeout=20.0):
    """Runs ``body()`` in a forked child and returns what it returned (JSON
    through a pipe). The child never returns into pytest: it ends with
    ``os._exit``; one still running after ``timeout`` is killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(body()).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
            os.write(w, json.dumps({"child failed": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the child did not finish in {timeout} s")
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        out = json.loads(f.read() or b"null")
    assert not (isinstance(out, dict) and "child failed" in out), out
    return out


def refusal(call):
    """The kind and code of ``call()``'s error, or "no error"."""
    try:
        call()
    except hkvd.HkvdError as e:
        return [type(e).__name__, e.code]
    except Exception as e:  # noqa: BLE001 - the kind is what the test compares
        return [type(e).__name__, None]
    return "no error"


REFUSED = ["WrongProcess", "wrong_process"]


def test_a_forked_child_is_refused_and_the_parent_keeps_its_connection(daemon):
    c = hkvd.Client(daemon.socket, timeout=10)
    c.create_table("t", 4, 1 << 12)
    ka = np.arange(1, 65, dtype=np.uint64)
    kb = ka + 1000
    c.insert_or_assign("t", ka, np.full((64, 4), 1, np.float32))
    c.insert_or_assign("t", kb, np.full((64, 4), 2, np.float32))
    # An answer in flight at the fork: only the parent may read it.
    rid = c.send_find("t", ka)

    def child():
        out = {
            "find": refusal(lambda: c.find("t", kb)),
            "ping": refusal(c.ping),
            "result": refusal(lambda: c.result(rid)),
            "send_find": refusal(lambda: c.send_find("t", kb)),
            "insert": refusal(lambda: c.insert_or_assign("t", kb, np.zeros((64, 4), np.float32))),
        }
        c.close()  # sends nothing: the connection is the parent's
        out["after close"] = refusal(c.ping)
        with hkvd.Client(c.path, timeout=10) as own:  # what the error says to do
            values, found = own.find("t", kb)
            out["own client"] = bool(found.all() and (values == 2).all())
        return out

    seen = in_child(child)
    assert {k: seen.pop(k) for k in ("find", "ping", "result", "send_find", "insert", "after close")} == {
        k: REFUSED for k in ("find", "ping", "result", "send_find", "insert", "after close")}
    assert seen == {"own client": True}

    values, found, _ = c.result(rid)
    assert found.all() and (values == 1).all()
    for _ in range(50):
        values, found = c.find("t", kb)
        assert found.all() and (values == 2).all()  # the child's insert of zeros never went out
    assert not c.closed and not c.lost
    c.close()


def test_a_forked_child_leaves_the_parent_s_regions_registered(daemon):
    with hkvd.Client(daemon.socket, timeout=10) as c:
        c.create_table("t", 4, 1 << 12)
        keys = hkvd.shm_array((16,), np.uint64)
        keys[:] = np.arange(1, 17, dtype=np.uint64)
        values = hkvd.shm_array((16, 4), np.float32)
        values[:] = 3
        c.insert_or_assign_shm("t", keys, values)
        out = hkvd.shm_array((16, 4), np.float32)
        assert c.find_shm("t", keys, out) == 16
        regions = c.stats()["regions"]["regions"]

        def child():
            seen = {"find_shm": refusal(lambda: c.find_shm("t", keys, out)),
                    "new array": refusal(lambda: c.find_shm("t", keys, hkvd.shm_array((16, 4), np.float32)))}
            c.close()  # an unregister of the parent's regions would go out here
            return seen

        assert in_child(child) == {"find_shm": REFUSED, "new array": REFUSED}
        out[:] = 0
        assert c.find_shm("t", keys, out) == 16
        assert (out == 3).all()
        assert c.stats()["regions"]["regions"] == regions


def test_a_forked_child_s_embedding_cache_is_refused(daemon):
    torch = pytest.importorskip("torch")
    import hkvd.torch as ht

    with hkvd.Client(daemon.socket, timeout=10) as c:
        c.create_table("emb", 4, 1 << 12)
        cache = ht.EmbeddingCache(c, "emb", transport="socket", verbose=False)
        ids = torch.arange(1, 9)
        first = cache.lookup(ids)

        def child():
            return {"lookup": refusal(lambda: cache.lookup(ids))}

        assert in_child(child) == {"lookup": REFUSED}
        assert torch.equal(cache.lookup(ids), first)
