"""The Python client against a real daemon: every op, errors, large batches,
concurrent clients, pipelining, checkpoints, and the torch helper."""

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

import hkvd


def rows(keys, dim, salt=0.0):
    k = np.asarray(keys, dtype=np.float64)
    return (k[:, None] % 997 + np.arange(dim)[None, :] + salt).astype(np.float32)


def test_every_table_operation(daemon):
    c = daemon.client()
    # The reference's tie rule: scores are the plain counts checked below.
    info = c.create_table("emb", dim=4, capacity=1 << 14, policy="lfu", mode="dual", lfu_ties="lowest-slot")
    assert info["shards"] == 2
    keys = np.arange(1, 3001, dtype=np.uint64) * 7919
    v = rows(keys, 4)
    s = c.insert_or_assign("emb", keys, v)
    assert s.inserted == 3000
    got, found, scores = c.find("emb", keys, scores=True)
    assert found.all() and got.dtype == np.float32 and got.shape == (3000, 4)
    np.testing.assert_array_equal(got, v)
    assert (scores == 1).all()
    assert list(c.contains("emb", [keys[0], 5])) == [True, False]
    # int64 keys work too.
    got64, found64 = c.find("emb", keys.astype(np.int64))
    assert found64.all()
    # find_or_insert: stored rows for hits, given rows inserted for misses.
    out = c.find_or_insert("emb", [keys[0], 6], np.full((2, 4), 9.0, np.float32), scores=[2, 3])
    np.testing.assert_array_equal(out[0], v[0])
    np.testing.assert_array_equal(out[1], [9.0] * 4)
    s = c.assign("emb", [keys[1], 7], np.ones((2, 4), np.float32))
    assert (s.updated, s.absent) == (1, 1)
    s = c.assign_scores("emb", [keys[1]], [100])
    assert s.updated == 1
    s = c.accum_or_assign("emb", [keys[1], 8], np.full((2, 4), 0.5, np.float32))
    assert (s.updated, s.inserted) == (1, 1)
    got, _ = c.find("emb", [keys[1], 8])
    np.testing.assert_array_equal(got, [[1.5] * 4, [0.5] * 4])
    s, outcomes = c.insert_or_assign("emb", [keys[2], 10**12], np.zeros((2, 4), np.float32), outcomes=True)
    assert list(outcomes) == [0, 1]
    assert c.erase("emb", [keys[2], 123456789]) == 1
    ek, ev, es = c.export("emb")
    assert len(ek) == c.tables()[0]["size"] and ev.shape == (len(ek), 4) and len(es) == len(ek)
    n = c.erase_if("emb", min_score=2)
    assert n == int((es >= 2).sum())
    c.load("emb", [1, 2], np.zeros((2, 4), np.float32), [77, 88])
    assert list(c.find("emb", [1, 2], scores=True)[2]) == [77, 88]
    c.clear("emb")
    assert len(c.export("emb")[0]) == 0
    # insert_and_evict on a full custom table.
    c.create_table("ev", dim=2, capacity=256, policy="custom")
    k = np.arange(1, 2001, dtype=np.uint64)
    s, ev = c.insert_and_evict("ev", k, rows(k, 2), scores=k % 50)
    assert len(ev.keys) == s.evicted + s.rejected and ev.values.shape == (len(ev.keys), 2)
    c.create_table("ep", dim=1, capacity=256, policy="epoch-lfu", max_capacity=1024)
    c.set_epoch("ep", 9)
    c.insert_or_assign("ep", [5], [[1.0]], scores=[3])
    assert c.find("ep", [5], scores=True)[2][0] == (9 << 32) | 3
    c.reserve("ep", 1024)
    assert [t for t in c.tables() if t["spec"]["name"] == "ep"][0]["capacity"] == 1024
    st = c.stats()
    assert st["shards"] == 2 and "checkpoint" in st
    assert "hkvd_up 1" in c.metrics()
    c.flush("ep")  # no cluster behind it: nothing queued, answered at once
    c.drop_table("ev")
    assert "ev" not in [t["spec"]["name"] for t in c.tables()]


