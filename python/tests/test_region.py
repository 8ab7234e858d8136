"""The region request builder: exact bytes against PROTOCOL.md (EVENTS
included), every keyed op through shm arrays against the socket's answers,
clear errors for memory that is neither shm nor CUDA, and the CUDA
registration path (with libcuda replaced by stand-ins) falling back with
CudaIpcUnavailable on a daemon that serves no GPU."""

import struct

import numpy as np
import pytest

import hkvd
from hkvd import cuda, region


def hx(s: str) -> bytes:
    return bytes.fromhex(" ".join(line.split("|")[0] for line in s.strip().splitlines()))


# PROTOCOL.md, "Worked example" of Registered regions: find with REGION on
# table emb, id 2; keys: 2 at offset 0, found: 2 at offset 16, values: 4 at offset 32.
WORKED_FIND = hx("""
48 4b 56 44 01 10 10 00 02 00 00 00 00 00 00 00 41 00 00 00 |
03 00 65 6d 62
01 00 00 00 00 00 00 00 00 00 00 00 02 00 00 00 00 00 00 00
01 00 00 00 10 00 00 00 00 00 00 00 02 00 00 00 00 00 00 00
01 00 00 00 20 00 00 00 00 00 00 00 04 00 00 00 00 00 00 00
""")


def test_region_request_bytes_match_the_protocol():
    refs = [(1, 0, 2), (1, 16, 2), (1, 32, 4)]
    assert region.encode_request(region.OP_FIND, 2, "emb", refs) == WORKED_FIND
    # EVENTS (0x0020): flags 0x0030, the body ends with u32 wait_event, u32 done_event.
    f = region.encode_request(region.OP_FIND, 2, "emb", refs, events=(3, 4))
    want = bytearray(WORKED_FIND)
    want[6:8] = (0x30).to_bytes(2, "little")
    want[16:20] = (0x41 + 8).to_bytes(4, "little")
    want += bytes.fromhex("03000000 04000000")
    assert f == bytes(want)
    # SCORES | OUTCOMES with insert_or_assign: keys, values, scores, outcomes.
    f = region.encode_request(region.OP_INSERT_OR_ASSIGN, 7, "t", [(2, 8, 1), (2, 16, 4), (3, 0, 1), (3, 8, 1)],
                              scores=True, outcomes=True, events=(0, 9))
    head = struct.pack("<4sBBHQI", b"HKVD", 1, 0x12, 0x0002 | 0x0004 | 0x0010 | 0x0020, 7, 2 + 1 + 4 * 20 + 8)
    body = b"\x01\x00t" + b"".join(struct.pack("<IQQ", *r) for r in [(2, 8, 1), (2, 16, 4), (3, 0, 1), (3, 8, 1)])
    assert f == head + body + struct.pack("<II", 0, 9)


def test_slots_follow_the_protocol_table():
    names = lambda op, **kw: [s.name for s in region.slots(op, **kw)]  # noqa: E731
    assert names(region.OP_FIND) == ["keys", "found", "values"]
    assert names(region.OP_FIND, scores=True) == ["keys", "found", "values", "scores"]
    assert names(region.OP_CONTAINS) == ["keys", "found"]
    assert names(region.OP_ERASE, outcomes=True) == ["keys", "erased"]
    assert names(region.OP_INSERT_OR_ASSIGN, scores=True, outcomes=True) == ["keys", "values", "scores", "outcomes"]
    assert names(region.OP_ACCUM_OR_ASSIGN) == ["keys", "deltas"]
    assert names(region.OP_LOAD, scores=True, outcomes=True) == ["keys", "values", "scores"]


def test_register_cuda_bodies():
    uuid, handle = bytes(range(16)), bytes(range(100, 164))
    assert cuda.register_body(uuid, handle, 1 << 20) == uuid + handle + (1 << 20).to_bytes(8, "little")
    assert len(cuda.register_body(uuid, handle, 1 << 20)) == 88
    assert cuda.register_body(uuid, handle, None) == uuid + handle
    with pytest.raises(ValueError):
        cuda.register_body(uuid[:8], handle, 1)


class _Recorder:
    """A stand-in client that keeps the frame a region call sends."""

    def __init__(self, dim):
        self._dim = dim
        self.sent = []

    def dim(self, table):
        return self._dim

    def _here(self):
        pass  # always the process that "connected"

    def _call(self, op, flags, parts):
        self.sent.append((op, flags, b"".join(bytes(p) for p in parts)))
        return struct.pack("<5Q", 0, 2, 0, 0, 0)