def test_errors_are_typed_and_carry_the_daemons_message(daemon):
    c = daemon.client()
    c.create_table("t", dim=4, capacity=4096)
    c.create_table("cus", dim=4, capacity=4096, policy="custom")
    with pytest.raises(hkvd.UnknownTable) as e:
        c.find("nope", [1])
    assert e.value.code == "unknown_table" and "nope" in e.value.message
    with pytest.raises(hkvd.WrongDim) as e:
        c.send_write(0x12, "t", [1, 2], np.zeros(7, np.float32))
        c.result(c._next - 1)
    assert "dim 4" in e.value.message
    with pytest.raises(hkvd.ReservedKey):
        c.insert_or_assign("t", np.array([1, 2**64 - 1], np.uint64), np.zeros((2, 4), np.float32))
    with pytest.raises(hkvd.LengthMismatch):
        c.insert_or_assign("cus", [1, 2], np.zeros((2, 4), np.float32), scores=[1])
    with pytest.raises(hkvd.ScoresError):
        c.insert_or_assign("cus", [1], np.zeros((1, 4), np.float32))
    with pytest.raises(hkvd.TableExists):
        c.create_table("t", dim=4, capacity=4096)
    assert isinstance(hkvd.Forbidden("forbidden", "x"), hkvd.HkvdError)
    # The connection still works after every error.
    c.insert_or_assign("t", [1], np.ones((1, 4), np.float32))
    assert c.find("t", [1])[1][0]
    with pytest.raises(ConnectionError):
        hkvd.Client(socket=daemon.socket + ".missing")


def test_large_batches_of_a_million_keys(daemon):
    c = daemon.client()
    c.create_table("big", dim=8, capacity=1 << 22)
    keys = np.arange(1 << 20, dtype=np.uint64) * 3 + 1
    v = np.random.default_rng(1).random((1 << 20, 8), dtype=np.float32)
    s = c.insert_or_assign("big", keys, v)
    assert s.inserted + s.evicted == 1 << 20
    got, found = c.find("big", keys)
    np.testing.assert_array_equal(got[found], v[found])
    assert found.sum() == c.tables()[0]["size"]
    # Into a caller's array: the same array back, filled, then refilled.
    out = np.full((1 << 20, 8), 7.0, np.float32)
    got2, found2 = c.find("big", keys, out=out)
    assert got2 is out and (found2 == found).all()
    np.testing.assert_array_equal(out, got)
    half = keys[: 1 << 19] + 1  # keys never inserted: rows of zeros
    got3, found3 = c.find("big", half, out=out[: 1 << 19])
    assert not found3.any() and (got3 == 0).all() and (out[1 << 19 :] == got[1 << 19 :]).all()
    with pytest.raises(ValueError, match="float32 of shape"):
        c.find("big", keys[:4], out=np.zeros((4, 7), np.float32))


def test_concurrent_clients_and_pipelining(daemon):
    daemon.client().create_table("t", dim=4, capacity=1 << 20)
    errors = []

    def work(w):
        try:
            with daemon.client() as c:
                sets = [np.arange(500, dtype=np.uint64) + (w << 40) + (j << 20) for j in range(8)]
                ids = [c.send_write(0x12, "t", k, rows(k, 4, w)) for k in sets]
                for i in ids:
                    assert c.result(i)["summary"].inserted == 500
                ids = [c.send_find("t", k) for k in sets]
                for k, i in reversed(list(zip(sets, ids))):  # collect out of order
                    values, found, _ = c.result(i)
                    assert found.all()
                    np.testing.assert_array_equal(values, rows(k, 4, w))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert daemon.client().tables()[0]["size"] == 8 * 8 * 500


def test_one_client_shared_by_threads(daemon):
    """Threads sharing one Client: each gets its own answers (frames were
    interleaved on the socket, answers read before their request was
    pending, and calls hung: an independent tester's finding)."""
    c = daemon.client()
    c.create_table("shared", dim=4, capacity=1 << 20)
    errors = []

    def work(w):
        try:
            for j in range(40):
                k = np.arange(300, dtype=np.uint64) + (w << 40) + (j << 20)
                assert c.insert_or_assign("shared", k, rows(k, 4, w)).inserted == 300
                i = c.send_find("shared", k)
                values, found, _ = c.result(i)
                assert found.all()
                np.testing.assert_array_equal(values, rows(k, 4, w))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert c.tables()[0]["size"] == 4 * 40 * 300


def test_checkpoint_and_restore(daemon, tmp_path):
    c = daemon.client()
    c.create_table("t", dim=2, capacity=4096, policy="custom")
    c.insert_or_assign("t", [1, 2, 3], np.ones((3, 2), np.float32), scores=[5, 6, 7])
    listing = c.checkpoint(wait=True)
    assert listing["entries"] == 3 and listing["status"] == "complete"
    assert c.checkpoints()[0]["id"] == listing["id"]
    c.clear("t")
    r = c.restore(listing["id"])
    assert r["tables"] == [["t", 3]]
    assert list(c.find("t", [1, 2, 3], scores=True)[2]) == [5, 6, 7]


def test_restoring_a_corrupt_checkpoint_raises_corrupt_checkpoint(daemon, tmp_path):
    # Issue 32: restoring a checkpoint whose chunk is corrupt answered
    # `internal`; it is `corrupt_checkpoint` now, hkvd.CorruptCheckpoint here.
    c = daemon.client()
    c.create_table("t", dim=2, capacity=4096, policy="custom")
    c.insert_or_assign("t", [1, 2, 3], np.ones((3, 2), np.float32), scores=[5, 6, 7])
    listing = c.checkpoint(wait=True)
    d = tmp_path / "state" / "checkpoints" / "chunks" / listing["id"]
    # A data file: not the MANIFEST, nor the VERIFIED / CORRUPT marks.
    chunk = sorted(p for p in d.iterdir() if p.name not in ("MANIFEST", "VERIFIED", "CORRUPT"))[0]
    b = bytearray(chunk.read_bytes())
    b[len(b) // 2] ^= 0x10
    chunk.write_bytes(bytes(b))
    with pytest.raises(hkvd.CorruptCheckpoint) as e:
        c.restore(listing["id"])
    assert e.value.code == "corrupt_checkpoint" and chunk.name in e.value.message


def test_torch_helper(daemon):
    torch = pytest.importorskip("torch")
    from hkvd.torch import EmbeddingCache

    c = daemon.client()
    c.create_table("emb", dim=3, capacity=4096)
    cache = EmbeddingCache(c, "emb")
    ids = torch.tensor([1, 2, 3])
    first = cache.lookup(ids)
    assert first.shape == (3, 3) and float(first.abs().sum()) == 0.0
    cache.write_back(ids, first + torch.tensor([1.0, 2.0, 3.0]))
    again = cache.lookup(ids)
    assert torch.equal(again[:, 1], torch.full((3,), 2.0))


def test_find_with_origins_says_where_each_key_came_from(daemon, redis_cluster, tmp_path):
    # Issue 34: a backed table's answer says per key whether the cache had
    # it, the cluster had it, or neither; a table without a cluster gives
    # no origins (its answers are as before).
    from conftest import Daemon

    (tmp_path / "b").mkdir()
    other = Daemon(tmp_path / "b")
    try:
        a, b = daemon.client(), other.client()
        a.create_table("e", dim=2, capacity=4096, backing=redis_cluster.seeds(), backing_mode="write-through")
        b.create_table("e", dim=2, capacity=4096, backing=redis_cluster.seeds())
        a.insert_or_assign("e", [1, 2], np.array([[1, 2], [3, 4]], np.float32))
        # B hears A's write first: its invalidation, arriving after B
        # filled the keys, would erase them again (B cannot tell that the
        # write came first), and the second read below would fetch again.
        def heard():
            table = next(t for t in b.stats()["tables"] if t["spec"]["name"] == "e")
            return table["backing"]["invalidations"]

        deadline = time.monotonic() + 10
        while heard() < 2:
            assert time.monotonic() < deadline, "B did not hear A's write"
            time.sleep(0.01)
        values, found, origins = b.find_with_origins("e", [1, 2, 99])
        assert found.tolist() == [True, True, False]
        assert origins.tolist() == [hkvd.ORIGIN_FILLED, hkvd.ORIGIN_FILLED, hkvd.ORIGIN_ABSENT]
        assert values.tolist() == [[1, 2], [3, 4], [0, 0]]
        _, found, origins = b.find_with_origins("e", [2, 1, 99])
        assert origins.tolist() == [hkvd.ORIGIN_HIT, hkvd.ORIGIN_HIT, hkvd.ORIGIN_ABSENT]
        found, origins = b.contains_with_origins("e", [1, 98])
        assert found.tolist() == [True, False] and origins.tolist() == [hkvd.ORIGIN_HIT, hkvd.ORIGIN_ABSENT]
        b.create_table("plain", dim=2, capacity=1024)
        b.insert_or_assign("plain", [5], np.ones((1, 2), np.float32))
        _, found, origins = b.find_with_origins("plain", [5, 6])
        assert found.tolist() == [True, False] and origins is None
    finally:
        other.stop()


def test_keys_that_are_not_integers_are_refused(daemon):
    """Float keys would be truncated (7.9 read as key 7, ids above 2**53
    rounded) and strings parsed: the client refuses them, naming the dtype;
    int64 keys are the uint64 keys of the same bits."""
    c = daemon.client()
    c.create_table("ints", dim=2, capacity=1024)
    c.insert_or_assign("ints", np.array([7, -5], dtype=np.int64), np.ones((2, 2), np.float32))
    for bad in (np.array([7.9]), np.array([7.0], np.float32), np.array(["7"]), [True]):
        with pytest.raises(TypeError, match="keys must be integers"):
            c.find("ints", bad)
    _, found = c.find("ints", np.array([7, 2**64 - 5], dtype=np.uint64))
    assert found.tolist() == [True, True]
    assert c.find("ints", [])[1].size == 0
    # A list of numpy uint64 and Python ints (which numpy makes float64) is taken as integers.
    assert c.find("ints", [np.uint64(7), 5])[1].tolist() == [True, False]
    c.close()


def test_a_table_made_again_with_another_dim_leaves_the_client_usable(daemon):
    """A client that learned a table's dim, then finds in it after another
    client made it again with another dim, is told so once (the daemon
    refuses the first request of a connection on a table dropped and
    created again since it used it: not a broken connection, nor rows
    read with the old dim), and its next requests work with the new
    dim."""
    c, c2 = daemon.client(), daemon.client()
    c.create_table("redim", dim=4, capacity=1024)
    c.find("redim", np.array([1], np.uint64))
    c2.drop_table("redim")
    c2.create_table("redim", dim=8, capacity=1024)
    c2.insert_or_assign("redim", np.array([1], np.uint64), np.ones((1, 8), np.float32))
    with pytest.raises(hkvd.UnknownTable, match="dropped and created again since this connection last used it"):
        c.find("redim", np.array([1], np.uint64))
    c.ping()
    v, found = c.find("redim", np.array([1], np.uint64))
    assert found.tolist() == [True] and v.shape == (1, 8)
    c.close()
    c2.close()


def test_a_client_past_the_connection_limit_is_told_busy(tmp_path):
    # The daemon's `busy` carries id 0 (a connection-level error): the
    # client raised "hkvd closed the connection" instead of Busy, waiting
    # for an answer with its own request's id.
    from conftest import Daemon
    d = Daemon(tmp_path, "--max-connections", "1")

    def take():
        # The slot, once the daemon saw the fixture's start-up connection go.
        deadline = time.time() + 10
        while True:
            c = d.client()
            try:
                c.ping()
                return c
            except hkvd.Busy:
                c.close()
                if time.time() > deadline:
                    raise
                time.sleep(0.02)

    try:
        with take() as held:
            for i in range(20):
                with pytest.raises(hkvd.Busy, match="limits.max_connections"):
                    with d.client() as c:
                        if i % 10 == 9:
                            # Sent after the daemon closed (past its 250 ms).
                            time.sleep(0.4)
                        c.ping()
            held.ping()
    finally:
        d.stop()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_request_to_a_daemon_that_stopped_raises_connection_lost(tmp_path, stop):
    # A request on a connection the daemon closed (stopped, drained after
    # SIGTERM, or killed) raised a raw BrokenPipeError, missed by callers
    # catching HkvdError.
    from conftest import Daemon
    d = Daemon(tmp_path)
    try:
        c = d.client()
        c.create_table("t", dim=2, capacity=1024)
        d.proc.send_signal(getattr(signal, stop))
        d.proc.wait(timeout=30)
        for _ in range(2):  # and again: the client stays closed, not confused
            with pytest.raises(hkvd.ConnectionLost, match="closed the connection.*did it stop or restart") as e:
                c.find("t", [1, 2])
            assert isinstance(e.value, hkvd.HkvdError) and isinstance(e.value, ConnectionError)
            assert e.value.code == "connection_lost"
            assert isinstance(e.value.__cause__, OSError)
        c.close()
    finally:
        d.stop()


def test_a_request_after_close_raises_connection_lost(daemon):
    # A tester's request on a client after close() raised the socket's
    # OSError "Bad file descriptor", missed by callers catching HkvdError.
    c = daemon.client()
    c.create_table("t", dim=2, capacity=1024)
    keys = hkvd.shm_array((2,), np.uint64)
    values = hkvd.shm_array((2, 2), np.float32)
    c.find_region("t", keys, values)  # a region, unregistered by close()
    c.close()
    for call in (c.ping, lambda: c.find("t", [1]), lambda: c.find_region("t", keys, values)):
        with pytest.raises(hkvd.ConnectionLost) as e:
            call()
        assert e.value.code == "connection_lost" and not c.lost
    c.close()  # again: no error
    assert daemon.client().stats()["regions"]["regions"] == 0


def stop(proc):
    """SIGSTOPs ``proc`` and returns once every thread of it is stopped.
    The signal is asynchronous: a request sent before each thread stopped
    could still be read, even answered (seen on the 2-core machine while
    others built: the find below was read, so the kill closed the socket
    cleanly instead of resetting it). Waits until /proc says so."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended
                pass
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.01)
    pytest.fail(f"hkvd {proc.pid} did not stop within 10 s of SIGSTOP")


def test_an_answer_cut_off_by_the_daemon_raises_connection_lost(tmp_path):
    """The same while receiving: a request the daemon never answers because
    it was killed (reset: it had not read the request), or because it
    closed the connection after reading part of a frame (end of stream)."""
    from conftest import Daemon
    d = Daemon(tmp_path, "--body-stall-seconds", "1")
    try:
        c = d.client()
        c.create_table("t", dim=2, capacity=1024)
        # A frame header promising a body that never comes: the daemon
        # closes the connection after --body-stall-seconds.
        rid = c._next
        c._next += 1
        c._sock.sendall(hkvd.HEADER.pack(hkvd.MAGIC, hkvd.VERSION, hkvd.OP_PING, 0, rid, 100))
        c._pending[rid] = hkvd._Pending(hkvd.OP_PING, 0, 0, 0)
        with pytest.raises(hkvd.ConnectionLost, match="closed the connection"):
            c.result(rid)
        c.close()
        c = hkvd.Client(d.socket, timeout=30)  # a failure here fails, not hangs
        c.dim("t")  # learned while the daemon runs: send_find then sends at once
        stop(d.proc)
        rid = c.send_find("t", [1, 2])
        d.proc.kill()
        d.proc.wait(timeout=30)
        with pytest.raises(hkvd.ConnectionLost, match="did it stop or restart") as e:
            c.result(rid)
        assert isinstance(e.value.__cause__, ConnectionResetError)
        c.close()
    finally:
        d.proc.kill()  # stopped or not
        d.proc.wait(timeout=30)


def test_a_timeout_stays_a_timeout(tmp_path):
    """``Client(timeout=S)``: a daemon that does not answer within S seconds
    (here stopped, not gone) raises socket.timeout, not ConnectionLost."""
    from conftest import Daemon
    d = Daemon(tmp_path)
    try:
        c = hkvd.Client(d.socket, timeout=0.3)
        c.ping()
        stop(d.proc)
        with pytest.raises(socket.timeout) as e:
            c.ping()
        assert not isinstance(e.value, hkvd.HkvdError)
        c.close()
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)


def test_integer_arguments_out_of_range_raise_value_error(daemon):
    """Integers the client packs into fixed-width fields: out of range they
    raised struct.error; now a ValueError naming the argument and its
    range, before anything is sent."""
    c = daemon.client()
    c.create_table("ep", dim=2, capacity=1024, policy="epoch-lfu", max_capacity=4096)
    c.create_table("opt", dim=2, capacity=1024, optimizer="sgd")
    u32, u64 = "0 to 4294967295", "0 to 18446744073709551615"
    bad = [
        (lambda: c.set_epoch("ep", -1), f"epoch must be {u32}, not -1"),
        (lambda: c.set_epoch("ep", 2**32), f"epoch must be {u32}, not 4294967296"),
        (lambda: c.reserve("ep", 2**64), f"capacity must be {u64}, not 18446744073709551616"),
        (lambda: c.reserve("ep", -1), f"capacity must be {u64}, not -1"),
        (lambda: c.erase_if("ep", key_mask=-1), f"key_mask must be {u64}"),
        (lambda: c.erase_if("ep", key_pattern=2**64), f"key_pattern must be {u64}"),
        (lambda: c.erase_if("ep", min_score=-5), f"min_score must be {u64}, not -5"),
        (lambda: c.erase_if("ep", max_score=2**64), f"max_score must be {u64}"),
        (lambda: c.export("ep", chunk_slots=-1), f"chunk_slots must be {u64}"),
        (lambda: c.export("ep", min_score=-1), f"min_score must be {u64}"),
        (lambda: c.hash(["a"], num_buckets=2**64), f"num_buckets must be {u64}"),
        (lambda: c.hash(["a"], num_buckets=10, kind="strong", key=(-1, 0)), f"key\\[0\\] must be {u64}"),
        (lambda: c.find_features("ep", ["a"], num_buckets=10, key=(0, 2**64)), f"key\\[1\\] must be {u64}"),
        (lambda: c.apply_gradients("opt", [1], np.zeros((1, 2), np.float32), lr=0.1, step=-1),
         f"step must be {u64}, not -1"),
        (lambda: c.unregister(-1), f"region must be {u32}, not -1"),
        (lambda: c.clear("x" * 65536), "table name must be at most 65535 bytes"),
    ]
    keys = hkvd.shm_array((4,), np.uint64)
    values = hkvd.shm_array((4, 2), np.float32)
    scores = hkvd.shm_array((4,), np.uint64)
    bad += [
        (lambda: c.export_region("ep", keys, values, scores, cursor=(-1, 0)), f"cursor\\[0\\] .* must be {u32}"),
        (lambda: c.export_region("ep", keys, values, scores, cursor=(0, 2**64)), f"cursor\\[1\\] .* must be {u64}"),
        (lambda: c.export_region("ep", keys, values, scores, max_slots=-1), f"max_slots must be {u64}"),
        (lambda: c.export_region("ep", keys, values, scores, key_mask=2**64), f"key_mask must be {u64}"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
    with pytest.raises(TypeError, match="epoch must be an integer, not float"):
        c.set_epoch("ep", 1.5)
    # Nothing was sent: the connection is in step, and the ends of each range work.
    c.set_epoch("ep", 2**32 - 1)
    c.set_epoch("ep", np.uint32(0))
    c.reserve("ep", 4096)
    assert c.erase_if("ep", key_mask=2**64 - 1, min_score=0, max_score=2**64 - 1) == 0
    c.close()


def test_reads_refresh_takes_a_bool_or_none(daemon):
    """An independent tester's finding: reads_refresh="false" made a table
    whose reads refresh (any truthy value was sent as True)."""
    c = daemon.client()
    for bad in ("false", "yes", 1, 0):
        with pytest.raises(ValueError, match="reads_refresh must be True, False or None"):
            c.create_table("rr", dim=2, capacity=1024, policy="adaptive", reads_refresh=bad)
    assert "rr" not in [t["spec"]["name"] for t in c.tables()]
    info = c.create_table("rr", dim=2, capacity=1024, policy="adaptive", reads_refresh=False)
    assert info["spec"]["reads_refresh"] is False
    # Left to the policy's default, the listing still says which it is.
    c.create_table("rr_a", dim=2, capacity=1024, policy="adaptive")
    c.create_table("rr_l", dim=2, capacity=1024, policy="lru")
    listed = {t["spec"]["name"]: t["spec"]["reads_refresh"] for t in c.tables()}
    assert (listed["rr"], listed["rr_a"], listed["rr_l"]) == (False, True, False), listed
    c.close()


def test_create_table_backing_options_are_checked_before_sending(daemon):
    c = daemon.client()
    with pytest.raises(ValueError, match="backing_deadline_ms needs backing="):
        c.create_table("b1", dim=4, capacity=1024, backing_deadline_ms=100)
    with pytest.raises(ValueError, match="write-back table's queue; this table is read-only"):
        c.create_table("b2", dim=4, capacity=1024, backing="127.0.0.1:1", backing_queue_bytes=1 << 20)
    info = c.create_table("g", dim=4, capacity=1024, max_capacity=4096, max_load_factor=0.75)
    assert info["spec"]["max_load_factor"] == 0.75
    assert "b1" not in [t["spec"]["name"] for t in c.tables()]


def test_backing_mode_needs_backing_and_a_known_name(daemon):
    """An independent tester's finding: backing_mode without backing= (even
    backing_mode="bogus") made an unbacked table, where its sibling keywords
    and hkvctl's --backing-mode refuse the same call."""
    c = daemon.client()
    for mode in ("write-back", "write-through", "read-only"):
        with pytest.raises(ValueError, match="backing_mode needs backing="):
            c.create_table("pz3", dim=4, capacity=1024, backing_mode=mode)
    for backing in (None, "127.0.0.1:1"):
        with pytest.raises(ValueError, match="backing_mode must be one of read-only, write-through, write-back"):
            c.create_table("pz3", dim=4, capacity=1024, backing=backing, backing_mode="bogus")
    # Nothing was sent: no table was made, and the connection is in step.
    assert "pz3" not in [t["spec"]["name"] for t in c.tables()]
    info = c.create_table("pz3", dim=4, capacity=1024)
    assert info["spec"].get("backing") is None
    c.close()