class _Event(cuda.CudaEvent):
    """An event that needs no driver: records what was done to it."""

    def __init__(self, id_):  # noqa: D401 - no driver call
        self.id, self.device, self.done = id_, 0, []

    def record(self, stream=0):
        self.done.append(("record", stream))

    def wait(self, stream=0):
        self.done.append(("wait", stream))


def test_device_region_request_with_events():
    c = _Recorder(dim=4)
    keys = region.Ref(5, 4096, 2, (2,), np.dtype(np.int64), "cuda", 0, "cai")
    values = region.Ref(5, 8192, 8, (2, 4), np.dtype(np.float32), "cuda", 0, "cai")
    w, d = _Event(7), _Event(8)
    region.call(c, region.OP_FIND_OR_INSERT, "emb", [keys, values], stream=1234, wait=w, done=d)
    op, flags, body = c.sent[0]
    assert op == 0x14 and flags == 0x0030
    assert body == b"\x03\x00emb" + struct.pack("<IQQIQQII", 5, 4096, 2, 5, 8192, 8, 7, 8)
    # The client records the wait event on the stream; the caller waits for its own done event.
    assert w.done == [("record", 1234)] and d.done == []
    # A prefix of a preallocated buffer is named without the driver.
    assert values.head(1).wire() == (5, 8192, 4)


def test_request_checks_say_what_is_wrong():
    c = _Recorder(dim=4)
    keys = region.Ref(1, 0, 3, (3,), np.dtype(np.uint64), "cuda", 0, "cai")
    vals = lambda shape, dt=np.float32, where="cuda", dev=0: region.Ref(  # noqa: E731
        1, 64, int(np.prod(shape)), shape, np.dtype(dt), where, dev, "cai")
    with pytest.raises(TypeError, match="values must be float32, found float64"):
        region.call(c, region.OP_INSERT_OR_ASSIGN, "t", [keys, vals((3, 4), np.float64)])
    with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
        region.call(c, region.OP_INSERT_OR_ASSIGN, "t", [keys, vals((4, 3))])
    with pytest.raises(ValueError, match="all in hkvd.shm_array memory or all in CUDA memory"):
        region.call(c, region.OP_INSERT_OR_ASSIGN, "t", [keys, vals((3, 4), where="shm")])
    with pytest.raises(ValueError, match="on one GPU"):
        region.call(c, region.OP_INSERT_OR_ASSIGN, "t", [keys, vals((3, 4), dev=1)])
    with pytest.raises(TypeError, match="keys must be uint64 or int64, found float32"):
        region.call(c, region.OP_ERASE, "t", [vals((3, 4))])
    found = region.Ref(1, 0, 3, (3,), np.dtype(np.int32), "cuda", 0, "cai")
    with pytest.raises(TypeError, match="found must be uint8 or bool"):
        region.call(c, region.OP_CONTAINS, "t", [keys, found])
    assert c.sent == []


def test_every_keyed_op_through_shm_equals_the_socket(daemon):
    with daemon.client() as c:
        c.create_table("t", 4, 4096)
        n = 64
        keys = hkvd.shm_array((n,), np.int64)
        keys[:] = np.arange(1, n + 1)
        values = hkvd.shm_array((n, 4), np.float32)
        values[:] = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
        assert c.insert_or_assign_region("t", keys[:32], values[:32]).inserted == 32
        # find_or_insert: hits keep their rows, misses get the given ones.
        fi = hkvd.shm_array((n, 4), np.float32)
        fi[:] = -1.0
        s = c.find_or_insert_region("t", keys, fi)
        assert (s.updated, s.inserted) == (32, 32)
        assert np.array_equal(fi[:32], values[:32]) and (fi[32:] == -1).all()
        deltas = hkvd.shm_array((n, 4), np.float32)
        deltas[:] = 0.5
        c.accum_or_assign_region("t", keys, deltas)
        assert c.assign_region("t", keys[:2], values[:2]).updated == 2
        found = hkvd.shm_array((n,), np.bool_)
        out = hkvd.shm_array((n, 4), np.float32)
        assert c.find_region("t", keys, out, found) == n
        want, wfound = c.find("t", keys)
        assert np.array_equal(out, want) and found.all() and wfound.all()
        assert c.contains_region("t", keys, found) == n
        erased = hkvd.shm_array((n,), np.uint8)
        assert c.erase_region("t", keys[:10], erased[:10]) == 10
        assert erased[:10].all()
        assert c.contains_region("t", keys) == n - 10
        assert not c.contains("t", keys[:10]).any()
        # No keys: nothing is sent.
        assert c.find_region("t", keys[:0], out[:0]) == 0