def test_create_table_arguments_of_a_wrong_type_raise_type_error_naming_them(daemon):
    """An independent tester's finding: backing=b"127.0.0.1:23001" or
    backing=[1, 2] raised AttributeError ('int' object has no attribute
    'strip') from inside create_table, where the docs promise an error
    naming the argument. Each argument's type is checked before sending: a
    wrong type is a TypeError naming it (also a ValueError, which the
    integers and reads_refresh raised before), a wrong value a ValueError."""
    c = daemon.client()
    base = dict(name="t", dim=4, capacity=1024)
    wrong = [
        ("name", b"t"), ("name", None),
        ("dim", "4"), ("dim", 4.0), ("dim", None), ("dim", True), ("capacity", [1024]),
        ("max_capacity", None), ("max_capacity", 1.5), ("fast_tier_bytes", "1"), ("num_buckets", 10.0),
        ("policy", None), ("policy", b"lru"), ("mode", 2), ("hash_kind", None), ("hash_key", 5),
        ("hash_key", (0, "1")), ("lfu_ties", 1), ("optimizer", b"sgd"), ("reads_refresh", "false"),
        ("backing", b"127.0.0.1:23001"), ("backing", [1, 2]), ("backing", ["127.0.0.1:1", b"127.0.0.1:2"]),
        ("backing", 23001), ("backing_mode", b"write-back"), ("backing_wait_replicas", "1"),
        ("backing_deadline_ms", 1.5), ("backing_queue_bytes", "1M"), ("max_load_factor", "0.5"),
        ("max_load_factor", True),
    ]
    for what, v in wrong:
        args = dict(base, **{what: v})
        if what.startswith("backing_"):
            args["backing"] = "127.0.0.1:1"
        if what == "hash_key":
            args["num_buckets"] = 10
        with pytest.raises(TypeError, match=f"^{what}") as e:
            c.create_table(**args)
        assert isinstance(e.value, ValueError), (what, v)
    for what, v in [("dim", -1), ("capacity", 2**64), ("backing_deadline_ms", -5), ("hash_key", (0, -1))]:
        args = dict(base, **{what: v})
        if what.startswith("backing_"):
            args["backing"] = "127.0.0.1:1"
        with pytest.raises(ValueError, match=f"^{what}") as e:
            c.create_table(**args)
        assert not isinstance(e.value, TypeError), (what, v)
    # Nothing was sent: no table was made, and the connection is in step.
    assert c.tables() == []
    # numpy scalars are integers and floats too.
    info = c.create_table("t", dim=np.int64(4), capacity=np.uint32(1024), max_capacity=np.int64(4096),
                          max_load_factor=np.float32(0.75), hash_key=(np.uint64(0), 0), num_buckets=np.int64(10))
    assert (info["spec"]["dim"], info["spec"]["max_load_factor"]) == (4, 0.75)
    c.close()


def test_max_load_factor_must_be_finite(daemon):
    """An independent tester's finding: max_load_factor=float('inf') came
    back as the daemon's "create_table body: expected value at line 1
    column 144" (JSON has no inf or nan; json.dumps wrote Infinity)."""
    c = daemon.client()
    for v in (float("inf"), float("-inf"), float("nan"), np.float32("nan"), np.inf):
        with pytest.raises(ValueError, match="^max_load_factor must be a finite number"):
            c.create_table("g", dim=4, capacity=1024, max_capacity=4096, max_load_factor=v)
    # Nothing was sent: no table was made, and the connection is in step.
    assert c.tables() == []
    info = c.create_table("g", dim=4, capacity=1024, max_capacity=4096, max_load_factor=1)
    assert info["spec"]["max_load_factor"] == 1
    c.close()


def test_summary_counts_each_key_once_and_totals_the_inserted(daemon):
    """An independent tester's finding: an insert_or_assign whose key took
    another entry's slot reads "1 inserted (1 of them by evicting another
    entry)" in hkvctl but Summary(inserted=0, evicted=1) here, and a user
    summing ``inserted`` undercounted. The fields keep their meaning (one
    outcome per key); ``inserted_total`` is what hkvctl calls inserted."""
    c = daemon.client()
    c.create_table("full", dim=2, capacity=256, policy="custom")
    k = np.arange(1, 2001, dtype=np.uint64)
    s = c.insert_or_assign("full", k, rows(k, 2), scores=np.full(len(k), 10, np.uint64))
    assert s.inserted == 256 and s.inserted_total == s.inserted + s.evicted
    assert s.updated + s.inserted + s.evicted + s.rejected + s.absent == len(k)
    assert c.tables()[0]["size"] == 256  # full: a newcomer now evicts or is rejected
    s = c.insert_or_assign("full", [10**9], rows([10**9], 2), scores=[1000])
    assert (s.inserted, s.evicted, s.inserted_total) == (0, 1, 1)
    assert c.find("full", [10**9])[1].all()
    s = c.insert_or_assign("full", [10**9 + 1, 10**9], rows([1, 2], 2), scores=[1, 1000])
    assert (s.inserted_total, s.rejected, s.updated) == (0, 1, 1)
    c.close()