def test_insert_and_evict_through_shm_writes_what_lost_its_slot(daemon):
    with daemon.client() as c:
        # Two shards of one bucket each, never grown: inserts past 256 keys
        # evict or are refused.
        c.create_table("full", 4, 256, max_capacity=256)
        n = 600
        keys = hkvd.shm_array((n,), np.uint64)
        keys[:] = np.arange(1, n + 1)
        values = hkvd.shm_array((n, 4), np.float32)
        values[:] = np.arange(1, n + 1, dtype=np.float32)[:, None]
        ek, es, kinds = (hkvd.shm_array((n,), t) for t in (np.uint64, np.uint64, np.uint8))
        ev = hkvd.shm_array((n, 4), np.float32)
        s, written = c.insert_and_evict_region("full", keys, values, ek, ev, es, kinds)
        assert written == s.evicted + s.rejected and written >= n - 256, (s, written)
        assert s.inserted + s.evicted + s.updated + s.rejected == n
        # What was evicted is gone; its rows are the ones it had.
        gone = ek[:written][kinds[:written] == 0]
        assert not c.contains("full", gone).any()
        assert np.array_equal(ev[:written][:, 0], ek[:written].astype(np.float32))
        with pytest.raises(ValueError, match="room for 10 entries"):
            c.insert_and_evict_region("full", keys[:20], values[:20], ek[:10], ev[:10], es[:10], kinds[:10])


def test_export_through_shm_walks_the_table(daemon):
    with daemon.client() as c:
        c.create_table("ex", 4, 4096)
        n = 1000
        keys = np.arange(1, n + 1, dtype=np.uint64)
        c.insert_or_assign("ex", keys, np.repeat(keys.astype(np.float32)[:, None], 4, axis=1))
        k, s = hkvd.shm_array((300,), np.uint64), hkvd.shm_array((300,), np.uint64)
        v = hkvd.shm_array((300, 4), np.float32)
        cursor, got = (0, 0), []
        while cursor is not None:
            cursor, count = c.export_region("ex", k, v, s, cursor)
            assert np.array_equal(v[:count, 0], k[:count].astype(np.float32))
            got.extend(k[:count].tolist())
        assert sorted(got) == keys.tolist()


def test_events_of_id_zero_on_host_regions_change_nothing(daemon):
    with daemon.client() as c:
        c.create_table("t", 4, 4096)
        keys = hkvd.shm_array((8,), np.uint64)
        keys[:] = np.arange(1, 9)
        c.insert_or_assign("t", keys[:5], np.ones((5, 4), np.float32))
        found = hkvd.shm_array((8,), np.uint8)
        out = hkvd.shm_array((8, 4), np.float32)
        k, f, v = c.region_ref(keys), c.region_ref(found), c.region_ref(out)
        body = region.encode_body("t", [k.wire(), f.wire(), v.wire()], events=(0, 0))
        try:
            answer = region.raw_call(c, region.OP_FIND, body, region.request_flags(events=True))
        except hkvd.BadRequest as e:
            if "unexpected bytes" in e.message:
                pytest.skip("this hkvd predates the EVENTS flag")
            raise
        assert struct.unpack("<Q", answer)[0] == 5
        assert found.tolist() == [1] * 5 + [0] * 3 and (out[:5] == 1).all()


def test_registering_what_is_not_cuda_memory_is_refused_clearly(daemon):
    class Fake:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<u8", "data": (0x7F0000000000, False),
                                    "version": 3, "strides": None}

    with daemon.client() as c:
        with pytest.raises(TypeError, match="__cuda_array_interface__"):
            c.register_cuda(np.zeros(4, np.uint64))
        with pytest.raises(TypeError, match="neither an hkvd.shm_array nor CUDA memory"):
            c.find_region("t", [1, 2], np.zeros((2, 4), np.float32))
        # An address CUDA does not know: no driver here (CudaIpcUnavailable),
        # or a driver that does not know it (ValueError).
        with pytest.raises((hkvd.CudaIpcUnavailable, ValueError), match="libcuda|not memory CUDA knows"):
            c.register_cuda(Fake())
        c.ping()