def test_reads_refresh_defaults_on_for_a_backed_table(daemon, redis_cluster):
    """An independent tester's finding: create_table's docstring said
    reads_refresh (None) is on for every backed table on the CPU backend,
    docs/tables.md and docs/cli.md on for adaptive only. A backed table
    left to the default refreshes (issue 34; router::build_table, on both
    backends), except a custom one, whose scores are the caller's; an
    explicit False is kept. The docs say so."""
    c = daemon.client()
    seeds = redis_cluster.seeds()
    c.create_table("backed", dim=2, capacity=1024, backing=seeds)
    c.create_table("backed_off", dim=2, capacity=1024, backing=seeds, reads_refresh=False)
    c.create_table("backed_custom", dim=2, capacity=1024, backing=seeds, policy="custom")
    c.create_table("plain", dim=2, capacity=1024)
    listed = {t["spec"]["name"]: t["spec"]["reads_refresh"] for t in c.tables()}
    want = {"backed": True, "backed_off": False, "backed_custom": False, "plain": False}
    assert listed == want, listed
    # On: a find hit gets the score a write would (lru: the clock, later).
    c.insert_or_assign("backed", [7], [[1.0, 2.0]])
    first = c.find("backed", [7], scores=True)[2][0]
    assert c.find("backed", [7], scores=True)[2][0] > first
    c.close()


def test_an_answer_read_twice_raises_instead_of_waiting(daemon):
    """hkvd.torch read a refused prefetch's answer a second time (its
    lookup stayed pending after the first read raised), and result()
    waited for an answer that never comes: the training loop hung. A
    request id whose answer was read already, or that was never sent,
    now raises at once."""
    c = hkvd.Client(daemon.socket, timeout=10)
    c.create_table("twice", dim=2, capacity=64)
    rid = c.send_find("twice", [1, 2])
    assert c.result(rid)[1].tolist() == [False, False]
    with pytest.raises(RuntimeError, match="no answer to come"):
        c.result(rid)
    with pytest.raises(RuntimeError, match="no answer to come"):
        c.result(rid + 1000)
    bad = c.send_find("twice", [2**64 - 1])
    with pytest.raises(hkvd.ReservedKey):
        c.result(bad)
    with pytest.raises(RuntimeError, match="no answer to come"):
        c.result(bad)
    assert c.find("twice", [1])[1].tolist() == [False]  # the connection is in step
    c.close()


@pytest.mark.parametrize("opt", ["adam", "sgd", "adagrad"])
def test_apply_gradients_checks_adams_step_from_one(daemon, opt):
    """A tester's apply_gradients(step=-1) was told "step must be 0 to
    2**64 - 1", and step 0 then went to the daemon, which refuses it on
    an Adam table (its bias correction divides by zero). On an Adam table
    step is now checked from 1 before sending, over the socket and
    registered memory alike, with one message; other optimizers keep 0."""
    c = daemon.client()
    name = f"st_{opt}"
    c.create_table(name, dim=2, capacity=64, optimizer=opt)
    c.insert_or_assign(name, [1], np.zeros((1, c.dim(name)), np.float32))
    keys = hkvd.shm_array((1,), np.uint64)
    keys[:] = 1
    grads = hkvd.shm_array((1, 2), np.float32)
    grads[:] = 1.0
    lowest = 1 if opt == "adam" else 0
    for step in (-1, 0):
        if step >= lowest:
            continue
        with pytest.raises(ValueError, match=f"step must be {lowest} to {2**64 - 1}"):
            c.apply_gradients(name, [1], np.ones((1, 2), np.float32), lr=0.1, step=step)
        with pytest.raises(ValueError, match=f"step must be {lowest} to {2**64 - 1}"):
            c.apply_gradients_region(name, keys, grads, lr=0.1, step=step)
    assert not c.find(name, [1])[0].any(), "nothing was sent"
    assert c.apply_gradients(name, [1], np.ones((1, 2), np.float32), lr=0.1, step=lowest) == 0
    c.close()