def test_a_daemon_without_gpus_refuses_device_memory_with_cuda_ipc_unavailable(daemon, monkeypatch):
    # libcuda replaced by stand-ins: an allocation at 0x1000_0000 of 1 MiB.
    monkeypatch.setattr(cuda, "pointer_info", lambda ptr: (cuda.CU_MEMORYTYPE_DEVICE, 77, 0))
    monkeypatch.setattr(cuda, "allocation", lambda ptr, ordinal: (0x1000_0000, 1 << 20, bytes(64)))
    monkeypatch.setattr(cuda, "device_uuid", lambda ordinal: bytes(range(16)))

    class Dev:
        __cuda_array_interface__ = {"shape": (8,), "typestr": "<i8", "data": (0x1000_0100, False), "version": 3}

    with daemon.client() as c:
        with pytest.raises(hkvd.CudaIpcUnavailable) as e:
            c.register_cuda(Dev())
        assert e.value.reason == "daemon"
        assert e.value.code in ("bad_request", "unknown_op")
        assert c._cuda_regions == {}
        c.ping()


def test_device_path_simulated_over_a_memfd(daemon, monkeypatch):
    # The client's whole device path (describe, allocation base and
    # offsets, one region per allocation, checks, the request) with libcuda
    # replaced by stand-ins and the "allocation" being an shm array, which
    # register_cuda registers as a memfd, so a CPU daemon can serve it.
    alloc = hkvd.shm_array((1 << 16,), np.uint8)
    base = alloc.__array_interface__["data"][0]
    calls = []
    monkeypatch.setattr(cuda, "pointer_info", lambda ptr: (
        (cuda.CU_MEMORYTYPE_DEVICE, 42, 0) if base <= ptr < base + alloc.nbytes else (0, 0, 0)))
    monkeypatch.setattr(cuda, "allocation", lambda ptr, ordinal: (base, alloc.nbytes, bytes(64)))
    monkeypatch.setattr(cuda, "device_uuid", lambda ordinal: bytes(16))
    monkeypatch.setattr(cuda, "synchronize", lambda stream, ordinal: calls.append(("sync", stream)))
    real_raw = region.raw_call

    def raw_call(client, op, body, flags=0):
        if op == cuda.OP_REGISTER_CUDA:
            assert body[16:80] == bytes(64) and struct.unpack("<Q", body[80:])[0] == alloc.nbytes
            calls.append("register")
            m, _ = hkvd.shm._memfd_of(alloc)
            return struct.pack("<IQ", hkvd.shm.register_memfd(client, m.fd, m.size), m.size)
        return real_raw(client, op, body, flags)

    monkeypatch.setattr(region, "raw_call", raw_call)

    class Dev:
        """A CUDA-array-interface view of bytes [offset, ...) of the allocation."""

        def __init__(self, offset, shape, typestr):
            self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (base + offset, False),
                                             "version": 3, "strides": None}
            self.np = np.frombuffer(alloc, dtype=typestr, count=int(np.prod(shape)), offset=offset).reshape(shape)

    with daemon.client() as c:
        c.create_table("t", 8, 4096)
        keys, values, found = Dev(4096, (100,), "<i8"), Dev(8192, (100, 8), "<f4"), Dev(16, (100,), "|u1")
        keys.np[:] = np.arange(1, 101)
        values.np[:] = np.arange(800, dtype=np.float32).reshape(100, 8)
        assert c.insert_or_assign_region("t", keys, values, wait=False, done=False).inserted == 100
        probe, out = Dev(32768, (150,), "<u8"), Dev(40960, (150, 8), "<f4")
        probe.np[:] = np.arange(51, 201)
        found = Dev(64, (150,), "|b1")
        assert c.find_region("t", probe, out, found, wait=False, done=False) == 50
        want, wfound = c.find("t", np.arange(51, 201, dtype=np.uint64))
        assert np.array_equal(out.np, want) and np.array_equal(found.np, wfound)
        assert calls.count("register") == 1 and len(c._cuda_regions) == 1
        assert calls.count(("sync", 0)) == 2  # wait=False: the (legacy default) stream synchronized
        # A Ref's head names a prefix with no driver call.
        r = c.region_ref(out)
        assert r.offset == 40960 and r.head(10).wire() == (r.region, 40960, 80)
        elsewhere = type("Elsewhere", (), {"__cuda_array_interface__": {
            "shape": (1,), "typestr": "<u8", "data": (8, False), "version": 3}})()
        with pytest.raises(ValueError, match="not memory CUDA knows"):
            c.register_cuda(elsewhere)
